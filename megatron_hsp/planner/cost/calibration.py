"""Published GPU measurements, the model's prediction of each, and the fit of the H100 terms.

Why: every speedup the project reports is a cost-model estimate, so the model's hardware terms
must be held against measurements someone else took on real GPUs. This module is the
single place that says which published figure is used to *fit* a term and which only to
*check* the fitted model; ``benchmarks/calibration.py`` prints the table that
docs/calibration.md shows, and ``tests/planner/cost/test_calibration.py`` keeps the H100 preset
equal to what
``fit_h100`` derives from the fit set.

The predictions come from the same formulas the planner's model is built from
(``first_principles``): an attention call costs its FLOPs at ``attention_fraction`` of peak plus
``attn_call_overhead_us``; Ulysses adds its four all-to-alls (bytes over NVLink or the NIC, plus
latency); ring attention runs one kernel call per step, hides each step's K/V p2p behind the
step's compute where it can, and pays ``ring_step_overhead_bytes_per_elem`` per output element
per extra step at HBM bandwidth. Only attention layers are measured in the public figures, so
only attention-layer predictions are checked; the linear-layer efficiency
(``achievable_fraction``) has no public bf16 H100 measurement in the fit set and stays an
assumption (docs/calibration.md says so).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass

from megatron_hsp.planner.cost.first_principles import ATTN_BACKWARD_FLOPS, HardwareConfig
from megatron_hsp.planner.groupspace import kv_copies

# FLOPs convention of FlashAttention's and MagiAttention's benchmarks: forward
# 4 * n^2 * heads * head_dim (halved when causal), backward 2.5x forward.
BACKWARD_FLOPS = ATTN_BACKWARD_FLOPS


@dataclass(frozen=True)
class AttentionCase:
    """One attention layer pass on ``cp`` GPUs, each holding ``tokens_per_gpu`` tokens."""

    q_heads: int
    kv_heads: int
    tokens_per_gpu: int
    cp: int = 1
    mode: str = "kernel"  # kernel (one GPU, one call), ulysses, ring (load-balanced)
    causal: bool = True
    passes: str = "fwd"  # fwd, bwd, fwd+bwd
    head_dim: int = 128
    gpus_per_node: int = 8
    # Varlen: the documents' sum of squared lengths over the squared total (1.0: one sequence).
    # Only the FLOPs shrink; calls, traffic and merges are per token, so unchanged: the model
    # has no per-document kernel cost (docs/calibration.md checks that choice here).
    work_fraction: float = 1.0

    def fwd_flops_per_gpu(self) -> float:
        """Forward FLOPs of the whole sequence's attention divided over the ``cp`` GPUs."""
        n = self.tokens_per_gpu * self.cp
        fwd = 4.0 * n * n * self.q_heads * self.head_dim * (0.5 if self.causal else 1.0)
        return fwd * self.work_fraction / self.cp

    def flops_per_gpu(self) -> float:
        """FLOPs of every pass the case runs, per GPU."""
        return self.fwd_flops_per_gpu() * sum(f for _, f in _pass_list(self.passes))


# The H100 preset fields fit_h100 returns (fitted, or taken from the NCCL figures): the
# preset must equal the fit on each (tests/planner/cost/test_calibration.py,
# benchmarks/calibration.py).
FITTED = (
    "attention_fraction",
    "attention_bwd_fraction",
    "attn_call_overhead_us",
    "ring_step_overhead_bytes_per_elem",
    "nvlink_gbs",
    "inter_node_gbs",
    "p2p_gbs",
    "latency_us",
    "p2p_latency_us",
    "inter_node_latency_us",
)


def _pass_list(passes: str) -> list[tuple[str, float]]:
    """(pass, FLOPs factor) for each pass a case runs."""
    return {
        "fwd": [("fwd", 1.0)],
        "bwd": [("bwd", BACKWARD_FLOPS)],
        "fwd+bwd": [("fwd", 1.0), ("bwd", BACKWARD_FLOPS)],
    }[passes]


