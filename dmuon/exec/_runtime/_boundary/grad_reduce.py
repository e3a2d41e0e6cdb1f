"""A hook boundary's gradient reduce: :func:`launch_reduce` (its post-backward: pack the local
gradients into the reduce buffers and reduce them towards their owners), and its completion over
the model's boundaries (:func:`finish_reduces`: the end of a backward; the HSDP replicate reduces,
:func:`issue_replicate_reduces`; the divisor of a reduced gradient, :func:`grad_divisor`). The
records in flight are :class:`_PendingReduce` entries of the comm context's ``pending_reduces``."""

from __future__ import annotations

import dataclasses
import functools

import torch

from dmuon.exec._comm import collective_calls as C
from dmuon.exec._runtime.packed_buffers import _Segment
from dmuon.exec._runtime.streams import _on_stream, current_stream
from dmuon.exec._runtime._boundary.bound_ops import ONE_RANK
from dmuon.exec._runtime._boundary.gather_buffers import _GatherBuffer, _owned_views
from dmuon.exec._setup.fsdp2 import gradient_divide_factor

__all__ = [
    "launch_reduce",
    "finish_reduces",
    "grad_divisor",
    "issue_replicate_reduces",
    "issue_replicate_reduces_before",
    "retire_reduces_before",
]


@dataclasses.dataclass(eq=False)
class _PendingReduce:
    """A launched gradient reduce, until :func:`finish_reduces`: its ``boundary``, the held
    ``segment`` whose owned sub-segments it delivers (None: this rank holds nothing in an
    all-gathered buffer), the reduce buffer ``buf`` laid out as that segment (a broadcast
    segment's, or an all-gathered buffer's ``rs_out``), the ``works`` to wait for, the local
    gradients to ``keep`` referenced until then (CUDA), and the ``gather`` buffer of a
    reduce-scatter (its ``rs_in`` is released after the wait); ``waited`` once its works were
    waited for (:func:`retire_reduces_before`); ``replicated`` once
    :func:`issue_replicate_reduces` has taken it."""

    boundary: object  # the HookBoundary
    segment: _Segment | None
    buf: torch.Tensor
    works: list
    keep: list
    gather: _GatherBuffer | None
    replicated: bool = False  # HSDP: its works waited for and its replicate reduces issued
    waited: bool = False  # its works waited for (its buffers released where no replicate reduce reads them)


