"""GPT layer specs with HSP attention, injected through megatron-core's ModuleSpec seam.

``with_hsp_attention(spec)`` rewrites any GPT layer/block spec Megatron-LM built from its flags;
``hsp_gpt_layer_spec`` starts from megatron-core's own GPT layer spec and swaps exactly two
things in ``self_attention``: the module (``HSPSelfAttention``, which hands RoPE for packed input
to the core attention) and ``core_attention`` (``HSPCoreAttention``: Ulysses over the micro-batch's
group + varlen causal attention). Everything else (linears, norms, MLP, bias-dropout-add) is
megatron's, so parameters and state dicts are those of the stock spec. In MoE layers
the router class becomes ``runtime.moe.HSPTopKRouter`` (same parameters): its per-sequence aux
loss and z-loss follow the packed documents instead of the micro-batch.

Local (pure megatron-core) variant on CPU: without Apex megatron-core's local spec already falls
back to ``WrappedTorchNorm`` (torch LayerNorm/RMSNorm); linears are megatron's
Column/RowParallelLinear, which run on CPU with ``use_cpu_initialization=True`` and
``gradient_accumulation_fusion=False``. The TE variant uses TE's fused layernorm-linear modules and
needs CUDA; the attention backend then defaults to TE's ``DotProductAttention``.
"""

from __future__ import annotations

import dataclasses
from functools import partial

from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_layer_local_spec,
    get_gpt_layer_with_transformer_engine_spec,
)
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

from megatron_hsp.runtime.attention import HSPCoreAttention, HSPSelfAttention, te_available


def with_hsp_attention(spec, attention_backend: str = "auto"):
    """Swap HSP attention into ANY megatron-core GPT spec Megatron-LM built from its own args.

    Accepts a layer ``ModuleSpec`` (``TransformerLayer``), a ``TransformerBlockSubmodules`` (what
    ``get_gpt_decoder_block_spec`` returns: one spec per layer), a hybrid stack's
    ``HybridStackSubmodules`` (its ``attention_layer`` only) or a ``ModuleSpec`` wrapping one.
    This is the seam for ``pretrain_gpt.py``: build the spec exactly as Megatron-LM does, then pass
    it through here, so every other flag (norms, MoE, qk-layernorm, TE) keeps Megatron's meaning.
    """
    if isinstance(spec, TransformerBlockSubmodules):
        return dataclasses.replace(
            spec,
            layer_specs=[with_hsp_attention(s, attention_backend) for s in spec.layer_specs],
        )
    if _is_hybrid_stack(spec):
        return _swap_hybrid_attention(spec, attention_backend)
    if isinstance(spec, ModuleSpec) and (
        isinstance(spec.submodules, TransformerBlockSubmodules) or _is_hybrid_stack(spec.submodules)
    ):
        return ModuleSpec(
            module=spec.module,
            params=dict(spec.params),
            submodules=with_hsp_attention(spec.submodules, attention_backend),
        )
    if isinstance(spec, ModuleSpec):
        return _swap_attention(spec, attention_backend)
    raise TypeError(f"expected a megatron-core GPT layer or block spec, got {type(spec).__name__}")


def _is_hybrid_stack(submodules: object) -> bool:
    """A megatron-core ``HybridStackSubmodules`` (``pretrain_hybrid.py``'s ``--spec``)."""
    try:
        from megatron.core.models.hybrid.hybrid_block import HybridStackSubmodules
    except ImportError:  # megatron-core without hybrid models
        return False
    return isinstance(submodules, HybridStackSubmodules)


def _swap_hybrid_attention(stack: object, backend: str) -> object:
    """HSP attention in a hybrid stack's attention layers (pattern symbol ``*``) only.

    Why only those: a hybrid stack holds one spec per layer *type* (mamba_layer, gdn_layer,
    attention_layer, dsa_layer, mla_layer, mlp_layer, moe_layer) and the pattern picks one per
    layer. ``attention_layer`` is a TransformerLayer with megatron-core SelfAttention, what HSP
    replaces; MLP layers run per token and need nothing; the other types are refused at argument
    time (``refusals._HYBRID_SYMBOLS_HSP_CANNOT_RUN``) and stay as they are here.
    """
    layer = stack.attention_layer  # type: ignore[attr-defined]
    if not isinstance(layer, ModuleSpec):
        return stack  # no attention layers in this stack spec (IdentityOp)
    return dataclasses.replace(stack, attention_layer=_swap_attention(layer, backend))