def attention_case_ms(case: AttentionCase, hw: HardwareConfig) -> float:
    """Predicted wall time (ms) of ``case`` on ``hw``, from the model's own terms."""
    call_ms = hw.attn_call_overhead_us * 1e-3
    total = 0.0
    n, c, hd = case.tokens_per_gpu, case.cp, case.head_dim
    crosses = c > case.gpus_per_node
    for kind, factor in _pass_list(case.passes):
        rate = hw.attention_bwd_flops if kind == "bwd" else hw.attention_flops
        compute = case.fwd_flops_per_gpu() * factor / rate * 1e3
        if case.mode == "kernel" or c == 1:
            total += compute + call_ms
        elif case.mode == "ulysses":
            copies = kv_copies(case.q_heads, case.kv_heads, c)
            elems = (2 * case.q_heads + 2 * case.kv_heads * copies) * hd
            per_peer = n * elems * 2.0 / c  # bf16 bytes to each peer
            intra = min(c, case.gpus_per_node) - 1
            inter = c - min(c, case.gpus_per_node)
            a2a = max(
                intra * per_peer / (hw.nvlink_gbs * 1e9),
                inter * per_peer / (hw.inter_node_gbs * 1e9),
            )
            lat = hw.inter_node_latency_us if crosses else hw.latency_us
            total += compute + call_ms + a2a * 1e3 + 4 * lat * 1e-3
        elif case.mode == "ring":
            # K, V forward; K, V and their gradients backward, for the rank's n tokens.
            kv_bytes = n * 2 * case.kv_heads * hd * 2.0 * (2 if kind == "bwd" else 1)
            p2p = kv_bytes / (hw.p2p_bandwidth_gbs(crosses) * 1e9) * 1e3
            step = compute / c
            extra = n * case.q_heads * hd * hw.ring_step_overhead_bytes_per_elem
            extra_ms = extra / (hw.hbm_tbs * 1e12) * 1e3
            lat = hw.p2p_latency(crosses) * 1e-3
            total += compute + c * call_ms + (c - 1) * (max(0.0, p2p - step) + lat + extra_ms)
        else:
            raise ValueError(f"unknown mode {case.mode!r}")
    return total


def attention_case_tflops(case: AttentionCase, hw: HardwareConfig) -> float:
    """Per-GPU TFLOP/s of ``case`` as the benchmarks report it (FLOPs per GPU / time)."""
    return case.flops_per_gpu() / (attention_case_ms(case, hw) * 1e-3) / 1e12


@dataclass(frozen=True)
class Figure:
    """One published figure and how the model predicts it.

    ``role``: "fit" (a term is set from it), "check" (only compared), "direct" (a link
    constant taken as published). ``low``/``high`` keep a published range; the error is taken
    against the nearest end (0 inside the range).
    """

    key: str
    source: str
    setting: str
    unit: str
    low: float
    high: float
    role: str
    predict: Callable[[HardwareConfig], float]

    def error(self, predicted: float) -> float:
        """Relative error of ``predicted`` against the published value or range."""
        if self.low <= predicted <= self.high:
            return 0.0
        ref = self.low if predicted < self.low else self.high
        return (predicted - ref) / ref


MAGI = (
    "MagiAttention, docs/source/blog/cp_benchmark.md + charts assets/magi_attn/exp/"
    "(read off bars, about +-10 TFLOP/s)"
)
RFA = "zhuzilin/ring-flash-attention, README.md table (benchmark/benchmark_kvpacked_func.py)"
NCCL_BW = "NVIDIA/nccl-tests #212, #268; NVIDIA/nccl #2169 (shared file row 10)"
NCCL_A2A = "NVIDIA/nccl-tests #267, #290, #130 (maintainers' answers; shared file rows 8-9)"
NCCL_LAT = "NVIDIA/nccl #1487, #1984; deepseek-ai/DeepEP #303; NVIDIA/nccl #1244 (row 11)"


def _tflops(**kw: object) -> Callable[[HardwareConfig], float]:
    case = AttentionCase(**kw)  # type: ignore[arg-type]
    return lambda hw: attention_case_tflops(case, hw)


def _attr(name: str) -> Callable[[HardwareConfig], float]:
    return lambda hw: float(getattr(hw, name))


