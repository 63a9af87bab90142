"""FlexSP's released solver against hsp on the suite's distributions: same batches, same pricing.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/flexsp_solver_compare.py --galvatron DIR

DIR is a local checkout of the ``flexsp`` branch of PKU-DAIR/Hetu-Galvatron (the folder that holds
``galvatron/flexsp_solver/solver.py``), run with ``pyscipopt`` installed. Nothing of it is copied
into this repo: the script writes each distribution's lengths to
``DIR/galvatron/datasets/hsp-NAME.txt``, runs FlexSP's ``solver.py --method_type flexSP`` on them
as a subprocess and reads its per-iteration ``Time`` lines.

Both sides see the same batches and the same pricing: flexsp-gpt-7b, 64 GPUs, 192k, GBS 512,
28 GB (``solver.py``'s default), FlexSP's padding and filtering (``solver_targets.flexsp_rules``,
what its ``read_dataset`` does) and FlexSP's cost model (``as_published=True``, pure Ulysses at
every size, as its solver prices). hsp plans with its default 1 s budget; FlexSP with SCIP at
``--time-limit`` seconds per MILP, as its scripts run it. Lengths: ``suite.generate(name, ...,
numpy.random.default_rng(0))`` per distribution, the Wikipedia sample from ``../shared``.
"""

from __future__ import annotations

import argparse
import gzip
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from solver_targets import flexsp_rules
from suite import DISTRIBUTIONS, generate

from megatron_hsp.planner.cost.costmodel import flexsp_cost_model
from megatron_hsp.planner.search.settings import SolverConfig
from megatron_hsp.planner.search.solver import solve
from megatron_hsp.planner.topology import Cluster

WIKI = Path("../shared/data/wikipedia_lengths.txt.gz")
ITER = re.compile(
    r"Iteration\[(\d+)\] Final Results: Search Time = ([\d.]+), # microbatch = (\d+), "
    r"Time = ([\d.]+)"
)
GBS, WORLD, SEQ_K, CAP_GB = 512, 64, 192, 28


def raw_lengths(name: str, iters: int) -> np.ndarray:
    if name == "wikipedia":
        with gzip.open(WIKI, "rt") as fh:
            # FlexSP's filtering drops a few: twice what the batches need is plenty.
            lines = [next(fh) for _ in range(4 * GBS * iters)]
            return np.array([int(x) for x in lines], dtype=np.int64)
    return generate(name, 2 * GBS * iters, SEQ_K * 1000, np.random.default_rng(0))


