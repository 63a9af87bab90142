"""The acceptance kit: ``megatron-hsp selftest`` under torchrun (here on gloo CPU ranks; on GPUs the
same code runs NCCL, docs/gpu-validation.md), and a planted bug that must make it fail.

The accepting run is made as on a GPU node (issue 28): ``torch.cuda.is_available()`` answers True
in torchrun, its ranks and every process they start (``testing/fake_cuda.py``), and NGC's
``TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=1`` is set. Before, the kit's CPU reference refused to run
wherever CUDA was visible."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from megatron_hsp.testing.acceptance import acceptance_cases
from megatron_hsp.testing.fake_cuda import cuda_reported_visible_env
from megatron_hsp.testing.tolerances import TOLERANCES
from tests.helpers import ROOT as ROOT_PATH

ROOT = str(ROOT_PATH)


def _env(cuda_visible: bool) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    if cuda_visible:
        env = cuda_reported_visible_env(env)
        env["TORCH_ALLOW_TF32_CUBLAS_OVERRIDE"] = "1"  # as NGC images set it
    return env


def _torchrun(nproc: int, *args: str, cuda_visible: bool = False) -> subprocess.CompletedProcess:
    env = _env(cuda_visible)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd += [f"--nproc-per-node={nproc}", "-m", "megatron_hsp.cli", "selftest", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=400, env=env)


def _json(out: str) -> dict:
    return json.loads(out[out.index("{") :])


@pytest.mark.spawns
@pytest.mark.slow
@pytest.mark.dist
def test_kit_accepts_a_correct_install_where_cuda_is_visible_and_catches_a_planted_bug():
    ok = _torchrun(2, "--device", "cpu", "--json", cuda_visible=True)
    assert ok.returncode == 0, ok.stderr[-3000:]
    doc = _json(ok.stdout)
    assert doc["ok"] and doc["kit"]["world_size"] == 2 and doc["kit"]["backend"] == "gloo"
    assert "CUDA hidden" in doc["kit"]["reference"]
    # NGC's override was found, removed from the kit's processes, and TF32 reads as off.
    tf32 = doc["kit"]["tf32"]
    assert tf32["override_env"] == "1" and not tf32["forced"], tf32
    names = {c["name"] for c in doc["cases"]}
    assert {"one-group-of-all", "tp2-group-of-all", "all-groups-size-1"} <= names
    assert {"head-dim-128", "long-document-ring", "lazy-groups-after-initialize"} <= names
    assert all(c["tolerances"]["grad_rel"] == TOLERANCES["gpu-fp32"].grad for c in doc["cases"])
    by_name = {c["name"]: c for c in doc["cases"]}
    assert set(by_name["long-document-ring"]["routes"]) == {"ring"}  # 5 heads: a pure ring
    assert all(c["backend"] == "torch" and c["tokens_per_s"] for c in doc["cases"])
    bad = _torchrun(2, "--device", "cpu", "--json", "--plant", "token-lost-at-group-boundary")
    assert bad.returncode == 1, bad.stderr[-3000:]
    planted = _json(bad.stdout)
    assert not planted["ok"] and planted["kit"]["planted"] == "token-lost-at-group-boundary"
    failed = [c["name"] for c in planted["cases"] if not c["ok"]]
    assert "one-group-of-all" in failed


@pytest.mark.parametrize("n", range(1, 10))
def test_cases_exist_and_validate_for_any_rank_count(n):
    cases = acceptance_cases(n)
    for case in cases:
        case.plan()  # raises on an invalid layout
    sizes = {d for c in cases for mb in c.layout for d, _ in mb if c.tp == 1}
    assert n in sizes and 1 in sizes
    if n > 3:
        assert 3 in sizes  # a pure ring of 3 (8 query heads)
    if n > 6:
        assert 6 in sizes  # Ulysses 2 x ring 3
    assert any(c.tp == 2 for c in cases) == (n % 2 == 0)


@pytest.mark.spawns
def test_kit_flags_outside_torchrun_are_refused(capsys, monkeypatch):
    from megatron_hsp.cli import main

    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    assert main(["selftest", "--dtype", "bf16"]) == 2
    assert "apply under torchrun (the acceptance kit) only" in capsys.readouterr().err


def test_kit_models_have_flash_kernel_head_dims():
    """torch's flash varlen kernel (and TE's) needs a head dim that is a multiple of 8."""
    from megatron_hsp.testing.reference import ModelShape

    for n in (1, 2, 4, 8):
        dims = {c.model_shape(ModelShape()).kv_channels for c in acceptance_cases(n)}
        assert all(d % 8 == 0 for d in dims) and 128 in dims, dims


@pytest.mark.dist
def test_cpu_selftest_ranks_run_with_cuda_hidden_on_a_gpu_node():
    """The plain ``selftest`` (and ``--megatron``) spawn CPU ranks through ``run_distributed``:
    on a node where CUDA is visible they start with it hidden, so the reference's CPU placement
    mode runs there (one selftest case on 2 ranks, reference included)."""
    script = (
        "from megatron_hsp.testing.acceptance import acceptance_cases\n"
        "from megatron_hsp.testing.dist import raise_rank_errors, run_distributed\n"
        "from megatron_hsp.testing.reference import ModelShape\n"
        "from megatron_hsp.testing.selftest import distributed_worker\n"
        "import torch\n"
        "assert torch.cuda.is_available()  # the parent sees CUDA, as on a GPU node\n"
        "cases = [c for c in acceptance_cases(2) if c.name == 'one-group-of-all']\n"
        "out = raise_rank_errors(run_distributed(distributed_worker, 2, cases, ModelShape()))\n"
        "print('max grad rel', max(r['cases'][0]['max_rel_grad_diff'] for r in out))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=400,
        env=_env(cuda_visible=True),
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert float(done.stdout.split("max grad rel")[1]) < 1e-5


def test_the_cost_model_prices_every_group_kind_a_case_runs():
    """The per-case summary puts each group kind's measured tokens/s beside the analytic cost
    model's (H100 preset); on a device without a preset there is no prediction, said so."""
    from megatron_hsp.testing.acceptance import predicted_tokens_per_s
    from megatron_hsp.testing.reference import ModelShape

    by_name = {c.name: c for c in acceptance_cases(8)}
    rates = predicted_tokens_per_s(by_name["ring-and-hybrid-groups"], ModelShape(), "H100", 8)
    assert set(rates) == {"u2xr3", "ulysses2", "ring3", "ring5", "single"}, rates
    assert all(r > 0 for r in rates.values())
    assert predicted_tokens_per_s(by_name["one-group-of-all"], ModelShape(), "cpu", 8) is None


