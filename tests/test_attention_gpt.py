"""A real megatron-core GPTModel built with ``hsp_gpt_layer_spec`` on the CPU.

Packed THD input must give the same logits and gradients as running every document on its own
(BSHD, megatron's own RoPE path): this pins position restarts and causality within documents.
The distributed case runs the same model with Ulysses over a group of 2 gloo ranks.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist

from megatron_hsp.runtime.testing import (
    destroy_cpu_megatron,
    init_single_process_megatron,
    raise_rank_errors,
    run_distributed,
    tiny_gpt_model,
)

DOCS = [5, 1, 7, 3, 1]
VOCAB = 64


def packed_params(cu: list[int], group=None):
    from megatron.core.packed_seq_params import PackedSeqParams

    cu_t = torch.tensor(cu, dtype=torch.int32)
    longest = max(b - a for a, b in itertools.pairwise(cu))
    return PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu_t,
        cu_seqlens_kv=cu_t,
        max_seqlen_q=longest,
        max_seqlen_kv=longest,
        cp_group=group,
    )


def cumulative(lengths: list[int]) -> list[int]:
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return cu


def tokens_and_weights(total: int, seed: int = 7):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (1, total), generator=g)
    # A fixed random linear functional of the logits: every logit gets a distinct gradient.
    w = torch.randn(1, total, VOCAB, generator=g)
    return ids, w


def positions(lengths: list[int]) -> torch.Tensor:
    return torch.cat([torch.arange(n) for n in lengths])[None]


def grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


@pytest.fixture(scope="module")
def megatron_cpu():
    init_single_process_megatron()
    yield
    destroy_cpu_megatron()


def test_packed_thd_equals_each_document_alone(megatron_cpu) -> None:
    model = tiny_gpt_model()
    total = sum(DOCS)
    ids, w = tokens_and_weights(total)

    packed = model(ids, positions(DOCS), None, packed_seq_params=packed_params(cumulative(DOCS)))
    (packed * w).sum().backward()
    g_packed = grads(model)
    model.zero_grad()

    pieces = []
    for a, b in zip(cumulative(DOCS)[:-1], cumulative(DOCS)[1:], strict=True):
        out = model(ids[:, a:b], torch.arange(b - a)[None], None)
        (out * w[:, a:b]).sum().backward()
        pieces.append(out.detach())
    separate = torch.cat(pieces, dim=1)
    g_separate = grads(model)

    assert packed.shape == separate.shape == (1, total, VOCAB)
    assert rel(packed.detach(), separate) <= 1e-6
    assert g_packed.keys() == g_separate.keys() and len(g_packed) > 0
    for name, g in g_separate.items():
        assert rel(g_packed[name], g) <= 1e-5, (name, rel(g_packed[name], g))

    # Negative control: the same tokens as ONE document (no position restart, attention across
    # document borders) must differ, otherwise the comparison above could not detect a leak.
    model.zero_grad()
    joined = model(ids, torch.arange(total)[None], None).detach()
    assert rel(joined, separate) > 1e-3


def test_hsp_spec_keeps_megatron_parameter_names(megatron_cpu) -> None:
    """Only attention code changes: checkpoints of the stock local spec load unchanged."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    from megatron_hsp.runtime.attention import HSPCoreAttention, HSPSelfAttention

    hsp = tiny_gpt_model()
    stock = GPTModel(
        hsp.config,
        get_gpt_layer_local_spec(),
        vocab_size=VOCAB,
        max_sequence_length=512,
        position_embedding_type="rope",
    )
    assert [n for n, _ in hsp.named_parameters()] == [n for n, _ in stock.named_parameters()]
    layer = hsp.decoder.layers[0]
    assert type(layer.self_attention) is HSPSelfAttention
    assert type(layer.self_attention.core_attention) is HSPCoreAttention


# ------------------------------------------------------------------ distributed GPTModel


def _gpt_ulysses_worker(rank: int, world: int) -> dict:
    """Group of all ranks; every rank also computes the single-process reference itself."""
    group = dist.new_group(list(range(world)))
    model = tiny_gpt_model(seed=3)
    docs = [6, 1, 9, 3]  # 19 tokens + 1 padding token for d=2; slices cross documents
    cu = cumulative(docs)
    pad = -cu[-1] % world
    if pad:
        cu.append(cu[-1] + pad)
    total = cu[-1]
    ids, w = tokens_and_weights(total, seed=11)
    seg_lengths = [b - a for a, b in itertools.pairwise(cu)]
    pos = positions(seg_lengths)

    ref = model(ids, pos, None, packed_seq_params=packed_params(cu))
    (ref * w).sum().backward()
    g_ref = grads(model)
    model.zero_grad()

    local = total // world
    sl = slice(rank * local, (rank + 1) * local)
    out = model(ids[:, sl], pos[:, sl], None, packed_seq_params=packed_params(cu, group))
    (out * w[:, sl]).sum().backward()
    g_dist = grads(model)
    for g in g_dist.values():  # each rank holds its tokens' share of every gradient
        dist.all_reduce(g, group=group)

    return {
        "logits": rel(out.detach(), ref.detach()[:, sl]),
        "grads": {n: rel(g_dist[n], g) for n, g in g_ref.items()},
    }


@pytest.mark.dist
@pytest.mark.slow
def test_gpt_model_ulysses_two_ranks_matches_single_process() -> None:
    results = raise_rank_errors(run_distributed(_gpt_ulysses_worker, 2))
    for r in results:
        assert r["logits"] <= 1e-6, r["logits"]
        assert r["grads"] and max(r["grads"].values()) <= 1e-5, r["grads"]
