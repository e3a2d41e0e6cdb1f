"""Reading the HTML pages back (``tests/plan/test_plan_html.py``, ``tests/test_html_browser.py``): the
root element's and every element's ``data-*`` attributes, the section SVGs' boxes, and an XML
parse of each SVG (well-formed)."""

from __future__ import annotations

import html.parser
import re
import xml.etree.ElementTree as ET


class Element:
    def __init__(self, tag: str, attrs: dict[str, str]):
        self.tag = tag
        self.attrs = attrs

    def data(self, name: str) -> str:
        return self.attrs[f"data-{name}"]

    def ints(self, name: str) -> list[int]:
        return [int(v) for v in self.data(name).split()]


class PageParser(html.parser.HTMLParser):
    """Every start tag with its attributes, in document order."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.elements: list[Element] = []

    def handle_starttag(self, tag, attrs):
        self.elements.append(Element(tag, {k: (v if v is not None else "") for k, v in attrs}))

    handle_startendtag = handle_starttag


def parse(page: str) -> list[Element]:
    p = PageParser()
    p.feed(page)
    p.close()
    return p.elements


def root(elements: list[Element]) -> Element:
    return next(e for e in elements if e.tag == "div" and "data-page" in e.attrs)


def sections(elements: list[Element]) -> list[Element]:
    """The section SVGs in order (``data-section``, ``data-top``, ``width``, ``height``)."""
    return [e for e in elements if e.tag == "svg" and "data-section" in e.attrs]


def section(elements: list[Element], name: str) -> Element:
    return next(e for e in sections(elements) if e.data("section") == name)


def with_data(elements: list[Element], name: str) -> list[Element]:
    return [e for e in elements if f"data-{name}" in e.attrs]


def svg_texts(page: str) -> list[str]:
    """Each ``<svg>...</svg>`` of ``page`` as text (they do not nest)."""
    return re.findall(r"<svg\b.*?</svg>", page, flags=re.S)


def check_well_formed(page: str) -> int:
    """Parse every SVG of ``page`` as XML (raises on malformed markup); returns how many."""
    svgs = svg_texts(page)
    for s in svgs:
        ET.fromstring(s)
    return len(svgs)
