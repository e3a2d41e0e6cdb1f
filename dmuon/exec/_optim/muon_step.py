"""One Muon step of a param group: :func:`muon_step` gathers, for every matrix this rank owns, its
layout's parameter, gradient, state and matrix view (:class:`dmuon._update.Matrices`: a matrix, a
conv weight's ``(out, in·k)`` view, an expert stack's ``(k, out, in)`` matrices, a view's blocks)
and runs the update of :mod:`dmuon._update` on them (:func:`dmuon._update.muon_update`: momentum,
Newton-Schulz per matrix or per bucket, NorMuon, decay, update). Matrices several ranks hold (TP,
owner groups) go through :mod:`dmuon.exec._optim.tp_orthogonalize`. :class:`dmuon.Muon`
(:mod:`dmuon.exec._optim.muon`) holds the hyper-parameters and state and calls it. See
docs/runtime.md ("The optimizer")."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Optional

import torch
from torch import Tensor

from dmuon import _update as _u
from dmuon.exec._optim import normuon_update as _nm
from dmuon.exec._optim import offload_stage as _offload_stage
from dmuon.exec._optim import ns_backends as _ns
from dmuon.exec._optim import tp_orthogonalize as _tp
from dmuon.exec._optim.expert_update import matrices_to_stack, stack_to_matrices
from dmuon.exec._runtime.packed_buffers import dedicated_info

__all__ = ["muon_step"]


def _as_dtype(value: Any, what: str) -> torch.dtype:
    if isinstance(value, str):
        resolved = getattr(torch, value.removeprefix("torch."), None)
        if not isinstance(resolved, torch.dtype):
            raise ValueError(f"{what}: {value!r} does not name a torch dtype")
        value = resolved
    if not isinstance(value, torch.dtype) or not value.is_floating_point:
        raise ValueError(f"{what} must be a real floating-point torch.dtype, got {value!r}")
    return value


def muon_step(group: dict, states) -> None:
    """Muon on the matrices of ``group`` this rank owns that have a gradient (see
    :class:`dmuon.Muon`), with the group's ``ns_batching`` (:func:`dmuon._update.muon_update`).
    ``states``: the optimizer's ``state`` (``states[p]`` holds ``p``'s momentum buffer and, for
    NorMuon, its second moment)."""
    lr = group["lr"]
    if isinstance(lr, Tensor):
        lr = lr.item()
    weight_decay, adjust_lr_fn = group["weight_decay"], group["adjust_lr_fn"]
    momentum, nesterov = group["momentum"], group["nesterov"]
    orthogonalize, ns_kw = _ns_settings(group)
    normuon = group.get("variant", "muon") == "normuon"
    backend = group.get("ns_backend", "standard")

    items: list[_u.Matrices] = []
    # offloaded matrices: the compute device each item's run is copied to (None: updated in place)
    item_devices: list[Optional[torch.device]] = []
    tp_entries: list[tuple[Tensor, Tensor, Any]] = []
    grouped_entries: list[tuple[Tensor, Tensor, Any]] = []

    def normalize_fn(v: Tensor, info, block: Optional[int], matrix_shape) -> Callable[[Tensor], Tensor]:
        return functools.partial(_normuon, v=v, info=info, block=block, matrix_shape=matrix_shape, group=group)

    for p in group["params"]:
        info = dedicated_info(p)
        grad = p.grad
        if not info.is_owner or grad is None:
            continue
        if grad.is_sparse:
            raise RuntimeError("Muon does not support sparse gradients")
        state = states[p]
        if normuon and _nm.SECOND_MOMENT_KEY not in state:  # state cleared by hand: zeros, as the momentum
            _nm.check_supported(info)
            state[_nm.SECOND_MOMENT_KEY] = _nm.new_second_moment(p, info)
        tp = getattr(info, "tp", None)
        view = getattr(info, "view", None)
        og = getattr(info, "group", None)
        stack = getattr(info, "experts", None)
        if og is not None and stack is None:  # owner group: momentum on this rank's block, sharded Gram NS below
            grouped_entries.append((p, _momentum(grad, state, momentum, nesterov), og))
            continue
        if tp is not None:  # TP-sharded: momentum on the local shard, NS on the TP group below
            update = _tp_momentum_update(grad, state, tp, momentum, nesterov)
            if tp.method != "local":
                tp_entries.append((p, update, tp))
                continue
            # view blocks inside this rank's shard: orthogonalised here like untouched matrices
            per = tp.shape[tp.shard_dim] // tp.size
            blocks = _view_blocks(p.to_local(), update, view, lo=tp.rank * per, length=per)
        elif view is not None:
            update = _momentum(grad, state, momentum, nesterov)
            blocks = _view_blocks(p, update, view, lo=0, length=int(info.shape[view.dim]))
        else:
            blocks = None
        compute_device = _compute_device(info)
        if blocks is not None:  # each block as its own matrix: its NS, its adjust_lr
            for p_block, u_block, i in blocks:
                shape = tuple(p_block.shape)
                nz = normalize_fn(state[_nm.SECOND_MOMENT_KEY], info, i, shape) if normuon else None
                items.append(_u.Matrices(param=p_block, update=u_block, matrix_shape=shape, normalize=nz))
                item_devices.append(compute_device)
            continue
        shape = tuple(int(s) for s in info.matrix_shape)
        buf = state.get("momentum_buffer")
        if buf is None:  # state cleared by hand: zeros, as torch creates them
            buf = state["momentum_buffer"] = torch.zeros_like(grad, memory_format=torch.preserve_format)
        to_m = from_m = nz_units = None
        unit_matrices = 0
        nz = normalize_fn(state[_nm.SECOND_MOMENT_KEY], info, None, shape) if normuon else None
        if stack is not None:  # an expert stack (this rank's experts): its (k, out, in) Muon matrices,
            # cut between experts where a range exceeds a run (dmuon.plan._rules.ns_batch_pieces)
            to_m = functools.partial(stack_to_matrices, stack=stack)
            from_m = functools.partial(_to_stack, stack=stack, tail=tuple(p.shape[1:]), matrix_shape=shape)
            unit_matrices = int(stack.matrices_per_expert)
            if normuon:  # NorMuon's rows of experts [lo, hi): dim 0 of its second moment
                v = state[_nm.SECOND_MOMENT_KEY]
                nz_units = functools.partial(_expert_normalize, normalize_fn, v, info, shape)
        items.append(
            _u.Matrices(
                param=p,
                grad=grad,
                buf=buf,
                matrix_shape=shape,
                num_matrices=int(info.num_matrices),
                to_matrices=to_m,
                from_matrices=from_m,
                normalize=nz,
                unit_matrices=unit_matrices,
                normalize_units=nz_units,
            )
        )
        item_devices.append(compute_device)

    for device in dict.fromkeys(item_devices):  # in place first (one call when nothing is offloaded), then per device
        _u.muon_update(
            [it for it, d in zip(items, item_devices) if d == device],
            lr=lr,
            weight_decay=weight_decay,
            momentum=momentum,
            nesterov=nesterov,
            adjust_lr_fn=adjust_lr_fn,
            coefficients=ns_kw["coefficients"],
            steps=ns_kw["steps"],
            eps=ns_kw["eps"],
            dtype=ns_kw["dtype"],
            ns_batching=group.get("ns_batching", "batched"),
            # "auto" decided once per call's shape; every backend resolved from ns_backends at call time
            kernel=lambda sides: _ns.resolve_ns_backend(backend, sides, steps=group["ns_steps"]),
            # offloaded: each run copied to the compute device and back, double-buffered
            stage=None if device is None else _offload_stage.staged_runs(device),
        )

    if not (tp_entries or grouped_entries):
        return

    def apply(p: Tensor, ortho: Tensor, matrix_shape) -> None:  # the TP and owner-group paths (no NorMuon there)
        if ortho.shape != p.shape:
            ortho = ortho.reshape(p.shape)
        scaled = _u.adjust_lr(lr, adjust_lr_fn, matrix_shape)
        _u.decay_and_apply_([p], [ortho], lr=lr, weight_decay=weight_decay, scaled_lrs=[scaled])

    if tp_entries:
        _tp.orthogonalize_and_apply(
            tp_entries, steps=group["ns_steps"], orthogonalize=orthogonalize, ns_kw=ns_kw, apply=apply
        )
    if grouped_entries:
        _tp.orthogonalize_groups_and_apply(grouped_entries, steps=group["ns_steps"], ns_kw=ns_kw, apply=apply)


def _compute_device(info) -> Optional[torch.device]:
    """The compute device of an offloaded matrix (its runtime's ``offload``), else None."""
    runtime = getattr(info, "runtime", None)
    rt = runtime() if callable(runtime) else None
    offload = getattr(rt, "offload", None)
    return None if offload is None else offload.compute_device


def _to_stack(ortho: Tensor, *, stack, tail: tuple[int, ...], matrix_shape) -> Tensor:
    """``(k, out, in)`` matrices (whole experts) back to an expert stack's storage shape
    ``(k / matrices_per_expert, *tail)``."""
    mats = ortho.reshape(-1, *matrix_shape)
    return matrices_to_stack(mats, stack, (mats.shape[0] // stack.matrices_per_expert, *tail))


def _expert_normalize(normalize_fn, v: Tensor, info, matrix_shape, lo: int, hi: int):
    """NorMuon's ``normalize`` of experts ``[lo, hi)`` of an owned range (its second moment's rows
    of those experts: ``v[lo:hi]``, a view written in place)."""
    return normalize_fn(v[lo:hi], info, None, matrix_shape)


def _normuon(ortho: Tensor, *, v: Tensor, info, block, matrix_shape, group: dict) -> Tensor:
    """NorMuon's normalisation (:func:`dmuon._update.normuon_normalize`) of the orthogonalised
    ``ortho`` (one matrix ``(m, n)`` or ``k`` of them) with the rows of ``v`` it covers (view block
    ``block``, or all of ``v``); ``v`` updated in place. Returns the fp32 update in ``ortho``'s shape."""
    m, n = matrix_shape
    rows = _nm.second_moment_rows(v, info, block, m)
    update, rows_new = _u.normuon_normalize(
        ortho.reshape(-1, m, n), rows, beta2=group["normuon_beta2"], eps=group["normuon_eps"]
    )
    _nm.write_second_moment_rows(v, rows_new, info, block)
    return update.reshape(ortho.shape)


def _ns_settings(group: dict) -> tuple[Callable, dict]:
    """The group's Newton-Schulz backend and its keyword arguments (``coefficients, steps, eps,
    dtype``)."""
    orthogonalize = _ns.get_ns_backend(group.get("ns_backend", "standard"))
    ns_kw = dict(
        coefficients=_u.coefficient_schedule(group["ns_coefficients"], group["ns_steps"]),
        steps=group["ns_steps"],
        eps=group["eps"],
        dtype=_as_dtype(group["ns_dtype"], "ns_dtype"),
    )
    return orthogonalize, ns_kw


def _momentum(grad: Tensor, state: dict, momentum: float, nesterov: bool) -> Tensor:
    """:func:`dmuon._update.momentum_` of one gradient; the buffer is created as zeros when
    missing (e.g. state cleared by hand), as torch does."""
    buf = state.get("momentum_buffer")
    if buf is None:
        buf = state["momentum_buffer"] = torch.zeros_like(grad, memory_format=torch.preserve_format)
    return _u.momentum_([grad], [buf], momentum=momentum, nesterov=nesterov)[0]


def _tp_momentum_update(grad: Tensor, state: dict, tp, momentum: float, nesterov: bool) -> Tensor:
    """:func:`_momentum` of a TP-sharded matrix on its local shard (the buffer is a DTensor with
    the matrix's placement); returns the local NS input."""
    g_local = tp.local(grad)
    buf = state.get("momentum_buffer")
    if buf is None:
        buf = state["momentum_buffer"] = tp.wrap(torch.zeros_like(g_local))
    return _u.momentum_([g_local], [tp.local(buf)], momentum=momentum, nesterov=nesterov)[0]


def _view_blocks(p: Tensor, update: Tensor, view, *, lo: int, length: int) -> list[tuple[Tensor, Tensor, int]]:
    """``(parameter block, update block, block index)`` triples of a :class:`~dmuon.plan._records.params.MatrixView`
    for the blocks inside ``[lo, lo + length)`` of its dim (``p`` / ``update`` hold that range:
    the whole matrix, or one TP rank's shard). Parameter blocks are views (updated in place);
    update blocks are contiguous copies, as ``torch.optim.Muon`` sees a block of its own."""
    out = []
    for i, (off, size) in enumerate(zip(view.offsets(), view.sizes)):
        if lo <= off < lo + length:
            start = off - lo
            out.append((p.narrow(view.dim, start, size), update.narrow(view.dim, start, size).contiguous(), i))
    return out
