"""``selftest --megatron``: Megatron's own ``train_step`` with HSP installed vs the stock path, CPU.

What runs, on N gloo CPU ranks (default 4), for each option set (plain DDP, distributed optimizer,
overlapped grad reduce):

* **HSP side, as users get it.** Megatron's real argument parser and ``validate_args`` on the
  flags a user passes plus ``--hsp ...`` (through ``hsp_extra_args_provider``); Megatron's
  ``set_global_variables``; ``megatron_hsp.megatron.install(args, ...)`` (validation, patches);
  HSP's dataset provider (indexed dataset on disk, document sampler, planner, plan agreement) and
  ``hsp_forward_step``; the model built from the layer spec HSP's ``--spec`` loads
  (``layer_spec.hsp_spec_from_args``); megatron-core ``DistributedDataParallel``, Megatron's
  optimizer (``get_megatron_optimizer``), ``finalize_model_grads`` and opt-param scheduler
  (``get_optimizer_param_scheduler``); then ``megatron.training.training.train_step`` (patched).
* **Stock side.** The same flags without ``--hsp``: stock megatron-core local spec (its own
  ``DotProductAttention`` with a causal mask, its own RoPE), each document its own ``[1, L]``
  micro-batch over the data-parallel ranks (micro-batch size 1, so ``global batch / dp``
  micro-batches per rank: the documents of the HSP step, in order, round-robin), a
  ``pretrain_gpt.py``-style forward step and per-token loss written here from Megatron's
  documented contract (no HSP code), and Megatron's unpatched ``train_step``.

Both start from the same weights (the stock model's, copied by parameter name). Per step the
comparison covers the reduced loss, every gradient (the data-parallel gradient buffers after
``finalize_model_grads``: whole buffers for plain DDP, each rank's own shard under the
distributed optimizer), the learning rate, the grad norm and consumed samples.

What ``train()`` does around ``train_step`` is not run (it is one long function without a seam).
The few lines this loop needs from it are reproduced and named: the ``config`` hooks
``train()`` sets before its loop (``grad_scale_func``, ``no_sync_func``/``grad_sync_func`` under
``--overlap-grad-reduce``, ``finalize_model_grads_func``) and its consumed-samples update
(``args.consumed_train_samples += dp * micro_batch_size * get_num_microbatches()``, read from
``megatron.training.training`` so a patched count would show). Device placement shims:
``testing.cpu_shims`` only (listed in ``megatron/patches.py``).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

STEPS = 3
GLOBAL_BATCH = 8

# What a user would pass Megatron for this tiny fp32 model (local modules, no fusions on CPU).
MODEL_FLAGS = [
    *("--num-layers", "2", "--hidden-size", "32", "--ffn-hidden-size", "64"),
    *("--num-attention-heads", "8", "--group-query-attention", "--num-query-groups", "2"),
    *("--seq-length", "256", "--max-position-embeddings", "512"),
    *("--position-embedding-type", "rope", "--untie-embeddings-and-output-weights"),
    *("--micro-batch-size", "1", "--global-batch-size", str(GLOBAL_BATCH)),
    *("--train-iters", "8", "--lr", "1e-3", "--min-lr", "1e-4", "--lr-decay-style", "cosine"),
    *("--lr-warmup-iters", "2", "--lr-decay-iters", "8", "--clip-grad", "1.0"),
    *("--eval-iters", "0", "--transformer-impl", "local", "--use-cpu-initialization"),
    *("--no-gradient-accumulation-fusion", "--attention-dropout", "0", "--hidden-dropout", "0"),
    *("--no-bias-dropout-fusion", "--no-masked-softmax-fusion", "--no-rope-fusion"),
    *("--no-persist-layer-norm", "--calculate-per-token-loss", "--seed", "1234"),
    *("--tokenizer-type", "NullTokenizer", "--vocab-size", "128"),
    *("--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear"),
    "--disable-gloo-process-groups",  # the default group is gloo already (testing.dist)
]


@dataclass(frozen=True)
class LoopOptions:
    """One Megatron data-parallel configuration the comparison runs under."""

    distributed_optimizer: bool = False
    overlap_grad_reduce: bool = False

    def flags(self) -> list[str]:
        out = []
        if self.distributed_optimizer:
            out.append("--use-distributed-optimizer")
        if self.overlap_grad_reduce:
            out.append("--overlap-grad-reduce")
        return out

    def as_dict(self) -> dict[str, bool]:
        return {
            "distributed_optimizer": self.distributed_optimizer,
            "overlap_grad_reduce": self.overlap_grad_reduce,
        }


DEFAULT_OPTIONS = (
    LoopOptions(),
    LoopOptions(distributed_optimizer=True),
    LoopOptions(overlap_grad_reduce=True),
)


# A cost model for this tiny CPU run (loaded from a file through --hsp-cost-model, as a user's
# fitted model would be). 64 tokens per rank is what makes plans heterogeneous here: documents
# over 64 tokens need a group of 2, over 128 a group of 4, and a step of 8 documents takes
# several micro-batches, so the plan's micro-batch count differs from Megatron's (2 per rank).
LOOP_COST_MODEL: dict[str, Any] = {
    "name": "megatron-loop-cpu",
    "coefficients": {
        "attn_ms_per_token2": 5.0e-5,
        "linear_ms_per_token": 0.12,
        "group_fixed_ms": 30.0,
        "a2a_ms_per_token": {2: 0.03, 4: 0.04},
        "tokens_per_rank": 64,
    },
}


def write_corpus(prefix: str, num_docs: int = 64, seed: int = 7) -> None:
    """A small indexed dataset of documents of very different lengths (2..200 tokens)."""
    from megatron_hsp.megatron.data import write_indexed_dataset

    rng = np.random.default_rng(seed)
    lengths = rng.choice([2, 5, 17, 40, 90, 130, 200], size=num_docs)
    write_indexed_dataset(prefix, [rng.integers(0, 128, size=int(n)) for n in lengths])


def _megatron_args(argv: list[str]) -> Any:
    """Megatron's own parse + validate on ``argv`` (``--hsp*`` flags added as users get them)."""
    from megatron.training.arguments import parse_args, validate_args

    from megatron_hsp.megatron.args import hsp_extra_args_provider

    saved = sys.argv
    sys.argv = ["megatron-hsp-selftest", *argv]
    try:
        args = parse_args(extra_args_provider=hsp_extra_args_provider(None))
    finally:
        sys.argv = saved
    validate_args(args, {})
    return args


