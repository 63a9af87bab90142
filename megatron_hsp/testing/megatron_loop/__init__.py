"""``selftest --megatron``: Megatron's own ``train_step`` with HSP installed vs the stock path, CPU.

What runs, on 4 gloo CPU ranks, for each option set (``DEFAULT_OPTIONS``: plain DDP, distributed
optimizer, overlapped grad reduce, tensor parallel 2 with ``--sequence-parallel`` under Ulysses
and under ring groups, pure-ring and hybrid Ulysses x ring groups):

* **HSP side, as users get it.** Megatron's real argument parser and ``validate_args`` on the
  flags a user passes plus ``--hsp ...`` (through ``hsp_extra_args_provider``); Megatron's
  ``set_global_variables``; ``megatron_hsp.megatron.install(args, ...)`` (validation, patches);
  HSP's dataset provider (indexed dataset on disk, document sampler, planner, plan agreement) and
  ``hsp_forward_step``, with the users' defaults (the online refit on, re-planning later steps
  from this machine's timings; the default ``--hsp-overlong split``; ``--hsp-max-seq`` from
  ``--seq-length``) except for ``TEST_ONLY_SWITCHES`` (``options.py``: each with its reason,
  printed at the head of the report); the model built from the layer spec HSP's ``--spec`` loads
  (``layer_spec.hsp_spec_from_args``); megatron-core ``DistributedDataParallel``, Megatron's
  optimizer (``get_megatron_optimizer``), ``finalize_model_grads`` and opt-param scheduler
  (``get_optimizer_param_scheduler``); then ``megatron.training.training.train_step`` (patched).
* **Stock side.** The same flags without ``--hsp``: stock megatron-core local spec (its own
  ``DotProductAttention`` with a causal mask, its own RoPE), each document its own ``[1, L]``
  micro-batch over the data-parallel ranks (micro-batch size 1, so ``global batch / dp``
  micro-batches per rank: the documents of the HSP step, in order, round-robin), a
  ``pretrain_gpt.py``-style forward step and per-token loss written here from Megatron's
  documented contract (no HSP code), and Megatron's unpatched ``train_step``. Its tokens are read
  with megatron-core's own ``IndexedDataset`` (``MegatronDocuments``), never with HSP's
  ``DocumentReader``: only the sampler's choice (document id, offset, length of each piece) is
  taken from the HSP side, as plan data. Under ``--sequence-parallel`` each document is padded at
  its end to a multiple of the TP size with loss mask 0 (causal: no real token sees the padding).
* **Megatron's own bookkeeping, driven apart from both runs.** The expected learning rate of each
  step comes from a fresh ``OptimizerParamScheduler`` (built by Megatron's
  ``get_optimizer_param_scheduler`` from the same flags) stepped by ``--global-batch-size``; the
  expected consumed samples from Megatron's ``MegatronPretrainingSampler`` on every
  data-parallel rank, fed ``ConstantNumMicroBatchesCalculator``'s count of micro-batches.

Both start from the same weights (the stock model's, copied by parameter name). Per step the
comparison covers the reduced loss, each parameter's gradient on its own scale (the DDP gradient
buffer after ``finalize_model_grads``, cut back into parameters by the buffer's
``param_index_map``; under the distributed optimizer each rank's shard, per parameter slice that
falls in it), the learning rate and consumed samples against Megatron's own values (above), the
documents trained against Megatron's sample count, and the grad norm; after the steps, each
parameter's weights.

The token-budget option set (``batch_unit="tokens"``: no ``--hsp-batch-unit``, the users'
default) trains the stock step's ``--global-batch-size x --seq-length`` tokens of whole documents
a step; the stock side runs the same documents, one ``[1, L]`` micro-batch each, through
Megatron's schedule with its rank's count (``stock_side._schedule_of``). Its groups hold 128
tokens at most, so the default ``--hsp-overlong split`` cuts the longer documents into pieces,
which the stock side reads and the sampler oracle expects (``split_units``).

The evaluation option set adds, on both sides: Megatron's own ``evaluate()`` on the validation split
after every step and on the test split at the end (HSP: planned batches of the splits' own
samplers through the patched ``get_forward_backward_func``; stock: the same documents as
``[1, L]`` samples, unpatched), a two-dataset blend (``--data-path 0.4 A 0.6 B``, the stock side
reading both with ``IndexedDataset``), and a restart of the HSP side after step 2 through
Megatron's own checkpointing (``--save``/``--load``, ``--ckpt-format torch``): Megatron's
``save_checkpoint``, everything dropped, a fresh model, optimizer and scheduler from the flags
restored by Megatron's ``load_checkpoint`` (which also restores ``args``' consumed samples), HSP
rebuilt from the flags; the stock side runs through. Checked besides: every batch trained or
evaluated is an uninterrupted run's, lies in Megatron's own split of its dataset, the blend's
token shares follow its weights, and what the load restored (iteration, consumed samples, the
scheduler's steps, the weights bit for bit, HSP's resume record) is what the uninterrupted run
had at the save (``_data_checks``).

The stock side reads the pieces HSP's sampler chose, so which documents are drawn is
judged apart, in every option set, by ``testing/sampler_oracle.py`` (no HSP code): every
document of megatron-core's own split (its dataset builder run on ``IndexedDataset``) with >= 2
tokens is drawn once per epoch, over the pieces trained and evaluated (across the restart) and
more drawn from copies of the live samplers; a blend's draws follow the deficit rule re-run on
the pieces' lengths, its token shares within the rule's bound. ``EVAL_SPLIT`` puts no split
boundary on an integer. ``margins`` reports every check's worst over its tolerance.

The pipeline option sets run the HSP side on 2 pipeline stages (``--pipeline-model-parallel-size
2``: 1F1B, then interleaved with a chunk per virtual stage, and evaluating): Megatron's parallel
state with the pipeline for the HSP side only (``_pipeline_state``), its model chunks built as
``training.get_model`` builds them (``_hsp_model``), its provider called once per chunk
(``_hsp_iterators``). The stock side is the *unpipelined* model on the same documents (why:
``_pipeline_state``); parameters are compared by their unpipelined names (``global_names``:
a stage's ``decoder.layers.<i>`` by its global layer number), each on the stage that holds it.

What ``train()`` does around ``train_step`` is not run (it is one long function without a seam).
The few lines this loop needs from it are reproduced and named: the ``config`` hooks
``train()`` sets before its loop (``grad_scale_func``, ``no_sync_func``/``grad_sync_func`` under
``--overlap-grad-reduce``, ``finalize_model_grads_func``) and its consumed-samples update
(``args.consumed_train_samples += dp * micro_batch_size * get_num_microbatches()``, read from
``megatron.training.training`` so a patched count would show). Device placement shims:
``testing.cpu_shims`` only (listed in ``megatron/patches.py``).

Where each part lives: ``options`` (the option sets and the run's sizes), ``corpus`` (the data
and megatron-core's reader of it), ``models`` (model build, weight copy, DDP and optimizer,
gradient readout), ``plants`` (the planted bugs and where each runs), ``hsp_side``,
``stock_side``, ``checks`` (comparisons, data and sampler-oracle checks, tolerances, margins),
``driver`` (the spawn, the per-rank worker, the report); ``refit`` runs the online refit under
the same machinery. This package keeps the names its users import.
"""

