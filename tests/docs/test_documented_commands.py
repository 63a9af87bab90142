"""The ``megatron-hsp ...`` commands in the README's and docs' fenced blocks (issue 42): every
one parses with the real command-line parser; usage synopses (``[--flag]``, ``<...>``, ``a|b``)
name only flags the command has; the README's own ``bench`` runs on real indexed datasets;
and every command not run here is listed in ``NOT_RUN`` with the reason and where it is run.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest

from megatron_hsp import cli

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]

# Commands not run by this file, each with why and where it does run.
NOT_RUN: dict[str, str] = {
    "selftest": "spawns 4-8 CPU ranks for minutes (--megatron: Megatron's train_step on 4 more); "
    "run by tests/testing/test_selftest.py and test_selftest_reference.py",
    "demo": "spawns CPU ranks and trains for minutes; run by tests/commands/test_integration_demo"
    ".py and test_reliability_demo.py",
    "profile": "measures this machine for about a minute; run by tests/commands/"
    "test_profile_command.py",
    "compare": "reads two training runs' plan logs, which only a training run writes; run on "
    "real plan logs by tests/commands/test_compare.py and tests/testing/test_megatron_loop.py",
    "plan": "documented as a synopsis with the bench command's job flags (the bench below runs "
    "here); run by tests/commands/test_cli_plan_bench.py",
}
SYNOPSIS = re.compile(r"[\[\]<>|]")


@dataclass(frozen=True)
class Documented:
    where: str  # FILE:LINE
    argv: tuple[str, ...]  # after "megatron-hsp"

    @property
    def synopsis(self) -> bool:
        return any(SYNOPSIS.search(a) for a in self.argv)


def documented_commands() -> list[Documented]:
    """Every ``megatron-hsp`` command in a fenced block: continuation lines joined, comments
    and environment assignments dropped, ``a && b`` taken as two commands."""
    found = []
    for path in DOCS:
        lines = path.read_text().splitlines()
        fenced, i = False, 0
        while i < len(lines):
            line = lines[i].strip()
            start = i + 1
            if line.startswith("```"):
                fenced = not fenced
            elif fenced:
                while line.endswith("\\") and i + 1 < len(lines):
                    i += 1
                    line = line[:-1] + " " + lines[i].strip()
                try:
                    words = shlex.split(line, comments=True)
                except ValueError:
                    words = line.split()
                where = f"{path.relative_to(ROOT)}:{start}"
                found += _commands(words, where)
            i += 1
    return found


def _commands(words: list[str], where: str) -> list[Documented]:
    out, current = [], []
    for w in [*words, "&&"]:
        if w in ("&&", "||", ";"):
            while current and re.fullmatch(r"[A-Z_]+=\S*", current[0]):
                current.pop(0)  # PYTHONPATH=... megatron-hsp ...
            if current and current[0].rsplit("/", 1)[-1] == "megatron-hsp" and len(current) > 1:
                out.append(Documented(where, tuple(current[1:])))
            elif "megatron_hsp.launch" in current:  # the launcher: its --hsp* flags
                at = current.index("megatron_hsp.launch")
                out.append(Documented(where, ("launch", *current[at + 1 :])))
            current = []
        else:
            current.append(w)
    return out


ALL = documented_commands()
COMMANDS = [c for c in ALL if c.argv[0] != "launch"]
LAUNCHES = [c for c in ALL if c.argv[0] == "launch"]


def _subparser(command: str):
    parser = cli.build_parser([command])
    return parser._subparsers._group_actions[0].choices[command]  # argparse's own table


def test_the_docs_have_commands_to_check():
    names = {c.argv[0] for c in COMMANDS}
    assert {"bench", "plan", "selftest", "demo", "profile"} <= names, names
    assert len(COMMANDS) >= 20


@pytest.mark.parametrize("doc", [c for c in COMMANDS if not c.synopsis], ids=lambda c: c.where)
def test_a_documented_command_parses(doc):
    """The command as written: argparse accepts it (an unknown or misspelled flag, a bad
    choice or a missing value fails here), and plan/bench know every Megatron flag in it."""
    argv = list(doc.argv)
    parser = cli.build_parser(argv)
    try:
        _, extras = parser.parse_known_args(argv)
    except SystemExit as stop:  # argparse's error; its message is on stderr
        pytest.fail(f"{doc.where}: megatron-hsp {' '.join(argv)} does not parse ({stop.code})")
    assert not extras, f"{doc.where}: unknown {extras}"


@pytest.mark.parametrize("doc", [c for c in COMMANDS if c.synopsis], ids=lambda c: c.where)
def test_a_usage_synopsis_names_only_flags_the_command_has(doc):
    commands = [n for n in doc.argv[0].split("|") if n in cli.COMMANDS]
    assert commands, f"{doc.where}: {doc.argv[0]} is not a megatron-hsp command"
    for command in commands:
        known = set(_subparser(command)._option_string_actions)
        for word in doc.argv[1:]:
            for flag in re.findall(r"--[a-z][a-z0-9-]*", word):
                if "*" in word:
                    continue  # --hsp-* stands for the family
                assert flag in known, f"{doc.where}: megatron-hsp {command} has no {flag}"


def test_every_command_not_run_here_says_why():
    """No documented command is left out silently: bench runs below, the rest are in NOT_RUN."""
    for doc in COMMANDS:
        for command in doc.argv[0].split("|"):
            assert command == "bench" or command in NOT_RUN, f"{doc.where}: {command}"
    assert all(len(why) > 40 for why in NOT_RUN.values())


def test_the_docs_launch_commands_are_checked():
    assert len(LAUNCHES) >= 2, LAUNCHES


@pytest.mark.parametrize("doc", LAUNCHES, ids=lambda c: c.where)
def test_a_documented_launch_names_only_hsp_flags_that_exist(doc):
    """``torchrun ... -m megatron_hsp.launch pretrain_gpt.py <megatron args> --hsp ...``: the
    Megatron flags are Megatron's to check; every ``--hsp*`` flag and its value must parse with
    the flags Megatron's parser gains (``megatron/flags.add_hsp_args``)."""
    import argparse

    from megatron_hsp.megatron.flags import add_hsp_args

    parser = add_hsp_args(argparse.ArgumentParser(allow_abbrev=False))
    words = [w for w in doc.argv[1:] if not SYNOPSIS.search(w) and w != "..."]
    hsp: list[str] = []
    for i, word in enumerate(words):
        if word.startswith("--hsp"):
            hsp.append(word)
            value = words[i + 1] if i + 1 < len(words) else None
            if value is not None and not value.startswith("--"):
                hsp.append(value)
    try:
        _, extras = parser.parse_known_args(hsp)
    except SystemExit as stop:
        pytest.fail(f"{doc.where}: {' '.join(hsp)} does not parse ({stop.code})")
    assert not extras, f"{doc.where}: unknown {extras}"


@pytest.mark.slow
@pytest.mark.spawns
def test_the_readmes_bench_runs_on_real_indexed_datasets(tmp_path, capsys):
    """The README's first command, with its two ``/data/...`` prefixes replaced by indexed
    datasets written here (megatron-core's format) and ``--steps 2`` added to keep it short:
    it plans and reports the gain, exit 0."""
    import numpy as np

    from megatron_hsp.step.corpus import write_indexed_dataset

    (doc,) = [c for c in COMMANDS if c.where.startswith("README.md") and c.argv[0] == "bench"]
    rng = np.random.default_rng(0)
    argv = []
    for word in doc.argv:
        if word.startswith("/data/"):
            prefix = tmp_path / Path(word).name
            lengths = rng.lognormal(7.0, 1.2, size=400).clip(16, 30000).astype(int)
            write_indexed_dataset(prefix, [np.ones(n, dtype=np.int32) for n in lengths])
            word = str(prefix)
        argv.append(word)
    assert cli.main([*argv, "--steps", "2"]) == 0
    assert "planned gain" in capsys.readouterr().out
