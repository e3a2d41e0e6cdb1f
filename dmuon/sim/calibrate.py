r"""``python -m dmuon calibrate``: microbenchmarks that make the ``cpu-gloo`` hardware record.

Measured on this machine, nothing taken from a training run:

* **gloo collectives** by kind (broadcast, reduce, all-reduce, all-gather, reduce-scatter,
  all-to-all), group size 2-4 (one launch of ``k`` processes each, the whole world as the group)
  and payload (bytes per rank, :data:`SIZES`): median seconds from issue to ``wait()`` over
  repeats, after a barrier — gloo's own algorithms, including the contention of ``k`` processes
  on this machine's cores. ``issue_s``: the calling thread's cost of one ``async_op=True`` call.
* **matmul FLOP/s** by dtype (fp32; bf16 at small sizes) and square size, one thread
  (``torch.set_num_threads(1)``, as every rank of the benchmarks runs): the peak is the best
  size's rate, the efficiency curve every size's fraction of it.
* **per-operator overhead** (a 1-element add) and **elementwise bandwidth** (a 4 M-element add).
* **training matmuls**: ``F.linear`` forward + backward with autograd (``x·Wᵀ``, the input and
  the weight gradient) at ``(4d, d, d)``, as a fraction of the plain peak by mean dimension
  (``autograd_matmul_efficiency``); and the **autograd operator** cost (a chain of recorded
  elementwise ops, forward + backward, per op).
* **hook cost**: a module with a forward pre-hook, forward hook and backward hooks vs without.
* **FSDP2 call / step-compute factor / DTensor gather / communication CPU share, in a real group
  of each size** (one launch of ``k`` processes per group size, the whole world as the group):
  stacks of FSDP2 units (:data:`FSDP2_STACKS`) forward + backward minus the plain stack's
  (interleaved pairs), per call, less the bare blocking collectives of the same payload (the
  simulator times those from the curves) — on tiny 8-parameter units (a transformer block's
  count) the per-call cost, and on two stacks of real block size 8x apart in compute the extra
  per second of compute between blocking calls (the members' skew, gloo's threads and wake-ups:
  ``step_compute_factor_by_group``, :func:`fsdp2_terms`); and a
  ``DTensor.full_tensor()`` + ``redistribute`` back to ``Shard(0)`` less a bare all-gather; and
  how much of a collective's duration the members' compute loses while it runs on gloo's
  threads (``comm_cpu_share``, :func:`_comm_cpu_share`). On gloo these grow with the group and
  with ranks per core (blocking waits, threads that share the cores), which a 1-rank
  measurement misses. Each is the difference of two noisy timings, so the whole in-situ
  measurement runs :data:`IN_SITU_REPEATS` times per group size and the record keeps the median
  of each figure (``raw["collectives"][k]["in_situ_all"]`` keeps every repeat).
* **Newton-Schulz**: one fp32 ``newton_schulz`` call by matrix shape (:func:`_newton_schulz`;
  ``gram_newton_schulz`` likewise on the shapes where it saves FLOPs),
  and per matrix a batched call of 4 / 16 / 32 same-shape matrices against a single one, as
  ``dmuon.Muon`` batches a bucket (:func:`_ns_batch_factor`).
* **attention, norm, activation**: fused ``scaled_dot_product_attention`` (causal), ``RMSNorm``
  and ``GELU``, forward + backward with autograd (:func:`_training_kernels`): on this CPU they
  run far below the GEMM rate / the plain add's bandwidth, which the matmul curve and the
  elementwise bandwidth would otherwise assume.
  The DTensor dispatch of an in-place multiply vs a plain one (1-rank group).

Compute is measured in one process while the other cores idle, and then the **busy node**
(:func:`_busy_node`): a reference mix of a block's kernels timed alone and with every other core
running the same mix (one background process per core), giving the slowdown of matmul-class and
of memory-bound work when every core computes (the benchmark's condition; on this 2-core VM a
block's kernels ran 10–35 % slower with the other core busy). The simulator applies these on
top of processor sharing (``ranks_per_node / cores_per_node``).

``--quick`` measures fewer sizes and repeats (a smoke run for tests, seconds). Total: under 3
minutes on 2 cores (161 s measured on the idle machine; 168–188 s under the step-time
benchmark's load before the in-situ pairs went from 11 to 9 and the batched-NS and busy-node
stages were trimmed). Progress: a tqdm bar if tqdm is installed, else one line per stage.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

from dmuon._launch import run_distributed  # the package's one launcher of local ranks
from dmuon.sim.hardware import CollectiveCurve, Hardware, Link, dump, ns_mean_dim

__all__ = ["calibrate", "main"]

#: payload bytes per rank of the collective curves
SIZES = (256, 4096, 65536, 524288, 2097152, 8388608)
QUICK_SIZES = (4096, 524288)
KINDS = ("broadcast", "reduce", "all_reduce", "all_gather", "reduce_scatter", "all_to_all")
MATMUL_SIZES = (32, 64, 128, 256, 512, 768)
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


def _median_s(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


# ----------------------------------------------------------------------------------- gloo


def _time_collectives(dist, torch, group, k: int, sizes: Sequence[int], repeats: int) -> dict[str, Any]:
    """Median seconds per kind and size on ``group`` (``k`` ranks; every rank of the world calls)."""
    res: dict[str, Any] = {}
    member = group is not None
    for kind in KINDS:
        pts = []
        for nbytes in sizes:
            numel = max(k, nbytes // 4 // k * k)
            x = torch.ones(numel)
            y = torch.empty(numel * k) if kind == "all_gather" else torch.empty(numel // k)
            z = torch.empty(numel)

            def call(x=x, y=y, z=z, kind=kind):
                if kind == "broadcast":
                    w = dist.broadcast(x, dist.get_global_rank(group, 0), group=group, async_op=True)
                elif kind == "reduce":
                    w = dist.reduce(x, dist.get_global_rank(group, 0), group=group, async_op=True)
                elif kind == "all_reduce":
                    w = dist.all_reduce(x, group=group, async_op=True)
                elif kind == "all_gather":
                    w = dist.all_gather_into_tensor(y, x, group=group, async_op=True)
                elif kind == "reduce_scatter":
                    w = dist.reduce_scatter_tensor(y, x, group=group, async_op=True)
                else:
                    w = dist.all_to_all_single(z, x, group=group, async_op=True)
                w.wait()

            times = []
            if member:
                call()
            for _ in range(repeats):
                dist.barrier()
                if member:
                    t0 = time.perf_counter()
                    call()
                    times.append(time.perf_counter() - t0)
            mine = torch.tensor([statistics.median(times) if times else 0.0], dtype=torch.float64)
            dist.all_reduce(mine, op=dist.ReduceOp.MAX)
            # reduce-scatter's schedule payload is the output shard (the input is k x that)
            pts.append((numel * 4 // k if kind == "reduce_scatter" else numel * 4, float(mine)))
        res[kind] = sorted(pts)
    x = torch.ones(8)
    issue = []
    for _ in range(max(repeats, 10)):
        dist.barrier()
        if member:
            t0 = time.perf_counter()
            w = dist.all_reduce(x, group=group, async_op=True)
            issue.append(time.perf_counter() - t0)
            w.wait()
    mine = torch.tensor([statistics.median(issue) if issue else 0.0], dtype=torch.float64)
    dist.all_reduce(mine, op=dist.ReduceOp.MAX)
    res["issue_s"] = float(mine)
    return res


#: The in-situ FSDP2 stacks (:func:`_in_situ`): ``(Linear width, Linears per unit, input rows)``.
#: The first is FSDP2's per-call cost alone (8 parameters per unit, a transformer block's count,
#: of 64 elements, next to no compute); the other two have a real block's bytes (6 x 256 x 256
#: fp32 = 1.5 MiB per unit) and 8x apart in compute between the calls: their difference is what
#: a blocking FSDP2 call costs per second of compute since the previous one (the step-compute
#: factor; the bytes cancel).
FSDP2_STACKS = ((8, 8, 2), (256, 6, 64), (256, 6, 512))


def _fsdp2_stack(dist, torch, group, mesh, k: int, med, reps: int, width: int, per_unit: int,
                 rows: int) -> dict[str, float]:
    """One FSDP2 stack of 4 units of ``per_unit`` ``Linear(width, width)`` on ``rows`` inputs:
    ``call_s`` = the sharded stack's forward + backward minus the plain stack's (the median of
    interleaved pairs), per call, less the bare blocking all-gather / reduce-scatter of the unit's
    payload (the simulator times those from the curves); ``compute_s`` = the plain stack's time;
    ``calls``."""
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    units = 4

    def stack():
        return nn.Sequential(*[nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(per_unit)])
                               for _ in range(units)])

    plain, sharded = stack(), stack()
    for unit in sharded:
        fully_shard(unit, mesh=mesh)
    fully_shard(sharded, mesh=mesh)
    inp = torch.ones(rows, width)

    def timed(model):
        dist.barrier(group=group)
        t0 = time.perf_counter()
        model(inp).sum().backward()
        return time.perf_counter() - t0

    for model in (plain, sharded, plain, sharded):  # warm-up
        timed(model)
    # interleaved pairs: the FSDP2 overhead as the median of per-pair differences, so the
    # machine's drift over the measurement cancels (the per-second-of-compute figure is a
    # difference of two such overheads)
    pairs = [(timed(plain), timed(sharded)) for _ in range(reps)]
    t_plain = statistics.median(p for p, _ in pairs)
    overhead = statistics.median(f - p for p, f in pairs)
    unit_numel = per_unit * width * width
    shard = torch.ones(-(-unit_numel // k))
    full = torch.empty(shard.numel() * k)
    t_ag = med(lambda: dist.all_gather_into_tensor(full, shard, group=group), reps)
    t_rs = med(lambda: dist.reduce_scatter_tensor(shard, full, group=group), reps)
    calls = units * 3  # Z3: all-gather before forward and before backward, reduce-scatter after
    return dict(call_s=overhead / calls - (2 * t_ag + t_rs) / 3, compute_s=t_plain, calls=calls)


def fsdp2_terms(small: dict[str, float], low: dict[str, float], high: dict[str, float]) -> tuple[float, float]:
    """``(fixed s per call, step-compute factor)`` from the three :data:`FSDP2_STACKS`
    measurements (:func:`_fsdp2_stack`), a call's cost being ``fixed + (factor - 1) · compute_s /
    calls`` with ``fixed`` the stack's cost without compute (it grows with the unit's bytes, which
    the two block-sized stacks share): the factor from those two (``low`` and ``high`` compute),
    the fixed cost from the tiny-unit stack with its (small) compute share removed. Each clamped to
    its physical range (``fixed >= 0``, ``factor >= 1``)."""
    extra = (high["call_s"] * high["calls"] - low["call_s"] * low["calls"]) / max(high["compute_s"] - low["compute_s"], 1e-9)
    extra = max(0.0, extra)
    return max(0.0, small["call_s"] - extra * small["compute_s"] / small["calls"]), 1.0 + extra


def _in_situ(dist, torch, group, k: int, repeats: int) -> dict[str, float]:
    """FSDP2's per-call cost and step-compute factor (:data:`FSDP2_STACKS`, :func:`fsdp2_terms`),
    the DTensor-gather cost on ``group`` (``k`` ranks; members only call), each beyond the bare
    collectives, and the communication CPU share (module docstring)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = DeviceMesh.from_group(group, "cpu")

    def med(fn, reps):
        fn()
        fn()
        times = []
        for _ in range(reps):
            dist.barrier(group=group)
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    reps = max(repeats, 9)
    fsdp2, step_factor = fsdp2_terms(*(_fsdp2_stack(dist, torch, group, mesh, k, med, reps, *s)
                                       for s in FSDP2_STACKS))
    width = 8
    dt = distribute_tensor(torch.ones(k * 16, width), mesh, [Shard(0)])
    x = torch.ones(16 * width)
    y = torch.empty(16 * width * k)
    t_full = med(lambda: dt.full_tensor(), reps)
    rep = dt.redistribute(mesh, [Replicate()])
    t_back = med(lambda: rep.redistribute(mesh, [Shard(0)]), reps)
    t_bare = med(lambda: dist.all_gather_into_tensor(y, x, group=group), reps)
    share = _comm_cpu_share(dist, torch, group, k, reps, med)
    out = torch.tensor([fsdp2, max(0.0, t_full + t_back - t_bare), share, step_factor], dtype=torch.float64)
    dist.all_reduce(out, op=dist.ReduceOp.MAX, group=group)
    return dict(fsdp2_call_s=float(out[0]), dtensor_gather_s=float(out[1]), comm_cpu_share=float(out[2]),
                step_compute_factor=float(out[3]))


