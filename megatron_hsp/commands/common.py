"""Flags and setup shared by ``plan`` and ``bench`` (torch-free; see docs/design.md sec. 3)."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from megatron_hsp.planner.cost.costmodel import CostModel, preset_names
from megatron_hsp.planner.cost.parallel import (
    ParallelConfig,
    load_any_cost_model,
    parallel_preset_names,
    pipeline_spec_for,
)
from megatron_hsp.planner.cost.pipeline import PipelineSpec
from megatron_hsp.planner.errors import InputError
from megatron_hsp.planner.lengths import (
    SAMPLING_MODES,
    BatchSampler,
    parse_max_seq,
    read_lengths,
)
from megatron_hsp.planner.run_spec import (
    DEFAULT_SOLVER,
    DEFAULT_TIME_BUDGET_S,
    MILP_SOLVERS,
    OVERLONG_POLICIES,
    PLAN_FLAGS,
    GroupSizeRequest,
    ParallelDims,
    check_time_budget,
)
from megatron_hsp.planner.search.settings import PlannerSettings, RunSpec
from megatron_hsp.planner.topology import Cluster
from megatron_hsp.planner.units import check_range

# The widest group of GPUs one fast fabric joins that this tool plans for (NVL72 is 72).
MAX_GPUS_PER_NODE = 512


# The FlexSP harness's defaults (docs/cli-plan-bench.md): the published FlexSP comparison.
HARNESS_DEFAULTS: dict[str, object] = {
    "gpus": 64,
    "gpus_per_node": 8,
    "cost_model": "flexsp-gpt-7b",
    "tp": 1,
    "pp": 1,
    "vpp": 1,
    "ep": 1,
    "max_seq": "192k",
    "global_batch": 512,
    "seed": 0,
    "solver": DEFAULT_SOLVER.value,
    "time_budget": DEFAULT_TIME_BUDGET_S,
    "sampling": "sequential",
}


def add_common_arguments(parser: argparse.ArgumentParser, harness: bool = True) -> None:
    """The FlexSP harness's flags. ``harness`` False (``plan``/``bench``, whose flags are
    Megatron's: ``megatron_args``): they default to None, are shown as the harness's, and
    ``apply_harness_defaults`` fills them under ``--flexsp-harness``."""
    group = (
        parser
        if harness
        else parser.add_argument_group(
            "FlexSP harness (only with --flexsp-harness: FlexSP's published setup, its fitted 7B "
            "cost model, lengths padded to 128, documents over max-seq - 128 dropped, k = 1000)"
        )
    )

    def default(key: str) -> object:
        return HARNESS_DEFAULTS.get(key) if harness else None

    def shown(key: str, text: str) -> str:
        value = HARNESS_DEFAULTS.get(key)
        return text if value is None else f"{text} (default: {value})"

    # --lengths works with and without --flexsp-harness (in place of --data-path): filed with
    # the command's own options, not under the harness's group.
    parser.add_argument(
        "--lengths",
        default=None,
        help="text file (one length per line, .gz ok) or Megatron indexed dataset prefix, "
        "with or without --flexsp-harness (instead of --data-path); default: the embedded "
        "Wikipedia 100k subset",
    )
    group.add_argument(
        "--gpus",
        type=int,
        default=default("gpus"),
        help=shown("gpus", "GPUs; the planner plans gpus / (tp * pp) sequence-parallel slots"),
    )
    group.add_argument(
        "--gpus-per-node",
        type=int,
        default=default("gpus_per_node"),
        help=shown("gpus_per_node", ""),
    )
    group.add_argument(
        "--cost-model",
        default=default("cost_model"),
        help=shown(
            "cost_model",
            f"preset ({', '.join(preset_names() + parallel_preset_names())}) or a YAML/JSON "
            "spec file",
        ),
    )
    group.add_argument(
        "--tp", type=int, default=default("tp"), help=shown("tp", "tensor-parallel size")
    )
    group.add_argument(
        "--pp",
        type=int,
        default=default("pp"),
        help=shown("pp", "pipeline stages; every stage runs the same plan, priced under 1F1B"),
    )
    group.add_argument(
        "--vpp",
        type=int,
        default=default("vpp"),
        help=shown("vpp", "virtual stages per device (> 1: interleaved)"),
    )
    group.add_argument(
        "--ep", type=int, default=default("ep"), help=shown("ep", "expert-parallel size (MoE)")
    )
    group.add_argument(
        "--max-seq",
        default=default("max_seq"),
        help=shown("max_seq", "max sequence length (k = 1000)"),
    )
    group.add_argument(
        "--global-batch",
        type=int,
        default=default("global_batch"),
        help=shown("global_batch", "sequences per step"),
    )
    if harness:  # plan/bench: Megatron's --seed (megatron_args)
        parser.add_argument("--seed", type=int, default=0, help="random sampling and solver seed")
    group.add_argument(
        "--memory-cap-gb",
        type=float,
        default=None,
        help="per-GPU memory cap (default: the cost model's, 30 for flexsp-*)",
    )
    group.add_argument(
        "--solver",
        choices=MILP_SOLVERS,
        default=default("solver"),
        help=shown("solver", "MILP backend"),
    )
    group.add_argument(
        "--time-budget",
        type=float,
        default=default("time_budget"),
        help=shown(
            "time_budget",
            "hsp wall-clock safety cap per batch (s); work counts limit the search, and a "
            "plan the cap cut says so (cut_by_cap in --json)",
        ),
    )
    group.add_argument(
        "--sizes",
        default=None,
        help="allowed group sizes, comma-separated (e.g. 1,2,4,8,16,32,64), 'pow2' (the powers "
        "of two among the legal sizes) or 'auto' (default: every size the cluster and cost "
        "model allow)",
    )
    group.add_argument(
        "--overlong",
        choices=OVERLONG_POLICIES,
        default=None,
        help="documents longer than max-seq (or memory allows): error, drop or split; default: "
        "drop under --sampling sequential (FlexSP's harness rule; the count is printed), error "
        "under random",
    )
    group.add_argument(
        "--sampling",
        choices=SAMPLING_MODES if harness else ("training", *SAMPLING_MODES),
        default=default("sampling"),
        help="how global batches are drawn: sequential (FlexSP's harness: consecutive runs of "
        "--global-batch padded lengths) or random (seeded draws without replacement)"
        + (
            ""
            if harness
            else "; without --flexsp-harness: training (default), the training "
            "run's own sampler (step/sampler.py: a seeded permutation of whole documents per "
            "epoch, blends by tokens)"
        ),
    )
    if harness:
        add_verbose_argument(parser)


def apply_harness_defaults(args: argparse.Namespace) -> None:
    """``--flexsp-harness``: the harness flags left at None take the harness's defaults."""
    for key, value in HARNESS_DEFAULTS.items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    if args.sampling == "training":
        raise InputError(
            "--sampling training is the Megatron job's sampler; with --flexsp-harness choose "
            "sequential or random"
        )


