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

One replicate row only (``R = 1``): a stack's ranges must lie in one row, which a fill across
rows cannot promise; on HSDP meshes the planner keeps the weight-capped ranges placed by LPT.
Pure; exact integer arithmetic (fractions for the level).
"""

from __future__ import annotations

from collections.abc import Sequence
from fractions import Fraction

__all__ = ["water_level", "fill_ranges"]


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
    for w, E in stacks:
        if int(w) != w or w < 0 or int(E) != E or E < 1:
            raise ValueError(f"fill_ranges: bad stack (weight per expert {w!r}, experts {E!r})")
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
