"""Cost-model specs: strict YAML/JSON reading, number checks, explicit coefficients.

Split out of ``costmodel.py``. Why strict: a cost model file is user input that
steers every plan; duplicate keys, aliases, text where a number belongs or a negative cost would
otherwise surface far from their cause (docs/reliability.md).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from megatron_hsp.planner.cost.costcore import RING_AND_LATENCY_KEYS, CostModel
from megatron_hsp.planner.errors import InputError
from megatron_hsp.planner.groupspace import HeadSpace
from megatron_hsp.planner.routes import ROUTES, check_routes
from megatron_hsp.planner.units import MAX_TOKENS

_TOP_KEYS = {
    "preset",
    "name",
    "memory_cap_gb",
    "max_seq_k",
    "flexsp",
    "coefficients",
    "model",
    "hardware",
    "training",
    "source",
    "details",
}


# A cost model is a few hundred bytes; this bounds what a hostile file can make the parser do.
MAX_SPEC_BYTES = 1 << 20
# Nesting of a cost model is 3-4 levels; PyYAML's flow parser is super-linear in bracket depth
# (80 KB of nested brackets ran for minutes), so depth is counted before any parser runs.
MAX_SPEC_NESTING = 16
# Leading spaces on a line: block nesting, bounded for the same reason.
MAX_SPEC_INDENT = 64
#: The most a cost model may price one group of a micro-batch holding its full capacity
#: (about 31 years): far above any real figure, low enough that sums over a step stay finite and
#: the solvers' tolerances meaningful. A coefficient that prices above it (1e308: overflow to
#: inf) is refused, naming it.
MAX_PRICE_MS = 1e12


def _check_nesting(text: str) -> None:
    """Bracket depth (outside quotes) and indentation bounded in one pass, before parsing."""
    depth = worst = 0
    quote = ""
    for ch in text:
        if quote:
            if ch == quote:
                quote = ""
        elif ch in "\"'":
            quote = ch
        elif ch in "[{":
            depth += 1
            worst = max(worst, depth)
            if worst > MAX_SPEC_NESTING:
                raise InputError(
                    f"brackets nested deeper than {MAX_SPEC_NESTING} levels; a cost model "
                    "needs 3 or 4"
                )
        elif ch in "]}":
            depth -= 1
        elif ch == "\n":
            quote = ""  # an unclosed quote ends with its line (YAML flow scalars aside)
    for lineno, line in enumerate(text.splitlines(), start=1):
        indent = len(line) - len(line.lstrip(" \t"))
        if indent > MAX_SPEC_INDENT and line.strip():
            raise InputError(
                f"line {lineno} is indented {indent} columns (nesting); a cost model needs at "
                f"most {MAX_SPEC_INDENT}"
            )


def _no_duplicates(pairs: list[tuple[Any, Any]]) -> dict:
    out: dict = {}
    for key, value in pairs:
        if key in out:
            raise InputError(f"key {key!r} appears twice (the last would silently win)")
        out[key] = value
    return out


def _strict_json(text: str) -> Any:
    import json

    return json.loads(text, object_pairs_hook=_no_duplicates)


def _strict_yaml(text: str) -> Any:
    """YAML without duplicate keys and without anchors or aliases: a 500-byte file of nested
    aliases expands to billions of nodes (a hang; docs/reliability.md); a cost model needs none."""
    import yaml

    for event in yaml.parse(text, Loader=yaml.SafeLoader):
        if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None):
            raise InputError("YAML anchors and aliases are not allowed in a cost model")

    class StrictLoader(yaml.SafeLoader):
        def construct_mapping(self, node: Any, deep: bool = False) -> dict:
            self.flatten_mapping(node)
            return _no_duplicates(
                [
                    (self.construct_object(k, deep=deep), self.construct_object(v, deep=deep))
                    for k, v in node.value
                ]
            )

    return yaml.load(text, Loader=StrictLoader)


def _read_spec_file(path: Path) -> Mapping[str, Any]:
    if not path.is_file():
        raise InputError(f"--cost-model file {str(path)!r} does not exist")
    if path.stat().st_size > MAX_SPEC_BYTES:
        raise InputError(
            f"--cost-model file {str(path)!r} is {path.stat().st_size} bytes; a cost model is "
            f"at most {MAX_SPEC_BYTES} bytes"
        )
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"--cost-model file {str(path)!r} cannot be read: {exc}") from None
    try:
        _check_nesting(text)
        data = _strict_json(text) if path.suffix == ".json" else _strict_yaml(text)
    except InputError as exc:
        raise InputError(f"--cost-model file {str(path)!r}: {exc}") from None
    except Exception as exc:  # parser errors: name the file, first line of the message only
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise InputError(
            f"--cost-model file {str(path)!r} is not valid YAML/JSON: {first}"
        ) from None
    if not isinstance(data, Mapping):
        raise InputError(f"--cost-model file {str(path)!r} must hold a mapping at top level")
    return data


def _dataclass_from(cls: type, section: str, data: Mapping[str, Any], **defaults: Any) -> Any:
    allowed = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - allowed)
    if unknown:
        raise InputError(
            f"cost model spec: unknown {section} keys {unknown}; allowed: {sorted(allowed)}"
        )
    try:
        return cls(**{**defaults, **dict(data)})
    except TypeError as exc:
        raise InputError(f"cost model spec: {section} section: {exc}") from None


def _size_map(value: Any, key: str) -> dict[int, float]:
    if isinstance(value, int | float):
        return {0: float(value)}
    if not isinstance(value, Mapping):
        raise InputError(f"cost model spec: coefficients.{key} must be a number or {{size: ms}}")
    return {int(k): float(v) for k, v in value.items()}


def _from_coefficients(name: str, co: Mapping[str, Any], cap_gb: float | None) -> CostModel:
    allowed = {
        "attn_ms_per_token2",
        "linear_ms_per_token",
        "group_fixed_ms",
        "a2a_ms_per_token",
        "a2a_bytes_per_token",
        "a2a_gbs",
        "tokens_per_rank",
        "model_states_gb",
        "act_mib_per_token",
        "heads",
        "pass_barrier",
        "ring_step_ms_per_token",
        "attn_route_factor",
        "ring_route",
        *RING_AND_LATENCY_KEYS,
    }
    unknown = sorted(set(co) - allowed)
    if unknown:
        raise InputError(
            f"cost model spec: unknown coefficients keys {unknown}; allowed: {sorted(allowed)}"
        )
    for key in ("attn_ms_per_token2", "linear_ms_per_token"):
        if key not in co:
            raise InputError(f"cost model spec: coefficients.{key} is required")
    if "a2a_ms_per_token" in co:
        a2a = {
            k: v for k, v in _size_map(co["a2a_ms_per_token"], "a2a_ms_per_token").items() if k > 1
        }
    elif "a2a_bytes_per_token" in co and "a2a_gbs" in co:
        # FlexSP-style: bytes / d at the measured bandwidth of d (GB/s = bytes/ns -> ms).
        nbytes = float(co["a2a_bytes_per_token"])
        bw = {int(k): float(v) for k, v in co["a2a_gbs"].items()}
        a2a = {d: nbytes / d / (b * 1e9) * 1e3 for d, b in bw.items() if d > 1}
    else:
        raise InputError(
            "cost model spec: coefficients need a2a_ms_per_token ({size: ms per token}) or "
            "a2a_bytes_per_token plus a2a_gbs ({size: GB/s})"
        )
    if "tokens_per_rank" in co:
        raw = co["tokens_per_rank"]
        if isinstance(raw, bool) or (isinstance(raw, float) and not raw.is_integer()):
            raise InputError(
                f"cost model spec: tokens_per_rank must be a whole number of tokens, got {raw!r}"
            )
        tokens = int(raw)
    elif "model_states_gb" in co and "act_mib_per_token" in co:
        if cap_gb is None:
            raise InputError("cost model spec: memory_cap_gb is needed with model_states_gb")
        tokens = int(
            (cap_gb * 1024 - float(co["model_states_gb"]) * 1024) / float(co["act_mib_per_token"])
        )
    else:
        raise InputError(
            "cost model spec: coefficients need tokens_per_rank, or model_states_gb plus "
            "act_mib_per_token (with memory_cap_gb)"
        )
    return CostModel(
        name=name,
        attn_ms_per_token2=float(co["attn_ms_per_token2"]),
        linear_ms_per_token=float(co["linear_ms_per_token"]),
        group_fixed_ms=_size_map(co.get("group_fixed_ms", 0.0), "group_fixed_ms"),
        a2a_ms_per_token=a2a,
        tokens_per_rank=tokens,
        source="explicit coefficients",
        heads=_heads(co.get("heads")),
        pass_barrier=bool(co.get("pass_barrier", False)),
        attn_route_factor=_route_factors(co.get("attn_route_factor", {})),
        ring_route=_ring_route(co.get("ring_route", {})),
        **{
            key: {k: v for k, v in _size_map(co.get(key, {}), key).items() if k > 1}
            for key in RING_AND_LATENCY_KEYS
        },
    )


def _route_factors(value: Any) -> dict[str, float]:
    """``coefficients.attn_route_factor``: {route: factor on attn_ms_per_token2}."""
    if not isinstance(value, Mapping):
        raise InputError(
            f"cost model spec: coefficients.attn_route_factor must be {{route: factor}} with "
            f"routes from {ROUTES}, got {value!r}"
        )
    unknown = sorted(str(k) for k in value if k not in ROUTES)
    if unknown:
        raise InputError(
            f"cost model spec: coefficients.attn_route_factor has unknown routes {unknown}; "
            f"routes: {ROUTES}"
        )
    return {str(k): float(v) for k, v in value.items()}


def _ring_route(value: Any) -> dict[int, str]:
    """``coefficients.ring_route``: {group size: ring route}, 0 for every size."""
    if not isinstance(value, Mapping):
        raise InputError(
            f"cost model spec: coefficients.ring_route must be {{size: route}}, got {value!r}"
        )
    return check_routes(value, "cost model spec: coefficients.ring_route")


# ------------------------------------------------------------------ validation
# Spec leaves that are text or flags rather than numbers; every other leaf must be a finite number.
_TEXT_KEYS = {"name", "preset", "source"}
# Text leaves of the training section (Megatron's recompute flags; ``TrainingConfig`` checks them).
_TRAINING_TEXT_KEYS = {"recompute_method", "recompute_modules"}
# Sections whose leaves are text ({size: route name}); ``_ring_route`` checks them.
_TEXT_SECTIONS = {"ring_route"}
_BOOL_KEYS = {"gated", "tied_embeddings", "recompute", "pass_barrier"}
# Numbers that may be zero (a free attention term, no fixed cost); the rest must be > 0.
_MAY_BE_ZERO = {
    "attn_ms_per_token2",
    "group_fixed_ms",
    "a2a_ms_per_token",
    "ring_step_ms_per_token",
    "a2a_fixed_ms",
    "ring_step_fixed_ms",
    "ring_step_extra_ms_per_token",
    "b1",
    "a1",
    "latency_us",
    "inter_node_latency_us",
    "p2p_latency_us",
    "p2p_gbs",
    "attn_call_overhead_us",
    "ring_step_overhead_bytes_per_elem",
    "host_call_overhead_us",
    "microbatch_overhead_ms",
    "zero_stage",
    "recompute_num_layers",  # block recompute of 0 layers (TrainingConfig checks the method)
    "model_states_gb",
    "details",
}


def _check_spec_numbers(data: Mapping[str, Any], where: str = "") -> None:
    """Reject strings, NaN, infinities and negatives anywhere in a spec before it is used.

    Why: a bad leaf otherwise surfaces far away (a ``ValueError`` traceback, a NaN that makes
    every schedule infeasible, a negative cost the solver chases forever). The message names
    the field by its dotted path and says what would work.
    """
    for key, value in data.items():
        path = f"{where}.{key}" if where else str(key)
        base = where.split(".")[0] if where else str(key)
        if str(key) == "name" or (not where and str(key) in _TEXT_KEYS):
            continue
        if where == "training" and str(key) in _TRAINING_TEXT_KEYS:
            continue
        if str(key) in _TEXT_SECTIONS and where:
            continue
        if isinstance(value, Mapping):
            _check_spec_numbers(value, path)
            continue
        if isinstance(value, list | tuple):
            # [query, kv] heads: each a positive number; ``_heads`` checks the pairing.
            _check_spec_numbers({f"{i}": v for i, v in enumerate(value)}, path)
            continue
        if str(key) in _BOOL_KEYS:
            if not isinstance(value, bool):
                raise InputError(f"cost model spec: {path} = {value!r} must be true or false")
            continue
        # {size: value} maps (a2a_gbs, params_b, ...) take their rule from the map's own name.
        leaf = where.split(".")[-1] if where and str(key).lstrip("-").isdigit() else str(key)
        if isinstance(value, bool) or not isinstance(value, int | float):
            hint = ""
            if isinstance(value, str) and value.strip().lstrip("+-")[:1].isdigit():
                hint = " (YAML 1.1 reads 1e-6 as text: write 1.0e-6)"
            raise InputError(f"cost model spec: {path} = {value!r} must be a number{hint}")
        if not math.isfinite(value):
            raise InputError(f"cost model spec: {path} = {value!r} must be a finite number")
        zero_ok = leaf in _MAY_BE_ZERO or base in _MAY_BE_ZERO
        if value < 0 or (value == 0 and not zero_ok):
            want = ">= 0" if zero_ok else "> 0"
            raise InputError(f"cost model spec: {path} = {value!r} must be {want}")


def validate_cost_model(model: CostModel) -> CostModel:
    """Check a resolved model: every coefficient finite, times positive, sizes sensible.

    Why here and not only on the spec: presets and first-principles models are derived, and a
    derived coefficient can still come out zero or negative (e.g. a tiny memory cap). The planner
    relies on ``linear_ms_per_token > 0`` (a plan's time grows with its tokens, so its lower
    bound holds and the search terminates) and on non-negative attention, fixed and all-to-all
    terms.
    """
    name = model.name

    def bad(field_: str, value: object, want: str) -> InputError:
        return InputError(f"cost model {name!r}: {field_} = {value!r}; it must be {want}")

    for field_, value, zero_ok in (
        ("attn_ms_per_token2", model.attn_ms_per_token2, True),
        ("linear_ms_per_token", model.linear_ms_per_token, False),
    ):
        v = float(value)
        if not math.isfinite(v) or v < 0 or (v == 0 and not zero_ok):
            raise bad(field_, value, "a finite number " + (">= 0" if zero_ok else "> 0"))
    for field_, mapping in (
        ("group_fixed_ms", model.group_fixed_ms),
        ("a2a_ms_per_token", model.a2a_ms_per_token),
        ("ring_step_ms_per_token", model.ring_step_ms_per_token),
        ("a2a_fixed_ms", model.a2a_fixed_ms),
        ("ring_step_fixed_ms", model.ring_step_fixed_ms),
        ("ring_step_extra_ms_per_token", model.ring_step_extra_ms_per_token),
    ):
        for d, v in mapping.items():
            if not isinstance(d, int) or d < 0:
                raise bad(f"{field_} key", d, "a group size (integer >= 1, or 0 for all sizes)")
            if not math.isfinite(float(v)) or float(v) < 0:
                raise bad(f"{field_}[{d}]", v, "a finite number >= 0")
    for route, v in model.attn_route_factor.items():
        if route not in ROUTES:
            raise bad("attn_route_factor key", route, f"one of {ROUTES}")
        if not math.isfinite(float(v)) or float(v) <= 0:
            raise bad(f"attn_route_factor[{route}]", v, "a finite number > 0")
    check_routes(model.ring_route, f"cost model {name!r}: ring_route")
    if not model.a2a_ms_per_token and not isinstance(model.a2a_ms_per_token, Mapping):
        raise bad("a2a_ms_per_token", model.a2a_ms_per_token, "a {size: ms per token} mapping")
    if not 0 < int(model.tokens_per_rank) <= MAX_TOKENS:
        raise bad("tokens_per_rank", model.tokens_per_rank, f"between 1 and {MAX_TOKENS:.0e}")
    _check_prices(model)
    return model


def _check_prices(model: CostModel) -> None:
    """Every coefficient times the most a group can hold of its unit stays finite and within
    ``MAX_PRICE_MS``; otherwise it is refused naming the coefficient and the price it makes.

    Why: a finite but huge coefficient (1e308) passes every sign check yet overflows to inf in
    ``seq_ms``; the search then compares infinities and ran for minutes.
    """
    tpr = float(model.tokens_per_rank)
    sizes = sorted({1, *model.a2a_ms_per_token, *model.group_fixed_ms} - {0}) or [1]
    top = float(max(sizes))
    factor = max([1.0, *(float(v) for v in model.attn_route_factor.values())])
    terms: list[tuple[str, float, float]] = [  # (name, coefficient, its largest multiplier)
        ("attn_ms_per_token2", float(model.attn_ms_per_token2), factor * tpr * tpr * top),
        ("linear_ms_per_token", float(model.linear_ms_per_token), tpr),
        ("details.step_ms", float(model.details.get("step_ms", 0.0) or 0.0), 1.0),
    ]
    per_size = (
        ("group_fixed_ms", model.group_fixed_ms, lambda d: 1.0),
        ("a2a_ms_per_token", model.a2a_ms_per_token, lambda d: tpr * d),
        ("ring_step_ms_per_token", model.ring_step_ms_per_token, lambda d: tpr * d * (d - 1)),
        ("a2a_fixed_ms", model.a2a_fixed_ms, lambda d: 1.0),
        ("ring_step_fixed_ms", model.ring_step_fixed_ms, lambda d: max(1.0, d - 1.0)),
        (
            "ring_step_extra_ms_per_token",
            model.ring_step_extra_ms_per_token,
            lambda d: tpr * d * max(1.0, d - 1.0),
        ),
    )
    for field_, mapping, mult in per_size:
        for d, v in mapping.items():
            terms.append((f"{field_}[{d}]", float(v), mult(float(max(d, 1) if d else top))))
    for name_, coefficient, multiplier in terms:
        with np.errstate(over="ignore"):
            priced = float(np.float64(coefficient) * np.float64(multiplier))
        if not math.isfinite(priced) or priced > MAX_PRICE_MS:
            raise InputError(
                f"cost model {model.name!r}: {name_} = {coefficient!r} prices a full group at "
                f"{priced:.3g} ms (tokens_per_rank {model.tokens_per_rank}); at most "
                f"{MAX_PRICE_MS:.0e} ms is plannable: check the coefficient's unit"
            )


def _heads(value: Any) -> tuple[int, int] | None:
    """``coefficients.heads``: [query, kv] heads per tensor-parallel rank, or absent."""
    if value is None:
        return None
    try:
        q, kv = (int(x) for x in value)
        HeadSpace(q, kv)
    except (TypeError, ValueError) as exc:
        raise InputError(
            f"cost model spec: coefficients.heads must be [query heads, kv heads] per "
            f"tensor-parallel rank with kv dividing query, got {value!r} ({exc})"
        ) from None
    return q, kv
