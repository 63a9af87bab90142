"""The model ``--hsp`` builds is the model Megatron builds, flag by flag (issue 44, item 4).

Both sides run Megatron-LM's own builder (``gpt_builders.gpt_builder`` and
``hybrid_builders.hybrid_builder``, the pristine upstream files of ``tests/fixtures/megatron-lm``,
against the installed megatron-core) on args from Megatron's own parser and ``validate_args``:
stock on the flags, HSP on the same flags plus ``--hsp``, with ``--spec`` set as ``install``
sets it (``layer_spec.hsp_layer_spec``, built from Megatron's global args as at its import). The
spec each builder hands ``GPTModel``/``HybridModel`` is compared node by node
(``testing.model_matrix.spec_differences``), and, where the CPU can build it, the instantiated
model module by module (types, parameter and buffer names, shapes and initial values, plain
attributes, ``TransformerConfig`` flags such as ``qk_l2_norm``/``qk_layernorm``). Only what HSP
swaps on purpose may differ: the self-attention module and its core attention, and the MoE
router (``model_matrix.hsp_replaces``).

The matrix (Megatron-LM core_r0.19.0's builder; main's too without a pipeline):
{dense, MoE, MoE with dense layers between (--moe-layer-freq), MoE with shared experts} x
{no qk norm, --qk-layernorm, --qk-l2-norm} x {local, transformer_engine} x {no pipeline, PP 2,
PP 2 with 2 virtual stages}, every pipeline stage and virtual stage compared; the dense spec
without a Megatron-LM checkout (``layer_spec``'s megatron-core fallback) against both builders;
a user's own ``--spec``; HybridModel patterns ``*-*-``, ``**--``, ``*-|*-`` (PP 2) x the qk
flags over megatron-core's own hybrid stack spec and a local one.

* local: spec and instantiated model (on the CPU, one process; a pipeline stage's rank is set in
  ``parallel_state`` and in the model's pipeline group, as on that rank).
* transformer_engine: spec level only. Transformer Engine does not import here and megatron-core
  then has no TE spec provider (``TESpecProvider is None``): ``te_stand_ins`` gives it its real
  ``TESpecProvider`` with each TE module class stood in by a distinct class of the same
  name and module path, so Megatron's own TE builder runs and the trees name the TE classes.
  Instantiating them needs TE and a GPU (not run by this file).
* HybridModel: megatron-core's ``hybrid_stack_spec`` is TE-only (spec level; built at its import
  with megatron-core's TE placeholders, compared by identity); a local stack spec given as the
  user's ``--spec`` (what ``pretrain_hybrid.py`` requires) is instantiated.

Excluded, and why:
* MoE with virtual pipeline stages: HSP refuses it (``refusals.refuse_moe_hsp_cannot_run``: the
  one ``--spec`` value cannot carry each chunk's virtual stage); a test asserts the refusal.
* Hybrid patterns with Mamba (``M``) or other non-attention mixers: HSP refuses them (asserted).
* ``--moe-grouped-gemm``: Megatron's ``validate_args`` reads the GPU's compute capability
  (refused on a machine without CUDA).
* ``--qk-layernorm`` with ``--qk-l2-norm`` together: megatron-core takes L2Norm and ignores
  qk-layernorm; no branch of its own (left out for time).
* HybridModel with virtual pipeline stages, ``--transformer-impl inference_optimized`` (needs
  TE), MLA / MTP / heterogeneous / experimental attention (refused by ``validate_hsp_args``).
* Megatron-LM main's builder is not instantiated: it passes ``GPTModel`` an argument the 0.19
  wheel lacks (``logit_dtype``). The oldest tier (megatron-core 0.18.0) cannot import either
  fixture builder (it needs 0.19's spec functions), so this file runs on the newest tier only.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import types
import unittest.mock
from typing import Any

import pytest
import torch

from megatron_hsp.testing import model_matrix
from megatron_hsp.testing.cpu_shims import cpu_megatron_training
from megatron_hsp.testing.model_matrix import module_differences, spec_differences, unexpected
from megatron_hsp.testing.mutations import MODEL_MUTATIONS
from tests.helpers import FIXTURES

MEGATRON_LM = FIXTURES / "megatron-lm"
GPT_COMMITS = sorted(p.parent.name for p in MEGATRON_LM.glob("*/gpt_builders.py.upstream"))
HYBRID_COMMITS = sorted(p.parent.name for p in MEGATRON_LM.glob("*/hybrid_builders.py.upstream"))
CORE_R019 = "f8837c04ef6cbef6cdefb8de001aad63178aebbf"  # the wheel's own release branch

BASE_FLAGS = [
    *("--hidden-size", "64", "--num-attention-heads", "4", "--ffn-hidden-size", "128"),
    *("--seq-length", "64", "--max-position-embeddings", "64"),
    *("--micro-batch-size", "1", "--global-batch-size", "2", "--train-iters", "1"),
    *("--lr", "1e-3", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128"),
    *("--use-cpu-initialization", "--no-gradient-accumulation-fusion"),
    *("--normalization", "RMSNorm", "--disable-bias-linear", "--swiglu"),
    *("--attention-dropout", "0", "--hidden-dropout", "0", "--seed", "1234"),
    # what the CPU's torch modules need (the loop's MODEL_FLAGS set the same)
    *("--no-persist-layer-norm", "--no-bias-dropout-fusion", "--no-masked-softmax-fusion"),
    "--no-rope-fusion",
]
MOE_FLAGS = [
    *("--num-experts", "4", "--moe-router-topk", "2"),
    *("--moe-token-dispatcher-type", "alltoall"),
]
FAMILIES = {
    "dense": [],
    "moe": MOE_FLAGS,
    "moe-mixed": [*MOE_FLAGS, "--moe-layer-freq", "([0]+[1])*{half}"],  # dense, MoE, ...
    # (--moe-grouped-gemm: Megatron's validate_args reads the GPU's compute capability)
    "moe-shared": [*MOE_FLAGS, "--moe-shared-expert-intermediate-size", "64"],
}
QK = {"none": [], "qk-layernorm": ["--qk-layernorm"], "qk-l2-norm": ["--qk-l2-norm"]}
IMPLS = ("local", "transformer_engine")
PIPELINES = {
    "no-pp": (1, None, 2),  # (PP size, virtual stages, layers)
    "pp2": (2, None, 2),
    "pp2-vpp2": (2, 2, 4),
}


# ------------------------------------------------------------------------------- environment


@pytest.fixture
def megatron_lm(tmp_path, monkeypatch, request):
    """Megatron-LM's own builder modules of one fixture commit, importable as upstream has them
    (siblings of ``pretrain_gpt.py``)."""
    commit = request.param
    for name in ("gpt_builders", "hybrid_builders", "model_provider"):
        src = MEGATRON_LM / commit / f"{name}.py.upstream"
        if src.exists():
            shutil.copy(src, tmp_path / f"{name}.py")
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.syspath_prepend(str(tmp_path))
    return commit


@pytest.fixture(scope="module")
def cpu_world():
    """A one-process gloo world with megatron's groups (what the local modules need)."""
    from megatron_hsp.testing.dist import destroy_cpu_megatron, init_single_process_megatron

    init_single_process_megatron()
    yield
    destroy_cpu_megatron()


