"""The plan's collective settings: :class:`CollectiveSettings` (``compile(collectives=...)``).

Which collective moves each packed buffer is recorded per buffer
(:attr:`~dmuon.plan._layout.buffer_layout.BufferLayout.collective`); this record keeps how the plan
chose: the mode and the two numbers of the ``"auto"`` rule. It is part of the JSON and so of
the fingerprint. Plans read from JSON without it (format ``dmuon.plan/1``, written before the
choice existed) get the default record: ``mode="broadcast"``, every buffer broadcast.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from dmuon.plan import _rules as _rules

__all__ = ["CollectiveSettings"]


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class CollectiveSettings:
    """How :func:`dmuon.plan.compile` chose each buffer's collective.

    Attributes:
        mode: ``"broadcast"`` (every buffer: one broadcast per owner segment, the gradient one
            reduce per segment), ``"all_gather"`` (every buffer whose group has >= 2 ranks: one
            all-gather over equal slots, the gradient one reduce-scatter) or ``"auto"`` (per
            buffer, the cheaper under the alpha-beta rule of
            :func:`dmuon.plan._cost.seconds.buffer_collective_s`, ties to broadcast).
        latency_s: alpha, seconds per algorithm step of one collective (``"auto"``).
        bandwidth_Bps: B, bytes per second of the link (``"auto"``).

    The defaults (``mode="broadcast"``, :data:`~dmuon.plan._rules.COLLECTIVE_LATENCY_S`,
    :data:`~dmuon.plan._rules.COLLECTIVE_BANDWIDTH_BPS`) are what a plan without the record
    means; such a plan's JSON omits it and keeps the ``dmuon.plan/1`` format.
    """

    mode: str = "broadcast"
    latency_s: float = _rules.COLLECTIVE_LATENCY_S
    bandwidth_Bps: float = _rules.COLLECTIVE_BANDWIDTH_BPS

    def __post_init__(self) -> None:
        if self.mode not in _rules.COLLECTIVE_MODES:
            raise ValueError(f"collectives must be one of {_rules.COLLECTIVE_MODES}, got {self.mode!r}")
        for name, low_ok in (("latency_s", True), ("bandwidth_Bps", False)):
            v = getattr(self, name)
            if (
                isinstance(v, bool)
                or not isinstance(v, (int, float))
                or not math.isfinite(v)
                or v < 0
                or (v == 0 and not low_ok)
            ):
                raise ValueError(
                    f"CollectiveSettings.{name} must be a finite number {'>= 0' if low_ok else '> 0'}, got {v!r}"
                )
            object.__setattr__(self, name, float(v))

    @property
    def is_default(self) -> bool:
        """True for the record a ``dmuon.plan/1`` plan means (its JSON omits it)."""
        return self == CollectiveSettings()

    def describe(self) -> str:
        return (
            f"collectives={self.mode!r} (auto rule: alpha {self.latency_s * 1e6:g} us per collective step, "
            f"B {self.bandwidth_Bps / 1e9:g} GB/s)"
        )

    def to_dict(self) -> dict[str, Any]:
        return {"mode": self.mode, "latency_s": self.latency_s, "bandwidth_Bps": self.bandwidth_Bps}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CollectiveSettings:
        return cls(mode=d["mode"], latency_s=d["latency_s"], bandwidth_Bps=d["bandwidth_Bps"])
