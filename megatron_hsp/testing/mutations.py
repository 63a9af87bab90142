"""Planted bugs for ``megatron-hsp selftest --mutations``: proof that the selftest can fail.

Each mutation is planted IN THE REAL CODE PATH, inside every worker process, by rebinding one
attribute of a runtime module (a function, a class method or a module global) to a wrapper that
calls the original with one thing broken; ``plant`` returns the undo. The distributed model, the
dispatch and the step are the unmodified production objects otherwise. The independent reference
(``testing/reference.py``) shares none of these functions, so a mutation cannot move it.

Every rank plants the same mutation at the same time and every mutation keeps the collectives
identical on all ranks (no rank raises alone, no collective is skipped), so one spawn of processes
runs them all one after another.

Caught rule (``CATCH_MARGIN``): a mutation is caught when, over the mutation cases, the worst loss
relative difference divided by the loss tolerance (``tolerances.CPU``) or the worst gradient
relative difference divided by the gradient one is at least 100, i.e. it misses the tolerance by
two orders of magnitude, or
when the step itself refuses it with an error on every rank (e.g. the token accounting check).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

CATCH_MARGIN = 100.0

Undo = Callable[[], None]


@dataclass(frozen=True)
class Mutation:
    """One planted bug: ``breaks`` says what goes wrong, ``where`` which attribute is rebound."""

    name: str
    breaks: str
    where: str
    wrap: Callable[[Any], Any]  # original attribute -> broken replacement
    everywhere: bool = True  # also rebind ``from module import name`` copies in megatron_hsp
    # The fewest ranks on which it changes anything (a bug between ranks, or in groups of two
    # or more): below that the broken code runs and breaks nothing.
    min_ranks: int = 1
    # It breaks only what learned absolute position embeddings read (RoPE recomputes positions).
    learned_positions_only: bool = False

    def unseen(self, world: int, position_embedding_type: str) -> str | None:
        """Why a run of ``world`` ranks on models with ``position_embedding_type`` cannot see
        this bug (the acceptance kit refuses it up front: a pass would say nothing), or None."""
        if world < self.min_ranks:
            return f"it changes nothing on fewer than {self.min_ranks} ranks ({self.breaks})"
        if self.learned_positions_only and position_embedding_type != "learned_absolute":
            return (
                f"only learned absolute position embeddings read what it breaks, and these "
                f"models use {position_embedding_type} (`selftest --megatron --mutations` "
                "catches it on its learned-absolute option set)"
            )
        return None

    def plant(self) -> Planted:
        """Rebind ``where`` (``module:attr`` or ``module:Class.attr``); returns the undo, which
        also counts the broken code's calls (``Planted.calls``)."""
        module_name, _, path = self.where.partition(":")
        module = importlib.import_module(module_name)
        owner: Any = module
        *outer, attr = path.split(".")
        for part in outer:
            owner = getattr(owner, part)
        original = owner.__dict__[attr] if isinstance(owner, type) else getattr(owner, attr)
        broken = self.wrap(original)
        calls = [0]
        if inspect.isfunction(broken):
            inner = broken

            @functools.wraps(inner)
            def broken(*args: Any, **kwargs: Any) -> Any:
                calls[0] += 1
                return inner(*args, **kwargs)

        rebound: list[tuple[Any, str, Any]] = [(owner, attr, original)]
        if self.everywhere and owner is module:
            for name, mod in list(sys.modules.items()):
                if (
                    name.startswith("megatron_hsp.")
                    and mod is not module
                    and getattr(mod, attr, None) is original
                ):
                    rebound.append((mod, attr, original))
        for target, name, _ in rebound:
            setattr(target, name, broken)

        def undo() -> None:
            for target, name, value in rebound:
                setattr(target, name, value)

        # A stand-in object (not a function) counts its own broken calls.
        return Planted(undo, lambda: calls[0] if inspect.isfunction(broken) else broken.calls)


@dataclass(frozen=True)
class Planted:
    """A planted mutation: calling it undoes the plant; ``calls()`` counts how often the broken
    code ran in this process. Why: a plant whose code path the run never takes (the SDPA plant
    where bf16 attention runs the varlen kernel) proves nothing, and a kit that then reported a
    miss would blame a correct install (docs/gpu-validation.md)."""

    undo: Callable[[], None]
    calls: Callable[[], int]

    def __call__(self) -> None:
        self.undo()


# ------------------------------------------------------------------------------ the wrappers


