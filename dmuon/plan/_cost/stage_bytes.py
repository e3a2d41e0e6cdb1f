"""Bytes per step of one pipeline stage: :func:`pipeline_cost`."""

from __future__ import annotations

from typing import TYPE_CHECKING

from dmuon.plan._cost.cost_model import ByteCost
from dmuon.plan._cost.nbytes import schedule_byte_cost

if TYPE_CHECKING:
    from dmuon.plan._records.plan import ShardingPlan

__all__ = ["pipeline_cost"]


def pipeline_cost(plan: "ShardingPlan", microbatches: int) -> ByteCost:
    """dmuon's bytes per optimizer step of one pipeline stage whose plan is ``plan``, when the
    schedule runs ``microbatches`` micro-batches through it (``torch.distributed.pipelining``,
    docs/pipeline_parallel.md); what the ledger measures for that stage's ranks per step.

    * Z2 (``reshard_after_forward=False``): the stage's buffers stay resident from the step's
      first forward until the schedule's gradient reduce, so the step moves one forward
      broadcast and one reduce whatever the micro-batch count: ``plan.cost``.
    * Z3: every micro-batch broadcasts for its forward and again for its backward; the gradients
      are reduced once, at the schedule's reduce: the step schedule of ``microbatches``
      micro-batches of which only the last syncs, i.e. ``plan.cost`` plus ``microbatches - 1``
      times the forward and backward broadcasts (per rank as well).

    Not counted, as in ``plan.cost``: FSDP2's own collectives, the pipeline's point-to-point
    activation sends, and the stage's shape inference before its first step (one more forward,
    with its broadcasts, unless the ``PipelineStage`` is given static shapes).

    Raises:
        ValueError: ``microbatches`` is not a positive int.
    """
    if type(microbatches) is not int or microbatches < 1:
        raise ValueError(f"dmuon.plan.pipeline_cost: microbatches must be a positive int, got {microbatches!r}")
    if not plan.reshard_after_forward or microbatches == 1:
        return plan.cost
    from dmuon.plan._scheduling.builder import schedule
    from dmuon.plan._scheduling.ops import MicroBatch, Step

    step = Step(micro_batches=(MicroBatch(sync=False),) * (microbatches - 1) + (MicroBatch(),))
    return schedule_byte_cost(schedule(plan, step))
