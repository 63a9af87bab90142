"""Sequence lengths in, global batches out (numpy only).

Sources: a text file with one positive integer per line (optionally ``.gz``), or a Megatron
indexed dataset prefix (``PREFIX.idx``), whose document lengths we read from the index ourselves.
The embedded default (``megatron_hsp/data/wikipedia_lengths_100k.txt.gz``) is used when no file
is given.

Global batches:

- ``sequential`` follows FlexSP's harness (galvatron/flexsp_solver/solver.py, ``read_dataset``
  and ``get_global_batch``): every length is padded up to a multiple of 128, lengths above
  ``max_seq - 128`` are dropped, and batch ``i`` is the ``i``-th run of ``global_batch``
  consecutive survivors. FlexSP writes the multiple as ``2 * world_size`` but its ``__main__``
  never passes ``world_size``, so it is 2 * 64 = 128 at every cluster size; ``max_seq`` "192k" is
  ``seq_limit_k * 1000`` = 192000 there. These exact rules reproduce its published totals.
- ``random`` draws ``global_batch`` documents without replacement, seeded by ``(seed, step)``,
  unpadded.

Sequences longer than what the cluster can train (``--overlong``): ``error`` (default) names the
sequence, its length and the longest trainable length; ``drop`` removes them and ``split`` cuts
them into trainable pieces, each counted in the batch's report.
"""

from __future__ import annotations

import gzip
import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import numpy as np

from megatron_hsp.planner.errors import InputError
from megatron_hsp.planner.paths import atomic_open, atomic_write
from megatron_hsp.planner.run_spec import OverlongPolicy, parse_choice
from megatron_hsp.planner.units import MAX_TOKENS, parse_tokens

DEFAULT_LENGTHS = "wikipedia_lengths_100k.txt.gz"
FLEXSP_PAD_MULTIPLE = 128  # 2 * world_size with FlexSP's hard-wired world_size = 64
SAMPLING_MODES = ("sequential", "random")
_IDX_HEADER = b"MMIDIDX\x00\x00"
#: Sequences one global batch may hold after --overlong split (the planner's search is about
#: linear in them; figures: docs/reliability.md): more pieces are refused before any is built.
MAX_BATCH_SEQUENCES = 65536
#: Sequences a lengths input may hold after --overlong split under --sampling sequential.
MAX_CORPUS_SEQUENCES = 10**8


# ---------------------------------------------------------------------- reading
def default_lengths_path() -> Path:
    """The Wikipedia subset shipped with the package (see megatron_hsp/data/README.md)."""
    return Path(str(resources.files("megatron_hsp") / "data" / DEFAULT_LENGTHS))


def parse_max_seq(value: str | int) -> int:
    """``--max-seq``: ``192k`` -> 192000 (decimal k, FlexSP's ``seq_limit_k * 1000``); the rule
    lives in :func:`megatron_hsp.planner.units.parse_tokens`."""
    return parse_tokens(value, "--max-seq")


def read_lengths(path: str | Path | None = None) -> np.ndarray:
    """Document lengths (int64) from a text/.gz file or an indexed-dataset prefix."""
    if path is None:
        path = default_lengths_path()
    p = Path(path)
    idx = p if p.suffix == ".idx" else Path(str(p) + ".idx")
    if idx.is_file() and not (p.is_file() and p.suffix != ".idx"):
        return read_indexed_dataset_lengths(idx)
    if p.suffix == ".bin":  # read as text it was a UTF-8 decode error
        prefix = p.with_suffix("")
        raise InputError(
            f"--lengths {str(path)!r} is an indexed dataset's token file; pass its prefix "
            f"{str(prefix)!r} (or {str(prefix)!r}.idx), whose index holds the document lengths"
        )
    if not p.is_file():
        raise InputError(
            f"--lengths {str(path)!r}: no such file (nor {idx.name}); give a text file with one "
            "length per line, a .gz of one, or a Megatron indexed dataset prefix"
        )
    return read_text_lengths(p)


