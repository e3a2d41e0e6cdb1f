"""The schedule of one step: :class:`StepSchedule`, every rank's ops in issue order.

Representation (symmetric form): ``StepSchedule.ops`` is one table in issue order; every op is
shared by all members of its group, and each rank issues exactly the ops whose group contains
it, in table order (:meth:`StepSchedule.rank_ops`). Op kinds, ranks and the bytes charged:
:mod:`dmuon.plan._scheduling.ops`; :meth:`StepSchedule.check` runs the deadlock replay
(:mod:`dmuon.plan._scheduling.schedule_replay`); :func:`~dmuon.plan._scheduling.builder.schedule` builds it.
"""

from __future__ import annotations

import bisect
import dataclasses
import heapq
from collections.abc import Sequence

from dmuon.plan._scheduling.ops import CHARGED_PHASES, Op, ScheduleError, Step, _fmt_group
from dmuon.plan._scheduling.schedule_replay import _group_problem, _op_problem, _replay_pieces

__all__ = [
    "StepSchedule",
]


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class StepSchedule:
    """Every rank's ops for one step (module docstring), built by :func:`schedule`.

    Attributes:
        mesh_shape: ``(R, N)`` of the plan. tp_size: ``T``. reshard_after_forward: Z3 / Z2.
        step: the :class:`Step` scheduled. ops: the op table in issue order (``ops[i].id == i``).
    """

    mesh_shape: tuple[int, int]
    tp_size: int
    reshard_after_forward: bool
    step: Step
    ops: tuple[Op, ...]
    # derived at construction: distinct groups, op ids per group, groups of each rank
    _groups: tuple[tuple[int, ...], ...] = dataclasses.field(default=(), init=False, repr=False, compare=False)
    _group_ops: tuple[tuple[int, ...], ...] = dataclasses.field(default=(), init=False, repr=False, compare=False)
    _rank_groups: tuple[tuple[int, ...], ...] = dataclasses.field(default=(), init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        n = self.num_ranks
        index: dict[tuple[int, ...], int] = {}
        # ops built from one template share its group tuple: look groups up by identity first
        # (hashing a 4096-rank tuple per op dominated schedules of 1000s of ranks)
        by_id: dict[int, int] = {}
        members: list[frozenset] = []
        group_ops: list[list[int]] = []
        for i, op in enumerate(self.ops):
            if op.id != i:
                raise ValueError(f"StepSchedule: ops[{i}].id is {op.id}")
            g = by_id.get(id(op.group))
            if g is None:
                g = index.get(op.group)
                if g is None:
                    problem = _group_problem(op.group, n)
                    if problem is not None:
                        raise ScheduleError(f"StepSchedule: {op.describe()}: {problem}", op=op)
                    g = index[op.group] = len(group_ops)
                    group_ops.append([])
                    members.append(frozenset(op.group))
                by_id[id(op.group)] = g
            group_ops[g].append(i)
            problem = _op_problem(op, members[g])
            if problem is not None:
                raise ScheduleError(f"StepSchedule: {op.describe()}: {problem}", op=op)
        rank_groups: list[list[int]] = [[] for _ in range(n)]
        for group, g in index.items():
            for x in group:
                rank_groups[x].append(g)
        object.__setattr__(self, "_groups", tuple(index))
        object.__setattr__(self, "_group_ops", tuple(tuple(v) for v in group_ops))
        object.__setattr__(self, "_rank_groups", tuple(tuple(v) for v in rank_groups))

    @property
    def num_ranks(self) -> int:
        """``R * N * T`` schedule ranks."""
        return self.mesh_shape[0] * self.mesh_shape[1] * self.tp_size

    def rank_ops(self, rank: int) -> tuple[Op, ...]:
        """Ops schedule rank ``rank`` issues or runs, in order. O(its ops · log(its groups))."""
        if not 0 <= rank < self.num_ranks:
            raise IndexError(f"rank {rank} is not in 0..{self.num_ranks - 1}")
        lists = [self._group_ops[g] for g in self._rank_groups[rank]]
        ids = lists[0] if len(lists) == 1 else list(heapq.merge(*lists))
        return tuple(self.ops[i] for i in ids)

    def rank_nbytes(self, rank: int, phase: str | None = None) -> int:
        """Bytes charged to ``rank`` (in ledger phase ``phase``, or all phases).

        Raises:
            ValueError: ``phase`` is not a phase dmuon charges.
        """
        if phase is not None and phase not in CHARGED_PHASES:
            raise ValueError(f"phase must be one of {CHARGED_PHASES} or None, got {phase!r}")
        return sum(op.charged_nbytes(rank) for op in self.rank_ops(rank) if phase is None or op.phase == phase)

    def boundary_ops(self, rank: int, boundary: str) -> tuple[Op, ...]:
        """``rank``'s ops of hook boundary ``boundary`` (e.g. the first boundary's, for display).

        Raises:
            ValueError: no op of the schedule names ``boundary``.
        """
        if not any(op.boundary == boundary for op in self.ops):
            known = sorted({op.boundary for op in self.ops if op.boundary})
            raise ValueError(f"no op of this schedule belongs to boundary {boundary!r}; boundaries: {known[:6]}")
        return tuple(op for op in self.rank_ops(rank) if op.boundary == boundary)

    def _pieces(self, coll: Sequence[tuple[int, ...]]) -> list[list[tuple[int, int]]]:
        """Per rank: its collectives as ``(group index, count)`` runs of consecutive ops on one
        group (the replay's input in the symmetric form); ``coll[g]``: group ``g``'s collective
        op ids in order."""
        out = []
        for rank in range(self.num_ranks):
            mine = [(g, coll[g]) for g in self._rank_groups[rank] if coll[g]]
            pieces: list[tuple[int, int]] = []
            if len(mine) == 1:
                pieces.append((mine[0][0], len(mine[0][1])))
            elif mine:
                # merge by op id; runs of one group become one piece
                heads = [(ids[0], g, 0) for g, ids in mine]
                heapq.heapify(heads)
                by_g = dict(mine)
                while heads:
                    _, g, pos = heapq.heappop(heads)
                    ids = by_g[g]
                    nxt = heads[0][0] if heads else None
                    end = len(ids) if nxt is None else bisect.bisect_left(ids, nxt, pos)
                    if pieces and pieces[-1][0] == g:
                        pieces[-1] = (g, pieces[-1][1] + end - pos)
                    else:
                        pieces.append((g, end - pos))
                    if end < len(ids):
                        heapq.heappush(heads, (ids[end], g, end))
            out.append(pieces)
        return out

    def check(self) -> None:
        """Deadlock check by replay (:func:`replay`) of every rank's op list. Raises
        :class:`ScheduleError`."""
        coll = [tuple(i for i in ops if self.ops[i].collective) for ops in self._group_ops]
        canonical = [tuple(self.ops[i] for i in ids) for ids in coll]
        _replay_pieces(self._groups, canonical, self._pieces(coll), None)

    def summary(self, rank: int, *, boundary: str | None = None, max_ops: int | None = None) -> str:
        """``rank``'s ops as a table, one per line, with the bytes charged to it (all its ops,
        or those of hook boundary ``boundary``; at most ``max_ops`` lines)."""
        ops = self.rank_ops(rank) if boundary is None else self.boundary_ops(rank, boundary)
        shown = ops if max_ops is None else ops[:max_ops]
        width = max([len(op.boundary or "") for op in shown] + [8])
        lines = [
            f"{'op':>7}  {'kind':<22}{'phase':<20}{'boundary':<{width + 2}}{'seg':<6}{'root':>5}"
            f"{'elements / FLOP':>22} {'dtype':<10}{'group':<20}{'charged':>16}"
        ]
        for op in shown:
            seg = "" if op.segment is None else str(op.segment) + ("" if op.subsegment is None else f"/{op.subsegment}")
            grp = "all" if op.kind in ("forward", "backward", "recompute") else _fmt_group(op.group)
            size = f"{op.numel:,}" if op.dtype else (f"{op.flops:,} FLOP" if op.flops else "")
            dtype = (op.dtype or "").replace("torch.", "")
            root = "" if op.root is None else str(op.root)
            where = "<root>" if op.boundary == "" else (op.boundary or "")
            lines.append(
                f"{op.id:>7}  {op.kind:<22}{op.phase:<20}{where:<{width + 2}}{seg:<6}{root:>5}"
                f"{size:>22} {dtype:<10}{grp:<20}{op.charged_nbytes(rank):>14,} B"
            )
        if len(shown) < len(ops):
            lines.append(f"{'':>7}  ... {len(ops) - len(shown)} more ops")
        return "\n".join(lines)
