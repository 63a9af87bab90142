"""Aligned rank blocks: the one rule planner, validator and runtime share."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from megatron_hsp.planner import Cluster, InputError


def test_legal_sizes_64_in_nodes_of_8() -> None:
    c = Cluster(64, 8)
    assert c.power_of_two_sizes() == [1, 2, 4, 8, 16, 32, 64]
    # Every size up to a node, then whole nodes only.
    assert c.legal_sizes() == [1, 2, 3, 4, 5, 6, 7, 8, 16, 24, 32, 40, 48, 56, 64]
    assert c.aligned_blocks(24) == [tuple(range(0, 24)), tuple(range(24, 48))]
    # Sizes that do not divide a node sit inside each node, leaving its tail for smaller groups.
    assert c.aligned_blocks(3)[:3] == [(0, 1, 2), (3, 4, 5), (8, 9, 10)]
    assert not c.is_aligned_block((6, 7, 8)) and not c.is_aligned_block((1, 2, 3))
    assert 3 not in c.tiling_sizes() and 8 in c.tiling_sizes()


def test_process_groups_at_1024_are_bounded() -> None:
    # 128 nodes of 8: sum_{d<=8} floor(8/d) * 128 = 20 * 128 inside nodes, plus
    # sum_{k=2..128} floor(128/k) across them; reported in docs/runtime.md.
    c = Cluster(1024, 8)
    inside = sum(8 // d for d in range(1, 9)) * 128
    across = sum(128 // k for k in range(2, 129))
    assert c.process_group_count() == inside + across == 2560 + 517
    # With gpt-7b's 32 heads, hybrid blocks add their ring sub-groups and those Ulysses
    # sub-groups not already made (19000 when each hybrid size made its own).
    from megatron_hsp.planner.groupspace import HeadSpace

    with_subgroups = c.process_group_count(heads=HeadSpace(32, 32))
    assert with_subgroups == 9565
    assert with_subgroups < 20 * 1024


def test_small_world_below_one_node() -> None:
    c = Cluster(6, 8)
    assert c.legal_sizes() == [1, 2, 3, 4, 5, 6]
    assert c.aligned_blocks(3) == [(0, 1, 2), (3, 4, 5)]
    assert c.aligned_blocks(4) == [(0, 1, 2, 3)]


@pytest.mark.parametrize(
    ("world", "gpn", "message"),
    [
        (12, 8, "--gpus 12 is not a multiple of --gpus-per-node 8; use whole nodes .*--gpus 16"),
        (0, 8, "--gpus must be >= 1"),
        (8, 0, "--gpus-per-node must be >= 1"),
    ],
)
def test_bad_cluster_shapes(world: int, gpn: int, message: str) -> None:
    with pytest.raises(InputError, match=message):
        Cluster(world, gpn)


def test_illegal_size_names_legal_ones() -> None:
    with pytest.raises(InputError, match=r"group size 12 is not legal .* legal sizes: \[1, 2, 3"):
        Cluster(16, 8).aligned_blocks(12)


@given(nodes=st.integers(1, 16), gpn=st.sampled_from([1, 2, 4, 8]), data=st.data())
def test_blocks_are_aligned_disjoint_and_node_respecting(nodes: int, gpn: int, data) -> None:
    c = Cluster(nodes * gpn, gpn)
    size = data.draw(st.sampled_from(c.legal_sizes()))
    blocks = c.aligned_blocks(size)
    flat = [r for b in blocks for r in b]
    assert len(flat) == len(set(flat))
    for b in blocks:
        assert c.is_aligned_block(b)
        nodes_touched = {c.node_of(r) for r in b}
        if size <= gpn:
            assert len(nodes_touched) == 1
        else:
            assert len(b) == len(nodes_touched) * gpn
    if size in c.tiling_sizes():
        assert sorted(flat) == list(range(c.world_size))
    assert c.block_index(blocks[-1]) == len(blocks) - 1


def test_planning_sizes_bound_the_search_at_thousands_of_gpus():
    from megatron_hsp.planner.groupspace import Cluster, planning_sizes

    small = Cluster(1024, 8).legal_sizes()
    assert planning_sizes(small, 8) == small  # 135 sizes: all searched
    legal = Cluster(4096, 8).legal_sizes()
    got = planning_sizes(legal, 8)
    assert len(legal) == 519 and len(got) <= 40
    assert set(range(1, 9)) <= set(got) and {16, 32, 64, 128, 256, 512, 1024, 2048, 4096} <= set(
        got
    )
    assert set(got) <= set(legal)
    # Every legal size has a kept size at most 25% larger (rounded up to the next whole node):
    # no sequence needs more than about 25% more ranks than the best legal size for it.
    for d in legal:
        assert min(k for k in got if k >= d) <= d * 1.25 + 8, d


def test_solver_searches_the_planning_sizes_only():
    import numpy as np

    from megatron_hsp.planner.cost.costmodel import flexsp_cost_model
    from megatron_hsp.planner.groupspace import Cluster, planning_sizes
    from megatron_hsp.planner.search.settings import SolverConfig
    from megatron_hsp.planner.search.solver import solve

    cost = flexsp_cost_model("flexsp-gpt-7b", 4096, max_seq_k=192)
    lengths = np.random.default_rng(0).integers(1000, 180_000, size=64)
    plan = solve(lengths, cost, Cluster(4096, 8), SolverConfig(time_budget_s=1.0))
    allowed = set(planning_sizes(cost.sizes, 8))
    assert {g.size for mb in plan.microbatches for g in mb.groups} <= allowed
    assert not plan.problems(lengths.tolist(), cost, 4096)
