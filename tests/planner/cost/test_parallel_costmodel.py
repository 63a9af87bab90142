"""Stage cost model for TP x PP x EP (planner/cost/parallel.py), MoE pricing (cost/moe.py)."""

from __future__ import annotations

import dataclasses
import math

import pytest

from megatron_hsp.planner.cost.costmodel import (
    FIRST_PRINCIPLES_PRESETS,
    H100_SXM,
    first_principles_cost_model,
)
from megatron_hsp.planner.cost.parallel import (
    DEEPSEEK_V2_LITE,
    MOE_TRAINING,
    QWEN3_30B_A3B,
    ParallelConfig,
    load_parallel_cost_model,
    model_parallel_cost_model,
    pipeline_spec_for,
)
from megatron_hsp.planner.errors import InputError

MAPS = ("group_fixed_ms", "a2a_ms_per_token", "ring_step_ms_per_token")
MAPS += ("a2a_fixed_ms", "ring_step_fixed_ms", "ring_step_extra_ms_per_token")


@pytest.mark.parametrize("preset", sorted(FIRST_PRINCIPLES_PRESETS))
def test_unsplit_dense_model_equals_first_principles(preset):
    # One rule for both builders: at tp = pp = ep = 1 every coefficient is the same.
    model, hw, tr = FIRST_PRINCIPLES_PRESETS[preset]
    ref = first_principles_cost_model(model, hw, tr, world_size=64)
    got = model_parallel_cost_model(model, hw, tr, ParallelConfig(), gpus=64)
    assert got.attn_ms_per_token2 == pytest.approx(ref.attn_ms_per_token2, rel=1e-12)
    assert got.linear_ms_per_token == pytest.approx(ref.linear_ms_per_token, rel=1e-12)
    assert abs(got.tokens_per_rank - ref.tokens_per_rank) <= 1
    assert got.heads == ref.heads
    assert got.step_overhead_ms == pytest.approx(ref.step_overhead_ms, rel=1e-12)
    assert got.step_overhead_ms > 0
    for key in MAPS:
        a, b = getattr(ref, key), getattr(got, key)
        assert set(a) == set(b), key
        for d in a:
            assert b[d] == pytest.approx(a[d], rel=1e-12, abs=1e-15), (key, d)


def test_tensor_parallel_splits_compute_heads_and_nodes():
    model, hw, tr = FIRST_PRINCIPLES_PRESETS["llama3-70b-h100"]
    shape = model
    one = model_parallel_cost_model(shape, hw, tr, ParallelConfig(), gpus=64)
    tp8 = model_parallel_cost_model(shape, hw, tr, ParallelConfig(tp=8), gpus=64)
    assert tp8.attn_ms_per_token2 == pytest.approx(one.attn_ms_per_token2 / 8)
    # linear: 1/8 of the matmuls plus the exposed sequence-parallel collectives over NVLink.
    passes, e, h = 3, 2.0, model.hidden  # full recompute: 3 passes
    tp_comm = 4 * passes * model.layers * 7 / 8 * h * e / (hw.nvlink_gbs * 1e9) * 1e3
    assert tp8.linear_ms_per_token == pytest.approx(one.linear_ms_per_token / 8 + tp_comm)
    assert tp8.heads == (8, 1)  # 64 query heads / 8; 8 KV heads, one per TP rank
    assert tp8.sizes == [1, 2, 3, 4, 5, 6, 7, 8]  # 64 GPUs / tp 8 = 8 slots, one per node
    # Ulysses over 2 slots crosses nodes: 7 of 8 query heads... per GPU bytes at the NIC.
    u = 2
    kv = 1 * 2  # one KV head per TP rank, copied so that 2 ranks each get one
    per_peer = model.layers * passes * (8 * 256 + kv * 256) * e / (2 * u)
    assert tp8.a2a_ms_per_token[2] == pytest.approx(per_peer / (hw.inter_node_gbs * 1e9) * 1e3)


