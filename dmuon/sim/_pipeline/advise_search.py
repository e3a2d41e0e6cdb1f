r"""``advise``: the fastest dmuon configurations of a model on ``G`` GPUs that fit the device.

:func:`advise` searches pipeline parallelism (``pp``, 1 or 2 stages per rank: 1F1B or
Interleaved1F1B), tensor parallelism (``tp``, dense models, within a node), expert parallelism
(``ep``, MoE models), the data-parallel mesh (``replicate x shard``), dmuon's Z2 / Z3,
activation checkpointing (none, selective, full) and owner groups (off, auto; off only with TP,
which dmuon refuses them with), in three passes:

1. **Memory, analytically.** Every configuration's plans are compiled (one per stage; stages of
   equal shapes once) and its peak per rank computed from them without a timed replay: each
   stage's peak less its activations (:func:`dmuon.sim._pipeline.pp_simulate.stage_memory`), plus
   the activations the schedule holds at once (the pipeline order's in-flight micro-batches), plus
   one boundary's recompute: the same figure :func:`dmuon.sim.simulate_pipeline` reports (both
   call :func:`~dmuon.sim._pipeline.pp_simulate.pipeline_peak_nbytes`). Configurations above the device's memory are
   dropped.
2. **Time, analytically.** The survivors are ranked by :func:`analytic_step_s`: the larger of
   the pipeline replay of their compute (forward, backward, recompute, TP all-reduces, token
   all-to-alls, activation sends) and their data-parallel communication over its link (no
   optimizer).
3. **Time, simulated.** The best layouts by that estimate (about ten configurations:
   Z2 / Z3 x owner groups off / auto of each) are simulated in full, with FSDP2 + AdamW in the same
   layout; the best ``top`` are returned.

The global batch is the same for every configuration: ``tokens_per_rank`` tokens per GPU, so a
pipeline (one data-parallel rank of ``pp x tp`` GPUs) processes ``tokens_per_rank * pp * tp``
tokens per step, in micro-batches of one sequence under pipeline parallelism (torchtitan's
default micro-batch size) and as one micro-batch without.
"""

from __future__ import annotations

import dataclasses
import time
import warnings
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

from torch import nn

from dmuon.plan._model.parallel import expert_parallel_variant, megatron_tp_shard_dims
from dmuon.plan._records.policies import TPPolicy
from dmuon.plan._model.pipeline_split import split_model
from dmuon.plan._cost.stage_bytes import pipeline_cost
from dmuon.plan._records.fields import itemsize_nbytes
from dmuon.plan._stage_plans import compile_stages
from dmuon.sim._engine import alternatives as _alt
from dmuon.sim._engine.hardware import Hardware, collective_s, group_link
from dmuon.sim._engine.lower import _work_s, tp_activation_all_reduce_s
from dmuon.sim._engine.sim_memory import activations_nbytes
from dmuon.sim._engine.workload import from_plan, model_top_k
from dmuon.sim._pipeline.pp_schedule import pipeline_order, replay_pipeline
from dmuon.sim._pipeline.pp_simulate import pipeline_peak_nbytes, send_seconds, simulate_pipeline, stage_memory