def h100_figures() -> list[Figure]:
    """Every published H100-class figure the model is fitted to or checked against."""
    figs: list[Figure] = []
    # -- kernel efficiency vs tokens per call (FA3 causal forward, one H100, b=1, 64:8 heads).
    for n, lo, hi, role in (
        (1024, 280, 280, "fit"),
        (2048, 585, 585, "check"),
        (8192, 655, 680, "check"),
        (16384, 655, 680, "check"),
        (32768, 655, 680, "fit"),
    ):
        figs.append(
            Figure(
                f"fa3-kernel-{n // 1024}k",
                "MagiAttention kernel charts, h100/causal_mask/fwd (read off, about +-10)",
                f"FA3 causal fwd, 1 x H100, {n // 1024}K tokens, 64/8 heads, hd 128",
                "TFLOP/s",
                lo,
                hi,
                role,
                _tflops(q_heads=64, kv_heads=8, tokens_per_gpu=n),
            )
        )
    # -- distributed attention, 8K tokens per GPU, 64/8 heads (MagiAttention "Distributed Level").
    magi = {
        ("ring", "fwd"): (420, 455, 450, 447),
        ("ulysses", "fwd"): (600, 557, 580, 585),
        ("ring", "bwd"): (432, 475, 470, 457),
        ("ulysses", "bwd"): (582, 560, 573, 585),
    }
    for (mode, passes), values in magi.items():
        for cp, v in zip((8, 16, 32, 64), values, strict=True):
            fit = (mode, passes, cp) in {("ring", "fwd", 8), ("ulysses", "bwd", 8)}
            role = "fit" if fit else "check"
            figs.append(
                Figure(
                    f"magi-{mode}-{passes}-cp{cp}",
                    MAGI,
                    f"{mode} {passes}, causal, CP {cp}, 8K tokens/GPU, 64/8 heads",
                    "TFLOP/s",
                    v,
                    v,
                    role,
                    _tflops(
                        q_heads=64,
                        kv_heads=8,
                        tokens_per_gpu=8192,
                        cp=cp,
                        mode=mode,
                        passes=passes,
                    ),
                )
            )
    for mode, lo, hi in (("ring", 511, 535), ("ulysses", 575, 620)):
        for cp in (8, 64):
            figs.append(
                Figure(
                    f"magi-{mode}-full-fwd-cp{cp}",
                    MAGI,
                    f"{mode} fwd, full mask, CP {cp} (published range over CP 8-64)",
                    "TFLOP/s",
                    lo,
                    hi,
                    "check",
                    _tflops(
                        q_heads=64,
                        kv_heads=8,
                        tokens_per_gpu=8192,
                        cp=cp,
                        mode=mode,
                        causal=False,
                    ),
                )
            )
    # -- links (taken as published: the model's constant is the figure).
    for key, src, setting, lo, hi, attr in (
        (
            "nccl-a2a-inter",
            NCCL_A2A,
            "all-to-all across nodes, NDR 400G: one NIC",
            46,
            49,
            "inter_node_gbs",
        ),
        (
            "nccl-intra-bw",
            NCCL_BW,
            "NVLink, large messages, NCCL effective",
            370,
            370,
            "nvlink_gbs",
        ),
        ("nccl-p2p-bw", NCCL_BW, "2-GPU send/recv inside a node", 80, 180, "p2p_gbs"),
        ("nccl-p2p-lat", NCCL_LAT, "send/recv, small messages", 3.0, 3.7, "p2p_latency_us"),
        (
            "nccl-a2a-lat",
            NCCL_LAT,
            "8-GPU all-to-all, small messages (H20)",
            10.5,
            10.5,
            "latency_us",
        ),
        (
            "nccl-inter-lat",
            NCCL_LAT,
            "2-node all-reduce, small messages (H20)",
            46,
            46,
            "inter_node_latency_us",
        ),
    ):
        unit = "us" if attr.endswith("_us") else "GB/s"
        figs.append(Figure(key, src, setting, unit, lo, hi, "direct", _attr(attr)))
    return figs


# ring-flash-attention's README (8 GPUs, 8K tokens per GPU, 32/8 heads): iter/s of the single-GPU
# flash_attn, the zigzag ring, the single-GPU varlen and the zigzag ring varlen, per pass set.
RFA_FIGURES = {
    "h800": {"fwd": (591.5, 63.0, 852.4, 74.8), "fwd+bwd": (154.7, 17.4, 225.4, 21.4)},
    "a100": {"fwd": (373.4, 38.2, 532.3, 47.9), "fwd+bwd": (94.7, 10.6, 133.8, 13.4)},
}


