"""torch.profiler over dmuon training steps: where one step's time goes.

    python benchmarks/profile_step.py                       # dmuon Z3, N=2, small, CPU/gloo
    python benchmarks/profile_step.py --variant adamw       # the FSDP2 + AdamW floor, same set-up
    python benchmarks/profile_step.py --nproc 4 --size large --variant dmuon_z2 --steps 2

Set-up and model: exactly those of ``benchmarks/step_time.py`` (same sizes, variants, seed,
batches, one thread per rank). Each rank warms up (``--warmup`` steps), then profiles
``--steps`` steps (CPU activities; CUDA too with ``--device cuda``). Before the model is built,
the script wraps dmuon's runtime entry points, the collectives module and Newton-Schulz in
``torch.profiler.record_function`` ranges (dmuon itself has none; nothing in dmuon is edited —
the wrappers live in this process only):

    dmuon.hook.pre_forward / post_forward / pre_backward / post_backward   boundary hooks
    dmuon.unshard            pack + broadcast one boundary (inside pre_forward / pre_backward)
    dmuon.launch_reduce      pack the gradients of one boundary and start its reduce
    dmuon.finish_reduces     end of backward: wait for every reduce, write owners' .grad
    dmuon.coll.broadcast / dmuon.coll.reduce / dmuon.coll.wait   every dmuon collective call
    dmuon.newton_schulz      every Newton-Schulz call (the optimizer's)
    step.forward / step.backward / step.optimizer                 the three phases of a step

Printed (rank 0's view, and per rank for the ranges): each rank's step wall time and its main
thread's CPU time in forward + backward (``time.thread_time``: not the time it waited for a core
on a shared machine), the top ops by self CPU time, then the
inclusive CPU time of every range above, per rank, averaged per profiled step. Times are
CPU wall time of the calling thread: a ``dmuon.coll.wait`` range is time spent waiting for
peers (and for gloo's own threads to move the bytes), not CPU work.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parent))
import step_time as ST  # noqa: E402  (benchmarks/step_time.py)

RANGES = (
    "step.forward",
    "step.backward",
    "step.optimizer",
    "dmuon.hook.pre_forward",
    "dmuon.hook.post_forward",
    "dmuon.hook.pre_backward",
    "dmuon.hook.post_backward",
    "dmuon.unshard",
    "dmuon.launch_reduce",
    "dmuon.finish_reduces",
    "dmuon.coll.broadcast",
    "dmuon.coll.reduce",
    "dmuon.coll.wait",
    "dmuon.newton_schulz",
)


def _ranged(name, fn):
    from torch.profiler import record_function

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with record_function(name):
            return fn(*args, **kwargs)

    wrapper._profile_wrapped = True  # type: ignore[attr-defined]
    return wrapper


def install_ranges() -> None:
    """Wrap dmuon's hooks, collectives and NS in record_function ranges (this process only).

    Must run before ``dedicate_params``: the forward hooks are bound methods looked up when
    they are registered.
    """
    from dmuon.exec._comm import collective_calls as C
    from dmuon.exec._optim import ns_backends as NS
    from dmuon.exec._runtime._boundary import grad_reduce as G
    from dmuon.exec._runtime._boundary.hook_boundary import HookBoundary as B

    targets = [
        (B, "pre_forward", "dmuon.hook.pre_forward"),
        (B, "post_forward", "dmuon.hook.post_forward"),
        (B, "_on_pre_backward", "dmuon.hook.pre_backward"),
        (B, "_on_post_backward", "dmuon.hook.post_backward"),
        (B, "_unshard", "dmuon.unshard"),
        (B, "_launch_reduce", "dmuon.launch_reduce"),
        (G, "finish_reduces", "dmuon.finish_reduces"),
        (C, "broadcast", "dmuon.coll.broadcast"),
        (C, "reduce_sum", "dmuon.coll.reduce"),
        (C, "wait_all", "dmuon.coll.wait"),
        (NS, "newton_schulz", "dmuon.newton_schulz"),
    ]
    for owner, attr, name in targets:
        fn = getattr(owner, attr)
        if not getattr(fn, "_profile_wrapped", False):
            setattr(owner, attr, _ranged(name, fn))


def _profiled_steps(v, batches, device, steps: int):
    from torch.profiler import ProfilerActivity, profile, record_function

    import torch.distributed as dist

    from dmuon._train.byte_gpt import lm_loss

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    dist.barrier()
    cpu_s = 0.0  # this thread's CPU time in forward + backward (not the time it waited for a core)
    with profile(activities=acts) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            x, y = batches[v.steps_done % len(batches)]
            v.steps_done += 1
            c0 = time.thread_time()
            with record_function("step.forward"):
                loss = lm_loss(v.model(x), y)
            with record_function("step.backward"):
                loss.backward()
            cpu_s += time.thread_time() - c0
            with record_function("step.optimizer"):
                v.opt.step()
                v.opt.zero_grad(set_to_none=True)
            ST._sync(device)
        wall = (time.perf_counter() - t0) / steps
    return prof, wall, cpu_s / steps


def _body(mesh, device, job):
    """Every rank: build, warm up, profile; rank 0 returns every rank's summary."""
    import torch.distributed as dist

    install_ranges()
    rank, world = dist.get_rank(), dist.get_world_size()
    batches = ST.make_batches(job["size"], rank, world, device)
    v = ST.build_variant(job["variant"], job["size"], mesh, device, job)
    for _ in range(job["warmup"]):
        ST.run_step(v, batches, device, timed=False)
    prof, wall, cpu = _profiled_steps(v, batches, device, job["steps"])
    steps = job["steps"]
    rows = []
    for e in prof.key_averages():
        rows.append(
            dict(
                name=e.key,
                calls=e.count / steps,
                self_ms=e.self_cpu_time_total / 1e3 / steps,
                total_ms=e.cpu_time_total / 1e3 / steps,
                device_ms=getattr(e, "self_device_time_total", 0) / 1e3 / steps,
            )
        )
    mine = dict(rank=rank, wall_ms=wall * 1e3, cpu_ms=cpu * 1e3, rows=rows)
    everyone: list = [None] * world
    dist.all_gather_object(everyone, mine)
    return everyone if rank == 0 else None


