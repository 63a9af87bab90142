"""Autograd-saved bytes of one ring attention call per rank.

Used by ``benchmarks/ring_memory.py`` and ``tests/runtime/test_ring_memory.py``: ``ring_attention``
on gloo CPU processes (a pure ring over all of them, the load-balanced layout of
``runtime/layout.py``, one document per buffer); every tensor autograd saves for backward is
counted once per distinct storage (``torch.autograd.graph.saved_tensors_hooks``); the maximum
over ranks is reported.
"""

from __future__ import annotations

TOKENS = (2048, 4096, 8192)
HEADS, KV_HEADS, DIM = 4, 2, 16


def _recorder(seen: dict[int, int]):
    """A pack hook recording each saved tensor's storage size once (keyed by its address)."""

    def pack(t):
        st = t.untyped_storage()
        seen[st.data_ptr()] = max(seen.get(st.data_ptr(), 0), st.nbytes())
        return t

    return pack


def saved_bytes_worker(rank: int, world: int, tokens_per_rank: list[int]) -> dict[str, int]:
    import numpy as np
    import torch
    import torch.distributed as dist

    from megatron_hsp.runtime.layout import ring_position_tokens
    from megatron_hsp.runtime.ring import ring_attention

    group = dist.new_group(list(range(world)))
    out = {}
    for n in tokens_per_rank:
        total = n * world
        cu = np.array([0, total], dtype=np.int64)
        held = torch.from_numpy(ring_position_tokens(cu, 1, world, rank))
        doc = torch.zeros_like(held)
        g = torch.Generator().manual_seed(rank)
        q = torch.randn(n, HEADS, DIM, generator=g, requires_grad=True)
        k = torch.randn(n, KV_HEADS, DIM, generator=g, requires_grad=True)
        v = torch.randn(n, KV_HEADS, DIM, generator=g, requires_grad=True)
        seen: dict[int, int] = {}
        with torch.autograd.graph.saved_tensors_hooks(_recorder(seen), lambda t: t):
            o = ring_attention(q, k, v, held, doc, group, DIM**-0.5)
        o.sum().backward()
        out[str(n)] = int(sum(seen.values()))
    return out


def measure_ring_saved_bytes(tokens: tuple[int, ...] = TOKENS, world: int = 2) -> dict[str, int]:
    from megatron_hsp.testing.dist import raise_rank_errors, run_distributed

    per_rank = raise_rank_errors(
        run_distributed(saved_bytes_worker, world, list(tokens), timeout_s=600)
    )
    return {str(n): max(r[str(n)] for r in per_rank) for n in tokens}
