"""NorMuon's second moments in optimizer state dicts (``dmuon.Muon(variant="normuon")``).

The layout, its resharding and its bytes: Note: NorMuon state dicts (docs/design.md).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from dmuon._dtensor import is_dtensor
from dmuon.exec._comm import collective_calls as C
from dmuon.exec._optim import normuon_update as _nm
from dmuon.exec._state.dtensor_layout import (
    _chunk_dtensor,
    _chunk_rows,
    _coords,
    _gather_rows,
    _is_own_layout,
    _my_rows,
    _placements,
    _scatter_chunks,
)

__all__ = ["global_second_moment_shape", "second_moment_to_dtensor", "second_moment_from_saved"]


def global_second_moment_shape(runtime, fqn: str) -> tuple[int, ...]:
    """The full logical second-moment shape of dedicated ``fqn`` (from its plan record)."""
    spec = runtime.plan.param(fqn)
    return _nm.second_moment_shape(spec.shape, matrix_shape=spec.matrix_shape, experts=spec.experts, view=spec.view)


def _block_shape(shape: tuple[int, ...], rows: int) -> tuple[int, ...]:
    return (rows, *shape[1:])


def second_moment_to_dtensor(runtime, info, p, v):
    """The second moment ``v`` of dedicated ``p`` (held on its owner; None elsewhere or when
    missing: zeros) as the state dict's DTensor of full logical shape, on every rank."""
    from torch.distributed.tensor import DTensor, Shard

    shape = global_second_moment_shape(runtime, info.fqn)
    g = runtime.groups
    device = runtime.device
    if getattr(info, "ep_local", False):  # this rank's experts' rows, no copy
        local = v if v is not None else _nm.new_second_moment(p, info)
        stride = torch.empty(shape, device="meta").stride()
        return DTensor.from_local(
            local, runtime.state_dict_mesh(), (Shard(0),), run_check=False, shape=torch.Size(shape), stride=stride
        )
    N = g.shape[1]
    c = _chunk_rows(shape[0], N)
    group_info = getattr(info, "group", None)
    if group_info is not None:  # expert ranges: owners hold row ranges (dim 0) of v
        owner_replicate = _coords(runtime, group_info.ranks[0])[0]
        chunk = torch.zeros((c, *shape[1:]), dtype=torch.float32, device=device)
        if g.replicate == owner_replicate:
            full = torch.empty(shape, dtype=torch.float32, device=device)
            me = dist.get_rank()
            for j, (off, size) in enumerate(zip(group_info.offsets, group_info.sizes)):
                src = g.rank_of(g.replicate, group_info.shards[j])
                block = torch.zeros(_block_shape(shape, size), dtype=torch.float32, device=device)
                if me == src and v is not None:
                    block.copy_(v)
                if N > 1:
                    C.broadcast(block, src=src, group=g.shard_group, phase="other")
                full[off : off + size].copy_(block)
            rows = _my_rows(shape[0], N, g.shard)
            chunk[:rows].copy_(full[g.shard * c : g.shard * c + rows])
    else:
        owner_replicate = _coords(runtime, info.owner_global_rank)[0]
        if g.replicate == owner_replicate:
            full = None
            if info.is_owner:
                full = v if v is not None else torch.zeros(shape, dtype=torch.float32, device=device)
            chunk = _scatter_chunks(runtime, shape, torch.float32, full, info.owner_global_rank)
        else:
            chunk = torch.empty((c, *shape[1:]), dtype=torch.float32, device=device)
    if g.shape[0] > 1:
        C.broadcast(chunk, src=g.rank_of(owner_replicate, g.shard), group=g.replicate_group, phase="other")
    return _chunk_dtensor(runtime, shape, shape, _placements(runtime), chunk)


def second_moment_from_saved(runtime, info, p, value):
    """The owner's second moment of dedicated ``p`` from a state-dict entry ``value`` (dmuon's
    DTensor, another DTensor of full shape, or a full tensor), fp32 on ``p``'s device; None on
    ranks that do not own ``p``. Every rank of ``p``'s rows takes part (a collective).

    Raises:
        ValueError: ``value`` is not of the full second-moment shape (names the parameter).
    """
    shape = global_second_moment_shape(runtime, info.fqn)
    if tuple(value.shape) != shape:
        raise ValueError(
            f"dmuon: state dict entry {_nm.SECOND_MOMENT_KEY!r} of {info.fqn!r} has shape {tuple(value.shape)}, "
            f"expected the full second-moment shape {shape}"
        )
    g = runtime.groups
    if getattr(info, "ep_local", False):  # this rank's experts' rows
        e = int(p.shape[0])
        if (
            is_dtensor(value)
            and tuple(value.to_local().shape) == (e, *shape[1:])
            and _is_own_layout(runtime, value, None)
        ):
            local = value.to_local()
        else:
            full = value.full_tensor() if is_dtensor(value) else value
            local = full[g.shard * e : (g.shard + 1) * e]
        return local.to(device=p.device, dtype=torch.float32, copy=True)
    group_info = getattr(info, "group", None)
    if group_info is not None:  # expert ranges: each member its range of rows
        full = value.full_tensor() if is_dtensor(value) else value
        if not info.is_owner:
            return None
        off, size = group_info.offsets[group_info.block], group_info.sizes[group_info.block]
        return full[off : off + size].to(device=p.device, dtype=torch.float32, copy=True).contiguous()
    owner_replicate = _coords(runtime, info.owner_global_rank)[0]
    dst = info.owner_global_rank if g.replicate == owner_replicate else None
    if is_dtensor(value) and _is_own_layout(runtime, value, None):
        full = _gather_rows(runtime, value, dst, shape)
    else:
        full = value.full_tensor() if is_dtensor(value) else value
    if not info.is_owner:
        return None
    return full.reshape(shape).to(device=p.device, dtype=torch.float32, copy=True)
