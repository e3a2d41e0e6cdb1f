r"""Replay a step schedule on a hardware model: ``simulate(plan, hardware, workload) -> Simulation``.

The deadlock check's replay with clocks: one thread and one channel per collective kind per rank.
When each op starts and ends, what is added to every schedule and what is not modelled: Note: the
simulator's replay (docs/design.md). Beside this module (the variant driver, :func:`simulate`,
:func:`simulate_variants`): :mod:`~dmuon.sim._engine.lower` (schedule ops -> timed simulator ops),
:mod:`~dmuon.sim._engine.sim_replay` (the clocked replay, the critical path),
:mod:`~dmuon.sim._engine.sim_memory` (peak memory), :mod:`~dmuon.sim._engine.records` (the result
records).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from dmuon.plan._cost import nbytes as _nbytes
from dmuon.plan._scheduling.ops import Op, Step
from dmuon.sim._engine import alternatives as _alt
from dmuon.sim._engine.hardware import Hardware
from dmuon.sim._engine.lower import _lower
from dmuon.sim._engine.sim_memory import memory
from dmuon.sim._engine.records import Interval, MemoryBreakdown, PathStep, RankTime, Simulation, Simulations
from dmuon.sim._engine.sim_replay import _critical_path, replay_ops
from dmuon.sim._engine.workload import Workload

__all__ = [
    "VARIANTS",
    "Interval",
    "PathStep",
    "RankTime",
    "MemoryBreakdown",
    "Simulation",
    "simulate",
    "simulate_variants",
    "memory",
    "replay_ops",
]

#: every variant :func:`simulate_variants` runs
VARIANTS = ("adamw", "naive", "z2", "z3", "all_to_all")


def _variant_ops(
    plan: Any, variant: str, step: Step | None, early_ns: bool | str, fsdp2_reshard: bool | None = None
) -> tuple[Sequence[Op], int, Any, Any]:
    if variant in ("z2", "z3"):
        want = variant == "z3"
        if plan.reshard_after_forward != want:
            plan = dataclasses.replace(plan, reshard_after_forward=want)
        sched = plan.schedule(step)
        sched.check()
        nominal = sched
        if early_ns:
            from dmuon.sim._engine.variants import early_ns_schedule

            sched = early_ns_schedule(sched, early_replicate_broadcast=early_ns != "ns_only")
        return sched.ops, sched.num_ranks, plan, nominal
    ops = _alt.build(variant, plan, step, fsdp2_reshard_after_forward=fsdp2_reshard)
    R, N = plan.mesh_shape
    return ops, R * N, plan, None


def _moved_nbytes(ops: Sequence[Op], num_ranks: int, variant: str) -> tuple[int, int]:
    """Bytes on the wire per step summed over ranks, and dmuon's part: dmuon's collectives by the
    ledger's rule (:func:`dmuon.plan._cost.nbytes.schedule_byte_cost`), FSDP2's and the
    alternatives' by :func:`dmuon.sim.alternatives.moved_nbytes`."""
    if variant in ("z2", "z3"):
        view = _OpsView(tuple(op for op in ops if op.collective), num_ranks)
        dmuon_part = _nbytes.schedule_byte_cost(view).total_nbytes
        return dmuon_part + _alt.moved_nbytes([op for op in ops if op.kind.startswith("fsdp2_")]), dmuon_part
    return _alt.moved_nbytes(ops), 0


class _OpsView:
    """The two attributes :func:`dmuon.plan._cost.nbytes.schedule_byte_cost` reads."""

    def __init__(self, ops: Sequence[Op], n: int) -> None:
        self.ops = ops
        self.num_ranks = n