def read_text_lengths(path: str | Path) -> np.ndarray:
    """One positive integer per line; blank lines are skipped; errors name file and line."""
    p = Path(path)
    opener = gzip.open if p.suffix == ".gz" else open
    out: list[int] = []
    try:
        with opener(p, "rt", encoding="utf-8-sig") as fh:  # -sig: a BOM is not part of line 1
            for lineno, line in enumerate(fh, start=1):
                text = line.strip().lstrip("\ufeff")
                if not text:
                    continue
                # ASCII digits only: int() would also take "1_000", "+7", " 7" and non-ASCII
                # digits, which no length file means.
                digits = text[1:] if text.startswith("-") else text
                if not (digits.isascii() and digits.isdigit()):
                    raise InputError(
                        f"{p}:{lineno}: {text[:40]!r} is not an integer length "
                        "(expected one positive integer per line, digits 0-9 only)"
                    )
                # Counted before int(): a 5,000-digit line exceeds Python's conversion limit
                # (ValueError) and any length this tool plans.
                if len(digits.lstrip("0")) > len(str(MAX_TOKENS)):
                    raise InputError(
                        f"{p}:{lineno}: length {text[:40]}{'...' if len(text) > 40 else ''} "
                        f"({len(digits)} digits) is larger than {MAX_TOKENS:.0e} tokens; "
                        "expected one document length per line"
                    )
                n = int(text)
                if n <= 0:
                    raise InputError(f"{p}:{lineno}: length {n} is not positive")
                if n > MAX_TOKENS:
                    raise InputError(
                        f"{p}:{lineno}: length {text[:40]} is larger than {MAX_TOKENS:.0e} "
                        "tokens; expected one document length per line"
                    )
                out.append(n)
    except (OSError, EOFError, UnicodeDecodeError, zlib.error) as exc:
        # zlib.error: a corrupt (not truncated) .gz; gzip.BadGzipFile is an OSError.
        raise InputError(f"--lengths {str(p)!r} cannot be read: {exc}") from None
    if not out:
        raise InputError(f"--lengths {str(p)!r} holds no lengths")
    return np.asarray(out, dtype=np.int64)


def read_indexed_dataset_lengths(idx_path: str | Path) -> np.ndarray:
    """Document lengths in tokens from a Megatron ``.idx`` file, without megatron-core.

    Layout (megatron/core/datasets/indexed_dataset.py, ``_IndexWriter.write`` / ``_IndexReader``):
    9-byte magic ``MMIDIDX\\0\\0``, ``<Q`` version (1), ``<B`` dtype code, ``<Q`` sequence
    count S, ``<Q`` document count D, then int32[S] sequence lengths, int64[S] byte pointers,
    int64[D] document indices (D = documents + 1; document j spans sequences
    ``document_indices[j]:document_indices[j+1]``). A document's length is the sum of its
    sequences' lengths (several when the preprocessor split sentences).
    """
    p = Path(idx_path)
    with open(p, "rb") as fh:
        head = fh.read(34)
    if len(head) < 34 or head[:9] != _IDX_HEADER:
        raise InputError(f"{p}: not a Megatron indexed-dataset index (bad header)")
    (version,) = struct.unpack("<Q", head[9:17])
    if version != 1:
        raise InputError(f"{p}: index version {version}, only version 1 is understood")
    seq_count, doc_count = struct.unpack("<QQ", head[18:34])
    buf = np.memmap(p, dtype=np.uint8, mode="r")
    need = 34 + seq_count * (4 + 8) + doc_count * 8
    if buf.size < need:
        raise InputError(f"{p}: truncated index ({buf.size} bytes, header promises {need})")
    seq_lengths = np.frombuffer(buf, dtype=np.int32, count=seq_count, offset=34).astype(np.int64)
    doc_idx = np.frombuffer(buf, dtype=np.int64, count=doc_count, offset=34 + seq_count * 12)
    if doc_count < 2:
        raise InputError(f"{p}: index lists no documents")
    if doc_idx[0] != 0 or doc_idx[-1] != seq_count or np.any(np.diff(doc_idx) < 0):
        raise InputError(f"{p}: document indices are not a partition of the {seq_count} sequences")
    csum = np.concatenate([[0], np.cumsum(seq_lengths)])
    lengths = csum[doc_idx[1:]] - csum[doc_idx[:-1]]
    bad = np.flatnonzero(lengths <= 0)
    if bad.size:
        raise InputError(f"{p}: document {int(bad[0])} has length {int(lengths[bad[0]])}")
    return lengths


def write_indexed_dataset_index(prefix: str | Path, doc_lengths: Sequence[Sequence[int]]) -> Path:
    """Write ``PREFIX.idx`` (and an empty-token ``.bin``) in Megatron's layout; for tests/tools.

    ``doc_lengths[j]`` lists the sequence lengths of document ``j``. Tokens are int32 (dtype
    code 4 in Megatron's ``DType``).
    """
    seqs = [int(x) for doc in doc_lengths for x in doc]
    doc_idx = np.concatenate([[0], np.cumsum([len(doc) for doc in doc_lengths])]).astype(np.int64)
    pointers = np.concatenate([[0], np.cumsum(np.asarray(seqs, dtype=np.int64) * 4)[:-1]])
    idx = Path(str(prefix) + ".idx")
    with atomic_open(idx, "wb") as fh:
        fh.write(_IDX_HEADER)
        fh.write(struct.pack("<Q", 1))
        fh.write(struct.pack("<B", 4))
        fh.write(struct.pack("<Q", len(seqs)))
        fh.write(struct.pack("<Q", len(doc_idx)))
        fh.write(np.asarray(seqs, dtype=np.int32).tobytes())
        fh.write(np.asarray(pointers, dtype=np.int64).tobytes())
        fh.write(doc_idx.tobytes())
    atomic_write(Path(str(prefix) + ".bin"), b"")
    return idx


