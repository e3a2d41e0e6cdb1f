"""``dmuon.clip_grad_norm_``: the global gradient norm with owner-held gradients counted once.

Other libraries' clipping functions hand dedicated parameters to it (Note: clipping hand-offs,
docs/design.md)."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn as nn

from dmuon._dtensor import is_dtensor
from dmuon.exec._comm import collective_calls as C
from dmuon.exec._optim import nonfinite_skip as _skip
from dmuon.exec._runtime.runtime import bare_stage_runtimes, runtimes_of
from dmuon.exec._runtime.packed_buffers import dedicated_info

__all__ = ["clip_grad_norm_"]


@torch.no_grad()
def clip_grad_norm_(
    parameters,
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> torch.Tensor:
    """Clip gradients in place by the global ``norm_type`` norm; return that norm (every rank).

    ``torch.nn.utils.clip_grad_norm_``'s signature and result: it equals torch's function in one
    process over the full model (up to reduction order). Gradients fall into three kinds, each
    counted once:

    * dedicated matrices: the full averaged gradient lives on its owner only (``p._dmuon``
      with ``is_owner``), so owners' local sums are summed over the world (one all-reduce of a
      scalar; HSDP replicas hold no gradient); with tensor parallelism each rank of a TP owner
      group counts its own shard, and an owned matrix without TP counts ``1/T`` per TP
      coordinate; an expert-parallel stack counts the experts this rank holds;
    * FSDP2 ``DTensor`` gradients: ``torch.nn.utils.get_total_norm`` over the DTensors of each
      device mesh (FSDP2's data-parallel mesh; ``(dp, tp)`` for TP-sharded parameters dmuon does
      not own, e.g. a colwise bias), then ``full_tensor()`` (DTensor reduces over shards and
      de-duplicates replicas);
    * plain tensors (replicated, identical on every rank): counted locally.

    Pipeline parallelism (a dedicated stage: docs/pipeline_parallel.md): pass every parameter
    of every stage this rank holds. The owners' sums are summed over the world (every stage),
    and the FSDP2 and plain parts, identical on the data-parallel ranks of a stage, are summed
    over the ranks at this rank's data-parallel coordinate in every stage (p-th powers; max for
    ``inf``): one number on every rank, equal to torch's norm of the whole model in one process.
    A rank whose stages dedicate nothing (e.g. only the embedding) runs the same collectives,
    through its stages' runtimes.

    Every rank must call it (it runs collectives), after ``backward()`` and before ``step()``.
    With a ``dmuon.Muon(skip_nonfinite=True)`` on the model, the step's non-finite flags (``2·W``
    float32 elements, :mod:`dmuon.exec._optim.nonfinite_skip`) ride on the all-reduce below, so the
    step that follows issues no collective of its own for them.
    dmuon's collectives here (the all-reduce, and the flags' all-gather below) are charged to the
    ledger phase ``"other"``: clipping is the caller's choice, not part of the plan's step, so
    ``plan.cost`` and the step schedule leave it out (as GradScaler's inf check).

    Args:
        parameters: an ``nn.Module``, an iterable of parameters (placeholders included) or one tensor.
        max_norm: maximum norm; gradients are scaled by ``min(1, max_norm / (norm + 1e-6))``,
            the coefficient ``torch.nn.utils.clip_grad_norm_`` uses.
        norm_type: ``p`` of the p-norm (``float("inf")`` for the max norm).
        error_if_nonfinite: raise when the total norm is ``nan`` / ``inf`` (before any gradient is
            scaled). Every rank then all-gathers one small flag vector (which ranks hold a
            non-finite gradient, and the first such parameter), the first such rank broadcasts
            that parameter's name when the norm is non-finite, and every rank raises the same
            ``RuntimeError``, naming those ranks and that parameter.
        foreach: as torch's: ``None`` uses the foreach kernels where the device supports them,
            ``True`` requires them, ``False`` scales tensor by tensor.

    Returns:
        the total norm as a 0-d float32 tensor, identical on every rank.
    """

    if isinstance(parameters, nn.Module):
        named = list(parameters.named_parameters())
    else:
        named = [(None, p) for p in ([parameters] if isinstance(parameters, torch.Tensor) else parameters)]
    owned, dtensors, plain = [], [], []
    replicated = []  # with TP: owned matrices without TP, held by an owner in every TP coordinate
    held = []  # (parameter index, local gradient this rank holds) for the non-finite report
    tp_size = 1
    job_group = None  # dmuon's group over this job's ranks (None: the world)
    stage_group = False  # pipeline: the group over which the stages' non-owned parts are summed
    rt_device = None  # the runtime's (compute) device: the reductions run there, wherever the gradients are
    for index, (_, p) in enumerate(named):
        info = dedicated_info(p)
        if info is not None and stage_group is False:
            rt = info.runtime()  # None once the runtime is gone: the world, no stage group
            job_group = rt.global_group() if rt is not None else None
            rt_device = rt.device if rt is not None else None
            stage_group = rt.groups.peer_group if rt is not None and rt.pipelined else None
        if p.grad is None:
            continue
        if info is not None:
            if info.is_owner:
                tp = getattr(info, "tp", None)
                tp_size = getattr(info.runtime(), "tp_size", 1)
                g = tp.local(p.grad) if tp is not None else p.grad  # a TP owner group's shards partition it
                (replicated if tp is None and tp_size > 1 else owned).append(g)
                held.append((index, g))
        elif is_dtensor(p.grad):
            dtensors.append(p.grad)
            held.append((index, p.grad.to_local()))
        else:
            plain.append(p.grad)
            held.append((index, p.grad))
    distributed = dist.is_available() and dist.is_initialized()
    # pipeline stages whose plan dedicates nothing: their rank takes part in the same collectives
    bare = bare_stage_runtimes(p for _, p in named) if distributed else []
    if bare and stage_group is False:  # no dedicated parameter here: the stage's groups
        job_group, stage_group = bare[0].global_group(), bare[0].groups.peer_group
        rt_device = bare[0].device
    norm_type = float(norm_type)
    inf = math.isinf(norm_type)
    # offload: owned gradients on the host, FSDP2's on the host or the accelerator; the norms meet on
    # the runtime's device
    device = rt_device or next((g.device for g in owned + replicated + plain + dtensors), torch.device("cpu"))

    def local(grads) -> torch.Tensor:
        if not grads:
            return torch.zeros((), dtype=torch.float32, device=device)
        n = torch.nn.utils.get_total_norm(grads, norm_type, foreach=foreach).float().to(device)
        return n if inf else n.pow(norm_type)

    owned_part = local(owned)
    if replicated:  # counted once per TP coordinate by the all-reduce below
        rep = local(replicated)
        owned_part = torch.maximum(owned_part, rep) if inf else owned_part + rep / tp_size
    if distributed:
        # dmuon.Muon(skip_nonfinite=True): the step's non-finite flags ride on this all-reduce
        # (dmuon.exec._optim.nonfinite_skip), kept on the runtime for the step
        runtimes = [rt for rt in runtimes_of(p for _, p in named) + bare if rt.check_nonfinite]
        reduced = (
            _skip.append_to_clip(owned_part, [p for _, p in named], runtimes, job_group) if runtimes else owned_part
        )
        if inf:
            C.all_reduce_max(reduced, group=job_group, phase="other")
        else:
            C.all_reduce_sum(reduced, group=job_group, phase="other")
        if runtimes:
            owned_part = _skip.keep_from_clip(reduced, runtimes, job_group)
    parts = [owned_part, local(plain).to(owned_part.device)]
    by_mesh: dict = {}  # FSDP2 gradients live on the data-parallel mesh, TP-sharded ones (a
    for g in dtensors:  # colwise bias) on (dp, tp): norms of different meshes cannot be stacked
        by_mesh.setdefault(g.device_mesh, []).append(g)
    for grads in by_mesh.values():  # same order on every rank: parameter order
        n = torch.nn.utils.get_total_norm(grads, norm_type, foreach=foreach)
        if is_dtensor(n) and n.device != owned_part.device:  # FSDP2 offload: host shards, reduced on the device
            n = n.to(owned_part.device)
        n = (n.full_tensor() if is_dtensor(n) else n).float().to(owned_part.device)
        parts.append(n if inf else n.pow(norm_type))
    if distributed and stage_group not in (False, None):  # pipeline: every stage's FSDP2 / plain parts
        stage_part = torch.stack(parts[1:]).max() if inf else torch.stack(parts[1:]).sum()
        if inf:
            C.all_reduce_max(stage_part, group=stage_group, phase="other")
        else:
            C.all_reduce_sum(stage_part, group=stage_group, phase="other")
        parts = [owned_part, stage_part]
    stacked = torch.stack(parts)
    total = stacked.max() if inf else stacked.sum().pow(1.0 / norm_type)
    if error_if_nonfinite:
        _raise_if_nonfinite(total, held, named, norm_type, job_group if distributed else False)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    _scale_(owned + replicated + plain + [g.to_local() for g in dtensors], coef, foreach)
    return total


def _scale_(grads: list, coef: torch.Tensor, foreach: bool | None) -> None:
    """``g *= coef`` for every tensor in ``grads`` (DTensors as their local shards), grouped by
    device and dtype as ``torch.nn.utils.clip_grads_with_norm_`` does (foreach kernels where
    supported, or as ``foreach`` demands); no host sync."""
    from torch.utils._foreach_utils import (
        _device_has_foreach_support,
        _group_tensors_by_device_and_dtype,
        _has_foreach_support,
    )

    if not grads:
        return
    for (dev, _), ([group], _) in _group_tensors_by_device_and_dtype([grads]).items():
        c = coef.to(dev)
        if (foreach is None and _has_foreach_support(group, dev)) or (foreach and _device_has_foreach_support(dev)):
            torch._foreach_mul_(group, c)
        elif foreach:
            raise RuntimeError(f"foreach=True was passed, but can't use the foreach API on {dev.type} tensors")
        else:
            for g in group:
                g.mul_(c)


def _raise_if_nonfinite(total: torch.Tensor, held: list, named: list, norm_type: float, group) -> None:
    """``error_if_nonfinite``: every rank all-gathers ``[total non-finite here, a held gradient
    non-finite here, index of the first such parameter]`` (three int64; ``group=False``: one
    process, no collective) and raises the same error when any rank's total is non-finite; the
    first rank holding a non-finite gradient then broadcasts that parameter's name (an index into
    its own list, which is another stage's list than this rank's under pipeline parallelism)."""
    bad_index = -1
    if held:
        finite = torch.stack([torch.isfinite(g).all() for _, g in held]).tolist()  # one host read
        bad_index = next((index for (index, _), ok in zip(held, finite) if not ok), -1)
    mine = torch.tensor([int(not bool(torch.isfinite(total))), int(bad_index >= 0), bad_index], dtype=torch.int64)
    if group is False:
        table = [mine.tolist()]
    else:
        k = dist.get_world_size(group)
        out = torch.empty(k * 3, dtype=torch.int64, device=total.device)
        C.all_gather_into(out, mine.to(total.device), group=group, phase="other")
        table = out.view(k, 3).tolist()
    if not any(row[0] for row in table):
        return
    ranks = [r for r, row in enumerate(table) if row[1]]
    if group not in (False, None):
        ranks = [dist.get_global_rank(group, r) for r in ranks]
    first = next((row[2] for row in table if row[1]), -1)
    if first >= 0:
        src = next(r for r, row in enumerate(table) if row[1])
        me = 0 if group is False else dist.get_rank(group)
        name = None
        if me == src:
            name = named[first][0] or getattr(dedicated_info(named[first][1]), "fqn", None) or f"parameter #{first}"
        if group is not False:
            box = [name]
            dist.broadcast_object_list(box, src=ranks[0], group=group)
            name = box[0]
        where = (
            f"global rank(s) {ranks} hold non-finite gradients (after the reduce: owned matrices, FSDP2 shards, "
            f"local tensors); the first such parameter: {name!r}"
        )
    else:  # every held gradient finite, the sum of their norms overflowed
        where = "no rank holds a non-finite gradient: the norm itself overflowed"
    raise RuntimeError(
        f"dmuon.clip_grad_norm_: the total norm of order {norm_type:g} of the gradients is non-finite, so it cannot be "
        f"clipped: {where}. Gradients were left unscaled. To scale by the non-finite norm anyway, set "
        "error_if_nonfinite=False"
    )
