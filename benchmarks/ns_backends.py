"""Gram NS against the standard iteration, and NS throughput against the core's matmul peak.

The shapes are the benchmark sizes' Muon matrices, batched as ``dmuon.Muon`` batches them in
fp32 (one ``(B, d, D)`` call per ``(min, max)`` side; ``B`` = the matrices one owner rank holds
at N = 2 and N = 4 for ``benchmarks/step_time.py``'s ``small`` (128 x 128, 128 x 512) and
``large`` (256 x 256, 256 x 1024) GPTs). For each shape, in every round, in turn:

- ``standard``: :func:`dmuon._update.newton_schulz` (fp32, 5 steps, "muon");
- ``gram``: :func:`gram_newton_schulz` with its default restarts and fallback check;
- ``gram_r2``: ``restart_every=[2]`` (one restart, the Dao-AILab schedule), fallback on;
- with ``--baseline REV``: the same three from ``dmuon/exec/_optim/newton_schulz.py`` as of git
  revision ``REV`` (``old_*``), so before / after are measured in one sitting;
- ``mm``: a square 512 fp32 matmul (the core's attainable matmul rate, measured in the run).

Every variant of a round runs back to back (interleaved), rounds repeat; ratios are taken
within a round, and the table gives their median and [min-max] over the rounds. Columns:

- ``FLOP ratio``: ``gram_ns_flops / ns_flops`` (the FLOPs each runs, dmuon.plan._cost.cost_model);
- ``time ratio``: gram / standard wall time; ``goal`` = ``1 - 0.8·(1 - FLOP ratio)`` (Gram
  faster by at least 80 % of its FLOP saving); the FLOP ratio of the baseline revision is
  given in ``old FLOP ratio`` (its Gram counted as a general matmul);
- ``GF/s``: ``ns_flops`` (standard) or ``gram_ns_flops`` (Gram) / median time; ``of mm``:
  that over the matmul rate; ``of peak``: over the theoretical peak of one core
  (``--flops-per-cycle`` x the nominal clock of /proc/cpuinfo; boost clocks are higher).

With ``--kernels``, a third table: the matmul kernels both iterations are made of, timed alone in
the same rounds (``(d, d)·(d, d)`` and ``(d, d)·(d, D)`` as ``baddbmm``, ``X Xᵀ`` full and as
Gram NS forms it: the symmetric blocks from ``GRAM_SYM_MIN_SIDE``, the full product below), their GFLOP/s, and the time ratio Gram / standard they imply with no other
work (``3·(Gram + QX) + 11·dd`` against ``5·(XXᵀ + dd + QX)`` for 5 steps and the default
restarts): the best the kernels allow, to read the measured ratio against.

Usage::

    python benchmarks/ns_backends.py --rounds 9 --baseline e56e164 [--kernels] [--json out.json]

Single thread (``torch.set_num_threads(1)``): the ranks of step_time.py run one each. Times are
this thread's CPU time by default (``--clock cpu``, ``time.thread_time``): all the work of a
single-threaded torch call runs on the calling thread, and CPU time does not count the time the
scheduler gives to other processes, which on a shared 2-core machine dominates wall time.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dmuon.exec._optim import ns_backends as ns  # noqa: E402
from dmuon import _ns_gram as ns_gram  # noqa: E402
from dmuon.plan._cost import flops as _flops  # noqa: E402
from dmuon.plan._cost.flops import gram_product_flops  # noqa: E402

# (label, B, d, D): matrices per owner rank, batched as dmuon.Muon does (fp32)
SHAPES = [
    ("small N=2", 8, 128, 128),
    ("small N=2", 4, 128, 512),
    ("small N=4", 4, 128, 128),
    ("small N=4", 2, 128, 512),
    ("large N=2", 16, 256, 256),
    ("large N=2", 8, 256, 1024),
    ("large N=4", 8, 256, 256),
    ("large N=4", 4, 256, 1024),
    # the MLP's up projection as a tall batch (B, 4d, d), i.e. the transposed view inside NS
    ("large N=2, tall", 8, 1024, 256),
]
FP32 = torch.float32


def _old_module(rev: str):
    """dmuon/exec/_optim/newton_schulz.py at git revision ``rev``, imported as a separate module."""
    src = subprocess.run(
        ["git", "-C", str(ROOT), "show", f"{rev}:dmuon/exec/_optim/newton_schulz.py"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    path = Path(tempfile.mkdtemp()) / "old_newton_schulz.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("old_newton_schulz", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _variants(mod, prefix: str) -> dict:
    return {
        f"{prefix}standard": lambda x: mod.newton_schulz(x, dtype=FP32),
        f"{prefix}gram": lambda x: mod.gram_newton_schulz(x, dtype=FP32),
        f"{prefix}gram_r2": lambda x: mod.gram_newton_schulz(x, dtype=FP32, restart_every=[2]),
    }


CLOCKS = {"cpu": time.thread_time, "wall": time.perf_counter}
_clock = time.thread_time


def _time(fn, reps: int) -> float:
    best = float("inf")
    for _ in range(reps):
        t0 = _clock()
        fn()
        best = min(best, _clock() - t0)
    return best


def _peak_gflops(flops_per_cycle: int) -> tuple[float, str]:
    mhz, model = None, "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("cpu MHz") and mhz is None:
                mhz = float(line.split(":")[1])
            if line.startswith("model name") and model == "?":
                model = line.split(":")[1].strip()
    except OSError:
        pass
    return (flops_per_cycle * mhz / 1e3 if mhz else float("nan")), f"{model}, {mhz} MHz"


def _med(xs):
    return statistics.median(xs), min(xs), max(xs)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--reps", type=int, default=2, help="calls per variant per round (fastest kept)")
    parser.add_argument("--baseline", default=None, help="git revision for the 'before' variants")
    parser.add_argument(
        "--flops-per-cycle",
        type=int,
        default=32,
        help="fp32 FLOPs per cycle of one core (AVX2, 2 FMA pipes: 32; AVX-512: 64)",
    )
    parser.add_argument("--shapes", default=None, help="subset, e.g. 8x256x1024,16x256x256")
    parser.add_argument(
        "--clock",
        choices=sorted(CLOCKS),
        default="cpu",
        help="cpu: this thread's CPU time (time.thread_time; robust to a shared, "
        "oversubscribed machine, where wall time mostly measures the scheduler); wall",
    )
    parser.add_argument("--kernels", action="store_true", help="also time the iterations' matmul kernels alone")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    global _clock
    _clock = CLOCKS[args.clock]
    torch.set_num_threads(1)
    shapes = SHAPES
    if args.shapes:
        want = {tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")}
        shapes = [s for s in SHAPES if s[1:] in want]
    variants = _variants(ns, "")
    old = None
    if args.baseline:
        old = _old_module(args.baseline)
        variants.update(_variants(old, "old_"))
    a = torch.randn(512, 512)
    mm = lambda: a @ a  # noqa: E731
    peak, cpu = _peak_gflops(args.flops_per_cycle)
    gen = torch.Generator().manual_seed(0)
    rows = []
    for label, B, d, D in shapes:
        x = torch.randn(B, d, D, generator=gen)
        for fn in variants.values():
            fn(x)
        times = {k: [] for k in variants}
        mm_gfs = []
        for _ in range(args.rounds):
            for k, fn in variants.items():
                times[k].append(_time(lambda: fn(x), args.reps))
            mm_gfs.append(2 * 512**3 / _time(mm, 3) / 1e9)
        flops = {
            "standard": _flops.ns_flops(d, D, 5, num_matrices=B),
            "gram": ns_gram.gram_ns_flops(d, D, 5, num_matrices=B),
            "gram_r2": ns_gram.gram_ns_flops(d, D, 5, restart_every=[2], num_matrices=B),
        }
        row = {
            "label": label,
            "shape": [B, d, D],
            "flops": flops,
            "mm_gflops": _med(mm_gfs),
            "ms": {k: _med([t * 1e3 for t in v]) for k, v in times.items()},
        }
        for g in ("gram", "gram_r2"):
            for pre in ("", "old_") if old else ("",):
                if pre + g in times:
                    row[f"{pre}{g}_ratio"] = _med([t / s for t, s in zip(times[pre + g], times[pre + "standard"])])
        if old is not None:
            row["old_flops"] = {
                "gram": old.gram_ns_flops(d, D, 5, num_matrices=B),
                "gram_r2": old.gram_ns_flops(d, D, 5, restart_every=[2], num_matrices=B),
            }
        row["gflops"] = {
            k: (
                flops[k.removeprefix("old_")]
                if not k.startswith("old_gram")
                else row["old_flops"][k.removeprefix("old_")]
            )
            / 1e9
            / (row["ms"][k][0] / 1e3)
            for k in times
        }
        rows.append(row)
        print(f"{label} {B}x{d}x{D}: " + ", ".join(f"{k} {v[0]:.1f} ms" for k, v in row["ms"].items()), flush=True)

    print(
        f"\ncpu: {cpu}; theoretical fp32 peak of one core {peak:.1f} GFLOP/s "
        f"({args.flops_per_cycle} FLOP/cycle at the nominal clock); {args.rounds} rounds, "
        f"median [min-max] over rounds; clock: {args.clock}\n"
    )
    print(
        "| size, N | batch | FLOP ratio gram / [2] | goal gram / [2] | time ratio gram | time ratio [2] |"
        + (" before: gram | before: [2] |" if old else "")
    )
    print("|---|---|---|---|---|---|" + ("---|---|" if old else ""))
    for r in rows:
        B, d, D = r["shape"]
        fr = r["flops"]["gram"] / r["flops"]["standard"]
        fr2 = r["flops"]["gram_r2"] / r["flops"]["standard"]
        cell = lambda t: f"{t[0]:.3f} [{t[1]:.3f}-{t[2]:.3f}]"  # noqa: E731
        line = (
            f"| {r['label']} | {B} x {d} x {D} | {fr:.3f} / {fr2:.3f} | {1 - 0.8 * (1 - fr):.3f} / "
            f"{1 - 0.8 * (1 - fr2):.3f} | {cell(r['gram_ratio'])} | {cell(r['gram_r2_ratio'])} |"
        )
        if old:
            line += f" {cell(r['old_gram_ratio'])} | {cell(r['old_gram_r2_ratio'])} |"
        print(line)
    print("\n| size, N | batch | mm GF/s | variant | ms | GF/s | of mm | of peak |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        B, d, D = r["shape"]
        mmg = r["mm_gflops"][0]
        for k, (ms, lo, hi) in r["ms"].items():
            g = r["gflops"][k]
            print(
                f"| {r['label']} | {B} x {d} x {D} | {mmg:.1f} | {k} | {ms:.2f} [{lo:.2f}-{hi:.2f}] | "
                f"{g:.1f} | {g / mmg:.2f} | {g / peak:.2f} |"
            )
    kernels = _kernel_table(shapes, args.rounds) if args.kernels else []
    if args.json:
        args.json.write_text(json.dumps({"cpu": cpu, "peak_gflops": peak, "rows": rows, "kernels": kernels}, indent=1))
    return 0


def _kernel_table(shapes, rounds: int) -> list:
    """The matmul kernels of both iterations alone, interleaved per round (see the module doc)."""
    gen = torch.Generator().manual_seed(1)
    out = []
    print(
        "\n| size, N | batch | dd GF/s | QX GF/s | XXᵀ GF/s | Gram NS XXᵀ GF/s | dd / QX rate | kernel-only gram / standard |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for label, B, d, D in shapes:
        if d > D:
            continue
        X = torch.randn(B, d, D, generator=gen) / D**0.5
        R = torch.randn(B, d, d, generator=gen) / d
        G, W, Y = torch.empty(B, d, d), torch.empty(B, d, d), torch.empty(B, d, D)
        ks = {
            "dd": lambda: torch.baddbmm(R, R, R, beta=0.5, alpha=2.0, out=W),
            "qx": lambda: torch.baddbmm(X, R, X, beta=3.4, out=Y),
            "xx": lambda: torch.bmm(X, X.mT, out=G),
            "sym": lambda: ns_gram._symmetric_gram(X, out=G),
        }
        t = {k: [] for k in ks}
        for _ in range(rounds):
            for k, fn in ks.items():
                t[k].append(_time(fn, 3))
        med = {k: statistics.median(v) for k, v in t.items()}
        fl = {"dd": 2 * B * d**3, "qx": 2 * B * d * d * D, "xx": 2 * B * d * d * D, "sym": B * gram_product_flops(d, D)}
        gfs = {k: fl[k] / med[k] / 1e9 for k in ks}
        std_t = 5 * (med["xx"] + med["dd"] + med["qx"])
        gram_t = 3 * (med["sym"] + med["qx"]) + 11 * med["dd"]
        row = {
            "label": label,
            "shape": [B, d, D],
            "ms": {k: v * 1e3 for k, v in med.items()},
            "gflops": gfs,
            "kernel_ratio": gram_t / std_t,
        }
        out.append(row)
        print(
            f"| {label} | {B} x {d} x {D} | {gfs['dd']:.1f} | {gfs['qx']:.1f} | {gfs['xx']:.1f} | "
            f"{gfs['sym']:.1f} | {gfs['dd'] / gfs['qx']:.2f} | {gram_t / std_t:.3f} |"
        )
    return out


if __name__ == "__main__":
    raise SystemExit(main())
