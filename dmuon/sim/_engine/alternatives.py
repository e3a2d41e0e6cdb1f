r"""The step schedules of what a user would run instead of dmuon, as op tables.

Each builder returns a tuple of :class:`dmuon.plan.Op` in issue order, replayed by
:func:`dmuon.sim.simulate` exactly as a dmuon schedule is. What ``adamw``, ``naive`` and ``all_to_all``
issue, and what is not modelled: Note: the simulator's alternatives (docs/design.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from dmuon.plan._cost import baseline as _baseline
from dmuon.plan._cost import flops as _flops
from dmuon.plan._cost import nbytes as _nbytes
from dmuon.plan._scheduling.ops import Op, Step

__all__ = ["VARIANTS", "fsdp2_ops", "build", "plan_ep", "shard_groups", "ep_groups"]

#: alternatives :func:`build` knows
VARIANTS = ("adamw", "naive", "all_to_all")


class _Emitter:
    def __init__(self) -> None:
        self.ops: list[Op] = []

    def emit(self, **fields: Any) -> int:
        i = len(self.ops)
        self.ops.append(Op(id=i, **fields))
        return i


def plan_ep(plan: Any) -> int:
    """The plan's expert-parallel degree (``compile(ep=...)``; 1 without EP)."""
    return max((spec.ep_size for spec in plan.params), default=1)


def _units(plan: Any) -> dict[str, list[tuple[str, int, int, bool]]]:
    """Unit fqn -> [(dtype, k, shard numel, requires_grad)] of every parameter, dedicated ones in
    their boundary's unit: ``k`` ranks of its FSDP2 group and its padded shard
    (:func:`dmuon.plan._cost.baseline.fsdp2_param_shard`)."""
    N = plan.mesh_shape[1]
    ep = plan_ep(plan)
    units: dict[str, list] = {b.fqn: [] for b in plan.boundaries}
    for spec in plan.params:
        k, c = _baseline.spec_fsdp2_shard(spec, N)
        units.setdefault(plan.boundary(spec.fqn), []).append((spec.dtype, k, c, True))
    for u in plan.fsdp2_units:
        for p, s, d, g in zip(u.params, u.shapes, u.dtypes, u.requires_grad):
            k, c = _baseline.fsdp2_param_shard(p, tuple(s), N, ep=ep)
            units.setdefault(u.fqn, []).append((d, k, c, g))
    units.setdefault("", [])
    return units


def _rows_cols(plan: Any) -> tuple[list[tuple[int, ...]], list[tuple[int, ...]]]:
    R, N = plan.mesh_shape
    rows = [tuple(r * N + s for s in range(N)) for r in range(R)]
    cols = [tuple(r * N + s for r in range(R)) for s in range(N)] if R > 1 else []
    return rows, cols


def shard_groups(plan: Any, k: int) -> list[tuple[int, ...]]:
    """FSDP2 groups of ``k`` ranks: the replicate rows (``k = N``), or with expert parallelism
    each row's efsdp groups (``k = N/ep``: ranks ``j, j+ep, j+2ep, ...`` of the row, those that
    hold the same experts); none for ``k = 1``."""
    R, N = plan.mesh_shape
    if k <= 1:
        return []
    if k == N:
        return _rows_cols(plan)[0]
    ep = N // k
    return [tuple(r * N + j + i * ep for i in range(k)) for r in range(R) for j in range(ep)]


