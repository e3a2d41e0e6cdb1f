r"""Hardware records for the step-time simulator: links, collective cost, compute throughput.

A :class:`Hardware` is frozen data (ints, floats, tuples); :func:`collective_s`, :func:`matmul_s`,
:func:`elementwise_s`, :func:`ns_call_s` and the ``train_*_s`` functions price one op each.
:data:`PRESETS` carry public figures; ``cpu-gloo`` is what ``python -m dmuon calibrate`` measures
(:func:`load`). What each term means and where it comes from: Note: the hardware model
(docs/design.md).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence
from typing import Any

__all__ = [
    "Link",
    "CollectiveCurve",
    "Hardware",
    "PRESETS",
    "preset",
    "load",
    "dump",
    "collective_s",
    "formula_collective_s",
    "matmul_s",
    "matmul_efficiency",
    "elementwise_s",
    "train_matmul_s",
    "train_elementwise_s",
    "train_attention_s",
    "ns_call_s",
    "ns_mean_dim",
    "ns_batch_factor_at",
    "busy_factors",
    "train_norm_s",
    "train_activation_s",
    "fsdp2_call_s_at",
    "dtensor_gather_s_at",
    "comm_cpu_share_at",
    "step_compute_factor_at",
    "blocking_wait_s_at",
    "group_link",
]

#: collective kinds the cost model knows (schedule kinds, FSDP2's, and all-to-all)
KINDS = ("broadcast", "reduce", "all_reduce", "all_gather", "reduce_scatter", "all_to_all")
#: models of a coalesced group of broadcasts / reduces (:mod:`dmuon.sim._engine.coalesce`)
COALESCE_MODELS = ("serial", "concurrent")
#: op kind of a schedule -> collective kind of the cost model
OP_COLLECTIVE = {
    "broadcast": "broadcast",
    "reduce": "reduce",
    "all_reduce": "all_reduce",
    "all_gather": "all_gather",
    "reduce_scatter": "reduce_scatter",
    "fsdp2_all_gather": "all_gather",
    "fsdp2_reduce_scatter": "reduce_scatter",
    "fsdp2_all_reduce": "all_reduce",
    "all_to_all": "all_to_all",
}


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Link:
    """One level of the network, as seen by one rank.

    Attributes:
        latency_s: ``α``, seconds per algorithm step (one hop).
        bandwidth_Bps: bytes per second per rank and direction an algorithm achieves (bus
            bandwidth, not the raw signalling rate).
    """

    latency_s: float
    bandwidth_Bps: float

    def __post_init__(self) -> None:
        if not (self.latency_s >= 0 and self.bandwidth_Bps > 0):
            raise ValueError(f"Link needs latency_s >= 0 and bandwidth_Bps > 0, got {self}")


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class CollectiveCurve:
    """Measured seconds of one collective kind on ``group_size`` ranks, by payload.

    Attributes:
        kind: one of :data:`KINDS`.
        group_size: ranks in the group.
        nbytes: payload bytes per rank (the schedule's ``Op.nbytes``), increasing.
        seconds: median seconds of one call, aligned with ``nbytes`` (issue to completion).
    """

    kind: str
    group_size: int
    nbytes: tuple[int, ...]
    seconds: tuple[float, ...]

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"CollectiveCurve.kind must be one of {KINDS}, got {self.kind!r}")
        if len(self.nbytes) != len(self.seconds) or not self.nbytes:
            raise ValueError("CollectiveCurve: nbytes and seconds must align and be non-empty")
        if any(b <= a for a, b in zip(self.nbytes, self.nbytes[1:])):
            raise ValueError("CollectiveCurve.nbytes must increase")

    def at(self, nbytes: float) -> float:
        """Seconds at ``nbytes``: piecewise linear between points, the first point's time below
        the first size, linear extrapolation of the last two points above the last."""
        xs, ys = self.nbytes, self.seconds
        if nbytes <= xs[0] or len(xs) == 1:
            return ys[0] if nbytes <= xs[0] else ys[0] * nbytes / xs[0]
        i = min(_bisect(xs, nbytes), len(xs) - 1)
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        return max(y0, y0 + (y1 - y0) * (nbytes - x0) / (x1 - x0))


def _bisect(xs: Sequence[float], x: float) -> int:
    lo, hi = 0, len(xs)
    while lo < hi:
        mid = (lo + hi) // 2
        if xs[mid] < x:
            lo = mid + 1
        else:
            hi = mid
    return lo


#: ``(d, fraction of peak)`` curves of :class:`Hardware` (``matmul_efficiency`` first: required)
_CURVE_FIELDS = (
    "matmul_efficiency",
    "autograd_matmul_efficiency",
    "attention_efficiency",
    "ns_efficiency",
    "gram_ns_efficiency",
)
#: ``(group size or ranks on the node, value)`` pairs of :class:`Hardware`
_BY_GROUP_FIELDS = (
    "fsdp2_call_s_by_group",
    "dtensor_gather_s_by_group",
    "comm_cpu_share_by_group",
    "step_compute_factor_by_group",
)
#: memory passes of a norm's / the activation function's forward where the record has no
#: calibrated per-element cost (:func:`train_norm_s`, :func:`train_activation_s`)
NORM_PASSES = 6
ACTIVATION_PASSES = 2


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Hardware:
    """A machine for :func:`dmuon.sim.simulate` (every field's role: Note: the hardware model, docs/design.md).

    Attributes:
        name: label.
        ranks_per_node: ranks (GPUs, or CPU processes) per node.
        intra / inter: :class:`Link` inside a node and between nodes.
        launch_s: fixed device-side start-up of one collective.
        curves: measured :class:`CollectiveCurve` records (empty: formulas only).
        issue_s: calling-thread seconds to issue one collective.
        matmul_peak_flops: ``(dtype string, FLOP/s)`` pairs, e.g. ``("torch.bfloat16", 989e12)``.
        matmul_efficiency: ``(d, fraction of peak)`` points, ``d`` increasing (``d`` = cube root
            of ``m·n·k``).
        autograd_matmul_efficiency: ``(d, fraction of the fp32 / compute-dtype peak)`` of a
            training matmul (``x·Wᵀ`` forward + both gradients, with autograd); empty = use
            ``matmul_efficiency`` (GPU presets).
        attention_efficiency: ``(d, fraction of the compute-dtype peak)`` of a fused attention
            kernel's forward + backward (``3 ×`` the forward FLOPs in the measured time), ``d`` =
            one head's ``(seq_len² · head_dim)^(1/3)``; empty = the attention matmuls on the
            training-matmul curve (GPU presets).
        ns_efficiency: ``(d, fraction of the ns_dtype peak)`` of one whole Newton-Schulz call
            (``d = (a²·b)^(1/3)`` of an ``a × b`` matrix, ``a <= b``); empty = its matmuls on
            ``matmul_efficiency`` plus memory passes.
        gram_ns_efficiency: the same for one whole Gram Newton-Schulz call
            (``gram_newton_schulz``, default restarts and fallback check; FLOPs as
            :func:`dmuon.plan._cost.flops.matrix_ns_flops` counts them for ``"gram"``) — the plan's
            ``ns_backend="gram"`` matrices, TP ``tp_ns="gram"`` and owner groups; empty = those
            on ``ns_efficiency``.
        ns_batch_factor: ``(d, batch, factor)`` points, sorted by ``(d, batch)``: per matrix, one
            batched Newton-Schulz call of ``batch`` same-shape matrices takes ``factor`` times
            one call on a single matrix (``dmuon.Muon`` batches NS by bucket,
            :func:`dmuon.plan._rules.ns_batch_pieces`); :func:`ns_batch_factor_at` interpolates.
            Empty = 1 (GPU presets: a batched call's operators are then shared by its matrices,
            their matmuls priced per matrix on ``matmul_efficiency``).
        norm_train_s_per_numel: seconds per element of a norm's forward + backward with autograd
            (0 = 6 memory passes).
        activation_train_s_per_numel: seconds per element of the MLP activation's forward +
            backward with autograd (0 = 2 memory passes).
        op_overhead_s: seconds per operator beyond its bytes / FLOPs (dispatch, launch).
        autograd_op_s: seconds per forward operator of training with autograd (the op and its
            backward node, per unit of the workload's operator count); 0 = ``op_overhead_s``.
        elementwise_Bps: bytes per second of memory-bound elementwise ops.
        hook_s: one dmuon hook call (Python), on the calling thread.
        fsdp2_call_s: one FSDP2 all-gather / reduce-scatter call's calling-thread cost.
        dtensor_op_s: extra dispatch per optimizer op on a ``DTensor`` parameter.
        dtensor_gather_s: one ``DTensor.full_tensor()`` + ``redistribute`` back, beyond its
            all-gather (FSDP2 + naive Muon).
        fsdp2_call_s_by_group / dtensor_gather_s_by_group: ``(group size, seconds)`` pairs
            measured in a real group of that size; sizes not listed use the scalar field.
        comm_cpu_share_by_group: ``(ranks on the node, share)`` pairs measured with that many
            ranks computing and communicating at once; other counts use ``comm_cpu_share``.
        step_compute_factor_by_group: ``(group size, factor)``: the forward / backward compute of a
            step whose units synchronise on a group of that size (a blocking collective between
            every two units) runs ``factor`` times its time alone (:func:`step_compute_factor_at`;
            absent = 1: GPU presets).
        cores_per_node: cores that run the ranks of a node (GPU presets: one per GPU).
        busy_compute_factor / busy_memory_factor: slowdown of matmul-class / memory-bound compute
            with every core of the node busy against one core alone (:func:`busy_factors`; 1 =
            none).
        comm_engine: ``"separate"`` or ``"threads"``.
        comm_cpu_share: with ``"threads"``, the fraction of a collective's duration its members'
            compute loses to gloo's threads.
        compute_dtype: dtype the forward / backward matmuls run in.
        ns_dtype: dtype of the Newton-Schulz iteration (torch.optim.Muon: bf16; CPU: fp32).
        memory_nbytes: device memory per rank (0 = unknown), for the memory figure.
        source: where the figures come from (a preset's citation key, or the calibration run).
        coalesces: the backend runs a boundary phase's broadcasts (reduces) on one group as one
            coalesced call (NCCL: True in the GPU presets; gloo cannot: False for calibrated
            records and for records that do not say).
        coalesce_model: ``"serial"`` (default: the bytes of a coalesced group move one after
            another) or ``"concurrent"`` (uncalibrated: they move at once, bound by the member
            that receives the most), :func:`dmuon.sim._engine.coalesce.coalesced_collective_s`.
        coalesced_op_s: per-collective cost inside a coalesced call beyond the first (None:
            the group's link latency ``α``).
    """

    name: str
    ranks_per_node: int
    intra: Link
    inter: Link
    launch_s: float = 0.0
    curves: tuple[CollectiveCurve, ...] = ()
    issue_s: float = 0.0
    matmul_peak_flops: tuple[tuple[str, float], ...] = ()
    matmul_efficiency: tuple[tuple[float, float], ...] = ((1.0, 1.0),)
    autograd_matmul_efficiency: tuple[tuple[float, float], ...] = ()
    attention_efficiency: tuple[tuple[float, float], ...] = ()
    ns_efficiency: tuple[tuple[float, float], ...] = ()
    gram_ns_efficiency: tuple[tuple[float, float], ...] = ()
    ns_batch_factor: tuple[tuple[float, float, float], ...] = ()
    norm_train_s_per_numel: float = 0.0
    activation_train_s_per_numel: float = 0.0
    op_overhead_s: float = 0.0
    autograd_op_s: float = 0.0
    elementwise_Bps: float = 1e12
    hook_s: float = 0.0
    fsdp2_call_s: float = 0.0
    dtensor_op_s: float = 0.0
    dtensor_gather_s: float = 0.0
    fsdp2_call_s_by_group: tuple[tuple[int, float], ...] = ()
    dtensor_gather_s_by_group: tuple[tuple[int, float], ...] = ()
    comm_cpu_share_by_group: tuple[tuple[int, float], ...] = ()
    step_compute_factor_by_group: tuple[tuple[int, float], ...] = ()
    cores_per_node: int = 1
    busy_compute_factor: float = 1.0
    busy_memory_factor: float = 1.0
    comm_engine: str = "separate"
    comm_cpu_share: float = 0.0
    compute_dtype: str = "torch.bfloat16"
    ns_dtype: str = "torch.bfloat16"
    memory_nbytes: int = 0
    source: str = ""
    coalesces: bool = False
    coalesce_model: str = "serial"
    coalesced_op_s: float | None = None
    _curve_index: dict | None = dataclasses.field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.ranks_per_node < 1 or self.cores_per_node < 1:
            raise ValueError("Hardware: ranks_per_node and cores_per_node must be >= 1")
        if self.comm_engine not in ("separate", "threads"):
            raise ValueError(f"Hardware.comm_engine must be 'separate' or 'threads', got {self.comm_engine!r}")
        if self.coalesce_model not in COALESCE_MODELS:
            raise ValueError(f"Hardware.coalesce_model must be one of {COALESCE_MODELS}, got {self.coalesce_model!r}")
        if not self.matmul_peak_flops:
            raise ValueError("Hardware.matmul_peak_flops needs at least one (dtype, FLOP/s) pair")
        for name in _CURVE_FIELDS:
            pts = getattr(self, name)
            if any(b[0] <= a[0] for a, b in zip(pts, pts[1:])):
                raise ValueError(f"Hardware.{name}: d must increase")
        pts3 = self.ns_batch_factor
        if any(not (d > 0 and b > 1 and f > 0) for d, b, f in pts3) or any(
            (b[0], b[1]) <= (a[0], a[1]) for a, b in zip(pts3, pts3[1:])
        ):
            raise ValueError("Hardware.ns_batch_factor: (d, batch > 1, factor > 0) points, (d, batch) increasing")
        index: dict[str, dict[int, CollectiveCurve]] = {}
        for c in self.curves:
            index.setdefault(c.kind, {})[c.group_size] = c
        object.__setattr__(self, "_curve_index", index)

    @property
    def oversubscription(self) -> float:
        """Processor-sharing slowdown of compute: ``max(1, ranks_per_node / cores_per_node)``."""
        return max(1.0, self.ranks_per_node / self.cores_per_node)

    def peak_flops(self, dtype: str) -> float:
        """Matmul peak of ``dtype`` (the record's first entry if ``dtype`` is not listed)."""
        for d, f in self.matmul_peak_flops:
            if d == dtype:
                return f
        return self.matmul_peak_flops[0][1]

    def with_bandwidth(self, factor: float) -> Hardware:
        """The same record with every link's bandwidth scaled by ``factor`` (and no curves)."""
        return dataclasses.replace(
            self,
            intra=dataclasses.replace(self.intra, bandwidth_Bps=self.intra.bandwidth_Bps * factor),
            inter=dataclasses.replace(self.inter, bandwidth_Bps=self.inter.bandwidth_Bps * factor),
            curves=(),
        )

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if not f.name.startswith("_")}
        d["intra"] = dataclasses.asdict(self.intra)
        d["inter"] = dataclasses.asdict(self.inter)
        d["curves"] = [
            dict(kind=c.kind, group_size=c.group_size, nbytes=list(c.nbytes), seconds=list(c.seconds))
            for c in self.curves
        ]
        d["matmul_peak_flops"] = [list(x) for x in self.matmul_peak_flops]
        for name in _CURVE_FIELDS + _BY_GROUP_FIELDS + ("ns_batch_factor",):
            d[name] = [list(x) for x in getattr(self, name)]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Hardware:
        d = dict(d)
        d["intra"] = Link(**d["intra"])
        d["inter"] = Link(**d["inter"])
        d["curves"] = tuple(
            CollectiveCurve(
                kind=c["kind"], group_size=c["group_size"], nbytes=tuple(c["nbytes"]), seconds=tuple(c["seconds"])
            )
            for c in d.get("curves", ())
        )
        d["matmul_peak_flops"] = tuple((str(a), float(b)) for a, b in d["matmul_peak_flops"])
        d["matmul_efficiency"] = tuple((float(a), float(b)) for a, b in d["matmul_efficiency"])
        for name in _CURVE_FIELDS[1:]:  # optional: absent from records of older calibrations
            d[name] = tuple((float(a), float(b)) for a, b in d.get(name, ()))
        for name in _BY_GROUP_FIELDS:
            d[name] = tuple((int(a), float(b)) for a, b in d.get(name, ()))
        d["ns_batch_factor"] = tuple((float(a), float(b), float(c)) for a, b, c in d.get("ns_batch_factor", ()))
        known = {f.name for f in dataclasses.fields(cls) if not f.name.startswith("_")}
        return cls(**{k: v for k, v in d.items() if k in known})


# ----------------------------------------------------------------------------------- costs


def group_link(hw: Hardware, group: Sequence[int]) -> Link:
    """The link a group's algorithm is bound by: ``inter`` if its ranks span nodes."""
    rpn = hw.ranks_per_node
    return hw.inter if min(group) // rpn != max(group) // rpn else hw.intra


def formula_collective_s(kind: str, k: int, nbytes: float, link: Link, launch_s: float = 0.0) -> float:
    """Ring / tree cost of one collective (Note: the simulator's collective cost, docs/design.md).
    ``k`` = group size, ``nbytes`` = bytes per rank. A one-rank group costs ``launch_s`` only."""
    if kind not in KINDS:
        raise ValueError(f"unknown collective kind {kind!r} (one of {KINDS})")
    if k <= 1:
        return launch_s
    a, beta = link.latency_s, 1.0 / link.bandwidth_Bps
    steps_tree = math.ceil(math.log2(k))
    if kind in ("broadcast", "reduce"):
        t = min((k - 1) * a, steps_tree * a) + nbytes * beta
    elif kind == "all_reduce":
        t = min(2 * (k - 1) * a + 2 * (k - 1) / k * nbytes * beta, 2 * steps_tree * a + 2 * nbytes * beta)
    elif kind in ("all_gather", "reduce_scatter"):
        t = (k - 1) * a + (k - 1) * nbytes * beta
    else:  # all_to_all
        t = (k - 1) * a + (k - 1) / k * nbytes * beta
    return launch_s + t


def collective_s(hw: Hardware, kind: str, group: Sequence[int], nbytes: float) -> float:
    """Seconds of one collective of ``kind`` (:data:`KINDS`) on ``group`` moving ``nbytes`` per
    rank: a measured curve of that kind if the record has one (exact group size, else the
    nearest measured size scaled by ``(k-1)/(k'-1)``), else :func:`formula_collective_s`."""
    k = len(group)
    curves = hw._curve_index.get(kind) if hw._curve_index else None  # type: ignore[union-attr]
    if curves:
        if k <= 1:
            return 0.0
        c = curves.get(k)
        if c is not None:
            return c.at(nbytes)
        near = min(curves, key=lambda g: (abs(g - k), -g))
        return curves[near].at(nbytes) * (k - 1) / max(near - 1, 1)
    return formula_collective_s(kind, k, nbytes, group_link(hw, group), hw.launch_s)


def matmul_efficiency(hw: Hardware, d: float, curve: Sequence[tuple[float, float]] | None = None) -> float:
    """Fraction of peak a matmul of mean dimension ``d`` reaches (log-linear interpolation,
    clamped at the ends of ``curve``, default ``hw.matmul_efficiency``)."""
    return _log_interp(hw.matmul_efficiency if curve is None else curve, d)


def _log_interp(pts: Sequence[tuple[float, float]], x: float) -> float:
    """``y`` at ``x`` on ``(x, y)`` points (``x`` increasing): linear in ``log x``, clamped at the ends."""
    if x <= pts[0][0]:
        return pts[0][1]
    if x >= pts[-1][0]:
        return pts[-1][1]
    i = _bisect([p[0] for p in pts], x)
    (x0, y0), (x1, y1) = pts[i - 1], pts[i]
    w = (math.log(x) - math.log(x0)) / (math.log(x1) - math.log(x0))
    return y0 + w * (y1 - y0)


def ns_batch_factor_at(hw: Hardware, d: float, batch: int) -> float:
    """Per-matrix time of a batched Newton-Schulz call of ``batch`` matrices of mean dimension
    ``d`` over one call on a single matrix (``hw.ns_batch_factor``): at each measured ``d``,
    linear in ``log batch`` from ``(1, 1.0)`` through the measured batches (clamped beyond the
    largest), then linear in ``log d`` between the measured ``d`` (clamped outside them). 1 for
    ``batch <= 1`` or a record without the table."""
    if batch <= 1 or not hw.ns_batch_factor:
        return 1.0
    by_d: dict[float, list[tuple[float, float]]] = {}
    for dd, b, f in hw.ns_batch_factor:
        by_d.setdefault(dd, [(1.0, 1.0)]).append((b, f))
    return _log_interp([(dd, _log_interp(pts, batch)) for dd, pts in by_d.items()], d)


def matmul_s(hw: Hardware, flops: float, d: float, dtype: str) -> float:
    """Seconds of ``flops`` matmul FLOPs at mean dimension ``d`` in ``dtype`` (no per-op overhead)."""
    if flops <= 0:
        return 0.0
    return flops / (hw.peak_flops(dtype) * matmul_efficiency(hw, d))


def elementwise_s(hw: Hardware, nbytes: float, ops: float) -> float:
    """Seconds of memory-bound work: ``nbytes / elementwise_Bps + ops * op_overhead_s``."""
    return nbytes / hw.elementwise_Bps + ops * hw.op_overhead_s


def train_matmul_s(hw: Hardware, flops: float, d: float, dtype: str) -> float:
    """:func:`matmul_s` for a matmul of the training forward / backward: the peak of ``dtype``
    times ``autograd_matmul_efficiency(d)`` where the record has that curve, else
    :func:`matmul_s`."""
    if not hw.autograd_matmul_efficiency:
        return matmul_s(hw, flops, d, dtype)
    if flops <= 0:
        return 0.0
    return flops / (hw.peak_flops(dtype) * matmul_efficiency(hw, d, hw.autograd_matmul_efficiency))


def train_elementwise_s(hw: Hardware, nbytes: float, ops: float) -> float:
    """:func:`elementwise_s` with ``autograd_op_s`` per operator where the record has it."""
    return nbytes / hw.elementwise_Bps + ops * (hw.autograd_op_s or hw.op_overhead_s)


def train_attention_s(hw: Hardware, flops: float, d: float, head_d: float, dtype: str) -> float:
    """Seconds of ``flops`` attention FLOPs of the training forward (``flops`` as the workload
    counts them, causal factor applied): on the calibrated ``attention_efficiency`` curve at one
    head's mean dimension ``head_d`` where the record has one, else :func:`train_matmul_s` at
    the whole width's ``d``."""
    if flops <= 0:
        return 0.0
    if not (hw.attention_efficiency and head_d > 0):
        return train_matmul_s(hw, flops, d, dtype)
    return flops / (hw.peak_flops(dtype) * matmul_efficiency(hw, head_d, hw.attention_efficiency))


def busy_factors(hw: Hardware) -> tuple[float, float]:
    """``(matmul-class, memory-bound)`` slowdown with ``min(ranks_per_node, cores_per_node)`` of
    the node's cores busy: 1 with one busy core, the calibrated factors with all of them, linear
    between (Note: the hardware model, docs/design.md)."""
    cores = hw.cores_per_node
    busy = min(hw.ranks_per_node, cores)
    if cores <= 1 or busy <= 1:
        return 1.0, 1.0
    w = (busy - 1) / (cores - 1)
    return 1.0 + w * (hw.busy_compute_factor - 1.0), 1.0 + w * (hw.busy_memory_factor - 1.0)


def ns_mean_dim(m: int, n: int) -> float:
    """``d = (a²·b)^(1/3)`` of an ``(m, n)`` matrix (``a <= b`` its sides): the mean dimension the
    Newton-Schulz curves (``ns_efficiency``, ``gram_ns_efficiency``, ``ns_batch_factor``) are
    calibrated and looked up by."""
    a, b = min(m, n), max(m, n)
    return (a * a * b) ** (1 / 3)


def ns_call_s(hw: Hardware, flops: float, d: float, backend: str = "standard") -> float:
    """Seconds of one Newton-Schulz call of ``flops`` (:func:`dmuon.plan._cost.flops.matrix_ns_flops`
    for ``backend``) on a matrix of mean dimension ``d`` in ``hw.ns_dtype``, on the calibrated
    curve of that call (the whole call: matmuls, norm, axpys; Gram NS also its Gram products and
    fallback check): ``gram_ns_efficiency`` for ``backend="gram"`` where the record has it, else
    ``ns_efficiency``. The record must have ``ns_efficiency``."""
    if flops <= 0:
        return 0.0
    curve = hw.gram_ns_efficiency if backend == "gram" and hw.gram_ns_efficiency else hw.ns_efficiency
    return flops / (hw.peak_flops(hw.ns_dtype) * matmul_efficiency(hw, d, curve))


def train_norm_s(hw: Hardware, numel: float, itemsize: int) -> float:
    """Forward seconds of norms over ``numel`` elements: a third of the calibrated forward +
    backward (``norm_train_s_per_numel``), else 6 passes of ``itemsize`` bytes."""
    if hw.norm_train_s_per_numel > 0:
        return numel * hw.norm_train_s_per_numel / 3
    return NORM_PASSES * numel * itemsize / hw.elementwise_Bps


def train_activation_s(hw: Hardware, numel: float, itemsize: int) -> float:
    """Forward seconds of the activation function over ``numel`` elements: a third of the
    calibrated forward + backward (``activation_train_s_per_numel``), else 2 passes."""
    if hw.activation_train_s_per_numel > 0:
        return numel * hw.activation_train_s_per_numel / 3
    return ACTIVATION_PASSES * numel * itemsize / hw.elementwise_Bps


def _by_group(pairs: Sequence[tuple[int, float]], k: int, default: float) -> float:
    for g, s in pairs:
        if g == k:
            return s
    return default


def fsdp2_call_s_at(hw: Hardware, k: int) -> float:
    """One FSDP2 call's calling-thread cost on a group of ``k`` (measured there, else the scalar)."""
    return _by_group(hw.fsdp2_call_s_by_group, k, hw.fsdp2_call_s)


def comm_cpu_share_at(hw: Hardware) -> float:
    """``comm_cpu_share`` with ``hw.ranks_per_node`` ranks on a node (measured so, else the scalar)."""
    return _by_group(hw.comm_cpu_share_by_group, hw.ranks_per_node, hw.comm_cpu_share)


def blocking_wait_s_at(hw: Hardware, k: int) -> float:
    """What a rank's blocking wait on one gloo collective of ``k`` members costs inside a step,
    beyond the collective's own time: the wake-up of the waiting thread and the members' skew.
    Not measured on its own but taken from FSDP2's in-situ call cost, whose calls are exactly
    such waits on CPU: ``fsdp2_call_s_at(k)`` less FSDP2's call on one rank (``fsdp2_call_s``,
    the same Python without a peer). 0 where collectives progress on separate engines (a GPU
    stream waits, not the thread), for ``k = 1``, and where ``k`` was not measured."""
    if hw.comm_engine != "threads" or k <= 1 or all(g != k for g, _ in hw.fsdp2_call_s_by_group):
        return 0.0
    return max(0.0, fsdp2_call_s_at(hw, k) - hw.fsdp2_call_s)


def step_compute_factor_at(hw: Hardware, k: int) -> float:
    """Slowdown of forward / backward compute in a step that synchronises on groups of ``k``
    (measured there; 1 for ``k = 1`` and where not measured). On gloo it comes from what a
    blocking collective between units costs beyond itself in proportion to the compute since the
    previous one: the members' skew (the slowest member's jitter over that compute) and gloo's
    threads and wake-ups sharing the cores with it; the in-situ calibration measures it as the
    extra time per second of compute between FSDP2 calls (``calibrate.gloo._in_situ``)."""
    return _by_group(hw.step_compute_factor_by_group, k, 1.0) if k > 1 else 1.0


def dtensor_gather_s_at(hw: Hardware, k: int) -> float:
    """One ``DTensor.full_tensor()`` + redistribution back on ``k`` ranks, beyond the all-gather."""
    return _by_group(hw.dtensor_gather_s_by_group, k, hw.dtensor_gather_s)


# ----------------------------------------------------------------------------------- presets

_GB = 1e9
_TF = 1e12
# Large-GEMM efficiency on tensor cores, by mean dimension (cuBLAS on H100 reaches ~70-80 % of
# the dense bf16 peak at 4-8k; small shapes are latency / tile bound). Used for every preset.
_GPU_EFFICIENCY = ((128.0, 0.08), (512.0, 0.35), (1024.0, 0.55), (2048.0, 0.68), (4096.0, 0.75), (8192.0, 0.78))


def _gpu(
    name: str,
    *,
    bf16: float,
    fp32: float,
    hbm: float,
    nvlink: float,
    ib: float,
    mem_gb: float,
    source: str,
    ranks_per_node: int = 8,
) -> Hardware:
    return Hardware(
        name=name,
        ranks_per_node=ranks_per_node,  # the NVLink domain
        # NCCL bus bandwidth reaches ~80 % of NVLink's per-direction rate and ~90 % of the NIC's
        intra=Link(latency_s=3e-6, bandwidth_Bps=0.8 * nvlink),
        inter=Link(latency_s=8e-6, bandwidth_Bps=0.9 * ib),
        launch_s=10e-6,
        issue_s=15e-6,
        matmul_peak_flops=(("torch.bfloat16", bf16), ("torch.float16", bf16), ("torch.float32", fp32)),
        matmul_efficiency=_GPU_EFFICIENCY,
        op_overhead_s=4e-6,
        elementwise_Bps=0.8 * hbm,
        hook_s=30e-6,
        fsdp2_call_s=60e-6,
        dtensor_op_s=0.0,  # foreach / fused optimizers on GPU: dispatch hidden behind the device
        cores_per_node=ranks_per_node,
        comm_engine="separate",
        compute_dtype="torch.bfloat16",
        ns_dtype="torch.bfloat16",
        memory_nbytes=int(mem_gb * 2**30),
        source=source,
        coalesces=True,  # NCCL groups a boundary phase's broadcasts / reduces on one group
    )


#: name -> :class:`Hardware` (GPU presets; figures: NVIDIA datasheets, cited in benchmarks/results/2026-12-01-step-time-simulator.md).
#: ``nvlink`` / ``ib`` are per GPU and direction: NVLink 4 900 GB/s bidirectional -> 450; NVLink 3
#: 600 -> 300; A800's NVLink 400 -> 200; one 400 Gb/s NDR NIC per GPU -> 50 GB/s; HDR 200 Gb/s -> 25.
PRESETS: dict[str, Hardware] = {
    "h100": _gpu(
        "H100 SXM5 80GB, NVLink 4 + 8x400G NDR InfiniBand",
        bf16=989 * _TF,
        fp32=67 * _TF,
        hbm=3350 * _GB,
        nvlink=450 * _GB,
        ib=50 * _GB,
        mem_gb=80,
        source="nvidia-h100-datasheet",
    ),
    "h200": _gpu(
        "H200 SXM 141GB, NVLink 4 + 8x400G NDR InfiniBand",
        bf16=989 * _TF,
        fp32=67 * _TF,
        hbm=4800 * _GB,
        nvlink=450 * _GB,
        ib=50 * _GB,
        mem_gb=141,
        source="nvidia-h200-datasheet",
    ),
    "a100": _gpu(
        "A100 SXM4 80GB, NVLink 3 + 8x200G HDR InfiniBand",
        bf16=312 * _TF,
        fp32=19.5 * _TF,
        hbm=2039 * _GB,
        nvlink=300 * _GB,
        ib=25 * _GB,
        mem_gb=80,
        source="nvidia-a100-datasheet",
    ),
    # GB300 NVL72 from NVIDIA's public product page only (per GPU: BF16 dense 2.5 PFLOPS = 360 PFLOPS
    # sparse / 72 / 2; FP32 6 PFLOPS / 72; HBM3e 288 GB at 8 TB/s; NVLink 5 1.8 TB/s bidirectional in a
    # 72-GPU domain; one ConnectX-8 800 Gb/s NIC per GPU): UNCALIBRATED, no measurement behind it
    "gb300": _gpu(
        "GB300 NVL72 288GB, NVLink 5 (72-GPU domain) + 800G ConnectX-8 (uncalibrated: public specifications)",
        bf16=2500 * _TF,
        fp32=83 * _TF,
        hbm=8000 * _GB,
        nvlink=900 * _GB,
        ib=100 * _GB,
        mem_gb=288e9 / 2**30,
        source="nvidia-gb300-nvl72-product-page (uncalibrated)",
        ranks_per_node=72,
    ),
    "a800": _gpu(
        "A800 SXM4 80GB, NVLink 400 GB/s + 8x200G HDR InfiniBand",
        bf16=312 * _TF,
        fp32=19.5 * _TF,
        hbm=2039 * _GB,
        nvlink=200 * _GB,
        ib=25 * _GB,
        mem_gb=80,
        source="nvidia-a800-datasheet",
    ),
}


def preset(name: str) -> Hardware:
    """A GPU preset by name (:data:`PRESETS`), or a calibration JSON file path (:func:`load`)."""
    if name in PRESETS:
        return PRESETS[name]
    if name.endswith(".json"):
        return load(name)
    raise ValueError(f"unknown hardware {name!r}: one of {sorted(PRESETS)} or a calibration .json file")


def load(path: str) -> Hardware:
    """Read a :class:`Hardware` written by :func:`dump` / ``python -m dmuon calibrate --json``
    (the file's ``"hardware"`` object, or the record itself).

    Raises:
        OSError: the file cannot be read.
        ValueError: it is not JSON or not such a record (the message names the file and the fix).
    """
    with open(path, encoding="utf-8") as f:
        try:
            d = json.load(f)
            return Hardware.from_dict(d.get("hardware", d))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:  # JSONDecodeError is a ValueError
            raise ValueError(
                f"{path}: not a calibration record ({type(exc).__name__}: {exc}); "
                "write one with `python -m dmuon calibrate --json FILE`"
            ) from exc


def dump(hw: Hardware, path: str, **extra: Any) -> None:
    """Write ``hw`` (and ``extra`` top-level keys, e.g. the raw measurements) as JSON."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump(dict(hardware=hw.to_dict(), **extra), f, indent=1)
        f.write("\n")
