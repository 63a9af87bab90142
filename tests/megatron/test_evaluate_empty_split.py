"""``evaluate()`` under ``--hsp`` on a split without documents gives what stock ``evaluate()``
gives on zero iterations (stock itself, on the same flags, would call ``pretrain_gpt.py``'s
``get_batch`` on no iterator: not run here, that script is not installed).

A user's ``--split 100,0,0`` (or no ``--valid-data-path``) with ``--eval-iters`` > 0: HSP's
provider hands Megatron no validation or test iterator, and Megatron's own
``build_train_valid_test_data_iterators`` still sets ``do_valid`` (its validation loaders are a
list, ``[None]``, which is not None; ``do_test`` stays off), so ``train()`` calls ``evaluate()``
with no iterator every ``--eval-interval`` steps (and ``pretrain()`` the test split where
``do_test`` is on: evaluated here too when Megatron sets it). The patched
``get_forward_backward_func`` (``megatron/patches.py``) then runs nothing and returns no loss.

On 2 gloo CPU ranks, through Megatron's own parser, ``install``, HSP's provider, Megatron's
iterator builder and Megatron's ``evaluate()`` (the patched schedule), against the stock side:
the stock model (same flags without ``--hsp``) through unpatched ``evaluate()`` with zero
evaluation iterations, what stock evaluates on zero documents. Equal: the loss dictionary (empty),
the non-loss data and time-limit flag, no forward call of the model, the weights untouched, the
model back in training mode; besides, the training sampler is not moved (the next training
batch is an uninterrupted run's) and ``consumed_valid_samples`` moves by Megatron's own count
(``evaluate()`` adds ``--eval-global-batch-size`` per iteration). The planted
``empty-split-evaluates-training-data`` (``mutations.EVALUATION_MUTATIONS``) must fail it.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import sys
from typing import Any

import pytest

from megatron_hsp.testing.mutations import EVALUATION_MUTATIONS

EVAL_ITERS = 2
PLANT = "empty-split-evaluates-training-data"


def _evaluate(training: Any, forward_step: Any, iterator: Any, model: list, config: Any, **kw):
    """Megatron's ``evaluate()``, with the model's forward calls counted and its weights and
    mode read around it."""
    import torch

    calls = [0]
    handles = [
        m.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1)) for m in model
    ]
    before = {n: p.detach().clone() for m in model for n, p in m.named_parameters()}
    try:
        losses, non_loss, timelimit = training.evaluate(
            forward_step, iterator, model, None, config, verbose=False, **kw
        )
    finally:
        for h in handles:
            h.remove()
    after = dict((n, p) for m in model for n, p in m.named_parameters())
    return {
        "losses": {k: [float(x) for x in torch.as_tensor(v).view(-1)] for k, v in losses.items()},
        "non_loss": non_loss,
        "timelimit": bool(timelimit),
        "forward_calls": calls[0],
        "weights_changed": sorted(n for n, w in before.items() if not torch.equal(w, after[n])),
        "training_mode": all(m.training for m in model),
    }


def _stock(flags: list[str]) -> dict[str, Any]:
    """Stock Megatron: the same flags without ``--hsp``, unpatched ``evaluate()`` with zero
    evaluation iterations (zero documents to evaluate)."""
    import megatron.training.training as training

    from megatron_hsp.testing.megatron_loop.models import (
        _megatron_args,
        _set_megatron_globals,
        _stock_model,
        _wrap,
    )

    args = _megatron_args(flags)
    args.consumed_valid_samples = 0
    _set_megatron_globals(args)
    model, _, _, config = _wrap(args, _stock_model(args))

    def forward_step(data_iterator: Any, model: Any) -> Any:
        raise AssertionError("stock evaluate() ran a forward step on zero iterations")

    out = _evaluate(training, forward_step, None, model, config, eval_iters=0)
    out["consumed_valid_samples"] = int(args.consumed_valid_samples)
    return out


def _hsp(argv: list[str], plant: str | None) -> dict[str, Any]:
    """The HSP side as users run it: validation and test evaluated on no iterator."""
    import megatron.training.training as training

    from megatron_hsp.megatron import hooks, patches
    from megatron_hsp.testing.megatron_loop.hsp_side import (
        _close_hsp_run,
        _hsp_iterators,
        _start_hsp,
    )
    from megatron_hsp.testing.megatron_loop.models import _hsp_model, _wrap

    args, provider, forward_step = _start_hsp(argv)
    with contextlib.ExitStack() as stack:
        stack.callback(_close_hsp_run, hooks, patches)
        if plant is not None:
            (mutation,) = [m for m in EVALUATION_MUTATIONS if m.name == plant]
            stack.callback(mutation.plant())
        model, _, _, config = _wrap(args, _hsp_model(args))
        _, valid_it, test_it = _hsp_iterators(provider)
        run = hooks.active_run()

        def next_training_batch() -> list[tuple[int, int, int]]:
            fresh = copy.deepcopy(run.pipeline.sampler)
            return [(p.doc, p.offset, p.length) for p in fresh.next_batch().pieces]

        expected_next = next_training_batch()
        out: dict[str, Any] = {
            "do_valid": bool(args.do_valid),
            "do_test": bool(args.do_test),
            "iterators": [valid_it is None, test_it is None],
            "eval_global_batch_size": int(args.eval_global_batch_size),
        }
        for split, iterator in (("valid", valid_it), ("test", test_it)):
            if not out[f"do_{split}"]:  # train() / pretrain() would not evaluate it
                continue
            before = int(args.consumed_valid_samples)
            try:
                out[split] = _evaluate(training, forward_step, iterator, model, config)
            except Exception as exc:  # a bug of this path may raise: the check reports it
                out[split] = {"error": f"{type(exc).__name__}: {exc}"}
            out[split]["consumed_valid_samples"] = int(args.consumed_valid_samples) - before
        out["training_sampler_moved"] = next_training_batch() != expected_next
        return out


def _worker(rank: int, world_size: int, prefix: str, cost_path: str, plant: str | None):
    from megatron_hsp.testing.cpu_shims import cpu_device_arch_version, cpu_megatron_training
    from megatron_hsp.testing.megatron_loop.hsp_side import _hsp_argv
    from megatron_hsp.testing.megatron_loop.options import MODEL_FLAGS, LoopOptions

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    os.environ["LOCAL_WORLD_SIZE"] = str(world_size)
    options = LoopOptions(group_sizes=(2,))
    evaluation = ["--eval-iters", str(EVAL_ITERS), "--eval-interval", "1"]
    with (
        contextlib.redirect_stdout(sys.stderr),
        cpu_megatron_training(),
        cpu_device_arch_version(),
    ):
        stock = _stock([*MODEL_FLAGS, *options.flags(), *evaluation])
        hsp = _hsp([*_hsp_argv(options, (prefix,), cost_path, world_size), *evaluation], plant)
    return {"stock": stock, "hsp": hsp}


def _failures(result: dict[str, Any]) -> list[str]:
    """What differs from stock (or from Megatron's own bookkeeping); empty: the check passes."""
    stock, hsp = result["stock"], result["hsp"]
    out = []
    if not (hsp["do_valid"] and all(hsp["iterators"])):
        out.append(f"not the empty-split path: {hsp}")
    for split in ("valid", "test"):
        got = hsp.get(split)
        if got is None:  # Megatron's do_test is off for a test split without a loader
            continue
        if "error" in got:
            out.append(f"{split}: evaluate() raised {got['error']}")
            continue
        for key in ("losses", "non_loss", "timelimit", "forward_calls", "weights_changed"):
            if got[key] != stock[key]:
                out.append(f"{split}: {key} {got[key]!r}, stock {stock[key]!r}")
        if not got["training_mode"] or not stock["training_mode"]:
            out.append(f"{split}: the model was not put back in training mode")
        counted = EVAL_ITERS * hsp["eval_global_batch_size"]
        if got["consumed_valid_samples"] != counted:
            out.append(
                f"{split}: consumed_valid_samples moved by {got['consumed_valid_samples']}, "
                f"Megatron's evaluate() counts {counted}"
            )
    if hsp["training_sampler_moved"]:
        out.append("evaluation moved the training sampler")
    return out


def _run(tmp_path, plant: str | None) -> list[str]:
    from megatron_hsp.planner.paths import atomic_write
    from megatron_hsp.testing.dist import raise_rank_errors, run_distributed
    from megatron_hsp.testing.megatron_loop import LoopOptions, write_corpus

    prefix = str(tmp_path / "docs")
    write_corpus(prefix)
    cost_path = str(tmp_path / "cost.json")
    atomic_write(cost_path, json.dumps(LoopOptions(group_sizes=(2,)).cost_model()))
    results = raise_rank_errors(
        run_distributed(_worker, 2, prefix, cost_path, plant, timeout_s=240.0)
    )
    return sorted({f for r in results for f in _failures(r)})


@pytest.mark.spawns
def test_evaluation_of_a_split_without_documents_is_stocks(tmp_path):
    """Validation and test evaluated on splits without documents: what stock gives, no hang."""
    assert _run(tmp_path, None) == []


@pytest.mark.spawns
def test_the_empty_split_plant_is_caught(tmp_path):
    """The planted bug (the training data evaluated instead) makes the check fail."""
    failures = _run(tmp_path, PLANT)
    print("\n".join(failures))
    assert failures
