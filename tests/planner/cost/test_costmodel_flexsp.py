"""FlexSP presets against values computed by hand from FlexSP's solver.py formulas."""

from __future__ import annotations

import dataclasses

import pytest

from megatron_hsp.planner.cost.costmodel import (
    FLEXSP_DEFAULT_MEMORY_CAP_GB,
    flexsp_cost_model,
    load_cost_model,
)
from megatron_hsp.planner.errors import InputError


def test_default_memory_cap_is_the_one_that_reproduces_flexsp():
    assert FLEXSP_DEFAULT_MEMORY_CAP_GB == 30.0
    assert load_cost_model("flexsp-gpt-7b", world_size=64).details["memory_cap_gb"] == 30.0


def test_gpt7b_memory_by_hand():
    m = load_cost_model("flexsp-gpt-7b", world_size=64, gpus_per_node=8, max_seq_k=192)
    # ZeRO-3 states: 7.1174468994140625 B params * 16 bytes / 64 ranks, in MiB.
    assert m.details["model_states_mib"] == pytest.approx(1822.06640625)
    # token_capacity: int((30*1024 - 1822.06640625) / 4.480441895) = int(6449.77...)
    assert m.tokens_per_rank == 6449
    assert m.capacity(8) == 6449 * 8
    assert m.fits([6449 * 4], 4) and not m.fits([6449 * 4 + 1], 4)


def test_gpt7b_time_by_hand():
    m = load_cost_model("flexsp-gpt-7b", world_size=64)
    # compute (a1 s^2 + a2 s) / d with a1 = 5.128e-6, a2 = 0.1839576; s = 4096, d = 8:
    # (86.0336... + 753.4903...) / 8 = 104.94049
    compute = (5.128e-6 * 4096**2 + 0.1839576 * 4096) / 8
    assert compute == pytest.approx(104.940487, abs=1e-6)
    assert m.seq_ms([4096], 1)[0] == pytest.approx(104.940487 * 8, abs=1e-5)
    # a2a: 4*2*32*4096*2 bytes = 2 MiB per token; / d / BW_8 = 2 / 8 / 96.5 ms per token
    assert m.a2a_ms_per_token[8] == pytest.approx(2 / 8 / 96.5)
    # 64 ranks over 32 heads: Ulysses 32 x ring 2; the all-to-all runs at BW_32 and each ring
    # step moves 3 * 32 * 2 * 4096 * 2 B = 1.5 MiB per token / 64 at BW_16 (ring crosses nodes).
    assert m.split(64) == (32, 2)
    assert m.a2a_ms_per_token[64] == pytest.approx(2 / 64 / 5.94)
    assert m.ring_step_ms_per_token[64] == pytest.approx(1.5 / 64 / 10.33)
    attn = 5.128e-6 * 4096**2 / 64
    lin = 0.1839576 * 4096 / 64
    step = 4096 * 1.5 / 64 / 10.33
    assert m.seq_ms([4096], 64)[0] == pytest.approx(
        attn + lin + 4096 * 2 / 64 / 5.94 + max(0.0, step - attn / 2)
    )
    published = flexsp_cost_model("flexsp-gpt-7b", 64, as_published=True)
    assert published.a2a_ms_per_token[64] == pytest.approx(2 / 64 / 4.87)
    assert published.heads is None and published.split(64) == (64, 1)
    assert m.seq_ms([4096], 8)[0] == pytest.approx(compute + 4096 * 2 / 8 / 96.5)
    # b1 once per group per micro-batch, and no a2a for d = 1
    assert m.group_ms([4096, 4096], 8) == pytest.approx(
        2 * (compute + 4096 * 2 / 8 / 96.5) + 629.3563
    )
    assert m.group_ms([1000], 1) == pytest.approx(5.128e-6 * 1e6 + 183.9576 + 629.3563)


