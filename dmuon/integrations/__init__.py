"""dmuon where people already train: Hugging Face transformers / accelerate, Lightning, torchtitan.

The frameworks call ``fully_shard`` themselves (accelerate's FSDP2 ``prepare``) or through a
hook the user writes (Lightning's ``configure_model``, torchtitan's ``parallelize`` functions),
and they build or wrap the optimizer and the model. This package holds what dmuon needs to fit
into each of them; recipes: ``docs/integrations.md``.

* :mod:`dmuon.integrations.hf` — ``MuonFactory`` for ``transformers.Trainer``.
* :func:`boundary_modules` — the modules to ``fully_shard`` one by one after dedication (the
  plan's hook boundaries: ``model.layers.N``, ``transformer.h.N``, ``encoder.layer.N`` ...).
* :mod:`dmuon.integrations.accelerate` — accelerate's FSDP2 ``prepare`` made dmuon-aware
  (installed by ``import dmuon`` as soon as accelerate is imported, see :func:`install`).
* Lightning's ``ModelParallelStrategy`` needs no module: ``configure_model`` dedicates and
  shards, ``configure_optimizers`` returns ``dmuon.Muon`` (docs/integrations.md).
* :mod:`dmuon.integrations.torchtitan` — torchtitan (>= 0.3): dedication inside the model's
  parallelize function (``wrap_parallelize``), ``dmuon.Muon`` through an ``OptimizersContainer``
  subclass (``muon_optimizer``), and torchtitan's gradient clipping routed to
  ``dmuon.clip_grad_norm_`` (installed by ``import dmuon`` when torchtitan is imported).
* ``import dmuon`` also makes ``DistributedDataParallel(model)`` of a dedicated model raise.
* :func:`framework_hint` — the framework-specific fix appended to the errors users hit first
  (``fully_shard`` before ``dedicate_params``; an optimizer built from ``model.parameters()``;
  the model wrapped after dedication).

Importing this package imports no framework: each submodule imports its framework when used.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import inspect
import sys
import threading
from typing import Callable

import torch
import torch.nn as nn

__all__ = [
    "boundary_modules",
    "framework_hint",
    "detect_framework",
    "check_optimizer",
    "install",
]

# ------------------------------------------------------------------------------------------
# Which framework is the user in
# ------------------------------------------------------------------------------------------

_FRAMEWORK_MODULES = (  # (framework, module prefixes whose frames on the stack name it)
    ("trainer", ("transformers.trainer",)),
    ("accelerate", ("accelerate.",)),
    ("lightning", ("lightning.", "pytorch_lightning.", "lightning_fabric.")),
    ("torchtitan", ("torchtitan.",)),
)


def detect_framework(model: nn.Module | None = None) -> str | None:
    """The framework the current call comes from: ``"trainer"`` (transformers.Trainer),
    ``"accelerate"``, ``"lightning"``, ``"torchtitan"``, or None.

    Read from the call stack (the innermost framework frame wins, Trainer before accelerate,
    which it calls), then from the model's classes (a ``LightningModule``; a transformers
    ``PreTrainedModel`` counts as ``"accelerate"``, which is how such models get sharded).
    """
    names = []
    for frame in inspect.stack(context=0)[1:]:
        mod = frame.frame.f_globals.get("__name__", "")
        names.append(mod)
    for fw, prefixes in _FRAMEWORK_MODULES:
        if any(n.startswith(prefixes) for n in names):
            return fw
    if model is not None:
        for cls in type(model).__mro__:
            mod = cls.__module__ or ""
            if mod.startswith(("lightning.", "pytorch_lightning.")):
                return "lightning"
            if mod.startswith("transformers."):
                return "accelerate"
            if mod.startswith("torchtitan."):
                return "torchtitan"
    return None


_HINTS: dict[str, dict[str, str]] = {
    "fully_shard_first": {
        "trainer": (
            "transformers.Trainer with FSDP2 shards the model inside trainer.train() "
            "(accelerator.prepare): call dmuon.dedicate_params(model, mesh) on the unsharded "
            "model BEFORE Trainer(...), and pass optimizer_cls_and_kwargs="
            "(dmuon.integrations.hf.MuonFactory, {...})"
        ),
        "accelerate": (
            "accelerate's FSDP2 prepare() calls fully_shard: call dmuon.dedicate_params(model, "
            "mesh) and build dmuon.Muon(model, ...) BEFORE accelerator.prepare(model, optimizer), "
            "not on the prepared model"
        ),
        "lightning": (
            "in LightningModule.configure_model call dmuon.dedicate_params(self.model, "
            "self.device_mesh['data_parallel']) first, then fully_shard each block, then the "
            "model; return dmuon.Muon(self.model, ...) from configure_optimizers"
        ),
        "torchtitan": (
            "torchtitan's parallelize function calls fully_shard: dedicate inside it, by setting "
            "model_spec.parallelize_fn = dmuon.integrations.torchtitan.wrap_parallelize("
            "model_spec.parallelize_fn) (or dmuon_model_spec(model_spec)); do not call "
            "dmuon.dedicate_params on the parallelized model"
        ),
    },
    "foreign_optimizer": {
        "trainer": (
            "transformers.Trainer built its own optimizer from model.parameters(): pass "
            "optimizer_cls_and_kwargs=(dmuon.integrations.hf.MuonFactory, {'lr': ..., "
            "'adamw_lr': ...}) to Trainer(...) (with FSDP Trainer refuses optimizers=(...))"
        ),
        "accelerate": (
            "pass dmuon.Muon(model, ...) to accelerator.prepare(model, optimizer) instead of an "
            "optimizer built from model.parameters()"
        ),
        "lightning": (
            "return dmuon.Muon(self.model, ...) from LightningModule.configure_optimizers "
            "(configure_model must have called dmuon.dedicate_params)"
        ),
        "torchtitan": (
            "torchtitan's OptimizersContainer builds Adam/AdamW/DistMuon over every parameter: set "
            "config.optimizer = dmuon.integrations.torchtitan.muon_optimizer(lr=..., adamw_lr=...) "
            "(a DmuonOptimizersContainer.Config whose param groups use optimizer_name='Muon')"
        ),
    },
    "wrapped_after": {
        "trainer": (
            "transformers.Trainer wraps the model in DistributedDataParallel unless FSDP2 is "
            "on: TrainingArguments(fsdp='full_shard', fsdp_config={'fsdp_version': 2, ...}) "
            "(or an accelerate config with distributed_type: FSDP, fsdp_version: 2)"
        ),
        "accelerate": (
            "accelerate wraps the model in DistributedDataParallel unless FSDP2 is on: "
            "Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2, ...)) or "
            "an accelerate config with distributed_type: FSDP and fsdp_version: 2"
        ),
        "lightning": (
            "use strategy=ModelParallelStrategy(...) and apply dmuon + fully_shard in "
            "configure_model; DDPStrategy / FSDPStrategy wrap the dedicated model"
        ),
        "torchtitan": (
            "let torchtitan's parallelize function apply fully_shard (data_parallel_shard_degree), "
            "wrapped by dmuon.integrations.torchtitan.wrap_parallelize; do not enable DDP "
            "(data_parallel_replicate_degree without sharding)"
        ),
    },
}

_GENERIC = {
    "fully_shard_first": "order: dedicate_params -> fully_shard(layer) for each layer -> "
    "fully_shard(model) -> dmuon.Muon(model)",
    "foreign_optimizer": "build the optimizer with dmuon.Muon(model, ...): it runs Muon on the "
    "dedicated matrices (owner only) and AdamW on every other parameter",
    "wrapped_after": "dmuon composes with FSDP2 (fully_shard) only; DistributedDataParallel "
    "sees different parameter shapes on different ranks",
}


def framework_hint(kind: str, model: nn.Module | None = None) -> str:
    """The fix for mistake ``kind`` (``"fully_shard_first"``, ``"foreign_optimizer"``,
    ``"wrapped_after"``) in the framework of this call (:func:`detect_framework`), as one
    sentence starting with the framework's name; the generic rule when no framework is
    recognised. Docs: docs/integrations.md."""
    fw = detect_framework(model)
    if fw is None:
        return _GENERIC[kind] + " (docs/integrations.md)"
    return f"{fw}: {_HINTS[kind][fw]} (docs/integrations.md)"


# ------------------------------------------------------------------------------------------
# Recipes' helpers
# ------------------------------------------------------------------------------------------


def boundary_modules(model: nn.Module, plan) -> list[nn.Module]:
    """The hook-boundary modules of ``plan`` in ``model``, in module order: exactly the blocks
    to ``fully_shard`` one by one after ``dedicate_params`` (then ``fully_shard(model)``), so
    that FSDP2's units and dmuon's boundaries coincide, whatever the block path is called."""
    return [model.get_submodule(b.fqn) for b in plan.boundaries]


def _dedicated(params) -> list[torch.Tensor]:
    return [p for p in params if getattr(p, "_dmuon", None) is not None]


def check_optimizer(optimizer: torch.optim.Optimizer, model: nn.Module | None = None) -> None:
    """Raise ``TypeError`` if ``optimizer`` holds dmuon-dedicated parameters but is not a
    ``dmuon.Muon``: such an optimizer would update owner-held masters as if they were ordinary
    parameters (and skip the zero-size placeholders), i.e. train wrongly. The message names the
    parameter and the framework-specific fix (:func:`framework_hint`)."""
    from dmuon.exec.optim import Muon

    inner = getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer
    if isinstance(inner, Muon):
        return
    params = [p for g in inner.param_groups for p in g["params"]]
    dedicated = _dedicated(params)
    parts = getattr(inner, "optimizers", None)  # a container (torchtitan's OptimizersContainer)
    if dedicated and isinstance(parts, (list, tuple)) and all(isinstance(o, torch.optim.Optimizer) for o in parts):
        # the container steps its parts, each checked on its own step: here only that every
        # dedicated parameter it holds is in one of its dmuon.Muon parts
        in_muon = {id(p) for o in parts if isinstance(o, Muon) for g in o.param_groups for p in g["params"]}
        dedicated = [p for p in dedicated if id(p) not in in_muon]
    if dedicated:
        fqn = dedicated[0]._dmuon.fqn
        raise TypeError(
            f"dmuon: {type(inner).__name__} holds {len(dedicated)} parameter(s) dedicated by "
            f"dmuon.dedicate_params (e.g. {fqn!r}); only dmuon.Muon can update them. "
            + framework_hint("foreign_optimizer", model)
        )


def _foreign_optimizer_step_pre_hook(optimizer, args, kwargs) -> None:
    check_optimizer(optimizer)


# ------------------------------------------------------------------------------------------
# Installation: patches applied when (and only if) the framework is imported
# ------------------------------------------------------------------------------------------

_POST_IMPORT: dict[str, Callable[[object], None]] = {}
_LOCK = threading.Lock()
_INSTALLED = False


class _PostImportFinder(importlib.abc.MetaPathFinder):
    """Runs ``_POST_IMPORT[name](module)`` right after module ``name`` is executed."""

    def find_spec(self, fullname, path, target=None):
        if fullname not in _POST_IMPORT:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None
        loader = spec.loader
        exec_module = loader.exec_module

        def exec_and_patch(module):
            exec_module(module)
            _POST_IMPORT[fullname](module)

        loader.exec_module = exec_and_patch
        return spec


def install() -> None:
    """Called by ``import dmuon``; idempotent.

    * a global optimizer step pre-hook that raises :func:`check_optimizer`'s error for any
      non-dmuon optimizer holding dedicated parameters (checked at the first step and again
      whenever the optimizer's parameters change; ``dmuon.Muon`` is skipped);
    * accelerate: :func:`dmuon.integrations.accelerate.patch` is applied to
      ``accelerate.accelerator`` when it is imported (now, if it already is);
    * transformers: :func:`dmuon.integrations.hf.patch_trainer` to ``transformers.trainer``
      (Trainer's gradient-norm clipping), likewise;
    * torchtitan: :func:`dmuon.integrations._torchtitan_clip.patch_clip_grad_norm` to
      ``torchtitan.distributed.utils`` (the trainer's gradient-norm clipping), likewise.
    """
    global _INSTALLED
    with _LOCK:
        if _INSTALLED:
            return
        _INSTALLED = True
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    register_optimizer_step_pre_hook(_checked_once)

    def patch_accelerate(module) -> None:
        from . import accelerate as _acc

        _acc.patch(module)

    def patch_trainer(module) -> None:
        from . import hf as _hf

        _hf.patch_trainer(module)

    def patch_torchtitan(module) -> None:
        from . import _torchtitan_clip

        _torchtitan_clip.patch_clip_grad_norm(module)

    _wrap_ddp_init()
    _POST_IMPORT["torchtitan.distributed.utils"] = patch_torchtitan
    _POST_IMPORT["accelerate.accelerator"] = patch_accelerate
    _POST_IMPORT["transformers.trainer"] = patch_trainer
    for name, fn in _POST_IMPORT.items():
        if name in sys.modules:
            fn(sys.modules[name])
    sys.meta_path.insert(0, _PostImportFinder())


_CHECKED_ATTR = "_dmuon_checked_param_ids"


def _checked_once(optimizer, args, kwargs) -> None:
    """The foreign-optimizer check, redone only when the optimizer's parameters changed."""
    from dmuon.exec.optim import Muon

    if isinstance(optimizer, Muon):
        return
    ids = tuple(id(p) for g in optimizer.param_groups for p in g["params"])
    if getattr(optimizer, _CHECKED_ATTR, None) == ids:
        return
    check_optimizer(optimizer)
    try:
        setattr(optimizer, _CHECKED_ATTR, ids)
    except AttributeError:  # an optimizer with __slots__: check every step
        pass


def _wrap_ddp_init() -> None:
    """``DistributedDataParallel(model)`` of a model with dedicated parameters raises a
    ``ValueError`` naming the framework's fix, before DDP's own parameter-shape check (which
    fails with a size mismatch between owners and non-owners, or hangs on ranks that disagree)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    orig = DDP.__init__
    if getattr(orig, "__dmuon_wrapped__", None) is not None:
        return

    def __init__(self, module, *args, **kwargs):
        dedicated = _dedicated(module.parameters()) if isinstance(module, nn.Module) else []
        if dedicated:
            raise ValueError(
                f"dmuon: DistributedDataParallel around a model with {len(dedicated)} parameter(s) "
                f"dedicated by dmuon.dedicate_params (e.g. {dedicated[0]._dmuon.fqn!r}): owners hold "
                f"full matrices, other ranks zero-size placeholders, and dmuon already averages their "
                f"gradients. " + framework_hint("wrapped_after", module)
            )
        orig(self, module, *args, **kwargs)

    __init__.__dmuon_wrapped__ = orig
    __init__.__doc__ = orig.__doc__
    DDP.__init__ = __init__
