"""Other libraries' gradient clipping handed to ``dmuon.clip_grad_norm_`` for dedicated parameters:
torch's (installed at ``import dmuon``), torchtitan's, and :func:`dmuon_clip` for accelerate's and the
HF Trainer's wrappers. Loads no ``dmuon.exec`` module until a call holds dedicated parameters
(Note: clipping hand-offs, docs/design.md)."""

from __future__ import annotations

import functools
import sys

import torch

from dmuon import _registry
from dmuon import _tags

__all__ = ["dmuon_clip", "hand_off", "wrap_torchtitan_clip_grad_norm", "install"]


def dmuon_clip(params: list, max_norm, norm_type=2.0, error_if_nonfinite=False, foreach=None) -> torch.Tensor:
    """:func:`dmuon.clip_grad_norm_` on ``params`` (a list holding dedicated parameters),
    imported on first use."""
    from dmuon.exec._optim.grad_clip import clip_grad_norm_

    return clip_grad_norm_(params, max_norm, norm_type, error_if_nonfinite, foreach)


def _for_dmuon(params: list) -> bool:
    """Whether ``params`` go to :func:`dmuon.clip_grad_norm_`: they include dedicated parameters
    (placeholders included), or parameters of a pipeline stage dmuon dedicated nothing in (its rank
    must run the same collectives as the stages with dedicated matrices). The second question
    needs ``dmuon.exec``, loaded by then if any such stage exists."""
    if _tags.has_dedicated(params):
        return True
    runtime = sys.modules.get("dmuon.exec._runtime.runtime")
    return runtime is not None and bool(runtime.bare_stage_runtimes(params))


def _as_list(parameters) -> list:
    """``parameters`` as a list (one tensor, or an iterable consumed once)."""
    return [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)


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
        params = _as_list(parameters)
        if not _for_dmuon(params):  # (a generator was consumed above: torch gets the list)
            return fn(params, max_norm, norm_type, error_if_nonfinite, foreach)
        # the parameters hold owner-only gradients (plain tensors) next to FSDP2's DTensor shards:
        # torch's norm would fail on the mix or count a rank's owned matrices only
        return dmuon_clip(params, max_norm, norm_type, error_if_nonfinite, foreach)

    return clip_grad_norm_


def wrap_torchtitan_clip_grad_norm(fn):
    """The wrapper of ``torchtitan.distributed.utils.clip_grad_norm_`` (registry entry
    ``torchtitan.clip_grad_norm_``, installed at the first dedication, or when
    ``torchtitan.distributed.utils`` is imported after it).

    torchtitan's ``Trainer.train_step`` clips with that function, which calls
    ``torch.nn.utils.get_total_norm`` on every gradient directly (not
    ``torch.nn.utils.clip_grad_norm_``). With dedicated parameters the list mixes FSDP2 DTensor
    shards with owner-only plain gradients: the norm would fail on the mix or count each rank's
    owned matrices locally. Such calls go to :func:`dmuon.clip_grad_norm_` (global norm, each
    owned gradient counted once; ``error_if_nonfinite`` raises before any gradient is scaled, naming
    the ranks and the first parameter; ``foreach`` is left to dmuon, torchtitan passes ``True`` on
    every device); every other call to torchtitan's.

    Under pipeline parallelism (``pp_mesh``) torchtitan passes every parameter of every model part
    the rank holds, and sums its norms' p-th powers over ``pp_mesh``; dmuon's norm does the same
    over the stages (owners' sums over the world, the FSDP2 and plain parts over the ranks at this
    rank's data-parallel coordinate in every stage: torchtitan's ``pp`` group), so ``pp_mesh`` is
    not used beyond checking that the dedicated models are pipeline stages."""

    @functools.wraps(fn)
    def clip_grad_norm_(
        parameters, max_norm, norm_type=2.0, error_if_nonfinite=False, foreach=None, pp_mesh=None, ep_enabled=False
    ):
        params = _as_list(parameters)
        if not _for_dmuon(params):
            return fn(params, max_norm, norm_type, error_if_nonfinite, foreach, pp_mesh, ep_enabled)
        if pp_mesh is not None and pp_mesh.size() > 1:
            _check_pipelined(params)
        return dmuon_clip(params, max_norm, norm_type, error_if_nonfinite)

    return clip_grad_norm_


def _check_pipelined(params: list) -> None:
    """torchtitan clips with a ``pp_mesh``: every dmuon runtime among ``params`` must be a pipeline
    stage's, or dmuon's norm would not be summed over the stages (the same on every rank: the flag
    is set at dedication, or by the schedule's first step)."""
    from dmuon.exec._runtime.runtime import runtimes_of

    flat = [rt for rt in runtimes_of(params) if not rt.pipelined]
    if flat:
        raise ValueError(
            "dmuon: torchtitan's clip_grad_norm_ was given a pipeline mesh (pp_mesh), but "
            f"{len(flat)} dmuon-dedicated model(s) among the parameters are not pipeline stages, so the norm would "
            "leave the other stages out: dedicate each model part with dmuon.integrations.torchtitan.wrap_parallelize "
            "(or dmuon.dedicate_params(part, dp_mesh, pipeline=True)), docs/pipeline_parallel.md"
        )


def install() -> None:
    """Install the ``torch.nn.utils.clip_grad_norm_`` hand-off now (``dmuon._registry.install("clip")``),
    even with the automatic installs disabled. Idempotent."""
    _registry.install("clip")
