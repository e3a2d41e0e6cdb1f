"""The simulator's result as a page: ``Simulations._repr_html_()`` / ``to_html()``,
``Simulation._repr_html_()`` and ``python -m dmuon simulate --html FILE``.

Three sections (SVG, the rules of :mod:`dmuon.plan._tools.html.svg`): a table of every variant's
figures (step, ratio to FSDP2 + AdamW, exposed communication, Newton-Schulz, peak memory, bytes
moved) with the step as a bar, the recommendation and the variants above the device's memory; the
peak memory of each variant's busiest rank by term, against FSDP2 + AdamW; then one timeline of one rank (rank 0 by default) per variant,
its lanes (compute, then each collective channel used) over a time axis shared by all variants:
the ``--png`` Gantt chart in SVG, each bar an op with its ``<title>``.

Past a width, bars aggregate: in a lane, ops of one kind closer than half a pixel merge into one
bar whose ``<title>`` counts them (said under the picture), so a timeline costs at most about
one bar per pixel per lane.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from dmuon.plan._tools.html.svg import PAGE_WIDTH, Page, Svg, document, title_section, wrap
from dmuon.sim._pages.recommendation import fits, recommend
from dmuon.sim._pages.sim_plot import _LANES, COLORS

__all__ = ["simulation_page", "simulation_html", "merge_bars", "MEMORY_TERMS"]

#: the terms of :class:`~dmuon.sim._engine.records.MemoryBreakdown` as the page and
#: ``python -m dmuon simulate`` name them: (label, attribute)
MEMORY_TERMS = (
    ("parameters", "parameters_nbytes"),
    ("gradients", "gradients_nbytes"),
    ("optimizer state", "optimizer_state_nbytes"),
    ("transient", "transient_nbytes"),
    ("activations", "activations_nbytes"),
)

#: left edge of the time axis, px (lane labels to its left)
AXIS_X = 120
#: px per lane
LANE_H = 15
#: bars closer than this many px (same lane, same kind) merge
MERGE_PX = 0.5


def merge_bars(intervals, scale: float) -> list[tuple[float, float, str, int, str]]:
    """``(start_s, end_s, kind, ops, label)`` bars of one lane's intervals at ``scale`` px per
    second: consecutive ops of one kind less than :data:`MERGE_PX` apart merge; zero-length ones
    (a wait that found its collective done) are dropped."""
    out: list[list] = []
    gap = MERGE_PX / scale if scale > 0 else 0.0
    for iv in sorted(intervals, key=lambda i: (i.start_s, i.end_s)):
        if iv.end_s <= iv.start_s:
            continue
        if out and out[-1][2] == iv.kind and iv.start_s - out[-1][1] <= gap:
            last = out[-1]
            last[1] = max(last[1], iv.end_s)
            last[3] += 1
        else:
            out.append([iv.start_s, iv.end_s, iv.kind, 1, iv.label])
    return [tuple(b) for b in out]


def _nice_step(span_ms: float, target: int = 8) -> float:
    """A 1-2-5 tick step giving about ``target`` ticks over ``span_ms``."""
    raw = span_ms / target if span_ms > 0 else 1.0
    mag = 10 ** math.floor(math.log10(raw))
    for m in (1, 2, 5, 10):
        if raw <= m * mag:
            return m * mag
    return 10 * mag


def _table(sims: Mapping[str, Any], memory_nbytes: int = 0) -> Svg:
    names = list(sims)
    base = sims["adamw"].step_s if "adamw" in sims else sims[names[0]].step_s
    base_name = "FSDP2 + AdamW" if "adamw" in sims else names[0]
    hw = sorted({s.hardware for s in sims.values()})
    svg = Svg(PAGE_WIDTH, 0, label="variants")
    svg.text(10, 22, "Simulated step per variant", size=15, bold=True)
    ranks = sorted({len(s.ranks) for s in sims.values()})
    y = (
        svg.lines(
            10,
            42,
            wrap(
                f"Hardware {', '.join(hw)}; {', '.join(map(str, ranks))} ranks. Step = the slowest rank's end; exposed comm = the critical rank's "
                f"wait for collectives; NS = Newton-Schulz seconds of the rank with the most (busiest by NS time); peak = the largest rank's "
                f"memory; moved = bytes on the wire per step, all ranks. Ratio to {base_name}.",
                PAGE_WIDTH - 20,
                12,
            ),
            size=12,
            fill="#444444",
        )
        + 6
    )
    cols = [
        (10, "variant"),
        (150, "step"),
        (230, "× " + ("AdamW" if "adamw" in sims else names[0])),
        (300, "exposed comm"),
        (400, "NS (share)"),
        (505, "peak"),
        (645, "moved"),
        (730, "step (bar)"),
    ]
    for x, h in cols:
        svg.text(x, y + 12, h, size=11, bold=True)
    y += 20
    smax = max(s.step_s for s in sims.values()) or 1
    for i, (name, s) in enumerate(sims.items()):
        if i % 2 == 0:
            svg.rect(6, y - 2, PAGE_WIDTH - 12, 18, "#f6f8fb")
        svg.raw(
            f'<g data-variant="{name}" data-step-s="{s.step_s!r}" data-comm-nbytes="{s.comm_nbytes}" '
            f'data-peak-nbytes="{max(s.peak_memory_nbytes, default=0)}">'
        )
        vals = [
            name,
            f"{1e3 * s.step_s:,.1f} ms",
            f"{s.step_s / base:.3f}" if base else "-",
            f"{1e3 * s.exposed_comm_s:,.1f} ms",
            f"{1e3 * s.ns_s:,.1f} ms ({100 * s.ns_share:.0f}%)" if s.ns_s else "– (no NS)",
            f"{max(s.peak_memory_nbytes, default=0) / 2**30:,.1f} GiB"
            + (" > device" if memory_nbytes and not fits(s, memory_nbytes) else ""),
            f"{s.comm_nbytes / 1e12:,.3f} TB",
        ]
        for (x, _), v in zip(cols, vals):
            over = x == 505 and v.endswith("> device")
            svg.text(x, y + 11, v, size=11, bold=x == 10 or over, fill="#c0392b" if over else "#222222")
        svg.rect(
            730,
            y + 2,
            (PAGE_WIDTH - 750) * s.step_s / smax,
            11,
            COLORS["forward"],
            probe=True,
            title=f"{name}: step {1e3 * s.step_s:,.2f} ms on {s.hardware}; critical rank {s.critical_rank}, "
            f"last op {s.critical_op}",
        )
        svg.raw("</g>")
        y += 18
    notes = _notes(sims, memory_nbytes)
    if notes:
        y = svg.lines(10, y + 14, [w for n in notes for w in wrap(n, PAGE_WIDTH - 20, 12)], size=12)
    svg.height = y + 8
    return svg


def _notes(sims: Mapping[str, Any], memory_nbytes: int) -> list[str]:
    """The recommendation (where Z2 and Z3 were both simulated) and every variant whose peak is above
    the device's memory, with why (:func:`dmuon.sim._pages.recommendation.recommend`)."""
    notes = []
    over = [(n, s) for n, s in sims.items() if memory_nbytes and not fits(s, memory_nbytes)]
    if over:
        what = ", ".join(f"{n} ({max(s.peak_memory_nbytes) / 2**30:,.1f} GiB)" for n, s in over)
        notes.append(
            f"Does not fit: {what} peak above the device's {memory_nbytes / 2**30:,.1f} GiB per rank (peak = the "
            "largest rank's parameters, gradients, optimizer state, dmuon's buffers and activations at once): at "
            "these tokens per rank they would run out of memory; more shard ranks, TP, activation checkpointing "
            "or fewer tokens per rank bring the peak down."
        )
    if "z2" in sims and "z3" in sims:
        mode, why = recommend(dict(sims), memory_nbytes)
        ratio = ""
        if "adamw" in sims and sims["adamw"].step_s:
            ratio = f" ({sims[mode].step_s / sims['adamw'].step_s:.3f} x FSDP2 + AdamW)"
        notes.append(f"Recommended: dmuon {mode.upper()}{ratio}: {why}.")
    return notes