def run_flexsp(solver_dir: Path, name: str, iters: int, time_limit: int) -> list[tuple]:
    cmd = [
        sys.executable, "solver.py", "--method_type", "flexSP", "--dataset", f"hsp-{name}",
        "--cluster_size", str(WORLD), "--model_size", "gpt-7b", "--seq_limit_k", str(SEQ_K),
        "--global_batch_size", str(GBS), "--memory_limit_gb", str(CAP_GB),
        "--iter_num", str(iters), "--start_iter", "0", "--time_limit", str(time_limit),
    ]  # fmt: skip
    root = solver_dir.parent.parent
    env = {"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=solver_dir, env=env, capture_output=True, text=True)
    rows = [(int(m[1]), float(m[2]), int(m[3]), float(m[4])) for m in ITER.finditer(proc.stdout)]
    if proc.returncode != 0 or len(rows) != iters:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        raise RuntimeError(f"FlexSP's solver.py on {name}: rc {proc.returncode}: {tail}")
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--galvatron",
        type=Path,
        default=os.environ.get("HSP_GALVATRON") or None,
        help="flexsp-branch checkout (default: $HSP_GALVATRON)",
    )
    ap.add_argument(
        "--skip-if-missing",
        action="store_true",
        help="exit 0 with a message when no checkout is given (make bench)",
    )
    ap.add_argument("--iters", type=int, default=5, help="batches per distribution")
    ap.add_argument("--time-limit", type=int, default=10, help="FlexSP's SCIP limit per MILP (s)")
    ap.add_argument("--distributions", default=",".join(DISTRIBUTIONS))
    ap.add_argument("--budget", type=float, default=1.0, help="hsp's time budget per solve (s)")
    args = ap.parse_args()
    if args.galvatron is None:
        print(
            "--galvatron: give a checkout of the flexsp branch of PKU-DAIR/Hetu-Galvatron "
            "(or set HSP_GALVATRON)" + ("; skipped" if args.skip_if_missing else "")
        )
        return 0 if args.skip_if_missing else 2
    args.galvatron = Path(args.galvatron)
    solver_dir = args.galvatron / "galvatron" / "flexsp_solver"
    if not (solver_dir / "solver.py").exists():
        print(f"--galvatron: no galvatron/flexsp_solver/solver.py under {args.galvatron}")
        return 2
    names = [n for n in args.distributions.split(",") if n]
    unknown = sorted(set(names) - set(DISTRIBUTIONS))
    if unknown:
        print(f"--distributions: unknown {unknown}; choose from {DISTRIBUTIONS}")
        return 2
    if "wikipedia" in names and not WIKI.exists():
        print(f"skipping wikipedia: {WIKI} is absent")
        names.remove("wikipedia")
    cost = flexsp_cost_model("flexsp-gpt-7b", WORLD, SEQ_K, CAP_GB, as_published=True)
    cluster = Cluster(WORLD, 8)
    print(
        f"flexsp-gpt-7b, {WORLD} GPUs, {SEQ_K}k, GBS {GBS}, {CAP_GB} GB, FlexSP's pricing, "
        f"batches 0-{args.iters - 1}; FlexSP SCIP limit {args.time_limit} s, hsp budget "
        f"{args.budget} s\n"
    )
    print(
        "| distribution | FlexSP (s) | hsp (s) | hsp vs FlexSP | per batch | hsp lower bound (s) "
        "| FlexSP search s/batch | hsp solve ms p50 | micro-batches FlexSP / hsp |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for name in names:
        raw = raw_lengths(name, args.iters)
        (args.galvatron / "galvatron" / "datasets").mkdir(exist_ok=True)
        path = args.galvatron / "galvatron" / "datasets" / f"hsp-{name}.txt"
        path.write_text("\n".join(str(int(x)) for x in raw) + "\n")
        data = flexsp_rules(raw, WORLD, SEQ_K)
        batches = [data[k * GBS : (k + 1) * GBS].tolist() for k in range(args.iters)]
        if any(len(b) < GBS for b in batches):
            print(f"| {name} | too few lengths after FlexSP's filtering |")
            continue
        started = time.time()
        flex = run_flexsp(solver_dir, name, args.iters, args.time_limit)
        flex_wall = time.time() - started
        plans = [solve(b, cost, cluster, SolverConfig(time_budget_s=args.budget)) for b in batches]
        f_ms = [r[3] for r in flex]
        h_ms = [p.est_step_ms for p in plans]
        ratios = [f / h for f, h in zip(f_ms, h_ms, strict=True)]
        print(
            f"| {name} | {sum(f_ms) / 1e3:.2f} | {sum(h_ms) / 1e3:.2f} | "
            f"{sum(f_ms) / sum(h_ms):.3f}x ({(1 - sum(h_ms) / sum(f_ms)) * 100:.1f}% faster) | "
            f"{min(ratios):.3f}-{max(ratios):.3f}x | "
            f"{sum(p.lower_bound_ms for p in plans) / 1e3:.2f} | "
            f"{np.mean([r[1] for r in flex]):.1f} (wall {flex_wall / args.iters:.0f}) | "
            f"{np.median([p.solve_ms for p in plans]):.0f} | "
            f"{sum(r[2] for r in flex)} / {sum(len(p.microbatches) for p in plans)} |",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
