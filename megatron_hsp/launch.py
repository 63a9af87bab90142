"""``python -m megatron_hsp.launch PATH/TO/pretrain_gpt.py <megatron args> --hsp ...``

Runs the user's unchanged Megatron-LM script as ``__main__`` after installing the HSP entry
points (``megatron_hsp.megatron.installer.install_entry_points``). Use it under torchrun exactly
like the script itself: ``torchrun --nproc-per-node 8 -m megatron_hsp.launch pretrain_gpt.py ...``.

SIGINT/SIGTERM stop the rank within seconds (docs/reliability.md): the background planner is
terminated at once, the signal becomes ``SystemExit(128 + signal)`` so ``finally`` blocks and
``atexit`` run (temporary files and directories of ``tempfile`` contexts are removed), and if
unwinding is stuck (a collective waiting on a peer) the process exits hard after
``SIGNAL_GRACE_S``. torchrun forwards the signal it receives to every rank process.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import runpy
import signal
import sys
import threading
from pathlib import Path
from types import FrameType

# Seconds a signalled rank may spend unwinding (closing the planner, finally blocks) before it
# exits hard; well under torchrun's own 30 s between forwarding the signal and SIGKILL.
SIGNAL_GRACE_S = 10.0
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def _stop_children() -> None:
    """Terminate this process's multiprocessing children (the background planner)."""
    for child in multiprocessing.active_children():
        child.terminate()


def _on_signal(signum: int, frame: FrameType | None) -> None:
    """Why not the default action: SIGTERM's default kills Python without ``atexit`` or
    ``finally``, which left the planner running until its parent watchdog noticed and temporary
    files behind. A second signal exits at once."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_DFL)
    name = signal.Signals(signum).name
    print(f"megatron_hsp.launch: {name}; stopping this rank and its planner", file=sys.stderr)
    _stop_children()
    timer = threading.Timer(SIGNAL_GRACE_S, os._exit, (128 + signum,))
    timer.daemon = True
    timer.start()
    raise SystemExit(128 + signum)


def install_signal_handlers() -> None:
    for sig in STOP_SIGNALS:
        signal.signal(sig, _on_signal)


class _DefaultsFormatter(argparse.HelpFormatter):
    """Appends ``(default: X)`` to flags whose help does not already say its default."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text.lower() or action.default is argparse.SUPPRESS:
            return text
        return f"{text} (default: {'none' if action.default is None else action.default})"


def hsp_flags_help() -> str:
    """The ``--hsp*`` flags with their defaults, from the one parser that defines them
    (``megatron.flags.add_hsp_args``), so this list cannot drift from what Megatron parses."""
    from megatron_hsp.megatron.flags import add_hsp_args

    parser = argparse.ArgumentParser(
        prog="... pretrain_gpt.py <megatron args>",
        add_help=False,
        usage=argparse.SUPPRESS,
        formatter_class=_DefaultsFormatter,
    )
    return add_hsp_args(parser).format_help().strip()


def usage() -> str:
    """``--help``: how to launch, then the HSP flags Megatron's parser gains."""
    return f"{__doc__.strip()}\n\n{hsp_flags_help()}"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0 if argv else 2
    script = Path(argv[0])
    if not script.is_file():
        print(f"megatron_hsp.launch: error: script {script} not found", file=sys.stderr)
        return 2
    from megatron_hsp.cli import missing_torch

    # Before Megatron's imports blame the checkout; versions are said by install(), on rank 0.
    error = missing_torch("launch", warn=False)
    if error:
        print(error, file=sys.stderr)
        return 2
    # The script sees its own path and flags, and imports its siblings (gpt_builders, ...) and
    # the checkout's megatron/ package, exactly as `python pretrain_gpt.py ...` would.
    sys.argv = [str(script), *argv[1:]]
    sys.path.insert(0, str(script.resolve().parent))
    from megatron_hsp.megatron.installer import install_entry_points
    from megatron_hsp.planner.errors import HSPError

    try:
        install_entry_points()
    except HSPError as exc:  # a Megatron-LM this launcher cannot patch: one line, exit 2
        print(f"megatron_hsp.launch: error: {exc}", file=sys.stderr)
        return 2
    install_signal_handlers()
    runpy.run_path(str(script), run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())
