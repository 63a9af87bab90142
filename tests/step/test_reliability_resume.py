"""Issue 9, resume: stop after step k, restore the pipeline from its checkpointed state, and the
steps k+1.. get the same samples and the same plans as an uninterrupted run (CPU, one process,
the real greedy planner in-process)."""

from __future__ import annotations

import numpy as np
import pytest

from megatron_hsp.planner.search.settings import PlannerSettings
from megatron_hsp.step.pipeline import StepPipeline
from megatron_hsp.step.planner_service import PlannerService, PlannerSpec
from megatron_hsp.step.sampler import GlobalBatchSampler, SamplerConfig

pytestmark = pytest.mark.spawns

COST = {
    "name": "resume-test",
    "coefficients": {
        "attn_ms_per_token2": 5.0e-5,
        "linear_ms_per_token": 0.12,
        "group_fixed_ms": 30.0,
        "a2a_ms_per_token": {2: 0.03, 4: 0.04},
        "tokens_per_rank": 1024,
    },
}
LENGTHS = np.random.default_rng(5).integers(1, 3000, 400)


class _NoTokens:
    """The reader is irrelevant to resume (it maps plans to tokens); return no documents."""

    def batch_for_rank(self, batch, plan, slot):
        return None


def _pipeline() -> StepPipeline:
    spec = PlannerSpec(
        COST, world_size=4, gpus_per_node=4, max_seq=4096, settings=PlannerSettings("greedy")
    )
    sampler = GlobalBatchSampler(
        LENGTHS, SamplerConfig(seed=7, max_length=4096, token_budget=6000, overlong="split")
    )
    return StepPipeline(
        sampler,
        _NoTokens(),
        slot=0,
        world_size=4,
        planner=PlannerService(spec, background=False),
        is_planning_rank=True,
    )


def _trace(pipe: StepPipeline, steps: int) -> list[tuple[int, tuple, str]]:
    out = []
    for _ in range(steps):
        s = pipe.next_step()
        out.append((s.step, tuple(s.batch.lengths), s.plan.fingerprint()))
    return out


def test_resume_after_step_k_reproduces_samples_and_plans():
    k, more = 3, 4
    reference = _trace(_pipeline(), k + more)

    first = _pipeline()
    assert _trace(first, k) == reference[:k]
    saved = first.state_dict()  # what a checkpoint after step k stores (prefetch excluded)
    assert saved["step"] == k, saved

    resumed = _pipeline()
    resumed.load_state_dict(saved)
    assert _trace(resumed, more) == reference[k:]
    assert "in 7 steps" in resumed.report()  # counters: trained batches, not the prefetched one
