"""The interface between the hook boundaries and their runtime, read from the source (AST, no
process group): the boundary package (``dmuon/exec/_runtime/_boundary/``) reaches shared state
only through its :class:`~dmuon.exec._runtime._boundary.comm_context.BoundaryCommContext`, uses
only members the context defines, and never imports the runtime module (not even for types);
the runtime's attributes that live on the context name fields the context has."""

from __future__ import annotations

import ast
import pathlib

from test_import_graph import imports_of

RUNTIME_DIR = pathlib.Path(__file__).resolve().parents[2] / "dmuon" / "exec" / "_runtime"
BOUNDARY_FILES = sorted((RUNTIME_DIR / "_boundary").glob("*.py"))


def context_members() -> set[str]:
    """Attributes assigned on ``self`` in the context's methods, and its methods."""
    tree = ast.parse((RUNTIME_DIR / "_boundary" / "comm_context.py").read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "BoundaryCommContext")
    out = {n.name for n in cls.body if isinstance(n, ast.FunctionDef)}
    for n in ast.walk(cls):
        targets = n.targets if isinstance(n, ast.Assign) else [n.target] if isinstance(n, ast.AnnAssign) else []
        for t in targets:
            for e in ast.walk(t):
                if isinstance(e, ast.Attribute) and isinstance(e.value, ast.Name) and e.value.id == "self":
                    out.add(e.attr)
    return out


def _is_ctx(node: ast.AST, names: set[str]) -> bool:
    """``x.comm_ctx`` (any ``x``), or one of ``names``: a name bound to one (``ctx = self.comm_ctx``) or a
    function's parameter ``ctx``."""
    return (isinstance(node, ast.Attribute) and node.attr == "comm_ctx") or (
        isinstance(node, ast.Name) and node.id in names
    )


def context_uses() -> dict[str, set[str]]:
    """``{member: functions}`` of every attribute the boundary package reads or sets on a context."""
    used: dict[str, set[str]] = {}
    for path in BOUNDARY_FILES:
        if path.name == "comm_context.py":
            continue
        for fn in ast.walk(ast.parse(path.read_text())):
            if not isinstance(fn, ast.FunctionDef):
                continue
            static = any(isinstance(d, ast.Name) and d.id == "staticmethod" for d in fn.decorator_list)
            names = {a.arg for a in fn.args.args if a.arg == "ctx" and not static}  # not autograd's ctx
            names |= {
                t.id
                for n in ast.walk(fn)
                if isinstance(n, ast.Assign) and _is_ctx(n.value, set())
                for t in n.targets
                if isinstance(t, ast.Name)
            }
            for n in ast.walk(fn):
                if isinstance(n, ast.Attribute) and _is_ctx(n.value, names):
                    used.setdefault(n.attr, set()).add(f"{path.name}:{fn.name}")
    return used


def test_boundaries_use_only_what_the_context_defines():
    used, members = context_uses(), context_members()
    extra = {k: sorted(v) for k, v in used.items() if k not in members}
    assert not extra, f"the boundary package uses comm-context members BoundaryCommContext does not define: {extra}"
    assert {"pending_reduces", "steps_done", "boundary_after", "wait"} <= set(used)  # the checker sees the uses


def test_runtime_shared_attributes_are_context_fields():
    from dmuon.exec._runtime.runtime import DmuonRuntime, _Shared

    shared = {a.name for a in vars(DmuonRuntime).values() if isinstance(a, _Shared)}
    assert shared and shared <= context_members(), sorted(shared - context_members())


def test_boundary_package_does_not_import_the_runtime_module():
    for path in BOUNDARY_FILES:
        tree = ast.parse(path.read_text())
        every = [(n.lineno, n.module) for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module] + [
            (n.lineno, a.name) for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names
        ]
        assert [x for x in every if x[1] == "dmuon.exec._runtime.runtime"] == [], path.name  # TYPE_CHECKING ones too
        assert "dmuon.exec._runtime.runtime" not in {m for _, m in imports_of(path)}, path.name
