"""One method name -> one plan function: what ``--hsp-plan-method`` trains with.

Why here: an A/B measured in training is only honest when both sides train the same batches
through the same runtime and their plans are priced by the same rule, so the baselines a user
trains with are the very functions ``bench`` compares (``baselines.py``, ``torch_side``), each
plan priced by the one price function (``planner/cost/execution.price``), as ``bench`` prices
every method. ``planner_for_spec`` is the planner process' factory (``PlannerSpec.factory``):
the background planner, its fallback and the plan agreement are the same for every method.

``static-best`` chooses its degree in hindsight over many batches; training cannot see the
future, so ``hooks.build_pipeline`` resolves it at start-up from the run's own next batches
(lengths only, drawn and put back: ``resolve_static_best``) and trains that ``static-N``.

The grammar (``check_plan_method``) imports nothing heavy: ``megatron/flags.py`` parses with it.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

from megatron_hsp.planner.errors import InputError

TRAINING_METHODS = ("hsp", "static-N", "static-best", "batchada", "megatron-dcp")
_STATIC = re.compile(r"^static-([1-9]\d*)$")
# Batches ``static-best`` looks ahead over at start-up (at most; fewer when --train-iters is less).
STATIC_BEST_LOOKAHEAD = 64


def check_plan_method(text: str, flag: str = "--hsp-plan-method") -> str:
    """``text`` if it names a method training can run, else an ``InputError`` naming ``flag``."""
    name = str(text).strip()
    if name in ("hsp", "static-best", "batchada", "megatron-dcp") or _STATIC.match(name):
        return name
    raise InputError(
        f"{flag} {text!r}: choose hsp, static-N (e.g. static-4), static-best, batchada or "
        "megatron-dcp"
    )


def static_degree(method: str) -> int | None:
    """N of ``static-N``, else None."""
    m = _STATIC.match(method)
    return int(m.group(1)) if m else None


def method_plan_fn(
    method: str,
    cost: Any,
    cluster: Any,
    settings: Any,
    sizes: Sequence[int] | None = None,
) -> Callable[[Sequence[int]], Any]:
    """``lengths -> Plan`` of ``method`` (not ``static-best``: resolve it first), every plan
    priced by ``execution.price`` as ``bench`` prices it. ``sizes``: the group sizes a baseline
    may use (the run's pre-created ones)."""
    import numpy as np

    from megatron_hsp.evaluation.baselines import batchada_plan, static_plan
    from megatron_hsp.evaluation.bench import hsp_plan_fn
    from megatron_hsp.planner.cost.execution import price

    check_plan_method(method)
    fn: Callable[[np.ndarray], Any]
    degree = static_degree(method)
    if method == "hsp":
        fn = hsp_plan_fn(cost, cluster, settings)
    elif degree is not None:
        fn = lambda b: static_plan(b, cost, cluster, degree)  # noqa: E731
    elif method == "batchada":
        fn = lambda b: batchada_plan(b, cost, cluster, sizes)  # noqa: E731
    elif method == "megatron-dcp":
        from megatron_hsp.evaluation.torch_side.dcp_baseline import megatron_dcp_plan

        fn = lambda b: megatron_dcp_plan(b, cost, cluster)  # noqa: E731
    else:
        raise InputError(
            f"--hsp-plan-method {method}: resolve it to static-N first (resolve_static_best)"
        )
    if method == "hsp" and getattr(settings, "pp", 1) > 1:
        return lambda lengths: fn(np.asarray(lengths, dtype=np.int64))  # priced as a pipeline
    return lambda lengths: price(fn(np.asarray(lengths, dtype=np.int64)), cost)


def planner_for_spec(spec: Any) -> Callable[[Sequence[int]], Any]:
    """``PlannerSpec.factory`` of a run whose ``options["method"]`` names its plan method."""
    from megatron_hsp.planner.topology import Cluster

    cost = spec.load_cost_model()
    cluster = Cluster(spec.world_size, spec.gpus_per_node)
    sizes = spec.settings.sizes
    return method_plan_fn(spec.options["method"], cost, cluster, spec.settings, sizes)


def resolve_static_best(
    batches: Sequence[Sequence[int]], cost: Any, cluster: Any, sizes: Sequence[int] | None
) -> tuple[str, str]:
    """(``static-N``, the start-up line) for ``static-best`` over ``batches`` (the run's own
    next batches): ``baselines.static_best_degree``, the least summed priced step time."""
    from megatron_hsp.evaluation.baselines import static_best_degree

    degree, per_degree = static_best_degree(batches, cost, cluster, sizes)
    totals = ", ".join(
        f"static-{d} {sum(p.est_step_ms for p in plans):.0f} ms"
        for d, plans in sorted(per_degree.items())
    )
    return (
        f"static-{degree}",
        f"--hsp-plan-method static-best: static-{degree} chosen over the run's next "
        f"{len(batches)} batches (summed planned step time: {totals})",
    )
