"""Peak memory per rank, by term, of dmuon (Z2 / Z3) or of an alternative (:func:`memory`).

Not time-resolved (:mod:`dmuon.sim.simulate`'s docstring): the sum of what is resident between
steps, the gradients, the largest transient buffers and one micro-batch's activations."""

from __future__ import annotations

import math
from typing import Any

from dmuon.plan._cost import baseline as _baseline
from dmuon.plan._cost import rank_memory as _memory
from dmuon.plan._cost import nbytes as _nbytes
from dmuon.plan._records.fields import itemsize_nbytes
from dmuon.plan._scheduling.step_schedule import StepSchedule
from dmuon.sim._engine.alternatives import plan_ep
from dmuon.sim._engine.records import MemoryBreakdown
from dmuon.sim._engine.workload import Workload

__all__ = ["memory", "buffer_wire_numel"]


def buffer_wire_numel(buf: Any, num_shards: int) -> int:
    """Elements of boundary buffer ``buf`` one rank holds while it is gathered, and packs for
    its gradient collective: a broadcast buffer's segments over the rank's group (the whole
    buffer; an expert-parallel buffer, ``buf.ep > 1``: the largest efsdp group's segments); an
    all-gather buffer (``buf.collective == "all_gather"``): ``k · slot_numel`` over its group of
    ``k`` ranks, its slot padding included."""
    ep = buf.ep
    k = num_shards // ep if ep > 1 else num_shards
    if getattr(buf, "collective", "broadcast") == "all_gather":
        return k * buf.slot_numel
    if ep == 1:
        return buf.numel
    per: dict[int, int] = {}
    for seg in buf.segments:
        per[seg.shard % ep] = per.get(seg.shard % ep, 0) + seg.numel
    return max(per.values())


def memory(
    plan: Any,
    workload: Workload,
    variant: str,
    sched: StepSchedule | None = None,
    *,
    fsdp2_reshard_after_forward: bool | None = None,
) -> tuple[MemoryBreakdown, ...]:
    """Peak memory per rank, by term (storage dtypes; the activation dtype for activations).

    ``z2`` / ``z3`` (dmuon): parameters = owned masters (+ HSDP replicas held,
    ``RankStats.resident_nbytes`` less momentum) + FSDP2 shards of the rest; gradients = full
    gradients of owned matrices + FSDP2 gradient shards; optimizer state = Muon momentum of
    owned matrices + AdamW's two moments of the shards; transient = the packed buffers
    (``RankStats.peak_transient_nbytes``: Z3 the largest boundary, Z2 all of them) + one
    boundary's gradient reduce buffer (:func:`buffer_wire_numel`: a reduce-scatter's whole input) + the largest FSDP2 unit unsharded (Z2: all units).
    ``adamw`` / ``naive`` / ``all_to_all``: FSDP2 shards of every parameter (expert stacks as
    torchtitan shards them, :func:`dmuon.plan._cost.baseline.fsdp2_param_shard`), their gradients,
    AdamW moments (or Muon momentum for the matrices), the largest unit unsharded with its
    unsharded gradient (Z2: every unit's parameters); ``naive`` adds every full Muon update
    gathered at once (its step gathers all before the NS); ``all_to_all`` adds two matrices'
    worth of each owned batch (received shards + result); ``fsdp2_reshard_after_forward``
    overrides the baselines' Z3 / Z2 as :func:`dmuon.sim.alternatives.build` does. Activations: one
    micro-batch's (:attr:`Workload.activation_nbytes`), plus under activation checkpointing what one
    boundary's recompute rebuilds (:attr:`Workload.recompute_transient_nbytes`).
    """
    R, N = plan.mesh_shape
    T = plan.tp_size if variant in ("z2", "z3") else 1
    n = R * N * T
    act = workload.activation_nbytes + workload.recompute_transient_nbytes
    unit_full: dict[str, int] = {}
    shard_rest = 0
    ep = plan_ep(plan)
    for u in plan.fsdp2_units:
        full = 0
        for p, shape, dt in zip(u.params, u.shapes, u.dtypes):
            isz = itemsize_nbytes(dt)
            full += math.prod(shape) * isz
            shard_rest += _baseline.fsdp2_param_shard(p, tuple(shape), N, ep=ep)[1] * isz
        unit_full[u.fqn] = unit_full.get(u.fqn, 0) + full
    if variant in ("z2", "z3"):
        if sched is None:
            stats = plan.rank_stats()
        else:  # the same figures from a schedule already built (plan.rank_stats() builds its own)
            stats = _memory.rank_stats(
                plan.params,
                plan.owners,
                sched,
                _nbytes.schedule_byte_cost(sched),
                mesh_shape=plan.mesh_shape,
                reshard_after_forward=plan.reshard_after_forward,
                tp_size=plan.tp_size,
                assembled_nbytes=plan.assembled_nbytes,
            )
        z3 = plan.reshard_after_forward
        fsdp_unsharded = max(unit_full.values(), default=0) if z3 else sum(unit_full.values())
        reduce_buf = max(
            (sum(buffer_wire_numel(buf, N) * itemsize_nbytes(buf.dtype) for buf in b.buffers) for b in plan.boundaries),
            default=0,
        )
        out = []
        for st in stats:
            momentum = st.owned_nbytes
            out.append(
                MemoryBreakdown(
                    parameters_nbytes=st.resident_nbytes - momentum + shard_rest,
                    gradients_nbytes=st.owned_nbytes + shard_rest,
                    optimizer_state_nbytes=momentum + 2 * shard_rest,
                    transient_nbytes=st.peak_transient_nbytes + reduce_buf + fsdp_unsharded,
                    activations_nbytes=act,
                )
            )
        return tuple(out)
    muon_shard = sum(_baseline.spec_fsdp2_shard(s, N)[1] * itemsize_nbytes(s.dtype) for s in plan.params)
    muon_full = sum(s.local_numel * itemsize_nbytes(s.dtype) for s in plan.params)
    for s in plan.params:
        b = plan.boundary(s.fqn)
        unit_full[b] = unit_full.get(b, 0) + s.local_numel * itemsize_nbytes(s.dtype)
    z3 = True if variant == "adamw" else plan.reshard_after_forward
    if fsdp2_reshard_after_forward is not None:
        z3 = fsdp2_reshard_after_forward
    largest = max(unit_full.values(), default=0)
    unsharded = largest if z3 else sum(unit_full.values())
    transient = unsharded + largest  # + one unit's unsharded gradient before its reduce-scatter
    if variant == "naive":
        transient = max(transient, muon_full + largest)
    elif variant == "all_to_all":
        transient += 2 * (muon_full // max(N, 1))
    state = 2 * shard_rest + (2 * muon_shard if variant == "adamw" else muon_shard)
    rec = MemoryBreakdown(
        parameters_nbytes=shard_rest + muon_shard,
        gradients_nbytes=shard_rest + muon_shard,
        optimizer_state_nbytes=state,
        transient_nbytes=transient,
        activations_nbytes=act,
    )
    return (rec,) * n
