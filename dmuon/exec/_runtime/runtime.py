"""The runtime of one model: its hook boundaries, reduce completion, HSDP replicas and streams.

`DmuonRuntime` owns one :class:`~dmuon.exec._runtime._boundary.hook_boundary.HookBoundary` per hook
boundary, builds the comm context they share, and does what spans boundaries (the end of the
backward, pipelining's gradient reduce, the HSDP replica broadcasts after the step), delegating to
:mod:`~dmuon.exec._runtime._boundary.grad_reduce`, :mod:`~dmuon.exec._runtime.replicas`,
:mod:`~dmuon.exec._runtime.streams` and :mod:`~dmuon.exec._runtime.ep_stacks`. The phases and the
stream rules on an accelerator: Note: the model runtime (docs/design.md).
"""

from __future__ import annotations

import contextlib
import weakref

import torch
import torch.nn as nn

from dmuon import _tags
from dmuon._tags import dedicated_info
from dmuon.plan._scheduling.programs import boundary_programs

from dmuon.exec._comm import collective_calls as C
from dmuon.exec._setup import fsdp2
from dmuon.exec._runtime import ep_stacks as expert_parallel, replicas
from dmuon.exec._runtime._boundary import grad_reduce
from dmuon.exec._runtime._boundary.bound_ops import bind
from dmuon.exec._runtime._boundary.comm_context import BoundaryCommContext
from dmuon.exec._runtime._boundary.hook_boundary import HookBoundary, ShardedState, TrainingState, eager_hook
from dmuon.exec._runtime.packed_buffers import build_segments
from dmuon.exec._comm.groups import MeshGroups

__all__ = [
    "DmuonRuntime",
    "wait_pending",
    "after_step",
    "get_runtime",
    "get_model_runtime",
    "no_sync",
    "record_bare_stage",
    "bare_stage_runtimes",
]


class _Shared:
    """An attribute of the runtime whose one home is the boundaries' comm context: read and set
    through either (``steps_done``, ``pipelined``, ... are set by the optimizer, the pipeline
    hooks and ``no_sync`` on the runtime, and read by the boundaries on the context)."""

    def __init__(self, name: str | None = None):
        self.name = name

    def __set_name__(self, owner, name: str) -> None:
        self.name = self.name or name

    def __get__(self, rt, owner=None):
        return self if rt is None else getattr(rt.comm_ctx, self.name)

    def __set__(self, rt, value) -> None:
        setattr(rt.comm_ctx, self.name, value)


