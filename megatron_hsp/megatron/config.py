"""``HSPConfig``: what the data, planner and runtime layers read, and ``validate_hsp_args``,
which builds it from Megatron's parsed flags in named steps.

Two passes of ``validate_hsp_args``: the flag-only checks as soon as Megatron's parser returns
(``flags.refuse_before_megatron``), before Megatron's own ``validate_args`` can stop on an assert
or a device query; then all of them on the validated namespace, since the cost model needs values
Megatron derives there (FFN size, padded vocabulary, world size). Every error names the flag at
fault and what would work, and ends the process with one line and exit 2
(``refusals.exit_on_refusal``); every setting we change on the user's behalf
(``--calculate-per-token-loss``) is returned as a note and printed. Also here: the refit output
path and the longest document a run trains whole.

This module imports neither torch nor Megatron: the flags can be checked anywhere.
"""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from megatron_hsp.megatron.model_cost import (
    HardwareUnknown,
    choose_hardware,
    default_cost_model_spec,
    spec_label,
)
from megatron_hsp.megatron.refusals import (
    HSPArgsError,
    arg_value,
    kv_heads,
    refuse_what_hsp_cannot_run,
)
from megatron_hsp.planner import units
from megatron_hsp.planner.errors import InputError
from megatron_hsp.planner.groupspace import DEFAULT_MAX_COMMUNICATORS, HeadSpace
from megatron_hsp.planner.run_spec import (
    DEFAULT_OVERLONG,
    MEGATRON_FLAGS,
    GroupSizeRequest,
    ParallelDims,
    check_method_sizes,
    check_plan_method,
    check_time_budget,
    method_heads,
)
from megatron_hsp.planner.search.settings import (
    DEFAULT_PLAN_TIMEOUT_S,
    PLAN_EXCHANGE_MARGIN_S,
    PlannerSettings,
    RunSpec,
)
from megatron_hsp.planner.units import check_range


@dataclass(frozen=True)
class HSPConfig:
    """Validated HSP settings; what the data, planner and runtime layers read."""

    # preset name or file (--hsp-cost-model), else the first-principles spec mapping built from
    # Megatron's flags (model_cost.default_cost_model_spec); load_cost_model takes either.
    cost_model: str | Mapping[str, Any]
    # The run description: parallel dimensions, group-size request, overlong policy, longest
    # document, planner settings (their sizes always set here: the ones the run plans with).
    run: RunSpec
    memory_cap_gb: float | None
    # Exactly one is set: ``token_budget`` (the default, --hsp-batch-unit tokens: tokens per
    # global batch, --hsp-token-budget or --global-batch-size x --seq-length) or
    # ``global_batch_docs`` (--hsp-batch-unit documents: --global-batch-size documents).
    global_batch_docs: int | None
    token_budget: int | None
    seed: int
    # Whose plan each step trains (--hsp-plan-method): "hsp" or a baseline
    # (``evaluation/torch_side/methods.py``); "static-best" is resolved to one static-N by the
    # planner from the run's next batches.
    plan_method: str = "hsp"
    plan_log: str | None = None
    log_interval: int = 1
    background_planner: bool = True
    plan_timeout_s: float = DEFAULT_PLAN_TIMEOUT_S  # --hsp-plan-timeout-s
    refit: bool = True  # online refit of the cost model (--hsp-no-refit turns it off)
    refit_out: str | None = None  # where the refit model is written (--hsp-refit-out)
    notes: tuple[str, ...] = field(default=(), compare=False)

    # Read-only views of the run description, for readers written before it (``run`` is the
    # one place these values live).
    world_size = property(lambda self: self.run.dims.slots, doc="sequence-parallel slots")
    gpus_per_node = property(lambda self: self.run.dims.slots_per_node, doc="slots per node")
    planner = property(lambda self: self.run.planner, doc="the planner's settings")
    overlong = property(lambda self: self.run.overlong.value, doc="the overlong policy")
    max_seq = property(lambda self: self.run.max_seq, doc="the longest document trained whole")

    @property
    def group_sizes(self) -> tuple[int, ...]:
        """The group sizes the run pre-creates and plans with."""
        assert self.run.planner.sizes is not None
        return self.run.planner.sizes

    def planner_spec(self) -> Any:
        """The ``step.planner_service.PlannerSpec`` of this run: what the planner process and
        ``plan``/``bench`` (``commands/megatron_args.py``) build the cost model from."""
        from megatron_hsp.step.pipeline import planner_spec

        return planner_spec(self.run, self.cost_model, self.memory_cap_gb, method=self.plan_method)

    def batch_line(self, seq_length: int | None, global_batch: int | None) -> str:
        """What a global batch holds, in the start-up line's words (``hooks.build_pipeline``
        adds the documents per step the data gives)."""
        if self.token_budget is None:
            return (
                f"{self.global_batch_docs} documents per step (--hsp-batch-unit documents): "
                "tokens per step vary with the documents drawn"
            )
        stock = (seq_length or 0) * (global_batch or 0)
        source = (
            f"--global-batch-size {global_batch} x --seq-length {seq_length}, the tokens the "
            "stock step trains"
            if self.token_budget == stock
            else "--hsp-token-budget"
        )
        return (
            f"at most {self.token_budget} tokens per step ({source}): whole documents in "
            "sampler order, the one that would cross the budget starts the next step"
        )


