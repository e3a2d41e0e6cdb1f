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
    "step_transient_nbytes",
    "dmuon_transient_nbytes",
    "fsdp2_transient_nbytes",
    "fsdp2_rest_nbytes",
    "dmuon_memory",
    "fsdp2_memory",
    "ranks_above",
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
        if isinstance(owner, ExpertOwners):  # each member owns (and its replicas hold) a range of experts
            per_expert = spec.numel // spec.num_experts
            pieces = [(member, per_expert * size) for member, size in zip(owner.members, owner.sizes)]
        elif isinstance(owner, OwnerGroup):  # each member owns (and its replicas hold) one block
            pieces = list(zip(owner.members, member_weights(spec, owner.dim, owner.sizes, "numel", ())))
        else:
            pieces = [(owner, spec.local_numel)]
        for member, numel in pieces:
            owned_numel[member.rank] += numel
            owned_nbytes[member.rank] += numel * isz
            replica_nbytes_by_shard[member.shard] += numel * isz

    flops = [0] * n
    for op in sched.ops:
        if op.kind == "newton_schulz":
            for x in op.group:
                flops[x] += op.flops
    per_boundary = received_nbytes(sched, n)
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
    ``sched`` (micro-batch 0): the packed copies a rank holds while the boundary is unsharded."""
    received: dict[tuple[str, tuple[int, ...]], int] = {}  # (boundary, group) -> bytes per member
    root_credit: dict[tuple[str, int], int] = {}
    for op in sched.ops:
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
    return per_boundary


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


def reduce_numels(buf: Any, shard: int, num_shards: int) -> tuple[int, int]:
    """``(held, sent)``: elements of boundary buffer ``buf``'s gradient reduce buffers on a rank
    of shard coordinate ``shard`` (the runtime's, ``dmuon.exec``): ``held``, the buffer of the
    segment the rank holds (it receives the sums it owns; a broadcast buffer's segment
    ``shard``, an all-gathered buffer's output slot), kept to the end of the backward; ``sent``,
    the rest of what it packs (the other segments of its group; the reduce-scatter input, ``k``
    slots, and the output slot where it holds no segment), released before the next boundary's
    buffers grow (on a 1-D mesh the held buffer too, its averages taken out). ``held + sent == buffer_wire_numel(buf, N)`` on a 1-D or EP group."""
    full = buffer_wire_numel(buf, num_shards)
    ep = buf.ep
    mine = [seg for seg in buf.segments if seg.shard == shard]
    if getattr(buf, "collective", "broadcast") == "all_gather":
        held = buf.slot_numel if mine else 0
        return held, full + buf.slot_numel - held
    group = sum(seg.numel for seg in buf.segments if ep == 1 or seg.shard % ep == shard % ep)
    held = mine[0].numel if mine else 0
    return held, group - held


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
            for s in range(N):
                h, t = reduce_numels(buf, s, N)
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
    its forward to its reduce."""
    K = len(units)
    root_unsharded, root_grad, root_reduce = root
    held_after = [0] * (K + 1)  # Z2: units 0..i-1 unsharded (their backward not yet run)
    for i, u in enumerate(units):
        held_after[i + 1] = held_after[i] + u[0] + u[1]
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


def _unit_nbytes(plan: Any, unit_params: Sequence[tuple[int, str]]) -> tuple[int, int, int]:
    """``(unsharded, grad, reduce)`` bytes of an FSDP2 unit of ``(numel, storage dtype)``
    parameters: all-gathered and differentiated in the parameter dtype (``mp_policy``), its
    reduce-scatter input in the reduce dtype (FSDP2's padding not counted)."""
    unsharded = sum(numel * itemsize_nbytes(plan.bcast_dtype(dt)) for numel, dt in unit_params)
    reduce = sum(numel * itemsize_nbytes(plan.reduce_dtype_for(dt)) for numel, dt in unit_params)
    return unsharded, unsharded, reduce


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


def _root_and_order(plan: Any, units: dict[str, list[tuple[int, str]]]) -> tuple[list[str], tuple[int, int, int]]:
    """The units in forward order (boundaries in plan order, then any other non-root unit) and
    the root unit's ``(unsharded, grad, reduce)``."""
    order = [b.fqn for b in plan.boundaries if b.fqn != ""]
    order += [fqn for fqn in units if fqn != "" and fqn not in order]
    return order, _unit_nbytes(plan, units.get("", []))


def dmuon_transient_nbytes(plan: Any, sched: Any, n: int) -> tuple[int, ...]:
    """dmuon's transient bytes per schedule rank (``n`` of them) over a step
    (:func:`step_transient_nbytes`): per boundary the packed copies the rank receives
    (:func:`received_nbytes`) with FSDP2's unsharded unit of the rest, the compute tensors
    assembled from expert ranges / owner-group blocks (``plan.assembled_nbytes``), the local
    gradients of its compute parameters (broadcast dtype) and of the rest, its reduce buffers
    (:func:`boundary_reduce_nbytes`, held + sent; HSDP: the held kept) with the rest's
    reduce-scatter input; dmuon prefetches the next boundary in the forward too."""
    R, N = plan.mesh_shape
    T = max(1, n // (R * N))
    recv = received_nbytes(sched, n)
    asm = plan.assembled_nbytes
    red = boundary_reduce_nbytes(plan)
    units = _unit_params(plan, with_dedicated=False)
    order, root = _root_and_order(plan, units)
    grads: dict[str, int] = {}
    for spec in plan.params:
        b = plan.boundary(spec.fqn)
        grads[b] = grads.get(b, 0) + spec.local_numel * itemsize_nbytes(plan.bcast_dtype(spec.dtype))
    rest = {fqn: _unit_nbytes(plan, units.get(fqn, [])) for fqn in order}
    out = []
    for x in range(n):
        s = (x // T) % N
        rows = []
        for fqn in order:
            r_uns, r_grad, r_red = rest[fqn]
            held, sent = red.get(fqn, ([0] * N, [0] * N))
            rows.append(
                (
                    recv.get(fqn, [0] * n)[x] + r_uns,
                    asm.get(fqn, 0),
                    grads.get(fqn, 0) + r_grad,
                    held[s] + sent[s] + r_red,
                    held[s] if R > 1 else 0,
                )
            )
        out.append(
            step_transient_nbytes(rows, root, reshard_after_forward=plan.reshard_after_forward, forward_prefetch=True)
        )
    return tuple(out)


def fsdp2_transient_nbytes(plan: Any, reshard_after_forward: bool) -> int:
    """FSDP2's transient bytes over a step when it shards every parameter
    (:func:`step_transient_nbytes`): per unit its parameters unsharded, their gradients and its
    reduce-scatter input; FSDP2 prefetches in the backward only (its default)."""
    units = _unit_params(plan, with_dedicated=True)
    order, root = _root_and_order(plan, units)
    rows = [_unit_nbytes(plan, units[fqn]) for fqn in order]
    return step_transient_nbytes(
        [(uns, 0, grad, red, 0) for uns, grad, red in rows],
        root,
        reshard_after_forward=reshard_after_forward,
        forward_prefetch=False,
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
    plan: Any, stats: Sequence[RankStats], *, variant: str = "muon", sched: Any = None
) -> tuple[MemoryTerms, ...]:
    """dmuon's :class:`MemoryTerms` per schedule rank (Note: memory per rank, docs/design.md), from the plan's
    :func:`rank_stats` ``stats`` (one per schedule rank) and its nominal schedule ``sched``
    (None: ``plan.schedule()``); ``variant``: ``"muon"`` or ``"normuon"`` (:data:`MEMORY_VARIANTS`)."""
    if variant not in MEMORY_VARIANTS:
        raise ValueError(f"variant must be one of {MEMORY_VARIANTS}, got {variant!r}")
    R, N = plan.mesh_shape
    T = max(1, len(stats) // (R * N))
    rest, _ = fsdp2_rest_nbytes(plan)
    transient = dmuon_transient_nbytes(plan, plan.schedule() if sched is None else sched, len(stats))
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
                transient_nbytes=transient[st.rank],
            )
        )
    return tuple(out)


def fsdp2_memory(plan: Any, variant: str, *, reshard_after_forward: bool | None = None) -> MemoryTerms:
    """One rank's :class:`MemoryTerms` (every rank the same) when FSDP2 shards every parameter
    of the plan's model on its mesh (Note: memory per rank, docs/design.md): ``"adamw"`` (FSDP2 + AdamW, Z3 as FSDP2
    defaults to), ``"naive"`` (FSDP2 + naive Muon: every Muon update gathered before its NS; the
    plan's Z2 / Z3) or ``"all_to_all"`` (dion-style: the same, then two matrices' worth of each
    owned batch instead of the gathered updates). ``reshard_after_forward`` overrides the
    variant's Z3 / Z2 (a pipelined baseline runs Z2, as torchtitan does under PP)."""
    if variant not in ("adamw", "naive", "all_to_all"):
        raise ValueError(f"variant must be 'adamw', 'naive' or 'all_to_all', got {variant!r}")
    N = plan.mesh_shape[1]
    rest, _ = fsdp2_rest_nbytes(plan)
    muon_shard = sum(_baseline.spec_fsdp2_shard(s, N)[1] * itemsize_nbytes(s.dtype) for s in plan.params)
    muon_full = sum(s.local_numel * itemsize_nbytes(s.dtype) for s in plan.params)
    z3 = _baseline.baseline_reshard_after_forward(variant, plan, reshard_after_forward)
    transient = fsdp2_transient_nbytes(plan, z3)
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
