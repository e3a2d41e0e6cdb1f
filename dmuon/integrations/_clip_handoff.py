"""``torch.nn.utils.clip_grad_norm_`` on a dmuon model: the hand-off to ``dmuon.clip_grad_norm_``.

The registry entries ``clip.*`` (:mod:`dmuon.integrations._patches`) wrap torch's function with
:func:`hand_off` at ``import dmuon``, the one change ``import dmuon`` makes: it must be in place
before a training script binds ``from torch.nn.utils import clip_grad_norm_``. It lives outside
``dmuon.exec`` and tells dedicated parameters apart by their tag (:mod:`dmuon._tags`), so
``import dmuon`` loads no ``dmuon.exec`` module; the first call whose parameters include
dedicated ones imports :func:`dmuon.exec._optim.grad_clip.clip_grad_norm_`.
"""

from __future__ import annotations

import functools

import torch

from dmuon import _registry
from dmuon import _tags

__all__ = ["hand_off", "install"]


def hand_off(fn):
    """The wrapper of ``torch.nn.utils.clip_grad_norm_`` (registry entries ``clip.*``, installed by
    ``import dmuon``): when its parameters include dedicated ones (placeholders included, so every
    rank takes the same path) it is :func:`dmuon.clip_grad_norm_` (the global norm with owner-held
    gradients counted once, identical on every rank; ``error_if_nonfinite`` and ``foreach`` are
    passed on); any other call goes to ``fn`` unchanged, with the same arguments. A name bound by ``from torch.nn.utils import clip_grad_norm_``
    BEFORE ``import dmuon`` keeps torch's function; the patch-free way is
    ``dmuon.clip_grad_norm_``."""

    @functools.wraps(fn)
    def clip_grad_norm_(parameters, max_norm, norm_type=2.0, error_if_nonfinite=False, foreach=None):
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        if not _tags.has_dedicated(params):  # (a generator was consumed above: torch gets the list)
            return fn(params, max_norm, norm_type, error_if_nonfinite, foreach)
        from dmuon.exec._optim.grad_clip import clip_grad_norm_ as dmuon_clip

        # the parameters hold owner-only gradients (plain tensors) next to FSDP2's DTensor shards:
        # torch's norm would fail on the mix or count a rank's owned matrices only
        return dmuon_clip(params, max_norm, norm_type, error_if_nonfinite, foreach)

    return clip_grad_norm_


def install() -> None:
    """Install the ``torch.nn.utils.clip_grad_norm_`` hand-off now (``dmuon._registry.install("clip")``),
    even with the automatic installs disabled. Idempotent."""
    _registry.install("clip")
