r"""Balanced expert ranges: every rank filled to one water level (:func:`water_level`,
:func:`fill_ranges`).

Owners hold whole matrices and whole experts. Once the dense matrices have their owners (the
constrained LPT of :mod:`dmuon.plan._ownership.partition`), the expert stacks fill the ranks up to
one level, in plan order::

    L = the water level: sum over slots of max(0, L - load[s]) = total stack weight
    cap[s] = max(0, L - load[s]); C_s = cap[0] + ... + cap[s]      (cumulative capacity)
    walk the experts of every stack in plan order, the slots in order 0, 1, ..., S-1:
        slot s takes the next expert while (weight placed before it) + (its weight) / 2 <= C_s
        (the last slot with capacity takes every expert left)

Each stack's ranges are then contiguous in expert order, on increasing (so distinct) slots.

**Guarantee.** ``L <= T/S`` (``T`` the total weight, dense included: at ``L = T/S`` the
unclipped capacities already sum to the stack weight). A slot's cumulative placement differs
from ``C_s`` by at most half the weight of the expert that straddles it, so every slot that
takes experts ends within ``L ± w`` (``w`` the heaviest expert), and a slot whose dense load is
at or above ``L`` takes none. So ``max(load) <= max(max dense load, L + w) <= T/S + W`` with
``W`` the largest piece (a dense matrix or an expert): the LPT bound of the partition holds.
With the dense LPT's own bound, ``max(load) <= T/S + max(largest dense matrix, w)``.

**Not guaranteed.** That a boundary's ranges lie on few ranks (a layer of ``E`` experts spans
about ``layer weight / L + 1`` ranks, often fewer than the ranges of a weight-capped cut);
balance of any one boundary (only the total per rank is levelled; use an all-gathered buffer's
equal slots, :mod:`dmuon.plan._layout.slots`, for per-boundary balance).

HSDP meshes (``R`` replicate rows of ``N`` slots, :func:`item_rows`, :func:`fill_rows`): a
stack's ranges must lie in one row, and the fill levels a row only up to its own mean, so the
rows are balanced first: every whole item (stack or dense matrix) goes to a row by LPT
(heaviest first), the dense matrices of a row to its slots by the constrained LPT, and each row
is filled as above with its stacks in plan order. A row then weighs at most ``T/R + W_item``
(LPT), its level is at most its mean ``<= T/S + W_item/N``, and every slot ends at most
``T/S + W_item/N + W`` (``W_item`` the heaviest stack or matrix, ``W`` the heaviest dense matrix
or expert). With one row it is the fill above.
Pure; exact integer arithmetic (fractions for the level).
"""

from __future__ import annotations

from collections.abc import Sequence
from fractions import Fraction

__all__ = ["water_level", "fill_ranges", "item_rows", "fill_rows"]


def water_level(loads: Sequence[int], fill_weight: int) -> Fraction:
    """The level ``L`` with ``sum(max(0, L - load)) == fill_weight`` (``min(loads)`` when
    ``fill_weight`` is 0)."""
    order = sorted(int(x) for x in loads)
    if not order:
        raise ValueError("water_level: no slots")
    if fill_weight < 0:
        raise ValueError(f"water_level: negative weight {fill_weight}")
    below = 0  # sum of the j lowest loads
    for j, x in enumerate(order):
        # with the j lowest slots under water, the level is (fill + below) / j; valid if <= x
        if j and Fraction(fill_weight + below, j) <= x:
            return Fraction(fill_weight + below, j)
        below += x
    return Fraction(fill_weight + below, len(order))


