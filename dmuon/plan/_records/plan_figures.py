"""Figures derived from a :class:`~dmuon.plan._records.plan.ShardingPlan`: the nominal step's
schedule and its :class:`~dmuon.plan._cost.cost_model.ByteCost` (built once, with the plan), owned
elements and LPT weight per rank, the LPT bound, the FSDP2 + naive Muon baseline, the bytes
assembled from owner groups' blocks, and per-rank stats. ``plan.cost``, ``plan.schedule()``,
``plan.rank_stats()`` and the others delegate here; the formulas live in :mod:`dmuon.plan._cost`.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from dmuon.plan._cost import baseline as _baseline
from dmuon.plan._cost import rank_memory as _memory
from dmuon.plan._cost import cost_model as _cost
from dmuon.plan._cost import nbytes as _nbytes
from dmuon.plan._cost import weights as _weights
from dmuon.plan._records.fields import itemsize_nbytes
from dmuon.plan._records.owners import ExpertOwners, OwnerGroup
from dmuon.plan._records.params import ParamSpec

if TYPE_CHECKING:
    from dmuon.plan._records.plan import ShardingPlan

ByteCost = _cost.ByteCost

__all__ = [
    "nominal",
    "owned_numel",
    "owned_weight",
    "balance_bound",
    "schedule",
    "cost",
    "baseline_params",
    "baseline_cost",
    "assembled_nbytes",
    "rank_stats",
    "baseline_rank_stats",
    "adamw_rank_stats",
]


def nominal(plan: ShardingPlan) -> tuple:
    """The nominal step's schedule and its :class:`ByteCost` (what :attr:`cost`,
    :meth:`schedule` with no step and :meth:`rank_stats` read), computed once per plan."""
    from dmuon.plan._scheduling.builder import schedule

    sched = schedule(plan)
    return sched, _nbytes.schedule_byte_cost(sched)


def owned_numel(plan: ShardingPlan) -> tuple[int, ...]:
    """:attr:`ShardingPlan.owned_numel`."""
    out = [0] * plan.world_size
    for spec, owner in zip(plan.params, plan.owners):
        for rank, numel in _weights.owner_weights(spec, owner, "numel", ()):
            out[rank] += numel
    return tuple(out)


def owned_weight(plan: ShardingPlan) -> tuple[int, ...]:
    """:attr:`ShardingPlan.owned_weight`."""
    out = [0] * plan.world_size
    lengths = plan.tp_segment_lengths
    for spec, owner in zip(plan.params, plan.owners):
        for rank, weight in _weights.owner_weights(spec, owner, plan.cost_model, lengths):
            out[rank] += weight
    return tuple(out)


def balance_bound(plan: ShardingPlan) -> float:
    """:attr:`ShardingPlan.balance_bound`."""
    lengths = plan.tp_segment_lengths
    weights = [
        w
        for spec, o in zip(plan.params, plan.owners)
        for _, w in _weights.owner_weights(spec, o, plan.cost_model, lengths)
    ]
    R, N = plan.mesh_shape
    K = max((o.k for o in plan.owners if isinstance(o, (OwnerGroup, ExpertOwners))), default=1)
    factor = N / (N - K + 1) if R > 1 and K > 1 else 1.0
    bound = factor * sum(weights) / plan.world_size + max(weights, default=0)
    if R > 1 and any(spec.experts is not None and spec.ep_size == 1 for spec in plan.params):
        # the level fill on HSDP rows (dmuon/plan/_ownership/level_fill.py): + the heaviest whole item / N
        whole = max(_weights.param_weight(spec, plan.cost_model) for spec in plan.params)
        bound = max(bound, sum(weights) / plan.world_size + whole / N + max(weights, default=0))
    return bound


def schedule(plan: ShardingPlan, step: Any = None) -> Any:
    """:meth:`ShardingPlan.schedule`."""
    if step is None and plan._nominal is not None:
        return plan._nominal[0]
    from dmuon.plan._scheduling.builder import schedule

    return schedule(plan, step)


def cost(plan: ShardingPlan) -> ByteCost:
    """:attr:`ShardingPlan.cost`."""
    if plan._nominal is not None:
        return plan._nominal[1]
    return _nbytes.schedule_byte_cost(plan.schedule())


def baseline_params(plan: ShardingPlan) -> tuple[ParamSpec, ...]:
    """The parameters FSDP2 + naive Muon would shard: expert-parallel stacks are local to
    each rank's model under either, so they are in neither cost."""
    return tuple(spec for spec in plan.params if spec.ep_size == 1)


