"""``megatron/refusals.py``: one function per feature ``--hsp`` refuses, walked from one table."""

from __future__ import annotations

import inspect

import pytest

from megatron_hsp.megatron import refusals
from megatron_hsp.megatron.config import validate_hsp_args
from megatron_hsp.megatron.refusals import REFUSALS, HSPArgsError
from tests.helpers.megatron_args import parse

BASE = ["--hsp", "--num-attention-heads", "8", "--global-batch-size", "8", "--seq-length", "4096"]


def test_every_refusal_is_in_the_table_and_says_why() -> None:
    """A refusal written but left out of ``REFUSALS`` would never run."""
    defined = {
        name
        for name, fn in inspect.getmembers(refusals, inspect.isfunction)
        if name.startswith("refuse_") and fn.__module__ == refusals.__name__
    } - {"refuse_what_hsp_cannot_run"}
    assert {fn.__name__ for fn in REFUSALS} == defined
    assert len(REFUSALS) == len(set(REFUSALS))
    assert all(len(inspect.getdoc(fn) or "") > 40 for fn in REFUSALS)


def test_a_refused_feature_is_named_before_a_layout_error() -> None:
    """World 6 does not hold tensor-parallel groups of 4, and Megatron's default attention
    dropout (0.1) is refused: the feature is named first, as fixing the layout would not help."""
    args = parse([*BASE, "--tensor-model-parallel-size", "4"], world_size=6)
    with pytest.raises(HSPArgsError, match=r"--attention-dropout 0\.1"):
        validate_hsp_args(args, env={})
    args = parse([*BASE, "--tensor-model-parallel-size", "4", "--attention-dropout", "0"], 6)
    with pytest.raises(HSPArgsError, match="world size 6 is not a multiple"):
        validate_hsp_args(args, env={})
