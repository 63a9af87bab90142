"""The planner process starts clean (issue 41): it imports what planning needs, not the user's
script.

``megatron_hsp.launch`` runs ``pretrain_gpt.py`` as ``__main__`` (``runpy.run_path``), and
multiprocessing's ``spawn`` re-imports the parent's main module in the child from its path
(``multiprocessing/spawn.py``, ``_fixup_main_from_path``): the planner process would import
Megatron (and TE) a second time, run any top-level side effect of the script again, and could
open a second CUDA context on rank 0's GPU. Here a script with a top-level side effect and a
top-level ``import torch`` starts the planner the way the Megatron hooks do; the side effect must
happen once, and the planner process must hold no torch.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from tests.helpers import ROOT

SCRIPT = textwrap.dedent(
    """
    import os
    with open(os.environ["HSP_TEST_MARK"], "a") as fh:  # a top-level side effect
        fh.write("ran\\n")
    import torch  # noqa: F401  (a training script's imports: Megatron, TE, torch)

    from megatron_hsp.step.planner_service import PlannerService, PlannerSpec

    if __name__ == "__main__":
        spec = PlannerSpec(
            cost_model="unused",
            world_size=2,
            gpus_per_node=2,
            max_seq=100,
            factory="tests.helpers.planner_probe:recording_planner",
            options={"record": os.environ["HSP_TEST_RECORD"]},
        )
        with PlannerService(spec) as svc:
            svc.submit(0, [5, 6, 7])
            print("plan", svc.result(0).plan.num_sequences)
    """
)


@pytest.mark.spawns
@pytest.mark.parametrize("how", ["script", "run_path"])
def test_the_planner_process_does_not_rerun_the_users_script(tmp_path, how):
    script = tmp_path / "pretrain_side_effect.py"
    script.write_text(SCRIPT)
    mark, record = tmp_path / "mark.txt", tmp_path / "record.json"
    env = dict(os.environ, HSP_TEST_MARK=str(mark), HSP_TEST_RECORD=str(record))
    env["PYTHONPATH"] = str(ROOT) + (
        os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else ""
    )
    if how == "script":
        cmd = [sys.executable, str(script)]
    else:  # as megatron_hsp.launch runs the user's script
        cmd = [
            sys.executable,
            "-c",
            f"import runpy; runpy.run_path({str(script)!r}, run_name='__main__')",
        ]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "plan 3" in run.stdout
    assert mark.read_text().splitlines() == ["ran"], "the script's top level ran again"
    seen = json.loads(record.read_text())
    assert seen["heavy_modules"] == [], seen
    assert seen["main_file"] is None, seen