def _launcher_flags(message: str) -> str:
    """The planner's messages name ``megatron-hsp plan``'s flags; here the flags are ``--hsp-*``.

    Why: the refusal on 1-2 ranks told Megatron users to "raise --memory-cap-gb", a flag the
    launcher does not have."""
    for flag in ("memory-cap-gb", "cost-model"):
        message = re.sub(rf"(?<![\w-])--{flag}\b", f"--hsp-{flag}", message)
    return message


def _sizes_the_cost_model_prices(
    args: argparse.Namespace,
    spec: str | Mapping[str, Any],
    sizes: list[int],
    world: int,
    slots_per_node: int,
    max_seq: int,
    memory_cap_gb: float | None,
    notes: list[str],
) -> tuple[list[int], Any]:
    """(group sizes the cost model has figures for, the cost model), checked once before
    training starts.

    Why here: a fitted cost model lists the sizes it measured (say 2, 4, 8), while the legal
    sizes include every size up to a node (3, 5, 6, 7). Left to the planner, the gap surfaced on
    the first step as a planning failure. Sizes chosen automatically are narrowed (with a note);
    sizes the user asked for with --hsp-group-sizes must all be priced, else a clear error.
    """
    from megatron_hsp.planner.cost.costmodel import load_cost_model

    label = spec_label(spec)
    try:
        cost = load_cost_model(
            spec,
            world_size=world,
            gpus_per_node=slots_per_node,
            max_seq_k=units.tokens_to_k(max_seq),
            memory_cap_gb=memory_cap_gb,
        )
    except InputError as exc:
        what = "--hsp-cost-model" if args.hsp_cost_model else "default cost model"
        hint = ""
        if not args.hsp_cost_model:
            if "memory cap" not in str(exc):
                hint = "; give a cost model with --hsp-cost-model FILE"
            elif not getattr(args, "use_distributed_optimizer", False):
                hint = "; --use-distributed-optimizer shards the optimizer states over the ranks"
        message = _launcher_flags(str(exc).removeprefix(f"cost model {label!r}: "))
        if not message.startswith("--hsp-cost-model"):  # the loader's own messages name it
            message = f"{what} {label}: {message}"
        raise HSPArgsError(f"{message}{hint}") from None
    priced = set(cost.sizes)
    missing = [d for d in sizes if d not in priced]
    if not missing:
        return sizes, cost
    if not _size_request(args).is_auto:
        raise HSPArgsError(
            f"--hsp-group-sizes {','.join(map(str, sizes))}: cost model "
            f"{label!r} has no figures for group sizes {missing} (it prices "
            f"{sorted(priced)}); leave those sizes out or use a cost model that prices them"
        )
    kept = [d for d in sizes if d in priced]
    if not kept:
        raise HSPArgsError(
            f"--hsp-cost-model {label}: prices none of the legal group sizes "
            f"{sizes} on {world} ranks in nodes of {slots_per_node}; it prices {sorted(priced)}"
        )
    notes.append(
        f"group sizes {missing} left out: cost model {label!r} has no figures for "
        f"them (it prices {sorted(priced)}); training uses {kept}"
    )
    return kept, cost


