"""The pretrain_gpt.py patches apply to the Megatron-LM commits they name (offline fixtures)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PATCHES = sorted((ROOT / "patches").glob("pretrain_gpt-*.patch"))
FIXTURES = ROOT / "tests" / "fixtures" / "megatron-lm"
GIT = shutil.which("git")


def commit_of(patch: Path) -> str:
    m = re.search(r"at commit ([0-9a-f]{40})", patch.read_text())
    assert m, f"{patch.name} must name its full Megatron-LM commit in its header"
    assert m.group(1).startswith(patch.stem.rsplit("-", 1)[-1]), "file name and header disagree"
    return m.group(1)


def test_both_targets_are_covered():
    refs = {p.name.split("-")[1] for p in PATCHES}
    assert refs == {"main", "core_r0.19.0"}


@pytest.mark.skipif(GIT is None, reason="git is not installed")
@pytest.mark.parametrize("patch", PATCHES, ids=lambda p: p.name)
def test_patch_applies_to_its_commit(patch, tmp_path):
    pristine = FIXTURES / commit_of(patch) / "pretrain_gpt.py.upstream"
    shutil.copy(pristine, tmp_path / "pretrain_gpt.py")
    run = subprocess.run(
        [GIT, "apply", "--check", "-v", str(patch)], cwd=tmp_path, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr
    subprocess.run([GIT, "apply", str(patch)], cwd=tmp_path, check=True)
    patched = (tmp_path / "pretrain_gpt.py").read_text()
    compile(patched, "pretrain_gpt.py", "exec")  # still valid Python
    assert "hsp_extra_args_provider(" in patched and "hsp_install(" in patched
    # Reversible: the checkout can be restored with `git apply -R`.
    subprocess.run([GIT, "apply", "-R", str(patch)], cwd=tmp_path, check=True)
    assert (tmp_path / "pretrain_gpt.py").read_bytes() == pristine.read_bytes()


# Needs a Megatron-LM checkout (megatron/training is not in the megatron-core wheel):
#   MEGATRON_LM_MAIN=/path/to/checkout-at-main MEGATRON_LM_CORE_R0_19=/path/... pytest ...
CHECKOUTS = {"main": "MEGATRON_LM_MAIN", "core_r0.19.0": "MEGATRON_LM_CORE_R0_19"}


@pytest.mark.parametrize("patch", PATCHES, ids=lambda p: p.name)
def test_patched_script_parses_hsp_flags(patch, tmp_path):
    """The patched script builds Megatron's parser with the --hsp flags and exits through
    argparse (no CUDA needed). Upstream's own ``--help`` crashes on an unescaped ``%`` in a
    Megatron help string at both commits (see docs/integration.md), so an argparse error on a
    bad --hsp value is what proves the flags are wired in."""
    checkout = os.environ.get(CHECKOUTS[patch.name.split("-")[1]])
    if not checkout:
        pytest.skip(f"set {CHECKOUTS[patch.name.split('-')[1]]} to a Megatron-LM checkout")
    # The patched script runs from a scratch dir; its siblings (gpt_builders, model_provider)
    # and megatron/ come from the checkout on PYTHONPATH, which is left untouched.
    shutil.copy(
        FIXTURES / commit_of(patch) / "pretrain_gpt.py.upstream", tmp_path / "pretrain_gpt.py"
    )
    subprocess.run([GIT, "apply", str(patch)], cwd=tmp_path, check=True)
    env = dict(os.environ, PYTHONPATH=f"{checkout}{os.pathsep}{ROOT}", RANK="0", WORLD_SIZE="1")
    run = subprocess.run(
        [sys.executable, "pretrain_gpt.py", "--hsp", "--hsp-solver", "nope"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 2, run.stderr[-2000:]
    assert "argument --hsp-solver: invalid choice: 'nope'" in run.stderr


@pytest.mark.parametrize("ref", sorted(CHECKOUTS))
def test_launcher_runs_the_unchanged_script(ref, tmp_path):
    """``python -m megatron_hsp.launch pretrain_gpt.py ...`` adds the flags to the unchanged
    upstream script (same argparse check as above)."""
    checkout = os.environ.get(CHECKOUTS[ref])
    if not checkout:
        pytest.skip(f"set {CHECKOUTS[ref]} to a Megatron-LM checkout")
    env = dict(os.environ, PYTHONPATH=f"{checkout}{os.pathsep}{ROOT}", RANK="0", WORLD_SIZE="1")
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "megatron_hsp.launch",
            str(Path(checkout) / "pretrain_gpt.py"),
            "--hsp",
            "--hsp-solver",
            "nope",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 2, run.stderr[-2000:]
    assert "argument --hsp-solver: invalid choice: 'nope'" in run.stderr
