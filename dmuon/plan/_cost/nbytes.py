r"""Bytes on the wire: the ledger's rule per collective, FSDP2's padded shard sizes, and the
:class:`~dmuon.plan._cost.cost_model.ByteCost` of a schedule, summed from its ops.

Byte accounting (:func:`collective_rank_nbytes`, the ledger's rule): for one collective over a group of ``k`` ranks and a
payload of ``S`` bytes, every non-root rank is charged ``S`` (it receives ``S`` in a broadcast,
sends ``S`` in a reduce), so the collective totals ``(k-1)*S``. An all-gather or
reduce-scatter of a full tensor of ``S`` bytes is charged ``S*(k-1)/k`` per rank (``(k-1)*S``
in total; here ``S`` includes FSDP2's dim-0 padding, so per-rank figures are exact integers).
Totals are summed over all mesh ranks; ``per_rank_nbytes`` is indexed by mesh rank
``replicate*N + shard`` and sums to the total. Averages are derived, never stored.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from dmuon.plan._cost.cost_model import ByteCost
from dmuon.plan._records.fields import itemsize_nbytes

__all__ = [
    "broadcast_nbytes",
    "reduce_nbytes",
    "all_gather_nbytes",
    "reduce_scatter_nbytes",
    "all_reduce_nbytes",
    "all_reduce_rank_nbytes",
    "collective_rank_nbytes",
    "fsdp2_shard_numel",
    "PHASE_FIELDS",
    "schedule_byte_cost",
]


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
      the other ranks' parts);
    * ``"reduce_scatter"`` to ``numel`` elements per rank: ``(k-1) * S`` to every rank (it sends
      the other ranks' parts). Over a full tensor of ``k * S`` bytes both are ``(k-1)/k`` of it
      per rank, ``(k-1) * k * S`` in total.

    Raises:
        ValueError: unknown ``kind``.
    """
    if kind in ("broadcast", "reduce", "scatter"):
        return 0 if is_root else numel * itemsize
    if kind == "all_reduce":
        return all_reduce_rank_nbytes(numel, itemsize, group_size)
    if kind in ("all_gather", "reduce_scatter"):
        return (group_size - 1) * numel * itemsize
    raise ValueError(f"unknown collective kind {kind!r}")


def fsdp2_shard_numel(shape: Sequence[int], num_shards: int, *, expert_stack: bool = False) -> int:
    """Elements of one FSDP2 shard of a tensor of ``shape`` over ``num_shards`` ranks, padding
    included.

    * Everything but an expert stack: ``Shard(0)``, ``ceil(shape[0] / N) * prod(shape[1:])``
      (FSDP2 chunks dim 0 and pads every chunk).
    * An expert stack (``expert_stack=True``, a 3-D ``(E_local, a, b)`` of the experts one rank
      holds: all ``E`` without expert parallelism, ``E/ep`` with it; ``num_shards`` = its FSDP
      group, ``efsdp = N/ep``): torchtitan's placement (``torchtitan/distributed/fsdp.py``,
      ``apply_fsdp_to_decoder``: ``Shard(1)`` when ``efsdp * ep > num_experts``, else
      ``Shard(0)``). Since ``E_local = E/ep`` that is ``Shard(1)``, ``ceil(a / efsdp) * E_local * b``,
      when ``efsdp > E_local``, else ``Shard(0)`` as above — so a stack of 128 experts on 256
      ranks is not padded to 2x with empty chunks.
    """
    if not shape:
        return 1
    if expert_stack and len(shape) == 3 and num_shards > shape[0]:
        return -(-shape[1] // num_shards) * shape[0] * shape[2]
    return -(-shape[0] // num_shards) * math.prod(shape[1:])


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
    """:class:`ByteCost` of a :class:`~dmuon.plan._scheduling.step_schedule.StepSchedule`: every collective's
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
