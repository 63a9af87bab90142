"""Every monkeypatch megatron-hsp applies to Megatron-LM, in one place.

Seams come first (``hooks.py``: dataset provider, forward step, layer spec via ``--spec``, flags via
``extra_args_provider``). What is left has no seam in Megatron-LM's ``megatron/training``:

=================================================  ===============================================
replaced attribute                                 why
=================================================  ===============================================
``megatron.training.training.get_num_microbatches``  Megatron's micro-batch calculator returns one
                                                   constant count; HSP plans a different number of
                                                   micro-batches every step. Returns the current
                                                   plan's count inside ``train_step`` only.
``megatron.training.training.train_step``          ``train()`` has no per-step callback; HSP must
                                                   fetch and dispatch the step's plan before the
                                                   schedule pulls micro-batches (and count them),
                                                   and measure the step for observability.
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
=================================================  ===============================================

Each patch checks that the attribute exists with a compatible signature, records the original,
and is undone by ``remove_patches`` (tests). Without ``--hsp`` every patched function behaves
exactly like the original.
"""

from __future__ import annotations

import functools
import importlib
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
        "get_num_microbatches",
        "per-step micro-batch count from the plan",
    ),
    Patch("megatron.training.training", "train_step", "per-step hook: plan, dispatch, measure"),
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


def _apply(patch: Patch, make: Callable[[Any], Any]) -> None:
    key = (patch.module, patch.attribute)
    if key in _originals:
        return  # idempotent: install() may be called by both the launcher and a patched script
    try:
        module = importlib.import_module(patch.module)
    except ImportError as exc:
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
    _originals[key] = original
    setattr(module, patch.attribute, functools.wraps(original)(make(original)))


def applied() -> list[str]:
    return [f"{m}.{a}" for m, a in _originals]


def remove_patches() -> None:
    for (module, attribute), original in list(_originals.items()):
        setattr(importlib.import_module(module), attribute, original)
        del _originals[(module, attribute)]


def apply_training_patches() -> None:
    """Patches needed by any HSP run inside Megatron's ``pretrain()`` loop."""
    from megatron_hsp.megatron import hooks

    def make_get_num_microbatches(original):
        def get_num_microbatches(*a, **kw):
            run = hooks.active_run()
            # Only inside train_step: train() compares counts between iterations and asserts
            # they never decrease, which a per-step plan count would break.
            if run is None or run.current is None or not run.in_step:
                return original(*a, **kw)
            return hooks.current_num_microbatches(run)

        return get_num_microbatches

    def make_train_step(original):
        def train_step(*a, **kw):
            run = hooks.active_run()
            if run is None or run.pipeline is None:
                return original(*a, **kw)
            hooks.begin_step(run)
            run.in_step = True
            try:
                out = original(*a, **kw)
            finally:
                run.in_step = False
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

    _apply(TRAINING_PATCHES[0], make_get_num_microbatches)
    _apply(TRAINING_PATCHES[1], make_train_step)


def apply_launcher_patches(install_fn: Callable[..., Any]) -> None:
    """Entry-point patches for ``python -m megatron_hsp.launch`` (unchanged ``pretrain_gpt.py``)."""
    from megatron_hsp.megatron.args import hsp_extra_args_provider

    def make_parse(original):
        def parse_and_validate_args(extra_args_provider=None, *a, **kw):
            args = original(hsp_extra_args_provider(extra_args_provider), *a, **kw)
            install_fn(args)
            return args

        return parse_and_validate_args

    def make_pretrain(original):
        def pretrain(*a, **kw):
            a = list(a)
            provider_key, forward_key = "train_valid_test_dataset_provider", "forward_step_func"
            provider = kw.get(provider_key, a[1] if len(a) > 1 else None)
            forward = kw.get(forward_key, a[3] if len(a) > 3 else None)
            provider, forward = install_fn(None, provider, forward)
            if provider_key in kw:
                kw[provider_key] = provider
            elif len(a) > 1:
                a[1] = provider
            if forward_key in kw:
                kw[forward_key] = forward
            elif len(a) > 3:
                a[3] = forward
            return original(*a, **kw)

        return pretrain

    _apply(LAUNCHER_PATCHES[0], make_parse)
    _apply(LAUNCHER_PATCHES[1], make_pretrain)
    _apply(LAUNCHER_PATCHES[2], make_pretrain)
