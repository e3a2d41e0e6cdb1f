"""The sharding plan record: :class:`ShardingPlan`, its validation and its optree registration.

Where its methods delegate, and its optree registration: Note: the plan record (docs/design.md).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import optree

from dmuon.plan._cost import cost_model as _cost
from dmuon.plan import _rules as _rules
from dmuon.plan._layout.buffer_layout import (
    Boundary,
    BufferLayout,
    LayoutEntry,
    Segment,
    SubSegment,
    check_buffer_layout,
)
from dmuon.plan._records.collective_records import CollectiveSettings
from dmuon.plan._records.qk_clip_records import QKClip
from dmuon.plan._records.fields import _check_int, check_dtype_str
from dmuon.plan._records.owners import Owner, OwnerGroup, ExpertOwners
from dmuon.plan._records.params import Fsdp2Unit, ParamSpec
from dmuon.plan._records import plan_figures as _plan_figures
from dmuon.plan._records import plan_index as _plan_index
from dmuon.plan._records import plan_json as _plan_json

__all__ = [
    "ShardingPlan",
    "Owner",
    "OwnerGroup",
    "ExpertOwners",
    "ParamSpec",
    "LayoutEntry",
    "SubSegment",
    "Segment",
    "BufferLayout",
    "Boundary",
    "ByteCost",
]

ByteCost = _cost.ByteCost

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
    "collectives",
)


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
            :class:`~dmuon.plan._records.owners.Owner`, or an :class:`~dmuon.plan._records.owners.OwnerGroup`
            (``compile(owner_groups=...)``: ``k`` ranks of one replicate row each owning a block
            of the matrix along its long side; its layout has one entry per block).
        boundaries: hook boundaries with their buffers, first-appearance order in ``named_modules()``.
        model_digest: sha256 hex of the snapshot of ALL parameters (names, shapes, dtypes, ties).
        tp_size: tensor-parallel degree ``T`` of the dedicated matrices (1 = no TP). With
            ``T > 1`` the mesh ``(R, N)`` is the data-parallel mesh of each TP coordinate, the
            layouts hold one TP rank's shards (identical on every TP coordinate), owners are
            data-parallel coordinates (the owner's ``T`` TP ranks form its owner group) and the
            world is ``R*N*T`` ranks (:class:`~dmuon.plan._cost.cost_model.ByteCost` indexing).
        tp_ns_steps / tp_gram_restart_every: the Newton-Schulz steps and Gram restart period
            the TP byte cost assumes (one Gram all-reduce per segment,
            :func:`~dmuon.plan._rules.gram_segment_lengths`); ``dmuon.Muon`` checks that its
            ``ns_steps`` agrees.
        fsdp2_units: the non-dedicated parameters per ``fully_shard`` unit
            (:class:`~dmuon.plan._records.params.Fsdp2Unit`), hook-boundary units in module order,
            then the root's: the schedule's external FSDP2 ops. Not part of the cost.
        qk_clip: QK-clip (MuonClip) settings (:class:`~dmuon.plan._records.qk_clip_records.QKClip`) or None; with
            them the schedule holds the per-step all-reduce (max) of the per-head logits.
        collectives: how the collective of every buffer was chosen
            (:class:`~dmuon.plan._records.collective_records.CollectiveSettings`: the mode of
            ``compile(collectives=...)`` and the alpha / B of its ``"auto"`` rule); each buffer's
            choice is its :attr:`~dmuon.plan._layout.buffer_layout.BufferLayout.collective`. Default
            (and plans read from ``dmuon.plan/1`` JSON): ``mode="broadcast"``.

    Raises (construction):
        ValueError / TypeError: any invariant below is violated: owner coordinates inside the
        mesh and ``rank == replicate*N + shard``; unique FQNs/aliases; each parameter in exactly
        one boundary buffer with its owner, numel, shape and dtype; layouts aligned and packed
        per :mod:`dmuon.plan._layout.buffer_layout`.
    """

    mesh_shape: tuple[int, int]
    reshard_after_forward: bool
    replicate_async: bool
    cost_model: str
    align_numel: int
    param_dtype: str | None
    reduce_dtype: str | None
    params: tuple[ParamSpec, ...]
    owners: tuple[Owner | OwnerGroup | ExpertOwners, ...]
    boundaries: tuple[Boundary, ...]
    model_digest: str
    tp_size: int = 1
    tp_ns_steps: int = 5
    tp_gram_restart_every: int | None = 2
    fsdp2_units: tuple[Fsdp2Unit, ...] = ()
    qk_clip: QKClip | None = None
    collectives: CollectiveSettings = CollectiveSettings()
    # FQN lookup tables, built once at construction (__post_init__, or _unflatten); never written after
    _index: dict | None = dataclasses.field(default=None, init=False, repr=False, compare=False)
    # (nominal step schedule, its ByteCost): derived once at construction, like _index; never written after
    _nominal: tuple | None = dataclasses.field(default=None, init=False, repr=False, compare=False)

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
        if self.cost_model not in _rules.COST_MODELS:
            raise ValueError(f"ShardingPlan.cost_model must be one of {_rules.COST_MODELS}, got {self.cost_model!r}")
        _check_int("ShardingPlan", "align_numel", self.align_numel, 1)
        check_dtype_str("ShardingPlan", "param_dtype", self.param_dtype, optional=True)
        check_dtype_str("ShardingPlan", "reduce_dtype", self.reduce_dtype, optional=True)
        if not isinstance(self.model_digest, str):
            raise TypeError("ShardingPlan.model_digest must be a str")
        for name, cls in (
            ("params", ParamSpec),
            ("owners", (Owner, OwnerGroup, ExpertOwners)),
            ("boundaries", Boundary),
            ("fsdp2_units", Fsdp2Unit),
        ):
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
            for o in owner.members if isinstance(owner, (OwnerGroup, ExpertOwners)) else (owner,):
                if o.shard >= N or o.replicate >= R or o.rank != o.replicate * N + o.shard:
                    raise ValueError(f"ShardingPlan: owner {o} of {spec.fqn} is not on mesh (R={R}, N={N})")
            if isinstance(owner, ExpertOwners) and (spec.experts is None or sum(owner.sizes) != spec.num_experts):
                raise ValueError(
                    f"ShardingPlan: {spec.fqn} {spec.shape} has expert owners with ranges {owner.sizes} but "
                    + ("no expert-stack layout" if spec.experts is None else f"{spec.num_experts} experts")
                )
            ep = spec.ep_size
            if ep > 1 or (isinstance(owner, ExpertOwners) and owner.local):
                problem = _ep_owner_problem(spec, owner, R, N)
                if problem:
                    raise ValueError(
                        f"ShardingPlan: {spec.fqn} is expert-parallel (ep_size {ep}) but its owner is {owner}: {problem}"
                    )
            if isinstance(owner, OwnerGroup):
                problem = _rules.owner_group_problem(spec)
                if problem is not None:
                    raise ValueError(f"ShardingPlan: {spec.fqn} has an owner group but {problem}")
                if owner.dim != _rules.owner_group_dim(spec.shape) or sum(owner.sizes) != spec.shape[owner.dim]:
                    raise ValueError(
                        f"ShardingPlan: owner group of {spec.fqn} {spec.shape} must cut its long side "
                        f"(dim {_rules.owner_group_dim(spec.shape)}) into blocks summing to it, got dim {owner.dim} "
                        f"sizes {owner.sizes}"
                    )
        if not isinstance(self.collectives, CollectiveSettings):
            raise TypeError("ShardingPlan.collectives must be a CollectiveSettings")
        index = self._build_index()
        seen: set[str] = set()
        for boundary in self.boundaries:
            if boundary.fqn in seen:
                raise ValueError(f"ShardingPlan: boundary {boundary.fqn!r} listed twice")
            seen.add(boundary.fqn)
            for buf in boundary.buffers:
                check_buffer_layout(buf, self.align_numel)
                problem = _collective_problem(buf, self.collectives.mode, N)
                if problem:
                    raise ValueError(f"ShardingPlan: buffer {buf.key} of boundary {boundary.fqn!r}: {problem}")
                for entry in buf.entries():
                    i = index["canonical"].get(entry.fqn)
                    if i is None:
                        raise ValueError(f"ShardingPlan: layout entry {entry.fqn!r} is not a dedicated param")
                    spec, owner = self.params[i], self.owners[i]
                    if isinstance(owner, ExpertOwners) and owner.local:
                        raise ValueError(
                            f"ShardingPlan: layout entry {entry.fqn!r} of an expert-parallel stack (its experts are "
                            "local to each rank and have no buffer entry)"
                        )
                    if isinstance(owner, (OwnerGroup, ExpertOwners)):
                        j = entry.block
                        ok = j is not None and j < owner.k and entry.owner == owner.members[j]
                        expected = tuple(owner.block_shape(j, spec.shape)) if ok else None
                        ok = ok and entry.shape == expected and entry.numel == math.prod(expected)
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
                        raise ValueError(
                            f"ShardingPlan: qk_clip names {rows.fqn!r}, which is not a dedicated parameter"
                        )
        object.__setattr__(self, "_index", index)
        object.__setattr__(self, "_nominal", self._build_nominal())

    def _build_nominal(self) -> tuple:
        return _plan_figures.nominal(self)

    def _build_index(self) -> dict:
        return _plan_index.build_index(self)

    def _idx(self) -> dict:
        return self._index  # type: ignore[return-value]

    # ------------------------------------------------------------------ lookups
    @property
    def world_size(self) -> int:
        """``R * N`` data-parallel mesh ranks (the LPT slots; times ``tp_size`` for the world)."""
        return self.mesh_shape[0] * self.mesh_shape[1]

    @property
    def ep_size(self) -> int:
        """Expert-parallel degree of the plan's expert stacks (``compile(ep=...)``; 1 = none)."""
        return max((spec.ep_size for spec in self.params), default=1)

    @property
    def tp_segment_lengths(self) -> tuple[int, ...]:
        """Steps per Gram NS segment assumed for TP ``"gram"`` matrices (one all-reduce each)."""
        return _rules.gram_segment_lengths(self.tp_ns_steps, self.tp_gram_restart_every)

    @property
    def dedicated(self) -> tuple[str, ...]:
        """Canonical FQNs of dedicated parameters, ``named_parameters()`` order."""
        return tuple(p.fqn for p in self.params)

    def _lookup(self, fqn: str) -> int:
        return _plan_index.lookup(self, fqn)

    def owner(self, fqn: str) -> Owner | OwnerGroup:
        """Owner (or owner group) of dedicated parameter ``fqn`` (any alias). Raises KeyError
        with close matches, and ValueError for an expert stack whose experts have several
        owners (use :meth:`expert_owners`)."""
        return _plan_index.owner(self, fqn)

    def owner_record(self, fqn: str) -> Owner | OwnerGroup | ExpertOwners:
        """The ownership record of ``fqn`` (any alias) as the plan stores it, whatever its kind
        (``plan.owners[i]``); :meth:`owner` is the same but refuses a multi-owner expert stack."""
        return _plan_index.owner_record(self, fqn)

    def expert_owners(self, fqn: str) -> tuple[Owner, ...]:
        """The :class:`Owner` of every expert of expert stack ``fqn`` (any alias), expert order
        (``len == E``). Raises KeyError (unknown FQN, close matches named) or ValueError (not an
        expert stack)."""
        return _plan_index.expert_owners(self, fqn)

    def param(self, fqn: str) -> ParamSpec:
        """:class:`ParamSpec` of ``fqn`` (any alias). Raises KeyError with close matches."""
        return _plan_index.param(self, fqn)

    def boundary(self, fqn: str) -> str:
        """FQN of the hook boundary module serving ``fqn`` (any alias). Raises KeyError."""
        return _plan_index.boundary(self, fqn)

    def boundary_record(self, fqn: str) -> Boundary:
        """The :class:`Boundary` (with buffers) serving parameter ``fqn`` (any alias)."""
        return _plan_index.boundary_record(self, fqn)

    def is_dedicated(self, fqn: str) -> bool:
        """True iff ``fqn`` (any alias) is a dedicated parameter."""
        return _plan_index.is_dedicated(self, fqn)

    def bcast_dtype(self, param_dtype_str: str) -> str:
        """Broadcast wire dtype for a parameter stored as ``param_dtype_str``."""
        return _rules.bcast_dtype(param_dtype_str, self.param_dtype)

    def reduce_dtype_for(self, param_dtype_str: str) -> str:
        """Gradient-reduce wire dtype for a parameter stored as ``param_dtype_str``."""
        return _rules.reduce_dtype(param_dtype_str, self.param_dtype, self.reduce_dtype)

    # ------------------------------------------------------------------ derived figures
    # Pure functions of the plan, computed on every access (nothing is cached on a frozen
    # record): bind the result once where it is read repeatedly.
    @property
    def owned_numel(self) -> tuple[int, ...]:
        """Elements owned per mesh rank (global owners only), length ``R*N``."""
        return _plan_figures.owned_numel(self)

    @property
    def owned_weight(self) -> tuple[int, ...]:
        """LPT weight (``cost_model`` unit) owned per mesh rank."""
        return _plan_figures.owned_weight(self)

    @property
    def balance_bound(self) -> float:
        """Proven LPT bound on ``max(owned_weight)``: ``total/(R*N) + max item weight``, items
        being the matrices (owner-group members' blocks counted as items of their own); on an
        HSDP mesh with owner groups of up to ``K`` members the mean term carries
        ``lpt_partition_groups``' factor ``N/(N-K+1)`` (a group stays in one replicate row); on
        an HSDP mesh with expert stacks, at least ``total/(R*N) + heaviest whole matrix or stack
        / N + max item weight`` (the level fill by replicate rows,
        :mod:`dmuon.plan._ownership.level_fill`)."""
        return _plan_figures.balance_bound(self)

    def schedule(self, step: Any = None) -> Any:
        """:func:`dmuon.plan._scheduling.builder.schedule` of this plan: every rank's ops for ``step``
        (a :class:`~dmuon.plan._scheduling.ops.Step`; None = the nominal step, built once with
        the plan)."""
        return _plan_figures.schedule(self, step)

    @property
    def cost(self) -> ByteCost:
        """:class:`ByteCost`: DMuon bytes per step summed over all ranks (+ per rank), summed
        from the nominal step's schedule (:func:`~dmuon.plan._cost.nbytes.schedule_byte_cost`); computed
        once, when the plan is built."""
        return _plan_figures.cost(self)

    def _baseline_params(self) -> tuple[ParamSpec, ...]:
        return _plan_figures.baseline_params(self)

    @property
    def baseline_cost(self) -> _cost.BaselineByteCost:
        """Bytes per step of FSDP2 + naive all-gather Muon on the same parameters."""
        return _plan_figures.baseline_cost(self)

    @property
    def assembled_nbytes(self) -> dict[str, int]:
        """Owner groups and expert stacks with several owners: per boundary FQN, the bytes of
        the full compute tensors every rank assembles from the blocks / expert ranges while the
        boundary is unsharded (broadcast dtype; an expert-parallel stack: the rank's ``E/ep``
        experts); empty without them. Stacks received in place (an all-gathered buffer whose
        ranges are single experts at one slot offset,
        :func:`~dmuon.plan._layout.slots.in_place_stacks`) are views of the gathered tensor and
        assemble nothing."""
        return _plan_figures.assembled_nbytes(self)

    def rank_stats(self, *, variant: str = "muon", offload: bool = False) -> tuple[_cost.RankStats, ...]:
        """Per-rank :class:`~dmuon.plan._cost.cost_model.RankStats` of this plan (schedule ranks: the mesh
        rank, or ``(replicate*N + shard)*T + tp`` with TP), from the nominal schedule; each with
        its whole memory by term (``.memory``, :class:`~dmuon.plan._cost.cost_model.MemoryTerms`) for
        ``dmuon.Muon(variant=variant)`` (``"muon"`` or ``"normuon"``: its second moment).
        ``offload=True``: under ``dedicate_params(offload_policy=CPUOffloadPolicy(...))`` (and the same
        policy to ``fully_shard``): the terms are the compute device's (``peak_nbytes``, the device
        peak) and ``host_*_nbytes`` the host's. Raises ``NotImplementedError`` / ``ValueError`` where
        the runtime refuses offload (TP, owner groups, NorMuon; EP-local stacks are not modelled)."""
        return _plan_figures.rank_stats(self, variant, offload)

    def baseline_rank_stats(self, *, offload: bool = False) -> tuple[_cost.RankStats, ...]:
        """Per-rank :class:`~dmuon.plan._cost.cost_model.RankStats` of FSDP2 + naive Muon, same parameters
        (``.memory``: the whole model's memory under it; ``offload=True``: under FSDP2's
        ``CPUOffloadPolicy``, device and host terms apart, as :meth:`rank_stats`)."""
        return _plan_figures.baseline_rank_stats(self, offload)

    def adamw_rank_stats(self, *, offload: bool = False) -> tuple[_cost.RankStats, ...]:
        """Per-rank :class:`~dmuon.plan._cost.cost_model.RankStats` of FSDP2 + AdamW on the same mesh:
        every parameter sharded by FSDP2 and updated by AdamW (two moments), no Newton-Schulz
        (``.memory``: the whole model's memory under it, the figure dmuon's busiest rank is
        held against; ``offload=True``: under FSDP2's ``CPUOffloadPolicy``, device and host terms
        apart, as :meth:`rank_stats`)."""
        return _plan_figures.adamw_rank_stats(self, offload)

    # ------------------------------------------------------------------ serialisation
    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (field order fixed; see :meth:`to_json`)."""
        return _plan_json.to_dict(self)

    def to_json(self, *, indent: int | None = None) -> str:
        """Deterministic JSON text (ASCII, fixed key order); ``from_json(to_json()) == self``."""
        return _plan_json.to_json(self, indent=indent)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ShardingPlan:
        return _plan_json.from_dict(cls, d)

    @classmethod
    def from_json(cls, text: str) -> ShardingPlan:
        """Inverse of :meth:`to_json` (validates). Raises ValueError on a malformed plan."""
        return _plan_json.from_json(cls, text)

    def fingerprint(self) -> str:
        """sha256 hex of :meth:`to_json` (compared across ranks at apply time)."""
        return _plan_json.fingerprint(self)

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

    def summary(self, *, max_rows: int = 16, offload: bool = False) -> str:
        """Plain-text report: settings, per-rank load vs. the LPT bound, bytes vs. the baseline.
        ``offload=True``: the memory block under CPU offload (device terms, then host memory;
        :meth:`rank_stats`)."""
        from dmuon.plan._tools.render import render_summary

        return render_summary(self, max_rows=max_rows, offload=offload)

    def expert_lines(self) -> list[str]:
        """The summary's experts lines (empty without expert stacks): stacks, experts, Muon
        matrices, layouts, and where they are owned (ranks owning experts, experts per owner)."""
        from dmuon.plan._tools.render import expert_lines

        return expert_lines(self)

    def to_html(self) -> str:
        """The plan as a standalone HTML page: header card, ownership map, per-rank bars, bytes
        per phase, collectives per boundary, experts, the step schedule (inline SVG, no
        JavaScript; docs/planning.md, "Pages you can see"). ``summary()`` is the text form."""
        from dmuon.plan._tools.html.plan_page import plan_html

        return plan_html(self, standalone=True)

    def _repr_html_(self) -> str:
        from dmuon.plan._tools.html.plan_page import plan_html

        return plan_html(self)


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
    try:  # lookups and the nominal schedule of a plan of records; a plan mapped to other leaves has none
        index = plan._build_index()
        object.__setattr__(plan, "_index", index)
        nominal = plan._build_nominal()
    except (AttributeError, TypeError, ValueError, KeyError):
        index = nominal = None
    object.__setattr__(plan, "_index", index)
    object.__setattr__(plan, "_nominal", nominal)
    return plan


optree.register_pytree_node(
    ShardingPlan,
    _flatten,
    _unflatten,
    path_entry_type=optree.GetAttrEntry,
    namespace="dmuon",
)


def _collective_problem(buf: BufferLayout, mode: str, N: int) -> str:
    """Why ``buf``'s collective disagrees with the plan's ``collectives`` mode ("" if it does
    not): a one-rank group moves nothing (broadcast); a forced mode holds for every buffer."""
    k = buf.group_size(N)
    if buf.collective == "all_gather" and k < 2:
        return "an all-gather over a one-rank group (nothing moves: 'broadcast')"
    if mode == "broadcast" and buf.collective != "broadcast":
        return f"collective {buf.collective!r} under collectives='broadcast'"
    if mode == "all_gather" and k >= 2 and buf.collective != "all_gather":
        return f"collective {buf.collective!r} under collectives='all_gather'"
    return ""


def _ep_owner_problem(spec: ParamSpec, owner: Any, R: int, N: int) -> str:
    """Why ``owner`` cannot own expert-parallel ``spec`` on mesh ``(R, N)`` ("" if it can).

    ``ep = N``, ``R = 1``: ``ExpertOwners(local=True)`` over every shard rank. Otherwise
    (``efsdp = N/ep > 1`` or ``R > 1``): ranges in global expert order, each owned inside the
    efsdp group that holds it (member shard ``= j (mod ep)`` for a range of EP coordinate ``j``),
    every coordinate cut alike."""
    ep = spec.ep_size
    if not isinstance(owner, ExpertOwners) or ep < 2 or N % ep:
        return "expert parallelism needs an ExpertOwners record and ep dividing N"
    if owner.local:
        return "" if owner.k == ep == N and R == 1 else "ExpertOwners(local=True) needs ep = N and R = 1"
    if ep == N and R == 1:
        return "with ep = N and R = 1 the stack is owned locally (ExpertOwners(local=True))"
    per = spec.experts.local_experts
    k, rem = divmod(owner.k, ep)
    if rem or owner.sizes != owner.sizes[:k] * ep or sum(owner.sizes[:k]) != per:
        return f"ranges must cut each EP coordinate's {per} experts alike"
    for q, member in enumerate(owner.members):
        if member.shard % ep != q // k:
            return f"range {q} (EP coordinate {q // k}) is owned by shard {member.shard}, outside its efsdp group"
    return ""