@contextlib.contextmanager
def te_stand_ins():
    """megatron-core's TE spec provider with every TE module class stood in by a distinct class
    of the same name and module (TE does not import here; see the module docstring)."""
    import megatron.core.extensions.transformer_engine as te_ext
    import megatron.core.extensions.transformer_engine_spec_provider as provider
    import megatron.core.models.gpt.gpt_layer_specs as gpt_specs
    import megatron.core.models.gpt.moe_module_specs as moe_specs

    stand_ins: dict[str, type] = {}

    def stand_in(name: str) -> type:
        if name not in stand_ins:
            stand_ins[name] = type(name, (torch.nn.Module,), {"__module__": te_ext.__name__})
        return stand_ins[name]

    with contextlib.ExitStack() as stack:
        for module in (te_ext, provider, gpt_specs, moe_specs):
            for name, value in list(vars(module).items()):
                if name.startswith("TE") and isinstance(value, unittest.mock.Mock | type(None)):
                    if name == "TESpecProvider":
                        continue
                    stack.enter_context(unittest.mock.patch.object(module, name, stand_in(name)))
        for name in ("TENorm", "TEFusedMLP", "TEFusedMLPWithGroupedLinear"):
            stack.enter_context(unittest.mock.patch.object(gpt_specs, name, stand_in(name)))
        stack.enter_context(
            unittest.mock.patch.object(gpt_specs, "TESpecProvider", provider.TESpecProvider)
        )
        for module in (provider, gpt_specs):
            stack.enter_context(
                unittest.mock.patch.object(module, "is_te_min_version", lambda *a, **k: True)
            )
        stack.enter_context(unittest.mock.patch.object(provider, "get_te_version", lambda: "2.8"))
        yield


