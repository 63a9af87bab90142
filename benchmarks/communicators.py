"""Process groups, communicators, their estimated GPU memory and the group-creation calls per rank
at 8, 64, 1024 and 4096 GPUs, with the default group sizes and communicator cap:
``python benchmarks/communicators.py --json`` prints ``{"<world>": {"groups": N,
"communicators_per_rank": N, "est_gb_per_rank": X, "startup_calls_per_rank": N}}``.

Computed from the rules the runtime creates groups by (``planner/groupspace.py``:
``Cluster.legal_sizes``, ``sizes_within_communicator_budget``, ``communicators_per_rank``,
``Cluster.process_group_count``, ``communicator_memory_gb``, ``startup_calls_per_rank``), for
nodes of 8 GPUs at tensor parallel 1 and a Llama-3-8B-like model (32 query / 8 KV heads); no
process is started.

``groups``: process-group objects every rank creates; ``communicators_per_rank``: the groups of
more than one rank this rank belongs to and communicates on; ``est_gb_per_rank``: their NCCL
buffers (``communicator_memory_gb``); ``startup_calls_per_rank``: world-wide group-creation calls
under NCCL (one ``split_group`` per family of groups). Without ``--json`` it also prints the
previous rule's figures: one ``new_group`` call per group and a flat 0.5 GB per communicator.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_hsp.planner.groupspace import (
    DEFAULT_MAX_COMMUNICATORS,
    Cluster,
    HeadSpace,
    communicator_memory_gb,
    communicators_for_size,
    communicators_per_rank,
    sizes_within_communicator_budget,
    startup_calls_per_rank,
)

WORLDS = (8, 64, 1024, 4096)
GPUS_PER_NODE = 8
# The previous rule's flat charge per communicator (GB), for the comparison columns only.
FLAT_GB_BEFORE = 0.5


def table(
    heads: HeadSpace, cap: int = DEFAULT_MAX_COMMUNICATORS, worlds=WORLDS
) -> dict[str, dict[str, float]]:
    out = {}
    for world in worlds:
        cluster = Cluster(world, min(GPUS_PER_NODE, world))
        sizes = sizes_within_communicator_budget(
            cluster.legal_sizes(), cluster.gpus_per_node, cap, heads
        )
        out[str(world)] = {
            "groups": cluster.process_group_count(sizes, heads),
            "communicators_per_rank": communicators_per_rank(sizes, heads),
            "est_gb_per_rank": round(communicator_memory_gb(sizes, heads), 3),
            "startup_calls_per_rank": startup_calls_per_rank(cluster, sizes, heads),
            "sizes": sizes,
        }
    return out


def before(
    heads: HeadSpace, cap: int = DEFAULT_MAX_COMMUNICATORS, worlds=WORLDS
) -> dict[str, dict[str, float]]:
    """The previous rule: each size's communicators counted alone (a hybrid split's Ulysses
    sub-group never shared with a block), one ``new_group`` per group, a flat charge."""
    out = {}
    for world in worlds:
        cluster = Cluster(world, min(GPUS_PER_NODE, world))
        kept: list[int] = []
        used = 0
        legal = cluster.legal_sizes()
        first = [1, legal[-1]]
        powers = [d for d in legal if d & (d - 1) == 0]
        intra = [d for d in legal if d <= cluster.gpus_per_node]
        for d in dict.fromkeys([*first, *powers, *intra, *legal]):
            need = communicators_for_size(d, heads)
            if used + need <= cap:
                kept.append(d)
                used += need
        groups = 0
        for d in kept:
            u, r = heads.split(d)
            groups += len(cluster.block_starts(d)) * (1 + (u + r if u > 1 and r > 1 else 0))
        out[str(world)] = {
            "groups": groups,
            "communicators_per_rank": used,
            "est_gb_per_rank": round(used * FLAT_GB_BEFORE, 3),
            "startup_calls_per_rank": groups,
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
    old = before(heads, args.max_communicators)
    print(
        f"{'GPUs':>5} {'groups':>7} {'comms':>5} {'est GB':>6} {'calls':>5}   "
        "before: groups, comms, GB, calls"
    )
    for w, row in now.items():
        o = old[w]
        print(
            f"{w:>5} {row['groups']:>7} {row['communicators_per_rank']:>5} "
            f"{row['est_gb_per_rank']:>6} {row['startup_calls_per_rank']:>5}   "
            f"{o['groups']:>7} {o['communicators_per_rank']:>3} {o['est_gb_per_rank']:>5} "
            f"{o['startup_calls_per_rank']:>6}   sizes {row['sizes']}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
