"""The layer spec Megatron-LM's ``--spec`` flag loads when ``--hsp`` is on.

``--spec MODULE NAME`` makes ``gpt_builders`` take ``vars(MODULE)[NAME]`` as the transformer layer
spec: a *value*, not a factory, so it is built here at import time, which happens while the model
is built, after Megatron's args are set. It follows the run's own choices (Transformer Engine or
local modules, QK layernorm, normalization) so that ``--hsp`` changes only the attention.
"""

from __future__ import annotations

from megatron.core.transformer.spec_utils import ModuleSpec

from megatron_hsp.megatron.spec import hsp_gpt_layer_spec


def _from_megatron_args() -> ModuleSpec:
    try:
        from megatron.training import get_args

        args = get_args()
    except (ImportError, AssertionError):  # no Megatron-LM, or args not parsed: defaults
        return hsp_gpt_layer_spec()
    return hsp_gpt_layer_spec(
        use_transformer_engine=getattr(args, "transformer_impl", "") == "transformer_engine",
        qk_layernorm=bool(getattr(args, "qk_layernorm", False)),
        normalization=getattr(args, "normalization", None),
    )


hsp_layer_spec: ModuleSpec = _from_megatron_args()
