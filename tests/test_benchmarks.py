"""Smoke test of benchmarks/step_time.py: it runs, its JSON has the expected shape, and
dmuon's measured ledger bytes equal the plan's. No wall-clock assertions: this 2-core machine
is shared, timings are reported, never checked.

``--quick`` = small model, N=2 (one launch of 2 gloo processes), 1 warm-up + 4 timed steps per
variant, one profiled step per variant for memory; about 20 s here.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from conftest import REPO_ROOT

SCRIPT = REPO_ROOT / "benchmarks" / "step_time.py"

ROW_KEYS = {
    "size",
    "nproc",
    "variant",
    "timed_steps",
    "step_ms",
    "fwd_bwd_ms",
    "opt_ms",
    "ratio_to_adamw",
    "losses",
    "ledger_nbytes_per_step",
    "ledger_per_rank_nbytes",
    "ledger_constant",
    "plan_total_nbytes",
    "plan_per_rank_nbytes",
    "ledger_matches_plan",
    "model_nbytes_per_step",
    "ns_flops_total",
    "ns_flops_per_rank",
    "ns_flops_busiest",
    "ns_busiest_over_mean",
    "ns_ms_busiest",
    "plan_ns_flops_per_rank",
    "peak_alloc_mib",
    "peak_rss_mib",
    "cost_model",
    "floor_ms",
}


@pytest.mark.distributed  # a process group in a subprocess
def test_step_time_quick(tmp_path):
    out_json = tmp_path / "bench.json"
    out_png = tmp_path / "bench.png"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--json", str(out_json), "--png", str(out_png)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "dmuon_z3" in proc.stdout and "ledger B/step" in proc.stdout

    data = json.loads(out_json.read_text())
    assert {"machine", "config", "results", "hook_overhead", "goals", "plans", "wall_s"} <= set(data)
    assert {"nproc", "cpu_model", "torch"} <= set(data["machine"])
    rows = {r["variant"]: r for r in data["results"]}
    assert set(rows) == {"adamw", "naive", "dmuon_z2", "dmuon_z3"}
    for name, r in rows.items():
        assert ROW_KEYS <= set(r), (name, ROW_KEYS - set(r))
        assert (r["size"], r["nproc"]) == ("small", 2)
        assert r["timed_steps"] >= 4 and r["step_ms"] > 0 and r["fwd_bwd_ms"] > 0
        assert len(r["peak_alloc_mib"]) == 2 and min(r["peak_alloc_mib"]) > 0
        assert len(r["peak_rss_mib"]) == 2 and min(r["peak_rss_mib"]) > 0
    assert rows["adamw"]["ratio_to_adamw"] == 1.0

    # dmuon: measured ledger bytes == plan, every timed step, total and per rank
    for name in ("dmuon_z2", "dmuon_z3"):
        r = rows[name]
        assert r["ledger_matches_plan"] is True, name
        assert r["ledger_constant"] is True, name
        assert r["ledger_nbytes_per_step"] == r["plan_total_nbytes"] > 0
        assert r["ledger_per_rank_nbytes"] == r["plan_per_rank_nbytes"]
        assert sum(r["plan_per_rank_nbytes"]) == r["plan_total_nbytes"]
        # NS work as planned: each matrix once, on its owner
        assert r["ns_flops_per_rank"] == r["plan_ns_flops_per_rank"]
        # the floor (own fwd+bwd + AdamW on the rest + NS, per step and rank) lies between the
        # step's fwd+bwd and the step (each rank's parts are inside its step; medians keep order)
        assert r["fwd_bwd_ms"] <= r["floor_ms"] <= r["step_ms"], name
    # Z3 broadcasts again before backward: 3(N-1)P vs 2(N-1)P
    assert 2 * rows["dmuon_z3"]["plan_total_nbytes"] == 3 * rows["dmuon_z2"]["plan_total_nbytes"]
    # naive: every rank runs Newton-Schulz on every matrix
    total = rows["dmuon_z3"]["ns_flops_total"]
    assert rows["naive"]["ns_flops_per_rank"] == [total, total]
    assert rows["adamw"]["ns_flops_total"] == 0
    assert rows["adamw"]["floor_ms"] is None and rows["naive"]["floor_ms"] is None
    # the baseline is the same optimizer: same losses as dmuon (fp32 NS on CPU), step by step
    ref = rows["dmuon_z3"]["losses"]
    for name in ("naive", "dmuon_z2"):
        assert len(rows[name]["losses"]) == len(ref)
        for a, b in zip(rows[name]["losses"], ref):
            assert math.isclose(a, b, rel_tol=1e-4), (name, rows[name]["losses"], ref)

    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


GPU_CHECK = REPO_ROOT / "benchmarks" / "gpu_check.py"


def test_gpu_check_arguments():
    """Argument parsing of benchmarks/gpu_check.py (importable without a GPU)."""
    import importlib.util
    import torch

    spec = importlib.util.spec_from_file_location("gpu_check", GPU_CHECK)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    args = mod.parse_args(["--device", "cpu", "--shapes", "64x256,32x32", "--quick"])
    assert args.shapes == [(64, 256), (32, 32)] and args.steps == 2 and args.parts == ["ns", "train", "offload"]
    assert mod.parse_args(["--device", "cpu"]).steps == 4
    for bad in (["--dtypes", "int8"], ["--shapes", "64by64"], ["--steps", "0"], ["--parts", "nothing"]):
        with pytest.raises(SystemExit) as exc:
            mod.parse_args(["--device", "cpu", *bad])
        assert exc.value.code == 2, bad
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit):
            mod.parse_args([])  # --device cuda is the default and needs a GPU


@pytest.mark.distributed  # a process group in a subprocess
def test_gpu_check_cpu_fallback(tmp_path):
    """The CPU fallback of both parts: NS rows, and dmuon's 1-rank run against torch.optim.Muon +
    AdamW, once through gloo and once through the identity collectives the GPU run may need."""
    for collectives in ("gloo", "identity"):
        out_json = tmp_path / f"gpu_check_{collectives}.json"
        proc = subprocess.run(
            [
                sys.executable,
                str(GPU_CHECK),
                "--device",
                "cpu",
                "--quick",
                "--collectives",
                collectives,
                "--json",
                str(out_json),
            ]
            + (["--parts", "train"] if collectives == "identity" else []),
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=240,
        )
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        data = json.loads(out_json.read_text())
        assert data["collectives"] == collectives
        train = data["train"]
        assert train["ok"] and set(train["runs"]) == {
            "dmuon_streams",
            "torch_ref",
            "dmuon_normuon",
            "normuon_ref",
            "dmuon_deepseek_v4",
            "deepseek_v4_ref",
        }
        assert all(c["ok"] for c in train["checks"])
        checked = {c["check"] for c in train["checks"]}
        assert any("normuon" in n for n in checked) and any("deepseek_v4" in n for n in checked), checked
        assert len(train["runs"]["dmuon_streams"]["losses"]) == 2
        if collectives == "gloo":  # and offload: the same losses as without it, masters on the host
            assert data["offload"]["ok"] and data["offload"]["runs"]["offload"]["masters_on_host"]
            assert data["offload"]["runs"]["offload"]["losses"] == data["offload"]["runs"]["plain"]["losses"]
            kinds = {r["kind"] for r in data["ns"]}
            assert kinds == {"newton_schulz", "batched", "gram_newton_schulz"}
            assert all(r["tflops"] > 0 and r["peak_tflops"] > 0 for r in data["ns"])


@pytest.mark.distributed  # a process group in a subprocess
def test_gpu_check_fails_on_mismatch():
    """A loss outside the tolerance (here: any, with a negative one) exits 1 and says FAIL."""
    proc = subprocess.run(
        [sys.executable, str(GPU_CHECK), "--device", "cpu", "--quick", "--parts", "train", "--loss-rtol", "-1"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "[FAIL] losses torch_ref vs dmuon_streams" in proc.stdout


def test_collective_kinds_verdict():
    """benchmarks/collective_kinds.py's verdict on hand-made step times (no launch): the default's
    kind must win where the forced kinds' per-repeat ranges do not overlap, and be within 5 % of the
    winner's median otherwise."""
    sys.path.insert(0, str(REPO_ROOT / "benchmarks"))
    try:
        import collective_kinds as ck
    finally:
        sys.path.pop(0)

    def run(bcast, allgather, default_kind):
        steps = {"adamw": [[1.0, 1.0]] * 3}
        for mode in ("z3", "z2"):
            steps[f"dmuon_{mode}"] = [[v, v] for v in bcast]
            steps[f"dmuon_{mode}_bcast"] = [[v, v] for v in bcast]
            steps[f"dmuon_{mode}_allgather"] = [[v, v] for v in allgather]
        kinds = {f"dmuon_{m}": [default_kind] for m in ("z3", "z2")}
        return ck.summarise(dict(size="small", nproc=2, steps_s=steps, kinds=kinds, settings={}))

    apart = run([1.2, 1.25, 1.3], [1.5, 1.6, 1.7], "broadcast")["verdicts"]["z3"]
    assert apart["kinds_differ"] and apart["winner"] == "broadcast" and apart["passed"]
    assert apart["default_kind_ratio"] == 1.25 and apart["best_ratio"] == 1.25
    assert not run([1.2, 1.25, 1.3], [1.5, 1.6, 1.7], "all_gather")["verdicts"]["z3"]["passed"]
    close = run([1.2, 1.3, 1.4], [1.15, 1.27, 1.35], "broadcast")["verdicts"]["z2"]
    assert not close["kinds_differ"] and close["winner"] == "all_gather" and close["passed"]  # 1.30 <= 1.05 x 1.27
    assert not run([1.2, 1.4, 1.6], [1.1, 1.25, 1.5], "broadcast")["verdicts"]["z2"]["passed"]  # 1.40 > 1.05 x 1.25
    assert "| 4 blocks x 128 | 2 | Z3 |" in ck.table([run([1.2] * 3, [1.5] * 3, "broadcast")])