def _parse(flags: list[str], world_size: int) -> Any:
    """Megatron's own parse + validate_args (with HSP's flags added, as users get them)."""
    from megatron_hsp.testing.megatron_loop.models import _megatron_args

    saved = os.environ.get("WORLD_SIZE")
    os.environ["WORLD_SIZE"] = str(world_size)
    try:
        args = _megatron_args(flags)
    finally:
        if saved is None:
            os.environ.pop("WORLD_SIZE", None)
        else:
            os.environ["WORLD_SIZE"] = saved
    args.padded_vocab_size = args.vocab_size  # what set_global_variables' tokenizer derives
    return args


class _PipelineGroup:
    """This stage's pipeline group as the model sees it (its rank and size only)."""

    def __init__(self, rank: int, size: int) -> None:
        self._rank, self._size = rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size


@contextlib.contextmanager
def on_stage(args: Any, pp_rank: int):
    """Megatron's global args and this rank's pipeline rank, as on that rank."""
    from megatron.core import parallel_state
    from megatron.training import global_vars

    saved = global_vars._GLOBAL_ARGS
    global_vars.set_args(args)
    parallel_state.set_pipeline_model_parallel_rank(pp_rank)
    parallel_state.set_pipeline_model_parallel_world_size(args.pipeline_model_parallel_size)
    vp = args.virtual_pipeline_model_parallel_size
    parallel_state.set_virtual_pipeline_model_parallel_world_size(vp)
    try:
        yield
    finally:
        global_vars.set_args(saved)
        parallel_state.set_pipeline_model_parallel_rank(None)
        parallel_state.set_pipeline_model_parallel_world_size(None)
        parallel_state.set_virtual_pipeline_model_parallel_world_size(None)


def _install_spec(args: Any, monkeypatch, *, checkout: bool = True) -> None:
    """What ``installer.install`` does to ``--spec`` and what importing ``layer_spec`` then
    computes (``hsp_layer_spec = _from_megatron_args()``), on this rank's global args.
    ``checkout=False``: HSP's side cannot import Megatron-LM's ``gpt_builders`` (a training loop
    of one's own), so ``layer_spec`` takes its megatron-core fallback."""
    from megatron_hsp.megatron import installer, layer_spec

    if not checkout:
        monkeypatch.setitem(sys.modules, "gpt_builders", None)

    if args.spec and list(args.spec) != installer.LAYER_SPEC:
        args.hsp_base_spec = list(args.spec)
    args.spec = list(installer.LAYER_SPEC)
    monkeypatch.setattr(layer_spec, "hsp_layer_spec", layer_spec._from_megatron_args())


def _stages(args: Any):
    pp, vp = args.pipeline_model_parallel_size, args.virtual_pipeline_model_parallel_size
    for rank in range(pp):
        for stage in range(vp) if vp else [None]:
            pre = rank == 0 and stage in (None, 0)
            post = rank == pp - 1 and stage in (None, (vp or 1) - 1)
            yield rank, stage, pre, post