def _comm_cpu_share(dist, torch, group, k: int, reps: int, med) -> float:
    """The fraction of a collective's duration its members' compute loses while it runs
    (``comm_cpu_share``): every rank runs a fixed loop of 256 x 256 matmuls (``C`` seconds
    alone) while 16 broadcasts of 256 KB from rotating roots progress on gloo's threads (``X``
    alone); both at once take ``T``. ``(T - max(C, X)) / min(C, X)``, clamped to [0, 1]: 0 =
    communication fully hidden, 1 = none of it overlaps."""
    a = torch.randn(256, 256)
    b = torch.randn(256, 256)
    bufs = [torch.ones(65536) for _ in range(16)]

    def compute():
        for _ in range(40):
            a @ b

    def issue():
        return [dist.broadcast(x, dist.get_global_rank(group, i % k), group=group, async_op=True)
                for i, x in enumerate(bufs)]

    def both():
        works = issue()
        compute()
        for w in works:
            w.wait()

    t_c = med(compute, reps)
    t_x = med(lambda: [w.wait() for w in issue()], reps)
    t_both = med(both, reps)
    return min(1.0, max(0.0, (t_both - max(t_c, t_x)) / max(min(t_c, t_x), 1e-9)))


def _fsdp_overheads(torch, group, repeats: int) -> dict[str, float]:
    """FSDP2 call and DTensor dispatch cost on a 1-rank group (no communication)."""
    from torch import nn
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    mesh = DeviceMesh.from_group(group, "cpu")
    inp = torch.ones(2, 8)
    plain = nn.Sequential(*[nn.Linear(8, 8) for _ in range(8)])
    sharded = nn.Sequential(*[nn.Linear(8, 8) for _ in range(8)])
    for layer in sharded:
        fully_shard(layer, mesh=mesh)
    fully_shard(sharded, mesh=mesh)

    def run(model):
        def f():
            for _ in range(10):
                model(inp).sum().backward()
        return f

    run(sharded)()
    t_plain = _median_s(run(plain), repeats)
    t_fsdp = _median_s(run(sharded), repeats)
    # per unit and call: 9 units x (all-gather + Z3 backward all-gather + reduce-scatter) per step
    fsdp2_call_s = max(0.0, (t_fsdp - t_plain) / 10 / (9 * 3))
    p = sharded[0].weight
    assert isinstance(p, DTensor)
    q = p.to_local().clone()
    n = 500
    with torch.no_grad():
        t_d = _median_s(lambda: [p.mul_(1.0) for _ in range(n)], repeats) / n
        t_q = _median_s(lambda: [q.mul_(1.0) for _ in range(n)], repeats) / n
    return dict(fsdp2_call_s=fsdp2_call_s, dtensor_op_s=max(0.0, t_d - t_q))


