"""The selftest's reference is independent of what it checks, and is itself right.

Independence: ``testing/reference.py`` (and the CPU shims it uses) import nothing from the HSP
runtime or the Megatron integration, and the model it builds holds no HSP module. Rightness, on
its own terms: it is causal (a token's loss ignores later tokens) and documents do not interact.
Also: the HSP spec and megatron-core's local spec give the same parameter names and shapes, which
is what lets the distributed model load the reference's initial weights by name.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from tests.test_layering import PKG, imported_modules


def _hsp_imports(path: Path) -> set[str]:
    return {m for m in imported_modules(path) if m.split(".")[0] == "megatron_hsp"}


def test_reference_imports_only_device_shims_from_megatron_hsp():
    ref = PKG / "testing" / "reference.py"
    shims = PKG / "testing" / "cpu_shims.py"
    allowed = "megatron_hsp.testing.cpu_shims"
    assert _hsp_imports(ref), "the parser found no import at all: the check would be vacuous"
    assert {m for m in _hsp_imports(ref) if not m.startswith(allowed)} == set()
    assert _hsp_imports(shims) == set()


_REFERENCE_RUN = """
import sys
import numpy as np
import torch.distributed as dist
from megatron.core import parallel_state
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
parallel_state.initialize_model_parallel()
from megatron.core.tensor_parallel import random as mpu_random
mpu_random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
from megatron_hsp.testing.reference import ModelShape, reference_model, reference_step
docs = [np.arange(9) % 128, np.arange(5) % 128]
loss, grads = reference_step(reference_model(ModelShape()), docs)
assert loss > 0 and grads
print(" ".join(sorted(m for m in sys.modules if m.startswith("megatron_hsp"))))
parallel_state.destroy_model_parallel()
dist.destroy_process_group()
"""


@pytest.mark.spawns
def test_reference_run_reaches_no_runtime_integration_or_planner_module():
    """Import the reference and run a step in a fresh process: every ``megatron_hsp`` module it
    loads must be test plumbing (``testing.reference`` itself, ``testing.cpu_shims``)."""
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", _REFERENCE_RUN],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    ).stdout.split()
    assert "megatron_hsp.testing.reference" in out, "the check would be vacuous"
    forbidden = ("megatron_hsp.runtime", "megatron_hsp.megatron", "megatron_hsp.planner")
    reached = [m for m in out if m.startswith(forbidden)]
    assert not reached, f"the reference reaches code under test: {reached}"
    plumbing = {"megatron_hsp", "megatron_hsp.testing"}  # package __init__s: docstrings only
    reference = {"megatron_hsp.testing.reference", "megatron_hsp.testing.cpu_shims"}
    assert set(out) <= plumbing | reference


@pytest.fixture(scope="module")
def megatron_cpu():
    from megatron_hsp.testing.dist import destroy_cpu_megatron, init_single_process_megatron

    init_single_process_megatron()
    yield
    destroy_cpu_megatron()


def test_reference_model_is_stock_megatron_core(megatron_cpu):
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from megatron_hsp.testing.reference import ModelShape, reference_model

    model = reference_model(ModelShape())
    cores = [layer.self_attention.core_attention for layer in model.decoder.layers]
    assert cores and all(type(c) is DotProductAttention for c in cores)
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    assert type(model.rotary_pos_emb) is RotaryEmbedding  # megatron's own RoPE, no subclass
    outside = {
        type(m).__module__
        for m in model.modules()
        if not type(m).__module__.startswith(("megatron.core.", "torch."))
    }
    assert outside == set()


def test_hsp_spec_and_local_spec_have_the_same_parameters(megatron_cpu):
    from megatron_hsp.testing.reference import ModelShape, reference_model
    from megatron_hsp.testing.selftest import build_model

    shape = ModelShape()
    ref = {n: p.shape for n, p in reference_model(shape).named_parameters()}
    hsp = {n: p.shape for n, p in build_model(shape).named_parameters()}
    assert ref == hsp


def _per_token_losses(model, doc):
    from megatron_hsp.testing.cpu_shims import cpu_attention_scores_buffer, cpu_megatron_training
    from megatron_hsp.testing.reference import causal_inputs

    cpu_attention_scores_buffer(model.config.num_attention_heads * len(doc) ** 2)
    x = causal_inputs(doc)
    with torch.no_grad(), cpu_megatron_training():
        return model(x["input_ids"], x["position_ids"], x["attention_mask"], labels=x["labels"])[0]


def test_reference_is_causal_and_documents_are_separate(megatron_cpu):
    from megatron_hsp.testing.reference import ModelShape, reference_model, reference_step

    shape = ModelShape()
    model = reference_model(shape)
    rng = np.random.default_rng(0)
    doc = rng.integers(0, shape.vocab_size, 24)
    changed = doc.copy()
    changed[-1] = (changed[-1] + 1) % shape.vocab_size  # only the last token differs
    a, b = _per_token_losses(model, doc), _per_token_losses(model, changed)
    assert torch.equal(a[:-2], b[:-2])  # no earlier position sees the last token
    assert not torch.equal(a[-2], b[-2])  # ...except through its own label
    # One step over two documents == the token-weighted mean of the documents run alone.
    other = rng.integers(0, shape.vocab_size, 9)
    both, _ = reference_step(model, [doc, other])
    one, _ = reference_step(model, [doc])
    two, _ = reference_step(model, [other])
    assert both == pytest.approx((one * 23 + two * 8) / 31, rel=1e-6)


def test_bf16_models_are_bf16_throughout(megatron_cpu):
    """CUDA's layer norm refuses bf16 input with fp32 weights (the CPU kernel accepts the mix):
    the kit's bf16 HSP model and its stock bf16 yardstick hold every parameter in bf16, as
    Megatron's ``Float16Module`` casts the model it trains (the kit crashed on an H200 before)."""
    import torch

    from megatron_hsp.testing.reference import ModelShape, bf16_reference_model
    from megatron_hsp.testing.selftest import build_model

    for model in (build_model(ModelShape(), "cpu", "bf16"), bf16_reference_model(ModelShape())):
        wrong = {n: p.dtype for n, p in model.named_parameters() if p.dtype != torch.bfloat16}
        assert not wrong, wrong
