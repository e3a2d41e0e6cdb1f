r"""Replay a step schedule on a hardware model: ``simulate(plan, hardware, workload) -> Simulation``.

The replay is the deadlock check's (:mod:`dmuon.plan.scheduling.replay`) with clocks. In the
symmetric form every op of the table is shared by all members of its group and each rank
issues its ops in table order, so walking the table once in order visits every rank's ops in
issue order and every collective's members at the same matched call — the ``i``-th call on a
group is the ``i``-th op of that group in the table, exactly how ``replay`` matches them. A
dmuon schedule is first checked with :meth:`StepSchedule.check` (the same matching, without
clocks), so a schedule that would hang raises :class:`dmuon.plan.ScheduleError` here too.

Each rank has one **thread** (its Python thread and, on GPUs, its compute stream: compute ops
run there one after another) and one **channel** per kind of collective (dmuon's broadcasts,
dmuon's reduces, FSDP2's all-gathers, FSDP2's reduce-scatters / all-reduces, TP, all-to-all),
each running its collectives in order:

* a **collective** costs its members ``issue_s`` on the thread when issued (plus, for FSDP2's,
  ``fsdp2_call_s`` and the copy in / out of its unsharded buffer; for dmuon's on gloo, one
  blocking wait per boundary's broadcasts and per micro-batch's reduces,
  :func:`~dmuon.sim.hardware.blocking_wait_s_at`); it starts when every member
  has issued it, every member's channel is free and its dependencies are done on every member,
  and ends for all members together after :func:`~dmuon.sim.hardware.collective_s`. With
  ``comm_engine="separate"`` (GPUs) a rank issues a collective as soon as the compute op before
  it has *started* (the CPU runs ahead of the device by one op; issue cost off the stream);
  with ``"threads"`` (gloo) issuing occupies the thread, a call that returns only when its
  collective is done holds it until then (every FSDP2 collective, which FSDP2 issues without
  ``async_op``; the naive baseline's ``DTensor.full_tensor()`` gathers), and a compute op that
  runs while the rank's collectives are still in flight (from its start to the end of the
  latest collective the rank issued) is stretched by ``comm_cpu_share``
  (:func:`~dmuon.sim.hardware.comm_cpu_share_at`) times that overlap: gloo's threads share the
  cores.
* a **compute op** (forward, backward, recompute, Newton-Schulz, optimizer) starts when the
  thread is free and its dependencies are done *on that rank* (a rank waits only for the ops it
  takes part in); time between is that rank's communication wait. Durations come from the
  :class:`~dmuon.sim.workload.Workload` and the hardware (module :mod:`dmuon.sim.hardware`),
  multiplied by the processor-sharing factor ``hardware.oversubscription``, per term by the
  busy-node factors (:func:`~dmuon.sim.hardware.busy_factors`), and the forward / backward (the
  compute between the step's blocking collectives) by the step-compute factor of the shard group
  (:func:`~dmuon.sim.hardware.step_compute_factor_at`; 1 on GPU presets).

Added to every schedule (they are not ops of it): the root's work (embeddings before the first
forward of a micro-batch, final norm + ``lm_head`` + loss forward and backward before the first
backward, embedding backward after the last), dmuon's hook calls (``hook_s`` x 2 on each
boundary forward and backward), the Muon update's elementwise work inside each Newton-Schulz
op, and at the end one ``optimizer`` op per rank: AdamW on its FSDP2 shards (all parameters for
``adamw``; the non-dedicated ones otherwise) after its last gradient collective.

No bandwidth contention between channels is modelled (a contention-free replay): concurrent
collectives on one link each get its full bandwidth. Memory is not time-resolved: the peak is
the sum of what is resident between steps, the gradients, the largest transient buffers and the
activations of one micro-batch (:func:`memory`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from dmuon.plan.cost import flops as _flops
from dmuon.plan.cost import memory as _memory
from dmuon.plan.cost import nbytes as _nbytes
from dmuon.plan import rules as _rules
from dmuon.plan.records.fields import itemsize_nbytes
from dmuon.plan.records.owners import OwnerGroup
from dmuon.plan.scheduling.ops import Op, Step
from dmuon.plan.scheduling.step_schedule import StepSchedule
from dmuon.sim import alternatives as _alt
from dmuon.sim.hardware import (OP_COLLECTIVE, Hardware, blocking_wait_s_at, busy_factors, collective_s, comm_cpu_share_at,
                       dtensor_gather_s_at, elementwise_s, fsdp2_call_s_at, matmul_s, ns_batch_factor_at, ns_call_s,
                       ns_mean_dim, step_compute_factor_at, train_activation_s, train_attention_s, train_elementwise_s,
                       train_matmul_s, train_norm_s)
from dmuon.sim.workload import Work, Workload

__all__ = ["VARIANTS", "Interval", "PathStep", "RankTime", "MemoryBreakdown", "Simulation", "simulate",
           "simulate_variants", "memory", "replay_ops"]

#: every variant :func:`simulate_variants` runs
VARIANTS = ("adamw", "naive", "z2", "z3", "all_to_all")

_CHANNEL = {
    "broadcast": "bcast",
    "reduce": "reduce",
    "all_reduce": "tp",
    "all_gather": "tp",
    "fsdp2_all_gather": "fsdp2_ag",
    "fsdp2_reduce_scatter": "fsdp2_rs",
    "fsdp2_all_reduce": "fsdp2_rs",
    "all_to_all": "a2a",
}
_CHANNELS = ("bcast", "reduce", "fsdp2_ag", "fsdp2_rs", "tp", "a2a")


@dataclasses.dataclass(frozen=True, slots=True)
class Interval:
    """One bar of a rank's timeline: ``lane`` is ``"compute"`` or a channel name."""

    start_s: float
    end_s: float
    lane: str
    kind: str
    label: str