from __future__ import annotations

from megatron_hsp.testing.megatron_loop.checks import (
    check,
    check_data,
    format_margin,
    margin,
    margins,
    megatron_schedule,
    per_param_diff,
    worst_check,
)
from megatron_hsp.testing.megatron_loop.corpus import BLEND_CHOICES, MegatronDocuments, write_corpus
from megatron_hsp.testing.megatron_loop.driver import (
    loop_table,
    run_megatron_loop,
    run_megatron_plants,
)
from megatron_hsp.testing.megatron_loop.hsp_side import CHANGED_SPLIT, CKPT_FORMAT, NO_REFIT
from megatron_hsp.testing.megatron_loop.models import global_names, param_grads
from megatron_hsp.testing.megatron_loop.options import (
    BLEND_WEIGHTS,
    CONTINUE_EPOCHS,
    DEFAULT_OPTIONS,
    EVAL_INTERVAL,
    EVAL_ITERS,
    EVAL_SPLIT,
    GLOBAL_BATCH,
    HEAD_DIM,
    KV_GROUPS,
    MODEL_FLAGS,
    MOE_TOPK,
    PIPELINE_LAYERS,
    RESUME_AFTER,
    SP_SPEC,
    STEPS,
    TEST_ONLY_SWITCHES,
    LoopOptions,
)
from megatron_hsp.testing.megatron_loop.plants import (
    GRAD_PLANT_SCALE,
    NOT_UPDATED_PARAM,
    PLANT_RUNS,
    PLANTED,
    PLANTS,
)
from megatron_hsp.testing.megatron_loop.stock_side import stock_sample

__all__ = [
    "BLEND_CHOICES",
    "BLEND_WEIGHTS",
    "CHANGED_SPLIT",
    "CKPT_FORMAT",
    "CONTINUE_EPOCHS",
    "DEFAULT_OPTIONS",
    "EVAL_INTERVAL",
    "EVAL_ITERS",
    "EVAL_SPLIT",
    "GLOBAL_BATCH",
    "GRAD_PLANT_SCALE",
    "HEAD_DIM",
    "KV_GROUPS",
    "MODEL_FLAGS",
    "MOE_TOPK",
    "NOT_UPDATED_PARAM",
    "NO_REFIT",
    "PIPELINE_LAYERS",
    "PLANTED",
    "PLANTS",
    "PLANT_RUNS",
    "RESUME_AFTER",
    "SP_SPEC",
    "STEPS",
    "TEST_ONLY_SWITCHES",
    "LoopOptions",
    "MegatronDocuments",
    "check",
    "check_data",
    "format_margin",
    "global_names",
    "loop_table",
    "margin",
    "margins",
    "megatron_schedule",
    "param_grads",
    "per_param_diff",
    "run_megatron_loop",
    "run_megatron_plants",
    "stock_sample",
    "worst_check",
    "write_corpus",
]
