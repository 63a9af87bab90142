"""``megatron-hsp compare RUN_A RUN_B``: the measured A/B of two training runs' plan logs.

Why: a speedup is only as honest as its comparison. Two runs that differ only in
``--hsp-plan-method`` train the same batches (the sampler reads lengths only, the planner never
changes which documents a step holds), so their step times compare step by step; this command
checks that they did (every step's batch fingerprint, ``DocumentBatch.fingerprint``, equal in
both logs, else a one-line refusal naming the first step that differs), then prints the measured
speedup of B over A (A's step time / B's) per step and overall beside the one the plans predicted
(``planned_ms``: the plan's ``est_step_ms`` plus the cost model's per-step cost).

Repeats: ``--hsp-plan-log`` appends, so running the same command again into the same log adds a
repeat; a log whose step number goes back starts a new repeat there. A step's time is the median
over its repeats. Overall: total time of A over total time of B after ``--warmup`` steps, the
median of the per-step ratios and their spread (interquartile range over steps, and with two or
more repeats on each side the range of the repeats' overall ratios). When 1.00 lies inside that
spread the runs cannot be told apart and the verdict says so instead of quoting a ratio.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from megatron_hsp.planner.errors import InputError

STDOUT = "-"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_a", metavar="RUN_A", help="plan log (--hsp-plan-log) of the baseline run")
    p.add_argument("run_b", metavar="RUN_B", help="plan log of the run compared with it")
    p.add_argument(
        "--warmup",
        type=int,
        default=1,
        help="steps left out at the start of every repeat (process-group creation, first "
        "touches); default 1",
    )
    p.add_argument("--json", metavar="OUT.json", help="write the comparison as JSON ('-': stdout)")
    p.add_argument("--plot", metavar="OUT.png", help="picture of the per-step speedups")


def read_plan_log(path: str, flag: str) -> list[list[dict[str, Any]]]:
    """The repeats of one plan log: its rows, split where the step number goes back."""
    p = Path(path)
    if not p.is_file():
        raise InputError(f"{flag} {path}: no such plan log; pass the file --hsp-plan-log wrote")
    repeats: list[list[dict[str, Any]]] = []
    last = None
    for n, line in enumerate(p.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            step = int(row["step"])
        except (ValueError, KeyError, TypeError):
            raise InputError(
                f"{flag} {path}: line {n} is not a plan-log row (JSON with a step); pass the "
                "file --hsp-plan-log wrote"
            ) from None
        if last is None or step <= last:
            repeats.append([])
        repeats[-1].append(row)
        last = step
    if not repeats:
        raise InputError(f"{flag} {path}: the plan log is empty")
    return repeats


def _method(rows: Sequence[dict[str, Any]]) -> str:
    plan = rows[0].get("plan") or {}
    return str((plan.get("extra") or {}).get("method") or "hsp")


def _by_step(repeats: list[list[dict[str, Any]]], flag: str, path: str) -> dict[int, list[dict]]:
    out: dict[int, list[dict[str, Any]]] = {}
    for rows in repeats:
        for row in rows:
            if not row.get("batch_fingerprint"):
                raise InputError(
                    f"{flag} {path}: step {row['step']} has no batch fingerprint (a log written "
                    "before issue 43); rerun with this version"
                )
            if row.get("measured_ms") is None:
                raise InputError(f"{flag} {path}: step {row['step']} has no measured time")
            out.setdefault(int(row["step"]), []).append(row)
    return out


def _ratio_spread(values: Sequence[float]) -> tuple[float, float]:
    return float(np.percentile(values, 25)), float(np.percentile(values, 75))


def compare_logs(path_a: str, path_b: str, warmup: int = 1) -> dict[str, Any]:
    """The comparison of two plan logs (``run`` prints it); refuses differing batches."""
    rep_a, rep_b = read_plan_log(path_a, "RUN_A"), read_plan_log(path_b, "RUN_B")
    return compare_repeats(rep_a, rep_b, warmup, path_a, path_b)


def compare_repeats(
    rep_a: list[list[dict[str, Any]]],
    rep_b: list[list[dict[str, Any]]],
    warmup: int = 1,
    path_a: str = "A",
    path_b: str = "B",
) -> dict[str, Any]:
    """The comparison of two runs given as repeats of plan-log rows (``step``,
    ``measured_ms``, ``planned_ms``, ``batch_fingerprint``, ``plan``): what ``compare`` reads
    from two logs and the demo's side-by-side measures in memory."""
    if warmup < 0:
        raise InputError(f"--warmup must be >= 0 (got {warmup})")
    a, b = _by_step(rep_a, "RUN_A", path_a), _by_step(rep_b, "RUN_B", path_b)
    steps = sorted(set(a) & set(b))
    if not steps:
        raise InputError(f"RUN_A {path_a} and RUN_B {path_b} have no step in common")
    for s in steps:
        prints = {r["batch_fingerprint"] for r in a[s] + b[s]}
        if len(prints) > 1:
            fa, fb = a[s][0]["batch_fingerprint"], b[s][0]["batch_fingerprint"]
            raise InputError(
                f"the runs trained different batches from step {s} on (fingerprint {fa} in "
                f"RUN_A, {fb} in RUN_B"
                + (", and differing repeats" if fa == fb else "")
                + "): compare runs that differ only in --hsp-plan-method (same data, seed, "
                "batch and overlong flags)"
            )
    kept = [s for s in steps if s >= steps[0] + warmup]
    if not kept:
        raise InputError(
            f"--warmup {warmup} leaves none of the {len(steps)} common steps; lower it or run "
            "more steps"
        )
    rows = []
    for s in steps:
        ma = float(np.median([r["measured_ms"] for r in a[s]]))
        mb = float(np.median([r["measured_ms"] for r in b[s]]))
        pa = float(np.median([r.get("planned_ms") or r["predicted_ms"] for r in a[s]]))
        pb = float(np.median([r.get("planned_ms") or r["predicted_ms"] for r in b[s]]))
        rows.append(
            {
                "step": s,
                "fingerprint": a[s][0]["batch_fingerprint"],
                "a_ms": ma,
                "b_ms": mb,
                "a_predicted_ms": pa,
                "b_predicted_ms": pb,
                "measured_speedup": ma / mb,
                "predicted_speedup": pa / pb,
                "warmup": s not in kept,
            }
        )
    used = [r for r in rows if not r["warmup"]]
    ratios = [r["measured_speedup"] for r in used]
    measured = sum(r["a_ms"] for r in used) / sum(r["b_ms"] for r in used)
    predicted = sum(r["a_predicted_ms"] for r in used) / sum(r["b_predicted_ms"] for r in used)
    iqr = _ratio_spread(ratios)
    repeat_range = None
    pairs = min(len(rep_a), len(rep_b))
    if pairs >= 2:
        per = []
        for ra, rb in zip(rep_a[:pairs], rep_b[:pairs], strict=True):
            ta = sum(r["measured_ms"] for r in ra if int(r["step"]) in kept)
            tb = sum(r["measured_ms"] for r in rb if int(r["step"]) in kept)
            if ta > 0 and tb > 0:
                per.append(ta / tb)
        if len(per) >= 2:
            repeat_range = (min(per), max(per))
    lo = min(iqr[0], repeat_range[0]) if repeat_range else iqr[0]
    hi = max(iqr[1], repeat_range[1]) if repeat_range else iqr[1]
    distinguishable = not (lo <= 1.0 <= hi)
    return {
        "run_a": {"path": path_a, "method": _method(rep_a[0]), "repeats": len(rep_a)},
        "run_b": {"path": path_b, "method": _method(rep_b[0]), "repeats": len(rep_b)},
        "steps_compared": len(used),
        # Steps one log has and the other not (a run stopped early): left out, and said.
        "steps_left_out": sorted(set(a) ^ set(b)),
        "warmup_steps": len(rows) - len(used),
        "batches_identical": True,
        "steps": rows,
        "overall": {
            "measured_speedup": measured,
            "median_step_speedup": float(np.median(ratios)),
            "step_iqr": list(iqr),
            "repeat_range": None if repeat_range is None else list(repeat_range),
            "spread": [lo, hi],
            "predicted_speedup": predicted,
            "distinguishable": distinguishable,
            "predicted_inside_spread": lo <= predicted <= hi,
        },
    }


