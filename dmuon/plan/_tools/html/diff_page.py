"""The diff page: ``PlanDiff._repr_html_()`` / ``to_html()`` / ``python -m dmuon diff --html``.

Sections: the header card (both plans, changed settings, counts, totals, and which comparison
rule applies), bytes per phase before and after, both ownership maps on one colour scale with
the changed cells outlined, bytes per boundary before and after, and per rank.

The rule for plans on different meshes: rank numbers correspond only when both plans have the
same mesh ``(R, N)`` and TP degree. Then the per-rank section draws each rank's change (load,
bytes per step). Otherwise rank ``i`` of one plan is not rank ``i`` of the other, so nothing
is compared rank by rank: each map is drawn on its own mesh with the changed parameters'
owners outlined in each, boundaries (rows) are matched by FQN, and the per-rank section
compares the two DISTRIBUTIONS (per-rank values sorted, against the fraction of ranks).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dmuon.plan._records.owners import owner_ranks
from dmuon.plan._tools.html.axes import RowAxis
from dmuon.plan._tools.html.figures import PlanFigures
from dmuon.plan._tools.html.maps import LABEL_W, header_block, ownership_map, ownership_vmax, rank_axis, unit_fmt
from dmuon.plan._tools.html.svg import BLUES, PAGE_WIDTH, Page, Svg, document, fit, fmt_bytes, num

if TYPE_CHECKING:
    from dmuon.plan._tools.diff import PlanDiff

__all__ = ["diff_page", "diff_html", "same_ranks"]

BEFORE = "#9e9e9e"
AFTER = BLUES[6]
UP = "#d62728"  # more bytes / load: worse
DOWN = "#2ca02c"  # fewer: better


def same_ranks(a, b) -> bool:
    """True when rank numbers of plans ``a`` and ``b`` correspond: same mesh and TP degree."""
    return (a.mesh_shape, a.tp_size) == (b.mesh_shape, b.tp_size)


def _signed(v: float, fmt) -> str:
    return ("+" if v > 0 else "−" if v < 0 else "±") + fmt(abs(v))


def diff_page(d: PlanDiff) -> Page:
    """The diff page (module docstring). Raises ValueError for a :class:`PlanDiff` that does not
    hold its plans (one built by hand rather than by :func:`dmuon.plan.diff`)."""
    a, b = getattr(d, "before", None), getattr(d, "after", None)
    if a is None or b is None:
        raise ValueError("this PlanDiff does not hold its two plans: build it with dmuon.plan.diff(a, b) to draw it")
    fa, fb = PlanFigures(a), PlanFigures(b)
    same = same_ranks(a, b)
    page = Page(
        "diff",
        data={
            "same-ranks": int(same),
            "before": fa.fingerprint,
            "after": fb.fingerprint,
            "owners-moved": len(d.owners_moved),
            "changes": len(d.changes),
        },
    )
    page.add(_header(d, fa, fb, same))
    page.add(_phases(d))
    ax_a, ax_b = rank_axis(fa), rank_axis(fb)
    by = "weight" if a.cost_model == b.cost_model else "numel"  # one unit for both maps' shared scale
    vmax = max(ownership_vmax(fa, ax_a, RowAxis(fa.names), by), ownership_vmax(fb, ax_b, RowAxis(fb.names), by))
    hi_a, hi_b = _highlights(d, fa, fb)
    rule = "" if same else "Different meshes: rank numbers do not correspond; compare rows (boundaries) only."
    unit = "" if by == "weight" else " The cost models differ: both maps in elements."
    page.add(
        ownership_map(
            fa,
            title="Before: ownership",
            ax=ax_a,
            vmax=vmax,
            highlight=hi_a,
            label="map-before",
            by=by,
            note=f"One colour scale for both maps. Outlined: cells holding a parameter that moved, "
            f"changed or was removed.{unit} {rule}",
        )
    )
    page.add(
        ownership_map(
            fb,
            title="After: ownership",
            ax=ax_b,
            vmax=vmax,
            highlight=hi_b,
            label="map-after",
            by=by,
            note=f"Outlined: cells holding a parameter that moved, changed or was added.{unit} {rule}",
        )
    )
    page.add(_boundaries(fa, fb))
    page.add(_per_rank(fa, fb) if same else _distributions(fa, fb))
    return page


def diff_html(d: PlanDiff, *, standalone: bool = False) -> str:
    """The diff page's HTML: a fragment, or (``standalone``) a whole document."""
    page = diff_page(d)
    fragment = page.render()
    if not standalone:
        return fragment
    return document(fragment, f"plan diff {page.data['before'][:12]} -> {page.data['after'][:12]}")


