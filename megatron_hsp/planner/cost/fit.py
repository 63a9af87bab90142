"""Fitting ``megatron-hsp profile`` measurements into the planner's cost model (numpy only).

The cost model is linear in its coefficients (docs/costmodel.md), so every fit here is a
non-negative least squares on a small design matrix. A fit is refused (``InputError``) when a
coefficient the model needs to rank schedules correctly comes out non-positive or when the fitted
curve is not monotone in tokens, because such a model would make the planner prefer nonsense
(e.g. longer sequences being cheaper).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from megatron_hsp.planner.errors import InputError


@dataclass(frozen=True)
class Fit:
    """Coefficients of one fit and how well they explain the samples."""

    names: tuple[str, ...]
    coef: tuple[float, ...]
    r2: float
    median_rel_err: float
    max_rel_err: float
    samples: int

    def as_dict(self) -> dict[str, float]:
        return dict(zip(self.names, self.coef, strict=True))


def _nnls(a: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Exact non-negative least squares for a few columns: the best feasible column subset.

    The NNLS optimum is the unconstrained least-squares solution on its support, so trying every
    subset (2^k, k <= 6 here) and keeping the best all-non-negative one is exact and needs no
    scipy.
    """
    k = a.shape[1]
    best, best_res = np.zeros(k), float((y**2).sum())
    for mask in range(1, 2**k):
        cols = [j for j in range(k) if mask >> j & 1]
        sol, *_ = np.linalg.lstsq(a[:, cols], y, rcond=None)
        if (sol < 0).any():
            continue
        x = np.zeros(k)
        x[cols] = sol
        res = float(((a @ x - y) ** 2).sum())
        if res < best_res:
            best, best_res = x, res
    return best


def fit_linear(
    columns: Mapping[str, Sequence[float]],
    y: Sequence[float],
    *,
    required: Sequence[str],
    what: str = "the fit",
    relative: bool = True,
) -> Fit:
    """Fit ``y ~ sum_k c_k * columns[k]`` with ``c >= 0``; refuse if a ``required`` c is 0.

    ``relative``: least squares on relative error (compute, where small batches' fixed costs
    matter as much as large ones' quadratic term); False: absolute error (message times, where
    small messages are latency plus scheduling noise and the per-token slope is set by the
    large ones).
    """
    names = tuple(columns)
    a = np.column_stack([np.asarray(columns[n], dtype=np.float64) for n in names])
    yy = np.asarray(y, dtype=np.float64)
    if a.shape[0] < len(names) + 1:
        raise InputError(
            f"profile: {a.shape[0]} samples cannot fit {len(names)} coefficients; "
            "measure more points (--points)"
        )
    # relative least squares: samples span orders of magnitude, and the planner needs small
    # batches (fixed costs) as right as large ones (quadratic term)
    w = 1.0 / np.maximum(np.abs(yy), 1e-12) if relative else np.ones_like(yy)
    coef = _nnls(a * w[:, None], yy * w)
    pred = a @ coef
    ss_res = float(((yy - pred) ** 2).sum())
    ss_tot = float(((yy - yy.mean()) ** 2).sum()) or 1.0
    rel = np.abs(pred - yy) / np.maximum(np.abs(yy), 1e-12)
    fit = Fit(
        names,
        tuple(float(c) for c in coef),
        1.0 - ss_res / ss_tot,
        float(np.median(rel)),
        float(rel.max()),
        int(a.shape[0]),
    )
    bad = [n for n, c in fit.as_dict().items() if n in required and not c > 0.0]
    if bad:
        raise InputError(
            f"profile: {what} gives non-positive {bad} (measurements too noisy or the range too "
            "narrow for those terms); measure longer batches (--max-tokens) or more repeats "
            "(--repeats)"
        )
    return fit


def fit_compute(samples: Iterable[tuple[Sequence[int], float]]) -> Fit:
    """The compute fit of ``profile``: ``ms = a1 * sum s^2 + a2 * sum s + b + c * sequences``
    over (sequence lengths of one packed batch, measured forward+backward ms) samples."""
    rows = list(samples)
    return fit_linear(
        {
            "attn_ms_per_token2": [sum(x * x for x in lengths) for lengths, _ in rows],
            "linear_ms_per_token": [sum(lengths) for lengths, _ in rows],
            "fixed_ms": [1.0] * len(rows),
            "seq_ms": [len(lengths) for lengths, _ in rows],
        },
        [ms for _, ms in rows],
        required=("attn_ms_per_token2", "linear_ms_per_token"),
        what="the compute fit",
    )


def fit_latency(rows: Sequence[tuple[int, float]], ms_per_token: float) -> Fit:
    """``ms = latency + ms_per_token * tokens`` with the slope given: the latency is the median
    of ``ms - ms_per_token * tokens`` over (tokens, ms) rows (robust to a few noisy points), and
    the quality columns describe these rows."""
    t = np.array([tokens for tokens, _ in rows], dtype=np.float64)
    y = np.array([ms for _, ms in rows], dtype=np.float64)
    latency = float(np.median(y - ms_per_token * t))
    err = np.abs(y - (ms_per_token * t + latency))
    rel = err / np.maximum(np.abs(y), 1e-9)
    ss = float(np.sum((y - y.mean()) ** 2))
    return Fit(
        ("ms_per_token", "latency_ms"),
        (float(ms_per_token), latency),
        1.0 - float(np.sum(err**2)) / ss if ss > 0 else 1.0,
        float(np.median(rel)),
        float(np.max(rel)),
        len(rows),
    )


