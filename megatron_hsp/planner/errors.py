"""Errors users see. Each message names the flag or value at fault and what would work."""

from __future__ import annotations


class HSPError(ValueError):
    """Base class: bad input or an impossible request, never an internal bug."""


class InputError(HSPError):
    """A flag, file or length list that cannot be used as given."""


class PlanError(HSPError):
    """A plan that breaks an invariant (coverage, topology, memory, world size)."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = list(problems)
        shown = "; ".join(self.problems[:8])
        more = f" (+{len(self.problems) - 8} more)" if len(self.problems) > 8 else ""
        super().__init__(f"invalid plan: {shown}{more}")


class InfeasibleError(HSPError):
    """No plan exists under the given memory cap and cluster (e.g. a sequence too long)."""