def _communicator_budget(
    args: argparse.Namespace,
    sizes: list[int],
    slots_per_node: int,
    heads: Any,
    cost: Any,
    notes: list[str],
    user_cap_gb: float | None = None,
    gpus_per_slot: int = 1,
) -> tuple[list[int], float | None]:
    """(sizes within ``--hsp-max-communicators``, the memory cap left after their communicators).

    Why: a communicator per group size (and up to two more per hybrid size) holds NCCL buffers
    for every peer its collective connects (``groupspace.communicator_memory_gb``); at 1024
    GPUs every legal size would be 260 of them per rank. Sizes
    chosen automatically are narrowed (with a note); sizes asked for with --hsp-group-sizes must
    fit, else a clear error. The kept communicators' memory is taken off the memory cap of cost
    models sized from one (first-principles and FlexSP presets); a fitted file's capacity was
    measured with its communicators in place. ``user_cap_gb`` is ``--hsp-memory-cap-gb`` in
    the cost model's units: per slot of ``gpus_per_slot`` tensor-parallel GPUs for the default
    model, each of which holds the communicators.
    """
    from megatron_hsp.planner.groupspace import (
        communicator_memory_gb,
        communicators_per_rank,
        sizes_within_communicator_budget,
    )

    cap = args.hsp_max_communicators
    cap = DEFAULT_MAX_COMMUNICATORS if cap is None else cap
    if cap < 1:
        raise HSPArgsError(f"--hsp-max-communicators must be >= 1 (got {cap})")
    kept = sizes_within_communicator_budget(sizes, slots_per_node, cap, heads)
    if kept != sorted(sizes):
        need = communicators_per_rank(sizes, heads)
        if not _size_request(args).is_auto:
            raise HSPArgsError(
                f"--hsp-group-sizes {','.join(map(str, sizes))} needs {need} communicators per "
                f"rank, more than --hsp-max-communicators {cap}; ask for fewer sizes or raise "
                "the cap"
            )
        dropped = sorted(set(sizes) - set(kept))
        notes.append(
            f"group sizes {dropped} left out: all {len(sizes)} sizes would hold {need} "
            f"communicators per rank, over --hsp-max-communicators {cap}; training uses {kept}"
        )
    comm_gb = communicator_memory_gb(kept, heads) * gpus_per_slot
    base = user_cap_gb
    if base is None:
        model_cap = cost.details.get("memory_cap_gb")  # presets sized from a memory cap
        base = None if model_cap is None else float(model_cap)
    if base is None or comm_gb == 0:
        return kept, user_cap_gb
    left = base - comm_gb
    if left <= 0:
        raise HSPArgsError(
            f"{communicators_per_rank(kept, heads)} communicators ({comm_gb:.3g} GB) leave no "
            f"memory under the {base:g} GB cap; lower --hsp-max-communicators or raise "
            "--hsp-memory-cap-gb"
        )
    notes.append(
        f"{comm_gb:.3g} GB per GPU charged for {communicators_per_rank(kept, heads)} "
        f"communicators: the planner's memory cap is {left:g} GB of {base:g}"
    )
    return kept, left


def _gpus_per_node_from_env(env: Mapping[str, str]) -> int | None:
    for key in ("LOCAL_WORLD_SIZE", "SLURM_GPUS_ON_NODE", "SLURM_NTASKS_PER_NODE"):
        raw = env.get(key, "")
        m = re.match(r"\d+", raw)  # SLURM_NTASKS_PER_NODE may read "8(x2)"
        if m and int(m.group()) > 0:
            return int(m.group())
    return None


def _size_request(args: argparse.Namespace) -> GroupSizeRequest:
    """``--hsp-group-sizes`` as ``flags.parse_sizes`` leaves it (None: auto, "pow2", or a tuple
    of sizes), or the flag's text in a namespace built by hand."""
    value = getattr(args, "hsp_group_sizes", None)
    if isinstance(value, GroupSizeRequest):
        return value
    text = value if value is None or isinstance(value, str) else ",".join(map(str, value))
    try:
        return GroupSizeRequest.parse(text, "--hsp-group-sizes")
    except InputError as exc:
        raise HSPArgsError(str(exc)) from None


