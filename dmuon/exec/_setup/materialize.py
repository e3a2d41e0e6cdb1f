"""Meta-device models: ``to_empty`` support and initialisation as if the model were whole.

:func:`install` makes ``model.to_empty(device=...)`` (and ``model.to(device)``) give each holder a
fresh segment on the new device; :func:`init_params` initialises every module on every rank as one
process would on the unsharded model. The recipe, how ``to_empty`` is wrapped and which initial
values are guaranteed: Note: meta-device initialisation (docs/design.md).
"""

from __future__ import annotations

import contextlib
import types
import weakref

import torch
import torch.nn as nn

from dmuon import _tags
from dmuon._dtensor import is_dtensor, local_tensor
from dmuon._tags import dedicated_info
from dmuon.plan._tools.render import fmt_names

from dmuon.exec._runtime._boundary.hook_boundary import eager_hook
from dmuon.exec._runtime.packed_buffers import _contiguous_strides, _grouped_storage, _Segment, _Slot
from dmuon.exec._runtime.runtime import get_model_runtime
from dmuon.exec._setup import host_offload as _host_offload

__all__ = ["install", "init_params", "rebind_storage"]


def install(runtime, model: nn.Module) -> None:
    """Wrap ``_apply`` of ``model`` and of every boundary module; add the first-use guard.

    The guard is a forward pre-hook on each boundary module, run before the runtime's own
    pre-forward: it raises a clear error while the model is still on ``meta`` and, in HSDP,
    runs :meth:`~dmuon.exec._runtime.runtime.DmuonRuntime.sync_replicas` when a ``_apply`` happened.
    """
    ref = weakref.ref(runtime)
    _wrap_apply(model, ref, list(runtime.boundaries))
    for b in runtime.boundaries:
        _wrap_apply(b.module, ref, [b])

    def guard(module, args):
        rt = ref()
        if rt is None:
            return None
        if rt.device.type == "meta":
            rt.check_materialized("forward")
        if rt.replicas_stale:
            rt.sync_replicas()
        return None

    for b in runtime.boundaries:
        b.handles.append(b.module.register_forward_pre_hook(eager_hook(guard), prepend=True))


def _dedupe(items: list) -> list:
    seen: set[int] = set()
    out = []
    for x in items:
        if id(x) not in seen:
            seen.add(id(x))
            out.append(x)
    return out


def _wrap_apply(module: nn.Module, runtime_ref, boundaries: list) -> None:
    if _tags.read(module, _tags.APPLY_WRAPPED, False):
        _tags.write(module, _tags.APPLY_BOUNDARIES, _dedupe(_tags.read(module, _tags.APPLY_BOUNDARIES) + boundaries))
        return

    def _apply(self, fn, *args, **kwargs):
        out = type(self)._apply(self, fn, *args, **kwargs)  # the class's (FSDP2's) _apply
        rt = runtime_ref()
        if rt is not None:
            rebind_storage(rt, _tags.read(self, _tags.APPLY_BOUNDARIES))
            rt.mark_replicas_stale()
        return out

    _tags.write(module, _tags.APPLY_BOUNDARIES, list(boundaries))
    _tags.write(module, _tags.APPLY_WRAPPED, True)
    object.__setattr__(module, "_apply", types.MethodType(_apply, module))


# ----------------------------------------------------------------------------------------------
# Storage rebinding after Module._apply
# ----------------------------------------------------------------------------------------------


@torch.no_grad()
def rebind_storage(rt, boundaries=None) -> bool:
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
    changed = False
    boundaries = rt.boundaries if boundaries is None else boundaries
    rt._settle(boundaries, "moving or re-creating the model's storage (to_empty / to)")
    for b in boundaries:
        for gm in b.grouped:  # owner groups: the module holds the grouped matrix's logical parameter
            _adopt_module_param(rt, gm)
            if dedicated_info(gm.logical) is None:
                _tags.write(gm.logical, _tags.PARAM, rt.infos[gm.fqn])
            for block in gm.blocks:
                if block is not None:  # expert parallelism: only this EP coordinate's ranges
                    block.logical = gm.logical
        for seg in b.segments:
            changed |= _rebind_segment(rt, seg)
        for gm in b.grouped:
            changed |= _rebind_grouped(gm, b.segments)
        for gb in b.gathers:  # the views are set (``set_`` regrows a storage it points past): release
            if gb.resident or gb.gathered.untyped_storage().nbytes():
                gb.release()
        _adopt_ep_stacks(rt, b)
    if changed:
        devices = {seg.wire.device for b in rt.boundaries for seg in b.segments}
        if len(devices) == 1:
            rt.set_device(devices.pop())
    return changed


