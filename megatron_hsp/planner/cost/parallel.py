"""A stage cost model for tensor, pipeline and expert parallelism (dense or MoE), first principles.

``costmodel.first_principles_cost_model`` prices a dense model whose every GPU is one
sequence-parallel slot. With TP x PP (x EP) the planner's slots are the data x context plane of
one pipeline stage: ``plane = gpus / (tp * pp)`` slots, each a TP group of ``tp`` GPUs, and
every stage runs the same plan (``planner/cost/pipeline.py``). ``model_parallel_cost_model`` builds
the ``CostModel`` of one such stage, by the same rules as ``first_principles_cost_model`` (it
reproduces that model's coefficients exactly for a dense model at tp = pp = ep = 1, which
``tests/planner/cost/test_parallel_costmodel.py`` pins), changed where TP, PP and MoE change them:

- **Stage.** ``ceil(layers / pp)`` layers plus the output layer (logits): the heaviest stage
  (Megatron's last), so every stage is priced as that one (conservative for the others).
  MoE layers first when the stage could hold dense or MoE layers (also the heavier choice).
- **TP** (Megatron, sequence parallel on): matmul and attention FLOPs split over ``tp`` GPUs;
  activations per GPU are ``1/tp`` of the slot's; each layer and pass runs two all-gathers and
  two reduce-scatters of the slot's hidden states inside the node, priced exposed (no
  ``--tp-comm-overlap``): ``4 * passes * layers * (tp - 1)/tp * h * 2 bytes`` per token over
  NVLink, added to the linear term, plus their call latencies to the fixed term. Ulysses and the
  ring run per TP rank on its own heads (``groupspace.HeadSpace.from_model``: ``heads / tp`` query
  heads, ``max(kv, tp) / tp`` KV heads), each GPU through its own link; a node holds
  ``gpus_per_node / tp`` slots, so with TP = 8 every multi-slot group crosses nodes.
- **PP**: memory holds the schedule's in-flight micro-batches (``pipeline.microbatch_token_
  capacity``): ``tokens_per_rank`` is per micro-batch. Model states are the stage's. ZeRO-3 is
  not combined with PP in Megatron, so a preset at ZeRO-3 runs its pipeline with the
  distributed optimizer (stage 1), said in ``source``.
- **MoE** (``planner/cost/moe.py``): active-parameter FLOPs, expert weights over ``ep`` (and TP),
  their optimizer states over ``plane / ep``, dispatch all-to-all over ``ep`` slots per MoE layer
  and pass (``ep <= plane``; inside a node while ``ep <= gpus_per_node / tp``).

What it does not price: load imbalance between experts, pipeline stages of unequal cost, TP
communication overlap, MoE grouped-GEMM efficiency below dense matmuls. All are the same for
every plan of a batch except through the linear term's size.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from megatron_hsp.planner.cost.costmodel import (
    FIRST_PRINCIPLES_PRESETS,
    H100_SXM,
    CostModel,
    HardwareConfig,
    TrainingConfig,
    load_cost_model,
    validate_cost_model,
)
from megatron_hsp.planner.cost.first_principles import (
    attention_ms_per_token2,
    collective_ms,
    grad_and_optimizer_ms,
    group_terms,
    linear_recompute_factor,
    recompute_shares,
)
from megatron_hsp.planner.cost.moe import DEEPSEEK_V2_LITE_MOE, QWEN3_30B_A3B_MOE
from megatron_hsp.planner.cost.pipeline import (
    BACKWARD_SHARE,
    PipelineSpec,
    microbatch_token_capacity,
)
from megatron_hsp.planner.cost.shape import TransformerShape
from megatron_hsp.planner.errors import InputError
from megatron_hsp.planner.groupspace import Cluster, HeadSpace
from megatron_hsp.planner.run_spec import check_degrees, check_tp_in_node


@dataclass(frozen=True)
class ParallelConfig:
    """Megatron's model-parallel degrees; the plane (DP x CP) is what the planner plans."""

    tp: int = 1
    pp: int = 1
    vpp: int = 1
    ep: int = 1

    def __post_init__(self) -> None:
        for key in ("tp", "pp", "vpp", "ep"):
            if int(getattr(self, key)) < 1:
                raise InputError(f"--{key} must be >= 1, got {getattr(self, key)}")
        PipelineSpec(self.pp, self.vpp)  # checks vpp against pp

    @property
    def is_default(self) -> bool:
        return (self.tp, self.pp, self.vpp, self.ep) == (1, 1, 1, 1)

    def plane(self, gpus: int) -> int:
        """Sequence-parallel slots of one stage: ``gpus / (tp * pp)`` (``run_spec``'s rule)."""
        return check_degrees(gpus, self.tp, self.pp)

    def plane_gpus_per_node(self, gpus_per_node: int) -> int:
        """Slots per node: ``gpus_per_node / tp`` (``run_spec``'s rule: TP inside a node)."""
        return check_tp_in_node(gpus_per_node, self.tp)


