"""Packed buffers of one hook boundary: segments, sub-segments and slots, and how they are built.

:func:`build_segments` binds the plan's layouts to tensors. The logical and compute tensors of a
dedicated parameter: Note: owner segments are the masters (docs/design.md).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from dmuon import _tags
from dmuon._dtensor import is_dtensor
from dmuon._tags import dedicated_info
from dmuon.plan._layout.slots import in_place_stacks
from dmuon.plan._records.fields import WIRE_DTYPES

from dmuon.exec._runtime._boundary.gather_buffers import _GatherBuffer

__all__ = ["DedicatedInfo", "TPInfo", "GroupInfo", "build_segments", "dedicated_info"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class DedicatedInfo:
    """dmuon's tag (:data:`dmuon._tags.PARAM`) on every logical dedicated parameter; read it with
    :func:`dedicated_info`.

    ``owner_global_rank``: the global rank that runs Newton-Schulz for it (the plan's
    ``Owner.rank`` is its mesh rank); ``is_owner``: this rank is it;
    ``holds_full``: this rank stores the full value (the owner, and in HSDP its replicate peers);
    ``matrix_shape`` ``(m, n)`` and ``num_matrices``: the Muon view; ``shape``: logical shape;
    ``view``: the plan's :class:`~dmuon.plan._records.params.MatrixView` (blocks orthogonalised
    separately) or None; ``experts``: the plan's :class:`~dmuon.plan._records.params.ExpertStack` of an
    expert stack (its layout; ``num_matrices`` then counts the matrices of the experts this
    rank's tensor holds) or None; ``ep_local``: an expert-parallel stack (the plan's
    ``ExpertOwners(local=True)``): the model's own tensor of this rank's experts, left in place
    (never packed, never moved by dmuon), owned here (``is_owner``), ``shape`` its local shape
    ``(E/ep, a, b)``, its gradient the local one divided by the data-parallel world by a tensor
    hook.
    """

    fqn: str
    owner_global_rank: int
    is_owner: bool
    holds_full: bool
    shape: tuple[int, ...]
    matrix_shape: tuple[int, int]
    num_matrices: int
    runtime: Any = dataclasses.field(repr=False, compare=False)  # weakref to DmuonRuntime
    tp: "TPInfo | None" = None  # a TP-sharded matrix: its placement and owner TP group
    view: Any = None  # dmuon.plan._records.params.MatrixView or None
    group: "GroupInfo | None" = None  # a matrix owned by an owner group / a stack with several expert owners
    experts: Any = None  # dmuon.plan._records.params.ExpertStack of an expert stack, or None
    ep_local: bool = False  # an expert-parallel stack: this rank's experts, in the model, owned here


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class GroupInfo:
    """A dedicated matrix owned by an owner group (the plan's ``OwnerGroup``), as one rank sees it.

    The matrix ``shape`` is cut along ``dim`` into blocks of ``sizes``; this rank holds block
    ``block`` (its logical parameter is that block, ``sizes[block]`` rows or columns at
    ``offsets[block]``), or none (``block is None``: a zero-size placeholder). ``pg``: dmuon's
    process group of the members (None on non-members), ``ranks``: their global ranks, block
    order. Members run sharded Gram Newton-Schulz over ``pg``
    (:func:`dmuon.exec._optim.tp_orthogonalize.orthogonalize_groups_and_apply`).

    An expert stack with several owners (the plan's ``ExpertOwners``) is the same record with
    ``dim = 0`` (ranges of experts), ``experts`` its layout and ``pg = None``: each member
    orthogonalises its own experts' matrices, with no collective.
    """

    shape: tuple[int, int]
    dim: int
    sizes: tuple[int, ...]
    offsets: tuple[int, ...]
    block: int | None
    pg: Any
    ranks: tuple[int, ...]
    mesh_ranks: tuple[int, ...]  # sorted mesh ranks of the members (the schedule's group)
    shards: tuple[int, ...]  # shard coordinate of each member, block order (holders of block j: (shards[j], ·))
    experts: Any = None  # dmuon.plan._records.params.ExpertStack when the blocks are ranges of experts
    # expert parallelism with efsdp > 1 (an expert-parallel buffer): this rank's model holds
    # only the blocks ``compute_blocks`` (its EP coordinate's ranges, global experts from
    # ``compute_start``); None = every block (the compute tensor is the whole ``shape``)
    compute_blocks: tuple[int, ...] | None = None
    compute_start: int = 0

    @property
    def k(self) -> int:
        return len(self.sizes)

    @property
    def compute_block_ids(self) -> tuple[int, ...]:
        """The blocks the compute tensor is assembled from (all, or this EP coordinate's)."""
        return tuple(range(self.k)) if self.compute_blocks is None else self.compute_blocks

    @property
    def compute_shape(self) -> tuple[int, ...]:
        """Shape of this rank's compute tensor: ``shape``, or its EP coordinate's experts."""
        if self.compute_blocks is None:
            return tuple(self.shape)
        return (sum(self.sizes[q] for q in self.compute_blocks), *self.shape[1:])

    def compute_offset(self, j: int) -> int:
        """Where block ``j`` starts in this rank's compute tensor (along ``dim``)."""
        return self.offsets[j] - self.compute_start

    def block_shape(self, j: int) -> tuple[int, ...]:
        if self.experts is not None:
            return (self.sizes[j], *self.shape[1:])
        m, n = self.shape
        return (self.sizes[j], n) if self.dim == 0 else (m, self.sizes[j])


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class TPInfo:
    """A dedicated matrix sharded by tensor parallelism (``parallelize_module``).

    Every tensor dmuon keeps for it (logical, compute, gradient, momentum) is a ``DTensor`` on
    the parameter's own TP ``mesh`` with its ``placements``; the packed buffers hold the local
    shards (``local_shape``). ``group`` is dmuon's TP group of the owner (the ``size`` ranks that
    share this rank's data-parallel coordinate; ``rank`` = this rank's TP coordinate, ``ranks``
    their global ranks in TP order); ``method``: ``"gram"`` or ``"gather"`` (the plan's
    ``tp_ns``).
    """

    mesh: Any
    placements: tuple
    shard_dim: int
    size: int
    rank: int
    group: Any
    ranks: tuple[int, ...]
    method: str
    shape: tuple[int, ...]
    local_shape: tuple[int, ...]

    def wrap(self, local: torch.Tensor) -> torch.Tensor:
        """``local`` (this rank's shard, or a zero-row placeholder) as a DTensor, sharing storage."""
        from torch.distributed.tensor import DTensor

        if tuple(local.shape) == self.local_shape:
            return DTensor.from_local(
                local,
                self.mesh,
                self.placements,
                run_check=False,
                shape=self.shape,
                stride=_contiguous_strides(self.shape),
            )
        return DTensor.from_local(local, self.mesh, self.placements, run_check=False)

    def local(self, t: torch.Tensor) -> torch.Tensor:
        """The local shard of a DTensor with this matrix's placement (redistributed if needed)."""
        if tuple(t.placements) != tuple(self.placements):
            t = t.redistribute(self.mesh, self.placements)
        return t.to_local()


_DTYPES = {name: getattr(torch, name[len("torch.") :]) for name in WIRE_DTYPES}


def _dtype(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"dmuon: unsupported parameter dtype {name}") from None


@dataclasses.dataclass(eq=False)
class _Slot:
    """One dedicated parameter inside a segment (or one block of a grouped matrix: ``grouped``
    is set, ``homes`` is empty, ``compute`` is the block's view of the segment and the module
    sees ``grouped.compute``)."""

    fqn: str
    offset_in_seg: int  # elements from the segment start
    numel: int
    shape: tuple[int, ...]
    homes: list[tuple[nn.Module, str]]  # every (module, attribute) alias
    logical: nn.Parameter
    compute: nn.Parameter
    tp: TPInfo | None = None
    grouped: "_Grouped | None" = None
    block: int | None = None


@dataclasses.dataclass(eq=False)
class _Grouped:
    """A matrix owned by an owner group, within one boundary on this rank.

    Its ``k`` blocks are slots of (up to ``k``) different segments. ``compute``: the full
    ``(m, n)`` compute parameter the modules see during forward and backward, with storage of
    its own, grown and filled from the blocks' segment views when the boundary is unsharded
    (one copy; ``writer`` aliases the storage with its own version counter, so the fill does
    not invalidate tensors saved for backward) and released with the segments.
    """

    fqn: str
    info: GroupInfo
    homes: list[tuple[nn.Module, str]]
    logical: nn.Parameter
    compute: nn.Parameter
    writer: torch.Tensor | None  # None when received in place
    blocks: list  # [_Slot] in block order
    resident: bool = False
    # received in place (the plan's in_place_stacks): ``compute`` is a strided view of this
    # all-gathered buffer's gathered tensor, ``(offset from its start, strides)``; nothing to copy
    gather: "_GatherBuffer | None" = None
    view: tuple | None = None

    def assemble(self) -> None:
        """Grow ``compute``'s storage and copy every block's (current) wire into it (received in
        place: the all-gather wrote it already)."""
        if self.view is not None:
            self.resident = True
            return
        w = self.writer
        w.untyped_storage().resize_(w.numel() * w.element_size())
        info = self.info
        with torch.no_grad():
            for j in info.compute_block_ids:
                w.narrow(info.dim, info.compute_offset(j), info.sizes[j]).copy_(self.blocks[j].compute)
        self.resident = True

    def release(self) -> None:
        if self.view is None:  # in place: the gathered tensor's storage is released with its buffer
            self.writer.untyped_storage().resize_(0)
        self.resident = False

    def view_gathered(self) -> torch.Tensor:
        """The compute tensor of a stack received in place: a view of the gathered storage with
        its own version counter (``set_``), as every compute parameter is built."""
        g = self.gather.gathered  # type: ignore[union-attr]
        offset, strides = self.view  # type: ignore[misc]
        return torch.empty(0, dtype=g.dtype, device=g.device).set_(
            g.untyped_storage(), g.storage_offset() + offset, self.info.compute_shape, strides
        )


@dataclasses.dataclass(eq=False)
class _SubSeg:
    replicate: int  # the owner's replicate coordinate
    owner_global_rank: int
    offset_in_seg: int
    numel: int
    flags_offset_in_seg: int
    slots: list[_Slot]


@dataclasses.dataclass(eq=False)
class _Segment:
    shard: int
    numel: int
    held: bool  # this rank stores it permanently (its shard coordinate)
    # 1-D, broadcast dtype; storage freed when not resident (non-held only). In an all-gathered
    # buffer a non-held segment's wire is a view of its slot in the buffer's gathered tensor
    wire: torch.Tensor
    master: torch.Tensor | None  # held only: 1-D, param dtype; ``wire`` itself unless mixed precision
    subs: list[_SubSeg]
    slots: list[_Slot]
    reduce_dtype: torch.dtype
    param_dtype: torch.dtype
    buffer_key: str = ""  # the plan buffer's key (BufferLayout.key): its dtype, "/ep<k>" if expert-parallel
    resident: bool = True
    # gradient reduce, built on first use (``_boundary.grad_reduce._reduce_buffer``) and reused every step
    reduce_buf: torch.Tensor | None = None  # 1-D, reduce dtype, on the segment's device
    reduce_inflight: bool = False  # a reduce on ``reduce_buf`` is launched and not yet finished
    owned: list = dataclasses.field(default_factory=list)  # [gather_buffers._Owned] sub-segments this rank owns
    owned_staged: bool = False  # 1-D: this backward's owned averages already taken out (grad_reduce._stage_owner_grads)
    gather: "_GatherBuffer | None" = None  # the all-gathered buffer it belongs to, or None (broadcast)


def _contiguous_strides(shape) -> tuple[int, ...]:
    strides = []
    acc = 1
    for d in reversed(tuple(shape)):
        strides.append(acc)
        acc *= d
    return tuple(reversed(strides))


def build_segments(boundary, *, plan, groups, device, modules, specs, owners, original, runtime_ref) -> list[_Segment]:
    """The segments of one plan boundary on this rank, from its buffer layouts.

    Per parameter dtype and shard coordinate one :class:`_Segment`: held (this rank's shard
    coordinate) it is permanent and its ``master`` is the storage of the logical parameters;
    otherwise its ``wire`` storage is released at once. Every logical parameter is tagged with
    its :class:`DedicatedInfo` (``runtime_ref``: a weak reference to the runtime). ``modules``
    maps module FQNs to modules, ``specs`` / ``owners`` / ``original``: the plan's
    ``ParamSpec``, ``Owner`` and the model's original parameter per FQN.

    Raises:
        ValueError: a parameter's shape or dtype differs from the plan's, or a TP matrix's
            placement differs from the one the plan was compiled for.
    """
    g = groups
    segments: list[_Segment] = []
    grouped: dict[str, _Grouped] = {}
    for layout in boundary.buffers:
        param_dtype = _dtype(layout.dtype)
        wire_dtype = _dtype(plan.bcast_dtype(layout.dtype))
        reduce_dtype = _dtype(plan.reduce_dtype_for(layout.dtype))
        gb = None
        in_place: dict = {}
        if layout.collective == "all_gather":  # one gathered tensor; non-held wires are its slots
            in_place = {fqn: views.get(g.shard % layout.ep) for fqn, views in in_place_stacks(layout).items()}
            shards = layout.group_shards(g.shard, plan.mesh_shape[1])
            gb = _GatherBuffer(
                key=layout.key,
                slot_numel=layout.slot_numel,
                group_shards=shards,
                my_slot=layout.slot_index(g.shard),
                gathered=torch.zeros(len(shards) * layout.slot_numel, dtype=wire_dtype, device=device),
                segments=[None] * len(shards),
                reduce_dtype=reduce_dtype,
            )
        for seg_l in layout.segments:
            if layout.ep > 1 and seg_l.shard % layout.ep != g.shard % layout.ep:
                continue  # expert-parallel: another EP coordinate's experts, not on this rank
            held = seg_l.shard == g.shard
            if gb is not None and not held:
                wire = gb.segment_view(layout.slot_index(seg_l.shard), seg_l.numel)
            else:
                wire = torch.zeros(seg_l.numel, dtype=wire_dtype, device=device)
            master = None
            if held:
                master = (
                    wire if wire_dtype == param_dtype else torch.zeros(seg_l.numel, dtype=param_dtype, device=device)
                )
            seg = _Segment(
                shard=seg_l.shard,
                numel=seg_l.numel,
                held=held,
                wire=wire,
                master=master,
                subs=[],
                slots=[],
                reduce_dtype=reduce_dtype,
                param_dtype=param_dtype,
                buffer_key=layout.key,
                gather=gb,
            )
            if gb is not None:
                gb.segments[layout.slot_index(seg_l.shard)] = seg
            for sub_l in seg_l.subsegments:
                sub = _SubSeg(
                    replicate=sub_l.owner.replicate,
                    owner_global_rank=g.rank_of(sub_l.owner.replicate, sub_l.owner.shard),
                    offset_in_seg=sub_l.offset - seg_l.offset,
                    numel=sub_l.numel,
                    flags_offset_in_seg=sub_l.flags_offset - seg_l.offset,
                    slots=[],
                )
                for e in sub_l.entries:
                    spec = specs[e.fqn]
                    off = e.offset - seg_l.offset
                    orig = original[e.fqn]
                    # an expert-parallel stack holds E/ep experts (checked in _block_slot)
                    want = tuple(spec.local_shape) if layout.ep > 1 else tuple(spec.shape)
                    if tuple(orig.shape) != want or str(orig.dtype) != spec.dtype:
                        raise ValueError(
                            f"dmuon: parameter {e.fqn!r} is {tuple(orig.shape)} {orig.dtype} in the model "
                            f"but {want} {spec.dtype} in the plan; recompile the plan after "
                            "changing the model"
                        )
                    if e.block is not None:  # one block of a matrix owned by an owner group
                        slot = _block_slot(
                            e,
                            off,
                            seg_l,
                            held,
                            wire,
                            master,
                            spec,
                            orig,
                            owners[e.fqn],
                            grouped,
                            groups=g,
                            device=device,
                            param_dtype=param_dtype,
                            wire_dtype=wire_dtype,
                            modules=modules,
                            runtime_ref=runtime_ref,
                            ep=layout.ep,
                            gather=gb if in_place.get(e.fqn) else None,
                            in_place=in_place.get(e.fqn),
                        )
                        sub.slots.append(slot)
                        seg.slots.append(slot)
                        continue
                    tp = tp_info(spec, orig, g)
                    lshape = tuple(spec.local_shape)
                    strides = _contiguous_strides(lshape)
                    if held:
                        value = orig.to_local() if tp is not None else orig
                        master[off : off + e.numel].copy_(value.detach().reshape(-1))
                        logical = torch.empty(0, dtype=param_dtype, device=device).set_(
                            master.untyped_storage(), off, lshape, strides
                        )
                    else:
                        # zero rows, the other dims kept: nn.init / reset_parameters see the
                        # true fan-in and run (as no-ops) on non-holders after to_empty
                        logical = torch.empty((0, *lshape[1:]), dtype=param_dtype, device=device)
                    compute = torch.empty(0, dtype=wire_dtype, device=device).set_(
                        wire.untyped_storage(), wire.storage_offset() + off, lshape, strides
                    )
                    if tp is not None:
                        logical, compute = tp.wrap(logical), tp.wrap(compute)
                    logical = nn.Parameter(logical, requires_grad=orig.requires_grad)
                    compute = nn.Parameter(compute, requires_grad=orig.requires_grad)
                    owner = owners[e.fqn]
                    owner_global_rank = g.rank_of(owner.replicate, owner.shard)
                    _tags.write(
                        logical,
                        _tags.PARAM,
                        DedicatedInfo(
                            fqn=e.fqn,
                            owner_global_rank=owner_global_rank,
                            is_owner=owner_global_rank == dist.get_rank(),
                            holds_full=held,
                            shape=tuple(spec.shape),
                            matrix_shape=tuple(spec.matrix_shape),
                            num_matrices=int(spec.num_matrices),
                            runtime=runtime_ref,
                            tp=tp,
                            view=spec.view,
                            experts=spec.experts,
                        ),
                    )
                    homes = []
                    for alias in spec.aliases:
                        mod_fqn, _, attr = alias.rpartition(".")
                        homes.append((modules[mod_fqn], attr))
                    slot = _Slot(
                        fqn=e.fqn,
                        offset_in_seg=off,
                        numel=e.numel,
                        shape=lshape,
                        homes=homes,
                        logical=logical,
                        compute=compute,
                        tp=tp,
                    )
                    sub.slots.append(slot)
                    seg.slots.append(slot)
                seg.subs.append(sub)
            if not held:
                if gb is None:  # an all-gathered buffer's storage is released once, below
                    wire.untyped_storage().resize_(0)
                seg.resident = False
            segments.append(seg)
        if gb is not None:
            gb.release()
    for gm in grouped.values():
        if any(gm.blocks[j] is None for j in gm.info.compute_block_ids):
            raise ValueError(f"dmuon: the plan's layout of {gm.fqn!r} misses blocks of its owner group")
    return segments


def _grouped_storage(shape: tuple[int, ...], dtype: torch.dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(compute, writer)``: two tensors of ``shape`` on one storage of their own, released
    (size 0) until :meth:`_Grouped.assemble` grows it; ``writer`` has its own version counter,
    so filling it does not invalidate ``compute`` where autograd saved it."""
    full = torch.empty(math.prod(shape), dtype=dtype, device=device)
    strides = _contiguous_strides(shape)
    compute = torch.empty(0, dtype=dtype, device=device).set_(full.untyped_storage(), 0, shape, strides)
    writer = torch.empty(0, dtype=dtype, device=device).set_(full.untyped_storage(), 0, shape, strides)
    full.untyped_storage().resize_(0)
    return compute, writer


def _block_slot(
    e,
    off,
    seg_l,
    held,
    wire,
    master,
    spec,
    orig,
    owner,
    grouped,
    *,
    groups,
    device,
    param_dtype,
    wire_dtype,
    modules,
    runtime_ref,
    ep: int = 1,
    gather=None,
    in_place=None,
) -> _Slot:
    """The slot of block ``e.block`` of a grouped matrix, and (first block seen) its :class:`_Grouped`.

    ``ep > 1``: an expert-parallel stack owned in efsdp groups: the model's parameter holds this
    rank's EP coordinate's experts only, and the compute tensor is assembled from those ranges.
    ``in_place``: ``(first slot, slot step, offset in the slot)`` of a stack received in place
    (:func:`~dmuon.plan._layout.slots.in_place_stacks`): its compute tensor is a strided view of
    ``gather``'s gathered tensor instead of a tensor of its own."""
    g = groups
    if is_dtensor(orig):
        raise ValueError(f"dmuon: {e.fqn!r} is a DTensor but the plan gives it an owner group (no TP support)")
    j = e.block
    bshape = tuple(e.shape)
    gm = grouped.get(e.fqn)
    if gm is None:
        me = dist.get_rank()
        ranks = tuple(g.rank_of(o.replicate, o.shard) for o in owner.members)
        mine = next((i for i, o in enumerate(owner.members) if o.shard == g.shard), None)  # block held here
        mesh_ranks = tuple(sorted(owner.ranks))
        is_experts = type(owner).__name__ == "ExpertOwners"  # ranges of experts: no group collective
        offsets = owner.offsets()
        compute_blocks, compute_start = None, 0
        if ep > 1:  # this EP coordinate's ranges, contiguous from its first expert
            compute_blocks = tuple(q for q, o in enumerate(owner.members) if o.shard % ep == g.shard % ep)
            compute_start = offsets[compute_blocks[0]]
        info = GroupInfo(
            shape=tuple(spec.shape),
            dim=owner.dim,
            sizes=tuple(owner.sizes),
            offsets=offsets,
            block=mine,
            pg=g.owner_group(mesh_ranks) if me in ranks and not is_experts else None,
            ranks=ranks,
            mesh_ranks=mesh_ranks,
            shards=tuple(o.shard for o in owner.members),
            experts=spec.experts if is_experts else None,
            compute_blocks=compute_blocks,
            compute_start=compute_start,
        )
        if ep > 1 and tuple(orig.shape) != info.compute_shape:
            raise ValueError(
                f"dmuon: expert-parallel stack {e.fqn!r} is {tuple(orig.shape)} on this rank but the plan gives each "
                f"rank {info.compute_shape} (E/ep experts of {tuple(spec.shape)}, ep = {ep})"
            )
        view = None
        if in_place is not None:
            first, step, offset = in_place
            S = gather.slot_numel
            view = (first * S + offset, (step * S, *_contiguous_strides(info.compute_shape[1:])))
            compute, writer = None, None
        else:
            compute, writer = _grouped_storage(info.compute_shape, wire_dtype, device)
        if mine is None:  # zero rows, the other dims kept (as a non-holder's placeholder)
            logical = torch.empty((0, *spec.shape[1:]), dtype=param_dtype, device=device)
        else:
            logical = None  # bound below when the held block's entry is reached
        homes = []
        for alias in spec.aliases:
            mod_fqn, _, attr = alias.rpartition(".")
            homes.append((modules[mod_fqn], attr))
        gm = grouped[e.fqn] = _Grouped(
            fqn=e.fqn,
            info=info,
            homes=homes,
            logical=logical,
            compute=None,  # type: ignore[arg-type]
            writer=writer,
            blocks=[None] * owner.k,
            gather=gather if view is not None else None,
            view=view,
        )
        gm.compute = nn.Parameter(gm.view_gathered() if view is not None else compute, requires_grad=orig.requires_grad)
    info = gm.info
    strides = _contiguous_strides(bshape)
    if held:
        value = orig.detach().narrow(info.dim, info.compute_offset(j), info.sizes[j])
        master[off : off + e.numel].view(bshape).copy_(value)
        gm.logical = torch.empty(0, dtype=param_dtype, device=device).set_(
            master.untyped_storage(), off, bshape, strides
        )
    block_view = torch.empty(0, dtype=wire_dtype, device=device).set_(
        wire.untyped_storage(), wire.storage_offset() + off, bshape, strides
    )
    slot = _Slot(
        fqn=e.fqn,
        offset_in_seg=off,
        numel=e.numel,
        shape=bshape,
        homes=[],
        logical=None,
        compute=block_view,
        grouped=gm,
        block=j,
    )
    gm.blocks[j] = slot
    if all(
        gm.blocks[q] is not None for q in info.compute_block_ids
    ):  # every block seen: the logical parameter is complete
        logical = gm.logical
        if not isinstance(logical, nn.Parameter):
            logical = nn.Parameter(logical, requires_grad=orig.requires_grad)
        owner_rank = None if info.block is None else info.ranks[info.block]
        stack = info.experts
        local_matrices = (
            1
            if stack is None
            else (spec.num_matrices if info.block is None else info.sizes[info.block] * stack.matrices_per_expert)
        )
        _tags.write(
            logical,
            _tags.PARAM,
            DedicatedInfo(
                fqn=e.fqn,
                owner_global_rank=info.ranks[0] if owner_rank is None else owner_rank,
                is_owner=owner_rank == dist.get_rank(),
                holds_full=False,
                shape=tuple(spec.shape),
                matrix_shape=tuple(spec.matrix_shape),
                num_matrices=local_matrices,
                runtime=runtime_ref,
                group=info,
                experts=stack,
            ),
        )
        gm.logical = logical
        for b in gm.blocks:
            if b is not None:  # expert parallelism: only this EP coordinate's ranges
                b.logical = logical
    return slot


def tp_info(spec, orig: torch.Tensor, groups) -> TPInfo | None:
    """The :class:`TPInfo` of a TP-sharded dedicated matrix (None without TP), after checking
    that the model's parameter has the placement the plan was compiled for."""
    if spec.tp_size == 1:
        return None
    g = groups
    placements = tuple(orig.placements) if is_dtensor(orig) else ()
    mesh = orig.device_mesh if is_dtensor(orig) else None
    ok = (
        mesh is not None
        and mesh.ndim == 1
        and mesh.size() == spec.tp_size == g.tp_size
        and len(placements) == 1
        and type(placements[0]).__name__ == "Shard"
        and placements[0].dim % 2 == spec.tp_shard_dim
    )
    if not ok:
        raise ValueError(
            f"dmuon: the plan says {spec.fqn!r} is sharded Shard({spec.tp_shard_dim}) over a TP mesh of "
            f"{spec.tp_size}, but the model's parameter is "
            + (f"a DTensor with {placements} on mesh {tuple(mesh.shape)}" if mesh is not None else "a plain tensor")
            + "; apply parallelize_module before dedicate_params and compile the plan from that model"
        )
    if mesh.get_local_rank() != g.tp_rank:
        raise ValueError(
            f"dmuon: {spec.fqn!r} is on TP coordinate {mesh.get_local_rank()} of its mesh but dmuon's TP "
            f"coordinate is {g.tp_rank}; all dedicated TP matrices must share one TP mesh"
        )
    return TPInfo(
        mesh=mesh,
        placements=placements,
        shard_dim=int(spec.tp_shard_dim),
        size=int(spec.tp_size),
        rank=g.tp_rank,
        group=g.tp_group,
        ranks=g.tp_ranks,
        method=str(spec.tp_ns),
        shape=tuple(spec.shape),
        local_shape=tuple(spec.local_shape),
    )
