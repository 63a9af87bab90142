"""``dp-balanced``'s port against Megatron-LM's own ``DpBalancedScheduler``, run from its source.

``evaluation/baselines.dp_balanced_layout`` re-implements Megatron's ``dp_balanced`` packing
scheduler (no released megatron-core has it). This script runs the scheduler's own
``get_groups_and_subsamples`` from a Megatron-LM dev checkout (``--checkout`` or
``$MEGATRON_HSP_DEV_CHECKOUT``; loaded as ``evaluation/torch_side/dcp_dev_baseline.py`` loads
dev's dynamic-CP scheduler) on the suite's batches, at every CP size, and compares the two layouts
micro-batch by
micro-batch (CP groups and the sample ids in each). Exit 1 on any difference.

    PYTHONPATH=. python benchmarks/dp_balanced_source_check.py --checkout DIR [--steps 2]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np
from suite import DISTRIBUTIONS, EMBEDDED, SHARED, generate

from megatron_hsp.commands.common import add_common_arguments, build_setup
from megatron_hsp.evaluation.baselines import (
    cp_groups_of_microbatch,
    dp_balanced_layout,
    homogeneous_sizes,
)
from megatron_hsp.evaluation.torch_side.dcp_dev_baseline import CHECKOUT_ENV, load_dev_dp_balanced
from megatron_hsp.planner.errors import InfeasibleError, InputError

Layout = list[list[tuple[int, list[int]]]] | str


def _normal(layout: list[list[tuple[int, list[int]]]]) -> Layout:
    return [sorted((size, sorted(ids)) for size, ids in mb if ids) for mb in layout]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkout", default=None, help=f"Megatron-LM dev checkout (${CHECKOUT_ENV})")
    ap.add_argument("--skip-if-missing", action="store_true", help="exit 0 without a checkout")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--gpus", type=int, default=64)
    ap.add_argument("--global-batch", type=int, default=512)
    ap.add_argument("--max-seq", type=int, default=192_000)
    ap.add_argument("--cost-model", default="llama3-8b-h100")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    try:
        schedule = load_dev_dp_balanced(args.checkout)
    except InputError as exc:
        print(exc, file=sys.stderr)
        return 0 if args.skip_if_missing else 2
    rng = np.random.default_rng(args.seed)
    print(f"{args.cost_model}, {args.gpus} GPUs, GBS {args.global_batch}, {args.steps} batches\n")
    print("| distribution | CP sizes | layouts compared | identical | first difference |")
    print("|---|---|---|---|---|")
    failed = 0
    with tempfile.TemporaryDirectory() as tmp:
        for name in DISTRIBUTIONS:  # the suite's draws, in its order, so the batches match
            if name == "wikipedia":
                path = SHARED if SHARED.exists() else EMBEDDED
            else:
                lens = generate(name, 2 * args.global_batch * args.steps, args.max_seq, rng)
                path = Path(tmp) / f"{name}.txt"
                path.write_text("\n".join(str(x) for x in lens.tolist()))
            setup_args = argparse.ArgumentParser()
            add_common_arguments(setup_args)
            flags = ["--lengths", str(path), "--gpus", str(args.gpus), "--cost-model",
                     args.cost_model, "--max-seq", str(args.max_seq), "--global-batch",
                     str(args.global_batch), "--sampling", "sequential",
                     "--overlong", "drop"]  # fmt: skip
            setup = build_setup(setup_args.parse_args(flags))  # the suite's bench batches
            cost, n = setup.cost, setup.cluster.world_size
            sizes = homogeneous_sizes(cost, setup.cluster, setup.sizes)
            compared, same, first = 0, 0, ""
            for step in range(args.steps):
                lengths = setup.sampler.batch(step).lengths
                for cp in sizes:
                    port: Layout
                    source: Layout
                    try:
                        port = _normal(dp_balanced_layout(lengths, cost, n, cp))
                    except InfeasibleError:
                        port = "infeasible"
                    try:
                        groups = schedule(
                            [(i, int(x)) for i, x in enumerate(lengths.tolist())],
                            n // cp,
                            cp,
                            int(cost.tokens_per_rank),
                        )
                        source = _normal([cp_groups_of_microbatch(g) for g in groups])
                    except AssertionError:  # "Not enough samples to move"
                        source = "infeasible"
                    compared += 1
                    if port == source:
                        same += 1
                    elif not first:
                        first = f"batch {step}, CP {cp}"
            failed += compared - same
            print(
                f"| {name} | {','.join(map(str, sizes))} | {compared} | {same} | {first or '-'} |",
                flush=True,
            )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
