"""Size limits a newcomer can read the package by: no module of ``megatron_hsp`` over
``MAX_MODULE_LINES`` lines and no function (or method) over ``MAX_FUNCTION_LINES`` lines,
measured by parsing the sources (a function's lines run from its ``def`` or first decorator to
its last statement, docstring included)."""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "megatron_hsp"

MAX_MODULE_LINES = 800
MAX_FUNCTION_LINES = 150

# Functions still over the limit, each owned by work in progress elsewhere (split them, then
# drop them from here; an entry that no longer exceeds the limit fails the test):
ALLOWED_LONG_FUNCTIONS = {}


def _functions(tree: ast.AST, prefix: str = ""):
    """(qualified name, lines) of every function in ``tree``, nested ones and methods too."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            start = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            name = f"{prefix}{node.name}"
            yield name, node.end_lineno - start + 1
            yield from _functions(node, f"{name}.")
        elif isinstance(node, ast.ClassDef):
            yield from _functions(node, f"{prefix}{node.name}.")
        else:
            yield from _functions(node, prefix)


def sizes() -> tuple[dict[str, int], dict[str, int]]:
    """(module path -> lines, ``path:function`` -> lines) for the whole package."""
    modules, functions = {}, {}
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG.parent).as_posix()
        text = path.read_text()
        modules[rel] = len(text.splitlines())
        for name, lines in _functions(ast.parse(text, filename=rel)):
            functions[f"{rel}:{name}"] = lines
    return modules, functions


def test_no_module_over_the_limit():
    modules, _ = sizes()
    over = {m: n for m, n in modules.items() if n > MAX_MODULE_LINES}
    assert not over, f"modules over {MAX_MODULE_LINES} lines (split them by concern): {over}"


def test_no_function_over_the_limit():
    _, functions = sizes()
    over = {f: n for f, n in functions.items() if n > MAX_FUNCTION_LINES}
    unexpected = {f: n for f, n in over.items() if f not in ALLOWED_LONG_FUNCTIONS}
    assert not unexpected, f"functions over {MAX_FUNCTION_LINES} lines: {unexpected}"
    stale = sorted(ALLOWED_LONG_FUNCTIONS - over.keys())
    assert not stale, f"no longer over the limit, drop from ALLOWED_LONG_FUNCTIONS: {stale}"


def test_the_measure_counts_nested_functions_and_decorators():
    source = "@dec\n@dec2\ndef f():\n    def g():\n        return 1\n    return g\n"
    assert dict(_functions(ast.parse(source))) == {"f": 6, "f.g": 2}
