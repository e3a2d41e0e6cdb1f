"""State-dict integration: dedicated parameters appear as ``Shard(0)`` DTensors of full shape.

``model.state_dict()`` (and hence ``torch.distributed.checkpoint.state_dict.get_model_state_dict``)
would otherwise hold the zero-size placeholders of non-owners. A post-hook on every module that
holds a dedicated parameter replaces each such entry by a DTensor of the full logical shape,
``Shard(0)`` over the shard dimension (``[Replicate(), Shard(0)]`` on an HSDP mesh), built by a
scatter from the holder of the full value in each replicate row: every rank materialises only its
``ceil(m/N)``-row chunk, one matrix at a time. ``full_state_dict=True`` then gathers them exactly
as it gathers FSDP2's own DTensors.

Loading goes the other way: a load pre-hook takes a DTensor (or a full tensor), gathers the full
value onto the holders, copies it into the master, and hands ``load_state_dict`` the logical
parameter itself so the default copy is a no-op.

These hooks run collectives over the shard group: like FSDP2 with ``full_state_dict``, every rank
must call ``state_dict()`` / ``load_state_dict()`` together.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from . import collectives as C

__all__ = ["register_state_dict_hooks", "scatter_full_to_dtensor"]


def _state_dict_mesh(runtime):
    mesh = getattr(runtime, "_state_dict_mesh", None)
    if mesh is None:
        from torch.distributed.device_mesh import DeviceMesh

        g = runtime.groups
        device_type = runtime.device.type
        R, N = g.shape
        ranks = torch.tensor(g.mesh_ranks, dtype=torch.int64)
        if R == 1:
            mesh = DeviceMesh.from_group(g.shard_group, device_type, mesh=ranks[0])
        else:
            mesh = DeviceMesh.from_group(
                [g.replicate_group, g.shard_group],
                device_type,
                mesh=ranks,
                mesh_dim_names=("replicate", "shard"),
            )
        runtime._state_dict_mesh = mesh
    return mesh


def scatter_full_to_dtensor(runtime, slot):
    """``Shard(0)`` DTensor of the full value of ``slot``; the holder in each replicate row scatters.

    Each rank receives ``ceil(m/N)`` rows (``torch.chunk`` layout, the last chunks possibly short
    or empty), so it never holds more than its chunk of the matrix.
    """
    from torch.distributed.tensor import DTensor, Replicate, Shard

    runtime.wait_replicate_broadcasts()  # a read right after step() sees the new values
    g = runtime.groups
    R, N = g.shape
    shape = tuple(slot.shape)
    rows = shape[0]
    chunk_rows = -(-rows // N)
    rest = shape[1:]
    dtype = slot.logical.dtype
    out = torch.empty((chunk_rows, *rest), dtype=dtype, device=runtime.device)
    src = g.rank_of(g.replicate, _shard_of(runtime, slot))
    chunks = None
    if dist.get_rank() == src:
        full = slot.logical.detach()
        padded = full.new_zeros((chunk_rows * N, *rest))
        padded[:rows].copy_(full)
        chunks = list(padded.chunk(N))
    C.scatter(out, chunks, src=src, group=g.shard_group, phase="other")
    mine = max(0, min(chunk_rows, rows - g.shard * chunk_rows))
    local = out[:mine]
    mesh = _state_dict_mesh(runtime)
    placements = [Shard(0)] if R == 1 else [Replicate(), Shard(0)]
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=torch.Size(shape), stride=stride)


def _shard_of(runtime, slot) -> int:
    return runtime.shard_of_fqn[slot.fqn]


def _full_from_value(runtime, slot, value) -> torch.Tensor | None:
    """Full tensor on the holders of ``slot`` (``None`` elsewhere)."""
    from torch.distributed.tensor import DTensor

    g = runtime.groups
    holder = _shard_of(runtime, slot) == g.shard
    if isinstance(value, DTensor):
        full = value.full_tensor()  # all-gather over the mesh; every rank takes part
        return full if holder else None
    if holder:
        if tuple(value.shape) != tuple(slot.shape):
            raise ValueError(
                f"dmuon: state dict entry for {slot.fqn!r} has shape {tuple(value.shape)}, "
                f"expected {tuple(slot.shape)} (a full tensor or a DTensor of full shape)"
            )
        return value
    return None


def register_state_dict_hooks(runtime) -> None:
    model = runtime.model_ref()
    by_module: dict[int, list] = {}
    for b in runtime.boundaries:
        for slot in b.slots:
            for module, attr in slot.homes:
                by_module.setdefault(id(module), [module, []])[1].append((attr, slot))

    for module, entries in by_module.values():

        def post_hook(mod, state_dict, prefix, local_metadata, _entries=entries):
            for attr, slot in _entries:
                key = prefix + attr
                if key in state_dict:
                    state_dict[key] = scatter_full_to_dtensor(runtime, slot)
            return state_dict

        def load_pre_hook(mod, state_dict, prefix, *args, _entries=entries):
            for attr, slot in _entries:
                key = prefix + attr
                if key not in state_dict:
                    continue
                full = _full_from_value(runtime, slot, state_dict[key])
                if full is not None:
                    with torch.no_grad():
                        slot.logical.copy_(full.to(slot.logical.device, slot.logical.dtype))
                state_dict[key] = slot.logical.detach()
            runtime.after_load()

        module._register_state_dict_hook(post_hook)
        module._register_load_state_dict_pre_hook(load_pre_hook)
    del model
