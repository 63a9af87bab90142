"""The parts of a run description every entry point shares, each rule written once.

Megatron's ``--hsp-*`` flags (``megatron/config.py``), ``plan``/``bench`` (``commands/common.py``)
and ``demo`` (``commands/demo_config.py``) each describe one run: how many GPUs in which nodes,
the model-parallel degrees around HSP's groups, which group sizes the planner may use, what
happens to documents too long to train whole, which solver plans and for how long. Each of them
used to work these out on its own (the slot arithmetic three times, the allowed sizes with two
grammars, the overlong policies and solvers as string tuples in three modules). Here each rule
has one home, in the spirit of torchtitan's ``ParallelDims``: an entry point builds these types
once from its own flags, naming its own flags in the errors (``DimFlags``), and everything below
reads them. ``search/settings.RunSpec`` gathers them with the planner's settings.

On the planner's ground floor (no torch, nothing above ``groupspace``): the cost model
(``cost/parallel.py``), the runtime's rank layout and the samplers import it too.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from enum import StrEnum

from megatron_hsp.planner.errors import InputError
from megatron_hsp.planner.groupspace import Cluster, HeadSpace
from megatron_hsp.planner.units import check_range


class OverlongPolicy(StrEnum):
    """What happens to a document longer than the run trains whole: stop with an error, drop
    it, or split it into trainable pieces (both samplers, ``planner/lengths.py`` and
    ``step/sampler.py``, implement all three)."""

    ERROR = "error"
    DROP = "drop"
    SPLIT = "split"


class Solver(StrEnum):
    """The planner's search: a MILP backend (HiGHS through highspy, or the COIN-OR CBC binary),
    or ``greedy``, the MILP-free mode (fast, plan status "heuristic")."""

    HIGHS = "highs"
    CBC = "cbc"
    GREEDY = "greedy"

    @property
    def uses_milp(self) -> bool:
        return self is not Solver.GREEDY


class AttentionBackendName(StrEnum):
    """HSP's attention kernels: ``auto`` picks Transformer Engine where TE and CUDA are present
    (``runtime/backends.make_backend``), else torch's."""

    AUTO = "auto"
    TE = "te"
    TORCH = "torch"


# The vocabularies as plain strings (argparse ``choices``, messages).
OVERLONG_POLICIES: tuple[str, ...] = tuple(p.value for p in OverlongPolicy)
SOLVERS: tuple[str, ...] = tuple(s.value for s in Solver)
MILP_SOLVERS: tuple[str, ...] = tuple(s.value for s in Solver if s.uses_milp)
ATTENTION_BACKENDS: tuple[str, ...] = tuple(b.value for b in AttentionBackendName)
DEFAULT_SOLVER = Solver.HIGHS
# Stock Megatron cuts documents at --seq-length (its GPTDataset packs them into --seq-length
# samples; a long document spans several), so a Megatron run under --hsp does the same by
# default: documents past the longest trainable length are split into pieces of that length.
DEFAULT_OVERLONG = OverlongPolicy.SPLIT


def parse_choice[E: StrEnum](kind: type[E], value: str | E, flag: str) -> E:
    """``value`` as a member of the closed vocabulary ``kind``; the error names ``flag`` and
    every choice."""
    try:
        return kind(value)
    except ValueError:
        choices = ", ".join(m.value for m in kind)
        raise InputError(f"{flag} {value!r}: choose one of {choices}") from None


# Wall-clock safety cap per plan. Counts limit the search (``SolverConfig``); the cap leaves room
# for a machine several times slower than the counts need (docs/solver.md "Work limits and the
# wall-clock cap"); the step it plans runs for seconds, and the plan of step t+1 is solved while
# step t trains (``step/planner_service.py``).
DEFAULT_TIME_BUDGET_S = 5.0
# An hour per plan is far past any step it would plan: a larger value is a typo (ms for s).
MAX_TIME_BUDGET_S = 3600.0


# Whose plan a training step runs (``--hsp-plan-method``): hsp, or a baseline on the same
# batches (``evaluation/torch_side/methods.py`` plans each; ``static-best`` is resolved to one
# ``static-N`` before training starts).
PLAN_METHODS: tuple[str, ...] = ("hsp", "static-N", "static-best", "batchada", "megatron-dcp")
_STATIC_METHOD = re.compile(r"^static-([1-9]\d*)$")