def _median_of_runs(runs: Sequence[dict[str, float]]) -> dict[str, float]:
    """Each figure's median over repeated in-situ measurements (the figures are independent)."""
    return {key: statistics.median(r[key] for r in runs) for key in runs[0]}


def _worker(sizes: Sequence[int], repeats: int, fsdp_solo: bool,
            in_situ_repeats: int = IN_SITU_REPEATS) -> dict[str, Any] | None:
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


# ----------------------------------------------------------------------------------- compute


def _matmul(sizes: Sequence[int], repeats: int) -> dict[str, list[tuple[int, float]]]:
    import torch

    out: dict[str, list[tuple[int, float]]] = {}
    for dtype in (torch.float32, torch.bfloat16):
        pts = []
        for d in sizes:
            if dtype == torch.bfloat16 and d > 256:
                break
            a = torch.randn(d, d).to(dtype)
            b = torch.randn(d, d).to(dtype)
            reps = max(3, int(2e8 / (2 * d**3)))
            a @ b
            t = _median_s(lambda: [a @ b for _ in range(reps)], repeats) / reps
            pts.append((d, 2 * d**3 / t))
        out[str(dtype)] = pts
    # training matmuls: x (t, i) . W (o, i)^T forward, grad_x and grad_W backward, with autograd
    pts = []
    for d in sizes:
        t_rows = 4 * d
        x = torch.randn(t_rows, d, requires_grad=True)
        w = torch.randn(d, d, requires_grad=True)
        flops = 3 * 2 * t_rows * d * d
        reps = max(2, int(2e8 / flops))

        def fb(x=x, w=w):
            for _ in range(reps):
                torch.nn.functional.linear(x, w).backward(torch.ones(t_rows, d))
        fb()
        pts.append(((t_rows * d * d) ** (1 / 3), flops * reps / _median_s(fb, repeats)))
    out["autograd"] = pts
    return out


