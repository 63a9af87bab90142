"""The layer spec Megatron-LM's ``--spec`` flag loads when ``--hsp`` is on.

``--spec MODULE NAME`` makes ``gpt_builders`` take ``vars(MODULE)[NAME]`` as the transformer layer
spec: a *value*, not a factory, so it is built here at import time, which happens while the model
is built, after Megatron's args are set.

It is the spec Megatron would have built without ``--hsp``, passed through ``with_hsp_attention``
so that ``--hsp`` changes only the attention:

* the user's own ``--spec`` (``install`` keeps it in ``args.hsp_base_spec``), else
* ``gpt_builders._get_transformer_layer_spec(use_te, config)`` of the running Megatron-LM checkout
  (the function its ``gpt_builder`` calls for a dense GPT: TE or local modules, qk-layernorm,
  qk-l2-norm, TE activation, kitchen options all as the flags say), else, outside a checkout,
* megatron-core's ``get_gpt_layer_{with_transformer_engine,local}_spec`` with the same options.

``pretrain_hybrid.py`` requires ``--spec`` (its builder takes the hybrid stack spec from it): the
base is then that stack spec, and ``with_hsp_attention`` rewrites its attention layers only.

With ``--num-experts`` the base is megatron-core's decoder block spec (what ``gpt_builder`` builds
for MoE); ``with_hsp_attention`` swaps HSP attention into every layer and HSP's router
(``runtime.moe.HSPTopKRouter``) into the MoE layers.

Features whose spec is not a plain layer or block spec (MTP, MLA, experimental attention,
heterogeneous layers, hybrid layers other than attention and MLP) are refused earlier, by
``validate_hsp_args``.
"""

from __future__ import annotations

from typing import Any

from megatron.core.transformer.spec_utils import ModuleSpec, import_module

from megatron_hsp.megatron.spec import hsp_gpt_layer_spec, with_hsp_attention


def megatron_default_spec(args: Any, config: Any) -> Any:
    """The GPT layer (dense) or block (``--num-experts``) spec Megatron-LM's ``gpt_builder``
    builds from ``args``/``config``."""
    use_te = getattr(args, "transformer_impl", "") == "transformer_engine"
    if getattr(args, "num_experts", None):
        # gpt_builder's MoE branch: megatron-core's decoder block spec (dense and MoE layers as
        # --moe-layer-freq says), the same call in and outside a checkout.
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

        return get_gpt_decoder_block_spec(
            config,
            use_transformer_engine=use_te,
            normalization=args.normalization,
            qk_l2_norm=bool(getattr(args, "qk_l2_norm", False)),
        )
    try:
        from gpt_builders import _get_transformer_layer_spec  # the checkout's own builder
    except ImportError:
        _get_transformer_layer_spec = None
    if _get_transformer_layer_spec is not None:
        return _get_transformer_layer_spec(use_te, config)
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )

    common = {
        "qk_layernorm": bool(config.qk_layernorm),
        "qk_l2_norm": bool(getattr(config, "qk_l2_norm", False)),
    }
    if use_te:
        return get_gpt_layer_with_transformer_engine_spec(
            use_te_activation_func=bool(getattr(config, "use_te_activation_func", False)),
            **common,
        )
    return get_gpt_layer_local_spec(normalization=config.normalization, **common)


def hsp_spec_from_args(args: Any) -> Any:
    """``with_hsp_attention`` over the user's ``--spec`` or Megatron's default spec."""
    base = getattr(args, "hsp_base_spec", None)
    if base:
        return with_hsp_attention(import_module(tuple(base)))
    from megatron.training.arguments import core_transformer_config_from_args

    return with_hsp_attention(megatron_default_spec(args, core_transformer_config_from_args(args)))


def _from_megatron_args() -> ModuleSpec:
    try:
        from megatron.training import get_args

        args = get_args()
    except (ImportError, AssertionError):  # no Megatron-LM, or args not parsed: defaults
        return hsp_gpt_layer_spec()
    return hsp_spec_from_args(args)


hsp_layer_spec: ModuleSpec = _from_megatron_args()
