"""Solve time and step total of ``SolverConfig`` variants on the six suite distributions.

Each variant is ``label=JSON`` of ``SolverConfig`` fields (``{}``: the defaults); batches are the
suite's generators (seed 0) or Wikipedia, 192k, 64 GPUs, GBS 512, sequential. Prints per
distribution: total step time over the batches, wall p50 and CPU p50 of the solve.
``--record FILE`` writes every plan's fingerprint, ``est_step_ms``, status and micro-batch count
(JSON): two trees that must plan alike (a performance refactor) must write the same file.

    PYTHONPATH=. python benchmarks/solve_time.py 5 'old={"milp_max_microbatches":100000}' 'new={}'
    PYTHONPATH=. python benchmarks/solve_time.py 2 --cost-model llama3-8b-h100 --record out.json
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys

import numpy as np
from suite import DISTRIBUTIONS, EMBEDDED, SHARED, generate

from megatron_hsp.planner.cost.costmodel import load_cost_model
from megatron_hsp.planner.search.settings import SolverConfig
from megatron_hsp.planner.search.solver import solve
from megatron_hsp.planner.topology import Cluster


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("steps", nargs="?", type=int, default=5, help="batches per distribution")
    ap.add_argument("variants", nargs="*", help="label=JSON of SolverConfig fields")
    ap.add_argument(
        "--cost-model",
        default="flexsp-gpt-7b",
        help="preset name or spec file (load_cost_model), e.g. llama3-8b-h100 (ZeRO-1)",
    )
    ap.add_argument("--record", default=None, metavar="FILE", help="write each plan's identity")
    args = ap.parse_args(argv)
    cost = load_cost_model(args.cost_model, world_size=64, max_seq_k=192)
    cl = Cluster(64, 8)
    rng = np.random.default_rng(0)
    steps = args.steps
    pairs = [a.split("=", 1) for a in args.variants] or [["default", "{}"]]
    configs = {k: SolverConfig(**json.loads(v)) for k, v in pairs}
    record: dict[str, dict[str, list[dict[str, object]]]] = {label: {} for label in configs}
    for name in DISTRIBUTIONS:
        if name == "wikipedia":
            with gzip.open(SHARED if SHARED.exists() else EMBEDDED, "rt") as fh:
                lens = np.array([int(x) for x in fh.read().split()[: 4 * 512 * steps]])
        else:
            lens = generate(name, 2 * 512 * 5, 192000, rng)
        lens = lens[lens <= cost.max_trainable_length()]
        row = [name]
        for label, cfg in configs.items():
            tot, ms, cpu = 0.0, [], []
            plans = record[label].setdefault(name, [])
            for s in range(steps):
                p = solve(lens[s * 512 : (s + 1) * 512].tolist(), cost, cl, cfg)
                tot += p.est_step_ms
                ms.append(p.solve_ms)
                cpu.append(p.extra["cpu_ms"])
                plans.append(
                    {
                        "fingerprint": p.fingerprint(),
                        "est_step_ms": p.est_step_ms.hex(),
                        "status": p.status,
                        "microbatches": len(p.microbatches),
                        "lower_bound_ms": p.lower_bound_ms.hex(),
                        "chunking": p.extra["chunking"],
                        "cut_by_cap": p.extra["cut_by_cap"],
                    }
                )
            row.append(
                f"{label}: {tot / 1e3:.2f}s p50 {np.median(ms):.0f}ms cpu {np.median(cpu):.0f}"
            )
        print(" | ".join(row), flush=True)
    if args.record:
        with open(args.record, "w") as fh:
            json.dump(record, fh, indent=1, sort_keys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
