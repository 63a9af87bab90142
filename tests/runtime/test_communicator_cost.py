"""Communicators that cost what they are charged: the ring's shifts on the ring's own group,
each group warmed with its own collective (no all-reduce on groups that never all-reduce), one
group-creation call per family of groups where torch can split (checked on gloo by standing a
``new_group``-backed ``split_group`` in for NCCL's), and the memory charge at 1024 GPUs."""

from __future__ import annotations

import pytest

from megatron_hsp.planner.groupspace import (
    DEFAULT_MAX_COMMUNICATORS,
    Cluster,
    HeadSpace,
    communicator_memory_gb,
    sizes_within_communicator_budget,
    startup_calls_per_rank,
)
from megatron_hsp.testing.dist import raise_rank_errors, run_distributed


def test_memory_charge_at_1024_gpus_with_the_default_cap_is_at_most_4_gb():
    heads = HeadSpace.from_model(32, 8, 1)
    cluster = Cluster(1024, 8)
    kept = sizes_within_communicator_budget(
        cluster.legal_sizes(), 8, DEFAULT_MAX_COMMUNICATORS, heads
    )
    gb = communicator_memory_gb(kept, heads)
    assert 1 < gb <= 4.0, gb
    # one pure-Ulysses size: 16 MiB plus, for each of its d - 1 all-to-all peers, two channels
    # of a Simple (4 MiB), LL128 (4,915,200 B) and LL (512 KiB) buffer at both ends
    peer = 2 * 2 * (4 * 2**20 + 4_915_200 + 2**19)
    assert communicator_memory_gb([8], heads) == pytest.approx((16 * 2**20 + 7 * peer) / 1e9)
    # a ring's shifts connect two peers whatever its length; size 1 holds nothing
    ring = HeadSpace(1, 1)
    assert communicator_memory_gb([7], ring) == pytest.approx((16 * 2**20 + 2 * peer) / 1e9)
    assert communicator_memory_gb([1], heads) == 0


def _recording(rank: int, world: int, heads: HeadSpace, sizes: list[int]) -> dict:
    """Create the groups (and run one ring shift) with the collectives recorded per group."""
    import torch
    import torch.distributed as dist

    from megatron_hsp.runtime import groups as groups_mod
    from megatron_hsp.runtime import ring as ring_mod

    calls: list[tuple[str, tuple[int, ...] | None]] = []

    def ranks_of(group) -> tuple[int, ...] | None:
        return None if group is None else tuple(dist.get_process_group_ranks(group))

    def wrap(name: str, fn):
        def inner(*args, **kwargs):
            calls.append((name, ranks_of(kwargs.get("group"))))
            return fn(*args, **kwargs)

        return inner

    real_p2p = dist.P2POp

    class RecordingP2POp(real_p2p):
        def __init__(self, op, tensor, peer=None, group=None, *args, **kwargs):
            calls.append(("p2p", ranks_of(group)))
            super().__init__(op, tensor, peer, group, *args, **kwargs)

    dist.all_reduce = wrap("all_reduce", dist.all_reduce)
    dist.all_to_all_single = wrap("all_to_all", dist.all_to_all_single)
    dist.P2POp = RecordingP2POp
    reg = groups_mod.create_groups(world, heads=heads, sizes=sizes)
    warm = list(calls)
    calls.clear()
    shifted = {}
    for (size, _block), (_, sub_r) in reg.hybrids.items():
        got = ring_mod.ring_shift(torch.full((1,), float(rank)), sub_r)
        shifted[size] = (ranks_of(sub_r), int(got.item()))
    return {
        "warm": warm,
        "shift": list(calls),
        "shifted": shifted,
        "hybrids": {size: (ranks_of(u), ranks_of(r)) for (size, _), (u, r) in reg.hybrids.items()},
        "blocks": {size: ranks_of(g) for (size, _), g in reg.groups.items()},
    }


