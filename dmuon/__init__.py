"""dmuon: Muon on FSDP2 with exclusive ownership of every Muon-target matrix.

``import dmuon`` imports no ``dmuon.exec`` module and no ``torch.distributed.fsdp`` (the names below
load on first use) and changes one thing in torch: ``torch.nn.utils.clip_grad_norm_`` over dedicated
parameters hands off to :func:`clip_grad_norm_`. The first :func:`dedicate_params` installs the rest;
the list, the opt-out (``DMUON_NO_PATCHES=1``) and the explicit paths: docs/integrations.md, "What
dmuon changes in other libraries, and when". Public names (one line each: docs/api.md):

* :mod:`dmuon.plan` — pure planning: ``dmuon.plan.compile(model, mesh, ...)`` → ``ShardingPlan``.
* :mod:`dmuon.exec` — execution: ``dmuon.exec.apply(plan, model, mesh=None)``.
* :func:`dedicate_params` — compile + apply; returns the plan. :class:`Muon` — Muon on dedicated
  matrices (owner only) + AdamW on everything else. :func:`no_sync`, :func:`clip_grad_norm_`,
  :func:`full_state_dict`, :mod:`qk_clip`, :func:`init_params`.
* :mod:`dmuon.testing` (``import dmuon.testing``, not imported here) — check dmuon on your own model.
"""

import importlib as _importlib

from dmuon import _registry
from dmuon.integrations import _patches as _patches  # noqa: F401 - registers the list (names its wrappers, imports none)

_registry.install_stage("import")  # the clip_grad_norm_ hand-off only

#: public name -> "module" (a module) or "module:attr" (loaded on first access, PEP 562)
_LAZY = {
    "plan": "dmuon.plan",
    "exec": "dmuon.exec",
    "integrations": "dmuon.integrations",
    "sim": "dmuon.sim",
    "dedicate_params": "dmuon.exec._setup.api:dedicate_params",
    "Muon": "dmuon.exec._optim.muon:Muon",
    "no_sync": "dmuon.exec._runtime.runtime:no_sync",
    "clip_grad_norm_": "dmuon.exec._optim.grad_clip:clip_grad_norm_",
    "full_state_dict": "dmuon.exec._state.model_state:full_state_dict",
    "init_params": "dmuon.exec._setup.materialize:init_params",
    "qk_clip": "dmuon.exec._optim.qk_clip",
    "GradScaler": "dmuon.exec._optim.amp:GradScaler",
    "DCPLoadPlanner": "dmuon.exec._state.dcp_errors:DCPLoadPlanner",
    "fsdp2_ignored_params": "dmuon.exec._setup.fsdp2:ignored_params",
}

__all__ = ["plan", "exec", "integrations", "dedicate_params", "Muon", "no_sync", "clip_grad_norm_"]
__all__ += ["full_state_dict", "init_params", "qk_clip", "GradScaler", "DCPLoadPlanner", "fsdp2_ignored_params"]


def __getattr__(name: str):
    spec = _LAZY.get(name)
    if spec is None:
        raise AttributeError(f"module 'dmuon' has no attribute {name!r}")
    module, _, attr = spec.partition(":")
    value = _importlib.import_module(module)
    if attr:
        value = getattr(value, attr)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
