"""Per-step observability: the plan, predicted vs measured time, imbalance, planner cost.

One ``StepRecord`` per step goes to the console (one line), to ``--hsp-plan-log`` (JSON lines with
the full docs/design.md plan), and to Megatron's TensorBoard / W&B writers when the run configured
them (``megatron.training.global_vars.get_tensorboard_writer`` / ``get_wandb_writer``; both return
None unless ``--tensorboard-dir`` / ``--wandb-project`` were given, and exist only on the rank
Megatron chose to write).
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any, TextIO

from megatron_hsp.planner.cost.costcore import CostModel
from megatron_hsp.planner.cost.execution import price, step_wall_ms
from megatron_hsp.planner.cost.refit import TERMS as REFIT_TERMS
from megatron_hsp.planner.paths import AppendLog
from megatron_hsp.planner.plan import Plan


def group_imbalance(plan: Plan) -> float:
    """Predicted idle fraction inside micro-batches: 1 - mean(group time) / max(group time),
    averaged over micro-batches weighted by their time (0 = perfectly balanced groups)."""
    num = den = 0.0
    for mb in plan.microbatches:
        times = [g.est_ms for g in mb.groups]
        top = max(times, default=0.0)
        if top > 0:
            num += top - sum(times) / len(times)
            den += top
    return num / den if den > 0 else 0.0


def layout_summary(plan: Plan) -> str:
    """``2 mb: [4] | [2,1,1]``: the group sizes of each micro-batch."""
    parts = ["[" + ",".join(str(s) for s in mb.group_sizes) + "]" for mb in plan.microbatches]
    return f"{len(plan.microbatches)} mb: " + " | ".join(parts)


def plan_ms(plan: Plan, model: CostModel) -> float:
    """A plan's time under ``model`` outside a pipeline: the execution model's price
    (``planner/cost/execution.py``, how the planner prices ``est_step_ms``)."""
    return price(plan, model).est_step_ms


def predicted_step_ms(plan: Plan, model: Any) -> float:
    """What ``model`` predicts for the step that runs ``plan``: its micro-batches plus the
    model's per-step cost (``CostModel.step_overhead_ms``). The one pricing rule of every logged
    prediction (the demo's JSON, the Megatron hooks' records): ``execution.step_wall_ms``."""
    return step_wall_ms(price(plan, model), model)


@dataclass
class StepRecord:
    step: int
    loss: float | None
    microbatches: int
    group_sizes: list[list[int]]
    num_sequences: int
    tokens: int
    predicted_ms: float
    measured_ms: float | None
    imbalance: float
    solve_ms: float
    planner_wait_ms: float
    status: str
    solver: str
    # The plan's own estimate (``est_step_ms`` + the per-step cost of the model the plan was made
    # with); ``predicted_ms`` re-prices the plan with the newest model when the step starts.
    planned_ms: float = 0.0
    # The global batch's identity (``DocumentBatch.fingerprint``): ``megatron-hsp compare``
    # checks two runs trained the same batches step by step.
    batch_fingerprint: str = ""
    # Megatron's model FLOPs of the documents trained (``hooks.document_flops``) and the GPUs
    # they ran on: the line's TFLOP/s per GPU. None where no Megatron args exist.
    model_flops: float | None = None
    gpus: int = 1
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float | None:
        """Measured tokens per second of the step (every GPU together)."""
        if not self.measured_ms:
            return None
        return self.tokens / (self.measured_ms / 1e3)

    @property
    def tflops_per_gpu(self) -> float | None:
        """Measured model TFLOP/s per GPU, as Megatron's ``--log-throughput`` defines it."""
        if not self.measured_ms or self.model_flops is None:
            return None
        return self.model_flops / (self.measured_ms / 1e3 * 1e12 * max(1, self.gpus))

    @classmethod
    def from_plan(
        cls,
        step: int,
        plan: Plan,
        *,
        loss: float | None = None,
        measured_s: float | None = None,
        solve_s: float | None = None,
        wait_s: float = 0.0,
        step_overhead_ms: float = 0.0,
        model: Any = None,
        batch_fingerprint: str = "",
        model_flops: float | None = None,
        gpus: int = 1,
        **extra: Any,
    ) -> StepRecord:
        """``step_overhead_ms``: the per-step cost of the model the plan was made with (goes to
        ``planned_ms``). ``model``: the newest cost model when the step started (a refit one):
        ``predicted_ms`` is the plan priced by it (``predicted_step_ms``). Why: plans are made
        ahead of their step (the demo and the hooks prefetch one step), so the model a plan was
        made with lags the machine by one more step than the newest one. None, or a pipelined
        plan (its ``est_step_ms`` is the pipelined step, not a sum of micro-batches; the refit is
        off under a pipeline anyway): ``predicted_ms`` is the plan's own estimate."""
        planned = plan.est_step_ms + step_overhead_ms
        predicted = (
            predicted_step_ms(plan, model)
            if model is not None and "pipeline" not in plan.extra
            else planned
        )
        return cls(
            step=step,
            loss=loss,
            microbatches=len(plan.microbatches),
            group_sizes=[mb.group_sizes for mb in plan.microbatches],
            num_sequences=plan.num_sequences,
            tokens=sum(g.tokens for mb in plan.microbatches for g in mb.groups),
            predicted_ms=predicted,
            measured_ms=None if measured_s is None else measured_s * 1e3,
            imbalance=group_imbalance(plan),
            solve_ms=plan.solve_ms if solve_s is None else solve_s * 1e3,
            planner_wait_ms=wait_s * 1e3,
            status=plan.status,
            solver=plan.solver,
            planned_ms=planned,
            batch_fingerprint=batch_fingerprint,
            model_flops=model_flops,
            gpus=gpus,
            extra=dict(extra),
        )

    def console_line(self) -> str:
        sizes = Counter(s for mb in self.group_sizes for s in mb)
        size_txt = " ".join(f"{n}x{s}" for s, n in sorted(sizes.items(), reverse=True))
        mb_txt = " | ".join("[" + ",".join(map(str, mb)) + "]" for mb in self.group_sizes)
        measured = "-" if self.measured_ms is None else f"{self.measured_ms:.0f}"
        loss = "" if self.loss is None else f"loss {self.loss:.4f}  "
        wait = f"  waited {self.planner_wait_ms:.0f} ms" if self.planner_wait_ms >= 1 else ""
        rate = ""
        if self.tokens_per_s is not None:
            rate = f"  {self.tokens_per_s:.0f} tok/s"
            if self.tflops_per_gpu is not None:
                rate += f" {self.tflops_per_gpu:.3g} TFLOP/s/GPU"
        return (
            f"step {self.step:>4}  {loss}{self.num_sequences} seqs {self.tokens} tok  "
            f"{self.microbatches} mb {mb_txt} ({size_txt})  pred {self.predicted_ms:.0f} ms  "
            f"meas {measured} ms{rate}  imbal {self.imbalance:.0%}  solve {self.solve_ms:.0f} ms "
            f"[{self.status}]{wait}"
        )


