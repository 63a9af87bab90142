"""Ring attention over the ring degree ``r`` of a hybrid (Ulysses x ring) group.

After the Ulysses all-to-all over ``u`` ranks, ring position ``j`` of a group holds its share of
the group's packed buffer (``layout.ring_position_tokens``: the load-balanced ``2r``-chunk
layout, so every position does near-equal causal work) for its ``h/u`` heads. Ring attention
keeps the queries in place and passes the K/V blocks around the ring (``r - 1`` point-to-point
shifts); each step computes the partial attention of the local queries against the visiting
block, as an output plus its log-sum-exp, and the partials are merged exactly by log-sum-exp
(``merge_partials``).

The mask is computed from each token's index in the group's buffer and its document, so it holds
for any assignment of tokens to ring positions: a token attends to keys of its own document at
an earlier or equal buffer index.

Memory: the whole ring is ONE autograd function (``_RingAttention``), the way
ring-flash-attention does it. Forward keeps only the running fp32 output and log-sum-exp; each
block's scores live only inside a query tile (``_block_forward``) and are dropped. Saved for
backward: q, k, v, the output and the log-sum-exp (plus the token index/document vectors), i.e.
activation memory linear in tokens (``tests/runtime/test_ring_memory.py``,
``benchmarks/ring_memory.py``).
Backward passes the K/V blocks around the ring again, recomputes each block's probabilities
from q, k and the saved log-sum-exp, and carries each block's dK/dV accumulator along with it; one
last shift returns every accumulator to its owner. The previous version let autograd keep every
step's ``[h, T/r, T/r]`` fp32 scores and mask (about 9-10 bytes per query-key pair per head).

Two rings share this structure:

- the tiled ring (``_RingAttention``): every step computes the whole visiting block in tiled fp32
  torch math under the index/document mask. Exact for any token assignment, memory-bounded, and
  the CPU reference; on a GPU it is far slower than a fused kernel (docs/runtime.md).
- the fused ring (``_FusedRingAttention``; ``ring_attention(..., route="ring-fused")``): every
  step hands a block kernel varlen batches of contiguous runs (a zigzag half-block: one chunk of
  one document) and gets back (out, lse); the partials merge in fp32; fully masked pairs (another
  document, or keys after the queries) are never computed, and a step with nothing visible calls
  no kernel. Backward recomputes each block from q, k, v, the ring's final out and lse. The next
  block's shift runs while the current block computes (on CUDA from a side stream). The block
  kernel is torch's flash kernel on CUDA (``FLASH_KERNEL``: ``aten._flash_attention_forward`` /
  ``_backward``), and the tiled kernel on the CPU (``TILED_KERNEL``, the same autograd function,
  so the CPU tests run the fused ring's planning, merging, skipping and shifting exactly as a
  GPU would).

Which ring runs is decided once (``ring_route``): the fused ring where the flash operator exists,
the tensors are on CUDA and in fp16/bf16; the tiled ring otherwise. The planner prices the same
routes (``planner/routes.py``: "ring-fused", "ring-tiled"). The flash path has not run on a GPU
here: its calls are checked against torch's operator schema at both ends of the supported torch
range (``tests/runtime/test_flash_block_schema.py``), not measured (docs/gpu-validation.md).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from megatron_hsp.planner.routes import RING_FUSED, RING_TILED
from megatron_hsp.runtime.comm import comm
from megatron_hsp.runtime.layout import _ranges, ring_position_tokens


def _shift(x: torch.Tensor, group: dist.ProcessGroup, step: int) -> torch.Tensor:
    """Send ``x`` to ring position ``i + step`` and receive from ``i - step`` (mod r)."""
    r = group.size()
    me = dist.get_rank(group)
    dst = dist.get_global_rank(group, (me + step) % r)
    src = dist.get_global_rank(group, (me - step) % r)
    out = torch.empty_like(x)
    # On the ring's own group, so its communicator carries the ring's traffic (the world's
    # would otherwise connect every ring pair on the world communicator as well).
    ops = [
        dist.P2POp(dist.isend, x.contiguous(), dst, group=group),
        dist.P2POp(dist.irecv, out, src, group=group),
    ]
    for req in comm().batch_isend_irecv(ops):
        req.wait()
    return out


class _RingShift(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _shift(x, group, 1)

    @staticmethod
    def backward(ctx, grad):
        return _shift(grad.contiguous(), ctx.group, -1), None


def ring_shift(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Differentiable one-step ring shift (backward sends the gradient the other way)."""
    return _RingShift.apply(x, group)


