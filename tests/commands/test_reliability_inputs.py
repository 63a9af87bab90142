"""Issue 9, validated inputs: each bad input ends in exit 2 with one line naming what is wrong.

Runs ``megatron_hsp.cli.main`` in-process (no subprocess start-up), under a wall-clock bound, and
a small seeded fuzz over malformed length and cost-model files for ``plan`` and ``bench``.
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import pytest

from megatron_hsp.cli import main
from megatron_hsp.megatron.flags import parse_tokens as megatron_parse_tokens
from megatron_hsp.planner.lengths import parse_max_seq
from megatron_hsp.planner.units import parse_tokens
from tests.helpers import ROOT

COEFFS = {
    "attn_ms_per_token2": 1.0e-7,
    "linear_ms_per_token": 0.002,
    "group_fixed_ms": 1.0,
    "a2a_ms_per_token": {2: 0.001, 4: 0.0008, 8: 0.0006},
    "tokens_per_rank": 4096,
}
SMALL = ["--gpus", "8", "--global-batch", "8", "--time-budget", "0.3", "--max-seq", "16k"]


def spec_file(tmp_path: Path, **override: object) -> str:
    co = {**COEFFS, **override}
    path = tmp_path / "cost.json"
    path.write_text(json.dumps({"name": "t", "coefficients": co}))
    return str(path)


def lengths_file(tmp_path: Path, data: bytes) -> str:
    path = tmp_path / "lengths.txt"
    path.write_bytes(data)
    return str(path)


def run_cli(argv: list[str], capsys: pytest.CaptureFixture[str], bound_s: float = 20.0):
    start = time.perf_counter()
    rc = main(argv)
    took = time.perf_counter() - start
    out = capsys.readouterr()
    assert took < bound_s, f"{argv} took {took:.1f} s"
    return rc, out.out, out.err


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        ({"attn_ms_per_token2": -1.0e-6}, "attn_ms_per_token2"),
        ({"linear_ms_per_token": -0.01}, "linear_ms_per_token"),
        ({"linear_ms_per_token": 0, "attn_ms_per_token2": 0}, "linear_ms_per_token = 0"),
        ({"linear_ms_per_token": "abc"}, "must be a number"),
        ({"a2a_ms_per_token": {2: float("nan")}}, "finite"),
        ({"tokens_per_rank": -5}, "tokens_per_rank"),
    ],
)
def test_bad_cost_model_exits_2_naming_field(tmp_path, capsys, override, needle):
    rc, _, err = run_cli(
        ["plan", "--flexsp-harness", *SMALL, "--cost-model", spec_file(tmp_path, **override)],
        capsys,
    )
    assert rc == 2
    line = err.strip().splitlines()
    assert len(line) == 1 and needle in line[0], err


@pytest.mark.parametrize(
    ("data", "needle"),
    [
        (b"100\n99999999999999999999999\n", ":2: length 99999999999999999999999"),
        (b"100\n-4\n", ":2: length -4"),
        (b"100\nabc\n", ":2: 'abc'"),
        (b"\xff\xfe\x00", "cannot be read"),
    ],
)
def test_bad_lengths_exit_2_with_file_line(tmp_path, capsys, data, needle):
    rc, _, err = run_cli(
        ["plan", "--flexsp-harness", *SMALL, "--lengths", lengths_file(tmp_path, data)], capsys
    )
    assert rc == 2 and needle in err, err


def test_bom_is_not_part_of_the_first_length(tmp_path, capsys):
    path = lengths_file(tmp_path, b"\xef\xbb\xbf" + b"1000\n" * 8)
    rc, out, err = run_cli(["plan", "--flexsp-harness", *SMALL, "--lengths", path], capsys)
    assert rc == 0 and "8 sequences" in out, err


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (["--time-budget", "-1"], "--time-budget"),
        (["--memory-cap-gb", "-3"], "--memory-cap-gb"),
        (["--gpus", "1000000"], "--gpus must be >= 1 and <= 16384"),
        (["--gpus", "0"], "--gpus"),
        (["--global-batch", "0"], "--global-batch"),
        (["--max-seq", "12q"], "--max-seq"),
    ],
)
def test_numeric_flags_range_checked(capsys, flags, needle):
    rc, _, err = run_cli(["plan", "--flexsp-harness", *SMALL, *flags], capsys, bound_s=10)
    assert rc == 2 and needle in err, err


def test_one_token_parser_everywhere():
    """``192k`` is 192000 for plan/bench --max-seq and Megatron's --hsp-max-seq alike."""
    for text, want in (("192k", 192_000), ("1.5k", 1500), ("2m", 2_000_000), ("196608", 196608)):
        assert parse_tokens(text) == want
        assert parse_max_seq(text) == want
        assert megatron_parse_tokens(text) == want


