"""The mutation table itself (single process): planting rebinds the real attribute everywhere it
is bound in megatron_hsp and undo restores it; each wrapper really breaks what it says; and the
caught rule reports a surviving mutation (so ``selftest --mutations`` can fail)."""

from __future__ import annotations

import importlib
import sys

import pytest
import torch

from megatron_hsp.testing.mutations import CATCH_MARGIN, MUTATIONS, SAMPLER_MUTATIONS, by_name


def _target(where: str):
    module_name, _, path = where.partition(":")
    owner = importlib.import_module(module_name)
    *outer, attr = path.split(".")
    for part in outer:
        owner = getattr(owner, part)
    return owner, attr


@pytest.mark.parametrize("mutation", MUTATIONS + SAMPLER_MUTATIONS, ids=lambda m: m.name)
def test_plant_rebinds_everywhere_and_undo_restores(mutation):

    owner, attr = _target(mutation.where)
    original = owner.__dict__[attr] if isinstance(owner, type) else getattr(owner, attr)
    holders = [
        m
        for n, m in sys.modules.items()
        if n.startswith("megatron_hsp.") and getattr(m, attr, None) is original
    ]
    undo = mutation.plant()
    try:
        now = owner.__dict__[attr] if isinstance(owner, type) else getattr(owner, attr)
        assert now is not original
        if mutation.everywhere:
            assert all(getattr(m, attr) is not original for m in holders)
    finally:
        undo()
    now = owner.__dict__[attr] if isinstance(owner, type) else getattr(owner, attr)
    assert now is original
    assert all(getattr(m, attr) is original for m in holders)


def test_per_sample_loss_weighs_documents_not_tokens():
    from megatron_hsp.runtime import loss

    (m,) = by_name(["per-sample-loss"])
    out = torch.tensor([[1.0, 1.0, 1.0, 0.0, 5.0, 0.0]])  # doc of 3 loss tokens, doc of 1
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0, 1.0, 0.0]])
    good = loss.microbatch_loss(out, mask)
    undo = m.plant()
    try:
        bad = loss.microbatch_loss(out, mask)
    finally:
        undo()
    assert float(good[0]) == 8.0 and int(good[1]) == 4
    assert float(bad[0]) == pytest.approx((1.0 + 5.0) / 2 * 4) and int(bad[1]) == 4


def test_rope_shift_stays_inside_the_table():
    from megatron_hsp.runtime import attention

    (m,) = by_name(["rope-positions-shifted"])
    cu = torch.tensor([0, 1, 5, 12], dtype=torch.int32)
    good = attention.positions_in_documents(cu, 12)
    undo = m.plant()
    try:
        bad = attention.positions_in_documents(cu, 12)
    finally:
        undo()
    assert not torch.equal(good, bad)
    assert int(bad.min()) >= 0 and int(bad.max()) <= int(good.max())
    assert bad[0] == 0 and torch.equal(bad[1:3], good[1:3])  # first halves untouched


def test_caught_rule_reports_survivors():
    from megatron_hsp.testing.selftest import _mutation_result
    from megatron_hsp.testing.tolerances import CPU

    def row(loss_rel, grad_rel, error=None):
        cases = [{"loss_rel_diff": loss_rel, "max_rel_grad_diff": grad_rel}]
        return {"cases": [] if error else cases, "error": error, "seconds": 1.0}

    name = MUTATIONS[0].name
    loud = _mutation_result(name, [row(0.0, CPU.grad * CATCH_MARGIN)] * 4)
    assert loud.caught and loud.margin == pytest.approx(CATCH_MARGIN)
    quiet = _mutation_result(name, [row(CPU.loss * 50, CPU.grad * 99)] * 4)
    assert not quiet.caught  # misses the tolerance, but not by the required margin
    refused = _mutation_result(name, [row(0, 0, "RuntimeError: token accounting")] * 4)
    assert refused.caught and refused.loss_rel_diff is None
    partial = _mutation_result(name, [row(0, 0, "RuntimeError: x")] + [row(0.0, 0.0)] * 3)
    assert not partial.caught


def test_unknown_mutation_name_is_refused():
    with pytest.raises(KeyError, match="unknown mutations"):
        by_name(["no-such-bug"])


def test_one_parameter_scale_touches_exactly_the_smallest_parameter(monkeypatch):
    from megatron_hsp.runtime import loss

    monkeypatch.setattr(loss.dist, "all_reduce", lambda t, group=None: None)
    params = [torch.nn.Parameter(torch.ones(4, 3)), torch.nn.Parameter(torch.ones(2))]
    for p in params:
        p.grad = torch.ones_like(p)
    (m,) = by_name(["one-parameter-gradient-scaled"])
    undo = m.plant()
    try:
        loss.allreduce_gradients(params, None)
    finally:
        undo()
    from megatron_hsp.testing.mutations import GRAD_SCALE

    assert torch.equal(params[0].grad, torch.ones(4, 3))
    assert torch.allclose(params[1].grad, torch.full((2,), GRAD_SCALE))


