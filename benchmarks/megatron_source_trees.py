"""The ``__main__`` cases of issue 32 on Megatron-LM checkouts with their OWN megatron package.

    PYTHONPATH=. python benchmarks/megatron_source_trees.py dev=/path/to/Megatron-LM@d48bd6be \\
        main=/path/to/Megatron-LM@d98e8a64

Without trees named: ``dev`` from ``$MEGATRON_HSP_DEV_CHECKOUT`` and ``main`` from
``$MEGATRON_HSP_MAIN_CHECKOUT`` where set; ``--skip-if-missing`` exits 0 saying so when neither is.

CI runs ``tests/megatron/test_patches.py`` on the fixture scripts with the megatron-core wheel
(0.19.2): Megatron-LM dev's scripts and main's ``pretrain_hybrid.py`` import megatron-core code
newer than that wheel, so CI cannot run them. This check puts each checkout's own ``megatron/``
(core and training) first on ``PYTHONPATH`` and runs, per tree, the same flag sets as the CI test
(dense, MoE, pipeline, hybrid; the launcher with Megatron's default ``transformer_engine``
implementation, Transformer Engine not importable, and the patched script with ``local``) up to
where stock Megatron ends on a machine without CUDA (``Megatron requires CUDA.``), then the stock
script with the MoE flags for the same end. A tree is named ``ref=path``; ``ref`` picks the
patch (``dev``, ``main`` or ``core_r0.19.0``). Needs git (to apply the patches). Prints one line
per case and exits 1 if any ends elsewhere.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from tests.megatron import test_patches as tp

CUDA_END = "AssertionError: Megatron requires CUDA."


def _script_dir(tree: Path, ref: str, script: str, patched: bool, tmp: Path) -> Path:
    root = tmp / ref
    root.mkdir()
    for name in tp.SIBLINGS if script == "pretrain_gpt" else tp.HYBRID_SIBLINGS:
        shutil.copy(tree / f"{name}.py", root / f"{name}.py")
    if patched:
        (patch,) = [
            p for p in tp.PATCHES if p.name.split("-")[1] == ref and tp.script_of(p) == script
        ]
        subprocess.run(["git", "apply", str(patch)], cwd=root, check=True)
    return root


def _run(argv: list[str], tmp: Path, root: Path, tree: Path, world: str) -> tuple[int, str, bool]:
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(tp.ROOT), str(root), str(tree)]),
        RANK="0",
        WORLD_SIZE=world,
        LOCAL_WORLD_SIZE="1",
    )
    run = subprocess.run(
        [sys.executable, *argv], cwd=tmp, env=env, capture_output=True, text=True, timeout=600
    )
    tail = run.stderr.rstrip().splitlines()
    # the tree's own modules ran (its path in the traceback), not an installed megatron-core
    own = str(tree / "megatron") in run.stderr
    return run.returncode, tail[-1] if tail else "", own


def main(argv: list[str]) -> int:
    skip = "--skip-if-missing" in argv
    trees = dict(a.split("=", 1) for a in argv if a != "--skip-if-missing")
    for ref, var in (("dev", "MEGATRON_HSP_DEV_CHECKOUT"), ("main", "MEGATRON_HSP_MAIN_CHECKOUT")):
        if not trees.get(ref) and os.environ.get(var):
            trees[ref] = os.environ[var]
    if not trees:
        print(
            "megatron_source_trees: no Megatron-LM checkout named (ref=path, or "
            "$MEGATRON_HSP_DEV_CHECKOUT / $MEGATRON_HSP_MAIN_CHECKOUT)",
            file=sys.stderr,
        )
        return 0 if skip else 2
    with tempfile.TemporaryDirectory(prefix="hsp-trees-") as scratch:
        return _run_trees(trees, Path(scratch))


def _run_trees(trees: dict[str, str], scratch: Path) -> int:
    """Every case of every tree, each in its own folder under ``scratch``; 1 if any failed."""
    failed = 0
    for ref, path in trees.items():
        tree = Path(path)
        for flags, (extra, world) in tp.FLAG_SETS.items():
            for entry, impl in (("launcher", "default"), ("patched", "local")):
                if entry == "patched" and flags not in ("dense", "moe"):
                    continue
                tmp = Path(tempfile.mkdtemp(dir=scratch))
                script = "pretrain_hybrid" if flags == "hybrid" else "pretrain_gpt"
                root = _script_dir(tree, ref, script, entry == "patched", tmp)
                path_ = str(root / f"{script}.py")
                head = ["-m", "megatron_hsp.launch", path_] if entry == "launcher" else [path_]
                tiny = tp.tiny_with_data(tmp)
                if impl == "default":
                    tiny = tp.without_flag(tiny, "--transformer-impl")
                code, last, own = _run([*head, *tiny, *extra, "--hsp"], tmp, root, tree, world)
                ok = code == 1 and last == CUDA_END and own
                failed += not ok
                print(f"{ref:13} {flags:8} {entry:8} {impl:8} {'ok' if ok else 'FAILED'}: {last}")
        tmp = Path(tempfile.mkdtemp(dir=scratch))
        root = _script_dir(tree, ref, "pretrain_gpt", False, tmp)
        tiny = tp.without_flag(
            tp.without_flag(tp.tiny_with_data(tmp), "--hsp-cost-model"), "--transformer-impl"
        )
        moe = tp.FLAG_SETS["moe"][0]
        code, last, own = _run([str(root / "pretrain_gpt.py"), *tiny, *moe], tmp, root, tree, "1")
        ok = code == 1 and last == CUDA_END and own
        failed += not ok
        print(f"{ref:13} stock    moe               {'ok' if ok else 'FAILED'}: {last}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
