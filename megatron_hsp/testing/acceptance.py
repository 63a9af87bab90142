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
  one document at a time, fp32) computed on the host CPU -- the very reference the CPU proof
  trusts, not a GPU re-implementation of it -- once, by global rank 0, in a child process that
  CUDA is hidden from (``testing/reference_child.py``: the reference's CPU placement mode is
  refused where CUDA is visible, i.e. on every GPU node), then broadcast to every rank;
* **HSP side**: megatron-core ``GPTModel`` with the HSP attention spec on the rank's device, in
  each dtype asked for (default on CUDA: fp32, the precise check, then bf16, the training
  dtype), weights loaded from the reference;
* **fp32 means fp32**: TF32 is turned off for the kit's processes (``torch.backends`` matmul and
  cuDNN flags, float32 matmul precision "highest"; NGC images set
  ``TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=1``, which the kit removes from its own processes before
  any CUDA work and reports); where TF32 still reads as on, fp32 rows are judged at TF32's
  tolerance and say so (``fp32_without_tf32``);
* **rows beyond the selftest's**: a head dim of 128 (every kit model's head dim is a multiple
  of 8, as the flash kernels need), a long document over a ring of all ranks, groups created
  lazily after megatron's ``initialize`` (``Case.lazy_groups``), and with Transformer Engine
  importable on CUDA the whole table again on the TE backend in bf16;
* **report**: TE's version, the attention route each case took (``HSPCoreAttention.routes``),
  and per case a one-line summary with the measured tokens/s of each group kind;
* **verdict**: per case and dtype the worst over ranks of the loss and per-parameter gradient
  differences against stated tolerances (``tolerances.TOLERANCES``); one screen, or ``--json``.

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
from megatron_hsp.planner.groupspace import HeadSpace
from megatron_hsp.runtime.backends import te_version
from megatron_hsp.testing.mutations import by_name
from megatron_hsp.testing.reference import ModelShape
from megatron_hsp.testing.selftest import Case, build_cases
from megatron_hsp.testing.tolerances import BF16_NOISE_FACTOR, gpu_tolerance

# The dtypes the kit runs; their tolerances: ``tolerances.gpu_tolerance``.
DTYPES = ("fp32", "bf16")
TF32_OVERRIDE = "TORCH_ALLOW_TF32_CUBLAS_OVERRIDE"


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
    return _selftest_cases(n) + kit_only_cases(n)


def _first_then_singles(size: int, slots: int, documents: int) -> tuple:
    """One group of ``size`` on slots 0.., size-1 groups after it, documents dealt round
    robin (aligned blocks on any count: a block at slot 0 is always legal)."""
    sizes = [size] + [1] * (slots - size)
    return (tuple((d, list(range(g, documents, len(sizes)))) for g, d in enumerate(sizes)),)


def kit_only_cases(n: int) -> list[Case]:
    """What GPU users meet that the CPU selftest's table does not hold.

    * ``head-dim-128``: a realistic head dim (the flash kernels' largest common one);
    * ``long-document-ring``: one long document over a group of all ranks that is a pure ring
      (5 query heads, 1 KV head: no Ulysses degree above 1 divides them unless ``n`` is a
      multiple of 5), next to short ones in the same buffer;
    * ``lazy-groups-after-initialize``: the group of all and size-1 groups created by the step
      (``GroupRegistry.ensure``) after megatron's ``initialize``, as the Megatron integration
      creates them (``megatron/hooks.py``).
    """
    tail = (97, 45, 30, 21, 13, 11, 8, 7, 5, 4, 3, 2, 2, 1)
    ring_shape = (
        ("num_attention_heads", 5),
        ("num_query_groups", 1),
        ("hidden_size", 40),
        ("max_sequence_length", 1024),
    )
    return [
        Case(
            "head-dim-128",
            1,
            n,
            tail,
            _first_then_singles(n, n, len(tail)),
            data_seed=11,
            shape_changes=(("kv_channels", 128),),
        ),
        Case(
            "long-document-ring",
            1,
            n,
            (1000, 7, 3),
            (((n, [0, 1, 2]),),),
            data_seed=12,
            shape_changes=ring_shape,
        ),
        Case(
            "lazy-groups-after-initialize",
            1,
            n,
            tail,
            (
                ((n, list(range(7))),),  # the group of all, then size-1 groups: two sizes
                tuple((1, list(range(7 + g, len(tail), n))) for g in range(n)),
            ),
            data_seed=13,
            lazy_groups=True,
        ),
    ]


