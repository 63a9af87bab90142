"""One spec, one loader: preset names, YAML/JSON files, mappings, and their errors."""

from __future__ import annotations

import json

import pytest
import yaml

from megatron_hsp.planner.cost.costmodel import (
    FLEXSP_FITS,
    H100_SXM,
    LLAMA3_8B,
    load_cost_model,
    preset_names,
)
from megatron_hsp.planner.errors import InputError

KW = {"world_size": 64, "gpus_per_node": 8, "max_seq_k": 192}


@pytest.mark.parametrize("name", preset_names())
def test_every_preset_round_trips_through_json_and_yaml(tmp_path, name):
    m = load_cost_model(name, **KW)
    spec = m.to_spec()
    jpath = tmp_path / "m.json"
    jpath.write_text(json.dumps(spec))
    assert load_cost_model(jpath, **KW) == m
    ypath = tmp_path / "m.yaml"
    ypath.write_text(yaml.safe_dump(spec))
    assert load_cost_model(str(ypath), **KW) == m


def test_preset_file_with_memory_override(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text("preset: flexsp-gpt-7b\nmemory_cap_gb: 28\n")
    m = load_cost_model(path, **KW)
    assert m.tokens_per_rank == int((28 * 1024 - 1822.06640625) / 4.480441895)
    # the flag (argument) beats the file
    assert load_cost_model(path, **KW, memory_cap_gb=30).tokens_per_rank == 6449


def test_model_and_hardware_sections_equal_the_preset(tmp_path):
    import dataclasses

    from megatron_hsp.planner.cost.shape import SPEC_KEYS

    spec = {
        "name": "llama3-8b-h100",
        # A spec's model section: the dense keys (head dim hidden / heads), as the preset's.
        "model": {
            k: getattr(LLAMA3_8B, k)
            for k in SPEC_KEYS
            if k != "name" and getattr(LLAMA3_8B, k) is not None  # head_dim: optional
        },
        "hardware": dataclasses.asdict(H100_SXM),
        "training": {"zero_stage": 1, "recompute": False},
    }
    path = tmp_path / "llama.yaml"
    path.write_text(yaml.safe_dump(spec))
    assert load_cost_model(path, **KW) == load_cost_model("llama3-8b-h100", **KW)


def test_preset_with_training_override():
    base = load_cost_model("llama3-8b-h100", **KW)
    rec = load_cost_model({"preset": "llama3-8b-h100", "training": {"recompute": True}}, **KW)
    assert rec.tokens_per_rank > base.tokens_per_rank


def test_flexsp_style_fit_section_equals_the_preset():
    fit = dict(FLEXSP_FITS["flexsp-gpt-13b"])
    m = load_cost_model({"name": "flexsp-gpt-13b", "flexsp": fit}, **KW)
    assert m == load_cost_model("flexsp-gpt-13b", **KW)


def test_explicit_coefficients_with_bandwidths_and_memory():
    spec = {
        "name": "mine",
        "memory_cap_gb": 40,
        "coefficients": {
            "attn_ms_per_token2": 1e-6,
            "linear_ms_per_token": 0.1,
            "group_fixed_ms": {1: 5, 8: 7},
            "a2a_bytes_per_token": 1e6,
            "a2a_gbs": {2: 100, 8: 50},
            "model_states_gb": 8,
            "act_mib_per_token": 2,
        },
    }
    m = load_cost_model(spec, **KW)
    assert m.sizes == [1, 2, 8]
    assert m.a2a_ms_per_token[8] == pytest.approx(1e6 / 8 / 50e9 * 1e3)
    assert m.tokens_per_rank == (40 - 8) * 1024 // 2
    assert m.fixed_ms(8) == 7 and m.fixed_ms(1) == 5


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("no-such-preset", "neither a preset nor a YAML/JSON file"),
        ("missing.yaml", "does not exist"),
        ({"preset": "nope"}, "unknown cost-model preset"),
        ({"preset": "flexsp-gpt-7b", "bogus": 1}, "unknown keys"),
        ({"preset": "flexsp-gpt-7b", "model": {}}, "exactly one of"),
        ({"name": "x"}, "exactly one of"),
        ({"model": {"layers": 2}}, "'hardware' section"),
        ({"coefficients": {"linear_ms_per_token": 1}}, "attn_ms_per_token2 is required"),
        (
            {"coefficients": {"attn_ms_per_token2": 1, "linear_ms_per_token": 1}},
            "a2a_ms_per_token",
        ),
        (
            {"model": {"layers": 2, "wrong": 1}, "hardware": {"peak_tflops": 1}},
            "unknown model keys",
        ),
        ({"flexsp": {"layers": 2}}, "flexsp section lacks"),
    ],
)
def test_spec_errors_say_what_is_wrong(spec, message):
    with pytest.raises(InputError, match=message):
        load_cost_model(spec, **KW)


def test_bad_yaml_names_the_file(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("preset: [unclosed\n")
    with pytest.raises(InputError, match=r"bad\.yaml"):
        load_cost_model(path, **KW)


def test_split_latency_maps_load_validate_and_round_trip():
    co = {
        "attn_ms_per_token2": 1e-6,
        "linear_ms_per_token": 0.1,
        "a2a_ms_per_token": {2: 0.01, 4: 0.02},
        "tokens_per_rank": 1000,
        "heads": [2, 2],
        "ring_step_ms_per_token": {2: 0.005, 4: 0.004},
        "a2a_fixed_ms": {2: 0.5},
        "ring_step_fixed_ms": {4: 0.25},
    }
    m = load_cost_model({"name": "lat", "coefficients": co}, world_size=4, gpus_per_node=4)
    assert m.split(4) == (2, 2)
    assert m.fixed_ms(4) == pytest.approx(0.5 + 0.25)  # a2a over 2, one ring step
    assert m.fixed_ms(4, (1, 4)) == pytest.approx(3 * 0.25)  # pure ring: three steps, no a2a
    assert load_cost_model(m.to_spec(), world_size=4, gpus_per_node=4) == m
    bad = {**co, "ring_step_fixed_ms": {4: -1.0}}
    with pytest.raises(InputError, match=r"ring_step_fixed_ms\.4 = -1\.0 must be >= 0"):
        load_cost_model({"name": "lat", "coefficients": bad}, world_size=4, gpus_per_node=4)
