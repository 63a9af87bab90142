"""The sampler's order against the oracle (issue 44, item 5): not only which pieces each epoch
draws but in which order.

``testing/sampler_oracle.py`` re-derives every dataset's permutation per epoch from the rule the
sampler documents (pieces in corpus order, ``default_rng([seed, epoch])`` or, for a blend's
dataset ``k >= 1``, ``default_rng([seed, k, epoch])``), checks that consecutive epochs differ, and
that a restart draws what the uninterrupted run draws. The plant
``blend-component-not-reshuffled`` (``testing/mutations.py:SAMPLER_MUTATIONS``: a blend's second
dataset repeats epoch 0's order forever) passes the once-per-epoch and deficit checks, which is
how the audit's bug survived; the order check catches it.
"""

from __future__ import annotations

import itertools
from collections import Counter

import numpy as np
import pytest

from megatron_hsp.step.sampler import (
    BlendComponent,
    BlendedBatchSampler,
    GlobalBatchSampler,
    SamplerConfig,
)
from megatron_hsp.testing.sampler_oracle import (
    coverage_failures,
    deficit_failures,
    epoch_orders,
    expected_units,
    order_failures,
    resume_failures,
)
from tests.testing.test_sampler_oracle import planted

SEED = 5
CAP = 50
# Three datasets: short documents (0 and 1 token ones never trained), long ones (some over the
# cap, split into pieces), and a small one that wraps many times.
LENGTHS = (
    [0, 1, 2, 2, 3, 7, 2, 19, 50, 51, 101, 102, 2, 33, 1, 5, 44, 2, 9, 12, 2, 26],
    [int(n) for n in np.random.default_rng(2).integers(20, 120, 13)],
    [3, 9, 4, 11, 6],
)
WEIGHTS = (0.3, 0.5, 0.2)
BASES = tuple(int(b) for b in np.cumsum([0, *(len(x) for x in LENGTHS)])[:-1])
STEPS = 90


def cfg(**kw) -> SamplerConfig:
    base = dict(seed=SEED, max_length=CAP, global_batch_docs=4, overlong="split")
    base.update(kw)
    return SamplerConfig(**base)


def blend(**kw) -> BlendedBatchSampler:
    comps = [
        BlendComponent(f"d{k}", w, BASES[k], np.asarray(x))
        for k, (w, x) in enumerate(zip(WEIGHTS, LENGTHS, strict=True))
    ]
    return BlendedBatchSampler(comps, cfg(**kw))


def units(k: int) -> Counter:
    return expected_units(LENGTHS[k], BASES[k], max_length=CAP)


def _stream(sampler, steps: int) -> list[tuple[int, int, int]]:
    return [(p.doc, p.offset, p.length) for _ in range(steps) for p in sampler.next_batch().pieces]


def _dataset(p: tuple[int, int, int]) -> int:
    return int(np.searchsorted(BASES, p[0], side="right")) - 1


def blend_failures(drawn: list[tuple[int, int, int]]) -> dict[str, list[str]]:
    """Every oracle check of a blend's draws: order (per dataset, its own stream), once per
    epoch, the deficit rule."""
    which = [_dataset(p) for p in drawn]
    out: dict[str, list[str]] = {"order": [], "coverage": []}
    for k in range(len(LENGTHS)):
        mine = [p for p, d in zip(drawn, which, strict=True) if d == k]
        out["order"] += order_failures(mine, units(k), SEED, None if k == 0 else k, f"d{k}")
        out["coverage"] += coverage_failures(mine, units(k), f"d{k}")
    out["deficit"] = deficit_failures(which, [n for _, _, n in drawn], WEIGHTS)
    return out


def epochs_drawn(drawn: list[tuple[int, int, int]]) -> list[float]:
    which = [_dataset(p) for p in drawn]
    return [which.count(k) / sum(units(k).values()) for k in range(len(LENGTHS))]


