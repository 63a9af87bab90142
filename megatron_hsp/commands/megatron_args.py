"""``plan`` and ``bench`` in Megatron's own terms: a user pastes their ``pretrain_gpt.py`` flags.

Why: the planner's own flags (``--gpus``, ``--global-batch``, ``--max-seq``, ``--sizes``) and its
FlexSP-harness defaults (the FlexSP-fitted 7B preset, lengths padded to 128) could not answer
"does *my* job gain". Here the flags are Megatron's, the HSP flags are ``megatron/flags.py``'s
table, and the job is built by the code the training run uses:

* the cost model and the planner's settings: ``megatron.config.validate_hsp_args`` (first
  principles from the model's sizes on ``--hsp-hardware``, or ``--hsp-cost-model``);
* the batches: the training split's sampler (``megatron.datasets.train_sampler``) over the
  ``--data-path`` blend and ``--split`` the run would read (Megatron's indexed ``.idx``), or over
  ``--lengths``/the embedded Wikipedia lengths as one dataset.

Megatron's flags are read without torch or Megatron: ``MEGATRON_FLAGS_FILE`` lists every flag of
megatron-core's ``megatron/training/arguments.py`` (name, values it takes, type, default),
written by ``flag_rows`` from Megatron's own parser and checked against it in
``tests/commands/test_megatron_args.py``. The flags the planner reads (``PLANNER_FLAGS``) are
parsed with Megatron's types and defaults from that list; every other Megatron flag is accepted
and ignored (a pasted command line holds optimizer, logging and checkpoint flags), with the
values it takes, so the next flag is never swallowed. A flag neither Megatron nor the command
knows is an error naming it.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

from megatron_hsp.megatron import refusals
from megatron_hsp.megatron.megatron_checks import check_as_megatron_validates
from megatron_hsp.planner.errors import InputError

MEGATRON_FLAGS_FILE = "megatron_flags.tsv"

# Megatron flags the planner reads -> what it does with them (the help text; the type and the
# default are Megatron's, from MEGATRON_FLAGS_FILE).
PLANNER_FLAGS: dict[str, str] = {
    "seq_length": "longest document trained whole (--hsp-max-seq overrides); sizes the cost model",
    "max_position_embeddings": "with learned absolute positions, no document trains past it",
    "position_embedding_type": "learned_absolute limits documents to --max-position-embeddings",
    "global_batch_size": "documents per step under --hsp (default: --micro-batch-size x data "
    "parallel, as Megatron derives it)",
    "micro_batch_size": "your stock run's samples per micro-batch (megatron-static-cp<N>) and a "
    "missing --global-batch-size's derivation; HSP picks its own micro-batches",
    "seed": "the document sampler's and planner's seed (--hsp-seed overrides; default: 1234, "
    "Megatron's; 0 with --flexsp-harness)",
    "data_path": "indexed datasets: PREFIX, or weights and prefixes (W1 P1 W2 P2 ...), split by "
    "--split as the training run reads them",
    "split": "train/valid/test shares of each --data-path dataset (Megatron: 969,30,1); bench "
    "and plan draw the training split",
    "data_args_path": "a file holding --data-path's list",
    "train_data_path": "the training split's datasets (instead of --data-path)",
    "valid_data_path": "read for the data checks only",
    "test_data_path": "read for the data checks only",
    "per_split_data_args_path": "JSON file of the three splits' lists",
    "mmap_bin_files": "read the datasets' .bin files with file reads instead of memory maps, "
    "as Megatron does with this flag",
    "tensor_model_parallel_size": "HSP plans slots of this many GPUs",
    "pipeline_model_parallel_size": "every stage runs the same plan",
    "num_layers_per_virtual_pipeline_stage": "interleaved pipeline (virtual stages)",
    "num_virtual_stages_per_pipeline_rank": "interleaved pipeline (virtual stages)",
    "context_parallel_size": "your static context-parallel size: the baseline hsp is compared "
    "with (static-CP); under --hsp these GPUs become HSP ranks",
    "expert_model_parallel_size": "expert parallelism (MoE)",
    "num_layers": "model size, for the first-principles cost model",
    "hybrid_layer_pattern": "hybrid models: attention and MLP layers counted from it",
    "hidden_size": "model size",
    "ffn_hidden_size": "model size (default: 4 x hidden, or SwiGLU's 8/3 rounded to 64, as "
    "Megatron derives it)",
    "num_attention_heads": "model size; also which group sizes split the heads",
    "num_query_groups": "KV heads with --group-query-attention",
    "group_query_attention": "use --num-query-groups KV heads",
    "num_experts": "MoE: priced as the active experts' dense FFN",
    "moe_router_topk": "MoE: experts per token",
    "moe_ffn_hidden_size": "MoE: an expert's FFN",
    "moe_shared_expert_intermediate_size": "MoE: shared experts' FFN",
    "swiglu": "gated FFN",
    "untie_embeddings_and_output_weights": "separate output layer weights",
    "vocab_size": "vocabulary (default: priced as 128256, Llama 3's)",
    "bf16": "precision",
    "fp16": "precision",
    "use_distributed_optimizer": "ZeRO-1 optimizer states (memory)",
    "recompute_granularity": "full or selective recompute, priced in memory and time",
    "recompute_method": "full recompute: uniform (every layer, chunks of --recompute-num-layers) "
    "or block (the first --recompute-num-layers layers of each stage)",
    "recompute_num_layers": "full recompute: layers per chunk (uniform) or recomputed (block)",
    "recompute_modules": "selective recompute: core_attn (Megatron's default), layernorm, mlp "
    "are priced; others are said in a note",
    "recompute_activations": "selective recompute (Megatron's alias)",
    "cp_comm_type": "your static CP's attention communication: p2p (ring, Megatron's default), "
    "a2a, allgather or a2a+p2p (with --hierarchical-context-parallel-sizes); prices "
    "megatron-static-cp<N>",
    "hierarchical_context_parallel_sizes": "a2a+p2p: all-to-all over the first size, ring "
    "across the rest",
    "reset_attention_mask": "stock samples: the mask is reset at document ends, the attention "
    "kernel still runs over the whole packed sample (priced so)",
    "dataloader_inter_document_masking": "stock samples carry cu_seqlens: attention per "
    "document piece (THD)",
    "sft": "stock samples carry cu_seqlens: attention per document piece (THD)",
    "attention_dropout": "training under --hsp needs 0 (said in a note; it does not change the "
    "planned times)",
}


@dataclass(frozen=True)
class MegatronFlag:
    """One Megatron flag: ``kind`` is how many values it takes (``true``/``false``/``bool``:
    none; ``1``, ``*``, ``+`` or a count), ``type`` int/float/str, ``default`` Megatron's."""

    dest: str
    kind: str
    type: str
    default: Any
    options: tuple[str, ...]