def _pg_collection(rank: int, size: int, monkeypatch) -> Any:
    """Megatron's groups with this stage's pipeline group (which torch.distributed's rank and
    size queries answer, as HybridModel's pattern split asks them)."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    pgs = ProcessGroupCollection.use_mpu_process_groups()
    pgs.pp = _PipelineGroup(rank, size)
    for query in ("get_rank", "get_world_size"):
        original = getattr(torch.distributed, query)

        def answer(group=None, _original=original, _query=query):
            if isinstance(group, _PipelineGroup):
                return group.rank() if _query == "get_rank" else group.size()
            return _original(group)

        monkeypatch.setattr(torch.distributed, query, answer)
    return pgs


class _Captured(Exception):
    """Raised by the stand-in model class once the builder has handed it its arguments."""

    def __init__(self, kwargs: dict[str, Any]) -> None:
        super().__init__("captured")
        self.kwargs = kwargs


def _capture(model_class_name: str, builder_module: Any, monkeypatch) -> None:
    """Make the builder hand its ``GPTModel``/``HybridModel`` arguments over instead of
    building it (raises ``_Captured``)."""

    def record(**kwargs):
        raise _Captured(kwargs)

    monkeypatch.setattr(builder_module, model_class_name, record)


def build_both(
    builder: str,
    flags: list[str],
    world_size: int,
    monkeypatch,
    *,
    instantiate: bool,
    checkout: bool = True,
):
    """For every pipeline stage and virtual stage: (stage, stock spec, HSP spec, stock model,
    HSP model), the models None unless ``instantiate``."""
    import importlib

    builders = importlib.import_module(f"{builder}_builders")
    build = getattr(builders, f"{builder}_builder")
    model_class = "GPTModel" if builder == "gpt" else "HybridModel"
    stock_args, hsp_args = _parse(flags, world_size), _parse([*flags, "--hsp"], world_size)
    out = []
    for rank, stage, pre, post in _stages(stock_args):
        results = []
        for args, hsp in ((stock_args, False), (hsp_args, True)):
            with on_stage(args, rank), monkeypatch.context() as m:
                if hsp:
                    _install_spec(args, m, checkout=checkout)
                _capture(model_class, builders, m)
                with pytest.raises(_Captured) as captured:
                    build(args, pre, post, vp_stage=stage)
                spec_key = "transformer_layer_spec" if builder == "gpt" else "hybrid_stack_spec"
                # read here, on this rank: a DeferredSpec is built on its first read
                spec = model_matrix._resolved(captured.value.kwargs[spec_key])
                model = None
                if instantiate:
                    m.undo()
                    if hsp:
                        _install_spec(args, m, checkout=checkout)
                    torch.manual_seed(1234)
                    from megatron.core.tensor_parallel.random import (
                        model_parallel_cuda_manual_seed,
                    )

                    with contextlib.suppress(Exception):
                        model_parallel_cuda_manual_seed(1234)
                    with cpu_megatron_training():
                        model = build(
                            args,
                            pre,
                            post,
                            vp_stage=stage,
                            pg_collection=_pg_collection(
                                rank, args.pipeline_model_parallel_size, m
                            ),
                        )
            results.append((spec, model))
        (stock_spec, stock_model), (hsp_spec, hsp_model) = results
        out.append(((rank, stage), stock_spec, hsp_spec, stock_model, hsp_model))
    return out


def _pipeline_flags(pipeline: str) -> tuple[list[str], int, int]:
    pp, vp, layers = PIPELINES[pipeline]
    flags = ["--num-layers", str(layers)]
    if pp > 1:
        flags += ["--pipeline-model-parallel-size", str(pp)]
    if vp:
        flags += ["--num-layers-per-virtual-pipeline-stage", str(layers // (pp * vp))]
    return flags, pp, layers


def _flags(family: str, qk: str, impl: str, pipeline: str) -> tuple[list[str], int]:
    pipe, world, layers = _pipeline_flags(pipeline)
    fam = [f.format(half=layers // 2) for f in FAMILIES[family]]
    return [*BASE_FLAGS, *pipe, *fam, *QK[qk], "--transformer-impl", impl], world


def _attention_layers(spec: Any) -> int:
    """How many attention layer specs a (resolved) layer, block or hybrid stack spec holds."""
    spec = model_matrix._resolved(spec)
    layer_specs = getattr(spec, "layer_specs", None)
    if layer_specs is not None:
        return len(layer_specs)
    stack = getattr(spec, "submodules", spec)
    if hasattr(stack, "attention_layer"):  # hybrid stack: one spec for every '*' layer
        return int(hasattr(stack.attention_layer, "submodules"))
    return 1


def assert_same_but_attention(built) -> None:
    """Nothing differs but what HSP swaps on purpose, and HSP swapped every attention layer."""
    from megatron.core.transformer.attention import SelfAttention

    from megatron_hsp.runtime.attention import HSPCoreAttention

    for stage, stock_spec, hsp_spec, stock_model, hsp_model in built:
        diffs = spec_differences(stock_spec, hsp_spec)
        assert not unexpected(diffs), (stage, [str(d) for d in unexpected(diffs)])
        swapped = [d for d in diffs if d.path.endswith("self_attention.module")]
        assert len(swapped) == _attention_layers(stock_spec) > 0, (stage, swapped)
        if stock_model is not None:
            mdiffs = module_differences(stock_model, hsp_model)
            assert not unexpected(mdiffs), (stage, [str(d) for d in unexpected(mdiffs)])
            cores = [m for m in hsp_model.modules() if isinstance(m, HSPCoreAttention)]
            layers = [m for m in stock_model.modules() if isinstance(m, SelfAttention)]
            assert len(cores) == len(layers) > 0, (stage, len(cores), len(layers))


# ------------------------------------------------------------------------------------ GPT


def _matrix():
    """core_r0.19.0's builder on every combination; Megatron-LM main's without a pipeline."""
    for commit in GPT_COMMITS:
        for family in FAMILIES:
            for qk in QK:
                for impl in IMPLS:
                    for pipeline in PIPELINES:
                        if family != "dense" and PIPELINES[pipeline][1]:
                            continue  # refused by HSP: test_moe_with_virtual_stages_is_refused
                        if commit != CORE_R019 and pipeline != "no-pp":
                            continue  # time: the builder's pipeline handling is the same call
                        yield pytest.param(commit, family, qk, impl, pipeline)


@pytest.mark.parametrize(
    ("megatron_lm", "family", "qk", "impl", "pipeline"), list(_matrix()), indirect=["megatron_lm"]
)
def test_gpt_model_under_hsp_is_megatrons(megatron_lm, family, qk, impl, pipeline, monkeypatch):
    flags, world = _flags(family, qk, impl, pipeline)
    local = impl == "local"
    ctx = contextlib.nullcontext() if local else te_stand_ins()
    with ctx:
        if local:
            pytest.importorskip("megatron.core")
        built = build_both("gpt", flags, world, monkeypatch, instantiate=False)
    assert_same_but_attention(built)


@pytest.mark.parametrize("megatron_lm", GPT_COMMITS, indirect=True)
@pytest.mark.parametrize("qk", list(QK))
@pytest.mark.parametrize("impl", IMPLS)
def test_dense_gpt_model_without_a_checkout_is_megatrons(
    megatron_lm, qk, impl, cpu_world, monkeypatch
):
    """A loop of one's own (``gpt_builders`` not importable): ``layer_spec``'s megatron-core
    fallback builds what Megatron-LM's builder builds (before: with ``--transformer-impl local
    --qk-l2-norm`` it added L2Norm on q and k, which Megatron-LM's local branch does not pass).
    MoE takes ``get_gpt_decoder_block_spec`` with or without a checkout (the matrix above).
    Megatron-LM main's builder passes ``GPTModel`` an argument the 0.19 wheel lacks
    (``logit_dtype``): at main, spec level only."""
    flags, world = _flags("dense", qk, impl, "no-pp")
    local = impl == "local"
    build = local and megatron_lm == CORE_R019
    with contextlib.nullcontext() if local else te_stand_ins():
        built = build_both("gpt", flags, world, monkeypatch, instantiate=build, checkout=False)
    assert_same_but_attention(built)


def _instantiated():
    for family in FAMILIES:
        for qk in QK:
            for pipeline in PIPELINES:
                if family != "dense" and PIPELINES[pipeline][1]:
                    continue  # refused by HSP: test_moe_with_virtual_stages_is_refused
                yield pytest.param(family, qk, pipeline)


@pytest.mark.parametrize("megatron_lm", [CORE_R019], indirect=True)
@pytest.mark.parametrize(("family", "qk", "pipeline"), list(_instantiated()))
def test_local_gpt_model_instantiated_under_hsp_is_megatrons(
    megatron_lm, family, qk, pipeline, cpu_world, monkeypatch
):
    """The local modules built on the CPU: every stage's model, module by module, with the same
    initial values (same seed)."""
    flags, world = _flags(family, qk, "local", pipeline)
    built = build_both("gpt", flags, world, monkeypatch, instantiate=True)
    assert_same_but_attention(built)


@pytest.mark.parametrize("megatron_lm", [CORE_R019], indirect=True)
@pytest.mark.parametrize("pipeline", list(PIPELINES))
def test_gpt_model_with_the_users_spec_is_megatrons(megatron_lm, pipeline, cpu_world, monkeypatch):
    """``--spec`` of the user's own (a local layer spec with L2Norm on q and k, RMSNorm): it
    stays the base under ``--hsp`` (``args.hsp_base_spec``), every stage built on the CPU."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    user = types.ModuleType("hsp_matrix_user_gpt_specs")
    user.l2 = get_gpt_layer_local_spec(qk_l2_norm=True, normalization="RMSNorm")
    monkeypatch.setitem(sys.modules, user.__name__, user)
    flags, world = _flags("dense", "qk-l2-norm", "local", pipeline)
    flags += ["--spec", user.__name__, "l2"]
    built = build_both("gpt", flags, world, monkeypatch, instantiate=True)
    assert_same_but_attention(built)
    from megatron.core.transformer.torch_norm import L2Norm

    assert any(isinstance(m, L2Norm) for m in built[0][4].modules())


