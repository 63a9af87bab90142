"""HSP core attention: Ulysses all-to-all over the micro-batch's group, varlen causal attention.

Injected through megatron-core's layer spec (``megatron_hsp.megatron.spec``), never by patching
``GPTModel``. Per micro-batch the schedule passes a ``PackedSeqParams`` (``qkv_format="thd"``)
whose ``cp_group`` is that micro-batch's sequence-parallel group and whose ``cu_seqlens_q`` describe
the group's WHOLE packed buffer (all documents plus a trailing padding segment, total a multiple of
the group size ``d``); group rank ``i`` holds the tokens ``layout.rank_tokens(cu, u, r, i)`` of it
(contiguous slice ``i`` for pure Ulysses, the load-balanced 2r-chunk layout for ring degree r > 1).

Data flow on one rank (``np``/``ng`` = query/KV heads per tensor-parallel rank)::

    q [T/d, np, D], k/v [T/d, ng, D]
      -> replicate KV heads if ng is not a multiple of d (autograd sums the copies' grads)
      -> all-to-all: scatter heads, gather sequence -> q [T, np/d, D], k/v [T, ng*r/d, D]
      -> RoPE at each token's position inside its own document (full buffer is present here)
      -> backend: causal attention within documents only (varlen)
      -> all-to-all back: gather heads, scatter sequence -> [T/d, np*D]

Why RoPE here: Megatron's THD RoPE (``_apply_rotary_pos_emb_thd``) assumes its static CP group's
load-balanced 2*cp chunking and splits the LOCAL tokens by the WHOLE buffer's ``cu_seqlens``; with
contiguous per-rank slices of a dynamic group it is wrong (or fails to split). ``HSPSelfAttention``
therefore hands Megatron's rotary table to this module (``HSPPackedSeqParams``) instead of letting
``SelfAttention`` apply it, and we apply it after the gather with megatron's own unfused RoPE math,
so the numbers equal a single-device run. See docs/runtime.md.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import re
from collections.abc import Sequence
from typing import Protocol

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_hsp.planner.groupspace import kv_copies
from megatron_hsp.runtime.compat import torch_features, varlen_causal
from megatron_hsp.runtime.layout import rank_tokens, ring_position_tokens, te_cp_arguments
from megatron_hsp.runtime.ring import ring_attention

# ---------------------------------------------------------------------------------------------
# Group-size rules (start-up check and the per-call check share them)
# ---------------------------------------------------------------------------------------------


def heads_per_tp_rank(config: TransformerConfig, tp: int) -> tuple[int, int]:
    """(query heads, KV heads) on one tensor-parallel rank, as megatron's attention splits them."""
    heads = config.num_attention_heads
    kv = config.num_query_groups or heads
    if heads % tp:
        raise ValueError(
            f"num_attention_heads={heads} is not divisible by tensor-model-parallel size {tp}"
        )
    # megatron replicates KV heads across TP ranks when there are fewer KV heads than TP ranks.
    return heads // tp, max(kv, tp) // tp


def kv_replication_factor(q_heads: int, kv_heads: int, group_size: int) -> int:
    """Copies of each KV head for Ulysses over ``group_size`` ranks (``groupspace.kv_copies``)."""
    return kv_copies(q_heads, kv_heads, group_size)


def usable_group_sizes(config: TransformerConfig, tp: int, max_size: int) -> list[int]:
    """Sequence-parallel group sizes in [1, max_size] that Ulysses can use for this model."""
    q, _ = heads_per_tp_rank(config, tp)
    return [d for d in range(1, max_size + 1) if q % d == 0]


