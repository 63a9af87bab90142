"""The communication adapter (``runtime/comm.py``) and the rank-to-device rule.

Many ranks on one GPU run gloo groups with every collective staged through host buffers. Here
the ranks are CPU processes and their CPU tensors take the same staged path (a host copy, the
collective on it, the copy back), so everything but the CUDA kernels and the pinned copies runs
in CI: each collective against the direct one, the ring's side-stream-shaped shift, and whole
HSP training steps (Ulysses, fused and tiled ring, hybrid groups, dispatch, loss) on 4 and 8
ranks against the independent reference (the selftest's cases).
"""

from __future__ import annotations

import pytest
import torch

from megatron_hsp.runtime.comm import DIRECT, HOST_STAGED, DirectComm, comm, rank_device
from megatron_hsp.testing.dist import raise_rank_errors, run_distributed


def test_rank_device_rule():
    assert rank_device("cpu", 5) == torch.device("cpu")
    assert rank_device("cpu", 5, ranks_share_device=True) == torch.device("cpu")
    assert rank_device("cuda", 5) == torch.device("cuda", 5)
    assert rank_device("cuda", 5, ranks_share_device=True) == torch.device("cuda", 0)
    with pytest.raises(ValueError, match="choose cuda or cpu"):
        rank_device("xpu", 0)


def test_the_default_adapter_is_direct():
    assert comm() is DIRECT and not DIRECT.staged and HOST_STAGED.staged


def _collectives(rank: int, world: int, staged: bool) -> dict:
    """Every collective of the adapter, staged or direct, on this rank's CPU tensors."""
    import torch.distributed as dist

    adapter = comm()
    assert adapter.staged is staged, "init_megatron chose the wrong adapter"
    before = getattr(adapter, "calls", 0)
    x = torch.arange(world * 3, dtype=torch.float32) + 100 * rank
    a2a = torch.empty_like(x)
    adapter.all_to_all_single(a2a, x, None)
    gathered = [torch.empty(2, dtype=torch.bfloat16) for _ in range(world)]
    adapter.all_gather(gathered, torch.full((2,), float(rank), dtype=torch.bfloat16), None)
    red = torch.full((4,), float(rank + 1), dtype=torch.float64)
    adapter.all_reduce(red)
    send = torch.full((3,), float(rank))
    recv = torch.empty(3)
    ops = [
        dist.P2POp(dist.isend, send, (rank + 1) % world),
        dist.P2POp(dist.irecv, recv, (rank - 1) % world),
    ]
    works = adapter.batch_isend_irecv(ops)
    for w in works:
        w.wait()
    return {
        "a2a": a2a.tolist(),
        "gathered": [g.float().tolist() for g in gathered],
        "reduced": red.tolist(),
        "recv": recv.tolist(),
        "staged_calls": getattr(adapter, "calls", 0) - before,
        "x_untouched": x.tolist() == (torch.arange(world * 3) + 100 * rank).float().tolist(),
    }


def _collectives_worker(rank: int, world: int) -> dict:
    return _collectives(rank, world, staged=True)


@pytest.mark.spawns
@pytest.mark.dist
def test_staged_collectives_equal_what_each_collective_must_return():
    world = 4
    results = raise_rank_errors(
        run_distributed(_collectives_worker, world, timeout_s=120, ranks_share_device=True)
    )
    for rank, got in enumerate(results):
        # all-to-all: chunk j of rank i lands as chunk i on rank j
        expected = [float(3 * rank + k + 100 * src) for src in range(world) for k in range(3)]
        assert got["a2a"] == expected
        assert got["gathered"] == [[float(r)] * 2 for r in range(world)]
        assert got["reduced"] == [float(sum(range(1, world + 1)))] * 4
        assert got["recv"] == [float((rank - 1) % world)] * 3
        assert got["staged_calls"] == 4 and got["x_untouched"]