def validate_hsp_args(
    args: argparse.Namespace,
    env: Mapping[str, str] | None = None,
    *,
    early: bool = False,
    gpu_names: list[str] | None = None,
) -> HSPConfig | None:
    """Check ``--hsp*`` against Megatron's validated args; returns None when ``--hsp`` is off.

    Mutates ``args`` only where HSP needs a Megatron setting (per-token loss, external data
    loader) and reports each change in ``HSPConfig.notes``.

    ``early``: the flag-only checks, run on the freshly parsed flags before Megatron's own
    ``validate_args`` (``flags.refuse_before_megatron``), returning None; everything that needs
    values Megatron derives (the cost model: FFN size, padded vocabulary) waits for the full
    call. ``gpu_names`` replaces NVML's answer (tests).

    The steps run in this order, each taking what it needs and returning what it derives: the
    refusals (``refusals.REFUSALS``), the pipeline settings, the parallel layout, the group sizes
    and heads, the Megatron settings HSP needs, the batch and length flags, then (full call
    only) the cost model, the sizes it prices and the communicators' budget, the planner.
    """
    if not getattr(args, "hsp", False):
        return None
    env = os.environ if env is None else env
    notes: list[str] = []

    refuse_what_hsp_cannot_run(args)
    pp = _pipeline_settings(args, early, notes)
    layout = _parallel_layout(args, env, pp)
    request = _size_request(args)
    try:
        sizes = list(request.resolve(layout.cluster(), "--hsp-group-sizes"))
    except InputError as exc:
        raise HSPArgsError(str(exc)) from None
    method = _plan_method(args)
    heads, space = _head_space(args, layout.tp, sizes, notes)
    space = method_heads(space, method)  # the splits this method's groups run
    _settings_hsp_needs(args, notes)
    _check_planner_budgets(args)
    gbs, token_budget = _global_batch(args, early, notes)
    max_seq = _max_seq(args, early, notes)
    if args.hsp_log_interval < 0:
        raise HSPArgsError(f"--hsp-log-interval must be >= 0 (got {args.hsp_log_interval})")
    refit_out = _refit_out(args)
    hardware = _hardware(args)
    if early:
        return None

    spec, gpus_per_slot = _cost_model_spec(args, hardware, gpu_names, layout.tp, notes)
    user_cap = args.hsp_memory_cap_gb
    if user_cap is not None:
        user_cap *= gpus_per_slot  # per GPU on the command line, per slot in the model
    sizes, cost = _sizes_the_cost_model_prices(
        args, spec, sizes, layout.slots, layout.slots_per_node, int(max_seq), user_cap, notes
    )
    sizes, memory_cap_gb = _communicator_budget(
        args, sizes, layout.slots_per_node, space, cost, notes, user_cap, gpus_per_slot
    )
    # Said once the sizes are final, so notes never contradict each other.
    _note_ring_sizes(space, sizes, heads, layout.tp, notes)
    try:
        check_method_sizes(
            method, sizes, layout.slots, space, cost.ring_step_ms_per_token, cost.name
        )
    except InputError as exc:
        raise HSPArgsError(str(exc)) from None
    seed = args.hsp_seed if args.hsp_seed is not None else int(arg_value(args, "seed", 1234))
    planner = _planner_settings(args, sizes, cost, pp, seed, notes)
    run = RunSpec(
        dims=layout,
        sizes=request,
        overlong=args.hsp_overlong,
        planner=planner,
        max_seq=int(max_seq),
        sizes_flag="--hsp-group-sizes",
    )
    return HSPConfig(
        cost_model=spec,
        run=run,
        memory_cap_gb=memory_cap_gb,
        global_batch_docs=None if token_budget is not None else int(gbs or 0),
        token_budget=token_budget,
        seed=seed,
        plan_method=method,
        plan_log=args.hsp_plan_log,
        log_interval=args.hsp_log_interval,
        background_planner=not args.hsp_sync_planner,
        plan_timeout_s=float(getattr(args, "hsp_plan_timeout_s", DEFAULT_PLAN_TIMEOUT_S)),
        refit=not getattr(args, "hsp_no_refit", False),
        refit_out=refit_out,
        notes=tuple(notes),
    )


def _pipeline_settings(args: argparse.Namespace, early: bool, notes: list[str]) -> int:
    """``--pipeline-model-parallel-size``, after setting what HSP's stages need of Megatron.

    Every stage runs the same plan, but a micro-batch's activation is [tokens of this rank, 1,
    hidden] and its token count changes every micro-batch: Megatron's own shape handshake
    between stages (docs/integration.md, "Pipeline parallelism", says why not shapes computed
    from the plan). Set on the full call only (the early one runs on a copy).
    """
    pp = arg_value(args, "pipeline_model_parallel_size", 1)
    if pp == 1 or early:
        return pp
    if not getattr(args, "variable_seq_lengths", False):
        args.variable_seq_lengths = True
        notes.append(
            f"variable_seq_lengths set (--pipeline-model-parallel-size {pp}): the "
            "activations sent between stages change shape every micro-batch, so the "
            "stages exchange each one's shape first"
        )
    if getattr(args, "moe_token_dispatcher_type", None) == "allgather":
        # megatron-core refuses variable_seq_lengths with allgather in a dense model too, where
        # no dispatcher is ever built (with experts: refusals.refuse_allgather_with_pipeline).
        args.moe_token_dispatcher_type = "alltoall"
        notes.append(
            "--moe-token-dispatcher-type set to alltoall: megatron-core refuses "
            "variable_seq_lengths with allgather even without experts (dense model: no "
            "dispatcher is built)"
        )
    return pp