@dataclass
class Setup:
    cluster: Cluster
    cost: CostModel
    sampler: BatchSampler
    run: RunSpec  # the run description, built once from the flags (``build_setup``)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    pipeline: PipelineSpec | None = None  # None: no pipeline (pp 1)
    # A Megatron job (megatron_args.megatron_setup): what the report says about the job; None
    # under --flexsp-harness.
    job: object | None = None

    @property
    def sizes(self) -> tuple[int, ...] | None:
        """``--sizes`` on this cluster; None (``auto``): every size it and the cost model allow."""
        return self.run.planner.sizes

    @property
    def max_seq(self) -> int:
        return self.run.max_seq

    def settings(self, args: argparse.Namespace | None = None) -> PlannerSettings:
        """hsp's settings: the run description's (``args`` is kept for callers that pass it)."""
        return self.run.planner


#: Largest cluster ``plan``/``bench`` accept. Planning time grows with the number of legal group
#: sizes (every multiple of the node size): 16384 GPUs plan in about 7 s with a 1 s budget on a
#: laptop core, 131072 take over a minute, so larger clusters are refused rather than left to run.
MAX_GPUS = 16384


def check_numeric_flags(args: argparse.Namespace) -> None:
    """Every numeric harness flag in range, before any work; errors name the flag and range."""
    check_range(args.gpus, "--gpus", low=1, high=MAX_GPUS)
    # Nodes are 4-8 GPUs, racks such as NVL72 72: a "node" of thousands made every size up to
    # it legal and exhausted memory building the size tables.
    check_range(args.gpus_per_node, "--gpus-per-node", low=1, high=MAX_GPUS_PER_NODE)
    check_range(args.global_batch, "--global-batch", low=1, high=10**7)
    check_range(args.seed, "--seed", low=0)
    check_time_budget(args.time_budget, "--time-budget")
    if args.memory_cap_gb is not None:
        check_range(args.memory_cap_gb, "--memory-cap-gb", low=0, low_open=True, high=1e6)
    for flag in ("tp", "pp", "vpp", "ep"):
        if getattr(args, flag, None) is not None:
            check_range(getattr(args, flag), "--" + flag, low=1, high=MAX_GPUS)
    check_numeric_flags_of_command(args)