class StepObserver:
    """Fans step records out to the console, a JSONL plan log and Megatron's writers."""

    def __init__(
        self,
        *,
        log_interval: int = 1,
        plan_log: str | None = None,
        stream: TextIO | None = None,
        tensorboard_writer: Any = None,
        wandb_writer: Any = None,
    ) -> None:
        self.log_interval = log_interval
        self.stream = stream if stream is not None else sys.stdout
        self.plan_log = AppendLog(plan_log) if plan_log else None
        self.tb = tensorboard_writer
        self.wandb = wandb_writer
        self.records: list[StepRecord] = []

    @classmethod
    def from_megatron(cls, **kwargs: Any) -> StepObserver:
        """Use Megatron's writers when the run configured them (and megatron.training exists)."""
        try:
            from megatron.training.global_vars import get_tensorboard_writer, get_wandb_writer

            tb, wb = get_tensorboard_writer(), get_wandb_writer()
        except (ImportError, AssertionError):
            tb = wb = None
        return cls(tensorboard_writer=tb, wandb_writer=wb, **kwargs)

    def record(self, rec: StepRecord, plan: Plan | None = None) -> None:
        self.records.append(rec)
        if self.log_interval and rec.step % self.log_interval == 0:
            print("[megatron-hsp] " + rec.console_line(), file=self.stream, flush=True)
        if self.plan_log is not None:
            row = asdict(rec)
            if plan is not None:
                row["plan"] = plan.to_dict()
            self.plan_log.write(json.dumps(row) + "\n")
            self.plan_log.flush()
        scalars = {
            "hsp/predicted_step_ms": rec.predicted_ms,
            "hsp/imbalance": rec.imbalance,
            "hsp/solve_ms": rec.solve_ms,
            "hsp/planner_wait_ms": rec.planner_wait_ms,
            "hsp/microbatches": rec.microbatches,
            "hsp/max_group_size": max((s for mb in rec.group_sizes for s in mb), default=0),
            "hsp/tokens": rec.tokens,
        }
        if rec.tokens_per_s is not None:
            scalars["hsp/tokens_per_s"] = rec.tokens_per_s
        if rec.tflops_per_gpu is not None:
            scalars["hsp/tflops_per_gpu"] = rec.tflops_per_gpu
        if rec.measured_ms is not None:
            scalars["hsp/measured_step_ms"] = rec.measured_ms
            if rec.predicted_ms > 0:
                scalars["hsp/measured_over_predicted"] = rec.measured_ms / rec.predicted_ms
        if self.tb is not None:
            for k, v in scalars.items():
                self.tb.add_scalar(k, v, rec.step)
        if self.wandb is not None:
            self.wandb.log(scalars, rec.step)

    def close(self) -> None:
        if self.plan_log is not None:
            self.plan_log.close()
            self.plan_log = None


