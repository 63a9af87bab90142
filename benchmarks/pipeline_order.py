"""What the bubble order is worth on random micro-batch times (planner/cost/pipeline.py).

For random pipelines (pp in {2, 3, 4, 8}, vpp in {1, 1, 2, 3}, m = pp x 1..4 micro-batches of
times uniform in [0.1, 10]), the mean bubble (step minus summed times) of the given order and
of ``order_microbatches``' order, how often the closed-form lower bound is attained, and the
largest step (1F1B cases) over ``sum t + (pp - 1) max t``, the textbook formula with the longest
micro-batch: above 1 means no such max-based upper bound holds.

    PYTHONPATH=. python benchmarks/pipeline_order.py [--cases 1500] [--seed 1]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys

from megatron_hsp.planner.cost.pipeline import (
    PipelineSpec,
    bubble_lower_bound,
    order_microbatches,
    simulate,
)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", type=int, default=1500)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args(argv)
    rng = random.Random(args.seed)
    given, ordered, attained, over_max = [], [], 0, 0.0
    for _ in range(args.cases):
        pp = rng.choice([2, 3, 4, 8])
        vpp = rng.choice([1, 1, 2, 3])
        m = pp * rng.randint(1, 4)
        times = [rng.uniform(0.1, 10) for _ in range(m)]
        spec = PipelineSpec(pp=pp, vpp=vpp)
        step = simulate(times, spec)
        given.append(step - sum(times))
        ordered.append(order_microbatches(times, spec).bubble_ms)
        attained += abs(step - bubble_lower_bound(times, spec)) < 1e-9
        if vpp == 1:
            over_max = max(over_max, step / (sum(times) + (pp - 1) * max(times)))
    print(f"cases {args.cases}, seed {args.seed}")
    print(f"mean bubble, given order:  {statistics.mean(given):.1f}")
    print(f"mean bubble, bubble order: {statistics.mean(ordered):.1f}")
    print(f"closed-form lower bound attained by the given order: {attained}/{args.cases}")
    print(f"largest 1F1B step / (sum t + (pp - 1) max t): {over_max:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