def check_numeric_flags_of_command(args: argparse.Namespace) -> None:
    """``plan``'s and ``bench``'s own numeric flags in range (both modes)."""
    for flag in ("steps", "start_step", "batch_index"):
        if getattr(args, flag, None) is not None:
            low = 1 if flag == "steps" else 0
            check_range(getattr(args, flag), "--" + flag.replace("_", "-"), low=low, high=10**7)


def parallel_dims(args: argparse.Namespace) -> ParallelDims:
    """``plan``/``bench``'s parallel dimensions: ``--gpus`` in nodes of ``--gpus-per-node``,
    ``--tp``/``--pp``/``--vpp``/``--ep`` (absent flags: 1)."""
    degrees = (int(getattr(args, k, 1) or 1) for k in ("tp", "pp", "vpp", "ep"))
    return ParallelDims(args.gpus, args.gpus_per_node, *degrees, flags=PLAN_FLAGS)


def build_setup(args: argparse.Namespace) -> Setup:
    check_numeric_flags(args)
    if args.overlong is None:  # resolved here so that the JSON config shows what ran
        args.overlong = "drop" if args.sampling == "sequential" else "error"
    Cluster(args.gpus, args.gpus_per_node)  # the whole machine's shape, checked first
    request = GroupSizeRequest.parse(args.sizes, "--sizes")
    max_seq = parse_max_seq(args.max_seq)
    dims = parallel_dims(args)
    parallel = ParallelConfig(dims.tp, dims.pp, dims.vpp, dims.ep)
    # With TP/PP/EP (or a MoE preset) the planner's cluster is one stage's data x context plane.
    cost, cluster = load_any_cost_model(
        args.cost_model,
        parallel,
        gpus=args.gpus,
        gpus_per_node=args.gpus_per_node,
        max_seq_k=max_seq / 1000,
        memory_cap_gb=args.memory_cap_gb,
    )
    pipeline = pipeline_spec_for(cost, parallel.pp, parallel.vpp) if parallel.pp > 1 else None
    sizes = request.restriction(cluster, "--sizes")
    costed = set(cost.sizes)  # one set: ``cost.sizes`` rebuilds a sorted list per access
    usable = [d for d in (sizes or sorted(costed)) if cluster.size_fits(d) and d in costed]
    if not usable:
        raise InputError(f"--sizes: none of {sizes} is costed by {cost.name}: {cost.sizes}")
    sampler = BatchSampler(
        read_lengths(args.lengths),
        global_batch=args.global_batch,
        sampling=args.sampling,
        max_seq=max_seq,
        seed=args.seed,
        overlong=args.overlong,
        max_trainable=cost.max_trainable_length(usable),
    )
    if sampler.harness_note():  # on stderr: counted in the JSON too, never silent
        print(sampler.harness_note(), file=sys.stderr)
    settings = PlannerSettings(
        args.solver, args.time_budget, sizes, args.seed, pp=parallel.pp, vpp=parallel.vpp
    )
    run = RunSpec(dims, request, args.overlong, settings, max_seq, sizes_flag="--sizes")
    return Setup(cluster, cost, sampler, run, parallel, pipeline)