def test_ring_overhead_under_tensor_parallelism_is_per_gpu():
    # Each GPU of a TP group merges the partial outputs of its own heads / tp at its own HBM
    # bandwidth: the ring overhead per token is the unsplit model's / tp. (The stage builder
    # once divided by tp twice, heads per GPU at tp GPUs' bandwidth: 1/tp^2, 8x too cheap at
    # TP 8, a discount for every ring baseline; first_principles' own rule, checked by hand.)
    model, hw, tr = FIRST_PRINCIPLES_PRESETS["llama3-70b-h100"]
    shape = model
    one = model_parallel_cost_model(shape, hw, tr, ParallelConfig(), gpus=64)
    passes = 3  # full recompute
    by_hand = model.layers * passes * model.heads * model.qk_dim
    by_hand *= hw.ring_step_overhead_bytes_per_elem / (hw.hbm_tbs * 1e12) * 1e3
    assert one.ring_step_extra_ms_per_token[16] == pytest.approx(by_hand / 16, rel=1e-12)
    for tp in (2, 4, 8):
        split = model_parallel_cost_model(shape, hw, tr, ParallelConfig(tp=tp), gpus=64)
        for d, v in split.ring_step_extra_ms_per_token.items():
            assert v == pytest.approx(by_hand / d / tp, rel=1e-12), (tp, d)


def test_step_cost_per_stage_splits_dense_and_expert_weights_by_hand():
    # The per-step gradient reduction and optimizer of a stage (details.step_ms): ZeRO-1, so
    # reduce-scatter fp32 grads and all-gather bf16 weights, (g + p) bytes per weight times
    # (n - 1) / n over the slots that hold a copy, then Adam on the 1/n shard at HBM bandwidth.
    hw, tr = H100_SXM, MOE_TRAINING
    cost = model_parallel_cost_model(QWEN3_30B_A3B, hw, tr, ParallelConfig(ep=8), gpus=64)
    base, expert = QWEN3_30B_A3B.params(1)
    g, p, o = tr.bytes_per_grad, tr.bytes_per_param, tr.bytes_per_optimizer_state
    nic = hw.inter_node_gbs * 1e9  # 64 slots span nodes
    # dense weights over all 64 slots; experts (1/8 each) over the 8 slots of their EP rank
    reduce = (g + p) * (base * 63 / 64 + expert / 8 * 7 / 8) / nic * 1e3
    adam = (2 * o + g + p) * (base / 64 + expert / 8 / 8) / (hw.hbm_tbs * 1e12) * 1e3
    assert cost.details["grad_reduce_ms_per_step"] == pytest.approx(reduce, rel=1e-9)
    assert cost.details["optimizer_ms_per_step"] == pytest.approx(adam, rel=1e-9)
    assert cost.step_overhead_ms == pytest.approx(reduce + adam, rel=1e-9)
    # Under TP each GPU reduces and updates 1/tp of the weights.
    model, hw, tr = FIRST_PRINCIPLES_PRESETS["llama3-70b-h100"]
    shape = model
    tp8 = model_parallel_cost_model(shape, hw, tr, ParallelConfig(tp=8, pp=4), gpus=256)
    w = shape.params(4)[0] / 8  # the heaviest stage's weights, 1/8 per GPU; 8 slots, one a node
    reduce8 = (g + p) * w * 7 / 8 / nic * 1e3  # ZeRO-1 (PP refuses ZeRO-3)
    adam8 = (2 * o + g + p) * w / 8 / (hw.hbm_tbs * 1e12) * 1e3
    assert tp8.details["grad_reduce_ms_per_step"] == pytest.approx(reduce8, rel=1e-9)
    assert tp8.details["optimizer_ms_per_step"] == pytest.approx(adam8, rel=1e-9)


def test_pipeline_memory_holds_in_flight_microbatches():
    model, hw, tr = FIRST_PRINCIPLES_PRESETS["llama3-70b-h100"]
    shape = model
    par = ParallelConfig(tp=8, pp=4)
    cost = model_parallel_cost_model(shape, hw, tr, par, gpus=256)
    # By hand: stage of 20 layers (+ output layer), ZeRO-3 replaced by the distributed optimizer.
    assert shape.stage_layers(4) == (20, 0)
    layer, head = shape.activation_bytes(tr, 4)
    base, _ = shape.params(4)
    states = base / 8 * (2 + 4) + base / 8 * 12 / 8  # bf16 weights, fp32 grads; Adam over 8
    avail = 72 * 2**30 - states
    need = max(4 * layer / 8, layer / 8 + head / 8)  # device 0 holds 4, the last 1 + logits
    assert cost.tokens_per_rank == int(avail / need)
    assert "distributed optimizer" in cost.source
    inter = model_parallel_cost_model(shape, hw, tr, ParallelConfig(tp=8, pp=4, vpp=2), gpus=256)
    assert inter.tokens_per_rank < cost.tokens_per_rank  # 5.5 micro-batches in flight, not 4
    assert inter.details["peak_in_flight"] == pytest.approx(5.5)
    spec = pipeline_spec_for(cost, 4)
    assert spec.backward_share == pytest.approx(0.75)  # full recompute
    assert spec.hop_ms > 0