def test_moe_with_virtual_stages_is_refused(capsys):
    """The one combination of the matrix left out: HSP refuses it (Megatron builds it)."""
    flags, world = _flags("moe", "qk-l2-norm", "local", "pp2-vpp2")
    assert _parse(flags, world).virtual_pipeline_model_parallel_size == 2
    with pytest.raises(SystemExit):
        _parse([*flags, "--hsp"], world)
    assert "virtual pipeline stages" in capsys.readouterr().err


# --------------------------------------------------------------------------------- plants


@pytest.mark.parametrize("megatron_lm", [CORE_R019], indirect=True)
@pytest.mark.parametrize("mutation", [m.name for m in MODEL_MUTATIONS])
@pytest.mark.parametrize(
    ("family", "impl", "pipeline", "instantiate"),
    [
        ("moe", "local", "no-pp", True),
        ("moe-mixed", "local", "pp2", True),
        ("moe", "transformer_engine", "no-pp", False),
    ],
)
def test_the_matrix_catches_the_model_definition_plants(
    megatron_lm, mutation, family, impl, pipeline, instantiate, cpu_world, monkeypatch
):
    """Each plant of ``mutations.MODEL_MUTATIONS`` (the MoE spec dropping --qk-l2-norm under
    --hsp: no parameter differs) fails the comparison, in the spec and in the built model."""
    (planted_mutation,) = [m for m in MODEL_MUTATIONS if m.name == mutation]
    flags, world = _flags(family, "qk-l2-norm", impl, pipeline)
    ctx = contextlib.nullcontext() if impl == "local" else te_stand_ins()
    planted = planted_mutation.plant()
    try:
        with ctx:
            built = build_both("gpt", flags, world, monkeypatch, instantiate=instantiate)
        assert planted.calls() > 0, "the planted code never ran"
    finally:
        planted()
    with pytest.raises(AssertionError) as caught:
        assert_same_but_attention(built)
    assert "layernorm" in str(caught.value)
    for stage, stock_spec, hsp_spec, stock_model, hsp_model in built:
        paths = [d.path for d in unexpected(spec_differences(stock_spec, hsp_spec))]
        assert any(p.endswith("q_layernorm") for p in paths), (stage, paths)
        if instantiate:
            mdiffs = unexpected(module_differences(stock_model, hsp_model))
            assert any("q_layernorm (type)" in d.path for d in mdiffs), (stage, mdiffs)
            assert not [d for d in mdiffs if "parameter" in d.path]  # same parameters


