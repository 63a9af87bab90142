"""``megatron-hsp compare``: two plan logs, same batches checked, measured vs predicted speedup."""

from __future__ import annotations

import io
import json

import pytest

from megatron_hsp.cli import main
from megatron_hsp.commands.compare import compare_logs
from megatron_hsp.planner.errors import InputError
from megatron_hsp.planner.plan import Group, MicroBatch, Plan
from megatron_hsp.step.observe import StepObserver, StepRecord


def plan(est_ms: float, method: str | None) -> Plan:
    mb = MicroBatch((Group((0, 1), (0,), (100,), est_ms=est_ms),), est_ms=est_ms)
    extra = {} if method is None else {"method": method}
    return Plan(2, 2, (mb,), "m", est_step_ms=est_ms, solver="highs", extra=extra)


def write_log(path, measured, predicted, method=None, prints=None, repeats=1):
    """A plan log as the Megatron hooks write it (``StepObserver``), ``repeats`` runs appended."""
    for _ in range(repeats):
        obs = StepObserver(plan_log=str(path), stream=io.StringIO())
        for step, (ms, pred) in enumerate(zip(measured, predicted, strict=True)):
            p = plan(pred, method)
            fp = prints[step] if prints else f"batch{step:011d}"
            obs.record(StepRecord.from_plan(step, p, measured_s=ms / 1e3, batch_fingerprint=fp), p)
        obs.close()
    return str(path)


def test_measured_and_predicted_speedups_per_step_and_overall(tmp_path):
    a = write_log(tmp_path / "a.jsonl", [500, 200, 210, 190, 205], [300] * 5, "static-2")
    b = write_log(tmp_path / "b.jsonl", [400, 100, 110, 95, 100], [150] * 5)
    r = compare_logs(a, b, warmup=1)
    assert r["run_a"]["method"] == "static-2" and r["run_b"]["method"] == "hsp"
    assert r["steps_compared"] == 4 and r["warmup_steps"] == 1
    assert r["steps"][1]["measured_speedup"] == pytest.approx(2.0)
    o = r["overall"]
    assert o["measured_speedup"] == pytest.approx(805 / 405)  # totals after the warm-up step
    assert o["predicted_speedup"] == pytest.approx(2.0)
    assert o["distinguishable"] and o["repeat_range"] is None


def test_different_batches_are_refused_naming_the_first_step(tmp_path, capsys):
    a = write_log(tmp_path / "a.jsonl", [100] * 4, [100] * 4, prints=["p0", "p1", "p2", "p3"])
    b = write_log(tmp_path / "b.jsonl", [90] * 4, [90] * 4, prints=["p0", "p1", "XX", "p3"])
    with pytest.raises(InputError, match="different batches from step 2 on"):
        compare_logs(a, b)
    assert main(["compare", a, b]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("megatron-hsp compare: error:")


def test_inside_the_spread_no_ratio_is_quoted(tmp_path, capsys):
    """Noise both ways around 1.00: the verdict says so instead of quoting a speedup."""
    a = write_log(tmp_path / "a.jsonl", [100, 100, 104, 96, 103, 97], [120] * 6)
    b = write_log(tmp_path / "b.jsonl", [100, 98, 100, 100, 100, 100], [100] * 6)
    assert main(["compare", a, b]) == 0
    out = capsys.readouterr().out
    assert "no difference between hsp and hsp beyond noise" in out and "includes 1.00x" in out
    assert "predicted 1.20x" in out


def test_repeats_give_a_run_to_run_spread_and_json_and_plot(tmp_path):
    a = write_log(tmp_path / "a.jsonl", [300, 200, 200, 200], [200] * 4, repeats=3)
    b = write_log(tmp_path / "b.jsonl", [300, 100, 105, 100], [100] * 4, repeats=2)
    out, png = tmp_path / "c.json", tmp_path / "c.png"
    assert main(["compare", a, b, "--json", str(out), "--plot", str(png)]) == 0
    r = json.loads(out.read_text())
    assert (r["run_a"]["repeats"], r["run_b"]["repeats"]) == (3, 2)
    assert r["overall"]["repeat_range"] == pytest.approx([600 / 305, 600 / 305])
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp left


def test_unreadable_inputs_are_one_line_errors(tmp_path, capsys):
    a = write_log(tmp_path / "a.jsonl", [100, 100], [100, 100])
    assert main(["compare", a, str(tmp_path / "missing.jsonl")]) == 2
    assert "RUN_B" in capsys.readouterr().err
    old = tmp_path / "old.jsonl"
    old.write_text(json.dumps({"step": 0, "measured_ms": 5.0, "predicted_ms": 4.0}) + "\n")
    with pytest.raises(InputError, match="no batch fingerprint"):
        compare_logs(a, str(old))
    with pytest.raises(InputError, match="--warmup 2 leaves none"):
        compare_logs(a, a, warmup=2)


def test_steps_in_one_log_only_are_named(tmp_path, capsys):
    a = write_log(tmp_path / "a.jsonl", [100, 100, 100, 100], [100] * 4)
    b = write_log(tmp_path / "b.jsonl", [50, 50, 50], [50] * 3)
    assert compare_logs(a, b)["steps_left_out"] == [3]
    assert main(["compare", a, b]) == 0
    assert "steps [3] are in one log only" in capsys.readouterr().out
