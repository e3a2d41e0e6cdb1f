"""One hook boundary's state machine: unshard, install, reshard and reduce around its hooks.

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
                       owner; the owner divides by ``R·N`` (or by FSDP2's gradient divide
                       factor when one is set); free non-held storage
end of backward        (autograd final callback, :class:`~dmuon.exec._runtime.runtime.DmuonRuntime`)
                       reduce boundaries not yet reduced, wait for every reduce, read all owned
                       presence flags at once (one host sync), copy or add the averaged
                       gradients into the owners' ``.grad`` (never a view of the reduce
                       buffer), release the reduce buffers' storage
=====================  =====================================================================

Every rank issues the same collectives in the same order whatever its data: a compute parameter
without gradient contributes zeros and a 0 flag, and an owner leaves ``.grad`` as ``None`` only
when every rank's flag was 0, i.e. exactly when single-process ``torch.optim.Muon`` would skip
the matrix.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import weakref
from collections.abc import Callable

import optree
import torch
import torch.nn as nn

from dmuon.exec._comm import collective_calls as C
from dmuon.exec._setup import fsdp2
from dmuon.exec._runtime.boundary_host import BoundaryHost
from dmuon.exec._runtime.packed_buffers import _Segment
from dmuon.exec._runtime.gather_buffers import _GatherBuffer, _owned_views
from dmuon.exec._runtime.program import ONE_RANK, BoundaryOps
from dmuon.exec._runtime.streams import _on_stream, current_stream

__all__ = ["ShardedState", "TrainingState"]


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


class _BoundaryRuntime:
    """The hooks of one hook boundary and its two states.

    ``sharded_state`` (:class:`ShardedState`): ``RESHARDED`` between uses; pre-forward posts the
    broadcasts (``UNSHARDING``, also when the previous boundary prefetches them) and waits
    (``UNSHARDED``); post-forward reshards under Z3 (``reshard_after_forward=True``) and stays
    ``UNSHARDED`` under Z2 until this boundary's backward, whose pre-backward then finds the
    buffers resident; post-backward reshards. ``training_state`` (:class:`TrainingState`):
    whether compute parameters are installed. ``uses``: the grad-enabled forwards whose backward
    has not finished (:class:`_Use`; a boundary called twice per forward is reduced after its
    last).

    Under a pipeline schedule (``runtime.pipelined``) several micro-batches' forwards run before
    their backwards, each backward in its own autograd call, and the schedule reduces once per
    step (:meth:`DmuonRuntime.finish_pipeline_step`): the end of one backward finishes only the
    uses it ran; Z3 frees after every forward and after every use's backward (each micro-batch
    broadcasts twice), Z2 keeps the buffers from the step's first forward until the step's
    reduce (one broadcast per step).
    """

    def __init__(self, runtime: BoundaryHost, fqn: str, module: nn.Module, segments: list[_Segment], ops: BoundaryOps):
        self.runtime_ref: Callable[[], BoundaryHost | None] = weakref.ref(runtime)  # only what BoundaryHost lists
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
        # the step check: who sent each received step code, in _received_codes() order
        self.round_senders = self._round_senders()
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
        self.index = 0  # position in the runtime's boundary order (set by the runtime)
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
        rt = self.runtime_ref()
        if self.sharded_state is ShardedState.RESHARDED:
            bops = self.ops.broadcast(phase)
            if not bops and rt.num_shards > 1:
                raise RuntimeError(
                    f"dmuon: boundary {self.fqn!r} needs its parameters for the backward but was freed after "
                    "its forward under reshard_after_forward=False (Z2), whose step has no backward broadcast; "
                    "was the forward run twice with its backward in between? Use reshard_after_forward=True"
                )
            rt.wait_replicate_broadcasts(self)  # HSDP: the holder's value must be current
            stream = rt.comm_stream("broadcast")  # None on CPU
            for seg in self.segments:
                if (
                    not seg.held and seg.gather is None
                ):  # regrown on the compute stream: the allocator keeps it stream-ordered
                    seg.wire.untyped_storage().resize_(seg.numel * seg.wire.element_size())
                    seg.resident = True
            for gb in self.gathers:
                gb.grow()
            if stream is not None:  # masters written by the optimizer, storage last read by compute
                stream.wait_stream(current_stream(stream.device))
            code = self._step_code(phase)
            with _on_stream(stream):
                for seg in self.segments:
                    if seg.held:
                        self._copy_masters_to_wire(seg)
                        if (
                            bops and seg.gather is None
                        ):  # the flag slots carry (step, phase, forward); receivers compare
                            for sub in seg.subs:
                                seg.wire[sub.flags_offset_in_seg : sub.flags_offset_in_seg + len(sub.slots)] = code
                for gb in self.gathers:  # the own slot: the held segment (all-gathered in place) and the code
                    own = gb.slot(gb.my_slot)
                    if gb.held is not None:
                        own[: gb.held.numel].copy_(gb.held.wire)
                    own[gb.slot_numel - 1] = code
                works = self._issue(bops, rt)
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
                rt.wait(
                    works,
                    f"boundary {self.fqn!r} {self._inflight_phase}",
                    boundary=self,
                    group=next(iter(groups.values())) if len(groups) == 1 else None,
                )
            if stream is not None:  # the compute stream waits before the parameters are used
                current_stream(stream.device).wait_event(stream.record_event())
            self.sharded_state = ShardedState.UNSHARDED
            self._check_rounds(self._inflight_phase)
            self._assemble_grouped()

    def _issue(self, bops, rt) -> list:
        """Post ``bops`` in order (async): an all-gather per all-gathered buffer (this rank's slot
        of the gathered tensor is its input, in place), and each run of consecutive broadcasts
        on one group as one coalesced group where the backend coalesces
        (:func:`~dmuon.exec._comm.collective_calls.broadcast_many`). Returns the works."""
        works: list = []
        i = 0
        while i < len(bops):
            b = bops[i]
            gb = b.gather
            if gb is not None:
                works.append(
                    C.all_gather_into(gb.gathered, gb.slot(gb.my_slot), group=b.group, phase=b.op.phase, async_op=True)
                )
                i += 1
                continue
            j = i + 1
            while j < len(bops) and bops[j].gather is None and bops[j].group is b.group:
                j += 1
            items = [(x.segment.wire, x.root) for x in bops[i:j]]
            works += C.broadcast_many(items, group=b.group, phase=b.op.phase, coalesce=rt.coalesces(b.group))
            i = j
        return works

    def _step_code(self, phase: str) -> float:
        rt = self.runtime_ref()
        return step_code(rt.steps_done, phase == "backward_broadcast", self.forwards_since_step)

    def _round_senders(self) -> list[int]:
        """Global rank that sent each code of :meth:`_received_codes`: the root of each received
        broadcast segment, then per all-gathered buffer every other member of the group."""
        rt = self.runtime_ref()
        g = rt.groups
        out = [g.rank_of(g.replicate, seg.shard) for seg in self.segments if not seg.held and seg.gather is None]
        for gb in self.gathers:
            out += [g.rank_of(g.replicate, s) for j, s in enumerate(gb.group_shards) if j != gb.my_slot]
        return out

    def _received_codes(self) -> list[torch.Tensor]:
        """The step codes this rank received (views): a received broadcast segment's first flag
        slot, and every other member's slot trailer of each all-gathered buffer."""
        parts = [
            seg.wire[seg.subs[0].flags_offset_in_seg].reshape(1)
            for seg in self.segments
            if not seg.held and seg.gather is None
        ]
        for gb in self.gathers:
            codes = gb.codes()
            parts += [codes[: gb.my_slot], codes[gb.my_slot + 1 :]]
        return parts

    def _check_rounds(self, phase: str) -> None:
        """Every received step code (a broadcast segment's flag slots, an all-gathered slot's
        trailer: every member writes one, owner or not) must be this rank's own
        :func:`step_code` (optimizer step, phase, forward index): a sender on another step or
        phase (a rank that skipped or repeated a forward, backward or optimizer step) is reported
        here on CPU; on an accelerator the comparison stays on the device and the runtime checks
        it once per optimizer step (one host sync)."""
        if not self.round_senders:
            return
        got = torch.cat(self._received_codes())
        expected = self._step_code(phase)
        if got.device.type != "cpu":
            self.runtime_ref().defer_round_check(self, phase, got, expected)
        elif not bool((got == expected).all()):  # host memory: no sync; the values are read on a mismatch only
            self.raise_if_out_of_step(phase, got.tolist(), expected)

    def raise_if_out_of_step(self, phase: str, got: list, expected: float) -> None:
        """Raise :class:`RanksOutOfStep` naming both sides when a received round differs."""
        rt = self.runtime_ref()
        for holder, value in zip(self.round_senders, got):
            if value != expected:
                me = rt.groups.rank_of(rt.groups.replicate, rt.groups.shard)
                raise RanksOutOfStep(
                    f"dmuon: ranks out of step at boundary {self.fqn!r}: this rank (global rank {me}) is at "
                    f"{describe_code(expected)} (optimizer steps done: {rt.steps_done}), but global rank {holder}, "
                    f"whose broadcast or all-gather slot it received, is at {describe_code(value)}: one of them "
                    "skipped or repeated a forward, a backward or an optimizer step. Every rank must run the same "
                    "forwards, backwards "
                    "and opt.step() calls in the same order (no rank-dependent skip, early exit or extra step)."
                )

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
            if not seg.held and seg.resident and seg.gather is None:
                seg.wire.untyped_storage().resize_(0)
                seg.resident = False
        for gb in self.gathers:
            if gb.resident:
                gb.release()
        for gm in self.grouped:
            if gm.resident:
                gm.release()
        self.sharded_state = ShardedState.RESHARDED

    @staticmethod
    def _copy_masters_to_wire(seg: _Segment) -> None:
        """Mixed precision: cast the full-precision masters into the broadcast-dtype segment."""
        if seg.master is not seg.wire:
            with torch.no_grad():
                seg.wire.copy_(seg.master)

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
        rt = self.runtime_ref()
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
        nxt = rt.boundary_after(self)
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
        keep_for_backward = not self.runtime_ref().reshard_after_forward and (grad or self.pending_backward > 0)
        if not keep_for_backward:
            self._reshard()
        use, self._forward_use = self._forward_use, None
        if grad and use is not None:
            tensors = [t for t in optree.tree_leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad]
            if tensors:
                hook = functools.partial(self._on_pre_backward, use)
                torch.autograd.graph.register_multi_grad_hook(tensors, hook, mode="any")
        return output

    def _check_fsdp_policy(self, module) -> None:
        """Report a ``fully_shard`` mixed-precision policy that differs from the plan's."""
        self._checked_fsdp_policy = True
        fsdp2.check_mp_policy(module, self.runtime_ref().plan, self.fqn)

    def _gradient_sync(self) -> bool:
        """``dmuon.no_sync`` / FSDP2's ``set_requires_gradient_sync(False)`` defer the reduce.

        FSDP2's flag is read from the boundary's own ``fully_shard`` unit and from the root's.
        """
        rt = self.runtime_ref()
        if not rt.requires_gradient_sync:
            return False
        return fsdp2.requires_gradient_sync(self.module) and fsdp2.requires_gradient_sync(rt.model_ref())

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
        rt = self.runtime_ref()
        rt.queue_final_callback()
        if not any(u is use for u in self.uses):  # finished already (e.g. by an earlier end of backward)
            return
        use.started = True
        self._unshard("backward_broadcast", wait=False)  # no-op in Z2: resident since the forward
        prev = rt.boundary_before(self)
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
            if self.runtime_ref().pipelined:
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
        if self.runtime_ref().reshard_after_forward:
            self._reshard()

    def finish_backward(self) -> None:
        """Called from the final callback: finish if the post-backward trigger never fired.

        Pipeline schedules: only the uses whose backward ran in this autograd call (their
        pre-backward fired) are done; the later micro-batches' uses stay in flight."""
        if not self.uses:
            return
        if not self.runtime_ref().pipelined:
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
        if self._gradient_sync():
            self._launch_reduce()
        else:
            # no_sync micro-batch: every rank keeps its full local gradient in the compute
            # parameters' .grad (autograd accumulates the next micro-batch into it)
            self.unreduced = True
        rt = self.runtime_ref()
        if not (rt.pipelined and not rt.reshard_after_forward):  # pipeline Z2: resident until the step's reduce
            self._reshard()

    def finish_pipeline_step(self) -> None:
        """The pipeline schedule's reduce (its ``REDUCE_GRAD``): drop the uses whose backward never
        ran, put the logical parameters back, and reduce the gradients accumulated over the
        step's micro-batches (every rank of the mesh in the same order: whether a boundary is
        reduced depends on hook order only). Storage is freed by the caller."""
        self.uses = []
        self._restore()
        if self.unreduced:
            self._launch_reduce()

    # -- gradient reduce -------------------------------------------------------------------

    def _launch_reduce(self) -> None:
        """Pack the local gradients into the reduce buffers and reduce them: per broadcast
        segment its reduce buffer, SUM-reduced to its holder (runs on one group coalesced where
        the backend coalesces); per all-gathered buffer ``rs_in`` (every segment at its slot),
        reduce-scattered into this rank's slot ``rs_out``.

        The buffer tensors are reused (storage regrown, zeroed, rewritten), so a reduce still in
        flight on one (the same boundary finishing twice before the end of the backward) is
        finished first. CUDA: the packing and the reduce are ordered after the compute stream on
        the reduce stream; the local gradients stay referenced until
        :meth:`DmuonRuntime.finish_reduces` waits for that stream.
        """
        rt = self.runtime_ref()
        self.unreduced = False
        if any(seg.reduce_inflight for seg in self.segments) or any(gb.reduce_inflight for gb in self.gathers):
            rt.finish_reduces()
        stream = rt.comm_stream("reduce")  # None on CPU
        # (re)grow the buffers on the compute stream, as FSDP2 allocates its reduce-scatter input
        bufs = [
            self._reduce_buffer(b.segment) if b.gather is None else b.gather.reduce_buffers()[0]
            for b in self.ops.reduce
        ]
        if stream is not None:  # the gradients were produced on the compute stream
            stream.wait_stream(current_stream(stream.device))
        with _on_stream(stream):
            keeps = []
            for b, buf in zip(self.ops.reduce, bufs):
                buf.fill_(0)
                keep: list = []
                gb = b.gather
                if gb is None:
                    self._pack(b.segment, buf, 0, keep, stream)
                else:
                    for j, seg in enumerate(gb.segments):
                        if seg is not None:
                            self._pack(seg, buf, j * gb.slot_numel, keep, stream)
                keeps.append(keep)
            if rt.check_nonfinite and bufs:  # skip_nonfinite: this rank's gradients, before the reduce
                rt.note_reduce_input(bufs)
            i = 0
            ops = self.ops.reduce
            while i < len(ops):
                b = ops[i]
                gb = b.gather
                if gb is not None:
                    work = C.reduce_scatter_into(gb.rs_out, bufs[i], group=b.group, phase=b.op.phase, async_op=True)
                    gb.reduce_inflight = True
                    rt.pending_reduces.append(_PendingReduce(self, gb.held, gb.rs_out, [work], keeps[i], gb))
                    i += 1
                    continue
                j = i + 1
                while j < len(ops) and ops[j].gather is None and ops[j].group is b.group:
                    j += 1
                if b.group is ONE_RANK:  # an efsdp group of one rank: the buffer is already the sum
                    works = []
                else:
                    items = [(bufs[q], ops[q].root) for q in range(i, j)]
                    works = C.reduce_many(items, group=b.group, phase=b.op.phase, coalesce=rt.coalesces(b.group))
                for q in range(i, j):  # the run's works (one when coalesced) ride on its first segment
                    seg = ops[q].segment
                    seg.reduce_inflight = True
                    rt.pending_reduces.append(
                        _PendingReduce(self, seg, bufs[q], works if q == i else [], keeps[q], None)
                    )
                i = j
            for gm in self.grouped:  # every block packed: the full local gradient is done with
                gm.compute.grad = None
        # HSDP: the boundaries reduced before this one, their shard reduces launched one boundary's
        # backward ago, go on to their replicate reduces now rather than all after the backward
        rt.issue_replicate_reduces(self)

    @staticmethod
    def _pack(seg: _Segment, buf: torch.Tensor, base: int, keep: list, stream) -> None:
        """Write ``seg``'s local gradients into ``buf`` at ``base`` + their offsets in the segment,
        and a presence flag 1 for each one present (zeros stay where a compute parameter has no
        gradient); a matrix's compute gradient is dropped once packed."""
        for sub in seg.subs:
            for k, slot in enumerate(sub.slots):
                gm = slot.grouped
                g = slot.compute.grad if gm is None else gm.compute.grad
                if g is None:
                    continue
                if slot.tp is not None:
                    g = slot.tp.local(g)
                if gm is not None:  # this block of the grouped matrix's full gradient
                    g = g.narrow(gm.info.dim, gm.info.compute_offset(slot.block), gm.info.sizes[slot.block])
                start = base + slot.offset_in_seg
                buf[start : start + slot.numel].view(slot.shape).copy_(g)
                buf[base + sub.flags_offset_in_seg + k] = 1
                if stream is not None:
                    keep.append(g)
                if gm is None:
                    slot.compute.grad = None

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
            seg.reduce_buf = buf
            seg.owned = _owned_views(seg, buf)
        else:
            buf.untyped_storage().resize_(seg.numel * buf.element_size())
        return buf


