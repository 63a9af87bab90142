"""``solve``: one global batch's lengths -> a validated ``Plan``, within a wall-clock budget.

Pipeline (each stage keeps the best plan so far, so the budget can cut in anywhere):

1. Candidates: micro-batch counts from the memory minimum up (``chunking``), each chunked two
   ways (time-balanced LPT, and FlexSP-style contiguous tokens), scheduled per micro-batch by the
   greedy builder (``greedy``). The best total is the warm start and the fallback.
2. Local search (``improve``): moves and swaps of long sequences, and bulk shifts of short ones,
   between micro-batches, re-scheduled greedily; first improvement.
3. Exact-ish refinement: each micro-batch more than ``milp_min_gap`` above its floor, biggest gap
   first, goes to the aggregated MILP (``milp``) over (length bucket x group size) with the
   greedy schedule as incumbent; a MILP schedule replaces the greedy one only when it is faster.
4. Plan assembly: aligned rank blocks, estimates, the lower bound (``bounds``), validation, and
   the status (see ``milp.refine_microbatches``).

Under a pipeline (``SolverConfig.pipeline`` with pp > 1, and a stage cost model built for it by
``planner/cost/parallel.py``), the step is priced by ``planner/cost/pipeline.py``: candidates are
compared by their pipelined step (a quick order), counts are kept a multiple of pp where
interleaving
needs it (``_fit_multiple`` splits the fullest micro-batch), and the final plan is ordered to
shrink the bubble, its ``est_step_ms`` the pipelined step. Local search and the MILP still
minimise the sum of micro-batch times, the bubble-free part of the step.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Generator, Iterator, Sequence
from dataclasses import dataclass, replace

from megatron_hsp.planner.cost.costmodel import CostModel, validate_cost_model
from megatron_hsp.planner.cost.execution import balance_segments, group_by_layout, price
from megatron_hsp.planner.cost.pipeline import (
    PipelineSpec,
    order_microbatches,
    pipeline_lower_bound,
    price_plan,
)
from megatron_hsp.planner.errors import InfeasibleError, InputError
from megatron_hsp.planner.groupspace import planning_sizes
from megatron_hsp.planner.plan import Group, MicroBatch, Plan
from megatron_hsp.planner.search import budget
from megatron_hsp.planner.search.bounds import instance_lower_bound
from megatron_hsp.planner.search.budget import Cap
from megatron_hsp.planner.search.chunking import (
    candidate_counts,
    check_microbatch_floor,
    chunk_contiguous,
    chunk_long_grouped,
    chunk_long_sized,
    chunk_time_balanced,
)
from megatron_hsp.planner.search.concurrency import Helper, finish
from megatron_hsp.planner.search.flexsp_style import flexsp_style_config
from megatron_hsp.planner.search.greedy import (
    group_times,
    place_groups,
    schedule_microbatch,
)
from megatron_hsp.planner.search.homogeneous import cheapest_homogeneous
from megatron_hsp.planner.search.improve import improve
from megatron_hsp.planner.search.instance import GroupSpec, Instance, check_lengths, resolve_sizes
from megatron_hsp.planner.search.milp import refine_microbatches, require_cbc
from megatron_hsp.planner.search.settings import BACKENDS, CHUNKINGS, SolverConfig, scaled_count
from megatron_hsp.planner.topology import Cluster

# ``long-grouped:scored`` candidates: the longest of these shares of the sequences whose scored
# size is not their cheapest keep it (``_scored_sizes``); 1 is every one, the first built.
SCORED_SHARES = (1.0, 2 / 3, 1 / 3)
EVERY_COUNT_CHUNKINGS = ("time-lpt", "contiguous-tokens")  # built at every count
DEFAULT_CONFIG = SolverConfig()  # frozen: the default of ``solve``


@dataclass
class _Candidate:
    total: float
    microbatches: list[tuple[float, list[GroupSpec]]]
    label: str


def solve(
    lengths: Sequence[int],
    cost: CostModel,
    cluster: Cluster,
    config: SolverConfig = DEFAULT_CONFIG,
    *,
    baselines: bool = True,
    bound: bool = True,
) -> Plan:
    """Plan one global batch: micro-batches, group sizes and placement, sequence assignment.

    The plan is priced by the execution model (``planner/cost/execution.py``), its passes of
    equal layout adjacent so that they share a segment where passes are not barriers.
    ``baselines``: also score the homogeneous layouts (static packing and ``dp_balanced`` at
    every size, ``search/homogeneous.py``) and the ``flexsp-style`` plan (this solver under
    FlexSP's choices, ``search/flexsp_style.py``), and return the cheapest of them when it
    beats the search, so that no plan is priced worse than the best of them; ``flexsp-style``
    turns this off (FlexSP's planner has no such fallback). ``bound``: compute the plan's
    ``lower_bound_ms`` (False: 0, for a plan scored only by its price).
    """
    if config.workers not in (1, 2):
        raise InputError(
            f"SolverConfig.workers={config.workers!r}: use 1 (everything in the calling thread) "
            "or 2 (the MILPs in one helper thread; the same plans)"
        )
    with Helper(config.workers) as helper:
        return finish(_solve_steps(lengths, cost, cluster, config, helper, baselines, bound))


def _solve_steps(
    lengths: Sequence[int],
    cost: CostModel,
    cluster: Cluster,
    config: SolverConfig,
    helper: Helper,
    baselines: bool,
    bound: bool,
) -> Generator[None, None, Plan]:
    """``solve`` in stages: yields once, when its MILP stage is with ``helper`` (or queued for
    the caller's thread), so that a caller may work meanwhile; returns the plan
    (``concurrency.finish``). The ``flexsp-style`` search runs this way beside hsp's own."""
    start, cpu_start = time.perf_counter(), time.process_time()
    budget_s = max(0.0, config.time_budget_s)
    # Counts limit the search (``SolverConfig``); the budget is a safety cap on wall clock, less
    # a slice kept for plan assembly and validation. Stages it cuts end up in ``cut_by_cap``.
    cap = Cap(budget.now() + budget_s - min(0.15 * budget_s, 0.15))
    if config.backend not in BACKENDS:
        raise InputError(f"unknown solver backend {config.backend!r}; choose from {BACKENDS}")
    if not config.chunkings or set(config.chunkings) - set(CHUNKINGS):
        raise InputError(f"chunkings {config.chunkings!r}: choose one or more of {CHUNKINGS}")
    if config.backend == "cbc" and config.use_milp:
        require_cbc()
    # A negative or NaN coefficient makes the bisection's tolerance and the lower bound
    # meaningless; refuse it here too, for models built in code rather than loaded.
    validate_cost_model(cost)
    sizes = resolve_sizes(cost, cluster, config.sizes)
    if config.sizes is None:  # a bounded search at thousands of GPUs (groupspace.planning_sizes)
        sizes = planning_sizes(sizes, cluster.gpus_per_node)
    checked = check_lengths(lengths, cost, sizes)
    pipe = _pipeline(config, cost, len(checked))
    inst = Instance.build(checked, cost, cluster, sizes)
    check_microbatch_floor(inst)
    lower = instance_lower_bound(inst, deadline=cap) if bound else 0.0

    phases = {"setup": time.perf_counter() - start}
    # FlexSP's search first: its MILP then runs in the helper beside hsp's search (Python).
    flexsp = _flexsp_style_start(checked, cost, cluster, config, cap, helper) if baselines else None
    try:
        if baselines:
            phases["flexsp-style"] = time.perf_counter() - start
        best, candidates = _search(inst, cluster, config, cap, pipe, phases, start)
        milp = None
        if config.use_milp:
            milp = helper.beside(
                lambda: refine_microbatches(
                    inst,
                    cluster,
                    best.microbatches,
                    cap,
                    backend=config.backend,
                    seed=config.seed,
                    max_buckets=config.max_buckets,
                    slice_s=config.milp_slice_s,
                    max_nodes=config.milp_max_nodes,
                    min_gap=config.milp_min_gap,
                    max_solves=scaled_count(config.milp_max_microbatches, len(checked)),
                )
            )
        status, milp_stats = "heuristic", {}
        try:
            # The MILP is with the helper: the caller's work, then the baselines, beside it.
            yield
            scored = (
                _baselines(checked, cost, cluster, sizes, pipe, flexsp, cap) if baselines else []
            )
            if milp is not None:
                best.microbatches, status, milp_stats = milp.result()
                best.total = _objective(best.microbatches, pipe)
        finally:
            if milp is not None:
                milp.close()
    finally:
        if flexsp is not None:
            flexsp.close()  # only where an error left it unfinished: its MILP is waited for
    phases["milp"] = time.perf_counter() - start
    plan = _assemble(inst, cluster, cost, best, lower, 0.0, config, status)
    if pipe is not None:
        plan = price_plan(price(plan, cost, pipelined=True), pipe)
        plan = replace(
            plan, lower_bound_ms=pipeline_lower_bound(lower, min(inst.best), pipe.pp, pipe.vpp)
        )
    elif cost.pass_barrier:  # every pass its own segment: the order is kept
        plan = price(plan, cost)
    else:  # equal layouts together share a segment, their groups balanced over its blocks
        plan = price(balance_segments(group_by_layout(plan), cost), cost)
    if baselines:
        plan = _no_worse_than_baselines(plan, scored, pipe)
    plan.validate(checked, cost, cluster.world_size)
    # Timings cover everything, assembly and validation included.
    solve_ms = (time.perf_counter() - start) * 1e3
    phases["assemble"] = solve_ms / 1e3
    extra = {
        **plan.extra,
        "cpu_ms": round((time.process_time() - cpu_start) * 1e3, 3),
        "milp": milp_stats,
        # Stages the wall-clock cap stopped before their counts did (empty: the counts alone
        # decided this plan, so the same inputs give it on any machine).
        "cut_by_cap": list(cap.cut),
        "candidates": candidates,  # greedy candidates scheduled (a count limit)
        # Wall-clock ms at the end of each phase, for budget diagnostics.
        "phase_end_ms": {k: round(v * 1e3, 3) for k, v in phases.items()},
    }
    return replace(plan, solve_ms=solve_ms, extra=extra)


def _search(
    inst: Instance,
    cluster: Cluster,
    config: SolverConfig,
    cap: Cap,
    pipe: PipelineSpec | None,
    phases: dict[str, float],
    start: float,
) -> tuple[_Candidate, int]:
    """hsp's own search before the MILP: the greedy candidates, then local search (its phases'
    end times go into ``phases``); returns the best and the candidates scheduled."""
    starts, candidates = _greedy_candidates(inst, cluster, config, cap, pipe)
    best = starts[0]
    phases["greedy"] = time.perf_counter() - start
    improve_evals = scaled_count(config.improve_evals, len(inst.lengths))
    if improve_evals > 0:
        # Local search from the best start and from the runner-up of another chunking: the
        # descent ends in different optima (lognormal-dcp: 0.3% behind before it, 1.4% ahead
        # after).
        for cand in starts:
            cand.microbatches, _ = improve(
                inst,
                cluster,
                cand.microbatches,
                cap,
                max_evals=improve_evals,
                merge=pipe is None,  # a pipeline's count stays a multiple of its stages
            )
            cand.total = _objective(cand.microbatches, pipe)
        best = min(starts, key=lambda c: c.total)
    if pipe is not None and improve_evals > 0:
        best.microbatches = _balance_for_pipeline(
            inst, cluster, best.microbatches, pipe, cap, improve_evals
        )
        best.total = _objective(best.microbatches, pipe)
    phases["improve"] = time.perf_counter() - start
    return best, candidates


# A first greedy candidate more than this far above the sum of its micro-batch floors gets one
# more count scheduled even past the deadline (``_greedy_candidates``).
RESCUE_OVER_FLOORS = 1.5


def _pipeline(config: SolverConfig, cost: CostModel, sequences: int) -> PipelineSpec | None:
    """The checked pipeline of ``config`` (None without one), its figures from the stage model."""
    spec = config.pipeline
    if spec is None or spec.pp == 1:
        return None
    from megatron_hsp.planner.cost.parallel import pipeline_spec_for

    checked = pipeline_spec_for(cost, spec.pp, spec.vpp)
    if spec.microbatch_multiple > sequences:
        raise InfeasibleError(
            f"interleaved pipeline (--vpp {spec.vpp}) needs a multiple of --pp {spec.pp} "
            f"micro-batches, at least {spec.pp}, but the batch has {sequences} sequences"
        )
    return replace(checked, order=spec.order, max_order_evals=spec.max_order_evals)


# Under a pipeline, counts up to this many times pp above the memory floor are tried (instead
# of ``SolverConfig.extra_microbatches``): the bubble shrinks with more, smaller micro-batches.
# With the default extra counts, benchmarks/pipeline_moe.py's Qwen3 EP8 PP2 row planned too few
# micro-batches, a large bubble, and lost to static packing at a smaller pack size
# (docs/results/benchmarks.md).
PIPELINE_EXTRA_PER_STAGE = 4

# simulate() calls spent per candidate when candidates are compared (the given and the shaped
# order); the final plan gets the spec's full order search.
QUICK_ORDER_EVALS = 2


def _objective(mbs: list[tuple[float, list[GroupSpec]]], pipe: PipelineSpec | None) -> float:
    """What the search minimises: the summed micro-batch times, or the pipelined step."""
    spans = [span for span, _ in mbs]
    if pipe is None:
        return sum(spans)
    return order_microbatches(spans, replace(pipe, max_order_evals=QUICK_ORDER_EVALS)).step_ms


def _balance_for_pipeline(
    inst: Instance,
    cluster: Cluster,
    mbs: list[tuple[float, list[GroupSpec]]],
    pipe: PipelineSpec,
    cap: Cap | float,
    max_evals: int,
) -> list[tuple[float, list[GroupSpec]]]:
    """Move single sequences from the longest micro-batches to the shortest while the
    pipelined step falls.

    Why: the local search minimises the sum; under a pipeline unequal neighbours also stall the
    steady state (a device waits for a long backward while holding a short forward), so a move
    that keeps the sum but evens the micro-batches shortens the step. Each move re-schedules the
    two micro-batches greedily and is kept only if the pipelined step (quick order) improves;
    the MILP afterwards can only shorten micro-batches, which never lengthens the pipeline.
    """
    cap = Cap.of(cap)
    out = list(mbs)
    current = _objective(out, pipe)
    evals = 0
    improved = True
    while improved and evals < max_evals and not cap.past("improve"):
        improved = False
        order = sorted(range(len(out)), key=lambda b: -out[b][0])
        for a in order[: max(1, len(out) // 4)]:
            ids = sorted((i for _, g in out[a][1] for i in g), key=lambda i: inst.best[i])
            if len(ids) < 2:
                continue
            for b in order[::-1][: max(1, len(out) // 4)]:
                if b == a or out[b][0] >= out[a][0]:
                    continue
                for i in ids:
                    if evals >= max_evals or cap.past("improve"):
                        return out
                    evals += 1
                    left = schedule_microbatch(inst, [j for j in ids if j != i], cluster)
                    right = schedule_microbatch(
                        inst, [*(j for _, g in out[b][1] for j in g), i], cluster
                    )
                    if left is None or right is None:
                        continue
                    trial = list(out)
                    trial[a], trial[b] = left, right
                    t = _objective(trial, pipe)
                    if t < current - 1e-9:
                        out, current, improved = trial, t, True
                        break
                if improved:
                    break
            if improved:
                break
    return out


def _fit_multiple(
    inst: Instance, cluster: Cluster, mbs: list[tuple[float, list[GroupSpec]]], k: int
) -> list[tuple[float, list[GroupSpec]]] | None:
    """``mbs`` with a micro-batch count that is a multiple of ``k``: split the fullest ones.

    Splitting never needs more memory than the original (each half holds a subset), so the
    result is feasible when the greedy builder schedules the halves; None when a split fails
    or every micro-batch holds a single sequence.
    """
    out = list(mbs)
    while len(out) % k:
        sizes = [sum(len(ids) for _, ids in groups) for _, groups in out]
        idx = max(range(len(out)), key=lambda b: (sizes[b], out[b][0]))
        if sizes[idx] < 2:
            return None
        ids = sorted(
            (i for _, g_ids in out[idx][1] for i in g_ids), key=lambda i: (-inst.lengths[i], i)
        )
        halves = [schedule_microbatch(inst, part, cluster) for part in (ids[0::2], ids[1::2])]
        if any(h is None for h in halves):
            return None
        out = out[:idx] + out[idx + 1 :] + [h for h in halves if h is not None]
    return out


def _greedy_candidates(
    inst: Instance,
    cluster: Cluster,
    config: SolverConfig,
    cap: Cap | float,
    pipe: PipelineSpec | None = None,
) -> tuple[list[_Candidate], int]:
    """Try (count, chunking) candidates up to ``config.max_candidates`` schedules (scaled,
    ``scaled_count``); the first always completes, the cap (``greedy``) only cuts a search that
    overruns it.

    Returns the best, then the best of another chunking kind when it is within
    ``RUNNER_UP_WITHIN`` of it (local search starts from both), and the candidates scheduled.
    """
    cap = Cap.of(cap)
    max_candidates = max(1, scaled_count(config.max_candidates, len(inst.lengths)))
    best: _Candidate | None = None
    by_kind: dict[str, _Candidate] = {}
    extra = config.extra_microbatches
    if pipe is not None:  # fewer, larger micro-batches lengthen warm-up and cool-down
        extra = max(extra, PIPELINE_EXTRA_PER_STAGE * pipe.pp)
    counts = candidate_counts(inst, extra)
    m = counts[0]
    tried = 0
    best_m = 0  # the count whose chunking gave ``best``
    # Past the deadline, one more count is still scheduled when the first candidate is far
    # above its micro-batches' floors: at the memory floor's count the builder may only fit by
    # pooling short sequences into huge groups (at 1024 GPUs on Wikipedia, two 512-rank groups
    # and a step several times the next count's; docs/results/solver.md), and a loaded machine
    # spends the whole budget on that first count.
    rescue = False
    # Whether the long-grouped candidate with every sequence scored could beat the best (its
    # floors below it); partial shares are built only then.
    scored_open = False
    # Per-kind climb: the every-count chunkings that have not fitted at any count yet (``unfit``
    # collects the labels that did not fit at this count). The climb goes on while one of them
    # has yet to fit with floors below the best: on long-heavy batches contiguous chunking fits
    # only well above the count where ``long-grouped`` wins, and is best there (sft-long-mix,
    # ZeRO-1: fits from 67 micro-batches, 0.6% ahead; the climb used to stop at 64).
    never_fit = {k for k in EVERY_COUNT_CHUNKINGS if k in config.chunkings}

    def past() -> bool:
        """A plan in hand, no rescue running, and the candidates or the cap spent: stop."""
        if best is None or rescue:
            return False
        return tried >= max_candidates or cap.past("greedy")

    def open_() -> bool:
        return scored_open

    while True:
        # The first candidate always runs, so its chunking ignores the cap too.
        until: Cap | float = cap if best is not None and not rescue else math.inf
        first = m == counts[0]
        kinds = config.chunkings
        # Past the counts near the floor, every kind is built only within two counts of a best
        # that one of the every-count kinds found; otherwise the climb is for the kinds yet to
        # fit. A best from a long chunking (built once, at the first count) gives the others no
        # count of theirs to climb to: on sft-long-mix (ZeRO-1) time-lpt was built at the ten
        # counts below long-grouped's, each scheduled in full and cut off (docs/solver.md,
        # "Solve time, 2026-11-27 (second)").
        if m > counts[-1] and (best_m < m - 2 or not _every_count(best)):
            kinds = tuple(k for k in kinds if k in never_fit)
        chunkings = _chunkings(inst, cluster, m, kinds, first, until, past, open_)
        unfit: set[str] = set()
        for label, chunks in chunkings:
            cutoff = best.total if best is not None else float("inf")
            cand = _schedule_chunks(inst, cluster, chunks, label, cutoff, unfit)
            kind = label.split("/")[0]
            if label not in unfit and kind in never_fit:
                never_fit.discard(kind)  # fitted, or its floors already above the best
            if cand is not None and pipe is not None:
                # A pipelined step is at least the sum, so the sum-based cutoff stays valid.
                fitted = _fit_multiple(inst, cluster, cand.microbatches, pipe.microbatch_multiple)
                cand = None if fitted is None else _Candidate(0.0, fitted, cand.label)
                if cand is not None:
                    cand.total = _objective(cand.microbatches, pipe)
            tried += 1
            if tried == 1 and cand is not None:
                floors = sum(inst.microbatch_floor(c) for c in chunks)
                rescue = cand.total > RESCUE_OVER_FLOORS * floors
            if cand is not None and (best is None or cand.total < best.total - 1e-9):
                # The count to climb from: a long chunking's own count, except the wider ones',
                # whose extra micro-batches come from wider groups, not from a count where the
                # token-based chunkings would do better (climbing to it doubled lognormal-dcp's
                # greedy phase, every count's candidates cut off by the floors).
                grown = not label.startswith("long-grouped:scored")
                best, best_m = cand, max(m, len(chunks)) if grown else m
            if label.startswith("long-grouped:scored/"):
                scored_open = cand is not None or (
                    sum(inst.microbatch_floor(c) for c in chunks) < cutoff
                )
            if cand is not None and (kind not in by_kind or cand.total < by_kind[kind].total):
                by_kind[kind] = cand
        if past():
            return _with_runner_up(best, by_kind), tried
        if rescue and m > counts[0]:
            rescue = False  # one further count done
        if best is not None and m >= counts[-1]:
            # Past the counts near the memory floor, climb while the best is at the last count
            # or the one before: on long-heavy batches the best count can lie well above the
            # floor (memory-bound groups pool or expand better with fewer sequences each).
            climbing = best_m >= m - 1 or never_fit
            if not climbing or m >= len(inst.lengths) or past():
                return _with_runner_up(best, by_kind), tried
            m += 1
            continue
        # Past the deadline with nothing yet: double the count (one schedule per doubling) up to
        # one sequence per micro-batch, the schedule that always fits (check_lengths guaranteed
        # it). Jumping straight there made a loaded machine plan one micro-batch per sequence at
        # 1024 GPUs, many times the step time of the next feasible count.
        if m >= len(inst.lengths):
            break
        late = not rescue and cap.past("greedy")
        m = min(len(inst.lengths), 2 * m) if late else m + 1
    if best is None and not set(config.chunkings) & set(EVERY_COUNT_CHUNKINGS):
        # long-grouped and long-sized are built once, for some batches only.
        raise InputError(
            f"chunkings {config.chunkings!r} do not apply to this batch; include one of "
            f"{EVERY_COUNT_CHUNKINGS}, which every batch has"
        )
    if best is None:  # one sequence per micro-batch always fits: check_lengths guaranteed it
        raise InfeasibleError("no schedule found even with one sequence per micro-batch")
    return _with_runner_up(best, by_kind), tried


def _every_count(cand: _Candidate | None) -> bool:
    """Whether ``cand`` came from a chunking built at every count (``EVERY_COUNT_CHUNKINGS``)."""
    return cand is not None and cand.label.split("/")[0] in EVERY_COUNT_CHUNKINGS


# A runner-up start for local search must be this close to the best greedy candidate.
RUNNER_UP_WITHIN = 0.03


def _with_runner_up(best: _Candidate, by_kind: dict[str, _Candidate]) -> list[_Candidate]:
    kind = best.label.split("/")[0]
    others = [c for k, c in by_kind.items() if k != kind]
    if not others:
        return [best]
    second = min(others, key=lambda c: c.total)
    return [best, second] if second.total <= (1 + RUNNER_UP_WITHIN) * best.total else [best]


def _chunkings(
    inst: Instance,
    cluster: Cluster,
    m: int,
    kinds: tuple[str, ...],
    first: bool,
    deadline: Cap | float = math.inf,
    stop: Callable[[], bool] | None = None,
    scored_open: Callable[[], bool] | None = None,
) -> Iterator[tuple[str, list[list[int]]]]:
    """The distinct chunkings of ``kinds`` into ``m`` micro-batches, in a fixed order, each
    built only when asked for: ``stop()`` true ends them (the caller is past its deadline), so
    none is built that would not be scheduled (each costs a noticeable share of the budget at
    100k sequences).
    ``scored_open()``: whether the all-scored long-grouped candidate's floors were below the
    best; the partial ``SCORED_SHARES`` are built only then."""
    seen: set[tuple[tuple[int, ...], ...]] = set()

    def builds() -> Iterator[tuple[str, Callable[[], list[list[int]] | None]]]:
        # Its count is set by the long sequences' rank needs, not by m: build it once, at the
        # first count, and try it first: when it applies, token-based chunkings are infeasible
        # at counts near the floor, and a loaded machine can spend the whole budget proving it.
        if "long-grouped" in kinds and first:
            yield "long-grouped", lambda: chunk_long_grouped(inst, cluster, m, deadline)
        if "time-lpt" in kinds:
            yield f"time-lpt/{m}", lambda: chunk_time_balanced(inst, m)
        if "long-grouped" in kinds and first:
            # The same, cross-node sequences at ``cross_node_size``: after time-lpt, which
            # decides the rescue below, as the memory-size variant is the one that guarantees a
            # feasible count on long-heavy batches. Partial shares only where the floors of
            # every sequence scored are below the best so far (on sft-long-mix they are far
            # above, and each share would cost schedule time for nothing).
            for share in SCORED_SHARES:
                if share < 1 and not (scored_open is not None and scored_open()):
                    break
                yield (
                    "long-grouped:scored" + ("" if share == 1 else f"-{share:.2f}"),
                    lambda s=share: chunk_long_grouped(inst, cluster, m, deadline, s),
                )
        # After time-lpt: the first candidate decides the rescue (``RESCUE_OVER_FLOORS``).
        if "long-sized" in kinds and first:
            yield "long-sized", lambda: chunk_long_sized(inst, cluster, m, deadline)
        if "contiguous-tokens" in kinds:
            yield f"contiguous-tokens/{m}", lambda: chunk_contiguous(inst, m, "tokens")

    for label, build in builds():
        if stop is not None and stop():
            return
        chunks = build()
        if chunks is None:
            continue
        if label.startswith(("long-grouped", "long-sized")):
            label = f"{label}/{len(chunks)}"
        key = tuple(sorted(tuple(sorted(c)) for c in chunks))
        if key not in seen:
            seen.add(key)
            yield label, chunks


def _schedule_chunks(
    inst: Instance,
    cluster: Cluster,
    chunks: list[list[int]],
    label: str,
    cutoff: float,
    unfit: set[str] | None = None,
) -> _Candidate | None:
    """Greedy schedule of each chunk; None if infeasible (``label`` then goes into ``unfit``)
    or provably no better than ``cutoff``."""
    floors = [inst.microbatch_floor(c) for c in chunks]
    if sum(floors) >= cutoff:
        return None
    mbs: list[tuple[float, list[GroupSpec]]] = []
    done = 0.0
    hint = None
    for b, chunk in enumerate(chunks):
        got = schedule_microbatch(inst, chunk, cluster, hint=hint)
        if got is None:
            if unfit is not None:
                unfit.add(label)
            return None
        hint = got[0] / floors[b] if floors[b] > 0 else None
        mbs.append(got)
        done += got[0]
        if done + sum(floors[b + 1 :]) >= cutoff:
            return None
    return _Candidate(sum(s for s, _ in mbs), mbs, label)


def _assemble(
    inst: Instance,
    cluster: Cluster,
    cost: CostModel,
    cand: _Candidate,
    bound: float,
    solve_ms: float,
    config: SolverConfig,
    status: str,
) -> Plan:
    splits: dict[int, tuple[int, int]] = {}  # per size, asked once (11k groups at 16k GPUs)
    # Longest micro-batch first: deterministic, and the runtime sees the heavy pass early.
    ordered = sorted(cand.microbatches, key=lambda mb: (-mb[0], _first_id(mb[1])))
    microbatches = []
    for _, groups in ordered:
        placed = place_groups(inst, groups, cluster)
        assert placed is not None, "scheduler returned groups that do not tile"
        out_groups = []
        ests = iter(group_times(inst, [(len(ranks), ids) for ranks, ids in placed]))
        for ranks, ids in placed:
            d = len(ranks)
            est = next(ests)[1] if ids else 0.0
            if d not in splits:
                splits[d] = cost.recorded_split(d)
            u, r = splits[d]
            out_groups.append(
                Group(
                    ranks=ranks,
                    seq_ids=ids,
                    lengths=tuple(map(inst.lengths.__getitem__, ids)),
                    est_ms=est,
                    ulysses=u,
                    ring=r,
                )
            )
        span = max(g.est_ms for g in out_groups)
        microbatches.append(MicroBatch(groups=tuple(out_groups), est_ms=span))
    total = sum(mb.est_ms for mb in microbatches)
    return Plan(
        world_size=cluster.world_size,
        gpus_per_node=cluster.gpus_per_node,
        microbatches=tuple(microbatches),
        cost_model=cost.name,
        est_step_ms=total,
        lower_bound_ms=bound,
        solve_ms=solve_ms,
        solver=config.backend if config.use_milp else "greedy",
        status=status,
        extra={"chunking": cand.label, "sizes": list(inst.sizes)},
    )


def _flexsp_style_start(
    lengths: Sequence[int],
    cost: CostModel,
    cluster: Cluster,
    config: SolverConfig,
    cap: Cap,
    helper: Helper,
) -> Generator[None, None, Plan] | None:
    """The ``flexsp-style`` search of this batch (``search/flexsp_style.py``) up to its MILP,
    which it leaves with ``helper``; None where FlexSP's sizes cannot plan it. Its plan comes
    from ``_flexsp_style_plan``.

    Why score it: the search prices its candidates by summed micro-batch times, and the
    execution model prices segments of equal layouts, where the restricted search's placements
    can come out cheaper (sft-long-mix on the calibrated model, docs/results). Its work is
    limited by the same counts as the search's; the wall clock left under the cap is its
    safety cap, and what that cuts is recorded as ``flexsp-style:<stage>`` (``flexsp-style``
    where the cap had passed before it started, and it was not run).
    """
    if cap.past("flexsp-style"):  # the cap is a safety net: no second search past it
        return None
    try:
        restricted = flexsp_style_config(cost, cluster, config, config.sizes)
    except InputError:  # no power-of-two size >= 2 among the allowed ones
        return None
    restricted = replace(restricted, time_budget_s=max(0.0, cap.left()))
    steps = _solve_steps(lengths, cost, cluster, restricted, helper, False, False)
    try:
        next(steps)
    except (InfeasibleError, InputError):  # a sequence only a size FlexSP lacks can hold
        return None
    return steps


def _flexsp_style_plan(steps: Generator[None, None, Plan] | None, cap: Cap) -> Plan | None:
    """The plan of a ``_flexsp_style_start`` search (None: it had none)."""
    if steps is None:
        return None
    try:
        plan = finish(steps)
    except (InfeasibleError, InputError):
        return None
    for stage in plan.extra.get("cut_by_cap", []):
        cap.mark(f"flexsp-style:{stage}")
    return plan


Scored = list[tuple[float, str, Plan]]


def _baselines(
    lengths: Sequence[int],
    cost: CostModel,
    cluster: Cluster,
    sizes: Sequence[int],
    pipe: PipelineSpec | None,
    flexsp_search: Generator[None, None, Plan] | None,
    cap: Cap,
) -> Scored:
    """(price, name, plan) of the baselines ``solve`` never returns a plan worse than: the
    cheapest valid homogeneous layout (``homogeneous.cheapest_homogeneous``) and the
    ``flexsp-style`` plan (``flexsp_search``, from ``_flexsp_style_start``), each validated
    with the cost model's memory, executable at its split, and priced by the same function as
    the search's plan (under a pipeline, ordered by the same schedule). Independent of hsp's
    own search."""
    homogeneous = cheapest_homogeneous(
        lengths, cost, cluster, sizes, None if pipe is None else lambda p: _piped(p, cost, pipe)
    )
    flexsp = _flexsp_style_plan(flexsp_search, cap)
    flexsp = None if flexsp is None else _piped(flexsp, cost, pipe)
    return [*([homogeneous] if homogeneous else []),
            *([(flexsp.est_step_ms, "flexsp-style", flexsp)] if flexsp else [])]  # fmt: skip


def _no_worse_than_baselines(plan: Plan, scored: Scored, pipe: PipelineSpec | None) -> Plan:
    """``plan``, or the cheapest baseline plan's passes (``_baselines``) where that is priced
    lower. ``extra["homogeneous_best"]`` names the cheapest homogeneous candidate and its
    price, ``extra["flexsp_style_ms"]`` the ``flexsp-style`` price (None where it could not
    plan); ``extra["chunking"]`` says when a baseline was taken.
    """
    homogeneous = next((t for t in scored if t[1] != "flexsp-style"), None)
    extra = dict(plan.extra)
    if homogeneous:
        ms, name, _ = homogeneous
        extra["homogeneous_best"] = {"layout": name, "est_step_ms": round(ms, 3)}
    flexsp_ms = [round(t[0], 3) for t in scored if t[1] == "flexsp-style"]
    extra["flexsp_style_ms"] = flexsp_ms[0] if flexsp_ms else None
    if not scored:
        return replace(plan, extra=extra)
    ms, name, cand = min(scored, key=lambda t: (t[0], t[1]))
    if ms >= plan.est_step_ms:
        return replace(plan, extra=extra)
    flexsp_won = name == "flexsp-style"
    extra["chunking"] = f"{name}:{cand.extra['chunking']}" if flexsp_won else f"homogeneous:{name}"
    return replace(
        plan,
        microbatches=cand.microbatches,
        est_step_ms=cand.est_step_ms,
        extra={**extra, **({"pipeline": cand.extra["pipeline"]} if pipe is not None else {})},
    )


def _piped(plan: Plan, cost: CostModel, pipe: PipelineSpec | None) -> Plan | None:
    """``plan`` priced under ``pipe`` in its own order (None: a count the interleaved schedule
    refuses); unchanged without a pipeline."""
    if pipe is None:
        return plan
    try:
        return price_plan(price(plan, cost, pipelined=True), pipe)
    except InputError:
        return None


def _first_id(groups: list[GroupSpec]) -> int:
    return min((min(ids) for _, ids in groups if ids), default=-1)


__all__ = ["BACKENDS", "CHUNKINGS", "SolverConfig", "solve"]
