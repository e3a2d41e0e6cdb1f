r"""The step schedules of what a user would run instead of dmuon, as op tables.

Each builder returns a tuple of :class:`dmuon.plan.Op` in issue order (the symmetric form of
:mod:`dmuon.plan.scheduling.step_schedule`: every op shared by all members of its group, each rank issues
the ops whose group holds it in table order), on the plan's data-parallel mesh, with the same
boundaries, parameters, wire dtypes and FSDP2 units the plan describes. They are replayed by
:func:`dmuon.sim.simulate` exactly as a dmuon schedule is.

``adamw`` — FSDP2 + AdamW, the floor. ``fully_shard`` on every hook boundary and on the root, all
parameters (dmuon's matrices included) sharded on dim 0: per micro-batch the root's all-gather,
per boundary an all-gather before its forward (again before its backward with
``reshard_after_forward=True``), the forward / backward, a reduce-scatter after the backward
(HSDP: then an all-reduce over the replicate group), the root's reduce-scatter at the end; then
AdamW on every shard (added by the simulator).

``naive`` — FSDP2 + naive Muon (``benchmarks/step_time.py``'s ``NaiveMuon``): the same FSDP2
ops, then per Muon matrix momentum on its shard, one all-gather of the update over the shard
group (``DTensor.full_tensor()``), Newton-Schulz of EVERY matrix on EVERY rank, and each rank
applies its own shard. Each NS waits for its own gather; on gloo the simulator also makes the
thread wait for each gather before the next (``full_tensor()`` blocks the host there), so all
gathers precede the first NS, as in ``NaiveMuon.step``.

``all_to_all`` — the design of microsoft/dion's Muon (``dion/muon.py``: gradient shards
all-to-all to whole-matrix owners at the step, all-to-all back): the same FSDP2 ops; at the step,
Muon matrices in plan order are grouped by shape and cut into batches of ``N`` (one matrix per
shard rank; the last batch short), and per batch: one all-to-all over the shard group of the
momentum-updated gradient shards (``N`` shards per rank sent; matrix ``j`` of the batch goes to
shard rank ``j``), Newton-Schulz of one matrix on each owner, one all-to-all of the orthogonalised
shards back. Every replicate group does the same (Newton-Schulz is repeated ``R`` times on HSDP).

Tensor parallelism is not modelled for the alternatives: they run on the data-parallel mesh with
the plan's per-TP-rank shapes (each TP rank's FLOPs), one TP coordinate.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from dmuon.plan.cost import flops as _flops
from dmuon.plan.cost import nbytes as _nbytes
from dmuon.plan.scheduling.ops import Op, Step

__all__ = ["VARIANTS", "fsdp2_ops", "build"]

#: alternatives :func:`build` knows
VARIANTS = ("adamw", "naive", "all_to_all")


class _Emitter:
    def __init__(self) -> None:
        self.ops: list[Op] = []

    def emit(self, **fields: Any) -> int:
        i = len(self.ops)
        self.ops.append(Op(id=i, **fields))
        return i


def _units(plan: Any) -> dict[str, list[tuple[str, str, tuple[int, ...], bool]]]:
    """Unit fqn -> [(param fqn, dtype, local shape, requires_grad)]: every parameter, dedicated
    ones in their boundary's unit."""
    units: dict[str, list] = {b.fqn: [] for b in plan.boundaries}
    for spec in plan.params:
        units.setdefault(plan.boundary(spec.fqn), []).append((spec.fqn, spec.dtype, tuple(spec.local_shape), True))
    for u in plan.fsdp2_units:
        for p, s, d, g in zip(u.params, u.shapes, u.dtypes, u.requires_grad):
            units.setdefault(u.fqn, []).append((p, d, tuple(s), g))
    units.setdefault("", [])
    return units


def _rows_cols(plan: Any) -> tuple[list[tuple[int, ...]], list[tuple[int, ...]]]:
    R, N = plan.mesh_shape
    rows = [tuple(r * N + s for s in range(N)) for r in range(R)]
    cols = [tuple(r * N + s for r in range(R)) for s in range(N)] if R > 1 else []
    return rows, cols


