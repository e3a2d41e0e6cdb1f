"""Gram Newton-Schulz (backend ``"gram"``): the standard polynomial evaluated through the
``(d, d)`` Gram matrix, with restarts and a safe fallback, and its sharded form for matrices
several ranks hold.

``"gram"``: :func:`gram_newton_schulz` (Zhang, Amsel, Chen, Dao, "Gram Newton-Schulz",
2026): the same polynomial as :func:`dmuon._update.newton_schulz` evaluated on
the ``(d, d)`` Gram matrix, ``d = min(m, n)``, with restarts (:func:`gram_segments`); equal to
``"standard"`` in exact arithmetic, cheaper when ``max(m, n) >> min(m, n)``, and the form tensor
parallelism needs (:func:`gram_ns_from_gram`, :func:`sharded_gram_newton_schulz`, which
:mod:`dmuon.exec._optim.tp_orthogonalize` runs for TP-sharded and owner-grouped matrices). The
safe fallback's checks (power-iteration spectral-norm estimates, the alignment ``⟨Y, X⟩``) and
the matmul FLOPs (:func:`gram_ns_flops`) live here too.

Pure functions: the module holds no state (observe fallbacks with
``gram_newton_schulz(on_fallback=...)``). Sources: see :func:`gram_newton_schulz`.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from typing import Optional, Union

import torch
from torch import Tensor

# The FLOP formulas (the cost model) and the Gram segment rule (the rules) are written once, in
# the torch-free planner.
from dmuon.plan._cost.flops import GRAM_SYM_MIN_SIDE, gram_ns_segment_flops
from dmuon.plan._rules import GRAM_RESTART_EVERY, gram_segment_lengths

from dmuon._update import (
    Coefficients,
    Triple,
    _check_input,
    _newton_schulz,
    coefficient_schedule,
    schedule_gain_bounds,
)

__all__ = [
    "GRAM_RESTART_EVERY",
    "gram_newton_schulz",
    "gram_ns_flops",
    "gram_ns_from_gram",
    "gram_segments",
    "sharded_gram_newton_schulz",
]

# GRAM_RESTART_EVERY (imported from dmuon.plan._rules, where the cost model reads it too): default
# restart period of gram_newton_schulz: re-form the Gram matrix from the current X before steps
# 2, 4, ... (0-based), i.e. segments of 2 steps.

Restarts = Union[int, Sequence[int], None]


def gram_segments(
    schedule: Sequence[Triple], restart_every: Restarts = GRAM_RESTART_EVERY
) -> tuple[tuple[Triple, ...], ...]:
    """Split a per-step schedule into the segments between Gram restarts.

    Args:
        schedule: one triple per step (see :func:`coefficient_schedule`).
        restart_every: ``r >= 1``: restart before every 0-based step ``k`` with ``k % r == 0``,
            ``k > 0`` (segments of ``r`` steps, the last one shorter); ``None``: never (one
            segment); a sequence of ints: restart before exactly those 0-based steps (the
            ``gram_newton_schulz_reset_iterations`` of Dao-AILab/gram-newton-schulz: ``[2]``
            restarts once, after the 2nd step). Entries ``<= 0`` or ``>= len(schedule)`` are
            ignored (nothing to restart).

    Returns:
        A tuple of non-empty tuples of triples whose concatenation is ``schedule``
        (empty for an empty schedule).

    Raises:
        ValueError: ``restart_every`` is not ``None``, an int ``>= 1`` or a sequence of ints.

    The rule itself is :func:`dmuon.plan._rules.gram_segment_lengths` (shared with the plan's
    count of TP Gram all-reduces); this function applies it to ``schedule``.
    """
    segments, start = [], 0
    for length in gram_segment_lengths(len(schedule), restart_every):
        segments.append(tuple(schedule[start : start + length]))
        start += length
    return tuple(segments)


def gram_ns_from_gram(g: Tensor, *, coefficients: Coefficients, steps: int) -> Tensor:
    """The ``(d, d)`` factor ``Q`` with ``NS(X) = Q·X``, from the Gram matrix ``g = X·Xᵀ`` alone.

    Pure, no restarts: one segment of Gram Newton-Schulz. For ``X`` of shape ``(d, D)``
    (already normalised, ``‖X‖_2 <= 1``) each quintic step ``X <- (a I + b A + c A²) X``,
    ``A = X Xᵀ``, keeps ``X_k = Q_k X_0`` with ``Q_k`` a polynomial in ``G = X_0 X_0ᵀ``, so::

        R = G, Q = I
        for (a, b, c) in schedule:
            W = b R + c R²                # Z = a I + W: the step's left factor, (d, d), symmetric
            Q = a Q + Q W                 # = Q Z; Q_{k+1} = Z_k Q_k (polynomials in G commute)
            R = Z (R Z) = a RZ + W RZ     # = X_{k+1} X_{k+1}ᵀ, RZ = a R + R W; symmetrised;
                                          #   skipped after the last step

    This is what a tensor-parallel caller needs: with ``X = [X_1 … X_T]`` split along its
    long side, all-reduce ``g = Σ_i X_i X_iᵀ`` (normalise by ``tr(g) = ‖X‖_F²``: divide
    ``g`` by it and each ``X_i`` by its square root), call this on every rank, and apply
    ``Q·X_i`` to the local shard; for restarts repeat per segment (:func:`gram_segments`),
    one all-reduce each.

    Args:
        g: ``(d, d)`` or batched ``(..., d, d)`` symmetric PSD matrix, the Gram of a
            normalised ``X`` (eigenvalues in ``[0, 1]``). Its dtype is the iteration dtype.
        coefficients, steps: as :func:`newton_schulz` (validated the same way).

    Returns:
        ``Q``, same shape and dtype as ``g`` (the identity for ``steps == 0``). ``g`` is not
        modified.

    Cost: ``(8·steps - 6)·d³`` matmul FLOPs for ``steps >= 1`` (``R²`` each step, ``Q Z``
    from the second step, ``Z R Z`` before the last).

    Raises:
        ValueError: ``g`` is not a (batch of) square matrix, is complex, or a bad
            coefficient spec / ``steps``.
    """
    if g.ndim < 2 or g.shape[-1] != g.shape[-2]:
        raise ValueError(f"gram_ns_from_gram needs square (d, d) matrices, got shape {tuple(g.shape)}")
    if g.is_complex():
        raise ValueError("gram_ns_from_gram supports real tensors only")
    schedule = coefficient_schedule(coefficients, steps)
    lead, d = g.shape[:-2], g.shape[-1]
    R = g.reshape(-1, d, d)
    Q = _gram_q(R, schedule)
    return Q.reshape(*lead, d, d)


def _gram_q(R: Tensor, schedule: Sequence[Triple]) -> Tensor:
    """:func:`gram_ns_from_gram` on a (B, d, d) batch and a resolved schedule (``R`` is not
    modified): ``Q = A·I + Q'`` from :func:`_gram_poly`."""
    Qs, A = _gram_poly(R, schedule)
    Qs.diagonal(dim1=-2, dim2=-1).add_(A)
    return Qs


