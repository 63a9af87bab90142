"""Pre-created aligned SP groups: slot -> global rank mapping (tp fastest), counts, membership.

One 4-process spawn serves every distributed check here (process start-up dominates on 2 cores).
"""

from __future__ import annotations

from datetime import timedelta

import pytest

from megatron_hsp.planner.errors import InputError
from megatron_hsp.runtime.groups import RankLayout


def test_rank_layout_matches_megatron_order():
    lay = RankLayout(world_size=16, tensor_parallel=2, pipeline_parallel=2)
    assert lay.num_slots == 4
    # tp fastest, then slots (dp x cp), then pipeline stages
    assert lay.slot_ranks([0, 1, 2, 3], tp_rank=1, pp_rank=0) == [1, 3, 5, 7]
    assert lay.global_rank(slot=2, tp_rank=0, pp_rank=1) == 12
    for r in range(16):
        assert lay.global_rank(*lay.coords(r)) == r
    with pytest.raises(InputError, match="not a multiple"):
        RankLayout(world_size=6, tensor_parallel=4)


def _registry(rank, sizes):
    import torch
    import torch.distributed as dist

    from megatron_hsp.runtime.groups import create_groups_from_megatron

    reg = create_groups_from_megatron(4, sizes=sizes, timeout=timedelta(seconds=60))
    members = {}
    for key, pg in sorted(reg.groups.items()):
        t = torch.tensor([float(rank)])
        dist.all_reduce(t, group=pg)  # the group really contains exactly these ranks
        members[key] = (dist.get_process_group_ranks(pg), float(t))
    return {"created": reg.created, "slot": reg.slot, "members": members, "sizes": reg.sizes}


def _lazy(rank):
    """A lazy registry creates nothing until ``ensure``; then exactly the asked sizes."""
    import torch
    import torch.distributed as dist

    from megatron_hsp.runtime.groups import create_groups_from_megatron

    reg = create_groups_from_megatron(4, timeout=timedelta(seconds=60), lazy=True)
    out = {"before": (reg.created, sorted(reg.groups)), "pending": sorted(reg.pending)}
    try:
        reg.group(2, rank // 2)
    except InputError as exc:
        out["early"] = str(exc)
    out["made"] = reg.ensure([4, 2, 2])
    out["again"] = reg.ensure([2])
    t = torch.tensor([float(rank)])
    dist.all_reduce(t, group=reg.group(2, rank // 2))
    out["after"] = (reg.created, sorted(reg.groups), float(t), sorted(reg.pending))
    return out


def _worker(rank, world_size):
    from megatron_hsp.testing.dist import init_cpu_megatron

    out = {"tp1": _registry(rank, None), "lazy": _lazy(rank)}
    try:
        _registry(rank, [5])
        out["bad"] = "no error"
    except InputError as exc:
        out["bad"] = str(exc)
    init_cpu_megatron(rank, world_size, "", tensor_model_parallel_size=2)
    out["tp2"] = _registry(rank, None)
    return out


@pytest.fixture(scope="module")
def results():
    from megatron_hsp.testing.dist import raise_rank_errors, run_distributed

    return raise_rank_errors(run_distributed(_worker, 4, timeout_s=300))


@pytest.mark.spawns
@pytest.mark.dist
def test_groups_tp1_all_sizes(results):
    for rank, res in enumerate(results):
        r = res["tp1"]
        assert r["sizes"] == (1, 2, 3, 4)
        assert r["created"] == 4 + 2 + 1 + 1  # size 3: one block, slots 0-2
        if rank < 3:
            assert r["members"][(3, 0)] == ([0, 1, 2], 3.0)
        assert r["slot"] == rank
        assert r["members"][(1, rank)] == ([rank], float(rank))
        pair = [rank - rank % 2, rank - rank % 2 + 1]
        assert r["members"][(2, rank // 2)] == (pair, float(sum(pair)))
        assert r["members"][(4, 0)] == ([0, 1, 2, 3], 6.0)


@pytest.mark.spawns
@pytest.mark.dist
def test_groups_tp2_use_same_tp_rank(results):
    # 2 slots x tp 2: slot = rank // 2; the size-2 group of tp rank t is {t, t + 2}
    for rank, res in enumerate(results):
        r = res["tp2"]
        assert r["created"] == (2 + 1) * 2
        assert r["slot"] == rank // 2
        same_tp = [rank % 2, rank % 2 + 2]
        assert r["members"][(2, 0)] == (same_tp, float(sum(same_tp)))
        assert r["members"][(1, rank // 2)] == ([rank], float(rank))


@pytest.mark.spawns
@pytest.mark.dist
def test_bad_size_fails_on_every_rank(results):
    assert all("group sizes [5] do not tile 4" in r["bad"] for r in results)


@pytest.mark.spawns
@pytest.mark.dist
def test_lazy_registry_creates_only_the_sizes_plans_use(results):
    for rank, res in enumerate(results):
        r = res["lazy"]
        assert r["before"] == (0, []) and r["pending"] == [1, 2, 3, 4]
        assert "size 2 are not created yet (lazy registry)" in r["early"]
        assert r["made"] == [2, 4] and r["again"] == []
        pair = [rank - rank % 2, rank - rank % 2 + 1]
        created, keys, total, pending = r["after"]
        assert created == 2 + 1 and keys == [(2, rank // 2), (4, 0)]
        assert total == float(sum(pair)) and pending == [1, 3]
