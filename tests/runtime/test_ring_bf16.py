"""The fused ring in bf16 (the tiled kernel standing in for flash on the CPU, rounding each block's
partial output and gradients to bf16 as flash does), on a ring of 4 gloo ranks (4 ring steps,
documents spanning every position, skipped and unskipped blocks), judged by a bound derived from
bf16's unit roundoff (``tolerances.bf16_attention_bounds``), not by stock's bf16 noise:

- against a float64 dense reference on the same bf16 inputs (``tests/helpers/ring_setup.py``, no
  ring code), elementwise, out, dq, dk and dv; the tiled ring in bf16 likewise;
- against the tiled ring in bf16, elementwise, by the two rings' bounds together.

Two input sets: random bf16 values, and "exact partials": v constant over each ring position's
tokens (random q, k, dout), so every block's partial output is a bf16 number and the only
rounding a correct ring may do to the output is the final one (bound u|O| + fp32 slack). There
the planted ``running-output-in-input-dtype`` (``mutations.RING_MUTATIONS``: every merge rounds
the running output to bf16: +52% attention error on random inputs here, +63% at a ring of 8,
+27% in the audit's case, all inside the GPU kit's 5%) must exceed the bound several times over.
A ring of 4, not 8: 8 spawned ranks did not start within the harness's 300 s on this shared
machine (load 60); the plant's margin is about the same (7.8x against the fp64 bound, 3.9x
against the tiled ring; 8.4x and 4.2x at a ring of 8)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist

from megatron_hsp.planner.routes import RING_FUSED, RING_TILED
from megatron_hsp.runtime import ring
from megatron_hsp.runtime.layout import ring_position_tokens
from megatron_hsp.testing.dist import raise_rank_errors, run_distributed
from megatron_hsp.testing.mutations import RING_MUTATIONS
from megatron_hsp.testing.tolerances import bf16_attention_bounds
from tests.helpers.ring_setup import (
    dense_forward_backward,
    dense_reference,
    document_of,
    padded_cu,
    run_route,
)

WORLD = 4
DIM = 16
HEADS = 2
DOCS = [150, 90, 9, 47]  # the first two span every ring position (zigzag: 2r chunks)
PLANT = "running-output-in-input-dtype"
# How far the plant must exceed the bound on the exact-partials inputs (measured 3.9x-7.8x).
PLANT_MARGIN = 3.0
DATA = ("random", "exact-partials")
NAMES = ("out", "dq", "dk", "dv")


def _bf16(x: torch.Tensor) -> torch.Tensor:
    """``x`` rounded to bf16, held in float64 (exact): the inputs both sides see."""
    return x.to(torch.bfloat16).double()


def _inputs(data: str, cu: np.ndarray, r: int) -> list[torch.Tensor]:
    total = int(cu[-1])
    g = torch.Generator().manual_seed(11)
    q, k, v, dout = (
        _bf16(torch.randn(total, HEADS, DIM, generator=g, dtype=torch.float64)) for _ in range(4)
    )
    if data == "exact-partials":  # v constant over each ring position's tokens
        owner = np.empty(total, dtype=np.int64)
        for pos in range(r):
            owner[ring_position_tokens(cu, 1, r, pos)] = pos
        c = _bf16(torch.randn(r, HEADS, DIM, generator=g, dtype=torch.float64))
        v = c[torch.from_numpy(owner)]
    return [q, k, v, dout]


def _worker(rank: int, world: int) -> dict:
    group = dist.group.WORLD
    cu = padded_cu(DOCS, world)
    doc_all = document_of(cu)
    held = torch.from_numpy(ring_position_tokens(cu, 1, world, rank))
    scale = DIM**-0.5
    (plant,) = [m for m in RING_MUTATIONS if m.name == PLANT]
    routes = {
        "tiled": lambda *a: ring.ring_attention(*a, route=RING_TILED),
        "fused": lambda *a: ring.ring_attention(*a, route=RING_FUSED),
    }
    results: dict = {}
    for data in DATA:
        q, k, v, dout = _inputs(data, cu, world)
        dense = dense_forward_backward(q, k, v, dout, doc_all, scale)
        # The written-out backward agrees with autograd's on the dense reference.
        ref = [t.clone().requires_grad_(True) for t in (q, k, v)]
        grads = torch.autograd.grad(dense_reference(*ref, doc_all, scale), ref, dout)
        for name, x in zip(NAMES[1:], grads, strict=True):
            assert torch.allclose(dense[name], x, rtol=1e-10, atol=1e-12), name
        exact = data == "exact-partials"
        bounds = {
            "tiled": bf16_attention_bounds(dense, scale, False, False),
            "fused": bf16_attention_bounds(dense, scale, not exact, True),
        }
        entry: dict = {
            "ref": [dense[n][held] for n in NAMES],
            "bound-tiled": [bounds["tiled"][n][held] for n in NAMES],
            "bound-fused": [bounds["fused"][n][held] for n in NAMES],
        }
        inputs = (q, k, v, dout, held, doc_all[held], group, scale)
        for route, fn in routes.items():
            got = run_route(fn, *inputs, dtype=torch.bfloat16)
            entry[route] = [x.double() for x in got]
        planted = plant.plant()
        try:
            got = run_route(routes["fused"], *inputs, dtype=torch.bfloat16)
        finally:
            planted.undo()
        entry["fused+plant"] = [x.double() for x in got]
        entry["plant-calls"] = planted.calls()
        results[data] = entry
    return results


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return raise_rank_errors(run_distributed(_worker, WORLD))


def _ratios(got, want, bound) -> dict[str, float]:
    """max |got - want| / bound per tensor (out, dq, dk, dv) on this rank's rows."""
    return {
        n: float(((g - w).abs() / b).max())
        for n, g, w, b in zip(NAMES, got, want, bound, strict=True)
    }