def _gram_poly(R: Tensor, schedule: Sequence[Triple], workspace: Optional[list[Tensor]] = None) -> tuple[Tensor, float]:
    """One Gram NS segment on a (B, d, d) batch: ``(Q', A)`` with the segment's factor
    ``Q = Z_L ⋯ Z_1 = A·I + Q'`` (``Q'`` a new tensor; ``R`` is not modified).

    ``W_k = b_k R_k + c_k R_k²``, ``Z_k = a_k I + W_k``, and every product with ``Z_k`` is one
    fused ``baddbmm`` (``a·M + M·W``): the large ``a·I`` part is never rounded on its own (in
    bf16 that alone costs ~2x accuracy), as in Dao-AILab/gram-newton-schulz. A one-step segment
    returns ``(W, a)``, so the caller applies it as ``a·X + W·X`` in one ``baddbmm``: exactly the
    standard iteration's step. A longer one returns ``(Q, 0)``: its ``Π a`` (12 for two "muon"
    steps, 484 for five) would cancel against ``Q'`` in low precision. The ``(d, d)``
    intermediates live in ``workspace``, a list of free ``R``-shaped buffers that the caller may
    share between segments (taken from and given back to as values die, ``out=``; fresh buffers
    when it runs dry).
    """
    spare: list[Tensor] = [] if workspace is None else workspace

    def buf() -> Tensor:
        return spare.pop() if spare else torch.empty_like(R, memory_format=torch.contiguous_format)

    if not schedule:
        return torch.zeros_like(R, memory_format=torch.contiguous_format), 1.0
    Q: Optional[Tensor] = None
    last = len(schedule) - 1
    for k, (a, b, c) in enumerate(schedule):
        W = torch.baddbmm(R, R, R, beta=b, alpha=c, out=buf())  # b·R + c·R²
        if k < last:
            RZ = torch.baddbmm(R, R, W, beta=a, out=buf())  # R·Z
            ZRZ = torch.baddbmm(RZ, W, RZ, beta=a, out=buf())  # Z·R·Z
            if k > 0:
                spare.append(R)
            R = torch.add(ZRZ, ZRZ.mT, out=RZ).mul_(0.5)  # symmetrised, into RZ's storage
            spare.append(ZRZ)
        elif k > 0:
            spare.append(R)
        if last == 0:
            return W, a  # Q = a·I + W
        if Q is None:
            Q = W
            Q.diagonal(dim1=-2, dim2=-1).add_(a)  # Q = Z
        else:
            nxt = torch.baddbmm(Q, Q, W, beta=a, out=buf())  # Q·Z
            spare += [Q, W]
            Q = nxt
    assert Q is not None
    return Q, 0.0


