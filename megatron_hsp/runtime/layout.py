"""Where each token of a group buffer lives: the one layout that dispatch and attention share.

A group of ``d = u * r`` ranks (Ulysses degree ``u``, ring degree ``r``) trains one packed group
buffer of ``T`` tokens (``cu_seqlens`` segments: documents, then the trailing padding segment,
``T % d == 0``). Group rank ``i`` is ring position ``j = i // u``. Causal ring attention does
work proportional to the query-key pairs a position holds, so contiguous slices would give the
last position almost all of it. The layout here is the standard load-balanced ("zigzag") one
that Megatron/Transformer Engine context parallelism uses, over the group's ``d`` ranks, per
segment:

* with ``r > 1``, a segment of ``L`` tokens is cut into ``2d`` core chunks of ``q = L // (2d)``
  tokens; group rank ``i`` holds chunks ``i`` and ``2d - 1 - i`` (one cheap early chunk, one
  expensive late one), so ring position ``j`` (ranks ``j*u .. j*u+u-1``) holds ``2u`` chunks whose
  causal work adds up to the same for every position;
* the ``L mod 2d`` tail tokens of every segment (all of a segment shorter than ``2d``) form one
  remainder list in buffer order, dealt to ranks in a snake (remainder token ``t`` goes to rank
  ``i`` when ``t mod 2d`` is ``i`` or ``2d - 1 - i``). ``T % d == 0`` makes every rank hold
  exactly ``T / d`` tokens, so no padding beyond the trailing segment is needed;
* a rank's tokens are stored as: for each segment in order, chunk ``i`` then chunk
  ``2d - 1 - i``; then its remainder tokens. When every segment is a multiple of ``2d`` there is
  no remainder and this is exactly Transformer Engine's THD context-parallel shard for a CP group
  of ``d`` (``te_cp_arguments``);
* after the Ulysses all-to-all, ring position ``j`` holds its ``u`` ranks' tokens concatenated in
  Ulysses-rank order (``ring_position_tokens``); the ring attention's mask and RoPE read buffer
  indices from there, so they hold for this (or any) assignment.

``r == 1`` is the identity (rank ``i`` holds ``[i*T/d, (i+1)*T/d)``). Everything is numpy,
``O(T / d + #segments * d)`` per call, because dispatch runs on the host every step.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def _ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Concatenation of ``arange(s, s + n)`` for every (s, n), vectorised."""
    lengths = np.asarray(lengths, dtype=np.int64)
    total = int(lengths.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    offsets = np.cumsum(lengths) - lengths
    return np.repeat(np.asarray(starts, dtype=np.int64) - offsets, lengths) + np.arange(total)


def _check(cu: np.ndarray, ranks: int) -> int:
    """The buffer length ``cu[-1]``; raises unless it splits evenly over ``ranks``."""
    total = int(cu[-1]) if cu.size else 0
    if ranks < 1:
        raise ValueError(f"the layout needs >= 1 rank, got {ranks}")
    if total % ranks:
        raise ValueError(
            f"group buffer of {total} tokens does not split over {ranks} ranks: dispatch pads it "
            "to a multiple of the group size (dispatch.padding_for)"
        )
    return total


def zigzag_tokens(cu_seqlens: Sequence[int] | np.ndarray, ranks: int, rank: int) -> np.ndarray:
    """Buffer indices ``rank`` (0..ranks-1) holds in the ``2 * ranks``-chunk layout (module doc)."""
    cu = np.asarray(cu_seqlens, dtype=np.int64)
    total = _check(cu, ranks)
    if ranks == 1:
        return np.arange(total, dtype=np.int64)
    if not 0 <= rank < ranks:
        raise ValueError(f"rank {rank} is outside 0..{ranks - 1}")
    n = 2 * ranks
    starts, lengths = cu[:-1], np.diff(cu)
    q = lengths // n
    pair_starts = np.stack([starts + rank * q, starts + (n - 1 - rank) * q], axis=1)
    core = _ranges(pair_starts.reshape(-1), np.repeat(q, 2))
    tails = _ranges(starts + n * q, lengths - n * q)
    t = np.arange(tails.size) % n
    mine = tails[(t == rank) | (t == n - 1 - rank)]
    return np.concatenate([core, mine])


def rank_tokens(
    cu_seqlens: Sequence[int] | np.ndarray, ulysses: int, ring: int, group_rank: int
) -> np.ndarray:
    """Buffer indices group rank ``group_rank`` holds before the Ulysses all-to-all."""
    cu = np.asarray(cu_seqlens, dtype=np.int64)
    d = ulysses * ring
    total = _check(cu, d)
    if not 0 <= group_rank < d:
        raise ValueError(f"group rank {group_rank} is outside 0..{d - 1}")
    if ring == 1:  # pure Ulysses: contiguous slices
        share = total // d
        return np.arange(group_rank * share, (group_rank + 1) * share, dtype=np.int64)
    return zigzag_tokens(cu, d, group_rank)


def ring_position_tokens(
    cu_seqlens: Sequence[int] | np.ndarray, ulysses: int, ring: int, position: int
) -> np.ndarray:
    """Buffer indices ring ``position`` holds after the Ulysses all-to-all: its ``ulysses``
    ranks' tokens concatenated in Ulysses-rank order (what the all-to-all gathers)."""
    if not 0 <= position < ring:
        raise ValueError(f"ring position {position} is outside 0..{ring - 1}")
    return np.concatenate(
        [rank_tokens(cu_seqlens, ulysses, ring, position * ulysses + a) for a in range(ulysses)]
    )


def layout_order(cu_seqlens: Sequence[int] | np.ndarray, ulysses: int, ring: int) -> np.ndarray:
    """The whole permutation: concatenating every group rank's tokens in rank order."""
    return np.concatenate(
        [rank_tokens(cu_seqlens, ulysses, ring, i) for i in range(ulysses * ring)]
    )


def scatter(
    values: np.ndarray,
    cu_seqlens: Sequence[int] | np.ndarray,
    ulysses: int,
    ring: int,
    group_rank: int,
) -> np.ndarray:
    """This rank's share of a buffer-ordered array (first axis is the token)."""
    return values[rank_tokens(cu_seqlens, ulysses, ring, group_rank)]


def gather(
    pieces: Sequence[np.ndarray], cu_seqlens: Sequence[int] | np.ndarray, ulysses: int, ring: int
) -> np.ndarray:
    """Inverse of ``scatter``: every rank's share (in group-rank order) back in buffer order."""
    joined = np.concatenate(list(pieces))
    out = np.empty_like(joined)
    out[layout_order(cu_seqlens, ulysses, ring)] = joined
    return out


def causal_pairs_per_position(
    cu_seqlens: Sequence[int] | np.ndarray, ulysses: int, ring: int
) -> list[int]:
    """Causal attention work of each ring position: query-key pairs of its queries (own segment,
    key index <= query index). What the load balancing equalises."""
    cu = np.asarray(cu_seqlens, dtype=np.int64)
    out = []
    for j in range(ring):
        idx = ring_position_tokens(cu, ulysses, ring, j)
        seg = np.searchsorted(cu, idx, side="right") - 1
        out.append(int((idx - cu[seg] + 1).sum()))
    return out


TE_COMM_TYPES = ("p2p", "a2a+p2p")


def te_cp_arguments(
    cu_seqlens: Sequence[int] | np.ndarray, ulysses: int, ring: int
) -> dict[str, object] | None:
    """Transformer Engine THD context-parallel arguments for a ``ulysses x ring`` group, or None.

    TE's ``DotProductAttention`` (``qkv_format="thd"``, a CP group) expects every CP rank ``c`` of
    ``cp`` to hold chunks ``c`` and ``2cp - 1 - c`` of every sequence padded to a multiple of
    ``2cp``, with ``cu_seqlens_q/kv`` and ``cu_seqlens_q/kv_padded`` of the WHOLE sequences. For
    ``cp_comm_type="a2a+p2p"`` with ``cp_group = [a2a group, p2p group]`` the CP rank is
    ``p2p_rank * a2a_size + a2a_rank``, which is our group rank (``groupspace``: ring position
    ``i // u``, Ulysses position ``i % u``), so ``rank_tokens`` is exactly TE's shard when every
    segment is a multiple of ``2d`` (no remainder list, no inner padding: ``cu_seqlens`` and the
    padded boundaries coincide). TE then runs the Ulysses all-to-all itself (it reduces
    "a2a+p2p" to "p2p" when ``u == 1``). Returns None when a segment is not a multiple of ``2d``:
    the caller must run the torch ring path (TE would need per-document padding there).
    """
    cu = np.asarray(cu_seqlens, dtype=np.int64)
    d = ulysses * ring
    _check(cu, d)
    if ring < 2 or np.any(np.diff(cu) % (2 * d)):
        return None
    longest = int(np.diff(cu).max()) if cu.size > 1 else 0
    cu32 = cu.astype(np.int32)
    return {
        "cp_comm_type": "a2a+p2p" if ulysses > 1 else "p2p",
        "forward": {
            "qkv_format": "thd",
            "attn_mask_type": "padding_causal",
            "cu_seqlens_q": cu32,
            "cu_seqlens_kv": cu32,
            "cu_seqlens_q_padded": cu32,
            "cu_seqlens_kv_padded": cu32,
            "max_seqlen_q": longest,
            "max_seqlen_kv": longest,
        },
        "local_tokens": int(cu[-1]) // d,
    }


__all__ = [
    "TE_COMM_TYPES",
    "causal_pairs_per_position",
    "gather",
    "layout_order",
    "rank_tokens",
    "ring_position_tokens",
    "scatter",
    "te_cp_arguments",
    "zigzag_tokens",
]
