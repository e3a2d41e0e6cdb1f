"""Packed buffer layouts: one flat buffer per (hook boundary, parameter dtype).

Offsets and sizes are in elements of the buffer. The layout rule (segments, sub-segments,
entries, presence flags, all-gather slots): Note: packed buffer layout (docs/design.md).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

from dmuon.plan._records.fields import _check_int, _check_shape, check_dtype_str
from dmuon.plan._records.owners import ExpertOwners, Owner, OwnerGroup

__all__ = [
    "BUFFER_COLLECTIVES",
    "LayoutEntry",
    "SubSegment",
    "Segment",
    "BufferLayout",
    "Boundary",
    "round_up",
    "build_boundaries",
    "check_buffer_layout",
    "slot_numel_of",
]


#: the collectives a buffer's shard phases may use (:attr:`BufferLayout.collective`); the
#: gradient pairs with them: ``"broadcast"`` with ``"reduce"``, ``"all_gather"`` with ``"reduce_scatter"``
BUFFER_COLLECTIVES = ("broadcast", "all_gather")


def round_up(x: int, align: int) -> int:
    """Smallest multiple of ``align`` that is ``>= x`` (``x >= 0``, ``align >= 1``)."""
    return -(-x // align) * align


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class LayoutEntry:
    """One dedicated parameter inside a buffer.

    Attributes:
        fqn: canonical FQN. owner: its owner. offset: first element, from buffer start.
        numel: elements (``prod(shape)``). shape: logical shape (the view to take).
        block: None for a matrix with one owner; for a matrix owned by an
            :class:`~dmuon.plan._records.owners.OwnerGroup`, the index ``j`` of the block this entry
            holds (``owner`` is member ``j``, ``shape`` the block's shape): a grouped matrix has
            one entry per block, each in its member's segment.
    """

    fqn: str
    owner: Owner
    offset: int
    numel: int
    shape: tuple[int, ...]
    block: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.fqn, str) or not self.fqn:
            raise ValueError(f"LayoutEntry.fqn must be a non-empty str, got {self.fqn!r}")
        if not isinstance(self.owner, Owner):
            raise TypeError(f"LayoutEntry {self.fqn}: owner must be an Owner")
        _check_int("LayoutEntry", "offset", self.offset, 0)
        _check_int("LayoutEntry", "numel", self.numel, 0)
        _check_shape("LayoutEntry", "shape", self.shape)
        if math.prod(self.shape) != self.numel:
            raise ValueError(f"LayoutEntry {self.fqn}: numel {self.numel} != prod(shape {self.shape})")
        if self.block is not None:
            _check_int("LayoutEntry", "block", self.block, 0)

    @property
    def end(self) -> int:
        return self.offset + self.numel

    def to_dict(self) -> dict[str, Any]:
        return {
            "fqn": self.fqn,
            "owner": self.owner.to_dict(),
            "offset": self.offset,
            "numel": self.numel,
            "shape": list(self.shape),
            **(
                {} if self.block is None else {"block": self.block}
            ),  # absent: plans without owner groups keep their JSON
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> LayoutEntry:
        return cls(
            fqn=d["fqn"],
            owner=Owner.from_dict(d["owner"]),
            offset=d["offset"],
            numel=d["numel"],
            shape=tuple(d["shape"]),
            block=d.get("block"),
        )


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class SubSegment:
    """The entries of one owner ``(shard, replicate)`` plus their flags region.

    Attributes:
        owner: owner of every entry. offset: first element, from buffer start.
        numel: elements including padding and flags. entries: plan order.
        flags_offset: first flag element, from buffer start (``len(entries)`` flags).
    """

    owner: Owner
    offset: int
    numel: int
    entries: tuple[LayoutEntry, ...]
    flags_offset: int

    def __post_init__(self) -> None:
        if not isinstance(self.owner, Owner):
            raise TypeError("SubSegment.owner must be an Owner")
        _check_int("SubSegment", "offset", self.offset, 0)
        _check_int("SubSegment", "numel", self.numel, 0)
        _check_int("SubSegment", "flags_offset", self.flags_offset, 0)
        if type(self.entries) is not tuple or not self.entries:
            raise ValueError("SubSegment.entries must be a non-empty tuple")
        cursor = self.offset
        for e in self.entries:
            if not isinstance(e, LayoutEntry):
                raise TypeError("SubSegment.entries must hold LayoutEntry records")
            if e.owner != self.owner:
                raise ValueError(f"SubSegment {self.owner}: entry {e.fqn} has owner {e.owner}")
            if e.offset < cursor:
                raise ValueError(f"SubSegment {self.owner}: entry {e.fqn} overlaps or is out of order")
            cursor = e.end
        if self.flags_offset < cursor:
            raise ValueError(f"SubSegment {self.owner}: flags region overlaps entries")
        if self.flags_offset + len(self.entries) > self.end:
            raise ValueError(f"SubSegment {self.owner}: flags region exceeds the subsegment")

    @property
    def end(self) -> int:
        return self.offset + self.numel

    def to_dict(self) -> dict[str, Any]:
        return {
            "owner": self.owner.to_dict(),
            "offset": self.offset,
            "numel": self.numel,
            "entries": [e.to_dict() for e in self.entries],
            "flags_offset": self.flags_offset,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SubSegment:
        return cls(
            owner=Owner.from_dict(d["owner"]),
            offset=d["offset"],
            numel=d["numel"],
            entries=tuple(LayoutEntry.from_dict(e) for e in d["entries"]),
            flags_offset=d["flags_offset"],
        )


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Segment:
    """Everything shard coordinate ``shard`` broadcasts from one boundary buffer.

    Attributes:
        shard: shard coordinate. offset: first element, from buffer start.
        numel: ``sum(sub.numel)``. subsegments: ordered by ``owner.replicate``, contiguous.
    """

    shard: int
    offset: int
    numel: int
    subsegments: tuple[SubSegment, ...]

    def __post_init__(self) -> None:
        _check_int("Segment", "shard", self.shard, 0)
        _check_int("Segment", "offset", self.offset, 0)
        _check_int("Segment", "numel", self.numel, 0)
        if type(self.subsegments) is not tuple or not self.subsegments:
            raise ValueError("Segment.subsegments must be a non-empty tuple")
        cursor = self.offset
        last_rep = -1
        for sub in self.subsegments:
            if not isinstance(sub, SubSegment):
                raise TypeError("Segment.subsegments must hold SubSegment records")
            if sub.owner.shard != self.shard:
                raise ValueError(f"Segment {self.shard}: subsegment owner {sub.owner} has another shard")
            if sub.owner.replicate <= last_rep:
                raise ValueError(f"Segment {self.shard}: subsegments not strictly ordered by replicate")
            if sub.offset != cursor:
                raise ValueError(f"Segment {self.shard}: subsegments not contiguous at {sub.offset}")
            last_rep = sub.owner.replicate
            cursor = sub.end
        if cursor - self.offset != self.numel:
            raise ValueError(f"Segment {self.shard}: numel {self.numel} != sum of subsegments")

    @property
    def end(self) -> int:
        return self.offset + self.numel

    def to_dict(self) -> dict[str, Any]:
        return {
            "shard": self.shard,
            "offset": self.offset,
            "numel": self.numel,
            "subsegments": [s.to_dict() for s in self.subsegments],
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Segment:
        return cls(
            shard=d["shard"],
            offset=d["offset"],
            numel=d["numel"],
            subsegments=tuple(SubSegment.from_dict(s) for s in d["subsegments"]),
        )


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class BufferLayout:
    """One packed buffer of a boundary: all its dedicated params of storage dtype ``dtype``.

    Attributes:
        dtype: storage dtype string of every entry. numel: total elements.
        segments: ordered by shard, contiguous from 0.
        ep: 1, or the expert-parallel degree of the stacks this buffer holds (``efsdp = N/ep > 1``
            or HSDP): shard ``s`` holds the experts of EP coordinate ``s mod ep``, so segment
            ``s`` is broadcast and reduced over its *efsdp group* only, the shard ranks
            ``s mod ep, s mod ep + ep, ...`` of each replicate row, and exists only on them. The
            offsets stay global (each rank allocates its segments separately). In JSON only
            when > 1.
        collective: how the shard phases move the buffer (the plan's choice, :func:`dmuon.plan.compile`'s
            ``collectives``): ``"broadcast"`` (one broadcast per segment in the forward / backward,
            one SUM-reduce per segment to its holder for the gradient) or ``"all_gather"`` (one
            all-gather over equal *slots* per group and phase, one reduce-scatter over the same
            slots for the gradient). In JSON only when ``"all_gather"``.
        slot_numel: ``"all_gather"`` only (0 otherwise): elements of one slot, ``round_up(largest
            segment + 1, align_numel)``. Slot ``j`` of a group's gathered tensor holds the segment
            of the group's ``j``-th shard coordinate (:meth:`slot_index`) at its start (its
            entries and flags at their offsets relative to the segment), zeros, and the step code
            in its last element; a shard coordinate without a segment has a slot of padding and
            its code. In JSON only when ``"all_gather"``.
    """

    dtype: str
    numel: int
    segments: tuple[Segment, ...]
    ep: int = 1
    collective: str = "broadcast"
    slot_numel: int = 0

    def __post_init__(self) -> None:
        check_dtype_str("BufferLayout", "dtype", self.dtype)
        _check_int("BufferLayout", "numel", self.numel, 0)
        _check_int("BufferLayout", "ep", self.ep, 1)
        if self.collective not in BUFFER_COLLECTIVES:
            raise ValueError(f"BufferLayout.collective must be one of {BUFFER_COLLECTIVES}, got {self.collective!r}")
        _check_int("BufferLayout", "slot_numel", self.slot_numel, 0)
        if (self.collective == "all_gather") != (self.slot_numel > 0):
            raise ValueError(
                f"BufferLayout {self.dtype}: slot_numel must be > 0 exactly for collective='all_gather', got "
                f"{self.slot_numel} with {self.collective!r}"
            )
        if type(self.segments) is not tuple or not self.segments:
            raise ValueError("BufferLayout.segments must be a non-empty tuple")
        cursor = 0
        last_shard = -1
        for seg in self.segments:
            if not isinstance(seg, Segment):
                raise TypeError("BufferLayout.segments must hold Segment records")
            if seg.shard <= last_shard:
                raise ValueError(f"BufferLayout {self.dtype}: segments not strictly ordered by shard")
            if seg.offset != cursor:
                raise ValueError(f"BufferLayout {self.dtype}: segments not contiguous at {seg.offset}")
            last_shard = seg.shard
            cursor = seg.end
        if cursor != self.numel:
            raise ValueError(f"BufferLayout {self.dtype}: numel {self.numel} != sum of segments {cursor}")
        if self.slot_numel and self.slot_numel <= max(seg.numel for seg in self.segments):
            raise ValueError(
                f"BufferLayout {self.dtype}: slot_numel {self.slot_numel} leaves no room for the largest segment "
                "and its step code"
            )

    def subsegments(self) -> tuple[SubSegment, ...]:
        return tuple(sub for seg in self.segments for sub in seg.subsegments)

    def entries(self) -> tuple[LayoutEntry, ...]:
        return tuple(e for seg in self.segments for sub in seg.subsegments for e in sub.entries)

    def to_dict(self) -> dict[str, Any]:
        ep = {"ep": self.ep} if self.ep > 1 else {}  # absent without EP: older plans keep their JSON
        # absent for broadcast buffers: plans without all-gathers keep their JSON
        kind = {"collective": self.collective, "slot_numel": self.slot_numel} if self.collective != "broadcast" else {}
        return {
            "dtype": self.dtype,
            "numel": self.numel,
            "segments": [s.to_dict() for s in self.segments],
            **ep,
            **kind,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> BufferLayout:
        return cls(
            dtype=d["dtype"],
            numel=d["numel"],
            segments=tuple(Segment.from_dict(s) for s in d["segments"]),
            ep=d.get("ep", 1),
            collective=d.get("collective", "broadcast"),
            slot_numel=d.get("slot_numel", 0),
        )

    def group_size(self, num_shards: int) -> int:
        """Shard ranks of one group of the shard phases: ``N``, or ``N/ep`` (an efsdp group)."""
        return num_shards // self.ep

    def slot_index(self, shard: int) -> int:
        """Position of shard coordinate ``shard`` in its group (:meth:`group_shards`): the index
        of its slot in the group's gathered tensor (``"all_gather"``)."""
        return shard // self.ep

    def padding_numel(self, num_shards: int) -> int:
        """Elements an ``"all_gather"`` buffer moves beyond its segments, per replicate row and
        TP coordinate: ``N * slot_numel - numel`` (every shard rank contributes one slot; the
        code trailers count as padding); 0 for ``"broadcast"``."""
        return num_shards * self.slot_numel - self.numel if self.collective == "all_gather" else 0

    @property
    def key(self) -> str:
        """The buffer's name within its boundary (schedule ops carry it): the dtype, with
        ``/ep<k>`` for an expert-parallel buffer (a boundary may hold both of one dtype)."""
        return self.dtype if self.ep == 1 else f"{self.dtype}/ep{self.ep}"

    def group_shards(self, shard: int, num_shards: int) -> tuple[int, ...]:
        """The shard coordinates segment ``shard`` is broadcast and reduced over: the whole row,
        or its efsdp group when ``ep > 1``."""
        return tuple(range(shard % self.ep, num_shards, self.ep))


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Boundary:
    """A hook boundary and its packed buffers.

    Attributes:
        fqn: module FQN whose hooks serve the entries (``""`` = root).
        fallback: True if no boundary ancestor existed and ``hook_boundary_strict=False`` fell
            back to the parameter's own module.
        buffers: one per parameter storage dtype and EP degree (:attr:`BufferLayout.ep`), sorted
            by ``(ep, dtype)``: the dense buffers first.
        local: canonical FQNs of the expert-parallel stacks inside this boundary (plan order):
            dedicated, but each rank's model holds and owns its own experts, so they have no
            buffer entry and move no bytes (:class:`~dmuon.plan._records.owners.ExpertOwners` with
            ``local=True``). In JSON only when non-empty.
    """

    fqn: str
    fallback: bool
    buffers: tuple[BufferLayout, ...]
    local: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.fqn, str):
            raise TypeError(f"Boundary.fqn must be a str, got {self.fqn!r}")
        if type(self.fallback) is not bool:
            raise TypeError("Boundary.fallback must be a bool")
        if type(self.local) is not tuple or any(not isinstance(f, str) for f in self.local):
            raise TypeError(f"Boundary {self.fqn!r}: local must be a tuple of FQNs, got {self.local!r}")
        if type(self.buffers) is not tuple or not (self.buffers or self.local):
            raise ValueError(f"Boundary {self.fqn!r}: buffers must be a non-empty tuple")
        keys = [(b.ep, b.dtype) for b in self.buffers]
        if keys != sorted(set(keys)):
            raise ValueError(f"Boundary {self.fqn!r}: buffers must be unique and sorted by (ep, dtype), got {keys}")

    def entries(self) -> tuple[LayoutEntry, ...]:
        return tuple(e for buf in self.buffers for e in buf.entries())

    def to_dict(self) -> dict[str, Any]:
        local = {"local": list(self.local)} if self.local else {}  # absent without EP: older plans keep their JSON
        return {"fqn": self.fqn, "fallback": self.fallback, "buffers": [b.to_dict() for b in self.buffers], **local}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Boundary:
        return cls(
            fqn=d["fqn"],
            fallback=d["fallback"],
            buffers=tuple(BufferLayout.from_dict(b) for b in d["buffers"]),
            local=tuple(d.get("local", ())),
        )


