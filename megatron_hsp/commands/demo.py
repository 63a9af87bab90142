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
import json
import os
import sys
import time

from megatron_hsp.commands.common import add_verbose_argument, import_warnings_summarised
from megatron_hsp.commands.demo_config import (
    DEMO_MAX_GLOBAL_BATCH,
    DEMO_MAX_TOKEN_BUDGET,
    DEMO_TIME_BUDGET_S,
    DemoConfig,
)
from megatron_hsp.planner.run_spec import DEFAULT_SOLVER, SOLVERS
from megatron_hsp.planner.search.settings import PlannerSettings


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
        default=8,
        help="batches re-run with static groups for the side-by-side (default 8; 0: skip)",
    )
    parser.add_argument(
        "--compare-repeats",
        type=int,
        default=3,
        help="times each side-by-side batch runs per layout, for the measured spread (default 3)",
    )
    parser.add_argument("--solver", choices=SOLVERS, default=DEFAULT_SOLVER.value)
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


def _checked_cost_model(spec: str, nproc: int) -> str:
    """Load ``--cost-model`` once here so a bad file or preset stops the demo before any rank
    starts, with the flag named (exit 2)."""
    from megatron_hsp.planner.cost.costmodel import load_cost_model
    from megatron_hsp.planner.errors import InputError

    try:
        load_cost_model(spec, world_size=nproc, gpus_per_node=nproc)
    except InputError as exc:
        msg = str(exc)
        raise InputError(
            msg if msg.startswith("--cost-model") else f"--cost-model {spec}: {msg}"
        ) from None
    return spec


# --------------------------------------------------------------------------------- entry point
def _under_torchrun() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def run(args: argparse.Namespace) -> int:
    with import_warnings_summarised(args.verbose, "demo", children=True):
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    from megatron_hsp.commands.demo_report import prediction_summary, render
    from megatron_hsp.planner.errors import InputError
    from megatron_hsp.planner.units import check_range
    from megatron_hsp.step.corpus import build_stdlib_corpus

    check_range(args.steps, "--steps", low=1, high=10**6)
    check_range(args.compare_steps, "--compare-steps", low=0)
    check_range(args.compare_repeats, "--compare-repeats", low=1)
    check_range(args.seed, "--seed", low=0)
    check_range(args.stall_timeout, "--stall-timeout", low=0, low_open=True)
    # 0 is not "use the default": a zero budget or batch cannot train anything.
    # Upper limits: the demo trains on CPU ranks; a step of millions of tokens grew memory to
    # GBs and never finished.
    if args.token_budget is not None:
        check_range(args.token_budget, "--token-budget", low=1, high=DEMO_MAX_TOKEN_BUDGET)
    if args.global_batch is not None:
        check_range(args.global_batch, "--global-batch", low=1, high=DEMO_MAX_GLOBAL_BATCH)
    if args.nproc < 1 or args.nproc & (args.nproc - 1):
        raise InputError(f"--nproc must be a power of two (1, 2, 4, 8), got {args.nproc}")
    if args.json is not None:  # before the training: a bad path must not lose a finished run
        from megatron_hsp.planner.paths import check_output_path

        check_output_path("--json", args.json, allow_stdout=True)
    refit_out = None
    if not args.no_refit:  # checked before the work, like --json
        from megatron_hsp.planner.paths import check_output_path
        from megatron_hsp.step.corpus import default_cache_dir

        if args.refit_out is None:
            from megatron_hsp.planner.paths import check_folder

            folder = check_folder(args.cache_dir or default_cache_dir(), "--cache-dir")
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
        compare_repeats=args.compare_repeats,
        planner=PlannerSettings(solver=args.solver, time_budget_s=DEMO_TIME_BUDGET_S),
        cache_dir=args.cache_dir,
        corpus_prefix=str(corpus.prefix),
        quiet=quiet,
    )
    if args.cost_model is not None:
        cfg.cost_model = args.cost_model
    cfg.refit, cfg.refit_out = not args.no_refit, refit_out
    if torchrun:
        from megatron_hsp.commands.demo_worker import run_torchrun

        result = run_torchrun(cfg)
        if rank != 0:
            return 0
    else:
        from megatron_hsp.commands.demo_ranks import run_ranks

        try:
            result = run_ranks(cfg)
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
            from megatron_hsp.planner.paths import atomic_write

            atomic_write(args.json, text + "\n", flag="--json")
    if plot_path is not None:
        from megatron_hsp.commands.plots import plot_demo

        plot_demo(result, plot_path)
        if args.json != "-":
            print(f"plot: {plot_path}", file=sys.stderr)
    if args.json != "-":
        print(render(result, elapsed))
    return 0
