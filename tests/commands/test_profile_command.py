"""`megatron-hsp profile` end to end on 2 gloo ranks (tiny model), and its refusals.

The written YAML must load everywhere a cost model is taken: `plan`, `bench`, `demo --cost-model`
(tests/commands/test_demo_cost_model.py) and the Megatron path's `--hsp-cost-model`.
"""

from __future__ import annotations

import pytest
import yaml

from megatron_hsp.cli import main
from megatron_hsp.runtime.profile import ComputeSample

# Sequences up to 2048 tokens at hidden 128, six lengths: the linear term must stand out of the
# timing noise of a 2-core CI machine. At 512 tokens / hidden 32 it was sometimes fitted as zero;
# at hidden 64 with four lengths it still was, once in a few idle runs (attention about twice
# the linear time at 2048 tokens, three parameters from four points); at hidden 128 the two are
# comparable and six points separate the quadratic from the linear term (about 3 s more).
TINY = [
    "--layers", "1", "--hidden", "128", "--heads", "4", "--kv-heads", "2", "--vocab", "64",
    "--max-tokens", "2048", "--points", "6", "--repeats", "3", "--nproc", "2",
]  # fmt: skip


@pytest.fixture(scope="module")
def profiled(tmp_path_factory) -> str:
    """A profile is a timing measurement: on the shared 2-core CI machine a load spike from other
    jobs (load average 96) once made forward+backward at 64 tokens slower than at 127, and the
    profile refused its non-monotone fit, as it should. Up to three runs; the fixture fails, with
    every exit code, if none succeeds."""
    out = tmp_path_factory.mktemp("profile") / "tiny.yaml"
    codes: list[int] = []
    while len(codes) < 3 and (not codes or codes[-1] != 0):
        codes.append(main(["profile", "--out", str(out), *TINY]))
    assert codes[-1] == 0, codes
    return str(out)


@pytest.mark.spawns
@pytest.mark.dist
def test_profile_writes_every_measured_term(profiled):
    with open(profiled) as fh:
        spec = yaml.safe_load(fh)
    co = spec["coefficients"]
    assert co["attn_ms_per_token2"] > 0 and co["linear_ms_per_token"] > 0
    assert set(co["a2a_ms_per_token"]) == {2} and co["a2a_ms_per_token"][2] > 0
    assert set(co["ring_step_ms_per_token"]) == {2} and co["ring_step_ms_per_token"][2] > 0
    assert co["group_fixed_ms"][2] == co["group_fixed_ms"][1] > 0  # compute's b, every size
    # split latencies: written for the size; an intercept of a few microseconds fits to zero
    # under load (the non-negative fit clamps it; seen once in a full-suite run), slopes cannot
    assert co["a2a_fixed_ms"][2] >= 0 and co["ring_step_fixed_ms"][2] >= 0
    assert spec["details"]["act_mib_per_token"] > 0 and spec["details"]["step_ms"] > 0
    assert "2 ranks x 1 thread" in spec["source"]


@pytest.mark.spawns
@pytest.mark.dist
@pytest.mark.parametrize("command", ["plan", "bench"])
def test_plan_and_bench_accept_the_profile(profiled, command, capsys):
    argv = [
        command,
        "--flexsp-harness",
        "--cost-model",
        profiled,
        "--gpus",
        "2",
        "--gpus-per-node",
        "2",
    ]
    argv += ["--max-seq", "2048", "--global-batch", "8"]
    if command == "bench":
        argv += ["--steps", "2"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert ("est_ms" if command == "plan" else "all plans valid: true") in printed


@pytest.mark.spawns
@pytest.mark.dist
def test_megatron_hsp_cost_model_accepts_the_profile(profiled):
    """The Megatron path: the flag reaches HSPConfig and loads as the training hook loads it."""
    from megatron_hsp.megatron.config import validate_hsp_args
    from megatron_hsp.planner.cost.costmodel import load_cost_model
    from tests.helpers.megatron_args import parse

    base = ["--micro-batch-size", "1", "--global-batch-size", "8", "--seq-length", "2048"]
    base += ["--eval-iters", "0", "--attention-dropout", "0"]
    args = parse([*base, "--hsp", "--hsp-cost-model", profiled], world_size=2)
    cfg = validate_hsp_args(args, env={})
    assert cfg.cost_model == profiled
    cost = load_cost_model(
        cfg.cost_model,
        world_size=cfg.run.dims.slots,
        gpus_per_node=cfg.run.dims.slots_per_node,
        memory_cap_gb=cfg.memory_cap_gb,
    )
    assert cost.name == "profiled" and cost.sizes == [1, 2]


def _fake_results(compute_ms: list[float], a2a_ms: list[float], steps=()):
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
            "steps": list(steps),
        },
        None,
    ]


@pytest.mark.spawns
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


@pytest.mark.spawns
@pytest.mark.dist
def test_demo_accepts_the_profile(profiled, tmp_path, monkeypatch):
    import json

    import megatron_hsp.step.corpus as data

    few = data.stdlib_sources()[:40]
    monkeypatch.setattr(data, "stdlib_sources", lambda: few)
    out = tmp_path / "demo.json"
    argv = ["demo", "--nproc", "2", "--steps", "2", "--global-batch", "4", "--compare-steps"]
    argv += ["0", "--cache-dir", str(tmp_path), "--json", str(out), "--cost-model", profiled]
    assert main(argv) == 0
    result = json.loads(out.read_text())
    assert result["config"]["cost_model"]["name"] == "profiled"
    assert all(s["predicted_s"] > 0 and s["step_s"] > 0 for s in result["steps"])


