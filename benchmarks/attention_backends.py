"""Compare HSP attention backends on one device: agreement and forward+backward time.

Runs every backend available on the current machine on the same packed long-tail documents:
  sdpa-per-doc   TorchAttentionBackend(force_sdpa=True)   (always; the reference)
  torch-varlen   TorchAttentionBackend() on CUDA fp16/bf16 (flash varlen kernel)
  te             TEAttentionBackend (Transformer Engine, CUDA)
On a CPU-only machine only the first runs; the script says which were skipped and why.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/attention_backends.py [--tokens 8192] \
        [--heads 8 --kv-heads 2 --head-dim 64] [--dtype bf16] [--repeats 5] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch


def long_tail_lengths(total: int, seed: int) -> list[int]:
    """Document lengths with a heavy tail (lognormal), summing exactly to ``total``."""
    rng = np.random.default_rng(seed)
    lengths: list[int] = []
    while sum(lengths) < total:
        lengths.append(max(1, int(rng.lognormal(mean=5.0, sigma=1.2))))
    lengths[-1] -= sum(lengths) - total
    return [n for n in lengths if n > 0]


def run_backend(backend, q, k, v, cu, max_len, dout, repeats: int):
    times = []
    out = grads = None
    for _ in range(repeats + 1):  # first iteration is warm-up
        qq, kk, vv = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
        if q.is_cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = backend(qq, kk, vv, cu, max_len, softmax_scale=q.size(-1) ** -0.5, dropout_p=0.0)
        out.backward(dout)
        if q.is_cuda:
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
        grads = (qq.grad, kk.grad, vv.grad)
    return out.detach(), grads, statistics.median(times[1:])


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default=None)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    from megatron_hsp.runtime.attention import (
        TEAttentionBackend,
        TorchAttentionBackend,
        te_available,
    )

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype_name = args.dtype or ("bf16" if device == "cuda" else "fp32")
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype_name]
    lengths = long_tail_lengths(args.tokens, args.seed)
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32, device=device)
    g = torch.Generator(device="cpu").manual_seed(args.seed)
    shape_q = (args.tokens, args.heads, args.head_dim)
    shape_kv = (args.tokens, args.kv_heads, args.head_dim)
    q, k, v, dout = (
        torch.randn(s, generator=g).to(device=device, dtype=dtype)
        for s in (shape_q, shape_kv, shape_kv, shape_q)
    )

    backends = {"sdpa-per-doc": TorchAttentionBackend(force_sdpa=True)}
    skipped = {}
    if device == "cuda" and dtype != torch.float32:
        backends["torch-varlen"] = TorchAttentionBackend()
    else:
        skipped["torch-varlen"] = "needs CUDA and fp16/bf16"
    if te_available():
        backends["te"] = TEAttentionBackend(config=None, layer_number=1, dropout=0.0)
    else:
        skipped["te"] = "Transformer Engine or CUDA not available"

    results = {}
    ref = None
    for name, backend in backends.items():
        out, grads, ms = run_backend(backend, q, k, v, cu, max(lengths), dout, args.repeats)
        if ref is None:
            ref = (out, grads)
        results[name] = {
            "fwd_bwd_ms": round(ms, 3),
            "rel_out_vs_sdpa": rel(out, ref[0]),
            "rel_grads_vs_sdpa": [rel(a, b) for a, b in zip(grads, ref[1], strict=True)],
        }
    report = {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "dtype": dtype_name,
        "tokens": args.tokens,
        "documents": len(lengths),
        "longest": max(lengths),
        "heads": args.heads,
        "kv_heads": args.kv_heads,
        "head_dim": args.head_dim,
        "torch_threads": torch.get_num_threads(),
        "backends": results,
        "skipped": skipped,
    }
    print(json.dumps(report, indent=2))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(report, fh, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