def _rebind_segment(rt, seg: _Segment) -> bool:
    for slot in seg.slots:
        _adopt_module_param(rt, slot)
        if dedicated_info(slot.logical) is None:
            _tags.write(slot.logical, _tags.PARAM, rt.infos[slot.fqn])
    devices = {slot.logical.device for slot in seg.slots}
    if len(devices) != 1:
        raise RuntimeError(
            f"dmuon: the dedicated parameters {[s.fqn for s in seg.slots]} of one packed segment "
            f"are on different devices {sorted(map(str, devices))}; move whole hook boundaries"
        )
    device = devices.pop()
    offload = rt.offload if device.type != "meta" else None
    # where the master and the broadcast buffer go: both on the parameters' device, or under
    # offload the master on the host and the buffer (always a tensor of its own) on the compute device
    master_device, wire_device = (device, device) if offload is None else (_host_offload.HOST, offload.compute_device)
    for slot in seg.slots:
        if slot.logical.dtype != seg.param_dtype:
            raise ValueError(
                f"dmuon: dedicated parameter {slot.fqn!r} became {slot.logical.dtype}, the plan says "
                f"{seg.param_dtype}; change dtypes before planning (or use mp_policy)"
            )
    wire_dtype = seg.wire.dtype
    if seg.held:
        storage = seg.master.untyped_storage()._cdata
        if (
            seg.master.device == master_device
            and all(local_tensor(slot.logical).untyped_storage()._cdata == storage for slot in seg.slots)
            and (offload is None or (seg.wire.device == wire_device and seg.wire is not seg.master))
        ):
            return False
        if offload is None:
            master = torch.zeros(seg.numel, dtype=seg.param_dtype, device=device)
        else:
            master = _host_offload.host_zeros(seg.numel, seg.param_dtype, offload)
        for slot in seg.slots:
            view = master[slot.offset_in_seg : slot.offset_in_seg + slot.numel].view(slot.shape)
            if slot.logical.device.type != "meta":
                view.copy_(local_tensor(slot.logical).detach().reshape(slot.shape))
            _point_logical(rt, slot, view)
        if wire_dtype == seg.param_dtype and offload is None:
            wire = master
        else:
            wire = torch.zeros(seg.numel, dtype=wire_dtype, device=wire_device)
            wire.copy_(master)  # the value until the next broadcast writes it again
        seg.master, seg.wire, seg.resident = master, wire, True
        _set_computes(seg, wire)
        if seg.gather is not None:
            _rebind_gather(seg.gather, wire_device)
        return True
    device = wire_device
    if seg.wire.device == device:
        return False
    gb = seg.gather
    if gb is not None:  # an all-gathered buffer: the wire is a view of its slot in the gathered tensor
        _rebind_gather(gb, device)
        wire = gb.segment_view(gb.group_shards.index(seg.shard), seg.numel)
        _set_computes(seg, wire)
        seg.wire, seg.resident = wire, False
        return True
    wire = torch.empty(seg.numel, dtype=wire_dtype, device=device)
    _set_computes(seg, wire)
    wire.untyped_storage().resize_(0)
    seg.wire, seg.resident = wire, False
    return True


def _rebind_gather(gb, device) -> None:
    """An all-gathered buffer's gathered tensor on ``device`` (its reduce buffers are rebuilt there
    at the next reduce). The caller rebinds the non-held segments' wires and the in-place stacks'
    views to it, then releases its storage (:func:`rebind_storage`)."""
    if gb.gathered.device == device:
        return
    gb.gathered = torch.empty(gb.k * gb.slot_numel, dtype=gb.gathered.dtype, device=device)


