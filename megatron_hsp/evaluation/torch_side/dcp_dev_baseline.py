"""``megatron-dcp-dev``: Megatron-LM dev's ``DefaultDynamicCPScheduler``, run from a local checkout.

Dev's dynamic-CP scheduler (``megatron/core/datasets/data_schedule.py``, its packing in
``next_hdp_group_packing_aware`` of ``data_schedule_utils.py``; dev ``d48bd6be0a85``) is in no
released megatron-core, and no copy of it is committed here: the user names a Megatron-LM
checkout of dev in ``$MEGATRON_HSP_DEV_CHECKOUT`` and this module runs that checkout's code.

Why the source is read rather than imported: ``data_schedule_utils.py`` imports
``get_thd_partitioned_indices`` from ``megatron.core.extensions.transformer_engine`` at module
level, which the installed megatron-core (0.19) lacks, and importing the checkout's whole
``megatron.core`` instead would shadow the installed package for the rest of the process (the
``megatron-dcp`` baseline and the runtime use it). The scheduler itself is pure Python, so this
module takes, unchanged, the definitions it needs (``SCHEDULER_NAMES`` from
``data_schedule_utils.py`` and ``DefaultDynamicCPScheduler.get_groups_and_subsamples`` from
``data_schedule.py``), executes them with their module's standard-library imports only, and
calls the method on a stand-in ``self`` carrying the four attributes it reads. A checkout whose
files lack one of those names is refused by name (an older or newer layout needs a new look).
``load_dev_dp_balanced`` loads ``DpBalancedScheduler.get_groups_and_subsamples`` the same way,
for ``benchmarks/dp_balanced_source_check.py`` to compare ``dp-balanced``'s port against.

Execution and pricing, as dev runs it: ``build_packed_microbatches`` packs each rank's sub-samples
of a scheduler group into one THD sequence (one forward/backward per group, unlike main's
sequential sub-sample passes), so the whole pack must fit and a group pays its fixed cost once per
pass (``ring_plan_from_layout(..., sequential=False)``); CP groups are ring attention priced by the
same rule as ``megatron-dcp``'s (docs/baselines.md). ``max_seq_len_per_rank`` is the memory model's
``tokens_per_rank``, as for ``megatron-dcp``. Lengths are padded first as dev's THD datasets pad
them under dynamic CP (``baselines.thd_pad_divisor``). The plans are checked against dev's own
outputs recorded from dev's code (``tests/fixtures/megatron_dev_schedules.json``).
"""

from __future__ import annotations

import ast
import dataclasses
import os
import sys
import types
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from megatron_hsp.evaluation.baselines import (
    RingAssumptions,
    plan_from_scheduler,
    thd_pad_divisor,
    thd_padded,
)
from megatron_hsp.planner.cost.costmodel import CostModel
from megatron_hsp.planner.errors import InputError
from megatron_hsp.planner.plan import Plan
from megatron_hsp.planner.topology import Cluster

CHECKOUT_ENV = "MEGATRON_HSP_DEV_CHECKOUT"
UTILS = Path("megatron/core/datasets/data_schedule_utils.py")
SCHEDULE = Path("megatron/core/datasets/data_schedule.py")
SCHEDULER_CLASS = "DefaultDynamicCPScheduler"
DP_BALANCED_CLASS = "DpBalancedScheduler"
SCHEDULER_METHOD = "get_groups_and_subsamples"
# What get_groups_and_subsamples calls (and they call), from data_schedule_utils.py.
SCHEDULER_NAMES = (
    "_DYNAMIC_CP_WORKLOAD_CAP_DELTA",
    "dcp_gpus_needed",
    "next_hdp_group_packing_aware",
    "align_sample_id_groups",
)

Schedule = Callable[[list[tuple[int, int]], int, int], list[list[list[int]]]]


# Who asks for each class, and what they can do instead of giving a checkout.
USERS = {
    SCHEDULER_CLASS: ("megatron-dcp-dev", "leave megatron-dcp-dev out of --methods"),
    DP_BALANCED_CLASS: ("dp_balanced_source_check", "pass --checkout DIR"),
}


def _refuse(cls: str, why: str) -> InputError:
    who, instead = USERS[cls]
    return InputError(
        f"{who}: {why}; set {CHECKOUT_ENV} to a Megatron-LM checkout of the dev branch "
        "(d48bd6be0a85 or newer, e.g. `git clone -b dev https://github.com/NVIDIA/Megatron-LM`) "
        f"or {instead}"
    )


def _stdlib_imports(tree: ast.Module) -> list[ast.stmt]:
    """The module's top-level imports of the standard library (typing, math, functools)."""
    out: list[ast.stmt] = []
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            top = node.module.split(".")[0]
        elif isinstance(node, ast.Import):
            top = node.names[0].name.split(".")[0]
        else:
            continue
        if top in sys.stdlib_module_names and top != "__future__":
            out.append(node)
    return out


def _definitions(tree: ast.Module, names: Sequence[str], path: Path, cls: str) -> list[ast.stmt]:
    """Top-level functions and assignments named ``names`` in ``tree``, refusing missing ones."""
    found: dict[str, ast.stmt] = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.ClassDef) and node.name in names:
            found[node.name] = node
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                if isinstance(t, ast.Name) and t.id in names:
                    found[t.id] = node
    missing = [n for n in names if n not in found]
    if missing:
        raise _refuse(cls, f"{path} defines no {', '.join(missing)}")
    return [found[n] for n in names]


