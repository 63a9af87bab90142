"""Branch coverage of the numerics by the exactness checks alone (issue 44, item 2).

One file says everything: ``tests/exactness/coverage.toml`` names

- ``[checks] tests``: the exactness checks (a test file, or ``file::function`` for some of its
  tests); ``tests/conftest.py`` gives each the ``exactness`` marker, so ``-m exactness`` runs
  them and ``-m "not exactness"`` the rest;
- ``[scope] files``: the code that computes what is trained, and ``[scope.functions]``: where only
  some functions of a file are numerics (the qualified name, nested functions included);
- ``[[allow]]``: every branch of the scope the checks do not execute, named by file, function and
  ``"<source of the branch line> -> <source of its destination, or exit>"`` (no line numbers: the
  names survive edits above them), each with its reason.

``python -m megatron_hsp.testing.exactness_coverage run [-- pytest args]`` runs the exactness
checks under coverage.py (every process: the pytest process, xdist workers, spawned gloo ranks
and subprocesses, through coverage's start-up hook and ``COVERAGE_PROCESS_START``), combines the
data, and fails (exit 1) when a check fails, when an unexecuted branch (or a function never
called) of the scope is not in the allowlist, or when an allowlist entry no longer names one.
``report REPORT.json`` runs only the check on a ``coverage json`` report. docs/exactness.md,
"Branch coverage of the numerics", describes the figures.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import tomllib
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from megatron_hsp.planner.paths import atomic_write
from megatron_hsp.runtime.lifetime import stop_tree

CONFIG = Path("tests/exactness/coverage.toml")
DATA_DIR = Path(".exactness-coverage")
MARKER = "exactness"
NEVER_CALLED = "<never called>"


@dataclass(frozen=True)
class Branch:
    """One unexecuted branch (or a function never called), named without line numbers."""

    file: str
    function: str
    branch: str

    def __str__(self) -> str:
        return f"{self.file}::{self.function}: {self.branch}"


@dataclass
class Config:
    checks: list[str]
    files: list[str]
    functions: dict[str, list[str]] = field(default_factory=dict)
    allow: dict[Branch, str] = field(default_factory=dict)
    # The reason for branches into a refusal (a block that ends by raising): listed in the report
    # under it, not one by one. None: they are named like any other branch.
    refusals: str | None = None


def load_config(path: Path = CONFIG) -> Config:
    raw = tomllib.loads(Path(path).read_text())
    allow: dict[Branch, str] = {}
    for entry in raw.get("allow", []):
        key = Branch(entry["file"], entry["function"], entry["branch"])
        if key in allow:
            raise ValueError(f"{path}: allowlist entry twice: {key}")
        if not str(entry.get("reason", "")).strip():
            raise ValueError(f"{path}: allowlist entry without a reason: {key}")
        allow[key] = entry["reason"]
    scope = raw["scope"]
    return Config(
        checks=list(raw["checks"]["tests"]),
        files=list(scope["files"]),
        functions={k: list(v) for k, v in scope.get("functions", {}).items()},
        allow=allow,
        refusals=raw.get("refusals", {}).get("reason"),
    )


def is_exactness_check(nodeid: str, checks: Iterable[str]) -> bool:
    """``nodeid`` (``path::name[params]``) is one of ``checks`` (``path`` or ``path::name``)."""
    base = nodeid.split("[", 1)[0]
    return any(base == check or base.startswith(check + "::") for check in checks)


# -- naming branches ------------------------------------------------------------------------------


class _Functions(ast.NodeVisitor):
    """Each function's qualified name and line span, innermost last."""

    def __init__(self) -> None:
        self.spans: list[tuple[int, int, str, int]] = []  # (first, last, qualname, body start)
        self._stack: list[str] = []

    def _visit_scope(self, node: ast.AST, is_function: bool) -> None:
        self._stack.append(node.name)  # type: ignore[attr-defined]
        if is_function:
            first = min([node.lineno] + [d.lineno for d in node.decorator_list])  # type: ignore[attr-defined]
            self.spans.append(
                (first, node.end_lineno, ".".join(self._stack), node.body[0].lineno)  # type: ignore[attr-defined]
            )
        self.generic_visit(node)
        self._stack.pop()

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        self._visit_scope(node, True)

    def visit_AsyncFunctionDef(self, node: ast.AsyncFunctionDef) -> None:
        self._visit_scope(node, True)

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self._visit_scope(node, False)


