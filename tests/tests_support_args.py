"""A parser with the Megatron flags HSP reads (Megatron's names and defaults), shared by tests."""

from __future__ import annotations

import argparse

from megatron_hsp.megatron.args import hsp_extra_args_provider


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
    return p


def parse(argv: list[str], world_size: int = 8, user_provider=None) -> argparse.Namespace:
    parser = hsp_extra_args_provider(user_provider)(megatron_like_parser())
    args = parser.parse_args(argv)
    args.world_size = world_size  # what Megatron's validate_args sets from WORLD_SIZE
    return args
