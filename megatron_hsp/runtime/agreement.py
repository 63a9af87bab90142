"""Plan agreement: every rank must execute the same plan, or fail loudly -- never hang.

Two ranks running different plans issue unmatched collectives and hang until a NCCL timeout with
no hint of why. Before a step the ranks therefore either receive the plan from one rank
(``mode="broadcast"``) or compare ``Plan.fingerprint()`` with one all-gather (``mode="verify"``,
for planners that run deterministically on every rank). Both are a single collective every rank
calls unconditionally, after which every rank holds the same information and therefore raises the
same error on a mismatch or an unexecutable plan.
"""

from __future__ import annotations

import dataclasses
import json
from collections import defaultdict
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from megatron_hsp.planner import groupspace
from megatron_hsp.planner.errors import HSPError, InputError, PlanError
from megatron_hsp.planner.groupspace import HeadSpace
from megatron_hsp.planner.plan import Plan
from megatron_hsp.planner.search.settings import DEFAULT_PLAN_TIMEOUT_S, PLAN_EXCHANGE_MARGIN_S
from megatron_hsp.runtime.groups import GroupRegistry


class PlanMismatchError(HSPError):
    """Ranks hold different plans for the same step."""


class PlanningFailedError(HSPError):
    """The planning rank could not produce this step's plan; raised on every rank alike."""


class BatchMismatchError(HSPError):
    """The agreed plan does not fit some rank's batch; raised on every rank alike."""


def agree_on_plan(
    plan: Plan | BaseException | None,
    *,
    mode: str = "verify",
    src: int = 0,
    group: dist.ProcessGroup | None = None,
    timeout_s: float = DEFAULT_PLAN_TIMEOUT_S + PLAN_EXCHANGE_MARGIN_S,
) -> Plan:
    """Return the plan all ranks of ``group`` (default: world) will execute.

    ``broadcast``: ``plan`` matters only on global rank ``src`` (others may pass None) and is sent
    to all. When ``src`` passes the exception its planner raised instead of a plan, the message is
    broadcast in the plan's place and every rank raises ``PlanningFailedError`` with it, so no
    rank is left waiting in the broadcast for a plan that never comes.
    ``verify``: every rank passes its own plan; fingerprints are all-gathered and compared;
    on a mismatch every rank raises ``PlanMismatchError`` naming the ranks that disagree.

    The broadcast is two tensor broadcasts (length, then the plan's JSON bytes), each waited
    for at most ``timeout_s``: the planning rank answers within its plan deadline (a late plan
    is replaced by the fallback plan, ``step/planner_service.py``), so a rank still waiting past
    that bound names the planning rank as stopped or wedged and stops, in one line, instead of
    waiting in an object collective until Megatron's distributed timeout.
    """
    if mode == "broadcast":
        box: list[Any] = [None]
        if dist.get_rank() == src and isinstance(plan, BaseException):
            box = [{"__error__": f"{type(plan).__name__}: {plan}"}]
        elif dist.get_rank() == src and plan is not None:
            box = [plan.to_dict()]
        box = [_broadcast_json(box[0], src=src, group=group, timeout_s=timeout_s)]
        if box[0] is None:
            raise PlanMismatchError(f"rank {src} had no plan to broadcast")
        if "__error__" in box[0]:
            raise PlanningFailedError(
                f"planning failed on rank {src}, stopping every rank: {box[0]['__error__']}"
            )
        return Plan.from_dict(box[0])
    if isinstance(plan, BaseException):
        raise plan
    if mode != "verify":
        raise ValueError(f"plan agreement mode {mode!r}: use 'broadcast' or 'verify'")
    mine = plan.fingerprint() if plan is not None else "<no plan>"
    everyone = _all_gather_text(mine, group, timeout_s)  # bounded, as the broadcast is
    by_print: dict[str, list[int]] = defaultdict(list)
    ranks = dist.get_process_group_ranks(group) if group is not None else range(len(everyone))
    for r, fp in zip(ranks, everyone, strict=True):
        by_print[str(fp)].append(r)
    if len(by_print) > 1:
        ordered = sorted(by_print.items(), key=lambda kv: (-len(kv[1]), kv[1][0]))
        parts = [f"ranks {_ranks(rs)} hold plan {fp[:12]}" for fp, rs in ordered]
        raise PlanMismatchError(
            "ranks disagree on the plan of this step: "
            + "; ".join(parts)
            + ". Plan on one rank and broadcast it (mode='broadcast'), or make the planner "
            "deterministic (same lengths, seed, solver and time limit on every rank)"
        )
    assert plan is not None
    return plan


