"""Pipeline-parallel pricing of a plan: 1F1B and interleaved step time, order, in-flight memory.

Every pipeline stage runs the same plan (micro-batch ``i`` has the same groups on every stage's
data x context plane), so one number per micro-batch describes it: ``t_i``, the plan's
``MicroBatch.est_ms`` priced by a *stage* cost model (the layers of one stage; see
``planner/cost/parallel.py``), forward plus backward. It splits into ``f_i = (1 - beta) t_i``
forward and ``b_i = beta t_i`` backward (``beta`` = ``PipelineSpec.backward_share``: 2/3 without
recomputation, the backward being two matmuls per forward one; 3/4 with full recomputation).

**Step time (exact for the model below).** Megatron runs a fixed operation order on each of the
``pp`` devices (``stage_ops``, the order of megatron-core 0.19's
``forward_backward_pipelining_without_interleaving`` / ``..._with_interleaving``). With ``v``
virtual stages per device (``vpp``), virtual stage ``k = chunk * pp + device`` of ``V = pp * vpp``
holds ``1/V`` of the layers, so its forward of micro-batch ``i`` takes ``f_i / vpp`` and its
backward ``b_i / vpp`` on a device. Operations start as early as their device and their input
allow::

    start F(k, i) = max(end of the device's previous op, end F(k-1, i) + h)      (k > 0)
    start B(k, i) = max(end of the device's previous op, end B(k+1, i) + h)      (k < V-1)
    start B(V-1, i) = max(end of the device's previous op, end F(V-1, i))
    T = the last end over all devices

(``h`` = ``hop_ms``, one stage-to-stage p2p). ``simulate`` evaluates this recurrence, i.e. the
longest path through the schedule's dependency graph, in O(m * V).

**Closed forms.** With equal micro-batches, 1F1B gives the textbook ``T = (m + pp - 1) t``. With
heterogeneous ones, every path through device ``pp-1`` waits for micro-batch 1's forward on the
``pp - 1`` devices before it and ends with micro-batch m's backward on them, and the last device
runs all forwards and backwards, hence the lower bound (equality for equal micro-batches)::

    T >= sum_i t_i + (pp - 1) * (f_first + b_last) / vpp

(chunks of ``1/vpp`` of a stage under interleaving), and the bubble is ``T - sum_i t_i``. The
bound is not attained in general: with pp=2, t=[6, 3] (beta 2/3) the bound says 13 and the
schedule takes 14, because the short second micro-batch's forward on device 1 waits for the
long first backward there (``tests/planner/cost/test_pipeline.py`` derives both by hand, and a
3-stage case).
No bound of the form ``sum t + (pp - 1) (max f + max b)`` holds from above: long micro-batches
can stall the steady state more than once (``benchmarks/pipeline_order.py``: up to 1.52x).
``simulate`` is the price the planner uses; the bound is for reasoning and tests.

**What is approximate.** All stages cost the same (the stage model prices the heaviest stage:
``ceil(layers / pp)`` layers plus the output layer, so it is conservative for the others);
p2p is a fixed ``hop_ms`` per boundary; a micro-batch costs its slowest group on every device
(groups of one micro-batch on a device do not wait for each other in a real pipeline, so the
per-rank pipelines are never slower: monotonicity of the recurrence); the gradient all-reduce
and optimizer step after the last backward are not part of a plan (``CostModel.step_overhead_ms``).

**Order.** ``order_microbatches`` searches an order that shrinks the bubble: the shortest first
(warm-up) and the next shortest last (cool-down), then first-improvement moves scored by
``simulate``; it never returns an order worse than the one it was given.

**Memory.** Device ``s`` holds the activations of the micro-batches it has run forward but not
backward: ``min(m, pp - s)`` under 1F1B (its warm-up plus one), and under interleaving
``min(m * vpp, 2 (pp - s - 1) + (vpp - 1) pp + 1)`` chunks of ``1/vpp`` of a micro-batch
(megatron-core's warm-up count plus one). ``in_flight`` gives it; the stage cost model divides
its activation capacity by the peak (``microbatch_token_capacity``), so any order of any
micro-batches that each fit the per-micro-batch cap fits the stage (conservative: the in-flight
micro-batches need not all be the largest).

**Count.** Interleaving in megatron-core 0.19 needs ``microbatch_group_size_per_vp_stage`` (default
``pp``) to be at most ``m`` and ``m`` mod it to be 0 or at least ``pp``: with the default, ``m`` is
a multiple of ``pp`` (``PipelineSpec.microbatch_multiple``); 1F1B takes any ``m``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from megatron_hsp.planner.errors import InputError

if TYPE_CHECKING:
    from megatron_hsp.planner.plan import Plan

# Backward share of a micro-batch's forward+backward time: two matmuls (input and weight
# gradients) per forward one; with full recomputation the backward also reruns the forward.
BACKWARD_SHARE = 2.0 / 3.0
BACKWARD_SHARE_RECOMPUTE = 3.0 / 4.0
ORDERS = ("bubble", "as-given")
MAX_PP = 256


@dataclass(frozen=True)
class PipelineSpec:
    """How the pipeline runs: stages, virtual stages per device, backward share, p2p per hop."""

    pp: int = 1
    vpp: int = 1
    backward_share: float = BACKWARD_SHARE
    hop_ms: float = 0.0
    order: str = "bubble"  # "bubble": order_microbatches; "as-given": keep the plan's order
    max_order_evals: int = 200  # simulate() calls the order search may spend

    def __post_init__(self) -> None:
        if not 1 <= int(self.pp) <= MAX_PP:
            raise InputError(f"--pp must be between 1 and {MAX_PP}, got {self.pp}")
        if int(self.vpp) < 1:
            raise InputError(f"--vpp must be >= 1, got {self.vpp}")
        if self.vpp > 1 and self.pp < 2:
            raise InputError(f"--vpp {self.vpp} needs --pp >= 2 (interleaving splits stages)")
        if not 0.0 < self.backward_share < 1.0:
            raise InputError(f"backward share must be in (0, 1), got {self.backward_share}")
        if not (math.isfinite(self.hop_ms) and self.hop_ms >= 0):
            raise InputError(f"hop_ms must be a finite number >= 0, got {self.hop_ms}")
        if self.order not in ORDERS:
            raise InputError(f"pipeline order {self.order!r}: choose from {ORDERS}")

    @property
    def schedule(self) -> str:
        return "none" if self.pp == 1 else ("1f1b" if self.vpp == 1 else "interleaved")

    @property
    def microbatch_multiple(self) -> int:
        """The micro-batch count must be a multiple of this (megatron-core's interleaving)."""
        return self.pp if self.vpp > 1 else 1

    def in_flight(self, device: int = 0, m: int | None = None) -> float:
        """Micro-batches' worth of activations ``device`` holds at its peak (module docstring)."""
        return in_flight(self.pp, self.vpp, device, m)

    def peak_in_flight(self, m: int | None = None) -> float:
        return max(self.in_flight(s, m) for s in range(self.pp))

    def to_dict(self) -> dict[str, Any]:
        return {
            "pp": self.pp,
            "vpp": self.vpp,
            "schedule": self.schedule,
            "backward_share": self.backward_share,
            "hop_ms": self.hop_ms,
            "order": self.order,
        }


def in_flight(pp: int, vpp: int, device: int, m: int | None = None) -> float:
    """Micro-batches' worth of activations device ``device`` keeps alive at its peak.

    1F1B: the warm-up forwards (``pp - device - 1``) plus the one before the first backward.
    Interleaved: megatron-core's warm-up ``2 (pp - device - 1) + (vpp - 1) pp`` chunk forwards plus
    one, each chunk ``1/vpp`` of the device's layers. Both capped by the work there is (``m``).
    """
    if not 0 <= device < pp:
        raise InputError(f"device {device} is not a stage of a {pp}-stage pipeline")
    if pp == 1:
        return 1.0
    if vpp == 1:
        held = pp - device
        return float(held if m is None else min(m, held))
    chunks = 2 * (pp - device - 1) + (vpp - 1) * pp + 1
    if m is not None:
        chunks = min(m * vpp, chunks)
    return chunks / vpp


def microbatch_token_capacity(
    avail_bytes: float,
    layer_bytes_per_token: float,
    head_bytes_per_token: float,
    spec: PipelineSpec,
) -> int:
    """Tokens one rank may hold in one micro-batch so that every device fits its in-flight set.

    ``layer_bytes_per_token``: the activations of one stage's layers per token (held by every
    in-flight micro-batch); ``head_bytes_per_token``: the output layer's (logits, loss), held on
    the last device only, by at most ``ceil(in_flight(pp - 1))`` micro-batches.
    """
    need = 0.0
    for s in range(spec.pp):
        held = spec.in_flight(s)
        per_token = held * layer_bytes_per_token
        if s == spec.pp - 1:
            per_token += math.ceil(held) * head_bytes_per_token
        need = max(need, per_token)
    return int(avail_bytes / need) if need > 0 else 0


# ---------------------------------------------------------------------- schedules
Op = tuple[str, int, int]  # ("F" or "B", micro-batch index, model chunk)


def stage_ops(pp: int, vpp: int, m: int, device: int) -> list[Op]:
    """The operation order megatron-core 0.19 runs on ``device`` (warm-up, 1F1B, cool-down).

    Non-interleaved: ``pp - device - 1`` warm-up forwards, then forward/backward pairs, then the
    remaining backwards. Interleaved (``vpp > 1``, groups of ``pp`` micro-batches per chunk,
    ``get_schedule_table``): the k-th forward is micro-batch ``table[k]`` on chunk ``table[k]``'s
    chunk, the k-th backward the same micro-batch on the mirrored chunk; warm-up
    ``2 (pp - device - 1) + (vpp - 1) pp`` forwards (all of them when that covers everything).
    """
    if vpp == 1:
        warm = min(pp - device - 1, m)
        ops: list[Op] = [("F", i, 0) for i in range(warm)]
        for j in range(m - warm):
            ops += [("F", warm + j, 0), ("B", j, 0)]
        ops += [("B", j, 0) for j in range(m - warm, m)]
        return ops
    if m % pp:
        raise InputError(
            f"interleaved pipeline: {m} micro-batches is not a multiple of --pp {pp} "
            "(megatron-core's microbatch_group_size_per_vp_stage defaults to pp)"
        )
    table = [(i, c) for g in range(0, m, pp) for c in range(vpp) for i in range(g, g + pp)]
    total = m * vpp
    warm = min(total, 2 * (pp - device - 1) + (vpp - 1) * pp)
    fwd = [("F", i, c) for i, c in table]
    bwd = [("B", i, vpp - 1 - c) for i, c in table]
    ops = fwd[:warm]
    for k in range(total - warm):
        ops += [fwd[warm + k], bwd[k]]
    ops += bwd[total - warm :]
    return ops


@dataclass(frozen=True)
class PipelineResult:
    """One step under the pipeline schedule."""

    step_ms: float
    busy_ms: float  # sum of the micro-batches' times: one device's work
    order: tuple[int, ...]  # micro-batch indices in the order they run

    @property
    def bubble_ms(self) -> float:
        return self.step_ms - self.busy_ms


def simulate(times: Sequence[float], spec: PipelineSpec) -> float:
    """Step time (ms) of micro-batches with forward+backward ``times`` on one stage, in order.

    The recurrence of the module docstring, evaluated device by device: each device runs its
    ``stage_ops`` in order, an op as soon as its input exists. Without a pipeline (pp 1) it is
    the sum, as the solver's objective has always been.
    """
    m, pp, vpp = len(times), spec.pp, spec.vpp
    if m == 0:
        return 0.0
    if pp == 1:
        return float(sum(times))
    beta = spec.backward_share
    fwd = [(1.0 - beta) * t / vpp for t in times]
    bwd = [beta * t / vpp for t in times]
    nv = pp * vpp
    f_end = [[-1.0] * m for _ in range(nv)]
    b_end = [[-1.0] * m for _ in range(nv)]
    programs = [stage_ops(pp, vpp, m, s) for s in range(pp)]
    pos = [0] * pp
    free = [0.0] * pp
    remaining = sum(len(p) for p in programs)
    hop = spec.hop_ms
    while remaining:
        progressed = False
        for s in range(pp):
            prog = programs[s]
            while pos[s] < len(prog):
                kind, i, chunk = prog[pos[s]]
                k = chunk * pp + s
                if kind == "F":
                    if k == 0:
                        ready = 0.0
                    elif f_end[k - 1][i] < 0:
                        break
                    else:
                        ready = f_end[k - 1][i] + hop
                    end = max(free[s], ready) + fwd[i]
                    f_end[k][i] = end
                else:
                    if k == nv - 1:
                        if f_end[k][i] < 0:
                            break
                        ready = f_end[k][i]
                    elif b_end[k + 1][i] < 0:
                        break
                    else:
                        ready = b_end[k + 1][i] + hop
                    end = max(free[s], ready) + bwd[i]
                    b_end[k][i] = end
                free[s] = end
                pos[s] += 1
                remaining -= 1
                progressed = True
        if not progressed:  # every schedule above is deadlock-free; this guards edits
            raise RuntimeError("pipeline schedule deadlocked: an op waits on one never run")
    return max(free)


def bubble_lower_bound(times: Sequence[float], spec: PipelineSpec) -> float:
    """``sum t + (pp - 1) (f_first + b_last) / vpp``: no run of this order is faster.

    The last device runs every op (``sum t``); its first waits for the first micro-batch's first
    chunk through the ``pp - 1`` devices before it, and after its last (the last micro-batch's
    chunk 0 backward, ``get_schedule_table``) that backward still crosses them. Equal to
    ``simulate`` for equal micro-batches: ``(m + pp - 1) t`` (1F1B), ``m t + (pp - 1) t / vpp``.
    """
    if not times:
        return 0.0
    beta = spec.backward_share
    ends = (1 - beta) * times[0] + beta * times[-1]
    return float(sum(times)) + (spec.pp - 1) * ends / spec.vpp


def pipeline_lower_bound(
    sum_bound_ms: float, shortest_microbatch_ms: float, pp: int, vpp: int = 1
) -> float:
    """A lower bound on any plan's pipelined step from a bound on its summed micro-batch times.

    Every plan has a first and a last micro-batch, each at least ``shortest_microbatch_ms`` (the
    cheapest single sequence with its group's fixed cost), so ``f_first + b_last`` is at least
    that much whatever the backward share (``bubble_lower_bound``).
    """
    return float(sum_bound_ms) + (pp - 1) * float(shortest_microbatch_ms) / vpp


def order_microbatches(times: Sequence[float], spec: PipelineSpec) -> PipelineResult:
    """An order of the micro-batches that shrinks the bubble, never worse than the given one.

    Start points: the given order, and "shortest first, next shortest last, the rest longest
    first" (the warm-up waits for the first forward and the cool-down for the last backward,
    through ``pp - 1`` devices each; putting long ones early lets short ones fill the steady
    state). Then first-improvement moves (take one micro-batch out, insert it elsewhere), each
    scored by ``simulate``, within ``spec.max_order_evals`` evaluations.
    """
    m = len(times)
    given = tuple(range(m))
    busy = float(sum(times))
    if spec.pp == 1 or m <= 1 or spec.order == "as-given":
        return PipelineResult(simulate(times, spec), busy, given)
    evals = 0

    def cost(order: Sequence[int]) -> float:
        nonlocal evals
        evals += 1
        return simulate([times[i] for i in order], spec)

    by_time = sorted(range(m), key=lambda i: (times[i], i))
    shaped = (by_time[0], *sorted(by_time[2:], key=lambda i: (-times[i], i)), by_time[1])
    best, best_t = given, cost(given)
    t = cost(shaped)
    if t < best_t - 1e-9:
        best, best_t = shaped, t
    improved = True
    while improved and evals < spec.max_order_evals:
        improved = False
        for a in range(m):
            for b in range(m):
                if a == b or evals >= spec.max_order_evals:
                    continue
                cand = list(best)
                cand.insert(b, cand.pop(a))
                t = cost(cand)
                if t < best_t - 1e-9:
                    best, best_t, improved = tuple(cand), t, True
                    break
            if improved or evals >= spec.max_order_evals:
                break
    return PipelineResult(best_t, busy, tuple(best))


def price_plan(
    plan: Plan,
    spec: PipelineSpec,
    *,
    reorder: bool = True,
    pass_times: Sequence[float] | None = None,
) -> Plan:
    """The plan with its micro-batches in pipeline order and ``est_step_ms`` the pipelined step.

    ``reorder`` False keeps the plan's own order (the Megatron baselines run in the order their
    schedulers emit). ``pass_times``: the pipeline's micro-batches when they are not the plan's
    (a plan whose groups run their sequences in separate passes pipelines each pass; kept in
    that order). The summed micro-batch time, the bubble and the schedule go to
    ``extra["pipeline"]``; the sequences and groups are untouched, so validation is unchanged.
    """
    times = [mb.est_ms for mb in plan.microbatches] if pass_times is None else list(pass_times)
    use = spec if reorder and pass_times is None else replace(spec, order="as-given")
    if spec.pp > 1 and len(times) % spec.microbatch_multiple:
        raise InputError(
            f"interleaved pipeline (--vpp {spec.vpp}) needs a multiple of --pp {spec.pp} "
            f"micro-batches; this plan has {len(times)}"
        )
    res = order_microbatches(times, use)
    mbs = plan.microbatches
    if pass_times is None:
        mbs = tuple(plan.microbatches[i] for i in res.order)
    info = {
        **spec.to_dict(),
        "order": use.order,
        "pipeline_microbatches": len(times),
        "sum_microbatch_ms": res.busy_ms,
        "bubble_ms": res.bubble_ms,
        "peak_in_flight": spec.peak_in_flight(len(times)),
    }
    return replace(
        plan, microbatches=mbs, est_step_ms=res.step_ms, extra={**plan.extra, "pipeline": info}
    )


__all__ = [
    "BACKWARD_SHARE",
    "BACKWARD_SHARE_RECOMPUTE",
    "PipelineResult",
    "PipelineSpec",
    "bubble_lower_bound",
    "in_flight",
    "microbatch_token_capacity",
    "order_microbatches",
    "pipeline_lower_bound",
    "price_plan",
    "simulate",
    "stage_ops",
]
