"""``dmuon.clip_grad_norm_``: the global gradient norm with owner-held gradients counted once.

(``torch.nn.utils.clip_grad_norm_``'s hand-off to it lives in :mod:`dmuon.integrations.clip`.)"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn as nn

from dmuon.exec.runtime.buffers import dedicated_info

__all__ = ["clip_grad_norm_"]


def clip_grad_norm_(model_or_params, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Clip gradients in place by the global ``norm_type`` norm; return that norm (every rank).

    The result equals ``torch.nn.utils.clip_grad_norm_`` in one process over the full model
    (up to reduction order). Gradients fall into three kinds, each counted once:

    * dedicated matrices: the full averaged gradient lives on its owner only (``p._dmuon``
      with ``is_owner``), so owners' local sums are summed over the world (one all-reduce of a
      scalar; HSDP replicas hold no gradient); with tensor parallelism each rank of a TP owner
      group counts its own shard, and an owned matrix without TP counts ``1/T`` per TP
      coordinate;
    * FSDP2 ``DTensor`` gradients: ``torch.nn.utils.get_total_norm`` over the DTensors of each
      device mesh (FSDP2's data-parallel mesh; ``(dp, tp)`` for TP-sharded parameters dmuon does
      not own, e.g. a colwise bias), then ``full_tensor()`` (DTensor reduces over shards and
      de-duplicates replicas);
    * plain tensors (replicated, identical on every rank): counted locally.

    Every rank must call it (it runs collectives), after ``backward()`` and before ``step()``.

    Args:
        model_or_params: an ``nn.Module`` or an iterable of parameters (placeholders included).
        max_norm: maximum norm; gradients are scaled by ``min(1, max_norm / (norm + 1e-6))``,
            the coefficient ``torch.nn.utils.clip_grad_norm_`` uses.
        norm_type: ``p`` of the p-norm (``float("inf")`` for the max norm).

    Returns:
        the total norm as a 0-d float32 tensor, identical on every rank.
    """
    from torch.distributed.tensor import DTensor

    params = model_or_params.parameters() if isinstance(model_or_params, nn.Module) else model_or_params
    owned, dtensors, plain = [], [], []
    replicated = []  # with TP: owned matrices without TP, held by an owner in every TP coordinate
    tp_size = 1
    job_group = None  # dmuon's group over this job's ranks (None: the world)
    for p in params:
        info = dedicated_info(p)
        if info is not None and job_group is None:
            job_group = getattr(getattr(info.runtime(), "groups", None), "job_group", None)
        if p.grad is None:
            continue
        if info is not None:
            if info.is_owner:
                tp = getattr(info, "tp", None)
                tp_size = getattr(info.runtime(), "tp_size", 1)
                if tp is not None:  # the owner group's shards partition it: local norms add up
                    owned.append(tp.local(p.grad))
                elif tp_size > 1:
                    replicated.append(p.grad)
                else:
                    owned.append(p.grad)
        elif isinstance(p.grad, DTensor):
            dtensors.append(p.grad)
        else:
            plain.append(p.grad)
    norm_type = float(norm_type)
    inf = math.isinf(norm_type)
    device = next((g.device for g in owned + plain), torch.device("cpu"))

    def local(grads) -> torch.Tensor:
        if not grads:
            return torch.zeros((), dtype=torch.float32, device=device)
        n = torch.nn.utils.get_total_norm(grads, norm_type).float()
        return n if inf else n.pow(norm_type)

    owned_part = local(owned)
    if replicated:  # counted once per TP coordinate by the all-reduce below
        rep = local(replicated)
        owned_part = torch.maximum(owned_part, rep) if inf else owned_part + rep / tp_size
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(owned_part, op=dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM, group=job_group)
    parts = [owned_part, local(plain).to(owned_part.device)]
    by_mesh: dict = {}  # FSDP2 gradients live on the data-parallel mesh, TP-sharded ones (a
    for g in dtensors:  # colwise bias) on (dp, tp): norms of different meshes cannot be stacked
        by_mesh.setdefault(g.device_mesh, []).append(g)
    for grads in by_mesh.values():  # same order on every rank: parameter order
        n = torch.nn.utils.get_total_norm(grads, norm_type)
        n = (n.full_tensor() if isinstance(n, DTensor) else n).float().to(owned_part.device)
        parts.append(n if inf else n.pow(norm_type))
    stacked = torch.stack(parts)
    total = stacked.max() if inf else stacked.sum().pow(1.0 / norm_type)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in owned + replicated + plain:
        g.mul_(coef.to(g.device, g.dtype))
    for g in dtensors:
        g.mul_(coef.item())
    return total
