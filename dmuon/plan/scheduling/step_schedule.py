r"""The step as data: what every rank does in one training step, in order.

``schedule(plan, step=None) -> StepSchedule`` is pure (no process group, no tensors). It replays
the hook-boundary state machine that ``dmuon.exec`` runs (pre-forward, post-forward,
pre-backward, post-backward, the end-of-backward callback, the optimizer step) over a described
step and records every operation as a frozen :class:`Op`:

=========================  ==========================================================  ========
op kind                    what                                                        issued
=========================  ==========================================================  ========
``broadcast``              a segment to its shard group (``forward_broadcast`` /        dmuon
                           ``backward_broadcast``); HSDP: a sub-segment from its owner
                           to its replicate group after the step (``replicate_broadcast``)
``reduce``                 a segment's gradients SUM-reduced to its holder (``reduce``);
                           HSDP: a sub-segment over the replicate group to its owner
                           (``replicate_reduce``)
``all_reduce``             TP Gram NS: the fp32 Gram of a batch of matrices over the
                           owner's TP group, one per Gram segment (``tp``)
``all_gather``             TP gather: the owner group's local updates (``tp``)
``all_reduce``             owner groups (``compile(owner_groups=...)``): the fp32 Gram
                           of a batch of grouped matrices over their members, one per
                           Gram segment (``owner_group``)
``newton_schulz``          the owner's momentum + NS + update of one matrix (FLOPs)     dmuon
``forward`` / ``backward`` the boundary's own compute; ``recompute`` for activation     external
/ ``recompute``            checkpointing (between its pre-backward and backward)
``fsdp2_all_gather`` /     FSDP2's own collectives of the parameters dmuon does not     external
``fsdp2_reduce_scatter`` / dedicate (norms, biases, embeddings, ``lm_head``), per
``fsdp2_all_reduce``       ``fully_shard`` unit (``plan.fsdp2_units``): the root's at
                           the start of the forward and the end of the backward, a
                           boundary's at its hooks; HSDP adds the replicate all-reduce
=========================  ==========================================================  ========

FSDP2's ops are modelled on the documented set-up (``fully_shard`` on every hook boundary, then
on the root, with the plan's ``reshard_after_forward``): one all-gather per unit and dtype of the
padded dim-0 shards (``numel`` = elements per rank, in the mixed-precision ``param_dtype``), again
before a Z3 backward, and one reduce-scatter of the gradients (``reduce_dtype``); FSDP2's own
prefetching and the root's reshard policy are not modelled.

Ranks are *schedule ranks*: the mesh rank ``replicate*N + shard`` without tensor parallelism and
``(replicate*N + shard)*T + tp`` with a TP degree ``T > 1`` (the layout of
``init_device_mesh(device, (R, N, T))``), the indexing of ``ByteCost.per_rank_nbytes``. A
group is the tuple of schedule ranks that take part; a root is a schedule rank.

Representation (symmetric form): ``StepSchedule.ops`` is one table in issue order; every op is
shared by all members of its group, and each rank issues exactly the ops whose group contains
it, in table order (:meth:`StepSchedule.rank_ops`). Bytes charged to a rank follow the ledger's
rule (:func:`dmuon.plan.cost.model.collective_rank_nbytes`): every non-root rank of a broadcast or
reduce of ``S`` bytes is charged ``S``; each rank of an all-reduce of ``numel`` elements over
``k`` ranks ``2·(k-1)·ceil(numel/k)·itemsize``; each rank of an all-gather of ``S`` bytes per
rank ``(k-1)·S``. External ops are not charged.

:func:`replay` checks per-rank op lists for deadlock freedom the way collectives match at run
time: the ``i``-th collective a rank issues on a group is matched with the ``i``-th of every
other member, must agree on kind, root, dtype and size, and completes only when every member
has reached it. ``compile`` runs it on the nominal step; :meth:`StepSchedule.check` on any.

What a :class:`Step` can describe: micro-batches (gradient accumulation), each with its
forward order (repeats: a boundary called twice; omissions: a boundary not called), its
gradient-sync flag (``dmuon.no_sync`` / FSDP2's ``set_requires_gradient_sync(False)``), and the
boundaries recomputed under activation checkpointing; and the dedicated matrices that receive no
gradient on any rank (``unused``), which Muon skips. The backward visits the forward calls in
reverse (a sequential model). The Muon step assumes one Muon parameter group in plan order, as
``dmuon.Muon(model)`` builds it.
"""

from __future__ import annotations

import bisect
import dataclasses
import heapq
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from dmuon.plan.cost import model as _cost
from dmuon.plan import rules as _rules
from dmuon.plan.records.params import ExpertOwners, OwnerGroup, itemsize_nbytes

if TYPE_CHECKING:
    from dmuon.plan.records.plan import ShardingPlan

__all__ = [
    "COLLECTIVE_KINDS",
    "EXTERNAL_KINDS",
    "Op",
    "MicroBatch",
    "Step",
    "StepSchedule",
    "BoundaryProgram",
    "ScheduleError",
    "boundary_programs",
    "schedule",
    "replay",
]

