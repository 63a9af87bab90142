"""``megatron-hsp`` entry point: dispatches to ``megatron_hsp.commands.<name>``."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from megatron_hsp import __version__
from megatron_hsp.planner.errors import HSPError

# name -> one-line help. Each module defines add_arguments(parser) and run(args) -> int.
COMMANDS: dict[str, str] = {
    "plan": "plan one global batch and print the Plan (table or --json)",
    "bench": "compare hsp with static/adaptive/megatron baselines over many batches",
    "selftest": "check distributed loss and gradients against one process (gloo, CPU)",
    "demo": "train a small GPT on CPU ranks with adaptive groups (the main job)",
    "profile": "measure this machine and fit a cost model YAML for plan/bench/demo",
    "compare": "measured vs predicted speedup of two training runs' plan logs (same batches)",
}


# Commands that run torch (the others, plan and bench, must not import it).
NEEDS_TORCH = ("selftest", "demo", "profile")


def missing_torch(command: str, warn: bool = True) -> str | None:
    """The one-line error when torch does not import, else None (and, with ``warn``, the
    untested-version warning printed, once per command)."""
    try:
        import torch  # noqa: F401
    except ImportError as exc:
        return (
            f"megatron-hsp {command}: error: torch does not import here ({exc}); install "
            "megatron-hsp[runtime] or run in the environment that has torch and megatron-core "
            "(README, 'In an existing Megatron container')"
        )
    if not warn:
        return None
    from megatron_hsp.runtime.compat import untested_versions

    line = untested_versions()
    if line:
        print(line, file=sys.stderr)
    return None


def _module(name: str):
    return importlib.import_module(f"megatron_hsp.commands.{name.replace('-', '_')}")


def build_parser(argv: Sequence[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="megatron-hsp",
        description="Heterogeneity-adaptive sequence parallelism for Megatron-LM.",
    )
    parser.add_argument("--version", action="version", version=f"megatron-hsp {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    # Only the chosen subcommand's module is imported (torch stays out of plan/bench).
    chosen = next((a for a in argv if a in COMMANDS), None)
    for name, help_text in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == chosen:
            _module(name).add_arguments(p)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(argv)
    args, extras = parser.parse_known_args(argv)
    if extras:
        message = getattr(_module(args.command), "unknown_arguments", None)
        if message is None:
            parser.error(f"unrecognized arguments: {' '.join(extras)}")
        print(message(extras), file=sys.stderr)
        return 2
    if args.command in NEEDS_TORCH:
        error = missing_torch(args.command)
        if error:
            print(error, file=sys.stderr)
            return 2
    try:
        return int(_module(args.command).run(args) or 0)
    except HSPError as exc:
        print(f"megatron-hsp {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