def _device(group: dist.ProcessGroup | None) -> torch.device:
    """Where a collective's tensors live: the current GPU under NCCL, else the CPU."""
    backend = str(dist.get_backend(group))
    if "nccl" in backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _bounded(work: Any, timeout_s: float, what: str) -> None:
    """Wait for an async collective at most ``timeout_s``; past it, one line naming what."""
    try:
        work.wait(timeout=timedelta(seconds=timeout_s))
    except RuntimeError as exc:
        first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else "timed out"
        raise PlanningFailedError(
            f"rank {dist.get_rank()}: {what} did not complete within {timeout_s:.0f} s ({first}); "
            "the planning rank or a peer is stopped, wedged or gone. Stopping this rank"
        ) from None


def bounded_all_gather(
    out: list[torch.Tensor],
    tensor: torch.Tensor,
    *,
    timeout_s: float,
    what: str,
    group: dist.ProcessGroup | None = None,
) -> None:
    """``dist.all_gather`` waited for at most ``timeout_s``: past it, every waiting rank stops
    with one line naming ``what`` instead of hanging until the distributed timeout."""
    _bounded(dist.all_gather(out, tensor, group=group, async_op=True), timeout_s, what)


def _broadcast_json(
    value: Any, *, src: int, group: dist.ProcessGroup | None, timeout_s: float
) -> Any:
    """``value`` (JSON-able, meaningful on ``src`` only) on every rank: its length, then its
    UTF-8 bytes, as tensors, each broadcast waited for at most ``timeout_s``."""
    device = _device(group)
    mine = dist.get_rank() == src
    data = json.dumps(value).encode() if mine else b""
    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    _bounded(dist.broadcast(size, src=src, group=group, async_op=True), timeout_s, "the plan")
    if mine:
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
    else:
        buf = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    _bounded(dist.broadcast(buf, src=src, group=group, async_op=True), timeout_s, "the plan")
    return json.loads(bytes(buf.cpu().numpy().tobytes()).decode())  # src too: one form


#: Bytes of each rank's first problem carried by ``agree_no_problems`` (a sentence or two).
PROBLEM_BYTES = 1024


