"""Fit the gloo link record of ``collectives="auto"`` (``dmuon.plan._rules.COLLECTIVE_LINKS["gloo"]``).

    python benchmarks/gloo_link_fit.py --json benchmarks/gloo_link_fit.json   # 214 s on 2 cores (3 runs)

Measures the simulator's gloo collective curves (``python -m dmuon calibrate``'s first stage:
:func:`dmuon.sim._calibrate.gloo._time_collectives`, the median seconds from issue to ``wait()``
of broadcast, reduce, all-gather and reduce-scatter at payloads 256 B - 8 MiB per rank, group
sizes 2, 3 and 4 with the whole world as the group, one launch of ``k`` processes each, one
thread per rank), ``--runs`` times; takes each point's median over the runs; and fits the
planner's alpha-beta formulas to them (:func:`dmuon.sim._calibrate.link_fit.fit_link`: one
``(alpha, B)`` for broadcast / reduce, one for all-gather / reduce-scatter, least squares on
relative error). Prints the four numbers as they go into ``dmuon/plan/rules.py``; ``--json``
writes the median curves and the fit (``tests`` re-fit that file and check the shipped numbers).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

GROUP_SIZES = (2, 3, 4)
KINDS = ("broadcast", "reduce", "all_gather", "reduce_scatter")


def _curves(sizes, repeats):
    """One rank of a launch: the curves on the whole world (rank 0 returns them)."""
    import torch
    import torch.distributed as dist

    from dmuon.sim._calibrate.gloo import _time_collectives

    torch.set_num_threads(1)
    res = _time_collectives(dist, torch, dist.group.WORLD, dist.get_world_size(), sizes, repeats)
    dist.barrier()
    return {kind: res[kind] for kind in KINDS} if dist.get_rank() == 0 else None


def measure(runs: int, repeats: int) -> dict:
    """``{str(k): {kind: [[payload bytes, median seconds over runs], ...]}}``."""
    from dmuon._launch import run_distributed
    from dmuon.sim._calibrate.gloo import SIZES

    got = {str(k): [] for k in GROUP_SIZES}
    for run in range(runs):
        for k in GROUP_SIZES:
            got[str(k)].append(run_distributed(_curves, k, SIZES, repeats, timeout_s=600.0)[0])
        print(f"run {run + 1}/{runs} done", file=sys.stderr, flush=True)
    return {
        k: {
            kind: [
                [int(pts[0][kind][i][0]), statistics.median(float(p[kind][i][1]) for p in pts)]
                for i in range(len(pts[0][kind]))
            ]
            for kind in KINDS
        }
        for k, pts in got.items()
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=3, help="measurements of every curve (the median is fitted)")
    p.add_argument("--repeats", type=int, default=7, help="timed calls per point and run (their median)")
    p.add_argument("--json", help="write the median curves and the fit here")
    args = p.parse_args(argv)
    from dmuon.sim._calibrate.link_fit import fit_link

    t0 = time.time()
    curves = measure(args.runs, args.repeats)
    fit = fit_link(curves)
    print(
        f"gloo link fitted on {os.cpu_count()} cores ({platform.processor() or platform.machine()}), "
        f"{time.time() - t0:.0f} s:"
    )
    print(
        f"  broadcast / reduce:            alpha {fit['latency_s'] * 1e6:.1f} us, B {fit['bandwidth_Bps'] / 1e9:.3f} GB/s"
    )
    print(
        f"  all-gather / reduce-scatter:   alpha {fit['all_gather_latency_s'] * 1e6:.1f} us, "
        f"B {fit['all_gather_bandwidth_Bps'] / 1e9:.3f} GB/s"
    )
    if args.json:
        meta = dict(
            date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            cpu_count=os.cpu_count(),
            runs=args.runs,
            repeats=args.repeats,
            group_sizes=list(GROUP_SIZES),
        )
        Path(args.json).write_text(json.dumps(dict(meta=meta, curves=curves, fit=fit), indent=1) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
