"""The step check of a hook boundary's broadcasts: every sender writes a :func:`step_code`
(optimizer step, phase, forward index) into slots its segment already has, and every receiver
compares it with its own; a difference (a rank skipped or repeated a forward, backward or
optimizer step) raises :class:`RanksOutOfStep` naming both ranks. No extra byte moves."""

from __future__ import annotations

import torch

__all__ = ["RanksOutOfStep", "step_code", "describe_code", "round_senders", "check_rounds", "raise_if_out_of_step"]


class RanksOutOfStep(RuntimeError):
    """Ranks disagree on how many broadcast rounds a boundary has run (a rank skipped or
    repeated a forward, backward or optimizer step); raised on the ranks that see it."""


_STEP_MOD, _FORWARD_MOD = 32, 4  # codes 1..256: integers every wire dtype holds exactly (bf16: up to 256)


def step_code(steps_done: int, backward: bool, forwards_since_step: int) -> float:
    """The value a holder writes into its segment's flag slots before a broadcast, and every
    receiver compares with its own: ``1 + (steps mod 32) * 8 + backward * 4 + (forwards mod 4)``
    (1..256, exact in bf16, fp16 and fp32). ``forwards_since_step``: grad-enabled forwards of
    the boundary since the last optimizer step, counted before this forward. The flag slots are
    already part of every segment (the reduce's gradient-presence flags), so the check moves no
    extra byte and the plan's byte counts are unchanged."""
    return float(1 + (steps_done % _STEP_MOD) * 8 + int(backward) * 4 + forwards_since_step % _FORWARD_MOD)


def describe_code(code: float) -> str:
    """``"optimizer step 3 (mod 32), forward broadcast of forward 1 (mod 4)"`` of a :func:`step_code`."""
    v = int(code) - 1
    step, rest = divmod(v, 8)
    phase = "backward" if rest >= 4 else "forward"
    return f"step {step} (mod {_STEP_MOD}), {phase} broadcast, after {rest % 4} forward(s) of this step (mod {_FORWARD_MOD})"


def boundary_code(boundary, phase: str) -> float:
    """``boundary``'s own :func:`step_code` for a broadcast of ``phase`` (the ledger phase)."""
    return step_code(boundary.comm_ctx.steps_done, phase == "backward_broadcast", boundary.forwards_since_step)


def round_senders(boundary) -> list[int]:
    """Global rank that sent each code of :func:`_received_codes`: the root of each received
    broadcast segment, then per all-gathered buffer every other member of the group."""
    g = boundary.comm_ctx.groups
    out = [g.rank_of(g.replicate, seg.shard) for seg in boundary.segments if not seg.held and seg.gather is None]
    for gb in boundary.gathers:
        out += [g.rank_of(g.replicate, s) for j, s in enumerate(gb.group_shards) if j != gb.my_slot]
    return out


def _received_codes(boundary) -> list[torch.Tensor]:
    """The step codes this rank received (views): a received broadcast segment's first flag
    slot, and every other member's slot trailer of each all-gathered buffer."""
    parts = [
        seg.wire[seg.subs[0].flags_offset_in_seg].reshape(1)
        for seg in boundary.segments
        if not seg.held and seg.gather is None
    ]
    for gb in boundary.gathers:
        codes = gb.codes()
        parts += [codes[: gb.my_slot], codes[gb.my_slot + 1 :]]
    return parts


def check_rounds(boundary, phase: str) -> None:
    """Every received step code (a broadcast segment's flag slots, an all-gathered slot's
    trailer: every member writes one, owner or not) must be this rank's own :func:`step_code`:
    a sender on another step or phase is reported here on CPU; on an accelerator the comparison
    stays on the device and the comm context checks it once per optimizer step (one host sync)."""
    if not boundary.round_senders:
        return
    got = torch.cat(_received_codes(boundary))
    expected = boundary_code(boundary, phase)
    if got.device.type != "cpu":
        boundary.comm_ctx.defer_round_check(boundary, phase, got, expected)
    elif not bool((got == expected).all()):  # host memory: no sync; the values are read on a mismatch only
        raise_if_out_of_step(boundary, phase, got.tolist(), expected)


def raise_if_out_of_step(boundary, phase: str, got: list, expected: float) -> None:
    """Raise :class:`RanksOutOfStep` naming both sides when a received round differs."""
    ctx = boundary.comm_ctx
    for holder, value in zip(boundary.round_senders, got):
        if value != expected:
            me = ctx.groups.rank_of(ctx.groups.replicate, ctx.groups.shard)
            raise RanksOutOfStep(
                f"dmuon: ranks out of step at boundary {boundary.fqn!r}: this rank (global rank {me}) is at "
                f"{describe_code(expected)} (optimizer steps done: {ctx.steps_done}), but global rank {holder}, "
                f"whose broadcast or all-gather slot it received, is at {describe_code(value)}: one of them "
                "skipped or repeated a forward, a backward or an optimizer step. Every rank must run the same "
                "forwards, backwards "
                "and opt.step() calls in the same order (no rank-dependent skip, early exit or extra step)."
            )
