"""No host synchronisation inside a layer (issue 15): the host reads per micro-batch must not grow
with the number of layers.

Everything a layer needs comes from the micro-batch built once on the host
(``HSPPackedSeqParams.hsp_micro_batch``: the segment bounds as Python ints, the token layout, the
sub-groups), and what the first layer derives (positions, ring indices) is shared by the others.
Counted: every ``Tensor.item/tolist/cpu/numpy/__int__/__index__/__bool__/__float__`` call (on a
GPU each is a device->host sync) during one forward+backward of a real megatron-core GPTModel with
HSP attention, at 2 and at 4 layers. Before the fix the per-document path called
``cu_seqlens.tolist()`` in every layer (2 layers: 5 reads, 4 layers: 7).

Host-built tensors are counted too (``torch.from_numpy``: on a GPU each is a host-to-device
copy): the routes build theirs once per micro-batch. The Transformer Engine context-parallel
route runs through the TE argument capture (``testing/te_capture.py``, as the TE contract tests
do): before issue 28 it read ``int(positions.max())`` twice and built (and copied, blocking)
TE's boundary tensors once per layer.

Data-dependent shapes are counted as reads too (issue 41): boolean-mask indexing
(``x[mask]``, ``x[mask] = v``), ``nonzero``, ``masked_select``, ``argwhere``, ``unique`` and
one-argument ``where`` must learn the result's size from the device before they can allocate it
(a device-to-host copy and a stream sync on CUDA). The MoE router used three boolean-mask
selections in every MoE layer.
"""

from __future__ import annotations

import itertools
from unittest import mock

import pytest
import torch

SYNCS = {
    torch.Tensor.item,
    torch.Tensor.tolist,
    torch.Tensor.cpu,
    torch.Tensor.numpy,
    torch.Tensor.__int__,
    torch.Tensor.__index__,
    torch.Tensor.__bool__,
    torch.Tensor.__float__,
}


# Ops whose output size depends on tensor values (a sync on CUDA whatever their arguments).
DATA_DEPENDENT_SHAPES = {
    torch.nonzero,
    torch.Tensor.nonzero,
    torch.masked_select,
    torch.Tensor.masked_select,
    torch.argwhere,
    torch.Tensor.argwhere,
    torch.unique,
    torch.Tensor.unique,
    torch.unique_consecutive,
}


def _bool_mask_index(index) -> bool:
    parts = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in parts)


def data_dependent(func, args, kwargs) -> bool:
    """Whether this call's output shape comes from tensor values (a host read on CUDA)."""
    if func in DATA_DEPENDENT_SHAPES:
        return True
    if func in (torch.Tensor.__getitem__, torch.Tensor.__setitem__) and len(args) > 1:
        return _bool_mask_index(args[1])
    if func in (torch.where, torch.Tensor.where):
        return len(args) + len(kwargs or {}) == 1
    return False


