"""Whole documents from a Megatron indexed dataset, sampled into global batches.

Megatron's ``GPTDataset`` cuts the token stream into fixed ``--seq-length`` samples, which destroys
exactly the length heterogeneity HSP exploits. Here a global batch is a set of whole documents:

* ``DocumentIndex`` reads document lengths from the ``.idx`` alone (no token is touched);
* ``GlobalBatchSampler`` draws batches from a seeded per-epoch permutation, by document count
  (``--global-batch-size``) or by token budget (``--hsp-token-budget``), applies the overlong
  policy (``error`` / ``drop`` / ``split``, every drop and split counted), and resumes exactly from
  its ``state_dict`` (or by replaying ``n`` steps, which only reads lengths);
* ``DocumentReader`` reads the tokens of the documents one rank trains, and nothing else;
* ``build_stdlib_corpus`` writes the demo corpus (Python's own standard library, byte-level tokens)
  with megatron-core's ``IndexedDatasetBuilder``.
"""

from __future__ import annotations

import ast
import hashlib
import itertools
import os
import sys
import sysconfig
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from megatron_hsp.planner.errors import InputError

OVERLONG_POLICIES = ("error", "drop", "split")


# ---------------------------------------------------------------------------------------- index
class DocumentIndex:
    """Document lengths (tokens) of a Megatron indexed dataset, from its ``.idx`` file only.

    A Megatron document is the run of sequences between consecutive ``document_indices``
    (one sequence per document unless the corpus was preprocessed with ``--split-sentences``).
    """

    def __init__(self, prefix: str | os.PathLike[str]) -> None:
        from megatron.core.datasets.indexed_dataset import IndexedDataset

        self.prefix = str(prefix)
        for suffix in (".idx", ".bin"):
            if not Path(self.prefix + suffix).is_file():
                raise InputError(
                    f"indexed dataset {self.prefix!r}: {self.prefix + suffix} not found; pass the "
                    "path prefix without .bin/.idx (e.g. --data-path my-corpus_text_document)"
                )
        # mmap=True keeps the .bin mapped, not read; only .idx arrays are touched here.
        self.dataset = IndexedDataset(self.prefix, mmap=True)
        seq_lengths = np.asarray(self.dataset.sequence_lengths, dtype=np.int64)
        doc_idx = np.asarray(self.dataset.document_indices, dtype=np.int64)
        self.first_sequence = doc_idx[:-1]
        self.num_sequences = np.diff(doc_idx)
        csum = np.concatenate([[0], np.cumsum(seq_lengths)])
        self.lengths = csum[doc_idx[1:]] - csum[doc_idx[:-1]]

    def __len__(self) -> int:
        return len(self.lengths)


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


# --------------------------------------------------------------------------------------- reader
class DocumentReader:
    """Reads the tokens of single pieces; a rank calls it only for the pieces its groups train."""

    def __init__(self, index: DocumentIndex) -> None:
        self.index = index
        self.tokens_read = 0

    def read(self, piece: Piece) -> np.ndarray:
        ds, ix = self.index.dataset, self.index
        first, count = int(ix.first_sequence[piece.doc]), int(ix.num_sequences[piece.doc])
        if count == 1:
            out = ds.get(first, offset=piece.offset, length=piece.length)
        else:  # sentence-split corpus: concatenate the document's sequences, then cut
            whole = np.concatenate([ds[i] for i in range(first, first + count)])
            out = whole[piece.offset : piece.offset + piece.length]
        self.tokens_read += len(out)
        return np.asarray(out, dtype=np.int64)

    def read_for_rank(self, batch: DocumentBatch, plan: Any, slot: int) -> dict[int, np.ndarray]:
        """Tokens of every sequence this slot's groups train in ``plan`` (keyed by seq id)."""
        wanted = sorted({s for mb in plan.microbatches for s in mb.group_of(slot).seq_ids})
        return {s: self.read(batch.pieces[s]) for s in wanted}

    def documents_for_rank(self, batch: DocumentBatch, plan: Any, slot: int) -> list[np.ndarray]:
        """All of the batch's documents in seq-id order, as the runtime's ``GlobalBatch`` takes
        them, with real tokens only where this slot trains them: the others are zero
        placeholders of the right length (dispatch reads only the slot's own groups)."""
        mine = self.read_for_rank(batch, plan, slot)
        return [
            mine[s] if s in mine else np.zeros(p.length, dtype=np.int64)
            for s, p in enumerate(batch.pieces)
        ]