def _memory(sims: Mapping[str, Any], memory_nbytes: int) -> Svg:
    """Each variant's busiest rank (largest peak) by term, GiB, and what the terms hold."""
    svg = Svg(PAGE_WIDTH, 0, label="memory")
    svg.text(10, 22, "Peak memory per rank, by term", size=15, bold=True)
    caption = (
        "Each variant's rank with the largest peak. Transient: the most held at once over the step, phase by "
        "phase (the root unit unsharded from the forward on; per block its parameters unsharded, the next "
        "block's prefetched, its gradients, its reduce buffers and the previous block's still in flight). "
        "Against FSDP2 + AdamW (every parameter sharded, AdamW's two moments per shard, FSDP2's units in that "
        "order): dmuon keeps each matrix a rank owns whole (parameter, gradient and one Muon momentum instead "
        "of two moments) and FSDP2 shards the rest; its blocks hold dmuon's received copies (with compute "
        "tensors assembled from pieces, where the plan has any) and its reduce buffers; naive Muon's transient "
        "is every full update gathered at once, if more. Activations: one micro-batch's, the same for every "
        "variant." + (f" Device memory: {memory_nbytes / 2**30:,.1f} GiB." if memory_nbytes else "")
    )
    y = svg.lines(10, 42, wrap(caption, PAGE_WIDTH - 20, 12), size=12, fill="#444444") + 6
    cols = [(10, "variant"), (110, "rank")] + [(180 + 120 * i, t) for i, (t, _) in enumerate(MEMORY_TERMS)]
    cols.append((180 + 120 * len(MEMORY_TERMS), "peak, GiB"))
    for x, h in cols:
        svg.text(x, y + 12, h, size=11, bold=True)
    y += 20
    ref = None
    if "adamw" in sims:
        ref = max(sims["adamw"].ranks, key=lambda r: (r.memory.peak_nbytes, -r.rank)).memory
    gaps = []
    for i, (name, s) in enumerate(sims.items()):
        if not s.ranks:
            continue
        r = max(s.ranks, key=lambda x: (x.memory.peak_nbytes, -x.rank))
        m = r.memory
        if i % 2 == 0:
            svg.rect(6, y - 2, PAGE_WIDTH - 12, 18, "#f6f8fb")
            svg.set_probe(PAGE_WIDTH - 14, y + 7, "#f6f8fb")  # the stripe's right end, clear of the text
        over = bool(memory_nbytes) and m.peak_nbytes > memory_nbytes
        vals = [name, str(r.rank)] + [f"{getattr(m, f) / 2**30:,.2f}" for _, f in MEMORY_TERMS]
        vals.append(f"{m.peak_nbytes / 2**30:,.2f}" + (" > device" if over else ""))
        svg.raw(f'<g data-memory-variant="{name}" data-peak-nbytes="{m.peak_nbytes}">')
        for (x, _), v in zip(cols, vals):
            red = over and v.endswith("> device")
            svg.text(x, y + 11, v, size=11, bold=x == 10 or red, fill="#c0392b" if red else "#222222")
        svg.raw("</g>")
        y += 18
        if ref is not None and name in ("z2", "z3"):
            gap = ", ".join(
                f"{t} {(getattr(m, f) - getattr(ref, f)) / 2**30:+,.2f}"
                for t, f in MEMORY_TERMS
                if getattr(m, f) != getattr(ref, f)
            )
            gaps.append(f"dmuon {name.upper()} minus FSDP2 + AdamW, GiB: {gap or 'no difference'}.")
    if gaps:
        y = svg.lines(10, y + 14, [w for g in gaps for w in wrap(g, PAGE_WIDTH - 20, 12)], size=12)
    svg.height = y + 8
    return svg


