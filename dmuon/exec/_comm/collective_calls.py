"""Every collective dmuon issues passes through this module, and is charged to the byte ledger.

Each process keeps its own :data:`LEDGER` of the bytes charged to *this* rank, per phase, by the
byte rule (Note: the byte rule, docs/design.md). Coalescing, the ledger's recording, and how a
failed wait is named (:func:`wait_all`, :func:`blocking_timeout_s`): Note: issuing and waiting for
collectives (docs/design.md).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import logging
import os
import threading
import time
from collections import Counter
from typing import ClassVar, Sequence

import torch
import torch.distributed as dist

from dmuon.exec._comm import wait_report
from dmuon.plan._cost.nbytes import collective_rank_nbytes

__all__ = [
    "PHASES",
    "LEDGER",
    "ledger",
    "metered",
    "Ledger",
    "IssuedOp",
    "CollectiveError",
    "CollectiveTimeout",
    "CollectiveTransportError",
    "DEFAULT_TIMEOUT_S",
    "blocking_timeout_s",
    "last_issued",
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

#: Ledger phases, in the order of a training step (``"other"``: outside the plan's step: state dicts,
#: fingerprints, GradScaler's inf check, gradient clipping, tests).
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


class CollectiveError(RuntimeError):
    """A dmuon collective failed: :class:`CollectiveTimeout` or :class:`CollectiveTransportError`."""


class CollectiveTimeout(CollectiveError):
    """A dmuon collective did not complete in time (dmuon's ``timeout_s``, or the process group's
    own timeout first); the message names the boundary and phase."""


class CollectiveTransportError(CollectiveError):
    """The backend reported a failure other than a timeout while dmuon waited (a peer closed or
    reset the connection, an NCCL error surfaced on the CPU); the message names the boundary and
    phase, the peer where the backend names it, and the usual causes; the backend's error is
    chained (``__cause__``)."""


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

    #: the phases a collective is charged to, in report order
    PHASES: ClassVar[tuple[str, ...]] = PHASES

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


#: Seconds a dmuon wait may take before :class:`CollectiveTimeout` (``collective_timeout_s``'s
#: default): 10 minutes, NCCL's default process-group timeout and a third of gloo's (30 min), so
#: on gloo dmuon's fires first and names the boundary. Applied where the wait blocks the CPU anyway
#: (:func:`blocking_timeout_s`); collectives outside a runtime (state dicts) use it as well.
DEFAULT_TIMEOUT_S: float = 600.0

_LOG = logging.getLogger("dmuon.comm")
if os.environ.get("DMUON_LOG_COLLECTIVES", "").strip().lower() in ("1", "true", "yes", "on"):
    _LOG.setLevel(logging.DEBUG)
    if not _LOG.handlers:
        _LOG.addHandler(logging.StreamHandler())

# dmuon's last issued collective on this process: (kind, phase, group, root, numel, dtype, seq)
_LAST: list = [None]


def _group_seq(group) -> int | None:
    """The process group's collective sequence number (NCCL's watchdog ``SeqNum``), or None."""
    try:
        g = group if group is not None else dist.group.WORLD
        return int(g._get_sequence_number_for_group())
    except Exception:  # noqa: BLE001 - a diagnostic only
        return None


def last_issued() -> str | None:
    """dmuon's last issued collective on this process, in words (kind, phase, global ranks,
    root, elements, dtype, the process group's sequence number after it), or None."""
    last = _LAST[0]
    if last is None:
        return None
    kind, phase, group, root, numel, dtype, seq = last
    try:
        ranks = tuple(dist.get_process_group_ranks(group)) if group is not None else tuple(range(dist.get_world_size()))
    except Exception:  # noqa: BLE001 - the group may be gone
        ranks = "?"
    text = f"{kind} (phase {phase}) over global ranks {ranks}"
    if root is not None:
        text += f", root {root}"
    text += f", {numel} {dtype.replace('torch.', '')} elements"
    if seq is not None:
        text += f", group sequence number {seq}"
    return text


def _charge(kind: str, phase: str, tensor: torch.Tensor, group, root: int | None) -> None:
    """Charge this rank for ``kind`` on ``tensor`` over ``group`` (rule of
    :func:`dmuon.plan._cost.nbytes.collective_rank_nbytes`), recording it when the ledger records;
    remember it as this process's last issued collective (logged at DEBUG on ``dmuon.comm``)."""
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
    # the sequence number this collective will carry (the group's counter before it is issued, + 1)
    seq = _group_seq(group)
    _LAST[0] = (kind, phase, group, root, tensor.numel(), str(tensor.dtype), None if seq is None else seq + 1)
    if _LOG.isEnabledFor(logging.DEBUG):
        _LOG.debug("dmuon rank %d issues %s", me, last_issued())


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
    return _done(
        dist.broadcast(tensor, src=src, group=group, async_op=True), async_op, "broadcast", phase, tensor, group
    )


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
    work = dist.reduce(tensor, dst=dst, op=dist.ReduceOp.SUM, group=group, async_op=True)
    return _done(work, async_op, "reduce", phase, tensor, group)


def all_reduce_sum(tensor: torch.Tensor, *, group: dist.ProcessGroup | None, phase: str, async_op: bool = False):
    """SUM all-reduce in place over ``group``; charges every rank
    ``2·(k-1)·ceil(numel/k)·itemsize`` (ring reduce-scatter + all-gather)."""
    _charge("all_reduce", phase, tensor, group, None)
    work = dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group, async_op=True)
    return _done(work, async_op, "all-reduce (sum)", phase, tensor, group)


