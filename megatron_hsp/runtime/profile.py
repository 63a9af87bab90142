"""Measurements for ``megatron-hsp profile`` on whatever backend this process runs (gloo/CPU or
NCCL/GPU): forward+backward time of a megatron-core ``GPTModel`` on packed (THD) batches (every
rank at once, as training runs them), activation bytes per token, all-to-all and ring (p2p) step
time per group size and message size, and the per-step costs (gradient all-reduce, optimizer).

Only measurement lives here; fitting is ``megatron_hsp.planner.cost.fit`` (pure), the command is
``megatron_hsp.commands.profile``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
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


def _device() -> torch.device:
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def own_group() -> dist.ProcessGroup:
    """This rank's one-rank group (the "cp group" of plain local attention); every rank creates
    every one-rank group, as ``new_group`` requires."""
    groups = [dist.new_group([r]) for r in range(dist.get_world_size())]
    return groups[dist.get_rank()]


def _max_over_ranks(x: float, device: torch.device) -> float:
    t = torch.tensor([x], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t[0])


def measure_compute_concurrent(
    model: torch.nn.Module,
    batches: Sequence[Sequence[int]],
    *,
    vocab: int,
    group: dist.ProcessGroup,
    device: torch.device,
    repeats: int,
    warmup: int = 2,
    progress: Callable[[int, int], None] | None = None,
) -> list[ComputeSample]:
    """Median over ``repeats`` of the slowest rank's forward+backward ms on each packed batch.

    Why every rank at once: training runs one model replica per rank, and on a small or shared
    machine the ranks compete for cores and memory bandwidth, so a batch timed alone is faster
    than the same batch inside a step. Why round-robin (all batches once per repeat, after
    ``warmup`` untimed rounds): load from other processes drifts over minutes, and spreading each
    point's repeats over the whole run keeps that drift out of the fitted slope. Every rank of
    the default group must call this with the same batches; ``group`` is ``own_group()``.
    """
    inputs = [_packed_inputs(b, vocab, group, device) for b in batches]
    times: list[list[float]] = [[] for _ in batches]
    rounds = warmup + repeats
    for r in range(rounds):
        for i, inp in enumerate(inputs):
            model.zero_grad(set_to_none=True)
            dist.barrier()
            _sync(device)
            t0 = time.perf_counter()
            model(**inp).sum().backward()
            _sync(device)
            ms = _max_over_ranks((time.perf_counter() - t0) * 1e3, device)
            if r >= warmup:
                times[i].append(ms)
        if progress:
            progress(r + 1, rounds)
    return [
        ComputeSample(tuple(int(x) for x in b), float(np.median(t)))
        for b, t in zip(batches, times, strict=True)
    ]


def measure_activation_bytes(
    model: torch.nn.Module,
    lengths: Sequence[int],
    *,
    vocab: int,
    group: dist.ProcessGroup,
    device: torch.device,
) -> float:
    """Bytes autograd keeps for the backward of one forward on a packed batch of ``lengths``.

    On CUDA this is the peak allocated memory above the pre-forward level
    (``torch.cuda.max_memory_allocated``). On the CPU there is no allocator counter, so the
    tensors autograd saves for backward are counted through ``saved_tensors_hooks`` (each
    storage once): that is the activation memory a training step holds at its peak, without
    allocator slack or temporaries, so a CPU figure is a lower bound of the GPU one.
    """
    inp = _packed_inputs(lengths, vocab, group, device)
    model.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        out = model(**inp).sum()
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - base
        out.backward()
        return float(peak)
    seen: set[int] = set()
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(**inp).sum()
    out.backward()
    return float(total)


def measure_step_overhead(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, device: torch.device, repeats: int
) -> float:
    """Median ms of what a step adds once after its micro-batches: the gradient all-reduce over
    every rank and the optimizer step (the slowest rank's time)."""
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    flat = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    times = []
    for r in range(repeats + 1):
        dist.barrier()
        _sync(device)
        t0 = time.perf_counter()
        dist.all_reduce(flat)
        optimizer.step()
        _sync(device)
        ms = _max_over_ranks((time.perf_counter() - t0) * 1e3, device)
        if r:
            times.append(ms)
    model.zero_grad(set_to_none=True)
    return float(np.median(times))


def _time_op(op: Callable[[], None], device: torch.device, repeats: int, warmup: int) -> float:
    """Median over ``repeats`` of the slowest rank's ms for ``op`` (a collective every rank
    runs), after ``warmup`` untimed calls: the first calls on a new group set up connections and
    buffers and take several times longer than the rest."""
    times: list[float] = []
    for r in range(warmup + repeats):
        dist.barrier()
        _sync(device)
        t0 = time.perf_counter()
        op()
        _sync(device)
        ms = _max_over_ranks((time.perf_counter() - t0) * 1e3, device)
        if r >= warmup:
            times.append(ms)
    return float(np.median(times))


def _group_sizes(world_size: int) -> list[int]:
    return [d for d in (2**k for k in range(1, world_size.bit_length())) if world_size % d == 0]


def measure_all_to_all(
    rank: int,
    world_size: int,
    token_counts: Sequence[int],
    bytes_per_token: int,
    repeats: int,
    warmup: int = 3,
) -> dict[int, list[tuple[int, float]]]:
    """For each group size d dividing the world (d > 1): (tokens, median ms) of an all-to-all.

    Every rank must call it (all groups of a size run at once, as in a step; the slowest rank's
    time counts). The message is what Ulysses moves per call for ``tokens`` tokens of the group:
    ``tokens / d`` tokens of ``bytes_per_token`` bytes on each rank, split evenly over the group.
    """
    device = _device()
    results: dict[int, list[tuple[int, float]]] = {}
    for d in _group_sizes(world_size):
        groups = [dist.new_group(list(range(s, s + d))) for s in range(0, world_size, d)]
        group = groups[rank // d]
        rows: list[tuple[int, float]] = []
        for tokens in token_counts:
            numel = max(d, (tokens // d) * bytes_per_token // 4 // d * d)
            send = torch.ones(numel, dtype=torch.float32, device=device)
            recv = torch.empty_like(send)
            op = partial(dist.all_to_all_single, recv, send, group=group)
            rows.append((int(tokens), _time_op(op, device, repeats, warmup)))
        results[d] = rows
    return results


def _ring_exchange(send: torch.Tensor, recv: torch.Tensor, nxt: int, prv: int) -> None:
    ops = [dist.P2POp(dist.isend, send, nxt), dist.P2POp(dist.irecv, recv, prv)]
    for req in dist.batch_isend_irecv(ops):
        req.wait()


def measure_ring_step(
    rank: int,
    world_size: int,
    token_counts: Sequence[int],
    bytes_per_token: int,
    repeats: int,
    warmup: int = 3,
) -> dict[int, list[tuple[int, float]]]:
    """For each group size d dividing the world (d > 1): (tokens, median ms) of one ring step.

    One ring step of ring attention: every rank of a ring of ``d`` sends its block (``tokens /
    d`` tokens of ``bytes_per_token`` bytes) to the next rank and receives the previous rank's
    (``isend``/``irecv``, all rings at once, slowest rank's time). Every rank must call it.
    """
    device = _device()
    results: dict[int, list[tuple[int, float]]] = {}
    for d in _group_sizes(world_size):
        start = (rank // d) * d
        nxt = start + (rank - start + 1) % d
        prv = start + (rank - start - 1) % d
        rows: list[tuple[int, float]] = []
        for tokens in token_counts:
            numel = max(1, (tokens // d) * bytes_per_token // 4)
            send = torch.ones(numel, dtype=torch.float32, device=device)
            recv = torch.empty_like(send)
            op = partial(_ring_exchange, send, recv, nxt, prv)
            rows.append((int(tokens), _time_op(op, device, repeats, warmup)))
        results[d] = rows
    return results


@dataclass(frozen=True)
class GroupStepSample:
    """One timed training micro-batch in which every group of ``size`` ranks trains ``lengths``."""

    size: int
    lengths: tuple[int, ...]
    ms: float


def measure_group_steps(
    model: torch.nn.Module,
    registry: Any,
    batches: Sequence[Sequence[int]],
    *,
    vocab: int,
    device: torch.device,
    repeats: int,
    warmup: int = 1,
    progress: Callable[[int, int], None] | None = None,
) -> list[GroupStepSample]:
    """Median ms of ``run_step`` on one micro-batch where every group of each registry size d
    (pure Ulysses, contiguous blocks) trains its own copy of each batch.

    Why, next to the all-to-all microbenchmark: a Ulysses group costs more than its compute share
    plus the bare collective. Its ranks wait for each other four times per layer, and on a
    machine with fewer cores than ranks a waiting rank's core goes to a peer only at the next
    scheduler tick; there are permutes around every call too. The microbenchmark sees none of
    that (on this 2-core machine 11-20 ms against 20-50 ms in situ). Timing the step itself, size 1
    included as the no-communication baseline, measures the whole per-size overhead where it
    arises. Every rank must call this with the same arguments; round-robin over the batches, as
    in ``measure_compute_concurrent``.
    """
    from megatron_hsp.planner.plan import Group, MicroBatch, Plan
    from megatron_hsp.runtime.dispatch import GlobalBatch
    from megatron_hsp.runtime.schedule import run_step

    world = dist.get_world_size()
    cases: list[tuple[int, tuple[int, ...], Plan, GlobalBatch]] = []
    for d in registry.sizes:
        if world % d:
            continue
        for lengths in batches:
            seqs = [int(n) for _ in range(world // d) for n in lengths]
            k = len(lengths)
            groups = tuple(
                Group(
                    ranks=tuple(range(g * d, (g + 1) * d)),
                    seq_ids=tuple(range(g * k, (g + 1) * k)),
                    lengths=tuple(int(n) for n in lengths),
                    ulysses=d,
                    ring=1,
                )
                for g in range(world // d)
            )
            plan = Plan(
                world_size=world,
                gpus_per_node=registry.cluster.gpus_per_node,
                microbatches=(MicroBatch(groups=groups),),
                cost_model="profile",
                solver="profile",
                status="heuristic",
            ).validate(lengths=seqs, world_size=world)
            rng = np.random.default_rng(sum(seqs))
            docs = GlobalBatch.from_documents([rng.integers(0, vocab, n) for n in seqs])
            cases.append((d, tuple(int(n) for n in lengths), plan, docs))
    times: list[list[float]] = [[] for _ in cases]
    for r in range(warmup + repeats):
        for i, (_, _, plan, docs) in enumerate(cases):
            dist.barrier()
            _sync(device)
            t0 = time.perf_counter()
            run_step(model, plan, docs, registry, grad_group=None, device=device)
            _sync(device)
            ms = _max_over_ranks((time.perf_counter() - t0) * 1e3, device)
            if r >= warmup:
                times[i].append(ms)
        if progress:
            progress(r + 1, warmup + repeats)
    model.zero_grad(set_to_none=True)
    return [
        GroupStepSample(d, lengths, float(np.median(t)))
        for (d, lengths, _, _), t in zip(cases, times, strict=True)
    ]
