"""Pipeline pricing (planner/cost/pipeline.py): schedules, step time by hand, order, memory."""

from __future__ import annotations

import random

import pytest

from megatron_hsp.planner.cost.pipeline import (
    PipelineSpec,
    bubble_lower_bound,
    in_flight,
    microbatch_token_capacity,
    order_microbatches,
    pipeline_lower_bound,
    simulate,
    stage_ops,
)
from megatron_hsp.planner.errors import InputError


def test_1f1b_op_order_matches_megatron():
    # megatron-core 0.19 forward_backward_pipelining_without_interleaving: pp - rank - 1 warm-up
    # forwards, then F/B pairs, then the remaining backwards.
    assert stage_ops(2, 1, 3, 0) == [
        ("F", 0, 0),
        ("F", 1, 0),
        ("B", 0, 0),
        ("F", 2, 0),
        ("B", 1, 0),
        ("B", 2, 0),
    ]
    assert stage_ops(2, 1, 3, 1) == [
        ("F", 0, 0),
        ("B", 0, 0),
        ("F", 1, 0),
        ("B", 1, 0),
        ("F", 2, 0),
        ("B", 2, 0),
    ]


def test_interleaved_op_order_matches_megatron_table():
    # get_schedule_table for pp 2, vpp 2, m 2: (0,0) (1,0) (0,1) (1,1); device 0 warm-up
    # 2*(2-0-1) + (2-1)*2 = 4 = everything; backward chunks mirrored.
    assert stage_ops(2, 2, 2, 0) == [
        ("F", 0, 0),
        ("F", 1, 0),
        ("F", 0, 1),
        ("F", 1, 1),
        ("B", 0, 1),
        ("B", 1, 1),
        ("B", 0, 0),
        ("B", 1, 0),
    ]
    # device 1: warm-up (2-1)*2 = 2, then pairs.
    assert stage_ops(2, 2, 2, 1)[:4] == [("F", 0, 0), ("F", 1, 0), ("F", 0, 1), ("B", 0, 1)]
    with pytest.raises(InputError, match="multiple of --pp"):
        stage_ops(4, 2, 6, 0)


def test_two_stage_heterogeneous_by_hand():
    """pp 2, beta 2/3, t = [3, 6]: f = [1, 2], b = [2, 4].

    device 0: F0 [0,1], F1 [1,3], B0 waits for device 1's B0 (ends 4): [4,6], B1 waits for
    device 1's B1 (ends 10): [10,14]. device 1: F0 [1,2], B0 [2,4], F1 [4,6], B1 [6,10]. T = 14.
    Reversed, t = [6, 3]: device 1 F0 [2,4] B0 [4,8], F1 (ready at 3) waits to 8: [8,9], B1
    [9,11]; device 0 B0 [8,12], B1 [12,14]: T = 14, while the closed-form bound gives 9 + 2 + 2.
    """
    spec = PipelineSpec(pp=2)
    assert simulate([3.0, 6.0], spec) == pytest.approx(14.0)
    assert bubble_lower_bound([3.0, 6.0], spec) == pytest.approx(14.0)
    assert simulate([6.0, 3.0], spec) == pytest.approx(14.0)
    assert bubble_lower_bound([6.0, 3.0], spec) == pytest.approx(13.0)


def test_three_stages_three_microbatches_by_hand():
    """pp 3, beta 1/2, t = [2, 4, 2]: f = b = [1, 2, 1].

    device 0 (warm-up 2: F0 F1 | F2 B0 | B1 B2): F0 [0,1] F1 [1,3] F2 [3,4].
    device 1 (warm-up 1: F0 | F1 B0 F2 B1 | B2): F0 [1,2] F1 [3,5].
    device 2 (F0 B0 F1 B1 F2 B2): F0 [2,3] B0 [3,4] F1 [5,7] B1 [7,9].
    device 1: B0 [5,6] F2 [6,7] B1 [9,11]; device 2: F2 [9,10] B2 [10,11]; device 1: B2 [11,12].
    device 0: B0 [6,7] B1 [11,13] B2 [13,14]. T = 14 = sum 8 + bubble 6, while
    (pp - 1)(f_first + b_last) = 4 gives the bound 12.
    """
    spec = PipelineSpec(pp=3, backward_share=0.5)
    assert simulate([2.0, 4.0, 2.0], spec) == pytest.approx(14.0)
    assert bubble_lower_bound([2.0, 4.0, 2.0], spec) == pytest.approx(12.0)


@pytest.mark.parametrize("pp,m", [(2, 1), (2, 5), (4, 3), (4, 8), (8, 16)])
def test_equal_microbatches_textbook_1f1b(pp, m):
    assert simulate([3.0] * m, PipelineSpec(pp=pp)) == pytest.approx((m + pp - 1) * 3.0)


