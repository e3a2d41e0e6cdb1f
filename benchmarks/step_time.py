"""Step time of dmuon against FSDP2 + AdamW and FSDP2 + naive Muon on the main job's GPT.

    python benchmarks/step_time.py --nproc 2 4 --sizes small large --steps 12 --warmup 3
    python benchmarks/step_time.py --quick --json out.json --png out.png      # smoke run (~20 s)
    python benchmarks/step_time.py --device cuda --nproc 2 4 --json gpu.json  # one GPU per rank

Model: :class:`dmuon._train.byte_gpt.GPT` (byte vocabulary 256, random tokens; the data does not
matter for speed), at these sizes (``--sizes``; ``mid`` is the simulator's blind check)::

    small: 4 blocks, d_model 128, d_mlp 512, 4 heads,  global batch 16 x 64 tokens
    large: 8 blocks, d_model 256, d_mlp 1024, 8 heads, global batch 16 x 128 tokens
    mid:   6 blocks, d_model 192, d_mlp 768, 6 heads,  global batch 12 x 96 tokens
    moe:   4 blocks, d_model 128, 4 heads, MoE MLP of 8 SwiGLU experts of hidden 256, top-2,
           global batch 16 x 64 tokens (``naive`` does not handle its 3-D stacks: leave it out)

For every N in ``--nproc`` the script spawns N local processes ONCE (gloo on CPU with
``torch.set_num_threads(--threads)``, default 1; NCCL on CUDA, rank i on ``cuda:i``); inside that
launch every size and every variant is built (same seed, same batches) and timed:

    adamw     FSDP2 (fully_shard per block + root, reshard_after_forward=True) + torch.optim.AdamW
              on every parameter: the floor.
    naive     the same FSDP2 wrapping + :class:`NaiveMuon` (below): momentum on the FSDP2 shards,
              every rank all-gathers each Muon matrix's update with ``DTensor.full_tensor()``,
              runs Newton-Schulz on ALL matrices redundantly, and applies its own shard.
    dmuon_z2  ``dmuon.dedicate_params(reshard_after_forward=False)`` + fully_shard(..., False)
              + ``dmuon.Muon``.
    dmuon_z3  the same with ``reshard_after_forward=True`` (dmuon's default).

Opt-in (``--variants``): ``dmuon_z3_auto`` (below), and ``dmuon_z3_bcast`` / ``dmuon_z3_allgather``:
``dmuon_z3`` with every buffer's collective forced (``collectives="broadcast"``: one broadcast per
owner segment, one reduce per segment; ``"all_gather"``: one all-gather of equal slots, one
reduce-scatter); ``dmuon_z2_bcast`` / ``dmuon_z2_allgather`` the same for ``dmuon_z2``.
``dmuon_z2`` / ``dmuon_z3`` use the plan's default, ``collectives="auto"`` (``dedicate_params``
prices it with the process group's link record: gloo's on CPU). ``benchmarks/collective_kinds.py``
runs these side by side. ``dmuon_z3_exact``: ``dmuon_z3`` with ``dmuon.Muon(ns_batching="exact")``
(one Newton-Schulz call per matrix, bit for bit ``torch.optim.Muon``); the others run the default,
``"batched"``.

and, with ``--hook-overhead`` (default on, off in ``--quick``), one more launch at N = 1::

    plain           the bare model + torch.optim.AdamW (no FSDP2, no dmuon)
    dmuon_hooks_z3  dedicate_params only (dmuon's hooks, no FSDP2) + dmuon.Muon
    adamw, dmuon_z3 as above, on a 1-rank mesh

Muon hyper-parameters are ``dmuon.Muon``'s defaults for both Muon variants; AdamW uses
``dmuon.Muon``'s AdamW defaults (lr 1e-3, betas (0.9, 0.999), eps 1e-8, weight decay 1e-2).
Newton-Schulz dtype ``--ns-dtype auto``: bf16 on CUDA (torch.optim.Muon's default), fp32 on
CPU (CPUs without bf16 units run bf16 matmuls several times slower), the rule of
``python -m dmuon train``. Both Muon variants batch same-shape matrices the same way (every NS dtype).

Timing: every variant is warmed up (``--warmup`` steps), then ``--rounds`` rounds run each
variant for ``ceil(--steps / --rounds)`` steps in turn (interleaving spreads machine drift over
all variants). A step = ``forward + loss + backward`` ("fwd+bwd") then ``opt.step() +
zero_grad()`` ("opt"); all ranks start it together after a barrier (not timed); its time is the
slowest rank's. Reported per variant: the median over the timed steps.

Per variant (JSON field names in brackets):

* ``step_ms`` / ``fwd_bwd_ms`` / ``opt_ms``: medians, milliseconds; ``ratio_to_adamw``.
* ``ledger_nbytes_per_step``: dmuon's byte ledger (:data:`dmuon.exec._comm.collective_calls.LEDGER`) for one
  step, plan phases only, summed over ranks (the median over steps; ``ledger_constant`` says
  whether every step charged the same), ``ledger_per_rank_nbytes``; ``plan_total_nbytes`` and
  ``plan_per_rank_nbytes`` from ``plan.cost``; ``ledger_matches_plan`` (total and per rank, every
  timed step). For ``adamw`` / ``naive``, ``model_nbytes_per_step`` is the plan's byte MODEL of
  FSDP2 (+ the naive all-gather) for the same matrices (``plan.baseline_cost``), not a measurement.
* NS: ``dmuon.exec._optim.ns_backends.newton_schulz`` is wrapped in every rank (both Muon variants
  call it through the module), recording matmul FLOPs (``ns_flops`` of each call's shape) and
  wall time (CUDA: synchronised around the call). ``ns_flops_total`` (all ranks, one step),
  ``ns_flops_per_rank``, ``ns_flops_busiest``, ``ns_busiest_over_mean`` = busiest / (total / N),
  ``ns_ms_busiest`` (median over steps of the slowest rank's NS time), and the plan's prediction
  ``plan_ns_flops_per_rank`` (``plan.rank_stats()``). ``gram_newton_schulz`` is wrapped the same
  way (``gram_ns_flops``), for ``--variants dmuon_z3_auto`` (Z3 with ``ns_backend="auto"`` in
  ``dedicate_params`` and ``dmuon.Muon``: Gram NS on the MLP matrices).
* ``floor_ms`` (``floor``; dmuon variants): per step, the slowest rank's own forward + backward +
  ``dmuon.Muon``'s AdamW group step (the non-dedicated parameters) + its Newton-Schulz time; the
  median over steps. The step time with nothing else (momentum, updates, waits) is this floor.
* Memory per rank: CPU: ``peak_rss_mib`` = ``resource.getrusage(RUSAGE_SELF).ru_maxrss`` after the
  size's runs — a PROCESS peak, shared by all variants of the launch (they live in one process),
  so it cannot separate them; therefore also ``peak_alloc_mib``: bytes of tensor storages held at
  the start of a step (parameters, optimizer state, dmuon buffers) + the peak of the allocations
  made during one extra step, measured with ``torch.profiler(profile_memory=True)`` (CPU
  allocator events). CUDA: ``peak_alloc_mib`` = ``torch.cuda.max_memory_allocated`` over the
  timed steps (reset before each), ``peak_rss_mib`` as on CPU.
* ``losses``: the global mean loss of each step, in step order (variants see the same batches,
  so the two Muon variants and dmuon Z2/Z3 must agree closely: a check of the baseline).

Outputs: a table on stdout, ``--json FILE``, ``--png FILE`` (matplotlib, Agg). The JSON's
``goals`` section evaluates, at the largest N run: dmuon step time <= 1.15 x AdamW, ledger ==
plan, and busiest-rank NS FLOPs <= 1.05 x total / N (meaningful with ``--cost-model ns_flops``;
``plans`` holds the plan-predicted balance for both cost models whatever was run).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import resource
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

SIZES: dict[str, dict[str, int]] = {
    "small": dict(n_layers=4, d_model=128, d_mlp=512, n_heads=4, seq_len=64, batch=16),
    "large": dict(n_layers=8, d_model=256, d_mlp=1024, n_heads=8, seq_len=128, batch=16),
    # a size the step-time simulator was not built on (its blind check), divisible by N = 2, 3, 4
    "mid": dict(n_layers=6, d_model=192, d_mlp=768, n_heads=6, seq_len=96, batch=12),
    # a Mixture-of-Experts block (8 SwiGLU experts of hidden 256, top-2): expert stacks as Muon owners
    "moe": dict(n_layers=4, d_model=128, d_mlp=256, n_heads=4, seq_len=64, batch=16, n_experts=8, top_k=2),
}
VARIANTS = ("adamw", "naive", "dmuon_z2", "dmuon_z3")
#: opt-in variants (``--variants``): dmuon Z3 with ``ns_backend="auto"`` in the plan and the optimizer;
#: dmuon Z3 / Z2 with every buffer's collective forced (``collectives="broadcast"`` / ``"all_gather"``);
#: dmuon Z3 with ``dmuon.Muon(ns_batching="exact")`` (one NS call per matrix; the others batch)
EXTRA_VARIANTS = (
    "dmuon_z3_auto",
    "dmuon_z3_bcast",
    "dmuon_z3_allgather",
    "dmuon_z2_bcast",
    "dmuon_z2_allgather",
    "dmuon_z3_exact",
)
#: the ``collectives=`` of each dmuon variant's plan (the others: the default, ``"auto"``)
VARIANT_COLLECTIVES = {
    "dmuon_z3_bcast": "broadcast",
    "dmuon_z3_allgather": "all_gather",
    "dmuon_z2_bcast": "broadcast",
    "dmuon_z2_allgather": "all_gather",
}
HOOK_VARIANTS = ("plain", "dmuon_hooks_z3", "adamw", "dmuon_z3")
GOAL_STEP_RATIO = 1.15
GOAL_NS_BALANCE = 1.05
N_BATCHES = 4  # distinct batches cycled through
SEED = 0

# dmuon.Muon's defaults (those of torch.optim.Muon / torch.optim.AdamW; dmuon.Muon's signature):
# both Muon variants use exactly these.
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


# ==============================================================================================
# The naive baseline: FSDP2 + all-gather Muon, Newton-Schulz on every rank
# ==============================================================================================


class NaiveMuon:
    """FSDP2 + naive Muon: what one writes without dmuon.

    Muon matrices (``muon_fqns``: the parameters dmuon's default predicate would dedicate) are
    FSDP2 ``DTensor`` shards like everything else. ``step()``, per matrix with a gradient:

    1. momentum on the local shard (``buf.lerp_(g, 1 - mu)``; Nesterov ``u = g.lerp(buf, mu)``),
       elementwise, so sharding it is exact;
    2. ``u`` is all-gathered with ``DTensor.full_tensor()`` (one all-gather per matrix, the
       same bytes as gathering the gradient itself);
    3. Newton-Schulz (:func:`dmuon._update.newton_schulz`) on the full matrix, on
       EVERY rank, same-shape matrices batched per call as ``dmuon.Muon`` batches them by default
       (every NS dtype);
    4. the rank keeps its own shard of the result (``Replicate -> Shard`` redistribution, a
       local slice) and applies ``p *= 1 - lr*wd; p -= adjust_lr(lr) * o``.

    Everything else: ``torch.optim.AdamW``. Hyper-parameters as ``dmuon.Muon``.
    """

    def __init__(self, model, muon_fqns, *, ns_dtype, **hp):
        from torch.distributed.tensor import DTensor

        h = dict(MUON_HP)
        h.update(hp)
        self.hp = h
        self.ns_dtype = ns_dtype
        names = set(muon_fqns)
        named = dict(model.named_parameters())
        self.muon = [(f, named[f]) for f in muon_fqns]
        for f, p in self.muon:
            if not isinstance(p, DTensor):
                raise TypeError(f"NaiveMuon expects FSDP2 DTensor parameters, {f} is {type(p)}")
        self.bufs = {f: torch.zeros_like(p.to_local()) for f, p in self.muon}
        self.adamw = torch.optim.AdamW([p for n, p in named.items() if n not in names], **ADAMW_HP)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for _, p in self.muon:
            p.grad = None
        self.adamw.zero_grad(set_to_none=set_to_none)

    @torch.no_grad()
    def step(self) -> None:
        from torch.distributed.tensor import DTensor, Replicate

        from dmuon.exec._optim import ns_backends as ns_mod
        from dmuon._update import adjust_lr

        h = self.hp
        mu, lr, wd = h["momentum"], h["lr"], h["weight_decay"]
        ns_kw = dict(coefficients=h["ns_coefficients"], steps=h["ns_steps"], eps=h["eps"], dtype=self.ns_dtype)
        gathered = []  # (param, full update)
        for f, p in self.muon:
            if p.grad is None:
                continue
            g = p.grad.to_local()
            buf = self.bufs[f]
            buf.lerp_(g, 1 - mu)
            u = g.lerp(buf, mu) if h["nesterov"] else buf
            full = DTensor.from_local(
                u, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
            ).full_tensor()
            gathered.append((p, full))
        outs: list[tuple[Any, torch.Tensor]] = []
        # batched as dmuon.Muon's default (ns_batching="batched"), in every NS dtype
        buckets: dict[tuple, list] = {}
        for p, full in gathered:
            m, n = full.shape
            buckets.setdefault((min(m, n), max(m, n)), []).append((p, full))
        for entries in buckets.values():
            if len(entries) == 1:
                p, full = entries[0]
                outs.append((p, ns_mod.newton_schulz(full, **ns_kw)))
                continue
            stack = torch.stack([x.mT if x.shape[0] > x.shape[1] else x for _, x in entries])
            ortho = ns_mod.newton_schulz(stack, **ns_kw)
            for (p, x), o in zip(entries, ortho.unbind(0)):
                outs.append((p, o.mT if x.shape[0] > x.shape[1] else o))
        for p, o in outs:
            o = o.to(p.dtype).contiguous()
            mine = DTensor.from_local(
                o, p.device_mesh, [Replicate()] * p.device_mesh.ndim, run_check=False
            ).redistribute(p.device_mesh, p.placements)
            local = p.to_local()
            local.mul_(1 - lr * wd)
            local.add_(mine.to_local(), alpha=-adjust_lr(lr, h["adjust_lr_fn"], tuple(p.shape)))
        self.adamw.step()


# ==============================================================================================
# Instrumentation: Newton-Schulz timer, sync, memory
# ==============================================================================================

_NS_LOG: list[tuple[int, float]] = []  # (FLOPs, seconds) of each newton_schulz / gram_newton_schulz call
_ADAMW_LOG: list[float] = []  # seconds of each dmuon.Muon AdamW group step


def _install_ns_timer(device: torch.device) -> None:
    """Wrap ``dmuon.exec._optim.ns_backends.newton_schulz`` and ``gram_newton_schulz`` (module
    attributes; ``ns_backend="auto"`` calls them through the module) with a FLOP/time log, and
    ``dmuon.Muon``'s AdamW group step with a time log (the ``floor`` column)."""
    from dmuon.exec._optim import ns_backends as ns_mod
    from dmuon import _ns_gram as ns_gram
    from dmuon.plan._cost import flops as _flops
    from dmuon.exec._optim.muon import Muon

    if getattr(ns_mod.newton_schulz, "_bench_timed", False):
        return

    def wrap(orig, flops_of):
        def timed(x, **kw):
            m, n = int(x.shape[-2]), int(x.shape[-1])
            k = math.prod(int(s) for s in x.shape[:-2])
            _sync(device)
            t0 = time.perf_counter()
            out = orig(x, **kw)
            _sync(device)
            _NS_LOG.append((flops_of(m, n, kw.get("steps", 5), num_matrices=k), time.perf_counter() - t0))
            return out

        timed._bench_timed = True  # type: ignore[attr-defined]
        return timed

    ns_mod.newton_schulz = wrap(ns_mod.newton_schulz, _flops.ns_flops)
    ns_mod.gram_newton_schulz = wrap(ns_mod.gram_newton_schulz, ns_gram.gram_ns_flops)
    adamw_step = Muon._adamw_group_step

    def timed_adamw(self, group):
        _sync(device)
        t0 = time.perf_counter()
        adamw_step(self, group)
        _sync(device)
        _ADAMW_LOG.append(time.perf_counter() - t0)

    Muon._adamw_group_step = timed_adamw


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _rss_mib() -> float:
    """Peak resident set size of this process (Linux: ru_maxrss is in KiB), MiB."""
    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kib / (1024.0 if sys.platform != "darwin" else 1024.0**2)


def _held_nbytes(v: "Variant") -> int:
    """Bytes of the distinct tensor storages this rank holds between steps for variant ``v``:
    parameters (FSDP2 local shards, dmuon masters), optimizer state, dmuon's packed buffers."""
    from torch.distributed.tensor import DTensor

    seen: dict[int, int] = {}

    def add(t):
        if not isinstance(t, torch.Tensor):
            return
        if isinstance(t, DTensor):
            t = t.to_local()
        st = t.untyped_storage()
        seen[st.data_ptr() or id(st)] = st.nbytes()

    for p in v.model.parameters():
        add(p)
    opt = v.opt
    if isinstance(opt, NaiveMuon):
        for b in opt.bufs.values():
            add(b)
        opt = opt.adamw
    for st in opt.state.values():
        for t in st.values():
            add(t)
    from dmuon.exec import get_model_runtime

    rt = get_model_runtime(v.model)
    if rt is not None:
        for b in rt.boundaries:
            for seg in b.segments:
                add(seg.wire)
                if seg.master is not None:
                    add(seg.master)
    return sum(seen.values())


def _alloc_peaks_from_trace(path: str, ranges: list[str]) -> dict[str, int]:
    """Peak of cumulative CPU allocator bytes inside each ``record_function`` range of a trace."""
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    spans = {}
    for e in events:
        if e.get("ph") == "X" and e.get("name") in ranges:
            spans[e["name"]] = (e["ts"], e["ts"] + e["dur"])
    mem = sorted(
        (e["ts"], int(e["args"].get("Bytes", 0)))
        for e in events
        if e.get("name") == "[memory]" and int(e.get("args", {}).get("Device Type", 0)) == 0
    )
    out = {}
    for name, (t0, t1) in spans.items():
        cur = peak = 0
        for ts, nbytes in mem:
            if t0 <= ts <= t1:
                cur += nbytes
                peak = max(peak, cur)
        out[name] = peak
    return out


# ==============================================================================================
# Variants
# ==============================================================================================


class Variant:
    def __init__(self, name: str, model, opt, plan, muon_fqns):
        self.name = name
        self.model = model
        self.opt = opt
        self.plan = plan
        self.muon_fqns = muon_fqns
        self.steps_done = 0
        self.records: list[dict[str, Any]] = []  # this rank's timed steps
        self.peak_alloc = 0
        self.held_nbytes = 0


def gpt_config(size: str):
    """The :class:`dmuon._train.byte_gpt.GPTConfig` of ``size`` (:data:`SIZES`)."""
    from dmuon._train.byte_gpt import GPTConfig

    s = SIZES[size]
    moe = {k: s[k] for k in ("n_experts", "top_k") if k in s}
    return GPTConfig(
        vocab_size=256,
        d_model=s["d_model"],
        n_layers=s["n_layers"],
        n_heads=s["n_heads"],
        d_mlp=s["d_mlp"],
        seq_len=s["seq_len"],
        **moe,
    )


def _ns_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        name = "bf16" if device.type == "cuda" else "fp32"
    return {"bf16": torch.bfloat16, "fp32": torch.float32}[name]


def build_variant(name: str, size: str, mesh, device: torch.device, cfg_args: dict) -> Variant:
    """Build one variant of one size on every rank (collective: call in the same order everywhere)."""
    import torch.distributed.fsdp as fsdp

    import dmuon
    from dmuon._train.byte_gpt import GPT

    model = GPT(gpt_config(size), seed=SEED, device=device)
    ns_dtype = _ns_dtype(cfg_args["ns_dtype"], device)
    world = torch.distributed.get_world_size()
    # The matrices Muon treats (dmuon's default predicate), for every variant's bookkeeping.
    ref_plan = dmuon.plan.compile(model, world, cost_model=cfg_args["cost_model"])
    muon_fqns = list(ref_plan.dedicated)
    plan = None
    dmuon_variants = ("dmuon_z2", "dmuon_z3", "dmuon_hooks_z3", "dmuon_z3_auto", "dmuon_z3_exact")
    if name in dmuon_variants + tuple(VARIANT_COLLECTIVES):
        z3 = not name.startswith("dmuon_z2")
        ns_backend = "auto" if name == "dmuon_z3_auto" else "standard"
        plan = dmuon.dedicate_params(
            model,
            mesh,
            reshard_after_forward=z3,
            cost_model=cfg_args["cost_model"],
            ns_backend=ns_backend,
            collectives=VARIANT_COLLECTIVES.get(name, "auto"),
        )
        if name != "dmuon_hooks_z3":
            for layer in model.layers:
                fsdp.fully_shard(layer, mesh=mesh, reshard_after_forward=z3)
            fsdp.fully_shard(model, mesh=mesh, reshard_after_forward=z3)
        opt = dmuon.Muon(
            model,
            **MUON_HP,
            ns_dtype=ns_dtype,
            adamw_lr=ADAMW_HP["lr"],
            adamw_betas=ADAMW_HP["betas"],
            adamw_eps=ADAMW_HP["eps"],
            adamw_weight_decay=ADAMW_HP["weight_decay"],
            ns_backend=ns_backend,
            ns_batching="exact" if name == "dmuon_z3_exact" else "batched",
        )
    elif name == "plain":
        opt = torch.optim.AdamW(model.parameters(), **ADAMW_HP)
    elif name in ("adamw", "naive"):
        for layer in model.layers:
            fsdp.fully_shard(layer, mesh=mesh, reshard_after_forward=True)
        fsdp.fully_shard(model, mesh=mesh, reshard_after_forward=True)
        if name == "adamw":
            opt = torch.optim.AdamW(model.parameters(), **ADAMW_HP)
        else:
            opt = NaiveMuon(model, muon_fqns, ns_dtype=ns_dtype)
    else:
        raise ValueError(f"unknown variant {name!r}")
    v = Variant(name, model, opt, plan, muon_fqns)
    v.ref_plan = ref_plan
    return v


def make_batches(size: str, rank: int, world: int, device: torch.device):
    s = SIZES[size]
    gen = torch.Generator().manual_seed(1234)
    per = s["batch"] // world
    out = []
    for _ in range(N_BATCHES):
        tok = torch.randint(0, 256, (s["batch"], s["seq_len"] + 1), generator=gen)
        mine = tok[rank * per : (rank + 1) * per]
        out.append((mine[:, :-1].contiguous().to(device), mine[:, 1:].contiguous().to(device)))
    return out


def run_step(v: Variant, batches, device: torch.device, *, timed: bool) -> None:
    """One training step of ``v`` (collective). Appends a record to ``v.records`` if ``timed``."""
    import torch.distributed as dist

    from dmuon.exec._comm.collective_calls import LEDGER
    from dmuon._train.byte_gpt import lm_loss

    x, y = batches[v.steps_done % len(batches)]
    v.steps_done += 1
    dist.barrier()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    LEDGER.reset()
    _NS_LOG.clear()
    _ADAMW_LOG.clear()
    _sync(device)
    t0 = time.perf_counter()
    loss = lm_loss(v.model(x), y)
    loss.backward()
    _sync(device)
    t1 = time.perf_counter()
    v.opt.step()
    v.opt.zero_grad(set_to_none=True)
    _sync(device)
    t2 = time.perf_counter()
    if not timed:
        return
    snap = LEDGER.snapshot()
    rec = dict(
        fb=t1 - t0,
        opt=t2 - t1,
        step=t2 - t0,
        loss=float(loss.detach()),
        ledger=sum(b for ph, b in snap.items() if ph != "other"),
        ledger_other=snap.get("other", 0),
        ns_flops=sum(f for f, _ in _NS_LOG),
        ns_s=sum(t for _, t in _NS_LOG),
        adamw_s=sum(_ADAMW_LOG),
    )
    if device.type == "cuda":
        v.peak_alloc = max(v.peak_alloc, torch.cuda.max_memory_allocated(device))
    v.records.append(rec)


def measure_cpu_memory(variants: list[Variant], batches, device: torch.device, tmp: str) -> None:
    """One profiled step per variant (one profiler session): held bytes + allocation peak."""
    from torch.profiler import ProfilerActivity, profile, record_function

    names = [f"bench_mem:{v.name}" for v in variants]
    for v in variants:
        v.held_nbytes = _held_nbytes(v)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        for v, name in zip(variants, names):
            with record_function(name):
                run_step(v, batches, device, timed=False)
    path = os.path.join(tmp, f"mem-{os.getpid()}.json")
    prof.export_chrome_trace(path)
    peaks = _alloc_peaks_from_trace(path, names)
    os.unlink(path)
    for v, name in zip(variants, names):
        v.peak_alloc = v.held_nbytes + peaks.get(name, 0)


def bench_size(size: str, variant_names, mesh, device, opts: dict) -> dict[str, Any]:
    """Every rank: build, warm up, time (interleaved rounds), measure memory; gather to rank 0."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    batches = make_batches(size, rank, world, device)
    variants = [build_variant(n, size, mesh, device, opts) for n in variant_names]
    for v in variants:
        for _ in range(opts["warmup"]):
            run_step(v, batches, device, timed=False)
    per_round = math.ceil(opts["steps"] / opts["rounds"])
    for _ in range(opts["rounds"]):
        for v in variants:
            for _ in range(per_round):
                run_step(v, batches, device, timed=True)
    if device.type == "cpu" and opts["memory"]:
        t_mem = time.perf_counter()
        measure_cpu_memory(variants, batches, device, opts["tmp"])
        if rank == 0:
            print(f"  [N={world}] {size}: memory pass {time.perf_counter() - t_mem:.1f} s", file=sys.stderr, flush=True)
    mine = {v.name: dict(records=v.records, peak_alloc=v.peak_alloc, held=v.held_nbytes) for v in variants}
    rss = _rss_mib()
    everyone: list = [None] * world
    dist.all_gather_object(everyone, (mine, rss))
    out = None
    if rank == 0:
        out = {"size": size, "nproc": world, "variants": {}}
        for v in variants:
            per_rank = [e[0][v.name] for e in everyone]
            out["variants"][v.name] = _summarise(v, per_rank, [e[1] for e in everyone], world)
    del variants
    gc.collect()
    return out


def _summarise(v: Variant, per_rank: list[dict], rss: list[float], world: int) -> dict[str, Any]:
    recs = [r["records"] for r in per_rank]  # [rank][step]
    n = len(recs[0])
    step = [max(recs[r][i]["step"] for r in range(world)) for i in range(n)]
    fb = [max(recs[r][i]["fb"] for r in range(world)) for i in range(n)]
    opt = [max(recs[r][i]["opt"] for r in range(world)) for i in range(n)]
    ns_s = [max(recs[r][i]["ns_s"] for r in range(world)) for i in range(n)]
    ledger_tot = [sum(recs[r][i]["ledger"] for r in range(world)) for i in range(n)]
    losses = [sum(recs[r][i]["loss"] for r in range(world)) / world for i in range(n)]
    ns_per_rank = [recs[r][0]["ns_flops"] for r in range(world)]
    ns_total = sum(ns_per_rank)
    res: dict[str, Any] = dict(
        variant=v.name,
        timed_steps=n,
        step_ms=1e3 * statistics.median(step),
        step_ms_min=1e3 * min(step),
        step_ms_all=[1e3 * s for s in step],
        fwd_bwd_ms=1e3 * statistics.median(fb),
        opt_ms=1e3 * statistics.median(opt),
        losses=losses,
        ns_flops_total=ns_total,
        ns_flops_per_rank=ns_per_rank,
        ns_flops_busiest=max(ns_per_rank),
        ns_busiest_over_mean=(max(ns_per_rank) / (ns_total / world)) if ns_total else None,
        ns_ms_busiest=1e3 * statistics.median(ns_s),
        floor_ms=None,
        ns_flops_constant=all(recs[r][i]["ns_flops"] == ns_per_rank[r] for r in range(world) for i in range(n)),
        peak_alloc_mib=[r["peak_alloc"] / 2**20 for r in per_rank],
        held_mib=[r["held"] / 2**20 for r in per_rank],
        peak_rss_mib=rss,
        ledger_nbytes_per_step=None,
        ledger_per_rank_nbytes=None,
        ledger_constant=None,
        plan_total_nbytes=None,
        plan_per_rank_nbytes=None,
        ledger_matches_plan=None,
        plan_ns_flops_per_rank=None,
        model_nbytes_per_step=None,
        cost_model=v.ref_plan.cost_model,
    )
    if v.plan is not None:
        cost = v.plan.cost
        per_rank_steps = [[recs[r][i]["ledger"] for r in range(world)] for i in range(n)]
        res.update(
            ledger_nbytes_per_step=int(statistics.median(ledger_tot)),
            ledger_per_rank_nbytes=per_rank_steps[0],
            ledger_constant=len(set(ledger_tot)) == 1,
            ledger_other_nbytes=max(recs[r][i]["ledger_other"] for r in range(world) for i in range(n)),
            plan_total_nbytes=cost.total_nbytes,
            plan_per_rank_nbytes=list(cost.per_rank_nbytes),
            ledger_matches_plan=all(list(pr) == list(cost.per_rank_nbytes) for pr in per_rank_steps)
            and all(t == cost.total_nbytes for t in ledger_tot),
            plan_ns_flops_per_rank=[s.ns_flops for s in v.plan.rank_stats()],
            cost_model=v.plan.cost_model,
            # the floor of this variant: its own forward + backward, AdamW on the non-dedicated
            # parameters and the rank's Newton-Schulz alone (no momentum, update or waits)
            floor_ms=1e3
            * statistics.median(
                max(recs[r][i]["fb"] + recs[r][i]["adamw_s"] + recs[r][i]["ns_s"] for r in range(world))
                for i in range(n)
            ),
        )
    elif v.name in ("adamw", "naive"):
        b = v.ref_plan.baseline_cost
        fsdp = b.forward_all_gather_nbytes + b.backward_all_gather_nbytes + b.reduce_scatter_nbytes
        res["model_nbytes_per_step"] = fsdp + (b.muon_all_gather_nbytes if v.name == "naive" else 0)
    return res


# ==============================================================================================
# Process launch (one launch per N)
# ==============================================================================================


def _rank_entry(job: dict) -> Any:
    """One rank of a launch (in the group :func:`dmuon._launch.run_distributed` set up; on CUDA
    rank i on ``cuda:i``): a 1-D mesh over the world, then ``job["body"]``."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import dmuon  # noqa: F401  (fully_shard integration)

    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", rank) if job["device"] == "cuda" else torch.device("cpu")
    mesh = init_device_mesh(device.type, (world,))
    results = (job.get("body") or _bench_body)(mesh, device, job)
    dist.barrier()
    return results


def _bench_body(mesh, device: torch.device, job: dict) -> list[dict] | None:
    """Every rank of a launch: time every size of ``job``; rank 0 returns the results."""
    import torch.distributed as dist

    _install_ns_timer(device)
    rank, world = dist.get_rank(), dist.get_world_size()
    digest = dmuon_source_digest()  # the code this launch imported (read at start-up)
    results = []
    for size in job["sizes"]:
        r = bench_size(size, job["variants"], mesh, device, job)
        if rank == 0:
            r["dmuon_source_digest"] = digest
            results.append(r)
            print(f"  [N={world}] {size}: done", file=sys.stderr, flush=True)
    return results if rank == 0 else None


def launch(world: int, job: dict, timeout_s: float) -> Any:
    """Spawn ``world`` processes (:func:`dmuon._launch.run_distributed`: gloo on CPU with
    ``torch.set_num_threads(job["threads"])``, NCCL on CUDA), each running
    ``job["body"](mesh, device, job)`` (default: :func:`_bench_body`, every size of ``job``)
    in an initialised group with a 1-D mesh; return rank 0's return value. A failed rank raises
    ``DistributedError`` with its traceback, a run past ``timeout_s`` ``DistributedTimeout``."""
    from dmuon._launch import run_distributed

    backend = "nccl" if job["device"] == "cuda" else "gloo"
    with tempfile.TemporaryDirectory(prefix="dmuon-bench-") as tmp:
        return run_distributed(
            _rank_entry, world, dict(job, tmp=tmp), timeout_s=timeout_s, backend=backend, threads=job["threads"]
        )[0]


# ==============================================================================================
# Reporting
# ==============================================================================================


def dmuon_source_digest() -> str:
    """sha256 (first 16 hex) of every ``dmuon/**/*.py`` file, path and content, sorted by path:
    which dmuon code a launch ran (the tree may change between launches of one run)."""
    import hashlib

    h = hashlib.sha256()
    root = REPO / "dmuon"
    for path in sorted(root.rglob("*.py")):
        h.update(str(path.relative_to(REPO)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def git_state() -> dict[str, Any]:
    import subprocess

    def git(*a):
        try:
            return subprocess.run(["git", *a], cwd=REPO, capture_output=True, text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return None

    dirty = git("status", "--porcelain", "--", "dmuon")
    return dict(head=git("rev-parse", "--short", "HEAD"), dmuon_dirty=None if dirty is None else bool(dirty))


def machine_info(device: str) -> dict[str, Any]:
    cpu = platform.processor() or "?"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    info = dict(
        nproc=os.cpu_count(),
        cpu_model=cpu,
        torch=torch.__version__,
        python=platform.python_version(),
        platform=platform.platform(),
        device=device,
    )
    if device == "cuda" and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        info["gpu_count"] = torch.cuda.device_count()
    return info


def plan_balance(sizes, nprocs) -> dict[str, Any]:
    """Plan-predicted NS balance and bytes for both cost models (pure: meta-device models)."""
    import dmuon.plan as P
    from dmuon._train.byte_gpt import GPT

    out: dict[str, Any] = {}
    for size in sizes:
        model = GPT(gpt_config(size), device="meta")
        for n in nprocs:
            for cm in ("numel", "ns_flops"):
                plan = P.compile(model, n, cost_model=cm)
                flops = [st.ns_flops for st in plan.rank_stats()]
                total = sum(flops)
                out.setdefault(size, {}).setdefault(str(n), {})[cm] = dict(
                    ns_flops_per_rank=flops,
                    ns_busiest_over_mean=max(flops) / (total / n) if total else None,
                    z3_total_nbytes=plan.cost.total_nbytes,
                    owned_numel=list(plan.owned_numel),
                )
    return out


# ==============================================================================================
# Predictions: dmuon.sim on a calibrated cpu-gloo record (never fed from this script's timings)
# ==============================================================================================

SIM_VARIANT = {
    "adamw": "adamw",
    "naive": "naive",
    "dmuon_z2": "z2",
    "dmuon_z3": "z3",
    "dmuon_z3_bcast": "z3",
    "dmuon_z3_allgather": "z3",
    "dmuon_z2_bcast": "z2",
    "dmuon_z2_allgather": "z2",
}


def predict(size: str, nproc: int, variant: str, hw, cost_model: str) -> dict[str, float] | None:
    """``dmuon.sim.simulate`` of one benchmark cell: the size's GPT on the meta device, the plan
    this script builds (``cost_model``, Z2/Z3, the variant's ``collectives``), ``hw`` with
    ``ranks_per_node = nproc`` (every rank on this machine: processor sharing when they outnumber
    its cores). None for the N = 1 variants."""
    import dataclasses

    import dmuon.plan as P
    import dmuon.sim as S
    from dmuon._train.byte_gpt import GPT

    if variant not in SIM_VARIANT:
        return None
    s = SIZES[size]
    plan = P.compile(
        GPT(gpt_config(size), device="meta"),
        nproc,
        cost_model=cost_model,
        reshard_after_forward=not variant.startswith("dmuon_z2"),
        collectives=VARIANT_COLLECTIVES.get(variant, "auto"),
        collective_backend="gloo" if hw.comm_engine == "threads" else "nccl",  # the backend the runtime ran
    )
    wl = S.from_plan(
        plan,
        tokens_per_rank=s["batch"] // nproc * s["seq_len"],
        seq_len=s["seq_len"],
        activation_dtype="torch.float32",
        head_dim=s["d_model"] // s["n_heads"],
        top_k=s.get("top_k", 2),
    )
    sim = S.simulate(
        plan, dataclasses.replace(hw, ranks_per_node=nproc), wl, variant=SIM_VARIANT[variant], timeline_ranks=()
    )
    return dict(step_ms=1e3 * sim.step_s, ns_ms=1e3 * sim.ns_s, exposed_comm_ms=1e3 * sim.exposed_comm_s)


def add_predictions(
    rows: list[dict], hw_records: list, cost_model: str, by_nproc: dict[int, list] | None = None
) -> None:
    """``predicted_ms`` (median over the records), ``predicted_ms_all``, ``predicted_ratio``.

    ``by_nproc``: the records of each launch (``--calibrate``: the calibrations taken just before
    and just after it), used for that launch's rows instead of ``hw_records``."""
    for r in rows:
        records = (by_nproc or {}).get(r["nproc"]) or hw_records
        preds = [predict(r["size"], r["nproc"], r["variant"], hw, cost_model) for hw in records]
        preds = [p for p in preds if p is not None]
        r["predicted_ms"] = statistics.median(p["step_ms"] for p in preds) if preds else None
        r["predicted_ms_all"] = [p["step_ms"] for p in preds]
        r["predicted_error"] = r["predicted_ms"] / r["step_ms"] - 1 if preds else None
    for r in rows:
        base = next(
            (b for b in rows if b["size"] == r["size"] and b["nproc"] == r["nproc"] and b["variant"] == "adamw"), None
        )
        r["predicted_ratio"] = (
            r["predicted_ms"] / base["predicted_ms"]
            if base and r.get("predicted_ms") and base.get("predicted_ms")
            else None
        )


def run_calibration(path: str, group_sizes: list[int] | None = None) -> Any:
    """``python -m dmuon calibrate --json path [--group-sizes ...]`` in a child process; returns the record."""
    import subprocess

    import dmuon.sim._engine.hardware as H

    extra = ["--group-sizes", *map(str, group_sizes)] if group_sizes else []
    subprocess.run(
        [sys.executable, "-m", "dmuon", "calibrate", "--json", path, *extra],
        check=True,
        cwd=REPO,
        env=dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")),
    )
    return H.load(path)


def rows_of(results: list[dict]) -> list[dict]:
    rows = []
    for r in results:
        base = r["variants"].get("adamw")
        plain = r["variants"].get("plain")
        for name, v in r["variants"].items():
            row = dict(size=r["size"], nproc=r["nproc"], dmuon_source_digest=r.get("dmuon_source_digest"), **v)
            row["ratio_to_adamw"] = v["step_ms"] / base["step_ms"] if base else None
            row["ratio_to_adamw_min"] = v["step_ms_min"] / base["step_ms_min"] if base else None
            row["fwd_bwd_ratio_to_adamw"] = v["fwd_bwd_ms"] / base["fwd_bwd_ms"] if base else None
            if plain:
                row["ratio_to_plain"] = v["step_ms"] / plain["step_ms"]
                row["fwd_bwd_ratio_to_plain"] = v["fwd_bwd_ms"] / plain["fwd_bwd_ms"]
            rows.append(row)
    return rows


def _fmt(x, spec="", none="-"):
    return none if x is None else format(x, spec)


def format_table(rows: list[dict]) -> str:
    hdr = (
        f"{'size':<6}{'N':>2} {'variant':<19}{'step ms':>9}{'fwd+bwd':>9}{'opt ms':>8}"
        f"{'xAdamW':>7}{'min ms':>8}{'xAdamW':>7}  {'ledger B/step':>14}{'plan B/step':>13}{'=plan':>6}"
        f"{'NS GF max':>10}{'max/mean':>9}{'NS ms max':>10}{'floor':>8}{'alloc MiB':>10}{'RSS MiB':>9}"
        f"{'pred ms':>9}{'err':>6}{'pred x':>7}"
    )
    lines = [hdr, "-" * len(hdr)]
    for r in rows:
        plan_b = r["plan_total_nbytes"] if r["plan_total_nbytes"] is not None else r["model_nbytes_per_step"]
        plan_s = _fmt(plan_b, ",") + ("" if r["plan_total_nbytes"] is not None or plan_b is None else "*")
        eq = None if r["ledger_matches_plan"] is None else ("yes" if r["ledger_matches_plan"] else "NO")
        lines.append(
            f"{r['size']:<6}{r['nproc']:>2} {r['variant']:<19}{r['step_ms']:>9.1f}{r['fwd_bwd_ms']:>9.1f}"
            f"{r['opt_ms']:>8.1f}{_fmt(r['ratio_to_adamw'], '.2f'):>7}"
            f"{r['step_ms_min']:>8.1f}{_fmt(r.get('ratio_to_adamw_min'), '.2f'):>7}  "
            f"{_fmt(r['ledger_nbytes_per_step'], ','):>14}{plan_s:>13}{_fmt(eq):>6}"
            f"{r['ns_flops_busiest'] / 1e9:>10.2f}{_fmt(r['ns_busiest_over_mean'], '.3f'):>9}"
            f"{r['ns_ms_busiest']:>10.1f}{_fmt(r.get('floor_ms'), '.1f'):>8}"
            f"{max(r['peak_alloc_mib']):>10.1f}{max(r['peak_rss_mib']):>9.0f}"
            f"{_fmt(r.get('predicted_ms'), '.1f'):>9}{_fmt(r.get('predicted_error'), '+.0%'):>6}"
            f"{_fmt(r.get('predicted_ratio'), '.2f'):>7}"
        )
    lines.append(
        "  (step/fwd+bwd/opt: medians over the timed steps, each the slowest rank's; min ms: the "
        "fastest timed step; xAdamW: ratio to FSDP2+AdamW at the same N, by median and by min)"
    )
    lines.append(
        "  (pred ms: dmuon.sim.simulate on the calibrated cpu-gloo record(s), median over the calibrations "
        "bracketing the row's launch (--calibrate) or over --hw; "
        "err: pred / measured median - 1; pred x: predicted ratio to FSDP2+AdamW)"
    )
    lines.append(
        "  (* = plan.baseline_cost byte MODEL of FSDP2 [+ naive all-gather] for the Muon "
        "matrices, not measured; ledger = dmuon's measured bytes, summed over ranks)"
    )
    lines.append(
        "  (floor: dmuon's own fwd+bwd + AdamW on the non-dedicated params + its Newton-Schulz, "
        "per step the slowest rank's sum, median; what the step would take with nothing else)"
    )
    return "\n".join(lines)


def format_hook_table(rows: list[dict]) -> str:
    hdr = f"{'size':<6}{'variant':<16}{'fwd+bwd ms':>11}{'x plain':>8}{'step ms':>9}{'x plain':>8}{'opt ms':>8}"
    lines = ["hook overhead at N=1 (plain = bare model, no FSDP2, no dmuon)", hdr, "-" * len(hdr)]
    for r in rows:
        lines.append(
            f"{r['size']:<6}{r['variant']:<16}{r['fwd_bwd_ms']:>11.1f}"
            f"{_fmt(r.get('fwd_bwd_ratio_to_plain'), '.3f'):>8}{r['step_ms']:>9.1f}"
            f"{_fmt(r.get('ratio_to_plain'), '.3f'):>8}{r['opt_ms']:>8.1f}"
        )
    return "\n".join(lines)


def evaluate_goals(rows: list[dict]) -> dict[str, Any]:
    if not rows:
        return {}
    n = max(r["nproc"] for r in rows)
    out: dict[str, Any] = {"nproc": n, "checks": []}
    for r in rows:
        if r["nproc"] != n or r["variant"] not in ("dmuon_z2", "dmuon_z3"):
            continue
        out["checks"].append(
            dict(
                size=r["size"],
                variant=r["variant"],
                cost_model=r["cost_model"],
                step_ratio=r["ratio_to_adamw"],
                step_ratio_ok=(r["ratio_to_adamw"] or 99) <= GOAL_STEP_RATIO,
                step_ratio_min=r["ratio_to_adamw_min"],
                ledger_equals_plan=r["ledger_matches_plan"],
                ns_busiest_over_mean=r["ns_busiest_over_mean"],
                ns_balance_ok=(r["ns_busiest_over_mean"] or 99) <= GOAL_NS_BALANCE,
            )
        )
    return out


def write_png(path: str, rows: list[dict]) -> None:
    """One panel per size; a group of bars per N (fwd+bwd solid, optimizer hatched)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    order = ("plain", "dmuon_hooks_z3") + VARIANTS
    colors = {
        "adamw": "#7f7f7f",
        "naive": "#d62728",
        "dmuon_z2": "#1f77b4",
        "dmuon_z3": "#2ca02c",
        "plain": "#c7c7c7",
        "dmuon_hooks_z3": "#9467bd",
    }
    sizes = list(dict.fromkeys(r["size"] for r in rows))
    fig, axes = plt.subplots(1, len(sizes), figsize=(6.5 * len(sizes), 4.8), squeeze=False)
    for ax, size in zip(axes[0], sizes):
        sel = [r for r in rows if r["size"] == size]
        labelled: set[str] = set()
        ns = sorted(set(r["nproc"] for r in sel))
        for i, n in enumerate(ns):
            group = sorted((r for r in sel if r["nproc"] == n), key=lambda r: order.index(r["variant"]))
            width = 0.8 / max(len(group), 1)
            for j, r in enumerate(group):
                name = r["variant"]
                x = i + (j - (len(group) - 1) / 2) * width
                c = colors.get(name)
                ax.bar(x, r["fwd_bwd_ms"], width, color=c, label=None if name in labelled else name)
                labelled.add(name)
                ax.bar(x, r["opt_ms"], width, bottom=r["fwd_bwd_ms"], color=c, alpha=0.45, hatch="//")
                if r.get("ratio_to_adamw"):
                    ax.text(
                        x,
                        r["fwd_bwd_ms"] + r["opt_ms"],
                        f"{r['ratio_to_adamw']:.2f}",
                        ha="center",
                        va="bottom",
                        fontsize=7,
                    )
        ax.set_xticks(range(len(ns)))
        ax.set_xticklabels([f"N={n}" for n in ns])
        ax.set_ylabel("ms per step (solid: fwd+bwd, hatched: optimizer)")
        ax.set_title(f"{size}: median step, slowest rank (labels: x FSDP2+AdamW at that N)", fontsize=9)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ==============================================================================================
# Main
# ==============================================================================================


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--nproc", type=int, nargs="+", default=[2, 4], help="world sizes, one launch each")
    p.add_argument("--sizes", nargs="+", choices=sorted(SIZES), default=["small", "large"])
    p.add_argument("--variants", nargs="+", choices=VARIANTS + EXTRA_VARIANTS, default=list(VARIANTS))
    p.add_argument("--steps", type=int, default=12, help="timed steps per variant (>= 10 recommended)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per variant first")
    p.add_argument("--rounds", type=int, default=4, help="interleaved rounds over the variants")
    p.add_argument(
        "--cost-model", choices=("numel", "ns_flops"), default="numel", help="dmuon.dedicate_params(cost_model=...)"
    )
    p.add_argument(
        "--ns-dtype",
        choices=("auto", "bf16", "fp32"),
        default="auto",
        help="Newton-Schulz dtype of both Muon variants; auto: bf16 on cuda, fp32 on cpu",
    )
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--threads", type=int, default=1, help="torch threads per CPU rank")
    p.add_argument(
        "--hook-overhead",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also run the N=1 launch: bare model vs dmuon hooks vs FSDP2",
    )
    p.add_argument(
        "--memory",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="CPU: one profiled step per variant for the allocation peak",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: small only, N=2, 4 timed steps, 1 warm-up, 2 rounds, no N=1 launch",
    )
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per launch")
    p.add_argument(
        "--hw",
        nargs="+",
        default=[],
        metavar="FILE",
        help="calibration JSON(s) of `python -m dmuon calibrate` for the predicted ms column",
    )
    p.add_argument(
        "--calibrate",
        action="store_true",
        help="run `python -m dmuon calibrate` before every launch and after the last (same "
        "sitting, interleaved); each launch's rows are predicted from the two that bracket it",
    )
    p.add_argument(
        "--calibrate-group-sizes",
        type=int,
        nargs="+",
        default=None,
        metavar="K",
        help="with --calibrate: the gloo group sizes `dmuon calibrate` measures (default: its own, 2 3 4)",
    )
    p.add_argument("--json", help="write the results here")
    p.add_argument("--png", help="write a bar chart here")
    return p


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = build_parser().parse_args(argv)
    if args.quick:
        args.sizes, args.nproc, args.steps, args.warmup, args.rounds = ["small"], [2], 4, 1, 2
        args.hook_overhead = False
    for size in args.sizes:
        for n in args.nproc:
            if SIZES[size]["batch"] % n:
                raise SystemExit(f"global batch {SIZES[size]['batch']} of {size} is not divisible by N={n}")
    if args.device == "cuda" and torch.cuda.device_count() < max(args.nproc):
        raise SystemExit(f"--device cuda needs {max(args.nproc)} GPUs, found {torch.cuda.device_count()}")
    job = dict(
        sizes=args.sizes,
        steps=args.steps,
        warmup=args.warmup,
        rounds=max(1, args.rounds),
        cost_model=args.cost_model,
        ns_dtype=args.ns_dtype,
        device=args.device,
        threads=args.threads,
        memory=args.memory,
    )
    t_start = time.time()
    load_start = os.getloadavg()
    digest_start, git_start = dmuon_source_digest(), git_state()
    results: list[dict] = []
    hook_results: list[dict] = []
    import dmuon.sim._engine.hardware as H

    hw_records = [H.load(f) for f in args.hw]
    calibrations = []
    cal_records: list = []  # calibration i runs before launch i; the last one after the last launch
    cal_dir = tempfile.mkdtemp(prefix="dmuon-cal-")

    def calibrate(when: str) -> None:
        print(f"calibrating {when} ...", file=sys.stderr, flush=True)
        path = os.path.join(cal_dir, f"cal-{len(calibrations)}.json")
        cal_records.append(run_calibration(path, args.calibrate_group_sizes))
        with open(path) as f:
            calibrations.append(json.load(f))

    for n in args.nproc:
        if args.calibrate:
            calibrate(f"before N={n}")
        print(f"launching N={n} ({', '.join(args.variants)}) ...", file=sys.stderr, flush=True)
        results += launch(n, dict(job, variants=list(args.variants)), args.timeout)
    by_nproc = None
    if args.calibrate:
        calibrate("after the last launch")
        # each launch is predicted from the calibrations that bracket it (the machine's speed
        # drifts by tens of percent over minutes here); the median over all of them is kept
        # in hw_records for rows no launch owns
        by_nproc = {n: cal_records[i : i + 2] for i, n in enumerate(args.nproc)}
        hw_records += cal_records
    if args.hook_overhead:
        print(f"launching N=1 ({', '.join(HOOK_VARIANTS)}) ...", file=sys.stderr, flush=True)
        hook_results = launch(1, dict(job, variants=list(HOOK_VARIANTS)), args.timeout)
    rows = rows_of(results)
    hook_rows = rows_of(hook_results)
    if hw_records:
        try:
            add_predictions(rows, hw_records, args.cost_model, by_nproc)
        except Exception:  # a broken prediction must not lose the measurements
            traceback.print_exc()
    info = machine_info(args.device)
    info["loadavg_1_5_15_start"] = list(load_start)
    info["loadavg_1_5_15_end"] = list(os.getloadavg())
    digests = sorted({r["dmuon_source_digest"] for r in results + hook_results} | {digest_start})
    info["dmuon_source"] = dict(
        git_start, digest_at_start=digest_start, digests_seen=digests, digest_at_end=dmuon_source_digest()
    )
    if len(set(digests) | {info["dmuon_source"]["digest_at_end"]}) > 1:
        print(
            f"WARNING: dmuon's sources changed during the run (digests {digests}): launches "
            "ran different code; see each row's dmuon_source_digest",
            file=sys.stderr,
        )
    threads = f"{args.threads} thread(s)/rank" if args.device == "cpu" else "1 GPU/rank"
    print(
        f"\nmachine: {info['nproc']} CPUs, {info['cpu_model']}, torch {info['torch']}, "
        f"{args.device} ({'gloo' if args.device == 'cpu' else 'nccl'}), {threads}; "
        f"cost_model={args.cost_model}; ns_dtype={args.ns_dtype}; "
        f"{args.rounds} rounds x {math.ceil(args.steps / args.rounds)} timed steps "
        f"after {args.warmup} warm-up; load average {load_start[0]:.1f} at start, "
        f"{info['loadavg_1_5_15_end'][0]:.1f} at end; dmuon {git_start['head']}"
        f"{'+dirty' if git_start['dmuon_dirty'] else ''} sources {digest_start}"
    )
    print(format_table(rows))
    if hook_rows:
        print()
        print(format_hook_table(hook_rows))
    goals = evaluate_goals(rows)
    if goals.get("checks"):
        print(
            f"\ngoals at N={goals['nproc']}: step <= {GOAL_STEP_RATIO}x AdamW, ledger == plan, "
            f"NS busiest <= {GOAL_NS_BALANCE}x total/N"
        )
        for c in goals["checks"]:
            print(
                f"  {c['size']:<6} {c['variant']:<9} step {c['step_ratio']:.2f}x "
                f"[{'ok' if c['step_ratio_ok'] else 'MISSED'}] (by min {c['step_ratio_min']:.2f}x)  ledger==plan "
                f"[{'ok' if c['ledger_equals_plan'] else 'MISSED'}]  NS max/mean "
                f"{c['ns_busiest_over_mean']:.3f} ({c['cost_model']}) "
                f"[{'ok' if c['ns_balance_ok'] else 'MISSED'}]"
            )
    out = dict(
        machine=info,
        config=dict(
            vars(args),
            sizes_spec={s: SIZES[s] for s in args.sizes},
            muon_hp={k: (list(v) if isinstance(v, tuple) else v) for k, v in MUON_HP.items()},
            adamw_hp={k: (list(v) if isinstance(v, tuple) else v) for k, v in ADAMW_HP.items()},
        ),
        results=rows,
        hook_overhead=hook_rows,
        goals=goals,
        plans=plan_balance(args.sizes, args.nproc),
        calibrations=calibrations,
        wall_s=time.time() - t_start,
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
            f.write("\n")
    if args.png:
        write_png(args.png, rows + hook_rows)
    print(f"\nwall time {out['wall_s']:.0f} s", file=sys.stderr)
    return out


if __name__ == "__main__":
    main()