def _all_gather_text(text: str, group: dist.ProcessGroup | None, timeout_s: float) -> list[str]:
    """Every rank's ``text`` (cut to ``PROBLEM_BYTES``), one fixed-size tensor all-gather
    waited for at most ``timeout_s``."""
    device = _device(group)
    data = text.encode()[: PROBLEM_BYTES - 2]
    buf = torch.zeros(PROBLEM_BYTES, dtype=torch.uint8, device=device)
    buf[0], buf[1] = len(data) // 256, len(data) % 256
    if data:
        buf[2 : 2 + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    out = [torch.empty_like(buf) for _ in range(dist.get_world_size(group))]
    work = dist.all_gather(out, buf, group=group, async_op=True)
    _bounded(work, timeout_s, "the plan check")
    texts = []
    for t in out:
        raw = t.cpu().numpy().tobytes()
        n = raw[0] * 256 + raw[1]
        texts.append(raw[2 : 2 + n].decode(errors="replace"))
    return texts


def agree_no_problems(
    problems: Sequence[str],
    *,
    what: str = "the plan does not fit the batch",
    group: dist.ProcessGroup | None = None,
    timeout_s: float = DEFAULT_PLAN_TIMEOUT_S + PLAN_EXCHANGE_MARGIN_S,
) -> None:
    """Raise ``BatchMismatchError`` on EVERY rank when any rank reports a problem.

    One all-gather of each rank's first problem (empty when fine). Why: a check that fails on
    one rank alone (its batch differs from the one the plan was made for) would make that rank
    raise while the others enter the step's collectives and hang until the NCCL timeout.
    """
    everyone = _all_gather_text(str(problems[0]) if problems else "", group, timeout_s)
    ranks = dist.get_process_group_ranks(group) if group is not None else range(len(everyone))
    bad = [(r, p) for r, p in zip(ranks, everyone, strict=True) if p]
    if bad:
        shown = "; ".join(f"rank {r}: {p}" for r, p in bad[:4])
        raise BatchMismatchError(
            f"{what} on ranks {_ranks([r for r, _ in bad])}, stopping every rank: {shown}. Every "
            "rank must sample the same batches (same data, seed, --global-batch-size and resume "
            "state)"
        )


def resolve_splits(plan: Plan, registry: GroupRegistry) -> Plan:
    """``plan`` with every group's Ulysses x ring split recorded.

    A planner that knew the model's heads recorded each group's split (``Group.ulysses/ring``);
    one that did not (a cost model without heads) left 0, and the split is then the one the
    registry pre-created sub-groups for (``GroupRegistry.split``). Resolved once, when the plan
    is agreed, on every rank alike (it depends only on the agreed plan and the static setup);
    from there on dispatch and attention read the recorded split and nothing recomputes it.
    """
    if all(g.ulysses for mb in plan.microbatches for g in mb.groups):
        return plan
    microbatches = tuple(
        dataclasses.replace(
            mb,
            groups=tuple(
                g
                if g.ulysses
                else dataclasses.replace(
                    g, ulysses=registry.split(g.size)[0], ring=registry.split(g.size)[1]
                )
                for g in mb.groups
            ),
        )
        for mb in plan.microbatches
    )
    return dataclasses.replace(plan, microbatches=microbatches)


def executable_problems(
    plan: Plan,
    registry: GroupRegistry,
    *,
    num_attention_heads: int | None = None,
    num_query_groups: int | None = None,
    lengths: Sequence[int] | None = None,
) -> list[str]:
    """Why this runtime cannot execute ``plan``, in sentences (empty: it can).

    Checks the plan's own invariants, its world size against the running sequence-parallel world
    (data x context slots), that every group size has a pre-created process group, that every
    recorded Ulysses x ring split is the one the registry pre-created sub-groups for, and -- given
    the model's heads -- that every split can run.
    """
    n_slots = registry.layout.num_slots
    problems = plan.problems(lengths=lengths, world_size=n_slots)
    missing = [d for d in plan.group_sizes_used if not registry.has_size(d)]
    if missing:
        problems.append(
            f"group sizes {missing} have no pre-created process group (pre-created: "
            f"{list(registry.sizes)}); add them to --hsp-group-sizes or re-plan without them"
        )
    if plan.world_size == n_slots and plan.gpus_per_node != registry.cluster.gpus_per_node:
        # Different node size means different legal blocks; the plan's blocks may straddle nodes.
        bad = [
            g.ranks[0]
            for mb in plan.microbatches
            for g in mb.groups
            if not registry.cluster.is_aligned_block(g.ranks)
        ]
        if bad:
            problems.append(
                f"plan made for {plan.gpus_per_node} slots per node but the job has "
                f"{registry.cluster.gpus_per_node}; groups at slots {bad[:6]} straddle nodes"
            )
    wrong = sorted(
        {
            (g.size, g.ulysses, g.ring)
            for mb in plan.microbatches
            for g in mb.groups
            if g.ulysses
            and registry.has_size(g.size)
            and (g.ulysses, g.ring) != registry.split(g.size)
        }
    )
    if wrong:
        problems.append(
            f"groups (size, ulysses, ring) {wrong[:6]} differ from the splits the runtime "
            "pre-created sub-groups for (groupspace.HeadSpace.split); plan with a cost model of "
            "this model's heads"
        )
    if num_attention_heads is not None:
        problems += head_problems(
            plan.group_sizes_used,
            num_attention_heads,
            num_query_groups or num_attention_heads,
            registry.layout.tensor_parallel,
        )
        try:
            model: HeadSpace | None = HeadSpace.from_model(
                num_attention_heads, num_query_groups, registry.layout.tensor_parallel
            )
        except InputError:  # head_problems above already says why
            model = None
        ringed = [d for d in plan.group_sizes_used if model and model.split(d)[1] > 1]
        made_for = registry.heads.heads if registry.heads is not None else None
        if model is not None and ringed and made_for != model.heads:
            problems.append(
                f"group sizes {ringed} run ring attention for this model ({model.q_heads} query "
                f"heads per tensor-parallel rank) but the process groups were created for "
                f"heads {registry.heads}; create them with create_groups(..., heads=...) of the "
                "model's heads"
            )
    if registry.heads is not None:  # every split runs for the heads the groups were made for
        problems += groupspace.problems(plan, registry.heads)
    return problems


def check_executable(
    plan: Plan,
    registry: GroupRegistry,
    *,
    num_attention_heads: int | None = None,
    num_query_groups: int | None = None,
    lengths: Sequence[int] | None = None,
) -> None:
    """Raise ``PlanError`` unless this runtime can execute ``plan`` (``executable_problems``);
    the same on every rank alike, since it depends only on the agreed plan and the setup."""
    problems = executable_problems(
        plan,
        registry,
        num_attention_heads=num_attention_heads,
        num_query_groups=num_query_groups,
        lengths=lengths,
    )
    if problems:
        raise PlanError(problems)


def head_problems(
    sizes: Sequence[int], num_attention_heads: int, num_query_groups: int, tensor_parallel: int
) -> list[str]:
    """Group sizes whose Ulysses x ring split (``groupspace.HeadSpace.split``) cannot run.

    Every size splits (pure ring when the heads share no factor with it), so this reports only
    what ``groupspace`` rejects, e.g. heads that tensor parallelism cannot divide.
    """
    try:
        space = HeadSpace.from_model(num_attention_heads, num_query_groups, tensor_parallel)
    except InputError as exc:
        return [str(exc)]
    out = []
    for d in sizes:
        why = space.split_problem(d, *space.split(d))
        if why:
            out.append(f"group size {d}: {why}")
    return out


def _ranks(rs: list[int]) -> str:
    shown = ", ".join(str(r) for r in rs[:8])
    return f"[{shown}{', ...' if len(rs) > 8 else ''}]"
