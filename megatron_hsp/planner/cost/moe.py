"""Mixture-of-experts layers as the planner prices them: active FLOPs, expert memory, EP dispatch.

A MoE layer replaces the dense FFN by a router over ``experts`` experts of width ``expert_ffn``,
of which each token visits ``top_k``, plus optional always-on shared experts (DeepSeek). For the
planner three things change (``parallel.model_parallel_cost_model`` uses them):

- **Compute** is that of the *active* parameters: ``top_k`` experts plus the shared ones plus the
  router, per token (``ffn_flops_per_token``); it is linear in tokens, so the cost model stays
  separable (it adds to ``linear_ms_per_token``). Routing is assumed balanced (no capacity
  factor, no dropped tokens): the slowest expert rank is what an unbalanced step waits for, so
  this is optimistic for every method alike.
- **Memory**: all experts' weights sit on the ``ep`` expert-parallel ranks (``expert_params``
  / ``ep``, further split by TP: Megatron's expert tensor parallelism defaults to TP), their
  optimizer states sharded over the expert-data-parallel ranks (plane / ep); activations per token
  grow with ``top_k`` (each routed copy keeps its expert input and FC1 output).
- **Dispatch**: per MoE layer and pass, an all-to-all sends each token's ``top_k`` copies of its
  hidden state to the experts' ranks and one brings them back (Megatron's ``alltoall`` token
  dispatcher), ``(ep - 1) / ep`` of them leaving the rank with balanced routing
  (``dispatch_bytes_per_token``). It does not depend on which sequence-parallel group a token's
  sequence is in, so it is a per-token term too, the same for every plan of a batch: it moves
  every method's step time alike and changes which group sizes win only through the rest of
  the model.

Presets (sizes from the public Hugging Face ``config.json`` of each model):

- ``Qwen/Qwen3-30B-A3B``: 48 layers, hidden 2048, 32 query / 4 KV heads of dim 128, 128 experts
  of width 768, 8 per token, no shared experts, every layer MoE (``decoder_sparse_step`` 1,
  ``mlp_only_layers`` []), vocab 151936, untied embeddings.
- ``deepseek-ai/DeepSeek-V2-Lite``: 27 layers, hidden 2048, 16 heads with MLA
  (``q_lora_rank`` null, ``kv_lora_rank`` 512, ``qk_nope_head_dim`` 128, ``qk_rope_head_dim``
  64, ``v_head_dim`` 128), 64 routed experts of width 1408, 6 per token, 2 shared experts of
  width 1408, the first layer dense (``first_k_dense_replace`` 1, ``intermediate_size`` 10944),
  vocab 102400. MLA is priced after its up-projection, as Megatron's MLA attention runs: 16
  query and 16 KV heads with Q/K dim 192 (128 + 64 RoPE) and V dim 128.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_hsp.planner.errors import InputError


@dataclass(frozen=True)
class MoEConfig:
    """The MoE part of a model: routed and shared experts and which layers have them."""

    experts: int
    top_k: int
    expert_ffn: int  # width of one routed expert's FFN
    shared_ffn: int = 0  # total width of the shared experts (0: none)
    dense_layers: int = 0  # leading layers with a dense FFN (DeepSeek's first_k_dense_replace)
    gated: bool = True  # SwiGLU experts: three matrices

    def __post_init__(self) -> None:
        for key in ("experts", "top_k", "expert_ffn"):
            if int(getattr(self, key)) < 1:
                raise InputError(f"moe.{key} must be >= 1, got {getattr(self, key)}")
        if self.top_k > self.experts:
            raise InputError(f"moe.top_k {self.top_k} exceeds the {self.experts} experts")
        if self.shared_ffn < 0 or self.dense_layers < 0:
            raise InputError("moe.shared_ffn and moe.dense_layers must be >= 0")

    @property
    def matrices(self) -> int:
        return 3 if self.gated else 2

    def expert_params(self, hidden: int) -> int:
        """Routed experts' weights of one MoE layer (all experts)."""
        return self.experts * self.matrices * hidden * self.expert_ffn

    def shared_params(self, hidden: int) -> int:
        """Shared experts' and router weights of one MoE layer (on every rank, TP-split)."""
        return self.matrices * hidden * self.shared_ffn + hidden * self.experts

    def active_params(self, hidden: int) -> int:
        """Weights one token touches in one MoE layer: top_k experts, shared experts, router."""
        return self.top_k * self.matrices * hidden * self.expert_ffn + self.shared_params(hidden)

    def ffn_flops_per_token(self, hidden: int) -> float:
        """Training FLOPs (fwd + bwd: 6 per weight touched) of one MoE layer per token."""
        return 6.0 * self.active_params(hidden)

    def activation_bytes_per_token(self, hidden: int, elem_bytes: float) -> float:
        """Activations one MoE layer keeps per token until backward (no recompute).

        Norm-2 input, the router's input and fp32 probabilities, then per routed copy its
        permuted input, FC1 output (2F gated) and activation output (F); the shared experts'
        the same at their width.
        """
        fe, fs = self.expert_ffn, self.shared_ffn
        per_copy = hidden + (2 * fe if self.gated else fe) + fe
        shared = (hidden + (2 * fs if self.gated else fs) + fs) if fs else 0
        return elem_bytes * (2 * hidden + self.top_k * per_copy + shared) + 4.0 * self.experts

    def dispatch_bytes_per_token(self, hidden: int, elem_bytes: float, ep: int) -> float:
        """Bytes one token's routed copies send off its rank in one all-to-all (one way)."""
        return self.top_k * hidden * elem_bytes * (ep - 1) / ep


# Qwen/Qwen3-30B-A3B config.json: num_experts 128, num_experts_per_tok 8,
# moe_intermediate_size 768, decoder_sparse_step 1, mlp_only_layers [].
QWEN3_30B_A3B_MOE = MoEConfig(experts=128, top_k=8, expert_ffn=768)
# deepseek-ai/DeepSeek-V2-Lite config.json: n_routed_experts 64, num_experts_per_tok 6,
# moe_intermediate_size 1408, n_shared_experts 2, first_k_dense_replace 1.
DEEPSEEK_V2_LITE_MOE = MoEConfig(
    experts=64, top_k=6, expert_ffn=1408, shared_ffn=2 * 1408, dense_layers=1
)

__all__ = ["DEEPSEEK_V2_LITE_MOE", "QWEN3_30B_A3B_MOE", "MoEConfig"]
