"""HSP attention in megatron-core's HybridModel (``pretrain_hybrid.py --hsp``, issue 18).

``with_hsp_attention`` on a hybrid stack spec replaces the attention layers' SelfAttention and
nothing else (before: AttributeError, 'HybridStackSubmodules' object has no attribute
'self_attention'). megatron-core's own ``hybrid_stack_spec`` is Transformer-Engine only (and
``HybridStack`` builds its final norm with ``TENorm`` unconditionally), so the CPU run below uses
a local stack spec of megatron-core's local GPT modules, with ``TENorm`` replaced by megatron's
``WrappedTorchNorm`` for this test only: a HybridModel with pattern ``*-*-`` trained on packed
documents with HSP attention gives the logits and gradients of the same model with stock
attention run on each document alone. The TE spec on a GPU is listed in docs/gpu-validation.md.
"""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

from megatron_hsp.megatron.spec import with_hsp_attention
from megatron_hsp.runtime.attention import HSPCoreAttention, HSPSelfAttention
from megatron_hsp.testing.dist import destroy_cpu_megatron, init_single_process_megatron

DOCS = [5, 1, 7, 3]
VOCAB = 64


def test_only_the_attention_layers_of_megatrons_hybrid_stack_spec_change():
    from megatron.core.models.hybrid.hybrid_layer_specs import hybrid_stack_spec

    ours = with_hsp_attention(hybrid_stack_spec)
    assert ours.module is hybrid_stack_spec.module
    before, after = hybrid_stack_spec.submodules, ours.submodules
    for f in dataclasses.fields(before):
        if f.name != "attention_layer":
            assert getattr(after, f.name) is getattr(before, f.name), f.name
    layer_before, layer_after = before.attention_layer, after.attention_layer
    assert layer_after.module is layer_before.module
    for f in dataclasses.fields(layer_before.submodules):
        if f.name != "self_attention":
            assert getattr(layer_after.submodules, f.name) is getattr(
                layer_before.submodules, f.name
            ), f.name
    attn_before = layer_before.submodules.self_attention
    attn_after = layer_after.submodules.self_attention
    assert attn_after.module is HSPSelfAttention and attn_after.params == attn_before.params
    sub_before, sub_after = attn_before.submodules, attn_after.submodules
    assert sub_after.core_attention is HSPCoreAttention
    for f in dataclasses.fields(sub_before):
        if f.name != "core_attention":
            assert getattr(sub_after, f.name) is getattr(sub_before, f.name), f.name
    # The upstream spec is left as it was (a copy is rewritten).
    assert before.attention_layer.submodules.self_attention.module.__name__ == "SelfAttention"


def _local_hybrid_stack_spec():
    """megatron-core's hybrid stack with its local (CPU) GPT modules: attention and MLP layers."""
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.hybrid.hybrid_block import HybridStack, HybridStackSubmodules
    from megatron.core.ssm.mlp_layer import MLPLayer
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_layer import (
        TransformerLayer,
        TransformerLayerSubmodules,
    )

    local = get_gpt_layer_local_spec().submodules
    attention = ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=local.input_layernorm,
            self_attention=local.self_attention,
            self_attn_bda=get_bias_dropout_add,
        ),
    )
    mlp = ModuleSpec(
        module=MLPLayer,
        submodules=TransformerLayerSubmodules(
            pre_mlp_layernorm=local.pre_mlp_layernorm, mlp=local.mlp, mlp_bda=get_bias_dropout_add
        ),
    )
    return ModuleSpec(
        module=HybridStack,
        submodules=HybridStackSubmodules(attention_layer=attention, mlp_layer=mlp),
    )


@pytest.fixture(scope="module")
def megatron_cpu():
    init_single_process_megatron()
    yield
    destroy_cpu_megatron()


