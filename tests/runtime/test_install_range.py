"""Installing into a user's environment (issue 32): the ``runtime`` extra accepts the torch and
megatron-core a Megatron container already has within the tested range, CI's constraint files
are that range's two ends, and a run outside it says so in one line and goes on."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from megatron_hsp.runtime.compat import untested_versions

ROOT = Path(__file__).resolve().parents[2]


def runtime_extra() -> dict[str, Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = [Requirement(r) for r in project["optional-dependencies"]["runtime"]]
    return {r.name: r for r in reqs}


def pins(name: str) -> dict[str, Version]:
    out = {}
    for line in (ROOT / "constraints" / name).read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            req = Requirement(line)
            (spec,) = req.specifier
            assert spec.operator == "==", line
            out[req.name] = Version(spec.version)
    return out


@pytest.mark.parametrize(
    ("name", "version"),
    [
        ("torch", "2.15.0"),  # on PyPI when issue 32 was filed; refused by `<2.15`
        ("torch", "2.14.1+cu130"),
        ("torch", "2.11.0"),
        ("megatron-core", "0.18.0"),
        ("megatron-core", "0.19.2"),
        ("megatron-core", "0.20.0rc0"),  # Megatron-LM main's own source
    ],
)
def test_the_runtime_extra_accepts_what_containers_have(name, version):
    assert runtime_extra()[name].specifier.contains(version, prereleases=True)


def test_ci_installs_both_ends_of_the_range():
    """constraints/torch-pinned.txt (``make test``) and torch-oldest.txt (``make
    test-oldest-torch``) pin torch and megatron-core, each inside the range."""
    extra = runtime_extra()
    newest, oldest = pins("torch-pinned.txt"), pins("torch-oldest.txt")
    for name in ("torch", "megatron-core"):
        assert extra[name].specifier.contains(newest[name]), (name, newest[name])
        assert extra[name].specifier.contains(oldest[name]), (name, oldest[name])
        assert oldest[name] < newest[name]
    # The lower bounds are what the oldest venv installs: the declared range's own end.
    for name, spec in ((n, s) for n in ("torch", "megatron-core") for s in extra[n].specifier):
        if spec.operator == ">=":
            assert Version(spec.version).release[:2] == oldest[name].release[:2], name


REQUIRES = [
    "numpy<3,>=1.26",
    'torch<2.16,>=2.11; extra == "runtime"',
    'megatron-core<0.21,>=0.18; extra == "runtime"',
    'matplotlib>=3.8; extra == "plot"',
]


def test_versions_inside_the_range_say_nothing():
    installed = {"torch": "2.15.0", "megatron-core": "0.20.0rc1"}
    assert untested_versions(REQUIRES, installed) is None


def test_an_untested_version_is_one_line_and_goes_on():
    line = untested_versions(REQUIRES, {"torch": "2.16.1+cu131", "megatron-core": "0.17.1"})
    assert line is not None and "\n" not in line
    assert "torch 2.16.1+cu131 (tested: <2.16,>=2.11)" in line
    assert "megatron-core 0.17.1 (tested: <0.21,>=0.18)" in line and "going on" in line


def test_a_missing_package_is_not_a_version_warning():
    assert untested_versions(REQUIRES, {"torch": "2.12.0", "megatron-core": None}) is None


def test_the_cli_prints_the_warning_and_runs_on(monkeypatch, capsys):
    from megatron_hsp import cli
    from megatron_hsp.runtime import compat

    monkeypatch.setattr(compat, "untested_versions", lambda: "megatron-hsp: warning: untested X")
    assert cli.missing_torch("selftest") is None
    assert capsys.readouterr().err == "megatron-hsp: warning: untested X\n"


def test_the_megatron_core_that_runs_is_checked_not_the_installed_wheel(monkeypatch):
    """Issue 42: with a Megatron-LM checkout on PYTHONPATH its megatron-core runs (main:
    0.20.0+d98e8a64dd, or a newer one) while the wheel's metadata says 0.19.2; the check read
    the metadata and stayed silent about a version outside the range."""
    import sys
    import types

    import megatron.core  # noqa: F401  (the parent package, as a checkout's import makes it)

    from megatron_hsp.runtime import compat

    checkout = types.ModuleType("megatron.core.package_info")
    checkout.__version__ = "0.21.0+d98e8a64dd"
    monkeypatch.setitem(sys.modules, "megatron.core.package_info", checkout)
    assert compat._installed_version("megatron-core") == "0.21.0+d98e8a64dd"
    line = untested_versions(REQUIRES)
    assert line is not None and "megatron-core 0.21.0+d98e8a64dd" in line
    assert "megatron-core 0.21.0+d98e8a64dd" in compat.running_versions()


def test_the_torch_that_runs_is_named(monkeypatch):
    import torch

    from megatron_hsp.runtime import compat

    monkeypatch.setattr(torch, "__version__", "2.16.0a0+git1234")
    assert compat._installed_version("torch") == "2.16.0a0+git1234"
    line = untested_versions(REQUIRES)
    assert line is not None and "torch 2.16.0a0+git1234" in line
    assert compat.running_versions().startswith("torch 2.16.0a0+git1234 (")
