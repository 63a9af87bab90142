"""What HSP plugs into Megatron-LM's ``pretrain()``: dataset provider, forward step, step hooks.

Megatron seams used (no patch needed):
* ``train_valid_test_datasets_provider`` -> ``hsp_datasets_provider``: returns an *external* data
  iterator (``--dataloader-type external``) that yields this rank's planned micro-batches, and
  the validation and test iterators Megatron's ``evaluate()`` pulls planned batches from (each
  split sampled by its own sampler over Megatron's data flags, ``datasets.py``);
* ``forward_step_func`` -> ``hsp_forward_step``: runs the GPT model on one packed THD micro-batch
  whose ``PackedSeqParams.cp_group`` is the plan's group for this rank, per-token loss;
* the layer spec (``--spec megatron_hsp.megatron.layer_spec hsp_layer_spec``) puts HSP attention
  in every layer.

The two things without a seam (a per-step hook that also hands the schedule the plan's
micro-batch count, and the same per evaluation batch) are the ``train_step`` and
``get_forward_backward_func`` patches in ``patches.py``; they call ``begin_step`` /
``current_num_microbatches`` and ``eval_iterator_of(...).begin()`` here.

Under pipeline parallelism every stage runs the same agreed plan with its own slot's inputs;
under virtual stages the provider is called once per model chunk and every chunk reads the same
micro-batches (``_ChunkInputs``); an interleaved schedule's count is padded with empty
micro-batches (``schedule_count``). docs/integration.md, "Pipeline parallelism under --hsp".

``selftest --megatron`` (``testing/megatron_loop/``) runs this module under Megatron's own
``train_step`` on gloo CPU ranks against the stock path; ``pretrain()``/``train()`` themselves
need CUDA (docs/integration.md says what only a GPU run shows).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from functools import partial
from typing import TYPE_CHECKING, Any

from megatron_hsp.megatron.config import HSPConfig
from megatron_hsp.megatron.refusals import exit_on_refusal, kv_heads
from megatron_hsp.planner.errors import InputError
from megatron_hsp.step.mbclock import MicrobatchClock
from megatron_hsp.step.observe import (
    MODEL_STATE,
    StepObserver,
    StepRecord,
    StepRefitter,
    model_from_state,
)
from megatron_hsp.step.pipeline import PreparedStep, StepPipeline

if TYPE_CHECKING:  # torch-side types, imported where they are built (``build_pipeline``)
    import torch

    from megatron_hsp.megatron.datasets import HSPData
    from megatron_hsp.planner.cost.costmodel import CostModel
    from megatron_hsp.runtime.groups import GroupRegistry
    from megatron_hsp.runtime.schedule import ModelInputs


@dataclass
class HSPRun:
    """Process-wide HSP state of one Megatron run.

    Three parts, each filled in one place: what the flags say (``config``, ``data``: built by
    ``installer.install`` from ``validate_hsp_args`` and the data flags); what the run sets up
    once (process groups, device, cost model, the schedule's and dispatch's per-run settings,
    the refit's clock and refitter, the evaluation iterators: ``build_pipeline``); and the
    current step (``pipeline``, ``current``, ``inputs``, ``read``, ``step_started``, ...:
    ``begin_step`` and the iterators).
    """

    config: HSPConfig
    pipeline: StepPipeline | None = None
    registry: GroupRegistry | None = None
    observer: StepObserver | None = None
    current: PreparedStep | None = None
    inputs: list[ModelInputs | None] = field(default_factory=list)  # None: an idle micro-batch
    # Micro-batches each model chunk's iterator has read this step (chunk -> count): under
    # virtual pipeline stages every chunk reads the same inputs in order (``_ChunkInputs``).
    read: dict[int, int] = field(default_factory=dict)
    microbatch_multiple: int = 1  # interleaved pipeline: the schedule's count must divide by pp
    step_started: float = 0.0
    local_multiple: int = 1  # per-rank token count multiple (TP size under --sequence-parallel)
    device: torch.device | None = None
    step_overhead_ms: float = 0.0  # the cost model's per-step cost, added to each prediction
    # How long a rank waits for its peers in HSP's own collectives after the step (the refit's
    # gather): the plan exchange's bound, so a stopped peer ends the run in one line.
    exchange_timeout_s: float = 600.0
    data: HSPData | None = None  # which datasets feed which split (set by ``install``)
    evaluation: dict[str, _EvalIterator] = field(default_factory=dict)  # by split
    te_layout: bool = False  # pad ring groups' documents for TE's context parallelism
    # Expert parallelism: MoE all-to-alls span plan groups, so a group without documents in a
    # micro-batch still runs the model, on padding (``schedule.step_inputs``).
    run_empty_groups: bool = False
    # Online refit (on by default, --hsp-no-refit): every rank marks its training micro-batches,
    # rank 0 (where the planner runs) refits and switches the planner (``refit_step``).
    clock: MicrobatchClock | None = None
    refitter: StepRefitter | None = None
    created_at_step_start: int = 0  # registry.created: a step that created groups paid for it
    # The starting cost model (every rank), and the refitter's model as the current step started,
    # rebuilt from rank 0's state in ``refit_step``'s gather: it prices the logged prediction.
    cost_model: CostModel | None = None
    predict_model: CostModel | None = None


_RUN: HSPRun | None = None


def active_run() -> HSPRun | None:
    return _RUN


def set_run(run: HSPRun | None) -> None:
    global _RUN
    _RUN = run


def build_pipeline(run: HSPRun, args: Any) -> StepPipeline:
    """Collective: creates the HSP process groups, (rank 0) the planner process, the training
    pipeline and, for the validation and test splits that have documents, their evaluation
    iterators (``run.evaluation``)."""
    import torch
    import torch.distributed as dist

    from megatron_hsp.megatron.config import document_length_limit
    from megatron_hsp.megatron.datasets import (
        build_split_sampler,
        data_fingerprint,
        hsp_data_from_args,
        train_sampler,
    )
    from megatron_hsp.runtime.backends import (
        attention_routes_for_run,
        te_available,
        te_doc_multiples_for_run,
    )
    from megatron_hsp.step.documents import BlendedDocumentReader, DocumentIndex
    from megatron_hsp.step.pipeline import build_training_step

    cfg = run.config
    data = run.data if run.data is not None else hsp_data_from_args(args)
    rank = dist.get_rank()
    # The model's device: CUDA in training; CPU where there is none (``selftest --megatron``).
    run.device = (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available()
        else torch.device("cpu")
    )
    heads = _head_space(cfg.plan_method)
    # The route each ring or hybrid group's attention will take (the layer spec's "auto"
    # backend): the planner prices each route by its own coefficient (planner/routes.py).
    splits = {} if heads is None else {d: heads.split(d) for d in cfg.group_sizes}
    routes = attention_routes_for_run(
        splits,
        "auto",
        run.device.type,
        dtype=getattr(args, "params_dtype", None) or torch.float32,
        head_dim=int(
            getattr(args, "kv_channels", None) or args.hidden_size // args.num_attention_heads
        ),
    )
    training = build_training_step(
        cfg.run,
        cfg.cost_model,
        rank=rank,
        memory_cap_gb=cfg.memory_cap_gb,
        heads=heads,
        ring_routes=routes,
        # TE's padding of the groups it carries (run.te_layout below): priced by the planner
        doc_multiples=te_doc_multiples_for_run(splits, "auto", run.device.type),
        method=cfg.plan_method,
    )
    run.registry = training.registry
    cost = training.spec.load_cost_model()
    run.step_overhead_ms = cost.step_overhead_ms
    run.cost_model, run.predict_model = cost, None
    mmap = bool(getattr(args, "mmap_bin_files", True))
    indices = {p: DocumentIndex(p, mmap=mmap) for p in data.prefixes}
    reader = BlendedDocumentReader([indices[p] for p in data.prefixes])
    # Whole documents up to --seq-length (or --hsp-max-seq), learned positions and memory.
    max_length, why = document_length_limit(
        args, cfg.run.max_seq, cost.max_trainable_length(list(cfg.group_sizes))
    )
    sampler, line = train_sampler(data, indices, cfg, max_length, why)
    if rank == 0:
        print(f"[megatron-hsp] {line}", flush=True)
        print(f"[megatron-hsp] {batch_line(cfg, args, sampler)}", flush=True)
    # Resume: Megatron restored args.iteration from the checkpoint; replaying that many batches
    # reads only lengths and lands on exactly the next unseen batch, if the data and sampling
    # flags are those the checkpoint trained with (checked against --load's record).
    check_and_record_data(args, data_fingerprint(data, indices) + "/" + sampler.fingerprint)
    sampler.fast_forward(int(getattr(args, "iteration", 0) or 0))
    rank0 = rank == 0
    if rank0 and cfg.plan_method == "static-best":
        training.spec = _static_best_lookahead(training.spec, sampler, args)
    training.start_planner(
        background=cfg.background_planner,
        sync_flag="--hsp-sync-planner",
        plan_timeout_s=cfg.plan_timeout_s,
    )
    planner, run.exchange_timeout_s = training.planner, training.exchange_timeout_s
    # Megatron's sequence parallelism splits each rank's tokens over the TP group again.
    tp = int(getattr(args, "tensor_model_parallel_size", 1) or 1)
    run.local_multiple = tp if getattr(args, "sequence_parallel", False) else 1
    # The layer spec's "auto" backend is Transformer Engine wherever TE and CUDA are present
    # (runtime.backends.make_backend); its context-parallel route needs padded documents.
    run.te_layout = te_available()
    # megatron-core's interleaved schedule runs micro-batches in groups of
    # microbatch_group_size_per_vp_stage (default pp) and refuses a count that is not a
    # multiple of it (a shorter last group would stall the pipeline): ``_prepare`` pads.
    if getattr(args, "virtual_pipeline_model_parallel_size", None):
        group = getattr(args, "microbatch_group_size_per_vp_stage", None)
        run.microbatch_multiple = int(group or args.pipeline_model_parallel_size)
    run.run_empty_groups = int(getattr(args, "expert_model_parallel_size", 1) or 1) > 1

    run.clock, run.refitter = None, None
    if cfg.refit:
        if int(getattr(args, "pipeline_model_parallel_size", 1) or 1) > 1:
            # Under a pipeline schedule a stage's micro-batch starts interleave with other
            # micro-batches' backwards: the marks would not bound one micro-batch.
            if rank0:
                print(
                    "[megatron-hsp] online refit off: micro-batch times are not measured under "
                    "--pipeline-model-parallel-size > 1 (the cost model stays fixed)",
                    flush=True,
                )
        else:
            run.clock = MicrobatchClock(run.device)
            if rank0:
                run.refitter = StepRefitter(cost, out=cfg.refit_out, planner=planner)

    run.evaluation = {}
    eval_iters = getattr(args, "eval_iters", 0) or 0
    # Megatron's evaluation batch in its samples (documents, or --seq-length tokens of budget).
    eval_batch = getattr(args, "eval_global_batch_size", None) or getattr(
        args, "global_batch_size", None
    )
    for key, split in enumerate(("valid", "test"), start=1):
        if eval_iters <= 0:
            break
        # Its own sampler over its own documents, its own state: evaluation never draws from,
        # or moves, the training sampler. By count: Megatron's eval global batch; by tokens:
        # the training budget, scaled as Megatron's eval batch is to its training batch.
        split_config = replace(
            sampler.config,
            global_batch_docs=None if cfg.token_budget else int(eval_batch),
            token_budget=_eval_budget(cfg, args, eval_batch),
        )
        split_sampler = build_split_sampler(data, split, indices, split_config)
        if split_sampler is None:
            if rank0:
                print(
                    f"[megatron-hsp] the {split} split has no documents (--split, or no "
                    f"--{split}-data-path): Megatron's {split} evaluations are skipped",
                    flush=True,
                )
            continue
        if split == "valid":
            # Megatron resumes validation at args.consumed_valid_samples (restored from the
            # checkpoint); each evaluation iteration counted one eval global batch.
            done = int(getattr(args, "consumed_valid_samples", 0) or 0) // int(eval_batch or 1)
            split_sampler.fast_forward(done)
        split_planner = None if planner is None else _SplitPlanner(planner, key)
        run.evaluation[split] = _EvalIterator(
            run, split, training.pipeline(split_sampler, reader, split_planner)
        )
    return training.pipeline(sampler, reader)


def batch_line(cfg: HSPConfig, args: Any, sampler: Any) -> str:
    """The start-up line on the global batch: tokens per step and documents per step (expected:
    the budget over the training split's mean sequence), what Megatron's samples count."""
    gbs = getattr(args, "global_batch_size", None)
    seq = getattr(args, "seq_length", None)
    mean = sampler.mean_sequence_tokens
    if cfg.token_budget is None:
        tokens = cfg.global_batch_docs * mean
        return (
            f"global batch: {cfg.batch_line(seq, gbs)}; expected {tokens:.0f} tokens per step "
            f"(mean sequence {mean:.0f} tokens); Megatron's samples count documents"
        )
    return (
        f"global batch: {cfg.batch_line(seq, gbs)}; expected {cfg.token_budget / mean:.1f} "
        f"documents per step (mean sequence {mean:.0f} tokens); Megatron's consumed samples "
        f"and learning-rate schedule count {gbs} samples per step"
    )


def _eval_budget(cfg: HSPConfig, args: Any, eval_batch: Any) -> int | None:
    """Tokens per evaluation batch under a token budget: the training budget times Megatron's
    eval global batch over its global batch (equal by default), so an evaluation batch is as
    large as the stock one."""
    if cfg.token_budget is None:
        return None
    gbs = getattr(args, "global_batch_size", None)
    if not gbs or not eval_batch or int(eval_batch) == int(gbs):
        return cfg.token_budget
    return max(1, cfg.token_budget * int(eval_batch) // int(gbs))


# Batches ``static-best`` chooses its degree over (at most; fewer when --train-iters is less).
STATIC_BEST_LOOKAHEAD = 64


def _static_best_lookahead(spec: Any, sampler: Any, args: Any) -> Any:
    """``spec`` with the lengths of the run's next batches (drawn from the sampler and put
    back: lengths only) for ``--hsp-plan-method static-best``: the planner chooses the one
    ``static-N`` with the least summed priced time over them (``evaluation/torch_side/
    methods.planner_for_spec``) and prints its choice."""
    import dataclasses

    iters = int(getattr(args, "train_iters", 0) or 0) - int(getattr(args, "iteration", 0) or 0)
    count = max(1, min(STATIC_BEST_LOOKAHEAD, iters if iters > 0 else STATIC_BEST_LOOKAHEAD))
    state = sampler.state_dict()
    batches = [sampler.next_batch().lengths for _ in range(count)]
    sampler.load_state_dict(state)
    return dataclasses.replace(spec, options={**spec.options, "lookahead": batches})


DATA_RECORD = "hsp_data.json"


def check_and_record_data(args: Any, fingerprint: str) -> None:
    """Resume guard: a run that loads a checkpoint (``--load``, ``args.iteration`` > 0) must
    sample what the saving run sampled, since resume replays ``args.iteration`` batches.

    Megatron's checkpoint has no room for HSP state, so rank 0 records the fingerprint of the
    data (every dataset's document lengths, each split's sources, weights and ``--split``) and
    of the training sampler's flags in ``<--save>/hsp_data.json``; a resumed run compares it
    with ``<--load>/hsp_data.json`` and stops, naming the flags, when they differ. A checkpoint
    directory without the record (written before it existed) is resumed without the check.
    """
    import json
    from pathlib import Path

    import torch.distributed as dist

    load, save = getattr(args, "load", None), getattr(args, "save", None)
    if load and int(getattr(args, "iteration", 0) or 0) > 0:
        record = Path(load) / DATA_RECORD
        if record.is_file():
            saved = json.loads(record.read_text()).get("fingerprint")
            if saved != fingerprint:
                raise InputError(
                    f"--load {load}: its checkpoint was trained on other data or sampling flags "
                    f"(fingerprint {saved}, now {fingerprint}); resuming would replay other "
                    "batches. Resume with the same --data-path (or --train/valid/test-data-path) "
                    "and weights, --split, --seed/--hsp-seed, --global-batch-size, "
                    "--seq-length, --hsp-token-budget and --hsp-batch-unit (a checkpoint "
                    "written before issue 43 counted documents: --hsp-batch-unit documents), "
                    "--hsp-overlong and cost model"
                )
    if save and (not dist.is_initialized() or dist.get_rank() == 0):
        Path(save).mkdir(parents=True, exist_ok=True)
        # Written aside and renamed over the record: with --save and --load the same directory,
        # the other ranks may be reading it for the check above right now, and a write in place
        # lets them read it empty (JSONDecodeError; the likely cause of one crashed rank seen in
        # selftest --megatron). The one atomic writer does exactly that (planner/paths.py).
        from megatron_hsp.planner.paths import atomic_write

        atomic_write(Path(save) / DATA_RECORD, json.dumps({"fingerprint": fingerprint}) + "\n")


class _SplitPlanner:
    """The one planner process, for the batches of an evaluation split.

    Why not a second planner process: it would double the processes and memory of planning for
    a few batches per evaluation. The split's steps get keys apart from training's (negative:
    valid ``-(2s+1)``, test ``-(2s+2)``), so a pending training plan and an evaluation plan
    never collide; a planner log line about step -3 is validation batch 1."""

    def __init__(self, planner: Any, split_key: int) -> None:
        self.planner = planner
        self.split_key = split_key

    def _key(self, step: int) -> int:
        return -(2 * step + self.split_key)

    def submit(self, step: int, lengths: Any) -> None:
        self.planner.submit(self._key(step), lengths)

    def result(self, step: int) -> Any:
        return self.planner.result(self._key(step))

    def close(self) -> None:
        """The training pipeline's planner is closed by its owner."""


class _EvalIterator:
    """The external validation/test iterator Megatron's ``evaluate()`` passes to the schedule.

    Each call of the schedule with this iterator is one evaluation batch: the patched
    ``get_forward_backward_func`` (``patches.py``) calls ``begin()`` (next batch of this
    split's own sampler, its plan, this rank's inputs) and runs the plan's micro-batch count;
    ``hsp_forward_step`` then pulls the micro-batches from here."""

    def __init__(self, run: HSPRun, split: str, pipeline: StepPipeline) -> None:
        self.run = run
        self.split = split
        self.pipeline = pipeline
        self.inputs: list[Any] = []
        self.read: dict[int, int] = {}  # chunk -> micro-batches read (``_ChunkInputs``)
        self.current: PreparedStep | None = None
        self.batches: list[Any] = []  # every batch evaluated (``DocumentBatch``), for reports

    def begin(self) -> int:
        """Prepare the next evaluation batch; returns the micro-batch count the schedule runs
        (the plan's, padded for an interleaved pipeline: ``_prepare``)."""
        self.current, self.inputs = _prepare(self.run, self.pipeline)
        self.read = {}
        self.batches.append(self.current.batch)
        return len(self.inputs)

    def chunk(self, index: int) -> _ChunkInputs:
        """The iterator of virtual pipeline chunk ``index`` (``hsp_datasets_provider``)."""
        return self if index == 0 else _ChunkInputs(self, index)

    def __iter__(self) -> _EvalIterator:
        return self

    def __next__(self) -> Any:
        return _next_input(self.inputs, self.read, 0, f"evaluation on the {self.split} split")


class _ChunkInputs:
    """What virtual pipeline chunk ``index`` > 0 reads: the same micro-batches as chunk 0, in
    the same order, from its own position (every chunk of a stage runs every micro-batch, and
    each needs its ``PackedSeqParams``; the interleaved schedule pulls one iterator per chunk)."""

    def __init__(self, owner: Any, index: int) -> None:
        self.owner = owner
        self.index = index

    def __iter__(self) -> _ChunkInputs:
        return self

    def __next__(self) -> Any:
        what = getattr(self.owner, "split", None)
        what = "training" if what is None else f"evaluation on the {what} split"
        return _next_input(self.owner.inputs, self.owner.read, self.index, what)


def _next_input(inputs: list[Any], read: dict[int, int], chunk: int, what: str) -> Any:
    """Micro-batch ``read[chunk]`` of ``inputs`` for model chunk ``chunk``; moves it on."""
    i = read.get(chunk, 0)
    if i >= len(inputs):
        raise RuntimeError(
            f"megatron-hsp: {what} asked for more micro-batches than the plan has; "
            "train_step / get_forward_backward_func is not patched (was "
            "megatron_hsp.megatron.install called before pretrain()?)"
        )
    read[chunk] = i + 1
    return inputs[i]


def eval_iterator_of(data_iterator: Any) -> _EvalIterator | None:
    """The HSP evaluation iterator behind what ``evaluate()`` hands the schedule (Megatron
    wraps external iterators in ``RerunDataIterator``; under virtual pipeline stages it hands
    one per chunk, chunk 0's first), else None."""
    if isinstance(data_iterator, list | tuple):
        data_iterator = data_iterator[0] if data_iterator else None
    inner = getattr(data_iterator, "iterable", data_iterator)
    return inner if isinstance(inner, _EvalIterator) else None


class _MicroBatchIterator:
    """The external data iterator Megatron's schedule pulls micro-batches from (one per model
    chunk under virtual pipeline stages, each reading every micro-batch: ``_ChunkInputs``)."""

    def __init__(self, run: HSPRun, chunk: int = 0) -> None:
        self.run = run
        self.chunk = chunk

    def __iter__(self) -> _MicroBatchIterator:
        return self

    def __next__(self) -> Any:
        # The schedule pulls a micro-batch as its forward starts: micro-batch m begins here
        # (and m - 1's backward is done). Model chunk 0's pull only (virtual pipeline stages
        # pull each micro-batch once per chunk); the clock is off under a pipeline.
        if self.chunk == 0 and self.run.clock is not None:
            self.run.clock.mark()
        return _next_input(self.run.inputs, self.run.read, self.chunk, "the training schedule")


def hsp_datasets_provider(train_val_test_num_samples: Any, vp_stage: Any = None) -> tuple:
    """``train_valid_test_datasets_provider`` for ``pretrain()``: HSP's training iterator and,
    when ``--eval-iters`` > 0 and the split has documents, the validation and test iterators
    (None otherwise: Megatron then skips that evaluation, as for an empty split)."""
    from megatron.training import get_args

    run = active_run()
    if run is None:
        raise RuntimeError("megatron-hsp: install() was not called before pretrain()")
    import torch.distributed as dist

    if vp_stage:
        # Virtual pipeline: pretrain() calls the provider once per model chunk; the pipeline
        # (planner, groups, samplers) is built once, for chunk 0, and every other chunk reads
        # the same micro-batches through its own iterators.
        if run.pipeline is None:
            raise RuntimeError("megatron-hsp: the provider ran for chunk 0 after a later chunk")
        valid, test = run.evaluation.get("valid"), run.evaluation.get("test")
        return (
            _MicroBatchIterator(run, vp_stage),
            None if valid is None else valid.chunk(vp_stage),
            None if test is None else test.chunk(vp_stage),
        )
    # A refusal while building (a --load whose data differs from the checkpoint's, an empty
    # training split) is one line and exit 2 on every rank, like a refused flag's.
    run.pipeline = exit_on_refusal(lambda: build_pipeline(run, get_args()))
    # Megatron logs and keeps its TensorBoard/W&B writers on the last rank; so do we. (Planner
    # waits are logged on rank 0, where the planner process runs.)
    if dist.get_rank() == dist.get_world_size() - 1:
        run.observer = StepObserver.from_megatron(
            log_interval=run.config.log_interval, plan_log=run.config.plan_log
        )
    valid, test = run.evaluation.get("valid"), run.evaluation.get("test")
    return _MicroBatchIterator(run), valid, test


hsp_datasets_provider.is_distributed = True  # every rank builds it: group creation is collective


def _head_space(method: str):
    """The model's heads per TP rank (``groupspace.HeadSpace``) from Megatron's args, with the
    split policy of the run's plan ``method`` (``run_spec.method_heads``: pure ring for
    megatron-dcp), so the registry pre-creates each block's Ulysses/ring sub-groups as that
    method's plans run them."""
    from megatron.core import parallel_state as ps
    from megatron.training import get_args

    from megatron_hsp.planner.groupspace import HeadSpace
    from megatron_hsp.planner.run_spec import method_heads

    args = get_args()
    tp = ps.get_tensor_model_parallel_world_size()
    return method_heads(HeadSpace.from_model(args.num_attention_heads, kv_heads(args), tp), method)


def _prepare(run: HSPRun, pipeline: StepPipeline) -> tuple[PreparedStep, list[ModelInputs | None]]:
    """The pipeline's next step (plan: waits only if the planner is late) and this rank's
    model inputs for it.

    The inputs come from ``schedule.step_inputs``, the one builder ``run_step`` (demo, selftest)
    uses too, so the ring layout and process-group binding cannot differ between them.

    Under an interleaved pipeline the list is padded with empty micro-batches (None: every
    rank idle, ``forward_microbatch``'s zero output with loss mask 0, so they train nothing and
    change no loss, token count or gradient) up to ``run.microbatch_multiple``, megatron-core's
    micro-batch group size: the count its interleaved schedule accepts.
    """
    from megatron_hsp.runtime.schedule import step_inputs

    prepared = pipeline.next_step()
    inputs = step_inputs(
        prepared.tokens,
        prepared.plan,
        run.registry,
        run.device,
        local_multiple=run.local_multiple,
        te_layout=run.te_layout,
        run_empty_groups=run.run_empty_groups,
    )
    inputs += [None] * (schedule_count(len(inputs), run.microbatch_multiple) - len(inputs))
    return prepared, inputs


def schedule_count(planned: int, multiple: int) -> int:
    """Micro-batches the schedule runs for a plan of ``planned``: the next multiple of
    ``multiple`` (at least one multiple), the padding being empty micro-batches (``_prepare``)."""
    return max(multiple, -(-planned // multiple) * multiple)


def begin_step(run: HSPRun) -> None:
    """Prepare the training step about to run: plan, dispatch."""
    assert run.pipeline is not None
    # Read before the dispatch, which creates a size's process groups the first time a plan
    # uses it (lazy registry): such a step's time holds that one-time cost.
    run.created_at_step_start = run.registry.created if run.registry is not None else 0
    run.current, run.inputs = _prepare(run, run.pipeline)
    if run.clock is not None:
        run.clock.start_step()
    run.read = {}
    run.step_started = time.perf_counter()


def end_microbatches(run: HSPRun) -> None:
    """The last training micro-batch's backward is done (before the gradient reduction where
    the schedule runs one, and again when the schedule returns: the first call counts)."""
    if run.clock is not None:
        run.clock.end()


def around_finalize(run: HSPRun, config: Any) -> Any:
    """Have Megatron's ``config.finalize_model_grads_func`` (set by ``train()``, called by the
    schedule after the last backward) first end the step's micro-batches, so the gradient
    reduction is not counted in the last micro-batch. Returns the function that restores it.
    A config seam (the attribute ``train()`` itself sets), not a patch of Megatron code."""
    finalize = getattr(config, "finalize_model_grads_func", None)
    if run.clock is None or finalize is None:
        return lambda: None

    def finalize_after_marking(*a: Any, **kw: Any) -> Any:
        end_microbatches(run)
        return finalize(*a, **kw)

    config.finalize_model_grads_func = finalize_after_marking

    def restore() -> None:
        config.finalize_model_grads_func = finalize

    return restore


def end_step(run: HSPRun, loss: float | None = None) -> None:
    refit_step(run)
    # After the refit's all-gather: a cost HSP adds to every step belongs to its measured time.
    measured_s = time.perf_counter() - run.step_started
    if run.current is None or run.observer is None:
        return
    p = run.current
    flops, gpus = _step_flops(run)
    rec = StepRecord.from_plan(
        p.step,
        p.plan,
        loss=loss,
        measured_s=measured_s,
        solve_s=p.solve_s if p.solve_s else None,
        wait_s=p.wait_s,
        step_overhead_ms=run.step_overhead_ms,
        model=run.predict_model,  # None (refit off): the plan's own estimate
        batch_fingerprint=p.batch.fingerprint,
        model_flops=flops,
        gpus=gpus,
    )
    run.observer.record(rec, p.plan)


def trained_lengths(run: HSPRun | None) -> list[int] | None:
    """The lengths of the sequences the current (just trained) step holds, or None outside
    an ``--hsp`` step: what the throughput patch counts (``patches.py``)."""
    if run is None or run.pipeline is None or run.current is None:
        return None
    return run.current.batch.lengths


def document_flops(count: Any, args: Any, lengths: list[int]) -> float:
    """Megatron's model FLOPs of one step that trained the sequences ``lengths``.

    ``count`` is Megatron's own ``num_floating_point_operations``: given the sum of lengths and
    of squared lengths (megatron-core releases that count packed THD batches take them), each
    sequence's attention is causal over that sequence alone, as HSP trains it; an older
    release without them is asked once per distinct length, as a batch of such samples.
    """
    import argparse
    import inspect
    from collections import Counter

    params = inspect.signature(count).parameters
    if "seqlen_squared_sum_in_batch" in params and "total_real_tokens_in_batch" in params:
        return float(
            count(
                args,
                len(lengths),
                seqlen_squared_sum_in_batch=float(sum(x * x for x in lengths)),
                total_real_tokens_in_batch=float(sum(lengths)),
            )
        )
    total = 0.0
    for length, n in Counter(lengths).items():
        one = argparse.Namespace(**{**vars(args), "seq_length": int(length)})
        total += n * float(count(one, 1))
    return total


def _step_flops(run: HSPRun) -> tuple[float | None, int]:
    """(model FLOPs of the step just trained, GPUs of the job): Megatron's count through the
    throughput patch, so the console line and Megatron's ``--log-throughput`` agree."""
    try:
        import torch.distributed as dist
        from megatron.training import get_args
        from megatron.training import training as mt

        args = get_args()
        gpus = dist.get_world_size() if dist.is_initialized() else 1
        return float(mt.num_floating_point_operations(args, args.global_batch_size)), gpus
    except Exception:  # no Megatron args (a library user's loop): no FLOPs column
        return None, 1


def refit_step(run: HSPRun) -> None:
    """Collective when the refit is on: every rank's micro-batch times to rank 0, which feeds
    ``StepRefitter`` (the demo's, shared) and prints one line per update.

    One small all-gather per step, after the step (the CUDA events are read once here). A slot's
    time is its slowest tensor-parallel rank's; ``observe.group_timings`` turns slots into
    groups. Rank 0's row also carries its refitter's model as the step started
    (``StepRefitter.model_state``, before this step's update): the logging rank prices the
    step's prediction with it (``run.predict_model``), as the demo does.
    """
    if run.clock is None or run.current is None:
        return
    import torch
    import torch.distributed as dist

    from megatron_hsp.runtime.agreement import bounded_all_gather

    plan = run.current.plan
    n = len(plan.microbatches)
    times = run.clock.read()
    k = 2 + MODEL_STATE  # slot, step seconds, rank 0's model state, then the micro-batches
    row = torch.full((k + n,), float("nan"), dtype=torch.float64)
    row[0] = float(run.registry.slot)
    row[1] = time.perf_counter() - run.step_started
    if run.refitter is not None:
        row[2:k] = torch.tensor(run.refitter.model_state(), dtype=torch.float64)
    if len(times) == n:
        row[k:] = torch.tensor(times, dtype=torch.float64)
    row = row.to(run.device)
    rows = [torch.empty_like(row) for _ in range(dist.get_world_size())]
    bounded_all_gather(rows, row, timeout_s=run.exchange_timeout_s, what="the refit's timings")
    if run.observer is not None:
        run.predict_model = model_from_state(run.cost_model, rows[0][2:k].cpu().tolist())
    if run.refitter is None:
        return
    table = torch.stack(rows).cpu()[:, [0, 1, *range(k, k + n)]]
    if bool(torch.isnan(table).any()):
        print(
            f"[megatron-hsp] refit after step {run.current.step}: skipped (a rank's marks do "
            f"not cover the plan's {n} micro-batches one by one)",
            flush=True,
        )
        return
    per_slot: list[list[float]] = [[0.0] * n for _ in range(run.config.run.dims.slots)]
    for r in table.tolist():
        slot = int(r[0])
        per_slot[slot] = [max(a, b) for a, b in zip(per_slot[slot], r[2:], strict=True)]
    result = run.refitter.record(
        run.current.step,
        plan,
        per_slot,
        float(table[:, 1].max()),
        step_is_clean=run.registry.created == run.created_at_step_start,
    )
    if result is not None:
        print("[megatron-hsp] " + run.refitter.summary_line(), flush=True)


def current_num_microbatches(run: HSPRun) -> int:
    """The micro-batch count the schedule runs: the plan's (padded under interleaving)."""
    assert run.current is not None, "megatron-hsp: no step prepared"
    return schedule_count(len(run.current.plan.microbatches), run.microbatch_multiple)


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