def check_group_sizes(config: TransformerConfig, sizes, tp: int = 1) -> None:
    """Start-up check: every group size a plan may use must divide the query heads per TP rank.

    Raises ``ValueError`` naming the model's heads, the offending sizes and the usable ones. Pure
    function of its arguments, so every rank raises the same error (no rank is left in a
    collective). KV heads never restrict the size: they are replicated when the group is larger.
    """
    q, _ = heads_per_tp_rank(config, tp)
    bad = sorted({int(d) for d in sizes if int(d) < 1 or q % int(d)})
    if bad:
        ok = usable_group_sizes(config, tp, max(max(int(d) for d in sizes), q))
        raise ValueError(
            f"HSP sequence-parallel group size(s) {bad} cannot split the attention heads: "
            f"the model has num_attention_heads={config.num_attention_heads} "
            f"(num_query_groups={config.num_query_groups or config.num_attention_heads}), i.e. {q} "
            f"query heads per tensor-parallel rank at tp={tp}; Ulysses needs the group size to "
            f"divide that. Usable sizes: {ok}. Restrict the planner's group sizes "
            f"(e.g. --hsp-group-sizes) or change tp."
        )


# ---------------------------------------------------------------------------------------------
# Autograd-correct Ulysses all-to-all
# ---------------------------------------------------------------------------------------------