def function_spans(source: str) -> list[tuple[int, int, str, int]]:
    visitor = _Functions()
    visitor.visit(ast.parse(source))
    return visitor.spans


def refusal_lines(source: str) -> set[int]:
    """First lines of the statements of every block that ends by raising (``if bad: x = ...;
    raise ...``): a branch into one is a refusal."""
    out: set[int] = set()
    for node in ast.walk(ast.parse(source)):
        for name in ("body", "orelse", "finalbody"):
            block = getattr(node, name, None)
            if isinstance(block, list) and block and isinstance(block[-1], ast.Raise):
                out.update(stmt.lineno for stmt in block)
    return out


def function_at(spans: list[tuple[int, int, str, int]], line: int) -> str:
    best = "<module>"
    width = None
    for first, last, name, _ in spans:
        if first <= line <= last and (width is None or last - first < width):
            best, width = name, last - first
    return best


def in_scope(function: str, wanted: list[str] | None) -> bool:
    if wanted is None:
        return True
    return any(function == w or function.startswith(w + ".") for w in wanted)


@dataclass
class FileBranches:
    """One file's in-scope branches: totals and the unexecuted ones, named."""

    total: int = 0
    covered: int = 0
    missing: list[Branch] = field(default_factory=list)
    refusals: list[Branch] = field(default_factory=list)  # unexecuted branches into a refusal


def name_branches(
    file: str,
    source: str,
    executed_branches: list[list[int]],
    missing_branches: list[list[int]],
    executed_lines: list[int],
    wanted: list[str] | None = None,
) -> FileBranches:
    """Name ``file``'s unexecuted branches (coverage's ``[from, to]`` line arcs; ``to`` < 0 leaves
    the function): ``"<from line's source> -> <to line's source or exit>"`` in the innermost
    function holding the from-line; identical names in one function get ``#2``, ``#3``. A
    function none of whose body lines ran is one entry, ``<never called>``, for all of its
    branches (and those of the functions nested in it). Branches into a block that ends by
    raising go to ``refusals``."""
    lines = source.splitlines()
    spans = function_spans(source)
    ran = set(executed_lines)
    raising = refusal_lines(source)

    def text(line: int) -> str:
        return lines[line - 1].strip() if 0 < line <= len(lines) else "?"

    never = {
        name
        for first, last, name, body in spans
        if in_scope(name, wanted) and not any(body <= n <= last for n in ran)
    }

    def under_never(function: str) -> str | None:
        hits = [n for n in never if function == n or function.startswith(n + ".")]
        return min(hits, key=len) if hits else None

    out = FileBranches()
    seen: dict[tuple[str, str], int] = {}
    for arc, is_missing in sorted(
        [(tuple(a), False) for a in executed_branches]
        + [(tuple(a), True) for a in missing_branches]
    ):
        src, dst = arc
        function = function_at(spans, src)
        if not in_scope(function, wanted):
            continue
        out.total += 1
        if not is_missing:
            out.covered += 1
            continue
        if under_never(function) is not None:
            continue
        name = f"{text(src)} -> {'exit' if dst < 0 else text(dst)}"
        count = seen.get((function, name), 0) + 1
        seen[(function, name)] = count
        branch = Branch(file, function, name if count == 1 else f"{name} #{count}")
        (out.refusals if dst in raising else out.missing).append(branch)
    for function in sorted(never):
        if under_never(function) == function:
            out.missing.append(Branch(file, function, NEVER_CALLED))
    return out


@dataclass
class Result:
    total: int
    covered: int
    unexplained: list[Branch]
    stale: list[Branch]
    allowed: list[Branch]
    per_file: dict[str, FileBranches]
    by_rule: list[Branch] = field(default_factory=list)


