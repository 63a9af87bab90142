"""Lengths input: files, indexed datasets, FlexSP/random batches, overlong policy, errors."""

from __future__ import annotations

import gzip
import itertools

import numpy as np
import pytest

from megatron_hsp.planner.errors import InputError
from megatron_hsp.planner.lengths import (
    BatchSampler,
    default_lengths_path,
    parse_max_seq,
    read_indexed_dataset_lengths,
    read_lengths,
    write_indexed_dataset_index,
)


def test_text_and_gz(tmp_path):
    (tmp_path / "a.txt").write_text("5\n\n 7 \n3\n")
    assert read_lengths(tmp_path / "a.txt").tolist() == [5, 7, 3]
    with gzip.open(tmp_path / "a.txt.gz", "wt") as fh:
        fh.write("5\n7\n")
    assert read_lengths(str(tmp_path / "a.txt.gz")).tolist() == [5, 7]


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ("5\nabc\n", r"a.txt:2: 'abc' is not an integer"),
        ("5\n2.5\n", r"a.txt:2: '2.5' is not an integer"),
        ("5\n0\n", r"a.txt:2: length 0 is not positive"),
        ("-4\n", r"a.txt:1: length -4 is not positive"),
        ("\n\n", "holds no lengths"),
    ],
)
def test_text_errors_name_file_and_line(tmp_path, body, message):
    (tmp_path / "a.txt").write_text(body)
    with pytest.raises(InputError, match=message):
        read_lengths(tmp_path / "a.txt")


def test_missing_file(tmp_path):
    with pytest.raises(InputError, match="no such file"):
        read_lengths(tmp_path / "nope.txt")


def test_indexed_dataset_document_lengths(tmp_path):
    prefix = tmp_path / "corpus_text_document"
    write_indexed_dataset_index(prefix, [[3, 4], [10], [1, 1, 1]])
    # document length = sum of its sequences' lengths (via document_indices)
    assert read_lengths(prefix).tolist() == [7, 10, 3]
    assert read_lengths(str(prefix) + ".idx").tolist() == [7, 10, 3]


def test_indexed_dataset_matches_megatron_reader(tmp_path):
    pytest.importorskip("megatron.core.datasets.indexed_dataset")
    from megatron.core.datasets.indexed_dataset import _IndexReader

    prefix = tmp_path / "c"
    write_indexed_dataset_index(prefix, [[5], [2, 9], [4]])
    reader = _IndexReader(str(prefix) + ".idx", multimodal=False)
    docs = reader.document_indices
    want = [int(reader.sequence_lengths[a:b].sum()) for a, b in itertools.pairwise(docs)]
    assert read_indexed_dataset_lengths(str(prefix) + ".idx").tolist() == want == [5, 11, 4]


def test_indexed_dataset_bad_header(tmp_path):
    (tmp_path / "x.idx").write_bytes(b"NOTANIDX" + b"\0" * 40)
    with pytest.raises(InputError, match="bad header"):
        read_lengths(tmp_path / "x")


def test_embedded_default():
    assert default_lengths_path().is_file()
    lens = read_lengths()
    assert lens.size == 100_000 and lens.min() > 0


def test_parse_max_seq():
    assert parse_max_seq("192k") == 192_000
    assert parse_max_seq("196608") == 196_608
    with pytest.raises(InputError, match="--max-seq"):
        parse_max_seq("big")


def test_sequential_follows_flexsp_rules():
    raw = np.array([1, 128, 129, 300, 191_873, 191_872, 5, 6])
    s = BatchSampler(raw, global_batch=3, sampling="sequential", max_seq=192_000, overlong="drop")
    # padded to multiples of 128; 191_873 pads to 192_000 > 192_000 - 128 and is dropped
    assert s.harness_dropped == 1 and "1 document(s)" in s.harness_note()
    assert s.batch(0).lengths.tolist() == [128, 128, 256]
    assert s.batch(1).lengths.tolist() == [384, 191_872, 128]
    with pytest.raises(InputError, match=r"batch 2 needs sequences 6\.\.8 .* 2 full batches"):
        s.batch(2)


