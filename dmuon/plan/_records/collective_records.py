"""The plan's collective settings: :class:`CollectiveSettings` (``compile(collectives=...)``).

Which collective moves each packed buffer is recorded per buffer
(:attr:`~dmuon.plan._layout.buffer_layout.BufferLayout.collective`); this record keeps how the plan
chose: the mode, the numbers of the ``"auto"`` rule and the link record they came from. It is part
of the JSON and so of the fingerprint. Plans read from JSON without it (format ``dmuon.plan/1``,
written before the choice existed) get the default record: ``mode="broadcast"``, every buffer
broadcast. Plans written before the link record (``dmuon.plan/2``) read as the ``"nccl"`` record's
numbers for every kind, which is what they used.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from dmuon.plan import _rules as _rules

__all__ = ["CollectiveSettings"]

#: ``link`` of settings whose numbers the caller gave (``collective_latency_s`` /
#: ``collective_bandwidth_Bps``) rather than a record of :data:`~dmuon.plan._rules.COLLECTIVE_LINKS`
CUSTOM_LINK = "custom"


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class CollectiveSettings:
    """How :func:`dmuon.plan.compile` chose each buffer's collective.

    Attributes:
        mode: ``"broadcast"`` (every buffer: one broadcast per owner segment, the gradient one
            reduce per segment), ``"all_gather"`` (every buffer whose group has >= 2 ranks: one
            all-gather over equal slots, the gradient one reduce-scatter) or ``"auto"`` (per
            buffer, the cheaper under the alpha-beta rule of
            :func:`dmuon.plan._cost.seconds.buffer_collective_s`, ties to broadcast).
        latency_s: alpha, seconds per algorithm step of one broadcast / reduce (``"auto"``).
        bandwidth_Bps: B, bytes per second of a broadcast / reduce (``"auto"``).
        all_gather_latency_s, all_gather_bandwidth_Bps: alpha and B of an all-gather /
            reduce-scatter; None (default) = ``latency_s`` / ``bandwidth_Bps`` (one pair for
            every kind, as the ``"nccl"`` record and every plan before the link record).
        link: the record the numbers came from: a key of
            :data:`~dmuon.plan._rules.COLLECTIVE_LINKS` (``"nccl"``, the default; ``"gloo"``) or
            ``"custom"`` (numbers the caller gave).

    The defaults (``mode="broadcast"``, the ``"nccl"`` record's numbers) are what a plan without
    the record means; such a plan's JSON omits it and keeps the ``dmuon.plan/1`` format.
    """

    mode: str = "broadcast"
    latency_s: float = _rules.COLLECTIVE_LATENCY_S
    bandwidth_Bps: float = _rules.COLLECTIVE_BANDWIDTH_BPS
    all_gather_latency_s: float | None = None
    all_gather_bandwidth_Bps: float | None = None
    link: str = "nccl"

    def __post_init__(self) -> None:
        if self.mode not in _rules.COLLECTIVE_MODES:
            raise ValueError(f"collectives must be one of {_rules.COLLECTIVE_MODES}, got {self.mode!r}")
        for name, low_ok in (
            ("latency_s", True),
            ("bandwidth_Bps", False),
            ("all_gather_latency_s", True),
            ("all_gather_bandwidth_Bps", False),
        ):
            v = getattr(self, name)
            if v is None and name.startswith("all_gather"):
                continue
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
        if self.link not in _rules.COLLECTIVE_LINKS and self.link != CUSTOM_LINK:
            raise ValueError(
                f"CollectiveSettings.link must be one of {(*_rules.COLLECTIVE_LINKS, CUSTOM_LINK)}, got {self.link!r}"
            )

    @property
    def gather_latency_s(self) -> float:
        """alpha of an all-gather / reduce-scatter (``all_gather_latency_s`` or ``latency_s``)."""
        return self.latency_s if self.all_gather_latency_s is None else self.all_gather_latency_s

    @property
    def gather_bandwidth_Bps(self) -> float:
        """B of an all-gather / reduce-scatter (``all_gather_bandwidth_Bps`` or ``bandwidth_Bps``)."""
        return self.bandwidth_Bps if self.all_gather_bandwidth_Bps is None else self.all_gather_bandwidth_Bps

    @property
    def is_default(self) -> bool:
        """True for the record a ``dmuon.plan/1`` plan means (its JSON omits it)."""
        return self == CollectiveSettings()

    @property
    def has_link_fields(self) -> bool:
        """True when the record needs the ``dmuon.plan/3`` JSON (a link other than ``"nccl"`` or
        separate all-gather numbers)."""
        return self.link != "nccl" or self.all_gather_latency_s is not None or self.all_gather_bandwidth_Bps is not None

    def link_source(self) -> str:
        """Where the numbers come from, in words: the record's name and source, or "given"."""
        if self.link == CUSTOM_LINK:
            return "numbers given to dmuon.plan.compile (collective_latency_s / collective_bandwidth_Bps)"
        return f"link record {self.link!r}: {_rules.COLLECTIVE_LINKS[self.link].source}"

    def rule_numbers(self) -> str:
        """The auto rule's numbers in words (one pair, or a pair per family)."""
        tree = f"alpha {self.latency_s * 1e6:g} us per collective step, B {self.bandwidth_Bps / 1e9:g} GB/s"
        if (self.gather_latency_s, self.gather_bandwidth_Bps) == (self.latency_s, self.bandwidth_Bps):
            return tree
        return (
            f"broadcast / reduce {tree}; all-gather / reduce-scatter alpha {self.gather_latency_s * 1e6:g} us, "
            f"B {self.gather_bandwidth_Bps / 1e9:g} GB/s"
        )

    def describe(self) -> str:
        return f"collectives={self.mode!r} (auto rule: {self.rule_numbers()}; {self.link_source()})"

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"mode": self.mode, "latency_s": self.latency_s, "bandwidth_Bps": self.bandwidth_Bps}
        if self.all_gather_latency_s is not None:
            d["all_gather_latency_s"] = self.all_gather_latency_s
        if self.all_gather_bandwidth_Bps is not None:
            d["all_gather_bandwidth_Bps"] = self.all_gather_bandwidth_Bps
        if self.link != "nccl":
            d["link"] = self.link
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CollectiveSettings:
        """Absent ``all_gather_*`` / ``link`` (``dmuon.plan/2``): the same pair for every kind, the
        ``"nccl"`` record."""
        return cls(
            mode=d["mode"],
            latency_s=d["latency_s"],
            bandwidth_Bps=d["bandwidth_Bps"],
            all_gather_latency_s=d.get("all_gather_latency_s"),
            all_gather_bandwidth_Bps=d.get("all_gather_bandwidth_Bps"),
            link=d.get("link", "nccl"),
        )