def _selftest_cases(n: int) -> list[Case]:
    if n in (4, 8):
        return build_cases(n)
    tail = (97, 45, 30, 21, 13, 11, 8, 7, 5, 4, 3, 2, 2, 1)

    def first_then_singles(size: int, slots: int) -> tuple:
        return _first_then_singles(size, slots, len(tail))

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
    # Many ranks on one GPU: every rank on cuda:0 (``comm.rank_device``), gloo groups, the
    # runtime's collectives staged through host buffers (``runtime/comm.py``); with device "cpu"
    # CPU ranks take the same staged path (how CI runs it).
    ranks_share_device: bool = False


def fp32_without_tf32() -> dict[str, Any]:
    """Turn TF32 off for this process's fp32 work; what was found and what holds now.

    Must run before the process's first CUDA matmul: ``TORCH_ALLOW_TF32_CUBLAS_OVERRIDE`` (set in
    NGC images) is read by torch when cuBLAS math mode is first asked for, and forces TF32
    whatever ``allow_tf32`` says. The kit's processes are its own, so the variable is removed
    from them (training runs keep theirs). ``matmul_tf32``/``cudnn_tf32`` read the flags back;
    ``forced`` is true when TF32 still reads as on (then fp32 rows use the ``gpu-tf32`` tolerance).
    """
    import torch

    found = os.environ.pop(TF32_OVERRIDE, None)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    matmul, cudnn = (
        bool(torch.backends.cuda.matmul.allow_tf32),
        bool(torch.backends.cudnn.allow_tf32),
    )
    return {
        "override_env": found,
        "matmul_tf32": matmul,
        "cudnn_tf32": cudnn,
        "forced": matmul or cudnn,
    }


def te_importable() -> bool:
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:
        return False
    return True


def shared_reference(
    cases: list[Case], shape: ModelShape, timeout_s: float, bf16_noise: bool = False
) -> dict[str, Any]:
    """The fp32 reference, computed once by global rank 0 where CUDA is hidden, given to all;
    ``bf16_noise``: with stock megatron-core's own bf16 difference per parameter."""
    import torch.distributed as dist

    from megatron_hsp.testing.reference_child import reference_in_child

    box: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            box[0] = reference_in_child(cases, shape, timeout_s, bf16_noise)
        except Exception as exc:  # every rank must leave the broadcast, with the reason
            box[0] = RuntimeError(str(exc))
    dist.broadcast_object_list(box, src=0)
    if isinstance(box[0], Exception):
        raise box[0]
    return box[0]


def _routes(model: Any) -> dict[str, int]:
    """Attention calls per route over the model's layers since the last call (then reset)."""
    total: dict[str, int] = {}
    for module in model.modules():
        routes = getattr(module, "routes", None)
        if isinstance(routes, dict):
            for name, calls in routes.items():
                total[name] = total.get(name, 0) + calls
            routes.clear()
    return total


def _group_tokens_per_s(row: dict[str, Any], case: Case) -> dict[str, float]:
    """Tokens per second of each group kind in this case's step (all micro-batches), measured
    as the case's tokens in groups of that kind over the step's wall time."""
    kinds: dict[str, int] = {}
    for mb_layout, mb in zip(row["layouts"], case.layout, strict=True):
        for g, (_size, docs) in zip(mb_layout, mb, strict=True):
            kind = _kind(g)
            kinds[kind] = kinds.get(kind, 0) + sum(case.lengths[i] for i in docs)
    seconds = max(row["step_s"], 1e-9)
    return {k: tokens / seconds for k, tokens in sorted(kinds.items())}


