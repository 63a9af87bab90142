"""One rank of ``megatron-hsp demo``: the training loop and the adaptive-versus-static re-run.

Each rank builds the step pipeline (sampler -> planner -> dispatch, ``step/pipeline.py``), trains
the demo's tiny megatron-core GPT for ``DemoConfig.steps`` steps with the plan of each step, feeds
the measured group times to the online refit (rank 0), and re-runs a few kept batches with static
groups for the side-by-side. torch.distributed and megatron's parallel_state are initialised by
the caller: ``demo_ranks`` (ranks the demo starts itself) or ``run_torchrun`` (a torchrun or
Slurm launch).
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import asdict
from typing import Any

from megatron_hsp.commands.demo_config import DEMO_MODEL, DemoConfig


def _max_over_ranks(x: float) -> float:
    import torch
    import torch.distributed as dist

    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t[0])


def _progress(done: int, total: int, line: str, quiet: bool) -> None:
    if quiet:
        return
    width = 24
    filled = width * done // max(total, 1)
    bar = "#" * filled + "-" * (width - filled)
    print(f"[{bar}] {done}/{total}  {line}", file=sys.stderr, flush=True)


def demo_worker(rank: int, world_size: int, cfg: DemoConfig) -> dict[str, Any] | None:
    """One rank of the demo; torch.distributed and megatron parallel_state are initialised."""
    import torch
    import torch.distributed as dist

    from megatron_hsp.planner.cost.costmodel import load_cost_model
    from megatron_hsp.runtime.schedule import run_step
    from megatron_hsp.step.corpus import DEMO_VOCAB_SIZE
    from megatron_hsp.step.documents import DocumentIndex, DocumentReader
    from megatron_hsp.step.observe import StepRecord, StepRefitter
    from megatron_hsp.step.pipeline import build_training_step
    from megatron_hsp.step.sampler import GlobalBatchSampler, SamplerConfig
    from megatron_hsp.testing.dist import tiny_gpt_model

    device = torch.device("cpu")
    assert world_size == cfg.nproc, f"{world_size} ranks for a demo of {cfg.nproc}"
    cost = load_cost_model(cfg.cost_model, world_size=world_size, gpus_per_node=world_size)
    run = cfg.run_spec(cost)
    training = build_training_step(run, cfg.cost_model, rank=rank)
    registry, sizes, max_len = training.registry, run.planner.sizes or (), run.max_seq
    index = DocumentIndex(cfg.corpus_prefix)
    sampler = GlobalBatchSampler(
        index.lengths,
        SamplerConfig(
            seed=cfg.seed,
            max_length=max_len,
            global_batch_docs=cfg.global_batch,
            token_budget=cfg.token_budget,
            overlong=run.overlong,
        ),
    )
    training.start_planner()
    pipeline = training.pipeline(sampler, DocumentReader(index))
    pipeline.prime()  # step 0 is planned while the model is built
    model = tiny_gpt_model(
        **DEMO_MODEL,
        vocab_size=DEMO_VOCAB_SIZE,
        max_sequence_length=max_len,
        seed=cfg.seed,
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)

    steps: list[dict[str, Any]] = []
    kept: list[tuple[Any, Any]] = []  # (DocumentBatch, adaptive plan) for the side-by-side
    refitter = (
        StepRefitter(cost, out=cfg.refit_out, planner=pipeline.planner)
        if cfg.refit and rank == 0
        else None
    )
    # The per-step cost the plan's own estimate adds, by the model each step's plan was made with
    # (plans are requested one step ahead, so a refit after step t prices the plans from t + 2
    # on): the JSON's planned_ms.
    overhead_ms = {0: cost.step_overhead_ms}
    try:
        for i in range(cfg.steps):
            prepared = pipeline.next_step()
            # The newest model as the step starts (refit after the previous step): it re-prices
            # the prefetched plan for predicted_ms, so the prediction lags the machine one step,
            # not two (the plan itself stays as it was made).
            current = refitter.model if refitter is not None else cost
            overhead_ms[prepared.step + 1] = current.step_overhead_ms
            created = registry.created
            dist.barrier()
            t0 = time.perf_counter()
            result = run_step(
                model,
                prepared.plan,
                prepared.tokens,
                registry,
                grad_group=None,
                device=device,
            )
            optimizer.step()
            step_s = _max_over_ranks(time.perf_counter() - t0)
            per_slot: list[Any] = [None] * world_size
            dist.all_gather_object(per_slot, result.microbatch_s)
            if refitter is not None:
                update = refitter.record(
                    prepared.step,
                    prepared.plan,
                    per_slot,
                    step_s,
                    step_is_clean=registry.created == created,
                )
                if update is not None and not cfg.quiet:
                    print(refitter.summary_line(), file=sys.stderr, flush=True)
            if len(kept) < cfg.compare_steps:
                kept.append((prepared.batch, prepared.plan))
            if rank == 0:
                rec = StepRecord.from_plan(
                    prepared.step,
                    prepared.plan,
                    loss=result.loss,
                    measured_s=step_s,
                    solve_s=prepared.solve_s,
                    wait_s=prepared.wait_s,
                    step_overhead_ms=overhead_ms.get(prepared.step, cost.step_overhead_ms),
                    model=current,
                )
                steps.append(_step_row(prepared, rec, result.loss, step_s))
                _progress(
                    i + 1, cfg.steps, _step_line(prepared, rec, result.loss, step_s), cfg.quiet
                )
        sampler_report = pipeline.report()  # trained batches, not the prefetched one
    finally:
        pipeline.close()
    # Every rank prices the side-by-side with the model the run ended on (the refit one).
    final_spec: list[Any] = [refitter.model.to_spec() if refitter is not None else None]
    dist.broadcast_object_list(final_spec, src=0)
    priced = cost
    if final_spec[0] is not None:
        priced = load_cost_model(final_spec[0], world_size=world_size, gpus_per_node=world_size)

    comparison = _side_by_side(
        model, kept, index, registry, priced, sizes, device, cfg.compare_repeats
    )
    model.zero_grad(set_to_none=True)
    if rank != 0:
        return None
    return {
        "steps": steps,
        "comparison": comparison,
        "sampler": sampler_report,
        "refit": {
            "enabled": refitter is not None,
            "updates": refitter.updates if refitter is not None else [],
            "out": cfg.refit_out if refitter is not None and refitter.updates else None,
        },
        "config": {
            **{k: v for k, v in asdict(cfg).items() if k not in ("extra", "quiet")},
            "group_sizes": list(sizes),
            "max_trainable_length": max_len,
            "cost_model": cost.to_spec(),
            "model": {**DEMO_MODEL, "vocab_size": DEMO_VOCAB_SIZE},
        },
    }


def _step_row(prepared: Any, rec: Any, loss: float, step_s: float) -> dict[str, Any]:
    """One trained step in the demo's JSON (``rec``: its ``observe.StepRecord``)."""
    return {
        "step": prepared.step,
        "loss": loss,
        "group_sizes": rec.group_sizes,
        "microbatches": rec.microbatches,
        "step_s": step_s,
        "predicted_s": rec.predicted_ms / 1e3,
        "predicted_ms": rec.predicted_ms,
        "planned_ms": rec.planned_ms,
        "solve_ms": rec.solve_ms,
        "planner_wait_ms": rec.planner_wait_ms,
        "imbalance": rec.imbalance,
        "sequences": rec.num_sequences,
        "tokens": rec.tokens,
        "status": rec.status,
        # Groups, documents and lengths: what a replay of the refit re-prices.
        "plan": prepared.plan.to_dict(),
    }


