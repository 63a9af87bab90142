"""Dispatch: from a global batch of whole documents to this rank's packed THD tokens.

The contract with the attention (``docs/runtime.md``, "Packed micro-batch contract"):

* A plan group of ``d`` slots trains documents ``seq_ids`` (in plan order) in one micro-batch. Its
  *group buffer* is those documents concatenated, followed -- only if the total ``T_real`` is not a
  multiple of ``d * local_multiple`` -- by one padding segment of ``P`` tokens that makes it so.
  ``T = T_real + P``.
* ``cu_seqlens`` (int32, length ``#docs + 1``, plus one entry when ``P > 0``) describes the whole
  group buffer, padding segment included, so the attention never mixes padding with a document.
* Slot ``i`` of the group holds the contiguous slice ``[i*T/d, (i+1)*T/d)`` of ``input_ids``,
  ``labels``, ``loss_mask`` and ``position_ids``; a document may straddle slots.
* ``position_ids`` restart at 0 for every document (and for the padding segment).
* Labels: ``labels[t] = token[t+1]`` of the same document; the last token of each document has no
  target and ``loss_mask`` 0. Padding tokens have id ``pad_id``, label ``pad_id`` and mask 0.
  A document of ``L`` tokens therefore contributes ``L - 1`` loss tokens, exactly what one device
  running the same packed documents trains, so the loss is the same.

Everything is numpy and proportional to this rank's slice (plus ``O(#docs)``), because dispatch
runs on the host every step.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from megatron_hsp.planner.errors import InputError, PlanError
from megatron_hsp.planner.plan import Group, Plan


@dataclass(frozen=True)
class GlobalBatch:
    """The documents of one global batch, stored flat: document ``i`` is ``tokens[offsets[i]:
    offsets[i+1]]``. Sequence ids in a ``Plan`` index these documents."""

    tokens: np.ndarray
    offsets: np.ndarray

    @classmethod
    def from_documents(cls, documents: Sequence[np.ndarray | Sequence[int]]) -> GlobalBatch:
        arrays = [np.asarray(d, dtype=np.int64).reshape(-1) for d in documents]
        lengths = np.fromiter((a.size for a in arrays), dtype=np.int64, count=len(arrays))
        if lengths.size and lengths.min() < 1:
            empty = np.flatnonzero(lengths < 1)[:8].tolist()
            raise InputError(f"documents {empty} are empty; every document needs >= 1 token")
        offsets = np.zeros(len(arrays) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        tokens = np.concatenate(arrays) if arrays else np.zeros(0, dtype=np.int64)
        return cls(tokens=tokens, offsets=offsets)

    @property
    def num_documents(self) -> int:
        return self.offsets.size - 1

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    @property
    def num_tokens(self) -> int:
        return int(self.offsets[-1])

    @property
    def num_loss_tokens(self) -> int:
        """Tokens with a target: ``sum(L - 1)``; the per-token loss of the step divides by this."""
        return self.num_tokens - self.num_documents

    def document(self, seq_id: int) -> np.ndarray:
        return self.tokens[self.offsets[seq_id] : self.offsets[seq_id + 1]]


@dataclass(frozen=True)
class PackedMicroBatch:
    """This rank's share of its group's group buffer in one micro-batch (numpy, host side).

    ``cu_seqlens`` and ``max_seqlen`` describe the whole group buffer; the token arrays are this
    slot's slice of it. ``doc_ids`` names the document of each local token (-1: padding) and
    exists for token accounting and debugging.
    """

    microbatch: int
    group_ranks: tuple[int, ...]
    slot_in_group: int
    seq_ids: tuple[int, ...]
    input_ids: np.ndarray
    labels: np.ndarray
    loss_mask: np.ndarray
    position_ids: np.ndarray
    doc_ids: np.ndarray
    cu_seqlens: np.ndarray
    max_seqlen: int
    group_tokens: int
    padded_tokens: int

    @property
    def group_size(self) -> int:
        return len(self.group_ranks)

    @property
    def block(self) -> int:
        return self.group_ranks[0] // len(self.group_ranks)

    @property
    def empty(self) -> bool:
        """The group trains nothing in this micro-batch (fewer sequences than groups)."""
        return not self.seq_ids

    @property
    def num_local_tokens(self) -> int:
        return int(self.input_ids.size)

    @property
    def num_loss_tokens(self) -> int:
        return int(self.loss_mask.sum())


def padding_for(total: int, group_size: int, local_multiple: int = 1) -> int:
    """Padding tokens that make a group buffer of ``total`` tokens split evenly over its ranks.

    The only padding the Ulysses path needs: every rank of the group must hold the same number of
    tokens for the all-to-all, i.e. ``T % d == 0`` (``local_multiple`` additionally makes each
    rank's share a multiple of e.g. the tensor-parallel size when Megatron's sequence parallelism
    splits it further). Documents themselves are never padded.
    """
    m = group_size * local_multiple
    return (-total) % m


def pack_group_slice(
    batch: GlobalBatch,
    group: Group,
    slot: int,
    *,
    microbatch: int = 0,
    local_multiple: int = 1,
    pad_id: int = 0,
) -> PackedMicroBatch:
    """Pack this ``slot``'s slice of ``group``'s buffer (see the module docstring)."""
    d = group.size
    i = group.ranks.index(slot) if slot in group.ranks else -1
    if i < 0:
        raise InputError(f"slot {slot} is not in the group of slots {list(group.ranks)[:8]}")
    seq_ids = np.asarray(group.seq_ids, dtype=np.int64)
    if seq_ids.size and (seq_ids.min() < 0 or seq_ids.max() >= batch.num_documents):
        raise PlanError(
            [f"micro-batch {microbatch}: sequence ids out of range 0..{batch.num_documents - 1}"]
        )
    starts = batch.offsets[seq_ids]
    lens = batch.offsets[seq_ids + 1] - starts
    if group.lengths and not np.array_equal(lens, np.asarray(group.lengths, dtype=np.int64)):
        bad = int(np.flatnonzero(lens != np.asarray(group.lengths))[0])
        raise PlanError(
            [
                f"micro-batch {microbatch}: sequence {int(seq_ids[bad])} has length "
                f"{group.lengths[bad]} in the plan but {int(lens[bad])} in the batch"
            ]
        )
    cum = np.zeros(seq_ids.size + 1, dtype=np.int64)
    np.cumsum(lens, out=cum[1:])
    t_real = int(cum[-1])
    pad = padding_for(t_real, d, local_multiple)
    t_total = t_real + pad
    share = t_total // d
    a, b = i * share, (i + 1) * share
    b_real = min(b, t_real)

    # Real tokens of the slice: j in [a, b_real) -> document k, offset pos inside it.
    j = np.arange(a, max(a, b_real), dtype=np.int64)
    k = np.searchsorted(cum, j, side="right") - 1
    pos = j - cum[k]
    flat = starts[k] + pos
    last = pos == lens[k] - 1
    nxt = batch.tokens[np.minimum(flat + 1, batch.tokens.size - 1)]
    n_pad_local = b - max(a, b_real)
    pad_start = max(a, t_real) - t_real  # position inside the padding segment

    input_ids = np.concatenate([batch.tokens[flat], np.full(n_pad_local, pad_id, np.int64)])
    labels = np.concatenate([np.where(last, pad_id, nxt), np.full(n_pad_local, pad_id, np.int64)])
    loss_mask = np.concatenate([(~last).astype(np.float32), np.zeros(n_pad_local, np.float32)])
    position_ids = np.concatenate(
        [pos, np.arange(pad_start, pad_start + n_pad_local, dtype=np.int64)]
    )
    doc_ids = np.concatenate([seq_ids[k], np.full(n_pad_local, -1, np.int64)])
    cu = np.append(cum, t_total) if pad else cum
    return PackedMicroBatch(
        microbatch=microbatch,
        group_ranks=tuple(group.ranks),
        slot_in_group=i,
        seq_ids=tuple(int(s) for s in seq_ids),
        input_ids=input_ids,
        labels=labels,
        loss_mask=loss_mask,
        position_ids=position_ids,
        doc_ids=doc_ids,
        cu_seqlens=cu.astype(np.int32),
        max_seqlen=int(max(int(lens.max()) if lens.size else 0, pad)),
        group_tokens=t_real,
        padded_tokens=t_total,
    )


def dispatch(
    batch: GlobalBatch,
    plan: Plan,
    slot: int,
    *,
    local_multiple: int = 1,
    pad_id: int = 0,
) -> list[PackedMicroBatch]:
    """This slot's packed share of every micro-batch of ``plan``, in plan order."""
    if not 0 <= slot < plan.world_size:
        raise InputError(f"slot {slot} is outside the plan's 0..{plan.world_size - 1}")
    return [
        pack_group_slice(
            batch,
            mb.group_of(slot),
            slot,
            microbatch=m,
            local_multiple=local_multiple,
            pad_id=pad_id,
        )
        for m, mb in enumerate(plan.microbatches)
    ]


