"""The online refit under Megatron's own ``train_step`` on gloo CPU ranks.

What runs on each rank: Megatron's parser and ``validate_args`` on a user's flags plus ``--hsp``
(``megatron_loop``'s machinery: model, DDP, optimizer, the ``config`` hooks ``train()`` sets),
then ``megatron.training.training.train_step`` (patched by ``install``) for a few steps, once
with the refit on (``--hsp-refit-out``) and once with ``--hsp-no-refit``.

The cost model handed to ``--hsp-cost-model`` is the loop's own (a file, as a user's fit would
be). In the run with the refit on, the micro-batch clock reads constructed times instead of the
wall clock (``records_x``): every group takes ``records_x`` times what the starting model prices
it at, the same on every member, so each update is decided by the refit alone (the wall clock on a
shared CPU put the first update anywhere from a large move to none; a test comparing prices with a
5% margin then failed under load). ``delay_s`` puts a sleep inside the
model's forward on slot 0 in the *last* micro-batch of every step (a forward pre-hook, i.e.
after the micro-batch started): the refit records must show it in that micro-batch's group of
slot 0 and nowhere else (``tests/megatron/test_megatron_refit.py``).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
from typing import Any

from megatron_hsp.step.mbclock import MicrobatchClock
from megatron_hsp.testing.megatron_loop.options import LoopOptions

SYNC = "--hsp-sync-planner"
# Groups of 1 and 2 over 4 slots: every micro-batch has at least two groups, so a delay on
# slot 0's group can be told apart from the other groups of the same micro-batch.
OPTIONS = LoopOptions(group_sizes=(1, 2), tokens_per_rank=100)


# The constructed records of the run with the refit on: each group took this many times the
# starting model's price (``_one_run``'s ``records_x``).
RECORDS_X = 3.0


def _one_run(
    rank: int,
    world_size: int,
    argv: list[str],
    steps: int,
    extra_s: float = 0.0,
    records_x: float | None = None,
) -> dict[str, Any]:
    import megatron.training.training as training
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_hsp.megatron import hooks, patches
    from megatron_hsp.testing.megatron_loop.hsp_side import (
        _close_hsp_run,
        _hsp_iterators,
        _start_hsp,
    )
    from megatron_hsp.testing.megatron_loop.models import _hsp_model, _wrap

    args, provider, forward_step = _start_hsp(argv)
    real_now = MicrobatchClock._now
    offset = [0.0]
    MicrobatchClock._now = lambda self: real_now(self) + offset[0]  # type: ignore[method-assign]
    try:
        if records_x is not None:
            MicrobatchClock._now = _constructed_clock(records_x)  # type: ignore[method-assign]
        (module,) = _hsp_model(args)  # one chunk: no pipeline here
        model, optimizer, scheduler, config = _wrap(args, [module])
        run = hooks.active_run()
        assert run is not None

        def delay(_module: Any, _inputs: Any) -> None:
            # Inside the forward: after the iterator handed out the micro-batch (its start mark).
            # The iterator has handed out the step's last micro-batch (hooks._next_input).
            if extra_s and run.read.get(0, 0) == len(run.inputs):
                last = run.current.plan.microbatches[-1]
                if 0 in last.group_of(run.registry.slot).ranks:
                    offset[0] += extra_s

        module.register_forward_pre_hook(delay)
        # Whether the step's micro-batches had ended when Megatron's gradient reduction began.
        ended_at_finalize: list[bool] = []
        finalize = config.finalize_model_grads_func

        def finalize_probe(*a: Any, **kw: Any) -> Any:
            ended_at_finalize.append(run.clock is not None and run.clock.ended)
            return finalize(*a, **kw)

        config.finalize_model_grads_func = finalize_probe
        train_it, _, _ = _hsp_iterators(provider)
        plans, models, created = [], [], []
        for it in range(steps):
            before = run.registry.created if run.registry is not None else 0
            training.train_step(
                forward_step,
                train_it,
                model,
                optimizer,
                scheduler,
                config,
                get_forward_backward_func(),
                iteration=it,
            )
            plans.append(run.current.plan.to_dict())
            created.append(run.registry.created != before)
            if run.refitter is not None:
                models.append(run.refitter.model.to_spec())
        return {
            "plans": plans,
            "models": models,
            "updates": [] if run.refitter is None else run.refitter.updates,
            "refit_on": run.clock is not None,
            "created_groups": created,  # per step: whether it created process groups
            # step timings the refit kept (only from steps that created no process group)
            "step_timings": 0 if run.refitter is None else len(run.refitter.refit._steps),
            "finalize_restored": config.finalize_model_grads_func is finalize_probe,
            "ended_at_finalize": ended_at_finalize,
            # The logging rank's records (the last rank): (step, predicted_ms, planned_ms).
            "predictions": []
            if run.observer is None
            else [(r.step, r.predicted_ms, r.planned_ms) for r in run.observer.records],
        }
    finally:
        MicrobatchClock._now = real_now  # type: ignore[method-assign]
        _close_hsp_run(hooks, patches)


def _constructed_clock(records_x: float) -> Any:
    """A ``MicrobatchClock._now`` whose marks are the sums of constructed micro-batch times:
    micro-batch ``m`` of this rank's slot takes ``records_x`` times the starting model's price
    of the slot's group in ``m`` (0 where the group has no documents). The mark being taken is
    the ``len(marks)``-th: micro-batch starts, then the end of the last one."""
    from megatron_hsp.megatron import hooks

    def now(clock: MicrobatchClock) -> float:
        run = hooks.active_run()
        assert run is not None and run.current is not None and run.registry is not None
        total = 0.0
        for mb in run.current.plan.microbatches[: len(clock.marks)]:
            g = mb.group_of(run.registry.slot)
            if g.seq_ids:
                split = (g.ulysses, g.ring) if g.ulysses else None
                total += records_x * run.cost_model.group_ms(list(g.lengths), g.size, split) / 1e3
        return total

    return now


def refit_worker(
    rank: int, world_size: int, prefix: str, workdir: str, steps: int, extra_s: float
) -> dict[str, Any]:
    """Three runs on this rank: refit on (written to ``workdir/refit.yaml``), on with the
    virtual delay (written elsewhere), then off."""
    from megatron_hsp.testing.cpu_shims import cpu_device_arch_version, cpu_megatron_training
    from megatron_hsp.testing.megatron_loop.hsp_side import NO_REFIT, _hsp_argv

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    os.environ["LOCAL_WORLD_SIZE"] = str(world_size)
    cost_path = os.path.join(workdir, "cost.json")
    if rank == 0:
        from megatron_hsp.planner.paths import atomic_write

        atomic_write(cost_path, json.dumps(OPTIONS.cost_model()))
    import torch.distributed as dist

    dist.barrier()
    # The background planner, as users run it (the loop's flags plan in-process): the plan of
    # step t + 2 is the first priced by the update after step t.
    loop_argv = _hsp_argv(OPTIONS, (prefix,), cost_path, world_size)
    base = [a for a in loop_argv if a not in (SYNC, NO_REFIT)]
    out = os.path.join(workdir, "refit.yaml")
    printed = io.StringIO()
    with (
        contextlib.redirect_stdout(printed),
        cpu_megatron_training(),
        cpu_device_arch_version(),
    ):
        on = _one_run(rank, world_size, [*base, "--hsp-refit-out", out], steps, 0.0, RECORDS_X)
        other = os.path.join(workdir, "delayed.yaml")
        delayed = _one_run(rank, world_size, [*base, "--hsp-refit-out", other], 3, extra_s)
        off = _one_run(rank, world_size, [*base, "--hsp-no-refit"], 2)
    sys.stderr.write(printed.getvalue())
    lines = [ln for ln in printed.getvalue().splitlines() if "refit after step" in ln]
    return {
        "on": on,
        "delayed": delayed,
        "off": off,
        "refit_lines": lines,
        "out": out,
        "cost_path": cost_path,
    }