def check(report: dict, config: Config, root: Path = Path()) -> Result:
    """``report``: coverage.py's JSON report. Every file of the scope must be in it."""
    files = report.get("files", {})
    per_file: dict[str, FileBranches] = {}
    for file in config.files:
        data = files.get(file)
        source = (root / file).read_text()
        if data is None:  # never imported by any check: every function is never called
            data = {"executed_branches": [], "missing_branches": [], "executed_lines": []}
        per_file[file] = name_branches(
            file,
            source,
            data.get("executed_branches", []),
            data.get("missing_branches", []),
            data.get("executed_lines", []),
            config.functions.get(file),
        )
    missing = [b for fb in per_file.values() for b in fb.missing]
    refusals = [b for fb in per_file.values() for b in fb.refusals]
    by_rule = [b for b in refusals if b not in config.allow] if config.refusals else []
    if not config.refusals:
        missing += refusals
    found = set(missing) | set(refusals)
    return Result(
        total=sum(fb.total for fb in per_file.values()),
        covered=sum(fb.covered for fb in per_file.values()),
        unexplained=[b for b in missing if b not in config.allow],
        stale=[b for b in config.allow if b not in found],
        allowed=[b for b in missing + refusals if b in config.allow],
        per_file=per_file,
        by_rule=by_rule,
    )


def _toml_string(s: str) -> str:
    return json.dumps(s, ensure_ascii=False)


def allowlist_stub(branches: Iterable[Branch]) -> str:
    """TOML ``[[allow]]`` entries for ``branches``, each with an empty reason to fill in."""
    out = []
    for b in branches:
        out.append(
            f"[[allow]]\nfile = {_toml_string(b.file)}\nfunction = {_toml_string(b.function)}\n"
            f'branch = {_toml_string(b.branch)}\nreason = ""\n'
        )
    return "\n".join(out)


def render(result: Result, config: Config) -> str:
    pct = 100.0 * result.covered / result.total if result.total else 100.0
    lines = [
        f"exactness coverage of the numerics: {result.covered}/{result.total} branches "
        f"({pct:.1f}%) in {len(config.files)} files; unexecuted and explained in {CONFIG}: "
        f"{len(result.allowed)} by name (a function never called counts once), "
        f"{len(result.by_rule)} refusals ({config.refusals})",
    ]
    for file, fb in result.per_file.items():
        fpct = 100.0 * fb.covered / fb.total if fb.total else 100.0
        lines.append(
            f"  {file}: {fb.covered}/{fb.total} ({fpct:.0f}%), {len(fb.missing)} unexecuted, "
            f"{len(fb.refusals)} refusals"
        )
    for b in result.allowed:
        lines.append(f"  allowed  {b}\n           reason: {config.allow[b]}")
    for b in result.by_rule:
        lines.append(f"  refusal  {b}")
    if result.unexplained:
        lines.append(f"{len(result.unexplained)} unexecuted branch(es) not in the allowlist:")
        lines += [f"  NEW      {b}" for b in result.unexplained]
        lines.append(
            "make a check execute them (preferred), or add to the allowlist, with a reason:"
        )
        lines.append(allowlist_stub(result.unexplained))
    if result.stale:
        lines.append(
            f"{len(result.stale)} allowlist entr(y/ies) no longer name an unexecuted branch "
            "(executed now, or the code changed): remove or rename them:"
        )
        lines += [f"  STALE    {b}" for b in result.stale]
    return "\n".join(lines)


# -- running --------------------------------------------------------------------------------------


def coveragerc(config: Config, data_dir: Path) -> str:
    """coverage.py's settings for every process of the run (COVERAGE_PROCESS_START reads it)."""
    include = "\n".join(f"    {Path(f).resolve()}" for f in config.files)
    return (
        "[run]\n"
        "branch = True\n"
        "parallel = True\n"
        f"data_file = {(data_dir / '.coverage').resolve()}\n"
        f"include =\n{include}\n"
        # os._exit (xdist's and multiprocessing's fork workers) would skip the data's save
        "patch =\n    _exit\n    subprocess\n"
        "disable_warnings =\n    no-data-collected\n    module-not-imported\n"
    )


