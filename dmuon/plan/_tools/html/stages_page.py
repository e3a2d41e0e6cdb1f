"""The page of a pipelined model's plans: ``StagePlans.to_html()`` / ``python -m dmuon plan --pp K --html``.

One page: the split (which rule, which layers and modules each stage holds, one row per stage with
its dedicated matrices, bytes per step and balance), then each stage's plan page
(:mod:`dmuon.plan._tools.html.plan_page`) under a banner naming the stage. The root element
carries ``data-stages``, ``data-pp-size``, ``data-stages-per-rank`` and ``data-split``; the
overview has one ``<g data-stage>`` per stage with its layers, fingerprint and bytes per step.
"""

from __future__ import annotations

from typing import Any

from dmuon.plan._tools.html.maps import header_block
from dmuon.plan._tools.html.plan_page import BAR, plan_page
from dmuon.plan._tools.html.svg import PAGE_WIDTH, Page, Svg, document, esc, fit, fmt_bytes, title_section

__all__ = ["stages_page", "stages_html"]

#: banner fill above each stage's plan
BANNER = "#e8eef7"


def _span(split: Any, s: int) -> str:
    idx = split.stage_layers(s)
    return f"layers {idx[0]}–{idx[-1]}" if len(idx) > 1 else (f"layer {idx[0]}" if idx else "no layers")


def _others(split: Any, s: int) -> str:
    return ", ".join(m for m in split.stages[s] if not m.startswith(split.layers + "."))


def overview(sp: Any) -> Svg:
    """The split and one row per stage."""
    split, plans = sp.split, sp.plans
    S = split.num_stages
    P, V = split.pp_size, split.stages_per_rank
    plan0 = plans[0]
    R, N = plan0.mesh_shape
    T = plan0.tp_size
    mesh = (f"{R} × {N}" if R > 1 else f"{N}") + (f" × TP {T}" if T > 1 else "")
    holds = (
        "one per rank"
        if V == 1
        else f"{V} per rank: pipeline rank r holds stages r, r + {P}, ... (looped schedules such as Interleaved1F1B)"
    )
    caption = (
        f"{S} stages on {P} pipeline ranks ({holds}), {split.num_layers} layers of {split.layers}. Split: "
        f"{split.method}. Each stage is a model of its own for dmuon: its own plan, owners and buffers over the "
        f"stage's data-parallel ranks (mesh {mesh}; the world is {P} × that = {P * R * N * T:,} ranks), each "
        "plan shown below under its stage's banner. Bytes per step: one micro-batch (plan.cost); under a "
        "pipeline schedule Z2 moves the same per step and Z3 adds one forward and one backward broadcast per "
        "further micro-batch (dmuon.plan.pipeline_cost)."
    )
    svg = Svg(PAGE_WIDTH, 0, label="stages")
    y = header_block(svg, "Pipeline stages", caption) + 8
    cols = [
        (10, "stage"),
        (70, "pp rank"),
        (140, "holds"),
        (510, "dedicated (Muon)"),
        (700, "bytes per step, all ranks"),
    ]
    for x, name in cols:
        svg.text(x, y, name, size=11, bold=True, fill="#555555")
    y += 8
    top = max((p.cost.total_nbytes for p in plans), default=0) or 1
    bar_x, bar_w = 860, PAGE_WIDTH - 860 - 16
    for s, plan in enumerate(plans):
        others = _others(split, s)
        holds = _span(split, s) + (f" + {others}" if others else "")
        n_mat = sum(len(p.matrices) for p in plan.params)
        total = plan.cost.total_nbytes
        svg.raw(
            f'<g data-stage="{s}" data-layers="{" ".join(map(str, split.stage_layers(s)))}" '
            f'data-modules="{esc(" ".join(split.stages[s]))}" data-fingerprint="{plan.fingerprint()}" '
            f'data-total-nbytes="{total}">'
        )
        svg.rect(6, y + 2, PAGE_WIDTH - 12, 20, "#f7f9fc" if s % 2 else "#ffffff")
        svg.text(10, y + 16, str(s), size=12, bold=True)
        svg.text(70, y + 16, str(s % split.pp_size), size=12)
        svg.text(140, y + 16, fit(holds, 360, 12), size=12)
        what = f"{len(plan.params):,} params ({n_mat:,} matrices)" if plan.params else "none (AdamW only)"
        svg.text(510, y + 16, fit(what, 180, 12), size=12)
        svg.text(700, y + 16, fmt_bytes(total), size=12)
        svg.rect(
            bar_x,
            y + 6,
            max(1.0, bar_w * total / top),
            12,
            BAR,
            probe=True,
            title=f"stage {s}: {fmt_bytes(total)} per step over {plan.world_size * plan.tp_size} ranks",
        )
        svg.raw("</g>")
        y += 22
    svg.height = y + 10
    return svg


def banner(sp: Any, s: int) -> Svg:
    """The bar above stage ``s``'s plan sections."""
    split = sp.split
    others = _others(split, s)
    text = f"Stage {s} of {split.num_stages} · pipeline rank {s % split.pp_size} · {_span(split, s)}" + (
        f" + {others}" if others else ""
    )
    svg = Svg(PAGE_WIDTH, 34, label=f"stage {s}", data={"stage": s})
    svg.rect(0, 0, PAGE_WIDTH, 34, BANNER, stroke="#b9c8de")
    svg.set_probe(PAGE_WIDTH - 8, 8, BANNER)
    svg.text(12, 22, fit(text + " — its plan:", PAGE_WIDTH - 24, 15), size=15, bold=True)
    return svg


def stages_page(sp: Any, *, title: str | None = None, subtitle: str | None = None) -> Page:
    """The page (module docstring) as a :class:`~dmuon.plan._tools.html.svg.Page`; ``title`` (and
    ``subtitle``): a heading above the split naming the run (``python -m dmuon plan --pp`` passes the
    model and the mesh); none by default."""
    split = sp.split
    page = Page(
        "stages",
        data={
            "stages": split.num_stages,
            "pp-size": split.pp_size,
            "stages-per-rank": split.stages_per_rank,
            "split": split.method,
        },
    )
    if title:
        page.add(title_section(title, subtitle))
    page.add(overview(sp))
    for s, plan in enumerate(sp.plans):
        page.add(banner(sp, s))
        sub = plan_page(plan)
        for svg in sub.sections:
            svg.label = f"stage {s} {svg.label}"
            page.add(svg)
        if sub.tail:  # the stage's op listings, folded under one more level
            page.tail.append(
                '<details style="margin:0 0 8px 0;border:1px solid #dddddd;border-radius:4px;padding:4px 8px">'
                f'<summary style="cursor:pointer;font-weight:600">stage {s}: op listings</summary>'
                + "".join(sub.tail)
                + "</details>"
            )
    return page


def stages_html(sp: Any, *, standalone: bool = False, title: str | None = None, subtitle: str | None = None) -> str:
    """The page's HTML: a ``<div>`` fragment or, ``standalone``, a whole document; ``title``: the
    heading and the document's ``<title>`` (default: the number of stages)."""
    fragment = stages_page(sp, title=title, subtitle=subtitle).render()
    if not standalone:
        return fragment
    split = sp.split
    return document(fragment, title or f"dmuon plans of {split.num_stages} pipeline stages")