def launch_reduce(boundary) -> None:
    """Pack the local gradients into the reduce buffers and reduce them: per broadcast
    segment its reduce buffer, SUM-reduced to its holder (runs on one group coalesced where
    the backend coalesces); per all-gathered buffer ``rs_in`` (every segment at its slot),
    reduce-scattered into this rank's slot ``rs_out``.

    The buffer tensors are reused (storage regrown, zeroed, rewritten), so a reduce still in
    flight on one (the same boundary finishing twice before the end of the backward) is
    finished first. Before its buffers grow, the reduces of the boundaries reduced before it
    are retired (:func:`retire_reduces_before`: waited for, HSDP's replicate reduces issued,
    their buffers released), as FSDP2 waits for the previous reduce-scatter. CUDA: the packing
    and the reduce are ordered after the compute stream on the reduce stream; the local
    gradients stay referenced until the reduce is retired.
    """
    ctx = boundary.comm_ctx
    boundary.unreduced = False
    if any(seg.reduce_inflight for seg in boundary.segments) or any(gb.reduce_inflight for gb in boundary.gathers):
        finish_reduces(ctx)
    retire_reduces_before(ctx)
    stream = ctx.comm_stream("reduce")  # None on CPU
    # (re)grow the buffers on the compute stream, as FSDP2 allocates its reduce-scatter input
    bufs = [
        _reduce_buffer(b.segment) if b.gather is None else b.gather.reduce_buffers()[0] for b in boundary.ops.reduce
    ]
    if stream is not None:  # the gradients were produced on the compute stream
        stream.wait_stream(current_stream(stream.device))
    with _on_stream(stream):
        keeps = []
        for b, buf in zip(boundary.ops.reduce, bufs):
            buf.fill_(0)
            keep: list = []
            gb = b.gather
            if gb is None:
                _pack(b.segment, buf, 0, keep, stream)
            else:
                for j, seg in enumerate(gb.segments):
                    if seg is not None:
                        _pack(seg, buf, j * gb.slot_numel, keep, stream)
            keeps.append(keep)
        if ctx.check_nonfinite and bufs:  # skip_nonfinite: this rank's gradients, before the reduce
            ctx.note_reduce_input(bufs)
        i = 0
        ops = boundary.ops.reduce
        while i < len(ops):
            b = ops[i]
            gb = b.gather
            if gb is not None:
                work = C.reduce_scatter_into(gb.rs_out, bufs[i], group=b.group, phase=b.op.phase, async_op=True)
                gb.reduce_inflight = True
                ctx.pending_reduces.append(_PendingReduce(boundary, gb.held, gb.rs_out, [work], keeps[i], gb))
                i += 1
                continue
            j = i + 1
            while j < len(ops) and ops[j].gather is None and ops[j].group is b.group:
                j += 1
            if b.group is ONE_RANK:  # an efsdp group of one rank: the buffer is already the sum
                works = []
            else:
                items = [(bufs[q], ops[q].root) for q in range(i, j)]
                works = C.reduce_many(items, group=b.group, phase=b.op.phase, coalesce=ctx.coalesces(b.group))
            for q in range(i, j):  # the run's works (one when coalesced) ride on its first segment
                seg = ops[q].segment
                seg.reduce_inflight = True
                ctx.pending_reduces.append(
                    _PendingReduce(boundary, seg, bufs[q], works if q == i else [], keeps[q], None)
                )
            i = j
        for gm in boundary.grouped:  # every block packed: the full local gradient is done with
            gm.compute.grad = None
    # HSDP: the boundaries reduced before this one, their shard reduces launched one boundary's
    # backward ago, go on to their replicate reduces now (after this boundary's reduces, the
    # schedule's order) rather than all after the backward
    issue_replicate_reduces_before(ctx, boundary)


def _pack(seg: _Segment, buf: torch.Tensor, base: int, keep: list, stream) -> None:
    """Write ``seg``'s local gradients into ``buf`` at ``base`` + their offsets in the segment,
    and a presence flag 1 for each one present (zeros stay where a compute parameter has no
    gradient); a matrix's compute gradient is dropped once packed. The flags of a sub-segment
    whose every slot has a gradient (the usual case) are written by one fill, not one per slot."""
    for sub in seg.subs:
        present = []
        for k, slot in enumerate(sub.slots):
            gm = slot.grouped
            g = slot.compute.grad if gm is None else gm.compute.grad
            if g is None:
                continue
            if slot.tp is not None:
                g = slot.tp.local(g)
            if gm is not None:  # this block of the grouped matrix's full gradient
                g = g.narrow(gm.info.dim, gm.info.compute_offset(slot.block), gm.info.sizes[slot.block])
            start = base + slot.offset_in_seg
            buf[start : start + slot.numel].view(slot.shape).copy_(g)
            present.append(k)
            if stream is not None:
                keep.append(g)
            if gm is None:
                slot.compute.grad = None
        flags = base + sub.flags_offset_in_seg
        if len(present) == len(sub.slots):
            buf[flags : flags + len(present)].fill_(1)
        else:
            for k in present:
                buf[flags + k] = 1


def _reduce_buffer(seg: _Segment) -> torch.Tensor:
    """The segment's reduce buffer, with its storage grown: the tensor (and the views of the
    sub-segments this rank owns) is built once, on the segment's device in the reduce dtype,
    and rebuilt only after the segment moved; its storage is released again by
    :func:`finish_reduces` once the averages are out, as the broadcast buffers'
    storage is after the boundary's use, so no rank keeps gradient-sized memory between
    backwards."""
    buf = seg.reduce_buf
    if buf is None or buf.device != seg.wire.device:
        buf = torch.empty(seg.numel, dtype=seg.reduce_dtype, device=seg.wire.device)
        seg.reduce_buf = buf
        seg.owned = _owned_views(seg, buf)
    else:
        buf.untyped_storage().resize_(seg.numel * buf.element_size())
    return buf


