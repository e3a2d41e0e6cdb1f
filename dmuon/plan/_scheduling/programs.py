"""Per-boundary programs: the collectives of each hook boundary per phase, for every rank
(:func:`boundary_programs`, :class:`BoundaryProgram`). The runtime binds them to its buffers
(``dmuon.exec._runtime._boundary.bound_ops``); the builder replays them into a step's op table.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from dmuon.plan._scheduling.ops import Op

if TYPE_CHECKING:
    from dmuon.plan._records.plan import ShardingPlan

__all__ = [
    "BoundaryProgram",
    "boundary_programs",
]


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class BoundaryProgram:
    """The collectives of one hook boundary per phase, for every rank (ops with ``id = -1``).

    The runtime binds these lists to its buffers once; its hooks decide when each list runs.
    Order within a list: buffers by dtype, segments by shard, sub-segments by replicate; rows of
    the mesh (and TP coordinates) one after another (their groups are disjoint). A buffer moved
    by all-gathers (:attr:`~dmuon.plan._layout.buffer_layout.BufferLayout.collective`) has one
    ``all_gather`` per group in each broadcast list and one ``reduce_scatter`` per group in
    ``reduce`` (``segment`` None) in place of its per-segment ops; its replicate phases are
    per sub-segment as for any buffer.
    ``backward_broadcast`` is empty in Z2: the buffers stay resident from the forward.
    """

    fqn: str
    index: int
    forward_broadcast: tuple[Op, ...]
    backward_broadcast: tuple[Op, ...]
    reduce: tuple[Op, ...]
    replicate_reduce: tuple[Op, ...]
    replicate_broadcast: tuple[Op, ...]


# ----------------------------------------------------------------------------------- ranks


def _rank_fns(plan: ShardingPlan):
    R, N = plan.mesh_shape
    T = plan.tp_size

    def rank(r: int, s: int, t: int = 0) -> int:
        return (r * N + s) * T + t

    rows = {(r, t): tuple(rank(r, s, t) for s in range(N)) for r in range(R) for t in range(T)}
    cols = {(s, t): tuple(rank(r, s, t) for r in range(R)) for s in range(N) for t in range(T)}
    tps = {(r, s): tuple(rank(r, s, t) for t in range(T)) for r in range(R) for s in range(N)}
    return rank, rows, cols, tps


def boundary_programs(plan: ShardingPlan) -> tuple[BoundaryProgram, ...]:
    """Every boundary's per-phase collectives (:class:`BoundaryProgram`), plan order. Pure."""
    R, N = plan.mesh_shape
    T = plan.tp_size
    rank, rows, cols, _ = _rank_fns(plan)
    out = []
    for index, b in enumerate(plan.boundaries):
        fwd: list[Op] = []
        bwd: list[Op] = []
        red: list[Op] = []
        rep_red: list[Op] = []
        rep_bc: list[Op] = []
        for t in range(T):
            for r in range(R):
                for buf in b.buffers:
                    wire = plan.bcast_dtype(buf.dtype)
                    red_dtype = plan.reduce_dtype_for(buf.dtype)
                    if buf.collective == "all_gather":  # one all-gather / reduce-scatter of slots per group
                        for c in sorted({seg.shard % buf.ep for seg in buf.segments}):
                            group = tuple(rank(r, s, t) for s in buf.group_shards(c, N))
                            common = dict(id=-1, group=group, numel=buf.slot_numel, boundary=b.fqn, buffer=buf.key)
                            fwd.append(Op(kind="all_gather", phase="forward_broadcast", dtype=wire, **common))
                            if plan.reshard_after_forward:
                                bwd.append(Op(kind="all_gather", phase="backward_broadcast", dtype=wire, **common))
                            red.append(Op(kind="reduce_scatter", phase="reduce", dtype=red_dtype, **common))
                        continue
                    for seg in buf.segments:
                        group = rows[(r, t)]
                        if buf.ep > 1:  # expert-parallel ranges: the segment's efsdp group only
                            group = tuple(rank(r, s, t) for s in buf.group_shards(seg.shard, N))
                        common = dict(
                            id=-1,
                            group=group,
                            root=rank(r, seg.shard, t),
                            numel=seg.numel,
                            boundary=b.fqn,
                            buffer=buf.key,
                            segment=seg.shard,
                        )
                        if len(group) > 1:  # a one-rank group has nothing to broadcast
                            fwd.append(Op(kind="broadcast", phase="forward_broadcast", dtype=wire, **common))
                            if plan.reshard_after_forward:
                                bwd.append(Op(kind="broadcast", phase="backward_broadcast", dtype=wire, **common))
                        red.append(Op(kind="reduce", phase="reduce", dtype=red_dtype, **common))
        if R > 1:
            for buf in b.buffers:
                red_dtype = plan.reduce_dtype_for(buf.dtype)
                for seg in buf.segments:
                    for sub in seg.subsegments:
                        for t in range(T):
                            common = dict(
                                id=-1,
                                group=cols[(seg.shard, t)],
                                root=rank(sub.owner.replicate, seg.shard, t),
                                numel=sub.numel,
                                boundary=b.fqn,
                                buffer=buf.key,
                                segment=seg.shard,
                                subsegment=sub.owner.replicate,
                            )
                            rep_red.append(Op(kind="reduce", phase="replicate_reduce", dtype=red_dtype, **common))
                            rep_bc.append(Op(kind="broadcast", phase="replicate_broadcast", dtype=buf.dtype, **common))
        out.append(
            BoundaryProgram(
                fqn=b.fqn,
                index=index,
                forward_broadcast=tuple(fwd),
                backward_broadcast=tuple(bwd),
                reduce=tuple(red),
                replicate_reduce=tuple(rep_red),
                replicate_broadcast=tuple(rep_bc),
            )
        )
    return tuple(out)