# Combine every process's data, add the scope's files no check imported (all unexecuted), write
# the JSON report: argv = rc file, report path, scope files.
_JSON_REPORT = """
import sys
from pathlib import Path
import coverage
rc, out, files = sys.argv[1], sys.argv[2], sys.argv[3:]
cov = coverage.Coverage(config_file=rc)
cov.combine(keep=False)
cov.get_data().touch_files([str(Path(f).resolve()) for f in files])
cov.save()
cov.json_report(outfile=out)
"""


def _children_cpu() -> float:
    """User + system CPU seconds of the waited-for descendants so far (spawned ranks included)."""
    import resource

    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _run_owned(argv: list[str], env: dict[str, str]) -> int:
    """``argv``'s exit code; the pytest run and every process below it (spawned ranks, their
    planners) end with this command, also when it is stopped (SIGTERM, Ctrl-C)."""
    proc = subprocess.Popen(argv, env=env)
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        return proc.wait()
    finally:
        signal.signal(signal.SIGTERM, previous)
        if proc.poll() is None:
            stop_tree([proc.pid])


def run(pytest_args: list[str], config_path: Path = CONFIG, data_dir: Path = DATA_DIR) -> int:
    config = load_config(config_path)
    shutil.rmtree(data_dir, ignore_errors=True)
    data_dir.mkdir(parents=True)
    rc_file = (data_dir / "coveragerc").resolve()
    atomic_write(rc_file, coveragerc(config, data_dir))
    env = dict(os.environ, COVERAGE_PROCESS_START=str(rc_file))
    start, before = time.monotonic(), _children_cpu()
    tests = _run_owned([sys.executable, "-m", "pytest", "-m", MARKER, *pytest_args], env)
    elapsed, cpu = time.monotonic() - start, _children_cpu() - before
    report_path = data_dir / "coverage.json"
    made = subprocess.run(
        [sys.executable, "-c", _JSON_REPORT, str(rc_file), str(report_path), *config.files],
        check=False,
    ).returncode
    if made != 0:  # coverage's own message is printed above it
        print(
            f"exactness coverage: no report (coverage exit code {made}): the tests run (pytest "
            f"exit code {tests}) recorded no data of the numerics' scope; run every check "
            "(`make exactness-coverage`)",
            file=sys.stderr,
        )
        return 1
    code = report(report_path, config)
    print(
        f"exactness checks under coverage: {elapsed:.0f} s wall, {cpu:.0f} s CPU (every process "
        f"of the run; pytest exit code {tests})"
    )
    return tests or code


def relative_report(report: dict, root: Path) -> dict:
    """The report's file names relative to ``root`` (the rc file names absolute paths)."""
    files = {}
    for name, data in report.get("files", {}).items():
        p = Path(name)
        files[str(p.resolve().relative_to(root.resolve())) if p.is_absolute() else name] = data
    return dict(report, files=files)


def report(report_path: Path, config: Config | None = None) -> int:
    config = config or load_config()
    data = relative_report(json.loads(Path(report_path).read_text()), Path.cwd())
    result = check(data, config)
    text = render(result, config)
    print(text)
    atomic_write(Path(report_path).with_suffix(".txt"), text + "\n")
    return 1 if result.unexplained or result.stale else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megatron_hsp.testing.exactness_coverage")
    sub = parser.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="run the exactness checks under coverage, then check")
    r.add_argument("pytest_args", nargs=argparse.REMAINDER)
    p = sub.add_parser("report", help="check a `coverage json` report against the allowlist")
    p.add_argument("report")
    args = parser.parse_args(argv)
    if args.command == "run":
        extra = args.pytest_args[1:] if args.pytest_args[:1] == ["--"] else args.pytest_args
        return run(extra)
    return report(Path(args.report))


if __name__ == "__main__":
    sys.exit(main())