def issue_replicate_reduces(ctx, entries: list) -> None:
    """HSDP: wait for the shard-group reduces of ``entries`` (pending records of boundaries whose
    reduces are all launched) and issue their replicate reduces: every holder ``(s, r')`` of a
    segment SUM-reduces each sub-segment over its replicate group to the sub-segment's owner
    ``(s, r)``. The works join ``ctx.replicate_reduce_works``, waited for by :func:`finish_reduces`.
    The post-backward of each boundary calls this for the boundaries reduced before it (one
    boundary's backward after their shard reduces were launched), :func:`finish_reduces` for the
    rest; on a 1-D mesh there is nothing to issue. On NCCL the waits are the reduce stream's."""
    if not entries:
        return
    stream = ctx.comm_stream("reduce")  # None on CPU
    with _on_stream(stream):
        _wait(ctx, entries)
        for p in entries:
            p.replicated = True
        for p in entries:  # the held segments' sub-segments
            if p.segment is None:
                continue
            for b in p.boundary.ops.replicate_reduce_of(p.segment):
                part = p.buf[b.sub.offset_in_seg : b.sub.offset_in_seg + b.sub.numel]
                work = C.reduce_sum(part, dst=b.root, group=b.group, phase=b.op.phase, async_op=True)
                ctx.replicate_reduce_works.append((p.boundary, work, b.group))


def _wait(ctx, entries: list) -> None:
    """Wait for the works of ``entries`` not waited for yet (on NCCL: the current stream waits)."""
    for p in entries:
        if not p.waited:
            ctx.wait(p.works, f"boundary {p.boundary.fqn!r} reduce", boundary=p.boundary, group=_reduce_group(p))
            p.waited = True


def issue_replicate_reduces_before(ctx, boundary) -> None:
    """HSDP: the replicate reduces of the boundaries reduced before ``boundary`` in this backward
    (:func:`issue_replicate_reduces`); nothing on a 1-D mesh."""
    if ctx.groups.shape[0] == 1:
        return
    # the entries due: after the last one already taken (entries are taken in order) and before
    # ``boundary``'s own, just appended at the end; walked from the end, so a post-backward
    # reads only its own and the previous boundary's entries, not the whole backward's
    pending = ctx.pending_reduces
    end = len(pending)
    while end and pending[end - 1].boundary is boundary:
        end -= 1
    start = end
    while start and not pending[start - 1].replicated:
        start -= 1
    issue_replicate_reduces(ctx, pending[start:end])


def retire_reduces_before(ctx) -> None:
    """Retire the reduces launched so far and not yet waited for (the boundaries reduced before the
    one about to reduce; their reduces had its backward to run in): wait for them (their HSDP
    replicate reduces are issued after the new boundary's reduces,
    :func:`issue_replicate_reduces_before`, as the schedule orders them), then release the reduce buffers
    no replicate reduce reads: what this rank only sent (a segment it does not hold, an
    all-gathered buffer's reduce-scatter input, and its output where the rank holds no segment
    there) and, on a 1-D mesh, the held ones too, once the averages this rank owns are taken out
    (:func:`_stage_owner_grads`; the presence flags are still read once, by
    :func:`finish_reduces`); on CUDA the local gradients kept for the packing as well. HSDP
    holders keep their held buffers (the replicate reduces read them) to the end of the
    backward. So a 1-D rank holds one boundary's reduce buffers at a time, not every
    boundary's until the end of the backward (``dmuon.plan._cost.rank_memory.reduce_buffer_nbytes``
    counts it). On NCCL the compute stream waits for the reduce stream before the storage goes
    back to the allocator."""
    pending = ctx.pending_reduces
    start = len(pending)
    while start and not pending[start - 1].waited:  # entries are waited for in order
        start -= 1
    entries = pending[start:]
    if not entries:
        return
    stream = ctx.comm_stream("reduce")  # None on CPU
    with _on_stream(stream):
        _wait(ctx, entries)
    if stream is not None:  # the reduces (and their packing) ran on the reduce stream
        current_stream(stream.device).wait_event(stream.record_event())
    one_row = ctx.groups.shape[0] == 1
    if one_row:
        _stage_owner_grads(ctx, [(p.boundary, o) for p in entries if p.segment is not None for o in p.segment.owned])
    for p in entries:
        p.keep = []
        if p.gather is not None:
            p.gather.rs_in.untyped_storage().resize_(0)
            if p.segment is None or one_row:  # the output: this rank's slot
                p.buf.untyped_storage().resize_(0)
        elif p.segment is not None and (one_row or not p.segment.held):
            p.buf.untyped_storage().resize_(0)
        if one_row and p.segment is not None:
            p.segment.owned_staged = True


