"""Execute notebooks/plan_inspection.ipynb end to end (skipped if nbclient is missing)."""

from __future__ import annotations

import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "notebooks" / "plan_inspection.ipynb"


def _load():
    nbformat = pytest.importorskip("nbformat", reason="nbformat not installed: pip install nbformat nbclient ipykernel")
    return nbformat, nbformat.read(str(NOTEBOOK), as_version=4)


def test_notebook_is_stored_without_outputs():
    _, nb = _load()
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None


def test_notebook_executes():
    nbclient = pytest.importorskip(
        "nbclient", reason="nbclient not installed: pip install nbclient ipykernel to execute the notebook"
    )
    pytest.importorskip("matplotlib", reason="matplotlib not installed (the notebook plots per-rank load)")
    _, nb = _load()
    client = nbclient.NotebookClient(
        nb,
        timeout=300,
        kernel_name="python3",
        resources={"metadata": {"path": str(ROOT)}},  # cwd = repo root, so `import dmuon` works
    )
    client.execute()
    text = "".join(
        out.get("text", "") for cell in nb.cells if cell.cell_type == "code" for out in cell.get("outputs", [])
    )
    assert "DMuon-Z3 sharding plan" in text
    assert "owners moved" in text
    images = [
        out
        for cell in nb.cells
        if cell.cell_type == "code"
        for out in cell.outputs
        if "image/png" in out.get("data", {})
    ]
    # per-rank load x2, NS FLOPs / resident bytes: 8B, then 70B + 405B, again with owner groups
    assert len(images) == 5
    # the pages (HTML, inline SVG): the 8B plan, 405B with owner groups, Qwen3-MoE, the plan read back from
    # JSON; two diffs (8 -> 16 ranks, numel -> ns_flops); the simulator's result
    pages = [
        out["data"]["text/html"]
        for cell in nb.cells
        if cell.cell_type == "code"
        for out in cell.outputs
        if "text/html" in out.get("data", {})
    ]
    kinds = [next((k for k in ("plan", "diff", "simulation") if f'data-page="{k}"' in p), None) for p in pages]
    assert kinds.count("plan") == 4 and kinds.count("diff") == 2 and kinds.count("simulation") == 1, kinds
    assert all("<svg" in p and "<script" not in p for p in pages)
    assert any("1,024 ranks &gt; 128: a column is 8 consecutive ranks" in p for p in pages)
    assert "z3: step" in text
    assert "Llama-3-70B, HSDP 8x128: 1024 ranks, 464 own nothing" in text
    assert "Llama-3-405B, N=1024: 1024 ranks, 142 own nothing" in text
    assert "Llama-3-70B, HSDP 8x128, owner groups: 1024 ranks, 0 own nothing" in text
    assert "Llama-3-405B, N=1024, owner groups: 1024 ranks, 0 own nothing" in text
    assert "ownership: 142 of 1,024 ranks own nothing" in text
    assert "experts: 96 stacks, 12,288 experts, 18,432 Muon matrices" in text
    assert "before: one owner per stack: owned max/mean 1.29, 672 broadcasts / all-gathers per rank and step" in text
    # ranges filled to one level per rank: 676 broadcasts at max/mean 1.01 (the weight-capped ranges:
    # 768 at 1.29; min(E, N) ranges: 6,144)
    assert "after: expert ranges: owned max/mean 1.01, 676 broadcasts / all-gathers per rank and step" in text
