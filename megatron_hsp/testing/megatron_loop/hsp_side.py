"""The HSP side, as users get it: Megatron's parser and ``validate_args`` on the user's flags plus
``--hsp ...``, ``megatron_hsp.megatron.install``, HSP's dataset provider and ``hsp_forward_step``,
the model from HSP's ``--spec``, then Megatron's patched ``train_step`` and ``evaluate()``; the
restart through Megatron's own checkpointing (``--save``/``--load``) and the refused resume; what
HSP's samplers drew, for the sampler oracle. The whole loop: the package's docstring."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence
from typing import Any

import torch

from megatron_hsp.testing.megatron_loop.models import (
    _chunk_parameters,
    _hsp_model,
    _load_weights,
    _megatron_args,
    _set_megatron_globals,
    _step_record,
    _wrap,
    param_grads,
)
from megatron_hsp.testing.megatron_loop.options import (
    CONTINUE_EPOCHS,
    EVAL_INTERVAL,
    EVAL_ITERS,
    MODEL_FLAGS,
    RESUME_AFTER,
    LoopOptions,
)
from megatron_hsp.testing.megatron_loop.plants import PLANTS

NO_REFIT = "--hsp-no-refit"  # not passed by the loop (refit on, as users run it)


def plan_log_path(cost_path: str) -> str:
    """Where an option set with ``plan_log`` writes its ``--hsp-plan-log`` (beside its cost
    model file, in the run's temporary directory; the driver returns its rows)."""
    return cost_path + ".plans.jsonl"


def _hsp_argv(
    options: LoopOptions, prefixes: Sequence[str], cost_path: str, nproc: int
) -> list[str]:
    """What a user passes Megatron for the HSP side: the model, the option set, ``--hsp ...``
    and Megatron's data flags."""
    # Users' defaults but for ``TEST_ONLY_SWITCHES`` (options.py, each with its reason): the
    # online refit on (it re-plans later steps from this machine's timings; what is trained
    # must not change), the default overlong policy, --hsp-max-seq from --seq-length, the GPUs
    # per node from LOCAL_WORLD_SIZE (the worker sets it, as torchrun does).
    hsp_flags = [
        *("--hsp", "--hsp-solver", "greedy", "--hsp-sync-planner"),
        *("--hsp-cost-model", cost_path),
        *options.hsp_flags(),
        *options.data_flags(prefixes),
        *(["--hsp-plan-log", plan_log_path(cost_path)] if options.plan_log else []),
    ]
    return [*MODEL_FLAGS, *options.flags(), *options.pipeline_flags(), *hsp_flags]


def _start_hsp(argv: list[str]) -> tuple[Any, Any, Any]:
    """Megatron's parse/validate, globals and ``install`` for the HSP side: (args, provider,
    forward step). A restart's ``iteration`` and consumed samples are set afterwards by
    Megatron's ``load_checkpoint`` (``_load_through_megatron``), before the provider runs, as
    ``pretrain()`` orders it."""
    from megatron_hsp.megatron import install

    args = _megatron_args(argv)
    # What setup_model_and_optimizer leaves in args when there is nothing to load.
    fresh = {"iteration": 0, "consumed_train_samples": 0, "consumed_valid_samples": 0}
    for key, value in fresh.items():
        setattr(args, key, value)
    _set_megatron_globals(args)
    provider, forward_step = install(args, None, None)
    return args, provider, forward_step


def _hsp_iterators(provider: Any, chunks: int = 1) -> tuple[Any, Any, Any]:
    """The training, validation and test iterators as ``pretrain()`` builds them from the
    provider: Megatron's own ``build_train_valid_test_data_iterators`` (sample counts, the
    ``is_distributed`` provider called on every rank, external loaders passed through and
    wrapped in ``RerunDataIterator``, ``do_valid``/``do_test`` agreed over ranks). Under
    virtual pipeline stages (``chunks`` > 1), as ``setup_model_and_optimizer``'s caller does:
    the provider once per chunk (``vp_stage``), each split a list of per-chunk iterators."""
    import functools

    import megatron.training.training as training

    if chunks == 1:
        return training.build_train_valid_test_data_iterators(provider)
    per_chunk = []
    for vp_stage in range(chunks):
        chunk_provider = functools.partial(provider, vp_stage=vp_stage)
        chunk_provider.is_distributed = getattr(provider, "is_distributed", False)
        per_chunk.append(training.build_train_valid_test_data_iterators(chunk_provider))
    train, valid, test = (list(split) for split in zip(*per_chunk, strict=True))
    return train, valid, test


def _uninterrupted(run: Any, steps: int) -> dict[str, list[list[tuple[int, int, int]]]]:
    """The batches an uninterrupted run draws from a fresh provider: copies of each split's
    sampler before anything is drawn, ``steps`` training batches and every evaluation batch the
    loop will ask for. Compared with what the run trained and evaluated across evaluations and
    the restart: evaluation must not move the training sampler, a resume must land on the next
    batch of each."""
    import copy

    def draw(sampler: Any, n: int) -> list[list[tuple[int, int, int]]]:
        fresh = copy.deepcopy(sampler)
        return [[(p.doc, p.offset, p.length) for p in fresh.next_batch().pieces] for _ in range(n)]

    train = draw(run.pipeline.sampler, steps + 2)
    # The batch after the one prefetched at the end: what the live training sampler must draw
    # next (evaluation drawing from it would move it on, even where the prefetch hides it).
    out = {"train": train[:steps], "train_next": [train[-1]]}
    counts = {"valid": steps // EVAL_INTERVAL * EVAL_ITERS, "test": EVAL_ITERS}
    for split, ev in run.evaluation.items():
        out[split] = draw(ev.pipeline.sampler, counts[split])
    return out


def _drawn_streams(
    run: Any, trained: Sequence[Sequence[tuple[int, int, int]]], evaluations: Sequence[dict]
) -> dict[str, list[tuple[int, int, int]]]:
    """Per split, every piece drawn, in draw order: what was trained or evaluated (across the
    restart), then ``CONTINUE_EPOCHS`` times the split's sequences more from a copy of its live
    sampler restored to the pipeline's resume point (``StepPipeline.state_dict``: after the
    batches handed out, before any prefetched one). The oracle's once-per-epoch check reads it."""
    import copy

    def more(pipeline: Any) -> list[tuple[int, int, int]]:
        sampler = copy.deepcopy(pipeline.sampler)
        sampler.load_state_dict(pipeline.state_dict())
        out: list[tuple[int, int, int]] = []
        while len(out) < CONTINUE_EPOCHS * sampler.num_sequences:
            out += [(p.doc, p.offset, p.length) for p in sampler.next_batch().pieces]
        return out

    streams = {"train": [tuple(p) for b in trained for p in b] + more(run.pipeline)}
    for split, ev in run.evaluation.items():
        done = [
            tuple(p) for e in evaluations if e["split"] == split for b in e["pieces"] for p in b
        ]
        streams[split] = done + more(ev.pipeline)
    return streams


def _evaluate(
    args: Any, split: str, forward_step: Any, iterator: Any, model: Any, config: Any, it: int
) -> dict[str, Any]:
    """Megatron's own ``evaluate()`` on one split, as ``train()`` (validation, every
    ``--eval-interval`` steps) and ``pretrain()`` (test, at the end) call it."""
    import megatron.training.training as training

    from megatron_hsp.megatron import hooks

    evaluation = hooks.eval_iterator_of(iterator)
    before = 0 if evaluation is None else len(evaluation.batches)
    losses, _, _ = training.evaluate(forward_step, iterator, model, None, config, verbose=False)
    loss = losses.get("lm loss")  # on the last pipeline stage only
    record: dict[str, Any] = {
        "after_step": it,
        "split": split,
        "loss": _last_stage_value(None if loss is None else float(loss)),
        "consumed_valid_samples": int(args.consumed_valid_samples),
    }
    if evaluation is not None:
        record["pieces"] = [
            [(p.doc, p.offset, p.length) for p in b.pieces] for b in evaluation.batches[before:]
        ]
    return record


def _run_hsp(
    options: LoopOptions,
    prefixes: Sequence[str],
    cost_path: str,
    nproc: int,
    steps: int,
    init: dict[str, torch.Tensor],
    plant: str | None = None,
) -> dict[str, Any]:
    import megatron.training.training as training
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_hsp.megatron import hooks, patches

    argv = _hsp_argv(options, prefixes, cost_path, nproc)
    if options.resume:
        argv = _with_checkpointing(argv, os.path.splitext(cost_path)[0] + ".checkpoints")
    args, provider, forward_step = _start_hsp(argv)
    with contextlib.ExitStack() as stack:
        stack.callback(_close_hsp_run, hooks, patches)
        hook = _plant_or_fault(plant)(stack) if plant is not None else None
        chunks = _hsp_model(args)
        _load_weights(chunks, init)
        model, optimizer, scheduler, config = _wrap(args, chunks)
        moe = _moe_record(model[0])
        if hook is not None:
            hook(model, optimizer, config)
        _load_through_megatron(args, model, optimizer, scheduler)  # nothing there yet: step 0
        train_it, valid_it, test_it = _hsp_iterators(provider, len(chunks))
        run = hooks.active_run()
        expected = _uninterrupted(run, steps)
        resume = None
        heads = options.heads()
        records, pieces, grads, evaluations = [], [], [], []
        for it in range(steps):
            if options.resume and it == RESUME_AFTER:
                # A restart through Megatron's own checkpointing: save_checkpoint after step
                # it - 1, everything dropped, a fresh model, optimizer and scheduler restored by
                # load_checkpoint, HSP rebuilt from the flags (docs/reliability.md).
                saved = _save_through_megatron(it, model, optimizer, scheduler)
                _close_hsp_run(hooks, patches)
                del model, optimizer, scheduler, chunks, train_it, valid_it, test_it, run
                refused = _refused_resume(argv)
                args, provider, forward_step = _start_hsp(argv)
                chunks = _hsp_model(args)  # fresh: its own initial weights, not the trained
                model, optimizer, scheduler, config = _wrap(args, chunks)
                if hook is not None:
                    hook(model, optimizer, config)
                _load_through_megatron(args, model, optimizer, scheduler)
                resume = {**_resume_record(args, saved, chunks, scheduler), **refused}
                train_it, valid_it, test_it = _hsp_iterators(provider, len(chunks))
                run = hooks.active_run()
            # Rank 0's refit updates accepted so far: the in-process planner prices this step's
            # plan with the last of them (the report's entry is rank 0's).
            refits = (
                None if run.refitter is None else sum(u["accepted"] for u in run.refitter.updates)
            )
            out = training.train_step(
                forward_step,
                train_it,
                model,
                optimizer,
                scheduler,
                config,
                get_forward_backward_func(),
                iteration=it,
            )
            grads.append(param_grads(model, options.distributed_optimizer))
            rec = _step_record(args, out, scheduler, optimizer)
            rec["loss"] = _last_stage_value(rec["loss"])
            plan = run.current.plan
            rec["plan_microbatches"] = len(plan.microbatches)
            # What the schedule ran: the plan's count, padded under interleaving (hooks._prepare)
            rec["schedule_microbatches"] = hooks.current_num_microbatches(run)
            rec["documents"] = len(run.current.batch.pieces)
            rec["tokens"] = int(sum(run.current.batch.lengths))
            rec["token_budget"] = getattr(run.config, "token_budget", None)
            rec["refit_on"] = run.clock is not None  # the online refit measures this run
            rec["refit_updates_before"] = refits
            rec["fingerprint"] = run.current.batch.fingerprint
            rec["plan_method"] = str(plan.extra.get("method", "hsp"))
            rec["layouts"] = [
                [_layout(g, heads) for g in mb.groups if g.seq_ids] for mb in plan.microbatches
            ]
            # Groups without documents in a micro-batch: skipped, or run on padding under
            # expert parallelism (their ranks join the MoE all-to-alls).
            rec["empty_groups"] = sum(not g.seq_ids for mb in plan.microbatches for g in mb.groups)
            records.append(rec)
            # Plan data only: which piece of which document; the stock side reads the tokens.
            pieces.append([(p.doc, p.offset, p.length) for p in run.current.batch.pieces])
            if options.evaluation and (it + 1) % EVAL_INTERVAL == 0:
                evaluations.append(
                    _evaluate(args, "valid", forward_step, valid_it, model, config, it)
                )
        if options.evaluation:
            evaluations.append(
                _evaluate(args, "test", forward_step, test_it, model, config, steps - 1)
            )
        weights = {n: p.detach().clone() for n, p in _chunk_parameters(chunks).items()}
        drawn = _drawn_streams(run, pieces, evaluations)
        next_draw = run.pipeline.sampler.next_batch().pieces  # after the run: harmless
        return {
            "pipeline": _pipeline_record(chunks, get_forward_backward_func()),
            "train_next": [[(p.doc, p.offset, p.length) for p in next_draw]],
            "records": records,
            "pieces": pieces,
            "grads": grads,
            "weights": weights,
            "evaluations": evaluations,
            "expected": expected,
            "drawn": drawn,
            "resume": resume,
            "moe": moe,
            # The longest trainable length: longer documents are cut into pieces of it (the
            # default --hsp-overlong split); the sampler oracle expects those pieces.
            "max_length": int(run.pipeline.sampler.config.max_length),
        }


def _last_stage_value(value: Any) -> Any:
    """``value`` as the last global rank holds it (the last pipeline stage, where Megatron's
    schedule reduces the loss; other stages get none); the value itself without a pipeline."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    if parallel_state.get_pipeline_model_parallel_world_size() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=dist.get_world_size() - 1)
    return box[0]


def _pipeline_record(chunks: Sequence[torch.nn.Module], schedule: Any) -> dict[str, Any]:
    """What the HSP side ran: pipeline stages and this rank's stage, model chunks per rank,
    Megatron's schedule function and whether activations exchange shapes per micro-batch."""
    from megatron.core import parallel_state
    from megatron.core.utils import get_model_config

    return {
        "pp": parallel_state.get_pipeline_model_parallel_world_size(),
        "model_chunks": len(chunks),
        "schedule": getattr(schedule, "__name__", str(schedule)),
        "variable_seq_lengths": bool(get_model_config(chunks[0]).variable_seq_lengths),
        "layers_per_chunk": [len(c.decoder.layers) for c in chunks],
    }


def _moe_record(ddp: Any) -> dict[str, Any] | None:
    """What the HSP model's MoE layers ran with, read from the model and megatron's groups
    (None for a dense model): experts on this rank, expert-parallel and expert-data-parallel
    sizes, the router class, and how many parameters DDP reduces over the expert groups."""
    from megatron.core import parallel_state
    from megatron.core.transformer.moe.moe_layer import MoELayer

    layers = [m for m in ddp.module.modules() if isinstance(m, MoELayer)]
    if not layers:
        return None
    return {
        "moe_layers": len(layers),
        "local_experts": len(layers[0].experts.local_experts),
        "ep": parallel_state.get_expert_model_parallel_world_size(),
        "expert_dp": parallel_state.get_expert_data_parallel_world_size(),
        "routers": sorted({type(m.router).__name__ for m in layers}),
        "expert_params": sum(len(b.param_index_map) for b in ddp.expert_parallel_buffers),
    }


def _layout(group: Any, heads: Any) -> dict[str, int]:
    """A group's size and the (Ulysses, ring) split it runs with (the plan's, else the default
    split of the model's heads per TP rank, as the runtime picks it)."""
    u, r = (group.ulysses, group.ring) if group.ulysses else heads.split(group.size)
    return {"size": group.size, "ulysses": u, "ring": r}


def _close_hsp_run(hooks: Any, patches: Any) -> None:
    run = hooks.active_run()
    if run is not None and run.pipeline is not None and run.pipeline.planner is not None:
        run.pipeline.planner.close()
    patches.remove_patches()
    hooks.set_run(None)


# Megatron's legacy per-rank checkpoint format: a plain torch.save per rank (and the
# distributed optimizer's state gathered on data-parallel rank 0 over the gloo group). The
# distributed format (torch_dist) is not used here: docs/reliability.md says why.
CKPT_FORMAT = "torch"


def _with_checkpointing(argv: list[str], directory: str) -> list[str]:
    """``argv`` with ``--save``/``--load`` as a user who resumes passes them: one directory for
    both, given from the first run on (its ``load_checkpoint`` finds nothing: step 0).

    Without ``--disable-gloo-process-groups``: Megatron's legacy format gathers the distributed
    optimizer's state over its gloo groups (``validate_args`` refuses it without them). With
    ``--no-load-rng``: on the CPU the model-parallel RNG tracker holds no states (no
    ``model_parallel_cuda_manual_seed``, ``testing.dist``), and ``load_checkpoint`` stops on an
    empty one; this model has no dropout, so training draws nothing from it.
    """
    return [
        *(flag for flag in argv if flag != "--disable-gloo-process-groups"),
        *("--save", directory, "--load", directory, "--no-load-rng"),
        *("--ckpt-format", CKPT_FORMAT, "--save-interval", str(RESUME_AFTER)),
    ]


def _save_through_megatron(
    iteration: int, model: list[Any], optimizer: Any, scheduler: Any
) -> dict[str, torch.Tensor]:
    """Megatron's own ``save_checkpoint`` after ``iteration`` steps, as ``train()`` calls it
    (``--save``); returns the weights saved, to check that the load restores them."""
    from megatron.training.checkpointing import save_checkpoint

    save_checkpoint(iteration, model, optimizer, scheduler, 0)
    return {n: p.detach().clone() for n, p in _chunk_parameters([m.module for m in model]).items()}


def _load_through_megatron(args: Any, model: list[Any], optimizer: Any, scheduler: Any) -> None:
    """What ``setup_model_and_optimizer`` does under ``--load``: Megatron's own
    ``load_checkpoint`` restores model, optimizer, scheduler and (into ``args``) the consumed
    train and validation samples; its caller sets ``args.iteration`` from what it returns.
    The distributed optimizer's state goes into torch's Adam through
    ``cpu_shims.torch_adam_distributed_optimizer_load`` (megatron-core 0.19.2 expects TE's or
    Apex's ``FusedAdam`` there; the shim's docstring says what it changes: no value).
    """
    if not args.load:
        return
    from megatron.training.checkpointing import load_checkpoint

    from megatron_hsp.testing.cpu_shims import torch_adam_distributed_optimizer_load

    with torch_adam_distributed_optimizer_load():
        args.iteration, args.num_floating_point_operations_so_far = load_checkpoint(
            model, optimizer, scheduler
        )


CHANGED_SPLIT = "5,2,1"  # a --split other than the checkpoint's, for the resume guard


def _refused_resume(argv: list[str]) -> dict[str, Any]:
    """A restart from the checkpoint with ``--split CHANGED_SPLIT``: after Megatron's
    ``load_checkpoint`` set ``args.iteration``, HSP's resume guard must stop it in the dataset
    provider, one line on stderr (rank 0) and exit 2 on every rank. Returns whether every rank
    exited 2 and rank 0's ``megatron-hsp: error:`` lines."""
    import io

    import torch.distributed as dist

    from megatron_hsp.megatron import hooks, patches

    changed = list(argv)
    changed[changed.index("--split") + 1] = CHANGED_SPLIT
    err, code = io.StringIO(), None
    try:
        with contextlib.redirect_stderr(err):
            args, provider, _ = _start_hsp(changed)
            model, optimizer, scheduler, _ = _wrap(args, _hsp_model(args))
            _load_through_megatron(args, model, optimizer, scheduler)
            _hsp_iterators(provider)
    except SystemExit as exc:
        code = exc.code
    finally:
        _close_hsp_run(hooks, patches)
    exited = torch.tensor([float(code == 2)])
    dist.all_reduce(exited, op=dist.ReduceOp.MIN)
    lines = [x for x in err.getvalue().splitlines() if x.startswith("megatron-hsp: error:")]
    return {"changed_split_exit_2_everywhere": bool(exited.item()), "refusal_lines": lines}


def _resume_record(
    args: Any, saved: dict[str, torch.Tensor], chunks: Sequence[torch.nn.Module], scheduler: Any
) -> dict[str, Any]:
    """What the load restored (``_resume_checks`` compares it with the stock run at that step):
    ``args``' iteration and consumed samples, the scheduler's step count, whether every rank's
    fresh model now holds the saved weights bit for bit, and whether the resume guard's record
    is in the directory."""
    import torch.distributed as dist

    from megatron_hsp.megatron.hooks import DATA_RECORD

    own = _chunk_parameters(chunks)
    same = torch.tensor(
        [float(sorted(own) == sorted(saved) and all(torch.equal(own[n], saved[n]) for n in saved))]
    )
    dist.all_reduce(same, op=dist.ReduceOp.MIN)
    return {
        "format": args.ckpt_format,
        "iteration": int(args.iteration),
        "consumed_train_samples": int(args.consumed_train_samples),
        "consumed_valid_samples": int(args.consumed_valid_samples),
        "scheduler_num_steps": int(scheduler.num_steps),
        "weights_restored": bool(same.item()),
        "guard_record": os.path.isfile(os.path.join(args.load, DATA_RECORD)),
    }


def _plant_or_fault(name: str) -> Any:
    """A planted bug (``plants.PLANTS``) or a fault HSP must absorb (``faults.FAULTS``)."""
    from megatron_hsp.testing.megatron_loop.faults import FAULTS

    return PLANTS[name] if name in PLANTS else FAULTS[name]
