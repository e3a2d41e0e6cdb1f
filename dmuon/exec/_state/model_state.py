"""Model state dicts: dedicated parameters (and expert-parallel stacks) as full-shape DTensors,
and :func:`full_state_dict` for export.

The hooks, the layout they produce, and why plain ``model.state_dict()`` is a collective:
Note: model state dicts (docs/design.md).
"""

from __future__ import annotations

import threading

import torch
import torch.distributed as dist
import torch.nn as nn

from dmuon._dtensor import is_dtensor, local_tensor
from dmuon.exec._comm import collective_calls as C
from dmuon.exec._runtime.packed_buffers import _Grouped
from dmuon.exec._state.dtensor_layout import (
    _as_dtensor,
    _coords,
    _ep_dtensor,
    _ep_rows,
    _full_on,
    _full_to_dtensor,
    _grouped_full,
    _load_grouped,
    _scatter_chunks,
)

__all__ = [
    "register_state_dict_hooks",
    "full_state_dict",
    "scatter_full_to_dtensor",
]

_LOCAL = threading.local()  # .full: None | (rank0_only, cpu_offload) while full_state_dict runs


def scatter_full_to_dtensor(runtime, slot):
    """The dedicated parameter of ``slot`` as a full-shape DTensor (holder of each row scatters)."""
    g = runtime.groups
    src = g.rank_of(g.replicate, runtime.shard_of_fqn[slot.fqn])
    full = local_tensor(slot.logical) if dist.get_rank() == src else None
    chunk = _scatter_chunks(runtime, tuple(slot.shape), slot.logical.dtype, full, src)
    return _as_dtensor(runtime, slot, chunk)


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
                        local_tensor(slot.logical).copy_(full.reshape(slot.shape))
                # the logical parameter itself: the default copy_ is a no-op, assign=True keeps it
                state_dict[key] = slot.logical

        module._register_state_dict_hook(post_hook)
        module._register_load_state_dict_pre_hook(load_pre_hook, with_module=True)
    _register_expert_parallel_hooks(runtime)


# ----------------------------------------------------------------------------------------------
# Expert-parallel stacks: each rank's model holds its own experts (E/ep, a, b), in place
# ----------------------------------------------------------------------------------------------


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
    # (dmuon.exec._setup.materialize._adopt_ep_stacks)
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
# Owner-grouped matrices, and full_state_dict
# ----------------------------------------------------------------------------------------------


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
        buf = local_tensor(slot.logical).detach()
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
        if is_dtensor(value):
            value = value.full_tensor()
        if not keep or value is None:
            continue
        if isinstance(value, torch.Tensor):
            value = value.detach()
            if cpu_offload:
                value = value.cpu()
        out[key] = value
    return out