@dataclasses.dataclass(frozen=True, slots=True)
class PathStep:
    """One op of the critical path, on ``rank``, and why it could not start earlier."""

    rank: int
    kind: str
    label: str
    start_s: float
    end_s: float


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class MemoryBreakdown:
    """Peak bytes on one rank, by term (:func:`memory`)."""

    parameters_nbytes: int
    gradients_nbytes: int
    optimizer_state_nbytes: int
    transient_nbytes: int
    activations_nbytes: int

    @property
    def peak_nbytes(self) -> int:
        return (self.parameters_nbytes + self.gradients_nbytes + self.optimizer_state_nbytes
                + self.transient_nbytes + self.activations_nbytes)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class RankTime:
    """One rank's step: ``busy_s + comm_wait_s + idle_s == step_s`` of the simulation.

    Attributes:
        busy_s: thread busy (compute and issuing). comm_wait_s: a compute op waiting for a
        collective. idle_s: done, waiting for the step to end (others, or own collectives still
        running: ``tail_comm_s`` of it). ns_s: Newton-Schulz time. exposed_comm_s:
        ``comm_wait_s + tail_comm_s``. memory: :class:`MemoryBreakdown`.
    """

    rank: int
    busy_s: float
    comm_wait_s: float
    idle_s: float
    tail_comm_s: float
    ns_s: float
    end_s: float
    memory: MemoryBreakdown

    @property
    def exposed_comm_s(self) -> float:
        return self.comm_wait_s + self.tail_comm_s


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Simulation:
    """The simulated step.

    Attributes:
        variant: ``"z2"`` / ``"z3"`` (dmuon), ``"adamw"``, ``"naive"``, ``"all_to_all"``, or a
            caller's label. hardware: the record's name.
        step_s: the slowest rank's end.
        ranks: per-rank :class:`RankTime` (schedule-rank order).
        exposed_comm_s: communication the critical rank waited for (its ``exposed_comm_s``).
        ns_s: Newton-Schulz seconds of the busiest rank; ns_share: ``ns_s / step_s``.
        critical_rank: the rank that ends last; critical_op: the last op of the critical path.
        critical_path: :class:`PathStep` records, first to last.
        timelines: ``{rank: (Interval, ...)}`` for the ranks asked for.
        comm_nbytes: bytes on the wire per step, summed over ranks (accounting of
            docs/planning.md; FSDP2's included).
        deferred_comm_s: HSDP with ``replicate_async``: how far the replicate broadcasts run
            past ``step_s`` (they are waited for before the next step's broadcast of their
            boundary, so they must hide behind the next forward; not in ``step_s``).
    """

    variant: str
    hardware: str
    step_s: float
    ranks: tuple[RankTime, ...]
    exposed_comm_s: float
    ns_s: float
    critical_rank: int
    critical_op: str
    critical_path: tuple[PathStep, ...]
    timelines: dict[int, tuple[Interval, ...]] = dataclasses.field(compare=False)
    comm_nbytes: int
    deferred_comm_s: float = 0.0

    @property
    def ns_share(self) -> float:
        return self.ns_s / self.step_s if self.step_s else 0.0

    @property
    def peak_memory_nbytes(self) -> tuple[int, ...]:
        return tuple(r.memory.peak_nbytes for r in self.ranks)

    def path_seconds(self) -> dict[str, float]:
        """Seconds of the critical path by op kind."""
        out: dict[str, float] = {}
        for p in self.critical_path:
            out[p.kind] = out.get(p.kind, 0.0) + p.end_s - p.start_s
        return out

    def summary(self) -> str:
        busy = max(self.ranks, key=lambda r: r.end_s)
        path = ", ".join(f"{k} {1e3 * v:.1f}" for k, v in sorted(self.path_seconds().items(), key=lambda kv: -kv[1])[:5])
        return (f"{self.variant}: step {1e3 * self.step_s:.2f} ms on {self.hardware}; critical rank {self.critical_rank} "
                f"(busy {1e3 * busy.busy_s:.2f}, comm wait {1e3 * busy.comm_wait_s:.2f}, idle {1e3 * busy.idle_s:.2f} ms); "
                f"exposed comm {1e3 * self.exposed_comm_s:.2f} ms; NS {1e3 * self.ns_s:.2f} ms ({100 * self.ns_share:.1f} %); "
                f"peak memory {max(self.peak_memory_nbytes) / 2**30:.2f} GiB; critical path ms: {path}")


# ----------------------------------------------------------------------------------- lowering


@dataclasses.dataclass(slots=True)
class _SimOp:
    kind: str
    label: str
    group: tuple[int, ...]
    deps: tuple[int, ...]
    collective: bool
    seconds: Any  # collective: float; local: float or np.ndarray aligned with group
    host_s: float = 0.0
    channel: str = ""
    ns: bool = False
    deferred: bool = False  # HSDP replicate broadcast with replicate_async: waited for in the next step


def _work_s(hw: Hardware, w: Work, factor: float, dtype: str, itemsize: int) -> float:
    """Seconds of ``factor`` x the forward of ``w``: matmuls at the training-matmul efficiency
    (:func:`~dmuon.sim.hardware.train_matmul_s`), attention
    (:func:`~dmuon.sim.hardware.train_attention_s`), norms and the activation function
    (:func:`~dmuon.sim.hardware.train_norm_s`, :func:`~dmuon.sim.hardware.train_activation_s`),
    the other elementwise bytes and operators with autograd; the first two times the busy-node
    matmul factor, the rest times the memory factor (:func:`~dmuon.sim.hardware.busy_factors`)."""
    busy_c, busy_m = busy_factors(hw)
    t_c = sum(train_matmul_s(hw, f, d, dtype) for f, d in w.matmuls)
    t_c += train_attention_s(hw, w.attention_flops, w.attention_d, w.attention_head_d, dtype)
    t_m = train_norm_s(hw, w.norm_numel, itemsize) + train_activation_s(hw, w.activation_numel, itemsize)
    t_m += train_elementwise_s(hw, w.elementwise_nbytes, w.ops)
    return factor * (busy_c * t_c + busy_m * t_m)


