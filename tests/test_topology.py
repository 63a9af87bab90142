"""Aligned rank blocks: the one rule planner, validator and runtime share."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from megatron_hsp.planner import Cluster, InputError


def test_legal_sizes_64_in_nodes_of_8() -> None:
    c = Cluster(64, 8)
    assert c.power_of_two_sizes() == [1, 2, 4, 8, 16, 32, 64]
    # Non-powers of two only where blocks stay whole: inside a node sizes must divide 8,
    # across nodes they must be whole nodes.
    assert 3 not in c.legal_sizes() and 6 not in c.legal_sizes()
    assert 24 in c.legal_sizes()
    assert c.aligned_blocks(24) == [tuple(range(0, 24)), tuple(range(24, 48))]


def test_small_world_below_one_node() -> None:
    c = Cluster(6, 8)
    assert c.legal_sizes() == [1, 2, 3, 6]
    assert c.aligned_blocks(3) == [(0, 1, 2), (3, 4, 5)]


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
    with pytest.raises(InputError, match=r"group size 6 does not tile .* legal sizes: \[1, 2, 4"):
        Cluster(16, 8).aligned_blocks(6)


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
    if c.world_size % size == 0:
        assert sorted(flat) == list(range(c.world_size))