def partial_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_index: torch.Tensor,
    q_doc: torch.Tensor,
    k_index: torch.Tensor,
    k_doc: torch.Tensor,
    scale: float,
    keep_fp32: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``q`` [Tq, h, D] on one K/V block [Tk, hk, D]: (out [Tq, h, D], lse [h, Tq]).

    Key ``b`` is visible to query ``a`` when both lie in one document and ``k_index[b] <=
    q_index[a]``. Rows that see no key get lse = -inf and out = 0, which ``merge_partials`` treats
    as an empty partial.
    """
    rep = q.size(1) // k.size(1)
    if rep > 1:  # GQA: query head j uses KV head j // rep
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
    dtype = q.dtype
    qf, kf, vf = q.float(), k.float(), v.float()
    scores = torch.einsum("ahd,bhd->hab", qf, kf) * scale
    visible = _visible(q_index, q_doc, k_index, k_doc)
    scores = scores.masked_fill(~visible[None], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [h, Tq]
    safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    probs = torch.exp(scores - safe[..., None])  # exp(-inf) = 0 on masked entries
    out = torch.einsum("hab,bhd->ahd", probs, vf)
    return (out if keep_fp32 else out.to(dtype)), lse


def merge_partials(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact merge of two softmax partials over disjoint key sets by their log-sum-exps.

    ``out = out_a * e^(lse_a - lse) + out_b * e^(lse_b - lse)`` with ``lse = logaddexp``; a
    partial with lse = -inf (no visible key) contributes nothing.
    """
    lse = torch.logaddexp(lse_a, lse_b)
    safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    wa = torch.exp(lse_a - safe).transpose(0, 1)[..., None]  # [Tq, h, 1]
    wb = torch.exp(lse_b - safe).transpose(0, 1)[..., None]
    out = out_a.float() * wa + out_b.float() * wb
    return out.to(out_a.dtype), lse


# Elements of one query tile's score block ([h, tile, Tk] fp32): bounds the transient memory of a
# block step whatever the buffer length (64 MiB at 2**24).
TILE_ELEMENTS = 1 << 24


def _visible(q_index, q_doc, k_index, k_doc) -> torch.Tensor:
    """[Tq, Tk] True where key b is visible to query a: same document, not later in the buffer."""
    return (q_doc[:, None] == k_doc[None, :]) & (k_index[None, :] <= q_index[:, None])


