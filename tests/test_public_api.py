"""The public surface is what docs/api.md lists: every public module's ``__all__`` equals the
names its section of the page lists, one list item each, and every other module is private by
name (a leading underscore in its own name or in a package above it)."""

from __future__ import annotations

import importlib
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
API_PAGE = ROOT / "docs" / "api.md"
PUBLIC_MODULES = ("dmuon", "dmuon.plan", "dmuon.exec", "dmuon.sim", "dmuon.testing", "dmuon.integrations")
#: public modules that are sub-namespaces of a public package (reached as attributes, listed in
#: their parent's ``__all__``); their own files are private
_HEADING = re.compile(r"^## (dmuon(?:\.\w+)*)\s*$")
_ITEM = re.compile(r"^- `([A-Za-z_][A-Za-z0-9_]*)")


def page_sections(text: str) -> dict[str, list[str]]:
    """``{module: [names in page order]}`` from the ``## dmuon.x`` sections of docs/api.md: the
    name is the identifier at the start of each list item's first backticked span."""
    sections: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        if line.startswith("## "):
            m = _HEADING.match(line)
            current = m.group(1) if m else None
            if current is not None:
                sections.setdefault(current, [])
            continue
        if current is not None and (m := _ITEM.match(line)):
            sections[current].append(m.group(1))
    return sections


def test_page_parser_reads_the_documented_form():
    text = "# API\n## dmuon.plan\n- `compile(model, mesh)` — plan\n- `ShardingPlan` — x\n  - `nested` no\n## Command line\n- `train`\n"
    assert page_sections(text) == {"dmuon.plan": ["compile", "ShardingPlan"]}


@pytest.mark.parametrize("module", PUBLIC_MODULES)
def test_all_matches_the_api_page(module):
    sections = page_sections(API_PAGE.read_text())
    assert module in sections, f"docs/api.md has no '## {module}' section"
    listed = sections[module]
    assert len(listed) == len(set(listed)), f"{module}: a name is listed twice in docs/api.md"
    exported = importlib.import_module(module).__all__
    assert sorted(exported) == sorted(listed), (
        f"{module}.__all__ and docs/api.md differ: only in __all__ {sorted(set(exported) - set(listed))}, "
        f"only on the page {sorted(set(listed) - set(exported))}"
    )
    mod = importlib.import_module(module)
    missing = [name for name in exported if not hasattr(mod, name)]
    assert missing == [], f"{module}.__all__ names what the module does not have: {missing}"


def test_every_other_module_is_private_by_name():
    public_files = {m.replace(".", "/") for m in PUBLIC_MODULES}
    exposed = []
    for path in sorted((ROOT / "dmuon").rglob("*.py")):
        rel = path.relative_to(ROOT).with_suffix("")
        parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
        if "/".join(parts) in public_files or rel.name == "__main__":
            continue
        if not any(part.startswith("_") for part in parts[1:]):
            exposed.append("/".join(parts))
    # the integrations users name in their frameworks' configurations stay importable by path
    assert sorted(exposed) == [
        "dmuon/integrations/accelerate",
        "dmuon/integrations/hf",
        "dmuon/integrations/torchtitan",
    ]
