"""The README leads with what a user needs (issue 42): what it does, the two commands, how to
switch it on in a Megatron run (the checklist as a list), how to ask whether a job gains, how to
measure it, then one short table of results; the detail comes after."""

from __future__ import annotations

import re

from tests.helpers import ROOT

FIRST = [
    "## Switch it on in your Megatron run",
    "## Ask whether your job gains",
    "## Measure it on your cluster",
    "## Results",
]


def _sections() -> list[str]:
    text = (ROOT / "README.md").read_text()
    return [line for line in text.splitlines() if line.startswith("## ")]


def test_the_user_sections_come_first_in_order() -> None:
    heads = _sections()
    found = [next(h for h in heads if h.startswith(f)) for f in FIRST]
    assert heads[: len(FIRST)] == found, heads


def test_the_two_commands_come_before_any_section() -> None:
    text = (ROOT / "README.md").read_text()
    top = text.split("\n## ", 1)[0]
    assert "make demo" in top and "make test" in top
    assert len(top.splitlines()) <= 30, "the first screen is what it does and the two commands"


def test_the_switch_on_checklist_is_a_list_naming_each_setting() -> None:
    text = (ROOT / "README.md").read_text()
    section = text.split(FIRST[0], 1)[1].split("\n## ", 1)[0]
    items = ["- " + item for item in section.split("\n- ")[1:]]  # continuation lines joined
    for flag in (
        "--context-parallel-size",
        "--micro-batch-size",
        "--attention-dropout",
        "--eod-mask-loss",
        "--hsp-overlong",
        "--seq-length",
    ):
        assert any(flag in item for item in items), flag


def test_the_results_are_one_short_table_with_links() -> None:
    text = (ROOT / "README.md").read_text()
    section = text.split("## Results", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("|")]
    assert 4 <= len(rows) <= 14
    assert all(
        re.search(r"\]\(docs/results/", r)
        or r.startswith("|---")
        or "source" in r
        or r.rstrip().endswith("same |")
        for r in rows
    )
