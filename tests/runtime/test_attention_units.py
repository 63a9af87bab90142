"""Single-process unit tests of the HSP attention pieces (no spawned processes)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from megatron_hsp.planner.groupspace import kv_copies
from megatron_hsp.runtime.attention import (
    TorchAttentionBackend,
    apply_rope_packed,
    group_packed_seq_params,
    heads_per_tp_rank,
    make_backend,
    positions_in_documents,
)
from megatron_hsp.testing.dist import destroy_cpu_megatron, init_single_process_megatron


def config(heads: int = 4, kv: int = 2, **kw):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=1,
        hidden_size=heads * 8,
        num_attention_heads=heads,
        num_query_groups=kv,
        attention_dropout=0.0,
        use_cpu_initialization=True,
        **kw,
    )


@pytest.fixture(scope="module")
def megatron_cpu():
    init_single_process_megatron()
    yield
    destroy_cpu_megatron()


def core_attention(cfg):
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_hsp.runtime.attention import HSPCoreAttention

    return HSPCoreAttention(cfg, 1, AttnMaskType.causal, "self", backend="torch")


# ------------------------------------------------------------------ group-size rules


def test_heads_per_tp_rank_splits_queries_and_replicates_kv_past_tp() -> None:
    assert heads_per_tp_rank(config(heads=8, kv=2), 1) == (8, 2)
    assert heads_per_tp_rank(config(heads=8, kv=2), 2) == (4, 1)
    assert heads_per_tp_rank(config(heads=8, kv=2), 4) == (2, 1)  # megatron replicates KV
    with pytest.raises(ValueError, match="--tensor-model-parallel-size 3"):
        heads_per_tp_rank(config(heads=8, kv=2), 3)


@pytest.mark.parametrize(
    ("q", "kv", "d", "r"),
    [(4, 4, 2, 1), (4, 2, 2, 1), (4, 2, 4, 2), (4, 1, 4, 4), (8, 2, 8, 4), (12, 3, 4, 4)],
)
def test_kv_copies(q: int, kv: int, d: int, r: int) -> None:
    assert kv_copies(q, kv, d) == r


@given(
    kv=st.integers(1, 6),
    per_kv=st.integers(1, 6),
    d=st.integers(1, 12),
)
def test_replicated_kv_heads_stay_paired_with_their_queries(kv: int, per_kv: int, d: int) -> None:
    """After replication and the head scatter, every rank's query head j meets KV head j//per_kv."""
    q = kv * per_kv
    if q % d:
        with pytest.raises(ValueError):
            kv_copies(q, kv, d)
        return
    r = kv_copies(q, kv, d)
    kv_rep = kv * r
    assert kv_rep % d == 0 and per_kv % r == 0
    q_local, kv_local = q // d, kv_rep // d
    for rank in range(d):
        for a in range(q_local):
            j = rank * q_local + a
            local_kv = a // (q_local // kv_local)  # the backend's GQA map on this rank
            original = (rank * kv_local + local_kv) // r  # repeat_interleave copy -> source head
            assert original == j // per_kv


# ------------------------------------------------------------------ packing helpers and RoPE


def test_positions_restart_per_segment() -> None:
    cu = torch.tensor([0, 3, 4, 4, 7], dtype=torch.int32)  # includes an empty segment
    assert positions_in_documents(cu, 7).tolist() == [0, 1, 2, 0, 0, 1, 2]


def test_group_packed_seq_params_covers_padding_and_rejects_bad_totals() -> None:
    p = group_packed_seq_params(torch.tensor([0, 2, 3, 12], dtype=torch.int32), None)
    assert p.qkv_format == "thd" and p.max_seqlen_q == 9 and p.cp_group is None
    fake_group = type("G", (), {"size": lambda self: 5})()
    with pytest.raises(ValueError, match="multiple of the group size 5"):
        group_packed_seq_params(torch.tensor([0, 12], dtype=torch.int32), fake_group)


def test_rope_table_too_short_is_a_clear_error(megatron_cpu) -> None:
    cfg = config()
    table = torch.zeros(3, 1, 1, 8)
    with pytest.raises(ValueError, match="max_seqlen_q/kv must be the longest segment"):
        apply_rope_packed(torch.zeros(5, 2, 8), table, torch.arange(5), cfg)


