"""The planted bugs: each breaks one thing on the HSP side (the loop's comparison must then fail),
with the option set and steps it runs on (``PLANT_RUNS``); the sampler bugs come from
``testing/mutations.py``."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from megatron_hsp.testing.mutations import MODEL_MUTATIONS, SAMPLER_MUTATIONS

# Each plant is called on the HSP side before the run with an ExitStack (register the undo on
# it) and may return a hook ``(model_chunks, optimizer, config) -> None`` run after DDP and the
# optimizer are built. ``PLANTED`` records what a plant chose, for the report.
PLANTED: dict[str, Any] = {}
GRAD_PLANT_SCALE = 1.0001  # a 0.01% error


def _plant_plan_count_everywhere_in_train_step(stack: contextlib.ExitStack) -> None:
    """PLANTED BUG (an early megatron-hsp): ``get_num_microbatches`` answers the plan's
    count for the whole of ``train_step``, so the LR scheduler's increment
    (count x micro-batch size x dp) follows the plan instead of the global batch."""
    import megatron.training.training as training

    from megatron_hsp.megatron import hooks

    inside = {"on": False}
    patched_step, megatron_count = training.train_step, training.get_num_microbatches

    def train_step(*a, **kw):
        inside["on"] = True
        try:
            return patched_step(*a, **kw)
        finally:
            inside["on"] = False

    def get_num_microbatches():
        run = hooks.active_run()
        if inside["on"] and run is not None and run.current is not None:
            return hooks.current_num_microbatches(run)
        return megatron_count()

    training.train_step, training.get_num_microbatches = train_step, get_num_microbatches

    def undo() -> None:
        training.train_step, training.get_num_microbatches = patched_step, megatron_count

    stack.callback(undo)


def _plant_smallest_gradient_scaled(
    stack: contextlib.ExitStack,
) -> Callable[[Any, Any, Any], None]:
    """PLANTED BUG: the parameter with the smallest gradient (max |g| after the data-parallel
    reduction of step 0, agreed over ranks) gets its gradient x 1.0001 every step, after
    backward and ``finalize_model_grads``, before the optimizer: a 0.01% error where a check on
    all gradients at once would not see it."""

    def hook(model: list[Any], optimizer: Any, config: Any) -> None:
        import torch.distributed as dist

        finalize = config.finalize_model_grads_func
        params = dict(model[0].module.named_parameters())

        def finalize_then_scale(*a: Any, **kw: Any) -> Any:
            result = finalize(*a, **kw)
            if "param" not in PLANTED:
                names = sorted(params)
                peak = torch.tensor(
                    [float(params[n].main_grad.abs().max()) for n in names], dtype=torch.float64
                )
                dist.all_reduce(peak, op=dist.ReduceOp.MAX)
                peak[peak == 0] = math.inf
                PLANTED["param"] = names[int(torch.argmin(peak))]
            params[PLANTED["param"]].main_grad.mul_(GRAD_PLANT_SCALE)
            return result

        config.finalize_model_grads_func = finalize_then_scale

    return hook


NOT_UPDATED_PARAM = "decoder.layers.0.mlp.linear_fc1.weight"


def _plant_one_parameter_not_updated(
    stack: contextlib.ExitStack,
) -> Callable[[Any, Any, Any], None]:
    """PLANTED BUG: one parameter (``NOT_UPDATED_PARAM``) is left out of the optimizer step
    (its weights are put back after ``optimizer.step``), as a parameter missing from the
    optimizer's groups would be. Gradients, loss, lr and grad norm stay right: only the weights
    after the steps show it (from the second step on: the first step's lr is 0)."""

    def hook(model: list[Any], optimizer: Any, config: Any) -> None:
        param = dict(model[0].module.named_parameters())[NOT_UPDATED_PARAM]
        step = optimizer.step

        def step_without_one(*a: Any, **kw: Any) -> Any:
            before = param.detach().clone()
            result = step(*a, **kw)
            with torch.no_grad():
                param.copy_(before)
            return result

        optimizer.step = step_without_one
        PLANTED["param"] = NOT_UPDATED_PARAM

    return hook


def _plant_reader_start_shift(stack: contextlib.ExitStack) -> None:
    """PLANTED BUG: HSP's ``DocumentReader.read`` starts one token late (an off-by-one start:
    the piece's tokens shifted by one, the last one padded with token 0)."""
    from megatron_hsp.step import documents
    from megatron_hsp.step.sampler import Piece

    original = documents.DocumentReader.read

    def read(self: Any, piece: Any) -> np.ndarray:
        shifted = original(self, Piece(piece.doc, piece.offset + 1, piece.length - 1))
        return np.append(shifted, 0)

    documents.DocumentReader.read = read
    stack.callback(setattr, documents.DocumentReader, "read", original)


def _plant_evaluation_draws_training_batches(stack: contextlib.ExitStack) -> None:
    """PLANTED BUG: the validation and test iterators draw their batches from the training
    sampler (one sampler for every split, as a provider that ignored the split would): the
    evaluation batches come from the training documents and move the training sampler on."""
    from megatron_hsp.megatron import hooks

    original = hooks.build_pipeline

    def build_pipeline(run: Any, args: Any) -> Any:
        pipeline = original(run, args)
        for evaluation in run.evaluation.values():
            evaluation.pipeline.sampler = pipeline.sampler
        return pipeline

    hooks.build_pipeline = build_pipeline
    stack.callback(setattr, hooks, "build_pipeline", original)


def _plant_resume_restarts_the_samplers(stack: contextlib.ExitStack) -> None:
    """PLANTED BUG: on a restart the samplers are not moved past what the checkpoint trained
    and evaluated (``fast_forward`` does nothing): the resumed run repeats the first batches."""
    from megatron_hsp.step import sampler

    original = sampler.BatchSampling.fast_forward  # both samplers' (their shared base)
    sampler.BatchSampling.fast_forward = lambda self, steps: None
    stack.callback(setattr, sampler.BatchSampling, "fast_forward", original)


def _plant_resume_shares_the_adam_step(
    stack: contextlib.ExitStack,
) -> Callable[[Any, Any, Any], None]:
    """PLANTED BUG (megatron-core 0.19.2's own, on torch's Adam; ``cpu_shims.
    torch_adam_distributed_optimizer_load`` undoes it for the clean run): after a load, every
    parameter's Adam state holds the same ``step`` tensor, which Adam increments once per
    parameter per step. Weights, loss and gradients of the restored model are right; only the
    weights after the first resumed optimizer step show it (its bias correction runs ahead)."""

    def hook(model: list[Any], optimizer: Any, config: Any) -> None:
        load = optimizer.load_state_dict

        def load_sharing_one_step(state_dict: Any) -> None:
            load(state_dict)
            for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
                states = list(inner.optimizer.state.values())
                for state in states:
                    state["step"] = states[0]["step"]

        optimizer.load_state_dict = load_sharing_one_step

    return hook


def _plant_expert_grads_not_reduced(
    stack: contextlib.ExitStack,
) -> Callable[[Any, Any, Any], None]:
    """PLANTED BUG: the expert parameters' gradients are not reduced over the
    expert-data-parallel ranks (DDP's expert bucket groups left out of the gradient sync, as
    an integration that reduced only over the dense data-parallel buffers would): each rank
    steps its experts on its own tokens' gradient."""

    def hook(model: list[Any], optimizer: Any, config: Any) -> None:
        ddp = model[0]
        if not ddp.expert_parallel_bucket_groups:
            raise RuntimeError("expert-grads-not-reduced needs an option set with experts")
        ddp.expert_parallel_bucket_groups = []
        PLANTED["param"] = "expert parameters"

    return hook


def _plant_stage_boundary_tokens_rolled(stack: contextlib.ExitStack) -> None:
    """PLANTED BUG: the activation a pipeline stage receives has its tokens in the
    wrong order (rolled by one along the sequence), as a boundary that mixed up the layout of
    the tokens it sends would: each token's hidden state lands on its neighbour's position and
    document. Gradients still flow back through the roll, so nothing fails; only the numbers."""
    from megatron.core.models.gpt.gpt_model import GPTModel

    original = GPTModel.set_input_tensor

    def set_input_tensor(self: Any, input_tensor: Any) -> None:
        received = input_tensor[0] if isinstance(input_tensor, list) else input_tensor
        if received is not None and received.shape[0] > 1:
            received = torch.roll(received, 1, dims=0)
        original(self, [received])

    GPTModel.set_input_tensor = set_input_tensor
    stack.callback(setattr, GPTModel, "set_input_tensor", original)


def _plant_document_expert_counts_not_reduced(stack: contextlib.ExitStack) -> None:
    """PLANTED BUG: the per-sequence aux loss counts each document's experts over
    this rank's tokens only, not over the plan group that holds the document (the all-reduce
    over the group left out)."""
    from megatron_hsp.runtime import moe

    original = moe.tokens_per_expert_per_document

    def local_only(routing_map: torch.Tensor, state: Any) -> torch.Tensor:
        return original(routing_map, moe.MoEMicroBatch(state.documents, state.num_documents, None))

    moe.tokens_per_expert_per_document = local_only
    stack.callback(setattr, moe, "tokens_per_expert_per_document", original)


def _plant_refit_finalize_drops_the_token_count(stack: contextlib.ExitStack) -> None:
    """PLANTED BUG (issue 44's audit): the online refit's wrapper around Megatron's
    ``config.finalize_model_grads_func`` (``hooks.around_finalize``, in force only with the
    refit on, the users' default) forwards the model chunks and keywords but drops the global
    token count the schedule passes second: under ``--calculate-per-token-loss`` every
    gradient is left undivided by the step's token count."""
    from megatron_hsp.megatron import hooks

    original = hooks.around_finalize

    def around_finalize(run: Any, config: Any) -> Any:
        finalize = getattr(config, "finalize_model_grads_func", None)
        if run.clock is None or finalize is None:
            return lambda: None

        def finalize_after_marking(*a: Any, **kw: Any) -> Any:
            hooks.end_microbatches(run)
            return finalize(a[0], **kw)  # the bug: a[1], the token count, is lost

        config.finalize_model_grads_func = finalize_after_marking
        return lambda: setattr(config, "finalize_model_grads_func", finalize)

    hooks.around_finalize = around_finalize
    stack.callback(setattr, hooks, "around_finalize", original)


PLANTS: dict[str, Callable[[contextlib.ExitStack], Any]] = {
    "plan-count-in-lr-increment": _plant_plan_count_everywhere_in_train_step,
    "smallest-gradient-scaled-1.0001": _plant_smallest_gradient_scaled,
    "reader-start-shift": _plant_reader_start_shift,
    "one-parameter-not-updated": _plant_one_parameter_not_updated,
    "evaluation-draws-training-batches": _plant_evaluation_draws_training_batches,
    "resume-restarts-the-samplers": _plant_resume_restarts_the_samplers,
    "resume-shares-the-adam-step": _plant_resume_shares_the_adam_step,
    "stage-boundary-tokens-rolled": _plant_stage_boundary_tokens_rolled,
    "expert-grads-not-reduced": _plant_expert_grads_not_reduced,
    "document-expert-counts-not-reduced": _plant_document_expert_counts_not_reduced,
    "refit-finalize-drops-the-token-count": _plant_refit_finalize_drops_the_token_count,
}


def _mutation_plant(mutation: Any) -> Callable[[contextlib.ExitStack], None]:
    """A sampler (or model-definition) bug of ``testing/mutations.py`` as a plant of this
    loop."""

    def plant(stack: contextlib.ExitStack) -> None:
        stack.callback(mutation.plant())

    plant.__doc__ = f"PLANTED BUG: {mutation.breaks}."
    return plant


# Which documents are drawn. The stock side reads the pieces HSP's sampler chose, so
# only the sampler checks against ``testing/sampler_oracle.py`` can see these.
PLANTS.update({m.name: _mutation_plant(m) for m in SAMPLER_MUTATIONS})
# The model the HSP side builds (the spec under --hsp): the stock side is built by Megatron's own
# builder (``models.stock_builder``), so a spec that drops a model-definition flag trains another
# model than stock's from the same weights, which the loss and gradients show.
PLANTS.update({m.name: _mutation_plant(m) for m in MODEL_MUTATIONS})


# Where each plant runs (an option set's label in DEFAULT_OPTIONS) and for how many steps: the
# option set that runs the planted code path at all (a resume plant needs the restart, an
# expert plant experts under EP 2, ...). The tests and ``selftest --megatron --mutations`` read it.
PLANT_RUNS: dict[str, tuple[str, int]] = {
    "plan-count-in-lr-increment": ("ddp", 1),
    "smallest-gradient-scaled-1.0001": ("ddp", 1),
    "reader-start-shift": ("ddp", 1),
    "one-parameter-not-updated": ("ddp", 2),
    "evaluation-draws-training-batches": ("distopt evaluation blend resume", 3),
    "resume-restarts-the-samplers": ("distopt evaluation blend resume", 3),
    "resume-shares-the-adam-step": ("distopt evaluation blend resume", 3),
    "stage-boundary-tokens-rolled": ("pp2", 1),
    "expert-grads-not-reduced": ("moe4 ep2 alltoall seqaux 0.1 z 0.01", 1),
    "document-expert-counts-not-reduced": ("moe4 ep2 alltoall seqaux 0.1 z 0.01", 1),
    # On the users' default (the refit on), which every option set without a pipeline runs.
    "refit-finalize-drops-the-token-count": ("ddp", 1),
    # The sampler's own bugs, one step each (the once-per-epoch check draws on from
    # copies of the live samplers) except the restart's.
    "blend-by-documents": ("distopt evaluation blend resume", 1),
    "two-token-documents-dropped": ("ddp", 1),
    "split-truncated-not-rounded": ("distopt evaluation blend resume", 1),
    "document-twice-after-restart": ("distopt evaluation blend resume", 3),
    "blend-component-not-reshuffled": ("distopt evaluation blend resume", 1),
    # The model-definition bug (issue 44): on the MoE set with --qk-l2-norm.
    "moe-spec-drops-qk-l2-norm": ("moe4 ep1 alltoall qk-l2-norm", 1),
}
