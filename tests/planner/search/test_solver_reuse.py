"""Work ``solve`` reuses instead of redoing gives what redoing gives, to the bit.

A solve asks for the same micro-batch schedule and the same tiling check many times
(``Instance.memo``); the chunkings and FlexSP's best-fit packing keep sorted state instead of
scanning every bin per sequence. Each test either counts the work a second request does (none)
or runs a plain version of the rule, written here, on random inputs and compares exactly.
"""

from __future__ import annotations

import numpy as np
import pytest

from megatron_hsp.planner.cost.costmodel import load_cost_model
from megatron_hsp.planner.groupspace import planning_sizes
from megatron_hsp.planner.search import chunking, greedy
from megatron_hsp.planner.search.homogeneous import _best_fit_decreasing
from megatron_hsp.planner.search.instance import Instance, resolve_sizes
from megatron_hsp.planner.topology import Cluster


def _instance(seed: int, gpus: int = 64, n: int = 300) -> Instance:
    """A batch of short and long sequences on ZeRO-1 Llama 3 8B (sizes 1-8 and whole nodes:
    not all powers of two, so placement is checked, not assumed)."""
    rng = np.random.default_rng(seed)
    cost = load_cost_model("llama3-8b-h100", world_size=gpus)
    cluster = Cluster(gpus, 8)
    sizes = planning_sizes(resolve_sizes(cost, cluster, None), 8)
    lengths = np.where(
        rng.random(n) < 0.8, rng.lognormal(7, 1.0, n), rng.uniform(20_000, 150_000, n)
    )
    lengths = np.clip(lengths.astype(int), 128, cost.max_trainable_length(sizes))
    return Instance.build(lengths.tolist(), cost, cluster, sizes)