def check_buffer_layout(buf: BufferLayout, align_numel: int) -> None:
    """Check the alignment rules of Note: packed buffer layout (docs/design.md) (structure is checked by the records).

    Raises:
        ValueError: an entry/flags offset is not a multiple of ``align_numel``, entries are not
            packed as ``round_up`` prescribes, or a subsegment's numel is not
            ``round_up(flags_offset + len(entries) - offset)``.
    """
    a = align_numel
    for seg in buf.segments:
        for sub in seg.subsegments:
            cursor = sub.offset
            for e in sub.entries:
                if e.offset != cursor:
                    raise ValueError(f"buffer {buf.dtype}: entry {e.fqn} at {e.offset}, expected {cursor} (align {a})")
                cursor = round_up(e.end, a)
            if sub.flags_offset != cursor:
                raise ValueError(f"buffer {buf.dtype}: flags of {sub.owner} at {sub.flags_offset}, expected {cursor}")
            expected = round_up(sub.flags_offset + len(sub.entries) - sub.offset, a)
            if sub.numel != expected:
                raise ValueError(f"buffer {buf.dtype}: subsegment {sub.owner} numel {sub.numel}, expected {expected}")
            if sub.offset % a:
                raise ValueError(f"buffer {buf.dtype}: subsegment {sub.owner} offset {sub.offset} not aligned to {a}")
    if buf.collective == "all_gather" and buf.slot_numel != slot_numel_of(buf, a):
        raise ValueError(
            f"buffer {buf.key}: slot_numel {buf.slot_numel}, expected {slot_numel_of(buf, a)} "
            f"(round_up(largest segment + 1 step code, {a}))"
        )


