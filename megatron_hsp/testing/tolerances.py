"""The one table of how far HSP's loss, gradients and weights may differ from a reference.

Every exactness check reads it: the CPU selftest (``selftest.py``: HSP on gloo ranks against
one process), the Megatron loop (``megatron_loop/checks.py``: Megatron's own ``train_step``
with HSP against the stock path) and the GPU acceptance kit (``acceptance.py``, per dtype).
The figures behind each entry are in docs/exactness.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Tolerance:
    """Allowed relative differences from the reference.

    ``loss``: |loss - loss_ref| / |loss_ref| of a step. ``grad``: per parameter,
    max |g - g_ref| / max |g_ref|. ``weight``: per parameter after the steps,
    max |w - w_ref| / max |w_ref - w_init| (the error relative to the parameter's own update);
    None where a check compares no weights.
    """

    loss: float
    grad: float
    weight: float | None = None


TOLERANCES: dict[str, Tolerance] = {
    # fp32 on CPU ranks: noise measured at or below 1e-6, so 1e-5 on gradients keeps clean runs
    # well inside and a 1e-4 error 10x outside.
    "cpu-fp32": Tolerance(loss=1e-6, grad=1e-5, weight=1e-3),
    # GPUs: the CPU figures widened 10x for GPU reduction order.
    "gpu-fp32": Tolerance(loss=1e-5, grad=1e-4),
    # fp32 where TF32 could not be turned off (10-bit mantissa, 2^-11 relative per product).
    "gpu-tf32": Tolerance(loss=2e-3, grad=1e-2),
    # bf16's 8-bit mantissa (2^-8 = 0.4% relative) over two layers and a loss over a few
    # hundred tokens.
    "gpu-bf16": Tolerance(loss=2e-2, grad=5e-2),
}

#: bf16 rows are also judged against stock megatron-core's own bf16 noise: a parameter whose
#: gradient sums many cancelling terms (a norm bias over a 1,000-token document) differs from
#: the fp32 reference by 20-25% in stock bf16 alone, far above ``gpu-bf16``'s 5%. Such a
#: parameter may differ by this factor times the stock bf16 model's own difference (the same
#: reference weights rounded to bf16, one document at a time, on the host CPU).
BF16_NOISE_FACTOR = 3.0

#: The CPU checks' entry (selftest and the Megatron loop).
CPU = TOLERANCES["cpu-fp32"]


def gpu_tolerance(dtype: str, tf32_forced: bool = False) -> Tolerance:
    """The acceptance kit's entry for ``dtype`` ("fp32" or "bf16"); fp32 with TF32 forced on
    takes the TF32 entry."""
    return TOLERANCES["gpu-tf32" if tf32_forced and dtype == "fp32" else f"gpu-{dtype}"]


# ------------------------------------------------------------------ bf16 from bf16's precision
#: bf16's unit roundoff: 8 significant bits, round to nearest, |fl(x) - x| <= 2^-8 |x|.
BF16_UNIT_ROUNDOFF = 2.0**-8
#: fp32 sums of at most 2^12 terms (a row of keys, a column of queries, a head dim, the ring's
#: merges): gamma_n = n * 2^-24 <= 2^-12 of the sum of the terms' magnitudes.
FP32_SUM_SLACK = 2.0**-12


def bf16_attention_bounds(
    dense: dict[str, Any],
    scale: float,
    rounded_partial_outputs: bool = True,
    rounded_partial_grads: bool = True,
) -> dict[str, Any]:
    """Elementwise bounds on |x - x_exact| for attention's out, dq, dk, dv computed from bf16
    q, k, v, dout by a ring (or any blockwise kernel) that computes each block in fp32, merges
    and accumulates in fp32 and rounds to bf16 only (i) each block's partial output (as flash
    returns it; ``rounded_partial_outputs``), (ii) each block's partial dq/dk/dv (as flash
    returns them; ``rounded_partial_grads``), (iii) the final out, saved in bf16 for backward,
    and (iv) the final dq, dk, dv. ``dense``: the float64 dense attention on the same (bf16)
    inputs, one KV head per query head (``tests/helpers/ring_setup.dense_forward_backward``:
    p [h, T, T], ds = p (dP - delta), q, k, v, dout, out, dq, dk, dv).

    Derivation, u = 2^-8, g = ``FP32_SUM_SLACK``, P|V| the attention of |v| (the bound applies
    to every row in every head and dimension):

    - out: the final rounding costs u|O|. Each partial o_s (a convex combination of its block's
      v rows) rounded costs u|o_s| and enters with its softmax weight w_s; sum_s w_s |o_s| <=
      P|V|. fp32 sums: g P|V|. So |dO_err| <= u|O| + (u + g) P|V| (u dropped with (i) off).
    - delta = rowsum(dO * O_bf16) (flash and the tiled kernel both read the saved bf16 out):
      |delta_err| <= E = sum_d |dO| (out bound + g|O|); dP = dO V^T in fp32: g |dO||V|^T.
    - dv = P^T dO: partials rounded u sum_calls |dv_s| <= u P^T|dO|; final u|dV|.
    - dq = scale DS K with DS = P (dP - delta): the delta and dP errors move DS by at most
      dS_err = P (E + g |dO||V|^T), i.e. dq by scale dS_err |K|; partials rounded: u scale
      |DS| |K|; final u|dQ|. dk likewise with Q: scale dS_err^T |Q| + u scale |DS|^T |Q| +
      u|dK|.

    Second-order terms (the final rounding of an already wrong value, u times the bound) are
    covered by the factor 1 + 2u. A bug that rounds anything else to bf16 (the running output
    of the ring's merges, an accumulator) adds its own u-sized terms: on inputs where the terms
    above vanish (partials exactly representable) it stands out by several times the bound.
    """
    import torch

    u, g = BF16_UNIT_ROUNDOFF, FP32_SUM_SLACK
    wo = (u if rounded_partial_outputs else 0.0) + g
    wg = (u if rounded_partial_grads else 0.0) + g
    p, ds = dense["p"], dense["ds"]
    aq, ak, av, ado = (dense[n].abs() for n in ("q", "k", "v", "dout"))
    out = dense["out"]
    b_out = u * out.abs() + wo * torch.einsum("hab,bhd->ahd", p, av)
    e = (ado * (b_out + g * out.abs())).sum(-1).transpose(0, 1)  # [h, T]: delta's error
    # The error of ds: p times delta's error and dP's fp32 error (g |dO||V|).
    dse = p * (e[..., None] + g * torch.einsum("ahd,bhd->hab", ado, av))
    b_dv = u * dense["dv"].abs() + wg * torch.einsum("hab,ahd->bhd", p, ado)
    b_dq = u * dense["dq"].abs() + scale * (
        wg * torch.einsum("hab,bhd->ahd", ds.abs(), ak) + torch.einsum("hab,bhd->ahd", dse, ak)
    )
    b_dk = u * dense["dk"].abs() + scale * (
        wg * torch.einsum("hab,ahd->bhd", ds.abs(), aq) + torch.einsum("hab,ahd->bhd", dse, aq)
    )
    return {
        n: (1 + 2 * u) * b
        for n, b in zip(("out", "dq", "dk", "dv"), (b_out, b_dq, b_dk, b_dv), strict=True)
    }
