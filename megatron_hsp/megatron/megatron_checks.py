"""The checks of Megatron's own ``validate_args`` that ``plan``/``bench`` make on a job's flags.

Why a mirror: ``bench`` reads a Megatron job's flags without importing torch (without
``--data-path`` it must not), and ``megatron.training.arguments`` imports torch, so it cannot
call ``validate_args``. A flag set that Megatron refuses must not plan: the user's stock job
would stop at its first line, and so would the same job under ``--hsp``. Each check below cites
the ``validate_args`` statement it mirrors (megatron-core 0.18-0.20,
``megatron/training/arguments.py``); ``tests/megatron/test_megatron_checks.py`` runs Megatron's
real ``validate_args`` on the same flag sets and asserts both refuse or both accept, so the
mirror is checked against the original. Only the checks on flags the planner reads are here;
the rest of ``validate_args`` is the training run's.

This module imports neither torch nor Megatron.
"""

from __future__ import annotations

import argparse

from megatron_hsp.megatron.refusals import arg_value
from megatron_hsp.planner.errors import InputError


class MegatronArgsError(InputError):
    """A flag set Megatron's ``validate_args`` refuses (one line naming the flag)."""


def check_as_megatron_validates(args: argparse.Namespace, job: str = "your job") -> None:
    """Refuse, in one line naming the flag and what would work, what ``validate_args`` refuses.

    ``args`` uses Megatron's attribute names and holds ``world_size`` (torchrun's, which
    Megatron reads from ``WORLD_SIZE``); ``job`` names the run checked in the message (the
    stock job as given, or the same job under ``--hsp``)."""
    world = int(args.world_size)
    tp = int(arg_value(args, "tensor_model_parallel_size", 1))
    pp = int(arg_value(args, "pipeline_model_parallel_size", 1))
    cp = int(arg_value(args, "context_parallel_size", 1))
    mbs = int(arg_value(args, "micro_batch_size", 1))
    gbs = arg_value(args, "global_batch_size", None)
    seq = arg_value(args, "seq_length", None)
    positions = arg_value(args, "max_position_embeddings", None)
    why = f"Megatron's validate_args refuses it for {job}"
    # validate_args: ``assert args.world_size % total_model_size == 0`` (total_model_size =
    # tensor x pipeline x context parallel sizes).
    model = tp * pp * cp
    if world % model:
        raise MegatronArgsError(
            f"world size {world} is not a multiple of --tensor-model-parallel-size {tp} x "
            f"--pipeline-model-parallel-size {pp} x --context-parallel-size {cp} = {model} "
            f"({why}); fix the sizes or --nnodes/--nproc-per-node/--world-size"
        )
    dp = world // model
    # validate_args: ``args.eval_global_batch_size`` defaults to ``args.global_batch_size`` and
    # ``args.eval_micro_batch_size`` to ``args.micro_batch_size``, then ``assert
    # args.eval_global_batch_size % (args.eval_micro_batch_size * args.data_parallel_size)
    # == 0`` (megatron-core's microbatch calculator asserts the same of the training batch).
    if gbs is not None and int(gbs) % (mbs * dp):
        step = mbs * dp
        lower, upper = int(gbs) // step * step, (int(gbs) // step + 1) * step
        fits = f"{lower} or {upper}" if lower else f"{upper}"
        raise MegatronArgsError(
            f"--global-batch-size {gbs} is not a multiple of --micro-batch-size {mbs} x {dp} "
            f"data-parallel ranks = {step} ({why}); use a multiple of {step}, e.g. {fits}"
        )
    # validate_args: ``if args.seq_length is not None and args.context_parallel_size > 1:
    # assert args.seq_length % (args.context_parallel_size * 2) == 0``.
    if seq is not None and cp > 1 and int(seq) % (2 * cp):
        step = 2 * cp
        raise MegatronArgsError(
            f"--seq-length {seq} is not a multiple of 2 x --context-parallel-size {cp} = {step} "
            f"({why}); use a multiple of {step}, e.g. {int(seq) // step * step or step}"
        )
    # validate_args: ``if args.seq_length is not None: assert args.max_position_embeddings >=
    # args.seq_length`` (Megatron requires --max-position-embeddings; bench prices a job that
    # omits it, whose positions do not limit it under RoPE).
    if seq is not None and positions is not None and int(positions) < int(seq):
        raise MegatronArgsError(
            f"--max-position-embeddings {positions} is below --seq-length {seq} ({why}); "
            f"raise --max-position-embeddings to at least {seq} or lower --seq-length"
        )