def _seq_to_head(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """[T/d, H, D] (my tokens, all heads) -> [T, H/d, D] (all tokens, my heads)."""
    d = group.size()
    t, h, dim = x.shape
    send = x.reshape(t, d, h // d, dim).transpose(0, 1).contiguous()  # chunk j -> rank j
    recv = torch.empty_like(send)  # recv[j] = rank j's tokens of my head chunk
    dist.all_to_all_single(recv, send, group=group)
    return recv.reshape(d * t, h // d, dim)


def _head_to_seq(y: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """[T, H/d, D] (all tokens, my heads) -> [T/d, H, D] (my tokens, all heads)."""
    d = group.size()
    total, hd, dim = y.shape
    send = y.reshape(d, total // d, hd, dim).contiguous()  # token chunk j -> rank j
    recv = torch.empty_like(send)  # recv[j] = my tokens of rank j's head chunk
    dist.all_to_all_single(recv, send, group=group)
    return recv.transpose(0, 1).reshape(total // d, d * hd, dim)


class _SeqToHead(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _seq_to_head(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _head_to_seq(grad.contiguous(), ctx.group), None


class _HeadToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, group):
        ctx.group = group
        return _head_to_seq(y, group)

    @staticmethod
    def backward(ctx, grad):
        return _seq_to_head(grad.contiguous(), ctx.group), None


def all_to_all_seq_to_head(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Scatter heads, gather sequence (backward: the reverse all-to-all). No-op for d <= 1."""
    if group is None or group.size() == 1:
        return x
    return _SeqToHead.apply(x, group)


def all_to_all_head_to_seq(y: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Gather heads, scatter sequence (backward: the reverse all-to-all). No-op for d <= 1."""
    if group is None or group.size() == 1:
        return y
    return _HeadToSeq.apply(y, group)


def _qkv_seq_to_head(q, k, v, group):
    """One all-to-all for q, k and v together (one collective per layer instead of three).

    Each destination rank's chunk is [its q heads | its k heads | its v heads], so the combined
    tensor goes through the same scatter-heads/gather-sequence exchange and is split afterwards.
    """
    d = 1 if group is None else group.size()
    if d == 1:
        return q, k, v
    t, dim = q.size(0), q.size(2)
    cq, ck = q.size(1) // d, k.size(1) // d
    combined = torch.cat(
        [q.reshape(t, d, cq, dim), k.reshape(t, d, ck, dim), v.reshape(t, d, ck, dim)], dim=2
    ).reshape(t, d * (cq + 2 * ck), dim)
    out = all_to_all_seq_to_head(combined, group)
    return out.split([cq, ck, ck], dim=1)


# ---------------------------------------------------------------------------------------------
# Packed-sequence helpers and RoPE
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass
class HSPPackedSeqParams(PackedSeqParams):
    """megatron-core's ``PackedSeqParams`` with HSP's per-micro-batch state as declared fields
    (the way megatron-core declares ``cp_scatter_cache``), never attributes attached at run time.

    ``hsp_micro_batch``: what every layer of one micro-batch shares, filled on the host when the
    micro-batch is built (``schedule.packed_seq_params``: ``cu_host`` the buffer's segment
    boundaries as Python ints, ``layout_ring`` the ring degree dispatch laid the tokens out for,
    ``hybrid`` the (Ulysses, ring) sub-groups) and completed once, by the first layer, with the
    per-token positions and ring indices; so no layer after the first reads a tensor back to the
    host (``tests/test_host_syncs.py``). The same dict object is shared by the per-layer copies
    ``wrap`` makes. ``rotary_*``: megatron's rotary table, so RoPE runs inside the HSP core
    attention (built per layer call by ``HSPSelfAttention``).
    """

    hsp_micro_batch: dict = dataclasses.field(default_factory=dict)
    rotary_q_freqs: torch.Tensor | None = None
    rotary_k_freqs: torch.Tensor | None = None
    rotary_mscale: float = 1.0

    @classmethod
    def wrap(cls, p: PackedSeqParams, q_freqs, k_freqs, mscale: float) -> HSPPackedSeqParams:
        kwargs = {f.name: getattr(p, f.name) for f in dataclasses.fields(PackedSeqParams)}
        total_tokens, seq_idx = kwargs.pop("total_tokens"), kwargs.pop("seq_idx")
        out = cls(
            **kwargs,
            hsp_micro_batch=_micro_batch_cache(p),  # shared by every layer of the micro-batch
            rotary_q_freqs=q_freqs,
            rotary_k_freqs=k_freqs,
            rotary_mscale=mscale,
        )
        out.total_tokens, out.seq_idx = total_tokens, seq_idx  # skip __post_init__'s recompute
        return out


def group_packed_seq_params(
    cu_seqlens: torch.Tensor,
    group: dist.ProcessGroup | None,
    hybrid: tuple[dist.ProcessGroup | None, dist.ProcessGroup | None] | None = None,
) -> PackedSeqParams:
    """The ``PackedSeqParams`` the HSP attention expects for one micro-batch (docs/runtime.md).

    ``cu_seqlens``: int32 boundaries of the group's whole buffer (documents, then the trailing
    padding segment), ``cu_seqlens[-1]`` a multiple of the group size. ``max_seqlen`` covers the
    padding segment too, because it sizes megatron's RoPE table. ``hybrid``: the group's
    (Ulysses sub-group, ring sub-group) from ``GroupRegistry.hybrid`` when its ring degree > 1;
    None runs pure Ulysses over ``group``.
    """
    d = 1 if group is None else group.size()
    total = int(cu_seqlens[-1])
    if total % d:
        raise ValueError(
            f"packed buffer of {total} tokens is not a multiple of the group size {d}: pad it "
            f"with one trailing segment of {-total % d} tokens"
        )
    longest = int((cu_seqlens[1:] - cu_seqlens[:-1]).max()) if cu_seqlens.numel() > 1 else 0
    cu = cu_seqlens.to(torch.int32)
    state: dict = {"cu_host": [int(x) for x in cu_seqlens.tolist()]}
    if hybrid is not None and hybrid[1] is not None and hybrid[1].size() > 1:
        state["hybrid"] = hybrid
    return HSPPackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        max_seqlen_q=longest,
        max_seqlen_kv=longest,
        cp_group=group,
        local_cp_size=d,
        hsp_micro_batch=state,
    )


def _micro_batch_cache(p: PackedSeqParams) -> dict:
    """The micro-batch's shared state (``HSPPackedSeqParams.hsp_micro_batch``).

    A plain megatron ``PackedSeqParams`` (built by other code) gets a fresh dict: correct, but
    then each layer re-derives what an ``HSPPackedSeqParams`` from the schedule carries.
    """
    return p.hsp_micro_batch if isinstance(p, HSPPackedSeqParams) else {}


def positions_in_documents(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """Position of every token inside its own segment: [0..L0-1, 0..L1-1, ...] (int64)."""
    cu = cu_seqlens.to(torch.int64)
    lengths = cu[1:] - cu[:-1]
    starts = torch.repeat_interleave(cu[:-1], lengths, output_size=total)
    return torch.arange(total, device=cu.device) - starts


def apply_rope_packed(
    t: torch.Tensor,
    freqs: torch.Tensor,
    positions: torch.Tensor,
    config: TransformerConfig,
    mscale: float = 1.0,
    check_range: bool = True,
) -> torch.Tensor:
    """RoPE on packed ``t`` [T, h, D] with per-token positions, using megatron's unfused math.

    ``freqs`` is megatron's rotary table [S, 1, 1, rot_dim] for positions 0..S-1 (what
    ``GPTModel`` computes for THD input with S = max_seqlen). Same elementwise operations as
    megatron's single-sequence (bshd) path, hence the same numbers as a single-device run.
    """
    if check_range and positions.numel() and int(positions.max()) >= freqs.size(0):
        raise ValueError(
            f"RoPE table covers {freqs.size(0)} positions but a packed segment reaches position "
            f"{int(positions.max())}: PackedSeqParams.max_seqlen_q/kv must be the longest segment "
            f"in cu_seqlens (trailing padding segment included)"
        )
    per_token = freqs.index_select(0, positions.to(freqs.device)).reshape(
        positions.numel(), 1, freqs.size(-1)
    )
    return _apply_rotary_pos_emb_bshd(
        t, per_token, rotary_interleaved=config.rotary_interleaved, mscale=mscale
    )


# ---------------------------------------------------------------------------------------------
# Backends: causal attention inside documents of a packed buffer
# ---------------------------------------------------------------------------------------------


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
    them; a plain dict hid them from the model (issue 15).
    """

    name = "te"

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
        if not q.is_cuda:
            raise RuntimeError("the Transformer Engine attention backend needs CUDA tensors")
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
    ) -> torch.Tensor | None:
        """TE's own context-parallel attention for a Ulysses x ring group, or None.

        UNPROVEN ON GPU (no TE run in this project yet; docs/runtime.md). Takes this rank's LOCAL
        shard (``layout.rank_tokens``, before any all-to-all; RoPE already applied) with all
        heads of the TP rank and returns the local output [T/d, hq, D]. TE runs the Ulysses
        all-to-all over ``ulysses_group`` and the KV ring over ``ring_group`` itself
        (``cp_comm_type`` "a2a+p2p"; "p2p" for pure ring). None when a segment is not a multiple
        of ``2d`` (``layout.te_cp_arguments``): the caller then runs the torch ring path.
        """
        u = 1 if ulysses_group is None else ulysses_group.size()
        r = ring_group.size()
        host = cu_seqlens.detach().cpu().numpy() if cu_seqlens_host is None else cu_seqlens_host
        args = te_cp_arguments(host, u, r)
        if args is None:
            return None
        if args["cp_comm_type"] == "a2a+p2p" and not te_thd_a2a_p2p_supported():
            return None  # TE <= 2.14 crashes on THD with a2a+p2p: the torch ring path runs it
        if not q.is_cuda:
            raise RuntimeError("the Transformer Engine attention backend needs CUDA tensors")
        if self._cp_stream is None:
            self._cp_stream = torch.cuda.Stream()
        mod = self._module(q.size(1), k.size(1), q.size(2), softmax_scale, cp=True)
        comm = args["cp_comm_type"]
        mod.set_context_parallel_group(
            [ulysses_group, ring_group] if comm == "a2a+p2p" else ring_group,
            [dist.get_global_rank(group, i) for i in range(group.size())],
            self._cp_stream,
            comm,
        )
        # One tensor per distinct array: te_cp_arguments hands the SAME boundaries as
        # cu_seqlens and cu_seqlens_padded (no padding between sequences), and TE must see them
        # as the same (separate copies made TE assume padding between sequences, which rules out
        # its flash backends).
        on_device: dict[int, torch.Tensor] = {}
        fwd = {}
        for key, val in args["forward"].items():
            if isinstance(val, np.ndarray):
                if id(val) not in on_device:
                    on_device[id(val)] = torch.from_numpy(val).to(q.device)
                val = on_device[id(val)]
            fwd[key] = val
        out = mod(q.contiguous(), k.contiguous(), v.contiguous(), **fwd)
        return out.reshape(q.size(0), q.size(1), q.size(2))


# TE fixed THD with cp_comm_type "a2a+p2p" in 2.15 (2.14 and older crash in that path).
TE_MIN_A2A_P2P_THD = (2, 15)


def te_thd_a2a_p2p_supported(version: str | None = None) -> bool:
    """Whether the installed (or given) Transformer Engine runs THD attention with
    ``cp_comm_type="a2a+p2p"``; hybrid groups fall back to the torch ring path when not."""
    if version is None:
        try:
            import transformer_engine
        except ImportError:
            return False
        version = getattr(transformer_engine, "__version__", "0")
    parts = [int(x) for x in re.findall(r"\d+", version)[:2]]
    return tuple(parts + [0] * (2 - len(parts))) >= TE_MIN_A2A_P2P_THD


def te_available() -> bool:
    """True when Transformer Engine imports and CUDA is usable."""
    if not torch.cuda.is_available():
        return False
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:
        return False
    return True


def make_backend(
    name: str, config: TransformerConfig, layer_number: int, dropout: float
) -> AttentionBackend:
    """``auto`` -> TE where TE and CUDA are present, torch otherwise; or ``te`` / ``torch``."""
    if name == "auto":
        name = "te" if te_available() else "torch"
    if name == "te":
        return TEAttentionBackend(config, layer_number, dropout)
    if name == "torch":
        return TorchAttentionBackend()
    raise ValueError(f"unknown HSP attention backend {name!r}; use 'auto', 'te' or 'torch'")


# ---------------------------------------------------------------------------------------------
# The core-attention module
# ---------------------------------------------------------------------------------------------


class HSPCoreAttention(MegatronModule):
    """Drop-in ``core_attention`` for megatron-core's ``SelfAttention`` (same ctor/forward).

    THD input (``packed_seq_params.qkv_format == "thd"``): Ulysses over ``packed_seq_params.
    cp_group`` (None or size 1: no communication), varlen causal attention within the segments
    of ``cu_seqlens_q``, RoPE from ``HSPPackedSeqParams`` if present. BSHD input (no
    packed_seq_params): plain causal attention per batch row, no communication (RoPE was
    applied by megatron as usual).
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection: ProcessGroupCollection | None = None,
        backend: str | AttentionBackend = "auto",
    ) -> None:
        super().__init__(config=config)
        if attn_mask_type not in (AttnMaskType.causal, AttnMaskType.padding_causal):
            raise NotImplementedError(
                f"HSP attention is causal-within-documents only; got attn_mask_type="
                f"{attn_mask_type.name}"
            )
        if attention_type != "self":
            raise NotImplementedError("HSP attention supports self-attention only")
        if config.window_size is not None:
            raise NotImplementedError("HSP attention does not support sliding-window attention")
        if getattr(config, "softmax_type", "vanilla") != "vanilla":
            raise NotImplementedError("HSP attention supports softmax_type='vanilla' only")
        if config.context_parallel_size != 1:
            raise ValueError(
                "HSP replaces megatron's static context parallelism: set "
                f"--context-parallel-size 1 (got {config.context_parallel_size})"
            )
        self.layer_number = max(1, layer_number)
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp"])
        tp = pg_collection.tp.size() if pg_collection.tp is not None else 1
        self.num_heads, self.num_kv_heads = heads_per_tp_rank(config, tp)
        self.head_dim = config.kv_channels
        # apply_query_key_layer_scaling divides and multiplies back by layer_number in megatron
        # (net effect 1/sqrt(d) in exact arithmetic), so the plain scale is the same math.
        self.softmax_scale = (
            softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(self.head_dim)
        )
        self.dropout_p = (
            config.attention_dropout if attention_dropout is None else attention_dropout
        )
        self.backend: AttentionBackend = (
            make_backend(backend, config, self.layer_number, self.dropout_p)
            if isinstance(backend, str)
            else backend
        )

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: PackedSeqParams | None = None,
    ) -> torch.Tensor:
        """Returns [T/d, np*D] for THD input, [s, b, np*D] for BSHD input."""
        if attention_bias is not None:
            raise NotImplementedError("HSP attention does not support attention_bias")
        if attn_mask_type not in (None, AttnMaskType.causal, AttnMaskType.padding_causal):
            raise NotImplementedError(f"HSP attention is causal only; got {attn_mask_type}")
        # attention_mask is ignored like in TE's causal path: causality within documents is
        # defined by cu_seqlens (THD) or by the sequence itself (BSHD).
        dropout_p = self.dropout_p if self.training else 0.0
        if packed_seq_params is None or packed_seq_params.qkv_format != "thd":
            return self._forward_bshd(query, key, value, dropout_p)
        return self._forward_thd(query, key, value, packed_seq_params, dropout_p)

    def _attend(self, q, k, v, cu_seqlens, max_seqlen, dropout_p, cu_host=None):
        host = {} if cu_host is None else {"cu_seqlens_host": cu_host}
        if dropout_p > 0 and q.is_cuda and not self.config.sequence_parallel:
            # Same RNG stream choice as megatron's DotProductAttention (heads differ per TP rank).
            with tensor_parallel.get_cuda_rng_tracker().fork():
                return self.backend(
                    q,
                    k,
                    v,
                    cu_seqlens,
                    max_seqlen,
                    softmax_scale=self.softmax_scale,
                    dropout_p=dropout_p,
                    **host,
                )
        return self.backend(
            q,
            k,
            v,
            cu_seqlens,
            max_seqlen,
            softmax_scale=self.softmax_scale,
            dropout_p=dropout_p,
            **host,
        )

    def _forward_bshd(self, query, key, value, dropout_p):
        s, b = query.shape[:2]
        q = query.transpose(0, 1).reshape(b * s, *query.shape[2:])
        k = key.transpose(0, 1).reshape(b * s, *key.shape[2:])
        v = value.transpose(0, 1).reshape(b * s, *value.shape[2:])
        cu = torch.arange(0, (b + 1) * s, s, dtype=torch.int32, device=query.device)
        out = self._attend(q, k, v, cu, s, dropout_p, list(range(0, (b + 1) * s, s)))
        return out.reshape(b, s, -1).transpose(0, 1).contiguous()

    def _forward_thd(self, query, key, value, p: PackedSeqParams, dropout_p):
        group = p.cp_group
        d = 1 if group is None else group.size()
        local = query.size(0)
        total = local * d
        cu = p.cu_seqlens_q
        cache = _micro_batch_cache(p)
        key_now = (cu, total)  # keyed by the tensor object: a re-used params object re-checks
        if (
            cache.get("checked") is None
            or cache["checked"][0] is not cu
            or (cache["checked"][1] != total)
        ):
            if "cu_host" not in cache:  # plain PackedSeqParams: read the bounds back once
                cache["cu_host"] = [int(x) for x in cu.tolist()]
            _checked_cu_seqlens(p, total, d, cache["cu_host"])
            cache["checked"] = key_now
            cache.pop("positions", None)
            cache.pop("ring_index", None)
            cache.pop("local_index", None)
        cu_host = cache["cu_host"]

        nq, nkv = query.size(1), key.size(1)
        ulysses_group, ring_group = cache.get("hybrid", (group, None))
        u = 1 if ulysses_group is None else ulysses_group.size()
        r = 1 if ring_group is None else ring_group.size()
        if u * r != d:
            raise ValueError(
                f"hybrid split ulysses {u} x ring {r} does not make the group of {d}; build the "
                "PackedSeqParams with group_packed_seq_params(..., hybrid=registry.hybrid(...))"
            )
        if nq % u:
            raise ValueError(
                f"Ulysses degree {u} (group of size {d}) cannot split the {nq} query heads per "
                f"tensor-parallel rank (num_attention_heads={self.config.num_attention_heads}); "
                "the group's split must come from groupspace.HeadSpace.split"
            )
        copies = kv_copies(nq, nkv, u)
        if copies > 1:
            key = key.repeat_interleave(copies, dim=1)
            value = value.repeat_interleave(copies, dim=1)

        layout_ring = cache.get("layout_ring")
        if layout_ring is not None and layout_ring != r:
            raise ValueError(
                f"the micro-batch was dispatched in the ring-{layout_ring} token layout but its "
                f"group runs ring degree {r}: dispatch with the registry's split "
                "(dispatch(..., ring_of=schedule.registry_ring(registry)))"
            )
        te_route = getattr(self.backend, "context_parallel", None) if r > 1 else None
        if te_route is not None:
            out = self._te_context_parallel(te_route, query, key, value, p, cache, total)
            if out is not None:
                return out.reshape(local, nq * self.head_dim)
        q, k, v = _qkv_seq_to_head(query, key, value, ulysses_group)
        # This rank now holds ring position j's tokens (load-balanced 2d-chunk layout,
        # runtime/layout.py, the function dispatch used), for its h/u heads.
        index = None
        if r > 1:
            if "ring_index" not in cache:
                j = dist.get_rank(group) // u
                held = ring_position_tokens(np.asarray(cu_host, dtype=np.int64), u, r, j)
                cache["ring_index"] = torch.from_numpy(held).to(q.device)
            index = cache["ring_index"]

        if isinstance(p, HSPPackedSeqParams) and (
            p.rotary_q_freqs is not None or p.rotary_k_freqs is not None
        ):
            first = "positions" not in cache  # range-check the table once per micro-batch
            if first:
                cache["positions"] = positions_in_documents(cu, total)
            pos = cache["positions"] if index is None else cache["positions"][index]
            if p.rotary_q_freqs is not None:
                q = apply_rope_packed(
                    q, p.rotary_q_freqs, pos, self.config, p.rotary_mscale, check_range=first
                )
            if p.rotary_k_freqs is not None:
                k = apply_rope_packed(
                    k, p.rotary_k_freqs, pos, self.config, p.rotary_mscale, check_range=first
                )

        if r > 1:
            if dropout_p > 0:
                raise NotImplementedError("HSP ring attention does not support attention dropout")
            doc = torch.searchsorted(cu.to(q.device, torch.int64), index, right=True)
            out = ring_attention(q, k, v, index, doc, ring_group, self.softmax_scale)
        else:
            max_seqlen = int(p.max_seqlen_q) if p.max_seqlen_q is not None else total
            out = self._attend(q, k, v, cu, max_seqlen, dropout_p, cu_host)
        out = all_to_all_head_to_seq(out, ulysses_group)
        return out.reshape(local, nq * self.head_dim)

    def _te_context_parallel(self, te_route, query, key, value, p, cache, total):
        """The backend's own context-parallel route (TE) on this rank's local shard, or None."""
        group = p.cp_group
        ulysses_group, ring_group = cache["hybrid"]
        u = 1 if ulysses_group is None else ulysses_group.size()
        cu = p.cu_seqlens_q
        if isinstance(p, HSPPackedSeqParams) and (
            p.rotary_q_freqs is not None or p.rotary_k_freqs is not None
        ):
            # RoPE is per token and head, so it can run on the local shard before TE's a2a.
            if "positions" not in cache:
                cache["positions"] = positions_in_documents(cu, total)
            if "local_index" not in cache:
                host = np.asarray(cache["cu_host"], dtype=np.int64)
                held = rank_tokens(host, u, ring_group.size(), group.rank())
                cache["local_index"] = torch.from_numpy(held).to(query.device)
            pos = cache["positions"][cache["local_index"]]
            if p.rotary_q_freqs is not None:
                query = apply_rope_packed(
                    query, p.rotary_q_freqs, pos, self.config, p.rotary_mscale
                )
            if p.rotary_k_freqs is not None:
                key = apply_rope_packed(key, p.rotary_k_freqs, pos, self.config, p.rotary_mscale)
        return te_route(
            query,
            key,
            value,
            cu,
            group,
            ulysses_group,
            ring_group,
            softmax_scale=self.softmax_scale,
            cu_seqlens_host=cache.get("cu_host"),
        )


class HSPSelfAttention(SelfAttention):
    """megatron-core ``SelfAttention`` that lets ``HSPCoreAttention`` apply RoPE for THD input.

    For packed (THD) input the rotary table is moved from ``SelfAttention``'s own RoPE step (which
    would use megatron's static-CP THD logic, wrong for HSP's contiguous per-rank slices) into
    ``HSPPackedSeqParams``; everything else is megatron's code path unchanged. BSHD input is
    passed through untouched.
    """

    def forward(
        self,
        hidden_states,
        attention_mask,
        key_value_states=None,
        inference_context=None,
        rotary_pos_emb=None,
        rotary_pos_cos=None,
        rotary_pos_sin=None,
        rotary_pos_cos_sin=None,
        attention_bias=None,
        packed_seq_params=None,
        sequence_len_offset=None,
        *,
        inference_params=None,
    ):
        if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
            if inference_context is not None or inference_params is not None:
                raise NotImplementedError("HSP attention does not support inference contexts")
            no_rope = (
                self.config.no_rope_freq[self.layer_number - 1]
                if self.config.no_rope_freq
                else False
            )
            if rotary_pos_emb is not None and not no_rope:
                q_freqs, k_freqs = (
                    rotary_pos_emb
                    if isinstance(rotary_pos_emb, tuple)
                    else (rotary_pos_emb, rotary_pos_emb)
                )
                packed_seq_params = HSPPackedSeqParams.wrap(
                    packed_seq_params, q_freqs, k_freqs, self._yarn_concentration_factor
                )
            rotary_pos_emb = None
        return super().forward(
            hidden_states,
            attention_mask,
            key_value_states=key_value_states,
            inference_context=inference_context,
            rotary_pos_emb=rotary_pos_emb,
            rotary_pos_cos=rotary_pos_cos,
            rotary_pos_sin=rotary_pos_sin,
            rotary_pos_cos_sin=rotary_pos_cos_sin,
            attention_bias=attention_bias,
            packed_seq_params=packed_seq_params,
            sequence_len_offset=sequence_len_offset,
            inference_params=inference_params,
        )


def _checked_cu_seqlens(
    p: PackedSeqParams, total: int, d: int, cu_host: Sequence[int]
) -> torch.Tensor:
    """The group buffer's segment boundaries; errors name the violated part of the contract.

    Runs once per micro-batch (the first layer); ``cu_host`` are the same boundaries on the host.
    """
    cu = p.cu_seqlens_q
    if cu is None:
        raise ValueError("THD PackedSeqParams needs cu_seqlens_q for HSP attention")
    if (
        p.cu_seqlens_kv is not None
        and p.cu_seqlens_kv is not cu
        and not torch.equal(p.cu_seqlens_kv.cpu(), cu.cpu())
    ):
        raise ValueError("HSP self-attention needs cu_seqlens_kv == cu_seqlens_q")
    for name in ("cu_seqlens_q_padded", "cu_seqlens_kv_padded"):
        padded = getattr(p, name)
        if padded is not None and padded is not cu and not torch.equal(padded.cpu(), cu.cpu()):
            raise ValueError(
                f"HSP attention does not support per-document padding ({name} differs from "
                f"cu_seqlens_q): put the group's padding in one trailing segment instead"
            )
    end = int(cu_host[-1]) if len(cu_host) else 0
    if end != total:
        raise ValueError(
            f"cu_seqlens_q must describe the group's whole packed buffer: it ends at {end} but "
            f"{d} rank(s) x {total // d} local tokens = {total}"
        )
    return cu


__all__ = [
    "AttentionBackend",
    "HSPCoreAttention",
    "HSPPackedSeqParams",
    "HSPSelfAttention",
    "TEAttentionBackend",
    "TorchAttentionBackend",
    "all_to_all_head_to_seq",
    "all_to_all_seq_to_head",
    "apply_rope_packed",
    "check_group_sizes",
    "group_packed_seq_params",
    "heads_per_tp_rank",
    "kv_replication_factor",
    "make_backend",
    "positions_in_documents",
    "usable_group_sizes",
]