def _highlights(d: PlanDiff, fa: PlanFigures, fb: PlanFigures) -> tuple[set, set]:
    """``(boundary index, mesh rank)`` cells of every changed parameter's owners, in each plan."""
    hi_a: set[tuple[int, int]] = set()
    hi_b: set[tuple[int, int]] = set()
    for c in d.changes:
        if c.owner_before is not None and c.boundary_before in fa._index:
            for r in owner_ranks(c.owner_before):
                hi_a.add((fa._index[c.boundary_before], r))
        if c.owner_after is not None and c.boundary_after in fb._index:
            for r in owner_ranks(c.owner_after):
                hi_b.add((fb._index[c.boundary_after], r))
    return hi_a, hi_b


def _header(d: PlanDiff, fa: PlanFigures, fb: PlanFigures, same: bool) -> Svg:
    from dmuon.plan._tools.render import mode_name, setting_str

    a, b = fa.plan, fb.plan
    svg = Svg(PAGE_WIDTH, 0, label="header")
    svg.text(12, 26, "Plan diff: before → after", size=18, bold=True)

    def who(p, f):
        R, N = p.mesh_shape
        return (
            f"{mode_name(p)}, mesh ({R}, {N})"
            + (f" × TP {p.tp_size}" if p.tp_size > 1 else "")
            + f", {len(p.params):,} params, cost model {p.cost_model}, fingerprint {f.fingerprint[:12]}"
        )

    lines = [f"before: {who(a, fa)}", f"after:  {who(b, fb)}"]
    for s in d.settings[:6]:
        lines.append(fit(f"setting {s.name}: {setting_str(s.before)} → {setting_str(s.after)}", PAGE_WIDTH - 30, 12))
    if len(d.settings) > 6:
        lines.append(f"… {len(d.settings) - 6} more settings")
    spec = sum(1 for c in d.changes if c.spec_changed)
    lines.append(
        f"{len(d.owners_moved):,} owners moved · {len(d.boundaries_changed):,} boundary changes · {spec:,} spec "
        f"changes · +{len(d.added):,} / −{len(d.removed):,} params · {len(d.layouts_changed):,} layouts changed"
    )
    lines.append(
        "Ranks correspond (same mesh and TP degree): per-rank changes are drawn."
        if same
        else "Different meshes: rank i of one plan is not rank i of the other; boundaries are matched by FQN and "
        "per-rank figures compared as distributions."
    )
    y = svg.lines(12, 50, lines, size=12, step=17)
    unit, fmt = unit_fmt(b.cost_model)
    tiles = []
    for label, va, vb, f in (
        ("bytes per step, all ranks", fa.cost.total_nbytes, fb.cost.total_nbytes, fmt_bytes),
        ("busiest rank, bytes per step", fa.cost.max_rank_nbytes, fb.cost.max_rank_nbytes, fmt_bytes),
    ):
        tiles.append(
            (
                label,
                f"{f(va)} → {f(vb)}",
                _signed(vb - va, f) + (f" ({100 * (vb - va) / va:+.1f}%)" if va else ""),
                vb - va,
            )
        )
    la = max(fa.owned_weight) / (sum(fa.owned_weight) / len(fa.owned_weight)) if sum(fa.owned_weight) else 0
    lb = max(fb.owned_weight) / (sum(fb.owned_weight) / len(fb.owned_weight)) if sum(fb.owned_weight) else 0
    tiles.append(("max / mean LPT load", f"{la:.3f} → {lb:.3f}", f"{lb - la:+.3f}", lb - la))
    tiles.append(("ranks owning nothing", f"{fa.idle_ranks:,} → {fb.idle_ranks:,}", f"of {fa.S:,} → {fb.S:,}", 0))
    tw = (PAGE_WIDTH - 24 - 3 * 10) / 4
    y += 2
    for i, (name, value, sub, delta) in enumerate(tiles):
        x = 12 + i * (tw + 10)
        svg.rect(x, y, tw, 62, "#f3f6fa", stroke="#d5dde8", title=f"{name}: {value} ({sub})")
        svg.set_probe(x + tw - 6, y + 6, "#f3f6fa")  # a corner of the first tile, clear of its text
        svg.text(x + 8, y + 16, name, size=11, fill="#555555")
        svg.text(x + 8, y + 38, fit(value, tw - 16, 16), size=16, bold=True)
        svg.text(
            x + 8, y + 54, fit(sub, tw - 16, 11), size=11, fill=UP if delta > 0 else DOWN if delta < 0 else "#555555"
        )
    svg.height = y + 72
    return svg


