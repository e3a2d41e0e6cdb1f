"""Forward + backward overhead of dmuon's hook boundaries over FSDP2, from ``profile_step.py``.

    python benchmarks/hook_overhead.py                                  # this tree, N = 1 and 2, 5 repeats
    python benchmarks/hook_overhead.py --tree before=/path/to/old/checkout --tree after=.

Runs ``benchmarks/profile_step.py`` of each tree (its own dmuon, through ``PYTHONPATH``) once per
(repeat, N, variant), the variants interleaved within each repeat so that a slow spell of the
shared machine hits them alike: FSDP2 + AdamW (``adamw``, from the first tree), then dmuon Z3
(``dmuon_z3``) of every tree. From each launch it reads the ``step.forward`` and
``step.backward`` ranges (inclusive CPU ms per step, averaged over the ranks) and the sum of
dmuon's hook ranges; the overhead of a dmuon launch is its forward + backward minus the AdamW
launch's of the same repeat; the same for the main thread's CPU time in forward + backward (less
sensitive than wall time to a shared machine's other jobs). Printed: median and spread (min-max)
over the repeats.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

HOOKS = (
    "dmuon.hook.pre_forward",
    "dmuon.hook.post_forward",
    "dmuon.hook.pre_backward",
    "dmuon.hook.post_backward",
)


def run_profile(tree: Path, variant: str, nproc: int, size: str, steps: int, warmup: int) -> dict:
    """One ``profile_step.py`` launch of ``tree``; the per-rank-mean ms of the ranges read back."""
    env = dict(os.environ, PYTHONPATH=str(tree), OMP_NUM_THREADS="1")
    cmd = [sys.executable, str(tree / "benchmarks" / "profile_step.py"), "--variant", variant]
    cmd += ["--nproc", str(nproc), "--size", size, "--steps", str(steps), "--warmup", str(warmup), "--top", "1"]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True, cwd=tree).stdout
    ranges = {}
    for line in out.splitlines():
        m = re.match(r"^((?:step|dmuon)\.[\w.]+)\s+(\d+)((?:\s+[\d.]+)+)$", line.strip())
        if m:
            cells = [float(x) for x in m.group(3).split()]
            ranges[m.group(1)] = sum(cells) / len(cells)
        m = re.match(r"^forward \+ backward main-thread CPU ms per rank: (.*)$", line.strip())
        if m:
            cells = [float(x.split()[1]) for x in m.group(1).split(",")]
            ranges["cpu"] = sum(cells) / len(cells)
    fb = ranges["step.forward"] + ranges["step.backward"]
    return dict(fwd_bwd_ms=fb, cpu_ms=ranges["cpu"], hooks_ms=sum(ranges.get(h, 0.0) for h in HOOKS), ranges=ranges)


def summary(values: list[float]) -> str:
    return f"{statistics.median(values):7.2f} [{min(values):7.2f}, {max(values):7.2f}]"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tree", action="append", default=[], help="name=path of a checkout (default: this one)")
    p.add_argument("--nproc", type=int, nargs="+", default=[1, 2])
    p.add_argument("--size", default="small")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=3)
    args = p.parse_args(argv)
    here = Path(__file__).resolve().parents[1]
    trees = [(t.split("=", 1)[0], Path(t.split("=", 1)[1]).resolve()) for t in args.tree] or [("this", here)]
    rows: dict = {}
    for rep in range(args.repeats):
        for n in args.nproc:
            base = run_profile(trees[0][1], "adamw", n, args.size, args.steps, args.warmup)
            rows.setdefault((n, "adamw"), []).append(dict(base, overhead_ms=0.0, cpu_overhead_ms=0.0))
            for name, tree in trees:
                r = run_profile(tree, "dmuon_z3", n, args.size, args.steps, args.warmup)
                r["overhead_ms"] = r["fwd_bwd_ms"] - base["fwd_bwd_ms"]
                r["cpu_overhead_ms"] = r["cpu_ms"] - base["cpu_ms"]
                rows.setdefault((n, f"dmuon_z3 {name}"), []).append(r)
            print(f"repeat {rep + 1}/{args.repeats}, N={n} done", file=sys.stderr, flush=True)
    print(
        f"size {args.size}; {args.repeats} repeats x {args.steps} profiled steps (after {args.warmup} warm-up); "
        "ms per step, median [min, max] over repeats"
    )
    cols = ("fwd_bwd_ms", "overhead_ms", "cpu_ms", "cpu_overhead_ms", "hooks_ms")
    names = ("fwd+bwd wall", "wall over adamw", "fwd+bwd thread CPU", "CPU over adamw", "dmuon hook ranges")
    print(f"{'N':>2} {'variant':<18}" + "".join(f"{x:>27}" for x in names))
    for (n, variant), rs in rows.items():
        print(f"{n:>2} {variant:<18}" + "".join(f"{summary([r[c] for r in rs]):>27}" for c in cols))


if __name__ == "__main__":
    main()
