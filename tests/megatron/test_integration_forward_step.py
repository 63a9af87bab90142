"""The Megatron forward-step hook on real megatron-core objects (2 gloo ranks, CPU).

``hooks.begin_step`` + ``hooks.hsp_forward_step`` + its loss function are what Megatron's
schedule calls once per planned micro-batch inside ``pretrain()``. Here they are driven directly
(Megatron's loop itself runs in ``selftest --megatron``) and must give:

* the loss and every parameter's gradient of the independent stock reference
  (``testing/reference.py``: megatron-core's local spec, each document alone) -- the check;
* the same numbers as the runtime's own ``run_step`` on the same plan and batch -- a
  CONSISTENCY check only: the two share ``step_inputs``, ``forward_microbatch`` and
  ``microbatch_loss``, so a bug in those would pass it and is caught by the first.
"""

from __future__ import annotations

import importlib.util

import pytest

pytestmark = [
    pytest.mark.spawns,
    pytest.mark.dist,
    pytest.mark.skipif(
        importlib.util.find_spec("megatron_hsp.runtime.schedule") is None
        or importlib.util.find_spec("megatron_hsp.megatron.spec") is None,
        reason="needs the runtime (megatron_hsp.runtime.schedule, megatron_hsp.megatron.spec)",
    ),
]