def _timelines(sims: Mapping[str, Any], rank: int) -> Svg:
    tmax = 0.0
    for s in sims.values():
        bars = s.timelines.get(rank, ())
        tmax = max(tmax, s.step_s, max((b.end_s for b in bars), default=0.0))
    tmax = tmax or 1.0
    width = PAGE_WIDTH - AXIS_X - 20
    scale = width / tmax
    sx = lambda t: AXIS_X + t * scale  # noqa: E731
    svg = Svg(PAGE_WIDTH, 0, label="timeline", data={"rank": rank, "tmax-s": repr(tmax)})
    svg.text(10, 22, f"Timeline of rank {rank} per variant", size=15, bold=True)
    y = (
        svg.lines(
            10,
            42,
            wrap(
                f"Each lane is the rank's compute stream or one channel of collectives; a bar is one op, coloured by kind "
                f"(hover for its name and times). One time axis for every variant: 0 – {1e3 * tmax:,.1f} ms. Aggregated: ops "
                f"of one kind less than {MERGE_PX} px apart in a lane are one bar, its title counts them.",
                PAGE_WIDTH - 20,
                12,
            ),
            size=12,
            fill="#444444",
        )
        + 4
    )
    kinds: list[str] = []
    step = _nice_step(1e3 * tmax)
    for name, s in sims.items():
        bars = s.timelines.get(rank)
        svg.text(10, y + 13, f"{name}: step {1e3 * s.step_s:,.1f} ms", size=12, bold=True)
        y += 20
        if not bars:
            svg.text(
                AXIS_X,
                y + 10,
                f"rank {rank}'s timeline was not kept (simulate(..., timeline_ranks=({rank},)))",
                size=11,
                fill="#777777",
            )
            y += 22
            continue
        lanes = [lane for lane in _LANES if any(b.lane == lane for b in bars)]
        lanes += sorted({b.lane for b in bars} - set(lanes))
        h = len(lanes) * LANE_H
        svg.rect(AXIS_X, y, width, h, "#f7f7f7")
        t = 0.0
        while t <= 1e3 * tmax + 1e-9:
            svg.line(sx(t / 1e3), y, sx(t / 1e3), y + h, "#e2e2e2")
            t += step
        for li, lane in enumerate(lanes):
            ly = y + li * LANE_H
            svg.text(AXIS_X - 6, ly + 11, lane, size=10, anchor="end", fill="#444444")
            for start, end, kind, n, label in merge_bars([b for b in bars if b.lane == lane], scale):
                if kind not in kinds:
                    kinds.append(kind)
                w = max(0.6, (end - start) * scale)
                title = (
                    f"{kind} {label}: {1e3 * start:,.3f} – {1e3 * end:,.3f} ms"
                    if n == 1
                    else f"{n:,} {kind} ops: {1e3 * start:,.3f} – {1e3 * end:,.3f} ms"
                )
                svg.rect(sx(start), ly + 1, w, LANE_H - 3, COLORS.get(kind, "#333333"), title=title, probe=w >= 4)
        svg.line(
            sx(s.step_s),
            y - 3,
            sx(s.step_s),
            y + h + 3,
            "#d62728",
            width=1.5,
            dash="4 2",
            title=f"step end {1e3 * s.step_s:,.2f} ms",
        )
        y += h + 12
    t = 0.0
    while t <= 1e3 * tmax + 1e-9:
        svg.line(sx(t / 1e3), y - 8, sx(t / 1e3), y - 4, "#777777")
        svg.text(sx(t / 1e3), y + 6, f"{t:g}", size=10, anchor="middle", fill="#555555")
        t += step
    svg.text(AXIS_X - 12, y + 6, "ms", size=10, anchor="end", fill="#555555")
    y += 24
    x = 10
    for kind in kinds:
        if x + 30 + len(kind) * 6.6 > PAGE_WIDTH:
            x = 10
            y += 18
        svg.rect(x, y - 9, 12, 12, COLORS.get(kind, "#333333"))
        svg.text(x + 16, y + 1, kind, size=11)
        x += 16 + len(kind) * 6.6 + 16
    if x + 90 > PAGE_WIDTH:
        x = 10
        y += 18
    svg.line(x, y - 3, x + 14, y - 3, "#d62728", width=1.5, dash="4 2")
    svg.text(x + 18, y + 1, "step end", size=11)
    svg.height = y + 12
    return svg


