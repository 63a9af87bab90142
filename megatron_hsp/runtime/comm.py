"""The collectives HSP's runtime issues on tensors, behind one adapter chosen once per process.

Why an adapter: to run many ranks on ONE GPU (docs/gpu-validation.md, "Many ranks on one GPU").
NCCL refuses two ranks on one device, so those ranks use gloo process groups, and gloo cannot
carry device tensors through all of the collectives the runtime issues (point-to-point, which
the ring's shifts use, takes host memory only; all-to-all, all-gather and all-reduce on device
tensors differ between torch versions). Rather than teach the attention code about it, every
collective the runtime issues on a tensor goes through ``comm()``:

* ``DirectComm`` (the default; NCCL on GPUs, gloo on CPU ranks): the torch call, unchanged;
* ``HostStagedComm`` (ranks sharing a device): each tensor is copied into a host buffer (pinned
  where the tensor is on CUDA, so the copy back is asynchronous), the collective runs on the
  host buffers over gloo, and received data is copied back into the caller's tensor -- after
  ``wait()`` for point-to-point, so the ring's side-stream shift keeps its shape. CPU tensors take
  the same path (a host copy, the collective, a copy back): that is how CI runs it.

The adapter is chosen once, where the world group is created (``testing/dist.init_megatron``
with ``ranks_share_device``), never per call and never in the attention code. ``rank_device``
is the one rule for which device a rank computes on.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist


def rank_device(kind: str, local_rank: int, ranks_share_device: bool = False) -> torch.device:
    """The device a rank computes on: the CPU for ``kind`` "cpu"; on CUDA ``cuda:LOCAL_RANK``
    (one GPU per rank, NCCL), or ``cuda:0`` for every rank when ranks share one device."""
    if kind == "cpu":
        return torch.device("cpu")
    if kind != "cuda":
        raise ValueError(f"device kind {kind!r}: choose cuda or cpu")
    return torch.device("cuda", 0 if ranks_share_device else local_rank)


class DirectComm:
    """The torch collectives as they are (each backend carries the tensors it is given)."""

    staged = False

    def all_to_all_single(
        self, output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup | None
    ) -> None:
        dist.all_to_all_single(output, input, group=group)

    def all_gather(
        self, outputs: list[torch.Tensor], input: torch.Tensor, group: dist.ProcessGroup | None
    ) -> None:
        dist.all_gather(outputs, input, group=group)

    def all_reduce(
        self, tensor: torch.Tensor, group: dist.ProcessGroup | None = None, op: Any = None
    ) -> None:
        """``op`` None: a sum (torch's default, called exactly as before the adapter)."""
        if op is None:
            dist.all_reduce(tensor, group=group)
        else:
            dist.all_reduce(tensor, op=op, group=group)

    def batch_isend_irecv(self, ops: Sequence[dist.P2POp]) -> list[Any]:
        return list(dist.batch_isend_irecv(list(ops)))


def _host_copy(t: torch.Tensor) -> torch.Tensor:
    """``t``'s data in a new host buffer: pinned for a CUDA tensor (waits for the copy, so the
    host may hand the buffer to gloo), a plain copy of a CPU tensor."""
    if not t.is_cuda:
        return t.detach().clone(memory_format=torch.contiguous_format)
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t)  # device -> pinned host, synchronous: after the stream's work on ``t``
    return host


def _host_like(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda)


def _copy_back(dst: torch.Tensor, host: torch.Tensor) -> None:
    """Received host data into the caller's tensor (asynchronous from pinned memory; torch's
    host allocator keeps the buffer alive until the copy has run)."""
    dst.copy_(host, non_blocking=host.is_pinned())


class _StagedWork:
    """A point-to-point request whose ``wait`` also copies a received host buffer back."""

    def __init__(self, work: Any, dst: torch.Tensor | None, host: torch.Tensor) -> None:
        self._work, self._dst, self._host = work, dst, host

    def wait(self, *args: Any) -> bool:
        self._work.wait(*args)
        if self._dst is not None:
            _copy_back(self._dst, self._host)
            self._dst = None
        return True

    def is_completed(self) -> bool:
        return self._dst is None and self._work.is_completed()


class HostStagedComm(DirectComm):
    """Every collective on host buffers (module docstring): for gloo groups of ranks that share
    one GPU, and on CPU ranks to run that path in CI."""

    staged = True

    def __init__(self) -> None:
        # Collectives this process staged (the kit reports it: proof the path ran).
        self.calls = 0

    def all_to_all_single(
        self, output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup | None
    ) -> None:
        self.calls += 1
        host_out = _host_like(output)
        dist.all_to_all_single(host_out, _host_copy(input), group=group)
        _copy_back(output, host_out)

    def all_gather(
        self, outputs: list[torch.Tensor], input: torch.Tensor, group: dist.ProcessGroup | None
    ) -> None:
        self.calls += 1
        host_outs = [_host_like(o) for o in outputs]
        dist.all_gather(host_outs, _host_copy(input), group=group)
        for out, host in zip(outputs, host_outs, strict=True):
            _copy_back(out, host)

    def all_reduce(
        self, tensor: torch.Tensor, group: dist.ProcessGroup | None = None, op: Any = None
    ) -> None:
        self.calls += 1
        host = _host_copy(tensor)
        DirectComm.all_reduce(self, host, group, op)
        _copy_back(tensor, host)

    def batch_isend_irecv(self, ops: Sequence[dist.P2POp]) -> list[Any]:
        self.calls += 1
        staged, backs = [], []
        for op in ops:
            if op.op in (dist.isend, dist.send):
                host, back = _host_copy(op.tensor), None
            else:
                host, back = _host_like(op.tensor), op.tensor
            staged.append(dist.P2POp(op.op, host, op.peer, op.group, op.tag))
            backs.append((back, host))
        works = dist.batch_isend_irecv(staged)
        return [_StagedWork(w, b, h) for w, (b, h) in zip(works, backs, strict=True)]


DIRECT = DirectComm()
HOST_STAGED = HostStagedComm()
_active: list[DirectComm] = [DIRECT]


def comm() -> DirectComm:
    """The process's adapter (``DIRECT`` unless ``use_comm`` chose another)."""
    return _active[0]


def use_comm(adapter: DirectComm) -> None:
    """Choose the process's adapter; called once where its world group is created (and with
    ``DIRECT`` when that group is torn down)."""
    _active[0] = adapter


__all__ = ["DIRECT", "HOST_STAGED", "comm", "rank_device", "use_comm"]