def gram_newton_schulz(
    x: Tensor,
    *,
    coefficients: Coefficients = (3.4445, -4.775, 2.0315),
    steps: int = 5,
    eps: float = 1e-7,
    dtype: torch.dtype = torch.bfloat16,
    restart_every: Restarts = GRAM_RESTART_EVERY,
    fallback: bool = True,
    on_fallback: Optional[Callable[[Tensor], None]] = None,
) -> Tensor:
    """Newton-Schulz through the ``(d, d)`` Gram matrix (Gram Newton-Schulz, with restarts).

    Zhang, Amsel, Chen, Dao, "Gram Newton-Schulz" (2026,
    https://dao-ailab.github.io/blog/2026/gram-newton-schulz/, code:
    https://github.com/Dao-AILab/gram-newton-schulz). Same polynomial as
    :func:`newton_schulz` with the same ``coefficients``/``steps``/``eps``, evaluated as:

    1. ``X = x.to(dtype)``, wide orientation ``(d, D)``, ``d <= D`` (tall input transposed),
       ``X /= max(‖X‖_F, eps)`` per matrix — :func:`newton_schulz`'s prologue (when ``x`` is
       already in ``dtype`` the scaled copy is not formed: the first Gram is divided by the
       squared norm and the first factor by the norm, which differs only by rounding);
    2. for each segment of the schedule between restarts (:func:`gram_segments`):
       ``G = X Xᵀ`` (from ``d >= 256`` only its lower blocks are multiplied,
       :func:`_symmetric_gram`), ``Q = gram_ns_from_gram(G, segment)``, ``X = Q X`` (for a
       one-step segment as ``a·X + W·X`` in one ``baddbmm``, the standard step itself);
    3. transpose back.

    Only ``(d, d)`` products run inside a segment; ``(d, D)`` products only at its ends. A
    restart re-forms ``G`` from the current ``X``, which is PSD by construction, so the
    rounding drift that ``R = Z R Z`` accumulates (in bf16 it can produce negative
    eigenvalues, which the polynomial then amplifies) is discarded; ``restart_every=2``
    (default) restarts before steps 2 and 4 of 5. Dao-AILab recommends one restart after
    step 2 for 5 steps, ``restart_every=[2]``.

    Exactness: in exact arithmetic the result equals :func:`newton_schulz` (every ``Q`` is a
    polynomial in ``G``, so ``Q X_0`` is the standard iterate; ``restart_every=1`` is the
    standard iteration with ``a`` folded into one factor). In floating point it differs.
    Measured relative distance to the standard iteration run in float64, on the directions
    with normalised singular value ``s >= 1e-2`` (the "err64" of benchmarks/ns_accuracy.py
    and docs/newton_schulz.md; standard backend in brackets):

    - float64: ~1e-14 (tests hold 1e-12 of the largest entry);
    - float32: 4e-7 to 3e-6 with "muon" [3e-7 to 1.4e-6]; 3e-6 to 5e-5 with
      "polar_express" [2e-6 to 7e-6];
    - bfloat16: 1e-2 to 4e-2 with "muon" [3e-3 to 1.5e-2]; 2e-2 to 1e-1 with
      "polar_express" [9e-3 to 9e-2], and 0.3 on a rank-1 matrix [0.09].

    Why: rounding errors of ``Q`` are relative to ``‖Q‖``, which on the input's
    small-singular-value directions is the product of the segment's ``a`` coefficients
    (3.4² = 12 for "muon", 8.1·4.1 = 33 for the first "polar_express" segment), while the
    standard iteration's errors are relative to ``‖X‖ <= 1.2``; and ``G`` holds squared
    singular values, so directions with ``s`` below ~``sqrt(eps_dtype)`` (bf16: 0.06) are
    represented in ``G`` mostly by rounding noise. Restarts bound the first effect; fp16 (as the
    Gram NS reference uses; 10 mantissa bits against bf16's 7) is about 10x more accurate
    than bf16 here, fp32 removes both effects for practical purposes.

    Safe fallback (``fallback=True``, default). With ``(min_slope, max_gain)`` =
    :func:`schedule_gain_bounds` (exact-arithmetic facts of the schedule), a matrix's Gram
    result ``Y`` is rejected when

    - it is not finite, or
    - its largest singular value exceeds ``1.1·max_gain`` (a deterministic 8-step power
      iteration gives a lower estimate, so this is never a false alarm; for ``D > 1.5·d`` it
      runs on the last segment's ``(d, d)`` factor and Gram, ``Y Yᵀ = Q G Qᵀ``, where their
      rounding is small enough for that, :func:`_gram_estimate_is_tight`: fp32 with these
      presets, and bf16 with the default restarts; otherwise on ``Y`` itself), or
    - ``⟨Y, X⟩ < 0.9·min_slope`` for the normalised input ``X`` (``‖X‖_F = 1``; exact:
      ``⟨Y, X⟩ = Σ P(s_i)·s_i >= min_slope``): the result lost the input's directions;

    and is then recomputed with :func:`newton_schulz` (same arguments), reported by a
    ``RuntimeWarning`` and, if given, to ``on_fallback``. The first two catch the
    instability of the Gram form (rounding makes small eigenvalues of ``R`` negative or
    inflates them, and the polynomial amplifies them: without restarts, bf16 results on the
    zoo of benchmarks/ns_accuracy.py with condition number >= 1e2 or rank 4 reach largest
    singular values from 12 to 7e8); the third catches a result turned away from its input,
    which ``Q``'s rounding error (relative to ``‖Q‖``, i.e. up to ``Π a``) can cause on
    low-rank input when restarts are sparse. None of them catches the milder loss of
    accuracy above: with the default restarts no zoo matrix falls back. Cost per matrix: one
    pass over ``Y`` and the input (``⟨Y, X⟩``), ``~48·d²`` FLOPs of power iteration on the
    factors (``~32·d·D`` on ``Y``), and one host synchronisation per call.

    Shapes, dtype, zero input: as :func:`newton_schulz` (``(m, n)`` or ``(..., m, n)``;
    result in ``dtype`` with ``x``'s shape, contiguous — a tall input's iterates live in its own
    layout, each product computed as its transpose; ``x`` is never modified). An all-zero
    matrix maps to zeros (``G = 0``, ``X = 0``).

    Args:
        x: real floating-point tensor, ``x.ndim >= 2``.
        coefficients, steps, eps, dtype: as :func:`newton_schulz`.
        restart_every: see :func:`gram_segments` (int ``>= 1``, sequence of 0-based steps,
            or ``None``).
        fallback: enable the safe fallback above.
        on_fallback: called once, only when some matrices fall back, with the 1-D int64
            indices (into ``x.reshape(-1, m, n)``, on ``x``'s device) of the matrices
            recomputed, before the warning. The module keeps no count; this callback is the
            observable for callers that need one (benchmarks/ns_accuracy.py counts with it).
            Default ``None``: not called.

    Returns:
        Tensor of ``x.shape`` in ``dtype``.

    Raises:
        ValueError: as :func:`newton_schulz`, or a bad ``restart_every``.
    """
    _check_input(x, dtype, "gram_newton_schulz")
    schedule = coefficient_schedule(coefficients, steps)
    segments = gram_segments(schedule, restart_every)

    lead, m, n = x.shape[:-2], x.shape[-2], x.shape[-1]
    tall = m > n
    X0 = x.reshape(-1, m, n)
    if X0.dtype != dtype:
        X0 = X0.to(dtype)
    if tall:
        X0 = X0.mT
    norms = torch.linalg.vector_norm(X0, dim=(-2, -1), keepdim=True)
    scale = norms.clamp(min=eps)
    # X0 = x / scale is never formed when x already has the iteration dtype: the first Gram is
    # x·xᵀ / scale² and the first factor is divided by the scale instead (d² elements, not d·D;
    # one (B, d, D) buffer and a pass fewer).
    scaled_input = bool(segments) and X0.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
    if not scaled_input:
        if X0.untyped_storage().data_ptr() == x.untyped_storage().data_ptr():
            X0 = X0.clone()
        X0.div_(scale)
    # Workspace of the call: the Gram (re-formed per segment in the same storage; after the loop
    # it is the last segment's, which the fallback check reads) and two (B, d, D) buffers that the
    # segments' products alternate between (x itself is never written).
    # For a tall input the iterates are stored in its own (B, D, d) layout, each product
    # written as its transpose (X_t·Pᵀ for P·X, same FLOPs): every buffer, the input included,
    # is then contiguous, so the fallback check's ⟨Y, X⟩ is one BLAS pass and the result needs
    # no transposed copy. The algebra below is on the wide (B, d, D) views either way.
    B, d = X0.shape[0], X0.shape[-2]
    wide_shape = (B, d, X0.shape[-1])

    def big() -> Tensor:  # one (B, d, D) iterate buffer, as a wide view
        return X0.new_empty((B, X0.shape[-1], d)).mT if tall else X0.new_empty(wide_shape)

    def product(P: Tensor, X: Tensor, beta: float, out: Tensor) -> None:  # out = beta·X + P·X
        if tall:
            if beta:
                torch.baddbmm(X.mT, X.mT, P.mT, beta=beta, out=out.mT)
            else:
                torch.bmm(X.mT, P.mT, out=out.mT)
        elif beta:
            torch.baddbmm(X, P, X, beta=beta, out=out)
        else:
            torch.bmm(P, X, out=out)

    G = X0.new_empty((B, d, d)) if segments else None
    spare: list[Tensor] = []
    work: list[Tensor] = []  # free (B, d, d) buffers, shared by the segments
    Q, A, X = None, 1.0, X0
    for j, segment in enumerate(segments):
        G = _symmetric_gram(X, out=G)
        if j == 0 and scaled_input:
            G.div_(scale.square())
        if Q is not None:
            work.append(Q)
        Q, A = _gram_poly(G, segment, work)  # the segment's factor A·I + Q
        Y = spare.pop() if spare else big()
        if j == 0 and scaled_input:
            P = torch.div(Q, scale, out=work.pop() if work else None)
            P.diagonal(dim1=-2, dim2=-1).add_(A / scale.reshape(-1, 1))
            product(P, X, 0.0, Y)  # (A·I + Q)/scale · x
            work.append(P)
        else:
            product(Q, X, A, Y)  # A·X + Q·X
        if X is not X0:
            spare.append(X)
        X = Y

    if fallback and segments:
        min_slope, max_gain = schedule_gain_bounds(schedule)
        top = _GRAM_FALLBACK_MARGIN * max_gain
        floor = min_slope / _GRAM_FALLBACK_MARGIN
        acc = torch.promote_types(X.dtype, torch.float32)
        inner = _batched_inner(X.mT, X0.mT, acc) if tall else _batched_inner(X, X0, acc)
        if scaled_input:
            inner = inner / scale.reshape(-1).to(acc)
        # ‖X0‖_F²: 1, or 0 for a zero matrix; from the norms, without another pass over X0
        x0_sq = (norms / scale).square().reshape(-1).to(acc)
        # NaN / inf compare False, so they count as bad.
        # on the factors: 3 products with (d, d) per power step against 2 with (d, D) on Y
        if 3 * d < 2 * X.shape[-1] and _gram_estimate_is_tight(segments[-1], dtype):
            norm_estimate = _gram_spectral_norm_estimate(Q, A, G)
        else:
            norm_estimate = _spectral_norm_estimate(X)
        ok = (norm_estimate <= top) & (inner >= floor * x0_sq)
        bad = ~ok
        if bool(bad.any()):
            idx = bad.nonzero().flatten()
            if on_fallback is not None:
                on_fallback(idx)
            warnings.warn(
                f"gram_newton_schulz: {idx.numel()} of {X.shape[0]} matrices of shape {(m, n)} "
                f"in {dtype} gave a non-finite result, a singular value above {top:.3g} or an "
                f"alignment <Y, X> below {floor:.3g}; recomputed with the standard "
                "Newton-Schulz iteration",
                RuntimeWarning,
                stacklevel=2,
            )
            redo = _newton_schulz(x.reshape(-1, m, n)[idx], schedule, eps, dtype)
            X[idx] = redo.mT if tall else redo
    if tall:
        X = X.mT
    return X.reshape(*lead, m, n)


