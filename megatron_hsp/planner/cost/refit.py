"""Online refit of a cost model from measured micro-batch and step times.

Why: a cost model fitted elsewhere (a preset, published figures, a ``profile`` run on another
day) is wrong on the cluster at hand by factors no one can know in advance (sites differ, kernels
change), and every plan is only as good as its model. During training every micro-batch is a free
measurement; this module turns them into a corrected model, without a separate profiling run.

What is refitted: scale factors on the current model's own terms (``TERMS``), not the raw
coefficients, so a handful of records per update is enough and the model's shape (quadratic
attention, split rules, ring overlap) is kept::

    group_ms ~ th_route * sum a1 f_route s^2 / d + th_lin * sum a2 s / d
             + th_comm * (all-to-all + exposed ring p2p + ring overhead) + th_fixed * fixed_ms

Attention has one factor per route (``planner/routes.py``: "attn" for Ulysses groups,
``ROUTE_TERMS`` for the ring routes), and a record's attention sits in its own route's column
only, so a slowdown that only ring groups have (a tiled ring kernel) raises that route's factor
and leaves Ulysses groups' price alone (docs/costmodel.md, "Per-route attention coefficients").

Each record's features are the current model's terms for that group; the fit is a robust
(Huber, iteratively reweighted) non-negative least squares on *relative* error, then

- bounded: each factor moves by at most ``max_step`` (relative) per update, so one bad batch of
  timings cannot swing the plans;
- refused: when a term the ranking needs (attention or linear) would get a non-positive factor
  (the model would no longer grow with tokens: non-monotone), when records are too few, or when
  the refit predicts the records clearly worse than the current model (median relative
  error more than 10% above the current one's). A refused update
  returns the current model unchanged with the reason.

Terms the records cannot identify (a column that is zero or a negligible share of every record,
e.g. communication when every group had size 1) keep their factor.

The exposed part of a ring step, ``max(0, p s - attn / r)``, is linearised at the current model
(computed once per record and scaled as communication); that is exact while the sign of the
excess does not change, and the bounded step keeps it close.

Interface (for the observer, the demo and the Megatron hooks; wired by them, not here)::

    from megatron_hsp.planner.cost.refit import GroupTiming, OnlineRefit, StepTiming

    refit = OnlineRefit(cost_model)                      # the planner's current model
    result = refit.update(
        [GroupTiming(lengths=[...], d=4, split=(4, 1), measured_ms=12.3), ...],
        steps=[StepTiming(step_ms=950.0, microbatch_ms=910.0)],  # optional
    )
    if result.accepted:
        planner_cost = result.model                      # plan the next steps with it
        atomic_write(path, yaml.safe_dump(result.spec))  # planner/paths.py; read next run

``refit_cost_model(model, groups, steps=..., base=...)`` is the same single update as a pure
function. ``result.spec`` is an explicit-coefficients spec (``CostModel.to_spec``) that
``load_cost_model`` reads back to an equal model.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from megatron_hsp.planner.cost.costcore import CostModel
from megatron_hsp.planner.errors import InputError
from megatron_hsp.planner.routes import RING_FUSED, RING_TILED, ROUTES, ULYSSES

# "attn" is the Ulysses route's attention (and the base coefficient ``attn_ms_per_token2``);
# each ring route's attention has its own factor, fitted from that route's records only.
ROUTE_TERMS = {RING_FUSED: "attn_ring_fused", RING_TILED: "attn_ring_tiled"}
TERMS = ("attn", "linear", "comm", "fixed", *ROUTE_TERMS.values())
# Terms whose factor must stay positive (time grows with tokens): every attention and linear.
TOKEN_TERMS = tuple(i for i, k in enumerate(TERMS) if k.startswith("attn") or k == "linear")
# A term is fitted only where it is on average at least this share of a record's prediction.
MIN_SHARE = 0.02
HUBER_K = 1.345  # the usual 95%-efficiency constant, in units of the robust scale (MAD)
# Ridge prior towards the common factor, in records per term (``_huber_shrunk``): strong against
# one step's handful of collinear records, weak against a window of many mixed ones.
PRIOR_RECORDS = 4.0


@dataclass(frozen=True)
class GroupTiming:
    """One group's measured time in one micro-batch: its lengths, size, split, and ms."""

    lengths: Sequence[int]
    d: int
    measured_ms: float
    split: tuple[int, int] | None = None
    # The attention route the group ran (``planner/routes.ROUTES``), where the runtime reported
    # it; None: the route the model assigns the group (``CostModel.route``).
    route: str | None = None