@dataclasses.dataclass(eq=False)
class _PendingReduce:
    """A launched gradient reduce, until :func:`~dmuon.exec._runtime.reduces.finish_reduces`:
    its ``boundary``, the held ``segment`` whose owned sub-segments it delivers (None: this rank
    holds nothing in an all-gathered buffer), the reduce buffer ``buf`` laid out as that segment
    (a broadcast segment's, or an all-gathered buffer's ``rs_out``), the ``works`` to wait for,
    the local gradients to ``keep`` referenced until then (CUDA), and the ``gather`` buffer of a
    reduce-scatter (its ``rs_in`` is released after the wait); ``replicated`` once
    :func:`~dmuon.exec._runtime.reduces.issue_replicate_reduces` has taken it."""

    boundary: "_BoundaryRuntime"
    segment: _Segment | None
    buf: torch.Tensor
    works: list
    keep: list
    gather: _GatherBuffer | None
    replicated: bool = False  # HSDP: its works waited for and its replicate reduces issued


class RanksOutOfStep(RuntimeError):
    """Ranks disagree on how many broadcast rounds a boundary has run (a rank skipped or
    repeated a forward, backward or optimizer step); raised on the ranks that see it."""


_STEP_MOD, _FORWARD_MOD = 32, 4  # codes 1..256: integers every wire dtype holds exactly (bf16: up to 256)