def check_monotone(fn: Mapping[int, float], what: str, tolerance: float = 0.0) -> None:
    """Refuse a curve (x -> y) that decreases as x grows by more than ``tolerance`` (relative).

    A tolerance is for measured points whose neighbours differ by less than the noise (short
    sequences, where the fixed cost dominates); a fall beyond it is noise above the signal.
    """
    xs = sorted(fn)
    for lo, hi in itertools.pairwise(xs):
        if fn[hi] < fn[lo] * (1.0 - tolerance):
            raise InputError(
                f"profile: {what} is not monotone ({lo}: {fn[lo]:.4g} > {hi}: "
                f"{fn[hi]:.4g}); measure more repeats (--repeats) or a wider range"
            )


def cost_model_spec(
    name: str,
    compute: Fit,
    a2a: Mapping[int, Fit],
    tokens_per_rank: int,
    *,
    source: str,
    ring: Mapping[int, Fit] | None = None,
    details: Mapping[str, float] | None = None,
) -> dict:
    """The explicit-coefficients spec ``load_cost_model`` accepts (docs/costmodel.md).

    ``compute`` has ``attn_ms_per_token2``, ``linear_ms_per_token`` and ``fixed_ms`` (per
    micro-batch: launches, loss, backward bookkeeping, written as ``group_fixed_ms`` for every
    size); a ``seq_ms`` column (per sequence) is reported by ``profile`` but the planner's
    separable form has no per-sequence term, so it is not part of the coefficients. ``a2a[d]``
    has ``ms_per_token`` and ``latency_ms`` (both already scaled to one step) per group size:
    the latency is ``a2a_fixed_ms[d]``, charged when Ulysses runs over d ranks. ``ring[d]``, same
    columns, gives ``ring_step_ms_per_token[d]`` and ``ring_step_fixed_ms[d]`` (one ring step
    of a pure ring of d, charged r - 1 times when a split runs a ring). ``details`` is stored as
    measured (per-sequence and per-step ms, activation MiB per token).
    """
    c = compute.as_dict()
    # No monotonicity across group sizes: per token of the group, a rank of a group of d sends
    # (d - 1) / d^2 of it, and all groups of a size run at once, so on a shared-memory machine the
    # measured per-token time legitimately falls with d (gloo on a CPU does; docs/costmodel.md,
    # run 1). Monotone in tokens is what the planner needs; the
    # positive slopes ensure it.
    per_token = {d: f.as_dict()["ms_per_token"] for d, f in sorted(a2a.items())}
    fixed = {1: c["fixed_ms"], **{d: c["fixed_ms"] for d in sorted(a2a)}}
    coefficients: dict = {
        "attn_ms_per_token2": c["attn_ms_per_token2"],
        "linear_ms_per_token": c["linear_ms_per_token"],
        "group_fixed_ms": fixed,
        "a2a_ms_per_token": per_token,
        "a2a_fixed_ms": {d: f.as_dict()["latency_ms"] for d, f in sorted(a2a.items())},
        "tokens_per_rank": int(tokens_per_rank),
    }
    if ring:
        steps = {d: f.as_dict()["ms_per_token"] for d, f in sorted(ring.items())}
        bad = [d for d, v in steps.items() if not v > 0.0]
        if bad:
            raise InputError(
                f"profile: the ring step fit gives no positive per-token time for group sizes "
                f"{bad}; measure more repeats (--repeats) or longer messages (--max-tokens)"
            )
        coefficients["ring_step_ms_per_token"] = steps
        coefficients["ring_step_fixed_ms"] = {
            d: f.as_dict()["latency_ms"] for d, f in sorted(ring.items())
        }
    spec: dict = {"name": name, "source": source, "coefficients": coefficients}
    if details:
        spec["details"] = {k: float(v) for k, v in details.items()}
    return spec


def in_situ_overhead_rows(
    samples: Iterable[tuple[int, Sequence[int], float]],
    attn_ms_per_token2: float,
    linear_ms_per_token: float,
) -> dict[int, list[tuple[int, float]]]:
    """Per group size d > 1: (tokens, ms) that a group of d adds beyond its compute share.

    ``samples`` are (d, lengths, measured ms) of one training micro-batch in which every group of
    d trains ``lengths`` (``runtime.profile.measure_group_steps``). A group of d is priced
    ``(a1 s^2 + a2 s) / d`` per sequence plus its communication; what the size-1 step of the
    same lengths measures beyond its own share (loss, gradient all-reduce, per-sequence costs)
    is common to every size and is subtracted, so the rows hold the per-size overhead alone, to
    be fitted as ``latency + per_token * tokens`` like an all-to-all.
    """
    rows = list(samples)

    def share(lengths: Sequence[int], d: int) -> float:
        return sum(attn_ms_per_token2 * s * s + linear_ms_per_token * s for s in lengths) / d

    base = {tuple(lengths): ms - share(lengths, 1) for d, lengths, ms in rows if d == 1}
    out: dict[int, list[tuple[int, float]]] = {}
    for d, lengths, ms in rows:
        key = tuple(lengths)
        if d == 1 or key not in base:
            continue
        out.setdefault(d, []).append((sum(key), ms - share(key, d) - base[key]))
    return out
