"""The exactness-coverage check itself (``megatron_hsp/testing/exactness_coverage.py``): branch
names that survive edits, new unexecuted branches and stale allowlist entries found on synthetic
reports, the config naming only what exists, and coverage measured inside spawned processes."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from megatron_hsp.testing import exactness_coverage as ec
from tests.helpers import ROOT

SOURCE = textwrap.dedent(
    """\
    def route(x, tiles):
        if x > 0:
            y = 1
        else:
            y = 2
        for t in range(tiles):
            y += t
        return y


    class Ring:
        def merge(self, a):
            if a:
                return 1
            return 0

        def never(self, b):
            if b:
                return 1
            return 2


    def outside(z):
        if z:
            return 1
        return 0
    """
)


def line(text: str) -> int:
    return next(i for i, s in enumerate(SOURCE.splitlines(), 1) if s.strip() == text)


def arcs(*pairs: tuple[str, str | None]) -> list[list[int]]:
    """Arcs between lines named by their text (None: exit the function)."""
    return [[line(a), -1 if b is None else line(b)] for a, b in pairs]


def report_of(executed, missing, executed_lines) -> dict:
    return {
        "files": {
            "pkg/mod.py": {
                "executed_branches": executed,
                "missing_branches": missing,
                "executed_lines": executed_lines,
            }
        }
    }


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "mod.py").write_text(SOURCE)
    return tmp_path


EXECUTED = arcs(("if x > 0:", "y = 1"), ("for t in range(tiles):", "y += t"), ("if a:", "return 1"))
MISSING = arcs(
    ("if x > 0:", "y = 2"),
    ("for t in range(tiles):", "return y"),
    ("if a:", "return 0"),
    ("if b:", "return 1"),
    ("if b:", "return 2"),
    ("if z:", "return 1"),
    ("if z:", "return 0"),
)
RAN = [line(s) for s in ("if x > 0:", "y = 1", "for t in range(tiles):", "y += t", "if a:")]


def names(branches) -> set[str]:
    return {str(b) for b in branches}


def test_unexecuted_branches_are_named_by_function_and_source_not_line_numbers(tree) -> None:
    config = ec.Config(checks=[], files=["pkg/mod.py"])
    result = ec.check(report_of(EXECUTED, MISSING, RAN), config, root=tree)
    assert names(result.unexplained) == {
        "pkg/mod.py::route: if x > 0: -> y = 2",
        "pkg/mod.py::route: for t in range(tiles): -> return y",
        "pkg/mod.py::Ring.merge: if a: -> return 0",
        "pkg/mod.py::Ring.never: <never called>",  # once, not its two branches
        "pkg/mod.py::outside: <never called>",
    }
    assert (result.total, result.covered) == (10, 3)
    # The same code 3 lines lower (an edit above it) gets the same names.
    shifted = SOURCE.replace("def route", "import os\n\n\ndef route")
    (tree / "pkg" / "mod.py").write_text(shifted)
    moved = report_of(
        [[a + 3, b] for a, b in EXECUTED],
        [[a + 3, b + 3 if b > 0 else b] for a, b in MISSING],
        [n + 3 for n in RAN],
    )
    assert names(ec.check(moved, config, root=tree).unexplained) == names(result.unexplained)


def test_the_scope_can_be_some_functions_of_a_file(tree) -> None:
    config = ec.Config(checks=[], files=["pkg/mod.py"], functions={"pkg/mod.py": ["Ring"]})
    result = ec.check(report_of(EXECUTED, MISSING, RAN), config, root=tree)
    assert names(result.unexplained) == {
        "pkg/mod.py::Ring.merge: if a: -> return 0",
        "pkg/mod.py::Ring.never: <never called>",
    }
    assert (result.total, result.covered) == (4, 1)


def test_a_new_unexecuted_branch_fails_and_a_stale_entry_is_flagged(tree, tmp_path) -> None:
    allowed = [
        ec.Branch("pkg/mod.py", "route", "if x > 0: -> y = 2"),
        ec.Branch("pkg/mod.py", "route", "for t in range(tiles): -> return y"),
        ec.Branch("pkg/mod.py", "Ring.never", ec.NEVER_CALLED),
        ec.Branch("pkg/mod.py", "outside", ec.NEVER_CALLED),
        ec.Branch("pkg/mod.py", "gone", "if q: -> exit"),  # code since removed
    ]
    config = ec.Config(checks=[], files=["pkg/mod.py"], allow={b: "why" for b in allowed})
    result = ec.check(report_of(EXECUTED, MISSING, RAN), config, root=tree)
    assert names(result.unexplained) == {"pkg/mod.py::Ring.merge: if a: -> return 0"}
    assert names(result.stale) == {"pkg/mod.py::gone: if q: -> exit"}
    text = ec.render(result, config)
    assert "NEW      pkg/mod.py::Ring.merge: if a: -> return 0" in text
    assert "STALE    pkg/mod.py::gone" in text
    # The stub it prints is a valid allowlist entry once a reason is written in.
    stub = ec.allowlist_stub(result.unexplained).replace('reason = ""', 'reason = "r"')
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'[checks]\ntests = []\n[scope]\nfiles = ["pkg/mod.py"]\n{stub}')
    assert list(ec.load_config(cfg).allow) == result.unexplained
    # An entry without a reason is refused.
    cfg.write_text(cfg.read_text().replace('reason = "r"', 'reason = " "'))
    with pytest.raises(ValueError, match="without a reason"):
        ec.load_config(cfg)


def test_branches_into_a_refusal_are_listed_under_one_reason(tmp_path) -> None:
    src = "def f(a):\n    if a:\n        bad = a\n        raise ValueError(bad)\n"
    src += "    if a > 1:\n        return 2\n    return 3\n"
    (tmp_path / "m.py").write_text(src)
    report = {
        "files": {
            "m.py": {
                "executed_branches": [[2, 5], [5, 7]],
                "missing_branches": [[2, 3], [5, 6]],
                "executed_lines": [2, 5, 7],
            }
        }
    }
    config = ec.Config(checks=[], files=["m.py"], refusals="a refusal")
    result = ec.check(report, config, root=tmp_path)
    assert names(result.by_rule) == {"m.py::f: if a: -> bad = a"}
    assert names(result.unexplained) == {"m.py::f: if a > 1: -> return 2"}
    assert "refusal  m.py::f: if a: -> bad = a" in ec.render(result, config)
    config.refusals = None  # without the reason, a refusal is named like any branch
    assert len(ec.check(report, config, root=tmp_path).unexplained) == 2


def test_identical_branch_lines_in_one_function_are_numbered(tmp_path) -> None:
    src = "def f(a, b):\n    if a:\n        return 1\n    if a:\n        return 2\n    return 3\n"
    (tmp_path / "m.py").write_text(src)
    fb = ec.name_branches("m.py", src, [], [[2, 3], [4, 5]], [2, 4, 6])
    assert [b.branch for b in fb.missing] == ["if a: -> return 1", "if a: -> return 2"]
    fb = ec.name_branches("m.py", src.replace("return 2", "return 1"), [], [[2, 3], [4, 5]], [2])
    assert [b.branch for b in fb.missing] == ["if a: -> return 1", "if a: -> return 1 #2"]


def test_checks_are_matched_by_file_or_test_with_any_parameters() -> None:
    checks = ["tests/a.py", "tests/b.py::test_x"]
    assert ec.is_exactness_check("tests/a.py::test_y[1-2]", checks)
    assert ec.is_exactness_check("tests/b.py::test_x[fp32]", checks)
    assert not ec.is_exactness_check("tests/b.py::test_xy", checks)
    assert not ec.is_exactness_check("tests/ab.py::test_x", checks)


def _functions(path: Path) -> set[str]:
    return {name for _, _, name, _ in ec.function_spans(path.read_text())} | {
        n.name for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.ClassDef)
    }


def test_the_config_names_only_tests_code_and_functions_that_exist() -> None:
    config = ec.load_config(ROOT / ec.CONFIG)
    wrong = []
    for check in config.checks:
        path, _, test = check.partition("::")
        if not (ROOT / path).is_file() or (test and test not in _functions(ROOT / path)):
            wrong.append(check)
    for file in config.files:
        if not (ROOT / file).is_file():
            wrong.append(file)
    for file, functions in config.functions.items():
        assert file in config.files
        wrong += [f"{file}::{f}" for f in functions if f not in _functions(ROOT / file)]
    for b in config.allow:
        assert b.file in config.files, b
    assert wrong == []


class _Item:
    def __init__(self, nodeid: str) -> None:
        self.nodeid, self.marks = nodeid, set()

    def get_closest_marker(self, name: str) -> object:
        return name if name in self.marks else None

    def add_marker(self, name: str) -> None:
        self.marks.add(name)


def test_the_exactness_marker_is_given_by_the_config() -> None:
    """What ``-m exactness`` selects is what the config names (tests/conftest.py's hook)."""
    from tests import conftest

    items = [
        _Item("tests/runtime/test_ring_tiles.py::test_planted_tile_bug_is_caught[tiled-x]"),
        _Item("tests/runtime/test_loss_normalisation.py::test_per_group_mean_would_be_wrong"),
        _Item(
            "tests/runtime/test_loss_normalisation.py::test_microbatch_loss_is_megatrons_per_token_contract"
        ),
    ]
    conftest.pytest_collection_modifyitems(items)  # type: ignore[arg-type]
    assert [ec.MARKER in i.marks for i in items] == [True, False, True]


CHILD = textwrap.dedent(
    """\
    import multiprocessing as mp
    import sys
    sys.path.insert(0, sys.argv[1])
    import measured

    if __name__ == "__main__":
        ctx = mp.get_context("spawn")  # torch.multiprocessing.spawn's start method
        p = ctx.Process(target=measured.in_worker, args=(3,))
        p.start()
        p.join()
        assert p.exitcode == 0
    """
)
MEASURED = "def in_worker(n):\n    if n > 2:\n        return 'big'\n    return 'small'\n"


@pytest.mark.spawns
def test_coverage_is_measured_inside_spawned_processes(tmp_path) -> None:
    """The run's mechanism: a subprocess (``patch = subprocess``) starting a spawn-method worker
    (a fresh interpreter, COVERAGE_PROCESS_START inherited) records the worker's branches."""
    pytest.importorskip("coverage")
    (tmp_path / "measured.py").write_text(MEASURED)
    (tmp_path / "child.py").write_text(CHILD)
    data = tmp_path / "data"
    data.mkdir()
    config = ec.Config(checks=[], files=[str(tmp_path / "measured.py")])
    rc = tmp_path / "rc"
    rc.write_text(ec.coveragerc(config, data))
    script = (
        "import subprocess, sys\n"
        f"subprocess.run([sys.executable, {str(tmp_path / 'child.py')!r}, {str(tmp_path)!r}],"
        " check=True)\n"
    )
    env = {**os.environ, "COVERAGE_PROCESS_START": str(rc)}
    subprocess.run([sys.executable, "-c", script], env=env, check=True, cwd=tmp_path)
    out = tmp_path / "report.json"
    subprocess.run(
        [sys.executable, "-c", ec._JSON_REPORT, str(rc), str(out), str(tmp_path / "measured.py")],
        check=True,
        cwd=tmp_path,
    )
    report = json.loads(out.read_text())
    (entry,) = report["files"].values()
    assert entry["executed_branches"] == [[2, 3]]
    assert entry["missing_branches"] == [[2, 4]]
