"""The cost model against published GPU measurements: the table in docs/calibration.md.

Fits the H100 terms to the fit set (``planner.cost.calibration.fit_h100``), then prints every
published figure next to the model's prediction and the error, fit and check rows marked. The
preset ``H100_SXM`` is checked too (it must equal the fit up to rounding). Pure planner code: no
GPU, no torch.

    PYTHONPATH=. python benchmarks/calibration.py            # Markdown table
    PYTHONPATH=. python benchmarks/calibration.py --json     # the same rows as JSON
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from megatron_hsp.planner.cost.calibration import FITTED, calibration_table, fit_h100, worst_error
from megatron_hsp.planner.cost.first_principles import H100_SXM


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print JSON instead of Markdown")
    args = ap.parse_args(argv)
    fitted = fit_h100(H100_SXM)
    rows = calibration_table(H100_SXM)
    terms = {k: {"fit": getattr(fitted, k), "preset": getattr(H100_SXM, k)} for k in FITTED}
    if args.json:
        json.dump(
            {
                "terms": terms,
                "rows": [dataclasses.asdict(r) for r in rows],
                "worst_check_error": worst_error(rows, "check"),
            },
            sys.stdout,
            indent=1,
        )
        print()
        return 0
    print("| term | fitted | preset (H100_SXM) |\n|---|---|---|")
    for k, v in terms.items():
        print(f"| `{k}` | {v['fit']:.4g} | {v['preset']:.4g} |")
    print()
    print("| figure | role | setting | unit | published | model | error |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r.key} | {r.role} | {r.setting} | {r.unit} | {r.published} | "
            f"{r.predicted:.1f} | {r.error * 100:+.1f}% |"
        )
    print()
    print(f"worst check error: {worst_error(rows, 'check') * 100:.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