# Largest relative move of a refit factor per training step. A model fitted elsewhere can be off
# by 2x on the machine at hand (the demo's built-in CPU model predicted 114% high on a fresh
# machine): at 25% per update it takes three accepted updates to halve a factor, at 50% two, and
# the plan of step t + 2 is the first to see the update after step t.
REFIT_MAX_STEP = 0.5
# Group records before the first update. The fit pulls every factor towards one common factor
# (planner/cost/refit.PRIOR_RECORDS), which any record informs, so a step's handful of records is
# enough for a bounded first move; at 8 the demo's first update waited for step 2 and a model
# off by 2x was not corrected in time for step 5.
REFIT_MIN_RECORDS = 4
# Steps over which a record's weight halves (planner/cost/refit.OnlineRefit.half_life): the
# machine's speed changes under other jobs (the demo's steps 2-4 and 5-7 differed by 30% on a loaded
# machine), and with equal weights the model stayed at the old speed. At 2 steps a machine 2x
# slower from step 3 on was still predicted 20-40% fast at steps 5-7: in the window the older,
# faster records outweighed the newest step's few (the 50% bound was not what held it: replayed
# at 100% the errors were the same; docs/costmodel.md, "Re-pricing the prefetched plan"). At 0.5
# the step before weighs 1/4, the one before that 1/16; the prior towards the common factor still
# holds the model's shape, and a factor still moves at most REFIT_MAX_STEP per update.
REFIT_HALF_LIFE_STEPS = 0.5


def group_timings(plan: Plan, microbatch_s: list[list[float]]) -> list[tuple[int, Any]]:
    """``(micro-batch index, GroupTiming)`` of every group that trained something.

    ``microbatch_s[slot][m]``: the seconds slot spent in micro-batch ``m``, measured from its
    start. A group's time is its members' *shortest*: members leave a micro-batch together (its
    collectives join them up to the end of the backward), but one that left the previous
    micro-batch early waits in this one's first collective for a late partner, so its time also
    holds that wait, which belongs to the previous micro-batch (the model charges a step the sum
    of each micro-batch's slowest group). The member that arrived last waited for no one.
    """
    from megatron_hsp.planner.cost.refit import GroupTiming

    return [
        (
            m,
            GroupTiming(
                lengths=list(g.lengths),
                d=g.size,
                measured_ms=1e3 * min(microbatch_s[r][m] for r in g.ranks),
                split=(g.ulysses, g.ring) if g.ulysses else None,
            ),
        )
        for m, mb in enumerate(plan.microbatches)
        for g in mb.groups
        if g.seq_ids
    ]


# ``StepRefitter.model_state``'s length: the factors (planner/cost/refit.TERMS: four terms and
# the ring routes' attention), then the step cost.
MODEL_STATE = len(REFIT_TERMS) + 1


def model_from_state(base: Any, state: list[float]) -> Any:
    """The refitter's model rebuilt from ``StepRefitter.model_state`` on a rank that has only
    the starting model ``base``: the same coefficients, so the same price for every plan."""
    import dataclasses

    from megatron_hsp.planner.cost.refit import TERMS, scaled_model

    assert len(state) == MODEL_STATE == len(TERMS) + 1
    model = scaled_model(base, dict(zip(TERMS, state[: len(TERMS)], strict=True)))
    return dataclasses.replace(model, details={**base.details, "step_ms": float(state[-1])})


def _priced(model: Any, t: Any) -> float:
    return float(model.group_ms(list(t.lengths), t.d, t.split))


