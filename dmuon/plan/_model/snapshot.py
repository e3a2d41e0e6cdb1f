"""Read-only snapshot of a module's parameter tree.

:func:`take_snapshot` walks ``model.named_modules(remove_duplicate=False)`` and
``model.named_parameters(remove_duplicate=False)`` once and records, for every distinct
parameter tensor: all of its names (aliases, for tied weights), its shape, dtype and owning
modules. Only ``.shape`` / ``.dtype`` / module types are read, so meta-device models work and
nothing is allocated; the model is never mutated. Every later planning step is a pure function
of the snapshot (plus the two user callables, which receive the live objects kept here by
reference, excluded from equality).

Ties: a parameter tensor reachable under several names appears once, with ``aliases`` in
``named_parameters(remove_duplicate=False)`` order; the canonical FQN is the first alias, which
is also its name in ``named_parameters()`` (both traversals visit modules in the same DFS order;
the deduplicating one only skips repeats).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import types
from collections.abc import Mapping

import torch
from torch import nn

from dmuon._dtensor import is_dtensor
from dmuon.plan._records.fields import dtype_str

__all__ = ["ModuleKind", "ParamRecord", "ModelSnapshot", "take_snapshot", "module_kind"]


class ModuleKind:
    """String tags for module types the planner treats specially (kept as plain ``str``)."""

    EMBEDDING = "embedding"  # nn.Embedding, nn.EmbeddingBag
    CONV = "conv"  # nn.Conv1d / nn.Conv2d / nn.Conv3d (incl. lazy variants once materialised)
    CONV_TRANSPOSE = "conv_transpose"  # nn.ConvTranspose{1,2,3}d: weight is (in, out/groups, *k)
    OTHER = "other"


def module_kind(module: nn.Module) -> str:
    """Classify ``module`` into a :class:`ModuleKind` tag."""
    if isinstance(module, (nn.Embedding, nn.EmbeddingBag)):
        return ModuleKind.EMBEDDING
    if isinstance(module, nn.modules.conv._ConvTransposeNd):
        return ModuleKind.CONV_TRANSPOSE
    if isinstance(module, (nn.Conv1d, nn.Conv2d, nn.Conv3d)):
        return ModuleKind.CONV
    return ModuleKind.OTHER


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ParamRecord:
    """One distinct parameter tensor.

    Attributes:
        fqn: canonical FQN (``aliases[0]``).
        aliases: every name of the tensor, ``named_parameters(remove_duplicate=False)`` order.
        module_fqns: owning-module FQN of each alias (aligned with ``aliases``; ``""`` = root).
        module_kinds: :class:`ModuleKind` tag of each owning module (aligned with ``aliases``).
        attrs: attribute name of each alias on its module (aligned with ``aliases``).
        shape: tensor shape, elements per dim.
        dtype: ``str(tensor.dtype)``.
        numel: ``prod(shape)`` elements.
        index: position in ``named_parameters()`` order.
        tp_size: ranks of the 1-D device mesh of a ``DTensor`` parameter (tensor parallelism,
            ``parallelize_module``); 1 for a plain tensor.
        tp_shard_dim: the tensor dim its placement ``Shard(dim)`` splits; None for a plain
            tensor or a ``Replicate()`` placement.
        tp_unsupported: why dmuon cannot dedicate this ``DTensor`` (a mesh of more than one
            dim, a ``Partial`` or ``_StridedShard`` placement); ``""`` when it can.
        tensor: the live parameter (passed to the user predicate; never read beyond metadata).
    """

    fqn: str
    aliases: tuple[str, ...]
    module_fqns: tuple[str, ...]
    module_kinds: tuple[str, ...]
    attrs: tuple[str, ...]
    shape: tuple[int, ...]
    dtype: str
    numel: int
    index: int
    tensor: torch.Tensor = dataclasses.field(compare=False, repr=False)
    tp_size: int = 1
    tp_shard_dim: int | None = None
    tp_unsupported: str = ""

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def module_fqn(self) -> str:
        return self.module_fqns[0]

    @property
    def attr(self) -> str:
        return self.attrs[0]

    @property
    def is_embedding_weight(self) -> bool:
        """True iff any alias is the ``weight`` of an ``nn.Embedding``/``nn.EmbeddingBag``."""
        return any(
            kind == ModuleKind.EMBEDDING and attr == "weight" for kind, attr in zip(self.module_kinds, self.attrs)
        )


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ModelSnapshot:
    """Immutable view of a model's module/parameter tree.

    Attributes:
        module_fqns: every module path, ``named_modules(remove_duplicate=False)`` order
            (a shared submodule appears once per path); ``""`` is the root.
        module_types: ``"<module>.<qualname>"`` of each module's class (aligned).
        params: one record per distinct parameter tensor, ``named_parameters()`` order.
        digest: sha256 hex over ``[(aliases, shape, dtype)]`` of ALL parameters (canonical JSON);
            equal digests mean equal names, shapes, dtypes and ties.
        modules: FQN -> live module (read-only mapping; excluded from equality).
    """

    module_fqns: tuple[str, ...]
    module_types: tuple[str, ...]
    params: tuple[ParamRecord, ...]
    digest: str
    modules: Mapping[str, nn.Module] = dataclasses.field(compare=False, repr=False)

    def module_order(self) -> dict[str, int]:
        """FQN -> position in ``named_modules(remove_duplicate=False)`` order."""
        return {fqn: i for i, fqn in enumerate(self.module_fqns)}


def _digest(params: tuple[ParamRecord, ...]) -> str:
    payload = [[list(p.aliases), list(p.shape), p.dtype] for p in params]
    text = json.dumps(payload, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(text.encode("ascii")).hexdigest()


def _tp_placement(tensor: torch.Tensor) -> tuple[int, int | None, str]:
    """``(tp_size, tp_shard_dim, tp_unsupported)`` of a parameter (see :class:`ParamRecord`).

    A DTensor by :func:`dmuon._dtensor.is_dtensor` (its public ``device_mesh`` / ``placements``:
    this package never imports ``torch.distributed``); only shapes and placement types are read.
    """
    if not is_dtensor(tensor):
        return 1, None, ""
    placements = tensor.placements
    mesh = tensor.device_mesh
    shape = tuple(int(d) for d in mesh.shape)
    size = math.prod(shape)
    if len(shape) != 1:
        return size, None, f"a DTensor on a {len(shape)}-D device mesh {shape} (dmuon supports a 1-D TP mesh)"
    (placement,) = placements
    kind = type(placement).__name__
    if kind == "Replicate":
        return size, None, ""
    if kind == "Shard":
        return size, int(placement.dim) % tensor.ndim, ""
    return size, None, f"a DTensor with placement {placement!r} (dmuon supports Shard(0), Shard(1))"


def take_snapshot(model: nn.Module) -> ModelSnapshot:
    """Snapshot ``model`` (any device, including ``meta``) without mutating or allocating.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"dmuon.plan.compile expects a torch.nn.Module, got {type(model).__name__}")
    modules: dict[str, nn.Module] = {}
    module_types: list[str] = []
    for name, mod in model.named_modules(remove_duplicate=False):
        if name in modules:  # cannot happen for distinct paths; guard against odd overrides
            continue
        modules[name] = mod
        cls = type(mod)
        module_types.append(f"{cls.__module__}.{cls.__qualname__}")

    # Group aliases by tensor identity, in remove_duplicate=False order.
    groups: dict[int, list[tuple[str, torch.Tensor]]] = {}
    for name, tensor in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(tensor), []).append((name, tensor))

    records: list[ParamRecord] = []
    for index, members in enumerate(groups.values()):
        tensor = members[0][1]
        aliases = tuple(name for name, _ in members)
        module_fqns: list[str] = []
        attrs: list[str] = []
        kinds: list[str] = []
        for alias in aliases:
            mod_fqn, _, attr = alias.rpartition(".")
            module_fqns.append(mod_fqn)
            attrs.append(attr)
            kinds.append(module_kind(modules[mod_fqn]))
        shape = tuple(int(d) for d in tensor.shape)
        tp_size, tp_shard_dim, tp_unsupported = _tp_placement(tensor)
        records.append(
            ParamRecord(
                fqn=aliases[0],
                aliases=aliases,
                module_fqns=tuple(module_fqns),
                module_kinds=tuple(kinds),
                attrs=tuple(attrs),
                shape=shape,
                dtype=dtype_str(tensor.dtype),
                numel=math.prod(shape),
                index=index,
                tensor=tensor,
                tp_size=tp_size,
                tp_shard_dim=tp_shard_dim,
                tp_unsupported=tp_unsupported,
            )
        )
    params = tuple(records)
    return ModelSnapshot(
        module_fqns=tuple(modules),
        module_types=tuple(module_types),
        params=params,
        digest=_digest(params),
        modules=types.MappingProxyType(modules),
    )
