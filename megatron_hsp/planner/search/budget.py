"""The search's one clock and its wall-clock safety cap.

The search's work is limited by counts (greedy candidates built, local-search schedule
evaluations, MILPs per solve and branch-and-bound nodes each), so the same inputs give the same
plan on an idle and a loaded machine. Wall clock is only a safety cap: a ``Cap`` says when it has
passed and remembers which stages it stopped, and ``solve`` writes those stages into the plan
(``extra["cut_by_cap"]``, empty when the counts alone decided the plan), so a plan that could
differ on another machine says so.

Every deadline check of the search reads ``now()`` here, one seam: a test slows the clock to
show that a loaded machine plans the same (``tests/planner/search/test_solver_determinism.py``).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field


def now() -> float:
    """Seconds on the search's clock (``time.perf_counter``)."""
    return time.perf_counter()


@dataclass
class Cap:
    """A wall-clock deadline (a ``now()`` value) and the stages it has cut."""

    deadline: float
    cut: list[str] = field(default_factory=list)

    @classmethod
    def of(cls, deadline: float | Cap | None) -> Cap:
        """``deadline`` as a cap: a cap unchanged, a ``now()`` value or None (no cap) wrapped."""
        if isinstance(deadline, Cap):
            return deadline
        return cls(math.inf if deadline is None else float(deadline))

    def past(self, stage: str) -> bool:
        """Whether the deadline has passed; if so ``stage`` is recorded as cut by it."""
        if now() < self.deadline:
            return False
        self.mark(stage)
        return True

    def mark(self, stage: str) -> None:
        """Record ``stage`` as cut by the cap (a stage that measured its own time limit)."""
        if stage not in self.cut:
            self.cut.append(stage)

    def left(self) -> float:
        """Seconds until the deadline (negative past it)."""
        return self.deadline - now()
