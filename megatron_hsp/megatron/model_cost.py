"""The default ``--hsp`` cost model: first principles from Megatron's own flags.

Why: before, ``--hsp`` without ``--hsp-cost-model`` planned every model with FlexSP's fitted
7B GPT figures, whatever was being trained (a 2-layer test model was refused as "too big for 2
GPUs", a 70B model would have been planned as a 7B one). The planner needs a step-time and
memory model of *this* model on *this* hardware, and Megatron's parsed arguments describe the
model completely: layers, hidden, heads, KV groups, FFN, vocabulary, precision, the
distributed optimizer (ZeRO-1) and recomputation. The hardware comes from ``--hsp-hardware``
or, with ``auto``, from the GPU NVML names (read without creating a CUDA context, so no rank
touches GPU 0 before Megatron picks its device).

The result is a cost-model *spec* (a mapping ``planner.cost.costmodel.load_cost_model`` accepts,
``model`` + ``hardware`` + ``training`` sections), so the training process and the planner
process build the identical ``CostModel`` from it.

Tensor parallelism: HSP plans over slots of ``--tensor-model-parallel-size`` GPUs; a slot is
priced as one device with TP times the GPU's FLOPs, memory and link bandwidth (each TP rank holds
1/TP of the weights, activations with sequence parallelism, and heads it exchanges). TP's own
all-reduces are not priced (they cost every plan alike).
"""

from __future__ import annotations

import ctypes
import dataclasses
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from megatron_hsp.megatron.refusals import kv_heads
from megatron_hsp.planner.cost.first_principles import H100_SXM

# Per GPU: the datasheet's dense bf16 peak and HBM; links as NCCL achieves them. Everything
# else (achievable fractions of peak, attention kernel call overhead, ring step overhead, call
# latencies) is the calibrated H100 model's (``first_principles.H100_SXM``, fitted to published
# GPU measurements: docs/calibration.md), so the default model of an H100 run is exactly the
# calibrated preset's; for other GPUs those fractions are the H100's, unmeasured there.
_H100 = dataclasses.asdict(H100_SXM)
_LINK_EFFICIENCY = H100_SXM.nvlink_gbs / 450.0  # NCCL's effective NVLink rate / datasheet's
HARDWARE_PRESETS: dict[str, dict[str, Any]] = {
    # NVIDIA H100 SXM5: 989 TFLOP/s bf16 dense, 80 GB HBM3; links: the calibrated preset's.
    "h100-sxm": {
        "peak_tflops": 989.0,
        "hbm_gb": 80.0,
        "nvlink_gbs": H100_SXM.nvlink_gbs,
        "inter_node_gbs": H100_SXM.inter_node_gbs,
        "p2p_gbs": H100_SXM.p2p_gbs,
    },
    # H200 SXM: H100's compute with 141 GB HBM3e; same NVLink 4 and NDR fabric.
    "h200-sxm": {
        "hbm_tbs": 4.8,
        "peak_tflops": 989.0,
        "hbm_gb": 141.0,
        "nvlink_gbs": H100_SXM.nvlink_gbs,
        "inter_node_gbs": H100_SXM.inter_node_gbs,
        "p2p_gbs": H100_SXM.p2p_gbs,
    },
    # A100 SXM4: 312 TFLOP/s bf16 dense, NVLink 3 600 GB/s bidirectional (300 one way, at the
    # H100's NCCL efficiency), HDR 200 Gb/s per GPU.
    "a100-sxm-80gb": {
        "hbm_tbs": 2.0,
        "peak_tflops": 312.0,
        "hbm_gb": 80.0,
        "nvlink_gbs": 300.0 * _LINK_EFFICIENCY,
        "inter_node_gbs": 25.0 * _LINK_EFFICIENCY,
    },
    "a100-sxm-40gb": {
        "hbm_tbs": 1.6,
        "peak_tflops": 312.0,
        "hbm_gb": 40.0,
        "nvlink_gbs": 300.0 * _LINK_EFFICIENCY,
        "inter_node_gbs": 25.0 * _LINK_EFFICIENCY,
    },
    # B200 (HGX B200): 2.25 PFLOP/s bf16 dense, 180 GB HBM3e, NVLink 5 1.8 TB/s bidirectional,
    # ConnectX-7 400 Gb/s per GPU.
    "b200": {
        "hbm_tbs": 8.0,
        "peak_tflops": 2250.0,
        "hbm_gb": 180.0,
        "nvlink_gbs": 900.0 * _LINK_EFFICIENCY,
        "inter_node_gbs": H100_SXM.inter_node_gbs,
    },
}
HARDWARE_COMMON = {
    k: v
    for k, v in _H100.items()
    if k not in ("name", "peak_tflops", "hbm_gb", "nvlink_gbs", "inter_node_gbs", "p2p_gbs")
    and k != "gpus_per_node"
}
# NVML device names (``nvidia-smi --query-gpu=name``) -> preset. Order matters: the first
# pattern that matches wins. PCIe and NVL cards have other clocks and links: no preset.
_NVML_NAMES: tuple[tuple[str, str | None], ...] = (
    (r"H100.*(PCIe|NVL)", None),
    (r"H100", "h100-sxm"),
    (r"H200.*NVL", None),
    (r"H200", "h200-sxm"),
    (r"A100.*SXM.*80GB", "a100-sxm-80gb"),
    (r"A100.*SXM.*40GB", "a100-sxm-40gb"),
    (r"B200", "b200"),
)
FALLBACK_HARDWARE = "h100-sxm"


