r"""The baseline: FSDP2 + naive all-gather Muon on the same parameters, its bytes per step
(:func:`baseline_byte_cost`) and per-rank figures (:func:`baseline_rank_stats`).

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
TP all-gather (``T > 1``)  ``R*N*(T-1)*S_full*isz_param``   ``(T-1)*S_full/T*isz_param``
=========================  ===============================  ===================================

With TP, ``d0``/``S`` above are of each TP rank's local shard (every column is per TP
coordinate, ``R*N*T`` ranks) and ``S_full = T*S`` is the whole matrix a naive Muon gathers.

So for Z3 on a 1-D mesh the baseline moves ``4*(N-1)*S`` versus DMuon's ``3*(N-1)*P``
(:mod:`dmuon.plan.cost.model`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from dmuon.plan.cost.flops import spec_ns_flops
from dmuon.plan.cost.model import BaselineByteCost, RankStats
from dmuon.plan.cost.nbytes import fsdp2_shard_numel
from dmuon.plan.records.fields import itemsize_nbytes
from dmuon.plan.records.params import ParamSpec
from dmuon.plan.rules import bcast_dtype, reduce_dtype

__all__ = [
    "baseline_byte_cost",
    "baseline_rank_stats",
]


def baseline_byte_cost(
    params: Sequence[ParamSpec],
    *,
    mesh_shape: tuple[int, int],
    reshard_after_forward: bool,
    param_dtype: str | None,
    reduce_dtype_: str | None,
    tp_size: int = 1,
) -> BaselineByteCost:
    """:class:`BaselineByteCost`: FSDP2 (HSDP if ``R > 1``) + naive all-gather Muon, same params.

    Every rank is charged the same (the per-rank column of the module docstring table). With
    TP (``tp_size = T > 1``), FSDP2 shards each TP rank's local shard over the data-parallel
    mesh, ``R*N*T`` ranks, and a naive Muon, once it holds its TP shard's full gradient, must
    all-gather the ``T`` shards of every TP-sharded matrix to orthogonalise it:
    ``(T-1) * local_numel * isz_param`` per rank (``S*(T-1)/T`` of the matrix's ``S`` bytes,
    the all-gather charge), ``tp_all_gather_nbytes`` in total.
    """
    R, N = mesh_shape
    ag = rs = ar = mu = tg = 0  # per rank
    for spec in params:
        c = fsdp2_shard_numel(spec.local_shape, N)
        isz_p = itemsize_nbytes(spec.dtype)
        isz_b = itemsize_nbytes(bcast_dtype(spec.dtype, param_dtype))
        isz_r = itemsize_nbytes(reduce_dtype(spec.dtype, param_dtype, reduce_dtype_))
        ag += (N - 1) * c * isz_b
        rs += (N - 1) * c * isz_r
        ar += 2 * (R - 1) * (-(-c // R)) * isz_r
        mu += (N - 1) * c * isz_p
        tg += (spec.tp_size - 1) * spec.local_numel * isz_p
    world = R * N * tp_size
    bwd = ag if reshard_after_forward else 0
    per = ag + bwd + rs + ar + mu + tg
    return BaselineByteCost(
        forward_all_gather_nbytes=ag * world,
        backward_all_gather_nbytes=bwd * world,
        reduce_scatter_nbytes=rs * world,
        replicate_all_reduce_nbytes=ar * world,
        muon_all_gather_nbytes=mu * world,
        tp_all_gather_nbytes=tg * world,
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
    tp_size: int = 1,
) -> tuple[RankStats, ...]:
    """Per-rank :class:`RankStats` of the baseline (identical on every rank; ``R*N*T`` ranks)."""
    R, N = mesh_shape
    shard_numel = 0
    shard_nbytes = 0
    layer_other_nbytes: dict[str, int] = {}
    max_grad_gather_nbytes = 0
    for spec in params:
        c = fsdp2_shard_numel(spec.local_shape, N)
        isz_p = itemsize_nbytes(spec.dtype)
        shard_numel += c
        shard_nbytes += c * isz_p
        b = boundary_of(spec.fqn)
        layer_other_nbytes[b] = layer_other_nbytes.get(b, 0) + (N - 1) * c * itemsize_nbytes(
            bcast_dtype(spec.dtype, param_dtype)
        )
        # the gathered gradient: the TP shard from the data-parallel ranks, then (TP) the matrix
        max_grad_gather_nbytes = max(
            max_grad_gather_nbytes, (N - 1) * c * isz_p + (spec.tp_size - 1) * spec.local_numel * isz_p
        )
    if reshard_after_forward:
        unsharded = max(layer_other_nbytes.values(), default=0)
    else:
        unsharded = sum(layer_other_nbytes.values())
    total_flops = sum(spec_ns_flops(p) for p in params)
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
        for rank in range(R * N * tp_size)
    )
