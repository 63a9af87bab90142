"""install(), the listed patches and observability, on stand-in Megatron training modules.

The stand-ins have the attribute names and parameter names of megatron-core 0.19's
``megatron/training`` so each wrapper is checked in isolation; Megatron's real ``train_step`` with
these patches is run by ``megatron_hsp.testing.megatron_loop`` (``selftest --megatron``).
"""

from __future__ import annotations

import io
import json
import sys
import types

import pytest

from megatron_hsp.megatron import hooks, install, patches
from megatron_hsp.megatron.config import validate_hsp_args
from megatron_hsp.planner.errors import HSPError
from megatron_hsp.planner.plan import Group, MicroBatch, Plan
from megatron_hsp.step.observe import StepObserver, StepRecord, group_imbalance
from megatron_hsp.step.sampler import DocumentBatch, Piece
from tests.helpers import FIXTURES
from tests.helpers.megatron_args import parse


@pytest.fixture()
def stand_in_megatron_training(monkeypatch):
    """Modules named like Megatron-LM's, holding the functions HSP patches."""
    pkg = types.ModuleType("megatron.training")
    training = types.ModuleType("megatron.training.training")
    calls = []
    training.get_num_microbatches = lambda: 7

    def train_step(
        forward_step_func,
        data_iterator,
        model,
        optimizer,
        opt_param_scheduler,
        config,
        forward_backward_func,
        iteration=None,
    ):
        # What Megatron's train_step does with the count: the schedule gets it, and so does the
        # LR scheduler increment (get_num_microbatches() * micro_batch_size * dp size).
        forward_backward_func(num_microbatches=training.get_num_microbatches())
        calls.append(("increment", training.get_num_microbatches()))
        return {"lm loss": 2.5}, False

    training.train_step = train_step

    def get_forward_backward_func(*a, **kw):
        def schedule(**skw):
            calls.append(("eval schedule", skw["num_microbatches"]))
            return [{"lm loss": 1.0}]

        return schedule

    training.get_forward_backward_func = get_forward_backward_func

    def num_floating_point_operations(
        args, batch_size, seqlen_squared_sum_in_batch=None, total_real_tokens_in_batch=None
    ):
        return -1.0  # the stand-in's count; the patch's own is tested in test_throughput.py

    training.num_floating_point_operations = num_floating_point_operations
    pkg.training = training
    monkeypatch.setitem(sys.modules, "megatron.training", pkg)
    monkeypatch.setitem(sys.modules, "megatron.training.training", training)
    yield training, calls
    patches.remove_patches()
    hooks.set_run(None)


def plan2() -> Plan:
    mb1 = MicroBatch((Group((0, 1), (0,), (100,), est_ms=10.0),), est_ms=10.0)
    mb2 = MicroBatch(
        (Group((0,), (1,), (30,), est_ms=4.0), Group((1,), (2,), (10,), est_ms=2.0)), est_ms=4.0
    )
    return Plan(2, 2, (mb1, mb2), est_step_ms=14.0, solve_ms=3.0, solver="highs")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    """A small indexed dataset (``--data-path``): install() checks its files at argument time."""
    import numpy as np

    from megatron_hsp.step.corpus import write_indexed_dataset

    prefix = str(tmp_path_factory.mktemp("hooks") / "docs")
    rng = np.random.default_rng(0)
    write_indexed_dataset(prefix, [rng.integers(0, 100, n) for n in (5, 9, 30, 2, 17, 40)])
    return prefix


HSP_ARGS = [
    "--num-attention-heads",
    "8",
    "--global-batch-size",
    "8",
    "--seq-length",
    "64",
    "--eval-iters",
    "0",
    "--attention-dropout",
    "0",
    "--hsp-cost-model",
    str(FIXTURES / "cost-model-tiny.yaml"),
    "--hsp",
]


def test_without_hsp_nothing_changes():
    args = parse(["--num-attention-heads", "8", "--global-batch-size", "8", "--seq-length", "64"])
    provider, forward = object(), object()
    assert install(args, provider, forward) == (provider, forward)
    assert patches.applied() == [] and hooks.active_run() is None


