"""Partial and selective recompute in the first-principles model and its spec (issue 43)."""

from __future__ import annotations

import pytest

from megatron_hsp.planner.cost.costmodel import load_cost_model
from megatron_hsp.planner.cost.first_principles import LLAMA3_8B, TrainingConfig
from megatron_hsp.planner.errors import InputError


def _spec(**training):
    return {
        "name": "t",
        "model": {"layers": 32, "hidden": 4096, "heads": 32, "kv_heads": 8,
                  "ffn_hidden": 14336, "vocab": 128256},
        "hardware": {"name": "h", "peak_tflops": 989.0, "hbm_gb": 80.0},
        "training": {"zero_stage": 1, **training},
    }  # fmt: skip


def test_a_spec_names_megatrons_recompute_as_given():
    full = load_cost_model(_spec(recompute=True), world_size=8)
    block = load_cost_model(
        _spec(recompute=True, recompute_method="block", recompute_num_layers=4), world_size=8
    )
    none = load_cost_model(
        _spec(recompute=True, recompute_method="block", recompute_num_layers=0), world_size=8
    )
    plain = load_cost_model(_spec(), world_size=8)
    assert full.tokens_per_rank > block.tokens_per_rank > plain.tokens_per_rank
    assert none.tokens_per_rank == plain.tokens_per_rank  # block of 0 layers: no recompute
    assert none.linear_ms_per_token == plain.linear_ms_per_token
    sel = load_cost_model(_spec(recompute_modules=["core_attn", "mlp"]), world_size=8)
    assert sel.tokens_per_rank > plain.tokens_per_rank
    assert sel.attn_ms_per_token2 > plain.attn_ms_per_token2


@pytest.mark.parametrize(
    ("training", "needle"),
    [
        ({"recompute": True, "recompute_method": "blocks"}, "uniform or block"),
        ({"recompute": True, "recompute_num_layers": 0}, ">= 1"),
        ({"recompute_modules": ["moe_act"]}, "not priced"),
        ({"recompute": True, "recompute_modules": ["mlp"]}, "both set"),
    ],
)
def test_bad_recompute_fields_are_refused_by_name(training, needle):
    with pytest.raises(InputError, match=needle):
        load_cost_model(_spec(**training), world_size=8)


def test_activation_memory_follows_megatrons_checkpointed_forward():
    """uniform N keeps 32/N chunk inputs plus one chunk's full sets; block N keeps N inputs and
    32 - N full sets (the recompute of the first N comes after the others are freed)."""
    e, h = 2.0, LLAMA3_8B.hidden
    plain, _ = LLAMA3_8B.activation_bytes(TrainingConfig())
    layer = plain / 32
    u8, _ = LLAMA3_8B.activation_bytes(TrainingConfig(recompute=True, recompute_num_layers=8))
    assert u8 == pytest.approx(4 * e * h + 8 * layer)
    b4, _ = LLAMA3_8B.activation_bytes(
        TrainingConfig(recompute=True, recompute_method="block", recompute_num_layers=4)
    )
    assert b4 == pytest.approx(4 * e * h + 28 * layer)
