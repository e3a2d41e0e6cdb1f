"""Side by side: dmuon's default collective kind against both kinds forced, with FSDP2 + AdamW.

    python benchmarks/collective_kinds.py --nproc 2 4 --repeats 5 --json kinds.json
    python benchmarks/collective_kinds.py --quick          # smoke run (N = 2, small, 2 repeats)

Models: the main job's GPT at two sizes (:data:`step_time.SIZES`): ``small`` = 4 blocks x hidden
128, ``large`` = 8 blocks x hidden 256. For every N in ``--nproc`` ONE launch (gloo on CPU, one
thread per rank; :func:`step_time.launch`) builds, per size, these variants on the same seed and
batches, and times them interleaved:

    adamw               FSDP2 + torch.optim.AdamW (the floor every figure is divided by)
    dmuon_z3            dmuon Z3 with the default, collectives="auto" (dedicate_params reads the
                        process group's backend: the gloo link record)
    dmuon_z3_bcast      Z3, every buffer's collective forced to "broadcast"
    dmuon_z3_allgather  Z3, forced to "all_gather"
    dmuon_z2, dmuon_z2_bcast, dmuon_z2_allgather   the same with reshard_after_forward=False

Timing: every variant warms up (``--warmup`` steps); then ``--repeats`` repeats, each ``--rounds``
rounds in which every variant runs ``--steps`` steps in turn (interleaved, so drift spreads over
all variants). A step = forward + backward + ``opt.step()`` + ``zero_grad()`` after a barrier, its
time the slowest rank's (:func:`step_time.run_step`). Per repeat and variant: the median step
time, divided by AdamW's median of the same repeat. Reported per variant: the median of those
ratios over the repeats and their spread (min - max), and the median ms.

Verdict per (size, N, Z2/Z3): the winner is the kind (broadcast / all_gather, the forced variants)
with the lower median ratio; the kinds *differ* when their [min, max] ranges do not overlap. The
default's kind is read from its plan (every buffer's collective). PASS when that kind is the
winner where the kinds differ, and its forced variant's median ratio is within 5 % of the
winner's otherwise. The default's own row (the same collectives, timed as a variant of its own)
shows the run's noise.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import step_time  # noqa: E402 - the benchmark's models, variants, steps and launch

VARIANTS = (
    "adamw",
    "dmuon_z3",
    "dmuon_z3_bcast",
    "dmuon_z3_allgather",
    "dmuon_z2",
    "dmuon_z2_bcast",
    "dmuon_z2_allgather",
)
#: the forced variant of each (mode, kind)
FORCED = {
    ("z3", "broadcast"): "dmuon_z3_bcast",
    ("z3", "all_gather"): "dmuon_z3_allgather",
    ("z2", "broadcast"): "dmuon_z2_bcast",
    ("z2", "all_gather"): "dmuon_z2_allgather",
}
#: the default's median ratio may trail the winner's by this much where the kinds do not differ
TOLERANCE = 0.05


def _kinds_body(mesh, device, job: dict) -> list[dict] | None:
    """Every rank of one launch: per size, build every variant, warm up, time ``repeats`` x
    ``rounds`` x ``steps`` interleaved; rank 0 returns per size and variant the step times of
    each repeat and the default plans' collective kinds."""
    import torch.distributed as dist

    rank = dist.get_rank()
    out = []
    for size in job["sizes"]:
        batches = step_time.make_batches(size, rank, dist.get_world_size(), device)
        variants = [step_time.build_variant(n, size, mesh, device, job) for n in job["variants"]]
        for v in variants:
            for _ in range(job["warmup"]):
                step_time.run_step(v, batches, device, timed=False)
        per_repeat: dict[str, list[list[float]]] = {v.name: [] for v in variants}
        for _ in range(job["repeats"]):
            mark = {v.name: len(v.records) for v in variants}
            for _ in range(job["rounds"]):
                for v in variants:
                    for _ in range(job["steps"]):
                        step_time.run_step(v, batches, device, timed=True)
            for v in variants:
                per_repeat[v.name].append([r["step"] for r in v.records[mark[v.name] :]])
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, per_repeat)
        if rank == 0:
            kinds = {
                v.name: sorted({buf.collective for b in v.plan.boundaries for buf in b.buffers})
                for v in variants
                if v.plan is not None
            }
            link = {v.name: v.plan.collectives.describe() for v in variants if v.plan is not None}
            # a step's time is the slowest rank's
            steps = {
                name: [
                    [max(e[name][r][i] for e in everyone) for i in range(len(everyone[0][name][r]))]
                    for r in range(job["repeats"])
                ]
                for name in per_repeat
            }
            out.append(dict(size=size, nproc=dist.get_world_size(), steps_s=steps, kinds=kinds, settings=link))
        del variants
    return out if rank == 0 else None


