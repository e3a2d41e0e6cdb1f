"""The drawing primitives of the plan, diff and simulator pages: an SVG writer that counts its
shapes, number formats, colour ramps, text wrapping, the page's root element and a standalone
document around it.

Every page is a ``<div>`` whose styles are inline (no ``<style>`` element, no class rule, so
nothing leaks into a notebook and a static viewer that strips ``<style>`` keeps the look), holding
one SVG per section in normal flow, each ``display:block`` with a fixed ``width`` / ``height``
(scaled down by ``max-width:100%`` where the output area is narrower) and :data:`GAP_PX` below
it, then optional ``<details>`` listings. So every section's box on the page is known from
Python: each section SVG carries ``data-top`` (its top edge relative to the root, CSS pixels at
full width) and ``data-probe="x,y,#rrggbb"`` (a point inside a shape of that fill), which the
browser test reads back. Colours are presentation attributes, labels are SVG ``<title>``
children (the hover text in every browser and notebook front end). No JavaScript, no network.
"""

from __future__ import annotations

import html
import math
from collections.abc import Iterable, Sequence

__all__ = [
    "FONT",
    "MONO",
    "GAP_PX",
    "PAGE_WIDTH",
    "BLUES",
    "ORANGES",
    "GREENS",
    "PURPLES",
    "GREYS",
    "EMPTY",
    "Svg",
    "Page",
    "esc",
    "num",
    "level",
    "ramp_colour",
    "wrap",
    "fit",
    "fmt_count",
    "fmt_bytes",
    "fmt_flops",
    "fmt_range",
    "document",
    "shape_count",
]

FONT = "system-ui,-apple-system,'Segoe UI',Roboto,'DejaVu Sans',Arial,sans-serif"
MONO = "ui-monospace,SFMono-Regular,Menlo,Consolas,'DejaVu Sans Mono',monospace"
#: vertical gap below every section SVG, CSS pixels
GAP_PX = 14
#: width of every section SVG, CSS pixels
PAGE_WIDTH = 1080
#: average advance of one character, in font sizes (DejaVu Sans, the widest common fallback)
CHAR_EM = 0.6

# ColorBrewer sequential ramps (9 classes); index 0 is near white and not used for data
BLUES = ("#f7fbff", "#deebf7", "#c6dbef", "#9ecae1", "#6baed6", "#4292c6", "#2171b5", "#08519c", "#08306b")
ORANGES = ("#fff5eb", "#fee6ce", "#fdd0a2", "#fdae6b", "#fd8d3c", "#f16913", "#d94801", "#a63603", "#7f2704")
GREENS = ("#f7fcf5", "#e5f5e0", "#c7e9c0", "#a1d99b", "#74c476", "#41ab5d", "#238b45", "#006d2c", "#00441b")
PURPLES = ("#fcfbfd", "#efedf5", "#dadaeb", "#bcbddc", "#9e9ac8", "#807dba", "#6a51a3", "#54278f", "#3f007d")
GREYS = ("#ffffff", "#f0f0f0", "#d9d9d9", "#bdbdbd", "#969696", "#737373", "#525252", "#252525", "#000000")
#: fill of a cell with nothing in it (owns nothing): visible against the white page
EMPTY = "#ececec"
#: number of data levels of a ramp (indices 1..LEVELS)
LEVELS = 8


def esc(text: object) -> str:
    """``text`` escaped for an HTML/SVG attribute or element."""
    return html.escape(str(text), quote=True)


def num(x: float) -> str:
    """A coordinate: at most one decimal, no trailing ``.0``."""
    r = round(float(x), 1)
    return str(int(r)) if r == int(r) else f"{r:.1f}"


def level(value: float, vmax: float) -> int:
    """Ramp level of ``value`` on ``[0, vmax]``: 0 for ``value <= 0``, else ``1..LEVELS``
    (``ceil(LEVELS * value / vmax)``), so any positive value is visibly coloured."""
    if value <= 0 or vmax <= 0:
        return 0
    return max(1, min(LEVELS, math.ceil(LEVELS * value / vmax - 1e-9)))


