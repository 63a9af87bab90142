"""The acceptance kit: ``megatron-hsp selftest`` under torchrun (here on gloo CPU ranks; on GPUs the
same code runs NCCL, docs/gpu-validation.md), and a planted bug that must make it fail."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from megatron_hsp.testing.acceptance import TOLERANCES, acceptance_cases


def _torchrun(nproc: int, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd += [f"--nproc-per-node={nproc}", "-m", "megatron_hsp.cli", "selftest", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=400, env=env)


def _json(out: str) -> dict:
    return json.loads(out[out.index("{") :])


@pytest.mark.spawns
@pytest.mark.slow
@pytest.mark.dist
def test_kit_accepts_a_correct_install_and_catches_a_planted_bug():
    ok = _torchrun(2, "--device", "cpu", "--json")
    assert ok.returncode == 0, ok.stderr[-3000:]
    doc = _json(ok.stdout)
    assert doc["ok"] and doc["kit"]["world_size"] == 2 and doc["kit"]["backend"] == "gloo"
    names = {c["name"] for c in doc["cases"]}
    assert {"one-group-of-all", "tp2-group-of-all", "all-groups-size-1"} <= names
    assert all(c["tolerances"]["grad_rel"] == TOLERANCES["fp32"][1] for c in doc["cases"])
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