def _swap_attention(layer_spec: ModuleSpec, backend: str) -> ModuleSpec:
    submodules = layer_spec.submodules
    attn = submodules.self_attention
    if not (isinstance(attn, ModuleSpec) and attn.module is SelfAttention):
        raise ValueError(
            f"expected megatron-core SelfAttention in the base GPT layer spec, got {attn!r} "
            f"(multi-latent attention and experimental attention variants are not supported by HSP)"
        )
    attn_sub: SelfAttentionSubmodules = attn.submodules
    core = HSPCoreAttention if backend == "auto" else partial(HSPCoreAttention, backend=backend)
    new_attn = ModuleSpec(
        module=HSPSelfAttention,
        params=dict(attn.params),
        submodules=dataclasses.replace(attn_sub, core_attention=core),
    )
    return ModuleSpec(
        module=layer_spec.module,
        params=dict(layer_spec.params),
        submodules=dataclasses.replace(
            submodules, self_attention=new_attn, mlp=_swap_router(submodules.mlp)
        ),
    )


def _swap_router(mlp: object) -> object:
    """An MoE layer's router becomes ``HSPTopKRouter`` (per-document sequence aux loss over the
    plan group, no padding in the router losses: ``runtime.moe`` says why); any other MLP spec
    is returned as it is. Same parameters as megatron-core's ``TopKRouter``.

    megatron-core 0.19 builds the MoE layer spec as ``partial(MoELayer, submodules=...)``;
    older releases as a ``ModuleSpec``: both are rewritten.
    """
    from megatron.core.transformer.moe.moe_layer import MoELayer

    if isinstance(mlp, partial) and isinstance(mlp.func, type) and issubclass(mlp.func, MoELayer):
        keywords = dict(mlp.keywords)
        keywords["submodules"] = _hsp_router_submodules(keywords.get("submodules"))
        return partial(mlp.func, *mlp.args, **keywords)
    if (
        isinstance(mlp, ModuleSpec)
        and isinstance(mlp.module, type)
        and issubclass(mlp.module, MoELayer)
    ):
        return ModuleSpec(
            module=mlp.module,
            params=dict(mlp.params),
            submodules=_hsp_router_submodules(mlp.submodules),
        )
    return mlp


def _hsp_router_submodules(submodules: object) -> object:
    from megatron.core.transformer.moe.router import TopKRouter

    from megatron_hsp.runtime.moe import HSPTopKRouter

    router = getattr(submodules, "router", None)
    if router is not TopKRouter:
        raise ValueError(
            f"expected megatron-core TopKRouter in the MoE layer spec, got {router!r}: HSP "
            "replaces that router only"
        )
    return dataclasses.replace(submodules, router=HSPTopKRouter)


def hsp_gpt_layer_spec(
    *,
    use_transformer_engine: bool | None = None,
    attention_backend: str = "auto",
    qk_layernorm: bool = False,
    normalization: str | None = None,
) -> ModuleSpec:
    """A dense GPT ``TransformerLayer`` spec whose self-attention is HSP's.

    use_transformer_engine: None picks TE when it imports and CUDA is present (TE layers + TE
      attention), else megatron-core's local modules (runs on CPU).
    attention_backend: ``auto`` | ``torch`` | ``te`` for the core attention (see
      ``megatron_hsp.runtime.attention.make_backend``).
    normalization: ``"RMSNorm"`` or None/``"LayerNorm"``; for the TE spec the norm type comes
      from ``TransformerConfig.normalization`` as usual.
    """
    if use_transformer_engine is None:
        use_transformer_engine = te_available()
    if use_transformer_engine:
        try:
            import transformer_engine.pytorch  # noqa: F401
        except Exception as exc:
            raise ValueError(
                "hsp_gpt_layer_spec(use_transformer_engine=True) needs Transformer Engine, which "
                f"does not import here ({type(exc).__name__}: {exc}); use "
                "use_transformer_engine=False (megatron-core local modules, runs on CPU)"
            ) from exc
        base = get_gpt_layer_with_transformer_engine_spec(qk_layernorm=qk_layernorm)
    else:
        base = get_gpt_layer_local_spec(qk_layernorm=qk_layernorm, normalization=normalization)
    return with_hsp_attention(base, attention_backend)
