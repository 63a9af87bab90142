"""Test-only: run commands as on a GPU node without one (``torch.cuda.is_available()`` True in
every process started, including the children they start, unless they hide CUDA with
``CUDA_VISIBLE_DEVICES=""``). Catches code that only works where CUDA is absent (the
acceptance kit refused to build its CPU reference on every GPU node)."""

from __future__ import annotations

import os
from pathlib import Path

SHIM_DIR = Path(__file__).with_name("cuda_reported_visible")


def cuda_reported_visible_env(base: dict[str, str] | None = None, devices: int = 8) -> dict:
    """``base`` (default ``os.environ``) with the shim's folder first on ``PYTHONPATH``."""
    env = dict(os.environ if base is None else base)
    env.pop("CUDA_VISIBLE_DEVICES", None)
    path = env.get("PYTHONPATH")
    env["PYTHONPATH"] = str(SHIM_DIR) + (os.pathsep + path if path else "")
    env["HSP_FAKE_CUDA_DEVICE_COUNT"] = str(devices)
    return env
