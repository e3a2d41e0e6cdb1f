"""Command-line entry points for ``python -m dmuon plan`` and ``python -m dmuon diff``.

``dmuon/__main__.py`` dispatches the ``plan`` and ``diff`` subcommands here with the remaining
arguments. Both functions return a process exit status instead of calling ``sys.exit``.

Examples::

    python -m dmuon plan --model llama3-8b --mesh 8
    python -m dmuon plan --model llama3-70b --mesh 2x8 --z2 --cost-model ns_flops --json p.json
    python -m dmuon plan --model llama3-8b --mesh 2x4 --schedule 5   # rank 5's whole step
    python -m dmuon diff a.json b.json
    python -m dmuon plan --model qwen3-30b-a3b --mesh 64 --html plan.html    # the plan's page
    python -m dmuon plan --model llama3-70b --mesh 8 --pp 4 --z2    # one plan per pipeline stage
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import warnings
from collections.abc import Iterator, Sequence
from types import SimpleNamespace

from dmuon.plan._tools.diff import diff
from dmuon.plan._compile import compile
from dmuon.plan._stage_plans import compile_stages
from dmuon.plan._records.mesh import parse_mesh_text
from dmuon.plan._records.plan import ShardingPlan
from dmuon.plan._model.parallel import expert_parallel_variant, megatron_tp_shard_dims
from dmuon.plan._records.policies import ExpertPolicy, TPPolicy
from dmuon._zoo import PRESETS
from dmuon.plan._model.selection import matrix_predicate

__all__ = [
    "main_plan",
    "main_diff",
    "parse_mesh",
    "add_selection_args",
    "check_selection_args",
    "selection_kwargs",
    "warnings_to_stderr",
    "write_html",
    "page_title",
]


@contextlib.contextmanager
def warnings_to_stderr() -> Iterator[None]:
    """Collect the warnings raised inside (``dmuon.plan.compile``'s coverage and stack warnings)
    and print each distinct message once, as a ``warning: ...`` line on stderr, when the block
    ends, instead of Python's ``file:line: UserWarning: ...`` form (a CLI user did not write
    that line)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            yield
        finally:
            messages = list(dict.fromkeys(str(w.message) for w in caught))  # distinct, in order
    for message in messages:
        print(f"warning: {message}", file=sys.stderr)


#: lines of a plan-compile refusal the CLIs print (a TP refusal names every parameter it refuses)
ERROR_LINES = 6


def refusal_text(exc: Exception) -> str:
    """A plan-compile refusal cut to its first :data:`ERROR_LINES` lines, and its last line where
    that is the fix (``plan`` and ``simulate``)."""
    lines = str(exc).splitlines()
    if len(lines) <= ERROR_LINES:
        return "\n".join(lines)
    fix = lines[-1] if lines[-1].startswith("Fix") else None
    cut = len(lines) - ERROR_LINES - (fix is not None)
    return "\n".join(lines[:ERROR_LINES] + [f"  ... ({cut} more lines)"] + ([fix] if fix else []))


def parse_owner_groups(text: str):
    """``--owner-groups``: ``off`` / ``auto`` or an int K >= 1."""
    if text in ("off", "auto"):
        return text
    try:
        k = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected off, auto or an int K >= 1, got {text!r}") from None
    if k < 1:
        raise argparse.ArgumentTypeError(f"K must be >= 1, got {k}")
    return k


def parse_mesh(text: str) -> int | tuple[int, int]:
    """``"8"`` -> ``8``; ``"2x8"`` -> ``(2, 8)`` (R replicate x N shard).

    Raises:
        argparse.ArgumentTypeError: anything else.
    """
    try:
        dims = parse_mesh_text(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return dims[0] if len(dims) == 1 else (dims[0], dims[1])


def dtype_arg(value: str) -> str:
    """``value`` unchanged if it names a dtype dmuon's buffers carry (the plan normalises it),
    else an argparse error."""
    from dmuon.plan._records.fields import WIRE_DTYPES, wire_dtype_str

    try:
        wire_dtype_str(value, "dtype")
        return value
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{value!r} is not a floating-point torch dtype dmuon's buffers carry "
            f"({', '.join(d[len('torch.') :] for d in WIRE_DTYPES)})"
        ) from None


