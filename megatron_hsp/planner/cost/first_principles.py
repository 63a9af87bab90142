"""First-principles cost model: FLOPs over achievable throughput, bytes over link bandwidth.

Split out of ``costmodel.py``; the names stay importable from
``megatron_hsp.planner.cost.costmodel``.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_hsp.planner.cost.costcore import CostModel
from megatron_hsp.planner.cost.shape import TransformerShape
from megatron_hsp.planner.errors import InputError
from megatron_hsp.planner.groupspace import Cluster, HeadSpace

# FlashAttention counts its backward kernel as 2.5x the forward's FLOPs (five matmuls to two);
# measured backward throughputs are quoted in that convention.
ATTN_BACKWARD_FLOPS = 2.5


@dataclass(frozen=True)
class HardwareConfig:
    """One GPU type in nodes of ``gpus_per_node`` joined by an inter-node fabric.

    The terms below ``inter_node_latency_us`` model what a model built from peak FLOPs and
    link bandwidths misses on real GPUs; their H100 values are fitted to published
    measurements in ``planner.cost.calibration`` (docs/calibration.md). Defaults leave them off,
    so a user's hardware section means what it did before.
    """

    name: str
    peak_tflops: float  # dense bf16 peak per GPU
    achievable_fraction: float = 0.5  # of peak, for token-linear matmuls
    attention_fraction: float | None = None  # of peak, for core attention (None: as above)
    # of peak, for the attention backward kernel, FLOPs counted as 2.5x forward (FlashAttention's
    # convention); None: as ``attention_fraction``.
    attention_bwd_fraction: float | None = None
    hbm_gb: float = 80.0
    nvlink_gbs: float = 450.0  # one direction, per GPU, inside a node
    inter_node_gbs: float = 50.0  # one direction, per GPU, across nodes
    latency_us: float = 10.0  # per collective call inside a node
    inter_node_latency_us: float = 25.0  # per collective call spanning nodes
    gpus_per_node: int = 8
    # Fixed time of one attention kernel call (wave tail, launch, prologue): why a kernel on
    # few tokens runs far below its peak. Efficiency at n tokens per call is F(n) / (F(n) +
    # peak * attention_fraction * overhead), F(n) the call's FLOPs.
    attn_call_overhead_us: float = 0.0
    # Ring attention's non-bandwidth cost per ring step, as effective HBM bytes per attention
    # output element the step touches (merging partial outputs and log-sum-exps, block split,
    # communication kernels' share of SMs). 0: no such cost.
    ring_step_overhead_bytes_per_elem: float = 0.0
    p2p_gbs: float = 0.0  # send/recv bandwidth inside a node (ring hops); 0: nvlink_gbs
    p2p_latency_us: float = 0.0  # per send/recv call inside a node; 0: latency_us
    hbm_tbs: float = 3.35  # HBM bandwidth, TB/s: the optimizer step is memory-bound

    def __post_init__(self) -> None:
        for key in ("peak_tflops", "hbm_gb", "nvlink_gbs", "inter_node_gbs", "hbm_tbs"):
            if float(getattr(self, key)) <= 0:
                raise InputError(f"hardware.{key} must be > 0, got {getattr(self, key)}")
        for key in (
            "attn_call_overhead_us",
            "ring_step_overhead_bytes_per_elem",
            "p2p_gbs",
            "p2p_latency_us",
        ):
            if float(getattr(self, key)) < 0:
                raise InputError(f"hardware.{key} must be >= 0, got {getattr(self, key)}")
        if not 0 < self.achievable_fraction <= 1:
            raise InputError(
                f"hardware.achievable_fraction must be in (0, 1], got {self.achievable_fraction}"
            )

    def bandwidth_gbs(self, crosses_node: bool) -> float:
        return self.inter_node_gbs if crosses_node else self.nvlink_gbs

    def p2p_bandwidth_gbs(self, crosses_node: bool) -> float:
        """Send/recv bandwidth of one ring hop (a ring is as fast as its slowest hop)."""
        if crosses_node:
            return self.inter_node_gbs
        return self.p2p_gbs or self.nvlink_gbs

    def p2p_latency(self, crosses_node: bool) -> float:
        """Latency (us) of one send/recv call."""
        if crosses_node:
            return self.inter_node_latency_us
        return self.p2p_latency_us or self.latency_us

    @property
    def attention_flops(self) -> float:
        """Achievable attention FLOP/s on long kernel calls."""
        return self.peak_tflops * 1e12 * (self.attention_fraction or self.achievable_fraction)

    @property
    def attention_bwd_flops(self) -> float:
        """Achievable attention backward FLOP/s (FLOPs counted as 2.5x the forward's)."""
        if self.attention_bwd_fraction is None:
            return self.attention_flops
        return self.peak_tflops * 1e12 * self.attention_bwd_fraction


@dataclass(frozen=True)
class TrainingConfig:
    """How the model is trained: memory layout and what recomputation costs."""

    zero_stage: int = 3
    # Megatron's activation recomputation, as its flags give it (``recompute_shares``):
    # ``recompute`` is ``--recompute-granularity full`` with ``--recompute-method`` and
    # ``--recompute-num-layers`` (uniform: layers per recomputed chunk, every layer recomputed;
    # block: this many layers of each pipeline stage recomputed, the rest keep their
    # activations); ``recompute_modules`` is ``--recompute-granularity selective``'s
    # ``--recompute-modules`` (the priced ones: ``RECOMPUTE_MODULES``).
    recompute: bool = False
    recompute_method: str = "uniform"
    recompute_num_layers: int = 1
    recompute_modules: tuple[str, ...] = ()
    bytes_per_param: float = 2.0  # bf16 weights
    bytes_per_grad: float = 4.0  # fp32 main grads (Megatron's default accumulation)
    bytes_per_optimizer_state: float = 12.0  # fp32 master weights + Adam m and v
    activation_bytes: float = 2.0  # bf16 activations
    microbatch_overhead_ms: float = 0.0  # launches etc. per group per micro-batch
    # Share of ZeRO-3's per-micro-batch all-gathers / reduce-scatter not hidden behind compute
    # (1.0: none hidden, as FlexSP's large fitted b1 suggests).
    zero3_exposed_fraction: float = 1.0
    # Host-side time per communication or attention call that the GPU waits for: 0 where the
    # CPU runs ahead of the GPU (Megatron, asynchronous launches); 50-100 us in eager PyTorch
    # loops that synchronise per call. Multiplies with layers x micro-batches x ring steps.
    host_call_overhead_us: float = 0.0

    def __post_init__(self) -> None:
        if self.zero_stage not in (0, 1, 2, 3):
            raise InputError(f"training.zero_stage must be 0, 1, 2 or 3, got {self.zero_stage}")
        if self.recompute_method not in ("uniform", "block"):
            raise InputError(
                f"training.recompute_method must be uniform or block, got {self.recompute_method!r}"
            )
        low = 0 if self.recompute_method == "block" else 1
        if isinstance(self.recompute_num_layers, bool) or int(self.recompute_num_layers) < low:
            raise InputError(
                f"training.recompute_num_layers must be an integer >= {low} with "
                f"recompute_method {self.recompute_method}, got {self.recompute_num_layers!r}"
            )
        modules = (
            (self.recompute_modules,)
            if isinstance(self.recompute_modules, str)
            else tuple(self.recompute_modules)
        )
        unknown = sorted(set(modules) - set(RECOMPUTE_MODULES))
        if unknown:
            raise InputError(
                f"training.recompute_modules: {unknown} not priced; priced modules: "
                f"{', '.join(RECOMPUTE_MODULES)}"
            )
        if modules and self.recompute:
            raise InputError(
                "training: recompute (full) and recompute_modules (selective) both set; Megatron "
                "runs one --recompute-granularity"
            )
        object.__setattr__(self, "recompute_modules", tuple(dict.fromkeys(modules)))

    def pass_barrier(self, ranks: int) -> bool:
        """Whether every pass synchronises all ``ranks``: ZeRO-3 all-gathers the parameters and
        reduce-scatters the gradients over every data-parallel rank in each forward/backward;
        ZeRO-0/1/2 accumulate gradients locally and reduce once per step
        (``execution.py``)."""
        return self.zero_stage == 3 and ranks > 1

    def model_state_bytes(self, params: float, shards: int) -> float:
        """Model-state bytes per rank, ZeRO (Rajbhandari et al. 2020, sec. 5, mixed-precision Adam).

        Stage 0 replicates weights, grads and optimizer states; 1 shards the optimizer states;
        2 also the grads; 3 also the weights, each over ``shards`` data-parallel ranks.
        """
        p, g, o = self.bytes_per_param, self.bytes_per_grad, self.bytes_per_optimizer_state
        n = max(1, shards)
        per_param = {
            0: p + g + o,
            1: p + g + o / n,
            2: p + (g + o) / n,
            3: (p + g + o) / n,
        }[self.zero_stage]
        return params * per_param


@dataclass(frozen=True)
class RecomputeShares:
    """What recomputation adds to a step, as shares of the layers (``recompute_shares``).

    full: layers whose whole forward runs again (their linear layers, attention and its
    communication, TP's collectives); attention: layers whose core attention (and the
    sequence-parallel communication inside it) runs again; mlp: layers whose dense MLP alone
    runs again (selective ``mlp``)."""

    full: float = 0.0
    attention: float = 0.0
    mlp: float = 0.0

    @property
    def attention_passes(self) -> float:
        """Forward + backward passes of attention and its collectives (3 with every layer's
        attention recomputed, as before partial recompute was priced)."""
        return 2.0 + self.attention


def recompute_shares(training: TrainingConfig, layers: int) -> RecomputeShares:
    """The shares of a stage of ``layers`` layers that ``training`` recomputes.

    Megatron's ``TransformerBlock._checkpointed_forward``: ``uniform`` checkpoints chunks of
    ``recompute_num_layers`` layers and recomputes every layer; ``block`` recomputes the first
    ``recompute_num_layers`` layers of each pipeline stage and no other. ``selective`` recomputes
    the named submodules in every layer: ``core_attn`` the core attention, ``mlp`` the dense MLP,
    ``layernorm`` the two norms (no matmul: priced as free time)."""
    n = max(1, int(layers))
    if training.recompute:
        k = n if training.recompute_method == "uniform" else min(n, training.recompute_num_layers)
        share = k / n
        return RecomputeShares(full=share, attention=share, mlp=0.0)
    mods = training.recompute_modules
    return RecomputeShares(
        full=0.0,
        attention=1.0 if "core_attn" in mods else 0.0,
        mlp=1.0 if "mlp" in mods else 0.0,
    )


def linear_recompute_factor(
    model: TransformerShape, training: TrainingConfig, pp: int = 1
) -> float:
    """Factor on the token-linear FLOPs (fwd + bwd = 3 forwards) that recomputation adds: a
    recomputed layer's forward once more. Full recompute of every layer is 4/3 on the whole
    linear term (the output layer included, as it was priced before partial recompute: a
    conservative share of a few percent); selective ``mlp`` adds the MLPs' forward."""
    shares = recompute_shares(training, sum(model.stage_layers(pp)))
    extra = shares.full
    if shares.mlp:
        dense, _ = model.stage_layers(pp)
        mlp = 6.0 * dense * model.dense_ffn_params()
        extra += shares.mlp * mlp / model.linear_flops_per_token(pp)
    return 1.0 + extra / 3.0


RECOMPUTE_MODULES = ("core_attn", "layernorm", "mlp")


def activation_bytes_per_token(model: TransformerShape, training: TrainingConfig) -> float:
    """Activation bytes one token keeps alive until its backward pass, on the rank holding it:
    the whole model's layers and output head (``TransformerShape.activation_bytes``). Ulysses
    splits every one of these over the group's ranks, so the group holds s/d per rank."""
    layers, head = model.activation_bytes(training)
    return layers + head


def a2a_bytes_per_token(model: TransformerShape, training: TrainingConfig, d: int) -> float:
    """Bytes of one token that Ulysses all-to-alls move in a Ulysses group of ``d`` (the whole
    model's ``ulysses_bytes_per_token``)."""
    space = HeadSpace(model.heads, model.kv_heads)
    return ulysses_bytes_per_token(space, d, model.layers, model.qk_dim, model.v_dim, training)


def ring_bytes_per_token(model: TransformerShape, training: TrainingConfig, u: int) -> float:
    """Bytes of one token's K/V that one ring step sends (the whole model's
    ``ring_kv_bytes_per_token``)."""
    space = HeadSpace(model.heads, model.kv_heads)
    return ring_kv_bytes_per_token(space, u, model.layers, model.qk_dim, model.v_dim, training)


def ulysses_bytes_per_token(
    heads: HeadSpace, u: int, layers: int, qk_dim: int, v_dim: int, training: TrainingConfig
) -> float:
    """Bytes of one token that one GPU's Ulysses all-to-alls over ``u`` ranks move in a whole
    training step, for its ``heads`` (per TP rank under TP).

    Per layer and pass, four all-to-alls (Jacobs et al. 2023, DeepSpeed-Ulysses): Q (heads),
    K and V (kv heads only, GQA) before attention and the output (heads) after it. Forward and
    backward each run them once, a recomputed forward a third time. KV heads travel with the
    copies the runtime makes (``groupspace.kv_copies``) when ``u`` does not divide them.
    """
    kv = heads.kv_heads * heads.kv_copies(u)
    passes = recompute_shares(training, layers).attention_passes
    return layers * passes * (heads.q_heads + kv) * (qk_dim + v_dim) * training.activation_bytes


def ring_kv_bytes_per_token(
    heads: HeadSpace, u: int, layers: int, qk_dim: int, v_dim: int, training: TrainingConfig
) -> float:
    """Bytes of one token's K/V that one GPU sends per ring step in a whole training step.

    Forward (and a recomputed forward) sends K and V, backward K, V and their gradients; the KV
    heads include the copies Ulysses over ``u`` ranks needs.
    """
    kv = heads.kv_heads * heads.kv_copies(u)
    passes = 1.0 + recompute_shares(training, layers).attention_passes
    return layers * passes * kv * (qk_dim + v_dim) * training.activation_bytes


def step_overhead_ms(
    model: TransformerShape,
    hardware: HardwareConfig,
    training: TrainingConfig,
    world_size: int,
    crosses_node: bool,
) -> dict[str, float]:
    """What a step costs once beyond its micro-batches: gradient reduction and optimizer step.

    Same for every plan of a step, so it never changes which plan is best, but a prediction of
    a step's wall time must add it (``CostModel.step_overhead_ms`` reads ``details.step_ms``).

    - Gradient reduction over the ``world_size`` data-parallel ranks (ring collectives, ``(N-1)/N``
      of the bytes per rank at the slowest tier): ZeRO-0 all-reduces the grads (2x), ZeRO-1/2
      reduce-scatter the grads and all-gather the updated weights; ZeRO-3 does its
      reduce-scatter per micro-batch (``zero3_ms_per_microbatch``), so nothing here.
    - Optimizer: Adam is memory-bound; it reads grads and fp32 states and writes states and bf16
      weights, ``2 * optimizer + grad + param`` bytes per parameter of the rank's shard (ZeRO >= 1
      shards them), at HBM bandwidth.
    """
    reduce_ms, optimizer_ms = grad_and_optimizer_ms(
        model.num_params(), hardware, training, world_size, crosses_node
    )
    return {
        "step_ms": reduce_ms + optimizer_ms,
        "grad_reduce_ms_per_step": reduce_ms,
        "optimizer_ms_per_step": optimizer_ms,
    }


def grad_and_optimizer_ms(
    params: float,
    hardware: HardwareConfig,
    training: TrainingConfig,
    ranks: int,
    crosses_node: bool,
) -> tuple[float, float]:
    """(gradient reduction, optimizer step) in ms for ``params`` weights on each GPU, reduced
    over ``ranks`` data-parallel ranks: the rule of ``step_overhead_ms``, also used per pipeline
    stage and per expert-parallel group by ``parallel.py``."""
    n = max(1, ranks)
    ring = (n - 1) / n
    p, g, o = training.bytes_per_param, training.bytes_per_grad, training.bytes_per_optimizer_state
    bw = hardware.bandwidth_gbs(crosses_node) * 1e9
    reduce_bytes = {0: 2 * g, 1: g + p, 2: g + p, 3: 0.0}[training.zero_stage] * params * ring
    reduce_ms = reduce_bytes / bw * 1e3
    shard = params / n if training.zero_stage >= 1 else params
    optimizer_ms = (2 * o + g + p) * shard / (hardware.hbm_tbs * 1e12) * 1e3
    return reduce_ms, optimizer_ms


def attention_ms_per_token2(
    attn_train_flops_per_token2: float,
    hardware: HardwareConfig,
    training: TrainingConfig,
    layers: int = 1,
) -> float:
    """a1 (ms per token^2) from the training FLOPs of causal core attention per token^2.

    The forward FLOPs (a third of Megatron's training count) at the forward rate, once more when
    recomputed, and the backward kernel's 2.5x forward FLOPs at the backward rate. The one rule
    every first-principles builder uses (this module, ``parallel.py``'s stages)."""
    fwd = attn_train_flops_per_token2 / 3.0
    return (
        fwd * (1.0 + recompute_shares(training, layers).attention) / hardware.attention_flops
        + ATTN_BACKWARD_FLOPS * fwd / hardware.attention_bwd_flops
    ) * 1e3


def attention_calls_ms(
    layers: int, passes: float, hardware: HardwareConfig, training: TrainingConfig
) -> float:
    """Fixed ms of one micro-batch's (or one ring step's) attention kernel calls: one per layer
    and pass, each paying the kernel's call overhead and the host's per-call overhead."""
    return (
        layers * passes * (hardware.attn_call_overhead_us + training.host_call_overhead_us) * 1e-3
    )


def collective_ms(peers_intra: int, peers_inter: int, nbytes: float, hw: HardwareConfig) -> float:
    """One all-to-all's time on one GPU: ``nbytes`` to each peer, intra-node peers over NVLink
    and inter-node peers over the NIC, the two concurrently."""
    return 1e3 * max(
        peers_intra * nbytes / (hw.nvlink_gbs * 1e9),
        peers_inter * nbytes / (hw.inter_node_gbs * 1e9),
    )


@dataclass(frozen=True)
class GroupTerms:
    """The per-group-size terms of a first-principles model, keyed by group size (``CostModel``'s
    ``group_fixed_ms``, ``a2a_ms_per_token``, ``a2a_fixed_ms``, ``ring_step_ms_per_token``,
    ``ring_step_fixed_ms`` and ``ring_step_extra_ms_per_token``; sizes > 1 only for the last
    five), and ``kernel_ms``, a micro-batch's (or a ring step's) attention kernel calls."""

    kernel_ms: float
    fixed: dict[int, float]
    a2a: dict[int, float]
    a2a_fixed: dict[int, float]
    ring: dict[int, float]
    ring_fixed: dict[int, float]
    ring_extra: dict[int, float]


def group_terms(
    cluster: Cluster,
    heads: HeadSpace,
    hardware: HardwareConfig,
    training: TrainingConfig,
    *,
    layers: int,
    microbatch_fixed_ms: float,
    qk_dim: int,
    v_dim: int,
) -> GroupTerms:
    """Every group size's communication and fixed terms, one GPU's view (the one rule both
    first-principles builders use: the whole model here, one pipeline stage in ``parallel.py``).

    ``heads``: this GPU's heads (per TP rank under TP), so its bytes and its attention output
    elements (``heads.q_heads * v_dim`` per layer and pass) are its own, at its own HBM
    bandwidth; ``microbatch_fixed_ms``: what a micro-batch pays besides its attention kernel
    calls. Group of d, run as ``heads.split(d)`` (Ulysses over u, ring over r):

    - fixed: ``microbatch_fixed_ms`` plus one attention kernel call per layer and pass;
    - Ulysses: each GPU holds s/d tokens and sends 1/u of them to every peer
      (``collective_ms``), plus ``4 * layers * passes`` call latencies (inter-node when the group
      spans nodes) and host overheads;
    - ring (priced pure ring, Megatron CP groups too): K/V of the GPU's s/d tokens per step at
      the slowest hop's send/recv bandwidth, ``layers * passes`` p2p call latencies and kernel
      calls more per step, and the non-bandwidth overhead
      (``hardware.ring_step_overhead_bytes_per_elem`` per output element at HBM bandwidth).
    """
    g = cluster.gpus_per_node
    passes = recompute_shares(training, layers).attention_passes
    calls = 4 * layers * passes
    host_ms = training.host_call_overhead_us * 1e-3
    kernel_ms = attention_calls_ms(layers, passes, hardware, training)
    merge_bytes = layers * passes * heads.q_heads * v_dim
    merge_bytes *= hardware.ring_step_overhead_bytes_per_elem
    ring_bytes = ring_kv_bytes_per_token(heads, 1, layers, qk_dim, v_dim, training)
    fixed: dict[int, float] = {}
    a2a: dict[int, float] = {}
    a2a_fixed: dict[int, float] = {}
    ring: dict[int, float] = {}
    ring_fixed: dict[int, float] = {}
    ring_extra: dict[int, float] = {}
    for d in cluster.legal_sizes():
        crosses = cluster.crosses_node(d)
        lat_us = hardware.inter_node_latency_us if crosses else hardware.latency_us
        fixed[d] = microbatch_fixed_ms + kernel_ms
        if d == 1:
            continue
        a2a_fixed[d] = calls * (lat_us * 1e-3 + host_ms)
        ring_fixed[d] = passes * layers * (hardware.p2p_latency(crosses) * 1e-3 + host_ms)
        ring_fixed[d] += kernel_ms
        ring[d] = ring_bytes / d / (hardware.p2p_bandwidth_gbs(crosses) * 1e9) * 1e3
        extra = merge_bytes / d / (hardware.hbm_tbs * 1e12) * 1e3
        if extra > 0:
            ring_extra[d] = extra
        u = heads.split(d)[0]
        a2a[d] = 0.0
        if u > 1:
            per_peer = ulysses_bytes_per_token(heads, u, layers, qk_dim, v_dim, training) / (d * u)
            a2a[d] = collective_ms(min(u, g) - 1, u - min(u, g), per_peer, hardware)
    return GroupTerms(kernel_ms, fixed, a2a, a2a_fixed, ring, ring_fixed, ring_extra)


def first_principles_cost_model(
    model: TransformerShape,
    hardware: HardwareConfig,
    training: TrainingConfig,
    *,
    world_size: int,
    gpus_per_node: int | None = None,
    memory_cap_gb: float | None = None,
    name: str | None = None,
) -> CostModel:
    """Analytic cost model: FLOPs over achievable throughput, bytes over link bandwidth.

    - a1 (ms/token^2) = forward attention FLOPs per s^2 at the forward rate (twice with full
      recompute, in the share of layers whose attention is recomputed: ``recompute_shares``) plus
      2.5x them at the backward rate (``attention_bwd_fraction``, FlashAttention's FLOP
      convention); a2 (ms/token) = linear FLOPs per token / (peak * achievable fraction), times
      ``linear_recompute_factor`` (4/3 with full recompute of every layer). Ulysses divides
      both by d (heads resp. tokens split d ways).
    - c_d (ms/token): each rank holds s/d tokens and sends 1/d of each to every peer, so a peer
      link carries ``bytes_per_token / d^2`` per token; intra-node peers (``min(d,G)-1``) share
      NVLink, inter-node peers (``d - min(d,G)``) the per-GPU NIC, the two running concurrently:
      ``max(intra * x / nvlink, inter * x / nic)``.
    - b_d (ms): per-call latency of the ``4 * layers * passes`` all-to-alls (inter-node latency
      when the group spans nodes), plus, under ZeRO-3, the per-micro-batch parameter all-gathers
      (forward and backward) and gradient reduce-scatter over all ``world_size`` ranks (ring:
      ``bytes * (N-1)/N`` per rank at the slowest tier), plus ``microbatch_overhead_ms``, plus
      the fixed time of the ``layers * passes`` attention kernel calls
      (``hardware.attn_call_overhead_us``: kernel efficiency as a function of tokens per call).
    - Ring steps (r - 1 per micro-batch): K/V p2p at the send/recv bandwidth of the slowest hop,
      hidden behind the step's attention where it can be (``CostModel.seq_ms``); each step also
      pays ``layers * passes`` more attention kernel calls and p2p call latencies
      (``ring_step_fixed_ms``) and a non-bandwidth overhead that nothing hides
      (``ring_step_extra_ms_per_token``: ``hardware.ring_step_overhead_bytes_per_elem`` per
      output element, ``heads * head_dim / d`` elements per token and pass, at HBM bandwidth).
    - Per step (``details.step_ms``, see ``step_overhead_ms``): gradient reduction and optimizer.
    - ``training.host_call_overhead_us`` is added to every call (a2a, p2p, attention kernel).
    - tokens_per_rank = (memory cap - model states by ZeRO stage) / activation bytes per token.
      The memory cap defaults to 90% of HBM (CUDA context, NCCL buffers, fragmentation).

    Every new term is linear in a sequence's tokens or fixed per group and micro-batch, so the
    planner's separable form (``costcore``) holds unchanged. What it cannot say: kernel
    efficiency per *document* inside one varlen call (the public kernel curve is for one
    sequence per call, and it is fitted by a per-call term alone; docs/calibration.md).

    Sizes: every legal size of the cluster, run as ``HeadSpace.split`` says (Ulysses over u
    ranks, ring over r). Ring figures are for pure ring at every size (Megatron CP groups are
    priced by them too); call latencies are kept by split: ``a2a_fixed_ms[u]`` for the
    all-to-alls over u ranks, ``ring_step_fixed_ms[d]`` per ring step.
    """
    if model.moe is not None:
        raise InputError(
            f"model {model.name}: a MoE model is priced per stage with its expert terms by "
            "planner.cost.parallel.model_parallel_cost_model (plan/bench --ep), not as dense"
        )
    g = gpus_per_node or hardware.gpus_per_node
    cluster = Cluster(world_size, g)
    cap_gb = hardware.hbm_gb * 0.9 if memory_cap_gb is None else float(memory_cap_gb)
    recompute = linear_recompute_factor(model, training)
    lin_flops = hardware.peak_tflops * 1e12 * hardware.achievable_fraction
    a1 = attention_ms_per_token2(model.attn_flops_per_token2(), hardware, training, model.layers)
    a2 = model.linear_flops_per_token() * recompute / lin_flops * 1e3

    space = HeadSpace(model.heads, model.kv_heads)
    params = model.num_params()
    zero3_ms = 0.0
    if training.zero_stage == 3 and world_size > 1:
        ring = (world_size - 1) / world_size
        gather = params * training.bytes_per_param * ring
        scatter = params * training.bytes_per_grad * ring
        bw = hardware.bandwidth_gbs(cluster.crosses_node(world_size)) * 1e9
        zero3_ms = (2 * gather + scatter) / bw * 1e3 * training.zero3_exposed_fraction
    terms = group_terms(
        cluster,
        space,
        hardware,
        training,
        layers=model.layers,
        microbatch_fixed_ms=training.microbatch_overhead_ms + zero3_ms,
        qk_dim=model.qk_dim,
        v_dim=model.v_dim,
    )
    states = training.model_state_bytes(params, world_size)
    act = activation_bytes_per_token(model, training)
    cap_bytes = cap_gb * 2**30
    tokens_per_rank = int((cap_bytes - states) / act)
    label = name or f"{model.name}-{hardware.name}"
    if tokens_per_rank <= 0:
        raise InputError(
            f"cost model {label!r}: model states take {states / 2**30:.1f} GiB per rank "
            f"(ZeRO-{training.zero_stage}, {params / 1e9:.2f}B params over {world_size} ranks), "
            f"at or above the memory cap of {cap_gb:g} GB; raise --memory-cap-gb, use more GPUs, "
            "a higher ZeRO stage or a smaller model"
        )
    step = step_overhead_ms(model, hardware, training, world_size, cluster.crosses_node(world_size))
    return CostModel(
        name=label,
        attn_ms_per_token2=a1,
        linear_ms_per_token=a2,
        group_fixed_ms=terms.fixed,
        a2a_ms_per_token=terms.a2a,
        tokens_per_rank=tokens_per_rank,
        source="first principles (megatron_hsp.planner.cost.first_principles)",
        details={
            "params_b": params / 1e9,
            "model_states_mib": states / 2**20,
            "act_mib_per_token": act / 2**20,
            "memory_cap_gb": cap_gb,
            "zero3_ms_per_microbatch": zero3_ms,
            "attn_calls_ms_per_microbatch": terms.kernel_ms,
            **step,
        },
        heads=(space.q_heads, space.kv_heads),
        ring_step_ms_per_token=terms.ring,
        a2a_fixed_ms=terms.a2a_fixed,
        ring_step_fixed_ms=terms.ring_fixed,
        ring_step_extra_ms_per_token=terms.ring_extra,
        pass_barrier=training.pass_barrier(world_size),
    )


H100_SXM = HardwareConfig(
    # Datasheet: bf16 dense peak 989 TFLOP/s, 80 GB HBM3 at 3.35 TB/s. Every other number is
    # fitted to (or taken from) published measurements by ``planner.cost.calibration.fit_h100``, and
    # tests/planner/cost/test_calibration.py keeps them equal to what that fit returns;
    # docs/calibration.md
    # lists each source, the fit set and the check set. ``achievable_fraction`` (linear layers)
    # is the one assumption left: no public bf16 H100 figure in the fit set measures it.
    name="h100",
    peak_tflops=989.0,
    achievable_fraction=0.5,
    attention_fraction=0.6885,  # FA3 causal fwd, 1K and 32K ends of the kernel curve
    attention_bwd_fraction=0.6011,  # Ulysses bwd at CP 8 (MagiAttention)
    hbm_gb=80.0,
    hbm_tbs=3.35,
    # Links, from NCCL maintainers' figures (docs/calibration.md has each issue number):
    nvlink_gbs=370.0,  # NCCL effective on NVLink, large messages
    inter_node_gbs=47.5,  # all-to-all across nodes runs at one NIC's rate, 46-49 GB/s
    p2p_gbs=130.0,  # 2-GPU send/recv 80-180 GB/s: midpoint
    latency_us=10.5,  # 8-GPU all-to-all, small messages
    p2p_latency_us=3.5,  # send/recv 3-3.7 us
    inter_node_latency_us=46.0,  # 2-node all-reduce, small messages
    attn_call_overhead_us=36.1,  # FA3 at 1K tokens: 280 TFLOP/s (kernel curve)
    ring_step_overhead_bytes_per_elem=55.0,  # ring fwd at CP 8, 8K/GPU: 420 TFLOP/s
    gpus_per_node=8,
)
# Llama 3 shapes from Meta's released configs (config.json of Meta-Llama-3-8B / -70B).
LLAMA3_8B = TransformerShape("llama3-8b", 32, 4096, 32, 8, 14336, 128256, gated=True)
LLAMA3_70B = TransformerShape("llama3-70b", 80, 8192, 64, 8, 28672, 128256, gated=True)

FIRST_PRINCIPLES_PRESETS: dict[str, tuple[TransformerShape, HardwareConfig, TrainingConfig]] = {
    # Megatron's distributed optimizer (ZeRO-1, ``--use-distributed-optimizer``): what Megatron
    # users run, and the only data-parallel setup Megatron's dynamic CP and hsp's integration
    # accept (both refuse Megatron-FSDP). Passes are then not barriers and a pass's fixed cost
    # is its kernel calls and latencies; the gradient reduction is paid once per step.
    "llama3-8b-h100": (LLAMA3_8B, H100_SXM, TrainingConfig(zero_stage=1, recompute=False)),
    # 70B activations are ~24 MiB/token without recompute: full recompute is how it is trained.
    # ZeRO-3: without tensor parallelism ZeRO-1's states (6.2 bytes per parameter, 430 GB) do
    # not fit an 80 GB GPU; with --tp/--pp the stage model (``parallel.py``) runs ZeRO-1.
    "llama3-70b-h100": (LLAMA3_70B, H100_SXM, TrainingConfig(zero_stage=3, recompute=True)),
}
