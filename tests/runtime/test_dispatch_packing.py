"""Dispatch: THD packing contract, padding rule and token accounting (no processes needed)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_hsp.planner.errors import InputError, PlanError
from megatron_hsp.planner.plan import Group, MicroBatch, Plan
from megatron_hsp.runtime.dispatch import (
    GlobalBatch,
    check_token_accounting,
    dispatch,
    dispatch_all,
    pack_group_slice,
    padding_for,
)
from megatron_hsp.testing.manual_plan import manual_plan, round_robin_plan


def _batch(lengths, seed=0):
    rng = np.random.default_rng(seed)
    return GlobalBatch.from_documents([rng.integers(1, 1000, n) for n in lengths])


def test_padding_rule():
    assert padding_for(12, 4) == 0
    assert padding_for(13, 4) == 3
    assert padding_for(5, 1) == 0
    assert padding_for(10, 2, local_multiple=4) == 6


def test_group_buffer_layout_and_slices():
    lengths = [5, 1, 7]
    b = _batch(lengths)
    g = Group(ranks=(0, 1, 2, 3), seq_ids=(2, 0, 1), lengths=(7, 5, 1))
    packs = [pack_group_slice(b, g, s) for s in range(4)]
    # 13 real tokens -> one padding segment of 3; cu_seqlens covers the whole group buffer.
    for p in packs:
        np.testing.assert_array_equal(p.cu_seqlens, [0, 7, 12, 13, 16])
        assert p.cu_seqlens.dtype == np.int32
        assert p.num_local_tokens == 4
        assert p.max_seqlen == 7
        assert (p.group_tokens, p.padded_tokens) == (13, 16)
    ids = np.concatenate([p.input_ids for p in packs])
    expect = np.concatenate([b.document(2), b.document(0), b.document(1), [0, 0, 0]])
    np.testing.assert_array_equal(ids, expect)
    pos = np.concatenate([p.position_ids for p in packs])
    np.testing.assert_array_equal(pos, [0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 3, 4, 0, 0, 1, 2])
    mask = np.concatenate([p.loss_mask for p in packs])
    # last token of each document and the padding carry no loss; a 1-token doc trains nothing
    np.testing.assert_array_equal(mask, [1] * 6 + [0] + [1] * 4 + [0] + [0] + [0, 0, 0])
    labels = np.concatenate([p.labels for p in packs])
    np.testing.assert_array_equal(labels[:6], b.document(2)[1:])
    np.testing.assert_array_equal(labels[7:11], b.document(0)[1:])


def test_no_padding_when_divisible_and_size_one():
    b = _batch([3, 5])
    p = pack_group_slice(b, Group(ranks=(0,), seq_ids=(0, 1), lengths=(3, 5)), 0)
    np.testing.assert_array_equal(p.cu_seqlens, [0, 3, 8])
    assert p.padded_tokens == 8 and p.num_local_tokens == 8


def test_empty_group_packs_nothing():
    b = _batch([4])
    p = pack_group_slice(b, Group(ranks=(2, 3)), 3)
    assert p.empty and p.num_local_tokens == 0 and p.num_loss_tokens == 0
    np.testing.assert_array_equal(p.cu_seqlens, [0])


def test_mixed_sizes_accounting_and_loss_tokens():
    lengths = [5, 1, 7, 3, 9, 2, 4, 6, 1]
    b = _batch(lengths)
    plan = manual_plan(
        8,
        lengths,
        [[(4, [0, 2]), (2, [1, 3]), (1, [4]), (1, [])], [(8, [5, 6, 7, 8])]],
    )
    packs = dispatch_all(b, plan)
    check_token_accounting(b, plan, packs)
    assert sum(p.num_loss_tokens for ps in packs.values() for p in ps) == b.num_loss_tokens
    assert b.num_loss_tokens == sum(lengths) - len(lengths)


def test_accounting_catches_a_lost_slot_and_a_duplicate():
    lengths = [6, 6]
    b = _batch(lengths)
    plan = manual_plan(2, lengths, [[(2, [0, 1])]])
    packs = dispatch_all(b, plan)
    with pytest.raises(PlanError, match="not held exactly once"):
        check_token_accounting(b, plan, {0: packs[0], 1: packs[0]})
    with pytest.raises(InputError, match="missing"):
        check_token_accounting(b, plan, {0: packs[0]})


def test_plan_length_mismatch_and_bad_slot():
    b = _batch([4, 4])
    bad = Plan(
        world_size=1,
        gpus_per_node=1,
        microbatches=(MicroBatch(groups=(Group(ranks=(0,), seq_ids=(0, 1), lengths=(4, 5)),)),),
    )
    with pytest.raises(PlanError, match="length 5 in the plan but 4"):
        dispatch(b, bad, 0)
    with pytest.raises(InputError, match="outside"):
        dispatch(b, bad, 3)


def test_empty_document_rejected():
    with pytest.raises(InputError, match="empty"):
        GlobalBatch.from_documents([[1, 2], []])


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 40), min_size=1, max_size=24),
    size=st.sampled_from([1, 2, 4, 8]),
    mbs=st.integers(1, 3),
    local_multiple=st.sampled_from([1, 2]),
)
def test_accounting_property(lengths, size, mbs, local_multiple):
    b = _batch(lengths, seed=len(lengths))
    plan = round_robin_plan(8, lengths, size, mbs)
    packs = dispatch_all(b, plan, local_multiple=local_multiple)
    check_token_accounting(b, plan, packs)
    for ps in packs.values():
        for p in ps:
            # every rank of a group holds the same share, divisible by local_multiple
            assert p.num_local_tokens * p.group_size == p.padded_tokens
            assert p.num_local_tokens % local_multiple == 0
            assert p.padded_tokens - p.group_tokens < p.group_size * local_multiple


def test_packed_seq_params_match_the_attention_contract():
    """schedule.packed_seq_params (host-side numbers, no device sync) builds what
    attention.group_packed_seq_params would from the same cu_seqlens."""
    import torch

    from megatron_hsp.runtime.attention import group_packed_seq_params
    from megatron_hsp.runtime.schedule import packed_seq_params

    class FakeGroup:
        def size(self):
            return 4

    b = _batch([5, 1, 7])
    pack = pack_group_slice(b, Group(ranks=(0, 1, 2, 3), seq_ids=(2, 0, 1), lengths=(7, 5, 1)), 1)
    ours = packed_seq_params(pack, FakeGroup(), torch.device("cpu"))
    theirs = group_packed_seq_params(torch.from_numpy(pack.cu_seqlens), FakeGroup())
    assert torch.equal(ours.cu_seqlens_q, theirs.cu_seqlens_q)
    assert ours.cu_seqlens_q.dtype == torch.int32
    assert (ours.max_seqlen_q, ours.max_seqlen_kv) == (theirs.max_seqlen_q, theirs.max_seqlen_kv)
    assert ours.qkv_format == theirs.qkv_format == "thd"
    assert ours.local_cp_size == theirs.local_cp_size == 4
    assert torch.equal(ours.cu_seqlens_q_padded, ours.cu_seqlens_q)  # "None or equal"


@settings(max_examples=40, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 60), min_size=1, max_size=12),
    size=st.sampled_from([1, 2, 4]),
    mbs=st.integers(1, 3),
)
def test_a_ranks_share_dispatches_like_the_whole_batch(lengths, size, mbs):
    """``GlobalBatch.for_rank`` (every length, only the slot's own documents) packs exactly what
    the whole batch packs for that slot, and holds no token of another group's documents."""
    batch = _batch(lengths, seed=len(lengths))
    plan = round_robin_plan(4, lengths, size, mbs)
    for slot in range(4):
        mine = sorted({s for mb in plan.microbatches for s in mb.group_of(slot).seq_ids})
        share = GlobalBatch.for_rank(lengths, {s: batch.document(s) for s in mine})
        assert share.tokens.size == sum(lengths[s] for s in mine)
        assert share.num_loss_tokens == batch.num_loss_tokens
        for a, b in zip(dispatch(share, plan, slot), dispatch(batch, plan, slot), strict=True):
            for name in ("input_ids", "labels", "loss_mask", "position_ids", "cu_seqlens"):
                assert np.array_equal(getattr(a, name), getattr(b, name)), name


def test_a_share_refuses_documents_it_does_not_hold_and_bad_lengths():
    lengths = [5, 3, 4, 2]
    plan = manual_plan(2, lengths, [[(1, [0, 1]), (1, [2, 3])]])
    batch = _batch(lengths)
    share = GlobalBatch.for_rank(lengths, {0: batch.document(0), 1: batch.document(1)})
    dispatch(share, plan, 0)
    with pytest.raises(InputError, match=r"does not hold documents \[2, 3\]"):
        dispatch(share, plan, 1)
    with pytest.raises(InputError, match="document 1 has 2 tokens but the batch says 3"):
        GlobalBatch.for_rank(lengths, {1: [1, 2]})
    with pytest.raises(InputError, match="token accounting needs the whole batch"):
        check_token_accounting(share, plan, {0: [], 1: []})


def test_dispatch_lays_tokens_out_by_the_recorded_split():
    """The layout's ring degree is the plan's recorded ``Group.ring`` (unrecorded: 1)."""
    import dataclasses

    lengths = [9, 7]
    plan = manual_plan(4, lengths, [[(4, [0, 1])]])
    batch = _batch(lengths)
    assert {p.ring for p in dispatch(batch, plan, 0)} == {1}
    (mb,) = plan.microbatches
    ringed = dataclasses.replace(
        plan,
        microbatches=(
            dataclasses.replace(
                mb, groups=tuple(dataclasses.replace(g, ulysses=2, ring=2) for g in mb.groups)
            ),
        ),
    )
    packs = {s: dispatch(batch, ringed, s)[0] for s in range(4)}
    assert {p.ring for p in packs.values()} == {2}
    # Ring 2 over 4 ranks: the load-balanced chunk layout, not contiguous quarters.
    assert not np.array_equal(packs[0].position_ids, np.arange(packs[0].position_ids.size))
    check_token_accounting(batch, ringed, {s: [p] for s, p in packs.items()})


@settings(max_examples=30, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 40), min_size=1, max_size=8),
    split=st.sampled_from([(1, 4), (2, 2)]),
)
def test_te_layout_pads_each_ring_document_to_twice_the_group(lengths, split):
    """``te_layout``: every document of a ring group gets a segment that is a multiple of 2d (what
    TE's THD context parallelism needs, ``layout.te_cp_arguments``); the padding carries no loss
    and every real token is still held and trained exactly once."""
    import dataclasses

    from megatron_hsp.runtime.layout import te_cp_arguments

    u, r = split
    plan = manual_plan(4, lengths, [[(4, list(range(len(lengths))))]])
    (mb,) = plan.microbatches
    group = dataclasses.replace(mb.groups[0], ulysses=u, ring=r)
    plan = dataclasses.replace(plan, microbatches=(dataclasses.replace(mb, groups=(group,)),))
    batch = _batch(lengths)
    packs = {s: dispatch(batch, plan, s, te_layout=True, te_hybrid=True) for s in range(4)}
    cu = packs[0][0].cu_seqlens
    assert np.all(np.diff(cu) % 8 == 0)  # 2 x d, d = 4
    assert te_cp_arguments(cu, u, r) is not None
    assert packs[0][0].group_tokens == sum(lengths)
    assert sum(p[0].loss_mask.sum() for p in packs.values()) == sum(lengths) - len(lengths)
    check_token_accounting(batch, plan, packs)