def _ns_s(hw: Hardware, wl: Workload, spec: Any, flops: int, batch_factor: float = 1.0,
          backend: str = "standard", numel: int | None = None) -> float:
    """One matrix's Muon update: the Newton-Schulz call (calibrated as a whole where the record has
    ``ns_efficiency`` — on the Gram curve for ``backend="gram"``,
    :func:`~dmuon.sim.hardware.ns_call_s` — else its matmuls on the plain curve plus its norm / axpy passes) times
    ``batch_factor`` (its share of a batched call, :func:`_ns_batch_factors`), and the update's
    elementwise work (momentum, Nesterov, decay, apply: 6 passes, ``muon_ops_per_matrix``);
    matmuls times the busy-node matmul factor, passes times the memory factor. ``numel``: the
    elements the op updates (default ``spec.local_numel``; an expert stack's range op: its share,
    :func:`_op_numel`)."""
    isz = itemsize_nbytes(spec.dtype)
    numel = spec.local_numel if numel is None else numel
    busy_c, busy_m = busy_factors(hw)
    update = busy_m * elementwise_s(hw, 6 * numel * isz, wl.muon_ops_per_matrix)
    d = ns_mean_dim(*spec.matrix_shape)
    if hw.ns_efficiency:
        return busy_c * ns_call_s(hw, flops, d, backend) * batch_factor + update
    mm = matmul_s(hw, flops, d, hw.ns_dtype)
    passes = elementwise_s(hw, 2 * _rules.NS_STEPS * numel * itemsize_nbytes(hw.ns_dtype),
                           wl.ns_ops_per_step * _rules.NS_STEPS)
    return (busy_c * mm + busy_m * passes) * batch_factor + update


def _op_numel(spec: Any, flops: int) -> int:
    """Elements a Newton-Schulz op of ``spec`` updates: the whole parameter, or for an expert
    stack's op over one owner's range of experts (its FLOPs a share of the stack's), that share
    of the stack's elements (every expert of a stack has the same size)."""
    if spec.experts is None:
        return spec.local_numel
    total = _flops.spec_ns_flops(spec)
    return spec.local_numel if total <= 0 or flops >= total else spec.local_numel * flops // total


def _owner_group_fqns(plan: Any) -> set[str]:
    """The plan's matrices owned by an owner group (sharded Gram NS on its members)."""
    return {spec.fqn for spec, owner in zip(plan.params, plan.owners) if isinstance(owner, OwnerGroup)}


def _ns_backend(spec: Any, grouped: set[str]) -> str:
    """The Newton-Schulz a dmuon matrix's update runs, ``"gram"`` or ``"standard"``: Gram for the
    plan's ``ns_backend="gram"`` matrices, TP-sharded ones with ``tp_ns="gram"`` and owner-group
    matrices (``grouped``; sharded Gram NS, :mod:`dmuon.exec.optim.tp_orthogonalize`)."""
    gram = spec.ns_backend == "gram" or (spec.tp_size > 1 and spec.tp_ns == "gram") or spec.fqn in grouped
    return "gram" if gram else "standard"


def _ns_batch_factors(ops: Sequence[Op], specs: dict[str, Any], grouped: set[str], hw: Hardware,
                      variant: str) -> dict[int, float]:
    """Op id -> the per-matrix factor of the batched NS call its matrices run in
    (:func:`~dmuon.sim.hardware.ns_batch_factor_at`; ops not listed: 1).

    ``dmuon.Muon`` (and the naive baseline, which batches as it does) runs fp32 / fp64 NS per
    bucket: on each rank, the matrices it orthogonalises with the same ``(short, long)`` side and
    dtype, in parameter order, cut into calls by :func:`dmuon.plan.rules.ns_batch_runs` (a view's
    blocks enter one by one, an expert stack as its ``E`` matrices; the optimizer buckets per param
    group, the simulator assumes one Muon param group). Here a bucket is keyed by the
    op's group (its members run the same calls), so each matrix gets the batch size of its call; an
    op whose matrices fall in several calls gets their factors weighted by NS FLOPs (``specs``: fqn ->
    spec; ``grouped``: :func:`_owner_group_fqns`). The TP and
    owner-group paths (Gram buckets, gathered TP matrices) and dion's all-to-all (one matrix per
    owner per batch) are not batched this way: factor 1."""
    if variant not in ("z2", "z3", "naive") or not hw.ns_batch_factor or hw.ns_dtype not in _rules.NS_BATCHED_DTYPES:
        return {}
    buckets: dict[tuple, list[tuple[int, int, int, int, int]]] = {}  # key -> [(op id, a, b, count, numel)]
    for op in ops:
        if op.kind != "newton_schulz":
            continue
        spec = specs[op.fqns[0]]
        if spec.tp_size > 1 or spec.fqn in grouped:
            continue
        if spec.experts is not None and spec.view is None:  # an op covers one owner's range of experts
            total = _flops.spec_ns_flops(spec)
            count = spec.num_matrices if total <= 0 else max(1, round(spec.num_matrices * op.flops / total))
            entries = [(tuple(spec.matrix_shape), count)]
        elif spec.view is None:
            entries = [(tuple(spec.matrix_shape), spec.num_matrices)]
        else:
            entries = [(block, 1) for block in spec.matrices]
        for (m, n), count in entries:
            a, b = _rules.ns_bucket_sides(m, n)
            buckets.setdefault((op.group, a, b, spec.dtype), []).append((op.id, a, b, count, count * a * b))
    weighted: dict[int, list[float]] = {}  # op id -> [sum of flops x factor, sum of flops]
    for entries in buckets.values():
        for run in _rules.ns_batch_runs([e[4] for e in entries]):
            batch = sum(entries[i][3] for i in run)
            for i in run:
                op_id, a, b, count, _ = entries[i]
                f = _flops.ns_flops(a, b, num_matrices=count)
                acc = weighted.setdefault(op_id, [0.0, 0.0])
                acc[0] += f * ns_batch_factor_at(hw, ns_mean_dim(a, b), batch)
                acc[1] += f
    return {i: num / den for i, (num, den) in weighted.items() if den > 0}


