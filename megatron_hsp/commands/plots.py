"""PNG pictures for ``plan --plot`` and ``bench --plot`` (matplotlib, headless Agg backend).

matplotlib is imported lazily, inside the drawing functions, so the planner and the commands that
do not draw never pay for it (nor need it installed); ``check_png_path`` runs before any work so
a bad path fails in a second, not after a long bench.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from megatron_hsp.planner.errors import InputError
from megatron_hsp.planner.plan import Plan


def check_png_path(path: str, flag: str = "--plot") -> Path:
    """The output path, or InputError naming ``flag`` when it cannot be a writable PNG file."""
    from megatron_hsp.planner.paths import refuse_link

    p = Path(path)
    refuse_link(p, flag)
    if p.suffix.lower() != ".png":
        raise InputError(f"{flag} {path}: the picture is a PNG; give a file name ending in .png")
    parent = p.parent if str(p.parent) else Path(".")
    if not parent.is_dir():
        raise InputError(f"{flag} {path}: directory {parent} does not exist; create it first")
    if p.is_dir() or not os.access(parent, os.W_OK) or (p.exists() and not os.access(p, os.W_OK)):
        raise InputError(f"{flag} {path}: cannot write there; choose a writable file path")
    return p


def _save(fig: Any, path: str | Path) -> None:
    """The picture through the one atomic writer (``planner.paths.atomic_open``)."""
    from megatron_hsp.planner.paths import atomic_open

    with atomic_open(path, "wb", flag="--plot") as fh:
        fig.savefig(fh, format="png", dpi=120)


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise InputError(
            "--plot needs matplotlib; install it (pip install 'megatron-hsp[plot]') or drop --plot"
        ) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_plan(plan: Plan, path: Path, tokens_per_rank: int) -> None:
    """Gantt of one step: x = time, y = ranks; one box per group per micro-batch.

    Each box spans the group's ranks and its estimated time inside its micro-batch (micro-batches
    run one after another, so the box starts where the previous micro-batch ended); its label gives
    the number of sequences and its memory use (tokens / capacity). The lower bound is a line.
    """
    plt = _pyplot()
    from matplotlib import colormaps

    fig, ax = plt.subplots(figsize=(12, 6))
    cmap = colormaps["viridis"]
    sizes = sorted(plan.group_sizes_used) or [1]
    t0 = 0.0
    for i, mb in enumerate(plan.microbatches):
        for g in mb.groups:
            if not g.seq_ids:
                continue
            color = cmap(sizes.index(g.size) / max(1, len(sizes) - 1))
            mem = g.tokens / (tokens_per_rank * g.size)
            ax.barh(
                g.ranks[0] + g.size / 2,
                g.est_ms / 1e3,
                left=t0 / 1e3,
                height=g.size * 0.92,
                color=color,
                edgecolor="black",
                linewidth=0.3,
            )
            if g.size >= max(1, plan.world_size // 32) and g.est_ms > 0.02 * plan.est_step_ms:
                ax.text(
                    (t0 + g.est_ms / 2) / 1e3,
                    g.ranks[0] + g.size / 2,
                    f"{len(g.seq_ids)}s {mem:.0%}",
                    ha="center",
                    va="center",
                    fontsize=6,
                )
        t0 += mb.est_ms
        ax.axvline(t0 / 1e3, color="grey", linewidth=0.5, linestyle=":")
        if i < 40:
            ax.text((t0 - mb.est_ms / 2) / 1e3, plan.world_size * 1.01, str(i), fontsize=6)
    if plan.lower_bound_ms:
        ax.axvline(plan.lower_bound_ms / 1e3, color="red", linewidth=1.5, label="lower bound")
    handles = [
        plt.Rectangle((0, 0), 1, 1, color=cmap(k / max(1, len(sizes) - 1)))
        for k in range(len(sizes))
    ]
    labels = [f"group of {s}" for s in sizes]
    if plan.lower_bound_ms:
        handles.append(plt.Line2D([0], [0], color="red"))
        labels.append(f"lower bound {plan.lower_bound_ms / 1e3:.2f} s")
    ax.legend(handles, labels, loc="upper right", fontsize=7)
    ax.set_xlabel("time in step (s, estimated); dotted lines end micro-batches (numbered on top)")
    ax.set_ylabel("rank")
    ax.set_ylim(0, plan.world_size * 1.05)
    ax.invert_yaxis()
    ax.set_title(
        f"{plan.solver}: {len(plan.microbatches)} micro-batches, step "
        f"{plan.est_step_ms / 1e3:.2f} s on {plan.world_size} GPUs ({plan.cost_model}); "
        "labels: sequences, memory used"
    )
    fig.tight_layout()
    _save(fig, path)
    plt.close(fig)


def plot_bench(
    result: Mapping[str, Any],
    lengths: Sequence[np.ndarray],
    hsp_plans: Sequence[Plan] | None,
    path: Path,
) -> None:
    """Step time per method over the run, and the length histogram with hsp's group sizes."""
    plt = _pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5))
    for name, res in result["methods"].items():
        steps = [np.nan if x is None else x / 1e3 for x in res["step_ms"]]
        style = "--" if name == "lower-bound" else "-"
        left.plot(range(len(steps)), steps, style, marker=".", label=name)
    left.set_xlabel("batch (step of the run)")
    left.set_ylabel("estimated step time (s)")
    left.set_title("step time per method")
    left.legend(fontsize=7)
    all_lens = np.concatenate([np.asarray(b) for b in lengths])
    bins = np.logspace(np.log10(max(1, all_lens.min())), np.log10(all_lens.max() + 1), 40)
    if hsp_plans:
        by_size: dict[int, list[int]] = {}
        for plan in hsp_plans:
            for mb in plan.microbatches:
                for g in mb.groups:
                    by_size.setdefault(g.size, []).extend(g.lengths)
        sizes = sorted(s for s in by_size if by_size[s])
        right.hist(
            [by_size[s] for s in sizes],
            bins=bins,
            stacked=True,
            label=[f"hsp group of {s}" for s in sizes],
        )
        right.legend(fontsize=7)
    else:
        right.hist(all_lens, bins=bins)
    right.set_xscale("log")
    right.set_yscale("log")
    right.set_xlabel("sequence length (tokens)")
    right.set_ylabel("sequences")
    right.set_title("length histogram, coloured by the group size hsp chose")
    fig.tight_layout()
    _save(fig, path)
    plt.close(fig)


