"""``planner/run_spec``: the slot arithmetic, the group-size grammar and the vocabularies, each
error naming the flags of the entry point that built it."""

from __future__ import annotations

import pytest

from megatron_hsp.planner.errors import InputError
from megatron_hsp.planner.groupspace import Cluster
from megatron_hsp.planner.run_spec import (
    MEGATRON_FLAGS,
    GroupSizeRequest,
    OverlongPolicy,
    ParallelDims,
    Solver,
    allowed_sizes,
    check_time_budget,
    parse_choice,
)


@pytest.mark.parametrize(
    ("world", "gpn", "tp", "pp", "slots", "per_node"),
    [(64, 8, 1, 1, 64, 8), (64, 8, 2, 2, 16, 4), (64, 8, 8, 1, 8, 1), (4, 8, 1, 1, 4, 4)],
)
def test_slots_are_world_over_tp_pp_in_nodes_of_gpus_over_tp(world, gpn, tp, pp, slots, per_node):
    dims = ParallelDims(world, gpn, tp, pp)
    assert (dims.slots, dims.slots_per_node) == (slots, per_node)
    assert dims.cluster() == Cluster(slots, per_node)


def test_layout_errors_name_the_entry_points_flags():
    with pytest.raises(InputError, match=r"--gpus 12 is not a multiple of --tp 8 x --pp 1"):
        ParallelDims(12, 8, 8)
    with pytest.raises(
        InputError, match="world size 12 is not a multiple of --tensor-model-parallel-size 8"
    ):
        ParallelDims(12, 8, 8, flags=MEGATRON_FLAGS)
    with pytest.raises(InputError, match="--tensor-model-parallel-size 3 does not divide"):
        ParallelDims(24, 8, 3, flags=MEGATRON_FLAGS)
    with pytest.raises(InputError, match="--tp 16 spans nodes of 8"):
        ParallelDims(32, 8, 16)
    with pytest.raises(InputError, match=r"do not fill whole nodes of 8 .*--hsp-gpus-per-node"):
        ParallelDims(24, 8, 1, 2, flags=MEGATRON_FLAGS).cluster()


def test_one_size_grammar():
    cluster = Cluster(32, 8)
    assert GroupSizeRequest.parse(None, "--sizes").resolve(cluster, "--sizes") == (
        1, 2, 3, 4, 5, 6, 7, 8, 16, 24, 32,
    )  # fmt: skip
    assert GroupSizeRequest.parse("AUTO", "--sizes").restriction(cluster, "--sizes") is None
    assert GroupSizeRequest.parse("pow2", "--sizes").resolve(cluster, "--sizes") == (
        1, 2, 4, 8, 16, 32,
    )  # fmt: skip
    listed = GroupSizeRequest.parse(" 8, 2,2,16 ", "--sizes")
    assert str(listed) == "2,8,16" and listed.resolve(cluster, "--sizes") == (2, 8, 16)
    assert allowed_sizes(listed, cluster, [1, 2, 4, 8], "--sizes") == (2, 8)
    with pytest.raises(InputError, match=r"--hsp-group-sizes 12: \[12\] are not legal"):
        GroupSizeRequest.parse("12", "--hsp-group-sizes").resolve(cluster, "--hsp-group-sizes")
    for bad in ("", "0,2", "x", "2;4"):
        with pytest.raises(InputError, match="--sizes"):
            GroupSizeRequest.parse(bad, "--sizes")


def test_vocabularies_and_budget():
    assert parse_choice(OverlongPolicy, "drop", "--overlong") == "drop"
    assert Solver("greedy").uses_milp is False and Solver.CBC.uses_milp
    with pytest.raises(InputError, match="--hsp-solver 'scip': choose one of highs, cbc, greedy"):
        parse_choice(Solver, "scip", "--hsp-solver")
    assert check_time_budget(3600, "--time-budget") == 3600.0
    for bad in (0, -1, 3600.5, float("inf")):
        with pytest.raises(InputError, match="--time-budget must be"):
            check_time_budget(bad, "--time-budget")