def _tiles(tq: int, h: int, tk: int) -> range:
    step = max(1, TILE_ELEMENTS // max(1, h * tk))
    return range(0, tq, step)


def _expand_kv(x: torch.Tensor, h: int) -> torch.Tensor:
    rep = h // x.size(1)
    return x.repeat_interleave(rep, dim=1) if rep > 1 else x


def _block_forward(q, k, v, q_index, q_doc, k_index, k_doc, scale):
    """(out [Tq, h, D] fp32, lse [h, Tq] fp32) of ``q`` against one K/V block, query tile by
    query tile (rows that see no key: lse -inf, out 0)."""
    tq, h, _ = q.shape
    kf, vf = _expand_kv(k, h).float(), _expand_kv(v, h).float()
    out = q.new_zeros(q.shape, dtype=torch.float32)
    lse = q.new_full((h, tq), float("-inf"), dtype=torch.float32)
    step = _tiles(tq, h, k.size(0)).step
    for a in range(0, tq, step):
        b = min(a + step, tq)
        o, s = partial_attention(
            q[a:b], kf, vf, q_index[a:b], q_doc[a:b], k_index, k_doc, scale, keep_fp32=True
        )
        out[a:b], lse[:, a:b] = o, s
    return out, lse


def _block_backward(dout, q, k, v, lse, delta, q_index, q_doc, k_index, k_doc, scale):
    """(dq [Tq, h, D], dk [Tk, hk, D], dv [Tk, hk, D]) in fp32 of one block, recomputed from q,
    k, v and the ring's final log-sum-exp (``delta`` = rowsum(dout * out), [h, Tq])."""
    tq, h, dim = q.shape
    hk = k.size(1)
    kf, vf = _expand_kv(k, h).float(), _expand_kv(v, h).float()
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dk = torch.zeros(kf.shape, dtype=torch.float32, device=q.device)
    dv = torch.zeros(vf.shape, dtype=torch.float32, device=q.device)
    safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    step = _tiles(tq, h, k.size(0)).step
    for a in range(0, tq, step):
        b = min(a + step, tq)
        qt, dot = q[a:b].float(), dout[a:b].float()
        scores = torch.einsum("ahd,bhd->hab", qt, kf) * scale
        vis = _visible(q_index[a:b], q_doc[a:b], k_index, k_doc)
        p = torch.exp(scores.masked_fill(~vis[None], float("-inf")) - safe[:, a:b, None])
        dv += torch.einsum("hab,ahd->bhd", p, dot)
        dp = torch.einsum("ahd,bhd->hab", dot, vf)
        ds = p * (dp - delta[:, a:b, None])
        dq[a:b] = torch.einsum("hab,bhd->ahd", ds, kf) * scale
        dk += torch.einsum("hab,ahd->bhd", ds, qt) * scale
    if h != hk:  # GQA: sum the query heads that share a KV head
        rep = h // hk
        dk = dk.view(-1, hk, rep, dim).sum(2)
        dv = dv.view(-1, hk, rep, dim).sum(2)
    return dq, dk, dv


class _RingAttention(torch.autograd.Function):
    """The whole ring, forward and backward (module docstring, "Memory")."""

    @staticmethod
    def forward(ctx, q, k, v, index, doc, group, scale):
        r = 1 if group is None else group.size()
        meta = torch.stack([index, doc]).to(torch.int64)
        kb, vb, mb = k, v, meta
        out = lse = None
        for step in range(r):
            if step:
                kb, vb, mb = (_shift(t, group, 1) for t in (kb, vb, mb))
            o, s = _block_forward(q, kb, vb, index, doc, mb[0], mb[1], scale)
            out, lse = (o, s) if out is None else merge_partials(out, lse, o, s)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, meta)
        ctx.group, ctx.scale = group, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, meta = ctx.saved_tensors
        group, scale = ctx.group, ctx.scale
        r = 1 if group is None else group.size()
        index, doc = meta[0], meta[1]
        delta = (dout.float() * out.float()).sum(-1).transpose(0, 1)  # [h, Tq]
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        kb, vb, mb = k, v, meta
        dkb = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
        dvb = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
        for step in range(r):
            if step:  # the block moves on with the gradient it has collected so far
                kb, vb, mb, dkb, dvb = (_shift(t, group, 1) for t in (kb, vb, mb, dkb, dvb))
            g_q, g_k, g_v = _block_backward(
                dout, q, kb, vb, lse, delta, index, doc, mb[0], mb[1], scale
            )
            dq += g_q
            dkb += g_k
            dvb += g_v
        if r > 1:  # one more step brings every block's accumulator home
            dkb, dvb = _shift(dkb, group, 1), _shift(dvb, group, 1)
        return dq.to(q.dtype), dkb.to(k.dtype), dvb.to(v.dtype), None, None, None, None


# ------------------------------------------------------------------ the fused ring
# Dtypes torch's flash kernel takes; head dims it takes (a multiple of 8, at most 256).
FLASH_DTYPES = (torch.float16, torch.bfloat16)
FLASH_MAX_HEAD_DIM = 256


