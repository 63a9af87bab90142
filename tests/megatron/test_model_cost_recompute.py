"""Megatron's recompute flags priced as given, in the one cost model bench and training build
(``megatron/model_cost.py`` through ``config.validate_hsp_args``; issue 43 item 3)."""

from __future__ import annotations

import pytest

from megatron_hsp.megatron.refusals import HSPArgsError
from tests.megatron.test_integration_cost_model import BASE, LLAMA3_8B, config, priced

LLAMA = [*BASE, *LLAMA3_8B, "--use-distributed-optimizer"]
FULL = ["--recompute-granularity", "full"]


def model(extra: list[str]):
    return priced(config([*LLAMA, *extra], world_size=32))


def test_block_recompute_of_4_layers_is_not_full_recompute():
    """Block recompute of 4 of 32 layers keeps 28 layers' activations (more memory than full
    recompute) and reruns 4 layers' forward (less time): before, both were priced as full."""
    full = model([*FULL, "--recompute-method", "uniform", "--recompute-num-layers", "1"])
    block = model([*FULL, "--recompute-method", "block", "--recompute-num-layers", "4"])
    none = model([])
    assert block.tokens_per_rank < full.tokens_per_rank  # more memory per token
    assert block.tokens_per_rank > none.tokens_per_rank  # 4 layers keep only their input
    lengths = [32768]
    assert none.group_ms(lengths, 4) < block.group_ms(lengths, 4) < full.group_ms(lengths, 4)
    # 4 of 32 layers rerun their forward: an eighth of full recompute's extra linear time
    extra = (block.linear_ms_per_token - none.linear_ms_per_token) / (
        full.linear_ms_per_token - none.linear_ms_per_token
    )
    assert extra == pytest.approx(4 / 32)


def test_block_recompute_of_every_layer_is_full_recompute():
    uniform = model([*FULL, "--recompute-method", "uniform", "--recompute-num-layers", "1"])
    block = model([*FULL, "--recompute-method", "block", "--recompute-num-layers", "32"])
    assert (block.tokens_per_rank, block.linear_ms_per_token, block.attn_ms_per_token2) == (
        uniform.tokens_per_rank,
        uniform.linear_ms_per_token,
        uniform.attn_ms_per_token2,
    )


def test_uniform_chunks_keep_one_chunk_while_it_is_recomputed():
    one = model([*FULL, "--recompute-method", "uniform", "--recompute-num-layers", "1"])
    eight = model([*FULL, "--recompute-method", "uniform", "--recompute-num-layers", "8"])
    assert eight.tokens_per_rank < one.tokens_per_rank  # 8 layers' full sets at once
    assert eight.linear_ms_per_token == one.linear_ms_per_token  # every layer recomputed


def test_selective_recompute_prices_its_modules():
    none = model([])
    attn = model(["--recompute-granularity", "selective"])  # Megatron's default: core_attn
    mlp = model(["--recompute-granularity", "selective", "--recompute-modules", "mlp"])
    assert attn.attn_ms_per_token2 > none.attn_ms_per_token2  # the attention forward again
    assert attn.linear_ms_per_token == none.linear_ms_per_token
    assert mlp.linear_ms_per_token > none.linear_ms_per_token  # the MLP forward again
    assert mlp.tokens_per_rank > attn.tokens_per_rank >= none.tokens_per_rank
    norms = model(["--recompute-granularity", "selective", "--recompute-modules", "layernorm"])
    assert norms.tokens_per_rank > none.tokens_per_rank
    assert norms.linear_ms_per_token == none.linear_ms_per_token  # norms: no matmul
    activations = model(["--recompute-activations"])  # Megatron's alias of selective
    assert activations.attn_ms_per_token2 == attn.attn_ms_per_token2


def test_unpriced_modules_are_said():
    cfg = config([*LLAMA, "--recompute-granularity", "selective", "--recompute-modules", "moe"])
    assert any("--recompute-modules moe" in n and "not recomputed" in n for n in cfg.notes)


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (FULL, "--recompute-method"),
        ([*FULL, "--recompute-method", "block"], "--recompute-num-layers"),
        ([*FULL, "--recompute-method", "blocky", "--recompute-num-layers", "2"], "blocky"),
        ([*FULL, "--recompute-method", "block", "--recompute-num-layers", "40"], "40"),
        (["--recompute-granularity", "selective", "--recompute-num-layers", "2"], "num-layers"),
        (["--recompute-granularity", "some"], "--recompute-granularity some"),
    ],
)
def test_recompute_flags_megatron_refuses_are_refused_by_name(flags, named):
    with pytest.raises(HSPArgsError, match=named):
        config([*LLAMA, *flags], world_size=32)
