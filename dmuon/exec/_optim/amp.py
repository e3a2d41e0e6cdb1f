"""Loss scaling: ``torch.amp.GradScaler`` (and FSDP1's ``ShardedGradScaler``) with :class:`dmuon.Muon`.

:class:`GradScaler` and the wrapped ``torch.amp.GradScaler`` (:func:`route_unscale`,
:func:`unscale_grads`) make every rank skip the same step. Why plain FSDP2's scaler fails on
dmuon's owners and what the unscale does: Note: loss scaling (docs/design.md).
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
