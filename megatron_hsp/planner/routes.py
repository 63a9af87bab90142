"""Attention routes: which kernel family runs a group's attention, in a form the planner reads.

A group's attention takes one of three routes at run time, and the cost model prices each by its
own coefficient (``CostModel.attn_route_factor``; docs/costmodel.md, "Per-route attention
coefficients"):

- ``ulysses``: a group without ring degree (``HeadSpace.split`` gives ring 1): the all-to-all,
  then the local varlen kernel (torch's flash varlen or TE's THD attention);
- ``ring-fused``: a ring or hybrid group whose ring a fused kernel runs: Transformer Engine's own
  context parallelism (``TEAttentionBackend.context_parallel``), or a fused flash ring;
- ``ring-tiled``: a ring or hybrid group that falls back to HSP's tiled fp32 torch ring
  (``runtime/ring.py``): the exact reference, far slower than a fused kernel on a GPU.

Which ring route a group takes is the runtime's backend rule, stated here once and torch-free so
both sides read the same rule: ``runtime/backends.py`` asks ``te_carries_ring`` before it hands a
group to TE, and builds the planner's ``{group size: route}`` map with ``ring_routes``
(``attention_routes_for_run``), which ``load_cost_model(..., ring_routes=...)`` puts into the
cost model.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from megatron_hsp.planner.errors import InputError

ULYSSES = "ulysses"
RING_FUSED = "ring-fused"
RING_TILED = "ring-tiled"
ROUTES = (ULYSSES, RING_FUSED, RING_TILED)
RING_ROUTES = (RING_FUSED, RING_TILED)

# The first Transformer Engine whose THD context parallelism accepts cp_comm_type "a2a+p2p":
# through v2.18 ``attn_forward_func_with_cp`` asserts ``qkv_format != "thd"`` for it; 2.19
# removed the assertion. Read from TE's own sources by tests/runtime/test_te_sources.py.
TE_MIN_A2A_P2P_THD = (2, 19)


def te_version_runs_a2a_p2p_thd(version: str) -> bool:
    """Whether Transformer Engine ``version`` runs THD attention with ``cp_comm_type="a2a+p2p"``
    (hybrid Ulysses x ring groups): from ``TE_MIN_A2A_P2P_THD`` on."""
    parts = [int(x) for x in re.findall(r"\d+", version)[:2]]
    return tuple(parts + [0] * (2 - len(parts))) >= TE_MIN_A2A_P2P_THD


def te_carries_ring(ulysses: int, te_runs_a2a_p2p_thd: bool) -> bool:
    """Whether TE's context-parallel route can carry a ring group whose Ulysses degree is
    ``ulysses``: a pure ring ("p2p") on every supported TE, a hybrid ("a2a+p2p") only where the
    installed TE runs it in THD (``te_version_runs_a2a_p2p_thd``)."""
    return ulysses == 1 or te_runs_a2a_p2p_thd


def te_doc_multiple(size: int, ulysses: int, ring: int, te_runs_a2a_p2p_thd: bool) -> int:
    """What each document of a group of ``size`` run as ``ulysses x ring`` is padded to when
    Transformer Engine's backend runs it: ``2 x size`` where TE's THD context parallelism carries
    the group (``te_carries_ring``: its CP rank ``c`` holds chunks ``c`` and ``2cp - 1 - c`` of
    every sequence), 1 elsewhere -- Ulysses-only groups (TE's plain varlen attention after HSP's
    all-to-all) and rings TE declines (HSP's own ring, which needs no padding). The one rule
    dispatch pads by and the cost model prices by."""
    if ring <= 1 or not te_carries_ring(ulysses, te_runs_a2a_p2p_thd):
        return 1
    return 2 * size


def te_doc_multiples(
    splits: Mapping[int, tuple[int, int]], *, te_version: str | None
) -> dict[int, int]:
    """``{group size: document multiple}`` of the sizes TE pads (``te_doc_multiple`` above 1)
    for the installed TE ``te_version`` (None: TE does not run the attention, nothing padded):
    what the cost model prices (``load_cost_model(doc_multiples=...)``)."""
    if te_version is None:
        return {}
    hybrid = te_version_runs_a2a_p2p_thd(te_version)
    out = {int(d): te_doc_multiple(int(d), u, r, hybrid) for d, (u, r) in splits.items()}
    return {d: m for d, m in out.items() if m > 1}


def attention_route(
    ulysses: int, ring: int, *, te_version: str | None, fused_ring: bool = False
) -> str:
    """The route a group split ``ulysses x ring`` takes at run time.

    ``te_version``: the Transformer Engine the attention backend runs (None: the torch backend,
    or no TE); ``fused_ring``: whether HSP's own ring runs a fused block kernel on this device
    (False: the tiled torch kernel).
    """
    if ring <= 1:
        return ULYSSES
    if te_version is not None and te_carries_ring(ulysses, te_version_runs_a2a_p2p_thd(te_version)):
        return RING_FUSED
    return RING_FUSED if fused_ring else RING_TILED


def ring_routes(
    splits: Mapping[int, tuple[int, int]], *, te_version: str | None, fused_ring: bool = False
) -> dict[int, str]:
    """``{group size: route}`` for the sizes whose split (``{size: (ulysses, ring)}``) has a
    ring: what the cost model's ``ring_route`` holds (``load_cost_model(ring_routes=...)``)."""
    return {
        int(d): attention_route(u, r, te_version=te_version, fused_ring=fused_ring)
        for d, (u, r) in splits.items()
        if r > 1
    }


def check_routes(routes: Mapping[int, str], where: str) -> dict[int, str]:
    """``{size: route}`` with every route a ring route; an InputError naming ``where`` else."""
    out: dict[int, str] = {}
    for d, route in routes.items():
        if isinstance(d, bool) or not str(d).isdigit():
            raise InputError(f"{where}: key {d!r} must be a group size (integer >= 2, or 0 = all)")
        if route not in RING_ROUTES:
            raise InputError(
                f"{where}[{d}] = {route!r}: a ring or hybrid group's route is one of {RING_ROUTES}"
            )
        out[int(d)] = str(route)
    return out


__all__ = [
    "RING_FUSED",
    "RING_ROUTES",
    "RING_TILED",
    "ROUTES",
    "TE_MIN_A2A_P2P_THD",
    "ULYSSES",
    "attention_route",
    "check_routes",
    "ring_routes",
    "te_carries_ring",
    "te_doc_multiple",
    "te_doc_multiples",
    "te_version_runs_a2a_p2p_thd",
]
