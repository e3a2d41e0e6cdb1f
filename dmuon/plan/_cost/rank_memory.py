"""Per-rank figures of a DMuon plan: owned, resident and peak transient bytes, with each rank's
bytes on the wire and Newton-Schulz FLOPs, from the nominal schedule (:func:`rank_stats`,
records :class:`~dmuon.plan._cost.cost_model.RankStats`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from dmuon.plan._cost.cost_model import ByteCost, RankStats
from dmuon.plan._cost.weights import member_weights
from dmuon.plan._records.fields import itemsize_nbytes
from dmuon.plan._records.owners import ExpertOwners, Owner, OwnerGroup
from dmuon.plan._records.params import ParamSpec

__all__ = [
    "rank_stats",
]


def rank_stats(
    params: Sequence[ParamSpec],
    owners: Sequence[Owner],
    sched: Any,
    cost: ByteCost,
    *,
    mesh_shape: tuple[int, int],
    reshard_after_forward: bool,
    tp_size: int = 1,
    assembled_nbytes: dict[str, int] | None = None,
) -> tuple[RankStats, ...]:
    """Per-rank :class:`RankStats` of a DMuon plan (definitions on the record), from its nominal
    schedule ``sched``: ``comm_nbytes`` = ``cost.per_rank_nbytes``; ``ns_flops`` = the
    ``newton_schulz`` ops each rank runs; ``peak_transient_nbytes`` = the bytes a rank receives
    in one boundary's forward broadcasts, or the whole output of its forward all-gathers (every
    slot, its own and the padding included: ``k * slot`` per all-gather), (Z3: the largest
    boundary; Z2: all of them), plus, per
    boundary, ``assembled_nbytes[boundary]``: the full compute matrices of owner-grouped
    matrices, which every rank assembles from their blocks (broadcast dtype).

    With TP (``tp_size = T > 1``) there is one record per schedule rank
    ``(replicate*N + shard)*T + tp``: element and byte figures are that rank's shards (the
    ``T`` ranks of a mesh coordinate are identical).
    """
    R, N = mesh_shape
    world = R * N
    T = tp_size
    n = world * T
    owned_numel = [0] * world
    owned_nbytes = [0] * world
    replica_nbytes_by_shard = [0] * N  # params with owner shard s, any replicate: held by every (s, r')
    for spec, owner in zip(params, owners):
        isz = itemsize_nbytes(spec.dtype)
        if isinstance(owner, ExpertOwners):  # each member owns (and its replicas hold) a range of experts
            per_expert = spec.numel // spec.num_experts
            pieces = [(member, per_expert * size) for member, size in zip(owner.members, owner.sizes)]
        elif isinstance(owner, OwnerGroup):  # each member owns (and its replicas hold) one block
            pieces = list(zip(owner.members, member_weights(spec, owner.dim, owner.sizes, "numel", ())))
        else:
            pieces = [(owner, spec.local_numel)]
        for member, numel in pieces:
            owned_numel[member.rank] += numel
            owned_nbytes[member.rank] += numel * isz
            replica_nbytes_by_shard[member.shard] += numel * isz

    flops = [0] * n
    received: dict[tuple[str, tuple[int, ...]], int] = {}  # (boundary, group) -> bytes per member
    root_credit: dict[tuple[str, int], int] = {}
    for op in sched.ops:
        if op.kind == "newton_schulz":
            for x in op.group:
                flops[x] += op.flops
        elif op.phase == "forward_broadcast" and op.micro_batch == 0:
            key = (op.boundary, op.group)
            if op.kind == "all_gather":  # the whole gathered tensor, own slot and padding included
                received[key] = received.get(key, 0) + len(op.group) * op.nbytes
                continue
            nbytes = op.nbytes
            received[key] = received.get(key, 0) + nbytes
            rkey = (op.boundary, op.root)
            root_credit[rkey] = root_credit.get(rkey, 0) + nbytes
    per_boundary: dict[str, list[int]] = {}
    for (boundary, group), nbytes in received.items():
        row = per_boundary.setdefault(boundary, [0] * n)
        for x in group:
            row[x] += nbytes
    for (boundary, root), nbytes in root_credit.items():
        per_boundary[boundary][root] -= nbytes
    for boundary, nbytes in (assembled_nbytes or {}).items():
        row = per_boundary.setdefault(boundary, [0] * n)
        for x in range(n):
            row[x] += nbytes
    transient = [0] * n
    for row in per_boundary.values():
        for x in range(n):
            transient[x] = max(transient[x], row[x]) if reshard_after_forward else transient[x] + row[x]

    out = []
    for g in range(n):
        rank = g // T
        s = rank % N
        params_held = replica_nbytes_by_shard[s] if R > 1 else owned_nbytes[rank]
        out.append(
            RankStats(
                rank=g,
                owned_numel=owned_numel[rank],
                owned_nbytes=owned_nbytes[rank],
                resident_nbytes=params_held + owned_nbytes[rank],
                peak_transient_nbytes=transient[g],
                comm_nbytes=cost.per_rank_nbytes[g],
                ns_flops=flops[g],
            )
        )
    return tuple(out)