__all__ = ["Config", "Candidate", "Advice", "advise", "candidate_configs", "analytic_peak", "analytic_step_s"]


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Config:
    """One configuration of the search (module docstring)."""

    pp: int
    stages_per_rank: int
    tp: int
    ep: int
    replicate: int
    shard: int
    z3: bool
    ac: str
    owner_groups: str
    micro_batches: int

    @property
    def schedule(self) -> str:
        return "1f1b" if self.stages_per_rank == 1 else "interleaved"

    @property
    def layout(self) -> tuple:
        """Everything but Z2/Z3 and owner groups (what the time estimate sees)."""
        return (self.pp, self.stages_per_rank, self.tp, self.ep, self.replicate, self.shard, self.ac)

    def label(self) -> str:
        pp = f"PP {self.pp}" + (f"x{self.stages_per_rank} {self.schedule}" if self.pp > 1 else "")
        par = [pp] + ([f"TP {self.tp}"] if self.tp > 1 else []) + ([f"EP {self.ep}"] if self.ep > 1 else [])
        return (
            f"{', '.join(par)}, dp {self.replicate}x{self.shard}, {'Z3' if self.z3 else 'Z2'}, AC {self.ac}, "
            f"og {self.owner_groups}, M {self.micro_batches}"
        )

    def flags(self) -> str:
        """The ``python -m dmuon simulate`` options of this configuration."""
        mesh = f"{self.replicate}x{self.shard}" if self.replicate > 1 else f"{self.shard}"
        out = f"--mesh {mesh} --mode {'z3' if self.z3 else 'z2'} --ac {self.ac}"
        if self.pp > 1:
            out += f" --pp {self.pp} --microbatches {self.micro_batches} --schedule {self.schedule}"
            if self.stages_per_rank > 1:
                out += f" --stages-per-rank {self.stages_per_rank}"
        if self.tp > 1:
            out += f" --tp {self.tp}"
        if self.ep > 1:
            out += f" --ep {self.ep}"
        if self.owner_groups != "off":
            out += f" --owner-groups {self.owner_groups}"
        return out


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Candidate:
    """A configuration and what the search found: ``fate`` is ``"simulated"``, ``"no_fit"``
    (analytic peak above the device), ``"refused"`` (the split or the plan refuses it, ``reason``)
    or ``"slower"`` (fits, analytic step behind the simulated ones)."""

    config: Config
    fate: str
    peak_nbytes: int = 0
    estimate_s: float = 0.0
    reason: str = ""
    step_s: float = 0.0
    adamw_step_s: float = 0.0
    adamw_peak_nbytes: int = 0
    simulated_peak_nbytes: int = 0
    bound: str = ""

    @property
    def ratio(self) -> float:
        return self.step_s / self.adamw_step_s if self.adamw_step_s else 0.0


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Advice:
    """:func:`advise`'s result: ``best`` (simulated, fastest first), every candidate, the wall and
    CPU seconds the search took."""

    model: str
    gpus: int
    hardware: str
    memory_nbytes: int
    tokens_per_rank: int
    seq_len: int
    best: tuple[Candidate, ...]
    candidates: tuple[Candidate, ...]
    seconds: float
    cpu_seconds: float = 0.0

    def dropped_line(self) -> str:
        """Why the configurations not shown were dropped, in one line."""
        count: dict[str, int] = {}
        for c in self.candidates:
            count[c.fate] = count.get(c.fate, 0) + 1
        sim = [c for c in self.candidates if c.fate == "simulated"]
        shown = len(self.best)
        parts = [f"{count.get('no_fit', 0):,} do not fit ({self.memory_nbytes / 2**30:.0f} GiB, analytic peak)"]
        if count.get("refused"):
            why: dict[str, int] = {}
            for c in self.candidates:
                if c.fate == "refused":
                    why[c.reason] = why.get(c.reason, 0) + 1
            top = max(why, key=lambda r: (why[r], r))
            parts.append(f"{count['refused']:,} refused by the split or the plan (most often: {top[:160]})")
        slow = count.get("slower", 0)
        if slow:
            cut = max((c.estimate_s for c in sim), default=0.0)
            parts.append(
                f"{slow:,} fit but their analytic step is slower than every simulated one (> {1e3 * cut:,.0f} ms)"
            )
        if len(sim) > shown:
            parts.append(f"{len(sim) - shown} simulated and slower than the {shown} shown")
        return f"of {len(self.candidates):,} configurations: " + "; ".join(parts)