def test_install_needs_megatron_training_and_says_so(monkeypatch, corpus):
    monkeypatch.setitem(sys.modules, "megatron.training.training", None)
    args = parse([*HSP_ARGS, "--data-path", corpus], world_size=2)
    try:
        with pytest.raises(HSPError, match=r"Megatron-LM's megatron\.training\.training"):
            install(args)
    finally:
        patches.remove_patches()
        hooks.set_run(None)


def test_install_keeps_a_user_spec_as_the_base(stand_in_megatron_training, corpus):
    args = parse([*HSP_ARGS, "--data-path", corpus, "--spec", "my.module", "my_spec"], world_size=2)
    install(args)
    assert args.hsp_base_spec == ["my.module", "my_spec"]
    assert args.spec == ["megatron_hsp.megatron.layer_spec", "hsp_layer_spec"]


def test_patched_step_counts_come_from_the_plan_only_in_the_schedule(
    stand_in_megatron_training, monkeypatch, corpus
):
    training, calls = stand_in_megatron_training
    args = parse([*HSP_ARGS, "--data-path", corpus], world_size=2)
    provider, forward = install(args, "theirs", "theirs")
    assert (provider, forward) == (hooks.hsp_datasets_provider, hooks.hsp_forward_step)
    assert args.spec == ["megatron_hsp.megatron.layer_spec", "hsp_layer_spec"]
    assert patches.applied() == [
        "megatron.training.training.train_step",
        "megatron.training.training.get_forward_backward_func",
        "megatron.training.training.num_floating_point_operations",
    ]
    run = hooks.active_run()
    out = io.StringIO()
    run.observer = StepObserver(stream=out)
    run.pipeline = object()  # the step pipeline itself is covered by the demo and data tests

    def fake_begin(r):
        batch = DocumentBatch(0, (Piece(4, 0, 100), Piece(7, 0, 30), Piece(9, 0, 10)))
        r.current = types.SimpleNamespace(
            plan=plan2(), step=0, solve_s=0.003, wait_s=0.0, batch=batch
        )

    monkeypatch.setattr(hooks, "begin_step", fake_begin)
    assert training.get_num_microbatches() == 7  # outside a step: Megatron's own count

    def schedule(**kw):
        calls.append(("schedule", kw["num_microbatches"]))

    result = training.train_step("fwd", "it", "model", "opt", "sched", "cfg", schedule)
    # The schedule runs the plan's two micro-batches; the LR increment keeps Megatron's count
    # (the global batch), as without --hsp.
    assert calls == [("schedule", 2), ("increment", 7)]
    assert training.get_num_microbatches() == 7
    assert result[0] == {"lm loss": 2.5}
    line = out.getvalue()
    assert "loss 2.5000" in line and "2 mb [2] | [1,1]" in line and "pred 14 ms" in line
    patches.remove_patches()
    assert training.get_num_microbatches() == 7 and patches.applied() == []


def test_observer_writes_plan_log_and_writers(tmp_path):
    class Writer:
        def __init__(self):
            self.seen = {}

        def add_scalar(self, k, v, step):
            self.seen[k] = v

        def log(self, d, step):
            self.seen.update(d)

    tb, wb = Writer(), Writer()
    log = tmp_path / "plans.jsonl"
    obs = StepObserver(
        plan_log=str(log), stream=io.StringIO(), tensorboard_writer=tb, wandb_writer=wb
    )
    plan = plan2()
    obs.record(StepRecord.from_plan(3, plan, loss=1.0, measured_s=0.028, wait_s=0.002), plan)
    obs.close()
    row = json.loads(log.read_text())
    assert (
        row["step"] == 3 and row["group_sizes"] == [[2], [1, 1]] and row["plan"]["world_size"] == 2
    )
    assert tb.seen["hsp/measured_over_predicted"] == pytest.approx(2.0)
    assert wb.seen["hsp/planner_wait_ms"] == pytest.approx(2.0)
    # micro-batch 2: groups of 4 and 2 ms -> 1 ms idle of 4; micro-batch 1: one group, none
    assert group_imbalance(plan) == pytest.approx(1.0 / 14.0)


