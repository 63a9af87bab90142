"""Attention backends: causal attention inside the documents of a packed buffer.

``AttentionBackend`` is the interface ``HSPCoreAttention`` calls once per layer and micro-batch.
``TorchAttentionBackend``: torch's flash varlen kernel on CUDA (``runtime/compat.py`` for the
torch range), per-document SDPA elsewhere (the exact CPU path every test runs).
``TEAttentionBackend``: Transformer Engine's ``DotProductAttention`` in THD, and TE's own
context-parallel route for ring and hybrid groups (unproven on a GPU, docs/runtime.md).
"""

from __future__ import annotations

import itertools
import logging
import os
from collections.abc import Mapping, Sequence
from typing import Protocol

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_hsp.planner.routes import (
    RING_FUSED,
    TE_MIN_A2A_P2P_THD,
    ring_routes,
    te_carries_ring,
    te_doc_multiples,
    te_version_runs_a2a_p2p_thd,
)
from megatron_hsp.planner.run_spec import ATTENTION_BACKENDS, AttentionBackendName
from megatron_hsp.runtime.compat import torch_features, varlen_causal
from megatron_hsp.runtime.layout import te_cp_arguments
from megatron_hsp.runtime.packed import MicroBatchState
from megatron_hsp.runtime.ring import ring_route

log = logging.getLogger(__name__)


class AttentionBackend(Protocol):
    """Varlen causal attention over a packed buffer; one call per layer per micro-batch.

    q: [T, hq, D]; k, v: [T, hk, D] with hq % hk == 0 (query head j uses KV head j // (hq/hk));
    cu_seqlens: int32 [n+1] segment boundaries, cu_seqlens[-1] == T; returns [T, hq, D].
    Tokens attend only to earlier-or-equal tokens of their own segment. ``cu_seqlens_host``: the
    same boundaries as Python ints, known when the micro-batch was built, so a backend that needs
    them on the host reads no tensor back (no device sync per layer).
    """

    name: str

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cu_seqlens: torch.Tensor,
        max_seqlen: int,
        *,
        softmax_scale: float,
        dropout_p: float,
        cu_seqlens_host: Sequence[int] | None = None,
    ) -> torch.Tensor: ...


def _torch_varlen_available(q: torch.Tensor) -> bool:
    """The flash varlen kernel serves CUDA fp16/bf16 where the installed torch has it."""
    if not q.is_cuda or q.dtype not in (torch.float16, torch.bfloat16):
        return False
    return torch_features().varlen_attn


class TorchAttentionBackend:
    """torch backend: flash varlen kernel on CUDA (fp16/bf16), per-document SDPA elsewhere.

    The path is chosen by device and dtype only, never by dropout: torch's ``varlen_attn`` has no
    dropout (hard-coded 0), so dropout > 0 on that path is an error naming the flag rather than a
    silent switch to the slow loop (``--hsp`` refuses attention dropout at argument time). The
    per-document path is exact fp32 math on the CPU (tests) and any dtype on CUDA; it loops over
    documents in Python, which is fine for tests and short batches, not for production.
    ``force_sdpa`` pins the per-document path (used to compare the two on a GPU). Version
    differences of ``varlen_attn`` (``enable_gqa``) are handled in ``runtime/compat.py``.
    """

    name = "torch"

    def __init__(self, force_sdpa: bool = False) -> None:
        self.force_sdpa = force_sdpa

    def route(self, q: torch.Tensor) -> str:
        """The kernel a call with ``q`` takes (reported by the acceptance kit)."""
        return (
            "torch-varlen" if not self.force_sdpa and _torch_varlen_available(q) else "torch-sdpa"
        )

    def __call__(
        self, q, k, v, cu_seqlens, max_seqlen, *, softmax_scale, dropout_p, cu_seqlens_host=None
    ):
        if not self.force_sdpa and _torch_varlen_available(q):
            if dropout_p > 0:
                raise NotImplementedError(
                    f"attention dropout {dropout_p:g}: torch's varlen_attn kernel has no dropout; "
                    "train with --attention-dropout 0 (attention_dropout=0.0)"
                )
            cu = cu_seqlens.to(device=q.device, dtype=torch.int32)
            return varlen_causal(q, k, v, cu, max_seqlen, softmax_scale)
        bounds = cu_seqlens.tolist() if cu_seqlens_host is None else cu_seqlens_host
        return self._per_document(q, k, v, bounds, softmax_scale, dropout_p)

    @staticmethod
    def _per_document(q, k, v, bounds, softmax_scale, dropout_p):
        rep = q.size(1) // k.size(1)
        if rep > 1:  # GQA: query head j uses KV head j // rep (autograd sums the copies)
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        outs = []
        for s, e in itertools.pairwise(bounds):
            if e == s:
                continue
            o = F.scaled_dot_product_attention(
                q[s:e].transpose(0, 1),
                k[s:e].transpose(0, 1),
                v[s:e].transpose(0, 1),
                dropout_p=dropout_p,
                is_causal=True,
                scale=softmax_scale,
            )
            outs.append(o.transpose(0, 1))
        if not outs:  # empty buffer (a group without sequences): keep the autograd graph
            return q * 0.0
        return torch.cat(outs, dim=0)