class DmuonRuntime:
    """Binds a :class:`~dmuon.plan.ShardingPlan` to a model and a mesh (Note: the model runtime, docs/design.md)."""

    # the comm context's fields (:class:`_Shared`)
    groups = _Shared()
    device = _Shared()
    reshard_after_forward = _Shared()
    num_shards = _Shared()
    world_numel = _Shared()
    timeout_s = _Shared()
    model_ref = _Shared()
    boundaries = _Shared()
    steps_done = _Shared()
    requires_gradient_sync = _Shared()
    pipelined = _Shared()
    check_nonfinite = _Shared()
    nonfinite_before_reduce = _Shared()
    pending_reduces = _Shared()
    pending_replicate = _Shared()
    use_streams = _Shared()
    use_coalescing = _Shared()
    _flag_host_reads = _Shared("flag_host_reads")
    _streams = _Shared()

    def __init__(
        self,
        plan,
        model: nn.Module,
        groups: MeshGroups,
        device: torch.device,
        *,
        timeout_s: float | None = C.DEFAULT_TIMEOUT_S,
        use_streams: bool = True,
    ):
        self.plan = plan
        # what the hook boundaries share, and the runtime reads (the _Shared attributes above)
        self.comm_ctx = BoundaryCommContext(plan, groups, device, model, timeout_s=timeout_s, use_streams=use_streams)
        self.replicate_async = bool(plan.replicate_async)
        self.tp_size = groups.tp_size
        # the step's non-finite flags, reduced over the job by dmuon.clip_grad_norm_'s all-reduce
        # (dmuon.exec._optim.nonfinite_skip.NonFiniteFlags), consumed by the next step
        self.nonfinite_flags = None
        self.ep_hooks: dict = {}  # expert-parallel stacks' gradient-divisor hook handles, by FQN
        # dmuon.exec._setup.host_offload.HostOffload: held masters and owned momenta on the host
        # (set by apply before the storage is placed), or None
        self.offload = None
        self._build(model)

    # -- construction ----------------------------------------------------------------------

    def _build(self, model: nn.Module) -> None:
        plan = self.plan
        modules = dict(model.named_modules(remove_duplicate=False))
        specs = {p.fqn: p for p in plan.params}
        owners = dict(zip((p.fqn for p in plan.params), plan.owners))
        original = {}
        for spec in plan.params:
            mod = modules[spec.module_fqn]
            original[spec.fqn] = mod._parameters[spec.attr]
        programs = boundary_programs(plan)  # the schedule's per-boundary collectives
        for b, program in zip(plan.boundaries, programs):
            segments = build_segments(
                b,
                plan=plan,
                groups=self.groups,
                device=self.device,
                modules=modules,
                specs=specs,
                owners=owners,
                original=original,
                runtime_ref=weakref.ref(self),
            )
            module = modules[b.fqn]
            br = HookBoundary(self.comm_ctx, b.fqn, module, segments, bind(program, segments, self.groups))
            br.index = len(self.boundaries)
            for slot in br.installable:
                for mod, attr in slot.homes:
                    mod._parameters[attr] = slot.logical
            br.handles.append(module.register_forward_pre_hook(eager_hook(br.pre_forward), with_kwargs=True))
            br.handles.append(module.register_forward_hook(eager_hook(br.post_forward), with_kwargs=True))
            self.boundaries.append(br)
        self.ep_params = expert_parallel.bind_expert_parallel(self, modules, original)
        self.ep_infos = {fqn: dedicated_info(p) for fqn, p in self.ep_params.items()}
        # matrices with one owner: their slot; owner-grouped matrices: their _Grouped (blocks in
        # several segments)
        self.slots_by_fqn = {s.fqn: s for b in self.boundaries for s in b.slots if s.grouped is None}
        self.grouped_by_fqn = {gm.fqn: gm for b in self.boundaries for gm in b.grouped}
        self.shard_of_fqn = {
            s.fqn: seg.shard for b in self.boundaries for seg in b.segments for s in seg.slots if s.grouped is None
        }
        # checkpoint / materialisation bookkeeping (dmuon.exec._state.*_state, dmuon.exec._setup.materialize)
        self.infos = {s.fqn: dedicated_info(s.logical) for s in self.slots_by_fqn.values()}
        self.infos.update({fqn: dedicated_info(gm.logical) for fqn, gm in self.grouped_by_fqn.items()})
        self._state_dict_mesh = None  # DeviceMesh of the state-dict DTensors, built on first use
        self.replicas_stale = False  # HSDP: holders may disagree (set by to_empty & co.)
        self.qk_clip = None  # QK-clip (MuonClip): reported max logits and the owners' rescaling
        if plan.qk_clip is not None:
            from dmuon.exec._optim.qk_clip import QKClipRuntime

            self.qk_clip = QKClipRuntime(self, model)

    def hook_ep_param(self, fqn: str, p: nn.Parameter, boundary_index: int) -> None:
        """(Re-)register the gradient-divisor hook of the local expert-parallel stack ``fqn`` on ``p``
        (:func:`dmuon.exec._runtime.ep_stacks.hook_ep_param`)."""
        expert_parallel.hook_ep_param(self, fqn, p, boundary_index)

    # -- settings and state changed from outside (dmuon.exec._setup.materialize, benchmarks) ----------

    def set_use_streams(self, enabled: bool) -> None:
        """CUDA: use dmuon's own broadcast / reduce streams (default) or the compute stream."""
        self.use_streams = bool(enabled)

    def set_coalescing(self, enabled: bool) -> None:
        """Issue a list of broadcasts (or reduces) on one group as one coalesced group where the
        backend supports it (default), or one by one. The same on every rank."""
        self.use_coalescing = bool(enabled)

    def mark_replicas_stale(self) -> None:
        """HSDP: holders may disagree now (after a ``Module._apply``): :meth:`sync_replicas`
        broadcasts every owner's value before the next use. Without replicas, nothing to do."""
        self.replicas_stale = self.groups.shape[0] > 1

    def set_device(self, device: torch.device) -> None:
        """The dedicated storage moved to ``device`` (after :func:`dmuon.exec._setup.materialize.rebind_storage`)."""
        if device != self.device:
            self.device = device  # the comm context's (_Shared)
            self._state_dict_mesh = None

    def state_dict_mesh(self):
        """The ``DeviceMesh`` of dmuon's state-dict DTensors (over dmuon's groups), cached.

        Without TP: ``(shard,)`` or ``("replicate", "shard")`` over this data-parallel mesh.
        With TP (``T > 1``) the whole job: ``("tp", "shard")`` or ``("replicate", "tp",
        "shard")``, ``mesh[r][t][s]`` = the global rank at ``(r, s)`` of TP coordinate ``t``;
        ``tp`` comes before ``shard`` so that a column-parallel (``Shard(0)``) matrix is split
        into its TP blocks first, then each block into row chunks (DTensor applies placements
        of one tensor dim left to right), which is how the holders store it.
        """
        mesh = self._state_dict_mesh
        if mesh is None:
            from torch.distributed.device_mesh import DeviceMesh

            g = self.groups
            R, _ = g.shape
            device_type = self.device.type
            if g.tp_size > 1:
                ranks = torch.tensor(g.tp_tables, dtype=torch.int64).permute(1, 0, 2)  # [r][t][s]
                if R == 1:
                    mesh = DeviceMesh.from_group(
                        [g.tp_group, g.shard_group], device_type, mesh=ranks[0], mesh_dim_names=("tp", "shard")
                    )
                else:
                    mesh = DeviceMesh.from_group(
                        [g.replicate_group, g.tp_group, g.shard_group],
                        device_type,
                        mesh=ranks,
                        mesh_dim_names=("replicate", "tp", "shard"),
                    )
            elif R == 1:
                ranks = torch.tensor(g.mesh_ranks, dtype=torch.int64)
                mesh = DeviceMesh.from_group(g.shard_group, device_type, mesh=ranks[0])
            else:
                ranks = torch.tensor(g.mesh_ranks, dtype=torch.int64)
                mesh = DeviceMesh.from_group(
                    [g.replicate_group, g.shard_group], device_type, mesh=ranks, mesh_dim_names=("replicate", "shard")
                )
            self._state_dict_mesh = mesh
        return mesh

    def wait(self, works, what: str, *, boundary=None, group=None) -> None:
        """Wait for ``works`` with this model's timeout, step count and ``boundary``'s forwards
        (:meth:`BoundaryCommContext.wait <dmuon.exec._runtime._boundary.comm_context.BoundaryCommContext.wait>`)."""
        self.comm_ctx.wait(works, what, boundary=boundary, group=group)

    # -- backward bookkeeping --------------------------------------------------------------

    def finish_pipeline_step(self) -> None:
        """The reduce of a pipeline schedule's step (its ``REDUCE_GRAD`` action, before FSDP2's
        reduce and the schedule's gradient scaling): every boundary, last first, drops the uses
        whose backward never ran and reduces the local gradients accumulated over the step's
        micro-batches to their owners (averaged over the data-parallel mesh, as FSDP2 does; the
        schedule then divides the owners' ``.grad`` by the micro-batch count with the rest of the
        stage's gradients); then every reduce is waited for and every buffer freed. A boundary
        already reduced by an autograd backward with gradient sync on is not reduced again."""
        for b in reversed(self.boundaries):
            b.finish_pipeline_step()
        self.finish_reduces()
        for b in self.boundaries:
            if b.sharded_state is not ShardedState.RESHARDED:
                b._reshard()

    def reset_after_shape_inference(self) -> None:
        """After a pipeline stage's shape inference (a real forward, and a backward for the input
        gradients only, before the first step): forget its uses, put the logical parameters back,
        drop any local gradient and free every buffer, as the stage resets FSDP2's parameters. The
        max logits QK-clip recorded in it are dropped too: a stage after the first infers from an
        uninitialised input (``torch.empty``), not from a micro-batch of the step."""
        self.finish_reduces()
        if self.qk_clip is not None:
            self.qk_clip.discard()
        for b in self.boundaries:
            b.uses = []
            b._restore()
            b.unreduced = False
            for slot in b.installable:
                slot.compute.grad = None
            if b.sharded_state is not ShardedState.RESHARDED:
                b._reshard()

    def finish_reduces(self) -> None:
        """Wait for the in-flight gradient reduces and accumulate the averages into owners' ``.grad``
        (:func:`dmuon.exec._runtime._boundary.grad_reduce.finish_reduces`)."""
        grad_reduce.finish_reduces(self.comm_ctx)

    def grad_divisor(self, boundary) -> float:
        """What the owner divides a reduced (summed) gradient by: FSDP2's gradient divide factor
        (:func:`dmuon.exec._runtime._boundary.grad_reduce.grad_divisor`)."""
        return grad_reduce.grad_divisor(self.comm_ctx, boundary)

    def wait_replicate_broadcasts(self, boundary=None) -> None:
        """HSDP: wait for the post-step replicate broadcasts of ``boundary`` (all when ``None``)."""
        self.comm_ctx.wait_replicate_broadcasts(boundary)

    def after_step(self, *, skipped: bool = False) -> None:
        """HSDP: each owner broadcasts its updated sub-segments to its replicate peers.

        ``replicate_async=True``: launched here, waited for just before the boundary's next
        forward broadcast or any state-dict read; ``False``: waited for here.

        QK-clip (``plan.qk_clip``) runs first: its all-reduce (max) and the owners' rescaling of
        W_q / W_k rows (:mod:`dmuon.exec._optim.qk_clip`), so replicas receive the rescaled values.

        ``skipped`` (a step ``dmuon.Muon(skip_nonfinite=True)`` skipped on every rank): the step
        bookkeeping only; QK-clip drops the step's max logits without its all-reduce or rescaling,
        and nothing is broadcast (no value changed). No collective.
        """
        self.steps_done += 1
        self.comm_ctx.check_deferred_rounds()
        if self.pipelined:  # pipeline Z2: a boundary still resident (no reduce ran) must broadcast the new values
            for b in self.boundaries:
                if not b.uses and b.sharded_state is not ShardedState.RESHARDED:
                    b._reshard()
        for b in self.boundaries:
            b.forwards_since_step = 0
        self.nonfinite_before_reduce = None
        self.nonfinite_flags = None
        if skipped:
            if self.qk_clip is not None:
                self.qk_clip.discard()
            return
        if self.qk_clip is not None:
            self.qk_clip.step()
        replicas.broadcast_after_step(self)

    def after_load(self) -> None:
        """After ``load_state_dict`` wrote new masters on every holder (nothing to communicate)."""

    def remove_hooks(self) -> None:
        for h in self.ep_hooks.values():
            h.remove()
        self.ep_hooks.clear()
        for b in self.boundaries:
            for h in b.handles:
                h.remove()
            b.handles.clear()

    # -- storage binding and state access (dmuon.exec._setup.materialize, dmuon.exec._state.*_state) --
    def check_materialized(self, what: str) -> None:
        """Raise a clear error while the dedicated storage is still on the ``meta`` device."""
        if any(seg.wire.device.type == "meta" for b in self.boundaries for seg in b.segments):
            raise RuntimeError(
                f"dmuon: {what}: the dedicated parameters are still on the meta device; call "
                "model.to_empty(device=...) and initialise the model first (e.g. dmuon.init_params(model), "
                "or load a checkpoint; see docs/checkpointing.md)"
            )

    def global_group(self):
        """The process group of this model's global reductions (the gradient norm's owners' term, the
        non-finite flags): the job's ranks, or the world (``None``) for a pipeline stage, whose every
        stage takes part."""
        return None if self.pipelined else self.groups.job_group

    def check_idle(self, what: str) -> None:
        """Before masters are overwritten (state-dict load): every boundary between steps.

        Raises if a forward still awaits its backward; a boundary left resident by a prefetch
        (a forward that stopped early) waits for its broadcasts and frees its copies, so the
        next forward broadcasts the new values again.
        """
        self._settle(self.boundaries, what)

    @staticmethod
    def _settle(boundaries, what: str) -> None:
        busy = [b.fqn for b in boundaries if b.training_state is not TrainingState.IDLE or b.pending_backward > 0]
        if busy:
            raise RuntimeError(
                f"dmuon: {what} while boundaries {busy[:3]} are between their forward and backward; "
                "do it between training steps"
            )
        for b in boundaries:
            if b.sharded_state is not ShardedState.RESHARDED:
                b._reshard()

    def sync_replicas(self) -> None:
        """HSDP: broadcast every owner's value to its replicate peers when they may disagree
        (:attr:`replicas_stale`; :func:`dmuon.exec._runtime.replicas.sync_replicas`)."""
        replicas.sync_replicas(self)

    def prepare_state_access(self, what: str) -> None:
        """Before reading or writing masters through the state-dict API (collective in HSDP)."""
        self.check_materialized(what)
        self.sync_replicas()
        self.wait_replicate_broadcasts()


