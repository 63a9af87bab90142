"""What the HSP sampler must draw, computed without the sampler: an independent oracle.

The Megatron loop's stock side reads exactly the pieces HSP's sampler chose, so a sampler bug is
on both sides of the loss comparison. These checks judge the choice itself, from the drawn pieces'
own (document, offset, length) and from Megatron, never from the sampler's counters or helpers:

* ``megatron_split``: the element range ``[lo, hi)`` of each split, from megatron-core's own
  ``BlendedMegatronDatasetBuilder._build_megatron_dataset_splits`` (its ``round`` of the split
  matrix megatron-core's ``parse_and_normalize_split`` / ``convert_split_vector_to_split_matrix``
  give), run on a recorder class instead of ``GPTDataset`` (HSP's ``datasets.document_range`` is
  not called);
* ``expected_units``: the trainable pieces of a split's documents: a document of at least
  ``MIN_LENGTH`` tokens is one piece; one longer than ``max_length`` (``--hsp-overlong split``)
  is cut into ``max_length`` pieces covering every token once (a tail under ``MIN_LENGTH``
  tokens has no next-token target and is not a piece);
* ``coverage_failures``: per dataset, the drawn pieces in draw order cut into windows of one
  epoch (as many pieces as ``expected_units`` gives): every complete window holds each expected
  piece exactly once, the last (partial) one none twice and none unexpected;
* ``deficit_failures`` / ``blend_deviation``: a blend's token shares. The deficit rule
  (docs/exactness.md) is re-run on the drawn pieces' lengths: each draw must come from the
  dataset furthest below its weight, ``argmax_i (w_i T - t_i)`` (``T`` tokens drawn before it,
  ``t_i`` of them from dataset ``i``, ties to the first). The rule guarantees, at every draw,
  ``-(1 - w_i) L <= w_i T - t_i <= (K - 2 + w_i) L`` (``L``: the longest piece, ``K``
  datasets; for two datasets ``w_i L`` on the upper side): a deficit only grows while another
  dataset is chosen, and the chosen one has the largest deficit, which is >= 0 since deficits
  sum to 0. ``blend_deviation`` reports the worst deviation against that bound.
* ``epoch_orders`` / ``order_failures``: the order inside each dataset, from the sampler's
  documented rule (docs/integration.md, "Blends"), re-derived here: a dataset's pieces numbered
  in corpus order (document, then offset), epoch ``e`` draws them in the order
  ``numpy.random.default_rng([seed, e]).permutation(n)`` (a lone dataset, and a blend's first
  dataset) or ``default_rng([seed, k, e])`` (a blend's dataset ``k >= 1``, counted over the
  split's non-empty datasets of positive weight). Every epoch is checked against it, and
  consecutive epochs must differ (unless the rule's own permutations coincide, chance
  ``1/n!``): a dataset that stops reshuffling still covers every piece once per epoch, so
  ``coverage_failures`` cannot see it. Megatron's ``GPTDataset`` (``_build_document_index``)
  instead shuffles the document index of all its epochs at once with one
  ``RandomState(seed)`` per dataset, so a document can recur before another is seen once; HSP
  keeps Megatron's "seeded, fresh each epoch, reproducible" but draws one permutation per
  epoch so each epoch covers every document once (the coverage check above);
* ``resume_failures``: a run restarted from a saved position draws what the uninterrupted run
  draws (the first difference), whichever resume path (``fast_forward``, ``load_state_dict``).

Imports nothing from ``megatron_hsp``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

MIN_LENGTH = 2  # a piece needs two tokens to give one next-token target
SPLITS = ("train", "valid", "test")

Drawn = tuple[int, int, int]  # (document, offset, length) as the sampler drew it


class _Recorder:
    """Stands in for megatron-core's ``GPTDataset`` in its own split builder: takes the low-level
    dataset as given and records the indices the builder hands each split."""

    def __init__(self, low_level: Any, path: Any, indices: Any, *_: Any) -> None:
        self.indices = indices

    @staticmethod
    def build_low_level_dataset(path: Any, config: Any) -> Any:
        return path

    @staticmethod
    def numel_low_level_dataset(low_level: Any) -> int:
        if isinstance(low_level, int):
            return low_level
        from megatron.core.datasets.gpt_dataset import GPTDataset

        return int(GPTDataset.numel_low_level_dataset(low_level))


def megatron_split(elements: int | Any, split_text: str) -> dict[str, tuple[int, int]]:
    """Per split (train, valid, test), the elements ``[lo, hi)`` megatron-core's dataset builder
    gives it under ``--split split_text``; ``(0, 0)`` for a split with no share.

    ``elements``: a count, or megatron-core's ``IndexedDataset`` (its ``GPTDataset`` counts the
    sequences, which are the documents unless the corpus was preprocessed with
    ``--split-sentences``)."""
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.blended_megatron_dataset_config import (
        convert_split_vector_to_split_matrix,
        parse_and_normalize_split,
    )

    matrix = convert_split_vector_to_split_matrix(parse_and_normalize_split(split_text))
    builder = BlendedMegatronDatasetBuilder.__new__(BlendedMegatronDatasetBuilder)
    builder.cls = _Recorder
    builder.config = None  # not a GPTDatasetConfig: no fast-cache shortcut
    builder.is_built_on_rank = lambda: True
    built = builder._build_megatron_dataset_splits(
        elements, matrix, [None] * len(SPLITS), synchronize_ranks=False
    )
    out = {}
    for name, dataset in zip(SPLITS, built, strict=True):
        idx = np.asarray([] if dataset is None else dataset.indices, dtype=np.int64)
        if len(idx) and not np.array_equal(idx, np.arange(idx[0], idx[-1] + 1)):
            raise AssertionError(f"megatron-core's {name} split is not a contiguous range")
        out[name] = (int(idx[0]), int(idx[-1]) + 1) if len(idx) else (0, 0)
    return out


def document_lengths(dataset: Any) -> np.ndarray:
    """Token count of every document of megatron-core's ``IndexedDataset`` (its sequences
    between consecutive ``document_indices``)."""
    seq = np.concatenate([[0], np.cumsum(np.asarray(dataset.sequence_lengths, dtype=np.int64))])
    doc = np.asarray(dataset.document_indices, dtype=np.int64)
    return seq[doc[1:]] - seq[doc[:-1]]


def expected_units(
    lengths: Sequence[int] | np.ndarray, first: int = 0, max_length: int | None = None
) -> Counter[Drawn]:
    """The pieces one epoch of documents ``first .. first + len(lengths) - 1`` must yield."""
    out: Counter[Drawn] = Counter()
    for i, n in enumerate(int(x) for x in lengths):
        cap = n if max_length is None else max_length
        for offset in range(0, n, max(cap, 1)):
            piece = min(cap, n - offset)
            if piece >= MIN_LENGTH:
                out[(first + i, offset, piece)] += 1
    return out


def coverage_failures(
    drawn: Iterable[Drawn], units: Counter[Drawn], what: str = "", limit: int = 4
) -> list[str]:
    """Where ``drawn`` (one dataset's pieces, in draw order) breaks "each expected piece once per
    epoch": for each window of ``sum(units)`` draws, the pieces drawn twice, never, or not
    expected at all (the last window, if partial: twice or not expected only)."""
    drawn = [tuple(int(v) for v in p) for p in drawn]
    size = sum(units.values())
    bad: list[str] = []
    if size == 0:
        return [f"{what}: no piece is expected, {len(drawn)} drawn"] if drawn else []
    for epoch, start in enumerate(range(0, len(drawn), size)):
        window = Counter(drawn[start : start + size])
        complete = start + size <= len(drawn)
        extra = window - units
        twice = sorted(p for p, c in window.items() if c > units.get(p, 0) and p in units)
        foreign = sorted(p for p in extra if p not in units)
        missing = sorted(units - window) if complete else []
        for label, pieces in (("twice", twice), ("never expected", foreign), ("missing", missing)):
            if pieces:
                shown = ", ".join(f"doc {d} [{o}, {o + n})" for d, o, n in pieces[:limit])
                more = f" and {len(pieces) - limit} more" if len(pieces) > limit else ""
                part = "complete" if complete else "partial"
                bad.append(f"{what} epoch {epoch} ({part}): {label}: {shown}{more}")
    return bad


def deficit_failures(
    datasets: Sequence[int], lengths: Sequence[int], weights: Sequence[float], limit: int = 3
) -> list[str]:
    """Draws that did not come from the dataset the deficit rule picks (re-run here on the drawn
    pieces' own lengths); ``datasets[j]``: which dataset draw ``j`` came from."""
    w = np.asarray(weights, dtype=np.float64)
    w = w / w.sum()
    taken = np.zeros(len(w), dtype=np.float64)
    bad = []
    for j, (k, n) in enumerate(zip(datasets, lengths, strict=True)):
        want = int(np.argmax(w * taken.sum() - taken))
        if want != k:
            bad.append(
                f"draw {j}: from dataset {k}, the deficit rule picks {want} "
                f"(tokens so far {taken.astype(int).tolist()}, weights {w.round(4).tolist()})"
            )
        taken[k] += n
    if len(bad) > limit:
        bad = [*bad[:limit], f"... {len(bad)} draws in all"]
    return bad


def blend_deviation(
    datasets: Sequence[int], lengths: Sequence[int], weights: Sequence[float]
) -> dict[str, Any]:
    """The worst ``|w_i T - t_i|`` over every prefix of the draws, in pieces of the longest
    length, and as a fraction of the bound the deficit rule guarantees (``<= 1`` when honoured);
    plus the final token shares."""
    w = np.asarray(weights, dtype=np.float64)
    w = w / w.sum()
    k = len(w)
    longest = max(lengths, default=1)
    lower, upper = (1 - w) * longest, (k - 2 + w) * longest
    taken = np.zeros(k, dtype=np.float64)
    worst_docs, worst_ratio = 0.0, 0.0
    for d, n in zip(datasets, lengths, strict=True):
        taken[d] += n
        deficit = w * taken.sum() - taken
        worst_docs = max(worst_docs, float(np.abs(deficit).max()) / longest)
        over = np.where(deficit >= 0, deficit / np.maximum(upper, 1e-12), -deficit / lower)
        worst_ratio = max(worst_ratio, float(over.max()))
    total = max(taken.sum(), 1.0)
    return {
        "weights": w.tolist(),
        "token_shares": (taken / total).tolist(),
        "worst_deviation_in_documents": worst_docs,
        "bound_in_documents": [
            [-float(a), float(b)] for a, b in zip(1 - w, k - 2 + w, strict=True)
        ],
        "worst_over_bound": worst_ratio,
    }


def epoch_orders(
    units: Counter[Drawn] | Iterable[Drawn], seed: int, epochs: int, stream: int | None = None
) -> list[list[Drawn]]:
    """The order of a dataset's pieces in each of epochs ``0 .. epochs - 1``, by the sampler's
    documented rule: pieces in corpus order (document, offset), permuted by
    ``numpy.random.default_rng([seed, epoch])`` or, for a blend's dataset ``stream >= 1``,
    ``default_rng([seed, stream, epoch])``."""
    elements = units.elements() if isinstance(units, Counter) else units
    pieces = sorted(tuple(int(v) for v in p) for p in elements)
    out = []
    for epoch in range(epochs):
        key = [seed, epoch] if stream is None else [seed, stream, epoch]
        perm = np.random.default_rng(key).permutation(len(pieces))
        out.append([pieces[int(i)] for i in perm])
    return out


def _show(p: Drawn) -> str:
    return f"doc {p[0]} [{p[1]}, {p[1] + p[2]})"


def order_failures(
    drawn: Iterable[Drawn],
    units: Counter[Drawn],
    seed: int,
    stream: int | None = None,
    what: str = "",
) -> list[str]:
    """Where ``drawn`` (one dataset's pieces, in draw order from its first draw) leaves the
    rule's order (``epoch_orders``): per epoch window, the first draw that differs; and each
    epoch that repeats the previous one's order (its complete window, or the partial last
    window's prefix) where the rule's permutations differ (a dataset that stopped
    reshuffling)."""
    drawn = [tuple(int(v) for v in p) for p in drawn]
    size = sum(units.values())
    if size == 0 or not drawn:
        return []
    epochs = -(-len(drawn) // size)
    want = epoch_orders(units, seed, epochs, stream)
    key = "[seed, epoch]" if stream is None else f"[seed, {stream}, epoch]"
    bad: list[str] = []
    for epoch in range(epochs):
        got = drawn[epoch * size : (epoch + 1) * size]
        expected = want[epoch][: len(got)]
        part = "complete" if len(got) == size else f"partial, {len(got)} draws"
        if got != expected:
            j = next(i for i, (a, b) in enumerate(zip(got, expected, strict=True)) if a != b)
            bad.append(
                f"{what} epoch {epoch} ({part}): draw {j} of the epoch is {_show(got[j])}, "
                f"the seeded permutation (default_rng({key}), seed {seed}) gives "
                f"{_show(expected[j])}"
            )
        if epoch and len(got) > 1:
            before = drawn[(epoch - 1) * size : (epoch - 1) * size + len(got)]
            if got == before and want[epoch][: len(got)] != want[epoch - 1][: len(got)]:
                bad.append(
                    f"{what} epoch {epoch} ({part}): the same order as epoch {epoch - 1} "
                    f"(not reshuffled; {size} pieces)"
                )
    return bad


def resume_failures(
    uninterrupted: Sequence[Drawn], resumed: Sequence[Drawn], what: str = ""
) -> list[str]:
    """Where a restarted run's draws (before and after the restart, in order) leave the
    uninterrupted run's: the first difference, or a length mismatch."""
    a = [tuple(int(v) for v in p) for p in uninterrupted]
    b = [tuple(int(v) for v in p) for p in resumed]
    for j, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return [
                f"{what} draw {j}: the resumed run draws {_show(y)}, the uninterrupted run "
                f"{_show(x)}"
            ]
    if len(a) != len(b):
        return [f"{what}: {len(b)} draws after the restart, the uninterrupted run {len(a)}"]
    return []
