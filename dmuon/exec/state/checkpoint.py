"""State-dict integration: owner-held matrices and momenta as ``Shard(0)`` DTensors of full shape.

Every dedicated matrix lives in full on its holders only (the owner; in HSDP also its replicas)
and its Muon momentum on the owner only. ``torch.distributed.checkpoint`` (DCP) and its
``get_/set_model_state_dict`` / ``get_/set_optimizer_state_dict`` helpers need, on every rank,
the same keys with tensors of full logical shape. dmuon hooks in at the narrowest points, the
``state_dict`` / ``load_state_dict`` hooks of the modules and of :class:`dmuon.Muon`:

Model (:func:`register_state_dict_hooks`, called by ``dmuon.exec.apply``)
    ``module.state_dict()`` post-hook: each dedicated entry becomes a DTensor of the full
    shape, ``[Shard(0)]`` over the shard group (``[Replicate(), Shard(0)]`` on an HSDP mesh),
    made by a *scatter* from the holder of each replicate row: each rank receives only its
    ``ceil(m/N)``-row chunk (the ``torch.chunk`` layout DTensor uses), one matrix at a time.
    ``load_state_dict`` pre-hook: a DTensor of that layout is *gathered chunk-wise to the
    holder* of each row (no ``full_tensor()`` on every rank: only holders ever see the whole
    matrix); a full tensor is copied by the holders; anything else is ``full_tensor()``-ed.

Optimizer (:func:`register_optimizer_hooks`, called by ``dmuon.Muon``)
    ``state_dict()`` pre-hook: :meth:`dmuon.Muon.init_state` (so every parameter, also one that
    never had a gradient, has state: keys are identical on every rank). Post-hook: for every
    dedicated parameter, on every rank, ``{"momentum_buffer": DTensor}`` scattered from the
    owner (HSDP: in the owner's row, then each chunk broadcast to the other rows); the state
    is ordered by parameter index on every rank (DCP's gather runs collectives in dict order).
    ``load_state_dict`` pre-hook: each momentum DTensor is gathered chunk-wise to the owner; on
    other ranks the entry is dropped (non-owners keep no state for placeholders).

Tensor parallelism: a TP-sharded dedicated matrix is held per TP coordinate as its TP shard (the
*unit*: ``slot.shape``); everything above runs on the unit in each TP coordinate's own
data-parallel groups, and the DTensor is over the whole job, ``("tp", "shard")`` (HSDP:
``("replicate", "tp", "shard")``, :meth:`~dmuon.exec.runtime.runtime.DmuonRuntime.state_dict_mesh`),
with the matrix's TP placement on ``tp`` and ``Shard(0)`` of the unit on ``shard``; a full tensor
given to load is cut to each holder's TP shard; :func:`full_state_dict` all-gathers the TP shards
on dmuon's TP group.

Plain ``model.state_dict()`` (decision): it returns the sharded form above, never a zero-size
placeholder. It is a *collective*: every rank of the mesh must call it together (as for DCP's
helpers). For a file readable without torch.distributed use :func:`full_state_dict` (gathered
full tensors, rank 0 by default). ``optimizer.state_dict()`` likewise.

All collectives run on dmuon's own groups and are charged to the ledger as ``"other"``; reading
waits for pending HSDP replicate broadcasts first, and loading waits for them before writing.
"""

from __future__ import annotations

import threading

import torch
import torch.distributed as dist
import torch.nn as nn

from dmuon.exec.comm import collectives as C
from dmuon.exec.runtime.buffers import _Grouped, dedicated_info

__all__ = [
    "register_state_dict_hooks",
    "register_optimizer_hooks",
    "full_state_dict",
    "scatter_full_to_dtensor",
]

_LOCAL = threading.local()  # .full: None | (rank0_only, cpu_offload) while full_state_dict runs


# ----------------------------------------------------------------------------------------------
# DTensor layout of a dedicated matrix
# ----------------------------------------------------------------------------------------------