def _drop_te_modules_from_state_dict(module, state_dict, prefix, local_metadata) -> None:
    for key in [k for k in state_dict if k.startswith(prefix + "te_modules.")]:
        del state_dict[key]


def _ignore_missing_te_modules(module, incompatible_keys) -> None:
    missing = incompatible_keys.missing_keys
    missing[:] = [k for k in missing if ".te_modules." not in k]


class TEAttentionBackend(torch.nn.Module):
    """Transformer Engine ``DotProductAttention`` in THD format (``padding_causal`` mask).

    NOT exercised on this project's CPU CI: written against TE's documented API
    (transformer_engine.pytorch.DotProductAttention, qkv_format="thd", cu_seqlens_q/kv int32 on
    CUDA, output [T, hq*D]). One TE module is built lazily per (hq, hk) head layout, because the
    per-rank head count changes with the group size (TE fixes head counts at construction; the
    modules hold no parameters). TE sees no TP or CP: heads are already the group-local ones.
    The modules are registered submodules (an ``nn.ModuleDict``; this backend is itself a
    submodule of ``HSPCoreAttention``), so ``.eval()``/``.train()``, ``.to()`` and hooks reach
    them; a plain dict hid them from the model.
    """

    name = "te"

    def route(self, q: torch.Tensor) -> str:
        return "te-thd"

    def __init__(self, config: TransformerConfig, layer_number: int, dropout: float) -> None:
        import transformer_engine.pytorch as te  # noqa: F401  (fails loudly if TE is absent)

        super().__init__()
        self._config = config
        self._layer_number = layer_number
        self._dropout = dropout
        self.te_modules = torch.nn.ModuleDict()
        self._cp_stream = None
        # The modules are created lazily per head layout, so a checkpoint must neither carry
        # them (a load before the first step would not have them) nor miss them (a load after
        # it would). They hold no parameters; TE's FP8 extra state is refused with --hsp.
        self.register_state_dict_post_hook(_drop_te_modules_from_state_dict)
        self.register_load_state_dict_post_hook(_ignore_missing_te_modules)

    def _module(self, hq: int, hk: int, dim: int, scale: float, cp: bool = False):
        # Context-parallel calls get their own modules: the CP group is module state in TE.
        # ModuleDict keys are strings (no dots).
        key = f"h{hq}_k{hk}_d{dim}_s{scale!r}_cp{int(cp)}".replace(".", "p")
        if key not in self.te_modules:
            import transformer_engine.pytorch as te

            module = te.DotProductAttention(
                num_attention_heads=hq,
                kv_channels=dim,
                num_gqa_groups=hk,
                attention_dropout=self._dropout,
                qkv_format="thd",
                attn_mask_type="padding_causal",
                tp_size=1,
                get_rng_state_tracker=(
                    tensor_parallel.get_cuda_rng_tracker if self._dropout > 0 else None
                ),
                layer_number=self._layer_number,
                softmax_scale=scale,
            )
            module.train(self.training)  # created lazily: take the model's current mode
            self.te_modules[key] = module
        return self.te_modules[key]

    def forward(
        self, q, k, v, cu_seqlens, max_seqlen, *, softmax_scale, dropout_p, cu_seqlens_host=None
    ):
        _require_cuda(q)
        cu = cu_seqlens.to(device=q.device, dtype=torch.int32)
        mod = self._module(q.size(1), k.size(1), q.size(2), softmax_scale)
        out = mod(
            q.contiguous(),  # the fused all-to-all hands out strided views
            k.contiguous(),
            v.contiguous(),
            qkv_format="thd",
            cu_seqlens_q=cu,
            cu_seqlens_kv=cu,
            max_seqlen_q=max_seqlen,
            max_seqlen_kv=max_seqlen,
            attn_mask_type="padding_causal",
        )
        return out.reshape(q.size(0), q.size(1), q.size(2))

    def context_parallel(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cu_seqlens: torch.Tensor,
        group: dist.ProcessGroup,
        ulysses_group: dist.ProcessGroup | None,
        ring_group: dist.ProcessGroup,
        *,
        softmax_scale: float,
        cu_seqlens_host: Sequence[int] | None = None,
        micro_batch: MicroBatchState | None = None,
    ) -> torch.Tensor | None:
        """TE's own context-parallel attention for a Ulysses x ring group, or None.

        UNPROVEN ON GPU (no TE run in this project yet; docs/gpu-validation.md). Takes this
        rank's LOCAL shard (``layout.rank_tokens``, before any all-to-all; RoPE already applied)
        with all heads of the TP rank and returns the local output [T/d, hq, D]. TE runs the
        Ulysses all-to-all over ``ulysses_group`` and the KV ring over ``ring_group`` itself
        (``cp_comm_type`` "a2a+p2p"; "p2p" for pure ring). None when TE cannot take the group:
        a segment not a multiple of ``2d`` (``layout.te_cp_arguments``), or THD with "a2a+p2p"
        on a TE that asserts it away (``te_thd_a2a_p2p_supported``); the caller then runs
        HSP's own Ulysses x ring path, the route the planner prices.

        ``micro_batch``: the micro-batch's shared state (``HSPPackedSeqParams.hsp_micro_batch``).
        TE's boundary tensors are built there once per micro-batch and group split -- on the
        host, pinned, copied ``non_blocking`` -- and reused by every layer: no host sync and no
        blocking copy inside a layer.
        """
        u = 1 if ulysses_group is None else ulysses_group.size()
        r = ring_group.size()
        cache = {} if micro_batch is None else micro_batch.te_cp
        key = (u, r)
        if key not in cache:
            host = cu_seqlens_host
            if host is None:  # a plain PackedSeqParams: one read-back, then cached
                host = cu_seqlens.detach().cpu().numpy()
            cache[key] = _te_cp_inputs(host, u, r, q.device)
        prepared = cache[key]
        if prepared is None:
            return None
        comm, fwd = prepared
        _require_cuda(q)
        if self._cp_stream is None and q.is_cuda:
            self._cp_stream = torch.cuda.Stream()
        if (comm, r) not in _HINTED:  # once per process and ring shape: a start-up hint
            _HINTED.add((comm, r))
            hint = te_p2p_hint(r, comm)
            if hint is not None:
                log.warning("megatron-hsp: %s", hint)
        mod = self._module(q.size(1), k.size(1), q.size(2), softmax_scale, cp=True)
        mod.set_context_parallel_group(
            cp_group=[ulysses_group, ring_group] if comm == "a2a+p2p" else ring_group,
            cp_global_ranks=[dist.get_global_rank(group, i) for i in range(group.size())],
            cp_stream=self._cp_stream,
            cp_comm_type=comm,
        )
        out = mod(q.contiguous(), k.contiguous(), v.contiguous(), **fwd)
        return out.reshape(q.size(0), q.size(1), q.size(2))


