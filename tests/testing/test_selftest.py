"""``megatron-hsp selftest``: every case (all size 1, one group of all, {4,2,1,1}, changing
layouts with empty groups, tp=2 x dynamic groups, ring and hybrid groups, 1-token documents, a
document exactly at the memory limit, learned absolute positions over hybrid groups) matches the
independent single-device reference on 4 and 8 gloo processes, and ``--mutations`` catches every
planted bug at both rank counts (the 8-process run checks its clean cases in the same spawn)."""

from __future__ import annotations

import json

import pytest

from megatron_hsp import cli
from megatron_hsp.testing.selftest import build_cases
from megatron_hsp.testing.tolerances import CPU

CASE_KEYS = {
    "name",
    "nproc",
    "group_sizes",
    "loss_abs_diff",
    "max_abs_grad_diff",
    "max_rel_grad_diff",
    "layouts",
}


def test_cases_cover_the_required_layouts():
    cases = {c.name: c for c in build_cases(8)}
    mixed = cases["mixed-sizes-in-one-microbatch"].plan()
    assert mixed.microbatches[0].group_sizes == [4, 2, 1, 1]
    layouts = cases["changing-layouts-and-empty-groups"].plan()
    assert [mb.group_sizes for mb in layouts.microbatches] == [[8], [4, 4], [1] * 8]
    assert any(not g.seq_ids for g in layouts.microbatches[-1].groups)
    assert cases["tp2-with-dynamic-groups"].tp == 2
    ring = cases["ring-and-hybrid-groups"].plan()
    assert [mb.group_sizes for mb in ring.microbatches] == [[6, 2], [3, 3, 1, 1], [5, 1, 2]]
    assert cases["tp2-ring-groups"].tp == 2
    assert cases["tp2-ring-groups"].plan().microbatches[0].group_sizes == [3, 1]
    assert 1 in cases["one-token-documents"].lengths
    at_limit = cases["document-at-memory-limit"]
    plan = at_limit.plan()
    group = plan.microbatches[0].groups[0]
    from megatron_hsp.testing.selftest import memory_limit_model

    cm = memory_limit_model(at_limit.tokens_per_rank, at_limit.slots)
    assert group.lengths == (cm.capacity(group.size),)  # exactly at the limit
    assert not cm.fits([group.lengths[0] + 1], group.size)


@pytest.mark.spawns
def test_bad_nproc_is_a_clear_error(capsys):
    assert cli.main(["selftest", "--nproc", "3"]) == 2
    assert "--nproc 3" in capsys.readouterr().err


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.parametrize("nproc", [4])
def test_selftest_matches_single_device(nproc):
    from megatron_hsp.testing.selftest import run_selftest

    result = run_selftest(nproc, timeout_s=840)
    by_name = {c.name: c for c in result["_results"]}
    assert set(by_name) == {c.name for c in build_cases(nproc)}
    for c in result["_results"]:
        assert c.loss_rel_diff <= CPU.loss, (c.name, c.loss_rel_diff)
        assert c.max_rel_grad_diff <= CPU.grad, (c.name, c.detail)
    assert result["ok"] is True
    assert "mutations" not in result  # only with --mutations
    doc = json.loads(json.dumps({"ok": result["ok"], "cases": result["cases"]}))
    assert all(set(c) == CASE_KEYS and c["nproc"] == nproc for c in doc["cases"])
    print(f"selftest nproc={nproc}: {result['_timing']}")