def format_report(per_rank: list[dict], job: dict, top: int) -> str:
    lines = []
    r0 = per_rank[0]
    busy = sum(r["self_ms"] for r in r0["rows"])
    lines.append(
        f"profile: variant {job['variant']}, size {job['size']}, N={len(per_rank)}, "
        f"{job['steps']} profiled step(s) after {job['warmup']} warm-up; per-step averages"
    )
    lines.append(
        "step wall ms per rank: "
        + ", ".join(f"r{r['rank']} {r['wall_ms']:.1f}" for r in per_rank)
        + f"; rank 0 self-CPU total {busy:.1f} ms"
    )
    lines.append(
        "forward + backward main-thread CPU ms per rank: "
        + ", ".join(f"r{r['rank']} {r['cpu_ms']:.1f}" for r in per_rank)
    )
    lines.append("")
    lines.append(f"top {top} ops by self CPU time, rank 0 (ms per step)")
    hdr = f"{'op':<44}{'calls':>7}{'self ms':>9}{'self %':>8}{'total ms':>10}"
    lines += [hdr, "-" * len(hdr)]
    for r in sorted(r0["rows"], key=lambda r: -r["self_ms"])[:top]:
        name = r["name"] if len(r["name"]) <= 43 else r["name"][:40] + "..."
        lines.append(
            f"{name:<44}{r['calls']:>7.0f}{r['self_ms']:>9.2f}"
            f"{100 * r['self_ms'] / max(busy, 1e-9):>7.1f}%{r['total_ms']:>10.2f}"
        )
    lines.append("")
    lines.append("ranges (inclusive CPU ms per step, per rank; calls per step)")
    hdr = f"{'range':<28}{'calls':>7}" + "".join(f"{'r' + str(r['rank']) + ' ms':>10}" for r in per_rank)
    lines += [hdr, "-" * len(hdr)]
    for name in RANGES:
        found = [next((x for x in r["rows"] if x["name"] == name), None) for r in per_rank]
        if all(f is None for f in found):
            continue
        calls = max(f["calls"] for f in found if f is not None)
        cells = "".join(f"{(f['total_ms'] if f else 0.0):>10.2f}" for f in found)
        lines.append(f"{name:<28}{calls:>7.0f}{cells}")
    comm = [
        (x["name"], x) for x in r0["rows"] if x["name"].startswith(("gloo:", "nccl:", "c10d::", "record_param_comms"))
    ]
    if comm:
        lines.append("")
        lines.append("collective ops seen by the profiler, rank 0 (all process groups: FSDP2's and dmuon's)")
        for name, x in sorted(comm, key=lambda t: -t[1]["total_ms"])[:12]:
            lines.append(f"  {name:<42}{x['calls']:>7.0f} calls{x['total_ms']:>10.2f} ms")
    return "\n".join(lines)


def main(argv=None) -> str:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--size", choices=sorted(ST.SIZES), default="small")
    p.add_argument("--variant", choices=ST.VARIANTS + ("plain", "dmuon_hooks_z3"), default="dmuon_z3")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=1, help="profiled steps (averaged)")
    p.add_argument("--top", type=int, default=20)
    p.add_argument("--cost-model", choices=("numel", "ns_flops"), default="numel")
    p.add_argument("--ns-dtype", choices=("auto", "bf16", "fp32"), default="auto")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--timeout", type=float, default=900.0)
    args = p.parse_args(argv)
    job = dict(
        size=args.size,
        variant=args.variant,
        warmup=args.warmup,
        steps=max(1, args.steps),
        cost_model=args.cost_model,
        ns_dtype=args.ns_dtype,
        device=args.device,
        threads=args.threads,
        body=_body,
    )
    per_rank = ST.launch(args.nproc, job, args.timeout)
    info = ST.machine_info(args.device)
    report = (
        f"machine: {info['nproc']} CPUs, {info['cpu_model']}, torch {info['torch']}, "
        f"{args.device}, {args.threads} thread(s)/rank\n" + format_report(per_rank, job, args.top)
    )
    print(report)
    return report


if __name__ == "__main__":
    main()
