"""One parser for token counts and sizes, shared by every flag that takes them (pure Python).

Meaning (docs/units.md): a suffix is *decimal*: ``k`` = 1000 and ``m`` = 1000000, so ``192k`` is
192000 everywhere: ``plan``/``bench --max-seq``, ``demo --token-budget`` and Megatron's
``--hsp-max-seq`` / ``--hsp-token-budget``. Decimal is FlexSP's convention (its harness computes
``seq_limit_k * 1000``) and the planner's published reproductions depend on it; a binary length
is written out in full (``196608``). One rule in one place: callers never re-implement it.
"""

from __future__ import annotations

import math
import re

from megatron_hsp.planner.errors import InputError

TOKEN_SCALE = {"": 1, "k": 1000, "m": 1000 * 1000}
#: Far above any trainable sequence or batch, yet small enough that sums over a batch stay exact
#: in int64 and float64; values above it are refused rather than overflowing somewhere later.
MAX_TOKENS = 10**12
_TOKENS = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([kKmM]?)\s*")


def parse_tokens(value: str | int, flag: str = "token count") -> int:
    """``192k`` -> 192000, ``1.5k`` -> 1500, ``2m`` -> 2000000, ``4096`` -> 4096.

    Raises :class:`InputError` naming ``flag`` when the text is not a positive whole number of
    tokens (after scaling) within :data:`MAX_TOKENS`.
    """
    text = str(value)
    m = _TOKENS.fullmatch(text)
    if not m:
        raise InputError(f"{flag} {text!r} is not a token count; use e.g. 4096, 192k or 2m")
    scaled = float(m.group(1)) * TOKEN_SCALE[m.group(2).lower()]
    if not math.isfinite(scaled) or scaled != int(scaled):
        raise InputError(f"{flag} {text!r} is not a whole number of tokens; use e.g. 192k")
    n = int(scaled)
    if n <= 0:
        raise InputError(f"{flag} must be a positive token count, got {text!r}")
    if n > MAX_TOKENS:
        raise InputError(f"{flag} {text!r} exceeds {MAX_TOKENS:.0e} tokens; use a smaller value")
    return n


def tokens_to_k(tokens: int) -> float:
    """Token count in the cost model's ``max_seq_k`` unit (the same decimal k as the parser)."""
    return tokens / TOKEN_SCALE["k"]


def check_range(
    value: float,
    flag: str,
    *,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
) -> float:
    """Range check for a numeric flag: finite, ``low <= value <= high`` (``>`` when ``low_open``).

    Raises :class:`InputError` with one line naming ``flag`` and the accepted range.
    """
    rng = (
        f"{'>' if low_open else '>='} {low:g}" if low is not None else "",
        f"<= {high:g}" if high is not None else "",
    )
    want = " and ".join(x for x in rng if x) or "a finite number"
    try:
        v = float(value)
    except OverflowError:  # an int with hundreds of digits: far outside any range we accept
        shown = str(value)
        raise InputError(f"{flag} must be {want}, got a {len(shown)}-digit number") from None
    except (TypeError, ValueError):
        raise InputError(f"{flag} must be a number ({want}), got {value!r}") from None
    if not math.isfinite(v):
        raise InputError(f"{flag} must be finite ({want}), got {value!r}")
    if low is not None and (v <= low if low_open else v < low):
        raise InputError(f"{flag} must be {want}, got {value!r}")
    if high is not None and v > high:
        raise InputError(f"{flag} must be {want}, got {value!r}")
    return value
