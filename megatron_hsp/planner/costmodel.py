"""Cost model: time and memory of a sequence-parallel group, as the planner sees them.

Every model, fitted (FlexSP presets) or first-principles, reduces to the same separable form, which
is what lets the MILP stay linear:

    group_ms(lengths, d, (u, r)) = sum_i [ (a1 * s_i^2 + a2 * s_i) / d + c_{d,u} * s_i
                                           + (r - 1) * max(0, p_{d,u} * s_i - a1 * s_i^2 / (d r)) ]
                                   + b_{d,u,r}
    fits(lengths, d)     = sum_i s_i / d <= tokens_per_rank

a1: attention (quadratic) ms per token^2 on one rank; a2: linear-layer ms per token;
c_{d,u}: Ulysses all-to-all ms per token over u ranks of a group of d (0 for u = 1; depends on the
network tier); p_{d,u}: one ring step's K/V p2p ms per token, hidden behind the attention block it
overlaps; b: fixed ms per group per micro-batch (kernel launches, call latencies of the split, the
optimizer-free per-pass overhead FlexSP fits as b1); tokens_per_rank: activation capacity left on a
rank after model states, under the memory cap. (u, r) defaults to ``HeadSpace.split`` (what hsp's
runtime executes); Megatron's CP baselines are the same formula at (1, d).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from megatron_hsp.planner.errors import InputError
from megatron_hsp.planner.groupspace import Cluster, HeadSpace, kv_copies
from megatron_hsp.planner.units import MAX_TOKENS


@dataclass(frozen=True)
class CostModel:
    """Resolved coefficients for one cluster, model and max sequence length."""

    name: str
    attn_ms_per_token2: float
    linear_ms_per_token: float
    group_fixed_ms: Mapping[int, float]
    a2a_ms_per_token: Mapping[int, float]
    tokens_per_rank: int
    # For reports: how the numbers were obtained, memory figures in bytes.
    source: str = ""
    details: Mapping[str, float] = field(default_factory=dict)
    # Query/KV heads per tensor-parallel rank; None: unknown model, every group pure Ulysses.
    heads: tuple[int, int] | None = None
    # Ring attention: ms per token of a sequence for one ring step's K/V p2p in a group of d run
    # as pure ring (u = 1), for every size d > 1; a split with Ulysses over u scales it by the KV
    # copies Ulysses needs (``groupspace.kv_copies``). See ``seq_ms``.
    ring_step_ms_per_token: Mapping[int, float] = field(default_factory=dict)
    # Latency (ms per micro-batch) of a group's collective calls, charged by split: all its
    # all-to-alls when Ulysses runs over u ranks (keyed by u), and one ring step's p2p calls
    # (keyed by the group size, paid r - 1 times). Empty: folded into ``group_fixed_ms``.
    a2a_fixed_ms: Mapping[int, float] = field(default_factory=dict)
    ring_step_fixed_ms: Mapping[int, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.tokens_per_rank <= 0:
            raise InputError(
                f"cost model {self.name!r}: model states fill the memory cap, leaving no room for "
                "activations; raise the memory cap (--memory-cap-gb), use more GPUs (ZeRO shards "
                "states over them) or a smaller model"
            )

    # ------------------------------------------------------------------ sizes
    @property
    def sizes(self) -> list[int]:
        """Group sizes this model has numbers for."""
        return sorted(set(self.a2a_ms_per_token) | {1})

    def _a2a(self, d: int, u: int) -> float:
        """All-to-all ms per token of a group of ``d`` whose Ulysses degree is ``u``.

        ``a2a_ms_per_token[d]`` is cached for the default split; any other ``u`` is the pure
        Ulysses group of ``u`` scaled by ``u / d`` (each rank then holds s/d tokens, not s/u),
        which is exactly how both builders derive the default figure.
        """
        if u == 1:
            return 0.0
        if u == self.split(d)[0] and d in self.a2a_ms_per_token:
            return self.a2a_ms_per_token[d]
        if u in self.a2a_ms_per_token and self.split(u) == (u, 1):
            return self.a2a_ms_per_token[u] * u / d
        raise InputError(
            f"cost model {self.name!r} has no all-to-all figure for Ulysses over {u} ranks in a "
            f"group of {d}; known sizes: {self.sizes}"
        )

    def _ring_step(self, d: int, u: int) -> float:
        """ms per token of one ring step in a group of ``d`` with Ulysses over ``u``."""
        try:
            step = self.ring_step_ms_per_token[d]
        except KeyError:
            raise InputError(
                f"cost model {self.name!r} has no ring_step_ms_per_token figure for group size "
                f"{d} (known: {sorted(self.ring_step_ms_per_token)}); add "
                "coefficients.ring_step_ms_per_token for every size > 1"
            ) from None
        hs = self.head_space()
        return step * (hs.kv_copies(u) if hs is not None else 1)

    def head_space(self, max_ring: int | None = None) -> HeadSpace | None:
        """The model's heads as ``groupspace.HeadSpace`` (None when this model knows none)."""
        if self.heads is None:
            return None
        q, kv = self.heads
        return HeadSpace(q, kv) if max_ring is None else HeadSpace(q, kv, max_ring)

    def split(self, d: int) -> tuple[int, int]:
        """(ulysses, ring) degrees a group of ``d`` runs with (pure Ulysses without heads)."""
        hs = self.head_space()
        return (d, 1) if hs is None else hs.split(d)

    def recorded_split(self, d: int) -> tuple[int, int]:
        """(ulysses, ring) for ``Group``'s fields: (0, 0) when the model's heads are unknown."""
        return self.split(d) if self.heads is not None else (0, 0)

    def _fixed(self, d: int) -> float:
        g = self.group_fixed_ms
        return g[d] if d in g else g.get(0, 0.0)

    def _resolve(self, d: int, split: tuple[int, int] | None) -> tuple[int, int]:
        """``split`` checked against ``d`` (default: ``self.split(d)``)."""
        if split is None:
            return self.split(d)
        u, r = int(split[0]), int(split[1])
        if u < 1 or r < 1 or u * r != d:
            raise InputError(
                f"split ulysses {u} x ring {r} does not multiply to group size {d}; "
                f"the default split of {d} is {self.split(d)}"
            )
        return u, r

    # ------------------------------------------------------------------ time
    def seq_ms(
        self,
        lengths: np.ndarray | Sequence[int],
        d: int,
        split: tuple[int, int] | None = None,
        ring: str = "overlap",
    ) -> np.ndarray:
        """Per-sequence time (ms) in a group of ``d`` run as ``split`` = (u, r), without b_d.

        The one pricing rule for every group, hsp's or a baseline's (Megatron CP is split
        ``(1, d)``): compute ``(a1 s^2 + a2 s)/d``, all-to-all over u ranks (zero when u = 1),
        and r - 1 ring steps, each moving one K/V block while the rank computes attention on the
        previous one (attn / r per step), so only the excess of transfer over compute shows.
        ``ring`` is a sensitivity knob for baselines only: "overlap" (this rule, the default),
        "hidden" (ring traffic free) or "exposed" (none of it overlapped).
        """
        u, r = self._resolve(d, split)
        s = np.asarray(lengths, dtype=np.float64)
        attn = self.attn_ms_per_token2 * s * s / d
        out = attn + self.linear_ms_per_token * s / d + self._a2a(d, u) * s
        if r > 1 and ring != "hidden":
            step = self._ring_step(d, u) * s
            if ring == "overlap":
                out = out + (r - 1) * np.maximum(0.0, step - attn / r)
            elif ring == "exposed":
                out = out + (r - 1) * step
            else:
                raise InputError(f"ring pricing {ring!r}: use overlap, hidden or exposed")
        return out

    def group_ms(
        self,
        lengths: np.ndarray | Sequence[int],
        d: int,
        split: tuple[int, int] | None = None,
        ring: str = "overlap",
    ) -> float:
        """Time (ms) of one group of ``d`` ranks training ``lengths`` in one micro-batch."""
        return float(self.seq_ms(lengths, d, split, ring).sum()) + self.fixed_ms(d, split)

    @property
    def step_overhead_ms(self) -> float:
        """What a step costs once beyond its micro-batches (gradient all-reduce, optimizer step)
        where a profile measured it (``details.step_ms``), else 0. Not part of any plan's
        ``est_step_ms``: it is the same for every plan of a step, so it never changes which plan
        is best, but a prediction of the step's wall time must add it."""
        return float(self.details.get("step_ms", 0.0))

    def fixed_ms(self, d: int, split: tuple[int, int] | None = None) -> float:
        """Fixed ms per group per micro-batch: b_d plus the latency of the split's calls."""
        u, r = self._resolve(d, split)
        out = self._fixed(d)
        if u > 1:
            out += self.a2a_fixed_ms.get(u, 0.0)
        if r > 1:
            out += (r - 1) * self.ring_step_fixed_ms.get(d, 0.0)
        return out

    # ------------------------------------------------------------------ memory
    def capacity(self, d: int) -> int:
        """Most tokens a group of ``d`` ranks can hold in one micro-batch."""
        return self.tokens_per_rank * d

    def fits(self, lengths: Sequence[int], group_size: int) -> bool:
        return sum(int(x) for x in lengths) <= self.capacity(group_size)

    def min_group_size(self, length: int, sizes: Sequence[int]) -> int | None:
        """Smallest size in ``sizes`` whose group can hold one sequence of ``length``."""
        need = math.ceil(length / self.tokens_per_rank)
        fitting = [d for d in sorted(sizes) if d >= need]
        return fitting[0] if fitting else None

    def max_trainable_length(self, sizes: Sequence[int] | None = None) -> int:
        """Longest single sequence any group of ``sizes`` (default: all known sizes) can hold."""
        return self.capacity(max(sizes if sizes else self.sizes))

    # ------------------------------------------------------------------ serialisation
    def to_spec(self) -> dict[str, Any]:
        """The explicit-coefficients spec (see ``load_cost_model``) that rebuilds this model.

        Round trip: ``load_cost_model(m.to_spec(), ...) == m`` for any cluster arguments, because
        the coefficients are already resolved for one cluster.
        """
        return {
            "name": self.name,
            "coefficients": {
                "attn_ms_per_token2": self.attn_ms_per_token2,
                "linear_ms_per_token": self.linear_ms_per_token,
                "group_fixed_ms": {int(k): float(v) for k, v in self.group_fixed_ms.items()},
                "a2a_ms_per_token": {int(k): float(v) for k, v in self.a2a_ms_per_token.items()},
                "tokens_per_rank": int(self.tokens_per_rank),
                **({"heads": list(self.heads)} if self.heads else {}),
                **{
                    key: {int(k): float(v) for k, v in getattr(self, key).items()}
                    for key in ("ring_step_ms_per_token", "a2a_fixed_ms", "ring_step_fixed_ms")
                    if getattr(self, key)
                },
            },
            "source": self.source,
            "details": {k: float(v) for k, v in self.details.items()},
        }


