"""The packed (THD) micro-batch as attention sees it: ``HSPPackedSeqParams`` and RoPE per document.

The schedule builds one ``HSPPackedSeqParams`` per micro-batch (megatron-core's per-call seam,
with HSP's state in declared fields); every layer reads the segment boundaries, the positions of
each token inside its own document and the rotary table from it. ``_checked_cu_seqlens`` states
the buffer contract and names what is violated.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.transformer_config import TransformerConfig


@dataclasses.dataclass
class MicroBatchState:
    """What every layer of one micro-batch shares (``HSPPackedSeqParams.hsp_micro_batch``).

    Filled on the host when the micro-batch is built (``schedule.packed_seq_params``): the
    buffer's segment boundaries as Python ints, the ring degree dispatch laid the tokens out
    for, the (Ulysses, ring) sub-groups. Completed once, by the first layer, with what it
    derives from them, so that no later layer reads a tensor back to the host
    (``tests/runtime/test_host_syncs.py``).
    """

    cu_host: list[int] | None = None  # segment boundaries of the group's buffer
    layout_ring: int | None = None  # the ring degree of dispatch's token layout
    # The group's (Ulysses sub-group, ring sub-group) when its ring degree > 1; None: pure
    # Ulysses over ``cp_group``.
    hybrid: tuple[dist.ProcessGroup | None, dist.ProcessGroup | None] | None = None
    # Derived by the first layer; ``checked`` is the (boundaries tensor, total tokens) they were
    # derived for: a re-used params object with other boundaries re-checks and re-derives.
    checked: tuple[torch.Tensor, int] | None = None
    positions: torch.Tensor | None = None  # every token's position inside its document
    ring_index: torch.Tensor | None = None  # the buffer tokens this ring position holds
    local_positions: torch.Tensor | None = None  # positions of this rank's local shard
    # The fused ring's block calls (``ring.host_ring_plans``), built from ``cu_host`` once.
    ring_plans: Any = None
    # TE's context-parallel inputs per (Ulysses, ring) split (``backends.TEAttentionBackend``).
    te_cp: dict[tuple[int, int], Any] = dataclasses.field(default_factory=dict)

    def forget_derived(self) -> None:
        """Drop what the first layer derived (the boundaries changed)."""
        self.positions = self.ring_index = self.local_positions = self.ring_plans = None
        self.te_cp.clear()


@dataclasses.dataclass
class HSPPackedSeqParams(PackedSeqParams):
    """megatron-core's ``PackedSeqParams`` with HSP's per-micro-batch state as declared fields
    (the way megatron-core declares ``cp_scatter_cache``), never attributes attached at run time.

    ``hsp_micro_batch``: what every layer of one micro-batch shares (``MicroBatchState``); the
    same object is shared by the per-layer copies ``wrap`` makes. ``rotary_*``: megatron's
    rotary table, so RoPE runs inside the HSP core attention (built per layer call by
    ``HSPSelfAttention``).
    """

    hsp_micro_batch: MicroBatchState = dataclasses.field(default_factory=MicroBatchState)
    rotary_q_freqs: torch.Tensor | None = None
    rotary_k_freqs: torch.Tensor | None = None
    rotary_mscale: float = 1.0

    @classmethod
    def wrap(cls, p: PackedSeqParams, q_freqs, k_freqs, mscale: float) -> HSPPackedSeqParams:
        kwargs = {f.name: getattr(p, f.name) for f in dataclasses.fields(PackedSeqParams)}
        total_tokens, seq_idx = kwargs.pop("total_tokens"), kwargs.pop("seq_idx")
        out = cls(
            **kwargs,
            hsp_micro_batch=_micro_batch_cache(p),  # shared by every layer of the micro-batch
            rotary_q_freqs=q_freqs,
            rotary_k_freqs=k_freqs,
            rotary_mscale=mscale,
        )
        out.total_tokens, out.seq_idx = total_tokens, seq_idx  # skip __post_init__'s recompute
        return out


def group_packed_seq_params(
    cu_seqlens: torch.Tensor,
    group: dist.ProcessGroup | None,
    hybrid: tuple[dist.ProcessGroup | None, dist.ProcessGroup | None] | None = None,
    *,
    cu_host: Sequence[int] | None = None,
    max_seqlen: int | None = None,
    layout_ring: int | None = None,
) -> HSPPackedSeqParams:
    """The ``PackedSeqParams`` the HSP attention expects for one micro-batch (docs/runtime.md);
    the one builder (``schedule.packed_seq_params`` calls it with what dispatch knows).

    ``cu_seqlens``: int32 boundaries of the group's whole buffer (documents, then the trailing
    padding segment), ``cu_seqlens[-1]`` a multiple of the group size. ``max_seqlen`` covers the
    padding segment too, because it sizes megatron's RoPE table. ``hybrid``: the group's
    (Ulysses sub-group, ring sub-group) from ``GroupRegistry.hybrid`` when its ring degree > 1;
    None runs pure Ulysses over ``group``. ``cu_host``/``max_seqlen``: the same boundaries and
    longest segment on the host when the caller has them (dispatch does), so nothing is read
    back from the device; ``layout_ring``: the ring degree dispatch laid the tokens out for,
    which attention checks against the degree it runs with.
    """
    host = [int(x) for x in (cu_seqlens.tolist() if cu_host is None else cu_host)]
    d = 1 if group is None else group.size()
    total = host[-1] if host else 0
    if total % d:
        raise ValueError(
            f"packed buffer of {total} tokens is not a multiple of the group size {d}: pad it "
            f"with one trailing segment of {-total % d} tokens"
        )
    if max_seqlen is None:
        max_seqlen = max((b - a for a, b in itertools.pairwise(host)), default=0)
    cu = cu_seqlens.to(torch.int32)
    state = MicroBatchState(cu_host=host, layout_ring=layout_ring)
    if hybrid is not None and hybrid[1] is not None and hybrid[1].size() > 1:
        state.hybrid = hybrid
    return HSPPackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        cu_seqlens_q_padded=cu,  # the same object: no padding between sequences
        cu_seqlens_kv_padded=cu,
        max_seqlen_q=int(max_seqlen),
        max_seqlen_kv=int(max_seqlen),
        cp_group=group,
        local_cp_size=d,
        hsp_micro_batch=state,
    )


def _micro_batch_cache(p: PackedSeqParams) -> MicroBatchState:
    """The micro-batch's shared state (``HSPPackedSeqParams.hsp_micro_batch``).

    A plain megatron ``PackedSeqParams`` (built by other code) gets a fresh one: correct, but
    then each layer re-derives what an ``HSPPackedSeqParams`` from the schedule carries.
    """
    return p.hsp_micro_batch if isinstance(p, HSPPackedSeqParams) else MicroBatchState()


def positions_in_documents(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """Position of every token inside its own segment: [0..L0-1, 0..L1-1, ...] (int64)."""
    cu = cu_seqlens.to(torch.int64)
    lengths = cu[1:] - cu[:-1]
    starts = torch.repeat_interleave(cu[:-1], lengths, output_size=total)
    return torch.arange(total, device=cu.device) - starts


def apply_rope_packed(
    t: torch.Tensor,
    freqs: torch.Tensor,
    positions: torch.Tensor,
    config: TransformerConfig,
    mscale: float = 1.0,
    check_range: bool = True,
) -> torch.Tensor:
    """RoPE on packed ``t`` [T, h, D] with per-token positions, using megatron's unfused math.

    ``freqs`` is megatron's rotary table [S, 1, 1, rot_dim] for positions 0..S-1 (what
    ``GPTModel`` computes for THD input with S = max_seqlen). Same elementwise operations as
    megatron's single-sequence (bshd) path, hence the same numbers as a single-device run.
    """
    if check_range and positions.numel() and int(positions.max()) >= freqs.size(0):
        raise ValueError(
            f"RoPE table covers {freqs.size(0)} positions but a packed segment reaches position "
            f"{int(positions.max())}: PackedSeqParams.max_seqlen_q/kv must be the longest segment "
            f"in cu_seqlens (trailing padding segment included)"
        )
    per_token = freqs.index_select(0, positions.to(freqs.device)).reshape(
        positions.numel(), 1, freqs.size(-1)
    )
    return _apply_rotary_pos_emb_bshd(
        t, per_token, rotary_interleaved=config.rotary_interleaved, mscale=mscale
    )


# ---------------------------------------------------------------------------------------------


def _checked_cu_seqlens(
    p: PackedSeqParams, total: int, d: int, cu_host: Sequence[int]
) -> torch.Tensor:
    """The group buffer's segment boundaries; errors name the violated part of the contract.

    Runs once per micro-batch (the first layer); ``cu_host`` are the same boundaries on the host.
    """
    cu = p.cu_seqlens_q
    if cu is None:
        raise ValueError("THD PackedSeqParams needs cu_seqlens_q for HSP attention")
    if (
        p.cu_seqlens_kv is not None
        and p.cu_seqlens_kv is not cu
        and not torch.equal(p.cu_seqlens_kv.cpu(), cu.cpu())
    ):
        raise ValueError("HSP self-attention needs cu_seqlens_kv == cu_seqlens_q")
    for name in ("cu_seqlens_q_padded", "cu_seqlens_kv_padded"):
        padded = getattr(p, name)
        if padded is not None and padded is not cu and not torch.equal(padded.cpu(), cu.cpu()):
            raise ValueError(
                f"HSP attention does not support per-document padding ({name} differs from "
                f"cu_seqlens_q): put the group's padding in one trailing segment instead"
            )
    end = int(cu_host[-1]) if len(cu_host) else 0
    if end != total:
        raise ValueError(
            f"cu_seqlens_q must describe the group's whole packed buffer: it ends at {end} but "
            f"{d} rank(s) x {total // d} local tokens = {total}"
        )
    return cu


__all__ = [
    "HSPPackedSeqParams",
    "apply_rope_packed",
    "group_packed_seq_params",
    "positions_in_documents",
]