@dataclass(frozen=True)
class StepTiming:
    """One step's wall time and the sum of its micro-batches' (critical-path) times, in ms."""

    step_ms: float
    microbatch_ms: float


@dataclass(frozen=True)
class RefitResult:
    """What one update did: the model to plan with next, its spec, and why."""

    model: CostModel
    spec: dict[str, Any]
    accepted: bool
    reason: str
    scales: Mapping[str, float]  # cumulative factors against ``base``
    median_rel_err_before: float
    median_rel_err_after: float
    records: int


def features(model: CostModel, g: GroupTiming) -> np.ndarray:
    """The model's terms (``TERMS``) for one group record, in ms: attention in the column of
    the group's route (Ulysses: "attn"), linear, comm, fixed."""
    s = np.asarray(g.lengths, dtype=np.float64)
    d = int(g.d)
    u, r = model._resolve(d, g.split)
    route = model.route(d, (u, r))
    if g.route is not None and g.route not in ROUTES:
        raise InputError(f"refit: group record route {g.route!r}; routes: {ROUTES}")
    sq = float((s * s).sum()) / d
    attn = model.attn_coefficient(d, (u, r)) * sq
    lin = float((model.linear_ms_per_token * s).sum()) / d
    total = float(model.seq_ms(s, d, (u, r)).sum())
    comm = max(0.0, total - attn - lin)
    ran = g.route or route
    out = np.zeros(len(TERMS))
    out[1:4] = lin, comm, model.fixed_ms(d, (u, r))
    term = "attn" if ran == ULYSSES else ROUTE_TERMS[ran]
    out[TERMS.index(term)] = model.attn_ms_per_token2 * model.route_factor(ran) * sq
    return out


def scaled_model(
    base: CostModel, scales: Mapping[str, float], name: str | None = None
) -> CostModel:
    """``base`` with its terms multiplied by ``scales`` (keys from ``TERMS``).

    "attn" scales ``attn_ms_per_token2`` (the Ulysses route's attention); a ring route's factor
    (``ROUTE_TERMS``) scales that route's attention, and defaults to "attn"'s (all attention
    alike). Stored as route factors relative to the scaled base coefficient."""
    a, lin, c, f = (float(scales.get(k, 1.0)) for k in TERMS[:4])
    factors = dict(base.attn_route_factor)
    for route, term in ROUTE_TERMS.items():
        k = float(scales.get(term, a))
        if k != a and a > 0:  # a route moved apart from the base coefficient
            factors[route] = base.route_factor(route) * k / a

    def times(m: Mapping[int, float], k: float) -> dict[int, float]:
        return {int(d): float(v) * k for d, v in m.items()}

    return dataclasses.replace(
        base,
        name=name or base.name,
        attn_route_factor=factors,
        attn_ms_per_token2=base.attn_ms_per_token2 * a,
        linear_ms_per_token=base.linear_ms_per_token * lin,
        a2a_ms_per_token=times(base.a2a_ms_per_token, c),
        ring_step_ms_per_token=times(base.ring_step_ms_per_token, c),
        ring_step_extra_ms_per_token=times(base.ring_step_extra_ms_per_token, c),
        group_fixed_ms=times(base.group_fixed_ms, f),
        a2a_fixed_ms=times(base.a2a_fixed_ms, f),
        ring_step_fixed_ms=times(base.ring_step_fixed_ms, f),
    )