def slot_numel_of(buf: BufferLayout, align_numel: int) -> int:
    """The slot of an all-gathered buffer: ``round_up(largest segment + 1, align_numel)`` elements
    (the segment, padding, and the step code in the last element)."""
    return round_up(max(seg.numel for seg in buf.segments) + 1, align_numel)


def _build_buffer(
    dtype: str, items: Sequence[tuple[str, tuple[int, ...], int, Owner, int | None]], align_numel: int, ep: int = 1
) -> BufferLayout:
    """``items``: ``(fqn, shape, numel, owner, block)`` in plan order (one per block of a
    grouped matrix)."""
    by_shard: dict[int, dict[int, list[tuple[str, tuple[int, ...], int, Owner]]]] = {}
    for item in items:
        owner = item[3]
        by_shard.setdefault(owner.shard, {}).setdefault(owner.replicate, []).append(item)
    cursor = 0
    segments: list[Segment] = []
    for shard in sorted(by_shard):
        seg_offset = cursor
        subs: list[SubSegment] = []
        for rep in sorted(by_shard[shard]):
            members = by_shard[shard][rep]
            sub_offset = cursor
            pos = sub_offset
            entries: list[LayoutEntry] = []
            for fqn, shape, numel, owner, block in members:
                entries.append(LayoutEntry(fqn=fqn, owner=owner, offset=pos, numel=numel, shape=shape, block=block))
                pos = round_up(pos + numel, align_numel)
            flags_offset = pos
            sub_numel = round_up(flags_offset + len(entries) - sub_offset, align_numel)
            subs.append(
                SubSegment(
                    owner=members[0][3],
                    offset=sub_offset,
                    numel=sub_numel,
                    entries=tuple(entries),
                    flags_offset=flags_offset,
                )
            )
            cursor = sub_offset + sub_numel
        segments.append(Segment(shard=shard, offset=seg_offset, numel=cursor - seg_offset, subsegments=tuple(subs)))
    return BufferLayout(dtype=dtype, numel=cursor, segments=tuple(segments), ep=ep)


