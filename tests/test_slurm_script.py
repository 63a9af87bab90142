"""scripts/slurm/hsp_pretrain.sbatch run under stand-in ``srun``/``scontrol`` (no Slurm in CI).

The stand-ins record how the script calls ``srun`` and ``scontrol`` and the environment torchrun
would inherit; ``hsp_node.sh`` (one node's part) runs the real torchrun with stand-in ranks.
``local_cluster_test.sh`` proves the sbatch script on a real single-node cluster (needs root).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "slurm" / "hsp_pretrain.sbatch"
NODE_SCRIPT = ROOT / "scripts" / "slurm" / "hsp_node.sh"

pytestmark = [
    pytest.mark.spawns,
    pytest.mark.skipif(shutil.which("bash") is None, reason="bash is not installed"),
]


def stand_ins(tmp_path: Path, srun_body: str = "") -> tuple[Path, Path, Path]:
    """(bin dir, srun record, scontrol record): ``srun`` writes its arguments and the
    environment it inherited, then runs ``srun_body``; ``scontrol`` names one host."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    record, control = tmp_path / "srun.txt", tmp_path / "scontrol.txt"
    (bin_dir / "srun").write_text(
        "#!/bin/bash\n"
        f'printf "%s\\n" "$@" > {record}\n'
        f'echo "CUDA_DEVICE_MAX_CONNECTIONS=${{CUDA_DEVICE_MAX_CONNECTIONS:-unset}}" >> {record}\n'
        + srun_body
    )
    (bin_dir / "scontrol").write_text(
        f'#!/bin/bash\necho "$@" >> {control}\nif [[ $1 == show ]]; then echo node1; fi\n'
    )
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    return bin_dir, record, control


def slurm_env(bin_dir: Path, tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "SLURM_CPUS_PER_TASK": "12",
        "SLURM_JOB_NUM_NODES": "2",
        "SLURM_JOB_ID": "7",
        "HSP_LOG_DIR": str(tmp_path / "logs"),
    }
    env.update(extra)
    return env


def run_sbatch(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=60
    )


def test_srun_gets_cpus_per_task_gpus_per_node_logs_and_megatron_env(tmp_path):
    bin_dir, record, _ = stand_ins(tmp_path)
    run = run_sbatch(
        slurm_env(bin_dir, tmp_path, SLURM_GPUS_ON_NODE="8"), "pretrain_gpt.py", "--hsp"
    )
    assert run.returncode == 0, run.stderr
    lines = record.read_text().splitlines()
    assert "--cpus-per-task=12" in lines
    assert "CUDA_DEVICE_MAX_CONNECTIONS=1" in lines
    assert lines[lines.index("--nproc-per-node") + 1] == "8"
    assert lines[lines.index("--nnodes") + 1] == "2"
    # One log per node (srun's %N), appended across requeues.
    assert f"--output={tmp_path / 'logs'}/node-%N.out" in lines
    assert f"--error={tmp_path / 'logs'}/node-%N.err" in lines
    assert "--open-mode=append" in lines
    # The node script hands the checkpoint signal to the ranks; Megatron's handler is asked for.
    assert lines[lines.index(str(NODE_SCRIPT)) + 1 : lines.index(str(NODE_SCRIPT)) + 3] == [
        "USR1",
        "--",
    ]
    tail = lines[lines.index("megatron_hsp.launch") + 1 : -1]
    assert tail == ["pretrain_gpt.py", "--hsp", "--exit-signal-handler", "--exit-signal", "SIGUSR1"]
    assert "added --exit-signal-handler --exit-signal SIGUSR1" in run.stdout
    assert "no --save" in run.stdout  # said: a requeued job would start over


@pytest.mark.parametrize(
    ("variables", "nproc"),
    [
        ({"SLURM_GPUS_PER_NODE": "gpu:h100:4"}, "4"),  # --gpus-per-node=h100:4
        ({"SLURM_GPUS_ON_NODE": "8(x2)"}, "8"),
        ({"SLURM_JOB_GPUS": "0,1,2"}, "3"),  # --gres=gpu:3 on older Slurm
        ({"CUDA_VISIBLE_DEVICES": "0,1"}, "2"),
        ({"HSP_NPROC_PER_NODE": "6", "SLURM_GPUS_ON_NODE": "8"}, "6"),
        ({}, "1"),
    ],
)
def test_ranks_per_node_come_from_slurms_gpu_variables(tmp_path, variables, nproc):
    bin_dir, record, _ = stand_ins(tmp_path)
    run = run_sbatch(slurm_env(bin_dir, tmp_path, **variables), "demo", "--steps", "1")
    assert run.returncode == 0, run.stderr
    lines = record.read_text().splitlines()
    assert lines[lines.index("--nproc-per-node") + 1] == nproc
    if not variables:
        assert "no GPU count from Slurm" in run.stdout  # never silently 1 rank per node