#: (seq_len, head_dim) of the attention calibration: one head's mean dimension 51 ... 203
ATTENTION_SHAPES = ((64, 32), (128, 32), (128, 64), (256, 64), (256, 128))
#: batch x heads of the attention calibration (4 sequences x 8 heads)
ATTENTION_BATCH, ATTENTION_HEADS = 4, 8
QUICK_ATTENTION_SHAPES = ((64, 32), (128, 64))


def _training_kernels(repeats: int, quick: bool) -> dict[str, Any]:
    """The training kernels that are neither a GEMM nor a plain memory pass, forward + backward
    under autograd, one thread:

    * attention: ``F.scaled_dot_product_attention(q, k, v, is_causal=True)`` on ``(4, 8,
      seq_len, head_dim)`` (``n = 32`` heads of 4 sequences, the models' 4-D layout: a 3-D
      ``(n, seq_len, head_dim)`` one, and more heads, measured slower here), per
      :data:`ATTENTION_SHAPES`:
      ``(d, FLOP/s)`` with ``d = (seq_len² · head_dim)^(1/3)`` and the FLOPs counted as the
      workload counts them (``3 ×`` the causal forward ``2 · n · seq_len² · head_dim``);
    * ``torch.nn.RMSNorm`` over ``(1024, 256)``: seconds per element;
    * ``F.gelu`` over ``(1024, 1024)``: seconds per element.
    """
    import torch
    import torch.nn.functional as F

    att = []
    for seq, hd in (QUICK_ATTENTION_SHAPES if quick else ATTENTION_SHAPES):
        shape = (ATTENTION_BATCH, ATTENTION_HEADS, seq, hd)
        n = ATTENTION_BATCH * ATTENTION_HEADS
        q, k, v = (torch.randn(*shape, requires_grad=True) for _ in range(3))
        go = torch.ones(*shape)

        def fb(q=q, k=k, v=v, go=go):
            F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(go)
        fb()
        att.append(((seq * seq * hd) ** (1 / 3), 3 * 2 * n * seq * seq * hd / _median_s(fb, max(repeats, 15))))

    def per_numel(fn, shape):
        x = torch.randn(*shape, requires_grad=True)
        go = torch.ones(*shape)

        def fb():
            fn(x).backward(go)
        fb()
        return _median_s(fb, max(repeats, 15)) / x.numel()

    norm = torch.nn.RMSNorm(256)
    return dict(attention=sorted(att), norm_s_per_numel=per_numel(norm, (1024, 256)),
                activation_s_per_numel=per_numel(F.gelu, (1024, 1024)))


