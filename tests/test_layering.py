"""Layer boundaries, checked by parsing imports (module level, inside functions and under
``TYPE_CHECKING`` alike).

Every package folder of ``megatron_hsp`` sits on one floor of ``FLOORS`` and imports only from
its own folder or from floors below it: the planner's core types at the bottom, then the cost
model, then the search; production training (runtime, step pipeline, Megatron integration)
above the planner; test machinery, evaluation (baselines, bench, research bounds) and the
commands on top. A floor list makes an import circle between folders impossible; a second check
refuses circles between modules, and a third keeps the planner and the torch-free half of the
evaluation package free of torch, so ``plan``/``bench`` run on a machine without it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "megatron_hsp"

# Lowest first. A folder may import its own modules and anything on a lower floor.
FLOORS = (
    # core types: errors, units, paths, topology, groupspace, run_spec (the run description's
    # rules, which every floor above reads), plan, lengths
    "megatron_hsp.planner",
    "megatron_hsp.planner.cost",  # the cost model family
    "megatron_hsp.planner.search",  # solver, chunking, greedy, improve, MILP, bounds, settings
    "megatron_hsp.runtime",  # torch.distributed execution of a plan
    "megatron_hsp.step",  # one training step: sampler, planner service, step pipeline
    "megatron_hsp.megatron",  # the Megatron-LM integration
    # a ``sitecustomize`` put on PYTHONPATH to report CUDA visible (imports nothing of ours)
    "megatron_hsp.testing.cuda_reported_visible",
    "megatron_hsp.testing",  # test machinery shipped with the package (selftest, dist harness)
    "megatron_hsp.testing.megatron_loop",  # selftest --megatron: train_step, HSP vs stock
    "megatron_hsp.evaluation",  # baselines, bench, research bounds (torch-free)
    "megatron_hsp.evaluation.torch_side",  # baselines that run megatron-core's schedulers
    "megatron_hsp.commands",  # the CLI's commands
    "megatron_hsp",  # cli.py, launch.py
)
# Folders whose modules must import without torch (``evaluation`` is torch-free but its
# ``torch_side`` is not).
TORCH_FREE = ("megatron_hsp.planner", "megatron_hsp.planner.cost", "megatron_hsp.planner.search",
              "megatron_hsp.evaluation")  # fmt: skip
TORCH_MODULES = ("torch", "megatron", "transformer_engine", "flash_attn", "apex")


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


def module_name(path: Path) -> str:
    name = ".".join(path.relative_to(PKG.parent).with_suffix("").parts)
    return name.removesuffix(".__init__")


MODULES = {module_name(p): p for p in sorted(PKG.rglob("*.py"))}


def folder_of(module: str) -> str:
    """The package folder a module lives in (a package's ``__init__`` is in its own folder)."""
    if (PKG.parent / Path(*module.split("."))).is_dir():
        return module
    return module.rpartition(".")[0]


def internal_imports(path: Path) -> set[str]:
    """The ``megatron_hsp`` modules ``path`` imports: ``from pkg import sub`` counts as ``sub``
    alone when ``sub`` is a module, otherwise as ``pkg``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name in MODULES)
        elif isinstance(node, ast.ImportFrom) and node.module in MODULES:
            subs = {f"{node.module}.{a.name}" for a in node.names} & MODULES.keys()
            out |= subs if len(subs) == len(node.names) else {node.module, *subs}
    return out


def upward_imports(modules: dict[str, Path]) -> list[str]:
    bad = []
    for name, path in modules.items():
        here = FLOORS.index(folder_of(name))
        for target in sorted(internal_imports(path)):
            there = folder_of(target)
            if there != folder_of(name) and FLOORS.index(there) >= here:
                bad.append(f"{name} ({folder_of(name)}) imports {target} ({there}), not below it")
    return bad


def module_cycles(modules: dict[str, Path]) -> list[list[str]]:
    """Strongly connected components of more than one module in the import graph (Tarjan)."""
    graph = {m: sorted(internal_imports(p) - {m}) for m, p in modules.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, []):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def offending(paths: list[Path], forbidden: tuple[str, ...]) -> list[str]:
    bad = []
    for path in paths:
        shown = path.relative_to(PKG.parent) if path.is_relative_to(PKG.parent) else path
        for mod in sorted(imported_modules(path)):
            if any(mod == f or mod.startswith(f + ".") for f in forbidden):
                bad.append(f"{shown} imports {mod}")
    return bad


def test_every_package_folder_has_a_floor() -> None:
    folders = {folder_of(m) for m in MODULES}
    assert folders == set(FLOORS), (
        f"missing: {folders - set(FLOORS)}, stale: {set(FLOORS) - folders}"
    )


def test_no_folder_imports_its_own_floor_or_one_above() -> None:
    assert upward_imports(MODULES) == []


def test_no_import_circle_between_modules() -> None:
    assert module_cycles(MODULES) == []


def test_the_planner_and_the_evaluation_core_import_no_torch() -> None:
    paths = [p for m, p in MODULES.items() if folder_of(m) in TORCH_FREE]
    assert len(paths) >= 30
    assert offending(paths, TORCH_MODULES) == []


def test_runtime_imports_neither_the_megatron_integration_nor_test_machinery() -> None:
    paths = sorted((PKG / "runtime").glob("*.py"))
    assert len(paths) >= 5
    assert offending(paths, ("megatron_hsp.megatron", "megatron_hsp.testing")) == []


def test_the_checks_catch_an_upward_import_and_a_circle(tmp_path: Path) -> None:
    """Each check fails on the arrows the package had before its floors (planted here)."""
    up = tmp_path / "args.py"
    up.write_text("def f():\n    from megatron_hsp.commands.common import check_output_path\n")
    fake = {**MODULES, "megatron_hsp.megatron.args": up}
    assert any("megatron_hsp.commands.common" in b for b in upward_imports(fake))
    settings, solver = tmp_path / "settings.py", tmp_path / "solver.py"
    settings.write_text("def f():\n    from megatron_hsp.planner.search.solver import solve\n")
    solver.write_text("from megatron_hsp.planner.search.settings import SOLVERS\n")
    fake = {**MODULES, "megatron_hsp.planner.search.settings": settings,
            "megatron_hsp.planner.search.solver": solver}  # fmt: skip
    assert [
        "megatron_hsp.planner.search.settings",
        "megatron_hsp.planner.search.solver",
    ] in module_cycles(fake)
    core = tmp_path / "plan.py"
    core.write_text("from megatron_hsp.planner.cost.costmodel import CostModel\nimport torch\n")
    fake = {**MODULES, "megatron_hsp.planner.plan": core}
    assert any("planner.cost.costmodel" in b for b in upward_imports(fake))
    assert offending([core], TORCH_MODULES) == [f"{core} imports torch"]


def test_the_checker_sees_function_level_imports(tmp_path: Path) -> None:
    src = tmp_path / "m.py"
    src.write_text("def f():\n    from megatron_hsp.megatron import spec\n    import os\n")
    assert "megatron_hsp.megatron.spec" in imported_modules(src)
    with pytest.raises(AssertionError, match="relative import"):
        src.write_text("from . import x\n")
        imported_modules(src)
