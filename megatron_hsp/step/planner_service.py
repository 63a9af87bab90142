"""Plan step t+1 in a separate process while step t trains (as FlexSP does).

The MILP solve is CPU-bound Python/HiGHS work; in the training process it would hold the GIL and
delay kernel launches and collectives. A ``spawn``-ed child (never ``fork``: the parent holds CUDA
and process-group state that must not be copied) builds the cost model once, then answers
``(step, lengths)`` requests in order. ``result(step)`` returns immediately when the plan is ready;
when the planner is late the training step blocks, and the wait is logged and kept for reports.

The child starts clean: ``spawn`` would re-import the parent's ``__main__`` from its path in the
child (``multiprocessing/spawn.py``, ``_fixup_main_from_path``), and under ``megatron_hsp.launch``
that is the user's ``pretrain_gpt.py``: its top-level code would run again and Megatron, TE and
torch be imported in the planner (a second CUDA context on rank 0's GPU, possibly).
``_start_without_main`` starts it with that fix-up disabled, so the child imports only the
planner and what its factory needs (a factory must therefore live in an importable module, not
in the script).

Only the planning rank (rank 0) runs a service; the plan reaches the other ranks through the
runtime's plan agreement, so every rank executes the same plan even when a time-limited solve is
not reproducible.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import logging
import multiprocessing as mp
import os
import pickle
import queue
import sys
import time
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from megatron_hsp.planner.errors import HSPError
from megatron_hsp.planner.plan import Plan
from megatron_hsp.planner.search.settings import (
    DEFAULT_PLAN_TIMEOUT_S,
    PLAN_EXCHANGE_MARGIN_S,
    PlannerSettings,
)
from megatron_hsp.planner.units import tokens_to_k

log = logging.getLogger("megatron_hsp.planner_service")

DEFAULT_PLANNER = "megatron_hsp.step.planner_service:solve_with_planner"
COST_MODEL_UPDATE = "cost_model"  # request tag: replace the child's cost model


@dataclass(frozen=True)
class PlannerSpec:
    """Everything the child needs to build its planner; picklable, no torch objects.

    The problem (cost model, cluster, longest sequence, memory cap) plus the planner's knobs,
    ``settings`` (``planner.search.settings.PlannerSettings``, the one type every entry point uses).
    """

    cost_model: str | dict[str, Any]  # preset name, YAML/JSON path, or a spec mapping
    world_size: int
    gpus_per_node: int
    max_seq: int
    memory_cap_gb: float | None = None
    settings: PlannerSettings = field(default_factory=PlannerSettings)
    # {group size: attention route} of the ring and hybrid groups as the runtime runs them
    # (``runtime.backends.attention_routes_for_run``); None: the cost model's own.
    ring_routes: dict[int, str] | None = None
    # {group size: document multiple} the runtime pads to (``routes.te_doc_multiples``: the
    # groups Transformer Engine's context parallelism carries); None: no padding.
    doc_multiples: dict[int, int] | None = None
    # "module:function" returning a planner ``(lengths) -> Plan`` for this spec.
    factory: str = DEFAULT_PLANNER
    options: dict[str, Any] = field(default_factory=dict)

    def load_cost_model(self):
        """The cost model this spec names, sized for its cluster, longest sequence and cap (the
        one loader the planner process and the training process both use)."""
        from megatron_hsp.planner.cost.costmodel import load_cost_model

        return load_cost_model(
            self.cost_model,
            world_size=self.world_size,
            gpus_per_node=self.gpus_per_node,
            max_seq_k=tokens_to_k(self.max_seq),
            memory_cap_gb=self.memory_cap_gb,
            ring_routes=self.ring_routes,
            doc_multiples=self.doc_multiples,
        )


def _import(path: str) -> Callable[..., Any]:
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def solve_with_planner(spec: PlannerSpec) -> Callable[[Sequence[int]], Plan]:
    """The production planner: cost model + MILP solver from ``megatron_hsp.planner``."""
    from megatron_hsp.planner.search.solver import solve
    from megatron_hsp.planner.topology import Cluster

    cost = spec.load_cost_model()
    cluster = Cluster(spec.world_size, spec.gpus_per_node)
    config = spec.settings.solver_config()
    return lambda lengths: solve(list(lengths), cost, cluster, config)


def build_planner(spec: PlannerSpec) -> Callable[[Sequence[int]], Plan]:
    return _import(spec.factory)(spec)


def fallback_spec(spec: PlannerSpec) -> PlannerSpec:
    """The safe fallback planner: the production cost model, greedy only, a short budget.

    Why greedy: it is the solver's bounded first phase (no MILP), so it answers in about its
    budget even when the full search is what made the plan late. A custom ``factory`` keeps its
    own planner, with the same short budget.
    """
    return dataclasses.replace(spec, settings=spec.settings.fallback())


def default_plan_deadline_s(spec: PlannerSpec) -> float:
    """Default wait for a background plan before the fallback: 20 budgets, at least 30 s, at
    most ``DEFAULT_PLAN_TIMEOUT_S`` (the flag's default)."""
    return min(DEFAULT_PLAN_TIMEOUT_S, max(30.0, 20.0 * spec.settings.time_budget_s))


def plan_exchange_timeout_s(plan_deadline_s: float | None) -> float:
    """How long a rank waits in the plan exchange (``runtime.agreement``): the planning rank's
    deadline plus ``PLAN_EXCHANGE_MARGIN_S`` (the default deadline when None)."""
    deadline = DEFAULT_PLAN_TIMEOUT_S if plan_deadline_s is None else plan_deadline_s
    return deadline + PLAN_EXCHANGE_MARGIN_S


def _picklable(exc: BaseException) -> BaseException:
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        return HSPError(f"{type(exc).__name__}: {exc}")


def _serve(spec: PlannerSpec, requests: Any, replies: Any, parent_pid: int | None = None) -> None:
    """Child process main loop: one reply per request, in order; None stops it; a
    ``("cost_model", spec)`` request replaces the cost model for every later plan (no reply)."""
    from megatron_hsp.runtime.lifetime import die_with_parent

    die_with_parent(parent=parent_pid)  # also while solving: the idle check runs between requests
    try:
        planner = build_planner(spec)
    except BaseException as exc:
        replies.put(("init", None, _picklable(exc), 0.0))
        return
    replies.put(("init", None, None, 0.0))
    parent = os.getppid()
    while True:
        try:
            item = requests.get(timeout=1.0)
        except queue.Empty:
            # The training process was killed (SIGKILL skips its cleanup): do not outlive it.
            if os.getppid() != parent:
                return
            continue
        if item is None:
            return
        if item[0] == COST_MODEL_UPDATE:
            spec = dataclasses.replace(spec, cost_model=item[1])
            planner = build_planner(spec)
            continue
        step, lengths = item
        t0 = time.perf_counter()
        try:
            plan = planner(lengths)
            replies.put(("plan", step, plan.to_json(), time.perf_counter() - t0))
        except BaseException as exc:
            replies.put(("plan", step, _picklable(exc), time.perf_counter() - t0))


def _start_without_main(proc: Any) -> None:
    """Start a ``spawn`` process without its re-import of this process's ``__main__`` (module
    docstring). ``spawn.get_preparation_data`` reads ``sys.modules['__main__']`` when the
    process starts and asks the child to re-run it when it has a ``__file__`` or a module
    spec; for the duration of ``start`` a bare stand-in with neither is put in its place, so
    the child keeps its own empty ``__main__``."""
    main = sys.modules["__main__"]
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        proc.start()
    finally:
        sys.modules["__main__"] = main


@dataclass
class PlanResult:
    step: int
    plan: Plan
    solve_s: float  # wall time of the solve in the planner process
    wait_s: float  # how long the training step blocked for it (0 when it was ready)


class PlannerService:
    """Background planner: ``submit(step, lengths)`` early, ``result(step)`` when the step starts.

    ``background=False`` plans in-process at ``result`` time (debugging, or one-shot tools); the
    wait is then the whole solve, and is reported the same way.
    """

    def __init__(
        self,
        spec: PlannerSpec,
        *,
        background: bool = True,
        wait_log_threshold_s: float = 0.001,
        start_timeout_s: float = 120.0,
        plan_deadline_s: float | None = -1.0,
        fallback: Callable[[Sequence[int]], Plan] | None = None,
        sync_flag: str | None = None,
    ) -> None:
        """``plan_deadline_s``: how long ``result`` waits for a background plan before it plans
        the step with ``fallback`` (default: ``fallback_spec(spec)`` built in-process) and
        counts it in ``fallbacks``; -1 means ``default_plan_deadline_s(spec)``, None waits
        forever (still logging a late plan every ``late_log_s``)."""
        self.spec = spec
        self.background = background
        # The caller's flag for planning in-process (Megatron: --hsp-sync-planner), named when
        # the planner process dies; None where the command has none (the demo).
        self.sync_flag = sync_flag
        self.wait_log_threshold_s = wait_log_threshold_s
        self.waits: list[float] = []
        self.plan_deadline_s = (
            default_plan_deadline_s(spec) if plan_deadline_s == -1.0 else plan_deadline_s
        )
        self.late_log_s = max(5.0, 2.0 * spec.settings.time_budget_s)
        self.fallbacks: list[int] = []  # steps trained with the fallback plan
        self._fallback = fallback
        self._abandoned: set[int] = set()  # steps whose late background plan is discarded
        self._pending: dict[int, Sequence[int]] = {}
        self._ready: dict[int, tuple[Any, float]] = {}
        self._proc: Any = None
        self.restarts = 0  # planner processes started again after a late or dead one
        if background:
            self._start_timeout_s = start_timeout_s
            self._start_process()
        else:
            self._planner = build_planner(spec)

    def _start_process(self) -> None:
        ctx = mp.get_context("spawn")
        self._requests = ctx.Queue()
        self._replies = ctx.Queue()
        self._proc = ctx.Process(
            target=_serve,
            args=(self.spec, self._requests, self._replies, os.getpid()),
            name="megatron-hsp-planner",
            daemon=True,
        )
        _start_without_main(self._proc)
        self._started = False
        self._proc_started_at = time.monotonic()

    def _stop_process(self) -> None:
        """The planner process and anything below it stopped in any state (a SIGSTOPped or
        wedged planner ignores SIGTERM: ``runtime.lifetime.stop_tree``)."""
        from megatron_hsp.runtime.lifetime import stop_tree

        if self._proc is None:
            return
        if self._proc.pid is not None:
            stop_tree([self._proc.pid], grace_s=2.0)
        self._proc.join(timeout=1)
        for q in (self._requests, self._replies):
            with contextlib.suppress(Exception):
                q.cancel_join_thread()  # a queue whose reader is gone must not block our exit
                q.close()
        self._proc = None

    def _restart(self, why: str) -> None:
        """A late or dead planner is replaced by a fresh process, which gets the current cost
        model and every plan still pending (their old requests died with the old process)."""
        self._stop_process()
        self.restarts += 1
        self._abandoned.clear()  # their replies went with the old queues
        self._ready.clear()
        self._start_process()
        for step, lengths in self._pending.items():
            self._requests.put((step, lengths))
        log.warning("planner process %s; restarted it (restarts so far: %d)", why, self.restarts)

    # ------------------------------------------------------------------ protocol
    def use_cost_model(self, cost_model: str | dict[str, Any]) -> None:
        """Plan every step submitted from now on with ``cost_model`` (e.g. an online refit).

        Background planner: in request order, so a plan already submitted keeps the model it
        was asked under and every plan is priced by one model. In-process planning solves at
        ``result`` time, with the model current then. The fallback planner follows too."""
        self.spec = dataclasses.replace(self.spec, cost_model=cost_model)
        self._fallback = None
        if self.background:
            self._requests.put((COST_MODEL_UPDATE, cost_model))
        else:
            self._planner = build_planner(self.spec)

    def submit(self, step: int, lengths: Sequence[int]) -> None:
        """Queue the plan for ``step``; returns at once."""
        if step in self._pending or step in self._ready:
            raise HSPError(f"planner: step {step} was already submitted")
        lengths = [int(x) for x in lengths]
        self._pending[step] = lengths
        if self.background:
            self._requests.put((step, lengths))

    def _receive(self, timeout: float | None) -> None:
        kind, step, payload, solve_s = self._replies.get(timeout=timeout)
        if kind == "init":
            self._started = True
            if payload is not None:
                raise payload
            return
        if step in self._abandoned:  # the step already trained with the fallback plan
            self._abandoned.discard(step)
            return
        self._ready[step] = (payload, solve_s)

    def _wait_started(self) -> None:
        deadline = time.monotonic() + self._start_timeout_s
        while not self._started:
            self._check_alive()
            try:
                self._receive(timeout=min(1.0, max(0.0, deadline - time.monotonic())))
            except queue.Empty:
                if time.monotonic() > deadline:
                    raise HSPError(
                        f"planner process did not start within {self._start_timeout_s:.0f} s"
                    ) from None

    def _check_alive(self) -> None:
        if self._proc is not None and not self._proc.is_alive():
            raise HSPError(
                f"planner process exited (code {self._proc.exitcode}) with plans pending; see "
                "its output above (out of memory? a solver crash?)"
                + (
                    f" or rerun with {self.sync_flag} to plan in the training process"
                    if self.sync_flag
                    else ""
                )
            )

    def result(self, step: int) -> PlanResult:
        """The plan for ``step``; blocks only while the planner is still solving it."""
        if step not in self._pending:
            raise HSPError(f"planner: no plan was submitted for step {step}")
        t0 = time.perf_counter()
        if self.background:
            if not self._started and not self.restarts:
                self._wait_started()
            # The deadline excludes the one-time first start; a restarted planner's start counts.
            t_wait = time.perf_counter()
            next_log = t_wait + self.late_log_s
            while step not in self._ready:
                if self._proc is None or not self._proc.is_alive():
                    # A dead planner (killed, out of memory) is no reason to stop training: this
                    # step trains on the fallback plan and a fresh planner takes the next ones.
                    code = None if self._proc is None else self._proc.exitcode
                    result = self._use_fallback(step, t0, f"planner process died (code {code})")
                    self._restart(f"died (code {code})")
                    return result
                with contextlib.suppress(queue.Empty):
                    self._receive(timeout=min(1.0, self.late_log_s))
                now = time.perf_counter()
                if step in self._ready:
                    break
                if now >= next_log:
                    log.warning(
                        "step %d: plan late, waited %.1f s so far (time budget %.1f s)%s",
                        step,
                        now - t_wait,
                        self.spec.settings.time_budget_s,
                        ""
                        if self.plan_deadline_s is None
                        else f"; the fallback plan is used after {self.plan_deadline_s:.0f} s",
                    )
                    next_log = now + self.late_log_s
                if self.plan_deadline_s is not None and now - t_wait >= self.plan_deadline_s:
                    result = self._use_fallback(step, t0, "no plan")
                    # A planner this late may be stopped or wedged: replace it, so that the
                    # next steps do not each wait out the deadline again. One still starting
                    # (imports) is left to start, up to its start timeout.
                    starting = time.monotonic() - self._proc_started_at < self._start_timeout_s
                    if self._started or not starting:
                        self._restart(f"gave no plan within {self.plan_deadline_s:.0f} s")
                    return result
            payload, solve_s = self._ready.pop(step)
        else:
            s0 = time.perf_counter()
            try:
                payload = self._planner(self._pending[step]).to_json()
            except BaseException as exc:
                payload = exc
            solve_s = time.perf_counter() - s0
        wait_s = time.perf_counter() - t0
        del self._pending[step]
        if isinstance(payload, BaseException):
            raise payload
        self.waits.append(wait_s)
        if wait_s > self.wait_log_threshold_s:
            log.warning(
                "step %d waited %.1f ms for its plan (solve took %.1f ms%s)",
                step,
                wait_s * 1e3,
                solve_s * 1e3,
                "" if self.background else ", planning in the training process",
            )
        return PlanResult(step, Plan.from_json(payload), solve_s, wait_s)

    def _use_fallback(self, step: int, t0: float, why: str = "no plan") -> PlanResult:
        """Plan ``step`` in-process with the safe fallback; the late plan is discarded."""
        if self._fallback is None:
            self._fallback = build_planner(fallback_spec(self.spec))
        s0 = time.perf_counter()
        plan = self._fallback(self._pending.pop(step))
        solve_s = time.perf_counter() - s0
        self._abandoned.add(step)
        self.fallbacks.append(step)
        wait_s = time.perf_counter() - t0
        self.waits.append(wait_s)
        log.warning(
            "step %d: %s after %.1f s (deadline %s s); trained with the fallback plan "
            "(greedy, solved in %.1f ms); fallbacks so far: %d",
            step,
            why,
            wait_s,
            "none" if self.plan_deadline_s is None else f"{self.plan_deadline_s:.1f}",
            solve_s * 1e3,
            len(self.fallbacks),
        )
        return PlanResult(step, Plan.from_json(plan.to_json()), solve_s, wait_s)

    def close(self) -> None:
        """Ask the planner to stop; one that does not within 10 s (stopped, wedged) is stopped
        with its whole tree."""
        if self._proc is not None:
            try:
                if self._proc.is_alive():
                    self._requests.put(None)
                    self._proc.join(timeout=10)
            finally:
                self._stop_process()

    def __enter__(self) -> PlannerService:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
