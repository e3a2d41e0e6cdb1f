"""dmuon's import graph, read from the source (AST, no import), over every module of ``dmuon/``:
no import cycle anywhere, ``dmuon/exec`` never imports ``dmuon/integrations`` (the frameworks sit
on top of the execution layer, never under it), the leaves (``_registry``, ``_hints``, ``_tags``,
``_dtensor``) import no dmuon module, and no module below the package face imports it (``import
dmuon``) except the user-facing main job and checker. Imports inside functions count (a lazy
import is still a dependency), and so do the dmuon modules named in strings (``"dmuon.x.y"`` /
``"dmuon.x.y:attr"``: the integration list's wrapper factories, the package face's lazy names),
which are imported by name at run time; imports under ``if TYPE_CHECKING:`` do not.

Plus the pure import, in fresh processes: ``import dmuon``, ``import dmuon.plan`` and ``import
dmuon.sim`` load no ``dmuon.exec`` module and no ``torch.distributed.fsdp`` module."""

from __future__ import annotations

import ast
import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PKG = ROOT / "dmuon"
ALL_FILES = sorted(PKG.rglob("*.py"))
LEAVES = ("_registry.py", "_hints.py", "_tags.py", "_dtensor.py")
#: a dmuon module named in a string: "dmuon.x.y" or "dmuon.x.y:attr" (imported by name at run time)
_NAMED = re.compile(r"^(dmuon(?:\.\w+)+)(?::[\w.]+)?$")


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
    as ``pkg.name`` when that is a module, else ``pkg``), and of every dmuon module it names in a
    string (:data:`_NAMED`)."""
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
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            named = _NAMED.match(node.value)
            if named and _is_module(named.group(1)):
                out.append((node.lineno, named.group(1)))
    return sorted((line, m) for line, m in out if m == "dmuon" or m.startswith("dmuon."))


def _is_module(name: str) -> bool:
    p = ROOT.joinpath(*name.split("."))
    return p.with_suffix(".py").exists() or (p / "__init__.py").exists()


def graph(files=ALL_FILES) -> dict[str, set[str]]:
    nodes = {module_name(p): p for p in files}
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
    bad = [
        (line, m) for line, m in imports_of(path) if m == "dmuon.integrations" or m.startswith("dmuon.integrations.")
    ]
    assert bad == [], f"{path.name} imports the integrations layer: {bad}"


def test_leaves_import_no_dmuon_module():
    for name in LEAVES:
        assert imports_of(PKG / name) == [], name


def test_no_import_cycle_in_dmuon():
    assert cycles(graph()) == []


def test_named_modules_exist():
    """Every ``"dmuon.x:attr"`` string names a module that exists (else the checker would not see
    the edge, and the registry would fail at install time)."""
    missing = []
    for path in ALL_FILES:
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and ":" in node.value:
                named = _NAMED.match(node.value)
                if named and not _is_module(named.group(1)):
                    missing.append((str(path.relative_to(ROOT)), node.lineno, node.value))
    assert missing == []


#: modules that import the package face on purpose: the main job and the user-facing checker run
#: dmuon as a user's script does
#: modules that use dmuon as a user's script would: the main job (every module of dmuon._train) and the checker
FACE_USERS = {module_name(p) for p in ALL_FILES if module_name(p).startswith("dmuon._train")} | {"dmuon.testing._check"}


def test_modules_import_what_they_use_from_its_module():
    """Below the package face nothing imports ``dmuon`` itself (its public names load lazily from
    their modules: importing them from the face would make every module depend on all of them)."""
    bad = {
        module_name(p): lines
        for p in ALL_FILES
        if module_name(p) not in FACE_USERS | {"dmuon"}
        and (lines := [line for line, m in imports_of(p) if m == "dmuon"])
    }
    assert bad == {}


def test_checker_sees_lazy_and_relative_imports():
    src = "\n".join(
        [
            "from typing import TYPE_CHECKING",
            "if TYPE_CHECKING:",
            "    from .optim import Muon",
            "def f():",
            "    from dmuon.integrations import framework_hint",
            "    from .._runtime import runtime",
            "from ... import _registry",
            "SPEC = ('dmuon.exec._optim.amp:route_unscale', 'dmuon.plan', 'dmuon.no.such:x', 'dmuon: a message')",
        ]
    )
    found = imports_of(PKG / "exec" / "_setup" / "fsdp2.py", src)
    assert found == [
        (5, "dmuon.integrations"),
        (6, "dmuon.exec._runtime.runtime"),
        (7, "dmuon._registry"),
        (8, "dmuon.exec._optim.amp"),
        (8, "dmuon.plan"),
    ]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


# ------------------------------------------------------------------------------------------------
# The pure import, in a fresh process
# ------------------------------------------------------------------------------------------------

_PURE = r"""
import json, sys, types
import torch

def loaded():
    return sorted(m for m in sys.modules if m == "dmuon.exec" or m.startswith(("dmuon.exec.", "torch.distributed.fsdp")))

out = {}
import dmuon
out["dmuon"] = loaded()
import dmuon.plan
out["dmuon.plan"] = loaded()
import dmuon.sim
out["dmuon.sim"] = loaded()
import dmuon._zoo
out["dmuon._zoo"] = loaded()
out["all_in_dir"] = sorted(set(dmuon.__all__) - set(dir(dmuon)))
out["hand_off"] = getattr(torch.nn.utils.clip_grad_norm_, "__dmuon_wraps__", None)

# the hand-off without dedicated parameters: torch's function, dmuon.exec still not loaded
w = torch.nn.Parameter(torch.ones(3))
w.grad = torch.full((3,), 4.0)
out["plain_norm"] = torch.nn.utils.clip_grad_norm_([w], 1e9).item()
out["after_plain_call"] = loaded()

# with a dedicated parameter (tagged by hand: an owner without TP, no process group) it is
# dmuon.clip_grad_norm_, imported on that call
from dmuon import _tags
v = torch.nn.Parameter(torch.ones(2))
v.grad = torch.full((2,), 3.0)
_tags.write(v, _tags.PARAM, types.SimpleNamespace(is_owner=True, tp=None, runtime=lambda: None))
out["dedicated_norm"] = torch.nn.utils.clip_grad_norm_([w, v], 1e9).item()
out["after_dedicated_call"] = "dmuon.exec._optim.grad_clip" in sys.modules

out["lazy"] = [dmuon.Muon.__module__, dmuon.dedicate_params.__module__, dmuon.qk_clip.__name__,
               dmuon.fsdp2_ignored_params.__module__]
print(json.dumps(out))
"""


def test_pure_import_loads_no_exec_and_no_fsdp():
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("DMUON_NO_PATCHES", None)
    r = subprocess.run([sys.executable, "-c", _PURE], env=env, capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-4000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    for name in ("dmuon", "dmuon.plan", "dmuon.sim", "dmuon._zoo", "after_plain_call"):
        assert out[name] == [], (name, out[name])
    assert out["all_in_dir"] == []
    assert out["hand_off"] == "clip.nn_utils"  # import dmuon installs the clip hand-off, nothing else
    assert out["plain_norm"] == pytest.approx(48.0**0.5)
    assert out["dedicated_norm"] == pytest.approx((48.0 + 18.0) ** 0.5)  # both counted once
    assert out["after_dedicated_call"] is True
    assert out["lazy"] == [
        "dmuon.exec._optim.muon",
        "dmuon.exec._setup.api",
        "dmuon.exec._optim.qk_clip",
        "dmuon.exec._setup.fsdp2",
    ]
