"""One Muon step as stateless functions (as torch.optim's ``_single_tensor_muon``):
:func:`muon_step` runs a Muon param group; :class:`dmuon.Muon` (:mod:`dmuon.exec._optim.muon`) holds
the hyper-parameters and state and calls it. See docs/runtime.md ("The optimizer")."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Optional

import torch
from torch import Tensor

from dmuon.plan import _rules as _rules
from dmuon.plan._records.fields import dtype_str

from dmuon.exec._optim import ns_backends as _ns
from dmuon.exec._optim import normuon_update as _nm
from dmuon.exec._optim import ns_coefficients as _nsc
from dmuon.exec._optim import tp_orthogonalize as _tp
from dmuon.exec._runtime.packed_buffers import dedicated_info
from dmuon.exec._optim.expert_update import matrices_to_stack, stack_to_matrices

__all__ = ["adjust_lr", "muon_step"]

_ADJUST_LR_FNS = (None, "original", "match_rms_adamw")


def adjust_lr(lr: float, adjust_lr_fn: Optional[str], matrix_shape: Sequence[int]) -> float:
    """Learning rate of the orthogonalised update of one ``(m, n)`` matrix.

    Same rule and float op order as ``torch.optim._muon._adjust_lr``:

    - ``None`` / ``"original"`` (Jordan et al. 2024): ``lr * sqrt(max(1, m / n))``;
    - ``"match_rms_adamw"`` (Moonlight, arXiv 2502.16982): ``lr * 0.2 * sqrt(max(m, n))``,
      which gives the update the RMS of a typical AdamW update so AdamW's lr and weight
      decay transfer.

    ``matrix_shape`` is the matrix view ``(m, n)`` (for a conv weight ``(out, in·kh·kw)``,
    for an expert stack one expert's ``(m, n)``), never the raw parameter shape.

    Raises:
        ValueError: an unknown ``adjust_lr_fn``.
    """
    A, B = matrix_shape[0], matrix_shape[1]
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        ratio = math.sqrt(max(1, A / B))
    elif adjust_lr_fn == "match_rms_adamw":
        ratio = 0.2 * math.sqrt(max(A, B))
    else:
        raise ValueError(f"unknown adjust_lr_fn {adjust_lr_fn!r}; expected one of {_ADJUST_LR_FNS}")
    return lr * ratio


def _as_dtype(value: Any, what: str) -> torch.dtype:
    if isinstance(value, str):
        resolved = getattr(torch, value.removeprefix("torch."), None)
        if not isinstance(resolved, torch.dtype):
            raise ValueError(f"{what}: {value!r} does not name a torch dtype")
        value = resolved
    if not isinstance(value, torch.dtype) or not value.is_floating_point:
        raise ValueError(f"{what} must be a real floating-point torch.dtype, got {value!r}")
    return value


# ----------------------------------------------------------------------------------------------
# One Muon step, piece by piece (each torch.optim._muon._single_tensor_muon's ops, in its order)
# ----------------------------------------------------------------------------------------------


def muon_step(group: dict, states) -> None:
    """Muon on the matrices of ``group`` this rank owns that have a gradient (see
    :class:`dmuon.Muon`): momentum, then Newton-Schulz per matrix or per bucket, then (variant
    ``"normuon"``) NorMuon's row normalisation (:mod:`dmuon.exec._optim.normuon_update`), then the update.
    ``states``: the optimizer's ``state`` (``states[p]`` holds ``p``'s momentum buffer and, for
    NorMuon, its second moment)."""
    lr = group["lr"]
    if isinstance(lr, Tensor):
        lr = lr.item()
    weight_decay, adjust_lr_fn = group["weight_decay"], group["adjust_lr_fn"]
    orthogonalize, ns_kw = _ns_settings(group)

    stacks: dict[int, Any] = {}  # id(p) -> ExpertStack of an expert stack whose update is in matrix layout
    normuon = group.get("variant", "muon") == "normuon"
    second: dict[int, tuple[Tensor, Any, Optional[int]]] = {}  # id(p or view block) -> (v, info, block)

    def apply(p: Tensor, ortho: Tensor, matrix_shape) -> None:
        if normuon:
            v, info, block = second[id(p)]
            ortho = _normuon(ortho, v, info, block, matrix_shape, group)
        stack = stacks.get(id(p))
        if stack is not None:  # (k, out, in) matrices back to the stack's storage layout
            ortho = matrices_to_stack(ortho.reshape(-1, *matrix_shape), stack, tuple(p.shape))
        _apply_update(p, ortho, lr, weight_decay, adjust_lr(lr, adjust_lr_fn, matrix_shape))

    # fp32 / fp64 NS batched by bucket (the rule in dmuon.plan._rules, which the simulator prices by)
    batched = dtype_str(ns_kw["dtype"]) in _rules.NS_BATCHED_DTYPES
    buckets: dict[tuple, list[tuple[Tensor, Tensor, int, int, int]]] = {}
    tp_entries: list[tuple[Tensor, Tensor, Any]] = []
    grouped_entries: list[tuple[Tensor, Tensor, Any]] = []
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
            update = _momentum_update(grad, state, group["momentum"], group["nesterov"])
            grouped_entries.append((p, update, og))
            continue
        if tp is not None:  # TP-sharded: momentum on the local shard, NS on the TP group below
            update = _tp_momentum_update(grad, state, tp, group["momentum"], group["nesterov"])
            if tp.method != "local":
                tp_entries.append((p, update, tp))
                continue
            # view blocks inside this rank's shard: orthogonalised here like untouched matrices
            per = tp.shape[tp.shard_dim] // tp.size
            blocks = _view_blocks(p.to_local(), update, view, lo=tp.rank * per, length=per)
        elif view is not None:
            update = _momentum_update(grad, state, group["momentum"], group["nesterov"])
            blocks = _view_blocks(p, update, view, lo=0, length=int(info.shape[view.dim]))
        else:
            blocks = None
        if blocks is not None:  # each block as its own matrix: its NS, its adjust_lr
            for p_block, u_block, i in blocks:
                m, n = p_block.shape
                if normuon:
                    second[id(p_block)] = (state[_nm.SECOND_MOMENT_KEY], info, i)
                if batched:
                    buckets.setdefault(_bucket_key(u_block, m, n), []).append((p_block, u_block, 1, m, n))
                else:
                    apply(p_block, _orthogonalize_matrices(u_block, 1, m, n, orthogonalize, ns_kw), (m, n))
            continue
        update = _momentum_update(grad, state, group["momentum"], group["nesterov"])
        m, n = (int(s) for s in info.matrix_shape)
        k = int(info.num_matrices)
        if normuon:
            second[id(p)] = (state[_nm.SECOND_MOMENT_KEY], info, None)
        if stack is not None:  # an expert stack (this rank's experts): its (k, out, in) Muon matrices
            update = stack_to_matrices(update, stack)
            stacks[id(p)] = stack
        if batched:
            buckets.setdefault(_bucket_key(update, m, n), []).append((p, update, k, m, n))
            continue
        apply(p, _orthogonalize_matrices(update, k, m, n, orthogonalize, ns_kw), (m, n))

    for (d, D, _, _), entries in buckets.items():
        # "auto" decided once per bucket (its shape): the picked backend's own calls
        fn = _ns.resolve_ns_backend(group.get("ns_backend", "standard"), (d, D), steps=group["ns_steps"])
        for chunk in _chunks(entries, d * D):
            for (p, _, _, m, n), o in zip(chunk, _orthogonalize_bucket(chunk, fn, ns_kw)):
                apply(p, o, (m, n))

    if tp_entries:
        _tp.orthogonalize_and_apply(
            tp_entries, steps=group["ns_steps"], orthogonalize=orthogonalize, ns_kw=ns_kw, apply=apply
        )
    if grouped_entries:
        _tp.orthogonalize_groups_and_apply(grouped_entries, steps=group["ns_steps"], ns_kw=ns_kw, apply=apply)


def _normuon(ortho: Tensor, v: Tensor, info, block, matrix_shape, group: dict) -> Tensor:
    """NorMuon's normalisation of the orthogonalised ``ortho`` (one matrix ``(m, n)`` or ``k`` of
    them) with the rows of ``v`` it covers (view block ``block``, or all of ``v``); ``v`` updated
    in place. Returns the fp32 update in ``ortho``'s shape."""
    m, n = matrix_shape
    rows = _nm.second_moment_rows(v, info, block, m)
    update, rows_new = _nm.normalize(
        ortho.reshape(-1, m, n), rows, beta2=group["normuon_beta2"], eps=group["normuon_eps"]
    )
    _nm.write_second_moment_rows(v, rows_new, info, block)
    return update.reshape(ortho.shape)


