"""TE's document padding is priced where it applies (issue 41).

Where Transformer Engine's THD context parallelism carries a ring or hybrid group, dispatch pads
every document of the group to a multiple of 2d (``routes.te_doc_multiple``); the planner's
time and memory predictions were low by up to 2d - 1 tokens per document, which near the memory
cap could run out of memory. The cost model now holds the multiples the runtime pads by
(``load_cost_model(doc_multiples=...)``), and the one price function and the memory check
see each document as the group holds it.
"""

from __future__ import annotations

import dataclasses

import pytest

from megatron_hsp.planner.cost.costmodel import load_cost_model
from megatron_hsp.planner.cost.execution import price
from megatron_hsp.planner.plan import Group, MicroBatch, Plan
from megatron_hsp.planner.routes import te_doc_multiple, te_doc_multiples

SPEC = {"preset": "llama3-8b-h100"}


def _plan(cost, lengths) -> Plan:
    split = cost.recorded_split(4)
    group = Group(tuple(range(4)), tuple(range(len(lengths))), tuple(lengths), 0.0, *split)
    return Plan(4, 4, (MicroBatch((group,)),))


def test_the_padding_rule_follows_what_te_carries():
    assert te_doc_multiple(4, 1, 4, te_runs_a2a_p2p_thd=False) == 8  # pure ring: always
    assert te_doc_multiple(4, 2, 2, te_runs_a2a_p2p_thd=False) == 1  # declined: HSP's ring
    assert te_doc_multiple(4, 2, 2, te_runs_a2a_p2p_thd=True) == 8
    assert te_doc_multiple(4, 4, 1, te_runs_a2a_p2p_thd=True) == 1  # Ulysses: no padding
    splits = {2: (2, 1), 4: (2, 2), 3: (1, 3)}
    assert te_doc_multiples(splits, te_version="2.18.0") == {3: 6}
    assert te_doc_multiples(splits, te_version="2.19.1") == {3: 6, 4: 8}
    assert te_doc_multiples(splits, te_version=None) == {}


def test_the_price_and_the_memory_check_see_the_padding():
    plain = load_cost_model(SPEC, world_size=4, gpus_per_node=4)
    padded = load_cost_model(SPEC, world_size=4, gpus_per_node=4, doc_multiples={4: 8})
    assert padded.doc_multiple == {4: 8}
    lengths = [1, 9, 17, 3000]
    held = [8, 16, 24, 3000]
    got = price(_plan(padded, lengths), padded).est_step_ms
    assert got == pytest.approx(price(_plan(plain, held), plain).est_step_ms, rel=1e-12)
    assert got > price(_plan(plain, lengths), plain).est_step_ms
    # memory: documents of one token each fill 8 tokens of the group's buffer
    cap = plain.capacity(4)
    ones = [1] * (cap // 8 + 1)
    assert plain.fits(ones, 4) and not padded.fits(ones, 4)
    assert padded.max_trainable_length([4]) % 8 == 0
    assert padded.min_group_size(padded.capacity(4), [4]) is None
    # sizes the runtime does not pad are priced as before
    other = dataclasses.replace(padded, doc_multiple={2: 4})
    assert price(_plan(other, lengths), other).est_step_ms == pytest.approx(
        price(_plan(plain, lengths), plain).est_step_ms, rel=1e-12
    )