def fsdp2_ops(plan: Any, step: Step | None = None, *, reshard_after_forward: bool = True) -> tuple[tuple[Op, ...], dict[str, tuple[int, ...]]]:
    """FSDP2's ops for every parameter of ``plan``'s model (module docstring, ``adamw``), and per
    unit FQN the ids of its last gradient collectives (reduce-scatter, HSDP all-reduce)."""
    step = Step() if step is None else step
    R, N = plan.mesh_shape
    rows, cols = _rows_cols(plan)
    everyone = tuple(range(R * N))
    units = _units(plan)
    e = _Emitter()
    last_grad: dict[str, tuple[int, ...]] = {}

    def sizes(unit: str, grad: bool) -> list[tuple[str, int]]:
        per: dict[str, int] = {}
        for _, dtype, shape, g in units[unit]:
            if grad and not g:
                continue
            per[dtype] = per.get(dtype, 0) + _nbytes.fsdp2_shard_numel(shape, N)
        return sorted(per.items())

    def gather(unit: str, mb: int) -> tuple[int, ...]:
        if N == 1:
            return ()
        return tuple(e.emit(kind="fsdp2_all_gather", phase="fsdp2", group=row, dtype=plan.bcast_dtype(d), numel=c,
                            boundary=unit, micro_batch=mb, external=True)
                     for d, c in sizes(unit, False) for row in rows)

    def reduce(unit: str, mb: int, deps: tuple[int, ...]) -> None:
        ids = []
        for d, c in sizes(unit, True):
            wire = plan.reduce_dtype_for(d)
            rs = [e.emit(kind="fsdp2_reduce_scatter", phase="fsdp2", group=row, dtype=wire, numel=c, boundary=unit,
                         micro_batch=mb, deps=deps, external=True) for row in rows] if N > 1 else []
            ids += rs
            for col in cols:
                ids.append(e.emit(kind="fsdp2_all_reduce", phase="fsdp2", group=col, dtype=wire, numel=c, boundary=unit,
                                  micro_batch=mb, deps=tuple(rs), external=True))
        last_grad[unit] = tuple(ids)

    bounds = [b.fqn for b in plan.boundaries]
    for mb, micro in enumerate(step.micro_batches):
        root = gather("", mb)
        fwd_deps: dict[str, tuple[int, ...]] = {}
        for b in bounds:
            g = gather(b, mb)
            fwd_deps[b] = g
            e.emit(kind="forward", phase="compute", group=everyone, boundary=b, micro_batch=mb, deps=g + root,
                   external=True)
        for b in reversed(bounds):
            g = gather(b, mb) if reshard_after_forward else fwd_deps[b]
            c = e.emit(kind="backward", phase="compute", group=everyone, boundary=b, micro_batch=mb, deps=g,
                       external=True)
            if micro.sync:
                reduce(b, mb, (c,))
        if micro.sync:
            reduce("", mb, ())
    return tuple(e.ops), last_grad