def check_plan_method(text: str, flag: str = "--hsp-plan-method") -> str:
    """``text`` if it names a method training can run, else an ``InputError`` naming ``flag``."""
    name = str(text).strip()
    if name in ("hsp", "static-best", "batchada", "megatron-dcp") or _STATIC_METHOD.match(name):
        return name
    raise InputError(
        f"{flag} {text!r}: choose hsp, static-N (e.g. static-4), static-best, batchada or "
        "megatron-dcp"
    )


# Methods whose groups run pure ring attention (split 1 x d) at every size: Megatron's dynamic
# context parallelism runs ring attention only (``hybrid_cp_schedule``; docs/baselines.md).
RING_ONLY_METHODS: frozenset[str] = frozenset({"megatron-dcp"})


def method_heads(heads: HeadSpace | None, method: str) -> HeadSpace | None:
    """The model's ``heads`` with the split policy a run of ``method`` trains with: pure ring
    for ``RING_ONLY_METHODS``, else as given (the largest Ulysses degree the heads allow).

    The one place a plan method chooses its splits: the run's flags (``megatron/config.py``:
    communicators, notes, refusals) and its runtime (``megatron/hooks.py``: the registry's
    pre-created sub-groups, the attention routes the planner prices) both take their heads
    from here, so the plan's recorded splits, the registry's and the agreement check agree."""
    if heads is None or method not in RING_ONLY_METHODS:
        return heads
    return dataclasses.replace(heads, ring_only=True)


def static_degree(method: str) -> int | None:
    """N of ``static-N``, else None."""
    m = _STATIC_METHOD.match(method)
    return int(m.group(1)) if m else None


def megatron_dcp_sizes(n: int, what: str = "--gpus") -> list[int]:
    """The CP group sizes megatron-core's dynamic-CP scheduler may use on ``n`` ranks: every
    power of two up to ``n`` (``BalancedCPScheduler.gpus_needed`` rounds a sequence's up to
    one, and ``fill_empty_gpus`` grows groups to the next, up to the whole DPxCP group), so
    ``n`` must be one (``what`` names it in the error)."""
    if n < 1 or n & (n - 1):
        raise InputError(
            f"megatron-dcp: megatron-core's scheduler uses power-of-two CP groups; {what} {n} "
            "is not a power of two"
        )
    return [1 << k for k in range(n.bit_length())]


def check_method_sizes(
    method: str,
    sizes: Sequence[int],
    slots: int,
    heads: HeadSpace | None = None,
    ring_priced: Collection[int] | None = None,
    cost_name: str = "",
) -> None:
    """Refuse, before training, a plan ``method`` the run's group ``sizes`` cannot train.

    ``static-N`` needs groups of N that the run pre-creates and that tile the ``slots``. A
    ring-only method needs every size its plans may use to run as pure ring for ``heads``
    (``method_heads``; ``HeadSpace.split_problem``: the ring degree the runtime supports) and
    be priced as one (``ring_priced``: the cost model's ``ring_step_ms_per_token`` sizes);
    megatron-dcp's plans may use every size of ``megatron_dcp_sizes``, which the run must
    pre-create. Each would otherwise stop the run at a plan that uses it."""
    used = list(sizes)  # the sizes the method's plans may use
    if method == "megatron-dcp":
        try:
            used = megatron_dcp_sizes(slots, "the sequence-parallel slot count (world / tp x pp)")
        except InputError as exc:
            raise InputError(f"--hsp-plan-method {exc}") from None
        missing = [d for d in used if d not in sizes]
        if missing:
            raise InputError(
                f"--hsp-plan-method {method}: megatron-core's scheduler may use CP groups of "
                f"every power of two up to the {slots} sequence-parallel slots, and the run has "
                f"no groups of {missing} (group sizes {sorted(sizes)}); train it with "
                "--hsp-group-sizes pow2 (or a list holding them) and enough "
                "--hsp-max-communicators"
            )
    if method in RING_ONLY_METHODS:
        heads = method_heads(heads, method)
        why = {d: heads.split_problem(d, *heads.split(d)) for d in used} if heads else {}
        bad = {d: w for d, w in why.items() if w}
        if bad:
            raise InputError(
                f"--hsp-plan-method {method} runs every group as pure ring, and group sizes "
                f"{sorted(bad)} cannot run so ({next(iter(bad.values()))}); train it with "
                f"--hsp-group-sizes {','.join(str(d) for d in sizes if d not in bad) or '1'}"
            )
        unpriced = [d for d in used if d > 1 and ring_priced is not None and d not in ring_priced]
        if unpriced:
            raise InputError(
                f"--hsp-plan-method {method} runs every group as pure ring, and cost model "
                f"{cost_name!r} has no ring_step_ms_per_token for group sizes {unpriced}; give "
                "--hsp-cost-model a model with coefficients.ring_step_ms_per_token for them "
                "(the default first-principles model prices every size)"
            )
    degree = static_degree(method)
    if degree is not None and (degree not in sizes or slots % degree):
        fit = [d for d in sizes if slots % d == 0]
        raise InputError(
            f"--hsp-plan-method {method}: groups of {degree} must be among the run's group "
            f"sizes {sorted(sizes)} and divide its {slots} sequence-parallel slots; choose "
            f"static-N with N in {fit}"
        )


