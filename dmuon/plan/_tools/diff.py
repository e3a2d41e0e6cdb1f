"""Compare two plans by parameter FQN: :func:`diff` -> :class:`PlanDiff`.

Works across mesh sizes, Z2/Z3, dtypes and even different models: parameters are matched by
canonical FQN (an alias of a tied parameter in one plan matches the canonical FQN in the
other), never by position. Owners are compared as records ``(shard, replicate, rank)``, so on
different meshes "moved" means "a different coordinate".
"""

from __future__ import annotations

import dataclasses

from dmuon.plan._cost.cost_model import ByteCost
from dmuon.plan._tools.render import fmt_names, setting_str as _setting_str
from dmuon.plan._records.plan import _SETTINGS, ShardingPlan
from dmuon.plan._records.owners import ExpertOwners, Owner, OwnerGroup
from dmuon.plan._records.params import ParamSpec

__all__ = ["ParamChange", "CostDelta", "SettingChange", "CollectiveChange", "PlanDiff", "diff"]


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ParamChange:
    """What changed for one FQN (``kind``: ``"added"``, ``"removed"`` or ``"changed"``).

    ``*_before`` are None for an added param, ``*_after`` None for a removed one. For
    ``"changed"`` at least one of owner, boundary, spec differs.
    """

    fqn: str
    kind: str
    owner_before: Owner | None
    owner_after: Owner | None
    boundary_before: str | None
    boundary_after: str | None
    spec_before: ParamSpec | None
    spec_after: ParamSpec | None

    @property
    def owner_moved(self) -> bool:
        return self.kind == "changed" and self.owner_before != self.owner_after

    @property
    def boundary_changed(self) -> bool:
        return self.kind == "changed" and self.boundary_before != self.boundary_after

    @property
    def spec_changed(self) -> bool:
        return self.kind == "changed" and self.spec_before != self.spec_after


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class CostDelta:
    """One :class:`~dmuon.plan._cost.cost_model.ByteCost` field (or ``max_rank_nbytes``) in bytes per step."""

    field: str
    before: int
    after: int

    @property
    def delta(self) -> int:
        return self.after - self.before


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class SettingChange:
    """A plan setting (mesh shape, Z2/Z3, dtypes, cost model, alignment, model digest) that differs."""

    name: str
    before: object
    after: object


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class CollectiveChange:
    """A buffer (boundary FQN x :attr:`~dmuon.plan._layout.buffer_layout.BufferLayout.key`) present in both
    plans whose collective or slot differs: ``kind_before`` / ``kind_after`` (``"broadcast"`` or
    ``"all_gather"``), ``slot_before`` / ``slot_after`` (elements; 0 for broadcast)."""

    boundary: str
    buffer: str
    kind_before: str
    kind_after: str
    slot_before: int
    slot_after: int


