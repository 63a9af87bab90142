"""Planner strength suite: hsp against the baselines on several length distributions.

Each distribution is a seeded generator (sources and parameters below) or the Wikipedia sample;
lengths are written to a temporary file and run through ``megatron-hsp bench`` (same harness,
validator and cost model as every other figure). Prints a Markdown table. "gap to LB" uses
the larger of the two bounds per batch (``lower-bound``: combinatorial facts 1-4 and the
configuration LP of ``bounds.instance_lp_bound``); both are also shown on their own, the LP with
how many batches' column generation converged within ``bench.LP_BOUND_LIMIT_S``, and the
restricted master's value (an upper bound on the LP's value) against the combinatorial bound:
when that is near 0%, the LP cannot tighten the bound on those batches however long it runs.

Parameters were chosen on ``sft-long-mix`` and ``bimodal`` (the long-grouped chunking) and are
reported unchanged on the others (wikipedia, code-heavy-tail, web-crawl, lognormal-dcp).

    PYTHONPATH=. python benchmarks/suite.py --steps 5 [--gpus 64] [--global-batch 512]

"vs flexsp-style" is FlexSP's planner *emulated* on our MILP (``baselines.flexsp_style_config``:
power-of-two groups >= 2, token-balanced contiguous chunking, no local search), priced by the
same cost model with the runtime's executable Ulysses x ring split; not FlexSP's code.

"vs megatron-dcp-dev" is Megatron-LM dev's ``DefaultDynamicCPScheduler`` run from the checkout
named by ``$MEGATRON_HSP_DEV_CHECKOUT`` (add ``megatron-dcp-dev`` to ``--methods``; n/a otherwise).

The Megatron columns come from ``bench`` (CP groups priced by the same rule as hsp's ring groups);
the two "ring hidden" columns re-price the same batches with Megatron's ring traffic free
(``RingAssumptions("fully-hidden")``, the bound most favourable to Megatron,
``dcp_sensitivity.megatron_totals``).

Distributions (clipped to [128, max-seq]):
- wikipedia: FlexSP's Wikipedia release (../shared/data or the embedded 100k sample).
- code-heavy-tail: Pareto tail, alpha 1.1, min 512 (source-file lengths are Pareto-like).
- web-crawl: lognormal, median e^6.5 ~ 665 tokens, sigma 1.0 (mostly short pages).
- sft-long-mix: 70% lognormal(7, 0.8) chat turns + 30% uniform 32k-max long documents.
- lognormal-dcp: Megatron's dynamic-CP example (lognormal sigma 1.5, mean 1024 at max 8192),
  scaled by max-seq / 8192.
- bimodal: 90% lognormal(6, 0.5) short + 10% uniform max/2..max very long.
"""

from __future__ import annotations

import argparse
import gzip
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
from dcp_sensitivity import megatron_totals

from megatron_hsp.commands.common import add_common_arguments, build_setup
from megatron_hsp.evaluation.baselines import RingAssumptions

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared" / "data" / "wikipedia_lengths.txt.gz"
EMBEDDED = ROOT / "megatron_hsp" / "data" / "wikipedia_lengths_100k.txt.gz"


def generate(name: str, n: int, max_seq: int, rng: np.random.Generator) -> np.ndarray:
    """``n`` lengths of distribution ``name`` (see the module docstring)."""
    if name == "code-heavy-tail":
        x = 512 * (1 + rng.pareto(1.1, n))
    elif name == "web-crawl":
        x = rng.lognormal(6.5, 1.0, n)
    elif name == "sft-long-mix":
        long = rng.random(n) < 0.3
        x = np.where(long, rng.uniform(32_000, max_seq, n), rng.lognormal(7.0, 0.8, n))
    elif name == "lognormal-dcp":
        sigma = 1.5
        mu = np.log(1024) - sigma**2 / 2
        x = rng.lognormal(mu, sigma, n) * (max_seq / 8192)
    elif name == "bimodal":
        long = rng.random(n) < 0.1
        x = np.where(long, rng.uniform(max_seq / 2, max_seq, n), rng.lognormal(6.0, 0.5, n))
    else:
        raise ValueError(name)
    return np.clip(x, 128, max_seq).astype(np.int64)