# ------------------------------------------------------------------------- the oracle itself
def test_the_rule_gives_fresh_permutations_and_the_oracle_fails_wrong_orders():
    u = expected_units([5, 3, 120, 7, 2, 9], max_length=CAP)
    orders = epoch_orders(u, SEED, 4)
    assert all(sorted(o) == sorted(u) for o in orders)
    assert all(a != b for a, b in itertools.pairwise(orders))
    assert epoch_orders(u, SEED, 2, stream=1) != orders[:2]  # a blend's other stream
    good = [p for o in orders for p in o]
    assert order_failures(good, u, SEED) == []
    assert order_failures(good[:17], u, SEED) == []  # a partial last epoch
    assert order_failures(good, u, SEED, stream=1)  # the wrong stream
    swapped = list(good)
    swapped[9], swapped[10] = swapped[10], swapped[9]  # epoch 1, draws 1 and 2
    (bad,) = order_failures(swapped, u, SEED, what="x")
    assert bad.startswith("x epoch 1 (complete): draw 1 of the epoch")
    # A stale epoch 2 (epoch 1 again, as a partial window too): a permutation still, so
    # coverage passes; the order check says why.
    stale = orders[0] + orders[1] + orders[1] + orders[1][:3]
    assert coverage_failures(stale, u) == []
    bad = order_failures(stale, u, SEED)
    assert any("epoch 2 (complete): the same order as epoch 1" in b for b in bad), bad
    assert any("epoch 3 (partial, 3 draws): the same order as epoch 2" in b for b in bad)
    # Permutations that coincide by the rule are not called stale (one piece, or chance).
    one = expected_units([4])
    assert order_failures([(0, 0, 4)] * 3, one, SEED) == []
    assert resume_failures(good, good) == []
    assert "draw 9" in resume_failures(good, swapped)[0]
    assert "draws after the restart" in resume_failures(good, good[:-1])[0]


# ----------------------------------------------------------------- the sampler against it
@pytest.mark.parametrize("kw", [{}, {"global_batch_docs": None, "token_budget": 120}])
def test_a_lone_dataset_draws_the_rules_order_every_epoch(kw):
    sampler = GlobalBatchSampler(LENGTHS[0], cfg(**kw))
    drawn = _stream(sampler, STEPS)
    u = expected_units(LENGTHS[0], max_length=CAP)
    assert len(drawn) >= 3 * sum(u.values())
    assert order_failures(drawn, u, SEED) == []


@pytest.mark.parametrize("kw", [{}, {"global_batch_docs": None, "token_budget": 150}])
def test_each_blend_dataset_draws_its_own_streams_order_every_epoch(kw):
    """Three datasets, each through at least 3 epochs (the small one more than 20)."""
    drawn = _stream(blend(**kw), STEPS)
    assert min(epochs_drawn(drawn)) >= 3, epochs_drawn(drawn)
    assert blend_failures(drawn) == {"order": [], "coverage": [], "deficit": []}


def test_a_blend_dataset_that_never_reshuffles_is_caught_by_the_order_check_alone():
    """The audit's bug (issue 44, class 4): the blend's later datasets repeat epoch 0's order.
    Every piece is still drawn once per epoch and the deficit rule holds, so the checks before
    the order check pass; the order check names the stale epochs of datasets 1 and 2."""
    with planted("blend-component-not-reshuffled"):
        drawn = _stream(blend(), STEPS)
    bad = blend_failures(drawn)
    assert bad["coverage"] == [] and bad["deficit"] == []
    for k in (1, 2):
        assert any(f.startswith(f"d{k} epoch 1 (complete): draw") for f in bad["order"])
        assert any(
            f.startswith(f"d{k} epoch 1 (complete): the same order as epoch 0")
            for f in bad["order"]
        ), bad["order"]
    assert not any(f.startswith("d0") for f in bad["order"])


