"""Start, watch and stop the CPU ranks of ``megatron-hsp demo`` (when it is not under torchrun).

The ranks are forked from a fork server that imported torch and megatron-core once; each writes
a heartbeat file every second and its result (or its error) to a pickle. The parent stops every
rank as soon as one dies, raises or stops beating, and on SIGTERM or Ctrl-C, so no rank outlives
the command (docs/reliability.md).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import tempfile
import threading
import time
from typing import Any

from megatron_hsp.commands.demo_config import DemoConfig


def _rank_main(rank: int, cfg: DemoConfig, rdzv: str, out: str) -> None:
    import pickle
    import traceback

    import torch

    from megatron_hsp.commands.common import quiet_megatron_notices
    from megatron_hsp.commands.demo_worker import demo_worker
    from megatron_hsp.runtime.lifetime import die_with_parent
    from megatron_hsp.testing.dist import destroy_cpu_megatron, init_cpu_megatron

    quiet_megatron_notices()
    torch.set_num_threads(1)
    _start_heartbeat(out + ".hb")
    # SIGTERM from the parent: unwind (close the planner, leave the process groups) and exit.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    die_with_parent()  # and SIGTERM when the parent dies, even by SIGKILL
    try:
        init_cpu_megatron(rank, cfg.nproc, f"file://{rdzv}")
        result: Any = demo_worker(rank, cfg.nproc, cfg)
    except BaseException as exc:  # reported by the parent, never swallowed
        from megatron_hsp.planner.errors import HSPError

        if isinstance(exc, HSPError):  # a reason in a sentence (bad input, planner died): one line
            result = HSPError(f"rank {rank}: {exc}")
        else:  # a bug: its traceback is what a report needs
            result = RuntimeError(
                f"rank {rank}: {type(exc).__name__}: {exc}\n{traceback.format_exc()}"
            )
    finally:
        destroy_cpu_megatron()
    from megatron_hsp.planner.paths import atomic_write

    atomic_write(out, pickle.dumps(result))  # the parent never reads half a result


HEARTBEAT_S = 1.0


def _start_heartbeat(path: str) -> None:
    """Touch ``path`` every second from a daemon thread.

    Why a thread: a rank waiting in a collective for a slow peer still beats (gloo releases the
    GIL), while a stopped or wedged process does not, so the parent can name the stalled rank.
    """

    def beat() -> None:
        tmp = f"{path}.tmp"
        while True:
            # The pid lets an operator (or a test) find the rank. Written aside and renamed: a
            # reader never sees the file truncated mid-write (os.replace is atomic, and it
            # updates the mtime the parent watches).
            with open(tmp, "w") as fh:
                fh.write(str(os.getpid()))
            os.replace(tmp, path)
            time.sleep(HEARTBEAT_S)

    threading.Thread(target=beat, name="hsp-heartbeat", daemon=True).start()


def _stalled_rank(outs: list[str], since: float, limit_s: float) -> tuple[int, float] | None:
    """The first rank whose heartbeat is older than ``limit_s`` (and its age), else None."""
    now = time.time()
    for r, out in enumerate(outs):
        hb = out + ".hb"
        last = os.path.getmtime(hb) if os.path.exists(hb) else since
        if now - max(last, since) > limit_s:
            return r, now - max(last, since)
    return None


def _stop(procs: list[Any]) -> None:
    """Stop every rank and everything below it (the planner process rank 0 started), in any
    state: continued, terminated, killed after 5 s (``runtime.lifetime.stop_tree``). Ranks never
    started (a signal during the start loop) are skipped: joining one raised "can only join a
    started process"."""
    from megatron_hsp.runtime.lifetime import stop_tree

    procs = [p for p in procs if p.pid is not None]
    stop_tree([p.pid for p in procs], grace_s=5.0)
    for p in procs:
        p.join(1)


def _is_error(path: str) -> bool:
    import pickle

    if not os.path.exists(path):
        return False
    with open(path, "rb") as fh:
        return isinstance(pickle.load(fh), BaseException)


