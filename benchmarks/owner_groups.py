"""Owner groups on large meta-device presets: exclusive owners (``split=1``) vs ``split="auto"``.

    python benchmarks/owner_groups.py [--repeats 7] [--slack 0.25]

For each case, builds the preset on the meta device, takes the dedicated matrices from
``dmuon.plan.compile(model, mesh)``'s ``ParamSpec``s (weights = ``numel``; blocks cut the long
side of ``matrix_shape``, balanced, the first ``L % k`` one row longer; ``max_split = 1`` for a
TP-sharded matrix, an expert stack or a matrix view, else ``min(N, long side)``) and runs
:func:`dmuon.plan._ownership.partition.lpt_partition_groups` with ``split=1`` and ``split="auto"``.

Prints, per case and mode: slots owning nothing; max/mean owned elements; max/mean resident
bytes of the dedicated parameters (fp32 master + momentum; on HSDP every slot also holds the
replicas of its shard coordinate, as ``ShardingPlan.rank_stats`` counts them); the proven
bound on max owned elements over the mean; items split, the ``k`` distribution and the
largest ``k``; and the wall time of the partition call (median and min-max of ``--repeats``
runs, the two modes interleaved). Plan compilation and model construction are not timed.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import dmuon.plan as P  # noqa: E402
from dmuon.sim import zoo  # noqa: E402
from dmuon.plan._ownership.partition import lpt_partition_groups  # noqa: E402

CASES = [("llama3-70b", (8, 128)), ("llama3-70b", (1, 1024)), ("llama3-405b", (1, 1024)), ("llama3-405b", (1, 4096))]


def items_of(plan):
    """(weights, piece_weights, max_split, keys, groups) of a plan's dedicated parameters."""
    R, N = plan.mesh_shape
    weights, shapes, max_split, keys, groups = [], [], [], [], []
    for spec in plan.params:
        m, n = spec.matrix_shape
        long_side, short_numel = max(m, n), min(m, n) * spec.num_matrices
        whole = spec.tp_size == 1 and spec.num_matrices == 1 and spec.view is None
        weights.append(spec.numel)
        shapes.append((long_side, short_numel))
        max_split.append(min(N, long_side) if whole else 1)
        keys.append(spec.fqn)
        groups.append(plan.boundary(spec.fqn))

    def piece_weights(i: int, k: int) -> tuple[int, ...]:
        long_side, short_numel = shapes[i]
        q, r = divmod(long_side, k)
        return tuple((q + (j < r)) * short_numel for j in range(k))

    return weights, piece_weights, max_split, keys, groups


def resident_nbytes(loads, R: int, N: int, itemsize: int = 4) -> list[int]:
    """Dedicated resident bytes per slot: owned master + momentum; on HSDP the master replicas
    of every slot with the same shard coordinate (each replicate row holds a full replica)."""
    if R == 1:
        return [2 * x * itemsize for x in loads]
    held = [sum(loads[r * N + s] for r in range(R)) * itemsize for s in range(N)]
    return [held[slot % N] + loads[slot] * itemsize for slot in range(R * N)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--slack", type=float, default=0.25)
    args = parser.parse_args(argv)
    models: dict[str, object] = {}
    header = (
        f"{'preset':<12}{'mesh':>9} {'split':<6}{'empty':>6}{'owned max/mean':>15}{'resident max/mean':>18}"
        f"{'bound/mean':>11}{'split items':>12}  {'k distribution':<28}{'max k':>6}{'median ms':>10}{'min-max ms':>15}"
    )
    print(header)
    for name, mesh in CASES:
        model = models.get(name) or models.setdefault(name, zoo.PRESETS[name]())
        plan = P.compile(model, mesh)
        R, N = plan.mesh_shape
        S = R * N
        weights, piece_weights, max_split, keys, groups = items_of(plan)
        total = sum(weights)
        if (
            tuple(plan.owned_numel)
            != lpt_partition_groups(
                weights, piece_weights, max_split, keys, groups, num_shards=N, num_replicas=R, split=1
            ).loads
        ):
            raise SystemExit(f"{name} {mesh}: split=1 does not reproduce the plan's owners")
        times: dict[str, list[float]] = {"1": [], "auto": []}
        results = {}
        for _ in range(args.repeats):
            for split in (1, "auto"):
                t0 = time.perf_counter()
                results[str(split)] = lpt_partition_groups(
                    weights,
                    piece_weights,
                    max_split,
                    keys,
                    groups,
                    num_shards=N,
                    num_replicas=R,
                    split=split,
                    slack=args.slack,
                )
                times[str(split)].append(time.perf_counter() - t0)
        mean_numel = total / S
        for split, res in results.items():
            ks = [len(m) for m in res.members]
            dist = Counter(k for k in ks if k > 1)
            resident = resident_nbytes(res.loads, R, N)
            t = [x * 1e3 for x in times[split]]
            mesh_s = f"{R}x{N}"
            print(
                f"{name:<12}{mesh_s:>9} {split:<6}{res.num_empty_slots:>6}{res.max_load / mean_numel:>15.3f}"
                f"{max(resident) * S / sum(resident):>18.3f}{res.bound[0] / res.bound[1] / mean_numel:>11.3f}"
                f"{sum(dist.values()):>12}  {' '.join(f'{k}:{c}' for k, c in sorted(dist.items())) or '-':<28}"
                f"{max(ks):>6}{statistics.median(t):>10.1f}{f'{min(t):.1f}-{max(t):.1f}':>15}"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