#: Batch size up to which :func:`_batched_inner` runs one BLAS ``dot`` per matrix (beyond it
#: the per-call cost of a Python loop outweighs ``vecdot``'s slower pass).
_DOT_LOOP_MAX_BATCH = 16


def _batched_inner(Y: Tensor, X: Tensor, acc: torch.dtype) -> Tensor:
    """``⟨Y_b, X_b⟩`` (Frobenius) per matrix of two ``(B, d, D)`` batches, in ``acc``. Where both
    are contiguous in ``acc``: a single pass without a temporary, one BLAS ``dot`` per matrix
    for a few large ones, ``linalg.vecdot`` for many (on CPU both took 0.3-0.4x the time of a
    batched ``(1, dD)·(dD, 1)`` product); else an elementwise product and sum."""
    if Y.is_contiguous() and X.is_contiguous() and Y.dtype == X.dtype == acc:
        Yf, Xf = Y.reshape(Y.shape[0], -1), X.reshape(X.shape[0], -1)
        if Y.shape[0] <= _DOT_LOOP_MAX_BATCH:
            return torch.stack([torch.dot(y, x) for y, x in zip(Yf, Xf)])
        return torch.linalg.vecdot(Yf, Xf)
    return (Y * X).sum(dim=(-2, -1), dtype=acc)


