"""The figures the plan and diff pages draw, read from a plan in one pass each:
:class:`PlanFigures`.

Cost of building them (the page's build cost): the nominal schedule and ``plan.cost`` are built
with the plan (not here); ``plan.rank_stats()`` walks the schedule's op table once, and
:class:`PlanFigures` once more (collectives per boundary, op counts); two ranks' own ops
(``rank_ops``: rank 0 and the busiest) are read for the schedule summary; the ownership cells
are one ``owner_weights`` per parameter (one entry per owner, group member or expert range).
Nothing re-runs the planner. ``tests/plan/test_plan_html.py`` bounds the op visits.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dmuon.plan._cost.nbytes import collective_rank_nbytes
from dmuon.plan._cost.weights import owner_weights
from dmuon.plan._records.fields import itemsize_nbytes
from dmuon.plan._records.owners import ExpertOwners, OwnerGroup
from dmuon.plan._scheduling.ops import ROOTED_KINDS

if TYPE_CHECKING:
    from dmuon.plan._records.plan import ShardingPlan

__all__ = ["PlanFigures", "KINDS", "buffer_kind", "buffer_padding_numel", "short_name"]

#: ownership kinds of a map cell, in the order of :attr:`PlanFigures.cells`' first three slots
KINDS = ("single owner", "owner-group block", "expert range")
#: the row of collectives that belong to no hook boundary (QK-clip's all-reduce)
STEP_ROW = "(step: no boundary)"


def buffer_kind(buf) -> str:
    """A buffer's collective: ``BufferLayout.collective`` (``"broadcast"`` / ``"all_gather"``),
    ``"broadcast"`` for plans whose buffers do not record one."""
    return getattr(buf, "collective", "broadcast")


def buffer_padding_numel(buf, num_shards: int) -> int:
    """Elements an all-gathered buffer moves beyond its segments per replicate row
    (``N * slot_numel - numel``; 0 for a broadcast buffer or a plan without slots)."""
    method = getattr(buf, "padding_numel", None)
    if callable(method):
        return int(method(num_shards))
    slot = getattr(buf, "slot_numel", 0) or 0
    if buffer_kind(buf) != "all_gather" or not slot:
        return 0
    return num_shards * slot - buf.numel


def short_name(fqn: str, boundary: str) -> str:
    """``fqn`` relative to its boundary (``self_attn.q_proj.weight``), the FQN itself at the root."""
    if boundary and fqn.startswith(boundary + "."):
        return fqn[len(boundary) + 1 :]
    return fqn


class PlanFigures:
    """Everything a page draws about one plan (module docstring for the cost).

    Attributes:
        plan, R, N, T: the plan and its mesh. names: boundary FQNs, plan order.
        stats / base_stats: ``plan.rank_stats()`` / ``plan.baseline_rank_stats()``.
        adamw_memory: FSDP2 + AdamW's whole memory per rank (``plan.adamw_rank_stats()``).
        cost / base_cost: ``plan.cost`` / ``plan.baseline_cost``.
        owned_numel / owned_weight / bound: the plan's own (per mesh rank; the LPT bound).
        cells: per boundary, ``{mesh rank: [single, group, expert] * 2}``: LPT weight owned by
            kind, then elements owned by kind (:data:`KINDS`).
        cell_params: per boundary, ``{mesh rank: [(short name, weight), ...]}``.
        experts: per boundary with expert stacks, ``{mesh rank: [experts, [(stack, first, last)]]}``
            (a stack named by its attribute, ``gate_up_proj``, when no other stack of the boundary shares it).
        coll: per boundary (then :data:`STEP_ROW`), ``{(kind, phase): [calls, bytes per step]}``
            summed over ranks by the ledger's rule (they add up to ``plan.cost.total_nbytes``).
        op_counts: ``{(phase, kind): ops}`` of the whole step's op table.
        buffers: per boundary, ``[(key, numel, collective, slot_numel, padding_numel)]``.
    """

    def __init__(self, plan: ShardingPlan):
        self.plan = plan
        self.R, self.N = plan.mesh_shape
        self.T = plan.tp_size
        self.S = self.R * self.N
        self.names = [b.fqn for b in plan.boundaries]
        self.sched = plan.schedule()
        self.cost = plan.cost
        self.base_cost = plan.baseline_cost
        self.stats = plan.rank_stats()
        self.base_stats = plan.baseline_rank_stats()
        self.adamw_memory = plan.adamw_rank_stats()[0].memory  # FSDP2 + AdamW: every rank the same
        self.owned_numel = plan.owned_numel
        self.owned_weight = plan.owned_weight
        self.bound = plan.balance_bound
        self.fingerprint = plan.fingerprint()  # sha256 of the JSON: the slowest figure of a large plan
        index = {name: i for i, name in enumerate(self.names)}
        self._index = index
        self._cells(plan, index)
        self._collectives(plan, index)
        self.buffers = [
            [
                (
                    buf.key,
                    buf.numel,
                    buffer_kind(buf),
                    getattr(buf, "slot_numel", 0) or 0,
                    buffer_padding_numel(buf, self.N),
                )
                for buf in b.buffers
            ]
            for b in plan.boundaries
        ]

    # ------------------------------------------------------------------------------ ownership
    def _cells(self, plan: ShardingPlan, index: dict[str, int]) -> None:
        lengths = plan.tp_segment_lengths
        model = plan.cost_model
        self.cells: list[dict[int, list[int]]] = [{} for _ in self.names]
        self.cell_params: list[dict[int, list[tuple[str, int]]]] = [{} for _ in self.names]
        self.experts: dict[int, dict[int, list]] = {}
        attrs: dict[int, list[str]] = {}  # an expert stack is named by its attribute when unique in its boundary
        for spec in plan.params:
            if spec.experts is not None:
                attrs.setdefault(index[plan.boundary(spec.fqn)], []).append(spec.attr)
        for spec, owner in zip(plan.params, plan.owners):
            bname = plan.boundary(spec.fqn)
            b = index[bname]
            kind = (
                2
                if isinstance(owner, ExpertOwners) or spec.experts is not None
                else (1 if isinstance(owner, OwnerGroup) else 0)
            )
            weights = owner_weights(spec, owner, model, lengths)
            numels = weights if model == "numel" else owner_weights(spec, owner, "numel", lengths)
            name = short_name(spec.fqn, bname)
            label = name + (f" [TP {spec.tp_ns}]" if spec.tp_size > 1 else "")  # how its owner TP group runs NS
            cells, params = self.cells[b], self.cell_params[b]
            for (rank, w), (_, n) in zip(weights, numels):
                cell = cells.get(rank)
                if cell is None:
                    cell = cells[rank] = [0, 0, 0, 0, 0, 0]
                cell[kind] += w
                cell[3 + kind] += n
                params.setdefault(rank, []).append((label, w))
            if spec.experts is not None:
                rows = self.experts.setdefault(b, {})
                name = spec.attr if attrs[b].count(spec.attr) == 1 else name
                if isinstance(owner, ExpertOwners):
                    for member, off, size in zip(owner.members, owner.offsets(), owner.sizes):
                        entry = rows.setdefault(member.rank, [0, []])
                        entry[0] += size
                        entry[1].append((name, off, off + size - 1))
                else:
                    for rank, _ in weights:
                        entry = rows.setdefault(rank, [0, []])
                        entry[0] += spec.num_experts
                        entry[1].append((name, 0, spec.num_experts - 1))

    # ---------------------------------------------------------------------------- collectives
    def _collectives(self, plan: ShardingPlan, index: dict[str, int]) -> None:
        rows: list[dict[tuple[str, str], list[int]]] = [{} for _ in range(len(self.names) + 1)]
        counts: dict[tuple[str, str], int] = {}
        isz: dict[str, int] = {}
        boundary_of: dict[str, int] = {}
        step_row = len(self.names)
        for op in self.sched.ops:
            key = (op.phase, op.kind)
            counts[key] = counts.get(key, 0) + 1
            if not op.collective:
                continue
            if op.boundary is not None:
                b = index.get(op.boundary, step_row)
            elif op.fqns:
                b = boundary_of.get(op.fqns[0])
                if b is None:
                    b = boundary_of[op.fqns[0]] = index[plan.boundary(op.fqns[0])]
            else:
                b = step_row
            size = isz.get(op.dtype)
            if size is None:
                size = isz[op.dtype] = itemsize_nbytes(op.dtype)
            k = len(op.group)
            if op.kind in ROOTED_KINDS:
                total = (k - 1) * op.numel * size
            else:
                total = k * collective_rank_nbytes(op.kind, op.numel, size, k, False)
            slot = rows[b].get((op.kind, op.phase))
            if slot is None:
                slot = rows[b][(op.kind, op.phase)] = [0, 0]
            slot[0] += 1
            slot[1] += total
        self.coll = rows
        self.op_counts = counts

    # ------------------------------------------------------------------------------- per rank
    def mesh_stat(self, field: str) -> list[int]:
        """``RankStats.field`` per mesh rank (with TP: the largest of its ``T`` TP ranks)."""
        T = self.T
        vals = [getattr(s, field) for s in self.stats]
        return vals if T == 1 else [max(vals[r * T : (r + 1) * T]) for r in range(self.S)]

    def mesh_peak(self) -> list[int]:
        """Whole peak memory per mesh rank (``RankStats.memory.peak_nbytes``; with TP: the largest
        of its ``T`` TP ranks)."""
        T = self.T
        vals = [s.memory.peak_nbytes for s in self.stats]
        return vals if T == 1 else [max(vals[r * T : (r + 1) * T]) for r in range(self.S)]

    def mesh_comm(self) -> list[int]:
        """Bytes per step charged per mesh rank (with TP: the largest of its TP ranks)."""
        per = self.cost.per_rank_nbytes
        T = self.T
        return list(per) if T == 1 else [max(per[r * T : (r + 1) * T]) for r in range(self.S)]

    @property
    def busiest_rank(self) -> int:
        """The schedule rank charged the most bytes (lowest on a tie)."""
        per = self.cost.per_rank_nbytes
        return max(range(len(per)), key=lambda r: (per[r], -r)) if per else 0

    def rank_phases(self, rank: int, ops=None) -> dict[tuple[str, str], list[int]]:
        """``{(phase, kind): [ops, bytes charged, FLOPs]}`` of schedule rank ``rank``'s ops
        (``ops``: ``sched.rank_ops(rank)`` when the caller has it)."""
        out: dict[tuple[str, str], list[int]] = {}
        isz: dict[str, int] = {}
        for op in self.sched.rank_ops(rank) if ops is None else ops:
            slot = out.get((op.phase, op.kind))
            if slot is None:
                slot = out[(op.phase, op.kind)] = [0, 0, 0]
            slot[0] += 1
            if op.collective:  # Op.charged_nbytes without its membership test: rank_ops holds the rank's ops
                size = isz.get(op.dtype)
                if size is None:
                    size = isz[op.dtype] = itemsize_nbytes(op.dtype)
                slot[1] += collective_rank_nbytes(op.kind, op.numel, size, len(op.group), op.root == rank)
            slot[2] += op.flops
        return out

    @property
    def idle_ranks(self) -> int:
        """Mesh ranks owning nothing."""
        return sum(1 for v in self.owned_numel if v == 0)
