"""dmuon's process groups of the data-parallel mesh (and, with tensor parallelism, its TP groups).

Why dmuon has its own groups, how they are cached and how long they live: Note: dmuon's own
process groups (docs/design.md).
"""

from __future__ import annotations

from collections.abc import Sequence

import dataclasses
import weakref
from typing import Any

import torch.distributed as dist

from dmuon.plan import mesh_dim_roles, normalize_mesh

__all__ = ["mesh_rank_table", "mesh_tp_ranks", "MeshGroups", "release_groups", "cached_group_tables"]

# (rank table, backend) -> its groups, in table order; valid under the default group that
# _CACHE_WORLD refers to (weakly: the cache must not keep a destroyed world alive)
_CACHE: dict[tuple[tuple[tuple[int, ...], ...], str], tuple[Any, ...]] = {}
_CACHE_WORLD: weakref.ref | None = None


def _current_cache() -> dict:
    """The cache of the current default group (emptied when that group changed: torch destroyed
    the old groups along with the old default group)."""
    global _CACHE_WORLD
    world = dist.distributed_c10d._get_default_group()
    if _CACHE_WORLD is None or _CACHE_WORLD() is not world:
        _CACHE.clear()
        _CACHE_WORLD = weakref.ref(world)
    return _CACHE


def _groups_for(table: tuple[tuple[int, ...], ...]) -> tuple[Any, ...]:
    """One process group per rank list of ``table`` (``dist.new_group`` in table order), or the
    groups an earlier call made for the same table and backend under this default group.
    Collective: every rank calls it with the same table."""
    cache = _current_cache()
    key = (table, str(dist.get_backend()))
    groups = cache.get(key)
    if groups is None:
        groups = cache[key] = tuple(dist.new_group(ranks=list(members)) for members in table)
    return groups


def cached_group_tables() -> tuple[tuple[tuple[int, ...], ...], ...]:
    """The rank tables whose groups are cached under the current default group (none without one)."""
    if not dist.is_initialized():
        return ()
    return tuple(table for table, _ in _current_cache())


def release_groups() -> int:
    """Destroy every process group dmuon cached under the current default group; returns how many
    this rank destroyed (those it is a member of).

    Call it on every rank at the same point, once no dmuon runtime built on them is used any more
    (a later ``dedicate_params`` creates fresh groups). Not needed before
    ``dist.destroy_process_group()``, which destroys them too.
    """
    global _CACHE_WORLD
    if not dist.is_initialized():
        _CACHE.clear()
        _CACHE_WORLD = None
        return 0
    cache = _current_cache()
    doomed = [g for groups in cache.values() for g in groups]
    cache.clear()
    n = 0
    for g in reversed(doomed):  # reverse creation order on every rank, as torch's own teardown
        if g is not None and g != dist.GroupMember.NON_GROUP_MEMBER:
            dist.destroy_process_group(g)
            n += 1
    return n


def mesh_rank_table(
    mesh, *, shard_dim: str | None = None, replicate_dim: str | None = None, tp_dim: str | None = None
) -> tuple[tuple[int, ...], ...]:
    """Global ranks of this rank's data-parallel mesh as ``table[replicate][shard]`` (R rows of N).

    ``mesh``: ``None`` (1-D over the world); an int ``N`` or ``(N,)`` (1-D over ranks ``0..N-1``);
    ``(R, N)`` (ranks ``r·N + s``, the layout of ``init_device_mesh(..., (R, N))``); or a
    ``DeviceMesh`` of 1 to 3 dims whose roles :func:`dmuon.plan.mesh_dim_roles` finds (by name,
    ``shard_dim`` / ``replicate_dim`` / ``tp_dim`` override; an unnamed 2-D mesh is
    ``(replicate, shard)``). A mesh with a TP dim, e.g. torchtitan's unsliced
    ``("dp_replicate", "dp_shard", "tp")``, gives the data-parallel table of this rank's TP
    coordinate (the same as passing ``mesh["dp_replicate", "dp_shard"]``).

    Raises:
        ValueError: a shape of more than 3 dims, dims whose roles cannot be found, a mesh that
            does not contain this rank, or a mesh whose size differs from the world size when
            given as an int or tuple.
    """
    world = dist.get_world_size()
    if mesh is None:
        if shard_dim is not None or replicate_dim is not None or tp_dim is not None:
            raise ValueError("dmuon: shard_dim / replicate_dim / tp_dim name dims of a DeviceMesh; mesh is None")
        return (tuple(range(world)),)
    if isinstance(mesh, int) or (isinstance(mesh, (tuple, list)) and all(isinstance(d, int) for d in mesh)):
        try:
            R, N = normalize_mesh(mesh)  # the one parser of mesh shapes (dmuon.plan)
        except ValueError as exc:
            raise ValueError(f"dmuon: {exc}") from None
        if R * N > world:
            shape = f"R*N = {R} x {N} = {R * N}" if R > 1 else f"{N}"
            raise ValueError(
                f"dmuon: mesh {mesh!r} needs {shape} ranks but the world has {world} "
                f"(processes): pass a mesh of {world} ranks (or None = 1-D over the world), or start "
                f"{R * N} processes (e.g. torchrun --nproc-per-node {R * N})"
            )
        if R * N < world:
            raise ValueError(
                f"dmuon: mesh {mesh!r} has R*N = {R * N} ranks but the world has {world}: an int or "
                f"tuple mesh must span the world (pass {world}, or None); to run dmuon on a subset of "
                "the ranks (e.g. the data-parallel part of a larger world), pass that DeviceMesh"
            )
        return tuple(tuple(r * N + s for s in range(N)) for r in range(R))
    t = mesh.mesh.detach().cpu()
    names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
    try:
        roles = mesh_dim_roles(tuple(t.shape), names, shard_dim=shard_dim, replicate_dim=replicate_dim, tp_dim=tp_dim)
    except ValueError as exc:
        raise ValueError(f"dmuon: {exc}") from None
    if roles.tp is not None:  # this rank's TP coordinate
        where = (t == dist.get_rank()).nonzero()
        if len(where) != 1:
            raise ValueError(f"dmuon: rank {dist.get_rank()} is not in the mesh {t.tolist()}")
        t = t.select(roles.tp, int(where[0][roles.tp]))
        shift = lambda d: d - (d > roles.tp)  # noqa: E731 - dim index after removing the TP dim
        roles = dataclasses.replace(
            roles,
            tp=None,
            shard=shift(roles.shard),
            replicate=None if roles.replicate is None else shift(roles.replicate),
        )
    if t.ndim == 1:
        return (tuple(int(x) for x in t.tolist()),)
    if roles.shard == 0:
        t = t.T
    return tuple(tuple(int(x) for x in row) for row in t.tolist())


