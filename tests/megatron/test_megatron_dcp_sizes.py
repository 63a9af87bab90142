"""``--hsp-plan-method megatron-dcp`` trains at every group size, as pure ring groups.

Megatron's dynamic context parallelism runs ring attention only (split 1 x d). A megatron-dcp
run pre-creates, plans, prices and checks pure-ring groups at every size, from one rule
(``HeadSpace.ring_only``, set by ``run_spec.method_heads`` from the plan method), so it trains
on models whose heads would split the same sizes over Ulysses (8 heads: 2 and 4 are Ulysses
sizes, which the flags used to refuse for megatron-dcp). An hsp run keeps the Ulysses split.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from megatron_hsp.megatron.config import validate_hsp_args
from megatron_hsp.megatron.refusals import HSPArgsError
from megatron_hsp.planner import run_spec
from megatron_hsp.planner.cost.costmodel import load_cost_model
from megatron_hsp.planner.errors import InputError
from megatron_hsp.planner.groupspace import (
    Cluster,
    HeadSpace,
    communicators_per_rank,
    group_families,
)
from megatron_hsp.planner.run_spec import check_method_sizes, method_heads
from megatron_hsp.testing.mutations import SPLIT_MUTATIONS
from tests.helpers.megatron_args import parse

BASE = [
    *("--num-attention-heads", "8", "--global-batch-size", "64", "--seq-length", "4096"),
    *("--eval-iters", "0", "--attention-dropout", "0", "--hsp"),
]
TINY = {
    "name": "tiny-ulysses-only",
    "coefficients": {
        "attn_ms_per_token2": 5.0e-5,
        "linear_ms_per_token": 0.12,
        "group_fixed_ms": 30.0,
        "a2a_ms_per_token": {2: 0.03, 4: 0.04},
        "tokens_per_rank": 64,
        "heads": [8, 8],
    },
}


def test_the_method_chooses_the_split_in_one_place():
    """megatron-dcp: 1 x d at every size, whatever the heads; hsp: the largest Ulysses degree."""
    model = HeadSpace.from_model(32, 8, 1)
    dcp = method_heads(model, "megatron-dcp")
    assert dcp is not None and dcp.ring_only and dcp.heads == model.heads
    assert [dcp.split(d) for d in (1, 2, 4, 8, 16, 32, 64)] == [
        (1, 1), (1, 2), (1, 4), (1, 8), (1, 16), (1, 32), (1, 64),
    ]  # fmt: skip
    for method in ("hsp", "static-4", "batchada", "static-best"):
        assert method_heads(model, method) is model
    assert [model.split(d) for d in (2, 4, 64)] == [(2, 1), (4, 1), (32, 2)]
    assert method_heads(None, "megatron-dcp") is None
    # Everything that reads the split follows: pure ring reuses the block (one family, one
    # communicator per size), and a Ulysses split is no longer runnable on such a run.
    assert group_families(Cluster(8, 8), 4, dcp) == [[(0, 1, 2, 3), (4, 5, 6, 7)]]
    assert communicators_per_rank([1, 2, 4, 8], dcp) == 3
    assert "pure ring" in (dcp.split_problem(4, 4, 1) or "")
    assert dcp.split_problem(4, 1, 4) is None


def test_flags_accept_megatron_dcp_at_ulysses_sizes_and_note_the_ring():
    """8 heads over sizes 2 and 4 (Ulysses sizes): accepted, noted as pure ring; hsp's run of
    the same flags notes no ring (its groups are Ulysses)."""
    argv = [*BASE, "--hsp-group-sizes", "1,2,4"]
    dcp = validate_hsp_args(
        parse([*argv, "--hsp-plan-method", "megatron-dcp"], world_size=4), env={}
    )
    assert dcp.group_sizes == (1, 2, 4)
    assert any("group sizes [2, 4] run pure ring attention" in n for n in dcp.notes), dcp.notes
    hsp = validate_hsp_args(parse(argv, world_size=4), env={})
    assert not any("ring attention" in n for n in hsp.notes), hsp.notes


def test_a_32_head_model_trains_megatron_dcp_at_every_size():
    """The case the issue names: 32 heads on 32 slots, every size a Ulysses size for hsp."""
    argv = [
        *("--num-attention-heads", "32", "--global-batch-size", "64", "--seq-length", "4096"),
        *("--eval-iters", "0", "--attention-dropout", "0", "--hsp"),
        *("--hsp-plan-method", "megatron-dcp", "--hsp-group-sizes", "pow2"),
    ]
    cfg = validate_hsp_args(parse(argv, world_size=32), env={"LOCAL_WORLD_SIZE": "8"})
    assert cfg.group_sizes == (1, 2, 4, 8, 16, 32)


def test_refused_only_where_the_ring_cannot_run_or_be_priced(tmp_path):
    """A ring degree past the runtime's support, and a cost model without ring-step figures,
    are refused in one line naming the flag and what works."""
    space = method_heads(HeadSpace(8, 8, max_ring=2), "megatron-dcp")
    with pytest.raises(InputError, match=r"group sizes \[4\] .* --hsp-group-sizes 1,2$"):
        check_method_sizes("megatron-dcp", [1, 2, 4], 4, space)
    check_method_sizes("megatron-dcp", [1, 2], 2, space)  # runs: no refusal
    path = tmp_path / "cost.json"
    path.write_text(json.dumps(TINY))
    argv = [*BASE, "--hsp-group-sizes", "1,2,4", "--hsp-cost-model", str(path)]
    with pytest.raises(HSPArgsError, match=r"ring_step_ms_per_token for group sizes \[2, 4\]"):
        validate_hsp_args(parse([*argv, "--hsp-plan-method", "megatron-dcp"], world_size=4), {})
    validate_hsp_args(parse(argv, world_size=4), env={})  # hsp prices them as Ulysses: fine


def test_refused_where_megatron_cores_scheduler_has_no_group():
    """megatron-core's scheduler may use every power of two up to the slots
    (``run_spec.megatron_dcp_sizes``): a run missing one, or whose slots are no power of two,
    would stop at a plan using it, so it is refused at start-up, naming what works."""
    argv = [*BASE, "--hsp-plan-method", "megatron-dcp"]
    with pytest.raises(HSPArgsError, match=r"no groups of \[8\] .* --hsp-group-sizes pow2"):
        validate_hsp_args(parse([*argv, "--hsp-group-sizes", "1,2,4"]), env={})
    with pytest.raises(HSPArgsError, match=r"megatron-dcp: megatron-core's scheduler .* 6 is"):
        validate_hsp_args(parse(argv, world_size=6), env={})
    assert validate_hsp_args(parse(argv), env={}).group_sizes == (1, 2, 3, 4, 5, 6, 7, 8)


def _registry(heads: HeadSpace, sizes: tuple[int, ...]):
    """A ``GroupRegistry`` as ``create_groups`` describes it (no process group needed for the
    agreement's checks, which read its sizes and split only)."""
    from megatron_hsp.runtime.groups import GroupRegistry, RankLayout

    return GroupRegistry(
        cluster=Cluster(4, 4), layout=RankLayout(4), rank=0, sizes=sizes, heads=heads
    )


def _check_plan_registry_and_agreement() -> None:
    """megatron-core's scheduler's plan records 1 x d; the agreement accepts it against the
    registry a megatron-dcp run makes (``run_spec.method_heads``, read through its module so a
    plant of it is seen) and refuses it against hsp's, naming the splits."""
    from megatron_hsp.evaluation.torch_side.dcp_baseline import megatron_dcp_plan
    from megatron_hsp.runtime.agreement import executable_problems

    ring = {"ring_step_ms_per_token": {2: 0.02, 4: 0.02}}
    spec = {**TINY, "coefficients": {**TINY["coefficients"], **ring}}
    cost = load_cost_model(spec, world_size=4, gpus_per_node=4)
    lengths = np.array([200, 120, 60, 60, 30, 12, 7])
    plan = megatron_dcp_plan(lengths, cost, Cluster(4, 4))
    model = HeadSpace.from_model(8, 8, 1)
    dcp = run_spec.method_heads(model, "megatron-dcp")
    groups = [g for mb in plan.microbatches for g in mb.groups]
    assert {g.size for g in groups} >= {1, 4}
    assert all((g.ulysses, g.ring) == (1, g.size) for g in groups)
    sizes = (1, 2, 4)
    ok = executable_problems(plan, _registry(dcp, sizes), num_attention_heads=8)
    assert ok == [], ok
    bad = executable_problems(plan, _registry(model, sizes), num_attention_heads=8)
    assert any("(4, 1, 4)" in p and "pre-created" in p for p in bad), bad
    # 6 heads: hsp would run 4 as 2 x 2; the ring-only registry was still made for these heads.
    six = run_spec.method_heads(HeadSpace.from_model(6, 6, 1), "megatron-dcp")
    ok = executable_problems(plan, _registry(six, sizes), num_attention_heads=6)
    assert ok == [], ok


def test_the_plan_the_pricing_and_the_agreement_agree_on_pure_ring():
    _check_plan_registry_and_agreement()


def test_a_registry_made_with_hsps_split_is_caught():
    """The plant ``method-heads-ignore-the-method`` (``mutations.SPLIT_MUTATIONS``: the old
    runtime's one split per size from the heads) fails the check above."""
    (mutation,) = SPLIT_MUTATIONS
    planted = mutation.plant()
    try:
        with pytest.raises(AssertionError, match="differ from the splits"):
            _check_plan_registry_and_agreement()
        assert planted.calls() > 0
    finally:
        planted.undo()
    _check_plan_registry_and_agreement()  # undone


@pytest.mark.slow
@pytest.mark.dist
def test_megatron_dcp_trains_at_ulysses_sizes_equal_to_the_stock_path():
    """4 gloo ranks, Megatron's own train_step (``selftest --megatron``'s loop), 8 heads over
    groups of 2 and 4: megatron-dcp trains them as pure ring (1 x d), hsp on the same batches
    as Ulysses (d x 1), each equal per parameter and loss to stock megatron-core."""
    from megatron_hsp.testing.megatron_loop import LoopOptions, run_megatron_loop

    dcp, hsp = run_megatron_loop(
        4, (LoopOptions(plan_method="megatron-dcp"), LoopOptions()), steps=3, timeout_s=600
    )
    for e in (dcp, hsp):
        print(f"{e['options']['plan_method']}: worst / tolerance {e['margin']:.3f}")
        assert e["ok"], e["failures"]
        assert e["margin"] < 0.5
    assert [s["fingerprint"] for s in dcp["steps"]] == [s["fingerprint"] for s in hsp["steps"]]
    assert {s["plan_method"] for s in dcp["steps"]} == {"megatron-dcp"}

    def splits(entry: dict) -> set[tuple[int, int, int]]:
        return {
            (g["size"], g["ulysses"], g["ring"])
            for s in entry["steps"]
            for mb in s["layouts"]
            for g in mb
            if g["size"] > 1
        }

    assert splits(dcp) and all(u == 1 and r == d for d, u, r in splits(dcp)), splits(dcp)
    assert (4, 1, 4) in splits(dcp)  # a size the heads would split over Ulysses
    assert splits(hsp) and all(u == d and r == 1 for d, u, r in splits(hsp)), splits(hsp)
