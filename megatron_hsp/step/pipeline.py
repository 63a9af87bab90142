"""The per-step pipeline: sampler -> plan (background) -> agreement -> this rank's documents.

Every rank runs the same seeded sampler (it reads only lengths, so this is cheap and needs no
communication); only rank 0 runs the planner process, and the plan of each step is broadcast
(``runtime.agreement``), because a time-limited MILP solve is not reproducible across ranks.
The plan of step t+1 is submitted when step t begins, so it is solved while step t trains.

When the plan is agreed it is checked once: its Ulysses x ring splits are recorded
(``agreement.resolve_splits``) and everything that decides whether this runtime can execute it
(``agreement.executable_problems``: plan invariants against this rank's batch, pre-created sizes,
splits against the registry's sub-groups) is agreed across ranks, so a bad plan stops every rank
with one message. Each rank then reads only the documents its own groups train.

``build_training_step`` is the one place a run's training step is set up from its run
description (process groups, planner spec, rank 0's planner) and ``build_step_pipeline`` the one
place a pipeline is assembled; the Megatron ``pretrain()`` hooks (``megatron/hooks.py``) and the
demo's own loop (``commands/demo_worker.py``) both call them.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from megatron_hsp.planner.errors import PlanError
from megatron_hsp.planner.plan import Plan
from megatron_hsp.planner.search.settings import RunSpec
from megatron_hsp.step.documents import DocumentReader
from megatron_hsp.step.planner_service import PlannerService, PlannerSpec
from megatron_hsp.step.sampler import DocumentBatch, GlobalBatchSampler

if TYPE_CHECKING:  # the runtime layer imports torch; the pipeline reaches it only at run time
    from megatron_hsp.planner.groupspace import HeadSpace
    from megatron_hsp.runtime.dispatch import GlobalBatch
    from megatron_hsp.runtime.groups import GroupRegistry


@dataclass
class PreparedStep:
    """Everything one rank needs to train one step."""

    step: int
    batch: DocumentBatch
    plan: Plan
    tokens: GlobalBatch  # this slot's share: every length, tokens of its own groups' sequences
    solve_s: float
    wait_s: float
    prepare_s: float


class StepPipeline:
    """Yields ``PreparedStep``s; ``planner`` is given on the planning rank only (None elsewhere)."""

    def __init__(
        self,
        sampler: GlobalBatchSampler,
        reader: DocumentReader,
        *,
        slot: int,
        world_size: int,
        planner: PlannerService | None,
        is_planning_rank: bool,
        agree: Any = None,  # (plan_or_None) -> Plan, collective; None: single process
        registry: GroupRegistry | None = None,  # records and checks splits; None: plan as is
        lookahead: int = 1,
    ) -> None:
        self.sampler = sampler
        self.reader = reader
        self.slot = slot
        self.world_size = world_size
        self.planner = planner
        self.is_planning_rank = is_planning_rank
        self.agree = agree
        self.registry = registry
        self.lookahead = max(1, lookahead)
        self._queue: deque[tuple[DocumentBatch, dict[str, Any]]] = deque()
        if is_planning_rank and planner is None:
            raise ValueError("the planning rank needs a PlannerService")

    def _draw(self) -> None:
        state = self.sampler.state_dict()  # the state *before* this batch: what resume needs
        batch = self.sampler.next_batch()
        self._queue.append((batch, state))
        if self.is_planning_rank:
            assert self.planner is not None
            self.planner.submit(batch.step, batch.lengths)

    def state_dict(self) -> dict[str, Any]:
        """Sampler state before the first batch not yet handed out (exact resume point)."""
        return self._queue[0][1] if self._queue else self.sampler.state_dict()

    def report(self) -> str:
        """Sampler counters for the batches handed out so far (not the prefetched ones)."""
        return self.sampler.report(self.state_dict())

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self._queue:
            raise RuntimeError("load the pipeline state before the first step")
        self.sampler.load_state_dict(state)

    def close(self) -> None:
        """Stop the planner process (planning rank; a no-op elsewhere)."""
        if self.planner is not None:
            self.planner.close()

    def prime(self) -> None:
        """Submit the first plan(s) now, e.g. before building the model, so that the planner
        process starts and solves step 0 while the model is built."""
        while len(self._queue) < self.lookahead:
            self._draw()

    def next_step(self) -> PreparedStep:
        t0 = time.perf_counter()
        self.prime()
        batch, _ = self._queue.popleft()
        self._draw()  # step t+1 is planned while step t trains
        solve_s = wait_s = 0.0
        plan: Plan | None = None
        failure: Exception | None = None
        if self.is_planning_rank:
            assert self.planner is not None
            try:
                res = self.planner.result(batch.step)
                plan, solve_s, wait_s = res.plan, res.solve_s, res.wait_s
            except Exception as exc:
                if self.agree is None:
                    raise
                failure = exc  # broadcast in the plan's place: every rank stops with it
        if self.agree is not None:
            plan = self.agree(failure if failure is not None else plan)
        assert plan is not None
        problems = plan.problems(lengths=batch.lengths, world_size=self.world_size)
        if self.registry is not None:
            from megatron_hsp.runtime.agreement import executable_problems, resolve_splits

            plan = resolve_splits(plan, self.registry)
            problems = executable_problems(plan, self.registry, lengths=batch.lengths)
        if self.agree is not None:
            # Each rank checks the plan against ITS batch; the verdict is agreed, so a rank whose
            # batch differs stops everyone with one message instead of raising alone.
            from megatron_hsp.runtime.agreement import agree_no_problems

            agree_no_problems(problems)
        elif problems:
            raise PlanError(problems)
        tokens = self.reader.batch_for_rank(batch, plan, self.slot)
        return PreparedStep(
            step=batch.step,
            batch=batch,
            plan=plan,
            tokens=tokens,
            solve_s=solve_s,
            wait_s=wait_s,
            prepare_s=time.perf_counter() - t0,
        )


def build_step_pipeline(
    sampler: GlobalBatchSampler,
    reader: DocumentReader,
    registry: GroupRegistry,
    *,
    rank: int,
    planner: PlannerService | None,
    exchange_timeout_s: float | None = None,
) -> StepPipeline:
    """The step pipeline of one rank of a distributed run (every rank calls it, alike).

    Every rank samples the same global batches (``sampler``: lengths only, seeded, resumed by
    its caller); global rank 0 runs ``planner`` (None on the other ranks) and broadcasts each
    plan, which is then checked once against ``registry`` (splits recorded, executability
    agreed); each rank reads the documents of its own groups only (``reader``). The Megatron
    hooks (training and each evaluation split) and the demo all build their pipelines here.
    """
    from functools import partial

    from megatron_hsp.runtime.agreement import agree_on_plan

    planning = rank == 0
    if planning and planner is None:
        raise ValueError("global rank 0 plans: it needs the planner")
    return StepPipeline(
        sampler,
        reader,
        slot=registry.slot,
        world_size=registry.layout.num_slots,
        planner=planner if planning else None,
        is_planning_rank=planning,
        agree=partial(agree_on_plan, mode="broadcast")
        if exchange_timeout_s is None
        else partial(agree_on_plan, mode="broadcast", timeout_s=exchange_timeout_s),
        registry=registry,
    )


# The planner factory of a baseline plan method (``--hsp-plan-method``), by name: the step
# pipeline does not import the evaluation package.
METHOD_PLANNER = "megatron_hsp.evaluation.torch_side.methods:planner_for_spec"
_RUN_PLANNER: Any = object()  # ``TrainingStep.pipeline``'s default: the run's own planner


@dataclass
class TrainingStep:
    """What every step pipeline of one run shares: the process groups over the run's group
    sizes, the planner's spec, and (global rank 0, once started) the planner process."""

    registry: GroupRegistry
    spec: PlannerSpec
    rank: int
    planner: PlannerService | None = None
    # How long a step waits for its plan (--hsp-plan-timeout-s; -1: the service's default);
    # known on every rank, which bound their wait in the plan exchange by it.
    plan_timeout_s: float = -1.0

    def start_planner(
        self,
        *,
        background: bool = True,
        sync_flag: str | None = None,
        plan_timeout_s: float | None = None,
    ) -> None:
        """Start the planner on global rank 0 (the others receive its plans); late, so that
        the checks before it (data, samplers) stop a run before any process is started. Every
        rank calls it: ``plan_timeout_s`` is recorded on each."""
        if plan_timeout_s is not None:
            self.plan_timeout_s = plan_timeout_s
        if self.rank == 0 and self.planner is None:
            self.planner = PlannerService(
                self.spec,
                background=background,
                sync_flag=sync_flag,
                plan_deadline_s=self.plan_timeout_s,
            )

    @property
    def exchange_timeout_s(self) -> float:
        """The ranks' bound on the plan exchange: the plan deadline plus its margin."""
        from megatron_hsp.step.planner_service import (
            default_plan_deadline_s,
            plan_exchange_timeout_s,
        )

        deadline = (
            default_plan_deadline_s(self.spec)
            if self.plan_timeout_s == -1.0
            else self.plan_timeout_s
        )
        return plan_exchange_timeout_s(deadline)

    def pipeline(
        self, sampler: GlobalBatchSampler, reader: DocumentReader, planner: Any = _RUN_PLANNER
    ) -> StepPipeline:
        """A pipeline over ``sampler``, planned by ``planner`` (default: the run's; an
        evaluation split passes its own view of it, None off rank 0)."""
        chosen = self.planner if planner is _RUN_PLANNER else planner
        return build_step_pipeline(
            sampler,
            reader,
            self.registry,
            rank=self.rank,
            planner=chosen,
            exchange_timeout_s=self.exchange_timeout_s,
        )


