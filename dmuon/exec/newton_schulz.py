"""Newton-Schulz orthogonalisation: stateless backends and coefficient presets.

Everything here is a pure function of its arguments (the only side effect is the
process-local counter :data:`NS_CALLS`). Momentum, learning rates and parameter updates
live in :mod:`dmuon.exec.optim`; this module only maps a matrix ``G`` (or a batch of
matrices) to an approximation of the orthogonal polar factor ``U Vᵀ`` of ``G = U S Vᵀ``.

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
import numbers
from collections.abc import Sequence
from typing import Union

import torch
from torch import Tensor

__all__ = [
    "NS_PRESETS",
    "NS_CALLS",
    "Coefficients",
    "coefficient_schedule",
    "newton_schulz",
    "ns_flops",
    "reset_ns_calls",
]

Triple = tuple[float, float, float]
#: A coefficient spec: one ``(a, b, c)`` triple used at every step, a sequence of triples
#: (one per step), or the name of an entry of :data:`NS_PRESETS`.
Coefficients = Union[str, Sequence[float], Sequence[Sequence[float]]]

#: Coefficient presets, by name. A value is either one ``(a, b, c)`` triple used at every
#: step, or a tuple of triples, one per step (its length then fixes the number of steps).
#:
#: - ``"muon"``: ``(3.4445, -4.775, 2.0315)``, Jordan et al. 2024; the default of
#:   ``torch.optim.Muon``. Chosen to maximise the slope at zero; converges to
#:   singular values in about [0.7, 1.2], not to 1.
NS_PRESETS: dict[str, Union[Triple, tuple[Triple, ...]]] = {
    "muon": (3.4445, -4.775, 2.0315),
}

#: Number of matrices orthogonalised by :func:`newton_schulz` in this process since import
#: or the last :func:`reset_ns_calls` (a batch of B matrices counts B). Read it as
#: ``dmuon.exec.newton_schulz.NS_CALLS`` (a ``from ... import`` copies the int).
NS_CALLS: int = 0

_MAX_STEPS = 100  # torch.optim.Muon refuses ns_steps >= 100 "for computational efficiency"


def reset_ns_calls() -> int:
    """Set :data:`NS_CALLS` to 0 and return the value it had."""
    global NS_CALLS
    previous, NS_CALLS = NS_CALLS, 0
    return previous


def _is_triple(value: object) -> bool:
    return (
        isinstance(value, Sequence)
        and not isinstance(value, str)
        and len(value) == 3
        and all(isinstance(v, numbers.Real) and not isinstance(v, bool) for v in value)
    )


def coefficient_schedule(coefficients: Coefficients, steps: int) -> tuple[Triple, ...]:
    """Resolve a coefficient spec to one ``(a, b, c)`` triple per step.

    Args:
        coefficients: a triple ``(a, b, c)`` used at every step; a sequence of exactly
            ``steps`` triples, one per step; or a key of :data:`NS_PRESETS`.
        steps: number of Newton-Schulz steps, ``0 <= steps < 100``.

    Returns:
        A tuple of ``steps`` triples of Python floats.

    Raises:
        ValueError: unknown preset name, a malformed triple, a per-step table whose
            length differs from ``steps``, or ``steps`` out of range.
        TypeError: ``steps`` is not an int.
    """
    if isinstance(steps, bool) or not isinstance(steps, int):
        raise TypeError(f"steps must be an int, got {type(steps).__name__}")
    if not 0 <= steps < _MAX_STEPS:
        raise ValueError(
            f"steps must satisfy 0 <= steps < {_MAX_STEPS} (as torch.optim.Muon), got {steps}"
        )
    if isinstance(coefficients, str):
        try:
            coefficients = NS_PRESETS[coefficients]
        except KeyError:
            raise ValueError(
                f"unknown Newton-Schulz preset {coefficients!r}; known: {sorted(NS_PRESETS)}"
            ) from None
    if _is_triple(coefficients):
        a, b, c = (float(v) for v in coefficients)  # type: ignore[union-attr]
        return ((a, b, c),) * steps
    if isinstance(coefficients, Sequence) and not isinstance(coefficients, str):
        table = tuple(coefficients)
        bad = [i for i, t in enumerate(table) if not _is_triple(t)]
        if bad:
            raise ValueError(
                "coefficients must be an (a, b, c) triple of real numbers or a sequence of "
                f"such triples, one per step; entries {bad} of {coefficients!r} are not triples"
            )
        if len(table) != steps:
            raise ValueError(
                f"per-step coefficient table has {len(table)} triples but steps={steps}"
            )
        return tuple(tuple(float(v) for v in t) for t in table)  # type: ignore[misc]
    raise ValueError(
        "coefficients must be an (a, b, c) triple, a sequence of triples (one per step) or "
        f"a preset name from {sorted(NS_PRESETS)}; got {coefficients!r}"
    )


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

    Side effect: :data:`NS_CALLS` grows by the number of matrices (``prod(x.shape[:-2])``,
    1 for 2-D input).
    """
    global NS_CALLS
    if x.ndim < 2:
        raise ValueError(f"newton_schulz needs a matrix or a batch of matrices, got shape {tuple(x.shape)}")
    if x.is_complex() or dtype.is_complex:
        raise ValueError("newton_schulz supports real tensors only")
    schedule = coefficient_schedule(coefficients, steps)
    m, n = x.shape[-2], x.shape[-1]

    if x.ndim == 2:
        NS_CALLS += 1
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

    lead = x.shape[:-2]
    batch = math.prod(lead)
    NS_CALLS += batch
    X = x.reshape(batch, m, n).to(dtype, copy=True)
    if m > n:
        X = X.mT
    norms = torch.linalg.vector_norm(X, dim=(-2, -1), keepdim=True)
    X.div_(norms.clamp_(min=eps))
    for a, b, c in schedule:
        A = torch.bmm(X, X.mT)
        B = torch.baddbmm(A, A, A, beta=b, alpha=c)
        X = torch.baddbmm(X, B, X, beta=a)
    if m > n:
        X = X.mT
    return X.reshape(*lead, m, n)


def ns_flops(m: int, n: int, steps: int, *, num_matrices: int = 1) -> int:
    """Matmul FLOPs of :func:`newton_schulz` on ``num_matrices`` matrices of shape ``(m, n)``.

    Formula (multiply-add = 2 FLOPs; elementwise work and the norm are ignored), with
    ``d = min(m, n)`` and ``D = max(m, n)``:

        ``num_matrices * steps * (4·d²·D + 2·d³)``

    per step: ``A = X Xᵀ`` costs ``2·d²·D``, ``A·A`` costs ``2·d³``, ``B·X`` costs
    ``2·d²·D``. This is the NS term of the plan cost model.

    Raises:
        ValueError: a negative argument.
    """
    if min(m, n, steps, num_matrices) < 0:
        raise ValueError(f"ns_flops arguments must be >= 0, got m={m} n={n} steps={steps} num_matrices={num_matrices}")
    if m > n:
        m, n = n, m
    return num_matrices * steps * (4 * m * m * n + 2 * m**3)