def fill_ranges(
    stacks: Sequence[tuple[int, int]], loads: Sequence[int]
) -> tuple[list[list[tuple[int, int]]], list[int]]:
    """Fill the slots to the water level with the stacks' experts (module docstring).

    Args:
        stacks: ``(weight per expert, experts)`` per stack, plan order; weights >= 0, experts >= 1.
        loads: weight already on each slot (the dense matrices), slot order.

    Returns:
        ``(ranges, loads)``: per stack its ranges ``[(slot, experts), ...]`` in expert order
        (slots increasing, every range >= 1 expert, the counts summing to the stack's
        experts), and the loads with the stacks added.
    """
    loads = [int(x) for x in loads]
    S = len(loads)
    if S == 0:
        raise ValueError("fill_ranges: no slots")
    _check_stacks("fill_ranges", stacks)
    total = sum(int(w) * int(E) for w, E in stacks)
    level = water_level(loads, total)
    caps = [max(Fraction(0), level - x) for x in loads]
    last = max((s for s in range(S) if caps[s] > 0), default=S - 1)
    ranges: list[list[tuple[int, int]]] = [[] for _ in stacks]
    placed = 0  # weight placed so far
    cum = Fraction(0)
    i, done = 0, 0  # current stack, experts of it placed
    for s in range(S):
        cum += caps[s]
        if caps[s] == 0 and s != last:
            continue
        while i < len(stacks):
            w, E = int(stacks[i][0]), int(stacks[i][1])
            left = E - done
            if s == last:
                take = left
            elif w == 0:
                take = left  # weightless experts go with the slot that reaches them
            else:
                # the most experts c <= left with placed + (c - 1) w + w/2 <= cum
                room = cum - placed - Fraction(w, 2)
                take = 0 if room < 0 else min(left, int(room // w) + 1)
            if take <= 0:
                break
            ranges[i].append((s, take))
            placed += take * w
            loads[s] += take * w
            done += take
            if done < E:
                break
            i, done = i + 1, 0
        if i == len(stacks):
            break
    return ranges, loads


def item_rows(weights: Sequence[int], num_rows: int, row_loads: Sequence[int] | None = None) -> list[int]:
    """The replicate row of every whole item (a stack or a dense matrix), by LPT: heaviest first
    (ties in input order), each to the row with the least weight (``row_loads`` first, None =
    zero; ties to the lowest row). Every row ends at most ``(row loads + items) / R + W``
    (``W`` the heaviest item: LPT's bound)."""
    R = int(num_rows)
    if R < 1:
        raise ValueError(f"item_rows: {num_rows!r} rows")
    load = [0] * R if row_loads is None else [int(x) for x in row_loads]
    if len(load) != R:
        raise ValueError(f"item_rows: {len(load)} row loads for {R} rows")
    rows = [0] * len(weights)
    for i in sorted(range(len(weights)), key=lambda i: (-int(weights[i]), i)):
        r = min(range(R), key=lambda r: (load[r], r))
        rows[i] = r
        load[r] += int(weights[i])
    return rows


def fill_rows(
    stacks: Sequence[tuple[int, int]], loads: Sequence[int], num_rows: int, rows: Sequence[int] | None = None
) -> tuple[list[list[tuple[int, int]]], list[int]]:
    """:func:`fill_ranges` on ``num_rows`` replicate rows of ``N = len(loads) / num_rows`` slots
    (slot ``= row * N + shard``): each row filled on its own with its whole stacks, in plan
    order (module docstring). Same arguments and result as :func:`fill_ranges`, every stack's
    ranges in one row; ``rows``: the row of every stack, None = :func:`item_rows` of the stacks
    over the rows' ``loads``. One row is :func:`fill_ranges`."""
    _check_stacks("fill_rows", stacks)
    loads = [int(x) for x in loads]
    R = int(num_rows)
    if R < 1 or len(loads) % R:
        raise ValueError(f"fill_rows: {len(loads)} slots do not make {num_rows!r} rows")
    N = len(loads) // R
    if rows is None:
        row_loads = [sum(loads[r * N : (r + 1) * N]) for r in range(R)]
        rows = item_rows([int(w) * int(E) for w, E in stacks], R, row_loads)
    if len(rows) != len(stacks) or any(not 0 <= int(r) < R for r in rows):
        raise ValueError(f"fill_rows: rows {list(rows)} for {len(stacks)} stacks on {R} rows")
    if R == 1:
        return fill_ranges(stacks, loads)
    ranges: list[list[tuple[int, int]]] = [[] for _ in stacks]
    for r in range(R):
        idx = [i for i in range(len(stacks)) if rows[i] == r]
        if not idx:
            continue
        row_ranges, row_loads = fill_ranges([stacks[i] for i in idx], loads[r * N : (r + 1) * N])
        for i, rng in zip(idx, row_ranges):
            ranges[i] = [(r * N + s, c) for s, c in rng]
        loads[r * N : (r + 1) * N] = row_loads
    return ranges, loads


def _check_stacks(name: str, stacks: Sequence[tuple[int, int]]) -> None:
    for w, E in stacks:
        if int(w) != w or w < 0 or int(E) != E or E < 1:
            raise ValueError(f"{name}: bad stack (weight per expert {w!r}, experts {E!r})")
