"""A planner factory for the planner process' start test: records which heavy modules the
planner process holds when it builds its planner (``spec.options['record']``: a file path)."""

from __future__ import annotations

import json
import sys

from tests.helpers.planners import one_group_per_rank

HEAVY = ("torch", "megatron", "transformer_engine")


def recording_planner(spec):
    loaded = sorted(m for m in sys.modules if m.split(".")[0] in HEAVY and "." not in m)
    with open(spec.options["record"], "w") as fh:
        json.dump(
            {
                "heavy_modules": loaded,
                "main_file": getattr(sys.modules["__main__"], "__file__", None),
            },
            fh,
        )
    return one_group_per_rank(spec)
