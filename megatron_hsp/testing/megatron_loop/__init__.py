"""``selftest --megatron``: Megatron's own ``train_step`` with HSP installed vs the stock path, CPU.

The loop is split by concern (what runs and how it is judged: ``hsp_side``'s docstring).
This package keeps the names its users import.
"""

from __future__ import annotations

from megatron_hsp.testing.megatron_loop.checks import (
    GRAD_RTOL,
    LOSS_RTOL,
    WEIGHT_RTOL,
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
from megatron_hsp.testing.megatron_loop.hsp_side import (
    CHANGED_SPLIT,
    CKPT_FORMAT,
    NO_REFIT,
    loop_table,
    run_megatron_loop,
    run_megatron_plants,
)
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
    "GRAD_RTOL",
    "HEAD_DIM",
    "KV_GROUPS",
    "LOSS_RTOL",
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
    "WEIGHT_RTOL",
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
