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
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from megatron_hsp.planner.errors import InputError
from megatron_hsp.planner.run_spec import DEFAULT_OVERLONG, OverlongPolicy, parse_choice


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

    @property
    def fingerprint(self) -> str:
        """The batch's identity: a hash of its (document, offset, length) pieces in order.

        Why: an A/B of two plan methods is only a comparison when both runs trained the same
        batches; ``megatron-hsp compare`` checks this value step by step in the plan logs."""
        rows = np.asarray([(p.doc, p.offset, p.length) for p in self.pieces], dtype=np.int64)
        return hashlib.sha256(rows.tobytes()).hexdigest()[:16]


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
    holds ``global_batch_docs`` sequences; by token budget (``--hsp``'s default: the stock
    step's ``--global-batch-size x --seq-length``), sequences are added whole in sampler order
    until the next one would exceed the budget: that document is neither cut nor dropped, it
    starts the next batch. So a batch never holds more than the budget, holds less by under
    one document (a batch always holds at least one), and no document is lost or trained
    twice; the number of documents per batch varies.
    """

    seed: int
    max_length: int  # longest trainable sequence (the cost model's, for the allowed sizes)
    global_batch_docs: int | None = None
    token_budget: int | None = None
    overlong: str = DEFAULT_OVERLONG.value
    shuffle: bool = True
    min_length: int = 2  # a sequence needs >= 2 tokens to give one next-token target
    # Which random stream the permutations come from: None is the lone dataset's; a blend gives
    # its other datasets their own (``BlendedBatchSampler``), so equal-sized datasets are not
    # shuffled alike.
    stream: int | None = None

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
        # Stored as the plain string: the sampler's fingerprint (resume check) hashes its repr.
        policy = parse_choice(OverlongPolicy, self.overlong, "--hsp-overlong").value
        object.__setattr__(self, "overlong", policy)
        if self.max_length < self.min_length:
            raise InputError(f"longest trainable length {self.max_length} is below 2 tokens")


class BatchSampling:
    """What both samplers share: a global batch is whole sequences, up to the token budget (a
    sequence that would cross it starts the next batch; a batch has at least one) and at most
    ``global_batch_docs`` of them (``fill``); batches one after another (``__iter__``); and a
    resume skips batches by drawing them (``fast_forward``: lengths only, no tokens read).
    Subclasses say which sequence comes next (``fill``'s two callables) and hold the state."""

    config: SamplerConfig

    def next_batch(self) -> DocumentBatch:
        raise NotImplementedError

    def fill(self, peek: Callable[[], int], take: Callable[[], Piece]) -> tuple[list[Piece], int]:
        """The next batch's pieces and tokens: ``peek()`` is the next sequence's length,
        ``take()`` takes it."""
        c = self.config
        pieces: list[Piece] = []
        tokens = 0
        while True:
            n = peek()
            if c.token_budget is not None and pieces and tokens + n > c.token_budget:
                break  # whole sequences only: this one starts the next batch
            pieces.append(take())
            tokens += n
            if c.global_batch_docs is not None and len(pieces) >= c.global_batch_docs:
                break
        return pieces, tokens

    def __iter__(self) -> Iterator[DocumentBatch]:
        while True:
            yield self.next_batch()

    def fast_forward(self, steps: int) -> None:
        """Skip ``steps`` batches (resume from an iteration count; reads lengths only)."""
        for _ in range(steps):
            self.next_batch()


class GlobalBatchSampler(BatchSampling):
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
                f"{cap} (first: document {first}, {int(self.lengths[first])} tokens) under "
                f"--hsp-overlong error; --hsp-overlong split (the default) trains them as "
                f"pieces of {cap} tokens, drop leaves them out"
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

    @property
    def mean_sequence_tokens(self) -> float:
        """Mean tokens of a trainable sequence: a token budget's expected documents per step is
        the budget over it (the start-up line)."""
        return float(self.unit_length.mean())

    def _fingerprint(self) -> str:
        h = hashlib.sha256(self.lengths.tobytes())
        c = self.config
        h.update(
            repr((c.seed, c.global_batch_docs, c.token_budget, c.overlong, c.shuffle)).encode()
        )
        h.update(repr((c.max_length, c.min_length)).encode())
        if c.stream is not None:
            h.update(repr(("stream", c.stream)).encode())
        return h.hexdigest()[:16]

    def _order(self, epoch: int) -> np.ndarray:
        """Epoch ``epoch``'s permutation of the units (corpus order): ``default_rng([seed,
        epoch])``, or ``[seed, stream, epoch]`` for a blend's dataset ``stream`` (the rule
        docs/integration.md states and ``testing/sampler_oracle.py`` re-derives)."""
        if epoch != self._perm_epoch:
            n = self.num_sequences
            if self.config.shuffle:
                key = [self.config.seed, epoch]
                if self.config.stream is not None:
                    key = [self.config.seed, self.config.stream, epoch]
                self._perm = np.random.default_rng(key).permutation(n)
            else:
                self._perm = np.arange(n)
            self._perm_epoch = epoch
        return self._perm

    def peek_unit(self) -> Piece:
        """The next sequence of the permutation, without taking it (a blend asks each of its
        datasets' samplers for one sequence at a time)."""
        st = self.state
        while True:
            order = self._order(st.epoch)
            if st.position < len(order):
                u = int(order[st.position])
                return Piece(
                    int(self.unit_doc[u]), int(self.unit_offset[u]), int(self.unit_length[u])
                )
            st.epoch += 1
            st.position = 0

    def take_unit(self) -> Piece:
        """Take the sequence ``peek_unit`` returns: the permutation moves on by one."""
        piece = self.peek_unit()
        self.state.position += 1
        return piece

    def next_batch(self) -> DocumentBatch:
        st = self.state
        pieces, tokens = self.fill(lambda: self.peek_unit().length, self.take_unit)
        batch = DocumentBatch(st.step, tuple(pieces))
        st.step += 1
        st.consumed_sequences += len(pieces)
        st.consumed_tokens += tokens
        return batch

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


# ------------------------------------------------------------------------------------- blending
@dataclass(frozen=True)
class BlendComponent:
    """One dataset of a blend, restricted to one split's documents.

    ``lengths`` are the lengths of documents ``doc_base .. doc_base + len(lengths) - 1`` in the
    blend's global document numbering (datasets numbered one after the other, in blend order:
    ``documents.BlendedDocumentReader`` maps them back). ``weight``: the share of the split's
    tokens this dataset should supply (normalised over the components).
    """

    name: str
    weight: float
    doc_base: int
    lengths: np.ndarray


class BlendedBatchSampler(BatchSampling):
    """Global batches of whole documents from several datasets, blend weights honoured by tokens.

    Why by tokens: Megatron's blend weights are shares of its fixed-length samples, i.e. of
    tokens; with whole documents of different mean length per dataset, a share of documents
    would over-weight the dataset of short documents. Each next sequence comes from the
    dataset furthest below its share, ``argmax_i(w_i * T - t_i)`` (``T`` tokens drawn so far,
    ``t_i`` from dataset ``i``; ties to the first), so ``|t_i - w_i T|`` stays under one document
    at every step: deterministic, no random draw to reproduce. Inside a dataset the sequences
    come from that dataset's own ``GlobalBatchSampler`` (seeded permutation per epoch, overlong
    policy, epochs that wrap independently: a small dataset is repeated, as Megatron's blend
    repeats it). Same interface as ``GlobalBatchSampler`` (``next_batch``, ``state_dict``,
    ``load_state_dict``, ``fast_forward``, ``report``), so ``StepPipeline`` takes either.
    """

    def __init__(self, components: Sequence[BlendComponent], config: SamplerConfig) -> None:
        if not components:
            raise InputError("a blend needs at least one dataset")
        weights = np.asarray([c.weight for c in components], dtype=np.float64)
        if not np.all(np.isfinite(weights)) or np.any(weights < 0) or weights.sum() <= 0:
            raise InputError(
                f"blend weights must be >= 0 with a positive sum (got {weights.tolist()})"
            )
        self.config = config
        kept = [(c, float(w)) for c, w in zip(components, weights, strict=True) if w > 0]
        self.components = [c for c, _ in kept]
        self.weights = np.asarray([w for _, w in kept]) / sum(w for _, w in kept)
        self.samplers: list[GlobalBatchSampler] = []
        for i, comp in enumerate(self.components):
            # Component 0 draws the permutation a lone dataset would (a one-dataset "blend" is
            # exactly GlobalBatchSampler over it); the others their own stream.
            sub = replace(config, stream=None if i == 0 else i)
            try:
                self.samplers.append(GlobalBatchSampler(comp.lengths, sub))
            except InputError as exc:
                raise InputError(f"dataset {comp.name}: {exc}") from None
        self.step = 0
        self.consumed_sequences = 0
        self.consumed_tokens = 0
        self.tokens_from = [0] * len(self.components)
        # The batch being drawn: its tokens, and per dataset (the choice counts them too).
        self._batch_tokens = 0
        self._batch_from = np.zeros(len(self.components), dtype=np.int64)
        self.fingerprint = self._fingerprint()

    @property
    def num_sequences(self) -> int:
        return sum(s.num_sequences for s in self.samplers)

    @property
    def mean_sequence_tokens(self) -> float:
        """Mean tokens of a drawn sequence: datasets supply tokens by weight, so the mean is
        the weights' harmonic mean of the datasets' means."""
        per_token = sum(
            w / s.mean_sequence_tokens for w, s in zip(self.weights, self.samplers, strict=True)
        )
        return float(1.0 / per_token)

    def _fingerprint(self) -> str:
        h = hashlib.sha256()
        for comp, w, s in zip(self.components, self.weights, self.samplers, strict=True):
            h.update(repr((comp.doc_base, round(float(w), 12), s.state.fingerprint)).encode())
        return h.hexdigest()[:16]

    def _choose(self) -> int:
        total = self.consumed_tokens + self._batch_tokens
        deficit = self.weights * total - (np.asarray(self.tokens_from) + self._batch_from)
        return int(np.argmax(deficit))

    def next_batch(self) -> DocumentBatch:
        self._batch_tokens, self._batch_from = 0, np.zeros(len(self.components), dtype=np.int64)
        chosen = [0]

        def peek() -> int:
            chosen[0] = self._choose()  # depends on what this batch took so far
            return self.samplers[chosen[0]].peek_unit().length

        def take() -> Piece:
            i = chosen[0]
            p = self.samplers[i].take_unit()
            self._batch_tokens += p.length
            self._batch_from[i] += p.length
            return Piece(self.components[i].doc_base + p.doc, p.offset, p.length)

        pieces, _ = self.fill(peek, take)
        batch = DocumentBatch(self.step, tuple(pieces))
        self.step += 1
        self.consumed_sequences += len(pieces)
        self.consumed_tokens += self._batch_tokens
        self.tokens_from = [int(t) for t in np.asarray(self.tokens_from) + self._batch_from]
        self._batch_tokens, self._batch_from = 0, np.zeros(len(self.components), dtype=np.int64)
        return batch

    @property
    def state(self) -> SamplerState:
        """The blend's totals in ``GlobalBatchSampler``'s form (epoch: the first dataset's)."""
        return SamplerState(
            seed=self.config.seed,
            epoch=self.samplers[0].state.epoch,
            position=self.samplers[0].state.position,
            step=self.step,
            consumed_sequences=self.consumed_sequences,
            consumed_tokens=self.consumed_tokens,
            fingerprint=self.fingerprint,
        )

    def state_dict(self) -> dict[str, Any]:
        return {
            "fingerprint": self.fingerprint,
            "step": self.step,
            "consumed_sequences": self.consumed_sequences,
            "consumed_tokens": self.consumed_tokens,
            "tokens_from": list(self.tokens_from),
            "datasets": [s.state_dict() for s in self.samplers],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("fingerprint") != self.fingerprint:
            raise InputError(
                "sampler checkpoint was written for a different blend, split or sampling flags "
                f"(fingerprint {state.get('fingerprint')} != {self.fingerprint}); resume with "
                "the same --data-path (or --train/valid/test-data-path), weights, --split, "
                "--seed/--hsp-seed, batch and overlong flags"
            )
        for sampler, sub in zip(self.samplers, state["datasets"], strict=True):
            sampler.load_state_dict(sub)
        self.step = int(state["step"])
        self.consumed_sequences = int(state["consumed_sequences"])
        self.consumed_tokens = int(state["consumed_tokens"])
        self.tokens_from = [int(t) for t in state["tokens_from"]]

    def report(self, state: dict[str, Any] | None = None) -> str:
        """Counters as one line, with each dataset's share of the tokens drawn (``state``: a
        ``state_dict`` to report instead of now)."""
        st = self.state_dict() if state is None else state
        total = max(1, st["consumed_tokens"])
        shares = ", ".join(
            f"{c.name} {t / total:.1%} (weight {w:.1%})"
            for c, w, t in zip(self.components, self.weights, st["tokens_from"], strict=True)
        )
        return (
            f"{st['consumed_sequences']} sequences / {st['consumed_tokens']} tokens in "
            f"{st['step']} steps from {len(self.components)} datasets: {shares}; corpus: "
            f"{self.num_sequences} sequences"
        )
