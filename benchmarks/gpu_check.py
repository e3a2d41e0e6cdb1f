"""Single-GPU check of dmuon's CUDA paths: Newton-Schulz throughput and a 1-rank training run.

NOT YET RUN ON A GPU: it was written and its ``--device cpu`` fallback tested on a CPU-only
machine (tests/test_benchmarks.py). One process, no NCCL: a 1-rank gloo group over a
``HashStore``. A collective over one rank is the identity; when gloo cannot run dmuon's
reduce / broadcast on CUDA tensors (probed at start-up), ``--collectives auto`` replaces the two
calls, as dmuon's collective module sees them, by identities that return a finished ``Work``
(``--collectives identity`` forces that, ``gloo`` forbids it). Everything else dmuon does on
CUDA runs as in a multi-GPU job: its broadcast and reduce streams, the events that order them
with the compute stream, the reused reduce buffers (same tensors every step, storage released between backwards).

Parts (all by default; ``--parts ns`` / ``--parts train`` / ``--parts offload`` for one):

``ns``
    :func:`~dmuon._update.newton_schulz` on one matrix, the same on a batch of ``B``
    matrices (one ``bmm``/``baddbmm`` chain), and
    :func:`~dmuon._ns_gram.gram_newton_schulz` on one matrix, by shape and dtype.
    ``TFLOP/s`` = matmul FLOPs of the call (``ns_flops`` / ``gram_ns_flops``) / fastest time;
    ``peak`` = a square ``(P, P) @ (P, P)`` matmul of the same dtype measured in the same run
    (``P`` = 8192 on CUDA, 256 on CPU); ``of peak`` = their ratio.
``train``
    The main job's GPT (``dmuon/_train/byte_gpt.py``, the ``small`` size of
    ``benchmarks/step_time.py`` unless ``--quick``) for ``--steps`` steps on the same batches:

    * ``dmuon_streams``: ``dmuon.dedicate_params`` + ``dmuon.Muon`` on the device, dmuon's CUDA
      streams on (``runtime.set_use_streams(True)``, the default);
    * ``dmuon_no_streams`` (CUDA only): the same with every dmuon kernel and collective on the
      compute stream;
    * ``torch_ref``: ``torch.optim.Muon`` on the same matrices + ``torch.optim.AdamW`` on the
      rest, plain model, same device;
    * ``dmuon_cpu`` (CUDA only): ``dmuon_streams``'s set-up on the CPU;
    * ``dmuon_normuon`` / ``normuon_ref``: ``dmuon.Muon(variant="normuon")`` against
      :class:`dmuon.testing.ReferenceOptimizer` with the same variant, same device;
    * ``dmuon_deepseek_v4`` / ``deepseek_v4_ref``: the fixed 10-step ``"deepseek_v4"``
      Newton-Schulz preset, likewise.

    Newton-Schulz in bf16 everywhere (``torch.optim.Muon`` always iterates in bf16). Checks:
    streams vs no streams within ``--stream-rtol`` (the same kernels in the same order: they
    should agree to the last bit); every other run vs ``dmuon_streams`` within ``--loss-rtol``
    (bf16 Newton-Schulz batched by dmuon, per matrix by torch; CPU vs GPU kernels), and each
    ``dmuon_<variant>`` vs its ``<variant>_ref`` within ``--loss-rtol``; on CUDA,
    that the stream path really ran (streams built, reduce buffers the same tensors at the last
    step as after the first), and that the presence flags were read once per backward.
``offload``
    The same GPT with ``dmuon.dedicate_params(offload_policy=CPUOffloadPolicy(pin_memory=True on
    CUDA))`` against the same set-up without offload, both with ``ns_batching="exact"`` (every
    matrix its own run, so the step has many host-device copies to overlap). Checks: losses equal
    within ``--stream-rtol`` (the same kernels on copies); held masters on the host, pinned on CUDA,
    never the broadcast buffer; on CUDA, the double buffering hides copies: with ``t_plain`` and
    ``t_offload`` the median ``opt.step()`` times and ``t_copy`` the time of the step's copies run
    alone, one after the other (each owned master, momentum and gradient to the device, each
    master and momentum back), ``overlap = (t_plain + t_copy - t_offload) / t_copy`` (1: every copy
    hidden behind compute, 0: none) must be ``> 0`` (``--min-overlap``).

Exit status: 0 every check passed; 1 a check failed (the table says which); 2 bad arguments.
Budget: about 1-2 minutes on one recent GPU with the defaults (it prints its wall time and
warns past 180 s); ``--quick`` shrinks everything (the CPU test uses it).

Usage::

    python benchmarks/gpu_check.py                        # cuda: ns + train
    python benchmarks/gpu_check.py --json gpu.json
    python benchmarks/gpu_check.py --device cpu --quick   # the CPU fallback, a few seconds
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
import types
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
for _p in (REPO, REPO / "benchmarks"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

from newton_schulz import DTYPES, measure  # noqa: E402  (benchmarks/newton_schulz.py)

BUDGET_S = 180.0
PEAK_SIDE = {"cuda": 8192, "cpu": 256}
NS_SHAPES = {
    "cuda": [(1024, 1024), (1024, 4096), (4096, 1024), (4096, 4096)],
    "cpu": [(64, 64), (64, 256)],
}
NS_BATCH = {"cuda": 16, "cpu": 4}
TRAIN_SIZES = {
    # the ``small`` size of benchmarks/step_time.py
    "small": dict(n_layers=4, d_model=128, d_mlp=512, n_heads=4, seq_len=64, batch=16),
    "quick": dict(n_layers=2, d_model=32, d_mlp=64, n_heads=2, seq_len=16, batch=4),
    # the offload part on CUDA: matrices large enough that Newton-Schulz takes a fair share of
    # the time their copies take (the share grows with the short side)
    "offload": dict(n_layers=4, d_model=2048, d_mlp=8192, n_heads=16, seq_len=128, batch=4),
}
MUON_HP = dict(
    lr=1e-3,
    weight_decay=0.1,
    momentum=0.95,
    nesterov=True,
    ns_coefficients=(3.4445, -4.775, 2.0315),
    eps=1e-7,
    ns_steps=5,
    adjust_lr_fn=None,
)
ADAMW_HP = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2)
VOCAB = 256
SEED = 0


# ----------------------------------------------------------------------------------------------
# arguments
# ----------------------------------------------------------------------------------------------


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--device",
        choices=["cuda", "cpu"],
        default="cuda",
        help="cuda (the point of the script) or cpu (the fallback the tests run)",
    )
    p.add_argument("--parts", nargs="+", choices=["ns", "train", "offload"], default=["ns", "train", "offload"])
    p.add_argument("--min-overlap", type=float, default=0.0, help="offload: least share of the copies hidden (CUDA)")
    p.add_argument("--quick", action="store_true", help="tiny shapes, a tiny GPT, 2 training steps, short timings")
    p.add_argument("--dtypes", default="bf16,fp32", help=f"NS dtypes, comma list of {sorted(DTYPES)}")
    p.add_argument("--shapes", default=None, help="NS shapes, e.g. 1024x4096,4096x4096 (default per device)")
    p.add_argument("--batch", type=int, default=None, help="matrices per batched NS call (default per device)")
    p.add_argument("--ns-steps", type=int, default=5)
    p.add_argument("--min-time", type=float, default=None, help="seconds per NS measurement")
    p.add_argument("--steps", type=int, default=None, help="training steps (default 4, --quick 2)")
    p.add_argument(
        "--loss-rtol", type=float, default=2e-3, help="relative loss tolerance vs dmuon_streams (bf16 Newton-Schulz)"
    )
    p.add_argument(
        "--stream-rtol",
        type=float,
        default=1e-5,
        help="relative loss tolerance, streams vs no streams on the same device",
    )
    p.add_argument(
        "--collectives",
        choices=["auto", "gloo", "identity"],
        default="auto",
        help="1-rank collectives: auto = gloo on CPU; on CUDA gloo if it can, else identities",
    )
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default 1 on cpu)")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    for d in (x.strip() for x in args.dtypes.split(",") if x.strip()):
        if d not in DTYPES:
            p.error(f"unknown dtype {d!r}; choose from {sorted(DTYPES)}")
    if args.shapes:
        try:
            args.shapes = [tuple(int(v) for v in s.lower().split("x")) for s in args.shapes.split(",")]
        except ValueError:
            p.error(f"--shapes: expected MxN[,MxN...], got {args.shapes!r}")
        if any(len(s) != 2 or min(s) <= 0 for s in args.shapes):
            p.error(f"--shapes: expected positive MxN pairs, got {args.shapes!r}")
    if args.steps is None:
        args.steps = 2 if args.quick else 4
    if args.steps < 1:
        p.error("--steps must be >= 1")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda but CUDA is not available (use --device cpu for the fallback)")
    return args


# ----------------------------------------------------------------------------------------------
# (a) Newton-Schulz throughput
# ----------------------------------------------------------------------------------------------


def matmul_peak_tflops(dtype: torch.dtype, device: str, side: int, min_time: float) -> float:
    """TFLOP/s of a square ``(side, side) @ (side, side)`` matmul in ``dtype`` (fastest run)."""
    a = torch.randn(side, side, device=device).to(dtype)
    b = torch.randn(side, side, device=device).to(dtype)
    _, fastest = measure(lambda: a @ b, device, min_time)
    return 2 * side**3 / fastest / 1e12


def ns_rows(device: str, dtype_names, shapes, batch: int, steps: int, min_time: float, peak_side: int) -> list[dict]:
    from dmuon._ns_gram import gram_newton_schulz, gram_ns_flops
    from dmuon._update import newton_schulz
    from dmuon.plan._cost.flops import ns_flops

    rows = []
    for dname in dtype_names:
        dtype = DTYPES[dname]
        peak = matmul_peak_tflops(dtype, device, peak_side, min_time)
        g = torch.Generator(device=device).manual_seed(0)
        for m, n in shapes:
            x = torch.randn((m, n), generator=g, device=device)
            xb = torch.randn((batch, m, n), generator=g, device=device)
            cases = [
                ("newton_schulz", 1, lambda: newton_schulz(x, steps=steps, dtype=dtype), ns_flops(m, n, steps)),
                (
                    "batched",
                    batch,
                    lambda: newton_schulz(xb, steps=steps, dtype=dtype),
                    ns_flops(m, n, steps, num_matrices=batch),
                ),
                (
                    "gram_newton_schulz",
                    1,
                    lambda: gram_newton_schulz(x, steps=steps, dtype=dtype),
                    gram_ns_flops(m, n, steps),
                ),
            ]
            for kind, b, fn, flops in cases:
                median, fastest = measure(fn, device, min_time)
                tflops = flops / fastest / 1e12
                rows.append(
                    dict(
                        device=device,
                        dtype=dname,
                        kind=kind,
                        batch=b,
                        m=m,
                        n=n,
                        steps=steps,
                        ms_median=median * 1e3,
                        ms_min=fastest * 1e3,
                        gflop=flops / 1e9,
                        tflops=tflops,
                        peak_tflops=peak,
                        of_peak=tflops / peak if peak > 0 else math.nan,
                    )
                )
    return rows


def print_ns(rows: list[dict]) -> None:
    head = (
        f"{'dtype':5} {'kind':18} {'B':>3} {'m x n':>11} {'ms med':>9} {'ms min':>9} {'GFLOP':>9} "
        f"{'TFLOP/s':>8} {'peak':>8} {'of peak':>7}"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        shape = f"{r['m']}x{r['n']}"
        print(
            f"{r['dtype']:5} {r['kind']:18} {r['batch']:>3} {shape:>11} {r['ms_median']:>9.3f} "
            f"{r['ms_min']:>9.3f} {r['gflop']:>9.3f} {r['tflops']:>8.4g} {r['peak_tflops']:>8.4g} "
            f"{r['of_peak']:>7.2f}"
        )


# ----------------------------------------------------------------------------------------------
# (b) 1-rank training
# ----------------------------------------------------------------------------------------------


class _Done:
    """A finished ``Work`` (what a collective over one rank amounts to)."""

    def wait(self, timeout=None):
        return True

    def is_completed(self):
        return True


class _OneRankCollectives(types.SimpleNamespace):
    """``torch.distributed`` as :mod:`dmuon.exec._comm.collective_calls` sees it, with ``broadcast`` and
    ``reduce`` replaced by identities: exact on a 1-rank group, whatever the backend supports."""

    def __getattr__(self, name):
        return getattr(torch.distributed, name)

    @staticmethod
    def broadcast(tensor, src, group=None, async_op=False):
        _check_one_rank(group)
        return _Done() if async_op else None

    @staticmethod
    def reduce(tensor, dst, op=None, group=None, async_op=False):
        _check_one_rank(group)
        return _Done() if async_op else None


def _check_one_rank(group) -> None:
    if torch.distributed.get_world_size(group) != 1:
        raise RuntimeError("gpu_check: identity collectives are only valid on a 1-rank group")


def init_one_rank_group(device: str, collectives: str) -> str:
    """A 1-rank gloo default group (no NCCL, no network); returns how collectives run."""
    import torch.distributed as dist

    from dmuon.exec._comm import collective_calls as C

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    if collectives == "gloo" or (collectives == "auto" and device != "cuda"):
        return "gloo"
    if collectives == "auto":
        try:
            t = torch.ones(4, device=device)
            dist.broadcast(t, src=0, async_op=True).wait()
            dist.reduce(t, dst=0, async_op=True).wait()
            torch.cuda.synchronize()
            if t.tolist() == [1.0] * 4:
                return "gloo"
        except (RuntimeError, ValueError, NotImplementedError):
            pass
    C.dist = _OneRankCollectives()
    return "identity"


def make_batches(spec: dict, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(SEED + 1)
    out = []
    for _ in range(steps):
        tok = torch.randint(0, VOCAB, (spec["batch"], spec["seq_len"] + 1), generator=g)
        out.append((tok[:, :-1], tok[:, 1:]))
    return out


def _gpt(spec: dict, device: str):
    from dmuon._train.byte_gpt import GPT, GPTConfig

    cfg = GPTConfig(
        vocab_size=VOCAB,
        d_model=spec["d_model"],
        n_layers=spec["n_layers"],
        n_heads=spec["n_heads"],
        d_mlp=spec["d_mlp"],
        seq_len=spec["seq_len"],
    )
    return GPT(cfg, seed=SEED, device=device)


def run_dmuon(spec: dict, batches, device: str, *, use_streams: bool, **opt_kw) -> dict:
    import dmuon
    from dmuon.exec._comm.collective_calls import LEDGER
    from dmuon._train.byte_gpt import lm_loss

    model = _gpt(spec, device)
    plan = dmuon.dedicate_params(model)
    rt = dmuon.exec.get_model_runtime(model)
    rt.set_use_streams(use_streams)
    opt = dmuon.Muon(
        model,
        **{**MUON_HP, **opt_kw},
        ns_dtype=torch.bfloat16,
        adamw_lr=ADAMW_HP["lr"],
        adamw_betas=ADAMW_HP["betas"],
        adamw_eps=ADAMW_HP["eps"],
        adamw_weight_decay=ADAMW_HP["weight_decay"],
    )
    segments = [seg for b in rt.boundaries for seg in b.segments]
    losses, first_bufs, ledger_ok = [], None, True
    reads0 = rt._flag_host_reads
    for x, y in batches:
        LEDGER.reset()
        loss = lm_loss(model(x.to(device)), y.to(device))
        loss.backward()
        ledger_ok &= LEDGER.total_nbytes() == plan.cost.per_rank_nbytes[0]
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        if first_bufs is None:
            first_bufs = [id(seg.reduce_buf) for seg in segments]
    if device == "cuda":
        torch.cuda.synchronize()
    return dict(
        losses=losses,
        dedicated=list(plan.dedicated),
        plan_json=plan.to_json(),
        streams_built=rt._streams is not None,
        buffers_persistent=first_bufs == [id(seg.reduce_buf) for seg in segments],
        flag_reads_per_step=(rt._flag_host_reads - reads0) / len(batches),
        ledger_matches_plan=bool(ledger_ok),
    )


def run_torch_reference(spec: dict, batches, device: str, dedicated) -> dict:
    from dmuon._train.byte_gpt import lm_loss

    model = _gpt(spec, device)
    named = dict(model.named_parameters())
    muon = torch.optim.Muon([named[f] for f in dedicated], **MUON_HP)
    adamw = torch.optim.AdamW([p for f, p in named.items() if f not in set(dedicated)], **ADAMW_HP)
    losses = []
    for x, y in batches:
        loss = lm_loss(model(x.to(device)), y.to(device))
        loss.backward()
        muon.step()
        adamw.step()
        muon.zero_grad()
        adamw.zero_grad()
        losses.append(loss.item())
    return dict(losses=losses)


def run_testing_reference(spec: dict, batches, device: str, plan_json: str, **opt_kw) -> dict:
    """:class:`dmuon.testing.ReferenceOptimizer` (``torch.optim.Muon`` / the NorMuon reference on the
    dedicated matrices, AdamW on the rest, one process) on the same GPU, bf16 Newton-Schulz."""
    from dmuon.plan import ShardingPlan
    from dmuon.testing import ReferenceOptimizer, proxies_from_plan
    from dmuon._train.byte_gpt import lm_loss

    model = _gpt(spec, device)
    hp = {**MUON_HP, **opt_kw, **{f"adamw_{k}": v for k, v in ADAMW_HP.items()}}
    if "ns_coefficients" in opt_kw:
        hp.pop("ns_steps")  # a fixed-length preset sets its own step count (dmuon.Muon's rule)
    opt = ReferenceOptimizer(model, proxies_from_plan(ShardingPlan.from_json(plan_json)), ns_dtype=torch.bfloat16, **hp)
    losses = []
    for x, y in batches:
        loss = lm_loss(model(x.to(device)), y.to(device))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return dict(losses=losses)


def _max_rel(a, b) -> float:
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b))


def train_check(device: str, spec: dict, steps: int, loss_rtol: float, stream_rtol: float) -> dict:
    batches = make_batches(spec, steps)
    runs = {"dmuon_streams": run_dmuon(spec, batches, device, use_streams=True)}
    dedicated = runs["dmuon_streams"]["dedicated"]
    if device == "cuda":
        runs["dmuon_no_streams"] = run_dmuon(spec, batches, device, use_streams=False)
    runs["torch_ref"] = run_torch_reference(spec, batches, device, dedicated)
    # NorMuon (variant="normuon") and the fixed 10-step "deepseek_v4" Newton-Schulz preset against
    # dmuon.testing's single-process references on the same device
    variants = {"normuon": dict(variant="normuon"), "deepseek_v4": dict(ns_coefficients="deepseek_v4")}
    for name, kw in variants.items():
        hp = {**kw, "ns_steps": None} if "ns_coefficients" in kw else kw
        runs[f"dmuon_{name}"] = run_dmuon(spec, batches, device, use_streams=True, **hp)
        runs[f"{name}_ref"] = run_testing_reference(spec, batches, device, runs[f"dmuon_{name}"]["plan_json"], **kw)
    if device == "cuda":
        runs["dmuon_cpu"] = run_dmuon(spec, batches, "cpu", use_streams=True)
    ref = runs["dmuon_streams"]["losses"]
    checks = []
    for name in variants:
        err = _max_rel(runs[f"dmuon_{name}"]["losses"], runs[f"{name}_ref"]["losses"])
        checks.append(dict(check=f"losses dmuon_{name} vs {name}_ref", value=err, limit=loss_rtol, ok=err <= loss_rtol))
    for name, run in runs.items():
        if name == "dmuon_streams" or any(name in (f"dmuon_{v}", f"{v}_ref") for v in variants):
            continue
        tol = stream_rtol if name == "dmuon_no_streams" else loss_rtol
        err = _max_rel(run["losses"], ref)
        checks.append(dict(check=f"losses {name} vs dmuon_streams", value=err, limit=tol, ok=err <= tol))
    s = runs["dmuon_streams"]
    checks.append(
        dict(
            check="ledger bytes == plan every step",
            value=s["ledger_matches_plan"],
            limit=True,
            ok=s["ledger_matches_plan"],
        )
    )
    checks.append(
        dict(
            check="reduce buffers the same tensors every step",
            value=s["buffers_persistent"],
            limit=True,
            ok=s["buffers_persistent"],
        )
    )
    checks.append(
        dict(
            check="flag host reads per backward",
            value=s["flag_reads_per_step"],
            limit=1.0,
            ok=s["flag_reads_per_step"] == 1.0,
        )
    )
    if device == "cuda":
        checks.append(
            dict(check="dmuon CUDA streams used", value=s["streams_built"], limit=True, ok=s["streams_built"])
        )
    finite = all(math.isfinite(v) for run in runs.values() for v in run["losses"])
    checks.append(dict(check="all losses finite", value=finite, limit=True, ok=finite))
    return dict(runs=runs, checks=checks, ok=all(c["ok"] for c in checks))


def _step_times(model, opt, batches, device: str) -> tuple[list[float], list[float]]:
    """Losses and ``opt.step()`` wall times (synchronised) over ``batches``."""
    from dmuon._train.byte_gpt import lm_loss

    losses, times = [], []
    for x, y in batches:
        loss = lm_loss(model(x.to(device)), y.to(device))
        loss.backward()
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        opt.step()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        opt.zero_grad()
        losses.append(loss.item())
    return losses, times


def _serial_copy_s(opt, device: str) -> float:
    """The offloaded step's copies run alone, one after the other: every owned master, momentum and
    gradient (a stand-in of the master's size) to the device, every master and momentum back."""
    owned = [p for g in opt.param_groups if g["use_muon"] for p in g["params"] if p.numel()]
    masters = [p.detach() for p in owned]
    momenta = [opt.state[p]["momentum_buffer"] for p in owned]
    pinned = device == "cuda"
    back = [torch.empty(t.shape, dtype=t.dtype, pin_memory=pinned) for t in masters + momenta]
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    on_device = [t.to(device, non_blocking=True) for t in masters + momenta + masters]
    for host, dev in zip(back, on_device):
        host.copy_(dev, non_blocking=True)
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def offload_check(device: str, spec: dict, steps: int, stream_rtol: float, min_overlap: float) -> dict:
    """The ``offload`` part (module docstring)."""
    import dmuon
    from torch.distributed.fsdp import CPUOffloadPolicy

    batches = make_batches(spec, max(steps, 4 if device == "cuda" else steps))
    out: dict = {}
    for name, policy in (("plain", None), ("offload", CPUOffloadPolicy(pin_memory=device == "cuda"))):
        model = _gpt(spec, device)
        dmuon.dedicate_params(model, offload_policy=policy)
        rt = dmuon.exec.get_model_runtime(model)
        opt = dmuon.Muon(model, **MUON_HP, ns_dtype=torch.bfloat16, ns_batching="exact")
        losses, times = _step_times(model, opt, batches, device)
        held = [seg for b in rt.boundaries for seg in b.segments if seg.held]
        out[name] = dict(
            losses=losses,
            step_s=sorted(times[1:] or times)[len(times[1:] or times) // 2],
            masters_on_host=all(seg.master.device.type == "cpu" for seg in held),
            masters_pinned=all(seg.master.is_pinned() for seg in held),
            master_is_wire=any(seg.master is seg.wire for seg in held),
        )
        if policy is not None:
            out[name]["copy_s"] = min(_serial_copy_s(opt, device) for _ in range(3))
    plain, off = out["plain"], out["offload"]
    err = _max_rel(off["losses"], plain["losses"])
    checks = [
        dict(check="losses offload vs plain", value=err, limit=stream_rtol, ok=err <= stream_rtol),
        dict(
            check="offloaded masters on the host, not the broadcast buffer",
            value=off["masters_on_host"] and not off["master_is_wire"],
            limit=True,
            ok=off["masters_on_host"] and not off["master_is_wire"],
        ),
    ]
    if device == "cuda":
        overlap = (plain["step_s"] + off["copy_s"] - off["step_s"]) / max(off["copy_s"], 1e-12)
        checks.append(
            dict(check="offloaded masters pinned", value=off["masters_pinned"], limit=True, ok=off["masters_pinned"])
        )
        checks.append(
            dict(check="offload copies hidden (overlap)", value=overlap, limit=min_overlap, ok=overlap > min_overlap)
        )
    else:
        overlap = None  # the CPU has no copy engine to overlap with
    return dict(runs=out, overlap=overlap, checks=checks, ok=all(c["ok"] for c in checks))


def print_offload(result: dict) -> None:
    for name, run in result["runs"].items():
        extra = f", serial copies {run['copy_s'] * 1e3:.2f} ms" if "copy_s" in run else ""
        print(f"offload {name:8} step {run['step_s'] * 1e3:.2f} ms{extra}")
    if result["overlap"] is not None:
        print(f"  overlap {result['overlap']:.2f}")
    for c in result["checks"]:
        value = f"{c['value']:.3g}" if isinstance(c["value"], float) else str(c["value"])
        print(f"  [{'ok' if c['ok'] else 'FAIL':4}] {c['check']}: {value} (limit {c['limit']})")


def print_train(result: dict) -> None:
    for name, run in result["runs"].items():
        print(f"{name:17} losses " + " ".join(f"{v:.6f}" for v in run["losses"]))
    for c in result["checks"]:
        value = f"{c['value']:.3g}" if isinstance(c["value"], float) else str(c["value"])
        print(f"  [{'ok' if c['ok'] else 'FAIL':4}] {c['check']}: {value} (limit {c['limit']})")


# ----------------------------------------------------------------------------------------------


def main(argv=None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    device = args.device
    if args.threads or device == "cpu":  # OpenMP on a shared CPU makes timings meaningless
        torch.set_num_threads(args.threads or 1)
    out: dict = dict(
        meta=dict(
            torch=torch.__version__,
            python=platform.python_version(),
            device=device,
            device_name=torch.cuda.get_device_name(0) if device == "cuda" else platform.processor(),
            quick=args.quick,
        )
    )
    ok = True
    if "ns" in args.parts:
        shapes = args.shapes or (NS_SHAPES["cpu"][:1] if args.quick else NS_SHAPES[device])
        batch = args.batch or (2 if args.quick else NS_BATCH[device])
        min_time = args.min_time if args.min_time is not None else (0.02 if args.quick else 0.2)
        side = 64 if args.quick else PEAK_SIDE[device]
        dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
        rows = ns_rows(device, dtypes, shapes, batch, args.ns_steps, min_time, side)
        print_ns(rows)
        out["ns"] = rows
    if "train" in args.parts:
        out["collectives"] = init_one_rank_group(device, args.collectives)
        spec = TRAIN_SIZES["quick" if args.quick else "small"]
        print(f"\ntraining: {args.steps} steps, GPT {spec}, 1-rank gloo, collectives: {out['collectives']}")
        result = train_check(device, spec, args.steps, args.loss_rtol, args.stream_rtol)
        print_train(result)
        out["train"] = result
        ok = result["ok"]
    if "offload" in args.parts:
        if "collectives" not in out:
            out["collectives"] = init_one_rank_group(device, args.collectives)
        spec = TRAIN_SIZES["quick" if args.quick else ("offload" if device == "cuda" else "small")]
        print(f"\noffload: {args.steps} steps, GPT {spec}")
        result = offload_check(device, spec, args.steps, args.stream_rtol, args.min_overlap)
        print_offload(result)
        out["offload"] = result
        ok = ok and result["ok"]
    wall = time.perf_counter() - started
    out["meta"]["wall_s"] = wall
    print(f"\n{'PASS' if ok else 'FAIL'} in {wall:.1f} s")
    if wall > BUDGET_S:
        print(f"warning: over the {BUDGET_S:.0f} s budget", file=sys.stderr)
    if args.json:
        args.json.write_text(json.dumps(out, indent=2, default=str))
        print(f"wrote {args.json}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
