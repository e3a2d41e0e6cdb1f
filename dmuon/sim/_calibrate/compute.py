"""The calibration's one-process measurements (:mod:`dmuon.sim._calibrate`, from "matmul FLOP/s"
to "attention, norm, activation", and the busy node): matmul FLOP/s (:func:`_matmul`), the
training kernels (:func:`_training_kernels`), Newton-Schulz calls and batches
(:func:`_newton_schulz`, :func:`_ns_batch_factor`), the busy node (:func:`_busy_node`) and the
operator / elementwise / hook overheads (:func:`_overheads`); :func:`_median_s` times them."""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Sequence
from typing import Any

from dmuon.sim._engine.hardware import ns_mean_dim

MATMUL_SIZES = (32, 64, 128, 256, 512, 768)


def _median_s(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


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
    for seq, hd in QUICK_ATTENTION_SHAPES if quick else ATTENTION_SHAPES:
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
    return dict(
        attention=sorted(att),
        norm_s_per_numel=per_numel(norm, (1024, 256)),
        activation_s_per_numel=per_numel(F.gelu, (1024, 1024)),
    )


#: (a, b) matrices of the Newton-Schulz calibration (square and 1:4, as transformer blocks have)
NS_SHAPES = ((64, 64), (64, 256), (128, 128), (128, 512), (256, 256), (256, 1024), (512, 512))
QUICK_NS_SHAPES = ((64, 64), (128, 512))


def _newton_schulz(repeats: int, quick: bool, backend: str = "standard") -> list[tuple[float, float]]:
    """One fp32 Newton-Schulz call (5 steps) per shape: ``(d, FLOP/s)`` with ``d = (a²·b)^(1/3)``
    and the FLOPs of :func:`dmuon.plan._cost.flops.matrix_ns_flops`. ``"standard"``:
    ``dmuon._update.newton_schulz`` (the matmuls with their transposed operand, the
    norm, the axpys) per :data:`NS_SHAPES` — a square ``a @ b`` on the same sizes runs 10–25 %
    faster on this CPU, which the plain curve would assume; ``"gram"``: ``gram_newton_schulz``
    (default restarts, fallback check) on the shapes of :data:`NS_SHAPES` where it needs fewer
    FLOPs (the 1:4 ones), which run at a lower rate per FLOP than the standard call here."""
    import torch

    from dmuon._ns_gram import gram_newton_schulz
    from dmuon._update import newton_schulz
    from dmuon.plan._cost.flops import matrix_ns_flops

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

    from dmuon._update import newton_schulz

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
    return dict(
        busy_compute_factor=max(1.0, med["busy_c"] / med["solo_c"]),
        busy_memory_factor=max(1.0, med["busy_m"] / med["solo_m"]),
    )


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
    hooks = [
        lin.register_forward_pre_hook(lambda m, a: None),
        lin.register_forward_hook(lambda m, a, o: None),
        lin.register_full_backward_pre_hook(lambda m, g: None),
        lin.register_full_backward_hook(lambda m, gi, go: None),
    ]
    hooked = _median_s(run, repeats)
    for h in hooks:
        h.remove()
    hook_s = max(0.0, (hooked - plain) / 200 / 2)  # per hook call: forward and backward each run two
    return dict(op_overhead_s=op_s, autograd_op_s=autograd_op_s, elementwise_Bps=elem_Bps, hook_s=hook_s)
