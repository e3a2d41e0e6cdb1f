r"""Microbenchmarks that make the ``cpu-gloo`` hardware record (:func:`calibrate`; the command is
``python -m dmuon calibrate``, :mod:`dmuon._cli.calibrate_command`).

Measured on this machine, nothing taken from a training run: gloo collectives by kind, group
size and payload, matmul and Newton-Schulz rates, per-operator costs, FSDP2 and DTensor costs in
a real group of each size, and the busy-node slowdowns. What each figure measures and how long it
takes: Note: what calibrate measures (docs/design.md).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

from dmuon._launch import run_distributed  # the package's one launcher of local ranks
from dmuon.sim._calibrate.compute import (
    MATMUL_SIZES,
    _busy_node,
    _matmul,
    _newton_schulz,
    _ns_batch_factor,
    _overheads,
    _training_kernels,
)
from dmuon.sim._calibrate.compute import (  # noqa: F401 - the settings keep their dmuon.sim._calibrate names
    ATTENTION_BATCH,
    ATTENTION_HEADS,
    ATTENTION_SHAPES,
    NS_BATCH_SHAPES,
    NS_BATCHES,
    NS_SHAPES,
    QUICK_ATTENTION_SHAPES,
    QUICK_NS_BATCH,
    QUICK_NS_SHAPES,
)
from dmuon.sim._calibrate.gloo import KINDS, QUICK_SIZES, SIZES, _fsdp_overheads, _in_situ, _time_collectives
from dmuon.sim._calibrate.gloo import FSDP2_STACKS, fsdp2_terms  # noqa: F401 - keep their dmuon.sim._calibrate names
from dmuon.sim._engine.hardware import CollectiveCurve, Hardware, Link

__all__ = ["calibrate"]

#: repeats of the in-situ measurement per group size (the median of each figure is kept)
IN_SITU_REPEATS = 3


class _Progress:
    """tqdm if available, else a line per stage on stderr."""

    def __init__(self, total: int) -> None:
        try:
            from tqdm import tqdm  # optional: not a dependency of dmuon

            self.bar = tqdm(total=total, desc="calibrate", unit="stage")
        except ImportError:
            self.bar = None
        self.total = total
        self.done = 0

    def step(self, what: str) -> None:
        self.done += 1
        if self.bar is not None:
            self.bar.set_postfix_str(what)
            self.bar.update(1)
        else:
            print(f"[calibrate {self.done}/{self.total}] {what}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _median_of_runs(runs: Sequence[dict[str, float]]) -> dict[str, float]:
    """Each figure's median over repeated in-situ measurements (the figures are independent)."""
    return {key: statistics.median(r[key] for r in runs) for key in runs[0]}


def _worker(
    sizes: Sequence[int], repeats: int, fsdp_solo: bool, in_situ_repeats: int = IN_SITU_REPEATS
) -> dict[str, Any] | None:
    """Every rank of one launch of ``world`` processes (:func:`dmuon._launch.run_distributed`,
    gloo, one thread): the collective curves on the whole world, then the in-situ costs
    (:func:`_in_situ`, ``in_situ_repeats`` times: the median of each figure); with ``fsdp_solo``
    also the DTensor dispatch (rank 0). Rank 0 returns the measurements."""
    import warnings

    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    g = dist.group.WORLD
    res: dict[str, Any] = _time_collectives(dist, torch, g, world, sizes, repeats)
    # each in-situ cost is a difference of two timings of tens of ms: repeat the whole
    # measurement and keep the median of each figure (every repeat is in raw["in_situ_all"])
    runs = [_in_situ(dist, torch, g, world, repeats) for _ in range(in_situ_repeats)]
    res["in_situ_all"] = runs
    res["in_situ"] = _median_of_runs(runs)
    if fsdp_solo:
        solo = dist.new_group([0])
        if rank == 0:
            res["fsdp"] = _fsdp_overheads(torch, solo, repeats)
    dist.barrier()
    return res if rank == 0 else None


# ----------------------------------------------------------------------------------- main


