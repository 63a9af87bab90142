"""CPU harness for multi-process tests: gloo + megatron ``parallel_state`` without CUDA.

Megatron-core assumes CUDA in two places a CPU test hits: ``model_parallel_cuda_manual_seed``
(seeds ``torch.cuda``) and the RNG tracker it fills. On CPU we initialise megatron's tracker with
its public ``inference_rng_tracker=True`` variant, whose ``fork()`` is a no-op and ``add()`` does
nothing: code that forks "the model-parallel RNG" then simply draws from torch's CPU generator.
That is only a difference for dropout inside tensor-parallel regions, which the exactness tests
switch off (dropout 0) anyway. Models must be built with ``use_cpu_initialization=True``.

``run_distributed`` spawns N processes with a file rendezvous (no ports to collide between test
workers) and returns each rank's result or exception, so a test can assert that *every* rank
raised (no hang) instead of only seeing the first failure.

A hang is told from a slow run by progress, not by the clock alone: a long worker calls
``report_progress()`` after each unit of work (an option set's step, say), and the run fails when
no rank has reported for ``timeout_s``, or when it passes ``max_total_s`` whatever it reports.
Starting (spawn, importing torch and Megatron, the rendezvous) has its own allowance,
``STARTUP_S``: under CI load it alone took more than 20 s. A silent rank prints every thread's
stack (``faulthandler``) before the parent gives up on it (20 s before, halfway for short
allowances): by the startup allowance until its first report, by the progress timeout after.
(Starting once used the progress timeout's delay, 1 s for an 8 s timeout: every start dumped
stacks mid-import, and faulthandler's watchdog reading a thread that is importing torch crashed
a rank with SIGSEGV under load.)
The ranks are CPU processes on any machine: they start with ``CUDA_VISIBLE_DEVICES=""``
(``cuda_hidden``), so on a GPU node they run exactly as on a CPU one (megatron's CUDA-only
paths, which ``cpu_shims`` answers only where CUDA is absent, included).
On a machine shared with other jobs a fixed wall-clock budget for a whole multi-part run is either
too tight (CI load doubled the time of a 250 s run and failed it as a hang) or too loose to find a
hang early.
"""

from __future__ import annotations

import faulthandler
import os
import pickle
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megatron_hsp.testing.cpu_shims import use_cpu_rotary


@dataclass(frozen=True)
class RankError:
    """An exception raised on one rank, carried back to the parent process as text."""

    rank: int
    type_name: str
    message: str
    traceback: str


def init_cpu_megatron(
    rank: int,
    world_size: int,
    init_method: str,
    *,
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    virtual_pipeline_model_parallel_size: int | None = None,
    expert_model_parallel_size: int = 1,
    seed: int = 1234,
    gloo_process_groups: bool = False,
    ranks_share_device: bool = False,
) -> None:
    """Initialise gloo torch.distributed and megatron ``parallel_state`` on the CPU.

    ``init_method`` is a ``file://`` or ``tcp://`` URL shared by all ranks. Idempotent for the
    process: a second call with the process group already up only (re)initialises megatron.
    ``gloo_process_groups``: also megatron's gloo copies of its groups (what Megatron creates
    unless ``--disable-gloo-process-groups``; its legacy checkpoint format gathers the
    distributed optimizer's state over them). ``ranks_share_device``: the runtime's collectives
    staged through host buffers, as ranks sharing one GPU run them (``init_megatron``).
    """
    init_megatron(
        rank,
        world_size,
        init_method,
        tensor_model_parallel_size=tensor_model_parallel_size,
        pipeline_model_parallel_size=pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=virtual_pipeline_model_parallel_size,
        expert_model_parallel_size=expert_model_parallel_size,
        seed=seed,
        gloo_process_groups=gloo_process_groups,
        ranks_share_device=ranks_share_device,
    )