def flash_block_available() -> bool:
    """Whether the installed torch has the flash operators the fused ring calls."""
    aten = torch.ops.aten
    return hasattr(aten, "_flash_attention_forward") and hasattr(aten, "_flash_attention_backward")


def ring_route(device_type: str, dtype: torch.dtype, head_dim: int) -> str:
    """The route HSP's own ring takes (``planner/routes.py`` names): "ring-fused" on CUDA in
    fp16/bf16 with a head dim flash takes, where the installed torch has the flash operators;
    "ring-tiled" otherwise. The one rule: ``ring_attention`` runs it and
    ``backends.attention_routes_for_run`` declares it to the planner."""
    if (
        device_type == "cuda"
        and dtype in FLASH_DTYPES
        and head_dim % 8 == 0
        and head_dim <= FLASH_MAX_HEAD_DIM
        and flash_block_available()
    ):
        return RING_FUSED
    return RING_TILED


@dataclass(frozen=True)
class BlockKernel:
    """A block kernel of the fused ring, on a varlen batch of (query run, key runs) sequences.

    ``forward(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale) -> (out, lse, aux)``: out
    [Tq, h, D] in q's dtype, lse [h, Tq] fp32, ``aux`` whatever its backward needs besides;
    ``backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale, aux) -> (dq,
    dk, dv)``, recomputed from q, k, v, out and lse (the ring's final ones: that makes each
    block's gradient exact). ``causal``: key j of a sequence is visible to its query i when
    ``j <= i + len_k - len_q`` (flash's bottom-right rule; the ring asks for it only with
    ``len_q == len_k``, where every alignment agrees); otherwise every key is visible.
    """

    name: str
    forward: Callable[..., tuple[torch.Tensor, torch.Tensor, object]]
    backward: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def flash_forward_call(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    max_q: int,
    max_k: int,
    causal: bool,
    scale: float,
) -> tuple[dict[str, object], dict[str, object]]:
    """``aten._flash_attention_forward``'s arguments, by the operator schema's names: the
    positional ones in schema order, then the keyword-only ones
    (``tests/runtime/test_flash_block_schema.py`` reads them against the installed torch's
    schema). Dropout 0, no debug mask, the varlen form (``cum_seq_q/k``, ``max_q/k``)."""
    positional = {
        "query": q,
        "key": k,
        "value": v,
        "cum_seq_q": cu_q,
        "cum_seq_k": cu_k,
        "max_q": int(max_q),
        "max_k": int(max_k),
        "dropout_p": 0.0,
        "is_causal": bool(causal),
        "return_debug_mask": False,
    }
    return positional, {"scale": float(scale)}


def flash_backward_call(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    max_q: int,
    max_k: int,
    causal: bool,
    scale: float,
    aux: tuple[torch.Tensor, torch.Tensor],
) -> tuple[dict[str, object], dict[str, object]]:
    """``aten._flash_attention_backward``'s arguments (as ``flash_forward_call``); ``aux`` is
    the forward's (rng_state, unused), which the kernel reads only under dropout."""
    rng_state, unused = aux
    positional = {
        "grad_out": dout,
        "query": q,
        "key": k,
        "value": v,
        "out": out,
        "logsumexp": lse,
        "cum_seq_q": cu_q,
        "cum_seq_k": cu_k,
        "max_q": int(max_q),
        "max_k": int(max_k),
        "dropout_p": 0.0,
        "is_causal": bool(causal),
        "rng_state": rng_state,
        "unused": unused,
    }
    return positional, {"scale": float(scale)}


def _flash_forward(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale):
    args, kwargs = flash_forward_call(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale)
    out, lse, rng_state, unused, _ = torch.ops.aten._flash_attention_forward(
        *args.values(), **kwargs
    )
    return out, lse, (rng_state, unused)


def _flash_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale, aux):
    args, kwargs = flash_backward_call(
        dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale, aux
    )
    dq, dk, dv = torch.ops.aten._flash_attention_backward(*args.values(), **kwargs)
    return dq, dk, dv