def baseline_cost(plan: ShardingPlan) -> _cost.BaselineByteCost:
    """:attr:`ShardingPlan.baseline_cost`."""
    return _baseline.baseline_byte_cost(
        plan._baseline_params(),
        mesh_shape=plan.mesh_shape,
        reshard_after_forward=plan.reshard_after_forward,
        param_dtype=plan.param_dtype,
        reduce_dtype_=plan.reduce_dtype,
        tp_size=plan.tp_size,
    )


def assembled_nbytes(plan: ShardingPlan) -> dict[str, int]:
    """:attr:`ShardingPlan.assembled_nbytes`."""
    from dmuon.plan._layout.slots import in_place_stacks

    in_place = {fqn for b in plan.boundaries for buf in b.buffers for fqn in in_place_stacks(buf)}
    out: dict[str, int] = {}
    for spec, owner in zip(plan.params, plan.owners):
        if spec.fqn in in_place:  # received in place: a view of the gathered tensor, nothing assembled
            continue
        if isinstance(owner, (OwnerGroup, ExpertOwners)) and not getattr(owner, "local", False):
            b = plan.boundary(spec.fqn)
            numel = spec.local_numel if spec.ep_size > 1 else spec.numel  # EP: the rank's E/ep experts
            out[b] = out.get(b, 0) + numel * itemsize_nbytes(plan.bcast_dtype(spec.dtype))
    return out


def rank_stats(plan: ShardingPlan, variant: str = "muon", offload: bool = False) -> tuple[_cost.RankStats, ...]:
    """:meth:`ShardingPlan.rank_stats`."""
    stats = _memory.rank_stats(
        plan.params,
        plan.owners,
        plan.schedule(),
        plan.cost,
        mesh_shape=plan.mesh_shape,
        reshard_after_forward=plan.reshard_after_forward,
        tp_size=plan.tp_size,
        assembled_nbytes=plan.assembled_nbytes,
    )
    terms = _memory.dmuon_memory(plan, stats, variant=variant, offload=offload)
    return tuple(dataclasses.replace(st, memory=t) for st, t in zip(stats, terms))


def baseline_rank_stats(plan: ShardingPlan, offload: bool = False) -> tuple[_cost.RankStats, ...]:
    """:meth:`ShardingPlan.baseline_rank_stats`."""
    stats = _baseline.baseline_rank_stats(
        plan._baseline_params(),
        plan.boundary,
        plan.baseline_cost,
        mesh_shape=plan.mesh_shape,
        reshard_after_forward=plan.reshard_after_forward,
        param_dtype=plan.param_dtype,
        tp_size=plan.tp_size,
    )
    terms = _memory.fsdp2_memory(plan, "naive", offload=offload)
    return tuple(dataclasses.replace(st, memory=terms) for st in stats)


def adamw_rank_stats(plan: ShardingPlan, offload: bool = False) -> tuple[_cost.RankStats, ...]:
    """:meth:`ShardingPlan.adamw_rank_stats`: FSDP2 + AdamW on the same mesh (every rank the
    same): the dedicated parameters' FSDP2 shards with AdamW's two moments instead of Muon's
    one, FSDP2's bytes without the naive Muon's gathers, no Newton-Schulz."""
    naive = baseline_rank_stats(plan)
    cost = plan.baseline_cost
    per_rank_gathers = (cost.muon_all_gather_nbytes + cost.tp_all_gather_nbytes) // max(1, len(naive))
    terms = _memory.fsdp2_memory(plan, "adamw", offload=offload)
    return tuple(
        dataclasses.replace(
            st,
            resident_nbytes=st.owned_nbytes * 3,
            peak_transient_nbytes=_baseline.fsdp2_unsharded_nbytes(
                plan._baseline_params(), plan.boundary, plan.mesh_shape, True, plan.param_dtype
            ),
            comm_nbytes=st.comm_nbytes - per_rank_gathers,
            ns_flops=0,
            memory=terms,
        )
        for st in naive
    )