# ---------------------------------------------------------------------- FlexSP fitted presets
# Source: PKU-DAIR/Hetu-Galvatron, branch flexsp, galvatron/flexsp_solver/solver.py
# (``optimizer_param_dict`` and ``flexSPCostModel``), as quoted in docs/design.md section 4.
# a1 in ms/token^2, a2 in ms/token, b1 in ms, activations in MiB/token, params in billions keyed by
# max-seq in K (FlexSP interpolates linearly between 192 and 384 for other lengths).
FLEXSP_FITS: dict[str, dict[str, Any]] = {
    "flexsp-gpt-7b": {
        "heads": 32,  # FlexSP's GPT configs: MHA, head_dim 128
        "layers": 32,
        "hidden": 4096,
        "a1": 5.128e-6,
        "a2": 183.9576e-3,
        "b1": 629.3563,
        "act_mib_per_token": 4.480441895,
        "params_b": {4: 6.51, 192: 7.1174468994140625, 384: 7.8498687744140625},
    },
    "flexsp-gpt-13b": {
        "heads": 40,  # FlexSP's GPT configs: MHA, head_dim 128
        "layers": 40,
        "hidden": 5120,
        "a1": 9.2852e-6,
        "a2": 306.0189e-3,
        "b1": 1132.5632,
        "act_mib_per_token": 4.220439453,
        "params_b": {4: 12.3568, 192: 13.11605453491211, 384: 14.03158187866211},
    },
    "flexsp-gpt-30b": {
        "heads": 52,  # FlexSP's GPT configs: MHA, head_dim 128
        "layers": 60,
        "hidden": 6656,
        "a1": 15.4262e-6,
        "a2": 803.5742e-3,
        "b1": 2789.3644,
        "act_mib_per_token": 3.417381836,
        "params_b": {4: 30.538, 192: 31.52513885498047, 384: 32.71532440185547},
    },
}
# All-to-all bandwidth by group size, "4k seq, 2 IB" figures FlexSP uses (8 GPUs per node).
FLEXSP_A2A_GBS: dict[int, float] = {2: 119.54, 4: 104.07, 8: 96.5, 16: 10.33, 32: 5.94, 64: 4.87}
# FlexSP's solver.py defaults --memory_limit_gb to 28, but its published runs
# (scripts/solver_all.sh) pass 30, and only 30 reproduces its static-64 (68.50 s) and batchada
# (55.38 s) totals on Wikipedia / gpt-7b / 192k / 64 GPUs / GBS 512 / batches 0-9 (28 GB gives
# 69.13 s and 55.62 s). See docs/costmodel.md.
FLEXSP_DEFAULT_MEMORY_CAP_GB = 30.0