# ---------------------------------------------------------------------------- HybridModel

HYBRID_PATTERNS = ("*-*-", "**--", "*-|*-")  # attention and MLP layers; "|": a PP 2 split
HYBRID_SPECS = {
    # megatron-core's own (Transformer Engine modules): spec level
    "transformer_engine": ("megatron.core.models.hybrid.hybrid_layer_specs", "hybrid_stack_spec"),
    # a user's local stack spec (what --spec is for): instantiated on the CPU
    "local": ("hsp_matrix_user_specs", "local_hybrid_stack_spec"),
}


@pytest.fixture
def local_hybrid_spec(monkeypatch):
    """The user's ``--spec`` module: megatron-core's hybrid stack of its local modules
    (``tests/megatron/test_hybrid_model.py``), with ``HybridStack``'s final norm, TE's
    ``TENorm`` unconditionally, made megatron's torch norm on both sides for the CPU."""
    import megatron.core.models.hybrid.hybrid_block as hybrid_block
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    from tests.megatron.test_hybrid_model import _local_hybrid_stack_spec

    user = types.ModuleType("hsp_matrix_user_specs")
    user.local_hybrid_stack_spec = _local_hybrid_stack_spec()
    monkeypatch.setitem(sys.modules, user.__name__, user)
    monkeypatch.setattr(hybrid_block, "TENorm", WrappedTorchNorm)


