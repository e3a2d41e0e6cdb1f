"""Each buffer's collective on the presets (docs/planning.md, "Collectives per buffer").

    python benchmarks/collective_plans.py [--collectives auto|broadcast|all_gather] [--json]

For each preset and mesh (meta device, no GPU, no process group; bf16 wire, fp32 reduce, Z3, cost
model numel), the plan of ``compile(collectives=...)``: dmuon's buffer collectives rank 0 takes part
in per step by kind (``plan.schedule().rank_ops(0)``, shard and replicate phases), the all-gathered
buffers and their padding (``N * slot - numel`` over their elements), the most segments of a buffer,
dmuon's bytes per step over all ranks (``plan.cost.total_nbytes``), the busiest rank's peak
transient buffer (``plan.rank_stats()``) and the bytes of compute tensors assembled per boundary
(``plan.assembled_nbytes``, the largest), and the compile time. The "before" columns of the docs'
table are this script's output on the commit before issue 35 (every buffer broadcast, ``min(E, N)``
expert ranges; run it there without ``--collectives``).
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
from dmuon.plan.model.parallel import expert_parallel_variant  # noqa: E402
from dmuon.zoo import PRESETS  # noqa: E402

CASES = [  # (preset, ranks, ep)
    ("tiny-llama", 2, 1), ("tiny-llama", 4, 1), ("tiny-moe", 2, 1), ("tiny-moe", 4, 1),
    ("llama3-8b", 8, 1), ("qwen3-30b-a3b", 64, 1), ("qwen3-30b-a3b", 256, 1),
    ("deepseek-v3", 64, 1), ("deepseek-v3", 256, 1), ("qwen3-30b-a3b", 64, 8), ("deepseek-v3", 256, 8),
]
PHASES = ("forward_broadcast", "backward_broadcast", "reduce", "replicate_reduce", "replicate_broadcast")


def row(name: str, ranks: int, ep: int, collectives: str) -> dict:
    model = PRESETS[name]()
    kw: dict = dict(mp_policy=SimpleNamespace(param_dtype="torch.bfloat16", reduce_dtype="torch.float32"),
                    collectives=collectives)
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
        model=name, ranks=ranks, ep=ep, collectives=dict(sorted(counts.items())),
        all_gathered=f"{len(gathered)} / {len(bufs)}",
        padding_pct=round(100 * sum(buf.padding_numel(N) for buf in gathered) / moved, 1) if moved else None,
        max_segments=max(len(buf.segments) for buf in bufs), total_nbytes=plan.cost.total_nbytes,
        peak_transient_nbytes=max(s.peak_transient_nbytes for s in plan.rank_stats()),
        assembled_nbytes=max(plan.assembled_nbytes.values(), default=0), compile_s=round(seconds, 1),
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--collectives", default="auto", choices=("auto", "broadcast", "all_gather"))
    ap.add_argument("--json", action="store_true", help="one JSON object per line")
    args = ap.parse_args()
    for name, ranks, ep in CASES:
        r = row(name, ranks, ep, args.collectives)
        if args.json:
            print(json.dumps(r), flush=True)
            continue
        print(f"{name:<15}{ranks:>5} ep {ep:<3} {r['collectives']!s:<64} all-gathered {r['all_gathered']:<8} "
              f"padding {r['padding_pct']!s:>5} % max segments {r['max_segments']:>4} "
              f"bytes {r['total_nbytes'] / 1e12:>10.3f} TB peak transient {r['peak_transient_nbytes'] / 2**30:>8.3f} GiB "
              f"(assembled {r['assembled_nbytes'] / 2**30:.3f}) {r['compile_s']} s", flush=True)


if __name__ == "__main__":
    main()