def verdict(result: dict[str, Any]) -> str:
    """The overall line: the ratio, or that the spread holds 1.00 and no ratio is quoted."""
    o, a, b = result["overall"], result["run_a"]["method"], result["run_b"]["method"]
    lo, hi = o["spread"]
    spread = f"spread {lo:.2f}-{hi:.2f}x"
    if o["repeat_range"] is None:
        spread += " (interquartile range over steps; repeat the runs for a run-to-run spread)"
    else:
        spread += " (per-step interquartile range and the repeats' range)"
    if not o["distinguishable"]:
        return (
            f"measured: no difference between {b} and {a} beyond noise: the {spread} includes "
            f"1.00x; predicted {o['predicted_speedup']:.2f}x"
        )
    slower = "" if o["measured_speedup"] > 1 else f", i.e. {b} is slower"
    return (
        f"measured: speedup of {b} over {a} {o['measured_speedup']:.2f}x{slower} (total time over "
        f"{result['steps_compared']} steps; median per step {o['median_step_speedup']:.2f}x, "
        f"{spread}); predicted {o['predicted_speedup']:.2f}x"
        + ("" if o["predicted_inside_spread"] else ", outside the measured spread")
    )


def report(result: dict[str, Any]) -> str:
    a, b = result["run_a"], result["run_b"]
    lines = [
        f"A: {a['path']} ({a['method']}, {a['repeats']} repeat(s)); B: {b['path']} "
        f"({b['method']}, {b['repeats']} repeat(s))",
        f"batches identical at all {len(result['steps'])} steps (fingerprints equal); "
        f"{result['warmup_steps']} warm-up step(s) left out of the overall figures"
        + (
            f"; steps {result['steps_left_out']} are in one log only and not compared"
            if result.get("steps_left_out")
            else ""
        ),
        f"{'step':>5} {'A ms':>9} {'B ms':>9} {'measured':>9} {'predicted':>9}",
    ]
    for r in result["steps"]:
        lines.append(
            f"{r['step']:>5} {r['a_ms']:>9.1f} {r['b_ms']:>9.1f} "
            f"{r['measured_speedup']:>8.2f}x {r['predicted_speedup']:>8.2f}x"
            + ("  (warm-up)" if r["warmup"] else "")
        )
    lines.append(verdict(result))
    return "\n".join(lines)


