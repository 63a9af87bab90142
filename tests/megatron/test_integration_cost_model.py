"""Without ``--hsp-cost-model``, ``--hsp`` prices the model Megatron's flags describe (issue 18).

Before, the default was FlexSP's fitted 7B GPT whatever was trained: a 2-layer model on 2 ranks
was refused as too big ("raise --memory-cap-gb", a flag the launcher does not have), and an 8B
Llama was planned with a 7B GPT's figures.
"""

from __future__ import annotations

import dataclasses
import pickle
import re

import pytest

from megatron_hsp.megatron.config import validate_hsp_args
from megatron_hsp.megatron.model_cost import (
    HARDWARE_PRESETS,
    nvml_gpu_names,
    preset_for_gpu_name,
)
from megatron_hsp.megatron.refusals import HSPArgsError
from megatron_hsp.planner.cost.costmodel import FIRST_PRINCIPLES_PRESETS, load_cost_model
from megatron_hsp.planner.cost.shape import TransformerShape
from tests.helpers.megatron_args import parse

BASE = [
    *("--num-attention-heads", "8", "--global-batch-size", "64", "--seq-length", "4096"),
    *("--eval-iters", "0", "--attention-dropout", "0", "--hsp"),
]
# Meta-Llama-3-8B's config.json in Megatron's flags.
LLAMA3_8B = [
    *("--num-layers", "32", "--hidden-size", "4096", "--num-attention-heads", "32"),
    *("--group-query-attention", "--num-query-groups", "8", "--ffn-hidden-size", "14336"),
    *("--swiglu", "--vocab-size", "128256", "--untie-embeddings-and-output-weights", "--bf16"),
]


def config(argv: list[str], world_size: int = 8, gpu_names: list[str] | None = None):
    args = parse(argv, world_size=world_size)
    return validate_hsp_args(args, env={}, gpu_names=[] if gpu_names is None else gpu_names)


def priced(cfg):
    return load_cost_model(
        cfg.cost_model,
        world_size=cfg.run.dims.slots,
        gpus_per_node=cfg.run.dims.slots_per_node,
        max_seq_k=cfg.run.max_seq / 1000,
        memory_cap_gb=cfg.memory_cap_gb,
    )


def test_the_default_cost_model_is_the_model_megatrons_flags_describe():
    small = config(BASE, world_size=2)  # refused as too big under the 7B default before
    assert small.cost_model["model"]["layers"] == 2
    assert small.cost_model["model"]["hidden"] == 384
    llama = config([*BASE, *LLAMA3_8B, "--use-distributed-optimizer"])
    model = llama.cost_model["model"]
    shape = (model["layers"], model["hidden"], model["heads"], model["kv_heads"])
    assert shape == (32, 4096, 32, 8)
    assert (model["ffn_hidden"], model["vocab"], model["gated"]) == (14336, 128256, True)
    assert model["tied_embeddings"] is False
    assert llama.cost_model["training"]["zero_stage"] == 1  # the distributed optimizer
    assert llama.cost_model["training"]["bytes_per_param"] == 2.0  # --bf16
    # Same model and hardware as the llama3-8b-h100 preset: the same compute coefficients.
    preset = load_cost_model("llama3-8b-h100", world_size=8)
    ours = priced(llama)
    assert ours.attn_ms_per_token2 == pytest.approx(preset.attn_ms_per_token2, rel=1e-12)
    assert ours.linear_ms_per_token == pytest.approx(preset.linear_ms_per_token, rel=1e-12)
    assert priced(small).tokens_per_rank > 100 * ours.tokens_per_rank
    note = next(n for n in llama.notes if "first principles" in n)
    assert "32 layers" in note and "h100-sxm" in note and "no GPU visible" in note