@pytest.mark.parametrize(
    ("split", "te_hybrid", "padded"),
    [
        ((2, 2), False, False),  # TE <= 2.18 declines THD hybrid groups: HSP's ring, no padding
        ((2, 2), True, True),  # TE >= 2.19 carries them: padded to 2d
        ((1, 4), False, True),  # a pure ring: TE carries it on every supported version
    ],
)
def test_te_layout_pads_only_the_groups_te_carries(split, te_hybrid, padded):
    """Issue 41: every ring group's documents were padded to 2d under ``te_layout``, also where
    TE then declined the group (hybrid groups on TE 2.14-2.18): padding for nothing."""
    import dataclasses

    lengths = [5, 3, 11]
    plan = manual_plan(4, lengths, [[(4, [0, 1, 2])]])
    (mb,) = plan.microbatches
    group = dataclasses.replace(mb.groups[0], ulysses=split[0], ring=split[1])
    plan = dataclasses.replace(plan, microbatches=(dataclasses.replace(mb, groups=(group,)),))
    packs = dispatch(_batch(lengths), plan, 0, te_layout=True, te_hybrid=te_hybrid)
    segments = np.diff(packs[0].cu_seqlens)
    if padded:
        assert segments.tolist() == [8, 8, 16]
    else:
        assert segments[:3].tolist() == lengths