def config_dict(args: argparse.Namespace) -> dict:
    """Every flag, for the JSON ``config`` block."""
    return {k: v for k, v in sorted(vars(args).items()) if k != "command"}


# Environment for a command's child processes (spawned ranks, planner): Python reads it at start,
# so their import-time warnings are hidden too (not counted: they happen in another interpreter).
QUIET_CHILD_ENV = {
    "PYTHONWARNINGS": "ignore::UserWarning,ignore::DeprecationWarning,ignore::FutureWarning",
    "MEGATRON_HSP_QUIET": "1",  # quiet_megatron_notices in the ranks
}
# Notices megatron-core logs (not warns) on every rank, about its own API, not the user's run:
# (logger, start of the message).
MEGATRON_NOTICES = (("megatron.core.models.gpt.gpt_model", "GPTModel IS DEPRECATED"),)


class _DropNotice(logging.Filter):
    def __init__(self, start: str) -> None:
        super().__init__()
        self.start = start

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.start)


def quiet_megatron_notices() -> None:
    """In a rank of a command run without ``--verbose``: drop ``MEGATRON_NOTICES``.

    Why: megatron-core 0.19 logs ``GPTModel IS DEPRECATED ...`` on every rank that builds a
    ``GPTModel``; the demo builds megatron-core's GPT on purpose, and the line buried its
    output. ``--verbose`` (which leaves ``MEGATRON_HSP_QUIET`` unset) shows it.
    """
    if os.environ.get("MEGATRON_HSP_QUIET") != "1":
        return
    for name, start in MEGATRON_NOTICES:
        logging.getLogger(name).addFilter(_DropNotice(start))


# Loggers that warn at import on a CPU machine ("No CUDA runtime is found"): counted with the rest.
NOISY_IMPORT_LOGGERS = ("torch.utils.cpp_extension",)


class _CountingFilter(logging.Filter):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def filter(self, record: logging.LogRecord) -> bool:
        self.count += 1
        return False


def add_verbose_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--verbose",
        action="store_true",
        help="show every import-time warning of Megatron-core and torch (hidden by default, "
        "summarised in one line)",
    )


@contextmanager
def import_warnings_summarised(
    verbose: bool, command: str, children: bool = False
) -> Iterator[None]:
    """Run a command with third-party warnings collected and summarised in one stderr line.

    Why: Megatron-core and torch warn at import about optional packages a CPU run does not use
    (Apex, Transformer Engine, absl): a dozen lines per process burying the command's
    output. Every command runs inside this one helper. Warnings raised by
    ``megatron_hsp`` itself are still shown; only those from other packages are counted and
    hidden. ``children``: the command spawns processes (ranks, planner) whose warnings are
    hidden through the environment but cannot be counted here; the line is then always printed.
    ``verbose`` leaves everything as Python would show it.
    """
    if verbose:
        yield
        return
    for key, value in QUIET_CHILD_ENV.items():
        os.environ.setdefault(key, value)
    logged = _CountingFilter()
    for name in NOISY_IMPORT_LOGGERS:
        logging.getLogger(name).addFilter(logged)
    with warnings.catch_warnings(record=True) as caught:
        failed = False
        try:
            yield
        except BaseException:
            failed = True  # an error exits with its own one line (exit 2): no summary beside it
            raise
        finally:
            for name in NOISY_IMPORT_LOGGERS:
                logging.getLogger(name).removeFilter(logged)
            hidden = logged.count
            for w in caught:
                if f"{os.sep}megatron_hsp{os.sep}" in w.filename:
                    warnings.showwarning(w.message, w.category, w.filename, w.lineno)
                else:
                    hidden += 1
            if (hidden or children) and not failed:
                also = " (and those of child processes)" if children else ""
                print(
                    f"{command}: {hidden} warnings from imports hidden{also}; --verbose shows them",
                    file=sys.stderr,
                )