#: (a, b) matrices of the Newton-Schulz calibration (square and 1:4, as transformer blocks have)
NS_SHAPES = ((64, 64), (64, 256), (128, 128), (128, 512), (256, 256), (256, 1024), (512, 512))
QUICK_NS_SHAPES = ((64, 64), (128, 512))


def _newton_schulz(repeats: int, quick: bool, backend: str = "standard") -> list[tuple[float, float]]:
    """One fp32 Newton-Schulz call (5 steps) per shape: ``(d, FLOP/s)`` with ``d = (a²·b)^(1/3)``
    and the FLOPs of :func:`dmuon.plan.cost.model.matrix_ns_flops`. ``"standard"``:
    ``dmuon.exec.optim.ns_kernel.newton_schulz`` (the matmuls with their transposed operand, the
    norm, the axpys) per :data:`NS_SHAPES` — a square ``a @ b`` on the same sizes runs 10–25 %
    faster on this CPU, which the plain curve would assume; ``"gram"``: ``gram_newton_schulz``
    (default restarts, fallback check) on the shapes of :data:`NS_SHAPES` where it needs fewer
    FLOPs (the 1:4 ones), which run at a lower rate per FLOP than the standard call here."""
    import torch

    from dmuon.exec.optim.ns_gram import gram_newton_schulz
    from dmuon.exec.optim.ns_kernel import newton_schulz
    from dmuon.plan.cost.model import matrix_ns_flops

    fn = gram_newton_schulz if backend == "gram" else newton_schulz
    shapes = QUICK_NS_SHAPES if quick else NS_SHAPES
    if backend == "gram":
        shapes = tuple((a, b) for a, b in shapes if matrix_ns_flops(a, b, "gram") < matrix_ns_flops(a, b, "standard"))
    pts = []
    for a, b in shapes:
        x = torch.randn(a, b)
        fn(x, dtype=torch.float32)
        t = _median_s(lambda x=x: fn(x, dtype=torch.float32), repeats)
        pts.append((ns_mean_dim(a, b), matrix_ns_flops(a, b, backend) / t))
    return sorted(pts)


