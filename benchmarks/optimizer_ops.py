"""aten ops per optimizer step (torch.profiler, CPU): dmuon.Muon on the main job's model and on a
32-expert MoE, one process (gloo, world 1: every dedicated matrix is owned here).

    python benchmarks/optimizer_ops.py --ns-batching batched exact [--json FILE]   # ~15 s on one core

Counted: the aten ops the step dispatches from Python (top-level ``aten::`` events of the
profiler, an op called inside another aten op is not counted again), split into ops that run a
kernel and view / metadata ops (``view``, ``reshape``, ``transpose``, ``split``, ``narrow``, ...:
no kernel on any device; allocations such as ``empty`` are counted with them). "Muon" is the step with every non-dedicated gradient set to None (AdamW
skips them), so it counts the Muon update alone; "step" is the whole step.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

import dmuon

from dmuon._train.byte_gpt import GPT, GPTConfig  # the main job's model

VIEW_OPS = {
    "aten::view",
    "aten::reshape",
    "aten::_reshape_alias",
    "aten::transpose",
    "aten::t",
    "aten::split",
    "aten::narrow",
    "aten::slice",
    "aten::select",
    "aten::as_strided",
    "aten::alias",
    "aten::unsqueeze",
    "aten::squeeze",
    "aten::expand",
    "aten::permute",
    "aten::detach",
    "aten::unbind",
    "aten::split_with_sizes",
    "aten::numpy_T",
    "aten::matrix_H",
    "aten::mT",
    "aten::_unsafe_view",
    "aten::lift_fresh",
    "aten::item",
    "aten::_local_scalar_dense",
    "aten::empty",
    "aten::empty_like",
    "aten::empty_strided",
    "aten::result_type",
}


def count(fn) -> dict:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    kernel = view = 0
    names: dict[str, int] = {}
    for e in prof.events():
        if not e.name.startswith("aten::"):
            continue
        parent = e.cpu_parent
        while parent is not None and not parent.name.startswith("aten::"):
            parent = parent.cpu_parent
        if parent is not None:
            continue
        if e.name in VIEW_OPS:
            view += 1
        else:
            kernel += 1
            names[e.name] = names.get(e.name, 0) + 1
    return {"kernel_ops": kernel, "view_ops": view, "by_name": dict(sorted(names.items(), key=lambda kv: -kv[1]))}


def run(cfg, ns_batching: str | None) -> dict:
    torch.manual_seed(0)
    model = GPT(cfg)
    dmuon.dedicate_params(model, None)
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    kw = {} if ns_batching is None else {"ns_batching": ns_batching}
    opt = dmuon.Muon(model, lr=0.02, **kw)
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len))

    def backward():
        opt.zero_grad(set_to_none=True)
        logits = model(tokens[:, :-1])
        torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1)).backward()

    for _ in range(2):  # warm-up (state created, first-step checks done)
        backward()
        opt.step()
    backward()
    step = count(opt.step)
    backward()
    for g in opt.param_groups:
        if not g["use_muon"]:
            for p in g["params"]:
                p.grad = None
    muon = count(opt.step)
    n_mats = sum(
        int(dmuon.exec.dedicated_info(p).num_matrices) for g in opt.param_groups if g["use_muon"] for p in g["params"]
    )
    n_params = sum(len(g["params"]) for g in opt.param_groups if g["use_muon"])
    return {"dedicated_params": n_params, "muon_matrices": n_mats, "step": step, "muon": muon}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--ns-batching", nargs="*", default=None, help="values of dmuon.Muon(ns_batching=); none: the default only"
    )
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{os.path.join(tmp, 'store')}", rank=0, world_size=1)
        try:
            models = {"main job (default GPTConfig)": GPTConfig(), "MoE, 32 experts": GPTConfig(n_experts=32, top_k=2)}
            out = {}
            for name, cfg in models.items():
                for mode in args.ns_batching or [None]:
                    r = run(cfg, mode)
                    key = f"{name} | ns_batching={mode or 'default'}"
                    out[key] = r
                    print(
                        f"{key}: {r['dedicated_params']} dedicated params, {r['muon_matrices']} Muon matrices; "
                        f"Muon part: {r['muon']['kernel_ops']} kernel ops + {r['muon']['view_ops']} view ops; "
                        f"whole step: {r['step']['kernel_ops']} + {r['step']['view_ops']}"
                    )
                    print("   top Muon ops:", dict(list(r["muon"]["by_name"].items())[:8]))
        finally:
            dist.barrier()
            dist.destroy_process_group()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
