"""Cost model: time and memory of a sequence-parallel group, as the planner sees them.

Every model, fitted (FlexSP presets) or first-principles, reduces to the same separable form, which
is what lets the MILP stay linear:

    group_ms(lengths, d) = sum_i [ (a1 * s_i^2 + a2 * s_i) / d + c_d * s_i ] + b_d
    fits(lengths, d)     = sum_i s_i / d <= tokens_per_rank

a1: attention (quadratic) ms per token^2 on one rank; a2: linear-layer ms per token;
c_d: Ulysses all-to-all ms per token for a group of d (0 for d = 1; depends on the network tier
the group spans); b_d: fixed ms per group per micro-batch (kernel launches, a2a latency, the
optimizer-free per-pass overhead FlexSP fits as b1); tokens_per_rank: activation capacity left on a
rank after model states, under the memory cap.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from megatron_hsp.planner.errors import InputError


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

    def _a2a(self, d: int) -> float:
        if d == 1:
            return 0.0
        try:
            return self.a2a_ms_per_token[d]
        except KeyError:
            raise InputError(
                f"cost model {self.name!r} has no all-to-all figure for group size {d}; "
                f"known sizes: {self.sizes}"
            ) from None

    def _fixed(self, d: int) -> float:
        g = self.group_fixed_ms
        return g[d] if d in g else g.get(0, 0.0)

    # ------------------------------------------------------------------ time
    def seq_ms(self, lengths: np.ndarray | Sequence[int], d: int) -> np.ndarray:
        """Per-sequence time (ms) in a group of ``d``, excluding the group's fixed cost."""
        s = np.asarray(lengths, dtype=np.float64)
        return (self.attn_ms_per_token2 * s * s + self.linear_ms_per_token * s) / d + self._a2a(
            d
        ) * s

    def group_ms(self, lengths: np.ndarray | Sequence[int], d: int) -> float:
        """Time (ms) of one group of ``d`` ranks training ``lengths`` in one micro-batch."""
        return float(self.seq_ms(lengths, d).sum()) + self._fixed(d)

    def fixed_ms(self, d: int) -> float:
        return self._fixed(d)

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

    def max_trainable_length(self, sizes: Sequence[int]) -> int:
        return self.capacity(max(sizes))


# ---------------------------------------------------------------------- FlexSP fitted presets
# Source: PKU-DAIR/Hetu-Galvatron, branch flexsp, galvatron/flexsp_solver/solver.py
# (``optimizer_param_dict`` and ``flexSPCostModel``), as quoted in shared/design.md section 4.
# a1 in ms/token^2, a2 in ms/token, b1 in ms, activations in MiB/token, params in billions keyed by
# max-seq in K (FlexSP interpolates linearly between 192 and 384 for other lengths).
FLEXSP_FITS: dict[str, dict[str, float | int | dict[int, float]]] = {
    "flexsp-gpt-7b": {
        "layers": 32,
        "hidden": 4096,
        "a1": 5.128e-6,
        "a2": 183.9576e-3,
        "b1": 629.3563,
        "act_mib_per_token": 4.480441895,
        "params_b": {192: 7.1174468994140625, 384: 7.8498687744140625},
    },
    "flexsp-gpt-13b": {
        "layers": 40,
        "hidden": 5120,
        "a1": 9.2852e-6,
        "a2": 306.0189e-3,
        "b1": 1132.5632,
        "act_mib_per_token": 4.220439453,
        "params_b": {192: 13.11605453491211, 384: 14.03158187866211},
    },
    "flexsp-gpt-30b": {
        "layers": 60,
        "hidden": 6656,
        "a1": 15.4262e-6,
        "a2": 803.5742e-3,
        "b1": 2789.3644,
        "act_mib_per_token": 3.417381836,
        "params_b": {192: 31.52513885498047, 384: 32.71532440185547},
    },
}
# All-to-all bandwidth by group size, "4k seq, 2 IB" figures FlexSP uses (8 GPUs per node).
FLEXSP_A2A_GBS: dict[int, float] = {2: 119.54, 4: 104.07, 8: 96.5, 16: 10.33, 32: 5.94, 64: 4.87}


def flexsp_params_b(fit: Mapping[str, object], max_seq_k: float) -> float:
    """Parameter count (billions) at ``max_seq_k`` (positional embeddings grow with max-seq)."""
    table = fit["params_b"]
    assert isinstance(table, dict)
    if max_seq_k in table:
        return float(table[max_seq_k])
    lo, hi = table[192], table[384]
    return (hi - lo) / 192 * (max_seq_k - 192) + lo


def flexsp_cost_model(
    name: str,
    world_size: int,
    max_seq_k: float = 192,
    memory_cap_gb: float = 30.0,
    a2a_gbs: Mapping[int, float] | None = None,
) -> CostModel:
    """FlexSP's fitted model, reproduced term for term (ZeRO-3, mixed precision).

    FlexSP measures all-to-all time as ``bytes / 2**20 / d / BW_d`` and calls it ms; we keep that
    exact arithmetic so estimates match its published numbers. Sizes above the largest measured
    one reuse its bandwidth (the per-GPU inter-node link is the bottleneck at that point).
    """
    if name not in FLEXSP_FITS:
        raise InputError(f"unknown FlexSP preset {name!r}; choose from {sorted(FLEXSP_FITS)}")
    fit = FLEXSP_FITS[name]
    layers, hidden = int(fit["layers"]), int(fit["hidden"])  # type: ignore[arg-type]
    bw = dict(a2a_gbs or FLEXSP_A2A_GBS)
    sizes = [1 << k for k in range(1, max(1, world_size).bit_length()) if (1 << k) <= world_size]
    biggest = max(bw)
    a2a_bytes_per_token = 4 * 2 * layers * hidden * 2
    a2a = {d: a2a_bytes_per_token / 2**20 / d / bw.get(d, bw[biggest]) for d in sizes}
    params_b = flexsp_params_b(fit, max_seq_k)
    model_states_mib = params_b * 16 * 1024 / world_size
    act = float(fit["act_mib_per_token"])  # type: ignore[arg-type]
    tokens_per_rank = int((memory_cap_gb * 1024 - model_states_mib) / act)
    return CostModel(
        name=name,
        attn_ms_per_token2=float(fit["a1"]),  # type: ignore[arg-type]
        linear_ms_per_token=float(fit["a2"]),  # type: ignore[arg-type]
        group_fixed_ms={0: float(fit["b1"])},  # type: ignore[arg-type]
        a2a_ms_per_token=a2a,
        tokens_per_rank=tokens_per_rank,
        source="FlexSP fitted model (Hetu-Galvatron flexsp branch, solver.py)",
        details={
            "params_b": params_b,
            "model_states_mib": model_states_mib,
            "act_mib_per_token": act,
            "memory_cap_gb": memory_cap_gb,
        },
    )