def _entry_items(fqn: str, shape: tuple[int, ...], numel: int, owner: Any) -> list:
    """The ``(fqn, shape, numel, owner, block)`` items :func:`_build_buffer` lays out for one
    parameter: one, or one per block / range of an owner group / expert owners."""
    if isinstance(owner, (OwnerGroup, ExpertOwners)):
        out = []
        for j, member in enumerate(owner.members):
            block = tuple(owner.block_shape(j, shape))
            out.append((fqn, block, math.prod(block), member, j))
        return out
    return [(fqn, shape, numel, owner, None)]


def build_boundaries(
    items: Sequence[
        tuple[str, tuple[int, ...], int, str, Any, str] | tuple[str, tuple[int, ...], int, str, Any, str, int]
    ],
    boundary_order: Sequence[str],
    fallback: dict[str, bool],
    *,
    align_numel: int,
) -> tuple[Boundary, ...]:
    """Build every boundary's buffers.

    Args:
        items: ``(fqn, shape, numel, dtype, owner, boundary_fqn)`` per dedicated param, plan
            order; ``owner`` an :class:`~dmuon.plan._records.owners.Owner`, or an
            :class:`~dmuon.plan._records.owners.OwnerGroup` / :class:`~dmuon.plan._records.owners.ExpertOwners`
            (one entry per block / range of experts, in its member's segment). An optional 7th
            field: the stack's EP degree when its ranges are owned inside efsdp groups (its
            entries go to a buffer of that :attr:`BufferLayout.ep`); 1 otherwise.
        boundary_order: boundary FQNs in output order (first appearance in ``named_modules()``).
        fallback: boundary FQN -> fallback flag.
        align_numel: alignment in elements (>= 1).
    """
    grouped: dict[str, dict[tuple[int, str], list[tuple[str, tuple[int, ...], int, Owner, int | None]]]] = {}
    local: dict[str, list[str]] = {}
    for item in items:
        fqn, shape, numel, dtype, owner, boundary = item[:6]
        ep = item[6] if len(item) > 6 else 1
        if getattr(owner, "local", False):  # expert parallelism: held by each rank's model, no entry
            local.setdefault(boundary, []).append(fqn)
            grouped.setdefault(boundary, {})
            continue
        if ep > 1:  # ranges of the global stack (E, a, b): entries of the global shape's ranges
            shape = (shape[0] * ep,) + tuple(shape[1:])
        grouped.setdefault(boundary, {}).setdefault((ep, dtype), []).extend(_entry_items(fqn, shape, numel, owner))
    out: list[Boundary] = []
    for bfqn in boundary_order:
        if bfqn not in grouped:
            continue
        buffers = tuple(
            _build_buffer(dtype, grouped[bfqn][(ep, dtype)], align_numel, ep) for ep, dtype in sorted(grouped[bfqn])
        )
        out.append(Boundary(fqn=bfqn, fallback=fallback[bfqn], buffers=buffers, local=tuple(local.get(bfqn, ()))))
    return tuple(out)
