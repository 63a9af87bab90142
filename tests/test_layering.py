"""Layer boundaries, checked by parsing imports (module level and inside functions).

``megatron_hsp.runtime`` is what production training imports; it must not depend on the Megatron
integration (``megatron_hsp.megatron``) or on test machinery (``megatron_hsp.testing``).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "megatron_hsp"


def imported_modules(path: Path) -> set[str]:
    """Every module named by an ``import`` / ``from ... import`` anywhere in ``path``, with
    ``from pkg import name`` also recorded as ``pkg.name`` (it may be a submodule)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                raise AssertionError(f"{path}: relative import; the layer check needs full names")
            mod = node.module or ""
            out.add(mod)
            out.update(f"{mod}.{a.name}" for a in node.names)
    return out


def offending(paths: list[Path], forbidden: tuple[str, ...]) -> list[str]:
    bad = []
    for path in paths:
        for mod in sorted(imported_modules(path)):
            if any(mod == f or mod.startswith(f + ".") for f in forbidden):
                bad.append(f"{path.relative_to(PKG.parent)} imports {mod}")
    return bad


def test_runtime_imports_neither_the_megatron_integration_nor_test_machinery() -> None:
    paths = sorted((PKG / "runtime").glob("*.py"))
    assert len(paths) >= 5
    assert offending(paths, ("megatron_hsp.megatron", "megatron_hsp.testing")) == []


def test_the_checker_sees_function_level_imports(tmp_path: Path) -> None:
    src = tmp_path / "m.py"
    src.write_text("def f():\n    from megatron_hsp.megatron import spec\n    import os\n")
    assert "megatron_hsp.megatron.spec" in imported_modules(src)
    with pytest.raises(AssertionError, match="relative import"):
        src.write_text("from . import x\n")
        imported_modules(src)
