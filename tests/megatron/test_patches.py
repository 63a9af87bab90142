"""The pretrain_gpt.py patches apply to the Megatron-LM commits they name (offline fixtures)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.helpers import FIXTURES, ROOT

PATCHES = sorted((ROOT / "patches").glob("pretrain_*-*.patch"))
MEGATRON_LM = FIXTURES / "megatron-lm"
GIT = shutil.which("git")
COMMIT_R019 = "f8837c04ef6cbef6cdefb8de001aad63178aebbf"
COMMIT_MAIN = "d98e8a64ddf34856e74b24714e3bedb2f5a39553"
# Megatron-LM dev's head when fetched (2026-08-21). Its scripts import megatron-core modules the
# 0.19.2 wheel does not have (context_parallel_layout, datasets.data_schedule), so the dev
# patches are checked to apply, reverse and compile, not run.
COMMIT_DEV = "d48bd6be0a85cc0d6d3cc71e8750cf357cc6bdb1"
SCRIPTS = ("pretrain_gpt", "pretrain_hybrid")


def commit_of(patch: Path) -> str:
    m = re.search(r"at commit ([0-9a-f]{40})", patch.read_text())
    assert m, f"{patch.name} must name its full Megatron-LM commit in its header"
    assert m.group(1).startswith(patch.stem.rsplit("-", 1)[-1]), "file name and header disagree"
    return m.group(1)


def script_of(patch: Path) -> str:
    return patch.name.split("-")[0]


def test_every_script_and_target_is_covered():
    """pretrain_gpt.py and pretrain_hybrid.py at main, core_r0.19.0 and dev (issue 18)."""
    covered = {(script_of(p), p.name.split("-")[1]) for p in PATCHES}
    assert covered == {(s, r) for s in SCRIPTS for r in ("main", "core_r0.19.0", "dev")}
    commits = {p.name.split("-")[1]: commit_of(p) for p in PATCHES}
    assert commits == {"main": COMMIT_MAIN, "core_r0.19.0": COMMIT_R019, "dev": COMMIT_DEV}


@pytest.mark.spawns
@pytest.mark.skipif(GIT is None, reason="git is not installed")
@pytest.mark.parametrize("patch", PATCHES, ids=lambda p: p.name)
def test_patch_applies_to_its_commit(patch, tmp_path):
    script = f"{script_of(patch)}.py"
    pristine = MEGATRON_LM / commit_of(patch) / f"{script}.upstream"
    shutil.copy(pristine, tmp_path / script)
    run = subprocess.run(
        [GIT, "apply", "--check", "-v", str(patch)], cwd=tmp_path, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr
    subprocess.run([GIT, "apply", str(patch)], cwd=tmp_path, check=True)
    patched = (tmp_path / script).read_text()
    compile(patched, script, "exec")  # still valid Python
    assert "hsp_extra_args_provider(" in patched and "hsp_install(" in patched
    # Reversible: the checkout can be restored with `git apply -R`.
    subprocess.run([GIT, "apply", "-R", str(patch)], cwd=tmp_path, check=True)
    assert (tmp_path / script).read_bytes() == pristine.read_bytes()


# A Megatron-LM "checkout" built from the fixtures: the script and its sibling modules
# (gpt_builders.py, model_provider.py) at each commit, with megatron/ (core and training) from the
# megatron-core wheel installed here. No network and no environment variable needed.
REFS = {"main": COMMIT_MAIN, "core_r0.19.0": COMMIT_R019}
SIBLINGS = ("pretrain_gpt", "gpt_builders", "model_provider")
HYBRID_SIBLINGS = ("pretrain_hybrid", "hybrid_builders", "model_provider")
# Megatron flags for a tiny CPU model (transformer-impl local: no Transformer Engine here).
TINY = [
    *("--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4"),
    *("--seq-length", "64", "--max-position-embeddings", "64", "--micro-batch-size", "1"),
    *("--global-batch-size", "4", "--eval-iters", "0", "--train-iters", "2", "--lr", "1e-3"),
    *("--attention-dropout", "0"),
    *("--tokenizer-type", "NullTokenizer", "--vocab-size", "128", "--transformer-impl", "local"),
    *("--data-path", "unused-prefix"),
    *("--hsp-cost-model", str(ROOT / "tests" / "fixtures" / "cost-model-tiny.yaml")),
]


def tiny_with_data(tmp_path: Path) -> list[str]:
    """``TINY`` with a real indexed dataset: install() checks the datasets' files at argument
    time (issue 18)."""
    from megatron_hsp.step.corpus import write_indexed_dataset

    write_indexed_dataset(tmp_path / "corpus", [np.arange(2, 9), np.arange(3, 40)])
    return [str(tmp_path / "corpus") if a == "unused-prefix" else a for a in TINY]


# Stands in for pretrain() alone (the training loop is what selftest --megatron runs); it has the
# wheel's parameter names, prints what the launcher and the patched script hand it, and returns.
STAND_IN_PRETRAIN = """
import sys
import megatron.training as mt
import megatron.training.training as t


