"""Global batches of whole documents.

Megatron's ``GPTDataset`` cuts the token stream into fixed ``--seq-length`` samples, which destroys
exactly the length heterogeneity HSP exploits. Here a global batch is a set of whole documents:
``GlobalBatchSampler`` draws batches from a seeded per-epoch permutation, by document count
(``--global-batch-size``) or by token budget (``--hsp-token-budget``), applies the overlong policy
(``error`` / ``drop`` / ``split``, every drop and split counted), and resumes exactly from its
``state_dict`` (or by replaying ``n`` steps, which only reads lengths). It reads lengths only.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from megatron_hsp.planner.errors import InputError

OVERLONG_POLICIES = ("error", "drop", "split")


# -------------------------------------------------------------------------------------- sampler
@dataclass(frozen=True, slots=True)
class Piece:
    """A trainable unit: a whole document, or one piece of a split overlong document."""

    doc: int
    offset: int
    length: int


@dataclass(frozen=True)
class DocumentBatch:
    """One step's sequences; sequence id ``i`` (what a ``Plan`` refers to) is ``pieces[i]``."""

    step: int
    pieces: tuple[Piece, ...]

    @property
    def lengths(self) -> list[int]:
        return [p.length for p in self.pieces]

    @property
    def tokens(self) -> int:
        return sum(p.length for p in self.pieces)


@dataclass
class SamplerState:
    """Everything needed to resume: where in which epoch's permutation the next batch starts."""

    seed: int
    epoch: int = 0
    position: int = 0
    step: int = 0
    consumed_sequences: int = 0
    consumed_tokens: int = 0
    fingerprint: str = ""


@dataclass(frozen=True)
class SamplerConfig:
    """How global batches are drawn; exactly one of ``global_batch_docs`` / ``token_budget``.

    A training sequence is a whole document, or one piece of an overlong document under the
    ``split`` policy (pieces are then sampled independently, like documents). By count, a batch
    holds ``global_batch_docs`` sequences; by token budget, sequences are added whole until the
    next one would exceed the budget (a batch always holds at least one).
    """

    seed: int
    max_length: int  # longest trainable sequence (the cost model's, for the allowed sizes)
    global_batch_docs: int | None = None
    token_budget: int | None = None
    overlong: str = "error"
    shuffle: bool = True
    min_length: int = 2  # a sequence needs >= 2 tokens to give one next-token target

    def __post_init__(self) -> None:
        if (self.global_batch_docs is None) == (self.token_budget is None):
            raise InputError(
                "give exactly one of --global-batch-size (documents per step) and "
                "--hsp-token-budget (tokens per step)"
            )
        if self.global_batch_docs is not None and self.global_batch_docs < 1:
            raise InputError(f"--global-batch-size must be >= 1 (got {self.global_batch_docs})")
        if self.token_budget is not None and self.token_budget < 1:
            raise InputError(f"--hsp-token-budget must be >= 1 (got {self.token_budget})")
        if self.overlong not in OVERLONG_POLICIES:
            raise InputError(
                f"--hsp-overlong {self.overlong!r}: choose one of {', '.join(OVERLONG_POLICIES)}"
            )
        if self.max_length < self.min_length:
            raise InputError(f"longest trainable length {self.max_length} is below 2 tokens")


