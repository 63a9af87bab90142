"""Where each token of a group buffer lives: the one layout that dispatch and attention share.

A group of ``d = u * r`` ranks (Ulysses degree ``u``, ring degree ``r``) trains one packed group
buffer of ``T`` tokens (``cu_seqlens`` segments: documents, then the trailing padding segment,
``T % d == 0``). Group rank ``i`` is ring position ``j = i // u``. Causal ring attention does
work proportional to the query-key pairs a position holds, so contiguous slices would give the
last position almost all of it. The layout here is the standard load-balanced ("zigzag", ``2r``
chunks) one that Megatron/Transformer Engine context parallelism uses, per segment:

* a segment of ``L`` tokens is cut into ``2r`` core chunks of ``q = L // (2r)`` tokens; position
  ``j`` holds chunks ``j`` and ``2r - 1 - j`` (one cheap early chunk, one expensive late one);
* the ``L mod 2r`` tail tokens of every segment (all of a segment shorter than ``2r``) form one
  remainder list in buffer order, dealt to positions in a snake (remainder token ``t`` goes to
  position ``j`` when ``t mod 2r`` is ``j`` or ``2r - 1 - j``). ``T % r == 0`` makes every
  position hold exactly ``T / r`` tokens, so no padding beyond the trailing segment is needed;
* a position's tokens are stored as: for each segment in order, chunk ``j`` then chunk
  ``2r - 1 - j``; then its remainder tokens. When every segment is a multiple of ``2r`` there is
  no remainder and this is exactly Transformer Engine's THD context-parallel shard
  (``te_cp_arguments``);
* the ``u`` Ulysses ranks of position ``j`` hold consecutive ``T / d`` pieces of its tokens, in
  Ulysses-rank order, which is what the Ulysses all-to-all concatenates.

``r == 1`` is the identity (rank ``i`` holds ``[i*T/d, (i+1)*T/d)``). Everything is numpy,
``O(T / r + #segments * r)`` per call, because dispatch runs on the host every step.
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


def _check(cu: np.ndarray, ring: int) -> int:
    total = int(cu[-1]) if cu.size else 0
    if ring < 1:
        raise ValueError(f"ring degree must be >= 1, got {ring}")
    if total % ring:
        raise ValueError(
            f"group buffer of {total} tokens does not split over ring degree {ring}: dispatch "
            f"pads it to a multiple of the group size (dispatch.padding_for)"
        )
    return total


def ring_position_tokens(cu_seqlens: Sequence[int] | np.ndarray, ring: int, position: int):
    """Buffer indices held by ring ``position`` (0..ring-1), in storage order (module doc)."""
    cu = np.asarray(cu_seqlens, dtype=np.int64)
    total = _check(cu, ring)
    if ring == 1:
        return np.arange(total, dtype=np.int64)
    if not 0 <= position < ring:
        raise ValueError(f"ring position {position} is outside 0..{ring - 1}")
    n = 2 * ring
    starts, lengths = cu[:-1], np.diff(cu)
    q = lengths // n
    pair_starts = np.stack([starts + position * q, starts + (n - 1 - position) * q], axis=1)
    core = _ranges(pair_starts.reshape(-1), np.repeat(q, 2))
    tails = _ranges(starts + n * q, lengths - n * q)
    t = np.arange(tails.size) % n
    mine = tails[(t == position) | (t == n - 1 - position)]
    return np.concatenate([core, mine])


def rank_tokens(
    cu_seqlens: Sequence[int] | np.ndarray, ulysses: int, ring: int, group_rank: int
) -> np.ndarray:
    """Buffer indices group rank ``group_rank`` holds before the Ulysses all-to-all."""
    cu = np.asarray(cu_seqlens, dtype=np.int64)
    total = _check(cu, ring)
    d = ulysses * ring
    if total % d:
        raise ValueError(f"group buffer of {total} tokens does not split over {d} ranks")
    share = total // d
    pos = ring_position_tokens(cu, ring, group_rank // ulysses)
    k = group_rank % ulysses
    return pos[k * share : (k + 1) * share]


def layout_order(cu_seqlens: Sequence[int] | np.ndarray, ulysses: int, ring: int) -> np.ndarray:
    """The whole permutation: concatenating every group rank's tokens in rank order."""
    return np.concatenate(
        [rank_tokens(cu_seqlens, ulysses, ring, i) for i in range(ulysses * ring)]
    )


def scatter(values: np.ndarray, cu_seqlens, ulysses: int, ring: int, group_rank: int):
    """This rank's share of a buffer-ordered array (first axis is the token)."""
    return values[rank_tokens(cu_seqlens, ulysses, ring, group_rank)]


def gather(pieces: Sequence[np.ndarray], cu_seqlens, ulysses: int, ring: int) -> np.ndarray:
    """Inverse of ``scatter``: every rank's share (in group-rank order) back in buffer order."""
    joined = np.concatenate(list(pieces))
    out = np.empty_like(joined)
    out[layout_order(cu_seqlens, ulysses, ring)] = joined
    return out


def causal_pairs_per_position(cu_seqlens, ring: int) -> list[int]:
    """Causal attention work of each ring position: query-key pairs of its queries (own segment,
    key index <= query index). What the load balancing equalises."""
    cu = np.asarray(cu_seqlens, dtype=np.int64)
    out = []
    for j in range(ring):
        idx = ring_position_tokens(cu, ring, j)
        seg = np.searchsorted(cu, idx, side="right") - 1
        out.append(int((idx - cu[seg] + 1).sum()))
    return out


def te_cp_arguments(
    cu_seqlens: Sequence[int] | np.ndarray, ring: int, position: int
) -> dict[str, object] | None:
    """Transformer Engine THD context-parallel arguments for ring ``position``, or None.

    TE (``DotProductAttention`` with ``qkv_format="thd"`` and a CP group, ``cp_comm_type``
    "p2p") expects every rank's shard to hold chunks ``j`` and ``2r - 1 - j`` of every sequence
    padded to a multiple of ``2r``, with ``cu_seqlens_q/kv`` and ``cu_seqlens_q/kv_padded`` of the
    WHOLE sequences. Our layout equals that shard exactly when every segment is a multiple of
    ``2r`` (no remainder list); then segments carry no inner padding, so ``cu_seqlens`` and the
    padded boundaries coincide. Returns None otherwise: the caller must run the torch ring path.
    """
    cu = np.asarray(cu_seqlens, dtype=np.int64)
    _check(cu, ring)
    if ring < 2 or np.any(np.diff(cu) % (2 * ring)):
        return None
    if not 0 <= position < ring:
        raise ValueError(f"ring position {position} is outside 0..{ring - 1}")
    lengths = np.diff(cu)
    cu32 = cu.astype(np.int32)
    return {
        "qkv_format": "thd",
        "attn_mask_type": "padding_causal",
        "cu_seqlens_q": cu32,
        "cu_seqlens_kv": cu32,
        "cu_seqlens_q_padded": cu32,
        "cu_seqlens_kv_padded": cu32,
        "max_seqlen_q": int(lengths.max()) if lengths.size else 0,
        "max_seqlen_kv": int(lengths.max()) if lengths.size else 0,
        "local_tokens": int(cu[-1]) // ring,
    }


__all__ = [
    "causal_pairs_per_position",
    "gather",
    "layout_order",
    "rank_tokens",
    "ring_position_tokens",
    "scatter",
    "te_cp_arguments",
]
