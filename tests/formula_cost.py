"""Independent oracle for the schedule-derived costs: the closed-form per-phase byte formulas
and per-rank statistics of a plan's layout (the table in docs/planning.md), written without the
schedule. ``plan.cost`` / ``plan.rank_stats()`` sum the nominal step's ops instead; the two must
agree exactly (tests/test_schedule.py).
"""

from __future__ import annotations

from collections.abc import Sequence

from dmuon.plan.cost import ByteCost, RankStats, bcast_dtype, broadcast_nbytes, ns_flops, reduce_dtype, reduce_nbytes, tp_ns_flops, tp_rank_nbytes
from dmuon.plan.layout import Boundary
from dmuon.plan.records import Owner, ParamSpec, itemsize_nbytes


def formula_cost(plan) -> ByteCost:
    """:func:`byte_cost` of ``plan``'s layout (TP bytes per matrix)."""
    tp_by = [0] * plan.world_size
    segments = len(plan.tp_segment_lengths)
    for spec, owner in zip(plan.params, plan.owners):
        if spec.tp_size > 1:
            tp_by[owner.rank] += tp_rank_nbytes(spec, spec.tp_ns, segments)
    return byte_cost(
        plan.boundaries, mesh_shape=plan.mesh_shape, reshard_after_forward=plan.reshard_after_forward,
        param_dtype=plan.param_dtype, reduce_dtype_=plan.reduce_dtype, tp_size=plan.tp_size,
        tp_rank_nbytes_by_mesh_rank=tp_by,
    )


def formula_rank_stats(plan) -> tuple[RankStats, ...]:
    return rank_stats(
        plan.params, plan.owners, plan.boundaries, formula_cost(plan), mesh_shape=plan.mesh_shape,
        reshard_after_forward=plan.reshard_after_forward, param_dtype=plan.param_dtype,
        tp_size=plan.tp_size, tp_segment_lengths=plan.tp_segment_lengths,
    )