#: (a, b) matrices and batch sizes of the batched-NS calibration (:func:`_ns_batch_factor`):
#: the benchmark models' shapes; batches of 32 only where ``a·b <= 16384`` (the calibration's
#: time: one call of 32 at 256 × 256 takes ~0.25 s here); beyond the largest measured batch the
#: factor is held
NS_BATCH_SHAPES = ((128, 128), (128, 512), (256, 256), (256, 1024))
NS_BATCHES = (4, 16, 32)
QUICK_NS_BATCH = (((128, 128),), (4,))


def _ns_batch_factor(repeats: int, quick: bool) -> list[tuple[float, int, float]]:
    """Per matrix, one batched fp32 ``newton_schulz`` call on ``(B, a, b)`` (how ``dmuon.Muon``
    runs a bucket) over one call on a single ``(a, b)`` matrix, single and batched calls
    interleaved, each timed right after an untimed call of the same size (as
    :func:`_newton_schulz` times the single call: a call after a larger one pays for the memory
    the allocator handed back, which a step's repeated calls do not), medians of each:
    ``(d, B, factor)`` points (``d = (a²·b)^(1/3)``). On this 2-core VM: ×0.8–1.0 for batches
    of 4–16 at ``d <= 203``, ×1.0–1.26 at ``d >= 256``, whose batches leave the cache."""
    import torch

    from dmuon.exec.optim.ns_kernel import newton_schulz

    shapes, batches = QUICK_NS_BATCH if quick else (NS_BATCH_SHAPES, NS_BATCHES)
    pts = []
    for a, b in shapes:
        sizes = [1] + [B for B in batches if B <= 16 or a * b <= 16384]
        xs = {B: torch.randn(B, a, b) if B > 1 else torch.randn(a, b) for B in sizes}
        samples: dict[int, list[float]] = {B: [] for B in sizes}
        for x in xs.values():
            newton_schulz(x, dtype=torch.float32)
        for _ in range(repeats):
            for B, x in xs.items():  # each timed call right after an untimed one of its own size
                newton_schulz(x, dtype=torch.float32)
                t0 = time.perf_counter()
                newton_schulz(x, dtype=torch.float32)
                samples[B].append((time.perf_counter() - t0) / B)
        single = statistics.median(samples[1])
        pts += [(ns_mean_dim(a, b), B, statistics.median(samples[B]) / single) for B in sizes[1:]]
    return sorted(pts)


def _probes():
    """The busy-node reference mix, one thread: ``(matmul-class, memory-bound)`` callables, each a
    transformer block's kernels forward + backward under autograd — ``F.linear`` at (1024, 256) x
    (256, 256) and causal SDPA on (4, 8, 128, 32); GELU over (1024, 1024), RMSNorm over (1024, 256)
    and a residual add."""
    import torch
    import torch.nn.functional as F

    x = torch.randn(1024, 256, requires_grad=True)
    w = torch.randn(256, 256, requires_grad=True)
    q, k, v = (torch.randn(4, 8, 128, 32, requires_grad=True) for _ in range(3))
    g = torch.randn(1024, 1024, requires_grad=True)
    norm = torch.nn.RMSNorm(256)

    def compute():
        F.linear(x, w).sum().backward()
        F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()

    def memory():
        F.gelu(g).sum().backward()
        norm(x).sum().backward()
        (x + x).sum().backward()

    return compute, memory


