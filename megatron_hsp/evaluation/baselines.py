"""Homogeneous sequence-parallel baselines in our harness and cost model (numpy only).

- ``static-N``: every sequence trains in a group of N, i.e. static Megatron CP / DeepSpeed
  Ulysses with packing. Packing and micro-batch chunking are a faithful port of FlexSP's
  ``solve_homo_sp_ffd_bfd_globalbatch`` (PKU-DAIR/Hetu-Galvatron, branch flexsp,
  galvatron/flexsp_solver/solver.py, with ``BestFitDecreasing`` from utils.py), because FlexSP's
  published static and adaptive numbers come from exactly this code:

  1. best-fit-decreasing (stable sort by length, descending; best fit = least room left, first
     bin on ties) into bins of ``max(0.9 * tokens_per_rank * N, longest length)`` tokens;
  2. bins are groups; consecutive runs of ``world_size // N`` groups form micro-batches;
  3. ``fill_empty``: each empty group of the last micro-batch takes the lowest-id sequence of
     the nearest earlier group holding more than one;
  4. for N >= 16 and when step 3 had empty groups, tokens of the last micro-batch are evened
     out towards their mean (FlexSP's ``even_distribute``);
  5. a micro-batch costs its slowest group; a group over the (un-discounted) memory cap makes N
     infeasible.

- ``static-best``: the one N with the least summed step time over the whole run (hindsight).
- ``batchada``: the best N for each batch separately (FlexSP's ``adaptive``).
- ``flexsp-style``: FlexSP's heterogeneous planner *emulated* on our MILP solver
  (``flexsp_style_config``): our solver restricted to FlexSP's choices, priced by the cost model
  in use with the runtime's executable Ulysses x ring split. Not FlexSP's code: its released
  solver prices with its own hard-coded model (benchmarks/flexsp_solver_compare.py runs it).

Candidate N: sizes that divide the world size (a homogeneous layout must use every GPU), the
cluster can place as aligned blocks, and the cost model can cost. ``megatron-dcp`` lives in
``megatron_hsp.evaluation.torch_side.dcp_baseline`` because it runs megatron-core's scheduler, which
imports torch.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from megatron_hsp.planner.cost.costmodel import CostModel
from megatron_hsp.planner.errors import InfeasibleError, InputError
from megatron_hsp.planner.groupspace import largest_ulysses
from megatron_hsp.planner.plan import Plan
from megatron_hsp.planner.search.flexsp_style import FLEXSP_STYLE_CHUNKING as FLEXSP_STYLE_CHUNKING
from megatron_hsp.planner.search.flexsp_style import FLEXSP_STYLE_MIN_SIZE as FLEXSP_STYLE_MIN_SIZE
from megatron_hsp.planner.search.flexsp_style import flexsp_style_config as flexsp_style_config
from megatron_hsp.planner.search.flexsp_style import flexsp_style_sizes as flexsp_style_sizes

# The layouts live in the planner (``solve`` scores them too); re-exported under their old names.
from megatron_hsp.planner.search.homogeneous import FLEXSP_BIN_FILL as FLEXSP_BIN_FILL
from megatron_hsp.planner.search.homogeneous import _best_fit_decreasing as _best_fit_decreasing
from megatron_hsp.planner.search.homogeneous import dp_balanced_layout as dp_balanced_layout
from megatron_hsp.planner.search.homogeneous import homogeneous_sizes as homogeneous_sizes
from megatron_hsp.planner.search.homogeneous import plan_from_layout as plan_from_layout
from megatron_hsp.planner.search.homogeneous import static_layout as static_layout
from megatron_hsp.planner.topology import Cluster

if TYPE_CHECKING:
    from megatron_hsp.planner.search.settings import SolverConfig


def static_plan(
    lengths: Sequence[int] | np.ndarray, cost: CostModel, cluster: Cluster, degree: int
) -> Plan:
    """``static-<degree>``: every sequence in a group of ``degree`` (FlexSP's BFD packing)."""
    if degree not in homogeneous_sizes(cost, cluster, [degree]):
        raise InputError(
            f"static-{degree}: degree must divide --gpus {cluster.world_size}, be a legal group "
            f"size and be costed by the model; choose from {homogeneous_sizes(cost, cluster)}"
        )
    layout = static_layout(lengths, cost, cluster.world_size, degree)
    if layout is None:
        longest = int(np.max(lengths))
        raise InfeasibleError(
            f"static-{degree}: the batch does not fit groups of {degree} under the memory cap "
            f"({cost.capacity(degree)} tokens per group, longest sequence {longest}); use a "
            "larger degree"
        )
    return plan_from_layout(
        lengths,
        cost,
        cluster,
        [[(degree, g) for g in mb] for mb in layout],
        solver=f"static-{degree}",
        extra={"method": f"static-{degree}", "degree": degree},
    )


def static_plans_by_degree(
    lengths: Sequence[int] | np.ndarray,
    cost: CostModel,
    cluster: Cluster,
    sizes: Sequence[int] | None = None,
) -> dict[int, Plan]:
    """Every feasible homogeneous plan of one batch, keyed by degree."""
    out: dict[int, Plan] = {}
    for d in homogeneous_sizes(cost, cluster, sizes):
        try:
            out[d] = static_plan(lengths, cost, cluster, d)
        except InfeasibleError:
            continue
    return out


def batchada_plan(
    lengths: Sequence[int] | np.ndarray,
    cost: CostModel,
    cluster: Cluster,
    sizes: Sequence[int] | None = None,
) -> Plan:
    """``batchada``: the fastest homogeneous degree for this batch (FlexSP's ``adaptive``).

    Ties go to the smaller degree, as FlexSP's ascending scan with a strict ``<`` does.
    """
    plans = static_plans_by_degree(lengths, cost, cluster, sizes)
    if not plans:
        raise InfeasibleError(
            f"batchada: no homogeneous degree in {homogeneous_sizes(cost, cluster, sizes)} "
            "fits this batch under the memory cap"
        )
    best = min(sorted(plans), key=lambda d: plans[d].est_step_ms)
    p = plans[best]
    return Plan(
        **{
            **{f: getattr(p, f) for f in ("world_size", "gpus_per_node", "microbatches")},
            "cost_model": p.cost_model,
            "est_step_ms": p.est_step_ms,
            "solver": "batchada",
            "status": "heuristic",
            "extra": {"method": "batchada", "degree": best},
        }
    )


def static_best_degree(
    batches: Sequence[Sequence[int] | np.ndarray],
    cost: CostModel,
    cluster: Cluster,
    sizes: Sequence[int] | None = None,
) -> tuple[int, dict[int, list[Plan]]]:
    """The one degree with the least total step time over ``batches`` (chosen in hindsight).

    Returns the degree and, for every degree feasible on all batches, its plans.
    """
    candidates = homogeneous_sizes(cost, cluster, sizes)
    per_degree: dict[int, list[Plan]] = {}
    for d in candidates:
        plans: list[Plan] = []
        for b in batches:
            try:
                plans.append(static_plan(b, cost, cluster, d))
            except InfeasibleError:
                break
        else:
            per_degree[d] = plans
    if not per_degree:
        raise InfeasibleError(
            f"static-best: no single degree in {candidates} fits every batch under the memory "
            "cap; use more GPUs, a larger --memory-cap-gb or --overlong drop/split"
        )
    best = min(sorted(per_degree), key=lambda d: sum(p.est_step_ms for p in per_degree[d]))
    return best, per_degree


# ---------------------------------------------------------------------- FlexSP, emulated
# FlexSP's search space is a ``SolverConfig`` variant in the planner, re-exported above
# (``planner/search/flexsp_style.py``), because ``solve`` scores its plan too.


def flexsp_style_plan(
    lengths: Sequence[int] | np.ndarray,
    cost: CostModel,
    cluster: Cluster,
    base: SolverConfig | None = None,
    sizes: Sequence[int] | None = None,
) -> Plan:
    """``flexsp-style``: one batch planned by ``flexsp_style_config``'s restricted solver."""
    from megatron_hsp.planner.search.solver import solve

    config = flexsp_style_config(cost, cluster, base, sizes)
    plan = solve([int(x) for x in lengths], cost, cluster, config, baselines=False)
    extra = {**plan.extra, "method": "flexsp-style", "milp_backend": plan.solver}
    return dataclasses.replace(plan, solver="flexsp-style", extra=extra)


# ---------------------------------------------------------------------- Megatron's own schedulers
# How much of a Megatron CP group's ring traffic shows (``RingAssumptions.overlap``), mapped to
# ``CostModel.seq_ms``'s ``ring`` knob; "cost-model" is the rule hsp's ring groups get.
RING_OVERLAP = {"cost-model": "overlap", "fully-hidden": "hidden", "exposed": "exposed"}


@dataclass(frozen=True)
class RingAssumptions:
    """How a Megatron CP group (pure ring attention, split (1, d)) is costed; docs/baselines.md.

    The default prices it exactly as the cost model prices any ring group, hsp's included
    (``CostModel.group_ms(lengths, d, split=(1, d))``): same ring-step figures, same overlap of
    each K/V transfer with the previous block's attention. The other values exist only to show
    the sensitivity of the comparison (``benchmarks/dcp_sensitivity.py``):

    overlap: "cost-model" (the one rule, the headline), "fully-hidden" (ring traffic free: the
        bound most favourable to Megatron) or "exposed" (no transfer hidden).
    ulysses: Megatron/TE hierarchical CP (``cp_comm_type="a2a+p2p"``,
        ``hierarchical_context_parallel_sizes``): all-to-all over this many ranks (e.g. a node),
        ring across; a group of d runs split (u, d/u) with u the largest degree dividing
        ``gcd(d, ulysses)`` and the query heads (``groupspace.largest_ulysses``). 1: pure p2p ring.
    """

    overlap: str = "cost-model"
    ulysses: int = 1

    def __post_init__(self) -> None:
        if self.overlap not in RING_OVERLAP:
            raise InputError(
                f"ring assumptions: overlap must be one of {sorted(RING_OVERLAP)}, "
                f"got {self.overlap!r}"
            )
        if self.ulysses < 1:
            raise InputError(f"ring assumptions: ulysses must be >= 1, got {self.ulysses}")

    def split(self, d: int, cost: CostModel) -> tuple[int, int]:
        """(ulysses, ring) a Megatron CP group of ``d`` runs with under these assumptions."""
        u = math.gcd(d, self.ulysses)
        if cost.heads is not None:
            u = largest_ulysses(u, cost.heads[0])
        return u, d // u


def ring_group_ms(
    lengths: Sequence[int] | np.ndarray, d: int, cost: CostModel, assume: RingAssumptions
) -> float:
    """Time (ms) of one pass of a Megatron CP group of ``d`` training ``lengths``:
    ``CostModel.group_ms`` at ``assume.split`` (pure ring by default)."""
    if len(lengths) == 0:
        return 0.0
    return cost.group_ms(lengths, d, assume.split(d, cost), RING_OVERLAP[assume.overlap])


def thd_pad_divisor(cp: int, world_size: int, dynamic: bool) -> int:
    """What Megatron's THD datasets pad each sequence to a multiple of (dev's
    ``SFTDataset._calculate_padding_divisor``, which ``MockVarlenDataset`` and ``VarlenDataset``
    inherit): ``2 * dp * cp`` (every DPxCP rank, ``world_size`` here) under dynamic CP, ``2 * cp``
    under static CP of ``cp > 1``, else 1 (sequence parallelism's factor is 1 without TP).
    The schedulers see, pack and train the padded lengths, so the baselines price those."""
    if dynamic:
        return 2 * world_size
    return 2 * cp if cp > 1 else 1


def thd_padded(lengths: Sequence[int] | np.ndarray, divisor: int) -> np.ndarray:
    """Each length rounded up to a multiple of ``divisor`` (``thd_pad_divisor``)."""
    lens = np.asarray(lengths, dtype=np.int64)
    return -(-lens // divisor) * divisor


def trained_lengths(plan: Plan, lengths: Sequence[int] | np.ndarray) -> np.ndarray:
    """The lengths ``plan`` trains for the batch ``lengths``, what a plan is validated against
    (``bench``, ``plan``, the benchmarks): for ``megatron-static-cp<N>`` the units of its packed
    samples (``stock_units``); padded where it is a Megatron THD baseline
    (``extra['thd_pad_divisor']``); as given otherwise."""
    stock = plan.extra.get("stock")
    if stock:
        units = stock_units(np.asarray(lengths, dtype=np.int64), StockCP(**stock))
        return np.asarray([n for u in units for n in u], dtype=np.int64)
    return thd_padded(lengths, int(plan.extra.get("thd_pad_divisor", 1)))


def sequential_passes(
    layout: Sequence[Sequence[tuple[int, Sequence[int]]]],
) -> list[list[tuple[int, list[int]]]]:
    """Each scheduler micro-batch of ``layout`` as the passes it runs when every group trains
    its sub-samples one forward/backward each (main's ``hybrid_context_parallel_forward_backward``):
    pass k holds every group's k-th sub-sample, an empty group where it has fewer. The passes
    keep the scheduler group's rank partition, so the execution model prices them as one segment
    (``execution.py``)."""
    out: list[list[tuple[int, list[int]]]] = []
    for mb in layout:
        depth = max((len(ids) for _, ids in mb), default=0)
        for k in range(depth):
            out.append([(size, [ids[k]] if k < len(ids) else []) for size, ids in mb])
    return out


def cp_groups_of_microbatch(
    sample_ids_per_gpu: Sequence[Sequence[int]],
) -> list[tuple[int, list[int]]]:
    """(size, sample ids) per group of one Megatron scheduler micro-batch (its per-rank lists of
    sample ids): ranks holding the same sample form one CP group."""
    members: dict[int, set[int]] = {}
    for rank, ids in enumerate(sample_ids_per_gpu):
        for sid in ids:
            members.setdefault(int(sid), set()).add(rank)
    groups: dict[tuple[int, ...], list[int]] = {}
    for sid, ranks in members.items():
        groups.setdefault(tuple(sorted(ranks)), []).append(sid)
    return [(len(r), ids) for r, ids in sorted(groups.items())]


def plan_from_scheduler(
    lens: np.ndarray,
    cost: CostModel,
    cluster: Cluster,
    schedule: Callable[[list[tuple[int, int]]], list],
    *,
    method: str,
    who: str,
    sequential: bool,
    assume: RingAssumptions | None = None,
) -> Plan:
    """A Megatron scheduler's micro-batches as a ring ``Plan`` (both ``megatron-dcp`` baselines).

    ``schedule`` maps ``[(sample id, length)]`` to the scheduler's groups of sample ids per
    micro-batch; its internal assertions (e.g. "cannot redistribute") become an
    ``InfeasibleError`` naming ``method`` and ``who``.
    """
    try:
        sample_id_groups = schedule([(i, int(x)) for i, x in enumerate(lens.tolist())])
    except AssertionError as exc:
        raise InfeasibleError(f"{method}: {who} gave up: {exc}") from None
    layout = [cp_groups_of_microbatch(sample_ids) for sample_ids in sample_id_groups]
    return ring_plan_from_layout(
        lens,
        cost,
        cluster,
        layout,
        assume or RingAssumptions(),
        sequential=sequential,
        solver=method,
        extra={
            "method": method,
            "scheduler_microbatches": len(sample_id_groups),
            # how many of the plan's passes each scheduler micro-batch runs, in order
            "scheduler_passes": [
                max((len(ids) for _, ids in mb), default=0) if sequential else 1 for mb in layout
            ],
        },
    )


def ring_plan_from_layout(
    lengths: Sequence[int] | np.ndarray,
    cost: CostModel,
    cluster: Cluster,
    layout: Sequence[Sequence[tuple[int, Sequence[int]]]],
    assume: RingAssumptions,
    *,
    sequential: bool,
    solver: str,
    extra: dict | None = None,
) -> Plan:
    """A ``Plan`` of Megatron CP groups (split ``assume.split``, pure ring by default), priced
    and memory-checked per pass by the execution model like every plan (``execution.py``).

    ``sequential`` groups train their sub-samples one pass each (``sequential_passes``);
    otherwise a group's pack is one pass and must fit as a whole.
    """
    lens = np.asarray(lengths, dtype=np.int64)
    unpriced = sorted(
        {size for mb in layout for size, ids in mb if ids and assume.split(size, cost)[1] > 1}
        - set(cost.ring_step_ms_per_token)
    )
    if unpriced and assume.overlap != "fully-hidden":
        method = solver.rsplit("-", 1)[0] if solver.startswith("dp-balanced") else solver
        raise InputError(
            f"{solver}: cost model {cost.name!r} has no ring_step_ms_per_token for group sizes "
            f"{unpriced}, so Megatron's ring attention cannot be priced; add "
            "coefficients.ring_step_ms_per_token to the cost model, or leave "
            f"{method} out of --methods"
        )
    passes = sequential_passes(layout) if sequential else layout
    for mb in passes:
        for size, ids in mb:
            glens = [int(lens[i]) for i in ids]
            if glens and not cost.fits(glens, size):
                raise InfeasibleError(
                    f"{solver}: a group of {size} holds {sum(glens)} tokens in one pass, over its "
                    f"memory cap of {cost.capacity(size)} tokens"
                )
    info = {
        **(extra or {}),
        "execution": "one-pass-per-sequence" if sequential else "one-pass-per-group",
        "ring_assumptions": dataclasses.asdict(assume),
    }
    return plan_from_layout(
        lens,
        cost,
        cluster,
        passes,
        solver=solver,
        extra=info,
        split=lambda d: assume.split(d, cost),
        ring=RING_OVERLAP[assume.overlap],
    )


def dp_balanced_plan(
    lengths: Sequence[int] | np.ndarray,
    cost: CostModel,
    cluster: Cluster,
    cp: int,
    assume: RingAssumptions | None = None,
) -> Plan:
    """``dp-balanced-<cp>``: static Megatron CP of ``cp`` with arrival-order sequence packing,
    as ``--sequence-packing-scheduler dp_balanced`` runs it: each sequence padded to a multiple of
    ``2 * cp`` by the dataset (``thd_pad_divisor``), packs of ``tokens_per_rank * cp`` padded
    tokens (its ``--max-seqlen-per-dp-cp-rank``), one THD forward/backward per pack, pure p2p
    ring attention over the CP group (``cp - 1`` ring steps per layer and pass, priced with the
    per-step latency and overhead of ``CostModel.fixed_ms`` and ``seq_ms``)."""
    if cp not in homogeneous_sizes(cost, cluster, [cp]):
        raise InputError(
            f"dp-balanced-{cp}: the CP size must divide --gpus {cluster.world_size}, be a legal "
            f"group size and be costed by the model; choose from {homogeneous_sizes(cost, cluster)}"
        )
    divisor = thd_pad_divisor(cp, cluster.world_size, dynamic=False)
    padded = thd_padded(lengths, divisor)
    layout = dp_balanced_layout(padded, cost, cluster.world_size, cp)
    return ring_plan_from_layout(
        padded,
        cost,
        cluster,
        layout,
        assume or RingAssumptions(),
        sequential=False,
        solver=f"dp-balanced-{cp}",
        extra={
            "method": f"dp-balanced-{cp}",
            "degree": cp,
            "thd_pad_divisor": divisor,
            "padding_tokens": int(padded.sum() - np.asarray(lengths, dtype=np.int64).sum()),
        },
    )


def dp_balanced_best_degree(
    batches: Sequence[Sequence[int] | np.ndarray],
    cost: CostModel,
    cluster: Cluster,
    sizes: Sequence[int] | None = None,
    assume: RingAssumptions | None = None,
) -> tuple[int, dict[int, list[Plan]]]:
    """``dp-balanced``: the one CP size with the least total over ``batches`` (hindsight)."""
    candidates = homogeneous_sizes(cost, cluster, sizes)
    per_degree: dict[int, list[Plan]] = {}
    for d in candidates:
        try:
            per_degree[d] = [dp_balanced_plan(b, cost, cluster, d, assume) for b in batches]
        except InfeasibleError:
            continue
    if not per_degree:
        raise InfeasibleError(
            f"dp-balanced: no single CP size in {candidates} fits every batch under the memory "
            "cap; use more GPUs, a larger --memory-cap-gb or --overlong drop/split"
        )
    best = min(sorted(per_degree), key=lambda d: sum(p.est_step_ms for p in per_degree[d]))
    return best, per_degree


# ---------------------------------------------------------------------- stock Megatron static CP
# How ``pretrain_gpt.py`` runs the user's own flags with --context-parallel-size N: the
# baseline a user means by "my static CP N" (issue 43), apart from the per-document ``static-N``
# rows (FlexSP's packing) kept beside it.
CP_COMM_TYPES = ("p2p", "a2a", "allgather", "a2a+p2p")
_STOCK = re.compile(r"^megatron-static-cp(\d+)$")


@dataclass(frozen=True)
class StockCP:
    """The flags that decide how stock Megatron trains a step with static CP.

    cp: ``--context-parallel-size``; seq_length: ``--seq-length`` (every sample's tokens);
    micro_batch_size: ``--micro-batch-size`` (samples per CP group per forward/backward);
    comm: ``--cp-comm-type`` (one type for every layer); a2a_size: with ``a2a+p2p``, the first
    of ``--hierarchical-context-parallel-sizes`` (all-to-all inside it, ring across);
    per_document: the samples carry ``cu_seqlens`` (``--dataloader-inter-document-masking`` or
    ``--sft``), so attention runs per document piece (THD) instead of causally over the whole
    packed sample (Megatron's default; ``--reset-attention-mask`` changes the mask, not the
    kernel's work, so it is priced as the default).
    """

    cp: int
    seq_length: int
    micro_batch_size: int = 1
    comm: str = "p2p"
    a2a_size: int = 1
    per_document: bool = False

    def __post_init__(self) -> None:
        if self.cp < 1 or self.seq_length < 1 or self.micro_batch_size < 1:
            raise InputError(
                f"megatron-static-cp{self.cp}: --context-parallel-size, --seq-length and "
                "--micro-batch-size must be >= 1"
            )
        if self.comm not in CP_COMM_TYPES:
            raise InputError(
                f"--cp-comm-type {self.comm}: choose one of {', '.join(CP_COMM_TYPES)}"
            )
        if self.comm == "a2a+p2p" and (self.a2a_size < 1 or self.cp % self.a2a_size):
            raise InputError(
                f"--hierarchical-context-parallel-sizes: the all-to-all size {self.a2a_size} "
                f"must divide --context-parallel-size {self.cp}"
            )

    @property
    def name(self) -> str:
        return f"megatron-static-cp{self.cp}"

    @property
    def attention(self) -> str:
        return "per-document (THD)" if self.per_document else "causal over the packed sample"

    def split(self, cost: CostModel) -> tuple[int, int]:
        """(ulysses, ring) of a CP group: p2p and allgather move K/V around all ``cp`` ranks
        (split (1, cp)); a2a is Ulysses over the group ((cp, 1)); a2a+p2p all-to-all over
        ``a2a_size`` and ring across. Megatron refuses an all-to-all its query heads do not
        divide; so does this."""
        u = {"p2p": 1, "allgather": 1, "a2a": self.cp, "a2a+p2p": self.a2a_size}[self.comm]
        if cost.heads is not None and u > 1 and cost.heads[0] % u:
            raise InputError(
                f"--cp-comm-type {self.comm}: all-to-all over {u} ranks needs the query heads "
                f"per tensor-parallel rank ({cost.heads[0]}) divisible by {u}, as Megatron "
                "requires; use p2p or another --context-parallel-size"
            )
        return u, self.cp // u

    @property
    def ring(self) -> str:
        """``CostModel.seq_ms``'s ring rule: allgather gathers K/V before attention (NCCL's
        ring all-gather, r - 1 steps, nothing overlapped); p2p overlaps each step."""
        return "exposed" if self.comm == "allgather" else "overlap"

    def describe(self) -> str:
        comm = self.comm + (f" (a2a over {self.a2a_size})" if self.comm == "a2a+p2p" else "")
        return (
            f"{self.seq_length}-token packed samples, {self.micro_batch_size} per micro-batch "
            f"per CP group, attention {self.attention}, --cp-comm-type {comm}"
        )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def stock_samples(lengths: Sequence[int] | np.ndarray, seq_length: int) -> list[list[int]]:
    """The batch's documents concatenated in order and cut every ``seq_length`` tokens, as
    megatron-core's ``GPTDataset`` builds samples (its sample index: consecutive
    ``seq_length``-token windows over the document stream, a document split where a window
    ends): each sample's document pieces. The last sample holds what is left (shorter), so the
    samples hold exactly the batch's tokens."""
    out: list[list[int]] = [[]]
    room = seq_length
    for n in (int(x) for x in lengths):
        while n > 0:
            take = min(n, room)
            out[-1].append(take)
            n -= take
            room -= take
            if room == 0:
                out.append([])
                room = seq_length
    return [s for s in out if s]


def stock_units(lengths: Sequence[int] | np.ndarray, stock: StockCP) -> list[list[int]]:
    """Per sample, the lengths its attention runs over: the whole sample (causal) or its
    document pieces (``per_document``)."""
    samples = stock_samples(lengths, stock.seq_length)
    return samples if stock.per_document else [[sum(s)] for s in samples]


def stock_layout(
    n_samples: int, units_per_sample: Sequence[int], stock: StockCP, world_size: int
) -> list[list[tuple[int, list[int]]]]:
    """Micro-batches of ``(cp, unit ids)`` per data-parallel rank, as Megatron's
    ``MegatronPretrainingSampler`` deals samples: micro-batch m gives data-parallel rank r the
    samples ``m * dp * mbs + r * mbs`` .. ``+ mbs - 1``; a rank past the last sample idles."""
    dp = world_size // stock.cp
    per_mb = dp * stock.micro_batch_size
    first = np.concatenate([[0], np.cumsum(units_per_sample)]).astype(int)
    layout = []
    for start in range(0, n_samples, per_mb):
        mb = []
        for r in range(dp):
            lo = start + r * stock.micro_batch_size
            hi = min(lo + stock.micro_batch_size, n_samples)
            ids = [u for s in range(lo, hi) for u in range(first[s], first[s + 1])]
            mb.append((stock.cp, ids))
        layout.append(mb)
    return layout


def megatron_static_plan(
    lengths: Sequence[int] | np.ndarray, cost: CostModel, cluster: Cluster, stock: StockCP
) -> Plan:
    """``megatron-static-cp<N>``: the batch's tokens as stock Megatron trains them with the
    user's flags (``StockCP``): packed ``--seq-length`` samples (``stock_samples``), the same
    number per data-parallel rank and micro-batch, CP groups of N at ``StockCP.split``, priced
    by the execution model like every plan (``execution.price``). Its plan covers the samples'
    units (``stock_units``), not the documents: ``Plan.validate`` against those."""
    if stock.cp not in homogeneous_sizes(cost, cluster, [stock.cp]):
        raise InputError(
            f"{stock.name}: --context-parallel-size {stock.cp} must divide the "
            f"{cluster.world_size} sequence-parallel slots, be a legal group size and be costed "
            f"by the model; choose from {homogeneous_sizes(cost, cluster)}"
        )
    units = stock_units(lengths, stock)
    flat = [n for u in units for n in u]
    layout = stock_layout(len(units), [len(u) for u in units], stock, cluster.world_size)
    split = stock.split(cost)
    if split[1] > 1 and stock.cp not in cost.ring_step_ms_per_token:
        raise InputError(
            f"{stock.name}: cost model {cost.name!r} has no ring_step_ms_per_token for groups of "
            f"{stock.cp}, so Megatron's {stock.comm} attention cannot be priced; add "
            f"coefficients.ring_step_ms_per_token or leave {stock.name} out of --methods"
        )
    for mb in layout:
        for _, ids in mb:
            tokens = sum(flat[i] for i in ids)
            if ids and not cost.fits([flat[i] for i in ids], stock.cp):
                raise InfeasibleError(
                    f"{stock.name}: {stock.micro_batch_size} sample(s) of up to "
                    f"{stock.seq_length} tokens ({tokens}) over a CP group of {stock.cp}: over "
                    f"its memory cap of {cost.capacity(stock.cp)} tokens (the stock run would "
                    "not fit; raise --context-parallel-size or recompute)"
                )
    return plan_from_layout(
        flat,
        cost,
        cluster,
        layout,
        solver=stock.name,
        extra={
            "method": stock.name,
            "degree": stock.cp,
            "stock": stock.to_dict(),
            "samples": len(units),
            "ring": stock.ring,  # the ring rule every re-pricing keeps (bench's ``piped``)
        },
        split=lambda d: split,
        ring=stock.ring,
    )


def stock_from_name(name: str) -> int | None:
    """N of ``megatron-static-cp<N>``, else None."""
    m = _STOCK.match(name)
    return int(m.group(1)) if m else None
