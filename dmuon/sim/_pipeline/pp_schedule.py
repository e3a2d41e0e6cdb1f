r"""Pipeline schedules as data, and their clocked replay (pure; no process group).

:func:`pipeline_order` is each pipeline rank's sequence of forward / backward actions
(``(stage, micro_batch)``) as torch 2.13's ``torch.distributed.pipelining`` schedules order them:

==============  ===========================================================================
schedule        rank ``r`` of ``P`` (``M`` micro-batches, ``V`` stages per rank)
==============  ===========================================================================
``gpipe``       ``ScheduleGPipe``: every forward, then every backward, micro-batch order
``1f1b``        ``Schedule1F1B``: ``min(M, P - r)`` forwards, then one backward and one
                forward in turn, then the remaining backwards
``interleaved`` ``ScheduleInterleaved1F1B``: ``V`` stages ``r, r + P, ...``; rounds of
                ``M / max(1, M // P)`` micro-batches per stage; ``(V - 1) * round +
                2 (P - 1 - r)`` warm-up forwards (capped at ``M V``), then backward /
                forward in turn (``_get_1f1b_rank_ops`` without its alignment no-ops)
==============  ===========================================================================

:func:`replay_pipeline` runs those actions with clocks: a rank runs its actions in order, one at
a time; the forward of micro-batch ``m`` on stage ``s > 0`` waits for the forward of ``m`` on
stage ``s - 1`` and its activation send (``send_s``); the backward of ``m`` on stage ``s < S -
1`` waits for the backward of ``m`` on stage ``s + 1`` and its gradient send; the last stage's
backward follows its own forward (the loss). Sends are asynchronous (they cost the receiver's
wait, not the sender's time). A rank's idle time (the bubble, and waits on sends) is its end
minus its busy time. Activation memory is counted per action: a forward adds its stage's
activations of one micro-batch, the backward of that micro-batch frees them.

Uniform costs give the textbook figures: GPipe and 1F1B end at ``(M + P - 1)(F + B)``, a bubble
share of ``(P - 1) / (M + P - 1)`` per rank; 1F1B's rank ``r`` holds at most ``min(M, P - r)``
micro-batches' activations, GPipe's ``M``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

__all__ = ["SCHEDULES", "Action", "PipelineReplay", "pipeline_order", "replay_pipeline"]

#: schedules :func:`pipeline_order` knows (torch class names in the module docstring)
SCHEDULES = ("gpipe", "1f1b", "interleaved")


@dataclasses.dataclass(frozen=True, slots=True)
class Action:
    """One forward (``"F"``) or full backward (``"B"``) of ``micro_batch`` on ``stage``."""

    kind: str
    stage: int
    micro_batch: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.micro_batch}"


def pipeline_order(
    schedule: str, pp_size: int, micro_batches: int, stages_per_rank: int = 1
) -> tuple[tuple[Action, ...], ...]:
    """Per pipeline rank, its actions in issue order (module docstring).

    Raises:
        ValueError: unknown schedule; ``gpipe`` / ``1f1b`` with more than one stage per rank or
            ``interleaved`` with one; micro-batches not a multiple of the interleaved rounds
            (torch's check); non-positive sizes.
    """
    P, M, V = pp_size, micro_batches, stages_per_rank
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {schedule!r}: one of {SCHEDULES}")
    if P < 1 or M < 1 or V < 1:
        raise ValueError(f"pipeline schedule: pp ({P}), micro-batches ({M}) and stages per rank ({V}) must be >= 1")
    if schedule in ("gpipe", "1f1b") and V != 1:
        raise ValueError(f"the {schedule} schedule runs one stage per rank, got {V} stages per rank: use interleaved")
    if schedule == "interleaved" and V < 2:
        raise ValueError("the interleaved schedule runs at least 2 stages per rank (--stages-per-rank)")
    out = []
    for r in range(P):
        if schedule == "gpipe":
            acts = [Action("F", r, m) for m in range(M)] + [Action("B", r, m) for m in range(M)]
        elif schedule == "1f1b":
            w = min(M, P - r)
            acts = [Action("F", r, m) for m in range(w)]
            f = w
            for b in range(M):
                acts.append(Action("B", r, b))
                if f < M:
                    acts.append(Action("F", r, f))
                    f += 1
        else:
            acts = _interleaved(r, P, M, V)
        out.append(tuple(acts))
    return tuple(out)


def _interleaved(r: int, P: int, M: int, V: int) -> list[Action]:
    """torch's ``ScheduleInterleaved1F1B._calculate_single_rank_operations`` without no-ops."""
    rounds = max(1, M // P)
    per_round = M // rounds
    if M % rounds:
        raise ValueError(
            f"interleaved schedule: {M} micro-batches must be a multiple of the number of rounds "
            f"({rounds} = micro-batches // pp); torch refuses it too"
        )
    warmup = min((V - 1) * per_round + 2 * (P - 1 - r), M * V)
    total = M * V
    fwd_mb: dict[int, int] = {}
    bwd_mb: dict[int, int] = {}

    def fwd_stage(step: int) -> int:
        return ((step // per_round) % V) * P + r

    def bwd_stage(step: int) -> int:
        return (V - 1 - ((step - warmup) // per_round) % V) * P + r

    acts = []
    for op in range(total + warmup):
        if op < total:  # warm-up forward, or the forward of a 1F1B pair
            s = fwd_stage(op)
            acts.append(Action("F", s, fwd_mb.get(s, 0)))
            fwd_mb[s] = fwd_mb.get(s, 0) + 1
        if op >= warmup:
            s = bwd_stage(op)
            acts.append(Action("B", s, bwd_mb.get(s, 0)))
            bwd_mb[s] = bwd_mb.get(s, 0) + 1
    return acts


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class PipelineReplay:
    """The replayed pipeline, per pipeline rank.

    Attributes:
        end_s: when the rank's last action ends.
        busy_s: the sum of its actions' seconds.
        in_flight: the most micro-batches (summed over its stages) whose forward ran and whose
            backward did not.
        activation_nbytes: the most activation bytes held at once.
        starts: ``{action: (start_s, end_s)}`` of every action.
    """

    end_s: tuple[float, ...]
    busy_s: tuple[float, ...]
    in_flight: tuple[int, ...]
    activation_nbytes: tuple[int, ...]
    starts: dict = dataclasses.field(compare=False, repr=False)

    @property
    def idle_s(self) -> tuple[float, ...]:
        """Per rank, ``end_s - busy_s``: the bubble and the waits on sends."""
        return tuple(max(0.0, e - b) for e, b in zip(self.end_s, self.busy_s))

    @property
    def makespan_s(self) -> float:
        return max(self.end_s, default=0.0)


def replay_pipeline(
    order: Sequence[Sequence[Action]],
    forward_s: Sequence[float],
    backward_s: Sequence[float],
    *,
    send_s: float | Sequence[float] = 0.0,
    activation_nbytes: Sequence[int] | None = None,
) -> PipelineReplay:
    """Replay ``order`` (:func:`pipeline_order`) with per-stage seconds of one micro-batch's
    forward / backward (module docstring). ``send_s``: seconds of one activation (or gradient)
    send across the edge after stage ``s`` (one figure for every edge, or one per stage; the
    last entry unused). ``activation_nbytes``: per stage, one micro-batch's activations.

    Raises:
        ValueError: an order that deadlocks (an action waits for one no rank can reach).
    """
    S = len(forward_s)
    if len(backward_s) != S:
        raise ValueError("replay_pipeline: forward_s and backward_s must have one entry per stage")
    sends = [float(send_s)] * S if isinstance(send_s, (int, float)) else [float(x) for x in send_s]
    act = list(activation_nbytes) if activation_nbytes is not None else [0] * S
    stage_rank: dict[int, int] = {}
    for r, acts in enumerate(order):
        for a in acts:
            stage_rank[a.stage] = r
    done: dict[Action, tuple[float, float]] = {}
    pos = [0] * len(order)
    free = [0.0] * len(order)
    busy = [0.0] * len(order)
    held = [0] * len(order)
    held_mb = [0] * len(order)
    peak = [0] * len(order)
    peak_mb = [0] * len(order)
    remaining = sum(len(a) for a in order)
    while remaining:
        progressed = False
        for r, acts in enumerate(order):
            while pos[r] < len(acts):
                a = acts[pos[r]]
                ready = free[r]
                if a.kind == "F":
                    if a.stage > 0:
                        prev = done.get(Action("F", a.stage - 1, a.micro_batch))
                        if prev is None:
                            break
                        hop = sends[a.stage - 1] if stage_rank.get(a.stage - 1) != r else 0.0
                        ready = max(ready, prev[1] + hop)
                    secs = float(forward_s[a.stage])
                else:
                    if a.stage < S - 1:
                        nxt = done.get(Action("B", a.stage + 1, a.micro_batch))
                        if nxt is None:
                            break
                        hop = sends[a.stage] if stage_rank.get(a.stage + 1) != r else 0.0
                        ready = max(ready, nxt[1] + hop)
                    own = done.get(Action("F", a.stage, a.micro_batch))
                    if own is None:
                        break
                    ready = max(ready, own[1])
                    secs = float(backward_s[a.stage])
                done[a] = (ready, ready + secs)
                free[r] = ready + secs
                busy[r] += secs
                if a.kind == "F":
                    held[r] += act[a.stage]
                    held_mb[r] += 1
                    peak[r] = max(peak[r], held[r])
                    peak_mb[r] = max(peak_mb[r], held_mb[r])
                else:
                    held[r] -= act[a.stage]
                    held_mb[r] -= 1
                pos[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = {r: str(acts[pos[r]]) for r, acts in enumerate(order) if pos[r] < len(acts)}
            raise ValueError(f"replay_pipeline: the order deadlocks; next actions per rank: {stuck}")
    return PipelineReplay(
        end_s=tuple(free), busy_s=tuple(busy), in_flight=tuple(peak_mb), activation_nbytes=tuple(peak), starts=done
    )
