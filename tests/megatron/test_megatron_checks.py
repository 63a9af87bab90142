"""``megatron/megatron_checks.py`` against the original: Megatron's own ``validate_args`` runs on
the same flag sets and both must refuse (for the reason the mirror cites) or both accept. A
mirror checked against itself would pass whatever it said (issue 42, item 2)."""

from __future__ import annotations

import argparse
import copy
import sys

import pytest

from megatron_hsp.megatron.megatron_checks import MegatronArgsError, check_as_megatron_validates

BASE = ["--num-layers", "2", "--hidden-size", "256", "--num-attention-heads", "8",
        "--seq-length", "1024", "--max-position-embeddings", "1024",
        "--micro-batch-size", "1"]  # fmt: skip

# (flags after BASE, world size, what Megatron's refusal says, or None: both accept).
CASES = [
    ([], 8, None),
    (["--global-batch-size", "63", "--micro-batch-size", "2", "--context-parallel-size", "4"],
     32, "eval_global_batch_size (63) must be divisible"),
    (["--global-batch-size", "64", "--micro-batch-size", "2", "--context-parallel-size", "4"],
     32, None),
    (["--global-batch-size", "48"], 32, "eval_global_batch_size (48) must be divisible"),
    (["--max-position-embeddings", "512"], 8, "max_position_embeddings (512) must be greater"),
    (["--seq-length", "1022", "--context-parallel-size", "4"], 8, "multiple of 2 * context"),
    (["--seq-length", "1020", "--context-parallel-size", "4"], 8, "multiple of 2 * context"),
    (["--seq-length", "1016", "--context-parallel-size", "4"], 8, None),
    (["--seq-length", "1022", "--context-parallel-size", "1"], 8, None),
    (["--tensor-model-parallel-size", "2", "--context-parallel-size", "4"], 12,
     "world size (12) is not divisible"),
]  # fmt: skip


def megatron_args(flags: list[str], world: int, monkeypatch: pytest.MonkeyPatch):
    arguments = pytest.importorskip("megatron.training.arguments")
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("RANK", "0")
    # validate_args asks the GPU's architecture when CP or TP > 1 (for a performance warning
    # only); this machine has none: an H100's (9) answers it.
    monkeypatch.setattr(arguments, "get_device_arch_version", lambda: 9, raising=False)
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")  # as Megatron's examples launch
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *BASE, *flags])
    return arguments, arguments.parse_args()


@pytest.mark.spawns  # megatron-core's import runs ldconfig
@pytest.mark.parametrize(("flags", "world", "megatron_says"), CASES)
def test_mirror_refuses_exactly_what_validate_args_refuses(
    flags: list[str], world: int, megatron_says: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    arguments, args = megatron_args(flags, world, monkeypatch)
    mirrored = copy.deepcopy(args)
    try:
        arguments.validate_args(args)
        original = None
    except (AssertionError, ValueError) as exc:
        original = str(exc)
    if megatron_says is None:
        assert original is None, original
        check_as_megatron_validates(mirrored)
    else:
        assert original is not None and megatron_says in original, original
        with pytest.raises(MegatronArgsError, match="Megatron's validate_args refuses it"):
            check_as_megatron_validates(mirrored)


@pytest.mark.parametrize(
    ("values", "needle"),
    [
        ({"global_batch_size": 63, "micro_batch_size": 2, "context_parallel_size": 4},
         "--global-batch-size 63 is not a multiple of --micro-batch-size 2 x 8 data-parallel "
         "ranks = 16 (Megatron's validate_args refuses it for your job); use a multiple of 16, "
         "e.g. 48 or 64"),
        ({"seq_length": 32766, "context_parallel_size": 4},
         "--seq-length 32766 is not a multiple of 2 x --context-parallel-size 4 = 8"),
        ({"seq_length": 32768, "max_position_embeddings": 8192},
         "--max-position-embeddings 8192 is below --seq-length 32768"),
    ],
)  # fmt: skip
def test_each_refusal_is_one_line_naming_the_flag_and_what_works(values: dict, needle: str) -> None:
    ns = argparse.Namespace(world_size=32, **values)
    with pytest.raises(MegatronArgsError) as exc:
        check_as_megatron_validates(ns)
    assert needle in str(exc.value) and "\n" not in str(exc.value), exc.value
