"""``--hsp`` changes only the attention of the spec Megatron would have built (issue 7).

The base is the user's ``--spec`` when given, else the dense layer spec Megatron-LM's own
``gpt_builders`` builds from the flags (from the fixtures here), so options such as qk-l2-norm
survive ``--hsp``; before, ``--spec`` was rejected and the base rebuilt from three flags only.
"""

from __future__ import annotations

import shutil
import sys
import types

import pytest
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.torch_norm import L2Norm
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_hsp.megatron.layer_spec import hsp_spec_from_args, megatron_default_spec
from megatron_hsp.runtime.attention import HSPCoreAttention, HSPSelfAttention
from tests.helpers import FIXTURES

MEGATRON_LM = FIXTURES / "megatron-lm"
# Commits whose gpt_builders is kept (Megatron-LM dev's needs a megatron-core newer than the
# 0.19.2 wheel, so its fixture holds the scripts for the patch checks only).
RUNNABLE = sorted(p.parent.name for p in MEGATRON_LM.glob("*/gpt_builders.py.upstream"))


def _is_hsp_with_l2norm(spec) -> bool:
    attn = spec.submodules.self_attention
    core = attn.submodules.core_attention
    core = getattr(core, "func", core)
    return (
        attn.module is HSPSelfAttention
        and core is HSPCoreAttention
        and attn.submodules.q_layernorm is L2Norm
        and attn.submodules.k_layernorm is L2Norm
    )


def test_the_users_spec_is_the_base(monkeypatch):
    user = types.ModuleType("my_specs")
    user.l2 = get_gpt_layer_local_spec(qk_l2_norm=True)
    monkeypatch.setitem(sys.modules, "my_specs", user)
    args = types.SimpleNamespace(hsp_base_spec=["my_specs", "l2"], transformer_impl="local")
    assert _is_hsp_with_l2norm(hsp_spec_from_args(args))


@pytest.mark.parametrize("commit", RUNNABLE)
def test_megatron_default_spec_is_the_checkouts_own(commit, tmp_path, monkeypatch):
    # Megatron-LM's own gpt_builders (pristine fixture) decides the base spec: HSP swaps only the
    # attention modules; the norms (here qk-layernorm) are whatever Megatron chose.
    shutil.copy(MEGATRON_LM / commit / "gpt_builders.py.upstream", tmp_path / "gpt_builders.py")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "gpt_builders", raising=False)
    config = TransformerConfig(
        num_layers=2, hidden_size=32, num_attention_heads=4, qk_layernorm=True
    )
    args = types.SimpleNamespace(transformer_impl="local")
    from gpt_builders import _get_transformer_layer_spec

    from megatron_hsp.megatron.spec import with_hsp_attention

    megatron = _get_transformer_layer_spec(False, config).submodules
    ours = with_hsp_attention(megatron_default_spec(args, config)).submodules
    assert ours.self_attention.module is HSPSelfAttention
    for name in ("q_layernorm", "k_layernorm", "linear_qkv", "linear_proj"):
        assert getattr(ours.self_attention.submodules, name) is getattr(
            megatron.self_attention.submodules, name
        )
    assert megatron.self_attention.submodules.q_layernorm is not IdentityOp
    # (partials compare by identity; their reprs name the same classes and arguments)
    assert repr(ours.mlp) == repr(megatron.mlp)
    assert ours.input_layernorm is megatron.input_layernorm


def test_megatron_default_spec_without_a_checkout(monkeypatch):
    # megatron-core's layer spec with the options Megatron-LM's builder passes: qk-layernorm
    # and, as its local branch, not qk-l2-norm (issue 44; the whole flag matrix against the
    # builder itself: test_model_definition_matrix.py).
    monkeypatch.setitem(sys.modules, "gpt_builders", None)  # not importable
    from megatron_hsp.megatron.spec import with_hsp_attention

    args = types.SimpleNamespace(transformer_impl="local")
    config = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, qk_l2_norm=True)
    attn = with_hsp_attention(megatron_default_spec(args, config)).submodules.self_attention
    assert attn.module is HSPSelfAttention and attn.submodules.q_layernorm is IdentityOp
    config = TransformerConfig(
        num_layers=2, hidden_size=32, num_attention_heads=4, qk_layernorm=True
    )
    attn = with_hsp_attention(megatron_default_spec(args, config)).submodules.self_attention
    assert attn.submodules.q_layernorm is not IdentityOp
