"""Record what Megatron-LM dev's own packing schedulers return on the test batches (a fixture).

Why: dev's ``DefaultDynamicCPScheduler`` and ``DpBalancedScheduler``
(``megatron/core/datasets/data_schedule.py``) are in no released megatron-core, so CI cannot
call them; ``tests/evaluation/test_megatron_schedules_fixture.py`` checks the ``megatron-dcp-dev``
and ``dp-balanced`` plans against what dev's code returned here instead. Nothing of Megatron is
copied: this script imports dev's ``megatron.core`` from a checkout outside the repository (it
imports on a CPU without Transformer Engine) and calls the classes as ``wrap_data_iterator``
constructs them. Run (dev checkout at ``$DEV``, e.g. ``git archive dev megatron/core``):

    PYTHONPATH=. python benchmarks/record_megatron_schedules.py --checkout $DEV \\
        --out tests/fixtures/megatron_dev_schedules.json

The batches are the dynamic-CP benchmark's (examples/dynamic_context_parallel of dev:
``MockVarlenDataset``, lognormal mean 1024, sigma 1.5, 128-8192 tokens, seed 0, one document
per sample, GBS 8 per data-parallel rank of CP 4, ``--max-seqlen-per-dp-cp-rank 2048``),
``benchmarks/dcp_published.py``'s ``benchmark_batches``, plus a more skewed set (the README's
sigma 1.8, mean 768 override).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

from benchmarks.dcp_published import CP, MAX_SEQLEN_PER_RANK, benchmark_batches
from megatron_hsp.evaluation.baselines import thd_pad_divisor, thd_padded

SETS = {"default": (1024, 1.5), "skewed": (768, 1.8)}
WORLDS = (4, 8, 16, 32, 64)
STEPS = {"default": 20, "skewed": 4}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--checkout",
        type=Path,
        default=os.environ.get("MEGATRON_HSP_DEV_CHECKOUT") or None,
        help="Megatron-LM dev checkout (default: $MEGATRON_HSP_DEV_CHECKOUT)",
    )
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--commit", help="the checkout's commit when it is no git work tree")
    ap.add_argument(
        "--skip-if-missing", action="store_true", help="exit 0 saying so when no checkout is given"
    )
    a = ap.parse_args()
    if a.checkout is None or not Path(a.checkout).is_dir():
        line = "no Megatron-LM dev checkout (--checkout or $MEGATRON_HSP_DEV_CHECKOUT)"
        print(f"record_megatron_schedules: {line}{': skipped' if a.skip_if_missing else ''}")
        return 0 if a.skip_if_missing else 2
    a.checkout = Path(a.checkout)
    commit = subprocess.run(
        ["git", "-C", str(a.checkout), "rev-parse", "HEAD"], capture_output=True, text=True
    ).stdout.strip() or (a.commit or "unknown (not a git work tree)")
    for name in [m for m in sys.modules if m == "megatron" or m.startswith("megatron.")]:
        del sys.modules[name]
    sys.path.insert(0, str(a.checkout.resolve()))
    ds = importlib.import_module("megatron.core.datasets.data_schedule")
    assert Path(ds.__file__).is_relative_to(a.checkout.resolve()), ds.__file__
    cases = []
    for name, (mean, sigma) in SETS.items():
        for world in WORLDS:
            dp = world // CP
            for step, raw in enumerate(
                benchmark_batches(world, STEPS[name], mean=mean, sigma=sigma)
            ):
                dyn = thd_padded(raw, thd_pad_divisor(CP, world, dynamic=True)).tolist()
                static = thd_padded(raw, thd_pad_divisor(CP, world, dynamic=False)).tolist()
                dcp = ds.DefaultDynamicCPScheduler(
                    MAX_SEQLEN_PER_RANK, CP, dp, None, min_cp_size=1
                ).get_groups_and_subsamples(list(enumerate(dyn)))
                bal = ds.DpBalancedScheduler(MAX_SEQLEN_PER_RANK, CP, dp, None)
                balanced = bal.get_groups_and_subsamples(list(enumerate(static)))
                cases.append(
                    {
                        "set": name,
                        "world": world,
                        "step": step,
                        "lengths": [int(x) for x in raw],
                        "dynamic_cp_padded": dyn,
                        "dynamic_cp_groups": dcp,
                        "dp_balanced_padded": static,
                        "dp_balanced_groups": balanced,
                    }
                )
    out = {
        "source": "NVIDIA/Megatron-LM dev, megatron/core/datasets/data_schedule.py "
        "(DefaultDynamicCPScheduler, DpBalancedScheduler), run unchanged",
        "commit": commit,
        "command": "PYTHONPATH=. python benchmarks/record_megatron_schedules.py "
        "--checkout DEV --out " + str(a.out),
        "checkout": "git archive of the commit's megatron/core",
        "cp": CP,
        "max_seqlen_per_dp_cp_rank": MAX_SEQLEN_PER_RANK,
        "sets": {k: {"mean_seq_len": m, "lognormal_sigma": s} for k, (m, s) in SETS.items()},
        "cases": cases,
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(out, separators=(",", ":")) + "\n")
    print(f"{len(cases)} cases from {commit} -> {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
