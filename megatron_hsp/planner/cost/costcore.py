"""The cost model's evaluation: ``CostModel``, the separable form every model reduces to.

Split out of ``costmodel.py`` so presets (``presets_flexsp``, ``first_principles``),
spec parsing (``costspec``) and the loader (``costmodel``) can each import it without a cycle.
Import the public names from ``megatron_hsp.planner.cost.costmodel``; they are all re-exported
there.

Every model, fitted (FlexSP presets) or first-principles, reduces to the same separable form, which
is what lets the MILP stay linear:

    group_ms(lengths, d, (u, r)) = sum_i [ (a1 * s_i^2 + a2 * s_i) / d + c_{d,u} * s_i
                                           + (r - 1) * max(0, p_{d,u} * s_i - a1 * s_i^2 / (d r))
                                           + (r - 1) * e_d * s_i ]
                                   + b_{d,u,r}
    fits(lengths, d)     = sum_i s_i / d <= tokens_per_rank

a1: attention (quadratic) ms per token^2 on one rank, times the factor of the group's attention
route (``attn_coefficient``: Ulysses, fused ring or tiled ring, ``planner/routes.py``);
a2: linear-layer ms per token;
c_{d,u}: Ulysses all-to-all ms per token over u ranks of a group of d (0 for u = 1; depends on the
network tier); p_{d,u}: one ring step's K/V p2p ms per token, hidden behind the attention block it
overlaps; e_d: one ring step's overhead beyond its traffic, never hidden; b: fixed ms
per group per pass (attention kernel calls, call latencies of the split, the optimizer-free
per-pass overhead FlexSP fits as b1); tokens_per_rank: activation capacity left on a
rank after model states, under the memory cap. (u, r) defaults to ``HeadSpace.split`` (what hsp's
runtime executes); Megatron's CP baselines are the same formula at (1, d). What a step costs once
beyond its micro-batches (gradient reduction, optimizer) is ``step_overhead_ms``, outside the
form: it is the same for every plan of a step.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from megatron_hsp.planner.errors import InputError
from megatron_hsp.planner.groupspace import HeadSpace
from megatron_hsp.planner.routes import RING_FUSED, RING_TILED, ROUTES, ULYSSES

# Each attention route's coefficient as a factor on ``attn_ms_per_token2`` (planner/routes.py,
# docs/costmodel.md "Per-route attention coefficients"). Ulysses and a fused ring are what the
# single coefficient was fitted and derived for (1.0: every plan priced as before); the tiled
# torch ring's factor is an estimate from reading its kernel against a fused one, not a GPU
# measurement (the docs say where it comes from), until a GPU run or the online refit sets it.
DEFAULT_ROUTE_FACTOR: Mapping[str, float] = {ULYSSES: 1.0, RING_FUSED: 1.0, RING_TILED: 15.0}

# Optional {size: value} coefficients, each empty when a model has no figure for it.
RING_AND_LATENCY_KEYS = (
    "ring_step_ms_per_token",
    "a2a_fixed_ms",
    "ring_step_fixed_ms",
    "ring_step_extra_ms_per_token",
)


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
    # Ring attention's cost beyond its traffic: ms per token of a sequence per ring
    # step in a group of d, never hidden (softmax merges of partial outputs, block splitting,
    # communication kernels taking SMs from attention). Per step a rank merges s/d tokens x all
    # its heads whatever the split, so one figure per d serves every (u, r) of d. Empty: none.
    ring_step_extra_ms_per_token: Mapping[int, float] = field(default_factory=dict)
    # Whether every pass (one forward and backward of a micro-batch) synchronises all ranks:
    # true under ZeRO-3, whose per-pass parameter all-gathers and gradient reduce-scatter span
    # every data-parallel rank; false where ranks meet only inside their group until the step's
    # gradient reduction (ZeRO-0/1/2, Megatron's distributed optimizer). Derived from the
    # training setup (``first_principles``); the execution model (``execution.py``) prices by it.
    pass_barrier: bool = False
    # Attention route factors ({route: factor on attn_ms_per_token2}, routes from
    # ``planner/routes.ROUTES``); a route absent here takes ``DEFAULT_ROUTE_FACTOR``.
    attn_route_factor: Mapping[str, float] = field(default_factory=dict)
    # The route HSP's runtime takes for its ring or hybrid group of each size ({size: route}, 0:
    # every size; ``routes.ring_routes`` builds it from the backend rule). Absent: ring-fused.
    ring_route: Mapping[int, str] = field(default_factory=dict)
    # {group size: multiple} each document of a group of that size is padded to at run time
    # (Transformer Engine's THD context parallelism: ``routes.te_doc_multiples``). Absent: none.
    # Priced in time (``execution.pass_times``) and memory (``fits``): up to 2d - 1 tokens more
    # per document, which near the memory cap decides what fits.
    doc_multiple: Mapping[int, int] = field(default_factory=dict)

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

    # ------------------------------------------------------------------ routes
    def route(self, d: int, split: tuple[int, int] | None = None) -> str:
        """The attention route (``planner/routes.py``) a group of ``d`` run as ``split`` takes:
        Ulysses without ring degree, else the ring route declared for ``d`` (fused by default)."""
        _, r = self._resolve(d, split)
        if r == 1:
            return ULYSSES
        return self.ring_route.get(d, self.ring_route.get(0, RING_FUSED))

    def route_factor(self, route: str) -> float:
        """The attention coefficient of ``route`` relative to ``attn_ms_per_token2``."""
        if route not in ROUTES:
            raise InputError(f"attention route {route!r}: use one of {ROUTES}")
        return float(self.attn_route_factor.get(route, DEFAULT_ROUTE_FACTOR[route]))

    def attn_coefficient(self, d: int, split: tuple[int, int] | None = None) -> float:
        """ms per token^2 of attention on one rank for a group of ``d`` run as ``split``."""
        return self.attn_ms_per_token2 * self.route_factor(self.route(d, split))

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
        previous one (attn / r per step), so only the excess of transfer over compute shows, plus
        each step's non-bandwidth overhead (``ring_step_extra_ms_per_token``), which no overlap
        hides.
        ``ring`` is a sensitivity knob for baselines only: "overlap" (this rule, the default),
        "hidden" (ring traffic free) or "exposed" (none of it overlapped).
        Attention is priced by the group's route (``route``, ``attn_coefficient``): a slow ring
        kernel costs its own coefficient, and hides more of the ring's traffic behind it.
        """
        u, r = self._resolve(d, split)
        s = np.asarray(lengths, dtype=np.float64)
        attn = self.attn_coefficient(d, (u, r)) * s * s / d
        out = attn + self.linear_ms_per_token * s / d + self._a2a(d, u) * s
        if r > 1 and ring != "hidden":
            step = self._ring_step(d, u) * s
            if ring == "overlap":
                out = out + (r - 1) * np.maximum(0.0, step - attn / r)
            elif ring == "exposed":
                out = out + (r - 1) * step
            else:
                raise InputError(f"ring pricing {ring!r}: use overlap, hidden or exposed")
        if r > 1:
            out = out + (r - 1) * self.ring_step_extra_ms_per_token.get(d, 0.0) * s
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

    def padded(self, lengths: np.ndarray | Sequence[int], d: int) -> np.ndarray:
        """``lengths`` as a group of ``d`` holds them: each rounded up to ``doc_multiple[d]``."""
        s = np.asarray(lengths, dtype=np.int64)
        m = int(self.doc_multiple.get(d, 1))
        return s if m <= 1 else -(-s // m) * m

    def fits(self, lengths: Sequence[int], group_size: int) -> bool:
        held = self.padded(list(map(int, lengths)), group_size)
        return int(held.sum()) <= self.capacity(group_size)

    def min_group_size(self, length: int, sizes: Sequence[int]) -> int | None:
        """Smallest size in ``sizes`` whose group can hold one sequence of ``length``."""
        need = math.ceil(length / self.tokens_per_rank)
        fitting = [d for d in sorted(sizes) if d >= need and self.fits([length], d)]
        return fitting[0] if fitting else None

    def max_trainable_length(self, sizes: Sequence[int] | None = None) -> int:
        """Longest single sequence any group of ``sizes`` (default: all known sizes) can hold
        (padding included: a padded document must fit whole)."""
        d = max(sizes if sizes else self.sizes)
        cap, m = self.capacity(d), int(self.doc_multiple.get(d, 1))
        return cap - cap % m

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
                **({"pass_barrier": True} if self.pass_barrier else {}),
                **{
                    key: {int(k): float(v) for k, v in getattr(self, key).items()}
                    for key in RING_AND_LATENCY_KEYS
                    if getattr(self, key)
                },
                **(
                    {"attn_route_factor": {k: float(v) for k, v in self.attn_route_factor.items()}}
                    if self.attn_route_factor
                    else {}
                ),
                **(
                    {"ring_route": {int(k): str(v) for k, v in self.ring_route.items()}}
                    if self.ring_route
                    else {}
                ),
            },
            "source": self.source,
            "details": {k: float(v) for k, v in self.details.items()},
        }
