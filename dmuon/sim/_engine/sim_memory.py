"""Peak memory per rank, by term, of dmuon (Z2 / Z3) or of an alternative (:func:`memory`).

The sum of what is resident between steps, the gradients, the transient buffers (the most held at
once over the step, phase by phase) and one micro-batch's activations. The terms
but the activations are :func:`dmuon.plan._cost.rank_memory.dmuon_memory` and
:func:`~dmuon.plan._cost.rank_memory.fsdp2_memory` (the formulas, written once there)."""

from __future__ import annotations

from typing import Any

from dmuon.plan._cost import rank_memory as _memory
from dmuon.plan._cost import nbytes as _nbytes
from dmuon.plan._cost.rank_memory import buffer_wire_numel
from dmuon.plan._scheduling.step_schedule import StepSchedule
from dmuon.sim._engine.records import MemoryBreakdown
from dmuon.sim._engine.workload import Workload

__all__ = ["memory", "buffer_wire_numel", "activations_nbytes"]


def activations_nbytes(workload: Workload) -> int:
    """The activations term of every rank and variant: one micro-batch's activations plus, under
    activation checkpointing, what one boundary's recompute rebuilds."""
    return workload.activation_nbytes + workload.recompute_transient_nbytes


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
    owned matrices + AdamW's two moments of the shards; transient =
    :func:`~dmuon.plan._cost.rank_memory.dmuon_transient_nbytes` (phase by phase: the received
    copies and compute tensors of the boundary computing, the next one prefetched, its gradients
    and reduce buffers beside the previous boundary's, FSDP2's units of the rest and its root).
    ``adamw`` / ``naive`` / ``all_to_all``: FSDP2 shards of every parameter (expert stacks as
    torchtitan shards them, :func:`dmuon.plan._cost.baseline.fsdp2_param_shard`), their gradients,
    AdamW moments (or Muon momentum for the matrices), the transient of FSDP2's units over the step
    (:func:`~dmuon.plan._cost.rank_memory.fsdp2_transient_nbytes`); ``naive``: or every full Muon update
    gathered at once, if more (its step gathers all before the NS); ``all_to_all`` adds two matrices'
    worth of each owned batch (received shards + result); ``fsdp2_reshard_after_forward``
    overrides the baselines' Z3 / Z2 as :func:`dmuon.sim.alternatives.build` does. Activations: one
    micro-batch's (:attr:`Workload.activation_nbytes`), plus under activation checkpointing what one
    boundary's recompute rebuilds (:attr:`Workload.recompute_transient_nbytes`).
    """
    act = activations_nbytes(workload)
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
        terms = _memory.dmuon_memory(plan, stats)
    else:
        R, N = plan.mesh_shape
        terms = (_memory.fsdp2_memory(plan, variant, reshard_after_forward=fsdp2_reshard_after_forward),) * (R * N)
    return tuple(
        MemoryBreakdown(
            parameters_nbytes=t.parameters_nbytes,
            gradients_nbytes=t.gradients_nbytes,
            optimizer_state_nbytes=t.optimizer_state_nbytes,
            transient_nbytes=t.transient_nbytes,
            activations_nbytes=act,
        )
        for t in terms
    )
