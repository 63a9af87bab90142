"""``--hsp-max-seq`` below ``--seq-length`` is said (issue 42): ``128k`` is 128000 tokens, below
``--seq-length 131072``, and the documents between them follow ``--hsp-overlong`` where stock
Megatron trains them."""

from __future__ import annotations

from megatron_hsp.megatron.config import validate_hsp_args
from tests.helpers.megatron_args import parse

BASE = [
    *("--hsp", "--num-attention-heads", "8", "--global-batch-size", "8"),
    *("--attention-dropout", "0", "--micro-batch-size", "1"),
]
ENV = {"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "8"}


def _notes(extra: list[str]) -> list[str]:
    args = parse([*BASE, *extra], world_size=8)
    config = validate_hsp_args(args, env=ENV, gpu_names=["NVIDIA H100 80GB HBM3"] * 8)
    return [n for n in config.notes if "--hsp-max-seq" in n]


def test_max_seq_below_seq_length_is_noted_with_what_trains_up_to_it():
    (note,) = _notes(["--seq-length", "131072", "--hsp-max-seq", "128k"])
    assert "--hsp-max-seq 128000 is below --seq-length 131072" in note
    assert "documents of 128001 to 131072 tokens follow --hsp-overlong" in note
    assert "--hsp-max-seq 131072 trains up to --seq-length" in note


def test_max_seq_at_or_above_seq_length_says_nothing():
    assert _notes(["--seq-length", "131072", "--hsp-max-seq", "131072"]) == []
    assert _notes(["--seq-length", "131072"]) == []
