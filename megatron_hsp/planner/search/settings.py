"""The planner's knobs: one type for every entry point.

Megatron's ``--hsp-*`` flags (``megatron/flags.py``), the demo, ``plan``/``bench`` and the
background planner service all hand the planner the same four choices: which solver, how long it
may search, which group sizes it may use, and its seed. They used to be re-declared in five
dataclasses with the default budget written five times; here they are declared once, with the
defaults, and turned into the solver's own ``SolverConfig`` in one place (``solver_config``).

``pp`` / ``vpp`` say which pipeline schedule the plan runs under (1F1B, or interleaved with
``vpp`` virtual stages): the solver then prices steps with ``planner/cost/pipeline.py``. They must
match the stage cost model (``planner/cost/parallel.py`` builds it; the solver refuses a mismatch).

What is *not* a knob lives elsewhere: the cluster (``topology.Cluster``) and the cost model
(``costmodel.load_cost_model``), which describe the problem rather than how to search it.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from megatron_hsp.planner.cost.pipeline import PipelineSpec
from megatron_hsp.planner.groupspace import Cluster
from megatron_hsp.planner.run_spec import (
    DEFAULT_SOLVER,
    DEFAULT_TIME_BUDGET_S,
    MILP_SOLVERS,
    GroupSizeRequest,
    OverlongPolicy,
    ParallelDims,
    Solver,
    allowed_sizes,
    check_time_budget,
    parse_choice,
)

# The fallback planner's budget when a background plan is late (greedy only, so it answers in
# about this long whatever made the full search slow).
FALLBACK_TIME_BUDGET_S = 0.2
#: ``--hsp-plan-timeout-s``'s default: how long a training step waits for its background plan
#: before it trains on the fallback plan. Well under Megatron's --distributed-timeout-minutes
#: (10 min), so a late or wedged planner never holds the ranks until the watchdog aborts them.
DEFAULT_PLAN_TIMEOUT_S = 60.0
#: What the ranks that do not plan wait in the plan exchange beyond the planning rank's
#: deadline: the fallback search (a fraction of a second) and the exchange, on a loaded host.
PLAN_EXCHANGE_MARGIN_S = 60.0

BACKENDS = MILP_SOLVERS
# The solver's candidate chunkings (``chunking.py``): every kind by default.
CHUNKINGS = ("time-lpt", "contiguous-tokens", "long-grouped", "long-sized")


# The batch size the greedy, local-search and MILP counts are given for. Each candidate schedules
# every sequence and each local-search evaluation about a micro-batch's worth, so above it the
# counts shrink in proportion (at 8192 sequences no MILP: one took seconds at 1024 GPUs), keeping
# solves at 1024-16384 GPUs about as long as when a 1 s budget stopped them
# (docs/results/solver.md).
WORK_REFERENCE_SEQUENCES = 512


def scaled_count(count: int, sequences: int) -> int:
    """``count`` (given at ``WORK_REFERENCE_SEQUENCES`` sequences) for a batch of ``sequences``:
    unchanged up to the reference, in proportion above it (0 once it rounds down)."""
    if sequences <= WORK_REFERENCE_SEQUENCES:
        return count
    return count * WORK_REFERENCE_SEQUENCES // sequences


@dataclass(frozen=True)
class SolverConfig:
    """How hard and with what to search. Defaults suit per-step planning during training."""

    backend: str = DEFAULT_SOLVER.value  # MILP solver: "highs" (highspy) or "cbc" (COIN-OR CBC)
    # Wall-clock safety cap for the whole solve: the counts below limit the search; a plan the
    # cap cut says so (``plan.extra["cut_by_cap"]``, ``planner/search/budget.py``).
    time_budget_s: float = DEFAULT_TIME_BUDGET_S
    sizes: tuple[int, ...] | None = None  # allowed group sizes; None: all that tile and are costed
    seed: int = 0  # MILP solver random seed
    extra_microbatches: int = 3  # counts tried above the memory minimum
    chunkings: tuple[str, ...] = CHUNKINGS  # candidate chunkings (see chunking.py)
    use_milp: bool = True  # False: greedy only (status "heuristic")
    max_buckets: int = 16  # length buckets per micro-batch in the MILP
    # Work limits keep results deterministic; the wall-clock budget is the safety net. The
    # candidate, evaluation and MILP counts are per WORK_REFERENCE_SEQUENCES sequences
    # (``scaled_count``).
    max_candidates: int = 64  # greedy (count, chunking) candidates scheduled
    improve_evals: int = 60  # local-search schedule evaluations between micro-batches
    # Branch-and-bound nodes per micro-batch MILP (``milp._make_solver`` has HiGHS's options):
    # more planned the suite's batches the same at several times the time (docs/solver.md,
    # "Solve time, 2026-11-27 (second)").
    milp_max_nodes: int = 20
    milp_min_gap: float = 0.03  # skip the MILP for micro-batches this close to their floor
    milp_slice_s: float = math.inf  # wall-clock safety cap per micro-batch MILP (and the budget)
    # Micro-batch MILPs per solve, biggest gap to the floor first (past the first they gained
    # a few hundredths of a percent of a step on the suite at several times the solve time:
    # docs/solver.md, "Solve time, 2026-11-27 (second)").
    milp_max_microbatches: int = 1
    # Threads one solve may use: 2 gives it a helper thread for its MILPs (HiGHS, outside the
    # GIL), the flexsp-style search's beside hsp's search and hsp's beside the baselines'
    # scoring (``search/concurrency.py``); 1 runs everything in turn. Plans do not depend on it.
    workers: int = 2
    # The pipeline the plan runs under (None or pp 1: none); the cost model must be the stage
    # model built for it (``parallel.pipeline_spec_for`` checks, and supplies its backward share
    # and p2p time).
    pipeline: PipelineSpec | None = None


@dataclass(frozen=True)
class PlannerSettings:
    """How the planner searches: solver, wall-clock budget, allowed group sizes, seed, and the
    pipeline schedule it prices (pp 1: none)."""

    solver: Solver = DEFAULT_SOLVER
    time_budget_s: float = DEFAULT_TIME_BUDGET_S
    sizes: tuple[int, ...] | None = None  # None: every size the cluster and cost model allow
    seed: int = 0
    pp: int = 1  # pipeline stages (every stage runs the same plan)
    vpp: int = 1  # virtual stages per device: > 1 is Megatron's interleaved schedule

    def __post_init__(self) -> None:
        object.__setattr__(self, "solver", parse_choice(Solver, self.solver, "solver"))
        check_time_budget(self.time_budget_s, "the planner's time budget")
        if self.sizes is not None:
            object.__setattr__(self, "sizes", tuple(int(d) for d in self.sizes))
        PipelineSpec(self.pp, self.vpp)  # refuses vpp without pp, non-positive degrees

    def solver_config(self) -> SolverConfig:
        """The solver's own configuration for these settings (the one place they map)."""
        return SolverConfig(
            pipeline=PipelineSpec(self.pp, self.vpp) if self.pp > 1 else None,
            backend=(self.solver if self.solver.uses_milp else DEFAULT_SOLVER).value,
            time_budget_s=self.time_budget_s,
            sizes=self.sizes,
            seed=self.seed,
            use_milp=self.solver.uses_milp,
        )

    def fallback(self) -> PlannerSettings:
        """The safe fallback when a plan is late: greedy only, a short budget."""
        return dataclasses.replace(
            self,
            solver=Solver.GREEDY,
            time_budget_s=min(FALLBACK_TIME_BUDGET_S, self.time_budget_s),
        )


