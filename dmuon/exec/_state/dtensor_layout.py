"""The state-dict layout of dedicated matrices: a ``Shard(0)`` DTensor of full logical shape,
and the scatter into it / gather out of it that the model and optimizer state hooks share.

The layout, its scatter and gather, tensor parallelism and the other holders it serves: Note:
the state-dict layout (docs/design.md). All collectives run on dmuon's own groups and are charged
to the ledger as ``"other"``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from dmuon._dtensor import is_dtensor
from dmuon.exec._comm import collective_calls as C


# ----------------------------------------------------------------------------------------------
# DTensor layout of a dedicated matrix
# ----------------------------------------------------------------------------------------------


def _placements(runtime, slot=None) -> tuple:
    """Placements of a dedicated entry on :meth:`~dmuon.exec._runtime.runtime.DmuonRuntime.state_dict_mesh`.

    ``Shard(0)`` over the shard dim (``Replicate()`` before it in HSDP); with TP, the matrix's
    own TP placement on the ``tp`` dim (``Replicate()`` for a plain matrix next to TP ones,
    which every TP coordinate holds whole).
    """
    from torch.distributed.tensor import Replicate, Shard

    g = runtime.groups
    dp = (Shard(0),) if g.shape[0] == 1 else (Replicate(), Shard(0))
    if g.tp_size == 1:
        return dp
    tp = slot.tp.placements[0] if slot is not None and slot.tp is not None else Replicate()
    return dp[:-1] + (tp, Shard(0))


def _global_shape(runtime, slot) -> tuple[int, ...]:
    """The full logical shape (``slot.shape`` is the *unit*: this TP coordinate's shard)."""
    return tuple(runtime.infos[slot.fqn].shape)


def _chunk_rows(rows: int, n: int) -> int:
    return -(-rows // n)


def _my_rows(rows: int, n: int, shard: int) -> int:
    c = _chunk_rows(rows, n)
    return max(0, min(c, rows - shard * c))


def _scatter_chunks(runtime, shape, dtype, full, src: int) -> torch.Tensor:
    """Scatter ``full`` (given on ``src``) over this rank's shard group; the padded chunk."""
    g = runtime.groups
    N = g.shape[1]
    rows, rest = shape[0], tuple(shape[1:])
    c = _chunk_rows(rows, N)
    out = torch.empty((c, *rest), dtype=dtype, device=runtime.device)
    chunks = None
    if dist.get_rank() == src:
        full = full.detach().reshape(shape)
        if c * N == rows:
            chunks = [t.contiguous() for t in full.chunk(N)]
        else:  # pad the last chunks (one extra copy of this matrix, on the source only)
            padded = full.new_zeros((c * N, *rest))
            padded[:rows].copy_(full)
            chunks = list(padded.chunk(N))
    if N == 1:
        out.copy_(chunks[0])
    else:
        C.scatter(out, chunks, src=src, group=g.shard_group, phase="other")
    return out


def _as_dtensor(runtime, slot, padded_chunk):
    """This rank's row chunk of the unit ``slot.shape`` as a DTensor of the full logical shape."""
    return _chunk_dtensor(
        runtime, tuple(slot.shape), _global_shape(runtime, slot), _placements(runtime, slot), padded_chunk
    )


def _chunk_dtensor(runtime, unit_shape, shape, placements, padded_chunk):
    """This rank's (padded) row chunk of a unit of ``unit_shape`` as a DTensor of ``shape``."""
    from torch.distributed.tensor import DTensor

    g = runtime.groups
    local = padded_chunk[: _my_rows(unit_shape[0], g.shape[1], g.shard)]
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(
        local, runtime.state_dict_mesh(), placements, run_check=False, shape=torch.Size(shape), stride=stride
    )


def _coords(runtime, rank: int) -> tuple[int, int]:
    """``(replicate, shard)`` of global ``rank`` in its TP coordinate's table (any table with TP)."""
    g = runtime.groups
    for table in g.tp_tables or (g.mesh_ranks,):
        for r, row in enumerate(table):
            for s, x in enumerate(row):
                if x == rank:
                    return r, s
    raise ValueError(f"dmuon: rank {rank} is not in the mesh {g.tp_tables or g.mesh_ranks}")


# ----------------------------------------------------------------------------------------------
# Loading: whatever was given -> the full value on the ranks that store it
# ----------------------------------------------------------------------------------------------


def _is_own_layout(runtime, value, slot) -> bool:
    mesh = runtime.state_dict_mesh()
    vmesh = value.device_mesh
    same_mesh = vmesh is mesh or (
        vmesh.mesh.shape == mesh.mesh.shape
        and torch.equal(vmesh.mesh.cpu(), mesh.mesh.cpu())
        and vmesh.device_type == mesh.device_type
    )
    return same_mesh and tuple(value.placements) == _placements(runtime, slot)


def _gather_rows(runtime, value, dst: int | None, shape) -> torch.Tensor | None:
    """Gather the row chunks of DTensor ``value`` (this rank's shard group) to ``dst``.

    ``shape``: the unit (this TP coordinate's shard, or the matrix without TP). ``dst=None``:
    this row takes no part. Only ``dst`` materialises the unit.
    """
    g = runtime.groups
    N = g.shape[1]
    if dst is None:
        return None
    rows, rest = shape[0], tuple(shape[1:])
    c = _chunk_rows(rows, N)
    local = value.to_local().detach()
    device, dtype = runtime.device, local.dtype
    padded = local.to(device).contiguous()
    if padded.shape[0] != c:
        tmp = torch.zeros((c, *rest), dtype=dtype, device=device)
        tmp[: padded.shape[0]].copy_(padded)
        padded = tmp
    me = dist.get_rank()
    if N == 1:
        return padded[:rows]
    gather_list = [torch.empty_like(padded) for _ in range(N)] if me == dst else None
    C.LEDGER.charge("other", 0 if me == dst else padded.numel() * padded.element_size())
    work = dist.gather(padded, gather_list, dst=dst, group=g.shard_group, async_op=True)
    C.wait_all(
        [work],
        what="state-dict gather of a dedicated matrix's row chunks",
        timeout_s=C.blocking_timeout_s(runtime.timeout_s, device, g.shard_group),
        group=g.shard_group,
    )
    if me != dst:
        return None
    return torch.cat(gather_list)[:rows]


def _tp_part(slot, full: torch.Tensor) -> torch.Tensor:
    """This rank's TP shard of the full matrix ``full`` (``full`` itself without TP)."""
    if slot.tp is None:
        return full
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(full.shape, slot.tp.mesh, slot.tp.placements)
    return full[tuple(slice(o, o + n) for n, o in zip(shape, offset))]


def _full_on(runtime, slot, value, dst: int | None) -> torch.Tensor | None:
    """The unit value of one state-dict entry (``slot.shape``: this TP coordinate's shard, the
    full matrix without TP) on ``dst`` (this row's receiving rank), None elsewhere.

    ``value``: a DTensor of dmuon's own layout (gathered chunk-wise, no rank but ``dst`` sees
    the whole unit), any other DTensor (``full_tensor()``, every rank of its mesh), or a
    full tensor (``dst`` takes its TP shard).
    """
    shape = _global_shape(runtime, slot)
    if tuple(value.shape) != shape:
        raise ValueError(
            f"dmuon: state dict entry for {slot.fqn!r} has shape {tuple(value.shape)}, expected the full "
            f"{shape} (a full tensor or a DTensor of full shape)"
        )
    if is_dtensor(value):
        if _is_own_layout(runtime, value, slot):
            return _gather_rows(runtime, value, dst, tuple(slot.shape))
        full = value.full_tensor()
        return _tp_part(slot, full) if dist.get_rank() == dst else None
    return _tp_part(slot, value) if dist.get_rank() == dst else None


# ----------------------------------------------------------------------------------------------
# Owner-grouped matrices: no rank holds the whole matrix; its k blocks live on k shard ranks
# ----------------------------------------------------------------------------------------------


def _grouped_full(runtime, gm, block_of_holder) -> torch.Tensor:
    """The full matrix of grouped ``gm`` on every rank of this rank's shard group: one broadcast
    per block from the rank of this row that holds it (``block_of_holder(j)``: the holder's
    tensor of block ``j``, read on the holder only). One matrix is materialised at a time."""
    g = runtime.groups
    info = gm.info
    dtype = gm.logical.dtype
    full = torch.empty(info.shape, dtype=dtype, device=runtime.device)
    me = dist.get_rank()
    for j, (off, size) in enumerate(zip(info.offsets, info.sizes)):
        src = g.rank_of(g.replicate, info.shards[j])
        block = torch.empty(info.block_shape(j), dtype=dtype, device=runtime.device)
        if me == src:
            block.copy_(block_of_holder(j))
        if g.shape[1] > 1:
            C.broadcast(block, src=src, group=g.shard_group, phase="other")
        full.narrow(info.dim, off, size).copy_(block)
    return full


def _full_to_dtensor(runtime, shape, full: torch.Tensor):
    """``full`` (present on every rank of the shard group) as dmuon's ``Shard(0)`` state-dict DTensor."""
    g = runtime.groups
    c = _chunk_rows(shape[0], g.shape[1])
    return _chunk_dtensor(runtime, shape, shape, _placements(runtime), full[g.shard * c : (g.shard + 1) * c].clone())


def _load_grouped(runtime, gm, value, target: torch.Tensor | None) -> torch.Tensor | None:
    """Write this rank's block of ``value`` (a full tensor or a full-shape DTensor of any layout)
    into ``target`` (the held block; None: nothing held here). A DTensor is gathered with
    ``full_tensor()`` (a collective over its mesh; one matrix at a time); returns the block."""
    info = gm.info
    if tuple(value.shape) != tuple(info.shape):
        raise ValueError(
            f"dmuon: state dict entry for {gm.fqn!r} has shape {tuple(value.shape)}, expected the full "
            f"{info.shape} (a full tensor or a DTensor of full shape)"
        )
    if is_dtensor(value):
        value = value.full_tensor()
    if info.block is None:
        return None
    block = value.narrow(info.dim, info.offsets[info.block], info.sizes[info.block])
    if target is not None and target.numel():
        with torch.no_grad():
            target.copy_(block)
    return block


# ----------------------------------------------------------------------------------------------
# Expert-parallel stacks: each rank's model holds its own experts (E/ep, a, b), in place
# ----------------------------------------------------------------------------------------------


def _ep_dtensor(runtime, fqn: str, local: torch.Tensor):
    """This rank's experts ``local`` as the stack's DTensor of full logical shape ``(E, a, b)``,
    ``[Shard(0)]`` over the shard group (rank ``j`` holds experts ``j*E/ep ..``, which is
    DTensor's even ``Shard(0)`` chunking). No copy: ``from_local`` of ``local`` itself."""
    from torch.distributed.tensor import DTensor, Shard

    shape = tuple(runtime.plan.param(fqn).shape)
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(
        local, runtime.state_dict_mesh(), (Shard(0),), run_check=False, shape=torch.Size(shape), stride=stride
    )


def _ep_rows(runtime, fqn: str, value) -> torch.Tensor:
    """This rank's experts of a saved stack ``value``: a DTensor in this runtime's layout
    (its local tensor), any other DTensor (``full_tensor()``, e.g. saved at another EP degree
    and not resharded by DCP), or a full tensor ``(E, a, b)``."""
    spec = runtime.plan.param(fqn)
    local_shape = tuple(spec.local_shape)
    if is_dtensor(value):
        from torch.distributed.tensor import Shard

        if (
            tuple(value.placements) == (Shard(0),)
            and value.device_mesh == runtime.state_dict_mesh()
            and tuple(value.to_local().shape) == local_shape
        ):
            return value.to_local()
        value = value.full_tensor()
    if tuple(value.shape) != tuple(spec.shape):
        raise ValueError(
            f"dmuon: loading expert-parallel stack {fqn!r}: the saved tensor is {tuple(value.shape)} but the stack "
            f"is {tuple(spec.shape)} ({spec.experts.num_experts} experts, {local_shape[0]} on each of "
            f"{spec.experts.ep_size} ranks)"
        )
    e = local_shape[0]
    j = runtime.groups.shard
    return value[j * e : (j + 1) * e]