def flexsp_params_b(fit: Mapping[str, Any], max_seq_k: float) -> float:
    """Parameter count (billions) at ``max_seq_k`` (positional embeddings grow with max-seq).

    FlexSP's ``__main__``: exact table entry if present, else the line through 192K and 384K.
    """
    table = {float(k): float(v) for k, v in fit["params_b"].items()}
    if float(max_seq_k) in table:
        return table[float(max_seq_k)]
    lo, hi = table[192.0], table[384.0]
    return (hi - lo) / 192 * (max_seq_k - 192) + lo


def flexsp_bandwidth(bw: Mapping[int, float], d: int) -> float:
    """All-to-all bandwidth (GB/s) FlexSP's table gives a group of ``d``.

    FlexSP measured powers of two only. A size it did not measure (24, 40, 48, 56, ... with 8
    GPUs per node, or anything above its largest entry) takes the bandwidth of the smallest
    measured size at least as large, else of the largest measured one: per-GPU all-to-all
    bandwidth falls as a group grows, so this never makes an unmeasured size look cheaper than
    its measured neighbours.
    """
    if d in bw:
        return float(bw[d])
    larger = [k for k in bw if k >= d]
    return float(bw[min(larger)] if larger else bw[max(bw)])


def flexsp_cost_model(
    name: str,
    world_size: int,
    max_seq_k: float = 192,
    memory_cap_gb: float | None = None,
    a2a_gbs: Mapping[int, float] | None = None,
    gpus_per_node: int = 8,
    fit: Mapping[str, Any] | None = None,
    as_published: bool = False,
) -> CostModel:
    """FlexSP's fitted model, reproduced term for term (ZeRO-3, mixed precision).

    With the fit's ``heads`` (FlexSP's GPT configs, MHA) every group runs the executable
    Ulysses x ring split (``groupspace.HeadSpace.split``): all-to-all over u ranks at the
    bandwidth of u, plus ring steps (``CostModel.seq_ms``). ``as_published`` drops the heads and
    prices every size as pure Ulysses, exactly as FlexSP's solver does; that reproduces its
    figures (static-64 68.50 s) but includes groups the runtime cannot run (Ulysses over 64
    ranks with 32 heads), so its plans are not executable.

    Formulas (``flexSPCostModel`` in FlexSP's solver.py):

    - compute: ``(a1*s^2 + a2*s)/d`` ms per sequence plus ``b1`` once per group per micro-batch;
    - all-to-all: ``4*2*layers*hidden*s*2 / 2**20 / d / BW_d`` ms (bytes / MiB / ms arithmetic
      exactly as FlexSP writes it), zero for ``d = 1``;
    - memory: ZeRO-3 states ``params_b * 16 * 1024 / N`` MiB plus ``act_mib_per_token * s/d``;
      ``tokens_per_rank = int((cap_gb*1024 - states_mib) / act_mib_per_token)`` (its
      ``token_capacity``).

    Sizes: every legal size of ``Cluster(world_size, gpus_per_node)``; unmeasured sizes get
    bandwidths as ``flexsp_bandwidth`` explains. ``fit`` costs a user's own FlexSP-style fit.
    """
    if fit is None:
        if name not in FLEXSP_FITS:
            raise InputError(f"unknown FlexSP preset {name!r}; choose from {sorted(FLEXSP_FITS)}")
        fit = FLEXSP_FITS[name]
    cap = FLEXSP_DEFAULT_MEMORY_CAP_GB if memory_cap_gb is None else float(memory_cap_gb)
    layers, hidden = int(fit["layers"]), int(fit["hidden"])
    bw = {int(k): float(v) for k, v in (a2a_gbs or fit.get("a2a_gbs") or FLEXSP_A2A_GBS).items()}
    cluster = Cluster(world_size, gpus_per_node)
    heads = int(fit["heads"]) if "heads" in fit and not as_published else None
    space = HeadSpace(heads, heads) if heads else None
    sizes = [d for d in cluster.legal_sizes() if d > 1]
    a2a_bytes_per_token = 4 * 2 * layers * hidden * 2
    # Ring step (pure ring, every size: Megatron CP groups are priced by the same figure): K and
    # V (MHA, bf16) of the rank's s/d tokens, once forward, and K/V plus their gradients
    # backward, per layer; at the size-2 (NVLink) bandwidth inside a node, the two-node figure
    # when the ring crosses nodes (its slowest hop sets the pace). MHA: no KV copies for any u.
    ring_bytes_per_token = 3 * layers * 2 * hidden * 2
    a2a: dict[int, float] = {}
    ring: dict[int, float] = {}
    for d in sizes:
        u = space.split(d)[0] if space else d
        a2a[d] = a2a_bytes_per_token / 2**20 / d / flexsp_bandwidth(bw, u) if u > 1 else 0.0
        hop = flexsp_bandwidth(bw, 2 if not cluster.crosses_node(d) else 2 * gpus_per_node)
        ring[d] = ring_bytes_per_token / 2**20 / d / hop
    params_b = flexsp_params_b(fit, max_seq_k)
    model_states_mib = params_b * 16 * 1024 / world_size
    act = float(fit["act_mib_per_token"])
    tokens_per_rank = int((cap * 1024 - model_states_mib) / act)
    return CostModel(
        name=name,
        attn_ms_per_token2=float(fit["a1"]),
        linear_ms_per_token=float(fit["a2"]),
        group_fixed_ms={0: float(fit["b1"])},
        a2a_ms_per_token=a2a,
        tokens_per_rank=tokens_per_rank,
        source="FlexSP fitted model (Hetu-Galvatron flexsp branch, solver.py)",
        details={
            "params_b": params_b,
            "model_states_mib": model_states_mib,
            "act_mib_per_token": act,
            "memory_cap_gb": cap,
        },
        heads=(heads, heads) if heads else None,
        ring_step_ms_per_token=ring,
    )