def _set_megatron_globals(args: Any) -> None:
    from megatron.training import global_vars

    global_vars.unset_global_variables()
    global_vars.set_global_variables(args, build_tokenizer=True)  # sets padded_vocab_size


def _stock_model(args: Any) -> torch.nn.Module:
    """Stock megatron-core GPTModel from the flags, with megatron-core's local layer spec."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.training.arguments import core_transformer_config_from_args

    from megatron_hsp.testing.cpu_shims import use_cpu_rotary

    config = core_transformer_config_from_args(args)
    torch.manual_seed(args.seed)
    spec = get_gpt_layer_local_spec(normalization=args.normalization)
    return use_cpu_rotary(_gpt(GPTModel, config, spec, args))


def _hsp_model(args: Any) -> torch.nn.Module:
    """The model Megatron builds under ``--hsp``: the spec layer_spec.py hands ``--spec``."""
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.training.arguments import core_transformer_config_from_args

    from megatron_hsp.megatron.layer_spec import hsp_spec_from_args
    from megatron_hsp.testing.cpu_shims import use_cpu_rotary

    config = core_transformer_config_from_args(args)
    return use_cpu_rotary(_gpt(GPTModel, config, hsp_spec_from_args(args), args))


def _gpt(cls: Any, config: Any, spec: Any, args: Any) -> torch.nn.Module:
    return cls(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
    )


def _load_weights(module: torch.nn.Module, init: dict[str, torch.Tensor]) -> None:
    """Copy ``init`` in by parameter name; the HSP spec swaps only parameter-free attention
    modules, so both models must have exactly the same names."""
    own = dict(module.named_parameters())
    if sorted(own) != sorted(init):
        raise RuntimeError(
            f"HSP and stock models have different parameters: {sorted(set(own) ^ set(init))}"
        )
    with torch.no_grad():
        for name, value in init.items():
            own[name].copy_(value)


def _wrap(args: Any, module: torch.nn.Module) -> tuple[list[Any], Any, Any, Any]:
    """megatron-core DDP + Megatron's optimizer and scheduler, configured from ``args`` by
    Megatron's own helpers; plus the ``config`` hooks ``train()`` sets before its loop."""
    from megatron.core.distributed import DistributedDataParallel, finalize_model_grads
    from megatron.core.optimizer import get_megatron_optimizer
    from megatron.core.utils import get_model_config
    from megatron.training.training import (
        get_megatron_ddp_config,
        get_megatron_optimizer_config,
        get_optimizer_param_scheduler,
    )

    config = get_model_config(module)
    ddp_config = get_megatron_ddp_config(args)
    model = [DistributedDataParallel(config, ddp_config, module)]
    opt_config, overrides = get_megatron_optimizer_config(args)
    optimizer = get_megatron_optimizer(
        opt_config,
        model,
        config_overrides=overrides,
        use_gloo_process_groups=args.use_gloo_process_groups,
    )
    scheduler = get_optimizer_param_scheduler(optimizer)
    # As train() does before its loop (megatron/training/training.py, "Setup some training
    # config params").
    config.grad_scale_func = optimizer.scale_loss
    if args.overlap_grad_reduce:
        config.no_sync_func = model[0].no_sync
        if args.align_grad_reduce:
            config.grad_sync_func = model[0].start_grad_sync
    config.finalize_model_grads_func = finalize_model_grads
    return model, optimizer, scheduler, config