#: op kinds that are collectives (matched across the members of their group)
COLLECTIVE_KINDS = ("broadcast", "reduce", "all_reduce", "all_gather")
#: op kinds dmuon does not issue or charge: the step's own compute, and FSDP2's collectives of
#: the parameters dmuon does not dedicate (FSDP2's own process groups; not replayed)
EXTERNAL_KINDS = ("forward", "backward", "recompute", "fsdp2_all_gather", "fsdp2_reduce_scatter", "fsdp2_all_reduce")
#: every op kind
OP_KINDS = COLLECTIVE_KINDS + ("newton_schulz",) + EXTERNAL_KINDS
#: the ledger phases a schedule charges bytes to (``ByteCost`` fields without ``_nbytes``)
CHARGED_PHASES = (
    "forward_broadcast", "backward_broadcast", "reduce", "replicate_reduce", "replicate_broadcast", "tp", "owner_group",
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
    """One operation of a step (module docstring table).

    Attributes:
        id: index in :attr:`StepSchedule.ops`.
        kind: one of :data:`OP_KINDS`.
        phase: the ledger phase of a collective (``"forward_broadcast"``, ``"backward_broadcast"``,
            ``"reduce"``, ``"replicate_reduce"``, ``"replicate_broadcast"``, ``"tp"``);
            ``"optimizer"`` for Newton-Schulz, ``"compute"`` for external ops.
        group: schedule ranks that take part (a collective) or each run it (a local op).
        root: source of a broadcast / destination of a reduce (a schedule rank), else None.
        dtype: wire dtype string of a collective, else None.
        numel: elements per rank (broadcast / reduce payload, all-reduce tensor, all-gather input).
        flops: Newton-Schulz FLOPs each member runs (matmuls; ``newton_schulz`` ops only).
        boundary: FQN of the hook boundary (None for TP and NS ops).
        buffer: :attr:`~dmuon.plan.layout.buffers.BufferLayout.key` of the boundary buffer the op moves
            (its storage dtype; ``"<dtype>/ep<k>"`` for expert-parallel ranges), None if not a
            buffer op.
        segment: shard coordinate of the segment (buffer ops).
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
        return _cost.collective_rank_nbytes(
            self.kind, self.numel, itemsize_nbytes(self.dtype), len(self.group), rank == self.root  # type: ignore[arg-type]
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
        if self.forward is not None and (type(self.forward) is not tuple or not all(isinstance(f, str) for f in self.forward)):
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
    """

    micro_batches: tuple[MicroBatch, ...] = (MicroBatch(),)
    unused: tuple[str, ...] = ()

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


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class BoundaryProgram:
    """The collectives of one hook boundary per phase, for every rank (ops with ``id = -1``).

    The runtime binds these lists to its buffers once; its hooks decide when each list runs.
    Order within a list: buffers by dtype, segments by shard, sub-segments by replicate; rows of
    the mesh (and TP coordinates) one after another (their groups are disjoint).
    ``backward_broadcast`` is empty in Z2: the buffers stay resident from the forward.
    """

    fqn: str
    index: int
    forward_broadcast: tuple[Op, ...]
    backward_broadcast: tuple[Op, ...]
    reduce: tuple[Op, ...]
    replicate_reduce: tuple[Op, ...]
    replicate_broadcast: tuple[Op, ...]


# ----------------------------------------------------------------------------------- ranks


def _rank_fns(plan: ShardingPlan):
    R, N = plan.mesh_shape
    T = plan.tp_size

    def rank(r: int, s: int, t: int = 0) -> int:
        return (r * N + s) * T + t

    rows = {(r, t): tuple(rank(r, s, t) for s in range(N)) for r in range(R) for t in range(T)}
    cols = {(s, t): tuple(rank(r, s, t) for r in range(R)) for s in range(N) for t in range(T)}
    tps = {(r, s): tuple(rank(r, s, t) for t in range(T)) for r in range(R) for s in range(N)}
    return rank, rows, cols, tps


def boundary_programs(plan: ShardingPlan) -> tuple[BoundaryProgram, ...]:
    """Every boundary's per-phase collectives (:class:`BoundaryProgram`), plan order. Pure."""
    R, N = plan.mesh_shape
    T = plan.tp_size
    rank, rows, cols, _ = _rank_fns(plan)
    out = []
    for index, b in enumerate(plan.boundaries):
        fwd: list[Op] = []
        bwd: list[Op] = []
        red: list[Op] = []
        rep_red: list[Op] = []
        rep_bc: list[Op] = []
        for t in range(T):
            for r in range(R):
                for buf in b.buffers:
                    wire = plan.bcast_dtype(buf.dtype)
                    red_dtype = plan.reduce_dtype_for(buf.dtype)
                    for seg in buf.segments:
                        group = rows[(r, t)]
                        if buf.ep > 1:  # expert-parallel ranges: the segment's efsdp group only
                            group = tuple(rank(r, s, t) for s in buf.group_shards(seg.shard, N))
                        common = dict(id=-1, group=group, root=rank(r, seg.shard, t), numel=seg.numel,
                                      boundary=b.fqn, buffer=buf.key, segment=seg.shard)
                        if len(group) > 1:  # a one-rank group has nothing to broadcast
                            fwd.append(Op(kind="broadcast", phase="forward_broadcast", dtype=wire, **common))
                            if plan.reshard_after_forward:
                                bwd.append(Op(kind="broadcast", phase="backward_broadcast", dtype=wire, **common))
                        red.append(Op(kind="reduce", phase="reduce", dtype=red_dtype, **common))
        if R > 1:
            for buf in b.buffers:
                red_dtype = plan.reduce_dtype_for(buf.dtype)
                for seg in buf.segments:
                    for sub in seg.subsegments:
                        for t in range(T):
                            common = dict(id=-1, group=cols[(seg.shard, t)], root=rank(sub.owner.replicate, seg.shard, t),
                                          numel=sub.numel, boundary=b.fqn, buffer=buf.key, segment=seg.shard,
                                          subsegment=sub.owner.replicate)
                            rep_red.append(Op(kind="reduce", phase="replicate_reduce", dtype=red_dtype, **common))
                            rep_bc.append(Op(kind="broadcast", phase="replicate_broadcast", dtype=buf.dtype, **common))
        out.append(
            BoundaryProgram(
                fqn=b.fqn, index=index, forward_broadcast=tuple(fwd), backward_broadcast=tuple(bwd),
                reduce=tuple(red), replicate_reduce=tuple(rep_red), replicate_broadcast=tuple(rep_bc),
            )
        )
    return tuple(out)


# ----------------------------------------------------------------------------------- schedule


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class StepSchedule:
    """Every rank's ops for one step (module docstring), built by :func:`schedule`.

    Attributes:
        mesh_shape: ``(R, N)`` of the plan. tp_size: ``T``. reshard_after_forward: Z3 / Z2.
        step: the :class:`Step` scheduled. ops: the op table in issue order (``ops[i].id == i``).
    """

    mesh_shape: tuple[int, int]
    tp_size: int
    reshard_after_forward: bool
    step: Step
    ops: tuple[Op, ...]
    # derived at construction: distinct groups, op ids per group, groups of each rank
    _groups: tuple[tuple[int, ...], ...] = dataclasses.field(default=(), init=False, repr=False, compare=False)
    _group_ops: tuple[tuple[int, ...], ...] = dataclasses.field(default=(), init=False, repr=False, compare=False)
    _rank_groups: tuple[tuple[int, ...], ...] = dataclasses.field(default=(), init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        n = self.num_ranks
        index: dict[tuple[int, ...], int] = {}
        # ops built from one template share its group tuple: look groups up by identity first
        # (hashing a 4096-rank tuple per op dominated schedules of 1000s of ranks)
        by_id: dict[int, int] = {}
        members: list[frozenset] = []
        group_ops: list[list[int]] = []
        for i, op in enumerate(self.ops):
            if op.id != i:
                raise ValueError(f"StepSchedule: ops[{i}].id is {op.id}")
            g = by_id.get(id(op.group))
            if g is None:
                g = index.get(op.group)
                if g is None:
                    problem = _group_problem(op.group, n)
                    if problem is not None:
                        raise ScheduleError(f"StepSchedule: {op.describe()}: {problem}", op=op)
                    g = index[op.group] = len(group_ops)
                    group_ops.append([])
                    members.append(frozenset(op.group))
                by_id[id(op.group)] = g
            group_ops[g].append(i)
            problem = _op_problem(op, members[g])
            if problem is not None:
                raise ScheduleError(f"StepSchedule: {op.describe()}: {problem}", op=op)
        rank_groups: list[list[int]] = [[] for _ in range(n)]
        for group, g in index.items():
            for x in group:
                rank_groups[x].append(g)
        object.__setattr__(self, "_groups", tuple(index))
        object.__setattr__(self, "_group_ops", tuple(tuple(v) for v in group_ops))
        object.__setattr__(self, "_rank_groups", tuple(tuple(v) for v in rank_groups))

    @property
    def num_ranks(self) -> int:
        """``R * N * T`` schedule ranks."""
        return self.mesh_shape[0] * self.mesh_shape[1] * self.tp_size

    def rank_ops(self, rank: int) -> tuple[Op, ...]:
        """Ops schedule rank ``rank`` issues or runs, in order. O(its ops · log(its groups))."""
        if not 0 <= rank < self.num_ranks:
            raise IndexError(f"rank {rank} is not in 0..{self.num_ranks - 1}")
        lists = [self._group_ops[g] for g in self._rank_groups[rank]]
        ids = lists[0] if len(lists) == 1 else list(heapq.merge(*lists))
        return tuple(self.ops[i] for i in ids)

    def rank_nbytes(self, rank: int, phase: str | None = None) -> int:
        """Bytes charged to ``rank`` (in ledger phase ``phase``, or all phases).

        Raises:
            ValueError: ``phase`` is not a phase dmuon charges.
        """
        if phase is not None and phase not in CHARGED_PHASES:
            raise ValueError(f"phase must be one of {CHARGED_PHASES} or None, got {phase!r}")
        return sum(op.charged_nbytes(rank) for op in self.rank_ops(rank) if phase is None or op.phase == phase)

    def boundary_ops(self, rank: int, boundary: str) -> tuple[Op, ...]:
        """``rank``'s ops of hook boundary ``boundary`` (e.g. the first boundary's, for display).

        Raises:
            ValueError: no op of the schedule names ``boundary``.
        """
        if not any(op.boundary == boundary for op in self.ops):
            known = sorted({op.boundary for op in self.ops if op.boundary})
            raise ValueError(f"no op of this schedule belongs to boundary {boundary!r}; boundaries: {known[:6]}")
        return tuple(op for op in self.rank_ops(rank) if op.boundary == boundary)

    def _pieces(self, coll: Sequence[tuple[int, ...]]) -> list[list[tuple[int, int]]]:
        """Per rank: its collectives as ``(group index, count)`` runs of consecutive ops on one
        group (the replay's input in the symmetric form); ``coll[g]``: group ``g``'s collective
        op ids in order."""
        out = []
        for rank in range(self.num_ranks):
            mine = [(g, coll[g]) for g in self._rank_groups[rank] if coll[g]]
            pieces: list[tuple[int, int]] = []
            if len(mine) == 1:
                pieces.append((mine[0][0], len(mine[0][1])))
            elif mine:
                # merge by op id; runs of one group become one piece
                heads = [(ids[0], g, 0) for g, ids in mine]
                heapq.heapify(heads)
                by_g = dict(mine)
                while heads:
                    _, g, pos = heapq.heappop(heads)
                    ids = by_g[g]
                    nxt = heads[0][0] if heads else None
                    end = len(ids) if nxt is None else bisect.bisect_left(ids, nxt, pos)
                    if pieces and pieces[-1][0] == g:
                        pieces[-1] = (g, pieces[-1][1] + end - pos)
                    else:
                        pieces.append((g, end - pos))
                    if end < len(ids):
                        heapq.heappush(heads, (ids[end], g, end))
            out.append(pieces)
        return out

    def check(self) -> None:
        """Deadlock check by replay (:func:`replay`) of every rank's op list. Raises
        :class:`ScheduleError`."""
        coll = [tuple(i for i in ops if self.ops[i].collective) for ops in self._group_ops]
        canonical = [tuple(self.ops[i] for i in ids) for ids in coll]
        _replay_pieces(self._groups, canonical, self._pieces(coll), None)

    def summary(self, rank: int, *, boundary: str | None = None, max_ops: int | None = None) -> str:
        """``rank``'s ops as a table, one per line, with the bytes charged to it (all its ops,
        or those of hook boundary ``boundary``; at most ``max_ops`` lines)."""
        ops = self.rank_ops(rank) if boundary is None else self.boundary_ops(rank, boundary)
        shown = ops if max_ops is None else ops[:max_ops]
        width = max([len(op.boundary or "") for op in shown] + [8])
        lines = [f"{'op':>7}  {'kind':<22}{'phase':<20}{'boundary':<{width + 2}}{'seg':<6}{'root':>5}"
                 f"{'elements / FLOP':>22} {'dtype':<10}{'group':<20}{'charged':>16}"]
        for op in shown:
            seg = "" if op.segment is None else str(op.segment) + ("" if op.subsegment is None else f"/{op.subsegment}")
            grp = "all" if op.kind in ("forward", "backward", "recompute") else _fmt_group(op.group)
            size = f"{op.numel:,}" if op.dtype else (f"{op.flops:,} FLOP" if op.flops else "")
            dtype = (op.dtype or "").replace("torch.", "")
            root = "" if op.root is None else str(op.root)
            where = "<root>" if op.boundary == "" else (op.boundary or "")
            lines.append(
                f"{op.id:>7}  {op.kind:<22}{op.phase:<20}{where:<{width + 2}}{seg:<6}{root:>5}"
                f"{size:>22} {dtype:<10}{grp:<20}{op.charged_nbytes(rank):>14,} B"
            )
        if len(shown) < len(ops):
            lines.append(f"{'':>7}  ... {len(ops) - len(shown)} more ops")
        return "\n".join(lines)


def _fmt_group(group: tuple[int, ...]) -> str:
    """``(0, 1, 2, 3)``, or ``(0..1023)`` / ``(3..1023 step 8)`` for a long arithmetic run."""
    if len(group) > 4:
        step = group[1] - group[0]
        if step > 0 and group == tuple(range(group[0], group[-1] + 1, step)):
            return f"({group[0]}..{group[-1]})" if step == 1 else f"({group[0]}..{group[-1]} step {step})"
    return str(group)


class _Builder:
    """Emits ops in issue order while replaying the boundary state machine of ``dmuon.exec``."""

    def __init__(self, plan: ShardingPlan, step: Step):
        self.plan = plan
        self.step = step
        self.programs = boundary_programs(plan)
        self.by_fqn = {p.fqn: p for p in self.programs}
        self.ops: list[Op] = []
        self.resident = [False] * len(self.programs)  # unsharded: segments broadcast and kept
        self.pending = [0] * len(self.programs)  # grad-enabled forwards awaiting their backward
        self.last_bcast: list[tuple[int, ...]] = [()] * len(self.programs)
        self.last_reduce: dict[int, tuple[int, ...]] = {}  # boundary index -> reduce op ids (last)
        self.last_rep_reduce: dict[int, tuple[int, ...]] = {}
        self.everyone = tuple(range(plan.world_size * plan.tp_size))
        _, rows, cols, self.tps = _rank_fns(plan)
        self.rows = tuple(rows.values())
        self.cols = tuple(cols.values()) if plan.mesh_shape[0] > 1 else ()
        N = plan.mesh_shape[1]
        self.fsdp2_units: dict[str, list[tuple[str, int, int]]] = {}  # unit -> (dtype, shard numel, of grads)
        for unit in plan.fsdp2_units:
            per: dict[str, list[int]] = {}
            for shape, dtype, grad in zip(unit.shapes, unit.dtypes, unit.requires_grad):
                c = _cost.fsdp2_shard_numel(shape, N)
                acc = per.setdefault(dtype, [0, 0])
                acc[0] += c
                acc[1] += c if grad else 0
            self.fsdp2_units[unit.fqn] = [(d, a, g) for d, (a, g) in sorted(per.items())]
        self.fsdp2_resident: set[str] = set()

    def fsdp2(self, unit: str, kind: str, mb: int, deps: tuple[int, ...] = ()) -> tuple[int, ...]:
        """FSDP2's collectives of ``unit``'s non-dedicated parameters, one per row and dtype."""
        plan = self.plan
        N = plan.mesh_shape[1]
        ids = []
        for dtype, numel, grad_numel in self.fsdp2_units.get(unit, ()):
            if kind == "fsdp2_all_gather":
                size, wire, groups = numel, plan.bcast_dtype(dtype), self.rows
            elif kind == "fsdp2_reduce_scatter":
                size, wire, groups = grad_numel, plan.reduce_dtype_for(dtype), self.rows
            else:  # HSDP: the reduce-scattered shards all-reduced over the replicate group
                size, wire, groups = grad_numel, plan.reduce_dtype_for(dtype), self.cols
            if size == 0 or (kind != "fsdp2_all_reduce" and N == 1):
                continue
            for group in groups:
                ids.append(self.emit(kind=kind, phase="fsdp2", group=group, dtype=wire, numel=size,
                                     boundary=unit, micro_batch=mb, deps=deps, external=True))
        return tuple(ids)

    def emit(self, template: Op | None = None, **fields: Any) -> int:
        i = len(self.ops)
        if template is not None:
            self.ops.append(dataclasses.replace(template, id=i, **fields))
        else:
            self.ops.append(Op(id=i, **fields))
        return i

    def boundary_index(self, fqn: str) -> int:
        p = self.by_fqn.get(fqn)
        if p is None:
            raise ValueError(
                f"dmuon.plan.schedule: {fqn!r} is not a hook boundary of this plan; boundaries: "
                f"{[q.fqn for q in self.programs][:6]}"
            )
        return p.index

    # -- the hooks, as dmuon.exec runs them ------------------------------------------------
    def unshard(self, b: int, phase: str, mb: int) -> None:
        if self.resident[b]:
            return
        prog = self.programs[b]
        templates = prog.forward_broadcast if phase == "forward_broadcast" else prog.backward_broadcast
        self.last_bcast[b] = tuple(self.emit(t, micro_batch=mb) for t in templates)
        self.resident[b] = True

    def fsdp2_unshard(self, unit: str, mb: int) -> tuple[int, ...]:
        if unit in self.fsdp2_resident:
            return ()
        self.fsdp2_resident.add(unit)
        return self.fsdp2(unit, "fsdp2_all_gather", mb)

    def forward(self, b: int, mb: int) -> None:
        self.unshard(b, "forward_broadcast", mb)
        if b + 1 < len(self.programs):  # prefetch the next boundary in plan order
            self.unshard(b + 1, "forward_broadcast", mb)
        self.pending[b] += 1
        fqn = self.programs[b].fqn
        gathered = self.fsdp2_unshard(fqn, mb)
        self.emit(kind="forward", phase="compute", group=self.everyone, boundary=fqn, micro_batch=mb,
                  deps=self.last_bcast[b] + gathered, external=True)
        if self.plan.reshard_after_forward:
            self.resident[b] = False
            self.fsdp2_resident.discard(fqn)

    def backward(self, b: int, mb: int, sync: bool, recompute: bool) -> None:
        fqn = self.programs[b].fqn
        if self.pending[b] > 0:  # pre-backward
            self.unshard(b, "backward_broadcast", mb)
            if b > 0 and self.pending[b - 1] > 0:  # prefetch the previous boundary
                self.unshard(b - 1, "backward_broadcast", mb)
        deps = self.last_bcast[b] + self.fsdp2_unshard(fqn, mb)
        if recompute:
            deps = (self.emit(kind="recompute", phase="compute", group=self.everyone, boundary=fqn, micro_batch=mb,
                              deps=deps, external=True),)
        compute = self.emit(kind="backward", phase="compute", group=self.everyone, boundary=fqn, micro_batch=mb,
                            deps=deps, external=True)
        self.pending[b] -= 1  # post-backward
        if self.pending[b] == 0:
            self.finish(b, mb, sync, (compute,))
            self.fsdp2_resident.discard(fqn)
            if sync:
                rs = self.fsdp2(fqn, "fsdp2_reduce_scatter", mb, (compute,))
                self.fsdp2(fqn, "fsdp2_all_reduce", mb, rs)

    def finish(self, b: int, mb: int, sync: bool, deps: tuple[int, ...]) -> None:
        self.pending[b] = 0
        if sync:
            if b in self.inflight:  # reduced twice in one backward: finish the first one first
                self.finish_reduces(mb)
            self.last_reduce[b] = tuple(self.emit(t, micro_batch=mb, deps=deps) for t in self.programs[b].reduce)
            self.inflight.append(b)
        self.resident[b] = False

    def finish_reduces(self, mb: int) -> None:
        inflight, self.inflight = self.inflight, []
        for b in inflight:
            by_seg: dict[tuple, list[int]] = {}
            for i in self.last_reduce[b]:
                by_seg.setdefault((self.ops[i].buffer, self.ops[i].segment), []).append(i)
            # each waits for the shard-group reduces of its segment (a rank waits for its row's)
            self.last_rep_reduce[b] = tuple(
                self.emit(t, micro_batch=mb, deps=tuple(by_seg[(t.buffer, t.segment)]))
                for t in self.programs[b].replicate_reduce
            )

    def micro_batch(self, mb: int, micro: MicroBatch) -> None:
        calls = [p.index for p in self.programs] if micro.forward is None else [self.boundary_index(f) for f in micro.forward]
        recompute = {self.boundary_index(f) for f in micro.recompute}
        if recompute - set(calls):
            raise ValueError(
                f"dmuon.plan.schedule: micro-batch {mb} recomputes "
                f"{sorted(self.programs[b].fqn for b in recompute - set(calls))}, which its forward does not call"
            )
        self.inflight: list[int] = []
        self.fsdp2_unshard("", mb)  # the root unit (embeddings, final norm, lm_head)
        for b in calls:
            self.forward(b, mb)
        for b in reversed(calls):
            self.backward(b, mb, micro.sync, b in recompute)
        for b in reversed(range(len(self.programs))):  # end-of-backward callback
            if self.pending[b] > 0:
                self.finish(b, mb, micro.sync, ())
        self.finish_reduces(mb)
        self.resident = [False] * len(self.programs)  # prefetched but never called: freed too
        if micro.sync:
            rs = self.fsdp2("", "fsdp2_reduce_scatter", mb)
            self.fsdp2("", "fsdp2_all_reduce", mb, rs)
        self.fsdp2_resident.clear()

    def gram_bucket(self, group, phase: str, d: int, bucket, flops, reduce_deps, ns_ids, mb: int) -> None:
        """Sharded Gram NS of one bucket of matrices on ``group`` (a TP group or an owner group):
        one fp32 all-reduce of the bucket's ``(d, d)`` Grams per Gram segment, each after the
        previous one, then every matrix's NS op (``flops[i]`` per member) after all of them."""
        deps = tuple(i for spec in bucket for i in reduce_deps[spec.fqn])
        ar = []
        for _ in self.plan.tp_segment_lengths:
            ar.append(self.emit(kind="all_reduce", phase=phase, group=group, dtype=_rules.TP_GRAM_DTYPE,
                                numel=len(bucket) * d * d, fqns=tuple(sp.fqn for sp in bucket),
                                micro_batch=mb, deps=deps))
            deps = (ar[-1],)
        for spec, f in zip(bucket, flops):
            ns_ids[spec.fqn] = self.emit(kind="newton_schulz", phase="optimizer", group=group, flops=f,
                                         fqns=(spec.fqn,), micro_batch=mb, deps=tuple(ar))

    def optimizer_step(self, mb: int) -> None:
        plan = self.plan
        R = plan.mesh_shape[0]
        tps = self.tps
        unused = set()
        for name in self.step.unused:
            try:
                unused.add(plan.param(name).fqn)
            except KeyError as exc:
                raise ValueError(f"dmuon.plan.schedule: Step.unused: {exc.args[0]}") from None
        # a matrix whose boundary was never reduced (never called, or only in no_sync
        # micro-batches) has no gradient on any rank: Muon skips it
        reduced = {self.programs[b].fqn for b in self.last_reduce}
        unused |= {spec.fqn for spec in plan.params if plan.boundary(spec.fqn) not in reduced}
        reduce_deps: dict[str, tuple[int, ...]] = {}
        for i, b in enumerate(plan.boundaries):
            deps = self.last_rep_reduce.get(i, ()) if R > 1 else self.last_reduce.get(i, ())
            for e in b.entries():
                reduce_deps[e.fqn] = deps
            for fqn in b.local:  # expert-parallel stacks: the local gradient, nothing reduced
                reduce_deps[fqn] = ()
        ns_ids: dict[str | tuple[str, int], int] = {}  # fqn, or (fqn, range) of an expert stack
        tp_entries: dict[tuple[int, int], list] = {}
        owner_groups: dict[tuple[int, ...], list] = {}
        for spec, owner in zip(plan.params, plan.owners):
            if spec.fqn in unused:
                continue
            if isinstance(owner, OwnerGroup):  # no TP with owner groups: schedule ranks are mesh ranks
                owner_groups.setdefault(tuple(sorted(owner.ranks)), []).append((spec, owner))
                continue
            if isinstance(owner, ExpertOwners):  # each member orthogonalises its own experts: no collective
                per_expert = _cost.spec_ns_flops(spec) // spec.num_experts
                for j, (member, size) in enumerate(zip(owner.members, owner.sizes)):
                    ns_ids[(spec.fqn, j)] = self.emit(  # keyed by (fqn, range): its replica broadcast waits for it
                        kind="newton_schulz", phase="optimizer", group=tps[(member.replicate, member.shard)],
                        flops=per_expert * size, fqns=(spec.fqn,), micro_batch=mb, deps=reduce_deps[spec.fqn],
                    )
                continue
            group = tps[(owner.replicate, owner.shard)]
            if spec.tp_size > 1:
                tp_entries.setdefault((owner.replicate, owner.shard), []).append(spec)
                continue
            ns_ids[spec.fqn] = self.emit(
                kind="newton_schulz", phase="optimizer", group=group, flops=_cost.spec_ns_flops(spec),
                fqns=(spec.fqn,), micro_batch=mb, deps=reduce_deps[spec.fqn],
            )
        # TP owner groups (dmuon.exec's TP orthogonalisation): Gram buckets by (d, D_local, dtype)
        # in plan order, ``segments`` fp32 all-reduces each; then one all-gather per dtype
        lengths = plan.tp_segment_lengths
        for (r, s), specs in tp_entries.items():
            group = tps[(r, s)]
            gram: dict[tuple, list] = {}
            gather: dict[str, list] = {}
            for spec in specs:
                if spec.tp_ns == "local":  # view blocks inside the TP shards: NS on each rank's own blocks
                    ns_ids[spec.fqn] = self.emit(kind="newton_schulz", phase="optimizer", group=group,
                                                 flops=_cost.tp_ns_flops(spec, lengths), fqns=(spec.fqn,),
                                                 micro_batch=mb, deps=reduce_deps[spec.fqn])
                elif spec.tp_ns == "gram":
                    d = _cost.tp_gram_side(spec.shape, spec.tp_shard_dim)  # type: ignore[arg-type]
                    gram.setdefault((d, spec.local_numel // d, spec.dtype), []).append(spec)
                else:
                    gather.setdefault(spec.dtype, []).append(spec)
            for (d, _, _), bucket in gram.items():
                self.gram_bucket(group, "tp", d, bucket, [_cost.tp_ns_flops(sp, lengths) for sp in bucket],
                                 reduce_deps, ns_ids, mb)
            for dtype, bucket in gather.items():
                deps = tuple(i for spec in bucket for i in reduce_deps[spec.fqn])
                ag = self.emit(kind="all_gather", phase="tp", group=group, dtype=dtype,
                               numel=sum(sp.local_numel for sp in bucket), fqns=tuple(sp.fqn for sp in bucket),
                               micro_batch=mb, deps=deps)
                for spec in bucket:
                    ns_ids[spec.fqn] = self.emit(kind="newton_schulz", phase="optimizer", group=group,
                                                 flops=_cost.tp_ns_flops(spec, lengths), fqns=(spec.fqn,),
                                                 micro_batch=mb, deps=(ag,))
        # owner groups (dmuon.exec's grouped orthogonalisation): per group in order of first
        # appearance, Gram buckets by (d, padded block width, dtype) in plan order, one fp32
        # all-reduce of the bucket's (d, d) Grams per Gram segment, then every member's NS
        lengths = plan.tp_segment_lengths
        for ranks, entries in owner_groups.items():
            gram_buckets: dict[tuple, list] = {}
            for spec, owner in entries:
                d = int(spec.shape[1 - owner.dim])
                gram_buckets.setdefault((d, max(owner.sizes), spec.dtype), []).append(spec)
            for (d, width, _), bucket in gram_buckets.items():
                flops = _cost.gram_ns_segment_flops(d, width, lengths)
                self.gram_bucket(ranks, "owner_group", d, bucket, [flops] * len(bucket), reduce_deps, ns_ids, mb)
        qk_ids: tuple[int, ...] = ()
        if plan.qk_clip is not None:  # QK-clip: one all-reduce (max) of every layer's per-head max logits
            qk_ids = (self.emit(kind="all_reduce", phase="qk_clip", group=self.everyone,
                                dtype=QK_CLIP_DTYPE, numel=plan.qk_clip.num_heads, micro_batch=mb,
                                deps=tuple(ns_ids.values())),)
        if R > 1:  # HSDP: owners broadcast the new values to their replicate peers
            for prog, b in zip(self.programs, plan.boundaries):
                subs = {(buf.key, seg.shard, sub.owner.replicate): sub for buf in b.buffers for seg in buf.segments for sub in seg.subsegments}
                for t in prog.replicate_broadcast:
                    sub = subs[(t.buffer, t.segment, t.subsegment)]
                    ns = (ns_ids.get((e.fqn, e.block), ns_ids.get(e.fqn)) for e in sub.entries)
                    deps = tuple(i for i in ns if i is not None) + qk_ids
                    self.emit(t, micro_batch=mb, deps=deps)


def schedule(plan: ShardingPlan, step: Step | None = None) -> StepSchedule:
    """The :class:`StepSchedule` of ``step`` (default: the nominal step: every boundary once in
    forward order, backward in reverse, one micro-batch that syncs) under ``plan``. Pure.

    Raises:
        TypeError: ``step`` is not a :class:`Step`.
        ValueError: ``step`` names a boundary or parameter the plan does not have, or
            recomputes a boundary its micro-batch does not call.
    """
    step = Step() if step is None else step
    if not isinstance(step, Step):
        raise TypeError(f"step must be a dmuon.plan.Step, got {type(step).__name__}")
    b = _Builder(plan, step)
    last = len(step.micro_batches) - 1
    for mb, micro in enumerate(step.micro_batches):
        b.micro_batch(mb, micro)
    b.optimizer_step(last)
    return StepSchedule(
        mesh_shape=plan.mesh_shape,
        tp_size=plan.tp_size,
        reshard_after_forward=plan.reshard_after_forward,
        step=step,
        ops=tuple(b.ops),
    )


# ----------------------------------------------------------------------------------- replay


def replay(programs: Sequence[Sequence[Op]]) -> None:
    """Deadlock check of explicit per-rank op lists (``programs[rank]``), by replay.

    Every rank runs its list with blocking collectives; local ops never block. The ``i``-th
    collective a rank issues on a group (a tuple of ranks) is matched with the ``i``-th one of
    every other member, as process groups match collectives at run time; it completes when every
    member has reached it. Runs in O(ranks + groups + collectives) batches.

    Raises:
        ScheduleError: a rank issues an op on a group it is not in; members disagree on a
            collective (kind, root, dtype, numel); or no rank can proceed: the message names
            the first stuck rank's op and the cycle of waiting ranks (or the member that ends
            its step without reaching the collective).
    """
    index: dict[tuple[int, ...], int] = {}
    per_rank: list[list[tuple[int, int]]] = []
    member_ops: dict[tuple[int, int], list[Op]] = {}
    n = len(programs)
    valid_groups: set = set()
    for rank, prog in enumerate(programs):
        pieces: list[tuple[int, int]] = []
        for op in prog:
            _check_op(op, rank, n, valid_groups)
            if not op.collective:
                continue
            g = index.setdefault(op.group, len(index))
            member_ops.setdefault((g, rank), []).append(op)
            if pieces and pieces[-1][0] == g:
                pieces[-1] = (g, pieces[-1][1] + 1)
            else:
                pieces.append((g, 1))
        per_rank.append(pieces)
    _replay_pieces(tuple(index), None, per_rank, member_ops)


def _group_problem(group: Any, num_ranks: int) -> str | None:
    """Why ``group`` is not a tuple of distinct ranks in ``0..num_ranks-1`` (None if it is)."""
    if type(group) is not tuple or not group or len(set(group)) != len(group) or any(
        type(x) is not int or not 0 <= x < num_ranks for x in group
    ):
        return f"group {group!r} is not a tuple of distinct ranks in 0..{num_ranks - 1}"
    return None


def _op_problem(op: Op, members: frozenset | None = None) -> str | None:
    """Why ``op`` (on a valid group) cannot run: an unknown kind, a root outside its group or on
    a kind without one, a negative size, a collective without a dtype (None if it can).
    ``members``: ``frozenset(op.group)`` when the caller has it (membership in O(1))."""
    if op.kind not in OP_KINDS:
        return f"unknown kind {op.kind!r} (one of {OP_KINDS})"
    if op.kind in ROOTED_KINDS and op.root not in (op.group if members is None else members):
        return f"its root {op.root!r} is not a member of its group {_fmt_group(op.group)}"
    if op.kind not in ROOTED_KINDS and op.root is not None:
        return f"{op.kind} takes no root, got {op.root!r}"
    if type(op.numel) is not int or op.numel < 0:
        return f"numel must be an int >= 0, got {op.numel!r}"
    if op.collective and op.dtype is None:
        return "a collective needs a dtype"
    return None


def _check_op(op: Any, rank: int, num_ranks: int, valid_groups: set) -> None:
    """One entry of ``rank``'s program, on its own (:func:`_group_problem`, membership,
    :func:`_op_problem`); ``valid_groups`` memoises groups already found valid."""
    if not isinstance(op, Op):
        raise ScheduleError(f"rank {rank}'s program holds {op!r}, not a dmuon.plan.Op", rank=rank)
    problem = None
    if op.group not in valid_groups:
        problem = _group_problem(op.group, num_ranks)
        if problem is None:
            valid_groups.add(op.group)
    if problem is None and rank not in op.group:
        problem = f"it is on group {_fmt_group(op.group)}, which rank {rank} is not in"
    if problem is None:
        problem = _op_problem(op)
    if problem is not None:
        raise ScheduleError(f"rank {rank} issues {op.describe()}: {problem}", rank=rank, op=op)


def _replay_pieces(
    groups: Sequence[tuple[int, ...]],
    canonical: Sequence[Sequence[Op]] | None,
    pieces: Sequence[Sequence[tuple[int, int]]],
    member_ops: dict[tuple[int, int], list[Op]] | None,
) -> None:
    """Core replay: ``pieces[rank]`` = runs ``(group index, count)``; the ops are either the
    same canonical list per group for every member (``canonical[g]``) or per member
    (``member_ops[(g, rank)]``, checked for agreement)."""
    num_ranks = len(pieces)
    piece = [0] * num_ranks
    left = [p[0][1] if p else 0 for p in pieces]
    done = [0] * len(groups)  # collectives completed per group
    at: list[set[int]] = [set() for _ in groups]
    for rank, p in enumerate(pieces):
        if p:
            at[p[0][0]].add(rank)
    ready = [g for g, group in enumerate(groups) if len(at[g]) == len(group)]
    while ready:
        g = ready.pop()
        group = groups[g]
        if len(at[g]) != len(group):
            continue
        k = min(left[x] for x in group)
        if member_ops is not None:
            _check_agreement(g, group, done[g], k, member_ops)
        done[g] += k
        for x in group:
            left[x] -= k
            if left[x] == 0:
                at[g].discard(x)
                piece[x] += 1
                if piece[x] < len(pieces[x]):
                    h, count = pieces[x][piece[x]]
                    left[x] = count
                    at[h].add(x)
                    if len(at[h]) == len(groups[h]):
                        ready.append(h)
        if len(at[g]) == len(group):
            ready.append(g)
    stuck = [x for x in range(num_ranks) if piece[x] < len(pieces[x])]
    if not stuck:
        return

    def current(x: int) -> tuple[int, Op | None]:
        h = pieces[x][piece[x]][0]
        ops = canonical[h] if canonical is not None else member_ops.get((h, x), [])  # type: ignore[union-attr]
        return h, (ops[done[h]] if done[h] < len(ops) else None)

    first = stuck[0]
    chain = [first]
    seen = {first: 0}
    lines = []
    while True:
        x = chain[-1]
        h, op = current(x)
        waiting = [y for y in groups[h] if y not in at[h]]
        y = waiting[0]
        desc = op.describe() if op is not None else "a collective"
        if piece[y] >= len(pieces[y]):
            lines.append(f"rank {x} waits at {desc} on group {_fmt_group(groups[h])} for rank {y}, "
                         f"which ends its step without issuing it (a missing collective)")
            raise ScheduleError("deadlock: no rank can proceed\n  " + "\n  ".join(lines), rank=first,
                                op=current(first)[1], cycle=())
        hy, opy = current(y)
        lines.append(f"rank {x} waits at {desc} on group {_fmt_group(groups[h])} for rank {y}, "
                     f"which waits on group {_fmt_group(groups[hy])}")
        if y in seen:
            cycle = tuple(chain[seen[y]:]) + (y,)
            raise ScheduleError(
                "deadlock: no rank can proceed; cycle of waiting ranks " + " -> ".join(map(str, cycle))
                + "\n  " + "\n  ".join(lines),
                rank=first, op=current(first)[1], cycle=cycle,
            )
        seen[y] = len(chain)
        chain.append(y)


def _check_agreement(g: int, group: tuple[int, ...], start: int, k: int, member_ops: dict) -> None:
    ref_rank = group[0]
    ref = member_ops[(g, ref_rank)]
    for x in group[1:]:
        mine = member_ops[(g, x)]
        for i in range(start, start + k):
            a, b = ref[i], mine[i]
            if a is b or a.signature() == b.signature():
                continue
            fields = [f for f, u, v in zip(("kind", "group", "root", "dtype", "numel"), a.signature(), b.signature()) if u != v]
            raise ScheduleError(
                f"collective #{i} on group {_fmt_group(group)}: rank {ref_rank} issues {a.describe()} but rank {x} "
                f"issues {b.describe()} (they differ in {', '.join(fields)}): the collective would hang or corrupt data",
                rank=x, op=b,
            )


def programs_of(sched: StepSchedule) -> list[tuple[Op, ...]]:
    """Explicit per-rank op lists of a schedule (for :func:`replay`, or to edit in tests)."""
    return [sched.rank_ops(r) for r in range(sched.num_ranks)]


