"""A bounded communicator budget (issue 15): no duplicate group for pure ring blocks, no
communicator for groups of one rank, a cap on the sizes (and so communicators) per rank, their
memory charged to the planner's cap, and the table of ``benchmarks/communicators.py``."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from megatron_hsp.megatron.config import validate_hsp_args
from megatron_hsp.megatron.refusals import HSPArgsError
from megatron_hsp.planner.groupspace import (
    DEFAULT_MAX_COMMUNICATORS,
    Cluster,
    HeadSpace,
    communicator_memory_gb,
    communicators_for_size,
    communicators_per_rank,
    sizes_within_communicator_budget,
)
from megatron_hsp.planner.run_spec import method_heads
from tests.helpers import ROOT
from tests.helpers.megatron_args import parse


def test_communicators_per_size_follow_the_split():
    h8 = HeadSpace.from_model(8, 2, 1)  # 3 = 1 x 3 (pure ring), 4 = 4 x 1 (Ulysses)
    h6 = HeadSpace.from_model(6, 2, 1)  # 4 = 2 x 2 (hybrid)
    assert [communicators_for_size(d, h8) for d in (1, 2, 3, 4)] == [0, 1, 1, 1]
    assert communicators_for_size(4, h6) == 3  # block + its Ulysses and its ring sub-group
    assert communicators_per_rank([1, 2, 3, 4], h8) == 3


def test_budget_keeps_the_largest_and_the_power_of_two_ladder_first():
    heads = HeadSpace.from_model(32, 8, 1)
    sizes = Cluster(1024, 8).legal_sizes()
    # every legal size: 260 (386 while a hybrid split's Ulysses sub-group, the same ranks as a
    # block of its Ulysses degree, was a communicator of its own for every hybrid size)
    assert communicators_per_rank(sizes, heads) == 260
    kept = sizes_within_communicator_budget(sizes, 8, DEFAULT_MAX_COMMUNICATORS, heads)
    assert communicators_per_rank(kept, heads) <= DEFAULT_MAX_COMMUNICATORS
    assert {1, 1024} <= set(kept)
    assert {2**k for k in range(11)} <= set(kept)
    # a tiny cap still keeps size 1 and the largest (whose Ulysses sub-group is the block of 32)
    assert sizes_within_communicator_budget(sizes, 8, 3, heads) == [1, 32, 1024]
    with pytest.raises(ValueError):
        sizes_within_communicator_budget(sizes, 8, 0, heads)


@pytest.mark.spawns
def test_communicators_benchmark_contract_and_bound():
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "communicators.py"), "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    doc = json.loads(out)
    assert set(doc) == {"8", "64", "1024", "4096"}
    for row in doc.values():
        assert set(row) == {
            "groups",
            "communicators_per_rank",
            "est_gb_per_rank",
            "startup_calls_per_rank",
        }
        assert 0 < row["communicators_per_rank"] <= DEFAULT_MAX_COMMUNICATORS
    # 29 with a duplicate group per pure ring block, 25 with a Ulysses sub-group per hybrid block
    assert doc["8"]["groups"] == 22


BASE = [
    *("--num-attention-heads", "32", "--group-query-attention", "--num-query-groups", "8"),
    *("--global-batch-size", "64", "--seq-length", "4096", "--eval-iters", "0"),
    *("--attention-dropout", "0"),
]


def test_auto_sizes_are_narrowed_to_the_cap_with_a_note():
    cfg = validate_hsp_args(parse([*BASE, "--hsp", "--hsp-max-communicators", "4"], 64), env={})
    assert communicators_per_rank(cfg.group_sizes, HeadSpace.from_model(32, 8, 1)) <= 4
    assert 64 in cfg.group_sizes and 1 in cfg.group_sizes
    assert any("--hsp-max-communicators 4" in n for n in cfg.notes), cfg.notes


def test_requested_sizes_over_the_cap_are_refused():
    argv = [*BASE, "--hsp", "--hsp-group-sizes", "1,2,4,8", "--hsp-max-communicators", "2"]
    with pytest.raises(HSPArgsError, match="--hsp-max-communicators 2"):
        validate_hsp_args(parse(argv, 8), env={})
    with pytest.raises(HSPArgsError, match="must be >= 1"):
        validate_hsp_args(parse([*BASE, "--hsp", "--hsp-max-communicators", "0"], 8), env={})


def test_communicator_memory_is_charged_to_the_planner_cap():
    cfg = validate_hsp_args(
        parse([*BASE, "--hsp", "--hsp-memory-cap-gb", "60", "--hsp-cost-model", "flexsp-gpt-7b"]),
        env={},
    )
    comms = communicators_per_rank(cfg.group_sizes, HeadSpace.from_model(32, 8, 1))
    assert comms > 0
    charge = communicator_memory_gb(cfg.group_sizes, HeadSpace.from_model(32, 8, 1))
    assert cfg.memory_cap_gb == pytest.approx(60 - charge)
    assert any("communicators" in n and "memory cap" in n for n in cfg.notes)


def _groups_worker(rank: int, world: int, q_heads: int, method: str) -> dict:
    from megatron_hsp.runtime.groups import create_groups

    heads = method_heads(HeadSpace.from_model(q_heads, 2, 1), method)
    reg = create_groups(world, heads=heads)
    pure_ring = {
        key: sub_r is reg.groups[key]
        for key, (sub_u, sub_r) in reg.hybrids.items()
        if sub_u is None
    }
    return {
        "created": reg.created,
        "expected": reg.cluster.process_group_count(reg.sizes, heads),
        "communicators": reg.communicators,
        "predicted": communicators_per_rank(reg.sizes, heads),
        "pure_ring_reuses_block": pure_ring,
        "splits": {d: reg.split(d) for d in reg.sizes},
    }


@pytest.mark.spawns
@pytest.mark.dist
@pytest.mark.parametrize(("q_heads", "method"), [(8, "hsp"), (6, "hsp"), (8, "megatron-dcp")])
def test_created_groups_match_the_pure_count_and_pure_ring_reuses_its_block(q_heads, method):
    """4 gloo ranks. 8 heads: a group of 3 is pure ring, which used to get a second, identical
    group (created = count + 1); 6 heads: a group of 4 is hybrid (block + 2 sub-groups);
    megatron-dcp's registry (``run_spec.method_heads``): every size pure ring, on its block."""
    from megatron_hsp.testing.dist import raise_rank_errors, run_distributed

    out = raise_rank_errors(run_distributed(_groups_worker, 4, q_heads, method, timeout_s=120))
    for r in out:
        assert r["created"] == r["expected"], r
        assert r["communicators"] <= r["predicted"]
        assert all(r["pure_ring_reuses_block"].values())
    # rank 0 is in a block of every size: it holds exactly the predicted communicators
    assert out[0]["communicators"] == out[0]["predicted"]
    if q_heads == 8:
        assert out[0]["pure_ring_reuses_block"]  # the size-3 block ran pure ring
    ring_only = {d: (1, d) for d in (1, 2, 3, 4)}
    assert (out[0]["splits"] == ring_only) is (method == "megatron-dcp"), out[0]["splits"]
    if method == "megatron-dcp":  # sizes 2, 3 and 4 each on their block, no sub-group
        assert set(out[0]["pure_ring_reuses_block"]) == {(2, 0), (3, 0), (4, 0)}