def _stage_owner_grads(ctx, owned: list) -> None:
    """Take the averages of the owned sub-segments ``owned`` (``(boundary, owned)`` pairs of
    finished reduces) out of their reduce buffer before it is released, as
    :func:`_write_owner_grads` computes them (divided by :func:`grad_divisor`, a new tensor,
    never a view of the buffer): added into an existing ``.grad`` at once (a matrix no rank had
    a gradient for is zeros there, so adding it changes nothing), else kept with a copy of the
    presence flags for :func:`finish_reduces` to make ``.grad`` of (or leave it None)."""
    divisors: dict[int, float] = {}
    model_factor = functools.cache(lambda: model_divide_factor(ctx))
    for boundary, o in owned:
        sub = o.sub
        divisor = divisors.get(id(boundary))
        if divisor is None:
            divisor = divisors[id(boundary)] = grad_divisor(ctx, boundary, model_factor)
        grads = []
        for slot in sub.slots:
            p = slot.logical
            grad = _owner_grad(o, slot, divisor, p)
            if p.grad is None:
                grads.append(grad)
            else:
                p.grad.add_(grad)
                grads.append(None)
        ctx.staged_grads.append((sub.slots, grads, o.flags.clone()))


def _owner_grad(o, slot, divisor: float, p) -> torch.Tensor:
    """``slot``'s average in owned sub-segment ``o``: a new tensor, never a view of the reduce
    buffer (released, and rewritten next backward): the division writes it (one pass, the reduce
    dtype's rounding as an in-place division's), or a copy when there is nothing to divide by; on
    the master's device (the host under offload, pinned as the master is)."""
    sub = o.sub
    start = slot.offset_in_seg - sub.offset_in_seg
    grad = o.values[start : start + slot.numel].view(slot.shape)
    if divisor != 1.0:
        grad = torch.div(grad, divisor)
    elif p.grad is None:
        grad = grad.clone() if grad.dtype == p.dtype and grad.device == p.device else grad
    if p.device != grad.device and p.is_pinned():
        grad = torch.empty(grad.shape, dtype=p.dtype, device=p.device, pin_memory=True).copy_(grad)
    else:
        grad = grad.to(p.device, p.dtype)
    return slot.tp.wrap(grad) if slot.tp is not None else grad


def finish_reduces(ctx) -> None:
    """Wait for the in-flight gradient reduces and accumulate the averages into owners' ``.grad``.

    Each pending entry (:class:`_PendingReduce`) is a segment's
    reduce or an all-gathered buffer's reduce-scatter (its input released with the output, once
    the compute stream has waited for the reduce stream). HSDP: the replicate reduces not yet
    issued by a later boundary's post-backward (:func:`issue_replicate_reduces`) are issued
    here, then every replicate reduce is waited for; the owner divides by :func:`grad_divisor`:
    ``R·N`` (net AVG over the whole mesh), or the gradient divide factor set on FSDP2
    (``set_gradient_divide_factor``).
    """
    pending, ctx.pending_reduces = ctx.pending_reduces, []
    if not pending:
        return
    issue_replicate_reduces(ctx, [p for p in pending if not p.replicated])
    works, ctx.replicate_reduce_works = ctx.replicate_reduce_works, []
    stream = ctx.comm_stream("reduce")  # None on CPU
    with _on_stream(stream):  # NCCL: the reduce stream waits for the collectives
        for boundary, work, group in works:
            ctx.wait([work], f"boundary {boundary.fqn!r} replicate_reduce", boundary=boundary, group=group)
    if stream is not None:  # the compute stream reads the buffers below; the local grads are released after
        current_stream(stream.device).wait_event(stream.record_event())
    for p in pending:
        if p.segment is not None:
            p.segment.reduce_inflight = False
        if p.gather is not None:
            p.gather.reduce_inflight = False
    owned = [
        (p.boundary, o)
        for p in pending
        if p.segment is not None and not p.segment.owned_staged
        for o in p.segment.owned
    ]
    if owned or ctx.staged_grads:
        _write_owner_grads(ctx, owned)
    for p in pending:  # averages copied out: release until the next backward (after the stream wait above)
        if p.segment is not None:
            p.segment.owned_staged = False
        p.buf.untyped_storage().resize_(0)
        if p.gather is not None:  # the reduce-scatter's input
            p.gather.rs_in.untyped_storage().resize_(0)


