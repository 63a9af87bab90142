"""scripts/slurm/hsp_pretrain.sbatch run under stand-in ``srun``/``scontrol`` (no Slurm in CI).

The stand-ins record how the script calls ``srun`` and the environment torchrun would inherit;
``local_cluster_test.sh`` proves the same script on a real single-node cluster (needs root).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "slurm" / "hsp_pretrain.sbatch"


@pytest.mark.skipif(shutil.which("bash") is None, reason="bash is not installed")
def test_srun_gets_cpus_per_task_and_megatron_env(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    record = tmp_path / "srun.txt"
    (bin_dir / "srun").write_text(
        "#!/bin/bash\n"
        f'printf "%s\\n" "$@" > {record}\n'
        f'echo "CUDA_DEVICE_MAX_CONNECTIONS=${{CUDA_DEVICE_MAX_CONNECTIONS:-unset}}" >> {record}\n'
    )
    (bin_dir / "scontrol").write_text("#!/bin/bash\necho node1\n")
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    env = {
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "SLURM_CPUS_PER_TASK": "12",
        "SLURM_GPUS_ON_NODE": "8",
        "SLURM_JOB_NUM_NODES": "2",
        "SLURM_JOB_ID": "7",
    }
    run = subprocess.run(
        ["bash", str(SCRIPT), "pretrain_gpt.py", "--hsp"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 0, run.stderr
    lines = record.read_text().splitlines()
    assert "--cpus-per-task=12" in lines
    assert "CUDA_DEVICE_MAX_CONNECTIONS=1" in lines
    assert lines[lines.index("--nproc-per-node") + 1] == "8"
    assert lines[-3:-1] == ["pretrain_gpt.py", "--hsp"]