def _ns_settings(group: dict) -> tuple[Callable, dict]:
    """The group's Newton-Schulz backend and its keyword arguments (``coefficients, steps, eps,
    dtype``)."""
    orthogonalize = _ns.get_ns_backend(group.get("ns_backend", "standard"))
    ns_kw = dict(
        coefficients=_nsc.coefficient_schedule(group["ns_coefficients"], group["ns_steps"]),
        steps=group["ns_steps"],
        eps=group["eps"],
        dtype=_as_dtype(group["ns_dtype"], "ns_dtype"),
    )
    return orthogonalize, ns_kw


def _momentum_update(grad: Tensor, state: dict, momentum: float, nesterov: bool) -> Tensor:
    """``buf.lerp_(g, 1 - momentum)``; the NS input is ``g.lerp(buf, momentum)`` (Nesterov) or
    ``buf``. The buffer is created as zeros when missing (e.g. state cleared by hand), as torch does."""
    buf = state.get("momentum_buffer")
    if buf is None:
        buf = state["momentum_buffer"] = torch.zeros_like(grad, memory_format=torch.preserve_format)
    buf.lerp_(grad, 1 - momentum)
    return grad.lerp(buf, momentum) if nesterov else buf


def _tp_momentum_update(grad: Tensor, state: dict, tp, momentum: float, nesterov: bool) -> Tensor:
    """:func:`_momentum_update` of a TP-sharded matrix on its local shard (the buffer is a
    DTensor with the matrix's placement); returns the local NS input."""
    g_local = tp.local(grad)
    buf = state.get("momentum_buffer")
    if buf is None:
        buf = state["momentum_buffer"] = tp.wrap(torch.zeros_like(g_local))
    b_local = tp.local(buf)
    b_local.lerp_(g_local, 1 - momentum)
    return g_local.lerp(b_local, momentum) if nesterov else b_local


