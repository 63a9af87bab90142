"""One training step of a plan: micro-batches in plan order, the group switched per micro-batch.

The per-micro-batch path is shared with the Megatron integration: ``to_model_inputs`` (a
dispatched pack -> model inputs), ``forward_microbatch`` (the model call, or a zero output tied
to the parameters for a group without sequences) and ``loss.microbatch_loss`` (Megatron's
per-token-loss contract) are what ``run_step`` calls here and what ``megatron_hsp.megatron.hooks``
(``begin_step``, ``hsp_forward_step``, ``_loss_func``) calls under Megatron's own schedule. So
the selftest, which drives ``run_step``, checks the code users train with; only the outer loop
(this function vs Megatron's ``forward_backward_func`` + DDP) differs.

Why no barrier is needed between micro-batches: every rank belongs to exactly one group in every
micro-batch and walks the micro-batches in the same (plan) order, so the collectives a group
issues in micro-batch ``m`` are matched by exactly its own members, whatever the group sizes in
``m - 1`` or ``m + 1`` were. A group with no sequences in a micro-batch skips it -- all its members
see the same plan, so they skip consistently and no partner waits on them; they still join the
step's single gradient all-reduce (with zero gradients if they trained nothing).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist
from megatron.core.packed_seq_params import PackedSeqParams

from megatron_hsp.planner.plan import Plan
from megatron_hsp.runtime.dispatch import GlobalBatch, PackedMicroBatch, dispatch
from megatron_hsp.runtime.groups import GroupRegistry
from megatron_hsp.runtime.loss import (
    LossAccumulator,
    allreduce_gradients,
    microbatch_loss,
    reduce_step_loss,
)
from megatron_hsp.runtime.moe import MoEMicroBatch, micro_batch
from megatron_hsp.runtime.packed import group_packed_seq_params


@dataclass
class ModelInputs:
    """Tensors for one ``GPTModel`` call (batch dimension 1, THD packing)."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor
    packed_seq_params: PackedSeqParams
    # The document map MoE routers read (``runtime.moe``): megatron-core calls MoE layers
    # without ``packed_seq_params``.
    moe: MoEMicroBatch | None = None


def packed_seq_params(
    pack: PackedMicroBatch,
    group: dist.ProcessGroup,
    device: torch.device,
    hybrid: tuple[dist.ProcessGroup | None, dist.ProcessGroup] | None = None,
) -> PackedSeqParams:
    """megatron-core's per-call seam: THD ``cu_seqlens`` of the whole group buffer + its group.

    ``hybrid``: the block's (Ulysses, ring) sub-groups (``GroupRegistry.hybrid``) when it runs
    ring attention; the attention reads them from the params' per-micro-batch cache.
    """
    return group_packed_seq_params(
        torch.from_numpy(pack.cu_seqlens).to(device),
        group,
        hybrid,
        cu_host=pack.cu_seqlens.tolist(),  # numpy on the host: no device read-back
        max_seqlen=pack.max_seqlen,
        layout_ring=pack.ring,
    )


