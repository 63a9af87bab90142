"""Thin Megatron-LM integration: flags, layer spec, data, launcher and the listed patches.

Importing this package imports neither torch nor Megatron-LM; ``install`` does, when called.
"""

from __future__ import annotations

from typing import Any

from megatron_hsp.megatron.config import validate_hsp_args
from megatron_hsp.megatron.flags import add_hsp_args, hsp_extra_args_provider

__all__ = ["add_hsp_args", "hsp_extra_args_provider", "install", "validate_hsp_args"]


def install(*args: Any, **kwargs: Any):
    """See ``megatron_hsp.megatron.installer.install``.

    The implementation lives in ``installer`` (not a submodule named ``install``): importing a
    submodule binds it as a package attribute, which would shadow this function.
    """
    from megatron_hsp.megatron.installer import install as _install

    return _install(*args, **kwargs)
