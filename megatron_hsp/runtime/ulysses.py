"""Ulysses: the autograd-correct all-to-all that trades a sequence shard for a head shard.

``all_to_all_seq_to_head``: [T/d, H, D] (my tokens, all heads) -> [T, H/d, D] (all tokens, my
heads); ``all_to_all_head_to_seq`` the reverse; each one's backward is the other, so no
hand-written gradient can drift from the forward. ``_qkv_seq_to_head`` sends q, k and v in one
collective per layer. A group of one rank (or none) is a no-op: no communicator is touched.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_hsp.runtime.comm import comm


def _seq_to_head(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """[T/d, H, D] (my tokens, all heads) -> [T, H/d, D] (all tokens, my heads)."""
    d = group.size()
    t, h, dim = x.shape
    send = x.reshape(t, d, h // d, dim).transpose(0, 1).contiguous()  # chunk j -> rank j
    recv = torch.empty_like(send)  # recv[j] = rank j's tokens of my head chunk
    comm().all_to_all_single(recv, send, group)
    return recv.reshape(d * t, h // d, dim)


def _head_to_seq(y: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """[T, H/d, D] (all tokens, my heads) -> [T/d, H, D] (my tokens, all heads)."""
    d = group.size()
    total, hd, dim = y.shape
    send = y.reshape(d, total // d, hd, dim).contiguous()  # token chunk j -> rank j
    recv = torch.empty_like(send)  # recv[j] = my tokens of rank j's head chunk
    comm().all_to_all_single(recv, send, group)
    return recv.transpose(0, 1).reshape(total // d, d * hd, dim)


class _SeqToHead(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _seq_to_head(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _head_to_seq(grad.contiguous(), ctx.group), None


class _HeadToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, group):
        ctx.group = group
        return _head_to_seq(y, group)

    @staticmethod
    def backward(ctx, grad):
        return _seq_to_head(grad.contiguous(), ctx.group), None


def all_to_all_seq_to_head(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Scatter heads, gather sequence (backward: the reverse all-to-all). No-op for d <= 1."""
    if group is None or group.size() == 1:
        return x
    return _SeqToHead.apply(x, group)


def all_to_all_head_to_seq(y: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Gather heads, scatter sequence (backward: the reverse all-to-all). No-op for d <= 1."""
    if group is None or group.size() == 1:
        return y
    return _HeadToSeq.apply(y, group)


def _qkv_seq_to_head(q, k, v, group):
    """One all-to-all for q, k and v together (one collective per layer instead of three).

    Each destination rank's chunk is [its q heads | its k heads | its v heads], so the combined
    tensor goes through the same scatter-heads/gather-sequence exchange and is split afterwards.
    """
    d = 1 if group is None else group.size()
    if d == 1:
        return q, k, v
    t, dim = q.size(0), q.size(2)
    cq, ck = q.size(1) // d, k.size(1) // d
    combined = torch.cat(
        [q.reshape(t, d, cq, dim), k.reshape(t, d, ck, dim), v.reshape(t, d, ck, dim)], dim=2
    ).reshape(t, d * (cq + 2 * ck), dim)
    out = all_to_all_seq_to_head(combined, group)
    return out.split([cq, ck, ck], dim=1)


__all__ = ["all_to_all_head_to_seq", "all_to_all_seq_to_head"]