def step_code(steps_done: int, backward: bool, forwards_since_step: int) -> float:
    """The value a holder writes into its segment's flag slots before a broadcast, and every
    receiver compares with its own: ``1 + (steps mod 32) * 8 + backward * 4 + (forwards mod 4)``
    (1..256, exact in bf16, fp16 and fp32). ``forwards_since_step``: grad-enabled forwards of
    the boundary since the last optimizer step, counted before this forward. The flag slots are
    already part of every segment (the reduce's gradient-presence flags), so the check moves no
    extra byte and the plan's byte counts are unchanged."""
    return float(1 + (steps_done % _STEP_MOD) * 8 + int(backward) * 4 + forwards_since_step % _FORWARD_MOD)


def describe_code(code: float) -> str:
    """``"optimizer step 3 (mod 32), forward broadcast of forward 1 (mod 4)"`` of a :func:`step_code`."""
    v = int(code) - 1
    step, rest = divmod(v, 8)
    phase = "backward" if rest >= 4 else "forward"
    return f"step {step} (mod {_STEP_MOD}), {phase} broadcast, after {rest % 4} forward(s) of this step (mod {_FORWARD_MOD})"


def _in_backward() -> bool:
    """True while autograd executes a backward pass on this thread (e.g. checkpoint recompute)."""
    return torch._C._current_graph_task_id() != -1