def flag_rows(parser: argparse.ArgumentParser) -> list[str]:
    """``MEGATRON_FLAGS_FILE``'s lines from a parser Megatron's ``add_megatron_arguments`` filled
    (the test compares the shipped file with this; ``--regenerate`` rewrites it)."""
    kinds = {"_StoreTrueAction": "true", "_StoreFalseAction": "false"}
    out = []
    for a in parser._actions:
        if not a.option_strings or a.dest == "help":
            continue
        name = type(a).__name__
        if name == "BooleanOptionalAction":
            kind = "bool"
        elif name in kinds:
            kind = kinds[name]
        elif name == "_StoreAction":
            kind = "1" if a.nargs is None else str(a.nargs)
        else:
            raise ValueError(f"{a.option_strings}: {name} has no kind in {MEGATRON_FLAGS_FILE}")
        typ = getattr(a.type, "__name__", None)
        typ = typ if typ in ("int", "float") else "str"
        default = json.dumps(a.default, default=str)
        out.append("\t".join((a.dest, kind, typ, default, " ".join(a.option_strings))))
    return out


@functools.cache
def megatron_flags() -> tuple[MegatronFlag, ...]:
    """Every Megatron flag, from the shipped list (no torch, no Megatron needed)."""
    path = resources.files("megatron_hsp") / "data" / MEGATRON_FLAGS_FILE
    flags = []
    for line in path.read_text().splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        dest, kind, typ, default, options = line.split("\t")
        flags.append(MegatronFlag(dest, kind, typ, json.loads(default), tuple(options.split())))
    return tuple(flags)


_TYPES = {"int": int, "float": float, "str": str}


def _add_flag(group: Any, flag: MegatronFlag, help_text: str) -> None:
    """Add one Megatron flag as Megatron's parser defines it (``help_text`` SUPPRESS: ignored,
    absent from the namespace unless given)."""
    ignored = help_text == argparse.SUPPRESS
    default = argparse.SUPPRESS if ignored else flag.default
    kw: dict[str, Any] = {"dest": flag.dest, "default": default, "help": help_text}
    if flag.kind == "true":
        group.add_argument(*flag.options, action="store_true", **kw)
    elif flag.kind == "false":
        group.add_argument(*flag.options, action="store_false", **kw)
    elif flag.kind == "bool":  # BooleanOptionalAction: Megatron lists --x and --no-x
        positive = [o for o in flag.options if "--no-" + o[2:] in flag.options]
        if positive:
            group.add_argument(*positive, action=argparse.BooleanOptionalAction, **kw)
        else:
            group.add_argument(*flag.options, action="store_const", const=True, **kw)
    else:
        nargs = None if flag.kind == "1" else int(flag.kind) if flag.kind.isdigit() else flag.kind
        kw["nargs"] = nargs
        group.add_argument(*flag.options, type=_TYPES[flag.type], **kw)