# ----------------------------------------------------------------------------------------------
# Optimizer hooks (called by dmuon.Muon.step)
# ----------------------------------------------------------------------------------------------


def get_model_runtime(model: nn.Module) -> DmuonRuntime | None:
    """The :class:`DmuonRuntime` that :func:`dmuon.exec.apply` attached to ``model``, or None."""
    return _tags.model_runtime(model)


def get_runtime(p: torch.Tensor) -> DmuonRuntime | None:
    """The live :class:`DmuonRuntime` of the dedicated parameter ``p`` (None if not dedicated)."""
    info = dedicated_info(p)
    return None if info is None else info.runtime()


def runtimes_of(params) -> list[DmuonRuntime]:
    """The distinct live runtimes of the dedicated parameters among ``params``, in first-seen order."""
    seen: dict[int, DmuonRuntime] = {}
    for p in params:
        rt = get_runtime(p)
        if rt is not None:
            seen.setdefault(id(rt), rt)
    return list(seen.values())


_runtimes = runtimes_of  # the former private name

# pipeline stages whose plan dedicates nothing (e.g. a split that gives a rank only the embedding):
# no parameter carries their runtime, so the gradient clip and skip_nonfinite find them through the
# stage's parameters; weak, in dedication order
_BARE_STAGES: "weakref.WeakValueDictionary[int, DmuonRuntime]" = weakref.WeakValueDictionary()


