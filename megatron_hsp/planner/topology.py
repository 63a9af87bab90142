"""Cluster shape: kept as an import path; the rules live in ``groupspace`` (one place)."""

from megatron_hsp.planner.groupspace import Cluster

__all__ = ["Cluster"]