def _huber_shrunk(
    a: np.ndarray, b: np.ndarray, prior_records: float, w: np.ndarray, iters: int = 30
) -> tuple[float, np.ndarray]:
    """Huber regression of ``b ~ a @ c`` with each factor shrunk towards one common factor.

    ``a``: the records' terms divided by their measured time (so residuals are relative), ``b``:
    what the fitted terms must add up to (1 minus the held terms' share). Returns
    ``(common, c)``: the robust common factor of all fitted terms (always identified: one
    number, any record informs it) and the per-term factors.

    Why the shrinkage: within one step's records the terms are nearly collinear (same-size groups
    pay all-to-all in proportion to their tokens, like the linear term; lengths of one batch are
    alike), so an unpenalised fit trades one term for another on timing noise (attention and
    linear both fitted to 0 on the demo's early steps, so updates were refused, or a term was
    doubled while another was zeroed, so the bounded step predicted worse). A ridge penalty worth
    ``prior_records`` average records per term pulls each factor towards the common one: where the
    records cannot tell the terms apart they move together (the machine is uniformly faster or
    slower), and where they can (many records, mixed sizes) the data outweighs the prior.
    ``w``: each record's weight (recency, ``OnlineRefit.half_life``), times its Huber weight.
    """
    h = np.ones(len(b))
    common, coef = 1.0, np.ones(a.shape[1])
    total = a.sum(axis=1)
    for _ in range(iters):
        hw = h * w
        common = float((hw * total * b).sum() / max(float((hw * total * total).sum()), 1e-300))
        # The prior is worth ``prior_records`` average (weighted) records per term.
        lam = prior_records * (hw[:, None] * a * a).sum(axis=0) / max(float(w.sum()), 1e-300)
        lhs = a.T @ (hw[:, None] * a) + np.diag(np.maximum(lam, 1e-300))
        new = np.linalg.lstsq(lhs, a.T @ (hw * b) + lam * common, rcond=None)[0]
        rel = a @ new - b
        mad = float(np.median(np.abs(rel - np.median(rel)))) * 1.4826
        r = np.abs(rel) / max(mad, 1e-6)
        h = np.where(r <= HUBER_K, 1.0, HUBER_K / np.maximum(r, 1e-12))
        done = np.allclose(new, coef, rtol=1e-9, atol=1e-12)
        coef = new
        if done:
            break
    return common, coef


def _huber_loss(pred: np.ndarray, y: np.ndarray, w: np.ndarray, scale: float) -> float:
    """The fit's own objective: weighted Huber loss of relative residuals at ``scale``."""
    r = np.abs(pred - y) / np.maximum(np.abs(y), 1e-12) / max(scale, 1e-6)
    rho = np.where(r <= HUBER_K, 0.5 * r * r, HUBER_K * r - 0.5 * HUBER_K**2)
    return float((w * rho).sum() / max(float(w.sum()), 1e-300))


def _median_rel(pred: np.ndarray, y: np.ndarray, w: np.ndarray | None = None) -> float:
    """The (weighted) median relative error of ``pred`` against ``y``."""
    err = np.abs(pred - y) / np.maximum(np.abs(y), 1e-12)
    if w is None:
        return float(np.median(err))
    order = np.argsort(err)
    cum = np.cumsum(w[order])
    return float(err[order][np.searchsorted(cum, 0.5 * cum[-1])])


