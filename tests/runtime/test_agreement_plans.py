"""Plan agreement: identical plans pass; a mismatch or an unexecutable plan raises on EVERY rank
(never a hang). One 4-process spawn runs every scenario in turn."""

from __future__ import annotations

from datetime import timedelta

import pytest

from megatron_hsp.runtime.agreement import head_problems
from megatron_hsp.testing.manual_plan import manual_plan

LENGTHS = [9, 5, 3, 2, 1]
SCENARIOS = (
    "same",
    "broadcast",
    "mismatch",
    "world",
    "missing-size",
    "heads",
    "planner-error",
    "batch-differs",
    "recorded-split",
    "resolved",
)


def _plan(variant: int = 0):
    if variant == 0:
        return manual_plan(4, LENGTHS, [[(2, [0, 4]), (1, [1]), (1, [2, 3])]])
    return manual_plan(4, LENGTHS, [[(4, [0, 1, 2, 3, 4])]])


def _scenario(rank, scenario, reg):
    from megatron_hsp.runtime.agreement import agree_on_plan, check_executable

    if scenario == "same":
        plan = agree_on_plan(_plan(0), mode="verify")
        check_executable(plan, reg, num_attention_heads=8, num_query_groups=2, lengths=LENGTHS)
        return plan.fingerprint()
    if scenario == "broadcast":
        return agree_on_plan(_plan(0) if rank == 0 else None, mode="broadcast").fingerprint()
    if scenario == "mismatch":
        agree_on_plan(_plan(1 if rank == 2 else 0), mode="verify")
    if scenario == "world":
        plan = manual_plan(8, LENGTHS, [[(8, [0, 1, 2, 3, 4])]])
        check_executable(agree_on_plan(plan), reg)
    if scenario == "missing-size":
        check_executable(agree_on_plan(_plan(1)), reg)
    if scenario == "heads":
        check_executable(agree_on_plan(_plan(0)), reg, num_attention_heads=3, num_query_groups=1)
    if scenario == "planner-error":  # rank 0's planner raised: every rank stops with its message
        failure = ValueError("cost model exploded") if rank == 0 else None
        agree_on_plan(failure, mode="broadcast")
    if scenario == "batch-differs":  # rank 3 sampled another batch than the plan was made for
        from megatron_hsp.runtime.agreement import agree_no_problems

        plan = agree_on_plan(_plan(0) if rank == 0 else None, mode="broadcast")
        mine = [9, 5, 3, 2, 7] if rank == 3 else LENGTHS
        agree_no_problems(plan.problems(lengths=mine, world_size=4))
    if scenario == "recorded-split":  # the plan says ring 2; the registry made none for size 2
        plan = _with_split(_plan(0), 2, (1, 2))
        check_executable(agree_on_plan(plan), reg)
    if scenario == "resolved":  # unrecorded splits take the registry's (no heads: pure Ulysses)
        from megatron_hsp.runtime.agreement import resolve_splits

        plan = resolve_splits(agree_on_plan(_plan(0)), reg)
        check_executable(plan, reg, lengths=LENGTHS)
        return sorted({(g.size, g.ulysses, g.ring) for mb in plan.microbatches for g in mb.groups})
    return "no error"


def _with_split(plan, size, split):
    import dataclasses

    return dataclasses.replace(
        plan,
        microbatches=tuple(
            dataclasses.replace(
                mb,
                groups=tuple(
                    dataclasses.replace(g, ulysses=split[0], ring=split[1]) if g.size == size else g
                    for g in mb.groups
                ),
            )
            for mb in plan.microbatches
        ),
    )


def _worker(rank, world_size):
    import torch.distributed as dist

    from megatron_hsp.runtime.groups import create_groups

    reg = create_groups(4, sizes=[1, 2], timeout=timedelta(seconds=60))
    out = {}
    for scenario in SCENARIOS:
        try:
            out[scenario] = ("ok", _scenario(rank, scenario, reg))
        except Exception as exc:
            out[scenario] = (type(exc).__name__, str(exc))
        # if any rank hung in a scenario, this barrier (and the harness timeout) would expose it
        dist.barrier()
    return out


@pytest.fixture(scope="module")
def results():
    from megatron_hsp.testing.dist import raise_rank_errors, run_distributed

    return raise_rank_errors(run_distributed(_worker, 4, timeout_s=300))


@pytest.mark.spawns
@pytest.mark.dist
def test_same_plan_and_broadcast_agree(results):
    fp = _plan(0).fingerprint()
    assert [r["same"] for r in results] == [("ok", fp)] * 4
    assert [r["broadcast"] for r in results] == [("ok", fp)] * 4


@pytest.mark.spawns
@pytest.mark.dist
@pytest.mark.parametrize(
    ("scenario", "error", "text"),
    [
        ("mismatch", "PlanMismatchError", "ranks [2] hold plan"),
        ("planner-error", "PlanningFailedError", "rank 0, stopping every rank: ValueError: cost"),
        ("batch-differs", "BatchMismatchError", "on ranks [3], stopping every rank"),
        ("world", "PlanError", "plan is for 8 sequence-parallel ranks but 4 are running"),
        ("missing-size", "PlanError", "group sizes [4] have no pre-created process group"),
        ("heads", "PlanError", "group sizes [2] run ring attention for this model (3 query"),
        ("recorded-split", "PlanError", "groups (size, ulysses, ring) [(2, 1, 2)] differ"),
    ],
)
def test_bad_plan_raises_on_every_rank(results, scenario, error, text):
    got = [r[scenario] for r in results]
    assert {kind for kind, _ in got} == {error}, got
    assert all(text in msg for _, msg in got), got[0]


@pytest.mark.spawns
@pytest.mark.dist
def test_unrecorded_splits_resolve_to_the_registrys(results):
    assert [r["resolved"] for r in results] == [("ok", [(1, 1, 1), (2, 2, 1)])] * 4


def test_head_rules():
    assert head_problems([1, 2, 4, 8], 8, 2, 1) == []  # KV replicated for 4 and 8
    assert head_problems([2], 8, 2, 2) == []  # 4 q / 1 kv per tp rank
    assert head_problems([4], 24, 6, 1) == []  # 6 KV heads, group of 4: replicated twice
    # 6 query heads per tp rank: 4 runs as Ulysses 2 x ring 2, 5 as a pure ring of 5.
    assert head_problems([4, 3, 5], 12, 12, 2) == []
    (msg,) = head_problems([4], 12, 12, 5)
    assert "--num-attention-heads 12 is not divisible by --tensor-model-parallel-size 5" in msg
