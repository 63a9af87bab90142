"""Every monkeypatch megatron-hsp applies to Megatron-LM, in one place.

Seams come first (``hooks.py``: dataset provider, forward step, layer spec via ``--spec``, flags via
``extra_args_provider``). What is left has no seam in Megatron-LM's ``megatron/training``:

=================================================  ===============================================
replaced attribute                                 why
=================================================  ===============================================
``megatron.training.training.train_step``          ``train()`` has no per-step callback; HSP must
                                                   fetch and dispatch the step's plan before the
                                                   schedule pulls micro-batches, and measure the
                                                   step (and, for the online refit, mark the end
                                                   of its micro-batches: the schedule's return,
                                                   or earlier ``config.finalize_model_grads_func``
                                                   wrapped for the call and restored). It also
                                                   hands the schedule the plan's
                                                   micro-batch count: ``train_step``'s own
                                                   ``forward_backward_func`` argument is wrapped
                                                   to pass ``num_microbatches`` from the plan.
                                                   ``get_num_microbatches`` itself is NOT patched,
                                                   so the LR scheduler increment and
                                                   ``consumed_train_samples`` keep Megatron's
                                                   count (``--global-batch-size``, see
                                                   docs/integration.md).
``megatron.training.training.``                    ``evaluate()`` has no per-batch callback either:
``get_forward_backward_func``                      the schedule it returns is wrapped so that a
                                                   call with HSP's validation/test iterator
                                                   first prepares that split's next batch (its own
                                                   sampler, its plan, dispatch) and runs the
                                                   plan's micro-batch count instead of
                                                   ``eval_global_batch_size / (mbs x dp)``.
                                                   Any other iterator (training: ``train_step``'s
                                                   patch) passes through unchanged.
``megatron.training.training.``                    ``--log-throughput`` and the FLOPs total
``num_floating_point_operations``                   ``train()`` keeps count Megatron's model FLOPs
                                                   of a step with ``batch_size x --seq-length``
                                                   tokens, each sample one causal sequence of
                                                   ``--seq-length``; an ``--hsp`` step trains
                                                   other documents (their number and lengths
                                                   vary), so its TFLOP/s/GPU was wrong. Under
                                                   ``--hsp``, after a step, the count is
                                                   Megatron's own formula on the documents that
                                                   step trained (sum of lengths, sum of squared
                                                   lengths: causal attention per document,
                                                   ``hooks.document_flops``); otherwise, and
                                                   outside a step, unchanged.
``megatron.training.arguments.parse_and_validate_args``  launcher only (unchanged scripts): adds the
                                                   ``--hsp*`` flags to the script's own
                                                   ``extra_args_provider`` and validates them after
                                                   Megatron's own validation.
``megatron.training.pretrain`` and                 launcher only: swaps the script's dataset
``megatron.training.training.pretrain``            provider and forward step for HSP's when
                                                   ``--hsp`` is on (the patched ``pretrain_gpt.py``
                                                   does this itself instead).
``RotaryEmbedding`` instances of a CPU-built model  CPU runs only (selftest, demo, tests):
(``testing.cpu_shims.use_cpu_rotary``)             megatron-core 0.19.2's ``get_emb`` always moves
                                                   its table to CUDA. The class of those instances
                                                   is swapped for a subclass that keeps the
                                                   table on the model's device; no global patch,
                                                   never applied on CUDA.
``parallel_state``'s global memory buffer ``mpu``  CPU selftest reference only: megatron-core's
(``testing.cpu_shims.cpu_attention_scores_buffer``)  ``DotProductAttention`` takes its score
                                                   buffer from it, allocated on CUDA; it is
                                                   pre-allocated on the CPU instead (megatron's
                                                   own ``get_tensor`` then hands out CPU views).
``torch.cuda.current_device``/``Stream``/          ``selftest --megatron`` only, inside
``current_stream``/``stream``/``synchronize``/     ``testing.cpu_shims.cpu_megatron_training``
``empty_cache``/``get_rng_state``; tensor          (a ``TorchFunctionMode``, restored on exit,
factories' ``device=``, ``Tensor.cuda``,           refused where CUDA exists): Megatron's DDP,
``Tensor.type()``                                  optimizer and ``train_step`` allocate on CUDA
                                                   unconditionally; those tensors go to the CPU,
                                                   streams/syncs are no-ops, and ``type()`` names
                                                   the CPU float type ``torch.cuda.FloatTensor``
                                                   for ``clip_grad_by_total_norm_fp32``'s assert;
                                                   ``save_checkpoint`` records the CPU generator
                                                   as the device's (``get_rng_state``).
                                                   Placement only: no result or logic changes.
``DistributedOptimizer.load_state_dict`` and       ``selftest --megatron``'s resume only, around
``._set_main_param_and_optimizer_states``          Megatron's ``load_checkpoint`` (``testing.
(``testing.cpu_shims.                              cpu_shims.torch_adam_distributed_optimizer_
torch_adam_distributed_optimizer_load``)           load``; refused where CUDA, TE or Apex exist):
                                                   megatron-core 0.19.2's legacy distributed-
                                                   optimizer load into torch's Adam (no TE/Apex
                                                   ``FusedAdam``) shares one ``step`` tensor over
                                                   all parameters (Adam then counts it once per
                                                   parameter), looks up a ``step`` the file does
                                                   not hold, and ``copy_``s into fp32 views of
                                                   leaf parameters outside ``no_grad``. Each
                                                   parameter gets its own ``step``, the missing
                                                   one is skipped, the copy runs in ``no_grad``:
                                                   every loaded value is the checkpoint's.
``token_dispatcher.maybe_move_tensor_to_cpu``      ``selftest --megatron`` only, inside
(megatron-core MoE; ``testing.cpu_shims.           ``cpu_megatron_training``: megatron-core's
_cpu_dtoh``)                                       version converts only CUDA tensors to numpy,
                                                   and the alltoall dispatcher then hands CPU
                                                   tensors to ``all_to_all_single`` as split
                                                   sizes, which torch refuses; CPU tensors asked
                                                   ``as_numpy`` become numpy as CUDA ones would.
                                                   Null streams compare equal and record null
                                                   events (its side-stream bookkeeping).
                                                   Placement only.
``megatron.training.arguments``'s                  ``selftest --megatron`` only, while it parses
``get_device_arch_version``                        flags (``testing.cpu_shims.
(``testing.cpu_shims.cpu_device_arch_version``)    cpu_device_arch_version``): ``validate_args``
                                                   queries ``cuda:0``'s architecture when TP > 1;
                                                   on the CPU it answers 9 (Hopper), the branch
                                                   that requires CUDA_DEVICE_MAX_CONNECTIONS=1.
=================================================  ===============================================

Each patch checks that the attribute exists and that its parameters have the names HSP binds by
(``check_parameters``; an unknown shape is refused naming the Megatron version), records the
original, and is undone by ``remove_patches`` (tests). Without ``--hsp`` every patched function
behaves exactly like the original.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from megatron_hsp.planner.errors import HSPError


@dataclass(frozen=True)
class Patch:
    module: str
    attribute: str
    why: str


TRAINING_PATCHES = (
    Patch(
        "megatron.training.training",
        "train_step",
        "per-step hook: plan, dispatch, the plan's micro-batch count, measure (and refit)",
    ),
    Patch(
        "megatron.training.training",
        "get_forward_backward_func",
        "per-evaluation-batch hook: plan, dispatch, the plan's micro-batch count",
    ),
    Patch(
        "megatron.training.training",
        "num_floating_point_operations",
        "--log-throughput and the FLOPs total: count the documents the step trained",
    ),
)
LAUNCHER_PATCHES = (
    Patch(
        "megatron.training.arguments",
        "parse_and_validate_args",
        "add --hsp* flags and validate them (unchanged scripts)",
    ),
    Patch("megatron.training", "pretrain", "swap in HSP's dataset provider and forward step"),
    Patch(
        "megatron.training.training",
        "pretrain",
        "swap in HSP's dataset provider and forward step",
    ),
)
ALL_PATCHES = TRAINING_PATCHES + LAUNCHER_PATCHES

_originals: dict[tuple[str, str], Any] = {}

# Parameters each patched function must have, by name: the wrappers bind arguments by name, never
# by position, so a release that reorders them still works and one that renames them is refused.
REQUIRED_PARAMETERS: dict[str, tuple[str, ...]] = {
    "train_step": ("forward_backward_func",),
    "pretrain": ("train_valid_test_dataset_provider", "forward_step_func"),
    "parse_and_validate_args": ("extra_args_provider",),
    "num_floating_point_operations": ("args", "batch_size"),
}


def megatron_version() -> str:
    """megatron-core's version string (what error messages name), or ``unknown``."""
    try:
        from megatron.core.package_info import __version__

        return str(__version__)
    except Exception:
        return "unknown"


