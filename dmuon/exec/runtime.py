"""Exclusive-ownership runtime: packed buffers and hooks at each hook boundary.

For one hook boundary the plan gives, per parameter dtype, a packed buffer made of one
*segment* per shard coordinate ``s`` (the parameters owned by ``(s, ·)``), each segment made of
one *sub-segment* per owner ``(s, r)``. This module binds those layouts to tensors and hooks:

=====================  =====================================================================
phase                  what happens on this rank (mesh coordinate ``(r, s)``)
=====================  =====================================================================
pre-forward            one async broadcast per segment ``s'`` from ``(s', r)`` in the shard
                       group of replicate row ``r``; wait; install compute parameters
post-forward           restore the logical parameters; Z3 (or no-grad forward): free the
                       storage of every segment this rank does not hold
pre-backward           Z3: broadcast again (into the same, regrown storage); install
post-backward          pack gradients into the segment's reduce buffer (one tensor per segment,
                       built once; its storage regrown and zeroed here, released once the
                       averages are out; zeros + presence flag 0 where a compute parameter has
                       no gradient), SUM-reduce each segment to its holder in the shard group;
                       HSDP: then SUM-reduce each sub-segment over the replicate group to its
                       owner; the owner divides by ``R·N``; free non-held storage
end of backward        (autograd final callback) reduce boundaries not yet reduced, wait for
                       every reduce, read all owned presence flags at once (one host sync), copy
                       or add the averaged gradients into the owners' ``.grad`` (never a view of
                       the reduce buffer), release the reduce buffers' storage
optimizer step         HSDP: after the owner's update, broadcast each sub-segment from its
                       owner to its replicate peers (waited for before the next use when
                       ``replicate_async=True``)
=====================  =====================================================================

Tensors per dedicated parameter:

* the **logical** parameter (what ``model.parameters()`` and the optimizer see between steps): on
  a rank that holds the segment, the full-size master whose storage *is* the segment when the
  wire dtype equals the parameter dtype (zero-copy broadcast); elsewhere a zero-size placeholder.
* the **compute** parameter, installed into the module during forward and backward: a leaf view
  of the segment storage in the broadcast dtype. Autograd accumulates this rank's local gradient
  into it; it never reaches the optimizer. It has its own version counter (built with ``set_``),
  so writing the segment in place (broadcast) does not invalidate tensors saved for backward —
  the same reason FSDP2 frees and regrows storage with ``untyped_storage().resize_``.

CUDA (``DmuonRuntime.use_streams``, default on): broadcasts (and the mixed-precision cast before
them) run on a broadcast stream, gradient packing and reduces on a reduce stream, as FSDP2 orders
its all-gathers and reduce-scatters: each waits for the compute stream when issued, the compute
stream waits for an event on it before the parameters or the reduced gradients are used, storage
is regrown on the compute stream and freed only after that wait, and local gradients read by the
reduce stream stay referenced until it. Off CUDA none of this runs.

Every rank issues the same collectives in the same order whatever its data: a compute parameter
without gradient contributes zeros and a 0 flag, and an owner leaves ``.grad`` as ``None`` only
when every rank's flag was 0, i.e. exactly when single-process ``torch.optim.Muon`` would skip
the matrix.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import warnings
import weakref
from typing import Any

import optree
import torch
import torch.distributed as dist
import torch.nn as nn

from . import collectives as C

__all__ = ["DedicatedInfo", "MeshGroups", "DmuonRuntime", "wait_pending", "after_step", "get_runtime", "no_sync"]


# ----------------------------------------------------------------------------------------------
# Process groups of the data-parallel mesh
# ----------------------------------------------------------------------------------------------


def mesh_rank_table(
    mesh, *, shard_dim: str | None = None, replicate_dim: str | None = None
) -> tuple[tuple[int, ...], ...]:
    """Global ranks of the data-parallel mesh as ``table[replicate][shard]`` (R rows of N).

    ``mesh``: ``None`` (1-D over the world); an int ``N`` or ``(N,)`` (1-D over ranks ``0..N-1``);
    ``(R, N)`` (ranks ``r·N + s``, the layout of ``init_device_mesh(..., (R, N))``); or a 1-D / 2-D
    ``DeviceMesh``. A 2-D ``DeviceMesh`` is read as ``(replicate, shard)``; ``shard_dim`` /
    ``replicate_dim`` name its dims when they are called otherwise (e.g. ``"dp_shard"``), and
    dims named exactly ``"shard"`` / ``"replicate"`` are recognised in either order.

    Raises:
        ValueError: a shape that is not 1-D or 2-D, unknown dim names, or a mesh whose size
            differs from the world size when given as an int or tuple.
    """
    world = dist.get_world_size()
    if mesh is None:
        return (tuple(range(world)),)
    if isinstance(mesh, int) or (isinstance(mesh, (tuple, list)) and all(isinstance(d, int) for d in mesh)):
        shape = (int(mesh),) if isinstance(mesh, int) else tuple(int(d) for d in mesh)
        if len(shape) not in (1, 2) or any(d <= 0 for d in shape):
            raise ValueError(f"dmuon: mesh must be N, (N,) or (R, N) with positive sizes, got {mesh!r}")
        if math.prod(shape) != world:
            raise ValueError(
                f"dmuon: mesh {mesh!r} has {math.prod(shape)} ranks but the world has {world}; pass a "
                "DeviceMesh to use a subset of the ranks"
            )
        R, N = (1, shape[0]) if len(shape) == 1 else shape
        return tuple(tuple(r * N + s for s in range(N)) for r in range(R))
    t = mesh.mesh.detach().cpu()
    if t.ndim == 1:
        return (tuple(int(x) for x in t.tolist()),)
    if t.ndim != 2:
        raise ValueError(f"dmuon: mesh must be 1-D or 2-D, got {t.ndim}-D {tuple(t.shape)}")
    names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
    if shard_dim is None and replicate_dim is None and set(names) == {"replicate", "shard"}:
        shard_dim, replicate_dim = "shard", "replicate"
    if shard_dim is not None or replicate_dim is not None:
        if shard_dim not in names or replicate_dim not in names or shard_dim == replicate_dim:
            raise ValueError(
                f"dmuon: shard_dim={shard_dim!r} and replicate_dim={replicate_dim!r} must name the two "
                f"different dims of the mesh, whose dims are {names}"
            )
        if names.index(shard_dim) == 0:
            t = t.T
    return tuple(tuple(int(x) for x in row) for row in t.tolist())


@dataclasses.dataclass(frozen=True, kw_only=True)
class MeshGroups:
    """dmuon's own process groups for a ``(R, N)`` mesh (rank layout ``mesh_ranks[r][s]``).

    dmuon never shares a process group with FSDP2: its collectives form their own sequence, so
    the relative order of dmuon's and FSDP2's hooks cannot mismatch between ranks.

    Tensor parallelism (``tp_size = T > 1``): every TP coordinate ``t`` has its own
    data-parallel mesh; ``mesh_ranks`` is this rank's (``t = tp_rank``), and ``tp_group`` joins
    the ``T`` ranks with this rank's data-parallel coordinate (an owner group), ``tp_ranks``
    their global ranks in TP order.
    """

    mesh_ranks: tuple[tuple[int, ...], ...]  # [replicate][shard] -> global rank
    replicate: int  # this rank's replicate coordinate
    shard: int  # this rank's shard coordinate
    shard_group: Any  # ProcessGroup over mesh_ranks[replicate][:]
    replicate_group: Any  # ProcessGroup over mesh_ranks[:][shard], None when R == 1
    tp_size: int = 1
    tp_rank: int = 0
    tp_group: Any = None  # ProcessGroup over tp_ranks, None when T == 1
    tp_ranks: tuple[int, ...] = ()
    job_group: Any = None  # ProcessGroup over every rank of this job (dp x tp), None = the world

    @property
    def shape(self) -> tuple[int, int]:
        return (len(self.mesh_ranks), len(self.mesh_ranks[0]))

    def rank_of(self, replicate: int, shard: int) -> int:
        return self.mesh_ranks[replicate][shard]

    @staticmethod
    def build(
        ranks: tuple[tuple[int, ...], ...],
        *,
        tp_tables: tuple[tuple[tuple[int, ...], ...], ...] | None = None,
        peer_tables: tuple[tuple[tuple[int, ...], ...], ...] | None = None,
    ) -> "MeshGroups":
        """Create the groups for the rank table ``ranks[replicate][shard]`` (see
        :func:`mesh_rank_table`); a collective call on every rank of the world, in a fixed order.

        ``tp_tables[t]``: the data-parallel table of TP coordinate ``t`` (all ``T`` of them, the
        same on every rank; ``ranks`` is one of them): groups are created for every table, then
        one TP group per data-parallel coordinate. ``peer_tables``: without TP, the tables of
        every independent data-parallel sub-mesh of the world (``ranks`` among them): groups are
        created for all of them, no TP groups.
        """
        me = dist.get_rank()
        tables = tuple(tp_tables or peer_tables or (ranks,))
        found = [(t, r, s) for t, tab in enumerate(tables) for r, row in enumerate(tab) for s, x in enumerate(row) if x == me]
        if len(found) != 1:
            raise ValueError(f"dmuon: rank {me} appears {len(found)} times in mesh {tables}")
        my_t, my_r, my_s = found[0]
        R, N = len(ranks), len(ranks[0])
        shard_group = replicate_group = tp_group = None
        for t, tab in enumerate(tables):  # every rank creates every group, same order
            for r, row in enumerate(tab):
                g = dist.new_group(ranks=list(row))
                if (t, r) == (my_t, my_r):
                    shard_group = g
            if R > 1:
                for s in range(N):
                    g = dist.new_group(ranks=[tab[r][s] for r in range(R)])
                    if (t, s) == (my_t, my_s):
                        replicate_group = g
        T = len(tables) if tp_tables is not None else 1
        tp_ranks: tuple[int, ...] = ()
        if T > 1:
            for r in range(R):
                for s in range(N):
                    members = [tab[r][s] for tab in tables]
                    g = dist.new_group(ranks=members)
                    if (r, s) == (my_r, my_s):
                        tp_group, tp_ranks = g, tuple(members)
        # the ranks of one job (global reductions such as clip_grad_norm_): all tables with TP,
        # each table on its own for independent sub-meshes; None when that is the whole world
        job_group = None
        if peer_tables is not None and tp_tables is None:
            for t, tab in enumerate(tables):
                g = dist.new_group(ranks=sorted(x for row in tab for x in row))
                if t == my_t:
                    job_group = g
        return MeshGroups(
            mesh_ranks=tables[my_t],
            replicate=my_r,
            shard=my_s,
            shard_group=shard_group,
            replicate_group=replicate_group,
            tp_size=T,
            tp_rank=my_t if T > 1 else 0,
            tp_group=tp_group,
            tp_ranks=tp_ranks,
            job_group=job_group,
        )


# ----------------------------------------------------------------------------------------------
# Per-parameter and per-segment state
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class DedicatedInfo:
    """Attached as ``p._dmuon`` to every logical dedicated parameter.

    ``owner_rank``: global rank that runs Newton-Schulz for it; ``is_owner``: this rank is it;
    ``holds_full``: this rank stores the full value (the owner, and in HSDP its replicate peers);
    ``matrix_shape`` ``(m, n)`` and ``num_matrices``: the Muon view; ``shape``: logical shape.
    """

    fqn: str
    owner_rank: int
    is_owner: bool
    holds_full: bool
    shape: tuple[int, ...]
    matrix_shape: tuple[int, int]
    num_matrices: int
    runtime: Any = dataclasses.field(repr=False, compare=False)  # weakref to DmuonRuntime
    tp: "TPInfo | None" = None  # a TP-sharded matrix: its placement and owner TP group


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
                local, self.mesh, self.placements, run_check=False, shape=self.shape,
                stride=_contiguous_strides(self.shape),
            )
        return DTensor.from_local(local, self.mesh, self.placements, run_check=False)

    def local(self, t: torch.Tensor) -> torch.Tensor:
        """The local shard of a DTensor with this matrix's placement (redistributed if needed)."""
        if tuple(t.placements) != tuple(self.placements):
            t = t.redistribute(self.mesh, self.placements)
        return t.to_local()