def sequential_batches(
    name: str, cost, gbs: int, steps: int, rng: np.random.Generator
) -> list[list[int]]:
    """The first ``steps`` sequential batches of ``name`` as ``gap_decomposition.py`` and
    ``placement_gap.py`` draw them (one ``rng`` over the distributions in order, 5 batches' worth
    each, lengths above the longest trainable dropped)."""
    if name == "wikipedia":
        path = SHARED if SHARED.exists() else EMBEDDED
        with gzip.open(path, "rt") as fh:
            raw = np.array([int(x) for x in fh.read().split()[: 4 * gbs * 5]])
    else:
        raw = generate(name, 2 * gbs * 5, 192_000, rng)
    raw = raw[raw <= cost.max_trainable_length()]
    return [raw[s * gbs : (s + 1) * gbs].tolist() for s in range(steps)]


DISTRIBUTIONS = ["wikipedia", "code-heavy-tail", "web-crawl", "sft-long-mix", "lognormal-dcp",
                 "bimodal"]  # fmt: skip


def _ring_hidden(path: Path, args: argparse.Namespace, hsp_s: float | None) -> str:
    """Both Megatron baselines on the bench's batches with ring traffic free: two cells."""
    if hsp_s is None or "megatron-dcp" not in args.methods:
        return "n/a | n/a"
    setup_args = argparse.ArgumentParser()
    add_common_arguments(setup_args)
    ns = setup_args.parse_args(
        ["--lengths", str(path), "--gpus", str(args.gpus), "--cost-model", args.cost_model,
         "--max-seq", str(args.max_seq), "--global-batch", str(args.global_batch),
         "--sampling", "sequential", "--overlong", "drop"]
    )  # fmt: skip
    dcp, dpb, cp = megatron_totals(build_setup(ns), args.steps, RingAssumptions("fully-hidden"))
    return f"{dpb / hsp_s:.2f}x [CP={cp}] | {dcp / hsp_s:.2f}x"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--gpus", type=int, default=64)
    ap.add_argument("--global-batch", type=int, default=512)
    ap.add_argument("--max-seq", type=int, default=192_000)
    ap.add_argument("--cost-model", default="flexsp-gpt-7b")
    ap.add_argument(
        "--methods",
        default="hsp,static-best,batchada,flexsp-style,dp-balanced,megatron-dcp,lower-bound",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--time-budget",
        type=float,
        default=None,
        help="hsp's (and flexsp-style's) wall-clock budget per batch, passed to bench (default: "
        "bench's); a larger one keeps a loaded machine from cutting the search short",
    )
    ap.add_argument(
        "--only",
        nargs="*",
        default=None,
        help="run only these distributions (the others are still drawn, so batches match)",
    )
    ap.add_argument(
        "--dump-lengths",
        default=None,
        metavar="DIR",
        help="write each generated distribution to DIR/<name>.txt.gz (for other scripts' "
        "--lengths) and exit",
    )
    ap.add_argument(
        "--fingerprints",
        default=None,
        metavar="FILE",
        help="write every method's plan fingerprint per distribution and batch to FILE (JSON): "
        "two runs with the same seed, idle and loaded, must write the same (issue 30)",
    )
    args = ap.parse_args(argv)
    if args.fingerprints and not Path(args.fingerprints).resolve().parent.is_dir():
        ap.error(f"--fingerprints {args.fingerprints}: its folder does not exist")
    rng = np.random.default_rng(args.seed)
    prints: dict[str, dict[str, list[str]]] = {}
    if args.dump_lengths:
        out_dir = Path(args.dump_lengths)
        out_dir.mkdir(parents=True, exist_ok=True)
        for name in DISTRIBUTIONS:
            if name != "wikipedia":
                lens = generate(name, 2 * args.global_batch * args.steps, args.max_seq, rng)
                with gzip.open(out_dir / f"{name}.txt.gz", "wt") as fh:
                    fh.write("\n".join(str(x) for x in lens.tolist()))
        return 0
    print(
        f"{args.cost_model}, {args.gpus} GPUs, max-seq {args.max_seq}, GBS {args.global_batch}, "
        f"{args.steps} batches, methods {args.methods}\n"
    )
    columns = (
        "distribution | hsp total | vs static-best | vs batchada | vs flexsp-style | "
        "vs dp-balanced | vs megatron-dcp | vs megatron-dcp-dev | vs dp-balanced, ring hidden | "
        "vs megatron-dcp, ring hidden | gap to LB | gap to combinatorial LB | "
        "gap to LP LB (converged) | LP master vs combinatorial | solve p50/p99 ms | valid"
    )
    print(f"| {columns} |\n|" + "---|" * (columns.count("|") + 1))
    with tempfile.TemporaryDirectory() as tmp:
        for name in DISTRIBUTIONS:
            if name == "wikipedia":
                path = SHARED if SHARED.exists() else EMBEDDED
            else:
                # twice what the batches need: FlexSP-style filtering drops some at max-seq
                lens = generate(name, 2 * args.global_batch * args.steps, args.max_seq, rng)
                path = Path(tmp) / f"{name}.txt.gz"
                with gzip.open(path, "wt") as fh:
                    fh.write("\n".join(str(x) for x in lens.tolist()))
            if args.only is not None and name not in args.only:
                continue
            out = Path(tmp) / f"{name}.json"
            cmd = [
                sys.executable, "-m", "megatron_hsp.cli", "bench", "--flexsp-harness",
                "--lengths", str(path), "--gpus", str(args.gpus), "--cost-model", args.cost_model,
                "--max-seq", str(args.max_seq), "--global-batch", str(args.global_batch),
                "--steps", str(args.steps), "--sampling", "sequential", "--methods",
                args.methods, "--overlong", "drop", "--json", str(out),
            ]  # fmt: skip
            if args.time_budget is not None:
                cmd += ["--time-budget", str(args.time_budget)]
            proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
            if proc.returncode != 0:
                print(f"| {name} | failed: {proc.stderr.strip().splitlines()[-1]} |")
                continue
            doc = json.loads(out.read_text())
            prints[name] = {
                m: r["fingerprints"] for m, r in doc["methods"].items() if "fingerprints" in r
            }
            s = doc["summary"]
            tot = s["total_step_s"]

            def sp(k: str, s=s) -> str:
                v = s.get(f"speedup_vs_{k.replace('-', '_')}")
                return "n/a" if v is None else f"{v:.2f}x"

            gap = s["gap_to_lower_bound"]
            hidden = _ring_hidden(path, args, tot.get("hsp"))
            lbm = json.loads(out.read_text())["methods"].get("lower-bound", {})
            hsp_ms = tot.get("hsp", float("nan")) * 1e3
            comb = sum(lbm.get("combinatorial_ms", [])) or float("nan")
            lpb = sum(lbm.get("lp_ms", [])) or float("nan")
            conv = lbm.get("lp_converged", [])
            master = sum(lbm.get("lp_master_ms", [])) or float("nan")
            gaps = (
                f"{hsp_ms / comb - 1:.1%} | {hsp_ms / lpb - 1:.1%} "
                f"({sum(conv)}/{len(conv)}) | {master / comb - 1:+.1%}"
            )
            print(
                f"| {name} | {tot.get('hsp', float('nan')):.1f}s | {sp('static-best')} | "
                f"{sp('batchada')} | {sp('flexsp-style')} | {sp('dp-balanced')} | "
                f"{sp('megatron-dcp')} | {sp('megatron-dcp-dev')} | {hidden} | "
                f"{'n/a' if gap is None else f'{gap:.1%}'} | {gaps} | "
                f"{s['solve_ms_p50']:.0f} / {s['solve_ms_p99']:.0f} | "
                f"{str(s['all_plans_valid']).lower()} |",
                flush=True,
            )
    if args.fingerprints:
        Path(args.fingerprints).write_text(json.dumps(prints, indent=1, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
