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

:func:`install` (run by ``import dmuon``) wraps ``GradScaler._unscale_grads_`` (and
``ShardedGradScaler``'s override): for a :class:`dmuon.Muon` it calls
:meth:`dmuon.Muon._unscale_grads_for_scaler` instead, which

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
import inspect

__all__ = ["install", "is_installed"]

_PATCHED_ATTR = "__dmuon_wrapped__"


def _wrap(fn):
    @functools.wraps(fn)
    def wrapper(self, optimizer, inv_scale, found_inf, allow_fp16=False, *args, **kwargs):
        hook = getattr(optimizer, "_unscale_grads_for_scaler", None)
        if hook is None:
            return fn(self, optimizer, inv_scale, found_inf, allow_fp16, *args, **kwargs)
        return hook(inv_scale, found_inf, allow_fp16)

    setattr(wrapper, _PATCHED_ATTR, fn)
    return wrapper


def _scaler_classes() -> list[type]:
    from torch.amp.grad_scaler import GradScaler

    classes = [GradScaler]
    try:
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
    except ImportError:  # pragma: no cover - depends on the torch build
        ShardedGradScaler = None
    if ShardedGradScaler is not None and "_unscale_grads_" in ShardedGradScaler.__dict__:
        classes.append(ShardedGradScaler)
    return classes


def install() -> None:
    """Wrap the scalers' ``_unscale_grads_`` for :class:`dmuon.Muon` (idempotent).

    Raises:
        RuntimeError: the installed torch's ``_unscale_grads_`` no longer takes
            ``(self, optimizer, inv_scale, found_inf, allow_fp16)``.
    """
    for cls in _scaler_classes():
        fn = cls.__dict__.get("_unscale_grads_")
        if fn is None or hasattr(fn, _PATCHED_ATTR):
            continue
        params = list(inspect.signature(fn).parameters)
        if params[:5] != ["self", "optimizer", "inv_scale", "found_inf", "allow_fp16"]:
            raise RuntimeError(
                f"dmuon: {cls.__module__}.{cls.__qualname__}._unscale_grads_{inspect.signature(fn)} no longer "
                "takes (optimizer, inv_scale, found_inf, allow_fp16); dmuon cannot make loss scaling agree "
                "across ranks on this torch version"
            )
        cls._unscale_grads_ = _wrap(fn)


def is_installed() -> bool:
    return all(hasattr(cls.__dict__.get("_unscale_grads_"), _PATCHED_ATTR) for cls in _scaler_classes())