_DTYPES = {str(d): d for d in (torch.float32, torch.float64, torch.float16, torch.bfloat16)}


def _dtype(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"dmuon: unsupported parameter dtype {name}") from None


@dataclasses.dataclass(eq=False)
class _Slot:
    """One dedicated parameter inside a segment."""

    fqn: str
    offset_in_seg: int  # elements from the segment start
    numel: int
    shape: tuple[int, ...]
    homes: list[tuple[nn.Module, str]]  # every (module, attribute) alias
    logical: nn.Parameter
    compute: nn.Parameter
    tp: TPInfo | None = None


@dataclasses.dataclass(eq=False)
class _SubSeg:
    owner_rank: int
    offset_in_seg: int
    numel: int
    flags_offset_in_seg: int
    slots: list[_Slot]


@dataclasses.dataclass(eq=False)
class _Segment:
    shard: int
    numel: int
    held: bool  # this rank stores it permanently (its shard coordinate)
    src_rank: int  # holder in this rank's replicate row: broadcast source / reduce destination
    wire: torch.Tensor  # 1-D, broadcast dtype; storage freed when not resident (non-held only)
    master: torch.Tensor | None  # held only: 1-D, param dtype; ``wire`` itself unless mixed precision
    subs: list[_SubSeg]
    slots: list[_Slot]
    reduce_dtype: torch.dtype
    param_dtype: torch.dtype
    resident: bool = True
    # gradient reduce, built on first use (``_BoundaryRuntime._reduce_buffer``) and reused every step
    reduce_buf: torch.Tensor | None = None  # 1-D, reduce dtype, on the segment's device
    reduce_inflight: bool = False  # a reduce on ``reduce_buf`` is launched and not yet finished
    owned: list = dataclasses.field(default_factory=list)  # [_Owned] sub-segments this rank owns


