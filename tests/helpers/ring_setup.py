"""Set-up shared by the ring exactness tests (``tests/runtime/test_ring_*.py``): the padded
document boundaries dispatch makes, a float64 dense reference written here (explicit
document-causal mask, no ring code), and one route's output and gradients on a rank's rows."""

from __future__ import annotations

import numpy as np
import torch


def padded_cu(docs: list[int], r: int) -> np.ndarray:
    """Document boundaries, padded with a trailing segment to a multiple of ``r`` (dispatch)."""
    pad = -sum(docs) % r
    return np.concatenate([[0], np.cumsum(docs + ([pad] if pad else []))]).astype(np.int64)


def document_of(cu: np.ndarray) -> torch.Tensor:
    """Each buffer token's document (its segment of ``cu``)."""
    total = int(cu[-1])
    return torch.searchsorted(torch.from_numpy(cu), torch.arange(total), right=True)


def dense_reference(q, k, v, doc, scale):
    """float64 causal per-document attention over the whole buffer, KV head j // (h / hk)."""
    rep = q.size(1) // k.size(1)
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    t = torch.arange(q.size(0))
    mask = (doc[:, None] == doc[None, :]) & (t[None, :] <= t[:, None])
    s = torch.einsum("ahd,bhd->hab", q, k) * scale
    return torch.einsum("hab,bhd->ahd", torch.softmax(s.masked_fill(~mask, -torch.inf), -1), v)


def dense_forward_backward(q, k, v, dout, doc, scale) -> dict[str, torch.Tensor]:
    """``dense_reference`` (one KV head per query head) with its backward written out, in
    float64: the probabilities ``p`` [h, T, T] and ``ds`` = p * (dP - rowsum(dO * O)) besides
    out, dq, dk and dv (what ``tolerances.bf16_attention_bounds`` reads)."""
    assert q.size(1) == k.size(1), "one KV head per query head"
    q, k, v, dout = (t.double() for t in (q, k, v, dout))
    t = torch.arange(q.size(0))
    mask = (doc[:, None] == doc[None, :]) & (t[None, :] <= t[:, None])
    s = torch.einsum("ahd,bhd->hab", q, k) * scale
    p = torch.softmax(s.masked_fill(~mask, -torch.inf), -1)
    out = torch.einsum("hab,bhd->ahd", p, v)
    dp = torch.einsum("ahd,bhd->hab", dout, v)
    delta = (dout * out).sum(-1).transpose(0, 1)  # [h, T]
    ds = p * (dp - delta[..., None])
    return {
        "p": p,
        "ds": ds,
        "q": q,
        "k": k,
        "v": v,
        "dout": dout,
        "out": out,
        "dq": torch.einsum("hab,bhd->ahd", ds, k) * scale,
        "dk": torch.einsum("hab,ahd->bhd", ds, q) * scale,
        "dv": torch.einsum("hab,ahd->bhd", p, dout),
    }


def run_route(fn, q, k, v, dout, held, doc, group, scale, dtype=torch.float32):
    """``fn`` on this position's rows, inputs cast to ``dtype``: [out, dq, dk, dv]."""
    local = [t[held].to(dtype).requires_grad_(True) for t in (q, k, v)]
    out = fn(*local, held, doc, group, scale)
    out.backward(dout[held].to(dtype))
    return [out.detach(), *(t.grad for t in local)]
