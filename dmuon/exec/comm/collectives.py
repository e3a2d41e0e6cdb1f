"""Every collective dmuon issues passes through this module, and is charged to the byte ledger.

Accounting (the rule :func:`dmuon.plan.cost.nbytes.collective_rank_nbytes` states once, and
``plan.cost`` sums over the step's schedule): for one collective over a group of ``k`` ranks and
a payload of ``S`` bytes, every non-root rank is charged ``S`` (it receives ``S`` in a
broadcast, sends ``S`` in a reduce), so the collective totals ``(k-1)·S`` over the group. An
all-reduce of ``numel`` elements is charged ``2·(k-1)·ceil(numel/k)·itemsize`` per rank (ring
reduce-scatter + all-gather, ``~2·S``); an all-gather of ``S`` bytes per rank, or a
reduce-scatter to ``S`` bytes per rank, ``(k-1)·S`` per rank; a scatter charges each non-root
rank its own chunk.

Coalescing (:func:`broadcast_many`, :func:`reduce_many`): where the backend supports it (NCCL:
``supports_coalescing`` on the group's backend for the device, the check torch's own
``batch_isend_irecv`` makes) the broadcasts (or reduces) of one list are issued as one
coalesced group through ``torch.distributed``'s private ``_coalescing_manager`` (torch has no
public API for it; gloo's backend reports no support and raises on ``startCoalescing``), and
return one ``Work``; elsewhere they are issued one by one, as before. The bytes charged are the
same either way.

Each process keeps its own :data:`LEDGER` of the bytes charged to *this* rank, per phase. The
sum over ranks (e.g. ``all_reduce`` of :meth:`Ledger.total_nbytes`) is what
``plan.cost.total_nbytes`` predicts for one training step; the per-rank values are
``plan.cost.per_rank_nbytes[rank]``. With :meth:`Ledger.recording` it also keeps every
collective it charged, in issue order (:class:`IssuedOp`), to compare with
``dmuon.plan.schedule(plan, step).rank_ops(rank)`` op by op.

The wrappers return the ``Work`` handle of an async collective (``async_op=True``) or ``None``.
A collective whose wait exceeds ``timeout_s`` raises :class:`CollectiveTimeout` naming the phase
and hook boundary instead of hanging silently.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import threading
from collections import Counter
from typing import Sequence

import torch
import torch.distributed as dist

from dmuon.plan.cost.nbytes import collective_rank_nbytes

__all__ = [
    "PHASES",
    "LEDGER",
    "ledger",
    "metered",
    "Ledger",
    "IssuedOp",
    "CollectiveTimeout",
    "broadcast",
    "reduce_sum",
    "all_reduce_sum",
    "all_reduce_max",
    "all_gather_into",
    "reduce_scatter_into",
    "broadcast_many",
    "reduce_many",
    "coalescing_supported",
    "scatter",
    "wait_all",
]

#: Ledger phases, in the order of a training step (``"other"``: state dicts, fingerprints, tests).
PHASES = (
    "forward_broadcast",
    "backward_broadcast",
    "reduce",
    "replicate_reduce",
    "replicate_broadcast",
    "tp",
    "qk_clip",
    "owner_group",
    "other",
)


class CollectiveTimeout(RuntimeError):
    """A dmuon collective did not complete in time; the message names the boundary and phase."""


@dataclasses.dataclass(frozen=True, slots=True)
class IssuedOp:
    """One collective as this rank issued it (recorded while :attr:`Ledger.record` is on).

    ``group``: global ranks of the process group, in group-rank order; ``root``: global rank of
    the broadcast source / reduce destination (None otherwise); ``numel``: elements of this
    rank's tensor; ``nbytes``: bytes charged to this rank.
    """

    kind: str
    phase: str
    group: tuple[int, ...]
    root: int | None
    dtype: str
    numel: int
    nbytes: int


@dataclasses.dataclass
class Ledger:
    """Bytes charged to this rank, per phase, since the last :meth:`reset`.

    ``nbytes[phase]``: integer bytes charged to this rank; ``calls[phase]``: number of
    collectives this rank took part in (charged or not); ``ops``: every collective charged
    while ``record`` is True (:meth:`recording`), in issue order. Thread-safe.
    """

    nbytes: Counter = dataclasses.field(default_factory=Counter)
    calls: Counter = dataclasses.field(default_factory=Counter)
    record: bool = False
    ops: list = dataclasses.field(default_factory=list)
    _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, repr=False)

    def charge(self, phase: str, nbytes: int, op: IssuedOp | None = None) -> None:
        if phase not in PHASES:
            raise ValueError(f"unknown ledger phase {phase!r}; expected one of {PHASES}")
        with self._lock:
            self.nbytes[phase] += int(nbytes)
            self.calls[phase] += 1
            if self.record and op is not None:
                self.ops.append(op)

    def reset(self) -> None:
        with self._lock:
            self.nbytes.clear()
            self.calls.clear()
            self.ops.clear()

    @contextlib.contextmanager
    def recording(self):
        """Record every charged collective into :attr:`ops` inside the context (cleared on entry)."""
        with self._lock:
            self.ops.clear()
            prev, self.record = self.record, True
        try:
            yield self.ops
        finally:
            self.record = prev

    def snapshot(self) -> dict[str, int]:
        """``{phase: bytes charged to this rank}`` for every phase (zeros included)."""
        with self._lock:
            return {phase: int(self.nbytes[phase]) for phase in PHASES}

    def total_nbytes(self, *, include_other: bool = False) -> int:
        """Bytes charged to this rank over the training phases (``"other"`` excluded by default)."""
        snap = self.snapshot()
        return sum(v for k, v in snap.items() if include_other or k != "other")


#: The per-process ledger every wrapper below charges. Kept for existing code; the API is
#: :func:`ledger` (this object) and :func:`metered` (a ledger of one block of code).
LEDGER = Ledger()

_METERS: list[Ledger] = []  # open metered() blocks, charged alongside LEDGER


def ledger() -> Ledger:
    """The per-process :class:`Ledger` every dmuon collective charges (``LEDGER``)."""
    return LEDGER


@contextlib.contextmanager
def metered(*, record: bool = False):
    """A fresh :class:`Ledger` charged with every dmuon collective of this process issued inside
    the block (``record=True``: also its :class:`IssuedOp` list), without resetting the process
    ledger, which keeps counting::

        with dmuon.exec.metered() as led:
            loss.backward(); opt.step()
        led.snapshot()   # {phase: bytes charged to this rank in the block}
    """
    led = Ledger(record=record)
    _METERS.append(led)
    try:
        yield led
    finally:
        _METERS.remove(led)

#: Seconds a wait may take before :class:`CollectiveTimeout`; ``None`` = wait forever.
DEFAULT_TIMEOUT_S: float | None = None


def _charge(kind: str, phase: str, tensor: torch.Tensor, group, root: int | None) -> None:
    """Charge this rank for ``kind`` on ``tensor`` over ``group`` (rule of
    :func:`dmuon.plan.cost.nbytes.collective_rank_nbytes`), recording it when the ledger records."""
    k = dist.get_world_size(group)
    me = dist.get_rank()
    nbytes = collective_rank_nbytes(kind, tensor.numel(), tensor.element_size(), k, me == root)
    op = None
    if LEDGER.record or any(m.record for m in _METERS):
        ranks = tuple(dist.get_process_group_ranks(group)) if group is not None else tuple(range(k))
        op = IssuedOp(kind, phase, ranks, root, str(tensor.dtype), tensor.numel(), nbytes)
    LEDGER.charge(phase, nbytes, op)
    for meter in _METERS:
        meter.charge(phase, nbytes, op)


def broadcast(
    tensor: torch.Tensor,
    *,
    src: int,
    group: dist.ProcessGroup,
    phase: str,
    async_op: bool = False,
):
    """Broadcast ``tensor`` (in place) from global rank ``src`` over ``group``.

    Charges ``tensor.nbytes`` to every rank but ``src``.
    """
    _charge("broadcast", phase, tensor, group, src)
    return dist.broadcast(tensor, src=src, group=group, async_op=async_op)


def reduce_sum(
    tensor: torch.Tensor,
    *,
    dst: int,
    group: dist.ProcessGroup,
    phase: str,
    async_op: bool = False,
):
    """SUM-reduce ``tensor`` to global rank ``dst`` over ``group`` (gloo has no AVG: divide at dst).

    Charges ``tensor.nbytes`` to every rank but ``dst``. Only ``dst``'s result is defined.
    """
    _charge("reduce", phase, tensor, group, dst)
    return dist.reduce(tensor, dst=dst, op=dist.ReduceOp.SUM, group=group, async_op=async_op)


def all_reduce_sum(tensor: torch.Tensor, *, group: dist.ProcessGroup | None, phase: str, async_op: bool = False):
    """SUM all-reduce in place over ``group``; charges every rank
    ``2·(k-1)·ceil(numel/k)·itemsize`` (ring reduce-scatter + all-gather)."""
    _charge("all_reduce", phase, tensor, group, None)
    return dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group, async_op=async_op)


def all_reduce_max(tensor: torch.Tensor, *, group: dist.ProcessGroup | None, phase: str, async_op: bool = False):
    """MAX all-reduce in place over ``group`` (QK-clip's per-head logits); charged like every
    all-reduce, ``2·(k-1)·ceil(numel/k)·itemsize`` per rank."""
    _charge("all_reduce", phase, tensor, group, None)
    return dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group, async_op=async_op)


def all_gather_into(
    output: torch.Tensor, tensor: torch.Tensor, *, group: dist.ProcessGroup, phase: str, async_op: bool = False
):
    """All-gather ``tensor`` from the ``k`` ranks of ``group`` into ``output`` (``k·numel``
    elements, group-rank order). Charges ``(k-1)·tensor.nbytes`` to every rank (it receives the
    other ranks' parts: ``S·(k-1)/k`` of the full ``S``)."""
    _charge("all_gather", phase, tensor, group, None)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # torch >= 2.13 renamed it
    return gather(output, tensor, group=group, async_op=async_op)


def reduce_scatter_into(
    output: torch.Tensor, tensor: torch.Tensor, *, group: dist.ProcessGroup, phase: str, async_op: bool = False
):
    """SUM-reduce-scatter ``tensor`` (``k·numel`` elements, group-rank order) over the ``k`` ranks
    of ``group``: group rank ``j`` receives chunk ``j``, summed, in ``output``. Charges
    ``(k-1)·output.nbytes`` to every rank (it sends the other ranks' chunks: ``S·(k-1)/k`` of the
    full ``S``)."""
    _charge("reduce_scatter", phase, output, group, None)
    rs = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor  # torch >= 2.13 renamed it
    return rs(output, tensor, op=dist.ReduceOp.SUM, group=group, async_op=async_op)


def coalescing_supported(group, device: torch.device) -> bool:
    """Whether ``group``'s backend on ``device`` coalesces a list of collectives into one launch
    (NCCL; never gloo or CPU): ``supports_coalescing`` of the backend, as torch's own
    ``batch_isend_irecv`` asks, and torch's private ``_coalescing_manager`` present. Any
    failure to ask reads as False (the one-by-one issue)."""
    if device.type == "cpu" or getattr(dist.distributed_c10d, "_coalescing_manager", None) is None:
        return False
    try:
        return bool(group._get_backend(device).supports_coalescing)
    except Exception:  # noqa: BLE001 - a backend without the query: issue one by one
        return False


def _issue_many(kind: str, items, group, phase: str, coalesce: bool) -> list:
    call = dist.broadcast if kind == "broadcast" else dist.reduce
    for tensor, root in items:
        _charge(kind, phase, tensor, group, root)
    if coalesce and len(items) > 1:
        device = items[0][0].device
        with dist.distributed_c10d._coalescing_manager(group, device, async_ops=True) as cm:
            for tensor, root in items:
                if kind == "broadcast":
                    call(tensor, src=root, group=group, async_op=True)
                else:
                    call(tensor, dst=root, op=dist.ReduceOp.SUM, group=group, async_op=True)
        return list(cm.works)
    if kind == "broadcast":
        return [call(t, src=root, group=group, async_op=True) for t, root in items]
    return [call(t, dst=root, op=dist.ReduceOp.SUM, group=group, async_op=True) for t, root in items]


def broadcast_many(items: Sequence[tuple[torch.Tensor, int]], *, group, phase: str, coalesce: bool) -> list:
    """Async broadcasts of ``(tensor, src global rank)`` pairs over ``group``, in order, charged
    as :func:`broadcast` each; one coalesced group when ``coalesce`` (pass
    :func:`coalescing_supported`), else one by one. Returns the works to wait for."""
    return _issue_many("broadcast", items, group, phase, coalesce)


def reduce_many(items: Sequence[tuple[torch.Tensor, int]], *, group, phase: str, coalesce: bool) -> list:
    """Async SUM-reduces of ``(tensor, dst global rank)`` pairs over ``group``, in order, charged as
    :func:`reduce_sum` each; one coalesced group when ``coalesce``, else one by one."""
    return _issue_many("reduce", items, group, phase, coalesce)


def scatter(
    output: torch.Tensor,
    chunks: Sequence[torch.Tensor] | None,
    *,
    src: int,
    group: dist.ProcessGroup,
    phase: str,
):
    """Scatter equal-size ``chunks`` (given on ``src`` only) into ``output`` on every rank.

    Charges ``output.nbytes`` to every rank but ``src``.
    """
    _charge("scatter", phase, output, group, src)
    chunks = list(chunks) if dist.get_rank() == src else None
    return dist.scatter(output, chunks, src=src, group=group)


def wait_all(works, *, what: str, timeout_s: float | None = None) -> None:
    """Wait for every ``Work`` in ``works`` (``None`` entries are skipped).

    Raises:
        CollectiveTimeout: a wait exceeded ``timeout_s`` (default :data:`DEFAULT_TIMEOUT_S`);
            the message includes ``what`` (boundary FQN and phase).
    """
    timeout_s = DEFAULT_TIMEOUT_S if timeout_s is None else timeout_s
    for work in works:
        if work is None:
            continue
        if timeout_s is None:
            work.wait()
            continue
        try:
            ok = work.wait(timeout=datetime.timedelta(seconds=timeout_s))
        except RuntimeError as exc:  # gloo raises on timeout
            raise CollectiveTimeout(
                f"dmuon: collective for {what} did not complete within {timeout_s} s "
                "(a rank skipped or reordered a collective, or a peer died)"
            ) from exc
        if ok is False:
            raise CollectiveTimeout(
                f"dmuon: collective for {what} did not complete within {timeout_s} s"
            )
