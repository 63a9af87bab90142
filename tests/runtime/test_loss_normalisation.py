"""Per-token loss across groups of different token counts, and the single gradient all-reduce.

The gradient identity the schedule relies on, checked without processes: split a batch's tokens
over "ranks" as dispatch does (groups of different sizes and token counts), let each rank
back-propagate its slice's loss sum / N_global, and the SUM of the ranks' gradients is exactly
the single-device gradient -- while averaging per group (what per-sample normalisation does) is not.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megatron_hsp.runtime.dispatch import GlobalBatch, dispatch_all
from megatron_hsp.runtime.loss import LossAccumulator, allreduce_gradients, microbatch_loss
from megatron_hsp.testing.manual_plan import manual_plan

LENGTHS = [17, 9, 5, 3, 2, 1, 1, 12]


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Embedding(32, 8), torch.nn.Linear(8, 32))


def _token_loss(model, ids, labels):
    return torch.nn.functional.cross_entropy(model(ids), labels, reduction="none")


def _grads(model):
    return [p.grad.detach().clone() for p in model.parameters()]


@pytest.fixture
def setup():
    rng = np.random.default_rng(0)
    batch = GlobalBatch.from_documents([rng.integers(0, 32, n) for n in LENGTHS])
    plan = manual_plan(4, LENGTHS, [[(2, [0, 5]), (1, [1, 6]), (1, [2])], [(4, [3, 4, 7])]])
    return batch, plan


def _reference(batch):
    model = _model()
    ids = torch.from_numpy(batch.tokens)
    labels = torch.from_numpy(np.append(batch.tokens[1:], 0))
    mask = torch.ones(batch.num_tokens)
    mask[torch.from_numpy(batch.offsets[1:] - 1)] = 0
    loss = (_token_loss(model, ids, labels) * mask).sum() / batch.num_loss_tokens  # plain torch
    loss.backward()
    return float(loss.detach()), _grads(model)


def _distributed(batch, plan, normalise):
    packs = dispatch_all(batch, plan)
    total = [torch.zeros_like(p) for p in _model().parameters()]
    acc = LossAccumulator()
    for slot_packs in packs.values():
        for p in slot_packs:
            if p.empty:
                continue
            model = _model()  # every rank holds the same parameters
            loss_sum, num_tokens = microbatch_loss(
                _token_loss(model, torch.from_numpy(p.input_ids), torch.from_numpy(p.labels)),
                torch.from_numpy(p.loss_mask),
            )
            assert int(num_tokens) == p.num_loss_tokens
            acc.add(loss_sum, int(num_tokens))
            group_tokens = sum(batch.lengths[s] - 1 for s in p.seq_ids)
            denom = batch.num_loss_tokens if normalise == "global" else max(group_tokens, 1)
            (loss_sum / denom).backward()
            for t, g in zip(total, _grads(model), strict=True):
                t += g
    return acc, total


def test_sum_of_rank_gradients_is_the_single_device_gradient(setup):
    batch, plan = setup
    ref_loss, ref = _reference(batch)
    acc, got = _distributed(batch, plan, "global")
    assert acc.num_tokens == batch.num_loss_tokens == sum(LENGTHS) - len(LENGTHS)
    assert acc.loss_sum / acc.num_tokens == pytest.approx(ref_loss, rel=1e-6)
    for g, r in zip(got, ref, strict=True):
        assert float((g - r).norm() / r.norm()) < 1e-6


def test_per_group_mean_would_be_wrong(setup):
    batch, plan = setup
    _, ref = _reference(batch)
    _, got = _distributed(batch, plan, "per-group")
    worst = max(float((g - r).norm() / r.norm()) for g, r in zip(got, ref, strict=True))
    assert worst > 1e-2  # the check above can fail: groups differ in token counts


def test_microbatch_loss_is_megatrons_per_token_contract():
    loss = torch.tensor([[1.0, 2.0, 100.0, 3.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0, 1.0]])
    loss_sum, num_tokens = microbatch_loss(loss, mask)
    assert float(loss_sum) == 6.0
    assert num_tokens.dtype == torch.int and int(num_tokens) == 3


def test_allreduce_gradients_issues_one_flat_collective_consistency(monkeypatch):
    """Consistency only (a fake all_reduce that ignores its group): the ONE flat collective and
    the zero-join of gradient-less parameters. The group is checked for real below."""
    import torch.distributed as dist

    calls = []

    def fake_all_reduce(t, group=None):
        calls.append(t.numel())
        t.mul_(3)  # as if three identical ranks summed

    monkeypatch.setattr(dist, "all_reduce", fake_all_reduce)
    model = torch.nn.Linear(3, 2)
    model.weight.grad = torch.ones_like(model.weight)  # bias has no grad (trained nothing)
    n = allreduce_gradients(model.parameters(), group=None)
    assert calls == [n] and n == 3 * 2 + 2
    assert torch.equal(model.weight.grad, torch.full((2, 3), 3.0))
    assert torch.equal(model.bias.grad, torch.zeros(2))


def _subgroup_worker(rank: int, world: int) -> dict:
    import torch.distributed as dist

    halves = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    mine = halves[rank // 2]
    model = torch.nn.Linear(3, 2)
    model.weight.grad = torch.full_like(model.weight, float(rank + 1))
    if rank != 0:  # rank 0 trained nothing: its bias joins with zeros
        model.bias.grad = torch.full_like(model.bias, 10.0 * (rank + 1))
    allreduce_gradients(model.parameters(), mine)
    return {"weight": float(model.weight.grad[0, 0]), "bias": float(model.bias.grad[0])}


@pytest.mark.spawns
@pytest.mark.dist
def test_allreduce_gradients_sums_over_its_group_only_on_real_gloo_subgroups():
    """Independent of the code's own collective calls: 4 gloo processes, two real subgroups;
    each rank's gradient must be the sum over ITS subgroup and nothing else."""
    from megatron_hsp.testing.dist import raise_rank_errors, run_distributed

    out = raise_rank_errors(run_distributed(_subgroup_worker, 4, timeout_s=120))
    assert [r["weight"] for r in out] == [1 + 2, 1 + 2, 3 + 4, 3 + 4]
    assert [r["bias"] for r in out] == [0 + 20, 0 + 20, 30 + 40, 30 + 40]
