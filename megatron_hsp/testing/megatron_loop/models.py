"""The models of both sides and what they share: Megatron's own argument parsing and globals, the
stock GPT model and HSP's pipeline chunks (built as ``training.get_model`` builds them), the
weight copy by unpipelined parameter name (``global_names``), DDP, optimizer and scheduler
(``_wrap``), each parameter's gradient out of the DDP buffers and the record of one step."""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch

from megatron_hsp.testing.megatron_loop.options import MODEL_FLAGS, LoopOptions


def _megatron_args(argv: list[str]) -> Any:
    """Megatron's own parse + validate on ``argv`` (``--hsp*`` flags added as users get them)."""
    from megatron.training.arguments import parse_args, validate_args

    from megatron_hsp.megatron.flags import hsp_extra_args_provider

    saved = sys.argv
    sys.argv = ["megatron-hsp-selftest", *argv]
    try:
        args = parse_args(extra_args_provider=hsp_extra_args_provider(None))
    finally:
        sys.argv = saved
    validate_args(args, {})
    return args


def _set_megatron_globals(args: Any) -> None:
    from megatron.training import global_vars

    global_vars.unset_global_variables()
    global_vars.set_global_variables(args, build_tokenizer=True)  # sets padded_vocab_size


def stock_builder() -> tuple[Callable[[Any], torch.nn.Module], str]:
    """Megatron's own GPT model builder, as a function of the parsed flags, and what it is.

    * Megatron-LM's ``gpt_builders.gpt_builder`` where a checkout is importable (found by
      ``layer_spec.megatron_lm_gpt_builders``, the one place that looks for it; HSP's base spec
      comes from the same module there);
    * else the megatron-core wheel's own builder (0.19 on): ``argument_utils.
      gpt_config_from_args`` then ``models.gpt.GPTModelBuilder.build_model``, the flags-to-model
      path the wheel ships for ``megatron/training``;
    * else (megatron-core 0.18, which ships neither) megatron-core's spec functions called
      with the options every Megatron-LM ``gpt_builder`` passes for the loop's flags (``--spec``,
      the MoE block spec with ``--qk-l2-norm``, the local layer spec): ``_spec_function_model``,
      checked against the wheel's builder on every option set by
      ``tests/testing/test_megatron_loop_models.py``.

    Each builds the whole unpipelined model (embedding and output layer: ``pre_process`` and
    ``post_process``); the CPU constraints stay the flags' (``--transformer-impl local``) and
    ``cpu_megatron_training``'s (megatron's own ``RotaryEmbedding``, its table kept on the CPU).
    """
    from megatron_hsp.megatron.layer_spec import megatron_lm_gpt_builders

    builders = megatron_lm_gpt_builders()
    if builders is not None and hasattr(builders, "gpt_builder"):

        def checkout(args: Any) -> torch.nn.Module:
            return builders.gpt_builder(args, True, True)

        return checkout, "Megatron-LM's gpt_builders.gpt_builder"
    try:
        from megatron.training.argument_utils import gpt_config_from_args
        from megatron.training.models.gpt import GPTModelBuilder
    except ImportError:
        return _spec_function_model, "megatron-core's spec functions (no builder in this wheel)"

    def wheel(args: Any) -> torch.nn.Module:
        from megatron.core.process_groups_config import ProcessGroupCollection

        groups = ProcessGroupCollection.use_mpu_process_groups()
        builder = GPTModelBuilder(gpt_config_from_args(args))
        return builder.build_model(groups, pre_process=True, post_process=True)

    return wheel, "megatron.training.models.gpt.GPTModelBuilder"


def _spec_function_model(args: Any) -> torch.nn.Module:
    """Where megatron-core ships no model builder (0.18): the stock GPTModel from megatron-core's
    spec functions with the options Megatron-LM's ``gpt_builder`` passes for these flags (a
    user's ``--spec``; with ``--num-experts`` the decoder block spec, ``--qk-l2-norm`` included;
    else the local layer spec, which takes no qk-l2-norm)."""
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_decoder_block_spec,
        get_gpt_layer_local_spec,
    )
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.spec_utils import import_module
    from megatron.training.arguments import core_transformer_config_from_args

    config = core_transformer_config_from_args(args)
    if args.transformer_impl != "local":
        raise RuntimeError("the loop's stock side runs --transformer-impl local only")
    if args.spec:
        spec = import_module(tuple(args.spec))
    elif args.num_experts:
        spec = get_gpt_decoder_block_spec(
            config, False, normalization=args.normalization, qk_l2_norm=args.qk_l2_norm
        )
    else:
        spec = get_gpt_layer_local_spec(
            qk_layernorm=config.qk_layernorm, normalization=args.normalization
        )
    return _gpt(GPTModel, config, spec, args)