def _varlen_masks(cu_q, cu_k, tq, tk, causal):
    """The tiled kernel's (q_index, q_doc, k_index, k_doc) for a varlen batch: the sequence is
    the document; causal: bottom-right aligned positions, else every key at index 0."""
    lq, lk = (cu_q[1:] - cu_q[:-1]).long(), (cu_k[1:] - cu_k[:-1]).long()
    seq_q = torch.repeat_interleave(torch.arange(lq.numel(), device=cu_q.device), lq)
    seq_k = torch.repeat_interleave(torch.arange(lk.numel(), device=cu_k.device), lk)
    if not causal:
        return torch.zeros_like(seq_q), seq_q, torch.zeros_like(seq_k), seq_k
    pos_q = torch.arange(tq, device=cu_q.device) - cu_q[:-1].long()[seq_q]
    pos_k = torch.arange(tk, device=cu_k.device) - cu_k[:-1].long()[seq_k]
    return pos_q + (lk - lq)[seq_q], seq_q, pos_k, seq_k


def _tiled_forward(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale):
    masks = _varlen_masks(cu_q, cu_k, q.size(0), k.size(0), causal)
    out, lse = _block_forward(q, k, v, *masks, scale)
    return out.to(q.dtype), lse, None


def _tiled_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale, aux):
    masks = _varlen_masks(cu_q, cu_k, q.size(0), k.size(0), causal)
    delta = (dout.float() * out.float()).sum(-1).transpose(0, 1)
    dq, dk, dv = _block_backward(dout, q, k, v, lse, delta, *masks, scale)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


# torch's flash kernel (CUDA, fp16/bf16), and the tiled kernel standing in for it on the CPU.
FLASH_KERNEL = BlockKernel("flash", _flash_forward, _flash_backward)
TILED_KERNEL = BlockKernel("tiled", _tiled_forward, _tiled_backward)


@dataclass(frozen=True)
class BlockCall:
    """One block-kernel call of a ring step: a varlen batch, one sequence per query run.

    ``rows_q``/``rows_k``: local query rows and visiting-block rows, packed in sequence order;
    ``keep`` False: a fully masked pair computed only with skipping off, its result dropped."""

    rows_q: torch.Tensor
    rows_k: torch.Tensor
    cu_q: torch.Tensor
    cu_k: torch.Tensor
    max_q: int
    max_k: int
    causal: bool
    keep: bool = True


def _runs(index: np.ndarray, doc: np.ndarray) -> np.ndarray:
    """Boundaries (starts, then the end) of the maximal runs of consecutive rows holding
    consecutive buffer indices of one document: the layout's chunks (a zigzag half-block of a
    document on a rank), or single remainder tokens."""
    if index.size == 0:
        return np.zeros(1, dtype=np.int64)
    cut = (np.diff(index) != 1) | (np.diff(doc) != 0)
    return np.concatenate([[0], np.flatnonzero(cut) + 1, [index.size]]).astype(np.int64)


