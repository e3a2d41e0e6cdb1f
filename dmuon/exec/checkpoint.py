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

from . import collectives as C

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


def _placements(runtime):
    from torch.distributed.tensor import Replicate, Shard

    return (Shard(0),) if runtime.groups.shape[0] == 1 else (Replicate(), Shard(0))


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


def _as_dtensor(runtime, shape, padded_chunk):
    from torch.distributed.tensor import DTensor

    g = runtime.groups
    local = padded_chunk[: _my_rows(shape[0], g.shape[1], g.shard)]
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(
        local, runtime.state_dict_mesh(), _placements(runtime), run_check=False, shape=torch.Size(shape), stride=stride
    )


def scatter_full_to_dtensor(runtime, slot):
    """The dedicated parameter of ``slot`` as a full-shape DTensor (holder of each row scatters)."""
    g = runtime.groups
    src = g.rank_of(g.replicate, runtime.shard_of_fqn[slot.fqn])
    full = slot.logical if dist.get_rank() == src else None
    chunk = _scatter_chunks(runtime, tuple(slot.shape), slot.logical.dtype, full, src)
    return _as_dtensor(runtime, tuple(slot.shape), chunk)


def _momentum_to_dtensor(runtime, slot, info, buf):
    """The owner's momentum ``buf`` as a full-shape DTensor on every rank.

    The owner ``(s, r)`` scatters in its row; in HSDP each ``(s', r)`` then broadcasts its chunk
    over its replicate group, so every rank holds one chunk and never the whole matrix.
    """
    g = runtime.groups
    owner_replicate = _coords(runtime, info.owner_global_rank)[0]
    shape = tuple(info.shape)
    if g.replicate == owner_replicate:
        chunk = _scatter_chunks(runtime, shape, slot.logical.dtype, buf, info.owner_global_rank)
    else:
        chunk = torch.empty((_chunk_rows(shape[0], g.shape[1]), *shape[1:]), dtype=slot.logical.dtype, device=runtime.device)
    if g.shape[0] > 1:
        C.broadcast(chunk, src=g.rank_of(owner_replicate, g.shard), group=g.replicate_group, phase="other")
    return _as_dtensor(runtime, shape, chunk)


def _coords(runtime, rank: int) -> tuple[int, int]:
    for r, row in enumerate(runtime.groups.mesh_ranks):
        for s, x in enumerate(row):
            if x == rank:
                return r, s
    raise ValueError(f"dmuon: rank {rank} is not in the mesh {runtime.groups.mesh_ranks}")


# ----------------------------------------------------------------------------------------------
# Loading: whatever was given -> the full value on the ranks that store it
# ----------------------------------------------------------------------------------------------


def _is_own_layout(runtime, value) -> bool:
    mesh = runtime.state_dict_mesh()
    vmesh = value.device_mesh
    same_mesh = vmesh is mesh or (
        vmesh.mesh.shape == mesh.mesh.shape and torch.equal(vmesh.mesh.cpu(), mesh.mesh.cpu())
        and vmesh.device_type == mesh.device_type
    )
    return same_mesh and tuple(value.placements) == _placements(runtime)


def _gather_rows(runtime, value, dst: int | None, shape) -> torch.Tensor | None:
    """Gather the row chunks of DTensor ``value`` (this rank's shard group) to ``dst``.

    ``dst=None``: this row takes no part. Only ``dst`` materialises the full matrix.
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


def _full_on(runtime, fqn, shape, value, dst: int | None) -> torch.Tensor | None:
    """The full value of one state-dict entry on ``dst`` (this row's receiving rank) or None.

    ``value``: a DTensor of dmuon's own layout (gathered chunk-wise, no rank but ``dst`` sees
    the whole matrix), any other DTensor (``full_tensor()``, every rank of its mesh), or a
    full tensor (used as is).
    """
    from torch.distributed.tensor import DTensor

    if tuple(value.shape) != tuple(shape):
        raise ValueError(
            f"dmuon: state dict entry for {fqn!r} has shape {tuple(value.shape)}, expected the full "
            f"{tuple(shape)} (a full tensor or a DTensor of full shape)"
        )
    if isinstance(value, DTensor):
        if _is_own_layout(runtime, value):
            return _gather_rows(runtime, value, dst, shape)
        full = value.full_tensor()
        return full if dist.get_rank() == dst else None
    return value if dist.get_rank() == dst else None


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
        for slot in b.slots:
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
                if full is None:
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
                holder = g.rank_of(g.replicate, rt.shard_of_fqn[slot.fqn])
                full = _full_on(rt, slot.fqn, slot.shape, state_dict[key], holder)
                if full is not None:
                    with torch.no_grad():
                        slot.logical.copy_(full.reshape(slot.shape))
                # the logical parameter itself: the default copy_ is a no-op, assign=True keeps it
                state_dict[key] = slot.logical

        module._register_state_dict_hook(post_hook)
        module._register_load_state_dict_pre_hook(load_pre_hook, with_module=True)


def _gather_full(runtime, slot, *, rank0_only: bool) -> torch.Tensor | None:
    """The full value of ``slot`` on every rank (``rank0_only``: on rank 0 only; else None).

    One broadcast from the holder over the shard group of each participating row (only rank
    0's row when ``rank0_only``): each receiving rank materialises this one matrix.
    """
    g = runtime.groups
    me = dist.get_rank()
    if rank0_only:
        row0 = _coords(runtime, 0)[0]
        if g.replicate != row0:
            return None
    src = g.rank_of(g.replicate, runtime.shard_of_fqn[slot.fqn])
    if me == src:
        buf = slot.logical.detach()
    else:
        buf = torch.empty(slot.shape, dtype=slot.logical.dtype, device=runtime.device)
    if g.shape[1] > 1:
        C.broadcast(buf, src=src, group=g.shard_group, phase="other")
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
    info = getattr(p, "_dmuon", None)
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
        slot = rt.slots_by_fqn[info.fqn]
        entry = dict(state.get(idx, {}))
        buf = None
        if info.is_owner:
            buf = entry.get("momentum_buffer")
            if buf is None:  # state cleared by hand: the step would start from zeros too
                buf = torch.zeros(info.shape, dtype=p.dtype, device=p.device)
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
        owner_replicate = _coords(rt, info.owner_global_rank)[0]
        dst = info.owner_global_rank if g.replicate == owner_replicate else None
        if not _is_dtensor(value) or not _is_own_layout(rt, value):
            dst = info.owner_global_rank  # full tensor / foreign DTensor: every rank takes part
        full = _full_on(rt, info.fqn, info.shape, value, dst)
        if info.is_owner:
            entry = dict(entry)
            entry["momentum_buffer"] = full.reshape(info.shape)
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
