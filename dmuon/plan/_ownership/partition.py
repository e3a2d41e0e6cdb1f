r"""Owner assignment: constrained LPT (longest processing time first) over ``R*N`` owner slots
(:func:`lpt_partition`), and owner groups, an item owned by ``k`` slots that each hold a block of
it (:func:`lpt_partition_groups`, ``split="auto"``). The algorithms, their guarantees and proofs:
Note: constrained LPT, Note: owner groups and Note: choosing owner groups (docs/design.md).
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from collections.abc import Callable, Sequence
from fractions import Fraction

import numpy as np

__all__ = ["GroupPartitionResult", "PartitionResult", "lpt_partition", "lpt_partition_groups"]

_INT64_SAFE = 2**62


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class PartitionResult:
    """Result of :func:`lpt_partition`.

    Attributes:
        slots: chosen slot of each item, aligned with the INPUT order.
        loads: total weight per slot, length ``num_replicas * num_shards``.
        bound: ``total / S + max weight`` as an exact fraction ``(numerator, S)``: the proven
            upper bound on ``max(loads)`` is ``numerator / S``.
    """

    slots: tuple[int, ...]
    loads: tuple[int, ...]
    bound: tuple[int, int]

    @property
    def max_load(self) -> int:
        return max(self.loads) if self.loads else 0


def lpt_partition(
    weights: Sequence[int],
    keys: Sequence[str],
    groups: Sequence[str],
    *,
    num_shards: int,
    num_replicas: int = 1,
) -> PartitionResult:
    """Assign each item to one of ``num_replicas * num_shards`` slots (Note: constrained LPT, docs/design.md).

    Args:
        weights: non-negative integer weight per item (unit: whatever the cost model uses).
        keys: unique tie-break key per item (the canonical FQN).
        groups: group key per item (the boundary FQN); spread is preferred within a group.
        num_shards: N, size of the shard mesh dimension.
        num_replicas: R, size of the replicate mesh dimension.

    Returns:
        :class:`PartitionResult` with slots aligned to the input order.

    Raises:
        ValueError: mismatched lengths, duplicate keys, negative weights, non-positive mesh.
    """
    _validate_common(weights, keys, groups, num_shards, num_replicas)
    num_slots = num_shards * num_replicas
    total = sum(int(w) for w in weights)
    w_max = max((int(w) for w in weights), default=0)
    pieces = [(int(w),) for w in weights]
    members, loads = _place(pieces, keys, groups, num_shards=num_shards, num_replicas=num_replicas)
    return PartitionResult(
        slots=tuple(m[0] for m in members),
        loads=tuple(loads),
        bound=(total + num_slots * w_max, num_slots),
    )


# --------------------------------------------------------------------------- owner groups


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class GroupPartitionResult:
    """Result of :func:`lpt_partition_groups`.

    Attributes:
        members: per item, aligned with the INPUT order, the slots of its owner group in block
            order (member ``j`` owns block ``j``); length 1 = an exclusive owner. All members
            of an item share one replicate row (``slot // N``) and have distinct shard
            coordinates (``slot % N``).
        loads: total piece weight per slot, length ``num_replicas * num_shards``.
        bound: the proven upper bound on ``max(loads)`` as an exact fraction
            ``(numerator, denominator)`` (Note: owner groups, docs/design.md).
    """

    members: tuple[tuple[int, ...], ...]
    loads: tuple[int, ...]
    bound: tuple[int, int]

    @property
    def max_load(self) -> int:
        return max(self.loads) if self.loads else 0

    @property
    def group_sizes(self) -> tuple[int, ...]:
        """``k`` per item (input order)."""
        return tuple(len(m) for m in self.members)

    @property
    def num_empty_slots(self) -> int:
        """Slots that own no weight."""
        return sum(1 for x in self.loads if x == 0)


def _validate_common(weights, keys, groups, num_shards, num_replicas) -> None:
    n_items = len(weights)
    if len(keys) != n_items or len(groups) != n_items:
        raise ValueError("weights, keys and groups must have equal lengths")
    if len(set(keys)) != n_items:
        raise ValueError("item keys must be unique")
    if num_shards < 1 or num_replicas < 1:
        raise ValueError(f"mesh must be positive, got R={num_replicas}, N={num_shards}")
    if any(int(w) != w or w < 0 for w in weights):
        raise ValueError("weights must be non-negative integers")


def _place(pieces, keys, groups, *, num_shards, num_replicas, initial_loads=None):
    """One greedy pass (Note: owner groups, docs/design.md), :func:`lpt_partition`'s when every
    item is one piece: items in ``(-largest piece, key)`` order; a 1-piece item as in the LPT step
    (Note: constrained LPT); a ``k``-piece item on the ``k``
    least-loaded slots of the replicate row whose resulting maximum is smallest (ties: lowest
    row), its largest block on the least-loaded slot. Returns ``(members, loads)``.
    ``initial_loads``: per slot, weight placed before this pass (expert-parallel ranges placed
    by their own structure); None = all zero.

    State: ``key[s] = load[s] * S + s``, so one argmin / partition over ``key`` orders slots by
    load with ties by lowest index (all keys distinct)."""
    n_items = len(pieces)
    N, R = num_shards, num_replicas
    S = N * R
    total = sum(sum(p) for p in pieces)
    w_max = max((max(p) for p in pieces), default=0)
    order = sorted(range(n_items), key=lambda i: (-max(pieces[i]), keys[i]))
    # penalty: a key offset above any reachable key (masked argmin over unused coordinates)
    penalty = (total + w_max + 1) * S
    initial = [0] * S if initial_loads is None else [int(x) for x in initial_loads]
    penalty += max(initial, default=0) * S
    dtype = np.int64 if 2 * penalty < _INT64_SAFE else object
    if initial_loads is None:
        key = np.arange(S, dtype=np.int64).astype(dtype)
    else:
        key = np.array([x * S + s for s, x in enumerate(initial)], dtype=dtype)
    key2d = key.reshape(R, N)  # a view
    # R = 1: a heap of keys finds the k least-loaded slots in O(k log S). It holds every slot's
    # current key exactly once, plus stale older keys (key[v % S] != v: the slot was loaded
    # since), dropped when popped
    key_list = [int(v) for v in key] if R == 1 else None  # the same keys as Python ints (fast reads)
    heap = sorted(key_list) if R == 1 else None
    group_ids: dict[str, int] = {}
    blocked: list[np.ndarray] = []  # per group: key offset, penalty where the coordinate is used
    n_used: list[int] = []

    out: list[tuple[int, ...]] = [()] * n_items
    makespan = max(initial, default=0)
    for i in order:
        p = pieces[i]
        k = len(p)
        gid = group_ids.setdefault(groups[i], len(group_ids))
        if gid == len(blocked):
            blocked.append(np.zeros(S, dtype=dtype))
            n_used.append(0)
        pen = blocked[gid]
        if k == 1:  # the LPT step (Note: constrained LPT, docs/design.md; spread preference)
            w = p[0]
            g = int(np.argmin(key))
            e = g if n_used[gid] == N else int(np.argmin(key + pen))
            load_e, load_g = int(key[e]) // S, int(key[g]) // S
            c = e if load_e + w <= max(makespan, load_g + w_max) else g
            key[c] += w * S
            if heap is not None and w:  # (a zero weight leaves the slot's entry valid)
                key_list[c] += w * S
                heapq.heappush(heap, key_list[c])
            makespan = max(makespan, load_e + w if c == e else load_g + w)
            slots = (c,)
            member = slots
        else:
            # block order: largest block first (ties: lower block), onto ascending loads
            block_order = sorted(range(k), key=lambda j: (-p[j], j))
            desc = [p[j] for j in block_order]
            if heap is not None:
                lowest: list[int] = []
                while len(lowest) < k:
                    v = heapq.heappop(heap)
                    if key_list[v % S] == v:
                        lowest.append(v)
                slots = tuple(v % S for v in lowest)
                for v, s, d in zip(lowest, slots, desc):
                    nv = v + d * S
                    key_list[s] = nv
                    heapq.heappush(heap, nv)
                key[list(slots)] = np.array([key_list[s] for s in slots], dtype=dtype)
                makespan = max(makespan, max(key_list[s] for s in slots) // S)
            else:
                desc = np.array(desc, dtype=dtype)
                part = np.partition(key2d, k - 1, axis=1)[:, :k] if k < N else key2d.copy()
                part = np.sort(part, axis=1)
                peaks = (part // S + desc[None, :]).max(axis=1)
                r = int(np.argmin(peaks))  # ties: lowest row
                slots_arr = (part[r] % S).astype(np.int64)
                key[slots_arr] += desc * S
                makespan = max(makespan, int(peaks[r]))
                slots = tuple(int(s) for s in slots_arr)
            m = [0] * k
            for s, j in zip(slots, block_order):
                m[j] = s
            member = tuple(m)
        if R == 1:
            for s in slots:
                if pen[s] == 0:
                    pen[s] = penalty
                    n_used[gid] += 1
        else:
            row_view = pen.reshape(R, N)
            for s in slots:
                c = s % N
                if row_view[0, c] == 0:
                    row_view[:, c] = penalty
                    n_used[gid] += 1
        out[i] = member
    return out, [int(x) // S for x in key]


def lpt_partition_groups(
    weights: Sequence[int],
    piece_weights: Callable[[int, int], tuple[int, ...]],
    max_split: Sequence[int],
    keys: Sequence[str],
    groups: Sequence[str],
    *,
    num_shards: int,
    num_replicas: int = 1,
    split: str | int = "auto",
    slack: float = 0.25,
    initial_loads: Sequence[int] | None = None,
) -> GroupPartitionResult:
    """Assign each item to an owner group of ``k`` slots (Note: owner groups, docs/design.md).

    Args:
        weights: non-negative integer weight per item, unsplit.
        piece_weights: ``(item index, k) -> k`` non-negative integer weights of the item's
            blocks when split ``k`` ways, in block order. Not called with ``k = 1`` (the piece
            is ``weights[i]``).
        max_split: per item, the largest ``k`` allowed, ``1 <= max_split[i] <= num_shards``.
        keys: unique tie-break key per item (the canonical FQN).
        groups: group key per item (the boundary FQN); spread is preferred within a group.
        num_shards: N. num_replicas: R.
        split: ``"auto"`` (choose ``k`` per item) or an int ``k >= 1``: every item uses
            ``min(k, max_split[i])``. ``split=1`` gives exactly :func:`lpt_partition`'s slots.
        slack: ``"auto"``'s target is ``max(loads) <= (1 + slack) * sum(weights) / (R*N)``
            (raised to the largest piece of an item that cannot get under it).
        initial_loads: per slot (``replicate*N + shard``), weight already placed there (the
            expert-parallel ranges, placed by their own structure first); ``loads`` include
            it, the target and the bound count it as placed weight (``T`` = pieces + initial;
            the bound is at least the largest initial load, and with groups on one replicate row
            whose initial loads differ by more than the largest piece it is the ``N/(N-K+1)``
            form: Note: owner groups, "Guarantee"). None: all zero.

    Returns:
        :class:`GroupPartitionResult`, members aligned to the input order.

    Raises:
        ValueError: as :func:`lpt_partition`; a bad ``max_split``, ``split`` or ``slack``; a
            ``piece_weights`` answer of the wrong length or with negative or non-integer weights.
    """
    _validate_common(weights, keys, groups, num_shards, num_replicas)
    n_items = len(weights)
    if len(max_split) != n_items:
        raise ValueError("max_split must have one entry per item")
    for i, m in enumerate(max_split):
        if int(m) != m or not 1 <= m <= num_shards:
            raise ValueError(
                f"max_split[{i}] = {m} for {keys[i]!r}: must be an integer in [1, num_shards={num_shards}] "
                f"(an owner group lies in one replicate row, on distinct shard coordinates)"
            )
    if not (isinstance(slack, (int, float)) and slack >= 0):
        raise ValueError(f"slack must be a non-negative number, got {slack!r}")
    weights = [int(w) for w in weights]
    S = num_shards * num_replicas
    if initial_loads is not None:
        initial_loads = [int(x) for x in initial_loads]
        if len(initial_loads) != S or any(x < 0 for x in initial_loads):
            raise ValueError(f"initial_loads must hold {S} non-negative integers, one per slot")
    preload = sum(initial_loads) if initial_loads is not None else 0
    cache: dict[tuple[int, int], tuple[int, ...]] = {}

    def pieces_of(i: int, k: int) -> tuple[int, ...]:
        if k == 1:
            return (weights[i],)
        got = cache.get((i, k))
        if got is None:
            got = tuple(piece_weights(i, k))
            if len(got) != k or any(int(x) != x or x < 0 for x in got):
                raise ValueError(
                    f"piece_weights({i}, {k}) for {keys[i]!r} returned {got!r}: expected {k} non-negative integers"
                )
            got = tuple(int(x) for x in got)
            cache[(i, k)] = got
        return got

    def run(ks):
        pieces = [pieces_of(i, k) for i, k in enumerate(ks)]
        members, loads = _place(
            pieces, keys, groups, num_shards=num_shards, num_replicas=num_replicas, initial_loads=initial_loads
        )
        return GroupPartitionResult(
            members=tuple(members),
            loads=tuple(loads),
            bound=_group_bound(
                pieces,
                num_shards,
                num_replicas,
                preload=preload,
                max_initial=max(initial_loads or [0]),
                min_initial=min(initial_loads or [0]),
            ),
        )

    if isinstance(split, bool) or not (split == "auto" or (isinstance(split, int) and split >= 1)):
        raise ValueError(f"split must be 'auto' or an int >= 1, got {split!r}")
    if split != "auto":
        return run([min(int(split), int(m)) for m in max_split])
    return _auto(weights, keys, pieces_of, max_split, run, num_shards, num_replicas, Fraction(slack), preload=preload)


def result_bound(ks, pieces_of, num_shards: int, num_replicas: int) -> tuple[int, int]:
    return _group_bound([pieces_of(i, k) for i, k in enumerate(ks)], num_shards, num_replicas)


def _group_bound(
    pieces, num_shards: int, num_replicas: int, preload: int = 0, max_initial: int = 0, min_initial: int = 0
) -> tuple[int, int]:
    """The proven bound on the makespan of :func:`_place` (Note: owner groups, docs/design.md),
    an exact fraction: ``T/S + W`` without groups, or for ``R = 1`` when the initial loads differ
    by at most ``W``; else ``N/(N-K+1) * T/S + W``, ``K`` the largest group size. ``T`` = total
    piece weight plus the initial loads' sum ``preload``, ``W`` = largest piece; the bound is at
    least the largest initial load ``max_initial`` (a slot may start above every average)."""
    N, R = num_shards, num_replicas
    S = N * R
    total = sum(sum(p) for p in pieces) + preload
    w_max = max((max(p) for p in pieces), default=0)
    K = max((len(p) for p in pieces), default=1)
    if K == 1 or (R == 1 and max_initial - min_initial <= w_max):
        num, den = total + S * w_max, S
    else:
        den = S * (N - K + 1)
        num = total * N + w_max * den
    return (max_initial, 1) if max_initial * den > num else (num, den)


def _pieces_lower_bound(pieces, num_slots: int) -> int:
    """A lower bound on ``max(load)`` of ANY placement of these pieces on ``num_slots`` slots:
    the largest piece, the mean, and pigeonhole (of the ``j*S + 1`` largest pieces some slot
    holds ``j + 1``, so at least the ``j + 1`` smallest of them), ``j = 1, 2, 3``."""
    flat = np.sort(np.fromiter((x for p in pieces for x in p), dtype=object if _huge(pieces) else np.int64))[::-1]
    if len(flat) == 0:
        return 0
    total = int(flat.sum())
    lb = max(int(flat[0]), -(-total // num_slots))
    for j in (1, 2, 3):
        top = j * num_slots + 1
        if len(flat) < top:
            break
        lb = max(lb, int(flat[top - 1 - j : top].sum()))
    return lb


def _huge(pieces) -> bool:
    return sum(sum(p) for p in pieces) >= _INT64_SAFE


def _auto(
    weights,
    keys,
    pieces_of,
    max_split,
    run,
    num_shards,
    num_replicas,
    slack,
    max_runs: int = 12,
    max_levels: int = 64,
    preload: int = 0,
):
    """``split="auto"`` (Note: choosing owner groups, docs/design.md): lower a piece cap level by
    level from "nothing split", splitting the items with the largest piece to the smallest
    ``k`` under the cap, and return the first placement that meets the target."""
    n_items = len(weights)
    S = num_shards * num_replicas
    total = sum(weights) + preload
    limit = (1 + slack) * total  # a placement meets the target iff max_load * S <= limit

    def meets(res) -> bool:
        return res.max_load * S <= limit

    results: dict[tuple[int, ...], GroupPartitionResult] = {}

    def result(ks) -> GroupPartitionResult:
        got = results.get(ks)
        if got is None:
            got = results[ks] = run(list(ks))
        return got

    def jump(cap):
        """Every item above ``cap`` at the smallest k whose largest piece is under it."""
        ks = [1] * n_items
        largest = list(weights)
        for i, w in enumerate(weights):
            if w > cap:
                ks[i] = _smallest_k_under(i, w, int(max_split[i]), cap, pieces_of)
                largest[i] = max(pieces_of(i, ks[i]))
        return ks, largest

    # Levels above the target cannot meet it (their largest piece exceeds it): the scan starts
    # with every item above the target split to the smallest k under it; with no item above it,
    # the first level is plain LPT (nothing split).
    ks, largest = jump(limit / S)
    floor = max(largest, default=0)
    if floor * S > limit:  # an item that may not split (far enough) stays above the target:
        limit = Fraction(floor * S)  # that is the target then, and nothing else splits for it
        ks, largest = jump(limit / S)
    heap = [(-largest[i], i) for i in range(n_items) if ks[i] < max_split[i] and largest[i] > 0]
    heapq.heapify(heap)
    fixed_max = max((largest[i] for i in range(n_items) if not (ks[i] < max_split[i] and largest[i] > 0)), default=0)
    runs = 0
    for _ in range(max_levels):
        top = max(fixed_max, -heap[0][0] if heap else 0)
        if top * S <= limit:
            pieces = [pieces_of(i, k) for i, k in enumerate(ks)]
            if _pieces_lower_bound(pieces, S) * S <= limit:
                res = result(tuple(ks))
                runs += 1
                if meets(res):
                    return _fill_empty_slots(tuple(ks), result, meets, pieces_of, max_split, weights, keys)
                if runs >= max_runs:
                    break
        if not heap:
            break
        # next level: every item whose largest piece is the current maximum, split to the
        # smallest k whose largest piece is below it
        level = -heap[0][0]
        while heap and -heap[0][0] == level:
            _, i = heapq.heappop(heap)
            m, w = int(max_split[i]), weights[i]
            k = max(ks[i] + 1, min(m, -(-w // level)))
            while k < m and max(pieces_of(i, k)) >= level:
                k += 1
            ks[i] = k
            largest[i] = max(pieces_of(i, k))
            if k < m and largest[i] > 0:
                heapq.heappush(heap, (-largest[i], i))
            else:
                fixed_max = max(fixed_max, largest[i])
    # the level scan gave up (max_runs / max_levels): the cap at which the proven bound meets
    # the target, halved until it does (or the pieces cannot get smaller)
    cap = Fraction(slack * total, S)
    ks_g = tuple(ks)
    for _ in range(8):
        ks_g = tuple(_smallest_k_under(i, weights[i], int(max_split[i]), cap, pieces_of) for i in range(n_items))
        num, den = _group_bound([pieces_of(i, k) for i, k in enumerate(ks_g)], num_shards, num_replicas)
        if num * S <= limit * den or cap <= 1:
            break
        cap /= 2
    res = result(ks_g)
    if meets(res):
        return _fill_empty_slots(ks_g, result, meets, pieces_of, max_split, weights, keys)
    return min(results.values(), key=lambda r: (r.max_load, sum(len(m) for m in r.members)))


def _smallest_k_under(i, w, m, cap, pieces_of) -> int:
    """The smallest ``k >= ceil(w / cap)``, ``<= m``, whose largest piece is ``<= cap``."""
    if w <= cap or m == 1:
        return 1
    if cap <= 0:
        return m
    k = min(m, max(2, math.ceil(w / cap)))
    while k < m and max(pieces_of(i, k)) > cap:
        k += 1
    return k


def _fill_empty_slots(ks, result, meets, pieces_of, max_split, weights, keys, rounds: int = 3):
    """Split further (one more block each, items with the largest blocks first) while slots own
    nothing and the target still holds; the first run that breaks the target or does not reduce
    the empty slots ends it."""
    best = result(ks)
    for _ in range(rounds):
        empty = best.num_empty_slots
        if empty == 0:
            break
        cand = sorted(
            (i for i, k in enumerate(ks) if k < max_split[i] and weights[i] > 0 and k > 1),
            key=lambda i: (-max(pieces_of(i, ks[i])), keys[i]),
        )
        if not cand:
            break
        new = list(ks)
        for i in cand[:empty]:
            new[i] += 1
        trial = result(tuple(new))
        if not meets(trial) or trial.num_empty_slots >= empty:
            break
        ks, best = tuple(new), trial
    return best
