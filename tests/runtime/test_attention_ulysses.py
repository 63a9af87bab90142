"""Ulysses HSP attention over gloo CPU groups equals single-device attention (fp32).

One spawn per world size runs every case (process start-up dominates the cost). The reference is
an independent float64 implementation (explicit block-diagonal causal mask, explicit GQA head map,
explicit rotate-half RoPE with positions restarting per document), not our backend.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist

from megatron_hsp.testing.dist import raise_rank_errors, run_distributed

pytestmark = [pytest.mark.spawns, pytest.mark.dist, pytest.mark.slow]

HEAD_DIM = 8
ROPE_BASE = 10000.0


# ------------------------------------------------------------------ reference (float64, naive)


def rope_table(max_len: int, dim: int = HEAD_DIM) -> torch.Tensor:
    """Megatron's rotary table layout [S, 1, 1, dim] (non-interleaved: cat(freqs, freqs))."""
    inv = 1.0 / (ROPE_BASE ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    freqs = torch.outer(torch.arange(max_len, dtype=torch.float32), inv)
    return torch.cat((freqs, freqs), dim=-1)[:, None, None, :]


def reference_rope(x: torch.Tensor, cu: list[int]) -> torch.Tensor:
    """x [T, H, D] float64; positions restart at every segment of cu."""
    out = torch.empty_like(x)
    table = rope_table(max(b - a for a, b in itertools.pairwise(cu))).double()
    for a, b in itertools.pairwise(cu):
        f = table[: b - a, 0]  # [L, 1, D]
        seg = x[a:b]
        half = seg.size(-1) // 2
        rot = torch.cat((-seg[..., half:], seg[..., :half]), dim=-1)
        out[a:b] = seg * torch.cos(f) + rot * torch.sin(f)
    return out


def reference_attention(q, k, v, cu: list[int], rope: bool) -> torch.Tensor:
    """Causal attention within segments; q [T, H, D], k/v [T, KV, D]; float64 math."""
    q, k, v = q.double(), k.double(), v.double()
    if rope:
        q, k = reference_rope(q, cu), reference_rope(k, cu)
    total, heads, dim = q.shape
    kv_of_head = torch.arange(heads) // (heads // k.size(1))
    k, v = k[:, kv_of_head], v[:, kv_of_head]
    seg = torch.repeat_interleave(
        torch.arange(len(cu) - 1), torch.tensor(cu[1:]) - torch.tensor(cu[:-1])
    )
    idx = torch.arange(total)
    allowed = (seg[:, None] == seg[None, :]) & (idx[:, None] >= idx[None, :])
    scores = torch.einsum("thd,shd->hts", q, k) / dim**0.5
    probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
    return torch.einsum("hts,shd->thd", probs, v)


def case_tensors(seed: int, total: int, heads: int, kv_heads: int):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(total, heads, HEAD_DIM, generator=g)
    k = torch.randn(total, kv_heads, HEAD_DIM, generator=g)
    v = torch.randn(total, kv_heads, HEAD_DIM, generator=g)
    dout = torch.randn(total, heads * HEAD_DIM, generator=g)
    return q, k, v, dout


def padded_cu(doc_lengths: list[int], group_size: int) -> list[int]:
    """The runtime contract: documents then one trailing padding segment to a multiple of d."""
    cu = [0]
    for n in doc_lengths:
        cu.append(cu[-1] + n)
    pad = -cu[-1] % group_size
    if pad:
        cu.append(cu[-1] + pad)
    return cu


# ------------------------------------------------------------------ cases run on every rank

# name, group size, heads, kv heads, document lengths, rope
CASES = [
    ("d1-no-group", 1, 4, 2, [5, 1, 7, 3], True),
    ("d1-size1-group", 1, 4, 4, [2, 6], True),
    ("d2-mha-cross-boundary", 2, 4, 4, [5, 1, 7, 3], True),
    ("d2-gqa", 2, 4, 2, [1, 9, 1, 4], True),
    ("d2-gqa-replicate", 2, 4, 1, [6, 3, 1], False),
    ("d4-gqa-replicate", 4, 4, 2, [1, 9, 1, 4, 2], True),
    ("d4-mqa-replicate", 4, 8, 1, [3, 1, 1, 1, 10], True),
    ("d4-one-token-docs", 4, 4, 4, [1, 1, 1, 1, 1, 1, 1, 1], True),
]


def _make_core_attention(heads: int, kv_heads: int):
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_hsp.runtime.attention import HSPCoreAttention

    config = TransformerConfig(
        num_layers=1,
        hidden_size=heads * HEAD_DIM,
        num_attention_heads=heads,
        num_query_groups=kv_heads,
        attention_dropout=0.0,
        use_cpu_initialization=True,
    )
    return config, HSPCoreAttention(config, 1, AttnMaskType.causal, "self", backend="torch")


def _groups_of_size(world: int, d: int) -> list[dist.ProcessGroup | None]:
    """Aligned blocks of size d, created on every rank in the same order."""
    return [dist.new_group(list(range(s, s + d))) for s in range(0, world, d)]


def _ulysses_worker(rank: int, world: int, cases: list) -> dict:
    from megatron.core.packed_seq_params import PackedSeqParams

    from megatron_hsp.runtime.attention import HSPPackedSeqParams

    sizes = sorted({c[1] for c in CASES if c[1] <= world} | {1})
    groups = {d: _groups_of_size(world, d) for d in sizes}
    results = {}
    for name, d, heads, kv_heads, docs, rope in cases:
        if d > world:
            continue
        block = rank // d
        group_rank = rank % d
        group = None if name == "d1-no-group" else groups[d][block]
        cu = padded_cu(docs, d)
        total = cu[-1]
        q, k, v, dout = case_tensors(1000 * block + len(name), total, heads, kv_heads)
        local = total // d
        sl = slice(group_rank * local, (group_rank + 1) * local)
        ql, kl, vl = (t[sl].clone().requires_grad_(True) for t in (q, k, v))
        _, attn = _make_core_attention(heads, kv_heads)
        cu_t = torch.tensor(cu, dtype=torch.int32)
        maxlen = max(b - a for a, b in itertools.pairwise(cu))
        params = PackedSeqParams(
            qkv_format="thd",
            cu_seqlens_q=cu_t,
            cu_seqlens_kv=cu_t,
            max_seqlen_q=maxlen,
            max_seqlen_kv=maxlen,
            cp_group=group,
        )
        if rope:
            table = rope_table(maxlen)
            params = HSPPackedSeqParams.wrap(params, table, table, 1.0)
        out = attn(ql, kl, vl, None, packed_seq_params=params)
        out.backward(dout[sl])
        results[name] = {
            "block": block,
            "group_rank": group_rank,
            "out": out.detach(),
            "dq": ql.grad,
            "dk": kl.grad,
            "dv": vl.grad,
        }
    return results


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b||, with ||b|| floored at 1 (one-token documents have exactly zero dq)."""
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1.0))


def _check_against_reference(world: int, results: list[dict]) -> None:
    checked = 0
    for name, d, heads, kv_heads, docs, rope in CASES:
        if d > world:
            continue
        for block in range(world // d):
            parts = sorted(
                (r[name] for r in results if r[name]["block"] == block),
                key=lambda p: p["group_rank"],
            )
            assert len(parts) == d
            cu = padded_cu(docs, d)
            q, k, v, dout = case_tensors(1000 * block + len(name), cu[-1], heads, kv_heads)
            q, k, v = (t.double().requires_grad_(True) for t in (q, k, v))
            ref = reference_attention(q, k, v, cu, rope).reshape(cu[-1], -1)
            ref.backward(dout.double())
            got = {key: torch.cat([p[key] for p in parts]) for key in ("out", "dq", "dk", "dv")}
            assert _rel(got["out"], ref) <= 1e-6, (name, block, _rel(got["out"], ref))
            for key, t in (("dq", q), ("dk", k), ("dv", v)):
                assert _rel(got[key], t.grad) <= 1e-5, (name, block, key, _rel(got[key], t.grad))
            checked += 1
    assert checked > 0


def _bad_heads_worker(rank: int, world: int) -> str:
    """6 heads on a group of 4 without its Ulysses x ring split: every rank must raise before any
    collective, then stay in sync."""
    from megatron.core.packed_seq_params import PackedSeqParams

    from megatron_hsp.runtime.agreement import head_problems

    group = dist.new_group(list(range(world)))
    _, attn = _make_core_attention(6, 6)
    # The start-up check accepts every size (4 runs as Ulysses 2 x ring 2) ...
    startup_error = "; ".join(head_problems([1, 2, world], 6, 6, 1))
    cu = torch.tensor([0, 4 * world], dtype=torch.int32)
    params = PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=4 * world, cp_group=group
    )
    x = torch.randn(4, 6, HEAD_DIM)
    try:
        attn(x, x, x, None, packed_seq_params=params)
        dist.barrier()
    except ValueError as exc:
        dist.barrier()  # all ranks got here: nobody is stuck inside an all-to-all
        return f"{startup_error}||{exc}"
    return f"{startup_error}||no error"


def _all_cases_worker(rank: int, world: int) -> dict:
    out = _ulysses_worker(rank, world, CASES)
    out["bad-heads"] = _bad_heads_worker(rank, world)
    return out


# ------------------------------------------------------------------ tests


@pytest.fixture(scope="module", params=[2, 4], ids=lambda w: f"world{w}")
def world_results(request) -> tuple[int, list]:
    """One spawn per world size runs every case (process start-up dominates the cost)."""
    world = request.param
    results = run_distributed(_all_cases_worker, world)
    return world, results


def test_ulysses_matches_single_device(world_results) -> None:
    world, results = world_results
    raise_rank_errors(results)
    _check_against_reference(world, results)


def test_heads_not_divisible_by_group_raises_on_every_rank(world_results) -> None:
    world, results = world_results
    raise_rank_errors(results)
    for r in results:
        startup, runtime = r["bad-heads"].split("||")
        if world == 2:  # 2 divides 6: the start-up check passes and attention runs
            assert startup == "" and runtime == "no error", (startup, runtime)
            continue
        # ... but a group of 4 handed to attention without that split is refused on every rank.
        assert startup == "", startup
        assert "group of size 4" in runtime and "6 query heads" in runtime, runtime
