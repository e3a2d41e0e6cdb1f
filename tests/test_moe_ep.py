"""Expert parallelism (ep = N, efsdp = 1, no replicate): each rank's model holds its own
experts and routes tokens with all_to_all; dmuon owns every rank's experts locally, moves no
byte for them, and trains as the single-process reference on the global batch.

Plan side (pure): the refusals and their messages, JSON round trip, the cost of an EP plan
(the non-EP plan's minus the stacks' bytes), boundary lookups, the schedule. Runtime: W = 4
(ep = 4, ep given) and W = 2 (ep = 2, a 1-D DeviceMesh named "ep") against
``dmuon.testing.reference_run`` with fp32 Newton-Schulz, the ledger against ``plan.cost``, and
the state-dict view of the stacks (full logical shape, DTensor Shard(0)).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import dmuon
import dmuon.plan as P
import dmuon.testing
from dmuon.plan import ShardingPlan
from dmuon.plan.records import ExpertOwners
from dist_utils import run_distributed
from moe_ep_models import E, full_model, ep_model, global_batches, is_expert, lm_loss

STEPS = 3
HP = dict(lr=0.02, weight_decay=0.1, adamw_lr=3e-3)


# ------------------------------------------------------------------------------ plan side (pure)


def test_ep_plan_records_global_stacks_owned_locally():
    plan = P.compile(ep_model(4, 0), 4, ep=4)
    stacks = [(s, o) for s, o in zip(plan.params, plan.owners) if s.experts is not None]
    assert len(stacks) == 6
    for spec, owner in stacks:
        assert spec.experts.ep_size == 4 and spec.experts.num_experts == E
        assert spec.shape[0] == E and spec.local_shape == (E // 4,) + spec.shape[1:]
        assert spec.local_numel * 4 == spec.numel
        assert isinstance(owner, ExpertOwners) and owner.local
        assert owner.ranks == (0, 1, 2, 3) and owner.sizes == (2, 2, 2, 2)
        assert plan.boundary(spec.fqn) == spec.fqn.split(".moe")[0]
        assert all(e.fqn != spec.fqn for b in plan.boundaries for e in b.entries())
    assert plan.ep_size == 4
    assert ShardingPlan.from_json(plan.to_json()) == plan
    assert '"local":true' in plan.to_json() and '"ep_size":4' in plan.to_json()
    plan.schedule().check()
    ns = [op for op in plan.schedule().ops if op.kind == "newton_schulz" and "layers.0.moe.experts.w1" in op.fqns]
    assert sorted(op.group for op in ns) == [(0,), (1,), (2,), (3,)] and all(op.deps == () for op in ns)
    assert "expert-parallel, local" in plan.summary()


def test_ep_plan_without_ep_keeps_json():
    plan = P.compile(full_model(), 4)
    text = plan.to_json()
    assert '"local"' not in text and '"ep_size"' not in text and plan.ep_size == 1


@pytest.mark.parametrize("world,align", [(4, 1), (2, 1), (4, 16)])
def test_ep_cost_is_non_ep_cost_minus_stacks(world, align):
    full = P.compile(full_model(), world, align_numel=align)
    ep = P.compile(ep_model(world, 0), world, ep=world, align_numel=align)
    # dense owners do not move: the stacks' ranges were N equal pieces in both plans
    dense = lambda p: [(s.fqn, o) for s, o in zip(p.params, p.owners) if s.experts is None]  # noqa: E731
    assert dense(full) == dense(ep)
    stacks = [s.fqn for s in full.params if s.experts is not None]
    # the stacks' bytes in the non-EP plan: every forward/backward broadcast and reduce of the
    # segments, counted without the stacks' entries (same boundary programs, their segments shrunk)
    assert ep.cost.total_nbytes < full.cost.total_nbytes
    if align == 1:  # packed without padding: each range entry is its elements + one flag element
        isz, n = 4, world
        stack_elems = sum(full.param(f).numel + world for f in stacks)
        assert full.cost.total_nbytes - ep.cost.total_nbytes == 3 * (n - 1) * isz * stack_elems
    assert sum(ep.cost.per_rank_nbytes) == ep.cost.total_nbytes


def test_ep_mesh_named_ep_implies_ep_n():
    from torch.distributed.device_mesh import DeviceMesh  # noqa: F401 - a duck-typed mesh below

    class Mesh:
        shape = (4,)
        mesh_dim_names = ("ep",)

    plan = P.compile(ep_model(4, 0), Mesh())
    assert plan.ep_size == 4
    with pytest.raises(ValueError, match="named 'ep'"):
        P.compile(ep_model(4, 0), Mesh(), ep=2)


def test_ep_refusals():
    with pytest.raises(ValueError, match="does not divide"):
        P.compile(ep_model(4, 0), 6, ep=4)
    with pytest.raises(ValueError, match="efsdp > 1 are not supported yet; use ep = N"):
        P.compile(ep_model(2, 0), 4, ep=2)
    with pytest.raises(ValueError, match="EP with HSDP replicas not supported yet"):
        P.compile(ep_model(2, 0), (2, 2), ep=2)
    with pytest.raises(ValueError, match="must be an int >= 1"):
        P.compile(ep_model(2, 0), 2, ep=0)
    with pytest.raises(ValueError, match="not dedicated"):
        P.compile(ep_model(2, 0), 2, ep=2, predicate=lambda fqn, p: p.ndim == 2 and fqn.startswith("layers."))
    with pytest.raises(ValueError, match="not dedicated"):
        P.compile(ep_model(2, 0), 2, ep=2, experts="off")
    with pytest.raises(ValueError, match="no expert stack"):
        P.compile(torch.nn.Sequential(torch.nn.Linear(4, 4)), 2, ep=2, hook_boundary_strict=False)


def test_ep_dtensor_stack_refused():
    """A stack held as a DTensor (EP by Shard(0)) is refused with the reason (duck-typed DTensor)."""
    from dmuon.plan import compile as compile_mod  # noqa: F401
    import dmuon.plan.snapshot as snap

    real = snap._tp_placement

    def fake(tensor):
        if tensor.ndim == 3:
            return 2, 0, ""
        return real(tensor)

    snap._tp_placement = fake
    try:
        with pytest.raises(ValueError, match="is a DTensor.*plain tensor"):
            P.compile(ep_model(2, 0), 2, ep=2)
    finally:
        snap._tp_placement = real


def test_ep_plan_validation():
    plan = P.compile(ep_model(2, 0), 2, ep=2)
    i = next(i for i, s in enumerate(plan.params) if s.experts is not None)
    owners = list(plan.owners)
    owners[i] = dataclasses.replace(owners[i], local=False)
    with pytest.raises(ValueError, match="expert-parallel"):
        dataclasses.replace(plan, owners=tuple(owners))
    with pytest.raises(ValueError, match="rank order"):
        ExpertOwners(members=tuple(reversed(plan.owners[i].members)), sizes=(4, 4), local=True)
