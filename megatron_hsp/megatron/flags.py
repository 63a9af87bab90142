"""The ``--hsp`` and ``--hsp-*`` flag table for Megatron-LM, added through its
``extra_args_provider``, and the parse helpers its flags use.

``hsp_extra_args_provider`` also wires the flag-only checks into the parser it returns
(``refuse_before_megatron``): they run as soon as Megatron's parser returns, before Megatron's
own ``validate_args`` can stop on an assert or a device query. What the flags mean together
(``HSPConfig``) is ``config.validate_hsp_args``; what ``--hsp`` refuses is ``refusals``.

This module imports neither torch nor Megatron: the flags can be parsed anywhere.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping

from megatron_hsp.megatron.config import BATCH_UNITS, REFIT_FILE, validate_hsp_args
from megatron_hsp.megatron.model_cost import HARDWARE_PRESETS
from megatron_hsp.megatron.refusals import exit_on_refusal
from megatron_hsp.planner import units
from megatron_hsp.planner.errors import InputError
from megatron_hsp.planner.groupspace import DEFAULT_MAX_COMMUNICATORS
from megatron_hsp.planner.run_spec import (
    DEFAULT_OVERLONG,
    DEFAULT_SOLVER,
    DEFAULT_TIME_BUDGET_S,
    OVERLONG_POLICIES,
    SOLVERS,
    GroupSizeRequest,
    check_plan_method,
)
from megatron_hsp.planner.search.settings import DEFAULT_PLAN_TIMEOUT_S

ExtraArgsProvider = Callable[[argparse.ArgumentParser], argparse.ArgumentParser]

# No --hsp-cost-model: first principles from Megatron's own flags (megatron/model_cost.py).
DEFAULT_COST_MODEL = None
HARDWARE_CHOICES = ("auto", *HARDWARE_PRESETS)


def parse_tokens(text: str) -> int:
    """argparse ``type`` for token flags; the one rule (decimal ``k``: ``192k`` -> 192000, as
    ``plan --max-seq``) lives in :func:`megatron_hsp.planner.units.parse_tokens`."""
    try:
        return units.parse_tokens(text, "value")
    except InputError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def parse_plan_method(text: str) -> str:
    """argparse ``type`` for ``--hsp-plan-method`` (its grammar: ``run_spec.check_plan_method``)."""
    try:
        return check_plan_method(text)
    except InputError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def parse_sizes(text: str) -> tuple[int, ...] | str | None:
    """argparse ``type`` for ``--hsp-group-sizes``, in the one grammar of allowed group sizes
    (:class:`megatron_hsp.planner.run_spec.GroupSizeRequest`): ``auto`` -> None, ``pow2`` ->
    "pow2", ``1,2,4,8`` -> (1, 2, 4, 8).

    Why plain values, not the request: Megatron saves its args in every checkpoint and loads
    them back with ``torch.load(weights_only=True)``, which refuses classes it does not know."""
    try:
        request = GroupSizeRequest.parse(text, "--hsp-group-sizes")
    except InputError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if request.is_auto:
        return None
    return request.sizes if request.rule == "list" else request.rule


def add_hsp_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Megatron ``extra_args_provider``: adds the HSP flag group and returns the parser.

    Idempotent, so the launcher can run an already patched script."""
    if any("--hsp" in a.option_strings for a in parser._actions):
        return parser
    g = parser.add_argument_group(
        "hsp", "heterogeneity-adaptive sequence parallelism (megatron-hsp)"
    )
    g.add_argument(
        "--hsp",
        action="store_true",
        help="Plan every global batch: variable micro-batches and Ulysses groups of different "
        "sizes over the data-parallel x context-parallel ranks, whole documents per group.",
    )
    g.add_argument(
        "--hsp-cost-model",
        default=DEFAULT_COST_MODEL,
        metavar="PRESET|FILE",
        help="Cost model preset name (e.g. flexsp-gpt-7b) or a YAML/JSON file with fitted "
        "coefficients (megatron-hsp profile measures one). Default: first principles from "
        "this run's own Megatron flags (layers, hidden, heads, KV groups, FFN, vocabulary, "
        "precision, distributed optimizer, recompute) on --hsp-hardware.",
    )
    g.add_argument(
        "--hsp-hardware",
        choices=HARDWARE_CHOICES,
        default="auto",
        help="GPU the default cost model prices (default auto: detected from the GPUs' NVML "
        "names; no GPU visible prices h100-sxm and says so). Only with the default cost model.",
    )
    g.add_argument(
        "--hsp-gpus-per-node",
        type=int,
        default=None,
        help="GPUs per node, which sets the network tier of each group. Default: "
        "LOCAL_WORLD_SIZE (torchrun), else SLURM_GPUS_ON_NODE / SLURM_NTASKS_PER_NODE.",
    )
    g.add_argument(
        "--hsp-memory-cap-gb",
        type=float,
        default=None,
        help="Per-GPU memory the planner may fill (GB); default: the cost model's own cap.",
    )
    g.add_argument(
        "--hsp-max-seq",
        type=parse_tokens,
        default=None,
        help="Longest document trained whole (e.g. 192k): longer ones follow --hsp-overlong, "
        "as do documents over what the largest group's memory holds or, with learned absolute "
        "positions, over --max-position-embeddings; the cost model is sized for it. Default "
        "--seq-length.",
    )
    g.add_argument(
        "--hsp-solver", choices=SOLVERS, default=DEFAULT_SOLVER.value, help="Planner backend."
    )
    g.add_argument(
        "--hsp-time-budget-s",
        type=float,
        default=DEFAULT_TIME_BUDGET_S,
        help="Wall-clock safety cap per plan: work counts limit the search, and a plan the cap "
        f"cut says so (cut_by_cap); the best plan found by then is used (default "
        f"{DEFAULT_TIME_BUDGET_S:g}).",
    )
    g.add_argument(
        "--hsp-group-sizes",
        type=parse_sizes,
        default=None,
        metavar="auto|pow2|1,2,4,...",
        help="Allowed group sizes; 'auto' (default) = every size the topology and the "
        "cost model allow, 'pow2' = the powers of two among them.",
    )
    g.add_argument(
        "--hsp-max-communicators",
        type=int,
        default=None,
        metavar="N",
        help="Most communicators one rank may hold for HSP's groups (default "
        f"{DEFAULT_MAX_COMMUNICATORS}; their GPU memory, from NCCL's buffer sizes, is charged "
        "to the planner's memory cap). Group sizes past it are left out, in a fixed priority "
        "order (1, the largest, powers of two, sizes within a node, then the rest).",
    )
    g.add_argument(
        "--hsp-overlong",
        choices=OVERLONG_POLICIES,
        default=DEFAULT_OVERLONG.value,
        help="Documents longer than the longest trainable length (the least of --hsp-max-seq "
        "or --seq-length, learned absolute positions' --max-position-embeddings and what the "
        "largest group's memory holds): split them into pieces of that length (default, as "
        "stock Megatron cuts documents at --seq-length), drop them, or stop with an error. "
        "The count is said at start-up.",
    )
    _add_batch_args(g)
    g.add_argument(
        "--hsp-plan-log",
        default=None,
        metavar="FILE.jsonl",
        help="Append every step's plan (docs/design.md JSON) with predicted and measured time.",
    )
    g.add_argument(
        "--hsp-log-interval",
        type=int,
        default=1,
        help="Print the one-line plan summary every N steps (0: never).",
    )
    g.add_argument(
        "--hsp-sync-planner",
        action="store_true",
        help="Plan in the training process instead of a background process (debugging).",
    )
    g.add_argument(
        "--hsp-plan-timeout-s",
        type=float,
        default=DEFAULT_PLAN_TIMEOUT_S,
        help="Seconds a step waits for its background plan; a later plan (or a dead planner) is "
        "replaced by the fallback plan (greedy, exact like any plan), the run logs it and the "
        "planner process is restarted. Keep it well under --distributed-timeout-minutes. "
        f"Default: {DEFAULT_PLAN_TIMEOUT_S:g}.",
    )
    g.add_argument(
        "--hsp-no-refit",
        action="store_true",
        help="Keep the cost model fixed. Default: refit it online from each micro-batch's "
        "measured time (step/observe.StepRefitter) and plan later steps with the refit model.",
    )
    g.add_argument(
        "--hsp-refit-out",
        default=None,
        metavar="FILE.yaml",
        help="Where the refit cost model is written after each accepted update, for the next "
        f"run's --hsp-cost-model. Default: <--save>/{REFIT_FILE} when --save is given, else "
        "not written.",
    )
    g.add_argument(
        "--hsp-seed",
        type=int,
        default=None,
        help="Seed of the document sampler and the planner; default --seed.",
    )
    return parser


