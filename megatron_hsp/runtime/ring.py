"""Ring attention over the ring degree ``r`` of a hybrid (Ulysses x ring) group.

After the Ulysses all-to-all over ``u`` ranks, ring position ``j`` of a group holds its share of
the group's packed buffer (``layout.ring_position_tokens``: the load-balanced ``2r``-chunk
layout, so every position does near-equal causal work) for its ``h/u`` heads. Ring attention
keeps the queries in place and passes the K/V blocks around the ring (``r - 1`` point-to-point
shifts); each step computes the partial attention of the local queries against the visiting
block, as an output plus its log-sum-exp, and the partials are merged exactly by log-sum-exp
(``merge_partials``).

The mask is computed from each token's index in the group's buffer and its document, so it holds
for any assignment of tokens to ring positions: a token attends to keys of its own document at
an earlier or equal buffer index.

Memory (issue 15): the whole ring is ONE autograd function (``_RingAttention``), the way
ring-flash-attention does it. Forward keeps only the running fp32 output and log-sum-exp; each
block's scores live only inside a query tile (``_block_forward``) and are dropped. Saved for
backward: q, k, v, the output and the log-sum-exp (plus the token index/document vectors), i.e.
activation memory linear in tokens (``tests/runtime/test_ring_memory.py``,
``benchmarks/ring_memory.py``).
Backward passes the K/V blocks around the ring again, recomputes each block's probabilities
from q, k and the saved log-sum-exp, and carries each block's dK/dV accumulator along with it; one
last shift returns every accumulator to its owner. The previous version let autograd keep every
step's ``[h, T/r, T/r]`` fp32 scores and mask (about 9-10 bytes per query-key pair per head).

Limits, stated where they bite: the block kernel is tiled torch math (fp32 accumulation) - exact,
memory-bounded, not a fused flash kernel (a CUDA flash block kernel with log-sum-exp, e.g.
``varlen_attn(return_aux=...)`` per zigzag block, is not wired in yet: docs/runtime.md); and the
shifts are not overlapped with compute.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _shift(x: torch.Tensor, group: dist.ProcessGroup, step: int) -> torch.Tensor:
    """Send ``x`` to ring position ``i + step`` and receive from ``i - step`` (mod r)."""
    r = group.size()
    me = dist.get_rank(group)
    dst = dist.get_global_rank(group, (me + step) % r)
    src = dist.get_global_rank(group, (me - step) % r)
    out = torch.empty_like(x)
    # On the ring's own group, so its communicator carries the ring's traffic (the world's
    # would otherwise connect every ring pair on the world communicator as well).
    ops = [
        dist.P2POp(dist.isend, x.contiguous(), dst, group=group),
        dist.P2POp(dist.irecv, out, src, group=group),
    ]
    for req in dist.batch_isend_irecv(ops):
        req.wait()
    return out


class _RingShift(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _shift(x, group, 1)

    @staticmethod
    def backward(ctx, grad):
        return _shift(grad.contiguous(), ctx.group, -1), None


def ring_shift(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Differentiable one-step ring shift (backward sends the gradient the other way)."""
    return _RingShift.apply(x, group)


def partial_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_index: torch.Tensor,
    q_doc: torch.Tensor,
    k_index: torch.Tensor,
    k_doc: torch.Tensor,
    scale: float,
    keep_fp32: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``q`` [Tq, h, D] on one K/V block [Tk, hk, D]: (out [Tq, h, D], lse [h, Tq]).

    Key ``b`` is visible to query ``a`` when both lie in one document and ``k_index[b] <=
    q_index[a]``. Rows that see no key get lse = -inf and out = 0, which ``merge_partials`` treats
    as an empty partial.
    """
    rep = q.size(1) // k.size(1)
    if rep > 1:  # GQA: query head j uses KV head j // rep
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
    dtype = q.dtype
    qf, kf, vf = q.float(), k.float(), v.float()
    scores = torch.einsum("ahd,bhd->hab", qf, kf) * scale
    visible = _visible(q_index, q_doc, k_index, k_doc)
    scores = scores.masked_fill(~visible[None], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [h, Tq]
    safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    probs = torch.exp(scores - safe[..., None])  # exp(-inf) = 0 on masked entries
    out = torch.einsum("hab,bhd->ahd", probs, vf)
    return (out if keep_fp32 else out.to(dtype)), lse


def merge_partials(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact merge of two softmax partials over disjoint key sets by their log-sum-exps.

    ``out = out_a * e^(lse_a - lse) + out_b * e^(lse_b - lse)`` with ``lse = logaddexp``; a
    partial with lse = -inf (no visible key) contributes nothing.
    """
    lse = torch.logaddexp(lse_a, lse_b)
    safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    wa = torch.exp(lse_a - safe).transpose(0, 1)[..., None]  # [Tq, h, 1]
    wb = torch.exp(lse_b - safe).transpose(0, 1)[..., None]
    out = out_a.float() * wa + out_b.float() * wb
    return out.to(out_a.dtype), lse


# Elements of one query tile's score block ([h, tile, Tk] fp32): bounds the transient memory of a
# block step whatever the buffer length (64 MiB at 2**24).
TILE_ELEMENTS = 1 << 24


def _visible(q_index, q_doc, k_index, k_doc) -> torch.Tensor:
    """[Tq, Tk] True where key b is visible to query a: same document, not later in the buffer."""
    return (q_doc[:, None] == k_doc[None, :]) & (k_index[None, :] <= q_index[:, None])