def _reduce_group(p):
    """The process group of a pending reduce (named by a failed wait): its segment's reduce, or
    its all-gathered buffer's reduce-scatter."""
    for b in p.boundary.ops.reduce:
        if (b.gather is p.gather) if p.gather is not None else (b.segment is p.segment):
            return b.group
    return None


def grad_divisor(ctx, boundary, model_factor=None) -> float:
    """What the owner divides a reduced (summed) gradient by: FSDP2's gradient divide factor.

    FSDP2 divides each reduced gradient by its param groups' ``gradient_divide_factor``
    (``FSDPModule.set_gradient_divide_factor``; torchtitan sets 1.0 and divides the loss by
    the global token count itself), or by the data-parallel size when none is set. dmuon
    follows the same rule so that dedicated and FSDP2-sharded gradients are scaled alike: the
    factor of ``boundary``'s own ``fully_shard`` unit, else the first one set on any unit of
    the model (a block whose parameters are all dedicated has no FSDP2 param group), else
    ``R·N`` (the average over the data-parallel mesh). Read at every reduce, so a factor set
    after set-up is honoured. ``model_factor``: a function giving :func:`model_divide_factor`
    (a caller reducing several boundaries walks the model once).
    """
    factor = gradient_divide_factor(boundary.module)
    if factor is None:
        factor = model_divide_factor(ctx) if model_factor is None else model_factor()
    return float(ctx.world_numel if factor is None else factor)


def model_divide_factor(ctx) -> float | None:
    """The first ``gradient_divide_factor`` set on any ``fully_shard`` unit of the model, or None."""
    model = ctx.model_ref()
    for module in model.modules() if model is not None else ():
        factor = gradient_divide_factor(module)
        if factor is not None:
            return factor
    return None


def _write_owner_grads(ctx, owned: list) -> None:
    """Divide the owned sub-segments of finished reduces (``(boundary, owned)`` pairs) by
    :meth:`grad_divisor` into their parameters' ``.grad``; the averages staged before
    (:func:`_stage_owner_grads`) become ``.grad`` where a rank had a gradient."""
    staged, ctx.staged_grads = ctx.staged_grads, []
    # one host read of every presence flag this rank owns (a device sync on CUDA)
    parts = [f for _, _, f in staged] + [o.flags for _, o in owned]
    flags = (parts[0] if len(parts) == 1 else torch.cat(parts)).tolist()
    ctx.flag_host_reads += 1
    i = 0
    for slots, grads, _ in staged:
        for slot, grad, flag in zip(slots, grads, flags[i : i + len(slots)]):
            if flag and grad is not None:  # None: added into the .grad it already had
                p = slot.logical
                if p.grad is None:
                    p.grad = grad
                else:
                    p.grad.add_(grad)
        i += len(slots)
    divisors: dict[int, float] = {}
    model_factor = functools.cache(lambda: model_divide_factor(ctx))  # the model walked once, if at all
    for boundary, o in owned:
        sub = o.sub
        sub_flags, i = flags[i : i + len(sub.slots)], i + len(sub.slots)
        if not any(sub_flags):
            continue
        divisor = divisors.get(id(boundary))
        if divisor is None:
            divisor = divisors[id(boundary)] = grad_divisor(ctx, boundary, model_factor)
        for slot, flag in zip(sub.slots, sub_flags):
            if flag == 0:
                continue  # no rank had a gradient: skip, as torch.optim.Muon does
            p = slot.logical
            grad = _owner_grad(o, slot, divisor, p)
            if p.grad is None:
                p.grad = grad
            else:
                p.grad.add_(grad)
