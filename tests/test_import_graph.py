"""dmuon's runtime import graph, read from the source (AST, no import): ``dmuon/exec`` never
imports ``dmuon/integrations`` (the frameworks sit on top of the execution layer, never under
it), and there is no import cycle among the runtime modules (``dmuon/exec``,
``dmuon/integrations``, ``dmuon/_registry.py``, ``dmuon/_hints.py``). Imports inside functions
count (a lazy import is still a dependency); imports under ``if TYPE_CHECKING:`` do not."""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PKG = ROOT / "dmuon"
RUNTIME_FILES = sorted(
    [*(PKG / "exec").rglob("*.py"), *(PKG / "integrations").rglob("*.py"), PKG / "_registry.py", PKG / "_hints.py"]
)


def module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING"
    )


def imports_of(path: pathlib.Path, src: str | None = None) -> list[tuple[int, str]]:
    """``(line, module)`` of every dmuon module ``path`` imports (``from pkg import name`` counts
    as ``pkg.name`` when that is a module, else ``pkg``)."""
    tree = ast.parse(src if src is not None else path.read_text(), filename=str(path))
    package = module_name(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and _is_type_checking(node):
            skip.update(id(n) for b in node.body for n in ast.walk(b))
    out: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            for a in node.names:
                sub = f"{mod}.{a.name}"
                out.append((node.lineno, sub if _is_module(sub) else mod))
    return sorted((line, m) for line, m in out if m == "dmuon" or m.startswith("dmuon."))


def _is_module(name: str) -> bool:
    p = ROOT.joinpath(*name.split("."))
    return p.with_suffix(".py").exists() or (p / "__init__.py").exists()


def graph() -> dict[str, set[str]]:
    nodes = {module_name(p): p for p in RUNTIME_FILES}
    return {n: {m for _, m in imports_of(p) if m in nodes and m != n} for n, p in nodes.items()}


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(g.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


EXEC_FILES = sorted((PKG / "exec").rglob("*.py"))


@pytest.mark.parametrize("path", EXEC_FILES, ids=[str(p.relative_to(PKG / "exec")) for p in EXEC_FILES])
def test_exec_does_not_import_integrations(path):
    bad = [(line, m) for line, m in imports_of(path) if m == "dmuon.integrations" or m.startswith("dmuon.integrations.")]
    assert bad == [], f"{path.name} imports the integrations layer: {bad}"


def test_registry_and_hints_are_leaves():
    for name in ("_registry.py", "_hints.py"):
        assert imports_of(PKG / name) == [], name


def test_no_import_cycle_among_runtime_modules():
    assert cycles(graph()) == []


def test_checker_sees_lazy_and_relative_imports():
    src = "\n".join(
        [
            "from typing import TYPE_CHECKING",
            "if TYPE_CHECKING:",
            "    from .optim import Muon",
            "def f():",
            "    from dmuon.integrations import framework_hint",
            "    from ..runtime import runtime",
            "from ... import _registry",
        ]
    )
    found = imports_of(PKG / "exec" / "setup" / "fsdp2.py", src)
    assert found == [(5, "dmuon.integrations"), (6, "dmuon.exec.runtime.runtime"), (7, "dmuon._registry")]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