@pytest.mark.spawns
@pytest.mark.slow
@pytest.mark.dist
def test_kit_runs_its_bf16_rows_as_megatron_trains_bf16():
    """The kit's bf16 rows, as the GPU default (``fp32,bf16``) runs them. On an H200 (2026-11-27,
    docs/gpu-validation.md) the bf16 rows crashed in the first layer norm: ``params_dtype``
    reaches megatron-core's linear layers only, the local spec's torch ``LayerNorm`` stayed fp32
    and CUDA's kernel refuses bf16 input with fp32 weights (the CPU kernel accepts the mix).
    Megatron casts the whole model (``Float16Module``); so must the kit
    (``test_selftest_reference.test_bf16_models_are_bf16_throughout``). Here the kit on one CPU
    rank: a norm bias's gradient over a long document differs from fp32 by over 20% in stock
    megatron-core's bf16 too, so bf16 rows are judged against that yardstick."""
    # as on a GPU node: CUDA reported visible (the reference and its bf16 yardstick run in the
    # child with CUDA hidden), NGC's TF32 override set
    one = _torchrun(1, "--device", "cpu", "--dtype", "fp32,bf16", "--json", cuda_visible=True)
    assert one.returncode == 0, one.stderr[-3000:]
    doc = _json(one.stdout)
    # the device's name, not the last attention route counted (the H200 record said
    # "torch-sdpa": the routes loop reused the name's variable)
    assert doc["kit"]["device"] == "cpu", doc["kit"]
    rows = [c for c in doc["cases"] if c["dtype"] == "bf16"]
    assert doc["ok"] and rows and all(c["stock_bf16_noise"] for c in rows)
    assert all(c["grad_judged"] <= 1.0 for c in doc["cases"])
    # the yardstick matters: at least one row is beyond the plain bf16 tolerance on its own
    assert any(c["max_rel_grad_diff"] > c["tolerances"]["grad_rel"] for c in rows)


def test_bf16_rows_are_judged_against_stock_bf16_noise_per_parameter():
    from megatron_hsp.testing.acceptance import _grad_judged
    from megatron_hsp.testing.tolerances import BF16_NOISE_FACTOR

    row = {"grad_rel_by_param": {"a": 0.2, "b": 0.01}, "stock_bf16_rel": {"a": 0.1, "b": 0.0}}
    assert _grad_judged(row, 0.05) == pytest.approx((0.2 / (BF16_NOISE_FACTOR * 0.1), "a"))
    # where stock bf16 is exact, the plain tolerance applies (0.2 / 0.05 = 4: fails)
    row["stock_bf16_rel"] = {"a": 0.0, "b": 0.0}
    assert _grad_judged(row, 0.05) == pytest.approx((4.0, "a"))
    # fp32 rows carry no yardstick
    assert _grad_judged({"grad_rel_by_param": {"a": 1e-5}, "stock_bf16_rel": None}, 1e-4)[0] == (
        pytest.approx(0.1)
    )
