"""``selftest --megatron``: Megatron's own ``train_step`` with HSP installed equals the stock path.

Runs megatron-core 0.19.2's ``megatron.training.training.train_step`` (the wheel ships
``megatron/training``) on 4 gloo CPU ranks, HSP side and stock side, for plain DDP, the
distributed optimizer and overlapped grad reduce; and shows that the LR-increment bug megatron-hsp
had before issue 7 is caught.
"""

from __future__ import annotations

import pytest

from megatron_hsp.testing.megatron_loop import (
    DEFAULT_OPTIONS,
    GRAD_RTOL,
    LOSS_RTOL,
    check,
    run_megatron_loop,
)

STEP_KEYS = {
    "step",
    "loss_hsp",
    "loss_ref",
    "lr_hsp",
    "lr_ref",
    "consumed_samples_hsp",
    "consumed_samples_ref",
    "max_rel_grad_diff",
}


@pytest.mark.slow
@pytest.mark.dist
def test_megatron_train_step_with_hsp_matches_the_stock_path():
    entries = run_megatron_loop(4, DEFAULT_OPTIONS, steps=3, timeout_s=500)
    assert [e["options"] for e in entries] == [o.as_dict() for o in DEFAULT_OPTIONS]
    assert any(e["options"]["distributed_optimizer"] for e in entries)
    for e in entries:
        assert e["ok"], e["failures"]
        assert len(e["steps"]) == 3
        for s in e["steps"]:
            assert set(s) >= STEP_KEYS
            assert s["lr_hsp"] == s["lr_ref"] and s["lr_hsp"] > 0
            assert s["consumed_samples_hsp"] == s["consumed_samples_ref"] == 8 * (s["step"] + 1)
            assert abs(s["loss_hsp"] - s["loss_ref"]) <= LOSS_RTOL * abs(s["loss_ref"])
            assert s["max_rel_grad_diff"] <= GRAD_RTOL
            assert s["grad_norm_ref"] > 0
        # The plans really differ from Megatron's own count (2 micro-batches per rank), so the
        # LR increment being right is not a coincidence of equal counts.
        assert any(s["plan_microbatches"] != 2 for s in e["steps"])


@pytest.mark.slow
@pytest.mark.dist
def test_the_old_lr_increment_bug_is_caught():
    (entry,) = run_megatron_loop(
        4, DEFAULT_OPTIONS[:1], steps=1, timeout_s=400, plant="plan-count-in-lr-increment"
    )
    assert not entry["ok"]
    assert any("lr" in f for f in entry["failures"]), entry["failures"]


def test_check_flags_each_quantity():
    good = {
        "step": 0,
        "loss_hsp": 2.0,
        "loss_ref": 2.0,
        "lr_hsp": 1e-3,
        "lr_ref": 1e-3,
        "consumed_samples_hsp": 8,
        "consumed_samples_ref": 8,
        "max_rel_grad_diff": 1e-7,
        "grad_norm_hsp": 0.5,
        "grad_norm_ref": 0.5,
    }
    assert check([good]) == []
    for key, value in [
        ("loss_hsp", 2.0 * (1 + 1e-5)),
        ("lr_hsp", 1.0000001e-3),
        ("consumed_samples_hsp", 4),
        ("max_rel_grad_diff", 1e-4),
        ("grad_norm_hsp", 0.51),
    ]:
        assert len(check([{**good, key: value}])) == 1, key
