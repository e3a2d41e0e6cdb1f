r"""The baseline: FSDP2 + naive all-gather Muon on the same parameters, its bytes per step
(:func:`baseline_byte_cost`) and per-rank figures (:func:`baseline_rank_stats`).

Its bytes per collective, per step and per rank: Note: the FSDP2 + naive Muon baseline
(docs/design.md).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from dmuon.plan._cost.flops import spec_ns_flops
from dmuon.plan._cost.cost_model import BaselineByteCost, RankStats
from dmuon.plan._cost.nbytes import fsdp2_shard_numel
from dmuon.plan._records.fields import itemsize_nbytes
from dmuon.plan._records.params import ParamSpec
from dmuon.plan._rules import bcast_dtype, reduce_dtype

__all__ = [
    "baseline_byte_cost",
    "baseline_rank_stats",
    "is_expert_stack",
    "fsdp2_param_shard",
    "spec_fsdp2_shard",
    "fsdp2_unsharded_nbytes",
    "baseline_reshard_after_forward",
]


def baseline_reshard_after_forward(variant: str, plan: Any, override: bool | None = None) -> bool:
    """FSDP2's ``reshard_after_forward`` in a baseline ``variant``: ``True`` for ``"adamw"`` (the
    floor as usually deployed), the plan's own for ``"naive"`` / ``"all_to_all"``; ``override``,
    where given, wins (a pipelined baseline runs ``False``, as torchtitan sets it under PP)."""
    if override is not None:
        return override
    return True if variant == "adamw" else plan.reshard_after_forward


def is_expert_stack(fqn: str, shape: Sequence[int]) -> bool:
    """A 3-D parameter whose FQN names an expert (``...experts.gate_up_proj``, torchtitan's
    ``moe.experts.w1``): the expert stacks FSDP2 places as torchtitan does
    (:func:`~dmuon.plan._cost.nbytes.fsdp2_shard_numel` with ``expert_stack=True``), the stacks
    ``dmuon.plan._model.parallel.expert_parallel_variant`` cuts and the simulator's workload prices
    at ``top_k / E`` of their FLOPs."""
    return len(shape) == 3 and "expert" in fqn


def fsdp2_param_shard(
    fqn: str, shape: Sequence[int], num_shards: int, *, ep: int = 1, expert_stack: bool | None = None
) -> tuple[int, int]:
    """``(k, numel)``: the FSDP2 group size and shard elements of parameter ``fqn`` of local
    ``shape`` (one TP rank's shard, or one EP rank's experts) when FSDP2 + AdamW (or a naive
    Muon) runs the same model on ``num_shards`` shard ranks with expert parallelism ``ep``: an
    expert stack (``expert_stack``, default :func:`is_expert_stack`) over its efsdp group of
    ``k = num_shards / ep`` ranks (torchtitan's ``edp`` mesh; ``k = 1``: FSDP2 moves nothing for
    it), everything else over all ``num_shards``; ``numel`` by :func:`~dmuon.plan._cost.nbytes.fsdp2_shard_numel`."""
    stack = is_expert_stack(fqn, shape) if expert_stack is None else expert_stack
    k = num_shards // ep if stack and ep > 1 else num_shards
    return k, fsdp2_shard_numel(shape, k, expert_stack=stack)


def spec_fsdp2_shard(spec: ParamSpec, num_shards: int) -> tuple[int, int]:
    """:func:`fsdp2_param_shard` of a dedicated parameter: its local shape, its EP degree; an
    expert stack if the plan recognised one (``spec.experts``) or :func:`is_expert_stack`."""
    stack = spec.experts is not None or is_expert_stack(spec.fqn, spec.shape)
    return fsdp2_param_shard(spec.fqn, spec.local_shape, num_shards, ep=spec.ep_size, expert_stack=stack)


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

    Every rank is charged the same (the per-rank column of the table in Note: the FSDP2 + naive Muon
    baseline, docs/design.md). With
    TP (``tp_size = T > 1``), FSDP2 shards each TP rank's local shard over the data-parallel
    mesh, ``R*N*T`` ranks, and a naive Muon, once it holds its TP shard's full gradient, must
    all-gather the ``T`` shards of every TP-sharded matrix to orthogonalise it:
    ``(T-1) * local_numel * isz_param`` per rank (``S*(T-1)/T`` of the matrix's ``S`` bytes,
    the all-gather charge), ``tp_all_gather_nbytes`` in total.
    """
    R, N = mesh_shape
    ag = rs = ar = mu = tg = 0  # per rank
    for spec in params:
        k, c = spec_fsdp2_shard(spec, N)
        isz_p = itemsize_nbytes(spec.dtype)
        isz_b = itemsize_nbytes(bcast_dtype(spec.dtype, param_dtype))
        isz_r = itemsize_nbytes(reduce_dtype(spec.dtype, param_dtype, reduce_dtype_))
        ag += (k - 1) * c * isz_b
        rs += (k - 1) * c * isz_r
        ar += 2 * (R - 1) * (-(-c // R)) * isz_r
        mu += (k - 1) * c * isz_p
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


def fsdp2_unsharded_nbytes(
    params: Sequence[ParamSpec],
    boundary_of: Callable[[str], str],
    mesh_shape: tuple[int, int],
    reshard_after_forward: bool,
    param_dtype: str | None,
) -> int:
    """FSDP2's unsharded parameters of ``params`` one rank holds at once beyond its own shards,
    broadcast dtype: per boundary ``sum (k - 1) * shard`` over its parameters (the unit minus
    the rank's shard); Z3 the largest boundary, Z2 the sum."""
    N = mesh_shape[1]
    layer_other_nbytes: dict[str, int] = {}
    for spec in params:
        k, c = spec_fsdp2_shard(spec, N)
        b = boundary_of(spec.fqn)
        layer_other_nbytes[b] = layer_other_nbytes.get(b, 0) + (k - 1) * c * itemsize_nbytes(
            bcast_dtype(spec.dtype, param_dtype)
        )
    if reshard_after_forward:
        return max(layer_other_nbytes.values(), default=0)
    return sum(layer_other_nbytes.values())


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
    max_grad_gather_nbytes = 0
    for spec in params:
        k, c = spec_fsdp2_shard(spec, N)
        isz_p = itemsize_nbytes(spec.dtype)
        shard_numel += c
        shard_nbytes += c * isz_p
        # the gathered gradient: the TP shard from the data-parallel ranks, then (TP) the matrix
        max_grad_gather_nbytes = max(
            max_grad_gather_nbytes, (k - 1) * c * isz_p + (spec.tp_size - 1) * spec.local_numel * isz_p
        )
    unsharded = fsdp2_unsharded_nbytes(params, boundary_of, mesh_shape, reshard_after_forward, param_dtype)
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
