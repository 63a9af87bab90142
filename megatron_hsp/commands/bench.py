"""``megatron-hsp bench``: hsp against static, adaptive and Megatron baselines over many batches."""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

from megatron_hsp.commands.common import config_dict, import_warnings_summarised
from megatron_hsp.commands.megatron_args import (
    add_job_arguments,
    default_methods,
    gain_lines,
    print_notes,
    setup_from_args,
    unknown_flags_message,
)
from megatron_hsp.evaluation.bench import DEFAULT_METHODS, parse_methods, run_bench
from megatron_hsp.planner.errors import InputError
from megatron_hsp.planner.paths import STDOUT, atomic_write, check_output_path
from megatron_hsp.planner.plan import Plan


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_job_arguments(parser, "bench")
    parser.add_argument("--steps", type=int, default=20, help="global batches to plan")
    parser.add_argument("--start-step", type=int, default=0, help="first global batch (0-based)")
    parser.add_argument(
        "--methods",
        default=None,
        help="default: hsp, static-<your --context-parallel-size>, static-best (with "
        f"--flexsp-harness: {','.join(DEFAULT_METHODS)}); "
        "comma-separated: hsp, static-best, static-N, batchada, flexsp-style (FlexSP's "
        "planner emulated on our solver), dp-balanced, dp-balanced-N, megatron-dcp, "
        "megatron-dcp-dev (dev's DefaultDynamicCPScheduler from the Megatron-LM checkout named by "
        "$MEGATRON_HSP_DEV_CHECKOUT), lower-bound "
        "(lower-bound is added whenever hsp runs)",
    )
    parser.add_argument(
        "--json",
        metavar="OUT.json",
        default=None,
        help="write results as JSON to this file ('-': standard output, instead of the table)",
    )
    parser.add_argument(
        "--plot",
        metavar="FILE.png",
        default=None,
        help="also draw step time per method and the length histogram (needs matplotlib)",
    )


def run_from_args(
    args: argparse.Namespace,
    hsp_plans: list[Plan] | None = None,
    lengths_out: list[np.ndarray] | None = None,
) -> dict:
    """Run the bench; ``hsp_plans`` / ``lengths_out`` collect hsp's plans and the batches."""
    if args.steps < 1:
        raise InputError(f"--steps must be >= 1, got {args.steps}")
    from megatron_hsp.evaluation.torch_side.methods import torch_methods  # torch only on use

    setup = setup_from_args(args)
    if args.methods is None:
        args.methods = ",".join(DEFAULT_METHODS if setup.job is None else default_methods(setup))
    methods = parse_methods(args.methods)
    if "hsp" in methods and "lower-bound" not in methods:
        methods.append("lower-bound")
    if not args.json:
        print_notes(setup)
    batches = [setup.sampler.batch(args.start_step + i) for i in range(args.steps)]
    out = run_bench(
        batches,
        setup.cost,
        setup.cluster,
        methods,
        hsp=setup.settings(args),
        pipeline=setup.pipeline,
        sizes=setup.sizes,
        stock=None if setup.job is None else setup.job.stock,
        extra_methods=torch_methods(setup.cost, setup.cluster),
        plans_sink={"hsp": hsp_plans} if hsp_plans is not None else None,
        progress=(lambda m: print(f"bench: running {m} ...", file=sys.stderr))
        if not args.json
        else None,
    )
    out["summary"]["batches"] = {
        "sequences": [len(b.lengths) for b in batches],
        "tokens": [int(b.lengths.sum()) for b in batches],
        "overlong_dropped": sum(b.dropped for b in batches),
        "overlong_split": sum(b.split for b in batches),
        "harness_dropped": setup.sampler.harness_dropped,
        "tokens_per_rank": setup.cost.tokens_per_rank,
    }
    if lengths_out is not None:
        lengths_out.extend(b.lengths for b in batches)
    job = setup.job
    if job is not None:  # a Megatron job: what it is, and the planned gain
        out["job"] = {
            "described": job.describe(),
            "cost_model": setup.cost.name,
            "context_parallel_size": job.cp,
            "token_budget": job.token_budget,
            "stock_step_tokens": job.stock_step_tokens,
            "stock": None if job.stock is None else job.stock.to_dict(),
            "stock_described": None if job.stock is None else job.stock.describe(),
            "notes": list(job.notes),
            "overlong": setup.sampler.overlong_line,
        }
    return {"config": config_dict(args), **out}


