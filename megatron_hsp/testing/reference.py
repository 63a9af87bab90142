"""The selftest's independent single-device reference: stock megatron-core, one document at a time.

Why independent. A reference that shares code with what it checks proves nothing about that code
(a non-causal attention planted in every process passed the old reference, which ran HSP's own
dispatch, forward and attention on one rank). This one uses none of it:

* model: megatron-core ``GPTModel`` built with megatron-core's own local layer spec
  (``get_gpt_layer_local_spec``: ``SelfAttention`` + ``DotProductAttention``), so RoPE is applied by
  megatron's ``SelfAttention`` and attention is megatron's masked softmax;
* causality: megatron's own left-to-right mask (``gpt_dataset._get_ltor_masks_and_position_ids``,
  what classic ``pretrain_gpt.py`` feeds ``DotProductAttention``);
* no packing: each document is its own ``[1, L]`` sequence, positions 0..L-1;
* loss: the model's own cross-entropy (labels passed to ``GPTModel``), summed over every token
  that has a target in every document, divided by the number of such tokens -- Megatron's
  per-token loss of the whole global batch. Documents of one token have no target and are not run.

It imports nothing from ``megatron_hsp`` except ``testing.cpu_shims`` (device placement only:
``cpu_megatron_training`` answers megatron's ``torch.cuda.current_device()`` requests with the CPU,
and ``cpu_attention_scores_buffer`` pre-allocates megatron's named score buffer there). RoPE is
megatron-core's own ``RotaryEmbedding`` instance, unmodified: its table is moved "to the GPU" by
megatron's own code, which the placement mode keeps on the CPU. ``reference_model`` refuses a
model holding any module defined outside megatron-core or torch;
``tests/testing/test_selftest_reference.py`` imports this module in a fresh process and fails if it
reaches ``megatron_hsp.runtime``, ``megatron_hsp.megatron`` or ``megatron_hsp.planner``.
The distributed HSP model loads this model's initial weights by
parameter name (the HSP spec only swaps parameter-free attention modules, so the names are the
same; the loader checks).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from megatron_hsp.testing.cpu_shims import cpu_attention_scores_buffer, cpu_megatron_training


@dataclass(frozen=True)
class ModelShape:
    """The tiny GPT every selftest case trains: small enough for 8 CPU processes on 2 cores.

    Megatron's ``TransformerConfig`` field names, as the reference and the HSP side build their
    models from them, plus the run's fields (``max_sequence_length``, ``seed``,
    ``position_embedding_type``). Not the planner's ``TransformerShape``: the reference imports
    nothing from the planner (its independence, checked by
    ``tests/testing/test_selftest_reference.py``); the cost model reads it as a
    ``TransformerShape`` (``acceptance.predicted_tokens_per_s``).
    """

    num_layers: int = 2
    hidden_size: int = 32
    num_attention_heads: int = 8
    num_query_groups: int = 2
    # Head dim, independent of hidden_size / heads: a multiple of 8 as torch's flash varlen
    # kernel (and TE's) needs on a GPU; the acceptance kit adds a case at 128.
    kv_channels: int = 8
    ffn_hidden_size: int = 64
    vocab_size: int = 128
    max_sequence_length: int = 512
    seed: int = 1234
    # megatron's "rope" (positions recomputed inside attention) or its default
    # "learned_absolute" (an embedding table indexed by the dispatched position ids).
    position_embedding_type: str = "rope"


def reference_model(shape: ModelShape) -> torch.nn.Module:
    """Stock megatron-core ``GPTModel`` (local spec, fp32, CPU, tensor parallel 1)."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    if parallel_state.get_tensor_model_parallel_world_size() != 1:
        raise RuntimeError("the reference runs with tensor parallel size 1 (one device)")
    config = TransformerConfig(
        num_layers=shape.num_layers,
        hidden_size=shape.hidden_size,
        ffn_hidden_size=shape.ffn_hidden_size,
        num_attention_heads=shape.num_attention_heads,
        num_query_groups=shape.num_query_groups,
        kv_channels=shape.kv_channels,
        use_cpu_initialization=True,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        gradient_accumulation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        calculate_per_token_loss=True,
    )
    torch.manual_seed(shape.seed)
    model = GPTModel(
        config,
        get_gpt_layer_local_spec(),
        vocab_size=shape.vocab_size,
        max_sequence_length=shape.max_sequence_length,
        position_embedding_type=shape.position_embedding_type,
    )
    foreign = sorted(
        {
            type(m).__module__ + "." + type(m).__qualname__
            for m in model.modules()
            if not type(m).__module__.startswith(("megatron.core.", "torch."))
        }
    )
    if foreign:
        raise RuntimeError(f"the reference model must be stock megatron-core; it holds {foreign}")
    return model


