"""Which collective moves each packed buffer (stage 3 of the planner, after the layout):
:func:`choose_collective`, :func:`assign_collectives`.

Per buffer (hook boundary x dtype [x EP degree]) the parameter phases use one of
:data:`~dmuon.plan._layout.buffer_layout.BUFFER_COLLECTIVES`, and the gradient pairs with it
(:data:`~dmuon.plan._rules.GRADIENT_COLLECTIVE`):

=================  ==========================================  ===========================================
kind               forward / backward (Z3)                     gradient
=================  ==========================================  ===========================================
``broadcast``      one broadcast per owner segment (root: the  one SUM-reduce per segment to its holder
                   segment's holder)
``all_gather``     one all-gather of equal slots per group     one reduce-scatter (SUM) of the same slots
=================  ==========================================  ===========================================

A group is a replicate row of ``N`` shard ranks, or an efsdp group of ``N/ep`` for an
expert-parallel buffer; a one-rank group moves nothing, so its buffer stays ``"broadcast"`` in
every mode. HSDP's replicate phases (per sub-segment, over the replicate group) are the same for
both kinds. ``collectives="auto"`` picks ``all_gather`` exactly when the alpha-beta rule
(:func:`~dmuon.plan._cost.seconds.buffer_collective_s`, padding included) prices it strictly below
the broadcasts; ties go to broadcast. Pure.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from dmuon.plan._cost.seconds import buffer_collective_s
from dmuon.plan._layout.buffer_layout import Boundary, BufferLayout, slot_numel_of
from dmuon.plan._records.collective_records import CollectiveSettings

__all__ = ["CollectiveChoice", "choose_collective", "with_collective", "assign_collectives"]


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class CollectiveChoice:
    """The collective of one buffer and why: ``kind``; the modelled seconds per step of its
    shard phases as broadcasts and as all-gathers (``broadcast_s``, ``all_gather_s``); the slot
    an all-gather would use; ``reason`` in words."""

    kind: str
    broadcast_s: float
    all_gather_s: float
    slot_numel: int
    group_size: int
    reason: str


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
    """The collective of ``buf`` under ``settings`` (module docstring)."""
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
    if k < 2:
        kind, reason = "broadcast", "one rank per group: nothing moves"
    elif settings.mode != "auto":
        kind, reason = settings.mode, f"forced by collectives={settings.mode!r}"
    elif t_a < t_b:
        kind, reason = "all_gather", "auto: all-gather modelled faster"
    else:
        kind, reason = "broadcast", "auto: broadcasts modelled no slower"
    return CollectiveChoice(kind=kind, broadcast_s=t_b, all_gather_s=t_a, slot_numel=slot, group_size=k, reason=reason)


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