def _adamw_s(hw: Hardware, wl: Workload, tensors: Sequence[tuple[int, int]], dtensor: bool) -> float:
    """AdamW over ``(numel, itemsize)`` tensors: 7 accesses per element (read p, g, m, v; write
    p, m, v), ``adamw_ops_per_tensor`` operators each, plus DTensor dispatch per operator."""
    nbytes = sum(7 * n * isz for n, isz in tensors)
    ops = wl.adamw_ops_per_tensor * len(tensors)
    return busy_factors(hw)[1] * (elementwise_s(hw, nbytes, ops) + (ops * hw.dtensor_op_s if dtensor else 0.0))


def _lower(ops: Sequence[Op], plan: Any, hw: Hardware, wl: Workload, *, variant: str, num_ranks: int) -> list[_SimOp]:
    """Schedule ops -> simulator ops, with the root's work, hooks and the optimizer added."""
    dtype = hw.compute_dtype
    N = plan.mesh_shape[1]
    dmuon = variant in ("z2", "z3")
    over = hw.oversubscription
    busy_m = busy_factors(hw)[1]
    # forward / backward compute between the step's blocking collectives (shard groups of N)
    step_f = over * step_compute_factor_at(hw, N)
    work = dict(wl.boundaries)
    isz = itemsize_nbytes(wl.activation_dtype)
    fwd_s = {f: _work_s(hw, w, 1.0, dtype, isz) * step_f for f, w in work.items()}
    bwd_s = {f: _work_s(hw, w, w.backward_factor, dtype, isz) * step_f for f, w in work.items()}
    embed_f = _work_s(hw, wl.embed, 1.0, dtype, isz) * step_f
    embed_b = _work_s(hw, wl.embed, wl.embed.backward_factor, dtype, isz) * step_f
    head = _work_s(hw, wl.head, 1.0 + wl.head.backward_factor, dtype, isz) * step_f
    hook = 2 * hw.hook_s if dmuon else 0.0
    boundary_nbytes = {b.fqn: sum(buf.numel * itemsize_nbytes(buf.dtype) for buf in b.buffers) for b in plan.boundaries}
    specs = {s.fqn: s for s in plan.params}
    everyone = tuple(range(num_ranks))
    out: list[_SimOp] = []
    remap: dict[int, int] = {}
    root_ag: dict[int, list[int]] = {}
    first_fwd: set[int] = set()
    first_bwd: set[int] = set()
    last_bwd: dict[int, int] = {}
    for op in ops:
        if op.kind == "backward":
            last_bwd[op.micro_batch] = op.id
    grad_colls: list[int] = []
    coll_cache: dict = {}
    waited: set[tuple] = set()
    grouped = _owner_group_fqns(plan)
    batch_factors = _ns_batch_factors(ops, specs, grouped, hw, variant)
    for op in ops:
        mb = op.micro_batch
        if op.kind == "forward" and mb not in first_fwd:
            first_fwd.add(mb)
            out.append(_SimOp("forward", "embed", everyone, tuple(root_ag.get(mb, ())), False, embed_f))
        if op.kind in ("backward", "recompute") and mb not in first_bwd:
            first_bwd.add(mb)
            out.append(_SimOp("backward", "head", everyone, tuple(root_ag.get(mb, ())), False, head))
        deps = tuple(map(remap.__getitem__, op.deps))
        kind = op.kind
        if kind in OP_COLLECTIVE:
            nbytes = op.nbytes
            k = len(op.group)
            key = (kind, op.group, nbytes)
            secs = coll_cache.get(key)
            if secs is None:
                secs = coll_cache[key] = collective_s(hw, OP_COLLECTIVE[kind], op.group, nbytes)
            host = hw.issue_s
            if kind.startswith("fsdp2_"):
                host += fsdp2_call_s_at(hw, k) + elementwise_s(hw, 2 * k * nbytes, 1)  # copy-out / copy-in
            elif dmuon and kind in ("broadcast", "reduce", "all_reduce"):
                # the runtime blocks once per boundary's broadcasts (before its forward / backward)
                # and once per micro-batch on its reduces (finish_reduces); the reduce packing is charged
                # with the boundary's backward, below
                wait_key = (op.phase, op.boundary, mb) if kind != "reduce" else ("reduce", mb)
                if wait_key not in waited:
                    waited.add(wait_key)
                    host += blocking_wait_s_at(hw, k)
            elif kind == "all_to_all":
                host += elementwise_s(hw, 2 * nbytes, 2)
            elif kind == "all_gather" and variant == "naive":  # DTensor.full_tensor() + redistribute back
                host += dtensor_gather_s_at(hw, k)
            label = f"{op.phase} {op.boundary or ''}".strip()
            s = _SimOp(kind, label, op.group, deps, True, secs, host, _CHANNEL[kind],
                       deferred=op.phase == "replicate_broadcast" and plan.replicate_async)
            if kind == "fsdp2_all_gather" and op.boundary == "":
                root_ag.setdefault(mb, []).append(len(out))
            if kind in ("fsdp2_reduce_scatter", "fsdp2_all_reduce") or (kind == "all_to_all" and variant == "all_to_all"):
                grad_colls.append(len(out))
        elif kind in ("forward", "backward", "recompute"):
            b = op.boundary
            secs = (fwd_s[b] if kind != "backward" else bwd_s[b]) + hook
            if kind == "backward" and dmuon:
                secs += elementwise_s(hw, 2 * boundary_nbytes.get(b, 0), 2) * busy_m * over  # packing
            s = _SimOp(kind, b or "", op.group, deps, False, secs)
        elif kind == "newton_schulz":
            spec = specs[op.fqns[0]]
            backend = _ns_backend(spec, grouped) if dmuon else "standard"  # the baselines: torch's iteration
            secs = _ns_s(hw, wl, spec, op.flops, batch_factors.get(op.id, 1.0), backend, _op_numel(spec, op.flops)) * over
            if not dmuon:  # FSDP2 shards: DTensor dispatch of the update's operators
                secs += wl.muon_ops_per_matrix * hw.dtensor_op_s * over
            s = _SimOp(kind, op.fqns[0], op.group, deps, False, secs, ns=True)
        else:
            raise ValueError(f"dmuon.sim: cannot simulate op kind {kind!r} ({op.describe()})")
        remap[op.id] = len(out)
        out.append(s)
        if hw.comm_engine == "threads" and (kind.startswith("fsdp2_") or (kind == "all_gather" and variant == "naive")):
            # Calls that return only when the collective is done, on gloo: every FSDP2 collective
            # (its all-gathers, prefetches included — unshard_async_op is off — and its gradient
            # reduce-scatter / all-reduce in the post-backward hook are issued without async_op;
            # on GPUs streams run them beside the compute) and DTensor.full_tensor() (the naive
            # baseline's gather: every gather precedes the first NS, as in its step). NCCL only
            # makes the compute stream wait, which the deps express.
            out.append(_SimOp("wait", s.label, op.group, (len(out) - 1,), False, 0.0))
        if op.kind == "backward" and last_bwd.get(mb) == op.id:
            out.append(_SimOp("backward", "embed", everyone, (len(out) - 1,), False, embed_b))
    # the optimizer: AdamW on this rank's FSDP2 shards (DTensors), after its gradient collectives
    tensors: list[tuple[int, int]] = []
    for u in plan.fsdp2_units:
        for shape, dt, g in zip(u.shapes, u.dtypes, u.requires_grad):
            if g:
                tensors.append((_nbytes.fsdp2_shard_numel(shape, N), itemsize_nbytes(dt)))
    if variant == "adamw":  # naive / all_to_all: Muon's elementwise work on the shards is in the NS ops
        tensors += [(_nbytes.fsdp2_shard_numel(s.local_shape, N), itemsize_nbytes(s.dtype)) for s in plan.params]
    out.append(_SimOp("optimizer", "adamw", everyone, tuple(grad_colls), False, _adamw_s(hw, wl, tensors, True) * over))
    return out


