"""All-gathered buffers on this rank (:class:`_GatherBuffer`: the gathered tensor whose slots the
non-held segments view, the reduce-scatter buffers) and the views an owner reads its reduced
gradients from (:class:`_Owned`, :func:`_owned_views`, for a broadcast segment's reduce buffer and
an all-gathered buffer's received slot alike). :mod:`dmuon.exec._runtime.packed_buffers` builds them from
the plan's layouts; the segments they point to are its ``_Segment`` records (duck-typed here)."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from dmuon.exec._runtime.packed_buffers import _Segment, _SubSeg

__all__ = ["_GatherBuffer", "_Owned", "_owned_views"]


@dataclasses.dataclass(eq=False)
class _Owned:
    """A sub-segment this rank owns: views of its segment's reduce buffer (built once, valid
    across the buffer's storage being released and regrown)."""

    sub: _SubSeg
    values: torch.Tensor  # reduce_buf[sub.offset_in_seg : + sub.numel]
    flags: torch.Tensor  # reduce_buf[sub.flags_offset_in_seg : + len(sub.slots)]


def _owned_views(seg: _Segment, buf: torch.Tensor) -> list[_Owned]:
    """The :class:`_Owned` views of ``buf`` (a reduce buffer laid out as the segment) for the
    sub-segments of ``seg`` this rank owns (none unless it holds ``seg``)."""
    me = dist.get_rank()
    return [
        _Owned(
            sub=sub,
            values=buf[sub.offset_in_seg : sub.offset_in_seg + sub.numel],
            flags=buf[sub.flags_offset_in_seg : sub.flags_offset_in_seg + len(sub.slots)],
        )
        for sub in seg.subs
        if seg.held and sub.owner_global_rank == me
    ]


@dataclasses.dataclass(eq=False)
class _GatherBuffer:
    """An all-gathered buffer of one boundary on this rank (the plan's ``BufferLayout`` with
    ``collective="all_gather"``): ``k`` slots of ``slot_numel`` elements, slot ``j`` holding the
    segment of shard coordinate ``group_shards[j]`` (or padding) and, in its last element, that
    rank's step code.

    ``gathered``: the ``k * slot_numel`` wire-dtype output of the forward / backward all-gather;
    the non-held segments' wires are views of their slots, so its storage is grown before and
    released after each use (as a broadcast segment's). Gradient: ``rs_in`` (``k`` slots of the
    packed gradients and presence flags, reduce dtype) is reduce-scattered into ``rs_out`` (this
    rank's slot, SUMmed), the held segment's ``reduce_buf``; both are released once the
    averages are out.
    """

    key: str
    slot_numel: int
    group_shards: tuple[int, ...]
    my_slot: int
    gathered: torch.Tensor
    segments: list  # per slot: its _Segment, or None (a shard rank owning nothing here)
    reduce_dtype: torch.dtype
    resident: bool = False
    rs_in: torch.Tensor | None = None
    rs_out: torch.Tensor | None = None
    reduce_inflight: bool = False

    @property
    def k(self) -> int:
        return len(self.group_shards)

    @property
    def held(self) -> "_Segment | None":
        """This rank's own segment in the buffer (None when it owns nothing here)."""
        return self.segments[self.my_slot]

    def slot(self, j: int) -> torch.Tensor:
        """Slot ``j`` of the gathered tensor (a view)."""
        return self.gathered[j * self.slot_numel : (j + 1) * self.slot_numel]

    def codes(self) -> torch.Tensor:
        """The step code of every slot, slot order."""
        return self.gathered.view(self.k, self.slot_numel)[:, self.slot_numel - 1]

    def grow(self) -> None:
        """Regrow the gathered storage (on the compute stream, before the all-gather writes it)."""
        g = self.gathered
        g.untyped_storage().resize_(g.numel() * g.element_size())
        self.resident = True
        for seg in self.segments:
            if seg is not None and not seg.held:
                seg.resident = True

    def release(self) -> None:
        self.gathered.untyped_storage().resize_(0)
        self.resident = False
        for seg in self.segments:
            if seg is not None and not seg.held:
                seg.resident = False

    def segment_view(self, j: int, numel: int) -> torch.Tensor:
        """A tensor of its own on the gathered storage: ``numel`` elements at slot ``j``'s start
        (a non-held segment's wire)."""
        g = self.gathered
        return torch.empty(0, dtype=g.dtype, device=g.device).set_(
            g.untyped_storage(), g.storage_offset() + j * self.slot_numel, (numel,), (1,)
        )

    def reduce_buffers(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(rs_in, rs_out)`` with their storage grown; built once on the gathered tensor's
        device (the held segment's ``reduce_buf`` and owned views point into ``rs_out``)."""
        dev = self.gathered.device
        if self.rs_in is None or self.rs_in.device != dev:
            self.rs_in = torch.empty(self.k * self.slot_numel, dtype=self.reduce_dtype, device=dev)
            self.rs_out = torch.empty(self.slot_numel, dtype=self.reduce_dtype, device=dev)
            held = self.held
            if held is not None:
                held.reduce_buf = self.rs_out
                held.owned = _owned_views(held, self.rs_out)
        else:
            for t in (self.rs_in, self.rs_out):
                t.untyped_storage().resize_(t.numel() * t.element_size())
        return self.rs_in, self.rs_out  # type: ignore[return-value]
