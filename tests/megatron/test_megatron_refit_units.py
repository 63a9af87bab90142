"""The online refit's flags (``--hsp-no-refit``, ``--hsp-refit-out``) and the micro-batch clock
(CPU path), without spawning ranks; the Megatron loop itself is
tests/megatron/test_megatron_refit.py."""

from __future__ import annotations

import time

import pytest
import torch

from megatron_hsp.megatron.config import REFIT_FILE, validate_hsp_args
from megatron_hsp.step.mbclock import MicrobatchClock
from tests.helpers.megatron_args import parse

BASE = [
    *("--num-attention-heads", "8", "--global-batch-size", "64", "--seq-length", "4096"),
    *("--eval-iters", "0", "--attention-dropout", "0", "--hsp"),
]


def test_refit_is_on_by_default_and_writes_next_to_the_checkpoint(tmp_path):
    cfg = validate_hsp_args(parse(BASE), env={})
    assert cfg.refit and cfg.refit_out is None  # no --save: nowhere to write by default
    args = parse(BASE)
    args.save = str(tmp_path / "ckpt")
    assert validate_hsp_args(args, env={}).refit_out == str(tmp_path / "ckpt" / REFIT_FILE)
    out = str(tmp_path / "model.yaml")
    assert validate_hsp_args(parse([*BASE, "--hsp-refit-out", out]), env={}).refit_out == out


def test_no_refit_turns_it_off():
    cfg = validate_hsp_args(parse([*BASE, "--hsp-no-refit"]), env={})
    assert not cfg.refit and cfg.refit_out is None


@pytest.mark.parametrize(
    "extra, flag",
    [
        (["--hsp-no-refit", "--hsp-refit-out", "x.yaml"], "--hsp-no-refit"),
        (["--hsp-refit-out", "/no/such/dir/x.yaml"], "--hsp-refit-out /no/such/dir/x.yaml"),
    ],
)
def test_bad_refit_flags_are_one_line_and_exit_2(extra, flag, capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(SystemExit) as stopped:
        parse([*BASE, *extra], refuse_early=True)
    assert stopped.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("megatron-hsp: error: ") and flag in err[0], err


def test_clock_gives_each_microbatch_from_its_start_to_the_next():
    clock = MicrobatchClock(torch.device("cpu"))
    clock.start_step()
    for pause in (0.05, 0.0, 0.1):
        clock.mark()
        time.sleep(pause)
    assert clock.read() == []  # not ended: nothing to report
    clock.end()
    clock.mark()  # after the end (an evaluation, a late call): ignored
    clock.end()  # the second end (schedule return after the finalize seam): ignored
    took = clock.read()
    assert len(took) == 3
    assert took[0] >= 0.05 and took[1] < 0.05 and took[2] >= 0.1
    clock.start_step()
    assert clock.read() == []