def _pow2(n: int, lo: int = 1, hi: int | None = None) -> list[int]:
    """Powers of two from ``lo`` to ``hi`` (default ``n``) that divide ``n``."""
    out, k = [], 1
    while k <= (n if hi is None else min(n, hi)):
        if k >= lo and n % k == 0:
            out.append(k)
        k *= 2
    return out


def candidate_configs(
    gpus: int,
    *,
    num_layers: int,
    num_experts: int,
    tokens_per_rank: int,
    seq_len: int,
    ranks_per_node: int,
    max_pp: int = 32,
) -> list[Config]:
    """The search space (module docstring): ``pp`` a power of two up to ``max_pp`` and half the
    layers, 1 or 2 stages per rank; ``tp`` a power of two up to a node for dense models
    (``num_experts == 0``), ``ep`` a power of two dividing the experts and the shard ranks for MoE
    ones (1, 8 and up); data-parallel ``R x N`` with ``N`` the whole data-parallel group, 64 or
    8 ranks; Z2 / Z3; AC none / selective / full; owner groups off / auto. Micro-batches: one
    sequence each under PP (at least ``pp`` of them, else the configuration is left out), one
    without."""
    out = []
    for pp in _pow2(gpus, hi=min(max_pp, max(1, num_layers // 2))):
        for V in (1,) if pp == 1 else (1, 2):
            for tp in _pow2(gpus // pp, hi=ranks_per_node) if not num_experts else [1]:
                dp = gpus // (pp * tp)
                tokens = tokens_per_rank * pp * tp
                if pp > 1:
                    if tokens % seq_len:
                        continue
                    M = tokens // seq_len
                    if M < pp or (V > 1 and M % max(1, M // pp)):
                        continue
                else:
                    M = 1
                shards = sorted({dp} | {n for n in (64, 8) if n < dp and dp % n == 0}, reverse=True)
                eps = [1] + ([e for e in _pow2(num_experts, lo=8)] if num_experts else [])
                for N in shards:
                    for ep in eps:
                        if N % ep:
                            continue
                        for z3 in (False, True):
                            for ac in ("none", "selective", "full"):
                                for og in ("off", "auto") if tp == 1 else ("off",):
                                    out.append(
                                        Config(
                                            pp=pp,
                                            stages_per_rank=V,
                                            tp=tp,
                                            ep=ep,
                                            replicate=dp // N,
                                            shard=N,
                                            z3=z3,
                                            ac=ac,
                                            owner_groups=og,
                                            micro_batches=M,
                                        )
                                    )
    return out


class _Layouts:
    """Compiled stages and workloads per configuration, shared across the passes."""

    def __init__(self, builder: Any, hw: Any, tokens_per_rank: int, seq_len: int, top_k: int, param_dtype: str) -> None:
        self.builder, self.hw, self.T, self.seq, self.top_k = builder, hw, tokens_per_rank, seq_len, top_k
        self.param_dtype = param_dtype
        self.plans: dict[tuple, Any] = {}
        self.wls: dict[tuple, list] = {}
        # a stage plan in the other mode (its schedule, rank stats and costs built once), and its
        # bytes per pipelined step: shared by the configurations that differ only in AC or M
        self.modes: dict[tuple[int, bool], Any] = {}
        self.costs: dict[tuple[int, bool, int], Any] = {}
        self.mems: dict[tuple[int, bool], Any] = {}

    def mode_plan(self, p: Any, z3: bool) -> Any:
        """Stage plan ``p`` (one of :meth:`stage_plans`') in Z3 or Z2, one object per mode."""
        if p.reshard_after_forward == z3:
            return p
        key = (id(p), z3)  # p stays alive in self.plans
        hit = self.modes.get(key)
        if hit is None:
            hit = self.modes[key] = dataclasses.replace(p, reshard_after_forward=z3)
        return hit

    def stage_memory(self, p: Any, z3: bool, wl: Any, micro_batches: int) -> Any:
        """:func:`~dmuon.sim._pipeline.pp_simulate.stage_memory` of stage plan ``p`` in that mode
        under workload ``wl``: the rank with the largest peak does not depend on the workload (its
        activations term is every rank's), so the terms are computed once per plan and mode."""
        key = (id(p), z3, micro_batches > 1)
        hit = self.mems.get(key)
        if hit is None:
            hit = self.mems[key] = stage_memory(
                self.mode_plan(p, z3), wl, "z3" if z3 else "z2", micro_batches=micro_batches
            )
        return dataclasses.replace(hit, activations_nbytes=activations_nbytes(wl))

    def stage_cost(self, p: Any, z3: bool, micro_batches: int) -> Any:
        """:func:`dmuon.plan.pipeline_cost` of stage plan ``p`` in that mode."""
        key = (id(p), z3, micro_batches)
        hit = self.costs.get(key)
        if hit is None:
            hit = self.costs[key] = pipeline_cost(self.mode_plan(p, z3), micro_batches)
        return hit

    def stage_plans(self, c: Config) -> Any:
        """One plan per stage (equal stages share one), compiled with Z3; Z2 is the same plan in
        the other mode."""
        key = (c.pp, c.stages_per_rank, c.tp, c.ep, c.replicate, c.shard, c.owner_groups)
        hit = self.plans.get(key)
        if hit is None:
            model = self.builder()
            kw: dict = dict(
                cost_model="ns_flops",
                owner_groups=c.owner_groups,
                mp_policy=SimpleNamespace(param_dtype=self.param_dtype, reduce_dtype="float32"),
            )
            if c.ep > 1:
                model = expert_parallel_variant(model, c.ep)
                kw["ep"] = c.ep
            mesh = (c.replicate, c.shard) if c.replicate > 1 else c.shard
            try:
                if c.tp > 1:
                    kw["tp"] = TPPolicy(size=c.tp, shard_dims=megatron_tp_shard_dims(model))
                hit = compile_stages(
                    model,
                    mesh,
                    pp=c.pp,
                    stages_per_rank=c.stages_per_rank,
                    reuse_equal_stages=True,
                    reshard_after_forward=True,
                    **kw,
                )
            except ValueError as exc:
                hit = exc
            self.plans[key] = hit
        if isinstance(hit, Exception):
            raise hit
        return hit

    def workloads(self, c: Config, sp: Any) -> list:
        key = (c.pp, c.stages_per_rank, c.tp, c.ep, c.replicate, c.shard, c.owner_groups, c.ac)
        hit = self.wls.get(key)
        if hit is None:
            per: dict[int, Any] = {}
            hit = []
            for p in sp.plans:
                if id(p) not in per:
                    per[id(p)] = from_plan(
                        p,
                        tokens_per_rank=self.T * c.pp * c.tp,
                        seq_len=self.seq,
                        micro_batches=c.micro_batches,
                        top_k=self.top_k,
                        ac=c.ac,
                    )
                hit.append(per[id(p)])
            self.wls[key] = hit
        return hit


def analytic_peak(layouts: _Layouts, c: Config) -> tuple[int, ...]:
    """Peak bytes per pipeline rank of ``c`` without a timed replay (module docstring, pass 1)."""
    sp = layouts.stage_plans(c)
    wls = layouts.workloads(c, sp)
    mems: dict[int, Any] = {}
    stage_mem = []
    for p, wl in zip(sp.plans, wls):
        if id(p) not in mems:
            mems[id(p)] = layouts.stage_memory(p, c.z3, wl, c.micro_batches)
        stage_mem.append(mems[id(p)])
    order = pipeline_order(c.schedule, c.pp, c.micro_batches, c.stages_per_rank)
    return pipeline_peak_nbytes(
        sp.split, stage_mem, [w.activation_nbytes for w in wls], [w.recompute_transient_nbytes for w in wls], order
    )


def analytic_step_s(layouts: _Layouts, c: Config) -> float:
    """An estimate of ``c``'s step (module docstring, pass 2): the larger of the pipeline replay
    of its compute (forward, backward, recompute, TP all-reduces, token all-to-alls, activation
    sends) and the busiest stage's data-parallel communication (dmuon's bytes per rank and step,
    :func:`dmuon.plan.pipeline_cost`, over the shard group's link), as if that communication hid
    behind the compute."""
    hw = layouts.hw
    sp = layouts.stage_plans(c)
    wls = layouts.workloads(c, sp)
    dt = hw.compute_dtype
    fwd, bwd, sends = [], [], []
    comm_s = 0.0
    link = group_link(hw, tuple(range(0, c.shard * c.tp, c.tp)))
    for p, wl in zip(sp.plans, wls):
        cost = layouts.stage_cost(p, c.z3, c.micro_batches)
        n = p.world_size * p.tp_size
        per_rank = (
            cost.forward_broadcast_nbytes
            + cost.backward_broadcast_nbytes
            + cost.reduce_nbytes
            + cost.replicate_reduce_nbytes
            + cost.replicate_broadcast_nbytes
        ) / n
        comm_s = max(comm_s, per_rank / link.bandwidth_Bps)
        isz = itemsize_nbytes(wl.activation_dtype)
        tokens = wl.tokens_per_rank // wl.micro_batches
        groups = _alt.ep_groups(p)
        f = _work_s(hw, wl.embed, 1.0, dt, isz) + _work_s(hw, wl.head, 1.0, dt, isz)
        b = _work_s(hw, wl.embed, wl.embed.backward_factor, dt, isz) + _work_s(
            hw, wl.head, wl.head.backward_factor, dt, isz
        )
        for _, w in wl.boundaries:
            ar = 2 * tp_activation_all_reduce_s(hw, p.tp_size, tokens, w.hidden, isz)
            a2a = (
                2 * collective_s(hw, "all_to_all", groups[0], w.dispatch_nbytes)
                if groups and w.dispatch_nbytes
                else 0.0
            )
            f += _work_s(hw, w, 1.0, dt, isz) + ar + a2a
            b += _work_s(hw, w, w.backward_factor, dt, isz) + ar + a2a
            if w.recompute is not None:
                b += _work_s(hw, w.recompute, 1.0, dt, isz) + (ar + a2a if w.recompute_all_to_all else 0.0)
        fwd.append(f)
        bwd.append(b)
        sends.append(
            send_seconds(
                hw,
                c.pp,
                c.replicate * c.shard * c.tp,
                tokens * max((w.hidden for _, w in wl.boundaries), default=0) * isz,
            )
        )
    order = pipeline_order(c.schedule, c.pp, c.micro_batches, c.stages_per_rank)
    return max(replay_pipeline(order, fwd, bwd, send_s=sends).makespan_s, comm_s)


def advise(
    builder: Callable[[], nn.Module],
    gpus: int,
    hw: Hardware,
    *,
    tokens_per_rank: int,
    seq_len: int = 8192,
    name: str = "model",
    top: int = 5,
    simulate_configs: int = 10,
    max_pp: int = 32,
    param_dtype: str = "bfloat16",
) -> Advice:
    """The ``top`` fastest simulated configurations of the model ``builder()`` returns (a meta
    model; called once per layout, since expert parallelism cuts its stacks in place) on
    ``gpus`` GPUs of ``hw`` (module docstring: the search, its passes, the batch). The plans'
    warnings (a stage whose matrices all sit outside the layers, say) are not repeated.

    Raises:
        ValueError: non-positive sizes, or no configuration that fits.
    """
    t0 = (time.perf_counter(), time.process_time())
    if gpus < 1 or tokens_per_rank < 1 or seq_len < 1:
        raise ValueError("advise: gpus, tokens_per_rank and seq_len must be >= 1")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return _advise(
            builder, gpus, hw, tokens_per_rank, seq_len, name, top, simulate_configs, max_pp, param_dtype, t0
        )


def _advise(builder, gpus, hw, tokens_per_rank, seq_len, name, top, simulate_configs, max_pp, param_dtype, t0):
    m = builder()
    num_layers = split_model(m, 1).num_layers
    experts = [int(p.shape[0]) for n, p in m.named_parameters() if p.ndim == 3 and "experts" in n]
    num_experts = min(experts, default=0)
    layouts = _Layouts(builder, hw, tokens_per_rank, seq_len, model_top_k(m), param_dtype)
    configs = candidate_configs(
        gpus,
        num_layers=num_layers,
        num_experts=num_experts,
        tokens_per_rank=tokens_per_rank,
        seq_len=seq_len,
        ranks_per_node=hw.ranks_per_node,
        max_pp=max_pp,
    )
    fates: dict[Config, Candidate] = {}
    fit: list[tuple[float, Config, int]] = []
    for c in configs:
        try:
            peak = max(analytic_peak(layouts, c))
        except ValueError as exc:
            fates[c] = Candidate(config=c, fate="refused", reason=str(exc).splitlines()[0])
            continue
        if hw.memory_nbytes and peak > hw.memory_nbytes:
            fates[c] = Candidate(config=c, fate="no_fit", peak_nbytes=peak)
            continue
        fit.append((analytic_step_s(layouts, c), c, peak))
    fit.sort(key=lambda x: (x[0], x[1].label()))
    chosen_layouts: set[tuple] = set()
    chosen: list[tuple[float, Config, int]] = []
    for est, c, peak in fit:  # the best layouts by the estimate, each with its fitting Z2/Z3 x owner groups
        if c.layout not in chosen_layouts:
            if len(chosen) >= simulate_configs:
                continue
            chosen_layouts.add(c.layout)
        chosen.append((est, c, peak))
    chosen_set = {c for _, c, _ in chosen}
    for est, c, peak in fit:
        if c not in chosen_set:
            fates[c] = Candidate(config=c, fate="slower", peak_nbytes=peak, estimate_s=est)
    adamw: dict[tuple, Any] = {}
    for est, c, peak in chosen:
        sp = layouts.stage_plans(c)
        kw = dict(
            tokens_per_rank=tokens_per_rank * c.pp * c.tp,
            seq_len=seq_len,
            micro_batches=c.micro_batches,
            schedule=c.schedule,
            ac=c.ac,
            top_k=layouts.top_k,
        )
        base = adamw.get(c.layout)
        if base is None:
            base = adamw[c.layout] = simulate_pipeline(sp, hw, variants=("adamw",), **kw)["adamw"]
        v = "z3" if c.z3 else "z2"
        sim = simulate_pipeline(sp, hw, variants=(v,), **kw)[v]
        fates[c] = Candidate(
            config=c,
            fate="simulated",
            peak_nbytes=peak,
            estimate_s=est,
            step_s=sim.step_s,
            adamw_step_s=base.step_s,
            adamw_peak_nbytes=max(base.peak_memory_nbytes),
            simulated_peak_nbytes=max(sim.peak_memory_nbytes),
            bound=sim.bound(),
        )
    sims = sorted((f for f in fates.values() if f.fate == "simulated"), key=lambda f: (f.step_s, f.config.label()))
    if not sims:
        raise ValueError(
            f"advise: no configuration of {name} on {gpus} GPUs fits {hw.memory_nbytes / 2**30:.0f} GiB "
            f"at {tokens_per_rank:,} tokens per GPU"
        )
    return Advice(
        model=name,
        gpus=gpus,
        hardware=hw.name,
        memory_nbytes=hw.memory_nbytes,
        tokens_per_rank=tokens_per_rank,
        seq_len=seq_len,
        best=tuple(sims[:top]),
        candidates=tuple(fates[c] for c in configs),
        seconds=time.perf_counter() - t0[0],
        cpu_seconds=time.process_time() - t0[1],
    )
