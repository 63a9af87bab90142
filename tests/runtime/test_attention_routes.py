"""The runtime's route map for the planner (``backends.attention_routes_for_run``): the same rule
as the TE hand-off (``planner/routes.py``), declared on CUDA only."""

from __future__ import annotations

from megatron_hsp.runtime import backends

SPLITS = {2: (2, 1), 3: (1, 3), 6: (2, 3)}


def test_off_cuda_no_route_is_declared():
    assert backends.attention_routes_for_run(SPLITS, "torch", "cpu") == {}
    assert backends.attention_routes_for_run(SPLITS, "auto", "cpu") == {}


def test_on_cuda_the_torch_backend_runs_every_ring_tiled():
    assert backends.attention_routes_for_run(SPLITS, "torch", "cuda") == {
        3: "ring-tiled",
        6: "ring-tiled",
    }


def test_on_cuda_te_carries_pure_rings_and_hybrids_from_2_19(monkeypatch):
    monkeypatch.setattr(backends, "te_version", lambda: "2.14.0")
    assert backends.attention_routes_for_run(SPLITS, "te", "cuda") == {
        3: "ring-fused",
        6: "ring-tiled",
    }
    monkeypatch.setattr(backends, "te_version", lambda: "2.20.2")
    assert backends.attention_routes_for_run(SPLITS, "te", "cuda") == {
        3: "ring-fused",
        6: "ring-fused",
    }
    # The TE hand-off asks the same rule: a hybrid is declined on a TE before 2.19.
    monkeypatch.setattr(backends, "te_version", lambda: "2.18.0")
    assert backends._te_cp_inputs([0, 24], 2, 3, "cpu") is None
