r"""Cost model: bytes on the wire, Newton-Schulz FLOPs and memory, for DMuon and a baseline.

Units are in the names: ``_numel`` = elements, ``_nbytes`` = bytes, ``_flops`` = floating-point
operations (a multiply-add counts 2). All figures are per optimizer step.

Byte accounting (:func:`collective_rank_nbytes`, the ledger's rule): for one collective over a group of ``k`` ranks and a
payload of ``S`` bytes, every non-root rank is charged ``S`` (it receives ``S`` in a broadcast,
sends ``S`` in a reduce), so the collective totals ``(k-1)*S``. An all-gather or
reduce-scatter of a full tensor of ``S`` bytes is charged ``S*(k-1)/k`` per rank (``(k-1)*S``
in total; here ``S`` includes FSDP2's dim-0 padding, so per-rank figures are exact integers).
Totals are summed over all mesh ranks; ``per_rank_nbytes`` is indexed by mesh rank
``replicate*N + shard`` and sums to the total. Averages are derived, never stored.

DMuon per step (mesh ``(R, N)``; ``P`` = packed segment bytes incl. alignment padding and flags,
in the phase's wire dtype; ``Q`` = subsegment bytes):

=========================  =======================  ==========================================
phase                      total bytes              charged to
=========================  =======================  ==========================================
forward broadcast          ``R*(N-1)*P_bcast``      ``(s', r')``, ``s' != seg.shard``
backward broadcast (Z3)    ``R*(N-1)*P_bcast``      same; 0 for Z2 (``reshard_after_forward=False``)
gradient reduce            ``R*(N-1)*P_reduce``     same (each non-root sends the segment)
replicate reduce (HSDP)    ``(R-1)*Q_reduce``       ``(s, r')``, ``r' != owner.replicate``
replicate broadcast        ``(R-1)*Q_param``        same, in the parameter's storage dtype
=========================  =======================  ==========================================

Baseline "FSDP2 + naive Muon" for the SAME parameters (every rank runs Newton-Schulz on every
full matrix after all-gathering its gradient). Per parameter with FSDP2 shard
``c = ceil(d0/N) * prod(shape[1:])`` elements (dim-0 chunking with padding), ``S = N*c``:

=========================  ===============================  ===================================
collective                 total bytes                      per rank
=========================  ===============================  ===================================
forward all-gather         ``R*(N-1)*S*isz_bcast``          ``(N-1)*c*isz_bcast``
backward all-gather (Z3)   same; 0 for Z2                   same
gradient reduce-scatter    ``R*(N-1)*S*isz_reduce``         ``(N-1)*c*isz_reduce``
replicate all-reduce       ``2*R*N*(R-1)*ceil(c/R)*isz_r``  ``2*(R-1)*ceil(c/R)*isz_reduce``
                           (~``2*(R-1)*S``, ring RS+AG)
naive Muon grad all-gather ``R*(N-1)*S*isz_param``          ``(N-1)*c*isz_param``
TP all-gather (``T > 1``)  ``R*N*(T-1)*S_full*isz_param``   ``(T-1)*S_full/T*isz_param``
=========================  ===============================  ===================================

With TP, ``d0``/``S`` above are of each TP rank's local shard (every column is per TP
coordinate, ``R*N*T`` ranks) and ``S_full = T*S`` is the whole matrix a naive Muon gathers.

So for Z3 on a 1-D mesh the baseline moves ``4*(N-1)*S`` versus DMuon's ``3*(N-1)*P``.

Newton-Schulz FLOPs (Muon, Jordan et al. 2024, quintic iteration on the ``m x n`` matrix with
``m <= n``): each step forms ``A = X X^T`` (``2 m^2 n``), ``A A`` (``2 m^3``) and ``B X``
(``2 m^2 n``), i.e. ``steps * (4 m^2 n + 2 m^3)`` per matrix; elementwise terms are ignored.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

from dmuon.plan.records.params import ExpertOwners, Owner, OwnerGroup, ParamSpec, _check_int, balanced_sizes, itemsize_nbytes
from dmuon.plan.rules import (
    COST_MODELS,
    GRAM_RESTART_EVERY,
    NS_STEPS,
    TP_GRAM_DTYPE,
    TP_NS_MODES,
    bcast_dtype,
    gram_segment_lengths,
    owner_group_dim,
    reduce_dtype,
)

__all__ = [
    "ByteCost",
    "BaselineByteCost",
    "RankStats",
    "ns_flops",
    "matrix_ns_flops",
    "spec_ns_flops",
    "param_weight",
    "broadcast_nbytes",
    "reduce_nbytes",
    "all_gather_nbytes",
    "reduce_scatter_nbytes",
    "all_reduce_nbytes",
    "fsdp2_shard_numel",
    "all_reduce_rank_nbytes",
    "gram_ns_segment_flops",
    "gram_product_flops",
    "GRAM_SYM_MIN_SIDE",
    "tp_gram_side",
    "tp_rank_nbytes",
    "tp_ns_flops",
    "choose_tp_ns",
    "owner_group_piece_weights",
    "member_weights",
    "owner_weights",
    "collective_rank_nbytes",
    "schedule_byte_cost",
    "PHASE_FIELDS",
    "baseline_byte_cost",
    "rank_stats",
    "baseline_rank_stats",
]


# --------------------------------------------------------------------------- formulas


def ns_flops(m: int, n: int, steps: int = NS_STEPS, *, num_matrices: int = 1) -> int:
    """Newton-Schulz FLOPs to orthogonalise ``num_matrices`` matrices of shape ``(m, n)``: the
    matmul FLOPs of ``dmuon.exec.optim.ns_kernel.newton_schulz`` (``ns_kernel`` re-exports this function).

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


