"""Time dmuon.plan.compile on large meta-device presets (CPU only, no GPU, no process group).

    python benchmarks/plan_compile.py [--repeats 3]

Reports, per case, the best wall time of ``compile`` (snapshot + selection + boundaries + LPT +
layout + validation + the deadlock replay of the nominal step) and of the derived figures
(``plan.cost``, ``rank_stats()``), in seconds; then, for the step schedule, the time to build
the whole schedule, one rank's op list (``rank_ops``), and the deadlock replay (``check``).
Targets: Llama-70B shape (80 layers x 7 matrices) on 1024 ranks in < 2 s total; Llama-3-405B on
1024 and on (8, 128) ranks: one rank's op list < 2 s, the whole schedule and its check < 10 s.
Model construction on the meta device is timed separately and not included.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import dmuon.plan as P  # noqa: E402
from dmuon.sim import zoo  # noqa: E402

CASES = [
    ("llama3-70b", 1024, "numel"),
    ("llama3-70b", (8, 128), "numel"),
    ("llama3-70b", 1024, "ns_flops"),
    ("llama3-405b", 1024, "numel"),
    ("llama3-8b", 8, "numel"),
]
SCHEDULE_CASES = [("llama3-405b", 1024), ("llama3-405b", (8, 128))]


def _best(fn, repeats: int) -> tuple[float, object]:
    best, out = float("inf"), None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    models: dict[str, object] = {}
    print(
        f"{'preset':<14}{'mesh':>10}{'cost model':>11}{'build s':>9}{'compile s':>11}{'cost+stats s':>14}{'total s':>9}  params"
    )
    for name, mesh, cost_model in CASES:
        t_build = 0.0
        if name not in models:
            t0 = time.perf_counter()
            models[name] = zoo.PRESETS[name]()
            t_build = time.perf_counter() - t0
        model = models[name]
        t_compile, plan = _best(lambda: P.compile(model, mesh, cost_model=cost_model), args.repeats)

        def derived():
            return plan.cost, plan.rank_stats(), plan.baseline_rank_stats()

        t_derived, _ = _best(derived, args.repeats)
        mesh_s = "x".join(map(str, mesh)) if isinstance(mesh, tuple) else str(mesh)
        print(
            f"{name:<14}{mesh_s:>10}{cost_model:>11}{t_build:>9.3f}{t_compile:>11.3f}{t_derived:>14.3f}"
            f"{t_compile + t_derived:>9.3f}  {len(plan.params)}"
        )
    print()
    print(
        f"{'preset':<14}{'mesh':>10}{'mode':>6}{'ops':>9}{'schedule s':>12}{'rank_ops s':>12}{'check s':>9}{'sched+check s':>15}"
    )
    for name, mesh in SCHEDULE_CASES:
        model = models.get(name) or models.setdefault(name, zoo.PRESETS[name]())
        for z3 in (True, False):
            plan = P.compile(model, mesh, reshard_after_forward=z3)
            t_sched, sched = _best(plan.schedule, args.repeats)
            per_rank = plan.cost.per_rank_nbytes  # derived on each access: bind once
            busiest = max(range(sched.num_ranks), key=per_rank.__getitem__)
            t_rank, _ = _best(lambda: sched.rank_ops(busiest), args.repeats)
            t_check, _ = _best(sched.check, args.repeats)
            mesh_s = "x".join(map(str, mesh)) if isinstance(mesh, tuple) else str(mesh)
            print(
                f"{name:<14}{mesh_s:>10}{'Z3' if z3 else 'Z2':>6}{len(sched.ops):>9,}{t_sched:>12.3f}"
                f"{t_rank:>12.4f}{t_check:>9.3f}{t_sched + t_check:>15.3f}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
