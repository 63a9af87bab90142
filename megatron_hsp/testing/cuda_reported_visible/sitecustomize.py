"""Test-only: make every Python process started with this folder on ``PYTHONPATH`` believe CUDA
is visible, as on a GPU node, unless ``CUDA_VISIBLE_DEVICES`` is empty (what hides CUDA there).

Used by ``testing/fake_cuda.py`` (``cuda_reported_visible_env``) so that a CI machine without a
GPU runs the kit's whole path -- torchrun's launcher, its ranks and any child process they
start -- with ``torch.cuda.is_available()`` answering as a GPU node's would. Nothing else about
CUDA is faked: any real CUDA call still fails, so a CPU path that touches CUDA fails loudly.
"""

import os

if os.environ.get("CUDA_VISIBLE_DEVICES", None) != "":
    import torch

    _COUNT = int(os.environ.get("HSP_FAKE_CUDA_DEVICE_COUNT", "8"))
    torch.cuda.is_available = lambda: True
    torch.cuda.device_count = lambda: _COUNT
