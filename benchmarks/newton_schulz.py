"""Throughput of dmuon's Newton-Schulz by shape, dtype and batching, against attainable matmul.

For every (device, dtype, shape) the script times

- ``single``:  ``newton_schulz(x)`` on one (m, n) matrix;
- ``batched``: ``newton_schulz(x)`` on a (B, m, n) batch (one bmm/baddbmm chain);
- ``loop``:    B separate 2-D calls on the same batch (what batching replaces);

and, in the same run, a plain matmul chain of about the same FLOPs: ``X @ X.mT`` with X of
shape (d, D) (``bmm`` for batches), d = min(m, n), D = max(m, n) — NS's Gram product in NS's
own operand layout, so its GFLOP/s is what this device attains on the shapes NS multiplies. Reported per row:

- ``ms med`` / ``ms min``: median and fastest wall time of one call (CUDA: synchronised);
- ``GFLOP``:     :func:`dmuon.plan._cost.flops.ns_flops` of the call (matmul FLOPs only);
- ``NS GF/s``:   GFLOP / fastest seconds (best observed: robust to a shared, noisy machine);
- ``mm GF/s``:   the plain matmul chain's GFLOP/s, also from its fastest run;
- ``eff``:       NS GF/s / mm GF/s (below 1: elementwise work, the norm, small-matrix
                 overheads, and NS's other two products, (d, d)·(d, d) and (d, d)·(d, D),
                 whose kernels/layouts can be slower or faster than the Gram product's).

Usage::

    python benchmarks/newton_schulz.py                      # CPU (+ CUDA if present), ~30-60 s on 2 cores
    python benchmarks/newton_schulz.py --device cuda --json ns.json
    python benchmarks/newton_schulz.py --shapes 1024x4096,4096x4096 --batch 8 --dtypes bf16

On a CPU shared with other jobs, OpenMP barriers make multi-threaded timings meaningless
(a 64x64 NS measured 360 ms with 2 threads on a loaded 2-core box, 0.4 ms with 1): pass
``--threads 1`` there.

Defaults are sized per device: small shapes on CPU (bf16 matmul on CPUs without native bf16
units runs at a few GFLOP/s), transformer-sized ones on CUDA.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dmuon._update import newton_schulz  # noqa: E402
from dmuon.plan._cost.flops import ns_flops  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DEFAULT_SHAPES = {
    "cpu": [(128, 128), (128, 512), (512, 128), (256, 256)],
    "cuda": [(1024, 1024), (1024, 4096), (4096, 1024), (4096, 4096), (8192, 8192)],
}
DEFAULT_BATCHED = {
    "cpu": [(8, 64, 256), (4, 128, 128)],
    "cuda": [(16, 1024, 1024), (8, 1024, 4096), (64, 512, 512)],
}


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def measure(fn: Callable[[], object], device: str, min_time: float, min_reps: int = 3) -> tuple[float, float]:
    """(median, min) seconds of ``fn()`` after one warm-up call; repeats until ``min_time`` total."""
    fn()
    _sync(device)
    times: list[float] = []
    total = 0.0
    while len(times) < min_reps or total < min_time:
        start = time.perf_counter()
        fn()
        _sync(device)
        elapsed = time.perf_counter() - start
        times.append(elapsed)
        total += elapsed
        if len(times) >= 10_000:
            break
    return statistics.median(times), min(times)


def attainable_matmul(b: int, d: int, D: int, flops: int, dtype, device: str, min_time: float) -> float:
    """GFLOP/s of NS's Gram product ``X @ X.mT``, X of shape (d, D) (or (b, d, D)), repeated
    to about ``flops``; same operand layout and allocation behaviour as inside NS."""
    x = torch.randn((b, d, D) if b > 1 else (d, D), dtype=dtype, device=device)
    one = 2 * b * d * d * D
    reps = max(1, round(flops / one))

    def chain():
        for _ in range(reps):
            x @ x.mT

    _, fastest = measure(chain, device, min_time)
    return reps * one / fastest / 1e9


def bench_row(mode: str, b: int, m: int, n: int, dtype_name: str, device: str, steps: int, min_time: float) -> dict:
    dtype = DTYPES[dtype_name]
    g = torch.Generator(device=device).manual_seed(0)
    shape = (b, m, n) if mode != "single" else (m, n)
    x = torch.randn(shape, generator=g, device=device, dtype=torch.float32)
    if mode == "loop":

        def fn():
            for i in range(b):
                newton_schulz(x[i], steps=steps, dtype=dtype)
    else:

        def fn():
            newton_schulz(x, steps=steps, dtype=dtype)

    flops = ns_flops(m, n, steps, num_matrices=b)
    median, fastest = measure(fn, device, min_time)
    mm_gflops = attainable_matmul(
        b if mode == "batched" else 1,
        min(m, n),
        max(m, n),
        flops if mode == "batched" else flops // b,
        dtype,
        device,
        min_time,
    )
    ns_gflops = flops / fastest / 1e9
    return {
        "device": device,
        "dtype": dtype_name,
        "mode": mode,
        "batch": b,
        "m": m,
        "n": n,
        "steps": steps,
        "ms_median": median * 1e3,
        "ms_min": fastest * 1e3,
        "gflop": flops / 1e9,
        "ns_gflops_per_s": ns_gflops,
        "matmul_gflops_per_s": mm_gflops,
        "efficiency": ns_gflops / mm_gflops if mm_gflops > 0 else math.nan,
    }


def _parse_shapes(text: str) -> list[tuple[int, int]]:
    shapes = []
    for item in text.split(","):
        m, n = item.lower().split("x")
        shapes.append((int(m), int(n)))
    return shapes


def print_table(rows: list[dict]) -> None:
    header = f"{'device':6} {'dtype':5} {'mode':7} {'B':>3} {'m x n':>11} {'ms med':>10} {'ms min':>10} {'GFLOP':>8} {'NS GF/s':>9} {'mm GF/s':>9} {'eff':>6}"
    print(header)
    print("-" * len(header))
    for r in rows:
        print(
            f"{r['device']:6} {r['dtype']:5} {r['mode']:7} {r['batch']:>3} {str(r['m']) + 'x' + str(r['n']):>11} "
            f"{r['ms_median']:>10.3f} {r['ms_min']:>10.3f} {r['gflop']:>8.3f} {r['ns_gflops_per_s']:>9.1f} "
            f"{r['matmul_gflops_per_s']:>9.1f} {r['efficiency']:>6.2f}"
        )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--device", choices=["auto", "cpu", "cuda"], default="auto", help="auto: cpu, plus cuda when available"
    )
    parser.add_argument("--dtypes", default="fp32,bf16", help=f"comma list of {sorted(DTYPES)}")
    parser.add_argument("--shapes", default=None, help="single-matrix shapes, e.g. 256x1024,512x512")
    parser.add_argument(
        "--batch",
        type=int,
        default=None,
        help="batch size for batched/loop rows (uses --shapes, or the defaults' shapes)",
    )
    parser.add_argument("--no-batched", action="store_true", help="skip batched and loop rows")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument(
        "--min-time", type=float, default=None, help="seconds per measurement (default 0.2 on CPU, 0.5 on CUDA)"
    )
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    parser.add_argument("--json", type=Path, default=None, help="also write rows and metadata here")
    args = parser.parse_args(argv)

    if args.threads:
        torch.set_num_threads(args.threads)
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else []) if args.device == "auto" else [args.device]
    if "cuda" in devices and not torch.cuda.is_available():
        parser.error("--device cuda but CUDA is not available")
    dtype_names = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    for d in dtype_names:
        if d not in DTYPES:
            parser.error(f"unknown dtype {d!r}; choose from {sorted(DTYPES)}")

    rows: list[dict] = []
    started = time.perf_counter()
    for device in devices:
        min_time = args.min_time if args.min_time is not None else (0.5 if device == "cuda" else 0.2)
        singles = _parse_shapes(args.shapes) if args.shapes else DEFAULT_SHAPES[device]
        if args.batch is not None:
            batched = [
                (args.batch, m, n) for m, n in (singles if args.shapes else [s[1:] for s in DEFAULT_BATCHED[device]])
            ]
        else:
            batched = DEFAULT_BATCHED[device]
        for dtype_name in dtype_names:
            for m, n in singles:
                rows.append(bench_row("single", 1, m, n, dtype_name, device, args.steps, min_time))
                print_progress(rows[-1])
            if args.no_batched:
                continue
            for b, m, n in batched:
                for mode in ("batched", "loop"):
                    rows.append(bench_row(mode, b, m, n, dtype_name, device, args.steps, min_time))
                    print_progress(rows[-1])
    elapsed = time.perf_counter() - started

    print()
    print_table(rows)
    print(
        f"\n{len(rows)} rows in {elapsed:.1f} s; torch {torch.__version__}, "
        f"{torch.get_num_threads()} CPU threads, ns_steps={args.steps}"
    )
    if args.json:
        meta = {
            "torch": torch.__version__,
            "python": platform.python_version(),
            "machine": platform.machine(),
            "processor": platform.processor(),
            "cpu_threads": torch.get_num_threads(),
            "cuda_device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
            "steps": args.steps,
            "elapsed_s": elapsed,
            "flop_model": "ns_flops: steps*(4*d*d*D + 2*d**3) per matrix, d=min(m,n), D=max(m,n)",
        }
        args.json.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
        print(f"wrote {args.json}")
    return 0


def print_progress(row: dict) -> None:
    print(
        f"  {row['device']} {row['dtype']} {row['mode']:7} B={row['batch']} {row['m']}x{row['n']}: "
        f"{row['ms_median']:.3f} ms, {row['ns_gflops_per_s']:.1f} GF/s",
        file=sys.stderr,
        flush=True,
    )


if __name__ == "__main__":
    raise SystemExit(main())
