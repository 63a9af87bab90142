"""The sampler against an independent oracle (issue 33): which documents are drawn.

``testing/sampler_oracle.py`` judges the drawn pieces' own (document, offset, length) against
megatron-core's split (its dataset builder's own rounding) and the documents' lengths read with
megatron-core's ``IndexedDataset``, never the sampler's counters. Each check is shown to fail
under its plant (``testing/mutations.py:SAMPLER_MUTATIONS``, which the Megatron loop also runs;
the blend's check and plant: ``test_integration_datasets.py``).
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator

import numpy as np
import pytest

from megatron_hsp.megatron import datasets
from megatron_hsp.megatron.datasets import build_split_sampler, hsp_data_from_args
from megatron_hsp.step.corpus import write_indexed_dataset
from megatron_hsp.step.sampler import (
    GlobalBatchSampler,
    SamplerConfig,
)
from megatron_hsp.testing.mutations import SAMPLER_MUTATIONS
from megatron_hsp.testing.sampler_oracle import (
    coverage_failures,
    document_lengths,
    expected_units,
    megatron_split,
)

PLANTS = {m.name: m for m in SAMPLER_MUTATIONS}
# Documents of 0 and 1 token (never trained), of exactly 2 (the shortest trainable), and over
# the 50-token cap (split into pieces; 101 leaves a 1-token tail, 102 a 2-token one).
LENGTHS = [0, 1, 2, 2, 3, 7, 2, 19, 50, 51, 101, 102, 2, 33, 1, 5, 44, 2, 9, 12, 2, 26]
A_LENGTHS = [int(n) for n in np.random.default_rng(1).integers(2, 30, 41)]  # short documents
B_LENGTHS = [int(n) for n in np.random.default_rng(2).integers(40, 120, 23)]  # long documents
SPLIT = "7,1,1"  # 41 and 23 documents: no split boundary is an integer


def cfg(**kw) -> SamplerConfig:
    base = dict(seed=5, max_length=50, global_batch_docs=4, overlong="split")
    base.update(kw)
    return SamplerConfig(**base)


def _stream(sampler, steps: int) -> list[tuple[int, int, int]]:
    return [(p.doc, p.offset, p.length) for _ in range(steps) for p in sampler.next_batch().pieces]


@contextlib.contextmanager
def planted(name: str) -> Iterator[None]:
    """One of ``SAMPLER_MUTATIONS`` planted for the block."""
    undo = PLANTS[name].plant()
    try:
        yield
    finally:
        undo()


def test_the_split_is_megatron_cores_own_rounding_and_hsp_follows_it():
    # megatron-core's builder, run by the oracle: [round(a n), round(b n)).
    assert megatron_split(41, SPLIT) == {"train": (0, 32), "valid": (32, 36), "test": (36, 41)}
    assert megatron_split(23, SPLIT)["valid"] == (18, 20)
    assert megatron_split(40, "100,0,0") == {"train": (0, 40), "valid": (0, 0), "test": (0, 0)}
    matrix = {
        "7,1,1": [(0, 7 / 9), (7 / 9, 8 / 9), (8 / 9, 1)],
        "6,1,1": [(0, 0.75), (0.75, 0.875), (0.875, 1)],
    }
    for split_text, rows in matrix.items():
        for n in (23, 29, 40, 41, 61, 64, 1000):
            want = megatron_split(n, split_text)
            assert [datasets.document_range(r, n) for r in rows] == list(want.values()), (
                n,
                split_text,
            )
    with planted("split-truncated-not-rounded"):
        # The plant rebinds the module's name, which build_split_sampler calls.
        assert datasets.document_range(matrix["7,1,1"][0], 41) == (0, 31)


def test_the_oracle_fails_a_wrong_stream():
    units = expected_units([2, 5, 120], max_length=50)
    assert units == Counter(
        {(0, 0, 2): 1, (1, 0, 5): 1, (2, 0, 50): 1, (2, 50, 50): 1, (2, 100, 20): 1}
    )
    good = list(units)
    assert coverage_failures(good + good[::-1] + good[:2], units) == []
    assert "missing: doc 0 [0, 2)" in coverage_failures([*good[1:], good[1]], units, "x")[1]
    assert "twice" in coverage_failures([*good[1:], good[1]], units, "x")[0]
    assert "never expected" in coverage_failures([(2, 0, 40)], units)[0]
    assert "twice" in coverage_failures([good[0], good[0]], units)[0]  # a partial epoch too
    assert expected_units([101], max_length=50) == Counter({(0, 0, 50): 1, (0, 50, 50): 1})


def _single_failures(steps: int = 30, **kw) -> list[str]:
    sampler = GlobalBatchSampler(LENGTHS, cfg(**kw))
    units = expected_units(LENGTHS, max_length=50)
    return coverage_failures(_stream(sampler, steps), units, "single")


@pytest.mark.parametrize("kw", [{}, {"global_batch_docs": None, "token_budget": 120}])
def test_every_eligible_document_is_drawn_once_per_epoch(kw):
    """Five epochs of 25 pieces (2-token documents included, overlong ones in pieces that cover
    every token once), by count and by token budget; fails when 2-token documents are dropped."""
    assert _single_failures(**kw) == []
    with planted("two-token-documents-dropped"):
        bad = _single_failures(**kw)
    assert any("missing: doc 2 [0, 2)" in b for b in bad), bad


@pytest.mark.parametrize("how", ["fast_forward", "load_state_dict"])
def test_once_per_epoch_across_a_restart(how):
    def drawn_with_restart() -> list[tuple[int, int, int]]:
        first = GlobalBatchSampler(LENGTHS, cfg())
        head = _stream(first, 8)  # mid-epoch 1
        resumed = GlobalBatchSampler(LENGTHS, cfg())
        if how == "fast_forward":
            resumed.fast_forward(8)
        else:
            resumed.load_state_dict(first.state_dict())
        return head + _stream(resumed, 20)

    units = expected_units(LENGTHS, max_length=50)
    assert coverage_failures(drawn_with_restart(), units) == []
    if how == "fast_forward":
        with planted("document-twice-after-restart"):
            bad = coverage_failures(drawn_with_restart(), units)
        assert any("twice" in b for b in bad) and any("missing" in b for b in bad), bad


def test_split_samplers_draw_megatrons_split_once_per_epoch(tmp_path):
    """Megatron's --split with boundaries that are not integers (41 and 23 documents at 7,1,1):
    each split's sampler draws exactly megatron-core's documents of each dataset, once per
    epoch; fails when the range is truncated instead of rounded."""
    import argparse

    from megatron.core.datasets.indexed_dataset import IndexedDataset

    from megatron_hsp.step.documents import DocumentIndex

    prefixes = []
    for name, lengths, seed in (("a", A_LENGTHS, 3), ("b", B_LENGTHS, 4)):
        rng = np.random.default_rng(seed)
        write_indexed_dataset(tmp_path / name, [rng.integers(0, 200, n) for n in lengths])
        prefixes.append(str(tmp_path / name))
    args = argparse.Namespace(data_path=["0.5", prefixes[0], "0.5", prefixes[1]], split=SPLIT)
    data = hsp_data_from_args(args)
    indices = {p: DocumentIndex(p) for p in data.prefixes}
    stock = [IndexedDataset(p) for p in prefixes]
    firsts = [0, len(A_LENGTHS)]

    def failures() -> list[str]:
        bad = []
        for split in ("train", "valid", "test"):
            drawn = _stream(build_split_sampler(data, split, indices, cfg(max_length=1000)), 30)
            for k, ds in enumerate(stock):
                lo, hi = megatron_split(ds, SPLIT)[split]
                units = expected_units(document_lengths(ds)[lo:hi], firsts[k] + lo)
                mine = [p for p in drawn if (p[0] >= firsts[1]) == (k == 1)]
                bad += coverage_failures(mine, units, f"{split} dataset {k}")
        return bad

    assert failures() == []
    with planted("split-truncated-not-rounded"):
        bad = failures()
    assert any("valid dataset 0" in b and "missing" in b for b in bad), bad


def test_the_oracle_imports_nothing_from_megatron_hsp():
    """The reference must not share the code it checks: no ``megatron_hsp`` import at all."""
    import ast
    from pathlib import Path

    import megatron_hsp.testing.sampler_oracle as oracle

    tree = ast.parse(Path(oracle.__file__).read_text())
    imported = [
        n.module if isinstance(n, ast.ImportFrom) else a.name
        for n in ast.walk(tree)
        if isinstance(n, ast.Import | ast.ImportFrom)
        for a in n.names
    ]
    assert imported and not [m for m in imported if m and m.startswith("megatron_hsp")]