def test_evaluation_schedule_runs_the_plans_count_only_for_hsp_eval_iterators(
    stand_in_megatron_training, corpus
):
    """``evaluate()`` calls the schedule by keyword with its own count (eval global batch /
    (mbs x dp)); with HSP's validation iterator (wrapped by Megatron in RerunDataIterator) the
    patched ``get_forward_backward_func`` prepares the split's next batch and runs its plan's
    count; other iterators pass through; a split without documents (iterator None) runs
    nothing."""
    from megatron.core.rerun_state_machine import RerunDataIterator

    training, calls = stand_in_megatron_training
    install(parse([*HSP_ARGS, "--data-path", corpus], world_size=2), "theirs", "theirs")
    run = hooks.active_run()
    began = []

    class Pipeline:
        def next_step(self):
            began.append(1)
            return types.SimpleNamespace(plan=plan2(), batch="batch", documents=[])

    evaluation = hooks._EvalIterator(run, "valid", Pipeline())

    def begin():  # the real begin() dispatches tokens; only the count matters here
        n = len(Pipeline().next_step().plan.microbatches)
        evaluation.batches.append("batch")
        return n

    evaluation.begin = begin
    schedule = training.get_forward_backward_func()
    schedule(data_iterator=RerunDataIterator(evaluation), num_microbatches=4, forward_only=True)
    schedule(data_iterator=iter([]), num_microbatches=4, forward_only=True)
    assert schedule(data_iterator=None, num_microbatches=4, forward_only=True) == [{}]
    assert calls == [("eval schedule", 2), ("eval schedule", 4)]
    assert evaluation.batches == ["batch"] and began == [1]
    with pytest.raises(HSPError, match="process_non_loss_data_func"):
        schedule(data_iterator=evaluation, num_microbatches=4, collect_non_loss_data=True)
    with pytest.raises(RuntimeError, match="evaluation on the valid split asked for more"):
        next(evaluation)


# ------------------------------------------------------------------ pipeline parallelism (issue 17)


def test_interleaved_schedule_counts_are_padded_to_the_group_multiple():
    """megatron-core's interleaved schedule needs a multiple of its micro-batch group size (at
    least one group); 1F1B (multiple 1) runs the plan's count as is."""
    assert [hooks.schedule_count(n, 2) for n in (1, 2, 3, 4, 5)] == [2, 2, 4, 4, 6]
    assert [hooks.schedule_count(n, 1) for n in (1, 3, 7)] == [1, 3, 7]
    assert hooks.schedule_count(4, 3) == 6


def test_every_model_chunk_reads_every_micro_batch_in_order():
    """Virtual pipeline: one iterator per chunk over the same inputs, each from its own
    position, and none past the plan's count."""
    run = hooks.HSPRun(config=None)
    run.inputs, run.read = ["mb0", "mb1", None], {}
    first, second = hooks._MicroBatchIterator(run, 0), hooks._MicroBatchIterator(run, 1)
    assert [next(first), next(second), next(second), next(first)] == ["mb0", "mb0", "mb1", "mb1"]
    assert next(second) is None and next(first) is None
    with pytest.raises(RuntimeError, match="more micro-batches than the plan has"):
        next(first)
    evaluation = hooks._EvalIterator(run, "valid", pipeline=None)
    evaluation.inputs = ["e0"]
    assert hooks.eval_iterator_of([evaluation, evaluation.chunk(1)]) is evaluation
    assert next(evaluation.chunk(1)) == "e0" and next(evaluation) == "e0"