def _busy_loop(stop, run, ready) -> None:
    """A background process of :func:`_busy_node`: the reference mix while ``run`` is set."""
    import torch

    torch.set_num_threads(1)
    compute, memory = _probes()
    ready.set()
    while not stop.is_set():
        if run.wait(0.01):
            compute()
            memory()


def _busy_node(repeats: int) -> dict[str, float]:
    """Slowdown of the reference mix (:func:`_probes`) with every other core of the node running
    it too (``cores - 1`` background processes) against this core alone: the benchmark's
    condition, one rank per core, all computing. Solo and busy samples interleaved (the
    background paused / running), medians of each."""
    import torch.multiprocessing as mp

    cores = os.cpu_count() or 1
    if cores <= 1:
        return dict(busy_compute_factor=1.0, busy_memory_factor=1.0)
    compute, memory = _probes()
    compute(), memory()
    ctx = mp.get_context("spawn")
    stop, run = ctx.Event(), ctx.Event()
    readies = [ctx.Event() for _ in range(cores - 1)]
    procs = [ctx.Process(target=_busy_loop, args=(stop, run, r), daemon=True) for r in readies]
    for p in procs:
        p.start()
    samples: dict[str, list[float]] = dict(solo_c=[], solo_m=[], busy_c=[], busy_m=[])
    try:
        for r in readies:
            r.wait(120)
        for _ in range(repeats):
            for mode in ("solo", "busy"):
                (run.set if mode == "busy" else run.clear)()
                time.sleep(0.03)  # the background settles (running, or parked on the event)
                samples[f"{mode}_c"].append(_median_s(compute, 1))
                samples[f"{mode}_m"].append(_median_s(memory, 1))
    finally:
        stop.set()
        run.set()
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    med = {k: statistics.median(v) for k, v in samples.items()}
    return dict(busy_compute_factor=max(1.0, med["busy_c"] / med["solo_c"]),
                busy_memory_factor=max(1.0, med["busy_m"] / med["solo_m"]))


def _overheads(repeats: int) -> dict[str, float]:
    import torch
    from torch import nn

    x = torch.ones(1)
    n = 2000
    op_s = _median_s(lambda: [x.add(1.0) for _ in range(n)], repeats) / n
    xg = torch.ones(8, requires_grad=True)

    def chain(ops):
        def f():
            y = xg
            for _ in range(ops):
                y = y * 1.0001
            y.sum().backward()
        return f

    autograd_op_s = max(0.0, (_median_s(chain(110), repeats) - _median_s(chain(10), repeats)) / 100 / 3)
    big = torch.ones(4 * 2**20)
    other = torch.ones_like(big)
    out_t = torch.empty_like(big)
    t = _median_s(lambda: torch.add(big, other, out=out_t), repeats)
    elem_Bps = 3 * big.numel() * 4 / t
    lin = nn.Linear(8, 8)
    inp = torch.ones(2, 8, requires_grad=True)

    def run():
        for _ in range(200):
            lin(inp).sum().backward()

    plain = _median_s(run, repeats)
    hooks = [lin.register_forward_pre_hook(lambda m, a: None), lin.register_forward_hook(lambda m, a, o: None),
             lin.register_full_backward_pre_hook(lambda m, g: None), lin.register_full_backward_hook(lambda m, gi, go: None)]
    hooked = _median_s(run, repeats)
    for h in hooks:
        h.remove()
    hook_s = max(0.0, (hooked - plain) / 200 / 2)  # per hook call: forward and backward each run two
    return dict(op_overhead_s=op_s, autograd_op_s=autograd_op_s, elementwise_Bps=elem_Bps, hook_s=hook_s)


# ----------------------------------------------------------------------------------- main


