"""Faults run under the loop's machinery: unlike ``plants``, the comparison must
still PASS, since a fault HSP handles must not change what trains.

``planner-stopped-after-step-1``: the HSP side plans in the background (as users run it,
not ``--hsp-sync-planner``) with ``--hsp-plan-timeout-s FAULT_PLAN_TIMEOUT_S``; after step 1
global rank 0 stops its planner process (SIGSTOP). The next step's plan is late: rank 0 trains
it on the fallback plan, restarts the planner, and the other ranks receive the fallback plan
through the bounded tensor exchange. Every step must still equal the stock path per parameter.
``PLANTED["faults"]`` records, on rank 0, the steps trained on fallback plans, the planner
restarts and the longest plan wait, for the test and the report.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
from typing import Any

from megatron_hsp.testing.megatron_loop.plants import PLANTED

#: The plan deadline of the faulted run (seconds): short, so the test is quick.
FAULT_PLAN_TIMEOUT_S = 4.0
#: The step after which the planner is stopped.
STOP_AFTER_STEP = 1


def _fault_planner_stopped(stack: contextlib.ExitStack) -> None:
    """SIGSTOP the planner process after step ``STOP_AFTER_STEP`` (module docstring)."""
    import megatron.training.training as training

    from megatron_hsp.megatron import hooks

    run = hooks.active_run()
    assert run is not None
    run.config = dataclasses.replace(
        run.config, background_planner=True, plan_timeout_s=FAULT_PLAN_TIMEOUT_S
    )
    stock_step = training.train_step
    record: dict[str, Any] = {"stopped_pid": None}
    PLANTED["faults"] = record

    def train_step(*a: Any, **kw: Any) -> Any:
        out = stock_step(*a, **kw)
        current = hooks.active_run()
        planner = None if current is None or current.pipeline is None else current.pipeline.planner
        if planner is not None:
            if kw.get("iteration") == STOP_AFTER_STEP and planner._proc is not None:
                record["stopped_pid"] = planner._proc.pid
                os.kill(planner._proc.pid, signal.SIGSTOP)
            record.update(
                fallbacks=list(planner.fallbacks),
                restarts=planner.restarts,
                max_wait_s=max(planner.waits, default=0.0),
            )
        return out

    training.train_step = train_step

    def undo() -> None:
        training.train_step = stock_step
        pid = record.get("stopped_pid")
        if pid:  # the service stopped it already; a no-op then
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
                os.kill(pid, signal.SIGKILL)

    stack.callback(undo)


FAULTS = {"planner-stopped-after-step-1": _fault_planner_stopped}
