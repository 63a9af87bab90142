"""A parser with the Megatron flags HSP reads (Megatron's names and defaults), shared by tests."""

from __future__ import annotations

import argparse

from megatron_hsp.megatron.flags import add_hsp_args, hsp_extra_args_provider


def megatron_like_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(allow_abbrev=False)
    p.add_argument("--tensor-model-parallel-size", type=int, default=1)
    p.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    p.add_argument("--context-parallel-size", type=int, default=1)
    p.add_argument("--num-attention-heads", type=int, default=None)
    p.add_argument("--group-query-attention", action="store_true")
    p.add_argument("--num-query-groups", type=int, default=1)
    p.add_argument("--calculate-per-token-loss", action="store_true")
    p.add_argument("--micro-batch-size", type=int, default=None)
    p.add_argument("--global-batch-size", type=int, default=None)
    p.add_argument("--seq-length", type=int, default=None)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--dataloader-type", default=None)
    p.add_argument("--hybrid-context-parallel", action="store_true")
    p.add_argument("--spec", nargs="*", default=None)
    p.add_argument("--eval-iters", type=int, default=100)
    p.add_argument("--full-validation", action="store_true")
    p.add_argument("--attention-dropout", type=float, default=0.1)
    # Megatron's data flags (megatron/training/arguments.py: _add_data_args), as HSP reads them.
    for flag in ("--data-path", "--train-data-path", "--valid-data-path", "--test-data-path"):
        p.add_argument(flag, nargs="*", default=None)
    p.add_argument("--split", default=None)
    p.add_argument("--data-args-path", default=None)
    p.add_argument("--per-split-data-args-path", default=None)
    p.add_argument("--data-cache-path", default=None)
    p.add_argument("--mock-data", action="store_true")
    p.add_argument("--eod-mask-loss", action="store_true")
    p.add_argument("--multiple-validation-sets", action="store_true")
    # Model shape and training flags the default cost model reads. Megatron's defaults are None
    # (it requires them); here a small model, so that tests need not repeat it.
    p.add_argument("--num-layers", type=int, default=2)
    p.add_argument("--hidden-size", type=int, default=384)  # 4, 6 and 8 heads
    p.add_argument("--ffn-hidden-size", type=int, default=None)
    p.add_argument("--kv-channels", type=int, default=None)
    p.add_argument("--swiglu", action="store_true")
    p.add_argument("--vocab-size", type=int, default=1024)
    p.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--fp16", action="store_true")
    p.add_argument("--use-distributed-optimizer", action="store_true")
    p.add_argument("--recompute-granularity", default=None)
    p.add_argument("--recompute-method", default=None)
    p.add_argument("--recompute-num-layers", type=int, default=None)
    p.add_argument("--recompute-modules", nargs="*", default=None)
    p.add_argument("--recompute-activations", action="store_true")
    p.add_argument("--hybrid-layer-pattern", default=None)
    # MoE (issue 17): Megatron's names and defaults.
    p.add_argument("--num-experts", type=int, default=None)
    p.add_argument("--moe-expert-capacity-factor", type=float, default=None)
    return p


def parse(
    argv: list[str], world_size: int = 8, user_provider=None, refuse_early: bool = False
) -> argparse.Namespace:
    """Flags as Megatron's ``parse_args`` leaves them, for ``validate_hsp_args`` to check.

    ``refuse_early``: the parser ``hsp_extra_args_provider`` returns, which runs the early
    refusals as it parses (exit 2); otherwise the same flags without them, so that tests see
    ``validate_hsp_args``'s own ``HSPArgsError``.
    """
    if refuse_early:
        parser = hsp_extra_args_provider(user_provider)(megatron_like_parser())
    else:
        parser = megatron_like_parser()
        if user_provider is not None:
            parser = user_provider(parser) or parser
        parser = add_hsp_args(parser)
    args = parser.parse_args(argv)
    args.world_size = world_size  # what Megatron's validate_args sets from WORLD_SIZE
    return args
