"""HSP's group creation leaves later ``new_group`` calls as torch would have made them (issue 41).

While the world group has a ``bound_device_id``, torch's ``new_group`` makes every non-member of
any later group join an NCCL split of the world, whatever backend the group asks for
(``distributed_c10d._new_process_group_helper``): a ``new_group(backend="gloo")`` made later
by Megatron or the user would leave its non-members waiting in a split its members never join.
HSP binds the device to split its own groups from the world, and must unbind it afterwards.
NCCL cannot run here: the binding is stood in for (what ``bind_world_device`` sets), the world
group is a real gloo one, and group creation is recorded instead of run.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed import distributed_c10d as c10d

CUDA0 = torch.device("cuda", 0)


@pytest.fixture
def world():
    from megatron_hsp.testing.dist import destroy_cpu_megatron, init_single_process_megatron

    init_single_process_megatron()
    pg = c10d._get_default_group()
    yield pg
    pg.bound_device_id = None
    destroy_cpu_megatron()


def _as_nccl(m, world, groups) -> list:
    """The world answers as an unbound NCCL world; binding sets what ``bind_world_device``
    sets; each size's creation records the world's binding at that moment."""

    def bind():
        world.bound_device_id = CUDA0
        return CUDA0

    seen: list = []
    m.setattr(groups, "bind_world_device", bind)
    m.setattr(groups.dist, "get_backend", lambda group=None: "nccl")
    m.setattr(groups, "can_split_groups", lambda backend, bound: bound is not None)
    m.setattr(groups, "_create_size", lambda reg, size: seen.append((size, world.bound_device_id)))
    return seen


def test_group_creation_unbinds_the_world_device_afterwards(world, monkeypatch):
    from megatron_hsp.runtime import groups

    with monkeypatch.context() as m:
        seen = _as_nccl(m, world, groups)
        eager = groups.create_groups(1, sizes=[1], warm=False)
        assert seen == [(1, CUDA0)]  # HSP's own groups are split from the bound world
        assert eager.use_split
        assert world.bound_device_id is None  # later new_group calls: as torch makes them
        lazy = groups.create_groups(1, sizes=[1], lazy=True)
        assert world.bound_device_id is None and len(seen) == 1
        lazy.ensure([1])  # the first step that uses the size: bound again, for its creation
        assert seen[-1] == (1, CUDA0) and world.bound_device_id is None


def test_a_world_bound_by_the_user_stays_bound(world, monkeypatch):
    from megatron_hsp.runtime import groups

    world.bound_device_id = CUDA0  # init_process_group(device_id=...): torch's own choice
    with monkeypatch.context() as m:
        seen = _as_nccl(m, world, groups)
        groups.create_groups(1, sizes=[1], warm=False)
        assert seen == [(1, CUDA0)] and world.bound_device_id == CUDA0


def test_gloo_groups_under_nccl_are_not_created_bound(world, monkeypatch):
    from megatron_hsp.runtime import groups

    with monkeypatch.context() as m:
        seen = _as_nccl(m, world, groups)
        reg = groups.create_groups(1, sizes=[1], warm=False, backend="gloo")
        assert seen == [(1, None)] and not reg.use_split
