"""Device-placement shims that let stock megatron-core modules run on the CPU (tests, selftest,
demo). Each one only changes WHERE a tensor megatron-core allocates lives; none changes what is
computed. They are listed in the patch table of ``megatron_hsp/megatron/patches.py``.

This module imports nothing from ``megatron_hsp``: the selftest's independent reference
(``testing/reference.py``) uses it, and must not reach HSP code through it.

* ``use_cpu_rotary``: megatron-core 0.19.2's ``RotaryEmbedding.get_emb`` moves ``inv_freq`` to
  ``torch.cuda.current_device()`` unconditionally on first use, so a CPU ``GPTModel`` with RoPE
  cannot run forward. The class of those instances is swapped for a subclass computing the
  identical table on the model's device (instance level, no global patch).
* ``cpu_attention_scores_buffer``: megatron-core's ``DotProductAttention`` (the local spec's core
  attention) takes its ``[b*np, sq, sk]`` score buffer from ``parallel_state``'s global memory
  buffer, which allocates on ``torch.cuda.current_device()``. Pre-allocating that named buffer on
  the CPU, large enough for every call, makes megatron's own ``get_tensor`` hand out CPU views.
"""

from __future__ import annotations

import torch


def cpu_rotary_embedding_class() -> type:
    """A megatron ``RotaryEmbedding`` whose table stays on the CPU (see the module docstring)."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    class CpuRotaryEmbedding(RotaryEmbedding):
        def get_emb(self, max_seq_len: int, offset: int = 0) -> torch.Tensor:
            freqs = self.get_freqs_non_repeated(max_seq_len, offset)
            if not self.rotary_interleaved:
                emb = torch.cat((freqs, freqs), dim=-1)
            else:
                emb = torch.stack((freqs.view(-1, 1), freqs.view(-1, 1)), dim=-1).view(
                    freqs.shape[0], -1
                )
            return emb[:, None, None, :]

    return CpuRotaryEmbedding


def use_cpu_rotary(model: torch.nn.Module) -> torch.nn.Module:
    """Make a CPU-built ``GPTModel``'s RoPE usable without CUDA (instance-level, no global patch).

    Only for CPU runs (tests, selftest, demo); on CUDA megatron's own class is kept.
    """
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    for module in model.modules():
        if type(module) is RotaryEmbedding:
            module.__class__ = cpu_rotary_embedding_class()
    return model


def cpu_attention_scores_buffer(numel: int, dtype: torch.dtype = torch.float32) -> None:
    """Give megatron's ``DotProductAttention`` a CPU score buffer of at least ``numel`` elements.

    ``numel`` must cover ``batch * heads_per_partition * seq_len**2`` of the largest call (a
    smaller buffer would make megatron allocate a new one on CUDA). Only for models that run on
    the CPU; must be called again after ``parallel_state`` is re-initialised (that drops it).
    """
    from megatron.core import parallel_state

    buffers = parallel_state.get_global_memory_buffer().buffer
    current = buffers.get(("mpu", dtype))
    if current is None or current.numel() < numel:
        buffers[("mpu", dtype)] = torch.empty(numel, dtype=dtype, device="cpu")
