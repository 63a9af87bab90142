"""The acceptance kit: ``megatron-hsp selftest`` under ``torchrun``, on the GPUs it was given.

Why a second driver next to ``selftest.run_selftest``: the CPU selftest spawns its own gloo
processes; a user accepting an install has ``torchrun`` (or Slurm) and GPUs, and needs the same
check on NCCL, on CUDA kernels and in the dtype training uses. This module runs inside every
launched process:

* **process groups**: NCCL on ``cuda:LOCAL_RANK`` with the device bound at ``init_process_group``
  (so HSP's sub-groups are split from the world communicator), gloo on the CPU;
* **cases**: the CPU selftest's table for 4 and 8 ranks; for any other count a table built from
  the same pieces (size-1 groups, one group of all, mixed sizes, a pure ring, Ulysses x ring,
  tensor parallel 2 where the count is even), GQA throughout;
* **reference**: the selftest's independent one (``testing/reference.py``: stock megatron-core,
  one document at a time, fp32) computed on the host CPU of every rank -- the very reference the
  CPU proof trusts, not a GPU re-implementation of it;
* **HSP side**: megatron-core ``GPTModel`` with the HSP attention spec on the rank's device, in
  each dtype asked for (default on CUDA: fp32, the precise check, then bf16, the training
  dtype), weights loaded from the reference;
* **verdict**: per case and dtype the worst over ranks of the loss and per-parameter gradient
  differences against stated tolerances (``TOLERANCES``); one screen, or ``--json``.

What it proves and what not: fp32 on the GPU is held to tolerances close to the CPU selftest's
(reduction order on the GPU differs, nothing else should), so a wrong layout, merge or reduction
shows by orders of magnitude; bf16 is held to bf16's precision, which shows a crash, a hang or a
gross error in the training dtype but not a 0.1% one. Multi-rank NCCL cannot run on this
project's machines (one GPU at most): docs/gpu-validation.md says what ran where.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass
from typing import Any

from megatron_hsp.planner.errors import InputError
from megatron_hsp.testing.mutations import by_name
from megatron_hsp.testing.reference import ModelShape
from megatron_hsp.testing.selftest import Case, build_cases

# (loss relative difference, per-parameter gradient relative difference) allowed per dtype.
# fp32: the CPU selftest's 1e-6 / 1e-5, widened 10x for GPU reduction order; bf16: its 8-bit
# mantissa (relative precision 2^-8 = 0.4%) accumulated over two layers and a loss over a few
# hundred tokens.
TOLERANCES = {"fp32": (1e-5, 1e-4), "bf16": (2e-2, 5e-2)}
DTYPES = tuple(TOLERANCES)


def under_torchrun() -> bool:
    """Launched by torchrun / Slurm with an env:// rendezvous."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def acceptance_cases(n: int) -> list[Case]:
    """The cases for ``n`` ranks: the CPU selftest's for 4 and 8, else built for ``n``.

    Heads: 8 query / 2 KV per tensor-parallel rank at tp 1 (``ModelShape``), so a group of 2, 4
    or 8 runs Ulysses, of 3, 5 or 7 a pure ring, of 6 Ulysses 2 x ring 3 (``HeadSpace.split``).
    """
    if n < 1:
        raise InputError(f"the acceptance kit needs at least one rank (got {n})")
    if n in (4, 8):
        return build_cases(n)
    tail = (97, 45, 30, 21, 13, 11, 8, 7, 5, 4, 3, 2, 2, 1)

    def first_then_singles(size: int, slots: int) -> tuple:
        """One group of ``size`` on slots 0.., size-1 groups after it, documents dealt round
        robin (aligned blocks on any count: a block at slot 0 is always legal)."""
        sizes = [size] + [1] * (slots - size)
        return (tuple((d, list(range(g, len(tail), len(sizes)))) for g, d in enumerate(sizes)),)

    cases = [
        Case("all-groups-size-1", 1, n, tail, first_then_singles(1, n)),
        Case("one-group-of-all", 1, n, tail, first_then_singles(n, n), data_seed=1),
    ]
    for size, name, seed in ((2, "ulysses", 2), (3, "pure-ring", 3), (6, "ulysses-x-ring", 4)):
        if size < n:
            cases.append(
                Case(
                    f"{name}-group-and-singles",
                    1,
                    n,
                    tail,
                    first_then_singles(size, n),
                    data_seed=seed,
                )
            )
    if n % 2 == 0:
        s = n // 2
        cases.append(Case("tp2-group-of-all", 2, s, tail, first_then_singles(s, s), data_seed=5))
    return cases


@dataclass(frozen=True)
class KitOptions:
    dtypes: tuple[str, ...]
    device: str  # "cuda" or "cpu"
    # A bug from ``testing/mutations.py`` planted for the whole run: the kit must then FAIL.
    # How a user checks, on their own cluster, that the kit can fail at all.
    plant: str | None = None


