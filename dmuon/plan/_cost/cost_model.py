r"""The cost records: :class:`ByteCost` (DMuon bytes per step), :class:`BaselineByteCost` (FSDP2
+ naive Muon) and :class:`RankStats` (per-rank figures), and what their fields count.

Units are in the names (``_numel``, ``_nbytes``, ``_flops``); all figures are per optimizer step.
What each phase's bytes count: Note: the byte cost records (docs/design.md).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from dmuon.plan._records.fields import _check_int

__all__ = [
    "MemoryTerms",
    "ByteCost",
    "BaselineByteCost",
    "RankStats",
]


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ByteCost:
    """DMuon bytes per step, summed over all mesh ranks (Note: the byte cost records, docs/design.md).

    ``total_nbytes`` is the sum of the phase fields; ``per_rank_nbytes[rank]`` sums to
    ``total_nbytes``. Without TP it has ``R*N`` entries (mesh rank ``replicate*N + shard``);
    with a TP degree ``T > 1`` it has ``R*N*T``, indexed ``(replicate*N + shard)*T + tp`` (the
    layout of ``init_device_mesh(device, (R, N, T))`` / ``(N, T)``), every data-parallel phase
    counted once per TP coordinate (each moves its own shards), and ``tp_nbytes`` is the
    owner TP groups' Gram all-reduces and all-gathers (:func:`tp_rank_nbytes`).
    ``qk_clip_nbytes``: QK-clip's all-reduce (max) of the per-head max logits, ``ΣH`` fp32
    values over the data-parallel mesh (:mod:`dmuon.plan._records.qk_clip_records`); 0 without QK-clip.
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
        d: dict[str, Any] = {
            n: getattr(self, n) for n in self.PHASES + ("total_nbytes",) if n not in optional or getattr(self, n)
        }
        d["per_rank_nbytes"] = list(self.per_rank_nbytes)
        return d


# ``PHASES`` must not become a dataclass field: it is a plain class attribute (no annotation).


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class BaselineByteCost:
    """FSDP2 + naive all-gather Muon bytes per step for the dedicated parameters (Note: the FSDP2 + naive
    Muon baseline, docs/design.md)."""

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
class MemoryTerms:
    """One rank's memory for the whole model, by term, in bytes (storage dtypes; activations
    are the workload's and not counted here). Formulas: :mod:`dmuon.plan._cost.rank_memory`.

    Attributes:
        parameters_nbytes: parameters held between steps: dmuon's owned masters (+ on HSDP the
            replicas of parameters owned in other replicate rows) and FSDP2's shards of every
            other parameter; an FSDP2 baseline: its shards of every parameter.
        gradients_nbytes: gradients live from the backward to ``zero_grad``: the full gradient
            of every owned matrix and FSDP2's gradient shards (baselines: shards).
        momentum_nbytes: Muon's momentum of the matrices this rank updates (dmuon: owned;
            naive Muon: its shards; FSDP2 + AdamW: 0).
        second_moment_nbytes: NorMuon's second moment, fp32, one value per output row of each
            owned Muon matrix (``variant="normuon"``; 0 for Muon).
        adamw_nbytes: AdamW's two moments of the parameters AdamW updates (FSDP2 shards; the
            FSDP2 + AdamW baseline: of every parameter).
        transient_nbytes: the most held at once beyond the above over one step, phase by
            phase (:func:`~dmuon.plan._cost.rank_memory.step_transient_nbytes`; unsharded
            parameters and their gradients in the parameter dtype, reduce buffers in the reduce
            dtype): FSDP2's root unit unsharded from the forward on with its gradients through
            the backward; per hook boundary / FSDP2 unit, its parameters unsharded while it
            computes (dmuon: the received copies, the compute tensors assembled from pieces and
            FSDP2's unit of the rest), the next unit prefetched, its gradients and its reduce
            buffers beside the previous unit's in flight (HSDP: with the held ones of every
            boundary reduced before); naive Muon: or every gathered update, if more.
        host_parameters_nbytes, host_gradients_nbytes, host_momentum_nbytes, host_adamw_nbytes:
            what CPU offload keeps in host memory (``offload=True`` of ``plan.rank_stats`` /
            ``plan.adamw_rank_stats``; 0 without it). With offload the six fields above are the
            compute device's bytes, so :attr:`peak_nbytes` is the device peak, and these four are
            the host's (:attr:`host_nbytes`); formulas:
            :func:`~dmuon.plan._cost.rank_memory.dmuon_offload_memory`,
            :func:`~dmuon.plan._cost.rank_memory.fsdp2_offload_memory`.
    """

    parameters_nbytes: int
    gradients_nbytes: int
    momentum_nbytes: int
    second_moment_nbytes: int
    adamw_nbytes: int
    transient_nbytes: int
    host_parameters_nbytes: int = 0
    host_gradients_nbytes: int = 0
    host_momentum_nbytes: int = 0
    host_adamw_nbytes: int = 0

    TERMS = (
        "parameters_nbytes",
        "gradients_nbytes",
        "momentum_nbytes",
        "second_moment_nbytes",
        "adamw_nbytes",
        "transient_nbytes",
    )
    #: the host terms of CPU offload (0 without it)
    HOST_TERMS = ("host_parameters_nbytes", "host_gradients_nbytes", "host_momentum_nbytes", "host_adamw_nbytes")

    @property
    def optimizer_state_nbytes(self) -> int:
        """Momentum + second moment + AdamW's moments."""
        return self.momentum_nbytes + self.second_moment_nbytes + self.adamw_nbytes

    @property
    def peak_nbytes(self) -> int:
        """Parameters + gradients + optimizer state + transient."""
        return self.parameters_nbytes + self.gradients_nbytes + self.optimizer_state_nbytes + self.transient_nbytes

    @property
    def host_nbytes(self) -> int:
        """Host memory under CPU offload: parameters + gradients + momentum + AdamW's moments
        held there (0 without offload); not in :attr:`peak_nbytes`, the device's."""
        return sum(getattr(self, name) for name in self.HOST_TERMS)


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
            assumed aliased), or for an all-gathered buffer its whole gathered tensor (``k``
            slots, padding included); Z2: the sum over boundaries (buffers stay resident from
            forward to backward); plus the compute tensors assembled from owner-group blocks
            and expert ranges. Baseline: the same for FSDP2's unsharded
            parameters (layer minus own shard; Z2: sum), or the largest all-gathered gradient in
            the naive Muon step if larger. Gradient reduce buffers and prefetch are not included.
        comm_nbytes: bytes charged to this rank per step (section 1 accounting).
        ns_flops: Newton-Schulz FLOPs this rank runs per step.
        memory: the rank's whole memory by term (:class:`MemoryTerms`: every parameter,
            gradient and optimizer state, not only the dedicated ones); None where a caller
            built the record without it.
    """

    rank: int
    owned_numel: int
    owned_nbytes: int
    resident_nbytes: int
    peak_transient_nbytes: int
    comm_nbytes: int
    ns_flops: int
    memory: MemoryTerms | None = None

    FIELDS = ("owned_numel", "owned_nbytes", "resident_nbytes", "peak_transient_nbytes", "comm_nbytes", "ns_flops")
