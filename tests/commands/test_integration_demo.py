"""`megatron-hsp demo` end to end on 2 gloo ranks (small corpus, 2 steps): the JSON contract."""

from __future__ import annotations

import importlib.util
import json

import pytest

pytestmark = [
    pytest.mark.spawns,
    pytest.mark.dist,
    pytest.mark.skipif(
        importlib.util.find_spec("megatron_hsp.runtime.schedule") is None
        or importlib.util.find_spec("megatron_hsp.megatron.spec") is None,
        reason="needs the runtime (megatron_hsp.runtime.schedule, megatron_hsp.megatron.spec)",
    ),
]


def test_demo_json_contract(tmp_path, monkeypatch, capfd):
    import megatron_hsp.step.corpus as data
    from megatron_hsp.cli import main

    few = data.stdlib_sources()[:40]
    monkeypatch.setattr(data, "stdlib_sources", lambda: few)
    out = tmp_path / "demo.json"
    rc = main(
        [
            "demo",
            "--nproc",
            "2",
            "--steps",
            "2",
            "--global-batch",
            "4",
            "--compare-steps",
            "2",
            "--compare-repeats",
            "2",
            "--cache-dir",
            str(tmp_path),
            "--json",
            str(out),
            "--plot",
            str(tmp_path / "demo.png"),
        ]
    )
    assert rc == 0
    png = (tmp_path / "demo.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000
    result = json.loads(out.read_text())
    steps = result["steps"]
    assert [s["step"] for s in steps] == [0, 1]
    for s in steps:
        assert set(s) >= {"step", "loss", "group_sizes", "microbatches", "step_s"}
        assert s["loss"] > 0 and s["step_s"] > 0
        assert len(s["group_sizes"]) == s["microbatches"]
        assert all(sum(mb) == 2 for mb in s["group_sizes"])  # every micro-batch covers both ranks
    comp = result["comparison"]
    assert comp["batches"][0]["adaptive"]["measured_s"] > 0
    assert "speedup_predicted" in comp
    # The side-by-side goes through compare's rule: same batches, repeats, a spread.
    ab = comp["compare"]
    assert ab["run_a"]["repeats"] == ab["run_b"]["repeats"] == 2 and ab["steps_compared"] == 2
    assert ab["overall"]["repeat_range"] is not None
    assert ab["overall"]["measured_speedup"] == comp["speedup_measured"]
    printed, err = capfd.readouterr()  # the ranks' output too (forked: file descriptors)
    assert "loss curve" in printed and "adaptive vs static groups" in printed
    assert "medians of 2 runs per batch and layout; measured" in printed
    assert "IS DEPRECATED" not in err, err  # megatron-core's GPTModel notice (issue 32)