def check_parameters(patch: Patch, func: Any) -> inspect.Signature:
    """The signature of ``func``; refuses one without the parameters HSP binds by name."""
    try:
        sig = inspect.signature(func)
    except (TypeError, ValueError) as exc:
        raise HSPError(
            f"cannot read the signature of {patch.module}.{patch.attribute} "
            f"(megatron-core {megatron_version()}); megatron-hsp binds its arguments by name"
        ) from exc
    missing = [n for n in REQUIRED_PARAMETERS.get(patch.attribute, ()) if n not in sig.parameters]
    if missing:
        raise HSPError(
            f"{patch.module}.{patch.attribute}{sig} of megatron-core {megatron_version()} has no "
            f"parameter {', '.join(missing)}, which megatron-hsp rebinds ({patch.why}); use a "
            "Megatron-LM version listed in patches/README.md"
        )
    return sig


def _apply(patch: Patch, make: Callable[[Any], Any]) -> None:
    key = (patch.module, patch.attribute)
    if key in _originals:
        return  # idempotent: install() may be called by both the launcher and a patched script
    try:
        module = importlib.import_module(patch.module)
    except ImportError as exc:
        missing = getattr(exc, "name", None) or ""
        if missing and not missing.startswith("megatron"):  # e.g. torch: not the checkout
            raise HSPError(
                f"Megatron-LM's {patch.module} does not import: {exc}; install {missing} "
                "or run in the environment that has it"
            ) from exc
        raise HSPError(
            f"megatron-hsp needs Megatron-LM's {patch.module} (not part of the megatron-core "
            "wheel): run from a Megatron-LM checkout or put it on PYTHONPATH"
        ) from exc
    if not hasattr(module, patch.attribute):
        raise HSPError(
            f"this Megatron-LM has no {patch.module}.{patch.attribute}, which megatron-hsp "
            f"patches ({patch.why}); use a Megatron-LM version listed in patches/README.md"
        )
    original = getattr(module, patch.attribute)
    sig = check_parameters(patch, original)
    wrapper = functools.wraps(original)(make(original, sig))
    _originals[key] = original
    setattr(module, patch.attribute, wrapper)


