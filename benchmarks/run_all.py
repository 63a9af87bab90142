"""Run every benchmark script in this folder with small defaults (``make bench``).

Each script runs as its own process with a smoke-sized configuration, writing its JSON under
``--out`` (default ``benchmarks/results/run_all``) and never rewriting the docs; the full-size
runs and the commands that produced the published figures are in each script's docstring and in
docs/results/benchmarks.md. Exit status: 0 when every script succeeded, else 1 (each failure is
named).

    PYTHONPATH=$PWD .venv/bin/python benchmarks/run_all.py [--only NAME ...] [--dry-run]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def commands(out: Path) -> dict[str, list[str]]:
    """Script name -> argv (small settings); every script in the folder has one entry."""
    py = sys.executable
    return {
        "attention_backends": [
            py, str(HERE / "attention_backends.py"), "--tokens", "2048", "--repeats", "2",
            "--json", str(out / "attention_backends.json"),
        ],
        "dispatch_overhead": [
            py, str(HERE / "dispatch_overhead.py"), "--steps", "3",
            "--json", str(out / "dispatch_overhead.json"),
        ],
        "solver_targets": [py, str(HERE / "solver_targets.py"), "--quick"],
        "flexsp_grid": [
            py, str(HERE / "flexsp_grid.py"), "--quick", "--steps", "2",
            "--out-dir", str(out / "flexsp_grid"), "--doc", str(out / "benchmarks.md"),
        ],
        "flexsp_published": [py, str(HERE / "flexsp_published.py")],
        "ring_cuda_check": [py, str(HERE / "ring_cuda_check.py")],
        "suite": [py, str(HERE / "suite.py"), "--steps", "1"],
        "dcp_sensitivity": [py, str(HERE / "dcp_sensitivity.py"), "--steps", "2"],
        "ring_split_check": [py, str(HERE / "ring_split_check.py")],
        "ring_memory": [py, str(HERE / "ring_memory.py")],
        "calibration": [py, str(HERE / "calibration.py")],
        "gap_decomposition": [py, str(HERE / "gap_decomposition.py"), "--steps", "1"],
        "pairing_check": [py, str(HERE / "pairing_check.py")],
        "placement_gap": [
            py, str(HERE / "placement_gap.py"), "--steps", "1", "--only", "bimodal",
            "--time-limit", "60",
        ],
        "solve_time": [py, str(HERE / "solve_time.py"), "1"],
        "solve_time_rounds": [
            py, str(HERE / "solve_time_rounds.py"), "flexsp-gpt-7b",
            str(Path(tempfile.gettempdir()) / "solve_time_rounds.json"),
        ],
        "communicators": [py, str(HERE / "communicators.py")],
        # One step, JSON to the temp dir: the committed 5-step results stay as docs quote them.
        "pipeline_moe": [
            py, str(HERE / "pipeline_moe.py"), "--steps", "1",
            "--json-dir", tempfile.gettempdir(),
        ],
        "pipeline_order": [py, str(HERE / "pipeline_order.py")],
        # Megatron's published dynamic-CP benchmark replayed (dev's schedules from the fixture).
        "dcp_published": [py, str(HERE / "dcp_published.py"), "--steps", "2"],
        # Needs a Megatron-LM dev checkout ($MEGATRON_HSP_DEV_CHECKOUT); writes to the temp dir,
        # never over the committed fixture.
        "record_megatron_schedules": [
            py, str(HERE / "record_megatron_schedules.py"), "--skip-if-missing",
            "--out", str(Path(tempfile.gettempdir()) / "megatron_dev_schedules.json"),
        ],
        # Needs a Megatron-LM dev checkout ($MEGATRON_HSP_DEV_CHECKOUT); says so if absent.
        "dp_balanced_source_check": [
            py, str(HERE / "dp_balanced_source_check.py"), "--steps", "1", "--skip-if-missing",
        ],
        # Needs Megatron-LM checkouts ($MEGATRON_HSP_DEV_CHECKOUT, $MEGATRON_HSP_MAIN_CHECKOUT).
        "megatron_source_trees": [
            py, str(HERE / "megatron_source_trees.py"), "--skip-if-missing",
        ],
        # Needs a FlexSP checkout (--galvatron / $HSP_GALVATRON) and pyscipopt; says so if absent.
        "flexsp_solver_compare": [
            py, str(HERE / "flexsp_solver_compare.py"), "--iters", "1", "--distributions",
            "web-crawl", "--skip-if-missing",
        ],
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(HERE / "results" / "run_all"), help="output folder")
    ap.add_argument("--only", nargs="*", default=None, help="run only these scripts")
    ap.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    args = ap.parse_args(argv)
    out = Path(args.out)
    cmds = commands(out)
    missing = sorted(
        p.stem for p in HERE.glob("*.py") if p.stem not in cmds and p.stem != "run_all"
    )
    if missing:
        print(f"error: benchmarks without a run_all entry: {missing}", file=sys.stderr)
        return 1
    unknown = sorted(set(args.only or ()) - set(cmds))
    if unknown:
        print(f"error: --only {unknown}: choose from {sorted(cmds)}", file=sys.stderr)
        return 2
    failed = []
    for name, cmd in cmds.items():
        if args.only and name not in args.only:
            continue
        print("$ " + " ".join(cmd), flush=True)
        if args.dry_run:
            continue
        out.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        rc = subprocess.call(cmd, cwd=HERE.parent)
        print(f"-- {name}: exit {rc} in {time.perf_counter() - t0:.1f} s", flush=True)
        if rc != 0:
            failed.append(name)
    if failed:
        print(f"error: benchmarks failed: {failed}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