def matrix_ns_flops(m: int, n: int, backend: str, *, steps: int = NS_STEPS, num_matrices: int = 1,
                    restart_every: int | Sequence[int] | None = GRAM_RESTART_EVERY) -> int:
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


def param_weight(spec: ParamSpec, cost_model: str) -> int:
    """LPT weight of a dedicated parameter: ``numel`` (elements) or :func:`spec_ns_flops` (the
    FLOPs of the backend it runs).

    Raises:
        ValueError: unknown ``cost_model``.
    """
    if cost_model == "numel":
        return spec.numel
    if cost_model == "ns_flops":
        return spec_ns_flops(spec)
    raise ValueError(f"cost_model must be one of {COST_MODELS}, got {cost_model!r}")


def broadcast_nbytes(payload_nbytes: int, group_size: int) -> int:
    """Total bytes of one broadcast of ``payload_nbytes`` to a group of ``group_size`` ranks:
    ``(k-1) * S`` (each non-root receives ``S``)."""
    return (group_size - 1) * payload_nbytes


def reduce_nbytes(payload_nbytes: int, group_size: int) -> int:
    """Total bytes of one reduce of ``payload_nbytes`` to a root: ``(k-1) * S`` (each non-root sends ``S``)."""
    return (group_size - 1) * payload_nbytes


def all_gather_nbytes(full_nbytes: int, group_size: int) -> int:
    """Total bytes of an all-gather producing ``full_nbytes`` on each of ``k`` ranks:
    ``(k-1) * S`` (``S*(k-1)/k`` per rank)."""
    return (group_size - 1) * full_nbytes


def reduce_scatter_nbytes(full_nbytes: int, group_size: int) -> int:
    """Total bytes of a reduce-scatter of a full tensor of ``full_nbytes``: ``(k-1) * S``."""
    return (group_size - 1) * full_nbytes


def all_reduce_nbytes(payload_nbytes: int, group_size: int) -> int:
    """Total bytes of an all-reduce of ``payload_nbytes``: ``2 * (k-1) * S`` (ring RS + AG)."""
    return 2 * (group_size - 1) * payload_nbytes


