"""First-principles cost model: shapes of the formulas, not fitted numbers."""

from __future__ import annotations

import dataclasses

import pytest

from megatron_hsp.planner.cost.costmodel import (
    H100_SXM,
    LLAMA3_8B,
    LLAMA3_70B,
    TrainingConfig,
    TransformerShape,
    a2a_bytes_per_token,
    activation_bytes_per_token,
    first_principles_cost_model,
    load_cost_model,
)
from megatron_hsp.planner.errors import InputError


def _model(**kw):
    tr = kw.pop("training", TrainingConfig())
    hw = kw.pop("hardware", H100_SXM)
    model = dataclasses.replace(LLAMA3_8B, **kw)
    return first_principles_cost_model(model, hw, tr, world_size=64, gpus_per_node=8)


def test_llama3_parameter_counts():
    assert LLAMA3_8B.num_params() == pytest.approx(8.03e9, rel=0.002)
    assert LLAMA3_70B.num_params() == pytest.approx(70.55e9, rel=0.002)


def test_flops_match_megatron_formula():
    # 6 * (weights per token): 6 * (L * (h*(h+2kv) + h*h + 3*h*F) + h*V)
    h, f, kv, v, layers = 4096, 14336, 1024, 128256, 32
    expect = 6 * (layers * (h * (h + 2 * kv) + h * h + 3 * h * f) + h * v)
    assert LLAMA3_8B.linear_flops_per_token() == expect
    assert LLAMA3_8B.attn_flops_per_token2() == 6 * layers * h
    m = _model()
    assert m.linear_ms_per_token == pytest.approx(expect / (989e12 * 0.5) * 1e3)


def test_attention_is_quadratic_and_linear_part_linear():
    m = _model()
    s = 8192
    t1 = m.seq_ms([s], 1)[0] - m.linear_ms_per_token * s
    t2 = m.seq_ms([2 * s], 1)[0] - m.linear_ms_per_token * 2 * s
    assert t2 == pytest.approx(4 * t1)
    assert m.seq_ms([2 * s], 1)[0] > 2 * m.seq_ms([s], 1)[0]


def test_gqa_shrinks_all_to_all():
    mha = _model(kv_heads=32)
    gqa = _model(kv_heads=8)
    for d in (2, 4, 8, 16):
        assert gqa.a2a_ms_per_token[d] < mha.a2a_ms_per_token[d]
    # Q and O full heads (32), K and V 8 heads: (2*32 + 2*8) * 128 elems * 2 bytes * 2 passes
    assert a2a_bytes_per_token(LLAMA3_8B, TrainingConfig(), 8) == 32 * 2 * 2 * (80 * 128)
    # more ranks than KV heads: KV replicated up to the group size
    assert a2a_bytes_per_token(LLAMA3_8B, TrainingConfig(), 16) == 32 * 2 * 2 * (96 * 128)


def test_crossing_a_node_costs_more():
    m = _model()
    assert m.a2a_ms_per_token[16] > m.a2a_ms_per_token[8]
    flat = _model(hardware=dataclasses.replace(H100_SXM, inter_node_gbs=H100_SXM.nvlink_gbs))
    assert m.a2a_ms_per_token[16] > flat.a2a_ms_per_token[16]
    assert m.fixed_ms(16) > m.fixed_ms(8)  # inter-node latency per call
    assert 1 not in m.a2a_ms_per_token and m.seq_ms([100], 1)[0] > 0


def test_recompute_trades_time_for_memory():
    plain = _model()
    rec = _model(training=TrainingConfig(recompute=True))
    assert rec.tokens_per_rank > 2 * plain.tokens_per_rank
    assert rec.linear_ms_per_token == pytest.approx(plain.linear_ms_per_token * 4 / 3)
    # Attention recomputes one forward, at the forward kernel's rate (issue 19: backward has
    # its own rate), so the growth is one forward's time, not 4/3 of the total.
    fwd_ms = LLAMA3_8B.attn_flops_per_token2() / 3 / H100_SXM.attention_flops * 1e3
    assert rec.attn_ms_per_token2 == pytest.approx(plain.attn_ms_per_token2 + fwd_ms)
    assert activation_bytes_per_token(LLAMA3_8B, TrainingConfig(recompute=True)) < (
        activation_bytes_per_token(LLAMA3_8B, TrainingConfig())
    )


