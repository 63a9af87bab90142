"""Benchmark harness: the same batches, cost model and validator for every method (torch-free).

Methods: ``hsp`` (our solver), ``static-N``, ``static-best`` (hindsight), ``batchada``,
``flexsp-style`` (FlexSP's planner emulated on our solver, ``baselines.flexsp_style_config``),
``dp-balanced-N`` / ``dp-balanced`` (Megatron's packing scheduler; hindsight CP size) and
``lower-bound``; callers may add more (``megatron-hsp bench`` adds ``megatron-dcp``, which needs
torch, and ``megatron-dcp-dev``, which runs a Megatron-LM checkout's code, so both are injected
from outside ``planner/``). Every plan is checked with
``Plan.validate(lengths, cost, world_size)``; speedups are ratios of summed estimated step
times over the same batches (baseline / hsp), as docs/design.md section 3 defines.

Under a pipeline (``run_bench(..., pipeline=PipelineSpec)``, with the stage cost model of
``planner/cost/parallel.py``) every method's plan is priced by the same
``pipeline.price_plan``: hsp's solver orders its micro-batches to shrink the bubble; the baselines
keep the order their
schedulers emit (that is how they run), and under interleaving a baseline whose micro-batch count
is not a multiple of pp is infeasible, as megatron-core's interleaved schedule refuses it. The
lower bound becomes ``pipeline.pipeline_lower_bound`` of the summed bound.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import resource
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from megatron_hsp.evaluation.baselines import (
    StockCP,
    batchada_plan,
    dp_balanced_best_degree,
    dp_balanced_plan,
    flexsp_style_plan,
    megatron_static_plan,
    static_best_degree,
    static_plan,
    stock_from_name,
    trained_lengths,
)
from megatron_hsp.planner import groupspace
from megatron_hsp.planner.cost.costmodel import CostModel
from megatron_hsp.planner.cost.execution import price, step_wall_ms
from megatron_hsp.planner.cost.pipeline import PipelineSpec, pipeline_lower_bound, price_plan
from megatron_hsp.planner.errors import InfeasibleError, InputError
from megatron_hsp.planner.lengths import GlobalBatch
from megatron_hsp.planner.plan import Plan
from megatron_hsp.planner.search.settings import PlannerSettings
from megatron_hsp.planner.topology import Cluster

PlanFn = Callable[[np.ndarray], Plan]
DEFAULT_METHODS = ("hsp", "static-best", "batchada", "dp-balanced", "megatron-dcp")
_STATIC = re.compile(r"^static-(\d+)$")
_DP_BALANCED = re.compile(r"^dp-balanced-(\d+)$")


def hsp_plan_fn(cost: CostModel, cluster: Cluster, settings: PlannerSettings) -> PlanFn:
    """``hsp``: the MILP planner, imported only when asked for."""
    try:
        from megatron_hsp.planner.search.solver import solve
    except ImportError as exc:
        raise InputError(
            f"method hsp needs megatron_hsp.planner.search.solver, which this build lacks ({exc}); "
            "choose another method: static-N, static-best, batchada or megatron-dcp"
        ) from None
    config = settings.solver_config()
    return lambda lengths: solve([int(x) for x in lengths], cost, cluster, config)


LP_BOUND_LIMIT_S = 2.0  # column-generation time per batch for ``lower-bound`` (docs/solver.md)


def plan_fn(
    name: str,
    cost: CostModel,
    cluster: Cluster,
    *,
    hsp: PlannerSettings | None = None,
    sizes: Sequence[int] | None = None,
    stock: StockCP | None = None,
    extra_methods: Mapping[str, Callable[[], PlanFn]] | None = None,
    flag: str = "--methods",
) -> PlanFn:
    """``lengths -> Plan`` (not yet priced) of one per-batch method: the one dispatch of method
    names that ``bench``, ``plan`` and training's ``--hsp-plan-method``
    (``torch_side/methods.method_plan_fn``) share. ``extra_methods``: factories of the
    torch-based methods (``torch_side/methods.torch_methods``). The hindsight methods
    (``static-best``, ``dp-balanced``) and ``lower-bound`` look at many batches: refused here."""
    extra_methods = extra_methods or {}
    if name == "hsp":
        return hsp_plan_fn(cost, cluster, hsp or PlannerSettings())
    if name == "batchada":
        return lambda b: batchada_plan(b, cost, cluster, sizes)
    if name == "flexsp-style":
        # hsp's backend, budget and seed; FlexSP's choices on top (baselines.py)
        base = (hsp or PlannerSettings()).solver_config()
        return functools.partial(
            flexsp_style_plan, cost=cost, cluster=cluster, base=base, sizes=sizes
        )
    if m := _STATIC.match(name):
        degree = int(m.group(1))
        return lambda b: static_plan(b, cost, cluster, degree)
    if (cp := stock_from_name(name)) is not None:
        if stock is None:
            raise InputError(
                f"{flag} {name}: stock Megatron's static CP is priced from a Megatron job's "
                "flags (--seq-length, --micro-batch-size, --cp-comm-type); drop "
                "--flexsp-harness or that method"
            )
        job = dataclasses.replace(stock, cp=cp)
        return lambda b: megatron_static_plan(b, cost, cluster, job)
    if m := _DP_BALANCED.match(name):
        degree = int(m.group(1))
        return lambda b: dp_balanced_plan(b, cost, cluster, degree)
    if name in extra_methods:
        return extra_methods[name]()
    if name in ("static-best", "dp-balanced", "lower-bound"):
        raise InputError(f"{flag} {name} is chosen over several batches; use `megatron-hsp bench`")
    raise InputError(f"{flag}: {name!r} is not available in this build")


def lower_bound_fn(
    cost: CostModel, cluster: Cluster, sizes: Sequence[int] | None
) -> Callable[[np.ndarray], float] | None:
    """``lower-bound`` from ``megatron_hsp.planner.search.bounds``, or None when that module is
    absent."""
    try:
        from megatron_hsp.planner.search.bounds import lower_bound_ms
    except ImportError:
        return None
    return lambda lengths: float(lower_bound_ms([int(x) for x in lengths], cost, cluster, sizes))


def lower_bounds_fn(
    cost: CostModel, cluster: Cluster, sizes: Sequence[int] | None
) -> Callable[[np.ndarray], tuple[float, float, bool, float]] | None:
    """Both bounds for the ``lower-bound`` method: (combinatorial, configuration LP, converged,
    restricted-master value). The last is an upper bound on the LP's value, not a step bound: it
    says how much the LP could add at most when its column generation was stopped early.

    The method's step time is the larger, so ``gap_to_lower_bound`` uses ``max(combinatorial,
    LP)``; the LP's column generation gets ``LP_BOUND_LIMIT_S`` per batch and, when stopped
    early, contributes its (weaker) scaled-dual bound.
    """
    comb = lower_bound_fn(cost, cluster, sizes)
    try:
        from megatron_hsp.planner.search.bounds import lp_lower_bound_ms
    except ImportError:
        return None
    if comb is None:
        return None

    def both(lengths: np.ndarray) -> tuple[float, float, bool, float]:
        ls = [int(x) for x in lengths]
        lp = lp_lower_bound_ms(ls, cost, cluster, sizes, time_limit_s=LP_BOUND_LIMIT_S)
        return comb(lengths), lp.bound_ms, lp.converged, lp.lp_ms

    return both


def parse_methods(text: str | Sequence[str]) -> list[str]:
    names = [m.strip() for m in (text.split(",") if isinstance(text, str) else text) if m.strip()]
    known = {
        "hsp",
        "static-best",
        "batchada",
        "flexsp-style",
        "megatron-dcp",
        "megatron-dcp-dev",
        "dp-balanced",
        "lower-bound",
    }
    bad = [
        m
        for m in names
        if m not in known
        and not (_STATIC.match(m) or _DP_BALANCED.match(m) or stock_from_name(m) is not None)
    ]
    if bad or not names:
        raise InputError(
            f"--methods: unknown {bad or 'empty list'}; choose from hsp, megatron-static-cpN "
            "(stock Megatron's static CP N of your flags), static-best, static-N "
            "(e.g. static-64), batchada, flexsp-style, megatron-dcp, megatron-dcp-dev, "
            "dp-balanced, dp-balanced-N, lower-bound"
        )
    return list(dict.fromkeys(names))


@dataclass
class MethodResult:
    # None where the method cannot plan that batch under the memory cap (e.g. static-32 with a
    # sequence longer than 32 ranks hold); such a method gets no total and no speedup.
    step_ms: list[float | None] = field(default_factory=list)
    # Per batch, the whole step (``execution.step_wall_ms``: the passes plus what every method
    # pays once a step, gradient reduction and optimizer): what the gains are quoted on.
    wall_ms: list[float] = field(default_factory=list)
    solve_ms: list[float] = field(default_factory=list)
    microbatches: list[int] = field(default_factory=list)
    valid: list[bool] = field(default_factory=list)
    # Whether the runtime can execute every group (None: the cost model knows no heads).
    executable: list[bool | None] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    infeasible: list[str] = field(default_factory=list)
    # Per batch, the stages the wall-clock cap stopped (hsp's ``plan.extra["cut_by_cap"]``; empty:
    # the work counts decided the plan, the same on any machine).
    cut_by_cap: list[list[str]] = field(default_factory=list)
    # Per batch, the tokens the plan trains (every row of a bench trains the same batches: the
    # summary checks it and says which comparison each gain is).
    tokens: list[int] = field(default_factory=list)
    # Per batch, the plan's fingerprint (``Plan.fingerprint``): two runs of the same inputs,
    # on an idle and a loaded machine, must print the same ones (issue 30's load check).
    fingerprints: list[str] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def complete(self) -> bool:
        return not self.infeasible

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"step_ms": self.step_ms, "solve_ms": self.solve_ms}
        if self.wall_ms:
            d["step_wall_ms"] = self.wall_ms
        if self.tokens:
            d["tokens"] = self.tokens
        if self.microbatches:
            d["microbatches"] = self.microbatches
        if self.valid:
            d["valid"] = all(self.valid)
        if self.executable:
            d["executable"] = (
                None if None in self.executable else all(bool(x) for x in self.executable)
            )
        if self.problems:
            d["problems"] = self.problems[:10]  # invalid or not executable
        if any(self.cut_by_cap):
            d["cut_by_cap"] = self.cut_by_cap
        if self.fingerprints:
            d["fingerprints"] = self.fingerprints
        if self.infeasible:
            d["infeasible_batches"] = len(self.infeasible)
            d["infeasible_reason"] = self.infeasible[0]
        d.update(self.extra)
        return d


def _record(res: MethodResult, plan: Plan, lengths: np.ndarray, cost: CostModel, ms: float) -> None:
    # What the plan trains: THD-padded sequences, or a stock run's packed-sample units.
    problems = plan.problems(trained_lengths(plan, lengths).tolist(), cost, plan.world_size)
    heads = cost.head_space()
    not_runnable = [] if heads is None else groupspace.problems(plan, heads)
    res.step_ms.append(float(plan.est_step_ms))
    res.wall_ms.append(step_wall_ms(plan, cost))
    res.solve_ms.append(float(ms))
    res.microbatches.append(len(plan.microbatches))
    res.tokens.append(sum(g.tokens for mb in plan.microbatches for g in mb.groups))
    res.cut_by_cap.append(list(plan.extra.get("cut_by_cap", [])))
    res.fingerprints.append(plan.fingerprint())
    res.valid.append(not problems)
    res.executable.append(None if heads is None else not not_runnable)
    res.problems.extend(problems + not_runnable)


def _pct(xs: Sequence[float], q: float) -> float | None:
    return float(np.percentile(np.asarray(xs, dtype=np.float64), q)) if xs else None


def _peak_rss_mb() -> float:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 1024  # bytes on macOS, KiB else


def run_bench(
    batches: Sequence[GlobalBatch],
    cost: CostModel,
    cluster: Cluster,
    methods: Sequence[str],
    *,
    hsp: PlannerSettings | None = None,
    sizes: Sequence[int] | None = None,
    extra_methods: Mapping[str, Callable[[], PlanFn]] | None = None,
    progress: Callable[[str], None] | None = None,
    plans_sink: Mapping[str, list[Plan]] | None = None,
    pipeline: PipelineSpec | None = None,
    stock: StockCP | None = None,
) -> dict[str, Any]:
    """Run ``methods`` on ``batches``; return docs/design.md's ``methods`` and ``summary`` blocks.

    ``stock``: how the user's stock Megatron run trains a step (``baselines.StockCP``, from
    their flags), which ``megatron-static-cp<N>`` rows price at CP N; None outside a Megatron
    job (those rows are then refused).

    ``extra_methods`` maps a name to a factory of its plan function (built only if requested),
    which is how torch-based baselines join without ``planner/`` importing torch. They run after
    the torch-free methods, so ``planner_peak_rss_mb`` is measured before torch is loaded.
    ``plans_sink`` maps method names to lists that receive that method's plans (for pictures).
    ``pipeline`` prices every plan under that schedule (module docstring); hsp's settings must
    name the same pp/vpp.
    """
    hsp = hsp or PlannerSettings()
    if pipeline is not None and pipeline.pp == 1:
        pipeline = None
    if pipeline is not None and (hsp.pp, hsp.vpp) != (pipeline.pp, pipeline.vpp):
        raise InputError(
            f"bench: hsp plans for pp {hsp.pp} vpp {hsp.vpp} but the pipeline is pp "
            f"{pipeline.pp} vpp {pipeline.vpp}"
        )

    def piped(plan: Plan) -> Plan:
        """A baseline's plan priced by the one price function (``execution.price``), under the
        pipeline in its own order."""
        ring = str(plan.extra.get("ring", "overlap"))
        if pipeline is None:
            return price(plan, cost, ring)
        return price_baseline(plan, cost, pipeline, ring)

    extra_methods = dict(extra_methods or {})
    lengths = [np.asarray(b.lengths, dtype=np.int64) for b in batches]
    if not lengths:
        raise InputError("--steps must be >= 1")
    results: dict[str, MethodResult] = {}
    ordered = sorted(methods, key=lambda m: m in extra_methods)  # torch-based ones last
    planner_rss: float | None = None
    for name in ordered:
        if name in extra_methods and planner_rss is None:
            planner_rss = _peak_rss_mb()
        if progress:
            progress(name)
        res = MethodResult()
        if name == "lower-bound":
            bound = _lower_bound_result(lengths, cost, cluster, sizes, pipeline)
            if bound is not None:
                results[name] = bound
            continue
        if name in ("static-best", "dp-balanced"):
            results[name] = _hindsight_result(name, lengths, cost, cluster, sizes, piped)
            continue
        fn = plan_fn(
            name, cost, cluster, hsp=hsp, sizes=sizes, stock=stock, extra_methods=extra_methods
        )
        degrees: list[int] = []
        statuses: list[str] = []
        for step, b in enumerate(lengths):
            t0 = time.perf_counter()
            try:
                plan = fn(b)
                if name != "hsp":
                    plan = piped(plan)
                elif pipeline is None:
                    plan = price(plan, cost)  # the one price function, as every method's
            except InfeasibleError as exc:
                if name == "hsp":
                    raise
                res.step_ms.append(None)
                res.solve_ms.append((time.perf_counter() - t0) * 1e3)
                res.infeasible.append(f"batch {batches[step].step}: {exc}")
                continue
            except InputError as exc:
                if name == "hsp" or pipeline is None:
                    raise
                res.step_ms.append(None)  # e.g. a count interleaving refuses
                res.solve_ms.append((time.perf_counter() - t0) * 1e3)
                res.infeasible.append(f"batch {batches[step].step}: {exc}")
                continue
            ms = (time.perf_counter() - t0) * 1e3
            _record(res, plan, b, cost, ms)  # wall clock around the whole call
            if plans_sink and name in plans_sink:
                plans_sink[name].append(plan)
            statuses.append(plan.status)
            if "degree" in plan.extra:
                degrees.append(int(plan.extra["degree"]))
        if name == "batchada":
            res.extra["degrees"] = degrees
        if name == "hsp":
            res.extra["status"] = statuses
        results[name] = res
    if planner_rss is None:
        planner_rss = _peak_rss_mb()
    return {
        "methods": {k: v.to_dict() for k, v in results.items()},
        "summary": summarize(results, planner_rss),
    }


def _lower_bound_result(
    lengths: Sequence[np.ndarray],
    cost: CostModel,
    cluster: Cluster,
    sizes: Sequence[int] | None,
    pipeline: PipelineSpec | None,
) -> MethodResult | None:
    """``lower-bound``'s row: per batch the larger of the combinatorial and the LP bound (under
    the pipeline when there is one); None where the cost model gives no bound."""
    lb = lower_bounds_fn(cost, cluster, sizes)
    if lb is None:
        return None
    res = MethodResult()
    combinatorial, lp_bound, converged, masters = [], [], [], []
    for b in lengths:
        t0 = time.perf_counter()
        comb, lpb, conv, master = lb(b)
        if pipeline is not None:
            shortest = shortest_microbatch_ms(b, cost, cluster, sizes)
            comb, lpb = (
                pipeline_lower_bound(x, shortest, pipeline.pp, pipeline.vpp) for x in (comb, lpb)
            )
        # A whole step's bound: every plan pays the same once-a-step cost beyond its passes.
        res.step_ms.append(max(comb, lpb))
        res.solve_ms.append((time.perf_counter() - t0) * 1e3)
        combinatorial.append(comb)
        lp_bound.append(lpb)
        converged.append(conv)
        masters.append(master)
    res.extra["bound"] = "max(combinatorial, lp) per batch"
    res.extra["combinatorial_ms"] = combinatorial
    res.extra["lp_ms"] = lp_bound
    res.extra["lp_converged"] = converged
    res.extra["lp_master_ms"] = masters  # >= the LP value; not a bound on the step
    return res


def _hindsight_result(
    name: str,
    lengths: Sequence[np.ndarray],
    cost: CostModel,
    cluster: Cluster,
    sizes: Sequence[int] | None,
    piped: Callable[[Plan], Plan],
) -> MethodResult:
    """``static-best`` / ``dp-balanced``: the one degree best over all batches, in hindsight,
    each degree's plans priced by ``piped`` (the one price function, under the pipeline)."""
    res = MethodResult()
    t0 = time.perf_counter()
    hindsight = static_best_degree if name == "static-best" else dp_balanced_best_degree
    try:
        best, per_degree = hindsight(lengths, cost, cluster, sizes)
        per_degree = _piped_degrees(per_degree, piped)
        best = min(sorted(per_degree), key=lambda d: sum(p.est_step_ms for p in per_degree[d]))
    except (InfeasibleError, ValueError) as exc:
        res.step_ms = [None] * len(lengths)
        res.infeasible.append(str(exc) or "no degree runs under the pipeline")
        return res
    elapsed = (time.perf_counter() - t0) * 1e3 / len(lengths)
    for plan, b in zip(per_degree[best], lengths, strict=True):
        _record(res, plan, b, cost, elapsed)
    res.extra["degree"] = best
    res.extra["total_s_by_degree"] = {
        str(d): sum(p.est_step_ms for p in ps) / 1e3 for d, ps in sorted(per_degree.items())
    }
    return res