def add_selection_args(parser: argparse.ArgumentParser, *, cost_model_default: str = "numel") -> None:
    """The options that choose what a plan dedicates and how (shared by ``python -m dmuon plan``
    and ``python -m dmuon simulate``, so both accept the same ones): ``--cost-model``,
    ``--param-dtype``, ``--reduce-dtype``, ``--all-matrices``, ``--experts``,
    ``--expert-gate-up``, ``--tp``, ``--tp-ns``, ``--owner-groups``, ``--collectives``. Read them with
    :func:`check_selection_args` and :func:`selection_kwargs`."""
    g = parser.add_argument_group("plan selection (the same for plan and simulate)")
    g.add_argument(
        "--cost-model",
        default=cost_model_default,
        choices=("numel", "ns_flops"),
        help="LPT weight of the owner assignment",
    )
    g.add_argument(
        "--param-dtype", default=None, type=dtype_arg, help="mixed-precision broadcast (wire) dtype, e.g. bfloat16"
    )
    g.add_argument("--reduce-dtype", default=None, type=dtype_arg, help="mixed-precision reduce dtype, e.g. float32")
    g.add_argument(
        "--all-matrices",
        action="store_true",
        help="also dedicate conv weights and every 3-D parameter (default: 2-D matrices and recognised expert stacks)",
    )
    g.add_argument(
        "--experts",
        default="auto",
        choices=("auto", "off"),
        help="expert stacks: 'auto' (dedicated, one owner per range of experts) or 'off' (the selection "
        "before expert support: 2-D only); docs/moe.md",
    )
    g.add_argument(
        "--expert-gate-up",
        default="split",
        choices=("split", "fused"),
        help="a fused gate/up expert: two Muon matrices (split) or one (fused)",
    )
    g.add_argument(
        "--tp",
        type=int,
        default=1,
        metavar="T",
        help="tensor-parallel degree: Megatron-style colwise q/k/v/gate/up, rowwise o/down (world = mesh x T)",
    )
    g.add_argument("--tp-ns", default="auto", choices=("auto", "gram", "gather"), help="TP Newton-Schulz method")
    g.add_argument(
        "--owner-groups",
        default="off",
        type=parse_owner_groups,
        metavar="off|auto|K",
        help="owner groups: 'off' (one owner per matrix), 'auto' (groups where one owner per matrix cannot "
        "balance the mesh) or K (every matrix that can be cut gets K members); docs/owner_groups.md",
    )
    g.add_argument(
        "--collectives",
        default="auto",
        choices=("auto", "broadcast", "all_gather"),
        help="each buffer's parameter-phase collective: one broadcast per owner segment (gradient: reduce), "
        "one all-gather of equal slots (gradient: reduce-scatter), or per buffer by the cost rule "
        "(auto); docs/planning.md",
    )


def check_selection_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The combinations :func:`add_selection_args`' options refuse, as argparse errors."""
    if args.tp < 1:
        parser.error("--tp must be >= 1")
    if args.tp > 1 and args.owner_groups not in ("off", 1):
        parser.error("--owner-groups with --tp: owner groups are not supported with tensor parallelism (use off)")
    if args.experts == "off" and args.expert_gate_up != "split":
        parser.error(
            "--expert-gate-up with --experts off: the stacks stay with AdamW, there is no gate/up to keep fused "
            "(--all-matrices --experts off dedicates each stack as one unit)"
        )


def tp_degree_error(model, tp: int) -> str | None:
    """Why ``--tp`` cannot shard ``model`` (a width a Megatron-style TP plan splits is not a multiple
    of it), with the degrees that would; ``None`` when it can."""
    if tp <= 1:
        return None
    shapes = dict(model.named_parameters())
    dims = megatron_tp_shard_dims(model)
    widths = sorted({shapes[fqn].shape[d] for fqn, d in dims.items()})
    bad = [w for w in widths if w % tp]
    if not bad:
        return None
    fits = [t for t in (2, 4, 8, 16, 32, 64) if all(w % t == 0 for w in widths)]
    return (
        f"--tp {tp} does not divide the widths tensor parallelism splits ({', '.join(map(str, bad))}); "
        f"use --tp {' or '.join(map(str, fits)) if fits else '1'}"
    )