# ---------------------------------------------------------------------- batches
@dataclass(frozen=True)
class GlobalBatch:
    """One global batch: lengths to plan plus what the overlong policy did to get them."""

    step: int
    lengths: np.ndarray
    source_ids: np.ndarray  # index into the prepared corpus, per planned sequence
    dropped: int = 0
    split: int = 0  # overlong sequences cut into pieces
    pieces: int = 0  # pieces those produced


@dataclass
class BatchSampler:
    """Global batches from a corpus of document lengths, by FlexSP's rules or at random."""

    lengths: np.ndarray
    global_batch: int = 512
    sampling: str = "sequential"
    max_seq: int = 192_000
    seed: int = 0
    overlong: str = "error"
    max_trainable: int | None = None  # longest sequence the cluster can train (memory)
    pad_multiple: int = FLEXSP_PAD_MULTIPLE
    corpus: np.ndarray = field(init=False, repr=False)
    harness_dropped: int = field(init=False, default=0)
    harness_split: int = field(init=False, default=0)  # documents cut by --overlong split
    harness_pieces: int = field(init=False, default=0)  # pieces those produced

    def __post_init__(self) -> None:
        if self.sampling not in SAMPLING_MODES:
            raise InputError(f"--sampling {self.sampling!r}: choose one of {list(SAMPLING_MODES)}")
        # A plain string: the policy is written into JSON configs as given.
        self.overlong = parse_choice(OverlongPolicy, self.overlong, "--overlong").value
        if self.global_batch < 1:
            raise InputError(f"--global-batch must be >= 1, got {self.global_batch}")
        raw = np.asarray(self.lengths, dtype=np.int64)
        if raw.size == 0:
            raise InputError("the lengths input is empty; give at least one sequence length")
        bad = np.flatnonzero(raw <= 0)
        if bad.size:
            raise InputError(
                f"sequence {int(bad[0])} has length {int(raw[bad[0]])}; lengths must be positive"
            )
        if self.sampling == "sequential":
            self.corpus = self._sequential_corpus(raw)
        else:
            self.corpus = raw

    def _sequential_corpus(self, raw: np.ndarray) -> np.ndarray:
        """FlexSP's padded corpus, with documents over ``max_seq - pad`` handled by --overlong.

        ``drop`` is FlexSP's harness rule (and what its published totals need); ``split`` cuts
        such a document into padded pieces of at most ``max_seq - pad`` in its place; ``error``
        (the default) refuses, naming the first one. Drops and splits are counted and printed.
        """
        m = self.pad_multiple
        padded = ((raw - 1) // m + 1) * m
        limit = self.max_seq - m
        over = np.flatnonzero(padded > limit)
        if limit < m:
            raise InputError(f"--max-seq {self.max_seq} is below FlexSP's {2 * m}-token minimum")
        if over.size and self.overlong == "error":
            i = int(over[0])
            raise InputError(
                f"--sampling sequential: {over.size} document(s) longer than --max-seq "
                f"{self.max_seq} minus FlexSP's {m}-token padding (first: document {i}, "
                f"{int(raw[i])} tokens); use --overlong drop (FlexSP's harness rule), --overlong "
                "split or a larger --max-seq"
            )
        if self.overlong == "drop" or not over.size:
            self.harness_dropped = int(over.size)
            corpus = np.delete(padded, over)
        else:
            piece = (limit // m) * m
            # Counted before any piece is built: one 1e12-token document is 5 million pieces.
            pieces = int(np.sum((raw[over] + piece - 1) // piece))
            if padded.size - over.size + pieces > MAX_CORPUS_SEQUENCES:
                raise InputError(
                    f"--overlong split: {over.size} document(s) would become {pieces} pieces of "
                    f"at most {piece} tokens, over the {MAX_CORPUS_SEQUENCES} sequences a "
                    "lengths input may hold; use --overlong drop or a larger --max-seq"
                )
            parts: list[np.ndarray] = []
            prev = 0
            for i in over.tolist():
                full, rest = divmod(int(raw[i]), piece)
                tail = [((rest - 1) // m + 1) * m] if rest else []
                cut = np.concatenate([np.full(full, piece, dtype=np.int64), tail]).astype(np.int64)
                parts += [padded[prev:i], cut]
                self.harness_pieces += len(cut)
                prev = i + 1
            parts.append(padded[prev:])
            self.harness_split = int(over.size)
            corpus = np.concatenate(parts)
        if corpus.size == 0:
            raise InputError(
                f"every sequence is longer than --max-seq {self.max_seq} minus the "
                f"{m}-token padding; raise --max-seq"
            )
        return corpus

    def harness_note(self) -> str:
        """One line for the text output when the sequential rules dropped or split documents."""
        if self.harness_dropped:
            return (
                f"note: {self.harness_dropped} document(s) longer than --max-seq minus "
                f"{self.pad_multiple} dropped (--overlong drop, FlexSP's harness rule)"
            )
        if self.harness_split:
            return (
                f"note: {self.harness_split} document(s) longer than --max-seq minus "
                f"{self.pad_multiple} split into {self.harness_pieces} pieces (--overlong split)"
            )
        return ""

    @property
    def limit(self) -> int:
        """Longest sequence a batch may contain: max-seq and what memory allows."""
        cap = self.max_seq if self.max_trainable is None else min(self.max_seq, self.max_trainable)
        return int(cap)

    def num_sequential_batches(self) -> int:
        return int(self.corpus.size // self.global_batch)

    def batch(self, step: int) -> GlobalBatch:
        if step < 0:
            raise InputError(f"--start-step / --batch-index must be >= 0, got {step}")
        if self.sampling == "sequential":
            lo, hi = step * self.global_batch, (step + 1) * self.global_batch
            if hi > self.corpus.size:
                raise InputError(
                    f"batch {step} needs sequences {lo}..{hi - 1} but the lengths input has "
                    f"{self.corpus.size} after FlexSP's filtering, i.e. "
                    f"{self.num_sequential_batches()} full batches of {self.global_batch}; use "
                    "an earlier --start-step/--batch-index, fewer --steps, a smaller "
                    "--global-batch or --sampling random"
                )
            ids = np.arange(lo, hi, dtype=np.int64)
        else:
            if self.global_batch > self.corpus.size:
                raise InputError(
                    f"--global-batch {self.global_batch} exceeds the {self.corpus.size} "
                    "sequences in the lengths input"
                )
            rng = np.random.default_rng([self.seed, step])
            ids = np.sort(rng.choice(self.corpus.size, size=self.global_batch, replace=False))
        return self._apply_overlong(step, ids, self.corpus[ids])

    def _apply_overlong(self, step: int, ids: np.ndarray, lengths: np.ndarray) -> GlobalBatch:
        limit = self.limit
        over = np.flatnonzero(lengths > limit)
        if over.size == 0:
            return GlobalBatch(step, lengths.copy(), ids.copy())
        if self.overlong == "error":
            i = int(over[0])
            raise InputError(
                f"batch {step}: sequence {i} (corpus index {int(ids[i])}) has length "
                f"{int(lengths[i])}, longer than the longest trainable length {limit} "
                f"({over.size} such sequence(s) in this batch); use --overlong drop or split, "
                "more GPUs, a larger --memory-cap-gb or --max-seq"
            )
        if self.overlong == "drop":
            keep = lengths <= limit
            if not keep.any():
                raise InputError(
                    f"batch {step}: --overlong drop removed every sequence (all longer than "
                    f"{limit}); the batch is empty"
                )
            return GlobalBatch(step, lengths[keep], ids[keep], dropped=int(over.size))
        counted = int(np.sum((lengths[over] + limit - 1) // limit))  # before any piece is built
        if lengths.size - over.size + counted > MAX_BATCH_SEQUENCES:
            raise InputError(
                f"batch {step}: --overlong split would cut {over.size} sequence(s) into "
                f"{counted} pieces of at most {limit} tokens, over the {MAX_BATCH_SEQUENCES} "
                "sequences one batch is planned with; use --overlong drop, more GPUs, a larger "
                "--memory-cap-gb or --max-seq"
            )
        out_len: list[int] = []
        out_ids: list[int] = []
        pieces = 0
        for sid, n in zip(ids.tolist(), lengths.tolist(), strict=True):
            if n <= limit:
                out_len.append(n)
                out_ids.append(sid)
                continue
            full, rest = divmod(n, limit)
            parts = [limit] * full + ([rest] if rest else [])
            pieces += len(parts)
            out_len.extend(parts)
            out_ids.extend([sid] * len(parts))
        return GlobalBatch(
            step,
            np.asarray(out_len, dtype=np.int64),
            np.asarray(out_ids, dtype=np.int64),
            split=int(over.size),
            pieces=pieces,
        )