def _worst(results, key, want, bound, data) -> dict[str, float]:
    per_rank = [_ratios(e[data][key], e[data][want], bound(e[data])) for e in results]
    return {n: max(r[n] for r in per_rank) for n in NAMES}


def _relative(results, key, data) -> dict[str, float]:
    """max |x - ref| / max |ref| per tensor, over the ranks (what a loose yardstick reads)."""
    out = {}
    for i, n in enumerate(NAMES):
        err = max(float((e[data][key][i] - e[data]["ref"][i]).abs().max()) for e in results)
        out[n] = err / max(float(e[data]["ref"][i].abs().max()) for e in results)
    return out


@pytest.mark.spawns
@pytest.mark.dist
@pytest.mark.parametrize("data", DATA)
@pytest.mark.parametrize("route", ["tiled", "fused"])
def test_bf16_ring_within_the_bound_derived_from_bf16(results, data, route) -> None:
    worst = _worst(results, route, "ref", lambda e: e[f"bound-{route}"], data)
    print(
        f"{route} bf16 vs fp64, {data}: error/bound {worst}; rel {_relative(results, route, data)}"
    )
    assert all(x <= 1.0 for x in worst.values()), (route, data, worst)


@pytest.mark.spawns
@pytest.mark.dist
@pytest.mark.parametrize("data", DATA)
def test_fused_bf16_matches_the_tiled_ring_in_bf16(results, data) -> None:
    def both(e):
        return [a + b for a, b in zip(e["bound-fused"], e["bound-tiled"], strict=True)]

    worst = _worst(results, "fused", "tiled", both, data)
    print(f"fused vs tiled bf16, {data}: difference/bound {worst}")
    assert all(x <= 1.0 for x in worst.values()), (data, worst)


@pytest.mark.spawns
@pytest.mark.dist
def test_running_output_rounded_per_merge_is_caught(results) -> None:
    assert all(e[d]["plant-calls"] > 0 for e in results for d in DATA)
    data = "exact-partials"
    vs_ref = _worst(results, "fused+plant", "ref", lambda e: e["bound-fused"], data)

    def both(e):
        return [a + b for a, b in zip(e["bound-fused"], e["bound-tiled"], strict=True)]

    vs_tiled = _worst(results, "fused+plant", "tiled", both, data)
    random = _worst(results, "fused+plant", "ref", lambda e: e["bound-fused"], "random")
    print(
        f"planted {PLANT}: out error/bound vs fp64 {vs_ref['out']:.2f}, vs tiled "
        f"{vs_tiled['out']:.2f} (exact partials); random inputs {random['out']:.2f}; rel "
        f"{_relative(results, 'fused+plant', 'random')['out']:.3g} vs "
        f"{_relative(results, 'fused', 'random')['out']:.3g} unplanted"
    )
    assert vs_ref["out"] > PLANT_MARGIN and vs_tiled["out"] > PLANT_MARGIN, (vs_ref, vs_tiled)


def test_one_block_in_bf16_within_the_bound_and_the_bound_is_bf16_sized() -> None:
    """In one process (group None: one block, its two calls merged): both rings in bf16 within
    the bound, and the bound is u-sized (out: at most 2(u + g) P|V|), far below stock's 5%."""
    cu = padded_cu([40, 9, 15], 1)
    doc_all = document_of(cu)
    held = torch.from_numpy(ring_position_tokens(cu, 1, 1, 0))
    scale = DIM**-0.5
    q, k, v, dout = _inputs("random", cu, 1)
    dense = dense_forward_backward(q, k, v, dout, doc_all, scale)
    for route, partials in ((RING_TILED, False), (RING_FUSED, True)):
        bound = bf16_attention_bounds(dense, scale, partials, partials)
        got = run_route(
            lambda *a, route=route: ring.ring_attention(*a, route=route),
            q, k, v, dout, held, doc_all[held], None, scale, dtype=torch.bfloat16,
        )  # fmt: skip
        ratios = _ratios(
            [x.double() for x in got],
            [dense[n][held] for n in NAMES],
            [bound[n][held] for n in NAMES],
        )
        assert all(x <= 1.0 for x in ratios.values()), (route, ratios)
    rel = float((bound["out"] / dense["out"].abs().max()).max())
    assert rel < 0.05 / 4, rel