def _stock_model(args: Any) -> torch.nn.Module:
    """Stock megatron-core GPTModel from the flags, built by Megatron's own builder
    (``stock_builder``), seeded with ``--seed``."""
    build, _ = stock_builder()
    torch.manual_seed(args.seed)
    return build(args)


def _hsp_model(args: Any) -> list[torch.nn.Module]:
    """The model chunks Megatron builds on this rank under ``--hsp`` (the spec layer_spec.py
    hands ``--spec``): one without a pipeline; under one, this stage's layers, one chunk per
    virtual stage, ``pre_process``/``post_process`` as ``training.get_model`` sets them."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.pipeline_parallel.utils import (
        is_pp_first_stage,
        is_pp_last_stage,
        is_vp_first_stage,
        is_vp_last_stage,
    )
    from megatron.training.arguments import core_transformer_config_from_args

    from megatron_hsp.megatron.layer_spec import hsp_spec_from_args
    from megatron_hsp.testing.cpu_shims import use_cpu_rotary

    config = core_transformer_config_from_args(args)
    spec = hsp_spec_from_args(args)
    group = parallel_state.get_pipeline_model_parallel_group()
    vp = args.virtual_pipeline_model_parallel_size
    chunks = []
    for i in range(vp) if vp else [None]:
        pre = is_pp_first_stage(group) and (i is None or is_vp_first_stage(i, vp))
        post = is_pp_last_stage(group) and (i is None or is_vp_last_stage(i, vp))
        model = _gpt(GPTModel, config, spec, args, pre_process=pre, post_process=post, vp_stage=i)
        chunks.append(use_cpu_rotary(model))
    return chunks


def _gpt(cls: Any, config: Any, spec: Any, args: Any, **stage: Any) -> torch.nn.Module:
    return cls(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        **stage,
    )


def global_names(module: torch.nn.Module) -> dict[str, str]:
    """Parameter name in ``module`` (a model chunk) -> its name in the unpipelined model.

    A pipeline stage numbers its layers from 0 (``decoder.layers.<i>``); megatron-core keeps
    each layer's global ``layer_number`` (1-based, ``get_transformer_layer_offset``), which is
    what maps it onto the stock model's layer. Other names (embedding, final norm, output
    layer) are the same on the stage that holds them."""
    out = {}
    for name, _ in module.named_parameters():
        parts = name.split(".")
        if parts[:2] == ["decoder", "layers"]:
            layer = module.decoder.layers[int(parts[2])]
            parts[2] = str(layer.layer_number - 1)
        out[name] = ".".join(parts)
    return out


def _chunk_parameters(modules: Sequence[torch.nn.Module]) -> dict[str, torch.nn.Parameter]:
    """This rank's parameters of every chunk by their unpipelined name (``global_names``)."""
    out = {}
    for module in modules:
        names = global_names(module)
        out.update({names[n]: p for n, p in module.named_parameters()})
    return out


def _load_weights(modules: Sequence[torch.nn.Module], init: dict[str, torch.Tensor]) -> None:
    """Copy ``init`` in by (unpipelined) parameter name; the HSP spec swaps only parameter-free
    attention modules, so both models must have the same names. Without a pipeline every
    parameter is here; with one, this stage's (``per_param_diff`` checks every parameter is
    on some stage)."""
    own = _chunk_parameters(modules)
    pipelined = len(modules) > 1 or not (
        getattr(modules[0], "pre_process", True) and getattr(modules[0], "post_process", True)
    )
    if sorted(own) != sorted(init) and (not pipelined or set(own) - set(init)):
        raise RuntimeError(
            f"HSP and stock models have different parameters: {sorted(set(own) ^ set(init))}"
        )
    with torch.no_grad():
        for name, param in own.items():
            param.copy_(init[name])


