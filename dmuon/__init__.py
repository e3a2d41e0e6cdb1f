"""dmuon: Muon on FSDP2 with exclusive ownership of every Muon-target matrix.

``import dmuon`` changes one thing in torch: ``torch.nn.utils.clip_grad_norm_`` over dedicated
parameters hands off to :func:`clip_grad_norm_` (other calls unchanged). It imports no
``dmuon.exec`` module and no ``torch.distributed.fsdp``: the names below load on first use. The
first :func:`dedicate_params` installs the rest (the ``fully_shard`` skip of dedicated
parameters, GradScaler, DCP load errors, the DDP and foreign-optimizer guards, accelerate /
transformers / torchtitan when imported). All of it is one list,
:mod:`dmuon.integrations._patches`: ``dmuon.integrations.status()`` shows it,
``DMUON_NO_PATCHES=1`` or ``dmuon.integrations.disable()`` leaves every library untouched
(explicit paths: :func:`fsdp2_ignored_params`, :class:`GradScaler`, :func:`clip_grad_norm_`,
:class:`DCPLoadPlanner`, ``dmuon.integrations.enable("accelerate")``; docs/integrations.md).
Public names (docs/api.md):

* :mod:`dmuon.plan` — pure planning: ``dmuon.plan.compile(model, mesh, ...)`` → ``ShardingPlan``.
* :mod:`dmuon.exec` — execution: ``dmuon.exec.apply(plan, model, mesh=None)``.
* :func:`dedicate_params` — compile + apply; returns the plan.
* :class:`Muon` — Muon on dedicated matrices (owner only) + AdamW on everything else.
* :func:`no_sync` — gradient accumulation without communication.
* :func:`clip_grad_norm_` — global gradient-norm clipping with owner-held gradients counted once.
* :func:`full_state_dict` — gathered full tensors (rank 0 by default) for export; docs/checkpointing.md.
* :mod:`qk_clip` — QK-clip (MuonClip): ``dmuon.qk_clip.record(attn_module, max_logits)``; docs/muon_variants.md.
* :func:`init_params` — initialise a ``to_empty``-ed meta model as one process would; docs/checkpointing.md.
* :mod:`dmuon.testing` (``import dmuon.testing``, not imported here) — the single-process
  reference and ``check_against_reference``: check dmuon on your own model; docs/testing.md.
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
