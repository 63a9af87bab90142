"""What ``--hsp`` refuses: one function per Megatron feature HSP cannot run, each saying why,
collected in ``REFUSALS``, which ``config.validate_hsp_args`` walks before it derives anything.

Why one table: a feature refused in one place and forgotten in another is how a flag came to
fail on the first step instead of at argument time. Every refusal is an ``HSPArgsError`` that
names the flag and what would work; ``exit_on_refusal`` turns it into one line and exit 2.

This module imports neither torch nor Megatron: the flags can be checked anywhere.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from typing import Any

from megatron_hsp.planner.errors import InputError


class HSPArgsError(InputError):
    """A ``--hsp*`` flag (or a Megatron flag it conflicts with) that cannot be used as given."""


def arg_value(args: argparse.Namespace, name: str, default: Any = None) -> Any:
    """Megatron's value of ``name``, or ``default`` where the flag is absent or None (Megatron
    leaves many flags None until its ``validate_args`` fills them)."""
    value = getattr(args, name, default)
    return default if value is None else value


def kv_heads(args: argparse.Namespace) -> int | None:
    """Megatron's KV heads, read in this one place: ``--num-query-groups`` under
    ``--group-query-attention``, else every attention head is its own (None where the flags
    give no heads)."""
    heads = arg_value(args, "num_attention_heads", None)
    if getattr(args, "group_query_attention", False):
        return arg_value(args, "num_query_groups", heads)
    return heads


# Flags whose model is not a dense GPT layer spec with megatron-core SelfAttention, which is what
# ``with_hsp_attention`` rewrites (and what the exactness checks cover). Dense options carried
# through unchanged: --qk-layernorm, --qk-l2-norm, --normalization, --use-te-activation-func,
# --transformer-impl, --spec (the user's spec gets HSP attention swapped in).
_UNCARRIED_FEATURES: tuple[tuple[str, str, str], ...] = (
    (
        "mtp_num_layers",
        "--mtp-num-layers",
        "multi-token prediction (MTP layers keep their own "
        "attention and roll labels across packed documents)",
    ),
    ("multi_latent_attention", "--multi-latent-attention", "MLA attention"),
    (
        "experimental_attention_variant",
        "--experimental-attention-variant",
        "experimental attention variants",
    ),
    (
        "heterogeneous_layers_config_path",
        "--heterogeneous-layers-config-path",
        "heterogeneous layer configs",
    ),
)


# Megatron features that change how attention or a step runs in ways HSP's per-micro-batch groups
# do not follow (or that no check here covers yet): refused at argument time, one line each.
# (attribute, flag, why); a value of None, False, 0 or "none" means the feature is off.
_UNSUPPORTED_WITH_HSP: tuple[tuple[str, str, str], ...] = (
    ("fp8", "--fp8-format", "FP8 needs TE dims divisible by 16 per call, and HSP's packed "
     "buffers change size every micro-batch (unproven)"),
    ("fp4", "--fp4-format", "FP4, as FP8"),
    ("cuda_graph_impl", "--cuda-graph-impl", "CUDA graphs capture fixed shapes and process "
     "groups; HSP's change every micro-batch"),
    ("enable_cuda_graph", "--enable-cuda-graph", "CUDA graphs, as --cuda-graph-impl"),
    ("external_cuda_graph", "--external-cuda-graph", "CUDA graphs, as --cuda-graph-impl"),
    ("tp_comm_overlap", "--tp-comm-overlap", "TE's userbuffers are sized for one fixed "
     "sequence length; HSP's micro-batches vary"),
    ("use_megatron_fsdp", "--use-megatron-fsdp", "Megatron FSDP is not covered by HSP's "
     "gradient checks (selftest --megatron runs DDP and the distributed optimizer)"),
    ("use_torch_fsdp2", "--use-torch-fsdp2", "as --use-megatron-fsdp"),
    ("sft", "--sft", "Megatron's SFT dataset packs its own samples; HSP's sampler chooses "
     "whole documents per step"),
    ("dynamic_context_parallel", "--dynamic-context-parallel", "Megatron's own dynamic CP "
     "schedules context-parallel groups per step, as --hsp does: use one of them"),
    ("sequence_packing_scheduler", "--sequence-packing-scheduler", "Megatron's packing "
     "scheduler builds the micro-batches that HSP's planner builds: use one of them"),
    ("use_varlen_dataset", "--use-varlen-dataset", "Megatron dev's VarlenDataset packs its own "
     "THD batches (with a packing scheduler); HSP's sampler chooses whole documents per step"),
)  # fmt: skip


def _refuse_features_hsp_does_not_run(
    args: argparse.Namespace, table: tuple[tuple[str, str, str], ...] = _UNSUPPORTED_WITH_HSP
) -> None:
    """Refuse the first feature of ``table`` (attribute, flag, why) that is on."""
    for attr, flag, why in table:
        value = getattr(args, attr, None)
        if value in (None, False, 0, "none", ""):
            continue
        shown = "" if value is True else f" {value}"
        raise HSPArgsError(f"--hsp does not support {flag}{shown}: {why}; drop {flag} or --hsp")


def refuse_specs_hsp_cannot_carry(args: argparse.Namespace) -> None:
    """HSP replaces only megatron-core ``SelfAttention``; refuse models built another way."""
    for attr, flag, what in _UNCARRIED_FEATURES:
        value = getattr(args, attr, None)
        if value:
            raise HSPArgsError(
                f"--hsp does not support {flag} {value if value is not True else ''}".rstrip()
                + f": {what} cannot carry HSP attention; drop {flag} or --hsp"
            )
    impl = getattr(args, "transformer_impl", None)
    if impl not in (None, "local", "transformer_engine"):
        raise HSPArgsError(
            f"--hsp does not support --transformer-impl {impl}; use transformer_engine or local"
        )


# MoE under --hsp: dropless routing is per token, so it does not depend on how HSP
# packs and splits documents; these do, or are not covered by selftest --megatron (which runs
# dropless MoE, alltoall/allgather dispatchers, EP 1 and 2, seq_aux_loss and z-loss exactly).
# (attribute, flag, why); a value of None, False, 0 or "none" means the feature is off.
_MOE_UNSUPPORTED_WITH_HSP: tuple[tuple[str, str, str], ...] = (
    ("moe_expert_capacity_factor", "--moe-expert-capacity-factor", "token dropping keeps the "
     "top tokens of each micro-batch's expert queue, so what is dropped depends on which "
     "documents share a micro-batch and rank (in stock Megatron with CP or another batch size "
     "too); HSP's packing differs from any per-sample run: train dropless"),
    ("moe_pad_expert_input_to_capacity", "--moe-pad-expert-input-to-capacity", "capacity "
     "padding, as --moe-expert-capacity-factor"),
    ("moe_router_enable_expert_bias", "--moe-router-enable-expert-bias", "the expert-bias "
     "update counts every routed token, HSP's padding tokens included (not checked)"),
    ("moe_input_jitter_eps", "--moe-input-jitter-eps", "random per-token noise drawn over the "
     "micro-batch's shape: no other packing draws the same noise"),
    ("overlap_moe_expert_parallel_comm", "--overlap-moe-expert-parallel-comm", "its schedule "
     "plan runs two micro-batches interleaved; HSP's micro-batches run their own groups"),
    ("moe_shared_expert_overlap", "--moe-shared-expert-overlap", "not covered by selftest "
     "--megatron (shared experts run per token, but the overlap is CUDA-stream work)"),
)  # fmt: skip
_MOE_DISPATCHERS = ("alltoall", "allgather")
# Load-balancing types whose value depends on which tokens share a micro-batch (or, for
# global_aux_loss, on the running average over the step's micro-batches): HSP packs several
# documents per micro-batch where a per-sample run has one, so no HSP run equals it.
_MOE_BALANCING_HSP_CANNOT_MATCH: dict[str, str] = {
    "aux_loss": "the micro-batch-level aux loss counts experts over the whole micro-batch, "
    "which under HSP holds several documents (a per-sample run: one); use seq_aux_loss, which "
    "HSP computes per document over the ranks holding it, or coefficient 0",
    "global_aux_loss": "the global aux loss averages expert counts over the micro-batches "
    "seen so far, which differ under HSP; use seq_aux_loss or coefficient 0",
    "sinkhorn": "Sinkhorn balancing normalises over the micro-batch's tokens",
    "quantile_balancing": "quantile balancing fits its bias over the micro-batch's tokens",
}


def _as_list(value: Any) -> list[Any]:
    return list(value) if isinstance(value, (list, tuple)) else [value]


def refuse_moe_hsp_cannot_run(args: argparse.Namespace) -> None:
    """``--num-experts`` under ``--hsp``: refuse what is layout-dependent or unchecked."""
    experts = getattr(args, "num_experts", None)
    if not experts:
        return
    vpp = arg_value(args, "virtual_pipeline_model_parallel_size", None) or arg_value(
        args, "num_layers_per_virtual_pipeline_stage", None
    )
    if vpp and arg_value(args, "pipeline_model_parallel_size", 1) > 1:
        # Megatron's builder takes --spec as one value for every model chunk (no vp_stage), and
        # megatron-core's MoE block spec needs the chunk's virtual stage to place its layers.
        raise HSPArgsError(
            f"--hsp does not support --num-experts {experts} with virtual pipeline stages: the "
            "MoE block spec HSP hands Megatron's --spec cannot know each model chunk's stage; "
            "drop --virtual-pipeline-model-parallel-size / "
            "--num-layers-per-virtual-pipeline-stage (1F1B pipelines run)"
        )
    for flag, attr in (
        ("--tensor-model-parallel-size", "tensor_model_parallel_size"),
        ("--expert-tensor-parallel-size", "expert_tensor_parallel_size"),
    ):
        size = arg_value(args, attr, 1)
        if size > 1:
            raise HSPArgsError(
                f"--hsp does not support {flag} {size} with --num-experts: HSP's router "
                "losses see a rank's whole packed share, unsplit by tensor parallelism (not "
                f"checked with TP); use {flag} 1 or drop --hsp"
            )
    dispatcher = getattr(args, "moe_token_dispatcher_type", "allgather") or "allgather"
    if dispatcher not in _MOE_DISPATCHERS:
        raise HSPArgsError(
            f"--hsp does not support --moe-token-dispatcher-type {dispatcher}: only "
            f"{' and '.join(_MOE_DISPATCHERS)} are checked (the flex dispatcher needs DeepEP or "
            "HybridEP on GPUs, unproven here); use alltoall"
        )
    ep = arg_value(args, "expert_model_parallel_size", 1)
    if dispatcher == "allgather" and ep > 1:
        raise HSPArgsError(
            f"--hsp does not support --moe-token-dispatcher-type allgather with "
            f"--expert-model-parallel-size {ep}: its all-gather over the expert-parallel ranks "
            "needs every rank to hold as many tokens as the others, and HSP's ranks hold "
            "different counts; use alltoall"
        )
    _refuse_features_hsp_does_not_run(args, _MOE_UNSUPPORTED_WITH_HSP)
    types = _as_list(getattr(args, "moe_router_load_balancing_type", "aux_loss") or "none")
    coeffs = _as_list(getattr(args, "moe_aux_loss_coeff", 0.0) or 0.0)
    for i, kind in enumerate(types):
        coeff = coeffs[i] if i < len(coeffs) else coeffs[-1]
        why = _MOE_BALANCING_HSP_CANNOT_MATCH.get(kind)
        if why is None or (kind in ("aux_loss", "global_aux_loss") and not coeff):
            continue
        raise HSPArgsError(
            f"--hsp does not support --moe-router-load-balancing-type {kind}"
            + (f" with --moe-aux-loss-coeff {coeff:g}" if kind.endswith("aux_loss") else "")
            + f": {why}"
        )


# Hybrid layer pattern symbols (megatron-core ``hybrid_layer_allocation.Symbols``) and why HSP
# cannot run each under per-micro-batch groups. HSP replaces the attention layers' SelfAttention
# ("*") and leaves MLP layers ("-") alone; every other mixer sees its rank's shard of a packed
# micro-batch whose group changes every step.
_HYBRID_SYMBOLS_HSP_CANNOT_RUN: dict[str, str] = {
    "M": "Mamba layers scan the whole sequence in order; under HSP each rank holds a slice of "
    "the micro-batch's documents and the group changes every micro-batch (Mamba's own context "
    "parallelism is tied to Megatron's static CP group)",
    "G": "Gated DeltaNet layers are recurrent over the sequence, as Mamba",
    "D": "DSA (sparse) attention is not megatron-core SelfAttention, which is what HSP replaces",
    "+": "MLA attention is not megatron-core SelfAttention, which is what HSP replaces",
    "E": "hybrid MoE layers are not covered by HSP's checks (selftest --megatron runs MoE in "
    "GPT models only: --num-experts with pretrain_gpt.py)",
    "/": "multi-token prediction depths (as --mtp-num-layers)",
}


def refuse_hybrid_layers_hsp_cannot_run(args: argparse.Namespace) -> None:
    """``pretrain_hybrid.py --hybrid-layer-pattern``: only attention (*) and MLP (-) layers.

    Why at argument time: the layer spec is built inside the model build, long after the job
    started, and a Mamba layer would not fail there: it would train on each rank's shard of the
    sequence as if it were whole.
    """
    pattern = getattr(args, "hybrid_layer_pattern", None) or getattr(
        args, "hybrid_override_pattern", None
    )
    if pattern and not getattr(args, "spec", None):
        # pretrain_hybrid.py's builder requires --spec; with --hsp, layer_spec.py takes it as the
        # base and swaps HSP attention into its attention layers.
        raise HSPArgsError(
            f"--hsp with --hybrid-layer-pattern {pattern} needs the hybrid stack spec as --spec "
            "(e.g. --spec megatron.core.models.hybrid.hybrid_layer_specs hybrid_stack_spec): "
            "HSP swaps its attention into that spec's attention layers"
        )
    for attr, flag in (
        ("hybrid_layer_pattern", "--hybrid-layer-pattern"),
        ("hybrid_override_pattern", "--hybrid-override-pattern"),
        ("mtp_hybrid_override_pattern", "--mtp-hybrid-override-pattern"),
    ):
        pattern = getattr(args, attr, None)
        if not pattern:
            continue
        if attr == "mtp_hybrid_override_pattern":
            raise HSPArgsError(
                f"--hsp does not support {flag} {pattern}: multi-token prediction cannot carry "
                f"HSP attention; drop {flag} or --hsp"
            )
        for symbol, why in _HYBRID_SYMBOLS_HSP_CANNOT_RUN.items():
            if symbol in pattern:
                raise HSPArgsError(
                    f"--hsp does not support {symbol!r} in {flag} {pattern}: {why}; HSP runs "
                    "patterns of attention (*) and MLP (-) layers only, drop --hsp otherwise"
                )


def refuse_allgather_with_pipeline(args: argparse.Namespace) -> None:
    """MoE's allgather dispatcher with pipeline stages: HSP's stages need Megatron's
    ``variable_seq_lengths`` (a micro-batch's token count changes every micro-batch), which
    megatron-core's TransformerConfig refuses with the allgather dispatcher."""
    pp = arg_value(args, "pipeline_model_parallel_size", 1)
    dispatcher = getattr(args, "moe_token_dispatcher_type", None)
    if pp > 1 and dispatcher == "allgather" and getattr(args, "num_experts", None):
        raise HSPArgsError(
            f"--hsp with --pipeline-model-parallel-size {pp} needs Megatron's "
            "variable_seq_lengths, which megatron-core refuses with --moe-token-dispatcher-type "
            "allgather; pass --moe-token-dispatcher-type alltoall"
        )


def refuse_hybrid_context_parallel(args: argparse.Namespace) -> None:
    """Megatron's ``--hybrid-context-parallel`` schedules dynamic context-parallel groups, as
    HSP does: two schedulers would each form groups over the same ranks."""
    if getattr(args, "hybrid_context_parallel", False):
        raise HSPArgsError(
            "--hsp and --hybrid-context-parallel both schedule dynamic context-parallel groups; "
            "use one of them."
        )


def refuse_micro_batch_size(args: argparse.Namespace) -> None:
    """HSP packs whole documents into one THD micro-batch per group; the planner, not
    ``--micro-batch-size``, chooses how many documents go into each."""
    mbs = arg_value(args, "micro_batch_size", 1)
    if mbs != 1:
        raise HSPArgsError(
            f"--hsp packs whole documents into one THD micro-batch per group, so "
            f"--micro-batch-size must be 1 (got {mbs}); the planner chooses how many documents "
            "go into each micro-batch."
        )


def refuse_context_parallel(args: argparse.Namespace) -> None:
    """Megatron's static context parallelism: Megatron builds the model for its static
    context-parallel group (TE attention with cp_comm_type, RoPE split by CP rank), which HSP's
    attention does not use, so the model build fails. HSP's own groups already give sequence
    parallelism over the data ranks."""
    cp = arg_value(args, "context_parallel_size", 1)
    if cp > 1:
        raise HSPArgsError(
            f"--hsp does not support --context-parallel-size {cp}: HSP forms its own "
            "sequence-parallel groups over the data-parallel ranks every step. Use "
            "--context-parallel-size 1 (the same GPUs become HSP ranks), or drop --hsp."
        )


def refuse_attention_dropout(args: argparse.Namespace) -> None:
    """Attention dropout: refused rather than planned around, since ring and hybrid groups merge
    per-block softmax partials (no dropout mask can be drawn consistently across blocks), torch's
    varlen kernel has none, and the exactness checks need deterministic attention. Long-context
    recipes (e.g. Llama 3) train with 0; Megatron's default is 0.1."""
    dropout = arg_value(args, "attention_dropout", 0.0)
    if dropout > 0:
        raise HSPArgsError(
            f"--hsp does not support attention dropout (--attention-dropout {dropout:g}, "
            "Megatron's default is 0.1): HSP's ring/hybrid attention and torch's varlen kernel "
            "draw no dropout mask; pass --attention-dropout 0"
        )


def refuse_unsupported_features(args: argparse.Namespace) -> None:
    """The features of ``_UNSUPPORTED_WITH_HSP``, each with its own reason there."""
    _refuse_features_hsp_does_not_run(args, _UNSUPPORTED_WITH_HSP)


# Every refusal, in the order ``config.validate_hsp_args`` walks them (the first one that fires
# is the one line the user sees). Evaluation (--eval-iters) runs on planned batches of the
# validation/test splits, and Megatron's data flags are refused by ``datasets.py`` (installer).
REFUSALS: tuple[Callable[[argparse.Namespace], None], ...] = (
    refuse_allgather_with_pipeline,
    refuse_hybrid_context_parallel,
    refuse_micro_batch_size,
    refuse_context_parallel,
    refuse_attention_dropout,
    refuse_specs_hsp_cannot_carry,
    refuse_hybrid_layers_hsp_cannot_run,
    refuse_unsupported_features,
    refuse_moe_hsp_cannot_run,
)


def refuse_what_hsp_cannot_run(args: argparse.Namespace) -> None:
    """Walk ``REFUSALS``; the first feature HSP cannot run raises its ``HSPArgsError``."""
    for refuse in REFUSALS:
        refuse(args)


def exit_on_refusal(check: Callable[[], Any]) -> Any:
    """Run ``check``; an ``HSPArgsError`` becomes one line on stderr (rank 0) and exit 2.

    Why not the exception: raised inside Megatron's argument parsing it printed a ~20-frame
    traceback and exit 1 on every rank, where docs/integration.md promises one line naming the
    flag. Every rank exits 2 (the checks are deterministic: the same flags everywhere); only
    rank 0 prints, so a 1024-rank job says it once.
    """
    import sys

    try:
        return check()
    except InputError as exc:
        if launch_rank() == 0:
            print(f"megatron-hsp: error: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None


def launch_rank(env: dict[str, str] | None = None) -> int:
    """This process's global rank as its launcher set it, before torch.distributed exists:
    torchrun's ``RANK``, else Slurm's ``SLURM_PROCID`` (``srun`` starting one rank per task, as
    Megatron's own sbatch examples do), else 0 (one process)."""
    env = os.environ if env is None else env
    for name in ("RANK", "SLURM_PROCID"):
        value = env.get(name, "").strip()
        if value.isdigit():
            return int(value)
    return 0
