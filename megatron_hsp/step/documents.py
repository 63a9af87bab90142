"""Whole documents of a Megatron indexed dataset: their lengths, and the tokens a rank trains.

* ``DocumentIndex`` reads document lengths from the ``.idx`` alone (no token is touched);
* ``DocumentReader`` reads the tokens of the documents one rank trains, and nothing else, so a
  rank's reads are proportional to its own share of the global batch.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from megatron_hsp.planner.errors import InputError
from megatron_hsp.step.sampler import DocumentBatch, Piece

if TYPE_CHECKING:
    from megatron_hsp.runtime.dispatch import GlobalBatch


# ---------------------------------------------------------------------------------------- index
class DocumentIndex:
    """Document lengths (tokens) of a Megatron indexed dataset, from its ``.idx`` file only.

    A Megatron document is the run of sequences between consecutive ``document_indices``
    (one sequence per document unless the corpus was preprocessed with ``--split-sentences``).
    """

    def __init__(self, prefix: str | os.PathLike[str], mmap: bool = True) -> None:
        from megatron.core.datasets.indexed_dataset import IndexedDataset

        self.prefix = str(prefix)
        for suffix in (".idx", ".bin"):
            if not Path(self.prefix + suffix).is_file():
                raise InputError(
                    f"indexed dataset {self.prefix!r}: {self.prefix + suffix} not found; pass the "
                    "path prefix without .bin/.idx (e.g. --data-path my-corpus_text_document)"
                )
        # mmap=True keeps the .bin mapped, not read; only .idx arrays are touched here
        # (Megatron's --no-mmap-bin-files passes False: tokens are then read with file reads).
        self.dataset = self._open(IndexedDataset, mmap)
        seq_lengths = np.asarray(self.dataset.sequence_lengths, dtype=np.int64)
        doc_idx = np.asarray(self.dataset.document_indices, dtype=np.int64)
        self.first_sequence = doc_idx[:-1]
        self.num_sequences = np.diff(doc_idx)
        csum = np.concatenate([[0], np.cumsum(seq_lengths)])
        self.lengths = csum[doc_idx[1:]] - csum[doc_idx[:-1]]

    def _open(self, indexed_dataset: Any, mmap: bool) -> Any:
        """Megatron's ``IndexedDataset``, or one line naming the file when it cannot be read
        (a damaged cached corpus gave a traceback that did not name it)."""
        from megatron.core.datasets.indexed_dataset import _INDEX_HEADER

        idx = self.prefix + ".idx"
        fix = (
            "it is not a Megatron indexed dataset or is damaged (an interrupted copy?); rebuild "
            "it (a cached demo corpus is rebuilt after deleting its .idx and .bin)"
        )
        with open(idx, "rb") as fh:
            if fh.read(len(_INDEX_HEADER)) != _INDEX_HEADER:
                raise InputError(f"{idx}: no Megatron index header; {fix}")
        try:
            return indexed_dataset(self.prefix, mmap=mmap)
        except Exception as exc:
            raise InputError(
                f"{idx}: cannot be read ({type(exc).__name__}: {exc}); {fix}"
            ) from None

    def __len__(self) -> int:
        return len(self.lengths)


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

    def batch_for_rank(self, batch: DocumentBatch, plan: Any, slot: int) -> GlobalBatch:
        """This slot's share of ``batch`` as the runtime takes it: every sequence's length, the
        tokens of only the sequences its groups train. Reads, copies and memory follow the
        slot's own share, not the global batch (``GlobalBatch.for_rank``)."""
        from megatron_hsp.runtime.dispatch import GlobalBatch

        return GlobalBatch.for_rank(batch.lengths, self.read_for_rank(batch, plan, slot))


class BlendedDocumentReader(DocumentReader):
    """Reads pieces of several indexed datasets numbered one after the other (a blend).

    Document ``d`` of the blend is document ``d - base[k]`` of dataset ``k``, where ``base`` are
    the running totals of the datasets' document counts in blend order (what
    ``sampler.BlendComponent.doc_base`` is built from). Each dataset is read by its own
    ``DocumentReader``, so a one-dataset blend reads exactly as ``DocumentReader`` does.
    """

    def __init__(self, indices: list[DocumentIndex]) -> None:
        if not indices:
            raise InputError("a blend needs at least one dataset")
        super().__init__(indices[0])
        self.readers = [DocumentReader(ix) for ix in indices]
        self.bases = np.concatenate([[0], np.cumsum([len(ix) for ix in indices])])

    def read(self, piece: Piece) -> np.ndarray:
        k = int(np.searchsorted(self.bases, piece.doc, side="right")) - 1
        if not 0 <= k < len(self.readers) or piece.doc >= self.bases[-1]:
            raise IndexError(f"document {piece.doc} is outside the blend's {self.bases[-1]}")
        local = Piece(piece.doc - int(self.bases[k]), piece.offset, piece.length)
        out = self.readers[k].read(local)
        self.tokens_read += len(out)
        return out
