"""What the Muon variants of docs/muon_variants.md cost on the owner, measured in one sitting.

1. Per-head orthogonalisation: ``dmuon.Muon.step`` on one ``(H·d_h, D)`` matrix, whole vs
   as ``H`` row blocks (``MatrixView``), fp32 NS (the batched path); the FLOP ratio of the two
   (:func:`dmuon.plan._cost.flops.ns_flops`) next to the measured time ratio.
2. QK-clip's SDPA helper: :func:`dmuon.exec._optim.qk_clip.max_logits_sdpa` (the extra ``QKᵀ`` pass)
   vs the ``scaled_dot_product_attention`` forward it accompanies, causal.

Variants are interleaved (A, B, A, B, ...) ``--repeats`` times; the table gives the median and
the interquartile range of each, and the median of the per-pair ratios. Usage::

    python benchmarks/muon_variants.py                    # CPU, 1 thread, ~20 s
    python benchmarks/muon_variants.py --device cuda --heads 32 --head-dim 128 --d-model 4096
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import dmuon  # noqa: E402
from dmuon import _tags  # noqa: E402
from dmuon.exec._runtime.packed_buffers import DedicatedInfo  # noqa: E402
from dmuon.exec._optim.qk_clip import max_logits_sdpa  # noqa: E402
from dmuon.plan._cost.flops import ns_flops  # noqa: E402
from dmuon.plan._records.params import MatrixView  # noqa: E402


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time(fn, device) -> float:
    _sync(device)
    t = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t


def _quartiles(v):
    q = statistics.quantiles(v, n=4) if len(v) > 1 else [v[0]] * 3
    return q[1], q[2] - q[0]


def _interleaved(fa, fb, repeats, device):
    fa(), fb()  # warm-up
    a, b = [], []
    for _ in range(repeats):
        a.append(_time(fa, device))
        b.append(_time(fb, device))
    return a, b


def _muon_step(shape, view, device):
    w = torch.nn.Parameter(torch.randn(shape, device=device))
    _tags.write(
        w,
        _tags.PARAM,
        DedicatedInfo(
            fqn="w",
            owner_global_rank=0,
            is_owner=True,
            holds_full=True,
            shape=shape,
            matrix_shape=shape,
            num_matrices=1,
            runtime=lambda: None,
            view=view,
        ),
    )
    opt = dmuon.Muon([w], ns_dtype=torch.float32)
    g = torch.randn(shape, device=device)

    def step():
        w.grad = g
        opt.step()

    return step


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--repeats", type=int, default=15)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    H, d, D = args.heads, args.head_dim, args.d_model
    shape = (H * d, D)
    whole = _muon_step(shape, None, device)
    heads = _muon_step(shape, MatrixView(dim=0, sizes=(d,) * H, label="heads"), device)
    a, b = _interleaved(whole, heads, args.repeats, device)
    ratio = statistics.median(x / y for x, y in zip(a, b))
    flop_ratio = ns_flops(*shape) / (H * ns_flops(d, D))
    print(f"device {device}, {args.threads} thread(s), {args.repeats} interleaved repeats; median [IQR] ms")
    print(f"\n1. dmuon.Muon step of one {shape} fp32 matrix")
    for name, v in (("whole matrix", a), (f"{H} heads of ({d}, {D})", b)):
        med, iqr = _quartiles([x * 1e3 for x in v])
        print(f"   {name:<26}{med:>10.2f} [{iqr:.2f}]")
    print(f"   time ratio whole/heads {ratio:.2f}x; NS FLOP ratio {flop_ratio:.2f}x")

    B, T = args.batch, args.seq
    g = torch.Generator(device="cpu").manual_seed(0)
    q, k, v = (torch.randn(B, H, T, d, generator=g).to(device) for _ in range(3))
    a, b = _interleaved(
        lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
        lambda: max_logits_sdpa(q, k, is_causal=True),
        args.repeats,
        device,
    )
    ratio = statistics.median(y / x for x, y in zip(a, b))
    print(f"\n2. attention (B={B}, H={H}, T={T}, d_h={d}), causal")
    for name, vals in (("SDPA forward", a), ("max_logits_sdpa (extra)", b)):
        med, iqr = _quartiles([x * 1e3 for x in vals])
        print(f"   {name:<26}{med:>10.2f} [{iqr:.2f}]")
    print(f"   extra pass / SDPA forward: {ratio:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
