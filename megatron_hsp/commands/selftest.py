"""``megatron-hsp selftest --nproc N [--json]``: distributed HSP steps vs one process (CPU)."""

from __future__ import annotations

import argparse
import json
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--nproc", type=int, default=4, help="gloo processes to spawn (power of two >= 4)"
    )
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.add_argument(
        "--timeout", type=float, default=600.0, help="seconds before a hung run is killed"
    )


def run(args: argparse.Namespace) -> int:
    from megatron_hsp.testing.selftest import build_cases, case_table, run_selftest

    build_cases(args.nproc)  # validates --nproc before anything is spawned
    result = run_selftest(args.nproc, timeout_s=args.timeout)
    if args.json:
        print(json.dumps({"ok": result["ok"], "cases": result["cases"]}, indent=2))
    else:
        print(case_table(result["_results"]))
        c = result["_control"]
        print(
            f"negative control (attention across documents): grad rel diff "
            f"{c['max_rel_grad_diff']:.2e}, loss rel diff {c['loss_rel_diff']:.2e} (must be large)"
        )
        t = result["_timing"]
        print(
            f"{'ok' if result['ok'] else 'FAILED'}: {len(result['cases'])} cases on "
            f"{args.nproc} processes in {t['total_s']:.1f} s (reference {t['reference_s']:.1f} s)",
            file=sys.stderr if not result["ok"] else sys.stdout,
        )
    return 0 if result["ok"] else 1
