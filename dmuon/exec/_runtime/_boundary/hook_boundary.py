"""One hook boundary's state machine: unshard, install, reshard and reduce around its hooks.

=====================  =====================================================================
phase                  what happens on this rank (mesh coordinate ``(r, s)``)
=====================  =====================================================================
pre-forward            one async broadcast per segment ``s'`` from ``(s', r)`` in the shard
                       group of replicate row ``r``; wait; install compute parameters
post-forward           restore the logical parameters; Z3 (or no-grad forward): free the
                       storage of every segment this rank does not hold, and its own
                       segments' broadcast copies where they are not the masters
pre-backward           Z3: broadcast again (into the same, regrown storage); install
post-backward          free non-held storage (as FSDP2 reshards before its reduce-scatter);
                       pack gradients into the segment's reduce buffer (one tensor per segment,
                       built once; its storage regrown and zeroed here, released once the
                       averages are out; zeros + presence flag 0 where a compute parameter has
                       no gradient), SUM-reduce each segment to its holder in the shard group;
                       HSDP: then SUM-reduce each sub-segment over the replicate group to its
                       owner; the owner divides by ``R·N`` (or by FSDP2's gradient divide
                       factor when one is set)
end of backward        (autograd final callback, :func:`_end_of_backward`, over every boundary)
                       reduce boundaries not yet reduced, wait for every reduce, read all owned
                       presence flags at once (one host sync), copy or add the averaged
                       gradients into the owners' ``.grad`` (never a view of the reduce
                       buffer), release the reduce buffers' storage
=====================  =====================================================================

Every rank issues the same collectives in the same order whatever its data: a compute parameter
without gradient contributes zeros and a 0 flag, and an owner leaves ``.grad`` as ``None`` only
when every rank's flag was 0, i.e. exactly when single-process ``torch.optim.Muon`` would skip
the matrix.

The boundaries of one model share a
:class:`~dmuon.exec._runtime._boundary.comm_context.BoundaryCommContext` (``comm_ctx``); the
broadcasts they send are in :mod:`~dmuon.exec._runtime._boundary.broadcast_send`, the reduce in
:mod:`~dmuon.exec._runtime._boundary.grad_reduce`, the step check in
:mod:`~dmuon.exec._runtime._boundary.step_check`.
"""

from __future__ import annotations

import enum
import functools
import weakref

import optree
import torch
import torch.nn as nn

from dmuon.exec._setup import fsdp2
from dmuon.exec._runtime.packed_buffers import _Segment
from dmuon.exec._runtime.streams import _on_stream, current_stream
from dmuon.exec._runtime._boundary import grad_reduce
from dmuon.exec._runtime._boundary.bound_ops import BoundaryOps
from dmuon.exec._runtime._boundary.broadcast_send import send_broadcasts
from dmuon.exec._runtime._boundary.comm_context import BoundaryCommContext
from dmuon.exec._runtime._boundary.step_check import boundary_code, check_rounds, round_senders

__all__ = ["HookBoundary", "ShardedState", "TrainingState", "eager_hook"]


class ShardedState(enum.Enum):
    """Where a boundary's non-held segments are (FSDP2's ``ShardedState``, plus the prefetch step).

    Every rank makes the same transitions (they depend on hook order only, never on data), so all
    ranks agree on which broadcasts run, in which order. Held segments are always resident.
    """

    RESHARDED = enum.auto()  # non-held segments have no storage
    UNSHARDING = enum.auto()  # storage regrown, broadcasts posted (a prefetch), not yet waited for
    UNSHARDED = enum.auto()  # every segment resident and current on this rank


class TrainingState(enum.Enum):
    """Which parameters the boundary's modules hold (FSDP2's ``TrainingState``)."""

    IDLE = enum.auto()  # the logical parameters (between steps, and between forward and backward)
    FORWARD = enum.auto()  # the compute parameters, from pre-forward to post-forward
    BACKWARD = enum.auto()  # the compute parameters, from pre-backward to post-backward (recompute included)


def eager_hook(fn):
    """``fn`` run eagerly, never traced, when called from a ``torch.compile``'d region — how
    FSDP2 registers its hooks (``torch._dynamo.disable(recursive=True)``).

    A block compiled with ``module.compile()`` / ``torch.compile(module)`` compiles
    ``Module._call_impl``, i.e. its forward hooks too. dmuon's hooks post collectives, wait on
    them, swap parameters and move Python state machines: nothing Dynamo should trace (it
    graph-broke five times per boundary inside them and warned on every rank). Disabled, the
    hook is one opaque call before and after the block's compiled graph, exactly as FSDP2's.
    """
    return torch._dynamo.disable(fn, recursive=True, reason="dmuon hook-boundary hooks (run eagerly, as FSDP2's)")