def _symmetric_gram(X: Tensor, out: Optional[Tensor] = None) -> Tensor:
    """``X Xᵀ`` of a ``(B, d, K)`` batch in ``X``'s dtype (written into ``out``, a ``(B, d, d)``
    buffer, when given).

    ``d < GRAM_SYM_MIN_SIDE``: one ``bmm``. Otherwise only the blocks on and above the diagonal
    are multiplied (:func:`dmuon.plan._cost.flops.gram_product_flops`: 3/4 of the FLOPs): with
    ``h = d // 2``, the first ``h`` rows ``G[:, :h] = X[:h]·Xᵀ`` and ``G[h:, h:] = X[h:]·X[h:]ᵀ``
    go straight into their (row-strided) places in ``G``, and the lower left block is the
    transpose of the upper right one. Each entry is the dot product a full ``bmm`` computes, up
    to the kernel's summation order. Symmetric up to that order within the diagonal blocks (the
    whole ``G`` below the threshold): MKL's fp32 / bf16 ``A·Aᵀ`` is bitwise symmetric on this
    Zen 3 CPU, its fp64 one to ~1e-16 relative. Nothing downstream needs more (the
    ``(d, d)`` iteration symmetrises its own ``R``); a ``(A + Aᵀ)/2`` pass here read a transpose
    and cost up to 0.6x the product itself (8 x 128 x 128).
    """
    B, d = X.shape[0], X.shape[-2]
    G = X.new_empty((B, d, d)) if out is None else out
    if d < GRAM_SYM_MIN_SIDE:
        return torch.bmm(X, X.mT, out=G)
    h = d // 2
    torch.bmm(X[:, :h], X.mT, out=G[:, :h])
    torch.bmm(X[:, h:], X[:, h:].mT, out=G[:, h:, h:])
    G[:, h:, :h] = G[:, :h, h:].mT
    return G