def simulate(
    plan: Any,
    hardware: Hardware,
    workload: Workload,
    step: Step | None = None,
    *,
    variant: str | None = None,
    early_ns: bool | str = False,
    timeline_ranks: Sequence[int] | None = None,
    fsdp2_reshard_after_forward: bool | None = None,
) -> Simulation:
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
            (:func:`dmuon.sim._engine.variants.early_ns_schedule`); ``"ns_only"`` = the same with the
            HSDP replicate broadcasts left at the end of the step.
        timeline_ranks: ranks whose timeline to keep (default: all ranks up to 16, else rank 0
            and the last rank).
        fsdp2_reshard_after_forward: the alternatives' FSDP2 Z3 (True) or Z2 (False); None = as
            :func:`dmuon.sim.alternatives.build` defaults (``adamw``: True).

    Raises:
        ValueError: unknown variant, or an op the simulator cannot time.
        dmuon.plan.ScheduleError: the dmuon schedule would deadlock.
    """
    if variant is None:
        variant = "z3" if plan.reshard_after_forward else "z2"
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}: one of {VARIANTS}")
    ops, n, mode_plan, nominal = _variant_ops(plan, variant, step, early_ns, fsdp2_reshard_after_forward)
    if timeline_ranks is None:
        timeline_ranks = tuple(range(n)) if n <= 16 else (0, n - 1)
    sim_ops = _lower(ops, plan, hardware, workload, variant=variant, num_ranks=n)
    raw = replay_ops(sim_ops, n, hardware, timeline_ranks=timeline_ranks)
    crit, path = _critical_path(sim_ops, raw)
    step_s = float(raw["rank_end"].max())
    mem = memory(
        mode_plan,
        workload,
        variant,
        sched=nominal if step is None else None,
        fsdp2_reshard_after_forward=fsdp2_reshard_after_forward,
        accumulate=step is not None and any(not mb.sync for mb in step.micro_batches),
    )
    calls = _calls_per_rank(sim_ops, n)
    ranks = []
    for x in range(n):
        busy, wait = float(raw["busy"][x]), float(raw["wait"][x])
        tail = max(0.0, float(raw["chan_end"][x]) - float(raw["host"][x]))
        ranks.append(
            RankTime(
                rank=x,
                busy_s=busy,
                comm_wait_s=wait,
                idle_s=max(0.0, step_s - busy - wait),
                tail_comm_s=tail,
                ns_s=float(raw["ns"][x]),
                end_s=float(raw["rank_end"][x]),
                memory=mem[x],
            )
        )
    last = path[-1] if path else PathStep(rank=crit, kind="", label="", start_s=0.0, end_s=0.0)
    moved, dmuon_moved = _moved_nbytes(ops, n, variant)
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
        comm_nbytes=moved,
        dmuon_nbytes=dmuon_moved,
        deferred_comm_s=max(0.0, float(raw["deferred_end"].max()) - step_s),
        collectives_per_rank=calls,
    )


def _calls_per_rank(sim_ops: Sequence[Any], n: int) -> tuple[int, ...]:
    """Collective calls each rank issues in the simulated step (a coalesced group counts once;
    FSDP2's and the model's token all-to-alls included)."""
    per_group: dict[tuple[int, ...], int] = {}
    for op in sim_ops:
        if op.collective:
            per_group[op.group] = per_group.get(op.group, 0) + 1
    calls = np.zeros(n, dtype=np.int64)
    for group, c in per_group.items():
        calls[np.asarray(group, dtype=np.int64)] += c
    return tuple(int(c) for c in calls)


def simulate_variants(
    plan: Any,
    hardware: Hardware,
    workload: Workload,
    step: Step | None = None,
    *,
    variants: Sequence[str] = VARIANTS,
    timeline_ranks: Sequence[int] | None = None,
) -> Simulations:
    """:func:`simulate` for every variant of :data:`VARIANTS` (same hardware and workload), as a
    :class:`~dmuon.sim._engine.records.Simulations` dict (it draws itself in a notebook)."""
    sims = Simulations(
        {v: simulate(plan, hardware, workload, step, variant=v, timeline_ranks=timeline_ranks) for v in variants}
    )
    sims.memory_nbytes = int(hardware.memory_nbytes or 0)
    return sims
