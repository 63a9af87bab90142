"""A ``--spec`` for CPU runs under ``--sequence-parallel``: megatron-core's local GPT spec with
norms that declare their parameters sequence-parallel.

Why it exists: megatron-core 0.19.2's local spec takes its norms from ``WrappedTorchNorm`` when
neither Apex nor Transformer Engine is installed (the CPU case), and ``WrappedTorchNorm`` refuses
``--sequence-parallel`` outright (``assert not config.sequence_parallel``): under sequence
parallelism each TP rank normalises only its shard of the sequence, so the norm weights'
gradients must be summed over the TP group, which ``finalize_model_grads`` does only for
parameters marked ``sequence_parallel`` -- as Apex's ``FusedLayerNorm`` and TE's ``TENorm`` mark
theirs and torch's modules do not. ``SequenceParallelTorchNorm`` is torch's own
``RMSNorm``/``LayerNorm`` (what ``WrappedTorchNorm`` returns) with that mark; nothing else about
the model changes. ``selftest --megatron`` passes this module as ``--spec`` on both sides of its
tensor-parallel option set (the HSP side swaps its attention in, as for any user ``--spec``).

``local_sp_block_spec`` is a value, as ``--spec MODULE NAME`` requires, built when this module is
first imported, from Megatron's parsed args (layer count, normalization); outside a Megatron run
(no args) it is built for 2 RMSNorm layers.
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules


class SequenceParallelTorchNorm:
    """torch ``RMSNorm``/``LayerNorm`` whose parameters carry ``sequence_parallel`` (see above).

    Same constructor as megatron-core's ``WrappedTorchNorm`` (a norm builder of the spec).
    """

    def __new__(
        cls,
        config: Any,
        hidden_size: int,
        eps: float = 1e-5,
        persist_layer_norm: bool = False,
        zero_centered_gamma: bool = False,
        normalization: str = "LayerNorm",
    ) -> torch.nn.Module:
        kinds = {"RMSNorm": torch.nn.RMSNorm, "LayerNorm": torch.nn.LayerNorm}
        if config.normalization not in kinds:
            raise ValueError(
                f"--normalization {config.normalization}: SequenceParallelTorchNorm builds "
                f"{' or '.join(kinds)}"
            )
        norm = kinds[config.normalization](normalized_shape=hidden_size, eps=eps)
        for param in norm.parameters():
            param.sequence_parallel = bool(config.sequence_parallel)
        return norm


def build_local_sp_block_spec(num_layers: int, normalization: str) -> TransformerBlockSubmodules:
    """megatron-core's local layer spec with ``SequenceParallelTorchNorm`` for every norm
    (the two per layer and the block's final norm)."""
    import dataclasses

    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    layer: ModuleSpec = get_gpt_layer_local_spec(normalization=normalization)
    norms = {
        f.name: SequenceParallelTorchNorm
        for f in dataclasses.fields(layer.submodules)
        if getattr(layer.submodules, f.name) is WrappedTorchNorm
    }
    if not norms:
        raise RuntimeError("megatron-core's local spec has no WrappedTorchNorm to replace here")
    sub = dataclasses.replace(layer.submodules, **norms)
    layer = ModuleSpec(module=layer.module, params=dict(layer.params), submodules=sub)
    return TransformerBlockSubmodules(
        layer_specs=[layer] * num_layers, layer_norm=SequenceParallelTorchNorm
    )


def _from_megatron_args() -> TransformerBlockSubmodules:
    try:
        from megatron.training import get_args

        args = get_args()
    except (ImportError, AssertionError):
        return build_local_sp_block_spec(2, "RMSNorm")
    return build_local_sp_block_spec(int(args.num_layers), str(args.normalization))


local_sp_block_spec: TransformerBlockSubmodules = _from_megatron_args()
