"""``selftest --megatron``: Megatron's own ``train_step`` with HSP installed vs the stock path, CPU.

What runs, on 4 gloo CPU ranks, for each option set (``DEFAULT_OPTIONS``: plain DDP, distributed
optimizer, overlapped grad reduce, tensor parallel 2 with ``--sequence-parallel`` under Ulysses
and under ring groups, pure-ring and hybrid Ulysses x ring groups):

* **HSP side, as users get it.** Megatron's real argument parser and ``validate_args`` on the
  flags a user passes plus ``--hsp ...`` (through ``hsp_extra_args_provider``); Megatron's
  ``set_global_variables``; ``megatron_hsp.megatron.install(args, ...)`` (validation, patches);
  HSP's dataset provider (indexed dataset on disk, document sampler, planner, plan agreement) and
  ``hsp_forward_step``; the model built from the layer spec HSP's ``--spec`` loads
  (``layer_spec.hsp_spec_from_args``); megatron-core ``DistributedDataParallel``, Megatron's
  optimizer (``get_megatron_optimizer``), ``finalize_model_grads`` and opt-param scheduler
  (``get_optimizer_param_scheduler``); then ``megatron.training.training.train_step`` (patched).
* **Stock side.** The same flags without ``--hsp``: stock megatron-core local spec (its own
  ``DotProductAttention`` with a causal mask, its own RoPE), each document its own ``[1, L]``
  micro-batch over the data-parallel ranks (micro-batch size 1, so ``global batch / dp``
  micro-batches per rank: the documents of the HSP step, in order, round-robin), a
  ``pretrain_gpt.py``-style forward step and per-token loss written here from Megatron's
  documented contract (no HSP code), and Megatron's unpatched ``train_step``. Its tokens are read
  with megatron-core's own ``IndexedDataset`` (``MegatronDocuments``), never with HSP's
  ``DocumentReader``: only the sampler's choice (document id, offset, length of each piece) is
  taken from the HSP side, as plan data. Under ``--sequence-parallel`` each document is padded at
  its end to a multiple of the TP size with loss mask 0 (causal: no real token sees the padding).
* **Megatron's own bookkeeping, driven apart from both runs.** The expected learning rate of each
  step comes from a fresh ``OptimizerParamScheduler`` (built by Megatron's
  ``get_optimizer_param_scheduler`` from the same flags) stepped by ``--global-batch-size``; the
  expected consumed samples from Megatron's ``MegatronPretrainingSampler`` on every
  data-parallel rank, fed ``ConstantNumMicroBatchesCalculator``'s count of micro-batches.

Both start from the same weights (the stock model's, copied by parameter name). Per step the
comparison covers the reduced loss, each parameter's gradient on its own scale (the DDP gradient
buffer after ``finalize_model_grads``, cut back into parameters by the buffer's
``param_index_map``; under the distributed optimizer each rank's shard, per parameter slice that
falls in it), the learning rate and consumed samples against Megatron's own values (above), the
documents trained against Megatron's sample count, and the grad norm; after the steps, each
parameter's weights.

Issue 18's option set adds, on both sides: Megatron's own ``evaluate()`` on the validation split
after every step and on the test split at the end (HSP: planned batches of the splits' own
samplers through the patched ``get_forward_backward_func``; stock: the same documents as
``[1, L]`` samples, unpatched), a two-dataset blend (``--data-path 0.4 A 0.6 B``, the stock side
reading both with ``IndexedDataset``), and a restart of the HSP side after step 2 through
Megatron's own checkpointing (``--save``/``--load``, ``--ckpt-format torch``): Megatron's
``save_checkpoint``, everything dropped, a fresh model, optimizer and scheduler from the flags
restored by Megatron's ``load_checkpoint`` (which also restores ``args``' consumed samples), HSP
rebuilt from the flags; the stock side runs through. Checked besides: every batch trained or
evaluated is an uninterrupted run's, lies in Megatron's own split of its dataset, the blend's
token shares follow its weights, and what the load restored (iteration, consumed samples, the
scheduler's steps, the weights bit for bit, HSP's resume record) is what the uninterrupted run
had at the save (``_data_checks``).

Issue 33: the stock side reads the pieces HSP's sampler chose, so which documents are drawn is
judged apart, in every option set, by ``testing/sampler_oracle.py`` (no HSP code): every
document of megatron-core's own split (its dataset builder run on ``IndexedDataset``) with >= 2
tokens is drawn once per epoch, over the pieces trained and evaluated (across the restart) and
more drawn from copies of the live samplers; a blend's draws follow the deficit rule re-run on
the pieces' lengths, its token shares within the rule's bound. ``EVAL_SPLIT`` puts no split
boundary on an integer. ``margins`` reports every check's worst over its tolerance.

Issue 17's option sets run the HSP side on 2 pipeline stages (``--pipeline-model-parallel-size
2``: 1F1B, then interleaved with a chunk per virtual stage, and evaluating): Megatron's parallel
state with the pipeline for the HSP side only (``_pipeline_state``), its model chunks built as
``training.get_model`` builds them (``_hsp_model``), its provider called once per chunk
(``_hsp_iterators``). The stock side is the *unpipelined* model on the same documents (why:
``_pipeline_state``); parameters are compared by their unpipelined names (``global_names``:
a stage's ``decoder.layers.<i>`` by its global layer number), each on the stage that holds it.

What ``train()`` does around ``train_step`` is not run (it is one long function without a seam).
The few lines this loop needs from it are reproduced and named: the ``config`` hooks
``train()`` sets before its loop (``grad_scale_func``, ``no_sync_func``/``grad_sync_func`` under
``--overlap-grad-reduce``, ``finalize_model_grads_func``) and its consumed-samples update
(``args.consumed_train_samples += dp * micro_batch_size * get_num_microbatches()``, read from
``megatron.training.training`` so a patched count would show). Device placement shims:
``testing.cpu_shims`` only (listed in ``megatron/patches.py``).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
from collections.abc import Sequence
from typing import Any

import torch

from megatron_hsp.testing.megatron_loop.checks import (
    _data_checks,
    _worst,
    check,
    check_data,
    format_margin,
    margin,
    megatron_schedule,
    per_param_diff,
    worst_check,
)
from megatron_hsp.testing.megatron_loop.corpus import BLEND_CHOICES, write_corpus
from megatron_hsp.testing.megatron_loop.models import (
    _chunk_parameters,
    _hsp_model,
    _initial_weights,
    _load_weights,
    _megatron_args,
    _set_megatron_globals,
    _step_record,
    _wrap,
    param_grads,
)
from megatron_hsp.testing.megatron_loop.options import (
    CONTINUE_EPOCHS,
    DEFAULT_OPTIONS,
    EVAL_INTERVAL,
    EVAL_ITERS,
    MODEL_FLAGS,
    RESUME_AFTER,
    STEPS,
    LoopOptions,
)
from megatron_hsp.testing.megatron_loop.plants import PLANT_RUNS, PLANTED, PLANTS
from megatron_hsp.testing.megatron_loop.stock_side import _run_stock


def run_megatron_plants(
    nproc: int = 4, timeout_s: float = 900.0, plants: Sequence[str] | None = None
) -> list[dict[str, Any]]:
    """Each plant of ``PLANTS`` on its option set (``PLANT_RUNS``), all in one spawn: one entry
    per plant with ``caught`` (the loop's comparison failed, as it must), its worst check and
    margin (``margins``) and the first failures it gave."""
    by_label = {o.label: o for o in DEFAULT_OPTIONS}
    names = list(PLANT_RUNS if plants is None else plants)
    runs = [(by_label[PLANT_RUNS[p][0]], PLANT_RUNS[p][1], p) for p in names]
    out = []
    for plant, entry in zip(names, _run_loops(nproc, runs, timeout_s), strict=True):
        label, steps = PLANT_RUNS[plant]
        out.append(
            {
                "plant": plant,
                "options": label,
                "steps": steps,
                "caught": not entry["ok"],
                "margin": entry["margin"],
                "worst_check": entry["worst_check"],
                "failures": entry["failures"][:3],
                "entry": entry,
            }
        )
    return out


NO_REFIT = "--hsp-no-refit"


def _hsp_argv(
    options: LoopOptions, prefixes: Sequence[str], cost_path: str, nproc: int
) -> list[str]:
    """What a user passes Megatron for the HSP side: the model, the option set, ``--hsp ...``
    and Megatron's data flags."""
    hsp_flags = [
        *("--hsp", "--hsp-solver", "greedy", "--hsp-sync-planner"),
        # The online refit (on by default) would re-plan from this machine's timings: the loop
        # checks exactness on reproducible plans (megatron_loop/refit.py runs the refit).
        NO_REFIT,
        *("--hsp-gpus-per-node", str(nproc), "--hsp-max-seq", "256"),
        *("--hsp-cost-model", cost_path),
        *options.hsp_flags(),
        *options.data_flags(prefixes),
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
        hook = PLANTS[plant](stack) if plant is not None else None
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


def _worker_all(
    rank: int,
    world_size: int,
    prefixes: tuple[str, ...],
    runs: tuple[tuple[LoopOptions, str, int, str | None], ...],
) -> list[dict[str, Any]]:
    """Every run (option set, cost model file, steps, plant) in turn, in this rank's process
    (Megatron's globals are reset each time; megatron's parallel state is re-initialised for
    each option set's TP size; a plant is undone when its run ends)."""
    from megatron_hsp.testing.dist import init_cpu_megatron

    out = []
    for options, cost_path, steps, plant in runs:
        init_cpu_megatron(
            rank,
            world_size,
            "",
            tensor_model_parallel_size=options.tp,
            gloo_process_groups=options.resume,  # Megatron's legacy checkpoint uses them
            expert_model_parallel_size=options.ep,
        )
        out.append(_worker(rank, world_size, prefixes, cost_path, options, steps, plant))
    return out


def _worker(
    rank: int,
    world_size: int,
    prefixes: tuple[str, ...],
    cost_path: str,
    options: LoopOptions,
    steps: int,
    plant: str | None,
) -> dict[str, Any]:
    """Both runs on this rank; returns per-step comparisons (max-reduced over ranks)."""
    from megatron_hsp.testing.cpu_shims import cpu_device_arch_version, cpu_megatron_training
    from megatron_hsp.testing.dist import report_progress

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    os.environ["LOCAL_WORLD_SIZE"] = str(world_size)
    if options.tp > 1:
        # What Megatron's validate_args requires of a tensor-parallel user on pre-Blackwell GPUs
        # (and asks of every CPU run, whose "device arch" reads as 0).
        os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"
    PLANTED.clear()
    # Megatron prints its argument table and HSP its step lines on stdout: keep stdout for the
    # parent's report (``selftest --json``) and send them to stderr.
    with (
        contextlib.redirect_stdout(sys.stderr),
        cpu_megatron_training(),
        cpu_device_arch_version(),
    ):
        stock_init = _initial_weights(options)
        with _pipeline_state(rank, world_size, options):
            hsp = _run_hsp(options, prefixes, cost_path, world_size, steps, stock_init, plant)
        report_progress()  # each half of each option set moves the test's hang timeout on
        ref = _run_stock(options, prefixes, hsp["pieces"], stock_init, hsp["evaluations"])
        report_progress()
        expected = megatron_schedule(ref["args"], steps)
    data = _data_checks(options, hsp, ref)
    out = []
    smallest = None
    for i in range(steps):
        h, r, m = hsp["records"][i], ref["records"][i], expected[i]
        rel, peak = per_param_diff(hsp["grads"][i], ref["grads"][i], ref["grads"][i])
        worst, worst_rel = _worst(rel)
        top = max(peak.values())
        # What a single ratio over all buffers (this loop before issue 16) would have reported.
        pooled = max(rel[n] * peak[n] for n in rel) / top
        small = min((n for n in peak if peak[n] > 0), key=lambda n: peak[n])
        smallest = smallest or small
        out.append(
            {
                "step": i,
                "loss_hsp": h["loss"],
                "loss_ref": r["loss"],
                "lr_hsp": h["lr"],
                "lr_ref": r["lr"],
                "lr_megatron": m["lr"],
                "consumed_samples_hsp": h["consumed_samples"],
                "consumed_samples_ref": r["consumed_samples"],
                "consumed_samples_megatron": m["consumed_samples"],
                "documents_hsp": h["documents"],
                "samples_megatron": m["samples"],
                "grad_norm_hsp": h["grad_norm"],
                "grad_norm_ref": r["grad_norm"],
                "max_rel_grad_diff": worst_rel,
                "pooled_rel_grad_diff": pooled,
                "worst_grad_param": worst,
                "smallest_grad_param": small,
                "smallest_grad_ratio": peak[small] / top,
                "rel_grad_diff_of_smallest": rel[small],
                "plan_microbatches": h["plan_microbatches"],
                "schedule_microbatches": h["schedule_microbatches"],
                "empty_groups": h["empty_groups"],
                "layouts": h["layouts"],
            }
        )
    update = {n: ref["weights"][n] - stock_init[n] for n in ref["weights"]}
    wrel, _ = per_param_diff(hsp["weights"], ref["weights"], update)
    wname, wworst = _worst(wrel)
    return {
        "steps": out,
        **data,
        "max_rel_weight_diff_after": wworst,
        "worst_weight_param": wname,
        "planted_param": PLANTED.get("param"),
        "pipeline": hsp["pipeline"],
        "moe": hsp["moe"],
        # Expert parameters compared per parameter (each rank's own experts; 0 when dense).
        "expert_params_compared": sum(".experts." in n for n in wrel),
    }


@contextlib.contextmanager
def _pipeline_state(rank: int, world_size: int, options: LoopOptions):
    """Megatron's parallel state with ``options``' pipeline for the HSP side, the unpipelined
    one (the stock reference's) again on exit. Why the stock side runs without a pipeline: it
    is then the plain model on the same documents, sharing none of the schedule's stage
    machinery (p2p, shape handshake, last-stage loss) with the HSP side, so an error at a stage
    boundary cannot hide in a reference that makes it too."""
    from megatron_hsp.testing.dist import init_cpu_megatron

    if options.pp == 1:
        yield
        return
    init_cpu_megatron(
        rank,
        world_size,
        "",
        tensor_model_parallel_size=options.tp,
        pipeline_model_parallel_size=options.pp,
        virtual_pipeline_model_parallel_size=options.vpp,
    )
    yield
    # Not on an exception: re-initialising is collective, and a rank that raised would wait
    # there for ranks still inside the run instead of reporting its error.
    init_cpu_megatron(rank, world_size, "", tensor_model_parallel_size=options.tp)


def run_megatron_loop(
    nproc: int = 4,
    options: Sequence[LoopOptions] = DEFAULT_OPTIONS,
    steps: int = STEPS,
    timeout_s: float = 600.0,
    plant: str | None = None,
) -> list[dict[str, Any]]:
    """The ``megatron_loop`` entries of ``selftest --json``: one per option set.

    ``plant`` names a bug from ``PLANTS`` to plant on the HSP side (tests: it must be caught).
    """
    return _run_loops(nproc, [(o, steps, plant) for o in options], timeout_s)


def _run_loops(
    nproc: int, runs: Sequence[tuple[LoopOptions, int, str | None]], timeout_s: float
) -> list[dict[str, Any]]:
    """Each (option set, steps, plant) of ``runs``, all in one spawn of ``nproc`` processes."""
    for _, _, plant in runs:
        if plant is not None and plant not in PLANTS:
            raise ValueError(f"unknown plant {plant!r}; known: {sorted(PLANTS)}")
    from megatron_hsp.testing.dist import raise_rank_errors, run_distributed

    results = []
    with tempfile.TemporaryDirectory(prefix="hsp_mloop_") as tmp:
        prefix = os.path.join(tmp, "docs")
        write_corpus(prefix)
        # The blend's second dataset: half as many documents, longer ones.
        write_corpus(prefix + "-b", num_docs=32, seed=11, choices=BLEND_CHOICES)
        prefixes = (prefix, prefix + "-b")
        spawned = []
        for i, (opt, steps, plant) in enumerate(runs):
            cost_path = f"{prefix}.cost-{i}.json"
            with open(cost_path, "w") as fh:
                json.dump(opt.cost_model(), fh)
            spawned.append((opt, cost_path, steps, plant))
        # One spawn for all runs: starting 4 processes that import torch and Megatron is most
        # of the cost on a small machine.
        per_rank = raise_rank_errors(
            run_distributed(_worker_all, nproc, prefixes, tuple(spawned), timeout_s=timeout_s)
        )
        for (opt, _, _), result in zip(runs, per_rank[0], strict=True):
            entry = {"options": opt.as_dict(), **result}
            entry["failures"] = check(entry["steps"], entry["max_rel_weight_diff_after"])
            entry["failures"] += check_data(entry)
            entry["ok"] = not entry["failures"]
            entry["margin"] = margin(entry)
            entry["worst_check"] = worst_check(entry)
            results.append(entry)
    return results


def loop_table(entries: Sequence[dict[str, Any]]) -> str:
    """Human-readable ``selftest --megatron`` report: one line per option set and step."""
    lines = [
        f"{'options':<22} {'step':>4} {'loss hsp':>11} {'loss ref':>11} {'lr':>9} "
        f"{'samples':>11} {'grad rel':>8} {'layouts (size=ulysses x ring)'}"
    ]
    for e in entries:
        name = _label(e["options"])
        for s in e["steps"]:
            layouts = " | ".join(
                " ".join(
                    f"{g['size']}" + (f"={g['ulysses']}x{g['ring']}" if g["ring"] > 1 else "")
                    for g in mb
                )
                for mb in s["layouts"]
            )
            lr_ok = s["lr_hsp"] == s["lr_ref"] == s["lr_megatron"]
            lines.append(
                f"{name:<22} {s['step']:>4} {s['loss_hsp']:>11.7f} {s['loss_ref']:>11.7f} "
                f"{s['lr_hsp']:>9.2e}{' ' if lr_ok else '!'}"
                f"{s['consumed_samples_hsp']:>3}/{s['consumed_samples_ref']}/"
                f"{s['consumed_samples_megatron']:<3} "
                f"{s['max_rel_grad_diff']:>8.1e} {layouts}"
            )
        lines.append(
            f"{name:<22} weights after: {e['max_rel_weight_diff_after']:.1e} "
            f"({e['worst_weight_param']}); worst / tolerance {format_margin(e['margin'])} "
            f"({e['worst_check']})"
        )
        for ev in e.get("evaluations", []):
            lines.append(
                f"{name:<22} {ev['split']} evaluation after step {ev['after_step']}: loss "
                f"{ev['loss_hsp']:.7f} / {ev['loss_ref']:.7f}, consumed valid samples "
                f"{ev['consumed_valid_samples_hsp']}/{ev['consumed_valid_samples_ref']}/"
                f"{ev['consumed_valid_samples_megatron']}"
            )
        if e.get("blend"):
            b = e["blend"]
            lines.append(
                f"{name:<22} blend: token shares "
                + " / ".join(f"{x:.3f}" for x in b["token_shares"])
                + " for weights "
                + " / ".join(f"{x:g}" for x in b["weights"])
                + f" ({b['worst_deviation_in_documents']:.2f} documents off, "
                f"{b['worst_over_bound']:.2f} of the deficit rule's bound)"
            )
        if e.get("resume"):
            r = e["resume"]
            lines.append(
                f"{name:<22} resume through Megatron's checkpoint (--ckpt-format {r['format']}): "
                + ", ".join(
                    f"{k} {v[0]}/{v[1]}" for k, v in r.items() if k not in ("format", "refusal")
                )
            )
        lines.extend(f"  FAIL {name}: {f}" for f in e["failures"])
    return "\n".join(lines)


def _label(options: dict[str, Any]) -> str:
    known = {f: options[f] for f in LoopOptions.__dataclass_fields__ if f in options}
    if known.get("group_sizes") is not None:
        known["group_sizes"] = tuple(known["group_sizes"])
    return LoopOptions(**known).label
