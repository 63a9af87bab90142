"""Megatron's data flags under ``--hsp`` (issue 18 item 2): blends, splits, refusals, resume.

``megatron/datasets.py`` reads the flags as Megatron does; ``step.sampler.BlendedBatchSampler``
samples whole documents with the blend weights honoured by tokens;
``step.documents.BlendedDocumentReader`` reads a blend's documents back.
"""

from __future__ import annotations

import argparse

import numpy as np
import pytest

from megatron_hsp.megatron.datasets import (
    build_split_sampler,
    data_fingerprint,
    document_range,
    hsp_data_from_args,
)
from megatron_hsp.megatron.refusals import HSPArgsError
from megatron_hsp.planner.errors import InputError
from megatron_hsp.step.corpus import write_indexed_dataset
from megatron_hsp.step.documents import BlendedDocumentReader, DocumentIndex, DocumentReader
from megatron_hsp.step.sampler import (
    BlendComponent,
    BlendedBatchSampler,
    GlobalBatchSampler,
    Piece,
    SamplerConfig,
)
from megatron_hsp.testing.sampler_oracle import (
    blend_deviation,
    coverage_failures,
    deficit_failures,
    expected_units,
)
from tests.helpers import FIXTURES
from tests.helpers.megatron_args import parse

A_LENGTHS = [int(n) for n in np.random.default_rng(1).integers(2, 30, 40)]  # short documents
B_LENGTHS = [int(n) for n in np.random.default_rng(2).integers(40, 120, 24)]  # long documents


@pytest.fixture(scope="module")
def two(tmp_path_factory) -> tuple[str, str]:
    d = tmp_path_factory.mktemp("blend")
    out = []
    for name, lengths, seed in (("a", A_LENGTHS, 3), ("b", B_LENGTHS, 4)):
        rng = np.random.default_rng(seed)
        write_indexed_dataset(d / name, [rng.integers(0, 200, n) for n in lengths])
        out.append(str(d / name))
    return out[0], out[1]


def _with(**kw) -> argparse.Namespace:
    args = parse(["--num-attention-heads", "8", "--global-batch-size", "8", "--hsp"])
    for k, v in kw.items():
        setattr(args, k, v)
    return args


def cfg(**kw) -> SamplerConfig:
    base = dict(seed=5, max_length=1000, global_batch_docs=6)
    base.update(kw)
    return SamplerConfig(**base)


def test_split_and_weights_read_as_megatron_reads_them(two):
    a, b = two
    data = hsp_data_from_args(_with(data_path=["0.4", a, "0.6", b], split="6,1,1"))
    assert data.prefixes == (a, b)
    assert [s.weight for s in data.splits["train"]] == [0.4, 0.6]
    assert data.splits["valid"][0].bounds == (0.75, 0.875)
    # Megatron's rounding (BlendedMegatronDatasetBuilder): [round(a n), round(b n)).
    assert document_range((0.75, 0.875), 40) == (30, 35)
    # --split 100,0,0: no validation or test split at all.
    only = hsp_data_from_args(_with(data_path=[a], split="100,0,0"))
    assert set(only.splits) == {"train"} and only.splits["train"][0].weight is None
    per = hsp_data_from_args(_with(train_data_path=["1", a, "3", b], valid_data_path=[b]))
    assert set(per.splits) == {"train", "valid"} and per.splits["valid"][0].bounds is None
    assert "valid: b x by size" in per.describe()


def test_unsupported_data_flags_are_refused_in_one_line_naming_the_flag(two):
    a, _ = two
    for attr, flag in [
        ("mock_data", "--mock-data"),
        ("eod_mask_loss", "--eod-mask-loss"),
        ("full_validation", "--full-validation"),
        ("multiple_validation_sets", "--multiple-validation-sets"),
    ]:
        with pytest.raises(HSPArgsError, match=f"--hsp does not support {flag}: ") as err:
            hsp_data_from_args(_with(data_path=[a], **{attr: True}))
        assert "\n" not in str(err.value)
    with pytest.raises(HSPArgsError, match=r"give --data-path PREFIX"):
        hsp_data_from_args(_with())
    with pytest.raises(HSPArgsError, match=r"--data-path: indexed dataset .*nowhere\.idx"):
        hsp_data_from_args(_with(data_path=["0.5", a, "0.5", a + "-nowhere"]))
    with pytest.raises(HSPArgsError, match=r"--split 'x': give three"):
        hsp_data_from_args(_with(data_path=[a], split="x"))
    with pytest.raises(HSPArgsError, match=r"blend weight -1 must be"):
        hsp_data_from_args(_with(data_path=["-1", a, "2", a]))
    with pytest.raises(HSPArgsError, match=r"--valid-data-path/--test-data-path without"):
        hsp_data_from_args(_with(valid_data_path=[a]))
    noted = hsp_data_from_args(_with(data_path=[a], data_cache_path="/tmp/cache"))
    assert any(n.startswith("--data-cache-path: nothing is cached") for n in noted.notes)


