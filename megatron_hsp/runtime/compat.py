"""What the installed torch offers, detected once: the one place version differences live.

Supported range: torch 2.11 (the CUDA images users are likely to have) through 2.15 and
megatron-core 0.18 through 0.20, as ``pyproject.toml``'s ``runtime`` extra declares (CI runs the
runtime tests on both ends, ``make test`` and ``make test-oldest-torch``; ``untested_versions``
reads the range from the installed metadata and names a version outside it). Features are
detected from the installed library, never assumed from a version number:

* ``torch.nn.attention.varlen.varlen_attn`` (torch >= 2.10): flash varlen attention on CUDA.
* its ``enable_gqa`` keyword: absent in 2.11 (where query and key must have the same head count,
  per its docstring), present in 2.14 (which raises on unequal head counts without it). Without
  it KV heads are repeated before the call, as the per-document path does.
* its ``return_aux`` keyword (log-sum-exp output), which ring attention needs from a flash kernel.
* ``torch.distributed.split_group(parent_pg, split_ranks, timeout, pg_options, group_desc)``:
  one ``ncclCommSplit`` creates every group of a family. Present with these arguments at both
  ends of the range; it splits NCCL only (gloo and CPU-only hosts raise), hence
  ``can_split_groups``.
"""

from __future__ import annotations

import functools
import importlib.metadata
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

RANGE_CHECKED = ("torch", "megatron-core")


def _installed_version(name: str) -> str | None:
    """The version of ``name`` that this process runs: the imported module's own version string
    (``torch.__version__``, ``megatron.core.package_info.__version__``), not the installed
    distribution's metadata. Why: with a Megatron-LM checkout on PYTHONPATH the checkout's
    megatron-core runs (e.g. main's 0.20.0+d98e8a64dd) while the wheel's metadata still says
    0.18.2, and a check or report must name what runs. The metadata is the fallback where the
    module cannot be imported."""
    if name == "torch":
        return str(torch.__version__)
    if name == "megatron-core":
        version = _megatron_core_version()
        if version is not None:
            return version
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _megatron_core_version() -> str | None:
    """The importable megatron-core's version, read without importing ``megatron.core``: its
    ``__init__`` imports torch, Transformer Engine probes and optimizer fallbacks (seconds, and
    warnings on stderr), which every command's start-up check must not pay. An already imported
    ``package_info`` is used as it is (it adds a checkout's git hash); else the release fields
    of the ``package_info.py`` that ``import megatron.core`` would load."""
    import re
    import sys

    loaded = sys.modules.get("megatron.core.package_info")
    if loaded is not None:
        return str(getattr(loaded, "__version__", "")) or None
    try:
        import importlib.util

        spec = importlib.util.find_spec("megatron.core")  # imports the namespace "megatron" only
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        info = Path(folder) / "package_info.py"
        try:
            text = info.read_text()
        except OSError:
            continue
        fields = {
            k: m.group(1)
            for k in ("MAJOR", "MINOR", "PATCH", "PRE_RELEASE")
            if (m := re.search(rf"^{k}\s*=\s*['\"]?([^'\"\n]*)['\"]?\s*$", text, re.M))
        }
        if {"MAJOR", "MINOR", "PATCH"} <= fields.keys():
            base = ".".join(fields[k].strip() for k in ("MAJOR", "MINOR", "PATCH"))
            return base + fields.get("PRE_RELEASE", "").strip()
    return None


def running_versions() -> str:
    """One line naming the torch and megatron-core this process runs and where each was imported
    from (selftest's report; a checkout on PYTHONPATH shows its own path and version)."""
    import importlib.util

    parts = []
    for name, module in (("torch", "torch"), ("megatron-core", "megatron.core")):
        version = _installed_version(name) or "not importable"
        try:
            spec = importlib.util.find_spec(module)
        except (ImportError, ValueError):
            spec = None
        where = ""
        if spec is not None and spec.origin:
            where = f" ({Path(spec.origin).parent})"
        parts.append(f"{name} {version}{where}")
    return ", ".join(parts)


