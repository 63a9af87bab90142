"""The loop's stock side is the model Megatron's own builder builds (issue 44, class 5).

``models.stock_builder`` takes Megatron-LM's ``gpt_builders.gpt_builder`` where a checkout is
importable, else the megatron-core wheel's ``GPTModelBuilder`` (0.19 on), else, where the wheel
ships no builder (megatron-core 0.18, the oldest tier), megatron-core's spec functions with the
options Megatron-LM's builder passes. Here, on every option set the CPU builds in one process
(no tensor, expert or pipeline parallelism: the others differ only in the groups), the three give
the same model module by module, same initial values included (``model_matrix``), and the stock
side shares nothing with the spec HSP builds: a model-definition plant on HSP's spec leaves it
alone, which is what lets the loop catch it (``test_megatron_loop.py``, on the MoE set with
``--qk-l2-norm``). Builds models in this process only (no process started).
"""

from __future__ import annotations

import contextlib
import shutil
import sys

import pytest

from megatron_hsp.testing.megatron_loop.models import (
    _megatron_args,
    _set_megatron_globals,
    _spec_function_model,
    _stock_model,
    stock_builder,
)
from megatron_hsp.testing.megatron_loop.options import DEFAULT_OPTIONS, MODEL_FLAGS, LoopOptions
from megatron_hsp.testing.model_matrix import module_differences
from megatron_hsp.testing.mutations import MODEL_MUTATIONS
from tests.helpers import FIXTURES

CORE_R019 = "f8837c04ef6cbef6cdefb8de001aad63178aebbf"  # Megatron-LM core_r0.19.0
ONE_PROCESS = [o for o in DEFAULT_OPTIONS if o.tp == o.ep == o.pp == 1]


@pytest.fixture(scope="module")
def cpu_world():
    """A one-process gloo world with megatron's groups, in the loop's CPU training context."""
    from megatron.training import global_vars

    from megatron_hsp.testing.cpu_shims import cpu_device_arch_version, cpu_megatron_training
    from megatron_hsp.testing.dist import destroy_cpu_megatron, init_single_process_megatron

    init_single_process_megatron()
    with cpu_megatron_training(), cpu_device_arch_version():
        yield
    global_vars.unset_global_variables()  # what _args set, for the tests after these
    destroy_cpu_megatron()


@pytest.fixture
def checkout(tmp_path, monkeypatch):
    """Megatron-LM core_r0.19.0's own ``gpt_builders`` importable, as in a checkout."""
    shutil.copy(
        FIXTURES / "megatron-lm" / CORE_R019 / "gpt_builders.py.upstream",
        tmp_path / "gpt_builders.py",
    )
    monkeypatch.delitem(sys.modules, "gpt_builders", raising=False)
    monkeypatch.syspath_prepend(str(tmp_path))


@pytest.fixture
def no_checkout(monkeypatch):
    monkeypatch.setitem(sys.modules, "gpt_builders", None)  # not importable


def _args(options: LoopOptions):
    args = _megatron_args([*MODEL_FLAGS, *options.flags()])
    _set_megatron_globals(args)
    return args


def _qk_norms(model) -> set[str]:
    return {
        type(m).__name__
        for n, m in model.named_modules()
        if n.endswith(("q_layernorm", "k_layernorm"))
    }


def test_the_loop_has_a_moe_set_with_qk_l2_norm():
    (qk,) = [o for o in DEFAULT_OPTIONS if o.qk_norm]
    assert qk.num_experts and "--qk-l2-norm" in qk.flags() and qk in ONE_PROCESS


@pytest.mark.parametrize("options", ONE_PROCESS, ids=lambda o: o.label)
def test_stock_model_is_what_megatrons_builders_build(options, cpu_world, monkeypatch, checkout):
    """The checkout's ``gpt_builder``, the wheel's ``GPTModelBuilder`` and the spec-function
    fallback build the same model from the loop's flags."""
    import megatron.training.models.gpt  # noqa: F401  (the wheel's builder exists on this tier)

    assert stock_builder()[1] == "Megatron-LM's gpt_builders.gpt_builder"
    args = _args(options)
    from_checkout = _stock_model(args)
    with monkeypatch.context() as m:
        m.setitem(sys.modules, "gpt_builders", None)
        assert stock_builder()[1] == "megatron.training.models.gpt.GPTModelBuilder"
        from_wheel = _stock_model(args)
        m.setitem(sys.modules, "megatron.training.models.gpt", None)  # as in megatron-core 0.18
        assert stock_builder()[0] is _spec_function_model
        fallback = _stock_model(args)
    assert module_differences(from_checkout, from_wheel) == []
    assert module_differences(from_wheel, fallback) == []
    assert (_qk_norms(from_wheel) == {"L2Norm"}) is (options.qk_norm == "l2-norm"), options.label


def test_a_plant_on_hsps_spec_leaves_the_stock_model_alone(cpu_world, no_checkout):
    """The reference shares no code with what it checks: with ``moe-spec-drops-qk-l2-norm``
    planted (HSP's ``layer_spec.megatron_default_spec``), the stock model keeps L2Norm on q and
    k and the planted code never runs (before: the loop's stock side built the MoE spec by hand,
    without --qk-l2-norm, and no option set passed it)."""
    (options,) = [o for o in DEFAULT_OPTIONS if o.qk_norm == "l2-norm"]
    (mutation,) = MODEL_MUTATIONS
    args = _args(options)
    planted = mutation.plant()
    try:
        model = _stock_model(args)
        assert planted.calls() == 0
    finally:
        planted()
    assert _qk_norms(model) == {"L2Norm"}


def test_the_hsp_side_under_the_plant_drops_what_stock_keeps(cpu_world, no_checkout):
    """The other half of the class: HSP's spec for the same flags (``layer_spec``, as the loop's
    HSP side builds it) has L2Norm on q and k, and loses it under the plant."""
    from megatron.core.models.gpt.gpt_model import GPTModel

    from megatron_hsp.megatron.layer_spec import hsp_spec_from_args
    from megatron_hsp.testing.megatron_loop.models import _gpt

    (options,) = [o for o in DEFAULT_OPTIONS if o.qk_norm == "l2-norm"]
    (mutation,) = MODEL_MUTATIONS
    args = _args(options)

    def hsp_model():
        from megatron.training.arguments import core_transformer_config_from_args

        config = core_transformer_config_from_args(args)
        return _gpt(GPTModel, config, hsp_spec_from_args(args), args)

    assert _qk_norms(hsp_model()) == {"L2Norm"}
    planted = mutation.plant()
    with contextlib.ExitStack() as stack:
        stack.callback(planted)
        dropped = hsp_model()
        assert planted.calls() > 0
    assert "L2Norm" not in _qk_norms(dropped)