def init_megatron(
    rank: int,
    world_size: int,
    init_method: str,
    *,
    device: torch.device | None = None,
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    virtual_pipeline_model_parallel_size: int | None = None,
    expert_model_parallel_size: int = 1,
    seed: int = 1234,
    gloo_process_groups: bool = False,
    ranks_share_device: bool = False,
) -> None:
    """torch.distributed and megatron ``parallel_state`` on ``device`` (default: the CPU).

    CPU: gloo and the CPU-safe RNG tracker (module docstring). CUDA: NCCL with the device bound
    at ``init_process_group`` (``device_id``), so the sub-groups HSP creates are split from the
    world communicator where torch supports it instead of each being a full new communicator, and
    megatron's own ``model_parallel_cuda_manual_seed``. Idempotent like ``init_cpu_megatron``.
    ``ranks_share_device`` (many ranks on one GPU, or CPU ranks running that path): gloo groups
    whatever the device, and the runtime's collectives staged through host buffers
    (``runtime/comm.HOST_STAGED``, chosen here, once, with the world group).
    """
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as mpu_random

    from megatron_hsp.runtime.comm import HOST_STAGED, use_comm

    cuda = device is not None and torch.device(device).type == "cuda"
    nccl = cuda and not ranks_share_device
    if not dist.is_initialized():
        kwargs: dict[str, Any] = {"device_id": torch.device(device)} if nccl else {}
        if ranks_share_device:
            use_comm(HOST_STAGED)
        dist.init_process_group(
            "nccl" if nccl else "gloo",
            init_method=init_method,
            rank=rank,
            world_size=world_size,
            **kwargs,
        )
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tensor_model_parallel_size,
        pipeline_model_parallel_size=pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=virtual_pipeline_model_parallel_size,
        expert_model_parallel_size=expert_model_parallel_size,
        create_gloo_process_groups=gloo_process_groups,
    )
    if cuda:
        mpu_random.model_parallel_cuda_manual_seed(seed)
    else:
        # CPU-safe replacement for model_parallel_cuda_manual_seed (see module docstring).
        mpu_random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    torch.manual_seed(seed)


def init_single_process_megatron(seed: int = 1234) -> None:
    """One-process gloo world with megatron initialised: for GPTModel tests on the CPU."""
    fd, path = tempfile.mkstemp(prefix="hsp_rdzv_")
    os.close(fd)
    os.unlink(path)
    init_cpu_megatron(0, 1, f"file://{path}", seed=seed)


def tiny_gpt_model(
    *,
    num_layers: int = 2,
    hidden_size: int = 32,
    num_attention_heads: int = 4,
    num_query_groups: int = 2,
    vocab_size: int = 64,
    max_sequence_length: int = 512,
    seed: int = 0,
    attention_backend: str = "torch",
    ffn_hidden_size: int | None = None,
    share_embeddings_and_output_weights: bool = False,
    position_embedding_type: str = "rope",
    device: torch.device | str = "cpu",
    **config_overrides: Any,
) -> torch.nn.Module:
    """A small megatron-core ``GPTModel`` (RoPE, GQA, no dropout) with HSP attention.

    Identical weights on every rank for the same ``seed`` (CPU initialisation), so distributed
    runs can be compared with a single-process reference built the same way. fp32 unless
    ``config_overrides`` set ``params_dtype``/``bf16``; on ``device`` (a CUDA device keeps
    megatron's own RoPE class, the CPU gets the placement shim of ``cpu_shims``).
    """
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_hsp.megatron.spec import hsp_gpt_layer_spec

    config = TransformerConfig(
        num_layers=num_layers,
        hidden_size=hidden_size,
        ffn_hidden_size=ffn_hidden_size or 4 * hidden_size,
        num_attention_heads=num_attention_heads,
        num_query_groups=num_query_groups,
        use_cpu_initialization=True,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        gradient_accumulation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        **config_overrides,
    )
    torch.manual_seed(seed)
    model = GPTModel(
        config,
        hsp_gpt_layer_spec(use_transformer_engine=False, attention_backend=attention_backend),
        vocab_size=vocab_size,
        max_sequence_length=max_sequence_length,
        position_embedding_type=position_embedding_type,
        share_embeddings_and_output_weights=share_embeddings_and_output_weights,
    )
    if config.bf16:
        # What Megatron's ``Float16Module`` does to the model it wraps (``module.bfloat16()``):
        # ``params_dtype`` reaches the linear layers only, the local spec's torch
        # ``LayerNorm`` is created in fp32, and CUDA's layer norm refuses bf16 input with fp32
        # weights (the CPU kernel accepts the mix, which hid it).
        model = model.bfloat16()
    if torch.device(device).type == "cpu":
        return use_cpu_rotary(model)
    return model.to(device)


