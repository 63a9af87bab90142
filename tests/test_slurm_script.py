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


# The environment torchrun would inherit from srun, recorded by the stand-in.
RECORDED_ENV = (
    "CUDA_DEVICE_MAX_CONNECTIONS",
    "TORCH_NCCL_AVOID_RECORD_STREAMS",
    "NCCL_NVLS_ENABLE",
)


def stand_ins(tmp_path: Path, srun_body: str = "", job: str = "") -> tuple[Path, Path, Path]:
    """(bin dir, srun record, scontrol record): ``srun`` writes its arguments and the
    environment it inherited, then runs ``srun_body``; ``scontrol show hostnames`` names one
    host, ``scontrol show job`` prints ``job`` (Slurm's ``Field=value`` form)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    record, control = tmp_path / "srun.txt", tmp_path / "scontrol.txt"
    (bin_dir / "srun").write_text(
        "#!/bin/bash\n"
        f'printf "%s\\n" "$@" > {record}\n'
        + "".join(f'echo "{v}=${{{v}:-unset}}" >> {record}\n' for v in RECORDED_ENV)
        + srun_body
    )
    (bin_dir / "scontrol").write_text(
        f'#!/bin/bash\necho "$@" >> {control}\n'
        "if [[ $1 == show && $2 == job ]]; then\n"
        f"  printf '%s\\n' '{job}'\n"
        "elif [[ $1 == show ]]; then echo node1; fi\n"
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
    tail = lines[lines.index("megatron_hsp.launch") + 1 : -len(RECORDED_ENV)]
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


@pytest.mark.parametrize(
    ("flags", "delivered"),
    [
        (["--exit-signal-handler", "--exit-signal=SIGUSR2"], "USR2"),  # the = form
        (["--exit-signal-handler", "--exit-signal", "USR2"], "USR2"),
        (["--exit-signal-handler"], "TERM"),  # Megatron's default exit signal
        (["--exit-signal", "SIGUSR2"], "USR1"),  # no handler: SIGUSR1 and the handler added
    ],
)
def test_the_signal_the_ranks_handle_is_the_one_delivered(tmp_path, flags, delivered):
    """Issue 32: ``--exit-signal=SIGUSR2`` was read as TERM."""
    bin_dir, record, _ = stand_ins(tmp_path)
    run = run_sbatch(slurm_env(bin_dir, tmp_path), "pretrain_gpt.py", *flags)
    assert run.returncode == 0, run.stderr
    lines = record.read_text().splitlines()
    assert lines[lines.index(str(NODE_SCRIPT)) + 1] == delivered
    if "--exit-signal-handler" in flags:
        assert f"the ranks checkpoint on SIG{delivered}" in run.stdout
    else:
        end = len(lines) - len(RECORDED_ENV)
        assert lines[end - 2 : end] == ["--exit-signal", "SIGUSR1"]


@pytest.mark.parametrize(
    ("value", "named"), [("SIGINT", "status request"), ("=SIGHUP", "SIGHUP is not one of")]
)
def test_an_exit_signal_srun_cannot_deliver_is_refused_in_one_line(tmp_path, value, named):
    bin_dir, record, _ = stand_ins(tmp_path)
    flag = ["--exit-signal" + value] if value.startswith("=") else ["--exit-signal", value]
    run = run_sbatch(slurm_env(bin_dir, tmp_path), "p.py", "--exit-signal-handler", *flag)
    assert run.returncode == 2 and not record.exists()
    assert run.stderr.count("\n") == 1 and named in run.stderr, run.stderr


@pytest.mark.parametrize(
    ("variables", "cpus", "warned"),
    [
        ({"SLURM_CPUS_ON_NODE": "64"}, "64", False),  # sbatch without --cpus-per-task
        ({"SLURM_CPUS_ON_NODE": "64", "SLURM_CPUS_PER_TASK": "16"}, "16", False),
        ({"SLURM_CPUS_ON_NODE": "1"}, "1", True),
        ({}, "1", True),
    ],
)
def test_cpus_per_task_comes_from_slurms_variables(tmp_path, variables, cpus, warned):
    """Issue 32: without sbatch --cpus-per-task, srun got --cpus-per-task=1 for 8 ranks."""
    bin_dir, record, _ = stand_ins(tmp_path)
    env = slurm_env(bin_dir, tmp_path, SLURM_GPUS_ON_NODE="8", **variables)
    env.pop("SLURM_CPUS_PER_TASK", None)
    env.update(variables)
    run = run_sbatch(env, "pretrain_gpt.py")
    assert run.returncode == 0, run.stderr
    assert f"--cpus-per-task={cpus}" in record.read_text().splitlines()
    assert ("warning: srun --cpus-per-task=1 for 8 ranks per node" in run.stderr) == warned


def test_many_hostnames_do_not_end_the_script_with_sigpipe(tmp_path):
    """``scontrol show hostnames | head -n 1`` under pipefail: scontrol's SIGPIPE (141) used to
    end the script with no message."""
    bin_dir, record, _ = stand_ins(tmp_path)
    (bin_dir / "scontrol").write_text(
        '#!/bin/bash\nfor ((i = 1; i <= 200000; i++)); do echo "node$i"; done\n'
    )
    run = run_sbatch(slurm_env(bin_dir, tmp_path), "pretrain_gpt.py")
    assert run.returncode == 0, (run.returncode, run.stderr)
    lines = record.read_text().splitlines()
    assert lines[lines.index("--rdzv-endpoint") + 1].startswith("node1:")


def test_a_failing_scontrol_is_named(tmp_path):
    bin_dir, record, _ = stand_ins(tmp_path)
    (bin_dir / "scontrol").write_text("#!/bin/bash\necho 'slurm_load_ctl_conf error' >&2\nexit 1\n")
    run = run_sbatch(slurm_env(bin_dir, tmp_path), "pretrain_gpt.py")
    assert run.returncode == 1 and not record.exists()
    assert "'scontrol show hostnames" in run.stderr and "failed" in run.stderr


def test_failed_ranks_are_named(tmp_path):
    bin_dir, _, _ = stand_ins(tmp_path, "exit 3\n")
    run = run_sbatch(slurm_env(bin_dir, tmp_path), "pretrain_gpt.py")
    assert run.returncode == 3
    assert "the ranks failed (status 3)" in run.stderr


def signal_when_ready(
    cmd: list[str], ready: list[Path], sig: int, timeout: float, **popen: object
) -> tuple[int, str, str]:
    """Start ``cmd`` in its own session, wait for every ``ready`` file, send ``sig`` and wait
    for the exit: (status, stdout, stderr). Whatever is left is killed."""
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        **popen,  # type: ignore[arg-type]
    )
    try:
        for path in ready:
            _wait_for(path, timeout=240)
        os.kill(proc.pid, sig)
        out, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return proc.returncode, out, err


def _stop_sbatch(
    tmp_path: Path, argv: list[str], on_usr1: str, sig: int = signal.SIGUSR1, **extra: str
):
    """The sbatch script until the stand-in srun (which runs ``on_usr1`` when the script
    passes it SIGUSR1) has started, then ``sig`` to the script (SIGUSR1: Slurm's
    --signal=B:USR1@300): (status, stdout, stderr, scontrol record)."""
    started = tmp_path / "srun-started"
    body = f"trap '{on_usr1}' USR1\ntouch {started}\nwhile true; do sleep 0.1; done\n"
    bin_dir, _, control = stand_ins(tmp_path, body)
    env = slurm_env(bin_dir, tmp_path, **extra)
    status, out, err = signal_when_ready(["bash", str(SCRIPT), *argv], [started], sig, 120, env=env)
    return status, out, err, control.read_text() if control.exists() else ""


@pytest.mark.parametrize("save", [True, False])
def test_no_requeue_without_a_completed_checkpoint(tmp_path, save):
    """Issue 32: the ranks stopped without saving (killed mid-checkpoint, or no --save) and the
    job printed 'requeueing' and requeued, losing the work since the last checkpoint."""
    ck = tmp_path / "ck"
    ck.mkdir()
    (ck / "latest_checkpointed_iteration.txt").write_text("5")  # an older checkpoint
    argv = ["pretrain_gpt.py", *(["--save", str(ck)] if save else [])]
    status, out, err, control = _stop_sbatch(tmp_path, argv, "exit 1")  # saves nothing
    assert status == 1, (out, err)
    assert "requeue" not in control and "requeueing" not in out
    if save:
        assert f"no checkpoint completed in {ck} after SIGUSR1 (latest: iteration 5)" in err
    else:
        assert "without a checkpoint (no --save); not requeued" in err


def _wait_for(path: Path, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.1)


def test_time_limit_signal_checkpoints_through_srun_and_requeues(tmp_path):
    """Slurm's --signal=B:USR1@300 (or preemption's SIGTERM) reaches the batch shell: it passes
    the checkpoint signal to srun (which forwards it to every node's hsp_node.sh), waits for the
    ranks to finish their checkpoint, and requeues the job."""
    ck = tmp_path / "ck"
    save = f"mkdir -p {ck}; echo 12 > {ck}/latest_checkpointed_iteration.txt"
    on_usr1 = f"echo got-USR1 >> {tmp_path / 'srun-signals.txt'}; {save}; exit 0"
    argv = ["pretrain_gpt.py", "--save", str(ck), "--hsp"]
    status, out, err, control = _stop_sbatch(tmp_path, argv, on_usr1)
    assert status == 0, err
    assert (tmp_path / "srun-signals.txt").read_text().split() == ["got-USR1"]
    assert "requeue 7" in control.splitlines()
    assert "SIGUSR1" in out and "requeueing job 7" in out
    assert f"checkpoint completed (iteration 12 in {ck})" in out  # says which


def test_without_requeue_the_job_just_stops(tmp_path):
    ck = tmp_path / "ck"
    save = f"mkdir -p {ck}; echo 3 > {ck}/latest_checkpointed_iteration.txt"
    argv = ["pretrain_gpt.py", "--save", str(ck), "--hsp"]
    # SIGTERM: preemption without --signal
    _, out, _, control = _stop_sbatch(
        tmp_path, argv, f"{save}; exit 0", signal.SIGTERM, HSP_REQUEUE="0"
    )
    assert "requeue" not in control
    assert "not requeued (HSP_REQUEUE=0)" in out and "iteration 3" in out


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
    ready = [tmp_path / f"ready-{rank}" for rank in (0, 1)]
    cmd = ["bash", str(NODE_SCRIPT), "USR1", "--", *torchrun, *ranks]
    status, _, err = signal_when_ready(cmd, ready, signal.SIGUSR1, 60)
    assert status == 0, err[-2000:]
    for rank in (0, 1):
        assert (tmp_path / f"checkpoint-{rank}").read_text() == "saved"
    assert "asking the ranks to checkpoint" in err


# A rank standing in for Megatron's: --exit-signal-handler's handler for SIGTERM (Megatron's
# default exit signal), then a checkpoint that takes CHECKPOINT_S; rank 0 writes the tracker
# file last, as Megatron does. Run through the real launcher and torchrun.
SLOW_RANK = """
import os, pathlib, signal, sys, time

save = pathlib.Path(sys.argv[sys.argv.index("--save") + 1])
rank = os.environ["RANK"]
got = []
signal.signal(signal.SIGTERM, lambda *a: got.append(1))
(save.parent / f"ready-{rank}").touch()
deadline = time.monotonic() + 300
while not got and time.monotonic() < deadline:
    time.sleep(0.05)
if got:
    time.sleep(float(os.environ["CHECKPOINT_S"]))
    (save.parent / f"saved-{rank}").touch()
    if rank == "0":
        save.mkdir(exist_ok=True)
        (save / "latest_checkpointed_iteration.txt").write_text("40")
"""
# torchrun SIGKILLs its workers 30 s after it forwards a stop signal (torch.distributed.elastic
# PContext.close); Megatron checkpoints of large models take longer.
CHECKPOINT_S = 45


@pytest.mark.slow
def test_a_45s_checkpoint_on_megatrons_default_sigterm_completes_and_requeues(tmp_path):
    """The user's --exit-signal-handler without --exit-signal (SIGTERM): the sbatch script, a
    stand-in srun that forwards signals to its task as srun does, the real hsp_node.sh,
    torchrun and the launcher, two ranks whose checkpoint takes 45 s, longer than torchrun's
    30 s kill grace. Before issue 32 torchrun got the SIGTERM, killed the ranks 30 s later,
    and the job printed 'requeueing' anyway."""
    (tmp_path / "rank.py").write_text(SLOW_RANK)
    ck = tmp_path / "ck"
    srun = (
        "#!/bin/bash\nwhile [[ $1 == --* ]]; do shift; done\n"  # srun's options
        '"$@" &\nchild=$!\n'
        'for s in TERM USR1 USR2; do trap "kill -$s $child" $s; done\n'
        "while kill -0 $child 2>/dev/null; do wait $child; done\n"
        "wait $child\n"
    )
    bin_dir, _, control = stand_ins(tmp_path)
    (bin_dir / "srun").write_text(srun)
    (bin_dir / "scontrol").write_text(
        f'#!/bin/bash\necho "$@" >> {control}\nif [[ $1 == show ]]; then echo localhost; fi\n'
    )
    env = slurm_env(
        bin_dir,
        tmp_path,
        SLURM_JOB_NUM_NODES="1",
        HSP_NPROC_PER_NODE="2",
        HSP_PYTHON=sys.executable,
        MASTER_PORT=str(20000 + os.getpid() % 20000),
        CHECKPOINT_S=str(CHECKPOINT_S),
        PYTHONPATH=str(ROOT),
        OMP_NUM_THREADS="1",
    )
    argv = [str(tmp_path / "rank.py"), "--save", str(ck), "--exit-signal-handler"]
    ready = [tmp_path / f"ready-{rank}" for rank in (0, 1)]
    # SIGUSR1: Slurm's --signal=B:USR1@300
    status, out, err = signal_when_ready(
        ["bash", str(SCRIPT), *argv],
        ready,
        signal.SIGUSR1,
        CHECKPOINT_S + 90,
        env=env,
        cwd=tmp_path,
    )
    logs = (
        "".join(p.read_text() for p in (tmp_path / "logs").glob("*"))
        if (tmp_path / "logs").exists()
        else ""
    )
    assert status == 0, (out, err, logs[-3000:])
    assert all((tmp_path / f"saved-{rank}").exists() for rank in (0, 1)), (out, err)
    assert "the ranks checkpoint on SIGTERM" in out
    assert f"checkpoint completed (iteration 40 in {ck})" in out and "requeueing job 7" in out
    assert "requeue 7" in control.read_text().splitlines()


# Issue 42: a real cluster's srun options, NCCL settings, exclusive nodes, and the checkpoint
# lead time tied to Megatron's --exit-duration-in-mins.


def test_srun_options_from_hsp_srun_args_follow_the_scripts_own(tmp_path):
    """pyxis' container image and mounts and --mpi=pmix, as Megatron-LM's and Megatron-Bridge's
    sbatch examples pass them, without editing the script; after the script's own options (a
    later option wins), before the node script."""
    bin_dir, record, _ = stand_ins(tmp_path)
    extra = [
        "--container-image=nvcr.io#nvidia/pytorch:25.01-py3",
        "--container-mounts=/data:/data,/ckpt:/ckpt",
        "--mpi=pmix",
    ]
    env = slurm_env(bin_dir, tmp_path, HSP_SRUN_ARGS=" ".join(extra))
    run = run_sbatch(env, "pretrain_gpt.py", "--hsp")
    assert run.returncode == 0, run.stderr
    lines = record.read_text().splitlines()
    at = lines.index(str(NODE_SCRIPT))
    assert lines[at - 3 : at] == extra
    assert lines.index("--cpus-per-task=12") < at - 3
    assert "srun options from HSP_SRUN_ARGS: " + " ".join(extra) in run.stdout


def test_without_hsp_srun_args_srun_gets_only_the_scripts_options(tmp_path):
    bin_dir, record, _ = stand_ins(tmp_path)
    run = run_sbatch(slurm_env(bin_dir, tmp_path), "pretrain_gpt.py")
    lines = record.read_text().splitlines()
    assert run.returncode == 0 and lines[: lines.index(str(NODE_SCRIPT))] == [
        "--ntasks-per-node=1",
        "--cpus-per-task=12",
        "--kill-on-bad-exit=1",
        "--open-mode=append",
        f"--output={tmp_path / 'logs'}/node-%N.out",
        f"--error={tmp_path / 'logs'}/node-%N.err",
    ]


@pytest.mark.parametrize(
    ("user", "expected"),
    [
        ({}, {"TORCH_NCCL_AVOID_RECORD_STREAMS": "1", "NCCL_NVLS_ENABLE": "0"}),
        (
            {"TORCH_NCCL_AVOID_RECORD_STREAMS": "0", "NCCL_NVLS_ENABLE": "1"},
            {"TORCH_NCCL_AVOID_RECORD_STREAMS": "0", "NCCL_NVLS_ENABLE": "1"},
        ),
    ],
)
def test_nccl_defaults_reach_the_ranks_and_a_users_value_wins(tmp_path, user, expected):
    bin_dir, record, _ = stand_ins(tmp_path)
    run = run_sbatch(slurm_env(bin_dir, tmp_path, **user), "pretrain_gpt.py")
    assert run.returncode == 0, run.stderr
    lines = record.read_text().splitlines()
    for name, value in expected.items():
        assert f"{name}={value}" in lines


JOB = "JobId=7 JobName=megatron-hsp RunTime=00:10:00 TimeLimit=04:00:00 OverSubscribe={shared}"


@pytest.mark.parametrize(("shared", "said"), [("OK", True), ("NO", False)])
def test_shared_nodes_are_said_with_what_keeps_them_to_the_job(tmp_path, shared, said):
    bin_dir, _, _ = stand_ins(tmp_path, job=JOB.format(shared=shared))
    run = run_sbatch(slurm_env(bin_dir, tmp_path), "pretrain_gpt.py")
    assert run.returncode == 0, run.stderr
    assert ("sbatch --exclusive keeps the nodes to this job" in run.stdout) is said


@pytest.mark.parametrize(
    ("minutes", "said", "stream"),
    [
        # 3 h 50 min left: 220 min ends 600 s before the limit, 300 s before the signal.
        ("220", "checkpoint and exit 600 s before the time limit (13800 s left)", "stdout"),
        ("--exit-duration-in-mins=225", "exit 300 s before the time limit", "stdout"),
        ("229", "use --exit-duration-in-mins 225 or less", "stderr"),
    ],
)
def test_exit_duration_is_compared_with_the_jobs_time_left(tmp_path, minutes, said, stream):
    """Megatron's examples tie the checkpoint to --exit-duration-in-mins; the script reads the
    job's time limit and time used (scontrol show job) and says which stop comes first."""
    bin_dir, _, _ = stand_ins(tmp_path, job=JOB.format(shared="NO"))
    flag = [minutes] if minutes.startswith("--") else ["--exit-duration-in-mins", minutes]
    run = run_sbatch(slurm_env(bin_dir, tmp_path), "pretrain_gpt.py", *flag)
    assert run.returncode == 0, run.stderr
    assert said in getattr(run, stream), (run.stdout, run.stderr)


