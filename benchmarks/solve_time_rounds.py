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

``--detail`` adds, per distribution and round, medians per solve of the group builder's runs
(``greedy.build_groups``), of the wall time in ``chunk_long_grouped`` and in the cheapest
homogeneous layout's stage, and of each phase of the solve (``plan.extra["phase_end_ms"]``;
``milp`` is the wait for the MILPs and the baselines beside them) (docs/solver.md, "Solve time,
2026-11-27 (third)"); it wraps those functions by name, so it reads an older tree too
(``PYTHONPATH=<tree>``).
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
    ap.add_argument("--detail", action="store_true", help="builder runs and stage times too")
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
    counts = _instrument() if args.detail else None
    out: dict[str, list[dict[str, float]]] = {}
    for _ in range(args.rounds):
        for name, (setup, config, batches) in setups.items():
            plans, seen = [], []
            for b in batches:
                if counts is not None:
                    counts.clear()
                plans.append(solve(b, setup.cost, setup.cluster, config))
                seen.append(dict(counts or {}))
                if counts is not None:  # each phase's own ms (``extra["phase_end_ms"]``)
                    before = 0.0
                    for phase, end in plans[-1].extra["phase_end_ms"].items():
                        seen[-1][f"{phase}_ms"] = end - before
                        before = end
            row = {
                "wall": float(np.median([p.solve_ms for p in plans])),
                "cpu": float(np.median([p.extra["cpu_ms"] for p in plans])),
                "total": float(sum(p.est_step_ms for p in plans)),
            }
            for key in sorted({k for one in seen for k in one}):
                row[key] = float(np.median([one.get(key, 0.0) for one in seen]))
            out.setdefault(name, []).append(row)
            print(name, json.dumps(out[name][-1]), flush=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    return 0


def _instrument() -> dict[str, float]:
    """Wrap the builder (a count) and two stages (wall ms) by name; returns the counters."""
    import time

    from megatron_hsp.planner.search import greedy, solver

    counts: dict[str, float] = {}

    def wrap(module, name: str, key: str, timed: bool) -> None:
        real = getattr(module, name)

        def wrapped(*a, **k):
            start = time.perf_counter()
            try:
                return real(*a, **k)
            finally:
                took = (time.perf_counter() - start) * 1e3 if timed else 1.0
                counts[key] = counts.get(key, 0.0) + took

        setattr(module, name, wrapped)

    wrap(greedy, "build_groups", "builder_runs", False)
    wrap(solver, "chunk_long_grouped", "long_grouped_ms", True)
    for name in ("cheapest_homogeneous", "_cheapest_homogeneous"):  # this tree's, an older one's
        if hasattr(solver, name):
            wrap(solver, name, "homogeneous_ms", True)
    return counts


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