def format_bench(result: dict) -> str:
    cfg, summ, methods = result["config"], result["summary"], result["methods"]
    walls = summ.get("total_step_wall_s") or summ["total_step_s"]
    hsp_wall = walls.get("hsp")
    steps = f"{cfg['start_step']}..{cfg['start_step'] + cfg['steps'] - 1}"
    job = result.get("job")
    if job is None:
        head = (
            f"bench: {cfg['cost_model']} on {cfg['gpus']} GPUs ({cfg['gpus_per_node']}/node), "
            f"max-seq {cfg['max_seq']}, GBS {cfg['global_batch']}, {cfg['sampling']} batches "
            f"{steps}"
        )
    else:
        head = f"bench: {job['cost_model']} on {job['described']}; training-sampler batches {steps}"
    lines = [head]
    if job is not None and job.get("stock_described"):
        lines.append(f"megatron-static-cp<N>: stock Megatron's step: {job['stock_described']}")
    lines.append(
        f"{'method':<22} {'total_s':>9} {'mean_step_s':>11} {'hsp_speedup':>11} "
        f"{'tokens/step':>11} {'solve_p50_ms':>12} {'solve_p99_ms':>12} {'valid':>5}"
    )
    tokens = summ.get("tokens_per_step", {})
    for name, res in methods.items():
        steps = res["step_ms"]
        if res.get("infeasible_batches"):
            lines.append(
                f"{name:<22} infeasible on {res['infeasible_batches']} of {len(steps)} batches: "
                f"{res['infeasible_reason']}"
            )
            continue
        total = sum(steps) / 1e3
        wall = walls.get(name)
        speed = f"{wall / hsp_wall:.3f}x" if hsp_wall and wall and name != "hsp" else "-"
        solve = sorted(res.get("solve_ms", []))
        p50 = f"{solve[len(solve) // 2]:.1f}" if solve else "-"
        p99 = f"{solve[min(len(solve) - 1, int(0.99 * len(solve)))]:.1f}" if solve else "-"
        valid = "-" if name == "lower-bound" else str(res.get("valid", True)).lower()
        label = name + (f" ({res['degree']})" if "degree" in res else "")
        tok = f"{tokens[name]:.0f}" if name in tokens else "-"
        lines.append(
            f"{label:<22} {total:>9.2f} {total / len(steps):>11.3f} {speed:>11} {tok:>11} "
            f"{p50:>12} {p99:>12} {valid:>5}"
        )
    hsp_passes = summ["total_step_s"].get("hsp")
    if hsp_wall and hsp_passes and hsp_wall > hsp_passes:
        n = len(methods["hsp"]["step_ms"])
        lines.append(
            f"total_s is the passes; hsp_speedup is of whole steps, adding "
            f"{(hsp_wall - hsp_passes) / n:.3f} s per step of gradient reduction and optimizer "
            "that every method pays"
        )
    gap = summ.get("gap_to_lower_bound")
    lines.append(
        f"all plans valid: {str(summ['all_plans_valid']).lower()}"
        + (f"; hsp gap to lower bound {gap * 100:.1f}%" if gap is not None else "")
        + f"; planner peak RSS {summ['planner_peak_rss_mb']:.0f} MB"
    )
    lines.extend(_not_trained_lines(summ.get("batches") or {}))
    if job is not None:
        lines.extend(gain_lines(result, job["context_parallel_size"]))
    return "\n".join(lines)


def _not_trained_lines(b: dict) -> list[str]:
    """What the batches left out or cut, said in the text output as in the JSON (only
    the JSON showed 163 of 1536 sequences dropped as too long for memory)."""
    out = []
    dropped, split = b.get("overlong_dropped", 0), b.get("overlong_split", 0)
    if dropped or split:
        total = sum(b.get("sequences", [])) + dropped
        out.append(
            f"overlong: {dropped} of {total} sequences dropped, {split} split, as longer than "
            f"the memory allows ({b.get('tokens_per_rank')} tokens per rank; --overlong)"
        )
    return out  # FlexSP's harness rule is said on stderr when the corpus is read (common.py)


def unknown_arguments(extras: list[str]) -> str:
    """The one line for flags neither Megatron nor ``bench`` knows (``cli.main``)."""
    return unknown_flags_message("bench", extras)


def run(args: argparse.Namespace) -> int:
    with import_warnings_summarised(args.verbose, "bench"):
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    if args.json:
        check_output_path("--json", args.json, allow_stdout=True)
    out = None
    if args.plot:
        from megatron_hsp.commands.plots import check_png_path

        out = check_png_path(args.plot)
    plans: list[Plan] = []
    lengths: list[np.ndarray] = []
    result = run_from_args(args, plans, lengths)
    if out is not None:
        from megatron_hsp.commands.plots import plot_bench

        plot_bench(result, lengths, plans, out)
        print(f"bench: wrote {out}", file=sys.stderr)
    if args.json == STDOUT:
        print(json.dumps(result, indent=1))
        return 0 if result["summary"]["all_plans_valid"] else 1
    if args.json:
        atomic_write(args.json, json.dumps(result, indent=1), flag="--json")
        print(f"bench: wrote {args.json}", file=sys.stderr)
    print(format_bench(result))
    return 0 if result["summary"]["all_plans_valid"] else 1
