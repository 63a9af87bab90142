"""Megatron's dp_balanced packing scheduler: arrival-order packs, DP-multiple fix-up, ring cost."""

from __future__ import annotations

import numpy as np
import pytest

from megatron_hsp.evaluation.baselines import (
    RingAssumptions,
    dp_balanced_layout,
    dp_balanced_plan,
    ring_group_ms,
    thd_padded,
)
from megatron_hsp.planner.cost.costmodel import load_cost_model
from megatron_hsp.planner.errors import InfeasibleError, InputError
from megatron_hsp.planner.topology import Cluster


def test_packs_in_arrival_order_and_moves_to_dp_multiple():
    cost = load_cost_model("flexsp-gpt-7b", world_size=8)
    cap = cost.capacity(4)
    # arrival order: [0.6, 0.6] would fit one pack best-fit with [0.4, 0.4]; arrival order doesn't
    lens = [int(cap * f) for f in (0.6, 0.6, 0.4, 0.4, 0.1)]
    layout = dp_balanced_layout(lens, cost, 8, 4)
    packs = [ids for mb in layout for _, ids in mb]
    # packs: [0], [1,2], [3,4] -> 3 packs, DP 2 -> pop 4 into a 4th pack
    assert packs == [[0], [1, 2], [3], [4]]
    assert all(size == 4 for mb in layout for size, _ in mb)
    assert len(layout) == 2


def test_plan_valid_and_costed_as_ring():
    cost = load_cost_model("flexsp-gpt-7b", world_size=16)
    cluster = Cluster(16, 8)
    rng = np.random.default_rng(0)
    lens = rng.integers(500, cost.capacity(4) // 2, size=64)
    plan = dp_balanced_plan(lens, cost, cluster, 4)
    plan.validate(thd_padded(lens, 8).tolist(), cost, 16)  # THD: multiples of 2 * cp
    assert plan.extra["thd_pad_divisor"] == 8
    assert plan.extra["padding_tokens"] == int(thd_padded(lens, 8).sum() - lens.sum()) > 0
    g = max((g for mb in plan.microbatches for g in mb.groups), key=lambda g: g.est_ms)
    assert g.est_ms == pytest.approx(ring_group_ms(g.lengths, 4, cost, RingAssumptions()))
    exposed = dp_balanced_plan(lens, cost, cluster, 4, RingAssumptions(overlap="exposed"))
    hidden = dp_balanced_plan(lens, cost, cluster, 4, RingAssumptions(overlap="fully-hidden"))
    assert hidden.est_step_ms < plan.est_step_ms < exposed.est_step_ms
    assert all((g.ulysses, g.ring) == (1, g.size) for mb in plan.microbatches for g in mb.groups)


def test_errors_name_the_flag():
    cost = load_cost_model("flexsp-gpt-7b", world_size=8)
    with pytest.raises(InputError, match="divide --gpus 8"):
        dp_balanced_plan([100], cost, Cluster(8, 8), 3)
    with pytest.raises(InfeasibleError, match="memory cap"):
        dp_balanced_plan([cost.capacity(2) + 1] + [5] * 7, cost, Cluster(8, 8), 2)
    with pytest.raises(InfeasibleError, match="cannot fill 4 data-parallel groups"):
        dp_balanced_plan([5, 5], cost, Cluster(8, 8), 2)
    with pytest.raises(InputError, match="overlap must be one of"):
        RingAssumptions(overlap="half")


def _pure_ring_model(world: int):
    """Three query heads: every group of 2, 4 or 8 runs as pure ring (1, d) in hsp's runtime too."""
    spec = {
        "name": "ring3",
        "model": {
            "name": "ring3",
            "layers": 4,
            "hidden": 192,
            "heads": 3,
            "kv_heads": 1,
            "ffn_hidden": 512,
            "vocab": 1000,
        },
        "hardware": {"name": "h", "peak_tflops": 100.0, "hbm_gb": 1.0},
        "training": {"zero_stage": 3},
    }
    return load_cost_model(spec, world_size=world, gpus_per_node=8)


def test_megatron_cp_priced_by_the_rule_hsp_groups_get():
    """Same (1, d) group, same price: the baseline's ring traffic is neither free nor extra.

    With 3 heads hsp's own groups of 2/4/8 are pure ring, so ``cost.group_ms(lengths, d)`` is
    exactly what hsp's planner charges them; the default baseline must charge the same.
    """
    cost = _pure_ring_model(16)
    cluster = Cluster(16, 8)
    assert [cost.split(d) for d in (2, 4, 8, 16)] == [(1, 2), (1, 4), (1, 8), (1, 16)]
    rng = np.random.default_rng(5)
    lens = rng.integers(64, cost.capacity(4) // 3, size=48)
    for d in (2, 4, 8, 16):
        plan = dp_balanced_plan(lens, cost, cluster, d)
        for mb in plan.microbatches:
            for g in mb.groups:
                if g.lengths:
                    assert g.est_ms == pytest.approx(cost.group_ms(g.lengths, d), rel=1e-12)
        # and the ring term is really charged: short sequences cannot hide their K/V p2p
        short = [64] * 8
        free = cost.group_ms(short, d, (1, d), ring="hidden")
        assert ring_group_ms(short, d, cost, RingAssumptions()) > free
    # A model whose default split is Ulysses: the baseline still runs (1, d), priced the same way.
    flex = load_cost_model("flexsp-gpt-7b", world_size=64)
    g = [30_000, 9_000, 1_000]
    assert flex.split(64) == (32, 2)
    assert ring_group_ms(g, 64, flex, RingAssumptions()) == pytest.approx(
        flex.group_ms(g, 64, (1, 64))
    )


def test_model_without_ring_figures_is_refused_not_priced_free():
    spec = {
        "name": "noring",
        "coefficients": {
            "attn_ms_per_token2": 5.0e-6,
            "linear_ms_per_token": 0.12,
            "a2a_ms_per_token": {2: 0.03, 4: 0.04},
            "tokens_per_rank": 20_000,
        },
    }
    cost = load_cost_model(spec, world_size=4, gpus_per_node=4)
    with pytest.raises(InputError, match=r"no ring_step_ms_per_token .* out of --methods"):
        dp_balanced_plan([1000] * 8, cost, Cluster(4, 4), 2)
    # the fully-hidden bound needs no ring figure
    hidden = dp_balanced_plan([1000] * 8, cost, Cluster(4, 4), 2, RingAssumptions("fully-hidden"))
    assert hidden.est_step_ms > 0


def test_plan_and_bench_validate_it_against_the_padded_lengths(
    tmp_path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The padded plan is valid where it is checked: ``plan`` and ``bench`` validate a THD
    baseline against the lengths it trains (``baselines.trained_lengths``), not refuse it."""
    from megatron_hsp.cli import main

    lens = tmp_path / "lens.txt"
    lens.write_text("\n".join(str(n) for n in np.random.default_rng(1).integers(99, 2801, 64)))
    common = ["--flexsp-harness", "--lengths", str(lens), "--gpus", "16", "--max-seq", "3000",
              "--cost-model", "llama3-8b-h100", "--global-batch", "64"]  # fmt: skip
    assert main(["plan", *common, "--method", "dp-balanced-4"]) == 0
    assert main(["bench", *common, "--steps", "1", "--methods", "dp-balanced-4"]) == 0
    out = capsys.readouterr().out
    assert "dp-balanced-4" in out and "invalid" not in out