def sharded_gram_newton_schulz(
    x: Tensor,
    *,
    all_reduce_sum: Callable[[Tensor], Tensor],
    coefficients: Coefficients = (3.4445, -4.775, 2.0315),
    steps: int = 5,
    eps: float = 1e-7,
    dtype: torch.dtype = torch.bfloat16,
    restart_every: Restarts = GRAM_RESTART_EVERY,
) -> Tensor:
    """Gram Newton-Schulz of matrices split by columns over ranks (tensor parallelism).

    Each rank passes its column block ``x`` = ``X_i`` of ``X = [X_1 … X_T]``, shape ``(d, D_i)``
    or ``(B, d, D_i)`` (``B`` matrices batched; a row-sharded matrix enters transposed, so ``d``
    is always the side that is not split), and gets ``NS(X)``'s block ``i`` back. Only ``(d,
    d)`` matrices cross ranks (Zhang, Amsel, Chen, Dao, "Gram Newton-Schulz"; the bytes: the
    plan's ``tp_nbytes``, docs/tensor_parallel.md):

    1. ``G = Σ_i X_i X_iᵀ`` in float32 (``all_reduce_sum``, one call per segment);
       the first one also gives ``‖X‖_F² = tr(G)``: ``X_i /= max(‖X‖_F, eps)``, ``G /= ‖X‖_F²``
       (:func:`newton_schulz`'s prologue, without a separate norm all-reduce);
    2. per segment of the schedule between restarts (:func:`gram_segments`):
       ``Q = gram_ns_from_gram(sym(G).to(dtype), segment)``, ``X_i = Q X_i``; a restart
       re-forms ``G`` from the current blocks (another all-reduce).

    Every rank computes the same ``Q`` from the same all-reduced ``G``, so the blocks stay
    consistent. In exact arithmetic the result is :func:`newton_schulz` of the full ``X`` (and
    :func:`gram_newton_schulz` with the same ``restart_every``); in floating point it differs by
    the Gram-form rounding documented on :func:`gram_newton_schulz` plus the order of the Gram
    sum. No safe fallback: detecting a bad result needs the full matrix (use fp32 ``dtype`` or
    the default restarts, with which no matrix of the accuracy zoo falls back).

    Args:
        x: real floating-point ``(d, D_i)`` or ``(B, d, D_i)``; not modified.
        all_reduce_sum: sums a float32 ``(B, d, d)`` tensor over the ranks (in place or not)
            and returns the sum; identity for one rank.
        coefficients, steps, eps, dtype, restart_every: as :func:`gram_newton_schulz`.

    Returns:
        ``x.shape`` in ``dtype``: this rank's block of the orthogonalised matrix.

    Raises:
        ValueError: as :func:`newton_schulz`; ``steps == 0`` (the iteration is what needs the Gram).
    """
    _check_input(x, dtype, "sharded_gram_newton_schulz")
    if steps == 0:
        raise ValueError("sharded_gram_newton_schulz needs steps >= 1")
    schedule = coefficient_schedule(coefficients, steps)
    segments = gram_segments(schedule, restart_every)
    lead, d, D = x.shape[:-2], x.shape[-2], x.shape[-1]
    X = x.reshape(-1, d, D).to(dtype, copy=True)
    for i, segment in enumerate(segments):
        G = all_reduce_sum(_symmetric_gram(X.float()))
        if i == 0:
            norm = G.diagonal(dim1=-2, dim2=-1).sum(-1).clamp_(min=0).sqrt_().clamp_(min=eps)
            X.div_(norm.to(dtype)[:, None, None])
            G = G / (norm * norm)[:, None, None]
        G = ((G + G.mT) * 0.5).to(dtype)
        X = torch.bmm(_gram_q(G, segment), X)
    return X.reshape(*lead, d, D)