def all_reduce_rank_nbytes(numel: int, itemsize: int, group_size: int) -> int:
    """Bytes charged to EACH rank of a ring all-reduce (reduce-scatter + all-gather) of
    ``numel`` elements of ``itemsize`` bytes over ``k`` ranks: ``2*(k-1)*ceil(numel/k)*itemsize``
    (``~2*S`` for large ``k``; 0 for ``k == 1``). The total is ``k`` times this."""
    if group_size <= 1:
        return 0
    return 2 * (group_size - 1) * (-(-numel // group_size)) * itemsize


def collective_rank_nbytes(kind: str, numel: int, itemsize: int, group_size: int, is_root: bool) -> int:
    """Bytes charged to ONE rank of a collective over ``group_size`` ranks (the ledger's rule):

    * ``"broadcast"`` / ``"reduce"`` / ``"scatter"`` of ``numel`` elements per rank: ``S =
      numel * itemsize`` to every rank but the root (it receives / sends ``S``), 0 to the root;
    * ``"all_reduce"`` of ``numel`` elements: :func:`all_reduce_rank_nbytes` to every rank;
    * ``"all_gather"`` of ``numel`` elements per rank: ``(k-1) * S`` to every rank (it receives
      the other ranks' parts).

    Raises:
        ValueError: unknown ``kind``.
    """
    if kind in ("broadcast", "reduce", "scatter"):
        return 0 if is_root else numel * itemsize
    if kind == "all_reduce":
        return all_reduce_rank_nbytes(numel, itemsize, group_size)
    if kind == "all_gather":
        return (group_size - 1) * numel * itemsize
    raise ValueError(f"unknown collective kind {kind!r}")


#: Gram side ``d`` from which Newton-Schulz forms a Gram matrix ``X Xᵀ`` from its lower blocks
#: only (:func:`gram_product_flops`); below it, one general matmul: at ``d = 128`` the blocks'
#: 64-row products took as long as the full product for 3/4 of its FLOPs on a CPU core
#: (benchmarks/ns_backends.py ``--kernels``), so counting the saving there promised time the
#: kernels do not give; at ``d = 256`` the blocks take 0.7-0.9 of the full product's time.
GRAM_SYM_MIN_SIDE = 256


def gram_product_flops(d: int, D: int) -> int:
    """FLOPs of forming the symmetric ``(d, d)`` Gram ``X Xᵀ`` of one ``(d, D)`` matrix as
    ``dmuon.exec.optim.ns_gram`` does:

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


def tp_rank_nbytes(spec: ParamSpec, method: str, segments: int) -> int:
    """Bytes charged to each rank of the owner's TP group per step for ``spec``:

    * ``"gram"``: ``segments`` ring all-reduces of the fp32 ``(d, d)`` Gram
      (:func:`all_reduce_rank_nbytes`, :func:`tp_gram_side`);
    * ``"gather"``: an all-gather of the update in the storage dtype: ``(T-1) * S/T`` with
      ``S`` = the full matrix's bytes.
    """
    T = spec.tp_size
    if method == "gram":
        d = tp_gram_side(spec.shape, spec.tp_shard_dim)  # type: ignore[arg-type]
        return segments * all_reduce_rank_nbytes(d * d, itemsize_nbytes(TP_GRAM_DTYPE), T)
    if method == "gather":
        return (T - 1) * spec.local_numel * itemsize_nbytes(spec.dtype)
    raise ValueError(f"tp method must be 'gram' or 'gather', got {method!r}")


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


def choose_tp_ns(spec: ParamSpec, mode: str, segments: int) -> str:
    """``"gram"`` or ``"gather"`` for a TP-sharded matrix (``spec.tp_ns`` is not read).

    ``mode="auto"``: the method charging fewer bytes per step (:func:`tp_rank_nbytes`), ties to
    ``"gather"`` (no extra rounding). Per rank, Gram costs ``segments·2·(T-1)·ceil(d²/T)·4`` and
    gathering ``(T-1)·(d·D/T)·itemsize`` (``D`` = the split side), so with fp32 storage Gram
    wins when ``D > 2·segments·d``, whatever ``T``: ``D > 6·d`` with the default three segments
    (5 steps, a restart every 2), ``D > 2·d`` with no restarts. Sharding along the short side
    (e.g. a colwise ``(1024, 4096)`` k_proj) makes ``d`` the long side, so it gathers; so do
    square matrices. ``"gram"`` / ``"gather"``: forced.

    Raises:
        ValueError: unknown ``mode``.
    """
    if mode not in TP_NS_MODES:
        raise ValueError(f"tp_ns must be one of {TP_NS_MODES}, got {mode!r}")
    if spec.view is not None and spec.view_tp_problem() is None:
        return "local"  # blocks inside the TP shards: no TP collective at all
    if mode != "auto":
        return mode
    gram = tp_rank_nbytes(spec, "gram", segments)
    gather = tp_rank_nbytes(spec, "gather", segments)
    return "gram" if gram < gather else "gather"


# --------------------------------------------------------------------------- owner groups


def owner_group_piece_weights(
    spec: ParamSpec, k: int, cost_model: str, segment_lengths: Sequence[int]
) -> tuple[int, ...]:
    """LPT weight of each member of a ``k``-member owner group of ``spec``, block order (blocks
    of :func:`~dmuon.plan.records.params.balanced_sizes` along :func:`owner_group_dim`); ``k = 1``:
    ``(param_weight(spec),)``.

    ``"numel"``: the block's elements. ``"ns_flops"``: the member's share of sharded Gram NS,
    :func:`gram_ns_segment_flops` of ``(d, D_j)`` with ``d`` the short side and ``D_j`` the
    block's long side: the local Gram and ``Q·X_j`` scale with the block, the ``(d, d)``
    iteration runs on every member (so splitting a matrix ``k`` ways costs ``k·(8L-6)·d³``
    more in total per segment). Every member's block enters NS padded with zeros to the
    largest block, ``D_j = ceil(L/k)`` (zero columns add nothing to the Gram and stay zero),
    so members of one group batch identically; the FLOPs are of that width.
    """
    if k == 1:
        return (param_weight(spec, cost_model),)
    dim = owner_group_dim(spec.shape)
    return member_weights(spec, dim, balanced_sizes(int(spec.shape[dim]), k), cost_model, segment_lengths)


def member_weights(
    spec: ParamSpec, dim: int, sizes: Sequence[int], cost_model: str, segment_lengths: Sequence[int]
) -> tuple[int, ...]:
    """LPT weight of each member of an owner group cutting ``spec`` along ``dim`` into blocks of
    ``sizes`` (:func:`owner_group_piece_weights` has the rule)."""
    other = int(spec.shape[1 - dim])
    if cost_model == "numel":
        return tuple(size * other for size in sizes)
    if cost_model == "ns_flops":  # every member runs the padded block width (exec: one batch shape per group)
        return (gram_ns_segment_flops(other, max(sizes), segment_lengths),) * len(sizes)
    raise ValueError(f"cost_model must be one of {COST_MODELS}, got {cost_model!r}")


def owner_weights(
    spec: ParamSpec, owner: Owner | OwnerGroup, cost_model: str, segment_lengths: Sequence[int]
) -> tuple[tuple[int, int], ...]:
    """``(mesh rank, weight)`` of every owner of ``spec``: one pair for an :class:`Owner`, one per
    member of an :class:`OwnerGroup` (:func:`member_weights` of the group's own blocks), one per
    member of an :class:`ExpertOwners` (its experts' share of the stack's weight)."""
    if isinstance(owner, ExpertOwners):
        per_expert = param_weight(spec, cost_model) // spec.num_experts
        return tuple((rank, per_expert * size) for rank, size in zip(owner.ranks, owner.sizes))
    if isinstance(owner, OwnerGroup):
        return tuple(zip(owner.ranks, member_weights(spec, owner.dim, owner.sizes, cost_model, segment_lengths)))
    return ((owner.rank, param_weight(spec, cost_model)),)


def fsdp2_shard_numel(shape: Sequence[int], num_shards: int) -> int:
    """Elements of one FSDP2 shard of a tensor of ``shape``, padding included:
    ``ceil(shape[0] / N) * prod(shape[1:])`` (FSDP2 chunks dim 0 and pads every chunk)."""
    if not shape:
        return 1
    return -(-shape[0] // num_shards) * math.prod(shape[1:])


# --------------------------------------------------------------------------- records


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ByteCost:
    """DMuon bytes per step, summed over all mesh ranks (module docstring table).

    ``total_nbytes`` is the sum of the phase fields; ``per_rank_nbytes[rank]`` sums to
    ``total_nbytes``. Without TP it has ``R*N`` entries (mesh rank ``replicate*N + shard``);
    with a TP degree ``T > 1`` it has ``R*N*T``, indexed ``(replicate*N + shard)*T + tp`` (the
    layout of ``init_device_mesh(device, (R, N, T))`` / ``(N, T)``), every data-parallel phase
    counted once per TP coordinate (each moves its own shards), and ``tp_nbytes`` is the
    owner TP groups' Gram all-reduces and all-gathers (:func:`tp_rank_nbytes`).
    ``qk_clip_nbytes``: QK-clip's all-reduce (max) of the per-head max logits, ``ΣH`` fp32
    values over the data-parallel mesh (:mod:`dmuon.plan.records.qk_clip`); 0 without QK-clip.
    ``owner_group_nbytes``: the owner groups' Gram all-reduces (fp32 ``(d, d)`` per grouped
    matrix and Gram segment over its ``k`` members, ring-charged as every all-reduce); 0
    without owner groups.
    """

    forward_broadcast_nbytes: int
    backward_broadcast_nbytes: int
    reduce_nbytes: int
    replicate_reduce_nbytes: int
    replicate_broadcast_nbytes: int
    total_nbytes: int
    per_rank_nbytes: tuple[int, ...]
    tp_nbytes: int = 0
    qk_clip_nbytes: int = 0
    owner_group_nbytes: int = 0

    PHASES = (
        "forward_broadcast_nbytes",
        "backward_broadcast_nbytes",
        "reduce_nbytes",
        "replicate_reduce_nbytes",
        "replicate_broadcast_nbytes",
        "tp_nbytes",
        "qk_clip_nbytes",
        "owner_group_nbytes",
    )

    def __post_init__(self) -> None:
        for name in self.PHASES + ("total_nbytes",):
            _check_int("ByteCost", name, getattr(self, name), 0)
        if type(self.per_rank_nbytes) is not tuple:
            raise TypeError("ByteCost.per_rank_nbytes must be a tuple")
        for v in self.per_rank_nbytes:
            _check_int("ByteCost", "per_rank_nbytes[i]", v, 0)
        if sum(getattr(self, n) for n in self.PHASES) != self.total_nbytes:
            raise ValueError("ByteCost.total_nbytes must equal the sum of the phase fields")
        if sum(self.per_rank_nbytes) != self.total_nbytes:
            raise ValueError("ByteCost.per_rank_nbytes must sum to total_nbytes")

    @property
    def max_rank_nbytes(self) -> int:
        """Bytes of the busiest rank (derived)."""
        return max(self.per_rank_nbytes, default=0)

    def to_dict(self) -> dict[str, Any]:
        optional = ("tp_nbytes", "qk_clip_nbytes", "owner_group_nbytes")  # absent when 0: older cost dicts unchanged
        d: dict[str, Any] = {n: getattr(self, n) for n in self.PHASES + ("total_nbytes",) if n not in optional or getattr(self, n)}
        d["per_rank_nbytes"] = list(self.per_rank_nbytes)
        return d


# ``PHASES`` must not become a dataclass field: it is a plain class attribute (no annotation).


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class BaselineByteCost:
    """FSDP2 + naive all-gather Muon bytes per step for the dedicated parameters (module docstring)."""

    forward_all_gather_nbytes: int
    backward_all_gather_nbytes: int
    reduce_scatter_nbytes: int
    replicate_all_reduce_nbytes: int
    muon_all_gather_nbytes: int
    total_nbytes: int
    per_rank_nbytes: tuple[int, ...]
    tp_all_gather_nbytes: int = 0  # TP: naive Muon gathers each TP-sharded matrix's T shards

    PHASES = (
        "forward_all_gather_nbytes",
        "backward_all_gather_nbytes",
        "reduce_scatter_nbytes",
        "replicate_all_reduce_nbytes",
        "muon_all_gather_nbytes",
        "tp_all_gather_nbytes",
    )

    def __post_init__(self) -> None:
        if sum(getattr(self, n) for n in self.PHASES) != self.total_nbytes:
            raise ValueError("BaselineByteCost.total_nbytes must equal the sum of the phase fields")
        if sum(self.per_rank_nbytes) != self.total_nbytes:
            raise ValueError("BaselineByteCost.per_rank_nbytes must sum to total_nbytes")

    @property
    def max_rank_nbytes(self) -> int:
        return max(self.per_rank_nbytes, default=0)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class RankStats:
    """Per-rank figures for the dedicated parameters, one optimizer step.

    Attributes:
        rank: mesh rank ``replicate*N + shard``.
        owned_numel: elements this rank owns (DMuon: global owner; baseline: its padded FSDP2 shards).
        owned_nbytes: ``owned_numel`` in storage dtype bytes.
        resident_nbytes: persistent bytes between steps: parameters held (DMuon: owned masters
            plus, on HSDP, full replicas of parameters owned by ``(shard, r)`` for other ``r``;
            baseline: FSDP2 shards) + Muon momentum (owned / sharded), storage dtype.
            Gradients (live from backward to ``zero_grad``) are not included.
        peak_transient_nbytes: largest temporary parameter buffer in the broadcast dtype.
            DMuon Z3: max over boundaries of the boundary's buffer bytes minus the segment of
            this rank's shard coordinate (its owned masters, or on HSDP the replicas it holds;
            assumed aliased); Z2: the sum over boundaries (buffers stay resident from forward
            to backward). Baseline: the same for FSDP2's unsharded
            parameters (layer minus own shard; Z2: sum), or the largest all-gathered gradient in
            the naive Muon step if larger. Gradient reduce buffers and prefetch are not included.
        comm_nbytes: bytes charged to this rank per step (section 1 accounting).
        ns_flops: Newton-Schulz FLOPs this rank runs per step.
    """

    rank: int
    owned_numel: int
    owned_nbytes: int
    resident_nbytes: int
    peak_transient_nbytes: int
    comm_nbytes: int
    ns_flops: int

    FIELDS = ("owned_numel", "owned_nbytes", "resident_nbytes", "peak_transient_nbytes", "comm_nbytes", "ns_flops")


# --------------------------------------------------------------------------- DMuon


#: ``ByteCost`` field of each ledger phase a schedule charges
PHASE_FIELDS = {
    "forward_broadcast": "forward_broadcast_nbytes",
    "backward_broadcast": "backward_broadcast_nbytes",
    "reduce": "reduce_nbytes",
    "replicate_reduce": "replicate_reduce_nbytes",
    "replicate_broadcast": "replicate_broadcast_nbytes",
    "tp": "tp_nbytes",
    "owner_group": "owner_group_nbytes",
    "qk_clip": "qk_clip_nbytes",
}


def schedule_byte_cost(sched: Any) -> ByteCost:
    """:class:`ByteCost` of a :class:`~dmuon.plan.scheduling.step_schedule.StepSchedule`: every collective's
    charge (:func:`collective_rank_nbytes`) summed per phase and per schedule rank. O(ops +
    distinct groups' sizes). ``plan.cost`` is this of the nominal step.
    """
    n = sched.num_ranks
    per_group: dict[tuple[int, ...], int] = {}
    root_credit = [0] * n
    totals = dict.fromkeys(ByteCost.PHASES, 0)
    isz: dict[str, int] = {}
    for op in sched.ops:
        if not op.collective:
            continue
        size = isz.get(op.dtype)
        if size is None:
            size = isz[op.dtype] = itemsize_nbytes(op.dtype)
        k = len(op.group)
        if op.kind in ("broadcast", "reduce"):
            each = op.numel * size
            root_credit[op.root] += each
            total = (k - 1) * each
        else:
            each = collective_rank_nbytes(op.kind, op.numel, size, k, False)
            total = k * each
        per_group[op.group] = per_group.get(op.group, 0) + each
        totals[PHASE_FIELDS[op.phase]] += total
    per_rank = [-c for c in root_credit]
    for group, each in per_group.items():
        for x in group:
            per_rank[x] += each
    return ByteCost(**totals, total_nbytes=sum(totals.values()), per_rank_nbytes=tuple(per_rank))


def rank_stats(
    params: Sequence[ParamSpec],
    owners: Sequence[Owner],
    sched: Any,
    cost: ByteCost,
    *,
    mesh_shape: tuple[int, int],
    reshard_after_forward: bool,
    tp_size: int = 1,
    assembled_nbytes: dict[str, int] | None = None,
) -> tuple[RankStats, ...]:
    """Per-rank :class:`RankStats` of a DMuon plan (definitions on the record), from its nominal
    schedule ``sched``: ``comm_nbytes`` = ``cost.per_rank_nbytes``; ``ns_flops`` = the
    ``newton_schulz`` ops each rank runs; ``peak_transient_nbytes`` = the bytes a rank receives
    in one boundary's forward broadcasts (Z3: the largest boundary; Z2: all of them), plus, per
    boundary, ``assembled_nbytes[boundary]``: the full compute matrices of owner-grouped
    matrices, which every rank assembles from their blocks (broadcast dtype).

    With TP (``tp_size = T > 1``) there is one record per schedule rank
    ``(replicate*N + shard)*T + tp``: element and byte figures are that rank's shards (the
    ``T`` ranks of a mesh coordinate are identical).
    """
    R, N = mesh_shape
    world = R * N
    T = tp_size
    n = world * T
    owned_numel = [0] * world
    owned_nbytes = [0] * world
    replica_nbytes_by_shard = [0] * N  # params with owner shard s, any replicate: held by every (s, r')
    for spec, owner in zip(params, owners):
        isz = itemsize_nbytes(spec.dtype)
        if isinstance(owner, ExpertOwners):  # each member owns (and its replicas hold) a range of experts
            per_expert = spec.numel // spec.num_experts
            pieces = [(member, per_expert * size) for member, size in zip(owner.members, owner.sizes)]
        elif isinstance(owner, OwnerGroup):  # each member owns (and its replicas hold) one block
            pieces = list(zip(owner.members, member_weights(spec, owner.dim, owner.sizes, "numel", ())))
        else:
            pieces = [(owner, spec.local_numel)]
        for member, numel in pieces:
            owned_numel[member.rank] += numel
            owned_nbytes[member.rank] += numel * isz
            replica_nbytes_by_shard[member.shard] += numel * isz

    flops = [0] * n
    received: dict[tuple[str, tuple[int, ...]], int] = {}  # (boundary, group) -> bytes per member
    root_credit: dict[tuple[str, int], int] = {}
    for op in sched.ops:
        if op.kind == "newton_schulz":
            for x in op.group:
                flops[x] += op.flops
        elif op.phase == "forward_broadcast" and op.micro_batch == 0:
            nbytes = op.nbytes
            key = (op.boundary, op.group)
            received[key] = received.get(key, 0) + nbytes
            rkey = (op.boundary, op.root)
            root_credit[rkey] = root_credit.get(rkey, 0) + nbytes
    per_boundary: dict[str, list[int]] = {}
    for (boundary, group), nbytes in received.items():
        row = per_boundary.setdefault(boundary, [0] * n)
        for x in group:
            row[x] += nbytes
    for (boundary, root), nbytes in root_credit.items():
        per_boundary[boundary][root] -= nbytes
    for boundary, nbytes in (assembled_nbytes or {}).items():
        row = per_boundary.setdefault(boundary, [0] * n)
        for x in range(n):
            row[x] += nbytes
    transient = [0] * n
    for row in per_boundary.values():
        for x in range(n):
            transient[x] = max(transient[x], row[x]) if reshard_after_forward else transient[x] + row[x]

    out = []
    for g in range(n):
        rank = g // T
        s = rank % N
        params_held = replica_nbytes_by_shard[s] if R > 1 else owned_nbytes[rank]
        out.append(
            RankStats(
                rank=g,
                owned_numel=owned_numel[rank],
                owned_nbytes=owned_nbytes[rank],
                resident_nbytes=params_held + owned_nbytes[rank],
                peak_transient_nbytes=transient[g],
                comm_nbytes=cost.per_rank_nbytes[g],
                ns_flops=flops[g],
            )
        )
    return tuple(out)


# --------------------------------------------------------------------------- baseline


def baseline_byte_cost(
    params: Sequence[ParamSpec],
    *,
    mesh_shape: tuple[int, int],
    reshard_after_forward: bool,
    param_dtype: str | None,
    reduce_dtype_: str | None,
    tp_size: int = 1,
) -> BaselineByteCost:
    """:class:`BaselineByteCost`: FSDP2 (HSDP if ``R > 1``) + naive all-gather Muon, same params.

    Every rank is charged the same (the per-rank column of the module docstring table). With
    TP (``tp_size = T > 1``), FSDP2 shards each TP rank's local shard over the data-parallel
    mesh, ``R*N*T`` ranks, and a naive Muon, once it holds its TP shard's full gradient, must
    all-gather the ``T`` shards of every TP-sharded matrix to orthogonalise it:
    ``(T-1) * local_numel * isz_param`` per rank (``S*(T-1)/T`` of the matrix's ``S`` bytes,
    the all-gather charge), ``tp_all_gather_nbytes`` in total.
    """
    R, N = mesh_shape
    ag = rs = ar = mu = tg = 0  # per rank
    for spec in params:
        c = fsdp2_shard_numel(spec.local_shape, N)
        isz_p = itemsize_nbytes(spec.dtype)
        isz_b = itemsize_nbytes(bcast_dtype(spec.dtype, param_dtype))
        isz_r = itemsize_nbytes(reduce_dtype(spec.dtype, param_dtype, reduce_dtype_))
        ag += (N - 1) * c * isz_b
        rs += (N - 1) * c * isz_r
        ar += 2 * (R - 1) * (-(-c // R)) * isz_r
        mu += (N - 1) * c * isz_p
        tg += (spec.tp_size - 1) * spec.local_numel * isz_p
    world = R * N * tp_size
    bwd = ag if reshard_after_forward else 0
    per = ag + bwd + rs + ar + mu + tg
    return BaselineByteCost(
        forward_all_gather_nbytes=ag * world,
        backward_all_gather_nbytes=bwd * world,
        reduce_scatter_nbytes=rs * world,
        replicate_all_reduce_nbytes=ar * world,
        muon_all_gather_nbytes=mu * world,
        tp_all_gather_nbytes=tg * world,
        total_nbytes=per * world,
        per_rank_nbytes=(per,) * world,
    )


def baseline_rank_stats(
    params: Sequence[ParamSpec],
    boundary_of: Callable[[str], str],
    cost: BaselineByteCost,
    *,
    mesh_shape: tuple[int, int],
    reshard_after_forward: bool,
    param_dtype: str | None,
    tp_size: int = 1,
) -> tuple[RankStats, ...]:
    """Per-rank :class:`RankStats` of the baseline (identical on every rank; ``R*N*T`` ranks)."""
    R, N = mesh_shape
    shard_numel = 0
    shard_nbytes = 0
    layer_other_nbytes: dict[str, int] = {}
    max_grad_gather_nbytes = 0
    for spec in params:
        c = fsdp2_shard_numel(spec.local_shape, N)
        isz_p = itemsize_nbytes(spec.dtype)
        shard_numel += c
        shard_nbytes += c * isz_p
        b = boundary_of(spec.fqn)
        layer_other_nbytes[b] = layer_other_nbytes.get(b, 0) + (N - 1) * c * itemsize_nbytes(
            bcast_dtype(spec.dtype, param_dtype)
        )
        # the gathered gradient: the TP shard from the data-parallel ranks, then (TP) the matrix
        max_grad_gather_nbytes = max(
            max_grad_gather_nbytes, (N - 1) * c * isz_p + (spec.tp_size - 1) * spec.local_numel * isz_p
        )
    if reshard_after_forward:
        unsharded = max(layer_other_nbytes.values(), default=0)
    else:
        unsharded = sum(layer_other_nbytes.values())
    total_flops = sum(spec_ns_flops(p) for p in params)
    return tuple(
        RankStats(
            rank=rank,
            owned_numel=shard_numel,
            owned_nbytes=shard_nbytes,
            resident_nbytes=2 * shard_nbytes,
            peak_transient_nbytes=max(unsharded, max_grad_gather_nbytes),
            comm_nbytes=cost.per_rank_nbytes[rank],
            ns_flops=total_flops,
        )
        for rank in range(R * N * tp_size)
    )
