"""The driver: every run (option set, steps, plant) in one spawn of gloo CPU ranks, each rank
running the HSP side then the stock side and comparing them (``_worker``); the entries of
``selftest --json`` (``run_megatron_loop``, ``run_megatron_plants``) and its table."""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
from collections.abc import Sequence
from typing import Any

from megatron_hsp.planner.paths import atomic_write
from megatron_hsp.testing.megatron_loop.checks import (
    _data_checks,
    _worst,
    check,
    check_data,
    format_margin,
    margin,
    megatron_schedule,
    per_param_diff,
    worst_check,
)
from megatron_hsp.testing.megatron_loop.corpus import BLEND_CHOICES, write_corpus
from megatron_hsp.testing.megatron_loop.hsp_side import _run_hsp, plan_log_path
from megatron_hsp.testing.megatron_loop.models import _initial_weights, stock_builder
from megatron_hsp.testing.megatron_loop.options import (
    DEFAULT_OPTIONS,
    STEPS,
    LoopOptions,
    switches,
    test_only_switches_text,
)
from megatron_hsp.testing.megatron_loop.plants import PLANT_RUNS, PLANTED, PLANTS
from megatron_hsp.testing.megatron_loop.stock_side import _run_stock


def run_megatron_plants(
    nproc: int = 4, timeout_s: float = 900.0, plants: Sequence[str] | None = None
) -> list[dict[str, Any]]:
    """Each plant of ``PLANTS`` on its option set (``PLANT_RUNS``), all in one spawn: one entry
    per plant with ``caught`` (the loop's comparison failed, as it must), its worst check and
    margin (``margins``) and the first failures it gave."""
    by_label = {o.label: o for o in DEFAULT_OPTIONS}
    names = list(PLANT_RUNS if plants is None else plants)
    runs = [(by_label[PLANT_RUNS[p][0]], PLANT_RUNS[p][1], p) for p in names]
    out = []
    for plant, entry in zip(names, _run_loops(nproc, runs, timeout_s), strict=True):
        label, steps = PLANT_RUNS[plant]
        out.append(
            {
                "plant": plant,
                "options": label,
                "steps": steps,
                "caught": not entry["ok"],
                "margin": entry["margin"],
                "worst_check": entry["worst_check"],
                "failures": entry["failures"][:3],
                "entry": entry,
            }
        )
    return out


def _worker_all(
    rank: int,
    world_size: int,
    prefixes: tuple[str, ...],
    runs: tuple[tuple[LoopOptions, str, int, str | None], ...],
) -> list[dict[str, Any]]:
    """Every run (option set, cost model file, steps, plant) in turn, in this rank's process
    (Megatron's globals are reset each time; megatron's parallel state is re-initialised for
    each option set's TP size; a plant is undone when its run ends)."""
    from megatron_hsp.testing.dist import init_cpu_megatron

    out = []
    for options, cost_path, steps, plant in runs:
        init_cpu_megatron(
            rank,
            world_size,
            "",
            tensor_model_parallel_size=options.tp,
            gloo_process_groups=options.resume,  # Megatron's legacy checkpoint uses them
            expert_model_parallel_size=options.ep,
        )
        out.append(_worker(rank, world_size, prefixes, cost_path, options, steps, plant))
    return out


