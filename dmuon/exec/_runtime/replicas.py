"""HSDP replica broadcasts: after each optimizer step every owner broadcasts its updated
sub-segments to its replicate peers (:func:`broadcast_after_step`), waited for before their next
use (the comm context's ``wait_replicate_broadcasts``); after a ``Module._apply`` every owner's value once more
(:func:`sync_replicas`). For :class:`~dmuon.exec._runtime.runtime.DmuonRuntime` (its
``pending_replicate`` and ``replicas_stale``); with one replica (``R == 1``) nothing runs.
``rt`` is that runtime (not imported here: the runtime imports this module)."""

from __future__ import annotations

from dmuon.exec._comm import collective_calls as C

__all__ = ["broadcast_after_step", "sync_replicas"]


def broadcast_after_step(rt) -> None:
    """HSDP: each owner broadcasts its updated sub-segments to its replicate peers (the replica
    phase of :meth:`DmuonRuntime.after_step <dmuon.exec._runtime.runtime.DmuonRuntime.after_step>`).

    ``replicate_async=True``: launched here, waited for just before the boundary's next
    forward broadcast or any state-dict read; ``False``: waited for here.
    """
    if rt.groups.shape[0] == 1:
        return
    rt.wait_replicate_broadcasts()
    for b in rt.boundaries:
        works = _broadcast_to_replicas(rt, [b], "replicate_broadcast")
        if rt.replicate_async:
            rt.pending_replicate[b.index] = works
        else:
            rt.wait(works, f"boundary {b.fqn!r} replicate_broadcast", boundary=b, group=rt.groups.replicate_group)


def _broadcast_to_replicas(rt, boundaries, phase: str) -> list:
    """HSDP: post one async broadcast per sub-segment of ``boundaries`` held here, from its
    owner to its replicate peers (the owner's current master); returns the works. Masters
    offloaded to the host of an accelerator travel through a device copy (:class:`_ToHost`)."""
    works = []
    for boundary in boundaries:
        for b in boundary.ops.replicate_broadcast:
            part = b.segment.master[b.sub.offset_in_seg : b.sub.offset_in_seg + b.sub.numel]
            if part.device == rt.device:
                works.append(C.broadcast(part, src=b.root, group=b.group, phase=phase, async_op=True))
                continue
            staged = part.to(rt.device)
            work = C.broadcast(staged, src=b.root, group=b.group, phase=phase, async_op=True)
            works.append(_ToHost(work, staged, part))
    return works


class _ToHost:
    """A broadcast's work whose received device copy ``staged`` is written into the host master
    ``part`` once waited for (offload on an accelerator; the root's copy is unchanged)."""

    def __init__(self, work, staged, part):
        self.work, self.staged, self.part = work, staged, part

    def wait(self, timeout=None):
        ok = self.work.wait() if timeout is None else self.work.wait(timeout=timeout)
        if ok is not False:
            self.part.copy_(self.staged)
        return ok


def sync_replicas(rt) -> None:
    """HSDP: broadcast every owner's value to its replicate peers when they may disagree.

    Runs only when :attr:`replicas_stale` is set, i.e. after a ``Module._apply`` on the model
    (``to_empty`` followed by a per-rank initialisation leaves replicas with their own
    values); a collective over each replicate group, charged to the ledger as ``"other"``.
    The flag is set on every rank by the same call, so all ranks agree on running it.
    """
    if not rt.replicas_stale:
        return
    rt.replicas_stale = False
    if rt.groups.shape[0] == 1:
        return
    rt.check_materialized("synchronising HSDP replicas")
    rt.wait_replicate_broadcasts()
    works = _broadcast_to_replicas(rt, rt.boundaries, "other")
    rt.wait(works, "HSDP replica sync after materialisation", group=rt.groups.replicate_group)
