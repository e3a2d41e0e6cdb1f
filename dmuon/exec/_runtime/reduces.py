"""Reduce completion: the HSDP replicate reduces (:func:`issue_replicate_reduces`), the end of a
backward's gradient reduces (:func:`finish_reduces`) and the
divisor of a reduced gradient (:func:`grad_divisor`), for :class:`~dmuon.exec._runtime.runtime.DmuonRuntime`
(its ``pending_reduces``, filled by each boundary's post-backward,
:meth:`dmuon.exec._runtime.boundary._BoundaryRuntime._launch_reduce`).
``rt`` is that runtime (not imported here: the runtime imports this module)."""

from __future__ import annotations

import torch

from dmuon.exec._comm import collective_calls as C
from dmuon.exec._runtime.streams import _on_stream, current_stream
from dmuon.exec._setup.fsdp2 import gradient_divide_factor

__all__ = ["finish_reduces", "grad_divisor", "issue_replicate_reduces"]


def issue_replicate_reduces(rt, entries: list) -> None:
    """HSDP: wait for the shard-group reduces of ``entries`` (pending records of boundaries whose
    reduces are all launched) and issue their replicate reduces: every holder ``(s, r')`` of a
    segment SUM-reduces each sub-segment over its replicate group to the sub-segment's owner
    ``(s, r)``. The works join ``rt.replicate_reduce_works``, waited for by :func:`finish_reduces`.
    The post-backward of each boundary calls this for the boundaries reduced before it (one
    boundary's backward after their shard reduces were launched), :func:`finish_reduces` for the
    rest; on a 1-D mesh there is nothing to issue. On NCCL the waits are the reduce stream's."""
    if not entries:
        return
    stream = rt.comm_stream("reduce")  # None on CPU
    with _on_stream(stream):
        for p in entries:
            rt.wait(p.works, f"boundary {p.boundary.fqn!r} reduce", boundary=p.boundary, group=_reduce_group(p))
            p.replicated = True
        for p in entries:  # the held segments' sub-segments
            if p.segment is None:
                continue
            for b in p.boundary.ops.replicate_reduce_of(p.segment):
                part = p.buf[b.sub.offset_in_seg : b.sub.offset_in_seg + b.sub.numel]
                work = C.reduce_sum(part, dst=b.root, group=b.group, phase=b.op.phase, async_op=True)
                rt.replicate_reduce_works.append((p.boundary, work, b.group))


def finish_reduces(rt) -> None:
    """Wait for the in-flight gradient reduces and accumulate the averages into owners' ``.grad``.

    Each pending entry (:class:`~dmuon.exec._runtime.boundary._PendingReduce`) is a segment's
    reduce or an all-gathered buffer's reduce-scatter (its input released with the output, once
    the compute stream has waited for the reduce stream). HSDP: the replicate reduces not yet
    issued by a later boundary's post-backward (:func:`issue_replicate_reduces`) are issued
    here, then every replicate reduce is waited for; the owner divides by :meth:`grad_divisor`:
    ``R·N`` (net AVG over the whole mesh), or the gradient divide factor set on FSDP2
    (``set_gradient_divide_factor``).
    """
    pending, rt.pending_reduces = rt.pending_reduces, []
    if not pending:
        return
    issue_replicate_reduces(rt, [p for p in pending if not p.replicated])
    works, rt.replicate_reduce_works = rt.replicate_reduce_works, []
    stream = rt.comm_stream("reduce")  # None on CPU
    with _on_stream(stream):  # NCCL: the reduce stream waits for the collectives
        for boundary, work, group in works:
            rt.wait([work], f"boundary {boundary.fqn!r} replicate_reduce", boundary=boundary, group=group)
    if stream is not None:  # the compute stream reads the buffers below; the local grads are released after
        current_stream(stream.device).wait_event(stream.record_event())
    for p in pending:
        if p.segment is not None:
            p.segment.reduce_inflight = False
        if p.gather is not None:
            p.gather.reduce_inflight = False
    owned = [(p.boundary, o) for p in pending if p.segment is not None for o in p.segment.owned]
    if owned:
        _write_owner_grads(rt, owned)
    for p in pending:  # averages copied out: release until the next backward (after the stream wait above)
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


def grad_divisor(rt, boundary) -> float:
    """What the owner divides a reduced (summed) gradient by: FSDP2's gradient divide factor.

    FSDP2 divides each reduced gradient by its param groups' ``gradient_divide_factor``
    (``FSDPModule.set_gradient_divide_factor``; torchtitan sets 1.0 and divides the loss by
    the global token count itself), or by the data-parallel size when none is set. dmuon
    follows the same rule so that dedicated and FSDP2-sharded gradients are scaled alike: the
    factor of ``boundary``'s own ``fully_shard`` unit, else the first one set on any unit of
    the model (a block whose parameters are all dedicated has no FSDP2 param group), else
    ``R·N`` (the average over the data-parallel mesh). Read at every reduce, so a factor set
    after set-up is honoured.
    """
    factor = gradient_divide_factor(boundary.module)
    if factor is None:
        model = rt.model_ref()
        for module in model.modules() if model is not None else ():
            factor = gradient_divide_factor(module)
            if factor is not None:
                break
    return float(rt.world_numel if factor is None else factor)


def _write_owner_grads(rt, owned: list) -> None:
    """Divide the owned sub-segments of finished reduces (``(boundary, owned)`` pairs) by
    :meth:`grad_divisor` into their parameters' ``.grad``."""
    # one host read of every presence flag this rank owns (a device sync on CUDA)
    flags = (owned[0][1].flags if len(owned) == 1 else torch.cat([o.flags for _, o in owned])).tolist()
    rt._flag_host_reads += 1
    i = 0
    divisors: dict[int, float] = {}
    for boundary, o in owned:
        sub = o.sub
        sub_flags, i = flags[i : i + len(sub.slots)], i + len(sub.slots)
        if not any(sub_flags):
            continue
        if id(boundary) not in divisors:
            divisors[id(boundary)] = rt.grad_divisor(boundary)
        if divisors[id(boundary)] != 1.0:
            o.values.div_(divisors[id(boundary)])
        for slot, flag in zip(sub.slots, sub_flags):
            if flag == 0:
                continue  # no rank had a gradient: skip, as torch.optim.Muon does
            start = slot.offset_in_seg - sub.offset_in_seg
            grad = o.values[start : start + slot.numel].view(slot.shape)
            p = slot.logical
            # a copy, never a view of the reduce buffer (released below, rewritten next backward)
            grad = grad.to(p.dtype, copy=True) if p.grad is None else grad.to(p.dtype)
            if slot.tp is not None:
                grad = slot.tp.wrap(grad)
            if p.grad is None:
                p.grad = grad
            else:
                p.grad.add_(grad)