class StepRefitter:
    """The observer's online refit: measured group times -> the planner's model.

    Why here: the observer already sees every step's plan and its measured time; a cost model
    fitted elsewhere (a preset, a ``profile`` run) is wrong on the machine at hand by factors no
    one knows in advance. After each step (past ``skip_steps``, whose times include first-touch
    allocation and process-group creation) the group timings go to
    ``planner.cost.refit.OnlineRefit``, a robust, bounded update of the model's four term factors
    that refuses non-monotone or worse fits. An accepted model is what the caller hands the planner
    next (``PlannerService.use_cost_model``) and, with ``out``, is written as a YAML spec that
    ``--cost-model`` / ``--hsp-cost-model`` reads on the next run.

    Group time: ``group_timings``. ``planner``: the ``PlannerService`` an accepted model is
    handed to (None: the caller plans with ``model`` itself). The demo and the Megatron hooks
    both drive this class; only how they measure micro-batches differs.
    """

    def __init__(
        self,
        cost: Any,
        *,
        skip_steps: int = 1,
        out: str | None = None,
        max_step: float = REFIT_MAX_STEP,
        min_records: int = REFIT_MIN_RECORDS,
        half_life: float | None = REFIT_HALF_LIFE_STEPS,
        planner: Any = None,
    ) -> None:
        from megatron_hsp.planner.cost.refit import OnlineRefit

        self.refit = OnlineRefit(
            cost, max_step=max_step, min_records=min_records, half_life=half_life
        )
        self.skip_steps = skip_steps
        self.out = out
        self.planner = planner
        self.seen = 0  # steps offered: the first ``skip_steps`` of a run (or a resume) skipped
        self.updates: list[dict[str, Any]] = []

    @property
    def model(self) -> Any:
        return self.refit.model

    def model_state(self) -> list[float]:
        """The current model in ``MODEL_STATE`` numbers (its factors against the starting model,
        then its per-step cost): what rank 0 sends the logging rank so that it prices plans with
        the same model (``model_from_state``) without a spec in a collective."""
        from megatron_hsp.planner.cost.refit import TERMS

        return [float(self.refit.scales[k]) for k in TERMS] + [self.model.step_overhead_ms]

    def record(
        self,
        step: int,
        plan: Plan,
        microbatch_s: list[list[float]],
        step_s: float,
        *,
        step_is_clean: bool = True,
    ) -> Any:
        """Refit from one step; returns the ``RefitResult`` (None for a skipped step).

        ``microbatch_s[slot][m]``: slot's forward + backward seconds of micro-batch ``m``.
        ``step_is_clean``: False when the step paid one-time costs outside its micro-batches
        (e.g. created process groups); its step time then does not inform the per-step cost.
        """
        from megatron_hsp.planner.cost.refit import StepTiming

        self.seen += 1
        if self.seen <= self.skip_steps:
            return None
        groups = group_timings(plan, microbatch_s)
        # The step as the model prices it: per micro-batch its slowest group, summed; what the
        # step took beyond that is the per-step cost (optimizer, gradient all-reduce).
        mb_ms = sum(
            max((t.measured_ms for m2, t in groups if m2 == m), default=0.0)
            for m in range(len(plan.microbatches))
        )
        steps = [StepTiming(step_ms=1e3 * step_s, microbatch_ms=mb_ms)] if step_is_clean else []
        before = self.refit.model
        result = self.refit.update([t for _, t in groups], steps)
        self.updates.append(
            {
                "step": step,
                "step_ms": 1e3 * step_s,
                "microbatch_ms": mb_ms,
                # Each record: micro-batch, group size, tokens, measured ms, the model's ms before
                # this update (what the demo's JSON shows of each update).
                "records": [
                    [m, t.d, sum(t.lengths), round(t.measured_ms, 2), round(_priced(before, t), 2)]
                    for m, t in groups
                ],
                "accepted": result.accepted,
                "reason": result.reason,
                "median_rel_err_before": result.median_rel_err_before,
                "median_rel_err_after": result.median_rel_err_after,
                "scales": dict(result.scales),
                # The per-step cost of the model after this update (what a prediction adds).
                "step_overhead_ms": self.refit.model.step_overhead_ms,
            }
        )
        if result.accepted and self.planner is not None:
            self.planner.use_cost_model(result.spec)
        if result.accepted and self.out:
            import yaml

            from megatron_hsp.planner.paths import atomic_write

            atomic_write(self.out, yaml.safe_dump(result.spec, sort_keys=False))
        return result

    def summary_line(self) -> str:
        """One line on the last update: accepted or refused, why, errors, factors."""
        u = self.updates[-1]
        factors = " ".join(f"{k} {v:.2f}" for k, v in u["scales"].items())
        verdict = "accepted" if u["accepted"] else "refused"
        errors = (
            f"median error {u['median_rel_err_before']:.1%} -> {u['median_rel_err_after']:.1%}"
            if u["median_rel_err_before"] == u["median_rel_err_before"]  # not NaN
            else "no error measured"
        )
        detail = (
            u["reason"]
            if not u["accepted"]
            else errors + (f"; written to {self.out}" if self.out else "")
        )
        return (
            f"refit after step {u['step']}: {verdict} ({len(u['records'])} records this step; "
            f"{detail}); factors {factors}"
        )