def add_megatron_arguments(parser: argparse.ArgumentParser) -> None:
    """Megatron's flags (the planner's with help and default, the rest hidden and ignored), the
    world size as torchrun spells it, and the ``--hsp*`` flags (``megatron/flags.py``)."""
    parser.allow_abbrev = False  # Megatron's parser too: 800 flags make prefixes ambiguous
    flags = {f.dest: f for f in megatron_flags()}
    job = parser.add_argument_group(
        "Megatron training flags the planner reads (paste your pretrain_gpt.py flags; "
        "other Megatron flags are accepted and ignored)"
    )
    for dest, help_text in PLANNER_FLAGS.items():
        _add_flag(job, flags[dest], help_text)
    # Megatron's --seed defaults to 1234; the FlexSP harness's to 0 (set after parsing).
    job.set_defaults(seed=None)
    _add_world_and_hsp_arguments(parser)
    hidden = parser.add_argument_group("other Megatron flags (ignored)")
    for flag in flags.values():
        if flag.dest not in PLANNER_FLAGS:
            _add_flag(hidden, flag, argparse.SUPPRESS)


def _add_world_and_hsp_arguments(parser: argparse.ArgumentParser) -> None:
    """The world size as torchrun spells it, and the ``--hsp*`` flags (``megatron/flags.py``)."""
    from megatron_hsp.megatron.flags import add_hsp_args

    world = parser.add_argument_group("world size (as torchrun or Slurm give it)")
    # Defaults None (resolved in ``_megatron_namespace``): a --world-size against both is refused.
    world.add_argument("--nnodes", type=int, default=None, help="nodes (default: 1)")
    world.add_argument(
        "--nproc-per-node", type=int, default=None, help="GPUs per node (default: 8)"
    )
    world.add_argument(
        "--world-size",
        type=int,
        default=None,
        help="GPUs in all (default: --nnodes x --nproc-per-node)",
    )
    add_hsp_args(parser)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every flag's default in ``--help``, unless its help already says it."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.help and "default" in action.help:
            return action.help
        if isinstance(action, argparse._StoreFalseAction):
            # "--no-mmap-bin-files ... (default: True)" read as if the flag were on by default.
            return f"{action.help} (default: not given)"
        return super()._get_help_string(action)


def add_job_arguments(parser: argparse.ArgumentParser, command: str) -> None:
    """``plan``'s and ``bench``'s shared flags: the Megatron job, the FlexSP harness, --verbose.

    A bad value is one line naming the flag (argparse's own message, without the usage block
    of some sixty flags)."""
    from megatron_hsp.commands.common import add_common_arguments, add_verbose_argument

    parser.formatter_class = HelpFormatter

    def error(message: str) -> None:
        print(
            f"megatron-hsp {command}: error: {message}; megatron-hsp {command} --help lists "
            "the flags",
            file=sys.stderr,
        )
        sys.exit(2)

    parser.error = error  # type: ignore[method-assign]
    parser.add_argument(
        "--flexsp-harness",
        action="store_true",
        help="plan FlexSP's published setup instead of a Megatron job: the harness flags below "
        "(--gpus, --global-batch, --max-seq, ...) with their defaults, FlexSP's fitted 7B cost "
        "model, lengths padded to 128, documents over max-seq - 128 dropped, k = 1000",
    )
    add_megatron_arguments(parser)
    add_common_arguments(parser, harness=False)
    add_verbose_argument(parser)


def setup_from_args(args: argparse.Namespace) -> Any:
    """``plan``/``bench``: the FlexSP harness's setup under ``--flexsp-harness``, else the
    Megatron job the flags describe."""
    from megatron_hsp.commands.common import apply_harness_defaults, build_setup

    if not getattr(args, "flexsp_harness", False):
        return megatron_setup(args)
    defaults = megatron_defaults()
    job_only = argparse.ArgumentParser()
    _add_world_and_hsp_arguments(job_only)
    defaults.update(vars(job_only.parse_args([])))
    given = [
        "--" + dest.replace("_", "-")
        for dest in [*PLANNER_FLAGS, *vars(job_only.parse_args([]))]
        if dest != "seed" and getattr(args, dest) != defaults[dest]
    ]
    if given:
        raise InputError(
            f"{given[0]} describes a Megatron job, which --flexsp-harness does not plan; drop "
            "--flexsp-harness to plan the job, or that flag to run the harness"
        )
    apply_harness_defaults(args)
    return build_setup(args)


