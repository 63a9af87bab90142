"""Solver targets: FlexSP comparison, gap to the lower bound, solve time, scale, memory.

Run from the repo root (needs ../shared/data/wikipedia_lengths.txt.gz):

    PYTHONPATH=$PWD .venv/bin/python benchmarks/solver_targets.py [--quick] [--write-docs]

Prints one table per target and, with ``--write-docs``, rewrites docs/results/solver.md's results
section.
Static baselines here are deliberately simple (best-fit-decreasing bins of one degree, packed
``N / d`` per micro-batch, longest bins first); the official baselines live in
``evaluation/baselines.py`` and ``megatron-hsp bench``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import gzip
import os
import platform
import resource
import sys
import time
import tracemalloc
from pathlib import Path

import numpy as np

from megatron_hsp.evaluation.baselines import flexsp_style_config
from megatron_hsp.planner.cost.costmodel import CostModel, flexsp_cost_model, load_cost_model
from megatron_hsp.planner.search.settings import SolverConfig
from megatron_hsp.planner.search.solver import solve
from megatron_hsp.planner.topology import Cluster

DATA = Path("../shared/data/wikipedia_lengths.txt.gz")
DOC = Path("docs/results/solver.md")
# FlexSP's own plans measured with its code (Wikipedia, gpt-7b, 192k, 64 GPUs, GBS 512, batches
# 0-9, SCIP 2 s limit): see the planner issue.
FLEXSP_TOTAL_S = 42.83
FLEXSP_STATIC64_S = 68.50
FLEXSP_BATCHADA_S = 55.38
FLEXSP_SOLVE_S = 2.75


def load_lengths() -> np.ndarray:
    if not DATA.exists():
        sys.exit(f"missing {DATA}: run from the repo root with ../shared beside it")
    with gzip.open(DATA, "rt") as fh:
        return np.array([int(line) for line in fh if line.strip()], dtype=np.int64)


def flexsp_rules(raw: np.ndarray, world: int, max_seq_k: int) -> np.ndarray:
    """FlexSP's harness: pad to a multiple of 2N, drop lengths above max_seq*1000 - 2N."""
    step = 2 * world
    padded = ((raw - 1) // step + 1) * step
    return padded[padded <= max_seq_k * 1000 - step]


def batches(data: np.ndarray, gbs: int, steps: int, sampling: str, seed: int = 0):
    if sampling == "sequential":
        return [data[i * gbs : (i + 1) * gbs].tolist() for i in range(steps)]
    rng = np.random.default_rng(seed)
    return [rng.choice(data, size=gbs, replace=False).tolist() for _ in range(steps)]


# ---------------------------------------------------------------------- simple static baseline
def static_ms(lengths: list[int], cost: CostModel, cluster: Cluster, d: int) -> float | None:
    """One degree ``d`` for every sequence: BFD bins of d*cap tokens, N/d bins per micro-batch."""
    cap = cost.capacity(d)
    if max(lengths) > cap:
        return None
    bins: list[list[int]] = []
    room: list[int] = []
    for s in sorted(lengths, reverse=True):
        best, best_room = -1, cap + 1
        for b, r in enumerate(room):
            if s <= r < best_room:
                best, best_room = b, r
        if best < 0:
            bins.append([s])
            room.append(cap - s)
        else:
            bins[best].append(s)
            room[best] -= s
    per_mb = cluster.world_size // d
    times = sorted((cost.group_ms(b, d) for b in bins), reverse=True)
    return sum(times[i] for i in range(0, len(times), per_mb))


def static_table(batch_list, cost, cluster) -> dict[int, list[float | None]]:
    sizes = [d for d in cluster.power_of_two_sizes() if d in cost.sizes]
    return {d: [static_ms(b, cost, cluster, d) for b in batch_list] for d in sizes}


def static_best_and_batchada(table) -> tuple[float, float]:
    feasible = {d: sum(v) for d, v in table.items() if all(x is not None for x in v)}
    best = min(feasible.values())
    steps = len(next(iter(table.values())))
    ada = sum(min(v[i] for v in table.values() if v[i] is not None) for i in range(steps))
    return best, ada


# ---------------------------------------------------------------------- runs
def run_plans(batch_list, cost, cluster, config):
    plans = []
    for lengths in batch_list:
        plan = solve(lengths, cost, cluster, config)
        plan.validate(lengths, cost, cluster.world_size)
        plans.append(plan)
    return plans


def pct(xs, q):
    return float(np.percentile(np.asarray(xs), q))


def summarise(plans) -> dict[str, float]:
    est = sum(p.est_step_ms for p in plans)
    lb = sum(p.lower_bound_ms for p in plans)
    solve_ms = [p.solve_ms for p in plans]
    cpu_ms = [p.extra["cpu_ms"] for p in plans]
    return {
        "cpu_p50_ms": pct(cpu_ms, 50),
        "cpu_p99_ms": pct(cpu_ms, 99),
        "total_s": est / 1e3,
        "lb_s": lb / 1e3,
        "gap": est / lb - 1,
        "worst_gap": max(p.est_step_ms / p.lower_bound_ms - 1 for p in plans),
        "p50_ms": pct(solve_ms, 50),
        "p99_ms": pct(solve_ms, 99),
        "max_ms": max(solve_ms),
    }


def lp_check(limit_s: float, budget: float) -> int:
    """Both bounds and the LP's restricted master on the first batch of each suite distribution
    (7b, 192k, 64 GPUs, 28 GB, 512 sequences, generators of benchmarks/suite.py, seed 0)."""
    sys.path.insert(0, str(Path(__file__).parent))
    from suite import DISTRIBUTIONS, generate

    from megatron_hsp.planner.search.bounds import lower_bound_ms, lp_lower_bound_ms

    cluster = Cluster(64, 8)
    cost = flexsp_cost_model("flexsp-gpt-7b", 64, 192, 28)
    print(
        "| distribution | hsp (s) | combinatorial (s) | LP bound (s) | LP master (s) | converged | "
        "iterations | classes |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name in DISTRIBUTIONS[1:]:
        b = generate(name, 512, 192_000, np.random.default_rng(0)).tolist()
        plan = solve(b, cost, cluster, SolverConfig(time_budget_s=budget))
        comb = lower_bound_ms(b, cost, cluster)
        lp = lp_lower_bound_ms(b, cost, cluster, time_limit_s=limit_s, upper_ms=plan.est_step_ms)
        print(
            f"| {name} | {plan.est_step_ms / 1e3:.2f} | {comb / 1e3:.2f} | {lp.bound_ms / 1e3:.2f} "
            f"| {lp.lp_ms / 1e3:.2f} | {lp.converged} | {lp.iterations} | {lp.classes} |",
            flush=True,
        )
    return 0


def xl_check(budget: float, steps: int = 3, gpus: int = 4096) -> int:
    """``gpus`` GPUs, GBS 8 per GPU (Wikipedia, 7b, 192k): is each solve shorter than its step?

    The background planner overlaps planning step k+1 with training step k, so a solve longer
    than the step it plans stalls training.
    """
    raw = load_lengths()
    cluster = Cluster(gpus, 8)
    gbs = 8 * gpus
    print(
        "| setting | batch | est. step (s) | solve wall (s) | solve CPU (s) | status "
        "| solve < step |"
    )
    print("|---|---|---|---|---|---|---|")
    settings = [
        # The calibrated H100 model (what the README quotes) on the raw lengths.
        (
            "calibrated llama3-8b-h100, raw",
            load_cost_model("llama3-8b-h100", world_size=gpus),
            raw[raw <= 192_000],
        ),
        # The preset's own memory cap on the raw lengths (the "3.7 s step").
        ("preset cap, raw", flexsp_cost_model("flexsp-gpt-7b", gpus, 192), raw[raw <= 192_000]),
        # FlexSP's harness: 30 GB, padded lengths; most sequences then need several ranks.
        (
            "30 GB, FlexSP rules",
            flexsp_cost_model("flexsp-gpt-7b", gpus, 192, 30),
            flexsp_rules(raw, gpus, 192),
        ),
    ]
    for name, cost, data in settings:
        for k, b in enumerate(batches(data, gbs, steps, "sequential")):
            plan = solve([int(x) for x in b], cost, cluster, SolverConfig(time_budget_s=budget))
            wall, step = plan.solve_ms / 1e3, plan.est_step_ms / 1e3
            print(
                f"| {name} | {k} | {step:.2f} | {wall:.2f} | {plan.extra['cpu_ms'] / 1e3:.2f} | "
                f"{plan.status} | {'yes' if wall < step else 'NO'} |",
                flush=True,
            )
    load = os.getloadavg()
    print(f"\nbudget {budget} s; load average {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f}")
    return 0


def scale_check(raw, args, emit) -> None:
    """1024 GPUs, GBS 8192 (Wikipedia, 7b, 192k, 30 GB, FlexSP's padding): hsp against
    static-best, gap, solve wall/CPU p50/p99 at the budget and at 2.5 s, planner memory."""
    config = SolverConfig(time_budget_s=args.budget)
    scale_steps = 3 if args.quick else 10
    emit(f"### Scale (Wikipedia, flexsp-gpt-7b, 192k, 1024 GPUs, GBS 8192, {scale_steps} steps)")
    emit()
    cluster = Cluster(1024, 8)
    cost = flexsp_cost_model("flexsp-gpt-7b", 1024, 192, 30)
    data = flexsp_rules(raw, 1024, 192)
    bl = batches(data, 8192, scale_steps, "sequential")
    best, _ada = static_best_and_batchada(static_table(bl, cost, cluster))
    plans = run_plans(bl, cost, cluster, config)
    s = summarise(plans)
    # Memory on its own run: tracemalloc slows allocation-heavy Python several-fold.
    tracemalloc.start()
    run_plans(bl[:2], cost, cluster, config)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    emit(
        "| hsp (s) | static-best (s) | vs static-best | gap to LB | budget | status | "
        "wall p50 / p99 (ms) | CPU p50 / p99 (ms) |"
    )
    emit("|---|---|---|---|---|---|---|---|")
    for budget in (args.budget, 2.5):
        if budget != args.budget:
            plans = run_plans(bl, cost, cluster, SolverConfig(time_budget_s=budget))
            s = summarise(plans)
        statuses = ",".join(sorted({p.status for p in plans}))
        emit(
            f"| {s['total_s']:.2f} | {best / 1e3:.2f} | {best / 1e3 / s['total_s']:.3f}x | "
            f"{s['gap'] * 100:.1f}% | {budget} s | {statuses} | "
            f"{s['p50_ms']:.0f} / {s['p99_ms']:.0f} | "
            f"{s['cpu_p50_ms']:.0f} / {s['cpu_p99_ms']:.0f} |"
        )
    emit()
    rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    emit(
        f"Planner memory: peak Python allocations during the 1024-GPU solves {peak / 2**20:.1f} "
        f"MiB (tracemalloc); whole benchmark process max RSS {rss_mb:.0f} MiB."
    )
    emit()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer steps (smoke run)")
    ap.add_argument(
        "--write-docs", action="store_true", help="rewrite docs/results/solver.md's results"
    )
    ap.add_argument("--budget", type=float, default=1.0, help="SolverConfig.time_budget_s")
    ap.add_argument(
        "--xl-only",
        action="store_true",
        help="only the 4096-GPU / 32768-sequence check: solve time against the step it plans",
    )
    ap.add_argument("--xl-gpus", type=int, default=4096, help="GPUs of --xl-only (GBS 8 per GPU)")
    ap.add_argument("--xl-steps", type=int, default=3, help="batches per setting of --xl-only")
    ap.add_argument(
        "--lp-check",
        type=float,
        metavar="SECONDS",
        help="only the LP-bound check: column generation with this limit on one batch per "
        "suite distribution, against the combinatorial bound and an hsp plan",
    )
    ap.add_argument(
        "--scale-only",
        action="store_true",
        help="only the 1024-GPU / 8192-sequence section (10 batches, or 3 with --quick)",
    )
    args = ap.parse_args()
    if args.xl_only:
        return xl_check(args.budget, args.xl_steps, args.xl_gpus)
    if args.scale_only:
        scale_check(load_lengths(), args, print)
        return 0
    if args.lp_check:
        return lp_check(args.lp_check, args.budget)
    steps = 5 if args.quick else 20
    config = SolverConfig(time_budget_s=args.budget)
    raw = load_lengths()
    out: list[str] = []

    def emit(line: str = "") -> None:
        print(line, flush=True)
        out.append(line)

    started = time.time()
    # 1. FlexSP's comparison: Wikipedia, 7b, 192k, 64 GPUs, GBS 512, batches 0-9.
    cluster = Cluster(64, 8)
    data = flexsp_rules(raw, 64, 192)
    b10 = batches(data, 512, 10, "sequential")
    emit("### FlexSP comparison (Wikipedia, flexsp-gpt-7b, 192k, 64 GPUs, GBS 512, batches 0-9)")
    emit()
    emit(
        "| memory cap | hsp total (s) | FlexSP (s) | hsp vs FlexSP | FlexSP-style emulation (s) "
        "| static-64 (s) | static-best (s) | batchada (s) | lower bound (s) | "
        "solve wall p50 / p99 (ms) | solve CPU p50 / p99 (ms) |"
    )
    emit("|---|---|---|---|---|---|---|---|---|---|---|")
    for cap in (28, 30):
        # FlexSP prices every size as pure Ulysses (not executable: 32 heads on 64 ranks).
        cost = flexsp_cost_model("flexsp-gpt-7b", 64, 192, cap, as_published=True)
        plans = run_plans(b10, cost, cluster, config)
        s = summarise(plans)
        emu = summarise(run_plans(b10, cost, cluster, flexsp_style_config(cost, cluster, config)))
        table = static_table(b10, cost, cluster)
        best, ada = static_best_and_batchada(table)
        s64 = sum(table[64]) / 1e3
        faster = (1 - s["total_s"] / FLEXSP_TOTAL_S) * 100
        emit(
            f"| {cap} GB | {s['total_s']:.2f} | {FLEXSP_TOTAL_S:.2f} | "
            f"{FLEXSP_TOTAL_S / s['total_s']:.3f}x ({faster:.1f}% faster) | "
            f"{emu['total_s']:.2f} | "
            f"{s64:.2f} (FlexSP {FLEXSP_STATIC64_S}) | {best / 1e3:.2f} | "
            f"{ada / 1e3:.2f} (FlexSP {FLEXSP_BATCHADA_S}) | {s['lb_s']:.2f} | "
            f"{s['p50_ms']:.0f} / {s['p99_ms']:.0f} | "
            f"{s['cpu_p50_ms']:.0f} / {s['cpu_p99_ms']:.0f} |"
        )
    emit()
    emit(f"FlexSP's own solve time on these batches: {FLEXSP_SOLVE_S} s per batch (SCIP).")
    emit()

    # 2. 64-GPU grid: gap to the lower bound, speedup over simple static baselines, solve time.
    emit(f"### 64-GPU grid (Wikipedia, GBS 512, {steps} steps, memory cap 30 GB)")
    emit()
    emit(
        "| model | max-seq | sampling | hsp (s) | FlexSP-style (s) | static-best (s) | "
        "batchada (s) | vs FlexSP-style | vs static-best | vs batchada | gap to LB | "
        "worst step gap | solve wall p50 / p99 (ms) | CPU p50 / p99 (ms) |"
    )
    emit("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    all_solve: list[float] = []
    all_cpu: list[float] = []
    for model in ("flexsp-gpt-7b", "flexsp-gpt-13b", "flexsp-gpt-30b"):
        for max_k in (192, 384):
            data = flexsp_rules(raw, 64, max_k)
            cost = flexsp_cost_model(model, 64, max_k, 30)
            for sampling in ("sequential", "random"):
                if sampling == "random" and args.quick:
                    continue
                bl = batches(data, 512, steps, sampling, seed=0)
                plans = run_plans(bl, cost, cluster, config)
                all_solve.extend(p.solve_ms for p in plans)
                all_cpu.extend(p.extra["cpu_ms"] for p in plans)
                s = summarise(plans)
                emu = summarise(
                    run_plans(bl, cost, cluster, flexsp_style_config(cost, cluster, config))
                )
                best, ada = static_best_and_batchada(static_table(bl, cost, cluster))
                tot = s["total_s"]
                emit(
                    f"| {model} | {max_k}k | {sampling} | {tot:.2f} | {emu['total_s']:.2f} | "
                    f"{best / 1e3:.2f} | {ada / 1e3:.2f} | {emu['total_s'] / tot:.3f}x | "
                    f"{best / 1e3 / tot:.3f}x | {ada / 1e3 / tot:.3f}x | "
                    f"{s['gap'] * 100:.1f}% | {s['worst_gap'] * 100:.1f}% | "
                    f"{s['p50_ms']:.0f} / {s['p99_ms']:.0f} | "
                    f"{s['cpu_p50_ms']:.0f} / {s['cpu_p99_ms']:.0f} |"
                )
    emit()
    emit(
        f"All 64-GPU solves: wall p50 {pct(all_solve, 50):.0f} ms, p99 "
        f"{pct(all_solve, 99):.0f} ms, max {max(all_solve):.0f} ms; CPU p50 "
        f"{pct(all_cpu, 50):.0f} ms, p99 {pct(all_cpu, 99):.0f} ms (budget {args.budget} s)."
    )
    emit()

    # 3. Scale: 1024 GPUs, GBS 8192.
    scale_check(raw, args, emit)
    load = os.getloadavg()
    emit(
        f"Machine load average at the end: {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} "
        f"(1/5/15 min) on {_cores()} cores shared with other jobs: wall times above include "
        "waiting for a core; CPU times are the planner's own work."
    )
    emit()
    emit(
        f"Measured {dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} UTC on {platform.node()} "
        f"({platform.processor() or platform.machine()}, {_cores()} cores, Python "
        f"{platform.python_version()}), {time.time() - started:.0f} s wall."
    )
    if args.write_docs:
        _write_docs("\n".join(out), args)
    return 0


def _cores() -> int:
    return len(os.sched_getaffinity(0))


def _write_docs(results: str, args) -> None:
    text = DOC.read_text() if DOC.exists() else ""
    marker = "## Results"
    head = text.split(marker)[0].rstrip() + "\n\n" if marker in text else text
    cmd = "PYTHONPATH=$PWD .venv/bin/python benchmarks/solver_targets.py --write-docs"
    if args.quick:
        cmd += " --quick"
    DOC.write_text(f"{head}{marker}\n\nCommand: `{cmd}`\n\n{results}\n")


if __name__ == "__main__":
    raise SystemExit(main())
