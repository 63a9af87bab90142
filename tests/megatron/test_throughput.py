"""Honest throughput under ``--hsp`` (issue 43): Megatron's ``--log-throughput`` FLOPs count the
documents a step trained, not ``batch_size x --seq-length`` tokens.

The expected figures are counted by hand here (GEMM FLOPs = 2 x multiply-adds, forward +
two backward GEMMs = 3x, causal attention over each document alone), never by calling the
function under test."""

from __future__ import annotations

import sys
import types

import pytest

pytest.importorskip("megatron.training.training")

from megatron_hsp.megatron import hooks, patches
from megatron_hsp.step.observe import StepRecord
from megatron_hsp.step.sampler import DocumentBatch, Piece
from tests.megatron.test_integration_hooks import plan2

LAYERS, HIDDEN, HEADS, GROUPS, FFN, VOCAB, SEQ, GBS = 2, 64, 4, 2, 128, 128, 256, 8
LENGTHS = [200, 37, 37, 5, 251]  # one step's documents: 530 tokens, not GBS x SEQ = 2048


def megatron_args():
    """This tiny GPT's flags through Megatron's own parser (GQA, SwiGLU)."""
    from megatron.training.arguments import parse_args

    argv = [
        *("--num-layers", str(LAYERS), "--hidden-size", str(HIDDEN)),
        *("--num-attention-heads", str(HEADS), "--group-query-attention"),
        *("--num-query-groups", str(GROUPS), "--ffn-hidden-size", str(FFN), "--swiglu"),
        *("--seq-length", str(SEQ), "--max-position-embeddings", str(SEQ)),
        *("--micro-batch-size", "1", "--global-batch-size", str(GBS)),
        *("--vocab-size", str(VOCAB)),
    ]
    saved = sys.argv
    sys.argv = ["pretrain_gpt.py", *argv]
    try:
        args = parse_args()
    finally:
        sys.argv = saved
    args.padded_vocab_size = VOCAB  # what validate_args / the tokenizer set
    args.kv_channels = HIDDEN // HEADS
    return args


def hand_count(lengths: list[int]) -> float:
    """Model FLOPs of one step training ``lengths``, each a causal sequence of its own."""
    head = HIDDEN // HEADS
    q, kv = HEADS * head, GROUPS * head
    per_token_layer = 2 * (HIDDEN * (q + 2 * kv) + q * HIDDEN + 3 * HIDDEN * FFN)  # SwiGLU: 3
    per_token = LAYERS * per_token_layer + 2 * HIDDEN * VOCAB  # + the logits
    # Causal attention per layer and document: QK^T and AV over half of the L x L scores.
    attention = sum(LAYERS * 2 * (2 * q * n * n / 2) for n in lengths)
    return 3 * (per_token * sum(lengths) + attention)


@pytest.fixture()
def hsp_step():
    """An --hsp run whose step just trained ``LENGTHS``, with the training patches applied."""
    batch = DocumentBatch(5, tuple(Piece(i, 0, n) for i, n in enumerate(LENGTHS)))
    run = types.SimpleNamespace(pipeline=object(), current=types.SimpleNamespace(batch=batch))
    patches.apply_training_patches()
    hooks.set_run(run)  # type: ignore[arg-type]
    yield
    hooks.set_run(None)
    patches.remove_patches()


def test_megatron_counts_the_documents_trained_under_hsp(hsp_step):
    from megatron.training import training

    args = megatron_args()
    flops = training.num_floating_point_operations(args, GBS)
    assert flops == pytest.approx(hand_count(LENGTHS), rel=1e-12)
    # What Megatron's training_log prints as TFLOP/s/GPU for a 0.25 s iteration on 4 GPUs.
    elapsed, world = 0.25, 4
    printed = flops / (elapsed * 10**12 * world)
    assert printed == pytest.approx(hand_count(LENGTHS) / (elapsed * 1e12 * world), rel=1e-12)
    # The step record's line says the same figure and the tokens per second.
    rec = StepRecord.from_plan(
        5, plan2(), measured_s=elapsed, model_flops=flops, gpus=world, batch_fingerprint="x"
    )
    assert rec.tflops_per_gpu == pytest.approx(printed, rel=1e-12)
    assert rec.tokens_per_s == pytest.approx(rec.tokens / elapsed)
    line = rec.console_line()
    assert f"{rec.tflops_per_gpu:.3g} TFLOP/s/GPU" in line and "tok/s" in line
    assert "pred 14 ms" in line and "meas 250 ms" in line


def test_unpatched_megatron_assumes_seq_length_samples():
    """Why the patch: stock Megatron counts GBS samples of --seq-length tokens, whatever the
    step trained (the count the test above must not get)."""
    from megatron.training import training

    args = megatron_args()
    stock = training.num_floating_point_operations(args, GBS)
    assert stock == pytest.approx(hand_count([SEQ] * GBS), rel=1e-12)
    assert stock > 3 * hand_count(LENGTHS)


def test_outside_a_step_the_patch_passes_through(hsp_step):
    from megatron.training import training

    hooks.set_run(None)
    args = megatron_args()
    assert training.num_floating_point_operations(args, GBS) == pytest.approx(
        hand_count([SEQ] * GBS), rel=1e-12
    )


def test_a_release_without_packed_counts_is_asked_per_length():
    """A Megatron whose count takes only (args, batch_size): one call per distinct length."""
    from megatron.training.training import num_floating_point_operations as real

    def old_release(args, batch_size):
        return real(args, batch_size)

    flops = hooks.document_flops(old_release, megatron_args(), LENGTHS)
    assert flops == pytest.approx(hand_count(LENGTHS), rel=1e-12)
