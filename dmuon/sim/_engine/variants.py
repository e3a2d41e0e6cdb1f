r"""Schedule variants the simulator can price before anyone implements them.

:func:`early_ns_schedule` ("earlier NS") only reorders the table; what it moves and what the
runtime would need: Note: earlier NS (docs/design.md).
"""

from __future__ import annotations

import dataclasses

from dmuon.plan._scheduling.step_schedule import StepSchedule

__all__ = ["early_ns_schedule"]


def early_ns_schedule(sched: StepSchedule, *, early_replicate_broadcast: bool = True) -> StepSchedule:
    """The "earlier NS" variant of ``sched`` (Note: earlier NS, docs/design.md). With
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