# ----------------------------------------------------------------------------------- engine


def replay_ops(sim_ops: list[_SimOp], num_ranks: int, hw: Hardware, *, timeline_ranks: Sequence[int] = ()) -> dict:
    """Clocked replay of lowered ops in table order (module docstring). Returns raw arrays."""
    n = num_ranks
    neg = -np.inf
    host = np.zeros(n)  # thread free
    cstart = np.zeros(n)  # start of the latest compute op (separate engines issue from there)
    issued = np.zeros(n)  # latest issue time (separate engines)
    chan = {c: np.zeros(n) for c in _CHANNELS}
    chan_op = {c: np.full(n, -1, dtype=np.int64) for c in _CHANNELS}
    host_op = np.full(n, -1, dtype=np.int64)
    comm_end = np.zeros(n)  # end of the rank's last collective that the step waits for
    comm_end_op = np.full(n, -1, dtype=np.int64)
    deferred_end = np.zeros(n)
    busy = np.zeros(n)
    wait = np.zeros(n)
    ns = np.zeros(n)
    comm_busy = np.zeros(n)  # end of the latest collective issued by each rank (its CPU share)
    threads = hw.comm_engine == "threads"
    share = comm_cpu_share_at(hw) if threads else 0.0
    tl_mask = np.zeros(n, dtype=bool)
    tl = [r for r in timeline_ranks if 0 <= r < n]
    tl_mask[tl] = True
    timelines: dict[int, list[Interval]] = {r: [] for r in tl}
    m = len(sim_ops)
    end_scalar = np.full(m, neg)
    start_scalar = np.full(m, neg)
    end_vec: dict[int, np.ndarray] = {}
    start_vec: dict[int, np.ndarray] = {}
    pred: dict[int, Any] = {}  # collective: (op, rank); local: (pred op array n, pred rank array n)

    # Groups are interned once: ``gid[i]`` names op i's group, ``garr[g]`` its global ranks.
    # Hashing a rank tuple costs O(group size), so everything below is keyed by group id.
    gids: dict[tuple[int, ...], int] = {}
    gid = [gids.setdefault(op.group, len(gids)) for op in sim_ops]
    garr = [np.asarray(g, dtype=np.int64) for g in gids]
    overlap_cache: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}
    pattern_cache: dict[tuple, tuple] = {}
    # dep_ready is a function of (group, deps) once the deps are replayed (they precede the op),
    # so ops with the same deps on the same group (e.g. the naive baseline's all-gathers of every
    # matrix of a unit, row by row) read them once; the arrays returned are never written to
    ready_cache: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}
    is_coll = [op.collective for op in sim_ops]
    sgid = [g if c else ~g for g, c in zip(gid, is_coll)]  # ~: a local op's group
    spans_all = [c and len(garr[g]) == n for g, c in zip(gid, is_coll)]

    def overlap(dep_g: int, g: int) -> tuple[np.ndarray, np.ndarray]:
        """(positions in group ``g``, global ranks) of the members ``g`` shares with ``dep_g``."""
        hit = overlap_cache.get((dep_g, g))
        if hit is None:
            pos = np.full(n, -1, dtype=np.int64)
            pos[garr[g]] = np.arange(len(garr[g]))
            p = pos[garr[dep_g]]
            keep = p >= 0
            hit = overlap_cache[(dep_g, g)] = (p[keep], garr[dep_g][keep])
        return hit

    def pattern(g: int, vec: list[int]) -> tuple:
        """The flattened (member position, dep order, local-dep slices) of ``vec``'s deps as seen
        from group ``g``; the same for every op whose deps sit on the same groups (every layer)."""
        key = (g, tuple(map(sgid.__getitem__, vec)))
        hit = pattern_cache.get(key)
        if hit is None:
            cols, rows, counts, local = [], [], [], []
            at = 0
            for j, d in enumerate(vec):
                pos, ranks = overlap(gid[d], g)
                cols.append(pos)
                rows.append(np.full(len(pos), j, dtype=np.int64))
                counts.append(len(pos))
                if not is_coll[d]:
                    local.append((j, at, at + len(pos), ranks))
                at += len(pos)
            cols_a, rows_a = np.concatenate(cols), np.concatenate(rows)
            # every member reached by exactly one dep (e.g. a replicate all-reduce after the
            # reduce-scatters of its rows): the dep of each member, in member order
            one = None
            if len(cols_a) == len(garr[g]) and not local and len(np.unique(cols_a)) == len(cols_a):
                one = rows_a[np.argsort(cols_a)]
            hit = pattern_cache[key] = (cols_a, rows_a, np.asarray(counts), local, one)
        return hit

    def dep_ready(deps, i, G):
        """(ready per member of op ``i``, dep index per member or -1): the latest end among the
        deps each member takes part in; on ties the first dep in ``deps`` order wins (a
        collective on the op's own group, or on every rank, counts as one scalar read first).
        The other deps are read in one pass: every (dep, shared member) pair flattened, the max
        per member by ``np.maximum.at``, the first dep reaching it by ``np.minimum.at``."""
        g = gid[i]
        hit = ready_cache.get((g, deps))
        if hit is not None:
            return hit
        sbest, swho = neg, -1
        vec = []
        for d in deps:
            if spans_all[d] or (is_coll[d] and gid[d] == g):
                e = end_scalar[d]
                if e > sbest:
                    sbest, swho = e, d
            else:
                vec.append(d)
        k = len(G)
        if not vec:
            hit = ready_cache[(g, deps)] = (np.full(k, sbest), np.full(k, swho, dtype=np.int64))
            return hit
        cols, rows, counts, local, one = pattern(g, vec)
        vec_arr = np.asarray(vec, dtype=np.int64)
        if one is not None:  # no ties to break: each member's dep is read directly
            mine = vec_arr[one]
            top = end_scalar[mine]
            better = top > sbest
            hit = ready_cache[(g, deps)] = (np.where(better, top, sbest), np.where(better, mine, swho))
            return hit
        vals = np.repeat(end_scalar[vec_arr], counts)
        for j, a, b, ranks in local:
            vals[a:b] = end_vec[vec[j]][ranks]
        top = np.full(k, neg)
        np.maximum.at(top, cols, vals)
        win = vals == top[cols]
        first = np.full(k, len(vec), dtype=np.int64)
        np.minimum.at(first, cols[win], rows[win])
        better = top > sbest
        best = np.where(better, top, sbest)
        who = np.where(better, np.append(vec_arr, -1)[first], swho)
        hit = ready_cache[(g, deps)] = (best, who)
        return hit

    for i, op in enumerate(sim_ops):
        G = garr[gid[i]]
        if op.collective:
            if threads:
                host[G] += op.host_s
                busy[G] += op.host_s
                issue = host[G]
            else:
                issued[G] = np.maximum(cstart[G], issued[G]) + op.host_s
                issue = issued[G]
            c = op.channel
            free = chan[c][G]
            a, b = int(issue.argmax()), int(free.argmax())
            j_issue, j_chan = int(G[a]), int(G[b])
            cand_t = [issue[a], free[b]]
            cand_p = [(int(host_op[j_issue]), j_issue), (int(chan_op[c][j_chan]), j_chan)]
            if op.deps:
                dr, who = dep_ready(op.deps, i, G)
                k = int(dr.argmax())
                cand_t.append(dr[k])
                cand_p.append((int(who[k]), int(G[k])))
            k = max(range(len(cand_t)), key=cand_t.__getitem__)  # the first of the latest, as np.argmax
            start = max(0.0, float(cand_t[k]))
            end = start + float(op.seconds)
            pred[i] = cand_p[k] if cand_t[k] > 0 else (-1, -1)
            start_scalar[i] = start
            end_scalar[i] = end
            chan[c][G] = end
            chan_op[c][G] = i
            if op.deferred:
                deferred_end[G] = np.maximum(deferred_end[G], end)
            else:
                later = G[comm_end[G] < end]
                comm_end[later] = end
                comm_end_op[later] = i
            if share:
                comm_busy[G] = np.maximum(comm_busy[G], end)
            if tl:
                for x in G[tl_mask[G]]:
                    timelines[int(x)].append(Interval(start, end, c, op.kind, op.label))
        else:
            dur = op.seconds
            h = host[G]
            if op.deps:
                dr, who = dep_ready(op.deps, i, G)
                start = np.maximum(h, dr)
                from_dep = dr > h
            else:
                start = h.copy()
                from_dep = np.zeros(len(G), dtype=bool)
                who = np.full(len(G), -1, dtype=np.int64)
            if share:  # gloo's threads take their share of the part of the op the rank's collectives overlap
                dur = dur + share * np.clip(np.minimum(comm_busy[G], start + dur) - start, 0.0, None)
            wait[G] += start - h
            end = start + dur
            busy[G] += dur
            if op.ns:
                ns[G] += dur
            pv = np.where(from_dep, who, host_op[G])
            full_end = np.full(n, neg)
            full_end[G] = end
            full_start = np.full(n, neg)
            full_start[G] = start
            end_vec[i] = full_end
            start_vec[i] = full_start
            pa = np.full(n, -1, dtype=np.int64)
            pa[G] = pv
            pred[i] = pa
            host[G] = end
            cstart[G] = start
            host_op[G] = i
            if tl:
                for x in G[tl_mask[G]]:
                    p = int(np.searchsorted(G, x)) if len(G) > 1 else 0
                    s0 = float(start[p]) if np.ndim(start) else float(start)
                    e0 = float(end[p]) if np.ndim(end) else float(end)
                    timelines[int(x)].append(Interval(s0, e0, "compute", op.kind, op.label))
    rank_end = np.maximum(host, comm_end)
    return dict(host=host, chan_end=comm_end, comm_end_op=comm_end_op, deferred_end=deferred_end, rank_end=rank_end, busy=busy, wait=wait, ns=ns, pred=pred,
                end_scalar=end_scalar, start_scalar=start_scalar, end_vec=end_vec, start_vec=start_vec,
                timelines={r: tuple(v) for r, v in timelines.items()}, chan_op=chan_op, host_op=host_op, chan=chan)


