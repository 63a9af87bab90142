"""A lower bound over the plans the runtime can place: groups in aligned blocks.

Why: every fact of ``bounds.py`` and its configuration LP let any group sizes
share a micro-batch as long as their ranks add up. The runtime does not: a group of more than one
node occupies a fixed block (``groupspace.Cluster.block_starts``: whole nodes, starting at a
multiple of its size), so on 64 ranks in nodes of 8 a 40-rank group and a 24-rank group never run
side by side (40 starts at 0 only, 24 at 0 or 24). On batches whose work is almost all in
sequences longer than a node holds (bimodal, long-context SFT mixes), which sizes can pair decides
the step, and a bound blind to it measures the placement rule, not the planner.

The bound is the LP relaxation of a micro-batch-pattern formulation in which only *long*
sequences (no group inside one node holds them) are placed explicitly:

- A pattern is one micro-batch's cross-node groups: a multiset of sizes that aligned blocks can
  hold at once (enumerated exactly, ``cross_node_mixes``), each group with a multiset of long
  classes whose tokens fit its memory; its makespan ``M`` is its slowest group,
  ``sum T(l, d) + b_d``.
- Everything else (*short*: sequences a node can hold, all of them fractional) runs in one of
  three places, and each place must hold its part's tokens and minimum work:
  the pattern's *free ranks* (those in no long group: ``(N - D) (M - b_min)`` rank-ms, every
  rank paying at least the smallest fixed cost ``b_min``, and ``(N - D) cap`` tokens, ``D`` the
  long groups' ranks); *inside its long groups* (``sum_g d_g (M - T_g - b_g)`` rank-ms and
  ``sum_g (d_g cap - L_g)`` tokens, where a short sequence costs its cross-node rank-ms,
  ``min_{d > G} d T(s, d)``, not its minimum); or *micro-batches of short sequences only*
  (cost ``b_min`` each for ``N cap`` tokens, and their work's time). One ms of every rank (cost
  1, ``N`` rank-ms) buys time in any of the three (lengthening a micro-batch).

    min sum_p M_p lambda_p + t_f + t_l + t_s + b_min m
    s.t. sum_p a_pk lambda_p >= n_k                    every long class covered
         sum_p WF_p lambda_p + N t_f >= w_f,  sum_p TF_p lambda_p >= x_f      free ranks
         sum_p WL_p lambda_p + N t_l >= c_l,  sum_p TL_p lambda_p >= x_l      long groups
         N t_s >= W_short - w_f - w_l,  N cap m >= L_short - x_f - x_l       short-only
         (x_f, w_f), (x_l, w_l, c_l) and their union: what a subset of the short sequences
         can be (``subset_curves``: the most work x tokens carry, the least cross-node work)

  Pooling memory and time over a micro-batch, or over all of them, is what this separates: a
  long group's spare memory holds no short sequence at its one-rank cost, and tokens moved to
  short-only micro-batches take their work with them (on lognormal-dcp and code-heavy-tail
  those two pools were most of the gap).

  Each pattern also offers its free ranks at most the minimum work its free tokens can carry
  (``WF_p`` is the smaller of their time and that work; ``carry_lines``: densest sequences
  first, a concave curve). Without it, patterns mixed fractionally lent one pattern's idle
  time to work whose tokens only another's memory held (two long sequences beside a few free
  ranks were offered more rank time than their free tokens can carry). The column generation
  converges without the cap first, then goes on with it from the same columns; both bounds are
  valid and the larger is returned (with the cap from the start, some batches' pricing did
  not converge). The same cap on the long groups' spare memory (cross-node work) added little
  and kept some batches from converging at all: not applied (figures: docs/results/solver.md).

Every micro-batch of every plan the runtime places is a pattern (with its short sequences' work
at least their minimum, its long classes at their shortest member's length), so the optimum is a
step-time bound; any superset of patterns only lowers it. Columns come from a pricing MILP
(HiGHS) that chooses the mix, fills each group and pays its makespan; a loose MILP gap while
columns are worth much, a tight one to prove convergence. When a limit stops the column
generation first, the larger of Farley's scaled dual bound ``D / (1 + z* / M_low)`` and the
Lagrangian ``D - n z*`` is returned (``z*``: the pricing MILP's dual bound on the best reduced
value; every priced pattern holds an explicit sequence, so ``M >= M_low``, the cheapest one
alone, and a plan has at most ``n``, one per explicit sequence), as
``bounds.instance_lp_bound`` does.

With ``intra_node`` the multi-rank sequences a node holds are explicit too: intra-node groups
are pooled per size (their count, memory and ``count x M`` of time, with ``count x M``
linearised by the count's bits), in nodes that per-node configurations of aligned offsets fill
(``node_configs``: sizes 5 and 3 never share a node of 8). Exact on small instances, slow at 512
sequences (its pricing MILP rarely converges in minutes), so off by default: then those
sequences are fractional and only cross-node placement counts.

What it does not model: the combinatorial facts (use ``max`` with
``bounds.instance_lower_bound``). It is a benchmark's bound (seconds to minutes at 64 ranks and
512 sequences), not the planner's per-solve one.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from megatron_hsp.evaluation.placement_curves import (
    SHORT_VARS,
    carried_work,
    carry_lines,
    inflated_work,
    subset_curves,
)
from megatron_hsp.planner.search.bounds import HighsModel, LpBound, dual_bound, length_classes
from megatron_hsp.planner.search.instance import Instance
from megatron_hsp.planner.topology import Cluster

# Mixes enumerated at most; past it the bound is not computed (None): the enumeration is exact or
# the bound would exclude placeable mixes and be invalid.
MAX_MIXES = 5000
# Relative MILP gaps of the pricing: loose while columns are worth much, then tight.
LOOSE_GAP, TIGHT_GAP = 0.05, 1e-6


@dataclass(frozen=True)
class PlacementBound(LpBound):
    """The placement-aware LP bound and how it was reached (``LpBound``'s fields, and more)."""

    long_sequences: int = 0  # sequences only cross-node groups hold
    mixes: int = 0  # maximal cross-node size mixes that aligned blocks place


def cross_node_mixes(cluster: Cluster, sizes: Sequence[int]) -> list[dict[int, int]] | None:
    """Every maximal multiset of cross-node ``sizes`` that aligned blocks hold at once.

    Exact: a depth-first search over block starts (whole nodes), sizes descending, equal sizes in
    increasing start order. None past ``MAX_MIXES`` mixes (the bound then is not computed).
    """
    g = cluster.node_width
    big = sorted({int(d) for d in sizes if d > g}, reverse=True)
    nodes = cluster.world_size // g
    if not big:
        return [{}]
    starts = {d: [s // g for s in cluster.block_starts(d)] for d in big}
    found: set[tuple[int, ...]] = set()
    used = [False] * nodes

    def free(s: int, w: int) -> bool:
        return not any(used[s : s + w])

    def dfs(k: int, counts: list[int], low: int) -> bool:
        """Extend with sizes big[k:]; True when the mix was cut (too many)."""
        if len(found) > MAX_MIXES:
            return True
        if k == len(big):
            found.add(tuple(counts))
            return False
        w = big[k] // g
        # Place another big[k] (starts after the previous one of this size) or move on.
        for s in starts[big[k]]:
            if s >= low and free(s, w):
                for t in range(s, s + w):
                    used[t] = True
                counts[k] += 1
                cut = dfs(k, counts, s + w)
                counts[k] -= 1
                for t in range(s, s + w):
                    used[t] = False
                if cut:
                    return True
        return dfs(k + 1, counts, 0)

    if dfs(0, [0] * len(big), 0):
        return None
    mixes = [dict(zip(big, c, strict=True)) for c in found]

    def dominated(a: dict[int, int]) -> bool:
        return any(b != a and all(b[d] >= a[d] for d in big) for b in mixes)

    return [m for m in mixes if not dominated(m) and any(m.values())]


def node_configs(cluster: Cluster, sizes: Sequence[int]) -> list[dict[int, int]]:
    """Every maximal multiset of multi-rank sizes up to a node that one node's aligned blocks
    hold at once; exact (one node is tiny)."""
    g = cluster.node_width
    small = sorted({int(d) for d in sizes if 1 < d <= g}, reverse=True)
    # The first node's blocks (``Cluster.block_starts`` owns the rule; every node has the same).
    offsets = {d: [s for s in cluster.block_starts(d) if s + d <= g] for d in small}
    found: set[tuple[int, ...]] = set()
    used = [False] * g

    def dfs(k: int, counts: list[int], low: int) -> None:
        if k == len(small):
            found.add(tuple(counts))
            return
        d = small[k]
        for off in offsets[d]:
            if off >= low and not any(used[off : off + d]):
                used[off : off + d] = [True] * d
                counts[k] += 1
                dfs(k, counts, off + d)
                counts[k] -= 1
                used[off : off + d] = [False] * d
        dfs(k + 1, counts, 0)

    dfs(0, [0] * len(small), 0)
    configs = [dict(zip(small, c, strict=True)) for c in found]

    def dominated(a: dict[int, int]) -> bool:
        return any(b != a and all(b[d] >= a[d] for d in small) for b in configs)

    return [c for c in configs if not dominated(c) and any(c.values())]


@dataclass
class _Problem:
    """What the placement LP is built from (``_problem``): explicit classes, short sequences,
    mixes, node configurations and the constants of the master and the pricing."""

    n: int  # ranks
    g: int  # ranks per node
    nodes: int
    cap: float  # tokens per rank (one pass's memory)
    passes: int  # most passes one group runs in a pattern (1: every pass is a barrier)
    token_fee: float  # rank-ms a short token costs in further passes (b_min / cap; 0: none)
    b_min: float  # the smallest fixed cost
    sizes: list[int]
    fixed: list[float]
    mixes: list[dict[int, int]]
    configs: list[dict[int, int]]
    cross: list[int]  # size indices of cross-node groups
    intra: list[int]  # size indices of multi-rank groups inside a node
    classes: list[list[int]]
    class_of: dict[int, int]
    rep: list[int]  # class length (its shortest member)
    count: list[int]
    tk: list[list[float]]  # class time per size index
    fits: list[list[int]]  # size indices that hold each class
    m_low: float  # no pattern lasts less
    m_cap: float  # no micro-batch of a better plan lasts more
    m_floor: int  # micro-batches memory forces
    explicit: int  # explicit sequences (at most one pattern each)
    long_sequences: int
    short_tokens: list[float]
    short_work: list[float]
    short_inflated: list[float]
    intra_node: bool


def _problem(
    inst: Instance, cluster: Cluster, rel_width: float, upper_ms: float | None, intra_node: bool
) -> _Problem | None:
    """The explicit (long, and with ``intra_node`` mid) classes and the short sequences; None
    when there is nothing explicit or too many mixes."""
    n, g = inst.world_size, cluster.node_width
    sizes = list(inst.sizes)
    need = [sizes[inst.dmin[i]] for i in range(len(inst.lengths))]
    long_ids = [i for i in range(len(inst.lengths)) if need[i] > g]
    mid_ids = [i for i in range(len(inst.lengths)) if sizes[0] < need[i] <= g and intra_node]
    if not long_ids and not mid_ids:
        return None
    mixes = cross_node_mixes(cluster, sizes)
    if mixes is None:
        return None
    cap, b_min = inst.cap, inst.min_fixed
    # Where groups run several passes between barriers (``inst.multi_pass``) a pattern is a
    # segment: a group holds any number of passes, each within its memory and paying its fixed
    # cost, so an explicit group's passes are priced (``passes``), and short tokens beyond the
    # memory of the free ranks' and long groups' first passes pay further passes (``token_fee``).
    multi = inst.multi_pass
    explicit = set(long_ids) | set(mid_ids)
    short = [i for i in range(len(inst.lengths)) if i not in explicit]
    cross = [j for j, d in enumerate(sizes) if d > g]
    # Classes: long ones (only cross-node groups hold them), then the multi-rank ones a node holds.
    classes = length_classes(long_ids, inst.lengths, rel_width) + length_classes(
        mid_ids, inst.lengths, rel_width
    )
    rep = [inst.lengths[c[0]] for c in classes]
    tk = [[inst.times[c[0]][j] for j in range(len(sizes))] for c in classes]
    fits = [[j for j in range(len(sizes)) if rep[k] <= sizes[j] * inst.cap and sizes[j] > 1]
            for k in range(len(classes))]  # fmt: skip
    return _Problem(
        n=n,
        g=g,
        nodes=max(1, n // g),
        cap=cap,
        passes=len(inst.lengths) if multi else 1,
        token_fee=b_min / cap if multi else 0.0,
        b_min=b_min,
        sizes=sizes,
        fixed=list(inst.fixed),
        mixes=mixes,
        configs=node_configs(cluster, sizes),
        cross=cross,
        intra=[j for j, d in enumerate(sizes) if 1 < d <= g],
        classes=classes,
        class_of={i: k for k, c in enumerate(classes) for i in c},
        rep=rep,
        count=[len(c) for c in classes],
        tk=tk,
        fits=fits,
        m_low=min(tk[k][j] + inst.fixed[j] for k in range(len(classes)) for j in fits[k]),
        m_cap=upper_ms if upper_ms is not None else float(sum(inst.best)) + b_min,
        m_floor=1 if multi else max(1, math.ceil(sum(inst.lengths) / (n * cap))),
        explicit=len(explicit),
        long_sequences=len(long_ids),
        short_tokens=[float(inst.lengths[i]) for i in short],
        short_work=[float(inst.work_min[i]) for i in short],
        short_inflated=[inflated_work(inst, i, cross) for i in short],
        intra_node=intra_node,
    )


class _Master:
    """The master LP (module docstring): rows 0..nk-1 cover classes; then the short sequences'
    work and tokens on long patterns' free ranks, inside their long groups and in micro-batches
    of short sequences only; the micro-batch floor; then the curves that tie each part's work
    to its tokens. Columns: one ms of every rank in each area, the short-only micro-batch, the
    short-sequence variables, and patterns."""

    def __init__(self, p: _Problem) -> None:
        self.p = p
        nk = len(p.classes)
        self.rows = dict(zip(("wf", "tf", "wl", "tl", "ws", "ts", "count"), range(nk, nk + 7),
                             strict=True))  # fmt: skip
        self.lp = HighsModel()
        w_short, tok_short = float(sum(p.short_work)), float(sum(p.short_tokens))
        rhs = [0.0, 0.0, 0.0, 0.0, w_short, tok_short, float(p.m_floor)]
        self.lp.empty_rows([(float(c), math.inf) for c in p.count] + [(r, math.inf) for r in rhs])
        self.curves = subset_curves(p.short_tokens, p.short_work, p.short_inflated)
        self.first_curve = nk + 7
        self.lp.empty_rows([(lo, hi) for lo, hi, _ in self.curves])
        self.free_lines = carry_lines(p.short_tokens, p.short_work, self._free_token_points())
        self.capped = False  # phase two: free work capped by what free tokens carry
        self.wf_of: list[tuple[int, float, float]] = []  # pattern column, free work both ways
        r = self.rows
        # One ms of every rank: for free ranks, long groups or short-only micro-batches (the
        # first two a relaxation of lengthening a long pattern, which gives both at once).
        for row in (r["wf"], r["wl"], r["ws"]):
            self.lp.column(1.0, {row: float(p.n)})
        # A micro-batch of short sequences only; it and every pattern count towards the floor.
        # Passes of short sequences only: ``b_min`` per ``cap`` tokens on each rank (a pass of
        # ``d`` holds ``d cap`` and costs ``d b_min`` rank-ms at least), also where they share a
        # segment's other ranks with long groups.
        self.lp.column(p.b_min, {r["ts"]: float(p.n * p.cap), r["count"]: 1.0})
        moves = {  # what each short-sequence variable takes from its area and gives the rest
            "x_free": {r["tf"]: -1.0, r["ts"]: 1.0},
            "w_free": {r["wf"]: -1.0, r["ws"]: 1.0},
            "x_long": {r["tl"]: -1.0, r["ts"]: 1.0},
            "w_long": {r["ws"]: 1.0},
            "c_long": {r["wl"]: -1.0},
        }
        if p.token_fee:
            # Multi-pass: short tokens beyond the memory a pattern's passes leave on its free
            # ranks or in its long groups run in further passes there, each ``d cap`` tokens
            # for ``d b_min`` rank-ms at least.
            for tokens, time_row in (("tf", "wf"), ("tl", "wl")):
                self.lp.column(0.0, {r[tokens]: 1.0, r[time_row]: -p.token_fee})
        for name in SHORT_VARS:
            entries = {self.first_curve + k: c[name]
                       for k, (_, _, c) in enumerate(self.curves) if name in c}  # fmt: skip
            entries.update(moves[name])
            self.lp.column(0.0, entries)

    def _free_token_points(self) -> list[float] | None:
        """Without pooled intra-node groups a pattern's free tokens are ``(N - D) cap`` for the
        ranks ``D`` of some part of a mix: exact with a line each (None: every line)."""
        p = self.p
        if p.intra_node:
            return None
        taken = set()
        for mix in p.mixes:
            for part in itertools.product(*(range(c + 1) for c in mix.values())):
                taken.add(sum(d * c for d, c in zip(mix, part, strict=True)))
        return [float((p.n - d) * p.cap) for d in taken]

    def add_pattern(self, groups: list[tuple[int, dict[int, int]]],
                    pooled: dict[int, tuple[int, dict[int, int]]]) -> None:  # fmt: skip
        """A pattern: cross-node groups as (size index, class counts); intra-node groups pooled
        per size index as (groups, class counts)."""
        p, r = self.p, self.rows
        makespan = p.b_min
        rank_ms, tokens = 0.0, 0.0  # on free ranks (pooled intra-node groups)
        long_ranks, long_ms, long_tokens, long_room = 0, 0.0, 0.0, 0.0  # cross-node groups
        cover: dict[int, float] = {}
        for j, content in groups:
            t_g = sum(p.tk[k][j] * c for k, c in content.items())
            tok_g = sum(p.rep[k] * c for k, c in content.items())
            passes = _passes(p, j, tok_g, 1)
            b_g = p.fixed[j] * passes
            makespan = max(makespan, t_g + b_g)
            long_ranks += p.sizes[j]
            long_ms += p.sizes[j] * (t_g + b_g)
            long_room += p.sizes[j] * p.cap * passes
            long_tokens += tok_g
            for k, c in content.items():
                cover[k] = cover.get(k, 0.0) + c
        for j, (ng, content) in pooled.items():
            t_all = sum(p.tk[k][j] * c for k, c in content.items())
            tok_j = sum(p.rep[k] * c for k, c in content.items())
            b_all = p.fixed[j] * _passes(p, j, tok_j, ng)
            makespan = max(makespan, (t_all + b_all) / ng)
            makespan = max(makespan, *(p.tk[k][j] + p.fixed[j] for k in content))
            rank_ms += p.sizes[j] * (t_all + b_all - p.b_min * ng)
            tokens += tok_j
            for k, c in content.items():
                cover[k] = cover.get(k, 0.0) + c
        free = p.n - long_ranks
        entries = dict(cover)
        entries[r["count"]] = 1.0
        entries[r["tf"]] = max(0.0, free * p.cap - tokens)
        entries[r["tl"]] = max(0.0, long_room - long_tokens)
        spare = max(0.0, free * (makespan - p.b_min) - rank_ms)
        carried = min(spare, carried_work(self.free_lines, entries[r["tf"]]))
        entries[r["wf"]] = carried if self.capped else spare
        entries[r["wl"]] = max(0.0, long_ranks * makespan - long_ms)
        self.wf_of.append((self.lp.h.getNumCol(), spare, carried))
        self.lp.column(makespan, entries)

    def add_micro(self, micro: Sequence[tuple[int, Sequence[int]]]) -> None:
        """A plan's micro-batch, as (group size, sequence ids) per group, as a pattern (if it
        holds an explicit sequence)."""
        p = self.p
        groups, pooled = [], {}
        index_of = {d: j for j, d in enumerate(p.sizes)}
        for d, ids in micro:
            content: dict[int, int] = {}
            for i in ids:
                if i in p.class_of:
                    content[p.class_of[i]] = content.get(p.class_of[i], 0) + 1
            if not content or d not in index_of:
                continue
            j = index_of[d]
            if d > p.g:
                groups.append((j, content))
            else:
                ng, pool = pooled.get(j, (0, {}))
                for k, c in content.items():
                    pool[k] = pool.get(k, 0) + c
                pooled[j] = (ng + 1, pool)
        if groups or pooled:
            self.add_pattern(groups, pooled)

    def cap_free_work(self) -> None:
        """Phase two: every pattern's free work capped by what its free tokens carry."""
        self.capped = True
        for col, _, wf in self.wf_of:
            self.lp.h.changeCoeff(self.rows["wf"], col, wf)

    def duals(self) -> tuple[float, list[float], list[float], float]:
        """Solve: (value, class duals, area duals in ``rows`` order, the curves' dual value)."""
        z_rmp, duals = self.lp.solve_master()
        nk = len(self.p.classes)
        pi = [max(0.0, float(duals[k])) for k in range(nk)]
        area = [max(0.0, float(duals[r])) for r in self.rows.values()]
        curve_dual = 0.0
        for k, (lo, hi, _) in enumerate(self.curves):
            y = float(duals[self.first_curve + k])
            side = lo if y > 0 else hi
            if abs(side) < math.inf:  # a dual on the infinite side is numerical noise
                curve_dual += y * side
        return z_rmp, pi, area, curve_dual


class _Pricing:
    """The pricing MILP, built once; only its objective changes. It chooses a mix, fills each
    cross-node group (and with ``intra_node`` the pooled intra-node groups) and pays the
    makespan ``M``; ``f`` is the work the pattern's free ranks offer short sequences."""

    def __init__(self, p: _Problem, free_lines: Sequence[tuple[float, float]]) -> None:
        self.p = p
        self.lp = HighsModel()
        self.mvar = self.lp.var(p.m_low, max(p.m_low, p.m_cap))
        self.slots: list[tuple[int, int]] = []  # cross-node groups: (size index, u variable)
        self.uvm: list[int] = []  # per slot, u x M (free ranks' time is (N - sum d u) M)
        self.qvar: list[int] = []  # per slot, its passes
        self.pass_var: dict[int, int] = {}  # size index -> pooled intra-node groups' passes
        self.xvar: dict[tuple[int, int], int] = {}  # (slot, class) -> variable
        self.bits: dict[int, list[tuple[int, int]]] = {}  # size index -> [(2^i, bit variable)]
        self.pvar: dict[tuple[int, int], int] = {}  # (size index, class) -> pooled count
        node_terms = self._cross_node_groups()
        self._intra_node_groups(node_terms)
        for k in range(len(p.classes)):
            terms = [(x, 1.0) for (_, kk), x in self.xvar.items() if kk == k]
            terms += [(x, 1.0) for (_, kk), x in self.pvar.items() if kk == k]
            if terms:
                self.lp.row(-math.inf, float(p.count[k]), terms)
        self.line_rows = self._free_work(free_lines)
        # A pattern holds an explicit sequence, so M >= m_low.
        self.lp.row(1.0, math.inf, [(x, 1.0) for x in [*self.xvar.values(), *self.pvar.values()]])

    def _cross_node_groups(self) -> list[tuple[int, float]]:
        """One slot per cross-node group a mix may hold, its memory and time rows; returns the
        nodes the slots take (the node row is completed by the configurations)."""
        p, lp, inf = self.p, self.lp, math.inf
        yvar = [lp.var(0.0, 1.0, True) for _ in p.mixes]
        if yvar:
            lp.row(-inf, 1.0, [(y, 1.0) for y in yvar])
        node_terms: list[tuple[int, float]] = []
        for j in p.cross:
            d = p.sizes[j]
            us = [lp.var(0.0, 1.0, True)
                  for _ in range(max((m.get(d, 0) for m in p.mixes), default=0))]  # fmt: skip
            if not us:
                continue
            in_mixes = [(y, -float(m.get(d, 0))) for y, m in zip(yvar, p.mixes, strict=True)]
            lp.row(-inf, 0.0, [(u, 1.0) for u in us] + in_mixes)
            for a, b in itertools.pairwise(us):
                lp.row(0.0, inf, [(a, 1.0), (b, -1.0)])  # symmetry: fill slots in order
            for u in us:
                s = len(self.slots)
                self.slots.append((j, u))
                node_terms.append((u, float(d // p.g)))
                v = lp.var(0.0, inf)
                self.uvm.append(v)
                lp.row(-inf, 0.0, [(v, 1.0), (self.mvar, -1.0)])
                lp.row(-inf, 0.0, [(v, 1.0), (u, -p.m_cap)])
                lp.row(-p.m_cap, inf, [(v, 1.0), (self.mvar, -1.0), (u, -p.m_cap)])
                # q: the group's passes (q = u where every pass is a barrier), each holding
                # its memory and paying its fixed cost.
                q = lp.var(0.0, float(p.passes), p.passes > 1)
                self.qvar.append(q)
                lp.row(0.0, inf, [(q, 1.0), (u, -1.0)])
                lp.row(-inf, 0.0, [(q, 1.0), (u, -float(p.passes))])
                mem, tim = [(q, -float(d * p.cap))], [(q, p.fixed[j]), (self.mvar, -1.0)]
                for k in range(len(p.classes)):
                    if j in p.fits[k]:
                        most = (d * p.cap) // p.rep[k] * p.passes
                        x = lp.var(0.0, float(min(p.count[k], most)), True)
                        self.xvar[s, k] = x
                        mem.append((x, float(p.rep[k])))
                        tim.append((x, p.tk[k][j]))
                lp.row(-inf, 0.0, mem)
                lp.row(-inf, 0.0, tim)
                # A pattern's cross-node groups are those holding an explicit sequence (a group
                # of short ones only is free ranks); an empty one would mis-price its u x M.
                held = [
                    (self.xvar[s, k], -1.0) for k in range(len(p.classes)) if (s, k) in self.xvar
                ]
                lp.row(-inf, 0.0, [(u, 1.0), *held])
        return node_terms

    def _intra_node_groups(self, node_terms: list[tuple[int, float]]) -> None:
        """Intra-node groups, pooled per size: ``ng`` groups (bits of it, to price ``ng * M``)
        in the nodes the configurations give; every class in it fits one group and finishes by
        M, and together they fit the groups' memory and ``ng`` makespans (a relaxation)."""
        p, lp, inf = self.p, self.lp, math.inf
        cvar = [lp.var(0.0, float(p.nodes), True) for _ in p.configs]
        lp.row(-inf, float(p.nodes), node_terms + [(c, 1.0) for c in cvar])
        for j in p.intra:
            d = p.sizes[j]
            most = p.nodes * (p.g // d)
            ks = [k for k in range(len(p.classes)) if j in p.fits[k]]
            if not ks or not any(c.get(d, 0) for c in p.configs):
                continue
            bs = [(1 << i, lp.var(0.0, 1.0, True)) for i in range(most.bit_length())]
            self.bits[j] = bs
            in_configs = [(c, -float(cf.get(d, 0))) for c, cf in zip(cvar, p.configs, strict=True)]
            lp.row(-inf, 0.0, [(b, float(w)) for w, b in bs] + in_configs)
            q = lp.var(0.0, float(most * p.passes), p.passes > 1)  # the pool's passes
            self.pass_var[j] = q
            lp.row(0.0, inf, [(q, 1.0)] + [(b, -float(w)) for w, b in bs])
            lp.row(-inf, 0.0, [(q, 1.0)] + [(b, -float(w * p.passes)) for w, b in bs])
            mem = [(q, -float(d * p.cap))]
            tim = [(q, p.fixed[j])]
            for w, b in bs:  # v_b = bit * M, linearised: v <= M, v <= m_cap * bit
                v = lp.var(0.0, inf)
                lp.row(-inf, 0.0, [(v, 1.0), (self.mvar, -1.0)])
                lp.row(-inf, 0.0, [(v, 1.0), (b, -p.m_cap)])
                tim.append((v, -float(w)))
            for k in ks:
                most_k = min(p.count[k], most * p.passes * ((d * p.cap) // p.rep[k]))
                x = lp.var(0.0, float(most_k), True)
                z = lp.var(0.0, 1.0, True)
                self.pvar[j, k] = x
                lp.row(-inf, 0.0, [(x, 1.0), (z, -float(most_k))])
                lp.row(-inf, 0.0, [(z, p.tk[k][j] + p.fixed[j]), (self.mvar, -1.0)])
                mem.append((x, float(p.rep[k])))
                tim.append((x, p.tk[k][j]))
            lp.row(-inf, 0.0, mem)
            lp.row(-inf, 0.0, tim)

    def _free_work(self, free_lines: Sequence[tuple[float, float]]) -> list[tuple[int, float]]:
        """``f``: at most the free ranks' spare time, and (phase two; rows returned with the
        bound they then take) at most what their memory's tokens carry."""
        p, lp = self.p, self.lp
        self.fvar = lp.var(0.0, math.inf)
        terms = [(self.fvar, 1.0), (self.mvar, -float(p.n))]  # f <= n M - sum d v + b_min D - ..
        terms += [t for (j, u), v in zip(self.slots, self.uvm, strict=True)
                  for t in ((v, float(p.sizes[j])), (u, -p.b_min * p.sizes[j]))]  # fmt: skip
        terms += [(b, -p.sizes[j] * p.b_min * w) for j, bs in self.bits.items() for w, b in bs]
        terms += [(q, p.sizes[j] * p.fixed[j]) for j, q in self.pass_var.items()]
        terms += [(x, p.sizes[j] * p.tk[k][j]) for (j, k), x in self.pvar.items()]
        lp.row(-math.inf, -p.n * p.b_min, terms)
        line_rows = []
        for a, c in free_lines:  # f <= c + a (n cap - cap D - pooled tokens)
            terms = [(self.fvar, 1.0)] + [(u, a * p.cap * p.sizes[j]) for j, u in self.slots]
            terms += [(x, a * p.rep[k]) for (j, k), x in self.pvar.items()]
            line_rows.append((lp.row(-math.inf, math.inf, terms), c + a * p.n * p.cap))
        return line_rows

    def cap_free_work(self) -> None:
        for r, ub in self.line_rows:
            self.lp.h.changeRowBounds(r, -math.inf, ub)

    def costs(self, pi: list[float], area: list[float]) -> tuple[np.ndarray, float]:
        """Reduced value of a pattern: sw f + st (N - D) cap + sl (D M - sum d (T + b q))
        + stl (sum d q cap - sum L) + covers - M, with D = sum d u, D M = sum d v, q a group's
        passes; (costs, offset)."""
        p = self.p
        sw, st, sl, stl, _, _, sc = area
        costs = np.zeros(self.lp.h.getNumCol())
        costs[self.mvar] = -1.0
        costs[self.fvar] = sw
        for (j, u), v, q in zip(self.slots, self.uvm, self.qvar, strict=True):
            d = p.sizes[j]
            costs[u] = -d * p.cap * st
            costs[q] = d * (p.cap * stl - sl * p.fixed[j])
            costs[v] = d * sl
        for (s, k), x in self.xvar.items():
            j = self.slots[s][0]
            costs[x] = pi[k] - sl * p.sizes[j] * p.tk[k][j] - stl * p.rep[k]
        for (_, k), x in self.pvar.items():
            costs[x] = pi[k] - st * p.rep[k]
        return costs, st * p.n * p.cap + sc

    def pattern(self, sol: list[float]):
        """The pattern a pricing solution describes, as ``_Master.add_pattern``'s arguments."""
        groups: list[tuple[int, dict[int, int]]] = []
        for s, (j, u) in enumerate(self.slots):
            if sol[u] < 0.5:
                continue
            content = {
                k: round(sol[x]) for (ss, k), x in self.xvar.items() if ss == s and sol[x] > 0.5
            }
            if content:
                groups.append((j, content))
        pooled: dict[int, tuple[int, dict[int, int]]] = {}
        for j, bs in self.bits.items():
            content = {
                k: round(sol[x]) for (jj, k), x in self.pvar.items() if jj == j and sol[x] > 0.5
            }
            ng = sum(w for w, b in bs if sol[b] > 0.5)
            if content and ng:
                pooled[j] = (ng, content)
        return groups, pooled


def _passes(p: _Problem, j: int, tokens: float, groups: int) -> int:
    """Fewest passes ``groups`` groups of ``sizes[j]`` run for ``tokens`` (at least one each;
    exactly ``groups`` where every pass is a barrier)."""
    if p.passes == 1:
        return groups
    return max(groups, math.ceil(tokens / (p.sizes[j] * p.cap) - 1e-9))


@dataclass
class _Limits:
    t_end: float
    max_iterations: int
    price_limit_s: float
    iterations: int = 0


def _generate(master: _Master, price: _Pricing, lim: _Limits) -> tuple[float, float, bool]:
    """Column generation to convergence or a limit: (bound, master value, converged).

    Early columns need only improve the master: a loose MILP gap finds them fast; once the best
    column found is worth little, the pricing is solved tightly, which convergence needs.
    """
    p = master.p
    rel_gap = LOOSE_GAP
    z_rmp, z_star = 0.0, math.inf
    while True:
        z_rmp, pi, area, curve_dual = master.duals()
        remaining = lim.t_end - time.perf_counter()
        if lim.iterations >= lim.max_iterations or remaining <= 0:
            break
        lim.iterations += 1
        costs, offset = price.costs(pi, area)
        limit = max(0.05, min(lim.price_limit_s, remaining))
        z_bound, best, sol = price.lp.price(costs, rel_gap, limit)
        z_star = max(0.0, z_bound + offset)
        tol = 1e-7 * max(1.0, z_rmp)
        # A column only from a feasible MILP solution (a time limit may leave none).
        found = best + offset if sol is not None else 0.0
        if z_star <= tol:
            break
        if found <= max(tol, 1e-3 * z_rmp / max(1, len(p.classes))) and rel_gap > TIGHT_GAP:
            rel_gap = TIGHT_GAP  # too little found to go on loosely: solve tightly next
            if found <= tol:
                continue
        elif found <= tol:
            break
        groups, pooled = price.pattern(sol)
        if not groups and not pooled:
            break
        master.add_pattern(groups, pooled)
    sws, sts, sc = area[4], area[5], area[6]
    dual_obj = sum(x * c for x, c in zip(pi, p.count, strict=True))
    dual_obj += sws * sum(p.short_work) + sts * sum(p.short_tokens) + sc * p.m_floor + curve_dual
    # A plan has at most one micro-batch with explicit sequences per explicit sequence.
    bound, converged = dual_bound(dual_obj, z_star, z_rmp, p.m_low, p.explicit)
    return bound, z_rmp, converged


def placement_lp_bound(
    inst: Instance,
    cluster: Cluster,
    *,
    rel_width: float = 0.02,
    max_iterations: int = 2000,
    time_limit_s: float = 60.0,
    price_limit_s: float = 5.0,
    seed: Sequence[Sequence[tuple[int, Sequence[int]]]] = (),
    upper_ms: float | None = None,
    intra_node: bool = False,
) -> PlacementBound | None:
    """Step time no placeable plan beats (module docstring); None where it is not computed.

    None: no sequence needs more than the smallest group (the bound would be the short work's,
    which ``bounds.py`` already gives), or more than ``MAX_MIXES`` placeable mixes. ``rel_width``
    groups lengths into classes priced at their shortest member (a relaxation: time and memory
    grow with length). ``seed``: micro-batches of a plan, as (group size, sequence ids) per
    group, that start the column generation (any plan's; it speeds convergence, the bound does
    not depend on it). ``upper_ms``: a plan's step time (no micro-batch of a better plan lasts
    longer; it only tightens the pricing's linearisation). ``intra_node``: also place the
    multi-rank sequences a node holds (pooled per size in node configurations); exact on small
    instances, but its pricing MILP is slow: at 64 ranks and 512 sequences it does not converge
    in minutes. Without it they are short (fractional) and only cross-node placement counts.
    """
    lim = _Limits(time.perf_counter() + time_limit_s, max_iterations, price_limit_s)
    p = _problem(inst, cluster, rel_width, upper_ms, intra_node)
    if p is None:
        return None
    master = _Master(p)
    for k in range(len(p.classes)):  # each class alone in its fastest group
        j = min(p.fits[k], key=lambda j: p.tk[k][j] + p.fixed[j])
        master.add_micro([(p.sizes[j], [p.classes[k][0]])])
    for micro in seed:
        master.add_micro(micro)
    price = _Pricing(p, master.free_lines)
    # Two phases: the free ranks' work uncapped until the LP converges, then capped by what
    # their tokens carry (module docstring), from those columns; each phase's bound is valid,
    # and the first converges as fast as without the cap (sft-long-mix's capped pricing alone
    # did not converge on one batch in minutes). Not where groups run several passes: there a
    # pattern's free ranks also hold the tokens further passes take, which the cap leaves out.
    bound, z_rmp, converged = _generate(master, price, lim)
    if converged and p.passes == 1 and time.perf_counter() < lim.t_end:
        price.cap_free_work()
        master.cap_free_work()
        again = _generate(master, price, lim)
        if again[0] > bound:
            bound, z_rmp, converged = again
    return PlacementBound(
        bound_ms=bound * (1 - 1e-7),
        lp_ms=z_rmp,
        converged=converged,
        iterations=lim.iterations,
        classes=len(p.classes),
        long_sequences=p.long_sequences,
        mixes=len(p.mixes),
    )
