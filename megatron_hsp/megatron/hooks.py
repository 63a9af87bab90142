"""What HSP plugs into Megatron-LM's ``pretrain()``: dataset provider, forward step, step hooks.

Megatron seams used (no patch needed):
* ``train_valid_test_datasets_provider`` -> ``hsp_datasets_provider``: returns an *external* data
  iterator (``--dataloader-type external``) that yields this rank's planned micro-batches;
* ``forward_step_func`` -> ``hsp_forward_step``: runs the GPT model on one packed THD micro-batch
  whose ``PackedSeqParams.cp_group`` is the plan's group for this rank, per-token loss;
* the layer spec (``--spec megatron_hsp.megatron.layer_spec hsp_layer_spec``) puts HSP attention
  in every layer.

The one thing without a seam (a per-step hook that also hands the schedule the plan's micro-batch
count) is the ``train_step`` patch in ``patches.py``; it calls ``begin_step`` /
``current_num_microbatches`` here.

``selftest --megatron`` (``testing/megatron_loop.py``) runs this module under Megatron's own
``train_step`` on gloo CPU ranks against the stock path; ``pretrain()``/``train()`` themselves
need CUDA (docs/integration.md says what only a GPU run shows).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from megatron_hsp.megatron.args import HSPConfig
from megatron_hsp.planner.errors import InputError
from megatron_hsp.step.observe import StepObserver, StepRecord
from megatron_hsp.step.pipeline import PreparedStep, StepPipeline


@dataclass
class HSPRun:
    """Process-wide HSP state of one Megatron run (set by ``install``)."""

    config: HSPConfig
    pipeline: StepPipeline | None = None
    registry: Any = None
    observer: StepObserver | None = None
    current: PreparedStep | None = None
    inputs: list[Any] = field(default_factory=list)
    step_started: float = 0.0
    local_multiple: int = 1  # per-rank token count multiple (TP size under --sequence-parallel)
    device: Any = None
    step_overhead_ms: float = 0.0  # the cost model's per-step cost, added to each prediction
    te_layout: bool = False  # pad ring groups' documents for TE's context parallelism


_RUN: HSPRun | None = None


def active_run() -> HSPRun | None:
    return _RUN


def set_run(run: HSPRun | None) -> None:
    global _RUN
    _RUN = run


def data_prefix(args: Any) -> str:
    """The one indexed-dataset prefix HSP trains on (``--data-path PREFIX`` or ``1.0 PREFIX``)."""
    paths = list(getattr(args, "data_path", None) or [])
    if len(paths) == 2:
        try:
            float(paths[0])
            paths = paths[1:]
        except ValueError:
            pass
    if len(paths) != 1:
        raise InputError(
            f"--hsp trains on one indexed dataset: give --data-path PREFIX (got {paths or None}); "
            "blends and per-split paths are not supported yet"
        )
    return paths[0]


def build_pipeline(run: HSPRun, args: Any) -> StepPipeline:
    """Collective: creates the HSP process groups and (rank 0) the planner process."""
    import torch
    import torch.distributed as dist

    from megatron_hsp.runtime.groups import create_groups_from_megatron
    from megatron_hsp.step.documents import DocumentIndex
    from megatron_hsp.step.pipeline import build_step_pipeline
    from megatron_hsp.step.planner_service import PlannerSpec
    from megatron_hsp.step.sampler import SamplerConfig

    cfg = run.config
    # Lazy: a size's communicators are created the first time an agreed plan uses it.
    run.registry = create_groups_from_megatron(
        cfg.gpus_per_node, sizes=cfg.group_sizes, heads=_head_space(), lazy=True
    )
    spec = PlannerSpec(
        cost_model=cfg.cost_model,
        world_size=cfg.world_size,
        gpus_per_node=cfg.gpus_per_node,
        max_seq=cfg.max_seq,
        memory_cap_gb=cfg.memory_cap_gb,
        settings=cfg.planner,
    )
    cost = spec.load_cost_model()
    run.step_overhead_ms = cost.step_overhead_ms
    # The model's device: CUDA in training; CPU where there is none (``selftest --megatron``).
    run.device = (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available()
        else torch.device("cpu")
    )
    # Megatron's sequence parallelism splits each rank's tokens over the TP group again.
    tp = int(getattr(args, "tensor_model_parallel_size", 1) or 1)
    run.local_multiple = tp if getattr(args, "sequence_parallel", False) else 1
    # The layer spec's "auto" backend is Transformer Engine wherever TE and CUDA are present
    # (runtime.backends.make_backend); its context-parallel route needs padded documents.
    from megatron_hsp.runtime.backends import te_available

    run.te_layout = te_available()
    return build_step_pipeline(
        spec,
        DocumentIndex(data_prefix(args)),
        SamplerConfig(
            seed=cfg.seed,
            max_length=cost.max_trainable_length(list(cfg.group_sizes)),
            global_batch_docs=cfg.global_batch_docs,
            token_budget=cfg.token_budget,
            overlong=cfg.overlong,
        ),
        run.registry,
        rank=dist.get_rank(),
        background=cfg.background_planner,
        # Resume: Megatron restored args.iteration from the checkpoint; replaying that many
        # batches reads only lengths and lands on exactly the next unseen batch.
        resume_steps=int(getattr(args, "iteration", 0) or 0),
    )


class _MicroBatchIterator:
    """The external data iterator Megatron's schedule pulls micro-batches from."""

    def __init__(self, run: HSPRun) -> None:
        self.run = run

    def __iter__(self) -> _MicroBatchIterator:
        return self

    def __next__(self) -> Any:
        if not self.run.inputs:
            raise RuntimeError(
                "megatron-hsp: the schedule asked for more micro-batches than the plan has; "
                "train_step is not patched (was megatron_hsp.megatron.install called before "
                "pretrain()?)"
            )
        return self.run.inputs.pop(0)


