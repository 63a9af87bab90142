"""Cluster shape and the aligned rank blocks that sequence-parallel groups may occupy.

One place decides which rank sets are legal groups, because the planner (which blocks it may
choose), the validator (which blocks it accepts) and the runtime (which process groups it
pre-creates) must agree exactly. A block of size ``d`` starts at a multiple of ``d``; when
``d <= gpus_per_node`` it lies inside one node, otherwise it spans whole nodes. Aligned blocks keep
the number of process groups to pre-create near ``2 * world_size`` instead of ``world_size**2``.

"Ranks" here are sequence-parallel slots (data-parallel x context-parallel positions). With tensor
parallelism each slot is a TP group; the runtime maps slots to global ranks.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from megatron_hsp.planner.errors import InputError


@dataclass(frozen=True, slots=True)
class Cluster:
    """``world_size`` sequence-parallel slots in nodes of ``gpus_per_node``."""

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
    def num_nodes(self) -> int:
        return max(1, self.world_size // self.gpus_per_node)

    def node_of(self, rank: int) -> int:
        return rank // self.gpus_per_node

    def size_fits(self, size: int) -> bool:
        """Whether groups of ``size`` can tile the cluster as aligned blocks."""
        if size < 1 or size > self.world_size:
            return False
        if self.world_size <= self.gpus_per_node:
            return self.world_size % size == 0
        if size <= self.gpus_per_node:
            return self.gpus_per_node % size == 0
        return size % self.gpus_per_node == 0

    def crosses_node(self, size: int) -> bool:
        return size > self.gpus_per_node

    def block(self, size: int, index: int) -> tuple[int, ...]:
        start = index * size
        return tuple(range(start, start + size))

    def aligned_blocks(self, size: int) -> list[tuple[int, ...]]:
        """Every legal group of ``size``, in rank order (blocks start at multiples of ``size``)."""
        if not self.size_fits(size):
            raise InputError(
                f"group size {size} does not tile {self.world_size} ranks in nodes of "
                f"{self.gpus_per_node}; legal sizes: {self.legal_sizes()}"
            )
        return [self.block(size, i) for i in range(self.world_size // size)]

    def is_aligned_block(self, ranks: Sequence[int]) -> bool:
        size = len(ranks)
        if size == 0 or not self.size_fits(size):
            return False
        start = ranks[0]
        return start % size == 0 and tuple(ranks) == tuple(range(start, start + size))

    def legal_sizes(self, candidates: Iterable[int] | None = None) -> list[int]:
        """Sizes from ``candidates`` (default: all) that tile this cluster, ascending."""
        pool = range(1, self.world_size + 1) if candidates is None else candidates
        return sorted({s for s in pool if self.size_fits(s)})

    def power_of_two_sizes(self) -> list[int]:
        return [s for s in self.legal_sizes() if s & (s - 1) == 0]