def summarise(run: dict) -> dict[str, Any]:
    """Ratios to AdamW per repeat, medians and spreads, and the verdict of each mode (module docstring)."""
    steps = run["steps_s"]
    repeats = len(steps["adamw"])
    adamw = [statistics.median(steps["adamw"][r]) for r in range(repeats)]
    rows = {}
    for name, per in steps.items():
        ratios = [statistics.median(per[r]) / adamw[r] for r in range(repeats)]
        rows[name] = dict(
            ms=1e3 * statistics.median(statistics.median(p) for p in per),
            ratio=statistics.median(ratios),
            ratio_min=min(ratios),
            ratio_max=max(ratios),
            ratios=ratios,
        )
    verdicts = {}
    for mode in ("z3", "z2"):
        default = f"dmuon_{mode}"
        if default not in rows:
            continue
        kinds = run["kinds"][default]
        kind = kinds[0] if len(kinds) == 1 else "mixed"
        b, a = rows[FORCED[(mode, "broadcast")]], rows[FORCED[(mode, "all_gather")]]
        winner = "broadcast" if b["ratio"] <= a["ratio"] else "all_gather"
        differ = b["ratio_max"] < a["ratio_min"] or a["ratio_max"] < b["ratio_min"]
        best = min(b["ratio"], a["ratio"])
        # the default's kind, measured as its forced variant (the same collectives; the default's own
        # row is the same plan timed once more)
        mine = rows[FORCED[(mode, kind)]]["ratio"] if kind in ("broadcast", "all_gather") else rows[default]["ratio"]
        ok = kind == winner if differ else mine <= best * (1 + TOLERANCE)
        verdicts[mode] = dict(
            default_kind=kind,
            winner=winner,
            kinds_differ=differ,
            passed=ok,
            default_ratio=rows[default]["ratio"],
            default_kind_ratio=mine,
            best_ratio=best,
        )
    return dict(
        size=run["size"],
        nproc=run["nproc"],
        variants=rows,
        verdicts=verdicts,
        settings=run["settings"].get("dmuon_z3", ""),
    )


def table(summaries: list[dict]) -> str:
    lines = [
        "| model | N | mode | default (its kind) | broadcast | all_gather | winner | kinds differ | verdict |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    fmt = lambda r: f"{r['ratio']:.3f} [{r['ratio_min']:.3f}-{r['ratio_max']:.3f}]"  # noqa: E731
    for s in summaries:
        label = {"small": "4 blocks x 128", "large": "8 blocks x 256"}.get(s["size"], s["size"])
        for mode, v in s["verdicts"].items():
            rows = s["variants"]
            lines.append(
                f"| {label} | {s['nproc']} | {mode.upper()} | {fmt(rows[f'dmuon_{mode}'])} ({v['default_kind']}) | "
                f"{fmt(rows[FORCED[(mode, 'broadcast')]])} | {fmt(rows[FORCED[(mode, 'all_gather')]])} | "
                f"{v['winner']} | {'yes' if v['kinds_differ'] else 'no'} | {'PASS' if v['passed'] else 'FAIL'} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--nproc", type=int, nargs="+", default=[2, 4], help="world sizes, one launch each")
    p.add_argument("--sizes", nargs="+", choices=("small", "large"), default=["small", "large"])
    p.add_argument("--repeats", type=int, default=5, help="repeats of the interleaved rounds (>= 5 for the table)")
    p.add_argument("--rounds", type=int, default=2, help="interleaved rounds per repeat")
    p.add_argument("--steps", type=int, default=2, help="steps per variant and round")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per variant first")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per launch")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--quick", action="store_true", help="smoke run: N = 2, small, 2 repeats of 1 round x 1 step")
    args = p.parse_args(argv)
    if args.quick:
        args.nproc, args.sizes, args.repeats, args.rounds, args.steps, args.warmup = [2], ["small"], 2, 1, 1, 1
    job = dict(
        sizes=args.sizes,
        variants=list(VARIANTS),
        repeats=args.repeats,
        rounds=args.rounds,
        steps=args.steps,
        warmup=args.warmup,
        cost_model="numel",
        ns_dtype="auto",
        device="cpu",
        threads=1,
        memory=False,
        body=_kinds_body,
    )
    summaries = []
    t0 = time.time()
    for n in args.nproc:
        for run in step_time.launch(n, job, args.timeout):
            summaries.append(summarise(run))
        print(f"N={n} done ({time.time() - t0:.0f} s)", file=sys.stderr, flush=True)
    print(table(summaries))
    if summaries:
        print(f"default plan's settings: {summaries[0]['settings']}")
    passed = all(v["passed"] for s in summaries for v in s["verdicts"].values())
    print("PASS" if passed else "FAIL")
    if args.json:
        Path(args.json).write_text(json.dumps(dict(summaries=summaries, passed=passed, args=vars(args)), indent=1))
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