def _placements(runtime, slot=None) -> tuple:
    """Placements of a dedicated entry on :meth:`~dmuon.exec.runtime.runtime.DmuonRuntime.state_dict_mesh`.

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


def _local(t):
    """The local tensor of a DTensor (a TP matrix's shard), else ``t`` itself."""
    return t.to_local() if _is_dtensor(t) else t


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
    return _chunk_dtensor(runtime, tuple(slot.shape), _global_shape(runtime, slot), _placements(runtime, slot), padded_chunk)


def _chunk_dtensor(runtime, unit_shape, shape, placements, padded_chunk):
    """This rank's (padded) row chunk of a unit of ``unit_shape`` as a DTensor of ``shape``."""
    from torch.distributed.tensor import DTensor

    g = runtime.groups
    local = padded_chunk[: _my_rows(unit_shape[0], g.shape[1], g.shard)]
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(
        local, runtime.state_dict_mesh(), placements, run_check=False, shape=torch.Size(shape), stride=stride
    )


def scatter_full_to_dtensor(runtime, slot):
    """The dedicated parameter of ``slot`` as a full-shape DTensor (holder of each row scatters)."""
    g = runtime.groups
    src = g.rank_of(g.replicate, runtime.shard_of_fqn[slot.fqn])
    full = _local(slot.logical) if dist.get_rank() == src else None
    chunk = _scatter_chunks(runtime, tuple(slot.shape), slot.logical.dtype, full, src)
    return _as_dtensor(runtime, slot, chunk)


def _momentum_to_dtensor(runtime, slot, info, buf):
    """The owner's momentum ``buf`` as a full-shape DTensor on every rank.

    The owner ``(s, r)`` scatters in its row; in HSDP each ``(s', r)`` then broadcasts its chunk
    over its replicate group, so every rank holds one chunk and never the whole matrix. With TP
    every TP coordinate does this for its own shard (its owner holds that shard's momentum).
    """
    g = runtime.groups
    owner_replicate = _coords(runtime, info.owner_global_rank)[0]
    shape = tuple(slot.shape)
    if g.replicate == owner_replicate:
        full = _local(buf) if buf is not None else None
        chunk = _scatter_chunks(runtime, shape, slot.logical.dtype, full, info.owner_global_rank)
    else:
        chunk = torch.empty((_chunk_rows(shape[0], g.shape[1]), *shape[1:]), dtype=slot.logical.dtype, device=runtime.device)
    if g.shape[0] > 1:
        C.broadcast(chunk, src=g.rank_of(owner_replicate, g.shard), group=g.replicate_group, phase="other")
    return _as_dtensor(runtime, slot, chunk)


def _grouped_momentum_to_dtensor(runtime, info, p, buf):
    """The owner group's momentum (each member holds its block) as a full-shape DTensor: the
    members broadcast their blocks in the owners' row (every rank of that row holds the matrix
    for a moment), each keeps its row chunk; HSDP: each chunk is broadcast over its replicate
    group, as for one owner."""
    g = runtime.groups
    gm = runtime.grouped_by_fqn[info.fqn]
    group_info = info.group
    owner_replicate = _coords(runtime, group_info.ranks[0])[0]
    shape = tuple(group_info.shape)
    N = g.shape[1]
    c = _chunk_rows(shape[0], N)
    chunk = torch.zeros((c, *shape[1:]), dtype=p.dtype, device=runtime.device)
    if g.replicate == owner_replicate:
        def block(j):
            if buf is None:  # state cleared by hand: the step would start from zeros too
                return torch.zeros(group_info.block_shape(j), dtype=p.dtype, device=runtime.device)
            return buf
        full = _grouped_full(runtime, gm, block)
        rows = _my_rows(shape[0], N, g.shard)
        chunk[:rows].copy_(full[g.shard * c : g.shard * c + rows])
    if g.shape[0] > 1:
        C.broadcast(chunk, src=g.rank_of(owner_replicate, g.shard), group=g.replicate_group, phase="other")
    return _chunk_dtensor(runtime, shape, shape, _placements(runtime), chunk)


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
        vmesh.mesh.shape == mesh.mesh.shape and torch.equal(vmesh.mesh.cpu(), mesh.mesh.cpu())
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
    dist.gather(padded, gather_list, dst=dst, group=g.shard_group)
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
    if _is_dtensor(value):
        if _is_own_layout(runtime, value, slot):
            return _gather_rows(runtime, value, dst, tuple(slot.shape))
        full = value.full_tensor()
        return _tp_part(slot, full) if dist.get_rank() == dst else None
    return _tp_part(slot, value) if dist.get_rank() == dst else None


# ----------------------------------------------------------------------------------------------
# Model hooks
# ----------------------------------------------------------------------------------------------


def register_state_dict_hooks(runtime) -> None:
    """Module ``state_dict`` post-hooks and ``load_state_dict`` pre-hooks for every dedicated
    parameter (each alias of a tied parameter is its own key, as in ``nn.Module.state_dict``)."""
    import weakref

    ref = weakref.ref(runtime)
    by_module: dict[int, list] = {}
    for b in runtime.boundaries:
        for slot in b.installable:  # one-owner slots and owner-grouped matrices (_Grouped)
            for module, attr in slot.homes:
                by_module.setdefault(id(module), [module, []])[1].append((attr, slot))

    for module, entries in by_module.values():

        def post_hook(mod, state_dict, prefix, local_metadata, _entries=entries):
            rt = ref()
            keys = [(prefix + attr, slot) for attr, slot in _entries if prefix + attr in state_dict]
            if rt is None or not keys:
                return state_dict
            full = getattr(_LOCAL, "full", None)
            rt.prepare_state_access("state_dict()")
            for key, slot in keys:
                if isinstance(slot, _Grouped):
                    state_dict[key] = _grouped_state_entry(rt, slot, full)
                elif full is None:
                    state_dict[key] = scatter_full_to_dtensor(rt, slot)
                else:
                    state_dict[key] = _gather_full(rt, slot, rank0_only=full[0])
            return state_dict

        def load_pre_hook(mod, state_dict, prefix, *args, _entries=entries):
            rt = ref()
            keys = [(prefix + attr, slot) for attr, slot in _entries if prefix + attr in state_dict]
            if rt is None or not keys:
                return
            rt.check_idle("load_state_dict()")
            rt.prepare_state_access("load_state_dict()")
            g = rt.groups
            for key, slot in keys:
                if isinstance(slot, _Grouped):
                    _load_grouped(rt, slot, state_dict[key], slot.logical)
                    state_dict[key] = slot.logical
                    continue
                holder = g.rank_of(g.replicate, rt.shard_of_fqn[slot.fqn])
                full = _full_on(rt, slot, state_dict[key], holder)
                if full is not None:
                    with torch.no_grad():
                        _local(slot.logical).copy_(full.reshape(slot.shape))
                # the logical parameter itself: the default copy_ is a no-op, assign=True keeps it
                state_dict[key] = slot.logical

        module._register_state_dict_hook(post_hook)
        module._register_load_state_dict_pre_hook(load_pre_hook, with_module=True)
    _register_expert_parallel_hooks(runtime)


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
    if _is_dtensor(value):
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


def _register_expert_parallel_hooks(runtime) -> None:
    """State-dict hooks of the expert-parallel stacks (:attr:`DmuonRuntime.ep_params`): saved as
    the full ``(E, a, b)`` DTensor ``Shard(0)`` over the shard group (:func:`_ep_dtensor`, no
    copy), loaded by taking this rank's experts (:func:`_ep_rows`); DCP reshards between EP
    degrees / world sizes through the DTensor layout."""
    import weakref

    ref = weakref.ref(runtime)
    by_module: dict[int, list] = {}
    plan = runtime.plan
    for fqn in runtime.ep_params:
        for alias in plan.param(fqn).aliases:
            mod_fqn, _, attr = alias.rpartition(".")
            module = runtime.model_ref().get_submodule(mod_fqn)
            by_module.setdefault(id(module), [module, []])[1].append((attr, fqn))
    # the parameter is read from rt.ep_params at every call: to_empty may have replaced it
    # (dmuon.exec.setup.materialize._adopt_ep_stacks)
    for module, entries in by_module.values():

        def post_hook(mod, state_dict, prefix, local_metadata, _entries=entries):
            rt = ref()
            if rt is None:
                return state_dict
            for attr, fqn in _entries:
                if prefix + attr in state_dict:
                    state_dict[prefix + attr] = _ep_dtensor(rt, fqn, rt.ep_params[fqn].detach())
            return state_dict

        def load_pre_hook(mod, state_dict, prefix, *args, _entries=entries):
            rt = ref()
            if rt is None:
                return
            for attr, fqn in _entries:
                key = prefix + attr
                p = rt.ep_params[fqn]
                if key in state_dict:
                    rows = _ep_rows(rt, fqn, state_dict[key])
                    with torch.no_grad():
                        p.copy_(rows)
                    state_dict[key] = p  # the default copy_ is then a no-op

        module._register_state_dict_hook(post_hook)
        module._register_load_state_dict_pre_hook(load_pre_hook, with_module=True)


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


def _grouped_state_entry(runtime, gm, full_mode):
    """State-dict value of a grouped matrix: the ``Shard(0)`` DTensor (``full_mode`` None), or the
    full tensor for :func:`full_state_dict` (None off rank 0 with ``rank0_only``)."""
    info = gm.info
    full = _grouped_full(runtime, gm, lambda j: gm.logical.detach())
    if full_mode is None:
        return _full_to_dtensor(runtime, info.shape, full)
    if full_mode[0] and dist.get_rank() != 0:
        return None
    return full


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
    if _is_dtensor(value):
        value = value.full_tensor()
    if info.block is None:
        return None
    block = value.narrow(info.dim, info.offsets[info.block], info.sizes[info.block])
    if target is not None and target.numel():
        with torch.no_grad():
            target.copy_(block)
    return block


def _gather_full(runtime, slot, *, rank0_only: bool) -> torch.Tensor | None:
    """The full value of ``slot`` on every rank (``rank0_only``: on rank 0 only; else None).

    One broadcast from the holder over the shard group of each participating row (only rank
    0's row when ``rank0_only``): each receiving rank materialises this one matrix. A TP
    matrix's shards are then all-gathered over dmuon's TP group (same rows in every TP
    coordinate, so every TP group either takes part whole or not at all).
    """
    g = runtime.groups
    me = dist.get_rank()
    if rank0_only:
        row0 = _coords(runtime, 0)[0]
        if g.replicate != row0:
            return None
    src = g.rank_of(g.replicate, runtime.shard_of_fqn[slot.fqn])
    if me == src:
        buf = _local(slot.logical).detach()
    else:
        buf = torch.empty(slot.shape, dtype=slot.logical.dtype, device=runtime.device)
    if g.shape[1] > 1:
        C.broadcast(buf, src=src, group=g.shard_group, phase="other")
    if slot.tp is not None:
        tp = slot.tp
        out = torch.empty(tp.size * buf.numel(), dtype=buf.dtype, device=buf.device)
        C.all_gather_into(out, buf.contiguous().reshape(-1), group=tp.group, phase="other")
        out = out.view(tp.size, -1)
        blocks = [out[dist.get_group_rank(tp.group, tp.ranks[t])].view(buf.shape) for t in range(tp.size)]
        buf = torch.cat(blocks, dim=tp.placements[0].dim)
        if rank0_only and me != 0:
            return None
        return buf
    if rank0_only and me != 0:
        return None
    return buf.clone() if me == src else buf


def full_state_dict(model: nn.Module, *, rank0_only: bool = True, cpu_offload: bool = True) -> dict:
    """The model's state dict with every tensor gathered to full size (a plain ``dict``).

    For export to tools that know nothing of torch.distributed (``torch.save`` on rank 0,
    safetensors, a single-process ``model.load_state_dict``): dedicated matrices come from
    their holders (one broadcast each over the shard group of rank 0's row, or of every row
    when ``rank0_only=False``), FSDP2 ``DTensor`` entries through ``full_tensor()``, the rest
    as they are. Keys are those of ``model.state_dict()``.

    Every rank must call it (it runs collectives). No rank holds more than one extra matrix at
    a time besides the result it keeps.

    Args:
        rank0_only: only rank 0 gets the tensors; other ranks get ``{}``.
        cpu_offload: move each kept tensor to the CPU as soon as it is gathered.

    Returns:
        ``{key: torch.Tensor}`` (detached copies, never aliases of the live masters).
    """
    from torch.distributed.tensor import DTensor

    rank = dist.get_rank() if dist.is_initialized() else 0
    prev = getattr(_LOCAL, "full", None)
    _LOCAL.full = (rank0_only, cpu_offload)
    try:
        sd = model.state_dict()
    finally:
        _LOCAL.full = prev
    keep = not rank0_only or rank == 0
    out = {}
    for key, value in sd.items():
        if isinstance(value, DTensor):
            value = value.full_tensor()
        if not keep or value is None:
            continue
        if isinstance(value, torch.Tensor):
            value = value.detach()
            if cpu_offload:
                value = value.cpu()
        out[key] = value
    return out


# ----------------------------------------------------------------------------------------------
# Optimizer hooks (dmuon.Muon)
# ----------------------------------------------------------------------------------------------


def _live_info(p):
    info = dedicated_info(p)
    ref = getattr(info, "runtime", None)
    rt = ref() if callable(ref) else None
    return (info, rt) if rt is not None else (None, None)


def _optimizer_runtimes(opt) -> list:
    seen: dict[int, object] = {}
    for group in opt.param_groups:
        for p in group["params"]:
            _, rt = _live_info(p)
            if rt is not None:
                seen.setdefault(id(rt), rt)
    return list(seen.values())


def register_optimizer_hooks(opt) -> None:
    """Checkpoint hooks of a :class:`dmuon.Muon` (no-ops for parameters without a live runtime)."""
    opt.register_state_dict_pre_hook(_optim_state_dict_pre_hook)
    opt.register_state_dict_post_hook(_optim_state_dict_post_hook)
    opt.register_load_state_dict_pre_hook(_optim_load_state_dict_pre_hook)
    opt.register_step_pre_hook(_optim_step_pre_hook)


def _optim_state_dict_pre_hook(opt) -> None:
    if _optimizer_runtimes(opt) and hasattr(opt, "init_state"):
        opt.init_state()  # every parameter has state: identical keys on every rank


def _optim_state_dict_post_hook(opt, state_dict):
    runtimes = _optimizer_runtimes(opt)
    if not runtimes:
        return None
    for rt in runtimes:
        rt.prepare_state_access("optimizer.state_dict()")
    params = [p for group in opt.param_groups for p in group["params"]]
    state = dict(state_dict["state"])
    for idx, p in enumerate(params):
        info, rt = _live_info(p)
        if rt is None:
            continue
        entry = dict(state.get(idx, {}))
        if getattr(info, "ep_local", False):  # this rank's experts' momentum, no copy
            buf = entry.get("momentum_buffer")
            if buf is None:
                buf = torch.zeros_like(p)
            entry["momentum_buffer"] = _ep_dtensor(rt, info.fqn, buf)
            state[idx] = entry
            continue
        if getattr(info, "group", None) is not None:
            entry["momentum_buffer"] = _grouped_momentum_to_dtensor(rt, info, p, entry.get("momentum_buffer"))
            state[idx] = entry
            continue
        slot = rt.slots_by_fqn[info.fqn]
        buf = None
        if info.is_owner:
            buf = entry.get("momentum_buffer")
            if buf is None:  # state cleared by hand: the step would start from zeros too
                buf = torch.zeros(slot.shape, dtype=p.dtype, device=p.device)
        entry["momentum_buffer"] = _momentum_to_dtensor(rt, slot, info, buf)
        state[idx] = entry
    order = sorted(state, key=lambda k: (0, k, "") if isinstance(k, int) else (1, 0, str(k)))
    state_dict["state"] = {k: state[k] for k in order}
    # torch.dtype values as strings ("torch.bfloat16"): DCP's full-state-dict gather accepts only
    # tensors, numbers, strings, lists and dicts; dmuon.Muon.load_state_dict parses the strings
    state_dict["param_groups"] = [
        {k: (str(v) if isinstance(v, torch.dtype) else v) for k, v in group.items()}
        for group in state_dict["param_groups"]
    ]
    return state_dict


def _optim_load_state_dict_pre_hook(opt, state_dict):
    runtimes = _optimizer_runtimes(opt)
    if not runtimes:
        return None
    for rt in runtimes:
        rt.check_idle("optimizer.load_state_dict()")
        rt.prepare_state_access("optimizer.load_state_dict()")
    params = [p for group in opt.param_groups for p in group["params"]]
    saved = [k for group in state_dict["param_groups"] for k in group["params"]]
    if len(saved) != len(params):
        return None  # torch's own check raises the usual error
    state = dict(state_dict["state"])
    for key, p in zip(saved, params):
        info, rt = _live_info(p)
        if rt is None:
            continue
        entry = state.get(key)
        value = entry.get("momentum_buffer") if isinstance(entry, dict) else None
        if value is None:
            if not info.is_owner:
                state.pop(key, None)
            continue
        g = rt.groups
        if getattr(info, "ep_local", False):  # this rank's experts' rows
            entry = dict(entry)
            entry["momentum_buffer"] = _ep_rows(rt, info.fqn, value).to(device=p.device, dtype=p.dtype, copy=True)
            state[key] = entry
            continue
        if getattr(info, "group", None) is not None:  # every rank joins the gather; owners keep their block
            block = _load_grouped(rt, rt.grouped_by_fqn[info.fqn], value, None)
            if info.is_owner:
                entry = dict(entry)
                entry["momentum_buffer"] = block.to(device=p.device, dtype=p.dtype, copy=True).contiguous()
                state[key] = entry
            else:
                state.pop(key, None)
            continue
        owner_replicate = _coords(rt, info.owner_global_rank)[0]
        dst = info.owner_global_rank if g.replicate == owner_replicate else None
        slot = rt.slots_by_fqn[info.fqn]
        if not _is_dtensor(value) or not _is_own_layout(rt, value, slot):
            dst = info.owner_global_rank  # full tensor / foreign DTensor: every rank takes part
        full = _full_on(rt, slot, value, dst)
        if info.is_owner:
            entry = dict(entry)
            full = full.reshape(slot.shape)
            entry["momentum_buffer"] = slot.tp.wrap(full) if slot.tp is not None else full
            state[key] = entry
        else:
            state.pop(key, None)
    state_dict["state"] = state
    return state_dict


def _is_dtensor(value) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(value, DTensor)


def _optim_step_pre_hook(opt, args, kwargs):
    """Fail loudly on torch.distributed.checkpoint's dummy-step state initialisation.

    ``get/set_optimizer_state_dict`` run ``optimizer.step()`` with zero gradients on every
    parameter when ``optimizer.state`` is empty on a rank (e.g. a rank that owns no matrix,
    before its first step). That step would run on some ranks only (dmuon's HSDP broadcast would
    hang) and would advance AdamW's step counters; placeholders never get gradients otherwise.
    """
    if not opt.state:  # nothing to initialise on this rank: dmuon.Muon.step makes it a local no-op
        return None
    for group in opt.param_groups:
        if not group.get("use_muon"):
            continue
        for p in group["params"]:
            info, rt = _live_info(p)
            if rt is not None and not info.is_owner and p.grad is not None:
                raise RuntimeError(
                    "dmuon: optimizer.step() with a gradient on a non-owner placeholder "
                    f"({info.fqn!r}): only torch.distributed.checkpoint's dummy-step initialisation "
                    "of an empty optimizer state makes one, on some ranks only. dmuon.Muon creates its "
                    "state at construction; if optimizer.state was cleared, call "
                    "optimizer.init_state() on every rank before the next checkpoint save/load"
                )
    return None
