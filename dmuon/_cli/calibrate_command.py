"""``python -m dmuon calibrate``: the command line of :func:`dmuon.sim._calibrate.calibrate`; prints the
cpu-gloo hardware record it measures and writes it with ``--json``."""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence

from dmuon.sim._calibrate import calibrate
from dmuon.sim._engine.hardware import dump

__all__ = ["main_calibrate"]


def main_calibrate(argv: Sequence[str] | None = None) -> int:
    """``python -m dmuon calibrate [--json F] [--quick]``: print the record; write it with ``--json``."""
    parser = argparse.ArgumentParser(
        prog="python -m dmuon calibrate",
        description="Microbenchmark this machine into a cpu-gloo hardware record "
        "for `python -m dmuon simulate --hw FILE` (under 3 minutes).",
    )
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
    print(
        f"  operator overhead {1e6 * hw.op_overhead_s:.2f} us, elementwise {hw.elementwise_Bps / 1e9:.2f} GB/s, "
        f"hook {1e6 * hw.hook_s:.1f} us, FSDP2 call {1e6 * hw.fsdp2_call_s:.0f} us, DTensor op +{1e6 * hw.dtensor_op_s:.1f} us, "
        f"collective issue {1e6 * hw.issue_s:.0f} us, autograd op {1e6 * hw.autograd_op_s:.1f} us"
    )
    if hw.autograd_matmul_efficiency:
        print(
            "  training matmul (autograd) fraction of peak by d: "
            + ", ".join(f"{d:.0f} {e:.2f}" for d, e in hw.autograd_matmul_efficiency)
        )
    if hw.attention_efficiency:
        print(
            "  attention (SDPA forward + backward) fraction of peak by head d: "
            + ", ".join(f"{d:.0f} {e:.2f}" for d, e in hw.attention_efficiency)
        )
    if hw.ns_efficiency:
        print(
            "  Newton-Schulz call (fp32) fraction of peak by d: "
            + ", ".join(f"{d:.0f} {e:.2f}" for d, e in hw.ns_efficiency)
        )
    if hw.gram_ns_efficiency:
        print(
            "  Gram Newton-Schulz call (fp32) fraction of peak by d: "
            + ", ".join(f"{d:.0f} {e:.2f}" for d, e in hw.gram_ns_efficiency)
        )
    if hw.ns_batch_factor:
        print(
            "  batched Newton-Schulz, per matrix over one call, by (d, batch): "
            + ", ".join(f"{d:.0f}/{b:.0f} x{f:.2f}" for d, b, f in hw.ns_batch_factor)
        )
    print(
        f"  busy node ({hw.cores_per_node} cores computing): matmul-class x{hw.busy_compute_factor:.2f}, "
        f"memory-bound x{hw.busy_memory_factor:.2f}"
    )
    print(
        f"  RMSNorm forward + backward {1e9 * hw.norm_train_s_per_numel:.2f} ns / element, "
        f"GELU forward + backward {1e9 * hw.activation_train_s_per_numel:.2f} ns / element"
    )
    step_factor = dict(hw.step_compute_factor_by_group)
    for (k, f), (_, g), (_, h) in zip(
        hw.fsdp2_call_s_by_group, hw.dtensor_gather_s_by_group, hw.comm_cpu_share_by_group
    ):
        print(
            f"  k={k}: FSDP2 call {1e3 * f:.2f} ms, DTensor gather {1e3 * g:.2f} ms (each beyond its collective), comm CPU share {h:.2f}, "
            f"step compute x{step_factor.get(k, 1.0):.2f}"
        )
    for c in hw.curves:
        if c.kind in ("broadcast", "all_gather"):
            pts = ", ".join(f"{b / 1024:.0f}K {1e3 * s:.2f}" for b, s in zip(c.nbytes, c.seconds))
            print(f"  {c.kind:<10} k={c.group_size}: ms by size {pts}")
    if args.json:
        dump(hw, args.json, raw=raw)
        print(f"wrote {args.json}")
    return 0