def write_json(result: dict[str, Any], path: str) -> None:
    """``result`` as JSON at ``path``, through the one atomic writer (``planner.paths``)."""
    if path == STDOUT:
        print(json.dumps(result, indent=1))
        return
    from megatron_hsp.planner.paths import atomic_write

    atomic_write(path, json.dumps(result, indent=1) + "\n", flag="--json")


def plot_compare(result: dict[str, Any], path: str) -> None:
    """Per-step measured and predicted speedups, the spread as a band (matplotlib, lazily)."""
    from megatron_hsp.commands.plots import _pyplot, _save, check_png_path

    out = check_png_path(path)
    plt = _pyplot()
    rows = result["steps"]
    o = result["overall"]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    xs = [r["step"] for r in rows]
    ax.axhspan(*o["spread"], color="tab:blue", alpha=0.12, label="measured spread")
    ax.plot(xs, [r["measured_speedup"] for r in rows], "o-", label="measured")
    ax.plot(xs, [r["predicted_speedup"] for r in rows], "s--", label="predicted")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xlabel("step")
    ax.set_ylabel(f"{result['run_a']['method']} time / {result['run_b']['method']} time")
    ax.legend(fontsize=8)
    fig.tight_layout()
    try:
        _save(fig, out)
    finally:
        plt.close(fig)


def run(args: argparse.Namespace) -> int:
    if args.plot:
        from megatron_hsp.commands.plots import check_png_path

        check_png_path(args.plot)
    result = compare_logs(args.run_a, args.run_b, args.warmup)
    if args.json != STDOUT:
        print(report(result))
    if args.json:
        write_json(result, args.json)
    if args.plot:
        plot_compare(result, args.plot)
        print(f"plot: {args.plot}", file=sys.stderr if args.json == STDOUT else sys.stdout)
    return 0
