"""``python -m dmuon simulate``: step time of every variant on a hardware model, from the plan.

Example: ``python -m dmuon simulate --model llama3-8b --mesh 8 --hw h100``. What it prints, how
``--ep`` and ``--tp`` are modelled and the dtypes assumed: Note: what simulate prints
(docs/design.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from collections.abc import Sequence
from typing import Any

from dmuon.sim._pages.sim_html import MEMORY_TERMS
from dmuon.sim._pages.recommendation import fits, recommend

__all__ = ["main_simulate"]


def expert_counts(model: Any) -> dict[str, int]:
    """``{fqn: E}`` of ``model``'s expert stacks as the simulator's workload sees them
    (:func:`dmuon.plan._cost.baseline.is_expert_stack`, :func:`dmuon.sim.workload.from_plan`)."""
    from dmuon.plan._cost.baseline import is_expert_stack

    return {n: int(p.shape[0]) for n, p in model.named_parameters() if is_expert_stack(n, tuple(p.shape))}


#: what the FSDP2 baselines assume, printed in the header (a model with expert stacks)
BASELINE_LINE = (
    "FSDP2 baseline: dense parameters Shard(0); expert stacks Shard(1) when efsdp x ep > E, else "
    "Shard(0) (torchtitan apply_fsdp_to_decoder)"
)
#: the same for a model without expert stacks
DENSE_BASELINE_LINE = "FSDP2 baseline: every parameter Shard(0)"


def dmuon_collectives(plan: Any) -> tuple[dict[str, int], int]:
    """dmuon's own collectives of ``plan``'s nominal step: per kind, the schedule table's count
    (every group), and the most any one rank issues (every op counted as the runtime issues it
    uncoalesced)."""
    from dmuon.sim._engine.hardware import OP_COLLECTIVE

    by_kind: dict[str, int] = {}
    per_group: dict[tuple[int, ...], int] = {}
    sched = plan.schedule()
    for op in sched.ops:
        if op.external or op.kind not in OP_COLLECTIVE:
            continue
        by_kind[op.kind] = by_kind.get(op.kind, 0) + 1
        per_group[op.group] = per_group.get(op.group, 0) + 1
    per_rank = [0] * sched.num_ranks
    for group, c in per_group.items():
        for x in group:
            per_rank[x] += c
    return by_kind, max(per_rank, default=0)


def busiest_memory(sim: Any) -> dict[str, int]:
    """The busiest rank's (largest peak) memory by term, and its rank and peak (``--json``)."""
    r = max(sim.ranks, key=lambda x: (x.memory.peak_nbytes, -x.rank))
    return dict(
        {field: getattr(r.memory, field) for _, field in MEMORY_TERMS}, rank=r.rank, peak_nbytes=r.memory.peak_nbytes
    )


def offload_lines(plans: dict, workload: Any) -> list[str]:
    """``simulate --offload``: each variant's busiest device peak (the memory terms under CPU
    offload, :func:`dmuon.plan._cost.rank_memory.dmuon_memory` / ``fsdp2_memory`` with
    ``offload=True``, plus the activations, which stay on the device) and its host memory, GiB;
    ``plans``: variant -> the plan it ran on."""
    from dmuon.plan._cost import rank_memory
    from dmuon.sim._engine.sim_memory import activations_nbytes

    act = activations_nbytes(workload)
    lines = [
        "",
        "under CPU offload (memory only; step times above without the host copies), busiest rank, GiB:",
        f"{'variant':<12}{'rank':>6}{'device peak':>14}{'host':>10}",
    ]
    for v, plan in plans.items():
        if v in ("z2", "z3"):
            terms = [s.memory for s in plan.rank_stats(offload=True)]
        else:
            terms = [rank_memory.fsdp2_memory(plan, v, offload=True)]
        r = max(range(len(terms)), key=lambda i: (terms[i].peak_nbytes, -i))
        t = terms[r]
        lines.append(f"{v:<12}{r:>6}{(t.peak_nbytes + act) / 2**30:>14.2f}{t.host_nbytes / 2**30:>10.2f}")
    return lines