def selection_kwargs(args: argparse.Namespace, model, mesh, *, param_dtype=None, reduce_dtype=None) -> dict:
    """``dmuon.plan.compile`` keyword arguments of :func:`add_selection_args`' options for
    ``model`` on ``mesh``; ``param_dtype`` / ``reduce_dtype``: defaults for the dtype options."""
    pred = matrix_predicate(model) if args.all_matrices else None
    kw: dict = dict(
        predicate=pred,
        cost_model=args.cost_model,
        owner_groups=args.owner_groups,
        experts=args.experts,
        expert_policy=ExpertPolicy(gate_up=args.expert_gate_up),
        collectives=args.collectives,
    )
    if args.tp > 1:
        dedicated = set(compile(model, mesh, predicate=pred, experts=args.experts).dedicated)
        dims = {k: v for k, v in megatron_tp_shard_dims(model).items() if k in dedicated}
        kw["tp"] = TPPolicy(size=args.tp, shard_dims=dims, ns=args.tp_ns)
    param_dtype = args.param_dtype or param_dtype
    reduce_dtype = args.reduce_dtype or reduce_dtype
    kw["mp_policy"] = (
        SimpleNamespace(param_dtype=param_dtype, reduce_dtype=reduce_dtype) if (param_dtype or reduce_dtype) else None
    )
    return kw