def calibrate(*, group_sizes: Sequence[int] = (2, 3, 4), quick: bool = False, repeats: int | None = None) -> tuple[Hardware, dict]:
    """Run the microbenchmarks (module docstring) and return ``(Hardware, raw measurements)``."""
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
            curves.append(CollectiveCurve(kind=kind, group_size=int(k), nbytes=tuple(int(b) for b, _ in pts),
                                          seconds=tuple(float(s) for _, s in pts)))
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


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m dmuon calibrate [--json F] [--quick]``: print the record; write it with ``--json``."""
    parser = argparse.ArgumentParser(prog="python -m dmuon calibrate",
                                     description="Microbenchmark this machine into a cpu-gloo hardware record "
                                                 "for `python -m dmuon simulate --hw FILE` (under 3 minutes).")
    parser.add_argument("--json", metavar="FILE", default=None, help="write the record (and raw measurements) here")
    parser.add_argument("--quick", action="store_true", help="fewer sizes and repeats (smoke run)")
    parser.add_argument("--group-sizes", type=int, nargs="+", default=[2, 3, 4], help="gloo group sizes to measure")
    args = parser.parse_args(argv)
    if args.json and not os.path.isdir(os.path.dirname(os.path.abspath(args.json))):
        parser.error(f"--json: the folder of {args.json!r} does not exist")
    if any(k < 2 for k in args.group_sizes):
        parser.error("--group-sizes must be >= 2")
    hw, raw = calibrate(group_sizes=args.group_sizes, quick=args.quick)
    print(f"{hw.name}: {raw['wall_s']:.0f} s")
    for d, f in hw.matmul_peak_flops:
        print(f"  matmul peak {d.replace('torch.', '')}: {f / 1e9:.1f} GFLOP/s (1 thread)")
    print(f"  operator overhead {1e6 * hw.op_overhead_s:.2f} us, elementwise {hw.elementwise_Bps / 1e9:.2f} GB/s, "
          f"hook {1e6 * hw.hook_s:.1f} us, FSDP2 call {1e6 * hw.fsdp2_call_s:.0f} us, DTensor op +{1e6 * hw.dtensor_op_s:.1f} us, "
          f"collective issue {1e6 * hw.issue_s:.0f} us, autograd op {1e6 * hw.autograd_op_s:.1f} us")
    if hw.autograd_matmul_efficiency:
        print("  training matmul (autograd) fraction of peak by d: "
              + ", ".join(f"{d:.0f} {e:.2f}" for d, e in hw.autograd_matmul_efficiency))
    if hw.attention_efficiency:
        print("  attention (SDPA forward + backward) fraction of peak by head d: "
              + ", ".join(f"{d:.0f} {e:.2f}" for d, e in hw.attention_efficiency))
    if hw.ns_efficiency:
        print("  Newton-Schulz call (fp32) fraction of peak by d: "
              + ", ".join(f"{d:.0f} {e:.2f}" for d, e in hw.ns_efficiency))
    if hw.gram_ns_efficiency:
        print("  Gram Newton-Schulz call (fp32) fraction of peak by d: "
              + ", ".join(f"{d:.0f} {e:.2f}" for d, e in hw.gram_ns_efficiency))
    if hw.ns_batch_factor:
        print("  batched Newton-Schulz, per matrix over one call, by (d, batch): "
              + ", ".join(f"{d:.0f}/{b:.0f} x{f:.2f}" for d, b, f in hw.ns_batch_factor))
    print(f"  busy node ({hw.cores_per_node} cores computing): matmul-class x{hw.busy_compute_factor:.2f}, "
          f"memory-bound x{hw.busy_memory_factor:.2f}")
    print(f"  RMSNorm forward + backward {1e9 * hw.norm_train_s_per_numel:.2f} ns / element, "
          f"GELU forward + backward {1e9 * hw.activation_train_s_per_numel:.2f} ns / element")
    step_factor = dict(hw.step_compute_factor_by_group)
    for (k, f), (_, g), (_, h) in zip(hw.fsdp2_call_s_by_group, hw.dtensor_gather_s_by_group,
                                      hw.comm_cpu_share_by_group):
        print(f"  k={k}: FSDP2 call {1e3 * f:.2f} ms, DTensor gather {1e3 * g:.2f} ms (each beyond its collective), comm CPU share {h:.2f}, "
              f"step compute x{step_factor.get(k, 1.0):.2f}")
    for c in hw.curves:
        if c.kind in ("broadcast", "all_gather"):
            pts = ", ".join(f"{b / 1024:.0f}K {1e3 * s:.2f}" for b, s in zip(c.nbytes, c.seconds))
            print(f"  {c.kind:<10} k={c.group_size}: ms by size {pts}")
    if args.json:
        dump(hw, args.json, raw=raw)
        print(f"wrote {args.json}")
    return 0
