"""The HTML pages of plans, diffs and simulations, read back without a browser: the ``data-*``
figures equal the plan's own (per-rank owned elements and LPT load, bytes per rank and per
phase, the LPT bound, collectives per boundary summing to ``plan.cost``), every SVG is
well-formed XML, nothing is fetched or run (no script, style sheet, link or URL), the size
gates of the largest presets (page bytes and SVG shapes), the aggregation rule, the op visits
a page build costs, the diff's comparison rule across meshes, the simulator's page and the
``--html`` options. The browser test is ``tests/test_html_browser.py``."""

from __future__ import annotations

import copy
import html
import math
import re
import subprocess
import sys

import pytest

import dmuon.plan as P
from dmuon.sim import zoo
from dmuon.plan._records import plan_figures
from dmuon.plan._tools.html.axes import MAX_COLS, MAX_ROWS, RankAxis, RowAxis, row_label
from dmuon.plan._tools.html.svg import level, shape_count
from html_pages import check_well_formed, parse, root, section, sections, with_data

#: the size gate of the largest presets' plan pages (tests below): bytes of the page and SVG shapes
PAGE_LIMIT_NBYTES = 640 * 1024
SHAPE_LIMIT = 4000

_FORBIDDEN = ("<script", "<style", "<link", "<iframe", "<img", " src=", " href=", "url(", "@import", "javascript:")


def _check_self_contained(page: str) -> None:
    low = page.lower()
    for token in _FORBIDDEN:
        assert token not in low, token
    # the only URL is the SVG namespace (a name, never fetched)
    assert set(re.findall(r"https?://[^\s\"'<>]+", page)) <= {"http://www.w3.org/2000/svg"}


def _check_plan_page(plan, page: str) -> list:
    """The figures a plan page carries equal the plan's own; returns the parsed elements."""
    _check_self_contained(page)
    assert check_well_formed(page) == len(sections(parse(page)))
    els = parse(page)
    top = root(els)
    assert top.data("page") == "plan"
    assert tuple(top.ints("owned-numel")) == plan.owned_numel
    assert tuple(top.ints("owned-weight")) == plan.owned_weight
    assert tuple(top.ints("comm-nbytes")) == plan.cost.per_rank_nbytes
    assert float(top.data("bound")) == plan.balance_bound
    assert int(top.data("total-nbytes")) == plan.cost.total_nbytes
    assert int(top.data("baseline-total-nbytes")) == plan.baseline_cost.total_nbytes
    assert top.data("fingerprint") == plan.fingerprint()
    assert int(top.data("shapes")) == shape_count(page)
    # bytes per phase: every charted ByteCost / BaselineByteCost field, its own value
    phases = [e for e in with_data(els, "field") if e.tag == "g"]
    assert phases
    for g in phases:
        if g.data("field"):
            assert int(g.data("nbytes")) == getattr(plan.cost, g.data("field")), g.data("field")
        if g.data("baseline-field"):
            assert int(g.data("baseline-nbytes")) == getattr(plan.baseline_cost, g.data("baseline-field"))
    charted = {g.data("field") for g in phases}
    assert {f for f in plan.cost.PHASES if getattr(plan.cost, f)} <= charted  # no nonzero phase left out
    # the ownership map's rows hold the whole LPT load; the per-rank panel holds each rank's
    rows = [e for e in els if e.tag == "g" and "data-weight" in e.attrs]
    assert sum(int(e.data("weight")) for e in rows) == sum(plan.owned_weight)
    panel = next(e for e in els if e.tag == "g" and e.attrs.get("data-panel") == "LPT-load")
    assert tuple(panel.ints("values")) == plan.owned_weight
    # collectives per boundary add up to the plan's bytes per step
    coll = section(els, "collectives")
    assert int(coll.data("total-nbytes")) == plan.cost.total_nbytes
    assert sum(int(e.data("nbytes")) for e in els if e.tag == "g" and "data-calls" in e.attrs) == plan.cost.total_nbytes
    # sections stack: each top is the previous top + height + the gap
    secs = sections(els)
    for a, b in zip(secs, secs[1:]):
        assert float(b.data("top")) == pytest.approx(float(a.data("top")) + float(a.attrs["height"]) + 14)
    return els