def _wrap(
    args: Any, module: torch.nn.Module | Sequence[torch.nn.Module]
) -> tuple[list[Any], Any, Any, Any]:
    """megatron-core DDP + Megatron's optimizer and scheduler, configured from ``args`` by
    Megatron's own helpers; plus the ``config`` hooks ``train()`` sets before its loop.
    ``module``: one model, or the chunks of a virtual pipeline (one DDP each, bucketing only
    for the first, as ``training.get_model`` does)."""
    from megatron.core.distributed import DistributedDataParallel, finalize_model_grads
    from megatron.core.optimizer import get_megatron_optimizer
    from megatron.core.utils import get_model_config
    from megatron.training.training import (
        get_megatron_ddp_config,
        get_megatron_optimizer_config,
        get_optimizer_param_scheduler,
    )

    modules = list(module) if isinstance(module, Sequence) else [module]
    config = get_model_config(modules[0])
    ddp_config = get_megatron_ddp_config(args)
    model = [
        DistributedDataParallel(config, ddp_config, m, disable_bucketing=i > 0)
        for i, m in enumerate(modules)
    ]
    opt_config, overrides = get_megatron_optimizer_config(args)
    optimizer = get_megatron_optimizer(
        opt_config,
        model,
        config_overrides=overrides,
        use_gloo_process_groups=args.use_gloo_process_groups,
    )
    scheduler = get_optimizer_param_scheduler(optimizer)
    # As train() does before its loop (megatron/training/training.py, "Setup some training
    # config params").
    config.grad_scale_func = optimizer.scale_loss
    if args.overlap_grad_reduce:
        config.no_sync_func = model[0].no_sync
        if args.align_grad_reduce:
            config.grad_sync_func = model[0].start_grad_sync
    config.finalize_model_grads_func = finalize_model_grads
    return model, optimizer, scheduler, config


def param_grads(model: Sequence[Any], distributed_optimizer: bool) -> dict[str, torch.Tensor]:
    """Each parameter's gradient as ``finalize_model_grads`` left it for the optimizer, by its
    unpipelined name (``global_names``), over this rank's DDP model chunks ``model``.

    The DDP gradient buffer is cut back into parameters with megatron-core's own
    ``param_index_map`` (``param -> (start, end, bucket_id)`` in the buffer). Under the
    distributed optimizer only this data-parallel rank's shard of each bucket is reduced
    (reduce-scatter): a parameter contributes the slice of its range inside that shard (empty
    when none is). Expert parameters (MoE under expert parallelism) sit in DDP's
    ``expert_parallel_buffers``, reduced and sharded over the expert-data-parallel group: each
    buffer's own group gives the shard size and this rank's place.
    """
    names = {p: n for n, p in _chunk_parameters([m.module for m in model]).items()}
    out: dict[str, torch.Tensor] = {}
    for buffer in (b for m in model for b in [*m.buffers, *m.expert_parallel_buffers]):
        dp = buffer.data_parallel_group.size()
        rank = buffer.data_parallel_group.rank()
        for param, (start, end, bucket_id) in buffer.param_index_map.items():
            lo, hi = start, end
            if distributed_optimizer:
                bucket = buffer.buckets[bucket_id]
                shard = bucket.grad_data.numel() // dp
                first = bucket.offset + rank * shard
                lo, hi = max(start, first), min(end, first + shard)
            grad = buffer.grad_data[lo:hi] if hi > lo else buffer.grad_data[:0]
            out[names[param]] = grad.detach().clone()
    if sorted(out) != sorted(names.values()):
        raise RuntimeError(f"parameters outside the DDP buffers: {set(names.values()) - set(out)}")
    return out


def _step_record(args: Any, out: tuple, scheduler: Any, optimizer: Any) -> dict[str, Any]:
    """Loss, lr, grad norm and consumed samples after one ``train_step``, as train() keeps them."""
    import megatron.training.training as training
    from megatron.core import parallel_state

    # (loss_reduced, skipped_iter, should_checkpoint, should_exit, exit_code, grad_norm, ...)
    reduced, grad_norm = out[0], out[5]
    # train(): args.consumed_train_samples += dp * micro_batch_size * get_num_microbatches()
    args.consumed_train_samples += (
        parallel_state.get_data_parallel_world_size()
        * args.micro_batch_size
        * training.get_num_microbatches()
    )
    loss = None
    if reduced and "lm loss" in reduced:
        value = reduced["lm loss"]  # train_step's data-parallel mean: sum / tokens
        loss = float(value[0] / value[1]) if value.numel() == 2 else float(value)
    lr = next(iter(optimizer.param_groups))["lr"]
    return {
        "loss": loss,
        "lr": float(lr),
        "grad_norm": None if grad_norm is None else float(grad_norm),
        "consumed_samples": int(args.consumed_train_samples),
        "scheduler_num_steps": int(scheduler.num_steps),
    }


def _initial_weights(options: LoopOptions) -> dict[str, torch.Tensor]:
    """The stock model's initial parameters (built from the stock flags, seeded); this rank's
    tensor-parallel shards under TP (``--use-cpu-initialization`` splits one master weight)."""
    args = _megatron_args([*MODEL_FLAGS, *options.flags()])
    _set_megatron_globals(args)
    module = _stock_model(args)
    return {n: p.detach().clone() for n, p in module.named_parameters()}