def megatron_defaults() -> dict[str, Any]:
    """Megatron's default of every flag (dest -> value), from the shipped list."""
    return {f.dest: f.default for f in megatron_flags()}


def unknown_flags_message(command: str, extras: Sequence[str]) -> str:
    """One line for arguments neither Megatron nor the command knows."""
    flags = [a for a in extras if a.startswith("-")]
    what = flags[0] if flags else extras[0]
    kind = "flag" if flags else "argument"
    return (
        f"megatron-hsp {command}: error: {kind} {what} is neither a Megatron-LM training flag "
        f"nor one of {command}'s (megatron-hsp {command} --help lists them; a flag of a newer "
        "Megatron-LM than the one this release lists is not known either)"
        + (f"; also unknown: {' '.join(extras[1:])}" if len(extras) > 1 else "")
    )


# ----------------------------------------------------------------------------- the job
# FlexSP-harness flags of add_common_arguments, and their names in this mode.
HARNESS_FLAGS: dict[str, str] = {
    "gpus": "--world-size N (or --nnodes and --nproc-per-node)",
    "gpus_per_node": "--nproc-per-node",
    "global_batch": "--global-batch-size",
    "max_seq": "--seq-length (or --hsp-max-seq)",
    "cost_model": "--hsp-cost-model (default: first principles from the model's sizes)",
    "tp": "--tensor-model-parallel-size",
    "pp": "--pipeline-model-parallel-size",
    "vpp": "--num-layers-per-virtual-pipeline-stage",
    "ep": "--expert-model-parallel-size",
    "sizes": "--hsp-group-sizes",
    "memory_cap_gb": "--hsp-memory-cap-gb",
    "solver": "--hsp-solver",
    "time_budget": "--hsp-time-budget-s",
    "overlong": "--hsp-overlong",
    "sampling": "nothing (batches are drawn by the training run's sampler)",
}


def refuse_harness_flags(args: argparse.Namespace) -> None:
    """Without ``--flexsp-harness`` the FlexSP harness's flags are errors naming the Megatron
    flag that says the same (they were left at None by ``add_common_arguments(harness=False)``)."""
    for dest, instead in HARNESS_FLAGS.items():
        if getattr(args, dest, None) is not None:
            flag = "--" + dest.replace("_", "-")
            if dest == "sampling" and args.sampling == "training":
                continue
            raise InputError(
                f"{flag} is a FlexSP-harness flag: add --flexsp-harness to reproduce the FlexSP "
                f"comparison, or give your Megatron job's {instead}"
            )


