"""Is this tensor a DTensor, and its local tensor: one rule for the planner, the runtime and the
integrations.

A leaf (no dmuon imports) that never imports ``torch.distributed``: the planner is pure
(:mod:`dmuon.plan._model.snapshot` reads TP placements through it) and the runtime asks the same
question the same way. A DTensor is recognised by its public ``device_mesh`` and ``placements``
(what every caller then reads), not by type, so the pure planner needs no import to tell.
"""

from __future__ import annotations

from typing import Any

__all__ = ["is_dtensor", "local_tensor"]


def is_dtensor(t: Any) -> bool:
    """Whether ``t`` is a DTensor (an FSDP2 shard, a TP matrix ...): it carries a device mesh and
    placements."""
    return getattr(t, "placements", None) is not None and getattr(t, "device_mesh", None) is not None


def local_tensor(t: Any) -> Any:
    """The local tensor of a DTensor (this rank's shard), else ``t`` itself."""
    return t.to_local() if is_dtensor(t) else t
