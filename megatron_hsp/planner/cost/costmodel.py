"""Cost model entry point: ``load_cost_model`` (preset name, YAML/JSON file or mapping).

The model itself lives in focused modules, all re-exported here so callers keep importing from
``megatron_hsp.planner.cost.costmodel``:

- ``costcore``: ``CostModel``, the separable form the planner evaluates (see its docstring);
- ``presets_flexsp``: FlexSP's fitted presets, reproduced term for term;
- ``first_principles``: the analytic model (FLOPs, bytes, latencies) and the H100 presets;
- ``costspec``: strict spec reading and validation;
- ``calibration``: the H100 presets' fitted hardware terms, from published measurements.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from megatron_hsp.planner.cost.costcore import CostModel
from megatron_hsp.planner.cost.costspec import (
    _TOP_KEYS,
    MAX_SPEC_BYTES,
    _check_spec_numbers,
    _dataclass_from,
    _from_coefficients,
    _heads,
    _read_spec_file,
    validate_cost_model,
)
from megatron_hsp.planner.cost.first_principles import (
    FIRST_PRINCIPLES_PRESETS,
    H100_SXM,
    LLAMA3_8B,
    LLAMA3_70B,
    HardwareConfig,
    TrainingConfig,
    a2a_bytes_per_token,
    activation_bytes_per_token,
    first_principles_cost_model,
    ring_bytes_per_token,
)
from megatron_hsp.planner.cost.presets_flexsp import (
    FLEXSP_A2A_GBS,
    FLEXSP_DEFAULT_MEMORY_CAP_GB,
    FLEXSP_FITS,
    flexsp_bandwidth,
    flexsp_cost_model,
    flexsp_params_b,
)
from megatron_hsp.planner.cost.shape import TransformerShape
from megatron_hsp.planner.errors import InputError
from megatron_hsp.planner.routes import check_routes

__all__ = [
    "FIRST_PRINCIPLES_PRESETS",
    "FLEXSP_A2A_GBS",
    "FLEXSP_DEFAULT_MEMORY_CAP_GB",
    "FLEXSP_FITS",
    "H100_SXM",
    "LLAMA3_8B",
    "LLAMA3_70B",
    "MAX_SPEC_BYTES",
    "CostModel",
    "HardwareConfig",
    "TrainingConfig",
    "TransformerShape",
    "_check_spec_numbers",
    "_heads",
    "a2a_bytes_per_token",
    "activation_bytes_per_token",
    "first_principles_cost_model",
    "flexsp_bandwidth",
    "flexsp_cost_model",
    "flexsp_params_b",
    "load_cost_model",
    "preset_names",
    "ring_bytes_per_token",
    "validate_cost_model",
]


def preset_names() -> list[str]:
    return sorted([*FLEXSP_FITS, *FIRST_PRINCIPLES_PRESETS])


def load_cost_model(
    spec: str | Path | Mapping[str, Any],
    *,
    world_size: int,
    gpus_per_node: int = 8,
    max_seq_k: float = 192,
    memory_cap_gb: float | None = None,
    ring_routes: Mapping[int, str] | None = None,
    doc_multiples: Mapping[int, int] | None = None,
) -> CostModel:
    """The one way to get a ``CostModel``: preset name, YAML/JSON file, or a mapping.

    Every input is checked (``_check_spec_numbers`` on the spec, ``validate_cost_model`` on the
    result); any problem is an :class:`InputError` naming the field. See ``_load_unchecked`` for
    the spec shapes. ``ring_routes``: ``{group size: route}`` of the ring and hybrid groups as
    the runtime will run them (``runtime.backends.attention_routes_for_run``); it overrides the
    spec's ``ring_route`` for the sizes it names, since the runtime knows what it runs.
    """
    if memory_cap_gb is not None:
        v = float(memory_cap_gb)
        if not math.isfinite(v) or v <= 0:
            raise InputError(
                f"--memory-cap-gb must be a positive number of GB, got {memory_cap_gb}"
            )
    if isinstance(spec, Mapping):
        _check_spec_numbers(spec)
    try:
        model = _load_unchecked(
            spec,
            world_size=world_size,
            gpus_per_node=gpus_per_node,
            max_seq_k=max_seq_k,
            memory_cap_gb=memory_cap_gb,
        )
    except InputError:
        raise
    except (TypeError, ValueError, KeyError, OverflowError, ZeroDivisionError) as exc:
        raise InputError(
            f"--cost-model {spec if isinstance(spec, str | Path) else 'spec'}: cannot be used: "
            f"{type(exc).__name__}: {exc}"
        ) from None
    if ring_routes:
        routes = check_routes(ring_routes, "ring_routes")
        model = dataclasses.replace(model, ring_route={**model.ring_route, **routes})
    if doc_multiples:  # what the runtime pads (``routes.te_doc_multiples``): priced
        multiples = {int(d): int(m) for d, m in doc_multiples.items()}
        model = dataclasses.replace(model, doc_multiple={**model.doc_multiple, **multiples})
    return validate_cost_model(model)


def _load_unchecked(
    spec: str | Path | Mapping[str, Any],
    *,
    world_size: int,
    gpus_per_node: int = 8,
    max_seq_k: float = 192,
    memory_cap_gb: float | None = None,
) -> CostModel:
    """The one way to get a ``CostModel``: preset name, YAML/JSON file, or a mapping.

    A spec is a mapping with exactly one of these shapes (YAML or JSON on disk)::

        preset: flexsp-gpt-7b        # a name from preset_names(), optional overrides:
        memory_cap_gb: 30            #   memory cap; model/hardware/training keys for
        training: {recompute: true}  #   first-principles presets

        name: my-fit                 # explicit (fitted) coefficients
        coefficients: {attn_ms_per_token2, linear_ms_per_token, group_fixed_ms,
                       a2a_ms_per_token | a2a_bytes_per_token + a2a_gbs,
                       tokens_per_rank | model_states_gb + act_mib_per_token,
                       optional: heads [q, kv], ring_step_ms_per_token {size: ms, pure ring},
                       a2a_fixed_ms {u: ms}, ring_step_fixed_ms {size: ms per step},
                       attn_route_factor {route: factor}, ring_route {size: route}}

        name: my-gpt                 # FlexSP-style fit, scaled with the cluster like the presets
        flexsp: {layers, hidden, a1, a2, b1, act_mib_per_token, params_b: {192: .., 384: ..}}

        name: my-llama               # first principles
        model: {name, layers, hidden, heads, kv_heads, ffn_hidden, vocab, gated}
        hardware: {name, peak_tflops, achievable_fraction, hbm_gb, nvlink_gbs, ...}
        training: {zero_stage, recompute, bytes_per_param, ...}

    ``memory_cap_gb`` given here (the ``--memory-cap-gb`` flag) overrides the spec's, which
    overrides the preset default (30 GB for FlexSP presets, 90% of HBM for first principles).
    """
    if isinstance(spec, Path | str):
        text = str(spec)
        if text in FLEXSP_FITS or text in FIRST_PRINCIPLES_PRESETS:
            data: Mapping[str, Any] = {"preset": text}
        elif text.endswith((".yaml", ".yml", ".json")) or Path(text).is_file():
            data = _read_spec_file(Path(text))
            _check_spec_numbers(data)
        else:
            raise InputError(
                f"--cost-model {text!r} is neither a preset nor a YAML/JSON file; presets: "
                f"{preset_names()}"
            )
    elif isinstance(spec, Mapping):
        data = spec
    else:
        raise InputError(
            f"cost model spec must be a name, a path or a mapping, got {type(spec).__name__}"
        )
    unknown = sorted(set(data) - _TOP_KEYS)
    if unknown:
        raise InputError(f"cost model spec: unknown keys {unknown}; allowed: {sorted(_TOP_KEYS)}")
    cap = memory_cap_gb if memory_cap_gb is not None else data.get("memory_cap_gb")
    max_seq_k = float(data.get("max_seq_k", max_seq_k))
    shapes = [k for k in ("preset", "coefficients", "flexsp", "model") if k in data]
    if len(shapes) != 1:
        raise InputError(
            "cost model spec needs exactly one of 'preset', 'coefficients', 'flexsp' or "
            f"'model' (+ 'hardware'); got {shapes or 'none'}"
        )
    shape = shapes[0]
    if shape == "preset":
        preset = str(data["preset"])
        if preset in FLEXSP_FITS:
            extra = sorted(set(data) - {"preset", "name", "memory_cap_gb", "max_seq_k"})
            if extra:
                raise InputError(
                    f"FlexSP preset {preset!r} takes only memory_cap_gb and max_seq_k "
                    f"overrides, not {extra}"
                )
            return flexsp_cost_model(
                str(data.get("name", preset)),
                world_size,
                max_seq_k=max_seq_k,
                memory_cap_gb=cap,
                gpus_per_node=gpus_per_node,
                fit=FLEXSP_FITS[preset],
            )
        if preset not in FIRST_PRINCIPLES_PRESETS:
            raise InputError(f"unknown cost-model preset {preset!r}; presets: {preset_names()}")
        model, hw, tr = FIRST_PRINCIPLES_PRESETS[preset]
        model = dataclasses.replace(model, **dict(data.get("model", {})))
        hw = dataclasses.replace(hw, **dict(data.get("hardware", {})))
        tr = dataclasses.replace(tr, **dict(data.get("training", {})))
        return first_principles_cost_model(
            model,
            hw,
            tr,
            world_size=world_size,
            gpus_per_node=gpus_per_node,
            memory_cap_gb=cap,
            name=str(data.get("name", preset)),
        )
    name = str(data.get("name", "custom"))
    if shape == "coefficients":
        model_ = _from_coefficients(name, data["coefficients"], cap)
        return dataclasses.replace(
            model_,
            source=str(data.get("source", model_.source)),
            details={str(k): float(v) for k, v in dict(data.get("details", {})).items()},
        )
    if shape == "flexsp":
        fit = dict(data["flexsp"])
        missing = sorted(
            {"layers", "hidden", "a1", "a2", "b1", "act_mib_per_token", "params_b"} - set(fit)
        )
        if missing:
            raise InputError(f"cost model spec: flexsp section lacks {missing}")
        return flexsp_cost_model(
            name,
            world_size,
            max_seq_k=max_seq_k,
            memory_cap_gb=cap,
            gpus_per_node=gpus_per_node,
            fit=fit,
        )
    if "hardware" not in data:
        raise InputError("cost model spec: a 'model' section needs a 'hardware' section too")
    model = TransformerShape.from_spec(data["model"], name=name)
    hw = _dataclass_from(HardwareConfig, "hardware", data["hardware"], name="hardware")
    tr = _dataclass_from(TrainingConfig, "training", data.get("training", {}))
    return first_principles_cost_model(
        model,
        hw,
        tr,
        world_size=world_size,
        gpus_per_node=gpus_per_node,
        memory_cap_gb=cap,
        name=name,
    )
