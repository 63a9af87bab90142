"""Solve time and step total of ``SolverConfig`` variants on the six suite distributions.

Each variant is ``label=JSON`` of ``SolverConfig`` fields (``{}``: the defaults); batches are the
suite's generators (seed 0) or Wikipedia, flexsp-gpt-7b, 192k, 64 GPUs, GBS 512, sequential.
Prints per distribution: total step time over the batches, wall p50 and CPU p50 of the solve.

    PYTHONPATH=. python benchmarks/solve_time.py 5 'old={"milp_max_microbatches":100000}' 'new={}'
"""

from __future__ import annotations

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
    cost = load_cost_model("flexsp-gpt-7b", world_size=64, max_seq_k=192)
    cl = Cluster(64, 8)
    rng = np.random.default_rng(0)
    steps = int(argv[0]) if argv else 5
    pairs = [a.split("=", 1) for a in argv[1:]] or [["default", "{}"]]
    configs = {k: SolverConfig(**json.loads(v)) for k, v in pairs}
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
            for s in range(steps):
                p = solve(lens[s * 512 : (s + 1) * 512].tolist(), cost, cl, cfg)
                tot += p.est_step_ms
                ms.append(p.solve_ms)
                cpu.append(p.extra["cpu_ms"])
            row.append(
                f"{label}: {tot / 1e3:.2f}s p50 {np.median(ms):.0f}ms cpu {np.median(cpu):.0f}"
            )
        print(" | ".join(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
