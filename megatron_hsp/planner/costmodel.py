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
