"""Solve time on the suite's batches as ``bench --flexsp-harness`` draws them, in rounds.

Each distribution's lengths are generated as ``suite.py`` generates them (seed 0, 5 batches of
512 at 64 GPUs, max-seq 192000, FlexSP's harness rules); ``solve()`` is called directly with the
tree's defaults (``--config`` overrides ``SolverConfig`` fields), in one warm process. Writes,
per distribution, one {wall, cpu, total} per round: wall and CPU p50 over the batches (ms) and
the summed step estimate. Two trees or two configs compare fairly only when their runs
alternate on one machine (docs/solver.md, "Solve time, 2026-11-27 (second)"):

    PYTHONPATH=<tree> python benchmarks/solve_time_rounds.py llama3-8b-h100 out.json
    PYTHONPATH=. python benchmarks/solve_time_rounds.py flexsp-gpt-7b w1.json \
        --config '{"workers": 1}'
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import json
import sys
import tempfile
from pathlib import Path

import numpy as np
from suite import DISTRIBUTIONS, EMBEDDED, SHARED, generate

from megatron_hsp.commands.common import add_common_arguments, apply_harness_defaults, build_setup
from megatron_hsp.planner.search.solver import solve

STEPS, GBS, GPUS, MAX_SEQ = 5, 512, 64, 192_000


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("cost_model", help="preset name or spec file, e.g. llama3-8b-h100")
    ap.add_argument("out", help="JSON file to write")
    ap.add_argument("--rounds", type=int, default=1, help="passes over the six distributions")
    ap.add_argument("--config", default="{}", help="JSON of SolverConfig fields to override")
    args = ap.parse_args(argv)
    if not Path(args.out).resolve().parent.is_dir():
        ap.error(f"{args.out}: its folder does not exist")
    overrides = json.loads(args.config)
    rng = np.random.default_rng(0)
    setups = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in DISTRIBUTIONS:  # the suite's draw order, so its batches
            if name == "wikipedia":
                path = SHARED if SHARED.exists() else EMBEDDED
            else:
                path = Path(tmp) / f"{name}.txt.gz"
                with gzip.open(path, "wt") as fh:
                    fh.write("\n".join(map(str, generate(name, 2 * GBS * STEPS, MAX_SEQ, rng))))
            parser = argparse.ArgumentParser()
            add_common_arguments(parser, harness=True)
            ns = parser.parse_args(
                ["--lengths", str(path), "--gpus", str(GPUS), "--cost-model", args.cost_model,
                 "--max-seq", str(MAX_SEQ), "--global-batch", str(GBS),
                 "--sampling", "sequential", "--overlong", "drop"]
            )  # fmt: skip
            apply_harness_defaults(ns)
            setup = build_setup(ns)
            config = dataclasses.replace(setup.settings(ns).solver_config(), **overrides)
            batches = [[int(x) for x in setup.sampler.batch(i).lengths] for i in range(STEPS)]
            setups[name] = (setup, config, batches)
    first = next(iter(setups.values()))
    solve(first[2][0], first[0].cost, first[0].cluster, first[1])  # warm: imports, first HiGHS
    out: dict[str, list[dict[str, float]]] = {}
    for _ in range(args.rounds):
        for name, (setup, config, batches) in setups.items():
            plans = [solve(b, setup.cost, setup.cluster, config) for b in batches]
            out.setdefault(name, []).append(
                {
                    "wall": float(np.median([p.solve_ms for p in plans])),
                    "cpu": float(np.median([p.extra["cpu_ms"] for p in plans])),
                    "total": float(sum(p.est_step_ms for p in plans)),
                }
            )
            print(name, json.dumps(out[name][-1]), flush=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