def pretrain(cfg_container, train_valid_test_dataset_provider, model_type, forward_step_func,
             **kw):
    print("PRETRAIN", train_valid_test_dataset_provider.__module__,
          train_valid_test_dataset_provider.__name__, forward_step_func.__name__, flush=True)
    from megatron.training import get_args
    from megatron.core.transformer.spec_utils import import_module

    args = get_args()
    if getattr(args, "hybrid_layer_pattern", None):  # the spec the hybrid builder will get
        stack = import_module(args.spec).submodules
        for kind in ("attention_layer", "mlp_layer", "mamba_layer"):
            layer = getattr(stack, kind)
            attn = getattr(getattr(layer, "submodules", None), "self_attention", None)
            what = getattr(attn, "module", attn)
            print("HYBRID", kind, getattr(what, "__name__", type(what).__name__), flush=True)
    if getattr(args, "num_experts", None):  # MoE: the block spec, read once the groups exist
        import os
        import torch
        from megatron.core import parallel_state

        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", os.environ["HSP_TEST_PORT"])
        torch.distributed.init_process_group("gloo", rank=0, world_size=1)
        parallel_state.initialize_model_parallel()
        layers = import_module(args.spec).submodules.layer_specs
        for layer in layers:
            sub = layer.submodules
            router = sub.mlp.keywords["submodules"].router if hasattr(sub.mlp, "keywords") else (
                sub.mlp.submodules.router)
            print("MOE", sub.self_attention.module.__name__, router.__name__, flush=True)


t.pretrain = mt.pretrain = pretrain
sys.argv = sys.argv[1:]
if sys.argv[0] == "-m":
    from megatron_hsp.launch import main

    sys.exit(main(sys.argv[2:]))
import runpy

