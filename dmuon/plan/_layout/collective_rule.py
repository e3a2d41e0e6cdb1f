"""Which collective moves each packed buffer (stage 3 of the planner, after the layout):
:func:`choose_collective`, :func:`assign_collectives`.

Each kind's phases, the groups, and when ``collectives="auto"`` picks ``all_gather``: Note: the
collective of a buffer (docs/design.md). Pure.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from dmuon.plan import _rules
from dmuon.plan._cost.seconds import buffer_collective_s
from dmuon.plan._layout.buffer_layout import Boundary, BufferLayout, slot_numel_of
from dmuon.plan._records.collective_records import CollectiveSettings

__all__ = [
    "CollectiveChoice",
    "choose_collective",
    "with_collective",
    "assign_collectives",
    "padding_fraction",
    "places_expert_ranges",
]


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class CollectiveChoice:
    """The collective of one buffer and why: ``kind``; the modelled seconds per step of its
    shard phases as broadcasts and as all-gathers (``broadcast_s``, ``all_gather_s``); the slot
    an all-gather would use and the fraction of the gathered tensor its slots would pad
    (``padding``, :func:`padding_fraction`); ``reason`` in words."""

    kind: str
    broadcast_s: float
    all_gather_s: float
    slot_numel: int
    group_size: int
    reason: str
    padding: float = 0.0


def padding_fraction(buf: BufferLayout, num_shards: int, slot_numel: int) -> float:
    """The share of an all-gather's output that is padding: ``(N * slot - numel) / (N * slot)``
    per replicate row (every shard rank contributes one slot of ``slot_numel`` elements; the step
    code trailers count as padding); 0 for an empty slot."""
    total = num_shards * slot_numel
    return (total - buf.numel) / total if total else 0.0


def places_expert_ranges(buf: BufferLayout) -> bool:
    """Whether the planner sizes ``buf``'s segments itself: a buffer without expert parallelism
    that holds an expert stack (a 3-D entry), whose ranges it cuts (:mod:`dmuon.plan._layout.slots`).
    Only such buffers are held to :data:`~dmuon.plan._rules.ALL_GATHER_MAX_PADDING`; the segments
    of the others are whole matrices (or an expert-parallel rank's experts) the rule takes as
    they are."""
    return buf.ep == 1 and any(len(e.shape) == 3 for e in buf.entries())


def choose_collective(
    buf: BufferLayout,
    settings: CollectiveSettings,
    *,
    num_shards: int,
    align_numel: int,
    wire_itemsize: int,
    reduce_itemsize: int,
    reshard_after_forward: bool,
) -> CollectiveChoice:
    """The collective of ``buf`` under ``settings`` (Note: the collective of a buffer, docs/design.md)."""
    k = buf.group_size(num_shards)
    slot = slot_numel_of(buf, align_numel)
    kw = dict(
        num_shards=num_shards,
        slot_numel=slot,
        wire_itemsize=wire_itemsize,
        reduce_itemsize=reduce_itemsize,
        reshard_after_forward=reshard_after_forward,
        latency_s=settings.latency_s,
        bandwidth_Bps=settings.bandwidth_Bps,
        all_gather_latency_s=settings.gather_latency_s,
        all_gather_bandwidth_Bps=settings.gather_bandwidth_Bps,
    )
    t_b = buffer_collective_s(buf, "broadcast", **kw)
    t_a = buffer_collective_s(buf, "all_gather", **kw)
    pad = padding_fraction(buf, num_shards, slot)
    cap = _rules.ALL_GATHER_MAX_PADDING
    if k < 2:
        kind, reason = "broadcast", "one rank per group: nothing moves"
    elif settings.mode != "auto":
        kind, reason = settings.mode, f"forced by collectives={settings.mode!r}"
    elif pad > cap and places_expert_ranges(buf):
        kind, reason = "broadcast", f"auto: its slots would pad {100 * pad:.1f} % > {100 * cap:g} %"
    elif t_a < t_b:
        kind, reason = "all_gather", "auto: all-gather modelled faster"
    else:
        kind, reason = "broadcast", "auto: broadcasts modelled no slower"
    return CollectiveChoice(
        kind=kind, broadcast_s=t_b, all_gather_s=t_a, slot_numel=slot, group_size=k, reason=reason, padding=pad
    )


def with_collective(buf: BufferLayout, kind: str, align_numel: int) -> BufferLayout:
    """``buf`` moved by ``kind`` (its slot set for ``"all_gather"``, cleared otherwise)."""
    slot = slot_numel_of(buf, align_numel) if kind == "all_gather" else 0
    if (buf.collective, buf.slot_numel) == (kind, slot):
        return buf
    return dataclasses.replace(buf, collective=kind, slot_numel=slot)


def assign_collectives(
    boundaries: Sequence[Boundary],
    settings: CollectiveSettings,
    *,
    num_shards: int,
    align_numel: int,
    itemsizes: Callable[[str], tuple[int, int]],
    reshard_after_forward: bool,
) -> tuple[Boundary, ...]:
    """Every buffer of ``boundaries`` with its collective (:func:`choose_collective`);
    ``itemsizes(dtype)`` = ``(wire, reduce)`` bytes per element of a buffer of storage ``dtype``."""
    out = []
    for b in boundaries:
        buffers = []
        for buf in b.buffers:
            wire, red = itemsizes(buf.dtype)
            choice = choose_collective(
                buf,
                settings,
                num_shards=num_shards,
                align_numel=align_numel,
                wire_itemsize=wire,
                reduce_itemsize=red,
                reshard_after_forward=reshard_after_forward,
            )
            buffers.append(with_collective(buf, choice.kind, align_numel))
        out.append(dataclasses.replace(b, buffers=tuple(buffers)))
    return tuple(out)