def byte_cost(
    boundaries: Sequence[Boundary],
    *,
    mesh_shape: tuple[int, int],
    reshard_after_forward: bool,
    param_dtype: str | None,
    reduce_dtype_: str | None,
    tp_size: int = 1,
    tp_rank_nbytes_by_mesh_rank: Sequence[int] | None = None,
) -> ByteCost:
    """:class:`ByteCost` of a layout (module docstring table). O(segments + R*N*T).

    With ``tp_size = T > 1`` the layouts hold each TP rank's shards (all TP coordinates have
    the same layout), the data-parallel phases are counted once per TP coordinate, and
    ``tp_rank_nbytes_by_mesh_rank[replicate*N + shard]`` is added to each of that mesh rank's
    ``T`` TP ranks (the TP traffic of the matrices it owns).
    """
    R, N = mesh_shape
    seg_b_by_shard = [0] * N  # bytes of segments of shard s, broadcast dtype
    seg_r_by_shard = [0] * N  # same, reduce dtype
    sub_r_by_slot: dict[tuple[int, int], int] = {}
    sub_p_by_slot: dict[tuple[int, int], int] = {}
    for boundary in boundaries:
        for buf in boundary.buffers:
            isz_b = itemsize_nbytes(bcast_dtype(buf.dtype, param_dtype))
            isz_r = itemsize_nbytes(reduce_dtype(buf.dtype, param_dtype, reduce_dtype_))
            isz_p = itemsize_nbytes(buf.dtype)
            for seg in buf.segments:
                seg_b_by_shard[seg.shard] += seg.numel * isz_b
                seg_r_by_shard[seg.shard] += seg.numel * isz_r
                for sub in seg.subsegments:
                    key = (seg.shard, sub.owner.replicate)
                    sub_r_by_slot[key] = sub_r_by_slot.get(key, 0) + sub.numel * isz_r
                    sub_p_by_slot[key] = sub_p_by_slot.get(key, 0) + sub.numel * isz_p
    total_b = sum(seg_b_by_shard)
    total_r = sum(seg_r_by_shard)
    sub_r_by_shard = [0] * N
    sub_p_by_shard = [0] * N
    for (s, _), v in sub_r_by_slot.items():
        sub_r_by_shard[s] += v
    for (s, _), v in sub_p_by_slot.items():
        sub_p_by_shard[s] += v

    bwd = reshard_after_forward
    per_rank = [0] * (R * N)
    for r in range(R):
        for s in range(N):
            fwd_b = total_b - seg_b_by_shard[s]  # receives every other shard's segments
            red = total_r - seg_r_by_shard[s]  # sends its part of every other shard's segments
            rep_r = sub_r_by_shard[s] - sub_r_by_slot.get((s, r), 0)
            rep_p = sub_p_by_shard[s] - sub_p_by_slot.get((s, r), 0)
            per_rank[r * N + s] = fwd_b * (2 if bwd else 1) + red + (rep_r + rep_p if R > 1 else 0)
    T = tp_size
    fwd_total = T * R * broadcast_nbytes(total_b, N)
    red_total = T * R * reduce_nbytes(total_r, N)
    rep_red_total = T * reduce_nbytes(sum(sub_r_by_slot.values()), R)
    rep_bc_total = T * broadcast_nbytes(sum(sub_p_by_slot.values()), R)
    tp_total = 0
    if T > 1:
        tp_by = list(tp_rank_nbytes_by_mesh_rank or [0] * (R * N))
        per_rank = [per_rank[g // T] + tp_by[g // T] for g in range(R * N * T)]
        tp_total = T * sum(tp_by)
    return ByteCost(
        forward_broadcast_nbytes=fwd_total,
        backward_broadcast_nbytes=fwd_total if bwd else 0,
        reduce_nbytes=red_total,
        replicate_reduce_nbytes=rep_red_total,
        replicate_broadcast_nbytes=rep_bc_total,
        total_nbytes=fwd_total * (2 if bwd else 1) + red_total + rep_red_total + rep_bc_total + tp_total,
        per_rank_nbytes=tuple(per_rank),
        tp_nbytes=tp_total,
    )


def rank_stats(
    params: Sequence[ParamSpec],
    owners: Sequence[Owner],
    boundaries: Sequence[Boundary],
    cost: ByteCost,
    *,
    mesh_shape: tuple[int, int],
    reshard_after_forward: bool,
    param_dtype: str | None,
    tp_size: int = 1,
    tp_segment_lengths: Sequence[int] = (),
) -> tuple[RankStats, ...]:
    """Per-rank :class:`RankStats` of a DMuon plan (definitions on the record).

    With TP (``tp_size = T > 1``) there is one record per global rank
    ``(replicate*N + shard)*T + tp``: element and byte figures are that rank's shards (the
    ``T`` ranks of a mesh coordinate are identical), ``ns_flops`` from :func:`tp_ns_flops`.
    """
    R, N = mesh_shape
    world = R * N
    T = tp_size
    owned_numel = [0] * world
    owned_nbytes = [0] * world
    flops = [0] * world
    replica_nbytes_by_shard = [0] * N  # params with owner shard s, any replicate: held by every (s, r')
    for spec, owner in zip(params, owners):
        nbytes = spec.local_numel * itemsize_nbytes(spec.dtype)
        owned_numel[owner.rank] += spec.local_numel
        owned_nbytes[owner.rank] += nbytes
        if spec.tp_size > 1:
            flops[owner.rank] += tp_ns_flops(spec, tp_segment_lengths)
        else:
            flops[owner.rank] += ns_flops(*spec.matrix_shape, num_matrices=spec.num_matrices)
        replica_nbytes_by_shard[owner.shard] += nbytes

    transient = [0] * world
    for boundary in boundaries:
        b_total = 0
        local_by_shard = [0] * N  # the shard's own segment: owned masters or HSDP replicas
        for buf in boundary.buffers:
            isz = itemsize_nbytes(bcast_dtype(buf.dtype, param_dtype))
            b_total += buf.numel * isz
            for seg in buf.segments:
                local_by_shard[seg.shard] += seg.numel * isz
        for rank in range(world):
            here = b_total - local_by_shard[rank % N]
            transient[rank] = max(transient[rank], here) if reshard_after_forward else transient[rank] + here

    out = []
    for g in range(world * T):
        rank = g // T
        s = rank % N
        params_held = replica_nbytes_by_shard[s] if R > 1 else owned_nbytes[rank]
        out.append(
            RankStats(
                rank=g,
                owned_numel=owned_numel[rank],
                owned_nbytes=owned_nbytes[rank],
                resident_nbytes=params_held + owned_nbytes[rank],
                peak_transient_nbytes=transient[rank],
                comm_nbytes=cost.per_rank_nbytes[g],
                ns_flops=flops[rank],
            )
        )
    return tuple(out)
