"""dmuon's tags on objects it does not own (parameters, modules, optimizers): their names, and the
one way to read and write them.

A leaf: imports nothing (not dmuon, not torch), so that what must tell a dedicated parameter
apart before ``dmuon.exec`` is imported (the ``torch.nn.utils.clip_grad_norm_`` hand-off,
:mod:`dmuon.integrations._clip_handoff`) reads the same tag the runtime writes.

Tags (the attribute each is stored under is this module's business only)::

    PARAM           on every logical dedicated parameter: its DedicatedInfo (dmuon.exec.apply)
    RUNTIME         on a dedicated model: its DmuonRuntime (dmuon.exec.apply)
    QK_CLIP         on a QK-clip attention module: (weakref to its QKClipRuntime, layer index)
    APPLY_WRAPPED   on a module whose ``_apply`` dmuon wraps (to_empty / .to rebind its storage)
    APPLY_BOUNDARIES  on that module: the hook boundaries its ``_apply`` rebinds
    CHECKED_GROUPS  on an optimizer: the parameter groups the foreign-optimizer guard checked

Reading: :func:`read` (or :func:`dedicated_info`, :func:`model_runtime`, :func:`has_dedicated`);
writing: :func:`write` (``object.__setattr__``: no ``nn.Module.__setattr__`` bookkeeping).
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
