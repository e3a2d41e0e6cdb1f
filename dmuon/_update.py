"""The Muon update as plain functions on tensors.

Momentum and Nesterov (:func:`momentum_`), decoupled weight decay and the scaled update
(:func:`decay_and_apply_`, :func:`adjust_lr`), the standard Newton-Schulz kernel
(:func:`newton_schulz`) and its coefficient presets (:data:`NS_PRESETS`), NorMuon's normalisation
(:func:`normuon_normalize`), and one step over many matrices (:func:`muon_update`;
:func:`single_tensor_muon` is ``torch.optim._muon._single_tensor_muon`` on plain tensors). No process
group, no dmuon tag, no state of its own: the caller's state tensors and parameters are updated in
place, as in torch.optim's functional API. ``ns_batching="exact"`` / ``"batched"`` and the bound
between them: Note: NS batching (docs/design.md).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Any, Optional, Union

import torch
from torch import Tensor

from dmuon.plan import _rules
from dmuon.plan._cost.flops import NS_STEPS

__all__ = [
    # coefficients
    "NS_PRESETS",
    "PRESET_LENGTH_POLICY",
    "DEFAULT_NS_STEPS",
    "DEEPSEEK_V4",
    "POLAR_EXPRESS_PUBLISHED",
    "POLAR_EXPRESS_SAFETY",
    "Coefficients",
    "coefficient_schedule",
    "resolve_ns_steps",
    "schedule_gain_bounds",
    # kernel
    "newton_schulz",
    # momentum, decay, learning rate
    "ADJUST_LR_FNS",
    "adjust_lr",
    "momentum_",
    "decay_and_apply_",
    # NorMuon
    "normuon_normalize",
    # many matrices
    "NS_BATCHING_MODES",
    "BATCHED_BF16_REL_BOUND",
    "orthogonalize_each",
    "orthogonalize_batch",
    "bucket_runs",
    "check_ns_batching",
    "Matrices",
    "muon_update",
    "single_tensor_muon",
]

# ----------------------------------------------------------------------------------------------
# Newton-Schulz coefficients: the preset table, a spec resolved to one triple per step, and a
# schedule's gain bounds. Each step of every backend is the odd quintic
# X <- a·X + b·(XXᵀ)X + c·(XXᵀ)²X. Presets are orthogonal to the backend; a per-step preset
# declares how it meets a step count (PRESET_LENGTH_POLICY); docs/newton_schulz.md compares them.
# ----------------------------------------------------------------------------------------------

Triple = tuple[float, float, float]
#: A coefficient spec: one ``(a, b, c)`` triple used at every step, a sequence of triples
#: (one per step), or the name of an entry of :data:`NS_PRESETS`.
Coefficients = Union[str, Sequence[float], Sequence[Sequence[float]]]

#: The Polar Express coefficient table, verbatim: Amsel, Persson, Musco, Gower, "The Polar
#: Express: Optimal Matrix Sign Methods and Their Application to the Muon Algorithm"
#: (arXiv 2505.16932), the degree-5 ``coeffs_list`` of the paper's Python listing, as
#: published in the authors' reference implementation
#: https://github.com/NoahAmsel/PolarExpress (``polar_express/basic.py`` at commit 7f0fb57,
#: ``_COEFFS``; the same numbers appear in that repository's ``gram_NS_diagnostic.py`` and,
#: the first five, in Dao-AILab/gram-newton-schulz ``coefficients.py``). One
#: ``(a_t, b_t, c_t)`` per step t = 1..8 of ``X <- a X + b (XXᵀ)X + c (XXᵀ)²X``: the paper's
#: optimal (minimax) odd quintics for singular values in ``[l, 1]`` with ``l = 1e-3``; the
#: last is the limit polynomial ``(15/8, -10/8, 3/8)``, which the reference repeats for steps
#: beyond 8.
#: These are data, never to be edited; the preset :data:`NS_PRESETS` ``["polar_express"]`` is
#: derived from them with :data:`POLAR_EXPRESS_SAFETY` (see there).
POLAR_EXPRESS_PUBLISHED: tuple[Triple, ...] = (
    (8.28721201814563, -23.595886519098837, 17.300387312530933),
    (4.107059111542203, -2.9478499167379106, 0.5448431082926601),
    (3.9486908534822946, -2.908902115962949, 0.5518191394370137),
    (3.3184196573706015, -2.488488024314874, 0.51004894012372),
    (2.300652019954817, -1.6689039845747493, 0.4188073119525673),
    (1.891301407787398, -1.2679958271945868, 0.37680408948524835),
    (1.8750014808534479, -1.2500016453999487, 0.3750001645474248),
    (1.875, -1.25, 0.375),
)

#: Safety factor of the Polar Express reference, used twice there:
#: (1) every published triple but the last is replaced by ``(a/s, b/s³, c/s⁵)`` (the
#: polynomial of ``x/s``), and (2) the input is normalised by ``s·‖G‖_F + 1e-7`` instead of
#: ``‖G‖_F``. Both guard against singular values pushed slightly above 1 by rounding.
POLAR_EXPRESS_SAFETY = 1.01


def _polar_express_preset(table: tuple[Triple, ...], s: float) -> tuple[Triple, ...]:
    """The per-step schedule that, applied to ``X / ‖X‖_F`` (this module's normalisation),
    computes exactly the polynomial of the reference ``X / (s·‖X‖_F)`` followed by the
    safety-scaled table.

    Reference: ``p'_1(x/s)`` with ``p'_1 = (a/s, b/s³, c/s⁵)``, i.e. coefficients
    ``(a/s², b/s⁶, c/s¹⁰)`` on ``x``; steps 2..7: ``(a/s, b/s³, c/s⁵)``; step 8 unscaled.
    (Folding the normalisation into step 1 keeps every backend, the optimizer's stored
    schedule and the Gram/TP form free of a preset-specific normaliser; the only difference
    to the reference is its ``+ 1e-7`` versus this module's ``clamp(min=eps)``.)
    """
    scaled = [(a / s, b / s**3, c / s**5) for a, b, c in table[:-1]] + [table[-1]]
    a, b, c = scaled[0]
    scaled[0] = (a / s, b / s**3, c / s**5)
    return tuple(scaled)


#: DeepSeek-V4's Newton-Schulz schedule, 10 steps: 8 steps of Muon's triple
#: ``(3.4445, -4.775, 2.0315)`` (fast growth of small singular values, which end in about
#: [0.68, 1.2]), then 2 steps of ``(2, -1.5, 0.5)``, whose polynomial has ``p(1) = 1`` and
#: ``p'(1) = 0`` (quadratic convergence to 1; maximum 1.0018 at ``x = 0.894``). In exact
#: arithmetic the 10 steps map every normalised singular value in [1e-3, 1] into
#: [1.0000, 1.0005]; the order matters (the two finishing steps first leave [0.68, 1.13]).
#: Source: the DeepSeek-V4 technical report
#: (huggingface.co/deepseek-ai/DeepSeek-V4-Pro, ``DeepSeek_V4.pdf``) as transcribed in
#: NVIDIA-NeMo/Emerging-Optimizers ``muon_utils._COEFFICIENT_SETS["deepseekv4"]`` (commit dd79ab1),
#: checked against that repository's test (``steps=10``). A fixed-length recipe: its last steps
#: are the finish, so it runs with exactly 10 steps (:data:`PRESET_LENGTH_POLICY`).
DEEPSEEK_V4: tuple[Triple, ...] = ((3.4445, -4.775, 2.0315),) * 8 + ((2.0, -1.5, 0.5),) * 2

#: Coefficient presets, by name, in one table. A value is either one ``(a, b, c)`` triple
#: used at every step, or a tuple of triples, one per step. How a per-step preset meets a step
#: count is its :data:`PRESET_LENGTH_POLICY`. (A per-step table passed directly, not by name,
#: must have exactly ``steps`` triples.)
#:
#: - ``"muon"``: ``(3.4445, -4.775, 2.0315)``, Jordan et al. 2024; the default of
#:   ``torch.optim.Muon``. Chosen to maximise the slope at zero; converges to
#:   singular values in about [0.7, 1.2], not to 1.
#: - ``"polar_express"``: 8 triples derived from :data:`POLAR_EXPRESS_PUBLISHED` with
#:   :data:`POLAR_EXPRESS_SAFETY` = 1.01 (see :func:`_polar_express_preset`): the reference
#:   ``PolarExpress(G, steps)`` up to rounding, with this module's normalisation
#:   ``X / max(‖X‖_F, eps)``. Designed for 5-8 steps (dmuon's default is 5, as Muon's). In
#:   exact arithmetic, 5 steps map every normalised singular value ``s`` in [3e-3, 1] into
#:   [0.87, 1.12] ("muon": [0.68, 1.20]); 8 steps map [1e-3, 1] to 1 within ~1e-12.
#: - ``"deepseek_v4"``: :data:`DEEPSEEK_V4`, 10 steps exactly (2x the FLOPs of 5); in exact
#:   arithmetic [1e-3, 1] -> [1.0000, 1.0005].
NS_PRESETS: dict[str, Union[Triple, tuple[Triple, ...]]] = {
    "muon": (3.4445, -4.775, 2.0315),
    "polar_express": _polar_express_preset(POLAR_EXPRESS_PUBLISHED, POLAR_EXPRESS_SAFETY),
    "deepseek_v4": DEEPSEEK_V4,
}

#: How each per-step preset meets a step count ``steps`` (a single-triple preset runs any count):
#:
#: - ``"prefix"``: every prefix of the table is itself a valid ``k``-step method and the last
#:   triple is the limit polynomial, so ``steps`` takes the first ``steps`` triples and repeats
#:   the last beyond the table, as its reference does. Polar Express qualifies: the paper builds
#:   step ``t`` greedily given steps ``1..t-1``, so its first 5 steps are the optimal 5-step
#:   method (``dmuon.Muon(ns_coefficients="polar_express")`` runs them with the default 5 steps).
#: - ``"fixed"``: a recipe whose last steps are the finish (DeepSeek-V4's two ``p(1) = 1``
#:   steps); it runs with exactly its length. ``ns_steps=None`` selects that length; any other
#:   ``ns_steps`` raises ``ValueError`` (a truncated DeepSeek-V4 would silently be 5 Muon steps).
PRESET_LENGTH_POLICY: dict[str, str] = {"polar_express": "prefix", "deepseek_v4": "fixed"}

#: The step count when none is given (``dmuon.Muon(ns_steps=None)``) and the preset does not
#: fix one: torch.optim.Muon's 5.
DEFAULT_NS_STEPS = NS_STEPS

_MAX_STEPS = 100  # torch.optim.Muon refuses ns_steps >= 100 "for computational efficiency"


def _is_triple(value: object) -> bool:
    return (
        isinstance(value, Sequence)
        and not isinstance(value, str)
        and len(value) == 3
        and all(isinstance(v, numbers.Real) and not isinstance(v, bool) for v in value)
    )


def resolve_ns_steps(coefficients: Coefficients, steps: "int | None") -> int:
    """The Newton-Schulz step count of ``coefficients`` run with ``steps`` (``dmuon.Muon``'s
    ``ns_steps``): ``steps`` itself when given; else (None) the length of a ``"fixed"`` preset
    (:data:`PRESET_LENGTH_POLICY`: ``"deepseek_v4"`` -> 10) or of an explicit per-step table, and
    :data:`DEFAULT_NS_STEPS` (5) for a triple or a ``"prefix"`` preset. Checking the pair is
    :func:`coefficient_schedule`'s job."""
    if steps is not None:
        return steps
    if isinstance(coefficients, str):
        table = NS_PRESETS.get(coefficients)
        if table is not None and PRESET_LENGTH_POLICY.get(coefficients) == "fixed":
            return len(table)
        return DEFAULT_NS_STEPS
    if isinstance(coefficients, Sequence) and not _is_triple(coefficients) and len(coefficients) > 0:
        return len(coefficients)
    return DEFAULT_NS_STEPS


def coefficient_schedule(coefficients: Coefficients, steps: int) -> tuple[Triple, ...]:
    """Resolve a coefficient spec to one ``(a, b, c)`` triple per step.

    Args:
        coefficients: a triple ``(a, b, c)`` used at every step; a sequence of exactly
            ``steps`` triples, one per step; or a key of :data:`NS_PRESETS` (a ``"prefix"``
            preset gives its first ``steps`` triples, its last one repeated if ``steps`` is
            longer than the preset; a ``"fixed"`` preset needs ``steps`` equal to its length,
            :data:`PRESET_LENGTH_POLICY`).
        steps: number of Newton-Schulz steps, ``0 <= steps < 100``.

    Returns:
        A tuple of ``steps`` triples of Python floats.

    Raises:
        ValueError: unknown preset name, a malformed triple, a per-step table whose
            length differs from ``steps``, a fixed-length preset with another ``steps``, or
            ``steps`` out of range.
        TypeError: ``steps`` is not an int.
    """
    if isinstance(steps, bool) or not isinstance(steps, int):
        raise TypeError(f"steps must be an int, got {type(steps).__name__}")
    if not 0 <= steps < _MAX_STEPS:
        raise ValueError(f"steps must satisfy 0 <= steps < {_MAX_STEPS} (as torch.optim.Muon), got {steps}")
    if isinstance(coefficients, str):
        name = coefficients
        if name not in NS_PRESETS:
            raise ValueError(f"unknown Newton-Schulz preset {name!r}; known: {sorted(NS_PRESETS)}")
        coefficients = NS_PRESETS[name]
        if not _is_triple(coefficients):  # per-step preset: its declared length policy
            table = tuple(coefficients)
            policy = PRESET_LENGTH_POLICY[name]
            if policy == "fixed" and steps != len(table):
                raise ValueError(
                    f"Newton-Schulz preset {name!r} is a fixed {len(table)}-step schedule (its last steps are "
                    f"the finish), got steps={steps}; pass ns_steps={len(table)} or ns_steps=None (its "
                    f"length), or an explicit table of {steps} triples"
                )
            coefficients = table[:steps] + (table[-1],) * max(0, steps - len(table))
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
            raise ValueError(f"per-step coefficient table has {len(table)} triples but steps={steps}")
        return tuple(tuple(float(v) for v in t) for t in table)  # type: ignore[misc]
    raise ValueError(
        "coefficients must be an (a, b, c) triple, a sequence of triples (one per step) or "
        f"a preset name from {sorted(NS_PRESETS)}; got {coefficients!r}"
    )


@functools.lru_cache(maxsize=64)
def schedule_gain_bounds(schedule: tuple[Triple, ...]) -> tuple[float, float]:
    """``(min_slope, max_gain)`` of the scalar map ``P = p_K ∘ … ∘ p_1`` that a schedule applies
    to each singular value ``s`` of the normalised input (``p(s) = a s + b s³ + c s⁵``):

    - ``max_gain = max |P(s)|`` over ``s`` in ``[0, 1]``: in exact arithmetic no singular
      value of an NS result exceeds it (the normalised input has ``‖X‖_2 <= ‖X‖_F = 1``);
    - ``min_slope = min P(s)/s`` over ``s`` in ``(0, 1]``: in exact arithmetic
      ``⟨NS(X), X⟩ = Σ P(s_i)·s_i >= min_slope · Σ s_i² = min_slope`` for ``‖X‖_F = 1``.

    Evaluated in float64 on a grid (4097 uniform points plus 1000 log-spaced in
    ``[1e-8, 1]``), so grid extrema, tight to ~1e-4 for the presets here. 5 steps:
    "muon" ``(0.696, 1.202)``, "polar_express" ``(0.877, 1.124)``; 10 steps of "deepseek_v4"
    ``(1.000, 1.002)``. ``(1, 1)`` for no steps.
    """
    s0 = torch.cat(
        [
            torch.linspace(0.0, 1.0, 4097, dtype=torch.float64)[1:],
            torch.logspace(-8, 0, 1000, dtype=torch.float64),
        ]
    )
    s = s0
    for a, b, c in schedule:
        s2 = s * s
        s = s * (a + s2 * (b + c * s2))
    return float((s / s0).min()), max(float(s.abs().max()), 0.0)


# ----------------------------------------------------------------------------------------------
# the standard Newton-Schulz iteration (Jordan et al. 2024, "Muon: An optimizer for hidden layers
# in neural networks"; torch.optim._muon._zeropower_via_newtonschulz, which newton_schulz
# reproduces bit for bit on 2-D bf16 input), on one matrix or a batch:
#     X₀ = G / max(‖G‖_F, eps);  A = XXᵀ;  B = b·A + c·A·A;  X <- a·X + B·X
# run on the wide orientation (rows <= columns) so that the Gram matrix A is the small one.
# ----------------------------------------------------------------------------------------------


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
    :func:`dmuon._ns_gram.gram_newton_schulz`'s fallback)."""
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


# ----------------------------------------------------------------------------------------------
# momentum, decay, learning rate
# ----------------------------------------------------------------------------------------------

#: ``adjust_lr_fn`` values (:func:`adjust_lr`), as ``torch.optim.Muon``'s.
ADJUST_LR_FNS = (None, "original", "match_rms_adamw")


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
        raise ValueError(f"unknown adjust_lr_fn {adjust_lr_fn!r}; expected one of {ADJUST_LR_FNS}")
    return lr * ratio


def momentum_(
    grads: Sequence[Tensor], bufs: Sequence[Tensor], *, momentum: float, nesterov: bool, foreach: bool = False
) -> list[Tensor]:
    """``torch.optim.Muon``'s momentum on each ``(grad, buf)`` pair: ``buf.lerp_(grad, 1 - momentum)``
    (the buffer, the caller's state, is updated in place), and the Newton-Schulz input
    ``grad.lerp(buf, momentum)`` (Nesterov) or ``buf`` itself.

    ``foreach=True`` runs the same two lerps as ``torch._foreach_lerp_`` / ``torch._foreach_lerp``
    over the lists (two ops for any number of pairs; the same values: the foreach kernels compute
    the same lerp per element). Returns one NS input per pair, in order."""
    w = 1 - momentum
    if foreach and len(grads) > 1:
        torch._foreach_lerp_(list(bufs), list(grads), w)
        return list(torch._foreach_lerp(list(grads), list(bufs), momentum)) if nesterov else list(bufs)
    out = []
    for g, buf in zip(grads, bufs):
        buf.lerp_(g, w)
        out.append(g.lerp(buf, momentum) if nesterov else buf)
    return out


def decay_and_apply_(
    params: Sequence[Tensor],
    updates: Sequence[Tensor],
    *,
    lr: float,
    weight_decay: float,
    scaled_lrs: Sequence[float],
    foreach: bool = False,
) -> None:
    """``torch.optim.Muon``'s update of each parameter, in place: decoupled weight decay
    ``p.mul_(1 - lr * weight_decay)``, then ``p.add_(update, alpha=-scaled_lr)`` (``scaled_lr``:
    :func:`adjust_lr` of its matrix shape). ``updates[i]`` has ``params[i]``'s shape.

    ``foreach=True``: one ``torch._foreach_mul_`` over every parameter and one
    ``torch._foreach_add_`` per distinct ``scaled_lr`` (the same values: a bf16 update added to an
    fp32 parameter is promoted exactly either way)."""
    decay = 1 - lr * weight_decay
    if not (foreach and len(params) > 1):
        for p, u, s in zip(params, updates, scaled_lrs):
            p.mul_(decay)
            p.add_(u, alpha=-s)
        return
    torch._foreach_mul_(list(params), decay)
    by_lr: dict[float, tuple[list[Tensor], list[Tensor]]] = {}
    for p, u, s in zip(params, updates, scaled_lrs):
        ps, us = by_lr.setdefault(s, ([], []))
        ps.append(p)
        us.append(u)
    for s, (ps, us) in by_lr.items():
        torch._foreach_add_(ps, us, alpha=-s)


# ----------------------------------------------------------------------------------------------
# NorMuon's normalisation (the per-parameter second-moment layout: dmuon.exec._optim.normuon_update)
# ----------------------------------------------------------------------------------------------


def normuon_normalize(ortho: Tensor, rows: Tensor, *, beta2: float, eps: float) -> tuple[Tensor, Tensor]:
    """NorMuon's normalisation of ``k`` orthogonalised matrices ``ortho`` ``(k, m, n)`` with their
    second moments ``rows`` ``(k, m)`` (NorMuon, Li et al., arXiv 2510.05491: ``s = mean_j O_ij²`` per row, ``v <- lerp(v, s, 1 - beta2)``, ``Ô = O / (sqrt(v) + eps)``, then ``Ô · ‖O‖_F / (‖Ô‖_F + eps)``; the authors' op order),
    in fp32. Pure: returns ``(update (k, m, n) fp32, new rows (k, m) fp32)``."""
    o = ortho.float()
    norm = o.norm(dim=(-2, -1), keepdim=True)
    mean_sq = torch.mean(o * o, dim=-1, keepdim=True)
    v_new = torch.lerp(rows.float().unsqueeze(-1), mean_sq, 1 - beta2)
    update = o * (1 / v_new.sqrt().add(eps))
    norm_new = update.norm(dim=(-2, -1), keepdim=True)
    update = update * (norm / norm_new.add(eps))
    return update, v_new.squeeze(-1)


# ----------------------------------------------------------------------------------------------
# Newton-Schulz over many matrices: one call per matrix, or one per bucket
# ----------------------------------------------------------------------------------------------

#: ``dmuon.Muon(ns_batching=...)``: ``"batched"`` (default) or ``"exact"`` (Note: NS batching, docs/design.md).
NS_BATCHING_MODES = _rules.NS_BATCHING_MODES

#: The stated bound between ``ns_batching="batched"`` and ``"exact"`` bf16 Newton-Schulz (Note: NS
#: batching, docs/design.md): ``‖O_batched − O_exact‖_F <= BATCHED_BF16_REL_BOUND · ‖O_exact‖_F`` per matrix,
#: twice the distance ``2⁻⁵`` of any bf16 evaluation order to the fp32 iteration.
BATCHED_BF16_REL_BOUND = 2.0**-4


def orthogonalize_each(mats: Tensor, fn: Optional[Callable[..., Tensor]] = None, **ns_kw: Any) -> Tensor:
    """Newton-Schulz of ``k`` matrices ``(k, m, n)`` (or one ``(m, n)``), one 2-D ``fn`` call per
    matrix (``fn``: :func:`newton_schulz` by default; ``ns_kw``: its keywords): for a 2-D bf16
    ``mats`` the very calls ``torch.optim.Muon`` makes (the ``"exact"`` mode). Result in ``ns_kw``'s
    dtype, ``mats``' shape (a tall 2-D result is a transposed view, as torch's)."""
    fn = newton_schulz if fn is None else fn
    if mats.ndim == 2:
        return fn(mats, **ns_kw)
    out = torch.empty(mats.shape, dtype=ns_kw.get("dtype", torch.bfloat16), device=mats.device)
    for i in range(mats.shape[0]):
        out[i] = fn(mats[i], **ns_kw)
    return out


def orthogonalize_batch(
    mats: Sequence[Tensor],
    fn: Optional[Callable[..., Tensor]] = None,
    *,
    out_dtype: Optional[torch.dtype] = None,
    **ns_kw: Any,
) -> list[Tensor]:
    """Newton-Schulz of several stacks of matrices in ONE ``fn`` call (the ``"batched"`` mode):
    ``mats[i]`` is ``(k_i, m_i, n_i)``, all with the same ``(min, max)`` sides (a bucket,
    :func:`bucket_runs`); tall ones enter transposed, all are concatenated into one ``(Σk, d, D)``
    batch, and the results come back split, each in its own orientation and shape (views of one
    result tensor). ``out_dtype``: the result cast once (e.g. to the parameters' dtype) before the
    split. Equal to :func:`orthogonalize_each` up to the reduction order of ``bmm`` against ``mm``
    (Note: NS batching, docs/design.md)."""
    fn = newton_schulz if fn is None else fn
    wide = [x.mT if x.shape[-2] > x.shape[-1] else x for x in mats]
    stack = wide[0] if len(wide) == 1 else torch.cat(wide)
    ortho = fn(stack, **ns_kw)
    if out_dtype is not None and ortho.dtype != out_dtype:
        ortho = ortho.to(out_dtype)
    parts = ortho.split([x.shape[0] for x in mats]) if len(mats) > 1 else (ortho,)
    return [o.mT if x.shape[-2] > x.shape[-1] else o for o, x in zip(parts, mats)]


def bucket_runs(
    keys: Sequence[Hashable],
    numels: Sequence[int],
    ns_batching: str,
    unit_numels: Optional[Sequence[int]] = None,
) -> list[list[_rules.RunPiece]]:
    """Which items Newton-Schulz orthogonalises together: runs of pieces (:class:`~dmuon.plan._rules.RunPiece`:
    an item's units ``[start, stop)``), one call each.

    ``"exact"``: each item its own run(s), in order. ``"batched"``: items with the same key (the
    caller's ``(short side, long side, dtype, device)``, :func:`dmuon.plan._rules.ns_bucket_sides`)
    form a bucket, buckets in order of first appearance. Either way cut by
    :func:`dmuon.plan._rules.ns_batch_pieces` (at most ``NS_BATCH_MAX_NUMEL`` elements per run where
    whole units allow; ``numels[i]``: item ``i``'s elements, ``unit_numels[i]``: its smallest
    piece's, an expert's; ``None``: items never cut). The memory model and the simulator use the
    same runs.

    Raises:
        ValueError: an unknown ``ns_batching``.
    """
    check_ns_batching(ns_batching)
    units = list(numels) if unit_numels is None else list(unit_numels)
    if ns_batching == "exact":
        groups = [[i] for i in range(len(keys))]
    else:
        buckets: dict[Hashable, list[int]] = {}
        for i, key in enumerate(keys):
            buckets.setdefault(key, []).append(i)
        groups = list(buckets.values())
    return [
        [_rules.RunPiece(idx[p.entry], p.start, p.stop) for p in run]
        for idx in groups
        for run in _rules.ns_batch_pieces([numels[i] for i in idx], [units[i] for i in idx])
    ]


def check_ns_batching(ns_batching: str) -> None:
    """Raise ``ValueError`` unless ``ns_batching`` is one of :data:`NS_BATCHING_MODES`."""
    if ns_batching not in NS_BATCHING_MODES:
        raise ValueError(f"ns_batching must be one of {NS_BATCHING_MODES}, got {ns_batching!r}")


# ----------------------------------------------------------------------------------------------
# one Muon step over many matrices
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(slots=True, kw_only=True)
class Matrices:
    """``k`` Muon matrices ``(m, n)`` of one layout, as one step of :func:`muon_update` sees them.

    Attributes:
        param: updated in place (its own layout: a matrix, a view block, an expert stack ...).
        grad, buf: the momentum input and buffer in ``param``'s layout; or None when ``update`` is
            given (a view block, whose parameter's momentum ran once for all its blocks).
        update: the Newton-Schulz input in ``param``'s layout, when already formed.
        matrix_shape: ``(m, n)``, in ``nn.Linear`` ``(out, in)`` orientation (:func:`adjust_lr`).
        num_matrices: ``k``.
        to_matrices: ``param``'s layout -> ``(k, m, n)`` (None: a reshape).
        from_matrices: ``(k, m, n)`` -> ``param``'s layout (None: a reshape to ``param.shape``).
        normalize: applied to the ``(k, m, n)`` Newton-Schulz result before the update (NorMuon,
            :func:`normuon_normalize` bound to its second moment); None: nothing.
        unit_matrices: matrices per unit, the smallest piece the item may be cut into along
            dim 0 of its tensors (an expert of a stack: its gate and up, 2, or 1); 0: never cut
            (:meth:`narrow`, :func:`dmuon.plan._rules.ns_batch_pieces`). ``from_matrices`` must
            then take any whole number of units.
        normalize_units: ``normalize`` of units ``[start, stop)`` (NorMuon's rows of those units).
    """

    param: Tensor
    grad: Optional[Tensor] = None
    buf: Optional[Tensor] = None
    update: Optional[Tensor] = None
    matrix_shape: tuple[int, int]
    num_matrices: int = 1
    to_matrices: Optional[Callable[[Tensor], Tensor]] = None
    from_matrices: Optional[Callable[[Tensor], Tensor]] = None
    normalize: Optional[Callable[[Tensor], Tensor]] = None
    unit_matrices: int = 0
    normalize_units: Optional[Callable[[int, int], Callable[[Tensor], Tensor]]] = None

    @property
    def units(self) -> int:
        """How many units (:meth:`narrow`) the item holds: ``num_matrices / unit_matrices``, or 1."""
        return self.num_matrices // self.unit_matrices if self.unit_matrices else 1

    def narrow(self, start: int, stop: int) -> "Matrices":
        """Units ``[start, stop)`` of the item as an item of its own (itself when that is all of
        it): its tensors sliced along dim 0 (views: updated in place), ``(stop - start) ·
        unit_matrices`` matrices, ``normalize`` from ``normalize_units(start, stop)``. A piece is not
        cut further."""
        if (start, stop) == (0, self.units):
            return self
        if not self.unit_matrices or not 0 <= start < stop <= self.units:
            raise ValueError(f"units [{start}, {stop}) of an item of {self.units} unit(s)")
        if self.normalize is not None and self.normalize_units is None:
            raise ValueError("a piece of an item with normalize needs normalize_units")

        def cut(t: Optional[Tensor]) -> Optional[Tensor]:
            return None if t is None else t[start:stop]

        return dataclasses.replace(
            self,
            param=cut(self.param),
            grad=cut(self.grad),
            buf=cut(self.buf),
            update=cut(self.update),
            num_matrices=(stop - start) * self.unit_matrices,
            normalize=None if self.normalize is None else self.normalize_units(start, stop),  # type: ignore[misc]
            unit_matrices=0,
            normalize_units=None,
        )

    def matrices(self, t: Tensor) -> Tensor:
        """``t`` in ``param``'s layout as ``(k, m, n)``; a plain matrix stays ``(m, n)``."""
        if self.to_matrices is not None:
            return self.to_matrices(t)
        m, n = self.matrix_shape
        if self.num_matrices == 1:
            return t if tuple(t.shape) == (m, n) else t.reshape(m, n)
        return t.reshape(self.num_matrices, m, n)

    def layout(self, ortho: Tensor) -> Tensor:
        """``ortho`` ``(k, m, n)`` (or ``(m, n)``) back in ``param``'s layout."""
        if self.from_matrices is not None:
            return self.from_matrices(ortho)
        return ortho if ortho.shape == self.param.shape else ortho.reshape(self.param.shape)


def muon_update(
    items: Sequence[Matrices],
    *,
    lr: float,
    weight_decay: float,
    momentum: float,
    nesterov: bool,
    adjust_lr_fn: Optional[str],
    coefficients: Coefficients,
    steps: int,
    eps: float,
    dtype: torch.dtype,
    ns_batching: str = "batched",
    kernel: Optional[Callable[[tuple[int, int]], Callable[..., Tensor]]] = None,
    stage: Optional[Callable[[list[list[Matrices]]], Iterable[list[Matrices]]]] = None,
) -> None:
    """One Muon step over ``items``: momentum, Newton-Schulz, (NorMuon's ``normalize``), decoupled
    weight decay and the scaled update, each parameter updated in place and each momentum buffer
    too; ``torch.optim._muon._single_tensor_muon``'s arithmetic on every matrix.

    ``ns_batching="exact"``: item by item, one 2-D Newton-Schulz call per matrix and one op per
    tensor, in torch's order: bit for bit ``torch.optim.Muon`` (bf16), or the fp32 oracle with
    ``dtype=torch.float32``. ``"batched"``: items cut into runs (:func:`bucket_runs`); per run two
    momentum ops, one Newton-Schulz call (:func:`orthogonalize_batch`), one decay op and one add op
    per distinct scaled learning rate, whatever the number of matrices (Note: NS batching: the bound
    against ``"exact"``). In both modes an item larger than ``NS_BATCH_MAX_NUMEL`` elements that has
    units (``Matrices.unit_matrices``: an expert range) runs in pieces of whole units
    (:meth:`Matrices.narrow`), so a run stays within the cap and offload copies no more at once.

    ``kernel(sides)``: the orthogonalisation function for matrices of ``(short, long)`` sides
    (default: :func:`newton_schulz` everywhere), called with ``coefficients, steps, eps, dtype``;
    resolved once per run (``"batched"``) or per item (``"exact"``).

    ``stage(runs)``: where each run computes. Given every run's items (the runs as without it), it
    yields for each run, in order, the items to compute on (e.g. device copies of host tensors),
    and copies the results back to the run's own items once asked for the next run (or at its end);
    ``None``: in place (:mod:`dmuon.exec._optim.offload_stage`).

    Raises:
        ValueError: an unknown ``ns_batching`` or ``adjust_lr_fn``, a bad coefficient spec.
    """
    check_ns_batching(ns_batching)
    ns_kw = dict(coefficients=coefficient_schedule(coefficients, steps), steps=steps, eps=eps, dtype=dtype)
    pick = kernel if kernel is not None else (lambda sides: newton_schulz)
    batched = ns_batching == "batched"
    keys, numels, unit_numels = [], [], []
    for it in items:
        m, n = it.matrix_shape
        ref = it.update if it.update is not None else it.grad
        keys.append((*_rules.ns_bucket_sides(m, n), ref.dtype, ref.device))
        numels.append(it.num_matrices * m * n)
        unit_numels.append(numels[-1] // it.units)
    runs = bucket_runs(keys, numels, ns_batching, unit_numels)
    groups = [[items[p.entry].narrow(p.start, p.stop) for p in run] for run in runs]
    # a plain loop drains stage (its write-backs); no enumerate / zip, whose reused result tuple
    # would keep the previous run referenced while stage uploads the next
    i = 0
    for group in groups if stage is None else stage(groups):
        _update_run(
            group,
            pick(keys[runs[i][0].entry][:2]),
            batched=batched,
            lr=lr,
            weight_decay=weight_decay,
            momentum=momentum,
            nesterov=nesterov,
            adjust_lr_fn=adjust_lr_fn,
            ns_kw=ns_kw,
        )
        # nothing of this run stays referenced while ``stage`` uploads the run after next: with
        # ``stage``, at most two runs' copies are alive (dmuon.plan._cost.rank_memory.OFFLOAD_RUNS_IN_FLIGHT)
        del group
        i += 1


def _update_run(
    group: Sequence[Matrices],
    fn: Callable[..., Tensor],
    *,
    batched: bool,
    lr: float,
    weight_decay: float,
    momentum: float,
    nesterov: bool,
    adjust_lr_fn: Optional[str],
    ns_kw: dict,
) -> None:
    """One run of :func:`muon_update`: momentum, one Newton-Schulz call by ``fn`` (``"batched"``;
    or one per item), NorMuon's ``normalize``, decay and the update; its intermediates die with the call."""
    fresh = [it for it in group if it.update is None]
    formed = momentum_(
        [it.grad for it in fresh], [it.buf for it in fresh], momentum=momentum, nesterov=nesterov, foreach=batched
    )
    formed_by_id = {id(it): u for it, u in zip(fresh, formed)}
    inputs = [it.matrices(it.update if it.update is not None else formed_by_id[id(it)]) for it in group]
    if batched and (len(group) > 1 or group[0].num_matrices > 1):
        dtypes = {it.param.dtype for it in group}
        cast = next(iter(dtypes)) if len(dtypes) == 1 and all(it.normalize is None for it in group) else None
        outs = orthogonalize_batch([x if x.ndim == 3 else x.unsqueeze(0) for x in inputs], fn, out_dtype=cast, **ns_kw)
        outs = [o if x.ndim == 3 else o.squeeze(0) for o, x in zip(outs, inputs)]
    else:
        outs = [orthogonalize_each(x, fn, **ns_kw) for x in inputs]
    updates = []
    for it, o in zip(group, outs):
        if it.normalize is not None:
            o = it.normalize(o)
        updates.append(it.layout(o))
    decay_and_apply_(
        [it.param for it in group],
        updates,
        lr=lr,
        weight_decay=weight_decay,
        scaled_lrs=[adjust_lr(lr, adjust_lr_fn, it.matrix_shape) for it in group],
        foreach=batched,
    )


def single_tensor_muon(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    momentum_bufs: Sequence[Tensor],
    *,
    lr: float,
    weight_decay: float,
    momentum: float,
    nesterov: bool,
    ns_coefficients: Coefficients,
    ns_steps: int,
    eps: float,
    adjust_lr_fn: Optional[str],
    ns_dtype: torch.dtype = torch.bfloat16,
    ns_batching: str = "batched",
) -> None:
    """``torch.optim._muon._single_tensor_muon(params, grads, momentum_bufs, ...)`` (same
    arguments, plus ``ns_dtype`` and ``ns_batching``) on plain 2-D tensors, by :func:`muon_update`:
    with ``ns_batching="exact"`` and the default bf16 bit for bit torch's, with
    ``ns_dtype=torch.float32`` bit for bit torch's patched with the fp32 iteration
    (:func:`dmuon.testing.fp32_newton_schulz`)."""
    items = [
        Matrices(param=p, grad=g, buf=b, matrix_shape=tuple(p.shape)) for p, g, b in zip(params, grads, momentum_bufs)
    ]
    muon_update(
        items,
        lr=lr,
        weight_decay=weight_decay,
        momentum=momentum,
        nesterov=nesterov,
        adjust_lr_fn=adjust_lr_fn,
        coefficients=ns_coefficients,
        steps=ns_steps,
        eps=eps,
        dtype=ns_dtype,
        ns_batching=ns_batching,
    )