def test_te_layout_leaves_ulysses_groups_unpadded():
    lengths = [5, 3]
    plan = manual_plan(2, lengths, [[(2, [0, 1])]])
    packs = dispatch(_batch(lengths), plan, 0, te_layout=True)
    assert packs[0].cu_seqlens.tolist() == [0, 5, 8]


def test_empty_groups_pack_padding_under_expert_parallelism():
    """Issue 17: ``pad_empty`` gives a group without documents one padding segment (2 x d x
    local_multiple tokens, split evenly, ring layouts included): no loss, no documents, so its
    ranks can run the model beside other groups in the MoE all-to-alls."""
    b = _batch([4, 6])
    assert pack_group_slice(b, Group(ranks=(2, 3)), 3).num_local_tokens == 0
    for ring in (1, 2):
        packs = [
            pack_group_slice(b, Group(ranks=(0, 1)), s, pad_empty=True, local_multiple=2, ring=ring)
            for s in (0, 1)
        ]
        for p in packs:
            assert p.empty and p.num_local_tokens == 4 and p.num_loss_tokens == 0
            assert (p.doc_ids == -1).all() and (p.document_index() == -1).all()
            assert p.cu_seqlens.tolist() == [0, 8]
    # A group with documents is packed as without pad_empty; document_index follows seq_ids.
    g = Group(ranks=(0, 1), seq_ids=(1, 0), lengths=(6, 4))
    with_docs = pack_group_slice(b, g, 0, pad_empty=True)
    assert with_docs.input_ids.tolist() == pack_group_slice(b, g, 0).input_ids.tolist()
    assert with_docs.document_index().tolist() == [0, 0, 0, 0, 0]
    assert pack_group_slice(b, g, 1).document_index().tolist() == [0, 1, 1, 1, 1]


def test_off_cuda_the_runtime_declares_no_te_padding_to_the_planner():
    from megatron_hsp.runtime.backends import te_doc_multiples_for_run

    assert te_doc_multiples_for_run({4: (1, 4)}, "auto", "cpu") == {}
    assert te_doc_multiples_for_run({4: (1, 4)}, "torch", "cuda") == {}