# ------------------------------------------------------------------ module contract


def test_bshd_input_equals_thd_with_one_document_per_row(megatron_cpu) -> None:
    attn = core_attention(config())
    g = torch.Generator().manual_seed(0)
    s, b = 6, 2
    q, k, v = (torch.randn(s, b, h, 8, generator=g) for h in (4, 2, 2))
    out_bshd = attn(q, k, v, None)
    assert out_bshd.shape == (s, b, 32)
    flat = [t.transpose(0, 1).reshape(b * s, t.size(2), 8) for t in (q, k, v)]
    params = group_packed_seq_params(torch.tensor([0, s, 2 * s], dtype=torch.int32), None)
    out_thd = attn(*flat, None, packed_seq_params=params)
    assert torch.allclose(out_thd.reshape(b, s, 32).transpose(0, 1), out_bshd, atol=1e-6)


def test_contract_violations_raise(megatron_cpu) -> None:
    from megatron.core.packed_seq_params import PackedSeqParams

    attn = core_attention(config())
    x, kv = torch.randn(8, 4, 8), torch.randn(8, 2, 8)
    short = group_packed_seq_params(torch.tensor([0, 6], dtype=torch.int32), None)
    with pytest.raises(ValueError, match="whole packed buffer: it ends at 6"):
        attn(x, kv, kv, None, packed_seq_params=short)
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    padded = PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        cu_seqlens_q_padded=torch.tensor([0, 4, 8], dtype=torch.int32),
        max_seqlen_q=5,
        max_seqlen_kv=5,
    )
    with pytest.raises(ValueError, match="per-document padding"):
        attn(x, kv, kv, None, packed_seq_params=padded)


def test_megatron_context_parallelism_must_be_off(megatron_cpu) -> None:
    with pytest.raises(ValueError, match="--context-parallel-size 1"):
        core_attention(config(context_parallel_size=2))


def test_backend_selection() -> None:
    assert isinstance(make_backend("torch", None, 1, 0.0), TorchAttentionBackend)
    with pytest.raises(ValueError, match="'auto', 'te' or 'torch'"):
        make_backend("flash", None, 1, 0.0)
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError):
            make_backend("te", None, 1, 0.0)  # never a silent fallback when TE is asked for


def test_torch_backend_skips_empty_segments_and_handles_gqa() -> None:
    g = torch.Generator().manual_seed(1)
    q, k, v = torch.randn(5, 4, 8, generator=g), *torch.randn(2, 5, 2, 8, generator=g)
    cu = torch.tensor([0, 2, 2, 5], dtype=torch.int32)
    out = TorchAttentionBackend()(q, k, v, cu, 3, softmax_scale=8**-0.5, dropout_p=0.0)
    # the first token only sees itself: output is its own value (GQA: head j uses KV head j//2)
    assert torch.allclose(out[0], v[0].repeat_interleave(2, dim=0), atol=1e-6)
    assert torch.allclose(out[2], v[2].repeat_interleave(2, dim=0), atol=1e-6)
    assert out.shape == (5, 4, 8)


def test_te_spec_without_te_is_a_clear_error() -> None:
    from megatron_hsp.megatron.spec import hsp_gpt_layer_spec

    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:
        with pytest.raises(ValueError, match="use_transformer_engine=False"):
            hsp_gpt_layer_spec(use_transformer_engine=True)
    else:
        pytest.skip("Transformer Engine is installed: the TE spec builds")


def test_empty_group_buffer_returns_empty_output(megatron_cpu) -> None:
    """A group without sequences in a micro-batch: zero tokens in, zero tokens out, no error."""
    attn = core_attention(config())
    q = torch.zeros(0, 4, 8, requires_grad=True)
    kv = torch.zeros(0, 2, 8, requires_grad=True)
    params = group_packed_seq_params(torch.tensor([0], dtype=torch.int32), None)
    out = attn(q, kv, kv, None, packed_seq_params=params)
    assert out.shape == (0, 32)
    out.sum().backward()
    assert q.grad.shape == q.shape