@dataclasses.dataclass(eq=False)
class _Owned:
    """A sub-segment this rank owns: views of its segment's reduce buffer (built once, valid
    across the buffer's storage being released and regrown)."""

    sub: _SubSeg
    values: torch.Tensor  # reduce_buf[sub.offset_in_seg : + sub.numel]
    flags: torch.Tensor  # reduce_buf[sub.flags_offset_in_seg : + len(sub.slots)]


# ----------------------------------------------------------------------------------------------
# One hook boundary
# ----------------------------------------------------------------------------------------------


class _PostBackward(torch.autograd.Function):
    """Identity on the boundary's forward inputs; its backward marks the boundary's backward done.

    Autograd runs a node once all its inputs' gradients are ready, and runs ``AccumulateGrad``
    nodes as soon as they are ready, so by the time gradients w.r.t. the boundary's inputs are
    produced, every parameter gradient inside it has been accumulated.
    """

    @staticmethod
    def forward(ctx, boundary_ref, *tensors):
        ctx.boundary_ref = boundary_ref
        return tensors if len(tensors) != 1 else tensors[0]

    @staticmethod
    def backward(ctx, *grads):
        boundary = ctx.boundary_ref()
        if boundary is not None:
            boundary._on_post_backward()
        return (None, *grads)


