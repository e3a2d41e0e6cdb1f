"""The schedule's collectives bound to this rank's buffers and process groups.

:func:`dmuon.plan._scheduling.programs.boundary_programs` gives, per hook boundary and phase, the ops of
every rank (the same lists :func:`dmuon.plan.schedule` sequences into a step). :func:`bind`
keeps the ops whose group contains this rank, resolves each to the packed segment (and
sub-segment) it moves, its root as a global rank and dmuon's process group, and checks that the
sizes agree with the buffers. The hooks (:mod:`dmuon.exec._runtime._boundary.hook_boundary`) and
the model-wide runtime (:mod:`dmuon.exec._runtime.runtime`) then run these lists: which collectives, with which roots, sizes and
dtypes, in which order, is decided by the plan; *when* each list runs, by the hooks.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from dmuon.plan._scheduling.ops import Op
from dmuon.plan._scheduling.programs import BoundaryProgram

from dmuon.exec._runtime.packed_buffers import _Segment, _SubSeg
from dmuon.exec._runtime._boundary.gather_buffers import _GatherBuffer
from dmuon.exec._comm.groups import MeshGroups

__all__ = ["BoundOp", "BoundaryOps", "schedule_rank", "bind", "ONE_RANK"]


@dataclasses.dataclass(frozen=True, eq=False)
class BoundOp:
    """One scheduled collective of this rank: the schedule's ``op``, the ``segment`` (and for
    the HSDP replicate phases the ``sub``-segment) it moves, its ``root`` as a global rank, and
    dmuon's process ``group`` for it. An all-gather / reduce-scatter moves a whole all-gathered
    buffer: ``gather`` is set, ``segment`` is its held segment or None, ``root`` None."""

    op: Op
    segment: _Segment | None
    sub: _SubSeg | None
    root: int | None
    group: Any
    gather: _GatherBuffer | None = None


@dataclasses.dataclass(frozen=True, eq=False)
class BoundaryOps:
    """This rank's collectives of one hook boundary, per phase, in issue order
    (:class:`~dmuon.plan._scheduling.programs.BoundaryProgram` filtered to this rank)."""

    forward_broadcast: tuple[BoundOp, ...]
    backward_broadcast: tuple[BoundOp, ...]  # empty in Z2: the buffers stay resident for the backward
    reduce: tuple[BoundOp, ...]
    replicate_reduce: tuple[BoundOp, ...]
    replicate_broadcast: tuple[BoundOp, ...]

    def broadcast(self, phase: str) -> tuple[BoundOp, ...]:
        """The forward or backward broadcast list (``phase``: the ledger phase)."""
        return self.forward_broadcast if phase == "forward_broadcast" else self.backward_broadcast

    def replicate_reduce_of(self, segment: _Segment) -> tuple[BoundOp, ...]:
        return tuple(b for b in self.replicate_reduce if b.segment is segment)


#: the phases whose ops run on a segment's efsdp group when its buffer is expert-parallel
EFSDP_PHASES = ("forward_broadcast", "backward_broadcast", "reduce")


class _OneRank:
    """The "group" of a reduce over one rank (an efsdp group of size 1, ``ep = N`` on an HSDP
    mesh): the packed buffer is already the sum, no collective runs and no byte moves."""

    def __repr__(self) -> str:
        return "ONE_RANK"


ONE_RANK = _OneRank()


def schedule_rank(groups: MeshGroups) -> int:
    """This process's schedule rank: ``(replicate*N + shard)*T + tp`` (the mesh rank without TP)."""
    return (groups.replicate * groups.shape[1] + groups.shard) * groups.tp_size + groups.tp_rank


def _global_rank(groups: MeshGroups, rank: int) -> int:
    """Global rank of schedule rank ``rank`` of this rank's TP coordinate."""
    dp, t = divmod(rank, groups.tp_size)
    if t != groups.tp_rank:
        raise AssertionError(f"dmuon: schedule rank {rank} is on TP coordinate {t}, not this rank's {groups.tp_rank}")
    r, s = divmod(dp, groups.shape[1])
    return groups.rank_of(r, s)


def bind(program: BoundaryProgram, segments: list[_Segment], groups: MeshGroups) -> BoundaryOps:
    """Bind ``program``'s ops that include this rank to its ``segments`` (local; no collective).

    Raises:
        AssertionError: an op's group is neither this rank's shard group, its replicate group
            nor (expert-parallel buffers) its efsdp group,
            or its size differs from the segment's (the runtime and the plan disagree: a bug).
    """
    me = schedule_rank(groups)
    R, N = groups.shape
    T = groups.tp_size
    my_row = tuple((groups.replicate * N + s) * T + groups.tp_rank for s in range(N))
    my_col = tuple((r * N + groups.shard) * T + groups.tp_rank for r in range(R))
    by_key = {}
    gathers = {}
    for seg in segments:
        by_key[(seg.buffer_key, seg.shard)] = seg
        if seg.gather is not None:
            gathers[seg.buffer_key] = seg.gather

    def bound(op: Op) -> BoundOp:
        if op.kind in ("all_gather", "reduce_scatter"):  # a whole all-gathered buffer, one slot per member
            gb = gathers[op.buffer]
            if op.group == my_row:
                group = groups.shard_group
            elif T == 1 and tuple(op.group) in groups.owner_group_pgs:
                group = groups.owner_group(op.group)  # expert-parallel: the efsdp group
            else:
                raise AssertionError(f"dmuon: {op.describe()} on group {op.group} is not one of this rank's groups")
            if op.numel != gb.slot_numel or len(op.group) != gb.k:
                raise AssertionError(
                    f"dmuon: {op.describe()} moves {len(op.group)} x {op.numel} elements but the "
                    f"buffer has {gb.k} x {gb.slot_numel}"
                )
            return BoundOp(op=op, segment=gb.held, sub=None, root=None, group=group, gather=gb)
        seg = by_key[(op.buffer, op.segment)]
        sub = None
        if op.group == my_row:
            group, size = groups.shard_group, seg.numel
        elif op.phase == "reduce" and op.group == (me,):  # an efsdp group of one rank: nothing to move
            group, size = ONE_RANK, seg.numel
        elif op.phase in EFSDP_PHASES and T == 1 and tuple(op.group) in groups.owner_group_pgs:
            group, size = groups.owner_group(op.group), seg.numel  # expert-parallel: the efsdp group
        elif op.group == my_col:
            group = groups.replicate_group
            sub = seg.subs[[x.replicate for x in seg.subs].index(op.subsegment)]
            size = sub.numel
        else:
            raise AssertionError(f"dmuon: {op.describe()} on group {op.group} is not one of this rank's groups")
        if op.numel != size:
            raise AssertionError(f"dmuon: {op.describe()} moves {op.numel} elements but the buffer has {size}")
        return BoundOp(op=op, segment=seg, sub=sub, root=_global_rank(groups, op.root), group=group)

    def mine(ops: tuple[Op, ...]) -> tuple[BoundOp, ...]:
        return tuple(bound(op) for op in ops if me in op.group)

    return BoundaryOps(
        forward_broadcast=mine(program.forward_broadcast),
        backward_broadcast=mine(program.backward_broadcast),
        reduce=mine(program.reduce),
        replicate_reduce=mine(program.replicate_reduce),
        replicate_broadcast=mine(program.replicate_broadcast),
    )
