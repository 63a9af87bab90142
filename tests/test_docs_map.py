"""The map is true: README.md's "Layout" names every package folder, in the import floors' order,
and nothing that is gone; docs/README.md indexes every document under docs/ and nothing else."""

from __future__ import annotations

import re

from tests.helpers import ROOT
from tests.test_layering import FLOORS, PKG


def layout_paths() -> list[str]:
    text = (ROOT / "README.md").read_text()
    section = text.split("## Layout", 1)[1]
    block = section.split("```", 2)[1]
    return [line.split()[0] for line in block.splitlines() if line.strip()]


def test_every_path_in_the_layout_exists() -> None:
    paths = layout_paths()
    assert len(paths) >= 10
    assert [p for p in paths if not (ROOT / p).exists()] == []


def test_the_layout_names_every_package_folder_in_floor_order() -> None:
    packages = sorted(
        str(d.relative_to(ROOT)) + "/" for d in PKG.rglob("*") if (d / "__init__.py").is_file()
    )
    listed = [p for p in layout_paths() if p.startswith("megatron_hsp/")]
    assert [p for p in packages if p not in listed] == []
    floors = [f.replace(".", "/") + "/" for f in FLOORS if f != "megatron_hsp"]
    assert [p for p in listed if p in floors] == floors


def test_docs_readme_indexes_every_document() -> None:
    index = (ROOT / "docs" / "README.md").read_text()
    linked = set(re.findall(r"\]\(([^)#]+\.md)\)", index))
    docs = {
        str(p.relative_to(ROOT / "docs"))
        for p in (ROOT / "docs").rglob("*.md")
        if p.name != "README.md"
    }
    assert docs - linked == set(), "documents missing from docs/README.md"
    assert {d for d in linked if not (ROOT / "docs" / d).exists()} == set()