def test_a_bad_exit_duration_is_refused_in_one_line(tmp_path):
    bin_dir, record, _ = stand_ins(tmp_path)
    run = run_sbatch(
        slurm_env(bin_dir, tmp_path), "pretrain_gpt.py", "--exit-duration-in-mins", "2h"
    )
    assert run.returncode == 2 and not record.exists()
    assert run.stderr.strip().splitlines() == [
        "megatron-hsp: error: --exit-duration-in-mins 2h is not a whole number of minutes "
        "(Megatron's flag is an integer)"
    ]


@pytest.mark.parametrize(("iteration", "requeued"), [("12", True), ("100", False)])
def test_megatrons_own_stop_after_exit_duration_requeues_until_training_is_done(
    tmp_path, iteration, requeued
):
    """The ranks save and exit 0 by themselves after --exit-duration-in-mins: before issue 42
    the script said "the ranks finished" and never requeued. At --train-iters the training is
    done, and the job ends."""
    ck = tmp_path / "ck"
    ck.mkdir()
    (ck / "latest_checkpointed_iteration.txt").write_text("4")  # the checkpoint it resumed from
    save = f"sleep 1; echo {iteration} > {ck}/latest_checkpointed_iteration.txt; exit 0\n"
    bin_dir, _, control = stand_ins(tmp_path, save, job=JOB.format(shared="NO"))
    argv = ["pretrain_gpt.py", "--save", str(ck), "--train-iters", "100"]
    run = run_sbatch(slurm_env(bin_dir, tmp_path), *argv, "--exit-duration-in-mins", "200")
    assert run.returncode == 0, run.stderr
    requeue = "requeue 7" in control.read_text().splitlines()
    assert requeue is requeued, (run.stdout, run.stderr)
    if requeued:
        assert (
            f"checkpoint completed (iteration 12 in {ck}), ranks stopped (status 0) after "
            "--exit-duration-in-mins 200; requeueing job 7"
        ) in run.stdout
    else:
        assert "the ranks finished (status 0)" in run.stdout