runpy.run_path(sys.argv[0], run_name="__main__")
"""


def checkout(ref: str, tmp_path: Path, patched: bool, script: str = "pretrain_gpt") -> Path:
    """The fixture files of ``ref`` as a script directory (patched or pristine)."""
    commit = REFS[ref]
    root = tmp_path / ref
    root.mkdir()
    for name in SIBLINGS if script == "pretrain_gpt" else HYBRID_SIBLINGS:
        shutil.copy(MEGATRON_LM / commit / f"{name}.py.upstream", root / f"{name}.py")
    if patched:
        (patch,) = [p for p in PATCHES if p.name.split("-")[1] == ref and script_of(p) == script]
        subprocess.run([GIT, "apply", str(patch)], cwd=root, check=True)
    return root


def run_script(
    argv: list[str], cwd: Path, script_dir: Path, **env_vars: str
) -> subprocess.CompletedProcess:
    env = dict(
        os.environ,
        PYTHONPATH=f"{ROOT}{os.pathsep}{script_dir}",
        RANK="0",
        WORLD_SIZE="1",
        LOCAL_WORLD_SIZE="1",
    )
    env.update(env_vars)
    return subprocess.run(
        [sys.executable, *argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )


def test_fixture_siblings_are_pristine_with_their_license_header():
    # Only what a test uses is kept: every script at every pinned commit (apply checks); the
    # sibling modules where the script runs (pretrain_gpt.py at main and core_r0.19.0,
    # pretrain_hybrid.py at core_r0.19.0).
    kept = {(c, s) for c in (*REFS.values(), COMMIT_DEV) for s in SCRIPTS}
    kept |= {(c, s) for c in REFS.values() for s in SIBLINGS}
    kept |= {(COMMIT_R019, s) for s in HYBRID_SIBLINGS}
    found = {(p.parent.name, p.name.removesuffix(".py.upstream")) for p in MEGATRON_LM.glob("*/*")}
    assert found == kept
    for commit, name in kept:
        text = (MEGATRON_LM / commit / f"{name}.py.upstream").read_text()
        assert "NVIDIA CORPORATION" in text.splitlines()[0], (commit, name)


@pytest.mark.spawns
@pytest.mark.slow
@pytest.mark.skipif(GIT is None, reason="git is not installed")
@pytest.mark.parametrize("ref", sorted(REFS))
def test_patched_script_parses_hsp_flags(ref, tmp_path):
    """The patched script builds Megatron's parser with the --hsp flags and exits through
    argparse. Upstream's own ``--help`` crashes on an unescaped ``%`` in a Megatron help string
    at both commits (see docs/integration.md), so an argparse error on a bad --hsp value is what
    proves the flags are wired in."""
    root = checkout(ref, tmp_path, patched=True)
    run = run_script(["pretrain_gpt.py", "--hsp", "--hsp-solver", "nope"], root, root)
    assert run.returncode == 2, run.stderr[-2000:]
    assert "argument --hsp-solver: invalid choice: 'nope'" in run.stderr


@pytest.mark.spawns
@pytest.mark.slow
@pytest.mark.parametrize("ref", sorted(REFS))
def test_launcher_runs_the_unchanged_script(ref, tmp_path):
    """``python -m megatron_hsp.launch pretrain_gpt.py ...`` adds the flags to the unchanged
    upstream script (same argparse check as above)."""
    root = checkout(ref, tmp_path, patched=False)
    argv = ["-m", "megatron_hsp.launch", str(root / "pretrain_gpt.py"), "--hsp"]
    run = run_script([*argv, "--hsp-solver", "nope"], tmp_path, root)
    assert run.returncode == 2, run.stderr[-2000:]
    assert "argument --hsp-solver: invalid choice: 'nope'" in run.stderr


@pytest.mark.spawns
@pytest.mark.slow
@pytest.mark.skipif(GIT is None, reason="git is not installed")
@pytest.mark.parametrize(
    ("ref", "patched", "launcher"),
    [
        (
            "main",
            True,
            True,
        ),  # launcher on an already-patched script ('module' not callable before)
        ("core_r0.19.0", True, True),
        ("core_r0.19.0", True, False),  # the patched script alone (the library call)
        ("main", False, True),  # launcher on the unchanged script
        ("main", False, "moe"),  # MoE: the block spec is built once the groups exist
    ],
)
def test_pretrain_gets_hsp_provider_and_forward_step(ref, patched, launcher, tmp_path):
    """Megatron's real argument parsing and validation, ``install`` and the builder's layer spec
    (``--spec`` -> layer_spec.py over gpt_builders) run; ``pretrain`` receives HSP's hooks.
    With MoE the stand-in creates the parallel groups, as ``pretrain()`` does, and reads the
    spec then: every layer has HSP attention and HSP's router (issue 32: the spec used to be
    built at import, before the groups, and failed)."""
    root = checkout(ref, tmp_path, patched=patched)
    (tmp_path / "stand_in.py").write_text(STAND_IN_PRETRAIN)
    script = str(root / "pretrain_gpt.py")
    entry = ["-m", "megatron_hsp.launch", script] if launcher else [script]
    tiny = tiny_with_data(tmp_path)
    if launcher == "moe":
        tiny += FLAG_SETS["moe"][0]
    run = run_script(
        [str(tmp_path / "stand_in.py"), *entry, *tiny, "--hsp"],
        tmp_path,
        root,
        HSP_TEST_PORT=str(free_port()),
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "PRETRAIN megatron_hsp.megatron.hooks hsp_datasets_provider hsp_forward_step" in (
        run.stdout
    ), run.stdout[-2000:]
    if launcher == "moe":
        layers = [line for line in run.stdout.splitlines() if line.startswith("MOE ")]
        assert layers == ["MOE HSPSelfAttention HSPTopKRouter"] * 2, run.stdout[-2000:]


def _stand_in_training(monkeypatch, pretrain):
    """Modules named like Megatron's, holding ``pretrain`` and a parse function."""
    import types

    pkg = types.ModuleType("megatron.training")
    training = types.ModuleType("megatron.training.training")
    arguments = types.ModuleType("megatron.training.arguments")
    arguments.parse_and_validate_args = lambda extra_args_provider=None, args_defaults=None: None
    pkg.pretrain = training.pretrain = pretrain
    for name, mod in [
        ("megatron.training", pkg),
        ("megatron.training.training", training),
        ("megatron.training.arguments", arguments),
    ]:
        monkeypatch.setitem(sys.modules, name, mod)
    return training