class _Use:
    """One grad-enabled forward of a boundary whose backward has not finished (its "use").

    ``started``: its pre-backward ran (the gradient reached the boundary's outputs). Several
    uses are in flight at once when a boundary is called twice per forward, or under a pipeline
    schedule that runs several micro-batches' forwards before their backwards."""

    __slots__ = ("started",)

    def __init__(self) -> None:
        self.started = False


class _PostBackward(torch.autograd.Function):
    """Identity on the boundary's forward inputs; its backward marks the use's backward done.

    Autograd runs a node once all its inputs' gradients are ready, and runs ``AccumulateGrad``
    nodes as soon as they are ready, so by the time gradients w.r.t. the boundary's inputs are
    produced, every parameter gradient inside it has been accumulated.
    """

    @staticmethod
    def forward(ctx, boundary_ref, use, *tensors):
        ctx.boundary_ref = boundary_ref
        ctx.use = use
        return tensors if len(tensors) != 1 else tensors[0]

    @staticmethod
    def backward(ctx, *grads):
        boundary = ctx.boundary_ref()
        if boundary is not None:
            boundary._on_post_backward(ctx.use)
        return (None, None, *grads)


class HookBoundary:
    """The hooks of one hook boundary and its two states.

    ``sharded_state`` (:class:`ShardedState`): ``RESHARDED`` between uses; pre-forward posts the
    broadcasts (``UNSHARDING``, also when the previous boundary prefetches them) and waits
    (``UNSHARDED``); post-forward reshards under Z3 (``reshard_after_forward=True``) and stays
    ``UNSHARDED`` under Z2 until this boundary's backward, whose pre-backward then finds the
    buffers resident; post-backward reshards. ``training_state`` (:class:`TrainingState`):
    whether compute parameters are installed. ``uses``: the grad-enabled forwards whose backward
    has not finished (:class:`_Use`; a boundary called twice per forward is reduced after its
    last).

    ``comm_ctx``: what the model's boundaries share (settings, prefetch order, pending reduces,
    streams), FSDP2's ``FSDPParamGroup.comm_ctx``.

    Under a pipeline schedule (``comm_ctx.pipelined``) several micro-batches' forwards run before
    their backwards, each backward in its own autograd call, and the schedule reduces once per
    step (:meth:`DmuonRuntime.finish_pipeline_step`): the end of one backward finishes only the
    uses it ran; Z3 frees after every forward and after every use's backward (each micro-batch
    broadcasts twice), Z2 keeps the buffers from the step's first forward until the step's
    reduce (one broadcast per step).
    """

    def __init__(
        self, comm_ctx: BoundaryCommContext, fqn: str, module: nn.Module, segments: list[_Segment], ops: BoundaryOps
    ):
        self.comm_ctx = comm_ctx
        self.fqn = fqn
        self.module = module
        self.segments = segments
        self.ops = ops  # this rank's collectives per phase, from the plan's schedule
        self.slots = [slot for seg in segments for slot in seg.slots]
        # matrices owned by owner groups: their blocks are slots above (no module homes); the
        # modules see each one's assembled full compute parameter
        self.grouped = list({id(s.grouped): s.grouped for s in self.slots if s.grouped is not None}.values())
        # what the modules hold during forward / backward: the slots of matrices with one owner,
        # and the grouped matrices (their blocks have no homes); the objects stay, their tensors
        # may be rebound (dmuon.exec._setup.materialize)
        self.installable = [s for s in self.slots if s.grouped is None] + self.grouped
        # all-gathered buffers (the plan's BufferLayout.collective): one gathered tensor each,
        # holding this rank's non-held segments of it
        self.gathers = list({id(seg.gather): seg.gather for seg in segments if seg.gather is not None}.values())
        # the step check: who sent each received step code, in the order this rank reads them
        self.round_senders = round_senders(self)
        self.uses: list[_Use] = []  # grad-enabled forwards whose backward has not finished
        self._forward_use: _Use | None = None  # the use of the forward between pre- and post-forward
        self.unreduced = False  # local gradients accumulated under no_sync / a pipeline schedule, not yet reduced
        self.sharded_state = ShardedState.RESHARDED
        self.training_state = TrainingState.IDLE
        # while UNSHARDING: the posted broadcasts, their phase, and (CUDA) the broadcast stream
        # whose queued work the compute stream has not waited for yet
        self._inflight: list = []
        self._inflight_phase = ""
        self._inflight_stream = None
        self._checked_fsdp_policy = False
        self.index = 0  # position in comm_ctx.boundaries (set by the runtime)
        self.handles: list = []
        # step check: grad-enabled forwards of this boundary since the last optimizer step
        self.forwards_since_step = 0

    @property
    def pending_backward(self) -> int:
        """Grad-enabled forwards whose backward has not finished."""
        return len(self.uses)

    # -- storage ---------------------------------------------------------------------------

    def _unshard(self, phase: str, *, wait: bool = True) -> None:
        """Make every segment resident on this rank: the scheduled broadcasts of ``phase`` (one
        per segment; none on a one-rank shard group).

        ``RESHARDED`` -> ``UNSHARDING`` (broadcasts posted) -> ``UNSHARDED`` (waited for).
        ``wait=False`` only posts the broadcasts (prefetch); the boundary's own hook waits for
        them before the parameters are used.

        Raises:
            RuntimeError: Z2 (the schedule has no backward broadcast) and the boundary is
                resharded at its backward: its parameters could not be made current.
        """
        ctx = self.comm_ctx
        if self.sharded_state is ShardedState.RESHARDED:
            bops = self.ops.broadcast(phase)
            if not bops and ctx.num_shards > 1:
                raise RuntimeError(
                    f"dmuon: boundary {self.fqn!r} needs its parameters for the backward but was freed after "
                    "its forward under reshard_after_forward=False (Z2), whose step has no backward broadcast; "
                    "was the forward run twice with its backward in between? Use reshard_after_forward=True"
                )
            ctx.wait_replicate_broadcasts(self)  # HSDP: the holder's value must be current
            stream = ctx.comm_stream("broadcast")  # None on CPU
            for seg in self.segments:
                # regrown on the compute stream: the allocator keeps it stream-ordered; a held
                # segment's own broadcast copy (mixed precision, offload) is rewritten from its
                # masters before it is sent (write_broadcast_source)
                if (not seg.held and seg.gather is None) or _own_copy(seg):
                    seg.wire.untyped_storage().resize_(seg.numel * seg.wire.element_size())
                    seg.resident = True
            for gb in self.gathers:
                gb.grow()
            if stream is not None:  # masters written by the optimizer, storage last read by compute
                stream.wait_stream(current_stream(stream.device))
            works = send_broadcasts(self, bops, boundary_code(self, phase), stream)
            self._inflight, self._inflight_phase, self._inflight_stream = works, phase, stream
            # nothing to wait for (one shard, off CUDA): unsharded at once
            self.sharded_state = ShardedState.UNSHARDING if works or stream is not None else ShardedState.UNSHARDED
            if self.sharded_state is ShardedState.UNSHARDED:
                self._assemble_grouped()
        if wait and self.sharded_state is ShardedState.UNSHARDING:
            works, stream = self._inflight, self._inflight_stream
            self._inflight, self._inflight_stream = [], None
            with _on_stream(stream):  # NCCL: the broadcast stream waits for the collectives
                groups = {id(b.group): b.group for b in self.ops.broadcast(self._inflight_phase)}
                ctx.wait(
                    works,
                    f"boundary {self.fqn!r} {self._inflight_phase}",
                    boundary=self,
                    group=next(iter(groups.values())) if len(groups) == 1 else None,
                )
            if stream is not None:  # the compute stream waits before the parameters are used
                current_stream(stream.device).wait_event(stream.record_event())
            self.sharded_state = ShardedState.UNSHARDED
            check_rounds(self, self._inflight_phase)
            self._assemble_grouped()

    def _assemble_grouped(self) -> None:
        """Owner groups: copy each grouped matrix's blocks (now resident) into its full compute
        parameter (on the compute stream, after the broadcasts)."""
        for gm in self.grouped:
            gm.assemble()

    def _reshard(self) -> None:
        """Free the storage of every segment this rank does not hold (the tensors stay valid).

        Storage is never freed under a collective still in flight: a prefetch is waited for first.
        """
        if self.sharded_state is ShardedState.UNSHARDING:
            self._unshard(self._inflight_phase)
        for seg in self.segments:
            if (not seg.held and seg.resident and seg.gather is None) or _own_copy(seg):
                seg.wire.untyped_storage().resize_(0)
                seg.resident = seg.held  # a held segment's masters stay
        for gb in self.gathers:
            if gb.resident:
                gb.release()
        for gm in self.grouped:
            if gm.resident:
                gm.release()
        self.sharded_state = ShardedState.RESHARDED

    # -- module attributes -----------------------------------------------------------------

    def _install(self, state: TrainingState) -> None:
        """Put the compute parameters into the modules (no-op when they are there already)."""
        if self.training_state is not TrainingState.IDLE:
            self.training_state = state
            return
        for slot in self.installable:
            if slot.compute.requires_grad != slot.logical.requires_grad:  # frozen / unfrozen since
                slot.compute.requires_grad_(slot.logical.requires_grad)
            for module, attr in slot.homes:
                module._parameters[attr] = slot.compute
        self.training_state = state

    def _restore(self) -> None:
        """Put the logical parameters back (no-op when they are there already)."""
        if self.training_state is TrainingState.IDLE:
            return
        for slot in self.installable:
            for module, attr in slot.homes:
                module._parameters[attr] = slot.logical
        self.training_state = TrainingState.IDLE

    # -- hooks -----------------------------------------------------------------------------

    def pre_forward(self, module, args, kwargs):
        if _in_backward():
            # activation-checkpoint recomputation (the boundary itself, or an ancestor, was
            # checkpointed): the backward's parameters are already in place (pre-backward ran
            # when the gradient reached the recomputed region's output); count nothing, free nothing
            self._unshard("backward_broadcast")
            self._install(TrainingState.BACKWARD)
            return args, kwargs
        if not self._checked_fsdp_policy:
            self._check_fsdp_policy(module)
        self._unshard("forward_broadcast", wait=False)
        nxt = self.comm_ctx.boundary_after(self)
        if nxt is not None:  # prefetch: the next boundary's broadcasts overlap this compute
            nxt._unshard("forward_broadcast", wait=False)
        self._unshard("forward_broadcast")
        self._install(TrainingState.FORWARD)
        self._forward_use = None
        if torch.is_grad_enabled():
            self.forwards_since_step += 1
            use = self._forward_use = _Use()
            self.uses.append(use)
            args, kwargs = self._register_post_backward(args, kwargs, use)
        return args, kwargs

    def post_forward(self, module, args, kwargs, output):
        if _in_backward():  # recomputation: the parameters stay installed until post-backward
            return output
        self._restore()
        grad = torch.is_grad_enabled()
        # Z3 frees after every forward. Z2 stays UNSHARDED from the forward broadcast until this
        # boundary's backward when one is coming (this forward's, or an earlier one's); a no-grad
        # forward with no backward pending frees.
        keep_for_backward = not self.comm_ctx.reshard_after_forward and (grad or self.pending_backward > 0)
        if not keep_for_backward:
            self._reshard()
        use, self._forward_use = self._forward_use, None
        if grad and use is not None:
            tensors = [t for t in optree.tree_leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad]
            # one hook per output tensor, as FSDP2 registers its pre-backward (a multi-grad hook
            # costs ~12x more to register); the first to fire starts the use, the rest return
            hook = functools.partial(self._on_pre_backward, use)
            for t in tensors:
                t.register_hook(hook)
        return output

    def _check_fsdp_policy(self, module) -> None:
        """Report a ``fully_shard`` mixed-precision policy that differs from the plan's."""
        self._checked_fsdp_policy = True
        fsdp2.check_mp_policy(module, self.comm_ctx.plan, self.fqn)

    def _gradient_sync(self) -> bool:
        """``dmuon.no_sync`` / FSDP2's ``set_requires_gradient_sync(False)`` defer the reduce.

        FSDP2's flag is read from the boundary's own ``fully_shard`` unit and from the root's.
        """
        ctx = self.comm_ctx
        if not ctx.requires_gradient_sync:
            return False
        return fsdp2.requires_gradient_sync(self.module) and fsdp2.requires_gradient_sync(ctx.model_ref())

    def _register_post_backward(self, args, kwargs, use: _Use):
        leaves, spec = optree.tree_flatten((args, kwargs))
        idx = [i for i, t in enumerate(leaves) if isinstance(t, torch.Tensor) and t.requires_grad]
        if not idx:
            return args, kwargs
        outs = _PostBackward.apply(weakref.ref(self), use, *[leaves[i] for i in idx])
        if len(idx) == 1:
            outs = (outs,)
        for i, o in zip(idx, outs):
            leaves[i] = o
        return optree.tree_unflatten(spec, leaves)

    def _on_pre_backward(self, use: _Use, *unused) -> None:
        _queue_end_of_backward(self.comm_ctx)
        if use.started or not any(u is use for u in self.uses):  # started by another output's hook, or
            return  # finished already (e.g. by an earlier end of backward)
        use.started = True
        self._unshard("backward_broadcast", wait=False)  # no-op in Z2: resident since the forward
        prev = self.comm_ctx.boundary_before(self)
        if prev is not None and prev.pending_backward > 0:  # prefetch for the next backward
            prev._unshard("backward_broadcast", wait=False)
        self._unshard("backward_broadcast")
        self._install(TrainingState.BACKWARD)

    def _on_post_backward(self, use: _Use) -> None:
        n = len(self.uses)
        self.uses = [u for u in self.uses if u is not use]
        if len(self.uses) == n:  # finished already
            return
        if self.uses:
            if self.comm_ctx.pipelined:
                self._end_use()
            return
        self._finish()

    def _end_use(self) -> None:
        """Pipeline schedules: a use's backward is done and other uses (later micro-batches) are
        still in flight. Unless another use's backward is running now (the boundary called twice
        in one micro-batch), put the logical parameters back and, under Z3, free the buffers: the
        next use's backward broadcasts again."""
        if any(u.started for u in self.uses):
            return
        self._restore()
        if self.comm_ctx.reshard_after_forward:
            self._reshard()

    def finish_backward(self) -> None:
        """Called from the final callback: finish if the post-backward trigger never fired.

        Pipeline schedules: only the uses whose backward ran in this autograd call (their
        pre-backward fired) are done; the later micro-batches' uses stay in flight."""
        if not self.uses:
            return
        if not self.comm_ctx.pipelined:
            self._finish()
            return
        n = len(self.uses)
        self.uses = [u for u in self.uses if not u.started]
        if not self.uses:
            self._finish()
        elif len(self.uses) < n:
            self._end_use()

    def _finish(self) -> None:
        self.uses = []
        self._restore()
        ctx = self.comm_ctx
        # free the received copies before the reduce buffers grow, as FSDP2 reshards before its
        # reduce-scatter: the local gradients are tensors of their own, the copies are done with
        if not (ctx.pipelined and not ctx.reshard_after_forward):  # pipeline Z2: resident until the step's reduce
            self._reshard()
        if self._gradient_sync():
            self._launch_reduce()
        else:
            # no_sync micro-batch: every rank keeps its full local gradient in the compute
            # parameters' .grad (autograd accumulates the next micro-batch into it)
            self.unreduced = True

    def finish_pipeline_step(self) -> None:
        """The pipeline schedule's reduce (its ``REDUCE_GRAD``): drop the uses whose backward never
        ran, put the logical parameters back, and reduce the gradients accumulated over the
        step's micro-batches (every rank of the mesh in the same order: whether a boundary is
        reduced depends on hook order only). A boundary it reduces is resharded first; the caller
        frees the rest."""
        self.uses = []
        self._restore()
        if self.unreduced:
            self._reshard()  # the received copies go before the reduce buffers grow
            self._launch_reduce()

    def _launch_reduce(self) -> None:
        """Pack the local gradients and reduce them to their owners
        (:func:`~dmuon.exec._runtime._boundary.grad_reduce.launch_reduce`)."""
        grad_reduce.launch_reduce(self)


