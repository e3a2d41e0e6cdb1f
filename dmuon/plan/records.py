"""Per-parameter plan records: :class:`Owner`, :class:`ParamSpec`, and dtype helpers.

Every record here is a frozen dataclass (``slots=True, kw_only=True``) holding only ints,
strings and tuples, validated once in ``__post_init__``; derive new ones with
:func:`dataclasses.replace` (which re-validates). They are optree *leaves* of a
:class:`~dmuon.plan.plan.ShardingPlan` (see ``plan.py`` for the tree registration).

Dtypes are carried as strings, exactly as ``str(torch.dtype)`` prints them
(``"torch.float32"``, ``"torch.bfloat16"``), so plans serialise to JSON without torch objects.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

__all__ = [
    "Owner",
    "ParamSpec",
    "Fsdp2Unit",
    "dtype_str",
    "itemsize_nbytes",
    "check_dtype_str",
]


def _check_int(owner: str, name: str, value: Any, minimum: int) -> None:
    if type(value) is not int:  # bool and numpy ints rejected on purpose: JSON must round-trip
        raise TypeError(f"{owner}.{name} must be an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{owner}.{name} must be >= {minimum}, got {value}")


def _check_shape(owner: str, name: str, value: Any) -> None:
    if type(value) is not tuple:
        raise TypeError(f"{owner}.{name} must be a tuple of ints, got {type(value).__name__}")
    for d in value:
        _check_int(owner, name + "[i]", d, 0)


def check_dtype_str(owner: str, name: str, value: Any, *, optional: bool = False) -> None:
    """Raise unless ``value`` is ``"torch.<name>"`` naming a ``torch.dtype`` (or None if optional)."""
    if value is None and optional:
        return
    if not isinstance(value, str) or not value.startswith("torch."):
        raise ValueError(f"{owner}.{name} must be a dtype string like 'torch.float32', got {value!r}")
    if not isinstance(getattr(torch, value[len("torch."):], None), torch.dtype):
        raise ValueError(f"{owner}.{name}: {value!r} is not a torch dtype")


def dtype_str(dtype: Any) -> str | None:
    """Normalise a ``torch.dtype``, a dtype string (``"torch.bfloat16"`` or ``"bfloat16"``) or
    None to the canonical string form (``str(torch.dtype)``) or None.

    Raises:
        ValueError: the value does not name a torch dtype.
    """
    if dtype is None:
        return None
    if isinstance(dtype, torch.dtype):
        return str(dtype)
    if isinstance(dtype, str):
        name = dtype[len("torch."):] if dtype.startswith("torch.") else dtype
        resolved = getattr(torch, name, None)
        if isinstance(resolved, torch.dtype):
            return str(resolved)
    raise ValueError(f"not a torch dtype: {dtype!r}")


def itemsize_nbytes(dtype: str) -> int:
    """Bytes per element of the dtype named by ``dtype`` (e.g. ``"torch.bfloat16"`` -> 2)."""
    resolved = getattr(torch, dtype[len("torch."):] if dtype.startswith("torch.") else dtype, None)
    if not isinstance(resolved, torch.dtype):
        raise ValueError(f"not a torch dtype: {dtype!r}")
    return resolved.itemsize


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Owner:
    """The single mesh rank that owns a dedicated parameter.

    Attributes:
        shard: coordinate along the shard mesh dimension, ``0 <= shard < N``.
        replicate: coordinate along the replicate dimension, ``0 <= replicate < R`` (0 on a 1-D mesh).
        rank: flat mesh rank ``replicate * N + shard`` (the layout of
            ``init_device_mesh(device, (R, N), mesh_dim_names=("replicate", "shard"))``).

    The invariant ``rank == replicate * N + shard`` needs N, which an Owner does not carry; the
    plan checks it (:class:`~dmuon.plan.plan.ShardingPlan` validation) and :meth:`at` builds it.
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


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ParamSpec:
    """A dedicated parameter as the plan sees it.

    Attributes:
        fqn: canonical FQN (first name of the tensor in ``model.named_parameters()`` order).
        shape: logical shape of the full parameter (elements per dim).
        dtype: storage dtype string, e.g. ``"torch.float32"``.
        numel: ``prod(shape)`` elements.
        matrix_shape: ``(m, n)`` of each matrix Muon orthogonalises: ``shape`` for 2-D, ``(out,
            in * prod(kernel))`` for an ``nn.Conv{1,2,3}d`` weight, ``shape[1:]`` for a 3-D
            expert stack ``(E, m, n)``.
        num_matrices: 1, or ``E`` for an expert stack. ``num_matrices * m * n == numel``.
        aliases: every name of this tensor, ``fqn`` first, in
            ``named_parameters(remove_duplicate=False)`` order.
        module_fqn: FQN of the canonical owning module (``""`` = the root module).
        attr: attribute name of the parameter on that module; ``fqn == module_fqn + "." + attr``
            (or ``attr`` alone when ``module_fqn == ""``).
        tp_size: ``T``, ranks of the tensor-parallel mesh that shards this matrix (1 = no TP).
        tp_shard_dim: the dim of ``shape`` TP shards (``Shard(0)``: colwise ``nn.Linear``
            weight, ``Shard(1)``: rowwise), ``shape[dim] % T == 0``; None without TP.
        tp_ns: how the owner's TP group orthogonalises it: ``"gram"`` (each TP rank keeps its
            shard; one all-reduce of the fp32 Gram ``(d, d)`` per Gram NS segment, ``d`` = the
            side TP does not shard) or ``"gather"`` (all-gather the update, every TP rank runs
            NS on the full matrix and keeps its shard); None without TP.
            See :func:`dmuon.plan.cost.choose_tp_ns`.
        ns_backend: the Newton-Schulz backend its owner runs, ``"standard"`` (default) or
            ``"gram"`` (``compile(ns_backend=...)``, :func:`dmuon.plan.cost.choose_ns_backend`);
            ``cost_model="ns_flops"`` weighs it by that backend's FLOPs and ``dmuon.Muon``
            checks that it runs it. Always ``"standard"`` for a TP-sharded matrix (``tp_ns``
            decides there).
    """

    fqn: str
    shape: tuple[int, ...]
    dtype: str
    numel: int
    matrix_shape: tuple[int, int]
    num_matrices: int
    aliases: tuple[str, ...]
    module_fqn: str
    attr: str
    tp_size: int = 1
    tp_shard_dim: int | None = None
    tp_ns: str | None = None
    ns_backend: str = "standard"

    @property
    def local_shape(self) -> tuple[int, ...]:
        """Shape of one TP rank's shard (``shape`` without TP): elements per dim."""
        if self.tp_size == 1:
            return self.shape
        d = self.tp_shard_dim
        return self.shape[:d] + (self.shape[d] // self.tp_size,) + self.shape[d + 1 :]

    @property
    def local_numel(self) -> int:
        """Elements of one TP rank's shard (``numel`` without TP)."""
        return self.numel // self.tp_size

    def __post_init__(self) -> None:
        if not isinstance(self.fqn, str) or not self.fqn:
            raise ValueError(f"ParamSpec.fqn must be a non-empty str, got {self.fqn!r}")
        _check_shape("ParamSpec", "shape", self.shape)
        check_dtype_str("ParamSpec", "dtype", self.dtype)
        _check_int("ParamSpec", "numel", self.numel, 0)
        if self.numel != math.prod(self.shape):
            raise ValueError(f"ParamSpec {self.fqn}: numel {self.numel} != prod(shape {self.shape})")
        _check_shape("ParamSpec", "matrix_shape", self.matrix_shape)
        if len(self.matrix_shape) != 2:
            raise ValueError(f"ParamSpec {self.fqn}: matrix_shape must be (m, n), got {self.matrix_shape}")
        _check_int("ParamSpec", "num_matrices", self.num_matrices, 1)
        if self.num_matrices * self.matrix_shape[0] * self.matrix_shape[1] != self.numel:
            raise ValueError(
                f"ParamSpec {self.fqn}: num_matrices * m * n = {self.num_matrices} * "
                f"{self.matrix_shape[0]} * {self.matrix_shape[1]} != numel {self.numel}"
            )
        if type(self.aliases) is not tuple or not self.aliases or self.aliases[0] != self.fqn:
            raise ValueError(f"ParamSpec {self.fqn}: aliases must be a tuple starting with fqn, got {self.aliases!r}")
        if len(set(self.aliases)) != len(self.aliases):
            raise ValueError(f"ParamSpec {self.fqn}: duplicate aliases {self.aliases!r}")
        if not isinstance(self.module_fqn, str) or not isinstance(self.attr, str) or not self.attr:
            raise ValueError(f"ParamSpec {self.fqn}: module_fqn/attr must be strings")
        expected = f"{self.module_fqn}.{self.attr}" if self.module_fqn else self.attr
        if expected != self.fqn:
            raise ValueError(f"ParamSpec {self.fqn}: module_fqn {self.module_fqn!r} + attr {self.attr!r} != fqn")
        _check_int("ParamSpec", "tp_size", self.tp_size, 1)
        if self.tp_size == 1:
            if self.tp_shard_dim is not None or self.tp_ns is not None:
                raise ValueError(f"ParamSpec {self.fqn}: tp_shard_dim/tp_ns need tp_size > 1")
        else:
            if len(self.shape) != 2 or self.num_matrices != 1:
                raise ValueError(f"ParamSpec {self.fqn}: tensor parallelism is supported for 2-D matrices only")
            if self.tp_shard_dim not in (0, 1):
                raise ValueError(f"ParamSpec {self.fqn}: tp_shard_dim must be 0 or 1, got {self.tp_shard_dim!r}")
            if self.shape[self.tp_shard_dim] % self.tp_size:
                raise ValueError(
                    f"ParamSpec {self.fqn}: dim {self.tp_shard_dim} of {self.shape} is not divisible by "
                    f"tp_size {self.tp_size}"
                )
            if self.tp_ns not in ("gram", "gather"):
                raise ValueError(f"ParamSpec {self.fqn}: tp_ns must be 'gram' or 'gather', got {self.tp_ns!r}")
        if self.ns_backend not in ("standard", "gram"):
            raise ValueError(f"ParamSpec {self.fqn}: ns_backend must be 'standard' or 'gram', got {self.ns_backend!r}")
        if self.tp_size > 1 and self.ns_backend != "standard":
            raise ValueError(f"ParamSpec {self.fqn}: a TP-sharded matrix has ns_backend 'standard' (tp_ns decides)")

    def to_dict(self) -> dict[str, Any]:
        tp = {}
        if self.tp_size > 1:  # absent without TP: plans without TP keep their JSON and fingerprint
            tp = {"tp_size": self.tp_size, "tp_shard_dim": self.tp_shard_dim, "tp_ns": self.tp_ns}
        if self.ns_backend != "standard":  # absent by default: older plans keep their JSON
            tp["ns_backend"] = self.ns_backend
        return {
            "fqn": self.fqn,
            "shape": list(self.shape),
            "dtype": self.dtype,
            "numel": self.numel,
            "matrix_shape": list(self.matrix_shape),
            "num_matrices": self.num_matrices,
            "aliases": list(self.aliases),
            "module_fqn": self.module_fqn,
            "attr": self.attr,
            **tp,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ParamSpec:
        return cls(
            fqn=d["fqn"],
            shape=tuple(d["shape"]),
            dtype=d["dtype"],
            numel=d["numel"],
            matrix_shape=tuple(d["matrix_shape"]),
            num_matrices=d["num_matrices"],
            aliases=tuple(d["aliases"]),
            module_fqn=d["module_fqn"],
            attr=d["attr"],
            tp_size=d.get("tp_size", 1),
            tp_shard_dim=d.get("tp_shard_dim"),
            tp_ns=d.get("tp_ns"),
            ns_backend=d.get("ns_backend", "standard"),
        )


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Fsdp2Unit:
    """The parameters dmuon does NOT dedicate that one ``fully_shard`` unit manages, as the
    schedule's external FSDP2 ops see them (FSDP2 all-gathers and reduce-scatters them itself).

    Units follow the documented set-up, ``fully_shard`` on every hook boundary, then on the
    root: a parameter belongs to its hook boundary's unit, or to the root's (``fqn == ""``:
    embeddings, final norm, ``lm_head``).

    Attributes:
        fqn: module FQN of the unit (``""`` = the root).
        params: canonical FQNs, ``named_parameters()`` order.
        shapes: each parameter's shape on one TP rank (its full shape without TP).
        dtypes: each parameter's storage dtype string.
        requires_grad: whether each parameter gets a gradient (FSDP2 reduces only those).
    """

    fqn: str
    params: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    requires_grad: tuple[bool, ...]

    def __post_init__(self) -> None:
        if not isinstance(self.fqn, str):
            raise TypeError(f"Fsdp2Unit.fqn must be a str, got {self.fqn!r}")
        n = len(self.params)
        if not n or any(len(getattr(self, f)) != n for f in ("shapes", "dtypes", "requires_grad")):
            raise ValueError(f"Fsdp2Unit {self.fqn!r}: params, shapes, dtypes and requires_grad must align (non-empty)")
        for shape in self.shapes:
            _check_shape("Fsdp2Unit", "shapes[i]", shape)
        for d in self.dtypes:
            check_dtype_str("Fsdp2Unit", "dtypes[i]", d)
        if any(type(g) is not bool for g in self.requires_grad):
            raise TypeError(f"Fsdp2Unit {self.fqn!r}: requires_grad must hold bools")

    def to_dict(self) -> dict[str, Any]:
        return {
            "fqn": self.fqn,
            "params": list(self.params),
            "shapes": [list(s) for s in self.shapes],
            "dtypes": list(self.dtypes),
            "requires_grad": list(self.requires_grad),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Fsdp2Unit:
        return cls(
            fqn=d["fqn"],
            params=tuple(d["params"]),
            shapes=tuple(tuple(s) for s in d["shapes"]),
            dtypes=tuple(d["dtypes"]),
            requires_grad=tuple(d["requires_grad"]),
        )