def ep_groups(plan: Any) -> list[tuple[int, ...]]:
    """The model's expert-parallel groups (its token all-to-all): ``ep`` consecutive shard ranks
    of each row (rank ``j`` of a group holds experts ``j*E/ep ..``); none without EP."""
    R, N = plan.mesh_shape
    ep = plan_ep(plan)
    if ep <= 1:
        return []
    return [tuple(r * N + g * ep + j for j in range(ep)) for r in range(R) for g in range(N // ep)]


def fsdp2_ops(
    plan: Any, step: Step | None = None, *, reshard_after_forward: bool = True
) -> tuple[tuple[Op, ...], dict[str, tuple[int, ...]]]:
    """FSDP2's ops for every parameter of ``plan``'s model (Note: the simulator's alternatives, ``adamw``,
    docs/design.md), and per
    unit FQN the ids of its last gradient collectives (reduce-scatter, HSDP all-reduce)."""
    step = Step() if step is None else step
    R, N = plan.mesh_shape
    _, cols = _rows_cols(plan)
    everyone = tuple(range(R * N))
    units = _units(plan)
    e = _Emitter()
    last_grad: dict[str, tuple[int, ...]] = {}

    def sizes(unit: str, grad: bool) -> list[tuple[str, int, int]]:
        """(dtype, group size k, shard numel) per FSDP2 collective of the unit: one per dtype and
        FSDP2 group (the rows; an EP model's expert stacks: their efsdp groups)."""
        per: dict[tuple[str, int], int] = {}
        for dtype, k, c, g in units[unit]:
            if grad and not g:
                continue
            per[(dtype, -k)] = per.get((dtype, -k), 0) + c
        return [(d, -nk, c) for (d, nk), c in sorted(per.items())]

    def gather(unit: str, mb: int) -> tuple[int, ...]:
        return tuple(
            e.emit(
                kind="fsdp2_all_gather",
                phase="fsdp2",
                group=grp,
                dtype=plan.bcast_dtype(d),
                numel=c,
                boundary=unit,
                micro_batch=mb,
                external=True,
            )
            for d, k, c in sizes(unit, False)
            for grp in shard_groups(plan, k)
        )

    def reduce(unit: str, mb: int, deps: tuple[int, ...]) -> None:
        ids = []
        for d, k, c in sizes(unit, True):
            wire = plan.reduce_dtype_for(d)
            rs = [
                e.emit(
                    kind="fsdp2_reduce_scatter",
                    phase="fsdp2",
                    group=grp,
                    dtype=wire,
                    numel=c,
                    boundary=unit,
                    micro_batch=mb,
                    deps=deps,
                    external=True,
                )
                for grp in shard_groups(plan, k)
            ]
            ids += rs
            for col in cols:
                ids.append(
                    e.emit(
                        kind="fsdp2_all_reduce",
                        phase="fsdp2",
                        group=col,
                        dtype=wire,
                        numel=c,
                        boundary=unit,
                        micro_batch=mb,
                        deps=tuple(rs),
                        external=True,
                    )
                )
        last_grad[unit] = tuple(ids)

    bounds = [b.fqn for b in plan.boundaries]
    # a pipeline schedule's step (Step.pipelined): units stay unsharded after their backward
    # (and after their forward without reshard_after_forward) until the step's one reduce,
    # which follows the last backward; elsewhere every unit is resharded after its backward
    held: dict[str, tuple[int, ...]] = {}  # unit -> its gather (unsharded now)

    def unshard(unit: str, mb: int) -> tuple[int, ...]:
        if unit not in held:
            held[unit] = gather(unit, mb)
        return held[unit]

    for mb, micro in enumerate(step.micro_batches):
        sync = micro.sync and not step.pipelined
        if not step.pipelined:
            held.clear()
        root = unshard("", mb)
        for b in bounds:
            g = unshard(b, mb)
            e.emit(
                kind="forward",
                phase="compute",
                group=everyone,
                boundary=b,
                micro_batch=mb,
                deps=g + root,
                external=True,
            )
            if reshard_after_forward:
                held.pop(b)
        c = None
        for b in reversed(bounds):
            g = unshard(b, mb)
            if b in micro.recompute:  # activation checkpointing: the forward again, before the backward
                g = (
                    e.emit(
                        kind="recompute",
                        phase="compute",
                        group=everyone,
                        boundary=b,
                        micro_batch=mb,
                        deps=g,
                        external=True,
                    ),
                )
            c = e.emit(
                kind="backward", phase="compute", group=everyone, boundary=b, micro_batch=mb, deps=g, external=True
            )
            if sync:
                reduce(b, mb, (c,))
        if sync:
            reduce("", mb, ())
        elif step.pipelined and micro.sync:  # the schedule's reduce, after the step's last backward
            last = (c,) if c is not None else ()
            for b in reversed(bounds):
                reduce(b, mb, last)
            reduce("", mb, last)
    return tuple(e.ops), last_grad


def build(
    variant: str, plan: Any, step: Step | None = None, *, fsdp2_reshard_after_forward: bool | None = None
) -> tuple[Op, ...]:
    """The op table of alternative ``variant`` (:data:`VARIANTS`) on ``plan``'s model and mesh.

    FSDP2 runs with the plan's ``reshard_after_forward`` for ``naive`` / ``all_to_all`` and with
    ``True`` for ``adamw`` (the floor as usually deployed), unless ``fsdp2_reshard_after_forward``
    says (under pipeline parallelism torchtitan keeps parameters after the forward: False). A
    micro-batch's ``recompute`` boundaries recompute their forward before their backward. NS FLOPs: :func:`dmuon.plan._cost.flops.ns_flops`
    of each matrix view.

    Raises:
        ValueError: unknown ``variant``.
    """
    if variant not in VARIANTS:
        raise ValueError(f"unknown alternative {variant!r}: one of {VARIANTS}")
    step = Step() if step is None else step
    reshard = _baseline.baseline_reshard_after_forward(variant, plan, fsdp2_reshard_after_forward)
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
            k, c = _baseline.spec_fsdp2_shard(spec, N)
            gathers[spec.fqn] = (
                tuple(
                    e.emit(
                        kind="all_gather",
                        phase="optimizer",
                        group=grp,
                        dtype=spec.dtype,
                        numel=c,
                        fqns=(spec.fqn,),
                        micro_batch=mb,
                        deps=deps,
                        external=True,
                    )
                    for grp in shard_groups(plan, k)
                )
                or deps
            )
        for spec in specs:
            m, n = spec.matrix_shape
            local = spec.num_matrices // spec.ep_size  # an EP rank's experts
            e.emit(
                kind="newton_schulz",
                phase="optimizer",
                group=everyone,
                fqns=(spec.fqn,),
                micro_batch=mb,
                flops=_flops.ns_flops(m, n, num_matrices=local),
                deps=gathers[spec.fqn],
            )
        return tuple(e.ops)
    if plan_ep(plan) > 1:
        raise ValueError("the all_to_all (dion) alternative is not modelled with expert parallelism")
    # all_to_all (dion): batches of N same-shape matrices
    by_shape: dict[tuple, list] = {}
    for spec in specs:
        by_shape.setdefault((spec.matrix_shape, spec.num_matrices, spec.dtype), []).append(spec)
    batches: list[list] = []
    for group in by_shape.values():
        for i in range(0, len(group), N):
            batches.append(group[i : i + N])
    sends: list[tuple[int, ...]] = []
    for batch in batches:
        # each unit's gradient collectives once (first-seen order), however many of its matrices the batch holds
        deps = tuple(dict.fromkeys(i for spec in batch for i in last_grad.get(plan.boundary(spec.fqn), ())))
        shard = max(_baseline.spec_fsdp2_shard(spec, N)[1] for spec in batch)
        if N > 1:
            sends.append(
                tuple(
                    e.emit(
                        kind="all_to_all",
                        phase="optimizer",
                        group=row,
                        dtype=batch[0].dtype,
                        numel=N * shard,
                        fqns=tuple(s.fqn for s in batch),
                        micro_batch=mb,
                        deps=deps,
                        external=True,
                    )
                    for row in rows
                )
            )
        else:
            sends.append(deps)
    for batch, sent in zip(batches, sends):
        ns_ids: dict[int, list[int]] = {}  # row -> its owners' NS ops
        for j, spec in enumerate(batch):
            m, n = spec.matrix_shape
            for r, row in enumerate(rows):
                sent_r = (sent[r],) if N > 1 else sent  # the row's own all-to-all
                ns_ids.setdefault(r, []).append(
                    e.emit(
                        kind="newton_schulz",
                        phase="optimizer",
                        group=(row[j],),
                        fqns=(spec.fqn,),
                        micro_batch=mb,
                        flops=_flops.ns_flops(m, n, num_matrices=spec.num_matrices),
                        deps=sent_r,
                    )
                )
        if N > 1:
            shard = max(_baseline.spec_fsdp2_shard(spec, N)[1] for spec in batch)
            for r, row in enumerate(rows):
                e.emit(
                    kind="all_to_all",
                    phase="optimizer",
                    group=row,
                    dtype=batch[0].dtype,
                    numel=N * shard,
                    fqns=tuple(s.fqn for s in batch),
                    micro_batch=mb,
                    deps=tuple(ns_ids[r]),
                    external=True,
                )
    return tuple(e.ops)


def moved_nbytes(ops: Sequence[Op]) -> int:
    """Bytes on the wire summed over ranks of an alternative's collectives, by the byte rule
    (Note: the byte rule, docs/design.md: a non-root member of a broadcast / reduce of ``S`` bytes: ``S``;
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
