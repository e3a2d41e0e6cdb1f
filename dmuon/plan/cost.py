r"""Cost model: bytes on the wire, Newton-Schulz FLOPs and memory, for DMuon and a baseline.

Units are in the names: ``_numel`` = elements, ``_nbytes`` = bytes, ``_flops`` = floating-point
operations (a multiply-add counts 2). All figures are per optimizer step.

Byte accounting (DESIGN.md section 1): for one collective over a group of ``k`` ranks and a
payload of ``S`` bytes, every non-root rank is charged ``S`` (it receives ``S`` in a broadcast,
sends ``S`` in a reduce), so the collective totals ``(k-1)*S``. An all-gather or
reduce-scatter of a full tensor of ``S`` bytes is charged ``S*(k-1)/k`` per rank (``(k-1)*S``
in total; here ``S`` includes FSDP2's dim-0 padding, so per-rank figures are exact integers).
Totals are summed over all mesh ranks; ``per_rank_nbytes`` is indexed by mesh rank
``replicate*N + shard`` and sums to the total. Averages are derived, never stored.

DMuon per step (mesh ``(R, N)``; ``P`` = packed segment bytes incl. alignment padding and flags,
in the phase's wire dtype; ``Q`` = subsegment bytes):

=========================  =======================  ==========================================
phase                      total bytes              charged to
=========================  =======================  ==========================================
forward broadcast          ``R*(N-1)*P_bcast``      ``(s', r')``, ``s' != seg.shard``
backward broadcast (Z3)    ``R*(N-1)*P_bcast``      same; 0 for Z2 (``reshard_after_forward=False``)
gradient reduce            ``R*(N-1)*P_reduce``     same (each non-root sends the segment)
replicate reduce (HSDP)    ``(R-1)*Q_reduce``       ``(s, r')``, ``r' != owner.replicate``
replicate broadcast        ``(R-1)*Q_param``        same, in the parameter's storage dtype
=========================  =======================  ==========================================

Baseline "FSDP2 + naive Muon" for the SAME parameters (every rank runs Newton-Schulz on every
full matrix after all-gathering its gradient). Per parameter with FSDP2 shard
``c = ceil(d0/N) * prod(shape[1:])`` elements (dim-0 chunking with padding), ``S = N*c``:

=========================  ===============================  ===================================
collective                 total bytes                      per rank
=========================  ===============================  ===================================
forward all-gather         ``R*(N-1)*S*isz_bcast``          ``(N-1)*c*isz_bcast``
backward all-gather (Z3)   same; 0 for Z2                   same
gradient reduce-scatter    ``R*(N-1)*S*isz_reduce``         ``(N-1)*c*isz_reduce``
replicate all-reduce       ``2*R*N*(R-1)*ceil(c/R)*isz_r``  ``2*(R-1)*ceil(c/R)*isz_reduce``
                           (~``2*(R-1)*S``, ring RS+AG)
naive Muon grad all-gather ``R*(N-1)*S*isz_param``          ``(N-1)*c*isz_param``
=========================  ===============================  ===================================

So for Z3 on a 1-D mesh the baseline moves ``4*(N-1)*S`` versus DMuon's ``3*(N-1)*P``.

Newton-Schulz FLOPs (Muon, Jordan et al. 2024, quintic iteration on the ``m x n`` matrix with
``m <= n``): each step forms ``A = X X^T`` (``2 m^2 n``), ``A A`` (``2 m^3``) and ``B X``
(``2 m^2 n``), i.e. ``steps * (4 m^2 n + 2 m^3)`` per matrix; elementwise terms are ignored.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

from .layout import Boundary
from .records import Owner, ParamSpec, _check_int, itemsize_nbytes

__all__ = [
    "NS_STEPS",
    "COST_MODELS",
    "ByteCost",
    "BaselineByteCost",
    "RankStats",
    "ns_flops",
    "param_weight",
    "broadcast_nbytes",
    "reduce_nbytes",
    "all_gather_nbytes",
    "reduce_scatter_nbytes",
    "all_reduce_nbytes",
    "fsdp2_shard_numel",
    "bcast_dtype",
    "reduce_dtype",
    "byte_cost",
    "baseline_byte_cost",
    "rank_stats",
    "baseline_rank_stats",
]

#: Newton-Schulz steps assumed by ``cost_model="ns_flops"`` (torch.optim.Muon default)
NS_STEPS = 5
#: valid ``cost_model`` values of :func:`dmuon.plan.compile`
COST_MODELS = ("numel", "ns_flops")


# --------------------------------------------------------------------------- formulas


def ns_flops(m: int, n: int, *, steps: int = NS_STEPS, num_matrices: int = 1) -> int:
    """Newton-Schulz FLOPs to orthogonalise ``num_matrices`` matrices of shape ``(m, n)``.

    ``num_matrices * steps * (4 * a*a*b + 2 * a**3)`` with ``a = min(m, n)``, ``b = max(m, n)``
    (Muon runs the iteration on the wide orientation). Unit: FLOPs (multiply-add = 2).
    """
    a, b = (m, n) if m <= n else (n, m)
    return num_matrices * steps * (4 * a * a * b + 2 * a**3)


def param_weight(spec: ParamSpec, cost_model: str) -> int:
    """LPT weight of a dedicated parameter: ``numel`` (elements) or :func:`ns_flops` (FLOPs).

    Raises:
        ValueError: unknown ``cost_model``.
    """
    if cost_model == "numel":
        return spec.numel
    if cost_model == "ns_flops":
        m, n = spec.matrix_shape
        return ns_flops(m, n, num_matrices=spec.num_matrices)
    raise ValueError(f"cost_model must be one of {COST_MODELS}, got {cost_model!r}")


def broadcast_nbytes(payload_nbytes: int, group_size: int) -> int:
    """Total bytes of one broadcast of ``payload_nbytes`` to a group of ``group_size`` ranks:
    ``(k-1) * S`` (each non-root receives ``S``)."""
    return (group_size - 1) * payload_nbytes


def reduce_nbytes(payload_nbytes: int, group_size: int) -> int:
    """Total bytes of one reduce of ``payload_nbytes`` to a root: ``(k-1) * S`` (each non-root sends ``S``)."""
    return (group_size - 1) * payload_nbytes


def all_gather_nbytes(full_nbytes: int, group_size: int) -> int:
    """Total bytes of an all-gather producing ``full_nbytes`` on each of ``k`` ranks:
    ``(k-1) * S`` (``S*(k-1)/k`` per rank)."""
    return (group_size - 1) * full_nbytes


def reduce_scatter_nbytes(full_nbytes: int, group_size: int) -> int:
    """Total bytes of a reduce-scatter of a full tensor of ``full_nbytes``: ``(k-1) * S``."""
    return (group_size - 1) * full_nbytes


def all_reduce_nbytes(payload_nbytes: int, group_size: int) -> int:
    """Total bytes of an all-reduce of ``payload_nbytes``: ``2 * (k-1) * S`` (ring RS + AG)."""
    return 2 * (group_size - 1) * payload_nbytes


def fsdp2_shard_numel(shape: Sequence[int], num_shards: int) -> int:
    """Elements of one FSDP2 shard of a tensor of ``shape``, padding included:
    ``ceil(shape[0] / N) * prod(shape[1:])`` (FSDP2 chunks dim 0 and pads every chunk)."""
    if not shape:
        return 1
    return -(-shape[0] // num_shards) * math.prod(shape[1:])


def bcast_dtype(storage_dtype: str, param_dtype: str | None) -> str:
    """Wire dtype of forward/backward broadcasts: ``param_dtype`` or the storage dtype."""
    return param_dtype or storage_dtype


def reduce_dtype(storage_dtype: str, param_dtype: str | None, reduce_dtype_: str | None) -> str:
    """Wire dtype of gradient reduces: ``reduce_dtype or param_dtype or`` the storage dtype
    (FSDP2 ``MixedPrecisionPolicy`` semantics)."""
    return reduce_dtype_ or param_dtype or storage_dtype


# --------------------------------------------------------------------------- records


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ByteCost:
    """DMuon bytes per step, summed over all mesh ranks (module docstring table).

    ``total_nbytes`` is the sum of the five phase fields; ``per_rank_nbytes[rank]`` (length
    ``R*N``) sums to ``total_nbytes``.
    """

    forward_broadcast_nbytes: int
    backward_broadcast_nbytes: int
    reduce_nbytes: int
    replicate_reduce_nbytes: int
    replicate_broadcast_nbytes: int
    total_nbytes: int
    per_rank_nbytes: tuple[int, ...]

    PHASES = (
        "forward_broadcast_nbytes",
        "backward_broadcast_nbytes",
        "reduce_nbytes",
        "replicate_reduce_nbytes",
        "replicate_broadcast_nbytes",
    )

    def __post_init__(self) -> None:
        for name in self.PHASES + ("total_nbytes",):
            _check_int("ByteCost", name, getattr(self, name), 0)
        if type(self.per_rank_nbytes) is not tuple:
            raise TypeError("ByteCost.per_rank_nbytes must be a tuple")
        for v in self.per_rank_nbytes:
            _check_int("ByteCost", "per_rank_nbytes[i]", v, 0)
        if sum(getattr(self, n) for n in self.PHASES) != self.total_nbytes:
            raise ValueError("ByteCost.total_nbytes must equal the sum of the phase fields")
        if sum(self.per_rank_nbytes) != self.total_nbytes:
            raise ValueError("ByteCost.per_rank_nbytes must sum to total_nbytes")

    @property
    def max_rank_nbytes(self) -> int:
        """Bytes of the busiest rank (derived)."""
        return max(self.per_rank_nbytes, default=0)

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {n: getattr(self, n) for n in self.PHASES + ("total_nbytes",)}
        d["per_rank_nbytes"] = list(self.per_rank_nbytes)
        return d


# ``PHASES`` must not become a dataclass field: it is a plain class attribute (no annotation).


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class BaselineByteCost:
    """FSDP2 + naive all-gather Muon bytes per step for the dedicated parameters (module docstring)."""

    forward_all_gather_nbytes: int
    backward_all_gather_nbytes: int
    reduce_scatter_nbytes: int
    replicate_all_reduce_nbytes: int
    muon_all_gather_nbytes: int
    total_nbytes: int
    per_rank_nbytes: tuple[int, ...]

    PHASES = (
        "forward_all_gather_nbytes",
        "backward_all_gather_nbytes",
        "reduce_scatter_nbytes",
        "replicate_all_reduce_nbytes",
        "muon_all_gather_nbytes",
    )

    def __post_init__(self) -> None:
        if sum(getattr(self, n) for n in self.PHASES) != self.total_nbytes:
            raise ValueError("BaselineByteCost.total_nbytes must equal the sum of the phase fields")
        if sum(self.per_rank_nbytes) != self.total_nbytes:
            raise ValueError("BaselineByteCost.per_rank_nbytes must sum to total_nbytes")

    @property
    def max_rank_nbytes(self) -> int:
        return max(self.per_rank_nbytes, default=0)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class RankStats:
    """Per-rank figures for the dedicated parameters, one optimizer step.

    Attributes:
        rank: mesh rank ``replicate*N + shard``.
        owned_numel: elements this rank owns (DMuon: global owner; baseline: its padded FSDP2 shards).
        owned_nbytes: ``owned_numel`` in storage dtype bytes.
        resident_nbytes: persistent bytes between steps: parameters held (DMuon: owned masters
            plus, on HSDP, full replicas of parameters owned by ``(shard, r)`` for other ``r``;
            baseline: FSDP2 shards) + Muon momentum (owned / sharded), storage dtype.
            Gradients (live from backward to ``zero_grad``) are not included.
        peak_transient_nbytes: largest temporary parameter buffer in the broadcast dtype.
            DMuon Z3: max over boundaries of the boundary's buffer bytes minus the segment of
            this rank's shard coordinate (its owned masters, or on HSDP the replicas it holds;
            assumed aliased); Z2: the sum over boundaries (buffers stay resident from forward
            to backward). Baseline: the same for FSDP2's unsharded
            parameters (layer minus own shard; Z2: sum), or the largest all-gathered gradient in
            the naive Muon step if larger. Gradient reduce buffers and prefetch are not included.
        comm_nbytes: bytes charged to this rank per step (section 1 accounting).
        ns_flops: Newton-Schulz FLOPs this rank runs per step.
    """

    rank: int
    owned_numel: int
    owned_nbytes: int
    resident_nbytes: int
    peak_transient_nbytes: int
    comm_nbytes: int
    ns_flops: int

    FIELDS = ("owned_numel", "owned_nbytes", "resident_nbytes", "peak_transient_nbytes", "comm_nbytes", "ns_flops")


# --------------------------------------------------------------------------- DMuon


def byte_cost(
    boundaries: Sequence[Boundary],
    *,
    mesh_shape: tuple[int, int],
    reshard_after_forward: bool,
    param_dtype: str | None,
    reduce_dtype_: str | None,
) -> ByteCost:
    """:class:`ByteCost` of a layout (module docstring table). O(segments + R*N)."""
    R, N = mesh_shape
    seg_b_by_shard = [0] * N  # bytes of segments of shard s, broadcast dtype
    seg_r_by_shard = [0] * N  # same, reduce dtype
    sub_r_by_slot: dict[tuple[int, int], int] = {}
    sub_p_by_slot: dict[tuple[int, int], int] = {}
    for boundary in boundaries:
        for buf in boundary.buffers:
            isz_b = itemsize_nbytes(bcast_dtype(buf.dtype, param_dtype))
            isz_r = itemsize_nbytes(reduce_dtype(buf.dtype, param_dtype, reduce_dtype_))
            isz_p = itemsize_nbytes(buf.dtype)
            for seg in buf.segments:
                seg_b_by_shard[seg.shard] += seg.numel * isz_b
                seg_r_by_shard[seg.shard] += seg.numel * isz_r
                for sub in seg.subsegments:
                    key = (seg.shard, sub.owner.replicate)
                    sub_r_by_slot[key] = sub_r_by_slot.get(key, 0) + sub.numel * isz_r
                    sub_p_by_slot[key] = sub_p_by_slot.get(key, 0) + sub.numel * isz_p
    total_b = sum(seg_b_by_shard)
    total_r = sum(seg_r_by_shard)
    sub_r_by_shard = [0] * N
    sub_p_by_shard = [0] * N
    for (s, _), v in sub_r_by_slot.items():
        sub_r_by_shard[s] += v
    for (s, _), v in sub_p_by_slot.items():
        sub_p_by_shard[s] += v

    bwd = reshard_after_forward
    per_rank = [0] * (R * N)
    for r in range(R):
        for s in range(N):
            fwd_b = total_b - seg_b_by_shard[s]  # receives every other shard's segments
            red = total_r - seg_r_by_shard[s]  # sends its part of every other shard's segments
            rep_r = sub_r_by_shard[s] - sub_r_by_slot.get((s, r), 0)
            rep_p = sub_p_by_shard[s] - sub_p_by_slot.get((s, r), 0)
            per_rank[r * N + s] = fwd_b * (2 if bwd else 1) + red + (rep_r + rep_p if R > 1 else 0)
    fwd_total = R * broadcast_nbytes(total_b, N)
    red_total = R * reduce_nbytes(total_r, N)
    rep_red_total = reduce_nbytes(sum(sub_r_by_slot.values()), R)
    rep_bc_total = broadcast_nbytes(sum(sub_p_by_slot.values()), R)
    return ByteCost(
        forward_broadcast_nbytes=fwd_total,
        backward_broadcast_nbytes=fwd_total if bwd else 0,
        reduce_nbytes=red_total,
        replicate_reduce_nbytes=rep_red_total,
        replicate_broadcast_nbytes=rep_bc_total,
        total_nbytes=fwd_total * (2 if bwd else 1) + red_total + rep_red_total + rep_bc_total,
        per_rank_nbytes=tuple(per_rank),
    )


def rank_stats(
    params: Sequence[ParamSpec],
    owners: Sequence[Owner],
    boundaries: Sequence[Boundary],
    cost: ByteCost,
    *,
    mesh_shape: tuple[int, int],
    reshard_after_forward: bool,
    param_dtype: str | None,
) -> tuple[RankStats, ...]:
    """Per-rank :class:`RankStats` of a DMuon plan (definitions on the record)."""
    R, N = mesh_shape
    world = R * N
    owned_numel = [0] * world
    owned_nbytes = [0] * world
    flops = [0] * world
    replica_nbytes_by_shard = [0] * N  # params with owner shard s, any replicate: held by every (s, r')
    for spec, owner in zip(params, owners):
        nbytes = spec.numel * itemsize_nbytes(spec.dtype)
        owned_numel[owner.rank] += spec.numel
        owned_nbytes[owner.rank] += nbytes
        flops[owner.rank] += ns_flops(*spec.matrix_shape, num_matrices=spec.num_matrices)
        replica_nbytes_by_shard[owner.shard] += nbytes

    transient = [0] * world
    for boundary in boundaries:
        b_total = 0
        local_by_shard = [0] * N  # the shard's own segment: owned masters or HSDP replicas
        for buf in boundary.buffers:
            isz = itemsize_nbytes(bcast_dtype(buf.dtype, param_dtype))
            b_total += buf.numel * isz
            for seg in buf.segments:
                local_by_shard[seg.shard] += seg.numel * isz
        for rank in range(world):
            here = b_total - local_by_shard[rank % N]
            transient[rank] = max(transient[rank], here) if reshard_after_forward else transient[rank] + here

    out = []
    for rank in range(world):
        s = rank % N
        params_held = replica_nbytes_by_shard[s] if R > 1 else owned_nbytes[rank]
        out.append(
            RankStats(
                rank=rank,
                owned_numel=owned_numel[rank],
                owned_nbytes=owned_nbytes[rank],
                resident_nbytes=params_held + owned_nbytes[rank],
                peak_transient_nbytes=transient[rank],
                comm_nbytes=cost.per_rank_nbytes[rank],
                ns_flops=flops[rank],
            )
        )
    return tuple(out)


# --------------------------------------------------------------------------- baseline


def baseline_byte_cost(
    params: Sequence[ParamSpec],
    *,
    mesh_shape: tuple[int, int],
    reshard_after_forward: bool,
    param_dtype: str | None,
    reduce_dtype_: str | None,
) -> BaselineByteCost:
    """:class:`BaselineByteCost`: FSDP2 (HSDP if ``R > 1``) + naive all-gather Muon, same params.

    Every rank is charged the same (the per-rank column of the module docstring table).
    """
    R, N = mesh_shape
    ag = rs = ar = mu = 0  # per rank
    for spec in params:
        c = fsdp2_shard_numel(spec.shape, N)
        isz_p = itemsize_nbytes(spec.dtype)
        isz_b = itemsize_nbytes(bcast_dtype(spec.dtype, param_dtype))
        isz_r = itemsize_nbytes(reduce_dtype(spec.dtype, param_dtype, reduce_dtype_))
        ag += (N - 1) * c * isz_b
        rs += (N - 1) * c * isz_r
        ar += 2 * (R - 1) * (-(-c // R)) * isz_r
        mu += (N - 1) * c * isz_p
    world = R * N
    bwd = ag if reshard_after_forward else 0
    per = ag + bwd + rs + ar + mu
    return BaselineByteCost(
        forward_all_gather_nbytes=ag * world,
        backward_all_gather_nbytes=bwd * world,
        reduce_scatter_nbytes=rs * world,
        replicate_all_reduce_nbytes=ar * world,
        muon_all_gather_nbytes=mu * world,
        total_nbytes=per * world,
        per_rank_nbytes=(per,) * world,
    )


def baseline_rank_stats(
    params: Sequence[ParamSpec],
    boundary_of: Callable[[str], str],
    cost: BaselineByteCost,
    *,
    mesh_shape: tuple[int, int],
    reshard_after_forward: bool,
    param_dtype: str | None,
) -> tuple[RankStats, ...]:
    """Per-rank :class:`RankStats` of the baseline (identical on every rank)."""
    R, N = mesh_shape
    shard_numel = 0
    shard_nbytes = 0
    layer_other_nbytes: dict[str, int] = {}
    max_grad_gather_nbytes = 0
    for spec in params:
        c = fsdp2_shard_numel(spec.shape, N)
        isz_p = itemsize_nbytes(spec.dtype)
        shard_numel += c
        shard_nbytes += c * isz_p
        b = boundary_of(spec.fqn)
        layer_other_nbytes[b] = layer_other_nbytes.get(b, 0) + (N - 1) * c * itemsize_nbytes(
            bcast_dtype(spec.dtype, param_dtype)
        )
        max_grad_gather_nbytes = max(max_grad_gather_nbytes, (N - 1) * c * isz_p)
    if reshard_after_forward:
        unsharded = max(layer_other_nbytes.values(), default=0)
    else:
        unsharded = sum(layer_other_nbytes.values())
    total_flops = sum(ns_flops(*p.matrix_shape, num_matrices=p.num_matrices) for p in params)
    return tuple(
        RankStats(
            rank=rank,
            owned_numel=shard_numel,
            owned_nbytes=shard_nbytes,
            resident_nbytes=2 * shard_nbytes,
            peak_transient_nbytes=max(unsharded, max_grad_gather_nbytes),
            comm_nbytes=cost.per_rank_nbytes[rank],
            ns_flops=total_flops,
        )
        for rank in range(R * N)
    )
