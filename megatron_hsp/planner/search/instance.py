"""The planning problem in the form the heuristics and the MILP read: checked, tabulated.

Input checks live here so that ``solve`` and ``lower_bound_ms`` reject the same inputs with the
same messages. ``Instance`` holds per-(sequence, size) times as plain lists built once per batch:
numpy scalar access in the heuristics' inner loops would cost more than their arithmetic. The
whole-batch passes (orders, floors, group sums over thousands of sequences) read numpy copies of
the same numbers instead (``*_np``, built on first use): at 16,384 GPUs (131k sequences) their
Python loops took seconds of a solve that must beat a 2-3 s step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from megatron_hsp.planner.cost.costmodel import CostModel
from megatron_hsp.planner.errors import InfeasibleError, InputError
from megatron_hsp.planner.topology import Cluster

# Sequence counts from which the whole-batch passes switch from Python to numpy (below it the
# array conversion costs more than the loop).
VECTOR_MIN = 256

# A scheduled micro-batch before rank placement: (group size, sequence indices) pairs.
GroupSpec = tuple[int, tuple[int, ...]]


def resolve_sizes(cost: CostModel, cluster: Cluster, sizes: Sequence[int] | None) -> list[int]:
    """Allowed group sizes: those that tile the cluster and that the cost model can cost."""
    costed = [d for d in cost.sizes if cluster.size_fits(d)]
    if sizes is None:
        if not costed:
            raise InputError(
                f"cost model {cost.name!r} has no group size that tiles {cluster.world_size} "
                f"ranks in nodes of {cluster.gpus_per_node}; its sizes: {cost.sizes}"
            )
        return costed
    wanted = sorted({int(d) for d in sizes})
    bad = [d for d in wanted if d not in costed]
    if not wanted or bad:
        raise InputError(
            f"group sizes {bad or wanted} cannot be used on {cluster.world_size} ranks in nodes "
            f"of {cluster.gpus_per_node} with cost model {cost.name!r}; legal sizes: {costed}"
        )
    return wanted


def check_lengths(lengths: Sequence[int], cost: CostModel, sizes: Sequence[int]) -> list[int]:
    """Lengths as ints; empty batches, non-positive and untrainable lengths raise."""
    out = [int(x) for x in lengths]
    if not out:
        raise InputError("the global batch is empty; pass at least one sequence length")
    for i, x in enumerate(out):
        if x <= 0:
            raise InputError(f"sequence {i} has length {x}; lengths must be positive integers")
    longest = cost.max_trainable_length(sizes)
    for i, x in enumerate(out):
        if x > longest:
            raise InfeasibleError(
                f"sequence {i} has length {x}, longer than the longest trainable length "
                f"{longest} (a group of {max(sizes)} ranks under this memory cap); split or drop "
                "it, raise the memory cap, or allow larger groups"
            )
    return out


@dataclass
class Instance:
    """One global batch with every per-(sequence, size) number the heuristics need."""

    lengths: list[int]
    sizes: list[int]  # allowed group sizes, ascending
    world_size: int
    gpus_per_node: int
    cap: int  # tokens per rank
    times: list[list[float]]  # times[i][j]: ms of sequence i in a group of sizes[j], no fixed cost
    fixed: list[float]  # fixed ms per group of sizes[j]
    dmin: list[int]  # index into sizes of the smallest group that holds sequence i
    work_min: list[float]  # min over fitting sizes of d * time: rank-ms a sequence must cost
    best: list[float]  # min over fitting sizes of time + fixed: a sequence's own critical path
    times_per_token_floor: list[float]  # min over lengths >= 1 of time(s, size j) / s
    work_grows_with_size: bool  # d * time(s, d) is non-decreasing in d for every s
    buddy: bool  # all sizes are powers of two dividing the world size: any mix that fits tiles
    # A group may run several passes between barriers (``cost/execution.py``: not
    # ``CostModel.pass_barrier``); the bounds then reason per pass and group, not per micro-batch.
    multi_pass: bool = True
    # Results of pure functions of this instance (``greedy.schedule_microbatch``, placement
    # checks), keyed by their inputs: a solve asks for the same micro-batch again and again
    # (counts that share chunks, local search, the MILP's incumbents). Never part of equality.
    memo: dict[object, object] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def build(
        cls, lengths: Sequence[int], cost: CostModel, cluster: Cluster, sizes: Sequence[int]
    ) -> Instance:
        sizes = sorted(sizes)
        arr = np.asarray(lengths, dtype=np.int64)
        # Every per-size number depends on the length alone, so the table is built once per
        # distinct length and its rows shared (a 16,384-GPU batch has far fewer distinct
        # lengths than sequences; the full n x |sizes| table and its list copy took most of the
        # solve). ``times[i]`` rows are read-only everywhere.
        uniq, inverse = np.unique(arr, return_inverse=True)
        table = np.stack([cost.seq_ms(uniq, d) for d in sizes], axis=1)  # distinct x |sizes|
        caps = np.asarray([cost.capacity(d) for d in sizes], dtype=np.int64)
        fits = uniq[:, None] <= caps[None, :]
        dmin = np.argmax(fits, axis=1)  # caller guarantees every sequence fits the largest size
        work = np.where(fits, table * np.asarray(sizes, dtype=np.float64)[None, :], np.inf)
        fixed = [float(cost.fixed_ms(d)) for d in sizes]
        best = np.where(fits, table + np.asarray(fixed)[None, :], np.inf).min(axis=1)
        rows = table.tolist()
        at = inverse.tolist()
        inst = cls(
            lengths=arr.tolist(),
            sizes=list(sizes),
            world_size=cluster.world_size,
            gpus_per_node=cluster.gpus_per_node,
            cap=int(cost.tokens_per_rank),
            times=[rows[k] for k in at],
            fixed=fixed,
            dmin=dmin[inverse].tolist(),
            work_min=work.min(axis=1)[inverse].tolist(),
            best=best[inverse].tolist(),
            times_per_token_floor=[float(cost.seq_ms([1], d)[0]) for d in sizes],
            work_grows_with_size=_grows(work),
            # Buddy offsets are multiples of each size; inside a node that is a legal block only
            # when the size divides the node (4 in nodes of 6 would straddle them).
            buddy=all(
                d & (d - 1) == 0
                and cluster.world_size % d == 0
                and (d > cluster.node_width or cluster.node_width % d == 0)
                for d in sizes
            ),
            multi_pass=not cost.pass_barrier,
        )
        # The numpy copies the whole-batch passes read (cached_property slots), already at hand.
        inst.__dict__.update(lengths_np=arr, _distinct=(table, inverse))
        return inst

    @cached_property
    def lengths_np(self) -> np.ndarray:
        return np.asarray(self.lengths, dtype=np.int64)

    @cached_property
    def work_min_np(self) -> np.ndarray:
        return np.asarray(self.work_min, dtype=np.float64)

    @cached_property
    def best_np(self) -> np.ndarray:
        return np.asarray(self.best, dtype=np.float64)

    @cached_property
    def _distinct(self) -> tuple[np.ndarray, np.ndarray]:
        """(table per distinct row, row of each sequence): ``build`` sets it from the distinct
        lengths; an instance made field by field has one row per sequence."""
        table = np.asarray(self.times, dtype=np.float64).reshape(len(self.lengths), len(self.sizes))
        return table, np.arange(len(self.lengths))

    @cached_property
    def times_np(self) -> np.ndarray:
        """``times`` as an n x |sizes| array."""
        table, inverse = self._distinct
        return table[inverse]

    def times_at(self, ids: np.ndarray, cols: np.ndarray | int) -> np.ndarray:
        """``times[i][j]`` for index arrays (broadcast together), read from the distinct rows:
        the bulk passes need a few thousand entries, not the n x |sizes| array."""
        table, inverse = self._distinct
        return table[inverse[ids], cols]

    @cached_property
    def _no_cheaper_distinct(self) -> np.ndarray:
        return _no_cheaper_larger(self._distinct[0], self.sizes)

    @cached_property
    def no_cheaper_larger_np(self) -> np.ndarray:
        """n x |sizes|: no larger size costs sequence ``i`` fewer rank-ms than size ``j``."""
        return self._no_cheaper_distinct[self._distinct[1]]

    def no_cheaper_larger_at(self, ids: np.ndarray, j: int) -> np.ndarray:
        """``no_cheaper_larger_np[ids, j]`` without building the whole table."""
        return self._no_cheaper_distinct[self._distinct[1][ids], j]

    @cached_property
    def no_cheaper_larger_bits(self) -> list[int]:
        """``no_cheaper_larger_np`` per sequence as a bit mask (bit ``j``): what the group
        builder's inner loop reads (one int per sequence, not a row of booleans)."""
        inverse = self._distinct[1]
        mask = self._no_cheaper_distinct
        if mask.shape[1] > 62:
            # int64 holds 63 bits: Python ints from the packed rows (hundreds of legal sizes).
            packed = np.packbits(mask, axis=1, bitorder="little")
            bits = [int.from_bytes(row.tobytes(), "little") for row in packed]
        else:
            weights = np.left_shift(np.int64(1), np.arange(mask.shape[1], dtype=np.int64))
            bits = (mask.astype(np.int64) @ weights).tolist()
        return [bits[k] for k in inverse.tolist()]

    def longest_first(self, seq_ids: Sequence[int] | None = None) -> list[int]:
        """Sequence indices longest first, ties by index: the order every builder walks."""
        if seq_ids is None:
            ids = np.arange(len(self.lengths))
        elif len(seq_ids) < VECTOR_MIN:
            lengths = self.lengths
            return sorted(seq_ids, key=lambda i: (-lengths[i], i))
        else:
            ids = np.asarray(seq_ids, dtype=np.int64)
        return longest_first_ids(self.lengths_np, ids)

    @cached_property
    def size_tokens(self) -> list[int]:
        """Token capacity of a group of each size (``cap`` per rank); read per build."""
        return [self.cap * d for d in self.sizes]

    @property
    def min_fixed(self) -> float:
        return min(self.fixed)

    def best_time(self, i: int) -> float:
        """Shortest time sequence ``i`` can take in any fitting group, fixed cost included."""
        return self.best[i]

    def microbatch_floor(self, seq_ids: Sequence[int]) -> float:
        """No schedule of these sequences in one micro-batch finishes sooner (see bounds.py)."""
        if not seq_ids:
            return 0.0
        if len(seq_ids) >= VECTOR_MIN:
            ids = np.asarray(seq_ids, dtype=np.int64)
            work = float(self.work_min_np[ids].sum())
            longest = float(self.best_np[ids].max())
        else:
            work = sum(self.work_min[i] for i in seq_ids)
            best = self.best
            longest = max(best[i] for i in seq_ids)
        return max(work / self.world_size + self.min_fixed, longest)


