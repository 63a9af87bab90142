"""Ring and hybrid (Ulysses x ring) attention equal single-device attention (gloo, fp32).

The reference is ``test_attention_ulysses``'s independent float64 implementation (explicit
block-diagonal causal mask, explicit GQA head map and RoPE), not the ring code. Groups come from
the real ``create_groups(..., heads=...)``, so the sub-group layout is the runtime's own.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from megatron_hsp.planner.groupspace import HeadSpace
from megatron_hsp.runtime.layout import layout_order, rank_tokens, te_cp_arguments
from megatron_hsp.runtime.ring import merge_partials, partial_attention
from megatron_hsp.testing.dist import raise_rank_errors, run_distributed
from tests.runtime.test_attention_ulysses import (
    _make_core_attention,
    _rel,
    case_tensors,
    padded_cu,
    reference_attention,
    rope_table,
)

WORLD = 4
# name, group size, heads, kv heads, document lengths; the split is HeadSpace.split's.
CASES = [
    ("hybrid-2x2-gqa", 4, 6, 2, [5, 1, 7, 3, 2]),  # 6 heads: u=2, r=2
    ("ring-4-mqa", 4, 3, 1, [9, 1, 4, 6]),  # 3 heads share no factor with 4: u=1, r=4
    ("ring-3-odd", 3, 4, 4, [4, 1, 6]),  # non-power-of-two group, pure ring
    ("ulysses-2", 2, 4, 2, [3, 5]),  # r=1 through the same entry point
]


def test_merge_of_two_key_halves_equals_full_softmax() -> None:
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(6, 2, 4, generator=g, dtype=torch.float64) for _ in range(3))
    idx = torch.arange(6)
    doc = torch.tensor([0, 0, 0, 0, 0, 1])  # the key halves split document 0
    full, lse = partial_attention(q, k, v, idx, doc, idx, doc, 0.5)
    a = partial_attention(q, k[:3], v[:3], idx, doc, idx[:3], doc[:3], 0.5)
    b = partial_attention(q, k[3:], v[3:], idx, doc, idx[3:], doc[3:], 0.5)
    merged, mlse = merge_partials(*a, *b)
    assert torch.allclose(merged, full) and torch.allclose(mlse, lse)
    # Independent check of the full partial: softmax with an explicit mask.
    mask = (doc[:, None] == doc[None, :]) & (idx[None, :] <= idx[:, None])
    s = torch.einsum("ahd,bhd->hab", q, k) * 0.5
    ref = torch.einsum("hab,bhd->ahd", torch.softmax(s.masked_fill(~mask, -torch.inf), -1), v)
    assert torch.allclose(full, ref)
    # A wrong merge (plain sum of partials) is caught by the same comparison.
    assert not torch.allclose(a[0] + b[0], full)


# The TE context-parallel route's wiring (TE itself cannot run here): name, group size, heads, kv
# heads, documents, the cp_comm_type expected (None: segments not multiples of 2d -> torch ring).
TE_ROUTE_CASES = [
    ("te-a2a+p2p", 4, 6, 2, [16, 8, 24], "a2a+p2p"),
    ("te-p2p", 4, 3, 1, [8, 16], "p2p"),
    ("te-fallback", 4, 6, 2, [5, 1, 7, 3, 2], None),
]


class _GatherStandIn:
    """Test double for ``TEAttentionBackend.context_parallel`` (NOT Transformer Engine): gathers
    the group's local shards, undoes the layout and runs plain per-document attention, so the
    HSP side of the route (local shard, RoPE on it, groups, output shape) is checked on CPU."""

    name = "stand-in"

    def __init__(self) -> None:
        from megatron_hsp.runtime.attention import TorchAttentionBackend

        self.inner = TorchAttentionBackend()
        self.calls: list[str | None] = []

    def __call__(self, *args, **kwargs):
        return self.inner(*args, **kwargs)

    def context_parallel(
        self,
        q,
        k,
        v,
        cu,
        group,
        ulysses_group,
        ring_group,
        *,
        softmax_scale,
        cu_seqlens_host=None,
        micro_batch=None,
    ):
        import torch.distributed as dist

        u = 1 if ulysses_group is None else ulysses_group.size()
        r = ring_group.size()
        cu_np = cu.numpy()
        args = te_cp_arguments(cu_np, u, r)
        self.calls.append(None if args is None else args["cp_comm_type"])
        if args is None:
            return None
        full = []
        for t in (q, k, v):
            parts = [torch.empty_like(t) for _ in range(group.size())]
            dist.all_gather(parts, t.contiguous(), group=group)
            joined = torch.cat(parts)
            full.append(
                torch.empty_like(joined).index_copy_(
                    0, torch.from_numpy(layout_order(cu_np, u, r)), joined
                )
            )
        out = self.inner(*full, cu, 0, softmax_scale=softmax_scale, dropout_p=0.0)
        return out[torch.from_numpy(rank_tokens(cu_np, u, r, group.rank()))]


def _worker(rank: int, world: int) -> dict:
    from megatron.core.packed_seq_params import PackedSeqParams

    from megatron_hsp.runtime.attention import HSPPackedSeqParams, group_packed_seq_params
    from megatron_hsp.runtime.groups import create_groups

    results = {}
    for name, d, heads, kv_heads, docs in CASES:
        reg = create_groups(world, sizes=[1, d], heads=HeadSpace(heads, kv_heads), warm=False)
        block = reg.cluster.block_index(tuple(range(rank // d * d, rank // d * d + d)))
        if block < 0:  # this rank is outside every block of d (ring-3 on 4 ranks): idle
            results[name] = None
            continue
        group_rank = rank % d
        cu = padded_cu(docs, d)
        total = cu[-1]
        q, k, v, dout = case_tensors(len(name), total, heads, kv_heads)
        u, r = reg.heads.split(d)
        sl = torch.from_numpy(rank_tokens(cu, u, r, group_rank))  # dispatch's layout
        ql, kl, vl = (t[sl].clone().requires_grad_(True) for t in (q, k, v))
        _, attn = _make_core_attention(heads, kv_heads)
        cu_t = torch.tensor(cu, dtype=torch.int32)
        maxlen = max(b - a for a, b in itertools.pairwise(cu))
        params: PackedSeqParams = group_packed_seq_params(
            cu_t, reg.group(d, block), reg.hybrid(d, block)
        )
        table = rope_table(maxlen)
        params = HSPPackedSeqParams.wrap(params, table, table, 1.0)
        out = attn(ql, kl, vl, None, packed_seq_params=params)
        out.backward(dout[sl])
        results[name] = {
            "group_rank": group_rank,
            "split": reg.heads.split(d),
            "out": out.detach(),
            "dq": ql.grad,
            "dk": kl.grad,
            "dv": vl.grad,
        }
    for name, d, heads, kv_heads, docs, _ in TE_ROUTE_CASES:
        reg = create_groups(world, sizes=[1, d], heads=HeadSpace(heads, kv_heads), warm=False)
        block = reg.cluster.block_index(tuple(range(d)))
        cu = padded_cu(docs, d)
        q, k, v, _ = case_tensors(len(name), cu[-1], heads, kv_heads)
        u, r = reg.heads.split(d)
        sl = torch.from_numpy(rank_tokens(cu, u, r, rank))
        _, attn = _make_core_attention(heads, kv_heads)
        attn.backend = _GatherStandIn()
        cu_t = torch.tensor(cu, dtype=torch.int32)
        maxlen = max(b - a for a, b in itertools.pairwise(cu))
        params = group_packed_seq_params(cu_t, reg.group(d, block), reg.hybrid(d, block))
        table = rope_table(maxlen)
        params = HSPPackedSeqParams.wrap(params, table, table, 1.0)
        with torch.no_grad():
            out = attn(q[sl], k[sl], v[sl], None, packed_seq_params=params)
        results[name] = {"out": out, "calls": attn.backend.calls[:1]}
    # A pack dispatched in another layout than the group runs (plan/registry split mismatch) is
    # refused before any collective, on every rank.
    reg = create_groups(world, sizes=[1, 4], heads=HeadSpace(3, 1), warm=False)
    cu = padded_cu([9, 1, 4, 6], 4)
    params = group_packed_seq_params(
        torch.tensor(cu, dtype=torch.int32), reg.group(4, 0), reg.hybrid(4, 0)
    )
    params.hsp_micro_batch.layout_ring = 1  # what schedule.packed_seq_params records for ring 1
    _, attn = _make_core_attention(3, 1)
    q, k, v, _ = case_tensors(1, cu[-1], 3, 1)
    try:
        attn(q[:5], k[:5], v[:5], None, packed_seq_params=params)
        results["mismatch"] = "accepted"
    except ValueError as err:
        results["mismatch"] = str(err)
    return results


@pytest.mark.spawns
@pytest.mark.dist
@pytest.mark.slow
def test_ring_and_hybrid_match_single_device() -> None:
    results = run_distributed(_worker, WORLD)
    raise_rank_errors(results)
    splits = {}
    for name, d, heads, kv_heads, docs in CASES:
        parts = sorted(
            (r[name] for r in results[:d] if r[name] is not None), key=lambda p: p["group_rank"]
        )
        assert len(parts) == d
        splits[name] = parts[0]["split"]
        cu = padded_cu(docs, d)
        q, k, v, dout = case_tensors(len(name), cu[-1], heads, kv_heads)
        q, k, v = (t.double().requires_grad_(True) for t in (q, k, v))
        ref = reference_attention(q, k, v, cu, True).reshape(cu[-1], -1)
        ref.backward(dout.double())
        u, r = splits[name]
        order = torch.cat([torch.from_numpy(rank_tokens(cu, u, r, i)) for i in range(d)])
        got = {}
        for key in ("out", "dq", "dk", "dv"):
            joined = torch.cat([p[key] for p in parts])
            got[key] = torch.empty_like(joined).index_copy_(0, order, joined)  # buffer order
        assert _rel(got["out"], ref) <= 1e-6, (name, _rel(got["out"], ref))
        for key, t in (("dq", q), ("dk", k), ("dv", v)):
            assert _rel(got[key], t.grad) <= 1e-5, (name, key, _rel(got[key], t.grad))
    for r in results:
        assert "ring-1 token layout but its group runs ring degree 4" in r["mismatch"]
    for name, d, heads, kv_heads, docs, comm in TE_ROUTE_CASES:
        assert [r[name]["calls"] for r in results] == [[comm]] * d, name
        cu = padded_cu(docs, d)
        q, k, v, _ = case_tensors(len(name), cu[-1], heads, kv_heads)
        ref = reference_attention(q, k, v, cu, True).reshape(cu[-1], -1)
        u, r = HeadSpace(heads, kv_heads).split(d)
        order = torch.cat([torch.from_numpy(rank_tokens(cu, u, r, i)) for i in range(d)])
        joined = torch.cat([results[i][name]["out"] for i in range(d)])
        got = torch.empty_like(joined).index_copy_(0, order, joined)
        assert _rel(got, ref) <= 1e-6, (name, _rel(got, ref))
    assert splits == {
        "hybrid-2x2-gqa": (2, 2),
        "ring-4-mqa": (1, 4),
        "ring-3-odd": (1, 3),
        "ulysses-2": (2, 1),
    }