def plan_ring_step(
    q_meta: np.ndarray,
    k_meta: np.ndarray,
    own: bool,
    device: torch.device,
    skip_masked: bool = True,
) -> list[BlockCall]:
    """The block-kernel calls of one ring step: local queries (``q_meta`` = [index, doc] rows)
    against the visiting block (``k_meta``); ``own``: the block is the queries' own (step 0).

    Every query run sees, of its document, all keys before it (one non-causal sequence: those
    key runs gathered in buffer order) and, on its own block, itself (causal, equal lengths).
    Keys of another document or after the run are never visible and never computed; a run
    seeing nothing is left out, and a call with no sequence is not made. With ``skip_masked``
    False the masked pairs are computed too, in a call whose result is dropped (what a kernel
    without skipping spends; tests count it). A key run overlapping a query run without being
    it cannot come from the layout (runtime/layout.py) and raises.
    """
    q_index, q_doc = (np.asarray(x, dtype=np.int64) for x in q_meta)
    k_index, k_doc = (np.asarray(x, dtype=np.int64) for x in k_meta)
    bounds = _runs(q_index, q_doc)
    starts, lengths = bounds[:-1], np.diff(bounds)
    if starts.size == 0:
        return []
    span = int(max(q_index.max(initial=0), k_index.max(initial=0))) + 1
    order = np.lexsort((k_index, k_doc))
    key = k_doc[order] * span + k_index[order]
    lo = q_doc[starts] * span + q_index[starts]
    first = np.searchsorted(key, q_doc[starts] * span, side="left")
    before = np.searchsorted(key, lo, side="left")
    after = np.searchsorted(key, lo + lengths - 1, side="right")
    inside = after - before
    if np.any(inside != (lengths if own else 0)):
        raise ValueError(
            "ring attention: a key block overlaps a query run without being it; the token "
            "layout must deal whole runs to ring positions (runtime/layout.py)"
        )

    def call(sel: np.ndarray, k_starts: np.ndarray, k_counts: np.ndarray, causal: bool,
             keep: bool = True) -> BlockCall:  # fmt: skip
        """Sequence i: query run ``sel[i]`` against the key ranges ``k_starts[:, i]`` (sorted
        order, ``k_counts[:, i]`` long), concatenated."""
        rows_k = order[_ranges(k_starts.T.reshape(-1), k_counts.T.reshape(-1))]
        rows_q = _ranges(starts[sel], lengths[sel])
        cu_q = np.concatenate([[0], np.cumsum(lengths[sel])])
        cu_k = np.concatenate([[0], np.cumsum(k_counts.sum(axis=0))])

        def dev(x: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(x)).to(device=device, dtype=dtype)

        return BlockCall(
            dev(rows_q, torch.int64),
            dev(rows_k, torch.int64),
            dev(cu_q, torch.int32),
            dev(cu_k, torch.int32),
            int(lengths[sel].max()),
            int(k_counts.sum(axis=0).max()),
            causal,
            keep,
        )

    calls = []
    seen = before - first
    full = np.flatnonzero(seen > 0)
    if full.size:
        calls.append(call(full, first[None, full], seen[None, full], causal=False))
    if own:
        every = np.arange(starts.size)
        calls.append(call(every, before[None], inside[None], causal=True))
    if not skip_masked:
        # Every key the run does not see: the documents before its own, then its own
        # document's keys after it and the documents after.
        counts = np.stack([first, key.size - after])
        some = np.flatnonzero(counts.sum(axis=0) > 0)
        if some.size:
            ks = np.stack([np.zeros(some.size, dtype=np.int64), after[some]])
            calls.append(call(some, ks, counts[:, some], causal=False, keep=False))
    return calls


def plan_ring(
    metas: list[np.ndarray], position: int, device: torch.device, skip_masked: bool = True
) -> list[list[BlockCall]]:
    """Every step's block calls for ring-group rank ``position``, from every ring-group rank's
    [index, doc] rows (``metas``, by ring-group rank): step ``s`` sees rank ``position - s``'s
    block."""
    r = len(metas)
    return [
        plan_ring_step(metas[position], metas[(position - s) % r], s == 0, device, skip_masked)
        for s in range(r)
    ]


def host_ring_plans(
    cu_seqlens: list[int] | np.ndarray,
    ulysses: int,
    group: dist.ProcessGroup,
    ring_group: dist.ProcessGroup,
    device: torch.device,
    skip_masked: bool = True,
) -> list[list[BlockCall]]:
    """The fused ring's plans for this rank, from the micro-batch's segment bounds on the host
    (no device read, no collective): ring-group rank ``g`` is group rank
    ``get_group_rank(group, get_global_rank(ring_group, g))``, i.e. ring position that // u,
    which holds ``layout.ring_position_tokens``. Built once per micro-batch (the attention keeps
    them in the micro-batch cache) and used by every layer."""
    cu = np.asarray(cu_seqlens, dtype=np.int64)
    r = ring_group.size()

    def meta(g: int) -> np.ndarray:
        pos = dist.get_group_rank(group, dist.get_global_rank(ring_group, g)) // ulysses
        index = ring_position_tokens(cu, ulysses, r, pos)
        return np.stack([index, np.searchsorted(cu, index, side="right")])

    return plan_ring([meta(g) for g in range(r)], dist.get_rank(ring_group), device, skip_masked)