def _rebind_grouped(gm, segments) -> bool:
    """A grouped matrix's full compute parameter (and its writer) on the segments' device; a
    stack received in place: its view of the (rebound) gathered tensor."""
    device = segments[0].wire.device
    if gm.view is not None:
        if (
            gm.compute.device == device
            and gm.compute.untyped_storage()._cdata == gm.gather.gathered.untyped_storage()._cdata
        ):
            return False
        gm.compute = nn.Parameter(gm.view_gathered(), requires_grad=gm.compute.requires_grad)
        gm.resident = False
        return True
    if gm.writer.device == device:
        return False
    compute, gm.writer = _grouped_storage(tuple(gm.info.shape), gm.writer.dtype, device)
    gm.compute = nn.Parameter(compute, requires_grad=gm.compute.requires_grad)
    gm.resident = False
    return True


def _set_computes(seg, wire: torch.Tensor) -> None:
    """Every slot's compute parameter on ``wire``'s storage, each a tensor of its own (``set_``,
    as :func:`~dmuon.exec._runtime.packed_buffers.build_segments` makes them), not a view of ``wire``: writes into
    the wire (the mixed-precision copy of the masters, the step code in the flag slots before a
    broadcast) must not bump the version counter of compute parameters autograd saved."""
    for slot in seg.slots:
        _set_compute(
            slot,
            torch.empty(0, dtype=wire.dtype, device=wire.device).set_(
                wire.untyped_storage(),
                wire.storage_offset() + slot.offset_in_seg,
                slot.shape,
                _contiguous_strides(slot.shape),
            ),
        )


def _set_compute(slot: _Slot, view: torch.Tensor) -> None:
    """A new compute parameter viewing ``view``'s storage (never installed between steps); a
    TP matrix's is a DTensor with its placement, as :func:`~dmuon.exec._runtime.packed_buffers.build_segments`
    makes it."""
    if slot.tp is not None:
        view = slot.tp.wrap(view)
    compute = nn.Parameter(view, requires_grad=slot.compute.requires_grad)
    slot.compute = compute


def _point_logical(rt, slot: _Slot, view: torch.Tensor) -> None:
    """Make the logical parameter (same Python object) a view of ``view``.

    Without TP ``param.data = view``. A TP matrix's logical parameter is a DTensor, whose
    ``.data`` setter does not reach its local tensor: ``torch.utils.swap_tensors`` with a new
    DTensor parameter on ``view`` instead (its dedicated tag restored after)."""
    if slot.tp is None:
        slot.logical.data = view
        return
    new = nn.Parameter(slot.tp.wrap(view), requires_grad=slot.logical.requires_grad)
    try:
        torch.utils.swap_tensors(slot.logical, new)
    except RuntimeError:  # e.g. a weak reference to it: adopt the new object everywhere
        slot.logical = new
        for module, attr in slot.homes:
            module._parameters[attr] = new
    _tags.write(slot.logical, _tags.PARAM, rt.infos[slot.fqn])


def _adopt_module_param(rt, slot: _Slot) -> None:
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
    _tags.write(slot.logical, _tags.PARAM, rt.infos[slot.fqn])
    for module, attr in slot.homes:
        module._parameters[attr] = slot.logical


