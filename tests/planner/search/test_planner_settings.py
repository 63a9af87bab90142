"""One settings type for the planner's knobs: every entry point's default is the one declared in
``planner/search/settings.py``, and the settings map to the solver's configuration in one place."""

from __future__ import annotations

import argparse

import pytest

from megatron_hsp.planner.errors import InputError
from megatron_hsp.planner.search.settings import (
    DEFAULT_SOLVER,
    DEFAULT_TIME_BUDGET_S,
    FALLBACK_TIME_BUDGET_S,
    PlannerSettings,
)


def test_every_entry_point_defaults_to_the_declared_budget_and_solver():
    from megatron_hsp.commands.common import add_common_arguments
    from megatron_hsp.megatron.flags import add_hsp_args
    from megatron_hsp.planner.search.settings import SolverConfig
    from megatron_hsp.step.planner_service import PlannerSpec

    megatron = add_hsp_args(argparse.ArgumentParser()).parse_args([])
    assert megatron.hsp_time_budget_s == DEFAULT_TIME_BUDGET_S
    assert megatron.hsp_solver == DEFAULT_SOLVER
    cli = argparse.ArgumentParser()
    add_common_arguments(cli)
    parsed = cli.parse_args([])
    assert (parsed.time_budget, parsed.solver) == (DEFAULT_TIME_BUDGET_S, DEFAULT_SOLVER)
    assert SolverConfig().time_budget_s == DEFAULT_TIME_BUDGET_S
    assert PlannerSpec("x", 4, 4, 100).settings == PlannerSettings()


def test_settings_map_to_the_solver_config():
    c = PlannerSettings("cbc", 0.7, (1, 2, 4), 5).solver_config()
    assert (c.backend, c.time_budget_s, c.sizes, c.seed, c.use_milp) == (
        "cbc",
        0.7,
        (1, 2, 4),
        5,
        True,
    )
    g = PlannerSettings("greedy").solver_config()
    assert (g.backend, g.use_milp) == (DEFAULT_SOLVER, False)


def test_fallback_is_greedy_with_a_short_budget():
    f = PlannerSettings("highs", 3.0, (1, 2), 9).fallback()
    assert f == PlannerSettings("greedy", FALLBACK_TIME_BUDGET_S, (1, 2), 9)
    assert PlannerSettings(time_budget_s=0.05).fallback().time_budget_s == 0.05


def test_bad_settings_are_refused():
    with pytest.raises(InputError, match="solver 'scip': choose one of highs, cbc, greedy"):
        PlannerSettings("scip")
    with pytest.raises(InputError, match="time budget must be > 0"):
        PlannerSettings(time_budget_s=0)