def _worker(rank: int, world: int, prefix: str) -> dict:
    import torch
    import torch.distributed as dist

    from megatron_hsp.commands.demo_config import DEMO_COST_MODEL, DEMO_MODEL
    from megatron_hsp.megatron import hooks
    from megatron_hsp.megatron.config import HSPConfig
    from megatron_hsp.planner.run_spec import GroupSizeRequest, OverlongPolicy, ParallelDims
    from megatron_hsp.planner.search.settings import PlannerSettings, RunSpec
    from megatron_hsp.runtime.agreement import agree_on_plan
    from megatron_hsp.runtime.groups import create_groups
    from megatron_hsp.runtime.schedule import run_step
    from megatron_hsp.step.corpus import DEMO_VOCAB_SIZE
    from megatron_hsp.step.documents import DocumentIndex, DocumentReader
    from megatron_hsp.step.pipeline import StepPipeline
    from megatron_hsp.step.planner_service import PlannerService, PlannerSpec
    from megatron_hsp.step.sampler import GlobalBatchSampler, SamplerConfig
    from megatron_hsp.testing.dist import tiny_gpt_model
    from megatron_hsp.testing.megatron_loop import MegatronDocuments
    from megatron_hsp.testing.reference import ModelShape, reference_model, reference_step

    registry = create_groups(world)
    index = DocumentIndex(prefix)
    sampler = GlobalBatchSampler(
        index.lengths, SamplerConfig(seed=1, max_length=1024, token_budget=3000, overlong="split")
    )
    planner = None
    if rank == 0:
        spec = PlannerSpec(
            DEMO_COST_MODEL,
            world,
            world,
            1024,
            settings=PlannerSettings(time_budget_s=0.3, sizes=(1, 2)),
        )
        planner = PlannerService(spec, background=False)
    config = HSPConfig(
        cost_model="demo",
        run=RunSpec(
            dims=ParallelDims(world, world),
            sizes=GroupSizeRequest(),
            overlong=OverlongPolicy.SPLIT,
            planner=PlannerSettings(time_budget_s=0.3, sizes=(1, 2)),
            max_seq=1024,
        ),
        memory_cap_gb=None,
        global_batch_docs=None,
        token_budget=3000,
        seed=1,
    )
    run = hooks.HSPRun(config=config, registry=registry, device=torch.device("cpu"))
    run.pipeline = StepPipeline(
        sampler,
        DocumentReader(index),
        slot=registry.slot,
        world_size=world,
        planner=planner,
        is_planning_rank=rank == 0,
        agree=lambda p: agree_on_plan(p, mode="broadcast"),
        registry=registry,
    )
    model = tiny_gpt_model(**DEMO_MODEL, vocab_size=DEMO_VOCAB_SIZE, max_sequence_length=1024)
    # The stock reference with the same weights (the HSP spec keeps megatron's parameter names).
    shape = ModelShape(
        **DEMO_MODEL,
        kv_channels=DEMO_MODEL["hidden_size"] // DEMO_MODEL["num_attention_heads"],
        ffn_hidden_size=4 * DEMO_MODEL["hidden_size"],
        vocab_size=DEMO_VOCAB_SIZE,
        max_sequence_length=1024,
    )
    stock = reference_model(shape)
    stock_params = dict(stock.named_parameters())
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(stock_params[name])

    hooks.begin_step(run)
    prepared = run.current
    n_mb = hooks.current_num_microbatches(run)
    it = hooks._MicroBatchIterator(run)
    total_tokens = prepared.tokens.num_loss_tokens
    model.zero_grad(set_to_none=True)
    loss_sum = torch.zeros(())
    tokens = torch.zeros((), dtype=torch.int)
    for _ in range(n_mb):  # what Megatron's forward_backward_no_pipelining does, per micro-batch
        output, loss_func = hooks.hsp_forward_step(it, model)
        ls, nt, _report = loss_func(output)
        (ls / total_tokens).backward()
        loss_sum += ls.detach()
        tokens += nt
    with pytest.raises(RuntimeError, match="more micro-batches than the plan has"):
        next(it)
    t = torch.stack([loss_sum, tokens.double().float()])
    dist.all_reduce(t)
    grads = [
        p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in model.parameters()
    ]
    for g in grads:
        dist.all_reduce(g)
    # Every document of the step (``prepared.tokens`` holds real tokens for this slot's
    # sequences only), read with megatron-core's own IndexedDataset.
    megatron_docs = MegatronDocuments(prefix)
    everything = [megatron_docs.read(p.doc, p.offset, p.length) for p in prepared.batch.pieces]
    stock_loss, stock_grads = reference_step(stock, everything)
    names = [n for n, _ in model.named_parameters()]
    stock_diff = max(
        float((g - stock_grads[n]).norm() / (stock_grads[n].norm() + 1e-12))
        for g, n in zip(grads, names, strict=True)
    )
    ref = run_step(
        model,
        prepared.plan,
        prepared.tokens,
        registry,
        grad_group=None,
        device=torch.device("cpu"),
    )
    if planner is not None:
        planner.close()
    diff = max(
        float((g - p.grad).norm() / (p.grad.norm() + 1e-12))
        for g, p in zip(grads, model.parameters(), strict=True)
    )
    return {
        "hook_loss": float(t[0] / t[1]),
        "stock_loss": stock_loss,
        "stock_max_rel_grad_diff": stock_diff,
        "ref_loss": ref.loss,
        "tokens": int(t[1]),
        "ref_tokens": ref.num_loss_tokens,
        "max_rel_grad_diff": diff,
        "sizes": prepared.plan.group_sizes_used,
    }


def test_forward_step_hook_matches_stock_megatron_and_is_consistent_with_run_step(tmp_path):
    import numpy as np

    from megatron_hsp.step.corpus import write_indexed_dataset
    from megatron_hsp.testing.dist import raise_rank_errors, run_distributed

    rng = np.random.default_rng(0)
    prefix = tmp_path / "docs"
    write_indexed_dataset(prefix, [rng.integers(0, 256, n) for n in (900, 40, 300, 700, 64, 1500)])
    results = raise_rank_errors(run_distributed(_worker, 2, str(prefix), timeout_s=300))
    for r in results:
        # the check: stock megatron-core, each document alone
        assert r["hook_loss"] == pytest.approx(r["stock_loss"], rel=1e-6)
        assert r["stock_max_rel_grad_diff"] < 1e-5, r["stock_max_rel_grad_diff"]
        # consistency with the runtime's own step (shared code, see the module docstring)
        assert r["tokens"] == r["ref_tokens"]
        assert r["hook_loss"] == pytest.approx(r["ref_loss"], rel=1e-6)
        assert r["max_rel_grad_diff"] < 1e-5