def _method(tree: ast.Module, cls: str, name: str, path: Path) -> ast.FunctionDef:
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == cls:
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == name:
                    return item
    raise _refuse(cls, f"{path} has no {cls}.{name}")


def _checkout_method(
    checkout: str | os.PathLike[str] | None, cls: str, utils_names: Sequence[str]
) -> Callable[..., list[list[list[int]]]]:
    """``cls.get_groups_and_subsamples`` of ``data_schedule.py`` in ``checkout`` (default:
    ``$CHECKOUT_ENV``), with ``utils_names`` from ``data_schedule_utils.py``, executed from the
    source with the two modules' standard-library imports only (module docstring)."""
    root_text = os.fspath(checkout) if checkout is not None else os.environ.get(CHECKOUT_ENV)
    if not root_text:
        raise _refuse(cls, f"{CHECKOUT_ENV} is not set")
    root = Path(root_text)
    sources = {}
    for rel in (UTILS, SCHEDULE):
        path = root / rel
        if not path.is_file():
            raise _refuse(cls, f"{path} does not exist")
        sources[rel] = (path, ast.parse(path.read_text(), filename=str(path)))
    utils_path, utils_tree = sources[UTILS]
    sched_path, sched_tree = sources[SCHEDULE]
    body = [
        *_stdlib_imports(utils_tree),
        *_stdlib_imports(sched_tree),
        *_definitions(utils_tree, utils_names, utils_path, cls),
        _method(sched_tree, cls, SCHEDULER_METHOD, sched_path),
    ]
    module = ast.Module(body=body, type_ignores=[])
    namespace: dict[str, object] = {"__name__": "megatron_hsp_dev_schedulers"}
    exec(compile(module, f"{root}/<{cls} from {SCHEDULE}>", "exec"), namespace)
    return namespace[SCHEDULER_METHOD]  # type: ignore[return-value]


def load_dev_scheduler(checkout: str | os.PathLike[str] | None = None) -> Schedule:
    """``DefaultDynamicCPScheduler``'s grouping from ``checkout`` (default: ``$CHECKOUT_ENV``).

    Returns ``schedule(sample_id_seqlens, total_gpus, max_seq_len_per_rank)``: its
    ``sample_id_groups`` (per micro-batch, per DPxCP rank, the sample ids on that rank).
    """
    method = _checkout_method(checkout, SCHEDULER_CLASS, SCHEDULER_NAMES)

    def schedule(
        sample_id_seqlens: list[tuple[int, int]], total_gpus: int, max_seq_len_per_rank: int
    ) -> list[list[list[int]]]:
        # The attributes DefaultDynamicCPScheduler.__init__ sets and this method reads; no
        # virtual pipeline (its align step only runs with microbatch_group_size_per_vp_stage > 1).
        self = types.SimpleNamespace(
            max_seq_len_per_rank=max_seq_len_per_rank,
            min_cp_size=1,
            total_hdp_gpus=total_gpus,
            microbatch_group_size_per_vp_stage=None,
        )
        return method(self, sample_id_seqlens)

    return schedule


def load_dev_dp_balanced(
    checkout: str | os.PathLike[str] | None = None,
) -> Callable[[list[tuple[int, int]], int, int, int], list[list[list[int]]]]:
    """``DpBalancedScheduler``'s grouping from ``checkout``, to check ``dp-balanced``'s port
    against (``benchmarks/dp_balanced_source_check.py``).

    Returns ``schedule(sample_id_seqlens, dp, cp, max_seqlen_per_dp_cp_rank)``.
    """
    method = _checkout_method(checkout, DP_BALANCED_CLASS, ())

    def schedule(
        sample_id_seqlens: list[tuple[int, int]], dp: int, cp: int, max_seqlen_per_rank: int
    ) -> list[list[list[int]]]:
        # The attributes DpBalancedScheduler.__init__ (and its base) set and this method reads.
        self = types.SimpleNamespace(
            max_seq_len_all_ranks=max_seqlen_per_rank * cp,
            max_num_seqs=None,
            dp_size=dp,
            cp_size=cp,
            microbatch_group_size_per_vp_stage=None,
        )
        return method(self, sample_id_seqlens)

    return schedule


def megatron_dcp_dev_plan(
    lengths: Sequence[int] | np.ndarray,
    cost: CostModel,
    cluster: Cluster,
    schedule: Schedule,
    assume: RingAssumptions | None = None,
) -> Plan:
    """Schedule one global batch with dev's ``DefaultDynamicCPScheduler`` (``schedule``).

    The scheduler sees each sequence padded as dev's THD datasets pad it under dynamic CP
    (``baselines.thd_pad_divisor``: a multiple of ``2 * dp * cp``), so the plan holds and prices
    the padded lengths (``extra['padding_tokens']``)."""
    raw = np.asarray(lengths, dtype=np.int64)
    if raw.size == 0:
        raise InputError("the global batch is empty; nothing to plan")
    n = cluster.world_size
    divisor = thd_pad_divisor(n, n, dynamic=True)
    lens = thd_padded(raw, divisor)
    plan = plan_from_scheduler(
        lens,
        cost,
        cluster,
        lambda samples: schedule(samples, n, int(cost.tokens_per_rank)),
        method="megatron-dcp-dev",
        who="dev's scheduler",
        sequential=False,
        assume=assume,
    )
    extra = {
        **plan.extra,
        "thd_pad_divisor": divisor,
        "padding_tokens": int(lens.sum() - raw.sum()),
    }
    return dataclasses.replace(plan, extra=extra)