def _grad_shards(model: Any, distributed_optimizer: bool) -> list[torch.Tensor]:
    """The gradients ``finalize_model_grads`` left for the optimizer on this rank."""
    from megatron.core import parallel_state

    dp = parallel_state.get_data_parallel_world_size()
    rank = parallel_state.get_data_parallel_rank()
    out = []
    for buffer in model.buffers:
        for bucket in buffer.buckets:
            data = bucket.grad_data
            if distributed_optimizer:  # reduce-scatter: only this rank's shard is final
                data = data.view(dp, -1)[rank]
            out.append(data.detach().clone())
    return out


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


def _step_record(args: Any, out: tuple, scheduler: Any, optimizer: Any) -> dict[str, Any]:
    """Loss, lr, grad norm and consumed samples after one ``train_step``, as train() keeps them."""
    import megatron.training.training as training
    from megatron.core import parallel_state

    # (loss_reduced, skipped_iter, should_checkpoint, should_exit, exit_code, grad_norm, ...)
    reduced, grad_norm = out[0], out[5]
    # train(): args.consumed_train_samples += dp * micro_batch_size * get_num_microbatches()
    args.consumed_train_samples += (
        parallel_state.get_data_parallel_world_size()
        * args.micro_batch_size
        * training.get_num_microbatches()
    )
    loss = None
    if reduced and "lm loss" in reduced:
        value = reduced["lm loss"]  # train_step's data-parallel mean: sum / tokens
        loss = float(value[0] / value[1]) if value.numel() == 2 else float(value)
    lr = next(iter(optimizer.param_groups))["lr"]
    return {
        "loss": loss,
        "lr": float(lr),
        "grad_norm": None if grad_norm is None else float(grad_norm),
        "consumed_samples": int(args.consumed_train_samples),
        "scheduler_num_steps": int(scheduler.num_steps),
    }