def price_baseline(
    plan: Plan, cost: CostModel, pipeline: PipelineSpec, ring: str = "overlap"
) -> Plan:
    """A baseline's plan under the pipeline, in its scheduler's order: every pass (a plan's
    micro-batch; a Megatron CP group's sub-samples are one pass each) is a pipeline micro-batch,
    priced by the stage model's execution model (every pass a barrier), as hsp's are."""
    return price_plan(price(plan, cost, ring, pipelined=True), pipeline, reorder=False)


def _piped_degrees(
    per_degree: Mapping[int, list[Plan]], piped: Callable[[Plan], Plan]
) -> dict[int, list[Plan]]:
    """Each degree's plans priced under the pipeline; degrees it cannot run are left out."""
    out: dict[int, list[Plan]] = {}
    for d, plans in per_degree.items():
        try:
            out[d] = [piped(p) for p in plans]
        except InputError:
            continue
    return out


def shortest_microbatch_ms(
    lengths: np.ndarray, cost: CostModel, cluster: Cluster, sizes: Sequence[int] | None
) -> float:
    """The cheapest micro-batch any plan can have: the shortest sequence in its best group."""
    shortest = int(np.min(lengths))
    usable = [d for d in (sizes or cost.sizes) if cluster.size_fits(d)]
    return min(cost.group_ms([shortest], d) for d in usable if cost.fits([shortest], d))