def untested_versions(
    requirements: list[str] | None = None, installed: dict[str, str | None] | None = None
) -> str | None:
    """One line naming torch / megatron-core versions outside the tested range, or None.

    The range is the ``runtime`` extra of the installed megatron-hsp (``pyproject.toml``), the
    one place it is written; without that metadata (a source tree on PYTHONPATH) nothing is
    checked. A run on an untested version goes on: containers pin their own torch and
    megatron-core, and most releases work; the line says what CI did not run.
    """
    try:
        from packaging.requirements import Requirement
    except ImportError:  # packaging comes with torch and megatron-core; without it, no check
        return None
    if requirements is None:
        try:
            requirements = importlib.metadata.requires("megatron-hsp") or []
        except importlib.metadata.PackageNotFoundError:
            return None
    outside = []
    for text in requirements:
        req = Requirement(text)
        if req.name not in RANGE_CHECKED or not req.specifier:
            continue
        if req.marker is not None and not req.marker.evaluate({"extra": "runtime"}):
            continue
        version = installed.get(req.name) if installed is not None else _installed_version(req.name)
        if version is None:
            continue
        if not req.specifier.contains(version, prereleases=True):
            outside.append(f"{req.name} {version} (tested: {req.specifier})")
    if not outside:
        return None
    return (
        f"megatron-hsp: warning: untested {', '.join(outside)}; going on "
        "(pyproject.toml's runtime extra is the range CI runs)"
    )


@dataclass(frozen=True)
class TorchFeatures:
    version: str
    varlen_attn: bool
    varlen_enable_gqa: bool
    varlen_return_aux: bool


def _varlen_function() -> Callable | None:
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


@functools.cache
def torch_features() -> TorchFeatures:
    fn = _varlen_function()
    params = inspect.signature(fn).parameters if fn is not None else {}
    return TorchFeatures(
        version=torch.__version__,
        varlen_attn=fn is not None,
        varlen_enable_gqa="enable_gqa" in params,
        varlen_return_aux="return_aux" in params,
    )


def varlen_causal(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    scale: float,
    *,
    features: TorchFeatures | None = None,
    fn: Callable | None = None,
) -> torch.Tensor:
    """Causal varlen attention over a packed buffer through torch's ``varlen_attn``.

    q: [T, hq, D], k/v: [T, hk, D] with hq % hk == 0; ``cu_seqlens`` int32 on q's device. GQA is
    passed as ``enable_gqa`` where the installed torch has it, else KV heads are repeated
    (query head j uses KV head j // (hq/hk), megatron's grouping). ``features``/``fn`` default to
    the installed torch (tests pass others to check both call shapes).
    """
    features = features or torch_features()
    fn = fn or _varlen_function()
    if fn is None:
        raise RuntimeError(f"torch {torch.__version__} has no torch.nn.attention.varlen")
    kwargs = {}
    if k.size(1) != q.size(1):
        if features.varlen_enable_gqa:
            kwargs["enable_gqa"] = True
        else:
            rep = q.size(1) // k.size(1)
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
    return fn(
        q.contiguous(),
        k.contiguous(),
        v.contiguous(),
        cu_seqlens,
        cu_seqlens,
        max_seqlen,
        max_seqlen,
        scale=scale,
        window_size=(-1, 0),  # causal
        **kwargs,
    )


# The arguments of ``dist.split_group`` the runtime passes (``groups._create_family``).
SPLIT_GROUP_ARGS = ("parent_pg", "split_ranks", "timeout", "group_desc")


def can_split_groups(backend: str, bound_device: object, split_fn: Callable | None = None) -> bool:
    """Whether process groups can be made by ``dist.split_group`` (one call per family of
    disjoint groups) instead of one world-wide ``new_group`` per group.

    Needs a ``split_group`` taking ``SPLIT_GROUP_ARGS``, the NCCL backend (torch splits NCCL
    communicators only: gloo raises "does not support splitting") and a device bound to the
    default group (``split_group`` raises without one; ``groups.bind_world_device`` binds it).
    ``split_fn`` defaults to the installed torch's (tests pass others).
    """
    import torch.distributed as dist

    fn = split_fn if split_fn is not None else getattr(dist, "split_group", None)
    if fn is None or backend != "nccl" or bound_device is None:
        return False
    params = inspect.signature(fn).parameters
    return all(a in params for a in SPLIT_GROUP_ARGS)


__all__ = [
    "SPLIT_GROUP_ARGS",
    "TorchFeatures",
    "can_split_groups",
    "running_versions",
    "torch_features",
    "untested_versions",
    "varlen_causal",
]
