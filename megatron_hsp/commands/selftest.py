"""``megatron-hsp selftest --nproc N [--mutations] [--json]``: distributed HSP steps vs an
independent single-device reference (CPU), optionally with the planted-bug suite.

Under ``torchrun`` it is the acceptance kit instead (``testing/acceptance.py``): the launched
processes, NCCL on their GPUs (gloo with ``--device cpu``), fp32 and bf16 against the fp32
reference (docs/gpu-validation.md)."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path
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
        "interleaved, dropless MoE at EP 1 and 2, a set whose steps hold a token budget; "
        "megatron_hsp/testing/megatron_loop/) with your defaults (online refit on, overlong "
        "documents split) but for the switches its table lists, and compare loss, every "
        "parameter's gradient "
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
        "--ranks-share-gpu",
        action="store_true",
        help="many ranks on one GPU: the acceptance kit with every rank on cuda:0, gloo process "
        "groups and the runtime's collectives staged through pinned host buffers (Ulysses, the "
        "fused ring, hybrid groups, dispatch and loss across ranks on CUDA kernels; NCCL, "
        "bandwidth and TE need a GPU per rank). Without torchrun it launches --nproc ranks "
        "itself; with --device cpu the ranks run on the CPU through the same staged path",
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
    """The ranks' logs are removed when every check passed and kept (and named) otherwise."""
    from megatron_hsp.planner.errors import HSPError
    from megatron_hsp.testing.dist import rank_output_logged

    started = _process_started()
    with (
        import_warnings_summarised(args.verbose, "selftest", children=True),
        rank_output_logged(args.verbose, "selftest") as logs,
    ):
        try:
            rc = _run(args, started)
        except TimeoutError as exc:  # every rank was stopped (testing/dist.py): one line
            first = str(exc).split("; rank ")[0].splitlines()[0]
            raise HSPError(
                f"{first}; every rank was stopped (--timeout {args.timeout:g})"
            ) from None
        logs.passed = rc == 0
        return rc


def _run(args: argparse.Namespace, started: float | None = None) -> int:
    from megatron_hsp.planner.errors import InputError
    from megatron_hsp.runtime.compat import running_versions
    from megatron_hsp.testing.acceptance import main as acceptance_main
    from megatron_hsp.testing.acceptance import under_torchrun

    if under_torchrun():
        if args.mutations or args.megatron:
            raise InputError(
                "--mutations and --megatron run on spawned CPU processes: run them without "
                "torchrun (megatron-hsp selftest --nproc 4 --mutations --megatron)"
            )
        return acceptance_main(args.dtype, args.device, args.json, args.plant, args.ranks_share_gpu)
    if args.ranks_share_gpu:
        if args.mutations or args.megatron:
            raise InputError(
                "--ranks-share-gpu runs the acceptance kit; --mutations and --megatron run the "
                "CPU selftest: run them without --ranks-share-gpu"
            )
        return _launch_kit(args)
    if args.dtype is not None or args.device is not None or args.plant is not None:
        raise InputError(
            "--dtype, --device and --plant apply under torchrun (the acceptance kit) only, or "
            "with --ranks-share-gpu"
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
            + f" on {args.nproc} processes in {_wall(started, t['total_s'])} "
            f"(reference {t['reference_s']:.1f} s); {running_versions()}",
            file=sys.stderr if not result["ok"] else sys.stdout,
        )
    return 0 if result["ok"] else 1


def _process_started() -> float:
    """When this process started, on ``time.monotonic()``'s clock: the interpreter's start-up and
    torch's import count as the user's wait too. Linux's ``/proc/self/stat`` (start time in clock
    ticks since boot) against ``/proc/uptime``; elsewhere, now."""
    now = time.monotonic()
    try:
        stat = Path("/proc/self/stat").read_text()
        ticks = int(stat.rsplit(")", 1)[1].split()[19])  # field 22, starttime
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        ago = uptime - ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return now
    return now - ago if 0 <= ago < 86400 else now


def _wall(started: float | None, fallback_s: float) -> str:
    """The command's wall time (start-up, every suite, the Megatron loops), as a user's clock
    reads it: "in 46.0 s" was once printed for a 4 min 41 s command (only the first suite)."""
    seconds = time.monotonic() - started if started is not None else fallback_s
    minutes, rest = divmod(seconds, 60.0)
    return f"{int(minutes)} min {rest:.0f} s" if minutes else f"{rest:.1f} s"


def _launch_kit(args: argparse.Namespace) -> int:
    """``selftest --ranks-share-gpu --nproc N``: the acceptance kit on N ranks launched here
    by torchrun's own launcher (``torch.distributed.run --standalone``), exactly as a user would
    start it, so there is one kit and one way its ranks start. The launcher dies with this
    command (``lifetime.die_with_parent``'s signal), and takes its ranks with it."""
    import os
    import subprocess

    from megatron_hsp.planner.errors import InputError
    from megatron_hsp.runtime.lifetime import die_with_parent_preexec

    if args.nproc < 1:
        raise InputError(f"--nproc {args.nproc}: the kit needs at least one rank")
    device = args.device or "cuda"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd += [f"--nproc-per-node={args.nproc}", "-m", "megatron_hsp.cli", "selftest"]
    cmd += ["--ranks-share-gpu", "--device", device]
    for flag, value in (("--dtype", args.dtype), ("--plant", args.plant)):
        if value is not None:
            cmd += [flag, value]
    cmd += ["--json"] if args.json else []
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.pop("TORCHELASTIC_RUN_ID", None)
    return subprocess.run(cmd, env=env, preexec_fn=die_with_parent_preexec()).returncode


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
