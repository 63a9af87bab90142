"""One method name -> one plan function: what ``--hsp-plan-method`` trains with.

Why here: an A/B measured in training is only honest when both sides train the same batches
through the same runtime and their plans are priced by the same rule, so the baselines a user
trains with are the very functions ``bench`` compares (``baselines.py``, ``torch_side``), each
plan priced by the one price function (``planner/cost/execution.price``), as ``bench`` prices
every method. ``planner_for_spec`` is the planner process' factory (``PlannerSpec.factory``):
the background planner, its fallback and the plan agreement are the same for every method.

``static-best`` chooses its degree in hindsight over many batches; training cannot see the
future, so the planner resolves it once from the run's own next batches (lengths only, drawn
by ``hooks.build_pipeline`` and put back: ``planner_for_spec``) and trains that ``static-N``.

The grammar of method names is ``planner/run_spec.check_plan_method`` (the flags parse with it).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from megatron_hsp.planner.errors import HSPError, InputError
from megatron_hsp.planner.run_spec import check_plan_method


def torch_methods(cost: Any, cluster: Any) -> dict[str, Callable[[], Any]]:
    """Factories of the methods that need torch or a Megatron-LM checkout (``bench.plan_fn``'s
    ``extra_methods``): ``megatron-dcp`` runs megatron-core's own scheduler, ``megatron-dcp-dev``
    the checkout named by ``$MEGATRON_HSP_DEV_CHECKOUT`` (refused, exit 2, without one)."""

    def dcp() -> Callable[[Any], Any]:
        from megatron_hsp.evaluation.torch_side.dcp_baseline import megatron_dcp_plan

        return lambda lengths: megatron_dcp_plan(lengths, cost, cluster)

    def dcp_dev() -> Callable[[Any], Any]:
        from megatron_hsp.evaluation.torch_side.dcp_dev_baseline import (
            load_dev_scheduler,
            megatron_dcp_dev_plan,
        )

        schedule = load_dev_scheduler()
        return lambda lengths: megatron_dcp_dev_plan(lengths, cost, cluster, schedule)

    return {"megatron-dcp": dcp, "megatron-dcp-dev": dcp_dev}


def method_plan_fn(
    method: str,
    cost: Any,
    cluster: Any,
    settings: Any,
    sizes: Sequence[int] | None = None,
) -> Callable[[Sequence[int]], Any]:
    """``lengths -> Plan`` of ``method`` (not ``static-best``: resolve it first), every plan
    priced by ``execution.price`` as ``bench`` prices it; the method's plan function is
    ``bench.plan_fn``, the dispatch ``bench`` and ``plan`` use. ``sizes``: the group sizes a
    baseline may use (the run's pre-created ones)."""
    import numpy as np

    from megatron_hsp.evaluation.bench import plan_fn
    from megatron_hsp.planner.cost.execution import price

    check_plan_method(method)
    if method == "static-best":
        raise InputError(
            f"--hsp-plan-method {method}: resolve it to static-N first (resolve_static_best)"
        )
    fn = plan_fn(
        method,
        cost,
        cluster,
        hsp=settings,
        sizes=sizes,
        extra_methods=torch_methods(cost, cluster),
        flag="--hsp-plan-method",
    )
    if method == "hsp" and getattr(settings, "pp", 1) > 1:
        return lambda lengths: fn(np.asarray(lengths, dtype=np.int64))  # priced as a pipeline
    return lambda lengths: price(fn(np.asarray(lengths, dtype=np.int64)), cost)


# static-best's choice, once per planner process: a refit cost model rebuilds the planner,
# and a static baseline must keep its degree for the whole run.
_RESOLVED: dict[tuple[tuple[int, ...], ...], str] = {}


def planner_for_spec(spec: Any) -> Callable[[Sequence[int]], Any]:
    """``PlannerSpec.factory`` of a run whose ``options["method"]`` names its plan method.

    ``static-best`` comes with ``options["lookahead"]``, the lengths of the run's next batches
    (``hooks.build_pipeline`` draws them and puts them back): the degree is chosen over them with
    the run's cost model the first time this process builds the planner, printed, and kept."""
    from megatron_hsp.planner.topology import Cluster

    cost = spec.load_cost_model()
    cluster = Cluster(spec.world_size, spec.gpus_per_node)
    sizes = spec.settings.sizes
    method = spec.options["method"]
    if method == "static-best":
        key = tuple(tuple(int(x) for x in b) for b in spec.options["lookahead"])
        if key not in _RESOLVED:
            _RESOLVED[key], line = resolve_static_best(key, cost, cluster, sizes)
            print(f"[megatron-hsp] {line}", flush=True)
        method = _RESOLVED[key]
    return method_plan_fn(method, cost, cluster, spec.settings, sizes)


def resolve_static_best(
    batches: Sequence[Sequence[int]], cost: Any, cluster: Any, sizes: Sequence[int] | None
) -> tuple[str, str]:
    """(``static-N``, the start-up line) for ``static-best`` over ``batches`` (the run's own
    next batches): ``baselines.static_best_degree``, the least summed priced step time."""
    from megatron_hsp.evaluation.baselines import static_best_degree

    try:
        degree, per_degree = static_best_degree(batches, cost, cluster, sizes)
    except HSPError as exc:
        raise InputError(f"--hsp-plan-method static-best: {exc}") from None
    totals = ", ".join(
        f"static-{d} {sum(p.est_step_ms for p in plans):.0f} ms"
        for d, plans in sorted(per_degree.items())
    )
    return (
        f"static-{degree}",
        f"--hsp-plan-method static-best: static-{degree} chosen over the run's next "
        f"{len(batches)} batches (summed planned step time: {totals})",
    )
