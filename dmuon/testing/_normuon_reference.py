"""The NorMuon reference of :mod:`dmuon.testing`: a single-process NorMuon step, pure torch, stateless.

Pure functions, written from the paper and the authors' code; the algorithm is Note: NorMuon,
its deliberate differences to the authors' code Note: the NorMuon reference (docs/design.md).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Optional, Union

import torch
from torch import Tensor

from dmuon.testing._newton_schulz import reference_newton_schulz

__all__ = [
    "NORMUON_BETA2",
    "NORMUON_EPS",
    "MUON_COEFFICIENTS",
    "DEEPSEEK_V4_COEFFICIENTS",
    "adjust_lr",
    "newton_schulz",
    "normuon_normalize",
    "normuon_normalize_blocks",
    "normuon_step",
]

#: The authors' defaults (``normuon.py``: ``beta2=0.95``; ``1e-10`` in both the denominator and
#: the rescale). dion uses 1e-8 (hard-coded); Emerging-Optimizers clamps ``v`` at ``eps=1e-8``.
NORMUON_BETA2 = 0.95
NORMUON_EPS = 1e-10

MUON_COEFFICIENTS = (3.4445, -4.775, 2.0315)
#: DeepSeek-V4's schedule as NVIDIA-NeMo/Emerging-Optimizers ``muon_utils._COEFFICIENT_SETS
#: ["deepseekv4"]`` has it (commit dd79ab1, citing the DeepSeek-V4 report): 8 Muon steps, then
#: 2 steps of (2, -1.5, 0.5), whose polynomial has p(1) = 1, p'(1) = 0.
DEEPSEEK_V4_COEFFICIENTS = (MUON_COEFFICIENTS,) * 8 + ((2.0, -1.5, 0.5),) * 2

Triple = tuple[float, float, float]


# ------------------------------------------------------------------------------------ Muon parts


def adjust_lr(lr: float, adjust_lr_fn: Optional[str], matrix_shape: Sequence[int]) -> float:
    """dmuon's / ``torch.optim.Muon``'s learning-rate factor for one ``(out, in)`` matrix."""
    a, b = int(matrix_shape[0]), int(matrix_shape[1])
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        return lr * math.sqrt(max(1, a / b))
    if adjust_lr_fn == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(a, b))
    raise ValueError(f"unknown adjust_lr_fn {adjust_lr_fn!r}")


def newton_schulz(
    x: Tensor,
    coefficients: Union[Triple, Sequence[Triple]] = MUON_COEFFICIENTS,
    steps: int = 5,
    eps: float = 1e-7,
    dtype: torch.dtype = torch.float32,
) -> Tensor:
    """:func:`dmuon.testing.reference_newton_schulz` (``torch.optim.Muon``'s arithmetic in
    ``dtype``) of ``(m, n)`` or of each matrix of ``(..., m, n)``; ``x`` is not modified."""
    if x.ndim > 2:
        flat = x.reshape(-1, *x.shape[-2:])
        return torch.stack([newton_schulz(m, coefficients, steps, eps, dtype) for m in flat]).reshape(x.shape)
    return reference_newton_schulz(x, coefficients, steps, eps, dtype=dtype)


# ---------------------------------------------------------------------------- NorMuon stage


def normuon_normalize(
    ortho: Tensor,
    second_moment: Optional[Tensor] = None,
    *,
    beta2: float = NORMUON_BETA2,
    eps: float = NORMUON_EPS,
    dtype: torch.dtype = torch.float32,
) -> tuple[Tensor, Tensor]:
    """NorMuon's normalisation of orthogonalised updates ``ortho`` ``(..., out, in)``.

    Args:
        ortho: one matrix or a batch (leading dims), ``(out, in)`` orientation: the statistic
            is per row (output neuron), the mean over the last dim.
        second_moment: ``v`` of shape ``ortho.shape[:-1]`` (one entry per row of every matrix),
            or None for the initial zeros. Not modified.
        beta2, eps: EMA factor and the epsilon of both divisions (authors: 0.95, 1e-10).
        dtype: dtype of the whole computation and of both results (default fp32).

    Returns:
        ``(update, new_second_moment)``: the normalised update (``ortho.shape``) and ``v``.
    """
    o = ortho.to(dtype)
    rows = o.shape[:-1]
    if second_moment is None:
        v = torch.zeros(rows, dtype=dtype, device=o.device)
    else:
        if tuple(second_moment.shape) != tuple(rows):
            raise ValueError(f"second_moment must have shape {tuple(rows)}, got {tuple(second_moment.shape)}")
        v = second_moment.to(dtype)
    # (the authors' op order: norm, mean square, lerp, 1/(sqrt+eps), multiply, norm, rescale)
    norm = o.norm(dim=(-2, -1), keepdim=True)
    mean_sq = torch.mean(o * o, dim=-1, keepdim=True)
    v_new = torch.lerp(v.unsqueeze(-1), mean_sq, 1 - beta2)
    step_size = 1 / v_new.sqrt().add(eps)
    update = o * step_size
    norm_new = update.norm(dim=(-2, -1), keepdim=True)
    update = update * (norm / norm_new.add(eps))
    return update, v_new.squeeze(-1)


def normuon_normalize_blocks(
    blocks: Sequence[Tensor],
    dim: int,
    second_moment: Optional[Tensor] = None,
    *,
    beta2: float = NORMUON_BETA2,
    eps: float = NORMUON_EPS,
    all_reduce_sum: Callable[[list[Tensor]], Tensor] = lambda parts: torch.stack(parts).sum(0),
) -> tuple[list[Tensor], Tensor]:
    """:func:`normuon_normalize` of ONE ``(out, in)`` matrix held as blocks cut along ``dim``
    (an owner group or a TP split), with exactly one (simulated) all-reduce:

    - ``dim == 1`` (column blocks: every block has part of every row): all-reduce the ``out``
      partial row sums of squares; every member then holds the same ``s``, ``v`` (replicated)
      and both Frobenius norms (``‖O‖² = Σ s_i``, ``‖Ô‖² = Σ s_i / (sqrt(v_i) + eps)²``);
    - ``dim == 0`` (row blocks: whole rows): ``s``, ``v`` are local (each member its rows);
      all-reduce the two scalars ``(Σ s_i, Σ s_i / (sqrt(v_i) + eps)²)``.

    ``all_reduce_sum`` sums a list of per-member tensors (the collective). fp32. Returns the
    normalised blocks and the full ``v`` (``out``,). Equal to the unsplit computation up to
    the summation order of the norms.
    """
    n_in = sum(b.shape[1] for b in blocks) if dim == 1 else blocks[0].shape[1]
    o = [b.float() for b in blocks]
    m = o[0].shape[0] if dim == 1 else sum(b.shape[0] for b in o)
    v = torch.zeros(m) if second_moment is None else second_moment.float()
    if dim == 1:
        row_sq = all_reduce_sum([(b * b).sum(dim=1) for b in o])  # (out,): the one all-reduce
        v_new = torch.lerp(v, row_sq / n_in, 1 - beta2)
        d = 1 / v_new.sqrt().add(eps)
        fro, fro_new = row_sq.sum(), (row_sq * d * d).sum()
        ratio = fro.sqrt() / fro_new.sqrt().add(eps)
        return [b * (d * ratio).unsqueeze(1) for b in o], v_new
    offs = [0]
    for b in o:
        offs.append(offs[-1] + b.shape[0])
    row_sq = [(b * b).sum(dim=1) for b in o]
    v_new = [torch.lerp(v[lo:hi], s / n_in, 1 - beta2) for s, lo, hi in zip(row_sq, offs, offs[1:])]
    d = [1 / vb.sqrt().add(eps) for vb in v_new]
    sums = all_reduce_sum([torch.stack([s.sum(), (s * db * db).sum()]) for s, db in zip(row_sq, d)])  # 2 floats
    ratio = sums[0].sqrt() / sums[1].sqrt().add(eps)
    return [b * (db * ratio).unsqueeze(1) for b, db in zip(o, d)], torch.cat(v_new)


# ------------------------------------------------------------------------------- one step


def normuon_step(
    param: Tensor,
    grad: Optional[Tensor],
    momentum_buffer: Optional[Tensor],
    second_moment: Optional[Tensor],
    *,
    lr: float,
    weight_decay: float = 0.1,
    momentum: float = 0.95,
    nesterov: bool = True,
    beta2: float = NORMUON_BETA2,
    eps: float = NORMUON_EPS,
    ns_coefficients: Union[Triple, Sequence[Triple]] = MUON_COEFFICIENTS,
    ns_steps: int = 5,
    ns_eps: float = 1e-7,
    ns_dtype: torch.dtype = torch.float32,
    adjust_lr_fn: Optional[str] = None,
    orthogonalize: Optional[Callable[[Tensor], Tensor]] = None,
    none_grad: str = "skip",
) -> tuple[Tensor, Optional[Tensor], Optional[Tensor]]:
    """One NorMuon step of one Muon matrix ``(out, in)`` or a batch of them ``(k, out, in)``.

    Order (dmuon's ``muon_step`` + the NorMuon stage):

    1. ``buf = momentum_buffer.lerp(grad, 1 - momentum)`` (zeros when None);
    2. NS input ``grad.lerp(buf, momentum)`` (Nesterov) or ``buf``;
    3. ``O = newton_schulz(input)`` per matrix in ``ns_dtype`` (or ``orthogonalize(input)``);
    4. ``(U, v) = normuon_normalize(O, second_moment)`` in fp32;
    5. ``p = p·(1 - lr·weight_decay)``, then ``p -= adjust_lr(lr, adjust_lr_fn, (out, in))·U``.

    Args:
        param, grad, momentum_buffer: ``(out, in)`` or ``(k, out, in)``; never modified.
        second_moment: ``param.shape[:-1]`` fp32, or None (zeros).
        orthogonalize: replaces step 3 (tests inject a known polar factor).
        none_grad: ``"skip"`` (default: a None ``grad`` leaves everything as it was, as
            torch.optim.Muon and dmuon) or ``"zeros"`` (the authors: a zero gradient, the
            step runs, no weight decay).

    Returns:
        ``(new_param, new_momentum_buffer, new_second_moment)``.
    """
    if grad is None:
        if none_grad == "skip":
            return param, momentum_buffer, second_moment
        if none_grad != "zeros":
            raise ValueError(f"none_grad must be 'skip' or 'zeros', got {none_grad!r}")
        grad, decay = torch.zeros_like(param), 0.0
    else:
        decay = weight_decay
    if param.ndim not in (2, 3):
        raise ValueError(f"expected an (out, in) matrix or a (k, out, in) batch, got shape {tuple(param.shape)}")
    buf = torch.zeros_like(grad) if momentum_buffer is None else momentum_buffer
    buf = buf.lerp(grad, 1 - momentum)
    ns_in = grad.lerp(buf, momentum) if nesterov else buf
    if orthogonalize is not None:
        ortho = orthogonalize(ns_in)
    else:
        ortho = newton_schulz(ns_in, ns_coefficients, ns_steps, ns_eps, ns_dtype)
    update, v = normuon_normalize(ortho, second_moment, beta2=beta2, eps=eps)
    scaled_lr = adjust_lr(lr, adjust_lr_fn, param.shape[-2:])
    new = param * (1 - lr * decay)
    new = new.add(update.to(param.dtype), alpha=-scaled_lr)
    return new, buf, v
