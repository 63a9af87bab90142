"""Megatron's published dynamic-CP benchmark, replayed through our execution model.

Megatron-LM dev's examples/dynamic_context_parallel (README, "Slurm Benchmark Results") times a
12-layer, hidden-2048 GPT (FFN 8192, 16 heads, vocab 131072, bf16, TP 1, PP 1, no distributed
optimizer) on ``MockVarlenDataset`` lengths (lognormal, mean 1024, sigma 1.5, 128-8192 tokens,
numpy seed 0, one document per sample), GBS 8 per data-parallel rank of CP 4,
``--max-seqlen-per-dp-cp-rank 2048``, on 4-64 GPUs, four per node, and reports dynamic CP
1.21-1.50x faster than ``--sequence-packing-scheduler dp_balanced`` at CP 4 (10%-trimmed mean of
iterations 11-30). This script plans iterations 11-30 of that run with

- ``dp-balanced-4``: ``evaluation.baselines.dp_balanced_plan`` (arrival-order packs of
  2048 x 4 padded tokens, pure p2p ring over CP 4, one THD pass per pack);
- ``megatron-dcp-dev``: dev's ``DefaultDynamicCPScheduler`` groups (from ``--checkout`` run
  live, else replayed from the recorded fixture ``tests/fixtures/megatron_dev_schedules.json``),
  one packed THD pass per scheduler micro-batch;
- ``megatron-dcp``: megatron-core's installed ``BalancedCPScheduler`` (main), one
  forward/backward per sub-sample as ``hybrid_context_parallel_forward_backward`` runs it;

each priced by the one price function (``planner/cost/execution.py``) on the first-principles
model of that GPT built from its flags as ``--hsp`` builds it (``megatron/model_cost.py``). The
hardware is not named by the benchmark: H100 SXM is assumed (the calibrated preset), four GPUs
per node, NDR across nodes. ``tokens_per_rank`` is the benchmark's 2048 (its scheduler's
capacity; memory does not bind a 0.9B model at 2K tokens per GPU).

    PYTHONPATH=. python benchmarks/dcp_published.py            # Markdown table
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import types
from collections.abc import Callable
from pathlib import Path

import numpy as np

from megatron_hsp.evaluation.baselines import dp_balanced_plan
from megatron_hsp.megatron.model_cost import choose_hardware, default_cost_model_spec
from megatron_hsp.planner.cost.costmodel import CostModel, load_cost_model
from megatron_hsp.planner.cost.execution import step_wall_ms
from megatron_hsp.planner.topology import Cluster

CP = 4
MAX_SEQLEN_PER_RANK = 2048
GPUS_PER_NODE = 4
NUM_MICROBATCHES = 8  # the script's default: GBS = 1 x DP x 8
FIRST_STEP = 10  # statistics exclude the first 10 logged iterations
STEPS = 20
SEED = 0
POOL = 1_000_000  # MockSFTLowLevelDataset.size
FIXTURE = Path(__file__).parent.parent / "tests/fixtures/megatron_dev_schedules.json"
# (GPUs, baseline trimmed mean ms, dynamic CP trimmed mean ms), README of dev d48bd6be0a85.
PUBLISHED = [
    (4, 195.269, 151.906),
    (8, 220.119, 155.850),
    (16, 226.775, 187.125),
    (32, 286.206, 208.088),
    (64, 271.988, 181.912),
]
MODEL_ARGS = {
    "num_layers": 12,
    "hidden_size": 2048,
    "ffn_hidden_size": 8192,
    "num_attention_heads": 16,
    "vocab_size": 131072,
    "bf16": True,
}


def mock_varlen_lengths(mean: int = 1024, sigma: float = 1.5) -> np.ndarray:
    """``MockSFTLowLevelDataset``'s lengths: numpy's global seed 0, lognormal with
    ``mu = log(mean) - sigma^2 / 2``, clipped to 128-8192, truncated to int."""
    rng = np.random.RandomState(SEED)
    mu = np.log(mean) - sigma**2 / 2
    return np.clip(rng.lognormal(mu, sigma, POOL), 128, 8192).astype(np.int64)


def benchmark_batches(
    world: int, steps: int, start: int = FIRST_STEP, mean: int = 1024, sigma: float = 1.5
) -> list[np.ndarray]:
    """The global batches of iterations ``start``.. as the scheduler sees them: the dataset's
    samples in order (split 99,1,0 keeps train indices contiguous; the single sampler hands
    micro-batch m's sample m * dp + r to DP rank r), gathered over DP ranks in rank order."""
    dp = world // CP
    gbs = dp * NUM_MICROBATCHES
    pool = mock_varlen_lengths(mean, sigma)
    order = [m * dp + r for r in range(dp) for m in range(NUM_MICROBATCHES)]
    return [pool[(start + k) * gbs + np.asarray(order)] for k in range(steps)]


def benchmark_cost(
    world: int, hardware: str = "h100-sxm", gpus_per_node: int = GPUS_PER_NODE
) -> CostModel:
    """The benchmark GPT on the assumed ``hardware`` (a ``--hsp-hardware`` preset),
    ``gpus_per_node`` per NVLink domain, capacity 2048 tokens per rank."""
    args = types.SimpleNamespace(**MODEL_ARGS)
    spec, _ = default_cost_model_spec(args, choose_hardware(hardware), 1)
    cost = load_cost_model(spec, world_size=world, gpus_per_node=gpus_per_node, max_seq_k=8.192)
    return dataclasses.replace(cost, tokens_per_rank=MAX_SEQLEN_PER_RANK)


def _fixture_schedule(world: int) -> Callable:
    data = json.loads(FIXTURE.read_text())
    recorded = {
        tuple(c["dynamic_cp_padded"]): c["dynamic_cp_groups"]
        for c in data["cases"]
        if c["set"] == "default" and c["world"] == world
    }

    def schedule(samples: list[tuple[int, int]], n: int, cap: int) -> list:
        key = tuple(length for _, length in samples)
        if key not in recorded or n != world or cap != MAX_SEQLEN_PER_RANK:
            raise KeyError(f"no recorded dev schedule for this batch at {n} GPUs")
        return recorded[key]

    return schedule


def run(
    checkout: str | None,
    steps: int,
    hardware: str = "h100-sxm",
    gpus_per_node: int = GPUS_PER_NODE,
) -> list[dict]:
    from megatron_hsp.evaluation.torch_side.dcp_baseline import megatron_dcp_plan
    from megatron_hsp.evaluation.torch_side.dcp_dev_baseline import (
        load_dev_scheduler,
        megatron_dcp_dev_plan,
    )

    rows = []
    for world, base_ms, dcp_ms in PUBLISHED:
        cost = benchmark_cost(world, hardware, gpus_per_node)
        cluster = Cluster(world, min(gpus_per_node, world))
        dev = load_dev_scheduler(checkout) if checkout else _fixture_schedule(world)
        sums = {"dp-balanced-4": [], "megatron-dcp-dev": [], "megatron-dcp": []}
        passes = {k: [] for k in sums}
        for batch in benchmark_batches(world, steps):
            plans = {
                "dp-balanced-4": dp_balanced_plan(batch, cost, cluster, CP),
                "megatron-dcp-dev": megatron_dcp_dev_plan(batch, cost, cluster, dev),
                "megatron-dcp": megatron_dcp_plan(batch, cost, cluster),
            }
            for k, p in plans.items():
                sums[k].append(step_wall_ms(p, cost))
                passes[k].append(len(p.microbatches))
        mean = {k: float(np.mean(v)) for k, v in sums.items()}
        rows.append(
            {
                "gpus": world,
                "published_baseline_ms": base_ms,
                "published_dcp_ms": dcp_ms,
                "published_speedup": base_ms / dcp_ms,
                "step_overhead_ms": cost.step_overhead_ms,
                **{f"{k}_ms": v for k, v in mean.items()},
                **{f"{k}_passes": float(np.mean(v)) for k, v in passes.items()},
                "model_speedup_dev": mean["dp-balanced-4"] / mean["megatron-dcp-dev"],
                "model_speedup_main": mean["dp-balanced-4"] / mean["megatron-dcp"],
                # the same without the per-step terms (passes only: est_step_ms)
                "passes_speedup_dev": (mean["dp-balanced-4"] - cost.step_overhead_ms)
                / (mean["megatron-dcp-dev"] - cost.step_overhead_ms),
            }
        )
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkout", help="Megatron-LM dev checkout (default: the recorded fixture)")
    ap.add_argument("--steps", type=int, default=STEPS)
    ap.add_argument("--hardware", default="h100-sxm", help="assumed GPU (--hsp-hardware preset)")
    ap.add_argument(
        "--gpus-per-node",
        type=int,
        default=GPUS_PER_NODE,
        help="GPUs per NVLink domain (default 4, as published; 72: an NVL72 rack)",
    )
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    rows = run(a.checkout, a.steps, a.hardware, a.gpus_per_node)
    if a.json:
        print(json.dumps(rows, indent=1))
        return 0
    print(
        "| GPUs | published dp_balanced / DCP ms | published speedup | model dp-balanced-4 ms "
        "| model dev DCP ms | model speedup (dev) | model main DCP ms | model speedup (main) "
        "| per-step ms | passes only: speedup (dev) | passes dp-bal / dev / main |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['gpus']} | {r['published_baseline_ms']:.0f} / {r['published_dcp_ms']:.0f} "
            f"| {r['published_speedup']:.2f}x | {r['dp-balanced-4_ms']:.1f} "
            f"| {r['megatron-dcp-dev_ms']:.1f} | {r['model_speedup_dev']:.2f}x "
            f"| {r['megatron-dcp_ms']:.1f} | {r['model_speedup_main']:.2f}x "
            f"| {r['step_overhead_ms']:.1f} | {r['passes_speedup_dev']:.2f}x "
            f"| {r['dp-balanced-4_passes']:.1f} / "
            f"{r['megatron-dcp-dev_passes']:.1f} / {r['megatron-dcp_passes']:.1f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
