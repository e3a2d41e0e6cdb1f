"""The alpha-beta link of ``dmuon.plan.compile(collectives="auto")`` fitted to measured collective
curves (:func:`fit_link`): the planner's formulas (:mod:`dmuon.plan._cost.seconds`) by least
squares on relative error, one ``(alpha, B)`` pair for the tree kinds (broadcast, reduce) and one
for the ring kinds (all-gather, reduce-scatter).

The curves are the calibration's (:func:`dmuon.sim._calibrate.gloo._time_collectives`: the
median seconds from issue to ``wait()`` per kind, group size and payload). ``gloo`` on CPU moves
a broadcast's bytes several times faster than an all-gather's (its ring copies through every
member), which one shared ``B`` cannot say: hence a pair per family. The fitted numbers ship
with the planner (:data:`dmuon.plan._rules.COLLECTIVE_LINKS`); ``benchmarks/gloo_link_fit.py``
measures the curves and prints them.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence

__all__ = ["TREE_KINDS", "RING_KINDS", "fit_alpha_beta", "fit_link"]

#: the kinds priced by ``(1 + ceil(log2 k)) * alpha + S / B`` (S = payload bytes)
TREE_KINDS = ("broadcast", "reduce")
#: the kinds priced by ``k * alpha + (k - 1) * slot / B`` (slot = one rank's part)
RING_KINDS = ("all_gather", "reduce_scatter")


def _terms(kind: str, k: int, nbytes: float) -> tuple[float, float]:
    """``(alpha multiplier, bytes over B)`` of one call in the planner's formulas."""
    if kind in TREE_KINDS:
        return 1.0 + math.ceil(math.log2(k)), float(nbytes)
    if kind in RING_KINDS:
        return float(k), float((k - 1) * nbytes)
    raise ValueError(f"no planner formula for collective kind {kind!r}")


def fit_alpha_beta(points: Iterable[tuple[str, int, float, float]]) -> tuple[float, float]:
    """``(alpha_s, bandwidth_Bps)`` minimising the summed squared RELATIVE error of the planner's
    formula over ``points`` = ``(kind, group size k, payload bytes, measured seconds)`` (kinds of
    one family). Relative error, so that the small payloads' latency counts as much as the large
    ones' bandwidth. ``alpha`` is clamped at 0; a fit whose byte term is not positive raises."""
    saa = sab = sbb = sat = sbt = 0.0
    n = 0
    for kind, k, nbytes, seconds in points:
        if seconds <= 0:
            continue
        a, b = _terms(kind, int(k), nbytes)
        a, b = a / seconds, b / seconds  # weight 1 / t: relative residuals, target 1
        saa += a * a
        sab += a * b
        sbb += b * b
        sat += a
        sbt += b
        n += 1
    det = saa * sbb - sab * sab
    if n < 2 or det <= 0:
        raise ValueError(f"fit_alpha_beta needs >= 2 points of distinct shape, got {n}")
    alpha = (sat * sbb - sbt * sab) / det
    inv_b = (saa * sbt - sab * sat) / det
    if alpha < 0:  # refit the byte term alone
        alpha = 0.0
        inv_b = sbt / sbb
    if inv_b <= 0:
        raise ValueError("fit_alpha_beta: the fitted seconds per byte is not positive")
    return alpha, 1.0 / inv_b


def fit_link(curves: Mapping[str, Mapping[str, Sequence[Sequence[float]]]]) -> dict[str, float]:
    """The link record's four numbers from ``curves`` = ``{str(k): {kind: [(payload bytes, seconds),
    ...]}}`` (the calibration's ``raw["collectives"]`` layout): ``latency_s`` / ``bandwidth_Bps``
    from :data:`TREE_KINDS`, ``all_gather_latency_s`` / ``all_gather_bandwidth_Bps`` from
    :data:`RING_KINDS` (:func:`fit_alpha_beta`)."""

    def points(kinds):
        return [(kind, int(k), float(b), float(s)) for k, res in curves.items() for kind in kinds for b, s in res[kind]]

    a_t, b_t = fit_alpha_beta(points(TREE_KINDS))
    a_r, b_r = fit_alpha_beta(points(RING_KINDS))
    return dict(latency_s=a_t, bandwidth_Bps=b_t, all_gather_latency_s=a_r, all_gather_bandwidth_Bps=b_r)