def refit_cost_model(
    model: CostModel,
    groups: Iterable[GroupTiming],
    *,
    steps: Iterable[StepTiming] = (),
    base: CostModel | None = None,
    scales: Mapping[str, float] | None = None,
    max_step: float = 0.25,
    min_records: int = 8,
    prior_records: float = PRIOR_RECORDS,
    weights: Sequence[float] | None = None,
) -> RefitResult:
    """One bounded, robust update of ``model`` from measured group times.

    ``base``/``scales``: the model the factors apply to and the factors already applied
    (``model == scaled_model(base, scales)``); default: ``model`` itself at factor 1. Keeping the
    base lets repeated updates compound without drifting from the model's shape.
    """
    if not max_step > 0:
        raise InputError(f"refit: max_step must be > 0, got {max_step}")
    base = base or model
    given = dict(scales or {})
    # A ring route without its own factor moves with the base coefficient ("attn").
    cur = {k: float(given.get(k, given.get("attn", 1.0) if k in ROUTE_TERMS.values() else 1.0))
           for k in TERMS}  # fmt: skip
    groups = list(groups)
    ws = [1.0] * len(groups) if weights is None else [float(v) for v in weights]
    if len(ws) != len(groups):
        raise InputError(f"refit: {len(ws)} weights for {len(groups)} group records")
    keep = [i for i, g in enumerate(groups) if float(g.measured_ms) > 0 and len(g.lengths) > 0]
    rows = [groups[i] for i in keep]
    w = np.array([ws[i] for i in keep], dtype=np.float64)
    step_rows = [s for s in steps if s.step_ms > 0]
    spec = model.to_spec()

    def refuse(reason: str, before: float = float("nan")) -> RefitResult:
        return RefitResult(model, spec, False, reason, dict(cur), before, before, len(rows))

    if len(rows) < min_records:
        return refuse(f"{len(rows)} group records; the refit needs at least {min_records}")
    # Features at the current model: the fit is a relative correction of it (factor 1 = no
    # change), so the linearised ring overlap is taken where the model now stands.
    x = np.stack([features(model, g) for g in rows])
    y = np.array([float(g.measured_ms) for g in rows])
    ones = np.ones(len(TERMS))
    pred_cur = x.sum(axis=1)
    before = _median_rel(pred_cur, y, w)
    # Mean share per record (the fit is on relative error, so a term that matters to the small
    # records counts even where the large ones dwarf it).
    share = (x / np.maximum(pred_cur, 1e-12)[:, None]).mean(axis=0)
    free = [i for i in range(len(TERMS)) if share[i] >= MIN_SHARE]
    if not free:
        return refuse("no term of the model is visible in these records", before)
    held: list[str] = []
    a = x / y[:, None]  # relative terms: the fit is on relative error
    while True:
        kept = [i for i in range(len(TERMS)) if i not in free]
        rel = ones.copy()
        common, rel[free] = _huber_shrunk(
            a[:, free], 1.0 - a[:, kept].sum(axis=1), prior_records, w
        )
        # A token term (attention, linear) at factor 0 would make time stop growing with tokens
        # (non-monotone): that term keeps its current factor and the others are refitted
        # without it.
        bad = [i for i in TOKEN_TERMS if i in free and not rel[i] > 0]
        if not bad and common > 0:
            break
        held += [TERMS[i] for i in bad]
        free = [i for i in free if i not in bad]
        # Every token term the records see came out non-positive (or the common factor did):
        # the records say time does not grow with tokens at all, which no monotone model
        # explains; refuse the update.
        if not bad or not free or not any(i in free for i in TOKEN_TERMS):
            return refuse(
                f"the fit gives non-positive {' and '.join(held) or 'common'} factors: time "
                "would not grow with tokens (non-monotone); kept the current model",
                before,
            )
    # Bounded: the common move first (all fitted terms scaled alike, so the fit's shape is kept
    # where the bound bites), then each factor on its own.
    bounded = min(max(common, 1.0 / (1.0 + max_step)), 1.0 + max_step)
    rel[free] *= bounded / common
    rel = np.clip(rel, 1.0 / (1.0 + max_step), 1.0 + max_step)
    after = _median_rel(x @ rel, y, w)
    # "Worse" is judged by the fit's own objective, the weighted Huber loss of relative error at
    # the current model's robust scale (MAD), not by the median error: the unbounded fit
    # minimises nearly this (plus its prior), so a worse bounded fit means the bound distorted
    # its shape. (Judged by the
    # median with a 10% margin, updates that followed a machine getting slower were refused
    # while the records' median was small, and the model froze at an old speed: in an
    # interleaved A/B of five demo runs each the median rule missed 20% once (79%), this one
    # never (worst 19%), docs/costmodel.md.) Then the uniform move alone (the current shape at
    # the fitted level, the bounded common factor on every fitted term) is tried: a machine
    # that got slower as a whole is followed even while the records cannot agree on a shape.
    note = ""
    rel_cur = (pred_cur - y) / y
    scale = float(np.median(np.abs(rel_cur - np.median(rel_cur)))) * 1.4826
    loss_before = _huber_loss(pred_cur, y, w, scale)
    if _huber_loss(x @ rel, y, w, scale) > loss_before:
        uniform = ones.copy()
        uniform[free] = bounded
        level_after = _median_rel(x @ uniform, y, w)
        if _huber_loss(x @ uniform, y, w, scale) > loss_before:
            return refuse(
                "the bounded refit predicts these records worse (robust loss; median relative "
                f"error {after:.3f} vs {before:.3f}), and so does a uniform move; kept the "
                "current model",
                before,
            )
        rel, after = uniform, level_after
        note = " (uniform: the fitted shape predicted worse)"
    theta_new = np.array([cur[k] for k in TERMS]) * rel
    new_scales = {k: float(v) for k, v in zip(TERMS, theta_new, strict=True)}
    new_model = scaled_model(base, new_scales)
    details = dict(model.details)
    if step_rows:
        # What a step costs beyond its micro-batches, robustly, moved by at most max_step.
        over = float(np.median([max(0.0, s.step_ms - s.microbatch_ms) for s in step_rows]))
        old = float(details.get("step_ms", 0.0))
        if old > 0:
            over = min(max(over, old / (1.0 + max_step)), old * (1.0 + max_step))
        details["step_ms"] = over
    details.update({f"refit_scale_{k}": v for k, v in new_scales.items()})
    details["refit_records"] = float(len(rows))
    new_model = dataclasses.replace(
        new_model,
        details=details,
        source=f"online refit of {base.name!r} (megatron_hsp.planner.cost.refit)",
    )
    return RefitResult(
        new_model,
        new_model.to_spec(),
        True,
        "refit accepted"
        + note
        + (f" ({', '.join(held)} kept: non-positive in this fit)" if held else ""),
        new_scales,
        before,
        after,
        len(rows),
    )