def test_zero_stages_shard_more_states():
    tr = TrainingConfig()
    p = 1e9
    states = [dataclasses.replace(tr, zero_stage=z).model_state_bytes(p, 64) for z in range(4)]
    assert states[0] == p * 18
    assert states[3] == pytest.approx(p * 18 / 64)
    assert states == sorted(states, reverse=True)
    tokens = [
        _model(training=TrainingConfig(zero_stage=z, recompute=True)).tokens_per_rank
        for z in (1, 2, 3)
    ]
    assert tokens == sorted(tokens)


def test_splits_respect_heads():
    m8 = load_cost_model("llama3-8b-h100", world_size=64)
    # 32 query heads: no Ulysses group of 64; it runs Ulysses 32 x ring 2, 6 as 2 x 3.
    assert m8.sizes == [1, 2, 3, 4, 5, 6, 7, 8, 16, 24, 32, 40, 48, 56, 64]
    assert m8.split(64) == (32, 2) and m8.split(6) == (2, 3) and m8.split(7) == (1, 7)
    # Ring figures for every size > 1 (pure ring), so Megatron CP groups of any size are priced.
    assert set(m8.ring_step_ms_per_token) == {d for d in m8.sizes if d > 1}
    m70 = load_cost_model("llama3-70b-h100", world_size=64)
    assert m70.split(64) == (64, 1) and 64 in m70.ring_step_ms_per_token


def test_ring_hides_behind_attention_for_long_sequences():
    m8 = load_cost_model("llama3-8b-h100", world_size=64)
    # 7 = pure ring: short sequences pay exposed p2p, long ones hide it behind attention. The
    # ring's non-bandwidth overhead (6 steps) is paid either way: nothing hides it.
    a1, a2 = m8.attn_ms_per_token2, m8.linear_ms_per_token
    extra = m8.ring_step_extra_ms_per_token[7]
    assert extra > 0
    for s, exposed in ((256, True), (200_000, False)):
        base = (a1 * s * s + a2 * s) / 7 + 6 * extra * s
        assert bool(m8.seq_ms([s], 7)[0] > base * (1 + 1e-9)) is exposed


def test_kv_copies_match_the_runtime_rule():
    # q=48, kv=8, Ulysses 6: each KV head copied 3 times (24 KV heads move), as the runtime does.
    from megatron_hsp.planner.groupspace import kv_copies

    assert kv_copies(48, 8, 6) == 3
    gqa = TransformerShape("q48", 2, 48 * 64, 48, 8, 1024, 1000)
    mha = TransformerShape("q48mha", 2, 48 * 64, 48, 48, 1024, 1000)
    t = TrainingConfig()
    assert a2a_bytes_per_token(gqa, t, 6) == pytest.approx(
        a2a_bytes_per_token(mha, t, 6) * (2 * 48 + 2 * 24) / (4 * 48)
    )


def test_states_above_cap_is_an_error_naming_the_flag():
    with pytest.raises(ValueError, match="--memory-cap-gb"):
        load_cost_model("llama3-70b-h100", world_size=8)


def test_a_shape_without_head_dim_derives_it_again_when_replaced():
    # head_dim None means hidden / heads on every read, so a replaced hidden moves it too (a
    # stored derived head_dim would keep 128 and price Q/K/V of the wrong width).
    assert LLAMA3_8B.head_dim is None and LLAMA3_8B.qk_dim == 128
    half = dataclasses.replace(LLAMA3_8B, hidden=2048)
    assert (half.qk_dim, half.v_dim, half.kv_dim) == (64, 64, 8 * 64)
    assert half.attn_flops_per_token2() == 6 * 32 * 2048


def test_a_moe_shape_is_refused_by_the_dense_builder():
    from megatron_hsp.planner.cost.parallel import QWEN3_30B_A3B

    with pytest.raises(InputError, match="model_parallel_cost_model"):
        first_principles_cost_model(QWEN3_30B_A3B, H100_SXM, TrainingConfig(), world_size=64)
