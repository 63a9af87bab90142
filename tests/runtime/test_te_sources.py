"""Transformer Engine checked against its own sources (issue 28), in CI, without importing TE.

The TE backend's three call sites -- ``DotProductAttention(...)``, ``set_context_parallel_group``
and the attention call, plain THD and context-parallel ("p2p", "a2a+p2p") -- run through the TE
argument capture (``testing/te_capture.py``). Every keyword and format captured is then looked up
in the Python sources of the supported TE releases (``runtime/backends.py`` ``TE_SUPPORTED``) and
of the releases either side of the THD a2a+p2p gate, parsed with ``ast``: a keyword the source's
signature lacks, a mask type or THD layout it does not list, a ``cp_comm_type`` it does not know,
or a format ``attn_forward_func_with_cp`` asserts away for the route we take, fails the test. The
gate itself (``te_thd_a2a_p2p_supported``) must equal what each release's source asserts.

Sources: ``make te-sources`` (``.ci/run`` runs it) unpacks the pure-Python ``transformer-engine``
wheels into ``.te-sources/<version>/`` (or ``HSP_TE_SOURCES``). Without them the test skips
locally and fails in CI (``HSP_REQUIRE_TE_SOURCES=1`` or ``CI`` set).
"""

from __future__ import annotations

import ast
import os
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch

from megatron_hsp.runtime.backends import (
    TE_MIN_A2A_P2P_THD,
    TE_SUPPORTED,
    te_thd_a2a_p2p_supported,
)

DPA = "transformer_engine/pytorch/attention/dot_product_attention/dot_product_attention.py"
CP = "transformer_engine/pytorch/attention/dot_product_attention/context_parallel.py"
CONSTANTS = "transformer_engine/pytorch/constants.py"
# Both ends of the supported range and the releases either side of the a2a+p2p THD gate (2.19):
# the Makefile's TE_VERSIONS fetches exactly these.
CHECKED = sorted({*TE_SUPPORTED, "2.18.0", "2.19.0"}, key=lambda v: tuple(map(int, v.split("."))))


def _root() -> Path:
    here = Path(__file__).resolve()
    return next(p for p in here.parents if (p / "pyproject.toml").exists())


def _source(version: str) -> Path:
    base = Path(os.environ.get("HSP_TE_SOURCES") or _root() / ".te-sources")
    tree = base / version
    if not (tree / DPA).exists():
        why = f"Transformer Engine {version}'s sources are not in {base}: run `make te-sources`"
        if os.environ.get("HSP_REQUIRE_TE_SOURCES") or os.environ.get("CI"):
            pytest.fail(why)
        pytest.skip(why)
    return tree


class _Group:
    """A process group's size and rank, all the TE backend asks of one before calling TE."""

    def __init__(self, size: int) -> None:
        self._size = size

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return 0