def _backward_share(training: TrainingConfig, layers: int) -> float:
    """Backward share of a stage's forward+backward: forward 1, backward 2 plus the recomputed
    forward's share of the layers (``BACKWARD_SHARE`` 2/3 without, 3/4 with every layer)."""
    f = recompute_shares(training, layers).full
    return (2.0 + f) / (3.0 + f)


def _tp_and_expert_comm(
    a2: float,
    shape: TransformerShape,
    hardware: HardwareConfig,
    training: TrainingConfig,
    parallel: ParallelConfig,
    gp: int,
) -> tuple[float, float, float]:
    """(linear term with TP's and MoE dispatch's exposed traffic added, TP's and MoE's fixed
    latency per micro-batch) of one stage whose node holds ``gp`` slots (module docstring)."""
    tp, ep = parallel.tp, parallel.ep
    passes = 2.0 + recompute_shares(training, sum(shape.stage_layers(parallel.pp))).full
    e = training.activation_bytes
    _, moe_l = shape.stage_layers(parallel.pp)
    n_layers = sum(shape.stage_layers(parallel.pp))
    lat_intra, lat_inter = hardware.latency_us * 1e-3, hardware.inter_node_latency_us * 1e-3
    # TP (sequence parallel): 2 all-gathers + 2 reduce-scatters per layer and pass, in the node.
    tp_fixed = 0.0
    if tp > 1:
        tp_bytes = 4 * passes * n_layers * (tp - 1) / tp * shape.hidden * e
        a2 += tp_bytes / (hardware.nvlink_gbs * 1e9) * 1e3
        tp_fixed = 4 * passes * n_layers * lat_intra
    # MoE dispatch: 2 all-to-alls per MoE layer and pass over ep slots (per GPU: 1/tp of them).
    ep_fixed = 0.0
    if shape.moe is not None and ep > 1 and moe_l:
        per_peer = shape.moe.top_k * shape.hidden * e / tp / ep
        intra = min(ep, gp) - 1
        inter = ep - min(ep, gp)
        a2 += 2 * passes * moe_l * collective_ms(intra, inter, per_peer, hardware)
        ep_fixed = 2 * passes * moe_l * (lat_inter if inter else lat_intra)
    return a2, tp_fixed, ep_fixed


def _zero3_ms(
    base_params: float,
    expert_params: float,
    hardware: HardwareConfig,
    training: TrainingConfig,
    parallel: ParallelConfig,
    cluster: Cluster,
) -> float:
    """ZeRO-3's exposed weight gathers and gradient reduce-scatters per micro-batch over the
    plane's slots (0 below ZeRO-3 or on one slot)."""
    plane = cluster.world_size
    if training.zero_stage != 3 or plane <= 1:
        return 0.0
    tp, ep = parallel.tp, parallel.ep
    ring = (plane - 1) / plane
    per_gpu = (base_params / tp + expert_params / (ep * tp)) * ring
    bw = hardware.bandwidth_gbs(cluster.crosses_node(plane)) * 1e9
    return (
        (2 * per_gpu * training.bytes_per_param + per_gpu * training.bytes_per_grad)
        / bw
        * 1e3
        * training.zero3_exposed_fraction
    )


