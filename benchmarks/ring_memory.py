"""Autograd-saved bytes per rank of one causal ring attention layer, at 2K, 4K and 8K tokens per
rank: ``python benchmarks/ring_memory.py --json`` prints
``{"saved_bytes": {"2048": N, "4096": N, "8192": N}}``.

Runs ``megatron_hsp.runtime.ring.ring_attention`` on 2 gloo CPU processes (a pure ring of 2, the
load-balanced layout of ``runtime/layout.py``, one document per buffer), counts every tensor
autograd saves for backward (``torch.autograd.graph.saved_tensors_hooks``), once per distinct
storage, and reports the maximum over ranks. Linear growth in tokens is the target; the old
dense path kept ``[h, T/r, T/r]`` scores and masks per ring step (quadratic).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_hsp.testing.memory import TOKENS, measure_ring_saved_bytes


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print the contract's JSON only")
    args = ap.parse_args(argv)
    saved = measure_ring_saved_bytes()
    if args.json:
        print(json.dumps({"saved_bytes": saved}))
        return 0
    base = saved[str(TOKENS[0])]
    for n in TOKENS:
        b = saved[str(n)]
        print(f"{n:>6} tokens/rank: {b / 2**20:8.2f} MiB saved ({b / base:.2f}x the 2K figure)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