def _capture(version: str) -> list[tuple[str, int, dict[str, Any]]]:
    """Every call the TE backend makes into TE for a plain THD call and a context-parallel call
    per route (pure ring "p2p", Ulysses x ring "a2a+p2p"), with TE reporting ``version``."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_hsp.runtime.backends import TEAttentionBackend
    from megatron_hsp.testing import te_capture

    te_capture.install(version=version)
    try:
        config = TransformerConfig(
            num_layers=1, hidden_size=64, num_attention_heads=8, use_cpu_initialization=True
        )
        backend = TEAttentionBackend(config, layer_number=1, dropout=0.0)
        cu = [0, 8, 24, 32]  # every segment a multiple of 2 x 4 ranks: TE's CP layout
        q, kv = torch.randn(32, 8, 8), torch.randn(32, 2, 8)
        cu_t = torch.tensor(cu, dtype=torch.int32)
        backend(q, kv, kv, cu_t, 16, softmax_scale=0.35, dropout_p=0.0, cu_seqlens_host=cu)
        with mock.patch.object(torch.distributed, "get_global_rank", lambda g, i: i):
            for u, r in ((1, 2), (2, 2)):
                local = 32 // (u * r)
                backend.context_parallel(
                    q[:local],
                    kv[:local],
                    kv[:local],
                    cu_t,
                    _Group(u * r),
                    None if u == 1 else _Group(u),
                    _Group(r),
                    softmax_scale=0.35,
                    cu_seqlens_host=cu,
                )
        return list(te_capture.CALLS)
    finally:
        te_capture.uninstall()


def _function(tree: ast.AST, name: str, cls: str | None = None) -> ast.FunctionDef:
    scope: ast.AST = tree
    if cls is not None:
        scope = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == cls)
    for node in ast.walk(scope):
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return node
    raise AssertionError(f"{cls + '.' if cls else ''}{name} is not in the source")


def _accepts(fn: ast.FunctionDef, positional: int, keywords: set[str]) -> list[str]:
    """What of a call (``positional`` arguments after self, ``keywords``) ``fn`` refuses."""
    a = fn.args
    pos = [x.arg for x in a.posonlyargs + a.args][1:]  # drop self
    names = set(pos) | {x.arg for x in a.kwonlyargs}
    bad = []
    if positional > len(pos) and a.vararg is None:
        bad.append(f"{positional} positional arguments (it takes {len(pos)})")
    if a.kwarg is None:
        bad += sorted(k for k in keywords if k not in names or k in pos[:positional])
    return bad


def _tuple_constant(tree: ast.AST, name: str) -> set[str]:
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == name for t in node.targets
        ):
            return set(ast.literal_eval(node.value))
    raise AssertionError(f"{name} is not in the source")


def _is_compare(node: ast.AST, var: str, op: type, value: str) -> bool:
    return (
        isinstance(node, ast.Compare)
        and isinstance(node.left, ast.Name)
        and node.left.id == var
        and len(node.ops) == 1
        and isinstance(node.ops[0], op)
        and isinstance(node.comparators[0], ast.Constant)
        and node.comparators[0].value == value
    )


def _thd_asserted_away(cp_fn: ast.FunctionDef, comm: str) -> bool:
    """Whether ``attn_forward_func_with_cp`` asserts ``qkv_format != "thd"`` under
    ``if cp_comm_type == comm`` (or unconditionally)."""

    def forbids(stmts: list[ast.stmt]) -> bool:
        return any(
            isinstance(s, ast.Assert) and _is_compare(s.test, "qkv_format", ast.NotEq, "thd")
            for s in stmts
        )

    if forbids(cp_fn.body):
        return True
    return any(
        isinstance(n, ast.If)
        and _is_compare(n.test, "cp_comm_type", ast.Eq, comm)
        and forbids(n.body)
        for n in ast.walk(cp_fn)
    )


def _comm_types(cp_fn: ast.FunctionDef) -> set[str]:
    """Every ``cp_comm_type`` value ``attn_forward_func_with_cp`` compares with."""
    out: set[str] = set()
    for n in ast.walk(cp_fn):
        if isinstance(n, ast.Compare) and isinstance(n.left, ast.Name):
            if n.left.id != "cp_comm_type":
                continue
            for c in n.comparators:
                if isinstance(c, ast.Constant):
                    out.add(c.value)
                elif isinstance(c, ast.List | ast.Tuple | ast.Set):
                    out |= {e.value for e in c.elts if isinstance(e, ast.Constant)}
    return out


@pytest.mark.parametrize("version", CHECKED)
def test_every_keyword_and_format_we_pass_exists_in_te_source(version):
    tree = _source(version)
    dpa = ast.parse((tree / DPA).read_text())
    constants = ast.parse((tree / CONSTANTS).read_text())
    cp_fn = _function(ast.parse((tree / CP).read_text()), "attn_forward_func_with_cp")
    calls = _capture(version)
    kinds = {name for name, _, _ in calls}
    assert kinds == {"__init__", "set_context_parallel_group", "forward"}, kinds
    problems = []
    for name, positional, kwargs in calls:
        fn = _function(dpa, name, "DotProductAttention")
        problems += [f"{name}: {p}" for p in _accepts(fn, positional, set(kwargs))]
    masks = _tuple_constant(constants, "AttnMaskTypes")
    layouts = _tuple_constant(constants, "QKVLayouts")
    known_comms = _comm_types(cp_fn)
    cp_formats = next(
        {e.value for e in n.test.comparators[0].elts}
        for n in ast.walk(cp_fn)
        if isinstance(n, ast.Assert)
        and isinstance(n.test, ast.Compare)
        and isinstance(n.test.left, ast.Name)
        and n.test.left.id == "qkv_format"
        and isinstance(n.test.ops[0], ast.In)
    )
    for name, _, kwargs in calls:
        if "attn_mask_type" in kwargs and kwargs["attn_mask_type"] not in masks:
            problems.append(f"{name}: attn_mask_type {kwargs['attn_mask_type']!r} not in {masks}")
        fmt = kwargs.get("qkv_format")
        if fmt is not None and "_".join([fmt] * 3) not in layouts:
            problems.append(f"{name}: qkv_format {fmt!r} has no layout in QKVLayouts")
        comm = kwargs.get("cp_comm_type")
        if comm is not None:
            if comm not in known_comms:
                problems.append(f"cp_comm_type {comm!r} not among {sorted(known_comms)}")
            if "thd" not in cp_formats:
                problems.append(f"context parallelism takes {sorted(cp_formats)}, not thd")
            if _thd_asserted_away(cp_fn, comm):
                problems.append(f"cp_comm_type {comm!r} with qkv_format 'thd' is asserted away")
    assert not problems, f"Transformer Engine {version}: " + "; ".join(problems)


@pytest.mark.parametrize("version", CHECKED)
def test_the_a2a_p2p_thd_gate_is_what_te_source_asserts(version):
    """THD with ``cp_comm_type="a2a+p2p"`` is taken exactly where TE's source accepts it; where
    it does not, the TE backend declines the group and HSP's own Ulysses x ring path runs it."""
    tree = _source(version)
    cp_fn = _function(ast.parse((tree / CP).read_text()), "attn_forward_func_with_cp")
    accepted = not _thd_asserted_away(cp_fn, "a2a+p2p")
    assert te_thd_a2a_p2p_supported(version) is accepted, (version, TE_MIN_A2A_P2P_THD)
    comms = [kw["cp_comm_type"] for n, _, kw in _capture(version) if "cp_comm_type" in kw]
    assert comms == (["p2p", "a2a+p2p"] if accepted else ["p2p"]), comms


@pytest.mark.parametrize("version", TE_SUPPORTED)
def test_the_batched_p2p_hint_names_what_te_reads(version):
    """The start-up hint suggests ``NVTE_BATCH_MHA_P2P_COMM=1`` where TE's ring sends and
    receives one after another: TE batches them itself only for a ring of 2 before Blackwell."""
    from megatron_hsp.runtime.backends import TE_BATCH_P2P_ENV, te_p2p_hint

    text = (_source(version) / CP).read_text()
    assert f'os.getenv("{TE_BATCH_P2P_ENV}", "0")' in text and "cp_size == 2" in text
    assert te_p2p_hint(2, "p2p", {}) is None  # TE batches a ring of 2 (this CPU: no Blackwell)
    assert TE_BATCH_P2P_ENV + "=1" in te_p2p_hint(4, "a2a+p2p", {})
    assert te_p2p_hint(3, "p2p", {TE_BATCH_P2P_ENV: "1"}) is None
