"""FlexSP's search space as a ``SolverConfig`` variant (the ``flexsp-style`` baseline), torch-free.

Why in the planner: ``solve`` scores the ``flexsp-style`` plan beside its own search and the
homogeneous layouts, and never returns a plan priced worse than it (hsp's plan space contains it:
the same passes of aligned groups at the cost model's split). ``evaluation/baselines.py``
documents the baseline and builds the named method on this configuration.

FlexSP's choices (arXiv 2412.01523; Galvatron's flexsp branch): power-of-two SP groups of at
least 2 ranks (every sequence pays an all-to-all), micro-batches chunked contiguously by tokens,
one MILP per micro-batch and nothing that moves sequences between micro-batches afterwards.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from megatron_hsp.planner.cost.costcore import CostModel
from megatron_hsp.planner.errors import InputError
from megatron_hsp.planner.search.settings import SolverConfig
from megatron_hsp.planner.topology import Cluster

FLEXSP_STYLE_MIN_SIZE = 2
FLEXSP_STYLE_CHUNKING = "contiguous-tokens"


def flexsp_style_sizes(
    cost: CostModel, cluster: Cluster, sizes: Sequence[int] | None = None
) -> tuple[int, ...]:
    """FlexSP's group sizes here: powers of two >= 2 that tile the cluster and are costed
    (within ``sizes`` when the user restricted them)."""
    pool = set(cost.sizes) if sizes is None else set(sizes) & set(cost.sizes)
    out = tuple(
        d
        for d in cluster.power_of_two_sizes()
        if d >= FLEXSP_STYLE_MIN_SIZE and d in pool and cluster.size_fits(d)
    )
    if not out:
        raise InputError(
            f"flexsp-style: no power-of-two group size >= {FLEXSP_STYLE_MIN_SIZE} among "
            f"{sorted(pool)} fits {cluster.world_size} ranks; widen --sizes (e.g. pow2)"
        )
    return out


def flexsp_style_config(
    cost: CostModel,
    cluster: Cluster,
    base: SolverConfig | None = None,
    sizes: Sequence[int] | None = None,
) -> SolverConfig:
    """Our solver restricted to FlexSP's choices (the one place they are written down).

    ``base`` supplies what is not FlexSP's choice (backend, budget, seed, MILP work limits);
    the pipeline is dropped because FlexSP plans without one (``bench`` prices the plan under
    the pipeline in its own order, as every baseline). What remains differs from FlexSP's own
    solver: our bucketed MILP and HiGHS instead of its SCIP model, and our cost model's prices
    (docs/baselines.md).
    """
    return dataclasses.replace(
        base or SolverConfig(),
        sizes=flexsp_style_sizes(cost, cluster, sizes),
        chunkings=(FLEXSP_STYLE_CHUNKING,),
        improve_evals=0,  # no local search between micro-batches
        use_milp=True,  # FlexSP always solves its MILP (hsp's greedy mode is not its choice)
        milp_min_gap=0.0,  # every micro-batch goes to the MILP, however close to its floor
        pipeline=None,
    )