def _megatron_namespace(args: argparse.Namespace, notes: list[str]) -> argparse.Namespace:
    """The namespace the training run's ``validate_hsp_args`` would see: ``--hsp`` on, the world
    size, and what Megatron's ``validate_args`` derives (FFN size, global batch, virtual stages).
    Your static context parallelism becomes HSP ranks (``--hsp`` refuses CP > 1), and the
    micro-batch size 1 (HSP chooses micro-batches); both are the baseline's, said in notes."""
    ns = argparse.Namespace(**vars(args))
    ns.hsp = True
    if ns.seed is None:
        ns.seed = megatron_defaults()["seed"]
    typed = ns.nnodes is not None and ns.nproc_per_node is not None
    ns.nnodes = 1 if ns.nnodes is None else ns.nnodes
    ns.nproc_per_node = 8 if ns.nproc_per_node is None else ns.nproc_per_node
    for flag, dest in (("--nnodes", "nnodes"), ("--nproc-per-node", "nproc_per_node")):
        if getattr(ns, dest) < 1:
            raise InputError(f"{flag} must be >= 1 (got {getattr(ns, dest)})")
    given = ns.nnodes * ns.nproc_per_node
    if typed and ns.world_size is not None and ns.world_size != given:
        raise InputError(
            f"--world-size {ns.world_size} disagrees with --nnodes {ns.nnodes} x "
            f"--nproc-per-node {ns.nproc_per_node} = {given} GPUs; give --nnodes and "
            "--nproc-per-node as torchrun does, or only --world-size"
        )
    world = ns.world_size if ns.world_size is not None else given
    if world < 1:
        raise InputError(f"--world-size must be >= 1 (got {world})")
    ns.world_size = world
    if ns.hsp_gpus_per_node is None:
        ns.hsp_gpus_per_node = min(ns.nproc_per_node, world)
    tp, pp = ns.tensor_model_parallel_size, ns.pipeline_model_parallel_size
    cp = ns.context_parallel_size
    for flag, v in (("--tensor-model-parallel-size", tp), ("--pipeline-model-parallel-size", pp),
                    ("--context-parallel-size", cp),
                    ("--expert-model-parallel-size", ns.expert_model_parallel_size)):  # fmt: skip
        if v < 1:
            raise InputError(f"{flag} must be >= 1 (got {v})")
    # The stock job as given must pass Megatron's own checks (its CP and micro-batch size).
    check_as_megatron_validates(ns, "your job as given")
    if getattr(args, "hsp", False):  # typed: the training run's flags, refused as it refuses
        for refuse in (refusals.refuse_micro_batch_size, refusals.refuse_context_parallel):
            refuse(ns)
        refusals.refuse_attention_dropout(ns)  # (without --hsp they are the stock job's: notes)
    if cp > 1:
        notes.append(
            f"--context-parallel-size {cp}: the static baseline (static-{cp}); under --hsp the "
            "same GPUs are HSP ranks (--context-parallel-size 1)"
        )
        ns.context_parallel_size = 1
    if ns.ffn_hidden_size is None and ns.hidden_size:
        h = ns.hidden_size  # validate_args: SwiGLU's 8/3 x hidden, down to a multiple of 64
        ns.ffn_hidden_size = int((4 * h * 2 / 3) / 64) * 64 if ns.swiglu else 4 * h
    if not ns.group_query_attention:
        ns.num_query_groups = ns.num_attention_heads
    if ns.global_batch_size is None and ns.hsp_token_budget is None:
        dp = world // (tp * pp * cp)
        mbs = ns.micro_batch_size or 1
        ns.global_batch_size = mbs * dp
        notes.append(
            f"--global-batch-size not given: {ns.global_batch_size} documents per step "
            f"(--micro-batch-size {mbs} x {dp} data-parallel ranks, as Megatron derives it)"
        )
    if (ns.micro_batch_size or 1) != 1:
        notes.append(
            f"--micro-batch-size {ns.micro_batch_size}: the static baseline's; training under "
            "--hsp needs --micro-batch-size 1 (the planner chooses the micro-batches), which "
            "hsp's rows assume"
        )
    ns.micro_batch_size = 1
    if ns.attention_dropout:
        notes.append(
            f"--attention-dropout {ns.attention_dropout:g} (Megatron's default is 0.1): training "
            "under --hsp needs --attention-dropout 0, which these times assume"
        )
        ns.attention_dropout = 0.0
    # Megatron's validate_args: virtual stages per rank, given or from layers per virtual stage.
    vpp = ns.num_virtual_stages_per_pipeline_rank
    if vpp is None and (per_vstage := ns.num_layers_per_virtual_pipeline_stage) and ns.num_layers:
        vpp = (ns.num_layers // pp) // per_vstage
    ns.virtual_pipeline_model_parallel_size = vpp if vpp and vpp > 1 else None
    # The job under --hsp passes Megatron's checks too, or the training run stops where this plans.
    check_as_megatron_validates(ns, "the same job under --hsp (CP 1, micro-batch 1)")
    return ns


class _Lengths:
    """A corpus given as lengths (``--lengths`` or the embedded default), shaped like a
    ``documents.DocumentIndex`` for ``datasets.build_split_sampler``."""

    def __init__(self, lengths: np.ndarray) -> None:
        self.lengths = lengths

    def __len__(self) -> int:
        return len(self.lengths)


def _data_and_indices(ns: argparse.Namespace) -> tuple[Any, dict[str, Any], str]:
    """(``datasets.HSPData``, prefix -> index, a description): the Megatron data flags as the
    training run reads them (megatron-core's blend and split helpers, its ``IndexedDataset``:
    these need torch), else ``--lengths``/the embedded lengths as one whole dataset."""
    from megatron_hsp.megatron.datasets import HSPData, SplitSource

    data_flags = ("data_path", "data_args_path", "per_split_data_args_path", "train_data_path")
    given = [f for f in data_flags if getattr(ns, f, None) is not None]
    if given and ns.lengths is not None:
        raise InputError(
            f"--lengths and --{given[0].replace('_', '-')} both name the documents; give one"
        )
    if given:
        try:
            import megatron.core  # noqa: F401
        except ImportError as exc:
            raise InputError(
                f"--{given[0].replace('_', '-')} is read with megatron-core, as the training run "
                f"reads it, and it does not import here ({exc}); install megatron-hsp[runtime] or "
                "give the lengths with --lengths PREFIX (one dataset, no blend)"
            ) from None
        from megatron_hsp.megatron.datasets import hsp_data_from_args
        from megatron_hsp.step.documents import DocumentIndex

        data = hsp_data_from_args(ns)
        mmap = bool(getattr(ns, "mmap_bin_files", True))
        indices = {p: DocumentIndex(p, mmap=mmap) for p in data.prefixes}
        return data, indices, data.describe()
    from megatron_hsp.planner.lengths import default_lengths_path, read_lengths

    name = ns.lengths or str(default_lengths_path())
    source = SplitSource(name, None, None)
    data = HSPData(splits={"train": (source,)}, prefixes=(name,))
    return data, {name: _Lengths(read_lengths(ns.lengths))}, f"train: {Path(name).name}"


@dataclass
class TrainingBatches:
    """The training split's global batches, as ``planner.lengths.BatchSampler`` serves them
    (``batch(step)``): step ``i`` is the ``i``-th batch the training run's sampler draws."""

    sampler: Any
    overlong_line: str
    harness_dropped: int = 0  # no FlexSP harness rule here (read by the reports)

    def __post_init__(self) -> None:
        self._drawn: list[Any] = []

    def batch(self, step: int) -> Any:
        from megatron_hsp.planner.lengths import GlobalBatch

        if step < 0:
            raise InputError(f"--start-step / --batch-index must be >= 0, got {step}")
        while len(self._drawn) <= step:
            self._drawn.append(self.sampler.next_batch())
        b = self._drawn[step]
        return GlobalBatch(
            step,
            np.asarray(b.lengths, dtype=np.int64),
            np.asarray([p.doc for p in b.pieces], dtype=np.int64),
        )


def megatron_setup(args: argparse.Namespace) -> Any:
    """The ``Setup`` (``commands.common``) of the Megatron job the flags describe: the training
    run's ``HSPConfig`` (cost model, slots, group sizes, planner settings) and its sampler."""
    from megatron_hsp.commands.common import Setup, check_numeric_flags_of_command
    from megatron_hsp.megatron.config import document_length_limit, validate_hsp_args
    from megatron_hsp.megatron.datasets import refuse_data_flags, train_sampler
    from megatron_hsp.planner.cost.parallel import ParallelConfig, pipeline_spec_for
    from megatron_hsp.planner.topology import Cluster

    refuse_harness_flags(args)
    check_numeric_flags_of_command(args)
    if not getattr(args, "seq_length", None) and not getattr(args, "hsp_max_seq", None):
        # Said as what the command needs: the user may not have typed --hsp at all.
        command = getattr(args, "command", None) or "bench"
        raise InputError(
            f"{command} needs your Megatron job's flags, --seq-length first (the longest "
            "sample), with --num-layers, --hidden-size, --num-attention-heads, "
            "--global-batch-size and the world size (--nnodes, --nproc-per-node); paste your "
            "pretrain_gpt.py flags (README, 'Ask whether your job gains')"
        )
    notes: list[str] = []
    ns = _megatron_namespace(args, notes)
    refuse_data_flags(ns)  # training's own check of its data flags, with or without data
    cfg = validate_hsp_args(ns, env={})
    assert cfg is not None  # --hsp is on
    notes.extend(cfg.notes)
    cfg = _equal_token_batches(cfg, ns, notes)
    cost = cfg.planner_spec().load_cost_model()
    cluster = Cluster(cfg.world_size, cfg.gpus_per_node)
    data, indices, described = _data_and_indices(ns)
    max_length, why = document_length_limit(
        ns, cfg.max_seq, cost.max_trainable_length(list(cfg.group_sizes))
    )
    sampler, line = train_sampler(data, indices, cfg, max_length, why)
    settings = cfg.planner
    parallel = ParallelConfig(
        ns.tensor_model_parallel_size,
        ns.pipeline_model_parallel_size,
        settings.vpp,
        ns.expert_model_parallel_size,
    )
    pipeline = pipeline_spec_for(cost, settings.pp, settings.vpp) if settings.pp > 1 else None
    stock = stock_cp_from_args(args, notes)
    gbs, seq = ns.global_batch_size, getattr(args, "seq_length", None)
    job = MegatronJob(
        world_size=ns.world_size,
        tp=ns.tensor_model_parallel_size,
        pp=ns.pipeline_model_parallel_size,
        cp=args.context_parallel_size,
        global_batch=cfg.global_batch_docs,
        token_budget=cfg.token_budget,
        max_length=max_length,
        data=described,
        notes=tuple(notes),
        stock=stock,
        stock_step_tokens=int(gbs) * int(seq) if gbs and seq else None,
    )
    return Setup(
        cluster,
        cost,
        TrainingBatches(sampler, line),  # type: ignore[arg-type]
        cfg.run,
        parallel,
        pipeline,
        job=job,
    )


def _equal_token_batches(cfg: Any, ns: argparse.Namespace, notes: list[str]) -> Any:
    """``cfg`` whose sampler draws the stock step's tokens per step: ``--global-batch-size x
    --seq-length``, whole documents in sampler order, the one that would cross the budget
    starting the next step (training's token-budget rule, ``step/sampler.py``).

    Why: bench's gains must compare equal work, the tokens a stock step trains (issue 43); a
    batch of ``--global-batch-size`` documents held 25-50x fewer. Where the training config
    already sets a token budget (``--hsp-token-budget``, or training's own default) it is kept;
    an explicit documents mode (``--hsp-batch-unit documents``) is kept too, and the report
    then says its gains are not at the stock step's tokens."""
    if cfg.token_budget is not None or getattr(ns, "hsp_batch_unit", "tokens") == "documents":
        return cfg
    gbs, seq = ns.global_batch_size, getattr(ns, "seq_length", None)
    if not gbs or not seq:
        return cfg
    budget = int(gbs) * int(seq)
    notes.append(
        f"batches of at most {budget} tokens per step (--global-batch-size {gbs} x --seq-length "
        f"{seq}, the stock step's tokens; whole documents in sampler order, the one that would "
        "cross the budget starts the next step): every row below trains these same batches"
    )
    return dataclasses.replace(cfg, token_budget=budget, global_batch_docs=None)


def stock_cp_from_args(args: argparse.Namespace, notes: list[str]) -> Any:
    """How stock Megatron runs these flags (``baselines.StockCP``), or None without
    ``--seq-length`` (said in a note): the ``megatron-static-cp<N>`` rows' job."""
    from megatron_hsp.evaluation.baselines import StockCP

    seq = getattr(args, "seq_length", None)
    if not seq:
        notes.append(
            "no --seq-length: stock Megatron's packed samples (megatron-static-cpN) skipped"
        )
        return None
    types = list(getattr(args, "cp_comm_type", None) or ["p2p"])
    if len(set(types)) > 1:
        raise InputError(
            f"--cp-comm-type {' '.join(types)}: bench prices one type for every layer; give one "
            "of p2p, a2a, allgather, a2a+p2p"
        )
    comm = types[0]
    sizes = getattr(args, "hierarchical_context_parallel_sizes", None)
    cp = int(args.context_parallel_size)
    a2a = 1
    if comm == "a2a+p2p":
        if not sizes:
            raise InputError(
                "--cp-comm-type a2a+p2p needs --hierarchical-context-parallel-sizes (e.g. 8 4: "
                "all-to-all over 8, ring across 4), as Megatron requires"
            )
        if math.prod(sizes) != cp:
            raise InputError(
                f"--hierarchical-context-parallel-sizes {' '.join(map(str, sizes))}: their "
                f"product must be --context-parallel-size {cp}, as Megatron requires"
            )
        a2a = int(sizes[0])
    per_doc = bool(
        getattr(args, "dataloader_inter_document_masking", False) or getattr(args, "sft", False)
    )
    if getattr(args, "reset_attention_mask", False) and not per_doc:
        notes.append(
            "--reset-attention-mask: the stock run masks attention at document ends, but its "
            "kernel still runs over the whole packed sample: megatron-static-cpN is priced so "
            "(--dataloader-inter-document-masking makes it per document)"
        )
    if cp > 1 and seq % (2 * cp):
        notes.append(
            f"--seq-length {seq} is not a multiple of 2 x --context-parallel-size {cp}: stock "
            "Megatron refuses it; megatron-static-cpN is priced as if it ran"
        )
    return StockCP(
        cp=cp,
        seq_length=int(seq),
        micro_batch_size=int(getattr(args, "micro_batch_size", None) or 1),
        comm=comm,
        a2a_size=a2a,
        per_document=per_doc,
    )


@dataclass(frozen=True)
class MegatronJob:
    """What the report says about the job: its parallel sizes, batch, data and the notes;
    ``stock``: how stock Megatron runs these flags (``megatron-static-cp<N>``), and
    ``stock_step_tokens`` the tokens its step trains (``--global-batch-size x --seq-length``)."""

    world_size: int
    tp: int
    pp: int
    cp: int
    global_batch: int | None
    token_budget: int | None
    max_length: int
    data: str
    notes: tuple[str, ...]
    stock: Any = None
    stock_step_tokens: int | None = None

    def describe(self) -> str:
        batch = (
            f"GBS {self.global_batch} documents"
            if self.token_budget is None
            else f"{self.token_budget} tokens per step"
        )
        return (
            f"{self.world_size} GPUs (TP {self.tp} x PP {self.pp}; your CP {self.cp}), {batch}, "
            f"documents up to {self.max_length} tokens; {self.data}"
        )


def print_notes(setup: Any, out: Any = None) -> None:
    """The job's notes (how the cost model was derived, what was set), one line each."""
    out = sys.stderr if out is None else out
    job = getattr(setup, "job", None)
    if job is None:
        return
    for note in job.notes:
        print(f"note: {note}", file=out)
    print(setup.sampler.overlong_line, file=out)


def default_methods(setup: Any) -> list[str]:
    """hsp against your static CP as stock Megatron runs it, the per-document static layouts of
    your CP and the best one (and the lower bound)."""
    stock = [f"megatron-static-cp{setup.job.cp}"] if setup.job.stock is not None else []
    return ["hsp", *stock, f"static-{setup.job.cp}", "static-best"]


def gain_lines(result: dict, cp: int) -> list[str]:
    """The headline and the further gains, each saying which comparison it is.

    The headline is hsp against stock Megatron's run of your flags (``megatron-static-cp<N>``)
    at equal tokens per step; then the per-document static rows (FlexSP's packing at your CP
    and the best CP in hindsight). Every ratio is of summed whole step times
    (``execution.step_wall_ms``: the passes plus the once-a-step gradient reduction and optimizer
    every method pays), over the same batches."""
    summ, methods = result["summary"], result["methods"]
    totals = summ.get("total_step_wall_s") or summ["total_step_s"]
    hsp = totals.get("hsp")
    if not hsp:
        return []
    job = result.get("job") or {}
    steps = len(methods["hsp"]["step_ms"])
    out = [_tokens_line(summ, job)]
    rows = [
        (f"megatron-static-cp{cp}", f"your static CP {cp} as stock Megatron runs it"),
        (f"static-{cp}", f"static CP {cp} packing whole documents (FlexSP's best-fit)"),
        ("static-best", "the best per-document static CP"),
    ]
    for name, label in rows:
        if name not in methods:
            continue
        total = totals.get(name)
        if name == "static-best" and methods[name].get("degree"):
            label += f" (CP {methods[name]['degree']})"
        if not total:
            reason = methods[name].get("infeasible_reason", "not plannable")
            out.append(f"planned gain: {label} cannot train these batches ({reason})")
            continue
        which = summ.get("comparison", {}).get(name, "equal tokens")
        out.append(
            f"planned gain: hsp {total / hsp:.2f}x faster than {label} ({total:.3g} s -> "
            f"{hsp:.3g} s over {steps} steps; {which})"
        )
        stock = job.get("stock") or {}
        if name.startswith("megatron-static") and not stock.get("per_document", True):
            out.append(
                "  (stock attention is causal over each whole packed sample, across its "
                "documents: work hsp's per-document attention does not do; with "
                "--dataloader-inter-document-masking it is priced per document)"
            )
    return out


def _tokens_line(summ: dict, job: dict) -> str:
    """Tokens per step of the rows, and how they relate to the stock step's."""
    tokens = summ.get("tokens_per_step", {})
    hsp = tokens.get("hsp", 0.0)
    stock = job.get("stock_step_tokens")
    line = f"tokens per step: {hsp:.0f} (mean) in every row"
    unequal = [k for k, v in summ.get("comparison", {}).items() if v.startswith("NOT")]
    if unequal:
        line = f"tokens per step: hsp {hsp:.0f} (mean); not equal in {', '.join(unequal)}"
    if not stock:
        return line
    budget = job.get("token_budget")
    if budget == stock:
        why = (
            "whole documents up to the stock step's --global-batch-size x --seq-length = "
            f"{stock} tokens ({hsp / stock:.1%} of it)"
        )
    elif budget:
        why = f"NOT the stock step's {stock} tokens: --hsp-token-budget {budget}"
    else:
        why = f"NOT the stock step's {stock} tokens: --global-batch-size counts documents"
    return f"{line}; {why}"


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m megatron_hsp.commands.megatron_args --regenerate``: rewrite the shipped list
    from the installed Megatron (needs torch and megatron-core's ``megatron/training``)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv != ["--regenerate"]:
        print("usage: python -m megatron_hsp.commands.megatron_args --regenerate", file=sys.stderr)
        return 2
    from megatron.training.arguments import add_megatron_arguments as add_megatron

    parser = argparse.ArgumentParser(allow_abbrev=False)
    add_megatron(parser)
    from megatron.core.package_info import __shortversion__ as version

    path = Path(str(resources.files("megatron_hsp") / "data" / MEGATRON_FLAGS_FILE))
    head = (
        f"# Megatron-LM training flags of megatron-core {version} (megatron/training/"
        "arguments.py): dest, values taken, type, default (JSON), option strings.\n"
        "# Written by: python -m megatron_hsp.commands.megatron_args --regenerate\n"
    )
    from megatron_hsp.planner.paths import atomic_write

    atomic_write(path, head + "\n".join(flag_rows(parser)) + "\n")
    print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
