"""Bytes per step of one pipeline stage: :func:`pipeline_cost`."""

from __future__ import annotations

import dataclasses

from typing import TYPE_CHECKING

from dmuon.plan._cost.cost_model import ByteCost
from dmuon.plan._cost.nbytes import schedule_byte_cost

if TYPE_CHECKING:
    from dmuon.plan._records.plan import ShardingPlan
    from dmuon.plan._scheduling.ops import Step

__all__ = ["pipeline_cost", "pipeline_step"]


def pipeline_step(microbatches: int, recompute: tuple[str, ...] = ()) -> "Step":
    """The :class:`dmuon.plan.Step` of one pipeline stage that runs ``microbatches`` micro-batches
    per optimizer step (``Step.pipelined``: backwards without sync, one reduce after the last),
    each recomputing the boundaries ``recompute`` (activation checkpointing). The one description
    of a stage's step: :func:`pipeline_cost` is its bytes, the simulator replays it.

    Raises:
        ValueError: ``microbatches`` is not a positive int.
    """
    if type(microbatches) is not int or microbatches < 1:
        raise ValueError(f"dmuon.plan.pipeline_cost: microbatches must be a positive int, got {microbatches!r}")
    from dmuon.plan._scheduling.ops import MicroBatch, Step

    mbs = tuple(MicroBatch(sync=i == microbatches - 1, recompute=recompute) for i in range(microbatches))
    return Step(micro_batches=mbs, pipelined=True)


def pipeline_cost(plan: "ShardingPlan", microbatches: int) -> ByteCost:
    """dmuon's bytes per optimizer step of one pipeline stage whose plan is ``plan``, when the
    schedule runs ``microbatches`` micro-batches through it (``torch.distributed.pipelining``,
    docs/pipeline_parallel.md); what the ledger measures for that stage's ranks per step: the
    bytes of :func:`pipeline_step`'s schedule.

    * Z2 (``reshard_after_forward=False``): the stage's buffers stay resident from the step's
      first forward until the schedule's gradient reduce, so the step moves one forward
      broadcast and one reduce whatever the micro-batch count: ``plan.cost``.
    * Z3: every micro-batch broadcasts for its forward and again for its backward; the gradients
      are reduced once, at the schedule's reduce: ``plan.cost`` plus ``microbatches - 1`` times
      the forward and backward broadcasts (per rank as well).

    Not counted, as in ``plan.cost``: FSDP2's own collectives, the pipeline's point-to-point
    activation sends, and the stage's shape inference before its first step (one more forward,
    with its broadcasts, unless the ``PipelineStage`` is given static shapes).

    Raises:
        ValueError: ``microbatches`` is not a positive int.
    """
    from dmuon.plan._scheduling.builder import schedule

    step = pipeline_step(microbatches)  # checks the count
    if microbatches <= 2:
        return schedule_byte_cost(schedule(plan, step))
    # every micro-batch past the first repeats the first's parameter phases and nothing else (the
    # reduce and the optimizer run once, after the last backward), so the bytes are linear in the
    # count: those of one micro-batch plus (M - 1) times what the second one adds (built, not
    # assumed; M x fewer ops to build than the whole step's schedule)
    one, two = (schedule_byte_cost(schedule(plan, pipeline_step(m))) for m in (1, 2))
    k = microbatches - 1

    def grow(a, b):
        return tuple(x + k * (y - x) for x, y in zip(a, b)) if isinstance(a, tuple) else a + k * (b - a)

    return dataclasses.replace(
        one, **{f.name: grow(getattr(one, f.name), getattr(two, f.name)) for f in dataclasses.fields(one)}
    )
