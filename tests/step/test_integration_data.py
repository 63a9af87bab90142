"""Whole-document global batches from a Megatron indexed dataset: sampling, overlong, resume."""

from __future__ import annotations

import numpy as np
import pytest

from megatron_hsp.planner.errors import InputError
from megatron_hsp.planner.plan import Group, MicroBatch, Plan
from megatron_hsp.step.corpus import EOD_TOKEN, build_stdlib_corpus, write_indexed_dataset
from megatron_hsp.step.corpus import split_top_level as data_split
from megatron_hsp.step.documents import DocumentIndex, DocumentReader
from megatron_hsp.step.sampler import GlobalBatchSampler, Piece, SamplerConfig

LENGTHS = [5, 1, 40, 7, 300, 12, 9, 64, 2, 130, 18, 3, 77, 26, 0, 51]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    prefix = tmp_path_factory.mktemp("idx") / "docs"
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 250, n) for n in LENGTHS]
    write_indexed_dataset(prefix, docs)
    return prefix, docs


def cfg(**kw):
    base = dict(seed=3, max_length=100, global_batch_docs=4, overlong="split")
    base.update(kw)
    return SamplerConfig(**base)


def test_index_reads_document_lengths(corpus):
    prefix, _ = corpus
    ix = DocumentIndex(prefix)
    assert ix.lengths.tolist() == LENGTHS
    with pytest.raises(InputError, match=r"nowhere\.idx not found"):
        DocumentIndex(prefix.parent / "nowhere")