def _phases(d: PlanDiff) -> Svg:
    rows = [c for c in d.costs if c.before or c.after]
    vmax = max([max(c.before, c.after) for c in rows if c.field not in ("total_nbytes", "max_rank_nbytes")] + [1])
    svg = Svg(PAGE_WIDTH, 0, label="phases")
    y = (
        header_block(
            svg,
            "Bytes per phase: before (grey) and after (blue)",
            "Bytes per step summed over all ranks, per ledger phase (the PlanDiff's cost deltas); totals and "
            "the busiest rank on their own scale. Red: more bytes after, green: fewer.",
        )
        + 6
    )
    bx, bw = 260, 480
    for c in rows:
        own = c.field in ("total_nbytes", "max_rank_nbytes")
        if own:
            y += 6
        scale = max(c.before, c.after, 1) if own else vmax
        svg.raw(f'<g data-field="{c.field}" data-before="{c.before}" data-after="{c.after}">')
        svg.text(
            10,
            y + 15,
            c.field.replace("_nbytes", "").replace("_", " ") + (" (own scale)" if own else ""),
            size=12,
            bold=own,
        )
        svg.rect(bx, y + 2, bw * c.before / scale, 10, BEFORE, title=f"before: {fmt_bytes(c.before)} ({c.before:,} B)")
        svg.rect(
            bx,
            y + 13,
            bw * c.after / scale,
            10,
            AFTER,
            title=f"after: {fmt_bytes(c.after)} ({c.after:,} B)",
            probe=True,
        )
        svg.raw("</g>")
        svg.text(bx + bw + 12, y + 11, f"{fmt_bytes(c.before)} → {fmt_bytes(c.after)}", size=11)
        svg.text(
            bx + bw + 200,
            y + 11,
            _signed(c.delta, fmt_bytes),
            size=11,
            bold=True,
            fill=UP if c.delta > 0 else DOWN if c.delta < 0 else "#555555",
        )
        y += 30
    svg.height = y + 6
    return svg


def _boundary_bytes(f: PlanFigures) -> dict[str, int]:
    return {name: sum(v[1] for v in f.coll[i].values()) for i, name in enumerate(f.names)}