def to_model_inputs(
    pack: PackedMicroBatch,
    group: dist.ProcessGroup,
    device: torch.device,
    hybrid: tuple[dist.ProcessGroup | None, dist.ProcessGroup] | None = None,
) -> ModelInputs:
    def t(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(a).to(device).unsqueeze(0)

    return ModelInputs(
        input_ids=t(pack.input_ids),
        position_ids=t(pack.position_ids),
        labels=t(pack.labels),
        loss_mask=t(pack.loss_mask),
        packed_seq_params=packed_seq_params(pack, group, device, hybrid),
        moe=MoEMicroBatch(
            torch.from_numpy(pack.document_index()).to(device), len(pack.seq_ids), group
        ),
    )


def step_inputs(
    batch: GlobalBatch,
    plan: Plan,
    registry: GroupRegistry,
    device: torch.device,
    *,
    local_multiple: int = 1,
    te_layout: bool = False,
    run_empty_groups: bool = False,
) -> list[ModelInputs | None]:
    """This rank's model inputs for every micro-batch of ``plan`` (None: its group trains nothing
    in that micro-batch), each bound to the plan group's process group.

    The token layout follows each group's recorded Ulysses x ring split (``Group.ring``); a plan
    agreed by ``step.pipeline`` already has every split recorded and checked against the registry
    (``agreement.resolve_splits`` / ``executable_problems``). A plan that left a split unrecorded
    (a hand-made one, a cost model without heads) gets the registry's here. The attention
    refuses a pack whose layout differs from its sub-groups' (``packed.py``), so a recorded split
    the registry cannot run fails loudly instead of mixing tokens. Sizes a lazy registry has not
    created yet are created here first: every rank calls this with the same agreed plan.
    ``te_layout`` pads each document of a ring group for Transformer Engine's own context-parallel
    route (``dispatch.te_doc_multiple``); the step is exact either way.
    ``run_empty_groups``: a group with no documents in a micro-batch runs the model on a buffer of
    padding instead of skipping it (expert parallelism: its ranks must join the MoE layers'
    all-to-alls with the ranks of other groups).
    """
    from megatron_hsp.runtime.agreement import resolve_splits

    registry.ensure(plan.group_sizes_used)  # lazy registry: every rank, same agreed sizes
    packs = dispatch(
        batch,
        resolve_splits(plan, registry),
        registry.slot,
        local_multiple=local_multiple,
        te_layout=te_layout,
        pad_empty=run_empty_groups,
    )
    return [
        None
        if p.empty and not run_empty_groups
        else to_model_inputs(
            p,
            registry.group(p.group_size, p.block),
            device,
            registry.hybrid(p.group_size, p.block),
        )
        for p in packs
    ]


def forward_microbatch(
    model: torch.nn.Module, inputs: ModelInputs | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(model output, loss mask) of one micro-batch; the output is the per-token loss ``[1, T]``.

    ``inputs`` None (the rank's group has no sequences in this micro-batch): the model is not run
    -- all members of the group skip it together, so no partner waits -- and the output is a zero
    tied to every trainable parameter with an all-zero mask, so backward and the step's gradient
    reduction stay identical on every rank.

    Under pipeline parallelism (``_idle_stage_output``) a stage that is not the last returns a
    zero activation ``[1, 1, hidden]`` instead, which Megatron's schedule sends on (its
    ``variable_seq_lengths`` handshake carries the shape), and a stage that is not the first
    ties the zero to the activation it received, so a (zero) gradient flows back to the stage
    before: every send and receive of the schedule has its partner.
    """
    if inputs is None:
        params = [p for p in model.parameters() if p.requires_grad]
        zero = sum((p.view(-1)[:1] * 0.0).sum() for p in params)
        return _idle_stage_output(model, zero)
    with micro_batch(inputs.moe):
        output = model(
            inputs.input_ids,
            inputs.position_ids,
            None,
            labels=inputs.labels,
            loss_mask=inputs.loss_mask,
            packed_seq_params=inputs.packed_seq_params,
        )
    return output, inputs.loss_mask


def _idle_stage_output(
    model: torch.nn.Module, zero: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(output, loss mask) of an idle micro-batch on this pipeline stage (``forward_microbatch``).

    The stage is read from the (possibly DDP-wrapped) ``GPTModel``: ``pre_process`` (it embeds
    tokens, else it received ``decoder.input_tensor``) and ``post_process`` (it computes the
    loss, else it sends an activation). Without a pipeline both are true: ``[1, 1]`` zero loss.
    """
    from megatron.core.utils import get_attr_wrapped_model

    def stage(attr: str) -> bool:
        try:
            return bool(get_attr_wrapped_model(model, attr))
        except RuntimeError:  # not a megatron-core model (tests' toys): no pipeline
            return True

    if not stage("pre_process"):
        received = get_attr_wrapped_model(model, "decoder").input_tensor
        if received is not None:
            zero = zero + (received.view(-1)[:1] * 0.0).sum()
    mask = torch.zeros(1, 1, device=zero.device)
    if not stage("post_process"):
        hidden = get_attr_wrapped_model(model, "config").hidden_size
        return zero * torch.zeros(1, 1, hidden, device=zero.device, dtype=zero.dtype), mask
    return zero.view(1, 1), mask


@dataclass
class StepResult:
    loss: float
    num_loss_tokens: int
    forward_calls: int
    skipped_microbatches: list[int] = field(default_factory=list)
    dispatch_ms: float = 0.0
    grad_numel: int = 0
    # Host wall time of each micro-batch's forward + backward on this rank. On the CPU (the demo)
    # that is its compute; on CUDA, without a sync, it would be launch time only.
    microbatch_s: list[float] = field(default_factory=list)


def run_step(
    model: torch.nn.Module,
    plan: Plan,
    batch: GlobalBatch,
    registry: GroupRegistry,
    *,
    grad_group: dist.ProcessGroup | None,
    device: torch.device,
    local_multiple: int = 1,
    te_layout: bool = False,
) -> StepResult:
    """Forward/backward every micro-batch of ``plan`` on this rank, then one gradient all-reduce.

    ``plan`` must already be agreed (``agreement.agree_on_plan``). ``grad_group`` is the data x
    context parallel group of this rank's tensor-parallel rank (megatron's
    ``get_data_parallel_group(with_context_parallel=True)``). Gradients are zeroed first; after
    the call they equal the single-device gradients of the per-token loss of ``batch``.
    """
    if registry.layout.pipeline_parallel != 1:
        raise NotImplementedError(
            "run_step executes plans with pipeline parallel size 1 only; the group registry "
            "supports pp > 1 but the micro-batch loop does not interleave pipeline stages"
        )
    n_global = batch.num_loss_tokens
    scale = 1.0 / max(n_global, 1)
    t0 = time.perf_counter()
    inputs_per_mb = step_inputs(
        batch, plan, registry, device, local_multiple=local_multiple, te_layout=te_layout
    )
    dispatch_ms = (time.perf_counter() - t0) * 1e3
    model.zero_grad(set_to_none=True)
    acc = LossAccumulator()
    result = StepResult(loss=0.0, num_loss_tokens=0, forward_calls=0, dispatch_ms=dispatch_ms)
    for m, inputs in enumerate(inputs_per_mb):
        t_mb = time.perf_counter()
        output, loss_mask = forward_microbatch(model, inputs)
        loss_sum, num_tokens = microbatch_loss(output, loss_mask)
        objective = loss_sum * scale
        objective.backward()
        result.microbatch_s.append(time.perf_counter() - t_mb)
        acc.add(loss_sum, int(num_tokens), objective)
        if inputs is None:
            result.skipped_microbatches.append(m)
        else:
            result.forward_calls += 1
    result.grad_numel = allreduce_gradients(model.parameters(), grad_group)
    _total, count, objective = reduce_step_loss(acc, grad_group, device)
    if count != n_global:
        raise RuntimeError(
            f"token accounting: the ranks trained {count} loss tokens but the batch has {n_global}"
        )
    result.loss = objective  # what was back-propagated: sum of token losses / N (loss.py)
    result.num_loss_tokens = count
    return result
