r"""The records of a step as data: the op kinds, :class:`Op`, :class:`ScheduleError`, and the
:class:`Step` (micro-batches) a schedule is built for.

What each op kind records, how FSDP2's own ops are modelled, schedule ranks, the bytes charged
to a rank and what a :class:`Step` can describe: Note: the step's ops (docs/design.md).
"""

from __future__ import annotations

import dataclasses

from dmuon.plan._cost import nbytes as _nbytes
from dmuon.plan._records.fields import itemsize_nbytes

__all__ = [
    "COLLECTIVE_KINDS",
    "EXTERNAL_KINDS",
    "OP_KINDS",
    "CHARGED_PHASES",
    "QK_CLIP_DTYPE",
    "ROOTED_KINDS",
    "Op",
    "MicroBatch",
    "Step",
    "ScheduleError",
]

#: op kinds that are collectives (matched across the members of their group)
COLLECTIVE_KINDS = ("broadcast", "reduce", "all_reduce", "all_gather", "reduce_scatter")
#: op kinds dmuon does not issue or charge: the step's own compute, and FSDP2's collectives of
#: the parameters dmuon does not dedicate (FSDP2's own process groups; not replayed)
EXTERNAL_KINDS = ("forward", "backward", "recompute", "fsdp2_all_gather", "fsdp2_reduce_scatter", "fsdp2_all_reduce")
#: every op kind
OP_KINDS = COLLECTIVE_KINDS + ("newton_schulz",) + EXTERNAL_KINDS
#: the ledger phases a schedule charges bytes to (``ByteCost`` fields without ``_nbytes``)
CHARGED_PHASES = (
    "forward_broadcast",
    "backward_broadcast",
    "reduce",
    "replicate_reduce",
    "replicate_broadcast",
    "tp",
    "owner_group",
    "qk_clip",
)
#: dtype of QK-clip's all-reduced per-head max logits
QK_CLIP_DTYPE = "torch.float32"
#: collectives that have a root (the others must have none)
ROOTED_KINDS = ("broadcast", "reduce")