@pytest.mark.parametrize(
    "shape",
    ["core_r0.19", "core_r0.18"],
)
def test_launcher_binds_pretrain_arguments_by_name(shape, monkeypatch):
    from megatron_hsp.megatron import patches

    seen = {}
    if shape == "core_r0.19":  # cfg_container first (megatron-core 0.19 wheel, main)

        def pretrain(
            cfg_container, train_valid_test_dataset_provider, model_type, forward_step_func
        ):
            seen.update(provider=train_valid_test_dataset_provider, forward=forward_step_func)

        call = ("cfg", "their_provider", "type", "their_forward")
    else:  # no cfg_container: the provider first

        def pretrain(
            train_valid_test_dataset_provider, model_provider, model_type, forward_step_func
        ):
            seen.update(provider=train_valid_test_dataset_provider, forward=forward_step_func)

        call = ("their_provider", "model_provider", "type", "their_forward")
    training = _stand_in_training(monkeypatch, pretrain)
    got = {}

    def install_fn(args=None, provider=None, forward=None):
        got.update(provider=provider, forward=forward)
        return "hsp_provider", "hsp_forward"

    try:
        patches.apply_launcher_patches(install_fn)
        training.pretrain(*call)
    finally:
        patches.remove_patches()
    assert got == {"provider": "their_provider", "forward": "their_forward"}
    assert seen == {"provider": "hsp_provider", "forward": "hsp_forward"}


def test_launcher_refuses_an_unknown_pretrain_shape(monkeypatch):
    from megatron_hsp.megatron import patches
    from megatron_hsp.planner.errors import HSPError

    def pretrain(config, datasets, model_type, step_fn):  # renamed parameters
        raise AssertionError("must not be reached")

    _stand_in_training(monkeypatch, pretrain)
    try:
        with pytest.raises(HSPError, match=r"has no parameter train_valid_test_dataset_provider"):
            patches.apply_launcher_patches(lambda *a: (None, None))
    finally:
        patches.remove_patches()


def test_install_is_callable_after_the_launcher_imported_its_module():
    """``launch`` imports the installer module; the package's ``install`` must stay the
    function (a submodule named ``install`` used to replace it: 'module' is not callable)."""
    import importlib

    importlib.import_module("megatron_hsp.megatron.installer")
    import megatron_hsp.megatron as integration

    assert callable(integration.install)
    from megatron_hsp.megatron import install

    assert install.__module__ == "megatron_hsp.megatron"


def without_flag(argv: list[str], flag: str) -> list[str]:
    at = argv.index(flag)
    return argv[:at] + argv[at + 2 :]


# (name, extra flags, WORLD_SIZE, what the one line must name). Before issue 18 the first two
# never reached HSP's checks (Megatron's validate_args failed first: its CP divisibility assert,
# and for TP 2 on a CPU its device-architecture query), and every refusal was a ~20-frame
# traceback with exit 1.
REFUSALS = {
    "cp2": (["--context-parallel-size", "2"], "1", "--context-parallel-size 2"),
    "tp2-dropout": (["--tensor-model-parallel-size", "2"], "2", "--attention-dropout 0.1"),
    "cost-model-file": (["--hsp-cost-model", "/nonexistent/model.yaml"], "1", "--hsp-cost-model"),
}


