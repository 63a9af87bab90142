"""planner.cost.fit: exact NNLS, refusal of non-positive / non-monotone fits, loadable spec."""

from __future__ import annotations

import numpy as np
import pytest

from megatron_hsp.planner.cost.costmodel import load_cost_model
from megatron_hsp.planner.cost.fit import check_monotone, cost_model_spec, fit_linear
from megatron_hsp.planner.errors import InputError


def _compute_fit(a1: float = 5e-5, a2: float = 0.12, b: float = 30.0):
    s = np.array([128, 256, 512, 1024, 2048, 4096], dtype=float)
    y = a1 * s * s + a2 * s + b
    return fit_linear(
        {"attn_ms_per_token2": s * s, "linear_ms_per_token": s, "fixed_ms": np.ones_like(s)},
        y,
        required=("attn_ms_per_token2", "linear_ms_per_token"),
    )


def test_recovers_coefficients_exactly():
    f = _compute_fit().as_dict()
    assert f["attn_ms_per_token2"] == pytest.approx(5e-5, rel=1e-6)
    assert f["linear_ms_per_token"] == pytest.approx(0.12, rel=1e-6)
    assert f["fixed_ms"] == pytest.approx(30.0, rel=1e-6)


def test_refuses_non_positive_required_term():
    s = np.array([128, 256, 512, 1024, 2048], dtype=float)
    y = 200.0 - 0.01 * s  # time falling with tokens: the linear term clamps to 0
    with pytest.raises(InputError, match="non-positive \\['linear_ms_per_token'\\]"):
        fit_linear(
            {"linear_ms_per_token": s, "fixed_ms": np.ones_like(s)},
            y,
            required=["linear_ms_per_token"],
        )


def test_refuses_non_monotone_and_too_few_samples():
    with pytest.raises(InputError, match="not monotone"):
        check_monotone({1: 0.0, 2: 0.3, 4: 0.1}, "a2a")
    with pytest.raises(InputError, match="--points"):
        fit_linear({"x": [1.0, 2.0], "c": [1.0, 1.0]}, [1.0, 2.0], required=["x"])


def test_spec_loads_as_cost_model():
    a2a = fit_linear(
        {"ms_per_token": [256, 1024, 4096], "latency_ms": [1, 1, 1]},
        [1.0 + 0.001 * t for t in (256, 1024, 4096)],
        required=["ms_per_token"],
    )
    spec = cost_model_spec("t", _compute_fit(), {2: a2a}, 1024, source="test")
    cost = load_cost_model(spec, world_size=2)
    assert cost.tokens_per_rank == 1024 and cost.sizes == [1, 2]
    assert cost.fixed_ms(2) == pytest.approx(31.0, rel=1e-6)


@pytest.mark.spawns
@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--out", "x.json"], "give a .yaml file name"),
        (["--out", "nodir/x.yaml"], "does not exist"),
        (["--out", "x.yaml", "--nproc", "1"], "--nproc must be >= 2"),
    ],
)
def test_profile_bad_flags_exit_2(argv, message, capsys):
    from megatron_hsp.cli import main

    assert main(["profile", *argv]) == 2
    assert message in capsys.readouterr().err


def test_monotone_tolerance_allows_noise_not_a_fall():
    check_monotone({64: 8.1, 128: 7.8, 256: 12.0}, "t", tolerance=0.1)  # 4% dip: noise
    with pytest.raises(InputError, match=r"64: 8\.1 > 128: 7"):
        check_monotone({64: 8.1, 128: 7.0, 256: 12.0}, "t", tolerance=0.1)  # 14% fall