def memory_lines(sims: dict) -> list[str]:
    """Peak memory per rank by term: each variant's busiest rank, GiB; then every dmuon mode's
    ranks above FSDP2 + AdamW's peak (the question "does dmuon fit where FSDP2 + AdamW fits?")."""
    if "adamw" not in sims:
        return []
    rows = {v: busiest_memory(s) for v, s in sims.items()}
    lines = [
        "",
        "peak memory per rank, busiest rank, GiB (transient: the most held at once over the step, phase by phase):",
        f"{'variant':<12}{'rank':>6}" + "".join(f"{t:>17}" for t, _ in MEMORY_TERMS) + f"{'peak':>10}",
    ]
    for v, m in rows.items():
        lines.append(
            f"{v:<12}{m['rank']:>6}"
            + "".join(f"{m[f] / 2**30:>17.2f}" for _, f in MEMORY_TERMS)
            + f"{m['peak_nbytes'] / 2**30:>10.2f}"
        )
    ref = rows["adamw"]
    for v in ("z2", "z3"):
        if v not in sims:
            continue
        above = [r.rank for r in sims[v].ranks if r.memory.peak_nbytes > ref["peak_nbytes"]]
        m = rows[v]
        if not above:
            lines.append(
                f"dmuon {v.upper()}: every rank at or below FSDP2 + AdamW's peak "
                f"({m['peak_nbytes'] / 2**30:.2f} vs {ref['peak_nbytes'] / 2**30:.2f} GiB)"
            )
            continue
        gap = ", ".join(f"{t} {(m[f] - ref[f]) / 2**30:+.2f}" for t, f in MEMORY_TERMS if m[f] != ref[f])
        shown = ", ".join(str(r) for r in above[:8]) + (" ..." if len(above) > 8 else "")
        lines.append(
            f"dmuon {v.upper()}: ABOVE FSDP2 + AdamW's peak on {len(above)} of {len(sims[v].ranks)} ranks "
            f"({shown}): busiest {m['peak_nbytes'] / 2**30:.2f} vs {ref['peak_nbytes'] / 2**30:.2f} GiB; "
            f"gap by term, GiB: {gap}"
        )
    return lines


def buffer_padding(plan: Any) -> tuple[int, int]:
    """``(payload_numel, wire_numel)`` of ``plan``'s boundary buffers in one replicate row:
    the dedicated elements they carry, and the elements one forward phase moves for them (a
    broadcast buffer: its segments, alignment and presence flags included; an all-gather buffer:
    ``N · slot_numel``, its slot padding included). Padding = wire / payload - 1."""
    payload = wire = 0
    N = plan.mesh_shape[1]
    for b in plan.boundaries:
        for buf in b.buffers:
            payload += sum(e.numel for seg in buf.segments for sub in seg.subsegments for e in sub.entries)
            wire += N * buf.slot_numel if getattr(buf, "collective", "broadcast") == "all_gather" else buf.numel
    return payload, wire


def top_k_error(model: Any, top_k: int) -> str | None:
    """Why ``--top-k top_k`` does not fit ``model`` (None when it does): each token visits
    ``1 <= top_k <= E`` of a stack's ``E`` experts, for every stack."""
    counts = expert_counts(model)
    if not counts:
        return "the model has no expert stacks (3-D 'experts' parameters); leave --top-k out"
    fewest = min(counts.values())
    if not 1 <= top_k <= fewest:
        name = min(counts, key=lambda n: (counts[n], n))
        smallest = " (the model's smallest stack)" if len(set(counts.values())) > 1 else ""
        return f"experts per token must be between 1 and {fewest}, the number of experts of {name}{smallest}"
    return None


def token_a2a_line(plan: Any, wl: Any, hw: Any, ep: int, top_k: int, act_dtype: str) -> str:
    """The header line of the token all-to-all model under ``--ep`` ("" without EP)."""
    from dmuon.sim._engine.alternatives import ep_groups
    from dmuon.sim._engine.hardware import collective_s

    groups = ep_groups(plan)
    moe = [(f, w) for f, w in wl.boundaries if w.experts is not None]
    if ep <= 1 or not groups or not moe:
        return ""
    nbytes = max(w.dispatch_nbytes for _, w in moe)
    call_s = collective_s(hw, "all_to_all", groups[0], nbytes)
    calls = 4 * len(moe) * wl.micro_batches
    return (
        f"token all-to-all over EP groups of {ep} ranks: {calls:,} calls per step (dispatch + combine, forward "
        f"and backward, {len(moe)} MoE layers), {nbytes / 1e6:,.1f} MB per rank per call (top-{top_k}, "
        f"{act_dtype.removeprefix('torch.')}), {1e3 * call_s:.2f} ms per call; uniform routing, no capacity "
        f"factor, no overlap with compute"
    )


