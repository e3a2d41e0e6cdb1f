"""The calibration's measurements inside a gloo process group (:mod:`dmuon.sim._calibrate`,
"gloo collectives" and "FSDP2 call / step-compute factor / DTensor gather / communication CPU
share"): the collective curves (:func:`_time_collectives`), the in-situ FSDP2 stacks and the
fitting of their two terms (:func:`_fsdp2_stack`, :func:`fsdp2_terms`), the DTensor gather and the
communication CPU share (:func:`_in_situ`, :func:`_comm_cpu_share`), and FSDP2 / DTensor dispatch
on a 1-rank group (:func:`_fsdp_overheads`). Called by every rank of a launch
(:func:`dmuon.sim._calibrate._worker`), which passes ``torch.distributed`` in as ``dist``."""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from typing import Any

from dmuon.sim._calibrate.compute import _median_s

#: payload bytes per rank of the collective curves
SIZES = (256, 4096, 65536, 524288, 2097152, 8388608)
QUICK_SIZES = (4096, 524288)
KINDS = ("broadcast", "reduce", "all_reduce", "all_gather", "reduce_scatter", "all_to_all")


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


def _fsdp2_stack(
    dist, torch, group, mesh, k: int, med, reps: int, width: int, per_unit: int, rows: int
) -> dict[str, float]:
    """One FSDP2 stack of 4 units of ``per_unit`` ``Linear(width, width)`` on ``rows`` inputs:
    ``call_s`` = the sharded stack's forward + backward minus the plain stack's (the median of
    interleaved pairs), per call, less the bare blocking all-gather / reduce-scatter of the unit's
    payload (the simulator times those from the curves); ``compute_s`` = the plain stack's time;
    ``calls``."""
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    units = 4

    def stack():
        return nn.Sequential(
            *[nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(per_unit)]) for _ in range(units)]
        )

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
    extra = (high["call_s"] * high["calls"] - low["call_s"] * low["calls"]) / max(
        high["compute_s"] - low["compute_s"], 1e-9
    )
    extra = max(0.0, extra)
    return max(0.0, small["call_s"] - extra * small["compute_s"] / small["calls"]), 1.0 + extra


def _in_situ(dist, torch, group, k: int, repeats: int) -> dict[str, float]:
    """FSDP2's per-call cost and step-compute factor (:data:`FSDP2_STACKS`, :func:`fsdp2_terms`),
    the DTensor-gather cost on ``group`` (``k`` ranks; members only call), each beyond the bare
    collectives, and the communication CPU share (:mod:`dmuon.sim._calibrate`)."""
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
    fsdp2, step_factor = fsdp2_terms(*(_fsdp2_stack(dist, torch, group, mesh, k, med, reps, *s) for s in FSDP2_STACKS))
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
    return dict(
        fsdp2_call_s=float(out[0]),
        dtensor_gather_s=float(out[1]),
        comm_cpu_share=float(out[2]),
        step_compute_factor=float(out[3]),
    )


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
        return [
            dist.broadcast(x, dist.get_global_rank(group, i % k), group=group, async_op=True)
            for i, x in enumerate(bufs)
        ]

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
    from dmuon._dtensor import is_dtensor

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
    assert is_dtensor(p)
    q = p.to_local().clone()
    n = 500
    with torch.no_grad():
        t_d = _median_s(lambda: [p.mul_(1.0) for _ in range(n)], repeats) / n
        t_q = _median_s(lambda: [q.mul_(1.0) for _ in range(n)], repeats) / n
    return dict(fsdp2_call_s=fsdp2_call_s, dtensor_op_s=max(0.0, t_d - t_q))