def record_bare_stage(rt: DmuonRuntime) -> None:
    """Record the runtime of a model whose plan dedicates nothing (:func:`bare_stage_runtimes`)."""
    _BARE_STAGES[max(_BARE_STAGES.keys(), default=-1) + 1] = rt


def bare_stage_runtimes(params) -> list[DmuonRuntime]:
    """The live pipeline-stage runtimes whose plan dedicates nothing and whose model holds one of
    ``params`` (the parameters the model holds now, e.g. FSDP2's sharded ones), in dedication
    order. Such a stage still takes part in the job's collectives of the gradient norm and the
    non-finite flags: ``dmuon.clip_grad_norm_`` and ``dmuon.Muon(skip_nonfinite=True)`` read its
    groups here (docs/pipeline_parallel.md)."""
    live = [rt for _, rt in sorted(_BARE_STAGES.items()) if rt.pipelined]
    if not live:
        return []
    ids = {id(p) for p in params}
    out = []
    for rt in live:
        model = rt.model_ref()
        if model is not None and any(id(p) in ids for p in model.parameters()):
            out.append(rt)
    return out


def wait_pending(params) -> None:
    """Before ``step()``: finish in-flight gradient reduces of every runtime owning ``params``.

    Raises:
        RuntimeError: local gradients of dedicated matrices were never reduced (every backward
            since the last step ran inside ``dmuon.no_sync``): the step would silently skip them.
    """
    for rt in runtimes_of(params):
        rt.finish_reduces()
        stale = [s.fqn for b in rt.boundaries for s in b.installable if s.compute.grad is not None]
        if stale:
            raise RuntimeError(
                f"dmuon: step() with unreduced gradients of {len(stale)} dedicated matrices "
                f"(e.g. {stale[0]!r}): every backward since the last step ran inside dmuon.no_sync "
                "(or with FSDP2's requires_gradient_sync False). Run the last micro-batch's backward "
                "outside the context so the accumulated gradients are reduced once."
            )


def after_step(params) -> None:
    """Post-step work of every runtime owning one of ``params`` (HSDP replicate broadcast)."""
    for rt in runtimes_of(params):
        rt.after_step()


def after_skipped_step(params) -> None:
    """A step ``dmuon.Muon(skip_nonfinite=True)`` skipped on every rank: the bookkeeping of every
    runtime owning one of ``params`` (:meth:`DmuonRuntime.after_step` with ``skipped=True``; no
    collective)."""
    for rt in runtimes_of(params):
        rt.after_step(skipped=True)


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
    rt = get_model_runtime(model)
    if rt is None:
        raise ValueError("dmuon.no_sync: the model has no dedicated parameters (call dmuon.dedicate_params first)")
    fsdp = getattr(model, "set_requires_gradient_sync", None)
    prev = rt.requires_gradient_sync
    prev_fsdp = fsdp2.requires_gradient_sync(model)
    rt.requires_gradient_sync = False
    if fsdp is not None:
        fsdp(False)
    try:
        yield
    finally:
        rt.requires_gradient_sync = prev
        if fsdp is not None:
            fsdp(prev_fsdp)
