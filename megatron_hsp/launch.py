"""``python -m megatron_hsp.launch PATH/TO/pretrain_gpt.py <megatron args> --hsp ...``

Runs the user's unchanged Megatron-LM script as ``__main__`` after installing the HSP entry
points (``megatron_hsp.megatron.installer.install_entry_points``). Use it under torchrun exactly
like the script itself: ``torchrun --nproc-per-node 8 -m megatron_hsp.launch pretrain_gpt.py ...``.
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        return 0 if argv else 2
    script = Path(argv[0])
    if not script.is_file():
        print(f"megatron_hsp.launch: error: script {script} not found", file=sys.stderr)
        return 2
    # The script sees its own path and flags, and imports its siblings (gpt_builders, ...) and
    # the checkout's megatron/ package, exactly as `python pretrain_gpt.py ...` would.
    sys.argv = [str(script), *argv[1:]]
    sys.path.insert(0, str(script.resolve().parent))
    from megatron_hsp.megatron.installer import install_entry_points

    install_entry_points()
    runpy.run_path(str(script), run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())