# --------------------------------------------------------------------------------- demo corpus
BYTE_VOCAB = 256
EOD_TOKEN = (
    256  # appended to every document, as Megatron's preprocess_data.py does with --append-eod
)
DEMO_VOCAB_SIZE = 264  # 257 rounded up to a multiple of 8


def stdlib_sources(limit: int | None = None) -> list[Path]:
    """The standard library's ``.py`` files, sorted: a real, heavy-tailed corpus in every Python."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts)
    return files[:limit] if limit else files


def write_indexed_dataset(prefix: str | os.PathLike[str], docs: Iterable[np.ndarray]) -> int:
    """Write documents as a Megatron indexed dataset (``prefix.bin`` / ``prefix.idx``)."""
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    prefix = str(prefix)
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    n = 0
    for doc in docs:
        builder.add_item(torch.from_numpy(np.asarray(doc, dtype=np.int64)))
        builder.end_document()
        n += 1
    builder.finalize(prefix + ".idx")
    return n


def default_cache_dir() -> Path:
    base = os.environ.get("MEGATRON_HSP_CACHE") or os.environ.get("XDG_CACHE_HOME")
    return Path(base) / "megatron-hsp" if base else Path.home() / ".cache" / "megatron-hsp"


@dataclass
class Corpus:
    prefix: Path
    num_docs: int
    source: str
    built: bool = field(default=False)


def split_top_level(source: bytes) -> list[bytes]:
    """A module's source cut at its top-level ``def`` / ``class`` statements (decorators
    included), plus the module header: the natural documents of a code corpus, heavy-tailed in
    length from one-line helpers to thousand-line classes. Unparsable files stay whole."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return [source]
    lines = source.splitlines(keepends=True)
    starts = [
        min([n.lineno, *(d.lineno for d in n.decorator_list)]) - 1
        for n in tree.body
        if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
    ]
    bounds = sorted({0, *starts, len(lines)})
    chunks = [b"".join(lines[a:b]) for a, b in itertools.pairwise(bounds)]
    return [c for c in chunks if c.strip()]


def build_stdlib_corpus(
    cache_dir: str | os.PathLike[str] | None = None, *, wait: bool = False, timeout_s: float = 900
) -> Corpus:
    """Byte-level tokens of the standard library's top-level definitions (one document each),
    built once per Python version; ``num_docs`` is -1 when the cached copy is reused."""
    files = stdlib_sources()
    sizes = sum(p.stat().st_size for p in files)
    key = hashlib.sha256(f"v2|{sys.version}|{len(files)}|{sizes}".encode()).hexdigest()[:12]
    out = Path(cache_dir) if cache_dir else default_cache_dir()
    prefix = out / f"stdlib-bytes-{key}"
    source = (
        f"top-level definitions of the {len(files)} .py files of Python "
        f"{sys.version.split()[0]}'s standard library, byte tokens"
    )
    ready = lambda: Path(str(prefix) + ".idx").is_file() and Path(str(prefix) + ".bin").is_file()  # noqa: E731
    if wait:  # another process (local rank 0) builds it
        deadline = time.monotonic() + timeout_s
        while not ready():
            if time.monotonic() > deadline:
                raise InputError(f"corpus {prefix} was not built within {timeout_s:.0f} s")
            time.sleep(0.5)
    if ready():
        return Corpus(prefix, -1, source)
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / f".tmp-{os.getpid()}-{prefix.name}"

    def docs() -> Iterator[np.ndarray]:
        for p in files:
            for chunk in split_top_level(p.read_bytes()):
                data = np.frombuffer(chunk, dtype=np.uint8).astype(np.int64)
                yield np.append(data, EOD_TOKEN)

    n = write_indexed_dataset(tmp, docs())
    # Atomic publish: concurrent builders (several ranks, two demos) never see half a file.
    os.replace(str(tmp) + ".bin", str(prefix) + ".bin")
    os.replace(str(tmp) + ".idx", str(prefix) + ".idx")
    return Corpus(prefix, n, source, built=True)