def build_training_step(
    run: RunSpec,
    cost_model: str | Mapping[str, Any],
    *,
    rank: int,
    memory_cap_gb: float | None = None,
    heads: HeadSpace | None = None,
    ring_routes: Mapping[int, str] | None = None,
    doc_multiples: Mapping[int, int] | None = None,
    method: str = "hsp",
) -> TrainingStep:
    """Collective: set up one run's training step from its run description.

    Creates the process groups for the sizes the run plans with (lazily: a size's communicators
    are created the first time an agreed plan uses it; ``heads`` adds each block's Ulysses/ring
    sub-groups) over Megatron's data x context-parallel ranks, and the planner's spec for the
    slots, the longest document and ``cost_model`` (``planner_spec``; ``ring_routes``: the
    attention route each ring or hybrid group size takes, which the planner prices). Every
    rank calls it alike.
    """
    from megatron_hsp.runtime.groups import create_groups_from_megatron

    registry = create_groups_from_megatron(
        run.dims.slots_per_node, sizes=run.planner.sizes, heads=heads, lazy=True
    )
    spec = planner_spec(run, cost_model, memory_cap_gb, ring_routes, doc_multiples, method=method)
    return TrainingStep(registry, spec, rank)


def planner_spec(
    run: RunSpec,
    cost_model: str | Mapping[str, Any],
    memory_cap_gb: float | None = None,
    ring_routes: Mapping[int, str] | None = None,
    doc_multiples: Mapping[int, int] | None = None,
    *,
    method: str = "hsp",
) -> PlannerSpec:
    """What the planner (its process in training, ``plan``/``bench`` offline) builds the cost
    model and plans from: the one place a run description becomes a ``PlannerSpec``.

    ``method`` other than hsp (``--hsp-plan-method``, an A/B on the same batches): the planner
    process plans with that baseline (``evaluation/torch_side/methods.planner_for_spec``)."""
    factory = {} if method == "hsp" else {"factory": METHOD_PLANNER, "options": {"method": method}}
    return PlannerSpec(
        cost_model=cost_model,
        world_size=run.dims.slots,
        gpus_per_node=run.dims.slots_per_node,
        max_seq=run.max_seq,
        memory_cap_gb=memory_cap_gb,
        settings=run.planner,
        ring_routes=dict(ring_routes) if ring_routes else None,
        doc_multiples=dict(doc_multiples) if doc_multiples else None,
        **factory,
    )