def ramp_colour(ramp: Sequence[str], lvl: int) -> str:
    """The fill of level ``lvl`` of ``ramp`` (:data:`EMPTY` for 0)."""
    return EMPTY if lvl <= 0 else ramp[lvl]


def text_width(text: str, size: float) -> float:
    """Estimated width of ``text`` at font size ``size`` (px; :data:`CHAR_EM` per character)."""
    return len(text) * size * CHAR_EM


def fit(text: str, width: float, size: float) -> str:
    """``text`` cut to fit ``width`` px at font size ``size``, ``…`` in the middle when cut (the
    tail of an FQN is the informative part)."""
    room = int(width / (size * CHAR_EM))
    if len(text) <= room:
        return text
    if room <= 3:
        return text[: max(room, 0)]
    head = (room - 1) // 3
    return text[:head] + "…" + text[len(text) - (room - 1 - head) :]


def wrap(text: str, width: float, size: float) -> list[str]:
    """``text`` broken at spaces into lines that fit ``width`` px at font size ``size``."""
    room = max(10, int(width / (size * CHAR_EM)))
    lines: list[str] = []
    line = ""
    for word in text.split(" "):
        if line and len(line) + 1 + len(word) > room:
            lines.append(line)
            line = word
        else:
            line = f"{line} {word}" if line else word
    if line:
        lines.append(line)
    return lines


def _sig(x: float) -> str:
    """Three significant digits without exponent: ``4490.2 -> '4,490'``, ``12.34 -> '12.3'``."""
    a = abs(x)
    if a >= 100:
        return f"{x:,.0f}"
    return f"{x:.1f}" if a >= 10 else f"{x:.2f}"


def fmt_count(v: float) -> str:
    """Compact count: ``123456 -> '123 k'``, ``6.98e9 -> '6.98 G'``; below 10,000 in full."""
    for unit, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(v) >= scale and abs(v) >= 10_000:
            return f"{_sig(v / scale)} {unit}"
    return f"{v:,.0f}" if float(v).is_integer() else f"{v:.3g}"