def main_plan(argv: Sequence[str] | None = None) -> int:
    """Compile a preset model's plan, print ``plan.summary()``, optionally write JSON. Returns 0."""
    parser = argparse.ArgumentParser(
        prog="python -m dmuon plan",
        description="Plan DMuon owners/boundaries/layouts for a preset model (meta device, no GPU).",
    )
    parser.add_argument("--model", required=True, choices=sorted(PRESETS), help="preset model shape")
    parser.add_argument("--mesh", required=True, type=parse_mesh, help="N (1-D) or RxN (HSDP), e.g. 8 or 2x8")
    parser.add_argument("--z2", action="store_true", help="reshard_after_forward=False (DMuon-Z2)")
    parser.add_argument(
        "--offload",
        action="store_true",
        help="the summary's memory under CPU offload (dedicate_params and fully_shard given CPUOffloadPolicy): "
        "device terms and host memory per rank, dmuon and both FSDP2 baselines; docs/planning.md",
    )
    parser.add_argument(
        "--ep",
        type=int,
        default=1,
        metavar="K",
        help="expert parallelism: plan the preset as one rank of ep = K holds it (each stack's E/K experts; "
        "K must divide the shard ranks and the experts); docs/moe_ep.md",
    )
    parser.add_argument(
        "--pp",
        type=int,
        default=1,
        metavar="K",
        help="pipeline parallelism: split the preset into K stages as torchtitan does (the embedding and the head "
        "count as one layer each) and print one plan per stage, each over --mesh (the stage's data-parallel "
        "ranks; world = K x mesh x T); docs/pipeline_simulation.md",
    )
    parser.add_argument(
        "--stages-per-rank",
        type=int,
        default=1,
        metavar="V",
        help="with --pp: stages per pipeline rank (K x V stages; rank r holds r, r + K, ...: Interleaved1F1B)",
    )
    add_selection_args(parser)
    parser.add_argument(
        "--json",
        metavar="FILE",
        default=None,
        help="write the plan as JSON to FILE (with --pp: one file per stage, FILE with .stageS before .json)",
    )
    parser.add_argument(
        "--html",
        metavar="FILE",
        default=None,
        help="write the plan's page to FILE (plan.to_html(): ownership map, per-rank bars, bytes; docs/planning.md; "
        "with --pp: the split and one plan per stage on one page)",
    )
    parser.add_argument(
        "--schedule",
        type=int,
        default=None,
        metavar="RANK",
        help="print RANK's ops of the nominal step (schedule rank: mesh rank, x T + tp with TP) instead of the summary",
    )
    args = parser.parse_args(argv)
    check_selection_args(parser, args)
    for flag, path in (("--json", args.json), ("--html", args.html)):
        if path and not os.path.isdir(os.path.dirname(os.path.abspath(path))):
            parser.error(f"{flag}: the folder of {path!r} does not exist")
    if args.pp < 1 or args.stages_per_rank < 1:
        parser.error("--pp and --stages-per-rank must be >= 1")
    if args.stages_per_rank > 1 and args.pp == 1:
        parser.error("--stages-per-rank needs --pp K > 1")
    if args.pp > 1 and args.schedule is not None:
        parser.error(
            "--schedule with --pp: not per stage yet; plan one stage with dmuon.plan.compile_stages(...).plans[s]"
        )

    model = PRESETS[args.model]()
    tp_error = tp_degree_error(model, args.tp)
    if tp_error:
        parser.error(tp_error)
    kw = selection_kwargs(args, model, args.mesh)
    if args.ep != 1:
        try:
            model = expert_parallel_variant(model, args.ep)
        except ValueError as exc:
            parser.error(f"--ep {args.ep}: {exc}")
        kw["ep"] = args.ep
    try:
        with warnings_to_stderr():
            if args.pp > 1:
                return _print_stages(args, model, kw)
            plan = compile(model, args.mesh, reshard_after_forward=not args.z2, **kw)
    except ValueError as exc:  # the plan refuses this mesh / TP degree / EP degree / owner groups / split
        flags = (
            f"--mesh {args.mesh}"
            + (f" --tp {args.tp}" if args.tp > 1 else "")
            + (f" --ep {args.ep}" if args.ep > 1 else "")
            + (f" --pp {args.pp}" if args.pp > 1 else "")
            + (f" --stages-per-rank {args.stages_per_rank}" if args.stages_per_rank > 1 else "")
        )
        parser.error(f"{args.model} on {flags}: {refusal_text(exc)}")
    if args.schedule is not None:
        sched = plan.schedule()
        if not 0 <= args.schedule < sched.num_ranks:
            parser.error(f"--schedule: rank {args.schedule} is not in 0..{sched.num_ranks - 1}")
        ops = sched.rank_ops(args.schedule)
        print(
            f"{args.model} on mesh {plan.mesh_shape} (T={plan.tp_size}), "
            f"{'Z3' if plan.reshard_after_forward else 'Z2'}: rank {args.schedule}, {len(ops):,} ops, "
            f"{sched.rank_nbytes(args.schedule):,} B charged per step"
        )
        print(sched.summary(args.schedule))
    else:
        print(_summary(parser, plan, args.offload))
    if args.json:
        with open(args.json, "w", encoding="ascii") as f:
            f.write(plan.to_json(indent=1))
            f.write("\n")
        print(f"\nwrote {args.json} (fingerprint {plan.fingerprint()[:12]})")
    if args.html:
        from dmuon.plan._tools.html.plan_page import plan_html

        title, subtitle = page_title(args, plan)
        write_html(args.html, plan_html(plan, standalone=True, title=title, subtitle=subtitle))
    return 0


def _summary(parser: argparse.ArgumentParser | None, plan, offload: bool) -> str:
    """``plan.summary(offload=...)``; a plan the runtime cannot offload (TP, owner groups, NorMuon,
    EP-local stacks) is a usage error of ``--offload``."""
    try:
        return plan.summary(offload=offload)
    except (NotImplementedError, ValueError) as exc:
        if not offload:
            raise
        if parser is None:
            raise SystemExit(f"python -m dmuon plan: error: --offload: {exc}") from None
        parser.error(f"--offload: {exc}")


def page_title(args: argparse.Namespace, plan, *, command: str = "plan", pp: int = 1) -> tuple[str, str]:
    """The heading of a ``--html`` page: what was run (``dmuon plan: qwen3-30b-a3b on 64 ranks (Z3)``),
    and a line with the mesh, its roles and the plan's settings."""
    ranks = plan.world_size * plan.tp_size * pp
    mode = "Z3" if plan.reshard_after_forward else "Z2"
    title = f"dmuon {command}: {args.model} on {ranks:,} ranks ({mode})"
    R, N = plan.mesh_shape
    parts = [f"mesh {R}x{N}" if R > 1 else f"mesh {N}"]
    if plan.tp_size > 1:
        parts.append(f"TP {plan.tp_size}")
    if getattr(args, "ep", 1) > 1:
        parts.append(f"EP {args.ep}")
    if pp > 1:
        parts.append(f"{pp} pipeline ranks")
    parts.append(f"cost model {plan.cost_model}")
    return title, " · ".join(parts)


