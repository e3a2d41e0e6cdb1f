"""The schedule builder: ``schedule(plan, step=None) -> StepSchedule``.

``schedule`` is pure (no process group, no tensors). It replays the hook-boundary state machine
that ``dmuon.exec`` runs (pre-forward, post-forward, pre-backward, post-backward, the
end-of-backward callback, the optimizer step) over a described step and records every operation
as a frozen :class:`~dmuon.plan._scheduling.ops.Op` (kinds, ranks, FSDP2's ops:
:mod:`dmuon.plan._scheduling.ops`), starting from each boundary's per-phase collectives
(:mod:`dmuon.plan._scheduling.programs`).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from dmuon.plan._cost import baseline as _baseline
from dmuon.plan._cost import flops as _flops
from dmuon.plan import _rules as _rules
from dmuon.plan._records.owners import ExpertOwners, OwnerGroup
from dmuon.plan._scheduling.ops import QK_CLIP_DTYPE, MicroBatch, Op, Step
from dmuon.plan._scheduling.programs import _rank_fns, boundary_programs
from dmuon.plan._scheduling.step_schedule import StepSchedule

if TYPE_CHECKING:
    from dmuon.plan._records.plan import ShardingPlan

__all__ = [
    "schedule",
]


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
        # unit -> (dtype, shard numel, of grads): FSDP2 places the non-dedicated parameters as the
        # baseline does (an expert stack Shard(1) where torchtitan uses it,
        # dmuon.plan._cost.baseline.fsdp2_param_shard; over the row: compile refuses a
        # non-dedicated stack under expert parallelism)
        self.fsdp2_units: dict[str, list[tuple[str, int, int]]] = {}
        for unit in plan.fsdp2_units:
            per: dict[str, list[int]] = {}
            for fqn, shape, dtype, grad in zip(unit.params, unit.shapes, unit.dtypes, unit.requires_grad):
                c = _baseline.fsdp2_param_shard(fqn, tuple(shape), N)[1]
                acc = per.setdefault(dtype, [0, 0])
                acc[0] += c
                acc[1] += c if grad else 0
            self.fsdp2_units[unit.fqn] = [(d, a, g) for d, (a, g) in sorted(per.items())]
        self.fsdp2_resident: set[str] = set()
        # a pipeline schedule's step (Step.pipelined): backwards without sync, one reduce at the
        # end; Z2 buffers resident until then; FSDP2 units kept unsharded after their backward
        self.pipelined = step.pipelined
        self.keep_resident = step.pipelined and not plan.reshard_after_forward
        self.unreduced: set[int] = set()  # boundaries whose backward ran, not yet reduced (pipelined)
        self.last_compute: tuple[int, ...] = ()  # the latest backward op (pipelined: the reduce waits for it)

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
                ids.append(
                    self.emit(
                        kind=kind,
                        phase="fsdp2",
                        group=group,
                        dtype=wire,
                        numel=size,
                        boundary=unit,
                        micro_batch=mb,
                        deps=deps,
                        external=True,
                    )
                )
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
        self.emit(
            kind="forward",
            phase="compute",
            group=self.everyone,
            boundary=fqn,
            micro_batch=mb,
            deps=self.last_bcast[b] + gathered,
            external=True,
        )
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
            deps = (
                self.emit(
                    kind="recompute",
                    phase="compute",
                    group=self.everyone,
                    boundary=fqn,
                    micro_batch=mb,
                    deps=deps,
                    external=True,
                ),
            )
        compute = self.emit(
            kind="backward",
            phase="compute",
            group=self.everyone,
            boundary=fqn,
            micro_batch=mb,
            deps=deps,
            external=True,
        )
        self.last_compute = (compute,)
        self.pending[b] -= 1  # post-backward
        if self.pending[b] == 0:
            self.finish(b, mb, sync, (compute,))
            if not self.pipelined:  # the pipeline schedule keeps FSDP2's units unsharded after backward
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
            # HSDP: the boundaries reduced before this one get their replicate reduces now, one
            # boundary's backward after their shard reduces (not all at the end of the backward)
            self.replicate_reduces([e for e in self.inflight if e not in self.replicated], mb)
            self.inflight.append(b)
        elif self.pipelined:
            self.unreduced.add(b)
        if not self.keep_resident:
            self.resident[b] = False

    def replicate_reduces(self, boundaries: list[int], mb: int) -> None:
        """The replicate reduces of ``boundaries`` (their shard reduces already in the table)."""
        for b in boundaries:
            by_seg: dict[tuple, list[int]] = {}
            for i in self.last_reduce[b]:
                by_seg.setdefault((self.ops[i].buffer, self.ops[i].segment), []).append(i)
            # each waits for the shard-group reduces of its segment (a rank waits for its row's),
            # or for its all-gathered buffer's reduce-scatters (segment None)
            self.last_rep_reduce[b] = tuple(
                self.emit(t, micro_batch=mb, deps=tuple(by_seg.get((t.buffer, t.segment)) or by_seg[(t.buffer, None)]))
                for t in self.programs[b].replicate_reduce
            )
            self.replicated.add(b)

    def finish_reduces(self, mb: int) -> None:
        inflight, self.inflight = self.inflight, []
        self.replicate_reduces([b for b in inflight if b not in self.replicated], mb)
        self.replicated = set()

    def micro_batch(self, mb: int, micro: MicroBatch) -> None:
        calls = (
            [p.index for p in self.programs]
            if micro.forward is None
            else [self.boundary_index(f) for f in micro.forward]
        )
        recompute = {self.boundary_index(f) for f in micro.recompute}
        if recompute - set(calls):
            raise ValueError(
                f"dmuon.plan.schedule: micro-batch {mb} recomputes "
                f"{sorted(self.programs[b].fqn for b in recompute - set(calls))}, which its forward does not call"
            )
        self.inflight: list[int] = []  # reduced in this backward, until finish_reduces
        self.replicated: set[int] = set()  # of those, the ones whose replicate reduces are issued
        sync = micro.sync and not self.pipelined  # a pipeline schedule reduces once, after the step
        self.fsdp2_unshard("", mb)  # the root unit (embeddings, final norm, lm_head)
        for b in calls:
            self.forward(b, mb)
        for b in reversed(calls):
            self.backward(b, mb, sync, b in recompute)
        for b in reversed(range(len(self.programs))):  # end-of-backward callback
            if self.pending[b] > 0:
                self.finish(b, mb, sync, ())
        self.finish_reduces(mb)
        if self.pipelined and micro.sync:
            self.pipeline_reduce(mb)
        if not self.keep_resident or micro.sync:
            self.resident = [False] * len(self.programs)  # prefetched but never called: freed too
        if sync:
            rs = self.fsdp2("", "fsdp2_reduce_scatter", mb)
            self.fsdp2("", "fsdp2_all_reduce", mb, rs)
        if not self.pipelined or micro.sync:
            self.fsdp2_resident.clear()

    def pipeline_reduce(self, mb: int) -> None:
        """The pipeline schedule's reduce after the step's last backward (``Step.pipelined``):
        dmuon's reduces of every boundary whose backward ran, last boundary first, then FSDP2's
        reduce-scatters (and HSDP all-reduces) of every unit, the root's last."""
        deps = self.last_compute
        for b in reversed(range(len(self.programs))):
            if b in self.unreduced:
                self.finish(b, mb, True, deps)
        self.finish_reduces(mb)
        self.unreduced = set()
        for p in reversed(self.programs):
            rs = self.fsdp2(p.fqn, "fsdp2_reduce_scatter", mb, deps)
            self.fsdp2(p.fqn, "fsdp2_all_reduce", mb, rs)
        rs = self.fsdp2("", "fsdp2_reduce_scatter", mb, deps)
        self.fsdp2("", "fsdp2_all_reduce", mb, rs)

    def gram_bucket(self, group, phase: str, d: int, bucket, flops, reduce_deps, ns_ids, mb: int) -> None:
        """Sharded Gram NS of one bucket of matrices on ``group`` (a TP group or an owner group):
        one fp32 all-reduce of the bucket's ``(d, d)`` Grams per Gram segment, each after the
        previous one, then every matrix's NS op (``flops[i]`` per member) after all of them."""
        deps = tuple(i for spec in bucket for i in reduce_deps[spec.fqn])
        ar = []
        for _ in self.plan.tp_segment_lengths:
            ar.append(
                self.emit(
                    kind="all_reduce",
                    phase=phase,
                    group=group,
                    dtype=_rules.TP_GRAM_DTYPE,
                    numel=len(bucket) * d * d,
                    fqns=tuple(sp.fqn for sp in bucket),
                    micro_batch=mb,
                    deps=deps,
                )
            )
            deps = (ar[-1],)
        for spec, f in zip(bucket, flops):
            ns_ids[spec.fqn] = self.emit(
                kind="newton_schulz",
                phase="optimizer",
                group=group,
                flops=f,
                fqns=(spec.fqn,),
                micro_batch=mb,
                deps=tuple(ar),
            )

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
                per_expert = _flops.spec_ns_flops(spec) // spec.num_experts
                for j, (member, size) in enumerate(zip(owner.members, owner.sizes)):
                    ns_ids[(spec.fqn, j)] = self.emit(  # keyed by (fqn, range): its replica broadcast waits for it
                        kind="newton_schulz",
                        phase="optimizer",
                        group=tps[(member.replicate, member.shard)],
                        flops=per_expert * size,
                        fqns=(spec.fqn,),
                        micro_batch=mb,
                        deps=reduce_deps[spec.fqn],
                    )
                continue
            group = tps[(owner.replicate, owner.shard)]
            if spec.tp_size > 1:
                tp_entries.setdefault((owner.replicate, owner.shard), []).append(spec)
                continue
            ns_ids[spec.fqn] = self.emit(
                kind="newton_schulz",
                phase="optimizer",
                group=group,
                flops=_flops.spec_ns_flops(spec),
                fqns=(spec.fqn,),
                micro_batch=mb,
                deps=reduce_deps[spec.fqn],
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
                    ns_ids[spec.fqn] = self.emit(
                        kind="newton_schulz",
                        phase="optimizer",
                        group=group,
                        flops=_flops.tp_ns_flops(spec, lengths),
                        fqns=(spec.fqn,),
                        micro_batch=mb,
                        deps=reduce_deps[spec.fqn],
                    )
                elif spec.tp_ns == "gram":
                    d = _flops.tp_gram_side(spec.shape, spec.tp_shard_dim)  # type: ignore[arg-type]
                    gram.setdefault((d, spec.local_numel // d, spec.dtype), []).append(spec)
                else:
                    gather.setdefault(spec.dtype, []).append(spec)
            for (d, _, _), bucket in gram.items():
                self.gram_bucket(
                    group, "tp", d, bucket, [_flops.tp_ns_flops(sp, lengths) for sp in bucket], reduce_deps, ns_ids, mb
                )
            for dtype, bucket in gather.items():
                deps = tuple(i for spec in bucket for i in reduce_deps[spec.fqn])
                ag = self.emit(
                    kind="all_gather",
                    phase="tp",
                    group=group,
                    dtype=dtype,
                    numel=sum(sp.local_numel for sp in bucket),
                    fqns=tuple(sp.fqn for sp in bucket),
                    micro_batch=mb,
                    deps=deps,
                )
                for spec in bucket:
                    ns_ids[spec.fqn] = self.emit(
                        kind="newton_schulz",
                        phase="optimizer",
                        group=group,
                        flops=_flops.tp_ns_flops(spec, lengths),
                        fqns=(spec.fqn,),
                        micro_batch=mb,
                        deps=(ag,),
                    )
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
                flops = _flops.gram_ns_segment_flops(d, width, lengths)
                self.gram_bucket(ranks, "owner_group", d, bucket, [flops] * len(bucket), reduce_deps, ns_ids, mb)
        qk_ids: tuple[int, ...] = ()
        if plan.qk_clip is not None:  # QK-clip: one all-reduce (max) of every layer's per-head max logits
            qk_ids = (
                self.emit(
                    kind="all_reduce",
                    phase="qk_clip",
                    group=self.everyone,
                    dtype=QK_CLIP_DTYPE,
                    numel=plan.qk_clip.num_heads,
                    micro_batch=mb,
                    deps=tuple(ns_ids.values()),
                ),
            )
        if R > 1:  # HSDP: owners broadcast the new values to their replicate peers
            for prog, b in zip(self.programs, plan.boundaries):
                subs = {
                    (buf.key, seg.shard, sub.owner.replicate): sub
                    for buf in b.buffers
                    for seg in buf.segments
                    for sub in seg.subsegments
                }
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
