"""Ring merge on CUDA, single process: blockwise partials merged by log-sum-exp vs fp32 reference.

    PYTHONPATH=. python benchmarks/ring_cuda_check.py

CUDA when present (CPU otherwise: numerics only, timings meaningless). Simulates the ring steps
of ``runtime/ring.py`` on one device (the K/V blocks of ``r`` ring
positions visited in ring order, no communication) for a packed buffer of several documents,
forward and backward, in fp32 and bf16, against per-document SDPA in fp32 (an independent
reference); then times the dense per-step math against torch's SDPA per document. Prints JSON.
"""

from __future__ import annotations

import itertools
import json
import time

import torch
import torch.nn.functional as F

from megatron_hsp.runtime.ring import merge_partials, partial_attention


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
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
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
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