def _add_batch_args(g: argparse._ArgumentGroup) -> None:
    """What a global batch holds (issue 43: by default the stock step's tokens) and whose plan
    trains it."""
    g.add_argument(
        "--hsp-token-budget",
        type=parse_tokens,
        default=None,
        help="Tokens per global batch (e.g. 2097152; 64k = 64000). "
        "Default: --global-batch-size x --seq-length, the tokens the stock step trains. Whole "
        "documents in sampler order until the next one would cross it (that one starts the "
        "next step).",
    )
    g.add_argument(
        "--hsp-batch-unit",
        choices=BATCH_UNITS,
        default="tokens",
        help="What a global batch counts: 'tokens' (default: the token budget above, as many "
        "documents as fit) or 'documents' (--global-batch-size whole documents per step, the "
        "mode before issue 43: a step then trains far fewer tokens than the stock step).",
    )
    g.add_argument(
        "--hsp-plan-method",
        type=parse_plan_method,
        default="hsp",
        metavar="hsp|static-N|static-best|batchada|megatron-dcp",
        help="Whose plan each step trains: hsp (default), or a baseline on the same batches "
        "through the same runtime, for an A/B measured with `megatron-hsp compare`.",
    )


def hsp_extra_args_provider(user_provider: ExtraArgsProvider | None = None) -> ExtraArgsProvider:
    """Compose the HSP flags with a script's own ``extra_args_provider`` (which may be None).

    The returned parser also runs ``refuse_before_megatron`` right after it parses: the
    provider is the one HSP code Megatron calls between parsing and ``validate_args``.
    """

    def provider(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        if user_provider is not None:
            parser = user_provider(parser) or parser
        return _refusing_early(add_hsp_args(parser))

    return provider


def _refusing_early(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Wrap this parser's ``parse_known_args`` (``parse_args`` calls it) with the early checks."""
    if getattr(parser, "_hsp_refuses_early", False):
        return parser
    original = parser.parse_known_args

    def parse_known_args(args=None, namespace=None):  # argparse's own signature
        parsed, extras = original(args, namespace)
        refuse_before_megatron(parsed)
        return parsed, extras

    parser.parse_known_args = parse_known_args  # type: ignore[method-assign]
    parser._hsp_refuses_early = True  # type: ignore[attr-defined]
    return parser


def refuse_before_megatron(args: argparse.Namespace, env: Mapping[str, str] | None = None) -> None:
    """The flag-only ``--hsp`` checks on freshly parsed flags, before Megatron validates them.

    Why before: Megatron's ``validate_args`` asserts device facts and its own divisibility
    rules (on a CPU, ``--context-parallel-size 2`` or TP > 1 failed there with a traceback),
    so a flag HSP refuses was never named. Runs on a copy: the real call after Megatron's
    validation makes the changes HSP needs.
    """
    if getattr(args, "hsp", False):
        exit_on_refusal(
            lambda: validate_hsp_args(argparse.Namespace(**vars(args)), env, early=True)
        )
