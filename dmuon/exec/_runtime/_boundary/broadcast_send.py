"""A hook boundary's unshard collectives, this rank's side: :func:`write_broadcast_source` (what
an owner sends: its segment's wire, written from the masters) and :func:`send_broadcasts` (the
phase's scheduled broadcasts and all-gathers, with the step codes, posted async)."""

from __future__ import annotations

import torch

from dmuon.exec._comm import collective_calls as C
from dmuon.exec._runtime.streams import _on_stream

__all__ = ["write_broadcast_source", "send_broadcasts"]


def write_broadcast_source(seg) -> None:
    """The owner's broadcast source: ``seg``'s wire (broadcast dtype) holding its masters (a cast
    under mixed precision; nothing to do where the masters are the wire)."""
    if seg.master is not seg.wire:
        with torch.no_grad():
            seg.wire.copy_(seg.master)


def send_broadcasts(boundary, bops, code: float, stream) -> list:
    """Post ``boundary``'s broadcasts / all-gathers ``bops`` (one phase, from the plan's schedule)
    on ``stream`` (None: the current one): every held segment's source
    (:func:`write_broadcast_source`) with the step ``code`` in its flag slots, every all-gathered
    buffer's own slot (the held segment, in place, and the code), then the collectives in order
    (:func:`_issue`). Returns the works; the storage of every received segment is grown already."""
    with _on_stream(stream):
        for seg in boundary.segments:
            if seg.held:
                write_broadcast_source(seg)
                if bops and seg.gather is None:  # the flag slots carry (step, phase, forward); receivers compare
                    for sub in seg.subs:
                        seg.wire[sub.flags_offset_in_seg : sub.flags_offset_in_seg + len(sub.slots)] = code
        for gb in boundary.gathers:  # the own slot: the held segment (all-gathered in place) and the code
            own = gb.slot(gb.my_slot)
            if gb.held is not None:
                own[: gb.held.numel].copy_(gb.held.wire)
            own[gb.slot_numel - 1] = code
        return _issue(bops, boundary.comm_ctx)


def _issue(bops, ctx) -> list:
    """Post ``bops`` in order (async): an all-gather per all-gathered buffer (this rank's slot
    of the gathered tensor is its input, in place), and each run of consecutive broadcasts
    on one group as one coalesced group where the backend coalesces
    (:func:`~dmuon.exec._comm.collective_calls.broadcast_many`). Returns the works."""
    works: list = []
    i = 0
    while i < len(bops):
        b = bops[i]
        gb = b.gather
        if gb is not None:
            works.append(
                C.all_gather_into(gb.gathered, gb.slot(gb.my_slot), group=b.group, phase=b.op.phase, async_op=True)
            )
            i += 1
            continue
        j = i + 1
        while j < len(bops) and bops[j].gather is None and bops[j].group is b.group:
            j += 1
        items = [(x.segment.wire, x.root) for x in bops[i:j]]
        works += C.broadcast_many(items, group=b.group, phase=b.op.phase, coalesce=ctx.coalesces(b.group))
        i = j
    return works