def causal_inputs(document: np.ndarray) -> dict[str, torch.Tensor]:
    """One document as a stock ``[1, L]`` GPT sample: megatron's causal mask and positions, labels
    the next token (the last position's label is a placeholder with loss mask 0)."""
    from megatron.core.datasets.gpt_dataset import _get_ltor_masks_and_position_ids

    tokens = torch.from_numpy(np.asarray(document, dtype=np.int64))
    mask, _, positions = _get_ltor_masks_and_position_ids(
        tokens,
        eod_token=-1,  # no end-of-document token inside a document
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=True,
    )
    labels = torch.cat([tokens[1:], tokens.new_zeros(1)])
    loss_mask = torch.ones(tokens.numel())
    loss_mask[-1] = 0.0
    return {
        "input_ids": tokens.unsqueeze(0),
        "position_ids": positions.unsqueeze(0),
        "attention_mask": mask.unsqueeze(0),  # [1, 1, L, L], True = masked
        "labels": labels.unsqueeze(0),
        "loss_mask": loss_mask,
    }


def reference_step(
    model: torch.nn.Module, documents: Sequence[np.ndarray]
) -> tuple[float, dict[str, torch.Tensor]]:
    """(per-token loss, every parameter's gradient) of one step over ``documents``, one at a time.

    Each document's loss sum is back-propagated divided by the batch's total loss-token count, so
    the accumulated gradient is that of ``sum(all token losses) / N``.
    """
    num_loss_tokens = sum(len(d) - 1 for d in documents)
    longest = max(len(d) for d in documents)
    cfg = model.config
    cpu_attention_scores_buffer(cfg.num_attention_heads * longest * longest)
    model.zero_grad(set_to_none=True)
    total = 0.0
    with cpu_megatron_training():  # device placement only (module docstring)
        total = _accumulate(model, documents, num_loss_tokens)
    grads = {
        n: (p.grad if p.grad is not None else torch.zeros_like(p)).detach().clone()
        for n, p in model.named_parameters()
    }
    return total / num_loss_tokens, grads


def _accumulate(model: torch.nn.Module, documents: Sequence[np.ndarray], num_loss_tokens: int):
    """Forward and backward of each document alone; returns the summed token loss."""
    total = 0.0
    for doc in documents:
        if len(doc) < 2:
            continue  # no token with a target: contributes neither loss nor gradient
        x = causal_inputs(doc)
        per_token = model(
            x["input_ids"], x["position_ids"], x["attention_mask"], labels=x["labels"]
        )
        loss_sum = (per_token.reshape(-1).float() * x["loss_mask"]).sum()
        (loss_sum / num_loss_tokens).backward()
        total += float(loss_sum.detach())
    return total


def bf16_reference_model(shape: ModelShape) -> torch.nn.Module:
    """``reference_model(shape)`` (the same seed, so the same weights) cast whole to bf16 as
    Megatron trains it: ``module.bfloat16()``, what megatron-core's ``Float16Module`` does."""
    return reference_model(shape).bfloat16()


def initial_weights(model: torch.nn.Module) -> dict[str, Any]:
    """The reference's initial parameters, by name: what the distributed HSP model loads."""
    return {n: p.detach().clone() for n, p in model.named_parameters()}
