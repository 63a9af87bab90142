"""``python -m megatron_hsp.launch --help`` lists every ``--hsp*`` flag Megatron's parser gains."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from megatron_hsp.megatron.flags import add_hsp_args

pytestmark = pytest.mark.spawns


def test_launch_help_lists_every_hsp_flag_with_its_default():
    out = subprocess.run(
        [sys.executable, "-m", "megatron_hsp.launch", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    flags = [
        opt
        for action in add_hsp_args(argparse.ArgumentParser())._actions
        for opt in action.option_strings
        if opt.startswith("--hsp")
    ]
    assert len(flags) >= 10
    missing = [f for f in flags if f not in out]
    assert not missing, f"launch --help does not list {missing}"
    assert "Planner backend. (default: highs)" in " ".join(out.split())
    # Every flag says its default (issue 18): the help of each, up to the next flag.
    text = " ".join(out.split())
    for flag, nxt in zip(flags, [*flags[1:], None], strict=True):
        start = text.index(f" {flag} ")
        end = text.index(f" {nxt} ", start) if nxt else len(text)
        assert "default" in text[start:end].lower(), f"launch --help: {flag} names no default"
