"""The loop's data: the indexed-dataset corpus it writes (``write_corpus``) and the stock side's
reader of it, megatron-core's own ``IndexedDataset`` (``MegatronDocuments``), with Megatron's
split of each dataset for the sampler oracle."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import numpy as np

from megatron_hsp.testing.sampler_oracle import (
    document_lengths,
    expected_units,
    megatron_split,
)


def write_corpus(
    prefix: str,
    num_docs: int = 64,
    seed: int = 7,
    choices: Sequence[int] = (2, 5, 17, 40, 90, 130, 200),
) -> None:
    """A small indexed dataset of documents of very different lengths (2..200 tokens); the
    blend's second dataset (``BLEND_CHOICES``) has longer documents, so that its token share and
    its document share differ."""
    from megatron_hsp.step.corpus import write_indexed_dataset

    rng = np.random.default_rng(seed)
    lengths = rng.choice(list(choices), size=num_docs)
    write_indexed_dataset(prefix, [rng.integers(0, 128, size=int(n)) for n in lengths])


BLEND_CHOICES = (60, 120, 180)


class MegatronDocuments:
    """The stock side's reader: megatron-core's ``IndexedDataset``, no HSP code.

    A piece (document id, token offset, length) is plan data chosen by HSP's sampler; its tokens
    are the document's sequences (``document_indices``) read whole with ``IndexedDataset[i]`` and
    cut here, so a wrong start or length in HSP's ``DocumentReader`` shows as different tokens.
    """

    def __init__(self, prefix: str | Sequence[str]) -> None:
        from megatron.core.datasets.indexed_dataset import IndexedDataset

        prefixes = [prefix] if isinstance(prefix, str) else list(prefix)
        self.datasets = [IndexedDataset(p, mmap=True) for p in prefixes]
        self.document_indices = [
            np.asarray(ds.document_indices, dtype=np.int64) for ds in self.datasets
        ]
        # A blend's documents are numbered dataset after dataset, in --data-path order.
        self.first_document = np.cumsum([0] + [len(d) - 1 for d in self.document_indices])

    def locate(self, doc: int) -> tuple[int, int]:
        """(dataset, document inside it) of a blend's document number."""
        k = int(np.searchsorted(self.first_document, doc, side="right")) - 1
        if not 0 <= k < len(self.datasets) or doc >= self.first_document[-1]:
            raise RuntimeError(f"document {doc} is outside the {self.first_document[-1]} read")
        return k, doc - int(self.first_document[k])

    def read(self, doc: int, offset: int, length: int) -> np.ndarray:
        k, local = self.locate(doc)
        indices, dataset = self.document_indices[k], self.datasets[k]
        first, last = int(indices[local]), int(indices[local + 1])
        whole = np.concatenate([np.asarray(dataset[i]) for i in range(first, last)])
        out = whole[offset : offset + length]
        if len(out) != length:
            raise RuntimeError(
                f"document {doc} has {len(whole)} tokens; piece [{offset}, {offset + length}) "
                "runs past its end"
            )
        return out.astype(np.int64)

    def split_ranges(self, split_text: str, which: str) -> list[tuple[int, int]]:
        """Per dataset, the documents ``[lo, hi)`` of Megatron's ``which`` split (train, valid,
        test) under ``--split split_text``: megatron-core's own dataset builder run on each
        ``IndexedDataset`` (``sampler_oracle.megatron_split``)."""
        return [megatron_split(ds, split_text)[which] for ds in self.datasets]

    def split_units(
        self, split_text: str, which: str, max_length: int | None = None
    ) -> list[Counter[tuple[int, int, int]]]:
        """Per dataset, the pieces one epoch of Megatron's ``which`` split must yield (every
        document of >= 2 tokens whole, or cut into ``max_length`` pieces where it is longer:
        the default ``--hsp-overlong split``), in the blend's document numbering."""
        out = []
        for k, ((lo, hi), ds) in enumerate(
            zip(self.split_ranges(split_text, which), self.datasets, strict=True)
        ):
            first = int(self.first_document[k]) + lo
            out.append(expected_units(document_lengths(ds)[lo:hi], first, max_length))
        return out
