"""Lookups by FQN of a :class:`~dmuon.plan._records.plan.ShardingPlan`: the index built once at
construction (canonical FQNs, aliases, each parameter's boundary, checked against the layouts)
and what ``plan.owner(fqn)``, ``plan.param(fqn)``, ``plan.boundary(fqn)`` and the other lookups
read from it. The methods on ShardingPlan delegate here.
"""

from __future__ import annotations

import difflib
from typing import TYPE_CHECKING

from dmuon.plan._layout.buffer_layout import Boundary
from dmuon.plan._records.owners import ExpertOwners, Owner, OwnerGroup
from dmuon.plan._records.params import ParamSpec

if TYPE_CHECKING:
    from dmuon.plan._records.plan import ShardingPlan

__all__ = [
    "build_index",
    "lookup",
    "owner",
    "owner_record",
    "expert_owners",
    "param",
    "boundary",
    "boundary_record",
    "is_dedicated",
]


def _closest(name: str, candidates: list[str]) -> str:
    close = difflib.get_close_matches(name, candidates, n=3, cutoff=0.5)
    return f"; closest: {', '.join(close)}" if close else ""


def build_index(plan: ShardingPlan) -> dict:
    """The FQN lookup tables of ``plan``, checked against its layouts: ``canonical`` (FQN ->
    index in ``plan.params``), ``alias`` (any name -> index), ``boundary_of`` (index -> boundary
    index). Built once, at construction (``ShardingPlan._build_index``)."""
    canonical: dict[str, int] = {}
    alias: dict[str, int] = {}
    for i, spec in enumerate(plan.params):
        if spec.fqn in canonical:
            raise ValueError(f"ShardingPlan: duplicate dedicated param {spec.fqn!r}")
        canonical[spec.fqn] = i
        for a in spec.aliases:
            if a in alias:
                raise ValueError(f"ShardingPlan: alias {a!r} names two dedicated params")
            alias[a] = i
    boundary_of: list[int | None] = [None] * len(plan.params)
    blocks_seen: list[set] = [set() for _ in plan.params]
    for b_index, boundary in enumerate(plan.boundaries):
        for buf in boundary.buffers:
            for entry in buf.entries():
                i = canonical.get(entry.fqn)
                if i is not None:
                    # one entry per parameter; an owner group's blocks: one entry each, one buffer
                    if boundary_of[i] is not None and (
                        boundary_of[i] != b_index or entry.block is None or entry.block in blocks_seen[i]
                    ):
                        raise ValueError(f"ShardingPlan: {entry.fqn!r} appears in two buffers")
                    boundary_of[i] = b_index
                    blocks_seen[i].add(entry.block)
        for fqn in boundary.local:  # expert-parallel stacks: in the boundary, no buffer entry
            i = canonical.get(fqn)
            if i is None:
                raise ValueError(
                    f"ShardingPlan: boundary {boundary.fqn!r} lists {fqn!r} as local, not a dedicated param"
                )
            owner = plan.owners[i]
            if boundary_of[i] is not None or not (isinstance(owner, ExpertOwners) and owner.local):
                raise ValueError(
                    f"ShardingPlan: boundary {boundary.fqn!r} lists {fqn!r} as local, but it "
                    + ("appears in two boundaries" if boundary_of[i] is not None else "is not an expert-parallel stack")
                )
            boundary_of[i] = b_index
    for i, owner in enumerate(plan.owners):
        if isinstance(owner, ExpertOwners) and owner.local:
            continue
        expected = set(range(owner.k)) if isinstance(owner, (OwnerGroup, ExpertOwners)) else {None}
        if boundary_of[i] is not None and blocks_seen[i] != expected:
            raise ValueError(
                f"ShardingPlan: {plan.params[i].fqn!r} has layout blocks {sorted(map(str, blocks_seen[i]))}, "
                f"expected {sorted(map(str, expected))}"
            )
    return {"canonical": canonical, "alias": alias, "boundary_of": boundary_of}


def lookup(plan: ShardingPlan, fqn: str) -> int:
    """Index in ``plan.params`` of ``fqn`` (any alias). Raises KeyError with close matches."""
    idx = plan._idx()["alias"].get(fqn)
    if idx is None:
        raise KeyError(f"{fqn!r} is not a dedicated parameter of this plan{_closest(fqn, list(plan._idx()['alias']))}")
    return idx


def owner(plan: ShardingPlan, fqn: str) -> Owner | OwnerGroup:
    """:meth:`ShardingPlan.owner`."""
    owner = plan.owners[plan._lookup(fqn)]
    if isinstance(owner, ExpertOwners):
        raise ValueError(
            f"{fqn!r} is an expert stack whose {owner.num_experts} experts have {owner.k} owners "
            f"(ranks {', '.join(map(str, owner.ranks))}); plan.expert_owners(fqn) gives the owner of each "
            "expert, plan.owner_record(fqn) the ExpertOwners record"
        )
    return owner


def owner_record(plan: ShardingPlan, fqn: str) -> Owner | OwnerGroup | ExpertOwners:
    """:meth:`ShardingPlan.owner_record`."""
    return plan.owners[plan._lookup(fqn)]


def expert_owners(plan: ShardingPlan, fqn: str) -> tuple[Owner, ...]:
    """:meth:`ShardingPlan.expert_owners`."""
    i = plan._lookup(fqn)
    spec, owner = plan.params[i], plan.owners[i]
    if spec.experts is None:
        raise ValueError(f"{fqn!r} is not an expert stack (shape {spec.shape}); plan.owner(fqn) gives its owner")
    if isinstance(owner, ExpertOwners):
        return owner.per_expert()
    return (owner,) * spec.num_experts


def param(plan: ShardingPlan, fqn: str) -> ParamSpec:
    """:meth:`ShardingPlan.param`."""
    return plan.params[plan._lookup(fqn)]


def boundary(plan: ShardingPlan, fqn: str) -> str:
    """:meth:`ShardingPlan.boundary`."""
    return plan.boundaries[plan._idx()["boundary_of"][plan._lookup(fqn)]].fqn


def boundary_record(plan: ShardingPlan, fqn: str) -> Boundary:
    """:meth:`ShardingPlan.boundary_record`."""
    return plan.boundaries[plan._idx()["boundary_of"][plan._lookup(fqn)]]


def is_dedicated(plan: ShardingPlan, fqn: str) -> bool:
    """:meth:`ShardingPlan.is_dedicated`."""
    return fqn in plan._idx()["alias"]
