"""``Plan``, ``MicroBatch`` and ``Group``: what the planner decides and the runtime executes.

A plan covers one global batch. Micro-batches run one after another; inside a micro-batch the
sequence-parallel ranks are partitioned into groups (aligned blocks, see ``topology``) that run
concurrently, each training its own sequences with Ulysses all-to-all over its ranks. The JSON
form is a contract (``docs/design.md`` section 3): change it only compatibly.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from megatron_hsp.planner import groupspace
from megatron_hsp.planner.errors import PlanError
from megatron_hsp.planner.groupspace import Cluster, HeadSpace

PLAN_STATUSES = ("optimal", "time_limit", "fallback", "heuristic")


class MemoryModel(Protocol):
    """What ``Plan.validate`` needs from a cost model to check memory."""

    def fits(self, lengths: Sequence[int], group_size: int) -> bool:
        """Whether a group of ``group_size`` ranks can hold these sequences' activations."""
        ...


@dataclass(frozen=True, slots=True)
class Group:
    """Ranks that train ``seq_ids`` together in one micro-batch."""

    ranks: tuple[int, ...]
    seq_ids: tuple[int, ...] = ()
    lengths: tuple[int, ...] = ()
    est_ms: float = 0.0
    # Ulysses x ring split (``groupspace.HeadSpace.split``); 0 when the planner knew no heads.
    ulysses: int = 0
    ring: int = 0

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def comm(self) -> str:
        """``a2a`` (Ulysses), ``ring``, ``a2a+ring`` (hybrid) or ``none`` (a single rank)."""
        if self.ring > 1:
            return "a2a+ring" if self.ulysses > 1 else "ring"
        return "a2a" if self.size > 1 else "none"

    @property
    def tokens(self) -> int:
        return sum(self.lengths)

    def to_dict(self) -> dict[str, Any]:
        return {
            "size": self.size,
            "ranks": list(self.ranks),
            "comm": self.comm,
            "seq_ids": list(self.seq_ids),
            "lengths": list(self.lengths),
            "est_ms": self.est_ms,
            **({"ulysses": self.ulysses, "ring": self.ring} if self.ulysses else {}),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Group:
        ranks = tuple(int(r) for r in d["ranks"])
        if "size" in d and int(d["size"]) != len(ranks):
            raise PlanError([f"group size {d['size']} does not match its {len(ranks)} ranks"])
        return cls(
            ranks=ranks,
            seq_ids=tuple(int(s) for s in d.get("seq_ids", ())),
            lengths=tuple(int(x) for x in d.get("lengths", ())),
            est_ms=float(d.get("est_ms", 0.0)),
            ulysses=int(d.get("ulysses", 0)),
            ring=int(d.get("ring", 0)),
        )


@dataclass(frozen=True, slots=True)
class MicroBatch:
    """One forward/backward pass: a partition of all ranks into groups."""

    groups: tuple[Group, ...]
    est_ms: float = 0.0

    @property
    def group_sizes(self) -> list[int]:
        return [g.size for g in self.groups]

    def group_of(self, rank: int) -> Group:
        for g in self.groups:
            if rank in g.ranks:
                return g
        raise PlanError([f"rank {rank} is in no group of this micro-batch"])

    def to_dict(self) -> dict[str, Any]:
        return {"est_ms": self.est_ms, "groups": [g.to_dict() for g in self.groups]}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> MicroBatch:
        return cls(
            groups=tuple(Group.from_dict(g) for g in d["groups"]),
            est_ms=float(d.get("est_ms", 0.0)),
        )


@dataclass(frozen=True)
class Plan:
    """The schedule of one global batch over ``world_size`` sequence-parallel ranks."""

    world_size: int
    gpus_per_node: int
    microbatches: tuple[MicroBatch, ...]
    cost_model: str = ""
    est_step_ms: float = 0.0
    lower_bound_ms: float = 0.0
    solve_ms: float = 0.0
    solver: str = ""
    status: str = "optimal"
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    @property
    def cluster(self) -> Cluster:
        return Cluster(self.world_size, self.gpus_per_node)

    @property
    def num_sequences(self) -> int:
        return sum(len(g.seq_ids) for mb in self.microbatches for g in mb.groups)

    @property
    def group_sizes_used(self) -> list[int]:
        return sorted({g.size for mb in self.microbatches for g in mb.groups})

    # ------------------------------------------------------------------ validation
    def problems(
        self,
        lengths: Sequence[int] | None = None,
        memory: MemoryModel | None = None,
        world_size: int | None = None,
        heads: HeadSpace | None = None,
    ) -> list[str]:
        """Every broken invariant, as readable sentences; empty when the plan is valid.

        ``lengths`` (indexed by sequence id) checks coverage: each sequence exactly once with its
        true length. ``memory`` checks that each group's sequences fit its size,
        ``world_size`` that the plan was made for the cluster about to execute it, and ``heads``
        (the model's heads per TP rank) that the runtime can execute every group's split.
        """
        out: list[str] = []
        if world_size is not None and world_size != self.world_size:
            out.append(
                f"plan is for {self.world_size} sequence-parallel ranks but {world_size} are "
                "running; re-plan with the running world size"
            )
        try:
            self.cluster  # noqa: B018 -- raises on an impossible cluster shape
        except ValueError as exc:
            return [*out, str(exc)]
        if self.status not in PLAN_STATUSES:
            out.append(f"status {self.status!r} is not one of {PLAN_STATUSES}")
        if not self.microbatches:
            out.append("plan has no micro-batches")
        out += groupspace.problems(self, heads)
        seen: Counter[int] = Counter()
        for i, mb in enumerate(self.microbatches):
            covered: list[int] = []
            for g in mb.groups:
                covered.extend(g.ranks)
                if len(g.seq_ids) != len(g.lengths):
                    out.append(
                        f"micro-batch {i}: group at rank {g.ranks[0] if g.ranks else '?'} has "
                        f"{len(g.seq_ids)} seq_ids but {len(g.lengths)} lengths"
                    )
                if g.lengths and min(g.lengths) <= 0:
                    out.append(f"micro-batch {i}: non-positive length in {_short(g.lengths)}")
                seen.update(g.seq_ids)
                # Memory is monotone (fewer tokens never need more), so a group that fits
                # holds each of its sequences: the per-sequence sentences are only looked for
                # in a group that does not (one check per sequence was slow at 16,384 GPUs).
                if memory is not None and g.lengths and not memory.fits(g.lengths, g.size):
                    for sid, ln in zip(g.seq_ids, g.lengths, strict=False):
                        if not memory.fits([ln], g.size):
                            out.append(
                                f"micro-batch {i}: sequence {sid} of length {ln} does not fit a "
                                f"group of {g.size}"
                            )
                    out.append(
                        f"micro-batch {i}: group of {g.size} at rank {g.ranks[0]} holds "
                        f"{g.tokens} tokens, over its memory cap"
                    )
            counts = Counter(covered)
            dup = sorted(r for r, c in counts.items() if c > 1)
            missing = sorted(set(range(self.world_size)) - set(counts))
            extra = sorted(r for r in counts if not 0 <= r < self.world_size)
            if dup:
                out.append(f"micro-batch {i}: ranks {_short(dup)} are in several groups")
            if missing:
                out.append(f"micro-batch {i}: ranks {_short(missing)} are in no group")
            if extra:
                out.append(
                    f"micro-batch {i}: ranks {_short(extra)} are outside 0..{self.world_size - 1}"
                )
        twice = sorted(s for s, c in seen.items() if c > 1)
        if twice:
            out.append(f"sequences {_short(twice)} are scheduled more than once")
        if lengths is not None:
            n = len(lengths)
            absent = sorted(set(range(n)) - set(seen))
            unknown = sorted(s for s in seen if not 0 <= s < n)
            if absent:
                out.append(f"sequences {_short(absent)} are not scheduled")
            if unknown:
                out.append(f"sequence ids {_short(unknown)} are not in the batch of {n}")
            for i, mb in enumerate(self.microbatches):
                for g in mb.groups:
                    for sid, ln in zip(g.seq_ids, g.lengths, strict=False):
                        if 0 <= sid < n and lengths[sid] != ln:
                            out.append(
                                f"micro-batch {i}: sequence {sid} has length {ln} in the plan "
                                f"but {lengths[sid]} in the batch"
                            )
        return out

    def validate(
        self,
        lengths: Sequence[int] | None = None,
        memory: MemoryModel | None = None,
        world_size: int | None = None,
        heads: HeadSpace | None = None,
    ) -> Plan:
        """Raise ``PlanError`` listing every broken invariant; return ``self`` when valid."""
        problems = self.problems(lengths, memory, world_size, heads)
        if problems:
            raise PlanError(problems)
        return self

    # ------------------------------------------------------------------ serialisation
    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "world_size": self.world_size,
            "gpus_per_node": self.gpus_per_node,
            "cost_model": self.cost_model,
            "est_step_ms": self.est_step_ms,
            "lower_bound_ms": self.lower_bound_ms,
            "solve_ms": self.solve_ms,
            "solver": self.solver,
            "status": self.status,
            "microbatches": [mb.to_dict() for mb in self.microbatches],
        }
        if self.extra:
            d["extra"] = self.extra
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Plan:
        try:
            return cls(
                world_size=int(d["world_size"]),
                gpus_per_node=int(d["gpus_per_node"]),
                microbatches=tuple(MicroBatch.from_dict(m) for m in d["microbatches"]),
                cost_model=str(d.get("cost_model", "")),
                est_step_ms=float(d.get("est_step_ms", 0.0)),
                lower_bound_ms=float(d.get("lower_bound_ms", 0.0)),
                solve_ms=float(d.get("solve_ms", 0.0)),
                solver=str(d.get("solver", "")),
                status=str(d.get("status", "optimal")),
                extra=dict(d.get("extra", {})),
            )
        except KeyError as exc:
            raise PlanError([f"plan JSON lacks the field {exc.args[0]!r}"]) from None

    def to_json(self, indent: int | None = None) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        return cls.from_dict(json.loads(text))

    def fingerprint(self) -> str:
        """Hash of what ranks execute (layout and sequences, not estimates or timings).

        Ranks compare fingerprints before a step so that a plan mismatch fails loudly instead
        of deadlocking inside a collective.
        """
        layout = [
            [
                [list(g.ranks), list(g.seq_ids), list(g.lengths)]
                + ([g.ulysses] if g.ulysses else [])
                for g in mb.groups
            ]
            for mb in self.microbatches
        ]
        blob = json.dumps([self.world_size, self.gpus_per_node, layout], separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()


def _short(xs: Sequence[Any], limit: int = 6) -> str:
    xs = list(xs)
    head = ", ".join(str(x) for x in xs[:limit])
    return f"[{head}{', ...' if len(xs) > limit else ''}]"