@pytest.mark.spawns
@pytest.mark.slow
@pytest.mark.skipif(GIT is None, reason="git is not installed")
@pytest.mark.parametrize(
    ("ref", "patched", "case"),
    [
        ("main", False, "cp2"),
        ("main", False, "tp2-dropout"),
        ("core_r0.19.0", True, "cost-model-file"),  # after Megatron's validation, in install
    ],
)
def test_refusals_are_one_line_and_exit_2_through_megatrons_parser(ref, patched, case, tmp_path):
    """Megatron's real parse_and_validate_args with the launcher (unchanged script) or the
    patched script: the refusal is one stderr line naming the flag, exit 2, no traceback."""
    extra, world, named = REFUSALS[case]
    root = checkout(ref, tmp_path, patched=patched)
    script = str(root / "pretrain_gpt.py")
    entry = [script] if patched else ["-m", "megatron_hsp.launch", script]
    tiny = without_flag(TINY, "--hsp-cost-model")
    if case == "tp2-dropout":
        tiny = without_flag(tiny, "--attention-dropout")  # Megatron's default 0.1
    run = run_script([*entry, *tiny, "--hsp", *extra], tmp_path, root, WORLD_SIZE=world)
    assert run.returncode == 2, run.stderr[-3000:]
    assert "Traceback" not in run.stderr, run.stderr[-3000:]
    errors = [line for line in run.stderr.splitlines() if "megatron-hsp: error:" in line]
    assert len(errors) == 1 and named in errors[0], run.stderr[-3000:]
    assert run.stderr.rstrip().endswith(errors[0])


HYBRID_SPEC = ["--spec", "megatron.core.models.hybrid.hybrid_layer_specs", "hybrid_stack_spec"]


@pytest.mark.spawns
@pytest.mark.slow
@pytest.mark.skipif(GIT is None, reason="git is not installed")
def test_hybrid_script_gets_hsp_attention_in_its_attention_layers_only(tmp_path):
    """``python -m megatron_hsp.launch pretrain_hybrid.py --hybrid-layer-pattern '*-*-' --spec
    ... --hsp``: Megatron's real parsing and validation, then the stack spec the hybrid builder
    gets has HSP attention in its attention layers and nothing else changed. Before issue 18 it
    printed "HSP attention is swapped into this spec" and failed with AttributeError:
    'HybridStackSubmodules' object has no attribute 'self_attention'."""
    # core_r0.19.0: main's pretrain_hybrid.py calls a set_startup_timestamps newer than the
    # megatron-core 0.19.2 wheel's training code (its patch is checked to apply, above).
    root = checkout("core_r0.19.0", tmp_path, patched=False, script="pretrain_hybrid")
    (tmp_path / "stand_in.py").write_text(STAND_IN_PRETRAIN)
    entry = ["-m", "megatron_hsp.launch", str(root / "pretrain_hybrid.py")]
    argv = [*tiny_with_data(tmp_path), "--hybrid-layer-pattern", "*-*-", *HYBRID_SPEC, "--hsp"]
    run = run_script([str(tmp_path / "stand_in.py"), *entry, *argv], tmp_path, root)
    assert run.returncode == 0, run.stderr[-3000:]
    out = run.stdout
    assert "PRETRAIN megatron_hsp.megatron.hooks hsp_datasets_provider hsp_forward_step" in out
    assert "HYBRID attention_layer HSPSelfAttention" in out, out[-2000:]
    assert "HYBRID mlp_layer IdentityOp" in out  # MLP layers have no attention, untouched
    assert "HYBRID mamba_layer NoneType" in out  # Mamba spec untouched (and refused below)