def _count_calls(monkeypatch, name: str) -> list[int]:
    """``greedy.<name>`` counting its calls into the returned one-element list."""
    calls = [0]
    real = getattr(greedy, name)

    def counting(*args, **kwargs):
        calls[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(greedy, name, counting)
    return calls


def test_a_schedule_asked_again_builds_nothing_and_is_the_callers_own(monkeypatch):
    inst = _instance(0)
    cluster = Cluster(inst.world_size, inst.gpus_per_node)
    builds = _count_calls(monkeypatch, "build_groups")
    # Thirty short sequences and two long ones (multi-rank groups beside single ranks).
    ids = [i for i in range(300) if inst.lengths[i] <= inst.cap][:30]
    ids += [i for i in range(300) if inst.lengths[i] > inst.cap][:2]
    first = greedy.schedule_microbatch(inst, ids, cluster)
    assert first is not None and builds[0] > 0
    built = builds[0]
    first[1].clear()  # the caller's list: changing it changes nothing kept
    again = greedy.schedule_microbatch(inst, ids[::-1], cluster)  # any order: the same batch
    assert builds[0] == built
    assert again is not None and again[1]
    # Another limit is another question: it is worked out.
    limited = greedy.schedule_microbatch(inst, ids, cluster, limit=again[0] * 1.5)
    assert builds[0] > built and limited is not None
    # What was kept is what working it out again gives.
    fresh = greedy._schedule_sorted(
        inst, inst.longest_first(ids), inst.microbatch_floor(ids), cluster, 3e-3, None, None
    )
    assert fresh is not None and again == (fresh[0], fresh[1])


def test_a_tiling_check_is_placed_once_per_mix_of_sizes(monkeypatch):
    inst = _instance(1)
    assert not inst.buddy  # sizes 3, 5, 6, 7, 24, ... are legal: placement is searched
    cluster = Cluster(inst.world_size, inst.gpus_per_node)
    placed = _count_calls(monkeypatch, "_assign_starts")
    mix = [(24, (0,)), (24, (1,)), (8, (2,)), (3, (3,))]
    assert greedy.groups_fit(inst, mix, cluster)
    assert greedy.groups_fit(inst, mix[::-1], cluster)  # the same sizes in another order
    assert placed[0] == 1
    assert not greedy.groups_fit(inst, [(32, ()), (24, ()), (16, ())], cluster)  # 72 > 64
    assert greedy.groups_fit(inst, [(32, (0,)), (24, (1,))], cluster)  # needs the search
    assert not greedy.groups_fit(inst, [(40, (0,)), (24, (1,))], cluster)  # 64, no tiling
    assert not greedy.groups_fit(inst, [(24, (0,)), (40, (1,))], cluster)
    assert placed[0] == 3


def _plain_best_fit(lengths: list[int], capacity: float) -> list[list[int]] | None:
    """Best fit decreasing, every bin scanned: the one whose room after the sequence is least."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    rooms: list[float] = []
    bins: list[list[int]] = []
    for i in order:
        s = float(lengths[i])
        if s > capacity:
            return None
        best = min(
            (b for b in range(len(bins)) if rooms[b] - s >= 0), key=lambda b: (rooms[b] - s, b),
            default=-1,
        )  # fmt: skip
        if best < 0:
            rooms.append(capacity - s)
            bins.append([i])
        else:
            rooms[best] -= s
            bins[best].append(i)
    return bins


@pytest.mark.parametrize("seed", range(6))
def test_best_fit_by_bisection_packs_as_a_scan_of_every_bin(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 600))
    # Many equal lengths (ties between bins) and capacities with a fractional part (FlexSP's
    # 90% fill of the token capacity).
    lengths = rng.choice([128, 512, 1000, 4096, 8192], n) if seed % 2 else rng.lognormal(8, 1, n)
    lengths = np.maximum(lengths.astype(np.int64), 1)
    capacity = max(float(lengths.max()), float(rng.uniform(0.5, 6.0)) * 32_768 * 0.9)
    assert _best_fit_decreasing(lengths, capacity) == _plain_best_fit(lengths.tolist(), capacity)
    assert _best_fit_decreasing(lengths, float(lengths.max()) - 0.5) is None


def _plain_time_balanced(inst: Instance, m: int) -> list[list[int]]:
    room = inst.world_size * inst.cap
    loads, tokens = [0.0] * m, [0] * m
    out: list[list[int]] = [[] for _ in range(m)]
    for i in inst.longest_first():
        ln = inst.lengths[i]
        fits = [b for b in range(m) if tokens[b] + ln <= room]
        b = (
            min(fits, key=lambda b: (loads[b], b))
            if fits
            else min(range(m), key=tokens.__getitem__)
        )
        tokens[b] += ln
        loads[b] += inst.work_min[i]
        out[b].append(i)
    return [c for c in out if c]


class _SearchsortedBisect:
    """``bisect`` as ``chunk_contiguous`` used it before: ``numpy.searchsorted`` on an array."""

    @staticmethod
    def bisect_right(values: list[float], x: float) -> int:
        return int(np.searchsorted(np.asarray(values), x, side="right"))


@pytest.mark.parametrize("seed", range(3))
def test_chunkings_equal_their_plain_forms_at_every_count(monkeypatch, seed):
    n = int(np.random.default_rng(seed).integers(50, 700))
    inst = _instance(seed, n=n)
    low = chunking.min_microbatches(inst)
    counts = range(low, low + 12)
    for m in counts:
        assert chunking.chunk_time_balanced(inst, m) == _plain_time_balanced(inst, m)
    contiguous = [chunking.chunk_contiguous(inst, m) for m in counts]
    # Run ends found by bisect on the prefix sums as Python floats are searchsorted's on the
    # float64 array, and the order and sums kept per instance are those of a fresh one.
    monkeypatch.setattr(chunking, "bisect", _SearchsortedBisect)
    fresh = _instance(seed, n=n)  # nothing kept yet
    assert [chunking.chunk_contiguous(fresh, m) for m in counts] == contiguous
