"""Class 1: writes. Every file the project writes goes through ``planner.paths`` (temp file in
the target's folder, fsync, rename): a link planted at an output path is refused, never written
through; a write that fails part-way leaves the previous file byte-identical and ends in one
line naming the path and the cause (exit 2)."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_hsp.planner.errors import InputError
from megatron_hsp.planner.paths import AppendLog, WriteError, atomic_write
from tests.faults.conftest import one_error_line, run_cli
from tests.helpers import ROOT

SMALL = ["--gpus", "8", "--global-batch", "8", "--time-budget", "0.3", "--max-seq", "16k"]


def _link(tmp_path: Path) -> tuple[Path, Path]:
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    link = tmp_path / "out.json"
    link.symlink_to(victim)
    return link, victim


def test_atomic_write_replaces_the_whole_file_and_keeps_its_mode(tmp_path):
    target = tmp_path / "model.yaml"
    target.write_text("old")
    target.chmod(0o640)
    atomic_write(target, "new content\n")
    assert target.read_text() == "new content\n"
    assert target.stat().st_mode & 0o777 == 0o640
    assert [p.name for p in tmp_path.iterdir()] == ["model.yaml"]  # no temp file left


def test_a_link_at_the_target_is_refused_and_what_it_points_to_is_untouched(tmp_path):
    link, victim = _link(tmp_path)
    with pytest.raises(InputError, match="symbolic link"):
        atomic_write(link, "attacker's choice")
    assert victim.read_text() == "precious\n" and link.is_symlink()


def test_a_failed_write_leaves_the_previous_file_byte_identical(tmp_path, monkeypatch):
    target = tmp_path / "result.json"
    target.write_bytes(b'{"complete": true}\n')

    def full_disk(_fd: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", full_disk)
    with pytest.raises(WriteError) as err:
        atomic_write(target, json.dumps({"x": "y" * 10_000}), flag="--json")
    assert str(target) in str(err.value) and "No space left" in str(err.value)
    assert "\n" not in str(err.value)
    assert target.read_bytes() == b'{"complete": true}\n'
    assert [p.name for p in tmp_path.iterdir()] == ["result.json"]


def test_bench_json_through_a_planted_link_is_refused_before_the_work(tmp_path, capsys):
    link, victim = _link(tmp_path)
    argv = ["bench", "--flexsp-harness", *SMALL, "--steps", "1", "--json", str(link)]
    rc, _, err = run_cli(argv, capsys)
    assert rc == 2
    one_error_line(err, "--json", "symbolic link")
    assert victim.read_text() == "precious\n"


def test_plot_through_a_planted_link_is_refused(tmp_path, capsys):
    victim = tmp_path / "victim.png"
    victim.write_bytes(b"png")
    link = tmp_path / "plan.png"
    link.symlink_to(victim)
    rc, _, err = run_cli(["plan", "--flexsp-harness", *SMALL, "--plot", str(link)], capsys)
    assert rc == 2
    one_error_line(err, "--plot", "symbolic link")
    assert victim.read_bytes() == b"png"


def test_demo_refit_model_through_a_link_in_the_cache_is_refused(tmp_path, capsys):
    """Issue 40's case: anyone who can write a shared --cache-dir planted demo-refit.yaml."""
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "demo-refit.yaml").symlink_to(victim)
    rc, _, err = run_cli(["demo", "--cache-dir", str(cache), "--steps", "1"], capsys, 60)
    assert rc == 2
    one_error_line(err, "demo-refit.yaml", "symbolic link")
    assert victim.read_text() == "precious\n"


def test_the_plan_log_refuses_a_link_and_stops_alone_on_a_failed_write(tmp_path, capsys):
    link, victim = _link(tmp_path)
    with pytest.raises(InputError, match="symbolic link"):
        AppendLog(link)
    log = AppendLog(tmp_path / "plans.jsonl")
    log.write('{"step": 0}\n')
    os.close(log.fd)  # the next write fails (EBADF), as a full disk would
    log.write('{"step": 1}\n')
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "plans.jsonl" in err and "training goes on" in err
    assert (tmp_path / "plans.jsonl").read_text() == '{"step": 0}\n'
    assert victim.read_text() == "precious\n"


def test_the_corpus_is_never_written_through_a_link(tmp_path):
    from megatron_hsp.step.corpus import publish_indexed_dataset

    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    (tmp_path / "c.idx").symlink_to(victim)
    with pytest.raises(InputError, match="symbolic link"):
        publish_indexed_dataset(tmp_path / "c", lambda tmp: 0)
    assert victim.read_text() == "precious\n"


@pytest.mark.spawns
def test_bench_json_on_a_full_disk_keeps_the_previous_result(tmp_path):
    """A file-size limit (EFBIG, as ENOSPC) while ``bench --json`` writes: before, a 2 KB
    fragment replaced the previous complete JSON."""
    out = tmp_path / "bench.json"
    out.write_text('{"previous": "complete"}\n')
    script = (
        "import resource, sys\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (2048, 2048))\n"
        "from megatron_hsp.cli import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    argv = ["bench", "--flexsp-harness", *SMALL, "--steps", "1", "--json", str(out)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONDONTWRITEBYTECODE": "1"}
    done = subprocess.run(
        [sys.executable, "-c", script, *argv],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 2, done.stderr[-3000:]
    line = one_error_line(done.stderr, str(out), "File too large")
    assert "unchanged" in line
    assert out.read_text() == '{"previous": "complete"}\n'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bench.json"]