# ---------------------------------------------------------------------- first principles
@dataclass(frozen=True)
class ModelConfig:
    """A dense decoder-only transformer (GPT / Llama family)."""

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn_hidden: int
    vocab: int
    gated: bool = True  # SwiGLU: three FFN matrices instead of two
    tied_embeddings: bool = False

    def __post_init__(self) -> None:
        for key in ("layers", "hidden", "heads", "kv_heads", "ffn_hidden", "vocab"):
            if int(getattr(self, key)) <= 0:
                raise InputError(
                    f"model.{key} must be a positive integer, got {getattr(self, key)}"
                )
        if self.hidden % self.heads:
            raise InputError(f"model.hidden {self.hidden} is not divisible by heads {self.heads}")
        if self.heads % self.kv_heads:
            raise InputError(
                f"model.heads {self.heads} is not a multiple of kv_heads {self.kv_heads}"
            )

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    def num_params(self) -> int:
        """Weights: QKV, O, FFN and two RMSNorms per layer, final norm, embeddings (+ output)."""
        h, f = self.hidden, self.ffn_hidden
        per_layer = h * (h + 2 * self.kv_dim) + h * h + (3 if self.gated else 2) * h * f + 2 * h
        emb = self.vocab * h * (1 if self.tied_embeddings else 2)
        return self.layers * per_layer + h + emb

    def linear_flops_per_token(self) -> float:
        """Training FLOPs (fwd + bwd) of every token-linear matmul, per token.

        Megatron-LM ``num_floating_point_operations`` (megatron/training/training.py): 2 FLOPs
        per multiply-add, backward = 2x forward, so 6 * (weights touched per token): QKV and
        output projections, FFN (3 matrices with SwiGLU), and the logit layer.
        """
        h, f = self.hidden, self.ffn_hidden
        attn = h * (self.hidden + 2 * self.kv_dim) + self.hidden * h
        ffn = (3 if self.gated else 2) * h * f
        return 6.0 * (self.layers * (attn + ffn) + h * self.vocab)

    def attn_flops_per_token2(self) -> float:
        """Training FLOPs of causal core attention per token^2 of one sequence.

        Same Megatron-LM source: per layer ``3 (fwd+bwd) * 2 (FMA) * heads*head_dim / 2 (causal)
        * 2 (QK^T and PV)`` = ``6 * hidden`` per s^2. K/V heads do not enter: every query head
        attends over the full sequence whether or not its KV head is shared (GQA).
        """
        return 6.0 * self.layers * self.heads * self.head_dim


@dataclass(frozen=True)
class HardwareConfig:
    """One GPU type in nodes of ``gpus_per_node`` joined by an inter-node fabric."""

    name: str
    peak_tflops: float  # dense bf16 peak per GPU
    achievable_fraction: float = 0.5  # of peak, for token-linear matmuls
    attention_fraction: float | None = None  # of peak, for core attention (None: as above)
    hbm_gb: float = 80.0
    nvlink_gbs: float = 450.0  # one direction, per GPU, inside a node
    inter_node_gbs: float = 50.0  # one direction, per GPU, across nodes
    latency_us: float = 10.0  # per collective call inside a node
    inter_node_latency_us: float = 25.0  # per collective call spanning nodes
    gpus_per_node: int = 8

    def __post_init__(self) -> None:
        for key in ("peak_tflops", "hbm_gb", "nvlink_gbs", "inter_node_gbs"):
            if float(getattr(self, key)) <= 0:
                raise InputError(f"hardware.{key} must be > 0, got {getattr(self, key)}")
        if not 0 < self.achievable_fraction <= 1:
            raise InputError(
                f"hardware.achievable_fraction must be in (0, 1], got {self.achievable_fraction}"
            )

    def bandwidth_gbs(self, crosses_node: bool) -> float:
        return self.inter_node_gbs if crosses_node else self.nvlink_gbs


@dataclass(frozen=True)
class TrainingConfig:
    """How the model is trained: memory layout and what recomputation costs."""

    zero_stage: int = 3
    recompute: bool = False  # full activation recomputation (Megatron --recompute-granularity full)
    bytes_per_param: float = 2.0  # bf16 weights
    bytes_per_grad: float = 4.0  # fp32 main grads (Megatron's default accumulation)
    bytes_per_optimizer_state: float = 12.0  # fp32 master weights + Adam m and v
    activation_bytes: float = 2.0  # bf16 activations
    microbatch_overhead_ms: float = 0.0  # launches etc. per group per micro-batch
    # Share of ZeRO-3's per-micro-batch all-gathers / reduce-scatter not hidden behind compute
    # (1.0: none hidden, as FlexSP's large fitted b1 suggests).
    zero3_exposed_fraction: float = 1.0

    def __post_init__(self) -> None:
        if self.zero_stage not in (0, 1, 2, 3):
            raise InputError(f"training.zero_stage must be 0, 1, 2 or 3, got {self.zero_stage}")

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


def activation_bytes_per_token(model: ModelConfig, training: TrainingConfig) -> float:
    """Activation bytes one token keeps alive until its backward pass, on the rank holding it.

    Per layer (no recompute), following Korthikanti et al. 2022 ("Reducing Activation
    Recomputation in Large Transformer Models", sec. 4) with flash attention (no s^2 scores),
    no dropout (Llama) and GQA/SwiGLU shapes: norm-1 input h, QKV input h, Q/K/V
    (h + 2*kv_dim), attention output h, softmax log-sum-exp (fp32, one per head), norm-2 input h,
    FC1 input h, FC1 output (2F gated / F), activation output F. With full recompute a layer
    keeps only its input h, plus one layer's full set while it is recomputed. Once per token: the
    logits in bf16 and the fp32 softmax that Megatron's cross-entropy keeps (6 * vocab bytes).
    Ulysses splits every one of these over the group's ranks, so the group holds s/d per rank.
    """
    e = training.activation_bytes
    h, f = model.hidden, model.ffn_hidden
    per_layer = (
        e * (h + h + (h + 2 * model.kv_dim) + h + h + h + f * (2 if model.gated else 1) + f)
        + 4.0 * model.heads
    )
    logits = 6.0 * model.vocab + e * h
    if training.recompute:
        return model.layers * e * h + per_layer + logits
    return model.layers * per_layer + logits


def a2a_bytes_per_token(model: ModelConfig, training: TrainingConfig, d: int) -> float:
    """Bytes of one token that Ulysses all-to-alls move in a Ulysses group of ``d``.

    Per layer and pass, four all-to-alls (Jacobs et al. 2023, DeepSpeed-Ulysses): Q (heads),
    K and V (kv heads only, GQA) before attention and the output (heads) after it. Forward and
    backward each run them once, a recomputed forward a third time. KV heads travel with the
    copies the runtime makes (``groupspace.kv_copies``) when ``d`` does not divide them.
    """
    kv_heads = model.kv_heads * kv_copies(model.heads, model.kv_heads, d)
    elems = (2 * model.heads + 2 * kv_heads) * model.head_dim
    passes = 3 if training.recompute else 2
    return model.layers * passes * elems * training.activation_bytes


def ring_bytes_per_token(model: ModelConfig, training: TrainingConfig, u: int) -> float:
    """Bytes of one token's K/V that one ring step sends (whole training step, all layers).

    Forward (and a recomputed forward) sends K and V, backward K, V and their gradients; the KV
    heads include the copies Ulysses over ``u`` ranks needs.
    """
    kv_heads = model.kv_heads * kv_copies(model.heads, model.kv_heads, u)
    passes = 4 if training.recompute else 3
    return model.layers * passes * 2 * kv_heads * model.head_dim * training.activation_bytes


