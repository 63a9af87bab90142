"""Where a plan's step time goes beyond the lower bound, by cause.

The combinatorial bound's main term is ``W_min / N + m_min * b``: every sequence at its cheapest
fitting group size (rank-ms), perfectly balanced over the ``N`` ranks, in the fewest micro-batches
memory allows. A plan's step time splits exactly the same way,

    sum_j M_j = (W_plan + F_plan + I_plan) / N

(``W_plan``: rank-ms of its sequences at the sizes it chose; ``F_plan``: rank-ms of its groups'
fixed costs; ``I_plan``: idle rank-ms, ranks waiting for their micro-batch's slowest group), so
the gap to that term is the sum of three excesses: size inflation ``(W_plan - W_min) / N``,
fixed costs / extra micro-batches ``F_plan / N - m_min * b``, and idle ``I_plan / N``. This says
which part of the planner loses time, not whether a better plan exists (that is the bound's
question); docs/results/solver.md reads it.

    PYTHONPATH=. python benchmarks/gap_decomposition.py [--steps 3] [--budget 1.0]
"""

from __future__ import annotations

import argparse
import math
import sys

import numpy as np
from suite import DISTRIBUTIONS, sequential_batches

from megatron_hsp.planner.cost.costmodel import load_cost_model
from megatron_hsp.planner.groupspace import planning_sizes
from megatron_hsp.planner.search.instance import Instance, check_lengths, resolve_sizes
from megatron_hsp.planner.search.settings import SolverConfig
from megatron_hsp.planner.search.solver import solve
from megatron_hsp.planner.topology import Cluster


def _dff(k: int, x: float) -> float:
    """Fekete-Schepers dual feasible function u^(k) on [0, 1]: any set of groups whose sizes sum
    to at most N has u-values summing to at most 1."""
    y = (k + 1) * x
    return x if abs(y - round(y)) < 1e-12 else math.floor(y) / k


def packing_bound(inst: Instance, m_min: int) -> float:
    """A critical-path-with-packing bound, maximised over DFFs and a Lagrange weight.

    Per micro-batch, ``M - b >= T_g`` for each group, so ``M - b >= sum_g f(d_g / N) T_g`` for a
    dual feasible ``f``, and ``M - b >= sum_g d_g T_g / N``. Any convex combination holds, and
    it separates over sequences: ``sum_i min_d [lam f(d/N) + (1 - lam) d/N] T_i(d) + m_min b``.
    A check of whether long sequences' packing alone forces the gap (docs/results/solver.md).
    """
    n = inst.world_size
    times = np.asarray(inst.times, dtype=np.float64)
    fits = np.zeros_like(times, dtype=bool)
    for i, j in enumerate(inst.dmin):
        fits[i, j:] = True
    share = np.asarray(inst.sizes, dtype=np.float64) / n
    best = 0.0
    for k in range(1, 9):
        f = np.array([_dff(k, x) for x in share])
        for lam in np.linspace(0.0, 1.0, 51):
            val = np.where(fits, (lam * f + (1 - lam) * share)[None, :] * times, np.inf)
            best = max(best, float(val.min(axis=1).sum()))
    return best + m_min * inst.min_fixed


def decompose(lengths: list[int], cost, cluster: Cluster, budget: float) -> dict[str, float]:
    """Plan ``lengths`` and split its step time and the bound's main term by cause (ms)."""
    n = cluster.world_size
    sizes = planning_sizes(resolve_sizes(cost, cluster, None), cluster.gpus_per_node)
    inst = Instance.build(check_lengths(lengths, cost, sizes), cost, cluster, sizes)
    plan = solve(lengths, cost, cluster, SolverConfig(time_budget_s=budget))
    m_min = max(1, math.ceil(sum(lengths) / (n * inst.cap)))
    work = fixed = idle = 0.0
    for mb in plan.microbatches:
        used = 0
        for g in mb.groups:
            d = len(g.ranks)
            used += d
            if not g.lengths:
                idle += d * mb.est_ms
                continue
            split = (g.ulysses, g.ring) if g.ulysses else None
            seq = float(cost.seq_ms(g.lengths, d, split).sum())
            fix = cost.fixed_ms(d, split)
            work += d * seq
            fixed += d * fix
            idle += d * (mb.est_ms - seq - fix)
        idle += (n - used) * mb.est_ms
    return {
        "plan": plan.est_step_ms,
        "bound": plan.lower_bound_ms,
        "work_term": sum(inst.work_min) / n + m_min * inst.min_fixed,
        "inflation": (work - sum(inst.work_min)) / n,
        "fixed_extra": fixed / n - m_min * inst.min_fixed,
        "idle": idle / n,
        "microbatches": float(len(plan.microbatches)),
        "m_min": float(m_min),
        "check": (work + fixed + idle) / n,
        "packing": packing_bound(inst, m_min),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--gpus", type=int, default=64)
    ap.add_argument("--global-batch", type=int, default=512)
    ap.add_argument("--cost-model", default="flexsp-gpt-7b")
    ap.add_argument("--budget", type=float, default=1.0)
    args = ap.parse_args(argv)
    cost = load_cost_model(args.cost_model, world_size=args.gpus, max_seq_k=192)
    cluster = Cluster(args.gpus, 8)
    rng = np.random.default_rng(0)
    print(
        f"{args.cost_model}, {args.gpus} GPUs, GBS {args.global_batch}, {args.steps} sequential "
        f"batches, budget {args.budget:g} s; seconds summed over the batches\n"
    )
    print(
        "| distribution | plan | bound | gap | bound's work term | size inflation | fixed / "
        "extra micro-batches | idle ranks | micro-batches (memory floor) | packing bound |\n|"
        + "---|"
        * 10
    )
    for name in DISTRIBUTIONS:
        tot: dict[str, float] = {}
        for batch in sequential_batches(name, cost, args.global_batch, args.steps, rng):
            for k, v in decompose(batch, cost, cluster, args.budget).items():
                tot[k] = tot.get(k, 0.0) + v
        assert abs(tot["check"] - tot["plan"]) <= 1e-6 * tot["plan"] + 1e-6, tot
        sec = {k: v / 1e3 for k, v in tot.items()}
        print(
            f"| {name} | {sec['plan']:.2f} | {sec['bound']:.2f} | "
            f"{(tot['plan'] / tot['bound'] - 1) * 100:.1f}% | {sec['work_term']:.2f} | "
            f"{sec['inflation']:.2f} | {sec['fixed_extra']:.2f} | {sec['idle']:.2f} | "
            f"{tot['microbatches']:.0f} ({tot['m_min']:.0f}) | {sec['packing']:.2f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
