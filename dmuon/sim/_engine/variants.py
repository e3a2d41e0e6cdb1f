r"""Schedule variants the simulator can price before anyone implements them.

:func:`early_ns_schedule` — "earlier NS": each owner runs a matrix's Newton-Schulz as soon as its
averaged gradient is complete, during the rest of the backward, instead of after the whole
backward; on HSDP the owner's replicate broadcast follows its NS at once, so updated matrices
travel while the backward is still running (the nominal schedule already issues the replicate
reduces one boundary behind their shard reduces, after that boundary's own; the variant moves
them just before them). The transformation
only reorders the table: every ``newton_schulz`` and ``replicate_reduce`` op (and every
``replicate_broadcast`` that waits only on NS) moves to just after the first ``backward`` op
issued after the ops it depends on (one boundary later, which gives the collective the next
boundary's backward to complete); ops, groups,
bytes and FLOPs are unchanged, so ``plan.cost`` is the same and the reordered table is checked
for deadlock like any other. The NS runs on the rank's compute stream (interleaved with the
backward), the runtime's only choice that keeps the oracle order of updates per matrix.

What the runtime would need (not implemented): gradient clipping needs the global gradient norm
before any NS, so early NS is only valid without clipping, or with the norm of each boundary's
gradient accumulated as it completes and the clip applied after NS (which is not the same
update); gradient accumulation runs early NS only in the syncing micro-batch.
"""

from __future__ import annotations

import dataclasses

from dmuon.plan._scheduling.step_schedule import StepSchedule

__all__ = ["early_ns_schedule"]


def early_ns_schedule(sched: StepSchedule, *, early_replicate_broadcast: bool = True) -> StepSchedule:
    """The "earlier NS" variant of ``sched`` (module docstring). With
    ``early_replicate_broadcast=False`` the HSDP replicate broadcasts stay at the end of the step
    (NS and replicate reduces still move). Pure; raises :class:`dmuon.plan.ScheduleError` if the
    reordered table would deadlock."""
    ops = sched.ops
    moved = {op.id for op in ops if op.kind == "newton_schulz" or op.phase == "replicate_reduce"}
    for op in ops:
        if (
            early_replicate_broadcast
            and op.kind == "broadcast"
            and op.phase == "replicate_broadcast"
            and op.deps
            and all(d in moved for d in op.deps)
        ):
            moved.add(op.id)
    # where each moved op goes: after the first backward issued after all its deps (a moved dep
    # counts at its new place); with no such backward, right after its last dep (no deps: in place)
    pos = {op.id: i for i, op in enumerate(ops)}
    backwards = [pos[op.id] for op in ops if op.kind == "backward"]
    anchor_of: dict[int, int] = {}
    placed_after: dict[int, list[int]] = {}
    for op in ops:
        if op.id not in moved:
            continue
        need = max((anchor_of[d] if d in moved else pos[d] for d in op.deps), default=-1)
        later = [b for b in backwards if b > need]
        anchor_of[op.id] = a = later[0] if later else (need if op.deps else pos[op.id] - 1)
        placed_after.setdefault(a, []).append(op.id)
    order: list[int] = list(placed_after.get(-1, ()))
    for op in ops:
        if op.id not in moved:
            order.append(op.id)
        order.extend(placed_after.get(pos[op.id], ()))
    new_id = {old: i for i, old in enumerate(order)}
    new_ops = tuple(
        dataclasses.replace(ops[old], id=i, deps=tuple(new_id[d] for d in ops[old].deps)) for i, old in enumerate(order)
    )
    out = dataclasses.replace(sched, ops=new_ops)
    out.check()
    return out
