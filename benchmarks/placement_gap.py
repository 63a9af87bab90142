"""The planner's gap to a bound that knows the runtime's placement rule.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/placement_gap.py [--steps 3] [--only bimodal ...]
        [--cost-model flexsp-gpt-7b] [--time-limit 300] [--intra-node] [--json out.json]

For each suite distribution (the batches ``gap_decomposition.py`` and ``suite.py --steps 5``
draw: one generator, seed 0, 192k, 64 GPUs in nodes of 8, GBS 512) and each of the first
``--steps`` batches: hsp's plan (default solver settings), the combinatorial bound the plan
carries (``bounds.py``, blind to placement) and ``placement_bound.placement_lp_bound`` (an LP
over micro-batches whose cross-node groups aligned blocks can hold), seeded with the plan's
micro-batches and given its step time. The placement bound is valid for every plan the runtime
can execute, so ``max`` of the two is too; the table sums seconds over the batches.

"LP master" is the restricted master's value when the column generation stopped: an upper bound
on what the LP can reach, so where it is below the plan by more than 10% no amount of running
closes the gap with this LP. ``--intra-node`` also places the multi-rank sequences a node holds
(node configurations; slow, rarely converges at this size).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from suite import DISTRIBUTIONS, sequential_batches

from megatron_hsp.evaluation.placement_bound import placement_lp_bound
from megatron_hsp.planner.cost.costmodel import load_cost_model
from megatron_hsp.planner.search.instance import Instance, check_lengths, resolve_sizes
from megatron_hsp.planner.search.settings import SolverConfig
from megatron_hsp.planner.search.solver import solve
from megatron_hsp.planner.topology import Cluster


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--gpus", type=int, default=64)
    ap.add_argument("--global-batch", type=int, default=512)
    ap.add_argument("--cost-model", default="flexsp-gpt-7b")
    ap.add_argument("--time-limit", type=float, default=300.0, help="seconds per batch's LP")
    ap.add_argument("--rel-width", type=float, default=0.02)
    ap.add_argument("--intra-node", action="store_true")
    ap.add_argument(
        "--only", nargs="*", default=None, help="these distributions (batches still match)"
    )
    ap.add_argument("--json", default=None, help="write per-batch figures here")
    args = ap.parse_args(argv)
    bad = [d for d in args.only or [] if d not in DISTRIBUTIONS]
    if bad:
        ap.error(f"--only: unknown {bad}; choose from {DISTRIBUTIONS}")
    cost = load_cost_model(args.cost_model, world_size=args.gpus, max_seq_k=192)
    cluster = Cluster(args.gpus, 8)
    sizes = resolve_sizes(cost, cluster, None)
    rng = np.random.default_rng(0)
    print(
        f"{args.cost_model}, {args.gpus} GPUs, GBS {args.global_batch}, {args.steps} sequential "
        f"batches, LP limit {args.time_limit:g} s, classes {args.rel_width:g}"
        f"{', intra-node placement' if args.intra_node else ''}; seconds summed over batches\n"
    )
    print(
        "| distribution | hsp plan | combinatorial bound | gap | placement bound (converged) "
        "| gap to max of both | LP master | LP time (s) |\n|" + "---|" * 8
    )
    rows = []
    for name in DISTRIBUTIONS:
        todo = sequential_batches(name, cost, args.global_batch, args.steps, rng)
        if args.only is not None and name not in args.only:
            continue
        plan_s = comb_s = best_s = pb_s = master_s = lp_time = 0.0
        conv = computed = 0
        for batch in todo:
            inst = Instance.build(check_lengths(batch, cost, sizes), cost, cluster, sizes)
            plan = solve(batch, cost, cluster, SolverConfig())
            seed = [[(g.size, g.seq_ids) for g in mb.groups] for mb in plan.microbatches]
            t0 = time.perf_counter()
            pb = placement_lp_bound(
                inst,
                cluster,
                rel_width=args.rel_width,
                time_limit_s=args.time_limit,
                seed=seed,
                upper_ms=plan.est_step_ms,
                intra_node=args.intra_node,
            )
            lp_time += time.perf_counter() - t0
            comb = plan.lower_bound_ms
            best = max(comb, pb.bound_ms) if pb else comb
            plan_s += plan.est_step_ms / 1e3
            comb_s += comb / 1e3
            best_s += best / 1e3
            pb_s += (pb.bound_ms if pb else 0.0) / 1e3
            master_s += (pb.lp_ms if pb else comb) / 1e3
            computed += pb is not None
            conv += bool(pb and pb.converged)
            rows.append(
                {
                    "distribution": name,
                    "plan_ms": plan.est_step_ms,
                    "combinatorial_ms": comb,
                    "placement_ms": pb.bound_ms if pb else None,
                    "placement_converged": bool(pb and pb.converged),
                    "lp_master_ms": pb.lp_ms if pb else None,
                    "long_sequences": pb.long_sequences if pb else 0,
                }
            )
        pb_cell = f"{pb_s:.2f} ({conv}/{computed})" if computed else "n/a (nothing to place)"
        print(
            f"| {name} | {plan_s:.2f} | {comb_s:.2f} | {(plan_s / comb_s - 1) * 100:.1f}% | "
            f"{pb_cell} | {(plan_s / best_s - 1) * 100:.1f}% | {master_s:.2f} | {lp_time:.0f} |",
            flush=True,
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