def first_principles_cost_model(
    model: ModelConfig,
    hardware: HardwareConfig,
    training: TrainingConfig,
    *,
    world_size: int,
    gpus_per_node: int | None = None,
    memory_cap_gb: float | None = None,
    name: str | None = None,
) -> CostModel:
    """Analytic cost model: FLOPs over achievable throughput, bytes over link bandwidth.

    - a1 (ms/token^2) = attention FLOPs per s^2 / (peak * attention fraction); a2 (ms/token) =
      linear FLOPs per token / (peak * achievable fraction). Full recompute adds one forward,
      i.e. multiplies both by 4/3. Ulysses divides both by d (heads resp. tokens split d ways).
    - c_d (ms/token): each rank holds s/d tokens and sends 1/d of each to every peer, so a peer
      link carries ``bytes_per_token / d^2`` per token; intra-node peers (``min(d,G)-1``) share
      NVLink, inter-node peers (``d - min(d,G)``) the per-GPU NIC, the two running concurrently:
      ``max(intra * x / nvlink, inter * x / nic)``.
    - b_d (ms): per-call latency of the ``4 * layers * passes`` all-to-alls (inter-node latency
      when the group spans nodes), plus, under ZeRO-3, the per-micro-batch parameter all-gathers
      (forward and backward) and gradient reduce-scatter over all ``world_size`` ranks (ring:
      ``bytes * (N-1)/N`` per rank at the slowest tier), plus ``microbatch_overhead_ms``.
    - tokens_per_rank = (memory cap - model states by ZeRO stage) / activation bytes per token.
      The memory cap defaults to 90% of HBM (CUDA context, NCCL buffers, fragmentation).

    Sizes: every legal size of the cluster, run as ``HeadSpace.split`` says (Ulysses over u
    ranks, ring over r); a ring step's K/V p2p shows only where it outlasts the attention block
    it overlaps (``CostModel.seq_ms``). Ring figures are for pure ring at every size (Megatron CP
    groups are priced by them too); call latencies are kept by split: ``a2a_fixed_ms[u]`` for the
    all-to-alls over u ranks, ``ring_step_fixed_ms[d]`` = 2 * layers p2p latencies per step.
    """
    g = gpus_per_node or hardware.gpus_per_node
    cluster = Cluster(world_size, g)
    cap_gb = hardware.hbm_gb * 0.9 if memory_cap_gb is None else float(memory_cap_gb)
    recompute = 4.0 / 3.0 if training.recompute else 1.0
    lin_flops = hardware.peak_tflops * 1e12 * hardware.achievable_fraction
    attn_frac = hardware.attention_fraction or hardware.achievable_fraction
    attn_flops = hardware.peak_tflops * 1e12 * attn_frac
    a1 = model.attn_flops_per_token2() * recompute / attn_flops * 1e3
    a2 = model.linear_flops_per_token() * recompute / lin_flops * 1e3

    space = HeadSpace(model.heads, model.kv_heads)
    sizes = cluster.legal_sizes()
    ring_ms: dict[int, float] = {}
    passes = 3 if training.recompute else 2
    calls = 4 * model.layers * passes
    a2a: dict[int, float] = {}
    fixed: dict[int, float] = {}
    params = float(model.num_params())
    zero3_ms = 0.0
    if training.zero_stage == 3 and world_size > 1:
        ring = (world_size - 1) / world_size
        gather = params * training.bytes_per_param * ring
        scatter = params * training.bytes_per_grad * ring
        bw = hardware.bandwidth_gbs(cluster.crosses_node(world_size)) * 1e9
        zero3_ms = (2 * gather + scatter) / bw * 1e3 * training.zero3_exposed_fraction
    a2a_fixed: dict[int, float] = {}
    ring_fixed: dict[int, float] = {}
    for d in sizes:
        crosses = cluster.crosses_node(d)
        lat_us = hardware.inter_node_latency_us if crosses else hardware.latency_us
        fixed[d] = training.microbatch_overhead_ms + zero3_ms
        if d == 1:
            continue
        a2a_fixed[d] = calls * lat_us * 1e-3
        ring_fixed[d] = 2 * model.layers * lat_us * 1e-3
        # One ring step, pure ring: each rank passes its s/d tokens' K/V to the next ring rank.
        nbytes = ring_bytes_per_token(model, training, 1) / d
        ring_ms[d] = nbytes / (hardware.bandwidth_gbs(crosses) * 1e9) * 1e3
        u = space.split(d)[0]
        # Ulysses over u contiguous ranks, each holding s/d tokens and sending 1/u to each peer.
        per_peer = a2a_bytes_per_token(model, training, u) / (d * u) if u > 1 else 0.0
        intra = min(u, g) - 1
        inter = u - min(u, g)
        t = max(
            intra * per_peer / (hardware.nvlink_gbs * 1e9),
            inter * per_peer / (hardware.inter_node_gbs * 1e9),
        )
        a2a[d] = t * 1e3
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
    return CostModel(
        name=label,
        attn_ms_per_token2=a1,
        linear_ms_per_token=a2,
        group_fixed_ms=fixed,
        a2a_ms_per_token=a2a,
        tokens_per_rank=tokens_per_rank,
        source="first principles (megatron_hsp.planner.costmodel.first_principles_cost_model)",
        details={
            "params_b": params / 1e9,
            "model_states_mib": states / 2**20,
            "act_mib_per_token": act / 2**20,
            "memory_cap_gb": cap_gb,
            "zero3_ms_per_microbatch": zero3_ms,
        },
        heads=(space.q_heads, space.kv_heads),
        ring_step_ms_per_token=ring_ms,
        a2a_fixed_ms=a2a_fixed,
        ring_step_fixed_ms=ring_fixed,
    )


H100_SXM = HardwareConfig(
    # docs/design.md sec. 4: bf16 dense peak 989 TFLOP/s; NVLink 4 900 GB/s bidirectional per GPU
    # (450 each way); NDR InfiniBand 400 Gb/s = 50 GB/s per GPU; 80 GB HBM3.
    name="h100",
    peak_tflops=989.0,
    achievable_fraction=0.5,
    attention_fraction=0.4,
    hbm_gb=80.0,
    nvlink_gbs=450.0,
    inter_node_gbs=50.0,
    latency_us=10.0,
    inter_node_latency_us=25.0,
    gpus_per_node=8,
)
# Llama 3 shapes from Meta's released configs (config.json of Meta-Llama-3-8B / -70B).
LLAMA3_8B = ModelConfig("llama3-8b", 32, 4096, 32, 8, 14336, 128256, gated=True)
LLAMA3_70B = ModelConfig("llama3-70b", 80, 8192, 64, 8, 28672, 128256, gated=True)