def mesh_tp_ranks(
    mesh, *, tp_dim: str | None = None, shard_dim: str | None = None, replicate_dim: str | None = None
) -> tuple[int, ...] | None:
    """Global ranks of this rank's line along ``mesh``'s TP dim (:func:`dmuon.plan.mesh_dim_roles`),
    in TP order; None when the mesh has no TP dim (or is not a ``DeviceMesh``)."""
    if mesh is None or isinstance(mesh, (int, tuple, list)):
        return None
    t = mesh.mesh.detach().cpu()
    names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
    roles = mesh_dim_roles(tuple(t.shape), names, shard_dim=shard_dim, replicate_dim=replicate_dim, tp_dim=tp_dim)
    if roles.tp is None:
        return None
    where = (t == dist.get_rank()).nonzero()
    if len(where) != 1:
        return None
    index = [int(i) for i in where[0]]
    line = t.movedim(roles.tp, -1)[tuple(i for d, i in enumerate(index) if d != roles.tp)]
    return tuple(int(x) for x in line.tolist())


@dataclasses.dataclass(frozen=True, kw_only=True)
class MeshGroups:
    """dmuon's own process groups for a ``(R, N)`` mesh (rank layout ``mesh_ranks[r][s]``).

    dmuon never shares a process group with FSDP2: its collectives form their own sequence, so
    the relative order of dmuon's and FSDP2's hooks cannot mismatch between ranks.

    Tensor parallelism (``tp_size = T > 1``): every TP coordinate ``t`` has its own
    data-parallel mesh; ``mesh_ranks`` is this rank's (``t = tp_rank``), and ``tp_group`` joins
    the ``T`` ranks with this rank's data-parallel coordinate (an owner group), ``tp_ranks``
    their global ranks in TP order, ``tp_tables[t]`` the data-parallel table of every TP
    coordinate (the state-dict ``DeviceMesh`` spans all of them).
    """

    mesh_ranks: tuple[tuple[int, ...], ...]  # [replicate][shard] -> global rank
    replicate: int  # this rank's replicate coordinate
    shard: int  # this rank's shard coordinate
    shard_group: Any  # ProcessGroup over mesh_ranks[replicate][:]
    replicate_group: Any  # ProcessGroup over mesh_ranks[:][shard], None when R == 1
    tp_size: int = 1
    tp_rank: int = 0
    tp_group: Any = None  # ProcessGroup over tp_ranks, None when T == 1
    tp_ranks: tuple[int, ...] = ()
    tp_tables: tuple[tuple[tuple[int, ...], ...], ...] = ()  # [t][replicate][shard] -> global rank, T > 1 only
    job_group: Any = None  # ProcessGroup over every rank of this job (dp x tp), None = the world
    # independent data-parallel sub-meshes of one shape (pipeline stages): the group of the ranks at
    # this rank's mesh coordinate in every sub-mesh (a "pp" group), None otherwise
    peer_group: Any = None
    # owner groups (plan OwnerGroups): sorted mesh ranks of the members -> ProcessGroup, for
    # the groups this rank belongs to
    owner_group_pgs: dict = dataclasses.field(default_factory=dict)

    def owner_group(self, mesh_ranks: tuple[int, ...]):
        """dmuon's process group of the owner group with these mesh ranks (this rank a member)."""
        return self.owner_group_pgs[tuple(sorted(mesh_ranks))]

    @property
    def shape(self) -> tuple[int, int]:
        return (len(self.mesh_ranks), len(self.mesh_ranks[0]))

    def rank_of(self, replicate: int, shard: int) -> int:
        return self.mesh_ranks[replicate][shard]

    @staticmethod
    def build(
        ranks: tuple[tuple[int, ...], ...],
        *,
        tp_tables: tuple[tuple[tuple[int, ...], ...], ...] | None = None,
        peer_tables: tuple[tuple[tuple[int, ...], ...], ...] | None = None,
        owner_groups: Sequence[tuple[int, ...]] = (),
        peer_owner_groups: Sequence[Sequence[tuple[int, ...]]] | None = None,
    ) -> "MeshGroups":
        """Create the groups for the rank table ``ranks[replicate][shard]`` (see
        :func:`mesh_rank_table`); a collective call on every rank of the world, in a fixed order.

        ``tp_tables[t]``: the data-parallel table of TP coordinate ``t`` (all ``T`` of them, the
        same on every rank; ``ranks`` is one of them): groups are created for every table, then
        one TP group per data-parallel coordinate. ``peer_tables``: without TP, the tables of
        every independent data-parallel sub-mesh of the world (``ranks`` among them): groups are
        created for all of them, no TP groups. ``owner_groups``: the distinct member sets of the
        plan's owner groups (sorted mesh ranks, plan order; the same on every rank): one group
        each, in every table. ``peer_owner_groups[t]``: with ``peer_tables``, those of table
        ``t``'s own plan instead (sub-meshes that hold different models, e.g. pipeline stages).
        """
        me = dist.get_rank()
        tables = tuple(tp_tables or peer_tables or (ranks,))
        found = [
            (t, r, s) for t, tab in enumerate(tables) for r, row in enumerate(tab) for s, x in enumerate(row) if x == me
        ]
        if len(found) != 1:
            raise ValueError(f"dmuon: rank {me} appears {len(found)} times in mesh {tables}")
        my_t, my_r, my_s = found[0]
        if owner_groups and tp_tables is not None:
            raise ValueError("dmuon: owner groups with tensor parallelism are not supported")
        R, N = len(ranks), len(ranks[0])
        # The rank list of every group, in creation order (the same on every rank: nothing below
        # depends on this rank's coordinates), and which of them this rank uses.
        specs: list[tuple[int, ...]] = []

        def want(members) -> int:
            specs.append(tuple(members))
            return len(specs) - 1

        shard_i = replicate_i = tp_i = job_i = None
        for t, tab in enumerate(tables):  # every rank creates every group, same order
            for r, row in enumerate(tab):
                i = want(row)
                if (t, r) == (my_t, my_r):
                    shard_i = i
            if R > 1:
                for s in range(N):
                    i = want(tab[r][s] for r in range(R))
                    if (t, s) == (my_t, my_s):
                        replicate_i = i
        T = len(tables) if tp_tables is not None else 1
        if T > 1:
            for r in range(R):
                for s in range(N):
                    i = want(tab[r][s] for tab in tables)
                    if (r, s) == (my_r, my_s):
                        tp_i = i
        peer_i = None
        if peer_tables is not None and tp_tables is None and len({(len(t), len(t[0])) for t in tables}) == 1:
            for r in range(R):
                for s in range(N):
                    i = want(tab[r][s] for tab in tables)
                    if (r, s) == (my_r, my_s):
                        peer_i = i
        # the ranks of one job (global reductions such as clip_grad_norm_): all tables with TP,
        # each table on its own for independent sub-meshes; None when that is the whole world
        if peer_tables is not None and tp_tables is None:
            for t, tab in enumerate(tables):
                i = want(sorted(x for row in tab for x in row))
                if t == my_t:
                    job_i = i
        owner_i = {}
        for t, tab in enumerate(tables):  # every rank creates every table's owner groups, same order
            flat = [x for row in tab for x in row]
            for members in owner_groups if peer_owner_groups is None else peer_owner_groups[t]:
                i = want(sorted(flat[m] for m in members))
                if t == my_t and my_r * N + my_s in members:
                    owner_i[tuple(members)] = i
        pgs = _groups_for(tuple(specs))
        pick = lambda i: None if i is None else pgs[i]  # noqa: E731
        shard_group, replicate_group, tp_group, job_group = map(pick, (shard_i, replicate_i, tp_i, job_i))
        tp_ranks = specs[tp_i] if tp_i is not None else ()
        owner_group_pgs = {members: pgs[i] for members, i in owner_i.items()}
        peer_group = pick(peer_i)
        return MeshGroups(
            owner_group_pgs=owner_group_pgs,
            mesh_ranks=tables[my_t],
            replicate=my_r,
            shard=my_s,
            shard_group=shard_group,
            replicate_group=replicate_group,
            tp_size=T,
            tp_rank=my_t if T > 1 else 0,
            tp_group=tp_group,
            tp_ranks=tp_ranks,
            tp_tables=tables if T > 1 else (),
            job_group=job_group,
            peer_group=peer_group,
        )
