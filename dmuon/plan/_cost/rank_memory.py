"""Per-rank figures of a DMuon plan: owned, resident and peak transient bytes, with each rank's
bytes on the wire and Newton-Schulz FLOPs, from the nominal schedule (:func:`rank_stats`,
records :class:`~dmuon.plan._cost.cost_model.RankStats`); and each rank's whole memory by term
(:func:`dmuon_memory`, :func:`fsdp2_memory`, records :class:`~dmuon.plan._cost.cost_model.MemoryTerms`)
for dmuon and for the FSDP2 baselines on the same mesh. Every byte formula of the memory terms
lives here; the plan's summary and page, and the simulator (:mod:`dmuon.sim._engine.sim_memory`, which adds
the workload's activations), import them.

The memory terms of dmuon and of the FSDP2 baselines: Note: memory per rank (docs/design.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import math

from dmuon.plan import _rules
from dmuon.plan._cost import baseline as _baseline
from dmuon.plan._cost.cost_model import ByteCost, MemoryTerms, RankStats
from dmuon.plan._cost.weights import member_weights
from dmuon.plan._records.fields import itemsize_nbytes
from dmuon.plan._records.owners import ExpertOwners, Owner, OwnerGroup
from dmuon.plan._records.params import ParamSpec

__all__ = [
    "rank_stats",
    "MEMORY_VARIANTS",
    "SECOND_MOMENT_ITEMSIZE",
    "second_moment_shape",
    "second_moment_nbytes",
    "buffer_wire_numel",
    "reduce_numels",
    "boundary_reduce_nbytes",
    "reduce_buffer_nbytes",
    "received_nbytes",
    "boundary_received_nbytes",
    "step_transient_nbytes",
    "dmuon_transient_nbytes",
    "fsdp2_transient_nbytes",
    "fsdp2_rest_nbytes",
    "dmuon_memory",
    "fsdp2_memory",
    "ranks_above",
    "OFFLOAD_RUNS_IN_FLIGHT",
    "check_offloadable",
    "held_segment_nbytes",
    "held_copy_nbytes",
    "owned_pieces",
    "staged_run_nbytes",
    "muon_step_nbytes",
    "dmuon_offload_memory",
    "fsdp2_offload_memory",
]

#: optimizers whose state :func:`dmuon_memory` counts: ``dmuon.Muon(variant=...)``
MEMORY_VARIANTS = ("muon", "normuon")
#: NorMuon keeps its second moment in fp32 whatever the parameter dtype
SECOND_MOMENT_ITEMSIZE = 4


def rank_stats(
    params: Sequence[ParamSpec],
    owners: Sequence[Owner],
    sched: Any,
    cost: ByteCost,
    *,
    mesh_shape: tuple[int, int],
    reshard_after_forward: bool,
    tp_size: int = 1,
    assembled_nbytes: dict[str, int] | None = None,
) -> tuple[RankStats, ...]:
    """Per-rank :class:`RankStats` of a DMuon plan (definitions on the record), from its nominal
    schedule ``sched``: ``comm_nbytes`` = ``cost.per_rank_nbytes``; ``ns_flops`` = the
    ``newton_schulz`` ops each rank runs; ``peak_transient_nbytes`` = the bytes a rank receives
    in one boundary's forward broadcasts, or the whole output of its forward all-gathers (every
    slot, its own and the padding included: ``k * slot`` per all-gather), (Z3: the largest
    boundary; Z2: all of them), plus, per
    boundary, ``assembled_nbytes[boundary]``: the full compute matrices of owner-grouped
    matrices, which every rank assembles from their blocks (broadcast dtype).

    With TP (``tp_size = T > 1``) there is one record per schedule rank
    ``(replicate*N + shard)*T + tp``: element and byte figures are that rank's shards (the
    ``T`` ranks of a mesh coordinate are identical).
    """
    R, N = mesh_shape
    world = R * N
    T = tp_size
    n = world * T
    owned_numel = [0] * world
    owned_nbytes = [0] * world
    replica_nbytes_by_shard = [0] * N  # params with owner shard s, any replicate: held by every (s, r')
    for spec, owner in zip(params, owners):
        isz = itemsize_nbytes(spec.dtype)
        for member, numel, _ in owned_pieces(spec, owner):  # its replicas hold the same
            owned_numel[member.rank] += numel
            owned_nbytes[member.rank] += numel * isz
            replica_nbytes_by_shard[member.shard] += numel * isz

    flops, per_boundary = _walk_schedule(sched, n)
    for boundary, nbytes in (assembled_nbytes or {}).items():
        row = per_boundary.setdefault(boundary, [0] * n)
        for x in range(n):
            row[x] += nbytes
    transient = [0] * n
    for row in per_boundary.values():
        for x in range(n):
            transient[x] = max(transient[x], row[x]) if reshard_after_forward else transient[x] + row[x]

    out = []
    for g in range(n):
        rank = g // T
        s = rank % N
        params_held = replica_nbytes_by_shard[s] if R > 1 else owned_nbytes[rank]
        out.append(
            RankStats(
                rank=g,
                owned_numel=owned_numel[rank],
                owned_nbytes=owned_nbytes[rank],
                resident_nbytes=params_held + owned_nbytes[rank],
                peak_transient_nbytes=transient[g],
                comm_nbytes=cost.per_rank_nbytes[g],
                ns_flops=flops[g],
            )
        )
    return tuple(out)


def received_nbytes(sched: Any, n: int) -> dict[str, list[int]]:
    """Per boundary, the bytes each of the ``n`` schedule ranks receives in its forward
    broadcasts (its own segments excluded) or holds as the output of its forward all-gathers
    (every slot, its own and the padding included: ``k * slot``), from the nominal schedule
    ``sched`` (micro-batch 0): the packed copies a rank holds while the boundary is unsharded.
    The layout gives the same per shard coordinate (:func:`boundary_received_nbytes`)."""
    return _walk_schedule(sched, n)[1]


def _walk_schedule(sched: Any, n: int) -> tuple[list[int], dict[str, list[int]]]:
    """One pass over the op table: each schedule rank's Newton-Schulz FLOPs and
    :func:`received_nbytes`."""
    flops = [0] * n
    received: dict[tuple[str, tuple[int, ...]], int] = {}  # (boundary, group) -> bytes per member
    root_credit: dict[tuple[str, int], int] = {}
    for op in sched.ops:
        if op.kind == "newton_schulz":
            for x in op.group:
                flops[x] += op.flops
            continue
        if op.phase != "forward_broadcast" or op.micro_batch != 0:
            continue
        key = (op.boundary, op.group)
        if op.kind == "all_gather":
            received[key] = received.get(key, 0) + len(op.group) * op.nbytes
            continue
        received[key] = received.get(key, 0) + op.nbytes
        rkey = (op.boundary, op.root)
        root_credit[rkey] = root_credit.get(rkey, 0) + op.nbytes
    per_boundary: dict[str, list[int]] = {}
    for (boundary, group), nbytes in received.items():
        row = per_boundary.setdefault(boundary, [0] * n)
        for x in group:
            row[x] += nbytes
    for (boundary, root), nbytes in root_credit.items():
        per_boundary[boundary][root] -= nbytes
    return flops, per_boundary


def boundary_received_nbytes(plan: Any) -> dict[str, list[int]]:
    """Per boundary, :func:`received_nbytes` of each shard coordinate from the layout (no pass
    over the schedule): a broadcast buffer's segments of the rank's group it does not hold (the
    ``sent`` of :func:`reduce_numels`), an all-gathered buffer's whole ``k * slot`` output, in
    the broadcast dtype."""
    N = plan.mesh_shape[1]
    out: dict[str, list[int]] = {}
    for b in plan.boundaries:
        row = [0] * N
        for buf in b.buffers:
            isz = itemsize_nbytes(plan.bcast_dtype(buf.dtype))
            gathered = getattr(buf, "collective", "broadcast") == "all_gather"
            received = [buffer_wire_numel(buf, N)] * N if gathered else reduce_numels(buf, N)[1]
            for s in range(N):
                row[s] += received[s] * isz
        out[b.fqn] = row
    return out


def second_moment_shape(shape, *, matrix_shape, experts=None, view=None) -> tuple[int, ...]:
    """The shape of NorMuon's second moment ``v`` for a parameter (or an owner's unit of it: its
    experts) of storage ``shape`` whose Muon matrices are ``matrix_shape`` (an expert stack's
    :class:`~dmuon.plan._records.params.ExpertStack` ``experts``, or a
    :class:`~dmuon.plan._model.views.MatrixView` ``view``): ``shape`` with the ``in`` axis
    collapsed: ``(out, 1)`` for a Linear, ``(out, 1, 1, 1)`` for a conv, ``(E, 2F, 1)`` for an HF
    gate/up stack, ``(E, 1, D)`` for a stack stored ``(in, out)``, ``(D, H)`` for a column view of
    ``H`` blocks. Pure."""
    shape = tuple(int(s) for s in shape)
    if view is not None:
        return (shape[0], 1) if view.dim == 0 else (shape[0], len(view.sizes))
    if experts is not None:  # (E', a, b): `in` is b, or a for a stack stored (in, out)
        in_dim = 1 if experts.transposed else 2
        return tuple(1 if d == in_dim else s for d, s in enumerate(shape))
    if len(shape) == 3 and tuple(matrix_shape) == shape[1:]:  # a stack without a layout record
        return (shape[0], shape[1], 1)
    return (shape[0],) + (1,) * (len(shape) - 1)  # a matrix, a conv weight (out, in, *k)


def second_moment_nbytes(spec: ParamSpec, owner: Any) -> tuple[tuple[int, int], ...]:
    """``(mesh rank, bytes)`` of NorMuon's second moment on every owner of ``spec``: the
    :func:`second_moment_shape` of the unit it owns (the whole local tensor; an expert range's
    ``(size, a, b)``; an owner group's block), fp32."""

    def nbytes(shape) -> int:
        return SECOND_MOMENT_ITEMSIZE * math.prod(
            second_moment_shape(shape, matrix_shape=spec.matrix_shape, experts=spec.experts, view=spec.view)
        )

    shape = tuple(spec.local_shape)
    if isinstance(owner, ExpertOwners):
        if owner.local:
            return tuple((m.rank, nbytes(shape)) for m in owner.members)
        return tuple((m.rank, nbytes((size,) + shape[1:])) for m, size in zip(owner.members, owner.sizes))
    if isinstance(owner, OwnerGroup):
        return tuple((m.rank, nbytes(owner.block_shape(j, shape))) for j, m in enumerate(owner.members))
    return ((owner.rank, nbytes(shape)),)


def buffer_wire_numel(buf: Any, num_shards: int) -> int:
    """Elements of boundary buffer ``buf`` one rank holds while it is gathered, and packs for
    its gradient collective: a broadcast buffer's segments over the rank's group (the whole
    buffer; an expert-parallel buffer, ``buf.ep > 1``: the largest efsdp group's segments); an
    all-gather buffer (``buf.collective == "all_gather"``): ``k · slot_numel`` over its group of
    ``k`` ranks, its slot padding included."""
    ep = buf.ep
    k = num_shards // ep if ep > 1 else num_shards
    if getattr(buf, "collective", "broadcast") == "all_gather":
        return k * buf.slot_numel
    if ep == 1:
        return buf.numel
    per: dict[int, int] = {}
    for seg in buf.segments:
        per[seg.shard % ep] = per.get(seg.shard % ep, 0) + seg.numel
    return max(per.values())


def reduce_numels(buf: Any, num_shards: int) -> tuple[list[int], list[int]]:
    """``(held, sent)`` per shard coordinate: elements of boundary buffer ``buf``'s gradient
    reduce buffers on a rank of that coordinate (the runtime's, ``dmuon.exec``): ``held``, the
    buffer of the segment the rank holds (it receives the sums it owns; a broadcast buffer's
    segment of that shard, an all-gathered buffer's output slot), kept to the end of the
    backward; ``sent``, the rest of what it packs (the other segments of its group; the
    reduce-scatter input, ``k`` slots, and the output slot where it holds no segment), released
    before the next boundary's buffers grow (on a 1-D mesh the held buffer too, its averages
    taken out). ``held + sent == buffer_wire_numel(buf, N)`` on a 1-D or EP group. One pass
    over the segments."""
    N = num_shards
    held = [0] * N
    if getattr(buf, "collective", "broadcast") == "all_gather":
        full = buffer_wire_numel(buf, N)
        for seg in buf.segments:
            held[seg.shard] = buf.slot_numel
        return held, [full + buf.slot_numel - h for h in held]
    ep = buf.ep
    group = [0] * ep  # per efsdp class (shard % ep); one class without EP
    for seg in buf.segments:
        held[seg.shard] = seg.numel
        group[seg.shard % ep] += seg.numel
    return held, [group[s % ep] - held[s] for s in range(N)]


def boundary_reduce_nbytes(plan: Any) -> dict[str, tuple[list[int], list[int]]]:
    """Per boundary, ``(held, sent)`` bytes of its gradient reduce buffers on each shard
    coordinate (:func:`reduce_numels` of every buffer, in its reduce dtype)."""
    N = plan.mesh_shape[1]
    out: dict[str, tuple[list[int], list[int]]] = {}
    for b in plan.boundaries:
        held = [0] * N
        sent = [0] * N
        for buf in b.buffers:
            isz = itemsize_nbytes(plan.reduce_dtype_for(buf.dtype))
            for s, (h, t) in enumerate(zip(*reduce_numels(buf, N))):
                held[s] += h * isz
                sent[s] += t * isz
        out[b.fqn] = (held, sent)
    return out


def reduce_buffer_nbytes(plan: Any) -> tuple[int, ...]:
    """Gradient reduce buffers per mesh rank (reduce dtype), the most held at once over one
    backward (boundaries in reverse plan order, as the nominal schedule runs them): boundary
    ``b``'s whole buffers (:func:`reduce_numels`: held + sent) while it packs and reduces; the
    boundary reduced before it is retired before ``b``'s buffers grow. On HSDP a holder keeps its
    held buffers (the replicate reduces read them) to the end of the backward, so those of every
    boundary reduced before ``b`` count too."""
    R, N = plan.mesh_shape
    per = boundary_reduce_nbytes(plan)
    peak = [0] * N
    kept = [0] * N  # HSDP: held buffers of the boundaries reduced so far
    for b in reversed(plan.boundaries):
        held, sent = per[b.fqn]
        for s in range(N):
            peak[s] = max(peak[s], kept[s] + held[s] + sent[s])
            if R > 1:
                kept[s] += held[s]
    return tuple(peak[rank % N] for rank in range(R * N))


def step_transient_nbytes(
    units: Sequence[tuple[int, int, int, int, int]],
    root: tuple[int, int, int],
    *,
    reshard_after_forward: bool,
    forward_prefetch: bool,
    accumulate: bool = False,
    kept_after_backward: int = 0,
) -> int:
    """The most transient bytes one rank holds at once over a training step, phase by phase
    (Note: memory per rank, docs/design.md). ``units``: per hook boundary / FSDP2 unit in forward
    order, ``(unsharded, assembled, grad, reduce, kept)`` bytes: held while it computes and while
    it is prefetched; held only while it computes; its unsharded gradients from its backward to
    its reduce; its reduce buffers from its reduce until the next unit's reduce retires them;
    of those, kept to the end of the backward (HSDP's held segments). ``root``: FSDP2's root
    unit ``(unsharded, grad, reduce)``, kept unsharded from the forward to the end of the
    backward (FSDP2's rule for the root), its gradients held through the backward (the head's
    come first). Z3 (``reshard_after_forward``): a unit is unsharded while it computes, the next
    one too when prefetched (forward: ``forward_prefetch``; backward: always, as FSDP2 and dmuon
    prefetch), and freed before its reduce buffers grow; Z2: every unit stays unsharded from
    its forward to its reduce.

    ``accumulate``: micro-batches whose backward does not reduce (a pipeline schedule's, or
    ``no_sync``), one reduce after the last: every unit's gradients stay from its first backward
    to that reduce (``grad``: the accumulated gradient, FSDP2's in the reduce dtype), and Z2's
    units stay unsharded; Z3 frees a unit after each use, but ``kept_after_backward`` bytes stay
    unsharded after their backward (FSDP2's units under a pipeline schedule, which sets
    ``reshard_after_backward=False``). The reduce after the last backward then holds one unit's
    reduce buffers beside the previous one's."""
    K = len(units)
    root_unsharded, root_grad, root_reduce = root
    held_after = [0] * (K + 1)  # Z2: units 0..i-1 unsharded (their backward not yet run)
    for i, u in enumerate(units):
        held_after[i + 1] = held_after[i] + u[0] + u[1]
    if accumulate:
        grads = sum(u[2] for u in units)
        if reshard_after_forward:
            computing = max((u[0] + u[1] + (units[i - 1][0] if i > 0 else 0) for i, u in enumerate(units)), default=0)
            params, at_reduce = computing + kept_after_backward, kept_after_backward
        else:
            params = at_reduce = held_after[K]
        pair = max((u[3] + (units[i + 1][3] if i + 1 < K else 0) for i, u in enumerate(units)), default=0)
        last = units[0][3] if K else 0
        return root_unsharded + root_grad + grads + max(params, at_reduce + pair, root_reduce + last)
    if reshard_after_forward:
        fwd = max(
            (u[0] + u[1] + (units[i + 1][0] if forward_prefetch and i + 1 < K else 0) for i, u in enumerate(units)),
            default=0,
        )
    else:
        fwd = held_after[K]
    bwd = 0
    kept = 0  # held buffers of the units retired so far
    for i in range(K - 1, -1, -1):
        unsharded, assembled, grad, reduce, keep = units[i]
        inflight = units[i + 1][3] if i + 1 < K else 0
        if reshard_after_forward:
            prefetched = units[i - 1][0] if i > 0 else 0
            computing = unsharded + assembled + prefetched
            before_reduce = prefetched  # its own copies freed before its reduce buffers grow
        else:
            computing = held_after[i + 1]
            before_reduce = held_after[i]
        bwd = max(bwd, computing + grad + inflight + kept)
        if i + 1 < K:
            kept += units[i + 1][4]
        bwd = max(bwd, before_reduce + grad + reduce + kept)
    last = (units[0][3] + kept) if K else 0  # the root's reduce beside the first unit's, in flight
    bwd = max(bwd, root_reduce + last)
    return root_unsharded + max(fwd, root_grad + bwd)


def _unit_nbytes(
    plan: Any, unit_params: Sequence[tuple[int, str]], *, accumulate: bool = False
) -> tuple[int, int, int]:
    """``(unsharded, grad, reduce)`` bytes of an FSDP2 unit of ``(numel, storage dtype)``
    parameters: all-gathered and differentiated in the parameter dtype (``mp_policy``), its
    reduce-scatter input in the reduce dtype (FSDP2's padding not counted); ``accumulate``
    (micro-batches without sync): FSDP2 accumulates the gradients in the reduce dtype."""
    unsharded = sum(numel * itemsize_nbytes(plan.bcast_dtype(dt)) for numel, dt in unit_params)
    reduce = sum(numel * itemsize_nbytes(plan.reduce_dtype_for(dt)) for numel, dt in unit_params)
    return unsharded, reduce if accumulate else unsharded, reduce


def _unit_params(plan: Any, *, with_dedicated: bool) -> dict[str, list[tuple[int, str]]]:
    """Per FSDP2 unit FQN (a hook boundary's, ``""`` the root's), its parameters ``(numel,
    storage dtype)``: the rest (``plan.fsdp2_units``), and with ``with_dedicated`` the dedicated
    parameters of its boundary (the baselines, where FSDP2 shards every parameter)."""
    out: dict[str, list[tuple[int, str]]] = {b.fqn: [] for b in plan.boundaries}
    for u in plan.fsdp2_units:
        out.setdefault(u.fqn, []).extend((math.prod(shape), dt) for shape, dt in zip(u.shapes, u.dtypes))
    if with_dedicated:
        for spec in plan.params:
            out.setdefault(plan.boundary(spec.fqn), []).append((spec.local_numel, spec.dtype))
    return out


def _root_and_order(
    plan: Any, units: dict[str, list[tuple[int, str]]], *, accumulate: bool = False
) -> tuple[list[str], tuple[int, int, int]]:
    """The units in forward order (boundaries in plan order, then any other non-root unit) and
    the root unit's ``(unsharded, grad, reduce)`` (:func:`_unit_nbytes`)."""
    order = [b.fqn for b in plan.boundaries if b.fqn != ""]
    order += [fqn for fqn in units if fqn != "" and fqn not in order]
    return order, _unit_nbytes(plan, units.get("", []), accumulate=accumulate)


def held_copy_nbytes(plan: Any, *, offload: bool = False) -> dict[str, list[int]]:
    """Per boundary, bytes of the broadcast copies of the segments each shard coordinate holds
    where they are tensors of their own beside the masters (the broadcast dtype differs from the
    storage dtype, or the masters are offloaded to the host): written from the masters before
    each broadcast and freed with the boundary's received copies (``dmuon.exec``)."""
    N = plan.mesh_shape[1]
    out: dict[str, list[int]] = {}
    for b in plan.boundaries:
        row = [0] * N
        for buf in b.buffers:
            wire = plan.bcast_dtype(buf.dtype)
            if offload or wire != buf.dtype:
                for seg in buf.segments:
                    row[seg.shard] += seg.numel * itemsize_nbytes(wire)
        out[b.fqn] = row
    return out


def dmuon_transient_nbytes(plan: Any, n: int, *, offload: bool = False, accumulate: bool = False) -> tuple[int, ...]:
    """dmuon's transient bytes per schedule rank (``n`` of them) over a step
    (:func:`step_transient_nbytes`): per boundary the packed copies the rank receives
    (:func:`boundary_received_nbytes`) and the broadcast copies of its own segments
    (:func:`held_copy_nbytes`) with FSDP2's unsharded unit of the rest, the compute tensors
    assembled from expert ranges / owner-group blocks (``plan.assembled_nbytes``), the local
    gradients of its compute parameters (broadcast dtype) and of the rest, its reduce buffers
    (:func:`boundary_reduce_nbytes`, held + sent; HSDP: the held kept) with the rest's
    reduce-scatter input; dmuon prefetches the next boundary in the forward too. ``accumulate``:
    micro-batches without sync before one reduce (:func:`step_transient_nbytes`): the local
    gradients of the compute parameters accumulate in their dtype, FSDP2's of the rest in the
    reduce dtype, and FSDP2's units of the rest stay unsharded after their backward."""
    R, N = plan.mesh_shape
    T = max(1, n // (R * N))
    recv = boundary_received_nbytes(plan)
    own = held_copy_nbytes(plan, offload=offload)
    asm = plan.assembled_nbytes
    red = boundary_reduce_nbytes(plan)
    units = _unit_params(plan, with_dedicated=False)
    order, root = _root_and_order(plan, units, accumulate=accumulate)
    grads: dict[str, int] = {}
    for spec in plan.params:
        b = plan.boundary(spec.fqn)
        grads[b] = grads.get(b, 0) + spec.local_numel * itemsize_nbytes(plan.bcast_dtype(spec.dtype))
    rest = {fqn: _unit_nbytes(plan, units.get(fqn, []), accumulate=accumulate) for fqn in order}
    kept_rest = sum(uns for uns, _, _ in rest.values())
    by_shard: dict[int, int] = {}  # every rank of a shard coordinate holds the same
    for s in range(N):
        rows = []
        for fqn in order:
            r_uns, r_grad, r_red = rest[fqn]
            held, sent = red.get(fqn, ([0] * N, [0] * N))
            rows.append(
                (
                    recv.get(fqn, [0] * N)[s] + own.get(fqn, [0] * N)[s] + r_uns,
                    asm.get(fqn, 0),
                    grads.get(fqn, 0) + r_grad,
                    held[s] + sent[s] + r_red,
                    held[s] if R > 1 else 0,
                )
            )
        by_shard[s] = step_transient_nbytes(
            rows,
            root,
            reshard_after_forward=plan.reshard_after_forward,
            forward_prefetch=True,
            accumulate=accumulate,
            kept_after_backward=kept_rest,
        )
    return tuple(by_shard[(x // T) % N] for x in range(n))


def fsdp2_transient_nbytes(plan: Any, reshard_after_forward: bool, *, accumulate: bool = False) -> int:
    """FSDP2's transient bytes over a step when it shards every parameter
    (:func:`step_transient_nbytes`): per unit its parameters unsharded, their gradients and its
    reduce-scatter input; FSDP2 prefetches in the backward only (its default). ``accumulate``
    (micro-batches without sync, then one reduce): gradients accumulated in the reduce dtype and
    every unit kept unsharded after its backward (a pipeline schedule's
    ``set_reshard_after_backward(False)``)."""
    units = _unit_params(plan, with_dedicated=True)
    order, root = _root_and_order(plan, units, accumulate=accumulate)
    rows = [_unit_nbytes(plan, units[fqn], accumulate=accumulate) for fqn in order]
    return step_transient_nbytes(
        [(uns, 0, grad, red, 0) for uns, grad, red in rows],
        root,
        reshard_after_forward=reshard_after_forward and not accumulate,
        forward_prefetch=False,
        accumulate=accumulate,
    )


def _plan_ep(plan: Any) -> int:
    return max((spec.ep_size for spec in plan.params), default=1)


def fsdp2_rest_nbytes(plan: Any) -> tuple[int, dict[str, int]]:
    """``(shard bytes, {unit: unsharded bytes})`` of the parameters dmuon leaves to FSDP2
    (``plan.fsdp2_units``): one rank's FSDP2 shards of all of them (expert stacks as torchtitan
    shards them, :func:`~dmuon.plan._cost.baseline.fsdp2_param_shard`), and each unit's full size."""
    N = plan.mesh_shape[1]
    ep = _plan_ep(plan)
    shard = 0
    unit_full: dict[str, int] = {}
    for u in plan.fsdp2_units:
        full = 0
        for p, shape, dt in zip(u.params, u.shapes, u.dtypes):
            isz = itemsize_nbytes(dt)
            full += math.prod(shape) * isz
            shard += _baseline.fsdp2_param_shard(p, tuple(shape), N, ep=ep)[1] * isz
        unit_full[u.fqn] = unit_full.get(u.fqn, 0) + full
    return shard, unit_full


def dmuon_memory(
    plan: Any, stats: Sequence[RankStats], *, variant: str = "muon", offload: bool = False, accumulate: bool = False
) -> tuple[MemoryTerms, ...]:
    """dmuon's :class:`MemoryTerms` per schedule rank (Note: memory per rank, docs/design.md), from the plan's
    :func:`rank_stats` ``stats`` (one per schedule rank); ``variant``: ``"muon"`` or ``"normuon"`` (:data:`MEMORY_VARIANTS`);
    ``offload``: under CPU offload, device and host terms apart (:func:`dmuon_offload_memory`);
    ``accumulate``: micro-batches without sync before one reduce (:func:`dmuon_transient_nbytes`)."""
    if variant not in MEMORY_VARIANTS:
        raise ValueError(f"variant must be one of {MEMORY_VARIANTS}, got {variant!r}")
    if offload:
        _check_offload_memory(plan, variant)
    R, N = plan.mesh_shape
    T = max(1, len(stats) // (R * N))
    rest, _ = fsdp2_rest_nbytes(plan)
    transient = dmuon_transient_nbytes(plan, len(stats), offload=offload, accumulate=accumulate)
    step = muon_step_nbytes(plan)  # the optimizer step's temporaries, after the backward's are gone
    second = [0] * (R * N)
    if variant == "normuon":
        for spec, owner in zip(plan.params, plan.owners):
            for rank, nb in second_moment_nbytes(spec, owner):
                second[rank] += nb
    out = []
    for st in stats:
        momentum = st.owned_nbytes
        out.append(
            MemoryTerms(
                parameters_nbytes=st.resident_nbytes - momentum + rest,
                gradients_nbytes=st.owned_nbytes + rest,
                momentum_nbytes=momentum,
                second_moment_nbytes=second[st.rank // T],
                adamw_nbytes=2 * rest,
                transient_nbytes=max(transient[st.rank], step[st.rank // T]),
            )
        )
    return dmuon_offload_memory(plan, stats, out) if offload else tuple(out)


def fsdp2_memory(
    plan: Any,
    variant: str,
    *,
    reshard_after_forward: bool | None = None,
    offload: bool = False,
    accumulate: bool = False,
) -> MemoryTerms:
    """One rank's :class:`MemoryTerms` (every rank the same) when FSDP2 shards every parameter
    of the plan's model on its mesh (Note: memory per rank, docs/design.md): ``"adamw"`` (FSDP2 + AdamW, Z3 as FSDP2
    defaults to), ``"naive"`` (FSDP2 + naive Muon: every Muon update gathered before its NS; the
    plan's Z2 / Z3) or ``"all_to_all"`` (dion-style: the same, then two matrices' worth of each
    owned batch instead of the gathered updates). ``reshard_after_forward`` overrides the
    variant's Z3 / Z2 (a pipelined baseline runs Z2, as torchtitan does under PP). ``offload``:
    FSDP2's ``CPUOffloadPolicy``, device and host terms apart (:func:`fsdp2_offload_memory`);
    ``accumulate``: micro-batches without sync before one reduce (:func:`fsdp2_transient_nbytes`)."""
    if variant not in ("adamw", "naive", "all_to_all"):
        raise ValueError(f"variant must be 'adamw', 'naive' or 'all_to_all', got {variant!r}")
    if offload:
        return fsdp2_offload_memory(
            fsdp2_memory(plan, variant, reshard_after_forward=reshard_after_forward, accumulate=accumulate)
        )
    N = plan.mesh_shape[1]
    rest, _ = fsdp2_rest_nbytes(plan)
    muon_shard = sum(_baseline.spec_fsdp2_shard(s, N)[1] * itemsize_nbytes(s.dtype) for s in plan.params)
    muon_full = sum(s.local_numel * itemsize_nbytes(s.dtype) for s in plan.params)
    z3 = _baseline.baseline_reshard_after_forward(variant, plan, reshard_after_forward)
    transient = fsdp2_transient_nbytes(plan, z3, accumulate=accumulate)
    if variant == "naive":  # the step gathers every update before its Newton-Schulz, beside the root unit
        units = _unit_params(plan, with_dedicated=True)
        largest = max((_unit_nbytes(plan, ps)[0] for ps in units.values()), default=0)
        transient = max(transient, muon_full + largest)
    elif variant == "all_to_all":
        transient += 2 * (muon_full // max(N, 1))
    adamw = variant == "adamw"
    return MemoryTerms(
        parameters_nbytes=rest + muon_shard,
        gradients_nbytes=rest + muon_shard,
        momentum_nbytes=0 if adamw else muon_shard,
        second_moment_nbytes=0,
        adamw_nbytes=2 * rest + (2 * muon_shard if adamw else 0),
        transient_nbytes=transient,
    )


def ranks_above(terms: Sequence[MemoryTerms], reference: MemoryTerms) -> tuple[int, ...]:
    """The ranks (indices into ``terms``) whose whole peak exceeds ``reference``'s (FSDP2 +
    AdamW's, :func:`fsdp2_memory`): what the summary and the plan page flag."""
    return tuple(i for i, t in enumerate(terms) if t.peak_nbytes > reference.peak_nbytes)


# ----------------------------------------------------------------------------------------------
# CPU offload: dedicate_params(offload_policy=CPUOffloadPolicy(...)) and fully_shard's same policy
# ----------------------------------------------------------------------------------------------

#: runs of the offloaded Muon step on the compute device at once
#: (:func:`dmuon.exec._optim.offload_stage.staged_runs`): the run being updated and the next
#: run's copies, which overlap its compute
OFFLOAD_RUNS_IN_FLIGHT = 2


def check_offloadable(plan: Any) -> None:
    """Raise where ``dedicate_params(offload_policy=CPUOffloadPolicy(...))`` refuses the plan
    (it calls this; local: every rank raises alike): offload keeps whole owned matrices on the host.

    Raises:
        NotImplementedError: TP-sharded or owner-grouped matrices.
    """
    grouped = [spec.fqn for spec, owner in zip(plan.params, plan.owners) if isinstance(owner, OwnerGroup)]
    if plan.tp_size > 1 or grouped:
        what = f"TP degree {plan.tp_size}" if plan.tp_size > 1 else f"owner-grouped matrices ({grouped[0]!r}, ...)"
        raise NotImplementedError(
            f"dmuon: offload_policy=CPUOffloadPolicy(...) with {what} is not supported yet: offload keeps whole "
            "owned matrices on the host. Drop offload_policy (here and in fully_shard), or compile without "
            "owner groups (owner_groups=None) and without TP"
        )


def _check_offload_memory(plan: Any, variant: str) -> None:
    """:func:`check_offloadable`, and what else :func:`dmuon_memory` refuses under offload.

    Raises:
        NotImplementedError: as :func:`check_offloadable`; expert-parallel local stacks
            (``compile(ep=...)``), whose memory under offload is not modelled.
        ValueError: ``variant="normuon"`` (``dmuon.Muon`` refuses it on offloaded matrices).
    """
    check_offloadable(plan)
    local = [s.fqn for s, o in zip(plan.params, plan.owners) if isinstance(o, ExpertOwners) and o.local]
    if local:
        raise NotImplementedError(
            f"dmuon: the memory of offload with expert-parallel local stacks ({local[0]!r}, ...) is not modelled: "
            "they stay on the device while their momenta go to the host. Compile without ep= for offload figures"
        )
    if variant == "normuon":
        raise ValueError(
            "dmuon: variant='normuon' with offload (dedicate_params(offload_policy=CPUOffloadPolicy(...))) is not "
            "supported yet; use variant='muon' or offload=False"
        )


def held_segment_nbytes(plan: Any) -> tuple[int, ...]:
    """Per mesh rank, bytes of the packed segments it holds (every buffer's segment of its shard
    coordinate: its owned masters and, on HSDP, the replicas of its shard peers'), whole as the
    runtime allocates its masters (alignment padding and presence flags included, storage dtype:
    ``dmuon.exec._setup.materialize``). Their broadcast copies, where they are tensors of their
    own, live only while their boundary is unsharded: :func:`held_copy_nbytes`."""
    R, N = plan.mesh_shape
    per_shard = [0] * N
    for b in plan.boundaries:
        for buf in b.buffers:
            isz = itemsize_nbytes(buf.dtype)
            for seg in buf.segments:
                per_shard[seg.shard] += seg.numel * isz
    return tuple(per_shard[rank % N] for rank in range(R * N))


def owned_pieces(spec: ParamSpec, owner: Any) -> list[tuple[Owner, int, int]]:
    """``(member, elements, elements of a unit)`` of what each owner of ``spec`` owns: an expert
    range per member of :class:`ExpertOwners` (a unit: one expert, its gate and up together), a
    block per member of an :class:`OwnerGroup` (never cut), else the owner's whole local tensor
    (a whole expert stack cut between experts, as a range is)."""
    if isinstance(owner, ExpertOwners):
        per_expert = spec.numel // spec.num_experts
        return [(m, per_expert * size, per_expert) for m, size in zip(owner.members, owner.sizes)]
    if isinstance(owner, OwnerGroup):
        weights = member_weights(spec, owner.dim, owner.sizes, "numel", ())
        return [(m, w, w) for m, w in zip(owner.members, weights)]
    per_expert = spec.numel // spec.num_experts if spec.experts is not None else 0
    whole = per_expert and spec.local_numel % per_expert == 0
    return [(owner, spec.local_numel, per_expert if whole else spec.local_numel)]


def _step_runs(plan: Any) -> list[list[tuple[tuple[int, int], str, int, int]]]:
    """Per mesh rank, its Muon step's runs in order, each ``(NS sides, storage dtype, elements,
    bytes copied to the device under offload)``: the items it owns (:func:`owned_pieces`; each
    block of a matrix view an item of its own sides) in buckets of equal NS sides and dtype in
    order of first appearance, each cut by :func:`~dmuon.plan._rules.ns_batch_pieces` (an expert
    range larger than ``NS_BATCH_MAX_NUMEL`` elements in pieces of whole experts), as
    ``dmuon.Muon``'s default ``ns_batching="batched"`` cuts them (``dmuon.exec._optim.muon_step``).
    An item copies its parameter, gradient and momentum (3 tensors); a view block its parameter
    block and its update block (the momentum ran on the host: 2 tensors)."""
    R, N = plan.mesh_shape
    per_rank: list[dict[tuple, list[tuple[int, int, int]]]] = [{} for _ in range(R * N)]
    for spec, owner in zip(plan.params, plan.owners):
        isz = itemsize_nbytes(spec.dtype)
        if spec.view is not None:
            for m, n in spec.matrices:
                per_rank[owner.rank].setdefault((_rules.ns_bucket_sides(m, n), spec.dtype), []).append(
                    (m * n, m * n, 2 * isz)
                )
            continue
        sides = _rules.ns_bucket_sides(*spec.matrix_shape)
        for member, numel, unit in owned_pieces(spec, owner):
            per_rank[member.rank].setdefault((sides, spec.dtype), []).append((numel, unit, 3 * isz))
    out = []
    for buckets in per_rank:
        runs = []
        for (sides, dtype), entries in buckets.items():
            for run in _rules.ns_batch_pieces([e[0] for e in entries], [e[1] for e in entries]):
                numels = [(p.stop - p.start) * entries[p.entry][1] for p in run]
                copies = sum(numel * entries[p.entry][2] for numel, p in zip(numels, run))
                runs.append((sides, dtype, sum(numels), copies))
        out.append(runs)
    return out


#: Newton-Schulz's dtype the optimizer-step term assumes: ``dmuon.Muon``'s default (bf16)
NS_ITEMSIZE = 2


def muon_step_nbytes(plan: Any, *, ns_itemsize: int = NS_ITEMSIZE) -> tuple[int, ...]:
    """Per mesh rank, the most temporary bytes its Muon step holds at once (the default
    ``ns_batching="batched"``; ``dmuon._update``): per run (:func:`_step_runs`) of ``E`` elements
    of storage itemsize ``p``, Newton-Schulz itemsize ``s`` and matrices of sides ``d <= D``:
    during Newton-Schulz the formed update and the batch concatenated (``2·E·p``), the normalised
    copy and the other step buffer (``2·E·s``) and the two ``(d, d)`` products per matrix
    (``2·E·(d/D)·s``); then the result cast back beside them (``3·E·p + E·s``): the larger of the
    two, the largest run."""
    out = []
    for runs in _step_runs(plan):
        peak = 0
        for (d, D), dtype, e, _ in runs:
            p = itemsize_nbytes(dtype)
            during = 2 * e * p + 2 * e * ns_itemsize + (2 * e * ns_itemsize * d) // D
            peak = max(peak, during, 3 * e * p + e * ns_itemsize)
        out.append(peak)
    return tuple(out)


def staged_run_nbytes(plan: Any) -> tuple[int, ...]:
    """Per mesh rank, device bytes of the offloaded Muon step's copies at once: the most bytes of
    :data:`OFFLOAD_RUNS_IN_FLIGHT` consecutive runs (:func:`_step_runs`). Newton-Schulz's own
    workspace is :func:`muon_step_nbytes`."""
    k = OFFLOAD_RUNS_IN_FLIGHT
    out = []
    for runs in _step_runs(plan):
        copies = [r[3] for r in runs]
        out.append(max((sum(copies[i : i + k]) for i in range(max(1, len(copies) - k + 1))), default=0))
    return tuple(out)


def dmuon_offload_memory(
    plan: Any, stats: Sequence[RankStats], terms: Sequence[MemoryTerms]
) -> tuple[MemoryTerms, ...]:
    """dmuon's memory per rank under CPU offload, from its terms without it (``terms``, of
    :func:`dmuon_memory` with ``offload=True``: its transient counts each held segment's
    broadcast copy on the device while its boundary is unsharded, :func:`held_copy_nbytes`): on
    the host the held masters (:func:`held_segment_nbytes`, storage dtype) and FSDP2's shards of
    the rest, the gradients (owners' and the rest's shards), the momentum and AdamW's moments; on
    the compute device every transient term and the Muon step's copies (:func:`staged_run_nbytes`)."""
    rest, _ = fsdp2_rest_nbytes(plan)
    masters = held_segment_nbytes(plan)
    staged = staged_run_nbytes(plan)
    return tuple(
        MemoryTerms(
            parameters_nbytes=0,
            gradients_nbytes=0,
            momentum_nbytes=0,
            second_moment_nbytes=0,
            adamw_nbytes=0,
            transient_nbytes=t.transient_nbytes + staged[st.rank],
            host_parameters_nbytes=masters[st.rank] + rest,
            host_gradients_nbytes=t.gradients_nbytes,
            host_momentum_nbytes=t.momentum_nbytes,
            host_adamw_nbytes=t.adamw_nbytes,
        )
        for st, t in zip(stats, terms)
    )


def fsdp2_offload_memory(terms: MemoryTerms) -> MemoryTerms:
    """An FSDP2 baseline's memory under ``CPUOffloadPolicy``, from its terms without it: shards,
    gradient shards, momentum shards (naive Muon) and AdamW's moments on the host; the unsharded
    units and gradients (the transient term) on the compute device."""
    return MemoryTerms(
        parameters_nbytes=0,
        gradients_nbytes=0,
        momentum_nbytes=0,
        second_moment_nbytes=0,
        adamw_nbytes=0,
        transient_nbytes=terms.transient_nbytes,
        host_parameters_nbytes=terms.parameters_nbytes,
        host_gradients_nbytes=terms.gradients_nbytes,
        host_momentum_nbytes=terms.momentum_nbytes,
        host_adamw_nbytes=terms.adamw_nbytes,
    )
