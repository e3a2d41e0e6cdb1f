"""What one model's hook boundaries share: :class:`BoundaryCommContext`.

FSDP2's pattern (``FSDPCommContext``, held by every ``FSDPParamGroup`` of a root): one object,
built by :class:`~dmuon.exec._runtime.runtime.DmuonRuntime` and referenced by each of its
:class:`~dmuon.exec._runtime._boundary.hook_boundary.HookBoundary`, holds the settings fixed at
``apply``, the state that spans boundaries (prefetch order, pending reduces, step count, the
flags the runtime's owners set) and the streams. The boundaries read and write it directly; the
runtime reads the same fields through it, so each fact has one home and the boundary package
never imports the runtime.
"""

from __future__ import annotations

import weakref

import torch

from dmuon.exec._comm import collective_calls as C
from dmuon.exec._runtime import streams
from dmuon.exec._runtime._boundary.step_check import raise_if_out_of_step

__all__ = ["BoundaryCommContext"]


class BoundaryCommContext:
    """The settings, shared state and streams of one model's hook boundaries (module docstring)."""

    def __init__(self, plan, groups, device: torch.device, model, *, timeout_s: float | None, use_streams: bool):
        # -- settings, fixed at apply (device: until the storage moves) ----------------------------
        self.plan = plan  # the ShardingPlan: the fully_shard mixed-precision policy is checked against it
        self.groups = groups  # dmuon's process groups (dmuon.exec._comm.groups.MeshGroups)
        self.num_shards = groups.shape[1]  # N
        self.world_numel = groups.shape[0] * groups.shape[1]  # R·N: the default gradient divisor
        self.reshard_after_forward = bool(plan.reshard_after_forward)  # Z3 (True) or Z2
        self.model_ref = weakref.ref(model)  # the model (weak): FSDP2's gradient-sync flag and divide factor
        self.device = device
        self.timeout_s = timeout_s  # seconds a dmuon wait may take where it blocks the CPU (None: no timeout)
        self.use_streams = bool(use_streams)  # accelerators: dmuon's broadcast / reduce streams
        self.use_coalescing = True  # a list of broadcasts / reduces on one group as one coalesced group
        # -- the boundaries, in plan (module registration) order: the prefetch order -------------
        self.boundaries: list = []
        # -- state -----------------------------------------------------------------------------
        self.steps_done = 0  # optimizer steps seen: part of the step check's code
        self.requires_gradient_sync = True  # False inside dmuon.no_sync: the post-backward defers the reduce
        # under a torch.distributed.pipelining schedule (dedicate_params(pipeline=...), the schedule's
        # first step): several micro-batches in flight, one reduce per step in its REDUCE_GRAD
        self.pipelined = False
        # dmuon.Muon(skip_nonfinite=True): check every reduce buffer packed here (this rank's local
        # gradients, before the reduce); a 0-d bool tensor since the last step, None before any
        self.check_nonfinite = False
        self.nonfinite_before_reduce: torch.Tensor | None = None
        self.pending_reduces: list = []  # grad_reduce._PendingReduce: the post-backward appends, finish drains
        self.replicate_reduce_works: list = []  # HSDP: (boundary, work, group) issued, waited by finish_reduces
        self.pending_replicate: dict[int, list] = {}  # HSDP: post-step replicate broadcasts by boundary index
        self.deferred_rounds: list = []  # accelerators: received step codes, compared once per optimizer step
        self.final_callback_queued = False  # the end-of-backward callback is queued for this backward
        self.flag_host_reads = 0  # host reads of presence flags (one per finish_reduces with owned grads)
        # 1-D: owners' averaged gradients taken out of reduce buffers released before the end of
        # the backward (grad_reduce.retire_reduces_before), waiting for finish_reduces' one flag read
        self.staged_grads: list = []
        self._streams = None  # (device, {"broadcast": Stream, "reduce": Stream}), built on first use
        self._coalesces: dict = {}  # (id(group), device) -> the backend coalesces (asked once)

    # -- prefetch order --------------------------------------------------------------------------

    def boundary_after(self, b):
        """Forward prefetch target: the next boundary in plan order, or None."""
        i = b.index + 1
        return self.boundaries[i] if i < len(self.boundaries) else None

    def boundary_before(self, b):
        """Backward prefetch target: the previous boundary in plan order, or None."""
        return self.boundaries[b.index - 1] if b.index > 0 else None

    # -- streams, coalescing, waits ----------------------------------------------------------------

    def comm_stream(self, kind: str):
        """On an accelerator: dmuon's ``"broadcast"`` or ``"reduce"`` stream; ``None`` on CPU or with
        ``use_streams=False`` (:func:`dmuon.exec._runtime.streams.comm_stream`)."""
        return streams.comm_stream(self, kind)

    def coalesces(self, group) -> bool:
        """Whether the broadcasts / reduces of one list on ``group`` go as one coalesced group:
        :attr:`use_coalescing` and the group's backend on this device supports it
        (:func:`dmuon.exec._comm.collective_calls.coalescing_supported`; never gloo), asked once per group."""
        if not self.use_coalescing:
            return False
        key = (id(group), self.device)
        found = self._coalesces.get(key)
        if found is None:
            found = self._coalesces[key] = C.coalescing_supported(group, self.device)
        return found

    def wait(self, works, what: str, *, boundary=None, group=None) -> None:
        """Wait for ``works`` through :func:`dmuon.exec._comm.collective_calls.wait_all` with this
        model's timeout where the wait blocks the CPU, its optimizer steps done and ``boundary``'s
        grad-enabled forwards since the last step (quoted by a failure)."""
        C.wait_all(
            works,
            what=what,
            timeout_s=C.blocking_timeout_s(self.timeout_s, self.device, group),
            step=self.steps_done,
            forwards=None if boundary is None else boundary.forwards_since_step,
            group=group,
        )

    def wait_replicate_broadcasts(self, boundary=None) -> None:
        """HSDP: wait for the post-step replicate broadcasts of ``boundary`` (all when ``None``)
        before its next unshard (:mod:`dmuon.exec._runtime.replicas` posts them)."""
        if not self.pending_replicate:
            return
        keys = list(self.pending_replicate) if boundary is None else [boundary.index]
        for key in keys:
            works = self.pending_replicate.pop(key, None)
            if works:
                b = self.boundaries[key]
                what = f"boundary {b.fqn!r} replicate_broadcast (after step)"
                self.wait(works, what, boundary=b, group=self.groups.replicate_group)

    # -- checks deferred to the step ---------------------------------------------------------------

    def defer_round_check(self, boundary, phase: str, got: torch.Tensor, expected: float) -> None:
        """Accelerators: keep a boundary's received step codes on the device; compared once per
        optimizer step (one host sync) by :meth:`check_deferred_rounds`."""
        self.deferred_rounds.append((boundary, phase, got, expected))

    def check_deferred_rounds(self) -> None:
        if not self.deferred_rounds:
            return
        pending, self.deferred_rounds = self.deferred_rounds, []
        values = torch.cat([got for _, _, got, _ in pending]).tolist()  # the one host sync
        at = 0
        for boundary, phase, got, expected in pending:
            raise_if_out_of_step(boundary, phase, values[at : at + got.numel()], expected)
            at += got.numel()

    def note_reduce_input(self, bufs) -> None:
        """``skip_nonfinite``: remember whether a reduce buffer this rank packed (its local
        gradients, before the reduce) holds a non-finite value; device tensors, no host sync."""
        bad = torch.stack([~torch.isfinite(b).all() for b in bufs]).any()
        prev = self.nonfinite_before_reduce
        self.nonfinite_before_reduce = bad if prev is None else prev | bad.to(prev.device)