def _all_executable(results: Mapping[str, MethodResult]) -> bool | None:
    """Every plan of every method runs on the runtime; None when the cost model knows no heads."""
    flags = [x for k, v in results.items() if k != "lower-bound" for x in v.executable]
    if not flags or None in flags:
        return None
    return all(bool(x) for x in flags)


def token_comparison(results: Mapping[str, MethodResult]) -> dict[str, Any]:
    """``tokens_per_step`` (mean tokens a row's plans train per step) and ``comparison`` (per
    row against hsp: ``equal tokens`` when every step trains exactly hsp's tokens, else why
    not). Why: a speedup is only a speedup at equal work (issue 43); every row plans the same
    batches, and this checks it from the plans themselves rather than assuming it."""
    per_step = {k: v.tokens for k, v in results.items() if v.tokens}
    mean = {k: float(np.mean(v)) for k, v in per_step.items()}
    ref = per_step.get("hsp")
    comparison: dict[str, str] = {}
    for name, toks in per_step.items():
        if name == "hsp" or ref is None:
            continue
        if not results[name].complete:
            comparison[name] = "not compared: infeasible on some batches"
        elif toks == ref:
            comparison[name] = "equal tokens"
        else:
            comparison[name] = (
                f"NOT equal tokens: {mean[name]:.0f} per step against hsp's {mean['hsp']:.0f}"
            )
    return {"tokens_per_step": mean, "comparison": comparison}


