"""Pure planner: sequence lengths -> ``Plan``. Imports numpy and PuLP only, never torch."""

from megatron_hsp.planner.errors import HSPError, InfeasibleError, InputError, PlanError
from megatron_hsp.planner.plan import Group, MicroBatch, Plan
from megatron_hsp.planner.topology import Cluster

__all__ = [
    "Cluster",
    "Group",
    "HSPError",
    "InfeasibleError",
    "InputError",
    "MicroBatch",
    "Plan",
    "PlanError",
]
