"""The pages in a real browser: headless Chromium renders the tiny dense plan, an MoE plan with
expert ranges, an HSDP plan, a plan diff, a simulator result and a pipelined model's stages page,
side by side in ONE launch
(one screenshot), and each section is checked not blank inside its known box (every section
is an SVG of fixed size whose top the page records in ``data-top``): enough pixels differ from
the white page, several colours, and the pixel at the section's ``data-probe`` point has the
fill the page drew there. The pages are also parsed and their ``data-*`` figures compared with
the plan's (diff's, simulation's) own.

Chromium: :func:`dmuon.plan._tools.html.browser.find_chromium` (``chromium``, Debian's package,
which ``.ci/run`` installs; ``chromium-browser``, ``google-chrome``, or ``DMUON_CHROMIUM``). Missing, the test fails under ``CI=true``
and skips with the reason elsewhere. Pixels are read with Pillow (matplotlib's dependency, in
the ``test`` extra)."""

from __future__ import annotations

import os

import numpy as np
import pytest

import dmuon.plan as P
from dmuon.sim import zoo
from dmuon.plan._tools.html.browser import find_chromium, screenshot
from html_pages import parse, root, sections

COLUMN_PX = 1120  # each page's column in the shared screenshot (pages are 1080 wide)


def chromium() -> str:
    """Path of a Chromium binary, or skip (fail under ``CI=true``) saying how to get one."""
    path = find_chromium()
    if path:
        return path
    why = "headless Chromium not found (apt-get install -y chromium, or set DMUON_CHROMIUM)"
    if os.environ.get("CI") == "true":
        pytest.fail(why + ": CI must run the browser test")
    pytest.skip(why)


def _pages():
    """``(name, page fragment, plan or None)`` of the six pages."""
    import dmuon.sim as S

    tiny = P.compile(zoo.tiny_llama(), 4)
    moe = P.compile(zoo.tiny_moe(), 4)
    hsdp = P.compile(zoo.llama3_8b(), (2, 4))
    model = zoo.llama3_8b()
    d = P.diff(P.compile(model, 8), P.compile(model, 8, cost_model="ns_flops"))
    wl = S.from_plan(tiny, tokens_per_rank=512, seq_len=512)
    sims = S.simulate_variants(
        tiny, S.hardware.preset("h100"), wl, variants=("adamw", "z3", "naive"), timeline_ranks=(0,)
    )
    stages = P.compile_stages(zoo.tiny_llama(), 2, pp=2)
    return [
        ("tiny", tiny._repr_html_(), tiny),
        ("moe", moe._repr_html_(), moe),
        ("hsdp", hsdp._repr_html_(), hsdp),
        ("diff", d._repr_html_(), d),
        ("simulation", sims._repr_html_(), sims),
        ("stages", stages._repr_html_(), stages),
    ]


def _check_figures(els, obj) -> None:
    """The ``data-*`` figures of a page equal its object's own."""
    kind = root(els).data("page")
    if kind == "plan":  # per-rank owned elements and bytes, the LPT bound, bytes per phase
        top = root(els)
        assert tuple(top.ints("owned-numel")) == obj.owned_numel
        assert tuple(top.ints("comm-nbytes")) == obj.cost.per_rank_nbytes
        assert float(top.data("bound")) == obj.balance_bound
        fields = [e for e in els if e.tag == "g" and e.attrs.get("data-field")]
        assert fields
        for g in fields:
            assert int(g.data("nbytes")) == getattr(obj.cost, g.data("field"))
    elif kind == "stages":  # each stage's layers, fingerprint and bytes per step
        rows = [e for e in els if e.tag == "g" and "data-stage" in e.attrs]
        assert [int(g.data("stage")) for g in rows] == list(range(len(obj.plans)))
        for g, plan in zip(rows, obj.plans):
            assert g.data("fingerprint") == plan.fingerprint()
            assert int(g.data("total-nbytes")) == plan.cost.total_nbytes
    elif kind == "diff":  # bytes per phase before and after
        rows = [e for e in els if e.tag == "g" and "data-before" in e.attrs and "data-field" in e.attrs]
        assert {g.data("field") for g in rows} == {c.field for c in obj.costs if c.before or c.after}
        for g in rows:
            c = next(c for c in obj.costs if c.field == g.data("field"))
            assert (int(g.data("before")), int(g.data("after"))) == (c.before, c.after)
    else:  # each variant's step and bytes
        rows = [e for e in els if e.tag == "g" and "data-variant" in e.attrs]
        assert [g.data("variant") for g in rows] == list(obj)
        for g in rows:
            assert float(g.data("step-s")) == obj[g.data("variant")].step_s
            assert int(g.data("comm-nbytes")) == obj[g.data("variant")].comm_nbytes


def _close(a, b, tol: int = 6) -> bool:
    return all(abs(x - y) <= tol for x, y in zip(a, b))


def test_pages_render_in_chromium(tmp_path):
    exe = chromium()
    Image = pytest.importorskip("PIL.Image", reason="Pillow (matplotlib's dependency) reads the screenshot")
    pages = _pages()
    height = 0
    columns = []
    for i, (name, page, obj) in enumerate(pages):
        els = parse(page)
        secs = sections(els)
        assert secs, name
        bottom = max(float(s.data("top")) + float(s.attrs["height"]) for s in secs)
        height = max(height, int(bottom) + 40)
        columns.append((name, i * COLUMN_PX, els, secs))
        _check_figures(els, obj)
    body = "".join(
        f'<div style="position:absolute;left:{x}px;top:0;width:1080px">{page}</div>'
        for (_, x, *_), (_, page, _) in zip(columns, pages)
    )
    sheet = tmp_path / "pages.html"
    sheet.write_text(
        "<!DOCTYPE html><html><head><meta charset='utf-8'></head>"
        f"<body style='margin:0;background:#ffffff'>{body}</body></html>",
        encoding="utf-8",
    )
    shot = tmp_path / "pages.png"
    width = len(pages) * COLUMN_PX
    screenshot(sheet, shot, width=width, height=height, chromium=exe)
    img = Image.open(shot).convert("RGB")
    assert img.size == (width, height), img.size
    checked = 0
    for name, x0, els, secs in columns:
        for s in secs:
            top, w, h = float(s.data("top")), float(s.attrs["width"]), float(s.attrs["height"])
            box = np.asarray(img.crop((int(x0), int(top), int(x0 + w), int(top + h))))
            pixels = box.reshape(-1, 3)
            inked = int((pixels != 255).any(axis=1).sum())
            where = f"{name}/{s.data('section')} box ({x0}, {top}, {w}x{h})"
            assert inked >= 0.01 * len(pixels), f"{where} is blank: {inked} of {len(pixels)} pixels drawn"
            colours = np.unique(pixels.astype(np.int32) @ np.array([65536, 256, 1], dtype=np.int32))
            assert len(colours) >= 3, f"{where}: {len(colours)} colours"
            assert "data-probe" in s.attrs, f"{where}: the section drew no probe shape"
            px, py, fill = s.data("probe").split(",")
            want = tuple(int(fill[i : i + 2], 16) for i in (1, 3, 5))
            got = img.getpixel((int(x0 + float(px)), int(top + float(py))))
            assert _close(got, want), f"{where}: pixel at the probe ({px}, {py}) is {got}, the page drew {fill}"
            checked += 1
    assert checked >= 5 * 4