def test_batches_by_count_cover_each_epoch_once():
    s = GlobalBatchSampler(LENGTHS, cfg(max_length=1000))
    usable = {i for i, n in enumerate(LENGTHS) if n >= 2}
    seen = []
    for _ in range(len(usable) // 4 + 1):
        b = s.next_batch()
        assert len(b.pieces) == 4
        seen += [p.doc for p in b.pieces]
    assert set(seen[: len(usable)]) == usable  # one epoch: each usable document exactly once
    assert s.skipped_short == 2  # the 1-token and the empty document


def test_same_seed_same_batches_other_seed_differs():
    a = [b.lengths for b, _ in zip(GlobalBatchSampler(LENGTHS, cfg()), range(5), strict=False)]
    b = [b.lengths for b, _ in zip(GlobalBatchSampler(LENGTHS, cfg()), range(5), strict=False)]
    c = [
        b.lengths for b, _ in zip(GlobalBatchSampler(LENGTHS, cfg(seed=4)), range(5), strict=False)
    ]
    assert a == b and a != c


def test_token_budget_keeps_documents_whole():
    s = GlobalBatchSampler(LENGTHS, cfg(global_batch_docs=None, token_budget=150, max_length=400))
    for _ in range(10):
        b = s.next_batch()
        assert b.tokens <= 150 or len(b.pieces) == 1  # over budget only as a lone document
        assert all(p.offset == 0 and p.length == LENGTHS[p.doc] for p in b.pieces)


def test_the_document_that_crosses_the_budget_starts_the_next_batch():
    """Issue 43's stated rule: in sampler order, whole documents until the next would cross the
    budget; that one is neither cut nor dropped but opens the next batch, so documents per batch
    vary, no batch exceeds the budget, and every document is trained exactly once."""
    lengths = [60, 50, 30, 70, 10, 40]
    s = GlobalBatchSampler(
        lengths, cfg(global_batch_docs=None, token_budget=120, max_length=100, shuffle=False)
    )
    batches = [[p.doc for p in s.next_batch().pieces] for _ in range(3)]
    # 60 + 50 = 110; + 30 would be 140 > 120: document 2 starts batch 2 (30 + 70 + 10 = 110;
    # + 40 would be 150), document 5 starts batch 3.
    assert batches == [[0, 1], [2, 3, 4], [5, 0]]
    assert s.state.consumed_tokens == 110 + 110 + 100


def test_batch_fingerprint_names_the_documents_in_order():
    a = GlobalBatchSampler(LENGTHS, cfg()).next_batch()
    b = GlobalBatchSampler(LENGTHS, cfg()).next_batch()
    assert a.fingerprint == b.fingerprint and len(a.fingerprint) == 16
    other = GlobalBatchSampler(LENGTHS, cfg(seed=4)).next_batch()
    assert other.fingerprint != a.fingerprint
    swapped = type(a)(a.step, tuple(reversed(a.pieces)))
    assert swapped.fingerprint != a.fingerprint  # order is part of the batch


def test_mean_sequence_tokens_gives_the_expected_documents_per_step():
    """The start-up line's expected documents per step (budget / mean sequence) against the
    documents the sampler actually puts in a step, over many steps."""
    s = GlobalBatchSampler(LENGTHS, cfg(global_batch_docs=None, token_budget=1000))
    pieces = s.unit_length.tolist()  # split pieces count as sequences
    assert s.mean_sequence_tokens == pytest.approx(sum(pieces) / len(pieces))
    drawn = [len(s.next_batch().pieces) for _ in range(300)]
    assert np.mean(drawn) == pytest.approx(1000 / s.mean_sequence_tokens, rel=0.1)


def test_overlong_policies_are_counted():
    with pytest.raises(InputError, match=r"2 documents .*first: document 4, 300 tokens"):
        GlobalBatchSampler(LENGTHS, cfg(overlong="error"))
    s = GlobalBatchSampler(LENGTHS, cfg(overlong="drop", global_batch_docs=12, shuffle=False))
    b = s.next_batch()
    assert {p.doc for p in b.pieces} == {0, 2, 3, 5, 6, 7, 8, 10, 11, 12, 13, 15}
    assert s.overlong_docs == 2 and s.dropped_tokens == 430 + 1  # + the 1-token document
    assert "2 dropped" in s.report()
    s = GlobalBatchSampler(LENGTHS, cfg(overlong="split", global_batch_docs=17, shuffle=False))
    b = s.next_batch()
    assert [(p.offset, p.length) for p in b.pieces if p.doc == 4] == [
        (0, 100),
        (100, 100),
        (200, 100),
    ]
    assert [(p.offset, p.length) for p in b.pieces if p.doc == 9] == [(0, 100), (100, 30)]
    assert s.num_sequences == 14 - 2 + 5 and b.tokens == sum(LENGTHS) - 1
    assert "2 split into 100-token pieces" in s.report()


def test_split_pieces_are_sampled_independently_under_a_token_budget():
    s = GlobalBatchSampler(LENGTHS, cfg(global_batch_docs=None, token_budget=120))
    seen = []
    for _ in range(12):
        b = s.next_batch()
        assert b.tokens <= 120
        seen += [(p.doc, p.offset) for p in b.pieces]
    assert len(set(seen[: s.num_sequences])) == s.num_sequences  # one epoch, each piece once


def test_resume_from_state_dict_and_by_replay_is_exact():
    ref = GlobalBatchSampler(LENGTHS, cfg())
    for _ in range(6):
        ref.next_batch()
    saved = ref.state_dict()
    expected = [ref.next_batch() for _ in range(6)]

    resumed = GlobalBatchSampler(LENGTHS, cfg())
    resumed.load_state_dict(saved)
    assert [resumed.next_batch() for _ in range(6)] == expected
    replayed = GlobalBatchSampler(LENGTHS, cfg())
    replayed.fast_forward(6)
    assert [replayed.next_batch() for _ in range(6)] == expected
    assert replayed.state_dict() == resumed.state_dict()

    other = GlobalBatchSampler(LENGTHS, cfg(seed=9))
    with pytest.raises(InputError, match="different corpus or sampling flags"):
        other.load_state_dict(saved)


def test_bad_config():
    with pytest.raises(InputError, match="exactly one of --global-batch-size"):
        SamplerConfig(seed=0, max_length=10, global_batch_docs=2, token_budget=10)
    with pytest.raises(InputError, match="--hsp-overlong 'cut'"):
        SamplerConfig(seed=0, max_length=10, global_batch_docs=2, overlong="cut")


def test_reader_reads_only_this_ranks_documents(corpus):
    prefix, docs = corpus
    reader = DocumentReader(DocumentIndex(prefix))
    batch = GlobalBatchSampler(LENGTHS, cfg(global_batch_docs=4)).next_batch()
    groups = (
        Group((0, 1), (0, 3), (batch.lengths[0], batch.lengths[3])),
        Group((2,), (1,), (batch.lengths[1],)),
        Group((3,), (2,), (batch.lengths[2],)),
    )
    plan = Plan(4, 4, (MicroBatch(groups),))
    mine = reader.read_for_rank(batch, plan, 1)
    assert sorted(mine) == [0, 3]
    for s, tokens in mine.items():
        p = batch.pieces[s]
        assert np.array_equal(tokens, docs[p.doc][p.offset : p.offset + p.length])
    assert reader.tokens_read == batch.lengths[0] + batch.lengths[3]
    share = reader.batch_for_rank(batch, plan, 1)
    # Every length, but only this slot's tokens: memory follows the slot's share.
    assert share.lengths.tolist() == batch.lengths
    assert share.tokens.size == batch.lengths[0] + batch.lengths[3] < batch.tokens
    assert np.array_equal(share.document(3), mine[3])
    with pytest.raises(InputError, match=r"does not hold documents \[1\]"):
        share.document(1)


def test_split_piece_reads_the_right_slice(corpus):
    prefix, docs = corpus
    reader = DocumentReader(DocumentIndex(prefix))
    s = GlobalBatchSampler(LENGTHS, cfg(global_batch_docs=17, shuffle=False))
    b = s.next_batch()
    assert any(p.offset > 0 for p in b.pieces)
    for p in b.pieces:
        assert np.array_equal(reader.read(p), docs[p.doc][p.offset : p.offset + p.length])


def test_stdlib_corpus_is_cached(tmp_path, monkeypatch):
    import megatron_hsp.step.corpus as data

    few = data.stdlib_sources()[:20]
    monkeypatch.setattr(data, "stdlib_sources", lambda: few)
    c1 = build_stdlib_corpus(tmp_path)
    c2 = build_stdlib_corpus(tmp_path)
    assert c1.built and not c2.built and c1.prefix == c2.prefix
    ix = DocumentIndex(c1.prefix)
    assert len(ix) == c1.num_docs > 20  # top-level definitions, not files
    first = DocumentReader(ix).read(Piece(0, 0, int(ix.lengths[0])))
    assert first[-1] == EOD_TOKEN
    assert few[0].read_bytes().startswith(bytes(first[:-1].astype(np.uint8)))


def test_split_top_level_keeps_decorators_and_header():
    src = b"import os\n\nX = 1\n\n@dec\ndef f():\n    return 1\n\nclass C:\n    pass\n"
    chunks = data_split(src)
    assert chunks == [
        b"import os\n\nX = 1\n\n",
        b"@dec\ndef f():\n    return 1\n\n",
        b"class C:\n    pass\n",
    ]
    assert b"".join(chunks) == src
    assert data_split(b"print 'py2'\n") == [b"print 'py2'\n"]  # unparsable: one document


@pytest.mark.parametrize("damage", [b"garbage!!", b""])
def test_a_damaged_index_is_one_line_naming_the_file(tmp_path, damage):
    """Issue 18: a damaged cached corpus gave a traceback that did not name it."""
    prefix = tmp_path / "docs"
    write_indexed_dataset(prefix, [np.arange(5), np.arange(7)])
    (tmp_path / "docs.idx").write_bytes(damage)
    with pytest.raises(InputError, match=r"docs\.idx: no Megatron index header; .* rebuild it"):
        DocumentIndex(prefix)


def test_a_truncated_index_is_one_line_naming_the_file(tmp_path):
    prefix = tmp_path / "docs"
    write_indexed_dataset(prefix, [np.arange(5), np.arange(7)])
    idx = tmp_path / "docs.idx"
    idx.write_bytes(idx.read_bytes()[:20])
    with pytest.raises(InputError, match=r"docs\.idx: cannot be read \("):
        DocumentIndex(prefix)


def test_a_blends_expected_documents_per_step_weights_each_datasets_mean():
    from megatron_hsp.step.sampler import BlendComponent, BlendedBatchSampler

    short = np.full(400, 10, dtype=np.int64)
    long = np.full(100, 90, dtype=np.int64)
    blend = BlendedBatchSampler(
        [BlendComponent("a", 0.4, 0, short), BlendComponent("b", 0.6, 400, long)],
        cfg(global_batch_docs=None, token_budget=900),
    )
    # 40% of the tokens in 10-token documents, 60% in 90-token ones: 1 / (0.4/10 + 0.6/90).
    assert blend.mean_sequence_tokens == pytest.approx(1 / (0.4 / 10 + 0.6 / 90))
    drawn = [len(blend.next_batch().pieces) for _ in range(200)]
    assert np.mean(drawn) == pytest.approx(900 / blend.mean_sequence_tokens, rel=0.1)
