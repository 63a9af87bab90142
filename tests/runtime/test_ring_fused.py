"""The fused ring (``ring.ring_attention(..., route="ring-fused")``) on the CPU, with the tiled
kernel standing in for flash through the same autograd function: rings of 2, 3 and 4 gloo ranks
give the tiled ring's outputs and gradients (fp32 tolerance) and a float64 dense reference's
(explicit document-causal mask, written here, sharing no ring code); fully masked pairs are never
handed to the kernel (kernel calls and query-key pairs counted, both larger with skipping off)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist

from megatron_hsp.planner.routes import RING_FUSED, RING_TILED
from megatron_hsp.runtime import ring
from megatron_hsp.runtime.layout import ring_position_tokens
from megatron_hsp.testing.dist import raise_rank_errors, run_distributed
from tests.helpers.ring_setup import dense_reference, document_of, padded_cu, run_route

WORLD = 4
DIM = 8
# name, ring ranks (group members, in group-rank order), heads, kv heads, documents; "zigzag":
# dispatch's layout (runtime/layout.py); "whole": ring position p holds document p, contiguous
# (every other position's block is another document: whole steps masked).
CASES = [
    ("ring-2-gqa", (2, 3), 4, 2, [13, 1, 8, 6], "zigzag"),
    ("ring-3", (0, 1, 2), 3, 3, [20, 5, 11, 3], "zigzag"),
    ("ring-4-mqa", (0, 1, 2, 3), 2, 1, [33, 2, 17, 12], "zigzag"),
    ("ring-4-whole-documents", (0, 1, 2, 3), 2, 2, [6, 6, 6, 6], "whole"),
    # Issue 41: blocks whose runs are all one token (flash's single-query path under GQA), and
    # documents shorter than 2d = 8, all of them tail tokens the zigzag layout deals one by one.
    ("ring-4-gqa-length-1", (0, 1, 2, 3), 4, 2, [1] * 12, "zigzag"),
    ("ring-4-gqa-shorter-than-2d", (0, 1, 2, 3), 4, 2, [1, 7, 2, 5, 3, 1, 6, 4, 1], "zigzag"),
]


def _held(cu: np.ndarray, r: int, pos: int, layout: str) -> np.ndarray:
    if layout == "zigzag":
        return ring_position_tokens(cu, 1, r, pos)
    share = int(cu[-1]) // r
    return np.arange(pos * share, (pos + 1) * share)


def _counting(kernel: ring.BlockKernel, counts: dict[str, int]) -> ring.BlockKernel:
    def pairs(cu_q, cu_k) -> int:
        return int(((cu_q[1:] - cu_q[:-1]).long() * (cu_k[1:] - cu_k[:-1]).long()).sum())

    def forward(q, k, v, cu_q, cu_k, *rest):
        counts["forward"] += 1
        counts["pairs"] += pairs(cu_q, cu_k)
        return kernel.forward(q, k, v, cu_q, cu_k, *rest)

    def backward(dout, q, k, v, out, lse, cu_q, cu_k, *rest):
        counts["backward"] += 1
        return kernel.backward(dout, q, k, v, out, lse, cu_q, cu_k, *rest)

    return ring.BlockKernel("counting", forward, backward)


def _worker(rank: int, world: int) -> dict:
    groups = {name: dist.new_group(list(members)) for name, members, *_ in CASES}
    results: dict = {}
    for name, members, heads, kv_heads, docs, layout in CASES:
        if rank not in members:
            continue
        r, pos = len(members), members.index(rank)
        group = groups[name]
        assert dist.get_rank(group) == pos
        cu = padded_cu(docs, r)
        total = int(cu[-1])
        g = torch.Generator().manual_seed(len(name))
        q, k, v, dout = (
            torch.randn(total, h, DIM, generator=g, dtype=torch.float64)
            for h in (heads, kv_heads, kv_heads, heads)
        )
        held = torch.from_numpy(_held(cu, r, pos, layout))
        doc_all = document_of(cu)
        scale = DIM**-0.5
        # Reference: float64, dense, over the whole buffer; this position's rows.
        ref = [t.clone().requires_grad_(True) for t in (q, k, v)]
        out_ref = dense_reference(*ref, doc_all, scale)
        grads_ref = torch.autograd.grad(out_ref, ref, dout)
        entry = {"ref": [out_ref.detach()[held], *(x[held] for x in grads_ref)]}

        inputs = (q, k, v, dout, held, doc_all[held], group, scale)
        entry["tiled"] = run_route(lambda *a: ring.ring_attention(*a, route=RING_TILED), *inputs)
        for skip in (True, False):
            counts = {"forward": 0, "backward": 0, "pairs": 0}
            kernel = _counting(ring.TILED_KERNEL, counts)
            entry[f"fused-skip-{skip}"] = run_route(
                lambda *a, kernel=kernel, skip=skip: ring.ring_attention(
                    *a, route=RING_FUSED, block_kernel=kernel, skip_masked=skip
                ),
                *inputs,
            )
            entry[f"counts-skip-{skip}"] = counts
        if layout == "zigzag":  # the plans the attention makes once per micro-batch
            plans = ring.host_ring_plans(cu, 1, group, group, torch.device("cpu"))
            entry["fused-host-plans"] = run_route(
                lambda *a, plans=plans: ring.ring_attention(*a, plans, route=RING_FUSED), *inputs
            )
        entry["local_tokens"] = int(held.numel())
        entry["total"] = total
        results[name] = entry
    # A hybrid 2 x 2 group (the world): Ulysses pairs {0, 1}, {2, 3}, rings {0, 2}, {1, 3}.
    # The host plans map ring-group ranks to ring positions as the gathered index vectors do.
    rings = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    ring_group = rings[rank % 2]
    cu = padded_cu([13, 1, 8, 6, 9], 4)
    held = ring_position_tokens(cu, 2, 2, rank // 2)
    mine = torch.from_numpy(np.stack([held, np.searchsorted(cu, held, side="right")]))
    metas = ring._gather_meta(mine, ring_group)
    gathered = ring.plan_ring(metas, dist.get_rank(ring_group), torch.device("cpu"))
    host = ring.host_ring_plans(cu, 2, dist.group.WORLD, ring_group, torch.device("cpu"))
    results["hybrid-plans-equal"] = all(
        len(a) == len(b)
        and all(
            torch.equal(x.rows_q, y.rows_q)
            and torch.equal(x.rows_k, y.rows_k)
            and torch.equal(x.cu_k, y.cu_k)
            and x.causal == y.causal
            for x, y in zip(a, b, strict=True)
        )
        for a, b in zip(gathered, host, strict=True)
    ) and any(len(a) for a in gathered[1:])
    return results


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return raise_rank_errors(run_distributed(_worker, WORLD))


def _close(a, b, tol):
    pairs = zip(a, b, strict=True)
    return all(torch.allclose(x.double(), y.double(), rtol=tol, atol=tol) for x, y in pairs)


@pytest.mark.spawns
@pytest.mark.dist
@pytest.mark.parametrize("case", [c[0] for c in CASES])
def test_fused_ring_matches_the_tiled_ring_and_a_dense_reference(results, case) -> None:
    ranks = [r[case] for r in results if case in r]
    assert len(ranks) == len(next(c[1] for c in CASES if c[0] == case))
    for entry in ranks:
        for skip in (True, False):
            fused = entry[f"fused-skip-{skip}"]
            assert _close(fused, entry["tiled"], 1e-5), (case, skip)  # out, dq, dk, dv
            assert _close(fused, entry["ref"], 1e-4), (case, skip)
        assert _close(entry["tiled"], entry["ref"], 1e-4), case
        if "fused-host-plans" in entry:
            assert _close(entry["fused-host-plans"], entry["tiled"], 1e-5), case


@pytest.mark.spawns
@pytest.mark.dist
def test_host_plans_map_ring_ranks_to_positions_as_the_gathered_index_does(results) -> None:
    assert [r["hybrid-plans-equal"] for r in results] == [True] * WORLD


@pytest.mark.spawns
@pytest.mark.dist
@pytest.mark.parametrize("case", [c[0] for c in CASES])
def test_masked_blocks_are_skipped(results, case) -> None:
    for entry in (r[case] for r in results if case in r):
        on, off = entry["counts-skip-True"], entry["counts-skip-False"]
        # Without skipping every local query meets every key of the buffer exactly once.
        assert off["pairs"] == entry["local_tokens"] * entry["total"], (case, off)
        assert on["pairs"] < off["pairs"], (case, on, off)
        assert on["forward"] < off["forward"] and on["backward"] < off["backward"], (on, off)
        assert on["forward"] == on["backward"]
        if case.endswith("whole-documents"):
            # Only the own block is visible: one (causal) call; with skipping off, one more
            # per ring step for the other documents' blocks.
            assert on["forward"] == 1 and off["forward"] == 4, (on, off)
