"""FlexSP's grid (and scale rows) through ``megatron-hsp bench``; writes docs/results/benchmarks.md.

Every row is exactly one ``megatron-hsp bench`` command (printed in the doc), run as its own
process so that the numbers in the table are the ones that command prints and its peak RSS is
the planner's alone. Methods that this build lacks
(``hsp`` before the solver is merged) are left out and their columns read ``n/a``.

    PYTHONPATH=. .venv/bin/python benchmarks/flexsp_grid.py            # full grid, >= 20 steps
    PYTHONPATH=. .venv/bin/python benchmarks/flexsp_grid.py --quick    # 64-GPU 7b rows, 5 steps
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SHARED_WIKI = "../shared/data/wikipedia_lengths.txt.gz"
ALL_METHODS = "hsp,static-best,static-32,static-64,batchada,dp-balanced,megatron-dcp"


def grid_rows(steps: int, quick: bool) -> list[dict]:
    rows = []
    models = ["flexsp-gpt-7b"] if quick else ["flexsp-gpt-7b", "flexsp-gpt-13b", "flexsp-gpt-30b"]
    for model in models:
        for max_seq in ("192k", "384k"):
            rows.append(
                {"gpus": 64, "gbs": 512, "model": model, "max_seq": max_seq, "steps": steps}
            )
    if not quick:
        rows.append(
            {"gpus": 256, "gbs": 2048, "model": "flexsp-gpt-7b", "max_seq": "192k", "steps": steps}
        )
        rows.append(
            {"gpus": 1024, "gbs": 8192, "model": "flexsp-gpt-7b", "max_seq": "192k", "steps": steps}
        )
    return rows


def available_methods(methods: str) -> str:
    names = [m for m in methods.split(",") if m]
    sys.path.insert(0, str(ROOT))
    if importlib.util.find_spec("megatron_hsp.planner.search.solver") is None:
        names = [m for m in names if m != "hsp"]
    if importlib.util.find_spec("megatron.core") is None:
        names = [m for m in names if m != "megatron-dcp"]
    return ",".join(names)


def row_argv(row: dict, lengths: str, methods: str, time_budget: float, out: Path) -> list[str]:
    return [
        "bench", "--flexsp-harness", "--lengths", lengths, "--gpus", str(row["gpus"]),
        "--gpus-per-node", "8", "--cost-model", row["model"], "--max-seq", row["max_seq"],
        "--global-batch", str(row["gbs"]), "--steps", str(row["steps"]), "--sampling", "sequential",
        "--overlong", "drop",
        "--methods", methods, "--time-budget", str(time_budget), "--json", str(out),
    ]  # fmt: skip


def _fmt(x: float | None, spec: str = ".2f", suffix: str = "x") -> str:
    return "n/a" if x is None else f"{x:{spec}}{suffix}"


def table_line(row: dict, result: dict) -> str:
    s, m = result["summary"], result["methods"]
    total = s["total_step_s"]
    hsp = total.get("hsp")

    def sp(name: str) -> str:
        if m.get(name, {}).get("infeasible_batches"):
            return f"OOM on {m[name]['infeasible_batches']}/{row['steps']}"
        if name not in total:
            return "n/a"
        base = f"{total[name]:.1f}s"
        return f"{total[name] / hsp:.2f}x ({base})" if hsp else base

    best = m.get("static-best", {}).get("degree")
    cp = m.get("dp-balanced", {}).get("degree")
    gap = s.get("gap_to_lower_bound")
    return (
        f"| {row['gpus']} | {row['model'].removeprefix('flexsp-')} | {row['max_seq']} | "
        f"{row['gbs']} | {row['steps']} | {_fmt(hsp, '.1f', 's')} | "
        f"{sp('static-best')}{f' [N={best}]' if best else ''} | {sp('static-32')} | "
        f"{sp('static-64')} | {sp('batchada')} | "
        f"{sp('dp-balanced')}{f' [CP={cp}]' if cp else ''} | "
        f"{sp('megatron-dcp')} | "
        f"{_fmt(None if gap is None else gap * 100, '.1f', '%')} | "
        f"{_fmt(s.get('solve_ms_p50'), '.0f', '')} / {_fmt(s.get('solve_ms_p99'), '.0f', '')} | "
        f"{str(s['all_plans_valid']).lower()} | "
        f"{str(s.get('all_plans_executable')).lower()} | {s['planner_peak_rss_mb']:.0f} |"
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--quick", action="store_true", help="64-GPU gpt-7b rows only")
    ap.add_argument("--methods", default=ALL_METHODS)
    ap.add_argument("--time-budget", type=float, default=1.0)
    ap.add_argument("--lengths", default=SHARED_WIKI, help="default: ../shared Wikipedia (1M)")
    ap.add_argument("--out-dir", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--doc", default=str(ROOT / "docs" / "results" / "benchmarks.md"))
    args = ap.parse_args()
    os.chdir(ROOT)  # relative paths (../shared/..., JSON outputs) are from the repo root
    lengths = args.lengths
    if not (ROOT / lengths).exists() and not Path(lengths).exists():
        print(f"flexsp_grid: {lengths} not found; using the embedded 100k subset", file=sys.stderr)
        lengths = "megatron_hsp/data/wikipedia_lengths_100k.txt.gz"
    methods = available_methods(args.methods)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    lines, commands = [], []
    for row in grid_rows(args.steps, args.quick):
        name = f"{row['model']}_{row['max_seq']}_{row['gpus']}gpus_gbs{row['gbs']}"
        out = out_dir / f"{name}.json"
        argv = row_argv(
            row,
            lengths,
            methods,
            args.time_budget,
            out.relative_to(ROOT) if out.is_relative_to(ROOT) else out,
        )
        commands.append("PYTHONPATH=. python -m megatron_hsp.cli " + shlex.join(argv))
        print(f"flexsp_grid: {name} ...", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        proc = subprocess.run(
            [sys.executable, "-m", "megatron_hsp.cli", *argv],
            cwd=ROOT,
            env=env,
            check=False,
            stdout=subprocess.DEVNULL,
        )
        if proc.returncode not in (0, 1):  # 1: some plan invalid (shown in the table)
            print(f"flexsp_grid: {name} failed (exit {proc.returncode})", file=sys.stderr)
            continue
        result = json.loads(out.read_text())
        lines.append(table_line(row, result))
        print(f"  {lines[-1]}  ({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
    write_doc(Path(args.doc), lines, commands, methods, args)
    return 0


HEADER = (
    "| GPUs | model | max-seq | GBS | steps | hsp total | vs static-best | vs static-32 | "
    "vs static-64 | vs batchada | vs dp-balanced | vs megatron-dcp | gap to LB | "
    "solve p50/p99 ms | valid | executable | RSS MB |\n|" + "---|" * 17
)


def write_doc(path: Path, lines: list[str], commands: list[str], methods: str, args) -> None:
    marker_begin, marker_end = "<!-- grid:begin -->", "<!-- grid:end -->"
    body = "\n".join(
        [
            marker_begin,
            f"Generated by `PYTHONPATH=. python benchmarks/flexsp_grid.py"
            f"{' --quick' if args.quick else ''} --steps {args.steps}` "
            f"(methods: {methods}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}). "
            "Speedup = baseline total / hsp total over the same batches (baseline total in "
            "parentheses); without hsp the cells show baseline totals only.",
            "",
            HEADER,
            *lines,
            "",
            "Exact commands (one per row; JSON lands in benchmarks/results/):",
            "",
            "```",
            *commands,
            "```",
            marker_end,
        ]
    )
    text = path.read_text() if path.exists() else ""
    if marker_begin in text and marker_end in text:
        head, rest = text.split(marker_begin, 1)
        text = head + body + rest.split(marker_end, 1)[1]
    else:
        text = (text.rstrip() + "\n\n" if text else "# Benchmarks\n\n") + body + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    print(f"flexsp_grid: wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
