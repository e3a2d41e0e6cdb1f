"""Each packed buffer's two collective kinds priced by the simulator: :func:`buffer_kind_costs`.

What is priced and what is left out: Note: pricing a buffer's kinds (docs/design.md). Pure.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from dmuon.plan._layout.collective_rule import with_collective
from dmuon.plan._scheduling.programs import boundary_programs
from dmuon.sim._engine.coalesce import coalesced_collective_s
from dmuon.sim._engine.hardware import OP_COLLECTIVE, Hardware, collective_s

__all__ = ["BufferKindCost", "buffer_kind_costs"]

_KINDS = ("broadcast", "all_gather")
_PHASES = ("forward_broadcast", "backward_broadcast", "reduce")


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class BufferKindCost:
    """One buffer of a plan: ``boundary``, ``buffer`` (its key), the kind the plan gave it
    (``chosen``), its group size, segments and slot, and the simulated seconds per step of its
    shard phases as broadcasts (``broadcast_s``) and as all-gathers (``all_gather_s``)."""

    boundary: str
    buffer: str
    chosen: str
    group_size: int
    segments: int
    slot_numel: int
    broadcast_s: float
    all_gather_s: float

    @property
    def chosen_s(self) -> float:
        """Seconds of the chosen kind."""
        return self.all_gather_s if self.chosen == "all_gather" else self.broadcast_s

    @property
    def other_s(self) -> float:
        """Seconds of the kind not chosen."""
        return self.broadcast_s if self.chosen == "all_gather" else self.all_gather_s


def _with_kind(plan: Any, kind: str) -> Any:
    """``plan`` with every buffer moved by ``kind`` (one-rank groups keep broadcast), same layout;
    its ``collectives`` mode set to ``kind`` (a plan records which kinds its mode allows)."""
    N = plan.mesh_shape[1]
    boundaries = tuple(
        dataclasses.replace(
            b,
            buffers=tuple(
                with_collective(buf, kind if buf.group_size(N) > 1 else "broadcast", plan.align_numel)
                for buf in b.buffers
            ),
        )
        for b in plan.boundaries
    )
    return dataclasses.replace(
        plan, boundaries=boundaries, collectives=dataclasses.replace(plan.collectives, mode=kind)
    )


def _phase_seconds(hw: Hardware, ops: list) -> dict[tuple[str, str], float]:
    """(boundary, buffer) -> seconds of one phase's ops: per group, coalesced where the hardware
    coalesces broadcasts / reduces, else one call each (plus its issue); the slowest group."""
    by_group: dict[tuple[str, str], dict[tuple[int, ...], list]] = {}
    for op in ops:
        by_group.setdefault((op.boundary, op.buffer), {}).setdefault(op.group, []).append(op)
    out = {}
    for key, groups in by_group.items():
        worst = 0.0
        for group, run in groups.items():
            if len(group) < 2:
                continue
            kind = run[0].kind
            if hw.coalesces and kind in ("broadcast", "reduce"):
                secs = (
                    coalesced_collective_s(hw, kind, group, [o.nbytes for o in run], [o.root for o in run]) + hw.issue_s
                )
            else:
                secs = sum(collective_s(hw, OP_COLLECTIVE[o.kind], group, o.nbytes) + hw.issue_s for o in run)
            worst = max(worst, secs)
        out[key] = worst
    return out


def buffer_kind_costs(plan: Any, hw: Hardware) -> tuple[BufferKindCost, ...]:
    """Every buffer of ``plan`` whose group has two or more ranks, with the simulator's seconds
    per step of its shard phases under each kind (Note: pricing a buffer's kinds, docs/design.md), in plan order."""
    N = plan.mesh_shape[1]
    seconds: dict[str, dict[tuple[str, str], float]] = {}
    for kind in _KINDS:
        acc: dict[tuple[str, str], float] = {}
        for prog in boundary_programs(_with_kind(plan, kind)):
            for phase in _PHASES:
                for key, s in _phase_seconds(hw, list(getattr(prog, phase))).items():
                    acc[key] = acc.get(key, 0.0) + s
        seconds[kind] = acc
    out = []
    for b in plan.boundaries:
        for buf in b.buffers:
            k = buf.group_size(N)
            if k < 2:
                continue
            key = (b.fqn, buf.key)
            slot = with_collective(buf, "all_gather", plan.align_numel).slot_numel
            out.append(
                BufferKindCost(
                    boundary=b.fqn,
                    buffer=buf.key,
                    chosen=buf.collective,
                    group_size=k,
                    segments=len(buf.segments),
                    slot_numel=slot,
                    broadcast_s=seconds["broadcast"][key],
                    all_gather_s=seconds["all_gather"][key],
                )
            )
    return tuple(out)
