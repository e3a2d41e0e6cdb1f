"""Each buffer's collective on the presets (docs/planning.md, "Collectives per buffer").

    python benchmarks/collective_plans.py [--collectives auto|broadcast|all_gather] [--json]

For each preset and mesh (meta device, no GPU, no process group; bf16 wire, fp32 reduce, Z3, cost
model numel), the plan of ``compile(collectives=...)``: dmuon's buffer collectives rank 0 takes part
in per step by kind (``plan.schedule().rank_ops(0)``, shard and replicate phases), the all-gathered
buffers and their padding (``N * slot - numel`` over their elements), the most segments of a buffer,
dmuon's bytes per step over all ranks (``plan.cost.total_nbytes``), the busiest rank's peak
transient buffer (``plan.rank_stats()``) and the bytes of compute tensors assembled per boundary
(``plan.assembled_nbytes``, the largest), and the compile time. The "before" columns of the docs'
table are this script's output before per-buffer collectives (every buffer broadcast, ``min(E, N)``
expert ranges; run it there without ``--collectives``).

    python benchmarks/collective_plans.py --simulate [--rows qwen3-30b-a3b/64/1 ...] [--json]

checks the per-buffer collective rows in the simulator (benchmarks/results/2026-12-06-collectives-per-buffer.md):
Qwen3-30B-A3B and DeepSeek-V3 on 64 and 256 ranks with EP 1, 8 and N (Qwen3-30B-A3B: 128 on 256
ranks), Llama-3-8B on 8 and 16 x 8, Llama-3-405B on 1,024 with owner groups ``"auto"``; each row
compiled as ``python -m dmuon simulate`` compiles it (Z3, bf16 wire, fp32 reduce, cost model
ns_flops), the h100 preset, 8,192 tokens per rank. Per row: (1) every buffer's kind against the
other on the same layout, priced by the simulator (:func:`dmuon.sim._engine.kinds.buffer_kind_costs`)
with NCCL coalescing (the preset) and without (``coalesces=False``): ``slower`` = buffers whose
chosen kind is modelled slower than the other, ``worst`` = the largest chosen / other ratio;
(2) the whole Z3 step of the default plan and of the plans compiled with ``collectives=
"broadcast"`` and ``"all_gather"`` (their own placement: water-filled slots where all-gathers
pay), coalescing on; (3) the most collectives one rank issues per step for one all-gathered
buffer's shard phases (at most 3 in Z3). Exit status 1 if (1) finds a buffer slower than its
other kind.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import dmuon.plan as P  # noqa: E402
from dmuon.plan._model.parallel import expert_parallel_variant  # noqa: E402
from dmuon._zoo import PRESETS  # noqa: E402

CASES = [  # (preset, ranks, ep)
    ("tiny-llama", 2, 1),
    ("tiny-llama", 4, 1),
    ("tiny-moe", 2, 1),
    ("tiny-moe", 4, 1),
    ("llama3-8b", 8, 1),
    ("qwen3-30b-a3b", 64, 1),
    ("qwen3-30b-a3b", 256, 1),
    ("deepseek-v3", 64, 1),
    ("deepseek-v3", 256, 1),
    ("qwen3-30b-a3b", 64, 8),
    ("deepseek-v3", 256, 8),
]
PHASES = ("forward_broadcast", "backward_broadcast", "reduce", "replicate_reduce", "replicate_broadcast")
#: the per-buffer collective rows, simulated: (preset, mesh, ep, owner_groups)
SIM_ROWS = [
    *[("qwen3-30b-a3b", n, ep, "off") for n, eps in ((64, (1, 8, 64)), (256, (1, 8, 128))) for ep in eps],
    *[("deepseek-v3", n, ep, "off") for n in (64, 256) for ep in (1, 8, n)],
    ("llama3-8b", 8, 1, "off"),
    ("llama3-8b", (16, 8), 1, "off"),
    ("llama3-405b", 1024, 1, "auto"),
]
SHARD_PHASES = ("forward_broadcast", "backward_broadcast", "reduce")


def row(name: str, ranks: int, ep: int, collectives: str) -> dict:
    model = PRESETS[name]()
    kw: dict = dict(
        mp_policy=SimpleNamespace(param_dtype="torch.bfloat16", reduce_dtype="torch.float32"), collectives=collectives
    )
    if ep > 1:
        model = expert_parallel_variant(model, ep)
        kw["ep"] = ep
    t = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = P.compile(model, ranks, **kw)
    seconds = time.perf_counter() - t
    counts = Counter(op.kind for op in plan.schedule().rank_ops(0) if op.collective and op.phase in PHASES)
    bufs = [buf for b in plan.boundaries for buf in b.buffers]
    gathered = [buf for buf in bufs if buf.collective == "all_gather"]
    N = plan.mesh_shape[1]
    moved = sum(buf.numel for buf in gathered)
    return dict(
        model=name,
        ranks=ranks,
        ep=ep,
        collectives=dict(sorted(counts.items())),
        all_gathered=f"{len(gathered)} / {len(bufs)}",
        padding_pct=round(100 * sum(buf.padding_numel(N) for buf in gathered) / moved, 1) if moved else None,
        max_segments=max(len(buf.segments) for buf in bufs),
        total_nbytes=plan.cost.total_nbytes,
        peak_transient_nbytes=max(s.peak_transient_nbytes for s in plan.rank_stats()),
        assembled_nbytes=max(plan.assembled_nbytes.values(), default=0),
        compile_s=round(seconds, 1),
    )


def sim_row(name: str, mesh, ep: int, owner_groups: str, tokens: int = 8192) -> dict:
    """The checks of one simulated row (module docstring, ``--simulate``)."""
    import dataclasses

    import dmuon.sim as S
    from dmuon.sim._engine.hardware import preset
    from dmuon.sim._engine.kinds import buffer_kind_costs
    from dmuon.sim._engine.workload import model_top_k

    model = PRESETS[name]()
    top_k = model_top_k(model)
    kw: dict = dict(
        mp_policy=SimpleNamespace(param_dtype="bfloat16", reduce_dtype="float32"),
        cost_model="ns_flops",
        owner_groups=owner_groups,
        reshard_after_forward=True,
    )
    if ep > 1:
        model = expert_parallel_variant(model, ep)
        kw["ep"] = ep
    t = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plans = {mode: P.compile(model, mesh, collectives=mode, **kw) for mode in ("auto", "broadcast", "all_gather")}
    plan = plans["auto"]
    hw = preset("h100")
    out: dict = dict(model=name, mesh=mesh if isinstance(mesh, int) else list(mesh), ep=ep, owner_groups=owner_groups)
    for label, h in (("coalesced", hw), ("uncoalesced", dataclasses.replace(hw, coalesces=False))):
        costs = buffer_kind_costs(plan, h)
        slower = [c for c in costs if c.chosen_s > c.other_s]
        worst = max(costs, key=lambda c: c.chosen_s / c.other_s)
        out[label] = dict(
            buffers=len(costs),
            all_gather=sum(c.chosen == "all_gather" for c in costs),
            slower=len(slower),
            worst_ratio=worst.chosen_s / worst.other_s,
            worst=f"{worst.boundary} {worst.buffer} {worst.chosen}",
            chosen_ms=1e3 * sum(c.chosen_s for c in costs),
            other_ms=1e3 * sum(c.other_s for c in costs),
        )
    per_buffer: Counter = Counter()
    gathered = {(b.fqn, buf.key) for b in plan.boundaries for buf in b.buffers if buf.collective == "all_gather"}
    sched = plan.schedule()
    for r in range(plan.world_size):
        if r and plan.mesh_shape[0] == 1 and ep == 1:
            break  # a 1-D mesh without EP: every rank issues the same ops
        for op in sched.rank_ops(r):
            if op.collective and op.phase in SHARD_PHASES and (op.boundary, op.buffer) in gathered:
                per_buffer[(r, op.boundary, op.buffer)] += 1
    out["all_gather_buffer_calls_max"] = max(per_buffer.values(), default=0)
    wl = S.from_plan(
        plan, tokens_per_rank=tokens, seq_len=min(tokens, 8192), activation_dtype="torch.bfloat16", top_k=top_k
    )
    out["z3_ms"] = {
        mode: 1e3 * S.simulate(p, hw, wl, variant="z3", timeline_ranks=()).step_s for mode, p in plans.items()
    }
    out["padding_pct"] = {
        mode: round(
            100
            * sum(buf.padding_numel(p.mesh_shape[1]) for b in p.boundaries for buf in b.buffers)
            / sum(buf.numel for b in p.boundaries for buf in b.buffers),
            2,
        )
        for mode, p in plans.items()
    }
    out["wall_s"] = round(time.perf_counter() - t, 1)
    return out


def simulate_main(args) -> int:
    rows = [
        r
        for r in SIM_ROWS
        if not args.rows
        or f"{r[0]}/{'x'.join(map(str, r[1])) if isinstance(r[1], tuple) else r[1]}/{r[2]}" in args.rows
    ]
    failed = 0
    for name, mesh, ep, og in rows:
        r = sim_row(name, mesh, ep, og)
        failed += r["coalesced"]["slower"] + r["uncoalesced"]["slower"]
        if args.json:
            print(json.dumps(r), flush=True)
            continue
        z = r["z3_ms"]
        c, u = r["coalesced"], r["uncoalesced"]
        print(
            f"{name:<14}{r['mesh']!s:>8} ep {ep:<4}buffers {c['buffers']:>4} (all_gather {c['all_gather']:>3}) "
            f"slower: {c['slower']} coalesced (worst {c['worst_ratio']:.3f}), {u['slower']} uncoalesced "
            f"(worst {u['worst_ratio']:.3f}); AG calls/buffer <= {r['all_gather_buffer_calls_max']}; Z3 ms auto "
            f"{z['auto']:,.0f} broadcast {z['broadcast']:,.0f} all_gather {z['all_gather']:,.0f} "
            f"(padding {r['padding_pct']['all_gather']} %) [{r['wall_s']} s]",
            flush=True,
        )
    print(
        f"{'PASS' if not failed else 'FAIL'}: {failed} buffers whose chosen kind is modelled slower than the other",
        flush=True,
    )
    return 1 if failed else 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--collectives", default="auto", choices=("auto", "broadcast", "all_gather"))
    ap.add_argument("--json", action="store_true", help="one JSON object per line")
    ap.add_argument(
        "--simulate", action="store_true", help="the per-buffer collective rows, simulated (module docstring)"
    )
    ap.add_argument(
        "--rows",
        nargs="*",
        default=[],
        metavar="MODEL/MESH/EP",
        help="with --simulate: only these rows, e.g. qwen3-30b-a3b/64/8 llama3-8b/16x8/1",
    )
    args = ap.parse_args()
    if args.simulate:
        sys.exit(simulate_main(args))
    for name, ranks, ep in CASES:
        r = row(name, ranks, ep, args.collectives)
        if args.json:
            print(json.dumps(r), flush=True)
            continue
        print(
            f"{name:<15}{ranks:>5} ep {ep:<3} {r['collectives']!s:<64} all-gathered {r['all_gathered']:<8} "
            f"padding {r['padding_pct']!s:>5} % max segments {r['max_segments']:>4} "
            f"bytes {r['total_nbytes'] / 1e12:>10.3f} TB peak transient {r['peak_transient_nbytes'] / 2**30:>8.3f} GiB "
            f"(assembled {r['assembled_nbytes'] / 2**30:.3f}) {r['compile_s']} s",
            flush=True,
        )


if __name__ == "__main__":
    main()