def _require_cuda(q: torch.Tensor) -> None:
    if not q.is_cuda:
        raise RuntimeError("the Transformer Engine attention backend needs CUDA tensors")


def _te_cp_inputs(
    cu_host: Sequence[int] | np.ndarray, u: int, r: int, device: torch.device
) -> tuple[str, dict[str, object]] | None:
    """``(cp_comm_type, forward keywords)`` for TE's context-parallel call, or None when TE
    cannot run the group (``context_parallel``'s docstring). Built once per micro-batch.

    One tensor per distinct array: ``te_cp_arguments`` hands the SAME boundaries as
    ``cu_seqlens`` and ``cu_seqlens_padded`` (no padding between sequences), and TE must see them
    as the same (separate copies made TE assume padding between sequences, which rules out its
    flash backends).
    """
    args = te_cp_arguments(cu_host, u, r)
    if args is None:
        return None
    comm = str(args["cp_comm_type"])
    if not te_carries_ring(u, te_thd_a2a_p2p_supported()):
        return None
    on_device: dict[int, torch.Tensor] = {}
    fwd: dict[str, object] = {}
    for name, val in args["forward"].items():  # type: ignore[union-attr]
        if isinstance(val, np.ndarray):
            if id(val) not in on_device:
                host = torch.from_numpy(val)
                if device.type == "cuda":
                    host = host.pin_memory()
                on_device[id(val)] = host.to(device, non_blocking=True)
            val = on_device[id(val)]
        fwd[name] = val
    return comm, fwd


# The Transformer Engine releases the TE backend is written and checked against (oldest, newest):
# tests/runtime/test_te_sources.py reads every keyword and format it passes in both releases'
# sources.
TE_SUPPORTED = ("2.14.0", "2.20.2")
# ``TE_MIN_A2A_P2P_THD`` (the first TE whose THD context parallelism runs "a2a+p2p") lives with
# the route rule in ``planner/routes.py``; re-exported here.
# TE batches a ring step's send and receive (one NCCL group call) only for a ring of 2 before
# Blackwell, unless NVTE_BATCH_MHA_P2P_COMM=1; otherwise it issues them one after another.
TE_BATCH_P2P_ENV = "NVTE_BATCH_MHA_P2P_COMM"
_HINTED: set[tuple[str, int]] = set()