def _resumed(how: str, after: int, total: int) -> list[tuple[int, int, int]]:
    """A blend restarted after ``after`` steps (a new process: a fresh sampler) by ``how``."""
    first = blend()
    head = _stream(first, after)
    again = blend()
    if how == "fast_forward":  # what the Megatron hooks run: replay args.iteration batches
        again.fast_forward(after)
    else:
        again.load_state_dict(first.state_dict())
    return head + _stream(again, total - after)


@pytest.mark.parametrize("how", ["fast_forward", "load_state_dict"])
@pytest.mark.parametrize("after", [3, 40, 75])
def test_a_restart_resumes_the_same_order(how, after):
    """Restarts at the end of the small dataset's epoch 0 (the others mid-epoch 0), in epochs
    1 / 1 / 17 and in epochs 3 / 2 / 31 (a fresh sampler must rebuild that epoch's
    permutation): the resumed run draws the uninterrupted run's pieces, each dataset in its
    rule's order."""
    whole = _stream(blend(), STEPS)
    resumed = _resumed(how, after, STEPS)
    assert resume_failures(whole, resumed, how) == []
    assert blend_failures(resumed)["order"] == []


def test_a_restart_that_repeats_a_piece_is_caught_by_the_order_checks_too():
    whole = _stream(blend(), STEPS)
    with planted("document-twice-after-restart"):
        resumed = _resumed("fast_forward", 40, STEPS)
    assert resume_failures(whole, resumed)
    assert blend_failures(resumed)["order"]


def test_the_order_check_does_not_fire_on_the_other_sampler_plants_by_accident():
    """``blend-by-documents`` changes which dataset each draw comes from, never the order
    inside one: the order check passes and the deficit check (its own) fails."""
    with planted("blend-by-documents"):
        drawn = _stream(blend(), STEPS)
    bad = blend_failures(drawn)
    assert bad["order"] == [] and bad["deficit"]


def test_megatrons_data_flags_give_each_splits_datasets_their_rules_order(tmp_path):
    """The path users run: ``--data-path 0.5 A 0.5 B --split 7,1,1`` read by
    ``hsp_data_from_args``, one blend sampler per split (``build_split_sampler``, as the Megatron
    hooks build them; evaluation's with the training seed): in every split, dataset ``k``
    draws ``default_rng([seed, k, epoch])``'s order (``[seed, epoch]`` for the first)."""
    import argparse

    from megatron_hsp.megatron.datasets import build_split_sampler, hsp_data_from_args
    from megatron_hsp.step.corpus import write_indexed_dataset
    from megatron_hsp.step.documents import DocumentIndex
    from megatron_hsp.testing.sampler_oracle import megatron_split

    lengths = ([int(n) for n in np.random.default_rng(1).integers(2, 30, 41)], LENGTHS[1])
    prefixes = []
    for name, x in zip("ab", lengths, strict=True):
        write_indexed_dataset(tmp_path / name, [np.arange(n) % 97 for n in x])
        prefixes.append(str(tmp_path / name))
    args = argparse.Namespace(data_path=["0.5", prefixes[0], "0.5", prefixes[1]], split="7,1,1")
    data = hsp_data_from_args(args)
    indices = {p: DocumentIndex(p) for p in data.prefixes}
    firsts = [0, len(lengths[0])]

    def failures() -> list[str]:
        bad = []
        for split in ("train", "valid", "test"):
            sampler = build_split_sampler(data, split, indices, cfg())
            drawn = _stream(sampler, 30)
            for k, x in enumerate(lengths):
                lo, hi = megatron_split(len(x), "7,1,1")[split]
                u = expected_units(x[lo:hi], firsts[k] + lo, max_length=CAP)
                mine = [p for p in drawn if (p[0] >= firsts[1]) == (k == 1)]
                assert len(mine) >= 2 * sum(u.values()), (split, k)
                bad += order_failures(mine, u, SEED, None if k == 0 else k, f"{split} d{k}")
        return bad

    assert failures() == []
    with planted("blend-component-not-reshuffled"):
        bad = failures()
    assert {b.split(" epoch")[0] for b in bad} == {"train d1", "valid d1", "test d1"}, bad
