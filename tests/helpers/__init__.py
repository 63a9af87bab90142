"""Helpers the tests import (``from tests.helpers... import ...``); fixtures live in conftest.py.

``solver``: small cost models and a brute-force optimum; ``megatron_args``: a parser with the
Megatron flags HSP reads; ``planners``: planner factories a spawned planner process imports.
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repository
FIXTURES = ROOT / "tests" / "fixtures"
SHARED = ROOT.parent / "shared"  # read-only data beside the checkout, absent in CI
