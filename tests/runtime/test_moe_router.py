"""HSP's MoE router (runtime/moe.py) on one packed micro-batch vs megatron-core's TopKRouter on
each document as its own [L, 1] micro-batch: the router-weight gradient of the per-sequence aux
loss and the z-loss (what the attached losses put on it) must match; padding adds nothing."""

from __future__ import annotations

import pytest
import torch

from megatron_hsp.testing.dist import destroy_cpu_megatron, init_single_process_megatron

LENGTHS = (5, 9, 3)
PAD = 3
EXPERTS, TOPK, HIDDEN = 4, 2, 8


@pytest.fixture(scope="module")
def megatron_cpu():
    """One gloo rank with megatron's groups; the router's "move the gate to the GPU" kept on the
    CPU (``cpu_megatron_training``, as in ``selftest --megatron``)."""
    from megatron_hsp.testing.cpu_shims import cpu_megatron_training

    init_single_process_megatron()
    with cpu_megatron_training():
        yield
    destroy_cpu_megatron()


def _config(seq_aux: float, z_loss: float):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=1,
        hidden_size=HIDDEN,
        num_attention_heads=2,
        num_moe_experts=EXPERTS,
        add_bias_linear=False,
        moe_router_topk=TOPK,
        moe_router_load_balancing_type="seq_aux_loss" if seq_aux else "none",
        moe_aux_loss_coeff=seq_aux,
        moe_z_loss_coeff=z_loss or None,
        calculate_per_token_loss=True,
        use_cpu_initialization=True,
        moe_token_dispatcher_type="alltoall",
    )


def _router_grad(cls, config, weight, pieces, state=None):
    """Router-weight gradient of the attached losses alone (the routed probs get no gradient):
    the sum over ``pieces`` (each a router call) of what MoEAuxLossAutoScaler puts on it."""
    from megatron.core.transformer.moe.moe_layer import get_default_pg_collection

    from megatron_hsp.runtime.moe import micro_batch

    router = cls(config=config, pg_collection=get_default_pg_collection())
    router.set_layer_number(1)
    with torch.no_grad():
        router.weight.copy_(weight)
    router.train()
    for x in pieces:
        with micro_batch(state):
            probs, _ = router(x)
        (probs * 0).sum().backward()
    return router.weight.grad.detach().clone()


@pytest.mark.parametrize(("seq_aux", "z_loss"), [(0.1, 0.0), (0.0, 0.01)])
def test_packed_router_losses_equal_per_document_ones(megatron_cpu, seq_aux, z_loss):
    from megatron.core.transformer.moe.router import TopKRouter

    from megatron_hsp.runtime.moe import HSPTopKRouter, MoEMicroBatch

    torch.manual_seed(0)
    config = _config(seq_aux, z_loss)
    weight = torch.randn(EXPERTS, HIDDEN)
    docs = [torch.randn(n, 1, HIDDEN) for n in LENGTHS]
    stock = _router_grad(TopKRouter, config, weight, docs)
    packed = torch.cat([*docs, torch.randn(PAD, 1, HIDDEN)])
    index = torch.cat(
        [torch.full((n,), i) for i, n in enumerate(LENGTHS)] + [torch.full((PAD,), -1)]
    )
    state = MoEMicroBatch(index, len(LENGTHS), None)
    hsp = _router_grad(HSPTopKRouter, config, weight, [packed], state)
    assert stock.abs().max() > 0
    assert torch.allclose(hsp, stock, rtol=1e-5, atol=1e-7), (hsp - stock).abs().max()
    # The stock router on the same pack treats it as one sequence (padding included): different.
    whole = _router_grad(TopKRouter, config, weight, [packed])
    assert not torch.allclose(whole, stock, rtol=1e-3, atol=0)


def _two_rank_router_grad(rank: int, world_size: int, seq_aux: float, z_loss: float):
    """Rank ``rank``'s half of the packed buffer (documents split across the two ranks), the
    document counts summed over the world group; returns this rank's router-weight gradient."""
    import torch.distributed as dist
    from megatron.core.transformer.moe.router import TopKRouter

    from megatron_hsp.runtime.moe import HSPTopKRouter, MoEMicroBatch
    from megatron_hsp.testing.cpu_shims import cpu_megatron_training

    torch.manual_seed(0)
    config = _config(seq_aux, z_loss)
    weight = torch.randn(EXPERTS, HIDDEN)
    docs = [torch.randn(n, 1, HIDDEN) for n in LENGTHS]
    packed = torch.cat([*docs, torch.randn(PAD + 1, 1, HIDDEN)])  # 21 tokens: 2 x 10 + 1
    index = torch.cat(
        [torch.full((n,), i) for i, n in enumerate(LENGTHS)] + [torch.full((PAD + 1,), -1)]
    )
    half = packed.shape[0] // 2
    mine = slice(rank * half, (rank + 1) * half)
    with cpu_megatron_training():
        stock = _router_grad(TopKRouter, config, weight, docs)
        state = MoEMicroBatch(index[mine], len(LENGTHS), dist.group.WORLD)
        hsp = _router_grad(HSPTopKRouter, config, weight, [packed[mine]], state)
    dist.all_reduce(hsp)  # the data-parallel gradient reduction
    return float((hsp - stock).abs().max()), float(stock.abs().max())


@pytest.mark.spawns
@pytest.mark.parametrize(("seq_aux", "z_loss"), [(0.1, 0.01)])
def test_documents_split_over_two_ranks(seq_aux, z_loss):
    from megatron_hsp.testing.dist import raise_rank_errors, run_distributed

    for err, top in raise_rank_errors(
        run_distributed(_two_rank_router_grad, 2, seq_aux, z_loss, timeout_s=120)
    ):
        assert top > 0 and err <= 1e-5 * top, (err, top)