def test_a_users_own_exit_signal_is_the_one_forwarded(tmp_path):
    bin_dir, record, _ = stand_ins(tmp_path)
    argv = ["pretrain_gpt.py", "--save", "ck", "--exit-signal-handler", "--exit-signal", "SIGUSR2"]
    run = run_sbatch(slurm_env(bin_dir, tmp_path), *argv)
    assert run.returncode == 0, run.stderr
    lines = record.read_text().splitlines()
    assert lines[lines.index(str(NODE_SCRIPT)) + 1] == "USR2"
    assert lines.count("--exit-signal-handler") == 1 and "no --save" not in run.stdout


def _wait_for(path: Path, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.1)


def test_time_limit_signal_checkpoints_through_srun_and_requeues(tmp_path):
    """Slurm's --signal=B:USR1@300 (or preemption's SIGTERM) reaches the batch shell: it passes
    the checkpoint signal to srun (which forwards it to every node's hsp_node.sh), waits for the
    ranks to finish their checkpoint, and requeues the job."""
    started = tmp_path / "srun-started"
    body = (
        f"trap 'echo got-USR1 >> {tmp_path / 'srun-signals.txt'}; exit 0' USR1\n"
        f"touch {started}\n"
        "while true; do sleep 0.1; done\n"
    )
    bin_dir, _, control = stand_ins(tmp_path, body)
    proc = subprocess.Popen(
        ["bash", str(SCRIPT), "pretrain_gpt.py", "--save", "ck", "--hsp"],
        env=slurm_env(bin_dir, tmp_path),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        _wait_for(started)
        os.kill(proc.pid, signal.SIGUSR1)  # what --signal=B:USR1@300 sends
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, err
    assert (tmp_path / "srun-signals.txt").read_text().split() == ["got-USR1"]
    assert "requeue 7" in control.read_text().splitlines()
    assert "SIGUSR1" in out and "requeueing job 7" in out


def test_without_requeue_the_job_just_stops(tmp_path):
    started = tmp_path / "srun-started"
    body = f"trap 'exit 0' USR1\ntouch {started}\nwhile true; do sleep 0.1; done\n"
    bin_dir, _, control = stand_ins(tmp_path, body)
    env = slurm_env(bin_dir, tmp_path, HSP_REQUEUE="0")
    proc = subprocess.Popen(
        ["bash", str(SCRIPT), "pretrain_gpt.py", "--hsp"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        _wait_for(started)
        os.kill(proc.pid, signal.SIGTERM)  # preemption without --signal
        out, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert "requeue" not in control.read_text()
    assert "not requeued (HSP_REQUEUE=0)" in out


RANK = """
import os, pathlib, signal, sys, time

out = pathlib.Path(sys.argv[1])
rank = os.environ["RANK"]
got = []
signal.signal(signal.SIGUSR1, lambda *a: got.append(1))  # Megatron's --exit-signal-handler
(out / f"ready-{rank}").touch()
deadline = time.monotonic() + 60
while not got and time.monotonic() < deadline:
    time.sleep(0.05)
(out / f"checkpoint-{rank}").write_text("saved" if got else "timeout")
"""


@pytest.mark.slow
def test_node_script_hands_the_checkpoint_signal_to_the_ranks_not_torchrun(tmp_path):
    """The real torchrun with two stand-in ranks: SIGUSR1 to hsp_node.sh reaches both ranks
    (each 'saves' and exits 0) and torchrun survives it (its default action would have killed
    the agent and then the ranks, with no checkpoint)."""
    (tmp_path / "rank.py").write_text(RANK)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    ranks = ["--nproc-per-node", "2", str(tmp_path / "rank.py"), str(tmp_path)]
    proc = subprocess.Popen(
        ["bash", str(NODE_SCRIPT), "USR1", "--", *torchrun, *ranks],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        for rank in (0, 1):
            _wait_for(tmp_path / f"ready-{rank}", timeout=120)
        os.kill(proc.pid, signal.SIGUSR1)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, err[-2000:]
    for rank in (0, 1):
        assert (tmp_path / f"checkpoint-{rank}").read_text() == "saved"
    assert "asking the ranks to checkpoint" in err