def build(variant: str, plan: Any, step: Step | None = None) -> tuple[Op, ...]:
    """The op table of alternative ``variant`` (:data:`VARIANTS`) on ``plan``'s model and mesh.

    FSDP2 runs with the plan's ``reshard_after_forward`` for ``naive`` / ``all_to_all`` and with
    ``True`` for ``adamw`` (the floor as usually deployed). NS FLOPs: :func:`dmuon.plan.cost.flops.ns_flops`
    of each matrix view.

    Raises:
        ValueError: unknown ``variant``.
    """
    if variant not in VARIANTS:
        raise ValueError(f"unknown alternative {variant!r}: one of {VARIANTS}")
    step = Step() if step is None else step
    reshard = True if variant == "adamw" else plan.reshard_after_forward
    ops, last_grad = fsdp2_ops(plan, step, reshard_after_forward=reshard)
    if variant == "adamw":
        return ops
    e = _Emitter()
    e.ops = list(ops)
    R, N = plan.mesh_shape
    rows, _ = _rows_cols(plan)
    everyone = tuple(range(R * N))
    mb = len(step.micro_batches) - 1
    specs = list(plan.params)
    if variant == "naive":
        gathers = {}
        for spec in specs:
            deps = last_grad.get(plan.boundary(spec.fqn), ())
            if N > 1:
                gathers[spec.fqn] = tuple(
                    e.emit(kind="all_gather", phase="optimizer", group=row, dtype=spec.dtype,
                           numel=_nbytes.fsdp2_shard_numel(spec.local_shape, N), fqns=(spec.fqn,), micro_batch=mb,
                           deps=deps, external=True) for row in rows)
            else:
                gathers[spec.fqn] = deps
        for spec in specs:
            m, n = spec.matrix_shape
            e.emit(kind="newton_schulz", phase="optimizer", group=everyone, fqns=(spec.fqn,), micro_batch=mb,
                   flops=_flops.ns_flops(m, n, num_matrices=spec.num_matrices), deps=gathers[spec.fqn])
        return tuple(e.ops)
    # all_to_all (dion): batches of N same-shape matrices
    by_shape: dict[tuple, list] = {}
    for spec in specs:
        by_shape.setdefault((spec.matrix_shape, spec.num_matrices, spec.dtype), []).append(spec)
    batches: list[list] = []
    for group in by_shape.values():
        for i in range(0, len(group), N):
            batches.append(group[i:i + N])
    sends: list[tuple[int, ...]] = []
    for batch in batches:
        # each unit's gradient collectives once (first-seen order), however many of its matrices the batch holds
        deps = tuple(dict.fromkeys(i for spec in batch for i in last_grad.get(plan.boundary(spec.fqn), ())))
        shard = max(_nbytes.fsdp2_shard_numel(spec.local_shape, N) for spec in batch)
        if N > 1:
            sends.append(tuple(e.emit(kind="all_to_all", phase="optimizer", group=row, dtype=batch[0].dtype,
                                      numel=N * shard, fqns=tuple(s.fqn for s in batch), micro_batch=mb, deps=deps,
                                      external=True) for row in rows))
        else:
            sends.append(deps)
    for batch, sent in zip(batches, sends):
        ns_ids: dict[int, list[int]] = {}  # row -> its owners' NS ops
        for j, spec in enumerate(batch):
            m, n = spec.matrix_shape
            for r, row in enumerate(rows):
                sent_r = (sent[r],) if N > 1 else sent  # the row's own all-to-all
                ns_ids.setdefault(r, []).append(
                    e.emit(kind="newton_schulz", phase="optimizer", group=(row[j],), fqns=(spec.fqn,), micro_batch=mb,
                           flops=_flops.ns_flops(m, n, num_matrices=spec.num_matrices), deps=sent_r))
        if N > 1:
            shard = max(_nbytes.fsdp2_shard_numel(spec.local_shape, N) for spec in batch)
            for r, row in enumerate(rows):
                e.emit(kind="all_to_all", phase="optimizer", group=row, dtype=batch[0].dtype, numel=N * shard,
                       fqns=tuple(s.fqn for s in batch), micro_batch=mb, deps=tuple(ns_ids[r]), external=True)
    return tuple(e.ops)


def moved_nbytes(ops: Sequence[Op]) -> int:
    """Bytes on the wire summed over ranks of an alternative's collectives, by the accounting
    rule of docs/planning.md (a non-root member of a broadcast / reduce of ``S`` bytes: ``S``;
    an all-gather / reduce-scatter of ``S`` bytes per rank over ``k``: ``(k-1)·S`` per rank; an
    all-reduce ``2·(k-1)·ceil(numel/k)·itemsize`` per rank; an all-to-all of ``S`` per rank:
    ``(k-1)/k·S`` per rank)."""
    total = 0
    for op in ops:
        k = len(op.group)
        if op.dtype is None or k < 2:
            continue
        isz = op.nbytes // op.numel if op.numel else 0
        if op.kind in ("broadcast", "reduce"):
            total += (k - 1) * op.nbytes
        elif op.kind in ("all_gather", "fsdp2_all_gather", "fsdp2_reduce_scatter"):
            total += k * (k - 1) * op.nbytes
        elif op.kind in ("all_reduce", "fsdp2_all_reduce"):
            total += k * _nbytes.all_reduce_rank_nbytes(op.numel, isz, k)
        elif op.kind == "all_to_all":
            total += (k - 1) * op.nbytes
    return total
