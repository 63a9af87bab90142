"""``megatron-hsp plan``: plan one global batch and print the Plan (table, or ``--json``)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

from megatron_hsp.commands.common import Setup, import_warnings_summarised
from megatron_hsp.commands.megatron_args import (
    add_job_arguments,
    print_notes,
    setup_from_args,
    unknown_flags_message,
)
from megatron_hsp.evaluation.baselines import trained_lengths
from megatron_hsp.evaluation.bench import (
    lower_bound_fn,
    parse_methods,
    plan_fn,
    price_baseline,
    shortest_microbatch_ms,
)
from megatron_hsp.planner.cost.pipeline import pipeline_lower_bound
from megatron_hsp.planner.plan import Plan


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_job_arguments(parser, "plan")
    parser.add_argument("--batch-index", type=int, default=0, help="which global batch (0-based)")
    parser.add_argument(
        "--method",
        default="hsp",
        help="hsp (default), megatron-static-cpN (stock Megatron's static CP N of your flags), "
        "static-N, batchada, flexsp-style, dp-balanced-N, megatron-dcp or "
        "megatron-dcp-dev (needs $MEGATRON_HSP_DEV_CHECKOUT)",
    )
    parser.add_argument("--json", action="store_true", help="print the Plan as JSON")
    parser.add_argument(
        "--plot",
        metavar="FILE.png",
        default=None,
        help="also draw the step as a Gantt chart (needs matplotlib)",
    )


def make_plan(args: argparse.Namespace, setup: Setup | None = None) -> Plan:
    setup = setup_from_args(args) if setup is None else setup
    batch = setup.sampler.batch(args.batch_index)
    lengths = batch.lengths
    (method,) = parse_methods(args.method)
    cost, cluster = setup.cost, setup.cluster
    t0 = time.perf_counter()
    from megatron_hsp.evaluation.torch_side.methods import torch_methods  # torch only on use

    job = getattr(setup, "job", None)
    plan = plan_fn(
        method,
        cost,
        cluster,
        hsp=setup.settings(args),
        sizes=setup.sizes,
        stock=None if job is None else job.stock,
        extra_methods=torch_methods(cost, cluster),
        flag="--method",
    )(lengths)
    if setup.pipeline is not None and method != "hsp":
        # Baselines run in the order their schedulers emit (evaluation/bench.py).
        plan = price_baseline(plan, cost, setup.pipeline, str(plan.extra.get("ring", "overlap")))
    elapsed = (time.perf_counter() - t0) * 1e3
    plan.validate(trained_lengths(plan, lengths).tolist(), cost, cluster.world_size)
    lb = plan.lower_bound_ms
    if not lb:
        fn = lower_bound_fn(cost, cluster, setup.sizes)
        lb = fn(lengths) if fn else 0.0
        if setup.pipeline is not None and lb:
            shortest = shortest_microbatch_ms(lengths, cost, cluster, setup.sizes)
            lb = pipeline_lower_bound(lb, shortest, setup.pipeline.pp, setup.pipeline.vpp)
    extra = {
        **plan.extra,
        "batch_index": args.batch_index,
        "sequences": len(lengths),
        "overlong_dropped": batch.dropped,
        "overlong_split": batch.split,
        "split_pieces": batch.pieces,
        "harness_dropped": setup.sampler.harness_dropped,
    }
    return dataclasses.replace(
        plan, lower_bound_ms=float(lb), solve_ms=plan.solve_ms or elapsed, extra=extra
    )


def format_plan(plan: Plan) -> str:
    # Under TP/PP the plan covers one stage's data x context plane, not the whole machine.
    where = "slots of one stage" if "pipeline" in plan.extra else "GPUs"
    lines = [
        f"plan: {plan.cost_model} on {plan.world_size} {where} ({plan.gpus_per_node}/node), "
        f"solver {plan.solver}, status {plan.status}",
        f"estimated step {plan.est_step_ms / 1e3:.3f} s  lower bound "
        f"{plan.lower_bound_ms / 1e3:.3f} s  solve {plan.solve_ms:.0f} ms  "
        f"{len(plan.microbatches)} micro-batches, {plan.num_sequences} sequences",
    ]
    x = plan.extra
    if "pipeline" in x:
        p = x["pipeline"]
        lines.append(
            f"pipeline: {p['schedule']} pp {p['pp']} vpp {p['vpp']}, micro-batches "
            f"{p['sum_microbatch_ms'] / 1e3:.3f} s + bubble {p['bubble_ms'] / 1e3:.3f} s "
            f"({p['order']} order), {p['peak_in_flight']:g} in flight"
        )
    if x.get("cut_by_cap"):
        lines.append(
            f"cut by the --time-budget cap in: {', '.join(x['cut_by_cap'])} (a plan that may "
            "differ on a faster or less loaded machine; a larger --time-budget lets counts decide)"
        )
    if x.get("overlong_dropped") or x.get("overlong_split"):
        lines.append(
            f"overlong: dropped {x.get('overlong_dropped', 0)}, split {x.get('overlong_split', 0)}"
            f" into {x.get('split_pieces', 0)} pieces"
        )
    lines.append(
        f"{'mb':>3} {'est_ms':>10}  {'groups (size x count)':<34} {'seqs':>5} {'tokens':>9}"
    )
    for i, mb in enumerate(plan.microbatches):
        counts: dict[int, int] = {}
        for g in mb.groups:
            counts[g.size] = counts.get(g.size, 0) + 1
        shape = " ".join(f"{s}x{c}" for s, c in sorted(counts.items(), reverse=True))
        seqs = sum(len(g.seq_ids) for g in mb.groups)
        tokens = sum(g.tokens for g in mb.groups)
        lines.append(f"{i:>3} {mb.est_ms:>10.1f}  {shape:<34} {seqs:>5} {tokens:>9}")
    return "\n".join(lines)


def unknown_arguments(extras: list[str]) -> str:
    """The one line for flags neither Megatron nor ``plan`` knows (``cli.main``)."""
    return unknown_flags_message("plan", extras)


def run(args: argparse.Namespace) -> int:
    with import_warnings_summarised(args.verbose, "plan"):
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    out = None
    if args.plot:
        from megatron_hsp.commands.plots import check_png_path

        out = check_png_path(args.plot)
    setup = setup_from_args(args)
    print_notes(setup)
    plan = make_plan(args, setup)
    if out is not None:
        from megatron_hsp.commands.plots import plot_plan

        plot_plan(plan, out, setup.cost.tokens_per_rank)
    if args.json:
        print(json.dumps(plan.to_dict()))
    else:
        print(format_plan(plan))
    return 0