def _adopt_ep_stacks(rt, b) -> None:
    """The local expert-parallel stacks of boundary ``b`` (``Boundary.local``, no segment):
    after ``Module._apply`` each keeps its dedicated object, dedicated tag, gradient-divisor
    hook and place in :attr:`~dmuon.exec._runtime.runtime.DmuonRuntime.ep_params`.

    ``to_empty`` from ``meta`` registers a NEW Parameter (as for the segments' logical
    parameters, :func:`_adopt_module_param`): its content moves into the dedicated object with
    ``torch.utils.swap_tensors`` (or, where that fails, the new object is adopted and tagged),
    which is registered again under every alias. The object's tensor-hook dict stays with the
    Python object in a swap while autograd keeps it on the old TensorImpl, so it is bound to the
    current one again (assigning ``_backward_hooks``; also covers the swap ``Module._apply``
    itself does under ``set_swap_module_params_on_conversion``) and dmuon's hook registered again."""
    local = rt.plan.boundaries[b.index].local
    if not local:
        return
    model = rt.model_ref()
    for fqn in local:
        orig = rt.ep_params[fqn]
        info = rt.ep_infos[fqn]
        homes = []
        for alias in rt.plan.param(fqn).aliases:
            mod_fqn, _, attr = alias.rpartition(".")
            homes.append((model.get_submodule(mod_fqn), attr))
        new = next(
            (m._parameters[a] for m, a in homes if m._parameters.get(a) is not None and m._parameters[a] is not orig),
            None,
        )
        keep = orig
        if new is not None:
            try:
                torch.utils.swap_tensors(orig, new)  # orig: the new storage; new: the old one
            except RuntimeError:  # e.g. a weak reference to one of them: adopt the new object
                keep = new
        _tags.write(keep, _tags.PARAM, info)
        rt.ep_params[fqn] = keep
        for module, attr in homes:
            module._parameters[attr] = keep
        hooks = keep._backward_hooks  # the Python object's hook dict stays with it in a swap, but
        if hooks is not None:  # autograd keeps it on the old TensorImpl: bind it to the current one
            keep._backward_hooks = hooks
        rt.hook_ep_param(fqn, keep, b.index)


# ----------------------------------------------------------------------------------------------
# Initial values
# ----------------------------------------------------------------------------------------------


@torch.no_grad()
def init_params(model: nn.Module, init_fn=None) -> None:
    """Initialise ``model`` as one process would initialise the unsharded model.

    Runs ``init_fn(module)`` — default: ``module.reset_parameters()`` for modules that define
    it — for every module of ``model.modules()`` in order, on every rank (every rank must call
    this, with the same RNG state: e.g. ``torch.manual_seed(seed)`` first). While it runs, the
    module's own parameters (``recurse=False``) are full size: a holder's dedicated parameter
    is its full master already; a non-holder's placeholder and an FSDP2 ``DTensor`` are
    replaced by a temporary full tensor, whose rows this rank does not keep are dropped after
    (a ``DTensor`` keeps its local shard). So every rank consumes the RNG exactly as one
    process running the same loop on the whole model, and ends up with its part of those
    values. See Note: meta-device initialisation (docs/design.md) for when that equals the model's constructor.

    Args:
        model: after ``model.to_empty(device=...)`` (or any materialised model; also works
            without dmuon, e.g. a plain FSDP2 model).
        init_fn: ``(module) -> None`` that initialises only that module's own parameters (as
            ``reset_parameters`` does); ``None`` = call ``reset_parameters`` where defined.

    Raises:
        RuntimeError: the model is still on the meta device.
        ValueError: ``init_fn`` is None and some parameter belongs only to modules without
            ``reset_parameters`` (e.g. a raw ``nn.Parameter`` on the root, such as positional
            embeddings): nothing would initialise it, and after ``to_empty`` it holds
            uninitialised memory. Checked first, locally (every rank raises alike); pass an
            ``init_fn`` that covers it.

    Memory: one module's own parameters at full size at a time, per rank.
    """
    rt = get_model_runtime(model)
    if rt is not None:
        rt.check_materialized("dmuon.init_params")
    if init_fn is None:
        _check_covered(model)
    for module in model.modules():
        if init_fn is None:
            fn = getattr(module, "reset_parameters", None)
            if not callable(fn):
                continue
            call = fn
        else:
            call = lambda m=module: init_fn(m)  # noqa: E731
        with full_size_params(module):
            call()


