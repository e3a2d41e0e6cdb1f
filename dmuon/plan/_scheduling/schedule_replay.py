"""The deadlock check of a step, by replay.

:func:`replay` checks per-rank op lists for deadlock freedom the way collectives match at run
time: the ``i``-th collective a rank issues on a group is matched with the ``i``-th of every
other member, must agree on kind, root, dtype and size, and completes only when every member
has reached it. ``compile`` runs it on the nominal step;
:meth:`~dmuon.plan._scheduling.step_schedule.StepSchedule.check` on any (the symmetric form, by
:func:`_replay_pieces`). :func:`_group_problem` and :func:`_op_problem` are the checks of one op
that the replay and ``StepSchedule`` share.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from dmuon.plan._scheduling.ops import OP_KINDS, ROOTED_KINDS, Op, ScheduleError, _fmt_group

if TYPE_CHECKING:
    from dmuon.plan._scheduling.step_schedule import StepSchedule

__all__ = [
    "replay",
    "programs_of",
]


def replay(programs: Sequence[Sequence[Op]]) -> None:
    """Deadlock check of explicit per-rank op lists (``programs[rank]``), by replay.

    Every rank runs its list with blocking collectives; local ops never block. The ``i``-th
    collective a rank issues on a group (a tuple of ranks) is matched with the ``i``-th one of
    every other member, as process groups match collectives at run time; it completes when every
    member has reached it. Runs in O(ranks + groups + collectives) batches.

    Raises:
        ScheduleError: a rank issues an op on a group it is not in; members disagree on a
            collective (kind, root, dtype, numel); or no rank can proceed: the message names
            the first stuck rank's op and the cycle of waiting ranks (or the member that ends
            its step without reaching the collective).
    """
    index: dict[tuple[int, ...], int] = {}
    per_rank: list[list[tuple[int, int]]] = []
    member_ops: dict[tuple[int, int], list[Op]] = {}
    n = len(programs)
    valid_groups: set = set()
    for rank, prog in enumerate(programs):
        pieces: list[tuple[int, int]] = []
        for op in prog:
            _check_op(op, rank, n, valid_groups)
            if not op.collective:
                continue
            g = index.setdefault(op.group, len(index))
            member_ops.setdefault((g, rank), []).append(op)
            if pieces and pieces[-1][0] == g:
                pieces[-1] = (g, pieces[-1][1] + 1)
            else:
                pieces.append((g, 1))
        per_rank.append(pieces)
    _replay_pieces(tuple(index), None, per_rank, member_ops)


def _group_problem(group: Any, num_ranks: int) -> str | None:
    """Why ``group`` is not a tuple of distinct ranks in ``0..num_ranks-1`` (None if it is)."""
    if (
        type(group) is not tuple
        or not group
        or len(set(group)) != len(group)
        or any(type(x) is not int or not 0 <= x < num_ranks for x in group)
    ):
        return f"group {group!r} is not a tuple of distinct ranks in 0..{num_ranks - 1}"
    return None


def _op_problem(op: Op, members: frozenset | None = None) -> str | None:
    """Why ``op`` (on a valid group) cannot run: an unknown kind, a root outside its group or on
    a kind without one, a negative size, a collective without a dtype (None if it can).
    ``members``: ``frozenset(op.group)`` when the caller has it (membership in O(1))."""
    if op.kind not in OP_KINDS:
        return f"unknown kind {op.kind!r} (one of {OP_KINDS})"
    if op.kind in ROOTED_KINDS and op.root not in (op.group if members is None else members):
        return f"its root {op.root!r} is not a member of its group {_fmt_group(op.group)}"
    if op.kind not in ROOTED_KINDS and op.root is not None:
        return f"{op.kind} takes no root, got {op.root!r}"
    if type(op.numel) is not int or op.numel < 0:
        return f"numel must be an int >= 0, got {op.numel!r}"
    if op.collective and op.dtype is None:
        return "a collective needs a dtype"
    return None


def _check_op(op: Any, rank: int, num_ranks: int, valid_groups: set) -> None:
    """One entry of ``rank``'s program, on its own (:func:`_group_problem`, membership,
    :func:`_op_problem`); ``valid_groups`` memoises groups already found valid."""
    if not isinstance(op, Op):
        raise ScheduleError(f"rank {rank}'s program holds {op!r}, not a dmuon.plan.Op", rank=rank)
    problem = None
    if op.group not in valid_groups:
        problem = _group_problem(op.group, num_ranks)
        if problem is None:
            valid_groups.add(op.group)
    if problem is None and rank not in op.group:
        problem = f"it is on group {_fmt_group(op.group)}, which rank {rank} is not in"
    if problem is None:
        problem = _op_problem(op)
    if problem is not None:
        raise ScheduleError(f"rank {rank} issues {op.describe()}: {problem}", rank=rank, op=op)


def _replay_pieces(
    groups: Sequence[tuple[int, ...]],
    canonical: Sequence[Sequence[Op]] | None,
    pieces: Sequence[Sequence[tuple[int, int]]],
    member_ops: dict[tuple[int, int], list[Op]] | None,
) -> None:
    """Core replay: ``pieces[rank]`` = runs ``(group index, count)``; the ops are either the
    same canonical list per group for every member (``canonical[g]``) or per member
    (``member_ops[(g, rank)]``, checked for agreement)."""
    num_ranks = len(pieces)
    piece = [0] * num_ranks
    left = [p[0][1] if p else 0 for p in pieces]
    done = [0] * len(groups)  # collectives completed per group
    at: list[set[int]] = [set() for _ in groups]
    for rank, p in enumerate(pieces):
        if p:
            at[p[0][0]].add(rank)
    ready = [g for g, group in enumerate(groups) if len(at[g]) == len(group)]
    while ready:
        g = ready.pop()
        group = groups[g]
        if len(at[g]) != len(group):
            continue
        k = min(left[x] for x in group)
        if member_ops is not None:
            _check_agreement(g, group, done[g], k, member_ops)
        done[g] += k
        for x in group:
            left[x] -= k
            if left[x] == 0:
                at[g].discard(x)
                piece[x] += 1
                if piece[x] < len(pieces[x]):
                    h, count = pieces[x][piece[x]]
                    left[x] = count
                    at[h].add(x)
                    if len(at[h]) == len(groups[h]):
                        ready.append(h)
        if len(at[g]) == len(group):
            ready.append(g)
    stuck = [x for x in range(num_ranks) if piece[x] < len(pieces[x])]
    if not stuck:
        return

    def current(x: int) -> tuple[int, Op | None]:
        h = pieces[x][piece[x]][0]
        ops = canonical[h] if canonical is not None else member_ops.get((h, x), [])  # type: ignore[union-attr]
        return h, (ops[done[h]] if done[h] < len(ops) else None)

    first = stuck[0]
    chain = [first]
    seen = {first: 0}
    lines = []
    while True:
        x = chain[-1]
        h, op = current(x)
        waiting = [y for y in groups[h] if y not in at[h]]
        y = waiting[0]
        desc = op.describe() if op is not None else "a collective"
        if piece[y] >= len(pieces[y]):
            lines.append(
                f"rank {x} waits at {desc} on group {_fmt_group(groups[h])} for rank {y}, "
                f"which ends its step without issuing it (a missing collective)"
            )
            raise ScheduleError(
                "deadlock: no rank can proceed\n  " + "\n  ".join(lines), rank=first, op=current(first)[1], cycle=()
            )
        hy, opy = current(y)
        lines.append(
            f"rank {x} waits at {desc} on group {_fmt_group(groups[h])} for rank {y}, "
            f"which waits on group {_fmt_group(groups[hy])}"
        )
        if y in seen:
            cycle = tuple(chain[seen[y] :]) + (y,)
            raise ScheduleError(
                "deadlock: no rank can proceed; cycle of waiting ranks "
                + " -> ".join(map(str, cycle))
                + "\n  "
                + "\n  ".join(lines),
                rank=first,
                op=current(first)[1],
                cycle=cycle,
            )
        seen[y] = len(chain)
        chain.append(y)


def _check_agreement(g: int, group: tuple[int, ...], start: int, k: int, member_ops: dict) -> None:
    ref_rank = group[0]
    ref = member_ops[(g, ref_rank)]
    for x in group[1:]:
        mine = member_ops[(g, x)]
        for i in range(start, start + k):
            a, b = ref[i], mine[i]
            if a is b or a.signature() == b.signature():
                continue
            fields = [
                f
                for f, u, v in zip(("kind", "group", "root", "dtype", "numel"), a.signature(), b.signature())
                if u != v
            ]
            raise ScheduleError(
                f"collective #{i} on group {_fmt_group(group)}: rank {ref_rank} issues {a.describe()} but rank {x} "
                f"issues {b.describe()} (they differ in {', '.join(fields)}): the collective would hang or corrupt data",
                rank=x,
                op=b,
            )


def programs_of(sched: StepSchedule) -> list[tuple[Op, ...]]:
    """Explicit per-rank op lists of a schedule (for :func:`replay`, or to edit in tests)."""
    return [sched.rank_ops(r) for r in range(sched.num_ranks)]
