"""LPT weights: what a dedicated parameter (or each member of its owner group / expert ranges)
weighs under ``cost_model`` (``"numel"``: elements; ``"ns_flops"``: the Newton-Schulz FLOPs of
:mod:`dmuon.plan._cost.flops`), for the partition and the plan's load figures.
"""

from __future__ import annotations

from collections.abc import Sequence

from dmuon.plan._cost.flops import gram_ns_segment_flops, spec_ns_flops
from dmuon.plan._records.owners import ExpertOwners, Owner, OwnerGroup, balanced_sizes
from dmuon.plan._records.params import ParamSpec
from dmuon.plan._rules import COST_MODELS, owner_group_dim

__all__ = [
    "param_weight",
    "owner_group_piece_weights",
    "member_weights",
    "owner_weights",
]


def param_weight(spec: ParamSpec, cost_model: str) -> int:
    """LPT weight of a dedicated parameter: ``numel`` (elements) or :func:`spec_ns_flops` (the
    FLOPs of the backend it runs).

    Raises:
        ValueError: unknown ``cost_model``.
    """
    if cost_model == "numel":
        return spec.numel
    if cost_model == "ns_flops":
        return spec_ns_flops(spec)
    raise ValueError(f"cost_model must be one of {COST_MODELS}, got {cost_model!r}")


# --------------------------------------------------------------------------- owner groups


def owner_group_piece_weights(
    spec: ParamSpec, k: int, cost_model: str, segment_lengths: Sequence[int]
) -> tuple[int, ...]:
    """LPT weight of each member of a ``k``-member owner group of ``spec``, block order (blocks
    of :func:`~dmuon.plan._records.owners.balanced_sizes` along :func:`owner_group_dim`); ``k = 1``:
    ``(param_weight(spec),)``.

    ``"numel"``: the block's elements. ``"ns_flops"``: the member's share of sharded Gram NS,
    :func:`gram_ns_segment_flops` of ``(d, D_j)`` with ``d`` the short side and ``D_j`` the
    block's long side: the local Gram and ``Q·X_j`` scale with the block, the ``(d, d)``
    iteration runs on every member (so splitting a matrix ``k`` ways costs ``k·(8L-6)·d³``
    more in total per segment). Every member's block enters NS padded with zeros to the
    largest block, ``D_j = ceil(L/k)`` (zero columns add nothing to the Gram and stay zero),
    so members of one group batch identically; the FLOPs are of that width.
    """
    if k == 1:
        return (param_weight(spec, cost_model),)
    dim = owner_group_dim(spec.shape)
    return member_weights(spec, dim, balanced_sizes(int(spec.shape[dim]), k), cost_model, segment_lengths)


def member_weights(
    spec: ParamSpec, dim: int, sizes: Sequence[int], cost_model: str, segment_lengths: Sequence[int]
) -> tuple[int, ...]:
    """LPT weight of each member of an owner group cutting ``spec`` along ``dim`` into blocks of
    ``sizes`` (:func:`owner_group_piece_weights` has the rule)."""
    other = int(spec.shape[1 - dim])
    if cost_model == "numel":
        return tuple(size * other for size in sizes)
    if cost_model == "ns_flops":  # every member runs the padded block width (exec: one batch shape per group)
        return (gram_ns_segment_flops(other, max(sizes), segment_lengths),) * len(sizes)
    raise ValueError(f"cost_model must be one of {COST_MODELS}, got {cost_model!r}")


def owner_weights(
    spec: ParamSpec, owner: Owner | OwnerGroup, cost_model: str, segment_lengths: Sequence[int]
) -> tuple[tuple[int, int], ...]:
    """``(mesh rank, weight)`` of every owner of ``spec``: one pair for an :class:`Owner`, one per
    member of an :class:`OwnerGroup` (:func:`member_weights` of the group's own blocks), one per
    member of an :class:`ExpertOwners` (its experts' share of the stack's weight)."""
    if isinstance(owner, ExpertOwners):
        per_expert = param_weight(spec, cost_model) // spec.num_experts
        return tuple((rank, per_expert * size) for rank, size in zip(owner.ranks, owner.sizes))
    if isinstance(owner, OwnerGroup):
        return tuple(zip(owner.ranks, member_weights(spec, owner.dim, owner.sizes, cost_model, segment_lengths)))
    return ((owner.rank, param_weight(spec, cost_model)),)