def _worker(
    rank: int,
    world_size: int,
    prefixes: tuple[str, ...],
    cost_path: str,
    options: LoopOptions,
    steps: int,
    plant: str | None,
) -> dict[str, Any]:
    """Both runs on this rank; returns per-step comparisons (max-reduced over ranks)."""
    from megatron_hsp.testing.cpu_shims import cpu_device_arch_version, cpu_megatron_training
    from megatron_hsp.testing.dist import report_progress

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    os.environ["LOCAL_WORLD_SIZE"] = str(world_size)
    if options.tp > 1:
        # What Megatron's validate_args requires of a tensor-parallel user on pre-Blackwell GPUs
        # (and asks of every CPU run, whose "device arch" reads as 0).
        os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"
    PLANTED.clear()
    # Megatron prints its argument table and HSP its step lines on stdout: keep stdout for the
    # parent's report (``selftest --json``) and send them to stderr.
    with (
        contextlib.redirect_stdout(sys.stderr),
        cpu_megatron_training(),
        cpu_device_arch_version(),
    ):
        stock_init = _initial_weights(options)
        with _pipeline_state(rank, world_size, options):
            hsp = _run_hsp(options, prefixes, cost_path, world_size, steps, stock_init, plant)
        report_progress()  # each half of each option set moves the test's hang timeout on
        ref = _run_stock(options, prefixes, hsp["pieces"], stock_init, hsp["evaluations"])
        report_progress()
        expected = megatron_schedule(ref["args"], steps)
    data = _data_checks(options, hsp, ref)
    out = []
    smallest = None
    # The first piece each step's successor drew (the token budget's rule: it would cross it).
    following = [*hsp["pieces"][1:], *hsp["train_next"]]
    for i in range(steps):
        h, r, m = hsp["records"][i], ref["records"][i], expected[i]
        rel, peak = per_param_diff(hsp["grads"][i], ref["grads"][i], ref["grads"][i])
        worst, worst_rel = _worst(rel)
        top = max(peak.values())
        # What a single ratio over all buffers (an earlier version of this loop) would report.
        pooled = max(rel[n] * peak[n] for n in rel) / top
        small = min((n for n in peak if peak[n] > 0), key=lambda n: peak[n])
        smallest = smallest or small
        out.append(
            {
                "step": i,
                "loss_hsp": h["loss"],
                "loss_ref": r["loss"],
                "lr_hsp": h["lr"],
                "lr_ref": r["lr"],
                "lr_megatron": m["lr"],
                "consumed_samples_hsp": h["consumed_samples"],
                "consumed_samples_ref": r["consumed_samples"],
                "consumed_samples_megatron": m["consumed_samples"],
                "documents_hsp": h["documents"],
                "tokens_hsp": h["tokens"],
                "token_budget": h["token_budget"],
                "next_document_tokens": following[i][0][2] if following[i] else None,
                "refit_on": h["refit_on"],
                # Accepted refit updates before the step was planned (rank 0's): > 0, the plan
                # was priced by a model refit from this machine's timings.
                "refit_updates_before": h["refit_updates_before"],
                "fingerprint": h["fingerprint"],
                "plan_method": h["plan_method"],
                "samples_megatron": m["samples"],
                "grad_norm_hsp": h["grad_norm"],
                "grad_norm_ref": r["grad_norm"],
                "max_rel_grad_diff": worst_rel,
                "pooled_rel_grad_diff": pooled,
                "worst_grad_param": worst,
                "smallest_grad_param": small,
                "smallest_grad_ratio": peak[small] / top,
                "rel_grad_diff_of_smallest": rel[small],
                "plan_microbatches": h["plan_microbatches"],
                "schedule_microbatches": h["schedule_microbatches"],
                "empty_groups": h["empty_groups"],
                "layouts": h["layouts"],
            }
        )
    update = {n: ref["weights"][n] - stock_init[n] for n in ref["weights"]}
    wrel, _ = per_param_diff(hsp["weights"], ref["weights"], update)
    wname, wworst = _worst(wrel)
    return {
        "steps": out,
        **data,
        "max_rel_weight_diff_after": wworst,
        "worst_weight_param": wname,
        "planted_param": PLANTED.get("param"),
        "stock_builder": stock_builder()[1],  # which of Megatron's builders built the stock side
        "faults": PLANTED.get("faults"),  # megatron_loop/faults.py
        "pipeline": hsp["pipeline"],
        "moe": hsp["moe"],
        # Expert parameters compared per parameter (each rank's own experts; 0 when dense).
        "expert_params_compared": sum(".experts." in n for n in wrel),
        "max_length": hsp["max_length"],
        # Trained pieces that start inside their document: the later pieces of overlong
        # documents the default --hsp-overlong split cut.
        "split_pieces": sum(p[1] > 0 for b in hsp["pieces"] for p in b),
    }


