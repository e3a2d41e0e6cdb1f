"""The boundary x rank pictures of the plan and diff pages: the ownership map
(:func:`ownership_map`), the expert ranges (:func:`experts_map`) and the collectives per
boundary (:func:`collectives_chart`).

Cells of a map row that fall in the same colour level, next to each other in one replicate row,
are drawn as one rectangle (its ``<title>`` names the run), so a sparse map costs a few shapes
per row; every picture states its aggregation (:mod:`dmuon.plan._tools.html.axes`).
"""

from __future__ import annotations

from collections.abc import Sequence

from dmuon.plan._tools.html.axes import MAX_ROWS, RankAxis, RowAxis, row_label
from dmuon.plan._tools.html.figures import KINDS, STEP_ROW, PlanFigures
from dmuon.plan._tools.html.svg import (
    BLUES,
    EMPTY,
    GREENS,
    LEVELS,
    ORANGES,
    PAGE_WIDTH,
    Svg,
    fit,
    fmt_bytes,
    fmt_count,
    fmt_flops,
    fmt_range,
    level,
    ramp_colour,
    wrap,
)

__all__ = [
    "LABEL_W",
    "ownership_map",
    "experts_map",
    "collectives_chart",
    "rank_axis",
    "unit_fmt",
    "header_block",
    "HIGHLIGHT",
]

#: width of the row-label column of every map, px
LABEL_W = 200
#: right margin of the maps, px
RIGHT = 16
#: stroke of a highlighted (changed) cell in a diff
HIGHLIGHT = "#d62728"
RAMPS = (BLUES, ORANGES, GREENS)


def rank_axis(fig: PlanFigures) -> RankAxis:
    """The rank columns of every per-rank picture of ``fig``'s plan (shared, so they align)."""
    return RankAxis(fig.R, fig.N, x0=LABEL_W, width=PAGE_WIDTH - LABEL_W - RIGHT)


def unit_fmt(cost_model: str):
    """``(unit name, formatter)`` of the LPT weight of ``cost_model``."""
    return ("NS FLOPs", fmt_flops) if cost_model == "ns_flops" else ("elements", fmt_count)


def header_block(svg: Svg, title: str, caption: str, *, y: float = 22) -> float:
    """The section title and its wrapped caption; returns the y below them."""
    svg.text(10, y, title, size=15, bold=True)
    return svg.lines(10, y + 20, wrap(caption, PAGE_WIDTH - 20, 12), size=12, fill="#444444") + 2