@contextlib.contextmanager
def full_size_params(module: nn.Module, *, dedicated_only: bool = False):
    """Within the context, ``module``'s own parameters (``recurse=False``) are full size; on exit
    this rank keeps its part of what was written to them (see :func:`init_params`).

    A holder's dedicated parameter is its full master already; a non-holder's placeholder, an
    owner-group block or a TP holder's shard (and, unless ``dedicated_only``, an FSDP2
    ``DTensor``) is replaced by a temporary full tensor, whose rows this rank does not keep are
    dropped on exit. A local expert-parallel stack ``(E/ep, a, b)`` is replaced by the whole
    ``(E, a, b)`` stack and keeps its EP coordinate's experts, so ranks get distinct experts
    equal to the single-process model's. ``dedicated_only=True`` is for initialisers that handle FSDP2's DTensors
    themselves (torchtitan's ``init_weights``: :mod:`dmuon.integrations.torchtitan`).
    """
    swapped = []  # (name, original, temporary)
    for name, p in list(module._parameters.items()):
        if p is None:
            continue
        info = dedicated_info(p)
        if info is not None:
            if info.ep_local:  # a local expert-parallel stack: the whole (E, a, b) stack for a moment
                tmp = torch.empty((info.experts.num_experts, *p.shape[1:]), dtype=p.dtype, device=p.device)
                swapped.append((name, p, nn.Parameter(tmp, requires_grad=p.requires_grad)))
                continue
            if info.holds_full and info.tp is None:
                continue  # the full master itself
            # an owner-group block, a non-holder's placeholder, or a TP holder's shard: the
            # full matrix for a moment
            tmp = torch.empty(info.shape, dtype=p.dtype, device=p.device)
        elif is_dtensor(p) and not dedicated_only:
            if p.device.type == "meta":
                raise RuntimeError("dmuon.init_params: the model is still on the meta device; call to_empty first")
            tmp = torch.empty(p.shape, dtype=p.dtype, device=p.device)
        else:
            if p.device.type == "meta":
                raise RuntimeError("dmuon.init_params: the model is still on the meta device; call to_empty first")
            continue
        swapped.append((name, p, nn.Parameter(tmp, requires_grad=p.requires_grad)))
    for name, _, tmp in swapped:
        module._parameters[name] = tmp
    try:
        yield
    finally:
        for name, original, tmp in swapped:
            module._parameters[name] = original
    for _, original, tmp in swapped:
        info = dedicated_info(original)
        if info is not None and info.ep_local:  # this rank's EP coordinate's experts
            rt = info.runtime()
            e = original.shape[0]
            j = rt.groups.shard % info.experts.ep_size
            original.detach().copy_(tmp.detach()[j * e : (j + 1) * e])
            continue
        group = getattr(info, "group", None)
        if group is not None:  # an owner group: the block this rank holds, if any
            if group.block is not None:
                original.detach().copy_(
                    tmp.detach().narrow(group.dim, group.offsets[group.block], group.sizes[group.block])
                )
            continue
        if info is not None and not info.holds_full:
            continue  # a placeholder keeps nothing
        if is_dtensor(original):  # FSDP2 shard, or a TP holder's shard
            _copy_local_part(original, tmp.detach())


def _check_covered(model: nn.Module) -> None:
    """Raise ``ValueError`` naming the parameters no module's ``reset_parameters`` initialises."""
    covered: set[int] = set()
    owners: dict[int, str] = {}
    for mod_name, module in model.named_modules(remove_duplicate=False):
        has_reset = callable(getattr(module, "reset_parameters", None))
        for name, p in module._parameters.items():
            if p is None:
                continue
            if has_reset:
                covered.add(id(p))
            owners.setdefault(id(p), f"{mod_name}.{name}" if mod_name else name)
    missing = [fqn for pid, fqn in owners.items() if pid not in covered]
    if missing:
        shown = fmt_names([repr(f) for f in missing], 6)
        raise ValueError(
            f"dmuon.init_params: {len(missing)} parameter(s) ({shown}) belong to modules without "
            "reset_parameters, so nothing would initialise them (after to_empty they hold uninitialised "
            "memory). Pass init_fn=(module) -> None that initialises each module's own parameters, these "
            "included (e.g. m.reset_parameters() where it exists, torch.nn.init.normal_ on the others)"
        )


def _copy_local_part(dt, full: torch.Tensor) -> None:
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(full.shape, dt.device_mesh, dt.placements)
    index = tuple(slice(o, o + s) for s, o in zip(shape, offset))
    local = dt.to_local()
    if local.numel():
        local.copy_(full[index])
