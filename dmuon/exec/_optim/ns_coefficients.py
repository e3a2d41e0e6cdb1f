"""Newton-Schulz coefficients: the preset table, a spec resolved to one triple per step, and a
schedule's gain bounds.

Each step of every backend (:mod:`dmuon.exec._optim.ns_backends`) is the odd quintic
``X <- a·X + b·(XXᵀ)X + c·(XXᵀ)²X``; a coefficient spec (:data:`Coefficients`) gives its
``(a, b, c)``: one triple for every step, one triple per step, or a preset name.
:func:`coefficient_schedule` resolves a spec to one triple per step; :func:`schedule_gain_bounds`
gives the exact-arithmetic bounds of a schedule that Gram NS's safe fallback checks against.
Pure functions and constant tables.

Coefficient presets (:data:`NS_PRESETS`) are orthogonal to the backend: ``"muon"`` (Jordan
et al.), ``"polar_express"`` (Amsel et al., arXiv 2505.16932) and ``"deepseek_v4"`` (the
DeepSeek-V4 report) run on either. Polar Express: see :data:`POLAR_EXPRESS_PUBLISHED`;
DeepSeek-V4: :data:`DEEPSEEK_V4`. A per-step preset declares how it meets a step count
(:data:`PRESET_LENGTH_POLICY`: a ``"prefix"`` preset is valid at any length, a ``"fixed"`` one only
at its own; never a silent truncation), and :func:`resolve_ns_steps` gives a spec's step count.
docs/newton_schulz.md compares the presets.
"""

from __future__ import annotations

import functools
import numbers
from collections.abc import Sequence
from typing import Union

import torch

__all__ = [
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
]

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
DEFAULT_NS_STEPS = 5

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
