"""Plan / MicroBatch / Group invariants, JSON round trip and fingerprint."""

from __future__ import annotations

import json

import pytest

from megatron_hsp.planner import Cluster, Group, MicroBatch, Plan, PlanError
from megatron_hsp.planner.cost.costmodel import flexsp_cost_model


def _mixed_plan() -> Plan:
    # 8 ranks, one node: sizes {4, 2, 1, 1}, then a second micro-batch with one group of 8.
    mb0 = MicroBatch(
        (
            Group((0, 1, 2, 3), (0,), (4096,), 10.0),
            Group((4, 5), (1, 2), (100, 200), 5.0),
            Group((6,), (3,), (50,), 1.0),
            Group((7,), (), (), 0.0),
        ),
        est_ms=10.0,
    )
    mb1 = MicroBatch((Group(tuple(range(8)), (4,), (8192,), 20.0),), est_ms=20.0)
    return Plan(8, 8, (mb0, mb1), cost_model="test", est_step_ms=30.0, solver="highs")


LENGTHS = [4096, 100, 200, 50, 8192]


def test_valid_plan_passes_and_reports_sizes() -> None:
    plan = _mixed_plan().validate(LENGTHS, world_size=8)
    assert plan.num_sequences == 5
    assert plan.group_sizes_used == [1, 2, 4, 8]
    assert plan.microbatches[0].group_of(5).ranks == (4, 5)
    assert [g.comm for g in plan.microbatches[0].groups] == ["a2a", "a2a", "none", "none"]


def test_json_round_trip_matches_contract_keys() -> None:
    plan = _mixed_plan()
    d = json.loads(plan.to_json())
    assert set(d) >= {
        "world_size",
        "gpus_per_node",
        "cost_model",
        "est_step_ms",
        "lower_bound_ms",
        "solve_ms",
        "solver",
        "status",
        "microbatches",
    }
    g = d["microbatches"][0]["groups"][0]
    assert set(g) == {"size", "ranks", "comm", "seq_ids", "lengths", "est_ms"}
    assert Plan.from_json(plan.to_json()) == plan


def test_fingerprint_ignores_estimates_but_not_layout() -> None:
    plan = _mixed_plan()
    retimed = Plan.from_dict({**plan.to_dict(), "est_step_ms": 99.0, "solve_ms": 5.0})
    assert retimed.fingerprint() == plan.fingerprint()
    d = plan.to_dict()
    d["microbatches"][0]["groups"][1]["seq_ids"] = [2, 1]
    d["microbatches"][0]["groups"][1]["lengths"] = [200, 100]
    assert Plan.from_dict(d).fingerprint() != plan.fingerprint()


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda d: d["microbatches"][0]["groups"].pop(), r"ranks \[7\] are in no group"),
        (
            lambda d: d["microbatches"][0]["groups"][1].update(ranks=[3, 4]),
            "is not a legal block",
        ),
        (
            lambda d: d["microbatches"][1]["groups"][0].update(seq_ids=[3], lengths=[50]),
            "scheduled more than once",
        ),
        (
            lambda d: d["microbatches"][0]["groups"][2].update(lengths=[51]),
            "has length 51 in the plan but 50 in the batch",
        ),
        (lambda d: d.update(microbatches=[]), "no micro-batches"),
        (lambda d: d.update(status="great"), "status 'great'"),
    ],
)
def test_broken_plans_name_the_problem(mutate, message: str) -> None:
    d = _mixed_plan().to_dict()
    mutate(d)
    with pytest.raises(PlanError, match=message):
        Plan.from_dict(d).validate(LENGTHS)


def test_missing_sequence_and_world_size_mismatch() -> None:
    with pytest.raises(PlanError) as err:
        _mixed_plan().validate([*LENGTHS, 7], world_size=16)
    text = str(err.value)
    assert "sequences [5] are not scheduled" in text
    assert "plan is for 8 sequence-parallel ranks but 16 are running" in text


def test_memory_check_uses_cost_model() -> None:
    cost = flexsp_cost_model("flexsp-gpt-7b", world_size=8, max_seq_k=192, memory_cap_gb=30)
    cap1 = cost.capacity(1)
    ok = Plan(8, 8, (MicroBatch((Group(tuple(range(8)), (0,), (cap1,)),)),))
    ok.validate([cap1], memory=cost)
    too_long = Plan(
        8, 8, (MicroBatch((Group((0,), (0,), (cap1 + 1,)), *[Group((r,)) for r in range(1, 8)])),)
    )
    with pytest.raises(PlanError, match=f"length {cap1 + 1} does not fit a group of 1"):
        too_long.validate([cap1 + 1], memory=cost)


def test_from_dict_reports_missing_field_and_size_mismatch() -> None:
    with pytest.raises(PlanError, match="lacks the field 'microbatches'"):
        Plan.from_dict({"world_size": 8, "gpus_per_node": 8})
    d = _mixed_plan().to_dict()
    d["microbatches"][0]["groups"][0]["size"] = 2
    with pytest.raises(PlanError, match="group size 2 does not match its 4 ranks"):
        Plan.from_dict(d)


def test_plan_cluster_shape_errors_are_reported() -> None:
    plan = Plan(12, 8, (MicroBatch((Group(tuple(range(12))),)),))
    assert any("not a multiple of --gpus-per-node 8" in p for p in plan.problems())


def test_cluster_property() -> None:
    assert _mixed_plan().cluster == Cluster(8, 8)