class ScheduleError(ValueError):
    """A schedule that cannot run: a deadlock (with the cycle of waiting ranks), a collective
    the members disagree on, or an op on a group its rank is not a member of.

    Attributes: ``rank`` (the first rank that cannot proceed, or None), ``op`` (its op),
    ``cycle`` (schedule ranks, each waiting for the next; empty when not a cycle).
    """

    def __init__(self, message: str, *, rank: int | None = None, op: Op | None = None, cycle: tuple[int, ...] = ()):
        super().__init__(message)
        self.rank = rank
        self.op = op
        self.cycle = cycle


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Op:
    """One operation of a step (the op kinds: Note: the step's ops, docs/design.md).

    Attributes:
        id: index in :attr:`StepSchedule.ops`.
        kind: one of :data:`OP_KINDS`.
        phase: the ledger phase of a collective (``"forward_broadcast"``, ``"backward_broadcast"``,
            ``"reduce"``, ``"replicate_reduce"``, ``"replicate_broadcast"``, ``"tp"``);
            ``"optimizer"`` for Newton-Schulz, ``"compute"`` for external ops.
        group: schedule ranks that take part (a collective) or each run it (a local op).
        root: source of a broadcast / destination of a reduce (a schedule rank), else None.
        dtype: wire dtype string of a collective, else None.
        numel: elements per rank (broadcast / reduce payload, all-reduce tensor, all-gather input,
            reduce-scatter output).
        flops: Newton-Schulz FLOPs each member runs (matmuls; ``newton_schulz`` ops only).
        boundary: FQN of the hook boundary (None for TP and NS ops).
        buffer: :attr:`~dmuon.plan._layout.buffer_layout.BufferLayout.key` of the boundary buffer the op moves
            (its storage dtype; ``"<dtype>/ep<k>"`` for expert-parallel ranges), None if not a
            buffer op.
        segment: shard coordinate of the segment (buffer ops); None for an all-gather /
            reduce-scatter of a whole buffer's slots.
        subsegment: owner replicate coordinate of the sub-segment (replicate ops), else None.
        fqns: the dedicated parameters an NS or TP op covers, plan order.
        micro_batch: index of the micro-batch (optimizer ops: the last one).
        deps: ids of the ops this one waits for; a rank waits only for those it takes part in.
        external: True for ops dmuon neither issues nor charges.
    """

    id: int
    kind: str
    phase: str
    group: tuple[int, ...]
    root: int | None = None
    dtype: str | None = None
    numel: int = 0
    flops: int = 0
    boundary: str | None = None
    buffer: str | None = None
    segment: int | None = None
    subsegment: int | None = None
    fqns: tuple[str, ...] = ()
    micro_batch: int = 0
    deps: tuple[int, ...] = ()
    external: bool = False

    @property
    def collective(self) -> bool:
        return self.kind in COLLECTIVE_KINDS

    @property
    def nbytes(self) -> int:
        """Payload bytes per rank: ``numel * itemsize(dtype)`` (0 for local ops)."""
        return self.numel * itemsize_nbytes(self.dtype) if self.dtype else 0

    def charged_nbytes(self, rank: int) -> int:
        """Bytes the ledger charges schedule rank ``rank`` for this op (0 if not a member)."""
        if not self.collective or rank not in self.group:
            return 0
        return _nbytes.collective_rank_nbytes(
            self.kind,
            self.numel,
            itemsize_nbytes(self.dtype),
            len(self.group),
            rank == self.root,  # type: ignore[arg-type]
        )

    def signature(self) -> tuple:
        """What the members of a collective must agree on: ``(kind, group, root, dtype, numel)``."""
        return (self.kind, self.group, self.root, self.dtype, self.numel)

    def describe(self) -> str:
        where = f" {self.boundary!r}" if self.boundary is not None else ""
        seg = f" seg {self.segment}" if self.segment is not None else ""
        sub = f"/{self.subsegment}" if self.subsegment is not None else ""
        root = f" root {self.root}" if self.root is not None else ""
        what = f" {self.numel} x {self.dtype}" if self.dtype else (f" {self.flops:,} FLOP" if self.flops else "")
        return f"#{self.id} {self.kind} [{self.phase}]{where}{seg}{sub}{root}{what}"


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class MicroBatch:
    """One forward + backward of a step.

    Attributes:
        forward: boundary FQNs in call order; a boundary may repeat or be absent. None = every
            boundary once, in plan order.
        sync: the backward reduces gradients (False: inside ``dmuon.no_sync``).
        recompute: boundaries whose forward is recomputed under activation checkpointing
            during their backward (no extra collective: the compute parameters are installed).
    """

    forward: tuple[str, ...] | None = None
    sync: bool = True
    recompute: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.forward is not None and (
            type(self.forward) is not tuple or not all(isinstance(f, str) for f in self.forward)
        ):
            raise TypeError("MicroBatch.forward must be None or a tuple of boundary FQNs")
        if type(self.sync) is not bool:
            raise TypeError("MicroBatch.sync must be a bool")
        if type(self.recompute) is not tuple:
            raise TypeError("MicroBatch.recompute must be a tuple of boundary FQNs")


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Step:
    """A training step: micro-batches, then one optimizer step.

    Attributes:
        micro_batches: at least one; the last one must sync (``dmuon.Muon.step`` raises after a
            backward inside ``no_sync`` whose gradients were never reduced, and so does ``Step``).
        unused: dedicated parameters (any alias) no rank produces a gradient for: Muon skips
            them (no NS op, left out of TP batches). Collectives are unchanged: a missing
            gradient travels as zeros with a presence flag of 0.
        pipelined: the step of one pipeline stage under a ``torch.distributed.pipelining``
            schedule (docs/pipeline_parallel.md), as dmuon's runtime and FSDP2 run it there:
            every backward runs without gradient sync, and the step's reduce (the schedule's
            ``REDUCE_GRAD``) follows the last micro-batch's backward: dmuon's reduces of every
            boundary that ran, last boundary first, then FSDP2's; FSDP2 keeps each unit
            unsharded after its backward (``set_reshard_after_backward(False)``); under Z2
            dmuon's buffers stay resident from a boundary's first forward until that reduce (one
            forward broadcast per step), under Z3 every micro-batch broadcasts for its forward
            and again for its backward. The micro-batches' ``sync`` flags are not read (the last
            must still be True). :func:`dmuon.plan.pipeline_cost` is the ledger's bytes of it.
    """

    micro_batches: tuple[MicroBatch, ...] = (MicroBatch(),)
    unused: tuple[str, ...] = ()
    pipelined: bool = False

    def __post_init__(self) -> None:
        if type(self.micro_batches) is not tuple or any(not isinstance(m, MicroBatch) for m in self.micro_batches):
            raise TypeError("Step.micro_batches must be a tuple of MicroBatch records")
        if not self.micro_batches:
            raise ValueError("Step.micro_batches must hold at least one MicroBatch")
        if not self.micro_batches[-1].sync:
            raise ValueError(
                "Step: the last micro-batch must sync (MicroBatch(sync=True)): an optimizer step after a "
                "backward inside dmuon.no_sync raises at run time, its gradients were never reduced"
            )
        if type(self.unused) is not tuple or not all(isinstance(f, str) for f in self.unused):
            raise TypeError("Step.unused must be a tuple of FQNs")
        if type(self.pipelined) is not bool:
            raise TypeError("Step.pipelined must be a bool")


def _fmt_group(group: tuple[int, ...]) -> str:
    """``(0, 1, 2, 3)``, or ``(0..1023)`` / ``(3..1023 step 8)`` for a long arithmetic run."""
    if len(group) > 4:
        step = group[1] - group[0]
        if step > 0 and group == tuple(range(group[0], group[-1] + 1, step)):
            return f"({group[0]}..{group[-1]})" if step == 1 else f"({group[0]}..{group[-1]} step {step})"
    return str(group)
