"""The Transformer Engine backend's modules are part of the model (issue 15), structurally.

TE cannot run here, so the TE argument capture (``testing/te_capture.py``) supplies a
parameter-free ``DotProductAttention`` with extra state (as TE's has): no numerics are faked or
checked, only that the lazily built per-head-layout modules are registered submodules
(``.eval()`` reaches them; before, a plain dict hid them) and that checkpoints neither carry
them nor miss them.
"""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def te_stand_in():
    from megatron_hsp.testing import te_capture

    te_capture.install()
    yield te_capture
    te_capture.uninstall()


def _core():
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_hsp.runtime.attention import TEAttentionBackend

    config = TransformerConfig(
        num_layers=1, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True
    )
    parent = torch.nn.Module()
    parent.backend = TEAttentionBackend(config, layer_number=1, dropout=0.0)
    return parent


def test_te_modules_are_submodules_and_follow_eval(te_stand_in):
    parent = _core()
    backend = parent.backend
    te_module = backend._module(4, 2, 8, 0.35)
    assert backend._module(4, 2, 8, 0.35) is te_module  # one per head layout
    assert any(m is te_module for m in parent.modules())
    parent.eval()
    assert te_module.training is False
    parent.train()
    assert te_module.training is True
    later = backend._module(2, 1, 8, 0.35)  # built while training: takes the current mode
    assert later.training is True


def test_checkpoints_neither_carry_nor_miss_the_lazy_te_modules(te_stand_in):
    before = _core()
    state = before.state_dict()  # no TE module built yet
    after = _core()
    after.backend._module(4, 2, 8, 0.35)
    assert not [k for k in after.state_dict() if "te_modules" in k]
    result = after.load_state_dict(state, strict=True)  # no missing te_modules keys
    assert not result.missing_keys and not result.unexpected_keys


@pytest.mark.parametrize(
    ("version", "ok"),
    [("2.14.0", False), ("2.14.1+cu12", False), ("2.15.0", False), ("2.18.0", False),
     ("2.19.0", True), ("2.20.2", True), ("3.0", True), ("1.13.0", False)],
)  # fmt: skip
def test_a2a_p2p_thd_is_gated_on_the_te_version(version, ok):
    """TE asserts ``qkv_format != "thd"`` for ``cp_comm_type="a2a+p2p"`` through v2.18 and
    accepts it from 2.19 (issue 28; tests/runtime/test_te_sources.py reads it from TE's sources); a
    hybrid group on an older TE runs HSP's own Ulysses x ring path instead."""
    from megatron_hsp.runtime.attention import te_thd_a2a_p2p_supported

    assert te_thd_a2a_p2p_supported(version) is ok
