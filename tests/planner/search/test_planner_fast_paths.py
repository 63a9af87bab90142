"""The planner's fast paths for huge batches give what the plain walks give, to the bit.

At 16,384 GPUs (131k sequences) the group builder places most of a longest-first walk's tail
in bulk (``greedy._catch_up``), stops comparing sizes once no larger one can cost less
(``Instance.no_cheaper_larger_bits``), and the whole-batch passes (orders, floors, group sums)
run in numpy (``Instance.*_np``). Each test runs the plain version (the catch-up and the early
stop switched off, or the obvious Python expression) on the same instances and compares: the
builder's groups exactly, the sums to rounding.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from megatron_hsp.planner.cost.costmodel import flexsp_cost_model, load_cost_model
from megatron_hsp.planner.groupspace import planning_sizes
from megatron_hsp.planner.search import greedy
from megatron_hsp.planner.search.instance import Instance, resolve_sizes
from megatron_hsp.planner.topology import Cluster


def _instances(seed: int, count: int):
    for inst, _cost in _priced_instances(seed, count):
        yield inst


def _priced_instances(seed: int, count: int):
    """Random batches on both cost-model families: rank-ms growing with size (first fit) and
    not (the builder compares sizes by cost), with many equal lengths (ties in load)."""
    rng = np.random.default_rng(seed)
    for _ in range(count):
        gpus = int(rng.choice([16, 64, 256, 1024]))
        family = rng.random()
        if family < 0.4:
            spec = {"preset": "llama3-8b-h100", "training": {"zero_stage": 3}}
            cost = load_cost_model(spec, world_size=gpus)  # ZeRO-3: long sequences fit
        elif family < 0.7:
            cost = flexsp_cost_model("flexsp-gpt-7b", gpus, 192)
        else:  # FlexSP's own pricing (pure Ulysses): rank-ms grows with size, first fit
            cost = flexsp_cost_model("flexsp-gpt-7b", gpus, 192, as_published=True)
        cluster = Cluster(gpus, 8)
        sizes = planning_sizes(resolve_sizes(cost, cluster, None), 8)
        n = int(rng.integers(100, 8 * gpus + 1))
        kind = int(rng.integers(3))
        if kind == 0:
            lengths = rng.lognormal(7, 1.5, n)
        elif kind == 1:
            lengths = np.where(
                rng.random(n) < 0.9, rng.integers(1, 2000, n), rng.integers(10_000, 150_000, n)
            )
        else:
            lengths = rng.choice([100, 500, 1000, 4096], n)
        lengths = np.clip(lengths.astype(int), 1, cost.max_trainable_length(sizes))
        yield Instance.build(lengths.tolist(), cost, cluster, sizes), cost


@pytest.mark.parametrize("seed", [0, 1])
def test_bulk_catch_up_builds_the_groups_the_walk_builds(monkeypatch, seed):
    """Targets from the floor (fails) to none at all, minimum sizes 1, 2, 3 (the calibrated
    model prices size 4 below 3 for some lengths: a larger open size wins on cost) and 8."""
    modes, bulk_used = set(), 0
    for inst in _instances(seed, 12):
        modes.add(inst.work_grows_with_size)
        ids = inst.longest_first()
        floor = inst.microbatch_floor(ids)
        for factor in (1.0, 1.02, 1.1, 1.5, math.inf):
            for min_size in (1, 2, 3, 8):
                target = floor * factor
                calls = []
                real = greedy._catch_up
                monkeypatch.setattr(
                    greedy,
                    "_catch_up",
                    lambda *a, real=real, calls=calls: calls.append(1) or real(*a),
                )
                fast = greedy.build_groups(inst, ids, target, min_size=min_size)
                monkeypatch.setattr(greedy, "CATCH_UP_MIN", 10**9)  # the walk alone,
                bits = inst.no_cheaper_larger_bits  # comparing every open size (no early stop)
                inst.__dict__["no_cheaper_larger_bits"] = [0] * len(bits)
                plain = greedy.build_groups(inst, ids, target, min_size=min_size)
                inst.__dict__["no_cheaper_larger_bits"] = bits
                monkeypatch.undo()
                assert fast == plain, (len(inst.lengths), inst.world_size, factor, min_size)
                bulk_used += len(calls)
    assert modes == {True, False}  # both of the builder's size rules were compared
    assert bulk_used > 50  # the bulk path really ran (it is not skipped everywhere)


def test_whole_batch_passes_equal_their_python_forms():
    widths = set()
    for inst in _instances(2, 6):
        widths.add(len(inst.sizes) > 62)
        n = len(inst.lengths)
        rng = np.random.default_rng(n)
        for ids in (None, rng.choice(n, size=min(n, 300), replace=False).tolist()):
            walk = range(n) if ids is None else ids
            assert inst.longest_first(ids) == sorted(walk, key=lambda i: (-inst.lengths[i], i))
        some = rng.choice(n, size=min(n, 400), replace=False).tolist()
        floor = max(
            sum(inst.work_min[i] for i in some) / inst.world_size + inst.min_fixed,
            max(inst.best[i] for i in some),
        )
        assert inst.microbatch_floor(some) == pytest.approx(floor, rel=1e-12)
        # One micro-batch's worth: half the cluster's memory, shortest sequences first.
        order = inst.longest_first()[::-1]
        room = np.cumsum([inst.lengths[i] for i in order]) <= inst.world_size * inst.cap / 2
        order = inst.longest_first(order[: int(room.sum())])
        floor = inst.microbatch_floor(order)
        groups = next(
            g for f in (1.1, 2, 4, 8, 64) if (g := greedy.build_groups(inst, order, floor * f))
        )
        index = {d: j for j, d in enumerate(inst.sizes)}
        expect = [
            (d, sum(inst.times[i][index[d]] for i in ids) + inst.fixed[index[d]])
            for d, ids in groups
        ]
        got = greedy.group_times(inst, groups)
        assert [d for d, _ in got] == [d for d, _ in expect]
        # Python's sum() compensates rounding (3.12), bincount adds plainly: ulps apart.
        assert [ms for _, ms in got] == pytest.approx([ms for _, ms in expect], rel=1e-12)
        work = np.asarray(inst.times) * np.asarray(inst.sizes)[None, :]
        bits = inst.no_cheaper_larger_bits  # one int per sequence (wider than 62 at 1024 GPUs)
        for j in range(len(inst.sizes)):
            larger = work[:, j + 1 :].min(axis=1) if j + 1 < len(inst.sizes) else np.inf
            assert np.array_equal(inst.no_cheaper_larger_np[:, j], work[:, j] <= larger)
            assert [b >> j & 1 for b in bits] == inst.no_cheaper_larger_np[:, j].tolist()
    assert widths >= {True, False}  # both ways of packing the bits were compared


def test_single_ranks_take_the_free_ranks_first_fit_gives_them():
    """``first_fit_starts`` places trailing single-rank groups in one pass; the per-group walk (the
    bulk branch switched off by a size list it does not recognise) gives the same starts."""
    rng = np.random.default_rng(3)
    for world in (16, 64, 1024):
        cluster = Cluster(world, 8)
        for _ in range(20):
            used = bytearray((rng.random(world) < rng.random() * 0.5).astype(np.uint8).tobytes())
            big = sorted(rng.choice([2, 4, 8, 16], size=int(rng.integers(0, 4))), reverse=True)
            ones = int(rng.integers(0, world))
            sizes = [int(d) for d in big] + [1] * ones
            fast_used, walk_used = bytearray(used), bytearray(used)
            fast = greedy.first_fit_starts(sizes, cluster, world, fast_used)

            class Walk(list):  # ``max(sizes[k:])`` is never 1: the walk places each one
                def __getitem__(self, k):
                    got = list.__getitem__(self, k)
                    return [*got, 2] if isinstance(k, slice) else got

            walk = greedy.first_fit_starts(Walk(sizes), cluster, world, walk_used)
            assert fast == walk
            if fast is not None:
                assert fast_used == walk_used


def test_tables_built_per_distinct_length_equal_each_sequence_priced_alone():
    """``Instance.build`` prices each distinct length once and shares the rows; every number
    must be what pricing that sequence on its own gives (many repeated lengths included)."""
    for inst, cost in _priced_instances(3, 4):
        cost_sizes = inst.sizes
        n = len(inst.lengths)
        rng = np.random.default_rng(n)
        assert len(set(inst.lengths)) < n  # rows are shared
        for i in rng.choice(n, size=min(n, 200), replace=False).tolist():
            ln = inst.lengths[i]
            alone = [float(cost.seq_ms([ln], d)[0]) for d in cost_sizes]
            assert inst.times[i] == pytest.approx(alone, rel=1e-12)
            fit = [j for j, d in enumerate(cost_sizes) if ln <= cost.capacity(d)]
            assert inst.dmin[i] == fit[0]
            assert inst.work_min[i] == pytest.approx(
                min(alone[j] * cost_sizes[j] for j in fit), rel=1e-12
            )
            assert inst.best[i] == pytest.approx(
                min(alone[j] + inst.fixed[j] for j in fit), rel=1e-12
            )
        assert np.array_equal(inst.times_np, np.asarray(inst.times))


@pytest.mark.parametrize("hint", [None, 1.0005, 1.03, 1.2])
def test_large_microbatch_bracket_ends_within_tolerance_of_a_failed_target(monkeypatch, hint):
    """Micro-batches of thousands of sequences start their bracket at ``1 + rel_tol`` or at a
    hint (the previous chunk's ratio) and step down from a met hint; whatever the path, the
    answer is a met target within ``rel_tol`` of one the builder failed (or of the floor)."""
    cost = load_cost_model("llama3-8b-h100", world_size=256)
    cluster = Cluster(256, 8)
    sizes = planning_sizes(resolve_sizes(cost, cluster, None), 8)
    rng = np.random.default_rng(7)
    lengths = np.clip(rng.lognormal(6.0, 1.2, 6000).astype(int), 1, 60_000)
    lengths = lengths[np.cumsum(lengths) <= 0.6 * 256 * cost.tokens_per_rank]  # one micro-batch
    assert len(lengths) > 1024
    inst = Instance.build(lengths.tolist(), cost, cluster, sizes)
    ids = inst.longest_first()
    floor = inst.microbatch_floor(ids)
    tried: list[tuple[float, bool]] = []
    build = greedy.build_groups

    def traced(inst, seq_ids, target, ranks=None, min_size=1, same=None):
        got = build(inst, seq_ids, target, ranks=ranks, min_size=min_size)
        tried.append((target, got is not None))
        if same is not None:  # a build per target, each traced (intervals: the tests below)
            same[:] = [target, target]
        return got

    monkeypatch.setattr(greedy, "build_groups", traced)
    hi, groups = greedy.schedule_microbatch(inst, ids, cluster, hint=hint)
    assert hi == pytest.approx(greedy.groups_makespan(inst, groups))
    assert any(ok and t >= hi * (1 - 1e-12) for t, ok in tried)  # a met target gave it
    failed = [t for t, ok in tried if not ok and math.isfinite(t)]
    assert max([floor, *failed]) >= hi * (1 - 1e-2) - 1e-9  # bracket within rel_tol (1%)
    assert floor < tried[0][0]  # the floor itself is not tried above 1024 sequences
    if hint is not None and hint > 1.01:
        assert tried[0][0] == pytest.approx(floor * hint)


def _sub_batches(inst: Instance, rng: np.random.Generator):
    """Micro-batch-sized pieces of a batch (longest first) and the whole of it."""
    n = len(inst.lengths)
    for size in (2, 3, 8, 40, 300):
        if size < n:
            yield inst.longest_first(rng.choice(n, size=size, replace=False).tolist())
    yield inst.longest_first()


@pytest.mark.parametrize("seed", [3, 4])
def test_a_build_gives_its_result_on_every_target_of_its_interval(seed):
    """``build_groups(..., same=)``: every target in the interval it reports builds the same
    groups (or fails alike); near its ends too, where a missed threshold would show."""
    rng = np.random.default_rng(seed)
    builds = widened = 0
    for inst in _instances(seed, 8):
        for ids in _sub_batches(inst, rng):
            floor = inst.microbatch_floor(ids)
            for factor in (1.0, 1.01, 1.05, 1.2, 2.0):
                for min_size in (1, 2, 8):
                    target = floor * factor
                    same: list[float] = []
                    got = greedy.build_groups(inst, ids, target, min_size=min_size, same=same)
                    lo, hi = same
                    assert lo <= target <= hi
                    builds += 1
                    widened += lo < target or hi > target
                    finite_lo = lo if math.isfinite(lo) else target / 2
                    finite_hi = hi if math.isfinite(hi) else target * 2
                    probes = {finite_lo, finite_hi, (finite_lo + target) / 2}
                    probes |= {(target + finite_hi) / 2, *rng.uniform(finite_lo, finite_hi, 4)}
                    for probe in probes:
                        again = greedy.build_groups(inst, ids, probe, min_size=min_size)
                        assert again == got, (len(ids), target, probe, lo, hi)
    assert builds > 300 and widened > builds // 2  # intervals are mostly wider than a point


def test_schedules_equal_those_built_without_intervals(monkeypatch):
    """``schedule_microbatch`` answers a bisection's targets from the intervals of earlier
    builds; with every interval cut to its own target (a build per target) the schedules are
    the same, to the bit."""
    rng = np.random.default_rng(5)
    real = greedy.build_groups
    cases = []
    for inst in _instances(5, 6):
        cluster = Cluster(inst.world_size, inst.gpus_per_node)
        for ids in _sub_batches(inst, rng):
            cases.append((inst, cluster, ids))
    fast = []
    for inst, cluster, ids in cases:
        inst.memo.clear()
        fast.append(greedy.schedule_microbatch(inst, ids, cluster))

    def point(inst, seq_ids, target, ranks=None, min_size=1, same=None):
        got = real(inst, seq_ids, target, ranks, min_size)
        if same is not None:
            same[:] = [target, target]
        return got

    monkeypatch.setattr(greedy, "build_groups", point)
    for (inst, cluster, ids), expect in zip(cases, fast, strict=True):
        inst.memo.clear()
        got = greedy.schedule_microbatch(inst, ids, cluster)
        assert got == expect
        if got is not None:
            assert got[0].hex() == expect[0].hex()


def _fill_short_by_scan(inst, chunks, crit, room, work, free, order, *, per_rank_key):
    """``chunking._fill_short`` as a scan of every micro-batch per sequence (its rule as
    written: least growth, then least work, then the lowest index)."""
    n, cap, base = inst.world_size, inst.cap, inst.min_fixed

    def makespan(c):
        return max(crit[c], base + work[c] / free[c]) if free[c] > 0 else math.inf

    before = [makespan(c) for c in range(len(chunks))]
    for i in order:
        ln, w, own = inst.lengths[i], inst.work_min[i], inst.best[i]
        chosen, best_key = -1, (math.inf, math.inf)
        for c in range(len(chunks)):
            f = free[c]
            if room[c] < ln or f <= 0:
                continue
            after = max(crit[c], own, base + (work[c] + w) / f)
            key = (after - before[c], work[c] / f if per_rank_key else work[c])
            if key < best_key:
                chosen, best_key = c, key
        if chosen < 0:
            chunks.append([])
            free.append(n)
            room.append(float(n * cap))
            crit.append(0.0)
            work.append(0.0)
            before.append(0.0)
            chosen = len(chunks) - 1
        chunks[chosen].append(i)
        room[chosen] -= ln
        work[chosen] += w
        crit[chosen] = max(crit[chosen], own)
        before[chosen] = makespan(chosen)


@pytest.mark.parametrize("per_rank_key", [False, True])
def test_fill_short_walk_in_key_order_equals_the_scan(per_rank_key):
    """``_fill_short`` walks micro-batches by their second key and stops at the first that
    does not grow; the scan of every one chooses the same, to the micro-batch."""
    from megatron_hsp.planner.search import chunking

    rng = np.random.default_rng(6)
    grew = 0
    for inst in _instances(6, 8):
        n = len(inst.lengths)
        for m in (1, 4, 30):
            state = {
                "chunks": [[] for _ in range(m)],
                "crit": rng.choice([0.0, 50.0, 400.0, 3000.0], m).tolist(),
                "room": (rng.uniform(0.0, 1.0, m) * inst.world_size * inst.cap).tolist(),
                "work": rng.choice([0.0, 10.0, 1000.0], m).tolist(),
                "free": rng.choice([0, 8, inst.world_size], m).tolist(),
            }
            order = inst.longest_first(rng.choice(n, size=min(n, 500), replace=False).tolist())
            a = {k: [list(x) for x in v] if k == "chunks" else list(v) for k, v in state.items()}
            b = {k: [list(x) for x in v] if k == "chunks" else list(v) for k, v in state.items()}
            chunking._fill_short(inst, **a, order=order, per_rank_key=per_rank_key)
            _fill_short_by_scan(inst, **b, order=order, per_rank_key=per_rank_key)
            assert a == b
            grew += len(a["chunks"]) > m
    assert grew > 0  # some walks opened micro-batches of short sequences