def check_token_accounting(
    batch: GlobalBatch, plan: Plan, packs_by_slot: dict[int, Iterable[PackedMicroBatch]]
) -> None:
    """Raise unless every token of ``batch`` is held exactly once and trained exactly once.

    ``packs_by_slot`` maps each slot to its ``dispatch`` result. Checks, per document: every
    position 0..L-1 appears exactly once across all slots and micro-batches with the right token
    id, every position but the last carries loss with the next token as label, and padding never
    carries loss.
    """
    missing_slots = sorted(set(range(plan.world_size)) - set(packs_by_slot))
    if missing_slots:
        raise InputError(f"token accounting needs every slot; missing {missing_slots[:8]}")
    seen = np.zeros(batch.num_tokens, dtype=np.int64)
    trained = np.zeros(batch.num_tokens, dtype=np.int64)
    problems: list[str] = []
    for slot, packs in packs_by_slot.items():
        for p in packs:
            real = p.doc_ids >= 0
            if p.loss_mask[~real].any():
                problems.append(f"slot {slot} micro-batch {p.microbatch}: padding carries loss")
            flat = batch.offsets[p.doc_ids[real]] + p.position_ids[real]
            if np.any(batch.tokens[flat] != p.input_ids[real]):
                problems.append(f"slot {slot} micro-batch {p.microbatch}: wrong token ids")
            np.add.at(seen, flat, 1)
            loss_here = p.loss_mask[real] > 0
            np.add.at(trained, flat[loss_here], 1)
            lab = p.labels[real][loss_here]
            if np.any(batch.tokens[flat[loss_here] + 1] != lab):
                problems.append(f"slot {slot} micro-batch {p.microbatch}: wrong labels")
    expect_trained = np.ones(batch.num_tokens, dtype=np.int64)
    expect_trained[batch.offsets[1:] - 1] = 0  # last token of each document has no target
    if np.any(seen != 1):
        bad = np.flatnonzero(seen != 1)
        doc = np.searchsorted(batch.offsets, bad[:4], side="right") - 1
        counts = Counter(seen[bad].tolist())
        problems.append(
            f"{bad.size} tokens are not held exactly once (times held: {dict(counts)}; first "
            f"in documents {doc.tolist()})"
        )
    if np.any(trained != expect_trained):
        bad = np.flatnonzero(trained != expect_trained)
        problems.append(f"{bad.size} tokens are not trained exactly once")
    if problems:
        raise PlanError(problems)


def dispatch_all(batch: GlobalBatch, plan: Plan, **kwargs) -> dict[int, list[PackedMicroBatch]]:
    """Every slot's dispatch (what the whole cluster does), for accounting and tests."""
    return {s: dispatch(batch, plan, s, **kwargs) for s in range(plan.world_size)}
