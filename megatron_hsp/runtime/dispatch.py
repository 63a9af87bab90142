"""Dispatch: from a global batch of whole documents to this rank's packed THD tokens.

The contract with the attention (``docs/runtime.md``, "Packed micro-batch contract"):

* A plan group of ``d`` slots trains documents ``seq_ids`` (in plan order) in one micro-batch. Its
  *group buffer* is those documents concatenated, followed -- only if the total ``T_real`` is not a
  multiple of ``d * local_multiple`` -- by one padding segment of ``P`` tokens that makes it so.
  ``T = T_real + P``.
* ``cu_seqlens`` (int32, length ``#docs + 1``, plus one entry when ``P > 0``) describes the whole
  group buffer, padding segment included, so the attention never mixes padding with a document.
* Slot ``i`` of the group holds the tokens ``layout.rank_tokens(cu_seqlens, u, r, i)`` of
  ``input_ids``, ``labels``, ``loss_mask`` and ``position_ids``, for the group's Ulysses x ring
  split ``(u, r)``: the contiguous slice ``[i*T/d, (i+1)*T/d)`` when ``r == 1``, the
  load-balanced ``2r``-chunk layout of every document when ``r > 1`` (``runtime/layout.py``). The
  attention reads the same function, so the two cannot disagree; a document may straddle slots.
* ``position_ids`` restart at 0 for every document (and for the padding segment).
* Labels: ``labels[t] = token[t+1]`` of the same document; the last token of each document has no
  target and ``loss_mask`` 0. Padding tokens have id ``pad_id``, label ``pad_id`` and mask 0.
  A document of ``L`` tokens therefore contributes ``L - 1`` loss tokens, exactly what one device
  running the same packed documents trains, so the loss is the same.

Everything is numpy and proportional to this rank's share (plus ``O(#docs * d)`` for the ring
layout's remainder list), because dispatch runs on the host every step.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from megatron_hsp.planner.errors import InputError, PlanError
from megatron_hsp.planner.plan import Group, Plan
from megatron_hsp.planner.routes import te_doc_multiple as routes_te_doc_multiple
from megatron_hsp.runtime.layout import rank_tokens


@dataclass(frozen=True)
class GlobalBatch:
    """The documents of one global batch as one rank holds them.

    ``offsets`` are the cumulative lengths of *every* document (the batch's token coordinates:
    document ``i`` is ``[offsets[i], offsets[i+1])``); sequence ids in a ``Plan`` index these
    documents. ``tokens`` holds the tokens of the documents this rank has: all of them for a
    dense batch (``starts`` None, ``from_documents``), or only those its groups train
    (``for_rank``), at ``tokens[starts[i] : starts[i] + L_i]`` with ``starts[i] = -1`` for a
    document it does not hold. Why both: a rank's work per step must follow its own share of the
    batch, not the whole global batch (a 1M-token batch over 256 ranks is 4K tokens per rank),
    while dispatch, accounting and the loss normalisation need every document's length.
    """

    tokens: np.ndarray
    offsets: np.ndarray
    starts: np.ndarray | None = None

    @classmethod
    def from_documents(cls, documents: Sequence[np.ndarray | Sequence[int]]) -> GlobalBatch:
        arrays = [np.asarray(d, dtype=np.int64).reshape(-1) for d in documents]
        lengths = np.fromiter((a.size for a in arrays), dtype=np.int64, count=len(arrays))
        _check_nonempty(lengths)
        offsets = np.zeros(len(arrays) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        tokens = np.concatenate(arrays) if arrays else np.zeros(0, dtype=np.int64)
        return cls(tokens=tokens, offsets=offsets)

    @classmethod
    def for_rank(
        cls, lengths: Sequence[int] | np.ndarray, held: Mapping[int, np.ndarray]
    ) -> GlobalBatch:
        """A rank's share: every document's length, the tokens of the documents in ``held``
        (seq id -> tokens) only. Memory and copies are proportional to what is held."""
        lengths = np.asarray(lengths, dtype=np.int64).reshape(-1)
        _check_nonempty(lengths)
        offsets = np.zeros(lengths.size + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        starts = np.full(lengths.size, -1, dtype=np.int64)
        parts: list[np.ndarray] = []
        at = 0
        for s in sorted(held):
            a = np.asarray(held[s], dtype=np.int64).reshape(-1)
            if not 0 <= s < lengths.size:
                raise InputError(f"held document {s} is outside the batch's 0..{lengths.size - 1}")
            if a.size != lengths[s]:
                raise InputError(
                    f"document {s} has {a.size} tokens but the batch says {int(lengths[s])}"
                )
            starts[s] = at
            parts.append(a)
            at += a.size
        tokens = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
        return cls(tokens=tokens, offsets=offsets, starts=starts)

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

    @property
    def dense(self) -> bool:
        return self.starts is None

    def token_starts(self, seq_ids: np.ndarray) -> np.ndarray:
        """Where each of ``seq_ids`` starts in ``tokens``; raises for a document not held."""
        if self.starts is None:
            return self.offsets[seq_ids]
        out = self.starts[seq_ids]
        if out.size and out.min() < 0:
            missing = seq_ids[out < 0][:8].tolist()
            raise InputError(
                f"this rank does not hold documents {missing}: the plan gives them to its group "
                "but the batch was read for another slot (GlobalBatch.for_rank)"
            )
        return out

    def document(self, seq_id: int) -> np.ndarray:
        start = int(self.token_starts(np.asarray([seq_id]))[0])
        return self.tokens[start : start + int(self.lengths[seq_id])]


def _check_nonempty(lengths: np.ndarray) -> None:
    if lengths.size and lengths.min() < 1:
        empty = np.flatnonzero(lengths < 1)[:8].tolist()
        raise InputError(f"documents {empty} are empty; every document needs >= 1 token")


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
    ring: int = 1  # ring degree of the token layout (``layout.rank_tokens``); 1: contiguous

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

    def document_index(self) -> np.ndarray:
        """Per local token, its document's index in the group buffer (0 .. ``len(seq_ids)``
        - 1, the order of ``seq_ids``), -1 for padding (MoE routers: ``runtime.moe``)."""
        if not self.seq_ids:
            return np.full(self.doc_ids.shape, -1, dtype=np.int64)
        lookup = np.full(max(self.seq_ids) + 1, -1, dtype=np.int64)
        lookup[list(self.seq_ids)] = np.arange(len(self.seq_ids))
        real = self.doc_ids >= 0
        return np.where(real, lookup[np.where(real, self.doc_ids, 0)], -1)


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
    ring: int = 1,
    doc_multiple: int = 1,
    pad_empty: bool = False,
) -> PackedMicroBatch:
    """Pack this ``slot``'s share of ``group``'s buffer (see the module docstring).

    ``ring``: the ring degree the group's attention runs with (``groupspace.HeadSpace.split``);
    it decides the token layout and must equal what the attention uses.

    ``doc_multiple``: pad every document's segment to a multiple of this (Transformer Engine's
    THD context parallelism needs each sequence a multiple of ``2 x cp``; ``te_doc_multiple``).
    The padding tokens sit at the END of their document's segment, so under the causal mask no
    real token attends to them; they carry ``pad_id``, no loss and position id 0, so they add
    nothing to the loss or to any gradient: the step stays exact (the selftest checks it).
    ``cu_seqlens`` then bounds the padded segments, and TE gets one array for its padded and
    unpadded boundaries (``layout.te_cp_arguments``), which keeps its flash backends usable.

    ``pad_empty``: a group without documents gets a buffer of one padding segment (2 x d x
    ``local_multiple`` tokens, which every ring layout splits evenly) instead of none, so its
    ranks can run the model (no loss, no gradient) alongside other groups' ranks in collectives
    that span groups (MoE expert parallelism).
    """
    d = group.size
    if ring < 1 or d % ring:
        raise InputError(f"ring degree {ring} does not divide the group size {d}")
    i = group.ranks.index(slot) if slot in group.ranks else -1
    if i < 0:
        raise InputError(f"slot {slot} is not in the group of slots {list(group.ranks)[:8]}")
    seq_ids = np.asarray(group.seq_ids, dtype=np.int64)
    if seq_ids.size and (seq_ids.min() < 0 or seq_ids.max() >= batch.num_documents):
        raise PlanError(
            [f"micro-batch {microbatch}: sequence ids out of range 0..{batch.num_documents - 1}"]
        )
    starts = batch.token_starts(seq_ids)
    lens = batch.offsets[seq_ids + 1] - batch.offsets[seq_ids]
    if group.lengths and not np.array_equal(lens, np.asarray(group.lengths, dtype=np.int64)):
        bad = int(np.flatnonzero(lens != np.asarray(group.lengths))[0])
        raise PlanError(
            [
                f"micro-batch {microbatch}: sequence {int(seq_ids[bad])} has length "
                f"{group.lengths[bad]} in the plan but {int(lens[bad])} in the batch"
            ]
        )
    if doc_multiple < 1:
        raise InputError(f"doc_multiple must be >= 1 (got {doc_multiple})")
    seg = -(-lens // doc_multiple) * doc_multiple  # each document's segment, padded
    cum = np.zeros(seq_ids.size + 1, dtype=np.int64)
    np.cumsum(seg, out=cum[1:])
    t_docs = int(cum[-1])
    pad = padding_for(t_docs, d, local_multiple)
    if pad_empty and not seq_ids.size:
        pad = 2 * d * local_multiple
    t_total = t_docs + pad
    cu = np.append(cum, t_total) if pad else cum
    idx = rank_tokens(cu, d // ring, ring, i)  # buffer indices this slot holds, in order
    n = max(seq_ids.size, 1)
    k = np.minimum(np.searchsorted(cum, idx, side="right") - 1, n - 1)
    in_docs = idx < t_docs
    if seq_ids.size:
        offset = idx - cum[k]
        real = in_docs & (offset < lens[k])
        # Padding: its position in the trailing segment; 0 inside a document's own padding.
        pos = np.where(real, offset, np.where(in_docs, 0, idx - t_docs))
        flat = np.where(real, starts[k] + pos, 0)
        last = real & (pos == lens[k] - 1)
        has_target = real & ~last
        nxt = batch.tokens[np.minimum(flat + 1, batch.tokens.size - 1)]
        input_ids = np.where(real, batch.tokens[flat], pad_id)
        labels = np.where(has_target, nxt, pad_id)
        doc_ids = np.where(real, seq_ids[k], -1)
    else:  # an empty group: nothing to hold, or padding only (pad_empty)
        pos = idx
        has_target = np.zeros(idx.size, dtype=bool)
        input_ids = labels = np.full(idx.size, pad_id, dtype=np.int64)
        doc_ids = np.full(idx.size, -1, dtype=np.int64)
    loss_mask = has_target.astype(np.float32)
    position_ids = pos.astype(np.int64)
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
        max_seqlen=int(max(int(seg.max()) if seg.size else 0, pad)),
        group_tokens=int(lens.sum()),
        padded_tokens=t_total,
        ring=ring,
    )


def dispatch(
    batch: GlobalBatch,
    plan: Plan,
    slot: int,
    *,
    local_multiple: int = 1,
    pad_id: int = 0,
    te_layout: bool = False,
    pad_empty: bool = False,
    te_hybrid: bool | None = None,
) -> list[PackedMicroBatch]:
    """This slot's packed share of every micro-batch of ``plan``, in plan order.

    ``te_layout``: pad each document of a ring group that Transformer Engine's context
    parallelism carries as it needs (``te_doc_multiple``), so its own route can run the group;
    groups TE declines run HSP's ring and are not padded. ``te_hybrid``: whether the TE that
    runs them carries hybrid (Ulysses x ring) groups in THD (None: the installed TE's answer,
    ``backends.te_thd_a2a_p2p_supported``).

    Each group's token layout follows the ring degree the plan recorded (``Group.ring``; 0, i.e.
    unrecorded, means 1: ``agreement.resolve_splits`` records the registry's split first). The
    attention refuses a pack whose layout ring degree differs from its own.
    """
    if not 0 <= slot < plan.world_size:
        raise InputError(f"slot {slot} is outside the plan's 0..{plan.world_size - 1}")
    if te_layout and te_hybrid is None:
        from megatron_hsp.runtime.backends import te_thd_a2a_p2p_supported

        te_hybrid = te_thd_a2a_p2p_supported()
    return [
        pack_group_slice(
            batch,
            mb.group_of(slot),
            slot,
            microbatch=m,
            local_multiple=local_multiple,
            pad_id=pad_id,
            ring=max(1, mb.group_of(slot).ring),
            doc_multiple=te_doc_multiple(mb.group_of(slot), bool(te_hybrid)) if te_layout else 1,
            pad_empty=pad_empty,
        )
        for m, mb in enumerate(plan.microbatches)
    ]


def te_doc_multiple(group: Group, te_hybrid: bool) -> int:
    """What each document of ``group`` is padded to for TE's THD context parallelism: ``2 x d``
    where TE carries the group's ring (TE's CP rank ``c`` holds chunks ``c`` and ``2cp - 1 - c``
    of every sequence, ``layout.te_cp_arguments``), 1 otherwise: Ulysses-only groups, and
    hybrid groups on a TE without THD "a2a+p2p" (``te_hybrid`` False), which HSP's own ring
    runs. The rule is ``routes.te_doc_multiple``, the one the cost model prices."""
    return routes_te_doc_multiple(group.size, max(1, group.ulysses), group.ring, te_hybrid)


def check_token_accounting(
    batch: GlobalBatch, plan: Plan, packs_by_slot: dict[int, Iterable[PackedMicroBatch]]
) -> None:
    """Raise unless every token of ``batch`` is held exactly once and trained exactly once.

    ``packs_by_slot`` maps each slot to its ``dispatch`` result. Checks, per document: every
    position 0..L-1 appears exactly once across all slots and micro-batches with the right token
    id, every position but the last carries loss with the next token as label, and padding never
    carries loss.
    """
    if not batch.dense:
        raise InputError("token accounting needs the whole batch (GlobalBatch.from_documents)")
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
