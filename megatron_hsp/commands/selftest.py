"""``megatron-hsp selftest --nproc N [--mutations] [--json]``: distributed HSP steps vs an
independent single-device reference (CPU), optionally with the planted-bug suite."""

from __future__ import annotations

import argparse
import json
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--nproc", type=int, default=4, help="gloo processes to spawn (power of two >= 4)"
    )
    parser.add_argument(
        "--mutations",
        action="store_true",
        help="also plant each bug of megatron_hsp/testing/mutations.py in turn and require the "
        "comparison to catch it (exit 1 if any survives)",
    )
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.add_argument(
        "--timeout", type=float, default=600.0, help="seconds before a hung run is killed"
    )


def run(args: argparse.Namespace) -> int:
    from megatron_hsp.testing.mutations import MUTATIONS
    from megatron_hsp.testing.selftest import build_cases, case_table, mutation_table, run_selftest

    build_cases(args.nproc)  # validates --nproc before anything is spawned
    mutations = [m.name for m in MUTATIONS] if args.mutations else None
    result = run_selftest(args.nproc, timeout_s=args.timeout, mutations=mutations)
    if args.json:
        doc = {k: v for k, v in result.items() if not k.startswith("_")}
        print(json.dumps(doc, indent=2))
    else:
        print(case_table(result["_results"]))
        if args.mutations:
            print()
            print(mutation_table(result["_mutations"]))
        t = result["_timing"]
        print(
            f"{'ok' if result['ok'] else 'FAILED'}: {len(result['cases'])} cases"
            + (f", {len(result['_mutations'])} mutations" if args.mutations else "")
            + f" on {args.nproc} processes in {t['total_s']:.1f} s "
            f"(reference {t['reference_s']:.1f} s)",
            file=sys.stderr if not result["ok"] else sys.stdout,
        )
    return 0 if result["ok"] else 1