def _hybrid_flags(pattern: str, impl: str, qk: str) -> tuple[list[str], int]:
    pp = pattern.count("|") + 1
    flags = [*BASE_FLAGS, "--hybrid-layer-pattern", pattern, "--transformer-impl", impl]
    flags += ["--spec", *HYBRID_SPECS[impl], *QK[qk]]
    if pp > 1:
        flags += ["--pipeline-model-parallel-size", str(pp)]
    return flags, pp


@pytest.mark.parametrize("megatron_lm", HYBRID_COMMITS, indirect=True)
@pytest.mark.parametrize("qk", list(QK))
@pytest.mark.parametrize("pattern", HYBRID_PATTERNS)
@pytest.mark.parametrize("impl", list(HYBRID_SPECS))
def test_hybrid_model_under_hsp_is_megatrons(
    megatron_lm, impl, pattern, qk, local_hybrid_spec, cpu_world, monkeypatch
):
    """``pretrain_hybrid.py``'s ``hybrid_builder`` on the user's ``--spec``: only the attention
    layers' attention changes; the local stack is also instantiated, stage by stage."""
    flags, world = _hybrid_flags(pattern, impl, qk)
    built = build_both("hybrid", flags, world, monkeypatch, instantiate=impl == "local")
    assert_same_but_attention(built)


def test_hybrid_patterns_hsp_refuses_are_refused(capsys):
    """Mamba layers in the pattern: HSP refuses them (so the matrix has no 'M' pattern)."""
    flags, world = _hybrid_flags("M*-", "transformer_engine", "none")
    _parse(flags, world)
    with pytest.raises(SystemExit):
        _parse([*flags, "--hsp"], world)
    assert "'M'" in capsys.readouterr().err