FIRST_PRINCIPLES_PRESETS: dict[str, tuple[ModelConfig, HardwareConfig, TrainingConfig]] = {
    "llama3-8b-h100": (LLAMA3_8B, H100_SXM, TrainingConfig(zero_stage=3, recompute=False)),
    # 70B activations are ~24 MiB/token without recompute: full recompute is how it is trained.
    "llama3-70b-h100": (LLAMA3_70B, H100_SXM, TrainingConfig(zero_stage=3, recompute=True)),
}


# ---------------------------------------------------------------------- one spec, one loader
def preset_names() -> list[str]:
    return sorted([*FLEXSP_FITS, *FIRST_PRINCIPLES_PRESETS])


_TOP_KEYS = {
    "preset",
    "name",
    "memory_cap_gb",
    "max_seq_k",
    "flexsp",
    "coefficients",
    "model",
    "hardware",
    "training",
    "source",
    "details",
}


# A cost model is a few hundred bytes; this bounds what a hostile file can make the parser do.
MAX_SPEC_BYTES = 1 << 20


def _no_duplicates(pairs: list[tuple[Any, Any]]) -> dict:
    out: dict = {}
    for key, value in pairs:
        if key in out:
            raise InputError(f"key {key!r} appears twice (the last would silently win)")
        out[key] = value
    return out


def _strict_json(text: str) -> Any:
    import json

    return json.loads(text, object_pairs_hook=_no_duplicates)


def _strict_yaml(text: str) -> Any:
    """YAML without duplicate keys and without anchors or aliases: a 500-byte file of nested
    aliases expands to billions of nodes (issue 18's hang), and a cost model needs none."""
    import yaml

    for event in yaml.parse(text, Loader=yaml.SafeLoader):
        if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None):
            raise InputError("YAML anchors and aliases are not allowed in a cost model")

    class StrictLoader(yaml.SafeLoader):
        def construct_mapping(self, node: Any, deep: bool = False) -> dict:
            self.flatten_mapping(node)
            return _no_duplicates(
                [
                    (self.construct_object(k, deep=deep), self.construct_object(v, deep=deep))
                    for k, v in node.value
                ]
            )

    return yaml.load(text, Loader=StrictLoader)


def _read_spec_file(path: Path) -> Mapping[str, Any]:
    if not path.is_file():
        raise InputError(f"--cost-model file {str(path)!r} does not exist")
    if path.stat().st_size > MAX_SPEC_BYTES:
        raise InputError(
            f"--cost-model file {str(path)!r} is {path.stat().st_size} bytes; a cost model is "
            f"at most {MAX_SPEC_BYTES} bytes"
        )
    text = path.read_text()
    try:
        data = _strict_json(text) if path.suffix == ".json" else _strict_yaml(text)
    except InputError as exc:
        raise InputError(f"--cost-model file {str(path)!r}: {exc}") from None
    except Exception as exc:  # parser errors: name the file, first line of the message only
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise InputError(
            f"--cost-model file {str(path)!r} is not valid YAML/JSON: {first}"
        ) from None
    if not isinstance(data, Mapping):
        raise InputError(f"--cost-model file {str(path)!r} must hold a mapping at top level")
    return data


def _dataclass_from(cls: type, section: str, data: Mapping[str, Any], **defaults: Any) -> Any:
    allowed = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - allowed)
    if unknown:
        raise InputError(
            f"cost model spec: unknown {section} keys {unknown}; allowed: {sorted(allowed)}"
        )
    try:
        return cls(**{**defaults, **dict(data)})
    except TypeError as exc:
        raise InputError(f"cost model spec: {section} section: {exc}") from None


def _size_map(value: Any, key: str) -> dict[int, float]:
    if isinstance(value, int | float):
        return {0: float(value)}
    if not isinstance(value, Mapping):
        raise InputError(f"cost model spec: coefficients.{key} must be a number or {{size: ms}}")
    return {int(k): float(v) for k, v in value.items()}


def _from_coefficients(name: str, co: Mapping[str, Any], cap_gb: float | None) -> CostModel:
    allowed = {
        "attn_ms_per_token2",
        "linear_ms_per_token",
        "group_fixed_ms",
        "a2a_ms_per_token",
        "a2a_bytes_per_token",
        "a2a_gbs",
        "tokens_per_rank",
        "model_states_gb",
        "act_mib_per_token",
        "heads",
        "ring_step_ms_per_token",
        "a2a_fixed_ms",
        "ring_step_fixed_ms",
    }
    unknown = sorted(set(co) - allowed)
    if unknown:
        raise InputError(
            f"cost model spec: unknown coefficients keys {unknown}; allowed: {sorted(allowed)}"
        )
    for key in ("attn_ms_per_token2", "linear_ms_per_token"):
        if key not in co:
            raise InputError(f"cost model spec: coefficients.{key} is required")
    if "a2a_ms_per_token" in co:
        a2a = {
            k: v for k, v in _size_map(co["a2a_ms_per_token"], "a2a_ms_per_token").items() if k > 1
        }
    elif "a2a_bytes_per_token" in co and "a2a_gbs" in co:
        # FlexSP-style: bytes / d at the measured bandwidth of d (GB/s = bytes/ns -> ms).
        nbytes = float(co["a2a_bytes_per_token"])
        bw = {int(k): float(v) for k, v in co["a2a_gbs"].items()}
        a2a = {d: nbytes / d / (b * 1e9) * 1e3 for d, b in bw.items() if d > 1}
    else:
        raise InputError(
            "cost model spec: coefficients need a2a_ms_per_token ({size: ms per token}) or "
            "a2a_bytes_per_token plus a2a_gbs ({size: GB/s})"
        )
    if "tokens_per_rank" in co:
        raw = co["tokens_per_rank"]
        if isinstance(raw, bool) or (isinstance(raw, float) and not raw.is_integer()):
            raise InputError(
                f"cost model spec: tokens_per_rank must be a whole number of tokens, got {raw!r}"
            )
        tokens = int(raw)
    elif "model_states_gb" in co and "act_mib_per_token" in co:
        if cap_gb is None:
            raise InputError("cost model spec: memory_cap_gb is needed with model_states_gb")
        tokens = int(
            (cap_gb * 1024 - float(co["model_states_gb"]) * 1024) / float(co["act_mib_per_token"])
        )
    else:
        raise InputError(
            "cost model spec: coefficients need tokens_per_rank, or model_states_gb plus "
            "act_mib_per_token (with memory_cap_gb)"
        )
    return CostModel(
        name=name,
        attn_ms_per_token2=float(co["attn_ms_per_token2"]),
        linear_ms_per_token=float(co["linear_ms_per_token"]),
        group_fixed_ms=_size_map(co.get("group_fixed_ms", 0.0), "group_fixed_ms"),
        a2a_ms_per_token=a2a,
        tokens_per_rank=tokens,
        source="explicit coefficients",
        heads=_heads(co.get("heads")),
        **{
            key: {k: v for k, v in _size_map(co.get(key, {}), key).items() if k > 1}
            for key in ("ring_step_ms_per_token", "a2a_fixed_ms", "ring_step_fixed_ms")
        },
    )