def _orthogonalize_matrices(update: Tensor, k: int, m: int, n: int, orthogonalize, ns_kw: dict) -> Tensor:
    """Unbatched NS: one 2-D call per ``(m, n)`` matrix (an expert stack loops over its ``k``)."""
    if k == 1:
        mat = update if tuple(update.shape) == (m, n) else update.reshape(m, n)
        return orthogonalize(mat, **ns_kw)
    stack = update.reshape(k, m, n)
    ortho = torch.empty((k, m, n), dtype=ns_kw["dtype"], device=update.device)
    for i in range(k):
        ortho[i] = orthogonalize(stack[i], **ns_kw)
    return ortho


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


def _bucket_key(update: Tensor, m: int, n: int) -> tuple:
    """Batched NS bucket: tall and wide matrices of the same (min, max) side share one (NS of a
    tall G is the transpose of NS of the wide Gᵀ; newton_schulz itself transposes)."""
    return (*_rules.ns_bucket_sides(m, n), update.dtype, update.device)


def _orthogonalize_bucket(chunk: list, orthogonalize, ns_kw: dict) -> list[Tensor]:
    """Batched NS of one chunk of bucket entries ``(p, update, k, m, n)``: one call on their
    ``(B, d, D)`` concatenation (a lone 2-D matrix uses the 2-D path); one result per entry,
    in its own orientation."""
    if len(chunk) == 1 and chunk[0][2] == 1:
        _, update, _, m, n = chunk[0]
        mat = update if tuple(update.shape) == (m, n) else update.reshape(m, n)
        return [orthogonalize(mat, **ns_kw)]
    # (k, d, D) wide views; tall (k, D, d) matrices enter transposed.
    views = [u.reshape(k, m, n).mT if m > n else u.reshape(k, m, n) for _, u, k, m, n in chunk]
    stack = views[0] if len(views) == 1 else torch.cat(views)
    ortho = orthogonalize(stack, **ns_kw)
    return [o.mT if m > n else o for o, (_, _, _, m, n) in zip(ortho.split([e[2] for e in chunk]), chunk)]


def _apply_update(p: Tensor, ortho: Tensor, lr: float, weight_decay: float, scaled_lr: float) -> None:
    """Decoupled weight decay, then the scaled orthogonalised update (``_single_tensor_muon``)."""
    p.mul_(1 - lr * weight_decay)
    p.add_(ortho if ortho.shape == p.shape else ortho.reshape(p.shape), alpha=-scaled_lr)


def _chunks(entries: list, matrix_numel: int) -> Iterable[list]:
    """Bucket entries ``(p, update, k, m, n)`` as batched NS calls (:func:`dmuon.plan._rules.ns_batch_runs`)."""
    for run in _rules.ns_batch_runs([entry[2] * matrix_numel for entry in entries]):
        yield [entries[i] for i in run]