def check_time_budget(seconds: float, flag: str) -> float:
    """The planner's wall-clock budget per plan: finite, > 0, at most ``MAX_TIME_BUDGET_S``.

    One rule for ``--hsp-time-budget-s``, ``--time-budget`` and ``PlannerSettings``."""
    return float(check_range(seconds, flag, low=0, low_open=True, high=MAX_TIME_BUDGET_S))


@dataclass(frozen=True)
class DimFlags:
    """The flags an entry point spells the parallel dimensions with, for its error messages."""

    world: str = "--gpus"
    gpus_per_node: str = "--gpus-per-node"
    tp: str = "--tp"
    pp: str = "--pp"
    vpp: str = "--vpp"
    ep: str = "--ep"


PLAN_FLAGS = DimFlags()
MEGATRON_FLAGS = DimFlags(
    world="world size",
    gpus_per_node="--hsp-gpus-per-node",
    tp="--tensor-model-parallel-size",
    pp="--pipeline-model-parallel-size",
    vpp="--virtual-pipeline-model-parallel-size",
    ep="--expert-model-parallel-size",
)


@dataclass(frozen=True)
class ParallelDims:
    """The job's GPUs and Megatron's model-parallel degrees around HSP's groups.

    HSP plans the data-parallel x context-parallel plane of one pipeline stage: ``slots`` =
    ``world / (tp * pp)`` sequence-parallel slots, each a tensor-parallel group of ``tp`` GPUs
    inside one node, so a node holds ``gpus_per_node / tp`` of them (``slots_per_node``, at most
    every slot). ``vpp`` is Megatron's virtual stages per device, ``ep`` the expert-parallel size
    over a stage's slots. ``flags`` names the entry point's own flags in the errors.
    """

    world: int
    gpus_per_node: int
    tp: int = 1
    pp: int = 1
    vpp: int = 1
    ep: int = 1
    flags: DimFlags = field(default=PLAN_FLAGS, compare=False, repr=False)

    def __post_init__(self) -> None:
        f = self.flags
        for key in ("world", "gpus_per_node", "tp", "pp", "vpp", "ep"):
            if int(getattr(self, key)) < 1:
                raise InputError(f"{getattr(f, key)} must be >= 1, got {getattr(self, key)}")
        check_degrees(self.world, self.tp, self.pp, f)
        check_tp_in_node(self.gpus_per_node, self.tp, f)
        # vpp against pp: ``cost/pipeline.PipelineSpec``, which prices the schedule.

    @property
    def slots(self) -> int:
        """Sequence-parallel slots of one stage: ``world / (tp * pp)``."""
        return self.world // (self.tp * self.pp)

    @property
    def slot_gpus_per_node(self) -> int:
        """Slots a whole node holds: ``gpus_per_node / tp``."""
        return self.gpus_per_node // self.tp

    @property
    def slots_per_node(self) -> int:
        """Slots per node of this job: a node's, or every slot when the job is smaller."""
        return min(self.slot_gpus_per_node, self.slots)

    def cluster(self) -> Cluster:
        """The planner's cluster: the slots, in whole nodes (refused otherwise)."""
        if self.slots % self.slots_per_node:
            f = self.flags
            raise InputError(
                f"{self.slots} sequence-parallel slots ({f.world} {self.world} / {f.tp} "
                f"{self.tp} x {f.pp} {self.pp}) do not fill whole nodes of "
                f"{self.slots_per_node} ({f.gpus_per_node} {self.gpus_per_node} / {f.tp} "
                f"{self.tp}); launch a whole number of nodes or fix {f.gpus_per_node}"
            )
        return Cluster(self.slots, self.slots_per_node)


