"""Output paths: checked before the work that fills them, and written atomically.

``plan``/``bench``/``demo``/``profile`` (``--json``, ``--out``, ``--refit-out``) and Megatron's
``--hsp-refit-out`` check their paths with the same rule and the same messages. Every file the
project writes (refit models, ``--json``, ``--plot``, ``profile --out``, corpus and cache files,
``hsp_data.json`` beside a checkpoint) goes through :func:`atomic_write` / :func:`atomic_open`:
a temporary file in the target's folder, flushed and fsynced, then renamed over the target.

Why: a write that fails part-way (a full disk, a file-size limit) must leave the previous file
byte-identical, and a link planted at the target (a shared cache folder) must not choose what
the user's process overwrites. A symbolic link at the target is refused in one line (never
followed, never replaced): the user learns of it rather than losing either file. It sits on the
planner's ground floor (no torch), below the commands and the Megatron integration that use it.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO

from megatron_hsp.planner.errors import HSPError, InputError

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
    refuse_link(out, flag)
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


class WriteError(HSPError):
    """An output file that could not be written; the previous file (if any) is unchanged."""


def refuse_link(path: str | Path, flag: str | None = None) -> None:
    """A symbolic link at an output path is refused, naming it: written through, it would
    overwrite whatever file its maker chose (docs/reliability.md)."""
    p = Path(path)
    if p.is_symlink():
        what = f"{flag} {p}" if flag else str(p)
        raise InputError(
            f"{what}: is a symbolic link (to {os.readlink(p)}); output files are never written "
            "through links: remove it or give another path"
        )


def check_folder(path: str | Path, flag: str) -> Path:
    """A folder flag (``--cache-dir``): created if missing; refused when a file (or a link to
    one) is in the way or it cannot be created, naming the flag."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise InputError(f"{flag} {p}: is a file, not a folder; give a folder (created if missing)")
    try:
        p.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise InputError(f"{flag} {p}: cannot create the folder ({exc.strerror or exc})") from None
    return p


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


@contextlib.contextmanager
def atomic_open(
    path: str | Path, mode: str = "w", *, flag: str | None = None, encoding: str = "utf-8"
) -> Iterator[IO]:
    """Open a temporary file beside ``path`` for writing; on a clean exit it is flushed,
    fsynced and renamed over ``path``; on any error it is removed and ``path`` is left as it was.

    ``mode`` is ``"w"`` or ``"wb"``. A symbolic link at ``path`` is refused (``refuse_link``).
    An ``OSError`` (ENOSPC, EFBIG, EACCES, ...) becomes :class:`WriteError`: one line naming the
    path (and ``flag``) and the cause, which the commands print with exit 2.
    """
    if mode not in ("w", "wb"):
        raise ValueError(f"atomic_open: mode {mode!r}; use 'w' or 'wb'")
    target = Path(path)
    refuse_link(target, flag)
    folder = target.parent if str(target.parent) else Path(".")
    what = f"{flag} {target}" if flag else str(target)
    tmp = None
    try:
        # mkstemp: O_CREAT | O_EXCL, a fresh name in the target's folder (same file system, so
        # the rename is atomic); it never follows a link.
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=folder)
        mode_bits = (target.stat().st_mode & 0o7777) if target.is_file() else 0o666 & ~_umask()
        os.fchmod(fd, mode_bits)
        kwargs = {} if "b" in mode else {"encoding": encoding}
        with os.fdopen(fd, mode, **kwargs) as fh:
            yield fh
            fh.flush()
            os.fsync(fh.fileno())
        refuse_link(target, flag)  # planted while the content was written
        os.replace(tmp, target)
        tmp = None
    except OSError as exc:
        cause = exc.strerror or type(exc).__name__
        raise WriteError(
            f"{what}: could not be written ({cause}); the previous file, if any, is unchanged"
        ) from None
    finally:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)


def atomic_write(
    path: str | Path, data: str | bytes, *, flag: str | None = None, encoding: str = "utf-8"
) -> None:
    """Write ``data`` to ``path`` atomically (:func:`atomic_open`)."""
    with atomic_open(
        path, "wb" if isinstance(data, bytes) else "w", flag=flag, encoding=encoding
    ) as fh:
        fh.write(data)


class AppendLog:
    """An append-only log (``--hsp-plan-log``): one ``os.write`` per row on a descriptor opened
    with ``O_APPEND | O_NOFOLLOW``, so rows from one process never interleave and a link at the
    path is refused at open. Why not ``atomic_write``: the log grows during training and earlier
    rows must stay. A failed write (a full disk) prints one line naming the path and the cause,
    and the log stops there; the training it records goes on (rows written so far are whole
    lines, the last row is at most cut short by the failing write).
    """

    def __init__(self, path: str | Path, flag: str = "--hsp-plan-log") -> None:
        self.path, self.flag = str(path), flag
        refuse_link(path, flag)
        try:
            self.fd: int | None = os.open(
                self.path,
                os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
                0o666,
            )
        except OSError as exc:
            raise InputError(f"{flag} {path}: cannot open for appending ({exc.strerror})") from None

    def write(self, line: str) -> None:
        if self.fd is None:
            return
        data = line.encode()
        try:
            while data:
                data = data[os.write(self.fd, data) :]
        except OSError as exc:
            import sys

            print(
                f"megatron-hsp: {self.flag} {self.path}: write failed ({exc.strerror}); the plan "
                "log stops here, training goes on",
                file=sys.stderr,
            )
            self.close()

    def flush(self) -> None:
        """Rows go straight to the descriptor: nothing is buffered."""

    def close(self) -> None:
        if self.fd is not None:
            with contextlib.suppress(OSError):
                os.close(self.fd)
            self.fd = None