def test_refused_at_argument_time_by_install(two, monkeypatch, capsys):
    """``install`` (right after Megatron's validate_args, before the model) refuses --mock-data:
    one line, exit 2 (issue 42: it raised the ``HSPArgsError``, a traceback on every rank)."""
    from megatron_hsp.megatron import hooks, install, patches

    a, _ = two
    args = parse(
        [
            *("--num-attention-heads", "8", "--global-batch-size", "8", "--seq-length", "64"),
            *("--attention-dropout", "0", "--hsp", "--mock-data", "--data-path", a),
            *("--hsp-cost-model", str(FIXTURES / "cost-model-tiny.yaml")),
        ],
        world_size=2,
    )
    try:
        monkeypatch.setenv("RANK", "0")
        with pytest.raises(SystemExit) as stop:
            install(args)
        assert stop.value.code == 2
        (line,) = capsys.readouterr().err.splitlines()
        assert line.startswith("megatron-hsp: error: --hsp does not support --mock-data")
        assert patches.applied() == [] and hooks.active_run() is None
    finally:
        patches.remove_patches()
        hooks.set_run(None)


def _draw(sampler, steps: int) -> list[tuple[Piece, ...]]:
    return [sampler.next_batch().pieces for _ in range(steps)]


def _blend_checks(steps: int = 40) -> tuple[list[str], dict]:
    """A 0.3 / 0.7 blend of short and long documents judged by ``testing/sampler_oracle.py``
    from the drawn pieces alone (dataset by document number, lengths of the pieces), never
    from the sampler's counters: the deficit rule re-run on them, each dataset's documents once
    per epoch, and the worst deviation of the token shares against the rule's bound."""
    a, b = np.asarray(A_LENGTHS), np.asarray(B_LENGTHS)
    comps = [BlendComponent("a", 0.3, 0, a), BlendComponent("b", 0.7, len(a), b)]
    s = BlendedBatchSampler(comps, cfg())
    drawn = [p for p in (q for _ in range(steps) for q in s.next_batch().pieces)]
    datasets = [int(p.doc >= len(a)) for p in drawn]
    lengths = [p.length for p in drawn]
    bad = deficit_failures(datasets, lengths, (0.3, 0.7))
    for k, (first, lens) in enumerate(((0, a), (len(a), b))):
        mine = [(p.doc, p.offset, p.length) for p, d in zip(drawn, datasets, strict=True) if d == k]
        bad += coverage_failures(mine, expected_units(lens, first), f"dataset {k}")
    return bad, blend_deviation(datasets, lengths, (0.3, 0.7))


def test_blend_weights_are_honoured_by_tokens_within_one_document():
    """Each draw comes from the dataset the deficit rule picks (re-run on the pieces' lengths),
    so at every draw each dataset's tokens are within the rule's bound of its weight: for two
    datasets ``-(1 - w) L <= w T - t <= w L`` (``L`` the longest piece drawn), a fraction of a
    document. Fails when the blend counts documents instead of tokens (its plant)."""
    from megatron_hsp.testing.mutations import SAMPLER_MUTATIONS

    bad, dev = _blend_checks()
    assert bad == []
    assert dev["worst_over_bound"] <= 1.0 and dev["worst_deviation_in_documents"] < 0.7
    assert dev["token_shares"][0] == pytest.approx(0.3, abs=0.02)
    (by_documents,) = [m for m in SAMPLER_MUTATIONS if m.name == "blend-by-documents"]
    undo = by_documents.plant()
    try:
        bad, dev = _blend_checks()
    finally:
        undo()
    assert any("the deficit rule picks" in b for b in bad)
    assert dev["worst_over_bound"] > 10  # by documents the short dataset gets far fewer tokens


def test_one_dataset_blend_is_the_plain_sampler():
    lengths = np.asarray(A_LENGTHS)
    plain = GlobalBatchSampler(lengths, cfg())
    blend = BlendedBatchSampler([BlendComponent("a", 1.0, 0, lengths)], cfg())
    assert _draw(plain, 12) == _draw(blend, 12)


