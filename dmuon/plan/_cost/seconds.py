r"""Seconds on the wire of a buffer's shard phases under the alpha-beta rule of
``compile(collectives="auto")``: :func:`broadcast_call_s`, :func:`all_gather_call_s`,
:func:`buffer_collective_s`.

The two link numbers and the per-call formulas: Note: the alpha-beta rule (docs/design.md).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dmuon.plan._layout.buffer_layout import BufferLayout

__all__ = ["broadcast_call_s", "all_gather_call_s", "buffer_collective_s"]


def broadcast_call_s(nbytes: int, group_size: int, latency_s: float, bandwidth_Bps: float) -> float:
    """One broadcast (or reduce) of ``nbytes`` over ``k = group_size`` ranks:
    ``(1 + ceil(log2 k)) * alpha + S / B``; 0 for ``k <= 1``."""
    if group_size <= 1:
        return 0.0
    return (1 + math.ceil(math.log2(group_size))) * latency_s + nbytes / bandwidth_Bps


def all_gather_call_s(slot_nbytes: int, group_size: int, latency_s: float, bandwidth_Bps: float) -> float:
    """One all-gather (or reduce-scatter) of ``k = group_size`` slots of ``slot_nbytes``:
    ``k * alpha + (k - 1) * slot / B``; 0 for ``k <= 1``."""
    if group_size <= 1:
        return 0.0
    return group_size * latency_s + (group_size - 1) * slot_nbytes / bandwidth_Bps


def buffer_collective_s(
    buf: BufferLayout,
    kind: str,
    *,
    num_shards: int,
    slot_numel: int,
    wire_itemsize: int,
    reduce_itemsize: int,
    reshard_after_forward: bool,
    latency_s: float,
    bandwidth_Bps: float,
    all_gather_latency_s: float | None = None,
    all_gather_bandwidth_Bps: float | None = None,
) -> float:
    """Seconds per step of ``buf``'s shard phases as one rank sees them, if moved by ``kind``:
    the forward phase and (``reshard_after_forward``, Z3) the backward phase in the wire dtype,
    and the gradient phase in the reduce dtype.

    ``"broadcast"``: one :func:`broadcast_call_s` per segment of the group (the slowest group of
    an expert-parallel buffer: its efsdp groups run side by side); ``"all_gather"``: one
    :func:`all_gather_call_s` over ``slot_numel``-element slots. Replicate rows and TP
    coordinates run side by side and add nothing. HSDP's replicate phases are per sub-segment
    whatever the kind and are left out. ``latency_s`` / ``bandwidth_Bps`` price broadcasts and
    reduces, ``all_gather_latency_s`` / ``all_gather_bandwidth_Bps`` all-gathers and
    reduce-scatters (None: the same pair; a link record may measure the families apart,
    :data:`dmuon.plan._rules.COLLECTIVE_LINKS`).
    """
    k = buf.group_size(num_shards)
    itemsizes = [wire_itemsize] * (2 if reshard_after_forward else 1) + [reduce_itemsize]
    if kind == "all_gather":
        a = latency_s if all_gather_latency_s is None else all_gather_latency_s
        b = bandwidth_Bps if all_gather_bandwidth_Bps is None else all_gather_bandwidth_Bps
        return sum(all_gather_call_s(slot_numel * isz, k, a, b) for isz in itemsizes)
    if kind != "broadcast":
        raise ValueError(f"unknown buffer collective {kind!r}")
    by_group: dict[int, list[int]] = {}
    for seg in buf.segments:
        by_group.setdefault(seg.shard % buf.ep, []).append(seg.numel)
    return max(
        sum(broadcast_call_s(numel * isz, k, latency_s, bandwidth_Bps) for isz in itemsizes for numel in numels)
        for numels in by_group.values()
    )
