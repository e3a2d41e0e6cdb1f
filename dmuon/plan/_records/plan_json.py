"""A :class:`~dmuon.plan._records.plan.ShardingPlan` as JSON: the deterministic dict and text
(fixed key order, ASCII; fields absent at their defaults so older plans keep their bytes), the
reading back (older plans' missing keys take their defaults), and the fingerprint (sha256 of
the text). ``plan.to_json()``, ``ShardingPlan.from_json(text)`` and the others delegate here.
"""

from __future__ import annotations

import hashlib
import json
from typing import TYPE_CHECKING, Any

from dmuon.plan._layout.buffer_layout import Boundary
from dmuon.plan._records.collective_records import CollectiveSettings
from dmuon.plan._records.owners import owner_from_dict
from dmuon.plan._records.params import Fsdp2Unit, ParamSpec
from dmuon.plan._records.qk_clip_records import QKClip

if TYPE_CHECKING:
    from dmuon.plan._records.plan import ShardingPlan

__all__ = [
    "JSON_FORMAT",
    "JSON_FORMAT_V1",
    "JSON_FORMAT_V2",
    "JSON_FORMATS",
    "json_format",
    "to_dict",
    "to_json",
    "from_dict",
    "from_json",
    "fingerprint",
]

#: version tag of :meth:`ShardingPlan.to_json` (``dmuon.plan/3``: the ``collectives`` settings
#: name their link record and may carry separate all-gather numbers,
#: :class:`~dmuon.plan._records.collective_records.CollectiveSettings`). A plan writes the oldest
#: version that holds it: :data:`JSON_FORMAT_V1` (every buffer broadcast, default collective
#: settings), :data:`JSON_FORMAT_V2` (collective settings of the ``"nccl"`` record's form), else this
#: one; so an older plan keeps its bytes and fingerprint. Every version is read.
JSON_FORMAT = "dmuon.plan/3"
#: per-buffer collectives and the plan's ``collectives`` settings (one alpha / B pair, the ``"nccl"`` record)
JSON_FORMAT_V2 = "dmuon.plan/2"
#: the first version: no ``collectives`` key (read as every buffer broadcast)
JSON_FORMAT_V1 = "dmuon.plan/1"
#: every version :func:`from_dict` reads
JSON_FORMATS = (JSON_FORMAT_V1, JSON_FORMAT_V2, JSON_FORMAT)


def json_format(plan: ShardingPlan) -> str:
    """The version :func:`to_dict` writes (the oldest that holds the plan): :data:`JSON_FORMAT` when
    its collective settings name a link other than ``"nccl"`` or carry all-gather numbers,
    :data:`JSON_FORMAT_V2` for other non-default ``collectives`` settings, else :data:`JSON_FORMAT_V1`."""
    if plan.collectives.has_link_fields:
        return JSON_FORMAT
    return JSON_FORMAT_V2 if not plan.collectives.is_default else JSON_FORMAT_V1


def to_dict(plan: ShardingPlan) -> dict[str, Any]:
    """:meth:`ShardingPlan.to_dict`."""
    return {
        "format": json_format(plan),
        "mesh_shape": list(plan.mesh_shape),
        "reshard_after_forward": plan.reshard_after_forward,
        "replicate_async": plan.replicate_async,
        "cost_model": plan.cost_model,
        "align_numel": plan.align_numel,
        "param_dtype": plan.param_dtype,
        "reduce_dtype": plan.reduce_dtype,
        "model_digest": plan.model_digest,
        "params": [p.to_dict() for p in plan.params],
        "owners": [o.to_dict() for o in plan.owners],
        "boundaries": [b.to_dict() for b in plan.boundaries],
        "fsdp2_units": [u.to_dict() for u in plan.fsdp2_units],
        **(
            {  # absent without TP: plans without TP keep their JSON and fingerprint
                "tp_size": plan.tp_size,
                "tp_ns_steps": plan.tp_ns_steps,
                "tp_gram_restart_every": plan.tp_gram_restart_every,
            }
            if plan.tp_size > 1
            else {}
        ),
        **({"qk_clip": plan.qk_clip.to_dict()} if plan.qk_clip is not None else {}),
        # absent at the default (every buffer broadcast): such plans keep the version-1 JSON
        **({"collectives": plan.collectives.to_dict()} if not plan.collectives.is_default else {}),
    }


def to_json(plan: ShardingPlan, *, indent: int | None = None) -> str:
    """:meth:`ShardingPlan.to_json`."""
    seps = (",", ":") if indent is None else (",", ": ")
    return json.dumps(plan.to_dict(), indent=indent, separators=seps, ensure_ascii=True)


def from_dict(cls: type[ShardingPlan], d: dict[str, Any]) -> ShardingPlan:
    """:meth:`ShardingPlan.from_dict`."""
    fmt = d.get("format")
    if fmt not in JSON_FORMATS:
        raise ValueError(f"not a dmuon plan of a known format {JSON_FORMATS} (format={fmt!r})")
    if fmt == JSON_FORMAT_V1 and "collectives" in d:
        raise ValueError(f"a {JSON_FORMAT_V1} plan has no 'collectives' (written by {JSON_FORMAT_V2} and later)")
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
        # absent (every version-1 plan): every buffer broadcast
        collectives=CollectiveSettings.from_dict(d["collectives"]) if "collectives" in d else CollectiveSettings(),
    )


def from_json(cls: type[ShardingPlan], text: str) -> ShardingPlan:
    """:meth:`ShardingPlan.from_json`."""
    return cls.from_dict(json.loads(text))


def fingerprint(plan: ShardingPlan) -> str:
    """:meth:`ShardingPlan.fingerprint`."""
    return hashlib.sha256(plan.to_json().encode("ascii")).hexdigest()
