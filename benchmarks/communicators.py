"""Process groups, communicators and their estimated GPU memory per rank at 8, 64, 1024 and 4096
GPUs, with the default group sizes and communicator cap (issue 15's contract):
``python benchmarks/communicators.py --json`` prints
``{"<world>": {"groups": N, "communicators_per_rank": N, "est_gb_per_rank": X}}``.

Computed from the rules the runtime creates groups by (``planner/groupspace.py``:
``Cluster.legal_sizes``, ``sizes_within_communicator_budget``, ``communicators_per_rank``,
``Cluster.process_group_count``), for nodes of 8 GPUs at tensor parallel 1 and a Llama-3-8B-like
model (32 query / 8 KV heads); no process is started. ``groups``: process-group objects every
rank creates (``new_group`` is collective over the world); ``communicators_per_rank``: the groups
of more than one rank this rank belongs to and communicates on; ``est_gb_per_rank``: times
``groupspace.COMMUNICATOR_GB``. Without ``--json`` it also prints the figures before issue 15
(every legal size, a duplicate group per pure-ring block, size-1 groups warmed).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_hsp.planner.groupspace import (
    COMMUNICATOR_GB,
    DEFAULT_MAX_COMMUNICATORS,
    Cluster,
    HeadSpace,
    communicators_per_rank,
    sizes_within_communicator_budget,
)

WORLDS = (8, 64, 1024, 4096)
GPUS_PER_NODE = 8


def table(
    heads: HeadSpace, cap: int = DEFAULT_MAX_COMMUNICATORS, worlds=WORLDS
) -> dict[str, dict[str, float]]:
    out = {}
    for world in worlds:
        cluster = Cluster(world, min(GPUS_PER_NODE, world))
        sizes = sizes_within_communicator_budget(
            cluster.legal_sizes(), cluster.gpus_per_node, cap, heads
        )
        comms = communicators_per_rank(sizes, heads)
        out[str(world)] = {
            "groups": cluster.process_group_count(sizes, heads),
            "communicators_per_rank": comms,
            "est_gb_per_rank": round(comms * COMMUNICATOR_GB, 3),
            "sizes": sizes,
        }
    return out


def before(heads: HeadSpace, worlds=WORLDS) -> dict[str, dict[str, float]]:
    """The rule before issue 15: every legal size, pure-ring blocks with a duplicate group, every
    group warmed (size 1 included)."""
    out = {}
    for world in worlds:
        cluster = Cluster(world, min(GPUS_PER_NODE, world))
        sizes = cluster.legal_sizes()
        groups, comms = 0, 0
        for d in sizes:
            u, r = heads.split(d)
            blocks = len(cluster.block_starts(d))
            extra = (u + r) if u > 1 and r > 1 else (1 if r > 1 else 0)
            groups += blocks * (1 + extra)
            comms += 1 + (2 if u > 1 and r > 1 else (1 if r > 1 else 0))
        out[str(world)] = {
            "groups": groups,
            "communicators_per_rank": comms,
            "est_gb_per_rank": round(comms * COMMUNICATOR_GB, 3),
        }
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print the contract's JSON only")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--max-communicators", type=int, default=DEFAULT_MAX_COMMUNICATORS)
    args = ap.parse_args(argv)
    heads = HeadSpace.from_model(args.heads, args.kv_heads, 1)
    now = table(heads, args.max_communicators)
    if args.json:
        print(
            json.dumps(
                {w: {k: v for k, v in row.items() if k != "sizes"} for w, row in now.items()}
            )
        )
        return 0
    old = before(heads)
    print(f"{'GPUs':>5} {'groups':>8} {'comms/rank':>10} {'est GB':>7}   before: groups, comms, GB")
    for w, row in now.items():
        o = old[w]
        print(
            f"{w:>5} {row['groups']:>8} {row['communicators_per_rank']:>10} "
            f"{row['est_gb_per_rank']:>7}   {o['groups']:>8} {o['communicators_per_rank']:>5} "
            f"{o['est_gb_per_rank']:>6}   sizes {row['sizes']}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
