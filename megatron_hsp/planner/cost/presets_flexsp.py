"""FlexSP's fitted cost models (Hetu-Galvatron flexsp branch), reproduced term for term.

Split out of ``costmodel.py``; the names stay importable from
``megatron_hsp.planner.cost.costmodel``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from megatron_hsp.planner.cost.costcore import CostModel
from megatron_hsp.planner.errors import InputError
from megatron_hsp.planner.groupspace import Cluster, HeadSpace

# Source: PKU-DAIR/Hetu-Galvatron, branch flexsp, galvatron/flexsp_solver/solver.py
# (``optimizer_param_dict`` and ``flexSPCostModel``), as quoted in docs/design.md section 4.
# a1 in ms/token^2, a2 in ms/token, b1 in ms, activations in MiB/token, params in billions keyed by
# max-seq in K (FlexSP interpolates linearly between 192 and 384 for other lengths).
FLEXSP_FITS: dict[str, dict[str, Any]] = {
    "flexsp-gpt-7b": {
        "heads": 32,  # FlexSP's GPT configs: MHA, head_dim 128
        "layers": 32,
        "hidden": 4096,
        "a1": 5.128e-6,
        "a2": 183.9576e-3,
        "b1": 629.3563,
        "act_mib_per_token": 4.480441895,
        "params_b": {4: 6.51, 192: 7.1174468994140625, 384: 7.8498687744140625},
    },
    "flexsp-gpt-13b": {
        "heads": 40,  # FlexSP's GPT configs: MHA, head_dim 128
        "layers": 40,
        "hidden": 5120,
        "a1": 9.2852e-6,
        "a2": 306.0189e-3,
        "b1": 1132.5632,
        "act_mib_per_token": 4.220439453,
        "params_b": {4: 12.3568, 192: 13.11605453491211, 384: 14.03158187866211},
    },
    "flexsp-gpt-30b": {
        "heads": 52,  # FlexSP's GPT configs: MHA, head_dim 128
        "layers": 60,
        "hidden": 6656,
        "a1": 15.4262e-6,
        "a2": 803.5742e-3,
        "b1": 2789.3644,
        "act_mib_per_token": 3.417381836,
        "params_b": {4: 30.538, 192: 31.52513885498047, 384: 32.71532440185547},
    },
}
# All-to-all bandwidth by group size, "4k seq, 2 IB" figures FlexSP uses (8 GPUs per node).
FLEXSP_A2A_GBS: dict[int, float] = {2: 119.54, 4: 104.07, 8: 96.5, 16: 10.33, 32: 5.94, 64: 4.87}
# FlexSP's solver.py defaults --memory_limit_gb to 28, but its published runs
# (scripts/solver_all.sh) pass 30, and only 30 reproduces its published static-64 and batchada
# totals on Wikipedia / gpt-7b / 192k / 64 GPUs / GBS 512 (docs/costmodel.md has the figures).
FLEXSP_DEFAULT_MEMORY_CAP_GB = 30.0


def flexsp_params_b(fit: Mapping[str, Any], max_seq_k: float) -> float:
    """Parameter count (billions) at ``max_seq_k`` (positional embeddings grow with max-seq).

    FlexSP's ``__main__``: exact table entry if present, else the line through 192K and 384K.
    """
    table = {float(k): float(v) for k, v in fit["params_b"].items()}
    if float(max_seq_k) in table:
        return table[float(max_seq_k)]
    lo, hi = table[192.0], table[384.0]
    return (hi - lo) / 192 * (max_seq_k - 192) + lo


def flexsp_bandwidth(bw: Mapping[int, float], d: int) -> float:
    """All-to-all bandwidth (GB/s) FlexSP's table gives a group of ``d``.

    FlexSP measured powers of two only. A size it did not measure (24, 40, 48, 56, ... with 8
    GPUs per node, or anything above its largest entry) takes the bandwidth of the smallest
    measured size at least as large, else of the largest measured one: per-GPU all-to-all
    bandwidth falls as a group grows, so this never makes an unmeasured size look cheaper than
    its measured neighbours.
    """
    if d in bw:
        return float(bw[d])
    larger = [k for k in bw if k >= d]
    return float(bw[min(larger)] if larger else bw[max(bw)])


def flexsp_cost_model(
    name: str,
    world_size: int,
    max_seq_k: float = 192,
    memory_cap_gb: float | None = None,
    a2a_gbs: Mapping[int, float] | None = None,
    gpus_per_node: int = 8,
    fit: Mapping[str, Any] | None = None,
    as_published: bool = False,
) -> CostModel:
    """FlexSP's fitted model, reproduced term for term (ZeRO-3, mixed precision).

    With the fit's ``heads`` (FlexSP's GPT configs, MHA) every group runs the executable
    Ulysses x ring split (``groupspace.HeadSpace.split``): all-to-all over u ranks at the
    bandwidth of u, plus ring steps (``CostModel.seq_ms``). ``as_published`` drops the heads and
    prices every size as pure Ulysses, exactly as FlexSP's solver does; that reproduces its
    figures (static-64 68.50 s) but includes groups the runtime cannot run (Ulysses over 64
    ranks with 32 heads), so its plans are not executable.

    Formulas (``flexSPCostModel`` in FlexSP's solver.py):

    - compute: ``(a1*s^2 + a2*s)/d`` ms per sequence plus ``b1`` once per group per micro-batch;
    - all-to-all: ``4*2*layers*hidden*s*2 / 2**20 / d / BW_d`` ms (bytes / MiB / ms arithmetic
      exactly as FlexSP writes it), zero for ``d = 1``;
    - memory: ZeRO-3 states ``params_b * 16 * 1024 / N`` MiB plus ``act_mib_per_token * s/d``;
      ``tokens_per_rank = int((cap_gb*1024 - states_mib) / act_mib_per_token)`` (its
      ``token_capacity``).

    Sizes: every legal size of ``Cluster(world_size, gpus_per_node)``; unmeasured sizes get
    bandwidths as ``flexsp_bandwidth`` explains. ``fit`` costs a user's own FlexSP-style fit.
    """
    if fit is None:
        if name not in FLEXSP_FITS:
            raise InputError(f"unknown FlexSP preset {name!r}; choose from {sorted(FLEXSP_FITS)}")
        fit = FLEXSP_FITS[name]
    cap = FLEXSP_DEFAULT_MEMORY_CAP_GB if memory_cap_gb is None else float(memory_cap_gb)
    layers, hidden = int(fit["layers"]), int(fit["hidden"])
    bw = {int(k): float(v) for k, v in (a2a_gbs or fit.get("a2a_gbs") or FLEXSP_A2A_GBS).items()}
    cluster = Cluster(world_size, gpus_per_node)
    heads = int(fit["heads"]) if "heads" in fit and not as_published else None
    space = HeadSpace(heads, heads) if heads else None
    sizes = [d for d in cluster.legal_sizes() if d > 1]
    a2a_bytes_per_token = 4 * 2 * layers * hidden * 2
    # Ring step (pure ring, every size: Megatron CP groups are priced by the same figure): K and
    # V (MHA, bf16) of the rank's s/d tokens, once forward, and K/V plus their gradients
    # backward, per layer; at the size-2 (NVLink) bandwidth inside a node, the two-node figure
    # when the ring crosses nodes (its slowest hop sets the pace). MHA: no KV copies for any u.
    ring_bytes_per_token = 3 * layers * 2 * hidden * 2
    a2a: dict[int, float] = {}
    ring: dict[int, float] = {}
    for d in sizes:
        u = space.split(d)[0] if space else d
        a2a[d] = a2a_bytes_per_token / 2**20 / d / flexsp_bandwidth(bw, u) if u > 1 else 0.0
        hop = flexsp_bandwidth(bw, 2 if not cluster.crosses_node(d) else 2 * gpus_per_node)
        ring[d] = ring_bytes_per_token / 2**20 / d / hop
    params_b = flexsp_params_b(fit, max_seq_k)
    model_states_mib = params_b * 16 * 1024 / world_size
    act = float(fit["act_mib_per_token"])
    tokens_per_rank = int((cap * 1024 - model_states_mib) / act)
    return CostModel(
        name=name,
        attn_ms_per_token2=float(fit["a1"]),
        linear_ms_per_token=float(fit["a2"]),
        group_fixed_ms={0: float(fit["b1"])},
        a2a_ms_per_token=a2a,
        tokens_per_rank=tokens_per_rank,
        source="FlexSP fitted model (Hetu-Galvatron flexsp branch, solver.py)",
        details={
            "params_b": params_b,
            "model_states_mib": model_states_mib,
            "act_mib_per_token": act,
            "memory_cap_gb": cap,
        },
        heads=(heads, heads) if heads else None,
        ring_step_ms_per_token=ring,
        # FlexSP's setup is ZeRO-3 (its memory term above): every pass gathers the parameters
        # and reduce-scatters the gradients over all ranks, so every pass is a barrier and b1,
        # fitted per group per micro-batch, is paid per pass.
        pass_barrier=world_size > 1,
    )
