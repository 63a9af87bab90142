"""``megatron-dcp-dev``: dev's scheduler read from a checkout, its groups priced as packed CP.

No Megatron-LM code is committed, so the checkout here is a stand-in with the same file layout
and names: its module-level imports (torch, a Transformer Engine helper) must not run, and its
scheduler's grouping must be what the plan holds. The real dev checkout's figures are in
docs/results/benchmarks.md.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import numpy as np
import pytest

from megatron_hsp.cli import main
from megatron_hsp.evaluation.torch_side.dcp_dev_baseline import (
    CHECKOUT_ENV,
    SCHEDULE,
    UTILS,
    load_dev_dp_balanced,
    load_dev_scheduler,
    megatron_dcp_dev_plan,
)
from megatron_hsp.planner.cost.costmodel import load_cost_model
from megatron_hsp.planner.errors import InputError
from megatron_hsp.planner.topology import Cluster

# Stand-in scheduler: each micro-batch is the longest remaining sequence on its minimum
# power-of-two CP size plus, on every other rank, one more sequence alone (ranks left empty
# take nothing). Module-level imports that would fail here prove they are not executed.
STAND_IN_UTILS = """
from functools import lru_cache
from math import ceil, log2
from typing import List, Tuple

import torch
from megatron.core.extensions.transformer_engine import get_thd_partitioned_indices

_DYNAMIC_CP_WORKLOAD_CAP_DELTA = 0.05


@lru_cache(maxsize=16)
def dcp_gpus_needed(seq_len, max_seq_len_per_rank, min_cp_size=1):
    return max(min_cp_size, max(1, 2 ** ceil(log2(seq_len / max_seq_len_per_rank))))


def next_hdp_group_packing_aware(sample_seqlens, total_gpus, max_seq_len_per_rank, min_cp_size=1):
    first_id, first_len = sample_seqlens[0]
    cp = dcp_gpus_needed(first_len, max_seq_len_per_rank, min_cp_size)
    ids: List[List[int]] = [[first_id] for _ in range(cp)] + [[] for _ in range(total_gpus - cp)]
    rest = list(sample_seqlens[1:])
    for rank in range(cp, total_gpus):
        if rest:
            ids[rank] = [rest.pop(0)[0]]
    return None, rest, None, ids


def align_sample_id_groups(sample_id_groups, microbatch_group_size_per_vp_stage):
    raise AssertionError("not called without a virtual pipeline")
"""
STAND_IN_SCHEDULE = """
import torch

from megatron.core.datasets.data_schedule_utils import next_hdp_group_packing_aware


class DefaultDynamicCPScheduler(DpBalancedScheduler):
    def get_groups_and_subsamples(self, sample_id_seqlens):
        groups = []
        rest = sorted(sample_id_seqlens, key=lambda x: x[1], reverse=True)
        while rest:
            _, rest, _, ids = next_hdp_group_packing_aware(
                rest, self.total_hdp_gpus, self.max_seq_len_per_rank, self.min_cp_size
            )
            groups.append(ids)
        return groups
"""


def _checkout(root: Path, utils: str = STAND_IN_UTILS, schedule: str = STAND_IN_SCHEDULE) -> Path:
    for rel, text in ((UTILS, utils), (SCHEDULE, schedule)):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(textwrap.dedent(text))
    return root


def test_plan_holds_the_checkouts_groups_packed(tmp_path: Path) -> None:
    cost = load_cost_model("llama3-8b-h100", world_size=8)
    cluster = Cluster(8, 8)
    schedule = load_dev_scheduler(_checkout(tmp_path))
    cap = cost.tokens_per_rank // 16 * 16  # lengths already padded: the plan holds them as is
    lengths = np.array([3 * cap, 496, 400, 304, 208, 96, 80, 80, 64, 48], dtype=np.int64)
    plan = megatron_dcp_dev_plan(lengths, cost, cluster, schedule)
    assert plan.extra["thd_pad_divisor"] == 16  # dynamic CP: multiples of 2 * dp * cp
    plan.validate(lengths.tolist(), cost, 8)  # packed: the whole group must fit, not one pass
    assert plan.extra["execution"] == "one-pass-per-group"
    assert plan.solver == "megatron-dcp-dev" and plan.extra["scheduler_microbatches"] == 2
    first, second = plan.microbatches
    busy = [[g for g in mb.groups if g.lengths] for mb in (first, second)]  # idle ranks: empty
    assert sorted(g.size for g in busy[0]) == [1, 1, 1, 1, 4]  # 3 cap -> CP 4, 4 singles
    assert [g.lengths for g in first.groups if g.size == 4] == [(3 * cap,)]
    assert sorted(g.size for g in busy[1]) == [1, 1, 1, 1, 1]  # 5 left, 3 ranks idle
    assert all(g.ring == g.size and g.ulysses == 1 for mb in plan.microbatches for g in mb.groups)


def test_refuses_without_a_checkout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(CHECKOUT_ENV, raising=False)
    with pytest.raises(InputError, match=f"{CHECKOUT_ENV} is not set"):
        load_dev_scheduler()
    with pytest.raises(InputError, match="does not exist"):
        load_dev_scheduler(tmp_path)
    no_align = STAND_IN_UTILS.replace("def align_sample_id_groups", "def renamed")
    with pytest.raises(InputError, match="defines no align_sample_id_groups"):
        load_dev_scheduler(_checkout(tmp_path, utils=no_align))
    no_method = STAND_IN_SCHEDULE.replace("get_groups_and_subsamples", "schedule")
    with pytest.raises(
        InputError, match=r"no DefaultDynamicCPScheduler\.get_groups_and_subsamples"
    ):
        load_dev_scheduler(_checkout(tmp_path, schedule=no_method))
    # The dp_balanced check's loader names its own user and remedy.
    with pytest.raises(InputError, match=r"dp_balanced_source_check: .* no DpBalancedScheduler"):
        load_dev_dp_balanced(_checkout(tmp_path))


def test_bench_runs_it_from_the_env_checkout_or_exits_2(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["bench", "--flexsp-harness", "--steps", "1", "--gpus", "8", "--global-batch", "32",
            "--max-seq", "3000", "--cost-model", "llama3-8b-h100",
            "--methods", "batchada,megatron-dcp-dev"]  # fmt: skip
    monkeypatch.delenv(CHECKOUT_ENV, raising=False)
    assert main(argv) == 2
    assert CHECKOUT_ENV in capsys.readouterr().err
    monkeypatch.setenv(CHECKOUT_ENV, str(_checkout(tmp_path)))
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "megatron-dcp-dev" in out and "infeasible" not in out
