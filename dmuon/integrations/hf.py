"""Hugging Face transformers: the optimizer factory ``transformers.Trainer`` takes.

``Trainer`` refuses ``optimizers=(...)`` when FSDP is on and builds the optimizer itself, from
``optimizer_cls_and_kwargs``, before accelerate's ``prepare`` shards the model. A class that is
not a ``torch.optim.Optimizer`` counts there as a *factory*: ``Trainer`` instantiates it and
calls the instance with the model. :class:`MuonFactory` is that factory for ``dmuon.Muon``::

    plan = dmuon.dedicate_params(model, mesh)        # before Trainer(...)
    trainer = Trainer(model=model, args=args, train_dataset=...,
                      optimizer_cls_and_kwargs=(MuonFactory, {"lr": 0.02, "adamw_lr": 3e-4}))

The default predicate and hook-boundary heuristic pick the projection matrices of every block
of Llama / Qwen2 / Qwen3 (``model.layers.N``), GPT-2 (``transformer.h.N``, Conv1D weights),
BERT (``bert.encoder.layer.N``) and ViT (``vit.layers.N``): docs/integrations.md has the table.
"""

from __future__ import annotations

from typing import Any

import torch.nn as nn

from dmuon import _tags

__all__ = ["MuonFactory"]


class MuonFactory:
    """``optimizer_cls_and_kwargs=(MuonFactory, kwargs)``: ``Trainer`` calls
    ``MuonFactory()(model, **kwargs)``, i.e. ``dmuon.Muon(model, **kwargs)`` (every keyword of
    :class:`dmuon.Muon`: ``lr``, ``weight_decay``, ``adamw_lr``, ``ns_dtype`` ...). Trainer's own
    ``learning_rate`` / ``weight_decay`` arguments are not read: give them here. The LR schedule
    Trainer builds scales every group's ``lr`` by the same factor (Muon's and AdamW's)."""

    def __call__(self, model: nn.Module, **kwargs: Any):
        from dmuon.exec._optim.muon import Muon

        return Muon(model, **kwargs)


def wrap_mixed_mesh_grad_norm(orig):
    """``Trainer._mixed_mesh_grad_norm`` (entry ``trainer.grad_norm`` of :mod:`dmuon._registry`,
    installed at the first dedication once transformers.trainer is imported, or by
    ``dmuon.integrations.enable("trainer")``). Trainer takes that path whenever gradients are a
    mix of DTensors and plain tensors, which is always the case with dmuon (owner-held gradients
    are plain tensors): it would add each rank's owned gradients to the norm locally, so every
    rank would clip by a different, too small norm. With dedicated parameters the norm (and the
    clip) is :func:`dmuon.clip_grad_norm_`'s, identical on every rank; ``max_norm=inf`` only
    measures."""
    import functools

    @functools.wraps(orig)
    def _mixed_mesh_grad_norm(self, model, max_norm):
        params = list(model.parameters())
        if _tags.has_dedicated(params):
            from dmuon.integrations._clip_handoff import dmuon_clip

            return dmuon_clip(params, max_norm)
        return orig(self, model, max_norm)

    return _mixed_mesh_grad_norm


def patch_trainer(module=None) -> None:
    """Install the Trainer integration now (``dmuon.integrations.enable("trainer")``; idempotent)."""
    from dmuon import _registry

    _registry.install("trainer")