class _BoundaryRuntime:
    def __init__(self, runtime: "DmuonRuntime", fqn: str, module: nn.Module, segments: list[_Segment]):
        self.runtime_ref = weakref.ref(runtime)
        self.fqn = fqn
        self.module = module
        self.segments = segments
        self.slots = [slot for seg in segments for slot in seg.slots]
        self.pending_backward = 0  # grad-enabled forwards whose backward has not finished
        self.installed = False
        self.unsharded = False
        self._inflight: list = []  # posted, not yet waited-for broadcasts (prefetch)
        self._stream_pending = False  # CUDA: work queued on the broadcast stream, not yet waited for
        self._inflight_phase = ""
        self._checked_fsdp_policy = False
        self.index = 0  # position in the runtime's boundary order (set by the runtime)
        self.handles: list = []

    # -- storage ---------------------------------------------------------------------------

    def _unshard(self, phase: str, *, wait: bool = True) -> None:
        """Make every segment resident on this rank: one async broadcast per segment.

        ``wait=False`` only posts the broadcasts (prefetch); the boundary's own hook waits for
        them before the parameters are used. ``self.unsharded`` follows the same transitions on
        every rank (it depends on hook order only, never on data), so all ranks agree on which
        broadcasts run, in which order.
        """
        rt = self.runtime_ref()
        if not self.unsharded:
            rt.wait_replicate_broadcasts(self)  # HSDP: the holder's value must be current
            works = []
            stream = rt.comm_stream("broadcast")  # None off CUDA
            for seg in self.segments:
                if not seg.held:  # regrown on the compute stream: the allocator keeps it stream-ordered
                    seg.wire.untyped_storage().resize_(seg.numel * seg.wire.element_size())
                    seg.resident = True
            if stream is not None:  # masters written by the optimizer, storage last read by compute
                stream.wait_stream(torch.cuda.current_stream(stream.device))
                self._stream_pending = True
            with _on_stream(stream):
                for seg in self.segments:
                    if seg.held:
                        self._copy_masters_to_wire(seg)
                    if rt.num_shards > 1:
                        works.append(
                            C.broadcast(
                                seg.wire, src=seg.src_rank, group=rt.groups.shard_group, phase=phase, async_op=True
                            )
                        )
            self._inflight = works
            self._inflight_phase = phase
            self.unsharded = True
        if wait and (self._inflight or self._stream_pending):
            works, self._inflight = self._inflight, []
            stream = rt.comm_stream("broadcast") if self._stream_pending else None
            with _on_stream(stream):  # NCCL: the broadcast stream waits for the collectives
                C.wait_all(works, what=f"boundary {self.fqn!r} {self._inflight_phase}", timeout_s=rt.timeout_s)
            if stream is not None:  # the compute stream waits before the parameters are used
                torch.cuda.current_stream(stream.device).wait_event(stream.record_event())
                self._stream_pending = False

    def _reshard(self) -> None:
        """Free the storage of every segment this rank does not hold (the tensors stay valid).

        Storage is never freed under a collective still in flight: a prefetch is waited for first.
        """
        if self._inflight or self._stream_pending:
            self._unshard(self._inflight_phase)
        for seg in self.segments:
            if not seg.held and seg.resident:
                seg.wire.untyped_storage().resize_(0)
                seg.resident = False
        self.unsharded = False

    @staticmethod
    def _copy_masters_to_wire(seg: _Segment) -> None:
        """Mixed precision: cast the full-precision masters into the broadcast-dtype segment."""
        if seg.master is not seg.wire:
            with torch.no_grad():
                seg.wire.copy_(seg.master)

    # -- module attributes -----------------------------------------------------------------

    def _install(self) -> None:
        if self.installed:
            return
        for slot in self.slots:
            if slot.compute.requires_grad != slot.logical.requires_grad:  # frozen / unfrozen since
                slot.compute.requires_grad_(slot.logical.requires_grad)
            for module, attr in slot.homes:
                module._parameters[attr] = slot.compute
        self.installed = True

    def _restore(self) -> None:
        if not self.installed:
            return
        for slot in self.slots:
            for module, attr in slot.homes:
                module._parameters[attr] = slot.logical
        self.installed = False

    # -- hooks -----------------------------------------------------------------------------

    def pre_forward(self, module, args, kwargs):
        rt = self.runtime_ref()
        if _in_backward():
            # activation-checkpoint recomputation (the boundary itself, or an ancestor, was
            # checkpointed): the backward's parameters are already in place (pre-backward ran
            # when the gradient reached the recomputed region's output); count nothing, free nothing
            self._unshard("backward_broadcast")
            self._install()
            return args, kwargs
        if not self._checked_fsdp_policy:
            self._check_fsdp_policy(module)
        self._unshard("forward_broadcast", wait=False)
        nxt = rt.boundary_after(self)
        if nxt is not None:  # prefetch: the next boundary's broadcasts overlap this compute
            nxt._unshard("forward_broadcast", wait=False)
        self._unshard("forward_broadcast")
        self._install()
        if torch.is_grad_enabled():
            self.pending_backward += 1
            args, kwargs = self._register_post_backward(args, kwargs)
        return args, kwargs

    def post_forward(self, module, args, kwargs, output):
        if _in_backward():  # recomputation: the parameters stay installed until post-backward
            return output
        self._restore()
        grad = torch.is_grad_enabled()
        # Z3 frees after every forward; a no-grad forward frees unless a backward still needs
        # the buffers (Z2 keeps them from the forward broadcast until the boundary's backward).
        if self.runtime_ref().reshard_after_forward or (not grad and self.pending_backward == 0):
            self._reshard()
        if grad:
            tensors = [t for t in optree.tree_leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad]
            if tensors:
                torch.autograd.graph.register_multi_grad_hook(tensors, self._on_pre_backward, mode="any")
        return output

    def _check_fsdp_policy(self, module) -> None:
        """Report a ``fully_shard`` mixed-precision policy that differs from the plan's."""
        self._checked_fsdp_policy = True
        state = _fsdp_state(module)
        policy = getattr(state, "_mp_policy", None)
        if policy is None:
            return
        plan = self.runtime_ref().plan
        theirs = (_dtype_name(policy.param_dtype), _dtype_name(policy.reduce_dtype))
        ours = (plan.param_dtype, plan.reduce_dtype)
        if theirs != ours:
            warnings.warn(
                f"dmuon: fully_shard({self.fqn or '<root>'}) uses mp_policy param_dtype/reduce_dtype "
                f"{theirs} but dmuon's plan uses {ours} for the dedicated matrices of this boundary; "
                "pass the same MixedPrecisionPolicy to dmuon.dedicate_params(..., mp_policy=...)",
                stacklevel=2,
            )

    def _gradient_sync(self) -> bool:
        """``dmuon.no_sync`` / FSDP2's ``set_requires_gradient_sync(False)`` defer the reduce.

        FSDP2's flag is read from the boundary's own ``fully_shard`` unit and from the root's.
        """
        rt = self.runtime_ref()
        if not rt.requires_gradient_sync:
            return False
        return _fsdp_requires_gradient_sync(self.module) and _fsdp_requires_gradient_sync(rt.model_ref())

    def _register_post_backward(self, args, kwargs):
        leaves, spec = optree.tree_flatten((args, kwargs))
        idx = [i for i, t in enumerate(leaves) if isinstance(t, torch.Tensor) and t.requires_grad]
        if not idx:
            return args, kwargs
        outs = _PostBackward.apply(weakref.ref(self), *[leaves[i] for i in idx])
        if len(idx) == 1:
            outs = (outs,)
        for i, o in zip(idx, outs):
            leaves[i] = o
        return optree.tree_unflatten(spec, leaves)

    def _on_pre_backward(self, *unused) -> None:
        rt = self.runtime_ref()
        rt.queue_final_callback()
        if self.pending_backward <= 0:
            return
        self._unshard("backward_broadcast", wait=False)  # no-op in Z2: resident since the forward
        prev = rt.boundary_before(self)
        if prev is not None and prev.pending_backward > 0:  # prefetch for the next backward
            prev._unshard("backward_broadcast", wait=False)
        self._unshard("backward_broadcast")
        self._install()

    def _on_post_backward(self) -> None:
        self.pending_backward -= 1
        if self.pending_backward > 0:
            return
        self._finish()

    def finish_backward(self) -> None:
        """Called from the final callback: finish if the post-backward trigger never fired."""
        if self.pending_backward > 0:
            self._finish()

    def _finish(self) -> None:
        self.pending_backward = 0
        self._restore()
        if self._gradient_sync():
            self._launch_reduce()
        # else: no_sync micro-batch: every rank keeps its full local gradient in the compute
        # parameters' .grad (autograd accumulates the next micro-batch into it)
        self._reshard()

    # -- gradient reduce -------------------------------------------------------------------

    def _launch_reduce(self) -> None:
        """Pack the local gradients into each segment's reduce buffer and reduce it.

        The buffer tensor is reused (storage regrown, zeroed, rewritten), so a reduce still in flight on it (the same boundary
        finishing twice before the end of the backward) is finished first. CUDA: the packing and
        the reduce are ordered after the compute stream on the reduce stream; the local gradients
        stay referenced until :meth:`DmuonRuntime.finish_reduces` waits for that stream.
        """
        rt = self.runtime_ref()
        groups = rt.groups
        if any(seg.reduce_inflight for seg in self.segments):
            rt.finish_reduces()
        stream = rt.comm_stream("reduce")  # None off CUDA
        # (re)grow the buffers on the compute stream, as FSDP2 allocates its reduce-scatter input
        bufs = [self._reduce_buffer(seg) for seg in self.segments]
        if stream is not None:  # the gradients were produced on the compute stream
            stream.wait_stream(torch.cuda.current_stream(stream.device))
        with _on_stream(stream):
            for seg, buf in zip(self.segments, bufs):
                buf.fill_(0)
                keep = []
                for sub in seg.subs:
                    for k, slot in enumerate(sub.slots):
                        g = slot.compute.grad
                        if g is not None:
                            if slot.tp is not None:
                                g = slot.tp.local(g)
                            buf[slot.offset_in_seg : slot.offset_in_seg + slot.numel].copy_(g.reshape(-1))
                            buf[sub.flags_offset_in_seg + k] = 1
                            if stream is not None:
                                keep.append(g)
                            slot.compute.grad = None
                work = C.reduce_sum(buf, dst=seg.src_rank, group=groups.shard_group, phase="reduce", async_op=True)
                seg.reduce_inflight = True
                rt.pending_reduces.append((self, seg, buf, work, keep))

    @staticmethod
    def _reduce_buffer(seg: _Segment) -> torch.Tensor:
        """The segment's reduce buffer, with its storage grown: the tensor (and the views of the
        sub-segments this rank owns) is built once, on the segment's device in the reduce dtype,
        and rebuilt only after the segment moved; its storage is released again by
        :meth:`DmuonRuntime.finish_reduces` once the averages are out, as the broadcast buffers'
        storage is after the boundary's use, so no rank keeps gradient-sized memory between
        backwards."""
        buf = seg.reduce_buf
        if buf is None or buf.device != seg.wire.device:
            buf = torch.empty(seg.numel, dtype=seg.reduce_dtype, device=seg.wire.device)
            me = dist.get_rank()
            seg.reduce_buf = buf
            seg.owned = [
                _Owned(
                    sub=sub,
                    values=buf[sub.offset_in_seg : sub.offset_in_seg + sub.numel],
                    flags=buf[sub.flags_offset_in_seg : sub.flags_offset_in_seg + len(sub.slots)],
                )
                for sub in seg.subs
                if seg.held and sub.owner_rank == me
            ]
        else:
            buf.untyped_storage().resize_(seg.numel * buf.element_size())
        return buf


