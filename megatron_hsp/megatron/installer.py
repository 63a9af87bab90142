"""``megatron_hsp.megatron.installer``: switch HSP on inside a Megatron-LM training script.

Three ways in, one mechanism (docs/integration.md, "Megatron-LM integration"):

* launcher, ``python -m megatron_hsp.launch pretrain_gpt.py ...``: ``install_entry_points()``
  makes the unchanged script do what the patch does (``patches.apply_launcher_patches``);
* patch (``patches/``): adds ``hsp_extra_args_provider`` to ``parse_and_validate_args`` and calls
  ``install(args, provider, forward_step)`` right after it;
* library: a script of your own that calls Megatron's ``pretrain()`` makes the same two calls;
  ``install`` points ``--spec`` at ``layer_spec.hsp_layer_spec``, which is
  ``spec.with_hsp_attention`` over your spec. A training loop of your own (no ``pretrain()``)
  does not call ``install``: it builds its layer spec with ``with_hsp_attention`` and runs each
  planned step with ``step.pipeline.build_training_step`` and ``runtime.schedule.run_step``
  (``commands/demo_worker.py`` is the worked example).

Without ``--hsp`` everything is returned unchanged and nothing is patched.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

from megatron_hsp.megatron import hooks, patches
from megatron_hsp.megatron.config import HSPConfig, validate_hsp_args
from megatron_hsp.megatron.datasets import HSPData, hsp_data_from_args
from megatron_hsp.megatron.model_cost import spec_label
from megatron_hsp.megatron.refusals import exit_on_refusal, launch_rank

LAYER_SPEC = ["megatron_hsp.megatron.layer_spec", "hsp_layer_spec"]


def _print0(msg: str) -> None:
    if launch_rank() == 0:
        print(f"[megatron-hsp] {msg}", flush=True)


def _checked_run_inputs(args: argparse.Namespace) -> tuple[HSPConfig, HSPData] | None:
    """``validate_hsp_args`` then the data flags (unsupported ones refused naming the flag, the
    datasets' files checked, the splits resolved); None without ``--hsp``."""
    config = validate_hsp_args(args)
    if config is None:
        return None
    return config, hsp_data_from_args(args)


def install(
    args: argparse.Namespace | None = None,
    datasets_provider: Callable[..., Any] | None = None,
    forward_step: Callable[..., Any] | None = None,
) -> tuple[Callable[..., Any] | None, Callable[..., Any] | None]:
    """Validate ``--hsp*`` on Megatron's parsed ``args`` and wire HSP into ``pretrain()``.

    Returns the dataset provider and forward step ``pretrain()`` should get: HSP's when ``--hsp``
    is on, the given ones otherwise. ``args=None`` only swaps providers for an earlier install.
    A flag HSP refuses ends the process here, before the model is built: one line on stderr,
    exit 2 (``refusals.exit_on_refusal``).
    """
    if args is not None and not getattr(args, "_hsp_installed", False):
        # The flags and Megatron's data flags, at argument time (before the model is built), in
        # one refusal path: an unsupported flag or a missing dataset is one line and exit 2 on
        # every rank, whichever check names it.
        checked = exit_on_refusal(lambda: _checked_run_inputs(args))
        if checked is None:
            return datasets_provider, forward_step
        config, data = checked
        spec = getattr(args, "spec", None)
        if spec and list(spec) != LAYER_SPEC:
            # The user's spec stays the base: layer_spec.py swaps HSP attention into it.
            args.hsp_base_spec = list(spec)
            _print0(f"--spec {' '.join(spec)}: HSP attention is swapped into this spec")
        args.spec = list(LAYER_SPEC)
        for note in (*config.notes, *data.notes):
            _print0(note)
        _print0(f"data: {data.describe()}")
        _print0(
            f"HSP on: {config.run.dims.slots} sequence-parallel ranks in nodes of "
            f"{config.run.dims.slots_per_node}, group sizes {list(config.group_sizes)}, cost model "
            f"{spec_label(config.cost_model)}, solver {config.run.planner.solver} "
            f"({config.run.planner.time_budget_s:g} s), overlong={config.run.overlong}"
        )
        from megatron_hsp.runtime.compat import untested_versions

        untested = untested_versions()
        if untested and launch_rank() == 0:
            print(untested, file=sys.stderr, flush=True)
        hooks.set_run(hooks.HSPRun(config=config, data=data))
        patches.apply_training_patches()
        args._hsp_installed = True  # the launcher on a patched script installs once
    if hooks.active_run() is None:
        return datasets_provider, forward_step
    return hooks.hsp_datasets_provider, hooks.hsp_forward_step


def install_entry_points() -> None:
    """For unchanged scripts: hook ``parse_and_validate_args`` and ``pretrain`` (launcher)."""

    def install_from_entry(args=None, provider=None, forward=None):
        if args is not None:
            install(args)
            return None
        return install(None, provider, forward)

    patches.apply_launcher_patches(install_from_entry)
