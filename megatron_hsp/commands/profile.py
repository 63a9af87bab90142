"""``megatron-hsp profile``: measure this machine and write a fitted cost-model YAML.

Measures, on the backend this process gets (gloo/CPU here, NCCL/GPU where CUDA is present, same
code): forward+backward time of a megatron-core ``GPTModel`` of the given shape on packed (THD)
batches against tokens, tokens^2, sequences per batch and a fixed cost; all-to-all time per group
size and message size on ``--nproc`` processes; then fits the planner's cost model
(``megatron_hsp.planner.fit``) and writes the explicit-coefficients YAML that every
``--cost-model`` flag accepts. Fits that are not positive and monotone are refused (exit 2).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", metavar="FILE.yaml", required=True, help="cost model to write")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument(
        "--max-tokens", type=int, default=4096, help="longest packed batch to time (tokens)"
    )
    parser.add_argument("--points", type=int, default=8, help="batch lengths to time")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per point (median)")
    parser.add_argument(
        "--nproc", type=int, default=2, help="processes for the all-to-all measurement (>= 2)"
    )
    parser.add_argument(
        "--tokens-per-rank",
        type=int,
        default=1024,
        help="activation capacity per rank to write (the memory cap the planner enforces)",
    )
    parser.add_argument("--name", default="profiled", help="name stored in the YAML")


def _bar(label: str) -> object:
    def show(done: int, total: int) -> None:
        filled = int(30 * done / total)
        end = "\n" if done == total else ""
        print(f"\r{label} [{'#' * filled}{'.' * (30 - filled)}] {done}/{total}", end=end,
              file=sys.stderr, flush=True)  # fmt: skip

    return show


def _a2a_worker(rank: int, world_size: int, tokens: list[int], bpt: int, repeats: int) -> dict:
    from megatron_hsp.runtime.profile import measure_all_to_all

    return measure_all_to_all(rank, world_size, tokens, bpt, repeats)


def _check(args: argparse.Namespace) -> Path:
    from megatron_hsp.planner.errors import InputError

    out = Path(args.out)
    if out.suffix not in (".yaml", ".yml"):
        raise InputError(f"--out {args.out}: the cost model is YAML; give a .yaml file name")
    if not out.parent.is_dir():
        raise InputError(f"--out {args.out}: directory {out.parent} does not exist")
    for flag, v, lo in (
        ("--points", args.points, 4),
        ("--repeats", args.repeats, 1),
        ("--nproc", args.nproc, 2),
        ("--max-tokens", args.max_tokens, 256),
        ("--tokens-per-rank", args.tokens_per_rank, 1),
    ):
        if v < lo:
            raise InputError(f"{flag} must be >= {lo}, got {v}")
    if args.hidden % args.heads or args.heads % args.kv_heads:
        raise InputError("--hidden must divide by --heads and --heads by --kv-heads")
    return out


def run(args: argparse.Namespace) -> int:
    out = _check(args)
    import torch
    import torch.distributed as dist
    import yaml

    from megatron_hsp.planner.costmodel import load_cost_model
    from megatron_hsp.planner.fit import cost_model_spec, fit_linear
    from megatron_hsp.runtime.profile import measure_compute
    from megatron_hsp.runtime.testing import (
        init_single_process_megatron,
        run_distributed,
        tiny_gpt_model,
    )

    t_start = time.perf_counter()
    init_single_process_megatron()
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    model = tiny_gpt_model(
        num_layers=args.layers,
        hidden_size=args.hidden,
        num_attention_heads=args.heads,
        num_query_groups=args.kv_heads,
        vocab_size=args.vocab,
        max_sequence_length=args.max_tokens,
    ).to(device)
    lengths = np.unique(np.geomspace(128, args.max_tokens, args.points).astype(int))
    batches: list[list[int]] = [[int(n)] for n in lengths]  # one sequence: tokens vs tokens^2
    for n in lengths[len(lengths) // 2 :]:  # same tokens in 4 sequences: per-sequence cost
        batches.append([int(n) // 4] * 4)
    samples = measure_compute(
        model,
        batches,
        vocab=args.vocab,
        group=dist.group.WORLD,
        device=device,
        repeats=args.repeats,
        progress=_bar("compute"),
    )
    s2 = [sum(x * x for x in s.lengths) for s in samples]
    s1 = [sum(s.lengths) for s in samples]
    compute = fit_linear(
        {
            "attn_ms_per_token2": s2,
            "linear_ms_per_token": s1,
            "fixed_ms": [1.0] * len(samples),
            "seq_ms": [len(s.lengths) for s in samples],
        },
        [s.ms for s in samples],
        required=("attn_ms_per_token2", "linear_ms_per_token"),
    )
    kv = args.hidden // args.heads * args.kv_heads
    per_call = 4 * args.hidden  # bytes per token of one fp32 hidden-size message
    calls = 2 * args.layers * (2 * args.hidden + 2 * kv) / args.hidden  # fwd+bwd q,k,v,o
    tokens = [int(x) for x in np.geomspace(256, args.max_tokens * 4, 5)]
    print(f"all-to-all on {args.nproc} processes ...", file=sys.stderr, flush=True)
    results = run_distributed(_a2a_worker, args.nproc, tokens, per_call, args.repeats)
    from megatron_hsp.runtime.testing import raise_rank_errors

    raise_rank_errors(results)
    a2a = {}
    for d in sorted(results[0]):
        rows = [max(r[d][i][1] for r in results) for i in range(len(tokens))]
        f = fit_linear(
            {"ms_per_token": tokens, "latency_ms": [1.0] * len(tokens)},
            rows,
            required=("ms_per_token",),
        )
        c = f.as_dict()
        a2a[d] = type(f)(
            f.names,
            (c["ms_per_token"] * calls, c["latency_ms"] * 4 * args.layers),
            f.r2,
            f.median_rel_err,
            f.max_rel_err,
            f.samples,
        )
    backend = "nccl/" + torch.cuda.get_device_name() if device.type == "cuda" else "gloo/cpu"
    spec = cost_model_spec(
        args.name,
        compute,
        a2a,
        args.tokens_per_rank,
        source=f"megatron-hsp profile {time.strftime('%Y-%m-%d', time.gmtime())} on {backend}, "
        f"model layers={args.layers} hidden={args.hidden} heads={args.heads}/{args.kv_heads}",
    )
    spec["details"] = {"seq_ms": compute.as_dict()["seq_ms"]}
    load_cost_model(spec, world_size=args.nproc)  # refuses anything the planner cannot use
    out.write_text(yaml.safe_dump(spec, sort_keys=False))
    print(f"{'fit':<12} {'samples':>7} {'R^2':>7} {'median err':>10} {'max err':>8}  coefficients")
    for label, f in [("compute", compute), *((f"a2a d={d}", f) for d, f in a2a.items())]:
        co = ", ".join(f"{k}={v:.4g}" for k, v in f.as_dict().items())
        print(
            f"{label:<12} {f.samples:>7} {f.r2:>7.3f} {f.median_rel_err:>10.1%} "
            f"{f.max_rel_err:>8.1%}  {co}"
        )
    print(f"profile: wrote {out} in {time.perf_counter() - t_start:.0f} s", file=sys.stderr)
    return 0