@pytest.mark.spawns
@pytest.mark.slow
@pytest.mark.skipif(GIT is None, reason="git is not installed")
def test_patched_hybrid_script_refuses_mamba_layers_in_one_line(tmp_path):
    root = checkout("core_r0.19.0", tmp_path, patched=True, script="pretrain_hybrid")
    argv = [*TINY, "--hybrid-layer-pattern", "M*M-", *HYBRID_SPEC, "--hsp"]
    run = run_script([str(root / "pretrain_hybrid.py"), *argv], tmp_path, root)
    assert run.returncode == 2, run.stderr[-3000:]
    assert "Traceback" not in run.stderr, run.stderr[-3000:]
    errors = [line for line in run.stderr.splitlines() if "megatron-hsp: error:" in line]
    assert len(errors) == 1 and "'M' in --hybrid-layer-pattern M*M-" in errors[0], errors


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# Flag sets a Megatron user runs (issue 32): (extra flags, WORLD_SIZE). Pipeline: two stages,
# alltoall dispatcher not needed without experts; MoE: alltoall at EP 1, as the issue ran it.
FLAG_SETS = {
    "dense": ([], "1"),
    "moe": (
        [
            *("--num-experts", "4", "--moe-router-topk", "2"),
            *("--moe-token-dispatcher-type", "alltoall"),
        ],
        "1",
    ),
    "pipeline": (["--pipeline-model-parallel-size", "2"], "2"),
    "hybrid": (["--hybrid-layer-pattern", "*-*-", *HYBRID_SPEC], "1"),
}
# Megatron's own end on a machine without CUDA: stock pretrain_gpt.py stops here too.
CUDA_CHECK = 'assert torch.cuda.is_available(), "Megatron requires CUDA."'
# Megatron-LM dev (d48bd6be) is not run: its scripts import megatron-core modules newer than the
# 0.19.2 wheel (COMMIT_DEV above); its patches are checked to apply.
MAIN_CASES = [
    (ref, flags, entry, impl)
    for ref in sorted(REFS)
    for flags in FLAG_SETS
    for entry, impl in (("launcher", "default"), ("patched", "local"))
    # main's pretrain_hybrid.py needs a megatron-core newer than the wheel (see above)
    if not (flags == "hybrid" and ref == "main")
    # the patched script for dense and MoE: the flag sets differ in what the launcher patches
    if entry == "launcher" or flags in ("dense", "moe")
]


@pytest.mark.slow
@pytest.mark.spawns
@pytest.mark.skipif(GIT is None, reason="git is not installed")
@pytest.mark.parametrize(("ref", "flags", "entry", "impl"), MAIN_CASES, ids=str)
def test_script_main_runs_to_megatrons_cuda_check(ref, flags, entry, impl, tmp_path):
    """The script's real ``__main__`` and Megatron's real ``pretrain()`` with ``--hsp``: on a
    machine without CUDA, the end is Megatron's own CUDA check in ``initialize_megatron``,
    the place stock Megatron ends (``test_stock_script_ends_at_the_same_check``). ``impl``
    ``default`` leaves out ``--transformer-impl``: Megatron's default, transformer_engine,
    with Transformer Engine not importable here. Before issue 32 MoE ended in layer_spec.py
    (``pipeline_model parallel group is not initialized``) and the TE default in
    ``TypeError: 'NoneType' object is not callable``: the spec was built when Megatron read
    ``--spec``, before ``pretrain()``."""
    extra, world = FLAG_SETS[flags]
    script = "pretrain_hybrid" if flags == "hybrid" else "pretrain_gpt"
    root = checkout(ref, tmp_path, patched=entry == "patched", script=script)
    path = str(root / f"{script}.py")
    argv = ["-m", "megatron_hsp.launch", path] if entry == "launcher" else [path]
    tiny = tiny_with_data(tmp_path)
    if impl == "default":
        tiny = without_flag(tiny, "--transformer-impl")
    run = run_script([*argv, *tiny, *extra, "--hsp"], tmp_path, root, WORLD_SIZE=world)
    assert "HSP on:" in run.stdout, run.stderr[-3000:]
    assert run.returncode == 1, run.stderr[-3000:]
    tail = run.stderr.rstrip().splitlines()
    assert tail[-1] == "AssertionError: Megatron requires CUDA.", run.stderr[-3000:]
    assert tail[-2].strip() == CUDA_CHECK, run.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.spawns
@pytest.mark.skipif(GIT is None, reason="git is not installed")
@pytest.mark.parametrize("ref", sorted(REFS))
def test_stock_script_ends_at_the_same_check(ref, tmp_path):
    """The reference for the test above: the unchanged script without ``--hsp`` (MoE flags,
    Megatron's default transformer_engine) ends at the same line."""
    root = checkout(ref, tmp_path, patched=False)
    tiny = without_flag(
        without_flag(tiny_with_data(tmp_path), "--hsp-cost-model"), "--transformer-impl"
    )
    run = run_script([str(root / "pretrain_gpt.py"), *tiny, *FLAG_SETS["moe"][0]], tmp_path, root)
    tail = run.stderr.rstrip().splitlines()
    assert run.returncode == 1 and tail[-1] == "AssertionError: Megatron requires CUDA.", (
        run.stderr[-3000:]
    )
    assert tail[-2].strip() == CUDA_CHECK
