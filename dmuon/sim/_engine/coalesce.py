r"""The cost of a coalesced group of broadcasts / reduces: :func:`coalesced_collective_s`.

The serial (default) and concurrent (uncalibrated) models: Note: coalesced collectives
(docs/design.md).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from dmuon.sim._engine.hardware import Hardware, collective_s, group_link

__all__ = ["coalesced_collective_s"]


def coalesced_collective_s(
    hw: Hardware, kind: str, group: Sequence[int], nbytes: Sequence[float], roots: Sequence[int]
) -> float:
    """Seconds of ``m`` broadcasts / reduces (``kind``) on ``group``, payloads ``nbytes[i]`` per
    rank and roots ``roots[i]``, issued as one coalesced call (Note: coalesced collectives,
    ``hw.coalesce_model``, ``hw.coalesced_op_s``). A measured curve of ``kind`` is not a model
    of coalescing: there each call keeps its own time, summed."""
    if kind not in ("broadcast", "reduce"):
        raise ValueError(f"only broadcasts and reduces are coalesced, got {kind!r}")
    k, m = len(group), len(nbytes)
    if hw._curve_index and hw._curve_index.get(kind):  # type: ignore[union-attr]
        return sum(collective_s(hw, kind, group, b) for b in nbytes)
    if k <= 1:
        return hw.launch_s
    link = group_link(hw, group)
    op_s = link.latency_s if hw.coalesced_op_s is None else hw.coalesced_op_s
    if hw.coalesce_model == "serial":
        moved = float(sum(nbytes))
    else:  # every rank receives (sends) the payloads it is not the root of, all at once
        total = float(sum(nbytes))
        own: dict[int, float] = {}
        for b, r in zip(nbytes, roots):
            own[r] = own.get(r, 0.0) + b
        moved = total - (min(own.get(x, 0.0) for x in group))
    return hw.launch_s + math.ceil(math.log2(k)) * link.latency_s + moved / link.bandwidth_Bps + (m - 1) * op_s
