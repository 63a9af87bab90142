"""bench's rows train the same tokens, checked from their plans, and every ratio is one of
summed whole step times (issue 43 items 1 and 4)."""

from __future__ import annotations

import numpy as np
import pytest

from megatron_hsp.evaluation.baselines import StockCP
from megatron_hsp.evaluation.bench import MethodResult, parse_methods, run_bench, token_comparison
from megatron_hsp.planner.cost.costmodel import load_cost_model
from megatron_hsp.planner.errors import InputError
from megatron_hsp.planner.lengths import GlobalBatch
from megatron_hsp.planner.topology import Cluster


def _batches(n: int = 2) -> list[GlobalBatch]:
    rng = np.random.default_rng(7)
    out = []
    for i in range(n):
        lengths = rng.integers(100, 3000, size=40).astype(np.int64)
        out.append(GlobalBatch(i, lengths, np.arange(40, dtype=np.int64)))
    return out


def test_every_row_trains_the_batch_tokens_and_ratios_are_whole_step_times():
    cost = load_cost_model("llama3-8b-h100", world_size=8)
    batches = _batches()
    out = run_bench(
        batches,
        cost,
        Cluster(8, 8),
        ["static-4", "megatron-static-cp4", "static-best"],
        stock=StockCP(cp=4, seq_length=4096),
    )
    summ, methods = out["summary"], out["methods"]
    tokens = [int(b.lengths.sum()) for b in batches]
    for name in ("static-4", "megatron-static-cp4", "static-best"):
        assert methods[name]["tokens"] == tokens, name
        assert summ["tokens_per_step"][name] == pytest.approx(np.mean(tokens))
    # no hsp row: nothing to compare against
    assert summ["comparison"] == {}
    stock = methods["megatron-static-cp4"]
    assert summ["total_step_s"]["megatron-static-cp4"] == pytest.approx(sum(stock["step_ms"]) / 1e3)
    assert stock["valid"] is True


def test_unequal_tokens_are_said_not_hidden():
    hsp, other = MethodResult(), MethodResult()
    hsp.tokens, other.tokens = [100, 200], [100, 150]
    same = MethodResult()
    same.tokens = [100, 200]
    got = token_comparison({"hsp": hsp, "other": other, "same": same})
    assert got["comparison"]["same"] == "equal tokens"
    assert got["comparison"]["other"].startswith("NOT equal tokens: 125 per step")


def test_stock_rows_need_a_megatron_job():
    assert parse_methods("hsp,megatron-static-cp8") == ["hsp", "megatron-static-cp8"]
    cost = load_cost_model("llama3-8b-h100", world_size=8)
    with pytest.raises(InputError, match="drop --flexsp-harness"):
        run_bench(_batches(1), cost, Cluster(8, 8), ["megatron-static-cp4"])
