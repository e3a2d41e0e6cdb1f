r"""Equal slots for all-gathered buffers: a boundary's expert ranges re-placed by water-fill
(:func:`water_fill`, :func:`equal_slots`).

The water-fill, what it guarantees and when :func:`equal_slots` adopts it: Note: equal slots
(docs/design.md).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from dmuon.plan._cost import weights as _weights
from dmuon.plan._layout.buffer_layout import _build_buffer, _entry_items, round_up, slot_numel_of
from dmuon.plan._layout.collective_rule import choose_collective, with_collective
from dmuon.plan._records.collective_records import CollectiveSettings
from dmuon.plan._records.owners import ExpertOwners, Owner

__all__ = [
    "subsegment_numel",
    "water_fill",
    "equal_slots",
    "water_filled_owners",
    "water_filled_buffer",
    "even_split_owners",
    "in_place_stacks",
]


def subsegment_numel(numels: Sequence[int], align_numel: int) -> int:
    """Elements of a sub-segment holding entries of ``numels`` (any order): ``round_up(sum
    round_up(numel) + len(numels))`` (entries aligned, one flag each); 0 without entries."""
    if not numels:
        return 0
    a = align_numel
    return round_up(sum(round_up(n, a) for n in numels) + len(numels), a)


def _fill(S, dense, stacks, num_shards, align_numel, row, start=0):
    """Per stack ``[(shard, experts), ...]`` if the sequential fill with slot ``S`` (shards visited
    from ``start`` on, cyclically) places every expert, else None."""
    a = align_numel
    out: list[list[tuple[int, int]]] = [[] for _ in stacks]
    i, done = 0, 0  # current stack, experts of it placed
    for s in [(start + j) % num_shards for j in range(num_shards)]:
        subs = dense.get(s, {})
        others = sum(subsegment_numel(v, a) for r, v in subs.items() if r != row)
        mine = list(subs.get(row, ()))
        while i < len(stacks):
            pe, E = stacks[i]
            capa = ((S - 1 - others) // a) * a  # the row's sub-segment may round up to this
            room = capa - sum(round_up(n, a) for n in mine) - (len(mine) + 1)
            c = min(E - done, ((room // a) * a) // pe) if room > 0 else 0
            if c <= 0:
                break
            mine.append(c * pe)
            out[i].append((s, c))
            done += c
            if done < E:
                break  # this shard is full for the stack
            i, done = i + 1, 0
        if others + subsegment_numel(mine, a) + 1 > S:
            return None  # its dense matrices alone do not fit
    return out if i == len(stacks) else None


def water_fill(
    dense: dict[int, dict[int, list[int]]],
    stacks: Sequence[tuple[int, int]],
    *,
    num_shards: int,
    align_numel: int,
    row: int = 0,
    start: int = 0,
) -> tuple[int, list[list[tuple[int, int]]]]:
    """The smallest slot (Note: equal slots, docs/design.md) and each stack's ranges ``[(shard, experts), ...]``.

    Args:
        dense: ``{shard: {replicate: [numel, ...]}}``, the fixed entries of each sub-segment.
        stacks: ``(elements per expert, experts)`` per stack, in plan order.
        row: the replicate coordinate the ranges are owned in.
        start: the first shard coordinate visited (then ``start + 1``, ... cyclically).
    """
    a = align_numel
    hi = a
    while _fill(hi, dense, stacks, num_shards, a, row, start) is None:
        hi *= 2
    lo = 0  # multiples of a: lo infeasible (or 0), hi feasible
    lo_m, hi_m = lo // a, hi // a
    while hi_m - lo_m > 1:
        mid = (lo_m + hi_m) // 2
        if _fill(mid * a, dense, stacks, num_shards, a, row, start) is None:
            lo_m = mid
        else:
            hi_m = mid
    S = hi_m * a
    return S, _fill(S, dense, stacks, num_shards, a, row, start)  # type: ignore[return-value]


def equal_slots(
    specs: Sequence[Any],
    owners: Sequence[Any],
    boundary_of: Sequence[str],
    boundaries: Sequence[Any],
    settings: CollectiveSettings,
    *,
    mesh_shape: tuple[int, int],
    align_numel: int,
    itemsizes: Callable[[str], tuple[int, int]],
    reshard_after_forward: bool,
    cost_model: str,
    segment_lengths: Sequence[int],
    refill: bool = False,
) -> tuple[Any, ...]:
    """``owners`` with the expert ranges of every buffer where water-fill pays re-placed (module
    docstring); ``boundaries``: the layouts of ``owners``. Pure; ``owners`` unchanged when
    ``settings.mode`` is ``"broadcast"`` or no buffer holds an expert stack without EP.

    ``refill``: the stacks were placed by the balanced fill
    (:func:`~dmuon.plan._ownership.level_fill.fill_rows`); once the water-filled buffers are chosen,
    the stacks of the other buffers are filled again on top of them, so the total per rank stays
    level (an all-gathered buffer gives every rank one slot of it)."""
    R, N = mesh_shape
    owners = list(owners)
    if settings.mode == "broadcast" or N < 2:
        return tuple(owners)
    index = {spec.fqn: i for i, spec in enumerate(specs)}
    loads = [0] * (R * N)
    for spec, owner in zip(specs, owners):
        for rank, w in _weights.owner_weights(spec, owner, cost_model, segment_lengths):
            loads[rank] += w
    adopted: set[int] = set()
    start = 0
    for b in boundaries:
        for buf in b.buffers:
            if buf.ep != 1:
                continue
            fqns = sorted({e.fqn for e in buf.entries()}, key=index.__getitem__)  # plan order
            stack_idx = [index[f] for f in fqns if specs[index[f]].experts is not None]
            if not stack_idx:
                continue
            for i in stack_idx:  # the stacks leave their ranks' loads while a row is chosen
                for rank, w in _weights.owner_weights(specs[i], owners[i], cost_model, segment_lengths):
                    loads[rank] -= w
            row = min(range(R), key=lambda r: (sum(loads[r * N : (r + 1) * N]), r))
            alt = water_filled_owners(buf, specs, index, N, align_numel, row, start)
            even = even_split_owners(buf, specs, index, N, row)
            if even is not None and _slot(buf, even, specs, owners, fqns, index, align_numel) <= _slot(
                buf, alt, specs, owners, fqns, index, align_numel
            ):
                alt = even  # as small a slot, and single-expert ranges received in place where E = N
            if _pays(buf, alt, specs, owners, fqns, index, settings, N, align_numel, itemsizes, reshard_after_forward):
                for i, owner in alt.items():
                    owners[i] = owner
                adopted.update(alt)
                last = [
                    o for i in stack_idx for o in (alt[i].members if isinstance(alt[i], ExpertOwners) else (alt[i],))
                ]
                start = (last[-1].shard + 1) % N  # the next buffer's fill starts where this one ended
            for i in stack_idx:
                for rank, w in _weights.owner_weights(specs[i], owners[i], cost_model, segment_lengths):
                    loads[rank] += w
    if refill and adopted:
        from dmuon.plan._ownership.assign import expert_owner
        from dmuon.plan._ownership.level_fill import fill_rows

        rest = [i for i, spec in enumerate(specs) if spec.experts is not None and i not in adopted]
        loads = [0] * (R * N)
        for i, (spec, owner) in enumerate(zip(specs, owners)):
            if i in rest:
                continue
            for rank, w in _weights.owner_weights(spec, owner, cost_model, segment_lengths):
                loads[rank] += w
        per_expert = [_weights.param_weight(specs[i], cost_model) // specs[i].num_experts for i in rest]
        ranges, _ = fill_rows([(w, specs[i].num_experts) for w, i in zip(per_expert, rest)], loads, R)
        for i, rng in zip(rest, ranges):
            owners[i] = expert_owner(rng, N)
    return tuple(owners)


def water_filled_owners(
    buf: Any,
    specs: Sequence[Any],
    index: dict[str, int],
    num_shards: int,
    align_numel: int,
    row: int = 0,
    start: int = 0,
) -> dict[int, Any]:
    """The owners of ``buf``'s expert stacks (by spec index) when water-fill re-places them
    around the buffer's dense entries on replicate row ``row``, shards visited from ``start``
    (Note: equal slots, docs/design.md)."""
    N = num_shards
    fqns = sorted({e.fqn for e in buf.entries()}, key=index.__getitem__)
    stack_idx = [index[f] for f in fqns if specs[index[f]].experts is not None]
    stack_set = set(stack_idx)
    dense: dict[int, dict[int, list[int]]] = {}
    for e in buf.entries():
        if index[e.fqn] not in stack_set:
            dense.setdefault(e.owner.shard, {}).setdefault(e.owner.replicate, []).append(e.numel)
    shapes = [(specs[i].numel // specs[i].num_experts, specs[i].num_experts) for i in stack_idx]
    _, ranges = water_fill(dense, shapes, num_shards=N, align_numel=align_numel, row=row, start=start)
    alt = {}
    for i, rng in zip(stack_idx, ranges):
        members = tuple(Owner.at(row * N + s, N) for s, _ in rng)
        alt[i] = members[0] if len(members) == 1 else ExpertOwners(members=members, sizes=tuple(c for _, c in rng))
    return alt


def water_filled_buffer(
    buf: Any, specs: Sequence[Any], owners: Sequence[Any], num_shards: int, align_numel: int, row: int = 0
) -> Any:
    """``buf`` laid out with its stacks water-filled (:func:`water_filled_owners`): the layout
    whose slot and padding an all-gather of equal slots would have."""
    index = {spec.fqn: i for i, spec in enumerate(specs)}
    alt = water_filled_owners(buf, specs, index, num_shards, align_numel, row)
    fqns = sorted({e.fqn for e in buf.entries()}, key=index.__getitem__)
    return _layout(buf, alt, specs, owners, fqns, index, align_numel)


def _layout(buf, alt, specs, owners, fqns, index, a):
    items = []
    for fqn in fqns:
        i = index[fqn]
        spec = specs[i]
        items += _entry_items(fqn, spec.local_shape, spec.local_numel, alt.get(i, owners[i]))
    return _build_buffer(buf.dtype, items, a)


def even_split_owners(buf: Any, specs: Sequence[Any], index: dict[str, int], num_shards: int, row: int = 0):
    """The owners of ``buf``'s stacks (by spec index) when every stack is cut into ``N`` ranges of
    ``E / N`` experts on shards ``0..N-1`` in order, or None: only for a buffer of stacks alone
    (no dense entry) whose every ``E`` is a multiple of ``N``. Every segment then holds the same
    experts of every stack (equal slots), and with ``E = N`` each range is one expert at one slot
    offset: received in place (:func:`in_place_stacks`)."""
    N = num_shards
    fqns = sorted({e.fqn for e in buf.entries()}, key=index.__getitem__)
    if any(specs[index[f]].experts is None or specs[index[f]].num_experts % N for f in fqns):
        return None
    out = {}
    for f in fqns:
        i = index[f]
        size = specs[i].num_experts // N
        members = tuple(Owner.at(row * N + s, N) for s in range(N))
        out[i] = members[0] if N == 1 else ExpertOwners(members=members, sizes=(size,) * N)
    return out


def _slot(buf, alt, specs, owners, fqns, index, a) -> int:
    return slot_numel_of(_layout(buf, alt, specs, owners, fqns, index, a), a)


def _in_place_count(buf, a) -> int:
    return len(in_place_stacks(with_collective(buf, "all_gather", a)))


def _pays(buf, alt, specs, owners, fqns, index, settings, N, a, itemsizes, z3) -> bool:
    """Whether the buffer laid out with the stacks' owners ``alt`` beats its current layout:
    ``"all_gather"``: a smaller slot; ``"auto"``: slots padding at most
    :data:`~dmuon.plan._rules.ALL_GATHER_MAX_PADDING` and a best kind modelled strictly faster.
    On a tie, more stacks received in place (:func:`in_place_stacks`) wins."""
    new = _layout(buf, alt, specs, owners, fqns, index, a)
    wire, red = itemsizes(buf.dtype)
    kw = dict(num_shards=N, align_numel=a, wire_itemsize=wire, reduce_itemsize=red, reshard_after_forward=z3)
    before = choose_collective(buf, settings, **kw)
    after = choose_collective(new, settings, **kw)
    tie_wins = _in_place_count(new, a) > _in_place_count(buf, a)
    if settings.mode == "all_gather":
        return after.slot_numel < before.slot_numel or (after.slot_numel == before.slot_numel and tie_wins)
    if after.kind != "all_gather":  # padded beyond the cap (or slower): the broadcast layout stays
        return False
    t_after = min(after.broadcast_s, after.all_gather_s)
    t_before = min(before.broadcast_s, before.all_gather_s)
    return t_after < t_before or (t_after == t_before and tie_wins)


def in_place_stacks(buf: Any) -> dict[str, dict[int, tuple[int, int, int]]]:
    """Expert stacks of an all-gathered buffer whose compute tensor can be a strided view of the
    gathered tensor itself (received in place, nothing assembled): per stack FQN and EP coordinate
    ``c`` (0 without EP) ``(first slot, slot step, offset in the slot)``.

    A stack's compute tensor ``(E_c, a, b)`` (this EP coordinate's experts) is such a view exactly
    when each of its ranges holds ONE expert and the ranges sit at the same offset of slots
    ``first, first + step, ...`` in expert order: expert ``i`` is then ``(first + i*step) * slot +
    offset``, dim-0 stride ``step * slot``. Ranges of several experts cannot be one view (their
    experts are contiguous within a slot and a slot apart between ranges); neither can a
    broadcast buffer's segments (separate tensors). Every other grouped matrix is assembled."""
    if buf.collective != "all_gather":
        return {}
    seg_offset = {seg.shard: seg.offset for seg in buf.segments}
    blocks: dict[str, dict[int, list[tuple[int, int, int, int]]]] = {}
    for e in buf.entries():
        if e.block is None or len(e.shape) != 3:  # expert ranges only (owner-group blocks are 2-D)
            continue
        c = e.owner.shard % buf.ep
        where = (e.block, e.shape[0], buf.slot_index(e.owner.shard), e.offset - seg_offset[e.owner.shard])
        blocks.setdefault(e.fqn, {}).setdefault(c, []).append(where)
    out: dict[str, dict[int, tuple[int, int, int]]] = {}
    for fqn, per in blocks.items():
        views = {}
        for c, ranges in per.items():
            ranges.sort()
            slots = [s for _, _, s, _ in ranges]
            step = slots[1] - slots[0] if len(slots) > 1 else 1
            if (
                any(size != 1 for _, size, _, _ in ranges)
                or len({o for *_, o in ranges}) != 1
                or step < 1
                or any(b - a != step for a, b in zip(slots, slots[1:]))
            ):
                break
            views[c] = (slots[0], step, ranges[0][3])
        else:
            out[fqn] = views
    return out
