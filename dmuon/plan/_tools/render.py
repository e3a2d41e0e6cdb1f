"""The text report of a :class:`~dmuon.plan._records.plan.ShardingPlan` (``summary()``; the HTML page:
:mod:`dmuon.plan._tools.html`).

Figures are per optimizer step; "all ranks" = summed over the mesh. Means are derived here
for display only. The baseline column is FSDP2 (HSDP when R > 1) + naive all-gather Muon on
the same parameters (:mod:`dmuon.plan._cost.baseline`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from dmuon.plan._cost import rank_memory as _memory
from dmuon.plan._cost.rank_memory import rank_stats
from dmuon.plan._cost.cost_model import RankStats
from dmuon.plan._cost.nbytes import schedule_byte_cost
from dmuon.plan._records.owners import ExpertOwners, OwnerGroup, owner_ranks
from dmuon.plan._tools.render_collectives import collective_lines

if TYPE_CHECKING:
    from dmuon.plan._records.plan import ShardingPlan

__all__ = ["render_summary", "mode_name", "fmt_nbytes", "fmt_flops", "memory_gap"]


def mode_name(plan: ShardingPlan) -> str:
    z = "Z3" if plan.reshard_after_forward else "Z2"
    return f"DMuon-{z}" + (" HSDP" if plan.mesh_shape[0] > 1 else "")


def _fmt(v: float) -> str:
    if isinstance(v, int):
        return f"{v:,}"
    return f"{v:,.1f}"


def fmt_nbytes(v: float) -> str:
    """Human-readable bytes (binary prefixes): ``1536 -> '1.50 KiB'``."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(v) >= scale:
            return f"{v / scale:,.2f} {unit}"
    return f"{v:,.0f} B"


def fmt_names(names: Sequence[str], limit: int) -> str:
    """The first ``limit`` of ``names``, comma-separated, ``" ..."`` when there are more (for
    messages that name what they are about without listing hundreds)."""
    return ", ".join(names[:limit]) + (" ..." if len(names) > limit else "")