def model_parallel_cost_model(
    shape: TransformerShape,
    hardware: HardwareConfig,
    training: TrainingConfig,
    parallel: ParallelConfig,
    *,
    gpus: int,
    gpus_per_node: int | None = None,
    memory_cap_gb: float | None = None,
    name: str | None = None,
) -> CostModel:
    """The cost model of one pipeline stage's data x context plane (module docstring).

    Times per slot (a TP group), memory per GPU; ``tokens_per_rank`` is per micro-batch under
    the schedule's in-flight rule. ``details`` carries ``pp``/``vpp``/``tp``/``ep``, the backward
    share and the per-boundary p2p time the pipeline pricing reads (``pipeline_spec_for``).
    """
    g = gpus_per_node or hardware.gpus_per_node
    tp, pp, ep = parallel.tp, parallel.pp, parallel.ep
    plane = parallel.plane(gpus)
    gp = parallel.plane_gpus_per_node(g)
    cluster = Cluster(plane, gp)
    if shape.moe is None and ep > 1:
        raise InputError(f"--ep {ep} needs a MoE model; {shape.name} is dense")
    if ep > plane or plane % ep:
        raise InputError(f"--ep {ep} must divide the {plane} data x context slots of a stage")
    notes = []
    if pp > 1 and training.zero_stage == 3:
        training = dataclasses.replace(training, zero_stage=1)
        notes.append("ZeRO-3 is not combined with PP in Megatron: distributed optimizer (1)")
    spec = PipelineSpec(pp, parallel.vpp)
    cap_gb = hardware.hbm_gb * 0.9 if memory_cap_gb is None else float(memory_cap_gb)
    recompute = linear_recompute_factor(shape, training, pp)
    e = training.activation_bytes
    lin_flops = hardware.peak_tflops * 1e12 * hardware.achievable_fraction * tp
    # The same attention rule as first_principles_cost_model, over the stage's layers; TP's
    # tp GPUs share the heads.
    stage = sum(shape.stage_layers(pp))
    a1 = attention_ms_per_token2(shape.attn_flops_per_token2(pp), hardware, training, stage) / tp
    a2 = shape.linear_flops_per_token(pp) * recompute / lin_flops * 1e3
    dense_l, moe_l = shape.stage_layers(pp)
    n_layers = dense_l + moe_l
    lat_inter = hardware.inter_node_latency_us * 1e-3
    a2, tp_fixed, ep_fixed = _tp_and_expert_comm(a2, shape, hardware, training, parallel, gp)
    heads = HeadSpace.from_model(shape.heads, shape.kv_heads, tp)
    base_params, expert_params = shape.params(pp)
    zero3_ms = _zero3_ms(base_params, expert_params, hardware, training, parallel, cluster)
    # The calibrated terms of first_principles_cost_model, per stage and per GPU of a slot (its
    # heads / tp): attention kernel calls, host overhead per call, the ring hop's send/recv
    # bandwidth and latency, the ring's non-bandwidth overhead per output element.
    terms = group_terms(
        cluster,
        heads,
        hardware,
        training,
        layers=n_layers,
        microbatch_fixed_ms=training.microbatch_overhead_ms + zero3_ms + tp_fixed + ep_fixed,
        qk_dim=shape.qk_dim,
        v_dim=shape.v_dim,
    )
    states = training.model_state_bytes(base_params / tp, plane)
    states += training.model_state_bytes(expert_params / (ep * tp), plane // ep)
    layer_act, head_act = shape.activation_bytes(training, pp)
    avail = cap_gb * 2**30 - states
    tokens = microbatch_token_capacity(avail, layer_act / tp, head_act / tp, spec)
    label = name or f"{shape.name}-{hardware.name}"
    if tokens <= 0:
        raise InputError(
            f"cost model {label!r}: model states take {states / 2**30:.1f} GiB per GPU "
            f"(tp {tp}, pp {pp}, ep {ep}, ZeRO-{training.zero_stage} over {plane} slots), at or "
            f"above the memory cap of {cap_gb:g} GB; raise --memory-cap-gb, --tp, --pp or --ep"
        )
    # One activation p2p between stages: a full slot's hidden states, per GPU 1/tp of them.
    hop_ms = 0.0
    if pp > 1:
        hop_bytes = tokens * shape.hidden * e / tp
        hop_ms = lat_inter + hop_bytes / (hardware.inter_node_gbs * 1e9) * 1e3
    # Per step, after the last backward (the heaviest stage, every stage at once): the dense
    # weights' gradients over the plane's slots, the experts' over their expert-data-parallel
    # group (plane / ep slots), each GPU its 1/tp (1/(ep tp)) share; then the optimizer.
    crosses = cluster.crosses_node(plane)
    dense_reduce, dense_opt = grad_and_optimizer_ms(
        base_params / tp, hardware, training, plane, crosses
    )
    expert_reduce, expert_opt = grad_and_optimizer_ms(
        expert_params / (ep * tp), hardware, training, plane // ep, crosses
    )
    step = {
        "step_ms": dense_reduce + expert_reduce + dense_opt + expert_opt,
        "grad_reduce_ms_per_step": dense_reduce + expert_reduce,
        "optimizer_ms_per_step": dense_opt + expert_opt,
    }
    source = (
        f"first principles, tp {tp} pp {pp} vpp {parallel.vpp} ep {ep} (planner/cost/parallel.py)"
    )
    if notes:
        source += "; " + "; ".join(notes)
    return validate_cost_model(
        CostModel(
            name=label,
            attn_ms_per_token2=a1,
            linear_ms_per_token=a2,
            group_fixed_ms=terms.fixed,
            a2a_ms_per_token=terms.a2a,
            tokens_per_rank=tokens,
            source=source,
            # A pipeline schedule meets every stage once per micro-batch: each pass is a barrier.
            pass_barrier=pp > 1 or training.pass_barrier(plane),
            details={
                "params_b": (base_params + expert_params) / 1e9,
                "active_params_b": shape.active_params_b(),
                "model_states_mib": states / 2**20,
                "act_mib_per_token": (layer_act + head_act) / tp / 2**20,
                "memory_cap_gb": cap_gb,
                "zero3_ms_per_microbatch": zero3_ms,
                "tp": float(tp),
                "pp": float(pp),
                "vpp": float(parallel.vpp),
                "ep": float(ep),
                "peak_in_flight": spec.peak_in_flight(),
                "backward_share": _backward_share(training, stage),
                "pp_hop_ms": hop_ms,
                **step,
            },
            heads=(heads.q_heads, heads.kv_heads),
            ring_step_ms_per_token=terms.ring,
            a2a_fixed_ms=terms.a2a_fixed,
            ring_step_fixed_ms=terms.ring_fixed,
            ring_step_extra_ms_per_token=terms.ring_extra,
        )
    )


def pipeline_spec_for(cost: CostModel, pp: int, vpp: int = 1) -> PipelineSpec:
    """The pipeline the stage model ``cost`` was built for, refusing a mismatch.

    A model not built for this pipeline would price whole-model micro-batches with one
    micro-batch in flight: refused by name rather than priced wrongly.
    """
    built = (int(cost.details.get("pp", 1)), int(cost.details.get("vpp", 1)))
    if built != (pp, vpp):
        raise InputError(
            f"cost model {cost.name!r} prices pp {built[0]} vpp {built[1]}, not pp {pp} vpp {vpp}; "
            "build it with planner.cost.parallel.load_parallel_cost_model (plan/bench --pp/--vpp)"
        )
    return PipelineSpec(
        pp,
        vpp,
        backward_share=float(cost.details.get("backward_share", BACKWARD_SHARE)),
        hop_ms=float(cost.details.get("pp_hop_ms", 0.0)),
    )


# ---------------------------------------------------------------------- presets
QWEN3_30B_A3B = TransformerShape(
    # Qwen/Qwen3-30B-A3B config.json (planner/cost/moe.py docstring).
    name="qwen3-30b-a3b",
    layers=48,
    hidden=2048,
    heads=32,
    kv_heads=4,
    head_dim=128,
    ffn_hidden=6144,
    vocab=151936,
    moe=QWEN3_30B_A3B_MOE,
)
DEEPSEEK_V2_LITE = TransformerShape(
    # deepseek-ai/DeepSeek-V2-Lite config.json; MLA: q_proj h x 16*192, kv_a_proj h x (512+64),
    # kv_b_proj 512 x 16*(128+128), o_proj 16*128 x h, plus the 512-wide kv norm.
    name="deepseek-v2-lite",
    layers=27,
    hidden=2048,
    heads=16,
    kv_heads=16,
    head_dim=192,
    v_head_dim=128,
    ffn_hidden=10944,
    vocab=102400,
    moe=DEEPSEEK_V2_LITE_MOE,
    attn_params_per_layer=2048 * 16 * 192 + 2048 * 576 + 512 * 16 * 256 + 16 * 128 * 2048 + 512,
)
# Long-context MoE training keeps full recomputation (top-k copies multiply activations).
MOE_TRAINING = TrainingConfig(zero_stage=1, recompute=True)
PARALLEL_PRESETS: dict[str, tuple[TransformerShape, HardwareConfig, TrainingConfig]] = {
    "qwen3-30b-a3b-h100": (QWEN3_30B_A3B, H100_SXM, MOE_TRAINING),
    "deepseek-v2-lite-h100": (DEEPSEEK_V2_LITE, H100_SXM, MOE_TRAINING),
}


def parallel_preset_names() -> list[str]:
    return sorted(PARALLEL_PRESETS)


def needs_parallel_builder(spec: Any, parallel: ParallelConfig) -> bool:
    """Whether ``spec`` must go through ``load_parallel_cost_model`` rather than the plain one."""
    return not parallel.is_default or (isinstance(spec, str) and spec in PARALLEL_PRESETS)


def load_parallel_cost_model(
    spec: str,
    parallel: ParallelConfig,
    *,
    gpus: int,
    gpus_per_node: int = 8,
    memory_cap_gb: float | None = None,
) -> tuple[CostModel, Cluster]:
    """(stage cost model, the plane's cluster) for a preset under ``parallel``.

    MoE presets (``PARALLEL_PRESETS``) and the first-principles dense presets
    (``costmodel.FIRST_PRINCIPLES_PRESETS``) can be split; FlexSP's fitted presets and spec files
    cannot (their fits know no TP, PP or experts): refused with the presets that can.
    """
    if spec in PARALLEL_PRESETS:
        shape, hw, tr = PARALLEL_PRESETS[spec]
    elif spec in FIRST_PRINCIPLES_PRESETS:
        shape, hw, tr = FIRST_PRINCIPLES_PRESETS[spec]
    else:
        can = sorted([*PARALLEL_PRESETS, *FIRST_PRINCIPLES_PRESETS])
        raise InputError(
            f"--cost-model {spec!r} cannot be split by --tp/--pp/--vpp/--ep (a fitted or file "
            f"model knows no stages or experts); use one of {can}"
        )
    cost = model_parallel_cost_model(
        shape, hw, tr, parallel, gpus=gpus, gpus_per_node=gpus_per_node,
        memory_cap_gb=memory_cap_gb, name=spec,
    )  # fmt: skip
    plane = Cluster(parallel.plane(gpus), parallel.plane_gpus_per_node(gpus_per_node))
    return cost, plane


def load_any_cost_model(
    spec: str,
    parallel: ParallelConfig,
    *,
    gpus: int,
    gpus_per_node: int,
    max_seq_k: float,
    memory_cap_gb: float | None,
) -> tuple[CostModel, Cluster]:
    """``load_cost_model`` when nothing is split, ``load_parallel_cost_model`` otherwise."""
    if needs_parallel_builder(spec, parallel):
        return load_parallel_cost_model(
            spec, parallel, gpus=gpus, gpus_per_node=gpus_per_node, memory_cap_gb=memory_cap_gb
        )
    cluster = Cluster(gpus, gpus_per_node)
    cost = load_cost_model(
        spec,
        world_size=gpus,
        gpus_per_node=gpus_per_node,
        max_seq_k=max_seq_k,
        memory_cap_gb=memory_cap_gb,
    )
    return cost, cluster


__all__ = [
    "DEEPSEEK_V2_LITE",
    "PARALLEL_PRESETS",
    "QWEN3_30B_A3B",
    "ParallelConfig",
    "TransformerShape",
    "load_any_cost_model",
    "load_parallel_cost_model",
    "model_parallel_cost_model",
    "parallel_preset_names",
    "pipeline_spec_for",
]
