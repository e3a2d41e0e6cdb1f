"""The standard Newton-Schulz iteration (backend ``"standard"``), on one matrix or a batch.

:func:`newton_schulz` maps a matrix ``G`` (or a batch of matrices) to an approximation of the
orthogonal polar factor ``U Vᵀ`` of ``G = U S Vᵀ``; a pure function, the module holds no state.
It is the default everywhere, and the only backend of the numerical contract (the README's "The
oracle guarantee": same losses and parameters as one process running ``torch.optim.Muon``, up
to reduction order). The other backends and how callers resolve them:
:mod:`dmuon.exec._optim.ns_backends`; coefficients: :mod:`dmuon.exec._optim.ns_coefficients`.

The iteration (Jordan et al. 2024, "Muon: An optimizer for hidden layers in neural
networks", https://kellerjordan.github.io/posts/muon/) is the odd quintic

    X₀   = G / max(‖G‖_F, eps)            (so the spectral norm is <= 1)
    A    = Xₖ Xₖᵀ
    B    = b·A + c·A·A
    Xₖ₊₁ = a·Xₖ + B·Xₖ                    = a·X + b·(XXᵀ)X + c·(XXᵀ)²X

run on the wide orientation (rows <= columns) so that the Gram matrix ``A`` is the small
(min(m, n))² one. With the "muon" coefficients the singular values land roughly in
[0.7, 1.2] after 5 steps rather than at exactly 1, which does not hurt training.

Sources: Keller Jordan's reference implementation
(https://github.com/KellerJordan/Muon/blob/master/muon.py) and its PyTorch port
``torch.optim._muon._zeropower_via_newtonschulz``, which :func:`newton_schulz` reproduces
bit for bit on 2-D bf16 input.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

# The FLOP formula (the cost model) is written once, in the torch-free planner; re-exported here.
from dmuon.plan._cost.flops import ns_flops

from dmuon.exec._optim.ns_coefficients import Coefficients, Triple, coefficient_schedule

__all__ = ["newton_schulz", "ns_flops"]


def newton_schulz(
    x: Tensor,
    *,
    coefficients: Coefficients = (3.4445, -4.775, 2.0315),
    steps: int = 5,
    eps: float = 1e-7,
    dtype: torch.dtype = torch.bfloat16,
) -> Tensor:
    """Approximately orthogonalise ``x`` (its polar factor) with a quintic Newton-Schulz iteration.

    Shapes:
        ``x`` is one matrix ``(m, n)`` or a batch ``(B, m, n)`` (more leading dimensions
        ``(..., m, n)`` are flattened into the batch and restored). The result has the
        shape of ``x`` and dtype ``dtype``. ``x`` is never modified.

    Algorithm, in this exact op order (the order of
    ``torch.optim._muon._zeropower_via_newtonschulz``):

    1. ``X = x.to(dtype)`` (always a copy);
    2. if ``m > n``, ``X = Xᵀ`` (a transposed view: iterate on the wide orientation, whose
       Gram matrix is ``min(m, n)²``);
    3. ``X /= ‖X‖_F.clamp(min=eps)``; batched input uses each matrix's own norm;
    4. for each step with coefficients ``(a, b, c)``:
       ``A = X @ Xᵀ``; ``B = addmm(A, A, A, beta=b, alpha=c)``;
       ``X = addmm(X, B, X, beta=a)`` (``bmm``/``baddbmm`` when batched);
    5. transpose back if step 2 did.

    For a 2-D ``x`` and ``dtype=torch.bfloat16`` the result is bit-identical to
    ``torch.optim._muon._zeropower_via_newtonschulz(x, coefficients, steps, eps)`` (same
    kernels, same operands, same layouts), except that torch divides in place and so
    mutates its input when that is already bf16; this function never does. Batched input
    equals looping over the matrices up to floating-point reduction order of ``bmm``
    versus ``mm`` (identical on most CPU builds, not guaranteed). As in torch, the 2-D
    result of a tall matrix is a transposed (non-contiguous) view.

    Args:
        x: real floating-point tensor, ``x.ndim >= 2``.
        coefficients: ``(a, b, c)`` used at every step, a sequence of ``steps`` triples
            (one per step), or a :data:`NS_PRESETS` key. Default: the "muon" preset.
        steps: number of iterations, ``0 <= steps < 100`` (default 5).
        eps: lower clamp of the Frobenius norm; an all-zero matrix maps to zeros.
        dtype: dtype of the whole iteration and of the result (default bf16, as
            ``torch.optim.Muon``; ``torch.float32`` for the tight numerical contract).

    Returns:
        Tensor of ``x.shape`` in ``dtype``.

    Raises:
        ValueError: ``x.ndim < 2``, complex ``x``, or a bad coefficient spec / ``steps``
            (see :func:`coefficient_schedule`).
    """
    _check_input(x, dtype, "newton_schulz")
    schedule = coefficient_schedule(coefficients, steps)
    return _newton_schulz(x, schedule, eps, dtype)


def _check_input(x: Tensor, dtype: torch.dtype, who: str) -> None:
    if x.ndim < 2:
        raise ValueError(f"{who} needs a matrix or a batch of matrices, got shape {tuple(x.shape)}")
    if x.is_complex() or dtype.is_complex:
        raise ValueError(f"{who} supports real tensors only")


def _newton_schulz(x: Tensor, schedule: tuple[Triple, ...], eps: float, dtype: torch.dtype) -> Tensor:
    """:func:`newton_schulz` on a resolved schedule, without validation (also the redo of
    :func:`gram_newton_schulz`'s fallback)."""
    m, n = x.shape[-2], x.shape[-1]

    if x.ndim == 2:
        X = x.to(dtype, copy=True)
        if m > n:
            X = X.T
        X.div_(X.norm().clamp(min=eps))
        for a, b, c in schedule:
            A = X @ X.T
            B = torch.addmm(A, A, A, beta=b, alpha=c)
            X = torch.addmm(X, B, X, beta=a)
        if m > n:
            X = X.T
        return X

    # Batched: the same kernels on the same operands as above, so the same values, with the
    # call's tensors allocated once: A and B, and two (B, d, D) buffers the steps alternate
    # between (the first is the normalised copy of x, reinterpreted in the wide layout once the
    # first step has read it). A fresh tensor per step costs page faults on CPU.
    lead = x.shape[:-2]
    batch = math.prod(lead)
    tall = m > n
    d, D = (n, m) if tall else (m, n)
    src = x.reshape(batch, m, n)
    if src.dtype == dtype:  # the normalised copy in one pass: x / ‖x‖ (same values as copy, then /=)
        norms = torch.linalg.vector_norm(src, dim=(-2, -1), keepdim=True)
        Xc = torch.div(src, norms.clamp_(min=eps))
    else:
        Xc = src.to(dtype, copy=True)
        norms = torch.linalg.vector_norm(Xc, dim=(-2, -1), keepdim=True)
        Xc.div_(norms.clamp_(min=eps))
    X = Xc.mT if tall else Xc
    if schedule:
        A = Xc.new_empty((batch, d, d))
        Bm = torch.empty_like(A)
        bufs: list[Optional[Tensor]] = [Xc.view(batch, d, D), None]
        for k, (a, b, c) in enumerate(schedule):
            torch.bmm(X, X.mT, out=A)
            torch.baddbmm(A, A, A, beta=b, alpha=c, out=Bm)
            out = bufs[(k + 1) % 2]
            if out is None:
                out = bufs[1] = Xc.new_empty((batch, d, D))
            X = torch.baddbmm(X, Bm, X, beta=a, out=out)
    if tall:
        X = X.mT
    return X.reshape(*lead, m, n)