#: A Gram result is rejected when its largest singular value exceeds this multiple of the
#: schedule's ``max_gain``, or its alignment falls below ``min_slope`` divided by it
#: (:func:`schedule_gain_bounds`; rounding alone stays within ~2% of either in bf16).
_GRAM_FALLBACK_MARGIN = 1.1
#: Power-iteration steps of :func:`_spectral_norm_estimate` and :func:`_gram_spectral_norm_estimate`.
_POWER_STEPS = 8
#: :func:`_gram_spectral_norm_estimate` normalises its iterate every this many steps (a divisor of
#: ``_POWER_STEPS``, so it ends normalised). In between it grows by at most ``‖Y‖_2²`` per step: a
#: good result (``‖Y‖_2 <= 1.1·max_gain``, 1.3 for these presets) grows < 10x in 4 steps; a
#: blown-up one may overflow to inf / NaN, which the check counts as bad — exactly its verdict.
_POWER_NORMALISE_EVERY = 4


def _spectral_norm_estimate(X: Tensor) -> Tensor:
    """A lower estimate of ``‖X_b‖_2`` per matrix of a ``(B, d, D)`` batch (float32 or wider).

    ``_POWER_STEPS`` power iterations on ``X Xᵀ`` from a fixed pseudo-random start (so the
    result is deterministic), each two batched vector-matrix products in ``X``'s dtype
    (``4·d·D`` FLOPs per matrix, no copy of ``X``); the returned ``‖vᵀ X‖`` with ``‖v‖ = 1``
    never exceeds the true norm (up to the rounding of ``X``'s dtype), so a value clearly above
    a limit proves the limit is exceeded. Non-finite input gives a non-finite estimate.

    The iterate is a row vector (``(B, 1, d)``): ``vᵀ·X`` and ``(vᵀX)·Xᵀ`` stream ``X`` in its
    own layout, where the column form ``X·v`` / ``Xᵀ·v`` runs 10-40x slower in CPU ``bmm``
    (benchmarks/ns_backends.py; it made this check cost more than half of Gram NS itself).
    """
    acc = torch.promote_types(X.dtype, torch.float32)
    g = torch.Generator(device="cpu").manual_seed(0x5EED)
    v = torch.randn(1, 1, X.shape[-2], generator=g, dtype=torch.float32)
    v = v.to(device=X.device, dtype=X.dtype).expand(X.shape[0], -1, -1).contiguous()
    for _ in range(_POWER_STEPS):
        v = torch.bmm(torch.bmm(v, X), X.mT)
        # (the sum of squares of a (B, 1, d) vector; linalg.vector_norm over two dims costs
        # ~0.2 ms per call on CPU here, more than the two products)
        norm = v.to(acc).square().sum(dim=-1, keepdim=True).sqrt_()
        v = (v / norm.clamp_(min=1e-30)).to(X.dtype)
    return torch.bmm(v, X).to(acc).square().sum(dim=(-2, -1)).sqrt_()


#: Largest worst-case error of :func:`_gram_spectral_norm_estimate`'s ``Q G Qᵀ`` against the
#: result's ``Y Yᵀ`` (on eigenvalues ``<= max_gain² ~ 1.44``) for which the check uses it.
_GRAM_ESTIMATE_MAX_ERROR = 0.1


def _gram_estimate_is_tight(segment: Sequence[Triple], dtype: torch.dtype) -> bool:
    """Whether ``Q G Qᵀ`` (the last segment's factor and Gram) stands for the result's
    ``Y Yᵀ`` in the fallback check: ``G`` carries rounding of relative size ``eps(dtype)``,
    which ``Q`` amplifies by up to ``‖Q‖² <= (Π |a|)²`` over the segment's steps (the
    polynomial's value at 0). Tight when that error stays below
    :data:`_GRAM_ESTIMATE_MAX_ERROR`: in fp32 for every "muon" last segment of up to 5 steps and every
    "polar_express" one but a 5-step segment from step 1 (whose ``Π a`` is ~1000); in bf16 / fp16 only for a one-step
    last segment with ``a <= 3.5`` (the default restarts with "muon": 3.4445² · 2⁻⁷ = 0.093).
    Otherwise — a long last segment in low precision, exactly where rounding of
    ``G``'s small eigenvalues makes the Gram form unstable — the check multiplies the result
    itself (:func:`_spectral_norm_estimate`)."""
    amp = math.prod(abs(a) for a, _, _ in segment)
    return amp * amp * torch.finfo(dtype).eps <= _GRAM_ESTIMATE_MAX_ERROR