def _critical_path(sim_ops: list[_SimOp], raw: dict) -> tuple[int, list[PathStep]]:
    rank_end = raw["rank_end"]
    r = int(np.argmax(rank_end))
    # the last op on that rank: its thread's, or a channel's if that ends later
    cands = [(raw["host"][r], int(raw["host_op"][r])), (raw["chan_end"][r], int(raw["comm_end_op"][r]))]
    _, i = max(cands)
    steps: list[PathStep] = []
    seen = 0
    while i >= 0 and seen < 10_000_000:
        seen += 1
        op = sim_ops[i]
        if op.collective:  # shown on the member that arrived last (the one it waited for)
            s, e = float(raw["start_scalar"][i]), float(raw["end_scalar"][i])
            nxt, nr = raw["pred"][i]
            r = int(nr) if nr >= 0 else r
        else:
            s, e = float(raw["start_vec"][i][r]), float(raw["end_vec"][i][r])
            nxt, nr = int(raw["pred"][i][r]), r
        steps.append(PathStep(rank=r, kind=op.kind, label=op.label, start_s=s, end_s=e))
        i, r = int(nxt), int(nr) if nr >= 0 else r
    steps.reverse()
    return int(np.argmax(rank_end)), steps


# ----------------------------------------------------------------------------------- memory