def predicted_tokens_per_s(
    case: Case, shape: ModelShape, device_name: str, world: int
) -> dict[str, float] | None:
    """The cost model's tokens/s per group kind for ``case``, as ``_group_tokens_per_s``
    measures them (a kind's tokens over the step's time), or None without a hardware preset.

    The model is the analytic one (``first_principles_cost_model``) for the kit's model shape on
    the device's preset (H100 only so far: ``H100_SXM``), one node of ``world`` GPUs, bf16, no
    ZeRO: the step is the sum over micro-batches of the slowest group's ``group_ms`` at the
    split the case ran. A tiny model is launch-bound, which the preset's per-call terms price;
    the comparison says how far the model is from this machine, not whether the kit passed.
    """
    from megatron_hsp.planner.cost.first_principles import (
        H100_SXM,
        TrainingConfig,
        first_principles_cost_model,
    )
    from megatron_hsp.planner.cost.shape import TransformerShape

    if "H100" not in device_name:
        return None
    s = case.model_shape(shape)
    # One tensor-parallel rank's heads, at the head dim the model runs (``kv_channels``).
    model = TransformerShape(
        "acceptance-kit",
        s.num_layers,
        s.hidden_size,
        s.num_attention_heads // case.tp,
        max(1, s.num_query_groups // case.tp),
        s.ffn_hidden_size,
        s.vocab_size,
        head_dim=s.kv_channels,
        gated=False,
    )
    slots = world // case.tp
    cost = first_principles_cost_model(
        model, H100_SXM, TrainingConfig(zero_stage=0), world_size=slots, gpus_per_node=slots
    )
    heads = HeadSpace.from_model(s.num_attention_heads, s.num_query_groups, case.tp)
    step_ms, kinds = 0.0, {}
    for mb in case.layout:
        slowest = 0.0
        for size, docs in mb:
            u, r = heads.split(size)
            lengths = [case.lengths[i] for i in docs]
            if lengths:
                slowest = max(slowest, cost.group_ms(lengths, size, (u, r)))
            kind = _kind({"size": size, "ulysses": u, "ring": r})
            kinds[kind] = kinds.get(kind, 0) + sum(lengths)
        step_ms += slowest
    return {k: tokens / max(step_ms / 1e3, 1e-12) for k, tokens in sorted(kinds.items())}


def _kind(g: dict[str, int]) -> str:
    if g["size"] == 1:
        return "single"
    if g["ring"] == 1:
        return f"ulysses{g['size']}"
    if g["ulysses"] == 1:
        return f"ring{g['size']}"
    return f"u{g['ulysses']}xr{g['ring']}"


def run_acceptance(opts: KitOptions, tf32: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """One launched process of the kit; returns the verdict document on global rank 0."""
    import torch
    import torch.distributed as dist

    from megatron_hsp.runtime.comm import comm, rank_device
    from megatron_hsp.testing.dist import destroy_cpu_megatron, init_megatron
    from megatron_hsp.testing.selftest import _WorkerState, run_case

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", "0"))
    shared = opts.ranks_share_device
    device = rank_device(opts.device, local, shared)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise InputError("--device cuda: no CUDA device is visible to this process")
        torch.cuda.set_device(device)
    cases = acceptance_cases(world)
    by_case = {c.name: c for c in cases}
    shape = ModelShape()
    # TE's context-parallel routes run TE's own NCCL p2p on the group: not on shared-device
    # ranks' gloo groups (and its staging would not be ours), so those rows need a GPU per rank.
    te = device.type == "cuda" and not shared and te_importable()
    backends = ["torch"] + (["te"] if te else [])
    t0 = time.perf_counter()
    init_megatron(
        rank,
        world,
        "env://",
        device=device if device.type == "cuda" else None,
        ranks_share_device=shared,
    )
    try:
        # bf16 rows (torch in bf16, or TE's, which run bf16 only) need the stock bf16 yardstick
        bf16 = "bf16" in opts.dtypes or "te" in backends
        reference = shared_reference(cases, shape, timeout_s=600.0, bf16_noise=bf16)
        rows: list[dict[str, Any]] = []
        state = _WorkerState(
            rank, world, shape, reference["weights"], device=device, ranks_share_device=shared
        )
        planted = by_name([opts.plant])[0].plant() if opts.plant else None
        for backend in backends:
            # TE's fused and flash kernels take 16-bit inputs only: TE rows run in bf16.
            dtypes = opts.dtypes if backend == "torch" else ("bf16",)
            for dtype in dtypes:
                # rebuild the model; keep the process groups
                state.dtype, state.backend, state.key = dtype, backend, None
                for case in cases:
                    row = run_case(state, case, reference)
                    row.update(dtype=dtype, backend=backend, routes=_routes(state.model))
                    row["tokens_per_s"] = _group_tokens_per_s(row, by_case[case.name])
                    rows.append(row)
        staged_calls = getattr(comm(), "calls", 0)
        calls = None
        if planted is not None:
            calls = planted.calls()
            planted()
        everyone: list[Any] = [None] * world
        dist.all_gather_object(everyone, (rows, calls, staged_calls))
    finally:
        destroy_cpu_megatron()
    if rank != 0:
        return None
    doc = _verdict(
        [r for r, _, _ in everyone], opts, world, device, time.perf_counter() - t0, tf32 or {}
    )
    doc["kit"]["planted_calls"] = None if calls is None else sum(c for _, c, _ in everyone)
    doc["kit"]["host_staged_collectives"] = [s for _, _, s in everyone]  # per rank
    return doc


def _verdict(
    per_rank: list[list[dict[str, Any]]],
    opts: KitOptions,
    world: int,
    device: Any,
    seconds: float,
    tf32: dict[str, Any],
) -> dict[str, Any]:
    import torch

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    by_case = {c.name: c for c in acceptance_cases(world)}
    out = []
    for i, row in enumerate(per_rank[0]):
        rows = [r[i] for r in per_rank]
        tf32_forced = row["dtype"] == "fp32" and bool(tf32.get("forced"))
        tol = gpu_tolerance(row["dtype"], tf32_forced)
        loss_tol, grad_tol = tol.loss, tol.grad
        loss_rel = max(r["loss_rel_diff"] for r in rows)
        grad_rel = max(r["max_rel_grad_diff"] for r in rows)
        grad_judged = max(_grad_judged(r, grad_tol) for r in rows)
        routes: dict[str, int] = {}
        for r in rows:
            for route, calls in r["routes"].items():
                routes[route] = routes.get(route, 0) + calls
        out.append(
            {
                "name": row["name"],
                "dtype": row["dtype"],
                "backend": row["backend"],
                "routes": routes,
                "tf32": tf32_forced,
                "group_sizes": row["group_sizes"],
                "layouts": row["layouts"],
                "loss_rel_diff": loss_rel,
                "max_rel_grad_diff": grad_rel,
                "worst_param": row["worst_param"],
                "tolerances": {"loss_rel": loss_tol, "grad_rel": grad_tol},
                # the worst parameter's difference over what it may differ by (<= 1 passes):
                # grad_rel, or on bf16 rows BF16_NOISE_FACTOR x stock bf16's where larger
                "grad_judged": grad_judged[0],
                "grad_judged_param": grad_judged[1],
                "stock_bf16_noise": row.get("stock_bf16_rel") is not None,
                "step_s": max(r["step_s"] for r in rows),
                # the slowest rank's rate of each group kind
                "tokens_per_s": {
                    k: min(r["tokens_per_s"][k] for r in rows) for k in row["tokens_per_s"]
                },
                "predicted_tokens_per_s": predicted_tokens_per_s(
                    by_case[row["name"]], ModelShape(), name, world
                ),
                "ok": loss_rel <= loss_tol and grad_judged[0] <= 1.0,
            }
        )
    return {
        "ok": all(c["ok"] for c in out),
        "kit": {
            "world_size": world,
            "device": name,
            "backend": "nccl" if device.type == "cuda" and not opts.ranks_share_device else "gloo",
            # many ranks on one device: gloo groups, collectives staged through host buffers
            "ranks_share_device": opts.ranks_share_device,
            "comm": "host-staged" if opts.ranks_share_device else "direct",
            "dtypes": list(opts.dtypes),
            "torch": torch.__version__,
            "transformer_engine": te_version(),  # None: not importable
            "tf32": tf32,
            "reference": "fp32 stock megatron-core, host CPU, child process with CUDA hidden",
            "seconds": seconds,
            "planted": opts.plant,
        },
        "cases": out,
    }


def _grad_judged(row: dict[str, Any], grad_tol: float) -> tuple[float, str]:
    """(max over parameters of difference / allowed, that parameter): allowed is ``grad_tol``,
    or on bf16 rows ``BF16_NOISE_FACTOR`` times stock megatron-core's own bf16 difference for
    the parameter where that is larger."""
    noise = row.get("stock_bf16_rel") or {}
    return max(
        (rel / max(grad_tol, BF16_NOISE_FACTOR * noise.get(name, 0.0)), name)
        for name, rel in row["grad_rel_by_param"].items()
    )


def _tf32_line(tf32: dict[str, Any]) -> str:
    found = tf32.get("override_env")
    env = f"{TF32_OVERRIDE}={found} found and removed from the kit's processes; " if found else ""
    if tf32.get("forced"):
        return (
            f"  TF32: {env}STILL ON (matmul {tf32['matmul_tf32']}, cuDNN "
            f"{tf32['cudnn_tf32']}): fp32 rows (marked *) judged at TF32 tolerance"
        )
    return f"  TF32: {env}off for fp32 (matmul and cuDNN allow_tf32 False, precision highest)"


def _shared_note(k: dict[str, Any]) -> str:
    if not k.get("ranks_share_device"):
        return ""
    staged = k.get("host_staged_collectives") or [0]
    return (
        f" (all ranks on one device; {min(staged):,}-{max(staged):,} collectives per rank "
        "staged through host buffers)"
    )


def render(doc: dict[str, Any]) -> str:
    k = doc["kit"]
    te = k.get("transformer_engine") or "not installed"
    lines = [
        f"megatron-hsp acceptance: {k['world_size']} ranks, {k['backend']} on {k['device']}"
        + _shared_note(k)
        + ", "
        f"torch {k['torch']}, Transformer Engine {te}, reference {k['reference']}",
        _tf32_line(k.get("tf32") or {}),
        f"  {'case':34} {'backend':7} {'dtype':5} {'loss rel':>9} {'grad rel':>9}  "
        f"{'tol (loss/grad)':15} groups",
    ]
    for c in doc["cases"]:
        t = c["tolerances"]
        dtype = c["dtype"] + ("*" if c["tf32"] else "")
        lines.append(
            f"  {c['name']:34} {c['backend']:7} {dtype:5} {c['loss_rel_diff']:9.2e} "
            f"{c['max_rel_grad_diff']:9.2e}  {t['loss_rel']:.0e}/{t['grad_rel']:.0e}     "
            f"{c['group_sizes']} {'ok' if c['ok'] else 'FAILED'}"
        )
        if c.get("stock_bf16_noise"):
            lines.append(
                f"      grad per parameter: the larger of {t['grad_rel']:.0e} and "
                f"{BF16_NOISE_FACTOR:g}x stock megatron-core's own bf16 difference; worst "
                f"{c['grad_judged_param']} at {c['grad_judged']:.2f} of it"
            )
        predicted = c.get("predicted_tokens_per_s") or {}
        rates = ", ".join(
            f"{kind} {rate:,.0f}"
            + (f" (model {predicted[kind]:,.0f})" if kind in predicted else "")
            for kind, rate in c["tokens_per_s"].items()
        )
        if not predicted:
            rates += " (no cost-model preset for this device)"
        routes = ", ".join(f"{name} x{calls}" for name, calls in sorted(c["routes"].items()))
        lines.append(f"      {c['step_s']:.2f} s; tokens/s {rates}; routes {routes}")
    bad = [c for c in doc["cases"] if not c["ok"]]
    if k["planted"] and unexercised(doc):
        lines.append(
            f"  (bug planted on purpose: {k['planted']}; its code never ran on this run's "
            "routes, so it proves nothing here: plant one these routes run)"
        )
    elif k["planted"]:
        lines.append(
            f"  (bug planted on purpose: {k['planted']}; the kit "
            + ("missed it: do not trust this install's kit)" if doc["ok"] else "caught it)")
        )
    if unexercised(doc):
        verdict = "NO VERDICT (the planted bug never ran)"
    else:
        verdict = "ACCEPTED" if doc["ok"] else f"NOT ACCEPTED ({len(bad)} failed)"
    lines.append(f"{verdict}: {len(doc['cases'])} checks in {k['seconds']:.1f} s")
    return "\n".join(lines)


def main(
    dtypes: str | None,
    device: str | None,
    as_json: bool,
    plant: str | None = None,
    ranks_share_device: bool = False,
) -> int:
    """``selftest`` under torchrun: every process runs this; rank 0 prints."""
    import torch

    tf32 = fp32_without_tf32()  # before any CUDA work (the override is read once)
    dev = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if dev not in ("cuda", "cpu"):
        raise InputError(f"--device {dev}: choose cuda or cpu")
    default = ("fp32", "bf16") if dev == "cuda" else ("fp32",)
    chosen = tuple(dtypes.split(",")) if dtypes else default
    unknown = [d for d in chosen if d not in DTYPES]
    if unknown:
        raise InputError(f"--dtype {','.join(unknown)}: choose from {', '.join(DTYPES)}")
    if plant is not None:
        refuse_unseen_plant(plant, int(os.environ.get("WORLD_SIZE", "1")))
    opts = KitOptions(dtypes=chosen, device=dev, plant=plant, ranks_share_device=ranks_share_device)
    doc = run_acceptance(opts, tf32)
    if doc is None:
        return 0
    print(json.dumps(doc, indent=2) if as_json else render(doc))
    if unexercised(doc):
        print(
            f"megatron-hsp acceptance: --plant {plant}: its code never ran on this run's routes "
            "(no verdict on the kit; plant a bug in code these routes run)",
            file=sys.stderr,
        )
        return 2
    if not doc["ok"] and not as_json:
        print("megatron-hsp acceptance: FAILED", file=sys.stderr)
    return 0 if doc["ok"] else 1


def refuse_unseen_plant(plant: str, world: int) -> None:
    """Refuse, before any collective, a plant unknown or one that this run cannot see: a bug
    between ranks on one rank, or one that only learned absolute position embeddings read on
    the kit's RoPE models (``Mutation.unseen``). Passing it would say nothing about the kit,
    and "missed it" would blame a correct install."""
    from megatron_hsp.testing.mutations import MUTATIONS

    (mutation,) = by_name([plant])
    kind = ModelShape().position_embedding_type
    why = mutation.unseen(world, kind)
    if why is not None:
        seen = [m.name for m in MUTATIONS if m.unseen(world, kind) is None]
        raise InputError(
            f"--plant {plant}: the kit cannot see it on {world} rank(s): {why}; plants it can "
            f"see here: {', '.join(seen)}"
        )


def unexercised(doc: dict[str, Any]) -> bool:
    """Whether a bug was planted and its broken code never ran on any rank (``Planted.calls``):
    then neither a pass nor a failure says anything about the kit."""
    return bool(doc["kit"]["planted"]) and doc["kit"].get("planted_calls") == 0