def simulation_page(
    sims: Mapping[str, Any],
    *,
    rank: int = 0,
    memory_nbytes: int = 0,
    title: str | None = None,
    subtitle: str | None = None,
) -> Page:
    """The page of ``{variant: Simulation}`` (module docstring); ``memory_nbytes``: the device's
    memory (0 = unknown), for the recommendation and the variants that do not fit; ``title`` (and
    ``subtitle``): a heading naming the run (``python -m dmuon simulate`` passes the model, mesh,
    tokens per rank, sequence length, wire dtype and hardware); none by default."""
    if not sims:
        raise ValueError("no simulation to draw")
    first = next(iter(sims.values()))
    page = Page(
        "simulation",
        data={
            "hardware": first.hardware,
            "rank": rank,
            "variants": " ".join(sims),
            "step-s": " ".join(repr(s.step_s) for s in sims.values()),
        },
    )
    if title:
        page.add(title_section(title, subtitle))
    page.add(_table(sims, memory_nbytes))
    if all(s.ranks for s in sims.values()):
        page.add(_memory(sims, memory_nbytes))
    page.add(_timelines(sims, rank))
    return page


def simulation_html(
    sims: Mapping[str, Any],
    *,
    rank: int = 0,
    standalone: bool = False,
    memory_nbytes: int = 0,
    title: str | None = None,
    subtitle: str | None = None,
) -> str:
    """The page's HTML: a fragment (``_repr_html_``) or (``standalone``) a whole document;
    ``title``: the heading and the document's ``<title>`` (default: the hardware and the variants)."""
    fragment = simulation_page(sims, rank=rank, memory_nbytes=memory_nbytes, title=title, subtitle=subtitle).render()
    if not standalone:
        return fragment
    first = next(iter(sims.values()))
    return document(fragment, title or f"dmuon simulation on {first.hardware}: {', '.join(sims)}")
