"""Write the screenshots of the pages in docs/img (headless Chromium; docs/planning.md, "Pages you
can see").

Run from the repository root:  python docs/img/make_screenshots.py
Needs Chromium (``apt-get install chromium``) and Pillow (matplotlib's dependency). Each image is
some of a page's sections, cut at their boxes (every section SVG records its top, width and
height), at one CSS pixel per pixel, colours reduced to a palette to keep the files small.
"""

from __future__ import annotations

import pathlib
import re
import sys
import tempfile
from types import SimpleNamespace

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import dmuon.plan as P  # noqa: E402
import dmuon.sim as S  # noqa: E402
from dmuon.sim import zoo  # noqa: E402
from dmuon.plan._tools.html.browser import screenshot  # noqa: E402
from dmuon.plan._tools.html.svg import GAP_PX, document  # noqa: E402

OUT = pathlib.Path(__file__).resolve().parent


def _boxes(page: str) -> dict[str, tuple[float, float]]:
    """``{section: (top, height)}`` of a page fragment."""
    out = {}
    for tag in re.findall(r"<svg\b[^>]*>", page):
        name = re.search(r'data-section="([^"]+)"', tag).group(1)
        top = float(re.search(r'data-top="([^"]+)"', tag).group(1))
        out[name] = (top, float(re.search(r'height="([^"]+)"', tag).group(1)))
    return out


def shoot(page: str, name: str, sections: tuple[str, ...]) -> None:
    """Render ``page`` and keep the sections ``sections``, one under the other in that order (the
    header card first, where a picture needs its model and mesh), as docs/img/``name``."""
    from PIL import Image

    boxes = _boxes(page)
    height = int(max(t + h for t, h in boxes.values())) + 200
    with tempfile.TemporaryDirectory() as tmp:
        html = pathlib.Path(tmp) / "page.html"
        png = pathlib.Path(tmp) / "page.png"
        html.write_text(document(f'<div style="padding:0 10px">{page}</div>', name), encoding="utf-8")
        screenshot(html, png, width=1100, height=height)
        full = Image.open(png).convert("RGB")
        parts = [full.crop((0, int(boxes[s][0]), 1100, int(boxes[s][0] + boxes[s][1]) + GAP_PX // 2)) for s in sections]
    img = Image.new("RGB", (1100, sum(p.size[1] for p in parts)), "white")
    y = 0
    for part in parts:
        img.paste(part, (0, y))
        y += part.size[1]
    img.quantize(colors=256, method=Image.Quantize.MEDIANCUT).save(OUT / name, optimize=True)
    print(f"wrote docs/img/{name} ({(OUT / name).stat().st_size:,} bytes, {img.size[0]}x{img.size[1]})")


def main() -> None:
    llama8 = zoo.llama3_8b()
    hsdp = P.compile(llama8, (2, 8))
    shoot(hsdp._repr_html_(), "plan_page.png", ("header", "ownership", "per-rank"))
    shoot(hsdp._repr_html_(), "plan_bytes.png", ("header", "phases", "collectives"))
    qwen = P.compile(zoo.qwen3_30b_a3b(), 64)
    shoot(qwen._repr_html_(), "plan_moe.png", ("header", "ownership", "per-rank"))
    shoot(qwen._repr_html_(), "plan_experts.png", ("header", "experts", "schedule"))
    big = P.compile(zoo.llama3_405b(), 1024, owner_groups="auto")
    shoot(big._repr_html_(), "plan_405b_1024.png", ("header", "ownership"))
    d = P.diff(P.compile(llama8, 8), P.compile(llama8, 8, cost_model="ns_flops"))
    shoot(d._repr_html_(), "plan_diff.png", ("header", "phases", "map-before", "map-after"))
    bf16 = SimpleNamespace(param_dtype="bfloat16", reduce_dtype="float32")
    p8 = P.compile(llama8, 8, mp_policy=bf16, cost_model="ns_flops")
    wl = S.from_plan(p8, tokens_per_rank=4096, seq_len=4096)
    sims = S.simulate_variants(p8, S.hardware.preset("h100"), wl, timeline_ranks=(0,))
    shoot(sims._repr_html_(), "simulation.png", ("variants", "timeline"))


if __name__ == "__main__":
    main()