def test_tiny_plan_page_figures_and_map_by_hand():
    plan = P.compile(zoo.tiny_llama(), 4)
    page = plan._repr_html_()
    els = _check_plan_page(plan, page)
    assert [s.data("section") for s in sections(els)] == [
        "header",
        "ownership",
        "per-rank",
        "phases",
        "collectives",
        "schedule",
    ]
    # the map by hand: row b holds the elements of boundary b's matrices; one column per rank
    own = section(els, "ownership")
    assert int(own.data("rows")) == len(plan.boundaries) and int(own.data("cols")) == 4
    rows = [e for e in els if e.tag == "g" and "data-weight" in e.attrs]
    for b, g in zip(plan.boundaries, rows):
        assert int(g.data("weight")) == sum(plan.param(e.fqn).numel for buf in b.buffers for e in buf.entries())
    # a cell's title names the rank and the matrices it owns there
    fqn = plan.dedicated[0]
    rank, bnd = plan.owner(fqn).rank, plan.boundary(fqn)
    short = fqn[len(bnd) + 1 :]
    assert re.search(rf"<title>{re.escape(bnd)} × rank {rank}: [^<]*{re.escape(short)}", page)
    # the listing of the first boundary is folded, the plain-text fallback is unchanged
    assert "<details" in page and "Ops of rank 0 in boundary" in page
    assert "DMuon-Z3 sharding plan" in plan.summary()


def test_hsdp_and_ns_flops_pages():
    plan = P.compile(zoo.tiny_llama(), (2, 2), cost_model="ns_flops")
    els = _check_plan_page(plan, plan.to_html())
    page = plan.to_html()
    assert page.startswith("<!DOCTYPE html>") and "<title>replica 1: mesh ranks 2–3 (shard 0–1)</title>" in page
    assert "LPT load (NS FLOPs)" in page and "owned elements" in page  # ns_flops: both panels
    assert [e.data("section") for e in sections(els)][:3] == ["header", "ownership", "per-rank"]


@pytest.mark.parametrize("preset", ["tiny-moe/4", "qwen3-30b-a3b/64"])
def test_moe_page_experts_section(preset):
    """Every expert range is named in the experts map (by the stack's attribute name: unique per
    boundary in these models)."""
    plan = P.compile(zoo.tiny_moe(), 4) if preset.startswith("tiny") else P.compile(zoo.qwen3_30b_a3b(), 64)
    els = _check_plan_page(plan, plan._repr_html_())
    ex = section(els, "experts")
    stacks = [(p, o) for p, o in zip(plan.params, plan.owners) if p.experts is not None]
    assert int(ex.data("experts")) == max(p.num_experts for p, _ in stacks)
    page = plan._repr_html_()
    for p, o in stacks[:6]:  # every expert range is named in the title of its rank's cell, under its stack
        if isinstance(o, P.ExpertOwners):
            for member, off, size in zip(o.members, o.offsets(), o.sizes):
                assert (off, off + size - 1) in _expert_ranges_named(page, member.rank, p.attr)


