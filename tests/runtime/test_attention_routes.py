"""The runtime's route map for the planner (``backends.attention_routes_for_run``): the same rule
as the TE hand-off (``planner/routes.py``), declared on CUDA only."""

from __future__ import annotations

import torch

from megatron_hsp.runtime import backends

SPLITS = {2: (2, 1), 3: (1, 3), 6: (2, 3)}
BF16 = {"dtype": torch.bfloat16, "head_dim": 128}
FP32 = {"dtype": torch.float32, "head_dim": 128}


def test_off_cuda_no_route_is_declared():
    assert backends.attention_routes_for_run(SPLITS, "torch", "cpu", **BF16) == {}
    assert backends.attention_routes_for_run(SPLITS, "auto", "cpu", **BF16) == {}


def test_on_cuda_the_torch_backend_runs_every_ring_fused_in_half_precision_else_tiled():
    # The fused flash ring where ring.ring_route takes it (bf16/fp16, a flash head dim, the
    # flash operators present: both ends of the torch range), the tiled ring otherwise.
    fused = {3: "ring-fused", 6: "ring-fused"}
    tiled = {3: "ring-tiled", 6: "ring-tiled"}
    assert backends.attention_routes_for_run(SPLITS, "torch", "cuda", **BF16) == fused
    fp16 = {"dtype": torch.float16, "head_dim": 64}
    assert backends.attention_routes_for_run(SPLITS, "torch", "cuda", **fp16) == fused
    assert backends.attention_routes_for_run(SPLITS, "torch", "cuda", **FP32) == tiled
    odd = {"dtype": torch.bfloat16, "head_dim": 100}
    assert backends.attention_routes_for_run(SPLITS, "torch", "cuda", **odd) == tiled


def test_on_cuda_te_carries_pure_rings_and_hybrids_from_2_19(monkeypatch):
    monkeypatch.setattr(backends, "te_version", lambda: "2.14.0")
    assert backends.attention_routes_for_run(SPLITS, "te", "cuda", **FP32) == {
        3: "ring-fused",
        6: "ring-tiled",
    }
    # The hybrid TE 2.14 declines runs HSP's own ring: fused in bf16.
    assert backends.attention_routes_for_run(SPLITS, "te", "cuda", **BF16) == {
        3: "ring-fused",
        6: "ring-fused",
    }
    monkeypatch.setattr(backends, "te_version", lambda: "2.20.2")
    assert backends.attention_routes_for_run(SPLITS, "te", "cuda", **FP32) == {
        3: "ring-fused",
        6: "ring-fused",
    }
    # The TE hand-off asks the same rule: a hybrid is declined on a TE before 2.19.
    monkeypatch.setattr(backends, "te_version", lambda: "2.18.0")
    assert backends._te_cp_inputs([0, 24], 2, 3, "cpu") is None