def _gram_spectral_norm_estimate(Q: Tensor, A: float, G: Tensor) -> Tensor:
    """A lower estimate of ``‖Y_b‖_2``, ``Y = (A·I + Q)·X``, per matrix from ``(B, d, d)``
    factors alone, where ``G = X Xᵀ``: ``Y Yᵀ = P G Pᵀ`` with ``P = A·I + Q``, so
    ``_POWER_STEPS`` power iterations on ``P G Pᵀ`` (three row-vector products with ``(d, d)``
    matrices each, ``6·d²`` FLOPs, instead of two passes over the ``(d, D)`` result) from a
    fixed pseudo-random start (deterministic), in ``Q``'s dtype. Returns ``sqrt(uᵀ G u)`` with
    ``uᵀ = vᵀ P``, ``‖v‖ = 1``, which never exceeds the true norm beyond the rounding of ``G``
    (:func:`_gram_estimate_is_tight` says when that is small), so a value clearly above a limit
    shows the limit exceeded. Non-finite factors give a non-finite estimate. (Row vectors:
    ``vᵀ·M`` streams ``M`` in its own layout; the column form ``M·v`` runs 10-40x slower in CPU
    ``bmm``.)
    """
    acc = torch.promote_types(Q.dtype, torch.float32)
    g = torch.Generator(device="cpu").manual_seed(0x5EED)
    v = torch.randn(1, 1, Q.shape[-1], generator=g, dtype=torch.float32)
    v = v.to(device=Q.device, dtype=Q.dtype).expand(Q.shape[0], -1, -1).contiguous()
    Qt = Q.mT
    for step in range(1, _POWER_STEPS + 1):
        u = torch.bmm(torch.baddbmm(v, v, Q, beta=A), G)  # vᵀ P G
        v = torch.baddbmm(u, u, Qt, beta=A)  # vᵀ P G Pᵀ
        if step % _POWER_NORMALISE_EVERY == 0:
            # the sum of squares as one (1, d)·(d, 1) product per matrix
            v = v * torch.bmm(v, v.mT).clamp_(min=1e-30).rsqrt_()
    u = torch.baddbmm(v, v, Q, beta=A)
    return torch.bmm(torch.bmm(u, G), u.mT).reshape(-1).to(acc).clamp_(min=0).sqrt_()


def gram_ns_flops(
    m: int, n: int, steps: int, *, restart_every: Restarts = GRAM_RESTART_EVERY, num_matrices: int = 1
) -> int:
    """Matmul FLOPs of :func:`gram_newton_schulz` on ``num_matrices`` ``(m, n)`` matrices.

    With ``d = min(m, n)``, ``D = max(m, n)`` and the schedule split into segments of
    lengths ``L_1 … L_S`` (:func:`gram_segments`; ``S = 1 +`` number of restarts), the
    formula of :func:`dmuon.plan._cost.flops.gram_ns_segment_flops`::

        num_matrices * Σ_j [ g(d, D)  +  2·d²·D  +  (8·L_j - 6)·d³ ]

    per segment: ``G = X Xᵀ`` (``g`` = :func:`dmuon.plan._cost.flops.gram_product_flops`: ``2·d²·D``
    below ``d = 256``, ``1.5·d²·D`` from there, the symmetric product of
    :func:`_symmetric_gram`) and ``Q·X`` (``2·d²·D``), and inside (:func:`gram_ns_from_gram`)
    ``R²`` every step, ``Q·Z`` from the segment's second step and ``Z·R·Z`` (two products)
    before its last step (``2·d³`` each). Compare :func:`ns_flops`: ``steps·(4·d²·D + 2·d³)``.
    For 5 steps with the default restarts (segments 2, 2, 1) and ``d >= 256``: ``10.5·d²·D +
    22·d³`` versus ``20·d²·D + 10·d³``: Gram NS is cheaper once ``D > 1.26·d`` (``D > 1.5·d``
    below ``d = 256``), and tends to 1.9x fewer FLOPs for ``D >> d`` (one restart after step 2:
    2.9x); on a square matrix it costs 1.08x more. The fallback,
    norms and elementwise work are not counted.

    Raises:
        ValueError: a negative argument or a bad ``restart_every``.
    """
    if min(m, n, steps, num_matrices) < 0:
        raise ValueError(
            f"gram_ns_flops arguments must be >= 0, got m={m} n={n} steps={steps} num_matrices={num_matrices}"
        )
    d, D = min(m, n), max(m, n)
    return num_matrices * gram_ns_segment_flops(d, D, gram_segment_lengths(steps, restart_every))
