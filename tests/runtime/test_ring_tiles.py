"""The ring with blocks that span several query tiles (``ring.TILE_ELEMENTS`` lowered in the
workers so that a few dozen tokens make several tiles), on a ring of 3 gloo ranks (3 ring steps,
skipped and unskipped blocks): tiled and fused routes against a float64 dense reference written
here (no ring code shared). The planted bug ``tile-accumulation-assigned``
(``mutations.RING_MUTATIONS``) must move dK/dV far outside the tolerance."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatron_hsp.planner.routes import RING_FUSED, RING_TILED
from megatron_hsp.runtime import ring
from megatron_hsp.runtime.layout import ring_position_tokens
from megatron_hsp.testing.dist import raise_rank_errors, run_distributed
from megatron_hsp.testing.mutations import RING_MUTATIONS

WORLD = 3
DIM = 8
HEADS, KV_HEADS = 4, 2
DOCS = [37, 5, 21, 14, 1, 9]
ROWS_PER_TILE = 5


def _dense_reference(q, k, v, doc, scale):
    rep = q.size(1) // k.size(1)
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    t = torch.arange(q.size(0))
    mask = (doc[:, None] == doc[None, :]) & (t[None, :] <= t[:, None])
    s = torch.einsum("ahd,bhd->hab", q, k) * scale
    return torch.einsum("hab,bhd->ahd", torch.softmax(s.masked_fill(~mask, -torch.inf), -1), v)


def _run(fn, q, k, v, dout, held, doc, group, scale) -> list[torch.Tensor]:
    local = [t[held].float().requires_grad_(True) for t in (q, k, v)]
    out = fn(*local, held, doc, group, scale)
    out.backward(dout[held].float())
    return [out.detach(), *(t.grad for t in local)]


def _worker(rank: int, world: int) -> dict:
    import numpy as np

    group = dist.group.WORLD
    pad = -sum(DOCS) % world
    cu = np.concatenate([[0], np.cumsum(DOCS + ([pad] if pad else []))]).astype(np.int64)
    total = int(cu[-1])
    held = torch.from_numpy(ring_position_tokens(cu, 1, world, rank))
    # Blocks of ``held`` keys: ROWS_PER_TILE query rows per tile, several tiles per block.
    ring.TILE_ELEMENTS = HEADS * int(held.numel()) * ROWS_PER_TILE
    tiles = len(ring._tiles(int(held.numel()), HEADS, int(held.numel())))
    g = torch.Generator().manual_seed(7)
    q, k, v, dout = (
        torch.randn(total, h, DIM, generator=g, dtype=torch.float64)
        for h in (HEADS, KV_HEADS, KV_HEADS, HEADS)
    )
    doc_all = torch.searchsorted(torch.from_numpy(cu), torch.arange(total), right=True)
    scale = DIM**-0.5
    ref = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out_ref = _dense_reference(*ref, doc_all, scale)
    grads_ref = torch.autograd.grad(out_ref, ref, dout)
    result = {"tiles": tiles, "ref": [out_ref.detach()[held], *(x[held] for x in grads_ref)]}
    inputs = (q, k, v, dout, held, doc_all[held], group, scale)
    routes = {
        "tiled": lambda *a: ring.ring_attention(*a, route=RING_TILED),
        "fused-skip": lambda *a: ring.ring_attention(*a, route=RING_FUSED, skip_masked=True),
        "fused-all": lambda *a: ring.ring_attention(*a, route=RING_FUSED, skip_masked=False),
    }
    for name, fn in routes.items():
        result[name] = _run(fn, *inputs)
        for mutation in RING_MUTATIONS:
            undo = mutation.plant()
            try:
                result[f"{name}+{mutation.name}"] = _run(fn, *inputs)
            finally:
                undo()
    return result


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return raise_rank_errors(run_distributed(_worker, WORLD))


def _worst(a, b) -> float:
    return max(
        float((x.double() - y).abs().max() / y.abs().max()) for x, y in zip(a, b, strict=True)
    )


@pytest.mark.spawns
@pytest.mark.dist
@pytest.mark.parametrize("route", ["tiled", "fused-skip", "fused-all"])
def test_several_query_tiles_match_a_dense_reference(results, route) -> None:
    for entry in results:
        assert entry["tiles"] >= 4, entry["tiles"]  # several query tiles per block
        assert _worst(entry[route], entry["ref"]) < 1e-5, route


@pytest.mark.spawns
@pytest.mark.dist
@pytest.mark.parametrize("route", ["tiled", "fused-skip", "fused-all"])
@pytest.mark.parametrize("mutation", [m.name for m in RING_MUTATIONS])
def test_planted_tile_bug_is_caught(results, route, mutation) -> None:
    worst = max(_worst(e[f"{route}+{mutation}"], e["ref"]) for e in results)
    assert worst > 100 * 1e-5, (route, mutation, worst)
