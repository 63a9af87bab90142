"""What one demo run is: ``DemoConfig`` and the demo's built-in model, cost model and limits.

Its own module because three modules read it: ``demo`` builds it from the flags, and the ranks
it starts (``demo_ranks``, ``demo_worker``) receive it; with it in ``demo.py`` they imported the
module that imports them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from megatron_hsp.planner.cost.costmodel import CostModel
from megatron_hsp.planner.run_spec import (
    DimFlags,
    GroupSizeRequest,
    OverlongPolicy,
    ParallelDims,
    allowed_sizes,
)
from megatron_hsp.planner.search.settings import PlannerSettings, RunSpec

# A cost model for the demo's tiny GPT on CPU ranks. The memory cap (tokens_per_rank) is what
# makes plans heterogeneous: a document over 1024 tokens needs a group of 2, over 2048 a group of
# 4, and longer ones are split into 4096-token pieces. At 512 tokens per rank every micro-batch
# was memory-bound (all groups of 4); 1024 leaves the planner room to mix sizes. Time
# coefficients were fitted on a 2-core CPU for DEMO_MODEL (fwd+bwd per rank; see
# docs/integration.md); predicted step times are of the right order here, not elsewhere.
DEMO_COST_MODEL: dict[str, Any] = {
    "name": "demo-cpu-tiny-gpt",
    "coefficients": {
        "attn_ms_per_token2": 5.0e-5,
        "linear_ms_per_token": 0.12,
        "group_fixed_ms": 30.0,
        "a2a_ms_per_token": {2: 0.03, 4: 0.04},
        "tokens_per_rank": 1024,
    },
}
# The demo's steps take about a second on CPU ranks: half the training default's plan budget.
DEMO_TIME_BUDGET_S = 0.5
DEMO_MAX_TOKEN_BUDGET = 262_144  # tokens per step on CPU ranks
DEMO_MAX_GLOBAL_BATCH = 4096  # documents per step
DEMO_MODEL = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2)
# The demo's ranks are one node of --nproc CPU ranks (or torchrun's WORLD_SIZE).
DEMO_FLAGS = DimFlags(world="--nproc", gpus_per_node="--nproc")


@dataclass
class DemoConfig:
    steps: int = 8
    nproc: int = 4
    token_budget: int | None = 8192
    global_batch: int | None = None
    seed: int = 0
    lr: float = 3e-3
    # The side-by-side: batches re-run with static groups, each this many times per layout, so
    # that ``compare`` reports a spread (3 batches once each could not tell 7% from noise).
    compare_steps: int = 8
    compare_repeats: int = 3
    planner: PlannerSettings = field(
        default_factory=lambda: PlannerSettings(time_budget_s=DEMO_TIME_BUDGET_S)
    )
    cache_dir: str | None = None
    corpus_prefix: str = ""
    quiet: bool = False
    stall_timeout_s: float = 30.0
    # preset name, YAML/JSON file (e.g. written by `megatron-hsp profile`) or a spec mapping
    cost_model: str | dict[str, Any] = field(default_factory=lambda: dict(DEMO_COST_MODEL))
    # Online refit of the cost model from measured group times (step/observe.StepRefitter); the
    # refit model is written to ``refit_out`` for the next run's --cost-model.
    refit: bool = True
    refit_out: str | None = None
    # Documents longer than the largest group trains are split: the corpus has a few.
    overlong: OverlongPolicy = OverlongPolicy.SPLIT
    extra: dict[str, Any] = field(default_factory=dict)

    def run_spec(self, cost: CostModel) -> RunSpec:
        """The demo's run description: ``nproc`` ranks in one node, no model parallelism, every
        legal size ``cost`` prices, documents as long as the largest of them trains whole.

        Only priced sizes: every size up to a node is legal (3 of 4 included), which a
        pure-Ulysses model of 4 heads cannot run and the planner cannot cost."""
        dims = ParallelDims(self.nproc, self.nproc, flags=DEMO_FLAGS)
        request = GroupSizeRequest()
        sizes = allowed_sizes(request, dims.cluster(), cost.sizes, "--cost-model")
        planner = dataclasses.replace(self.planner, sizes=sizes, seed=self.seed)
        max_seq = cost.max_trainable_length(list(sizes))
        return RunSpec(dims, request, self.overlong, planner, max_seq, sizes_flag="--cost-model")