class HardwareUnknown(ValueError):
    """A GPU whose figures no preset holds (named in the message)."""


def preset_for_gpu_name(name: str) -> str | None:
    """The hardware preset of an NVML device name, or None when none fits."""
    for pattern, preset in _NVML_NAMES:
        if re.search(pattern, name, re.IGNORECASE):
            return preset
    return None


def nvml_gpu_names() -> list[str]:
    """Names of the GPUs NVML sees ([] without a driver).

    Why NVML through ctypes: ``torch.cuda.get_device_name`` initialises CUDA, and at argument
    time no rank has chosen its device yet, so every rank would open a context on GPU 0. NVML is
    the driver's management library: it reads names without a CUDA context, and it is present
    wherever the NVIDIA driver is.
    """
    try:
        lib = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return []
    if lib.nvmlInit_v2() != 0:
        return []
    names: list[str] = []
    try:
        count = ctypes.c_uint(0)
        if lib.nvmlDeviceGetCount_v2(ctypes.byref(count)) != 0:
            return []
        for i in range(count.value):
            handle = ctypes.c_void_p()
            if lib.nvmlDeviceGetHandleByIndex_v2(i, ctypes.byref(handle)) != 0:
                continue
            buf = ctypes.create_string_buffer(96)
            if lib.nvmlDeviceGetName(handle, buf, 96) == 0:
                names.append(buf.value.decode(errors="replace"))
    finally:
        lib.nvmlShutdown()
    return names


@dataclass(frozen=True)
class HardwareChoice:
    """The preset used and how it was chosen (printed at start-up)."""

    preset: str
    how: str  # "named with --hsp-hardware", "detected: NVIDIA H100 80GB HBM3", ...


def choose_hardware(requested: str | None, gpu_names: list[str] | None = None) -> HardwareChoice:
    """``--hsp-hardware NAME`` as given; ``auto``/None: from the GPUs NVML names.

    No GPU visible (a CPU run: tests, argument checks on a login node) prices as
    ``FALLBACK_HARDWARE`` and says so; a GPU no preset describes is refused, since pricing,
    say, a 48 GB card with 80 GB would plan micro-batches that do not fit.
    """
    if requested and requested != "auto":
        if requested not in HARDWARE_PRESETS:
            raise HardwareUnknown(
                f"--hsp-hardware {requested}: unknown; presets: {', '.join(HARDWARE_PRESETS)}"
            )
        return HardwareChoice(requested, "named with --hsp-hardware")
    names = nvml_gpu_names() if gpu_names is None else gpu_names
    if not names:
        return HardwareChoice(
            FALLBACK_HARDWARE,
            f"no GPU visible to NVML, priced as {FALLBACK_HARDWARE}; name the GPUs with "
            "--hsp-hardware",
        )
    presets = {preset_for_gpu_name(n) for n in names}
    if None in presets or len(presets) != 1:
        raise HardwareUnknown(
            f"--hsp-hardware auto: no preset for the GPUs here ({', '.join(sorted(set(names)))}); "
            f"name one with --hsp-hardware ({', '.join(HARDWARE_PRESETS)}) or give a cost model "
            "with --hsp-cost-model FILE (megatron-hsp profile measures one)"
        )
    (preset,) = presets
    return HardwareChoice(preset, f"detected: {names[0]}")


def _count_hybrid_layers(pattern: str) -> tuple[int, int]:
    """(attention layers, MLP layers) of a hybrid layer pattern's main decoder part."""
    main = pattern.split("/")[0]
    return main.count("*"), main.count("-")