def hsp_datasets_provider(train_val_test_num_samples: Any, vp_stage: Any = None) -> tuple:
    """``train_valid_test_datasets_provider`` for ``pretrain()``: HSP's iterator, no eval sets."""
    from megatron.training import get_args

    run = active_run()
    if run is None:
        raise RuntimeError("megatron-hsp: install() was not called before pretrain()")
    import torch.distributed as dist

    run.pipeline = build_pipeline(run, get_args())
    # Megatron logs and keeps its TensorBoard/W&B writers on the last rank; so do we. (Planner
    # waits are logged on rank 0, where the planner process runs.)
    if dist.get_rank() == dist.get_world_size() - 1:
        run.observer = StepObserver.from_megatron(
            log_interval=run.config.log_interval, plan_log=run.config.plan_log
        )
    return _MicroBatchIterator(run), None, None


hsp_datasets_provider.is_distributed = True  # every rank builds it: group creation is collective


def _head_space():
    """The model's heads per TP rank (``groupspace.HeadSpace``) from Megatron's args, so the
    registry pre-creates each block's Ulysses/ring sub-groups."""
    from megatron.core import parallel_state as ps
    from megatron.training import get_args

    from megatron_hsp.planner.groupspace import HeadSpace

    args = get_args()
    kv = args.num_query_groups if getattr(args, "group_query_attention", False) else None
    tp = ps.get_tensor_model_parallel_world_size()
    return HeadSpace.from_model(args.num_attention_heads, kv, tp)


def begin_step(run: HSPRun) -> None:
    """Prepare the step about to run: plan (waits only if the planner is late), dispatch.

    The inputs come from ``schedule.step_inputs``, the one builder ``run_step`` (demo, selftest)
    uses too, so the ring layout and process-group binding cannot differ between them.
    """
    from megatron_hsp.runtime.schedule import step_inputs

    assert run.pipeline is not None
    prepared = run.pipeline.next_step()
    run.inputs = step_inputs(
        prepared.tokens,
        prepared.plan,
        run.registry,
        run.device,
        local_multiple=run.local_multiple,
        te_layout=run.te_layout,
    )
    run.current = prepared
    run.step_started = time.perf_counter()


def end_step(run: HSPRun, loss: float | None = None) -> None:
    if run.current is None or run.observer is None:
        return
    p = run.current
    rec = StepRecord.from_plan(
        p.step,
        p.plan,
        loss=loss,
        measured_s=time.perf_counter() - run.step_started,
        solve_s=p.solve_s if p.solve_s else None,
        wait_s=p.wait_s,
        step_overhead_ms=run.step_overhead_ms,
    )
    run.observer.record(rec, p.plan)


def current_num_microbatches(run: HSPRun) -> int:
    assert run.current is not None, "megatron-hsp: no step prepared"
    return len(run.current.plan.microbatches)


def _loss_func(loss_mask: Any, output_tensor: Any, num_tokens_override: int | None = None):
    """Megatron's ``--calculate-per-token-loss`` contract: (loss sum, token count, report).

    The reduction is ``runtime.loss.microbatch_loss``, the same one ``run_step`` (demo, selftest)
    uses; only the report dict is Megatron-specific.
    """
    import torch

    from megatron_hsp.runtime.loss import microbatch_loss

    loss_sum, num_tokens = microbatch_loss(output_tensor, loss_mask)
    report = torch.cat([loss_sum.detach().view(1), num_tokens.float().view(1)])
    return loss_sum, num_tokens, {"lm loss": report}


def hsp_forward_step(data_iterator: Any, model: Any, return_schedule_plan: bool = False):
    """``forward_step_func`` for ``pretrain()``: one planned THD micro-batch of this rank.

    The model call (and the zero output of a rank whose group trains nothing in this micro-batch)
    is ``runtime.schedule.forward_microbatch``, shared with ``run_step``.
    """
    from megatron_hsp.runtime.schedule import forward_microbatch

    if return_schedule_plan:
        raise InputError("--hsp does not support --overlap-moe-expert-parallel-comm")
    output, loss_mask = forward_microbatch(model, next(data_iterator))
    return output, partial(_loss_func, loss_mask)
