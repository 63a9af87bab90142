"""``megatron-hsp selftest --nproc N [--mutations] [--json]``: distributed HSP steps vs an
independent single-device reference (CPU), optionally with the planted-bug suite.

Under ``torchrun`` it is the acceptance kit instead (``testing/acceptance.py``): the launched
processes, NCCL on their GPUs (gloo with ``--device cpu``), fp32 and bf16 against the fp32
reference (docs/gpu-validation.md)."""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Any

from megatron_hsp.commands.common import add_verbose_argument, import_warnings_summarised


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nproc", type=int, default=4, help="gloo processes to spawn: 4 or 8")
    parser.add_argument(
        "--mutations",
        action="store_true",
        help="also plant each bug of megatron_hsp/testing/mutations.py in turn and require the "
        "comparison to catch it (exit 1 if any survives); with --megatron also each bug of the "
        "Megatron loop (megatron_loop.PLANTS: stage boundary, expert-gradient reduction, "
        "per-document aux loss, resume, the sampler's choice of documents, ...) on its option "
        "set, printing each plant's worst check and by how much it missed its tolerance",
    )
    parser.add_argument(
        "--megatron",
        action="store_true",
        help="also run Megatron's own train_step with HSP installed against the stock path on 4 "
        "gloo ranks (plain DDP, distributed optimizer, overlapped grad reduce, TP 2 with "
        "--sequence-parallel, pure-ring and hybrid Ulysses x ring groups, evaluation, a blend "
        "and a restart through Megatron's checkpointing, pipeline parallel 1F1B and "
        "interleaved, dropless MoE at EP 1 and 2; "
        "megatron_hsp/testing/megatron_loop/) and compare loss, every parameter's gradient "
        "and final weights, grad norm, and lr / consumed samples against Megatron's own "
        "scheduler and sampler",
    )
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.add_argument(
        "--dtype",
        default=None,
        metavar="fp32,bf16",
        help="under torchrun: the dtypes the HSP model runs in, each against the fp32 reference "
        "(default fp32,bf16 on CUDA, fp32 on the CPU)",
    )
    parser.add_argument(
        "--device",
        choices=("cuda", "cpu"),
        default=None,
        help="under torchrun: where the launched processes run (default cuda when visible)",
    )
    parser.add_argument(
        "--plant",
        default=None,
        metavar="MUTATION",
        help="under torchrun: plant this bug (a name from megatron_hsp/testing/mutations.py, e.g. "
        "wrong-ring-merge) for the whole run; the kit must then report NOT ACCEPTED",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=600.0,
        help="seconds without progress from any rank before a run is called hung and killed "
        "(a run that keeps progressing is killed at 4x this plus a 300 s start-up allowance)",
    )
    add_verbose_argument(parser)


def run(args: argparse.Namespace) -> int:
    from megatron_hsp.planner.errors import HSPError
    from megatron_hsp.testing.dist import rank_output_logged

    with (
        import_warnings_summarised(args.verbose, "selftest", children=True),
        rank_output_logged(args.verbose, "selftest"),
    ):
        try:
            return _run(args)
        except TimeoutError as exc:  # every rank was stopped (testing/dist.py): one line
            first = str(exc).split("; rank ")[0].splitlines()[0]
            raise HSPError(
                f"{first}; every rank was stopped (--timeout {args.timeout:g})"
            ) from None


def _run(args: argparse.Namespace) -> int:
    from megatron_hsp.planner.errors import InputError
    from megatron_hsp.testing.acceptance import main as acceptance_main
    from megatron_hsp.testing.acceptance import under_torchrun

    if under_torchrun():
        if args.mutations or args.megatron:
            raise InputError(
                "--mutations and --megatron run on spawned CPU processes: run them without "
                "torchrun (megatron-hsp selftest --nproc 4 --mutations --megatron)"
            )
        return acceptance_main(args.dtype, args.device, args.json, args.plant)
    if args.dtype is not None or args.device is not None or args.plant is not None:
        raise InputError(
            "--dtype, --device and --plant apply under torchrun (the acceptance kit) only"
        )
    from megatron_hsp.planner.units import check_range
    from megatron_hsp.testing.mutations import MUTATIONS
    from megatron_hsp.testing.selftest import build_cases, case_table, mutation_table, run_selftest

    # A wall-clock bound: 0, negative or NaN would mean "never" or "at once".
    check_range(args.timeout, "--timeout", low=0, low_open=True, high=86400)
    build_cases(args.nproc)  # validates --nproc before anything is spawned
    mutations = [m.name for m in MUTATIONS] if args.mutations else None
    result = run_selftest(args.nproc, timeout_s=args.timeout, mutations=mutations)
    if args.megatron:
        from megatron_hsp.testing.megatron_loop import loop_table, run_megatron_loop

        # Always 4 ranks: the layout the loop's batch (8 documents) and checks are sized for.
        result["megatron_loop"] = run_megatron_loop(4, timeout_s=args.timeout)
        result["ok"] = result["ok"] and all(e["ok"] for e in result["megatron_loop"])
        if args.mutations:
            from megatron_hsp.testing.megatron_loop import run_megatron_plants

            plants = run_megatron_plants(4, timeout_s=args.timeout)
            result["megatron_plants"] = [
                {k: v for k, v in p.items() if k != "entry"} for p in plants
            ]
            result["ok"] = result["ok"] and all(p["caught"] for p in plants)
    if args.json:
        doc = {k: v for k, v in result.items() if not k.startswith("_")}
        print(json.dumps(_finite(doc), indent=2, allow_nan=False))
    else:
        print(case_table(result["_results"]))
        if args.mutations:
            print()
            print(mutation_table(result["_mutations"]))
        if args.megatron:
            print()
            print(loop_table(result["megatron_loop"]))
        if "megatron_plants" in result:
            print()
            from megatron_hsp.testing.megatron_loop import format_margin

            for p in result["megatron_plants"]:
                verdict = "caught" if p["caught"] else "SURVIVED"
                print(
                    f"{p['plant']:<38} on {p['options']!r:<40} {verdict}: worst check "
                    f"{p['worst_check']}, worst / tolerance {format_margin(p['margin'])}"
                )
        t = result["_timing"]
        print(
            f"{'ok' if result['ok'] else 'FAILED'}: {len(result['cases'])} cases"
            + (f", {len(result['_mutations'])} mutations" if args.mutations else "")
            + (f", {len(result['megatron_loop'])} Megatron loops" if args.megatron else "")
            + (
                f", {len(result['megatron_plants'])} Megatron plants"
                if "megatron_plants" in result
                else ""
            )
            + f" on {args.nproc} processes in {t['total_s']:.1f} s "
            f"(reference {t['reference_s']:.1f} s)",
            file=sys.stderr if not result["ok"] else sys.stdout,
        )
    return 0 if result["ok"] else 1


def _finite(value: Any) -> Any:
    """``--json`` is strict JSON: a margin of ``inf`` (an exact check failed; ``worst_check``
    names it) is written as null, never as the non-standard ``Infinity``."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value
