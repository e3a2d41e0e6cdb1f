"""dmuon where people already train: Hugging Face transformers / accelerate, Lightning, torchtitan.

The frameworks call ``fully_shard`` themselves or through a hook the user writes, and they build or
wrap the optimizer and the model; this package holds what dmuon needs to fit into each of them:
:mod:`dmuon.integrations.hf` (``MuonFactory`` for ``transformers.Trainer``),
:mod:`dmuon.integrations.accelerate`, :mod:`dmuon.integrations.torchtitan`, :func:`boundary_modules`
(the modules to ``fully_shard`` one by one after dedication) and :func:`framework_hint`. What dmuon
changes in other libraries, and when, is one list: :func:`status` prints it, :func:`disable` (or
``DMUON_NO_PATCHES=1``) undoes it, :func:`enable` installs named integrations. Recipes, Lightning
included: docs/integrations.md. Importing this package imports no framework and no ``dmuon.exec``
module.
"""

from __future__ import annotations

import torch.nn as nn

from dmuon import _registry
from dmuon._hints import detect_framework, framework_hint
from dmuon._registry import IntegrationError, status

__all__ = [
    "boundary_modules",
    "framework_hint",
    "detect_framework",
    "check_optimizer",
    "status",
    "enable",
    "disable",
    "uninstall",
    "IntegrationError",
]


def __getattr__(name: str):
    if name == "check_optimizer":  # dmuon.exec._setup.guards.check_optimizer, loaded on first use
        from dmuon.exec._setup.guards import check_optimizer

        return check_optimizer
    raise AttributeError(f"module 'dmuon.integrations' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))


# ------------------------------------------------------------------------------------------
# Recipes' helpers
# ------------------------------------------------------------------------------------------


def boundary_modules(model: nn.Module, plan) -> list[nn.Module]:
    """The hook-boundary modules of ``plan`` in ``model``, in module order: exactly the blocks
    to ``fully_shard`` one by one after ``dedicate_params`` (then ``fully_shard(model)``), so
    that FSDP2's units and dmuon's boundaries coincide, whatever the block path is called."""
    return [model.get_submodule(b.fqn) for b in plan.boundaries]


# ------------------------------------------------------------------------------------------
# What dmuon changes in other libraries (dmuon._registry)
# ------------------------------------------------------------------------------------------


def enable(*names: str) -> list[str]:
    """Install the named integrations now, also with ``DMUON_NO_PATCHES=1`` or after
    :func:`disable` (the explicit way): families ``"fsdp2"``, ``"clip"``, ``"amp"``, ``"dcp"``,
    ``"ddp"``, ``"optimizer"``, ``"accelerate"`` (imports accelerate), ``"trainer"`` (imports
    transformers.trainer), or entry names of :func:`status`. Without names: every integration
    (what ``import dmuon`` + the first dedication install, accelerate / transformers only if
    imported). Idempotent; returns the names installed.

    Raises:
        IntegrationError: a target no longer has the parameters dmuon's wrapper relies on.
    """
    if not names:
        names = tuple(i.name for i in _registry.INTEGRATIONS if i.trigger is None)
        import sys

        names += tuple(i.name for i in _registry.INTEGRATIONS if i.trigger in sys.modules)
    return _registry.install(*names)


def uninstall(*names: str) -> list[str]:
    """Undo the named integrations (all without names): the original objects back in place.
    The automatic installs of a stage already passed do not run again."""
    return _registry.uninstall(*names)


def disable() -> list[str]:
    """Undo every integration and block the automatic installs, as ``DMUON_NO_PATCHES=1`` does
    (torch and the frameworks untouched; the ``fully_shard`` skip included, so pass
    ``ignored_params=dmuon.fsdp2_ignored_params(module)`` to ``fully_shard``: docs/integrations.md,
    "Without patches"). Returns the names undone."""
    return _registry.disable()