def test_an_idle_micro_batch_keeps_every_stage_boundary_connected():
    """A rank idle in a micro-batch sends a zero activation on (not the last stage) and, past
    the first stage, ties it to what it received, so a zero gradient goes back: every send and
    receive of Megatron's schedule has its partner."""
    import torch

    from megatron_hsp.runtime.schedule import forward_microbatch

    class Stage(torch.nn.Module):
        def __init__(self, pre: bool, post: bool) -> None:
            super().__init__()
            self.pre_process, self.post_process = pre, post
            self.weight = torch.nn.Parameter(torch.ones(3))
            self.decoder = types.SimpleNamespace(input_tensor=None)
            self.config = types.SimpleNamespace(hidden_size=8)

    middle = Stage(pre=False, post=False)
    middle.decoder.input_tensor = received = torch.randn(5, 1, 8, requires_grad=True)
    out, mask = forward_microbatch(middle, None)
    assert out.shape == (1, 1, 8) and float(out.abs().sum()) == 0.0 and float(mask.sum()) == 0
    out.backward(torch.ones_like(out))
    assert received.grad is not None and float(received.grad.abs().sum()) == 0.0
    assert middle.weight.grad is not None
    last = Stage(pre=False, post=True)
    last.decoder.input_tensor = received = torch.randn(5, 1, 8, requires_grad=True)
    loss, _ = forward_microbatch(last, None)
    assert loss.shape == (1, 1)
    loss.sum().backward()
    assert received.grad is not None
    first = Stage(pre=True, post=False)
    out, _ = forward_microbatch(first, None)
    assert out.shape == (1, 1, 8) and out.requires_grad


def test_static_best_looks_ahead_at_the_runs_own_next_batches_and_puts_them_back():
    """--hsp-plan-method static-best: the planner gets the lengths of the batches the run is
    about to train, and the sampler then draws exactly those batches."""
    from megatron_hsp.step.planner_service import PlannerSpec
    from megatron_hsp.step.sampler import GlobalBatchSampler, SamplerConfig

    lengths = [200, 30, 30, 12, 7, 90, 60, 60, 60, 60, 5, 250, 8, 8, 8] * 3
    sampler = GlobalBatchSampler(lengths, SamplerConfig(seed=1, max_length=256, token_budget=512))
    spec = PlannerSpec("tiny", 4, 4, 256, options={"method": "static-best"})
    before = sampler.state_dict()
    args = types.SimpleNamespace(train_iters=5, iteration=0)
    out = hooks._static_best_lookahead(spec, sampler, args)
    assert sampler.state_dict() == before
    ahead = out.options["lookahead"]
    assert len(ahead) == 5 and out.options["method"] == "static-best"
    assert [sampler.next_batch().lengths for _ in range(5)] == ahead


def test_start_up_line_says_tokens_and_expected_documents_per_step():
    from megatron_hsp.step.sampler import GlobalBatchSampler, SamplerConfig

    args = parse(
        [
            *("--num-attention-heads", "8", "--global-batch-size", "8", "--seq-length", "64"),
            *("--attention-dropout", "0", "--hsp"),
        ]
    )
    cfg = validate_hsp_args(args, env={})
    lengths = [16, 48, 32, 32] * 10  # mean 32 tokens: 512 / 32 = 16 documents per step
    sampler = GlobalBatchSampler(lengths, SamplerConfig(seed=1, max_length=64, token_budget=512))
    line = hooks.batch_line(cfg, args, sampler)
    assert "at most 512 tokens per step (--global-batch-size 8 x --seq-length 64" in line
    assert "expected 16.0 documents per step (mean sequence 32 tokens)" in line
    assert "count 8 samples per step" in line


def test_evaluation_batches_scale_the_token_budget_as_megatron_scales_its_batch():
    args = parse(
        [
            *("--num-attention-heads", "8", "--global-batch-size", "8", "--seq-length", "64"),
            *("--attention-dropout", "0", "--hsp"),
        ]
    )
    cfg = validate_hsp_args(args, env={})
    assert hooks._eval_budget(cfg, args, 8) == 512  # Megatron's default: the training batch
    assert hooks._eval_budget(cfg, args, 4) == 256
    args.hsp_batch_unit = "documents"
    assert hooks._eval_budget(validate_hsp_args(args, env={}), args, 4) is None
