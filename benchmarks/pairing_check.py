"""What pairing long sequences can reach, with and without the runtime's placement rule.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/pairing_check.py [--cost-model flexsp-gpt-7b]

This checks whether the 17-27% gap to the lower bound on long-heavy distributions is
the planner's or the bound's. On those batches almost all work is in sequences that cannot run on
one rank, each needing a multi-rank group, so a micro-batch holds one or two of them. This script
prices, for batch 0 of each suite distribution (64 GPUs, GBS 512, 192k), every pair of such long
sequences as the better of one shared group and two groups side by side over all legal size
pairs, matches pairs greedily by the time they save against running alone, and sums the
micro-batch times. Twice: (a) any two sizes whose sum fits the ranks, which the lower bound's
facts also assume (none models placement), and (b) only size pairs that ``greedy.groups_fit``
places (aligned blocks, the runtime's rule: 40 + 24 does not tile 64 ranks). Short sequences are
left out (their total minimum work over all ranks is printed; they fit beside the long groups).
Neither column is a bound: (a) is what a plan structure would cost if placement were free, so a
bound that ignores placement cannot rise much above it; (b) is a heuristic under the real rule.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from suite import DISTRIBUTIONS, generate

from megatron_hsp.planner.cost.costmodel import load_cost_model
from megatron_hsp.planner.search.greedy import groups_fit
from megatron_hsp.planner.search.instance import Instance, check_lengths, resolve_sizes
from megatron_hsp.planner.search.settings import SolverConfig
from megatron_hsp.planner.search.solver import solve
from megatron_hsp.planner.topology import Cluster

GPUS, GBS, MAX_SEQ = 64, 512, 192_000


def pairing_total(inst: Instance, cluster: Cluster, placed: bool) -> tuple[float, int, int]:
    """(sum of micro-batch times, pairs, long sequences) of a greedy pairing of long ones."""
    n, cap = inst.world_size, inst.cap
    ids = np.asarray([i for i in range(len(inst.lengths)) if inst.lengths[i] > cap])
    nl, ns = len(ids), len(inst.sizes)
    if nl == 0:
        return 0.0, 0, 0
    sizes = np.asarray(inst.sizes)
    fixed = np.asarray(inst.fixed)
    lengths = inst.lengths_np[ids]
    times = inst.times_at(ids[:, None], np.arange(ns)[None, :])
    alone = np.where(lengths[:, None] <= cap * sizes[None, :], times + fixed[None, :], np.inf)
    side = np.zeros((ns, ns), dtype=bool)
    for j1 in range(ns):
        for j2 in range(ns):
            if sizes[j1] + sizes[j2] <= n:
                groups = [(int(sizes[j1]), (0,)), (int(sizes[j2]), (1,))]
                side[j1, j2] = groups_fit(inst, groups, cluster) if placed else True
    sep = np.full((nl, nl), np.inf)
    for j1 in range(ns):
        if side[j1].any():
            other = alone[:, side[j1]].min(axis=1)
            sep = np.minimum(sep, np.maximum(alone[:, j1][:, None], other[None, :]))
    shared = np.full((nl, nl), np.inf)
    both = lengths[:, None] + lengths[None, :]
    for j in range(ns):
        together = times[:, j][:, None] + times[:, j][None, :] + fixed[j]
        shared = np.where(both <= cap * sizes[j], np.minimum(shared, together), shared)
    pair = np.minimum(sep, shared)
    single = alone.min(axis=1)
    save = single[:, None] + single[None, :] - pair
    iu = np.triu_indices(nl, 1)
    gains = save[iu]
    used = np.zeros(nl, dtype=bool)
    total, pairs = 0.0, 0
    for e in np.lexsort((iu[1], iu[0], -gains)).tolist():
        a, b = int(iu[0][e]), int(iu[1][e])
        if gains[e] <= 0:
            break
        if not (used[a] or used[b]):
            used[a] = used[b] = True
            total += float(pair[a, b])
            pairs += 1
    total += float(single[~used].sum())
    return total, pairs, nl


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cost-model", default="flexsp-gpt-7b")
    args = ap.parse_args(argv)
    cost = load_cost_model(args.cost_model, world_size=GPUS, max_seq_k=MAX_SEQ // 1000)
    cluster = Cluster(GPUS, 8)
    sizes = resolve_sizes(cost, cluster, None)
    print(f"{cost.name}, {GPUS} GPUs, GBS {GBS}, batch 0 of each distribution (seed 0)\n")
    print(
        "| distribution | long seqs | hsp plan (s) | lower bound (s) | gap | pairing, placement "
        "free (s) | pairing, runtime placement (s) | short work / N (s) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name in DISTRIBUTIONS:
        if name == "wikipedia":
            continue  # no long sequences to pair at 192k on 64 GPUs
        lens = generate(name, 2 * GBS * 5, MAX_SEQ, np.random.default_rng(0))
        lens = lens[lens <= cost.max_trainable_length()]
        batch = [int(x) for x in lens[:GBS]]
        inst = Instance.build(check_lengths(batch, cost, sizes), cost, cluster, sizes)
        plan = solve(batch, cost, cluster, SolverConfig())
        free, _, nl = pairing_total(inst, cluster, placed=False)
        real, _, _ = pairing_total(inst, cluster, placed=True)
        short = sum(inst.work_min[i] for i in range(len(batch)) if inst.lengths[i] <= inst.cap)
        gap = plan.est_step_ms / plan.lower_bound_ms - 1
        print(
            f"| {name} | {nl} | {plan.est_step_ms / 1e3:.1f} | {plan.lower_bound_ms / 1e3:.1f} | "
            f"{gap:.1%} | {free / 1e3:.1f} | {real / 1e3:.1f} | {short / GPUS / 1e3:.1f} |",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
