"""Measurements for ``megatron-hsp profile`` on whatever backend this process runs (gloo/CPU or
NCCL/GPU): forward+backward time of a megatron-core ``GPTModel`` on packed (THD) batches, and
all-to-all time per group size and message size.

Only measurement lives here; fitting is ``megatron_hsp.planner.fit`` (pure), the command is
``megatron_hsp.commands.profile``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from megatron.core.packed_seq_params import PackedSeqParams


@dataclass(frozen=True)
class ComputeSample:
    """One timed forward+backward: the batch's sequence lengths and the median time."""

    lengths: tuple[int, ...]
    ms: float


def _packed_inputs(
    lengths: Sequence[int], vocab: int, group: dist.ProcessGroup, device: torch.device
) -> dict[str, Any]:
    total = int(sum(lengths))
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32, device=device)
    gen = torch.Generator().manual_seed(total)
    ids = torch.randint(0, vocab, (1, total), generator=gen).to(device)
    pos = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0).to(device)
    params = PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        cu_seqlens_q_padded=cu,
        cu_seqlens_kv_padded=cu,
        max_seqlen_q=int(max(lengths)),
        max_seqlen_kv=int(max(lengths)),
        cp_group=group,
        local_cp_size=1,
    )
    return {
        "input_ids": ids,
        "position_ids": pos,
        "attention_mask": None,
        "labels": torch.roll(ids, -1, dims=1),
        "packed_seq_params": params,
    }


def measure_compute(
    model: torch.nn.Module,
    batches: Sequence[Sequence[int]],
    *,
    vocab: int,
    group: dist.ProcessGroup,
    device: torch.device,
    repeats: int,
    progress: Callable[[int, int], None] | None = None,
) -> list[ComputeSample]:
    """Median forward+backward ms of ``model`` on each packed batch (one warm-up run each)."""
    out: list[ComputeSample] = []
    for i, lengths in enumerate(batches):
        inputs = _packed_inputs(lengths, vocab, group, device)
        times: list[float] = []
        for r in range(repeats + 1):
            model.zero_grad(set_to_none=True)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            model(**inputs).sum().backward()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if r:  # the first run warms caches and allocators
                times.append((time.perf_counter() - t0) * 1e3)
        out.append(ComputeSample(tuple(int(x) for x in lengths), float(np.median(times))))
        if progress:
            progress(i + 1, len(batches))
    return out


def measure_all_to_all(
    rank: int,
    world_size: int,
    token_counts: Sequence[int],
    bytes_per_token: int,
    repeats: int,
) -> dict[int, list[tuple[int, float]]]:
    """For each group size d dividing the world (d > 1): (tokens, median ms) of an all-to-all.

    Runs on an initialised process group (any backend); every rank must call it. The message is
    what Ulysses moves per layer call for ``tokens`` tokens of the group (``bytes_per_token``,
    float32 elements), split evenly over the group.
    """
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if dist.get_backend() == "nccl"
        else (torch.device("cpu"))
    )
    results: dict[int, list[tuple[int, float]]] = {}
    d = 2
    while d <= world_size:
        if world_size % d == 0:
            ranks = list(range((rank // d) * d, (rank // d) * d + d))
            groups = [dist.new_group(list(range(s, s + d))) for s in range(0, world_size, d)]
            group = groups[ranks[0] // d]
            rows: list[tuple[int, float]] = []
            for tokens in token_counts:
                numel = max(d, (tokens // d) * bytes_per_token // 4 // d * d)
                send = torch.ones(numel, dtype=torch.float32, device=device)
                recv = torch.empty_like(send)
                times: list[float] = []
                for r in range(repeats + 1):
                    dist.barrier()
                    t0 = time.perf_counter()
                    dist.all_to_all_single(recv, send, group=group)
                    if device.type == "cuda":
                        torch.cuda.synchronize(device)
                    if r:
                        times.append((time.perf_counter() - t0) * 1e3)
                rows.append((int(tokens), float(np.median(times))))
            results[d] = rows
        d *= 2
    return results