def _expert_ranges_named(page: str, rank: int, stack: str) -> set[tuple[int, int]]:
    """The ``(first, last)`` expert ranges of ``stack`` the experts map's titles give ``rank``
    (a cell of one rank lists them; a run of ranks states a progression ``F–L, k per rank in rank
    order``; a cell of several ranks lists them per rank)."""
    svg = next(t for t in re.findall(r"<svg\b.*?</svg>", page, flags=re.S) if 'data-section="experts"' in t)
    out = set()

    def ranges(text):
        return {tuple(int(v) for v in (r.split("–") * 2)[:2]) for r in text.split(", ")}

    for title in (html.unescape(t) for t in re.findall(r"<title>([^<]*)</title>", svg)):
        m = re.search(r" × ranks? (\d+)(?:–(\d+))?: (.*)$", title)
        if not m or ": experts " not in title:
            continue
        lo, hi, body = int(m.group(1)), int(m.group(2) or m.group(1)), m.group(3)
        if not lo <= rank <= hi:
            continue
        for part in body.split(" | "):
            if part.startswith("rank "):  # per-rank listing of a cell of several ranks
                r, part = part[5:].split(": ", 1)
                if int(r) != rank:
                    continue
            for piece in part.split("; "):
                names, _, text = piece.partition(": experts ")
                if stack not in names.split(", "):
                    continue
                prog = re.fullmatch(r"(\d+)–(\d+), (\d+) per rank in rank order", text)
                if prog:
                    k = int(prog.group(3))
                    first = int(prog.group(1)) + (rank - lo) * k
                    out.add((first, first + k - 1))
                else:
                    out |= ranges(text)
    return out


def test_tp_page_per_schedule_rank_bytes():
    from dmuon.plan._model.parallel import megatron_tp_shard_dims

    model = zoo.tiny_llama()
    plan = P.compile(model, 2, tp=P.TPPolicy(size=2, shard_dims=megatron_tp_shard_dims(model)))
    page = plan._repr_html_()
    els = _check_plan_page(plan, page)
    assert len(root(els).ints("comm-nbytes")) == 4  # schedule ranks (R*N*T)
    assert "TP: a column is a data-parallel coordinate" in page
    spec = next(p for p in plan.params if p.tp_size > 1)  # a cell names how its owner's TP group runs NS
    assert f"{spec.fqn[len(plan.boundary(spec.fqn)) + 1 :]} [TP {spec.tp_ns}]" in page
    assert "TP all-" in page  # the TP collectives have their category in the chart