def test_position_shift_changes_only_later_positions():
    import numpy as np

    from megatron_hsp.planner.plan import Group
    from megatron_hsp.runtime import dispatch

    (m,) = by_name(["position-ids-shifted"])
    docs = [np.arange(12), np.arange(5)]
    batch = dispatch.GlobalBatch.from_documents(docs)
    group = Group(ranks=(0,), seq_ids=(0, 1), lengths=(12, 5))
    good = dispatch.pack_group_slice(batch, group, 0)
    undo = m.plant()
    try:
        bad = dispatch.pack_group_slice(batch, group, 0)
    finally:
        undo()
    assert np.array_equal(good.input_ids, bad.input_ids)
    changed = good.position_ids != bad.position_ids
    assert changed.any() and np.all(good.position_ids[changed] >= 8)


def test_a_plant_counts_the_calls_of_its_broken_code():
    """``Planted.calls``: what the acceptance kit reads to tell a plant its routes never ran
    (no verdict) from one they ran and missed. A function plant counts its calls; the SDPA
    plant (a stand-in ``torch.nn.functional``) counts its SDPA only, not the functions it
    passes through."""
    from megatron_hsp.runtime import backends, loss

    (per_sample,) = by_name(["per-sample-loss"])
    planted = per_sample.plant()
    try:
        assert planted.calls() == 0
        out = torch.ones(1, 4)
        loss.microbatch_loss(out, torch.ones(1, 4))
        loss.microbatch_loss(out, torch.ones(1, 4))
        assert planted.calls() == 2
    finally:
        planted()
    (non_causal,) = by_name(["non-causal-attention"])
    planted = non_causal.plant()
    try:
        backends.F.softmax(torch.ones(3), dim=0)  # passed through, not the broken code
        assert planted.calls() == 0
        q = torch.randn(1, 2, 4, 8)
        backends.F.scaled_dot_product_attention(q, q, q, is_causal=True)
        assert planted.calls() == 1
    finally:
        planted()


def test_kit_gives_no_verdict_on_a_plant_its_routes_never_ran(monkeypatch, capsys):
    """A plant whose broken code ran on no rank (SDPA where bf16 attention runs the varlen
    kernel, as on an H100, docs/gpu-validation.md) says nothing about the kit: no "missed it",
    exit 2 and a line naming the plant; one that ran and was missed still says so."""
    from megatron_hsp.testing import acceptance

    def doc(calls: int, ok: bool) -> dict:
        case = {
            "name": "one-group-of-all", "dtype": "bf16", "backend": "torch", "tf32": False,
            "loss_rel_diff": 0.0, "max_rel_grad_diff": 0.0, "group_sizes": [2],
            "tolerances": {"loss_rel": 1e-2, "grad_rel": 5e-2}, "ok": ok, "step_s": 0.1,
            "tokens_per_s": {}, "predicted_tokens_per_s": None, "routes": {"torch-varlen": 4},
        }  # fmt: skip
        kit = {
            "world_size": 2, "backend": "nccl", "device": "H100", "torch": "2.9",
            "transformer_engine": None, "reference": "fp32 stock", "tf32": {}, "seconds": 1.0,
            "planted": "non-causal-attention", "planted_calls": calls,
        }  # fmt: skip
        return {"ok": ok, "kit": kit, "cases": [case]}

    monkeypatch.setattr(acceptance, "fp32_without_tf32", lambda: {})
    for calls, ok, code, says in (
        (0, True, 2, "never ran"),
        (5, True, 0, "missed it"),
        (5, False, 1, "caught it"),
    ):
        made = doc(calls, ok)
        monkeypatch.setattr(acceptance, "run_acceptance", lambda *a, made=made: made)
        assert acceptance.main("bf16", "cpu", False, plant="non-causal-attention") == code
        out = capsys.readouterr()
        assert says in out.out
        assert ("NO VERDICT" in out.out) == (calls == 0)
        assert ("missed it" in out.out) == (calls > 0 and ok)


def test_kit_refuses_up_front_a_plant_it_cannot_see(monkeypatch):
    """A bug between ranks on one rank, or one only learned absolute position embeddings read on
    the kit's RoPE models, would pass and read as "missed it": refused before any run, with the
    plants that do apply."""
    from megatron_hsp.planner.errors import InputError
    from megatron_hsp.testing import acceptance

    def never(*args, **kwargs):
        raise AssertionError("the kit ran a plant it cannot see")

    monkeypatch.setattr(acceptance, "run_acceptance", never)
    monkeypatch.setattr(acceptance, "fp32_without_tf32", lambda: {})
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(InputError, match="fewer than 2 ranks") as one:
        acceptance.main("fp32", "cpu", False, plant="one-rank-loss-normalisation")
    assert "per-sample-loss" in str(one.value)
    assert "token-lost-at-group-boundary" not in str(one.value).split("see here:")[1]
    monkeypatch.setenv("WORLD_SIZE", "8")
    with pytest.raises(InputError, match="learned absolute"):
        acceptance.main("fp32", "cpu", False, plant="position-ids-shifted")
    for name in ("one-rank-loss-normalisation", "token-lost-at-group-boundary"):
        acceptance.refuse_unseen_plant(name, 2)  # seen from two ranks on
    assert [m.name for m in MUTATIONS if m.unseen(1, "rope")] == [
        "token-lost-at-group-boundary",
        "wrong-ring-chunk-order",
        "gradients-reduced-over-wrong-group",
        "position-ids-shifted",
        "one-rank-loss-normalisation",
    ]
    assert by_name(["position-ids-shifted"])[0].unseen(8, "learned_absolute") is None
