"""The stock side: the same flags without ``--hsp``, the model Megatron's own builder builds
from them (``models.stock_builder``), each document its own ``[1, L]`` sample read with
megatron-core's ``IndexedDataset``, a ``pretrain_gpt.py``-style forward step and per-token loss
written from Megatron's documented contract (no HSP code) and Megatron's unpatched
``train_step``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from megatron_hsp.testing.megatron_loop.corpus import MegatronDocuments
from megatron_hsp.testing.megatron_loop.models import (
    _load_weights,
    _megatron_args,
    _set_megatron_globals,
    _step_record,
    _stock_model,
    _wrap,
    param_grads,
)
from megatron_hsp.testing.megatron_loop.options import MODEL_FLAGS, LoopOptions


def _stock_forward_step(data_iterator: Any, model: Any):
    """A ``pretrain_gpt.py``-style forward step on one stock ``[1, L]`` sample (no HSP code):
    Megatron's per-token-loss contract returns (loss sum, token count, {"lm loss": [sum, n]})."""
    from functools import partial

    x = next(data_iterator)
    out = model(x["input_ids"], x["position_ids"], x["attention_mask"], labels=x["labels"])
    return out, partial(_stock_loss, x["loss_mask"])


def _stock_loss(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    losses = output_tensor.view(-1).float()
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().to(torch.int)
    report = torch.cat([loss.detach().view(1), num_tokens.view(1).float()])
    return loss, num_tokens, {"lm loss": report}


def stock_sample(tokens: np.ndarray, multiple: int = 1) -> dict[str, torch.Tensor]:
    """One document as a stock ``[1, L]`` sample (``testing.reference.causal_inputs``: Megatron's
    causal mask and positions), padded at its end to a multiple of ``multiple`` (the TP size
    under ``--sequence-parallel``, which splits the sequence over TP ranks) with loss mask 0 on
    the padding: causal attention keeps every real token blind to it."""
    from megatron_hsp.testing.reference import causal_inputs

    n = len(tokens)
    padded = -(-n // multiple) * multiple
    sample = causal_inputs(np.concatenate([tokens, np.zeros(padded - n, dtype=np.int64)]))
    sample["loss_mask"][n - 1 :] = 0.0
    return sample


def _schedule_of(count: int) -> Any:
    """Megatron's own schedule run on ``count`` micro-batches: under the token budget a step's
    documents, one ``[1, L]`` sample each, are not ``--global-batch-size`` of them, so this
    rank's share of them is passed as the schedule's ``num_microbatches`` (an argument
    ``train_step`` passes, the function unpatched; its learning-rate increment and Megatron's
    consumed samples still count ``--global-batch-size`` samples a step, as under ``--hsp``).
    Under ``--calculate-per-token-loss`` the gradients are divided by the tokens of every
    rank's micro-batches together, however many each rank ran."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    if count < 1:
        raise RuntimeError("a data-parallel rank got no document of the step")
    schedule = get_forward_backward_func()

    def forward_backward_func(*a: Any, **kw: Any) -> Any:
        kw["num_microbatches"] = count
        return schedule(*a, **kw)

    return forward_backward_func


def _run_stock(
    options: LoopOptions,
    prefixes: Sequence[str],
    pieces: Sequence[Sequence[tuple[int, int, int]]],
    init: dict[str, torch.Tensor],
    evaluations: Sequence[dict[str, Any]] = (),
) -> dict[str, Any]:
    """The stock side, uninterrupted: the same documents (read with megatron-core's
    ``IndexedDataset``), unpatched ``train_step``, and Megatron's unpatched ``evaluate()`` on
    the HSP side's evaluation batches after the same steps."""
    import megatron.training.training as training
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_hsp.testing.cpu_shims import cpu_attention_scores_buffer

    args = _megatron_args([*MODEL_FLAGS, *options.flags()])
    _set_megatron_globals(args)
    module = _stock_model(args)
    _load_weights([module], init)
    model, optimizer, scheduler, config = _wrap(args, module)
    dp = parallel_state.get_data_parallel_world_size()
    rank = parallel_state.get_data_parallel_rank()
    multiple = args.tensor_model_parallel_size if args.sequence_parallel else 1
    reader = MegatronDocuments(prefixes)
    documents = [[reader.read(*p) for p in step] for step in pieces]
    evaluated = [[[reader.read(*p) for p in b] for b in e["pieces"]] for e in evaluations]
    every = [d for step in documents for d in step] + [d for e in evaluated for b in e for d in b]
    longest = -(-max(len(d) for d in every) // multiple) * multiple
    cpu_attention_scores_buffer(args.num_attention_heads * longest * longest)
    records, grads, evals = [], [], []
    by_tokens = options.batch_unit == "tokens"
    for it, docs in enumerate(documents):
        if not by_tokens and len(docs) != args.global_batch_size:
            raise RuntimeError(
                f"step {it}: {len(docs)} documents, the stock run needs --global-batch-size "
                f"{args.global_batch_size} samples"
            )
        mine = [stock_sample(d, multiple) for d in docs[rank::dp]]
        out = training.train_step(
            _stock_forward_step,
            iter(mine),
            model,
            optimizer,
            scheduler,
            config,
            _schedule_of(len(mine)) if by_tokens else get_forward_backward_func(),
            iteration=it,
        )
        grads.append(param_grads(model, options.distributed_optimizer))
        records.append(_step_record(args, out, scheduler, optimizer))
        for e, batches in zip(evaluations, evaluated, strict=True):
            if e["after_step"] != it:
                continue
            for b in batches:
                if len(b) != args.eval_global_batch_size:
                    raise RuntimeError(
                        f"{e['split']} batch of {len(b)} documents; the stock evaluate() needs "
                        f"--eval-global-batch-size {args.eval_global_batch_size}"
                    )
            # evaluate() asks eval_global_batch_size / dp micro-batches per rank per batch.
            mine = [stock_sample(d, multiple) for b in batches for d in b[rank::dp]]
            losses, _, _ = training.evaluate(
                _stock_forward_step, iter(mine), model, None, config, eval_iters=len(batches)
            )
            evals.append(
                {
                    "loss": float(losses["lm loss"]),
                    "consumed_valid_samples": int(args.consumed_valid_samples),
                }
            )
    weights = {n: p.detach().clone() for n, p in module.named_parameters()}
    return {
        "records": records,
        "grads": grads,
        "weights": weights,
        "args": args,
        "evaluations": evals,
        "reader": reader,
    }