def _in_situ_steps(compute_yaml_fit: dict, extra_ms: float) -> list:
    """Group steps whose size-2 groups take their compute share plus ``extra_ms``; size 1 takes
    its share plus 7 ms of per-step work that every size pays (and must cancel)."""
    from megatron_hsp.runtime.profile import GroupStepSample

    a1, a2 = compute_yaml_fit["attn"], compute_yaml_fit["linear"]
    out = []
    for lengths in [(512,), (128,) * 4, (1024,), (256,) * 4]:
        share = sum(a1 * n * n + a2 * n for n in lengths)
        out.append(GroupStepSample(1, lengths, share + 7.0))
        out.append(GroupStepSample(2, lengths, share / 2 + 7.0 + extra_ms))
    return out


@pytest.mark.spawns
@pytest.mark.parametrize("extra_ms", [60.0, 0.5])
def test_ulysses_latency_is_measured_in_situ_where_it_exceeds_the_microbenchmark(
    tmp_path, monkeypatch, capsys, extra_ms
):
    """Fails before the in-situ group steps: the written latency was the bare all-to-all's."""
    import megatron_hsp.testing.dist as dist_testing
    from megatron_hsp.planner.cost.fit import fit_compute

    compute_ms = [10.0, 20.0, 45.0, 100.0]
    fake = _fake_results(compute_ms, [1.0, 2.0, 5.0, 17.0])
    fit = fit_compute((c.lengths, c.ms) for c in fake[0]["compute"]).as_dict()
    coefs = {"attn": fit["attn_ms_per_token2"], "linear": fit["linear_ms_per_token"]}
    fake[0]["steps"] = _in_situ_steps(coefs, extra_ms)
    monkeypatch.setattr(dist_testing, "run_distributed", lambda *a, **k: fake)
    out = tmp_path / "x.yaml"
    assert main(["profile", "--out", str(out), *TINY]) == 0
    spec = yaml.safe_load(out.read_text())
    bench_latency = spec["details"]["a2a_microbench_latency_ms_d2"]
    slope = spec["coefficients"]["a2a_ms_per_token"][2]
    assert slope == spec["details"]["a2a_microbench_ms_per_token_d2"]
    got = spec["coefficients"]["a2a_fixed_ms"][2]
    if extra_ms > bench_latency:
        # median over the four batches of extra - slope * tokens (512, 512, 1024, 1024 tokens)
        assert got == pytest.approx(extra_ms - slope * 768, rel=1e-6)
        assert "a2a d=2 in situ" in capsys.readouterr().out
    else:
        assert got == bench_latency


def test_in_situ_rows_cancel_what_every_size_pays():
    from megatron_hsp.planner.cost.fit import in_situ_overhead_rows

    a1, a2 = 1e-4, 0.05
    rows = []
    for lengths in [(1000,), (250,) * 4, (2000,)]:
        share = sum(a1 * n * n + a2 * n for n in lengths)
        rows.append((1, lengths, share + 40.0))  # loss, all-reduce: every size pays it
        rows.append((2, lengths, share / 2 + 40.0 + 3.0 + 0.01 * sum(lengths)))
        rows.append((4, lengths, share / 4 + 40.0 + 5.0))
    out = in_situ_overhead_rows(rows, a1, a2)
    assert set(out) == {2, 4}
    assert [t for t, _ in out[2]] == [1000, 1000, 2000]
    assert [ms for _, ms in out[2]] == pytest.approx([13.0, 13.0, 23.0])
    assert [ms for _, ms in out[4]] == pytest.approx([5.0, 5.0, 5.0])


def test_a_step_prediction_adds_the_profiled_per_step_cost():
    """Fails before: predictions were the plan's micro-batches alone, short of every measured
    step by the gradient all-reduce and optimizer step the profile had measured."""
    from megatron_hsp.planner.cost.costmodel import load_cost_model
    from megatron_hsp.step.observe import StepRecord
    from megatron_hsp.testing.manual_plan import manual_plan

    spec = {
        "name": "p",
        "coefficients": {
            "attn_ms_per_token2": 1e-4,
            "linear_ms_per_token": 0.05,
            "group_fixed_ms": {1: 10.0, 2: 10.0},
            "a2a_ms_per_token": {2: 0.001},
            "tokens_per_rank": 4096,
        },
        "details": {"step_ms": 17.5},
    }
    cost = load_cost_model(spec, world_size=2)
    assert cost.step_overhead_ms == 17.5
    assert load_cost_model({**spec, "details": {}}, world_size=2).step_overhead_ms == 0.0
    plan = manual_plan(2, [100, 200], [[(2, [0, 1])]])
    rec = StepRecord.from_plan(0, plan, step_overhead_ms=cost.step_overhead_ms)
    assert rec.predicted_ms == pytest.approx(plan.est_step_ms + 17.5)
