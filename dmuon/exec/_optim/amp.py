"""Loss scaling: ``torch.amp.GradScaler`` (and FSDP1's ``ShardedGradScaler``) with :class:`dmuon.Muon`.

What users of FSDP2 write is the plain scaler::

    scaler = torch.amp.GradScaler(device)
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)          # optional, e.g. before clipping
    scaler.step(optimizer)
    scaler.update()

With plain FSDP2 every gradient is a ``DTensor``, and DTensor's dispatch of
``torch._amp_foreach_non_finite_check_and_unscale_`` all-reduces ``found_inf`` over each
gradient's mesh, so every rank agrees on whether to skip the step. dmuon's owners hold plain
tensors: the scaler's one foreach call over a list that mixes them with DTensors fails
("got mixed torch.Tensor and DTensor"), and even split, an inf that only the owner of one matrix
sees would make that rank alone skip its step.

:class:`GradScaler` (``dmuon.GradScaler``, a ``torch.amp.GradScaler``) does this without any patch,
the way ``ShardedGradScaler`` scopes FSDP1's. By default the first ``dmuon.dedicate_params`` also
wraps ``torch.amp.GradScaler._unscale_grads_`` (and ``ShardedGradScaler``'s override) with
:func:`route_unscale` (the ``amp.*`` entries of :mod:`dmuon._registry`), so that the plain scaler
works too: for a :class:`dmuon.Muon` it calls
:func:`unscale_grads` instead (through ``dmuon.Muon._unscale_grads_for_scaler``), which

1. finishes in-flight gradient reduces (``runtime.wait_pending``), so owners' ``.grad`` are final;
2. unscales every local gradient (DTensors through their local shards) with torch's own kernel,
   one call per (device, dtype);
3. MAX-all-reduces ``found_inf`` over the default process group (ONE collective, on every rank
   alike), so every rank skips the same step and ``update()`` moves the scale identically.

A skipped step leaves parameters, momenta and AdamW's step counters untouched (the scaler does not
call ``optimizer.step()``). Other optimizers go to torch's code unchanged. ``ShardedGradScaler``
then all-reduces the agreed ``found_inf`` once more (a sum of equal flags: same decision).
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from dmuon import _registry
from dmuon._dtensor import local_tensor
from dmuon.exec._runtime.runtime import wait_pending

__all__ = ["GradScaler", "route_unscale", "install", "is_installed", "unscale_grads"]


def route_unscale(fn):
    """The wrapper of a scaler's ``_unscale_grads_`` (registry entries ``amp.*``): an optimizer
    with ``_unscale_grads_for_scaler`` (:class:`dmuon.Muon`) unscales through it; any other goes
    to ``fn`` unchanged."""

    @functools.wraps(fn)
    def wrapper(self, optimizer, inv_scale, found_inf, allow_fp16=False, *args, **kwargs):
        hook = getattr(optimizer, "_unscale_grads_for_scaler", None)
        if hook is None:
            return fn(self, optimizer, inv_scale, found_inf, allow_fp16, *args, **kwargs)
        return hook(inv_scale, found_inf, allow_fp16)

    return wrapper


class GradScaler(torch.amp.GradScaler):
    """``torch.amp.GradScaler`` for :class:`dmuon.Muon`, without patching torch: ``unscale_`` /
    ``step`` on a ``dmuon.Muon`` unscale owner-held gradients and agree on ``found_inf`` over
    every rank (:func:`unscale_grads`); any other optimizer is torch's. Same arguments as
    ``torch.amp.GradScaler`` (``dmuon.GradScaler("cuda")``)."""

    def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16):
        hook = getattr(optimizer, "_unscale_grads_for_scaler", None)
        if hook is None:
            return super()._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)
        return hook(inv_scale, found_inf, allow_fp16)


def install() -> None:
    """Wrap the scalers' ``_unscale_grads_`` now (``dmuon._registry.install("amp")``), even with
    the automatic installs disabled. Idempotent.

    Raises:
        dmuon._registry.IntegrationError: the installed torch's ``_unscale_grads_`` no longer
            takes ``(self, optimizer, inv_scale, found_inf, allow_fp16)``.
    """
    _registry.install("amp")


def is_installed() -> bool:
    return _registry.installed("amp.grad_scaler")


@torch.no_grad()
def unscale_grads(opt, inv_scale: Tensor, found_inf: Tensor, allow_fp16: bool) -> dict:
    """``GradScaler._unscale_grads_`` for the :class:`dmuon.Muon` ``opt`` (called through
    ``Muon._unscale_grads_for_scaler`` by :class:`GradScaler` or :func:`route_unscale`):
    finish in-flight reduces, unscale every local gradient (a DTensor through its local shard)
    with torch's kernel per (device, dtype), then SUM-all-reduce the inf flag over the default
    process group so that every rank skips the same step.

    Collectives: one all-reduce of one float (when a process group is initialised), on
    every rank alike, whatever the gradients hold.

    Returns: ``{found_inf.device: found_inf}`` (0.0 or 1.0 on every rank), as the scaler expects.

    Raises:
        ValueError: an fp16 gradient with ``allow_fp16=False`` (torch's rule), on the rank that
            holds it, before the collective; sparse gradients are not supported.
    """
    import torch.distributed as dist

    wait_pending(opt._dedicated_params())
    by_device: dict[torch.device, dict[torch.dtype, list[Tensor]]] = {}
    for group in opt.param_groups:
        for p in group["params"]:
            grad = p.grad
            if grad is None:
                continue
            if grad.is_sparse:
                raise RuntimeError("dmuon.Muon: loss scaling does not support sparse gradients")
            if not allow_fp16 and grad.dtype == torch.float16:
                raise ValueError("Attempting to unscale FP16 gradients.")
            local = local_tensor(grad)  # DTensor: its shard
            by_device.setdefault(local.device, {}).setdefault(local.dtype, []).append(local)
    flags = []
    for device, per_dtype in by_device.items():
        flag = torch.zeros_like(found_inf, device=device)
        scale = inv_scale.to(device)
        for grads in per_dtype.values():
            torch._amp_foreach_non_finite_check_and_unscale_(grads, flag, scale)
        flags.append(flag.to(found_inf.device))
    for flag in flags:
        found_inf.add_(flag)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        from dmuon.exec._comm import collective_calls as C

        C.all_reduce_sum(found_inf, group=None, phase="other")
    found_inf.clamp_(max=1.0)
    return {found_inf.device: found_inf}