def fmt_flops(v: float) -> str:
    """Human-readable FLOPs (decimal prefixes): ``2.5e12 -> '2.50 TFLOP'``."""
    for unit, scale in (("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6)):
        if abs(v) >= scale:
            return f"{v / scale:,.2f} {unit}"
    return f"{v:,.0f} FLOP"


def setting_str(value: object) -> str:
    """A plan setting for a report (the diff's text and page): records with ``describe()``
    (QK-clip) in one line, the rest as repr."""
    describe = getattr(value, "describe", None)
    return describe() if callable(describe) else repr(value)


def _fmt_field(field: str, v: float) -> str:
    if field.endswith("_nbytes"):
        return fmt_nbytes(v)
    if field.endswith("_flops"):
        return fmt_flops(v)
    return _fmt(v)


class _Figures:
    """The derived figures a report reads, computed once (each is a pure function of the plan)."""

    def __init__(self, plan: ShardingPlan):
        self.schedule = plan.schedule()
        self.cost = schedule_byte_cost(self.schedule)
        self.stats = rank_stats(
            plan.params,
            plan.owners,
            self.schedule,
            self.cost,
            mesh_shape=plan.mesh_shape,
            reshard_after_forward=plan.reshard_after_forward,
            tp_size=plan.tp_size,
            assembled_nbytes=plan.assembled_nbytes,
        )
        self.baseline_cost = plan.baseline_cost
        self.baseline_stats = plan.baseline_rank_stats()
        self.memory = _memory.dmuon_memory(plan, self.stats)
        self.adamw_memory = _memory.fsdp2_memory(plan, "adamw")
        self.naive_memory = _memory.fsdp2_memory(plan, "naive")


def _stat_rows(fig: _Figures) -> list[tuple[str, int, float, int, int]]:
    ours = fig.stats
    base = fig.baseline_stats
    rows = []
    for field in RankStats.FIELDS:
        vals = [getattr(r, field) for r in ours]
        rows.append((field, min(vals), sum(vals) / len(vals), max(vals), max(getattr(r, field) for r in base)))
    return rows


_COST_ROWS = (
    ("forward broadcast / all-gather", "forward_broadcast_nbytes", "forward_all_gather_nbytes"),
    ("backward broadcast / all-gather", "backward_broadcast_nbytes", "backward_all_gather_nbytes"),
    ("grad reduce / reduce-scatter", "reduce_nbytes", "reduce_scatter_nbytes"),
    ("replicate reduce / all-reduce", "replicate_reduce_nbytes", "replicate_all_reduce_nbytes"),
    ("replicate broadcast", "replicate_broadcast_nbytes", None),
    ("naive Muon grad all-gather", None, "muon_all_gather_nbytes"),
    ("TP Gram all-reduce / gather", "tp_nbytes", "tp_all_gather_nbytes"),
    ("QK-clip all-reduce (max)", "qk_clip_nbytes", None),
    ("owner-group Gram all-reduce", "owner_group_nbytes", None),
    ("total", "total_nbytes", "total_nbytes"),
    ("busiest rank by bytes", "max_rank_nbytes", "max_rank_nbytes"),
)


def _cost_rows(plan: ShardingPlan, fig: _Figures) -> list[tuple[str, int | None, int | None]]:
    ours, base = fig.cost, fig.baseline_cost
    return [
        (label, getattr(ours, a) if a else None, getattr(base, b) if b else None)
        for label, a, b in _COST_ROWS
        if (a != "tp_nbytes" or plan.tp_size > 1)
        and (a != "qk_clip_nbytes" or plan.qk_clip is not None)
        and (a != "owner_group_nbytes" or ours.owner_group_nbytes > 0)
    ]


#: the memory block's rows: label, MemoryTerms attribute
_MEMORY_ROWS = (
    ("parameters", "parameters_nbytes"),
    ("gradients", "gradients_nbytes"),
    ("momentum", "momentum_nbytes"),
    ("AdamW moments", "adamw_nbytes"),
    ("transient", "transient_nbytes"),
    ("peak", "peak_nbytes"),
)


def memory_gap(top, adamw) -> str:
    """One rank's whole memory minus FSDP2 + AdamW's, by term (``MemoryTerms``), e.g.
    ``"parameters +1.2 MiB, AdamW moments -3.4 MiB, transient +2.0 GiB"``; the summary's and the
    plan page's wording."""
    return ", ".join(
        f"{label} {'+' if d >= 0 else '-'}{fmt_nbytes(abs(d))}"
        for label, field in _MEMORY_ROWS[:-1]
        if (d := getattr(top, field) - getattr(adamw, field))
    )


def memory_lines(plan: ShardingPlan, terms, adamw, naive, *, max_ranks: int = 8, offload: bool = False) -> list[str]:
    """The summary's memory block: the busiest dmuon rank's whole memory by term (Muon; per
    schedule rank ``terms``) next to the mean, FSDP2 + AdamW (``adamw``) and FSDP2 + naive Muon
    (``naive``) on the same mesh, then whether any rank peaks above FSDP2 + AdamW, and which.
    ``offload``: the terms are CPU offload's (``rank_stats(offload=True)``): the rows are the
    device's, then one row of host memory."""
    if not terms:
        return []
    busy = max(range(len(terms)), key=lambda i: (terms[i].peak_nbytes, -i))
    top = terms[busy]
    what = "CPU offload: device terms, then host" if offload else "Muon"
    lines = [
        f"memory per rank, whole model (storage dtypes, {what}; transient: parameter / reduce dtypes, phase by phase; activations not included; dmuon.plan._cost.rank_memory):",
        f"{'':<24}{f'dmuon busiest (rank {busy})':>26}{'dmuon mean':>16}{'FSDP2+AdamW':>16}{'FSDP2+naive':>16}",
    ]
    rows = _MEMORY_ROWS + ((("host", "host_nbytes"),) if offload else ())
    for label, field in rows:
        label = "device peak" if offload and label == "peak" else label
        mean = sum(getattr(t, field) for t in terms) / len(terms)
        lines.append(
            f"{label:<24}{fmt_nbytes(getattr(top, field)):>26}{fmt_nbytes(mean):>16}"
            f"{fmt_nbytes(getattr(adamw, field)):>16}{fmt_nbytes(getattr(naive, field)):>16}"
        )
    above = _memory.ranks_above(terms, adamw)
    peak = "device peak (both under offload)" if offload else "peak"
    if not above:
        lines.append(
            f"{peak}: every rank at or below FSDP2 + AdamW's ({fmt_nbytes(top.peak_nbytes)} vs "
            f"{fmt_nbytes(adamw.peak_nbytes)} on the busiest rank)"
        )
    else:
        gap = memory_gap(top, adamw)
        lines.append(
            f"{peak}: ABOVE FSDP2 + AdamW's on {len(above)} of {len(terms)} ranks "
            f"({', '.join(str(r) for r in above[:max_ranks])}{' ...' if len(above) > max_ranks else ''}): "
            f"busiest {fmt_nbytes(top.peak_nbytes)} vs {fmt_nbytes(adamw.peak_nbytes)}; gap by term: {gap}"
        )
    return lines


def _header(plan: ShardingPlan) -> list[str]:
    R, N = plan.mesh_shape
    n_mat = sum(len(p.matrices) for p in plan.params)  # view blocks count one each
    numel = sum(p.numel for p in plan.params)
    dtypes = sorted({p.dtype for p in plan.params})
    fallback = [b.fqn for b in plan.boundaries if b.fallback]
    weights = plan.owned_weight
    mean = sum(weights) / len(weights)
    T = plan.tp_size
    tp_line = []
    if T > 1:
        tp = [p for p in plan.params if p.tp_size > 1]
        gram = sum(p.tp_ns == "gram" for p in tp)
        tp_line = [
            f"tensor parallel: T={T}, world {R * N * T} ranks; {len(tp)} TP-sharded matrices: {gram} Gram NS "
            f"({len(plan.tp_segment_lengths)} all-reduces each), {len(tp) - gram} gathered; per-rank figures "
            "are per TP rank (one shard), the LPT load counts whole matrices"
        ]
    return [
        f"{mode_name(plan)} sharding plan: mesh (R={R}, N={N}) = {R * N} ranks, cost_model={plan.cost_model}, "
        f"align={plan.align_numel} elements",
        *tp_line,
        *_variant_lines(plan),
        f"wire dtypes: param={plan.param_dtype or 'storage'} reduce={plan.reduce_dtype or plan.param_dtype or 'storage'}"
        + (f"; replicate_async={plan.replicate_async}" if R > 1 else ""),
        f"model digest {plan.model_digest[:12]}  plan fingerprint {plan.fingerprint()[:12]}",
        f"dedicated: {len(plan.params):,} params ({n_mat:,} matrices), {numel:,} elements, dtypes {', '.join(dtypes) or '-'}",
        f"boundaries: {len(plan.boundaries):,} ({len(fallback)} fallback"
        + (f": {', '.join(fallback[:5])}{' ...' if len(fallback) > 5 else ''}" if fallback else "")
        + ")",
        f"LPT load ({plan.cost_model}): max {max(weights, default=0):,} <= bound {plan.balance_bound:,.0f} "
        f"({_bound_formula(plan)}); max/mean {max(weights, default=0) / mean if mean else 0:.3f}",
    ]


def _bound_formula(plan: ShardingPlan) -> str:
    """The formula :attr:`ShardingPlan.balance_bound` used: ``total/ranks + largest``, or on an
    HSDP mesh with groups / expert ranges of up to ``K`` members its ``N/(N-K+1)`` factor (a
    group stays in one replicate row; loose, up to ``N``x, when ``K`` nears ``N``), and with
    expert stacks at least the level fill's ``total/ranks + heaviest whole / N + largest``."""
    R, N = plan.mesh_shape
    K = max((o.k for o in plan.owners if isinstance(o, (OwnerGroup, ExpertOwners))), default=1)
    text = "total/ranks + largest"
    if R > 1 and K > 1:
        text = f"{N}/({N}-{K}+1) x total/ranks + largest: groups of up to K={K} stay in one replicate row"
    if R > 1 and any(spec.experts is not None and spec.ep_size == 1 for spec in plan.params):
        text = f"the larger of {text} and total/ranks + heaviest whole matrix or stack/{N} + largest"
    return text


def _variant_lines(plan: ShardingPlan, *, max_views: int = 3) -> list[str]:
    """Matrix views (per-head / split-QKV orthogonalisation) and QK-clip, when the plan has them."""
    lines = []
    viewed = [p for p in plan.params if p.view is not None]
    if viewed:
        blocks = sum(len(p.view.sizes) for p in viewed)  # type: ignore[union-attr]
        lines.append(
            f"matrix views: {len(viewed):,} params orthogonalised as {blocks:,} blocks (NS FLOPs and LPT count blocks)"
        )
        seen: dict[str, str] = {}
        for p in viewed:  # one example per distinct view description
            seen.setdefault(p.view.describe(p.shape), p.fqn)  # type: ignore[union-attr]
        for text, fqn in list(seen.items())[:max_views]:
            lines.append(f"  e.g. {fqn}: {text}")
        if len(seen) > max_views:
            lines.append(f"  ... {len(seen) - max_views} more distinct views")
    if plan.qk_clip is not None:
        lines.append(
            f"QK-clip (MuonClip): {plan.qk_clip.describe()}; one all-reduce (max) of {plan.qk_clip.num_heads} fp32 "
            "values per step over the data-parallel mesh"
        )
    return lines


def render_summary(plan: ShardingPlan, *, max_rows: int = 16, offload: bool = False) -> str:
    """Plain-text summary table (see module docstring); at most ``max_rows`` rank rows, then
    the first boundary's ops for rank 0 and for the busiest rank. ``offload``: the memory block
    under CPU offload (device terms and host memory, :func:`memory_lines`)."""
    fig = _Figures(plan)
    lines = _header(plan)
    lines.append("")
    lines.append(f"{'per rank, per step':<24}{'min':>16}{'mean':>18}{'max':>16}{'FSDP2+naive':>16}")
    for field, lo, mean, hi, base in _stat_rows(fig):
        f = lambda v: _fmt_field(field, v)  # noqa: E731
        lines.append(f"{field:<24}{f(lo):>16}{f(mean):>18}{f(hi):>16}{f(base):>16}")
    lines.append("")
    lines.append(f"{'bytes per step, all ranks':<34}{'dmuon':>20}{'FSDP2+naive':>20}")
    for label, ours, base in _cost_rows(plan, fig):
        a = fmt_nbytes(ours) if ours is not None else "-"
        b = fmt_nbytes(base) if base is not None else "-"
        lines.append(f"{label:<34}{a:>20}{b:>20}")
    base_total = fig.baseline_cost.total_nbytes
    if base_total:
        lines.append(f"{'saving vs FSDP2+naive':<34}{100.0 * (1 - fig.cost.total_nbytes / base_total):>19.1f}%")
    lines += _excluded_lines(plan)
    lines.append("")
    if offload:
        lines += memory_lines(
            plan,
            _memory.dmuon_memory(plan, fig.stats, offload=True),
            _memory.fsdp2_memory(plan, "adamw", offload=True),
            _memory.fsdp2_memory(plan, "naive", offload=True),
            offload=True,
        )
    else:
        lines += memory_lines(plan, fig.memory, fig.adamw_memory, fig.naive_memory)
    lines += [""] + expert_lines(plan) if any(p.experts is not None for p in plan.params) else []
    lines.append("")
    lines += collective_lines(plan, fig.schedule)
    lines.append("")
    lines += ownership_lines(plan, fig.cost)
    lines.append("")
    stats = sorted(fig.stats, key=lambda r: (-r.owned_numel, r.rank))
    counts = [0] * plan.world_size
    for o in plan.owners:
        for rank in owner_ranks(o):
            counts[rank] += 1
    N, T = plan.mesh_shape[1], plan.tp_size
    shown = stats[:max_rows]
    lines.append(f"ranks by owned elements ({len(shown)} of {len(stats)}):")
    lines.append(
        f"{'rank':>6}{'shard':>7}{'repl':>6}{'params':>8}{'owned elements':>18}{'comm/step':>14}{'NS/step':>16}"
    )
    for r in shown:
        m = r.rank // T  # data-parallel mesh rank
        lines.append(
            f"{r.rank:>6}{m % N:>7}{m // N:>6}{counts[m]:>8}{r.owned_numel:>18,}"
            f"{fmt_nbytes(r.comm_nbytes):>14}{fmt_flops(r.ns_flops):>16}"
        )
    lines += _schedule_lines(plan, fig)
    return "\n".join(lines)


def _ownership_figures(owned: Sequence[int]) -> tuple[int, float]:
    """``(ranks owning nothing, max/mean owned)`` of a per-rank owned-elements vector."""
    mean = sum(owned) / len(owned) if owned else 0
    return sum(1 for v in owned if v == 0), (max(owned) / mean if mean else 0.0)


def ownership_lines(plan: ShardingPlan, cost=None) -> list[str]:
    """Ownership in words: ranks owning nothing, the largest matrix's share of the busiest rank,
    and what owner groups change (for a plan without them: what ``owner_groups="auto"`` would
    do; with them: the same parameters with one owner each, ``k = 1`` forced). Pure: reruns
    the planner on the plan's own parameters (elements as the weight, as these figures are).
    ``cost``: ``plan.cost`` when the caller has it already."""
    from dmuon.plan._cost import weights as _weights
    from dmuon.plan import _rules as _rules
    from dmuon.plan._ownership.partition import lpt_partition, lpt_partition_groups

    if not plan.params:
        return []
    R, N = plan.mesh_shape
    S = R * N
    owned = plan.owned_numel
    idle, ratio = _ownership_figures(owned)
    busiest = max(range(S), key=lambda r: (owned[r], -r))
    grouped = [(p, o) for p, o in zip(plan.params, plan.owners) if isinstance(o, OwnerGroup)]
    pieces = [  # (elements, what) this busiest rank owns
        (numel, p.fqn if not isinstance(o, OwnerGroup) else f"a block of {p.fqn}")
        for p, o in zip(plan.params, plan.owners)
        for rank, numel in _weights.owner_weights(p, o, "numel", ())
        if rank == busiest
    ]
    top = max(pieces, default=(0, "-"))
    lines = [
        f"ownership: {idle:,} of {S:,} ranks own nothing; owned elements max/mean {ratio:.2f}; the busiest rank by "
        f"owned elements "
        f"({busiest}) owns {owned[busiest]:,} elements, {100.0 * top[0] / owned[busiest] if owned[busiest] else 0:.0f}% "
        f"of them in {top[1]}"
    ]
    keys = [p.fqn for p in plan.params]
    bounds = [plan.boundary(p.fqn) for p in plan.params]
    numel = [p.numel for p in plan.params]
    if grouped:
        ks = sorted(o.k for _, o in grouped)
        res = lpt_partition(numel, keys, bounds, num_shards=N, num_replicas=R)
        loads = [0] * S
        for p, slot in zip(plan.params, res.slots):
            loads[slot] += p.numel
        idle1, ratio1 = _ownership_figures(loads)
        assembled = max(plan.assembled_nbytes.values(), default=0)
        lines.append(
            f"owner groups: {len(grouped):,} matrices cut into blocks (k {ks[0]}-{ks[-1]}, median {ks[len(ks) // 2]}), "
            f"Gram NS over each group, {fmt_nbytes((cost or plan.cost).owner_group_nbytes)} of Gram all-reduces per step; "
            f"every rank assembles a boundary's grouped matrices in full while it computes (up to "
            f"{fmt_nbytes(assembled)} more transient memory); with one owner per matrix (k = 1): {idle1:,} ranks "
            f"would own nothing, max/mean {ratio1:.3f}"
        )
    elif plan.tp_size == 1 and (idle or ratio > 1.25):
        max_split = [_rules.owner_group_max_split(p, N) for p in plan.params]
        res = lpt_partition_groups(
            numel,
            lambda i, k: _weights.owner_group_piece_weights(plan.params[i], k, "numel", ()),
            max_split,
            keys,
            bounds,
            num_shards=N,
            num_replicas=R,
            split="auto",
        )
        loads = list(res.loads)
        idle_g, ratio_g = _ownership_figures(loads)
        split = sum(1 for m in res.members if len(m) > 1)
        lines.append(
            f"owner groups: compile(owner_groups='auto') would cut {split:,} matrices into blocks owned by groups "
            f"(sharded Gram NS) and leave {idle_g:,} ranks owning nothing, max/mean {ratio_g:.2f}"
        )
    return lines


def excluded_vectors(plan: ShardingPlan) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """Trainable 2-D parameters inside a hook boundary that the plan leaves to FSDP2/AdamW
    because a side is 1 (a ``(1, C)`` gate or head, a ``(C, 1)`` column: Newton-Schulz would only
    normalise a vector), read from the plan's ``fsdp2_units``: ``(fqn, shape)`` pairs."""
    out = []
    for unit in plan.fsdp2_units:
        if unit.fqn == "":
            continue  # root unit: outside every boundary, not a candidate anyway
        for fqn, shape, grad in zip(unit.params, unit.shapes, unit.requires_grad):
            if grad and len(shape) == 2 and min(shape) == 1:
                out.append((fqn, tuple(shape)))
    return tuple(out)


def expert_lines(plan: ShardingPlan) -> list[str]:
    """The experts line of a plan with expert stacks: stacks, experts, Muon matrices, layouts,
    and where they are owned (ranks owning experts, experts per owner, stacks with one owner)."""
    stacks = [(p, o) for p, o in zip(plan.params, plan.owners) if p.experts is not None]
    if not stacks:
        return []
    experts = sum(p.experts.num_experts for p, _ in stacks)
    matrices = sum(p.num_matrices for p, _ in stacks)
    numel = sum(p.numel for p, _ in stacks)
    total = sum(p.numel for p in plan.params)
    per_rank: dict[int, int] = {}
    whole = 0
    for p, o in stacks:
        if isinstance(o, ExpertOwners):
            for member, size in zip(o.members, o.sizes):
                per_rank[member.rank] = per_rank.get(member.rank, 0) + size
        else:
            whole += 1
            per_rank[o.rank] = per_rank.get(o.rank, 0) + p.experts.num_experts
    layouts = sorted({p.experts.describe(p.shape).split("[")[-1].rstrip("]") for p, _ in stacks})
    split = sum(1 for p, _ in stacks if p.experts.matrices_per_expert == 2)
    counts = sorted(per_rank.values())
    local = [(p, o) for p, o in stacks if isinstance(o, ExpertOwners) and o.local]
    grouped = [(p, o) for p, o in stacks if p.experts.ep_size > 1 and not (isinstance(o, ExpertOwners) and o.local)]
    ep_line = []
    if grouped:
        ep = max(p.experts.ep_size for p, _ in grouped)
        R, N = plan.mesh_shape
        efsdp = N // ep
        ep_line = [
            f"  expert-parallel: {len(grouped):,} stacks over ep = {ep} x efsdp = {efsdp}"
            + (f" x {R} replicas" if R > 1 else "")
            + f"; each rank's {', '.join(sorted({str(p.experts.local_experts) for p, _ in grouped}))} experts owned "
            + (f"in ranges inside its efsdp group of {efsdp} ranks" if efsdp > 1 else "on the rank (efsdp = 1)")
            + (", replicas reduced over the replicate group" if R > 1 else "")
        ]
    if local:
        ep = max(p.experts.ep_size for p, _ in local)
        held = sorted({p.experts.local_experts for p, _ in local})
        ep_line = [
            f"  expert-parallel, local: {_count(len(local), 'stack')} over ep = {_count(ep, 'rank')} (each rank owns the "
            f"{', '.join(map(str, held))} {_noun(held[-1], 'expert')} its model holds); 0 dmuon bytes per step"
        ]
    each = f"{counts[0]:,}" if counts[0] == counts[-1] else f"{counts[0]:,}-{counts[-1]:,}"
    return [
        f"experts: {_count(len(stacks), 'stack')}, {_count(experts, 'expert')}, {_count(matrices, 'Muon matrix', 'Muon matrices')}"
        + (f" ({_count(split, 'fused gate/up stack')} split into gate and up)" if split else "")
        + f", {100.0 * numel / total if total else 0:.0f}% of dedicated elements; "
        + f"{_noun(len(layouts), 'layout')} {', '.join(layouts)}",
        f"  owned by {len(per_rank):,} of {_count(plan.world_size, 'rank')}, {each} {_noun(counts[-1], 'expert')} each; "
        f"stacks with a single owner: {whole:,}",
    ] + ep_line


def _noun(n: int, singular: str, plural: str | None = None) -> str:
    """``singular`` for ``n == 1``, else ``plural`` (default: ``singular + "s"``)."""
    return singular if n == 1 else (plural or singular + "s")


def _count(n: int, singular: str, plural: str | None = None) -> str:
    """``"1 stack"``, ``"12 stacks"``, ``"12,288 experts"``: ``n`` and its noun."""
    return f"{n:,} {_noun(n, singular, plural)}"


def _excluded_lines(plan: ShardingPlan) -> list[str]:
    vectors = excluded_vectors(plan)
    if not vectors:
        return []
    shown = fmt_names([f"{fqn} {shape}" for fqn, shape in vectors], 4)
    return ["", f"left to AdamW inside hook boundaries, a side of 1 (not a matrix for Muon): {len(vectors)}: {shown}"]


def _schedule_lines(plan: ShardingPlan, fig: _Figures) -> list[str]:
    if not plan.boundaries:
        return []
    first = plan.boundaries[0].fqn
    per_rank = fig.cost.per_rank_nbytes
    busiest = max(range(len(per_rank)), key=lambda r: (per_rank[r], -r))
    lines = []
    for rank, why in (
        (0, "rank 0"),
        (busiest, f"busiest rank by bytes {busiest} ({fmt_nbytes(per_rank[busiest])}/step)"),
    ):
        if rank == 0 and why != "rank 0":
            continue
        ops = fig.schedule.rank_ops(rank)
        lines.append("")
        lines.append(
            f"step schedule, {why}: {len(ops):,} ops; boundary {first or '<root>'!r} "
            f"(python -m dmuon plan ... --schedule {rank} prints the whole step):"
        )
        lines.append(fig.schedule.summary(rank, boundary=first))
        if busiest == 0:
            break
    return lines
