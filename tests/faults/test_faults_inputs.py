"""Class 2: inputs parsed with bounds. Numbers in flags, length files (text, .gz, indexed
datasets) and cost-model files are range-checked before any arithmetic; each bad input is one
line naming the flag, file or coefficient, exit 2, no traceback."""

from __future__ import annotations

import gzip
import json

import pytest

from tests.faults.conftest import one_error_line, run_cli

SMALL = ["--gpus", "8", "--global-batch", "8", "--time-budget", "0.3", "--max-seq", "16k"]
COEFFS = {
    "attn_ms_per_token2": 1.0e-7,
    "linear_ms_per_token": 0.002,
    "group_fixed_ms": 1.0,
    "a2a_ms_per_token": {2: 0.001, 4: 0.0008, 8: 0.0006},
    "tokens_per_rank": 4096,
}


def plan(*extra: str) -> list[str]:
    return ["plan", "--flexsp-harness", *SMALL, *extra]


@pytest.mark.parametrize("flag", ["--gpus", "--global-batch", "--tp", "--seed"])
def test_a_400_digit_number_in_a_flag_is_refused_naming_it(capsys, flag):
    argv = [a for a in plan() if a != flag]
    if flag in plan():  # drop the flag's value too
        i = plan().index(flag)
        argv = plan()[:i] + plan()[i + 2 :]
    rc, _, err = run_cli([*argv, flag, "9" * 400], capsys)
    assert rc == 2
    one_error_line(err, flag, "400-digit")


def test_a_5000_digit_length_is_refused_with_file_and_line(tmp_path, capsys):
    lengths = tmp_path / "lengths.txt"
    lengths.write_text("100\n" + "1" * 5000 + "\n")
    rc, _, err = run_cli(plan("--lengths", str(lengths)), capsys)
    assert rc == 2
    one_error_line(err, f"{lengths}:2", "5000 digits")


def test_a_corrupt_gz_is_refused_naming_the_file(tmp_path, capsys):
    good = gzip.compress(b"100\n200\n" * 1000)
    bad = bytearray(good)
    bad[len(bad) // 2 : len(bad) // 2 + 8] = b"\xff" * 8  # corrupt, not truncated
    path = tmp_path / "lengths.txt.gz"
    path.write_bytes(bytes(bad))
    rc, _, err = run_cli(plan("--lengths", str(path)), capsys)
    assert rc == 2
    one_error_line(err, "lengths.txt.gz", "cannot be read")


def test_an_index_whose_header_lies_is_refused(tmp_path, capsys):
    from megatron_hsp.planner.lengths import write_indexed_dataset_index

    idx = write_indexed_dataset_index(tmp_path / "docs", [[100], [200, 50]])
    data = bytearray(idx.read_bytes())
    data[18:26] = (10**15).to_bytes(8, "little")  # sequence count far beyond the file
    idx.write_bytes(bytes(data))
    rc, _, err = run_cli(plan("--lengths", str(tmp_path / "docs")), capsys)
    assert rc == 2
    one_error_line(err, "docs.idx", "truncated")


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("[" * 40000 + "]" * 40000, "nested deeper"),
        ("coefficients: " + "{a: " * 40000 + "1" + "}" * 40000, "nested deeper"),
        ("".join(f"{' ' * i}k{i}:\n" for i in range(0, 400, 2)) + " " * 400 + "v: 1\n", "indented"),
    ],
    ids=["brackets", "flow-mappings", "block-indent"],
)
def test_a_deeply_nested_cost_model_is_refused_before_parsing(tmp_path, capsys, text, needle):
    """80 KB of nested brackets kept the YAML parser busy past 30 s."""
    path = tmp_path / "cost.yaml"
    path.write_text(text)
    rc, _, err = run_cli(plan("--cost-model", str(path)), capsys, bound_s=10)
    assert rc == 2
    one_error_line(err, "cost.yaml", needle)


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("linear_ms_per_token", 1e308),
        ("attn_ms_per_token2", 1e300),
        ("group_fixed_ms", 1e200),
        ("a2a_ms_per_token", {2: 1e305, 4: 0.0008, 8: 0.0006}),
    ],
)
def test_a_coefficient_whose_price_overflows_is_refused_naming_it(tmp_path, capsys, key, value):
    """1e308 passed every sign check, overflowed to inf in the pricing, and kept plan busy
    past 45 s."""
    path = tmp_path / "cost.json"
    path.write_text(json.dumps({"name": "t", "coefficients": {**COEFFS, key: value}}))
    rc, _, err = run_cli(plan("--cost-model", str(path)), capsys, bound_s=15)
    assert rc == 2
    one_error_line(err, key, "prices a full group")


def test_a_cache_dir_that_is_a_file_is_refused_naming_the_flag(tmp_path, capsys):
    cache = tmp_path / "cache"
    cache.write_text("a file")
    for extra in ([], ["--no-refit"]):
        rc, _, err = run_cli(["demo", "--cache-dir", str(cache), *extra], capsys, bound_s=60)
        assert rc == 2
        one_error_line(err, "--cache-dir", "is a file")


@pytest.mark.parametrize("value", ["-1", "0", "nan", "inf"])
def test_selftest_timeout_out_of_range_is_refused_before_anything_starts(capsys, value):
    rc, _, err = run_cli(["selftest", "--timeout", value], capsys, bound_s=60)
    assert rc == 2
    one_error_line(err, "--timeout")


def test_fuzzed_numeric_flags_never_raise_a_traceback(capsys):
    """Every numeric flag of plan with extreme values: exit 0 or one line, never an exception."""
    flags = ["--gpus", "--gpus-per-node", "--global-batch", "--tp", "--pp", "--ep", "--seed"]
    values = ["0", "-1", "9" * 30, "9" * 400, "1e309"]
    for flag in flags:
        for value in values:
            base = plan()
            if flag in base:
                i = base.index(flag)
                base = base[:i] + base[i + 2 :]
            try:
                rc, _, err = run_cli([*base, flag, value], capsys)
            except SystemExit as exc:  # argparse's own one line (not an int): exit 2
                assert exc.code == 2
                one_error_line(capsys.readouterr().err, flag)
                continue
            assert rc in (0, 2), (flag, value)
            if rc == 2:
                one_error_line(err)
