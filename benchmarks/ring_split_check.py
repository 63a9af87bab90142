"""Does hsp lose anything by pricing each size at its default split only? (docs/baselines.md)

hsp's runtime pre-creates sub-groups for ``HeadSpace.split`` only, so the planner never runs a
group as pure ring where that would be cheaper. This prints, per preset, the sizes and sequence
lengths where pure ring ``(1, d)`` beats the default split under the one pricing rule, then an
optimistic bound on the whole-plan effect: hsp re-planned with every sequence charged the cheaper
of the two (a per-sequence choice no runtime group can make), on the FlexSP benchmark batches.

    PYTHONPATH=. python benchmarks/ring_split_check.py
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from megatron_hsp.evaluation.bench import hsp_plan_fn
from megatron_hsp.planner.cost.costmodel import CostModel, load_cost_model
from megatron_hsp.planner.lengths import BatchSampler, read_lengths
from megatron_hsp.planner.search.settings import PlannerSettings
from megatron_hsp.planner.topology import Cluster

DATA = Path("../shared/data/wikipedia_lengths.txt.gz")
EMBEDDED = Path("megatron_hsp/data/wikipedia_lengths_100k.txt.gz")
PRESETS = ("flexsp-gpt-7b", "flexsp-gpt-13b", "flexsp-gpt-30b", "llama3-8b-h100", "llama3-70b-h100")


@dataclasses.dataclass(frozen=True)
class BestOfSplits(CostModel):
    """Each sequence charged the cheaper of its default split and pure ring (a bound only)."""

    def seq_ms(
        self,
        lengths: np.ndarray | Sequence[int],
        d: int,
        split: tuple[int, int] | None = None,
        ring: str = "overlap",
    ) -> np.ndarray:
        out = super().seq_ms(lengths, d, split, ring)
        if split is None and d > 1:
            out = np.minimum(out, super().seq_ms(lengths, d, (1, d), ring))
        return out


def ring_wins(m: CostModel) -> list[tuple[int, int, int, float]]:
    """(size, shortest, longest, best relative saving) where pure ring beats the default."""
    s = np.unique(np.geomspace(128, m.max_trainable_length(), 400).astype(np.int64))
    out = []
    for d in m.sizes:
        if d == 1 or m.split(d) == (1, d):
            continue
        ok = s[s <= m.capacity(d)]
        default = m.seq_ms(ok, d) + m.fixed_ms(d)
        ring = m.seq_ms(ok, d, (1, d)) + m.fixed_ms(d, (1, d))
        win = ring < default
        if win.any():
            saving = float(np.max((default - ring)[win] / default[win]))
            out.append((d, int(ok[win].min()), int(ok[win].max()), saving))
    return out


def main() -> int:
    for name in PRESETS:
        m = load_cost_model(name, world_size=64, gpus_per_node=8, max_seq_k=192)
        wins = ring_wins(m)
        text = ", ".join(f"d={d}: {lo}-{hi} tokens (up to {x:.1%})" for d, lo, hi, x in wins)
        print(f"{name}: pure ring cheaper than the default split: {text or 'never'}")
    data = DATA if DATA.exists() else EMBEDDED
    sampler = BatchSampler(read_lengths(data), 512, "sequential", 192_000, overlong="drop")
    batches = [sampler.batch(i).lengths for i in range(10)]
    cluster = Cluster(64, 8)
    cost = load_cost_model("flexsp-gpt-7b", world_size=64, gpus_per_node=8, max_seq_k=192)
    best = BestOfSplits(**{f.name: getattr(cost, f.name) for f in dataclasses.fields(cost)})
    totals = [
        sum(hsp_plan_fn(c, cluster, PlannerSettings())(b).est_step_ms for b in batches) / 1e3
        for c in (cost, best)
    ]
    print(
        f"\nflexsp-gpt-7b, 192k, 64 GPUs, Wikipedia batches 0-9: hsp {totals[0]:.2f} s at default "
        f"splits; {totals[1]:.2f} s if every sequence got the cheaper of default and pure ring "
        f"({1 - totals[1] / totals[0]:.1%} less, an optimistic bound)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
