"""``python -m dmuon simulate --pp K ...`` (the pipelined step) and ``python -m dmuon advise``.

``simulate`` takes this path when any of ``--pp K > 1``, ``--stages-per-rank``, ``--microbatches M >
1``, ``--schedule`` or ``--ac`` other than ``none`` is given: the model is split as torchtitan splits it
(:func:`dmuon.plan.compile_stages`), one dmuon plan per stage over ``--mesh`` (the stage's
data-parallel ranks; world = ``K x mesh x T``), and :func:`dmuon.sim.simulate_pipeline` prices the
schedule's bubble, the activation sends between stages, each stage's own step and every pipeline
rank's peak memory (in-flight micro-batches' activations included) against the device's.
``--tokens-per-rank`` stays the tokens of one data-parallel rank (one pipeline) per step, cut
into ``M`` micro-batches (default: one sequence each under PP, as torchtitan's micro-batch size 1;
one micro-batch without).

``advise`` searches the configurations of a preset on ``G`` GPUs (:func:`dmuon.sim.advise`):
there ``--tokens-per-rank`` is per GPU, so every configuration trains the same global batch.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from typing import Any

from dmuon.sim._pages.recommendation import fits, recommend

__all__ = ["add_pipeline_args", "wants_pipeline", "simulate_pipelined", "main_advise", "gap_line"]


def add_pipeline_args(parser: argparse.ArgumentParser) -> None:
    """``--pp``, ``--stages-per-rank``, ``--microbatches``, ``--schedule``, ``--ac``."""
    from dmuon.sim._engine.workload import AC_MODES
    from dmuon.sim._pipeline.pp_schedule import SCHEDULES

    g = parser.add_argument_group("pipeline parallelism and activation checkpointing (docs/pipeline_simulation.md)")
    g.add_argument("--pp", type=int, default=1, metavar="K", help="pipeline ranks (stages split as torchtitan does)")
    g.add_argument("--stages-per-rank", type=int, default=1, metavar="V", help="stages per pipeline rank")
    g.add_argument(
        "--microbatches",
        type=int,
        default=None,
        metavar="M",
        help="micro-batches per step (default: one sequence each under --pp, else 1)",
    )
    g.add_argument(
        "--schedule",
        choices=SCHEDULES,
        default=None,
        help="pipeline schedule (default: 1f1b, interleaved with --stages-per-rank > 1)",
    )
    g.add_argument(
        "--ac",
        choices=AC_MODES,
        default="none",
        help="activation checkpointing of every block: none, full (recompute the block), selective (torchtitan's "
        "per-op SAC: recompute elementwise work and every second matmul)",
    )


def wants_pipeline(args: argparse.Namespace) -> bool:
    """Whether ``simulate`` takes the pipelined path (module docstring)."""
    return (
        args.pp > 1
        or (args.microbatches or 1) > 1
        or args.ac != "none"
        or args.stages_per_rank > 1
        or args.schedule is not None
    )


def check_pipeline_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> tuple[int, int, str]:
    """``(seq_len, micro_batches, schedule)`` of the pipelined path, or one argparse error."""
    if args.pp < 1 or args.stages_per_rank < 1:
        parser.error("--pp and --stages-per-rank must be >= 1")
    if args.png or args.html:
        parser.error(
            "--png / --html with --pp, --microbatches or --ac: not drawn for a pipelined step yet (use --json)"
        )
    T = args.tokens_per_rank
    seq = args.seq_len or min(T, 8192)
    M = args.microbatches if args.microbatches is not None else (max(1, T // seq) if args.pp > 1 else 1)
    if M < 1 or T % M:
        parser.error(f"--microbatches {M} must be >= 1 and divide --tokens-per-rank ({T:,})")
    if seq > T // M:
        parser.error(f"--seq-len {seq} is longer than a micro-batch ({T // M:,} tokens): fewer --microbatches")
    schedule = args.schedule or ("interleaved" if args.stages_per_rank > 1 else "1f1b")
    if schedule == "interleaved" and args.stages_per_rank < 2:
        parser.error("--schedule interleaved needs --stages-per-rank V >= 2")
    if schedule != "interleaved" and args.stages_per_rank > 1:
        parser.error(f"--schedule {schedule} runs one stage per rank: give --schedule interleaved")
    if schedule == "interleaved" and M % max(1, M // args.pp):
        parser.error(f"--schedule interleaved: {M} micro-batches must be a multiple of the rounds ({M // args.pp})")
    return seq, M, schedule


def gap_line(sim: Any, base: Any) -> str:
    """``sim`` against ``base`` (FSDP2 + AdamW) on their critical ranks, by term, in ms."""
    a, b = sim.terms(), base.terms()
    delta = 1e3 * (sim.step_s - base.step_s)
    names = dict(bubble="bubble", exposed_comm="exposed communication", ns="Newton-Schulz", recompute="recompute")
    parts = [f"{names[k]} {1e3 * (a[k] - b[k]):+,.1f}" for k in names]
    parts.append(f"forward/backward/optimizer and hooks {1e3 * (a['compute'] - b['compute']):+,.1f}")
    return f"{sim.variant} - adamw = {delta:+,.1f} ms: " + ", ".join(parts)


def simulate_pipelined(
    parser: argparse.ArgumentParser,
    args: argparse.Namespace,
    model: Any,
    kw: dict,
    hw: Any,
    top_k: int,
    param_dtype: str | None,
    act_dtype: str,
) -> int:
    """The pipelined ``simulate`` (module docstring); prints the rows, returns 0."""
    from dmuon._cli.plan_commands import refusal_text, warnings_to_stderr
    from dmuon.plan._stage_plans import compile_stages
    from dmuon.sim._pipeline.pp_simulate import simulate_pipeline

    seq, M, schedule = check_pipeline_args(parser, args)
    try:
        with warnings_to_stderr():
            sp = compile_stages(
                model,
                args.mesh,
                pp=args.pp,
                stages_per_rank=args.stages_per_rank,
                reshard_after_forward=True,
                reuse_equal_stages=True,
                **kw,
            )
    except ValueError as exc:
        parser.error(f"{args.model} on --mesh {args.mesh} --pp {args.pp}: {refusal_text(exc)}")
    modes = [args.mode] if args.mode else ["z2", "z3"]
    try:
        sims = simulate_pipeline(
            sp,
            hw,
            tokens_per_rank=args.tokens_per_rank,
            seq_len=seq,
            micro_batches=M,
            schedule=schedule,
            ac=args.ac,
            variants=["adamw", *modes],
            activation_dtype=act_dtype,
            top_k=top_k,
        )
    except ValueError as exc:
        parser.error(str(exc))
    plan = sp.plans[0]
    R, N = plan.mesh_shape
    T = plan.tp_size
    dp = R * N
    base = sims["adamw"]
    mem = hw.memory_nbytes
    print(f"{args.model}: {sp.split.describe()}")
    print(
        f"{args.model} on PP {args.pp} x mesh {plan.mesh_shape}"
        + (f" x TP {T}" if T > 1 else "")
        + f" ({args.pp * dp * T} ranks)"
        + (f", EP {args.ep}" if args.ep > 1 else "")
        + f", {hw.name}; {args.tokens_per_rank:,} tokens per data-parallel rank per step (global batch "
        f"{args.tokens_per_rank * dp:,} tokens, seq {seq}), {M} micro-batch{'es' if M > 1 else ''} of "
        f"{args.tokens_per_rank // M:,} tokens, schedule {schedule}, AC {args.ac}; "
        f"wire {param_dtype or 'fp32'}"
    )
    print(
        "FSDP2 + AdamW baseline in the same layout"
        + (", reshard_after_forward=False under PP (torchtitan)" if args.pp > 1 else "")
    )
    if args.pp > 1:
        st = base.stages[0]
        print(
            f"activation send between stages: {st.send_nbytes / 1e6:,.1f} MB per micro-batch, "
            f"{1e3 * max(base.send_s):.2f} ms (ranks {dp * T} apart)"
        )
    hdr = (
        f"{'variant':<9}{'step ms':>10}{'x AdamW':>9}{'bubble ms':>11}{'exposed ms':>12}{'NS ms':>9}"
        f"{'recompute ms':>14}{'peak GiB':>10}{'device GiB':>12}{'fits':>6}  bound"
    )
    print(hdr)
    print("-" * len(hdr))
    for v, s in sims.items():
        peak = max(s.peak_memory_nbytes)
        fit = "yes" if fits(s, mem) else "NO"
        print(
            f"{v:<9}{1e3 * s.step_s:>10.1f}{s.step_s / base.step_s:>9.3f}{1e3 * s.bubble_s:>11.1f}"
            f"{1e3 * s.exposed_comm_s:>12.1f}{1e3 * s.ns_s:>9.1f}{1e3 * s.recompute_s:>14.1f}{peak / 2**30:>10.2f}"
            f"{mem / 2**30:>12.1f}{fit:>6}  {s.bound()}"
        )
    print(
        "\npeak GiB per pipeline rank: "
        + "; ".join(f"{v} " + " ".join(f"{x / 2**30:.1f}" for x in s.peak_memory_nbytes) for v, s in sims.items())
    )
    for v in modes:
        print(gap_line(sims[v], base))
    best, why = recommend({v: sims[v] for v in modes}, mem)
    print(f"recommended: dmuon {best.upper()} ({sims[best].step_s / base.step_s:.3f} x FSDP2 + AdamW): {why}")
    if not fits(sims[best], mem):  # recommend() prefers a mode that fits: none does
        print(
            f"warning: no dmuon mode fits the device ({mem / 2**30:.1f} GiB): more pipeline or shard ranks, "
            "activation checkpointing (--ac) or fewer tokens per rank"
        )
    if args.json:
        out = dict(
            model=args.model,
            pp=args.pp,
            stages_per_rank=args.stages_per_rank,
            split=[list(s) for s in sp.split.stages],
            split_method=sp.split.method,
            mesh=list(plan.mesh_shape),
            tp=T,
            ep=args.ep,
            hardware=hw.name,
            device_memory_nbytes=mem,
            tokens_per_rank=args.tokens_per_rank,
            global_batch_tokens=args.tokens_per_rank * dp,
            seq_len=seq,
            micro_batches=M,
            schedule=schedule,
            ac=args.ac,
            variants={
                v: dict(
                    step_ms=1e3 * s.step_s,
                    ratio_to_adamw=s.step_s / base.step_s,
                    bubble_ms=1e3 * s.bubble_s,
                    exposed_comm_ms=1e3 * s.exposed_comm_s,
                    ns_ms=1e3 * s.ns_s,
                    recompute_ms=1e3 * s.recompute_s,
                    peak_memory_nbytes=list(s.peak_memory_nbytes),
                    critical_pp_rank=s.critical_rank,
                    bound=s.bound(),
                )
                for v, s in sims.items()
            },
        )
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(out, f, indent=1)
            f.write("\n")
        print(f"wrote {args.json}")
    return 0


def main_advise(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m dmuon advise``. Returns 0."""
    from dmuon._zoo import PRESETS
    from dmuon.sim._engine import hardware as H
    from dmuon.sim._pipeline.advise_search import advise

    parser = argparse.ArgumentParser(
        prog="python -m dmuon advise",
        description="The fastest dmuon configurations of a preset on G GPUs that fit the device (no GPU needed): "
        "pp, tp, ep, replicate x shard, Z2/Z3, activation checkpointing and owner groups, filtered by an analytic "
        "memory check, ranked by an analytic step, the best simulated.",
    )
    parser.add_argument("--model", required=True, choices=sorted(PRESETS))
    parser.add_argument("--gpus", required=True, type=int, metavar="G")
    parser.add_argument("--hw", required=True, help=f"hardware preset {sorted(H.PRESETS)} or a calibration .json")
    parser.add_argument(
        "--tokens-per-rank",
        type=int,
        default=8192,
        metavar="T",
        help="tokens per GPU per step: the global batch is T x G for every configuration",
    )
    parser.add_argument("--seq-len", type=int, default=8192, help="tokens per sequence (one sequence per micro-batch)")
    parser.add_argument("--top", type=int, default=5, help="configurations to print")
    parser.add_argument("--simulate", type=int, default=10, metavar="S", help="about S configurations are simulated")
    parser.add_argument("--max-pp", type=int, default=32, help="largest pipeline degree searched")
    args = parser.parse_args(argv)
    for flag in ("gpus", "tokens_per_rank", "seq_len", "top", "simulate", "max_pp"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be >= 1")
    try:
        hw = H.preset(args.hw)
    except (ValueError, OSError) as exc:
        parser.error(f"--hw {args.hw!r}: not a preset {sorted(H.PRESETS)} nor a readable calibration record ({exc})")
    try:
        adv = advise(
            PRESETS[args.model],
            args.gpus,
            hw,
            tokens_per_rank=args.tokens_per_rank,
            seq_len=args.seq_len,
            name=args.model,
            top=args.top,
            simulate_configs=args.simulate,
            max_pp=args.max_pp,
        )
    except ValueError as exc:
        parser.error(str(exc))
    print(
        f"{args.model} on {args.gpus:,} GPUs of {hw.name} ({hw.memory_nbytes / 2**30:.0f} GiB); global batch "
        f"{args.tokens_per_rank * args.gpus:,} tokens ({args.tokens_per_rank:,} per GPU), seq {args.seq_len}; "
        f"searched in {adv.seconds:.1f} s ({adv.cpu_seconds:.1f} s CPU)"
    )
    hdr = f"{'#':<3}{'configuration':<78}{'step ms':>10}{'x AdamW':>9}{'peak GiB':>10}{'AdamW peak':>12}  bound"
    print(hdr)
    print("-" * len(hdr))
    for i, c in enumerate(adv.best, 1):
        print(
            f"{i:<3}{c.config.label():<78}{1e3 * c.step_s:>10.1f}{c.ratio:>9.3f}{c.simulated_peak_nbytes / 2**30:>10.2f}"
            f"{c.adamw_peak_nbytes / 2**30:>12.2f}  {c.bound}"
        )
    print(f"dropped: {adv.dropped_line()}")
    if adv.best:
        c = adv.best[0]
        per_dp = args.tokens_per_rank * c.config.pp * c.config.tp
        print(
            f"best as a simulate command: python -m dmuon simulate --model {args.model} --hw {args.hw} "
            f"--tokens-per-rank {per_dp} --seq-len {args.seq_len} {c.config.flags()}"
        )
    return 0
