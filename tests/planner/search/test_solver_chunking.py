"""Chunking: memory sets the fewest micro-batches; chunks balance time, not tokens."""

from __future__ import annotations

import random

import pytest

from megatron_hsp.planner.errors import InputError
from megatron_hsp.planner.search.chunking import (
    candidate_counts,
    chunk_contiguous,
    chunk_time_balanced,
    min_microbatches,
)
from megatron_hsp.planner.search.instance import Instance
from megatron_hsp.planner.search.settings import SolverConfig
from megatron_hsp.planner.search.solver import solve
from megatron_hsp.planner.topology import Cluster
from tests.helpers.solver import toy_cost


def _inst(lengths, world=8, cap=4000):
    cluster = Cluster(world, world)
    cost = toy_cost(world, cap, attn=1e-4)
    return Instance.build(lengths, cost, cluster, cluster.legal_sizes()), cluster, cost


def test_memory_sets_the_fewest_microbatches():
    inst, _, _ = _inst([3000] * 30)  # 90k tokens, 32k per micro-batch
    assert min_microbatches(inst) == 3
    assert candidate_counts(inst, 2) == [3, 4, 5]


def test_time_balanced_chunks_balance_work_not_tokens():
    rng = random.Random(0)
    lengths = [rng.choice([200, 300, 400]) for _ in range(200)] + [6000, 5000, 4000]
    inst, _, _ = _inst(lengths, cap=20_000)
    chunks = chunk_time_balanced(inst, 3)
    assert sorted(i for c in chunks for i in c) == list(range(len(lengths)))
    work = [sum(inst.work_min[i] for i in c) for c in chunks]
    # LPT: loads differ by at most the largest single item placed.
    assert max(work) - min(work) <= max(inst.work_min)
    # The three long sequences land in different micro-batches.
    longs = {next(b for b, c in enumerate(chunks) if i in c) for i in (200, 201, 202)}
    assert len(longs) == 3
    # FlexSP's contiguous token split puts them together instead.
    contiguous = chunk_contiguous(inst, 3, "tokens")
    assert {200, 201, 202} <= set(contiguous[0])


def test_time_balanced_chunks_respect_token_room():
    inst, _, _ = _inst([3000] * 30)
    for chunk in chunk_time_balanced(inst, 3):
        assert sum(inst.lengths[i] for i in chunk) <= 8 * 4000


def test_unknown_chunking_is_rejected():
    _, cluster, cost = _inst([100])
    with pytest.raises(InputError, match="choose one or more of"):
        solve([100], cost, cluster, SolverConfig(chunkings=("zigzag",)))


@pytest.mark.parametrize(
    "kinds", [("long-grouped",), ("long-sized",), ("long-grouped", "long-sized")]
)
def test_chunkings_that_apply_to_some_batches_only_name_the_fix_when_they_do_not(kinds):
    """Alone, they are built once and only for some batches (a 100-token batch has no long
    sequence): the search found nothing and said "no schedule found even with one sequence per
    micro-batch", which blamed the batch; now the error names the chunkings and the fix."""
    _, cluster, cost = _inst([100])
    with pytest.raises(InputError, match="do not apply to this batch; include one of"):
        solve([100], cost, cluster, SolverConfig(chunkings=kinds))