def memory(plan: Any, workload: Workload, variant: str, sched: StepSchedule | None = None) -> tuple[MemoryBreakdown, ...]:
    """Peak memory per rank, by term (storage dtypes; the activation dtype for activations).

    ``z2`` / ``z3`` (dmuon): parameters = owned masters (+ HSDP replicas held,
    ``RankStats.resident_nbytes`` less momentum) + FSDP2 shards of the rest; gradients = full
    gradients of owned matrices + FSDP2 gradient shards; optimizer state = Muon momentum of
    owned matrices + AdamW's two moments of the shards; transient = the packed buffers
    (``RankStats.peak_transient_nbytes``: Z3 the largest boundary, Z2 all of them) + one
    boundary's gradient reduce buffer + the largest FSDP2 unit unsharded (Z2: all units).
    ``adamw`` / ``naive`` / ``all_to_all``: FSDP2 shards of every parameter, their gradients,
    AdamW moments (or Muon momentum for the matrices), the largest unit unsharded with its
    unsharded gradient (Z2: every unit's parameters); ``naive`` adds every full Muon update
    gathered at once (its step gathers all before the NS); ``all_to_all`` adds two matrices'
    worth of each owned batch (received shards + result). Activations: one micro-batch's
    (:attr:`Workload.activation_nbytes`).
    """
    R, N = plan.mesh_shape
    T = plan.tp_size if variant in ("z2", "z3") else 1
    n = R * N * T
    act = workload.activation_nbytes
    unit_full: dict[str, int] = {}
    shard_rest = 0
    for u in plan.fsdp2_units:
        full = 0
        for shape, dt in zip(u.shapes, u.dtypes):
            isz = itemsize_nbytes(dt)
            full += math.prod(shape) * isz
            shard_rest += _nbytes.fsdp2_shard_numel(shape, N) * isz
        unit_full[u.fqn] = unit_full.get(u.fqn, 0) + full
    if variant in ("z2", "z3"):
        if sched is None:
            stats = plan.rank_stats()
        else:  # the same figures from a schedule already built (plan.rank_stats() builds its own)
            stats = _memory.rank_stats(plan.params, plan.owners, sched, _nbytes.schedule_byte_cost(sched),
                                     mesh_shape=plan.mesh_shape, reshard_after_forward=plan.reshard_after_forward,
                                     tp_size=plan.tp_size, assembled_nbytes=plan.assembled_nbytes)
        z3 = plan.reshard_after_forward
        fsdp_unsharded = max(unit_full.values(), default=0) if z3 else sum(unit_full.values())
        reduce_buf = max((sum(buf.numel * itemsize_nbytes(buf.dtype) for buf in b.buffers) for b in plan.boundaries),
                         default=0)
        out = []
        for st in stats:
            momentum = st.owned_nbytes
            out.append(MemoryBreakdown(
                parameters_nbytes=st.resident_nbytes - momentum + shard_rest,
                gradients_nbytes=st.owned_nbytes + shard_rest,
                optimizer_state_nbytes=momentum + 2 * shard_rest,
                transient_nbytes=st.peak_transient_nbytes + reduce_buf + fsdp_unsharded,
                activations_nbytes=act,
            ))
        return tuple(out)
    muon_shard = sum(_nbytes.fsdp2_shard_numel(s.local_shape, N) * itemsize_nbytes(s.dtype) for s in plan.params)
    muon_full = sum(s.local_numel * itemsize_nbytes(s.dtype) for s in plan.params)
    for s in plan.params:
        b = plan.boundary(s.fqn)
        unit_full[b] = unit_full.get(b, 0) + s.local_numel * itemsize_nbytes(s.dtype)
    z3 = True if variant == "adamw" else plan.reshard_after_forward
    largest = max(unit_full.values(), default=0)
    unsharded = largest if z3 else sum(unit_full.values())
    transient = unsharded + largest  # + one unit's unsharded gradient before its reduce-scatter
    if variant == "naive":
        transient = max(transient, muon_full + largest)
    elif variant == "all_to_all":
        transient += 2 * (muon_full // max(N, 1))
    state = 2 * shard_rest + (2 * muon_shard if variant == "adamw" else muon_shard)
    rec = MemoryBreakdown(parameters_nbytes=shard_rest + muon_shard, gradients_nbytes=shard_rest + muon_shard,
                          optimizer_state_nbytes=state, transient_nbytes=transient, activations_nbytes=act)
    return (rec,) * n


# ----------------------------------------------------------------------------------- API


def _variant_ops(plan: Any, variant: str, step: Step | None, early_ns: bool | str) -> tuple[Sequence[Op], int, Any, Any]:
    if variant in ("z2", "z3"):
        want = variant == "z3"
        if plan.reshard_after_forward != want:
            plan = dataclasses.replace(plan, reshard_after_forward=want)
        sched = plan.schedule(step)
        sched.check()
        nominal = sched
        if early_ns:
            from dmuon.sim.variants import early_ns_schedule

            sched = early_ns_schedule(sched, early_replicate_broadcast=early_ns != "ns_only")
        return sched.ops, sched.num_ranks, plan, nominal
    ops = _alt.build(variant, plan, step)
    R, N = plan.mesh_shape
    return ops, R * N, plan, None


def _moved_nbytes(ops: Sequence[Op], num_ranks: int, variant: str) -> int:
    """Bytes on the wire per step summed over ranks: dmuon's collectives by the ledger's rule
    (:func:`dmuon.plan.cost.nbytes.schedule_byte_cost`), FSDP2's and the alternatives' by
    :func:`dmuon.sim.alternatives.moved_nbytes`."""
    if variant in ("z2", "z3"):
        view = _OpsView(tuple(op for op in ops if op.collective), num_ranks)
        dmuon_part = _nbytes.schedule_byte_cost(view).total_nbytes
        return dmuon_part + _alt.moved_nbytes([op for op in ops if op.kind.startswith("fsdp2_")])
    return _alt.moved_nbytes(ops)


class _OpsView:
    """The two attributes :func:`dmuon.plan.cost.nbytes.schedule_byte_cost` reads."""

    def __init__(self, ops: Sequence[Op], n: int) -> None:
        self.ops = ops
        self.num_ranks = n


def simulate(plan: Any, hardware: Hardware, workload: Workload, step: Step | None = None, *,
             variant: str | None = None, early_ns: bool | str = False,
             timeline_ranks: Sequence[int] | None = None) -> Simulation:
    """Simulate one step of ``plan`` (dmuon, with the plan's Z2/Z3) or of an alternative.

    Args:
        plan: a :class:`dmuon.plan.ShardingPlan`; its schedule (``plan.schedule(step)``) is
            checked for deadlock and replayed.
        hardware: a :class:`~dmuon.sim.hardware.Hardware` (a preset, or a calibration).
        workload: :func:`dmuon.sim.workload.from_plan` of the same plan (or a user's).
        step: a :class:`dmuon.plan.Step` (micro-batches, ...); None = the nominal step.
        variant: None = dmuon with the plan's mode; ``"z2"`` / ``"z3"`` = dmuon in that mode;
            ``"adamw"``, ``"naive"``, ``"all_to_all"`` (:mod:`dmuon.sim.alternatives`).
        early_ns: dmuon only: True = the "earlier NS" schedule variant
            (:func:`dmuon.sim.variants.early_ns_schedule`); ``"ns_only"`` = the same with the
            HSDP replicate broadcasts left at the end of the step.
        timeline_ranks: ranks whose timeline to keep (default: all ranks up to 16, else rank 0
            and the last rank).

    Raises:
        ValueError: unknown variant, or an op the simulator cannot time.
        dmuon.plan.ScheduleError: the dmuon schedule would deadlock.
    """
    if variant is None:
        variant = "z3" if plan.reshard_after_forward else "z2"
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}: one of {VARIANTS}")
    ops, n, mode_plan, nominal = _variant_ops(plan, variant, step, early_ns)
    if timeline_ranks is None:
        timeline_ranks = tuple(range(n)) if n <= 16 else (0, n - 1)
    sim_ops = _lower(ops, plan, hardware, workload, variant=variant, num_ranks=n)
    raw = replay_ops(sim_ops, n, hardware, timeline_ranks=timeline_ranks)
    crit, path = _critical_path(sim_ops, raw)
    step_s = float(raw["rank_end"].max())
    mem = memory(mode_plan, workload, variant, sched=nominal if step is None else None)
    ranks = []
    for x in range(n):
        busy, wait = float(raw["busy"][x]), float(raw["wait"][x])
        tail = max(0.0, float(raw["chan_end"][x]) - float(raw["host"][x]))
        ranks.append(RankTime(rank=x, busy_s=busy, comm_wait_s=wait, idle_s=max(0.0, step_s - busy - wait),
                              tail_comm_s=tail, ns_s=float(raw["ns"][x]), end_s=float(raw["rank_end"][x]),
                              memory=mem[x]))
    last = path[-1] if path else PathStep(rank=crit, kind="", label="", start_s=0.0, end_s=0.0)
    return Simulation(
        variant=variant + ({True: "+early_ns", "ns_only": "+early_ns_only"}.get(early_ns, "") if early_ns else ""),
        hardware=hardware.name,
        step_s=step_s,
        ranks=tuple(ranks),
        exposed_comm_s=ranks[crit].exposed_comm_s,
        ns_s=float(raw["ns"].max()),
        critical_rank=crit,
        critical_op=f"{last.kind} {last.label}".strip(),
        critical_path=tuple(path),
        timelines=raw["timelines"],
        comm_nbytes=_moved_nbytes(ops, n, variant),
        deferred_comm_s=max(0.0, float(raw["deferred_end"].max()) - step_s),
    )


def simulate_variants(plan: Any, hardware: Hardware, workload: Workload, step: Step | None = None, *,
                      variants: Sequence[str] = VARIANTS, timeline_ranks: Sequence[int] | None = None) -> dict[str, Simulation]:
    """:func:`simulate` for every variant of :data:`VARIANTS` (same hardware and workload)."""
    return {v: simulate(plan, hardware, workload, step, variant=v, timeline_ranks=timeline_ranks) for v in variants}
