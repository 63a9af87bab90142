"""A real megatron-core GPTModel built with ``hsp_gpt_layer_spec`` on the CPU.

Packed THD input must give the logits and gradients of stock megatron-core (its local spec, its
own RoPE and masked softmax, same weights) running every document on its own: the independent
check of position restarts and causality within documents. Against the SAME HSP model run per
document (BSHD) it is only a consistency check (shared attention and RoPE code).

The distributed case runs the same HSP model with Ulysses over groups of 2 and 4 gloo ranks
against the HSP model on one process: a CONSISTENCY check of the all-to-alls (both sides run
HSP's backend and RoPE); the independent distributed check is ``selftest`` (Ulysses at tp 1 and 2
against stock megatron-core, docs/exactness.md).
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist

from megatron_hsp.testing.dist import (
    destroy_cpu_megatron,
    init_single_process_megatron,
    raise_rank_errors,
    run_distributed,
    tiny_gpt_model,
)

DOCS = [5, 1, 7, 3, 1]
VOCAB = 64


def packed_params(cu: list[int], group=None):
    from megatron_hsp.runtime.attention import group_packed_seq_params

    return group_packed_seq_params(torch.tensor(cu, dtype=torch.int32), group)


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


def _stock_model_with_weights_of(model):
    """Stock megatron-core (``testing/reference.py``) with ``model``'s weights."""
    from megatron_hsp.testing.reference import ModelShape, reference_model

    c = model.config
    shape = ModelShape(
        num_layers=c.num_layers,
        hidden_size=c.hidden_size,
        num_attention_heads=c.num_attention_heads,
        num_query_groups=c.num_query_groups,
        kv_channels=c.kv_channels,
        ffn_hidden_size=c.ffn_hidden_size,
        vocab_size=VOCAB,
        max_sequence_length=512,
    )
    stock = reference_model(shape)
    own = dict(model.named_parameters())
    assert own.keys() == dict(stock.named_parameters()).keys()
    with torch.no_grad():
        for name, p in stock.named_parameters():
            p.copy_(own[name])
    return stock


def _stock_logits(stock, ids, w):
    """Each document alone through stock megatron-core; returns (logits, gradients)."""
    from megatron_hsp.testing.cpu_shims import cpu_attention_scores_buffer, cpu_megatron_training
    from megatron_hsp.testing.reference import causal_inputs

    pieces = []
    cpu_attention_scores_buffer(stock.config.num_attention_heads * max(DOCS) ** 2)
    with cpu_megatron_training():
        for a, b in zip(cumulative(DOCS)[:-1], cumulative(DOCS)[1:], strict=True):
            x = causal_inputs(ids[0, a:b].numpy())
            out = stock(x["input_ids"], x["position_ids"], x["attention_mask"])
            (out * w[:, a:b]).sum().backward()
            pieces.append(out.detach())
    return torch.cat(pieces, dim=1), grads(stock)


def test_packed_thd_equals_stock_megatron_each_document_alone(megatron_cpu) -> None:
    model = tiny_gpt_model()
    total = sum(DOCS)
    ids, w = tokens_and_weights(total)
    stock_out, g_stock = _stock_logits(_stock_model_with_weights_of(model), ids, w)

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

    # the independent check: stock megatron-core, each document alone
    assert packed.shape == stock_out.shape == (1, total, VOCAB)
    assert rel(packed.detach(), stock_out) <= 1e-6
    assert g_packed.keys() == g_stock.keys()
    for name, g in g_stock.items():
        assert rel(g_packed[name], g) <= 1e-5, (name, rel(g_packed[name], g))

    # consistency: the same HSP model per document (shared attention and RoPE code)
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


def test_with_hsp_attention_rewrites_a_megatron_decoder_block_spec(megatron_cpu) -> None:
    """The pretrain_gpt seam: Megatron-LM's block spec (one spec per layer) gets HSP attention."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    from megatron_hsp.megatron.spec import with_hsp_attention
    from megatron_hsp.runtime.attention import HSPCoreAttention, HSPSelfAttention
    from megatron_hsp.testing.cpu_shims import use_cpu_rotary

    config = tiny_gpt_model().config
    block = with_hsp_attention(get_gpt_decoder_block_spec(config, use_transformer_engine=False))
    torch.manual_seed(0)
    model = use_cpu_rotary(
        GPTModel(
            config, block, vocab_size=VOCAB, max_sequence_length=512, position_embedding_type="rope"
        )
    )
    for layer in model.decoder.layers:
        assert type(layer.self_attention) is HSPSelfAttention
        assert type(layer.self_attention.core_attention) is HSPCoreAttention
    ids, _ = tokens_and_weights(sum(DOCS))
    out = model(ids, positions(DOCS), None, packed_seq_params=packed_params(cumulative(DOCS)))
    assert out.shape == (1, sum(DOCS), VOCAB) and torch.isfinite(out).all()


# ------------------------------------------------------------------ distributed GPTModel


def _gpt_ulysses_worker(rank: int, world: int, tp: int) -> dict:
    """Ulysses over the ranks sharing this rank's TP position; each rank also computes the
    no-communication reference (its TP group alone on the whole buffer) itself."""
    from megatron.core import parallel_state

    # megatron orders TP fastest: the sequence-parallel peers of rank r are r % tp + k*tp.
    groups = [dist.new_group(list(range(t, world, tp))) for t in range(tp)]
    group = groups[parallel_state.get_tensor_model_parallel_rank()]
    world = group.size()
    rank = group.rank()
    model = tiny_gpt_model(seed=3, tensor_model_parallel_size=tp)
    docs = [6, 1, 9, 3]  # 19 tokens + 1 padding token for d=2; slices cross documents
    cu = cumulative(docs)
    pad = -cu[-1] % world
    if pad:
        cu.append(cu[-1] + pad)
    total = cu[-1]
    ids, w = tokens_and_weights(total, seed=11)
    shard = VOCAB // tp  # logits are vocab-parallel under TP
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    w = w[..., tp_rank * shard : (tp_rank + 1) * shard]
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


def _gpt_cases_worker(rank: int, world: int) -> dict:
    """4 ranks: tp=2 x Ulysses d=2 (KV heads replicated: 1 per TP rank), then tp=1 x d=4.

    megatron's --sequence-parallel is not covered: its CPU fallback (torch LayerNorm) refuses it.
    """
    from megatron_hsp.testing.dist import init_cpu_megatron

    results = {"tp2-d2": _gpt_ulysses_worker(rank, world, tp=2)}
    init_cpu_megatron(rank, world, "unused://", tensor_model_parallel_size=1)  # re-init megatron
    results["tp1-d4"] = _gpt_ulysses_worker(rank, world, tp=1)
    return results


@pytest.mark.spawns
@pytest.mark.dist
@pytest.mark.slow
def test_gpt_model_ulysses_consistent_with_single_process_hsp_with_and_without_tp() -> None:
    results = raise_rank_errors(
        run_distributed(_gpt_cases_worker, 4, tensor_model_parallel_size=2, timeout_s=400)
    )
    for per_rank in results:
        for case, r in per_rank.items():
            assert r["logits"] <= 1e-6, (case, r["logits"])
            assert r["grads"] and max(r["grads"].values()) <= 1e-5, (case, r["grads"])
