"""``megatron-hsp selftest --ranks-share-gpu``: the acceptance kit with many ranks on one device.

On a GPU every rank computes on cuda:0 over gloo groups, the runtime's collectives staged
through pinned host buffers (``runtime/comm.py``). Here the same command runs with
``--device cpu``: the ranks are CPU processes whose collectives take the same staged path, and
``torch.cuda.is_available()`` answers True in every process (``testing/fake_cuda.py``), as on a
GPU node, so nothing in the mode may depend on CUDA being absent. The command launches its ranks
itself (torchrun's launcher), as the GPU script does (``scripts/gpu_many_ranks.sh``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from megatron_hsp.testing.fake_cuda import cuda_reported_visible_env
from tests.helpers import ROOT


def _selftest(*args: str, timeout: float = 500) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["PYTHONPATH"] = str(ROOT) + (
        os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else ""
    )
    env = cuda_reported_visible_env(env)
    cmd = [sys.executable, "-m", "megatron_hsp.cli", "selftest", "--ranks-share-gpu", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


def _doc(out: str) -> dict:
    start = out.index("{\n")
    return json.JSONDecoder().raw_decode(out[start:])[0]


@pytest.mark.spawns
@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.parametrize("nproc", [4, 8])
def test_the_kit_accepts_ranks_sharing_a_device_through_the_staged_adapter(nproc):
    run = _selftest("--nproc", str(nproc), "--device", "cpu", "--json")
    assert run.returncode == 0, run.stderr[-3000:]
    doc = _doc(run.stdout)
    kit = doc["kit"]
    assert doc["ok"] and kit["world_size"] == nproc and kit["backend"] == "gloo"
    assert kit["ranks_share_device"] and kit["comm"] == "host-staged"
    # every rank staged its collectives (Ulysses, ring shifts, loss, gradients)
    assert len(kit["host_staged_collectives"]) == nproc
    assert min(kit["host_staged_collectives"]) > 0
    routes = {r for c in doc["cases"] for r in c["routes"]}
    assert {"ring", "torch-sdpa"} <= routes
    sizes = {s for c in doc["cases"] for mb in c["group_sizes"] for s in mb}
    assert nproc in sizes and 1 in sizes


@pytest.mark.spawns
@pytest.mark.slow
@pytest.mark.dist
def test_the_shared_device_kit_catches_a_bug_between_ranks():
    run = _selftest("--nproc", "4", "--device", "cpu", "--plant", "wrong-ring-merge", "--json")
    assert run.returncode == 1, run.stderr[-3000:]
    doc = _doc(run.stdout)
    assert not doc["ok"] and doc["kit"]["planted"] == "wrong-ring-merge"
    assert doc["kit"]["planted_calls"] > 0


def test_the_mode_refuses_the_cpu_selftests_suites(capsys):
    from megatron_hsp.cli import main

    assert main(["selftest", "--ranks-share-gpu", "--mutations"]) == 2
    assert "--ranks-share-gpu runs the acceptance kit" in capsys.readouterr().err
