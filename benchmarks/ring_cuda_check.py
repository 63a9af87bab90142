"""Ring merge on CUDA, single process: blockwise partials merged by log-sum-exp vs fp32 reference.

    PYTHONPATH=. python benchmarks/ring_cuda_check.py [--part all|short-documents]

CUDA when present (CPU otherwise: numerics only, timings meaningless). Simulates the ring steps
of ``runtime/ring.py`` on one device (the K/V blocks of ``r`` ring
positions visited in ring order, no communication) for a packed buffer of several documents,
forward and backward, in fp32 and bf16, against per-document SDPA in fp32 (an independent
reference); then times the dense per-step math against torch's SDPA per document; then
(``block_step``) the fused ring's block kernel against the tiled ring's on one ring position's own
block (zigzag layout of a ring of 4, one document): forward+backward time, peak CUDA memory and
the outputs' agreement, at 8K-32K tokens, 32 heads, head dim 128, bf16 on CUDA (the fused ring's
flash kernel; ../shared/gpu-checklist.md item 5), a small fp32 case on the CPU (the tiled kernel
stands in for flash there: a smoke run, not a measurement); then (``short_documents``) the fused
ring against the tiled one on blocks whose documents are all of length 1 (flash's single-query,
``seqlenq_ngroups_swapped`` path under GQA) or shorter than ``2d`` (the zigzag layout's remainder
runs), GQA 32 query / 8 KV heads, forward and backward. Prints JSON; ``--part short-documents``
runs that last part alone.
"""

from __future__ import annotations

import argparse
import itertools
import json
import time

import torch
import torch.nn.functional as F

from megatron_hsp.runtime.layout import ring_position_tokens
from megatron_hsp.runtime.ring import merge_partials, partial_attention, ring_attention, ring_route


def reference(q, k, v, cu, scale):
    outs = []
    for a, b in itertools.pairwise(cu):
        o = F.scaled_dot_product_attention(
            q[a:b].transpose(0, 1),
            k[a:b].transpose(0, 1),
            v[a:b].transpose(0, 1),
            is_causal=True,
            scale=scale,
        )
        outs.append(o.transpose(0, 1))
    return torch.cat(outs)


def ring_blocks(q, k, v, cu, r, scale):
    total = q.size(0)
    idx = torch.arange(total, device=q.device)
    doc = torch.searchsorted(torch.tensor(cu, device=q.device), idx, right=True)
    span = total // r
    outs = []
    for j in range(r):
        sl = slice(j * span, (j + 1) * span)
        out, lse = None, None
        for s in range(r):  # ring order: own block first, then positions j-1, j-2, ...
            m = (j - s) % r
            kb = slice(m * span, (m + 1) * span)
            o, l_ = partial_attention(
                q[sl], k[kb], v[kb], idx[sl], doc[sl], idx[kb], doc[kb], scale
            )
            out, lse = (o, l_) if out is None else merge_partials(out, lse, o, l_)
        outs.append(out)
    return torch.cat(outs)


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--part", choices=("all", "short-documents"), default="all")
    args = parser.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.part == "short-documents":
        name = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"
        doc = {"device": name, "torch": torch.__version__}
        print(json.dumps({**doc, "short_documents": short_documents(dev)}, indent=1))
        return
    g = torch.Generator(device=dev).manual_seed(0)
    heads, dim, r = 8, 64, 4
    docs = [1500, 37, 900, 2, 611, 1046]  # 4096 tokens
    cu = [0, *itertools.accumulate(docs)]
    total = cu[-1]
    scale = dim**-0.5
    name = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"
    res = {"device": name, "torch": torch.__version__, "ring": r}
    base = [torch.randn(total, heads, dim, device=dev, generator=g) for _ in range(3)]
    dout = torch.randn(total, heads, dim, device=dev, generator=g)
    ref_in = [t.clone().requires_grad_(True) for t in base]
    ref = reference(*ref_in, cu, scale)
    ref.backward(dout)
    for dtype in (torch.float32, torch.bfloat16):
        x = [t.to(dtype).clone().requires_grad_(True) for t in base]
        out = ring_blocks(*x, cu, r, scale)
        out.backward(dout.to(dtype))
        res[str(dtype)] = {
            "out_rel": rel(out, ref),
            **{
                f"d{n}_rel": rel(t.grad, rt.grad) for n, t, rt in zip("qkv", x, ref_in, strict=True)
            },
        }
    for name, fn in (
        ("ring_dense", lambda *a: ring_blocks(*a, cu, r, scale)),
        ("sdpa_per_doc", lambda *a: reference(*a, cu, scale)),
    ):
        x = [t.to(torch.bfloat16).clone().requires_grad_(True) for t in base]
        for _ in range(2):
            fn(*x).backward(dout.to(torch.bfloat16))
        sync(dev)
        t0 = time.perf_counter()
        for _ in range(5):
            fn(*x).backward(dout.to(torch.bfloat16))
        sync(dev)
        res[f"{name}_fwd_bwd_ms"] = (time.perf_counter() - t0) / 5 * 1e3
    res["block_step"] = block_step(dev)
    res["short_documents"] = short_documents(dev)
    print(json.dumps(res, indent=1))


# Documents per case: all of length 1 (each ring step's kernel calls see one query and one key
# per run), and mixed lengths below 2d = 8 (a ring of 4) around one long one, whose remainder
# tokens the zigzag layout deals out one by one.
SHORT_CASES = {
    "all-length-1": [1] * 96,
    "shorter-than-2d": [1, 7, 2, 5, 1, 3, 6, 1, 4, 2, 7, 1, 1, 300, 5, 1, 2, 6, 3],
}