def check_degrees(world: int, tp: int, pp: int, flags: DimFlags = PLAN_FLAGS) -> int:
    """``world / (tp * pp)``, the slots of one stage; refused unless it divides exactly."""
    if world % (tp * pp):
        raise InputError(
            f"{flags.world} {world} is not a multiple of {flags.tp} {tp} x {flags.pp} {pp}"
        )
    return world // (tp * pp)


def check_tp_in_node(gpus_per_node: int, tp: int, flags: DimFlags = PLAN_FLAGS) -> int:
    """``gpus_per_node / tp``: Megatron keeps a tensor-parallel group inside one node."""
    if tp > gpus_per_node:
        raise InputError(
            f"{flags.tp} {tp} spans nodes of {gpus_per_node} GPUs ({flags.gpus_per_node}); "
            "Megatron keeps tensor-parallel groups inside a node"
        )
    if gpus_per_node % tp:
        raise InputError(
            f"{flags.tp} {tp} does not divide {flags.gpus_per_node} {gpus_per_node} "
            "(tensor-parallel groups stay inside a node)"
        )
    return gpus_per_node // tp


AUTO_SIZES = "auto"
POW2_SIZES = "pow2"


@dataclass(frozen=True)
class GroupSizeRequest:
    """Which group sizes the user allows, in one grammar for every entry point:

    ``auto`` (every legal size: every size up to a node, then whole nodes), ``pow2`` (the
    powers of two among them) or a comma-separated list (``1,2,4,8``), each of which must be
    legal. The cost model may narrow the result further to the sizes it prices.
    """

    rule: str = AUTO_SIZES  # "auto", "pow2" or "list"
    sizes: tuple[int, ...] = ()

    @classmethod
    def parse(cls, text: str | None, flag: str) -> GroupSizeRequest:
        if text is None or str(text).strip().lower() == AUTO_SIZES:
            return cls()
        if str(text).strip().lower() == POW2_SIZES:
            return cls(POW2_SIZES)
        try:
            sizes = tuple(sorted({int(s) for s in str(text).split(",") if s.strip()}))
        except ValueError:
            raise InputError(
                f"{flag} {text!r}: give comma-separated group sizes (e.g. 1,2,4,8), "
                f"'{POW2_SIZES}' or '{AUTO_SIZES}'"
            ) from None
        if not sizes or sizes[0] < 1:
            raise InputError(f"{flag} {text!r}: group sizes must be integers >= 1")
        return cls("list", sizes)

    @property
    def is_auto(self) -> bool:
        return self.rule == AUTO_SIZES

    def __str__(self) -> str:
        return ",".join(map(str, self.sizes)) if self.rule == "list" else self.rule

    def resolve(self, cluster: Cluster, flag: str) -> tuple[int, ...]:
        """The allowed sizes on ``cluster``; a listed size that is not legal is refused."""
        legal = cluster.legal_sizes()
        if self.rule == AUTO_SIZES:
            return tuple(legal)
        if self.rule == POW2_SIZES:
            return tuple(cluster.power_of_two_sizes())
        bad = [d for d in self.sizes if d not in legal]
        if bad:
            raise InputError(
                f"{flag} {self}: {bad} are not legal group sizes on {cluster.world_size} slots "
                f"in nodes of {cluster.node_width} (every size up to a node, then whole nodes: "
                f"other sizes cannot tile them); legal sizes: {','.join(map(str, legal))}"
            )
        return self.sizes

    def restriction(self, cluster: Cluster, flag: str) -> tuple[int, ...] | None:
        """As ``resolve``, but None for ``auto``: the planner then takes every size the cluster
        and the cost model allow."""
        return None if self.is_auto else self.resolve(cluster, flag)


def allowed_sizes(
    request: GroupSizeRequest, cluster: Cluster, costed: list[int] | tuple[int, ...], flag: str
) -> tuple[int, ...]:
    """The sizes a run plans with: the request on ``cluster``, narrowed to those the cost model
    prices (``costed``). Every entry point's answer for one cluster, model and request."""
    priced = set(costed)
    return tuple(d for d in request.resolve(cluster, flag) if d in priced)