def run_acceptance(opts: KitOptions) -> dict[str, Any] | None:
    """One launched process of the kit; returns the verdict document on global rank 0."""
    import torch
    import torch.distributed as dist

    from megatron_hsp.testing.dist import destroy_cpu_megatron, init_megatron
    from megatron_hsp.testing.selftest import _WorkerState, compute_reference, run_case

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if opts.device == "cuda":
        if not torch.cuda.is_available():
            raise InputError("--device cuda: no CUDA device is visible to this process")
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        device = torch.device("cpu")
    cases = acceptance_cases(world)
    shape = ModelShape()
    t0 = time.perf_counter()
    init_megatron(rank, world, "env://", device=device if device.type == "cuda" else None)
    try:
        reference = compute_reference(cases, shape)  # fp32, host CPU: the trusted reference
        rows: list[dict[str, Any]] = []
        state = _WorkerState(rank, world, shape, reference["weights"], device=device)
        undo = by_name([opts.plant])[0].plant() if opts.plant else None
        for dtype in opts.dtypes:
            state.dtype, state.key = dtype, None  # rebuild the model; keep the process groups
            for case in cases:
                row = run_case(state, case, reference)
                row["dtype"] = dtype
                rows.append(row)
        if undo is not None:
            undo()
        everyone: list[Any] = [None] * world
        dist.all_gather_object(everyone, rows)
    finally:
        destroy_cpu_megatron()
    if rank != 0:
        return None
    return _verdict(everyone, opts, world, device, time.perf_counter() - t0)


def _verdict(
    per_rank: list[list[dict[str, Any]]],
    opts: KitOptions,
    world: int,
    device: Any,
    seconds: float,
) -> dict[str, Any]:
    import torch

    out = []
    for i, row in enumerate(per_rank[0]):
        rows = [r[i] for r in per_rank]
        loss_tol, grad_tol = TOLERANCES[row["dtype"]]
        loss_rel = max(r["loss_rel_diff"] for r in rows)
        grad_rel = max(r["max_rel_grad_diff"] for r in rows)
        out.append(
            {
                "name": row["name"],
                "dtype": row["dtype"],
                "group_sizes": row["group_sizes"],
                "layouts": row["layouts"],
                "loss_rel_diff": loss_rel,
                "max_rel_grad_diff": grad_rel,
                "worst_param": row["worst_param"],
                "tolerances": {"loss_rel": loss_tol, "grad_rel": grad_tol},
                "ok": loss_rel <= loss_tol and grad_rel <= grad_tol,
            }
        )
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return {
        "ok": all(c["ok"] for c in out),
        "kit": {
            "world_size": world,
            "device": name,
            "backend": "nccl" if device.type == "cuda" else "gloo",
            "dtypes": list(opts.dtypes),
            "torch": torch.__version__,
            "seconds": seconds,
            "planted": opts.plant,
        },
        "cases": out,
    }


def render(doc: dict[str, Any]) -> str:
    k = doc["kit"]
    lines = [
        f"megatron-hsp acceptance: {k['world_size']} ranks, {k['backend']} on {k['device']}, "
        f"torch {k['torch']}, reference fp32 stock megatron-core (host CPU)",
        f"  {'case':34} {'dtype':5} {'loss rel':>9} {'grad rel':>9}  {'tol (loss/grad)':15} groups",
    ]
    for c in doc["cases"]:
        t = c["tolerances"]
        lines.append(
            f"  {c['name']:34} {c['dtype']:5} {c['loss_rel_diff']:9.2e} "
            f"{c['max_rel_grad_diff']:9.2e}  {t['loss_rel']:.0e}/{t['grad_rel']:.0e}     "
            f"{c['group_sizes']} {'ok' if c['ok'] else 'FAILED'}"
        )
    bad = [c for c in doc["cases"] if not c["ok"]]
    if k["planted"]:
        lines.append(
            f"  (bug planted on purpose: {k['planted']}; the kit "
            + ("missed it: do not trust this install's kit)" if doc["ok"] else "caught it)")
        )
    lines.append(
        ("ACCEPTED" if doc["ok"] else f"NOT ACCEPTED ({len(bad)} failed)")
        + f": {len(doc['cases'])} checks in {k['seconds']:.1f} s"
    )
    return "\n".join(lines)


def main(dtypes: str | None, device: str | None, as_json: bool, plant: str | None = None) -> int:
    """``selftest`` under torchrun: every process runs this; rank 0 prints."""
    import torch

    dev = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if dev not in ("cuda", "cpu"):
        raise InputError(f"--device {dev}: choose cuda or cpu")
    default = ("fp32", "bf16") if dev == "cuda" else ("fp32",)
    chosen = tuple(dtypes.split(",")) if dtypes else default
    unknown = [d for d in chosen if d not in TOLERANCES]
    if unknown:
        raise InputError(f"--dtype {','.join(unknown)}: choose from {', '.join(DTYPES)}")
    if plant is not None:
        by_name([plant])  # an unknown name fails before any collective
    doc = run_acceptance(KitOptions(dtypes=chosen, device=dev, plant=plant))
    if doc is None:
        return 0
    print(json.dumps(doc, indent=2) if as_json else render(doc))
    if not doc["ok"] and not as_json:
        print("megatron-hsp acceptance: FAILED", file=sys.stderr)
    return 0 if doc["ok"] else 1
