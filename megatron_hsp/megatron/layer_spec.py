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
* megatron-core's ``get_gpt_layer_{with_transformer_engine,local}_spec`` with the options that
  builder passes (its local branch ignores ``--qk-l2-norm``: so does this one).

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

from collections.abc import Callable
from types import ModuleType
from typing import Any

from megatron.core.transformer.spec_utils import ModuleSpec, import_module
from megatron.core.transformer.transformer_block import TransformerBlock, TransformerBlockSubmodules

from megatron_hsp.megatron.spec import hsp_gpt_layer_spec, with_hsp_attention


def megatron_lm_gpt_builders() -> ModuleType | None:
    """The running Megatron-LM checkout's own ``gpt_builders`` module (the sibling of
    ``pretrain_gpt.py`` that builds the GPT model from the flags), or None outside a checkout
    (a training loop of one's own, ``selftest --megatron``) or where it does not import against
    the installed megatron-core. The one place that looks for Megatron-LM's builder: HSP's base
    spec here and the loop's stock model (``testing/megatron_loop/models.py``) both ask it."""
    try:
        import gpt_builders
    except ImportError:
        return None
    return gpt_builders


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
    builders = megatron_lm_gpt_builders()
    if builders is not None and hasattr(builders, "_get_transformer_layer_spec"):
        return builders._get_transformer_layer_spec(use_te, config)
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )

    # The options gpt_builders._get_transformer_layer_spec passes (Megatron-LM core_r0.19.0 and
    # main): its local branch does not pass qk_l2_norm, so stock Megatron builds no L2Norm with
    # --transformer-impl local --qk-l2-norm, and neither does --hsp (issue 44: the model HSP
    # builds is the model Megatron builds; tests/megatron/test_model_definition_matrix.py).
    qk_layernorm = bool(config.qk_layernorm)
    if use_te:
        return get_gpt_layer_with_transformer_engine_spec(
            qk_layernorm=qk_layernorm,
            qk_l2_norm=bool(getattr(config, "qk_l2_norm", False)),
            use_te_activation_func=bool(getattr(config, "use_te_activation_func", False)),
        )
    return get_gpt_layer_local_spec(qk_layernorm=qk_layernorm, normalization=config.normalization)


def hsp_spec_from_args(args: Any) -> Any:
    """``with_hsp_attention`` over the user's ``--spec`` or Megatron's default spec."""
    base = getattr(args, "hsp_base_spec", None)
    if base:
        return with_hsp_attention(import_module(tuple(base)))
    from megatron.training.arguments import core_transformer_config_from_args

    return with_hsp_attention(megatron_default_spec(args, core_transformer_config_from_args(args)))


class DeferredSpec(ModuleSpec):
    """A ``ModuleSpec`` built on its first read, when Megatron builds the model.

    Why: Megatron-LM main and core_r0.19 read ``--spec`` (``gpt_config_from_args``) right after
    parsing the flags, before ``pretrain()`` has checked for CUDA or created the parallel groups.
    The MoE decoder block spec needs the pipeline group (which layers this stage builds), and
    the Transformer Engine spec needs TE; built at import, both failed where stock Megatron goes
    on to its own CUDA check. Building on first read of a field gives the spec exactly where
    Megatron's builder would have made it, with the groups in place.

    The base is a layer spec (dense: the block repeats it for its own stage and virtual stage)
    or a ``ModuleSpec(TransformerBlock, <block submodules>)`` (MoE), which megatron-core's
    ``TransformerBlock`` takes as it takes ``get_gpt_decoder_block_spec``'s result.
    """

    def __init__(self, build: Callable[[], Any], what: str) -> None:  # no dataclass fields set
        self.__dict__.update(_build=build, _what=what, _spec=None)

    def resolve(self) -> ModuleSpec:
        """The spec, built now if it was not yet."""
        if self.__dict__["_spec"] is None:
            spec = self.__dict__["_build"]()
            if isinstance(spec, TransformerBlockSubmodules):
                spec = ModuleSpec(module=TransformerBlock, submodules=spec)
            self.__dict__["_spec"] = spec
        return self.__dict__["_spec"]

    module = property(lambda self: self.resolve().module)  # type: ignore[assignment]
    params = property(lambda self: self.resolve().params)  # type: ignore[assignment]
    submodules = property(lambda self: self.resolve().submodules)  # type: ignore[assignment]
    metainfo = property(lambda self: getattr(self.resolve(), "metainfo", {}))  # type: ignore[assignment]

    def __repr__(self) -> str:  # printing the config must not build the spec early
        built = self.__dict__["_spec"]
        return repr(built) if built is not None else f"DeferredSpec({self.__dict__['_what']})"


def _from_megatron_args() -> ModuleSpec:
    try:
        from megatron.training import get_args

        args = get_args()
    except (ImportError, AssertionError):  # no Megatron-LM, or args not parsed: defaults
        return hsp_gpt_layer_spec()
    if getattr(args, "hsp_base_spec", None):
        return hsp_spec_from_args(args)  # the user's own spec: imported as stock Megatron would
    impl = getattr(args, "transformer_impl", "?")
    moe = " MoE" if getattr(args, "num_experts", None) else ""
    return DeferredSpec(lambda: hsp_spec_from_args(args), f"HSP over Megatron's {impl}{moe} spec")


hsp_layer_spec: ModuleSpec = _from_megatron_args()