def _hybrid_model(spec):
    from megatron.core.models.hybrid.hybrid_model import HybridModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_hsp.testing.cpu_shims import use_cpu_rotary

    config = TransformerConfig(
        num_layers=4,
        hidden_size=32,
        ffn_hidden_size=64,
        num_attention_heads=4,
        num_query_groups=2,
        use_cpu_initialization=True,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        gradient_accumulation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
    )
    torch.manual_seed(0)
    model = HybridModel(
        config,
        hybrid_stack_spec=spec,
        vocab_size=VOCAB,
        max_sequence_length=512,
        hybrid_layer_pattern="*-*-",
        position_embedding_type="rope",
    )
    return use_cpu_rotary(model)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def test_hybrid_model_with_hsp_attention_equals_stock_per_document(megatron_cpu, monkeypatch):
    import megatron.core.models.hybrid.hybrid_block as hybrid_block
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    from megatron_hsp.runtime.attention import group_packed_seq_params
    from megatron_hsp.testing.cpu_shims import cpu_attention_scores_buffer, cpu_megatron_training
    from megatron_hsp.testing.reference import causal_inputs

    # HybridStack's final norm is TENorm whatever the spec; no TE on the CPU (test only).
    monkeypatch.setattr(hybrid_block, "TENorm", WrappedTorchNorm)
    stock_spec = _local_hybrid_stack_spec()
    hsp, stock = _hybrid_model(with_hsp_attention(stock_spec)), _hybrid_model(stock_spec)
    kinds = [type(layer).__name__ for layer in hsp.decoder.layers]
    assert kinds == ["TransformerLayer", "MLPLayer", "TransformerLayer", "MLPLayer"]
    assert type(hsp.decoder.layers[0].self_attention) is HSPSelfAttention
    assert type(stock.decoder.layers[0].self_attention) is not HSPSelfAttention
    # Same parameter names (checkpoints interchange) and the same weights.
    assert [n for n, _ in hsp.named_parameters()] == [n for n, _ in stock.named_parameters()]
    with torch.no_grad():
        for (_, p), (_, q) in zip(hsp.named_parameters(), stock.named_parameters(), strict=True):
            q.copy_(p)

    cu = [0]
    for n in DOCS:
        cu.append(cu[-1] + n)
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, VOCAB, (1, cu[-1]), generator=g)
    w = torch.randn(1, cu[-1], VOCAB, generator=g)
    positions = torch.cat([torch.arange(n) for n in DOCS])[None]
    packed = hsp(
        ids,
        positions,
        None,
        packed_seq_params=group_packed_seq_params(torch.tensor(cu, dtype=torch.int32), None),
    )
    (packed * w).sum().backward()

    cpu_attention_scores_buffer(4 * max(DOCS) ** 2)
    pieces = []
    with cpu_megatron_training():
        for a, b in itertools.pairwise(cu):
            x = causal_inputs(ids[0, a:b].numpy())
            out = stock(x["input_ids"], x["position_ids"], x["attention_mask"])
            (out * w[:, a:b]).sum().backward()
            pieces.append(out.detach())
    reference = torch.cat(pieces, dim=1)
    assert packed.shape == reference.shape == (1, cu[-1], VOCAB)
    assert rel(packed.detach(), reference) <= 1e-6
    stock_grads = {n: p.grad for n, p in stock.named_parameters()}
    for name, p in hsp.named_parameters():
        assert rel(p.grad, stock_grads[name]) <= 1e-5, name

    # Negative control: the packed documents as one sequence must differ (a leak would show).
    hsp.zero_grad()
    joined = hsp(ids, torch.arange(cu[-1])[None], None).detach()
    assert rel(joined, reference) > 1e-3


def _hybrid_ulysses_worker(rank: int, world: int) -> dict:
    """Two gloo ranks, one Ulysses group of 2: each rank's half of the packed tokens through the
    HSP HybridModel against the same model on the whole buffer in this process (consistency of
    the all-to-alls inside a hybrid stack; the independent check is the single-process test)."""
    import megatron.core.models.hybrid.hybrid_block as hybrid_block
    import torch.distributed as dist
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    from megatron_hsp.runtime.attention import group_packed_seq_params

    hybrid_block.TENorm = WrappedTorchNorm  # this spawned process only (see the module doc)
    group = dist.new_group(list(range(world)))
    model = _hybrid_model(with_hsp_attention(_local_hybrid_stack_spec()))
    docs = [6, 1, 9, 3, 1]  # 20 tokens, slices cross documents
    cu = [0]
    for n in docs:
        cu.append(cu[-1] + n)
    g = torch.Generator().manual_seed(11)
    ids = torch.randint(0, VOCAB, (1, cu[-1]), generator=g)
    w = torch.randn(1, cu[-1], VOCAB, generator=g)
    pos = torch.cat([torch.arange(n) for n in docs])[None]
    cu_t = torch.tensor(cu, dtype=torch.int32)

    ref = model(ids, pos, None, packed_seq_params=group_packed_seq_params(cu_t, None))
    (ref * w).sum().backward()
    g_ref = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    model.zero_grad()

    local = cu[-1] // world
    sl = slice(rank * local, (rank + 1) * local)
    out = model(
        ids[:, sl], pos[:, sl], None, packed_seq_params=group_packed_seq_params(cu_t, group)
    )
    (out * w[:, sl]).sum().backward()
    worst = 0.0
    for name, p in model.named_parameters():
        grad = p.grad.detach().clone()
        dist.all_reduce(grad, group=group)  # each rank holds its tokens' share
        worst = max(worst, rel(grad, g_ref[name]))
    return {"logits": rel(out.detach(), ref.detach()[:, sl]), "grads": worst}


@pytest.mark.spawns
@pytest.mark.dist
@pytest.mark.slow
def test_hybrid_model_ulysses_over_two_ranks_is_consistent():
    from megatron_hsp.testing.dist import raise_rank_errors, run_distributed

    for r in raise_rank_errors(run_distributed(_hybrid_ulysses_worker, 2, timeout_s=400)):
        assert r["logits"] <= 1e-6 and r["grads"] <= 1e-5, r