_SIDE_STREAMS: dict[int, torch.cuda.Stream] = {}


def _start_shift(x: torch.Tensor, group: dist.ProcessGroup) -> Callable[[], torch.Tensor]:
    """Start sending ``x`` one ring position on (receiving from the one before); returns the
    wait that hands back the received tensor. On CUDA the p2p is issued from a side stream
    (after the current stream's work on ``x``), so the block computed meanwhile overlaps it;
    gloo's p2p runs on its own threads."""
    r = group.size()
    me = dist.get_rank(group)
    dst = dist.get_global_rank(group, (me + 1) % r)
    src = dist.get_global_rank(group, (me - 1) % r)
    send = x.contiguous()
    recv = torch.empty_like(send)
    stream = None
    if send.is_cuda:
        stream = _SIDE_STREAMS.setdefault(
            send.device.index or 0, torch.cuda.Stream(device=send.device)
        )
        stream.wait_stream(torch.cuda.current_stream(send.device))
        send.record_stream(stream)
        recv.record_stream(stream)
    with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
        ops = [
            dist.P2POp(dist.isend, send, dst, group=group),
            dist.P2POp(dist.irecv, recv, src, group=group),
        ]
        reqs = comm().batch_isend_irecv(ops)

    def wait() -> torch.Tensor:
        for req in reqs:
            req.wait()
        if stream is not None:
            torch.cuda.current_stream(recv.device).wait_stream(stream)
        return recv

    return wait


def _gather_meta(meta: torch.Tensor, group: dist.ProcessGroup | None) -> list[np.ndarray]:
    """Every ring position's [index, doc] rows on the host, by group rank: one all-gather and
    one device-to-host copy per call, so every step's calls are planned before the ring turns
    (and reused by backward)."""
    if group is None or group.size() == 1:
        return [meta.cpu().numpy()]
    metas = [torch.empty_like(meta) for _ in range(group.size())]
    comm().all_gather(metas, meta.contiguous(), group)
    return [m.cpu().numpy() for m in metas]


