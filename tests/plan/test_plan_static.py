"""dmuon/plan is pure: no file under it imports torch.distributed or dmuon.exec (any form)."""

from __future__ import annotations

import ast
import pathlib

import pytest

PLAN_DIR = pathlib.Path(__file__).resolve().parents[2] / "dmuon" / "plan"
FILES = sorted(PLAN_DIR.rglob("*.py"))
FORBIDDEN = ("torch.distributed", "dmuon.exec")


def _forbidden(name: str) -> bool:
    return any(name == f or name.startswith(f + ".") for f in FORBIDDEN)


def _resolve_relative(path: pathlib.Path, level: int, module: str | None) -> str:
    """Absolute module named by ``from <level dots><module> import ...`` inside ``path``."""
    package = list(path.relative_to(PLAN_DIR.parents[1]).with_suffix("").parts[:-1])  # e.g. dmuon.plan
    base = package[: len(package) - (level - 1)] if level > 1 else package
    return ".".join(base + ([module] if module else []))


def offending_imports(path: pathlib.Path) -> list[tuple[int, str]]:
    """``(line, module)`` of every import of a forbidden module in ``path``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    bad: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            mod = _resolve_relative(path, node.level, node.module) if node.level else (node.module or "")
            names = [mod] + [f"{mod}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Call):
            fn = node.func
            fname = fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", "")
            if fname in ("import_module", "__import__") and node.args and isinstance(node.args[0], ast.Constant):
                names = [str(node.args[0].value)]
        hit = next((n for n in names if _forbidden(n)), None)
        if hit is not None:
            bad.append((node.lineno, hit))
    return sorted(bad)


def test_plan_package_has_files():
    names = {p.relative_to(PLAN_DIR).as_posix() for p in FILES}
    assert {
        "__init__.py",
        "_model/snapshot.py",
        "_ownership/partition.py",
        "_layout/buffer_layout.py",
        "_cost/cost_model.py",
        "_records/plan.py",
    } <= names


@pytest.mark.parametrize("path", FILES, ids=[p.relative_to(PLAN_DIR).as_posix() for p in FILES])
def test_no_distributed_or_exec_imports(path):
    assert offending_imports(path) == []


def test_checker_catches_every_form(monkeypatch):
    sample = PLAN_DIR / "_sample_for_test.py"
    src = "\n".join(
        [
            "import torch.distributed as dist",
            "from torch import distributed",
            "from torch.distributed.fsdp import MixedPrecisionPolicy",
            "from ..exec import runtime",
            "from .. import exec",
            "import dmuon.exec._runtime.runtime",
            "import importlib; importlib.import_module('torch.distributed')",
        ]
    )
    monkeypatch.setattr(pathlib.Path, "read_text", lambda self, *a, **k: src)
    found = offending_imports(sample)
    assert [line for line, _ in found] == [1, 2, 3, 4, 5, 6, 7]
    assert [name.split(".")[0] for _, name in found] == ["torch"] * 3 + ["dmuon"] * 3 + ["torch"]