def _moe_active_ffn(args: Any, ffn: int, notes: list[str]) -> int:
    """The dense FFN width whose FLOPs per token equal an MoE layer's active experts: top-k
    routed experts of ``--moe-ffn-hidden-size`` plus the shared experts.

    Why only that: the default model is a dense ``load_cost_model`` spec, which the planner
    process rebuilds from plain data; the MoE terms of ``planner/cost/moe.py`` (expert weights over
    EP, optimizer states over expert-data-parallel ranks, dispatch all-to-all) live in the
    stage builder of ``planner/cost/parallel.py``, which takes presets, not specs. Compute is what
    separates plans here; the per-token dispatch and the expert weights cost every plan of a
    batch alike, except through the memory cap, which this model sets too high: said in a note.
    """
    experts = int(args.num_experts)
    top_k = int(getattr(args, "moe_router_topk", None) or 2)
    expert_ffn = int(getattr(args, "moe_ffn_hidden_size", None) or ffn)
    shared = int(getattr(args, "moe_shared_expert_intermediate_size", None) or 0)
    freq = getattr(args, "moe_layer_freq", 1)
    every = freq == 1 if isinstance(freq, int) else all(int(x) == 1 for x in freq)
    active = top_k * expert_ffn + shared
    notes.append(
        f"MoE ({experts} experts, top-{top_k}, expert FFN {expert_ffn}"
        + (f", shared {shared}" if shared else "")
        + f"): priced as a dense FFN of {active} (the active experts' FLOPs)"
        + ("" if every else " in every layer, an upper bound for --moe-layer-freq's dense layers")
        + "; expert weights beyond the active ones, their optimizer states and the dispatch "
        "all-to-all are not in the default model (its memory cap is optimistic): give "
        "--hsp-cost-model for a measured fit"
    )
    return max(active, ffn) if not every else active


# Megatron's --recompute-modules whose time and memory the cost model prices
# (``first_principles.RECOMPUTE_MODULES``); the others are said in a note and priced as not
# recomputed (memory as if kept: conservative; time without their recompute: optimistic).
_PRICED_MODULES = ("core_attn", "layernorm", "mlp")


def recompute_training(args: Any, layers: int, notes: list[str]) -> dict[str, Any]:
    """The cost-model spec's recompute keys from Megatron's recompute flags, as given.

    Why: ``--recompute-method block --recompute-num-layers 4`` of 32 layers was priced as full
    recompute of all 32 (the time of recomputing every layer, the memory of keeping none), so
    plans were slower than the run and their memory too optimistic for the 28 layers that keep
    their activations (issue 43). Megatron's own checks (``TransformerConfig.__post_init__``)
    are applied here, each a one-line error naming the flag: ``full`` needs a method and a
    layer count, ``selective`` takes neither; ``--recompute-activations`` is ``selective``.
    """
    granularity = getattr(args, "recompute_granularity", None)
    if getattr(args, "recompute_activations", False):
        granularity = "selective"  # Megatron's validate_args
    method = getattr(args, "recompute_method", None)
    count = getattr(args, "recompute_num_layers", None)
    modules = getattr(args, "recompute_modules", None)
    if granularity not in (None, "full", "selective"):
        raise ValueError(f"--recompute-granularity {granularity}: choose full or selective")
    if method not in (None, "uniform", "block"):
        raise ValueError(f"--recompute-method {method}: choose uniform or block")
    if granularity is None:
        return {"recompute": False}
    if granularity == "selective":
        if method is not None or count is not None:
            flag = "--recompute-method" if method is not None else "--recompute-num-layers"
            raise ValueError(
                f"{flag} is for --recompute-granularity full; selective recompute takes "
                "--recompute-modules (Megatron refuses it too)"
            )
        given = list(modules) if modules is not None else ["core_attn"]  # Megatron's default
        priced = [m for m in given if m in _PRICED_MODULES]
        other = [m for m in given if m not in _PRICED_MODULES]
        if other:
            notes.append(
                f"--recompute-modules {' '.join(other)}: not in the default cost model (MoE, MLA "
                "and GatedDeltaNet parts are not priced apart): priced as not recomputed"
            )
        return {"recompute": False, "recompute_modules": priced}
    if method is None or count is None:
        missing = "--recompute-method uniform|block" if method is None else "--recompute-num-layers"
        raise ValueError(
            f"--recompute-granularity full needs {missing} (Megatron refuses it without: "
            "uniform N recomputes every layer in chunks of N, block N the first N layers of "
            "each pipeline stage)"
        )
    if int(count) < 1 or int(count) > layers:
        raise ValueError(
            f"--recompute-num-layers {count}: must be between 1 and the layers per pipeline "
            f"stage ({layers} or fewer)"
        )
    return {"recompute": True, "recompute_method": method, "recompute_num_layers": int(count)}


def _recompute_words(training: Mapping[str, Any]) -> str:
    """How the start-up note names the recompute the model prices."""
    if training.get("recompute"):
        n, method = training["recompute_num_layers"], training["recompute_method"]
        if method == "uniform":
            return f", full recompute of every layer (uniform, chunks of {n})"
        return f", full recompute of {n} layers per stage (block)"
    mods = training.get("recompute_modules")
    return f", selective recompute of {', '.join(mods)}" if mods else ""