def test_blend_is_deterministic_resumable_and_fingerprinted():
    a, b = np.asarray(A_LENGTHS), np.asarray(B_LENGTHS)

    def make(wa=0.5, **kw):
        comps = [BlendComponent("a", wa, 0, a), BlendComponent("b", 1 - wa, len(a), b)]
        return BlendedBatchSampler(comps, cfg(**kw))

    whole = _draw(make(), 30)
    assert whole == _draw(make(), 30)
    first = make()
    _draw(first, 11)
    state = first.state_dict()
    resumed = make()
    resumed.load_state_dict(state)
    assert _draw(resumed, 19) == whole[11:]
    replayed = make()
    replayed.fast_forward(11)
    assert _draw(replayed, 19) == whole[11:]
    for other in (make(wa=0.4), make(seed=6)):
        with pytest.raises(InputError, match="different blend, split or sampling flags"):
            other.load_state_dict(state)
    budget = make(global_batch_docs=None, token_budget=300)
    for p in _draw(budget, 20):
        assert sum(x.length for x in p) <= 300 or len(p) == 1


def test_blended_reader_reads_each_dataset_and_split_samplers_stay_in_their_documents(two):
    a, b = two
    data = hsp_data_from_args(_with(data_path=["0.5", a, "0.5", b], split="6,1,1"))
    indices = {p: DocumentIndex(p) for p in data.prefixes}
    reader = BlendedDocumentReader([indices[a], indices[b]])
    plain = {a: DocumentReader(indices[a]), b: DocumentReader(indices[b])}
    n_a = len(A_LENGTHS)
    for split, (lo, hi) in (("train", (0, 0.75)), ("valid", (0.75, 0.875)), ("test", (0.875, 1))):
        sampler = build_split_sampler(data, split, indices, cfg())
        ra, rb = document_range((lo, hi), n_a), document_range((lo, hi), len(B_LENGTHS))
        for pieces in _draw(sampler, 6):
            for p in pieces:
                if p.doc < n_a:
                    assert ra[0] <= p.doc < ra[1]
                    want = plain[a].read(p)
                else:
                    assert rb[0] <= p.doc - n_a < rb[1]
                    want = plain[b].read(Piece(p.doc - n_a, p.offset, p.length))
                np.testing.assert_array_equal(reader.read(p), want)
    fp = data_fingerprint(data, indices)
    other = hsp_data_from_args(_with(data_path=["0.5", a, "0.5", b], split="7,1,1"))
    assert data_fingerprint(other, indices) != fp


def test_resume_with_other_data_is_refused_naming_the_flags(tmp_path):
    """Resume replays ``args.iteration`` batches: a --load whose record holds another data
    fingerprint stops naming the flags; the same data, or a fresh start, passes."""
    from megatron_hsp.megatron.hooks import DATA_RECORD, check_and_record_data

    ckpt = str(tmp_path / "ckpt")
    check_and_record_data(argparse.Namespace(save=ckpt, load=None, iteration=0), "aaa/1")
    assert (tmp_path / "ckpt" / DATA_RECORD).is_file()
    check_and_record_data(argparse.Namespace(save=ckpt, load=ckpt, iteration=5), "aaa/1")
    check_and_record_data(argparse.Namespace(save=None, load=ckpt, iteration=0), "bbb/1")
    with pytest.raises(InputError, match=r"--load .*other data or sampling flags.*--split"):
        check_and_record_data(argparse.Namespace(save=ckpt, load=ckpt, iteration=5), "bbb/1")


def test_the_resume_record_is_never_seen_half_written(tmp_path, monkeypatch):
    """With --save and --load one directory, the other ranks read ``hsp_data.json`` for the
    check while rank 0 rewrites it: written in place, a reader can find it empty
    (JSONDecodeError; the likely cause of one crashed rank in selftest --megatron's full run). A
    reader in the middle of the write must find a whole record."""
    import json
    import os

    from megatron_hsp.megatron.hooks import DATA_RECORD, check_and_record_data

    ckpt = tmp_path / "ckpt"
    record = ckpt / DATA_RECORD
    check_and_record_data(argparse.Namespace(save=str(ckpt), load=None, iteration=0), "aaa/1")
    seen = []
    real_fsync = os.fsync

    def slow_fsync(fd: int) -> None:
        # The new record is written but not yet renamed over the old one (the one atomic
        # writer, planner/paths.py): another rank reads now.
        seen.append(record.read_text())
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", slow_fsync)
    check_and_record_data(argparse.Namespace(save=str(ckpt), load=str(ckpt), iteration=5), "aaa/1")
    assert seen and all(json.loads(text)["fingerprint"] == "aaa/1" for text in seen)
    assert json.loads(record.read_text())["fingerprint"] == "aaa/1"
    assert sorted(p.name for p in ckpt.iterdir()) == [DATA_RECORD]
