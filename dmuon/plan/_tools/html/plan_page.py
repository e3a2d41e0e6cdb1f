"""The plan page: ``plan._repr_html_()`` / ``plan.to_html()`` / ``python -m dmuon plan --html``.

Sections, top to bottom (each one SVG of fixed size, :mod:`dmuon.plan._tools.html.svg`): the
header card (mesh and roles, Z2/Z3, cost model, fingerprint, balance against the LPT bound),
the ownership map, per-rank bars, bytes per phase against FSDP2 + naive Muon, collectives per
boundary, the experts (plans with expert stacks), the step schedule by phase; then the first
boundary's ops of rank 0 and of the busiest rank, folded under ``<details>``. The root element
carries the figures a test reads back (``data-owned-numel``, ``data-owned-weight``,
``data-comm-nbytes``: space-separated per rank; ``data-bound``; per phase ``<g data-field>``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dmuon.plan._records.owners import OwnerGroup
from dmuon.plan._tools.html.axes import RankAxis
from dmuon.plan._tools.html.figures import PlanFigures
from dmuon.plan._tools.html.maps import collectives_chart, experts_map, header_block, ownership_map, rank_axis, unit_fmt
from dmuon.plan._tools.html.svg import (
    BLUES,
    PAGE_WIDTH,
    Page,
    Svg,
    details,
    document,
    fit,
    fmt_bytes,
    fmt_count,
    fmt_flops,
    num,
    title_section,
    wrap,
)

if TYPE_CHECKING:
    from dmuon.plan._records.plan import ShardingPlan

__all__ = [
    "plan_page",
    "plan_html",
    "page_mode_name",
    "header_card",
    "per_rank_bars",
    "phases_chart",
    "schedule_section",
]

#: colours of the per-rank bars and the lines over them
BAR = BLUES[6]
BAR_LIGHT = BLUES[3]
BAR_DARK = BLUES[8]
MEAN = "#333333"
BOUND = "#d62728"
BASELINE = "#7f7f7f"
OURS = BLUES[6]
THEIRS = "#b0b0b0"
#: listing lines per rank under <details>
LISTING_OPS = 200


def _ints(values) -> str:
    return " ".join(str(int(v)) for v in values)


def plan_page(plan: ShardingPlan, *, title: str | None = None, subtitle: str | None = None) -> Page:
    """The plan page (module docstring) as a :class:`~dmuon.plan._tools.html.svg.Page`; ``title``
    (and ``subtitle``): a heading above the sections naming the run (``python -m dmuon plan`` passes
    the model and the mesh); none by default."""
    fig = PlanFigures(plan)
    R, N = plan.mesh_shape
    page = Page(
        "plan",
        data={
            "fingerprint": fig.fingerprint,
            "mesh": f"{R},{N}",
            "tp": plan.tp_size,
            "cost-model": plan.cost_model,
            "bound": repr(float(fig.bound)),
            "owned-numel": _ints(fig.owned_numel),
            "owned-weight": _ints(fig.owned_weight),
            "comm-nbytes": _ints(fig.cost.per_rank_nbytes),
            "total-nbytes": fig.cost.total_nbytes,
            "baseline-total-nbytes": fig.base_cost.total_nbytes,
            "peak-nbytes": _ints(fig.mesh_peak()),
            "adamw-peak-nbytes": fig.adamw_memory.peak_nbytes,
            "ranks-above-adamw": _ints(r for r, v in enumerate(fig.mesh_peak()) if v > fig.adamw_memory.peak_nbytes),
        },
    )
    ax = rank_axis(fig)
    if title:
        page.add(title_section(title, subtitle))
    page.add(header_card(fig))
    page.add(ownership_map(fig, ax=ax))
    page.add(per_rank_bars(fig, ax))
    page.add(phases_chart(fig))
    page.add(collectives_chart(fig))
    from dmuon.plan._tools.render import expert_lines

    ex = experts_map(fig, ax=ax, lines=expert_lines(plan))
    if ex is not None:
        page.add(ex)
    svg, listings = schedule_section(fig)
    page.add(svg)
    page.tail.extend(listings)
    return page


def plan_html(
    plan: ShardingPlan, *, standalone: bool = False, title: str | None = None, subtitle: str | None = None
) -> str:
    """The plan page's HTML: a ``<div>`` fragment (``_repr_html_``) or, ``standalone``, a whole
    document (``to_html``, ``--html FILE``); ``title``: the heading and the document's ``<title>``
    (default: the mode and the fingerprint), ``subtitle``: a line under the heading."""
    page = plan_page(plan, title=title, subtitle=subtitle)
    fragment = page.render()
    if not standalone:
        return fragment
    return document(fragment, title or f"{page_mode_name(plan)} plan {page.data['fingerprint'][:12]}")


def page_mode_name(plan: ShardingPlan) -> str:
    """The mode as the pages spell it: ``dmuon Z3``, ``dmuon Z2 HSDP``."""
    from dmuon.plan._tools.render import mode_name

    return mode_name(plan).replace("DMuon-", "dmuon ")


# ----------------------------------------------------------------------------------- header
def header_card(fig: PlanFigures) -> Svg:
    """Mesh and roles, mode, cost model, fingerprint; the balance tiles and the LPT gauge."""
    plan = fig.plan
    R, N, T = fig.R, fig.N, fig.T
    unit, fmt = unit_fmt(plan.cost_model)
    weights = fig.owned_weight
    wmax, wmin = max(weights, default=0), min(weights, default=0)
    mean = sum(weights) / len(weights) if weights else 0
    ep = plan.ep_size
    roles = (f"replicate R = {R} × " if R > 1 else "") + f"shard N = {N}" + (f" × TP T = {T}" if T > 1 else "")
    roles += f" = {R * N * T:,} ranks" + (f"; expert parallel ep = {ep}" if ep > 1 else "")
    z = (
        (
            "Z3 (reshard_after_forward=True): a boundary's matrices are broadcast before its forward and again before "
            "its backward; gradients reduced to their owner"
        )
        if plan.reshard_after_forward
        else (
            "Z2 (reshard_after_forward=False): broadcast once before the forward, kept until the backward; gradients "
            "reduced to their owner"
        )
    )
    coll = getattr(getattr(plan, "collectives", None), "mode", None)
    settings = (
        f"cost model {plan.cost_model} (LPT weight: {unit}) · wire dtypes param "
        f"{(plan.param_dtype or 'storage').replace('torch.', '')}, reduce "
        f"{(plan.reduce_dtype or plan.param_dtype or 'storage').replace('torch.', '')} · align {plan.align_numel}"
        + (f" · collectives {coll}" if coll else "")
        + (" · HSDP replicate broadcast async" if R > 1 and plan.replicate_async else "")
    )
    groups = sum(1 for o in plan.owners if isinstance(o, OwnerGroup))
    stacks = sum(1 for p in plan.params if p.experts is not None)
    n_mat = sum(len(p.matrices) for p in plan.params)
    numel = sum(p.numel for p in plan.params)
    what = (
        f"dedicated: {len(plan.params):,} params ({n_mat:,} Muon matrices), {fmt_count(numel)} elements, in "
        f"{len(plan.boundaries):,} hook boundaries"
        + (f" · {groups:,} owner groups" if groups else "")
        + (f" · {stacks:,} expert stacks" if stacks else "")
    )
    ident = f"plan fingerprint {fig.fingerprint[:16]} · model digest {plan.model_digest[:16]}"
    svg = Svg(
        PAGE_WIDTH,
        0,
        label="header",
        data={"max-weight": wmax, "mean-weight": repr(float(mean)), "bound": repr(float(fig.bound))},
    )
    svg.text(12, 26, f"{page_mode_name(plan)} sharding plan", size=18, bold=True)
    y = svg.lines(12, 48, [f"mesh: {roles}", z, settings, what], size=12, step=17)
    svg.text(12, y, ident, size=11, mono=True, fill="#555555")
    y += 14
    base_total = fig.base_cost.total_nbytes
    saving = 100.0 * (1 - fig.cost.total_nbytes / base_total) if base_total else 0.0
    busiest = fig.busiest_rank
    above_mean = 100.0 * (wmax / mean - 1) if mean else 0.0
    tiles = [
        (
            "balance: busiest / mean load",
            f"{wmax / mean:.3f}" if mean else "-",
            f"busiest {above_mean:+.1f} % (1 = even)",
        ),
        (
            "LPT worst case (not a target)",
            f"{fmt(fig.bound)} {unit}",
            "mean + largest matrix",
        ),
        ("ranks owning nothing", f"{fig.idle_ranks:,} of {fig.S:,}", "of the data-parallel mesh"),
        (
            "bytes per step, all ranks",
            fmt_bytes(fig.cost.total_nbytes),
            f"FSDP2+naive {fmt_bytes(base_total)} ({-saving:+.1f}%)",
        ),
        (
            "busiest rank by bytes",
            f"{fmt_bytes(fig.cost.max_rank_nbytes)}/step",
            f"rank {busiest} (FSDP2+naive {fmt_bytes(fig.base_cost.max_rank_nbytes)})",
        ),
    ]
    tw = (PAGE_WIDTH - 24 - 4 * 10) / 5
    for i, (name, value, sub) in enumerate(tiles):
        x = 12 + i * (tw + 10)
        svg.rect(x, y, tw, 62, "#f3f6fa", stroke="#d5dde8", title=f"{name}: {value} ({sub})")
        svg.set_probe(x + tw - 6, y + 6, "#f3f6fa")  # a corner of the first tile, clear of its text
        svg.text(x + 8, y + 16, name, size=11, fill="#555555")
        svg.text(x + 8, y + 38, fit(value, tw - 16, 18), size=18, bold=True)
        svg.text(x + 8, y + 54, fit(sub, tw - 16, 10), size=10, fill="#555555")
    y += 80
    # the balance gauge: max / min / mean of the LPT load against the bound
    gx, gw = 230, PAGE_WIDTH - 230 - 60
    xmax = max(fig.bound, wmax, 1) * 1.06
    sx = lambda v: gx + gw * v / xmax  # noqa: E731
    svg.text(12, y + 14, f"LPT load per rank ({unit})", size=12, bold=True)
    svg.rect(gx, y + 4, gw, 14, "#f0f0f0")
    svg.rect(gx, y + 4, sx(wmax) - gx, 14, BAR_LIGHT, title=f"busiest rank by {unit}: {fmt(wmax)} {unit}")
    svg.rect(gx, y + 4, sx(wmin) - gx, 14, BAR, title=f"least loaded rank: {fmt(wmin)} {unit}")
    svg.line(sx(mean), y, sx(mean), y + 22, MEAN, width=2, dash="4 2", title=f"mean {fmt(mean)}")
    svg.line(sx(fig.bound), y, sx(fig.bound), y + 22, BOUND, width=2, title=f"LPT bound {fmt(fig.bound)}")
    svg.text(gx, y + 34, "0", size=10, fill="#555555")
    labels = [
        (sx(wmin), f"min {fmt(wmin)}", BAR),
        (sx(mean), f"mean {fmt(mean)}", MEAN),
        (sx(wmax), f"max {fmt(wmax)}", BLUES[7]),
        (sx(fig.bound), f"bound {fmt(fig.bound)}", BOUND),
    ]
    last = -1e9
    row = 0
    for x, text, colour in sorted(labels):
        row = row + 1 if x - last < 90 else 0
        svg.text(x, y + 34 + 12 * row, text, size=10, anchor="middle", fill=colour)
        last = x
    y += 34 + 12 * 3 + 4
    note = (
        f"Balance reads from the busiest / mean tile ({wmax / mean:.3f}: the busiest rank carries "
        f"{above_mean:+.1f} % of the mean {unit}). The red line is the LPT bound, the worst that greedy LPT "
        "can give (the mean plus the largest single matrix): being under it is guaranteed, not a sign of "
        "balance. When the largest matrix is big next to the mean, no assignment can be even."
        if mean
        else "No rank owns anything: nothing to balance."
    )
    y = svg.lines(12, y, wrap(note, PAGE_WIDTH - 24, 11), size=11, step=15, fill="#555555")
    svg.height = y + 2
    return svg


# --------------------------------------------------------------------------------- per rank
#: the per-rank panel of the Muon matrices' packed buffers (not the memory table's transient term)
BUFFERS_PANEL = "Muon buffers held at once"
#: the grey reference line's label per panel (default: FSDP2 + naive Muon's mean over ranks)
BASE_NAMES = {"whole peak memory": "FSDP2+AdamW peak", BUFFERS_PANEL: "FSDP2+naive gathers"}


def per_rank_bars(fig: PlanFigures, ax: RankAxis) -> Svg:
    """Per mesh rank (the ownership map's columns): LPT load with its mean and the LPT bound,
    then (``ns_flops``) owned elements, resident bytes, the Muon buffers held at once and bytes per step,
    each with its mean and FSDP2 + naive Muon's mean."""
    plan = fig.plan
    unit, fmt = unit_fmt(plan.cost_model)
    T = fig.T

    def base_mean(field: str) -> float:
        vals = [getattr(s, field) for s in fig.base_stats]
        return sum(vals) / len(vals) if vals else 0.0

    panels = [(f"LPT load ({unit})", list(fig.owned_weight), fmt, fig.bound, None)]
    if plan.cost_model != "numel":
        panels.append(("owned elements", list(fig.owned_numel), fmt_count, None, None))
    peaks = fig.mesh_peak()
    adamw_peak = fig.adamw_memory.peak_nbytes
    panels += [
        ("whole peak memory", peaks, fmt_bytes, None, adamw_peak),
        ("resident bytes", fig.mesh_stat("resident_nbytes"), fmt_bytes, None, base_mean("resident_nbytes")),
        (
            BUFFERS_PANEL,
            fig.mesh_stat("peak_transient_nbytes"),
            fmt_bytes,
            None,
            base_mean("peak_transient_nbytes"),
        ),
        ("bytes per step", fig.mesh_comm(), fmt_bytes, None, base_mean("comm_nbytes")),
    ]
    caption = (
        "Per rank (the ownership map's columns): bar = the rank's figure; dashed = mean over ranks; red = the "
        "LPT bound on the load (total/ranks + largest item); grey = FSDP2 + naive Muon's mean on the same "
        "matrices. Resident: owned masters + momentum (+ HSDP replicas). Muon buffers held at once: the packed "
        "broadcast buffers of the Muon matrices a rank holds at once; its grey line is FSDP2 + naive Muon's "
        "larger of the Muon matrices it unshards at once and one gathered gradient. Neither is the memory "
        "table's transient term: dmuon's adds the gradient reduce buffer and FSDP2's largest unit of the other "
        "parameters; FSDP2 + naive Muon's is the larger of FSDP2's unsharded units and every Muon update "
        "gathered at once before its Newton-Schulz, plus the largest unit's gradient. Whole peak memory: every parameter, gradient and optimizer state of the model and "
        "the largest transient buffers (activations not included), against FSDP2 + AdamW's peak on the same "
        "mesh (grey)"
    )
    above = [r for r, v in enumerate(peaks) if v > adamw_peak]
    busiest = max(peaks, default=0)
    from dmuon.plan._tools.render import memory_gap

    top_rank = max(range(len(fig.stats)), key=lambda r: (fig.stats[r].memory.peak_nbytes, -r)) if fig.stats else 0
    gap = memory_gap(fig.stats[top_rank].memory, fig.adamw_memory) if fig.stats else ""
    if above:
        caption += (
            f": ABOVE it on {len(above)} of {len(peaks)} ranks ({', '.join(map(str, above[:8]))}"
            f"{' ...' if len(above) > 8 else ''}), busiest {fmt_bytes(busiest)} vs {fmt_bytes(adamw_peak)}."
        )
    else:
        caption += f": every rank at or below it (busiest {fmt_bytes(busiest)} vs {fmt_bytes(adamw_peak)})."
    if gap:
        caption += (
            f" The busiest rank by peak (schedule rank {top_rank}) minus FSDP2 + AdamW, by term: {gap}. dmuon keeps "
            "each owned matrix whole (parameter, gradient, one Muon momentum instead of AdamW's two moments) and "
            "FSDP2 shards the rest; its transient term is one boundary's broadcast buffer (Z3; Z2: all of them) "
            "plus one boundary's gradient reduce buffer and FSDP2's largest unit of the other parameters, where "
            "FSDP2 + AdamW holds its largest unit unsharded with that unit's gradient."
        )
    assembled = max(fig.plan.assembled_nbytes.values(), default=0)
    if assembled:
        caption += (
            f" Muon buffers held at once also count up to {fmt_bytes(assembled)} per boundary of compute tensors every rank "
            "assembles from their pieces (a fused gate/up expert stack planned as two matrices, owner-grouped "
            "matrices), which FSDP2 + naive Muon does not need."
        )
    if ax.aggregated:
        caption += f" Aggregated: {ax.describe('light bar: their max; dark line: their min')}."
    if T > 1:
        caption += f" With TP a column shows the largest of its {T} TP ranks."
    svg = Svg(PAGE_WIDTH, 0, label="per-rank")
    y = header_block(svg, "Per rank: load, memory and bytes", caption) + 4
    ph = 64
    for title, values, f, bound, base in panels:
        cols = ax.reduce(values)
        vmax = max(max(values, default=0), bound or 0, base or 0) * 1.08 or 1
        mean = sum(values) / len(values) if values else 0
        svg.text(10, y + 12, title, size=12, bold=True)
        svg.text(10, y + 28, f"max {f(max(values, default=0))}", size=10, fill="#555555")
        svg.line(10, y + 37.5, 26, y + 37.5, MEAN, width=1.2, dash="5 3")
        svg.text(30, y + 41, f"mean {f(mean)}", size=10, fill=MEAN)
        if bound is not None:
            svg.line(10, y + 50.5, 26, y + 50.5, BOUND, width=1.5)
            svg.text(30, y + 54, f"LPT bound {f(bound)}", size=10, fill=BOUND)
        base_name = BASE_NAMES.get(title, "FSDP2+naive mean")
        if base is not None:
            svg.line(10, y + 50.5, 26, y + 50.5, BASELINE, width=1.5, dash="8 3 2 3")
            svg.text(30, y + 54, f"{base_name} {f(base)}", size=10, fill=BASELINE)
        base_y = y + ph
        svg.line(ax.x0, base_y + 0.5, ax.x1, base_y + 0.5, "#999999")
        field = title.split(" (")[0].replace(" ", "-")
        svg.raw(
            f'<g data-panel="{field}" data-values="{_ints(values)}">'
            if len(values) <= 4096
            else f'<g data-panel="{field}">'
        )
        floor = []  # aggregated: the columns' minima, one step line
        for i, (mn, avg, mx) in enumerate(cols):
            x = ax.x[i]
            w = max(1, ax.col_w - (1 if ax.col_w >= 4 else 0))
            h_mx = ph * mx / vmax
            if ax.aggregated:
                svg.rect(
                    x,
                    base_y - h_mx,
                    w,
                    h_mx,
                    BAR_LIGHT,
                    probe=True,
                    title=f"{ax.label(i)}: min {f(mn)}, mean {f(avg)}, max {f(mx)}",
                )
                y_mn = num(base_y - ph * mn / vmax)
                floor.append(f"{'M' if not floor else 'L'}{num(x)} {y_mn}H{num(x + ax.col_w)}")
            else:
                svg.rect(x, base_y - h_mx, w, h_mx, BAR, title=f"{ax.label(i)}: {f(mx)}", probe=True)
        svg.raw("</g>")
        if floor:
            svg.path("".join(floor), stroke=BAR_DARK, width=1.5, title="the least loaded rank of each column")
        svg.line(
            ax.x0,
            base_y - ph * mean / vmax,
            ax.x1,
            base_y - ph * mean / vmax,
            MEAN,
            width=1.2,
            dash="5 3",
            title=f"mean {f(mean)}",
        )
        if bound is not None:
            svg.line(
                ax.x0,
                base_y - ph * bound / vmax,
                ax.x1,
                base_y - ph * bound / vmax,
                BOUND,
                width=1.5,
                title=f"LPT bound {f(bound)}",
            )
        if base is not None:
            svg.line(
                ax.x0,
                base_y - ph * base / vmax,
                ax.x1,
                base_y - ph * base / vmax,
                BASELINE,
                width=1.5,
                dash="8 3 2 3",
                title=f"{base_name.replace('+', ' + ')} {f(base)}",
            )
        y += ph + 14
    svg.height = y + 4
    return svg


# ----------------------------------------------------------------------------------- phases
def phases_chart(fig: PlanFigures) -> Svg:
    """Bytes per step (all ranks) per phase, dmuon against FSDP2 + naive Muon's matching phase
    (one scale); then the totals and the busiest rank (each pair on its own scale)."""
    from dmuon.plan._tools.render import _COST_ROWS

    ours_c, base_c = fig.cost, fig.base_cost
    rows = []
    for label, a, b in _COST_ROWS:
        ours = getattr(ours_c, a, 0) if a else None
        base = getattr(base_c, b, 0) if b else None
        if label in ("total", "busiest rank by bytes") or (ours or 0) + (base or 0) > 0:
            rows.append((label, a, b, ours, base))
    phases = [r for r in rows if r[0] not in ("total", "busiest rank by bytes")]
    totals = [r for r in rows if r[0] in ("total", "busiest rank by bytes")]
    vmax = max([(r[3] or 0) for r in phases] + [(r[4] or 0) for r in phases] + [1])
    base_total = base_c.total_nbytes
    saving = 100.0 * (1 - ours_c.total_nbytes / base_total) if base_total else 0.0
    caption = (
        f"Bytes per step summed over all ranks, from the schedule: dmuon (blue) against FSDP2 + naive all-gather "
        f"Muon on the same matrices (grey). dmuon moves {fmt_bytes(ours_c.total_nbytes)} where the baseline moves "
        f"{fmt_bytes(base_total)}: {saving:.1f}% less."
    )
    svg = Svg(PAGE_WIDTH, 0, label="phases")
    y = header_block(svg, "Bytes per phase against FSDP2 + naive Muon", caption) + 6
    lx, bx, bw = 10, 260, 480
    tx = bx + bw + 12

    def pair(label, a, b, ours, base, scale, bold=False):
        nonlocal y
        svg.raw(
            f'<g data-field="{a or ""}" data-baseline-field="{b or ""}" data-nbytes="{ours if ours is not None else ""}" '
            f'data-baseline-nbytes="{base if base is not None else ""}">'
        )
        svg.text(lx, y + 15, label, size=12, bold=bold)
        if ours is not None:
            svg.rect(
                bx,
                y + 2,
                bw * ours / scale,
                10,
                OURS,
                title=f"dmuon {label}: {fmt_bytes(ours)} ({ours:,} B)",
                probe=True,
            )
        if base is not None:
            svg.rect(
                bx, y + 13, bw * base / scale, 10, THEIRS, title=f"FSDP2+naive {label}: {fmt_bytes(base)} ({base:,} B)"
            )
        svg.raw("</g>")
        svg.text(tx, y + 11, "dmuon " + (fmt_bytes(ours) if ours is not None else "–"), size=11, fill=OURS)
        svg.text(
            tx + 140, y + 11, "FSDP2+naive " + (fmt_bytes(base) if base is not None else "–"), size=11, fill="#666666"
        )
        y += 30

    for row in phases:
        pair(*row, vmax)
    y += 6
    svg.line(lx, y, PAGE_WIDTH - 10, y, "#dddddd")
    y += 8
    for label, a, b, ours, base in totals:
        pair(label + " (own scale)", a, b, ours, base, max(ours or 0, base or 0, 1), bold=True)
    svg.height = y + 6
    return svg


# --------------------------------------------------------------------------------- schedule
#: display order of ledger phases, then the optimizer and the step's compute
PHASE_ORDER = (
    "forward_broadcast",
    "backward_broadcast",
    "reduce",
    "replicate_reduce",
    "replicate_broadcast",
    "tp",
    "owner_group",
    "qk_clip",
    "optimizer",
    "compute",
)


def schedule_section(fig: PlanFigures) -> tuple[Svg, list[str]]:
    """The step schedule by phase and op kind (ops in the whole table; rank 0's and the busiest
    rank's ops, bytes charged, NS FLOPs), and the ``<details>`` listings."""
    sched = fig.sched
    busiest = fig.busiest_rank
    ranks = [0] if busiest == 0 else [0, busiest]
    rank_ops = {r: sched.rank_ops(r) for r in ranks}
    per = {r: fig.rank_phases(r, rank_ops[r]) for r in ranks}
    keys = sorted(
        fig.op_counts, key=lambda k: (PHASE_ORDER.index(k[0]) if k[0] in PHASE_ORDER else len(PHASE_ORDER), k)
    )
    caption = (
        f"The nominal step as data: {len(sched.ops):,} ops in issue order, every rank issuing the ops whose group "
        f"holds it (plan.schedule(); plan.cost is summed from it). Per phase and op kind: ops in the table, "
        f"then per rank its ops and the bytes charged to it (NS: FLOPs), for rank 0 and the rank charged the most "
        f"bytes."
    )
    svg = Svg(PAGE_WIDTH, 0, label="schedule", data={"ops": len(sched.ops)})
    y = header_block(svg, "Step schedule by phase", caption) + 6
    heads = ["phase", "op kind", "ops (table)"] + [
        f"rank {r}" + (" (most bytes)" if r == busiest else "") for r in ranks
    ]
    xs = [10, 190, 330, 450, 750][: len(heads)]
    for x, h in zip(xs, heads):
        svg.text(x, y + 12, h, size=11, bold=True)
    y += 20
    vmax = max([v[1] for p in per.values() for v in p.values()] + [1])
    for i, key in enumerate(keys):
        phase, kind = key
        if i % 2 == 0:
            svg.rect(6, y - 2, PAGE_WIDTH - 12, 18, "#f6f8fb")
        svg.text(10, y + 11, phase.replace("_", " "), size=11)
        svg.text(190, y + 11, kind, size=11, mono=True)
        svg.text(330, y + 11, f"{fig.op_counts[key]:,}", size=11)
        for x, r in zip(xs[3:], ranks):
            ops, nbytes, flops = per[r].get(key, (0, 0, 0))
            if not ops:
                svg.text(x, y + 11, "–", size=11, fill="#999999")
                continue
            what = fmt_bytes(nbytes) if nbytes else (fmt_flops(flops) if flops else "")
            svg.text(x, y + 11, f"{ops:,} ops" + (f" · {what}" if what else ""), size=11)
            if nbytes:
                svg.rect(
                    x + 150,
                    y + 2,
                    130 * nbytes / vmax,
                    10,
                    OURS,
                    probe=True,
                    title=f"rank {r}: {phase} {kind}: {ops:,} ops, {fmt_bytes(nbytes)} charged",
                )
        y += 18
    svg.height = y + 8
    listings = []
    if fig.plan.boundaries:
        first = fig.plan.boundaries[0].fqn
        for r in ranks:
            if not any(op.boundary == first for op in rank_ops[r]):
                continue
            text = sched.summary(r, boundary=first, max_ops=LISTING_OPS)
            listings.append(
                details(
                    f"Ops of rank {r}{' (busiest by bytes)' if r == busiest and r else ''} in boundary {first or '<root>'!r} "
                    f"({len(rank_ops[r]):,} ops in its whole step: python -m dmuon plan ... --schedule {r})",
                    text,
                )
            )
    return svg, listings