def _non_causal(functional: Any) -> Any:
    """A stand-in for ``torch.nn.functional`` whose SDPA ignores ``is_causal``."""

    class NonCausalFunctional:
        calls = 0  # the broken SDPA's calls (``Planted.calls``)

        def __getattr__(self, name: str) -> Any:
            return getattr(functional, name)

        def scaled_dot_product_attention(self, *args: Any, **kwargs: Any) -> torch.Tensor:
            self.calls += 1
            kwargs["is_causal"] = False
            return functional.scaled_dot_product_attention(*args, **kwargs)

    return NonCausalFunctional()


def _across_documents(call: Callable) -> Callable:
    def backend_call(self, q, k, v, cu_seqlens, max_seqlen, **kwargs):
        total = int(cu_seqlens[-1])
        whole = torch.tensor([0, total], dtype=cu_seqlens.dtype, device=cu_seqlens.device)
        if kwargs.get("cu_seqlens_host") is not None:  # the host copy of the same bounds
            kwargs["cu_seqlens_host"] = [0, total]
        return call(self, q, k, v, whole, total, **kwargs)

    return backend_call


def _rope_shift(positions_in_documents: Callable) -> Callable:
    def shifted(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
        pos = positions_in_documents(cu_seqlens, total)
        cu = cu_seqlens.to(torch.int64)
        lengths = torch.repeat_interleave(cu[1:] - cu[:-1], cu[1:] - cu[:-1], output_size=total)
        # Second half of every document one position back: one position repeated, none past the
        # table (so every rank still runs the same collectives).
        return pos - (2 * pos >= lengths).to(pos.dtype) * (pos > 0).to(pos.dtype)

    return shifted


def _token_lost_at_boundary(pack_group_slice: Callable) -> Callable:
    def lossy(*args: Any, **kwargs: Any):
        pack = pack_group_slice(*args, **kwargs)
        if pack.slot_in_group == 0 or pack.input_ids.size == 0:
            return pack
        ids = pack.input_ids.copy()
        ids[0] = kwargs.get("pad_id", 0)
        return dataclasses.replace(pack, input_ids=ids)

    return lossy


def _per_sample_loss(microbatch_loss: Callable) -> Callable:
    def per_sample(output_tensor: torch.Tensor, loss_mask: torch.Tensor):
        loss_sum, num_tokens = microbatch_loss(output_tensor, loss_mask)
        losses = output_tensor.reshape(-1).float()
        mask = loss_mask.reshape(-1).float()
        # Runs of loss tokens are the (slices of) documents: a masked token ends one.
        run_id = torch.cumsum((mask == 0).to(torch.int64), 0)
        runs = int(run_id[-1]) + 1 if run_id.numel() else 0
        if runs == 0 or float(mask.sum()) == 0:
            return loss_sum, num_tokens
        sums = torch.zeros(runs).index_add(0, run_id, losses * mask)
        counts = torch.zeros(runs).index_add(0, run_id, mask)
        means = sums[counts > 0] / counts[counts > 0]
        # every document weighs the same, rescaled so the token count still adds up
        return means.mean() * mask.sum(), num_tokens

    return per_sample


def _kv_heads_off_by_one(qkv_seq_to_head: Callable) -> Callable:
    def shifted(q, k, v, group):
        return qkv_seq_to_head(q, torch.roll(k, 1, dims=1), torch.roll(v, 1, dims=1), group)

    return shifted


def _gradients_left_out(allreduce_gradients: Callable) -> Callable:
    def reduce(params, group):
        import torch.distributed as dist

        params = list(params)
        if dist.get_rank(group) == 0:
            for p in params:
                if p.grad is not None:
                    p.grad.zero_()  # this rank's share never enters the reduction
        return allreduce_gradients(params, group)

    return reduce


def _merge_without_lse(merge_partials: Callable) -> Callable:
    def merge(out_a, lse_a, out_b, lse_b):
        # Average the partials instead of weighting them by their softmax mass (exp(lse)).
        _, lse = merge_partials(out_a, lse_a, out_b, lse_b)
        both = torch.isfinite(lse_a) & torch.isfinite(lse_b)
        w = torch.where(both, 0.5, torch.where(torch.isfinite(lse_a), 1.0, 0.0))
        w = w.transpose(0, 1)[..., None].to(out_a.dtype)
        return out_a * w + out_b * (1 - w), lse

    return merge


def _swapped_chunks(ring_position_tokens: Callable) -> Callable:
    """Attention believes each rank stores chunk ``2d-1-i`` of a document before chunk ``i``
    (dispatch stored ``i`` first): the two chunks' mask and RoPE positions are swapped."""

    def swapped(cu_seqlens, ulysses, ring, position):
        held = ring_position_tokens(cu_seqlens, ulysses, ring, position)
        d = ulysses * ring
        if ring < 2:
            return held
        q = (np.diff(np.asarray(cu_seqlens, dtype=np.int64)) // (2 * d)).tolist()
        share = held.size // ulysses
        parts = []
        for a in range(ulysses):
            piece, at = held[a * share : (a + 1) * share], 0
            for n in q:
                parts += [piece[at + n : at + 2 * n], piece[at : at + n]]
                at += 2 * n
            parts.append(piece[at:])
        return np.concatenate(parts)

    return swapped


_HALVES: dict[int, Any] = {}


def _reduced_over_wrong_group(allreduce_gradients: Callable) -> Callable:
    """Gradients summed over half the world (a subgroup that exists, the wrong one) instead of
    the data x context group. Every rank reaches the reduction at the same point, so creating
    the halves there with ``new_subgroups`` is collective-safe; they are kept for later plants."""
    import torch.distributed as dist

    def reduce(params, group):
        world = dist.get_world_size()
        if world not in _HALVES:
            _HALVES[world] = dist.new_subgroups(group_size=world // 2)[0]
        return allreduce_gradients(params, _HALVES[world])

    return reduce


def _position_ids_shifted(pack_group_slice: Callable) -> Callable:
    """Dispatched position ids one back from each document's 9th token on (RoPE recomputes its
    positions from ``cu_seqlens``, so only learned absolute position embeddings see them)."""

    def shifted(*args: Any, **kwargs: Any):
        pack = pack_group_slice(*args, **kwargs)
        pos = pack.position_ids
        return dataclasses.replace(pack, position_ids=pos - (pos >= 8).astype(pos.dtype))

    return shifted


def _one_rank_normalisation(microbatch_loss: Callable) -> Callable:
    """Rank 1 normalises its slices as if they had one loss token more (``sum / (n + 1)``
    rescaled to the step's ``1/N``): its share of the objective and gradients is off by
    ``n/(n+1)``, every other rank is right."""
    import torch.distributed as dist

    def wrong(output_tensor: torch.Tensor, loss_mask: torch.Tensor):
        loss_sum, num_tokens = microbatch_loss(output_tensor, loss_mask)
        if dist.get_rank() != 1:
            return loss_sum, num_tokens
        n = float(num_tokens)
        return loss_sum * (n / (n + 1.0)), num_tokens

    return wrong


GRAD_SCALE = 1.002


def _one_parameter_scaled(allreduce_gradients: Callable) -> Callable:
    """The gradient of ONE parameter (the smallest, a norm weight, same choice on every rank) is
    scaled by ``GRAD_SCALE`` before the reduction; every other parameter is exact."""

    def reduce(params, group):
        params = [p for p in params if p.requires_grad]
        if params:
            target = min(params, key=lambda p: p.numel())
            if target.grad is not None:
                target.grad.mul_(GRAD_SCALE)
        return allreduce_gradients(params, group)

    return reduce


MUTATIONS: tuple[Mutation, ...] = (
    Mutation(
        "non-causal-attention",
        "tokens attend to later tokens of their document (SDPA called with is_causal=False)",
        "megatron_hsp.runtime.backends:F",
        _non_causal,
        everywhere=False,
    ),
    Mutation(
        "attention-across-documents",
        "the attention backend sees one segment per group buffer, so documents attend to each "
        "other",
        "megatron_hsp.runtime.backends:TorchAttentionBackend.__call__",
        _across_documents,
    ),
    Mutation(
        "rope-positions-shifted",
        "RoPE positions of each document's second half shifted back by one",
        "megatron_hsp.runtime.packed:positions_in_documents",
        _rope_shift,
    ),
    Mutation(
        "token-lost-at-group-boundary",
        "the first token of every non-first rank's slice of a group buffer is lost (replaced by "
        "the padding id) at the boundary between two ranks' slices",
        "megatron_hsp.runtime.dispatch:pack_group_slice",
        _token_lost_at_boundary,
        min_ranks=2,
    ),
    Mutation(
        "per-sample-loss",
        "each micro-batch slice averages the loss per document instead of per token",
        "megatron_hsp.runtime.loss:microbatch_loss",
        _per_sample_loss,
    ),
    Mutation(
        "gqa-kv-head-off-by-one",
        "KV heads rotated by one before the head scatter: query head j meets KV head "
        "j // (q/kv) + 1",
        "megatron_hsp.runtime.ulysses:_qkv_seq_to_head",
        _kv_heads_off_by_one,
    ),
    Mutation(
        "wrong-ring-merge",
        "ring attention averages the per-step partial results instead of weighting them by "
        "their log-sum-exp",
        "megatron_hsp.runtime.ring:merge_partials",
        _merge_without_lse,
    ),
    Mutation(
        "wrong-ring-chunk-order",
        "attention assumes each rank stores its two chunks of a document in the opposite order "
        "from dispatch's load-balanced layout (chunk 2d-1-i before chunk i): mask and RoPE "
        "positions of the wrong tokens",
        "megatron_hsp.runtime.attention:ring_position_tokens",
        _swapped_chunks,
        everywhere=False,
        min_ranks=2,
    ),
    Mutation(
        "group-gradients-not-reduced",
        "the gradients computed on slot 0 (its share of every group it trained in) are left out "
        "of the step's data x context gradient all-reduce",
        "megatron_hsp.runtime.loss:allreduce_gradients",
        _gradients_left_out,
    ),
    Mutation(
        "gradients-reduced-over-wrong-group",
        "the step's gradient all-reduce runs over half of the ranks (a real subgroup, not the "
        "data x context group)",
        "megatron_hsp.runtime.loss:allreduce_gradients",
        _reduced_over_wrong_group,
        min_ranks=2,
    ),
    Mutation(
        "position-ids-shifted",
        "dispatched position ids one back from each document's 9th token on (seen by learned "
        "absolute position embeddings)",
        "megatron_hsp.runtime.dispatch:pack_group_slice",
        _position_ids_shifted,
        learned_positions_only=True,
    ),
    Mutation(
        "one-rank-loss-normalisation",
        "rank 1 divides its slices' loss by one token more than they have (n + 1)",
        "megatron_hsp.runtime.loss:microbatch_loss",
        _one_rank_normalisation,
        min_ranks=2,
    ),
    Mutation(
        "one-parameter-gradient-scaled",
        f"one parameter's gradient (the smallest parameter, a norm weight) scaled by "
        f"{GRAD_SCALE} before the reduction",
        "megatron_hsp.runtime.loss:allreduce_gradients",
        _one_parameter_scaled,
    ),
)


# ------------------------------------------------------------------ sampler plants
# Bugs in which documents are drawn. ``run_step`` is handed its documents, so the selftest cannot
# see them; the Megatron loop plants them (``megatron_loop.PLANTS``) and its sampler checks
# against ``testing/sampler_oracle.py`` must catch them. Not in ``MUTATIONS``.


def _blend_by_documents(choose: Callable) -> Callable:
    """The blend picks the dataset furthest below its weight in *documents* drawn (each
    dataset's sequences taken so far, epochs included) instead of tokens."""

    def by_documents(self: Any) -> int:
        drawn = np.asarray(
            [s.state.epoch * s.num_sequences + s.state.position for s in self.samplers],
            dtype=np.float64,
        )
        return int(np.argmax(self.weights * drawn.sum() - drawn))

    return by_documents


def _shortest_documents_dropped(init: Callable) -> Callable:
    """The sampler skips documents of exactly ``min_length`` (2) tokens, as ``lengths <=
    min_length`` for ``lengths < min_length`` would (split tails of 2 tokens too)."""

    def init_off_by_one(self: Any, lengths: Any, config: Any) -> None:
        init(self, lengths, dataclasses.replace(config, min_length=config.min_length + 1))

    return init_off_by_one


def _split_truncated(document_range: Callable) -> Callable:
    """A split's document range truncated (``int()``) instead of rounded as megatron-core's
    dataset builder rounds: a fractional boundary moves one document to the other split."""

    def truncated(bounds: Any, num_documents: int) -> tuple[int, int]:
        if bounds is None:
            return document_range(bounds, num_documents)
        return int(bounds[0] * float(num_documents)), int(bounds[1] * float(num_documents))

    return truncated


def _duplicate_after_restart(fast_forward: Callable) -> Callable:
    """After a resume (``fast_forward`` over at least one batch), the epoch being resumed draws
    its first sequence again in place of its last one: one document twice, one never."""

    def fast_forward_then_duplicate(self: Any, steps: int) -> None:
        fast_forward(self, steps)
        if steps <= 0:
            return
        for sub in getattr(self, "samplers", [self]):
            order = np.array(sub._order(sub.state.epoch))
            if len(order) > 1:
                order[-1] = order[0]
                sub._perm = order

    return fast_forward_then_duplicate


def _blend_component_not_reshuffled(order: Callable) -> Callable:
    """A blend's datasets after the first (their own random stream) never reshuffle after
    epoch 0: every later epoch repeats epoch 0's permutation. Each epoch still covers every
    piece once and the deficit rule is untouched; only the order is stale."""

    def stale_order(self: Any, epoch: int) -> Any:
        return order(self, 0 if self.config.stream is not None else epoch)

    return stale_order


SAMPLER_MUTATIONS: tuple[Mutation, ...] = (
    Mutation(
        "blend-by-documents",
        "blend weights honoured by documents drawn instead of tokens",
        "megatron_hsp.step.sampler:BlendedBatchSampler._choose",
        _blend_by_documents,
    ),
    Mutation(
        "two-token-documents-dropped",
        "documents of exactly 2 tokens skipped (`<=` for `<` in the too-short test)",
        "megatron_hsp.step.sampler:GlobalBatchSampler.__init__",
        _shortest_documents_dropped,
    ),
    Mutation(
        "split-truncated-not-rounded",
        "a split's document range int()-truncated instead of rounded as megatron-core rounds",
        "megatron_hsp.megatron.datasets:document_range",
        _split_truncated,
    ),
    Mutation(
        "document-twice-after-restart",
        "after a resume, the resumed epoch draws its first sequence again instead of its last",
        "megatron_hsp.step.sampler:BatchSampling.fast_forward",
        _duplicate_after_restart,
    ),
    Mutation(
        "blend-component-not-reshuffled",
        "a blend's second dataset repeats its epoch-0 permutation in every later epoch",
        "megatron_hsp.step.sampler:GlobalBatchSampler._order",
        _blend_component_not_reshuffled,
    ),
)


# ------------------------------------------------------------------ ring kernel plants
# Bugs inside one ring block's kernel that only show when a block spans several query tiles
# (``ring.TILE_ELEMENTS``). The ring exactness test ``tests/runtime/test_ring_tiles.py`` runs
# several query tiles, ring steps and skipped and unskipped blocks against a float64 dense
# reference and must catch them. Not in ``MUTATIONS`` (the selftest's sizes fit in one tile).


def _tile_accumulation_assigned(block_backward: Callable) -> Callable:
    """dK/dV written ``dk = ...`` instead of ``dk += ...`` in the query-tile loop: only the last
    query tile's contribution survives (dQ is per tile and stays right)."""

    def last_tile_only(dout, q, k, v, lse, delta, q_index, q_doc, k_index, k_doc, scale):
        from megatron_hsp.runtime import ring

        dq, dk, dv = block_backward(
            dout, q, k, v, lse, delta, q_index, q_doc, k_index, k_doc, scale
        )
        tiles = ring._tiles(q.size(0), q.size(1), k.size(0))
        a = tiles[-1] if len(tiles) else 0
        _, dk, dv = block_backward(
            dout[a:],
            q[a:],
            k,
            v,
            lse[:, a:],
            delta[:, a:],
            q_index[a:],
            q_doc[a:],
            k_index,
            k_doc,
            scale,
        )
        return dq, dk, dv

    return last_tile_only


# A bug of the fused ring's merges that shows only in bf16 (fp32 rounds it away): caught by
# ``tests/runtime/test_ring_bf16.py`` (bf16 ring of 8 against a bound derived from bf16's
# precision); ``test_ring_tiles.py`` runs the tile plant alone.
def _running_output_in_input_dtype(merge_partials: Callable) -> Callable:
    """The fused ring's running output allocated in the input dtype (``torch.zeros(q.shape,
    dtype=q.dtype)``): ``merge_partials`` hands back its first argument's dtype, so in bf16 every
    merge rounds the running output to bf16. Planted as the merge rounding its result to the
    visiting partial's dtype (the kernel's: q's); the tiled ring's partials are fp32, where it
    changes nothing, as it does in fp32."""

    def rounded(out_a, lse_a, out_b, lse_b):
        out, lse = merge_partials(out_a, lse_a, out_b, lse_b)
        return out.to(out_b.dtype).to(out.dtype), lse

    return rounded


RING_MUTATIONS: tuple[Mutation, ...] = (
    Mutation(
        "tile-accumulation-assigned",
        "the block backward assigns each query tile's dK/dV instead of accumulating them",
        "megatron_hsp.runtime.ring:_block_backward",
        _tile_accumulation_assigned,
    ),
    Mutation(
        "running-output-in-input-dtype",
        "the fused ring's running output held in the input dtype: bf16 rounds every merge",
        "megatron_hsp.runtime.ring:merge_partials",
        _running_output_in_input_dtype,
    ),
)


# ------------------------------------------------------------------ model-definition plants
# Bugs in the model ``--hsp`` builds (the spec handed to Megatron's builder), which train a
# different model with the same parameters, so checkpoints load and the loop (whose option sets
# do not pass these flags) sees nothing. The model-definition matrix
# ``tests/megatron/test_model_definition_matrix.py`` compares that model with the one Megatron's
# own builder makes from the same flags and must catch them. Not in ``MUTATIONS``.


def _moe_spec_without_qk_l2_norm(megatron_default_spec: Callable) -> Callable:
    """The MoE block spec built under ``--hsp`` without ``--qk-l2-norm``: q and k go unnormed
    (IdentityOp for megatron-core's parameterless ``L2Norm``); every parameter is the same."""

    def dropped(args: Any, config: Any) -> Any:
        if getattr(args, "num_experts", None) and getattr(args, "qk_l2_norm", False):
            args = type(args)(**{**vars(args), "qk_l2_norm": False})
        return megatron_default_spec(args, config)

    return dropped


MODEL_MUTATIONS: tuple[Mutation, ...] = (
    Mutation(
        "moe-spec-drops-qk-l2-norm",
        "the MoE block spec built under --hsp drops --qk-l2-norm (no parameter differs)",
        "megatron_hsp.megatron.layer_spec:megatron_default_spec",
        _moe_spec_without_qk_l2_norm,
    ),
)


# A split-policy plant: a megatron-dcp run's registry made with hsp's split (the old runtime:
# one split per size from the heads), so Megatron's pure-ring plans no longer agree with the
# pre-created groups. ``tests/megatron/test_megatron_dcp_sizes.py`` must catch it. Not in
# ``MUTATIONS``.
def _method_heads_ignore_the_method(method_heads: Callable) -> Callable:
    """``run_spec.method_heads`` returning the heads as given, whatever the plan method."""

    def ignored(heads: Any, method: str) -> Any:
        return method_heads(heads, "hsp")

    return ignored


SPLIT_MUTATIONS: tuple[Mutation, ...] = (
    Mutation(
        "method-heads-ignore-the-method",
        "a megatron-dcp run pre-creates hsp's Ulysses split, not Megatron's pure ring",
        "megatron_hsp.planner.run_spec:method_heads",
        _method_heads_ignore_the_method,
    ),
)


def by_name(names: list[str] | None = None) -> list[Mutation]:
    """The mutations named (all when None), in table order."""
    if names is None:
        return list(MUTATIONS)
    known = {m.name: m for m in MUTATIONS}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise KeyError(f"unknown mutations {unknown}; known: {sorted(known)}")
    return [known[n] for n in names]


def margin(loss_rel: float, grad_rel: float, loss_tol: float, grad_tol: float) -> float:
    """How many times the worse of the two differences exceeds its tolerance."""
    return max(loss_rel / loss_tol, grad_rel / grad_tol)


# ------------------------------------------------------------------ evaluation plants
# Bugs of ``evaluate()`` under ``--hsp`` on a split without documents (``--split`` giving it no
# share: HSP's provider hands Megatron no iterator, Megatron still evaluates it). Caught by
# ``tests/megatron/test_evaluate_empty_split.py`` against stock's ``evaluate()`` with zero
# evaluation iterations. Not in ``MUTATIONS``.


def _empty_split_evaluates_training_data(eval_iterator_of: Callable) -> Callable:
    """An evaluation call without an iterator (a split without documents) taken for one of the
    training data: the training pipeline's next batch is planned and the schedule runs."""

    def training_data_instead(data_iterator: Any) -> Any:
        from megatron_hsp.megatron import hooks

        found = eval_iterator_of(data_iterator)
        run = hooks.active_run()
        if found is None and data_iterator is None and run is not None and run.pipeline:
            return hooks._EvalIterator(run, "valid", run.pipeline)
        return found

    return training_data_instead


EVALUATION_MUTATIONS: tuple[Mutation, ...] = (
    Mutation(
        "empty-split-evaluates-training-data",
        "evaluate() on a split without documents plans and runs the next training batch",
        "megatron_hsp.megatron.hooks:eval_iterator_of",
        _empty_split_evaluates_training_data,
    ),
)