@pytest.mark.spawns
@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.parametrize("nproc", [4, 8])
def test_selftest_mutations_are_all_caught(capsys, nproc):
    """The CLI as users run it: every planted bug misses the tolerance by >= CATCH_MARGIN, at 4
    and at 8 processes; the clean cases pass in the same run."""
    from megatron_hsp.testing.mutations import CATCH_MARGIN, MUTATIONS

    assert cli.main(["selftest", "--nproc", str(nproc), "--mutations", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["ok"] is True
    rows = {m["name"]: m for m in doc["mutations"]}
    assert (
        set(rows)
        == {m.name for m in MUTATIONS}
        >= {
            "non-causal-attention",
            "attention-across-documents",
            "rope-positions-shifted",
            "token-lost-at-group-boundary",
            "per-sample-loss",
            "gqa-kv-head-off-by-one",
            "group-gradients-not-reduced",
            "gradients-reduced-over-wrong-group",
            "position-ids-shifted",
            "one-rank-loss-normalisation",
            "one-parameter-gradient-scaled",
        }
    )
    for name, m in rows.items():
        assert set(m) == {"name", "caught", "loss_rel_diff", "max_rel_grad_diff"}
        assert m["caught"] is True, m
        worst = max(m["loss_rel_diff"] / CPU.loss, m["max_rel_grad_diff"] / CPU.grad)
        assert worst >= CATCH_MARGIN, (name, worst)
        print(f"nproc={nproc} {name}: caught at {worst:.3g} x tolerance")
    # the one-rank normalisation error shows in the loss itself, not only in the gradients
    norm = rows["one-rank-loss-normalisation"]
    assert norm["loss_rel_diff"] / CPU.loss >= CATCH_MARGIN, norm
    # the clean cases pass in the same run (mutations were undone between runs)
    assert all(set(c) == CASE_KEYS and c["nproc"] == nproc for c in doc["cases"])
    assert {c["name"] for c in doc["cases"]} == {c.name for c in build_cases(nproc)}
    for c in doc["cases"]:
        assert c["max_rel_grad_diff"] <= CPU.grad, c
    mutated = {
        layout["ulysses"] > 1 and layout["ring"] > 1
        for c in doc["cases"]
        for mb in c["layouts"]
        for layout in mb
    }
    assert True in mutated  # a hybrid Ulysses x ring group runs at this rank count


@pytest.mark.spawns
def test_megatron_mutations_run_the_loop_plants_and_fail_on_a_survivor(monkeypatch, capsys):
    """``selftest --megatron --mutations`` also runs the Megatron loop's plants (each on its
    option set, ``PLANT_RUNS``) and exits 1 when one is not caught. Wiring only: the plants
    themselves are run by tests/testing/test_megatron_loop.py."""
    import megatron_hsp.testing.megatron_loop as loop
    import megatron_hsp.testing.selftest as selftest

    fake = {
        "ok": True,
        "cases": [],
        "_results": [],
        "_mutations": [],
        "_timing": {"total_s": 0.0, "reference_s": 0.0},
    }
    monkeypatch.setattr(selftest, "run_selftest", lambda *a, **kw: dict(fake))
    monkeypatch.setattr(selftest, "case_table", lambda *a: "")
    monkeypatch.setattr(selftest, "mutation_table", lambda *a: "")
    monkeypatch.setattr(loop, "run_megatron_loop", lambda *a, **kw: [])
    monkeypatch.setattr(loop, "loop_table", lambda *a: "")
    seen = []

    def plants(nproc, timeout_s):
        seen.append(nproc)
        survivor = "stage-boundary-tokens-rolled"
        return [
            {
                "plant": name,
                "options": label,
                "caught": name != survivor,
                "margin": 0.25 if name == survivor else float("inf"),
                "worst_check": "loss",
            }
            for name, (label, _) in loop.PLANT_RUNS.items()
        ]

    monkeypatch.setattr(loop, "run_megatron_plants", plants)
    rc = cli.main(["selftest", "--nproc", "4", "--megatron", "--mutations"])
    out = capsys.readouterr()
    assert seen == [4] and rc == 1
    assert "stage-boundary-tokens-rolled" in out.out and "SURVIVED" in out.out
    # Each plant's worst check and margin is printed (issue 33).
    assert "SURVIVED: worst check loss, worst / tolerance 0.25" in out.out
    assert "caught: worst check loss, worst / tolerance inf (an exact check failed)" in out.out
    assert f"{len(loop.PLANT_RUNS)} Megatron plants" in out.err