@dataclass
class OnlineRefit:
    """Keeps a window of recent records and the cumulative factors across updates.

    ``window``: group records kept (older ones fall out, so the model follows a cluster whose
    speed changes); each ``update`` refits on the whole window. ``half_life``: in updates, how
    fast a record's weight halves (None: all records in the window count alike). Why: on a
    shared machine the speed shifts within seconds (other jobs start and stop) and the plan
    made after step t runs at t + 2; equal weights for every past step kept the model at an
    old speed for many steps, while the prior towards the common factor keeps the model's
    shape from chasing one step's noise.
    """

    base: CostModel
    max_step: float = 0.25
    window: int = 512
    min_records: int = 8
    prior_records: float = PRIOR_RECORDS
    half_life: float | None = None
    scales: dict[str, float] = field(default_factory=lambda: dict.fromkeys(TERMS, 1.0))
    _groups: deque = field(default_factory=deque, repr=False)
    _steps: deque = field(default_factory=deque, repr=False)
    model: CostModel | None = None
    updates: int = 0

    def __post_init__(self) -> None:
        self._groups = deque(maxlen=self.window)  # (update index, GroupTiming)
        self._steps = deque(maxlen=max(8, self.window // 8))
        self.model = self.model or self.base

    def update(
        self, groups: Iterable[GroupTiming], steps: Iterable[StepTiming] = ()
    ) -> RefitResult:
        """Add records and refit; on acceptance the new model becomes ``self.model``."""
        self._groups.extend((self.updates, g) for g in groups)
        self._steps.extend(steps)
        self.updates += 1
        assert self.model is not None
        now = self.updates - 1
        weights = [
            1.0 if not self.half_life else 0.5 ** ((now - i) / self.half_life)
            for i, _ in self._groups
        ]
        result = refit_cost_model(
            self.model,
            [g for _, g in self._groups],
            weights=weights,
            steps=list(self._steps),
            base=self.base,
            scales=self.scales,
            max_step=self.max_step,
            min_records=self.min_records,
            prior_records=self.prior_records,
        )
        if result.accepted:
            self.model = result.model
            self.scales = dict(result.scales)
        return result