def _tiles(tq: int, h: int, tk: int) -> range:
    step = max(1, TILE_ELEMENTS // max(1, h * tk))
    return range(0, tq, step)


def _expand_kv(x: torch.Tensor, h: int) -> torch.Tensor:
    rep = h // x.size(1)
    return x.repeat_interleave(rep, dim=1) if rep > 1 else x


def _block_forward(q, k, v, q_index, q_doc, k_index, k_doc, scale):
    """(out [Tq, h, D] fp32, lse [h, Tq] fp32) of ``q`` against one K/V block, query tile by
    query tile (rows that see no key: lse -inf, out 0)."""
    tq, h, _ = q.shape
    kf, vf = _expand_kv(k, h).float(), _expand_kv(v, h).float()
    out = q.new_zeros(q.shape, dtype=torch.float32)
    lse = q.new_full((h, tq), float("-inf"), dtype=torch.float32)
    step = _tiles(tq, h, k.size(0)).step
    for a in range(0, tq, step):
        b = min(a + step, tq)
        o, s = partial_attention(
            q[a:b], kf, vf, q_index[a:b], q_doc[a:b], k_index, k_doc, scale, keep_fp32=True
        )
        out[a:b], lse[:, a:b] = o, s
    return out, lse


def _block_backward(dout, q, k, v, lse, delta, q_index, q_doc, k_index, k_doc, scale):
    """(dq [Tq, h, D], dk [Tk, hk, D], dv [Tk, hk, D]) in fp32 of one block, recomputed from q,
    k, v and the ring's final log-sum-exp (``delta`` = rowsum(dout * out), [h, Tq])."""
    tq, h, dim = q.shape
    hk = k.size(1)
    kf, vf = _expand_kv(k, h).float(), _expand_kv(v, h).float()
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dk = torch.zeros(kf.shape, dtype=torch.float32, device=q.device)
    dv = torch.zeros(vf.shape, dtype=torch.float32, device=q.device)
    safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    step = _tiles(tq, h, k.size(0)).step
    for a in range(0, tq, step):
        b = min(a + step, tq)
        qt, dot = q[a:b].float(), dout[a:b].float()
        scores = torch.einsum("ahd,bhd->hab", qt, kf) * scale
        vis = _visible(q_index[a:b], q_doc[a:b], k_index, k_doc)
        p = torch.exp(scores.masked_fill(~vis[None], float("-inf")) - safe[:, a:b, None])
        dv += torch.einsum("hab,ahd->bhd", p, dot)
        dp = torch.einsum("ahd,bhd->hab", dot, vf)
        ds = p * (dp - delta[:, a:b, None])
        dq[a:b] = torch.einsum("hab,bhd->ahd", ds, kf) * scale
        dk += torch.einsum("hab,ahd->bhd", ds, qt) * scale
    if h != hk:  # GQA: sum the query heads that share a KV head
        rep = h // hk
        dk = dk.view(-1, hk, rep, dim).sum(2)
        dv = dv.view(-1, hk, rep, dim).sum(2)
    return dq, dk, dv


class _RingAttention(torch.autograd.Function):
    """The whole ring, forward and backward (module docstring, "Memory")."""

    @staticmethod
    def forward(ctx, q, k, v, index, doc, group, scale):
        r = 1 if group is None else group.size()
        meta = torch.stack([index, doc]).to(torch.int64)
        kb, vb, mb = k, v, meta
        out = lse = None
        for step in range(r):
            if step:
                kb, vb, mb = (_shift(t, group, 1) for t in (kb, vb, mb))
            o, s = _block_forward(q, kb, vb, index, doc, mb[0], mb[1], scale)
            out, lse = (o, s) if out is None else merge_partials(out, lse, o, s)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, meta)
        ctx.group, ctx.scale = group, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, meta = ctx.saved_tensors
        group, scale = ctx.group, ctx.scale
        r = 1 if group is None else group.size()
        index, doc = meta[0], meta[1]
        delta = (dout.float() * out.float()).sum(-1).transpose(0, 1)  # [h, Tq]
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        kb, vb, mb = k, v, meta
        dkb = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
        dvb = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
        for step in range(r):
            if step:  # the block moves on with the gradient it has collected so far
                kb, vb, mb, dkb, dvb = (_shift(t, group, 1) for t in (kb, vb, mb, dkb, dvb))
            g_q, g_k, g_v = _block_backward(
                dout, q, kb, vb, lse, delta, index, doc, mb[0], mb[1], scale
            )
            dq += g_q
            dkb += g_k
            dvb += g_v
        if r > 1:  # one more step brings every block's accumulator home
            dkb, dvb = _shift(dkb, group, 1), _shift(dvb, group, 1)
        return dq.to(q.dtype), dkb.to(k.dtype), dvb.to(v.dtype), None, None, None, None


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    index: torch.Tensor,
    doc: torch.Tensor,
    group: dist.ProcessGroup | None,
    scale: float,
) -> torch.Tensor:
    """Causal per-document attention of the local tokens against every ring position's tokens.

    ``index``/``doc``: buffer index and document of each local token (same on q and k/v). Step
    ``s`` sees the block of ring position ``i - s``; the visiting block carries its own index and
    document vectors. Memory linear in tokens (module docstring).
    """
    return _RingAttention.apply(q, k, v, index, doc, group, scale)


__all__ = [
    "merge_partials",
    "partial_attention",
    "ring_attention",
    "ring_shift",
]