def _malformed_lengths(rng: random.Random) -> bytes:
    pool = ["100", "0", "-7", "1e3", "abc", "", " 12 ", "9" * 30, "\ufeff5", "3.5", "4096"]
    return "\n".join(rng.choice(pool) for _ in range(rng.randint(0, 12))).encode()


def _malformed_cost(rng: random.Random) -> dict:
    co: dict = dict(COEFFS)
    for key in rng.sample(sorted(co), rng.randint(1, 3)):
        co[key] = rng.choice([0, -1.0, 1e300, "x", None, [], {2: -1}, {"a": 1}, float("inf")])
    if rng.random() < 0.2:
        co.pop(rng.choice(sorted(co)))
    return {"name": "fuzz", "coefficients": co}


@pytest.mark.parametrize("seed", range(6))
def test_fuzz_plan_and_bench(tmp_path, capsys, seed):
    """Random malformed inputs: exit 0 with a plan, or exit 2 with one line; never a traceback."""
    rng = random.Random(seed)
    lengths = lengths_file(tmp_path, _malformed_lengths(rng))
    cost = tmp_path / "cost.json"
    cost.write_text(json.dumps(_malformed_cost(rng), allow_nan=True))
    for command in (
        ["plan", "--flexsp-harness"],
        ["bench", "--flexsp-harness", "--steps", "1", "--methods", "hsp"],
    ):
        for extra in (["--lengths", lengths], ["--cost-model", str(cost)]):
            rc, out, err = run_cli([*command, *SMALL, "--overlong", "split", *extra], capsys)
            assert rc in (0, 2), (rc, err)
            if rc == 2:
                assert len(err.strip().splitlines()) == 1 and "error" in err, err
            else:
                assert out.strip(), err


@pytest.mark.parametrize(
    "override",
    [
        {"linear_ms_per_token": -0.01},
        {"attn_ms_per_token2": -1e-4},
        {"a2a_ms_per_token": {d: -0.01 for d in (2, 4, 8)}},
    ],
)
def test_solver_returns_within_budget_even_on_unvalidated_negative_costs(monkeypatch, override):
    """The solve is bounded by its budget plus a margin (1 s here) whatever the coefficients:
    the negative-coefficient YAML used to hang the greedy bisection for minutes."""
    from megatron_hsp.planner.cost.costmodel import CostModel
    from megatron_hsp.planner.search import solver
    from megatron_hsp.planner.topology import Cluster

    kw: dict = {
        **COEFFS,
        "group_fixed_ms": {0: 1.0},
        "a2a_ms_per_token": {2: 0.001, 4: 0.0008, 8: 0.0006},
        **override,
    }
    cost = CostModel("neg", **kw)
    monkeypatch.setattr(solver, "validate_cost_model", lambda c: c)  # what load would refuse
    lengths = [4096, 3000, 2500, 900, 800, 700, 600, 500, 400, 300, 200, 100] * 4
    t0 = time.perf_counter()
    plan = solver.solve(lengths, cost, Cluster(8, 8), solver.SolverConfig(time_budget_s=0.5))
    assert time.perf_counter() - t0 < 0.5 + 1.0
    assert plan.num_sequences == len(lengths)


