"""The collectives block of ``plan.summary()``: per class of buffers its kind, group, segments,
padding, collectives per step and why (:func:`collective_lines`), and the collectives each rank
issues per step by kind (:func:`rank_collective_counts`).
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Any

from dmuon.plan._layout.buffer_layout import slot_numel_of
from dmuon.plan._layout.collective_rule import choose_collective, padding_fraction, places_expert_ranges
from dmuon.plan._records.fields import itemsize_nbytes

if TYPE_CHECKING:
    from dmuon.plan._records.plan import ShardingPlan

__all__ = ["collective_lines", "rank_collective_counts", "buffer_choices"]

#: the ledger phases of dmuon's own buffer collectives (shard and replicate phases)
_BUFFER_PHASES = ("forward_broadcast", "backward_broadcast", "reduce", "replicate_reduce", "replicate_broadcast")


def buffer_choices(plan: ShardingPlan) -> list[tuple[Any, Any, Any]]:
    """``(boundary, buffer, CollectiveChoice)`` of every buffer: the modelled seconds of both
    kinds for its layout under the plan's settings and the reason for its kind (recomputed:
    pure)."""
    N = plan.mesh_shape[1]
    out = []
    for b in plan.boundaries:
        for buf in b.buffers:
            choice = choose_collective(
                buf,
                plan.collectives,
                num_shards=N,
                align_numel=plan.align_numel,
                wire_itemsize=itemsize_nbytes(plan.bcast_dtype(buf.dtype)),
                reduce_itemsize=itemsize_nbytes(plan.reduce_dtype_for(buf.dtype)),
                reshard_after_forward=plan.reshard_after_forward,
            )
            out.append((b, buf, choice))
    return out


def equal_slots_trade(plan: ShardingPlan, buf: Any) -> str:
    """The trade a broadcast buffer holding expert stacks made, in words: the padding of equal
    slots with its experts re-placed (water-fill, :func:`~dmuon.plan._layout.slots.water_filled_buffer`)
    and that all-gather's modelled seconds per step."""
    from dmuon.plan._layout.slots import water_filled_buffer

    N = plan.mesh_shape[1]
    alt = water_filled_buffer(buf, plan.params, plan.owners, N, plan.align_numel)
    slot = slot_numel_of(alt, plan.align_numel)
    choice = choose_collective(
        alt,
        plan.collectives,
        num_shards=N,
        align_numel=plan.align_numel,
        wire_itemsize=itemsize_nbytes(plan.bcast_dtype(buf.dtype)),
        reduce_itemsize=itemsize_nbytes(plan.reduce_dtype_for(buf.dtype)),
        reshard_after_forward=plan.reshard_after_forward,
    )
    return (
        f"equal slots with its experts re-placed would pad {100 * padding_fraction(alt, N, slot):.1f} % "
        f"(all-gather modelled {choice.all_gather_s * 1e3:.3f} ms/step)"
    )


def rank_collective_counts(sched: Any, rank: int = 0) -> Counter:
    """dmuon's buffer collectives schedule rank ``rank`` takes part in per step, by kind."""
    return Counter(op.kind for op in sched.rank_ops(rank) if op.collective and op.phase in _BUFFER_PHASES)


def collective_lines(plan: ShardingPlan, sched: Any, *, max_rows: int = 8) -> list[str]:
    """The summary's collectives block (module docstring): a settings line, the collectives of
    rank 0 per step, then one line per class of buffers (same key, kind, group size, segments,
    padding and reason), the largest classes first."""
    s = plan.collectives
    N = plan.mesh_shape[1]
    phases = 3 if plan.reshard_after_forward else 2
    counts = rank_collective_counts(sched)
    gathered = [buf for b in plan.boundaries for buf in b.buffers if buf.collective == "all_gather"]
    pad = sum(buf.padding_numel(N) for buf in gathered)
    moved = sum(buf.numel for buf in gathered)
    n_bufs = sum(len(b.buffers) for b in plan.boundaries)
    lines = [
        f"collectives: {s.mode!r} (auto rule: {s.rule_numbers()}); gradients: reduce with broadcast, "
        f"reduce_scatter with all_gather; "
        f"{len(gathered):,} of {n_bufs:,} buffers all-gathered (one collective per phase), "
        f"{n_bufs - len(gathered):,} broadcast (one collective per segment and phase)"
        + (f", the all-gathered ones padding {100.0 * pad / moved:.1f} % of their elements" if moved else ""),
        f"  the rule's numbers: {s.link_source()}"
        + ("; dmuon.plan.compile without collective_backend assumes NCCL" if s.link == "nccl" else ""),
        "  per rank per step (rank 0): " + (", ".join(f"{n:,} {k}" for k, n in sorted(counts.items())) or "none"),
    ]
    classes: dict[tuple, list] = {}
    for b, buf, choice in buffer_choices(plan):
        k = choice.group_size
        segs = max(Counter(seg.shard % buf.ep for seg in buf.segments).values())  # segments of one group
        padding = 100.0 * buf.padding_numel(N) / buf.numel if buf.collective == "all_gather" else 0.0
        reason = choice.reason
        if buf.collective == "broadcast" and k >= 2 and places_expert_ranges(buf):
            reason += "; " + equal_slots_trade(plan, buf)
        key = (buf.key, buf.collective, k, segs, round(padding, 1), reason)
        entry = classes.setdefault(key, [0, b.fqn, 0.0, 0.0])
        entry[0] += 1
        entry[2] += choice.broadcast_s
        entry[3] += choice.all_gather_s
    rows = sorted(classes.items(), key=lambda kv: (-kv[1][0], kv[1][1]))
    for (bkey, kind, k, segs, padding, reason), (n, example, t_b, t_a) in rows[:max_rows]:
        if k < 2:
            lines.append(f"  {n:,} x {bkey} (e.g. {example}): one rank per group, nothing moves")
            continue
        calls = phases if kind == "all_gather" else phases * segs
        other = phases * segs if kind == "all_gather" else phases
        mine, alt = (t_a, t_b) if kind == "all_gather" else (t_b, t_a)
        per_segment = f"{segs} segment(s) x {phases} phases"
        if kind == "all_gather":
            how = f"one per phase; {other} if broadcast: {per_segment}"
        else:
            how = f"{per_segment}; {other} if all-gathered: one per phase"
        lines.append(
            f"  {n:,} x {bkey} (e.g. {example}) over {k} ranks: {kind}, {segs} segment(s), padding {padding:.1f} %, "
            f"{calls} collectives/step per buffer ({how}); "
            f"{reason}: modelled {mine / n * 1e3:.3f} vs {alt / n * 1e3:.3f} ms/step each"
        )
    if len(rows) > max_rows:
        lines.append(f"  ... {len(rows) - max_rows} more classes")
    return lines
