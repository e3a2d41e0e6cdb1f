"""Behaviour rules of the planner and the runtime, one definition each: which Newton-Schulz
backend a matrix runs, how the optimizer batches NS calls, where Gram NS restarts, which
modes ``dmuon.plan.compile`` accepts, the wire dtypes, which matrices an owner group may
cut, and how a TP-sharded matrix is orthogonalised (:func:`choose_tp_ns`). The cost model
(:mod:`dmuon.plan._cost`) prices what these rules decide; ``dmuon.Muon``,
the Newton-Schulz backends (``dmuon.exec._optim.ns_*``) and the simulator follow them. The Newton-Schulz schedule
(``NS_STEPS``, ``GRAM_RESTART_EVERY``, :func:`gram_segment_lengths`) is defined beside the FLOP
formulas that count over it, in the leaf :mod:`dmuon.plan._cost.flops`, and re-exported here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import NamedTuple, Optional

from dmuon.plan._cost.flops import (
    GRAM_RESTART_EVERY,
    NS_STEPS,
    gram_segment_lengths,
    matrix_ns_flops,
    ns_flops,
    tp_gram_side,
)
from dmuon.plan._cost.nbytes import all_reduce_rank_nbytes
from dmuon.plan._records.fields import itemsize_nbytes
from dmuon.plan._records.params import ParamSpec

__all__ = [
    "NS_STEPS",
    "COST_MODELS",
    "NS_BACKEND_MODES",
    "GRAM_RESTART_EVERY",
    "NS_BATCHING_MODES",
    "NS_BATCH_MAX_NUMEL",
    "TP_NS_MODES",
    "TP_GRAM_DTYPE",
    "OWNER_GROUP_MODES",
    "GRAM_AUTO_MIN_SIDE",
    "choose_ns_backend",
    "ns_bucket_sides",
    "RunPiece",
    "ns_batch_pieces",
    "ns_batch_runs",
    "gram_segment_lengths",
    "tp_rank_nbytes",
    "choose_tp_ns",
    "owner_group_dim",
    "owner_group_problem",
    "owner_group_max_split",
    "bcast_dtype",
    "reduce_dtype",
    "COLLECTIVE_MODES",
    "GRADIENT_COLLECTIVE",
    "COLLECTIVE_LATENCY_S",
    "COLLECTIVE_BANDWIDTH_BPS",
    "CollectiveLink",
    "COLLECTIVE_LINKS",
    "collective_link",
    "EXPERT_RANGE_SLACK",
    "ALL_GATHER_MAX_PADDING",
]

#: valid ``cost_model`` values of :func:`dmuon.plan.compile`
COST_MODELS = ("numel", "ns_flops")
#: valid ``ns_backend`` values of :func:`dmuon.plan.compile` (and of ``dmuon.Muon``)
NS_BACKEND_MODES = ("standard", "gram", "auto")
#: ``dmuon.Muon(ns_batching=...)``: ``"batched"`` (default: same-shape matrices share one
#: Newton-Schulz call per bucket, :func:`ns_batch_runs`, in every NS dtype) or ``"exact"`` (one call
#: per matrix, bit for bit torch.optim.Muon). The simulator prices the mode the job runs.
NS_BATCHING_MODES = ("batched", "exact")
#: upper bound on the elements of one batched NS call (several temporaries of this size live at
#: once; under CPU offload, the elements of one run copied to the device): an expert range larger
#: than this is cut between experts (:func:`ns_batch_pieces`); a single larger matrix (or expert)
#: still runs, alone
NS_BATCH_MAX_NUMEL = 1 << 26
#: valid ``tp_ns`` values of :func:`dmuon.plan.compile`
TP_NS_MODES = ("auto", "gram", "gather")
#: dtype of the Gram matrices all-reduced over a TP group (accumulated in fp32 whatever the NS dtype)
TP_GRAM_DTYPE = "torch.float32"
#: string values of ``dmuon.plan.compile(owner_groups=...)`` (an int ``k >= 1`` forces ``k``)
OWNER_GROUP_MODES = ("off", "auto")
#: valid ``collectives`` values of :func:`dmuon.plan.compile`: the parameter phases' collective
#: of every buffer, chosen per buffer (``"auto"``) or forced (:mod:`dmuon.plan._layout.collective_rule`)
COLLECTIVE_MODES = ("auto", "broadcast", "all_gather")
#: the gradient collective each parameter-phase kind pairs with (over the same segments / slots)
GRADIENT_COLLECTIVE = {"broadcast": "reduce", "all_gather": "reduce_scatter"}
#: ``collectives="auto"``: seconds per collective algorithm step (alpha) and link bandwidth (B) of
#: the cost rule (:func:`dmuon.plan._cost.seconds.buffer_collective_s`) for NCCL (the ``"nccl"``
#: record of :data:`COLLECTIVE_LINKS`). COPIED from the simulator's
#: ``dmuon.sim.hardware.PRESETS["h100"].inter`` (8 us, 0.9 x 50 GB/s NDR InfiniBand); the planner
#: never imports the simulator, a test asserts the two agree. Plan settings (JSON, fingerprint).
COLLECTIVE_LATENCY_S = 8e-6
COLLECTIVE_BANDWIDTH_BPS = 45e9
#: the ``"gloo"`` record's numbers (:data:`COLLECTIVE_LINKS`: how they were measured and fitted)
GLOO_LATENCY_S = 133.8e-6
GLOO_BANDWIDTH_BPS = 2.151e9
GLOO_ALL_GATHER_LATENCY_S = 214.6e-6
GLOO_ALL_GATHER_BANDWIDTH_BPS = 0.432e9


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class CollectiveLink:
    """The numbers of the ``collectives="auto"`` rule for one process-group backend: ``alpha``
    (seconds per algorithm step) and ``B`` (bytes per second) of the tree kinds (broadcast,
    reduce: ``latency_s``, ``bandwidth_Bps``) and of the ring kinds (all-gather,
    reduce-scatter: ``all_gather_latency_s``, ``all_gather_bandwidth_Bps``), where the record
    comes from (``source``) and its ``name`` (the key in :data:`COLLECTIVE_LINKS`, which the plan
    records)."""

    name: str
    latency_s: float
    bandwidth_Bps: float
    all_gather_latency_s: float
    all_gather_bandwidth_Bps: float
    source: str


#: The link records of ``collectives="auto"``, by process-group backend. ``dmuon.dedicate_params``
#: picks the record of its process group's backend for the model's device (``"gloo"``: gloo;
#: every other backend: ``"nccl"``); ``dmuon.plan.compile`` without ``collective_backend`` (no
#: process group) assumes NCCL.
#:
#: * ``"nccl"``: the h100 preset's inter-node link, one pair for every kind (above).
#: * ``"gloo"``: MEASURED on CPU and fitted, no run-time benchmark: ``benchmarks/gloo_link_fit.py``
#:   ran the simulator's gloo calibration curves (``dmuon.sim._calibrate.gloo._time_collectives``:
#:   median seconds from issue to ``wait()`` of broadcast, reduce, all-gather and reduce-scatter,
#:   payloads 256 B - 8 MiB per rank, groups of 2, 3 and 4 processes, one thread each) 3 times on
#:   this project's 2-core CPU VM (2026-12-06), took each point's median and fitted the planner's
#:   formulas by least squares on relative error (``dmuon.sim._calibrate.link_fit.fit_link``), one
#:   pair per family; the curves and the fit are in ``benchmarks/gloo_link_fit.json`` and a test
#:   re-fits that file against these numbers. gloo moves a broadcast's bytes ~4x faster than an
#:   all-gather's on CPU (its ring copies through every member), so the auto rule keeps the
#:   broadcasts there except for latency-bound buffers of a few KB; one shared ``B`` would pick the
#:   all-gather at every size (measured slower: benchmarks/results/2026-12-06-collectives-per-buffer.md,
#:   "Measured on CPU: broadcast against all-gather").
COLLECTIVE_LINKS = {
    "nccl": CollectiveLink(
        name="nccl",
        latency_s=COLLECTIVE_LATENCY_S,
        bandwidth_Bps=COLLECTIVE_BANDWIDTH_BPS,
        all_gather_latency_s=COLLECTIVE_LATENCY_S,
        all_gather_bandwidth_Bps=COLLECTIVE_BANDWIDTH_BPS,
        source="the h100 preset's inter-node link (8 us, 45 GB/s NDR InfiniBand)",
    ),
    "gloo": CollectiveLink(
        name="gloo",
        latency_s=GLOO_LATENCY_S,
        bandwidth_Bps=GLOO_BANDWIDTH_BPS,
        all_gather_latency_s=GLOO_ALL_GATHER_LATENCY_S,
        all_gather_bandwidth_Bps=GLOO_ALL_GATHER_BANDWIDTH_BPS,
        source="gloo on CPU, fitted to the gloo calibration curves of 2-4 processes on a 2-core VM "
        "(benchmarks/gloo_link_fit.py)",
    ),
}


def collective_link(backend: str) -> CollectiveLink:
    """The link record of ``backend`` (a key of :data:`COLLECTIVE_LINKS`).

    Raises:
        ValueError: an unknown backend, naming the known ones.
    """
    if backend not in COLLECTIVE_LINKS:
        raise ValueError(f"collective_backend must be one of {tuple(COLLECTIVE_LINKS)}, got {backend!r}")
    return COLLECTIVE_LINKS[backend]


#: expert ranges: a stack of ``E`` experts gets ranges of ``g`` experts, ``g`` the largest with
#: ``g * per-expert weight <= EXPERT_RANGE_SLACK * mean slot weight``
#: (:func:`dmuon.plan._model.expert_ranges.expert_range_count`): fewer owners per boundary (fewer
#: broadcasts) while the LPT bound stays ``mean + max(largest dense matrix, slack * mean)``
EXPERT_RANGE_SLACK = 0.5
#: ``collectives="auto"`` all-gathers a buffer only when its slots pad it by at most this
#: fraction of the gathered tensor (``N * slot``; :func:`dmuon.plan._layout.collective_rule.padding_fraction`):
#: above it the buffer stays broadcasts, whose segments carry no padding, even where the
#: alpha-beta rule prices the padded all-gather lower (the padding is memory and bytes on every
#: rank, and uneven slots mean uneven owners)
ALL_GATHER_MAX_PADDING = 0.02


#: ``ns_backend="auto"`` picks Gram NS only for matrices whose short side ``d = min(m, n)`` is at
#: least this (:func:`choose_ns_backend`). Hardware assumption: one CPU core (fp32, MKL; measured
#: on AMD Zen 3 in benchmarks/ns_backends.py, benchmarks/results/2026-12-01-newton-schulz-kernels.md). Gram NS moves about 40 % of
#: its FLOPs into ``(d, d)`` products, which run ~25 % slower per FLOP than the ``(d, D)`` ones at
#: ``d = 256``, and adds ~10 small ops per step and its fallback check (two ``(d, D)`` passes):
#: at ``128 x 512`` that ate all of the 29 % FLOP saving (0.95-1.1x the standard iteration's
#: time), at ``256 x 1024`` it ran 0.75-0.85x. Accelerators, where Gram NS pays from much larger
#: ``d``, need their own value: this constant is the rule's only hardware term.
GRAM_AUTO_MIN_SIDE = 256


def choose_ns_backend(
    matrix_shape: Sequence[int],
    mode: str,
    *,
    steps: int = NS_STEPS,
    restart_every: int | Sequence[int] | None = GRAM_RESTART_EVERY,
) -> str:
    """The Newton-Schulz backend a matrix runs: ``"standard"`` or ``"gram"`` (the one rule, used by
    :func:`dmuon.plan.compile` to fill ``ParamSpec.ns_backend``, by ``dmuon.Muon`` to check it and
    by ``dmuon.exec._optim.ns_backends.auto_newton_schulz`` at run time).

    ``mode="auto"``: ``"gram"`` exactly when the short side ``d = min(m, n)`` is at least
    :data:`GRAM_AUTO_MIN_SIDE` (below it the per-op and fallback-check overheads outweigh the
    saving on a CPU core; the constant's comment gives the measurement) and Gram NS needs fewer
    matmul FLOPs (:func:`~dmuon.plan._cost.flops.matrix_ns_flops` with ``steps`` and ``restart_every``); ties and everything
    else go to ``"standard"`` (torch's iteration). With 5 steps and the default restarts (before
    steps 2 and 4) Gram NS costs ``10.5·d²·D + 22·d³`` for ``(d, D)`` (the symmetric Gram product,
    :func:`~dmuon.plan._cost.flops.gram_product_flops`) against ``20·d²·D + 10·d³``: Gram where ``D > 1.26·d``.
    ``"standard"`` / ``"gram"``: forced.

    Raises:
        ValueError: unknown ``mode``.
    """
    if mode not in NS_BACKEND_MODES:
        raise ValueError(f"ns_backend must be one of {NS_BACKEND_MODES}, got {mode!r}")
    if mode != "auto":
        return mode
    m, n = (int(v) for v in matrix_shape)
    if min(m, n) < GRAM_AUTO_MIN_SIDE:
        return "standard"
    gram = matrix_ns_flops(m, n, "gram", steps=steps, restart_every=restart_every)
    return "gram" if gram < ns_flops(m, n, steps) else "standard"


def ns_bucket_sides(m: int, n: int) -> tuple[int, int]:
    """``(short, long)`` side: the batched-NS bucket of an ``(m, n)`` matrix (with its dtype and
    device). Tall and wide matrices of the same sides share a bucket: NS of a tall ``G`` is the
    transpose of NS of the wide ``Gᵀ``, so e.g. an MLP's ``(4d, d)`` and ``(d, 4d)`` weights run
    in one call."""
    return (min(m, n), max(m, n))


class RunPiece(NamedTuple):
    """Units ``[start, stop)`` of entry ``entry`` of a bucket in one Newton-Schulz run
    (:func:`ns_batch_pieces`); a unit is the smallest piece an entry may be cut into: one expert
    of an owned expert range (its gate and up matrices together), else the whole entry."""

    entry: int
    start: int
    stop: int


def ns_batch_pieces(numels: Sequence[int], unit_numels: Optional[Sequence[int]] = None) -> list[list[RunPiece]]:
    """A bucket's entries (``numels[i]`` elements each, in parameter order) cut into batched NS
    calls, the runs ``dmuon.Muon`` issues (and, under CPU offload, copies to the device one at a
    time): consecutive entries join a run while it stays within :data:`NS_BATCH_MAX_NUMEL`
    elements; an entry that does not fit starts a new run. An entry larger than the cap on its
    own is cut into pieces of whole units (``unit_numels[i]`` elements each, dividing
    ``numels[i]``: one expert of an owned range; ``None`` or ``numels[i]``: never cut), as many
    units per piece as fit (at least one), each piece a run; later entries may join its last.
    Cutting keeps every result: Newton-Schulz is per matrix, momentum, decay and update per
    element. ``dmuon.Muon``, the memory model (``staged_run_nbytes``) and :mod:`dmuon.sim` use
    these runs.

    Raises:
        ValueError: a unit that does not divide its entry.
    """
    runs: list[list[RunPiece]] = []
    total = 0
    for i, numel in enumerate(numels):
        unit = numel if unit_numels is None else unit_numels[i]
        if unit < 0 or (unit == 0 and numel) or (unit and numel % unit):
            raise ValueError(f"entry {i}: a unit of {unit} elements does not divide its {numel}")
        units = numel // unit if unit else 1  # an empty entry: one unit of nothing
        if runs and total + numel <= NS_BATCH_MAX_NUMEL:
            runs[-1].append(RunPiece(i, 0, units))
            total += numel
            continue
        per = max(1, NS_BATCH_MAX_NUMEL // unit) if numel > NS_BATCH_MAX_NUMEL else units
        for start in range(0, units, per):
            stop = min(units, start + per)
            runs.append([RunPiece(i, start, stop)])
            total = (stop - start) * unit
    return runs


def ns_batch_runs(numels: Sequence[int]) -> list[list[int]]:
    """:func:`ns_batch_pieces` of entries never cut: runs of consecutive indices of at most
    :data:`NS_BATCH_MAX_NUMEL` elements in all (an entry larger than that alone)."""
    return [[piece.entry for piece in run] for run in ns_batch_pieces(numels)]


def tp_rank_nbytes(spec: ParamSpec, method: str, segments: int) -> int:
    """Bytes charged to each rank of the owner's TP group per step for ``spec``:

    * ``"gram"``: ``segments`` ring all-reduces of the fp32 ``(d, d)`` Gram
      (:func:`all_reduce_rank_nbytes`, :func:`tp_gram_side`);
    * ``"gather"``: an all-gather of the update in the storage dtype: ``(T-1) * S/T`` with
      ``S`` = the full matrix's bytes.
    """
    T = spec.tp_size
    if method == "gram":
        d = tp_gram_side(spec.shape, spec.tp_shard_dim)  # type: ignore[arg-type]
        return segments * all_reduce_rank_nbytes(d * d, itemsize_nbytes(TP_GRAM_DTYPE), T)
    if method == "gather":
        return (T - 1) * spec.local_numel * itemsize_nbytes(spec.dtype)
    raise ValueError(f"tp method must be 'gram' or 'gather', got {method!r}")


def choose_tp_ns(spec: ParamSpec, mode: str, segments: int) -> str:
    """``"gram"`` or ``"gather"`` for a TP-sharded matrix (``spec.tp_ns`` is not read).

    ``mode="auto"``: the method charging fewer bytes per step (:func:`tp_rank_nbytes`), ties to
    ``"gather"`` (no extra rounding). Per rank, Gram costs ``segments·2·(T-1)·ceil(d²/T)·4`` and
    gathering ``(T-1)·(d·D/T)·itemsize`` (``D`` = the split side), so with fp32 storage Gram
    wins when ``D > 2·segments·d``, whatever ``T``: ``D > 6·d`` with the default three segments
    (5 steps, a restart every 2), ``D > 2·d`` with no restarts. Sharding along the short side
    (e.g. a colwise ``(1024, 4096)`` k_proj) makes ``d`` the long side, so it gathers; so do
    square matrices. ``"gram"`` / ``"gather"``: forced.

    Raises:
        ValueError: unknown ``mode``.
    """
    if mode not in TP_NS_MODES:
        raise ValueError(f"tp_ns must be one of {TP_NS_MODES}, got {mode!r}")
    if spec.view is not None and spec.view_tp_problem() is None:
        return "local"  # blocks inside the TP shards: no TP collective at all
    if mode != "auto":
        return mode
    gram = tp_rank_nbytes(spec, "gram", segments)
    gather = tp_rank_nbytes(spec, "gather", segments)
    return "gram" if gram < gather else "gather"


def owner_group_dim(shape: Sequence[int]) -> int:
    """The dim an owner group cuts a 2-D matrix along: its long side (rows when ``m >= n``), so
    that the Gram of the short side ``d`` is a sum of the blocks' Grams (:func:`~dmuon.plan._cost.flops.tp_gram_side`
    with the same dim gives ``d``)."""
    return 0 if int(shape[0]) >= int(shape[1]) else 1


def owner_group_problem(spec: ParamSpec) -> str | None:
    """Why ``spec`` cannot be owned by an owner group (None if it can): only whole 2-D matrices
    (no TP shard, no matrix view, no expert stack or conv kernel) are cut into blocks."""
    if spec.tp_size > 1:
        return "it is TP-sharded (its TP group already shares the Newton-Schulz)"
    if spec.view is not None:
        return "it has a matrix view (its blocks are orthogonalised separately)"
    if len(spec.shape) != 2 or spec.num_matrices != 1:
        return f"it is not a plain 2-D matrix (shape {spec.shape})"
    return None


def owner_group_max_split(spec: ParamSpec, num_shards: int) -> int:
    """Largest owner group ``spec`` may get on ``num_shards`` shard ranks: ``min(N, long side)``,
    or 1 (:func:`owner_group_problem`)."""
    if owner_group_problem(spec) is not None:
        return 1
    return max(1, min(int(num_shards), max(int(v) for v in spec.shape)))


def bcast_dtype(storage_dtype: str, param_dtype: str | None) -> str:
    """Wire dtype of forward/backward broadcasts: ``param_dtype`` or the storage dtype."""
    return param_dtype or storage_dtype


def reduce_dtype(storage_dtype: str, param_dtype: str | None, reduce_dtype_: str | None) -> str:
    """Wire dtype of gradient reduces: ``reduce_dtype or param_dtype or`` the storage dtype
    (FSDP2 ``MixedPrecisionPolicy`` semantics)."""
    return reduce_dtype_ or param_dtype or storage_dtype
