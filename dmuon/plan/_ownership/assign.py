"""Who owns each dedicated parameter (stage 2 of the planner): :func:`assign_owners` runs the
constrained LPT of :mod:`dmuon.plan._ownership.partition` per matrix class: one owner per matrix,
owner groups (``compile(owner_groups=...)``), expert stacks cut into ranges of experts, and the
expert-parallel ranges owned inside efsdp groups (:func:`assign_ep_owners`).
"""

from __future__ import annotations

from fractions import Fraction
from typing import Any

from dmuon.plan import _rules as _rules
from dmuon.plan._cost import weights as _weights
from dmuon.plan._model.expert_ranges import expert_max_split, expert_range_count, expert_range_weights
from dmuon.plan._ownership.level_fill import fill_rows, item_rows
from dmuon.plan._ownership.partition import lpt_partition, lpt_partition_groups
from dmuon.plan._records.owners import ExpertOwners, Owner, OwnerGroup, balanced_sizes

__all__ = ["assign_owners", "assign_ep_owners", "fills_expert_ranges", "expert_owner"]


def assign_owners(
    specs, boundaries, mesh_shape, cost_model, owner_groups, tp_size, qk_clip, segment_lengths, initial_loads=None
):
    """The owner (constrained LPT, :func:`~dmuon.plan._ownership.partition.lpt_partition`), owner group or
    expert owners (:func:`~dmuon.plan._ownership.partition.lpt_partition_groups`) of every dedicated
    parameter.

    Expert stacks (``ParamSpec.experts``) without expert parallelism and with one owner per
    dense matrix (:func:`fills_expert_ranges`, the default plans): the dense matrices by the
    constrained LPT, then the stacks' experts fill every rank to one water level in plan order
    (:func:`~dmuon.plan._ownership.level_fill.fill_ranges`): each rank owns the mean within one
    expert unless its dense matrices alone exceed it, and a boundary's stacks span few ranks
    (contiguous ranges on consecutive ranks). On HSDP meshes whole matrices and stacks go to
    replicate rows first (:func:`~dmuon.plan._ownership.level_fill.item_rows`), then each row is
    placed and filled on its own.

    Otherwise (owner groups): a stack of ``E`` experts is cut into
    :func:`~dmuon.plan._model.expert_ranges.expert_range_count` contiguous ranges of experts (ranges of
    at most ``g`` experts, ``g`` the most whose weight stays within
    :data:`~dmuon.plan._rules.EXPERT_RANGE_SLACK` of the mean slot weight; at most ``min(E, N)``),
    each an LPT item of its own placed together with the dense matrices (on distinct shard
    ranks of one replicate row, as an owner group's blocks): :class:`ExpertOwners`. An expert-parallel
    stack (owned locally, ``ep = N``) keeps ``N`` ranges.

    ``initial_loads``: ``{"numel": [...], cost_model: [...]}``, per slot, weight placed before
    (the expert-parallel ranges of :func:`assign_ep_owners`), in elements (what "auto" owner
    groups are sized by) and in the cost model's unit (what they are placed by); None: none."""
    R, N = mesh_shape
    if isinstance(owner_groups, bool) or not (
        owner_groups in _rules.OWNER_GROUP_MODES or (isinstance(owner_groups, int) and owner_groups >= 1)
    ):
        raise ValueError(
            f"owner_groups must be one of {_rules.OWNER_GROUP_MODES} or an int k >= 1, got {owner_groups!r}"
        )
    ep = max((spec.ep_size for spec in specs), default=1)
    if ep > 1 and (N // ep > 1 or R > 1):
        return assign_ep_owners(
            specs, boundaries, mesh_shape, ep, cost_model, owner_groups, tp_size, qk_clip, segment_lengths
        )
    weights = [_weights.param_weight(spec, cost_model) for spec in specs]
    keys = [spec.fqn for spec in specs]
    initial = initial_loads or {}
    total = sum(weights) + sum(initial.get(cost_model, ()))
    mean = Fraction(total, R * N)
    expert_split = [
        1
        if spec.experts is None
        else expert_max_split(spec.num_experts, N)
        if spec.ep_size > 1  # local experts: one range per rank
        else expert_range_count(spec.num_experts, N, w // spec.num_experts, mean, _rules.EXPERT_RANGE_SLACK)
        for spec, w in zip(specs, weights)
    ]
    if owner_groups in ("off", 1) and max(expert_split, default=1) == 1 and not initial:
        result = lpt_partition(weights, keys, boundaries, num_shards=N, num_replicas=R)
        return tuple(Owner.at(slot, N) for slot in result.slots)
    if _fills(specs, mesh_shape, owner_groups, initial):
        return _filled_owners(specs, weights, keys, boundaries, mesh_shape)
    if tp_size > 1 and owner_groups not in ("off", 1):
        raise ValueError(
            f"dmuon.plan._compile: owner_groups={owner_groups!r} with tensor parallelism (T={tp_size}) is not "
            "supported: a TP-sharded matrix is already orthogonalised by its TP group, and an owner group of TP "
            "groups is not implemented; use owner_groups='off' with TP"
        )

    def pieces(i: int, k: int, model: str) -> tuple[int, ...]:
        spec = specs[i]
        if spec.experts is not None:  # every expert of a stack weighs the same
            return expert_range_weights(_weights.param_weight(spec, model) // spec.num_experts, spec.num_experts, k)
        return _weights.owner_group_piece_weights(spec, k, model, segment_lengths)

    if owner_groups in ("off", 1):
        max_split, split = expert_split, N  # forced: each stack gets its expert_range_count ranges, matrices one owner
    else:
        clipped = set()
        if qk_clip is not None:  # QK-clip rescales whole W_q / W_k rows on their owner
            clipped = {rows.fqn for att in qk_clip.attention for rows in (att.q, att.k)}
        max_split = [1 if spec.fqn in clipped else _rules.owner_group_max_split(spec, N) for spec in specs]
        split = owner_groups
        has_stacks = max(expert_split, default=1) > 1
        if owner_groups == "auto" and (cost_model != "numel" or has_stacks):
            # "auto" sizes the groups by elements, what they exist for (memory, ranks owning
            # nothing), then places them by the cost model: a member's share of Gram NS does not
            # shrink like 1/k (the (d, d) part runs on every member), so sizing by NS FLOPs alone
            # would cut square matrices across every rank and raise the busiest rank's FLOPs
            sizing = lpt_partition_groups(
                [spec.numel for spec in specs],
                lambda i, k: pieces(i, k, "numel"),
                [e if e > 1 else m for e, m in zip(expert_split, max_split)],
                keys,
                boundaries,
                num_shards=N,
                num_replicas=R,
                split="auto",
                initial_loads=initial.get("numel"),
            )
            max_split = [len(m) for m in sizing.members]
            split = max(max_split)  # forced: each matrix gets min(split, max_split[i]), its own k
        elif owner_groups != "auto":
            max_split = [min(m, int(owner_groups)) for m in max_split]
        if has_stacks:  # expert stacks always get their expert_range_count ranges; split = the largest k, forced
            max_split = [e if e > 1 else m for e, m in zip(expert_split, max_split)]
            split = max(max_split)
    result = lpt_partition_groups(
        weights,
        lambda i, k: pieces(i, k, cost_model),
        max_split,
        keys,
        boundaries,
        num_shards=N,
        num_replicas=R,
        split=split,
        initial_loads=initial.get(cost_model),
    )
    owners = []
    for spec, members in zip(specs, result.members):
        if len(members) == 1:
            owners.append(Owner.at(members[0], N))
            continue
        if spec.experts is not None and spec.ep_size > 1:
            # expert parallelism: rank j holds (and owns) experts j*E/ep ..; the LPT placed the
            # N equal ranges on N distinct ranks, so fixing them to rank order keeps every load
            owners.append(
                ExpertOwners(
                    members=tuple(Owner.at(slot, N) for slot in range(N)),
                    sizes=(spec.experts.local_experts,) * N,
                    local=True,
                )
            )
            continue
        if spec.experts is not None:
            owners.append(
                ExpertOwners(
                    members=tuple(Owner.at(slot, N) for slot in members),
                    sizes=balanced_sizes(spec.num_experts, len(members)),
                )
            )
            continue
        owners.append(_owner_group(spec, members, N))
    return tuple(owners)


def assign_ep_owners(specs, boundaries, mesh_shape, ep, cost_model, owner_groups, tp_size, qk_clip, segment_lengths):
    """Owners under expert parallelism with ``efsdp = N/ep > 1`` or HSDP replicas (``R > 1``).

    Shard rank ``s`` holds the experts of EP coordinate ``j = s mod ep`` (EP groups are ``ep``
    consecutive shard ranks); the ``efsdp`` ranks ``j, j+ep, j+2ep, ...`` of a replicate row (its
    *efsdp group*) hold the same ``E/ep`` experts and split their ownership.

    1. The stacks first: each stack's ``E/ep`` local experts are cut into ``k = min(E/ep,
       efsdp)`` contiguous ranges (:func:`~dmuon.plan._records.owners.balanced_sizes`), placed by the
       constrained LPT (:func:`~dmuon.plan._ownership.partition.lpt_partition_groups`) on ``k`` distinct
       efsdp indices ``i`` of one replicate row ``r``, the slots being ``(r, i)``. Every EP
       coordinate ``j`` uses the same placement, so range ``q`` of coordinate ``j`` is owned by
       shard ``j + i_q*ep`` of row ``r`` and every rank of an EP group carries the same load.
    2. Then the dense matrices, by :func:`assign_owners` over the ``R*N`` slots with the
       stacks' loads as its ``initial_loads`` (owner groups as requested).

    The :class:`ExpertOwners` lists the ranges in global expert order (coordinate-major), so
    ``per_expert()`` is the owner of every global expert.
    """
    R, N = mesh_shape
    efsdp = N // ep
    stack_idx = [i for i, spec in enumerate(specs) if spec.experts is not None]
    dense_idx = [i for i, spec in enumerate(specs) if spec.experts is None]
    per_expert = {i: _weights.param_weight(specs[i], cost_model) // specs[i].num_experts for i in stack_idx}
    local = {i: specs[i].experts.local_experts for i in stack_idx}
    ks = [min(local[i], efsdp) for i in stack_idx]
    placed = lpt_partition_groups(
        [per_expert[i] * local[i] for i in stack_idx],
        lambda n, k: expert_range_weights(per_expert[stack_idx[n]], local[stack_idx[n]], k),
        ks,
        [specs[i].fqn for i in stack_idx],
        [boundaries[i] for i in stack_idx],
        num_shards=efsdp,
        num_replicas=R,
        split=max(ks),
    )
    owners: list[Any] = [None] * len(specs)
    for n, i in enumerate(stack_idx):
        slots = placed.members[n]
        sizes = balanced_sizes(local[i], len(slots))
        if len(set(sizes)) == 1:  # equal ranges: in efsdp order (same loads), so single-expert
            slots = sorted(slots)  # ranges sit in consecutive slots of an all-gather (in place)
        members = tuple(Owner.at((slot // efsdp) * N + j + (slot % efsdp) * ep, N) for j in range(ep) for slot in slots)
        owners[i] = ExpertOwners(members=members, sizes=tuple(sizes) * ep)
    if dense_idx:
        initial = {"numel": [0] * (R * N), cost_model: [0] * (R * N)}
        for i in stack_idx:
            for model, loads in initial.items():
                per = _weights.param_weight(specs[i], model) // specs[i].num_experts
                for member, size in zip(owners[i].members, owners[i].sizes):
                    loads[member.rank] += per * size
        sub = assign_owners(
            tuple(specs[i] for i in dense_idx),
            [boundaries[i] for i in dense_idx],
            mesh_shape,
            cost_model,
            owner_groups,
            tp_size,
            qk_clip,
            segment_lengths,
            initial_loads=initial,
        )
        for i, owner in zip(dense_idx, sub):
            owners[i] = owner
    return tuple(owners)


def _owner_group(spec, members, N: int) -> OwnerGroup:
    """The :class:`OwnerGroup` of a dense matrix on LPT ``members`` (slots): its long side cut
    into balanced blocks, block ``j`` on member ``j``."""
    dim = _rules.owner_group_dim(spec.shape)
    return OwnerGroup(
        members=tuple(Owner.at(slot, N) for slot in members),
        dim=dim,
        sizes=balanced_sizes(int(spec.shape[dim]), len(members)),
    )


def fills_expert_ranges(specs, mesh_shape, owner_groups) -> bool:
    """Whether :func:`assign_owners` places the expert stacks by the balanced fill
    (:mod:`dmuon.plan._ownership.level_fill`): one owner per dense matrix, no expert
    parallelism, at least one stack (on HSDP meshes whole stacks per replicate row,
    :func:`~dmuon.plan._ownership.level_fill.fill_rows`)."""
    return (
        owner_groups in ("off", 1)
        and any(spec.experts is not None for spec in specs)
        and all(spec.ep_size == 1 for spec in specs)
    )


def _fills(specs, mesh_shape, owner_groups, initial) -> bool:
    return not initial and fills_expert_ranges(specs, mesh_shape, owner_groups)


def expert_owner(ranges, N: int):
    """The owner record of a stack cut into ``ranges`` ``[(slot, experts), ...]`` (expert order):
    a plain :class:`Owner` for one range, else :class:`ExpertOwners`."""
    members = tuple(Owner.at(slot, N) for slot, _ in ranges)
    if len(members) == 1:
        return members[0]
    return ExpertOwners(members=members, sizes=tuple(c for _, c in ranges))


def _filled_owners(specs, weights, keys, boundaries, mesh_shape):
    """Every whole matrix or stack to a replicate row by LPT
    (:func:`~dmuon.plan._ownership.level_fill.item_rows`; one row: row 0), each row's dense
    matrices by the constrained LPT over its slots, then each row's stacks filled to one level
    (:func:`~dmuon.plan._ownership.level_fill.fill_rows`, plan order)."""
    R, N = mesh_shape
    dense = [i for i, spec in enumerate(specs) if spec.experts is None]
    stacks = [i for i, spec in enumerate(specs) if spec.experts is not None]
    row_of = item_rows(weights, R)
    owners: list[Any] = [None] * len(specs)
    loads = [0] * (R * N)
    for r in range(R):
        mine = [i for i in dense if row_of[i] == r]
        if not mine:
            continue
        result = lpt_partition(
            [weights[i] for i in mine], [keys[i] for i in mine], [boundaries[i] for i in mine], num_shards=N
        )
        for i, s in zip(mine, result.slots):
            owners[i] = Owner.at(r * N + s, N)
            loads[r * N + s] += weights[i]
    ranges, _ = fill_rows(
        [(weights[i] // specs[i].num_experts, specs[i].num_experts) for i in stacks],
        loads,
        R,
        [row_of[i] for i in stacks],
    )
    for i, rng in zip(stacks, ranges):
        owners[i] = expert_owner(rng, N)
    return tuple(owners)
