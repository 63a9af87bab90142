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
from tests.helpers.ring_setup import dense_reference, document_of, padded_cu, run_route

WORLD = 3
DIM = 8
HEADS, KV_HEADS = 4, 2
DOCS = [37, 5, 21, 14, 1, 9]
ROWS_PER_TILE = 5
# The plant of this class (``test_ring_bf16.py`` runs the bf16 one, which fp32 rounds away).
PLANTS = [m for m in RING_MUTATIONS if m.name == "tile-accumulation-assigned"]


def _worker(rank: int, world: int) -> dict:
    group = dist.group.WORLD
    cu = padded_cu(DOCS, world)
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
    doc_all = document_of(cu)
    scale = DIM**-0.5
    ref = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out_ref = dense_reference(*ref, doc_all, scale)
    grads_ref = torch.autograd.grad(out_ref, ref, dout)
    result = {"tiles": tiles, "ref": [out_ref.detach()[held], *(x[held] for x in grads_ref)]}
    inputs = (q, k, v, dout, held, doc_all[held], group, scale)
    routes = {
        "tiled": lambda *a: ring.ring_attention(*a, route=RING_TILED),
        "fused-skip": lambda *a: ring.ring_attention(*a, route=RING_FUSED, skip_masked=True),
        "fused-all": lambda *a: ring.ring_attention(*a, route=RING_FUSED, skip_masked=False),
    }
    for name, fn in routes.items():
        result[name] = run_route(fn, *inputs)
        for mutation in PLANTS:
            undo = mutation.plant()
            try:
                result[f"{name}+{mutation.name}"] = run_route(fn, *inputs)
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
@pytest.mark.parametrize("mutation", [m.name for m in PLANTS])
def test_planted_tile_bug_is_caught(results, route, mutation) -> None:
    worst = max(_worst(e[f"{route}+{mutation}"], e["ref"]) for e in results)
    assert worst > 100 * 1e-5, (route, mutation, worst)