def calibrate(
    *, group_sizes: Sequence[int] = (2, 3, 4), quick: bool = False, repeats: int | None = None
) -> tuple[Hardware, dict]:
    """Run the microbenchmarks (Note: what calibrate measures, docs/design.md) and return ``(Hardware, raw
    measurements)``."""
    import torch

    torch.set_num_threads(1)
    sizes = QUICK_SIZES if quick else SIZES
    reps = repeats or (3 if quick else 7)
    prog = _Progress(3)
    raw: dict[str, Any] = dict(machine=dict(cpu_count=os.cpu_count(), torch=torch.__version__), collectives={})
    t0 = time.time()
    for i, k in enumerate(group_sizes):  # one launch per group size: k processes, the world as the group
        got = run_distributed(_worker, k, sizes, reps, i == 0, 1 if quick else IN_SITU_REPEATS, timeout_s=300.0)[0]
        got = json.loads(json.dumps(got))  # plain JSON data like the rest of raw (tuples as lists)
        if "fsdp" in got:
            raw["fsdp"] = got.pop("fsdp")
        raw["collectives"][str(k)] = got
        print(f"  gloo collectives and in-situ costs on {k} ranks done", file=sys.stderr, flush=True)
    prog.step(f"gloo collectives on {', '.join(map(str, group_sizes))} ranks; FSDP2 call / DTensor dispatch")
    raw["matmul"] = _matmul(MATMUL_SIZES[:3] if quick else MATMUL_SIZES, reps)
    prog.step("matmul FLOP/s")
    raw["overheads"] = _overheads(reps)
    raw["training_kernels"] = _training_kernels(reps, quick)
    raw["newton_schulz"] = _newton_schulz(reps, quick)
    raw["gram_newton_schulz"] = _newton_schulz(reps, quick, "gram")
    raw["ns_batch_factor"] = _ns_batch_factor(3, quick)
    raw["busy_node"] = _busy_node(max(reps, 15))
    prog.step("operator / elementwise / hook overheads; attention, norm, activation; Newton-Schulz; busy node")
    prog.close()
    raw["wall_s"] = time.time() - t0
    curves = []
    issue = []
    for k, res in raw["collectives"].items():
        issue.append(res["issue_s"])
        for kind in KINDS:
            pts = sorted(dict(res[kind]).items())
            curves.append(
                CollectiveCurve(
                    kind=kind,
                    group_size=int(k),
                    nbytes=tuple(int(b) for b, _ in pts),
                    seconds=tuple(float(s) for _, s in pts),
                )
            )
    peaks = []
    eff: list[tuple[float, float]] = []
    in_situ = {int(k): res["in_situ"] for k, res in raw["collectives"].items() if "in_situ" in res}

    def by_group(figure: str) -> tuple[tuple[int, float], ...]:  # an in-situ figure per group size
        return tuple(sorted((k, v[figure]) for k, v in in_situ.items()))

    for dtype, pts in raw["matmul"].items():
        if not pts or dtype == "autograd":
            continue
        best = max(f for _, f in pts)
        peaks.append((dtype, best))
        if dtype == "torch.float32":
            eff = [(float(d), f / best) for d, f in pts]
    fp32_peak = dict(peaks).get("torch.float32", 1.0)
    # the training-matmul curve as a fraction of the plain fp32 peak (may exceed 1 nowhere here)
    autograd_eff = tuple((float(d), f / fp32_peak) for d, f in raw["matmul"].get("autograd", ()))
    kern = raw["training_kernels"]
    attention_eff = tuple((float(d), f / fp32_peak) for d, f in kern["attention"])
    ns_eff = tuple((float(d), f / fp32_peak) for d, f in raw["newton_schulz"])  # fp32 NS on CPU
    gram_eff = tuple((float(d), f / fp32_peak) for d, f in raw["gram_newton_schulz"])
    ov = raw["overheads"]
    cores = os.cpu_count() or 1
    hw = Hardware(
        name=f"cpu-gloo ({cores} cores, calibrated {time.strftime('%Y-%m-%d %H:%M')})",
        ranks_per_node=max(group_sizes),
        # links are unused where curves exist; kept for kinds without one
        intra=Link(latency_s=50e-6, bandwidth_Bps=1e9),
        inter=Link(latency_s=50e-6, bandwidth_Bps=1e9),
        curves=tuple(curves),
        issue_s=statistics.median(issue),
        matmul_peak_flops=tuple(sorted(peaks, key=lambda p: p[0] != "torch.float32")),
        matmul_efficiency=tuple(eff) or ((1.0, 1.0),),
        autograd_matmul_efficiency=autograd_eff,
        attention_efficiency=attention_eff,
        ns_efficiency=ns_eff,
        gram_ns_efficiency=gram_eff,
        ns_batch_factor=tuple((float(d), float(B), float(f)) for d, B, f in raw["ns_batch_factor"]),
        norm_train_s_per_numel=kern["norm_s_per_numel"],
        activation_train_s_per_numel=kern["activation_s_per_numel"],
        op_overhead_s=ov["op_overhead_s"],
        autograd_op_s=ov["autograd_op_s"],
        elementwise_Bps=ov["elementwise_Bps"],
        hook_s=ov["hook_s"],
        comm_cpu_share_by_group=by_group("comm_cpu_share"),
        fsdp2_call_s=raw["fsdp"]["fsdp2_call_s"],
        dtensor_op_s=raw["fsdp"]["dtensor_op_s"],
        fsdp2_call_s_by_group=by_group("fsdp2_call_s"),
        step_compute_factor_by_group=by_group("step_compute_factor"),
        dtensor_gather_s_by_group=by_group("dtensor_gather_s"),
        cores_per_node=cores,
        busy_compute_factor=raw["busy_node"]["busy_compute_factor"],
        busy_memory_factor=raw["busy_node"]["busy_memory_factor"],
        comm_engine="threads",
        comm_cpu_share=0.0,  # the scalar: sizes without a measurement
        compute_dtype="torch.float32",
        ns_dtype="torch.float32",
        source="python -m dmuon calibrate",
    )
    return hw, raw
