"""Who owns a dedicated parameter: :class:`Owner` (one mesh rank), :class:`OwnerGroup` (``k``
ranks sharing one matrix's blocks), :class:`ExpertOwners` (one rank per range of an expert
stack's experts), and the block arithmetic they share (:func:`balanced_sizes`).

Every record here is a frozen dataclass (``slots=True, kw_only=True``) holding only ints,
strings and tuples, validated once in ``__post_init__``; derive new ones with
:func:`dataclasses.replace` (which re-validates). They are optree *leaves* of a
:class:`~dmuon.plan._records.plan.ShardingPlan` (see ``plan.py`` for the tree registration).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from dmuon.plan._records.fields import _check_int

__all__ = [
    "Owner",
    "OwnerGroup",
    "ExpertOwners",
    "balanced_sizes",
    "owner_from_dict",
    "owner_ranks",
]


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Owner:
    """The single mesh rank that owns a dedicated parameter.

    Attributes:
        shard: coordinate along the shard mesh dimension, ``0 <= shard < N``.
        replicate: coordinate along the replicate dimension, ``0 <= replicate < R`` (0 on a 1-D mesh).
        rank: flat mesh rank ``replicate * N + shard`` (the layout of
            ``init_device_mesh(device, (R, N), mesh_dim_names=("replicate", "shard"))``).

    The invariant ``rank == replicate * N + shard`` needs N, which an Owner does not carry; the
    plan checks it (:class:`~dmuon.plan._records.plan.ShardingPlan` validation) and :meth:`at` builds it.
    """

    shard: int
    replicate: int
    rank: int

    def __post_init__(self) -> None:
        _check_int("Owner", "shard", self.shard, 0)
        _check_int("Owner", "replicate", self.replicate, 0)
        _check_int("Owner", "rank", self.rank, 0)
        if self.rank < self.shard or self.rank < self.replicate:
            raise ValueError(f"Owner.rank {self.rank} cannot be below shard/replicate coordinates: {self}")

    @classmethod
    def at(cls, slot: int, num_shards: int) -> Owner:
        """Owner of flat slot ``slot`` on a mesh with ``num_shards`` (N) shard ranks."""
        return cls(shard=slot % num_shards, replicate=slot // num_shards, rank=slot)

    def to_dict(self) -> dict[str, int]:
        return {"shard": self.shard, "replicate": self.replicate, "rank": self.rank}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Owner:
        return cls(shard=d["shard"], replicate=d["replicate"], rank=d["rank"])


def _offsets(sizes: tuple[int, ...]) -> tuple[int, ...]:
    """Start of each of consecutive blocks of ``sizes``: ``(3, 3, 2) -> (0, 3, 6)``."""
    out, at = [], 0
    for s in sizes:
        out.append(at)
        at += s
    return tuple(out)


def balanced_sizes(length: int, k: int) -> tuple[int, ...]:
    """``length`` cut into ``k`` consecutive blocks as evenly as possible, the first
    ``length % k`` one longer: ``balanced_sizes(10, 4) == (3, 3, 2, 2)``. ``1 <= k <= length``."""
    if not 1 <= k <= length:
        raise ValueError(f"cannot cut {length} into {k} non-empty blocks")
    q, extra = divmod(length, k)
    return tuple(q + 1 if j < extra else q for j in range(k))


class _Blocks:
    """What :class:`OwnerGroup` and :class:`ExpertOwners` share: ``members`` (one per block, block
    order; one replicate coordinate, distinct shard coordinates, checked by :func:`_check_members`)
    and ``sizes`` (block lengths along the cut dim)."""

    __slots__ = ()

    @property
    def k(self) -> int:
        """Members (blocks / expert ranges)."""
        return len(self.members)

    @property
    def replicate(self) -> int:
        return self.members[0].replicate

    @property
    def ranks(self) -> tuple[int, ...]:
        """Mesh ranks of the members, block order."""
        return tuple(o.rank for o in self.members)

    def offsets(self) -> tuple[int, ...]:
        """Start of each block along the cut dim."""
        return _offsets(self.sizes)

    def block_of(self, owner: Owner) -> int | None:
        """Index of the block ``owner`` holds, or None."""
        for j, o in enumerate(self.members):
            if o == owner:
                return j
        return None


def _check_members(record: str, members, sizes) -> None:
    """The :class:`_Blocks` invariants: >= 2 Owners in one replicate row on distinct shard
    coordinates, one size >= 1 per member."""
    if type(members) is not tuple or len(members) < 2:
        raise ValueError(f"{record}.members must be a tuple of >= 2 Owners, got {members!r}")
    if any(not isinstance(o, Owner) for o in members):
        raise TypeError(f"{record}.members must hold Owner records")
    if len({o.replicate for o in members}) != 1:
        raise ValueError(f"{record} members must share one replicate coordinate, got {members}")
    if len({o.shard for o in members}) != len(members):
        raise ValueError(f"{record} members must have distinct shard coordinates, got {members}")
    if type(sizes) is not tuple or len(sizes) != len(members):
        raise ValueError(f"{record}.sizes must be a tuple with one size per member, got {sizes!r}")
    for v in sizes:
        _check_int(record, "sizes[i]", v, 1)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class OwnerGroup(_Blocks):
    """The ``k >= 2`` mesh ranks that own one dedicated matrix together (an *owner group*).

    The matrix ``(m, n)`` is cut along its long side ``dim`` into ``k`` consecutive blocks of
    ``sizes`` (``dim=0``: row blocks ``(sizes[j], n)`` of a tall matrix; ``dim=1``: column
    blocks ``(m, sizes[j])`` of a wide one); member ``j`` holds block ``j`` of the master and of
    the momentum, receives block ``j`` of the averaged gradient and broadcasts it to its shard
    peers. Newton-Schulz runs sharded over the group: Gram NS on the short side ``d``, one fp32
    ``(d, d)`` all-reduce per Gram segment (``ShardingPlan.tp_ns_steps`` /
    ``tp_gram_restart_every``, as for tensor parallelism), each member updating its block.

    Attributes:
        members: the owners of the blocks, block order: one replicate coordinate, distinct
            shard coordinates (ascending is not required).
        dim: 0 (row blocks) or 1 (column blocks), the long side (``m >= n`` cuts rows).
        sizes: rows (``dim=0``) or columns (``dim=1``) of each block, each >= 1, ``len == k``.
    """

    members: tuple[Owner, ...]
    dim: int
    sizes: tuple[int, ...]

    def __post_init__(self) -> None:
        _check_members("OwnerGroup", self.members, self.sizes)
        if self.dim not in (0, 1) or type(self.dim) is not int:
            raise ValueError(f"OwnerGroup.dim must be 0 or 1, got {self.dim!r}")

    def block_shape(self, j: int, shape: tuple[int, ...]) -> tuple[int, int]:
        """Shape of block ``j`` of a matrix of 2-D ``shape``."""
        m, n = shape
        return (self.sizes[j], n) if self.dim == 0 else (m, self.sizes[j])

    def to_dict(self) -> dict[str, Any]:
        return {"members": [o.to_dict() for o in self.members], "dim": self.dim, "sizes": list(self.sizes)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> OwnerGroup:
        return cls(members=tuple(Owner.from_dict(o) for o in d["members"]), dim=d["dim"], sizes=tuple(d["sizes"]))


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ExpertOwners(_Blocks):
    """The owners of an expert stack's experts: one owner per contiguous range of experts.

    The stack ``(E, a, b)`` is cut along its expert dim 0 into ``k >= 2`` consecutive ranges of
    ``sizes`` experts; member ``j`` holds range ``j`` of the master and of the momentum,
    receives range ``j`` of the averaged gradient, broadcasts it to its shard peers, and
    orthogonalises each of its experts' matrices on its own (no collective: experts are
    independent Muon matrices, unlike an :class:`OwnerGroup`'s blocks of one matrix). A stack
    whose experts all have one owner has a plain :class:`Owner` instead.

    Attributes:
        members: the owner of each range, range order: one replicate coordinate, distinct
            shard coordinates (on an HSDP mesh the other replicate rows hold every range as
            replicas, as for any owner).
        sizes: experts in each range, each >= 1, ``len == k``, ``sum == E``.
        local: expert parallelism (``compile(ep=...)``, :attr:`ExpertStack.ep_size` ``> 1``):
            the model on each rank holds only its own experts, so member ``j`` is shard rank
            ``j`` and owns exactly the ``sizes[j]`` experts that rank holds (all sizes equal).
            Nothing is broadcast or reduced: no layout entry, the owner's gradient is its local
            one (tokens reach its experts through the model's all-to-all). In JSON only when
            True.

    Expert parallelism with ``efsdp = N/ep > 1`` or HSDP replicas (``local=False``, the stack's
    :attr:`ExpertStack.ep_size` ``> 1``): the ranges are in global expert order, each EP
    coordinate ``j``'s ``E/ep`` experts cut alike into ``k/ep`` ranges owned by members of its
    efsdp group (shard ``= j mod ep``); the plan checks this (``ShardingPlan``).
    """

    members: tuple[Owner, ...]
    sizes: tuple[int, ...]
    local: bool = False

    def __post_init__(self) -> None:
        _check_members("ExpertOwners", self.members, self.sizes)
        if type(self.local) is not bool:
            raise TypeError(f"ExpertOwners.local must be a bool, got {self.local!r}")
        if self.local and (
            tuple(o.shard for o in self.members) != tuple(range(len(self.members))) or len(set(self.sizes)) != 1
        ):
            raise ValueError(
                "ExpertOwners(local=True) (expert parallelism) needs members on shard ranks 0..k-1 in rank order "
                f"and equal sizes (each rank holds E/ep experts), got {self.members} sizes {self.sizes}"
            )

    dim = 0  # class constant (not a field): the ranges cut the expert dim

    @property
    def num_experts(self) -> int:
        return sum(self.sizes)

    def block_shape(self, j: int, shape: tuple[int, ...]) -> tuple[int, ...]:
        """Shape of range ``j`` of a stack of ``shape`` ``(E, a, b)``."""
        return (self.sizes[j],) + tuple(shape[1:])

    def per_expert(self) -> tuple[Owner, ...]:
        """The owner of every expert, expert order (``len == E``)."""
        return tuple(o for o, size in zip(self.members, self.sizes) for _ in range(size))

    def to_dict(self) -> dict[str, Any]:
        local = {"local": True} if self.local else {}  # absent without EP: older plans keep their JSON
        return {"experts": [o.to_dict() for o in self.members], "sizes": list(self.sizes), **local}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ExpertOwners:
        return cls(
            members=tuple(Owner.from_dict(o) for o in d["experts"]),
            sizes=tuple(d["sizes"]),
            local=bool(d.get("local", False)),
        )


def owner_from_dict(d: dict[str, Any]) -> Owner | OwnerGroup | ExpertOwners:
    """An :class:`Owner`, :class:`OwnerGroup` (``"members"`` key) or :class:`ExpertOwners`
    (``"experts"`` key) from its ``to_dict``."""
    if "experts" in d:
        return ExpertOwners.from_dict(d)
    return OwnerGroup.from_dict(d) if "members" in d else Owner.from_dict(d)


def owner_ranks(owner: Owner | OwnerGroup | ExpertOwners) -> tuple[int, ...]:
    """The mesh ranks that own (blocks or experts of) a parameter: one for an :class:`Owner`."""
    return owner.ranks if isinstance(owner, (OwnerGroup, ExpertOwners)) else (owner.rank,)
