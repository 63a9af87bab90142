"""Per-token loss and the step's single gradient all-reduce.

Why the plain sum is right. Groups train different numbers of tokens, so averaging per group or
per micro-batch would weigh tokens unequally; the step loss is Megatron's
``calculate_per_token_loss`` form, ``sum of token losses / number of loss tokens of the whole
global batch`` (``N``, known on every rank from the batch before the step starts). Each rank
back-propagates ``(its slice's loss sum) / N``. Inside a sequence-parallel group every rank holds
the same parameters but only its slice of the activations; the Ulysses all-to-all is
differentiable, so the gradient a rank accumulates is exactly the part of ``dL/dtheta`` that flows
through the operations it executed (its slice of the linear layers, its heads of the attention).
Those parts are disjoint across the ranks of the group and across groups, so the *sum* of all
data x context ranks' gradients is the single-device gradient -- no division by the number of
ranks, which is what Megatron's DDP does under ``calculate_per_token_loss`` as well.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_hsp.runtime.comm import comm


@dataclass
class LossAccumulator:
    """Running (loss sum, loss-token count, back-propagated objective) over this rank's
    micro-batches of one step.

    ``objective`` is the sum of the very tensors ``backward`` was called on (``loss sum / N``).
    The step reports their global sum as its loss, so a normalisation error on any rank (a wrong
    ``N``, a rescaled slice) shows in the loss as well as in the gradients, instead of the loss
    being recomputed on a side path that the gradients never took.
    """

    loss_sum: float = 0.0
    num_tokens: int = 0
    objective: float = 0.0

    def add(
        self, loss_sum: torch.Tensor, num_tokens: int, objective: torch.Tensor | None = None
    ) -> None:
        self.loss_sum += float(loss_sum.detach())
        self.num_tokens += int(num_tokens)
        if objective is not None:
            self.objective += float(objective.detach())


def microbatch_loss(
    output_tensor: torch.Tensor, loss_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss sum, loss-token count) of one micro-batch: Megatron's ``--calculate-per-token-loss``
    contract, the ONE loss reduction of both step paths (``schedule.run_step`` and the Megatron
    loss function in ``megatron_hsp.megatron.hooks``).

    ``output_tensor`` is the model's per-token loss (``[1, T_local]``); ``loss_mask`` is 1 for
    tokens with a target, 0 for documents' last tokens and padding. The count is an int tensor,
    as Megatron's schedule sums it into ``total_num_tokens``; the step divides by the global sum.
    """
    mask = loss_mask.reshape(-1).float()
    loss_sum = (output_tensor.reshape(-1).float() * mask).sum()
    return loss_sum, mask.sum().to(torch.int)


def reduce_step_loss(
    acc: LossAccumulator, group: dist.ProcessGroup | None, device: torch.device
) -> tuple[float, int, float]:
    """Global (loss sum, loss-token count, objective) over ``group`` (the data x context ranks of
    one tensor parallel rank): one all-reduce of three numbers."""
    t = torch.tensor(
        [acc.loss_sum, float(acc.num_tokens), acc.objective], dtype=torch.float64, device=device
    )
    comm().all_reduce(t, group)
    return float(t[0]), round(float(t[1])), float(t[2])


def allreduce_gradients(
    params: Iterable[torch.nn.Parameter], group: dist.ProcessGroup | None
) -> int:
    """Sum every parameter's gradient over ``group`` in ONE flat all-reduce; returns its numel.

    Parameters without a gradient on this rank (e.g. it trained nothing this step) join with
    zeros, so every rank issues the identical collective.
    """
    params = [p for p in params if p.requires_grad]
    if not params:
        return 0
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    grads = [p.grad for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    comm().all_reduce(flat, group)
    offset = 0
    for g in grads:
        n = g.numel()
        g.copy_(flat[offset : offset + n].view_as(g))
        offset += n
    return int(flat.numel())
