"""Simulated step time of dmuon and the alternatives at production scale (dmuon.sim, no GPU).

    python benchmarks/simulate.py                    # the paper table + earlier NS + scale timing
    python benchmarks/simulate.py --json sim.json

Three parts, all from ``dmuon.sim.simulate`` on GPU presets (``dmuon/sim/_engine/hardware.py``):

* **paper table**: Llama-3-8B on 8 GPUs (one node) and on 16 nodes x 8 (1-D mesh of 128, and
  HSDP 16 x 8 with the shard group inside a node), Llama-3-70B and 405B on 1024 GPUs (1-D 1024 and
  HSDP 8 x 128 / 128 x 8), H100 preset; every variant's step and its ratio to FSDP2 + AdamW.
  Set-up: ``--tokens-per-rank`` (default 8192) tokens per GPU per step in sequences of 8192, bf16
  parameters on the wire (FSDP2 ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``),
  fp32 master weights and optimizer state, bf16 Newton-Schulz, no activation checkpointing,
  no tensor / pipeline parallelism, ``cost_model="ns_flops"``.
* **earlier NS** (:func:`dmuon.sim._engine.variants.early_ns_schedule`): predicted gain for Llama-3-8B and
  70B on H100 and A100 presets, Z3.
* **scale**: each paper row's wall time (compile of both modes + workload + all five
  simulations); the 405B rows are the scale check (Llama-3-405B on 1024 and on (8, 128) ranks).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import dmuon.plan as P  # noqa: E402
from dmuon.sim import zoo  # noqa: E402
import dmuon.sim as S  # noqa: E402
from dmuon.sim import hardware as H  # noqa: E402

MP = SimpleNamespace(param_dtype="bfloat16", reduce_dtype="float32")
PAPER = [
    ("llama3-8b", 8),
    ("llama3-8b", 128),
    ("llama3-8b", (16, 8)),
    ("llama3-70b", 1024),
    ("llama3-70b", (8, 128)),
    ("llama3-405b", 1024),
    ("llama3-405b", (8, 128)),
]
EARLY = [
    ("llama3-8b", 8, "h100"),
    ("llama3-8b", (16, 8), "h100"),
    ("llama3-70b", 1024, "h100"),
    ("llama3-70b", (8, 128), "h100"),
    ("llama3-8b", 8, "a100"),
    ("llama3-70b", 1024, "a100"),
]


def _plans(model, mesh):
    return {
        z3: P.compile(model, mesh, reshard_after_forward=z3, cost_model="ns_flops", mp_policy=MP)
        for z3 in (False, True)
    }


def run_case(name, mesh, hw, tokens, variants=S.VARIANTS):
    model = zoo.PRESETS[name]()
    plans = _plans(model, mesh)
    wl = S.from_plan(plans[True], tokens_per_rank=tokens, seq_len=min(tokens, 8192))
    out = {}
    for v in variants:
        p = plans[v != "z2"] if v in ("z2", "z3") else plans[True]
        out[v] = S.simulate(p, hw, wl, variant=v, timeline_ranks=())
    return out, plans, wl


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hw", default="h100")
    ap.add_argument("--tokens-per-rank", type=int, default=8192)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    hw = H.preset(args.hw)
    result = {"hardware": hw.name, "tokens_per_rank": args.tokens_per_rank, "paper": [], "early_ns": [], "scale": []}
    print(f"paper table: {hw.name}, {args.tokens_per_rank} tokens/GPU/step, seq 8192, bf16 wire")
    hdr = (
        f"{'model':<12}{'mesh':<10}{'adamw ms':>10}"
        + "".join(f"{v + ' x':>14}" for v in S.VARIANTS if v != "adamw")
        + f"{'z3 exposed ms':>15}{'z3 NS %':>9}{'z2 GiB':>8}{'z3 GiB':>8}{'adamw GiB':>10}"
    )
    print(hdr)
    print("-" * len(hdr))
    for name, mesh in PAPER:
        t0 = time.perf_counter()
        sims, _, _ = run_case(name, mesh, hw, args.tokens_per_rank)
        result["scale"].append(dict(model=name, mesh=mesh, wall_s=time.perf_counter() - t0))
        base = sims["adamw"].step_s
        row = dict(
            model=name,
            mesh=mesh,
            **{f"{v}_ms": 1e3 * s.step_s for v, s in sims.items()},
            **{f"{v}_ratio": s.step_s / base for v, s in sims.items()},
            z3_exposed_ms=1e3 * sims["z3"].exposed_comm_s,
            z3_ns_share=sims["z3"].ns_share,
            peak_gib={v: max(s.peak_memory_nbytes) / 2**30 for v, s in sims.items()},
            deferred_ms={v: 1e3 * s.deferred_comm_s for v, s in sims.items()},
        )
        result["paper"].append(row)
        print(
            f"{name:<12}{str(mesh):<10}{1e3 * base:>10.1f}"
            + "".join(f"{sims[v].step_s / base:>14.3f}" for v in S.VARIANTS if v != "adamw")
            + f"{1e3 * sims['z3'].exposed_comm_s:>15.1f}{100 * sims['z3'].ns_share:>9.1f}"
            + f"{row['peak_gib']['z2']:>8.1f}{row['peak_gib']['z3']:>8.1f}{row['peak_gib']['adamw']:>10.1f}"
            + f"   ({result['scale'][-1]['wall_s']:.1f} s)"
        )
    print("\nearlier NS (Z3): predicted step, standard vs early")
    for name, mesh, hwname in EARLY:
        hw2 = H.preset(hwname)
        sims, plans, wl = run_case(name, mesh, hw2, args.tokens_per_rank, variants=("z3",))
        early = S.simulate(plans[True], hw2, wl, early_ns=True, timeline_ranks=())
        std = sims["z3"]
        gain = 1 - early.step_s / std.step_s
        result["early_ns"].append(
            dict(
                model=name,
                mesh=mesh,
                hw=hwname,
                z3_ms=1e3 * std.step_s,
                early_ms=1e3 * early.step_s,
                gain=gain,
                z3_exposed_ms=1e3 * std.exposed_comm_s,
                early_exposed_ms=1e3 * early.exposed_comm_s,
            )
        )
        print(
            f"  {name:<12}{str(mesh):<10}{hwname:<6} z3 {1e3 * std.step_s:9.1f} ms  early {1e3 * early.step_s:9.1f} ms  "
            f"gain {100 * gain:+.2f} %  (exposed comm {1e3 * std.exposed_comm_s:.1f} -> {1e3 * early.exposed_comm_s:.1f} ms)"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1, default=str)
    return result


if __name__ == "__main__":
    main()
