"""The long-sized chunking: cross-node sequences at the size that shortens the step, alone."""

from __future__ import annotations

import numpy as np

from megatron_hsp.planner.cost.costmodel import load_cost_model
from megatron_hsp.planner.search.chunking import chunk_long_sized, cross_node_size
from megatron_hsp.planner.search.instance import Instance, check_lengths, resolve_sizes
from megatron_hsp.planner.search.settings import CHUNKINGS, SolverConfig
from megatron_hsp.planner.search.solver import solve
from megatron_hsp.planner.topology import Cluster


def _setup():
    cost = load_cost_model("flexsp-gpt-7b", world_size=64, max_seq_k=192)
    return cost, Cluster(64, 8)


def _code_heavy_batch(cost) -> list[int]:
    """The suite's code-heavy-tail batch 1 (Pareto 1.1 from 512 tokens), inlined: one 192k and
    one 73k sequence among 510 mostly short ones."""
    rng = np.random.default_rng(0)
    x = np.clip(512 * (1 + rng.pareto(1.1, 5120)), 128, 192_000).astype(np.int64)
    x = x[x <= cost.max_trainable_length()]
    return x[512:1024].tolist()


def test_a_192k_sequence_runs_at_56_ranks_not_at_its_cheapest_40():
    """At 40 of 64 ranks it costs the fewest rank-ms (228 rank-s, 6.3 s) but its 24 other ranks
    hold 155k tokens of short sequences, about a third of the work that keeps them busy; at 56
    ranks the micro-batch takes 4.8 s beside 8 ranks that short sequences do keep busy."""
    cost, cluster = _setup()
    lengths = _code_heavy_batch(cost)
    sizes = resolve_sizes(cost, cluster, None)
    inst = Instance.build(check_lengths(lengths, cost, sizes), cost, cluster, sizes)
    i = lengths.index(192_000)
    j40, j56 = inst.sizes.index(40), inst.sizes.index(56)
    assert 40 * inst.times[i][j40] < 56 * inst.times[i][j56]  # 40 is the cheapest in rank-ms
    short = [k for k in range(len(lengths)) if inst.sizes[inst.dmin[k]] <= 8]
    density = sum(inst.work_min[k] for k in short) / sum(lengths[k] for k in short)
    assert cross_node_size(inst, i, density) == 56


def test_long_sized_is_a_partition_and_beats_the_other_chunkings_on_code_heavy_tail():
    cost, cluster = _setup()
    lengths = _code_heavy_batch(cost)
    sizes = resolve_sizes(cost, cluster, None)
    inst = Instance.build(check_lengths(lengths, cost, sizes), cost, cluster, sizes)
    chunks = chunk_long_sized(inst, cluster, 4)
    assert chunks is not None
    assert sorted(i for c in chunks for i in c) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in c) <= inst.world_size * inst.cap for c in chunks)
    others = tuple(k for k in CHUNKINGS if k != "long-sized")
    # A generous budget: on a loaded machine the 1 s default may end the search before the
    # second chunking of the first count.
    without = solve(lengths, cost, cluster, SolverConfig(chunkings=others, time_budget_s=10.0))
    with_it = solve(lengths, cost, cluster, SolverConfig(time_budget_s=10.0))
    with_it.validate(lengths, cost, cluster.world_size)
    assert with_it.est_step_ms < 0.95 * without.est_step_ms  # 11.25 s against 12.33 s
    assert with_it.extra["chunking"].startswith("long-sized")