def _parallel_layout(args: argparse.Namespace, env: Mapping[str, str], pp: int) -> ParallelDims:
    """The job's parallel dimensions from Megatron's flags (``run_spec.ParallelDims``: slots =
    world / (tp x pp), in whole nodes of GPUs per node / tp); GPUs per node from
    ``--hsp-gpus-per-node``, else the launcher's environment, else one node."""
    tp = arg_value(args, "tensor_model_parallel_size", 1)
    world = arg_value(args, "world_size", int(env.get("WORLD_SIZE", "1")))
    gpn = args.hsp_gpus_per_node or _gpus_per_node_from_env(env) or world
    vpp = arg_value(args, "virtual_pipeline_model_parallel_size", 1) if pp > 1 else 1
    ep = arg_value(args, "expert_model_parallel_size", 1)
    try:
        dims = ParallelDims(world, gpn, tp, pp, int(vpp or 1), int(ep or 1), MEGATRON_FLAGS)
        dims.cluster()  # whole nodes
    except InputError as exc:
        raise HSPArgsError(str(exc)) from None
    return dims


def _head_space(
    args: argparse.Namespace, tp: int, sizes: list[int], notes: list[str]
) -> tuple[int | None, HeadSpace | None]:
    """(``--num-attention-heads``, the ``HeadSpace`` that splits each group into Ulysses x
    ring), or (None, None) where the flags give no heads; notes KV heads replicated in groups."""
    heads = arg_value(args, "num_attention_heads", None)
    kv = kv_heads(args)
    space = None
    if heads is not None:
        if heads % tp:
            raise HSPArgsError(
                f"--num-attention-heads {heads} is not divisible by "
                f"--tensor-model-parallel-size {tp}"
            )
        space = HeadSpace.from_model(heads, kv, tp)
    if kv is not None and heads is not None and (kv // tp) < max(sizes):
        notes.append(
            f"{kv // tp} KV heads per tensor-parallel rank are fewer than the largest "
            f"group ({max(sizes)}); KV heads are replicated inside such groups"
        )
    return heads, space


def _settings_hsp_needs(args: argparse.Namespace, notes: list[str]) -> None:
    """Set the Megatron settings HSP needs, each noted: per-token loss (groups train different
    numbers of tokens) and the external data loader (HSP's sampler feeds the micro-batches)."""
    if not getattr(args, "calculate_per_token_loss", False):
        args.calculate_per_token_loss = True
        notes.append(
            "--calculate-per-token-loss forced on: groups train different numbers of tokens, "
            "so the loss is normalised by the global token count, as on one device"
        )
    if getattr(args, "dataloader_type", None) not in (None, "external"):
        notes.append(
            f"--dataloader-type {args.dataloader_type} replaced by 'external': HSP's "
            "document sampler feeds the planned micro-batches"
        )
    if hasattr(args, "dataloader_type"):
        args.dataloader_type = "external"


def _check_planner_budgets(args: argparse.Namespace) -> None:
    """``--hsp-time-budget-s`` and ``--hsp-memory-cap-gb`` must be positive."""
    try:
        check_time_budget(args.hsp_time_budget_s, "--hsp-time-budget-s")
        _check_plan_timeout(args)
    except InputError as exc:
        raise HSPArgsError(str(exc)) from None
    if args.hsp_memory_cap_gb is not None and args.hsp_memory_cap_gb <= 0:
        raise HSPArgsError(f"--hsp-memory-cap-gb must be > 0 (got {args.hsp_memory_cap_gb})")


BATCH_UNITS = ("tokens", "documents")


def _global_batch(
    args: argparse.Namespace, early: bool, notes: list[str]
) -> tuple[int | None, int | None]:
    """(``--global-batch-size``, the token budget per step; None in the documents mode).

    By default (``--hsp-batch-unit tokens``) a global batch holds the tokens the user's stock
    step trains, ``--global-batch-size x --seq-length`` (or ``--hsp-token-budget``): why, a run
    switched to ``--hsp`` with unchanged flags trained 25-50x fewer tokens per step when
    ``--global-batch-size`` counted documents (issue 43), and its learning rate and batch-size
    hyper-parameters no longer meant what they meant. Megatron's own counters are left to
    Megatron: ``consumed_train_samples`` grows by ``--global-batch-size`` per step, so a sample
    is ``--seq-length`` tokens of the budget and ``--train-samples``, ``--lr-warmup-samples`` and
    ``--lr-decay-samples`` mean what they mean in the stock run (docs/integration.md, "A step as
    large as the stock step"). ``--hsp-batch-unit documents`` keeps the old mode, in which a
    sample is a document.

    Megatron's validate_args derives a missing --global-batch-size (micro-batch x data
    parallel) and --seq-length may come from elsewhere: the budget is checked on the full call
    only."""
    gbs = getattr(args, "global_batch_size", None)
    unit = getattr(args, "hsp_batch_unit", "tokens") or "tokens"
    budget = getattr(args, "hsp_token_budget", None)
    if getattr(args, "rampup_batch_size", None):
        raise HSPArgsError(
            "--rampup-batch-size: under --hsp every step draws the same budget, so Megatron's "
            "ramped sample count would not describe the batches trained; drop "
            "--rampup-batch-size (or ramp the learning rate with --lr-warmup-*)"
        )
    if unit == "documents":
        if budget is not None:
            raise HSPArgsError(
                f"--hsp-token-budget {budget} sets tokens per step and --hsp-batch-unit "
                "documents counts --global-batch-size documents per step; drop one of them"
            )
        if not gbs and not early:
            raise HSPArgsError(
                "--hsp-batch-unit documents needs --global-batch-size (documents per step)"
            )
        return gbs, None
    if unit != "tokens":
        raise HSPArgsError(f"--hsp-batch-unit must be one of {', '.join(BATCH_UNITS)}")
    if budget is not None:
        if budget < 1:
            raise HSPArgsError(f"--hsp-token-budget must be >= 1 (got {budget})")
        seq = arg_value(args, "seq_length", None)
        if gbs and seq and budget != gbs * seq:
            notes.append(
                f"--hsp-token-budget {budget} tokens per step, not the stock step's "
                f"--global-batch-size {gbs} x --seq-length {seq} = {gbs * seq}; Megatron still "
                f"counts {gbs} samples per step (consumed_train_samples, the learning-rate "
                f"schedule), so a sample stands for {budget / gbs:g} tokens"
            )
        return gbs, int(budget)
    if early:
        return gbs, None
    seq = arg_value(args, "seq_length", None)
    if not gbs or not seq:
        raise HSPArgsError(
            "--hsp needs a global batch: give --global-batch-size and --seq-length (tokens "
            "per step = their product, as the stock step), or --hsp-token-budget"
        )
    return gbs, int(gbs) * int(seq)


def _plan_method(args: argparse.Namespace) -> str:
    """``--hsp-plan-method`` (default hsp), in ``run_spec.check_plan_method``'s grammar."""
    try:
        return check_plan_method(getattr(args, "hsp_plan_method", None) or "hsp")
    except InputError as exc:
        raise HSPArgsError(str(exc)) from None


def _max_seq(args: argparse.Namespace, early: bool, notes: list[str]) -> int | None:
    """The longest document the cost model is sized for: ``--hsp-max-seq``, else
    ``--seq-length`` (which Megatron's validate_args may derive: required on the full call
    only), never past learned absolute positions. An ``--hsp-max-seq`` below ``--seq-length``
    is noted: ``128k`` is 128000 tokens (docs/units.md), below a ``--seq-length 131072``, and
    the documents between the two would follow ``--hsp-overlong`` where stock Megatron trains
    them."""
    seq = arg_value(args, "seq_length", None) or arg_value(args, "max_position_embeddings", None)
    max_seq = args.hsp_max_seq or seq
    if not max_seq and not early:
        raise HSPArgsError("--hsp needs --hsp-max-seq or --seq-length to size the cost model")
    seq_length = arg_value(args, "seq_length", None)
    if args.hsp_max_seq and seq_length and int(args.hsp_max_seq) < int(seq_length):
        notes.append(
            f"--hsp-max-seq {args.hsp_max_seq} is below --seq-length {seq_length}: documents "
            f"of {int(args.hsp_max_seq) + 1} to {seq_length} tokens follow --hsp-overlong "
            f"{getattr(args, 'hsp_overlong', None) or DEFAULT_OVERLONG.value} (a k is 1000 tokens, "
            f"docs/units.md); --hsp-max-seq {seq_length} trains up to --seq-length"
        )
    positions = _learned_positions(args)
    if positions is not None and max_seq and int(max_seq) > positions:
        raise HSPArgsError(
            f"--hsp-max-seq {max_seq} is longer than --max-position-embeddings {positions}: "
            "with --position-embedding-type learned_absolute a document's positions past it "
            "have no embedding; lower --hsp-max-seq or raise --max-position-embeddings"
        )
    return max_seq


def _hardware(args: argparse.Namespace) -> str:
    """``--hsp-hardware``, which only the default cost model reads."""
    hardware = getattr(args, "hsp_hardware", "auto")
    if args.hsp_cost_model and hardware not in (None, "auto"):
        raise HSPArgsError(
            f"--hsp-hardware {hardware} prices the default cost model, and --hsp-cost-model "
            f"{args.hsp_cost_model} brings its own figures; drop one of them"
        )
    return hardware


def _cost_model_spec(
    args: argparse.Namespace,
    hardware: str,
    gpu_names: list[str] | None,
    tp: int,
    notes: list[str],
) -> tuple[str | dict[str, Any], int]:
    """(the cost model: the user's, else first principles from this model's own flags, GPUs
    per slot it prices: 1 for a user's model, tp for the default, which prices a whole slot)."""
    if args.hsp_cost_model:
        return args.hsp_cost_model, 1
    try:
        choice = choose_hardware(hardware, gpu_names)
    except HardwareUnknown as exc:
        raise HSPArgsError(str(exc)) from None
    try:
        spec, derived = default_cost_model_spec(args, choice, tp)
    except ValueError as exc:
        raise HSPArgsError(str(exc)) from None
    notes.extend(derived)
    return spec, tp


def _note_ring_sizes(
    space: HeadSpace | None, sizes: list[int], heads: int | None, tp: int, notes: list[str]
) -> None:
    """Note the group sizes whose heads do not split over them: they run Ulysses x ring (every
    size > 1 of a ring-only run: pure ring, whatever the heads)."""
    if space is None:
        return
    ringed = [d for d in sizes if space.split(d)[1] > 1]
    if ringed and space.ring_only:
        notes.append(
            f"group sizes {ringed} run pure ring attention (1 x d), as Megatron's dynamic "
            "context parallelism runs them (--hsp-plan-method)"
        )
    elif ringed:
        assert heads is not None  # a head space comes from the heads
        notes.append(
            f"group sizes {ringed} run Ulysses x ring attention: {heads // tp} attention "
            f"heads per tensor-parallel rank (--num-attention-heads {heads} / "
            f"--tensor-model-parallel-size {tp}) do not split over them, so "
            + ", ".join(f"{d} = {space.split(d)[0]} x {space.split(d)[1]}" for d in ringed)
        )


def _planner_settings(
    args: argparse.Namespace,
    sizes: list[int],
    cost: Any,
    pp: int,
    seed: int,
    notes: list[str],
) -> PlannerSettings:
    """The planner's settings; the pipeline is priced only with a stage cost model for it.

    The planner prices the pipeline (and keeps interleaving's micro-batch multiple) only with a
    stage cost model built for it (planner/cost/parallel.py); with any other model it plans the
    stage's micro-batches unpipelined and the runtime pads an interleaved count
    (hooks._prepare, docs/integration.md).
    """
    vpp = int(arg_value(args, "virtual_pipeline_model_parallel_size", 1))
    staged = (int(cost.details.get("pp", 1)), int(cost.details.get("vpp", 1))) == (pp, vpp)
    if pp > 1 and not staged:
        notes.append(
            f"the cost model is not a stage model for --pipeline-model-parallel-size {pp}"
            + (f" x {vpp} virtual stages" if vpp > 1 else "")
            + ": plans are not priced as a pipeline"
            + (" and their micro-batch count is padded for interleaving" if vpp > 1 else "")
        )
    return PlannerSettings(
        solver=args.hsp_solver,
        time_budget_s=float(args.hsp_time_budget_s),
        sizes=tuple(sizes),
        seed=seed,
        pp=pp if pp > 1 and staged else 1,
        vpp=vpp if pp > 1 and staged else 1,
    )


def _learned_positions(args: argparse.Namespace) -> int | None:
    """``--max-position-embeddings`` where it limits a document (learned absolute positions:
    one embedding per position), else None (RoPE, no positions: any length)."""
    if arg_value(args, "position_embedding_type", "learned_absolute") != "learned_absolute":
        return None
    positions = arg_value(args, "max_position_embeddings", None)
    return int(positions) if positions else None


def document_length_limit(
    args: argparse.Namespace, max_seq: int, memory_length: int
) -> tuple[int, str]:
    """The longest document trained whole under ``--hsp`` and the limit that sets it.

    Why not the memory limit alone: Megatron users set ``--seq-length`` as the longest sample,
    and learned absolute positions have no embedding past ``--max-position-embeddings``;
    whole documents used to train up to whatever the largest group's memory held. Longer
    documents follow ``--hsp-overlong``. Ties name the user's flag.
    """
    flag = "--hsp-max-seq" if getattr(args, "hsp_max_seq", None) else "--seq-length"
    limits = [(int(max_seq), flag)]
    positions = _learned_positions(args)
    if positions is not None:
        limits.append((positions, LIMIT_POSITIONS))
    limits.append((int(memory_length), LIMIT_MEMORY))
    return min(limits, key=lambda limit: limit[0])


LIMIT_POSITIONS = "--max-position-embeddings (learned absolute positions)"
LIMIT_MEMORY = "what the largest group's memory holds"
# What can lengthen the longest trainable length, per limit (``document_length_limit``'s
# ``why``): only the flag that binds. Memory flags cannot help a --seq-length limit.
LIMIT_REMEDIES: dict[str, str] = {
    "--seq-length": "a larger --seq-length (or --hsp-max-seq) trains them whole",
    "--hsp-max-seq": "a larger --hsp-max-seq (up to --seq-length) trains them whole",
    LIMIT_POSITIONS: "a larger --max-position-embeddings, or --position-embedding-type rope, "
    "trains them whole",
    LIMIT_MEMORY: "a larger --hsp-memory-cap-gb, larger --hsp-group-sizes or more GPUs "
    "train them whole",
}


def overlong_line(split: str, count: int, total: int, limit: int, why: str, policy: str) -> str:
    """The start-up line: how many documents are over the limit and what happens to them."""
    if not count:
        return f"{split} split: no document over {limit} tokens ({why})"
    fate = {
        "drop": "dropped",
        "split": f"split into {limit}-token pieces",
        "error": "refused",
    }[policy]
    return (
        f"{split} split: {count} of {total} documents are over {limit} tokens ({why}): "
        f"{fate} (--hsp-overlong {policy})"
    )


REFIT_FILE = "hsp-cost-model.yaml"


def _refit_out(args: argparse.Namespace) -> str | None:
    """Where the online refit writes its model: ``--hsp-refit-out``, else ``<--save>/``
    ``hsp-cost-model.yaml``, else nowhere. Checked now, not after hours of training."""
    from pathlib import Path

    from megatron_hsp.planner.paths import check_output_path

    out = getattr(args, "hsp_refit_out", None)
    if getattr(args, "hsp_no_refit", False):
        if out:
            raise HSPArgsError(
                f"--hsp-refit-out {out} names where the online refit writes its model, and "
                "--hsp-no-refit turns the refit off; drop one of them"
            )
        return None
    if out:
        return check_output_path("--hsp-refit-out", out)
    save = arg_value(args, "save", None)
    return str(Path(save) / REFIT_FILE) if save else None


def _check_plan_timeout(args: argparse.Namespace) -> None:
    """``--hsp-plan-timeout-s`` > 0 and, with the exchange's margin, under Megatron's
    ``--distributed-timeout-minutes``: otherwise a late planner would still meet the watchdog."""
    value = getattr(args, "hsp_plan_timeout_s", DEFAULT_PLAN_TIMEOUT_S)
    minutes = getattr(args, "distributed_timeout_minutes", None) or 10
    high = max(1.0, 60.0 * float(minutes) - PLAN_EXCHANGE_MARGIN_S)
    check_range(value, "--hsp-plan-timeout-s", low=0, low_open=True, high=high)