def test_gpt13b_and_30b_by_hand():
    m13 = load_cost_model("flexsp-gpt-13b", world_size=64, max_seq_k=384)
    states = 14.03158187866211 * 16 * 1024 / 64
    assert m13.details["model_states_mib"] == pytest.approx(states)
    assert m13.tokens_per_rank == int((30 * 1024 - states) / 4.220439453)
    # 4*2*40*5120*2 bytes per token = 3.125 MiB
    # 40 heads: 16 = Ulysses 8 (inside a node, BW_8) x ring 2
    assert m13.split(16) == (8, 2)
    assert m13.a2a_ms_per_token[16] == pytest.approx(3.125 / 16 / 96.5)
    m30 = load_cost_model("flexsp-gpt-30b", world_size=64, max_seq_k=192)
    assert m30.tokens_per_rank == int(
        (30 * 1024 - 31.52513885498047 * 16 * 1024 / 64) / 3.417381836
    )
    assert m30.group_ms([], 2) == pytest.approx(2789.3644)
    assert m30.seq_ms([10000], 2)[0] == pytest.approx(
        (15.4262e-6 * 1e8 + 0.8035742 * 1e4) / 2
        + 1e4 * (4 * 2 * 60 * 6656 * 2 / 2**20) / 2 / 119.54
    )


def test_param_interpolation_between_192k_and_384k():
    m = flexsp_cost_model("flexsp-gpt-7b", 64, max_seq_k=256)
    assert m.details["params_b"] == pytest.approx(7.1174468994140625 + 0.732421875 / 3)


def test_unmeasured_sizes_take_the_next_larger_measured_bandwidth():
    m = load_cost_model("flexsp-gpt-7b", world_size=64, gpus_per_node=8)
    assert m.sizes == [1, 2, 3, 4, 5, 6, 7, 8, 16, 24, 32, 40, 48, 56, 64]
    assert m.split(24) == (8, 3)  # 32 heads: Ulysses 8 inside a node, ring of 3 nodes
    assert m.a2a_ms_per_token[24] == pytest.approx(2 / 24 / 96.5)  # BW_8
    assert m.split(40) == (8, 5)
    assert m.a2a_ms_per_token[6] == pytest.approx(2 / 6 / 119.54)  # Ulysses 2 x ring 3: BW_2
    big = load_cost_model("flexsp-gpt-7b", world_size=256, gpus_per_node=8)
    assert big.split(128) == (32, 4)
    flat = flexsp_cost_model("flexsp-gpt-7b", 256, as_published=True)
    assert flat.a2a_ms_per_token[128] == pytest.approx(2 / 128 / 4.87)  # above the table: BW_64


def test_memory_cap_below_model_states_is_an_error():
    with pytest.raises(ValueError, match="--memory-cap-gb"):
        load_cost_model("flexsp-gpt-30b", world_size=8, memory_cap_gb=30)


def test_exact_table_entries_are_used_before_interpolating():
    assert flexsp_cost_model("flexsp-gpt-30b", 64, max_seq_k=4).details["params_b"] == 30.538
    assert flexsp_cost_model("flexsp-gpt-13b", 64, max_seq_k=384).details["params_b"] == (
        14.03158187866211
    )


def test_any_split_priced_by_the_one_rule():
    """(u, r) given: all-to-all over u ranks (none for pure ring), r - 1 overlapped ring steps."""
    m = flexsp_cost_model("flexsp-gpt-7b", 64)
    s = 20_000
    attn, lin = 5.128e-6 * s * s / 64, 0.1839576 * s / 64
    step = s * 1.5 / 64 / 10.33  # pure-ring figure, every size > 1 (MHA: no KV copies)
    assert m.seq_ms([s], 64, (1, 64))[0] == pytest.approx(
        attn + lin + 63 * max(0, step - attn / 64)
    )
    # Ulysses over 8 ranks of a group of 64: the group-of-8 figure scaled by 8/64.
    a2a8 = 2 / 8 / 96.5
    assert m.seq_ms([s], 64, (8, 8))[0] == pytest.approx(
        attn + lin + a2a8 * 8 / 64 * s + 7 * max(0, step - attn / 8)
    )
    # the default split is the same rule with split=None
    assert m.seq_ms([s], 64)[0] == pytest.approx(m.seq_ms([s], 64, (32, 2))[0])
    assert m.seq_ms([s], 64, (1, 64), ring="hidden")[0] == pytest.approx(attn + lin)
    assert m.seq_ms([s], 64, (1, 64), ring="exposed")[0] == pytest.approx(attn + lin + 63 * step)
    with pytest.raises(InputError, match="does not multiply to group size 64"):
        m.seq_ms([s], 64, (3, 21))
    bare = dataclasses.replace(m, ring_step_ms_per_token={})
    with pytest.raises(InputError, match="no ring_step_ms_per_token figure for group size 64"):
        bare.group_ms([s], 64, (1, 64))