#: ByteCost fields compared by :func:`diff` (``max_rank_nbytes`` is derived: busiest rank)
COST_FIELDS = ByteCost.PHASES + ("total_nbytes", "max_rank_nbytes")


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class PlanDiff:
    """Differences ``a -> b`` keyed by FQN.

    Attributes:
        before / after: the two plans (``a``, ``b``), for :meth:`to_html`; not compared.
        changes: one :class:`ParamChange` per differing FQN: ``b``'s order first (changed and
            added), then removed params in ``a``'s order.
        costs: one :class:`CostDelta` per field of :data:`COST_FIELDS` (all listed, even if 0).
        settings: differing settings.
        layouts_changed: boundary FQNs present in both plans whose buffers differ.
        collectives_changed: one :class:`CollectiveChange` per buffer of a boundary in both plans
            (matched by boundary FQN and buffer key) whose collective or slot differs.

    ``diff[fqn]`` returns the change for ``fqn`` (KeyError if unchanged); ``bool(diff)`` and
    ``not diff.empty`` are True iff anything differs.
    """

    # the two plans compared (set by diff(); what the HTML page draws), not part of the comparison
    before: ShardingPlan | None = dataclasses.field(default=None, compare=False, repr=False)
    after: ShardingPlan | None = dataclasses.field(default=None, compare=False, repr=False)
    changes: tuple[ParamChange, ...]
    costs: tuple[CostDelta, ...]
    settings: tuple[SettingChange, ...]
    layouts_changed: tuple[str, ...]
    collectives_changed: tuple[CollectiveChange, ...] = ()

    @property
    def empty(self) -> bool:
        return not (self.changes or self.settings or self.layouts_changed or any(c.delta for c in self.costs))

    def __bool__(self) -> bool:
        return not self.empty

    def __getitem__(self, fqn: str) -> ParamChange:
        for change in self.changes:
            if change.fqn == fqn:
                return change
        raise KeyError(f"{fqn!r} is unchanged or unknown in this diff")

    @property
    def by_fqn(self) -> dict[str, ParamChange]:
        return {c.fqn: c for c in self.changes}

    @property
    def added(self) -> tuple[str, ...]:
        return tuple(c.fqn for c in self.changes if c.kind == "added")

    @property
    def removed(self) -> tuple[str, ...]:
        return tuple(c.fqn for c in self.changes if c.kind == "removed")

    @property
    def owners_moved(self) -> tuple[str, ...]:
        return tuple(c.fqn for c in self.changes if c.owner_moved)

    @property
    def boundaries_changed(self) -> tuple[str, ...]:
        return tuple(c.fqn for c in self.changes if c.boundary_changed)

    def cost_delta(self, field: str) -> int:
        """``after - before`` of cost field ``field`` (bytes per step, summed over ranks)."""
        for c in self.costs:
            if c.field == field:
                return c.delta
        raise KeyError(f"unknown cost field {field!r}; one of {COST_FIELDS}")

    def __str__(self) -> str:
        return self.render()

    def render(self, *, max_lines: int = 40) -> str:
        """Readable report; at most ``max_lines`` per-parameter lines."""
        if self.empty:
            return "PlanDiff: no differences"
        out = [
            f"PlanDiff: {len(self.owners_moved)} owner(s) moved, {len(self.boundaries_changed)} boundary change(s), "
            f"+{len(self.added)} / -{len(self.removed)} dedicated param(s)"
        ]
        for s in self.settings:
            out.append(f"  setting {s.name}: {_setting_str(s.before)} -> {_setting_str(s.after)}")
        shown = 0
        for c in self.changes:
            if shown >= max_lines:
                out.append(f"  ... {len(self.changes) - shown} more")
                break
            shown += 1
            if c.kind == "added":
                out.append(f"  + {c.fqn}  {_owner_str(c.owner_after)}  boundary {c.boundary_after}")
            elif c.kind == "removed":
                out.append(f"  - {c.fqn}  was {_owner_str(c.owner_before)}")
            else:
                parts = []
                if c.owner_moved:
                    parts.append(f"{_owner_str(c.owner_before)} -> {_owner_str(c.owner_after)}")
                if c.boundary_changed:
                    parts.append(f"boundary {c.boundary_before} -> {c.boundary_after}")
                if c.spec_changed:
                    a, b = c.spec_before, c.spec_after
                    parts.append(f"spec {_spec_str(a)} -> {_spec_str(b)}")
                out.append(f"  ~ {c.fqn}  " + "; ".join(parts))
        if self.layouts_changed:
            names = fmt_names(self.layouts_changed, 8)
            out.append(f"  layouts changed in {len(self.layouts_changed)} boundary(ies): {names}")
        for c in self.collectives_changed[:max_lines]:
            out.append(
                f"  collective {c.boundary} {c.buffer}: {c.kind_before} (slot {c.slot_before:,}) -> {c.kind_after} "
                f"(slot {c.slot_after:,})"
            )
        if len(self.collectives_changed) > max_lines:
            out.append(f"  ... {len(self.collectives_changed) - max_lines} more collective changes")
        out.append("  bytes per step (all ranks)          before            after            delta")
        for c in self.costs:
            out.append(f"  {c.field:<28} {c.before:>16,} {c.after:>16,} {c.delta:>+16,}")
        return "\n".join(out)

    def to_html(self) -> str:
        """The diff as a standalone HTML page (both ownership maps with the changed owners
        outlined, bytes per phase / boundary / rank before and after; docs/planning.md, "Pages
        you can see"). Raises ValueError for a diff built without its plans."""
        from dmuon.plan._tools.html.diff_page import diff_html

        return diff_html(self, standalone=True)

    def _repr_html_(self) -> str:
        from dmuon.plan._tools.html.diff_page import diff_html

        return diff_html(self)

    def __repr__(self) -> str:  # short; str() is the report
        return (
            f"PlanDiff(changes={len(self.changes)}, settings={len(self.settings)}, "
            f"layouts_changed={len(self.layouts_changed)}, empty={self.empty})"
        )


def diff(a: ShardingPlan, b: ShardingPlan) -> PlanDiff:
    """Differences from plan ``a`` to plan ``b``, keyed by FQN (module docstring); the result
    keeps ``a`` and ``b`` (``before`` / ``after``) for its page."""
    return dataclasses.replace(_compare(a, b), before=a, after=b)