def _plant_plan_count_everywhere_in_train_step() -> None:
    """PLANTED BUG (megatron-hsp before issue 7): ``get_num_microbatches`` answers the plan's
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


PLANTS = {"plan-count-in-lr-increment": _plant_plan_count_everywhere_in_train_step}


def _run_hsp(
    options: LoopOptions,
    prefix: str,
    nproc: int,
    steps: int,
    init: dict[str, torch.Tensor],
    plant: str | None = None,
) -> dict[str, Any]:
    import megatron.training.training as training

    from megatron_hsp.megatron import hooks, install, patches

    hsp_flags = [
        *("--hsp", "--data-path", prefix, "--hsp-solver", "greedy", "--hsp-sync-planner"),
        *("--hsp-gpus-per-node", str(nproc), "--hsp-max-seq", "256"),
        *("--hsp-cost-model", prefix + ".cost.json"),
    ]
    args = _megatron_args([*MODEL_FLAGS, *options.flags(), *hsp_flags])
    _set_megatron_globals(args)
    provider, forward_step = install(args, None, None)
    saved = training.train_step, training.get_num_microbatches
    if plant is not None:
        PLANTS[plant]()
    try:
        module = _hsp_model(args)
        _load_weights(module, init)
        model, optimizer, scheduler, config = _wrap(args, module)
        data_iterator, _valid, _test = provider(None)
        from megatron.core.pipeline_parallel import get_forward_backward_func

        run = hooks.active_run()
        records, documents, grads = [], [], []
        for it in range(steps):
            out = training.train_step(
                forward_step,
                data_iterator,
                model,
                optimizer,
                scheduler,
                config,
                get_forward_backward_func(),
                iteration=it,
            )
            grads.append(_grad_shards(model[0], options.distributed_optimizer))
            rec = _step_record(args, out, scheduler, optimizer)
            rec["plan_microbatches"] = len(run.current.plan.microbatches)
            records.append(rec)
            documents.append(_global_documents(run))
        weights = {n: p.detach().clone() for n, p in module.named_parameters()}
        return {"records": records, "documents": documents, "grads": grads, "weights": weights}
    finally:
        if hooks.active_run() is not None and hooks.active_run().pipeline is not None:
            planner = hooks.active_run().pipeline.planner
            if planner is not None:
                planner.close()
        training.train_step, training.get_num_microbatches = saved
        patches.remove_patches()
        hooks.set_run(None)


def _global_documents(run: Any) -> list[np.ndarray]:
    """Every document of the step, in sampler order (read back from the dataset: the reference
    needs all of them, each rank holds only its own)."""
    batch = run.current.batch
    reader = run.pipeline.reader
    return [reader.read(piece) for piece in batch.pieces]


def _run_stock(
    options: LoopOptions, documents: Sequence[Sequence[np.ndarray]], init: dict[str, torch.Tensor]
) -> dict[str, Any]:
    import megatron.training.training as training
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_hsp.testing.cpu_shims import cpu_attention_scores_buffer
    from megatron_hsp.testing.reference import causal_inputs

    args = _megatron_args([*MODEL_FLAGS, *options.flags()])
    _set_megatron_globals(args)
    module = _stock_model(args)
    _load_weights(module, init)
    model, optimizer, scheduler, config = _wrap(args, module)
    dp = parallel_state.get_data_parallel_world_size()
    rank = parallel_state.get_data_parallel_rank()
    longest = max(len(d) for step in documents for d in step)
    cpu_attention_scores_buffer(args.num_attention_heads * longest * longest)
    records, grads = [], []
    for it, docs in enumerate(documents):
        if len(docs) != args.global_batch_size:
            raise RuntimeError(
                f"step {it}: {len(docs)} documents, the stock run needs --global-batch-size "
                f"{args.global_batch_size} samples"
            )
        mine = [causal_inputs(d) for d in docs[rank::dp]]
        out = training.train_step(
            _stock_forward_step,
            iter(mine),
            model,
            optimizer,
            scheduler,
            config,
            get_forward_backward_func(),
            iteration=it,
        )
        grads.append(_grad_shards(model[0], options.distributed_optimizer))
        records.append(_step_record(args, out, scheduler, optimizer))
    weights = {n: p.detach().clone() for n, p in module.named_parameters()}
    return {"records": records, "grads": grads, "weights": weights}


def _rel(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> float:
    num = max(float((x - y).abs().max()) if x.numel() else 0.0 for x, y in zip(a, b, strict=True))
    den = max(float(y.abs().max()) if y.numel() else 0.0 for y in b)
    return num / max(den, 1e-30)


def _worker_all(
    rank: int,
    world_size: int,
    prefix: str,
    options: tuple[LoopOptions, ...],
    steps: int,
    plant: str | None,
) -> list[dict[str, Any]]:
    """Every option set in turn, in this rank's process (Megatron's globals are reset each time)."""
    return [_worker(rank, world_size, prefix, opt, steps, plant) for opt in options]


def _worker(
    rank: int,
    world_size: int,
    prefix: str,
    options: LoopOptions,
    steps: int,
    plant: str | None,
):
    """Both runs on this rank; returns per-step comparisons (max-reduced over ranks)."""
    import contextlib

    import torch.distributed as dist

    from megatron_hsp.testing.cpu_shims import cpu_megatron_training

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    os.environ["LOCAL_WORLD_SIZE"] = str(world_size)
    # Megatron prints its argument table and HSP its step lines on stdout: keep stdout for the
    # parent's report (``selftest --json``) and send them to stderr.
    with contextlib.redirect_stdout(sys.stderr), cpu_megatron_training():
        stock_init = _initial_weights()
        hsp = _run_hsp(options, prefix, world_size, steps, stock_init, plant)
        ref = _run_stock(options, hsp["documents"], stock_init)
    out = []
    for i in range(steps):
        h, r = hsp["records"][i], ref["records"][i]
        diff = torch.tensor([_rel(hsp["grads"][i], ref["grads"][i])], dtype=torch.float64)
        dist.all_reduce(diff, op=dist.ReduceOp.MAX)
        out.append(
            {
                "step": i,
                "loss_hsp": h["loss"],
                "loss_ref": r["loss"],
                "lr_hsp": h["lr"],
                "lr_ref": r["lr"],
                "consumed_samples_hsp": h["consumed_samples"],
                "consumed_samples_ref": r["consumed_samples"],
                "grad_norm_hsp": h["grad_norm"],
                "grad_norm_ref": r["grad_norm"],
                "max_rel_grad_diff": float(diff),
                "plan_microbatches": h["plan_microbatches"],
            }
        )
    wdiff = torch.tensor(
        [_rel(list(hsp["weights"].values()), [ref["weights"][n] for n in hsp["weights"]])],
        dtype=torch.float64,
    )
    dist.all_reduce(wdiff, op=dist.ReduceOp.MAX)
    return {"steps": out, "max_rel_weight_diff_after": float(wdiff)}


def _initial_weights() -> dict[str, torch.Tensor]:
    """The stock model's initial parameters (built from the stock flags, seeded)."""
    args = _megatron_args([*MODEL_FLAGS])
    _set_megatron_globals(args)
    module = _stock_model(args)
    return {n: p.detach().clone() for n, p in module.named_parameters()}