class GlobalBatchSampler:
    """Seeded global batches of whole documents; deterministic given (lengths, config, state).

    The overlong policy is applied once, to the whole corpus, at construction: ``error`` fails at
    start-up naming the first overlong document (not hours into training), ``drop`` and
    ``split`` are counted (``report()``). Units are numpy arrays, so 10^8 documents are fine.
    """

    def __init__(self, lengths: Sequence[int] | np.ndarray, config: SamplerConfig) -> None:
        self.lengths = np.asarray(lengths, dtype=np.int64)
        self.config = config
        cap, lo = config.max_length, config.min_length
        # Documents too short to train anything (empty files, a lone token) are not sequences.
        short = self.lengths < lo
        over = self.lengths > cap
        self.skipped_short = int(short.sum())
        self.overlong_docs = int(over.sum())
        self.dropped_tokens = int(self.lengths[short].sum())
        if self.overlong_docs and config.overlong == "error":
            first = int(np.flatnonzero(over)[0])
            raise InputError(
                f"{self.overlong_docs} documents are longer than the longest trainable length "
                f"{cap} under this cost model and memory cap (first: document {first}, "
                f"{int(self.lengths[first])} tokens); pass --hsp-overlong split (cut them into "
                "trainable pieces) or drop, raise --hsp-memory-cap-gb, or allow larger "
                "--hsp-group-sizes"
            )
        whole = np.flatnonzero(~short & ~over)
        if config.overlong == "drop" or not self.overlong_docs:
            self.dropped_tokens += int(self.lengths[over].sum())
            doc, off, ln = whole, np.zeros_like(whole), self.lengths[whole]
        else:  # split into pieces of ``cap``; a tail under ``min_length`` has no target
            odocs = np.flatnonzero(over)
            counts = -(-self.lengths[odocs] // cap)
            pdoc = np.repeat(odocs, counts)
            first = np.repeat(np.cumsum(counts) - counts, counts)
            poff = (np.arange(len(pdoc)) - first) * cap
            plen = np.minimum(cap, self.lengths[pdoc] - poff)
            keep = plen >= lo
            self.dropped_tokens += int(plen[~keep].sum())
            doc = np.concatenate([whole, pdoc[keep]])
            off = np.concatenate([np.zeros_like(whole), poff[keep]])
            ln = np.concatenate([self.lengths[whole], plen[keep]])
            order = np.lexsort((off, doc))  # units in corpus order: (document, offset)
            doc, off, ln = doc[order], off[order], ln[order]
        self.unit_doc, self.unit_offset, self.unit_length = doc, off, ln
        if len(doc) == 0:
            raise InputError(
                f"no trainable sequence: every document is under {lo} tokens or dropped as "
                f"longer than {cap}"
            )
        self.state = SamplerState(seed=config.seed, fingerprint=self._fingerprint())
        self._perm_epoch = -1
        self._perm = np.arange(len(doc))

    @property
    def num_sequences(self) -> int:
        return len(self.unit_doc)

    def _fingerprint(self) -> str:
        h = hashlib.sha256(self.lengths.tobytes())
        c = self.config
        h.update(
            repr((c.seed, c.global_batch_docs, c.token_budget, c.overlong, c.shuffle)).encode()
        )
        h.update(repr((c.max_length, c.min_length)).encode())
        return h.hexdigest()[:16]

    def _order(self, epoch: int) -> np.ndarray:
        if epoch != self._perm_epoch:
            n = self.num_sequences
            if self.config.shuffle:
                self._perm = np.random.default_rng([self.config.seed, epoch]).permutation(n)
            else:
                self._perm = np.arange(n)
            self._perm_epoch = epoch
        return self._perm

    def next_batch(self) -> DocumentBatch:
        c, st = self.config, self.state
        pieces: list[Piece] = []
        tokens = 0
        while True:
            order = self._order(st.epoch)
            if st.position >= len(order):
                st.epoch += 1
                st.position = 0
                continue
            u = int(order[st.position])
            n = int(self.unit_length[u])
            if c.token_budget is not None and pieces and tokens + n > c.token_budget:
                break  # whole sequences only: this one starts the next batch
            st.position += 1
            pieces.append(Piece(int(self.unit_doc[u]), int(self.unit_offset[u]), n))
            tokens += n
            if c.global_batch_docs is not None and len(pieces) >= c.global_batch_docs:
                break
        batch = DocumentBatch(st.step, tuple(pieces))
        st.step += 1
        st.consumed_sequences += len(pieces)
        st.consumed_tokens += tokens
        return batch

    def __iter__(self) -> Iterator[DocumentBatch]:
        while True:
            yield self.next_batch()

    def fast_forward(self, steps: int) -> None:
        """Skip ``steps`` batches (resume from an iteration count; reads lengths only)."""
        for _ in range(steps):
            self.next_batch()

    # -------------------------------------------------------------------- checkpointing
    def state_dict(self) -> dict[str, Any]:
        return dict(vars(self.state))

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("fingerprint") != self.state.fingerprint:
            raise InputError(
                "sampler checkpoint was written for a different corpus or sampling flags "
                f"(fingerprint {state.get('fingerprint')} != {self.state.fingerprint}); resume "
                "with the same --data-path, --seed/--hsp-seed, batch and overlong flags"
            )
        self.state = SamplerState(**state)

    def report(self, state: dict[str, Any] | None = None) -> str:
        """Counters as one line; ``state`` (a ``state_dict``) reports that point instead of
        now, e.g. the batches actually trained when one more has already been prefetched."""
        s, c = (self.state if state is None else SamplerState(**state)), self.config
        policy = {
            "error": "none",
            "drop": f"{self.overlong_docs} dropped",
            "split": f"{self.overlong_docs} split into {c.max_length}-token pieces",
        }[c.overlong if self.overlong_docs else "error"]
        return (
            f"{s.consumed_sequences} sequences / {s.consumed_tokens} tokens in {s.step} steps "
            f"(epoch {s.epoch}); corpus: {self.num_sequences} sequences, overlong documents: "
            f"{policy}, {self.skipped_short} documents under {c.min_length} tokens skipped, "
            f"{self.dropped_tokens} tokens never trained"
        )
