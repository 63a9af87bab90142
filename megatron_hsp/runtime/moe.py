"""MoE routers under HSP: the load-balancing losses that depend on how tokens are laid out.

Why this module exists. Megatron's MoE layer routes each token on its own, so dropless routing
and the experts' outputs do not depend on how documents are packed or split over ranks. Two
router losses do:

* the per-sequence load-balancing loss (``--moe-router-load-balancing-type seq_aux_loss``):
  megatron-core computes it per *sample* of a ``[S, B]`` micro-batch, reducing the expert counts
  over its static TP x CP group. Under HSP a micro-batch is one packed THD buffer ``[T, 1]`` of
  several documents, and a long document is split over the plan group's ranks, so the stock
  router would treat the whole pack as one sequence and reduce over the wrong group;
* the router z-loss (``--moe-z-loss-coeff``): per token, but megatron-core counts every token it
  is handed, and HSP's buffers carry padding tokens (a trailing segment per group buffer).

``HSPTopKRouter`` (swapped into MoE layer specs by ``megatron.spec.with_hsp_attention``) computes
the per-sequence loss per *document* of the pack, with each document's expert counts summed over
the plan group that holds its tokens, and leaves padding out of both losses. The micro-batch's
document map reaches the router through ``micro_batch`` (set by ``schedule.forward_microbatch``
around the model call): megatron-core calls the MoE layer without ``packed_seq_params``.

Scaling, for exactness against stock Megatron training each document as its own ``[1, L]``
micro-batch under ``--calculate-per-token-loss`` (which HSP requires): stock attaches
``aux_d x L_d`` per document (``attach_and_log_load_balancing_loss``: loss x local tokens x
TP-CP size) and ``MoEAuxLossAutoScaler`` scales it by 1; the global token count divides every
gradient in ``finalize_model_grads``. Here each rank attaches ``sum_d partial_d x L_d``, where
``partial_d`` is the part of document ``d``'s loss its own tokens carry (the probabilities are
local, the counts are the group's); summed over the group's ranks by the gradient reduction,
that is the stock sum. The micro-batch-level ``aux_loss`` and the accumulated ``global_aux_loss``
depend on which documents share a micro-batch (in stock Megatron too) and are refused at
argument time (``megatron.refusals``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core.transformer.moe.moe_utils import switch_load_balancing_loss_func
from megatron.core.transformer.moe.router import TopKRouter

from megatron_hsp.runtime.comm import comm


@dataclass(frozen=True)
class MoEMicroBatch:
    """What the router needs of the packed micro-batch it is called on.

    ``documents``: per local token, the index of its document in the group buffer (0 ..
    ``num_documents - 1``), -1 for padding; ``group``: the plan group holding the documents.
    """

    documents: torch.Tensor
    num_documents: int
    group: dist.ProcessGroup | None

    @property
    def padding(self) -> torch.Tensor:
        return self.documents < 0

    def rows(self) -> torch.Tensor:
        """Per local token, its row of a ``[num_documents + 1, ...]`` accumulator: its document,
        or the extra last row for padding (dropped after the sum). Why: selecting the real
        tokens with a boolean mask has a data-dependent shape, a device-to-host sync on CUDA in
        every MoE layer of every micro-batch; a fixed-shape ``index_add`` into a spare row has
        none."""
        return torch.where(self.padding, self.num_documents, self.documents)


def per_document_sum(values: torch.Tensor, state: MoEMicroBatch) -> torch.Tensor:
    """``[num_documents, E]``: ``values`` ``[tokens, E]`` summed per document, padding left
    out, with no data-dependent shape (``MoEMicroBatch.rows``)."""
    out = values.new_zeros(state.num_documents + 1, values.shape[1])
    return out.index_add(0, state.rows(), values)[: state.num_documents]


_CURRENT: ContextVar[MoEMicroBatch | None] = ContextVar("hsp_moe_micro_batch", default=None)


@contextlib.contextmanager
def micro_batch(state: MoEMicroBatch | None) -> Iterator[None]:
    """The packed micro-batch the model is called on, for the routers inside the call."""
    token = _CURRENT.set(state)
    try:
        yield
    finally:
        _CURRENT.reset(token)


def current_micro_batch() -> MoEMicroBatch | None:
    return _CURRENT.get()


def tokens_per_expert_per_document(routing_map: torch.Tensor, state: MoEMicroBatch) -> torch.Tensor:
    """``[num_documents, experts]`` expert counts of each document over its whole group: the
    local counts summed over the plan group (the ranks that hold the document's tokens)."""
    counts = per_document_sum(routing_map.to(torch.float32), state)
    if state.group is not None and state.group.size() > 1:
        comm().all_reduce(counts, state.group)
    return counts


class HSPTopKRouter(TopKRouter):
    """megatron-core's ``TopKRouter`` with the per-document sequence aux loss and a z-loss
    without padding when it runs on an HSP packed micro-batch (``micro_batch`` set); outside one
    (stock calls, evaluation without HSP) it is exactly ``TopKRouter``."""

    def _apply_seq_aux_loss(
        self,
        probs: torch.Tensor,
        scores_for_aux_loss: torch.Tensor,
        routing_map: torch.Tensor,
        seq_length: int,
        bsz: int,
        with_padding_mask: bool = False,
    ) -> torch.Tensor:
        state = current_micro_batch()
        coeff = self.get_aux_loss_coeff("seq_aux_loss")
        if state is None or coeff == 0:
            return super()._apply_seq_aux_loss(
                probs, scores_for_aux_loss, routing_map, seq_length, bsz, with_padding_mask
            )
        check_micro_batch(state, scores_for_aux_loss.shape[0], self.tp_cp_group)
        counts = tokens_per_expert_per_document(routing_map, state)  # [docs, E]
        lengths = counts.sum(dim=1) / self.topk  # each document's tokens, whole group
        # Per document d of L_d tokens, megatron-core's switch loss is
        #   E x coeff / (k x L_d^2) x sum_e P[d, e] x f[d, e]
        # (P: the sum of its tokens' scores per expert, here only this rank's tokens, the part
        # of the loss they carry; f: its expert counts over the group), and stock weighs it by
        # L_d. The sum over documents of that product is one switch loss over the flattened
        # [docs x E] terms P x f / L_d with unit counts and T = 1: megatron-core's own function
        # computes it, with no per-document host read of L_d (no device sync per layer).
        local_scores = per_document_sum(scores_for_aux_loss, state)
        inverse = torch.where(lengths > 0, 1.0 / lengths.clamp(min=1.0), 0.0)
        terms = (local_scores * counts * inverse[:, None]).reshape(1, -1)
        weighted = switch_load_balancing_loss_func(
            probs=terms,
            tokens_per_expert=torch.ones_like(terms[0]),
            total_num_tokens=1,
            topk=self.topk,
            num_experts=self.config.num_moe_experts,
            moe_aux_loss_coeff=coeff,
            fused=False,  # the fused kernel takes [tokens, E] scores; these are not
        )
        # attach_and_log_load_balancing_loss multiplies by the token count passed (and by the
        # TP-CP size, 1 under HSP): pass 1 so the attached value is the weighted sum itself.
        return self.attach_and_log_load_balancing_loss(
            probs,
            coeff,
            weighted,
            "seq_load_balancing_loss",
            self.tp_cp_group,
            valid_token_count=1,
        )

    def apply_z_loss(self, logits: torch.Tensor, padding_mask: torch.Tensor | None = None):
        state = current_micro_batch()
        if state is not None and padding_mask is None:
            check_micro_batch(state, logits.shape[0], self.tp_cp_group)
            padding_mask = state.padding
        return super().apply_z_loss(logits, padding_mask=padding_mask)


def check_micro_batch(state: MoEMicroBatch, tokens: int, tp_cp_group: object) -> None:
    """The router must see exactly the rank's packed tokens, unsplit by TP/CP (HSP refuses MoE
    with tensor or context parallelism: ``megatron.refusals``)."""
    size = tp_cp_group.size() if tp_cp_group is not None else 1  # type: ignore[attr-defined]
    if tokens != state.documents.numel() or size != 1:
        raise RuntimeError(
            f"HSP MoE router: {tokens} tokens routed for a packed micro-batch of "
            f"{state.documents.numel()} local tokens, TP x CP size {size}; HSP runs MoE layers "
            "on the rank's whole packed share (tensor and context parallel size 1)"
        )