def test_moe_presets_match_published_sizes():
    # Qwen3-30B-A3B: 30.5B total, 3.3B activated (model card). DeepSeek-V2-Lite: 15.7B total,
    # 2.4B activated (model card, without the input embedding we count).
    assert QWEN3_30B_A3B.total_params_b() == pytest.approx(30.5, abs=0.1)
    assert QWEN3_30B_A3B.active_params_b() == pytest.approx(3.35, abs=0.1)
    assert DEEPSEEK_V2_LITE.total_params_b() == pytest.approx(15.7, abs=0.1)
    emb = DEEPSEEK_V2_LITE.vocab * DEEPSEEK_V2_LITE.hidden / 1e9
    assert DEEPSEEK_V2_LITE.active_params_b() - emb == pytest.approx(2.4, abs=0.1)


def test_moe_compute_is_active_parameters():
    dense = dataclasses.replace(QWEN3_30B_A3B, moe=None, ffn_hidden=8 * 768)
    # top-8 experts of 768 = one dense FFN of 6144, plus the router: h * 128 per layer.
    extra = 6.0 * 48 * 2048 * 128
    assert QWEN3_30B_A3B.linear_flops_per_token() == pytest.approx(
        dense.linear_flops_per_token() + extra
    )


def test_expert_dispatch_and_memory_by_hand():
    hw, tr = H100_SXM, MOE_TRAINING
    # Unsharded experts do not fit 72 GB (30.5B params x 6 bytes): a large cap for ep 1, whose
    # time terms do not depend on memory.
    ep1 = model_parallel_cost_model(
        QWEN3_30B_A3B, hw, tr, ParallelConfig(ep=1), gpus=64, memory_cap_gb=400
    )
    ep4 = model_parallel_cost_model(QWEN3_30B_A3B, hw, tr, ParallelConfig(ep=4), gpus=64)
    ep8 = model_parallel_cost_model(QWEN3_30B_A3B, hw, tr, ParallelConfig(ep=8), gpus=64)
    # 2 all-to-alls per MoE layer and pass (3 passes with recompute), 8 copies of h bf16 per
    # token, 1/8 to each of 7 NVLink peers.
    per_peer = 8 * 2048 * 2 / 8
    dispatch = 2 * 3 * 48 * 7 * per_peer / (hw.nvlink_gbs * 1e9) * 1e3
    assert ep8.linear_ms_per_token - ep1.linear_ms_per_token == pytest.approx(dispatch)
    assert ep8.group_fixed_ms[1] > ep1.group_fixed_ms[1]  # the calls' latencies
    # Experts sharded 8 ways: more room for activations.
    assert ep8.details["model_states_mib"] < ep4.details["model_states_mib"] * 0.75
    assert ep8.tokens_per_rank > ep4.tokens_per_rank
    # Crossing nodes (ep 16 on 8-GPU nodes) is slower per token than inside one.
    ep16 = model_parallel_cost_model(QWEN3_30B_A3B, hw, tr, ParallelConfig(ep=16), gpus=64)
    assert ep16.linear_ms_per_token > ep8.linear_ms_per_token


def test_presets_load_and_refusals():
    cost, plane = load_parallel_cost_model("deepseek-v2-lite-h100", ParallelConfig(ep=8), gpus=64)
    assert plane.world_size == 64 and cost.heads == (16, 16)
    cost, plane = load_parallel_cost_model("llama3-70b-h100", ParallelConfig(tp=8, pp=4), gpus=256)
    assert (plane.world_size, plane.gpus_per_node) == (8, 1)
    with pytest.raises(InputError, match="cannot be split"):
        load_parallel_cost_model("flexsp-gpt-7b", ParallelConfig(pp=2), gpus=64)
    with pytest.raises(InputError, match="needs a MoE model"):
        load_parallel_cost_model("llama3-8b-h100", ParallelConfig(ep=2), gpus=64)
    with pytest.raises(InputError, match="multiple of --tp"):
        load_parallel_cost_model("llama3-8b-h100", ParallelConfig(tp=8, pp=3), gpus=64)
    with pytest.raises(InputError, match="prices pp 4"):
        pipeline_spec_for(cost, 2)
    with pytest.raises(InputError, match="--vpp"):
        ParallelConfig(vpp=2)
    assert math.isfinite(cost.details["pp_hop_ms"])