def destroy_cpu_megatron() -> None:
    """Tear down megatron's groups and the default process group (safe to call twice)."""
    from megatron.core import parallel_state

    from megatron_hsp.runtime.comm import DIRECT, use_comm

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
    use_comm(DIRECT)


# Set in each spawned rank by ``_worker``: where ``report_progress`` leaves its mark, and how long
# after a report the rank dumps its stacks if it has not reported again.
_progress_file: str | None = None
_stack_dump_after_s: float = 0.0


def report_progress() -> None:
    """Tell ``run_distributed``'s parent this rank is still moving (restarts its ``timeout_s``).

    Touches this rank's progress file and re-arms the stack dump; a no-op outside
    ``run_distributed`` (``selftest`` runs the same workers in its own processes).
    """
    if _progress_file is None:
        return
    with open(_progress_file, "a"):
        pass
    os.utime(_progress_file)
    faulthandler.dump_traceback_later(_stack_dump_after_s, exit=False)


# Set (by ``rank_output_logged``) to a directory: each spawned rank writes its stdout and
# stderr to ``rank<r>.log`` there instead of the terminal.
RANK_LOG_DIR_ENV = "HSP_RANK_LOG_DIR"


def _output_to_log(rank: int) -> None:
    directory = os.environ.get(RANK_LOG_DIR_ENV)
    if not directory:
        return
    fd = os.open(os.path.join(directory, f"rank{rank}.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


@dataclass
class RankLogs:
    """What ``rank_output_logged`` does with the ranks' logs: ``passed`` set by the command when
    it succeeded removes them; left False (a failure, an exception) keeps them and names them."""

    passed: bool = False
    directory: str | None = None


@contextmanager
def rank_output_logged(verbose: bool, command: str) -> Iterator[RankLogs]:
    """Spawned ranks' output in log files, not on the terminal, unless ``verbose``.

    Why: Megatron's ranks log every dataset index, argument and iteration; ``selftest
    --megatron`` wrote ~38,600 lines to stderr, burying the result table. A passing run's logs
    are removed (they left ~36,000 lines in /tmp per run); a failing run's are kept and named in
    one stderr line. ``--verbose`` streams the output as before.
    """
    logs_state = RankLogs()
    if verbose or os.environ.get(RANK_LOG_DIR_ENV):
        yield logs_state
        return
    directory = tempfile.mkdtemp(prefix=f"megatron-hsp-{command}-")
    logs_state.directory = directory
    os.environ[RANK_LOG_DIR_ENV] = directory
    try:
        yield logs_state
    finally:
        del os.environ[RANK_LOG_DIR_ENV]
        logs = sorted(Path(directory).glob("rank*.log"))
        lines = 0
        for log in logs:
            with open(log, "rb") as fh:
                lines += sum(1 for _ in fh)
        if lines and not logs_state.passed:
            print(
                f"{command}: the ranks' output ({lines:,} lines) is kept in "
                f"{directory}/rank*.log; --verbose prints it instead",
                file=sys.stderr,
            )
        else:
            shutil.rmtree(directory, ignore_errors=True)


def _worker(
    rank: int,
    world_size: int,
    tmpdir: str,
    fn: Callable[..., Any],
    args: tuple,
    tensor_model_parallel_size: int,
    stack_dump_after_s: float,
    startup_dump_after_s: float,
    parent_pid: int,
    ranks_share_device: bool = False,
) -> None:
    from megatron_hsp.runtime.lifetime import die_with_parent, start_heartbeat

    global _progress_file, _stack_dump_after_s
    die_with_parent(parent=parent_pid)  # a killed test runner (or command) leaves no rank behind
    start_heartbeat(os.path.join(tmpdir, f"heartbeat_{rank}"))  # a stopped rank stops beating
    _output_to_log(rank)
    # A stuck rank prints every thread's stack to stderr shortly before the parent gives up.
    _progress_file = os.path.join(tmpdir, f"progress_{rank}")
    _stack_dump_after_s = stack_dump_after_s
    faulthandler.dump_traceback_later(startup_dump_after_s, exit=False)  # until the first report
    torch.set_num_threads(1)
    result: Any
    try:
        init_cpu_megatron(
            rank,
            world_size,
            f"file://{os.path.join(tmpdir, 'rdzv')}",
            tensor_model_parallel_size=tensor_model_parallel_size,
            ranks_share_device=ranks_share_device,
        )
        report_progress()  # started: spawn, imports and rendezvous are behind it
        result = fn(rank, world_size, *args)
        faulthandler.cancel_dump_traceback_later()
    except BaseException as exc:  # carried back to the parent, never swallowed
        result = RankError(rank, type(exc).__name__, str(exc), traceback.format_exc())
    finally:
        from megatron_hsp.planner.paths import atomic_write

        atomic_write(os.path.join(tmpdir, f"result_{rank}.pkl"), pickle.dumps(result))
        destroy_cpu_megatron()


@contextmanager
def cuda_hidden() -> Iterator[None]:
    """``CUDA_VISIBLE_DEVICES=""`` in ``os.environ`` while child processes are started (they
    inherit it: CUDA is hidden from them), restored after. The parent's own CUDA is unaffected
    once initialised; the CPU harness's parents never use it."""
    saved = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    try:
        yield
    finally:
        if saved is None:
            del os.environ["CUDA_VISIBLE_DEVICES"]
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = saved


# Seconds the ranks may take to start (spawn, imports, rendezvous) before their first report.
STARTUP_S = 300.0
# The shortest silence of a rank's heartbeat thread read as stopped or wedged: a loaded shared
# host can hold a runnable process off the CPU for seconds (an import holding the GIL too).
MIN_STALL_S = 30.0


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    tensor_model_parallel_size: int = 1,
    timeout_s: float = 300.0,
    max_total_s: float | None = None,
    startup_s: float | None = None,
    ranks_share_device: bool = False,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned gloo CPU processes.

    Returns one entry per rank: ``fn``'s (picklable) return value or a ``RankError``. ``fn`` must
    be importable (module level). The run fails with TimeoutError (every rank killed) when no
    rank has called ``report_progress`` for ``timeout_s`` seconds (every rank reports once
    started, so an ``fn`` that never reports has ``timeout_s`` in all), when no rank has started
    within ``max(startup_s, timeout_s)`` (``startup_s`` defaults to ``STARTUP_S``), or after
    ``max_total_s`` in any case (default: the startup allowance and ``4 * timeout_s``).
    ``ranks_share_device``: the ranks' collectives take the host-staged path of ranks that
    share one GPU (``runtime/comm.py``), here with CPU tensors.
    """
    startup_s = max(STARTUP_S if startup_s is None else startup_s, timeout_s)
    max_total_s = startup_s + 4.0 * timeout_s if max_total_s is None else max_total_s
    with tempfile.TemporaryDirectory(prefix="hsp_dist_") as tmpdir:
        with cuda_hidden():  # CPU ranks, on a GPU node too (module docstring)
            ctx = mp.start_processes(
                _worker,
                args=(
                    world_size,
                    tmpdir,
                    fn,
                    args,
                    tensor_model_parallel_size,
                    _dump_after(timeout_s),
                    _dump_after(startup_s),
                    os.getpid(),
                    ranks_share_device,
                ),
                nprocs=world_size,
                join=False,
                start_method="spawn",
            )
        try:
            return _watch(ctx, tmpdir, world_size, timeout_s, startup_s, max_total_s)
        finally:  # whatever happened (a timeout, ^C, an error): no rank or its child survives
            from megatron_hsp.runtime.lifetime import stop_tree

            stop_tree([p.pid for p in ctx.processes if p.pid], grace_s=5.0)
            for p in ctx.processes:
                p.join(1)


def _mtime(path: str) -> float | None:
    try:
        return os.path.getmtime(path)
    except OSError:
        return None


def _watch(
    ctx: Any,
    tmpdir: str,
    world_size: int,
    timeout_s: float,
    startup_s: float,
    max_total_s: float,
) -> list[Any]:
    """``run_distributed``'s wait: results, or TimeoutError on no progress, a rank without
    heartbeat (stopped or wedged: ``stall_s``) or the total bound; the caller stops the ranks."""
    start = time.time()  # wall clock: progress marks are file modification times
    # A rank whose heartbeat thread has not run for this long is stopped or wedged, not slow.
    stall_s = max(MIN_STALL_S, min(timeout_s, 120.0))
    from megatron_hsp.runtime.lifetime import stopped

    progress = [os.path.join(tmpdir, f"progress_{rank}") for rank in range(world_size)]
    beats = [os.path.join(tmpdir, f"heartbeat_{rank}") for rank in range(world_size)]
    # Since when each rank has been seen stopped (SIGSTOP): also before its heartbeat starts,
    # i.e. while it still imports, where only the start-up allowance bounded it.
    stopped_since: dict[int, float] = {}
    while True:
        marks = [os.path.getmtime(p) for p in progress if os.path.exists(p)]
        allowed = timeout_s if marks else startup_s
        deadline = min(max([start, *marks]) + allowed, start + max_total_s)
        now = time.time()
        for r, p in enumerate(ctx.processes):
            if p.pid and stopped(p.pid):
                stopped_since.setdefault(r, now)
            else:
                stopped_since.pop(r, None)
        silent = [
            (r, now - t)
            for r, t in enumerate(_mtime(b) for b in beats)
            if t is not None and now - t > stall_s and ctx.processes[r].is_alive()
        ] + [(r, now - t) for r, t in stopped_since.items() if now - t > stall_s]
        if now >= deadline or silent:
            from megatron_hsp.runtime.lifetime import stop_tree

            stop_tree([p.pid for p in ctx.processes if p.pid], grace_s=5.0)
            reported = []
            for rank in range(world_size):
                path = os.path.join(tmpdir, f"result_{rank}.pkl")
                if os.path.exists(path):
                    with open(path, "rb") as fh:
                        reported.append(f"rank {rank}: {pickle.load(fh)!r}"[:2000])
                else:
                    reported.append(f"rank {rank}: no result (stuck)")
            why = (
                f"stalled: rank {silent[0][0]} has not run for {silent[0][1]:.0f}s "
                "(stopped or wedged)"
                if silent
                else f"did not finish within {max_total_s:.0f}s"
                if now >= start + max_total_s
                else f"made no progress for {allowed:.0f}s (likely a hang)"
                if marks
                else f"did not start within {allowed:.0f}s"
            )
            raise TimeoutError(
                f"distributed test {why}, after {now - start:.0f}s in all; " + "; ".join(reported)
            )
        # Short waits, so a progress report moves the deadline on.
        if ctx.join(timeout=max(0.1, min(deadline - now, 1.0))):
            break
    results = []
    for rank in range(world_size):
        with open(os.path.join(tmpdir, f"result_{rank}.pkl"), "rb") as fh:
            results.append(pickle.load(fh))
    return results


def _dump_after(allowed_s: float) -> float:
    """When a silent rank dumps its stacks: well before the parent stops it after ``allowed_s``
    (20 s before, or halfway for short allowances), never within the first second."""
    return max(1.0, allowed_s / 2, allowed_s - 20.0)


def raise_rank_errors(results: list[Any]) -> list[Any]:
    """Re-raise the first ``RankError`` with its remote traceback; otherwise return ``results``."""
    for r in results:
        if isinstance(r, RankError):
            raise RuntimeError(f"rank {r.rank} raised {r.type_name}: {r.message}\n{r.traceback}")
    return results
