"""Output paths checked before the work that fills them, for every entry point's output flags.

``plan``/``bench``/``demo``/``profile`` (``--json``, ``--out``, ``--refit-out``) and Megatron's
``--hsp-refit-out`` check their paths with the same rule and the same messages. It sits on the
planner's ground floor, below both the commands and the Megatron integration that use it.
"""

from __future__ import annotations

import os
from pathlib import Path

from megatron_hsp.planner.errors import InputError

STDOUT = "-"  # the path that means standard output, where a flag allows it


def check_output_path(
    flag: str, path: str, *, allow_stdout: bool = False, overwrite: bool = True
) -> str:
    """An output path checked BEFORE the work that fills it (a bad path found after the work
    loses the work). ``-`` is standard output where the command allows it; otherwise the folder
    must exist and be writable, the path must not be a folder, and an existing file is refused
    when ``overwrite`` is False. Returns the path; raises ``InputError`` naming the flag."""
    if path == STDOUT:
        if allow_stdout:
            return path
        raise InputError(f"{flag} -: this output cannot go to standard output; give a file name")
    out = Path(path)
    if out.is_dir():
        raise InputError(f"{flag} {path}: is a directory; give a file name")
    parent = out.parent if str(out.parent) else Path(".")
    if not parent.is_dir():
        raise InputError(f"{flag} {path}: directory {parent} does not exist")
    if not os.access(parent, os.W_OK):
        raise InputError(f"{flag} {path}: directory {parent} is not writable")
    if out.exists() and not overwrite:
        raise InputError(f"{flag} {path}: the file exists; remove it, pick another name or --force")
    return path