def test_megatron_flags_and_the_dense_preset_are_one_shape_type():
    """One model-shape type: what Megatron's flags describe and the Llama 3 8B preset are both a
    ``TransformerShape``, equal but for the name (head dim hidden / heads in both)."""
    spec = config([*BASE, *LLAMA3_8B, "--use-distributed-optimizer"]).cost_model
    shape = TransformerShape.from_spec(spec["model"], name=spec["name"])
    preset = FIRST_PRINCIPLES_PRESETS["llama3-8b-h100"][0]
    assert type(shape) is type(preset) is TransformerShape
    assert shape == dataclasses.replace(preset, name=shape.name)
    assert shape.qk_dim == 128


def test_kv_channels_set_the_attention_head_dim():
    """``--kv-channels`` apart from hidden / heads (a wide-head model): attention is priced at
    that head dim. Before, the flag was not read and attention was priced at hidden / heads."""
    base = [*BASE, *LLAMA3_8B, "--use-distributed-optimizer"]
    plain = config(base).cost_model
    assert "head_dim" not in plain["model"]
    # Megatron's validate_args fills --kv-channels with hidden / heads: nothing changes
    assert config([*base, "--kv-channels", "128"]).cost_model == plain
    wide = config([*base, "--kv-channels", "256"]).cost_model
    assert wide["model"]["head_dim"] == 256
    shape = TransformerShape.from_spec(wide["model"], name=wide["name"])
    assert shape.qk_dim == 256
    assert priced(config([*base, "--kv-channels", "256"])).attn_ms_per_token2 == pytest.approx(
        2 * load_cost_model(plain, world_size=8).attn_ms_per_token2, rel=1e-9
    )


def test_moe_flags_price_the_active_experts():
    """Issue 17: with --num-experts the default model's FFN is the active experts' (top-k x
    the expert width + shared), and a note says what it leaves out (expert memory, dispatch)."""
    argv = [*BASE, *LLAMA3_8B, "--use-distributed-optimizer"]
    args = parse([*argv, "--num-experts", "8"], world_size=8)
    args.moe_router_topk, args.moe_ffn_hidden_size = 2, 1024
    args.moe_shared_expert_intermediate_size = 512
    cfg = validate_hsp_args(args, env={}, gpu_names=[])
    assert cfg.cost_model["model"]["ffn_hidden"] == 2 * 1024 + 512
    note = next(n for n in cfg.notes if n.startswith("MoE"))
    assert "8 experts, top-2" in note and "dispatch" in note and "--hsp-cost-model" in note
    dense = config(argv)
    assert priced(cfg).linear_ms_per_token < priced(dense).linear_ms_per_token


def test_the_spec_reaches_the_planner_process_unchanged():
    cfg = config([*BASE, *LLAMA3_8B, "--use-distributed-optimizer"])
    again = pickle.loads(pickle.dumps(cfg.cost_model))  # what the spawned planner receives
    a, b = (
        priced(cfg),
        load_cost_model(
            again,
            world_size=cfg.run.dims.slots,
            gpus_per_node=cfg.run.dims.slots_per_node,
            max_seq_k=cfg.run.max_seq / 1000,
            memory_cap_gb=cfg.memory_cap_gb,
        ),
    )
    assert a == b


def test_training_flags_change_the_memory_model():
    fp32 = config(BASE).cost_model["training"]
    assert fp32["bytes_per_param"] == 4.0 and fp32["activation_bytes"] == 4.0
    assert fp32["zero_stage"] == 0 and fp32["recompute"] is False
    full_flags = ["--recompute-granularity", "full", "--recompute-method", "uniform"]
    full = config([*BASE, "--bf16", *full_flags, "--recompute-num-layers", "1"])
    assert full.cost_model["training"]["recompute"] is True
    assert full.cost_model["training"]["activation_bytes"] == 2.0
    sel = config([*BASE, "--recompute-granularity", "selective"]).cost_model["training"]
    assert sel["recompute"] is False  # selective: Megatron's default module, core_attn
    assert sel["recompute_modules"] == ["core_attn"]


