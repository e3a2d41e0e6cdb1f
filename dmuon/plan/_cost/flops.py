r"""Newton-Schulz FLOPs: the formulas, per backend, per dedicated parameter and per TP rank, and
the Newton-Schulz schedule they count over (steps, Gram restarts, segments). A leaf: it imports
nothing from ``dmuon.plan`` but the records, so :mod:`dmuon.plan._rules` (which picks a backend
by these FLOPs) and every cost module can import it.

Units are in the names: ``_flops`` = floating-point operations (a multiply-add counts 2). All
figures are per optimizer step.

Newton-Schulz FLOPs (Muon, Jordan et al. 2024, quintic iteration on the ``m x n`` matrix with
``m <= n``): each step forms ``A = X X^T`` (``2 m^2 n``), ``A A`` (``2 m^3``) and ``B X``
(``2 m^2 n``), i.e. ``steps * (4 m^2 n + 2 m^3)`` per matrix; elementwise terms are ignored.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence

from dmuon.plan._records.params import ParamSpec

__all__ = [
    "NS_STEPS",
    "GRAM_RESTART_EVERY",
    "gram_segment_lengths",
    "ns_flops",
    "matrix_ns_flops",
    "spec_ns_flops",
    "GRAM_SYM_MIN_SIDE",
    "gram_product_flops",
    "gram_ns_segment_flops",
    "tp_gram_side",
    "tp_ns_flops",
]

#: Newton-Schulz steps assumed by ``cost_model="ns_flops"`` (torch.optim.Muon default)
NS_STEPS = 5
#: Gram restart period of ``dmuon._ns_gram.gram_newton_schulz`` (and so of
#: ``dmuon.Muon(ns_backend="gram" | "auto")``): restart before every 2nd step (0-based 2, 4, ...)
GRAM_RESTART_EVERY = 2


def gram_segment_lengths(steps: int, restart_every: int | Sequence[int] | None) -> tuple[int, ...]:
    """Lengths of the Gram Newton-Schulz segments between restarts; one Gram (one TP
    all-reduce) per segment. The one segment rule: ``dmuon._ns_gram.gram_segments``
    splits a schedule by these lengths.

    ``restart_every``: ``r >= 1``: restart before every 0-based step ``k`` with ``k % r == 0``,
    ``k > 0`` (segments of ``r`` steps, the last one shorter); ``None``: never (one segment); a
    sequence of ints: restart before exactly those 0-based steps (entries ``<= 0`` or
    ``>= steps`` are ignored). ``()`` for ``steps <= 0``.

    Raises:
        ValueError: ``restart_every`` is not ``None``, an int ``>= 1`` or a sequence of ints.
    """
    if restart_every is None:
        cuts: list[int] = []
    elif isinstance(restart_every, numbers.Integral) and not isinstance(restart_every, bool):
        if restart_every < 1:
            raise ValueError(f"restart_every must be >= 1 (or None for no restarts), got {restart_every}")
        cuts = list(range(int(restart_every), steps, int(restart_every)))
    elif (
        isinstance(restart_every, Sequence)
        and not isinstance(restart_every, str)
        and all(isinstance(k, numbers.Integral) and not isinstance(k, bool) for k in restart_every)
    ):
        cuts = sorted({int(k) for k in restart_every if 0 < k < steps})
    else:
        raise ValueError(
            f"restart_every must be None, an int >= 1 or a sequence of 0-based step indices, got {restart_every!r}"
        )
    if steps <= 0:
        return ()
    bounds = [0, *cuts, steps]
    return tuple(b - a for a, b in zip(bounds, bounds[1:]))


def ns_flops(m: int, n: int, steps: int = NS_STEPS, *, num_matrices: int = 1) -> int:
    """Newton-Schulz FLOPs to orthogonalise ``num_matrices`` matrices of shape ``(m, n)``: the
    matmul FLOPs of ``dmuon._update.newton_schulz``.

    ``num_matrices * steps * (4 * a*a*b + 2 * a**3)`` with ``a = min(m, n)``, ``b = max(m, n)``
    (Muon runs the iteration on the wide orientation): per step ``A = X Xᵀ`` and ``B·X``
    (``2·a²·b`` each) and ``A·A`` (``2·a³``); elementwise work and the norm are ignored. Unit:
    FLOPs (multiply-add = 2).

    Raises:
        ValueError: a negative argument.
    """
    if min(m, n, steps, num_matrices) < 0:
        raise ValueError(f"ns_flops arguments must be >= 0, got m={m} n={n} steps={steps} num_matrices={num_matrices}")
    a, b = (m, n) if m <= n else (n, m)
    return num_matrices * steps * (4 * a * a * b + 2 * a**3)


def matrix_ns_flops(
    m: int,
    n: int,
    backend: str,
    *,
    steps: int = NS_STEPS,
    num_matrices: int = 1,
    restart_every: int | Sequence[int] | None = GRAM_RESTART_EVERY,
) -> int:
    """Matmul FLOPs of orthogonalising ``num_matrices`` ``(m, n)`` matrices with ``backend``:
    ``"standard"``: :func:`ns_flops`; ``"gram"``: :func:`gram_ns_segment_flops` over the segments
    of ``restart_every`` (:func:`gram_segment_lengths`). Unit: FLOPs.

    Raises:
        ValueError: ``backend`` is neither ``"standard"`` nor ``"gram"``.
    """
    if backend == "standard":
        return ns_flops(m, n, steps, num_matrices=num_matrices)
    if backend == "gram":
        d, D = min(m, n), max(m, n)
        return num_matrices * gram_ns_segment_flops(d, D, gram_segment_lengths(steps, restart_every))
    raise ValueError(f"backend must be 'standard' or 'gram', got {backend!r}")


def spec_ns_flops(spec: ParamSpec, steps: int = NS_STEPS) -> int:
    """Newton-Schulz FLOPs per step of one (non-TP) dedicated parameter: :func:`matrix_ns_flops`
    with the backend its plan records (``spec.ns_backend``) and the default Gram restarts, summed
    over the matrices Muon orthogonalises (``spec.matrices``: its view's blocks, or
    ``num_matrices`` copies of ``matrix_shape``). A per-head view of ``(H·d_h, D)`` costs ``H``
    times one ``(d_h, D)`` matrix, ``4·H·d_h²·D + 2·H·d_h³`` per standard step instead of
    ``4·(H·d_h)²·D + 2·(H·d_h)³``."""
    if spec.view is None:
        m, n = spec.matrix_shape
        return matrix_ns_flops(m, n, spec.ns_backend, steps=steps, num_matrices=spec.num_matrices)
    return sum(matrix_ns_flops(m, n, spec.ns_backend, steps=steps) for m, n in spec.matrices)


#: Gram side ``d`` from which Newton-Schulz forms a Gram matrix ``X Xᵀ`` from its lower blocks
#: only (:func:`gram_product_flops`); below it, one general matmul: at ``d = 128`` the blocks'
#: 64-row products took as long as the full product for 3/4 of its FLOPs on a CPU core
#: (benchmarks/ns_backends.py ``--kernels``), so counting the saving there promised time the
#: kernels do not give; at ``d = 256`` the blocks take 0.7-0.9 of the full product's time.
GRAM_SYM_MIN_SIDE = 256


def gram_product_flops(d: int, D: int) -> int:
    """FLOPs of forming the symmetric ``(d, d)`` Gram ``X Xᵀ`` of one ``(d, D)`` matrix as
    ``dmuon._ns_gram`` does:

    * ``d < GRAM_SYM_MIN_SIDE``: one matmul, ``2·d²·D``;
    * otherwise its lower blocks only, mirrored into the upper one: with ``h = d // 2`` and
      ``X = [X_top; X_bot]`` (``h`` and ``d - h`` rows), ``X·X_topᵀ`` (the first ``h`` columns,
      ``2·d·h·D``) and ``X_bot·X_botᵀ`` (``2·(d-h)²·D``): ``2·D·(d·h + (d-h)²)``, i.e.
      ``1.5·d²·D`` for even ``d`` — 3/4 of the general product (a one-level ``syrk``).

    Unit: FLOPs (multiply-add = 2).
    """
    if d < GRAM_SYM_MIN_SIDE:
        return 2 * d * d * D
    h = d // 2
    return 2 * D * (d * h + (d - h) ** 2)


def gram_ns_segment_flops(d: int, D: int, segment_lengths: Sequence[int]) -> int:
    """Matmul FLOPs of Gram Newton-Schulz on ONE ``(d, D)`` matrix (``d`` = the Gram side) whose
    schedule is split into segments of ``segment_lengths`` steps (:func:`gram_segment_lengths`)::

        Σ_L [ gram_product_flops(d, D)  +  2·d²·D  +  (8·L - 6)·d³ ]

    per segment: ``G = X Xᵀ`` (:func:`gram_product_flops`: ``2·d²·D``, or ``1.5·d²·D`` from
    ``d >= GRAM_SYM_MIN_SIDE``) and ``Q·X`` (``2·d²·D``), and on ``(d, d)`` matrices ``R²``
    every step, ``Q·Z`` from the segment's second step and ``Z·R·Z`` (two products) before its
    last step (``2·d³`` each). ``D`` is the full other side (``gram_newton_schulz``) or a TP
    rank's block of it (:func:`tp_ns_flops`). Unit: FLOPs (multiply-add = 2).
    """
    return sum(gram_product_flops(d, D) + 2 * d * d * D + (8 * L - 6) * d**3 for L in segment_lengths)


def tp_gram_side(shape: Sequence[int], tp_shard_dim: int) -> int:
    """``d`` of the exact Gram of a TP-sharded ``(m, n)`` matrix: the side TP does not shard.

    Row shards (``Shard(0)``, ``X = [X_1; …; X_T]``): ``XᵀX = Σ X_iᵀX_i``, ``d = n``; column
    shards (``Shard(1)``, ``X = [X_1 … X_T]``): ``XXᵀ = Σ X_iX_iᵀ``, ``d = m``. The other
    Gram would need the cross-shard products ``X_iX_jᵀ``.
    """
    return int(shape[1]) if tp_shard_dim == 0 else int(shape[0])


def tp_ns_flops(spec: ParamSpec, segment_lengths: Sequence[int]) -> int:
    """Newton-Schulz FLOPs of ONE rank of the owner's TP group for ``spec`` (matmuls only).

    ``"gram"``: :func:`gram_ns_segment_flops` with ``D`` = the local block's side ``D/T``: per
    segment of ``L`` steps, the local Gram and ``Q·X_i`` (``2·d²·D/T`` each) plus
    ``(8L - 6)·d³`` on ``(d, d)`` matrices (replicated on every TP rank);
    ``"gather"``: :func:`ns_flops` of the full matrix (every TP rank runs it);
    ``"local"``: the view blocks in one TP rank's shard, the largest over the TP ranks. Non-TP: 0.
    """
    if spec.tp_size == 1:
        return 0
    if spec.tp_ns == "local":
        steps = sum(segment_lengths)
        return max(sum(ns_flops(m, n, steps) for m, n in spec.shard_matrices(t)) for t in range(spec.tp_size))
    if spec.tp_ns == "gather":
        return ns_flops(*spec.matrix_shape, steps=sum(segment_lengths))
    d = tp_gram_side(spec.shape, spec.tp_shard_dim)  # type: ignore[arg-type]
    return gram_ns_segment_flops(d, spec.local_numel // d, segment_lengths)