def applied() -> list[str]:
    return [f"{m}.{a}" for m, a in _originals]


def remove_patches() -> None:
    for (module, attribute), original in list(_originals.items()):
        setattr(importlib.import_module(module), attribute, original)
        del _originals[(module, attribute)]


def apply_training_patches() -> None:
    """Patches needed by any HSP run inside Megatron's ``pretrain()`` loop."""
    from megatron_hsp.megatron import hooks

    def make_train_step(original, sig):
        def train_step(*a, **kw):
            run = hooks.active_run()
            if run is None or run.pipeline is None:
                return original(*a, **kw)
            bound = sig.bind(*a, **kw)
            hooks.begin_step(run)
            count = hooks.current_num_microbatches(run)
            schedule = bound.arguments["forward_backward_func"]

            # Only the schedule runs the plan's micro-batch count. Megatron's own count
            # (get_num_microbatches, from --global-batch-size) stays in force for the LR
            # scheduler increment inside train_step and for consumed_train_samples in train().
            def forward_backward_func(*fa, **fkw):
                fkw["num_microbatches"] = count
                result = schedule(*fa, **fkw)
                hooks.end_microbatches(run)  # the online refit's last mark, if not taken yet
                return result

            bound.arguments["forward_backward_func"] = forward_backward_func
            restore = hooks.around_finalize(run, bound.arguments.get("config"))
            try:
                out = original(*bound.args, **bound.kwargs)
            finally:
                restore()
            loss = None
            reduced = out[0] if isinstance(out, tuple) and out else None
            if isinstance(reduced, dict) and "lm loss" in reduced:
                value = reduced["lm loss"]
                loss = (
                    float(value[0] / value[1])
                    if getattr(value, "numel", lambda: 1)() == 2
                    else (float(value))
                )
            hooks.end_step(run, loss)
            return out

        return train_step

    _apply(TRAINING_PATCHES[0], make_train_step)

    def make_get_forward_backward_func(original, sig):
        def get_forward_backward_func(*a, **kw):
            schedule = original(*a, **kw)

            # evaluate() calls the schedule once per evaluation batch, by keyword; only a call
            # with an HSP evaluation iterator is changed.
            def forward_backward_func(*fa, **fkw):
                evaluation = hooks.eval_iterator_of(fkw.get("data_iterator"))
                if (
                    evaluation is None
                    and fkw.get("forward_only")
                    and fkw.get("data_iterator") is None
                    and hooks.active_run() is not None
                ):
                    # evaluate() on a split without documents (HSP's provider said so): no
                    # batch to plan, no loss; Megatron reports nothing for it. One loss dict
                    # without keys, not none: megatron-core < 0.19's evaluate() reads
                    # loss_dicts[0] on the last stage (0.19 skips an empty list).
                    return [{}]
                if evaluation is not None:
                    if fkw.get("collect_non_loss_data"):
                        # evaluate() makes this call on the last rank only; planning a batch is
                        # collective, so it would hang every other rank.
                        raise HSPError(
                            "--hsp evaluation does not support pretrain()'s "
                            "process_non_loss_data_func (it runs one more batch on the last "
                            "rank only); pass process_non_loss_data_func=None"
                        )
                    fkw["num_microbatches"] = evaluation.begin()
                return schedule(*fa, **fkw)

            return forward_backward_func

        return get_forward_backward_func

    _apply(TRAINING_PATCHES[1], make_get_forward_backward_func)

    def make_num_floating_point_operations(original, sig):
        def num_floating_point_operations(*a, **kw):
            lengths = hooks.trained_lengths(hooks.active_run())
            if lengths is None:
                return original(*a, **kw)
            args = sig.bind(*a, **kw).arguments["args"]
            return hooks.document_flops(original, args, lengths)

        return num_floating_point_operations

    _apply(TRAINING_PATCHES[2], make_num_floating_point_operations)