# ------------------------------------------------------------------ validation
# Spec leaves that are text or flags rather than numbers; every other leaf must be a finite number.
_TEXT_KEYS = {"name", "preset", "source"}
_BOOL_KEYS = {"gated", "tied_embeddings", "recompute"}
# Numbers that may be zero (a free attention term, no fixed cost); the rest must be > 0.
_MAY_BE_ZERO = {
    "attn_ms_per_token2",
    "group_fixed_ms",
    "a2a_ms_per_token",
    "ring_step_ms_per_token",
    "a2a_fixed_ms",
    "ring_step_fixed_ms",
    "b1",
    "a1",
    "latency_us",
    "inter_node_latency_us",
    "microbatch_overhead_ms",
    "zero_stage",
    "model_states_gb",
    "details",
}


def _check_spec_numbers(data: Mapping[str, Any], where: str = "") -> None:
    """Reject strings, NaN, infinities and negatives anywhere in a spec before it is used.

    Why: a bad leaf otherwise surfaces far away (a ``ValueError`` traceback, a NaN that makes
    every schedule infeasible, a negative cost the solver chases forever). The message names
    the field by its dotted path and says what would work.
    """
    for key, value in data.items():
        path = f"{where}.{key}" if where else str(key)
        base = where.split(".")[0] if where else str(key)
        if str(key) == "name" or (not where and str(key) in _TEXT_KEYS):
            continue
        if isinstance(value, Mapping):
            _check_spec_numbers(value, path)
            continue
        if isinstance(value, list | tuple):
            # [query, kv] heads: each a positive number; ``_heads`` checks the pairing.
            _check_spec_numbers({f"{i}": v for i, v in enumerate(value)}, path)
            continue
        if str(key) in _BOOL_KEYS:
            if not isinstance(value, bool):
                raise InputError(f"cost model spec: {path} = {value!r} must be true or false")
            continue
        # {size: value} maps (a2a_gbs, params_b, ...) take their rule from the map's own name.
        leaf = where.split(".")[-1] if where and str(key).lstrip("-").isdigit() else str(key)
        if isinstance(value, bool) or not isinstance(value, int | float):
            hint = ""
            if isinstance(value, str) and value.strip().lstrip("+-")[:1].isdigit():
                hint = " (YAML 1.1 reads 1e-6 as text: write 1.0e-6)"
            raise InputError(f"cost model spec: {path} = {value!r} must be a number{hint}")
        if not math.isfinite(value):
            raise InputError(f"cost model spec: {path} = {value!r} must be a finite number")
        zero_ok = leaf in _MAY_BE_ZERO or base in _MAY_BE_ZERO
        if value < 0 or (value == 0 and not zero_ok):
            want = ">= 0" if zero_ok else "> 0"
            raise InputError(f"cost model spec: {path} = {value!r} must be {want}")


def validate_cost_model(model: CostModel) -> CostModel:
    """Check a resolved model: every coefficient finite, times positive, sizes sensible.

    Why here and not only on the spec: presets and first-principles models are derived, and a
    derived coefficient can still come out zero or negative (e.g. a tiny memory cap). The planner
    relies on ``linear_ms_per_token > 0`` (a plan's time grows with its tokens, so its lower
    bound holds and the search terminates) and on non-negative attention, fixed and all-to-all
    terms.
    """
    name = model.name

    def bad(field_: str, value: object, want: str) -> InputError:
        return InputError(f"cost model {name!r}: {field_} = {value!r}; it must be {want}")

    for field_, value, zero_ok in (
        ("attn_ms_per_token2", model.attn_ms_per_token2, True),
        ("linear_ms_per_token", model.linear_ms_per_token, False),
    ):
        v = float(value)
        if not math.isfinite(v) or v < 0 or (v == 0 and not zero_ok):
            raise bad(field_, value, "a finite number " + (">= 0" if zero_ok else "> 0"))
    for field_, mapping in (
        ("group_fixed_ms", model.group_fixed_ms),
        ("a2a_ms_per_token", model.a2a_ms_per_token),
        ("ring_step_ms_per_token", model.ring_step_ms_per_token),
        ("a2a_fixed_ms", model.a2a_fixed_ms),
        ("ring_step_fixed_ms", model.ring_step_fixed_ms),
    ):
        for d, v in mapping.items():
            if not isinstance(d, int) or d < 0:
                raise bad(f"{field_} key", d, "a group size (integer >= 1, or 0 for all sizes)")
            if not math.isfinite(float(v)) or float(v) < 0:
                raise bad(f"{field_}[{d}]", v, "a finite number >= 0")
    if not model.a2a_ms_per_token and not isinstance(model.a2a_ms_per_token, Mapping):
        raise bad("a2a_ms_per_token", model.a2a_ms_per_token, "a {size: ms per token} mapping")
    if not 0 < int(model.tokens_per_rank) <= MAX_TOKENS:
        raise bad("tokens_per_rank", model.tokens_per_rank, f"between 1 and {MAX_TOKENS:.0e}")
    return model


def _heads(value: Any) -> tuple[int, int] | None:
    """``coefficients.heads``: [query, kv] heads per tensor-parallel rank, or absent."""
    if value is None:
        return None
    try:
        q, kv = (int(x) for x in value)
        HeadSpace(q, kv)
    except (TypeError, ValueError) as exc:
        raise InputError(
            f"cost model spec: coefficients.heads must be [query heads, kv heads] per "
            f"tensor-parallel rank with kv dividing query, got {value!r} ({exc})"
        ) from None
    return q, kv


