"""Pre-created sequence-parallel process groups: every group a plan may use, made once, up front.

Creating process groups lazily in the middle of training stalls or deadlocks (``new_group`` is a
collective over the whole world, and NCCL communicators are set up on first use), so the runtime
creates every legal block (``Cluster.aligned_blocks``) of every configured size at start-up (or
lazily, the same on every rank, before the step that first uses a size), in one fixed order.

Under NCCL one ``dist.split_group`` call creates a whole family of disjoint groups (a size's
blocks, its Ulysses sub-groups, its ring sub-groups: ``groupspace.group_families``), so start-up
costs a few calls per size instead of one world-wide ``new_group`` per block; other backends
(gloo, which torch cannot split) keep one ``new_group`` per group. A set of ranks is created
once and reused by every size that needs it (a hybrid split's Ulysses sub-group is a block of
its Ulysses degree). Each new group is warmed with the collective it will run -- all-to-all for
Ulysses groups, the ring's point-to-point shift for ring groups -- and a group that runs none
(the block of a hybrid split) is not warmed, so NCCL connects only the peers and buffers the
group uses (``groupspace.communicator_memory_gb`` charges exactly those).

Plan "ranks" are sequence-parallel *slots*: data-parallel x context-parallel positions. Tensor and
pipeline parallel groups stay static. megatron-core orders global ranks ``tp-cp-ep-dp-pp`` (tensor
parallel fastest), so with ``tp`` tensor-parallel ranks and ``S`` slots per pipeline stage::

    global_rank(slot, tp_rank, pp_rank) = pp_rank * S * tp + slot * tp + tp_rank

and the group a plan calls "slots [b*d, (b+1)*d)" is, on a rank with tensor-parallel rank ``t``, the
``d`` global ranks with that same ``t`` (and pipeline stage) -- exactly how megatron builds its
data-parallel-with-context-parallel group. ``GroupRegistry`` maps ``(size, block)`` to this rank's
``ProcessGroup`` for that block.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from megatron_hsp.planner.errors import InputError
from megatron_hsp.planner.groupspace import Cluster, HeadSpace, group_families
from megatron_hsp.planner.run_spec import DimFlags, check_degrees
from megatron_hsp.runtime.comm import comm
from megatron_hsp.runtime.compat import can_split_groups

log = logging.getLogger(__name__)


# How the layout's errors name the degrees (it is built from the process group, not from flags).
RANK_FLAGS = DimFlags(world="world size", tp="tensor-parallel", pp="pipeline-parallel")


@dataclass(frozen=True, slots=True)
class RankLayout:
    """How sequence-parallel slots map to global ranks (megatron order ``tp-cp-ep-dp-pp``)."""

    world_size: int
    tensor_parallel: int = 1
    pipeline_parallel: int = 1

    def __post_init__(self) -> None:
        if self.tensor_parallel < 1 or self.pipeline_parallel < 1:
            raise InputError(
                f"tensor-parallel {self.tensor_parallel} and pipeline-parallel "
                f"{self.pipeline_parallel} must be >= 1"
            )
        check_degrees(self.world_size, self.tensor_parallel, self.pipeline_parallel, RANK_FLAGS)

    @property
    def num_slots(self) -> int:
        """Sequence-parallel slots (data-parallel x context-parallel size): ``run_spec``'s
        ``world / (tp * pp)``."""
        return check_degrees(
            self.world_size, self.tensor_parallel, self.pipeline_parallel, RANK_FLAGS
        )

    def global_rank(self, slot: int, tp_rank: int = 0, pp_rank: int = 0) -> int:
        tp = self.tensor_parallel
        return pp_rank * self.num_slots * tp + slot * tp + tp_rank

    def coords(self, global_rank: int) -> tuple[int, int, int]:
        """``(slot, tp_rank, pp_rank)`` of a global rank."""
        tp = self.tensor_parallel
        per_stage = self.num_slots * tp
        pp_rank, rest = divmod(global_rank, per_stage)
        slot, tp_rank = divmod(rest, tp)
        return slot, tp_rank, pp_rank

    def slot_ranks(self, slots: Sequence[int], tp_rank: int, pp_rank: int) -> list[int]:
        return [self.global_rank(s, tp_rank, pp_rank) for s in slots]


@dataclass
class GroupRegistry:
    """This rank's pre-created process group for every ``(size, block index)`` of the plan space."""

    cluster: Cluster
    layout: RankLayout
    rank: int
    sizes: tuple[int, ...]
    groups: dict[tuple[int, int], dist.ProcessGroup] = field(default_factory=dict)
    # (size, block) -> (Ulysses sub-group or None, ring sub-group) for blocks with ring > 1.
    hybrids: dict[tuple[int, int], tuple[dist.ProcessGroup | None, dist.ProcessGroup]] = field(
        default_factory=dict
    )
    heads: HeadSpace | None = None
    created: int = 0
    create_s: float = 0.0
    warm_s: float = 0.0
    # Sizes allowed but not created yet (``create_groups(lazy=True)``): ``ensure`` creates them,
    # collectively, the first time an agreed plan uses them.
    pending: set[int] = field(default_factory=set)
    new_group_kwargs: dict[str, object] = field(default_factory=dict)
    warm: bool = True
    # One ``split_group`` per family (NCCL) instead of one ``new_group`` per group.
    use_split: bool = False
    # Bind the rank's device to the world group while creating groups, then unbind
    # (``world_device_bound``): NCCL, groups of the world's backend.
    bind_device: bool = False
    # Calls to ``split_group`` / ``new_group`` this rank made (collective over the world each).
    startup_calls: int = 0
    # Every global rank set created so far (the same on every rank) and this rank's groups.
    made: set[tuple[int, ...]] = field(default_factory=set)
    mine: dict[tuple[int, ...], dist.ProcessGroup] = field(default_factory=dict)
    warmed: set[tuple[int, ...]] = field(default_factory=set)

    def ensure(self, sizes: Iterable[int]) -> list[int]:
        """Create the process groups of every size in ``sizes`` not created yet; returns them.

        Collective over the world: every rank must call it with the same sizes at the same point.
        Where it is called from guarantees that: right before a step, with the sizes of the
        plan every rank agreed on (``schedule.step_inputs``), in ascending order. A size used
        once stays created, so the groups a run holds are the ones its plans used, never more
        than the allowed sizes (whose communicators the planner's memory cap is charged for).
        """
        todo = sorted(self.pending.intersection(int(d) for d in sizes))
        if not todo:
            return todo
        with world_device_bound(self.bind_device):
            for size in todo:
                _create_size(self, size)
                self.pending.discard(size)
        return todo

    @property
    def communicators(self) -> int:
        """Distinct groups of more than one rank this rank belongs to: the communicators its
        collectives use (``groupspace.communicators_per_rank`` predicts the same number)."""
        mine = {id(g): g for (size, _), g in self.groups.items() if size > 1}
        for sub_u, sub_r in self.hybrids.values():
            for g in (sub_u, sub_r):
                if g is not None and g.size() > 1:
                    mine[id(g)] = g
        return len(mine)

    @property
    def slot(self) -> int:
        """This rank's sequence-parallel slot (the "rank" plans talk about)."""
        return self.layout.coords(self.rank)[0]

    def has_size(self, size: int) -> bool:
        return size in self.sizes

    def group(self, size: int, block: int) -> dist.ProcessGroup:
        """The process group of block ``block`` of ``size`` slots; this rank must belong to it."""
        try:
            return self.groups[(size, block)]
        except KeyError:
            if size in self.pending:
                raise InputError(
                    f"the process groups of size {size} are not created yet (lazy registry): "
                    "GroupRegistry.ensure creates them, on every rank, before the step that "
                    "uses them"
                ) from None
            if size not in self.sizes:
                raise InputError(
                    f"no process group of size {size} was pre-created (sizes: {list(self.sizes)}); "
                    "add it to the group sizes (--hsp-group-sizes) or re-plan without it"
                ) from None
            raise InputError(
                f"slot {self.slot} is not in block {block} of size {size} "
                f"(slots {block * size}..{(block + 1) * size - 1})"
            ) from None

    def hybrid(
        self, size: int, block: int
    ) -> tuple[dist.ProcessGroup | None, dist.ProcessGroup] | None:
        """(Ulysses sub-group, ring sub-group) of a block whose split has ring > 1, else None.

        Pass it to ``attention.group_packed_seq_params(..., hybrid=...)``.
        """
        self.group(size, block)  # same errors for an unknown size or a foreign block
        return self.hybrids.get((size, block))

    def split(self, size: int) -> tuple[int, int]:
        """(Ulysses degree, ring degree) this registry's sub-groups run a group of ``size`` with:
        ``HeadSpace.split`` of the heads it was created for, pure Ulysses without heads."""
        return (size, 1) if self.heads is None else self.heads.split(size)

    def group_for(self, slots: Sequence[int]) -> dist.ProcessGroup:
        """The group for a plan group's slots (an aligned block containing this rank's slot)."""
        size = len(slots)
        if not self.cluster.is_aligned_block(slots):
            raise InputError(f"slots {list(slots)[:8]} are not an aligned block")
        return self.group(size, slots[0] // size)

    def summary(self) -> str:
        return (
            f"{self.created} process groups for sizes {list(self.sizes)} over "
            f"{self.layout.num_slots} slots x tp {self.layout.tensor_parallel} x pp "
            f"{self.layout.pipeline_parallel} ({self.communicators} communicators on this rank): "
            f"created in {self.create_s * 1e3:.1f} ms by {self.startup_calls} "
            f"{'split_group' if self.use_split else 'new_group'} calls, "
            f"warmed in {self.warm_s * 1e3:.1f} ms"
        )


def default_sizes(cluster: Cluster) -> tuple[int, ...]:
    """Every size that tiles the cluster as aligned blocks (the planner may use any of them)."""
    return tuple(cluster.legal_sizes())


def create_groups(
    gpus_per_node: int,
    *,
    tensor_parallel: int = 1,
    pipeline_parallel: int = 1,
    sizes: Iterable[int] | None = None,
    backend: str | None = None,
    timeout: timedelta | None = None,
    warm: bool = True,
    heads: HeadSpace | None = None,
    bind_device: bool = True,
    lazy: bool = False,
) -> GroupRegistry:
    """Create (collectively, on every rank) and warm every aligned sequence-parallel group.

    ``gpus_per_node`` counts sequence-parallel slots per node (GPUs per node / tp when tensor
    parallelism stays inside a node). ``sizes`` defaults to every legal size. Must be called by all
    ranks with the same arguments: ``new_group`` is collective and order-sensitive.

    ``heads`` (the model's heads per TP rank) splits each block into Ulysses x ring
    (``HeadSpace.split``); a block with ring > 1 and Ulysses > 1 also gets its ``ring`` Ulysses
    sub-groups and ``ulysses`` ring sub-groups (pure ring reuses the block's own group), so every
    process group exists before the first step. ``Cluster.process_group_count`` bounds the blocks.
    ``bind_device`` binds this rank's CUDA device to the world group under NCCL while HSP
    creates its groups (``world_device_bound``), so these groups are communicator splits, not
    new communicators, and each family is one ``split_group`` call where
    ``compat.can_split_groups`` allows it; the world is left as it was afterwards.
    ``lazy`` creates nothing now: each size's groups are created by ``GroupRegistry.ensure`` the
    first time an agreed plan uses it (the step, every rank alike), so a run holds communicators
    only for the sizes its plans use.
    """
    if not dist.is_initialized():
        raise InputError("torch.distributed is not initialised; call init_process_group first")
    world = dist.get_world_size()
    layout = RankLayout(world, tensor_parallel, pipeline_parallel)
    cluster = Cluster(layout.num_slots, min(gpus_per_node, layout.num_slots))
    chosen = default_sizes(cluster) if sizes is None else tuple(sorted(set(int(s) for s in sizes)))
    bad = [s for s in chosen if not cluster.size_fits(s)]
    if bad:
        raise InputError(
            f"group sizes {bad} do not tile {cluster.world_size} sequence-parallel slots in nodes "
            f"of {cluster.gpus_per_node}; legal sizes: {cluster.legal_sizes()}"
        )
    reg = GroupRegistry(
        cluster=cluster,
        layout=layout,
        rank=dist.get_rank(),
        sizes=chosen,
        heads=heads,
        warm=warm,
    )
    if backend is not None:
        reg.new_group_kwargs["backend"] = backend
    if timeout is not None:
        reg.new_group_kwargs["timeout"] = timeout
    # Only groups of the world's own backend are split from it (a gloo group under NCCL is not).
    reg.bind_device = bind_device and backend in (None, dist.get_backend())
    default = dist.distributed_c10d._get_default_group()
    with world_device_bound(reg.bind_device):
        reg.use_split = backend in (None, dist.get_backend()) and can_split_groups(
            dist.get_backend(), getattr(default, "bound_device_id", None)
        )
    reg.pending = set(chosen)
    if not lazy:
        reg.ensure(chosen)
    log.info("megatron-hsp: %s", reg.summary())
    return reg


def _create_size(reg: GroupRegistry, size: int) -> None:
    """Create (collectively) and warm every group of ``size``: its blocks, then the Ulysses and
    the ring sub-groups of a hybrid split (``groupspace.group_families``), each family for every
    pipeline stage and tensor-parallel rank. Same order on every rank."""
    layout = reg.layout
    my_slot, my_tp, my_pp = layout.coords(reg.rank)
    u, r = reg.split(size)
    families = group_families(reg.cluster, size, reg.heads)
    # What each family runs: blocks run all-to-all (pure Ulysses), the ring (pure ring) or
    # nothing themselves (hybrid: their sub-groups do); then Ulysses runs, then ring strides.
    kinds = ["ring" if u == 1 and size > 1 else "all-to-all" if r == 1 else None]
    kinds += ["all-to-all", "ring"]
    t0 = time.perf_counter()
    mine: list[tuple[dist.ProcessGroup, tuple[int, ...], str | None]] = []
    for family, kind in zip(families, kinds, strict=False):
        sets = [
            tuple(layout.slot_ranks(slots, tp, pp))
            for slots in family
            for pp in range(layout.pipeline_parallel)
            for tp in range(layout.tensor_parallel)
        ]
        _create_family(reg, [s for s in sets if s not in reg.made])
        for slots in family:
            if my_slot in slots:
                ranks = tuple(layout.slot_ranks(slots, my_tp, my_pp))
                mine.append((reg.mine[ranks], ranks, kind))
    for b, slots in enumerate(reg.cluster.aligned_blocks(size)):
        if my_slot in slots:
            block = mine[0][0]
            reg.groups[(size, b)] = block
            if r > 1:
                sub_u = next((g for g, _, k in mine[1:] if k == "all-to-all"), None)
                sub_r = next((g for g, _, k in mine[1:] if k == "ring"), block)
                reg.hybrids[(size, b)] = (sub_u, sub_r)
    reg.create_s += time.perf_counter() - t0
    if reg.warm:
        t1 = time.perf_counter()
        for g, ranks, kind in mine:
            if kind is not None and len(ranks) > 1 and ranks not in reg.warmed:
                _warm(g, kind)
                reg.warmed.add(ranks)
        reg.warm_s += time.perf_counter() - t1


def _create_family(reg: GroupRegistry, sets: list[tuple[int, ...]]) -> None:
    """Create the disjoint global rank ``sets`` (collective: every rank, same sets): one
    ``split_group`` of the world under NCCL, else one ``new_group`` per set."""
    if not sets:
        return
    me = reg.rank
    if reg.use_split:
        kwargs = {"timeout": reg.new_group_kwargs.get("timeout")}
        pg = dist.split_group(None, [list(s) for s in sets], group_desc="hsp", **kwargs)
        reg.startup_calls += 1
        reg.created += len(sets)
        for s in sets:
            if me in s:
                reg.mine[s] = pg
    else:
        for s in sets:
            pg = dist.new_group(list(s), **reg.new_group_kwargs)
            reg.startup_calls += 1
            reg.created += 1
            if me in s:
                reg.mine[s] = pg
    reg.made.update(sets)


def bind_world_device() -> torch.device | None:
    """Bind this rank's CUDA device to the world process group, so that the groups created after
    it are split from the world communicator instead of each bootstrapping a full one.

    Why: Megatron's ``initialize`` (megatron-core 0.19) computes the device but does not pass
    ``device_id`` to ``init_process_group``, and torch splits a new NCCL group from its parent
    (``ncclCommSplit``: shared resources, no new bootstrap) only when the default group has a
    ``bound_device_id`` (``distributed_c10d._new_process_group_helper``: "only split when we know
    the default PG has already started communicator initialization"). One all-reduce on the
    world makes sure it has, then the device is bound. Every rank calls this at the same point
    (before HSP's groups), so the no-color splits of non-members stay matched. NCCL only; a
    no-op where the device is bound already (``init_process_group(device_id=...)``) or the
    backend is not NCCL. Returns the bound device, or None.
    """
    if not dist.is_initialized() or dist.get_backend() != "nccl":
        return None
    world = dist.distributed_c10d._get_default_group()
    if world.bound_device_id is not None:
        return world.bound_device_id
    device = torch.device("cuda", torch.cuda.current_device())
    started = torch.ones(1, device=device)
    dist.all_reduce(started)
    world.bound_device_id = device
    return device


@contextlib.contextmanager
def world_device_bound(enabled: bool = True) -> Iterator[torch.device | None]:
    """The world group bound to this rank's device (``bind_world_device``) while HSP creates
    its groups, and as it was again afterwards.

    Why unbind: while the world has a ``bound_device_id``, torch's ``new_group`` makes every
    non-member of ANY later group join an NCCL split of the world
    (``distributed_c10d._new_process_group_helper``: ``perform_nocolor_split``), whatever
    backend the group asks for; members of a ``new_group(backend="gloo")`` made later by
    Megatron or the user never split, so the non-members would wait in it for ever. Restored,
    later ``new_group`` calls run as torch would have run them without HSP. HSP's own groups
    keep their communicators (and split ones their own bound device). A world bound by the
    user (``init_process_group(device_id=...)``) stays bound: torch already behaves that way.
    """
    if not enabled or not dist.is_initialized() or dist.get_backend() != "nccl":
        yield None
        return
    world = dist.distributed_c10d._get_default_group()
    before = world.bound_device_id
    device = bind_world_device()
    try:
        yield device
    finally:
        world.bound_device_id = before


def group_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """Device collectives on ``group`` need: CUDA for NCCL, CPU otherwise."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _warm(group: dist.ProcessGroup, kind: str) -> None:
    """Set the communicator up now rather than inside the first micro-batch, with the collective
    the group runs (``kind``: "all-to-all" or "ring"), so NCCL connects exactly the peers and
    buffers that collective uses; checked, so a broken group fails here, not mid-step."""
    n = dist.get_world_size(group)
    me = dist.get_rank(group)
    device = group_device(group)
    if kind == "all-to-all":
        send = torch.full((n,), float(me), device=device)
        got = torch.empty_like(send)
        comm().all_to_all_single(got, send, group)
        expected = list(range(n))
    else:
        from megatron_hsp.runtime.ring import ring_shift

        got = ring_shift(torch.full((1,), float(me), device=device), group)
        expected = [(me - 1) % n]
    if [int(x) for x in got.tolist()] != expected:
        raise RuntimeError(f"warm-up {kind} on a group of {n} returned {got.tolist()}")


def create_groups_from_megatron(
    gpus_per_node: int, sizes: Iterable[int] | None = None, **kwargs
) -> GroupRegistry:
    """``create_groups`` with tp/pp read from megatron ``parallel_state``, checked against it.

    Our slot layout must equal megatron's data-parallel-with-context-parallel group (the ranks the
    step's gradient all-reduce spans); a different rank order would put a plan's group on the wrong
    ranks, so a mismatch is an error rather than a silent mis-mapping.
    """
    from megatron.core import parallel_state as ps

    tp = ps.get_tensor_model_parallel_world_size()
    pp = ps.get_pipeline_model_parallel_world_size()
    reg = create_groups(
        gpus_per_node, tensor_parallel=tp, pipeline_parallel=pp, sizes=sizes, **kwargs
    )
    ours = reg.layout.slot_ranks(range(reg.layout.num_slots), *reg.layout.coords(reg.rank)[1:])
    theirs = dist.get_process_group_ranks(ps.get_data_parallel_group(with_context_parallel=True))
    if list(theirs) != ours:
        raise InputError(
            f"megatron's data x context parallel group on rank {reg.rank} is {theirs[:8]} but the "
            f"HSP slot layout (order tp-cp-ep-dp-pp) expects {ours[:8]}; HSP needs megatron's "
            "default rank order (expert parallelism splits the data-parallel ranks, so it "
            "leaves this group as it is)"
        )
    return reg
