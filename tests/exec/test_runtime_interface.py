"""The interface between a hook boundary and its runtime, read from the source (AST, no process
group): ``dmuon/exec/_runtime/boundary.py`` uses exactly the members of
:class:`dmuon.exec._runtime.boundary_host.BoundaryHost` on ``self.runtime_ref()``, the runtime has
every one of them, and boundary.py never imports the runtime module (not even for types)."""

from __future__ import annotations

import ast
import pathlib

from test_import_graph import imports_of

RUNTIME_DIR = pathlib.Path(__file__).resolve().parents[2] / "dmuon" / "exec" / "_runtime"


def host_members() -> set[str]:
    tree = ast.parse((RUNTIME_DIR / "boundary_host.py").read_text())
    host = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "BoundaryHost")
    out = set()
    for n in host.body:
        if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name):
            out.add(n.target.id)
        elif isinstance(n, ast.FunctionDef):
            out.add(n.name)
    return out


def _is_runtime_call(node: ast.AST) -> bool:
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "runtime_ref"


def boundary_uses() -> dict[str, set[str]]:
    """``{member: functions}`` of every attribute boundary.py reads on its runtime: on
    ``self.runtime_ref()`` itself, or on a name assigned from it (``rt = self.runtime_ref()``)."""
    tree = ast.parse((RUNTIME_DIR / "boundary.py").read_text())
    used: dict[str, set[str]] = {}
    for fn in ast.walk(tree):
        if not isinstance(fn, ast.FunctionDef):
            continue
        names = {
            t.id
            for n in ast.walk(fn)
            if isinstance(n, ast.Assign) and _is_runtime_call(n.value)
            for t in n.targets
            if isinstance(t, ast.Name)
        }
        for n in ast.walk(fn):
            if isinstance(n, ast.Attribute) and (
                (isinstance(n.value, ast.Name) and n.value.id in names) or _is_runtime_call(n.value)
            ):
                used.setdefault(n.attr, set()).add(fn.name)
    return used


def test_boundary_uses_exactly_the_host_interface():
    used, members = boundary_uses(), host_members()
    extra = {k: sorted(v) for k, v in used.items() if k not in members}
    assert not extra, f"boundary.py uses runtime members BoundaryHost does not list (add them there): {extra}"
    assert members <= set(used), f"BoundaryHost lists members boundary.py no longer uses: {sorted(members - set(used))}"


def test_runtime_provides_the_host_interface():
    from dmuon.exec._runtime.runtime import DmuonRuntime

    tree = ast.parse((RUNTIME_DIR / "runtime.py").read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "DmuonRuntime")
    assigned = {
        t.attr
        for n in ast.walk(cls)
        if isinstance(n, (ast.Assign, ast.AnnAssign))
        for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
        if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"
    }
    missing = sorted(m for m in host_members() if not hasattr(DmuonRuntime, m) and m not in assigned)
    assert missing == []


def test_boundary_does_not_import_the_runtime_module():
    tree = ast.parse((RUNTIME_DIR / "boundary.py").read_text())
    every = [(n.lineno, n.module) for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module] + [
        (n.lineno, a.name) for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names
    ]
    assert [x for x in every if x[1] == "dmuon.exec._runtime.runtime"] == []  # TYPE_CHECKING ones included
    assert "dmuon.exec._runtime.runtime" not in {m for _, m in imports_of(RUNTIME_DIR / "boundary.py")}
