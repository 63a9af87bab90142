"""`megatron-hsp profile` end to end on 2 gloo ranks (tiny model), and its refusals.

The written YAML must load everywhere a cost model is taken: `plan`, `bench`, `demo --cost-model`
(tests/test_demo_cost_model.py) and the Megatron path's `--hsp-cost-model`.
"""

from __future__ import annotations

import pytest
import yaml

from megatron_hsp.cli import main
from megatron_hsp.runtime.profile import ComputeSample

# Sequences up to 2048 tokens at hidden 64: long enough that the per-token terms stand out of
# the timing noise of a loaded 2-core CI machine (at 512 tokens / hidden 32 the linear term was
# sometimes fitted as zero there and the profile refused, correctly, to write it).
TINY = [
    "--layers", "1", "--hidden", "64", "--heads", "4", "--kv-heads", "2", "--vocab", "64",
    "--max-tokens", "2048", "--points", "4", "--repeats", "3", "--nproc", "2",
]  # fmt: skip


@pytest.fixture(scope="module")
def profiled(tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("profile") / "tiny.yaml"
    assert main(["profile", "--out", str(out), *TINY]) == 0
    return str(out)


@pytest.mark.dist
def test_profile_writes_every_measured_term(profiled):
    with open(profiled) as fh:
        spec = yaml.safe_load(fh)
    co = spec["coefficients"]
    assert co["attn_ms_per_token2"] > 0 and co["linear_ms_per_token"] > 0
    assert set(co["a2a_ms_per_token"]) == {2} and co["a2a_ms_per_token"][2] > 0
    assert set(co["ring_step_ms_per_token"]) == {2} and co["ring_step_ms_per_token"][2] > 0
    assert co["group_fixed_ms"][2] == co["group_fixed_ms"][1] > 0  # compute's b, every size
    assert co["a2a_fixed_ms"][2] > 0 and co["ring_step_fixed_ms"][2] > 0  # split latencies
    assert spec["details"]["act_mib_per_token"] > 0 and spec["details"]["step_ms"] > 0
    assert "2 ranks x 1 thread" in spec["source"]


@pytest.mark.dist
@pytest.mark.parametrize("command", ["plan", "bench"])
def test_plan_and_bench_accept_the_profile(profiled, command, capsys):
    argv = [command, "--cost-model", profiled, "--gpus", "2", "--gpus-per-node", "2"]
    argv += ["--max-seq", "2048", "--global-batch", "8"]
    if command == "bench":
        argv += ["--steps", "2"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert ("est_ms" if command == "plan" else "all plans valid: true") in printed


@pytest.mark.dist
def test_megatron_hsp_cost_model_accepts_the_profile(profiled):
    """The Megatron path: the flag reaches HSPConfig and loads as the training hook loads it."""
    from tests_support_args import parse

    from megatron_hsp.megatron.args import validate_hsp_args
    from megatron_hsp.planner.costmodel import load_cost_model

    base = ["--micro-batch-size", "1", "--global-batch-size", "8", "--seq-length", "2048"]
    base += ["--eval-iters", "0"]
    args = parse([*base, "--hsp", "--hsp-cost-model", profiled], world_size=2)
    cfg = validate_hsp_args(args, env={})
    assert cfg.cost_model == profiled
    cost = load_cost_model(
        cfg.cost_model,
        world_size=cfg.world_size,
        gpus_per_node=cfg.gpus_per_node,
        memory_cap_gb=cfg.memory_cap_gb,
    )
    assert cost.name == "profiled" and cost.sizes == [1, 2]


def _fake_results(compute_ms: list[float], a2a_ms: list[float]):
    """What the spawned ranks return, with chosen timings (no processes)."""
    lengths = [128, 256, 512, 1024]
    return [
        {
            "compute": [ComputeSample((n,), ms) for n, ms in zip(lengths, compute_ms, strict=True)]
            + [ComputeSample((n // 4,) * 4, ms) for n, ms in zip(lengths, compute_ms, strict=True)],
            "act": [(128, 1e6), (256, 2e6), (512, 4e6)],
            "step_ms": 5.0,
            "a2a": {2: list(zip([1024, 4096, 16384, 65536], a2a_ms, strict=True))},
            "ring": {2: [(1024, 1.0), (4096, 2.0), (16384, 5.0), (65536, 17.0)]},
        },
        None,
    ]


@pytest.mark.parametrize(
    ("compute_ms", "a2a_ms", "message"),
    [
        # a longer sequence measured faster: noise above signal
        ([10.0, 30.0, 20.0, 90.0], [1.0, 2.0, 5.0, 17.0], "not monotone"),
        # message time falling with size: no positive per-token term
        ([10.0, 20.0, 45.0, 100.0], [9.0, 6.0, 4.0, 2.0], "the all-to-all fit (d=2)"),
    ],
)
def test_refused_fit_exits_2_naming_the_flag(
    tmp_path, monkeypatch, capsys, compute_ms, a2a_ms, message
):
    import megatron_hsp.testing.dist as dist_testing

    fake = _fake_results(compute_ms, a2a_ms)
    monkeypatch.setattr(dist_testing, "run_distributed", lambda *a, **k: fake)
    out = tmp_path / "x.yaml"
    assert main(["profile", "--out", str(out), *TINY]) == 2
    err = capsys.readouterr().err
    assert message in err and "--repeats" in err
    assert not out.exists()


@pytest.mark.dist
def test_demo_accepts_the_profile(profiled, tmp_path, monkeypatch):
    import json

    import megatron_hsp.megatron.data as data

    few = data.stdlib_sources()[:40]
    monkeypatch.setattr(data, "stdlib_sources", lambda: few)
    out = tmp_path / "demo.json"
    argv = ["demo", "--nproc", "2", "--steps", "2", "--global-batch", "4", "--compare-steps"]
    argv += ["0", "--cache-dir", str(tmp_path), "--json", str(out), "--cost-model", profiled]
    assert main(argv) == 0
    result = json.loads(out.read_text())
    assert result["config"]["cost_model"]["name"] == "profiled"
    assert all(s["predicted_s"] > 0 and s["step_s"] > 0 for s in result["steps"])
