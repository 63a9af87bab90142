"""Length limits a Megatron user can see under ``--hsp`` (issue 32): documents longer than
``--seq-length`` (or ``--hsp-max-seq``, or learned absolute positions'
``--max-position-embeddings``) follow ``--hsp-overlong``, and the start-up line says how many
and what happens to them. Before, whole documents trained up to what the largest group's memory
held, silently past ``--seq-length`` and past the learned position embeddings."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from megatron_hsp.megatron import hooks
from megatron_hsp.megatron.config import validate_hsp_args
from megatron_hsp.megatron.refusals import HSPArgsError
from megatron_hsp.planner.errors import InputError
from megatron_hsp.step.corpus import write_indexed_dataset
from tests.helpers import FIXTURES
from tests.helpers.megatron_args import parse

TINY = str(FIXTURES / "cost-model-tiny.yaml")
# Tiny cost model: 64 tokens per rank, so the largest group (4 ranks) holds 256 tokens.
LENGTHS = (10, 100, 200, 40)


def positions(parser):
    parser.add_argument("--position-embedding-type", default="learned_absolute")
    parser.add_argument("--max-position-embeddings", type=int, default=None)
    return parser


def config(tmp_path: Path, *flags: str):
    prefix = tmp_path / "docs"
    write_indexed_dataset(prefix, [np.arange(n) % 50 for n in LENGTHS])
    argv = [
        *("--num-attention-heads", "8", "--global-batch-size", "2", "--attention-dropout", "0"),
        *("--hsp", "--hsp-cost-model", TINY, "--data-path", str(prefix)),
        *("--hsp-gpus-per-node", "4"),
        *flags,
    ]
    args = parse(argv, world_size=4, user_provider=positions)
    return args, validate_hsp_args(args)


def sampler_of(args, cfg, monkeypatch):
    """``hooks.build_pipeline`` up to the training sampler (the rest needs process groups)."""
    import torch.distributed as dist

    class Built(Exception):
        pass

    monkeypatch.setattr(hooks, "_head_space", lambda method: None)
    monkeypatch.setattr(
        "megatron_hsp.runtime.groups.create_groups_from_megatron", lambda *a, **k: None
    )
    monkeypatch.setattr(dist, "get_rank", lambda *a, **k: 0)

    def stop(args, fingerprint):
        raise Built

    monkeypatch.setattr(hooks, "check_and_record_data", stop)
    with pytest.raises(Built):
        hooks.build_pipeline(hooks.HSPRun(config=cfg), args)


@pytest.mark.parametrize(
    ("flags", "line"),
    [
        (
            ("--seq-length", "64", "--max-position-embeddings", "64", "--hsp-overlong", "split"),
            "training split: 2 of 4 documents are over 64 tokens (--seq-length): split into "
            "64-token pieces (--hsp-overlong split)",
        ),
        (
            ("--seq-length", "64", "--max-position-embeddings", "64", "--hsp-overlong", "drop"),
            "training split: 2 of 4 documents are over 64 tokens (--seq-length): dropped "
            "(--hsp-overlong drop)",
        ),
        (  # RoPE: --hsp-max-seq past --max-position-embeddings is fine, memory binds
            (
                *("--seq-length", "64", "--max-position-embeddings", "64"),
                *("--position-embedding-type", "rope", "--hsp-max-seq", "1000"),
            ),
            "training split: no document over 256 tokens (what the largest group's memory holds)",
        ),
    ],
)
def test_documents_over_the_limit_follow_hsp_overlong_and_are_counted(
    tmp_path, monkeypatch, capsys, flags, line
):
    args, cfg = config(tmp_path, *flags)
    sampler_of(args, cfg, monkeypatch)
    assert f"[megatron-hsp] {line}\n" in capsys.readouterr().out


def test_overlong_error_names_the_limit_and_its_flag(tmp_path, monkeypatch):
    args, cfg = config(
        tmp_path, "--seq-length", "64", "--max-position-embeddings", "64", "--hsp-overlong", "error"
    )
    with pytest.raises(InputError, match=r"2 documents are longer .* is --seq-length;") as exc:
        sampler_of(args, cfg, monkeypatch)
    # Only what can help: the limit is --seq-length, memory flags cannot lengthen it (issue 42).
    assert "a larger --seq-length" in str(exc.value), exc.value
    assert "--hsp-memory-cap-gb" not in str(exc.value) and "--hsp-group-sizes" not in str(exc.value)


def test_overlong_error_bound_by_memory_suggests_memory_flags(tmp_path, monkeypatch):
    """RoPE and --hsp-max-seq 1000: the largest group's 256 tokens bind, so the memory cap, group
    sizes or more GPUs are what can train the 1000-token documents whole."""
    args, cfg = config(
        tmp_path,
        *("--seq-length", "1000", "--max-position-embeddings", "1000"),
        *("--position-embedding-type", "rope", "--hsp-overlong", "error"),
    )
    # Documents of 10/100/200/40 tokens all fit 256; make one longer through the corpus.
    prefix = tmp_path / "docs"
    write_indexed_dataset(prefix, [np.arange(n) % 50 for n in (10, 300, 200)])
    with pytest.raises(InputError, match="what the largest group's memory holds;") as exc:
        sampler_of(args, cfg, monkeypatch)
    assert "--hsp-memory-cap-gb" in str(exc.value) and "larger --seq-length" not in str(exc.value)


def test_default_splits_overlong_documents_at_the_limit_and_says_so(tmp_path, monkeypatch, capsys):
    """No --hsp-overlong: documents past --seq-length are cut into --seq-length pieces, as stock
    Megatron cuts them into --seq-length samples; the start-up line counts them (issue 42: the
    default used to stop the run on every real corpus)."""
    args, cfg = config(tmp_path, "--seq-length", "64", "--max-position-embeddings", "64")
    assert cfg.overlong == "split"
    sampler_of(args, cfg, monkeypatch)
    line = (
        "[megatron-hsp] training split: 2 of 4 documents are over 64 tokens (--seq-length): "
        "split into 64-token pieces (--hsp-overlong split)\n"
    )
    assert line in capsys.readouterr().out


def test_learned_positions_never_exceed_max_position_embeddings(tmp_path):
    with pytest.raises(HSPArgsError, match="--hsp-max-seq 128 is longer than --max-position-emb"):
        config(tmp_path, *("--seq-length", "64", "--max-position-embeddings", "96"),
               "--hsp-max-seq", "128")  # fmt: skip
