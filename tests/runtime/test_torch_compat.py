"""Supported torch range (2.11 .. 2.14): features detected, the varlen call shaped for each.

These run on every supported torch (CI runs them on the pinned release and on the oldest,
``make test-oldest-torch``), so the call is checked against the installed library's own
signature, not against an assumption about it.
"""

from __future__ import annotations

import inspect

import pytest
import torch

from megatron_hsp.runtime import backends, compat
from megatron_hsp.runtime.compat import TorchFeatures, torch_features, varlen_causal


def _inputs(hq: int = 4, hk: int = 2, t: int = 6, d: int = 8):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(t, h, d, generator=g) for h in (hq, hk, hk))
    return q, k, v, torch.tensor([0, 2, t], dtype=torch.int32)


def test_features_are_read_from_the_installed_torch():
    f = torch_features()
    assert f.version == torch.__version__
    real = compat._varlen_function()
    assert f.varlen_attn == (real is not None)
    if real is not None:
        params = inspect.signature(real).parameters
        assert f.varlen_enable_gqa == ("enable_gqa" in params)
        assert f.varlen_return_aux == ("return_aux" in params)


@pytest.mark.parametrize("gqa", [False, True])
def test_the_call_binds_to_the_installed_varlen_signature(gqa):
    """What ``varlen_causal`` passes must bind to the installed ``varlen_attn`` (a TypeError on
    torch 2.11 before: ``enable_gqa`` does not exist there)."""
    real = compat._varlen_function()
    if real is None:
        pytest.fail(f"torch {torch.__version__} is below the supported range: no varlen_attn")
    sig = inspect.signature(real)
    q, k, v, cu = _inputs(4, 2 if gqa else 4)

    def bind_only(*args, **kwargs):
        sig.bind(*args, **kwargs)  # raises TypeError on an unknown keyword
        assert args[1].size(1) in (args[0].size(1), k.size(1))
        return args[0]

    out = varlen_causal(q, k, v, cu, 4, 0.5, fn=bind_only)
    assert out.shape == q.shape


def test_without_enable_gqa_kv_heads_are_repeated():
    q, k, v, cu = _inputs(4, 2)
    seen = {}

    def record(*args, **kwargs):
        seen["args"], seen["kwargs"] = args, kwargs
        return args[0]

    old = TorchFeatures("2.11.0", True, varlen_enable_gqa=False, varlen_return_aux=True)
    varlen_causal(q, k, v, cu, 4, 0.5, features=old, fn=record)
    assert "enable_gqa" not in seen["kwargs"]
    assert torch.equal(seen["args"][1], k.repeat_interleave(2, dim=1))  # head j -> KV j // 2
    assert torch.equal(seen["args"][2], v.repeat_interleave(2, dim=1))
    assert seen["kwargs"]["window_size"] == (-1, 0)

    new = TorchFeatures("2.14.1", True, varlen_enable_gqa=True, varlen_return_aux=True)
    varlen_causal(q, k, v, cu, 4, 0.5, features=new, fn=record)
    assert seen["kwargs"]["enable_gqa"] is True
    assert torch.equal(seen["args"][1], k)


def test_backend_path_is_chosen_by_device_not_dropout(monkeypatch):
    """Before: dropout > 0 silently fell back to the per-document loop on CUDA; now the varlen
    path is taken whenever the kernel serves the device and dtype, and dropout there is an
    error naming the flag."""
    calls = []
    monkeypatch.setattr(backends, "_torch_varlen_available", lambda q: True)
    monkeypatch.setattr(backends, "varlen_causal", lambda q, k, v, cu, m, s: calls.append(m) or q)
    q, k, v, cu = _inputs(4, 2)
    backend = backends.TorchAttentionBackend()
    backend(q, k, v, cu, 4, softmax_scale=0.5, dropout_p=0.0)
    assert calls == [4]
    with pytest.raises(NotImplementedError, match="--attention-dropout 0"):
        backend(q, k, v, cu, 4, softmax_scale=0.5, dropout_p=0.1)
    assert calls == [4]  # no silent per-document fallback either


def test_communicator_split_contract_of_this_torch():
    """``groups.bind_world_device`` relies on torch splitting new NCCL groups from the default
    group once it has a ``bound_device_id`` (settable), and on ``init_process_group`` taking
    ``device_id``; checked against this torch's own source (both ends of the supported range run
    this test). NCCL itself cannot run here: docs/gpu-validation.md lists it as unproven."""
    import inspect

    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    prop = dist.ProcessGroup.__dict__["bound_device_id"]
    assert isinstance(prop, property) and prop.fset is not None
    helper = inspect.getsource(c10d._new_process_group_helper)
    assert "_get_default_group().bound_device_id" in helper and "split_from" in helper
    assert callable(c10d._get_split_source)
    assert "device_id" in inspect.signature(dist.init_process_group).parameters


def test_bind_world_device_leaves_gloo_alone():
    from megatron_hsp.runtime.groups import bind_world_device
    from megatron_hsp.testing.dist import destroy_cpu_megatron, init_single_process_megatron

    init_single_process_megatron()
    try:
        assert bind_world_device() is None
        assert dist_default_bound() is None
    finally:
        destroy_cpu_megatron()


def dist_default_bound():
    from torch.distributed import distributed_c10d as c10d

    return c10d._get_default_group().bound_device_id