@pytest.mark.spawns
@pytest.mark.dist
def test_ring_shifts_go_over_the_ring_group_and_groups_warm_with_their_own_collective():
    """4 gloo ranks, 2 heads: size 4 is hybrid (2 x 2), 3 is pure ring (1 x 3), 2 pure Ulysses."""
    heads = HeadSpace(2, 2)
    out = raise_rank_errors(run_distributed(_recording, 4, heads, [1, 2, 3, 4], timeout_s=120))
    for rank, r in enumerate(out):
        # the ring's P2POps all name the ring's group (not the world communicator)
        assert r["shift"], r
        ring_groups = {v[0] for v in r["shifted"].values()}
        assert all(name == "p2p" and g in ring_groups for name, g in r["shift"]), r["shift"]
        for ring_ranks, got in r["shifted"].values():
            me = ring_ranks.index(rank)
            assert got == ring_ranks[(me - 1) % len(ring_ranks)]
        # warm-up: no all-reduce; all-to-all on Ulysses groups, the ring's p2p on ring groups
        assert not [c for c in r["warm"] if c[0] == "all_reduce"], r["warm"]
        a2a = {g for name, g in r["warm"] if name == "all_to_all"}
        p2p = {g for name, g in r["warm"] if name == "p2p"}
        assert None not in a2a | p2p
        sub_u, sub_r = r["hybrids"][4]
        assert sub_u in a2a and sub_r in p2p and sub_u not in p2p
        assert r["blocks"][2] in a2a  # pure Ulysses block
        if 3 in r["blocks"]:
            assert r["blocks"][3] in p2p  # pure ring block
        # the hybrid block runs nothing itself: not warmed
        assert r["blocks"][4] not in a2a | p2p
        # the hybrid's Ulysses sub-group is the block of 2 (one communicator, not two)
        assert sub_u == r["blocks"][2]


def _split_worker(rank: int, world: int, heads: HeadSpace) -> dict:
    """The NCCL path on gloo: ``split_group`` stood in for by one ``new_group`` per split (what
    NCCL's one ``ncclCommSplit`` creates), counted."""
    import torch
    import torch.distributed as dist

    from megatron_hsp.runtime import groups as groups_mod

    splits = []
    new_groups = []
    real_new_group = dist.new_group

    def new_group(*args, **kwargs):
        new_groups.append(1)
        return real_new_group(*args, **kwargs)

    def split_group(parent_pg=None, split_ranks=None, timeout=None, group_desc=None):
        assert parent_pg is None
        splits.append([list(s) for s in split_ranks])
        mine = None
        for s in split_ranks:
            pg = real_new_group(s)
            if rank in s:
                mine = pg
        return mine if mine is not None else dist.GroupMember.NON_GROUP_MEMBER

    dist.split_group = split_group
    dist.new_group = new_group
    groups_mod.can_split_groups = lambda *a, **k: True
    reg = groups_mod.create_groups(world, heads=heads)
    direct = len(new_groups)
    # the groups work: an all-to-all over each hybrid's Ulysses sub-group
    checks = []
    for sub_u, _ in reg.hybrids.values():
        if sub_u is not None:
            n = sub_u.size()
            send = torch.full((n,), float(rank))
            got = torch.empty_like(send)
            dist.all_to_all_single(got, send, group=sub_u)
            checks.append(got.tolist() == [float(x) for x in dist.get_process_group_ranks(sub_u)])
    return {
        "startup_calls": reg.startup_calls,
        "splits": len(splits),
        "direct_new_groups": direct,
        "predicted": startup_calls_per_rank(reg.cluster, reg.sizes, heads),
        "blocks": reg.cluster.process_group_count(reg.sizes, heads),
        "checks": checks,
    }


@pytest.mark.spawns
@pytest.mark.dist
def test_nccl_path_makes_one_split_call_per_family_not_one_per_block():
    """8 gloo ranks in one node, 6 heads: sizes 1..8; 4 (2 x 2) and 8 (2 x 4) are hybrid, whose
    Ulysses sub-groups are the blocks of 2, so each adds one family (its ring sub-groups):
    1 + 1 + 1 + 2 + 1 + 1 + 1 + 2 = 10 calls, against 26 groups."""
    out = raise_rank_errors(run_distributed(_split_worker, 8, HeadSpace(6, 2), timeout_s=180))
    for r in out:
        assert r["direct_new_groups"] == 0, r
        assert r["startup_calls"] == r["splits"] == r["predicted"] == 10, r
        assert r["blocks"] == 26, r
        assert r["checks"] and all(r["checks"]), r


def test_split_is_used_only_where_torch_can_split():
    """NCCL with a bound device and a ``split_group`` taking the arguments passed; never gloo."""
    import torch.distributed as dist

    from megatron_hsp.runtime.compat import can_split_groups

    def old_split(parent_pg=None, split_ranks=None, timeout=None, pg_options=None):
        return None  # no group_desc: not the call the runtime makes

    assert can_split_groups("nccl", "cuda:0", dist.split_group)  # the installed torch
    assert not can_split_groups("gloo", "cuda:0", dist.split_group)
    assert not can_split_groups("nccl", None, dist.split_group)
    assert not can_split_groups("nccl", "cuda:0", old_split)
