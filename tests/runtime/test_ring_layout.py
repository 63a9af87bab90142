"""The load-balanced ring layout (runtime/layout.py): a permutation, balanced, TE-compatible.

Expected values are written out by hand or computed here from first principles (causal pairs of
a contiguous split), never by the layout code itself.
"""

from __future__ import annotations

import numpy as np
import pytest

from megatron_hsp.planner.plan import Group, MicroBatch, Plan
from megatron_hsp.runtime.dispatch import GlobalBatch, check_token_accounting, dispatch_all
from megatron_hsp.runtime.layout import (
    causal_pairs_per_position,
    gather,
    layout_order,
    rank_tokens,
    ring_position_tokens,
    scatter,
    te_cp_arguments,
)


def _cu(lengths: list[int], multiple: int) -> list[int]:
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    if cu[-1] % multiple:
        cu.append(cu[-1] + (-cu[-1] % multiple))
    return cu


def test_one_document_zigzag_by_hand() -> None:
    held = [ring_position_tokens([0, 16], 1, 4, j).tolist() for j in range(4)]
    assert held == [[0, 1, 14, 15], [2, 3, 12, 13], [4, 5, 10, 11], [6, 7, 8, 9]]
    # Hybrid u=2 x r=2: rank i holds chunks i and 7-i of 8; position j gathers ranks 2j, 2j+1.
    assert rank_tokens([0, 16], 2, 2, 1).tolist() == [2, 3, 12, 13]
    assert ring_position_tokens([0, 16], 2, 2, 0).tolist() == [0, 1, 14, 15, 2, 3, 12, 13]
    assert ring_position_tokens([0, 16], 2, 2, 1).tolist() == [4, 5, 10, 11, 6, 7, 8, 9]


def test_short_documents_are_dealt_without_padding() -> None:
    # r = 2: 2r = 4 chunks. Doc of 6: core q=1 (chunks 0,1,2,3 = tokens 0..3), tail 4,5.
    # Doc of 2 (tokens 6,7): all tail. Remainder list [4, 5, 6, 7] -> snake 0,1,1,0.
    assert ring_position_tokens([0, 6, 8], 1, 2, 0).tolist() == [0, 3, 4, 7]
    assert ring_position_tokens([0, 6, 8], 1, 2, 1).tolist() == [1, 2, 5, 6]


