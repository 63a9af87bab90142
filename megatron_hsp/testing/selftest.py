"""Selftest: distributed HSP training steps against an independent single-device reference (CPU).

HSP side: a small real megatron-core ``GPTModel`` (GQA, RoPE, fp32, HSP attention from
``megatron_hsp.megatron.spec``) runs one training step per case on N gloo processes through
``runtime.schedule.run_step`` -- the micro-batch path the Megatron hooks share -- with a
hand-written plan (``manual_plan``).

Reference side (``testing/reference.py``, no HSP code): stock megatron-core ``GPTModel`` with its
own local layer spec, each document run alone as a ``[1, L]`` sequence, per-token loss over all
documents. The reference initialises the weights; the distributed ranks load them by parameter
name (sliced along ``partition_dim`` for tensor-parallel parameters) and gather their gradients
back the same way before comparing. Every rank computes the reference itself (it is cheap and
saves a separate process).

Tolerances (fp32): loss relative difference <= 1e-6; per parameter
``||g - g_ref|| / ||g_ref|| <= 1e-5``. ``--mutations`` then plants the bugs of
``testing/mutations.py`` one at a time in the same processes and requires each to be caught.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import numpy as np

from megatron_hsp.planner.cost.costmodel import CostModel
from megatron_hsp.planner.errors import InputError
from megatron_hsp.planner.groupspace import HeadSpace
from megatron_hsp.planner.plan import Plan
from megatron_hsp.testing.manual_plan import Layout, manual_plan
from megatron_hsp.testing.mutations import CATCH_MARGIN, by_name, margin
from megatron_hsp.testing.reference import ModelShape
from megatron_hsp.testing.tolerances import CPU

GROUP_TIMEOUT = timedelta(seconds=120)
# The cases each mutation runs: a group of all ranks, three sizes in one micro-batch (size-1
# groups included), tensor parallel 2, pure ring and Ulysses x ring groups, and learned absolute
# positions over a hybrid layout (which the position-id mutation needs): enough to expose every
# planted bug at 4 and at 8 ranks while keeping --mutations short for CI.
MUTATION_CASES = (
    "one-group-of-all",
    "mixed-sizes-in-one-microbatch",
    "tp2-with-dynamic-groups",
    "ring-and-hybrid-groups",
    "learned-positions-hybrid-groups",
)


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
    # ModelShape fields this case changes (e.g. learned absolute positions, another head count).
    shape_changes: tuple[tuple[str, Any], ...] = ()
    # Dispatch in Transformer Engine's layout: every document of a ring group padded to 2 x d
    # (``dispatch.te_doc_multiple``); here the torch backend runs it, so the padding's exactness
    # is checked against the reference.
    te_layout: bool = False
    # Create this case's process groups lazily (``create_groups(lazy=True)``, after megatron's
    # ``initialize``; the step's ``GroupRegistry.ensure`` makes them), not all up front.
    lazy_groups: bool = False

    def model_shape(self, base: ModelShape) -> ModelShape:
        return dataclasses.replace(base, **dict(self.shape_changes))

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
    layouts: list[list[dict[str, int]]] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        # Exactly the keys of the contract (docs/design.md section 3).
        return {
            "name": self.name,
            "nproc": self.nproc,
            "group_sizes": self.group_sizes,
            "loss_abs_diff": self.loss_abs_diff,
            "max_abs_grad_diff": self.max_abs_grad_diff,
            "max_rel_grad_diff": self.max_rel_grad_diff,
            "layouts": self.layouts,  # per micro-batch: each group's size and Ulysses x ring
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
    """The cases for ``nproc`` processes (4 or 8), identical on every rank."""
    if nproc not in (4, 8):
        # The case table's layouts are written for 4 and 8 slots (16 indexed past its documents).
        raise InputError(f"--nproc {nproc}: the CPU selftest runs on 4 or 8 processes")
    # Plain Ulysses layouts, then tensor parallelism and ring groups, then edge cases.
    return _ulysses_cases(nproc) + _tp_and_ring_cases(nproc) + _edge_cases(nproc)


def _ulysses_cases(n: int) -> list[Case]:
    """Groups of one size and of mixed sizes, and layouts that change every micro-batch."""
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
    return cases


def _tp_and_ring_cases(n: int) -> list[Case]:
    """Dynamic groups under tensor parallelism 2, and Ulysses x ring groups."""
    tail = list(_TAIL)
    ids = list(range(len(tail)))
    cases: list[Case] = []
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
    # Ulysses x ring (heads per TP rank: 8 at tp 1, 4 at tp 2; groupspace.HeadSpace.split):
    # 6 = Ulysses 2 x ring 3 (hybrid, not a power of two), 3/5/7 = pure ring, mixed with
    # Ulysses-only groups in one micro-batch; with GQA (2 KV heads) and, below, tp 2.
    if n >= 8:
        cases.append(
            Case(
                "ring-and-hybrid-groups",
                1,
                n,
                tuple(tail),
                (
                    ((6, [0, 9]), (2, [1, 13])),
                    ((3, [2, 10]), (3, [3, 11]), (1, [4]), (1, [12])),
                    ((5, [5, 6]), (1, [8]), (2, [7])),
                ),
                data_seed=7,
            )
        )
        cases.append(
            Case(
                "tp2-ring-groups",
                2,
                s,
                tuple(tail),
                (((3, [0, 4, 9]), (1, [1, 2, 3])), ((2, [5, 6]), (2, [7, 8, 10, 11, 12, 13]))),
                data_seed=8,
            )
        )
    else:
        cases.append(
            Case(
                "ring-and-hybrid-groups",
                1,
                n,
                tuple(tail),
                (((3, [0, 5, 9, 13]), (1, [1, 6, 10])), ((4, [2, 3, 4, 7, 8, 11, 12]),)),
                data_seed=7,
            )
        )
    return cases


def _edge_cases(n: int) -> list[Case]:
    """TE's padded layout, 1-token documents, a document at its group's memory limit, learned
    absolute positions."""
    tail = list(_TAIL)
    cases: list[Case] = []
    # Transformer Engine's layout (each document of a ring group padded to 2 x d inside its own
    # segment) run by the torch backend: a pure ring of 3 and, on 8, Ulysses 2 x ring 3.
    te_groups: Layout = ((6, [0, 3, 9]), (2, [1, 13])) if n >= 8 else ((3, [0, 3, 9]), (1, [1, 13]))
    cases.append(
        Case(
            "te-layout-padded-documents",
            1,
            n,
            tuple(tail),
            (te_groups, ((n, [2, 4, 5, 6, 7, 8, 10, 11, 12]),)),
            data_seed=10,
            te_layout=True,
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
    # Megatron's default learned absolute position embeddings (the model reads the dispatched
    # position ids; RoPE cases never do) over hybrid layouts: 6 query / 2 KV heads make a group
    # of 4 Ulysses 2 x ring 2, of 8 Ulysses 2 x ring 4, of 5 pure ring.
    learned = (
        ("position_embedding_type", "learned_absolute"),
        ("num_attention_heads", 6),
        ("hidden_size", 36),
    )
    if n >= 8:
        learned_layout: tuple[Layout, ...] = (
            ((4, [0, 9]), (2, [1, 13]), (1, [2]), (1, [10])),
            ((5, [3, 11]), (1, [4]), (2, [5, 6])),
            ((8, [7, 8, 12]),),
        )
    else:
        learned_layout = (((4, [0, 9, 13]),), ((2, [1, 2, 10]), (1, [3, 4]), (1, [5, 6, 11])))
        learned_layout += (((4, [7, 8, 12]),),)
    cases.append(
        Case(
            "learned-positions-hybrid-groups",
            1,
            n,
            tuple(tail),
            learned_layout,
            data_seed=9,
            shape_changes=learned,
        )
    )
    return cases


# ---------------------------------------------------------------------------------- model


def build_model(
    shape: ModelShape, device: Any = "cpu", dtype: str = "fp32", backend: str = "torch"
):
    """The HSP side: megatron-core ``GPTModel`` with the HSP attention spec (CPU fp32 unless the
    acceptance kit asks for a device and bf16).

    Untied embeddings (GPTModel's default), so the output layer's gradient is compared on its
    own; the TP size comes from megatron's parallel state (the tp=2 case). Initialised from
    another seed than the reference on purpose: its weights must come from ``load_full_weights``.
    """
    from megatron_hsp.testing.dist import tiny_gpt_model

    return tiny_gpt_model(
        num_layers=shape.num_layers,
        hidden_size=shape.hidden_size,
        num_attention_heads=shape.num_attention_heads,
        num_query_groups=shape.num_query_groups,
        kv_channels=shape.kv_channels,
        ffn_hidden_size=shape.ffn_hidden_size,
        vocab_size=shape.vocab_size,
        max_sequence_length=shape.max_sequence_length,
        position_embedding_type=shape.position_embedding_type,
        seed=shape.seed + 1,
        attention_backend=backend,
        tensor_model_parallel_size=_tp_size(),
        calculate_per_token_loss=True,
        device=device,
        **_dtype_config(dtype),
    )


def _dtype_config(dtype: str) -> dict[str, Any]:
    import torch

    if dtype == "fp32":
        return {}
    if dtype == "bf16":
        return {"bf16": True, "params_dtype": torch.bfloat16}
    raise InputError(f"dtype {dtype!r}: choose fp32 or bf16")


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
    from megatron.core import parallel_state as ps

    from megatron_hsp.runtime.comm import comm

    out = {}
    tp = _tp_size()
    for name, p in model.named_parameters():
        g = p.grad if p.grad is not None else torch.zeros_like(p)
        if _is_tp_sharded(p):
            parts = [torch.empty_like(g) for _ in range(tp)]
            comm().all_gather(parts, g.contiguous(), ps.get_tensor_model_parallel_group())
            g = torch.cat(parts, dim=p.partition_dim)
        out[name] = g.detach().float().cpu()  # compared with the fp32 host-CPU reference
    return out


# ---------------------------------------------------------------------------------- workers


def _compare(
    grads: dict[str, Any], ref_grads: dict[str, Any]
) -> tuple[float, float, str, dict[str, float]]:
    """(max abs difference, max over parameters of ||g - g_ref|| / ||g_ref||, worst parameter,
    that relative difference per parameter)."""
    by_param = _relative_by_param(grads, ref_grads)
    max_abs, max_rel, worst = 0.0, 0.0, ""
    for name, g_ref in ref_grads.items():
        max_abs = max(max_abs, float((grads[name] - g_ref).abs().max()))
        if by_param[name] > max_rel:
            max_rel, worst = by_param[name], name
    return max_abs, max_rel, worst, by_param


def _relative_by_param(grads: dict[str, Any], ref_grads: dict[str, Any]) -> dict[str, float]:
    """Per parameter ``||g - g_ref|| / ||g_ref||`` (``_compare``'s relative measure)."""
    return {
        n: float((grads[n].float() - g).norm() / g.norm().clamp_min(1e-30))
        for n, g in ref_grads.items()
    }


def compute_reference(
    cases: list[Case], shape: ModelShape, bf16_noise: bool = False
) -> dict[str, Any]:
    """Initial weights per model shape, and per case the reference loss and gradients
    (``testing/reference.py``: stock megatron-core, one document at a time, tensor parallel 1,
    no collective). Identical on every rank: CPU initialisation from one seed.

    ``bf16_noise`` (the acceptance kit's bf16 rows): also, per case and parameter, how far the
    same stock model in bf16 (``bf16_reference_model``) lands from the fp32 gradients,
    ``||g - g_ref|| / ||g_ref||``: the yardstick of ``tolerances.BF16_NOISE_FACTOR``."""
    from megatron_hsp.testing.reference import (
        bf16_reference_model,
        initial_weights,
        reference_model,
        reference_step,
    )

    models: dict[Any, Any] = {}
    out: dict[str, Any] = {"weights": {}, "cases": {}}
    for case in cases:
        case_shape = case.model_shape(shape)
        if case_shape not in models:
            models[case_shape] = reference_model(case_shape)
            out["weights"][case_shape] = initial_weights(models[case_shape])
        docs = case.documents(shape.vocab_size)
        loss, grads = reference_step(models[case_shape], docs)
        out["cases"][case.name] = {"loss": loss, "grads": grads}
        if bf16_noise:
            if ("bf16", case_shape) not in models:
                models["bf16", case_shape] = bf16_reference_model(case_shape)
            _, low = reference_step(models["bf16", case_shape], docs)
            out["cases"][case.name]["bf16_rel"] = _relative_by_param(low, grads)
    return out


@dataclass
class _WorkerState:
    """The HSP model and groups of one worker, rebuilt only when the tensor-parallel size or the
    case's model shape changes (weights never change: a step computes gradients, no optimizer
    runs). Group registries are kept per (tp, heads): creating groups is collective and slow."""

    rank: int
    world_size: int
    shape: ModelShape
    weights: dict[ModelShape, dict[str, Any]]
    model: Any = None
    registry: Any = None
    key: tuple[int, ModelShape, bool] | None = None
    device: Any = None  # None: the CPU (the selftest); a CUDA device under the acceptance kit
    dtype: str = "fp32"
    backend: str = "torch"  # HSP attention backend (the kit adds "te" where TE imports)
    ranks_share_device: bool = False  # the kit's many-ranks-on-one-GPU mode (gloo, staged)
    registries: dict[tuple[int, HeadSpace, bool], Any] = field(default_factory=dict)

    def for_case(self, case: Case) -> None:
        from megatron.core import parallel_state as ps

        from megatron_hsp.runtime.groups import create_groups_from_megatron
        from megatron_hsp.testing.dist import init_megatron

        shape = case.model_shape(self.shape)
        if self.key == (case.tp, shape, case.lazy_groups):
            return
        if ps.get_tensor_model_parallel_world_size() != case.tp:
            # Re-initialise megatron's static groups (dist stays up; init_method unused).
            init_megatron(
                self.rank,
                self.world_size,
                "",
                device=self.device,
                tensor_model_parallel_size=case.tp,
                ranks_share_device=self.ranks_share_device,
            )
        self.model = build_model(shape, self.device or "cpu", self.dtype, self.backend)
        load_full_weights(self.model, self.weights[shape])
        heads = self.heads(case)
        reg_key = (case.tp, heads, case.lazy_groups)
        if reg_key not in self.registries:
            self.registries[reg_key] = create_groups_from_megatron(
                self.world_size, timeout=GROUP_TIMEOUT, heads=heads, lazy=case.lazy_groups
            )
        self.registry = self.registries[reg_key]
        self.key = (case.tp, shape, case.lazy_groups)

    def heads(self, case: Case) -> HeadSpace:
        shape = case.model_shape(self.shape)
        return HeadSpace.from_model(shape.num_attention_heads, shape.num_query_groups, case.tp)


def _layouts(plan: Plan, heads: HeadSpace) -> list[list[dict[str, int]]]:
    """Per micro-batch, each group's size and the (Ulysses, ring) split it ran with."""
    out = []
    for mb in plan.microbatches:
        row = []
        for g in mb.groups:
            u, r = heads.split(g.size)
            row.append({"size": g.size, "ulysses": u, "ring": r})
        out.append(row)
    return out


def run_case(state: _WorkerState, case: Case, reference: dict[str, Any]) -> dict[str, Any]:
    """One case's HSP step on this rank (the production path), compared with the reference."""
    import torch
    from megatron.core import parallel_state as ps

    from megatron_hsp.runtime.agreement import agree_on_plan, check_executable
    from megatron_hsp.runtime.dispatch import GlobalBatch
    from megatron_hsp.runtime.schedule import run_step

    state.for_case(case)
    shape = case.model_shape(state.shape)
    t0 = time.perf_counter()
    plan = agree_on_plan(case.plan(), mode="verify")
    check_executable(
        plan,
        state.registry,
        num_attention_heads=shape.num_attention_heads,
        num_query_groups=shape.num_query_groups,
        lengths=case.lengths,
    )
    res = run_step(
        state.model,
        plan,
        GlobalBatch.from_documents(case.documents(shape.vocab_size)),
        state.registry,
        grad_group=ps.get_data_parallel_group(with_context_parallel=True),
        device=torch.device(state.device or "cpu"),
        # The TE backend gets TE's layout, as the Megatron hooks give it (its CP route needs it).
        te_layout=case.te_layout or state.backend == "te",
    )
    grads = full_gradients(state.model)
    ref = reference["cases"][case.name]
    max_abs, max_rel, worst, by_param = _compare(grads, ref["grads"])
    loss_abs = abs(res.loss - ref["loss"])
    return {
        "name": case.name,
        "loss_abs_diff": loss_abs,
        "loss_rel_diff": loss_abs / max(abs(ref["loss"]), 1e-30),
        "max_abs_grad_diff": max_abs,
        "max_rel_grad_diff": max_rel,
        "worst_param": worst,
        "grad_rel_by_param": by_param,
        "stock_bf16_rel": ref.get("bf16_rel") if state.dtype == "bf16" else None,
        "group_sizes": [mb.group_sizes for mb in plan.microbatches],
        "layouts": _layouts(plan, state.heads(case)),
        "forward_calls": res.forward_calls,
        "skipped_microbatches": res.skipped_microbatches,
        "step_s": time.perf_counter() - t0,
        "loss": res.loss,
        "ref_loss": ref["loss"],
    }


def distributed_worker(
    rank: int,
    world_size: int,
    cases: list[Case],
    shape: ModelShape,
    mutation_names: list[str] | None = None,
) -> dict[str, Any]:
    """On every rank: the reference, each case's HSP step compared with it, then (if asked) the
    mutation cases once per planted mutation, in the same order on every rank."""
    t_ref = time.perf_counter()
    reference = compute_reference(cases, shape)
    t_ref = time.perf_counter() - t_ref
    state = _WorkerState(rank, world_size, shape, reference["weights"])
    results = [run_case(state, case, reference) for case in cases]
    rows: dict[str, dict[str, Any]] = {}
    if mutation_names is not None:
        # Case-major order: the model and groups change once per case, not once per mutation.
        muts = by_name(mutation_names)
        rows = {m.name: {"name": m.name, "cases": [], "error": None, "seconds": 0.0} for m in muts}
        for case in (c for c in cases if c.name in MUTATION_CASES):
            for mutation in muts:
                row = rows[mutation.name]
                if row["error"] is not None:
                    continue  # refused already (on every rank: the same plan and data)
                t0 = time.perf_counter()
                undo = mutation.plant()
                try:
                    row["cases"].append(run_case(state, case, reference))
                except Exception as exc:  # a refusal by the real code counts
                    row["error"] = f"{type(exc).__name__}: {exc}"[:500]
                finally:
                    undo()
                row["seconds"] += time.perf_counter() - t0
    return {"cases": results, "mutations": list(rows.values()), "reference_s": t_ref}


# ---------------------------------------------------------------------------------- driver


@dataclass
class MutationResult:
    name: str
    breaks: str
    caught: bool
    loss_rel_diff: float | None
    max_rel_grad_diff: float | None
    margin: float | None
    error: str | None = None
    seconds: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "caught": self.caught,
            "loss_rel_diff": self.loss_rel_diff,
            "max_rel_grad_diff": self.max_rel_grad_diff,
        }


def _mutation_result(name: str, rows: list[dict[str, Any]]) -> MutationResult:
    """Worst over ranks and cases; caught per the rule in ``testing/mutations.py``."""
    (mutation,) = by_name([name])
    errors = [r["error"] for r in rows if r["error"]]
    seconds = max(r["seconds"] for r in rows)
    if errors:
        return MutationResult(
            name,
            mutation.breaks,
            caught=len(errors) == len(rows),  # refused on every rank
            loss_rel_diff=None,
            max_rel_grad_diff=None,
            margin=None,
            error=errors[0],
            seconds=seconds,
        )
    loss_rel = max(c["loss_rel_diff"] for r in rows for c in r["cases"])
    grad_rel = max(c["max_rel_grad_diff"] for r in rows for c in r["cases"])
    m = margin(loss_rel, grad_rel, CPU.loss, CPU.grad)
    return MutationResult(
        name,
        mutation.breaks,
        caught=m >= CATCH_MARGIN,
        loss_rel_diff=loss_rel,
        max_rel_grad_diff=grad_rel,
        margin=m,
        seconds=seconds,
    )


def run_selftest(
    nproc: int,
    shape: ModelShape | None = None,
    timeout_s: float = 600.0,
    *,
    mutations: list[str] | None = None,
) -> dict:
    """Run every case on ``nproc`` gloo processes; the ``selftest --json`` document plus timing.

    ``mutations``: names from ``testing/mutations.py`` to plant one after another (``[]`` none,
    None skips the mutation suite). With mutations, ``ok`` also needs every one caught.
    """
    from megatron_hsp.testing.dist import raise_rank_errors, run_distributed

    shape = shape or ModelShape()
    cases = build_cases(nproc)
    for c in cases:  # fail fast, before spawning anything, on a broken case table
        c.plan()
    if mutations is not None:
        by_name(mutations)  # unknown names fail before spawning
    t0 = time.perf_counter()
    per_rank = raise_rank_errors(
        run_distributed(
            distributed_worker,
            nproc,
            cases,
            shape,
            mutations,
            tensor_model_parallel_size=1,
            timeout_s=timeout_s,
        )
    )
    out_cases = []
    for i, case in enumerate(cases):
        rows = [r["cases"][i] for r in per_rank]
        res = CaseResult(
            name=case.name,
            nproc=nproc,
            group_sizes=rows[0]["group_sizes"],
            layouts=rows[0]["layouts"],
            loss_abs_diff=max(r["loss_abs_diff"] for r in rows),
            max_abs_grad_diff=max(r["max_abs_grad_diff"] for r in rows),
            max_rel_grad_diff=max(r["max_rel_grad_diff"] for r in rows),
            loss_rel_diff=max(r["loss_rel_diff"] for r in rows),
            detail={k: rows[0][k] for k in ("worst_param", "forward_calls", "loss", "ref_loss")},
        )
        res.ok = res.loss_rel_diff <= CPU.loss and res.max_rel_grad_diff <= CPU.grad
        out_cases.append(res)
    out_mutations = [
        _mutation_result(m["name"], [r["mutations"][j] for r in per_rank])
        for j, m in enumerate(per_rank[0]["mutations"])
    ]
    doc: dict[str, Any] = {
        "ok": all(c.ok for c in out_cases) and all(m.caught for m in out_mutations),
        "cases": [c.to_json() for c in out_cases],
    }
    if mutations is not None:
        doc["mutations"] = [m.to_json() for m in out_mutations]
    doc.update(
        {
            "_results": out_cases,
            "_mutations": out_mutations,
            "_timing": {
                "reference_s": max(r["reference_s"] for r in per_rank),
                "total_s": time.perf_counter() - t0,
            },
        }
    )
    return doc


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


def mutation_table(mutations: Sequence[MutationResult]) -> str:
    """One line per planted bug: worst differences, margin over the tolerance, verdict."""

    def num(x: float | None) -> str:
        return f"{x:9.2e}" if x is not None else f"{'-':>9s}"

    lines = [f"{'mutation':36s} {'loss rel':>9s} {'grad rel':>9s} {'x tol':>9s}  verdict"]
    for m in mutations:
        verdict = "caught" if m.caught else "SURVIVED"
        if m.error:
            verdict += f" (refused: {m.error[:80]})"
        lines.append(
            f"{m.name:36s} {num(m.loss_rel_diff)} {num(m.max_rel_grad_diff)} {num(m.margin)}  "
            f"{verdict}"
        )
    return "\n".join(lines)