def apply_launcher_patches(install_fn: Callable[..., Any]) -> None:
    """Entry-point patches for ``python -m megatron_hsp.launch`` (unchanged ``pretrain_gpt.py``)."""
    from megatron_hsp.megatron.flags import hsp_extra_args_provider

    def make_parse(original, sig):
        def parse_and_validate_args(*a, **kw):
            bound = sig.bind(*a, **kw)
            user = bound.arguments.get("extra_args_provider")
            bound.arguments["extra_args_provider"] = hsp_extra_args_provider(user)
            args = original(*bound.args, **bound.kwargs)
            install_fn(args)
            return args

        return parse_and_validate_args

    def make_pretrain(original, sig):
        def pretrain(*a, **kw):
            # By name: the position of these two changed between releases (cfg_container first
            # since core_r0.19); binding by position would silently swap them.
            bound = sig.bind(*a, **kw)
            provider_key, forward_key = "train_valid_test_dataset_provider", "forward_step_func"
            provider, forward = install_fn(
                None, bound.arguments.get(provider_key), bound.arguments.get(forward_key)
            )
            bound.arguments[provider_key] = provider
            bound.arguments[forward_key] = forward
            return original(*bound.args, **bound.kwargs)

        return pretrain

    _apply(LAUNCHER_PATCHES[0], make_parse)
    _apply(LAUNCHER_PATCHES[1], make_pretrain)
    _apply(LAUNCHER_PATCHES[2], make_pretrain)