def all_reduce_max(tensor: torch.Tensor, *, group: dist.ProcessGroup | None, phase: str, async_op: bool = False):
    """MAX all-reduce in place over ``group`` (QK-clip's per-head logits); charged like every
    all-reduce, ``2·(k-1)·ceil(numel/k)·itemsize`` per rank."""
    _charge("all_reduce", phase, tensor, group, None)
    work = dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group, async_op=True)
    return _done(work, async_op, "all-reduce (max)", phase, tensor, group)


def all_gather_into(
    output: torch.Tensor, tensor: torch.Tensor, *, group: dist.ProcessGroup, phase: str, async_op: bool = False
):
    """All-gather ``tensor`` from the ``k`` ranks of ``group`` into ``output`` (``k·numel``
    elements, group-rank order). Charges ``(k-1)·tensor.nbytes`` to every rank (it receives the
    other ranks' parts: ``S·(k-1)/k`` of the full ``S``)."""
    _charge("all_gather", phase, tensor, group, None)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # torch >= 2.13 renamed it
    return _done(gather(output, tensor, group=group, async_op=True), async_op, "all-gather", phase, tensor, group)


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
    return _done(
        dist.scatter(output, chunks, src=src, group=group, async_op=True), False, "scatter", phase, output, group
    )


def blocking_timeout_s(timeout_s: float | None, device: torch.device | None, group=None) -> float | None:
    """The timeout dmuon passes to ``Work.wait`` for a collective on ``device`` over ``group``.

    ``timeout_s`` where the wait blocks the CPU anyway: CPU tensors (gloo), or NCCL with
    ``TORCH_NCCL_BLOCKING_WAIT=1``. ``None`` on NCCL's default non-blocking wait: there
    ``Work.wait()`` only makes the current stream wait, and ``Work.wait(timeout)`` would block the
    CPU thread until the collective finished on the GPU (no launch-ahead); the process group's
    watchdog enforces the process group's timeout instead and takes the process down on a failure
    (docs/troubleshooting.md, "Collective failures").
    """
    if timeout_s is None or device is None or device.type in ("cpu", "meta"):
        return timeout_s
    try:
        backend = str(dist.get_backend(group))
    except Exception:  # noqa: BLE001 - no group: nothing to wait for anyway
        return timeout_s
    if "nccl" not in backend:
        return timeout_s
    flag = os.environ.get("TORCH_NCCL_BLOCKING_WAIT", os.environ.get("NCCL_BLOCKING_WAIT", "0"))
    return timeout_s if flag.strip().lower() in ("1", "true", "yes", "y", "on") else None


def _done(work, async_op: bool, kind: str, phase: str, tensor: torch.Tensor, group):
    """A wrapper's issued ``work``: returned when ``async_op``, else waited for here through
    :func:`wait_all` (:data:`DEFAULT_TIMEOUT_S` where the wait blocks the CPU)."""
    if async_op:
        return work
    wait_all(
        [work],
        what=f"{kind} (ledger phase {phase!r})",
        timeout_s=blocking_timeout_s(DEFAULT_TIMEOUT_S, tensor.device, group),
        group=group,
    )
    return None


_DEFAULT = object()


def wait_all(
    works,
    *,
    what: str,
    timeout_s=_DEFAULT,
    step: int | None = None,
    forwards: int | None = None,
    group=None,
) -> None:
    """Wait for every ``Work`` in ``works`` (``None`` entries are skipped), naming a failure.

    Args:
        what: the boundary FQN and phase (or the collective's purpose), quoted by the errors.
        timeout_s: seconds each wait may take (default :data:`DEFAULT_TIMEOUT_S`; ``None``: no
            dmuon timeout, the process group's own applies).
        step, forwards: this rank's optimizer steps done and the boundary's grad-enabled forwards
            since the last step, quoted by the errors (None: not quoted).
        group: the process group of the works (its global ranks are quoted; with two ranks the
            other one is the peer).

    Raises:
        CollectiveTimeout: a wait exceeded ``timeout_s``, or the backend raised a time-out of its
            own (the process group's timeout fired first).
        CollectiveTransportError: the backend raised anything else from a wait (a peer closed or
            reset the connection, an NCCL error surfaced on the CPU), chained.
    """
    timeout_s = DEFAULT_TIMEOUT_S if timeout_s is _DEFAULT else timeout_s
    for work in works:
        if work is None:
            continue
        t0 = time.monotonic()
        try:
            ok = work.wait() if timeout_s is None else work.wait(timeout=datetime.timedelta(seconds=timeout_s))
        except RuntimeError as exc:  # gloo: RuntimeError; c10d: DistBackendError / DistNetworkError (subclasses)
            waited_s = time.monotonic() - t0
            timed_out = wait_report.is_timeout(str(exc), waited_s, timeout_s)
            cls, text = (
                (CollectiveTimeout, wait_report.timeout_message)
                if timed_out
                else (CollectiveTransportError, wait_report.transport_message)
            )
            raise cls(
                text(what, str(exc), waited_s=waited_s, timeout_s=timeout_s, **_where(step, forwards, group))
            ) from exc
        if ok is False:
            raise CollectiveTimeout(
                wait_report.timeout_message(
                    what, None, waited_s=time.monotonic() - t0, timeout_s=timeout_s, **_where(step, forwards, group)
                )
            )


def _where(step, forwards, group) -> dict:
    """This rank's position for a failed wait's message (never raises)."""
    me = ranks = None
    try:
        me = dist.get_rank()
        if isinstance(group, dist.ProcessGroup):
            ranks = tuple(dist.get_process_group_ranks(group))
    except Exception:  # noqa: BLE001 - the message must not hide the failure
        pass
    return dict(me=me, step=step, forwards=forwards, ranks=ranks, last_issued=last_issued())