def _own_copy(seg) -> bool:
    """A held segment whose broadcast buffer is a tensor of its own beside its masters (another
    dtype under mixed precision, or another device under offload): like a received copy, it
    lives only while its boundary is unsharded."""
    return seg.held and seg.wire is not seg.master


def _queue_end_of_backward(ctx: BoundaryCommContext) -> None:
    """Queue :func:`_end_of_backward` once per backward (FSDP2's root post-backward callback)."""
    if ctx.final_callback_queued:
        return
    ctx.final_callback_queued = True
    torch.autograd.Variable._execution_engine.queue_callback(functools.partial(_end_of_backward, ctx))


def _end_of_backward(ctx: BoundaryCommContext) -> None:
    """The autograd final callback: every boundary, last first, finishes the uses whose backward
    ran (reducing where the post-backward trigger never fired), every reduce is waited for and
    the owners' gradients written; then the boundaries still resident are resharded."""
    ctx.final_callback_queued = False
    for b in reversed(ctx.boundaries):
        b.finish_backward()
    grad_reduce.finish_reduces(ctx)
    if ctx.pipelined and not ctx.reshard_after_forward:
        return  # pipeline Z2: every boundary stays resident until the step's reduce
    # a boundary prefetched but not called in this forward (e.g. a skipped layer) waits for
    # its broadcasts and frees its copies: every step starts with every boundary resharded
    # (under a pipeline schedule: those with no backward left running; a boundary whose
    # later micro-batches are in flight is resharded too under Z3, its next use re-broadcasts)
    for b in ctx.boundaries:
        if b.sharded_state is not ShardedState.RESHARDED and not any(u.started for u in b.uses):
            b._reshard()


def _in_backward() -> bool:
    """True while autograd executes a backward pass on this thread (e.g. checkpoint recompute)."""
    return torch._C._current_graph_task_id() != -1