def _step_line(prepared: Any, rec: Any, loss: float, step_s: float) -> str:
    """One trained step on the progress line."""
    from megatron_hsp.step.observe import layout_summary

    waited = f"  waited {rec.planner_wait_ms:.0f} ms" if rec.planner_wait_ms >= 1 else ""
    return (
        f"loss {loss:.4f}  {rec.num_sequences} docs {rec.tokens} tok  "
        f"{layout_summary(prepared.plan)}  {step_s * 1e3:.0f} ms "
        f"(pred {rec.predicted_ms:.0f})  solve {rec.solve_ms:.0f} ms" + waited
    )


def _side_by_side(
    model: Any,
    kept: list[tuple[Any, Any]],
    index: Any,
    registry: Any,
    priced: Any,
    sizes: Any,
    device: Any,
    repeats: int = 1,
) -> dict[str, Any]:
    """The kept batches re-run with their adaptive plans and with the smallest static degree that
    fits all of them, measured and priced by ``priced`` (the model the run ended on), then
    compared by ``megatron-hsp compare``'s own rule (``compare.compare_repeats``).

    Same batches, same weights: no optimizer step in between, so both layouts see identical
    parameters (the model is warm from training). Each batch runs ``repeats`` times per layout,
    the layouts alternating, so that a machine shared with other work slows both alike; one
    unmeasured pass of each layout first creates the process groups a static degree may not
    have used yet. Collective: every rank calls it.
    """
    import torch.distributed as dist

    from megatron_hsp.commands.compare import compare_repeats
    from megatron_hsp.evaluation.baselines import static_plan
    from megatron_hsp.planner.errors import HSPError
    from megatron_hsp.runtime.schedule import run_step
    from megatron_hsp.step.documents import DocumentReader
    from megatron_hsp.step.observe import plan_ms

    if not kept:
        return {}
    reader = DocumentReader(index)
    degree = None
    for d in sorted(sizes):
        try:
            for batch, _ in kept:
                static_plan(batch.lengths, priced, registry.cluster, d)
            degree = d
            break
        except HSPError:
            continue
    s_name = None if degree is None else f"static-{degree}"
    layouts = []
    for batch, adaptive in kept:
        plans = {"adaptive": adaptive}
        if s_name is not None:
            plans[s_name] = static_plan(batch.lengths, priced, registry.cluster, degree)
        layouts.append((batch, plans))

    def timed(batch: Any, plan: Any) -> float:
        docs = reader.batch_for_rank(batch, plan, registry.slot)
        dist.barrier()
        t0 = time.perf_counter()
        run_step(model, plan, docs, registry, grad_group=None, device=device)
        return _max_over_ranks(time.perf_counter() - t0)

    for plan in layouts[0][1].values():
        timed(layouts[0][0], plan)  # warm-up: group creation, first touches
    names = list(layouts[0][1])
    measured: dict[str, list[list[dict[str, Any]]]] = {n: [] for n in names}
    for _ in range(max(1, repeats)):
        for n in names:
            measured[n].append([])
        for batch, plans in layouts:
            for n in names:
                measured[n][-1].append(
                    {
                        "step": batch.step,
                        "measured_ms": 1e3 * timed(batch, plans[n]),
                        "planned_ms": plan_ms(plans[n], priced),
                        "batch_fingerprint": batch.fingerprint,
                        "plan": {"extra": {"method": n}},
                    }
                )
    rows = []
    for i, (batch, plans) in enumerate(layouts):
        row: dict[str, Any] = {"step": batch.step, "tokens": batch.tokens}
        for n, plan in plans.items():
            times = sorted(r[i]["measured_ms"] for r in measured[n])
            row[n] = {
                "measured_s": times[len(times) // 2] / 1e3,  # the median over the repeats
                # Both layouts priced by the one model the run ended on (the adaptive plan
                # was made under an earlier one while the refit settled).
                "predicted_ms": plan_ms(plan, priced),
                "microbatches": len(plan.microbatches),
                "group_sizes": [mb.group_sizes for mb in plan.microbatches],
            }
        rows.append(row)
    comparison: dict[str, Any] = {"static_degree": degree, "batches": rows, "repeats": repeats}
    if s_name is not None:
        result = compare_repeats(measured[s_name], measured["adaptive"], 0, s_name, "adaptive")
        comparison["compare"] = result
        comparison["speedup_measured"] = result["overall"]["measured_speedup"]
        comparison["speedup_predicted"] = result["overall"]["predicted_speedup"]
    return comparison


def run_torchrun(cfg: DemoConfig) -> dict[str, Any] | None:
    """One process of a torchrun / Slurm launch (env:// rendezvous, gloo, CPU)."""
    import torch

    from megatron_hsp.testing.dist import destroy_cpu_megatron, init_cpu_megatron

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["LOCAL_WORLD_SIZE"])))
    init_cpu_megatron(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), "env://")
    try:
        return demo_worker(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), cfg)
    finally:
        destroy_cpu_megatron()
