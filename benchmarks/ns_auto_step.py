"""``dmuon.Muon``'s Newton-Schulz step with ``ns_backend="auto"`` against ``"standard"``, in CPU time.

    python benchmarks/ns_auto_step.py --rounds 30                       # this tree
    python benchmarks/ns_auto_step.py --rounds 30 --trees OLD NEW       # two source trees, interleaved

What it times: one Muon step (:func:`dmuon.exec._optim.muon_step.muon_step`: momentum, the batched
fp32 Newton-Schulz calls, the updates) over the matrices ONE owner rank holds in
``benchmarks/step_time.py``'s GPT (``small``, ``large``) planned for N ranks with
``cost_model="ns_flops"`` and the backend under test (``compile(ns_backend=...)``, as
``step_time.py``'s ``dmuon_z3`` and ``dmuon_z3_auto`` plan it), rank 0's share. No process group:
the matrices carry dmuon's tags with a runtime that holds the plan (the set-up of
``tests/plan/test_ns_auto.py``); the rest of a training step (forward, backward, collectives, AdamW)
runs the same code under both backends, so this is where the two can differ.

Timing: ``time.thread_time`` of the calling thread, one torch thread (NS is single-threaded, and
CPU time leaves out the time the scheduler gives other processes, which dominates wall time on a
shared machine; cache and memory contention still count). In every round each backend runs once,
in alternating order; the ratio auto / standard is taken within the round; the table gives
medians and [min-max] over the rounds. With ``--trees``, each tree (a source checkout, put first on
``sys.path`` of a worker process) runs ``--rounds`` rounds in ``--launches`` alternating worker
launches (tree A, tree B, tree A, ...), so both are measured in one sitting.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

#: benchmarks/step_time.py's GPT sizes (model shape only)
SIZES = {
    "small": dict(n_layers=4, d_model=128, d_mlp=512, n_heads=4, seq_len=64),
    "large": dict(n_layers=8, d_model=256, d_mlp=1024, n_heads=8, seq_len=128),
}
BACKENDS = ("standard", "auto")


def _setup(size: str, nproc: int, backend: str):
    """The Muon param group and state of rank 0's matrices, planned with ``backend``."""
    import types

    import torch

    import dmuon
    from dmuon._train.byte_gpt import GPT, GPTConfig

    model = GPT(GPTConfig(vocab_size=256, **SIZES[size]), seed=0)
    plan = dmuon.plan.compile(model, nproc, cost_model="ns_flops", ns_backend=backend)
    rt = types.SimpleNamespace(plan=plan, model_ref=lambda: None)
    params = dict(model.named_parameters())
    for spec, owner in zip(plan.params, plan.owners):
        params[spec.fqn]._dmuon = types.SimpleNamespace(
            fqn=spec.fqn,
            owner_global_rank=owner.rank,
            is_owner=owner.rank == 0,
            holds_full=owner.rank == 0,
            shape=spec.shape,
            matrix_shape=spec.matrix_shape,
            num_matrices=spec.num_matrices,
            runtime=lambda: rt,
            tp=None,
        )
    gen = torch.Generator().manual_seed(0)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen)
    opt = dmuon.Muon(list(model.parameters()), ns_backend=backend, ns_dtype=torch.float32)
    return opt


def worker(sizes: list[str], nprocs: list[int], rounds: int) -> dict:
    """Rounds of both backends per (size, N): CPU seconds per Muon step, and which backend
    functions each step called (the ``ns_backends`` attributes, counted by a wrapper)."""
    import torch

    from dmuon.exec._optim import ns_backends as ns
    from dmuon.exec._optim.muon_step import muon_step

    torch.set_num_threads(1)
    calls: dict[str, int] = {}
    for name in ("newton_schulz", "gram_newton_schulz", "auto_newton_schulz"):
        real = getattr(ns, name)

        def counted(x, *, _real=real, _name=name, **kw):
            calls[_name] = calls.get(_name, 0) + 1
            return _real(x, **kw)

        setattr(ns, name, counted)
    out = {}
    for size in sizes:
        for n in nprocs:
            opts = {b: _setup(size, n, b) for b in BACKENDS}
            seen = {}

            def step(b):
                calls.clear()
                t0 = time.thread_time()
                with torch.no_grad():
                    muon_step(opts[b].param_groups[0], opts[b].state)
                dt = time.thread_time() - t0
                seen[b] = dict(calls)
                return dt

            for b in BACKENDS:  # warm-up
                step(b)
            times = {b: [] for b in BACKENDS}
            for r in range(rounds):
                for b in BACKENDS if r % 2 == 0 else BACKENDS[::-1]:
                    times[b].append(step(b))
            out[f"{size}/{n}"] = dict(times=times, calls=seen)
    return out


def _fmt(xs: list[float]) -> str:
    xs = sorted(xs)
    return f"{statistics.median(xs):.3f} [{xs[0]:.3f}-{xs[-1]:.3f}]"


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", nargs="+", choices=sorted(SIZES), default=["small", "large"])
    p.add_argument("--nproc", type=int, nargs="+", default=[2, 4])
    p.add_argument("--rounds", type=int, default=30, help="rounds per launch (each runs both backends once)")
    p.add_argument("--trees", nargs="+", default=[], help="source trees to compare, each in its own worker processes")
    p.add_argument("--launches", type=int, default=2, help="with --trees: alternating worker launches per tree")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.sizes, args.nproc, args.rounds)))
        return {}
    trees = args.trees or [str(Path(__file__).resolve().parents[1])]
    results: dict[str, dict] = {t: {} for t in trees}
    for _ in range(args.launches if args.trees else 1):
        for t in trees:
            env = dict(os.environ, PYTHONPATH=t)
            cmd = [
                sys.executable,
                __file__,
                "--worker",
                "--rounds",
                str(args.rounds),
                "--sizes",
                *args.sizes,
                "--nproc",
                *map(str, args.nproc),
            ]
            res = json.loads(subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout)
            for key, r in res.items():
                acc = results[t].setdefault(key, dict(times={b: [] for b in BACKENDS}, calls=r["calls"]))
                for b in BACKENDS:
                    acc["times"][b] += r["times"][b]
    print(f"{'tree':<28}{'size/N':<10}{'standard ms':>24}{'auto ms':>24}{'auto / standard':>24}  calls per step (auto)")
    for t, per in results.items():
        for key, r in per.items():
            s, a = r["times"]["standard"], r["times"]["auto"]
            ratio = [x / y for x, y in zip(a, s)]
            print(
                f"{Path(t).name[:27]:<28}{key:<10}{_fmt([1e3 * x for x in s]):>24}{_fmt([1e3 * x for x in a]):>24}"
                f"{_fmt(ratio):>24}  {r['calls']['auto']}"
            )
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(dict(results=results, load=os.getloadavg()), f, indent=1)
    return results


if __name__ == "__main__":
    main()
