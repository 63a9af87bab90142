"""Test-only: a stand-in ``transformer_engine.pytorch`` that records what HSP passes to TE.

Transformer Engine cannot run on the CPU, so the TE backend's calls are captured instead: every
``DotProductAttention(...)`` construction, ``set_context_parallel_group(...)`` and forward call
lands in ``CALLS`` with its keywords. ``tests/runtime/test_te_sources.py`` checks those keywords and
values against TE's own sources (oldest and newest supported release), and
``tests/runtime/test_host_syncs.py`` runs a real megatron-core model through the TE route with it to
count host synchronisations. No numerics are faked or checked: the stand-in's attention returns
its query unchanged (the graph stays connected, nothing else is claimed).

``install()`` puts the stand-in in ``sys.modules`` (megatron-core must be imported first: it
reads TE's presence at import) and lets the TE backend take CPU tensors (its CUDA guard,
``backends._require_cuda``, is the only thing replaced). ``uninstall()`` restores both.
"""

from __future__ import annotations

import sys
import types
from typing import Any

import torch

# (call, positional argument count, keywords) in call order, this process.
CALLS: list[tuple[str, int, dict[str, Any]]] = []


class DotProductAttention(torch.nn.Module):
    """Parameter-free with extra state, as TE's is; records every call."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__()
        self.kwargs = kwargs
        CALLS.append(("__init__", len(args), dict(kwargs)))

    def get_extra_state(self) -> dict[str, Any]:
        return {"fp8_meta": None}

    def set_extra_state(self, state: Any) -> None:
        pass

    def set_context_parallel_group(self, *args: Any, **kwargs: Any) -> None:
        CALLS.append(("set_context_parallel_group", len(args), dict(kwargs)))

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        CALLS.append(("forward", len(args), dict(kwargs)))
        q = args[0]
        return q.reshape(q.size(0), -1) * 1.0


_saved: dict[str, Any] = {}


def install(version: str = "2.20.2") -> None:
    """Make ``import transformer_engine.pytorch`` give the stand-in, reporting ``version``
    (what the backend's version gates read; idempotent)."""
    import megatron.core.transformer.transformer_config  # noqa: F401  (reads TE at import)

    from megatron_hsp.runtime import backends

    if _saved:
        return
    _saved["modules"] = {
        n: sys.modules.get(n) for n in ("transformer_engine", "transformer_engine.pytorch")
    }
    _saved["guard"] = backends._require_cuda
    te = types.ModuleType("transformer_engine")
    te.__version__ = version
    te_pt = types.ModuleType("transformer_engine.pytorch")
    te_pt.DotProductAttention = DotProductAttention
    te.pytorch = te_pt
    sys.modules["transformer_engine"] = te
    sys.modules["transformer_engine.pytorch"] = te_pt
    backends._require_cuda = lambda q: None
    CALLS.clear()


def uninstall() -> None:
    from megatron_hsp.runtime import backends

    if not _saved:
        return
    for name, module in _saved["modules"].items():
        if module is None:
            sys.modules.pop(name, None)
        else:
            sys.modules[name] = module
    backends._require_cuda = _saved["guard"]
    _saved.clear()
