"""Independent oracle for the schedule-derived costs: the closed-form per-phase byte formulas
and per-rank statistics of a plan's layout (the table in docs/planning.md), written without the
schedule. Broadcast buffers: every non-holder receives / sends each segment; all-gathered
buffers: every rank receives / sends ``N-1`` slots per phase and holds all ``N`` while unsharded. ``plan.cost`` / ``plan.rank_stats()`` sum the nominal step's ops instead; the two must
agree exactly (tests/plan/test_schedule.py).
"""

from __future__ import annotations

from collections.abc import Sequence

from dmuon.plan._cost.flops import ns_flops, tp_ns_flops
from dmuon.plan._cost.cost_model import ByteCost
from dmuon.plan._cost.nbytes import broadcast_nbytes, reduce_nbytes
from dmuon.plan._rules import tp_rank_nbytes
from dmuon.plan._layout.buffer_layout import Boundary
from dmuon.plan._records.fields import itemsize_nbytes
from dmuon.plan._records.owners import Owner
from dmuon.plan._records.params import ParamSpec
from dmuon.plan._rules import bcast_dtype, reduce_dtype


def formula_cost(plan) -> ByteCost:
    """:func:`byte_cost` of ``plan``'s layout (TP bytes per matrix)."""
    tp_by = [0] * plan.world_size
    segments = len(plan.tp_segment_lengths)
    for spec, owner in zip(plan.params, plan.owners):
        if spec.tp_size > 1:
            tp_by[owner.rank] += tp_rank_nbytes(spec, spec.tp_ns, segments)
    return byte_cost(
        plan.boundaries,
        mesh_shape=plan.mesh_shape,
        reshard_after_forward=plan.reshard_after_forward,
        param_dtype=plan.param_dtype,
        reduce_dtype_=plan.reduce_dtype,
        tp_size=plan.tp_size,
        tp_rank_nbytes_by_mesh_rank=tp_by,
    )


def formula_rank_stats(plan) -> tuple[tuple[int, int, int], ...]:
    return rank_stats(
        plan.params,
        plan.owners,
        plan.boundaries,
        formula_cost(plan),
        mesh_shape=plan.mesh_shape,
        reshard_after_forward=plan.reshard_after_forward,
        param_dtype=plan.param_dtype,
        tp_size=plan.tp_size,
        tp_segment_lengths=plan.tp_segment_lengths,
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
    seg_b_by_shard = [0] * N  # bytes of broadcast segments of shard s, broadcast dtype
    seg_r_by_shard = [0] * N  # same, reduce dtype
    slot_b = slot_r = 0  # all-gathered buffers: one slot per rank, broadcast / reduce dtype
    sub_r_by_slot: dict[tuple[int, int], int] = {}
    sub_p_by_slot: dict[tuple[int, int], int] = {}
    for boundary in boundaries:
        for buf in boundary.buffers:
            isz_b = itemsize_nbytes(bcast_dtype(buf.dtype, param_dtype))
            isz_r = itemsize_nbytes(reduce_dtype(buf.dtype, param_dtype, reduce_dtype_))
            isz_p = itemsize_nbytes(buf.dtype)
            gathered = buf.collective == "all_gather"
            assert buf.ep == 1 or not gathered, "formula_cost: all-gathered expert-parallel buffers are not covered"
            if gathered:  # every rank sends / receives (N-1) slots per phase
                slot_b += buf.slot_numel * isz_b
                slot_r += buf.slot_numel * isz_r
            for seg in buf.segments:
                if not gathered:
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
            fwd_b += (N - 1) * slot_b
            red += (N - 1) * slot_r
            per_rank[r * N + s] = fwd_b * (2 if bwd else 1) + red + (rep_r + rep_p if R > 1 else 0)
    T = tp_size
    fwd_total = T * R * (broadcast_nbytes(total_b, N) + N * (N - 1) * slot_b)
    red_total = T * R * (reduce_nbytes(total_r, N) + N * (N - 1) * slot_r)
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
) -> tuple[tuple[int, int, int], ...]:
    """Per rank ``(peak_transient_nbytes, comm_nbytes, ns_flops)`` by formula: the
    :class:`RankStats` fields that ``plan.rank_stats()`` reads off the schedule."""
    R, N = mesh_shape
    world = R * N
    T = tp_size
    flops = [0] * world
    for spec, owner in zip(params, owners):
        if spec.tp_size > 1:
            flops[owner.rank] += tp_ns_flops(spec, tp_segment_lengths)
        else:
            flops[owner.rank] += ns_flops(*spec.matrix_shape, num_matrices=spec.num_matrices)

    transient = [0] * world
    for boundary in boundaries:
        b_total = 0
        local_by_shard = [0] * N  # the shard's own segment: owned masters or HSDP replicas
        for buf in boundary.buffers:
            isz = itemsize_nbytes(bcast_dtype(buf.dtype, param_dtype))
            if buf.collective == "all_gather":  # the whole gathered tensor, own slot included
                b_total += N * buf.slot_numel * isz
                continue
            b_total += buf.numel * isz
            for seg in buf.segments:
                local_by_shard[seg.shard] += seg.numel * isz
        for rank in range(world):
            here = b_total - local_by_shard[rank % N]
            transient[rank] = max(transient[rank], here) if reshard_after_forward else transient[rank] + here
    return tuple((transient[g // T], cost.per_rank_nbytes[g], flops[g // T]) for g in range(world * T))


def schedule_fields(stats) -> tuple[tuple[int, int, int], ...]:
    """``(peak_transient_nbytes, comm_nbytes, ns_flops)`` of each :class:`RankStats`."""
    return tuple((r.peak_transient_nbytes, r.comm_nbytes, r.ns_flops) for r in stats)
