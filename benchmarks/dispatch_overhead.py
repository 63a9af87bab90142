"""Host overhead of dispatch + THD packing per training step (target: <= 20 ms per step).

For a 512-sequence global batch of real Wikipedia document lengths (``../shared/data``, or a
seeded log-normal long tail when that file is absent), times what ONE rank does on the host each
step: build the ``GlobalBatch`` from per-document token arrays, ``dispatch`` its share of every
micro-batch, and turn the packs into torch tensors + ``PackedSeqParams``. Reported per plan shape
(homogeneous groups of 1, 8, 64 slots and a mixed-size plan) on 64 slots, as the median and p90 over
steps; the slot measured is the one with the most tokens (the slowest rank sets the step).

    PYTHONPATH=$PWD .venv/bin/python benchmarks/dispatch_overhead.py [--steps 20] [--json OUT]
"""

from __future__ import annotations

import argparse
import gzip
import json
import platform
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from megatron_hsp.runtime.dispatch import GlobalBatch, dispatch
from megatron_hsp.runtime.schedule import to_model_inputs
from megatron_hsp.testing.manual_plan import manual_plan, round_robin_plan

DATA = (
    Path(__file__).resolve().parent.parent / ".." / "shared" / "data" / "wikipedia_lengths.txt.gz"
)


def load_lengths(n_total: int, seed: int) -> tuple[np.ndarray, str]:
    if DATA.exists():
        with gzip.open(DATA, "rt") as fh:
            arr = np.fromiter((int(x) for x in fh), dtype=np.int64)
        return arr, "../shared/data/wikipedia_lengths.txt.gz"
    rng = np.random.default_rng(seed)
    arr = np.maximum(1, rng.lognormal(6.0, 1.2, n_total)).astype(np.int64)
    return arr, "synthetic log-normal(6.0, 1.2) (../shared/data absent)"


def mixed_plan(world: int, lengths: list[int]):
    """Longest 16 sequences in groups of 8 (micro-batch 0), the rest dealt to groups of
    {4, 2, 1, 1} per block of 8 (micro-batches 1-2): several sizes in one micro-batch."""
    order = sorted(range(len(lengths)), key=lambda s: -lengths[s])
    long, rest = order[:16], order[16:]
    mb0 = [(8, long[i::8]) for i in range(8)]
    sizes = [4, 2, 1, 1] * (world // 8)
    cells = [[] for _ in range(2 * len(sizes))]
    load = [0.0] * len(cells)
    for s in rest:
        c = min(range(len(cells)), key=lambda k: load[k] * 1.0)
        cells[c].append(s)
        load[c] += lengths[s] / sizes[c % len(sizes)]
    mb1 = [(sizes[i], cells[i]) for i in range(len(sizes))]
    mb2 = [(sizes[i], cells[len(sizes) + i]) for i in range(len(sizes))]
    return manual_plan(world, lengths, [mb0, mb1, mb2], gpus_per_node=8)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--global-batch", type=int, default=512)
    ap.add_argument("--gpus", type=int, default=64)
    ap.add_argument("--max-seq", type=int, default=192 * 1024)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=str, default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    # A one-rank gloo group stands in for the real group object (only its identity is used).
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    group = dist.group.WORLD
    all_lengths, source = load_lengths(args.steps * args.global_batch, args.seed)
    all_lengths = all_lengths[all_lengths <= args.max_seq]
    rng = np.random.default_rng(args.seed)
    results: dict[str, dict[str, float]] = {}
    shapes = {
        "groups-of-1": lambda L: round_robin_plan(args.gpus, L, 1, 1, gpus_per_node=8),
        "groups-of-8": lambda L: round_robin_plan(args.gpus, L, 8, 2, gpus_per_node=8),
        "group-of-64": lambda L: round_robin_plan(args.gpus, L, 64, 4, gpus_per_node=8),
        "mixed-8/4/2/1": lambda L: mixed_plan(args.gpus, L),
    }
    for name, make in shapes.items():
        times, tokens, parts = [], [], []
        for step in range(args.steps):
            lo = step * args.global_batch % max(1, all_lengths.size - args.global_batch)
            lengths = all_lengths[lo : lo + args.global_batch].tolist()
            docs = [rng.integers(0, 50_000, n) for n in lengths]  # the data loader's output
            plan = make(lengths)
            per_slot = np.zeros(args.gpus)
            for mb in plan.microbatches:
                for g in mb.groups:
                    per_slot[list(g.ranks)] += g.tokens / g.size
            slot = int(per_slot.argmax())
            t0 = time.perf_counter()
            batch = GlobalBatch.from_documents(docs)
            t1 = time.perf_counter()
            packs = dispatch(batch, plan, slot)
            t2 = time.perf_counter()
            inputs = [to_model_inputs(p, group, torch.device("cpu")) for p in packs if not p.empty]
            t3 = time.perf_counter()
            times.append((t3 - t0) * 1e3)
            parts.append(((t1 - t0) * 1e3, (t2 - t1) * 1e3, (t3 - t2) * 1e3))
            tokens.append(sum(int(i.input_ids.numel()) for i in inputs))
        t = np.asarray(times[1:] if len(times) > 1 else times)
        p50 = np.median(np.asarray(parts[1:] if len(parts) > 1 else parts), axis=0)
        results[name] = {
            "ms_p50": round(float(np.median(t)), 3),
            "ms_p90": round(float(np.percentile(t, 90)), 3),
            "ms_max": round(float(t.max()), 3),
            "p50_split_ms": {
                "global_batch": round(float(p50[0]), 3),
                "dispatch": round(float(p50[1]), 3),
                "to_torch": round(float(p50[2]), 3),
            },
            "local_tokens_mean": round(float(np.mean(tokens)), 1),
        }
    out = {
        "config": {**vars(args), "lengths_source": source},
        "machine": f"{platform.processor() or platform.machine()}, torch {torch.__version__}, "
        f"{torch.get_num_threads()} torch thread",
        "per_step_one_rank": results,
        "target_ms": 20.0,
        "ok": all(r["ms_p90"] <= 20.0 for r in results.values()),
    }
    text = json.dumps(out, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