def test_package_data_globs_match_files():
    """pyproject's package-data must name files that exist (it once shipped a missing presets/)."""
    import tomllib

    root = ROOT
    data = tomllib.loads((root / "pyproject.toml").read_text())
    for package, globs in data["tool"]["setuptools"]["package-data"].items():
        for pattern in globs:
            assert list((root / package).glob(pattern)), f"{package}/{pattern} matches nothing"


@pytest.mark.spawns
def test_make_bench_target_exists_and_covers_every_script():
    root = ROOT
    assert "benchmarks/run_all.py" in (root / "Makefile").read_text()
    import subprocess
    import sys

    got = subprocess.run(
        [sys.executable, str(root / "benchmarks" / "run_all.py"), "--dry-run"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert got.returncode == 0, got.stderr
    for script in (root / "benchmarks").glob("*.py"):
        if script.stem != "run_all":
            assert script.name in got.stdout


def test_sequential_drops_are_printed_and_error_is_honoured(capsys):
    """Issue 9: FlexSP's drop of overlong documents is announced, and --overlong error obeyed."""
    rc, _, err = run_cli(["plan", "--flexsp-harness", *SMALL], capsys)
    assert rc == 0 and "dropped (--overlong drop, FlexSP's harness rule)" in err, err
    rc, _, err = run_cli(["plan", "--flexsp-harness", *SMALL, "--overlong", "error"], capsys)
    assert rc == 2 and "--sampling sequential" in err and "--overlong drop" in err, err
    rc, _, err = run_cli(["plan", "--flexsp-harness", *SMALL, "--overlong", "split"], capsys)
    assert rc == 0 and "split into" in err, err


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (["--token-budget", "0"], "--token-budget"),
        (["--global-batch", "0"], "--global-batch"),
        (["--nproc", "3"], "--nproc must be a power of two"),
    ],
)
def test_demo_flags_refused_before_anything_starts(capsys, flags, needle):
    """``demo --token-budget 0`` used to run silently with 8192, ``--global-batch 0`` to end in a
    traceback naming Megatron's flags; both now exit 2 naming the demo's flag, before spawning."""
    rc, _, err = run_cli(["demo", "--steps", "1", *flags], capsys, bound_s=30)
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and needle in lines[0], err


def test_output_paths_are_checked_before_the_work(tmp_path, capsys):
    """Issue 18: ``bench --json``, ``demo --json FILE`` and ``profile --out`` checked their path
    only after the work (then crashed, losing it); ``profile --out`` overwrote silently."""
    missing = str(tmp_path / "no-such-dir" / "out.json")
    rc, _, err = run_cli(
        ["bench", "--flexsp-harness", *SMALL, "--steps", "1", "--json", missing], capsys, bound_s=5
    )
    assert rc == 2 and "--json" in err and "does not exist" in err, err
    assert "running" not in err  # refused before any method ran
    rc, _, err = run_cli(["demo", "--json", missing, "--steps", "1"], capsys, bound_s=5)
    assert rc == 2 and "--json" in err and "does not exist" in err, err
    existing = tmp_path / "model.yaml"
    existing.write_text("keep me\n")
    rc, _, err = run_cli(["profile", "--out", str(existing)], capsys, bound_s=5)
    assert rc == 2 and "--force" in err, err
    assert existing.read_text() == "keep me\n"
    rc, _, err = run_cli(
        ["bench", "--flexsp-harness", *SMALL, "--steps", "1", "--json", str(tmp_path)], capsys, 5
    )
    assert rc == 2 and "is a directory" in err, err


