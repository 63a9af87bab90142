"""Ring attention's activation memory grows linearly with tokens (issue 15).

Autograd-saved bytes of one ring attention call on 2 gloo ranks at 2K, 4K and 8K tokens per rank
(``benchmarks/ring_memory.py``). Each doubling of the tokens may at most double the bytes (plus
a little slack); the old dense path, which let autograd keep every step's ``[h, T/r, T/r]`` fp32
scores and mask, grew about 4x per doubling and fails this.
"""

from __future__ import annotations

import pytest

from megatron_hsp.testing import memory


@pytest.mark.dist
@pytest.mark.slow
def test_ring_saved_bytes_grow_linearly_with_tokens():
    saved = memory.measure_ring_saved_bytes()
    b2, b4, b8 = (saved[str(n)] for n in (2048, 4096, 8192))
    print(f"saved bytes per rank: 2K {b2}, 4K {b4}, 8K {b8}")
    assert b2 > 0
    assert b4 / b2 <= 2.1 and b8 / b4 <= 2.1, (b2, b4, b8)
    # and of the order of q, k, v and the output: no per-pair term survives
    per_token = memory.HEADS * memory.DIM * 4 * 2 + 2 * memory.KV_HEADS * memory.DIM * 4
    assert b8 <= 4 * per_token * 8192, (b8, per_token)