def run_ranks(cfg: DemoConfig, timeout_s: float = 900) -> dict[str, Any]:
    """Run the ranks as children of a fork server that has imported the heavy modules once.

    On a small CPU machine, four processes each importing torch and megatron-core again (spawn)
    cost more than the eight training steps, so the ranks are forked from a server that imported
    them once. Forking from *this* process would be unsafe: a caller that already ran torch ops
    (a test worker, a notebook) has OpenMP/gloo threads alive and a fork can deadlock in them.
    The fork server is a fresh single-threaded process. The planner process is spawned separately
    (it must not inherit the ranks' process groups).
    """
    import multiprocessing as mp
    import pickle

    from megatron_hsp.planner.errors import HSPError

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(
        [
            "megatron_hsp.runtime.forkserver_lifetime",  # first: the server dies with us
            "torch",
            "megatron.core.models.gpt.gpt_model",
            "megatron_hsp.runtime.schedule",
            "megatron_hsp.testing.dist",
            "megatron_hsp.commands.demo_worker",
            "megatron_hsp.commands.demo_ranks",
        ]
    )
    with tempfile.TemporaryDirectory(prefix="hsp_demo_") as tmp:
        outs = [os.path.join(tmp, f"rank{r}.pkl") for r in range(cfg.nproc)]
        procs = [
            ctx.Process(target=_rank_main, args=(r, cfg, os.path.join(tmp, "rdzv"), outs[r]))
            for r in range(cfg.nproc)
        ]
        # SIGTERM to this process stops the ranks too (SIGINT already raises KeyboardInterrupt);
        # the finally below terminates them and the with-block removes the temp dir.
        previous = signal.getsignal(signal.SIGTERM)
        with contextlib.suppress(ValueError):  # not the main thread: keep the default
            signal.signal(signal.SIGTERM, _raise_interrupt)
        started = time.time()
        deadline = time.monotonic() + timeout_s
        failed = None
        stalled: tuple[int, float] | None = None
        try:
            for p in procs:
                p.start()
            while any(p.is_alive() for p in procs) and failed is None:
                time.sleep(0.2)
                for r, p in enumerate(procs):
                    # A rank that died or raised leaves the others blocked in a collective:
                    # stop them at once instead of waiting for gloo's timeout.
                    if not p.is_alive() and (p.exitcode != 0 or _is_error(outs[r])):
                        failed = r
                stalled = _stalled_rank(outs, started, cfg.stall_timeout_s)
                if stalled is not None and failed is None:
                    failed = -2
                if time.monotonic() > deadline:
                    failed = -1
        finally:
            _stop(procs)
            with contextlib.suppress(ValueError):
                signal.signal(signal.SIGTERM, previous)
        if failed == -2 and stalled is not None:
            raise HSPError(
                f"demo rank {stalled[0]} stalled: no heartbeat for {stalled[1]:.0f} s (stopped, "
                "swapped out or wedged); every rank was stopped. Raise --stall-timeout on a "
                "heavily loaded machine"
            )
        if failed == -1:
            raise HSPError(
                f"demo ranks did not finish within {timeout_s:.0f} s; every rank was stopped"
            )
        if failed is not None:
            if _is_error(outs[failed]):
                with open(outs[failed], "rb") as fh:
                    raise pickle.load(fh)
            raise HSPError(_death(failed, procs[failed].exitcode))
        results = []
        for r, path in enumerate(outs):
            if not os.path.exists(path):
                raise HSPError(_death(r, procs[r].exitcode))
            with open(path, "rb") as fh:
                results.append(pickle.load(fh))
    for res in results:
        if isinstance(res, BaseException):
            raise res
    return results[0]


def _death(rank: int, code: int | None) -> str:
    """One line for a rank that died without reporting (killed, out of memory, a crash)."""
    how = (
        f"was killed by signal {-code} ({signal.Signals(-code).name})"
        if code is not None and code < 0
        else f"exited with code {code}"
    )
    return (
        f"demo rank {rank} {how} before reporting (out of memory? killed from outside?); "
        "every rank and the planner were stopped"
    )


def _raise_interrupt(signum: int, _frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")