def default_cost_model_spec(
    args: Any, hardware: HardwareChoice, tp: int
) -> tuple[dict[str, Any], list[str]]:
    """(cost-model spec for ``load_cost_model``, notes saying how it was derived).

    Reads Megatron's *validated* args (``ffn_hidden_size`` and ``num_query_groups`` are filled
    in by ``validate_args``; ``padded_vocab_size`` by the tokenizer build in
    ``parse_and_validate_args``).
    """
    notes: list[str] = []
    for attr in ("num_layers", "hidden_size", "num_attention_heads"):
        if not getattr(args, attr, None):
            flag = "--" + attr.replace("_", "-")
            raise ValueError(f"the default cost model needs {flag} (or give --hsp-cost-model)")
    heads = int(args.num_attention_heads)
    kv = int(kv_heads(args) or heads)
    layers = int(args.num_layers)
    pattern = getattr(args, "hybrid_layer_pattern", None)
    if pattern:
        attn, mlp = _count_hybrid_layers(pattern)
        layers = max(attn, mlp, 1)
        notes.append(
            f"hybrid pattern {pattern}: {attn} attention and {mlp} MLP layers priced as {layers} "
            "dense layers (an upper bound)"
        )
    hidden = int(args.hidden_size)
    ffn = getattr(args, "ffn_hidden_size", None) or 4 * hidden
    experts = getattr(args, "num_experts", None)
    if experts:
        ffn = _moe_active_ffn(args, int(ffn), notes)
    vocab = getattr(args, "padded_vocab_size", None) or getattr(args, "vocab_size", None)
    if not vocab:
        vocab = 128256
        notes.append(
            "vocabulary size unknown at argument time: priced with 128256 (Llama 3); pass "
            "--vocab-size or --hsp-cost-model"
        )
    half = bool(getattr(args, "bf16", False) or getattr(args, "fp16", False))
    training = {
        # Megatron's distributed optimizer shards fp32 master weights and Adam states over the
        # data-parallel ranks (ZeRO-1); the bf16 weights and fp32 main grads stay whole.
        "zero_stage": 1 if getattr(args, "use_distributed_optimizer", False) else 0,
        **recompute_training(args, layers, notes),
        "bytes_per_param": 2.0 if half else 4.0,
        "bytes_per_grad": 2.0 if getattr(args, "grad_reduce_in_bf16", False) else 4.0,
        "bytes_per_optimizer_state": 12.0 if half else 8.0,
        "activation_bytes": 2.0 if half else 4.0,
    }
    model = {
        "name": f"megatron-{layers}x{hidden}",
        "layers": layers,
        "hidden": hidden,
        "heads": heads,
        "kv_heads": kv,
        "ffn_hidden": int(ffn),
        "vocab": int(vocab),
        "gated": bool(getattr(args, "swiglu", False)),
        "tied_embeddings": not getattr(args, "untie_embeddings_and_output_weights", False),
    }
    kv_channels = getattr(args, "kv_channels", None)
    if kv_channels and int(kv_channels) != hidden // heads:
        # --kv-channels sets the attention head dim apart from hidden / heads (Megatron's
        # validate_args fills it in with that quotient when it is not given)
        model["head_dim"] = int(kv_channels)
    hw = {**HARDWARE_COMMON, **HARDWARE_PRESETS[hardware.preset]}
    for key in ("peak_tflops", "hbm_gb", "hbm_tbs", "nvlink_gbs", "inter_node_gbs", "p2p_gbs"):
        if key in hw:
            hw[key] = hw[key] * tp
    hw["name"] = hardware.preset if tp == 1 else f"{hardware.preset}x{tp}"
    name = f"{model['name']}-{hw['name']}"
    precision = "bf16" if getattr(args, "bf16", False) else "fp16" if half else "fp32"
    notes.append(
        f"cost model {name}: first principles from Megatron's flags ({layers} layers, hidden "
        f"{hidden}, {heads} heads / {kv} KV, FFN {ffn}{' SwiGLU' if model['gated'] else ''}, "
        f"vocab {vocab}, {precision}, ZeRO-{training['zero_stage']}"
        f"{_recompute_words(training)}) on {hardware.preset} "
        f"({hardware.how})"
        + (
            f"; a slot of {tp} tensor-parallel GPUs priced as one device of {tp}x the GPU"
            if tp > 1
            else ""
        )
        + "; --hsp-cost-model FILE replaces it"
    )
    return {"name": name, "model": model, "hardware": hw, "training": training}, notes


def spec_label(spec: str | Mapping[str, Any]) -> str:
    """How a cost model is named in messages: the preset/file, or a spec's ``name``."""
    if isinstance(spec, Mapping):
        return str(spec.get("name", "spec"))
    return str(spec)