def short_documents(dev: torch.device, ring: int = 4) -> list[dict]:
    """Fused vs tiled ring, forward and backward, on ring position 0's block of a ring of
    ``ring`` (its own block: group None) for ``SHORT_CASES``, GQA 32 / 8 heads, head dim 128,
    bf16 on CUDA (fp32 on the CPU, where the tiled kernel stands in for flash)"""
    cuda = dev.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    heads, kv_heads, dim = 32, 8, 128
    rows = []
    for case, lengths in SHORT_CASES.items():
        pad = -sum(lengths) % ring  # the trailing padding segment dispatch adds
        cu = [0, *itertools.accumulate(lengths + [pad] * bool(pad))]
        held = torch.from_numpy(ring_position_tokens(cu, 1, ring, 0)).to(dev)
        doc = torch.searchsorted(torch.tensor(cu, device=dev), held, right=True)
        g = torch.Generator(device=dev).manual_seed(2)
        n = held.numel()
        base = [
            torch.randn(n, h, dim, device=dev, generator=g) for h in (heads, kv_heads, kv_heads)
        ]
        dout = torch.randn(n, heads, dim, device=dev, generator=g)
        row = {"case": case, "documents": len(lengths), "local": n, "heads": [heads, kv_heads]}
        row["route"] = ring_route(dev.type, dtype, dim)
        outs = {}
        for name in ("fused", "tiled"):
            x = [t.to(dtype).clone().requires_grad_(True) for t in base]
            out = ring_attention(*x, held, doc, None, dim**-0.5, route=f"ring-{name}")
            out.backward(dout.to(dtype))
            sync(dev)
            outs[name] = [out, *(t.grad for t in x)]
        row.update(
            {
                ("out_rel" if n == "o" else f"d{n}_rel"): rel(a, b)
                for n, a, b in zip("o" + "qkv", outs["fused"], outs["tiled"], strict=True)
            }
        )
        row["finite"] = all(bool(torch.isfinite(t).all()) for t in outs["fused"])
        # Against an exact fp64 reference: on length-1 documents dq and dk are zero in exact
        # arithmetic (softmax over one key has no gradient), so fused-vs-tiled ratios of two
        # rounding noises mean nothing; each kernel's error is scaled by the reference's norm,
        # or by dout's where the reference is (near) zero.
        ref = _dense_reference(base, dout, held, doc, dim**-0.5)
        for name in ("fused", "tiled"):
            for n, a, b in zip("o" + "qkv", outs[name], ref, strict=True):
                key = "out" if n == "o" else f"d{n}"
                scale = b.norm()
                if scale <= 1e-6 * dout.double().norm():
                    scale = dout.double().norm()
                row[f"{key}_err64_{name}"] = float((a.detach().double() - b).norm() / scale)
        rows.append(row)
    return rows


def _dense_reference(base, dout, held, doc, scale):
    """Exact (fp64) causal per-document attention over the held tokens, GQA, and its gradients:
    written apart from the ring code it checks (a dense mask, no tiling, no merges)."""
    q, k, v = (t.detach().double().clone().requires_grad_(True) for t in base)
    rep = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    s = torch.einsum("qhd,khd->hqk", q, kk) * scale
    allowed = (doc[:, None] == doc[None, :]) & (held[None, :] <= held[:, None])
    s = s.masked_fill(~allowed, float("-inf"))
    out = torch.einsum("hqk,khd->qhd", torch.softmax(s, dim=-1), vv)
    out.backward(dout.double())
    return [out.detach(), q.grad, k.grad, v.grad]


def block_step(dev: torch.device) -> list[dict]:
    """Fused vs tiled ring on one position's own block (group None: the ring's first step)."""
    cuda = dev.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    heads, dim = (32, 128) if cuda else (4, 64)
    rows = []
    for tokens in (8192, 16384, 32768) if cuda else (2048,):
        held = torch.from_numpy(ring_position_tokens([0, tokens], 1, 4, 0)).to(dev)
        doc = torch.ones_like(held)
        g = torch.Generator(device=dev).manual_seed(1)
        base = [torch.randn(held.numel(), heads, dim, device=dev, generator=g) for _ in range(4)]
        row = {"tokens": tokens, "local": held.numel(), "heads": heads, "dim": dim}
        row["route"] = ring_route(dev.type, dtype, dim)
        outs = {}
        for name in ("fused", "tiled"):
            route = f"ring-{name}"
            x = [t.to(dtype).clone().requires_grad_(True) for t in base[:3]]
            meta = (held, doc, None, dim**-0.5)

            def fn(*a, route=route):
                return ring_attention(*a, route=route)

            out = fn(*x, *meta)
            out.backward(base[3].to(dtype))
            outs[name] = [out, *(t.grad for t in x)]
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            sync(dev)
            t0 = time.perf_counter()
            for _ in range(3):
                fn(*x, *meta).backward(base[3].to(dtype))
            sync(dev)
            row[f"{name}_fwd_bwd_ms"] = (time.perf_counter() - t0) / 3 * 1e3
            if cuda:
                row[f"{name}_peak_mib"] = torch.cuda.max_memory_allocated() / 2**20
        row.update(
            {
                ("out_rel" if n == "o" else f"d{n}_rel"): rel(a, b)
                for n, a, b in zip("o" + "qkv", outs["fused"], outs["tiled"], strict=True)
            }
        )
        rows.append(row)
    return rows


if __name__ == "__main__":
    main()
