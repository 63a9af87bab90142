"""``megatron-hsp demo``: train a small megatron-core GPT on CPU ranks with adaptive groups.

The whole product in one command, on a laptop-class CPU: the standard library's own ``.py``
sources become a Megatron indexed dataset (byte-level tokens, cached), a seeded sampler draws
global batches of whole documents, the planner process plans step t+1 while step t trains, every
rank executes the plan with Ulysses groups of different sizes (gloo), and the run ends with the
loss curve and adaptive versus static groups on the same batches.

Under ``torchrun`` (e.g. ``scripts/slurm/hsp_pretrain.sbatch demo``) the demo uses the launched
processes instead of spawning its own.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import signal
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from megatron_hsp.commands.common import add_verbose_argument, import_warnings_summarised
from megatron_hsp.planner.settings import SOLVERS, PlannerSettings

# A cost model for the demo's tiny GPT on CPU ranks. The memory cap (tokens_per_rank) is what
# makes plans heterogeneous: a document over 1024 tokens needs a group of 2, over 2048 a group of
# 4, and longer ones are split into 4096-token pieces. At 512 tokens per rank every micro-batch
# was memory-bound (all groups of 4); 1024 leaves the planner room to mix sizes. Time
# coefficients were fitted on a 2-core CPU for DEMO_MODEL (fwd+bwd per rank; see
# docs/integration.md); predicted step times are of the right order here, not elsewhere.
DEMO_COST_MODEL: dict[str, Any] = {
    "name": "demo-cpu-tiny-gpt",
    "coefficients": {
        "attn_ms_per_token2": 5.0e-5,
        "linear_ms_per_token": 0.12,
        "group_fixed_ms": 30.0,
        "a2a_ms_per_token": {2: 0.03, 4: 0.04},
        "tokens_per_rank": 1024,
    },
}
# The demo's steps take about a second on CPU ranks: half the training default's plan budget.
DEMO_TIME_BUDGET_S = 0.5
DEMO_MAX_TOKEN_BUDGET = 262_144  # tokens per step on CPU ranks
DEMO_MAX_GLOBAL_BATCH = 4096  # documents per step
DEMO_MODEL = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2)


@dataclass
class DemoConfig:
    steps: int = 8
    nproc: int = 4
    token_budget: int | None = 8192
    global_batch: int | None = None
    seed: int = 0
    lr: float = 3e-3
    compare_steps: int = 3
    planner: PlannerSettings = field(
        default_factory=lambda: PlannerSettings(time_budget_s=DEMO_TIME_BUDGET_S)
    )
    cache_dir: str | None = None
    corpus_prefix: str = ""
    quiet: bool = False
    stall_timeout_s: float = 30.0
    # preset name, YAML/JSON file (e.g. written by `megatron-hsp profile`) or a spec mapping
    cost_model: str | dict[str, Any] = field(default_factory=lambda: dict(DEMO_COST_MODEL))
    # Online refit of the cost model from measured group times (step/observe.StepRefitter); the
    # refit model is written to ``refit_out`` for the next run's --cost-model.
    refit: bool = True
    refit_out: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--steps", type=int, default=8, help="training steps (default 8)")
    parser.add_argument("--nproc", type=int, default=4, help="gloo CPU ranks (default 4)")
    batch = parser.add_mutually_exclusive_group()
    batch.add_argument(
        "--token-budget",
        type=int,
        default=None,
        help="tokens per global batch, whole documents (default 8192)",
    )
    batch.add_argument(
        "--global-batch",
        type=int,
        default=None,
        help="sample a fixed number of documents (or pieces of split ones) per batch instead",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--compare-steps",
        type=int,
        default=3,
        help="batches re-run with static groups for the side-by-side (default 3; 0: skip)",
    )
    parser.add_argument("--solver", choices=SOLVERS, default="highs")
    parser.add_argument(
        "--cost-model",
        default=None,
        metavar="FILE|PRESET",
        help="cost model the planner uses: a YAML/JSON file (e.g. from `megatron-hsp profile`) "
        "or a preset name (default: the demo's built-in CPU model). Each step's predicted_s in "
        "--json is its plan priced by this model, refit online up to the previous step unless "
        "--no-refit (planned_ms: the plan's own estimate)",
    )
    parser.add_argument(
        "--no-refit",
        action="store_true",
        help="keep the cost model fixed (default: refit it online from measured group times and "
        "plan with the refit model, step/observe.py)",
    )
    parser.add_argument(
        "--refit-out",
        default=None,
        metavar="FILE.yaml",
        help="where the refit cost model is written for the next run's --cost-model (default: "
        "demo-refit.yaml in the cache directory)",
    )
    add_verbose_argument(parser)
    parser.add_argument(
        "--stall-timeout",
        type=float,
        default=30.0,
        help="seconds without a heartbeat before a rank counts as stalled and the demo stops, "
        "naming it (default 30)",
    )
    parser.add_argument("--cache-dir", default=None, help="where the corpus is built (cached)")
    parser.add_argument(
        "--json",
        nargs="?",
        const="-",
        default=None,
        metavar="FILE",
        help="print the result as JSON (docs/design.md contract) instead of tables; FILE: write it",
    )
    parser.add_argument(
        "--plot",
        default=None,
        metavar="FILE.png",
        help="also draw the loss curve and adaptive-vs-static step times as a PNG (needs "
        "matplotlib, the 'plot' extra)",
    )


# --------------------------------------------------------------------------------- the worker
def _max_over_ranks(x: float) -> float:
    import torch
    import torch.distributed as dist

    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t[0])


def _progress(done: int, total: int, line: str, quiet: bool) -> None:
    if quiet:
        return
    width = 24
    filled = width * done // max(total, 1)
    bar = "#" * filled + "-" * (width - filled)
    print(f"[{bar}] {done}/{total}  {line}", file=sys.stderr, flush=True)


def demo_worker(rank: int, world_size: int, cfg: DemoConfig) -> dict[str, Any] | None:
    """One rank of the demo; torch.distributed and megatron parallel_state are initialised."""
    import torch
    import torch.distributed as dist

    from megatron_hsp.planner.baselines import static_plan
    from megatron_hsp.planner.costmodel import load_cost_model
    from megatron_hsp.planner.errors import HSPError
    from megatron_hsp.runtime.groups import create_groups
    from megatron_hsp.runtime.schedule import run_step
    from megatron_hsp.step.corpus import DEMO_VOCAB_SIZE
    from megatron_hsp.step.documents import DocumentIndex, DocumentReader
    from megatron_hsp.step.observe import StepRecord, StepRefitter, layout_summary, plan_ms
    from megatron_hsp.step.pipeline import build_step_pipeline
    from megatron_hsp.step.planner_service import PlannerService, PlannerSpec
    from megatron_hsp.step.sampler import GlobalBatchSampler, SamplerConfig
    from megatron_hsp.testing.dist import tiny_gpt_model

    device = torch.device("cpu")
    gpus_per_node = world_size
    cost = load_cost_model(cfg.cost_model, world_size=world_size, gpus_per_node=gpus_per_node)
    # Only the sizes the cost model prices: the registry offers every size up to a node (3 of 4
    # included), which a pure-Ulysses model of 4 heads cannot run and the planner cannot cost.
    registry = create_groups(
        gpus_per_node, sizes=[d for d in cost.sizes if d <= world_size], lazy=True
    )
    sizes = registry.sizes
    max_len = cost.max_trainable_length(list(sizes))
    index = DocumentIndex(cfg.corpus_prefix)
    spec = PlannerSpec(
        cost_model=cfg.cost_model,
        world_size=world_size,
        gpus_per_node=gpus_per_node,
        max_seq=max_len,
        settings=dataclasses.replace(cfg.planner, sizes=tuple(sizes), seed=cfg.seed),
    )
    sampler = GlobalBatchSampler(
        index.lengths,
        SamplerConfig(
            seed=cfg.seed,
            max_length=max_len,
            global_batch_docs=cfg.global_batch,
            token_budget=cfg.token_budget,
            overlong="split",
        ),
    )
    pipeline = build_step_pipeline(
        sampler,
        DocumentReader(index),
        registry,
        rank=rank,
        planner=PlannerService(spec) if rank == 0 else None,
    )
    pipeline.prime()  # step 0 is planned while the model is built
    model = tiny_gpt_model(
        **DEMO_MODEL,
        vocab_size=DEMO_VOCAB_SIZE,
        max_sequence_length=max_len,
        seed=cfg.seed,
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)

    steps: list[dict[str, Any]] = []
    kept: list[tuple[Any, Any]] = []  # (DocumentBatch, adaptive plan) for the side-by-side
    refitter = (
        StepRefitter(cost, out=cfg.refit_out, planner=pipeline.planner)
        if cfg.refit and rank == 0
        else None
    )
    # The per-step cost the plan's own estimate adds, by the model each step's plan was made with
    # (plans are requested one step ahead, so a refit after step t prices the plans from t + 2
    # on): the JSON's planned_ms.
    overhead_ms = {0: cost.step_overhead_ms}
    try:
        for i in range(cfg.steps):
            prepared = pipeline.next_step()
            # The newest model as the step starts (refit after the previous step): it re-prices
            # the prefetched plan for predicted_ms, so the prediction lags the machine one step,
            # not two (the plan itself stays as it was made).
            current = refitter.model if refitter is not None else cost
            overhead_ms[prepared.step + 1] = current.step_overhead_ms
            created = registry.created
            dist.barrier()
            t0 = time.perf_counter()
            result = run_step(
                model,
                prepared.plan,
                prepared.tokens,
                registry,
                grad_group=None,
                device=device,
            )
            optimizer.step()
            step_s = _max_over_ranks(time.perf_counter() - t0)
            per_slot: list[Any] = [None] * world_size
            dist.all_gather_object(per_slot, result.microbatch_s)
            if refitter is not None:
                update = refitter.record(
                    prepared.step,
                    prepared.plan,
                    per_slot,
                    step_s,
                    step_is_clean=registry.created == created,
                )
                if update is not None and not cfg.quiet:
                    print(refitter.summary_line(), file=sys.stderr, flush=True)
            if len(kept) < cfg.compare_steps:
                kept.append((prepared.batch, prepared.plan))
            if rank == 0:
                rec = StepRecord.from_plan(
                    prepared.step,
                    prepared.plan,
                    loss=result.loss,
                    measured_s=step_s,
                    solve_s=prepared.solve_s,
                    wait_s=prepared.wait_s,
                    step_overhead_ms=overhead_ms.get(prepared.step, cost.step_overhead_ms),
                    model=current,
                )
                steps.append(
                    {
                        "step": prepared.step,
                        "loss": result.loss,
                        "group_sizes": rec.group_sizes,
                        "microbatches": rec.microbatches,
                        "step_s": step_s,
                        "predicted_s": rec.predicted_ms / 1e3,
                        "predicted_ms": rec.predicted_ms,
                        "planned_ms": rec.planned_ms,
                        "solve_ms": rec.solve_ms,
                        "planner_wait_ms": rec.planner_wait_ms,
                        "imbalance": rec.imbalance,
                        "sequences": rec.num_sequences,
                        "tokens": rec.tokens,
                        "status": rec.status,
                        # Groups, documents and lengths: what a replay of the refit re-prices.
                        "plan": prepared.plan.to_dict(),
                    }
                )
                _progress(
                    i + 1,
                    cfg.steps,
                    f"loss {result.loss:.4f}  {rec.num_sequences} docs {rec.tokens} tok  "
                    f"{layout_summary(prepared.plan)}  {step_s * 1e3:.0f} ms "
                    f"(pred {rec.predicted_ms:.0f})  solve {rec.solve_ms:.0f} ms"
                    + (
                        f"  waited {rec.planner_wait_ms:.0f} ms" if rec.planner_wait_ms >= 1 else ""
                    ),
                    cfg.quiet,
                )
        sampler_report = pipeline.report()  # trained batches, not the prefetched one
    finally:
        pipeline.close()
    # Every rank prices the side-by-side with the model the run ended on (the refit one).
    final_spec: list[Any] = [refitter.model.to_spec() if refitter is not None else None]
    dist.broadcast_object_list(final_spec, src=0)
    priced = cost
    if final_spec[0] is not None:
        priced = load_cost_model(final_spec[0], world_size=world_size, gpus_per_node=gpus_per_node)

    # Side-by-side on the same batches and the same weights: no optimizer step, so both layouts
    # see identical parameters (the model is warm from training).
    comparison: dict[str, Any] = {}
    if kept:
        reader = DocumentReader(index)
        degree = None
        for d in sorted(sizes):
            try:
                for batch, _ in kept:
                    static_plan(batch.lengths, priced, registry.cluster, d)
                degree = d
                break
            except HSPError:
                continue
        rows = []
        for batch, adaptive in kept:
            row: dict[str, Any] = {"step": batch.step, "tokens": batch.tokens}
            plans = {"adaptive": adaptive}
            if degree is not None:
                plans[f"static-{degree}"] = static_plan(
                    batch.lengths, priced, registry.cluster, degree
                )
            for name, plan in plans.items():
                docs = reader.batch_for_rank(batch, plan, registry.slot)
                dist.barrier()
                t0 = time.perf_counter()
                run_step(model, plan, docs, registry, grad_group=None, device=device)
                row[name] = {
                    "measured_s": _max_over_ranks(time.perf_counter() - t0),
                    # Both layouts priced by the one model the run ended on (the adaptive plan
                    # was made under an earlier one while the refit settled).
                    "predicted_ms": plan_ms(plan, priced),
                    "microbatches": len(plan.microbatches),
                    "group_sizes": [mb.group_sizes for mb in plan.microbatches],
                }
            rows.append(row)
        comparison = {"static_degree": degree, "batches": rows}
        if degree is not None:
            s = f"static-{degree}"
            tot = {
                k: (sum(r[k]["measured_s"] for r in rows), sum(r[k]["predicted_ms"] for r in rows))
                for k in ("adaptive", s)
            }
            comparison["speedup_measured"] = tot[s][0] / tot["adaptive"][0]
            comparison["speedup_predicted"] = tot[s][1] / max(tot["adaptive"][1], 1e-9)
    model.zero_grad(set_to_none=True)
    if rank != 0:
        return None
    return {
        "steps": steps,
        "comparison": comparison,
        "sampler": sampler_report,
        "refit": {
            "enabled": refitter is not None,
            "updates": refitter.updates if refitter is not None else [],
            "out": cfg.refit_out if refitter is not None and refitter.updates else None,
        },
        "config": {
            **{k: v for k, v in asdict(cfg).items() if k not in ("extra", "quiet")},
            "group_sizes": list(sizes),
            "max_trainable_length": max_len,
            "cost_model": cost.to_spec(),
            "model": {**DEMO_MODEL, "vocab_size": DEMO_VOCAB_SIZE},
        },
    }


# ------------------------------------------------------------------------- the model's accuracy
WARMUP_STEPS = 2  # step 0 pays first-touch allocation and the planner's start-up
REFIT_SCORED_FROM_STEP = 5


def prediction_summary(steps: list[dict[str, Any]], cost_spec: dict[str, Any]) -> dict[str, Any]:
    """Median relative error of ``predicted_s`` against ``step_s`` after the warm-up steps.

    Why the median after warm-up: the first steps allocate buffers and warm caches, and a loaded
    machine adds outliers either way; the median over the rest is what the planner can rely on.
    With too few steps the warm-up shrinks so that at least one step is scored.
    """
    warm = min(WARMUP_STEPS, max(0, len(steps) - 1))
    scored = steps[warm:]
    errs = [abs(s["predicted_s"] - s["step_s"]) / s["step_s"] for s in scored if s["step_s"] > 0]
    import statistics

    late_steps = [
        s
        for i, s in enumerate(steps)
        if s.get("step", i) >= REFIT_SCORED_FROM_STEP and s["step_s"] > 0
    ]
    late = [abs(s["predicted_s"] - s["step_s"]) / s["step_s"] for s in late_steps]
    # The plans' own estimates (the model each plan was made with, a step older than the one
    # predicted_s re-prices with), scored on the same steps.
    late_planned = [
        abs(s["planned_ms"] / 1e3 - s["step_s"]) / s["step_s"]
        for s in late_steps
        if s.get("planned_ms") is not None
    ]
    return {
        "cost_model": cost_spec.get("name", "?"),
        "warmup_steps": warm,
        "steps": len(errs),
        "median_rel_err": statistics.median(errs) if errs else None,
        # From step 5 on: the steps there are priced by a refit model (the first refit follows
        # step 1 and prices step 2 on, bounded steps compound over a few updates).
        "median_rel_err_from_step_5": statistics.median(late) if late else None,
        "median_rel_err_from_step_5_planned": (
            statistics.median(late_planned) if late_planned else None
        ),
        "mean_predicted_over_measured": (
            sum(s["predicted_s"] / s["step_s"] for s in scored) / len(scored) if scored else None
        ),
    }


def _checked_cost_model(spec: str, nproc: int) -> str:
    """Load ``--cost-model`` once here so a bad file or preset stops the demo before any rank
    starts, with the flag named (exit 2)."""
    from megatron_hsp.planner.costmodel import load_cost_model
    from megatron_hsp.planner.errors import InputError

    try:
        load_cost_model(spec, world_size=nproc, gpus_per_node=nproc)
    except InputError as exc:
        msg = str(exc)
        raise InputError(
            msg if msg.startswith("--cost-model") else f"--cost-model {spec}: {msg}"
        ) from None
    return spec


# ----------------------------------------------------------------------------------- reporting
def _sparkline(values: list[float]) -> str:
    ticks = "▁▂▃▄▅▆▇█"
    lo, hi = min(values), max(values)
    span = (hi - lo) or 1.0
    return "".join(ticks[min(7, int((v - lo) / span * 7.999))] for v in values)


def render(result: dict[str, Any], elapsed_s: float) -> str:
    steps = result["steps"]
    lines = []
    losses = [s["loss"] for s in steps]
    lines.append("")
    lines.append(f"loss curve  {_sparkline(losses)}  {losses[0]:.4f} -> {losses[-1]:.4f}")
    for s in steps:
        lines.append(f"  step {s['step']:>3}  loss {s['loss']:.4f}")
    comp = result.get("comparison") or {}
    if comp.get("batches"):
        s_name = f"static-{comp['static_degree']}" if comp.get("static_degree") else None
        lines.append("")
        lines.append("adaptive vs static groups on the same batches (measured / predicted):")
        head = f"  {'step':>4} {'tokens':>7}  {'adaptive':>22}"
        if s_name:
            head += f"  {s_name:>22}"
        lines.append(head)
        for r in comp["batches"]:
            a = r["adaptive"]
            row = (
                f"  {r['step']:>4} {r['tokens']:>7}  "
                f"{a['measured_s'] * 1e3:>8.0f} ms / {a['predicted_ms']:>6.0f} ms"
            )
            if s_name:
                b = r[s_name]
                row += f"  {b['measured_s'] * 1e3:>8.0f} ms / {b['predicted_ms']:>6.0f} ms"
            lines.append(row)
        if s_name:
            lines.append(
                f"  speedup of adaptive over {s_name}: measured "
                f"{comp['speedup_measured']:.2f}x, predicted {comp['speedup_predicted']:.2f}x"
            )
    pred = result.get("prediction") or {}
    if pred.get("median_rel_err") is not None:
        lines.append("")
        lines.append(
            f"prediction ({pred['cost_model']}): median |predicted - measured| / measured "
            f"{pred['median_rel_err']:.1%} over {pred['steps']} steps after "
            f"{pred['warmup_steps']} warm-up"
        )
    refit = result.get("refit") or {}
    if refit.get("updates"):
        took = [u for u in refit["updates"] if u["accepted"]]
        late = pred.get("median_rel_err_from_step_5")
        lines.append(
            f"online refit: {len(took)} of {len(refit['updates'])} updates accepted"
            + (f"; median error from step 5 on {late:.1%}" if late is not None else "")
            + (
                f"; refit model written to {refit['out']} (--cost-model {refit['out']} next run)"
                if refit.get("out") and took
                else ""
            )
        )
    lines.append("")
    lines.append(f"data: {result['sampler']}")
    lines.append(f"done in {elapsed_s:.1f} s")
    return "\n".join(lines)


# --------------------------------------------------------------------------------- entry point
def _under_torchrun() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def run(args: argparse.Namespace) -> int:
    with import_warnings_summarised(args.verbose, "demo", children=True):
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    from megatron_hsp.planner.errors import InputError
    from megatron_hsp.planner.units import check_range
    from megatron_hsp.step.corpus import build_stdlib_corpus

    check_range(args.steps, "--steps", low=1, high=10**6)
    check_range(args.compare_steps, "--compare-steps", low=0)
    check_range(args.seed, "--seed", low=0)
    check_range(args.stall_timeout, "--stall-timeout", low=0, low_open=True)
    # 0 is not "use the default": a zero budget or batch cannot train anything.
    # Upper limits: the demo trains on CPU ranks; a step of millions of tokens grew memory to
    # GBs and never finished (issue 18).
    if args.token_budget is not None:
        check_range(args.token_budget, "--token-budget", low=1, high=DEMO_MAX_TOKEN_BUDGET)
    if args.global_batch is not None:
        check_range(args.global_batch, "--global-batch", low=1, high=DEMO_MAX_GLOBAL_BATCH)
    if args.nproc < 1 or args.nproc & (args.nproc - 1):
        raise InputError(f"--nproc must be a power of two (1, 2, 4, 8), got {args.nproc}")
    if args.json is not None:  # before the training: a bad path must not lose a finished run
        from megatron_hsp.commands.common import check_output_path

        check_output_path("--json", args.json, allow_stdout=True)
    refit_out = None
    if not args.no_refit:  # checked before the work, like --json
        from megatron_hsp.commands.common import check_output_path
        from megatron_hsp.step.corpus import default_cache_dir

        if args.refit_out is None:
            folder = Path(args.cache_dir) if args.cache_dir else default_cache_dir()
            folder.mkdir(parents=True, exist_ok=True)
        refit_out = check_output_path(
            "--refit-out", args.refit_out or str(folder / "demo-refit.yaml")
        )
    if args.cost_model is not None:  # before the corpus is built: a bad file fails at once
        _checked_cost_model(args.cost_model, int(os.environ.get("WORLD_SIZE", args.nproc)))
    plot_path = None
    if args.plot is not None:
        from megatron_hsp.commands.plots import check_png_path

        plot_path = check_png_path(args.plot)
    t0 = time.perf_counter()
    torchrun = _under_torchrun()
    rank = int(os.environ.get("RANK", "0")) if torchrun else 0
    quiet = args.json == "-"
    # Under torchrun one process per node builds the corpus; the others wait for it (cached).
    local_rank = int(os.environ.get("LOCAL_RANK", "0")) if torchrun else 0
    corpus = build_stdlib_corpus(args.cache_dir, wait=local_rank != 0)
    if rank == 0 and not quiet:
        what = "built" if corpus.built else "cached"
        print(f"corpus: {corpus.source} ({what} at {corpus.prefix})", file=sys.stderr)
    cfg = DemoConfig(
        steps=args.steps,
        nproc=int(os.environ["WORLD_SIZE"]) if torchrun else args.nproc,
        token_budget=None if args.global_batch else (args.token_budget or 8192),
        stall_timeout_s=args.stall_timeout,
        global_batch=args.global_batch,
        seed=args.seed,
        compare_steps=min(args.compare_steps, args.steps),
        planner=PlannerSettings(solver=args.solver, time_budget_s=DEMO_TIME_BUDGET_S),
        cache_dir=args.cache_dir,
        corpus_prefix=str(corpus.prefix),
        quiet=quiet,
    )
    if args.cost_model is not None:
        cfg.cost_model = args.cost_model
    cfg.refit, cfg.refit_out = not args.no_refit, refit_out
    if torchrun:
        result = _run_torchrun(cfg)
        if rank != 0:
            return 0
    else:
        try:
            result = _run_ranks(cfg)
        except KeyboardInterrupt:
            print("demo: interrupted; every rank and the planner were stopped", file=sys.stderr)
            return 130
    elapsed = time.perf_counter() - t0
    result["elapsed_s"] = elapsed
    result["prediction"] = prediction_summary(result["steps"], result["config"]["cost_model"])
    if args.json is not None:
        text = json.dumps(result, indent=2)
        if args.json == "-":
            print(text)
        else:
            with open(args.json, "w") as fh:
                fh.write(text + "\n")
    if plot_path is not None:
        from megatron_hsp.commands.plots import plot_demo

        plot_demo(result, plot_path)
        if args.json != "-":
            print(f"plot: {plot_path}", file=sys.stderr)
    if args.json != "-":
        print(render(result, elapsed))
    return 0


def _rank_main(rank: int, cfg: DemoConfig, rdzv: str, out: str) -> None:
    import pickle
    import traceback

    import torch

    from megatron_hsp.runtime.lifetime import die_with_parent
    from megatron_hsp.testing.dist import destroy_cpu_megatron, init_cpu_megatron

    torch.set_num_threads(1)
    _start_heartbeat(out + ".hb")
    # SIGTERM from the parent: unwind (close the planner, leave the process groups) and exit.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    die_with_parent()  # and SIGTERM when the parent dies, even by SIGKILL
    try:
        init_cpu_megatron(rank, cfg.nproc, f"file://{rdzv}")
        result: Any = demo_worker(rank, cfg.nproc, cfg)
    except BaseException as exc:  # reported by the parent, never swallowed
        from megatron_hsp.planner.errors import HSPError

        if isinstance(exc, HSPError):  # a reason in a sentence (bad input, planner died): one line
            result = HSPError(f"rank {rank}: {exc}")
        else:  # a bug: its traceback is what a report needs
            result = RuntimeError(
                f"rank {rank}: {type(exc).__name__}: {exc}\n{traceback.format_exc()}"
            )
    finally:
        destroy_cpu_megatron()
    with open(out, "wb") as fh:
        pickle.dump(result, fh)


HEARTBEAT_S = 1.0


def _start_heartbeat(path: str) -> None:
    """Touch ``path`` every second from a daemon thread.

    Why a thread: a rank waiting in a collective for a slow peer still beats (gloo releases the
    GIL), while a stopped or wedged process does not, so the parent can name the stalled rank.
    """

    def beat() -> None:
        tmp = f"{path}.tmp"
        while True:
            # The pid lets an operator (or a test) find the rank. Written aside and renamed: a
            # reader never sees the file truncated mid-write (os.replace is atomic, and it
            # updates the mtime the parent watches).
            with open(tmp, "w") as fh:
                fh.write(str(os.getpid()))
            os.replace(tmp, path)
            time.sleep(HEARTBEAT_S)

    threading.Thread(target=beat, name="hsp-heartbeat", daemon=True).start()


def _stalled_rank(outs: list[str], since: float, limit_s: float) -> tuple[int, float] | None:
    """The first rank whose heartbeat is older than ``limit_s`` (and its age), else None."""
    now = time.time()
    for r, out in enumerate(outs):
        hb = out + ".hb"
        last = os.path.getmtime(hb) if os.path.exists(hb) else since
        if now - max(last, since) > limit_s:
            return r, now - max(last, since)
    return None


def _stop(procs: list[Any]) -> None:
    """Terminate every live rank, then kill what is left after 5 s (a stopped rank ignores
    SIGTERM until continued, so it is continued too). Ranks never started (a signal during the
    start loop) are skipped: joining one raised "can only join a started process" (issue 18)."""
    procs = [p for p in procs if p.pid is not None]
    for p in procs:
        if p.is_alive():
            p.terminate()
            with contextlib.suppress(ProcessLookupError, TypeError):
                os.kill(p.pid, signal.SIGCONT)
    end = time.monotonic() + 5
    for p in procs:
        p.join(max(0.0, end - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(5)


def _is_error(path: str) -> bool:
    import pickle

    if not os.path.exists(path):
        return False
    with open(path, "rb") as fh:
        return isinstance(pickle.load(fh), BaseException)


def _run_ranks(cfg: DemoConfig, timeout_s: float = 900) -> dict[str, Any]:
    """Run the ranks as children of a fork server that has imported the heavy modules once.

    On a small CPU machine, four processes each importing torch and megatron-core again (spawn)
    cost more than the eight training steps, so the ranks are forked from a server that imported
    them once. Forking from *this* process would be unsafe: a caller that already ran torch ops
    (a test worker, a notebook) has OpenMP/gloo threads alive and a fork can deadlock in them.
    The fork server is a fresh single-threaded process. The planner process is spawned separately
    (it must not inherit the ranks' process groups).
    """
    import multiprocessing as mp
    import pickle

    from megatron_hsp.planner.errors import HSPError

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(
        [
            "megatron_hsp.runtime.forkserver_lifetime",  # first: the server dies with us
            "torch",
            "megatron.core.models.gpt.gpt_model",
            "megatron_hsp.runtime.schedule",
            "megatron_hsp.testing.dist",
            "megatron_hsp.commands.demo",
        ]
    )
    with tempfile.TemporaryDirectory(prefix="hsp_demo_") as tmp:
        outs = [os.path.join(tmp, f"rank{r}.pkl") for r in range(cfg.nproc)]
        procs = [
            ctx.Process(target=_rank_main, args=(r, cfg, os.path.join(tmp, "rdzv"), outs[r]))
            for r in range(cfg.nproc)
        ]
        # SIGTERM to this process stops the ranks too (SIGINT already raises KeyboardInterrupt);
        # the finally below terminates them and the with-block removes the temp dir.
        previous = signal.getsignal(signal.SIGTERM)
        with contextlib.suppress(ValueError):  # not the main thread: keep the default
            signal.signal(signal.SIGTERM, _raise_interrupt)
        started = time.time()
        deadline = time.monotonic() + timeout_s
        failed = None
        stalled: tuple[int, float] | None = None
        try:
            for p in procs:
                p.start()
            while any(p.is_alive() for p in procs) and failed is None:
                time.sleep(0.2)
                for r, p in enumerate(procs):
                    # A rank that died or raised leaves the others blocked in a collective:
                    # stop them at once instead of waiting for gloo's timeout.
                    if not p.is_alive() and (p.exitcode != 0 or _is_error(outs[r])):
                        failed = r
                stalled = _stalled_rank(outs, started, cfg.stall_timeout_s)
                if stalled is not None and failed is None:
                    failed = -2
                if time.monotonic() > deadline:
                    failed = -1
        finally:
            _stop(procs)
            with contextlib.suppress(ValueError):
                signal.signal(signal.SIGTERM, previous)
        if failed == -2 and stalled is not None:
            raise HSPError(
                f"demo rank {stalled[0]} stalled: no heartbeat for {stalled[1]:.0f} s (stopped, "
                "swapped out or wedged); every rank was stopped. Raise --stall-timeout on a "
                "heavily loaded machine"
            )
        if failed == -1:
            raise HSPError(
                f"demo ranks did not finish within {timeout_s:.0f} s; every rank was stopped"
            )
        if failed is not None:
            if _is_error(outs[failed]):
                with open(outs[failed], "rb") as fh:
                    raise pickle.load(fh)
            raise HSPError(_death(failed, procs[failed].exitcode))
        results = []
        for r, path in enumerate(outs):
            if not os.path.exists(path):
                raise HSPError(_death(r, procs[r].exitcode))
            with open(path, "rb") as fh:
                results.append(pickle.load(fh))
    for res in results:
        if isinstance(res, BaseException):
            raise res
    return results[0]


def _death(rank: int, code: int | None) -> str:
    """One line for a rank that died without reporting (killed, out of memory, a crash)."""
    how = (
        f"was killed by signal {-code} ({signal.Signals(-code).name})"
        if code is not None and code < 0
        else f"exited with code {code}"
    )
    return (
        f"demo rank {rank} {how} before reporting (out of memory? killed from outside?); "
        "every rank and the planner were stopped"
    )


def _raise_interrupt(signum: int, _frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def _run_torchrun(cfg: DemoConfig) -> dict[str, Any] | None:
    """One process of a torchrun / Slurm launch (env:// rendezvous, gloo, CPU)."""
    import torch

    from megatron_hsp.testing.dist import destroy_cpu_megatron, init_cpu_megatron

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["LOCAL_WORLD_SIZE"])))
    init_cpu_megatron(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), "env://")
    try:
        return demo_worker(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), cfg)
    finally:
        destroy_cpu_megatron()