@pytest.mark.parametrize("pp,vpp,m", [(2, 2, 4), (4, 2, 8), (4, 4, 8), (3, 3, 9)])
def test_equal_microbatches_textbook_interleaved(pp, vpp, m):
    # Narayanan et al. 2021: the bubble shrinks by vpp, (pp - 1) t / vpp.
    t = 3.0
    assert simulate([t] * m, PipelineSpec(pp=pp, vpp=vpp)) == pytest.approx(
        m * t + (pp - 1) * t / vpp
    )


def test_hop_adds_per_boundary():
    # One micro-batch through 3 stages: forward crosses 2 boundaries, backward 2.
    assert simulate([3.0], PipelineSpec(pp=3, hop_ms=0.5)) == pytest.approx(9.0 + 4 * 0.5)


def test_no_pipeline_is_the_sum():
    assert simulate([1.0, 2.0, 4.5], PipelineSpec()) == pytest.approx(7.5)


def test_lower_bound_holds_and_order_never_worse():
    rng = random.Random(7)
    for _ in range(300):
        pp = rng.choice([2, 3, 4, 8])
        vpp = rng.choice([1, 1, 2, 3])
        m = pp * rng.randint(1, 3)
        times = [rng.uniform(0.1, 10.0) for _ in range(m)]
        spec = PipelineSpec(pp=pp, vpp=vpp)
        t = simulate(times, spec)
        assert t >= bubble_lower_bound(times, spec) - 1e-9
        assert t >= pipeline_lower_bound(sum(times), min(times), pp, vpp) - 1e-9
        res = order_microbatches(times, spec)
        assert sorted(res.order) == list(range(m))
        assert res.step_ms <= t + 1e-9
        assert res.step_ms == pytest.approx(simulate([times[i] for i in res.order], spec))


def test_order_puts_short_microbatches_at_the_ends():
    # One short micro-batch among long ones: first (warm-up) or last (cool-down) beats middle.
    times = [10.0, 10.0, 1.0, 10.0]
    spec = PipelineSpec(pp=4)
    res = order_microbatches(times, spec)
    assert res.step_ms < simulate(times, spec)
    assert res.order[0] == 2 or res.order[-1] == 2
    assert order_microbatches(times, PipelineSpec(pp=4, order="as-given")).order == (0, 1, 2, 3)


def test_in_flight_counts():
    assert [in_flight(4, 1, s) for s in range(4)] == [4, 3, 2, 1]
    assert in_flight(4, 1, 0, m=2) == 2
    # interleaved pp 4 vpp 2: device 0 warm-up 2*3 + 1*4 = 10 chunks, +1, each half a stage.
    assert in_flight(4, 2, 0) == pytest.approx(11 / 2)
    assert in_flight(4, 2, 3) == pytest.approx(5 / 2)
    assert in_flight(1, 1, 0) == 1


def test_microbatch_capacity_by_hand():
    spec = PipelineSpec(pp=4)
    # device 0 holds 4 micro-batches of 10 bytes/token; the last one 1 micro-batch + 25 head.
    assert microbatch_token_capacity(4000, 10, 25, spec) == 100
    # head dominates: last device 10 + 50 = 60 > 40.
    assert microbatch_token_capacity(6000, 10, 50, spec) == 100
    assert microbatch_token_capacity(1000, 10, 0, PipelineSpec()) == 100


def test_spec_refusals():
    with pytest.raises(InputError, match="--vpp"):
        PipelineSpec(pp=1, vpp=2)
    with pytest.raises(InputError, match="--pp"):
        PipelineSpec(pp=0)
    assert PipelineSpec(pp=4, vpp=2).microbatch_multiple == 4
    assert PipelineSpec(pp=4).microbatch_multiple == 1
    assert PipelineSpec(pp=4, vpp=2).schedule == "interleaved"


def test_planted_off_by_one_warmup_is_caught(monkeypatch):
    """A warm-up of pp - s forwards instead of pp - s - 1 must change the hand-computed step."""
    from megatron_hsp.planner.cost import pipeline

    real = pipeline.stage_ops

    def one_too_many(pp: int, vpp: int, m: int, device: int):
        if vpp > 1:
            return real(pp, vpp, m, device)
        warm = min(pp - device, m)
        ops = [("F", i, 0) for i in range(warm)]
        for j in range(m - warm):
            ops += [("F", warm + j, 0), ("B", j, 0)]
        return ops + [("B", j, 0) for j in range(m - warm, m)]

    monkeypatch.setattr(pipeline, "stage_ops", one_too_many)
    # device 0 runs F0 F1 B0 B1, device 1 F0 F1 B0 B1: B1 ends at 11 there, 15 on device 0.
    assert simulate([3.0, 6.0], PipelineSpec(pp=2)) == pytest.approx(15.0)


def test_planted_in_flight_off_by_one_is_caught():
    # The 1F1B peak is the warm-up plus one; warm-up alone would give [3, 2, 1, 0].
    assert [in_flight(4, 1, s) for s in range(4)] != [3, 2, 1, 0]
    assert min(in_flight(4, 1, s) for s in range(4)) == 1