# ----------------------------------------------------------------------------------------------
# The runtime of one model
# ----------------------------------------------------------------------------------------------


class DmuonRuntime:
    """Binds a :class:`~dmuon.plan.ShardingPlan` to a model and a mesh (see module docstring)."""

    def __init__(self, plan, model: nn.Module, groups: MeshGroups, device: torch.device):
        self.plan = plan
        self.groups = groups
        self.device = device
        self.reshard_after_forward = bool(plan.reshard_after_forward)
        self.replicate_async = bool(plan.replicate_async)
        self.num_shards = groups.shape[1]
        self.world_numel = groups.shape[0] * groups.shape[1]
        self.tp_size = groups.tp_size
        self.boundaries: list[_BoundaryRuntime] = []
        self.pending_reduces: list = []  # (boundary, segment, buffer, work, local grads kept alive)
        self._flag_host_reads = 0  # host reads of presence flags (one per finish_reduces with owned grads)
        self.use_streams = True  # CUDA: dmuon's own broadcast / reduce streams (False: the compute stream)
        self._streams = None  # (device, {"broadcast": Stream, "reduce": Stream}), built on first use
        self.pending_replicate: dict[int, list] = {}
        self._final_callback_queued = False
        self.requires_gradient_sync = True
        self.timeout_s: float | None = None
        self.model_ref = weakref.ref(model)
        self._build(model)

    # -- construction ----------------------------------------------------------------------

    def _build(self, model: nn.Module) -> None:
        plan = self.plan
        g = self.groups
        R, N = g.shape
        modules = dict(model.named_modules(remove_duplicate=False))
        specs = {p.fqn: p for p in plan.params}
        owners = dict(zip((p.fqn for p in plan.params), plan.owners))
        original = {}
        for spec in plan.params:
            mod = modules[spec.module_fqn]
            original[spec.fqn] = mod._parameters[spec.attr]
        for b in plan.boundaries:
            segments: list[_Segment] = []
            for layout in b.buffers:
                param_dtype = _dtype(layout.dtype)
                wire_dtype = _dtype(plan.param_dtype) if plan.param_dtype else param_dtype
                reduce_dtype = _dtype(plan.reduce_dtype) if plan.reduce_dtype else wire_dtype
                for seg_l in layout.segments:
                    held = seg_l.shard == g.shard
                    wire = torch.zeros(seg_l.numel, dtype=wire_dtype, device=self.device)
                    master = None
                    if held:
                        master = wire if wire_dtype == param_dtype else torch.zeros(
                            seg_l.numel, dtype=param_dtype, device=self.device
                        )
                    seg = _Segment(
                        shard=seg_l.shard,
                        numel=seg_l.numel,
                        held=held,
                        src_rank=g.rank_of(g.replicate, seg_l.shard),
                        wire=wire,
                        master=master,
                        subs=[],
                        slots=[],
                        reduce_dtype=reduce_dtype,
                        param_dtype=param_dtype,
                    )
                    for sub_l in seg_l.subsegments:
                        sub = _SubSeg(
                            owner_rank=g.rank_of(sub_l.owner.replicate, sub_l.owner.shard),
                            offset_in_seg=sub_l.offset - seg_l.offset,
                            numel=sub_l.numel,
                            flags_offset_in_seg=sub_l.flags_offset - seg_l.offset,
                            slots=[],
                        )
                        for e in sub_l.entries:
                            spec = specs[e.fqn]
                            off = e.offset - seg_l.offset
                            orig = original[e.fqn]
                            if tuple(orig.shape) != tuple(spec.shape) or str(orig.dtype) != spec.dtype:
                                raise ValueError(
                                    f"dmuon: parameter {e.fqn!r} is {tuple(orig.shape)} {orig.dtype} in the model "
                                    f"but {spec.shape} {spec.dtype} in the plan; recompile the plan after "
                                    "changing the model"
                                )
                            tp = self._tp_info(spec, orig)
                            lshape = tuple(spec.local_shape)
                            strides = _contiguous_strides(lshape)
                            if held:
                                value = orig.to_local() if tp is not None else orig
                                master[off : off + e.numel].copy_(value.detach().reshape(-1))
                                logical = torch.empty(0, dtype=param_dtype, device=self.device).set_(
                                    master.untyped_storage(), off, lshape, strides
                                )
                            else:
                                # zero rows, the other dims kept: nn.init / reset_parameters see the
                                # true fan-in and run (as no-ops) on non-holders after to_empty
                                logical = torch.empty((0, *lshape[1:]), dtype=param_dtype, device=self.device)
                            compute = torch.empty(0, dtype=wire_dtype, device=self.device).set_(
                                wire.untyped_storage(), off, lshape, strides
                            )
                            if tp is not None:
                                logical, compute = tp.wrap(logical), tp.wrap(compute)
                            logical = nn.Parameter(logical, requires_grad=orig.requires_grad)
                            compute = nn.Parameter(compute, requires_grad=orig.requires_grad)
                            owner = owners[e.fqn]
                            owner_rank = g.rank_of(owner.replicate, owner.shard)
                            logical._dmuon = DedicatedInfo(
                                fqn=e.fqn,
                                owner_rank=owner_rank,
                                is_owner=owner_rank == dist.get_rank(),
                                holds_full=held,
                                shape=tuple(spec.shape),
                                matrix_shape=tuple(spec.matrix_shape),
                                num_matrices=int(spec.num_matrices),
                                runtime=weakref.ref(self),
                                tp=tp,
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
                        wire.untyped_storage().resize_(0)
                        seg.resident = False
                    segments.append(seg)
            module = modules[b.fqn]
            br = _BoundaryRuntime(self, b.fqn, module, segments)
            br.index = len(self.boundaries)
            for slot in br.slots:
                for mod, attr in slot.homes:
                    mod._parameters[attr] = slot.logical
            br.handles.append(module.register_forward_pre_hook(br.pre_forward, with_kwargs=True))
            br.handles.append(module.register_forward_hook(br.post_forward, with_kwargs=True))
            self.boundaries.append(br)
        self.slots_by_fqn = {s.fqn: s for b in self.boundaries for s in b.slots}
        self.shard_of_fqn = {s.fqn: seg.shard for b in self.boundaries for seg in b.segments for s in seg.slots}
        # checkpoint / materialisation bookkeeping (dmuon.exec.checkpoint, dmuon.exec.materialize)
        self.infos = {s.fqn: s.logical._dmuon for s in self.slots_by_fqn.values()}
        self.state_dict_mesh = None  # DeviceMesh of the state-dict DTensors, built on first use
        self.replicas_stale = False  # HSDP: holders may disagree (set by to_empty & co.)

    def _tp_info(self, spec, orig: torch.Tensor) -> TPInfo | None:
        """The :class:`TPInfo` of a TP-sharded dedicated matrix (None without TP), after checking
        that the model's parameter has the placement the plan was compiled for."""
        if spec.tp_size == 1:
            return None
        g = self.groups
        placements = tuple(getattr(orig, "placements", ()))
        mesh = getattr(orig, "device_mesh", None)
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

    def comm_stream(self, kind: str):
        """CUDA: dmuon's ``"broadcast"`` or ``"reduce"`` stream (high priority, as FSDP2's), ordered
        with the compute stream by events; ``None`` off CUDA or with ``use_streams=False``."""
        if self.device.type != "cuda" or not self.use_streams:
            return None
        if self._streams is None or self._streams[0] != self.device:
            self._streams = (
                self.device,
                {k: torch.cuda.Stream(device=self.device, priority=-1) for k in ("broadcast", "reduce")},
            )
        return self._streams[1][kind]

    def boundary_after(self, b: "_BoundaryRuntime") -> "_BoundaryRuntime | None":
        """Forward prefetch target: the next boundary in plan (module registration) order."""
        i = b.index + 1
        return self.boundaries[i] if i < len(self.boundaries) else None

    def boundary_before(self, b: "_BoundaryRuntime") -> "_BoundaryRuntime | None":
        """Backward prefetch target: the previous boundary in plan order."""
        return self.boundaries[b.index - 1] if b.index > 0 else None

    # -- backward bookkeeping --------------------------------------------------------------

    def queue_final_callback(self) -> None:
        if self._final_callback_queued:
            return
        self._final_callback_queued = True
        torch.autograd.Variable._execution_engine.queue_callback(self._final_callback)

    def _final_callback(self) -> None:
        self._final_callback_queued = False
        for b in reversed(self.boundaries):
            b.finish_backward()
        self.finish_reduces()

    def finish_reduces(self) -> None:
        """Wait for the in-flight gradient reduces and accumulate the averages into owners' ``.grad``.

        HSDP: after the shard-group reduce, every holder ``(s, r')`` of a segment SUM-reduces each
        sub-segment over its replicate group to the sub-segment's owner ``(s, r)``; the owner
        divides by ``R·N`` (net AVG over the whole mesh).
        """
        pending, self.pending_reduces = self.pending_reduces, []
        if not pending:
            return
        stream = self.comm_stream("reduce")  # None off CUDA
        with _on_stream(stream):  # NCCL: the reduce stream waits for the collectives
            for boundary, _, _, work, _ in pending:
                C.wait_all([work], what=f"boundary {boundary.fqn!r} reduce", timeout_s=self.timeout_s)
            g = self.groups
            if g.shape[0] > 1:
                works = []
                for boundary, seg, buf, _, _ in pending:
                    if not seg.held:
                        continue
                    for sub in seg.subs:
                        part = buf[sub.offset_in_seg : sub.offset_in_seg + sub.numel]
                        work = C.reduce_sum(
                            part, dst=sub.owner_rank, group=g.replicate_group, phase="replicate_reduce", async_op=True
                        )
                        works.append((boundary, work))
                for boundary, work in works:
                    C.wait_all([work], what=f"boundary {boundary.fqn!r} replicate_reduce", timeout_s=self.timeout_s)
        if stream is not None:  # the compute stream reads the buffers below; the local grads are released after
            torch.cuda.current_stream(stream.device).wait_event(stream.record_event())
        for _, seg, _, _, _ in pending:
            seg.reduce_inflight = False
        owned = [o for _, seg, _, _, _ in pending for o in seg.owned]
        if owned:
            self._write_owner_grads(owned)
        for _, seg, buf, _, _ in pending:  # averages copied out: release until the next backward
            buf.untyped_storage().resize_(0)

    def _write_owner_grads(self, owned: list) -> None:
        """Average the owned sub-segments of finished reduces into their parameters' ``.grad``."""
        # one host read of every presence flag this rank owns (a device sync on CUDA)
        flags = (owned[0].flags if len(owned) == 1 else torch.cat([o.flags for o in owned])).tolist()
        self._flag_host_reads += 1
        i = 0
        for o in owned:
            sub = o.sub
            sub_flags, i = flags[i : i + len(sub.slots)], i + len(sub.slots)
            if not any(sub_flags):
                continue
            o.values.div_(self.world_numel)
            for slot, flag in zip(sub.slots, sub_flags):
                if flag == 0:
                    continue  # no rank had a gradient: skip, as torch.optim.Muon does
                start = slot.offset_in_seg - sub.offset_in_seg
                grad = o.values[start : start + slot.numel].view(slot.shape)
                p = slot.logical
                # a copy, never a view of the reduce buffer (released below, rewritten next backward)
                grad = grad.to(p.dtype, copy=True) if p.grad is None else grad.to(p.dtype)
                if slot.tp is not None:
                    grad = slot.tp.wrap(grad)
                if p.grad is None:
                    p.grad = grad
                else:
                    p.grad.add_(grad)

    def wait_replicate_broadcasts(self, boundary=None) -> None:
        """HSDP: wait for the post-step replicate broadcasts of ``boundary`` (all when ``None``)."""
        if not self.pending_replicate:
            return
        keys = list(self.pending_replicate) if boundary is None else [boundary.index]
        for key in keys:
            works = self.pending_replicate.pop(key, None)
            if works:
                what = f"boundary {self.boundaries[key].fqn!r} replicate_broadcast (after step)"
                C.wait_all(works, what=what, timeout_s=self.timeout_s)

    def after_step(self) -> None:
        """HSDP: each owner broadcasts its updated sub-segments to its replicate peers.

        ``replicate_async=True``: launched here, waited for just before the boundary's next
        forward broadcast or any state-dict read; ``False``: waited for here.
        """
        if self.groups.shape[0] == 1:
            return
        self.wait_replicate_broadcasts()
        for b in self.boundaries:
            works = self._broadcast_to_replicas([b], "replicate_broadcast")
            if self.replicate_async:
                self.pending_replicate[b.index] = works
            else:
                C.wait_all(works, what=f"boundary {b.fqn!r} replicate broadcast", timeout_s=self.timeout_s)

    def _broadcast_to_replicas(self, boundaries, phase: str) -> list:
        """HSDP: post one async broadcast per sub-segment of ``boundaries`` held here, from its
        owner to its replicate peers (the owner's current master); returns the works."""
        works = []
        for b in boundaries:
            for seg in b.segments:
                if not seg.held:
                    continue
                for sub in seg.subs:
                    part = seg.master[sub.offset_in_seg : sub.offset_in_seg + sub.numel]
                    works.append(
                        C.broadcast(part, src=sub.owner_rank, group=self.groups.replicate_group, phase=phase, async_op=True)
                    )
        return works

    def after_load(self) -> None:
        """After ``load_state_dict`` wrote new masters on every holder (nothing to communicate)."""

    def remove_hooks(self) -> None:
        for b in self.boundaries:
            for h in b.handles:
                h.remove()
            b.handles.clear()

    # -- storage binding and state access (dmuon.exec.materialize, dmuon.exec.checkpoint) --

    @torch.no_grad()
    def rebind_storage(self, boundaries=None) -> bool:
        """Bind segment storage to where the logical parameters are now (after ``Module._apply``).

        ``model.to_empty(device=d)``, ``model.to(d)`` and every other ``Module._apply`` give each
        logical parameter new storage (``param.data = fn(param)``), which cuts the link between a
        holder's logical parameters and its segment ``master``. For every segment of
        ``boundaries`` (default: all) whose storage no longer matches:

        * held: a new 1-D ``master`` on the parameters' device, each logical parameter's current
          value copied into its slice (nothing copied from ``meta``), the logical parameter
          re-pointed at that slice; ``wire`` is the master again (or a new wire-dtype buffer
          under mixed precision); compute parameters re-pointed at ``wire``;
        * not held: a new ``wire`` on that device whose storage is released again at once
          (building the compute views allocates the segment for a moment, as a forward
          broadcast does), so non-holders keep no dedicated storage.

        Local (no collective). Tags lost by ``torch.utils.swap_tensors``
        (``torch.__future__.set_swap_module_params_on_conversion(True)``) are restored.
        Returns True when anything was re-bound.

        Raises:
            RuntimeError: a boundary is between its forward and its backward, or the logical
                parameters of one segment ended up on different devices.
            ValueError: a parameter's dtype changed (the plan fixes dtypes; cast before planning).
        """
        self._check_no_tp("moving or re-creating the model's storage (to_empty / to / meta-device init)")
        changed = False
        boundaries = self.boundaries if boundaries is None else boundaries
        self._settle(boundaries, "moving or re-creating the model's storage (to_empty / to)")
        for b in boundaries:
            for seg in b.segments:
                changed |= self._rebind_segment(seg)
        if changed:
            devices = {seg.wire.device for b in self.boundaries for seg in b.segments}
            if len(devices) == 1:
                device = devices.pop()
                if device != self.device:
                    self.device = device
                    self.state_dict_mesh = None
        return changed

    def _rebind_segment(self, seg: _Segment) -> bool:
        for slot in seg.slots:
            self._adopt_module_param(slot)
            if getattr(slot.logical, "_dmuon", None) is None:
                slot.logical._dmuon = self.infos[slot.fqn]
        devices = {slot.logical.device for slot in seg.slots}
        if len(devices) != 1:
            raise RuntimeError(
                f"dmuon: the dedicated parameters {[s.fqn for s in seg.slots]} of one packed segment "
                f"are on different devices {sorted(map(str, devices))}; move whole hook boundaries"
            )
        device = devices.pop()
        for slot in seg.slots:
            if slot.logical.dtype != seg.param_dtype:
                raise ValueError(
                    f"dmuon: dedicated parameter {slot.fqn!r} became {slot.logical.dtype}, the plan says "
                    f"{seg.param_dtype}; change dtypes before planning (or use mp_policy)"
                )
        wire_dtype = seg.wire.dtype
        if seg.held:
            storage = seg.master.untyped_storage()._cdata
            if seg.master.device == device and all(
                slot.logical.untyped_storage()._cdata == storage for slot in seg.slots
            ):
                return False
            master = torch.zeros(seg.numel, dtype=seg.param_dtype, device=device)
            for slot in seg.slots:
                view = master[slot.offset_in_seg : slot.offset_in_seg + slot.numel].view(slot.shape)
                if slot.logical.device.type != "meta":
                    view.copy_(slot.logical.detach().reshape(slot.shape))
                slot.logical.data = view
            wire = master if wire_dtype == seg.param_dtype else torch.zeros(seg.numel, dtype=wire_dtype, device=device)
            seg.master, seg.wire, seg.resident = master, wire, True
            for slot in seg.slots:
                self._set_compute(slot, wire[slot.offset_in_seg : slot.offset_in_seg + slot.numel].view(slot.shape))
            return True
        if seg.wire.device == device:
            return False
        wire = torch.empty(seg.numel, dtype=wire_dtype, device=device)
        for slot in seg.slots:
            self._set_compute(
                slot,
                torch.empty(0, dtype=wire_dtype, device=device).set_(
                    wire.untyped_storage(), slot.offset_in_seg, slot.shape, _contiguous_strides(slot.shape)
                ),
            )
        wire.untyped_storage().resize_(0)
        seg.wire, seg.resident = wire, False
        return True

    @staticmethod
    def _set_compute(slot: _Slot, view: torch.Tensor) -> None:
        """A new compute parameter viewing ``view``'s storage (never installed between steps)."""
        compute = nn.Parameter(view, requires_grad=slot.compute.requires_grad)
        slot.compute = compute

    def _adopt_module_param(self, slot: _Slot) -> None:
        """``Module._apply`` from ``meta`` (to_empty) registers NEW Parameter objects (meta and
        real tensors cannot share a TensorImpl type): move the new content into the logical
        Parameter with ``torch.utils.swap_tensors`` so its identity (held by optimizers, the
        runtime, user code) survives, and register it again under every alias (which also
        re-ties aliases that ``_apply`` split)."""
        new = None
        for module, attr in slot.homes:
            cur = module._parameters.get(attr)
            if cur is not None and cur is not slot.logical:
                new = cur
                break
        if new is None:
            return
        try:
            torch.utils.swap_tensors(slot.logical, new)
        except RuntimeError:  # e.g. a weak reference to one of them: adopt the new object
            slot.logical = new
        slot.logical._dmuon = self.infos[slot.fqn]
        for module, attr in slot.homes:
            module._parameters[attr] = slot.logical

    def check_materialized(self, what: str) -> None:
        """Raise a clear error while the dedicated storage is still on the ``meta`` device."""
        if any(seg.wire.device.type == "meta" for b in self.boundaries for seg in b.segments):
            raise RuntimeError(
                f"dmuon: {what}: the dedicated parameters are still on the meta device; call "
                "model.to_empty(device=...) and initialise the model first (e.g. dmuon.init_params(model), "
                "or load a checkpoint; see docs/checkpointing.md)"
            )

    def check_idle(self, what: str) -> None:
        """Before masters are overwritten (state-dict load): every boundary between steps.

        Raises if a forward still awaits its backward; a boundary left resident by a prefetch
        (a forward that stopped early) waits for its broadcasts and frees its copies, so the
        next forward broadcasts the new values again.
        """
        self._settle(self.boundaries, what)

    @staticmethod
    def _settle(boundaries, what: str) -> None:
        busy = [b.fqn for b in boundaries if b.installed or b.pending_backward > 0]
        if busy:
            raise RuntimeError(
                f"dmuon: {what} while boundaries {busy[:3]} are between their forward and backward; "
                "do it between training steps"
            )
        for b in boundaries:
            if b.unsharded:
                b._reshard()

    def sync_replicas(self) -> None:
        """HSDP: broadcast every owner's value to its replicate peers when they may disagree.

        Runs only when :attr:`replicas_stale` is set, i.e. after a ``Module._apply`` on the model
        (``to_empty`` followed by a per-rank initialisation leaves replicas with their own
        values); a collective over each replicate group, charged to the ledger as ``"other"``.
        The flag is set on every rank by the same call, so all ranks agree on running it.
        """
        if not self.replicas_stale:
            return
        self.replicas_stale = False
        if self.groups.shape[0] == 1:
            return
        self.check_materialized("synchronising HSDP replicas")
        self.wait_replicate_broadcasts()
        works = self._broadcast_to_replicas(self.boundaries, "other")
        C.wait_all(works, what="HSDP replica sync after materialisation", timeout_s=getattr(self, "timeout_s", None))

    def _check_no_tp(self, what: str) -> None:
        if self.tp_size > 1:
            raise NotImplementedError(
                f"dmuon: {what} is not supported yet for tensor-parallel dedicated matrices (plan tp_size="
                f"{self.tp_size}); training, gradient accumulation and no_sync are. Build the model on its "
                "device before parallelize_module, and keep TP models out of state-dict checkpoints for now "
                "(or exclude the TP matrices from dmuon with predicate=)"
            )

    def prepare_state_access(self, what: str) -> None:
        """Before reading or writing masters through the state-dict API (collective in HSDP)."""
        self._check_no_tp(what)
        self.check_materialized(what)
        self.sync_replicas()
        self.wait_replicate_broadcasts()


def _fsdp_state(module):
    """FSDP2 state of ``module`` if ``fully_shard`` was applied to it, else ``None``."""
    get = getattr(module, "_get_fsdp_state", None)
    return get() if get is not None else None


def _fsdp_requires_gradient_sync(module) -> bool:
    """False when FSDP2's ``set_requires_gradient_sync(False)`` is in force on ``module``'s unit."""
    groups = getattr(_fsdp_state(module), "_fsdp_param_groups", None) or ()
    return all(getattr(g, "reduce_grads", True) for g in groups)


def _on_stream(stream):
    """``torch.cuda.stream(stream)``, or nothing for ``None`` (CPU: a single stream)."""
    return contextlib.nullcontext() if stream is None else torch.cuda.stream(stream)


def _in_backward() -> bool:
    """True while autograd executes a backward pass on this thread (e.g. checkpoint recompute)."""
    return torch._C._current_graph_task_id() != -1


def _dtype_name(dtype) -> str | None:
    return None if dtype is None else str(dtype)


def _contiguous_strides(shape) -> tuple[int, ...]:
    strides = []
    acc = 1
    for d in reversed(tuple(shape)):
        strides.append(acc)
        acc *= d
    return tuple(reversed(strides))


# ----------------------------------------------------------------------------------------------
# Optimizer hooks (called by dmuon.Muon.step)
# ----------------------------------------------------------------------------------------------


def get_runtime(p: torch.Tensor) -> DmuonRuntime | None:
    info = getattr(p, "_dmuon", None)
    return None if info is None else info.runtime()


def _runtimes(params) -> list[DmuonRuntime]:
    seen: dict[int, DmuonRuntime] = {}
    for p in params:
        rt = get_runtime(p)
        if rt is not None:
            seen.setdefault(id(rt), rt)
    return list(seen.values())


def wait_pending(params) -> None:
    """Before ``step()``: finish in-flight gradient reduces of every runtime owning ``params``.

    Raises:
        RuntimeError: local gradients of dedicated matrices were never reduced (every backward
            since the last step ran inside ``dmuon.no_sync``): the step would silently skip them.
    """
    for rt in _runtimes(params):
        rt.finish_reduces()
        stale = [s.fqn for b in rt.boundaries for s in b.slots if s.compute.grad is not None]
        if stale:
            raise RuntimeError(
                f"dmuon: step() with unreduced gradients of {len(stale)} dedicated matrices "
                f"(e.g. {stale[0]!r}): every backward since the last step ran inside dmuon.no_sync "
                "(or with FSDP2's requires_gradient_sync False). Run the last micro-batch's backward "
                "outside the context so the accumulated gradients are reduced once."
            )


def after_step(params) -> None:
    """Post-step work of every runtime owning one of ``params`` (HSDP replicate broadcast)."""
    for rt in _runtimes(params):
        rt.after_step()


@contextlib.contextmanager
def no_sync(model: nn.Module):
    """Defer gradient reduces (dmuon's and FSDP2's) for the backward passes inside the context.

    Gradient accumulation without communication: every rank keeps its full local gradient of
    every dedicated matrix (+ the dedicated bytes of memory on non-owners) and FSDP2 keeps its
    unsharded gradients; the first backward outside the context reduces the accumulated sum
    once. Without the context each micro-batch reduces and owners accumulate the averages
    (traffic x micro-batches, no extra memory). Either way the optimizer step runs one
    Newton-Schulz per matrix. FSDP2's ``set_requires_gradient_sync(False)`` is honoured too.
    """
    rt = getattr(model, "_dmuon_runtime", None)
    if rt is None:
        raise ValueError("dmuon.no_sync: the model has no dedicated parameters (call dmuon.dedicate_params first)")
    fsdp = getattr(model, "set_requires_gradient_sync", None)
    prev = rt.requires_gradient_sync
    prev_fsdp = _fsdp_requires_gradient_sync(model)
    rt.requires_gradient_sync = False
    if fsdp is not None:
        fsdp(False)
    try:
        yield
    finally:
        rt.requires_gradient_sync = prev
        if fsdp is not None:
            fsdp(prev_fsdp)