def longest_first_ids(lengths: np.ndarray, ids: np.ndarray) -> list[int]:
    """``ids`` longest first by ``lengths``, ties by index (the order every builder walks)."""
    # lexsort's last key is the primary one; both sorts are stable and total, so the order
    # equals sorted(key=(-length, index)).
    return ids[np.lexsort((ids, -lengths[ids]))].tolist()


def _no_cheaper_larger(times: np.ndarray, sizes: Sequence[int]) -> np.ndarray:
    """Per row and size ``j``: no larger size costs that row fewer rank-ms than ``j``."""
    work = times * np.asarray(sizes, dtype=np.float64)[None, :]
    larger = np.minimum.accumulate(work[:, ::-1], axis=1)[:, ::-1]  # min over sizes >= j
    larger = np.concatenate([larger[:, 1:], np.full((len(work), 1), np.inf)], axis=1)
    return work <= larger


def _grows(work: np.ndarray) -> bool:
    """Whether each row is non-decreasing where both neighbours are finite (fitting sizes)."""
    if work.shape[1] < 2:
        return True
    lo, hi = work[:, :-1], work[:, 1:]
    both = np.isfinite(lo) & np.isfinite(hi)
    return bool(np.all(hi[both] >= lo[both] * (1 - 1e-12)))