def row_labels(row_h: int) -> tuple[int, int]:
    """``(every, font)``: label every ``every``-th row of ``row_h`` px, in a ``font`` px font; every
    row from 8 px up (the font shrinks to 7 px), else as many as fit."""
    if row_h >= 8:
        return 1, max(7, min(11, row_h - 1))
    return -(-8 // row_h), 7


def _columns_header(svg: Svg, ax: RankAxis, y: float) -> float:
    """Replica bands and rank ticks above the columns from ``y``; returns the grid's top."""
    if ax.R > 1 and ax.by_row:
        for r in range(ax.R):
            cols = [i for i, rep in enumerate(ax.replica) if rep == r]
            x0, x1 = ax.x[cols[0]], ax.x[cols[-1]] + ax.col_w
            lo, hi = ax.bins[cols[0]][0], ax.bins[cols[-1]][1]
            svg.rect(x0, y, x1 - x0, 16, "#eef1f6", title=f"replica {r}: mesh ranks {lo}–{hi} (shard 0–{ax.N - 1})")
            svg.text(
                (x0 + x1) / 2,
                y + 12,
                fit(f"replica {r} · ranks {lo}–{hi}", x1 - x0 - 4, 10),
                size=10,
                anchor="middle",
                fill="#334",
            )
        y += 20
    step = max(1, -(-40 // ax.col_w))
    for i in range(0, len(ax), step):
        x = ax.x[i]
        svg.line(x, y + 12, x, y + 16, "#777777")
        svg.text(x, y + 10, str(ax.bins[i][0]), size=9, fill="#555555")
    return y + 18


def _legend(
    svg: Svg, y: float, kinds: Sequence[int], vmax: float, fmt, unit: str, *, extra: Sequence[tuple[str, str]] = ()
) -> None:
    """Colour ramps of the ownership ``kinds`` present (0 .. ``vmax`` per rank), then ``extra``
    ``(fill or stroke spec, label)`` swatches."""
    x = 10
    svg.rect(x, y - 9, 12, 12, EMPTY, stroke="#bbbbbb", stroke_width=0.5)
    svg.text(x + 16, y + 1, "owns nothing", size=11)
    x += 110
    for k in kinds:
        svg.text(x, y + 1, KINDS[k], size=11)
        x += len(KINDS[k]) * 6.6 + 6
        for lvl in range(1, LEVELS + 1):
            svg.rect(
                x, y - 9, 10, 12, RAMPS[k][lvl], title=f"{KINDS[k]}: up to {fmt(vmax * lvl / LEVELS)} {unit} per rank"
            )
            x += 10
        x += 14
    svg.text(x, y + 1, f"0 – {fmt(vmax)} {unit} per rank", size=11, fill="#444444")
    x += 200
    for spec, label in extra:
        svg.rect(x, y - 9, 12, 12, "none", stroke=spec, stroke_width=2)
        svg.text(x + 16, y + 1, label, size=11)
        x += 16 + len(label) * 6.6 + 14


def _ownership_values(fig: PlanFigures, ax: RankAxis, rows: RowAxis, by: str = "weight"):
    """Per map row: per column ``[single, group, expert, other unit, largest rank]``: the kinds'
    sums over the cell's ranks and boundaries in the unit ``by`` (``"weight"``: the LPT weight;
    ``"numel"``: elements), the total in the other unit, and the largest of its ranks' loads;
    and the per-rank loads of the row."""
    a, o = (0, 3) if by == "weight" else (3, 0)
    out = []
    for lo, hi in rows.bins:
        cols = [[0, 0, 0, 0, 0] for _ in range(len(ax))]
        per_rank: dict[int, int] = {}
        for b in range(lo, hi + 1):
            for rank, cell in fig.cells[b].items():
                c = cols[ax.col_of[rank]]
                for j in range(3):
                    c[j] += cell[a + j]
                c[3] += cell[o] + cell[o + 1] + cell[o + 2]
                per_rank[rank] = per_rank.get(rank, 0) + cell[a] + cell[a + 1] + cell[a + 2]
        for rank, w in per_rank.items():
            c = cols[ax.col_of[rank]]
            c[4] = max(c[4], w)
        out.append((cols, per_rank))
    return out


def ownership_vmax(fig: PlanFigures, ax: RankAxis, rows: RowAxis, by: str = "weight") -> float:
    """The largest rank load of any cell of ``fig``'s map (the colour scale's top)."""
    return max((c[4] for cols, _ in _ownership_values(fig, ax, rows, by) for c in cols), default=0)


def ownership_map(
    fig: PlanFigures,
    *,
    title: str = "Ownership: hook boundaries × ranks",
    ax: RankAxis | None = None,
    vmax: float | None = None,
    highlight: set[tuple[int, int]] | None = None,
    note: str = "",
    label: str = "ownership",
    by: str = "weight",
) -> Svg:
    """Boundaries down, mesh ranks across; a cell's colour is the LPT load (``by="weight"``: the
    ``cost_model`` unit; ``"numel"``: elements) its rank(s) own in its boundary(ies): blue
    single owners, orange owner-group blocks, green expert ranges (the kind holding most of it),
    grey nothing. ``highlight``: ``(boundary index, mesh rank)`` pairs outlined in red (a
    diff's changes); ``vmax``: a shared scale."""
    plan = fig.plan
    ax = ax or rank_axis(fig)
    rows = RowAxis(fig.names)
    unit, fmt = unit_fmt(plan.cost_model if by == "weight" else "numel")
    values = _ownership_values(fig, ax, rows, by)
    if vmax is None:
        vmax = max((c[4] for cols, _ in values for c in cols), default=0)
    kinds_present = sorted({k for cols, _ in values for c in cols for k in range(3) if c[k]})
    what = f"the LPT load ({unit})" if by == "weight" else "the elements"
    parts = [
        f"Each cell: {what} the rank owns in the boundary, whose matrices it keeps in full and "
        "orthogonalises; the colour's hue is the kind of ownership holding most of it (hover a cell: what it "
        "holds)."
    ]
    if fig.R > 1:
        parts.append(f"HSDP: {fig.R} replicas side by side, each matrix owned once on the whole mesh.")
    if fig.T > 1:
        parts.append(
            f"TP: a column is a data-parallel coordinate whose owner is its group of T = {fig.T} TP ranks, "
            f"each holding 1/{fig.T} of every matrix ({len(plan.tp_segment_lengths)} Gram NS segments)."
        )
    agg = "; ".join(s for s in (rows.describe(), ax.describe()) if s)
    if agg:
        parts.append(f"Aggregated: {agg}.")
    if note:
        parts.append(note)
    grid_h = len(rows) * rows.row_h
    svg = Svg(
        PAGE_WIDTH,
        0,
        label=label,
        data={
            "rows": len(rows),
            "cols": len(ax),
            "ranks-per-col": ax.per_col,
            "boundaries-per-row": rows.per_row,
            "vmax": round(vmax, 3),
            "aggregation": agg,
        },
    )
    label_every, font = row_labels(rows.row_h)
    if label_every > 1:
        parts.append(
            f"Rows are {rows.row_h} px high: every {label_every}th row is labelled (hover a row for its name)."
        )
    y = header_block(svg, title, " ".join(parts))
    top = _columns_header(svg, ax, y + 2)
    for i, (cols, per_rank) in enumerate(values):
        y0 = top + i * rows.row_h
        lo, hi = rows.bins[i]
        if i % label_every == 0:
            svg.text(
                LABEL_W - 6,
                y0 + min(rows.row_h, 12) - 2,
                fit(rows.labels[i], LABEL_W - 12, font),
                size=font,
                anchor="end",
                title=", ".join(n or "<root>" for n in fig.names[lo : hi + 1][:8]),
            )
        svg.raw(f'<g data-row="{i}" data-weight="{sum(c[0] + c[1] + c[2] for c in cols)}">')
        j = 0
        while j < len(ax):
            c = cols[j]
            w = c[0] + c[1] + c[2]
            kind = max(range(3), key=lambda k: c[k]) if w else -1
            lvl = level(c[4], vmax)
            run = j + 1
            while run < len(ax) and ax.replica[run] == ax.replica[j]:
                n = cols[run]
                nw = n[0] + n[1] + n[2]
                nkind = max(range(3), key=lambda k: n[k]) if nw else -1
                if nkind != kind or level(n[4], vmax) != lvl:
                    break
                run += 1
            fill = ramp_colour(RAMPS[kind], lvl) if kind >= 0 else EMPTY
            svg.rect(
                ax.x[j],
                y0,
                ax.x[run - 1] + ax.col_w - ax.x[j],
                rows.row_h - (1 if rows.row_h >= 8 else 0),
                fill,
                title=_cell_title(fig, ax, rows, i, j, run, cols, per_rank, unit, fmt, by),
                probe=w > 0,
            )
            j = run
        svg.raw("</g>")
    if highlight:
        runs: list[list[int]] = []  # [row, first col, last col]: adjacent changed columns of one replicate row
        for row, col in sorted({(rows.row_of[b], ax.col_of[rank]) for b, rank in highlight}):
            if runs and runs[-1][0] == row and runs[-1][2] == col - 1 and ax.replica[col] == ax.replica[col - 1]:
                runs[-1][2] = col
            else:
                runs.append([row, col, col])
        for row, c0, c1 in runs:
            first, last = ax.bins[c0][0], ax.bins[c1][1]
            svg.rect(
                ax.x[c0] - 0.5,
                top + row * rows.row_h - 0.5,
                ax.x[c1] + ax.col_w - ax.x[c0] + 1,
                rows.row_h,
                "none",
                stroke=HIGHLIGHT,
                stroke_width=1.5,
                title=f"changed: {rows.labels[row]} × "
                + (f"rank {first}" if first == last else f"ranks {first}–{last}"),
            )
    y = top + grid_h + 24
    extra = (("#d62728", "changed"),) if highlight is not None else ()
    _legend(svg, y, kinds_present or [0], vmax, fmt, unit, extra=extra)
    svg.height = y + 14
    return svg


def _cell_title(
    fig: PlanFigures, ax: RankAxis, rows: RowAxis, i: int, j: int, run: int, cols, per_rank, unit, fmt, by: str
) -> str:
    lo_b, hi_b = rows.bins[i]
    where = rows.labels[i]
    first, last = ax.bins[j][0], ax.bins[run - 1][1]
    ranks = f"rank {first}" if first == last else f"ranks {first}–{last}"
    total = [sum(cols[k][t] for k in range(j, run)) for t in range(4)]
    w = total[0] + total[1] + total[2]
    n_ranks = last - first + 1
    if not w:
        return f"{where} × {ranks}: owns nothing here"
    if n_ranks == 1:
        coords = f" (shard {first % fig.N}, replica {first // fig.N})" if fig.R > 1 else ""
        items = sorted(fig.cell_params[lo_b].get(first, ()), key=lambda t: -t[1]) if lo_b == hi_b else []
        f_item = fmt if by == "weight" else unit_fmt(fig.plan.cost_model)[1]
        what = ", ".join(f"{name} {f_item(v)}" for name, v in items[:4]) + (
            f" (+{len(items) - 4} more)" if len(items) > 4 else ""
        )
        kinds = "; ".join(f"{KINDS[k]} {100 * total[k] / w:.0f}%" for k in range(3) if total[k] and total[k] != w)
        numel = (
            ""
            if fig.plan.cost_model == "numel"
            else (
                f"; {fmt_count(total[3])} elements"
                if by == "weight"
                else f"; {unit_fmt(fig.plan.cost_model)[1](total[3])} LPT weight"
            )
        )
        return (
            f"{where} × {ranks}{coords}: {fmt(w)} {unit}{numel}"
            + (f" — {what}" if what else "")
            + (f" [{kinds}]" if kinds else "")
        )
    vals = [per_rank.get(r, 0) for r in range(first, last + 1)]
    top = max(range(first, last + 1), key=lambda r: (per_rank.get(r, 0), -r))
    kinds = ", ".join(f"{KINDS[k]} {100 * total[k] / w:.0f}%" for k in range(3) if total[k])
    return (
        f"{where} × {ranks}: mean {fmt(w / n_ranks)} {unit} per rank, min {fmt(min(vals))}, max {fmt(max(vals))} "
        f"(rank {top}); {kinds}"
    )


#: ramp of the first expert a rank owns, expert 0 (dark) to the last (light): viridis, 8 steps
EXPERT_RAMP = ("#440154", "#46327e", "#365c8d", "#277f8e", "#1fa187", "#4ac16d", "#a0da39", "#fde725")


def _expert_rows(fig: PlanFigures) -> list[tuple[list[int], bool]]:
    """Rows of the experts map: runs of consecutive boundaries whose ranks own the same ranges
    (one row each, exact), or, past :data:`~dmuon.plan._tools.html.axes.MAX_ROWS` such runs,
    bins of consecutive runs (not exact): ``(boundary indices, exact)``."""
    groups: list[tuple[list[int], tuple]] = []
    for b in sorted(fig.experts):
        pattern = tuple(sorted((rank, tuple(r)) for rank, (_, r) in fig.experts[b].items()))
        if groups and groups[-1][1] == pattern and groups[-1][0][-1] == b - 1:
            groups[-1][0].append(b)
        else:
            groups.append(([b], pattern))
    if len(groups) <= MAX_ROWS:
        return [(bs, True) for bs, _ in groups]
    per = -(-len(groups) // MAX_ROWS)
    return [([b for bs, _ in groups[i : i + per] for b in bs], per == 1) for i in range(0, len(groups), per)]


def experts_map(fig: PlanFigures, *, ax: RankAxis | None = None, lines: Sequence[str] = ()) -> Svg | None:
    """Expert ranges × ranks: a row is a run of consecutive boundaries whose ranks own the same
    expert ranges; a cell's colour is the first expert the rank owns there (expert 0 dark to the
    last light, so contiguous ranges read as a gradient; grey: none), its ``<title>`` names every
    range of every stack of its rank(s). Past :data:`MAX_ROWS` rows, rows aggregate (their titles
    then count experts). None when the plan has no expert stacks."""
    if not fig.experts:
        return None
    ax = ax or rank_axis(fig)
    row_items = _expert_rows(fig)
    labels = [row_label([fig.names[b] for b in bs]) for bs, _ in row_items]
    rows = RowAxis(labels, max_height=560, min_h=8)  # at most MAX_ROWS labels: one row each
    n_exp = max(spec.num_experts for spec in fig.plan.params if spec.experts is not None)
    grid = []  # per row: per column (first expert or None, experts owned)
    for bs, _ in row_items:
        first: list[int | None] = [None] * len(ax)
        count = [0] * len(ax)
        for b in bs:
            for rank, (n, ranges) in fig.experts[b].items():
                j = ax.col_of[rank]
                count[j] += n
                f = min(a for _, a, _ in ranges)
                first[j] = f if first[j] is None else min(first[j], f)
        grid.append((first, count))
    aggregated = not all(exact for _, exact in row_items)
    agg = "; ".join(
        s
        for s in (
            f"{len(fig.experts):,} boundaries in runs of equal ranges > {MAX_ROWS}: a row holds several runs"
            if aggregated
            else "",
            ax.describe("the lowest first expert, every rank's ranges in the title"),
        )
        if s
    )
    label_every, font = row_labels(rows.row_h)
    caption = (
        "Which experts each rank owns. A row is a run of consecutive boundaries whose ranks own the same ranges; "
        f"colour = the first expert a rank owns (expert 0 dark … expert {n_exp - 1} light), so contiguous ranges "
        "show as a gradient along the ranks; grey: no experts. A rank owns whole experts (master, momentum) and "
        "runs their Newton-Schulz; hover a cell for its ranges."
        + (f" Aggregated: {agg}." if agg else "")
        + (f" Every {label_every}th row is labelled (hover a row for its name)." if label_every > 1 else "")
    )
    svg = Svg(PAGE_WIDTH, 0, label="experts", data={"rows": len(rows), "cols": len(ax), "experts": n_exp})
    y = header_block(svg, "Experts: expert ranges × ranks", caption)
    y = svg.lines(10, y + 4, lines, size=11, mono=True, step=14)
    top = _columns_header(svg, ax, y)

    def colour(f):
        return EMPTY if f is None else EXPERT_RAMP[min(7, f * 8 // max(1, n_exp))]

    for i, ((first, count), (bs, exact)) in enumerate(zip(grid, row_items)):
        y0 = top + i * rows.row_h
        where = labels[i] + (f" ({len(bs)} boundaries)" if len(bs) > 1 else "")
        if i % label_every == 0:
            svg.text(
                LABEL_W - 6,
                y0 + min(rows.row_h, 12) - 2,
                fit(labels[i], LABEL_W - 12, font),
                size=font,
                anchor="end",
                title=where,
            )
        owned = fig.experts[bs[0]]  # exact rows: every boundary of the run owns these ranges
        j = 0
        while j < len(ax):
            fill = colour(first[j])
            run = j + 1
            prog = (
                _progression(owned, range(ax.bins[j][0], ax.bins[j][1] + 1)) if exact and first[j] is not None else None
            )
            while run < len(ax) and ax.replica[run] == ax.replica[j] and colour(first[run]) == fill:
                if exact and first[j] is not None:  # exact: a run of owners only while it is one progression
                    longer = None if prog is None else _progression(owned, range(ax.bins[j][0], ax.bins[run][1] + 1))
                    if longer is None:
                        break
                    prog = longer
                run += 1
            a, z = ax.bins[j][0], ax.bins[run - 1][1]
            ranks = f"rank {a}" if a == z else f"ranks {a}–{z}"
            n = sum(count[j:run])
            if not n:
                title = f"{where} × {ranks}: no experts"
            elif exact and a == z:
                title = f"{where} × rank {a}: " + _ranges_text(owned[a][1])
            elif exact and prog is not None:
                same: dict[tuple[int, int, int], list[str]] = {}  # stacks with one progression share a clause
                for name, key in prog.items():
                    same.setdefault(key, []).append(name)
                title = f"{where} × {ranks}: " + "; ".join(
                    f"{', '.join(names)}: experts {fmt_range(f0, f1)}, {k} per rank in rank order"
                    for (f0, f1, k), names in same.items()
                )
            elif exact:
                owners = [r for r in range(a, z + 1) if r in owned]
                title = (
                    f"{where} × {ranks}: "
                    + " | ".join(f"rank {r}: {_ranges_text(owned[r][1])}" for r in owners[:8])
                    + (f" | +{len(owners) - 8} more ranks" if len(owners) > 8 else "")
                )
            else:
                firsts = [f for f in first[j:run] if f is not None]
                title = (
                    f"{where} × {ranks}: {n:,} experts owned (all stacks), first experts "
                    f"{fmt_range(min(firsts), max(firsts))}"
                )
            svg.rect(
                ax.x[j],
                y0,
                ax.x[run - 1] + ax.col_w - ax.x[j],
                rows.row_h - (1 if rows.row_h >= 8 else 0),
                fill,
                title=title,
                probe=n > 0,
            )
            j = run
    y = top + len(rows) * rows.row_h + 22
    svg.rect(10, y - 9, 12, 12, EMPTY)
    svg.text(26, y + 1, "no experts", size=11)
    x = 110
    svg.text(x, y + 1, "first expert: 0", size=11)
    x += 96
    for c in EXPERT_RAMP:
        svg.rect(x, y - 9, 14, 12, c)
        x += 14
    svg.text(x + 6, y + 1, f"{n_exp - 1}", size=11)
    svg.height = y + 14
    return svg


def _progression(owned: dict[int, list], ranks) -> dict[str, tuple[int, int, int]] | None:
    """``{stack: (first expert, last expert, per rank)}`` when every rank of ``ranks`` (in order)
    owns one range of each of the same stacks, of one size per stack, each starting where the
    previous rank's ended; else None (the title then lists each rank's ranges)."""
    out: dict[str, list[int]] = {}
    stacks = None
    for r in ranks:
        entry = owned.get(r)
        if entry is None:
            return None
        names = [name for name, _, _ in entry[1]]
        if len(set(names)) != len(names) or (stacks is not None and set(names) != stacks):
            return None
        stacks = set(names)
        for name, f, last in entry[1]:
            if name not in out:
                out[name] = [f, last, last - f + 1]
            elif f != out[name][1] + 1 or last - f + 1 != out[name][2]:
                return None
            else:
                out[name][1] = last
    return {name: (v[0], v[1], v[2]) for name, v in out.items()}


def _ranges_text(ranges, limit: int = 8) -> str:
    """``"w1, w3: experts 0–1, 6; w2: experts 2"``: a rank's expert ranges per stack, in order
    (at most ``limit`` ranges per stack, then a count), stacks with the same ranges together."""
    by_stack: dict[str, list[str]] = {}
    for name, first, last in ranges:
        by_stack.setdefault(name, []).append(fmt_range(first, last))
    same: dict[str, list[str]] = {}  # stacks with the same ranges share a clause
    for name, rs in by_stack.items():
        more = f" (+{len(rs) - limit} more)" if len(rs) > limit else ""
        same.setdefault(f"experts {', '.join(rs[:limit])}{more}", []).append(name)
    return "; ".join(f"{', '.join(names)}: {text}" for text, names in same.items()) or "no experts"


#: fill per (collective kind, ledger phase); others get :data:`_MORE` in turn
CATEGORY_FILLS = {
    ("broadcast", "forward_broadcast"): "#4c72b0",
    ("broadcast", "backward_broadcast"): "#9ab8e6",
    ("reduce", "reduce"): "#dd8452",
    ("all_gather", "forward_broadcast"): "#1b9e77",
    ("all_gather", "backward_broadcast"): "#8fd3c1",
    ("reduce_scatter", "reduce"): "#c44e52",
    ("reduce", "replicate_reduce"): "#937860",
    ("broadcast", "replicate_broadcast"): "#8172b2",
    ("all_reduce", "tp"): "#da8bc3",
    ("all_gather", "tp"): "#b07aa1",
    ("all_reduce", "owner_group"): "#bcbd22",
    ("all_reduce", "qk_clip"): "#7f7f7f",
}
_MORE = ("#17becf", "#e377c2", "#8c564b", "#2ca02c", "#ff7f0e")


#: how the legend names a ledger phase
PHASE_LABELS = {
    "forward_broadcast": "forward",
    "backward_broadcast": "backward",
    "reduce": "gradient",
    "replicate_reduce": "replicate",
    "replicate_broadcast": "replicate",
    "tp": "TP",
    "owner_group": "owner-group",
    "qk_clip": "QK-clip",
}


def category_label(kind: str, phase: str) -> str:
    """``"forward broadcast"``, ``"gradient reduce-scatter"``, ``"TP all-reduce"`` for the legend."""
    return f"{PHASE_LABELS.get(phase, phase.replace('_', ' '))} {kind.replace('_', '-')}"


def collectives_chart(fig: PlanFigures) -> Svg:
    """Per boundary row: bytes per step (all ranks, the ledger's rule) of its collectives,
    stacked by kind and phase, with the calls and each buffer's collective (and all-gather
    padding) on the right; rows aggregate as the ownership map's."""
    rows = RowAxis(fig.names, max_height=520, min_h=8, max_h=16)
    extra = fig.coll[len(fig.names)]
    cats: list[tuple[str, str]] = []
    for row in fig.coll:
        for key in row:
            if key not in cats:
                cats.append(key)
    order = list(CATEGORY_FILLS)
    cats.sort(key=lambda c: (order.index(c) if c in order else len(order), c))
    fills = {}
    more = iter(_MORE * 4)
    for c in cats:
        fills[c] = CATEGORY_FILLS.get(c) or next(more)
    data_rows = []
    for lo, hi in rows.bins:
        agg: dict[tuple[str, str], list[int]] = {}
        kinds: dict[str, int] = {}
        pad = used = 0
        for b in range(lo, hi + 1):
            for key, (calls, nbytes) in fig.coll[b].items():
                slot = agg.setdefault(key, [0, 0])
                slot[0] += calls
                slot[1] += nbytes
            for _, numel, kind, _, padding in fig.buffers[b]:
                kinds[kind] = kinds.get(kind, 0) + 1
                pad += padding
                used += numel
        data_rows.append((rows.labels[rows.row_of[lo]], agg, kinds, pad, used))
    if extra:
        data_rows.append((STEP_ROW, {k: list(v) for k, v in extra.items()}, {}, 0, 0))
    vmax = max((sum(v[1] for v in agg.values()) for _, agg, *_ in data_rows), default=0)
    caption = (
        "Bytes per step summed over all ranks (each collective charged as the ledger does: k−1 payloads for a "
        "broadcast or reduce over k ranks), stacked by collective kind and phase; right: calls per step and "
        "each buffer's collective." + (f" Aggregated: {rows.describe()}." if rows.aggregated else "")
    )
    svg = Svg(PAGE_WIDTH, 0, label="collectives", data={"rows": len(data_rows), "total-nbytes": fig.cost.total_nbytes})
    y = header_block(svg, "Collectives per boundary", caption)
    bar_x, bar_w = LABEL_W, 560
    text_x = bar_x + bar_w + 10
    row_h = rows.row_h
    font = max(7, min(10, row_h - 1))
    y += 4
    for i, (label, agg, kinds, pad, used) in enumerate(data_rows):
        y0 = y + i * row_h
        total = sum(v[1] for v in agg.values())
        calls = sum(v[0] for v in agg.values())
        svg.raw(f'<g data-row="{i}" data-nbytes="{total}" data-calls="{calls}">')
        # every row labelled (a smaller font where rows are thin; rows aggregate past MAX_ROWS, said in the caption)
        svg.text(LABEL_W - 6, y0 + min(row_h, 12) - 2, fit(label, LABEL_W - 12, font), size=font, anchor="end")
        x = bar_x
        for key in cats:
            if key not in agg:
                continue
            n, nbytes = agg[key]
            w = bar_w * nbytes / vmax if vmax else 0
            svg.rect(
                x,
                y0,
                w,
                row_h - 2,
                fills[key],
                probe=True,
                title=f"{label}: {category_label(*key)}: {n:,} calls, {fmt_bytes(nbytes)} per step (all ranks)",
            )
            x += w
        svg.raw("</g>")
        kind_text = ", ".join(f"{k.replace('_', '-')}" + (f" ×{c}" if c > 1 else "") for k, c in kinds.items())
        pad_text = f", +{100 * pad / used:.1f}% padding" if pad and used else ""
        svg.text(
            text_x,
            y0 + min(row_h, 12) - 2,
            fit(
                f"{fmt_bytes(total)} · {calls:,} calls" + (f" · {kind_text}{pad_text}" if kind_text else ""),
                PAGE_WIDTH - text_x - 8,
                font,
            ),
            size=font,
            fill="#444444",
        )
    y = y + len(data_rows) * row_h + 20
    x = 10
    for key in cats:
        lab = category_label(*key)
        if x + 20 + len(lab) * 6.6 > PAGE_WIDTH - 10:
            x = 10
            y += 18
        svg.rect(x, y - 9, 12, 12, fills[key])
        svg.text(x + 16, y + 1, lab, size=11)
        x += 16 + len(lab) * 6.6 + 16
    svg.height = y + 14
    return svg