def test_bench_json_dash_is_standard_output(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rc, out, _ = run_cli(
        ["bench", "--flexsp-harness", *SMALL, "--steps", "1", "--json", "-"], capsys, bound_s=60
    )
    assert rc == 0
    doc = json.loads(out)  # JSON only: no table, no banner
    assert "summary" in doc
    assert not (tmp_path / "-").exists()


@pytest.mark.parametrize("line", ["1_000", "+7", "\u0663\u0663", "1e3", "0x10"])
def test_length_files_take_ascii_digits_only(tmp_path, capsys, line):
    """Issue 18: ``int()`` accepted ``1_000``, ``+7`` and non-ASCII digits silently."""
    f = tmp_path / "lengths.txt"
    f.write_text(f"100\n{line}\n200\n", encoding="utf-8")
    rc, _, err = run_cli(["plan", "--flexsp-harness", *SMALL, "--lengths", str(f)], capsys)
    assert rc == 2 and f"{f}:2" in err and "digits 0-9 only" in err, err


DUPLICATE_KEY = """name: dup
coefficients:
  attn_ms_per_token2: 1.0e-7
  linear_ms_per_token: 0.1
  linear_ms_per_token: 0.2
  group_fixed_ms: 1.0
  a2a_ms_per_token: {2: 0.1}
  tokens_per_rank: 16000
"""
FRACTIONAL = DUPLICATE_KEY.replace("  linear_ms_per_token: 0.2\n", "").replace("16000", "64000.7")
BILLION_LAUGHS = "a: &a [1,1,1,1,1,1,1,1,1]\n" + "".join(
    f"{c}: &{c} [{', '.join([f'*{p}'] * 9)}]\n" for p, c in zip("abcdefgh", "bcdefghi", strict=True)
)


@pytest.mark.parametrize(
    ("text", "suffix", "needle"),
    [
        (DUPLICATE_KEY, ".yaml", "appears twice"),
        ('{"name": "x", "name": "y"}', ".json", "appears twice"),
        (BILLION_LAUGHS, ".yaml", "anchors and aliases"),
        (FRACTIONAL, ".yaml", "whole number"),
        ("name: [unclosed\n", ".yaml", "not valid YAML/JSON"),
    ],
)
def test_cost_model_files_are_loaded_strictly(tmp_path, capsys, text, suffix, needle):
    """Issue 18: duplicate keys (last won), a billion-laughs YAML (hung for minutes), a
    fractional token capacity and YAML syntax errors (8 lines) now end in one line, fast."""
    f = tmp_path / f"model{suffix}"
    f.write_text(text)
    rc, _, err = run_cli(
        ["plan", "--flexsp-harness", *SMALL, "--cost-model", str(f)], capsys, bound_s=10
    )
    assert rc == 2 and needle in err, err
    assert len([x for x in err.splitlines() if x.strip()]) == 1, err


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["selftest", "--nproc", "16"], "--nproc 16"),  # was an IndexError traceback
        (["profile", "--out", "OUT", "--heads", "0"], "--heads"),  # was ZeroDivisionError
        (["profile", "--out", "OUT", "--layers", "0"], "--layers"),  # failed after measuring
        (["profile", "--out", "OUT", "--vocab", "0"], "--vocab"),
        (["demo", "--global-batch", "100000"], "<= 4096"),  # memory grew to GBs, then hung
        (["demo", "--token-budget", "99999999"], "<= 262144"),
        (
            ["plan", "--flexsp-harness", "--gpus", "16384", "--gpus-per-node", "16384"],
            "<= 512",
        ),  # exhausted 24 GB
    ],
)
def test_out_of_range_flags_are_one_line_errors(tmp_path, capsys, argv, needle):
    """Issue 18: tracebacks and unbounded work where one line was promised."""
    argv = [str(tmp_path / "out.yaml") if a == "OUT" else a for a in argv]
    rc, _, err = run_cli(argv, capsys, bound_s=10)
    assert rc == 2 and needle in err, err
    assert len([x for x in err.splitlines() if x.strip()]) == 1, err
