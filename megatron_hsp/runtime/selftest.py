"""Selftest: distributed HSP training steps against a single-process reference, on the CPU.

A small real megatron-core ``GPTModel`` (GQA, RoPE, fp32, HSP core attention from
``megatron_hsp.megatron.spec``) runs one training step per case on N gloo processes with a
hand-written plan (``manual_plan``), and its loss and every parameter's gradient are compared with
the same step on one process that sees the whole batch as one packed sequence stream. Same
weights on both sides: the reference initialises the model and ships its parameters; the
distributed ranks load them (sliced along ``partition_dim`` for tensor-parallel parameters) and
gather their gradients back the same way before comparing.

Tolerances (fp32): loss relative difference <= 1e-6; per parameter
``||g - g_ref|| / ||g_ref|| <= 1e-5``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import numpy as np

from megatron_hsp.planner.costmodel import CostModel
from megatron_hsp.planner.errors import InputError
from megatron_hsp.planner.plan import Plan
from megatron_hsp.runtime.manual_plan import Layout, manual_plan

LOSS_REL_TOL = 1e-6
GRAD_REL_TOL = 1e-5
GROUP_TIMEOUT = timedelta(seconds=120)


@dataclass(frozen=True)
class ModelShape:
    """The tiny GPT every case trains: small enough for 8 CPU processes on 2 cores."""

    num_layers: int = 2
    hidden_size: int = 32
    num_attention_heads: int = 8
    num_query_groups: int = 2
    ffn_hidden_size: int = 64
    vocab_size: int = 128
    max_sequence_length: int = 512
    seed: int = 1234


@dataclass(frozen=True)
class Case:
    """One step to check: a batch of document lengths and the plan layout over ``slots``."""

    name: str
    tp: int
    slots: int
    lengths: tuple[int, ...]
    layout: tuple[Layout, ...]
    tokens_per_rank: int | None = None  # memory-limit case: plan validated against this capacity
    data_seed: int = 0

    def plan(self) -> Plan:
        memory = None
        if self.tokens_per_rank is not None:
            memory = memory_limit_model(self.tokens_per_rank, self.slots)
        return manual_plan(self.slots, self.lengths, self.layout, memory=memory)

    def documents(self, vocab_size: int) -> list[np.ndarray]:
        rng = np.random.default_rng(1000 + self.data_seed)
        return [rng.integers(0, vocab_size, n, dtype=np.int64) for n in self.lengths]


@dataclass
class CaseResult:
    name: str
    nproc: int
    group_sizes: list[list[int]]
    loss_abs_diff: float
    max_abs_grad_diff: float
    max_rel_grad_diff: float
    loss_rel_diff: float = 0.0
    ok: bool = False
    detail: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        # Exactly the keys of the contract (docs/design.md section 3).
        return {
            "name": self.name,
            "nproc": self.nproc,
            "group_sizes": self.group_sizes,
            "loss_abs_diff": self.loss_abs_diff,
            "max_abs_grad_diff": self.max_abs_grad_diff,
            "max_rel_grad_diff": self.max_rel_grad_diff,
        }


def memory_limit_model(tokens_per_rank: int, slots: int) -> CostModel:
    """A cost model whose only relevant part is the activation capacity per rank."""
    sizes = [d for d in (2, 4, 8, 16, 32, 64) if d <= slots]
    return CostModel(
        name=f"selftest-capacity-{tokens_per_rank}",
        attn_ms_per_token2=1e-6,
        linear_ms_per_token=1e-3,
        group_fixed_ms={0: 0.0},
        a2a_ms_per_token=dict.fromkeys(sizes, 1e-4),
        tokens_per_rank=tokens_per_rank,
    )


# Long-tail document lengths: a few long ones, many short, including 1-token documents.
_TAIL = (97, 45, 30, 21, 13, 11, 8, 7, 5, 4, 3, 2, 2, 1)


def build_cases(nproc: int) -> list[Case]:
    """The cases for ``nproc`` processes (a power of two >= 4), identical on every rank."""
    if nproc < 4 or nproc & (nproc - 1):
        raise InputError(f"--nproc {nproc}: the selftest needs a power of two >= 4 (4 or 8)")
    n = nproc
    tail = list(_TAIL)
    ids = list(range(len(tail)))
    cases = [
        Case(
            "all-groups-size-1",
            1,
            n,
            tuple(tail),
            (
                tuple((1, [ids[i]]) for i in range(n)),
                tuple((1, ids[n + i :: n]) for i in range(n)),
            ),
        ),
        Case("one-group-of-all", 1, n, tuple(tail), (((n, ids),),)),
    ]
    # Three distinct sizes in one micro-batch: {4,2,1,1} on 8, {2,1,1} on 4 -- twice, so the
    # second micro-batch reuses the layout with other documents.
    sizes = [n // 2, n // 4, n // 4] if n == 4 else [n // 2, n // 4] + [1] * (n // 4)
    k = len(sizes)
    cases.append(
        Case(
            "mixed-sizes-in-one-microbatch",
            1,
            n,
            tuple(tail),
            (
                tuple((sizes[g], ids[g : len(ids) // 2 : k]) for g in range(k)),
                tuple((sizes[g], ids[len(ids) // 2 + g :: k]) for g in range(k)),
            ),
            data_seed=2,
        )
    )
    # Layout changes every micro-batch; the last has fewer documents than groups (empty groups).
    cases.append(
        Case(
            "changing-layouts-and-empty-groups",
            1,
            n,
            tuple(tail),
            (
                ((n, [0, 13]),),
                ((n // 2, [1, 3, 5, 7, 9]), (n // 2, [2, 4, 6, 8, 10])),
                ((1, [11]), (1, [12]), *((1, []) for _ in range(n - 2))),
            ),
            data_seed=3,
        )
    )
    s = n // 2  # slots with tensor parallel 2
    tp_layout_1 = (
        ((s // 2, [1, 2, 3]), (s // 2, [4, 5, 6])) if s >= 4 else ((s, [1, 2, 3, 4, 5, 6]),)
    )
    cases.append(
        Case(
            "tp2-with-dynamic-groups",
            2,
            s,
            tuple(tail),
            (
                ((s, [0, 7]),),
                tp_layout_1,
                tuple((1, ids[8 + i :: s]) for i in range(s)),
            ),
            data_seed=4,
        )
    )
    # 1-token documents: alone in a group of all ranks (1 real token, n-1 padding), next to long
    # ones, and alone on a single rank.
    one_tok = (1, 1, 29, 1, 6, 1)
    cases.append(
        Case(
            "one-token-documents",
            1,
            n,
            one_tok,
            (((n, [0]),), ((n // 2, [1, 2]), (n // 2, [3, 4, 5]))),
            data_seed=5,
        )
    )
    # A document exactly at the memory limit of its group: capacity(d) == its length.
    per_rank = 12
    d = n // 2
    at_limit = (per_rank * d, 9, 5, 3)
    rest = tuple((1, [1, 2, 3][i :: n - d]) for i in range(n - d))
    cases.append(
        Case(
            "document-at-memory-limit",
            1,
            n,
            at_limit,
            (((d, [0]), *rest),),
            tokens_per_rank=per_rank,
            data_seed=6,
        )
    )
    return cases


# ---------------------------------------------------------------------------------- model


def build_model(shape: ModelShape):
    """A megatron-core ``GPTModel`` with the HSP attention spec, built on the CPU in fp32.

    Untied embeddings (GPTModel's default), so the output layer's gradient is compared on its
    own; the TP size comes from megatron's parallel state (the tp=2 case).
    """
    from megatron_hsp.runtime.testing import tiny_gpt_model

    return tiny_gpt_model(
        num_layers=shape.num_layers,
        hidden_size=shape.hidden_size,
        num_attention_heads=shape.num_attention_heads,
        num_query_groups=shape.num_query_groups,
        ffn_hidden_size=shape.ffn_hidden_size,
        vocab_size=shape.vocab_size,
        max_sequence_length=shape.max_sequence_length,
        seed=shape.seed,
        attention_backend="torch",
        tensor_model_parallel_size=_tp_size(),
        calculate_per_token_loss=True,
    )


def _tp_size() -> int:
    from megatron.core import parallel_state as ps

    return ps.get_tensor_model_parallel_world_size()


def _is_tp_sharded(p) -> bool:
    return bool(getattr(p, "tensor_model_parallel", False)) and _tp_size() > 1


def load_full_weights(model, full: dict[str, Any]) -> None:
    """Copy single-process weights into a (possibly tensor-parallel) model."""
    from megatron.core import parallel_state as ps

    tp, r = _tp_size(), ps.get_tensor_model_parallel_rank()
    params = dict(model.named_parameters())
    if set(params) != set(full):
        raise RuntimeError(f"parameter names differ: {sorted(set(params) ^ set(full))[:6]}")
    for name, p in params.items():
        src = full[name]
        if _is_tp_sharded(p):
            src = src.chunk(tp, dim=p.partition_dim)[r]
        if src.shape != p.shape:
            raise RuntimeError(f"{name}: shard {tuple(src.shape)} vs parameter {tuple(p.shape)}")
        p.data.copy_(src)


def full_gradients(model) -> dict[str, Any]:
    """Every parameter's gradient, tensor-parallel shards gathered along ``partition_dim``."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    out = {}
    tp = _tp_size()
    for name, p in model.named_parameters():
        g = p.grad if p.grad is not None else torch.zeros_like(p)
        if _is_tp_sharded(p):
            parts = [torch.empty_like(g) for _ in range(tp)]
            dist.all_gather(parts, g.contiguous(), group=ps.get_tensor_model_parallel_group())
            g = torch.cat(parts, dim=p.partition_dim)
        out[name] = g.detach().clone()
    return out


# ---------------------------------------------------------------------------------- workers


def _step(model, case: Case, plan: Plan, shape: ModelShape, registry, grad_group, **kwargs):
    import torch

    from megatron_hsp.runtime.dispatch import GlobalBatch
    from megatron_hsp.runtime.schedule import run_step

    batch = GlobalBatch.from_documents(case.documents(shape.vocab_size))
    return run_step(
        model, plan, batch, registry, grad_group=grad_group, device=torch.device("cpu"), **kwargs
    )


def _compare(grads: dict[str, Any], ref_grads: dict[str, Any]) -> tuple[float, float, str]:
    """(max abs difference, max over parameters of ||g - g_ref|| / ||g_ref||, worst parameter)."""
    max_abs, max_rel, worst = 0.0, 0.0, ""
    for name, g_ref in ref_grads.items():
        diff = grads[name] - g_ref
        rel = float(diff.norm() / g_ref.norm().clamp_min(1e-30))
        max_abs = max(max_abs, float(diff.abs().max()))
        if rel > max_rel:
            max_rel, worst = rel, name
    return max_abs, max_rel, worst


def _leaky_forward(model, inputs):
    """Negative control: the same step with document boundaries dropped (one segment per group
    buffer), i.e. attention leaking across documents. The comparison must flag it."""
    import dataclasses

    import torch

    from megatron_hsp.runtime.schedule import gpt_forward

    p = inputs.packed_seq_params
    total = int(p.cu_seqlens_q[-1])
    cu = torch.tensor([0, total], dtype=torch.int32)
    leaky = dataclasses.replace(
        p,
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        cu_seqlens_q_padded=cu,
        cu_seqlens_kv_padded=cu,
        max_seqlen_q=total,
        max_seqlen_kv=total,
    )
    return gpt_forward(model, dataclasses.replace(inputs, packed_seq_params=leaky))


def compute_reference(cases: list[Case], shape: ModelShape) -> dict[str, Any]:
    """Initial weights, and per case the loss and gradients of the whole batch trained as ONE
    packed stream on one device: tensor parallel 1, a single group of one slot (``cp_group``
    None), no collective at all -- what single-device training computes. Runs inside each
    process (identical on all: CPU init from one seed), which saves spawning a separate one."""
    import torch

    from megatron_hsp.runtime.dispatch import GlobalBatch, dispatch
    from megatron_hsp.runtime.loss import masked_loss_sum
    from megatron_hsp.runtime.schedule import gpt_forward, to_model_inputs

    if _tp_size() != 1:
        raise RuntimeError("the reference is computed with tensor parallel size 1")
    model = build_model(shape)
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    out: dict[str, Any] = {"weights": weights, "cases": {}}
    for case in cases:
        batch = GlobalBatch.from_documents(case.documents(shape.vocab_size))
        plan = manual_plan(1, case.lengths, [[(1, list(range(len(case.lengths))))]])
        (pack,) = dispatch(batch, plan, 0)
        inputs = to_model_inputs(pack, None, torch.device("cpu"))
        model.zero_grad(set_to_none=True)
        loss_sum = masked_loss_sum(gpt_forward(model, inputs), inputs.loss_mask)
        (loss_sum / batch.num_loss_tokens).backward()
        out["cases"][case.name] = {
            "loss": float(loss_sum.detach()) / batch.num_loss_tokens,
            "grads": {n: p.grad.detach().clone() for n, p in model.named_parameters()},
        }
    return out


def distributed_worker(rank: int, world_size: int, cases: list[Case], shape: ModelShape):
    """On every rank: the single-device reference, then each case's plan, compared."""
    import torch
    from megatron.core import parallel_state as ps

    from megatron_hsp.runtime.agreement import agree_on_plan, check_executable
    from megatron_hsp.runtime.groups import create_groups_from_megatron
    from megatron_hsp.runtime.testing import init_cpu_megatron

    t_ref = time.perf_counter()
    reference = compute_reference(cases, shape)
    t_ref = time.perf_counter() - t_ref
    results = []
    model = registry = None
    for case in cases:
        if model is None or ps.get_tensor_model_parallel_world_size() != case.tp:
            if ps.get_tensor_model_parallel_world_size() != case.tp:
                # Re-initialise megatron's static groups (dist stays up; init_method unused).
                init_cpu_megatron(rank, world_size, "", tensor_model_parallel_size=case.tp)
            model = build_model(shape)
            load_full_weights(model, reference["weights"])
            registry = create_groups_from_megatron(world_size, timeout=GROUP_TIMEOUT)
        t0 = time.perf_counter()
        plan = agree_on_plan(case.plan(), mode="verify")
        check_executable(
            plan,
            registry,
            num_attention_heads=shape.num_attention_heads,
            num_query_groups=shape.num_query_groups,
            lengths=case.lengths,
        )
        grad_group = ps.get_data_parallel_group(with_context_parallel=True)
        res = _step(model, case, plan, shape, registry, grad_group)
        grads = full_gradients(model)
        ref = reference["cases"][case.name]
        max_abs, max_rel, worst = _compare(grads, ref["grads"])
        loss_abs = abs(res.loss - ref["loss"])
        results.append(
            {
                "name": case.name,
                "loss_abs_diff": loss_abs,
                "loss_rel_diff": loss_abs / max(abs(ref["loss"]), 1e-30),
                "max_abs_grad_diff": max_abs,
                "max_rel_grad_diff": max_rel,
                "worst_param": worst,
                "group_sizes": [mb.group_sizes for mb in plan.microbatches],
                "forward_calls": res.forward_calls,
                "skipped_microbatches": res.skipped_microbatches,
                "step_s": time.perf_counter() - t0,
                "loss": res.loss,
                "ref_loss": ref["loss"],
                "nonzero_grads": sum(int(torch.count_nonzero(g)) > 0 for g in grads.values()),
                "reference_s": t_ref,
            }
        )
    # Negative control (not a case): the mixed-size plan with attention leaking across documents
    # must miss the tolerance by far, or the comparison above proves nothing.
    control = next(c for c in cases if c.name == "mixed-sizes-in-one-microbatch")
    if ps.get_tensor_model_parallel_world_size() != control.tp:
        init_cpu_megatron(rank, world_size, "", tensor_model_parallel_size=control.tp)
        model = build_model(shape)
        load_full_weights(model, reference["weights"])
        registry = create_groups_from_megatron(world_size, timeout=GROUP_TIMEOUT)
    grad_group = ps.get_data_parallel_group(with_context_parallel=True)
    res = _step(model, control, control.plan(), shape, registry, grad_group, forward=_leaky_forward)
    ref = reference["cases"][control.name]
    _, leak_rel, _ = _compare(full_gradients(model), ref["grads"])
    leak_loss = abs(res.loss - ref["loss"]) / abs(ref["loss"])
    return {
        "cases": results,
        "control": {"max_rel_grad_diff": leak_rel, "loss_rel_diff": leak_loss},
    }


# ---------------------------------------------------------------------------------- driver


def run_selftest(nproc: int, shape: ModelShape | None = None, timeout_s: float = 600.0) -> dict:
    """Run every case on ``nproc`` gloo processes; the ``selftest --json`` document plus timing."""
    from megatron_hsp.runtime.testing import raise_rank_errors, run_distributed

    shape = shape or ModelShape()
    cases = build_cases(nproc)
    for c in cases:  # fail fast, before spawning anything, on a broken case table
        c.plan()
    t0 = time.perf_counter()
    per_rank = raise_rank_errors(
        run_distributed(
            distributed_worker,
            nproc,
            cases,
            shape,
            tensor_model_parallel_size=1,
            timeout_s=timeout_s,
        )
    )
    control = {
        k: min(r["control"][k] for r in per_rank) for k in ("max_rel_grad_diff", "loss_rel_diff")
    }
    per_rank = [r["cases"] for r in per_rank]
    t_ref = max(r[0]["reference_s"] for r in per_rank)
    out_cases = []
    for i, case in enumerate(cases):
        rows = [r[i] for r in per_rank]
        res = CaseResult(
            name=case.name,
            nproc=nproc,
            group_sizes=rows[0]["group_sizes"],
            loss_abs_diff=max(r["loss_abs_diff"] for r in rows),
            max_abs_grad_diff=max(r["max_abs_grad_diff"] for r in rows),
            max_rel_grad_diff=max(r["max_rel_grad_diff"] for r in rows),
            loss_rel_diff=max(r["loss_rel_diff"] for r in rows),
            detail={k: rows[0][k] for k in ("worst_param", "forward_calls", "loss", "ref_loss")},
        )
        res.ok = res.loss_rel_diff <= LOSS_REL_TOL and res.max_rel_grad_diff <= GRAD_REL_TOL
        out_cases.append(res)
    return {
        "ok": all(c.ok for c in out_cases),
        "cases": [c.to_json() for c in out_cases],
        "_results": out_cases,
        "_control": control,
        "_timing": {"reference_s": t_ref, "total_s": time.perf_counter() - t0},
    }


def case_table(cases: Sequence[CaseResult]) -> str:
    lines = [
        f"{'case':36s} {'nproc':>5s} {'loss rel':>9s} {'grad rel':>9s} {'grad abs':>9s}  sizes"
    ]
    for c in cases:
        mark = "ok " if c.ok else "BAD"
        lines.append(
            f"{c.name:36s} {c.nproc:5d} {c.loss_rel_diff:9.2e} {c.max_rel_grad_diff:9.2e} "
            f"{c.max_abs_grad_diff:9.2e}  {c.group_sizes} {mark}"
        )
    return "\n".join(lines)
