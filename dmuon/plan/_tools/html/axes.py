"""The two axes every map of the pages shares: mesh ranks across (:class:`RankAxis`) and hook
boundaries down (:class:`RowAxis`), with the aggregation rule for large plans.

Aggregation (stated on every picture that uses it): past :data:`MAX_COLS` ranks a column holds
``b = ceil(N / (MAX_COLS // R))`` consecutive shard ranks of ONE replicate row (so HSDP replicas
stay apart; with more than ``MAX_COLS // 4`` replicas, ``ceil(R*N / MAX_COLS)`` consecutive mesh
ranks whatever their row); past :data:`MAX_ROWS` boundaries a row holds ``ceil(B / MAX_ROWS)``
consecutive boundaries. An aggregated cell is coloured by its busiest rank (the largest of its
ranks' loads summed over its boundaries), and its ``<title>`` gives the min, mean and max rank.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

__all__ = ["MAX_COLS", "MAX_ROWS", "RankAxis", "RowAxis", "row_label"]

#: most rank columns a map draws
MAX_COLS = 128
#: most boundary rows a map draws
MAX_ROWS = 64


class RankAxis:
    """Rank columns of a map of mesh ``(R, N)``, ``width`` px wide from ``x0``.

    Attributes: ``bins`` (``(first, last)`` mesh ranks of each column, inclusive), ``replica``
    (the replicate row of each column, None when columns mix rows), ``x`` (left edge of each
    column), ``col_w`` (column width, px), ``per_col`` (ranks per column, the largest),
    ``col_of`` (the column of each mesh rank), ``gap`` (px between replicate rows).
    """

    def __init__(self, R: int, N: int, *, x0: float, width: float, max_cols: int = MAX_COLS, max_col_w: int = 40):
        S = R * N
        self.R, self.N = R, N
        by_row = R == 1 or R <= max_cols // 4
        if S <= max_cols:
            per = 1
        elif by_row:
            per = math.ceil(N / max(1, max_cols // R))
        else:
            per = math.ceil(S / max_cols)
        self.per_col = per
        bins: list[tuple[int, int]] = []
        replica: list[int | None] = []
        if by_row:
            for r in range(R):
                for s in range(0, N, per):
                    bins.append((r * N + s, r * N + min(s + per, N) - 1))
                    replica.append(r)
        else:
            for lo in range(0, S, per):
                bins.append((lo, min(lo + per, S) - 1))
                replica.append(None)
        self.bins = bins
        self.replica = replica
        self.by_row = by_row
        self.gap = 4 if (by_row and R > 1) else 0
        n = len(bins)
        self.col_w = max(1, min(max_col_w, int((width - self.gap * (R - 1 if by_row else 0)) // n)))
        self.x: list[float] = []
        x = x0
        for i, r in enumerate(replica):
            if i and r is not None and r != replica[i - 1]:
                x += self.gap
            self.x.append(x)
            x += self.col_w
        self.x0 = x0
        self.x1 = x
        self.col_of = [0] * S
        for i, (lo, hi) in enumerate(bins):
            for rank in range(lo, hi + 1):
                self.col_of[rank] = i

    @property
    def aggregated(self) -> bool:
        return self.per_col > 1

    def __len__(self) -> int:
        return len(self.bins)

    def size(self, i: int) -> int:
        lo, hi = self.bins[i]
        return hi - lo + 1

    def label(self, i: int) -> str:
        """``"rank 5"`` / ``"ranks 8–15"``."""
        lo, hi = self.bins[i]
        return f"rank {lo}" if lo == hi else f"ranks {lo}–{hi}"

    def describe(self, how: str = "coloured by its busiest rank") -> str:
        """The aggregation in words, for the picture's caption ("" when none); ``how``: what a
        column shows of its ranks."""
        if not self.aggregated:
            return ""
        where = "of one replicate row " if self.by_row and self.R > 1 else ""
        return f"{self.R * self.N:,} ranks > {MAX_COLS}: a column is {self.per_col} consecutive ranks {where}({how})"

    def reduce(self, values: Sequence[float]) -> list[tuple[float, float, float]]:
        """``(min, mean, max)`` of per-rank ``values`` in each column."""
        out = []
        for lo, hi in self.bins:
            part = values[lo : hi + 1]
            out.append((min(part), sum(part) / len(part), max(part)))
        return out


class RowAxis:
    """Rows of ``names`` (boundary FQNs), at most :data:`MAX_ROWS`: ``bins`` (index ranges,
    inclusive), ``labels``, ``row_h`` (px, from ``max_height`` within ``[min_h, max_h]``)."""

    def __init__(
        self,
        names: Sequence[str],
        *,
        max_rows: int = MAX_ROWS,
        max_height: float = 560,
        min_h: int = 6,
        max_h: int = 18,
    ):
        B = len(names)
        self.names = list(names)
        self.per_row = max(1, math.ceil(B / max_rows)) if B else 1
        self.bins = [(lo, min(lo + self.per_row, B) - 1) for lo in range(0, B, self.per_row)]
        self.labels = [row_label(self.names[lo : hi + 1]) for lo, hi in self.bins]
        n = max(1, len(self.bins))
        self.row_h = max(min_h, min(max_h, int(max_height // n)))
        self.row_of = [0] * B
        for i, (lo, hi) in enumerate(self.bins):
            for j in range(lo, hi + 1):
                self.row_of[j] = i

    @property
    def aggregated(self) -> bool:
        return self.per_row > 1

    def __len__(self) -> int:
        return len(self.bins)

    def describe(self) -> str:
        if not self.aggregated:
            return ""
        return f"{len(self.names):,} boundaries > {MAX_ROWS}: a row is {self.per_row} consecutive boundaries (summed)"


_NUMBERED = re.compile(r"^(.*?)(\d+)$")


def row_label(names: Sequence[str]) -> str:
    """Label of consecutive boundaries: the FQN (``<root>`` for ``""``), or ``prefix.a–b`` when
    they share a prefix and end in numbers, else ``first … last``."""
    shown = [n or "<root>" for n in names]
    if len(shown) == 1:
        return shown[0]
    first, last = _NUMBERED.match(shown[0]), _NUMBERED.match(shown[-1])
    if first and last and first.group(1) == last.group(1):
        return f"{first.group(1)}{first.group(2)}–{last.group(2)}"
    return f"{shown[0]} … {shown[-1]}"