LOSS_RTOL = 1e-6
GRAD_RTOL = 1e-5


def check(steps: list[dict[str, Any]]) -> list[str]:
    """Failures of one option set's steps against the tolerances (empty list: ok)."""
    bad = []
    for s in steps:
        i = s["step"]
        if s["lr_hsp"] != s["lr_ref"]:
            bad.append(f"step {i}: lr {s['lr_hsp']} vs {s['lr_ref']}")
        if s["consumed_samples_hsp"] != s["consumed_samples_ref"]:
            bad.append(
                f"step {i}: consumed samples {s['consumed_samples_hsp']} vs "
                f"{s['consumed_samples_ref']}"
            )
        rel = abs(s["loss_hsp"] - s["loss_ref"]) / max(abs(s["loss_ref"]), 1e-30)
        if not rel <= LOSS_RTOL:
            bad.append(f"step {i}: loss rel diff {rel:.2e} > {LOSS_RTOL:g}")
        if not s["max_rel_grad_diff"] <= GRAD_RTOL:
            bad.append(f"step {i}: grad rel diff {s['max_rel_grad_diff']:.2e} > {GRAD_RTOL:g}")
        gn_h, gn_r = s["grad_norm_hsp"], s["grad_norm_ref"]
        if gn_h is None or gn_r is None or not abs(gn_h - gn_r) <= GRAD_RTOL * abs(gn_r):
            bad.append(f"step {i}: grad norm {gn_h} vs {gn_r}")
    return bad


def run_megatron_loop(
    nproc: int = 4,
    options: Sequence[LoopOptions] = DEFAULT_OPTIONS,
    steps: int = STEPS,
    timeout_s: float = 600.0,
    plant: str | None = None,
) -> list[dict[str, Any]]:
    """The ``megatron_loop`` entries of ``selftest --json``: one per option set.

    ``plant`` names a bug from ``PLANTS`` to plant on the HSP side (tests: it must be caught).
    """
    if plant is not None and plant not in PLANTS:
        raise ValueError(f"unknown plant {plant!r}; known: {sorted(PLANTS)}")
    from megatron_hsp.testing.dist import raise_rank_errors, run_distributed

    results = []
    with tempfile.TemporaryDirectory(prefix="hsp_mloop_") as tmp:
        prefix = os.path.join(tmp, "docs")
        write_corpus(prefix)
        with open(prefix + ".cost.json", "w") as fh:
            json.dump(LOOP_COST_MODEL, fh)
        # One spawn for all option sets: starting 4 processes that import torch and Megatron is
        # most of the cost on a small machine.
        per_rank = raise_rank_errors(
            run_distributed(
                _worker_all, nproc, prefix, tuple(options), steps, plant, timeout_s=timeout_s
            )
        )
        for opt, result in zip(options, per_rank[0], strict=True):
            entry = {"options": opt.as_dict(), **result}
            entry["failures"] = check(entry["steps"])
            entry["ok"] = not entry["failures"]
            results.append(entry)
    return results


def loop_table(entries: Sequence[dict[str, Any]]) -> str:
    """Human-readable ``selftest --megatron`` report: one line per option set and step."""
    lines = [
        f"{'options':<28} {'step':>4} {'loss hsp':>12} {'loss ref':>12} {'lr hsp':>10} "
        f"{'lr ref':>10} {'samples':>9} {'grad rel':>9} {'mb':>3}"
    ]
    for e in entries:
        name = ",".join(k for k, v in e["options"].items() if v) or "ddp"
        for s in e["steps"]:
            lines.append(
                f"{name:<28} {s['step']:>4} {s['loss_hsp']:>12.8f} {s['loss_ref']:>12.8f} "
                f"{s['lr_hsp']:>10.3e} {s['lr_ref']:>10.3e} "
                f"{s['consumed_samples_hsp']:>4}/{s['consumed_samples_ref']:<4} "
                f"{s['max_rel_grad_diff']:>9.1e} {s['plan_microbatches']:>3}"
            )
        lines.extend(f"  FAIL {name}: {f}" for f in e["failures"])
    return "\n".join(lines)
