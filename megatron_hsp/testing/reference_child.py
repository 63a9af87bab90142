"""The selftest's reference computed in a process of its own, where CUDA is hidden.

Why a child process: the reference (``testing/reference.py``: stock megatron-core, fp32, the host
CPU) runs megatron's training path through ``cpu_shims.cpu_megatron_training``, which answers
megatron's ``torch.cuda`` requests with the CPU and is refused wherever CUDA is visible (it would
otherwise hide a real device from code that expects one). The acceptance kit's ranks run on GPU
nodes, where CUDA is visible to them by design; hiding it in-process is not possible once torch
has looked. So the kit starts this module with ``CUDA_VISIBLE_DEVICES=""``: the child sees a
CPU-only machine, computes ``selftest.compute_reference`` (the same function the CPU selftest's
ranks call) and hands back the weights, losses and gradients in a file.

``python -m megatron_hsp.testing.reference_child IN OUT``: IN a pickle of ``(cases, shape)``,
OUT where ``torch.save`` writes the reference.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from megatron_hsp.planner.paths import atomic_write

# Variables of the launcher (torchrun, Slurm) the child must not take as its own rendezvous.
_LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")  # fmt: skip


def reference_in_child(
    cases: list[Any], shape: Any, timeout_s: float = 600.0, bf16_noise: bool = False
) -> dict[str, Any]:
    """``selftest.compute_reference(cases, shape, bf16_noise)`` run in a child process with CUDA
    hidden.

    Raises RuntimeError with the child's output when it fails or runs past ``timeout_s``.
    """
    import torch

    env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_VARS}
    env["CUDA_VISIBLE_DEVICES"] = ""
    with tempfile.TemporaryDirectory(prefix="hsp_reference_") as tmp:
        src, dst = Path(tmp, "cases.pkl"), Path(tmp, "reference.pt")
        atomic_write(src, pickle.dumps((cases, shape, bf16_noise)))
        cmd = [sys.executable, "-m", "megatron_hsp.testing.reference_child", str(src), str(dst)]
        try:
            done = subprocess.run(
                cmd, env=env, capture_output=True, text=True, timeout=timeout_s, check=False
            )
        except subprocess.TimeoutExpired as exc:
            raise RuntimeError(
                f"the selftest reference (CUDA hidden) took over {timeout_s:.0f} s: "
                f"{(exc.stderr or '')[-2000:]}"
            ) from None
        if done.returncode != 0 or not dst.exists():
            raise RuntimeError(
                f"the selftest reference (a child process with CUDA_VISIBLE_DEVICES='') failed "
                f"with exit code {done.returncode}:\n{done.stderr[-4000:]}"
            )
        return torch.load(dst, weights_only=False)


def main(argv: list[str]) -> int:
    import torch

    from megatron_hsp.testing.dist import destroy_cpu_megatron, init_single_process_megatron
    from megatron_hsp.testing.selftest import compute_reference

    if torch.cuda.is_available():
        raise RuntimeError(
            "the reference child must run with CUDA hidden (CUDA_VISIBLE_DEVICES='')"
        )
    src, dst = argv
    cases, shape, bf16_noise = pickle.loads(Path(src).read_bytes())
    torch.set_num_threads(max(1, min(8, os.cpu_count() or 1)))
    init_single_process_megatron()
    try:
        reference = compute_reference(cases, shape, bf16_noise)
    finally:
        destroy_cpu_megatron()
    from megatron_hsp.planner.paths import atomic_open

    with atomic_open(dst, "wb") as fh:  # the parent never reads half a reference
        torch.save(reference, fh)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