def summarize(results: Mapping[str, MethodResult], planner_rss_mb: float) -> dict[str, Any]:
    """docs/design.md's summary keys (None where a method did not run) plus extras."""
    total = {k: float(sum(v.step_ms)) for k, v in results.items() if v.complete}  # type: ignore[arg-type]
    hsp_total = total.get("hsp")
    # Gains on whole step times (issue 43): each row's passes plus the once-a-step cost every
    # method pays; the gap to the bound stays on the passes, where the bound is defined.
    wall = {
        k: float(sum(v.wall_ms))
        for k, v in results.items()
        if v.complete and len(v.wall_ms) == len(v.step_ms)
    }
    hsp_wall = wall.get("hsp")

    def speedup(name: str) -> float | None:
        if hsp_wall is None or name not in wall or hsp_wall <= 0:
            return None
        return wall[name] / hsp_wall

    out: dict[str, Any] = {
        "speedup_vs_static_best": speedup("static-best"),
        "speedup_vs_batchada": speedup("batchada"),
        "speedup_vs_flexsp_style": speedup("flexsp-style"),
        "speedup_vs_megatron_dcp": speedup("megatron-dcp"),
        "speedup_vs_megatron_dcp_dev": speedup("megatron-dcp-dev"),
        "speedup_vs_dp_balanced": speedup("dp-balanced"),
        "gap_to_lower_bound": (
            hsp_total / total["lower-bound"] - 1.0
            if hsp_total is not None and total.get("lower-bound")
            else None
        ),
        "solve_ms_p50": _pct(results["hsp"].solve_ms, 50) if "hsp" in results else None,
        "solve_ms_p99": _pct(results["hsp"].solve_ms, 99) if "hsp" in results else None,
        "all_plans_valid": all(all(v.valid) for k, v in results.items() if k != "lower-bound"),
        "all_plans_executable": _all_executable(results),
    }
    for name in results:
        if _STATIC.match(name) or stock_from_name(name) is not None:
            out[f"speedup_vs_{name.replace('-', '_')}"] = speedup(name)
    out["total_step_s"] = {k: v / 1e3 for k, v in total.items()}
    out["total_step_wall_s"] = {k: v / 1e3 for k, v in wall.items()}
    out.update(token_comparison(results))
    out["planner_peak_rss_mb"] = planner_rss_mb
    return out