@pytest.mark.parametrize(
    ("names", "preset"),
    [
        (["NVIDIA H100 80GB HBM3"] * 8, "h100-sxm"),
        (["NVIDIA H200"], "h200-sxm"),
        (["NVIDIA A100-SXM4-80GB"], "a100-sxm-80gb"),
        (["NVIDIA A100-SXM4-40GB"], "a100-sxm-40gb"),
        (["NVIDIA B200"], "b200"),
    ],
)
def test_hardware_is_detected_from_the_gpu_names(names, preset):
    cfg = config(BASE, gpu_names=names)
    assert cfg.cost_model["hardware"]["name"] == preset
    assert cfg.cost_model["hardware"]["hbm_gb"] == HARDWARE_PRESETS[preset]["hbm_gb"]
    assert any(f"on {preset} (detected: {names[0]})" in n for n in cfg.notes)


@pytest.mark.parametrize("name", ["NVIDIA L40S", "NVIDIA H100 PCIe", "NVIDIA H100 NVL"])
def test_a_gpu_no_preset_describes_is_refused_naming_the_flag(name):
    assert preset_for_gpu_name(name) is None
    refused = rf"no preset for the GPUs here \({name}\).*--hsp-hardware"
    with pytest.raises(HSPArgsError, match=refused):
        config(BASE, gpu_names=[name])
    # Named explicitly, the user takes responsibility for the figures.
    cfg = config([*BASE, "--hsp-hardware", "h100-sxm"], gpu_names=[name])
    assert cfg.cost_model["hardware"]["name"] == "h100-sxm"
    assert any("named with --hsp-hardware" in n for n in cfg.notes)


def test_named_hardware_sets_the_memory_cap():
    cfg = config([*BASE, "--hsp-hardware", "a100-sxm-40gb"])
    assert cfg.cost_model["hardware"]["hbm_gb"] == 40.0
    assert any(n.endswith("of 36") for n in cfg.notes)  # 90% of 40 GB, less communicators


def test_hardware_with_an_explicit_cost_model_is_refused():
    with pytest.raises(HSPArgsError, match=r"--hsp-hardware h200-sxm .*--hsp-cost-model"):
        config([*BASE, "--hsp-hardware", "h200-sxm", "--hsp-cost-model", "flexsp-gpt-7b"])


def test_a_tensor_parallel_slot_is_priced_as_tp_gpus():
    argv = [*BASE, "--tensor-model-parallel-size", "2", "--hsp-gpus-per-node", "8"]
    cfg = config([*argv, "--hsp-memory-cap-gb", "40"])
    hw = cfg.cost_model["hardware"]
    assert hw["name"] == "h100-sxmx2" and hw["peak_tflops"] == 2 * 989.0
    assert hw["hbm_gb"] == 160.0
    # --hsp-memory-cap-gb is per GPU: a slot of 2 GPUs has 80 GB, less 2 x its communicators.
    comm = next(n for n in cfg.notes if "communicators:" in n)
    assert "of 80" in comm
    assert cfg.memory_cap_gb < 80 and cfg.memory_cap_gb > 70
    assert any("slot of 2 tensor-parallel GPUs" in n for n in cfg.notes)


def test_a_model_that_does_not_fit_names_the_launchers_flags():
    """The refusal on few ranks named ``--memory-cap-gb`` (``megatron-hsp plan``'s flag)."""
    for argv, world in (
        ([*BASE, "--hsp-cost-model", "flexsp-gpt-7b"], 2),
        ([*BASE, *LLAMA3_8B], 2),
    ):
        with pytest.raises(HSPArgsError) as caught:
            config(argv, world_size=world)
        message = str(caught.value)
        assert "--hsp-memory-cap-gb" in message
        assert not re.search(r"(?<![\w-])--memory-cap-gb", message), message
    with pytest.raises(HSPArgsError, match="--use-distributed-optimizer shards"):
        config([*BASE, *LLAMA3_8B], world_size=2)


def test_nvml_names_are_a_list_here():
    # No NVIDIA driver on CI machines: an empty list, not an error. (On a GPU machine the names
    # are the driver's; docs/gpu-validation.md lists that check as open.)
    assert isinstance(nvml_gpu_names(), list)
