"""The sharding plan: :class:`ShardingPlan` and :func:`compile`.

``compile(model, mesh, ...)`` is pure: it reads a snapshot of the model (names, shapes, dtypes,
module types; meta-device models work), selects the dedicated parameters, resolves their hook
boundaries, assigns ONE owner rank per parameter with constrained LPT over the ``R*N`` mesh
slots, and lays out the packed per-boundary buffers. It never touches ``torch.distributed``,
never mutates or allocates the model, and gives byte-identical plans (same
:meth:`ShardingPlan.fingerprint`) for the same model and arguments on every rank.

optree registration (namespace ``"dmuon"``): a ShardingPlan is an internal node whose children
are, in this order, ``params``, ``owners``, ``boundaries`` (tuples, so the leaves are the
:class:`~dmuon.plan.records.ParamSpec`, :class:`~dmuon.plan.records.Owner` and
:class:`~dmuon.plan.layout.Boundary` records, in plan order); every other field is treespec
metadata. So ``optree.tree_map(f, plan_a, plan_b, namespace="dmuon")`` works for plans that
share the dedicated-parameter count, boundary count AND settings (mesh shape, Z2/Z3, dtypes,
cost model, alignment, model digest); compare plans of different shape with
:func:`dmuon.plan.diff`. Unflattening does not re-run validation (like equinox modules), so a
mapped plan may hold arbitrary leaves; methods other than field access need real records.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
from collections.abc import Callable, Mapping
from typing import Any

import optree
import torch
from torch import nn

from . import cost as _cost
from .layout import (
    Boundary,
    BufferLayout,
    LayoutEntry,
    Segment,
    SubSegment,
    build_boundaries,
    check_buffer_layout,
)
from .partition import lpt_partition, lpt_partition_groups
from .boundaries import BoundaryResolver
from .qk_clip import QKClip, check_qk_clip
from .records import (
    Fsdp2Unit,
    Owner,
    OwnerGroup,
    ParamSpec,
    _check_int,
    balanced_sizes,
    check_dtype_str,
    dtype_str,
    itemsize_nbytes,
    owner_from_dict,
)
from .selection import select_params
from .snapshot import take_snapshot

__all__ = [
    "ShardingPlan",
    "compile",
    "normalize_mesh",
    "mesh_dim_roles",
    "MeshDimRoles",
    "MESH_DIM_NAMES",
    "Owner",
    "OwnerGroup",
    "ParamSpec",
    "LayoutEntry",
    "SubSegment",
    "Segment",
    "BufferLayout",
    "Boundary",
    "ByteCost",
    "JSON_FORMAT",
]

ByteCost = _cost.ByteCost

#: version tag written into every :meth:`ShardingPlan.to_json`
JSON_FORMAT = "dmuon.plan/1"

_SETTINGS = (
    "mesh_shape",
    "reshard_after_forward",
    "replicate_async",
    "cost_model",
    "align_numel",
    "param_dtype",
    "reduce_dtype",
    "model_digest",
    "tp_size",
    "tp_ns_steps",
    "tp_gram_restart_every",
    "qk_clip",
)


#: Dim names recognised on a named mesh, per role, in order of preference (torchtitan names its
#: meshes ``("dp_replicate", "dp_shard", "tp")``; :func:`mesh_dim_roles`).
MESH_DIM_NAMES = {
    "replicate": ("replicate", "dp_replicate"),
    "shard": ("shard", "dp_shard", "dp"),
    "tp": ("tp",),
}


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class MeshDimRoles:
    """Which dim of a mesh is the data-parallel replicate dim, the shard dim and the TP dim
    (indices into ``mesh.shape``; ``None``: the mesh has no such dim)."""

    replicate: int | None
    shard: int
    tp: int | None


def mesh_dim_roles(
    shape: tuple[int, ...],
    names: tuple[str, ...] | None,
    *,
    shard_dim: str | None = None,
    replicate_dim: str | None = None,
    tp_dim: str | None = None,
) -> MeshDimRoles:
    """The roles of a mesh's dims: the one rule for reading a mesh (plan and runtime).

    * 1-D: the shard dim.
    * Named dims: each role is the dim named by its override (``shard_dim=`` /
      ``replicate_dim=`` / ``tp_dim=``) or else the first dim whose name is in
      :data:`MESH_DIM_NAMES` for it; a 2-D or 3-D mesh needs a shard dim, a 3-D mesh all three
      roles. So ``("dp_replicate", "dp_shard", "tp")``, ``("replicate", "shard", "tp")``,
      ``("dp", "tp")`` and ``("shard", "replicate")`` read without arguments.
    * A 2-D mesh whose names match no role (or no names) and no override: ``(replicate, shard)``
      by position (``init_device_mesh(..., (R, N))``).

    Raises:
        ValueError: more than 3 dims; an override that names no dim; a role that cannot be
            found (the message lists the dim names and the names expected); two roles on
            one dim.
    """
    ndim = len(shape)
    if ndim not in (1, 2, 3):
        raise ValueError(f"mesh must have 1, 2 or 3 dims (replicate, shard, tp), got shape {tuple(shape)}")
    names = tuple(names) if names else ()
    overrides = {"shard": shard_dim, "replicate": replicate_dim, "tp": tp_dim}
    for role, name in overrides.items():
        if name is not None and name not in names:
            raise ValueError(f"{role}_dim={name!r} names no dim of the mesh, whose dims are {names or '(unnamed)'}")
    if ndim == 1:
        if replicate_dim is not None or tp_dim is not None:
            raise ValueError(f"a 1-D mesh has only a shard dim, got replicate_dim={replicate_dim!r} tp_dim={tp_dim!r}")
        return MeshDimRoles(replicate=None, shard=0, tp=None)
    found: dict[str, int | None] = {}
    for role, candidates in MESH_DIM_NAMES.items():
        name = overrides[role]
        if name is None:
            name = next((c for c in candidates if c in names), None)
        found[role] = None if name is None else names.index(name)
    if ndim == 2 and all(v is None for v in found.values()):
        return MeshDimRoles(replicate=0, shard=1, tp=None)  # positional (R, N)
    expected = "; ".join(f"{r}: {' / '.join(map(repr, c))}" for r, c in MESH_DIM_NAMES.items())
    need = ("replicate", "shard", "tp") if ndim == 3 else ("shard",)
    missing = [r for r in need if found[r] is None]
    if ndim == 2 and found["replicate"] is None and found["tp"] is None:
        missing.append("replicate or tp")
    if missing:
        raise ValueError(
            f"cannot find the {' and '.join(missing)} dim of the {ndim}-D mesh with dims {names or '(unnamed)'}: "
            f"expected names ({expected}), or pass shard_dim= / replicate_dim= / tp_dim="
        )
    used = [v for v in found.values() if v is not None]
    if len(set(used)) != len(used) or (ndim == 2 and found["replicate"] is not None and found["tp"] is not None):
        raise ValueError(f"mesh dims {names}: roles {found} overlap; name each dim once")
    return MeshDimRoles(replicate=found["replicate"], shard=found["shard"], tp=found["tp"])


def normalize_mesh(mesh: Any) -> tuple[int, int]:
    """``(R, N)`` of the data-parallel part of ``mesh``: ``int N`` | ``(N,)`` | ``(R, N)`` | an
    object with ``.shape`` (e.g. a ``DeviceMesh``; only ``tuple(mesh.shape)`` and
    ``mesh.mesh_dim_names`` are read, by :func:`mesh_dim_roles`, so a named 3-D
    ``(dp_replicate, dp_shard, tp)`` mesh gives ``(dp_replicate, dp_shard)``). 1-D gives ``(1, N)``.

    Raises:
        ValueError: not 1-D or 2-D (3-D for a named mesh), or a dimension is not a positive int.
    """
    names = None
    if hasattr(mesh, "shape") and not isinstance(mesh, (tuple, list)):
        dims = tuple(mesh.shape)
        names = getattr(mesh, "mesh_dim_names", None)
    elif isinstance(mesh, (tuple, list)):
        dims = tuple(mesh)
    else:
        dims = (mesh,)
    if len(dims) not in (1, 2) and not names:
        raise ValueError(f"mesh must be 1-D (N) or 2-D (R, N), got shape {dims}")
    out = []
    for d in dims:
        if isinstance(d, bool) or not isinstance(d, int) and not hasattr(d, "__index__"):
            raise ValueError(f"mesh dimensions must be positive ints, got {dims}")
        d = int(d)
        if d < 1:
            raise ValueError(f"mesh dimensions must be positive ints, got {dims}")
        out.append(d)
    roles = mesh_dim_roles(tuple(out), names)
    R = 1 if roles.replicate is None else out[roles.replicate]
    return (R, out[roles.shard])


def _closest(name: str, candidates: list[str]) -> str:
    close = difflib.get_close_matches(name, candidates, n=3, cutoff=0.5)
    return f"; closest: {', '.join(close)}" if close else ""


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True, eq=True)
class ShardingPlan:
    """Who owns each dedicated parameter, which module's hooks serve it, and the packed layouts.

    Attributes:
        mesh_shape: ``(R, N)`` (a 1-D mesh of N is ``(1, N)``); mesh rank ``= replicate*N + shard``.
        reshard_after_forward: True = DMuon-Z3 (re-broadcast for backward), False = Z2.
        replicate_async: HSDP post-step replicate broadcast waited for lazily.
        cost_model: ``"numel"`` or ``"ns_flops"``, the LPT weight.
        align_numel: alignment of layout entries and flags, in elements.
        param_dtype / reduce_dtype: mixed-precision wire dtype strings or None.
        params: dedicated parameters, ``named_parameters()`` order.
        owners: owner of each parameter (aligned with ``params``): an
            :class:`~dmuon.plan.records.Owner`, or an :class:`~dmuon.plan.records.OwnerGroup`
            (``compile(owner_groups=...)``: ``k`` ranks of one replicate row each owning a block
            of the matrix along its long side; its layout has one entry per block).
        boundaries: hook boundaries with their buffers, first-appearance order in ``named_modules()``.
        model_digest: sha256 hex of the snapshot of ALL parameters (names, shapes, dtypes, ties).
        tp_size: tensor-parallel degree ``T`` of the dedicated matrices (1 = no TP). With
            ``T > 1`` the mesh ``(R, N)`` is the data-parallel mesh of each TP coordinate, the
            layouts hold one TP rank's shards (identical on every TP coordinate), owners are
            data-parallel coordinates (the owner's ``T`` TP ranks form its owner group) and the
            world is ``R*N*T`` ranks (:class:`~dmuon.plan.cost.ByteCost` indexing).
        tp_ns_steps / tp_gram_restart_every: the Newton-Schulz steps and Gram restart period
            the TP byte cost assumes (one Gram all-reduce per segment,
            :func:`~dmuon.plan.cost.gram_segment_lengths`); ``dmuon.Muon`` checks that its
            ``ns_steps`` agrees.
        fsdp2_units: the non-dedicated parameters per ``fully_shard`` unit
            (:class:`~dmuon.plan.records.Fsdp2Unit`), hook-boundary units in module order,
            then the root's: the schedule's external FSDP2 ops. Not part of the cost.
        qk_clip: QK-clip (MuonClip) settings (:class:`~dmuon.plan.qk_clip.QKClip`) or None; with
            them the schedule holds the per-step all-reduce (max) of the per-head logits.

    Raises (construction):
        ValueError / TypeError: any invariant below is violated: owner coordinates inside the
        mesh and ``rank == replicate*N + shard``; unique FQNs/aliases; each parameter in exactly
        one boundary buffer with its owner, numel, shape and dtype; layouts aligned and packed
        per :mod:`dmuon.plan.layout`.
    """

    mesh_shape: tuple[int, int]
    reshard_after_forward: bool
    replicate_async: bool
    cost_model: str
    align_numel: int
    param_dtype: str | None
    reduce_dtype: str | None
    params: tuple[ParamSpec, ...]
    owners: tuple[Owner | OwnerGroup, ...]
    boundaries: tuple[Boundary, ...]
    model_digest: str
    tp_size: int = 1
    tp_ns_steps: int = 5
    tp_gram_restart_every: int | None = 2
    fsdp2_units: tuple[Fsdp2Unit, ...] = ()
    qk_clip: QKClip | None = None
    # FQN lookup tables, built once at construction (__post_init__, or _unflatten); never written after
    _index: dict | None = dataclasses.field(default=None, init=False, repr=False, compare=False)

    # ------------------------------------------------------------------ validation
    def __post_init__(self) -> None:
        ms = self.mesh_shape
        if type(ms) is not tuple or len(ms) != 2:
            raise ValueError(f"ShardingPlan.mesh_shape must be a 2-tuple (R, N), got {ms!r}")
        _check_int("ShardingPlan", "mesh_shape[0]", ms[0], 1)
        _check_int("ShardingPlan", "mesh_shape[1]", ms[1], 1)
        for name in ("reshard_after_forward", "replicate_async"):
            if type(getattr(self, name)) is not bool:
                raise TypeError(f"ShardingPlan.{name} must be a bool")
        if self.cost_model not in _cost.COST_MODELS:
            raise ValueError(f"ShardingPlan.cost_model must be one of {_cost.COST_MODELS}, got {self.cost_model!r}")
        _check_int("ShardingPlan", "align_numel", self.align_numel, 1)
        check_dtype_str("ShardingPlan", "param_dtype", self.param_dtype, optional=True)
        check_dtype_str("ShardingPlan", "reduce_dtype", self.reduce_dtype, optional=True)
        if not isinstance(self.model_digest, str):
            raise TypeError("ShardingPlan.model_digest must be a str")
        for name, cls in (("params", ParamSpec), ("owners", (Owner, OwnerGroup)), ("boundaries", Boundary), ("fsdp2_units", Fsdp2Unit)):
            value = getattr(self, name)
            if type(value) is not tuple or any(not isinstance(v, cls) for v in value):
                names = "/".join(c.__name__ for c in (cls if isinstance(cls, tuple) else (cls,)))
                raise TypeError(f"ShardingPlan.{name} must be a tuple of {names}")
        if len(self.owners) != len(self.params):
            raise ValueError("ShardingPlan.owners must align with params")
        if self.qk_clip is not None and not isinstance(self.qk_clip, QKClip):
            raise TypeError("ShardingPlan.qk_clip must be a QKClip or None")
        _check_int("ShardingPlan", "tp_size", self.tp_size, 1)
        _check_int("ShardingPlan", "tp_ns_steps", self.tp_ns_steps, 0)
        if self.tp_gram_restart_every is not None:
            _check_int("ShardingPlan", "tp_gram_restart_every", self.tp_gram_restart_every, 1)
        for spec in self.params:
            if spec.tp_size not in (1, self.tp_size):
                raise ValueError(
                    f"ShardingPlan: {spec.fqn} has tp_size {spec.tp_size} but the plan's is {self.tp_size}"
                )
        R, N = ms
        for spec, owner in zip(self.params, self.owners):
            for o in owner.members if isinstance(owner, OwnerGroup) else (owner,):
                if o.shard >= N or o.replicate >= R or o.rank != o.replicate * N + o.shard:
                    raise ValueError(f"ShardingPlan: owner {o} of {spec.fqn} is not on mesh (R={R}, N={N})")
            if isinstance(owner, OwnerGroup):
                problem = _cost.owner_group_problem(spec)
                if problem is not None:
                    raise ValueError(f"ShardingPlan: {spec.fqn} has an owner group but {problem}")
                if owner.dim != _cost.owner_group_dim(spec.shape) or sum(owner.sizes) != spec.shape[owner.dim]:
                    raise ValueError(
                        f"ShardingPlan: owner group of {spec.fqn} {spec.shape} must cut its long side "
                        f"(dim {_cost.owner_group_dim(spec.shape)}) into blocks summing to it, got dim {owner.dim} "
                        f"sizes {owner.sizes}"
                    )
        index = self._build_index()
        seen: set[str] = set()
        for boundary in self.boundaries:
            if boundary.fqn in seen:
                raise ValueError(f"ShardingPlan: boundary {boundary.fqn!r} listed twice")
            seen.add(boundary.fqn)
            for buf in boundary.buffers:
                check_buffer_layout(buf, self.align_numel)
                for entry in buf.entries():
                    i = index["canonical"].get(entry.fqn)
                    if i is None:
                        raise ValueError(f"ShardingPlan: layout entry {entry.fqn!r} is not a dedicated param")
                    spec, owner = self.params[i], self.owners[i]
                    if isinstance(owner, OwnerGroup):
                        j = entry.block
                        ok = j is not None and j < owner.k and entry.owner == owner.members[j]
                        expected = (owner.block_shape(j, spec.shape) if ok else None)
                        ok = ok and entry.shape == expected and entry.numel == expected[0] * expected[1]
                        ok = ok and buf.dtype == spec.dtype
                    else:
                        ok = entry.block is None and (entry.owner, entry.numel, entry.shape, buf.dtype) == (
                            owner,
                            spec.local_numel,
                            spec.local_shape,
                            spec.dtype,
                        )
                    if not ok:
                        raise ValueError(f"ShardingPlan: layout entry {entry.fqn!r} disagrees with its ParamSpec/Owner")
        if len(index["boundary_of"]) != len(self.params) or None in index["boundary_of"]:
            raise ValueError("ShardingPlan: every dedicated param must appear in exactly one boundary buffer")
        if self.qk_clip is not None:  # the rows QK-clip rescales live on dedicated owners
            for att in self.qk_clip.attention:
                for rows in (att.q, att.k):
                    if rows.fqn not in index["alias"]:
                        raise ValueError(f"ShardingPlan: qk_clip names {rows.fqn!r}, which is not a dedicated parameter")
        object.__setattr__(self, "_index", index)

    def _build_index(self) -> dict:
        canonical: dict[str, int] = {}
        alias: dict[str, int] = {}
        for i, spec in enumerate(self.params):
            if spec.fqn in canonical:
                raise ValueError(f"ShardingPlan: duplicate dedicated param {spec.fqn!r}")
            canonical[spec.fqn] = i
            for a in spec.aliases:
                if a in alias:
                    raise ValueError(f"ShardingPlan: alias {a!r} names two dedicated params")
                alias[a] = i
        boundary_of: list[int | None] = [None] * len(self.params)
        blocks_seen: list[set] = [set() for _ in self.params]
        for b_index, boundary in enumerate(self.boundaries):
            for buf in boundary.buffers:
                for entry in buf.entries():
                    i = canonical.get(entry.fqn)
                    if i is not None:
                        # one entry per parameter; an owner group's blocks: one entry each, one buffer
                        if boundary_of[i] is not None and (boundary_of[i] != b_index or entry.block is None
                                                           or entry.block in blocks_seen[i]):
                            raise ValueError(f"ShardingPlan: {entry.fqn!r} appears in two buffers")
                        boundary_of[i] = b_index
                        blocks_seen[i].add(entry.block)
        for i, owner in enumerate(self.owners):
            expected = set(range(owner.k)) if isinstance(owner, OwnerGroup) else {None}
            if boundary_of[i] is not None and blocks_seen[i] != expected:
                raise ValueError(
                    f"ShardingPlan: {self.params[i].fqn!r} has layout blocks {sorted(map(str, blocks_seen[i]))}, "
                    f"expected {sorted(map(str, expected))}"
                )
        return {"canonical": canonical, "alias": alias, "boundary_of": boundary_of}

    def _idx(self) -> dict:
        return self._index  # type: ignore[return-value]

    # ------------------------------------------------------------------ lookups
    @property
    def world_size(self) -> int:
        """``R * N`` data-parallel mesh ranks (the LPT slots; times ``tp_size`` for the world)."""
        return self.mesh_shape[0] * self.mesh_shape[1]

    @property
    def tp_segment_lengths(self) -> tuple[int, ...]:
        """Steps per Gram NS segment assumed for TP ``"gram"`` matrices (one all-reduce each)."""
        return _cost.gram_segment_lengths(self.tp_ns_steps, self.tp_gram_restart_every)

    @property
    def dedicated(self) -> tuple[str, ...]:
        """Canonical FQNs of dedicated parameters, ``named_parameters()`` order."""
        return tuple(p.fqn for p in self.params)

    def _lookup(self, fqn: str) -> int:
        idx = self._idx()["alias"].get(fqn)
        if idx is None:
            raise KeyError(f"{fqn!r} is not a dedicated parameter of this plan{_closest(fqn, list(self._idx()['alias']))}")
        return idx

    def owner(self, fqn: str) -> Owner | OwnerGroup:
        """Owner (or owner group) of dedicated parameter ``fqn`` (any alias). Raises KeyError
        with close matches."""
        return self.owners[self._lookup(fqn)]

    def param(self, fqn: str) -> ParamSpec:
        """:class:`ParamSpec` of ``fqn`` (any alias). Raises KeyError with close matches."""
        return self.params[self._lookup(fqn)]

    def boundary(self, fqn: str) -> str:
        """FQN of the hook boundary module serving ``fqn`` (any alias). Raises KeyError."""
        return self.boundaries[self._idx()["boundary_of"][self._lookup(fqn)]].fqn

    def boundary_record(self, fqn: str) -> Boundary:
        """The :class:`Boundary` (with buffers) serving parameter ``fqn`` (any alias)."""
        return self.boundaries[self._idx()["boundary_of"][self._lookup(fqn)]]

    def is_dedicated(self, fqn: str) -> bool:
        """True iff ``fqn`` (any alias) is a dedicated parameter."""
        return fqn in self._idx()["alias"]

    def bcast_dtype(self, param_dtype_str: str) -> str:
        """Broadcast wire dtype for a parameter stored as ``param_dtype_str``."""
        return _cost.bcast_dtype(param_dtype_str, self.param_dtype)

    def reduce_dtype_for(self, param_dtype_str: str) -> str:
        """Gradient-reduce wire dtype for a parameter stored as ``param_dtype_str``."""
        return _cost.reduce_dtype(param_dtype_str, self.param_dtype, self.reduce_dtype)

    # ------------------------------------------------------------------ derived figures
    # Pure functions of the plan, computed on every access (nothing is cached on a frozen
    # record): bind the result once where it is read repeatedly.
    @property
    def owned_numel(self) -> tuple[int, ...]:
        """Elements owned per mesh rank (global owners only), length ``R*N``."""
        out = [0] * self.world_size
        for spec, owner in zip(self.params, self.owners):
            for rank, numel in _cost.owner_weights(spec, owner, "numel", ()):
                out[rank] += numel
        return tuple(out)

    @property
    def owned_weight(self) -> tuple[int, ...]:
        """LPT weight (``cost_model`` unit) owned per mesh rank."""
        out = [0] * self.world_size
        lengths = self.tp_segment_lengths
        for spec, owner in zip(self.params, self.owners):
            for rank, weight in _cost.owner_weights(spec, owner, self.cost_model, lengths):
                out[rank] += weight
        return tuple(out)

    @property
    def balance_bound(self) -> float:
        """Proven LPT bound on ``max(owned_weight)``: ``total/(R*N) + max item weight``, items
        being the matrices (owner-group members' blocks counted as items of their own); on an
        HSDP mesh with owner groups of up to ``K`` members the mean term carries
        ``lpt_partition_groups``' factor ``N/(N-K+1)`` (a group stays in one replicate row)."""
        lengths = self.tp_segment_lengths
        weights = [w for spec, o in zip(self.params, self.owners) for _, w in _cost.owner_weights(spec, o, self.cost_model, lengths)]
        R, N = self.mesh_shape
        K = max((o.k for o in self.owners if isinstance(o, OwnerGroup)), default=1)
        factor = N / (N - K + 1) if R > 1 and K > 1 else 1.0
        return factor * sum(weights) / self.world_size + max(weights, default=0)

    def schedule(self, step: Any = None) -> Any:
        """:func:`dmuon.plan.step_schedule.schedule` of this plan: every rank's ops for ``step``
        (a :class:`~dmuon.plan.step_schedule.Step`; None = the nominal step)."""
        from .step_schedule import schedule

        return schedule(self, step)

    @property
    def cost(self) -> ByteCost:
        """:class:`ByteCost`: DMuon bytes per step summed over all ranks (+ per rank), summed
        from the nominal step's schedule (:func:`~dmuon.plan.cost.schedule_byte_cost`)."""
        return _cost.schedule_byte_cost(self.schedule())

    @property
    def baseline_cost(self) -> _cost.BaselineByteCost:
        """Bytes per step of FSDP2 + naive all-gather Muon on the same parameters."""
        return _cost.baseline_byte_cost(
            self.params,
            mesh_shape=self.mesh_shape,
            reshard_after_forward=self.reshard_after_forward,
            param_dtype=self.param_dtype,
            reduce_dtype_=self.reduce_dtype,
            tp_size=self.tp_size,
        )

    @property
    def assembled_nbytes(self) -> dict[str, int]:
        """Owner groups: per boundary FQN, the bytes of the full compute matrices every rank
        assembles from the blocks while the boundary is unsharded (broadcast dtype); empty
        without owner groups."""
        out: dict[str, int] = {}
        for spec, owner in zip(self.params, self.owners):
            if isinstance(owner, OwnerGroup):
                b = self.boundary(spec.fqn)
                out[b] = out.get(b, 0) + spec.numel * itemsize_nbytes(self.bcast_dtype(spec.dtype))
        return out

    def rank_stats(self) -> tuple[_cost.RankStats, ...]:
        """Per-rank :class:`~dmuon.plan.cost.RankStats` of this plan (schedule ranks: the mesh
        rank, or ``(replicate*N + shard)*T + tp`` with TP), from the nominal schedule."""
        sched = self.schedule()
        return _cost.rank_stats(
            self.params,
            self.owners,
            sched,
            _cost.schedule_byte_cost(sched),
            mesh_shape=self.mesh_shape,
            reshard_after_forward=self.reshard_after_forward,
            tp_size=self.tp_size,
            assembled_nbytes=self.assembled_nbytes,
        )

    def baseline_rank_stats(self) -> tuple[_cost.RankStats, ...]:
        """Per-rank :class:`~dmuon.plan.cost.RankStats` of FSDP2 + naive Muon, same parameters."""
        return _cost.baseline_rank_stats(
            self.params,
            self.boundary,
            self.baseline_cost,
            mesh_shape=self.mesh_shape,
            reshard_after_forward=self.reshard_after_forward,
            param_dtype=self.param_dtype,
            tp_size=self.tp_size,
        )

    # ------------------------------------------------------------------ serialisation
    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (field order fixed; see :meth:`to_json`)."""
        return {
            "format": JSON_FORMAT,
            "mesh_shape": list(self.mesh_shape),
            "reshard_after_forward": self.reshard_after_forward,
            "replicate_async": self.replicate_async,
            "cost_model": self.cost_model,
            "align_numel": self.align_numel,
            "param_dtype": self.param_dtype,
            "reduce_dtype": self.reduce_dtype,
            "model_digest": self.model_digest,
            "params": [p.to_dict() for p in self.params],
            "owners": [o.to_dict() for o in self.owners],
            "boundaries": [b.to_dict() for b in self.boundaries],
            "fsdp2_units": [u.to_dict() for u in self.fsdp2_units],
            **(
                {  # absent without TP: plans without TP keep their JSON and fingerprint
                    "tp_size": self.tp_size,
                    "tp_ns_steps": self.tp_ns_steps,
                    "tp_gram_restart_every": self.tp_gram_restart_every,
                }
                if self.tp_size > 1
                else {}
            ),
            **({"qk_clip": self.qk_clip.to_dict()} if self.qk_clip is not None else {}),
        }

    def to_json(self, *, indent: int | None = None) -> str:
        """Deterministic JSON text (ASCII, fixed key order); ``from_json(to_json()) == self``."""
        seps = (",", ":") if indent is None else (",", ": ")
        return json.dumps(self.to_dict(), indent=indent, separators=seps, ensure_ascii=True)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ShardingPlan:
        if d.get("format") != JSON_FORMAT:
            raise ValueError(f"not a {JSON_FORMAT} plan (format={d.get('format')!r})")
        return cls(
            mesh_shape=tuple(d["mesh_shape"]),
            reshard_after_forward=d["reshard_after_forward"],
            replicate_async=d["replicate_async"],
            cost_model=d["cost_model"],
            align_numel=d["align_numel"],
            param_dtype=d["param_dtype"],
            reduce_dtype=d["reduce_dtype"],
            params=tuple(ParamSpec.from_dict(p) for p in d["params"]),
            owners=tuple(owner_from_dict(o) for o in d["owners"]),
            boundaries=tuple(Boundary.from_dict(b) for b in d["boundaries"]),
            model_digest=d["model_digest"],
            tp_size=d.get("tp_size", 1),
            tp_ns_steps=d.get("tp_ns_steps", 5),
            tp_gram_restart_every=d.get("tp_gram_restart_every", 2),
            fsdp2_units=tuple(Fsdp2Unit.from_dict(u) for u in d.get("fsdp2_units", ())),
            qk_clip=QKClip.from_dict(d["qk_clip"]) if d.get("qk_clip") is not None else None,
        )

    @classmethod
    def from_json(cls, text: str) -> ShardingPlan:
        """Inverse of :meth:`to_json` (validates). Raises ValueError on a malformed plan."""
        return cls.from_dict(json.loads(text))

    def fingerprint(self) -> str:
        """sha256 hex of :meth:`to_json` (compared across ranks at apply time)."""
        return hashlib.sha256(self.to_json().encode("ascii")).hexdigest()

    # ------------------------------------------------------------------ rendering
    def __repr__(self) -> str:
        # the field-by-field dataclass repr of a 70B plan is megabytes; to_json() has it all
        mode = "Z3" if self.reshard_after_forward else "Z2"
        return (
            f"ShardingPlan(mesh_shape={self.mesh_shape}, {mode}, params={len(self.params)}, "
            f"boundaries={len(self.boundaries)}, cost_model={self.cost_model!r}, "
            f"param_dtype={self.param_dtype!r}, reduce_dtype={self.reduce_dtype!r}, "
            f"model_digest={self.model_digest[:12]!r})"
        )

    def summary(self, *, max_rows: int = 16) -> str:
        """Plain-text report: settings, per-rank load vs. the LPT bound, bytes vs. the baseline."""
        from .render import render_summary

        return render_summary(self, max_rows=max_rows)

    def _repr_html_(self) -> str:
        from .render import render_html

        return render_html(self)


def _flatten(plan: ShardingPlan):
    meta = tuple(getattr(plan, name) for name in _SETTINGS) + (plan.fsdp2_units,)
    return (plan.params, plan.owners, plan.boundaries), meta, ("params", "owners", "boundaries")


def _unflatten(meta: tuple, children) -> ShardingPlan:
    plan = object.__new__(ShardingPlan)
    for name, value in zip(_SETTINGS, meta):
        object.__setattr__(plan, name, value)
    object.__setattr__(plan, "fsdp2_units", meta[len(_SETTINGS)])
    params, owners, boundaries = children
    object.__setattr__(plan, "params", params)
    object.__setattr__(plan, "owners", owners)
    object.__setattr__(plan, "boundaries", boundaries)
    try:  # lookups of a plan of records; a plan mapped to other leaves has none
        index = plan._build_index()
    except (AttributeError, TypeError, ValueError):
        index = None
    object.__setattr__(plan, "_index", index)
    return plan


optree.register_pytree_node(
    ShardingPlan,
    _flatten,
    _unflatten,
    path_entry_type=optree.GetAttrEntry,
    namespace="dmuon",
)


# ---------------------------------------------------------------------- compile


def _mp_dtypes(mp_policy: Any) -> tuple[str | None, str | None]:
    if mp_policy is None:
        return None, None
    return dtype_str(getattr(mp_policy, "param_dtype", None)), dtype_str(getattr(mp_policy, "reduce_dtype", None))


def compile(  # noqa: A001 - shadows the builtin on purpose: dmuon.plan.compile is the public name
    model: nn.Module,
    mesh: Any,
    *,
    predicate: Callable[[str, torch.Tensor], bool] | None = None,
    reshard_after_forward: bool = True,
    hook_boundary_predicate: Callable[[nn.Module], bool] | None = None,
    hook_boundary_strict: bool = True,
    replicate_async: bool = True,
    mp_policy: Any = None,
    cost_model: str = "numel",
    align_numel: int = 16,
    tp_ns: str = "auto",
    tp_size: int | None = None,
    tp_shard_dims: Mapping[str, int] | None = None,
    tp_ns_steps: int = 5,
    tp_gram_restart_every: int | None = 2,
    matrix_views: Any = None,
    qk_clip: Any = None,
    ns_backend: str = "standard",
    owner_groups: str | int = "off",
) -> ShardingPlan:
    """Plan DMuon for ``model`` on ``mesh`` (pure; no process group; meta models work).

    Args:
        model: any ``nn.Module`` on any device; only names/shapes/dtypes/module types are read.
        mesh: ``N`` | ``(N,)`` | ``(R, N)`` | an object with ``.shape`` (DeviceMesh).
        predicate: ``(fqn, param) -> bool`` selecting dedicated params by canonical FQN; None =
            every 2-D param inside a hook boundary that is not an embedding weight.
        reshard_after_forward: True = DMuon-Z3, False = DMuon-Z2.
        hook_boundary_predicate: ``(module) -> bool``; innermost matching ancestor is the
            boundary. None = FQN heuristic (:mod:`dmuon.plan.boundaries`).
        hook_boundary_strict: raise if a dedicated param has no boundary (else own-module fallback).
        replicate_async: recorded for the runtime (HSDP post-step broadcast overlap).
        mp_policy: object with ``.param_dtype`` / ``.reduce_dtype`` (torch dtypes, dtype strings
            or None), e.g. FSDP2's ``MixedPrecisionPolicy``: wire dtypes of broadcast/reduce.
        cost_model: ``"numel"`` (elements) or ``"ns_flops"`` (Newton-Schulz FLOPs) LPT weight.
        align_numel: alignment of every layout entry and flags region, in elements (>= 1).
        tp_ns: tensor parallelism: ``"auto"`` (per matrix, the cheaper in bytes of Gram NS and
            gathering, :func:`~dmuon.plan.cost.choose_tp_ns`), ``"gram"`` or ``"gather"``.
        tp_size, tp_shard_dims: plan tensor parallelism for a model that is not parallelised
            (e.g. on the meta device): ``T`` and ``{fqn: dim}`` of the dedicated matrices TP
            shards (``0`` colwise, ``1`` rowwise). Without them, TP is read from the model's
            ``DTensor`` parameters (``parallelize_module`` on a 1-D TP mesh).
        tp_ns_steps, tp_gram_restart_every: Newton-Schulz steps and Gram restart period the TP
            cost assumes (``dmuon.Muon``'s ``ns_steps`` must agree; restarts as
            ``gram_newton_schulz(restart_every=...)``).
        matrix_views: which blocks of dedicated matrices Muon orthogonalises separately
            (per-head q/k/v/o, split QKV): ``{fqn_pattern: MatrixView | rule}`` (fnmatch globs,
            first match wins) or ``(fqn, shape) -> MatrixView | None``; None = whole matrices.
            Helpers: :mod:`dmuon.plan.views` (``hf_llama_views``, ``gpt2_views``, ...). Under TP
            a view must cut the TP-sharded dim with whole blocks per shard (``tp_ns="local"``).
        qk_clip: QK-clip (MuonClip) settings, a :class:`dmuon.plan.qk_clip.QKClip` (threshold
            ``tau`` and the attention layers whose W_q / W_k rows are rescaled after each step);
            the plan's schedule and cost then include its one all-reduce (max) per step.
        ns_backend: the Newton-Schulz backend each (non-TP) matrix's owner will run, recorded
            in its ``ParamSpec.ns_backend``: ``"standard"`` (default: torch's iteration),
            ``"gram"`` (Gram NS everywhere) or ``"auto"`` (per matrix, Gram NS where its short
            side is at least ``GRAM_AUTO_MIN_SIDE`` = 256 and it needs fewer FLOPs with 5 steps
            and the default restarts, :func:`~dmuon.plan.cost.choose_ns_backend`: e.g. an MLP's
            ``(4d, d)`` / ``(d, 4d)`` weights from ``d = 256``, not square attention projections). ``cost_model="ns_flops"`` balances by
            those FLOPs; ``dmuon.Muon`` must then be built with the same ``ns_backend`` (it
            raises otherwise, naming the parameter).
        owner_groups: ``"off"`` (default: ONE owner rank per matrix), ``"auto"`` (the planner
            gives a matrix an owner group of ``k`` shard ranks of one replicate row only where
            exclusive owners cannot balance the mesh, e.g. more ranks than matrices:
            :func:`~dmuon.plan.partition.lpt_partition_groups`) or an int ``k`` (every matrix
            that can be cut gets ``min(k, N, long side)`` members; ``1`` = ``"off"``). A grouped
            matrix is cut along its long side into balanced blocks (``OwnerGroup``), each
            member holding, broadcasting and updating its block, and is orthogonalised by
            sharded Gram Newton-Schulz over the group (one fp32 ``(d, d)`` all-reduce per Gram
            segment of ``tp_ns_steps`` / ``tp_gram_restart_every``; ``dmuon.Muon``'s
            ``ns_steps`` must agree): the Gram form, not torch's iteration, for those matrices,
            which is why it is opt-in. Matrices with a TP shard, a matrix view, an expert stack
            or a conv kernel, and QK-clip's W_q / W_k, keep one owner.

    Returns:
        A validated, frozen :class:`ShardingPlan` whose nominal step schedule passed the
        deadlock replay (:meth:`~dmuon.plan.step_schedule.StepSchedule.check`).

    Raises:
        TypeError: ``model`` is not an ``nn.Module``.
        ValueError: bad mesh / cost_model / align_numel; a selected param without a matrix
            view; a tied param across boundaries; a boundary-less param when strict; a
            selected ``DTensor`` that dmuon cannot own (not ``Shard(0)``/``Shard(1)`` on a 1-D
            mesh, uneven, not 2-D), TP degrees that differ, ``tp_shard_dims`` naming a
            parameter that is not dedicated or combined with a parallelised model.
    """
    mesh_shape = normalize_mesh(mesh)
    if cost_model not in _cost.COST_MODELS:
        raise ValueError(f"cost_model must be one of {_cost.COST_MODELS}, got {cost_model!r}")
    _cost.choose_ns_backend((1, 1), ns_backend)  # ValueError naming the known modes
    if isinstance(align_numel, bool) or not isinstance(align_numel, int) or align_numel < 1:
        raise ValueError(f"align_numel must be a positive int (elements), got {align_numel!r}")
    param_dtype, reduce_dtype = _mp_dtypes(mp_policy)
    snapshot = take_snapshot(model)
    selected = select_params(
        snapshot,
        predicate=predicate,
        hook_boundary_predicate=hook_boundary_predicate,
        hook_boundary_strict=hook_boundary_strict,
    )
    if predicate is None:
        from .selection import coverage_warning

        message = coverage_warning(snapshot, hook_boundary_predicate)
        if message is not None:
            import warnings

            warnings.warn(message, UserWarning, stacklevel=2)
    specs = tuple(
        ParamSpec(
            fqn=s.record.fqn,
            shape=s.record.shape,
            dtype=s.record.dtype,
            numel=s.record.numel,
            matrix_shape=s.matrix_shape,
            num_matrices=s.num_matrices,
            aliases=s.record.aliases,
            module_fqn=s.record.module_fqn,
            attr=s.record.attr,
        )
        for s in selected
    )
    if matrix_views is not None:
        from .views import resolve_views

        views = resolve_views(specs, matrix_views)
        specs = tuple(dataclasses.replace(spec, view=views[spec.fqn]) if spec.fqn in views else spec for spec in specs)
    T, specs = _tp_specs(snapshot, selected, specs, tp_ns, tp_size, tp_shard_dims, tp_ns_steps, tp_gram_restart_every)
    if qk_clip is not None:
        if not isinstance(qk_clip, QKClip):
            raise TypeError(f"qk_clip must be a dmuon.plan.qk_clip.QKClip, got {type(qk_clip).__name__}")
        check_qk_clip(qk_clip, specs, snapshot.modules, {a: r for r in snapshot.params for a in r.aliases})
    if ns_backend != "standard":
        with_view = [spec.fqn for spec in specs if spec.view is not None]
        if with_view:
            raise ValueError(
                f"compile: ns_backend={ns_backend!r} with matrix views is not supported yet ({with_view[0]} has "
                f"a view; its blocks may differ in shape and so in the backend 'auto' would pick): use "
                f"ns_backend='standard' with matrix_views, or drop matrix_views"
            )
        specs = tuple(
            spec if spec.tp_size > 1
            else dataclasses.replace(spec, ns_backend=_cost.choose_ns_backend(spec.matrix_shape, ns_backend))
            for spec in specs
        )
    R, N = mesh_shape
    owners = _assign_owners(
        specs, [s.boundary for s in selected], mesh_shape, cost_model, owner_groups, T, qk_clip,
        _cost.gram_segment_lengths(tp_ns_steps, tp_gram_restart_every),
    )
    fallback = {s.boundary: s.fallback for s in selected}
    used = set(fallback)
    boundary_order = [fqn for fqn in snapshot.module_fqns if fqn in used]
    boundaries = build_boundaries(
        [
            (spec.fqn, spec.local_shape, spec.local_numel, spec.dtype, owner, s.boundary)
            for spec, owner, s in zip(specs, owners, selected)
        ],
        boundary_order,
        fallback,
        align_numel=align_numel,
    )
    plan = ShardingPlan(
        mesh_shape=mesh_shape,
        reshard_after_forward=bool(reshard_after_forward),
        replicate_async=bool(replicate_async),
        cost_model=cost_model,
        align_numel=align_numel,
        param_dtype=param_dtype,
        reduce_dtype=reduce_dtype,
        params=specs,
        owners=owners,
        boundaries=boundaries,
        model_digest=snapshot.digest,
        tp_size=T,
        tp_ns_steps=tp_ns_steps,
        tp_gram_restart_every=tp_gram_restart_every,
        fsdp2_units=_fsdp2_units(snapshot, {s.record.fqn for s in selected}, hook_boundary_predicate),
        qk_clip=qk_clip,
    )
    plan.schedule().check()  # the nominal step replays without deadlock on every rank
    return plan


def _assign_owners(specs, boundaries, mesh_shape, cost_model, owner_groups, tp_size, qk_clip, segment_lengths):
    """The owner (constrained LPT, :func:`~dmuon.plan.partition.lpt_partition`) or owner group
    (:func:`~dmuon.plan.partition.lpt_partition_groups`) of every dedicated parameter."""
    R, N = mesh_shape
    if isinstance(owner_groups, bool) or not (
        owner_groups in _cost.OWNER_GROUP_MODES or (isinstance(owner_groups, int) and owner_groups >= 1)
    ):
        raise ValueError(
            f"owner_groups must be one of {_cost.OWNER_GROUP_MODES} or an int k >= 1, got {owner_groups!r}"
        )
    weights = [_cost.param_weight(spec, cost_model) for spec in specs]
    keys = [spec.fqn for spec in specs]
    if owner_groups in ("off", 1):
        result = lpt_partition(weights, keys, boundaries, num_shards=N, num_replicas=R)
        return tuple(Owner.at(slot, N) for slot in result.slots)
    if tp_size > 1:
        raise ValueError(
            f"dmuon.plan.compile: owner_groups={owner_groups!r} with tensor parallelism (T={tp_size}) is not "
            "supported: a TP-sharded matrix is already orthogonalised by its TP group, and an owner group of TP "
            "groups is not implemented; use owner_groups='off' with TP"
        )
    clipped = set()
    if qk_clip is not None:  # QK-clip rescales whole W_q / W_k rows on their owner
        clipped = {rows.fqn for att in qk_clip.attention for rows in (att.q, att.k)}
    max_split = [1 if spec.fqn in clipped else _cost.owner_group_max_split(spec, N) for spec in specs]
    split = owner_groups
    if owner_groups == "auto" and cost_model != "numel":
        # "auto" sizes the groups by elements, what they exist for (memory, ranks owning
        # nothing), then places them by the cost model: a member's share of Gram NS does not
        # shrink like 1/k (the (d, d) part runs on every member), so sizing by NS FLOPs alone
        # would cut square matrices across every rank and raise the busiest rank's FLOPs
        sizing = lpt_partition_groups(
            [spec.numel for spec in specs],
            lambda i, k: _cost.owner_group_piece_weights(specs[i], k, "numel", segment_lengths),
            max_split,
            keys,
            boundaries,
            num_shards=N,
            num_replicas=R,
            split="auto",
        )
        max_split = [len(m) for m in sizing.members]
        split = max(max_split)  # forced: each matrix gets min(split, max_split[i]), its own k
    result = lpt_partition_groups(
        weights,
        lambda i, k: _cost.owner_group_piece_weights(specs[i], k, cost_model, segment_lengths),
        max_split,
        keys,
        boundaries,
        num_shards=N,
        num_replicas=R,
        split=split,
    )
    owners = []
    for spec, members in zip(specs, result.members):
        if len(members) == 1:
            owners.append(Owner.at(members[0], N))
            continue
        dim = _cost.owner_group_dim(spec.shape)
        owners.append(
            OwnerGroup(
                members=tuple(Owner.at(slot, N) for slot in members),
                dim=dim,
                sizes=balanced_sizes(int(spec.shape[dim]), len(members)),
            )
        )
    return tuple(owners)


def _fsdp2_units(snapshot, dedicated: set[str], hook_boundary_predicate) -> tuple[Fsdp2Unit, ...]:
    """The non-dedicated parameters per ``fully_shard`` unit (:class:`Fsdp2Unit`): each one's
    hook boundary (the same resolution as for dedicated parameters), else the root; units in
    ``named_modules()`` order of their module, the root last."""
    resolver = BoundaryResolver(snapshot.modules, hook_boundary_predicate)
    order = snapshot.module_order()
    by_unit: dict[str, list] = {}
    for record in snapshot.params:
        if record.fqn in dedicated:
            continue
        res = resolver.resolve(record)
        unit = res.boundary if res.boundary is not None and not res.conflict else ""
        shape = record.shape
        if record.tp_size > 1 and record.tp_shard_dim is not None:
            d = record.tp_shard_dim
            shape = shape[:d] + (-(-shape[d] // record.tp_size),) + shape[d + 1 :]
        by_unit.setdefault(unit, []).append((record.fqn, shape, record.dtype, bool(record.tensor.requires_grad)))
    units = sorted((u for u in by_unit if u), key=lambda u: order.get(u, len(order)))
    if "" in by_unit:
        units.append("")
    return tuple(
        Fsdp2Unit(
            fqn=u,
            params=tuple(p[0] for p in by_unit[u]),
            shapes=tuple(p[1] for p in by_unit[u]),
            dtypes=tuple(p[2] for p in by_unit[u]),
            requires_grad=tuple(p[3] for p in by_unit[u]),
        )
        for u in units
    )


def _tp_specs(snapshot, selected, specs, tp_ns, tp_size, tp_shard_dims, ns_steps, restart_every):
    """``(T, specs)`` with the TP fields filled in (see :func:`compile`'s TP arguments)."""
    if tp_ns not in _cost.TP_NS_MODES:
        raise ValueError(f"tp_ns must be one of {_cost.TP_NS_MODES}, got {tp_ns!r}")
    if isinstance(ns_steps, bool) or not isinstance(ns_steps, int) or ns_steps < 0:
        raise ValueError(f"tp_ns_steps must be an int >= 0, got {ns_steps!r}")
    if restart_every is not None and (
        isinstance(restart_every, bool) or not isinstance(restart_every, int) or restart_every < 1
    ):
        raise ValueError(f"tp_gram_restart_every must be None or an int >= 1, got {restart_every!r}")
    dims: dict[str, int] = {}
    sizes: dict[str, int] = {}
    problems: list[str] = []
    if tp_shard_dims is not None or tp_size is not None:
        if tp_size is None or isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
            raise ValueError(f"tp_size must be an int >= 1 when tp_shard_dims is given, got {tp_size!r}")
        if tp_size > 1 and not tp_shard_dims:
            raise ValueError(
                f"dmuon.plan.compile: tp_size={tp_size} without tp_shard_dims plans no TP-sharded matrix; pass "
                "tp_shard_dims={fqn: 0 (colwise) | 1 (rowwise)} for the dedicated matrices TP shards "
                "(e.g. dmuon.plan.presets.megatron_tp_shard_dims(model)), or parallelize the model first"
            )
        parallel = [r.fqn for r in snapshot.params if r.tp_size > 1]
        if parallel:
            raise ValueError(
                f"dmuon.plan.compile: tp_size/tp_shard_dims describe TP for a model that is not "
                f"parallelised, but {parallel[:3]} are already DTensors; drop the arguments "
                "(TP is read from the model)"
            )
        names = {s.record.fqn: s.record.fqn for s in selected}
        names.update({a: s.record.fqn for s in selected for a in s.record.aliases})
        for fqn, dim in dict(tp_shard_dims or {}).items():
            if fqn not in names:
                raise ValueError(
                    f"dmuon.plan.compile: tp_shard_dims names {fqn!r}, which is not a dedicated parameter"
                )
            if dim not in (0, 1):
                raise ValueError(f"dmuon.plan.compile: tp_shard_dims[{fqn!r}] must be 0 or 1, got {dim!r}")
            dims[names[fqn]] = dim
            sizes[names[fqn]] = tp_size
    else:
        for sel in selected:
            r = sel.record
            if r.tp_size == 1:
                continue
            if r.tp_unsupported:
                problems.append(f"  {r.fqn}: {r.tp_unsupported}")
            elif r.tp_shard_dim is None:
                problems.append(
                    f"  {r.fqn}: replicated over the TP mesh (Replicate()); dmuon owns TP-sharded matrices"
                )
            else:
                dims[r.fqn] = r.tp_shard_dim
                sizes[r.fqn] = r.tp_size
    for spec in specs:
        if spec.fqn in dims:
            d = dims[spec.fqn]
            if spec.num_matrices != 1 or len(spec.shape) != 2:
                problems.append(f"  {spec.fqn}: TP-sharded but {len(spec.shape)}-D {spec.shape}; only 2-D matrices")
            elif spec.shape[d] % sizes[spec.fqn]:
                problems.append(
                    f"  {spec.fqn}: dim {d} of {spec.shape} is not divisible by the TP degree {sizes[spec.fqn]}"
                )
    if problems:
        raise ValueError(
            "dmuon.plan.compile: selected tensor-parallel parameters dmuon cannot own:\n"
            + "\n".join(problems)
            + "\nFix: exclude them in predicate (they stay with FSDP2 and AdamW), or shard them with "
            "ColwiseParallel/RowwiseParallel (Shard(0)/Shard(1) on a 1-D TP mesh, evenly)."
        )
    degrees = sorted(set(sizes.values()) - {1})
    if len(degrees) > 1:
        raise ValueError(f"dmuon.plan.compile: dedicated matrices use different TP degrees {degrees}; use one TP mesh")
    T = degrees[0] if degrees else 1
    if T == 1:
        return 1, specs
    segments = len(_cost.gram_segment_lengths(ns_steps, restart_every))
    out = []
    view_problems = []
    for spec in specs:
        if spec.fqn in dims:
            spec = dataclasses.replace(spec, tp_size=T, tp_shard_dim=dims[spec.fqn], tp_ns="gather")
            if spec.view is not None and spec.view_tp_problem() is not None:
                view_problems.append(f"  {spec.fqn}: {spec.view_tp_problem()}")
                continue
            spec = dataclasses.replace(spec, tp_ns=_cost.choose_tp_ns(spec, tp_ns, segments))
        out.append(spec)
    if view_problems:
        raise ValueError(
            "dmuon.plan.compile: matrix views that tensor parallelism splits:\n" + "\n".join(view_problems)
            + "\nA view works under TP when it cuts the dim TP shards and every TP shard holds whole blocks "
            "(per-head q/k/v with colwise TP, per-head o_proj with rowwise TP, heads divisible by the TP degree); "
            "drop the view for these matrices (matrix_views) or shard them so."
        )
    return T, tuple(out)