@dataclass(frozen=True)
class RunSpec:
    """One run, as every entry point describes it: the parallel dimensions, the group sizes the
    user allows, the overlong policy, the longest document trained whole and the planner's
    settings. Megatron's flags (``megatron/config.validate_hsp_args``), ``plan``/``bench``
    (``commands/common.build_setup``) and ``demo`` (``DemoConfig.run_spec``) each build it
    once from their own flags; what runs below reads it.

    ``planner.sizes`` are the sizes the run plans with: the request on the slots, narrowed to
    those the cost model prices (and, under Megatron, to the communicator budget); None where
    the planner takes every size the cluster and the cost model allow (``plan``'s default).
    ``sizes_flag`` names the flag ``sizes`` came from, for errors.
    """

    dims: ParallelDims
    sizes: GroupSizeRequest
    overlong: OverlongPolicy
    planner: PlannerSettings
    max_seq: int
    sizes_flag: str = dataclasses.field(default="--sizes", compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "overlong", parse_choice(OverlongPolicy, self.overlong, "overlong")
        )

    def cluster(self) -> Cluster:
        """The slots HSP plans, in whole nodes (``ParallelDims.cluster``)."""
        return self.dims.cluster()

    def allowed_sizes(self, costed: list[int] | tuple[int, ...]) -> tuple[int, ...]:
        """The sizes the run may plan with under a cost model pricing ``costed``."""
        return allowed_sizes(self.sizes, self.cluster(), costed, self.sizes_flag)
