"""dmuon's tags on objects it does not own (parameters, modules, optimizers): their names, and the
one way to read and write them.

A leaf: imports nothing (not dmuon, not torch). The tags and why this is a leaf: Note: dmuon's
tags (docs/design.md). Reading: :func:`read`; writing: :func:`write`.
"""

from __future__ import annotations

from typing import Any, Iterable

__all__ = [
    "PARAM",
    "RUNTIME",
    "QK_CLIP",
    "APPLY_WRAPPED",
    "APPLY_BOUNDARIES",
    "CHECKED_GROUPS",
    "read",
    "write",
    "dedicated_info",
    "has_dedicated",
    "model_runtime",
]

PARAM = "_dmuon"
RUNTIME = "_dmuon_runtime"
QK_CLIP = "_dmuon_qk_clip"
APPLY_WRAPPED = "_dmuon_apply_wrapped"
APPLY_BOUNDARIES = "_dmuon_apply_boundaries"
CHECKED_GROUPS = "_dmuon_checked_groups"


def read(obj: Any, tag: str, default: Any = None) -> Any:
    """The value of dmuon's ``tag`` on ``obj``, or ``default`` if it carries none."""
    return getattr(obj, tag, default)


def write(obj: Any, tag: str, value: Any) -> None:
    """Set dmuon's ``tag`` on ``obj`` to ``value``."""
    object.__setattr__(obj, tag, value)


def dedicated_info(p: Any):
    """The ``DedicatedInfo`` (:class:`dmuon.exec._runtime.packed_buffers.DedicatedInfo`) of ``p`` if
    :func:`dmuon.exec.apply` dedicated it, else None: the one way to ask "is this parameter
    dedicated" (also ``dmuon.exec.dedicated_info``)."""
    return getattr(p, PARAM, None)


def has_dedicated(params: Iterable[Any]) -> bool:
    """Whether any of ``params`` is dedicated (placeholders included: the answer is the same on
    every rank)."""
    return any(getattr(p, PARAM, None) is not None for p in params)


def model_runtime(model: Any):
    """The ``DmuonRuntime`` :func:`dmuon.exec.apply` attached to ``model``, or None."""
    return getattr(model, RUNTIME, None)