@contextlib.contextmanager
def _pipeline_state(rank: int, world_size: int, options: LoopOptions):
    """Megatron's parallel state with ``options``' pipeline for the HSP side, the unpipelined
    one (the stock reference's) again on exit. Why the stock side runs without a pipeline: it
    is then the plain model on the same documents, sharing none of the schedule's stage
    machinery (p2p, shape handshake, last-stage loss) with the HSP side, so an error at a stage
    boundary cannot hide in a reference that makes it too."""
    from megatron_hsp.testing.dist import init_cpu_megatron

    if options.pp == 1:
        yield
        return
    init_cpu_megatron(
        rank,
        world_size,
        "",
        tensor_model_parallel_size=options.tp,
        pipeline_model_parallel_size=options.pp,
        virtual_pipeline_model_parallel_size=options.vpp,
    )
    yield
    # Not on an exception: re-initialising is collective, and a rank that raised would wait
    # there for ranks still inside the run instead of reporting its error.
    init_cpu_megatron(rank, world_size, "", tensor_model_parallel_size=options.tp)


def run_megatron_loop(
    nproc: int = 4,
    options: Sequence[LoopOptions] = DEFAULT_OPTIONS,
    steps: int = STEPS,
    timeout_s: float = 600.0,
    plant: str | None = None,
) -> list[dict[str, Any]]:
    """The ``megatron_loop`` entries of ``selftest --json``: one per option set.

    ``plant`` names a bug from ``PLANTS`` to plant on the HSP side (tests: it must be caught).
    """
    return _run_loops(nproc, [(o, steps, plant) for o in options], timeout_s)


def _run_loops(
    nproc: int, runs: Sequence[tuple[LoopOptions, int, str | None]], timeout_s: float
) -> list[dict[str, Any]]:
    """Each (option set, steps, plant) of ``runs``, all in one spawn of ``nproc`` processes."""
    from megatron_hsp.testing.megatron_loop.faults import FAULTS

    for _, _, plant in runs:  # faults go through the plant seam but must pass
        if plant is not None and plant not in PLANTS and plant not in FAULTS:
            raise ValueError(f"unknown plant {plant!r}; known: {sorted(PLANTS)}")
    from megatron_hsp.testing.dist import raise_rank_errors, run_distributed

    results = []
    with tempfile.TemporaryDirectory(prefix="hsp_mloop_") as tmp:
        prefix = os.path.join(tmp, "docs")
        write_corpus(prefix)
        # The blend's second dataset: half as many documents, longer ones.
        write_corpus(prefix + "-b", num_docs=32, seed=11, choices=BLEND_CHOICES)
        prefixes = (prefix, prefix + "-b")
        spawned = []
        for i, (opt, steps, plant) in enumerate(runs):
            cost_path = f"{prefix}.cost-{i}.json"
            atomic_write(cost_path, json.dumps(opt.cost_model()))
            spawned.append((opt, cost_path, steps, plant))
        # One spawn for all runs: starting 4 processes that import torch and Megatron is most
        # of the cost on a small machine.
        per_rank = raise_rank_errors(
            run_distributed(_worker_all, nproc, prefixes, tuple(spawned), timeout_s=timeout_s)
        )
        for (opt, cost_path, _, _), result in zip(spawned, per_rank[0], strict=True):
            entry = {"options": opt.as_dict(), "test_only_switches": switches(opt), **result}
            if opt.plan_log:  # the rows the last rank's observer wrote (the dir goes away)
                log = plan_log_path(cost_path)
                with open(log) as fh:
                    entry["plan_log"] = [json.loads(line) for line in fh if line.strip()]
            entry["failures"] = check(entry["steps"], entry["max_rel_weight_diff_after"])
            entry["failures"] += check_data(entry)
            entry["ok"] = not entry["failures"]
            entry["margin"] = margin(entry)
            entry["worst_check"] = worst_check(entry)
            results.append(entry)
    return results


