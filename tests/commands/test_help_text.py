"""``plan``/``bench --help`` grouped as the flags are used (issue 42): ``--lengths`` works with
and without ``--flexsp-harness`` and is not filed under the harness; a Megatron ``--no-*`` flag
does not read as on by default."""

from __future__ import annotations

import pytest

from megatron_hsp import cli


def _help(command: str, capsys) -> str:
    with pytest.raises(SystemExit):
        cli.main([command, "--help"])
    return capsys.readouterr().out


def _section(text: str, title_start: str) -> str:
    """The lines of the --help section whose title starts with ``title_start``."""
    lines = text.splitlines()
    (at,) = [i for i, line in enumerate(lines) if line.startswith(title_start)]
    end = next((i for i in range(at + 1, len(lines)) if lines[i] and lines[i][0] != " "), None)
    return "\n".join(lines[at:end])


@pytest.mark.parametrize("command", ["bench", "plan"])
def test_lengths_is_not_filed_under_the_flexsp_harness(command, capsys):
    text = _help(command, capsys)
    assert "--lengths" not in _section(text, "FlexSP harness")
    assert "--lengths LENGTHS" in _section(text, "options:")
    assert "--gpus GPUS" in _section(text, "FlexSP harness")  # the harness's own flags stay


@pytest.mark.parametrize("command", ["bench", "plan"])
def test_a_no_flag_does_not_read_as_on_by_default(command, capsys):
    """``--no-mmap-bin-files ... (default: True)`` read as if the flag were given by default."""
    text = " ".join(_help(command, capsys).split())
    assert "--no-mmap-bin-files read the datasets' .bin files with file reads" in text
    assert "(default: not given)" in text
    at = text.index("--no-mmap-bin-files read")
    assert "(default: True)" not in text[at : at + 200]
