"""Mixture-of-Experts plans before and after expert ranges (docs/planning.md, "Mixture-of-Experts").

    python benchmarks/moe_plans.py [--models qwen3-30b-a3b deepseek-v3] [--meshes 64 256]

For each preset (meta device, no GPU, no process group) and mesh, two plans:

* before: ``predicate=dmuon.plan.matrix_predicate(model), experts="off"`` -- every 3-D expert
  stack is one Muon parameter with a single owner (what selecting the stacks meant before expert
  support; ``python -m dmuon plan --experts off --all-matrices``);
* after: the defaults (``experts="auto"``, ``ExpertPolicy(gate_up="split")``) -- every expert its own
  Muon matrices, a stack's experts owned by min(E, N) ranks in contiguous ranges;

and per ``--ep k`` (default 8 and N) the expert-parallel plan (``compile(ep=k)`` of the model as
one rank holds it, ``E/k`` experts per stack): local experts for ``k = N`` (0 expert bytes),
owners inside efsdp groups of ``N/k`` ranks otherwise. Owned elements, NS FLOPs and bytes count
the experts each rank owns and moves (the model's own all-to-all is not dmuon's).

Columns: ranks owning nothing; owned elements max/mean over ranks; the busiest rank's
Newton-Schulz FLOPs per step; bytes per rank per step (max of ``plan.cost.per_rank_nbytes``);
peak transient buffer (max of ``plan.rank_stats()`` ``peak_transient_nbytes``); the Muon matrix
count; and ``compile`` wall time (seconds, this machine). Storage fp32, Z3, cost model numel.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import dmuon.plan as P  # noqa: E402
from dmuon.plan._model.parallel import expert_parallel_variant  # noqa: E402
from dmuon._zoo import PRESETS  # noqa: E402

GIB = 2**30


def row(model, mesh: int, before: bool, ep: int = 1) -> dict:
    """The table's figures of one plan (``ep > 1``: ``model`` is an ``expert_parallel_variant``)."""
    kw = dict(predicate=P.matrix_predicate(model), experts="off") if before else {}
    if ep > 1:
        kw = dict(ep=ep)
    t0 = time.perf_counter()
    plan = P.compile(model, mesh, **kw)
    compile_s = time.perf_counter() - t0
    owned = plan.owned_numel
    stats = plan.rank_stats()
    return dict(
        empty=sum(1 for n in owned if n == 0),
        max_mean=max(owned) / (sum(owned) / len(owned)),
        ns_tflop=max(s.ns_flops for s in stats) / 1e12,
        bytes_gib=max(plan.cost.per_rank_nbytes) / GIB,
        peak_gib=max(s.peak_transient_nbytes for s in stats) / GIB,
        matrices=sum(p.num_matrices for p in plan.params),
        compile_s=compile_s,
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["qwen3-30b-a3b", "deepseek-v3"], choices=sorted(PRESETS))
    ap.add_argument("--meshes", nargs="+", type=int, default=[64, 256])
    ap.add_argument("--no-before-after", action="store_true", help="only the EP rows")
    ap.add_argument(
        "--ep",
        nargs="*",
        type=int,
        default=[8, 0],
        help="expert-parallel degrees to add rows for (0 = ep = min(N, E): local experts when E >= N)",
    )
    args = ap.parse_args(argv)
    print(
        "| model | ranks | plan | Muon matrices | ranks owning nothing | owned max/mean | busiest-rank NS TFLOP "
        "| bytes/rank/step (max) | peak transient (max) | compile s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name in args.models:
        model = PRESETS[name]()
        for mesh in args.meshes:
            for before in () if args.no_before_after else (True, False):
                r = row(model, mesh, before)
                label = "before: one owner per stack" if before else "after: expert ranges (default)"
                print(
                    f"| {name} | {mesh} | {label} | {r['matrices']:,} | {r['empty']} | {r['max_mean']:.2f} "
                    f"| {r['ns_tflop']:.1f} | {r['bytes_gib']:.1f} GiB | {r['peak_gib']:.2f} GiB | {r['compile_s']:.1f} |",
                    flush=True,
                )
            num_experts = next(p.shape[0] for n, p in model.named_parameters() if p.ndim == 3)
            for ep in args.ep:
                k = ep or min(mesh, num_experts)  # "0": ep = N, or every expert on its own rank when N > E
                if num_experts % k or mesh % k:
                    continue
                r = row(expert_parallel_variant(PRESETS[name](), k), mesh, False, ep=k)
                label = f"EP ep={k} x efsdp={mesh // k}" + (" (local)" if k == mesh else "")
                print(
                    f"| {name} | {mesh} | {label} | {r['matrices']:,} | {r['empty']} | {r['max_mean']:.2f} "
                    f"| {r['ns_tflop']:.1f} | {r['bytes_gib']:.1f} GiB | {r['peak_gib']:.2f} GiB | {r['compile_s']:.1f} |",
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
