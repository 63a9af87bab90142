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

One concern per module (as yunchang keeps them): ``ulysses`` (the all-to-all), ``ring`` (ring
attention), ``packed`` (the micro-batch's params, positions, RoPE), ``backends`` (torch, TE);
this module is the megatron-core seam (``HSPCoreAttention``, ``HSPSelfAttention``). Which
group sizes a model can run is ``groupspace.HeadSpace``'s rule alone (checked at start-up by
``agreement.head_problems``). Its names re-export the others' for callers.
"""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import tensor_parallel
from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import (
    _yarn_get_concentration_factor_from_config,
)
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_hsp.planner.groupspace import HeadSpace, kv_copies
from megatron_hsp.planner.routes import RING_FUSED
from megatron_hsp.runtime.backends import (
    AttentionBackend,
    TEAttentionBackend,
    TorchAttentionBackend,
    make_backend,
    te_available,
    te_thd_a2a_p2p_supported,
)
from megatron_hsp.runtime.layout import rank_tokens, ring_position_tokens
from megatron_hsp.runtime.packed import (
    HSPPackedSeqParams,
    MicroBatchState,
    _checked_cu_seqlens,
    _micro_batch_cache,
    apply_rope_packed,
    group_packed_seq_params,
    positions_in_documents,
)
from megatron_hsp.runtime.ring import host_ring_plans, ring_attention, ring_route
from megatron_hsp.runtime.ulysses import (
    _qkv_seq_to_head,
    all_to_all_head_to_seq,
    all_to_all_seq_to_head,
)


def heads_per_tp_rank(config: TransformerConfig, tp: int) -> tuple[int, int]:
    """(query heads, KV heads) on one tensor-parallel rank, as megatron's attention splits them
    (KV heads replicated when tp exceeds them): ``groupspace.HeadSpace.from_model``, the one
    rule the planner and the start-up check (``agreement.head_problems``) use too."""
    space = HeadSpace.from_model(config.num_attention_heads, config.num_query_groups, tp)
    return space.q_heads, space.kv_heads


# ---------------------------------------------------------------------------------------------
# Autograd-correct Ulysses all-to-all
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
        # Calls per route taken ("torch-varlen", "torch-sdpa", "te-thd", "ring", "te-cp-p2p",
        # ...): host-side counts, so the acceptance kit reports what each case really ran.
        self.routes: Counter[str] = Counter()

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
        route = getattr(self.backend, "route", None)
        self.routes[route(q) if route is not None else self.backend.name] += 1
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
        if cache.checked is None or cache.checked[0] is not cu or cache.checked[1] != total:
            if cache.cu_host is None:  # plain PackedSeqParams: read the bounds back once
                cache.cu_host = [int(x) for x in cu.tolist()]
            _checked_cu_seqlens(p, total, d, cache.cu_host)
            cache.checked = key_now
            cache.forget_derived()
        cu_host = cache.cu_host

        nq, nkv = query.size(1), key.size(1)
        ulysses_group, ring_group = cache.hybrid or (group, None)
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

        layout_ring = cache.layout_ring
        if layout_ring is not None and layout_ring != r:
            raise ValueError(
                f"the micro-batch was dispatched in the ring-{layout_ring} token layout but its "
                f"group runs ring degree {r}: record the registry's split in the plan "
                "(agreement.resolve_splits) before dispatch"
            )
        te_route = getattr(self.backend, "context_parallel", None) if r > 1 else None
        if te_route is not None:
            out = self._te_context_parallel(te_route, query, key, value, p, cache, total)
            if out is not None:
                self.routes["te-cp-" + ("a2a+p2p" if u > 1 else "p2p")] += 1
                return out.reshape(local, nq * self.head_dim)
        q, k, v = _qkv_seq_to_head(query, key, value, ulysses_group)
        # This rank now holds ring position j's tokens (load-balanced 2d-chunk layout,
        # runtime/layout.py, the function dispatch used), for its h/u heads.
        index = None
        if r > 1:
            if cache.ring_index is None:
                j = dist.get_rank(group) // u
                held = ring_position_tokens(np.asarray(cu_host, dtype=np.int64), u, r, j)
                cache.ring_index = torch.from_numpy(held).to(q.device)
            index = cache.ring_index

        if isinstance(p, HSPPackedSeqParams) and (
            p.rotary_q_freqs is not None or p.rotary_k_freqs is not None
        ):
            first = cache.positions is None  # range-check the table once per micro-batch
            if cache.positions is None:
                cache.positions = positions_in_documents(cu, total)
            pos = cache.positions if index is None else cache.positions[index]
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
            self.routes["ring" if te_route is None else "ring (TE declined)"] += 1
            plans = None
            if ring_route(q.device.type, q.dtype, q.size(-1)) == RING_FUSED:
                # The fused ring's block calls: from the host bounds, once per micro-batch.
                if cache.ring_plans is None:
                    cache.ring_plans = host_ring_plans(cu_host, u, group, ring_group, q.device)
                plans = cache.ring_plans
            out = ring_attention(q, k, v, index, doc, ring_group, self.softmax_scale, plans)
        else:
            max_seqlen = int(p.max_seqlen_q) if p.max_seqlen_q is not None else total
            out = self._attend(q, k, v, cu, max_seqlen, dropout_p, cu_host)
        out = all_to_all_head_to_seq(out, ulysses_group)
        return out.reshape(local, nq * self.head_dim)

    def _te_context_parallel(
        self, te_route, query, key, value, p, cache: MicroBatchState, total: int
    ):
        """The backend's own context-parallel route (TE) on this rank's local shard, or None."""
        group = p.cp_group
        assert cache.hybrid is not None  # the route runs ring degrees > 1 only
        ulysses_group, ring_group = cache.hybrid
        u = 1 if ulysses_group is None else ulysses_group.size()
        cu = p.cu_seqlens_q
        if isinstance(p, HSPPackedSeqParams) and (
            p.rotary_q_freqs is not None or p.rotary_k_freqs is not None
        ):
            # RoPE is per token and head, so it can run on the local shard before TE's a2a.
            # The positions are built, and their range checked, once per micro-batch.
            first = cache.local_positions is None
            if cache.local_positions is None:
                if cache.positions is None:
                    cache.positions = positions_in_documents(cu, total)
                host = np.asarray(cache.cu_host, dtype=np.int64)
                held = rank_tokens(host, u, ring_group.size(), group.rank())
                index = torch.from_numpy(held).to(query.device, non_blocking=True)
                cache.local_positions = cache.positions[index]
            pos = cache.local_positions
            if p.rotary_q_freqs is not None:
                query = apply_rope_packed(
                    query, p.rotary_q_freqs, pos, self.config, p.rotary_mscale, check_range=first
                )
            if p.rotary_k_freqs is not None:
                key = apply_rope_packed(
                    key, p.rotary_k_freqs, pos, self.config, p.rotary_mscale, check_range=first
                )
        return te_route(
            query,
            key,
            value,
            cu,
            group,
            ulysses_group,
            ring_group,
            softmax_scale=self.softmax_scale,
            cu_seqlens_host=cache.cu_host,
            micro_batch=cache,
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
                    packed_seq_params,
                    q_freqs,
                    k_freqs,
                    # megatron-core >= 0.19 caches it as self._yarn_concentration_factor; 0.18
                    # computes it from the config at each call, as here.
                    _yarn_get_concentration_factor_from_config(self.config),
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
    "group_packed_seq_params",
    "heads_per_tp_rank",
    "make_backend",
    "positions_in_documents",
    "te_available",
    "te_thd_a2a_p2p_supported",
]
