"""The group space: which rank blocks may form a sequence-parallel group and how each one runs.

One module owns every rule that the planner, the cost model, flag validation, process-group
creation, attention and plan agreement must agree on, so none of them restates it:

- **Blocks.** ``Cluster`` holds ``world_size`` sequence-parallel slots in nodes of
  ``gpus_per_node``. Every size ``1..gpus_per_node`` is legal (3, 5, 6, 7 on 8-slot nodes too) as
  contiguous blocks inside one node, starting at ``node * G + k * d`` for ``k < G // d``; above a
  node, every multiple of whole nodes, starting at multiples of ``d``. A fixed set of blocks
  (not any contiguous run) keeps the number of process groups to pre-create bounded:
  ``sum_d floor(G/d) * nodes`` inside nodes plus ``world/d`` per multi-node size
  (``process_group_count``).
- **Heads.** ``HeadSpace`` holds the query and KV heads per tensor-parallel rank. A group of ``d``
  ranks runs Ulysses all-to-all over ``u`` ranks and ring attention over ``r = d / u`` ranks;
  ``u`` must divide the query heads, so the default split takes the largest such ``u``
  (pure Ulysses when the heads allow it, pure ring when ``d`` shares no factor with them).
  Slot ``i`` of a group sits at Ulysses position ``i % u`` and ring position ``i // u``, so the
  Ulysses sub-groups are contiguous (inside a node whenever ``u <= G``) and the ring strides.
- **KV copies.** With GQA, Ulysses needs the KV heads to split over ``u`` ranks; each KV head is
  copied ``kv_copies`` times (the smallest ``c`` with ``c | q/kv`` and ``u | kv * c``), which keeps
  query head ``j`` paired with KV head ``j // (q/kv)`` after the scatter.
- ``problems(plan, heads)`` lists every group a runtime could not execute.

Pure Python: the planner layer must not import torch.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from megatron_hsp.planner.errors import InputError


class PlanLayout(Protocol):
    """What ``problems`` reads of a plan: ``plan.Plan`` has it (plan.py imports this module, so
    this one names the shape instead of the type)."""

    @property
    def world_size(self) -> int: ...

    @property
    def gpus_per_node(self) -> int: ...

    @property
    def microbatches(self) -> Sequence[Any]: ...  # each with ``groups`` of ``plan.Group``


@dataclass(frozen=True, slots=True)
class Cluster:
    """``world_size`` sequence-parallel slots in nodes of ``gpus_per_node``.

    "Ranks" here are sequence-parallel slots (data-parallel x context-parallel positions). With
    tensor parallelism each slot is a TP group; the runtime maps slots to global ranks.
    """

    world_size: int
    gpus_per_node: int

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise InputError(f"--gpus must be >= 1, got {self.world_size}")
        if self.gpus_per_node < 1:
            raise InputError(f"--gpus-per-node must be >= 1, got {self.gpus_per_node}")
        if self.world_size > self.gpus_per_node and self.world_size % self.gpus_per_node:
            raise InputError(
                f"--gpus {self.world_size} is not a multiple of --gpus-per-node "
                f"{self.gpus_per_node}; use whole nodes (e.g. --gpus "
                f"{(self.world_size // self.gpus_per_node + 1) * self.gpus_per_node})"
            )

    @property
    def node_width(self) -> int:
        """Slots in one node (the whole cluster when it is smaller than a node)."""
        return min(self.gpus_per_node, self.world_size)

    @property
    def num_nodes(self) -> int:
        return max(1, self.world_size // self.gpus_per_node)

    def node_of(self, rank: int) -> int:
        return rank // self.gpus_per_node

    def size_fits(self, size: int) -> bool:
        """Whether ``size`` is a legal group size: up to a node, or whole nodes dividing none."""
        if size < 1 or size > self.world_size:
            return False
        return size <= self.node_width or size % self.node_width == 0

    def crosses_node(self, size: int) -> bool:
        return size > self.gpus_per_node

    def block_starts(self, size: int) -> tuple[int, ...]:
        """First slot of every legal block of ``size``, ascending (cached: placement asks often)."""
        return _block_starts(self.world_size, self.node_width, size)

    def block(self, size: int, index: int) -> tuple[int, ...]:
        start = self.block_starts(size)[index]
        return tuple(range(start, start + size))

    def block_index(self, ranks: Sequence[int]) -> int:
        """Index of ``ranks`` among ``aligned_blocks(len(ranks))``; -1 when it is none of them."""
        size = len(ranks)
        if size == 0 or not self.size_fits(size):
            return -1
        start = ranks[0]
        if tuple(ranks) != tuple(range(start, start + size)):
            return -1
        g = self.node_width
        if size <= g:
            node, offset = divmod(start, g)
            per_node = g // size
            if offset % size or offset + size > g or node >= self.world_size // g:
                return -1
            return node * per_node + offset // size
        if start % size or start + size > self.world_size:
            return -1
        return start // size

    def aligned_blocks(self, size: int) -> list[tuple[int, ...]]:
        """Every legal group of ``size``, in rank order."""
        if not self.size_fits(size):
            raise InputError(
                f"group size {size} is not legal on {self.world_size} ranks in nodes of "
                f"{self.gpus_per_node}; legal sizes: {self.legal_sizes()}"
            )
        return [tuple(range(s, s + size)) for s in self.block_starts(size)]

    def is_aligned_block(self, ranks: Sequence[int]) -> bool:
        return self.block_index(ranks) >= 0

    def legal_sizes(self, candidates: Iterable[int] | None = None) -> list[int]:
        """Sizes from ``candidates`` (default: all) that are legal here, ascending."""
        pool = range(1, self.world_size + 1) if candidates is None else candidates
        return sorted({int(s) for s in pool if self.size_fits(int(s))})

    def tiling_sizes(self) -> list[int]:
        """Legal sizes whose blocks cover every slot (a micro-batch of only that size exists)."""
        return [d for d in self.legal_sizes() if len(self.block_starts(d)) * d == self.world_size]

    def power_of_two_sizes(self) -> list[int]:
        return [s for s in self.legal_sizes() if s & (s - 1) == 0]

    def process_group_count(
        self, sizes: Iterable[int] | None = None, heads: HeadSpace | None = None
    ) -> int:
        """Process groups per TP x PP position that the runtime pre-creates for ``sizes``.

        One per block; with ``heads``, a hybrid block (u > 1 and r > 1) adds its ``r`` Ulysses
        and ``u`` ring sub-groups (pure ring reuses the block's group), and a set of slots
        already created for another size is reused (``group_families``). Every rank holds a
        process-group object for each; only the groups a rank is a member of and communicates
        on become communicators (``communicators_per_rank``).
        """
        chosen = self.legal_sizes() if sizes is None else self.legal_sizes(sizes)
        made: set[tuple[int, ...]] = set()
        for d in chosen:
            for family in group_families(self, d, heads):
                made.update(family)
        return len(made)


# Communicators (NCCL) one rank may hold for HSP's groups, by default (``--hsp-max-communicators``).
# Why 24: it holds, for a 32-head model in nodes of 8, size 1 (free), every power of two up to
# 1024 and the largest size plus the intra-node sizes; 16 would leave a 128 -> 1024 gap at 1024
# GPUs. What they cost in memory is ``communicator_memory_gb`` (docs/runtime.md).
DEFAULT_MAX_COMMUNICATORS = 24

# The memory rule's inputs (docs/runtime.md, "What a communicator costs", has the NCCL settings
# they come from). One connection to a peer holds, per channel, a buffer for each NCCL protocol:
# Simple (NCCL_BUFFSIZE), LL128 and LL.
NCCL_SIMPLE_BYTES = 4 * 2**20
NCCL_LL128_BYTES = 4_915_200
NCCL_LL_BYTES = 2**19
# Channels NCCL opens to each point-to-point peer (all-to-all and send/recv).
NCCL_P2P_CHANNELS_PER_PEER = 2
# Both ends of a connection are charged (the receive buffers and the sender's staging).
COMMUNICATOR_PEER_BYTES = (
    2 * NCCL_P2P_CHANNELS_PER_PEER * (NCCL_SIMPLE_BYTES + NCCL_LL128_BYTES + NCCL_LL_BYTES)
)
# Per communicator whatever it runs: device-side channel and work structures.
COMMUNICATOR_FIXED_BYTES = 16 * 2**20


def communicator_sets(
    sizes: Iterable[int], heads: HeadSpace | None = None
) -> dict[tuple[int, ...], int]:
    """The communicators slot 0 holds for ``sizes``, as ``slot set -> peers its collective
    connects``. Slot 0 is in the first block of every size, so this is a rank's full set.

    A pure-Ulysses block runs all-to-all (every other member is a peer); a pure-ring block and a
    hybrid split's ring sub-group run the ring's shifts (next and previous: two peers, one for a
    ring of two); a hybrid split's Ulysses sub-group (its first ``u`` slots) runs all-to-all and
    is the same set as a block of ``u`` (or another hybrid size's Ulysses sub-group), which the
    runtime creates once (``runtime/groups.py``); the block of a hybrid split only names the
    ranks (no collective runs on it, so no peer is connected). Groups of one rank hold none.
    """
    out: dict[tuple[int, ...], int] = {}

    def add(ranks: tuple[int, ...], peers: int) -> None:
        out[ranks] = max(out.get(ranks, 0), peers)

    for d in sorted({int(x) for x in sizes}):
        if d <= 1:
            continue
        u, r = heads.split(d) if heads is not None else (d, 1)
        if r == 1:
            add(tuple(range(d)), d - 1)
        elif u == 1:
            add(tuple(range(d)), min(2, d - 1))
        else:
            add(tuple(range(d)), 0)
            add(tuple(range(u)), u - 1)
            add(tuple(range(0, d, u)), min(2, r - 1))
    return out


def communicators_for_size(size: int, heads: HeadSpace | None = None) -> int:
    """Communicators one rank joins to run groups of ``size`` alone: none for 1 (no
    collective), one for its block, two more for a hybrid split (its Ulysses and its ring
    sub-group; pure ring and pure Ulysses run on the block's own group)."""
    return len(communicator_sets([size], heads))


def communicators_per_rank(sizes: Iterable[int], heads: HeadSpace | None = None) -> int:
    """Communicators one rank holds when every size of ``sizes`` is in use: each rank belongs
    to one aligned block per size, and groups of the same ranks are one communicator."""
    return len(communicator_sets(sizes, heads))


def communicator_memory_gb(sizes: Iterable[int], heads: HeadSpace | None = None) -> float:
    """GPU memory (GB) one rank's communicators for ``sizes`` hold: what the planner's memory
    cap is charged (``megatron/config.py``) and ``benchmarks/communicators.py`` reports.

    Each communicator costs ``COMMUNICATOR_FIXED_BYTES`` plus ``COMMUNICATOR_PEER_BYTES`` per
    peer its collective connects (``communicator_sets``). NCCL connects a peer when a collective
    first needs it, so a group warmed with (or running) its own collective only holds those
    buffers; the rule assumes no split sharing (NCCL_COMM_SPLIT_SHARE_RESOURCES unset), which
    would only lower it. The settings behind each figure: docs/runtime.md.
    """
    sets = communicator_sets(sizes, heads)
    total = sum(COMMUNICATOR_FIXED_BYTES + p * COMMUNICATOR_PEER_BYTES for p in sets.values())
    return total / 1e9


def sizes_within_communicator_budget(
    sizes: Sequence[int], gpus_per_node: int, cap: int, heads: HeadSpace | None = None
) -> list[int]:
    """The sizes kept under a cap of ``cap`` communicators per rank, in a fixed priority order:
    1 (free), the largest (the longest sequences need it), every power of two, every other size
    up to a node, then whole-node sizes ascending. Deterministic, so every rank and the planner
    agree without a collective; sizes past the cap are dropped, never created lazily mid-run.
    A size costs the communicators it adds to those already kept (a hybrid's Ulysses sub-group
    may be a kept block already)."""
    if cap < 1:
        raise ValueError(f"communicator cap must be >= 1, got {cap}")
    ordered = sorted({int(d) for d in sizes})
    if not ordered:
        return []
    first = [d for d in ordered if d == 1] + [ordered[-1]]
    powers = [d for d in ordered if d & (d - 1) == 0]
    intra = [d for d in ordered if d <= gpus_per_node]
    priority = list(dict.fromkeys([*first, *powers, *intra, *ordered]))
    kept: list[int] = []
    for d in priority:
        if communicators_per_rank([*kept, d], heads) <= cap:
            kept.append(d)
    return sorted(kept)


def group_families(
    cluster: Cluster, size: int, heads: HeadSpace | None = None
) -> list[list[tuple[int, ...]]]:
    """The families of disjoint slot sets the runtime creates for ``size``, in creation order:
    its blocks, then (hybrid split) every block's Ulysses sub-groups, then its ring sub-groups.
    One family is one ``split_group`` call under NCCL (``runtime/groups.py``)."""
    blocks = cluster.aligned_blocks(size)
    u, r = heads.split(size) if heads is not None else (size, 1)
    if u == 1 or r == 1:
        return [blocks]
    runs = [b[j * u : (j + 1) * u] for b in blocks for j in range(r)]
    strides = [b[i::u] for b in blocks for i in range(u)]
    return [blocks, runs, strides]


def startup_calls_per_rank(
    cluster: Cluster, sizes: Iterable[int], heads: HeadSpace | None = None
) -> int:
    """Group-creation calls each rank makes at start-up under NCCL: one ``split_group`` per
    family with a slot set not created before (sets already created are reused), so of the
    order of the sizes, not of the blocks (``Cluster.process_group_count``)."""
    made: set[tuple[int, ...]] = set()
    calls = 0
    for d in sorted({int(x) for x in sizes}):
        for family in group_families(cluster, d, heads):
            fresh = [s for s in family if s not in made]
            if fresh:
                calls += 1
                made.update(fresh)
    return calls


# Above this many candidate sizes the solver searches a geometric subset (``planning_sizes``).
PLANNING_SIZE_LIMIT = 160


def anchor_sizes(sizes: Sequence[int], gpus_per_node: int) -> list[int]:
    """Every size up to a node, every power of two and the largest of ``sizes``, ascending: a
    bounded subset that keeps the intra-node choices and a geometric ladder across nodes."""
    ordered = sorted({int(d) for d in sizes})
    keep = {d for d in ordered if d <= gpus_per_node or d & (d - 1) == 0}
    if ordered:
        keep.add(ordered[-1])
    return sorted(keep)


def planning_sizes(
    sizes: Sequence[int], gpus_per_node: int, limit: int = PLANNING_SIZE_LIMIT
) -> list[int]:
    """The sizes the solver searches when it may use all of ``sizes`` (ascending, legal).

    Why: every whole-node multiple is a legal size, so 4096 GPUs in nodes of 8 have 519 sizes,
    and the solver's per-(sequence, size) tables and group search grow with that count: a
    32768-sequence solve took longer than the step it planned. Up to ``limit`` sizes all are
    kept. Above it: every size up to a node, every power of two, the largest, and whole-node
    sizes at most 25% apart, which cost at most 25% more ranks than the best size for any one
    sequence (the measured solve times and step loss: docs/results/solver.md).
    ``bench``'s lower-bound method keeps all sizes, so its gap includes what the subset gives up.
    """
    ordered = sorted({int(d) for d in sizes})
    if len(ordered) <= limit:
        return ordered
    keep = set(anchor_sizes(ordered, gpus_per_node))
    last = gpus_per_node
    for d in ordered:
        if d > gpus_per_node and d >= last * 1.25:
            keep.add(d)
            last = d
    return sorted(keep)


@functools.lru_cache(maxsize=4096)
def _block_starts(world: int, g: int, size: int) -> tuple[int, ...]:
    if size < 1 or size > world or (size > g and size % g):
        return ()
    if size <= g:
        return tuple(n * g + k * size for n in range(world // g) for k in range(g // size))
    return tuple(range(0, world - size + 1, size))


@functools.cache  # asked per group by every split and price (a few ints: a small cache)
def largest_ulysses(size: int, q_heads: int) -> int:
    """Largest divisor of ``size`` that also divides ``q_heads`` (the default Ulysses degree)."""
    return max(u for u in range(1, size + 1) if size % u == 0 and q_heads % u == 0)


def kv_copies(q_heads: int, kv_heads: int, ulysses: int) -> int:
    """Copies of each KV head so that ``ulysses`` ranks split them evenly (1 when they already do).

    The smallest ``c`` with ``c | q/kv`` and ``ulysses | kv * c``; ``c = q/kv`` (plain MHA
    expansion) always works once ``ulysses`` divides ``q_heads``.
    """
    if q_heads % ulysses:
        raise InputError(f"Ulysses degree {ulysses} does not divide {q_heads} query heads per rank")
    per_kv = q_heads // kv_heads
    return next(
        c for c in range(1, per_kv + 1) if per_kv % c == 0 and (kv_heads * c) % ulysses == 0
    )


# Largest ring degree the runtime executes. The torch attention runs ring attention of any degree
# (runtime/ring.py), so there is no limit; a backend without ring support would pass 1.
RUNTIME_MAX_RING = 1 << 30


@dataclass(frozen=True, slots=True)
class HeadSpace:
    """Query and KV heads on one tensor-parallel rank: what Ulysses can split.

    ``max_ring`` is the largest ring degree the executing runtime supports. ``ring_only``: the
    run's groups use no Ulysses at all (split 1 x d at every size), as Megatron's dynamic
    context parallelism runs them; ``run_spec.method_heads`` sets it for the plan methods
    that train that way. Every split the runtime pre-creates, plans record and the cost model
    prices comes from ``split``, so this one field decides them all.
    """

    q_heads: int
    kv_heads: int
    max_ring: int = RUNTIME_MAX_RING
    ring_only: bool = False

    def __post_init__(self) -> None:
        if self.q_heads < 1 or self.kv_heads < 1 or self.q_heads % self.kv_heads:
            raise InputError(
                f"query heads {self.q_heads} per tensor-parallel rank must be a positive multiple "
                f"of the KV heads {self.kv_heads}"
            )

    @classmethod
    def from_model(
        cls, heads: int, kv_heads: int | None = None, tp: int = 1, max_ring: int = RUNTIME_MAX_RING
    ) -> HeadSpace:
        """Per-TP-rank heads as Megatron splits them (KV heads replicated when tp > kv)."""
        kv = heads if kv_heads is None else kv_heads
        if heads % tp:
            raise InputError(
                f"--num-attention-heads {heads} is not divisible by --tensor-model-parallel-size "
                f"{tp}"
            )
        return cls(heads // tp, max(kv, tp) // tp, max_ring)

    def split(self, size: int, ulysses: int | None = None) -> tuple[int, int]:
        """(Ulysses degree u, ring degree r) for a group of ``size``: u * r = size.

        Default: the largest u the query heads allow (1 for a ``ring_only`` space). A chosen
        ``ulysses`` must divide both.
        """
        if ulysses is None:
            u = 1 if self.ring_only else largest_ulysses(size, self.q_heads)
        else:
            u = int(ulysses)
            if u < 1 or size % u or self.q_heads % u:
                raise InputError(
                    f"Ulysses degree {u} cannot run a group of {size}: it must divide the group "
                    f"size and the {self.q_heads} query heads per tensor-parallel rank; the "
                    f"largest that does is {largest_ulysses(size, self.q_heads)}"
                )
        return u, size // u

    def kv_copies(self, ulysses: int) -> int:
        return kv_copies(self.q_heads, self.kv_heads, ulysses)

    def split_problem(self, size: int, ulysses: int, ring: int) -> str | None:
        """Why (``ulysses``, ``ring``) cannot run a group of ``size``; None when it can."""
        if ulysses < 1 or ring < 1 or ulysses * ring != size:
            return f"split ulysses {ulysses} x ring {ring} does not multiply to group size {size}"
        if self.ring_only and ulysses > 1:
            return (
                f"split ulysses {ulysses} x ring {ring}: this run's groups are pure ring "
                f"(1 x {size}), as Megatron's dynamic context parallelism runs them"
            )
        if self.q_heads % ulysses:
            return (
                f"Ulysses degree {ulysses} does not divide the {self.q_heads} query heads per "
                f"tensor-parallel rank (largest usable for size {size}: "
                f"{largest_ulysses(size, self.q_heads)})"
            )
        if ring > self.max_ring:
            allowed = (
                f"groups of up to {self.max_ring} ranks run pure ring"
                if self.ring_only
                else f"the {self.q_heads} query heads per tensor-parallel rank allow Ulysses "
                f"groups of {self.ulysses_sizes()}"
            )
            return (
                f"ring degree {ring} (group {size} = ulysses {ulysses} x ring {ring}) exceeds the "
                f"runtime's ring support ({self.max_ring}); {allowed}"
            )
        return None

    def executable(self, size: int) -> bool:
        """Whether the default split of ``size`` runs on this runtime."""
        u, r = self.split(size)
        return self.split_problem(size, u, r) is None

    @property
    def heads(self) -> tuple[int, int]:
        """(query heads, KV heads) per tensor-parallel rank, whatever the split policy."""
        return self.q_heads, self.kv_heads

    def ulysses_sizes(self) -> list[int]:
        """Group sizes pure Ulysses can run: divisors of the query heads."""
        return [d for d in range(1, self.q_heads + 1) if self.q_heads % d == 0]

    def legal_sizes(self, cluster: Cluster, candidates: Iterable[int] | None = None) -> list[int]:
        """Legal block sizes of ``cluster`` (from ``candidates``) whose default split runs."""
        return [d for d in cluster.legal_sizes(candidates) if self.executable(d)]


def problems(plan: PlanLayout, heads: HeadSpace | None = None) -> list[str]:
    """Groups of ``plan`` that the runtime cannot execute, as sentences (empty: all executable).

    Checks every group is a legal block and, given the model's ``heads``, that its recorded
    (ulysses, ring) split can run (a group without a recorded split gets the default one).
    """
    cluster = Cluster(plan.world_size, plan.gpus_per_node)
    out: list[str] = []
    for i, mb in enumerate(plan.microbatches):
        for g in mb.groups:
            if not cluster.is_aligned_block(g.ranks):
                first = g.ranks[0] if g.ranks else "?"
                out.append(
                    f"micro-batch {i}: group of {g.size} at rank {first} is not a legal block "
                    f"(sizes up to a node of {plan.gpus_per_node} sit inside the node at offsets "
                    f"that are multiples of the size; larger ones span whole nodes)"
                )
            if heads is not None and g.ranks:
                u, r = (g.ulysses, g.ring) if g.ulysses else heads.split(g.size)
                why = heads.split_problem(g.size, u, r)
                if why:
                    out.append(f"micro-batch {i}: group at rank {g.ranks[0]}: {why}")
    return out