@pytest.mark.parametrize("u,r", [(1, 1), (4, 1), (1, 3), (2, 3), (1, 4), (2, 2), (1, 7)])
def test_scatter_then_gather_is_identity(u: int, r: int) -> None:
    rng = np.random.default_rng(u * 10 + r)
    lengths = rng.integers(1, 40, size=9).tolist()
    cu = _cu(lengths, u * r)
    order = layout_order(cu, u, r)
    assert sorted(order.tolist()) == list(range(cu[-1]))  # a permutation
    values = rng.normal(size=(cu[-1], 3))
    pieces = [scatter(values, cu, u, r, i) for i in range(u * r)]
    assert {p.shape[0] for p in pieces} == {cu[-1] // (u * r)}  # equal shares
    np.testing.assert_array_equal(gather(pieces, cu, u, r), values)
    if r == 1 and u > 1:  # pure Ulysses keeps contiguous slices
        share = cu[-1] // u
        assert rank_tokens(cu, u, r, 1).tolist() == list(range(share, 2 * share))


@pytest.mark.parametrize(
    "lengths,u,r",
    [([65536], 1, 4), ([40000, 9000, 3], 1, 8), ([30001, 77], 1, 3), ([50001, 999], 2, 4)],
)
def test_causal_work_is_balanced_for_long_documents(lengths: list[int], u: int, r: int) -> None:
    cu = _cu(lengths, u * r)
    work = causal_pairs_per_position(cu, u, r)
    assert sum(work) == sum(n * (n + 1) // 2 for n in np.diff(cu).tolist())
    assert max(work) / min(work) < 1.01
    # Contiguous slices, for contrast: the last position does ~2r-1 times the first's work.
    share = cu[-1] // r
    contiguous = []
    for j in range(r):
        idx = np.arange(j * share, (j + 1) * share)
        seg = np.searchsorted(cu, idx, side="right") - 1
        contiguous.append(int((idx - np.asarray(cu)[seg] + 1).sum()))
    if len(lengths) == 1:
        assert max(contiguous) / min(contiguous) > r


def test_te_arguments_only_when_every_segment_is_a_multiple_of_2d() -> None:
    assert te_cp_arguments([0, 6, 8], 1, 2) is None  # 6 and 2 are not multiples of 4
    assert te_cp_arguments([0, 8], 2, 1) is None  # pure Ulysses: no CP route
    args = te_cp_arguments([0, 8, 16, 24], 1, 2)
    assert args is not None and args["cp_comm_type"] == "p2p"
    fwd = args["forward"]
    assert fwd["cu_seqlens_q"].tolist() == [0, 8, 16, 24]
    assert fwd["cu_seqlens_q_padded"].tolist() == [0, 8, 16, 24]
    assert fwd["max_seqlen_q"] == 8 and args["local_tokens"] == 12
    # TE's THD shard for cp rank 1 of 2: chunks 1 and 2 (of 4) of every sequence, in order.
    assert rank_tokens([0, 8, 16, 24], 1, 2, 1).tolist() == [
        2, 3, 4, 5, 10, 11, 12, 13, 18, 19, 20, 21,
    ]  # fmt: skip
    hybrid = te_cp_arguments([0, 16, 32], 2, 2)
    assert hybrid is not None and hybrid["cp_comm_type"] == "a2a+p2p"
    assert hybrid["local_tokens"] == 8
    # cp rank = p2p rank * a2a size + a2a rank = our group rank: rank 3 holds chunks 3 and 4.
    assert rank_tokens([0, 16, 32], 2, 2, 3).tolist() == [6, 7, 8, 9, 22, 23, 24, 25]


def test_dispatch_in_ring_layout_holds_every_token_once() -> None:
    batch = GlobalBatch.from_documents(
        [np.arange(100 * i, 100 * i + n) for i, n in enumerate([37, 5, 64, 2, 11])]
    )
    groups = (
        Group(ranks=(0, 1, 2, 3, 4, 5), seq_ids=(0, 2, 3), lengths=(37, 64, 2), ring=3, ulysses=2),
        Group(ranks=(6, 7), seq_ids=(1, 4), lengths=(5, 11)),
    )
    plan = Plan(world_size=8, gpus_per_node=8, microbatches=(MicroBatch(groups=groups),))
    packs = dispatch_all(batch, plan, local_multiple=2)
    check_token_accounting(batch, plan, packs)
    cu = packs[0][0].cu_seqlens
    for slot in range(6):
        p = packs[slot][0]
        assert p.ring == 3 and p.num_local_tokens == cu[-1] // 6
        real = p.doc_ids >= 0
        idx = rank_tokens(cu, 2, 3, slot)
        seg = np.searchsorted(cu, idx, side="right") - 1
        np.testing.assert_array_equal(p.position_ids, idx - cu[seg])
        assert not p.loss_mask[~real].any()


def test_swapped_chunk_mutation_really_swaps() -> None:
    from megatron_hsp.testing.mutations import by_name

    (mutation,) = by_name(["wrong-ring-chunk-order"])
    swapped = mutation.wrap(ring_position_tokens)
    # d = 2 ranks, 4 chunks of 4: rank 0 holds chunks 0 and 3; the mutation reads 3 first.
    assert ring_position_tokens([0, 16], 1, 2, 0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert swapped([0, 16], 1, 2, 0).tolist() == [12, 13, 14, 15, 0, 1, 2, 3]


@pytest.mark.parametrize("pad_empty", [False, True])
def test_every_ring_position_the_model_runs_holds_query_rows(pad_empty: bool) -> None:
    """Why no ring rank ever plans zero query rows (``ring._runs``' and ``plan_ring_step``'s
    empty cases, allowlisted in tests/exactness/coverage.toml): a pack the model runs holds
    documents (>= 1 token), or is an empty group's padding segment under expert parallelism
    (``pad_empty``); an empty group without it is not run (``schedule.step_inputs``: None).
    Every ring position of a run pack then holds the same number (> 0) of rows, so the fused
    ring's step 0 plans at least one call on every position."""
    import torch

    from megatron_hsp.runtime.dispatch import pack_group_slice
    from megatron_hsp.runtime.ring import plan_ring

    rng = np.random.default_rng(0)
    checked = 0
    for trial in range(60):
        d = int(rng.choice([2, 3, 4, 6, 8]))
        r = int(rng.choice([x for x in range(2, d + 1) if d % x == 0]))
        n_docs = int(rng.integers(0, 4))
        lengths = [int(x) for x in rng.integers(1, 40, n_docs)]
        batch = GlobalBatch.from_documents([np.arange(1, n + 1) for n in lengths] or [[1]])
        group = Group(ranks=tuple(range(d)), seq_ids=tuple(range(n_docs)), lengths=tuple(lengths))
        multiple = int(rng.choice([1, 2]))
        packs = [
            pack_group_slice(batch, group, s, ring=r, pad_empty=pad_empty, local_multiple=multiple)
            for s in range(d)
        ]
        if packs[0].empty and not pad_empty:
            assert all(p.num_local_tokens == 0 for p in packs)  # not run: step_inputs gives None
            continue
        cu = packs[0].cu_seqlens
        held = [ring_position_tokens(cu, d // r, r, j) for j in range(r)]
        assert len({h.size for h in held}) == 1 and held[0].size > 0, (trial, cu, d, r)
        metas = [np.stack([h, np.searchsorted(cu, h, side="right")]) for h in held]
        for j in range(r):
            assert plan_ring(metas, j, torch.device("cpu"))[0], (trial, cu, d, r, j)
        checked += 1
    assert checked > 10