def rfa_hardware(h100: HardwareConfig, gpu: str) -> HardwareConfig:
    """The GPU of a ring-flash-attention row, from the H100 fit: H800 has H100 compute and HBM
    and NVLink 400 GB/s both ways; A100: 312 TFLOP/s bf16, NVLink 600 GB/s both ways, HBM
    2.0 TB/s (the 80 GB part; the README does not say which A100, and the 40 GB part's
    1.555 TB/s would make the ring overhead dearer)."""
    if gpu == "h800":
        return dataclasses.replace(h100, name="h800-fa2", nvlink_gbs=200.0)
    return dataclasses.replace(
        h100, name="a100-fa2", peak_tflops=312.0, hbm_tbs=2.0, nvlink_gbs=300.0, p2p_gbs=100.0
    )


def ring_flash_attention_figures(h100: HardwareConfig) -> list[tuple[Figure, HardwareConfig]]:
    """ring-flash-attention on 8 x H800 and 8 x A100 (FA2 kernels): checks of the ring term
    and of the varlen choice on other kernels and GPUs.

    The FA2 kernel efficiency of each GPU (forward and backward fractions scaled together, their
    H100 ratio kept) is fitted to the same source's single-GPU, single-document ``flash_attn``
    figure, keeping the H100 fit's call overhead; the ring overhead term is the H100 fit's in
    HBM bytes, unchanged, so the zigzag ring figures check it on other kernels and (A100) other
    HBM; the varlen rows check that no per-document kernel cost is needed.
    """
    out = []
    one = AttentionCase(q_heads=32, kv_heads=8, tokens_per_gpu=8192)
    varlen = _varlen_fraction()
    for gpu, rows in RFA_FIGURES.items():
        for passes, (single_its, ring_its, v_single, v_ring) in rows.items():
            kernel = dataclasses.replace(one, passes=passes)
            hw = _solve_scale(kernel, rfa_hardware(h100, gpu), 1e3 / single_its)
            ring = dataclasses.replace(kernel, cp=8, mode="ring")
            for key, case, value, what in (
                ("zigzag", ring, ring_its, "zigzag ring"),
                ("varlen-single", dataclasses.replace(kernel, work_fraction=varlen), v_single,
                 "flash_attn varlen, one GPU"),
                ("varlen-zigzag", dataclasses.replace(ring, work_fraction=varlen), v_ring,
                 "zigzag ring varlen"),
            ):  # fmt: skip
                layout = (
                    f", the benchmark's 4 document layouts (work fraction {varlen:.3f}), no "
                    "per-document term"
                    if "varlen" in key
                    else ""
                )
                out.append(
                    (
                        Figure(
                            f"rfa-{gpu}-{key}-{passes}",
                            RFA,
                            f"{what} {passes}, 8 x {gpu.upper()}, 8K tokens/GPU, 32/8 heads, FA2 "
                            f"(efficiency from the single-GPU {single_its} iter/s){layout}",
                            "iter/s",
                            value,
                            value,
                            "check",
                            lambda h, case=case: 1e3 / attention_case_ms(case, h),
                        ),
                        hw,
                    )
                )
    return out


# ring-flash-attention's varlen benchmark cycles through these per-GPU document layouts
# (``cu_seqlens`` in benchmark/benchmark_varlen_kvpacked_func.py), 8K tokens each.
RFA_VARLEN_LAYOUTS = (
    (8192,),
    (256, 7392, 544),
    (4096, 4096),
    (3104, 3200, 1600, 160, 128),
)


def _varlen_fraction() -> float:
    """Mean over the layouts of sum(doc^2) / 8192^2: the attention work relative to one doc."""
    fr = [sum(x * x for x in lay) / float(sum(lay)) ** 2 for lay in RFA_VARLEN_LAYOUTS]
    return sum(fr) / len(fr)


def _scale_fractions(hw: HardwareConfig, scale: float) -> HardwareConfig:
    """``hw`` with forward and backward attention fractions both times ``scale``."""
    fwd = hw.attention_flops / (hw.peak_tflops * 1e12)
    bwd = hw.attention_bwd_flops / (hw.peak_tflops * 1e12)
    return dataclasses.replace(
        hw, attention_fraction=fwd * scale, attention_bwd_fraction=bwd * scale
    )


