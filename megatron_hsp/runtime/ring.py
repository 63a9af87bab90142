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
an earlier or equal buffer index. The backward pass is autograd through ``ring_shift`` (whose
backward is the opposite shift), so no hand-written gradient can drift from the forward.

Limits, stated where they bite: the per-step partial attention is dense torch math (scores of
``T/r x T/r`` per head, fp32 accumulation) - exact and fine for tests and short buffers, not a
flash kernel; and the shifts are not overlapped with compute (torch autograd runs them in order).
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
    ops = [dist.P2POp(dist.isend, x.contiguous(), dst), dist.P2POp(dist.irecv, out, src)]
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
    visible = (q_doc[:, None] == k_doc[None, :]) & (k_index[None, :] <= q_index[:, None])
    scores = scores.masked_fill(~visible[None], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [h, Tq]
    safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    probs = torch.exp(scores - safe[..., None])  # exp(-inf) = 0 on masked entries
    out = torch.einsum("hab,bhd->ahd", probs, vf)
    return out.to(dtype), lse


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
    document vectors, shifted with it (they need no gradient).
    """
    out, lse = partial_attention(q, k, v, index, doc, index, doc, scale)
    r = 1 if group is None else group.size()
    kv = torch.cat([k, v], dim=1)
    meta = torch.stack([index, doc]).to(torch.int64)
    for _ in range(r - 1):
        kv = ring_shift(kv, group)
        meta = _shift(meta, group, 1)
        kb, vb = kv.split(k.size(1), dim=1)
        o, s = partial_attention(q, kb, vb, index, doc, meta[0], meta[1], scale)
        out, lse = merge_partials(out, lse, o, s)
    return out


__all__ = [
    "merge_partials",
    "partial_attention",
    "ring_attention",
    "ring_shift",
]
