"""`megatron-hsp demo --cost-model`: the planner uses the given model, each step carries its
prediction (``predicted_s``), and the run ends with the model's median error."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from megatron_hsp.cli import main
from megatron_hsp.commands.demo_report import prediction_summary


def _demo(tmp_path, monkeypatch, *extra: str) -> dict:
    import megatron_hsp.step.corpus as data

    few = data.stdlib_sources()[:40]
    monkeypatch.setattr(data, "stdlib_sources", lambda: few)
    out = tmp_path / "demo.json"
    argv = ["demo", "--nproc", "2", "--steps", "2", "--global-batch", "4"]
    argv += ["--compare-steps", "0", "--cache-dir", str(tmp_path), "--json", str(out), *extra]
    assert main(argv) == 0
    return json.loads(out.read_text())


def test_prediction_summary_is_the_median_after_warm_up():
    steps = [
        {"step_s": 1.0, "predicted_s": 3.0},  # warm-up: not scored
        {"step_s": 1.0, "predicted_s": 5.0},  # warm-up: not scored
        {"step_s": 1.0, "predicted_s": 1.1},
        {"step_s": 2.0, "predicted_s": 1.0},
        {"step_s": 1.0, "predicted_s": 1.2},
    ]
    s = prediction_summary(steps, {"name": "m"})
    assert s["warmup_steps"] == 2 and s["steps"] == 3
    assert s["median_rel_err"] == pytest.approx(0.2)
    one = prediction_summary(steps[:1], {"name": "m"})  # too short: the one step is scored
    assert one["warmup_steps"] == 0 and one["median_rel_err"] == pytest.approx(2.0)


@pytest.mark.spawns
def test_bad_cost_model_exits_2_naming_the_flag(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\ncoefficients: {linear_ms_per_token: 0.1}\n")
    assert main(["demo", "--cost-model", str(bad), "--cache-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "--cost-model" in err and "attn_ms_per_token2" in err
    assert main(["demo", "--cost-model", str(tmp_path / "none.yaml")]) == 2
    assert "--cost-model" in capsys.readouterr().err


def _slow_model(tmp_path) -> Path:
    """A model no real step matches (1 s per micro-batch group), written as a YAML spec."""
    spec = {
        "name": "slow-test-model",
        "coefficients": {
            "attn_ms_per_token2": 1e-6,
            "linear_ms_per_token": 0.01,
            "group_fixed_ms": {1: 1000.0, 2: 1000.0},
            "a2a_ms_per_token": {2: 0.001},
            "tokens_per_rank": 1024,
        },
    }
    path = tmp_path / "slow.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


@pytest.mark.dist
def test_demo_plans_and_predicts_with_the_given_model(tmp_path, monkeypatch, capsys):
    # A model no real step matches: 1 s per micro-batch group. If the flag were ignored, the
    # built-in model (tens of ms) would be in predicted_s.
    path = _slow_model(tmp_path)
    result = _demo(tmp_path, monkeypatch, "--cost-model", str(path))
    assert result["config"]["cost_model"]["name"] == "slow-test-model"
    for s in result["steps"]:
        assert s["predicted_s"] >= 1.0 * s["microbatches"]
        assert s["step_s"] > 0
    pred = result["prediction"]
    assert pred["cost_model"] == "slow-test-model" and pred["steps"] >= 1
    assert pred["median_rel_err"] > 0
    assert "prediction (slow-test-model)" in capsys.readouterr().out


@pytest.mark.dist
def test_each_step_is_predicted_by_the_model_refit_after_the_step_before(tmp_path, monkeypatch):
    """Plans are prefetched a step ahead, so step t's plan was made before the refit after step
    t - 1; its ``predicted_ms`` must still be that newest model's price of the plan (its group
    records in the refit after step t carry that model's ms), not the plan's own estimate
    (``planned_ms``). A model 10x too slow makes every accepted update move it."""
    path = _slow_model(tmp_path)
    result = _demo(tmp_path, monkeypatch, "--cost-model", str(path), "--steps", "4")
    updates = {u["step"]: u for u in result["refit"]["updates"]}
    # Two ranks, four documents a step: the first update may wait for a second step's records.
    assert updates[1]["accepted"] or updates[2]["accepted"], updates[2]["reason"]
    moved = 0
    for s in result["steps"][1:]:
        t = s["step"]
        # The model at step t's start: its ms of each group record of the refit after step t.
        records = updates[t]["records"]
        by_mb = [max(r[4] for r in records if r[0] == m) for m in {r[0] for r in records}]
        overhead = updates[t - 1]["step_overhead_ms"] if t - 1 in updates else 0.0
        assert s["predicted_ms"] == pytest.approx(sum(by_mb) + overhead, rel=1e-3), t
        moved += abs(s["predicted_ms"] - s["planned_ms"]) > 0.05 * s["planned_ms"]
    assert moved >= 1  # the plan's own estimate differs from the newest model's
