"""Peak memory per rank, by term, of dmuon (Z2 / Z3) or of an alternative (:func:`memory`).

Not time-resolved (:mod:`dmuon.sim.simulate`'s docstring): the sum of what is resident between
steps, the gradients, the largest transient buffers and one micro-batch's activations."""

from __future__ import annotations

import math
from typing import Any

from dmuon.plan.cost import memory as _memory
from dmuon.plan.cost import nbytes as _nbytes
from dmuon.plan.records.fields import itemsize_nbytes
from dmuon.plan.scheduling.step_schedule import StepSchedule
from dmuon.sim.records import MemoryBreakdown
from dmuon.sim.workload import Workload

__all__ = ["memory"]


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