def test_aggregation_rule():
    ax = RankAxis(8, 128, x0=0, width=880)  # HSDP 8x128: 16 columns of 8 shard ranks per replica
    assert len(ax) == MAX_COLS and ax.per_col == 8 and ax.by_row
    assert all(ax.replica[i] == ax.bins[i][0] // 128 == ax.bins[i][1] // 128 for i in range(len(ax)))
    assert ax.col_of[1023] == len(ax) - 1 and ax.bins[0] == (0, 7)
    flat = RankAxis(64, 4, x0=0, width=880)  # more replicas than MAX_COLS // 4: columns mix rows
    assert not flat.by_row and flat.per_col == 2 and set(flat.replica) == {None}
    small = RankAxis(2, 8, x0=0, width=880)
    assert not small.aggregated and len(small) == 16 and small.gap == 4
    rows = RowAxis([f"model.layers.{i}" for i in range(126)])
    assert len(rows) == 63 <= MAX_ROWS and rows.per_row == 2 and rows.labels[1] == "model.layers.2–3"
    assert row_label(["a.0", "b.1"]) == "a.0 … b.1" and row_label([""]) == "<root>"
    assert [level(v, 8.0) for v in (0, 0.01, 1, 4, 8, 9)] == [0, 1, 1, 4, 8, 8]
    assert ax.reduce(list(range(1024)))[1] == (8, 11.5, 15)


@pytest.mark.parametrize("name", ["llama3-405b/1024 owner groups", "deepseek-v3/256"])
def test_size_gate_of_the_largest_presets(name):
    """The hard gate: a page of at most PAGE_LIMIT_NBYTES bytes and SHAPE_LIMIT SVG shapes,
    aggregated and saying so, its figures still exact."""
    if name.startswith("llama"):
        plan = P.compile(zoo.llama3_405b(), 1024, owner_groups="auto")
    else:
        plan = P.compile(zoo.deepseek_v3(), 256)
    page = plan._repr_html_()
    nbytes, shapes = len(page.encode("utf-8")), shape_count(page)
    assert nbytes <= PAGE_LIMIT_NBYTES, nbytes
    assert shapes <= SHAPE_LIMIT, shapes
    els = _check_plan_page(plan, page)
    own = section(els, "ownership")
    S = plan.world_size
    assert int(own.data("cols")) <= MAX_COLS and int(own.data("rows")) <= MAX_ROWS
    assert int(own.data("ranks-per-col")) == math.ceil(S / MAX_COLS)
    said = own.data("aggregation")  # the rule as the picture states it, under its title
    assert f"{S:,} ranks > {MAX_COLS}: a column is {math.ceil(S / MAX_COLS)} consecutive ranks" in said
    if len(plan.boundaries) > MAX_ROWS:
        assert f"a row is {math.ceil(len(plan.boundaries) / MAX_ROWS)} consecutive boundaries" in said
    assert f"Aggregated: {said}." in _section_text(page, "ownership")


def _section_text(page: str, name: str) -> str:
    """The visible text of section ``name``'s SVG, lines joined by spaces (titles left out)."""
    svg = next(s for s in re.findall(r"<svg\b.*?</svg>", page, flags=re.S) if f'data-section="{name}"' in s)
    return html.unescape(" ".join(re.findall(r"<text[^>]*>(?:<title>.*?</title>)?([^<]*)</text>", svg)))


class _CountingOps(tuple):
    """A schedule's op table that counts every op read (iteration or index)."""

    visits = 0

    def __iter__(self):
        for op in tuple.__iter__(self):
            _CountingOps.visits += 1
            yield op

    def __getitem__(self, i):
        out = tuple.__getitem__(self, i)
        _CountingOps.visits += len(out) if isinstance(i, slice) else 1
        return out


@pytest.mark.parametrize("preset", ["tiny-moe/2x2", "llama3-405b/1024 owner groups"])
def test_page_build_reads_the_schedule_twice_at_most(monkeypatch, preset):
    """The build cost, as a count: the op table is walked at most twice (rank_stats' pass and the
    page's per-boundary pass) plus the ops of two ranks (rank 0 and the busiest) a few times
    each; the planner is never re-run and the schedule never rebuilt."""
    if preset.startswith("tiny"):
        plan = P.compile(zoo.tiny_moe(), (2, 2))
    else:
        plan = P.compile(zoo.llama3_405b(), 1024, owner_groups="auto")
    nominal = plan.schedule()
    counted = copy.copy(nominal)
    object.__setattr__(counted, "ops", _CountingOps(nominal.ops))
    monkeypatch.setattr(plan_figures, "schedule", lambda p, step=None: counted)
    from dmuon.plan._ownership import partition
    from dmuon.plan._scheduling import builder

    for module, name in ((partition, "lpt_partition"), (partition, "lpt_partition_groups"), (builder, "schedule")):
        monkeypatch.setattr(module, name, lambda *a, _n=name, **k: pytest.fail(f"the page called {_n}"))
    _CountingOps.visits = 0
    plan._repr_html_()
    busiest = max(range(len(plan.cost.per_rank_nbytes)), key=lambda r: (plan.cost.per_rank_nbytes[r], -r))
    two_ranks = len(nominal.rank_ops(0)) + len(nominal.rank_ops(busiest))
    assert 0 < _CountingOps.visits <= 2 * len(nominal.ops) + 3 * two_ranks, (
        _CountingOps.visits,
        len(nominal.ops),
        two_ranks,
    )


def test_diff_page_same_mesh_outlines_the_moved_owners():
    model = zoo.llama3_8b()
    a, b = P.compile(model, 8), P.compile(model, 8, cost_model="ns_flops")
    d = P.diff(a, b)
    assert d.owners_moved and d.before is a and d.after is b
    page = d._repr_html_()
    _check_self_contained(page)
    check_well_formed(page)
    els = parse(page)
    top = root(els)
    assert top.data("page") == "diff" and top.data("same-ranks") == "1"
    assert int(top.data("owners-moved")) == len(d.owners_moved)
    for g in (e for e in els if e.tag == "g" and "data-before" in e.attrs and "data-field" in e.attrs):
        c = next(c for c in d.costs if c.field == g.data("field"))
        assert (int(g.data("before")), int(g.data("after"))) == (c.before, c.after)
    # per boundary (matched by FQN): its collectives' bytes before and after
    rows = [e for e in els if e.tag == "g" and "data-row" in e.attrs and "data-before" in e.attrs]
    assert sum(int(g.data("before")) for g in rows) == a.cost.total_nbytes
    assert sum(int(g.data("after")) for g in rows) == b.cost.total_nbytes
    # the cost models differ: both maps in elements, on one scale
    maps = [section(els, "map-before"), section(els, "map-after")]
    assert maps[0].data("vmax") == maps[1].data("vmax") and "both maps in elements" in page
    # per rank: each rank's change of bytes per step, exactly
    panel = next(e for e in els if e.tag == "g" and e.attrs.get("data-panel") == "bytes per step")
    assert panel.ints("delta") == [y - x for x, y in zip(a.cost.per_rank_nbytes, b.cost.per_rank_nbytes)]
    # every moved owner's cell is outlined in both maps
    for fqn in d.owners_moved:
        c = d[fqn]
        assert f"changed: {c.boundary_before} × rank" in page
    # the diff is compared without its plans; one built by hand cannot be drawn
    bare = P.PlanDiff(changes=d.changes, costs=d.costs, settings=d.settings, layouts_changed=d.layouts_changed)
    assert bare == d
    with pytest.raises(ValueError, match="dmuon.plan.diff"):
        bare.to_html()


def test_diff_page_different_meshes_compares_distributions():
    model = zoo.tiny_llama()
    a, b = P.compile(model, 4), P.compile(model, (2, 4))
    page = P.diff(a, b).to_html()
    els = parse(page)
    assert root(els).data("same-ranks") == "0"
    per_rank = section(els, "per-rank")
    assert "distributions" in page and "Rank numbers do not correspond (4 → 8 ranks)" in page
    assert not any("data-delta" in e.attrs for e in els)  # nothing compared rank by rank
    assert page.count("<polyline") == 4 and per_rank is not None
    assert [s.data("section") for s in sections(els)] == [
        "header",
        "phases",
        "map-before",
        "map-after",
        "boundaries",
        "per-rank",
    ]


def test_simulation_page():
    import dmuon.sim as S
    from dmuon.sim._pages.sim_html import merge_bars
    from dmuon.sim._engine.records import Interval

    plan = P.compile(zoo.tiny_llama(), 4)
    hw = S.hardware.preset("h100")
    wl = S.from_plan(plan, tokens_per_rank=512, seq_len=512)
    sims = S.simulate_variants(plan, hw, wl, variants=("adamw", "z3"), timeline_ranks=(0,))
    assert isinstance(sims, dict) and isinstance(sims, S.Simulations)
    page = sims._repr_html_()
    _check_self_contained(page)
    check_well_formed(page)
    els = parse(page)
    assert root(els).data("page") == "simulation"
    rows = [e for e in els if e.tag == "g" and "data-variant" in e.attrs]
    assert [r.data("variant") for r in rows] == ["adamw", "z3"]
    for r in rows:
        s = sims[r.data("variant")]
        assert float(r.data("step-s")) == s.step_s and int(r.data("comm-nbytes")) == s.comm_nbytes
    assert "Timeline of rank 0 per variant" in page and "z3: step" in page
    assert sims["z3"]._repr_html_().count('data-variant="z3"') == 1  # one Simulation draws itself too
    # the merge rule: same lane and kind, < 0.5 px apart (here 1 px = 1 ms)
    ivs = [
        Interval(0.000, 0.001, "bcast", "broadcast", "a"),
        Interval(0.0013, 0.002, "bcast", "broadcast", "b"),
        Interval(0.0030, 0.004, "bcast", "broadcast", "c"),
        Interval(0.004, 0.005, "bcast", "reduce", "d"),
        Interval(0.006, 0.006, "bcast", "broadcast", "zero"),
    ]
    assert merge_bars(ivs, scale=1000.0) == [
        (0.0, 0.002, "broadcast", 2, "a"),
        (0.003, 0.004, "broadcast", 1, "c"),
        (0.004, 0.005, "reduce", 1, "d"),
    ]


def test_simulation_page_memory_by_term_and_fit():
    """The memory section: each variant's busiest rank by peak, its terms, '> device' on those above
    the device, and dmuon minus FSDP2 + AdamW by term."""
    import dataclasses

    import dmuon.sim as S
    from dmuon.sim._pages.sim_html import MEMORY_TERMS

    plan = P.compile(zoo.tiny_llama(), 4)
    wl = S.from_plan(plan, tokens_per_rank=512, seq_len=512)
    sims = S.simulate_variants(plan, S.hardware.preset("h100"), wl, variants=("adamw", "z2", "z3"), timeline_ranks=(0,))
    peaks = {v: max(s.peak_memory_nbytes) for v, s in sims.items()}
    sims.memory_nbytes = sorted(peaks.values())[1]  # the two larger peaks above the device
    page = sims._repr_html_()
    els = parse(page)
    assert [e.data("section") for e in sections(els)] == ["variants", "memory", "timeline"]
    rows = [e for e in els if e.tag == "g" and "data-memory-variant" in e.attrs]
    assert {r.data("memory-variant"): int(r.data("peak-nbytes")) for r in rows} == peaks
    over = [v for v, p in peaks.items() if p > sims.memory_nbytes]
    assert over and page.count(" &gt; device</text>") == 2 * len(over)  # the table's and the memory section's
    ref = max(sims["adamw"].ranks, key=lambda r: (r.memory.peak_nbytes, -r.rank)).memory
    z3 = max(sims["z3"].ranks, key=lambda r: (r.memory.peak_nbytes, -r.rank)).memory
    gap = ", ".join(
        f"{t} {(getattr(z3, f) - getattr(ref, f)) / 2**30:+,.2f}"
        for t, f in MEMORY_TERMS
        if getattr(z3, f) != getattr(ref, f)
    )
    assert f"dmuon Z3 minus FSDP2 + AdamW, GiB: {gap}." in html.unescape(page)
    assert "one Muon momentum instead of two moments" in page
    assert dataclasses.is_dataclass(z3)


def test_plan_page_header_says_what_balance_and_the_bound_mean():
    """The header's balance tile is busiest / mean; the LPT bound is named a worst case with its
    meaning; the per-rank caption gives the busiest rank's memory gap to FSDP2 + AdamW by term."""
    from dmuon.plan._tools.render import memory_gap

    plan = P.compile(zoo.tiny_moe(), 4)
    page = html.unescape(plan._repr_html_())
    text = " ".join(re.sub(r"<[^>]+>", " ", page).split())  # the page's words (wrapped lines joined)
    w = plan.owned_weight
    mean = sum(w) / len(w)
    assert "balance: busiest / mean load" in page and f">{max(w) / mean:.3f}<" in page
    assert "max / LPT bound" not in page and "LPT worst case (not a target)" in page
    assert "the mean plus the largest single matrix" in text and "not a sign of balance" in text
    stats = plan.rank_stats()
    top = max(range(len(stats)), key=lambda r: (stats[r].memory.peak_nbytes, -r))
    gap = memory_gap(stats[top].memory, plan.adamw_rank_stats()[0].memory)
    assert gap and f"(schedule rank {top}) minus FSDP2 + AdamW, by term: {gap}." in text
    # fields that do not apply are not shown: no TP, no HSDP, no owner groups on this plan
    header = page[: page.index('data-section="ownership"')]
    assert "TP T =" not in header and "replicate" not in header and "owner groups" not in header


def test_plan_pp_html_shows_every_stage(tmp_path, capsys):
    """``plan --pp K --stages-per-rank V --html``: one page, the split (which rule, which layers per
    stage) and every stage's plan under a banner naming it; the figures are each stage's own."""
    from dmuon._cli.plan_commands import main_plan

    path = str(tmp_path / "stages.html")
    assert (
        main_plan(["--model", "tiny-llama", "--mesh", "2", "--pp", "2", "--stages-per-rank", "2", "--html", path]) == 0
    )
    assert f"wrote {path} (" in capsys.readouterr().out
    page = open(path, encoding="utf-8").read()
    sp = P.compile_stages(zoo.tiny_llama(), 2, pp=2, stages_per_rank=2)
    # the command line names the run in the <title> and a heading; the rest is sp.to_html()'s page
    from dmuon.plan._tools.html.stages_page import stages_html

    title = "dmuon plan: tiny-llama on 4 ranks (Z3)"
    assert f"<title>{title}</title>" in page and "<title>dmuon plans of 4 pipeline stages</title>" in sp.to_html()
    subtitle = "mesh 2 · 2 pipeline ranks · cost model numel · 4 stages"
    assert page == stages_html(sp, standalone=True, title=title, subtitle=subtitle)
    assert html.unescape(page).count(subtitle) == 1
    _check_self_contained(page)
    els = parse(page)
    assert check_well_formed(page) == len(sections(els))
    top = root(els)
    assert top.data("page") == "stages" and int(top.data("stages")) == 4
    assert (int(top.data("pp-size")), int(top.data("stages-per-rank"))) == (2, 2)
    assert top.data("split") == sp.split.method and "the embedding and the head count as one layer each" in page
    rows = [e for e in els if e.tag == "g" and "data-stage" in e.attrs]
    assert [int(r.data("stage")) for r in rows] == [0, 1, 2, 3]
    for s, (r, plan) in enumerate(zip(rows, sp.plans)):
        assert r.data("layers").split() == [str(i) for i in sp.split.stage_layers(s)]
        assert r.data("modules").split() == list(sp.split.stages[s])
        assert r.data("fingerprint") == plan.fingerprint()
        assert int(r.data("total-nbytes")) == plan.cost.total_nbytes
        names = [e.data("section") for e in sections(els) if e.data("section").startswith(f"stage {s} ")]
        assert names[:2] == [f"stage {s} header", f"stage {s} ownership"], names
        assert f"Stage {s} of 4 · pipeline rank {s % 2}" in html.unescape(page)
    secs = sections(els)
    assert [s.data("section") for s in secs[:2]] == ["title", "stages"]
    for a, b in zip(secs, secs[1:]):
        assert float(b.data("top")) == pytest.approx(float(a.data("top")) + float(a.attrs["height"]) + 14)
    # 6 effective layers over 4 stages: the last holds the head alone (no boundary: AdamW only)
    assert sp.split.stage_layers(3) == () and not sp.plans[3].params and page.count("none (AdamW only)") == 1
    assert "stage 0: op listings" in page and "stage 2: op listings" in page


def test_html_options_of_the_clis(tmp_path, capsys):
    from dmuon._cli.plan_commands import main_diff, main_plan

    a, b, ph, dh = (str(tmp_path / n) for n in ("a.json", "b.json", "p.html", "d.html"))
    assert main_plan(["--model", "tiny-llama", "--mesh", "4", "--json", a, "--html", ph]) == 0
    assert main_plan(["--model", "tiny-llama", "--mesh", "2x2", "--json", b]) == 0
    assert main_diff([a, b, "--html", dh]) == 0
    out = capsys.readouterr().out
    assert f"wrote {ph} (" in out and f"wrote {dh} (" in out
    plan = P.ShardingPlan.from_json(open(a).read())
    page = open(ph, encoding="utf-8").read()
    from dmuon.plan._tools.html.plan_page import plan_html

    title = "dmuon plan: tiny-llama on 4 ranks (Z3)"  # the command line names the run; to_html() does not
    assert page == plan_html(plan, standalone=True, title=title, subtitle="mesh 4 · cost model numel")
    assert f"<title>{title}</title>" in page and sections(parse(page))[0].data("section") == "title"
    assert f"<title>dmuon Z3 plan {plan.fingerprint()[:12]}</title>" in plan.to_html()
    assert "tiny-llama" not in plan.to_html() and "dmuon Z3 sharding plan" in plan.to_html()
    _check_plan_page(plan, page)
    # the per-rank buffers panel and its grey line say they are not the memory table's transient term
    text = html.unescape(page)
    assert "Muon buffers held at once</text>" in text and "peak transient bytes" not in text
    from dmuon.plan._tools.html.svg import fmt_bytes

    naive = [st.peak_transient_nbytes for st in plan.baseline_rank_stats()]
    assert f"FSDP2+naive gathers {fmt_bytes(sum(naive) / len(naive))}</text>" in text
    assert "Neither is the memory table's transient term" in text
    assert root(parse(open(dh, encoding="utf-8").read())).data("page") == "diff"
    # simulate --html: the page names the model, the ranks, tokens per rank, seq len, wire dtype, hardware
    from dmuon._cli.sim_commands import main_simulate

    sh = str(tmp_path / "s.html")
    argv = ["--model", "tiny-llama", "--mesh", "4", "--hw", "h100", "--tokens-per-rank", "512", "--mode", "z3"]
    assert main_simulate([*argv, "--html", sh]) == 0
    sim_page = html.unescape(open(sh, encoding="utf-8").read())
    assert "<title>dmuon simulate: tiny-llama on 4 ranks of h100 (Z3)</title>" in sim_page
    assert sections(parse(sim_page))[0].data("section") == "title"
    assert "mesh 4 · 512 tokens/rank, seq 512, wire bfloat16 · H100 SXM5" in sim_page
    with pytest.raises(SystemExit):
        main_plan(["--model", "tiny-llama", "--mesh", "4", "--html", str(tmp_path / "no" / "p.html")])
    assert "--html: the folder of" in capsys.readouterr().err


def test_import_dmuon_plan_does_not_load_the_pages():
    code = (
        "import sys, dmuon.plan as P; from dmuon import _zoo as zoo; p = P.compile(zoo.tiny_llama(), 2); "
        "assert not [m for m in sys.modules if m.startswith(('dmuon.plan._tools.html', 'dmuon.sim'))]; "
        "p.summary(); assert 'dmuon.plan._tools.html' not in sys.modules; p._repr_html_(); "
        "assert 'dmuon.plan._tools.html.plan_page' in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)


def test_collectives_per_boundary_labels_every_row():
    """Qwen3-30B-A3B on 64 ranks: 48 boundaries, thin rows; every boundary row carries its label and
    its bytes / calls text (before, only every other row did)."""
    plan = P.compile(zoo.qwen3_30b_a3b(), 64)
    text = _section_text(plan._repr_html_(), "collectives")
    names = [b.fqn for b in plan.boundaries]
    assert len(names) == 48
    for name in names:
        assert re.search(rf"(^| ){re.escape(name)} ", text), name
    assert text.count(" calls") >= len(names)
    # the experts map labels every one of its rows too (runs of boundaries with the same ranges)
    from dmuon.plan._tools.html.figures import PlanFigures
    from dmuon.plan._tools.html.maps import _expert_rows

    page = plan._repr_html_()
    text = _section_text(page, "experts")
    rows = _expert_rows(PlanFigures(plan))
    assert len(rows) > 40 and int(section(parse(page), "experts").data("rows")) == len(rows)
    labels = re.findall(r"model\.layers\.\d+(?:–\d+)?", text)
    assert len(labels) == len(rows), (len(labels), len(rows))