def _compare(a: ShardingPlan, b: ShardingPlan) -> PlanDiff:
    """:func:`diff` without the plans attached."""
    if not isinstance(a, ShardingPlan) or not isinstance(b, ShardingPlan):
        raise TypeError("dmuon.plan.diff expects two ShardingPlan objects")
    changes: list[ParamChange] = []
    for spec_b, owner_b in zip(b.params, b.owners):
        key = next((alias for alias in spec_b.aliases if a.is_dedicated(alias)), None)
        if key is None:
            changes.append(
                ParamChange(
                    fqn=spec_b.fqn,
                    kind="added",
                    owner_before=None,
                    owner_after=owner_b,
                    boundary_before=None,
                    boundary_after=b.boundary(spec_b.fqn),
                    spec_before=None,
                    spec_after=spec_b,
                )
            )
            continue
        spec_a, owner_a, bnd_a = a.param(key), a.owner_record(key), a.boundary(key)
        bnd_b = b.boundary(spec_b.fqn)
        if (spec_a, owner_a, bnd_a) != (spec_b, owner_b, bnd_b):
            changes.append(
                ParamChange(
                    fqn=spec_b.fqn,
                    kind="changed",
                    owner_before=owner_a,
                    owner_after=owner_b,
                    boundary_before=bnd_a,
                    boundary_after=bnd_b,
                    spec_before=spec_a,
                    spec_after=spec_b,
                )
            )
    for spec_a, owner_a in zip(a.params, a.owners):
        if not any(b.is_dedicated(alias) for alias in spec_a.aliases):
            changes.append(
                ParamChange(
                    fqn=spec_a.fqn,
                    kind="removed",
                    owner_before=owner_a,
                    owner_after=None,
                    boundary_before=a.boundary(spec_a.fqn),
                    boundary_after=None,
                    spec_before=spec_a,
                    spec_after=None,
                )
            )
    ca, cb = a.cost, b.cost
    costs = tuple(CostDelta(field=f, before=getattr(ca, f), after=getattr(cb, f)) for f in COST_FIELDS)
    settings = tuple(
        SettingChange(name=n, before=getattr(a, n), after=getattr(b, n))
        for n in _SETTINGS
        if getattr(a, n) != getattr(b, n)
    )
    a_bounds = {bd.fqn: bd for bd in a.boundaries}
    layouts_changed = tuple(bd.fqn for bd in b.boundaries if bd.fqn in a_bounds and a_bounds[bd.fqn] != bd)
    collectives_changed = []
    for bd in b.boundaries:
        bufs_a = {buf.key: buf for buf in a_bounds[bd.fqn].buffers} if bd.fqn in a_bounds else {}
        for buf in bd.buffers:
            old = bufs_a.get(buf.key)
            if old is not None and (old.collective, old.slot_numel) != (buf.collective, buf.slot_numel):
                collectives_changed.append(
                    CollectiveChange(
                        boundary=bd.fqn,
                        buffer=buf.key,
                        kind_before=old.collective,
                        kind_after=buf.collective,
                        slot_before=old.slot_numel,
                        slot_after=buf.slot_numel,
                    )
                )
    return PlanDiff(
        changes=tuple(changes),
        costs=costs,
        settings=settings,
        layouts_changed=layouts_changed,
        collectives_changed=tuple(collectives_changed),
    )


def _owner_str(o) -> str:
    """``owner rank 3 (s3,r0)`` / ``owner group ranks 0,1 (s0,s1; r0) rows 24+24`` /
    ``expert owners ranks 0,1 (s0,s1; r0) experts 4+4``."""
    if isinstance(o, ExpertOwners):
        shards = ",".join(f"s{m.shard}" for m in o.members)
        ranks = ",".join(str(r) for r in o.ranks)
        local = " expert-parallel, local" if o.local else ""
        return f"expert owners ranks {ranks} ({shards}; r{o.replicate}) experts {'+'.join(map(str, o.sizes))}{local}"
    if isinstance(o, OwnerGroup):
        cut = "rows" if o.dim == 0 else "cols"
        shards = ",".join(f"s{m.shard}" for m in o.members)
        ranks = ",".join(str(r) for r in o.ranks)
        return f"owner group ranks {ranks} ({shards}; r{o.replicate}) {cut} {'+'.join(map(str, o.sizes))}"
    return f"owner rank {o.rank} (s{o.shard},r{o.replicate})"


def _spec_str(spec: ParamSpec) -> str:
    """Shape and dtype, plus the TP split and Newton-Schulz method when tensor-parallel."""
    text = f"{spec.shape} {spec.dtype}"
    if spec.tp_size > 1:
        text += f" TP {spec.tp_size} Shard({spec.tp_shard_dim}) {spec.tp_ns}"
    if spec.view is not None:
        text += f" view [{spec.view.describe(spec.shape)}]"
    if spec.experts is not None:
        text += f" experts [{spec.experts.describe(spec.shape)}]"
    return text
