"""``megatron-hsp profile``: measure this machine and write a fitted cost-model YAML.

Measures, on the backend this process gets (gloo/CPU here, NCCL/GPU where CUDA is present, same
code): forward+backward time of a megatron-core ``GPTModel`` of the given shape on packed (THD)
batches against tokens, tokens^2, sequences per batch and a fixed cost; all-to-all time per group
size and message size on ``--nproc`` processes; then fits the planner's cost model
(``megatron_hsp.planner.cost.fit``) and writes the explicit-coefficients YAML that every
``--cost-model`` flag accepts. Fits that are not positive and monotone are refused (exit 2).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from megatron_hsp.planner.paths import atomic_write


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from megatron_hsp.commands.demo_config import DEMO_MODEL
    from megatron_hsp.step.corpus import DEMO_VOCAB_SIZE

    parser.add_argument("--out", metavar="FILE.yaml", required=True, help="cost model to write")
    parser.add_argument("--force", action="store_true", help="overwrite --out if the file exists")
    # Defaults: the demo's model, so `profile` then `demo --cost-model` measures what runs.
    parser.add_argument("--layers", type=int, default=DEMO_MODEL["num_layers"])
    parser.add_argument("--hidden", type=int, default=DEMO_MODEL["hidden_size"])
    parser.add_argument("--heads", type=int, default=DEMO_MODEL["num_attention_heads"])
    parser.add_argument("--kv-heads", type=int, default=DEMO_MODEL["num_query_groups"])
    parser.add_argument("--vocab", type=int, default=DEMO_VOCAB_SIZE)
    parser.add_argument(
        "--max-tokens", type=int, default=4096, help="longest packed batch to time (tokens)"
    )
    parser.add_argument("--points", type=int, default=8, help="batch lengths to time")
    parser.add_argument(
        "--repeats", type=int, default=5, help="timed rounds per point (median; default 5)"
    )
    parser.add_argument(
        "--nproc",
        type=int,
        default=4,
        help="processes measuring at once, one thread each, like the demo's ranks (>= 2; "
        "default 4, the demo's)",
    )
    parser.add_argument(
        "--tokens-per-rank",
        type=int,
        default=1024,
        help="activation capacity per rank to write (the memory cap the planner enforces)",
    )
    parser.add_argument("--name", default="profiled", help="name stored in the YAML")


def _bar(label: str) -> Callable[[int, int], None]:
    def show(done: int, total: int) -> None:
        filled = int(30 * done / total)
        end = "\n" if done == total else ""
        print(f"\r{label} [{'#' * filled}{'.' * (30 - filled)}] {done}/{total}", end=end,
              file=sys.stderr, flush=True)  # fmt: skip

    return show


def _batches(max_tokens: int, points: int) -> list[list[int]]:
    """Single sequences (tokens against tokens^2) and the same token counts as 4 and 16
    sequences (the per-sequence cost), the packed shapes a demo micro-batch has."""
    lengths = np.unique(np.geomspace(64, max_tokens, points).astype(int))
    batches: list[list[int]] = [[int(n)] for n in lengths]
    for n in lengths[len(lengths) // 2 :]:
        for k in (4, 16):
            if n // k >= 16:
                batches.append([int(n) // k] * k)
    return batches


def _step_batches(max_tokens: int) -> list[list[int]]:
    """Batches for the in-situ group steps: one, and four, sequences at three token counts
    (the upper range, where a step's communication is measurable above its noise)."""
    out: list[list[int]] = []
    for n in (max_tokens // 4, max_tokens // 2, max_tokens):
        out.append([n])
        if n >= 1024:
            out.append([n // 4] * 4)
    return out


def _profile_worker(rank: int, world_size: int, cfg: dict) -> dict | None:
    """One measuring rank (spawned, gloo/CPU or NCCL/GPU, one thread like the demo's ranks)."""
    import torch

    from megatron_hsp.runtime import profile as prof
    from megatron_hsp.runtime.groups import create_groups
    from megatron_hsp.testing.dist import tiny_gpt_model

    device = prof._device()
    model = tiny_gpt_model(
        num_layers=cfg["layers"],
        hidden_size=cfg["hidden"],
        num_attention_heads=cfg["heads"],
        num_query_groups=cfg["kv_heads"],
        vocab_size=cfg["vocab"],
        max_sequence_length=cfg["max_tokens"],
    ).to(device)
    group = prof.own_group()
    compute = prof.measure_compute_concurrent(
        model,
        cfg["batches"],
        vocab=cfg["vocab"],
        group=group,
        device=device,
        repeats=cfg["repeats"],
        progress=_bar("compute") if rank == 0 else None,
    )
    act = [
        (
            n,
            prof.measure_activation_bytes(
                model, [n], vocab=cfg["vocab"], group=group, device=device
            ),
        )
        for n in (cfg["max_tokens"] // 4, cfg["max_tokens"] // 2, cfg["max_tokens"])
    ]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    step_ms = prof.measure_step_overhead(model, optimizer, device, cfg["repeats"])
    if rank == 0:
        print("all-to-all and ring steps ...", file=sys.stderr, flush=True)
    a2a = prof.measure_all_to_all(
        rank, world_size, cfg["msg_tokens"], cfg["a2a_bytes"], cfg["comm_repeats"]
    )
    ring = prof.measure_ring_step(
        rank, world_size, cfg["msg_tokens"], cfg["ring_bytes"], cfg["comm_repeats"]
    )
    registry = create_groups(world_size, sizes=[1, *(d for d in a2a if d <= world_size)])
    steps = prof.measure_group_steps(
        model,
        registry,
        cfg["step_batches"],
        vocab=cfg["vocab"],
        device=device,
        repeats=cfg["step_repeats"],
        progress=_bar("ulysses groups in situ") if rank == 0 else None,
    )
    if rank != 0:
        return None
    return {
        "compute": compute,
        "act": act,
        "step_ms": step_ms,
        "a2a": a2a,
        "ring": ring,
        "steps": steps,
    }


def _fit_comm(
    rows: list[tuple[int, float]], per_token_scale: float, latency_scale: float, what: str
) -> Any:
    """Fit ``ms = latency + per_token * tokens`` and scale to one training step's calls."""
    from megatron_hsp.planner.cost.fit import fit_linear

    tokens = [t for t, _ in rows]
    f = fit_linear(
        {"ms_per_token": tokens, "latency_ms": [1.0] * len(tokens)},
        [ms for _, ms in rows],
        required=("ms_per_token",),
        what=what,
        relative=False,
    )
    c = f.as_dict()
    return type(f)(
        f.names,
        (c["ms_per_token"] * per_token_scale, c["latency_ms"] * latency_scale),
        f.r2,
        f.median_rel_err,
        f.max_rel_err,
        f.samples,
    )


def _check(args: argparse.Namespace) -> Path:
    from megatron_hsp.planner.errors import InputError

    out = Path(args.out)
    if out.suffix not in (".yaml", ".yml"):
        raise InputError(f"--out {args.out}: the cost model is YAML; give a .yaml file name")
    from megatron_hsp.planner.paths import check_output_path

    check_output_path("--out", args.out, overwrite=args.force)
    for flag, v, lo in (
        ("--points", args.points, 4),
        ("--repeats", args.repeats, 1),
        ("--nproc", args.nproc, 2),
        ("--max-tokens", args.max_tokens, 256),
        ("--tokens-per-rank", args.tokens_per_rank, 1),
        ("--layers", args.layers, 1),
        ("--hidden", args.hidden, 1),
        ("--heads", args.heads, 1),
        ("--kv-heads", args.kv_heads, 1),
        ("--vocab", args.vocab, 1),
    ):
        if v < lo:
            raise InputError(f"{flag} must be >= {lo}, got {v}")
    if args.hidden % args.heads or args.heads % args.kv_heads:
        raise InputError("--hidden must divide by --heads and --heads by --kv-heads")
    return out


def run(args: argparse.Namespace) -> int:
    out = _check(args)
    import torch
    import yaml

    from megatron_hsp.planner.cost.costmodel import load_cost_model
    from megatron_hsp.planner.cost.fit import (
        check_monotone,
        cost_model_spec,
        fit_compute,
        fit_latency,
        fit_linear,
        in_situ_overhead_rows,
    )
    from megatron_hsp.testing.dist import raise_rank_errors, run_distributed

    t_start = time.perf_counter()
    kv = args.hidden // args.heads * args.kv_heads
    cfg = {
        "layers": args.layers,
        "hidden": args.hidden,
        "heads": args.heads,
        "kv_heads": args.kv_heads,
        "vocab": args.vocab,
        "max_tokens": args.max_tokens,
        "repeats": args.repeats,
        "batches": _batches(args.max_tokens, args.points),
        # messages are cheap next to compute: a wider range and more repeats steady the slope
        "msg_tokens": [int(x) for x in np.geomspace(1024, max(65536, args.max_tokens * 16), 5)],
        "comm_repeats": 2 * args.repeats + 1,
        "a2a_bytes": 4 * args.hidden,  # one fp32 hidden vector per token
        "ring_bytes": 4 * 2 * kv,  # one layer's fp32 K and V per token
        "step_batches": _step_batches(args.max_tokens),
        "step_repeats": max(3, (args.repeats + 1) // 2),
    }
    print(
        f"profile: {args.nproc} processes, 1 thread each, {len(cfg['batches'])} batches x "
        f"{args.repeats} rounds (+2 warm-up)",
        file=sys.stderr,
        flush=True,
    )
    from megatron_hsp.commands.common import QUIET_CHILD_ENV

    for key, value in QUIET_CHILD_ENV.items():  # Megatron's import-time warnings, once per process
        os.environ.setdefault(key, value)
    try:
        results = raise_rank_errors(
            run_distributed(_profile_worker, args.nproc, cfg, timeout_s=3600.0)
        )
    except TimeoutError as exc:  # a stopped or wedged rank: every rank was stopped (dist.py)
        from megatron_hsp.planner.errors import HSPError

        first = str(exc).split("; rank ")[0].splitlines()[0]
        raise HSPError(f"{first}; every measuring rank was stopped") from None
    res = results[0]
    samples = res["compute"]
    # Measured, not fitted: a longer single sequence timed more than 10% faster than a shorter
    # one means the machine's noise exceeds the signal, and no fit of such points can rank
    # schedules (within 10%: short sequences whose times the fixed cost dominates).
    check_monotone(
        {s.lengths[0]: s.ms for s in samples if len(s.lengths) == 1},
        "measured forward+backward ms against sequence length",
        tolerance=0.1,
    )
    compute = fit_compute((s.lengths, s.ms) for s in samples)
    # Ulysses moves q,k,v (one call) and o per layer forward, the same backward: 4 calls per
    # layer; per-token traffic in hidden-vector units (GQA-aware).
    calls = 2 * args.layers * (2 * args.hidden + 2 * kv) / args.hidden
    a2a_bench = {
        d: _fit_comm(rows, calls, 4 * args.layers, f"the all-to-all fit (d={d})")
        for d, rows in sorted(res["a2a"].items())
    }
    # What a Ulysses group costs beyond its compute share and the bare all-to-all, measured in
    # situ (runtime.profile.measure_group_steps says why): the per-token slope stays the
    # microbenchmark's (the in-situ residuals carry the compute fit's own error, tens of ms at
    # 4096 tokens, too much for a slope), the per-micro-batch latency becomes the median of
    # what the in-situ steps add beyond compute share + slope, where that is larger.
    co = compute.as_dict()
    rows_in_situ = in_situ_overhead_rows(
        ((s.size, s.lengths, s.ms) for s in res["steps"]),
        co["attn_ms_per_token2"],
        co["linear_ms_per_token"],
    )
    a2a = dict(a2a_bench)
    for d, rows in sorted(rows_in_situ.items()):
        if d in a2a_bench:
            in_situ = fit_latency(rows, a2a_bench[d].as_dict()["ms_per_token"])
            if in_situ.as_dict()["latency_ms"] > a2a_bench[d].as_dict()["latency_ms"]:
                a2a[d] = in_situ
    ring = {
        d: _fit_comm(rows, 3 * args.layers, 2 * args.layers, f"the ring step fit (d={d})")
        for d, rows in sorted(res["ring"].items())
    }
    act = res["act"]
    act_fit = fit_linear(
        {"bytes_per_token": [n for n, _ in act], "bytes_fixed": [1.0] * len(act)},
        [b for _, b in act],
        required=("bytes_per_token",),
        what="the activation memory fit",
    )
    backend = "nccl/" + torch.cuda.get_device_name() if torch.cuda.is_available() else "gloo/cpu"
    spec = cost_model_spec(
        args.name,
        compute,
        a2a,
        args.tokens_per_rank,
        ring=ring,
        source=f"megatron-hsp profile {time.strftime('%Y-%m-%d', time.gmtime())} on {backend}, "
        f"{args.nproc} ranks x 1 thread, model layers={args.layers} hidden={args.hidden} "
        f"heads={args.heads}/{args.kv_heads} vocab={args.vocab}",
        details={
            **{
                f"a2a_microbench_{k}_d{d}": v
                for d, f in a2a_bench.items()
                for k, v in f.as_dict().items()
            },
            "seq_ms": compute.as_dict()["seq_ms"],
            "step_ms": res["step_ms"],
            "act_mib_per_token": act_fit.as_dict()["bytes_per_token"] / 2**20,
        },
    )
    load_cost_model(spec, world_size=args.nproc)  # refuses anything the planner cannot use
    atomic_write(out, yaml.safe_dump(spec, sort_keys=False), flag="--out")
    print(f"{'fit':<16} {'samples':>7} {'R^2':>7} {'median err':>10} {'max err':>8}  coefficients")
    fits = [
        ("compute", compute),
        *((f"a2a d={d}", f) for d, f in a2a_bench.items()),
        *((f"a2a d={d} in situ", a2a[d]) for d in a2a if a2a[d] is not a2a_bench[d]),
        *((f"ring d={d}", f) for d, f in ring.items()),
        ("activation", act_fit),
    ]
    for label, f in fits:
        co = ", ".join(f"{k}={v:.4g}" for k, v in f.as_dict().items())
        print(
            f"{label:<16} {f.samples:>7} {f.r2:>7.3f} {f.median_rel_err:>10.1%} "
            f"{f.max_rel_err:>8.1%}  {co}"
        )
    mib = act_fit.as_dict()["bytes_per_token"] / 2**20
    how = "CUDA peak" if torch.cuda.is_available() else "autograd saved tensors, CPU"
    print(
        "per step (gradient all-reduce + optimizer; added to step predictions, not to plans): "
        f"{res['step_ms']:.3g} ms; activation memory {mib:.4g} MiB/token ({how})"
    )
    print(f"profile: wrote {out} in {time.perf_counter() - t_start:.0f} s", file=sys.stderr)
    return 0