def _print_stages(args: argparse.Namespace, model, kw: dict) -> int:
    """``plan --pp``: the split (which rule, which layers per stage), then each stage's plan
    summary; ``--json``: one file per stage; ``--html``: one page, the split and every stage's plan."""
    sp = compile_stages(
        model, args.mesh, pp=args.pp, stages_per_rank=args.stages_per_rank, reshard_after_forward=not args.z2, **kw
    )
    print(f"{args.model}: {sp.split.describe()}")
    for s, plan in enumerate(sp.plans):
        print(f"\n=== stage {s} of {sp.split.num_stages} (pp rank {s % sp.split.pp_size}) ===")
        print(_summary(None, plan, args.offload))
    if args.json:
        root, ext = os.path.splitext(args.json)
        for s, plan in enumerate(sp.plans):
            path = f"{root}.stage{s}{ext or '.json'}"
            with open(path, "w", encoding="ascii") as f:
                f.write(plan.to_json(indent=1))
                f.write("\n")
            print(f"wrote {path} (fingerprint {plan.fingerprint()[:12]})")
    if args.html:
        from dmuon.plan._tools.html.stages_page import stages_html

        title, subtitle = page_title(args, sp.plans[0], pp=sp.split.pp_size)
        subtitle += f" · {sp.split.num_stages} stages"
        write_html(args.html, stages_html(sp, standalone=True, title=title, subtitle=subtitle))
    return 0


def write_html(path: str, text: str) -> None:
    """Write a page (``--html FILE``) and say so."""
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    print(f"wrote {path} ({len(text.encode('utf-8')):,} bytes)")


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def main_diff(argv: Sequence[str] | None = None) -> int:
    """Print ``dmuon.plan.diff(a, b)`` of two plan JSON files. Returns 0 (with ``--exit-code``:
    1 if the plans differ)."""
    parser = argparse.ArgumentParser(
        prog="python -m dmuon diff",
        description="Compare two plan JSON files (written by `python -m dmuon plan --json`) by FQN.",
    )
    parser.add_argument("a", help="plan JSON (before)")
    parser.add_argument("b", help="plan JSON (after)")
    parser.add_argument("--exit-code", action="store_true", help="exit 1 when the plans differ")
    parser.add_argument("--max-lines", type=_non_negative_int, default=40, help="per-parameter lines to print")
    parser.add_argument(
        "--html",
        metavar="FILE",
        default=None,
        help="write the diff's page to FILE (both ownership maps, changes outlined; docs/planning.md)",
    )
    args = parser.parse_args(argv)
    if args.html and not os.path.isdir(os.path.dirname(os.path.abspath(args.html))):
        parser.error(f"--html: the folder of {args.html!r} does not exist")
    plans = []
    for path in (args.a, args.b):
        try:
            with open(path, encoding="ascii") as f:
                plans.append(ShardingPlan.from_json(f.read()))
        except OSError as exc:
            parser.error(f"{path}: cannot read it ({exc.strerror or exc})")
        except (ValueError, TypeError, KeyError) as exc:  # not JSON, not a plan, or a plan that fails validation
            parser.error(
                f"{path}: not a dmuon plan JSON (python -m dmuon plan --json FILE writes one): "
                f"{type(exc).__name__}: {exc}"
            )
    d = diff(plans[0], plans[1])
    print(d.render(max_lines=args.max_lines))
    if args.html:
        write_html(args.html, d.to_html())
    return 1 if (args.exit_code and d) else 0


if __name__ == "__main__":  # pragma: no cover - convenience: python -m dmuon._cli.plan_commands plan ...
    cmd, *rest = sys.argv[1:] or ["plan"]
    sys.exit(main_diff(rest) if cmd == "diff" else main_plan(rest))
