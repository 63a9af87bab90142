"""What ``megatron-hsp demo`` prints: the prediction error, the loss curve, the side-by-side.

Pure functions of the result dictionary the ranks return (the ``--json`` contract of
docs/design.md), so the summary is tested without starting ranks.
"""

from __future__ import annotations

from typing import Any

WARMUP_STEPS = 2  # step 0 pays first-touch allocation and the planner's start-up
REFIT_SCORED_FROM_STEP = 5


def prediction_summary(steps: list[dict[str, Any]], cost_spec: dict[str, Any]) -> dict[str, Any]:
    """Median relative error of ``predicted_s`` against ``step_s`` after the warm-up steps.

    Why the median after warm-up: the first steps allocate buffers and warm caches, and a loaded
    machine adds outliers either way; the median over the rest is what the planner can rely on.
    With too few steps the warm-up shrinks so that at least one step is scored.
    """
    warm = min(WARMUP_STEPS, max(0, len(steps) - 1))
    scored = steps[warm:]
    errs = [abs(s["predicted_s"] - s["step_s"]) / s["step_s"] for s in scored if s["step_s"] > 0]
    import statistics

    late_steps = [
        s
        for i, s in enumerate(steps)
        if s.get("step", i) >= REFIT_SCORED_FROM_STEP and s["step_s"] > 0
    ]
    late = [abs(s["predicted_s"] - s["step_s"]) / s["step_s"] for s in late_steps]
    # The plans' own estimates (the model each plan was made with, a step older than the one
    # predicted_s re-prices with), scored on the same steps.
    late_planned = [
        abs(s["planned_ms"] / 1e3 - s["step_s"]) / s["step_s"]
        for s in late_steps
        if s.get("planned_ms") is not None
    ]
    return {
        "cost_model": cost_spec.get("name", "?"),
        "warmup_steps": warm,
        "steps": len(errs),
        "median_rel_err": statistics.median(errs) if errs else None,
        # From step 5 on: the steps there are priced by a refit model (the first refit follows
        # step 1 and prices step 2 on, bounded steps compound over a few updates).
        "median_rel_err_from_step_5": statistics.median(late) if late else None,
        "median_rel_err_from_step_5_planned": (
            statistics.median(late_planned) if late_planned else None
        ),
        "mean_predicted_over_measured": (
            sum(s["predicted_s"] / s["step_s"] for s in scored) / len(scored) if scored else None
        ),
    }


def _sparkline(values: list[float]) -> str:
    ticks = "▁▂▃▄▅▆▇█"
    lo, hi = min(values), max(values)
    span = (hi - lo) or 1.0
    return "".join(ticks[min(7, int((v - lo) / span * 7.999))] for v in values)


def render(result: dict[str, Any], elapsed_s: float) -> str:
    steps = result["steps"]
    lines = []
    losses = [s["loss"] for s in steps]
    lines.append("")
    lines.append(f"loss curve  {_sparkline(losses)}  {losses[0]:.4f} -> {losses[-1]:.4f}")
    for s in steps:
        lines.append(f"  step {s['step']:>3}  loss {s['loss']:.4f}")
    comp = result.get("comparison") or {}
    if comp.get("batches"):
        s_name = f"static-{comp['static_degree']}" if comp.get("static_degree") else None
        lines.append("")
        lines.append("adaptive vs static groups on the same batches (measured / predicted):")
        head = f"  {'step':>4} {'tokens':>7}  {'adaptive':>22}"
        if s_name:
            head += f"  {s_name:>22}"
        lines.append(head)
        for r in comp["batches"]:
            a = r["adaptive"]
            row = (
                f"  {r['step']:>4} {r['tokens']:>7}  "
                f"{a['measured_s'] * 1e3:>8.0f} ms / {a['predicted_ms']:>6.0f} ms"
            )
            if s_name:
                b = r[s_name]
                row += f"  {b['measured_s'] * 1e3:>8.0f} ms / {b['predicted_ms']:>6.0f} ms"
            lines.append(row)
        if s_name and comp.get("compare"):
            from megatron_hsp.commands.compare import verdict

            lines.append(
                f"  medians of {comp.get('repeats', 1)} runs per batch and layout; "
                + verdict(comp["compare"])
            )
        elif s_name:
            lines.append(
                f"  speedup of adaptive over {s_name}: measured "
                f"{comp['speedup_measured']:.2f}x, predicted {comp['speedup_predicted']:.2f}x"
            )
    pred = result.get("prediction") or {}
    if pred.get("median_rel_err") is not None:
        lines.append("")
        lines.append(
            f"prediction ({pred['cost_model']}): median |predicted - measured| / measured "
            f"{pred['median_rel_err']:.1%} over {pred['steps']} steps after "
            f"{pred['warmup_steps']} warm-up"
        )
    refit = result.get("refit") or {}
    if refit.get("updates"):
        took = [u for u in refit["updates"] if u["accepted"]]
        late = pred.get("median_rel_err_from_step_5")
        lines.append(
            f"online refit: {len(took)} of {len(refit['updates'])} updates accepted"
            + (f"; median error from step 5 on {late:.1%}" if late is not None else "")
            + (
                f"; refit model written to {refit['out']} (--cost-model {refit['out']} next run)"
                if refit.get("out") and took
                else ""
            )
        )
    lines.append("")
    lines.append(f"data: {result['sampler']}")
    lines.append(f"done in {elapsed_s:.1f} s")
    return "\n".join(lines)