def load_cost_model(
    spec: str | Path | Mapping[str, Any],
    *,
    world_size: int,
    gpus_per_node: int = 8,
    max_seq_k: float = 192,
    memory_cap_gb: float | None = None,
) -> CostModel:
    """The one way to get a ``CostModel``: preset name, YAML/JSON file, or a mapping.

    Every input is checked (``_check_spec_numbers`` on the spec, ``validate_cost_model`` on the
    result); any problem is an :class:`InputError` naming the field. See ``_load_unchecked`` for
    the spec shapes.
    """
    if memory_cap_gb is not None:
        v = float(memory_cap_gb)
        if not math.isfinite(v) or v <= 0:
            raise InputError(
                f"--memory-cap-gb must be a positive number of GB, got {memory_cap_gb}"
            )
    if isinstance(spec, Mapping):
        _check_spec_numbers(spec)
    try:
        model = _load_unchecked(
            spec,
            world_size=world_size,
            gpus_per_node=gpus_per_node,
            max_seq_k=max_seq_k,
            memory_cap_gb=memory_cap_gb,
        )
    except InputError:
        raise
    except (TypeError, ValueError, KeyError, OverflowError, ZeroDivisionError) as exc:
        raise InputError(
            f"--cost-model {spec if isinstance(spec, str | Path) else 'spec'}: cannot be used: "
            f"{type(exc).__name__}: {exc}"
        ) from None
    return validate_cost_model(model)


def _load_unchecked(
    spec: str | Path | Mapping[str, Any],
    *,
    world_size: int,
    gpus_per_node: int = 8,
    max_seq_k: float = 192,
    memory_cap_gb: float | None = None,
) -> CostModel:
    """The one way to get a ``CostModel``: preset name, YAML/JSON file, or a mapping.

    A spec is a mapping with exactly one of these shapes (YAML or JSON on disk)::

        preset: flexsp-gpt-7b        # a name from preset_names(), optional overrides:
        memory_cap_gb: 30            #   memory cap; model/hardware/training keys for
        training: {recompute: true}  #   first-principles presets

        name: my-fit                 # explicit (fitted) coefficients
        coefficients: {attn_ms_per_token2, linear_ms_per_token, group_fixed_ms,
                       a2a_ms_per_token | a2a_bytes_per_token + a2a_gbs,
                       tokens_per_rank | model_states_gb + act_mib_per_token,
                       optional: heads [q, kv], ring_step_ms_per_token {size: ms, pure ring},
                       a2a_fixed_ms {u: ms}, ring_step_fixed_ms {size: ms per step}}

        name: my-gpt                 # FlexSP-style fit, scaled with the cluster like the presets
        flexsp: {layers, hidden, a1, a2, b1, act_mib_per_token, params_b: {192: .., 384: ..}}

        name: my-llama               # first principles
        model: {name, layers, hidden, heads, kv_heads, ffn_hidden, vocab, gated}
        hardware: {name, peak_tflops, achievable_fraction, hbm_gb, nvlink_gbs, ...}
        training: {zero_stage, recompute, bytes_per_param, ...}

    ``memory_cap_gb`` given here (the ``--memory-cap-gb`` flag) overrides the spec's, which
    overrides the preset default (30 GB for FlexSP presets, 90% of HBM for first principles).
    """
    if isinstance(spec, Path | str):
        text = str(spec)
        if text in FLEXSP_FITS or text in FIRST_PRINCIPLES_PRESETS:
            data: Mapping[str, Any] = {"preset": text}
        elif text.endswith((".yaml", ".yml", ".json")) or Path(text).is_file():
            data = _read_spec_file(Path(text))
            _check_spec_numbers(data)
        else:
            raise InputError(
                f"--cost-model {text!r} is neither a preset nor a YAML/JSON file; presets: "
                f"{preset_names()}"
            )
    elif isinstance(spec, Mapping):
        data = spec
    else:
        raise InputError(
            f"cost model spec must be a name, a path or a mapping, got {type(spec).__name__}"
        )
    unknown = sorted(set(data) - _TOP_KEYS)
    if unknown:
        raise InputError(f"cost model spec: unknown keys {unknown}; allowed: {sorted(_TOP_KEYS)}")
    cap = memory_cap_gb if memory_cap_gb is not None else data.get("memory_cap_gb")
    max_seq_k = float(data.get("max_seq_k", max_seq_k))
    shapes = [k for k in ("preset", "coefficients", "flexsp", "model") if k in data]
    if len(shapes) != 1:
        raise InputError(
            "cost model spec needs exactly one of 'preset', 'coefficients', 'flexsp' or "
            f"'model' (+ 'hardware'); got {shapes or 'none'}"
        )
    shape = shapes[0]
    if shape == "preset":
        preset = str(data["preset"])
        if preset in FLEXSP_FITS:
            extra = sorted(set(data) - {"preset", "name", "memory_cap_gb", "max_seq_k"})
            if extra:
                raise InputError(
                    f"FlexSP preset {preset!r} takes only memory_cap_gb and max_seq_k "
                    f"overrides, not {extra}"
                )
            return flexsp_cost_model(
                str(data.get("name", preset)),
                world_size,
                max_seq_k=max_seq_k,
                memory_cap_gb=cap,
                gpus_per_node=gpus_per_node,
                fit=FLEXSP_FITS[preset],
            )
        if preset not in FIRST_PRINCIPLES_PRESETS:
            raise InputError(f"unknown cost-model preset {preset!r}; presets: {preset_names()}")
        model, hw, tr = FIRST_PRINCIPLES_PRESETS[preset]
        model = dataclasses.replace(model, **dict(data.get("model", {})))
        hw = dataclasses.replace(hw, **dict(data.get("hardware", {})))
        tr = dataclasses.replace(tr, **dict(data.get("training", {})))
        return first_principles_cost_model(
            model,
            hw,
            tr,
            world_size=world_size,
            gpus_per_node=gpus_per_node,
            memory_cap_gb=cap,
            name=str(data.get("name", preset)),
        )
    name = str(data.get("name", "custom"))
    if shape == "coefficients":
        model_ = _from_coefficients(name, data["coefficients"], cap)
        return dataclasses.replace(
            model_,
            source=str(data.get("source", model_.source)),
            details={str(k): float(v) for k, v in dict(data.get("details", {})).items()},
        )
    if shape == "flexsp":
        fit = dict(data["flexsp"])
        missing = sorted(
            {"layers", "hidden", "a1", "a2", "b1", "act_mib_per_token", "params_b"} - set(fit)
        )
        if missing:
            raise InputError(f"cost model spec: flexsp section lacks {missing}")
        return flexsp_cost_model(
            name,
            world_size,
            max_seq_k=max_seq_k,
            memory_cap_gb=cap,
            gpus_per_node=gpus_per_node,
            fit=fit,
        )
    if "hardware" not in data:
        raise InputError("cost model spec: a 'model' section needs a 'hardware' section too")
    model = _dataclass_from(ModelConfig, "model", data["model"], name=name)
    hw = _dataclass_from(HardwareConfig, "hardware", data["hardware"], name="hardware")
    tr = _dataclass_from(TrainingConfig, "training", data.get("training", {}))
    return first_principles_cost_model(
        model,
        hw,
        tr,
        world_size=world_size,
        gpus_per_node=gpus_per_node,
        memory_cap_gb=cap,
        name=name,
    )