def te_p2p_hint(ring: int, comm: str, environ: Mapping[str, str] | None = None) -> str | None:
    """A one-line hint to set ``NVTE_BATCH_MHA_P2P_COMM=1`` where TE's ring would issue its
    sends and receives serially (ring > 2, or any ring on Blackwell), None where it batches."""
    env = os.environ if environ is None else environ
    if env.get(TE_BATCH_P2P_ENV, "0") not in ("", "0") or comm not in ("p2p", "a2a+p2p"):
        return None
    if ring <= 2 and not _blackwell_or_newer():
        return None
    return (
        f"Transformer Engine runs this ring of {ring} ({comm}) with serialised send/recv; set "
        f"{TE_BATCH_P2P_ENV}=1 to batch them (what TE does by itself only for a ring of 2)"
    )


def _blackwell_or_newer() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 10


def te_thd_a2a_p2p_supported(version: str | None = None) -> bool:
    """Whether the installed (or given) Transformer Engine runs THD attention with
    ``cp_comm_type="a2a+p2p"``; hybrid groups run HSP's own Ulysses x ring path when not."""
    if version is None:
        version = te_version()
        if version is None:
            return False
    return te_version_runs_a2a_p2p_thd(version)


def te_version() -> str | None:
    """The installed Transformer Engine's version, None when it does not import."""
    try:
        import transformer_engine
    except ImportError:
        return None
    return str(getattr(transformer_engine, "__version__", "0"))


def te_available() -> bool:
    """True when Transformer Engine imports and CUDA is usable."""
    if not torch.cuda.is_available():
        return False
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:
        return False
    return True


def attention_routes_for_run(
    splits: Mapping[int, tuple[int, int]],
    backend: str,
    device_type: str,
    *,
    dtype: torch.dtype,
    head_dim: int,
) -> dict[int, str]:
    """``{group size: route}`` of the ring and hybrid groups of ``splits`` (``{size: (ulysses,
    ring)}``) as this process's attention will run them: what the planner's cost model prices
    (``load_cost_model(ring_routes=...)``, ``planner/routes.py``).

    ``backend``: the layer spec's attention backend (``auto`` / ``te`` / ``torch``, resolved as
    ``make_backend`` does). Off CUDA nothing is declared (empty map): there every route runs torch
    math in fp32 (per-document SDPA, the tiled ring), so no route is a different kernel class and
    the model's single coefficient stands. On CUDA a group TE does not carry runs HSP's own ring,
    fused or tiled as ``ring.ring_route`` decides for the model's ``dtype`` and ``head_dim`` (the
    rule ``ring_attention`` itself runs).
    """
    if device_type != "cuda":
        return {}
    if backend == "auto":
        backend = "te" if te_available() else "torch"
    version = te_version() if backend == "te" else None
    fused = ring_route(device_type, dtype, head_dim) == RING_FUSED
    return ring_routes(splits, te_version=version, fused_ring=fused)


def te_doc_multiples_for_run(
    splits: Mapping[int, tuple[int, int]], backend: str, device_type: str
) -> dict[int, int]:
    """``{group size: document multiple}`` this process's dispatch will pad to (``te_layout``
    with the installed TE, ``routes.te_doc_multiples``): only where Transformer Engine runs the
    attention and carries the group's ring. What the planner prices (``load_cost_model(
    doc_multiples=...)``), so its time and memory see the padding."""
    if device_type != "cuda":
        return {}
    if backend == "auto":
        backend = "te" if te_available() else "torch"
    return te_doc_multiples(splits, te_version=te_version() if backend == "te" else None)


def make_backend(
    name: str, config: TransformerConfig, layer_number: int, dropout: float
) -> AttentionBackend:
    """``auto`` -> TE where TE and CUDA are present, torch otherwise; or ``te`` / ``torch``
    (the closed vocabulary ``run_spec.AttentionBackendName``)."""
    try:
        choice = AttentionBackendName(name)
    except ValueError:
        *first, last = ATTENTION_BACKENDS
        known = f"{', '.join(map(repr, first))} or {last!r}"
        raise ValueError(f"unknown HSP attention backend {name!r}; use {known}") from None
    if choice is AttentionBackendName.AUTO:
        choice = AttentionBackendName.TE if te_available() else AttentionBackendName.TORCH
    if choice is AttentionBackendName.TE:
        return TEAttentionBackend(config, layer_number, dropout)
    return TorchAttentionBackend()


__all__ = [
    "TE_MIN_A2A_P2P_THD",
    "TE_SUPPORTED",
    "AttentionBackend",
    "TEAttentionBackend",
    "TorchAttentionBackend",
    "attention_routes_for_run",
    "make_backend",
    "te_available",
    "te_doc_multiples_for_run",
    "te_p2p_hint",
    "te_thd_a2a_p2p_supported",
    "te_version",
]
