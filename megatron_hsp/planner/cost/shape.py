"""The one type that says what a transformer is shaped like: ``TransformerShape``.

Every cost builder reads it: ``first_principles`` (the whole dense model on every GPU: the Llama
presets, a cost-model spec's ``model`` section, the default model Megatron's flags describe) and
``parallel`` (one pipeline stage under TP, PP and EP, dense or MoE). One frozen dataclass, so a
preset, a spec and Megatron's flags that describe the same model compare equal.

``head_dim`` left out is ``hidden // heads`` (GPT / Llama; ``qk_dim`` reads the dim in effect),
which is what a spec's ``model`` section means; Qwen3 (head dim 128 at hidden 2048, 32 heads) and
MLA (Q/K 192, V 128) name theirs.
Torch-free, at the cost model's floor: it imports only the planner's errors and ``moe``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from megatron_hsp.planner.cost.moe import MoEConfig
from megatron_hsp.planner.errors import InputError


class ActivationLayout(Protocol):
    """What ``activation_bytes`` reads of ``first_principles.TrainingConfig`` (a protocol, so
    this floor does not import the builder that imports it)."""

    activation_bytes: float
    recompute: bool
    recompute_method: str
    recompute_num_layers: int
    recompute_modules: tuple[str, ...]


# The keys of a cost-model spec's ``model`` section (``load_cost_model``): a dense model whose
# head dim is hidden / heads unless ``head_dim`` says otherwise (Megatron's ``--kv-channels``).
# The format predates the MoE fields.
SPEC_KEYS = (
    "name",
    "layers",
    "hidden",
    "heads",
    "kv_heads",
    "head_dim",
    "ffn_hidden",
    "vocab",
    "gated",
    "tied_embeddings",
)


@dataclass(frozen=True)
class TransformerShape:
    """A decoder-only transformer, dense or MoE. ``head_dim`` None: ``hidden // heads`` (then
    ``hidden`` must divide by ``heads``); ``v_head_dim`` None: the Q/K head dim. Read the dims in
    effect as ``qk_dim`` and ``v_dim``."""

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn_hidden: int  # the dense layers' FFN width
    vocab: int
    head_dim: int | None = None  # None: hidden // heads (``qk_dim`` is the one in effect)
    v_head_dim: int | None = None
    gated: bool = True  # SwiGLU: three FFN matrices instead of two
    tied_embeddings: bool = False
    moe: MoEConfig | None = None
    # MLA and other attentions whose projection weights are not Q, K, V, O of these heads.
    attn_params_per_layer: int | None = None

    def __post_init__(self) -> None:
        for key in ("layers", "hidden", "heads", "kv_heads", "ffn_hidden", "vocab"):
            if int(getattr(self, key)) <= 0:
                raise InputError(
                    f"model.{key} must be a positive integer, got {getattr(self, key)}"
                )
        if self.head_dim is None:
            if self.hidden % self.heads:
                raise InputError(
                    f"model.hidden {self.hidden} is not divisible by heads {self.heads}"
                )
        elif int(self.head_dim) <= 0:
            raise InputError(f"model.head_dim must be a positive integer, got {self.head_dim}")
        if self.heads % self.kv_heads:
            raise InputError(
                f"model.heads {self.heads} is not a multiple of kv_heads {self.kv_heads}"
            )
        if self.moe is not None and self.moe.dense_layers > self.layers:
            raise InputError("moe.dense_layers exceeds the layer count")

    @classmethod
    def from_spec(cls, section: Mapping[str, Any], name: str) -> TransformerShape:
        """A cost-model spec's ``model`` section (``SPEC_KEYS``); ``name`` unless it names one."""
        unknown = sorted(set(section) - set(SPEC_KEYS))
        if unknown:
            raise InputError(
                f"cost model spec: unknown model keys {unknown}; allowed: {sorted(SPEC_KEYS)}"
            )
        try:
            return cls(**{"name": name, **dict(section)})
        except TypeError as exc:
            raise InputError(f"cost model spec: model section: {exc}") from None

    @property
    def qk_dim(self) -> int:
        """The Q/K head dim in effect. Derived on each read (not stored), so that
        ``dataclasses.replace(shape, hidden=...)`` of a shape without ``head_dim`` derives it
        again rather than keeping the old one."""
        return self.head_dim or self.hidden // self.heads

    @property
    def v_dim(self) -> int:
        return self.v_head_dim or self.qk_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.qk_dim

    @property
    def moe_layers(self) -> int:
        return 0 if self.moe is None else self.layers - self.moe.dense_layers

    def attn_params(self) -> int:
        if self.attn_params_per_layer is not None:
            return self.attn_params_per_layer
        h, hd, vd = self.hidden, self.qk_dim, self.v_dim
        return h * (self.heads * hd + self.kv_heads * (hd + vd)) + self.heads * vd * h

    def dense_ffn_params(self) -> int:
        return (3 if self.gated else 2) * self.hidden * self.ffn_hidden

    def embedding_params(self) -> int:
        return self.vocab * self.hidden * (1 if self.tied_embeddings else 2)

    def stage_layers(self, pp: int) -> tuple[int, int]:
        """(dense, MoE) layers of the heaviest stage: ceil(layers / pp), MoE layers first."""
        n = math.ceil(self.layers / pp)
        moe = min(n, self.moe_layers)
        return n - moe, moe

    def params(self, pp: int = 1) -> tuple[float, float]:
        """(non-expert, routed-expert) weights of the heaviest stage, embeddings included:
        per layer attention, two norms and the FFN, a final norm, embeddings (+ output)."""
        dense, moe = self.stage_layers(pp)
        h = self.hidden
        base = (dense + moe) * (self.attn_params() + 2 * h) + dense * self.dense_ffn_params()
        expert = 0.0
        if self.moe is not None:
            base += moe * self.moe.shared_params(h)
            expert = float(moe * self.moe.expert_params(h))
        # Embedding on the first stage, output layer on the last: both counted (conservative).
        return float(base + self.embedding_params() + h), expert

    def num_params(self) -> float:
        """Every weight of the whole model."""
        base, expert = self.params(1)
        return base + expert

    def active_params_b(self) -> float:
        """Weights one token touches in the whole model (billions), for reports."""
        h = self.hidden
        per = self.layers * (self.attn_params() + 2 * h)
        per += (self.layers - self.moe_layers) * self.dense_ffn_params()
        if self.moe is not None:
            per += self.moe_layers * self.moe.active_params(h)
        return (per + self.embedding_params() + h) / 1e9

    def total_params_b(self) -> float:
        return self.num_params() / 1e9

    def linear_flops_per_token(self, pp: int = 1) -> float:
        """Training FLOPs (fwd + bwd) of the heaviest stage's token-linear matmuls, per token.

        Megatron-LM ``num_floating_point_operations`` (megatron/training/training.py): 2 FLOPs
        per multiply-add, backward = 2x forward, so 6 * (weights touched per token): QKV and
        output projections, FFN (3 matrices with SwiGLU, the active experts under MoE), and the
        logit layer.
        """
        dense, moe = self.stage_layers(pp)
        per = (dense + moe) * self.attn_params() + dense * self.dense_ffn_params()
        flops = 6.0 * (per + self.hidden * self.vocab)
        if self.moe is not None:
            flops += moe * self.moe.ffn_flops_per_token(self.hidden)
        return flops

    def attn_flops_per_token2(self, pp: int = 1) -> float:
        """Training FLOPs of causal core attention per token^2 of one sequence.

        Same Megatron-LM source: per layer ``3 (fwd+bwd) * 2 (FMA) * heads * head_dim / 2
        (causal) * 2 (QK^T and PV)``, the PV half at the V head dim. K/V heads do not enter:
        every query head attends over the full sequence whether or not its KV head is shared.
        """
        n = sum(self.stage_layers(pp))
        return 3.0 * n * self.heads * (self.qk_dim + self.v_dim)

    def activation_bytes(self, training: ActivationLayout, pp: int = 1) -> tuple[float, float]:
        """(layers, output head) activation bytes one token keeps alive until its backward pass,
        on the heaviest stage of one slot (before TP splits it).

        Per layer (no recompute), following Korthikanti et al. 2022 ("Reducing Activation
        Recomputation in Large Transformer Models", sec. 4) with flash attention (no s^2
        scores), no dropout (Llama) and GQA/SwiGLU shapes: norm-1 input h, QKV input h, Q/K/V,
        attention output, softmax log-sum-exp (fp32, one per head), norm-2 input h, FC1 input h,
        FC1 output (2F gated / F), activation output F; MoE FFNs from
        ``MoEConfig.activation_bytes_per_token``. With full recompute a layer keeps only its
        input h, plus one layer's full set (the largest) while it is recomputed. The head: the
        logits in bf16 and the fp32 softmax that Megatron's cross-entropy keeps (6 * vocab).

        Partial recompute as Megatron's ``TransformerBlock._checkpointed_forward`` runs it:
        ``uniform`` with chunks of N layers keeps each chunk's input and, while one chunk is
        recomputed, its N layers' full sets; ``block`` with N keeps the input of the stage's
        first N layers and the full sets of the others (whose backward frees them before the
        first N are recomputed). Selective recompute drops, in every layer, what its modules
        would keep: ``core_attn`` the attention's log-sum-exp (its Q/K/V and output stay alive
        as the projections' saved tensors), ``layernorm`` the two norms' outputs, ``mlp`` the
        FC1 and activation outputs.
        """
        e, h, f = training.activation_bytes, self.hidden, self.ffn_hidden
        mods = getattr(training, "recompute_modules", ())
        qkv = self.heads * self.qk_dim + self.kv_heads * (self.qk_dim + self.v_dim)
        norm = 0.0 if "layernorm" in mods else e * h
        lse = 0.0 if "core_attn" in mods else 4.0 * self.heads
        attn = e * h + norm + e * (qkv + self.heads * self.v_dim) + lse
        fc = 0.0 if "mlp" in mods else e * (f * (2 if self.gated else 1) + f)
        dense_ffn = e * h + norm + fc
        moe_ffn = self.moe.activation_bytes_per_token(h, e) if self.moe is not None else 0.0
        dense, moe = self.stage_layers(pp)
        head = 6.0 * self.vocab + e * h
        if not training.recompute:
            return dense * (attn + dense_ffn) + moe * (attn + moe_ffn), head
        full_dense, full_moe = attn + dense_ffn, attn + moe_ffn
        biggest = full_moe if moe else full_dense
        n = dense + moe
        chunk = int(getattr(training, "recompute_num_layers", 1))
        if getattr(training, "recompute_method", "uniform") == "uniform":
            chunk = max(1, chunk)
            return math.ceil(n / chunk) * e * h + min(chunk, n) * biggest, head
        k = min(
            max(0, chunk), n
        )  # block: the stage's first k layers (MoE layers first, stage_layers)
        k_moe = min(k, moe)
        kept = k * e * h + (moe - k_moe) * full_moe + (dense - (k - k_moe)) * full_dense
        return max(kept, k * e * h + biggest if k else 0.0), head