def _solve_scale(case: AttentionCase, hw: HardwareConfig, target_ms: float) -> HardwareConfig:
    """``hw`` with attention fractions scaled until ``case`` takes ``target_ms``."""
    lo, hi = 1e-3, 1.0 / max(hw.attention_flops, hw.attention_bwd_flops) * hw.peak_tflops * 1e12
    for _ in range(200):
        mid = (lo + hi) / 2
        t = attention_case_ms(case, _scale_fractions(hw, mid))
        lo, hi = (mid, hi) if t > target_ms else (lo, mid)
    return _scale_fractions(hw, (lo + hi) / 2)


def fit_h100(base: HardwareConfig) -> HardwareConfig:
    """The H100 terms from the fit set only (``role == "fit"`` or ``"direct"``).

    - ``attention_fraction`` and ``attn_call_overhead_us``: the FA3 kernel curve's two ends
      (1K: 280, 32K: 680 TFLOP/s), solved exactly (time = FLOPs / rate + overhead is linear in
      1 / rate and the overhead);
    - ``attention_bwd_fraction``: Ulysses backward at CP 8 (582 TFLOP/s), by bisection (no
      single-GPU backward curve in the set);
    - ``ring_step_overhead_bytes_per_elem``: ring forward at CP 8 (420 TFLOP/s), by bisection
      (the predicted throughput falls as the term grows);
    - link constants: the published figures (midpoints of ranges).

    Everything else in ``h100_figures`` is a check this fit never sees.
    """
    hw = dataclasses.replace(
        base,
        inter_node_gbs=47.5,
        nvlink_gbs=370.0,
        p2p_gbs=130.0,
        p2p_latency_us=3.5,
        latency_us=10.5,
        inter_node_latency_us=46.0,
    )
    small = AttentionCase(q_heads=64, kv_heads=8, tokens_per_gpu=1024)
    large = AttentionCase(q_heads=64, kv_heads=8, tokens_per_gpu=32768)
    t_small = small.flops_per_gpu() / 280e12
    t_large = large.flops_per_gpu() / 680e12
    rate = (large.flops_per_gpu() - small.flops_per_gpu()) / (t_large - t_small)
    overhead_s = t_small - small.flops_per_gpu() / rate
    hw = dataclasses.replace(
        hw,
        attention_fraction=rate / (hw.peak_tflops * 1e12),
        attn_call_overhead_us=overhead_s * 1e6,
    )
    uly = AttentionCase(
        q_heads=64, kv_heads=8, tokens_per_gpu=8192, cp=8, mode="ulysses", passes="bwd"
    )
    lo, hi = 1e-3, 1.0
    for _ in range(200):
        mid = (lo + hi) / 2
        got = attention_case_tflops(uly, dataclasses.replace(hw, attention_bwd_fraction=mid))
        lo, hi = (lo, mid) if got > 582.0 else (mid, hi)
    hw = dataclasses.replace(hw, attention_bwd_fraction=(lo + hi) / 2)
    ring = AttentionCase(q_heads=64, kv_heads=8, tokens_per_gpu=8192, cp=8, mode="ring")
    lo, hi = 0.0, 1e4
    for _ in range(200):
        mid = (lo + hi) / 2
        got = attention_case_tflops(
            ring, dataclasses.replace(hw, ring_step_overhead_bytes_per_elem=mid)
        )
        lo, hi = (mid, hi) if got > 420.0 else (lo, mid)
    return dataclasses.replace(hw, ring_step_overhead_bytes_per_elem=(lo + hi) / 2)


@dataclass(frozen=True)
class Row:
    """One line of the calibration table."""

    key: str
    role: str
    setting: str
    source: str
    unit: str
    published: str
    predicted: float
    error: float


def calibration_table(hw: HardwareConfig) -> list[Row]:
    """Every figure (H100 set and the H800 ring check) with the model's prediction."""
    pairs = [(f, hw) for f in h100_figures()] + ring_flash_attention_figures(hw)
    rows = []
    for fig, h in pairs:
        pred = fig.predict(h)
        pub = f"{fig.low:g}" if fig.low == fig.high else f"{fig.low:g}-{fig.high:g}"
        rows.append(
            Row(fig.key, fig.role, fig.setting, fig.source, fig.unit, pub, pred, fig.error(pred))
        )
    return rows


def worst_error(rows: list[Row], role: str = "check") -> float:
    """Largest absolute relative error among rows of ``role``."""
    errs = [abs(r.error) for r in rows if r.role == role]
    return max(errs) if errs else math.nan
