"""Class 3: bounded work. ``plan``/``bench`` finish in seconds or refuse: the pieces an
overlong document becomes are counted before any is built, and a batch that needs more
micro-batches than one step is planned in (its memory floor) is refused before the search."""

from __future__ import annotations

import numpy as np
import pytest

from megatron_hsp.planner.errors import InputError
from megatron_hsp.planner.lengths import MAX_BATCH_SEQUENCES, BatchSampler
from tests.faults.conftest import bounded, one_error_line, run_cli


def _lengths(tmp_path, first: int) -> str:
    path = tmp_path / "lengths.txt"
    path.write_text(f"{first}\n" + "".join(f"{n}\n" for n in range(100, 301)))
    return str(path)


@pytest.mark.parametrize("bench", [False, True])
def test_a_1e10_token_document_under_split_is_refused_in_seconds(tmp_path, capsys, bench):
    """Before: one 1e10-token length under --overlong split kept plan busy past 45 s."""
    cmd = ["bench", "--steps", "1"] if bench else ["plan"]
    argv = [*cmd, "--flexsp-harness", "--lengths", _lengths(tmp_path, 10**10)]
    argv += ["--overlong", "split", "--sampling", "random", "--global-batch", "64"]
    rc, _, err = run_cli(argv, capsys, bound_s=20)
    assert rc == 2
    one_error_line(err, "micro-batches")


def test_a_1e12_token_document_is_counted_before_any_piece_is_built():
    lengths = np.array([10**12, 100, 200], dtype=np.int64)
    with bounded(10):
        sampler = BatchSampler(
            lengths, global_batch=3, sampling="random", max_seq=192_000, overlong="split"
        )
        with pytest.raises(InputError, match=f"over the {MAX_BATCH_SEQUENCES}"):
            sampler.batch(0)


def test_sequential_split_of_a_1e12_token_document_finishes_in_seconds(tmp_path, capsys):
    argv = ["plan", "--flexsp-harness", "--lengths", _lengths(tmp_path, 10**12)]
    rc, out, _ = run_cli([*argv, "--overlong", "split"], capsys, bound_s=30)
    assert rc == 0 and out.strip()


def test_a_batch_beyond_the_memory_cap_is_refused_before_the_search():
    from megatron_hsp.planner.cost.costmodel import load_cost_model
    from megatron_hsp.planner.search.chunking import MAX_MICROBATCHES
    from megatron_hsp.planner.search.settings import SolverConfig
    from megatron_hsp.planner.search.solver import solve
    from megatron_hsp.planner.topology import Cluster

    cost = load_cost_model("flexsp-gpt-7b", world_size=8, gpus_per_node=8, max_seq_k=192)
    full = cost.tokens_per_rank * 8  # one sequence fills the cluster: one micro-batch each
    with bounded(20), pytest.raises(InputError, match="micro-batches"):
        solve([full] * (MAX_MICROBATCHES + 1), cost, Cluster(8, 8), SolverConfig())