def main_simulate(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m dmuon simulate``. Returns 0."""
    from dmuon._cli.plan_commands import (
        add_selection_args,
        check_selection_args,
        parse_mesh,
        refusal_text,
        selection_kwargs,
        tp_degree_error,
        warnings_to_stderr,
    )
    from dmuon._cli.pipeline_commands import add_pipeline_args, simulate_pipelined, wants_pipeline
    from dmuon.plan._compile import compile
    from dmuon._zoo import PRESETS
    from dmuon.sim._engine import hardware as H
    from dmuon.sim._engine.simulate import VARIANTS, simulate
    from dmuon.sim._engine.workload import from_plan, model_top_k

    parser = argparse.ArgumentParser(
        prog="python -m dmuon simulate",
        description="Simulated step time of dmuon Z2/Z3 and the alternatives (no GPU needed).",
    )
    parser.add_argument("--model", required=True, choices=sorted(PRESETS))
    parser.add_argument("--mesh", required=True, type=parse_mesh, help="N or RxN (replicate x shard)")
    parser.add_argument("--hw", required=True, help=f"hardware preset {sorted(H.PRESETS)} or a calibration .json")
    parser.add_argument("--tokens-per-rank", type=int, default=8192, help="tokens per rank per step")
    parser.add_argument("--seq-len", type=int, default=None, help="sequence length (default: min(tokens, 8192))")
    parser.add_argument("--mode", choices=("z2", "z3"), default=None, help="only this dmuon mode")
    parser.add_argument(
        "--top-k",
        type=int,
        default=None,
        metavar="K",
        help="experts each token visits in 3-D expert stacks (default: the model's routing "
        "top_k, e.g. 8 for qwen3-30b-a3b and deepseek-v3; 2 when the model names none)",
    )
    parser.add_argument(
        "--coalesce",
        choices=("record", "off", "serial", "concurrent"),
        default="record",
        help="dmuon's broadcasts / reduces per boundary phase and group as one coalesced call: as the "
        "hardware record says (GPU presets: NCCL, serial model), off (one call each, as a runtime that "
        "does not coalesce), or on with the serial / concurrent (uncalibrated) model",
    )
    parser.add_argument(
        "--ep",
        type=int,
        default=1,
        metavar="K",
        help="expert parallelism: plan the model as one rank of ep = K holds it and simulate the "
        "token all-to-all over the EP groups (uniform routing, no capacity factor, no overlap with compute)",
    )
    add_pipeline_args(parser)
    add_selection_args(parser, cost_model_default="ns_flops")  # the same options as `plan`
    parser.add_argument("--json", metavar="FILE", default=None, help="write every variant's figures as JSON")
    parser.add_argument(
        "--offload",
        action="store_true",
        help="also print each variant's busiest device peak and host memory under CPU offload (dedicate_params "
        "and fully_shard given CPUOffloadPolicy; plan.rank_stats(offload=True) + activations); memory only: the "
        "step times do not price the host copies",
    )
    parser.add_argument(
        "--png", metavar="FILE", default=None, help="draw rank 0's timeline of each variant (matplotlib)"
    )
    parser.add_argument(
        "--html",
        metavar="FILE",
        default=None,
        help="write the variants' figures and rank 0's timeline per variant as a page (SVG, no matplotlib)",
    )
    args = parser.parse_args(argv)
    check_selection_args(parser, args)
    for f in (args.json, args.png, args.html):
        if f and os.path.isdir(f):
            parser.error(f"{f!r} is a folder: give a file name")
        if f and not os.path.isdir(os.path.dirname(os.path.abspath(f))):
            parser.error(f"the folder of {f!r} does not exist")
    if args.tokens_per_rank < 1:
        parser.error("--tokens-per-rank must be >= 1")
    if args.seq_len is not None and not 1 <= args.seq_len <= args.tokens_per_rank:
        parser.error(
            f"--seq-len must be between 1 and --tokens-per-rank ({args.tokens_per_rank:,}), got {args.seq_len}"
        )
    try:
        hw = H.preset(args.hw)
    except (ValueError, OSError) as exc:
        parser.error(f"--hw {args.hw!r}: not a preset {sorted(H.PRESETS)} nor a readable calibration record ({exc})")
    if args.coalesce != "record":
        hw = dataclasses.replace(
            hw,
            coalesces=args.coalesce != "off",
            coalesce_model=hw.coalesce_model if args.coalesce == "off" else args.coalesce,
        )
    gpu = hw.comm_engine == "separate"
    param_dtype = args.param_dtype or ("bfloat16" if gpu else None)
    model = PRESETS[args.model]()
    if args.top_k is not None:
        check = top_k_error(model, args.top_k)
        if check:
            parser.error(f"--top-k {args.top_k}: {check}")
    top_k = args.top_k or model_top_k(model)
    if args.ep < 1:
        parser.error("--ep must be >= 1")
    if args.ep > 1 and args.tp > 1:
        parser.error("--ep with --tp: expert parallelism is not simulated with tensor parallelism")
    tp_error = tp_degree_error(model, args.tp)
    if tp_error:
        parser.error(tp_error)
    try:
        with warnings_to_stderr():
            kw = selection_kwargs(
                args, model, args.mesh, param_dtype=param_dtype, reduce_dtype="float32" if gpu else None
            )
            if args.ep > 1:
                from dmuon.plan._model.parallel import expert_parallel_variant

                model = expert_parallel_variant(model, args.ep)
                kw["ep"] = args.ep
            # a CPU (gloo) record prices collectives="auto" with gloo's link record, as dedicate_params does there
            kw.setdefault("collective_backend", "nccl" if gpu else "gloo")
            if not wants_pipeline(args):
                plans = {z3: compile(model, args.mesh, reshard_after_forward=z3, **kw) for z3 in (False, True)}
    except ValueError as exc:  # the plan refuses this mesh / TP degree / EP degree / owner groups for this model
        flags = f"--mesh {args.mesh} --tp {args.tp}" + (f" --ep {args.ep}" if args.ep > 1 else "")
        parser.error(f"{args.model} on {flags}: {refusal_text(exc)}")
    if wants_pipeline(args):  # --pp / --microbatches / --ac: the pipelined step (pipeline_commands)
        if not gpu:  # a calibrated CPU: every rank on this machine
            dims = args.mesh if isinstance(args.mesh, tuple) else (args.mesh,)
            hw = dataclasses.replace(hw, ranks_per_node=args.pp * args.tp * dims[0] * (dims[1] if len(dims) > 1 else 1))
        act = "torch.bfloat16" if gpu else "torch.float32"
        return simulate_pipelined(parser, args, model, kw, hw, top_k, param_dtype, act)
    plan = plans[True]
    R, N = plan.mesh_shape
    if not gpu:  # a calibrated CPU: every rank on this machine
        hw = dataclasses.replace(hw, ranks_per_node=R * N * plan.tp_size)
    seq = args.seq_len or min(args.tokens_per_rank, 8192)
    act_dtype = "torch.bfloat16" if gpu else "torch.float32"
    wl = from_plan(plan, tokens_per_rank=args.tokens_per_rank, seq_len=seq, activation_dtype=act_dtype, top_k=top_k)
    variants = [
        v
        for v in VARIANTS
        if (args.mode is None or v not in ("z2", "z3") or v == args.mode)
        and (args.ep == 1 or v not in ("naive", "all_to_all"))
    ]
    sims = {}
    for v in variants:
        p = plans[v != "z2"] if v in ("z2", "z3") else plan
        sims[v] = simulate(p, hw, wl, variant=v, timeline_ranks=(0,))
    base = sims["adamw"].step_s
    ep_note = f", EP {args.ep} (efsdp {plan.mesh_shape[1] // args.ep})" if args.ep > 1 else ""
    tp_note = f" x TP {plan.tp_size}" if plan.tp_size > 1 else ""
    print(
        f"{args.model} on mesh {plan.mesh_shape}{tp_note} ({plan.world_size * plan.tp_size} ranks){ep_note}, "
        f"{hw.name}; {args.tokens_per_rank:,} tokens/rank, seq {seq}, wire {param_dtype or 'fp32'}"
    )
    baseline_line = BASELINE_LINE if expert_counts(model) else DENSE_BASELINE_LINE
    print(baseline_line)
    coll_note = ""
    if hw.coalesces:
        coll_note = (
            f"; NCCL-coalesced broadcasts / reduces per boundary phase and group ({hw.coalesce_model} model"
            + (", uncalibrated" if hw.coalesce_model == "concurrent" else "")
            + ")"
        )
    a2a = token_a2a_line(plan, wl, hw, args.ep, top_k, act_dtype)
    if a2a:
        print(a2a)
    by_kind, busiest = dmuon_collectives(plan)
    payload, wire = buffer_padding(plan)
    kinds = ", ".join(f"{k} {c:,}" for k, c in sorted(by_kind.items())) or "none"
    pad = f"{100 * (wire / payload - 1):.4f} %" if payload else "-"
    print(
        f"dmuon Z3 collectives per step: {kinds} (schedule table, all groups); the busiest rank by calls issues "
        f"{busiest:,}{coll_note}; buffer padding {pad} ({payload:,} elements carried, {wire:,} moved per row and phase)"
    )
    hdr = (
        f"{'variant':<12}{'step ms':>10}{'x AdamW':>9}{'exposed ms':>12}{'NS ms':>9}{'NS %':>7}{'peak GiB':>10}"
        f"{'TB moved':>12}{'calls/rank':>12}"
    )
    print(hdr)
    print("-" * len(hdr))
    for v, s in sims.items():
        print(
            f"{v:<12}{1e3 * s.step_s:>10.1f}{s.step_s / base:>9.3f}{1e3 * s.exposed_comm_s:>12.1f}{1e3 * s.ns_s:>9.1f}"
            f"{100 * s.ns_share:>7.1f}{max(s.peak_memory_nbytes) / 2**30:>10.2f} {s.comm_nbytes / 1e12:>11.3f}"
            f"{max(s.collectives_per_rank, default=0):>12,}"
        )
    for line in memory_lines(sims):
        print(line)
    if hw.memory_nbytes:  # every row's peak per rank against the device
        print(
            f"peak per rank against the device's {hw.memory_nbytes / 2**30:.1f} GiB: "
            + ", ".join(f"{v} {'fits' if fits(s, hw.memory_nbytes) else 'DOES NOT FIT'}" for v, s in sims.items())
        )
    if args.offload:
        try:
            lines = offload_lines({v: plans[v != "z2"] if v in ("z2", "z3") else plan for v in sims}, wl)
        except (NotImplementedError, ValueError) as exc:
            parser.error(f"--offload: {exc}")
        for line in lines:
            print(line)
    rec, why = recommend(sims, hw.memory_nbytes)
    print(f"\nrecommended: dmuon {rec.upper()} ({sims[rec].step_s / base:.3f} x FSDP2 + AdamW): {why}")
    if not fits(sims[rec], hw.memory_nbytes):  # recommend() prefers a mode that fits: none does
        peak = max(sims[rec].peak_memory_nbytes)
        print(
            f"warning: no dmuon mode fits the device: {rec.upper()} peaks at {peak / 2**30:.1f} GiB per rank against "
            f"{hw.memory_nbytes / 2**30:.1f} GiB (more shard ranks, TP, activation checkpointing or fewer tokens per rank)"
        )
    if args.json:
        out = dict(
            model=args.model,
            mesh=list(plan.mesh_shape),
            tp=plan.tp_size,
            ep=args.ep,
            hardware=hw.name,
            tokens_per_rank=args.tokens_per_rank,
            seq_len=seq,
            recommended=rec,
            baseline=baseline_line,
            dmuon_collectives=by_kind,
            dmuon_collectives_busiest_rank=busiest,
            buffer_payload_numel=payload,
            buffer_wire_numel=wire,
            variants={
                v: dict(
                    step_ms=1e3 * s.step_s,
                    ratio_to_adamw=s.step_s / base,
                    exposed_comm_ms=1e3 * s.exposed_comm_s,
                    ns_ms=1e3 * s.ns_s,
                    peak_memory_nbytes=list(s.peak_memory_nbytes),
                    comm_nbytes=s.comm_nbytes,
                    busiest_memory_nbytes=busiest_memory(s),
                    collectives_busiest_rank=max(s.collectives_per_rank, default=0),
                    critical_rank=s.critical_rank,
                    critical_op=s.critical_op,
                    critical_path_s=s.path_seconds(),
                )
                for v, s in sims.items()
            },
        )
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(out, f, indent=1)
            f.write("\n")
        print(f"wrote {args.json}")
    if args.png:
        from dmuon.sim._pages.sim_plot import gantt

        gantt({v: s for v, s in sims.items()}, 0, args.png)
        print(f"wrote {args.png}")
    if args.html:
        from dmuon._cli.plan_commands import write_html
        from dmuon.sim._pages.sim_html import simulation_html

        hw_short = os.path.basename(args.hw) if args.hw.endswith(".json") else args.hw
        title = f"dmuon simulate: {args.model} on {plan.world_size * plan.tp_size:,} ranks of {hw_short}" + (
            f" ({args.mode.upper()})" if args.mode else ""
        )
        subtitle = (
            (f"mesh {R}x{N}" if R > 1 else f"mesh {N}")
            + f"{tp_note}{ep_note} · {args.tokens_per_rank:,} tokens/rank, seq {seq}, wire {param_dtype or 'fp32'}"
            + f" · {hw.name}"
        )
        write_html(
            args.html,
            simulation_html(sims, standalone=True, memory_nbytes=hw.memory_nbytes, title=title, subtitle=subtitle),
        )
    return 0