def test_random_is_seeded_and_unpadded():
    raw = np.arange(1, 1001)
    a = BatchSampler(raw, global_batch=50, sampling="random", seed=3, max_seq=10**6)
    b = BatchSampler(raw, global_batch=50, sampling="random", seed=3, max_seq=10**6)
    c = BatchSampler(raw, global_batch=50, sampling="random", seed=4, max_seq=10**6)
    assert a.batch(7).lengths.tolist() == b.batch(7).lengths.tolist()
    assert a.batch(7).lengths.tolist() != c.batch(7).lengths.tolist()
    assert a.batch(7).lengths.tolist() != a.batch(8).lengths.tolist()
    assert len(set(a.batch(0).lengths.tolist())) == 50  # without replacement


def test_overlong_error_names_sequence_length_and_limit():
    s = BatchSampler(
        np.array([10, 500, 20]), global_batch=3, sampling="random", max_seq=10**6, max_trainable=100
    )
    with pytest.raises(
        InputError,
        match=r"sequence 1 .* length 500, longer than the longest "
        r"trainable length 100",
    ):
        s.batch(0)


def test_overlong_drop_and_split_report_counts():
    raw = np.array([10, 250, 20, 100])
    drop = BatchSampler(raw, 4, "random", max_seq=10**6, overlong="drop", max_trainable=100)
    b = drop.batch(0)
    assert sorted(b.lengths.tolist()) == [10, 20, 100] and b.dropped == 1
    split = BatchSampler(raw, 4, "random", max_seq=10**6, overlong="split", max_trainable=100)
    b = split.batch(0)
    assert b.split == 1 and b.pieces == 3
    assert int(b.lengths.sum()) == 380 and b.lengths.max() == 100


def test_max_seq_bounds_random_batches_too():
    s = BatchSampler(np.array([10, 500]), 2, "random", max_seq=100, overlong="split")
    assert s.batch(0).lengths.tolist() == [10, 100, 100, 100, 100, 100]


def test_batch_errors():
    with pytest.raises(InputError, match="empty"):
        BatchSampler(np.array([], dtype=np.int64))
    with pytest.raises(InputError, match="sequence 1 has length 0"):
        BatchSampler(np.array([3, 0, 4]))
    with pytest.raises(InputError, match="sequence 0 has length -2"):
        BatchSampler(np.array([-2]))
    with pytest.raises(InputError, match="--global-batch"):
        BatchSampler(np.array([3]), global_batch=0)
    with pytest.raises(InputError, match="--sampling"):
        BatchSampler(np.array([3]), sampling="shuffled")
    with pytest.raises(InputError, match="--overlong"):
        BatchSampler(np.array([3]), overlong="truncate")
    with pytest.raises(InputError, match="removed every sequence"):
        BatchSampler(np.array([500]), 1, "random", max_seq=100, overlong="drop").batch(0)
    with pytest.raises(InputError, match="exceeds the 2 sequences"):
        BatchSampler(np.array([5, 6]), 3, "random").batch(0)
    with pytest.raises(InputError, match="raise --max-seq"):
        BatchSampler(np.array([5000]), 1, "sequential", max_seq=1000, overlong="drop")


def test_sequential_obeys_overlong_like_random():
    """Issue 9: FlexSP's drop is no longer silent; error refuses and split keeps the tokens."""
    raw = np.array([1, 128, 129, 300, 191_873, 191_872, 5, 6])
    with pytest.raises(InputError, match=r"1 document\(s\) longer .*first: document 4"):
        BatchSampler(raw, global_batch=3, sampling="sequential", max_seq=192_000)
    s = BatchSampler(raw, global_batch=3, sampling="sequential", max_seq=192_000, overlong="split")
    assert (
        s.harness_split == 1
        and s.harness_pieces == 2
        and "split into 2 pieces" in (s.harness_note())
    )
    assert s.corpus.tolist() == [128, 128, 256, 384, 191_872, 128, 191_872, 128, 128]