def loop_table(entries: Sequence[dict[str, Any]]) -> str:
    """Human-readable ``selftest --megatron`` report: one line per option set and step."""
    lines = [
        "HSP side: the users' defaults (online refit on, default overlong policy) except for "
        "these test-only switches:",
        test_only_switches_text(),
        *[
            f"stock side: the model {b} builds"
            for b in sorted({e["stock_builder"] for e in entries})
        ],
        f"{'options':<22} {'step':>4} {'loss hsp':>11} {'loss ref':>11} {'lr':>9} "
        f"{'samples':>11} {'grad rel':>8} {'layouts (size=ulysses x ring)'}",
    ]
    for e in entries:
        name = _label(e["options"])
        for s in e["steps"]:
            layouts = " | ".join(
                " ".join(
                    f"{g['size']}" + (f"={g['ulysses']}x{g['ring']}" if g["ring"] > 1 else "")
                    for g in mb
                )
                for mb in s["layouts"]
            )
            lr_ok = s["lr_hsp"] == s["lr_ref"] == s["lr_megatron"]
            lines.append(
                f"{name:<22} {s['step']:>4} {s['loss_hsp']:>11.7f} {s['loss_ref']:>11.7f} "
                f"{s['lr_hsp']:>9.2e}{' ' if lr_ok else '!'}"
                f"{s['consumed_samples_hsp']:>3}/{s['consumed_samples_ref']}/"
                f"{s['consumed_samples_megatron']:<3} "
                f"{s['max_rel_grad_diff']:>8.1e} {layouts}"
            )
        lines.append(
            f"{name:<22} weights after: {e['max_rel_weight_diff_after']:.1e} "
            f"({e['worst_weight_param']}); worst / tolerance {format_margin(e['margin'])} "
            f"({e['worst_check']}); {_refit_note(e['steps'])}"
        )
        for ev in e.get("evaluations", []):
            lines.append(
                f"{name:<22} {ev['split']} evaluation after step {ev['after_step']}: loss "
                f"{ev['loss_hsp']:.7f} / {ev['loss_ref']:.7f}, consumed valid samples "
                f"{ev['consumed_valid_samples_hsp']}/{ev['consumed_valid_samples_ref']}/"
                f"{ev['consumed_valid_samples_megatron']}"
            )
        if e.get("blend"):
            b = e["blend"]
            lines.append(
                f"{name:<22} blend: token shares "
                + " / ".join(f"{x:.3f}" for x in b["token_shares"])
                + " for weights "
                + " / ".join(f"{x:g}" for x in b["weights"])
                + f" ({b['worst_deviation_in_documents']:.2f} documents off, "
                f"{b['worst_over_bound']:.2f} of the deficit rule's bound)"
            )
        if e.get("resume"):
            r = e["resume"]
            lines.append(
                f"{name:<22} resume through Megatron's checkpoint (--ckpt-format {r['format']}): "
                + ", ".join(
                    f"{k} {v[0]}/{v[1]}" for k, v in r.items() if k not in ("format", "refusal")
                )
            )
        lines.extend(f"  FAIL {name}: {f}" for f in e["failures"])
    return "\n".join(lines)


def _refit_note(steps: Sequence[dict[str, Any]]) -> str:
    """Whether the online refit ran, and how many steps a refit model planned."""
    if not all(s.get("refit_on") for s in steps):
        return "refit off (pipeline)"
    refit = sum(bool(s.get("refit_updates_before")) for s in steps)
    return f"refit on, {refit} of {len(steps)} steps planned by a refit model"


def _label(options: dict[str, Any]) -> str:
    known = {f: options[f] for f in LoopOptions.__dataclass_fields__ if f in options}
    if known.get("group_sizes") is not None:
        known["group_sizes"] = tuple(known["group_sizes"])
    return LoopOptions(**known).label