def _boundaries(fa: PlanFigures, fb: PlanFigures) -> Svg:
    """Per boundary (matched by FQN; rows aggregate as the maps'): bytes per step of its
    collectives before (grey) and after (blue), and the change."""
    ba, bb = _boundary_bytes(fa), _boundary_bytes(fb)
    names = list(fb.names) + [n for n in fa.names if n not in bb]
    rows = RowAxis(names, max_height=520, min_h=10, max_h=18)
    vals = []
    for lo, hi in rows.bins:
        before = sum(ba.get(n, 0) for n in names[lo : hi + 1])
        after = sum(bb.get(n, 0) for n in names[lo : hi + 1])
        vals.append((before, after))
    vmax = max([max(x0, x1) for x0, x1 in vals] + [1])
    svg = Svg(PAGE_WIDTH, 0, label="boundaries", data={"rows": len(rows)})
    caption = (
        "Bytes per step of each boundary's collectives (all ranks), boundaries matched by FQN: before (grey) and "
        "after (blue); the change in red (more) or green (fewer)."
        + (f" Aggregated: {rows.describe()}." if rows.aggregated else "")
    )
    y = header_block(svg, "Bytes per boundary: before and after", caption) + 4
    bx, bw = LABEL_W, 480
    every = max(1, -(-11 // rows.row_h))
    half = (rows.row_h - 2) / 2
    for i, (before, after) in enumerate(vals):
        y0 = y + i * rows.row_h
        delta = after - before
        text = f"{rows.labels[i]}: {fmt_bytes(before)} → {fmt_bytes(after)} ({_signed(delta, fmt_bytes)})"
        svg.raw(f'<g data-row="{i}" data-before="{before}" data-after="{after}">')
        svg.rect(bx, y0, bw * before / vmax, half, BEFORE, title=text)
        svg.rect(bx, y0 + half, bw * after / vmax, half, AFTER, title=text, probe=True)
        svg.raw("</g>")
        if i % every == 0:
            svg.text(
                LABEL_W - 6, y0 + min(rows.row_h, 12) - 2, fit(rows.labels[i], LABEL_W - 12, 10), size=10, anchor="end"
            )
            svg.text(
                bx + bw + 12,
                y0 + min(rows.row_h, 12) - 2,
                f"{fmt_bytes(before)} → {fmt_bytes(after)}",
                size=10,
                fill="#444444",
            )
            svg.text(
                bx + bw + 200,
                y0 + min(rows.row_h, 12) - 2,
                _signed(delta, fmt_bytes),
                size=10,
                bold=bool(delta),
                fill=UP if delta > 0 else DOWN if delta < 0 else "#777777",
            )
    svg.height = y + len(rows) * rows.row_h + 14
    return svg


def _per_rank(fa: PlanFigures, fb: PlanFigures) -> Svg:
    """Same mesh: each rank's change of LPT load and of bytes per step (diverging bars)."""
    ax = rank_axis(fb)
    unit, fmt = unit_fmt(fb.plan.cost_model)
    svg = Svg(PAGE_WIDTH, 0, label="per-rank")
    caption = "Ranks correspond (same mesh): each rank's change, up = more after (red), down = less (green)." + (
        f" Aggregated: {ax.describe('their mean change')}." if ax.aggregated else ""
    )
    y = header_block(svg, "Per rank: change", caption) + 4
    if fa.plan.cost_model == fb.plan.cost_model:
        load = (f"LPT load ({unit})", fa.owned_weight, fb.owned_weight, fmt)
    else:
        load = ("owned elements", fa.owned_numel, fb.owned_numel, unit_fmt("numel")[1])
    for title, va, vb, f in (load, ("bytes per step", fa.mesh_comm(), fb.mesh_comm(), fmt_bytes)):
        delta = [x1 - x0 for x0, x1 in zip(va, vb)]
        cols = ax.reduce(delta)
        dmax = max([abs(v) for v in delta] + [1])
        h = 44
        mid = y + h
        svg.text(10, y + 14, title, size=12, bold=True)
        svg.text(10, y + 30, f"max +{f(max(max(delta), 0))}", size=10, fill=UP)
        svg.text(10, y + 44, f"max −{f(max(-min(delta), 0))}", size=10, fill=DOWN)
        svg.line(ax.x0, mid + 0.5, ax.x1, mid + 0.5, "#888888")
        svg.raw(f'<g data-panel="{title}" data-delta="{" ".join(str(int(v)) for v in delta)}">')
        for i, (mn, avg, mx) in enumerate(cols):
            v = avg
            hh = h * abs(v) / dmax
            svg.rect(
                ax.x[i],
                mid - hh if v > 0 else mid,
                max(1, ax.col_w - 1),
                hh,
                UP if v > 0 else DOWN,
                probe=True,
                title=f"{ax.label(i)}: {_signed(v, f)}"
                + (f" (min {_signed(mn, f)}, max {_signed(mx, f)})" if ax.size(i) > 1 else ""),
            )
        svg.raw("</g>")
        y += 2 * h + 16
    svg.height = y + 4
    return svg


def _quantiles(values, n: int = 128) -> list[float]:
    s = sorted(values, reverse=True)
    if len(s) <= n:
        return s
    return [s[min(len(s) - 1, int(i * len(s) / n))] for i in range(n)] + [s[-1]]


def _distributions(fa: PlanFigures, fb: PlanFigures) -> Svg:
    """Different meshes: each plan's per-rank load and bytes per step sorted (busiest first)
    against the fraction of its ranks: comparable whatever the mesh."""
    svg = Svg(PAGE_WIDTH, 0, label="per-rank")
    y = (
        header_block(
            svg,
            "Per rank: distributions (different meshes)",
            f"Rank numbers do not correspond ({fa.S:,} → {fb.S:,} ranks), so each plan's per-rank values are "
            "sorted, largest first, and drawn against the fraction of its ranks: before grey, after blue.",
        )
        + 6
    )
    x0, w, h = LABEL_W, PAGE_WIDTH - LABEL_W - 40, 90
    unit, fmt = unit_fmt(fb.plan.cost_model)
    same_unit = fa.plan.cost_model == fb.plan.cost_model
    panels = [
        (
            (f"LPT load ({unit})" if same_unit else "owned elements"),
            fa.owned_weight if same_unit else fa.owned_numel,
            fb.owned_weight if same_unit else fb.owned_numel,
            fmt if same_unit else unit_fmt("numel")[1],
        ),
        ("bytes per step", fa.mesh_comm(), fb.mesh_comm(), fmt_bytes),
    ]
    for title, va, vb, f in panels:
        vmax = max(max(va, default=0), max(vb, default=0), 1) * 1.05
        svg.text(10, y + 14, title, size=12, bold=True)
        svg.text(10, y + 30, f"before max {f(max(va, default=0))}", size=10, fill="#666666")
        svg.text(10, y + 44, f"after max {f(max(vb, default=0))}", size=10, fill=AFTER)
        svg.rect(x0, y, w, h, "#fafafa", stroke="#dddddd")
        for values, colour in ((va, BEFORE), (vb, AFTER)):
            q = _quantiles(values)
            n = max(1, len(q) - 1)
            pts = " ".join(f"{num(x0 + w * i / n)},{num(y + h - h * v / vmax)}" for i, v in enumerate(q))
            svg.raw(f'<polyline points="{pts}" fill="none" stroke="{colour}" stroke-width="2"/>', shapes=1)
        svg.text(x0, y + h + 12, "largest first", size=9, fill="#666666")
        svg.text(x0 + w, y + h + 12, "smallest last", size=9, anchor="end", fill="#666666")
        y += h + 26
    svg.rect(x0, y - 6, 14, 6, BEFORE)
    svg.text(x0 + 20, y, "before", size=11)
    svg.rect(x0 + 80, y - 6, 14, 6, AFTER, probe=True)
    svg.text(x0 + 100, y, "after", size=11)
    svg.height = y + 12
    return svg