class _Counting(DirectComm):
    """Stands in for the adapter to prove the attention's collectives all go through it."""

    def __init__(self) -> None:
        self.names: list[str] = []

    def all_to_all_single(self, output, input, group):
        self.names.append("all_to_all_single")
        HOST_STAGED.all_to_all_single(output, input, group)

    def all_gather(self, outputs, input, group):
        self.names.append("all_gather")
        HOST_STAGED.all_gather(outputs, input, group)

    def all_reduce(self, tensor, group=None, op=None):
        self.names.append("all_reduce")
        HOST_STAGED.all_reduce(tensor, group, op)

    def batch_isend_irecv(self, ops):
        self.names.append("batch_isend_irecv")
        return HOST_STAGED.batch_isend_irecv(ops)


def _hybrid_attention_worker(rank: int, world: int) -> list[str]:
    """Ulysses 2 x ring 2 attention, forward and backward, with a counting adapter: every
    collective the attention issues must reach it (none may call torch directly)."""
    import torch.distributed as dist

    from megatron_hsp.runtime import comm as comm_module
    from megatron_hsp.runtime.ring import ring_attention
    from megatron_hsp.runtime.ulysses import all_to_all_head_to_seq, all_to_all_seq_to_head

    counting = _Counting()
    comm_module.use_comm(counting)
    u_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank, same order
    u_group = u_groups[rank // 2]
    ring_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    ring_group = ring_groups[rank % 2]
    torch.manual_seed(rank)
    x = torch.randn(6, 4, 8, requires_grad=True)
    heads = all_to_all_seq_to_head(x, u_group)  # [12, 2, 8]
    t = heads.size(0)
    index = torch.arange(t) + t * (rank // 2)
    doc = torch.zeros(t, dtype=torch.int64)
    out = ring_attention(heads, heads, heads, index, doc, ring_group, scale=0.3, route="ring-tiled")
    fused = ring_attention(
        heads, heads, heads, index, doc, ring_group, scale=0.3, route="ring-fused"
    )
    back = all_to_all_head_to_seq(out + fused, u_group)
    back.sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()
    return sorted(set(counting.names))


@pytest.mark.spawns
@pytest.mark.dist
def test_ulysses_and_both_rings_issue_every_collective_through_the_adapter():
    results = raise_rank_errors(
        run_distributed(_hybrid_attention_worker, 4, timeout_s=180, ranks_share_device=True)
    )
    for names in results:
        assert {"all_to_all_single", "batch_isend_irecv"} <= set(names), names


def _selftest_staged(rank: int, world: int, names: tuple[str, ...]) -> dict:
    from megatron_hsp.testing.reference import ModelShape
    from megatron_hsp.testing.selftest import build_cases, distributed_worker

    cases = [c for c in build_cases(world) if c.name in names]
    before = HOST_STAGED.calls
    out = distributed_worker(rank, world, cases, ModelShape())
    out["staged"] = comm().staged
    out["staged_calls"] = HOST_STAGED.calls - before
    return out


@pytest.mark.spawns
@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.parametrize(
    "world,names",
    [
        (4, ("one-group-of-all", "ring-and-hybrid-groups", "tp2-with-dynamic-groups")),
        (8, ("mixed-sizes-in-one-microbatch", "ring-and-hybrid-groups")),
    ],
)
def test_training_steps_through_the_staged_adapter_match_the_reference(world, names):
    """The selftest's own cases (its independent stock megatron-core reference, its CPU
    tolerances) on ranks whose every runtime collective is host-staged."""
    from megatron_hsp.testing.tolerances import CPU

    results = raise_rank_errors(
        run_distributed(_selftest_staged, world, names, timeout_s=300, ranks_share_device=True)
    )
    for r in results:
        assert r["staged"] and r["staged_calls"] > 0
        assert {c["name"] for c in r["cases"]} == set(names)
        for c in r["cases"]:
            assert c["loss_rel_diff"] <= CPU.loss, c
            assert c["max_rel_grad_diff"] <= CPU.grad, c
