"""FlexSP's own pricing (pure Ulysses at every size) on its benchmark batches: the comparison row.

    PYTHONPATH=. python benchmarks/flexsp_published.py

Wikipedia, gpt-7b, 192k, 64 GPUs (8 per node), GBS 512, sequential batches 0-9, hsp time budget
1 s. ``as_published=True`` reproduces FlexSP's figures (static-64 68.50 s, batchada 55.38 s) but
includes groups no runtime can execute (Ulysses over 64 ranks, 32 heads);
docs/results/benchmarks.md."""

from __future__ import annotations

import sys
from pathlib import Path

from megatron_hsp.evaluation.bench import run_bench
from megatron_hsp.planner.cost.costmodel import flexsp_cost_model
from megatron_hsp.planner.lengths import BatchSampler, read_lengths
from megatron_hsp.planner.search.settings import PlannerSettings
from megatron_hsp.planner.topology import Cluster

DATA = Path("../shared/data/wikipedia_lengths.txt.gz")


def main() -> int:
    if not DATA.exists():
        print(f"missing {DATA}: run from the repo root with ../shared beside it", file=sys.stderr)
        return 2
    cost = flexsp_cost_model("flexsp-gpt-7b", 64, max_seq_k=192, as_published=True)
    sampler = BatchSampler(read_lengths(DATA), 512, "sequential", 192_000, overlong="drop")
    batches = [sampler.batch(i) for i in range(10)]
    methods = ["hsp", "static-64", "batchada", "lower-bound"]
    res = run_bench(batches, cost, Cluster(64, 8), methods, hsp=PlannerSettings())
    for name, total in res["summary"]["total_step_s"].items():
        print(f"{name:12s} {total:8.3f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