def plot_demo(result: Mapping[str, Any], path: Path) -> None:
    """The demo's loss curve, and adaptive vs static groups on the same batches (measured and
    predicted step time), side by side."""
    plt = _pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5))
    steps = result["steps"]
    left.plot([s["step"] for s in steps], [s["loss"] for s in steps], marker=".")
    left.set_xlabel("step")
    left.set_ylabel("loss (per token, whole global batch)")
    left.set_title(f"demo loss on {result.get('config', {}).get('nproc', '?')} ranks")
    comp = result.get("comparison") or {}
    rows = comp.get("batches") or []
    static = f"static-{comp['static_degree']}" if comp.get("static_degree") else None
    if rows:
        x = np.arange(len(rows))
        names = ["adaptive"] + ([static] if static else [])
        width = 0.8 / len(names)
        for i, name in enumerate(names):
            measured = [r[name]["measured_s"] for r in rows]
            predicted = [r[name]["predicted_ms"] / 1e3 for r in rows]
            right.bar(x + i * width, measured, width, label=f"{name} measured")
            right.plot(x + i * width, predicted, "k_", markersize=14, label=f"{name} predicted")
        right.set_xticks(x + width * (len(names) - 1) / 2, [str(r["step"]) for r in rows])
        right.set_xlabel("step (same batch for every method)")
        right.set_ylabel("step time (s)")
        title = "adaptive vs static groups"
        if static and comp.get("speedup_measured"):
            title += f": measured {comp['speedup_measured']:.2f}x over {static}"
        right.set_title(title)
        right.legend(fontsize=7)
    else:
        right.text(0.5, 0.5, "no comparison steps (--compare-steps 0)", ha="center")
        right.set_axis_off()
    fig.tight_layout()
    _save(fig, path)
    plt.close(fig)