class _FusedRingAttention(torch.autograd.Function):
    """The fused ring (module docstring): block kernel per step, fp32 merge, masked pairs
    skipped, shifts overlapped; backward recomputes every block from q, k, v, out and lse."""

    @staticmethod
    def forward(ctx, q, k, v, index, doc, group, scale, kernel, skip_masked, plans):
        r = 1 if group is None else group.size()
        me = 0 if r == 1 else dist.get_rank(group)
        if plans is None:
            metas = _gather_meta(torch.stack([index, doc]).to(torch.int64), group)
            plans = plan_ring(metas, me, q.device, skip_masked)
        elif len(plans) != r:
            raise ValueError(f"fused ring: {len(plans)} step plans for a ring of {r}")
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.full(
            (q.size(1), q.size(0)), float("-inf"), dtype=torch.float32, device=q.device
        )
        auxes: list[list[object]] = []
        kv = torch.stack([k, v])
        pending = _start_shift(kv, group) if r > 1 else None
        for s in range(r):
            step_aux = []
            for c in plans[s]:
                o, part_lse, aux = kernel.forward(
                    q.index_select(0, c.rows_q),
                    kv[0].index_select(0, c.rows_k),
                    kv[1].index_select(0, c.rows_k),
                    c.cu_q,
                    c.cu_k,
                    c.max_q,
                    c.max_k,
                    c.causal,
                    scale,
                )
                step_aux.append(aux)
                if c.keep:
                    mo, ml = merge_partials(
                        out.index_select(0, c.rows_q), lse.index_select(1, c.rows_q), o, part_lse
                    )
                    out.index_copy_(0, c.rows_q, mo)
                    lse.index_copy_(1, c.rows_q, ml)
            auxes.append(step_aux)
            if pending is not None:
                kv = pending()
                pending = _start_shift(kv, group) if s + 2 < r else None
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.scale, ctx.kernel, ctx.plans, ctx.auxes = group, scale, kernel, plans, auxes
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        group, kernel = ctx.group, ctx.kernel
        r = 1 if group is None else group.size()
        dout = dout.contiguous()
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        dkv = torch.zeros((2, *k.shape), dtype=torch.float32, device=k.device)
        kv = torch.stack([k, v])
        pending_kv = _start_shift(kv, group) if r > 1 else None
        pending_acc = None
        for s in range(r):
            grads = []
            for c, aux in zip(ctx.plans[s], ctx.auxes[s], strict=True):
                g = kernel.backward(
                    dout.index_select(0, c.rows_q),
                    q.index_select(0, c.rows_q),
                    kv[0].index_select(0, c.rows_k),
                    kv[1].index_select(0, c.rows_k),
                    out.index_select(0, c.rows_q),
                    lse.index_select(1, c.rows_q).contiguous(),
                    c.cu_q,
                    c.cu_k,
                    c.max_q,
                    c.max_k,
                    c.causal,
                    ctx.scale,
                    aux,
                )
                if c.keep:
                    grads.append((c, g))
            if pending_acc is not None:  # this block's accumulator arrives with it
                dkv = pending_acc()
            for c, (g_q, g_k, g_v) in grads:
                dq.index_add_(0, c.rows_q, g_q.float())
                dkv[0].index_add_(0, c.rows_k, g_k.float())
                dkv[1].index_add_(0, c.rows_k, g_v.float())
            if pending_kv is not None:
                kv = pending_kv()
                pending_kv = _start_shift(kv, group) if s + 2 < r else None
            # The accumulator moves on with its block; after the last step, home to its owner.
            pending_acc = _start_shift(dkv, group) if r > 1 else None
        if pending_acc is not None:
            dkv = pending_acc()
        return (
            dq.to(q.dtype),
            dkv[0].to(k.dtype),
            dkv[1].to(v.dtype),
            *([None] * 7),
        )


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    index: torch.Tensor,
    doc: torch.Tensor,
    group: dist.ProcessGroup | None,
    scale: float,
    plans: list[list[BlockCall]] | None = None,
    *,
    route: str | None = None,
    block_kernel: BlockKernel | None = None,
    skip_masked: bool = True,
) -> torch.Tensor:
    """Causal per-document attention of the local tokens against every ring position's tokens.

    ``index``/``doc``: buffer index and document of each local token (same on q and k/v). Step
    ``s`` sees the block of ring position ``i - s``. Memory linear in tokens (module docstring).

    ``route``: "ring-fused" or "ring-tiled" (None: as ``ring_route`` decides for these tensors).
    The fused ring's options: ``plans``, its step calls made once per micro-batch
    (``host_ring_plans``; None: gathered and planned here); ``block_kernel`` (default: flash on
    CUDA, the tiled kernel standing in for it elsewhere); ``skip_masked`` False computes (and
    drops) the masked pairs too, for measuring what skipping saves.
    """
    route = route or ring_route(q.device.type, q.dtype, q.size(-1))
    if route == RING_FUSED:
        kernel = block_kernel or (FLASH_KERNEL if q.is_cuda else TILED_KERNEL)
        return _FusedRingAttention.apply(
            q, k, v, index, doc, group, scale, kernel, skip_masked, plans
        )
    if route != RING_TILED:
        raise ValueError(f"ring attention route {route!r}: use {RING_FUSED!r} or {RING_TILED!r}")
    return _RingAttention.apply(q, k, v, index, doc, group, scale)


__all__ = [
    "FLASH_KERNEL",
    "TILED_KERNEL",
    "BlockCall",
    "BlockKernel",
    "flash_backward_call",
    "flash_block_available",
    "flash_forward_call",
    "host_ring_plans",
    "merge_partials",
    "partial_attention",
    "plan_ring",
    "plan_ring_step",
    "ring_attention",
    "ring_route",
    "ring_shift",
]