def test_without_exit_duration_a_clean_exit_is_finished(tmp_path):
    ck = tmp_path / "ck"
    save = f"mkdir -p {ck}; echo 12 > {ck}/latest_checkpointed_iteration.txt; exit 0\n"
    bin_dir, _, control = stand_ins(tmp_path, save)
    run = run_sbatch(slurm_env(bin_dir, tmp_path), "pretrain_gpt.py", "--save", str(ck))
    assert run.returncode == 0 and "the ranks finished (status 0)" in run.stdout
    assert "requeue" not in control.read_text()


def test_a_refused_flag_is_named_in_the_jobs_summary(tmp_path):
    """Every rank refuses a flag at argument time (one line from rank 0, exit 2) and torchrun
    exits 1 after its own failure summary: the job's summary names the refusal, not only the
    status."""
    line = "megatron-hsp: error: --hsp does not support --eod-mask-loss: ...; drop --eod-mask-loss"
    logs = tmp_path / "logs"
    err = logs / "node-node1.err"
    body = f"echo '{line}' >> {err}\necho 'ChildFailedError' >> {err}\nexit 1\n"
    bin_dir, _, _ = stand_ins(tmp_path, body)
    run = run_sbatch(slurm_env(bin_dir, tmp_path), "pretrain_gpt.py", "--eod-mask-loss", "--hsp")
    assert run.returncode == 1
    assert run.stderr.strip().splitlines()[-2:] == [
        f"megatron-hsp: the ranks failed (status 1); see {logs}/node-<host>.err",
        line,
    ]
