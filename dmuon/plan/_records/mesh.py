"""Reading a mesh: the roles of its dims (:func:`mesh_dim_roles`), the data-parallel ``(R, N)``
(:func:`normalize_mesh`), the one rule for the planner and the runtime, and a mesh written as
text, ``N`` or ``RxN`` (:func:`parse_mesh_text`), the one rule for the command lines."""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ["MESH_DIM_NAMES", "MeshDimRoles", "mesh_dim_roles", "normalize_mesh", "parse_mesh_text"]


#: Dim names recognised on a named mesh, per role, in order of preference (torchtitan names its
#: meshes ``("dp_replicate", "dp_shard", "tp")``, and from 0.3 its FSDP2 mesh
#: ``("dp_replicate", "fsdp")``, ``"fsdp"`` = dp_shard x cp; :func:`mesh_dim_roles`).
MESH_DIM_NAMES = {
    "replicate": ("replicate", "dp_replicate"),
    "shard": ("shard", "dp_shard", "fsdp", "dp"),
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


def parse_mesh_text(text: str) -> tuple[int, ...]:
    """A mesh written as text: ``"8"`` -> ``(8,)`` (N shard ranks), ``"2x8"`` -> ``(2, 8)`` (R
    replicate x N shard; ``X`` also accepted).

    Raises:
        ValueError: not ``N`` or ``RxN`` with positive ints.
    """
    try:
        dims = tuple(int(p) for p in str(text).lower().split("x"))
    except ValueError:
        dims = ()
    if len(dims) not in (1, 2) or any(d < 1 for d in dims):
        raise ValueError(f"mesh must be N or RxN with positive ints, got {text!r}")
    return dims