class CountHostReads(torch.overrides.TorchFunctionMode):
    """Device reads (``SYNCS``) and host-built tensors (``torch.from_numpy``) while active."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0
        self._from_numpy = torch.from_numpy
        self._patch = mock.patch.object(torch, "from_numpy", self._count_from_numpy)

    def _count_from_numpy(self, array):
        self.count += 1
        return self._from_numpy(array)

    def __enter__(self):
        self._patch.start()
        return super().__enter__()

    def __exit__(self, *exc):
        self._patch.stop()
        return super().__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in SYNCS or data_dependent(func, args, kwargs):
            self.count += 1
        return func(*args, **(kwargs or {}))


def _reads(
    layers: int,
    group=None,
    hybrid=None,
    rank: int = 0,
    world: int = 1,
    docs: tuple[int, ...] = (5, 1, 7, 3, 8),
    backend: str = "torch",
) -> int:
    import numpy as np

    from megatron_hsp.runtime.dispatch import PackedMicroBatch  # noqa: F401  (the contract type)
    from megatron_hsp.runtime.layout import rank_tokens
    from megatron_hsp.runtime.schedule import packed_seq_params
    from megatron_hsp.testing.dist import tiny_gpt_model

    cu = np.cumsum([0, *docs])  # padded below to what the group's layout needs
    ring = 1 if hybrid is None else hybrid[1].size()
    pad = -int(cu[-1]) % (2 * world) if ring > 1 else -int(cu[-1]) % world
    if pad:
        cu = np.append(cu, cu[-1] + pad)
    total = int(cu[-1])
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 64, (1, total), generator=g)
    pos = torch.cat([torch.arange(b - a) for a, b in itertools.pairwise(cu)])[None]
    mine = torch.from_numpy(rank_tokens(cu, 1, ring, rank)) if world > 1 else torch.arange(total)
    model = tiny_gpt_model(num_layers=layers, seed=1, attention_backend=backend)

    class Pack:  # the fields of dispatch.PackedMicroBatch that packed_seq_params reads
        cu_seqlens = cu.astype(np.int32)
        max_seqlen = int(np.diff(cu).max())
        group_size = world

    Pack.ring = ring
    params = packed_seq_params(Pack, group, torch.device("cpu"), hybrid)
    counter = CountHostReads()
    with counter:
        out = model(ids[:, mine], pos[:, mine], None, packed_seq_params=params)
        out.sum().backward()
    return counter.count


@pytest.fixture
def megatron_cpu():
    from megatron_hsp.testing.dist import destroy_cpu_megatron, init_single_process_megatron

    init_single_process_megatron()
    yield
    destroy_cpu_megatron()


def test_host_reads_do_not_grow_with_layers_single_rank(megatron_cpu):
    two, four = _reads(2), _reads(4)
    print(f"host reads per micro-batch: 2 layers {two}, 4 layers {four}")
    assert four == two


def _ring_worker(rank: int, world: int) -> tuple[int, int]:
    import torch.distributed as dist

    group = dist.new_group(list(range(world)))
    return _reads(2, group, (None, group), rank, world), _reads(
        4, group, (None, group), rank, world
    )


@pytest.mark.spawns
@pytest.mark.dist
def test_host_reads_do_not_grow_with_layers_on_a_ring_of_two():
    from megatron_hsp.testing.dist import raise_rank_errors, run_distributed

    for two, four in raise_rank_errors(run_distributed(_ring_worker, 2, timeout_s=300)):
        assert four == two, (two, four)


def _te_ring_worker(rank: int, world: int) -> tuple[int, int, int]:
    import torch.distributed as dist

    from megatron_hsp.testing import te_capture

    te_capture.install()
    group = dist.new_group(list(range(world)))
    docs = (8, 4, 12)  # every document a multiple of 2d: TE's context-parallel route takes it
    two = _reads(2, group, (None, group), rank, world, docs, backend="te")
    four = _reads(4, group, (None, group), rank, world, docs, backend="te")
    cp_calls = sum(
        1 for name, _, kw in te_capture.CALLS if name == "forward" and "cu_seqlens_q_padded" in kw
    )
    return two, four, cp_calls


@pytest.mark.dist
def test_host_reads_do_not_grow_with_layers_on_the_te_context_parallel_route():
    """Issue 28: the TE route read the positions' maximum twice and built TE's boundary tensors
    in every layer; now once per micro-batch (2 layers and 4 layers read the same)."""
    from megatron_hsp.testing.dist import raise_rank_errors, run_distributed

    for two, four, cp_calls in raise_rank_errors(
        run_distributed(_te_ring_worker, 2, timeout_s=300)
    ):
        assert cp_calls == 2 + 4, cp_calls  # every layer took TE's route (forward only)
        assert four == two, (two, four)


def test_the_counter_sees_data_dependent_shapes():
    x, mask = torch.arange(6.0), torch.tensor([True, False] * 3)
    for op in (
        lambda: x[mask],
        lambda: x.__setitem__(mask, 0.0),
        lambda: torch.nonzero(mask),
        lambda: mask.nonzero(),
        lambda: x.masked_select(mask),
        lambda: torch.where(mask),
        lambda: torch.unique(x),
    ):
        with CountHostReads() as counter:
            op()
        assert counter.count == 1
    with CountHostReads() as counter:  # fixed shapes: no read
        x[torch.tensor([0, 2])]
        torch.where(mask, x, 0.0)
        x.index_add(0, torch.tensor([1, 1]), torch.ones(2))
    assert counter.count == 0


@pytest.fixture
def megatron_moe_cpu():
    from megatron_hsp.testing.cpu_shims import cpu_megatron_training
    from megatron_hsp.testing.dist import destroy_cpu_megatron, init_single_process_megatron

    init_single_process_megatron()
    with cpu_megatron_training():
        yield
    destroy_cpu_megatron()


def _router_reads(cls, state) -> int:
    """Host reads of one router forward and backward on a packed micro-batch of 20 tokens
    (3 documents and padding), per-sequence aux loss and z-loss on."""
    from megatron.core.transformer.moe.moe_layer import get_default_pg_collection
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_hsp.runtime.moe import micro_batch

    config = TransformerConfig(
        num_layers=1,
        hidden_size=8,
        num_attention_heads=2,
        num_moe_experts=4,
        add_bias_linear=False,
        moe_router_topk=2,
        moe_router_load_balancing_type="seq_aux_loss",
        moe_aux_loss_coeff=0.1,
        moe_z_loss_coeff=0.01,
        calculate_per_token_loss=True,
        use_cpu_initialization=True,
        moe_token_dispatcher_type="alltoall",
    )
    torch.manual_seed(0)
    router = cls(config=config, pg_collection=get_default_pg_collection())
    router.set_layer_number(1)
    router.train()
    x = torch.randn(20, 1, 8)
    with CountHostReads() as counter, micro_batch(state):
        probs, _ = router(x)
        (probs * 0).sum().backward()
    return counter.count


def test_the_moe_router_adds_no_host_read_per_layer(megatron_moe_cpu):
    """Issue 41: HSP's router reads the device no more than megatron-core's own router does on
    the same tokens (before: three boolean-mask selections per MoE layer, three syncs)."""
    from megatron.core.transformer.moe.router import TopKRouter

    from megatron_hsp.runtime.moe import HSPTopKRouter, MoEMicroBatch

    docs = torch.tensor([0] * 7 + [1] * 5 + [2] * 6 + [-1] * 2)
    stock = _router_reads(TopKRouter, None)
    hsp = _router_reads(HSPTopKRouter, MoEMicroBatch(docs, 3, None))
    print(f"router host reads: stock {stock}, HSP {hsp}")
    assert hsp <= stock, (hsp, stock)