def fmt_bytes(v: float) -> str:
    """Compact binary bytes: ``1536 -> '1.50 KiB'``; negative values keep their sign."""
    for unit, scale in (("PiB", 2**50), ("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(v) >= scale:
            return f"{_sig(v / scale)} {unit}"
    return f"{v:,.0f} B"


def fmt_flops(v: float) -> str:
    """Compact FLOPs: ``2.5e12 -> '2.50 TFLOP'``."""
    for unit, scale in (("EFLOP", 1e18), ("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6)):
        if abs(v) >= scale:
            return f"{_sig(v / scale)} {unit}"
    return f"{v:,.0f} FLOP"


def fmt_range(lo: int, hi: int) -> str:
    """``'5'`` or ``'5–12'`` (inclusive ends)."""
    return str(lo) if lo == hi else f"{lo}–{hi}"


class Svg:
    """One section's SVG: elements appended in drawing order, shapes counted.

    ``width`` / ``height`` in CSS pixels (also the ``viewBox``); ``label`` the section's name
    (``aria-label``, ``data-section``); ``data``: more ``data-*`` attributes of the root element.
    """

    def __init__(self, width: float, height: float, *, label: str, data: dict[str, object] | None = None):
        self.width = width
        self.height = height
        self.label = label
        self.data = dict(data or {})
        self.parts: list[str] = []
        self.shapes = 0
        self.probe: tuple[float, float, str] | None = None

    # -- shapes ------------------------------------------------------------------------------
    def rect(
        self,
        x: float,
        y: float,
        w: float,
        h: float,
        fill: str,
        *,
        title: str | None = None,
        stroke: str | None = None,
        stroke_width: float = 1.0,
        extra: str = "",
        probe: bool = False,
    ) -> None:
        """A rectangle (zero-size ones are skipped); ``title``: its hover label; ``probe``: make
        its centre the section's pixel probe (the first such rect wins; needs >= 4 px each way)."""
        if w <= 0 or h <= 0:
            return
        s = f' stroke="{stroke}" stroke-width="{num(stroke_width)}"' if stroke else ""
        body = f'<rect x="{num(x)}" y="{num(y)}" width="{num(w)}" height="{num(h)}" fill="{fill}"{s}{extra}'
        self.parts.append(body + (f"><title>{esc(title)}</title></rect>" if title else "/>"))
        self.shapes += 1
        if probe and self.probe is None and w >= 4 and h >= 4 and fill.startswith("#"):
            self.probe = (x + w / 2, y + h / 2, fill)

    def set_probe(self, x: float, y: float, fill: str) -> None:
        """Make ``(x, y)``, a point of plain ``fill`` (no text over it), the section's pixel probe."""
        if self.probe is None:
            self.probe = (x, y, fill)

    def line(
        self,
        x1: float,
        y1: float,
        x2: float,
        y2: float,
        stroke: str,
        *,
        width: float = 1.0,
        dash: str | None = None,
        title: str | None = None,
    ) -> None:
        d = f' stroke-dasharray="{dash}"' if dash else ""
        body = (
            f'<line x1="{num(x1)}" y1="{num(y1)}" x2="{num(x2)}" y2="{num(y2)}" stroke="{stroke}" '
            f'stroke-width="{num(width)}"{d}'
        )
        self.parts.append(body + (f"><title>{esc(title)}</title></line>" if title else "/>"))
        self.shapes += 1

    def path(
        self, d: str, *, fill: str = "none", stroke: str | None = None, width: float = 1.0, title: str | None = None
    ) -> None:
        s = f' stroke="{stroke}" stroke-width="{num(width)}"' if stroke else ""
        body = f'<path d="{d}" fill="{fill}"{s}'
        self.parts.append(body + (f"><title>{esc(title)}</title></path>" if title else "/>"))
        self.shapes += 1

    def text(
        self,
        x: float,
        y: float,
        text: str,
        *,
        size: float = 12,
        anchor: str = "start",
        bold: bool = False,
        fill: str = "#222222",
        mono: bool = False,
        title: str | None = None,
        rotate: float | None = None,
    ) -> None:
        """One line of text, baseline at ``y``."""
        a = f' text-anchor="{anchor}"' if anchor != "start" else ""
        b = ' font-weight="bold"' if bold else ""
        m = f' font-family="{esc(MONO)}"' if mono else ""
        f = f' fill="{fill}"' if fill != "#222222" else ""
        r = f' transform="rotate({num(rotate)} {num(x)} {num(y)})"' if rotate else ""
        t = f"<title>{esc(title)}</title>" if title else ""
        self.parts.append(
            f'<text x="{num(x)}" y="{num(y)}" font-size="{num(size)}"{a}{b}{m}{f}{r}>{t}{esc(text)}</text>'
        )
        self.shapes += 1

    def lines(
        self, x: float, y: float, lines: Iterable[str], *, size: float = 12, step: float | None = None, **kw
    ) -> float:
        """Several lines from baseline ``y`` down; returns the baseline after the last."""
        step = step or size * 1.35
        for line in lines:
            self.text(x, y, line, size=size, **kw)
            y += step
        return y

    def raw(self, markup: str, shapes: int = 0) -> None:
        """Pre-built markup (``shapes`` of them)."""
        self.parts.append(markup)
        self.shapes += shapes

    # -- output ------------------------------------------------------------------------------
    def render(self, top: float) -> str:
        """The ``<svg>`` element, its top edge at ``top`` px below the page root (``data-top``)."""
        data = dict(self.data, section=self.label, top=num(top))
        if self.probe is not None:
            x, y, fill = self.probe
            data["probe"] = f"{num(x)},{num(y)},{fill}"
        attrs = "".join(f' data-{k}="{esc(v)}"' for k, v in data.items())
        return (
            f'<svg xmlns="http://www.w3.org/2000/svg" width="{num(self.width)}" height="{num(self.height)}" '
            f'viewBox="0 0 {num(self.width)} {num(self.height)}" role="img" aria-label="{esc(self.label)}" '
            f'font-family="{esc(FONT)}" font-size="12" fill="#222222" '
            f'style="display:block;max-width:100%;height:auto;margin:0 0 {GAP_PX}px 0;background:#ffffff"{attrs}>'
            + "".join(self.parts)
            + "</svg>"
        )


class Page:
    """A page: section SVGs stacked in order (tops known), then HTML after them (listings).

    ``kind``: ``"plan"``, ``"diff"`` or ``"simulation"`` (the root's ``data-page``); ``data``:
    ``data-*`` attributes of the root element.
    """

    def __init__(self, kind: str, *, data: dict[str, object] | None = None):
        self.kind = kind
        self.data = dict(data or {})
        self.sections: list[Svg] = []
        self.tail: list[str] = []

    def add(self, svg: Svg) -> None:
        self.sections.append(svg)

    @property
    def shapes(self) -> int:
        return sum(s.shapes for s in self.sections)

    def render(self) -> str:
        out, top = [], 0.0
        for svg in self.sections:
            out.append(svg.render(top))
            top += svg.height + GAP_PX
        attrs = "".join(f' data-{k}="{esc(v)}"' for k, v in dict(self.data, page=self.kind, shapes=self.shapes).items())
        style = (
            f"font-family:{FONT};font-size:13px;color:#222222;background:#ffffff;padding:0;margin:0;"
            f"max-width:{PAGE_WIDTH}px;line-height:1.35"
        )
        return (
            f'<div class="dmuon-{self.kind}"{attrs} style="{esc(style)}">'
            + "".join(out)
            + "".join(self.tail)
            + "</div>"
        )


def details(summary: str, body: str) -> str:
    """A folded ``<details>`` block with a monospace ``<pre>`` body (inline styles)."""
    return (
        '<details style="margin:0 0 8px 0;border:1px solid #dddddd;border-radius:4px;padding:4px 8px;background:#fafafa">'
        f'<summary style="cursor:pointer;font-weight:600">{esc(summary)}</summary>'
        f'<pre style="font-family:{esc(MONO)};font-size:11px;line-height:1.3;overflow-x:auto;margin:6px 0 0 0;'
        f'white-space:pre">{esc(body)}</pre></details>'
    )


def title_section(title: str, subtitle: str | None = None) -> Svg:
    """The page's heading (what was run: model, mesh, mode), a section above the others; ``subtitle``:
    one smaller line under it (the run's settings)."""
    lines = wrap(subtitle, PAGE_WIDTH - 24, 13) if subtitle else []
    height = 40 + 18 * len(lines)
    svg = Svg(PAGE_WIDTH, height, label="title")
    svg.rect(0, 0, PAGE_WIDTH, height, TITLE_FILL, stroke="#c9d3e0")
    svg.set_probe(PAGE_WIDTH - 8, 8, TITLE_FILL)
    svg.text(12, 27, fit(title, PAGE_WIDTH - 24, 20), size=20, bold=True)
    svg.lines(12, 49, lines, size=13, step=18, fill="#444444")
    return svg


#: the page heading's background
TITLE_FILL = "#f3f6fa"


def document(fragment: str, title: str) -> str:
    """A standalone HTML document around a page fragment (``--html FILE``)."""
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>{esc(title)}</title>"
        '<meta name="viewport" content="width=device-width, initial-scale=1"></head>'
        '<body style="margin:0;padding:0;background:#ffffff">\n' + fragment + "\n</body></html>\n"
    )


def shape_count(markup: str) -> int:
    """SVG shapes in ``markup``: ``<rect``, ``<line``, ``<path``, ``<text``, ``<circle``,
    ``<polyline`` elements (the size gate's count, read from the text itself)."""
    return sum(markup.count(tag) for tag in ("<rect", "<line", "<path", "<text", "<circle", "<polyline"))
