"""Command line and process launcher of ``python -m dmuon train``.

Three ways in, one training function (:func:`dmuon._train.loop.train`):

* plain ``python -m dmuon train --nproc N``: spawns N local processes
  (:func:`dmuon._launch.run_distributed`, the package's one launcher), rendezvous on a free port
  of 127.0.0.1 via MASTER_ADDR/MASTER_PORT;
* ``torchrun ... -m dmuon train``: RANK / WORLD_SIZE / LOCAL_RANK / MASTER_* come from the
  environment and this process is one rank (``--nproc`` is ignored);
* :func:`run` called from a process whose default group is already initialised (tests): trains
  in that group, in this process.

Backend: gloo for ``--device cpu`` (default), nccl for ``--device cuda``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from dmuon._launch import free_port, run_distributed  # the package's one launcher

__all__ = ["OPTIMIZERS", "build_parser", "parse_args", "compare_list", "run", "main", "free_port"]

OPTIMIZERS = ("dmuon", "normuon", "adamw")
"""``--optimizer`` values: dmuon.Muon, dmuon.Muon(variant="normuon"), torch.optim.AdamW."""

_PG_TIMEOUT = datetime.timedelta(minutes=10)


def build_parser() -> argparse.ArgumentParser:
    """The ``train`` argument parser (all defaults: the main job on 2 CPU processes)."""
    from dmuon._cli.plan_commands import parse_owner_groups  # the one parser of off | auto | K

    p = argparse.ArgumentParser(
        prog="python -m dmuon train",
        description="Train a small byte-level GPT with dmuon.Muon (or the AdamW baseline) on "
        "FSDP2. Default: 2 local CPU processes (gloo) on the Python standard library's source.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    g = p.add_argument_group("processes")
    g.add_argument("--nproc", type=int, default=2, help="local processes to spawn (ignored under torchrun)")
    g.add_argument(
        "--device", choices=("cpu", "cuda"), default="cpu", help="cpu uses gloo, cuda uses nccl (one GPU per process)"
    )
    g.add_argument(
        "--mesh",
        default=None,
        metavar="N|RxN",
        help="data-parallel mesh: N (1-D, FSDP2) or RxN (HSDP: R replicate groups of N "
        "shards, dmuon owners over all R*N ranks); default: 1-D over the world",
    )
    g.add_argument(
        "--tp",
        type=int,
        default=1,
        metavar="T",
        help="tensor-parallel degree: q/k/v/up colwise, o/down rowwise over T ranks "
        "(world = T x data-parallel mesh); dmuon owners per TP group, Gram NS or gather",
    )
    g.add_argument(
        "--tp-ns",
        choices=("auto", "gram", "gather"),
        default="auto",
        help="with --tp: how owner TP groups run Newton-Schulz (auto: fewer bytes per matrix)",
    )
    g.add_argument(
        "--threads", type=int, default=1, help="torch intra-op threads per CPU rank (0 = leave torch's default)"
    )

    g = p.add_argument_group("optimisation")
    g.add_argument(
        "--optimizer",
        choices=OPTIMIZERS,
        default="dmuon",
        help="dmuon: dmuon.Muon (Muon on dedicated matrices, AdamW on the rest); "
        "normuon: dmuon.Muon(variant='normuon') (NorMuon, docs/muon_variants.md); "
        "adamw: torch.optim.AdamW on everything, no dedication",
    )
    g.add_argument(
        "--router-optimizer",
        choices=("muon", "adamw"),
        default="muon",
        help="with --experts: the MoE routers' optimizer under dmuon (dmuon.plan.ExpertPolicy(routers=...); "
        "docs/moe.md, 'Routers: Muon or AdamW')",
    )
    g.add_argument(
        "--mode",
        choices=("z2", "z3"),
        default="z3",
        help="z3: reshard_after_forward=True, z2: False (dmuon and FSDP2 alike)",
    )
    g.add_argument("--steps", type=int, default=500, help="optimizer steps")
    g.add_argument("--batch", type=int, default=32, help="GLOBAL batch in sequences (a multiple of the world size)")
    g.add_argument("--lr", type=float, default=0.02, help="Muon learning rate")
    g.add_argument("--weight-decay", type=float, default=0.0, help="Muon weight decay")
    g.add_argument(
        "--adamw-lr", type=float, default=3e-3, help="AdamW learning rate (non-dedicated params; every param for adamw)"
    )
    g.add_argument("--adamw-weight-decay", type=float, default=0.0, help="AdamW weight decay")
    g.add_argument(
        "--ns-dtype",
        choices=("auto", "bf16", "fp32"),
        default="auto",
        help="dtype of the Newton-Schulz iteration; auto: bf16 on cuda (as "
        "torch.optim.Muon), fp32 on cpu (CPU bf16 matmuls are several times slower)",
    )
    g.add_argument(
        "--qk-clip",
        type=float,
        default=None,
        metavar="TAU",
        help="QK-clip (MuonClip): after each step rescale W_q / W_k rows of heads whose max "
        "attention logit exceeded TAU (docs/muon_variants.md); logs clipped heads and the max logit",
    )
    g.add_argument(
        "--matrix-views",
        choices=("none", "per-head"),
        default="none",
        help="per-head: orthogonalise q/k/v row blocks and o_proj column blocks per head",
    )
    g.add_argument(
        "--owner-groups",
        type=parse_owner_groups,
        default="off",
        metavar="off|auto|K",
        help="owner groups (docs/owner_groups.md): 'auto' lets K shard ranks own a matrix as blocks "
        "where one owner per matrix cannot balance the mesh; K: every matrix gets K members",
    )
    g.add_argument("--warmup", type=int, default=0, help="linear LR warm-up steps")
    g.add_argument(
        "--cooldown-frac",
        type=float,
        default=0.2,
        help="fraction of the steps over which the LR decays linearly to 0 at the end",
    )
    g.add_argument("--seed", type=int, default=0, help="model init and batch sampling seed")

    g = p.add_argument_group("model")
    g.add_argument("--seq-len", type=int, default=64, help="tokens per sequence")
    g.add_argument("--d-model", type=int, default=128)
    g.add_argument("--n-layers", type=int, default=4)
    g.add_argument("--n-heads", type=int, default=4)
    g.add_argument("--d-mlp", type=int, default=512, help="MLP hidden width (each expert's with --experts)")
    g.add_argument(
        "--experts",
        type=int,
        default=0,
        metavar="E",
        help="Mixture-of-Experts MLP of E SwiGLU experts in every block (router 'gate', "
        "3-D stacks experts.w1/w3/w2, token-choice top-k); 0 = the dense MLP",
    )
    g.add_argument("--top-k", type=int, default=2, metavar="K", help="with --experts: experts per token")
    g.add_argument(
        "--ep",
        type=int,
        default=1,
        metavar="P",
        help="with --experts: expert parallelism over groups of P consecutive ranks; each rank holds "
        "E/P experts of every stack and routes token slots with all_to_all; dmuon owns them locally "
        "(docs/moe_ep.md); P must divide E, the world size and the mesh's shard dim N",
    )
    g.add_argument(
        "--aux-loss-coef",
        type=float,
        default=0.01,
        help="with --experts: weight of the Switch-style load-balancing loss added to the LM loss",
    )

    g = p.add_argument_group("data and output")
    g.add_argument(
        "--data",
        default=None,
        help="training text file (bytes are tokens); default: the embedded corpus "
        "(this Python's standard-library sources, 4 MiB)",
    )
    g.add_argument(
        "--val-fraction", type=float, default=0.1, help="the last fraction of the corpus is the validation split"
    )
    g.add_argument(
        "--eval-every", type=int, default=100, help="validate every N steps, at step 0 and at the end (0 = never)"
    )
    g.add_argument("--eval-batches", type=int, default=8, help="validation batches")
    g.add_argument("--eval-batch", type=int, default=32, help="GLOBAL validation batch in sequences")
    g.add_argument("--log-every", type=int, default=25, help="log the train loss every N steps")
    g.add_argument("--json", default=None, help="write the final metrics to this JSON file")
    g.add_argument("--quiet", action="store_true", help="no log lines and no progress bar")

    g = p.add_argument_group("checkpoints and comparison")
    g.add_argument(
        "--save",
        default=None,
        metavar="DIR",
        help="write sharded DCP checkpoints (model, optimizer, LR schedule, data "
        "position, RNG) to DIR/step_XXXXXXXX every --save-every steps and at the end",
    )
    g.add_argument(
        "--save-every",
        type=int,
        default=100,
        metavar="K",
        help="with --save: checkpoint every K steps (and after the last step)",
    )
    g.add_argument(
        "--resume",
        default=None,
        metavar="DIR",
        help="continue the run saved in DIR (its newest step_* folder, or one "
        "checkpoint folder); any mesh and world size; the run-defining flags must match",
    )
    g.add_argument(
        "--compare",
        default=None,
        metavar="OPT[,OPT...]",
        help="after the run, train each listed optimizer (dmuon, normuon, adamw; comma-separated, "
        "e.g. normuon,adamw) on the same data, seed and model and report them all "
        "(adamw: --adamw-lr on every parameter, without --ep)",
    )
    g.add_argument(
        "--png",
        default=None,
        metavar="FILE",
        help="plot validation loss vs step and vs training wall time (every run of "
        "--compare in one figure) to FILE; needs matplotlib: pip install -e '.[train]'",
    )
    return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse ``train`` flags (``argv`` None = no flags, i.e. all defaults) and validate them."""
    args = build_parser().parse_args([] if argv is None else list(argv))
    _validate(args)
    return args


def _validate(args: argparse.Namespace) -> None:
    """Checks argparse cannot make for values set through :func:`run`'s mapping form."""
    for action in build_parser()._actions:
        value = getattr(args, action.dest, None)
        if (
            action.choices is not None
            and value not in action.choices
            and not (
                value is None and action.default is None  # an optional choice left unset
            )
        ):
            raise SystemExit(
                f"--{action.dest.replace('_', '-')} must be one of {sorted(action.choices)}, got {value!r}"
            )
    for name in (
        "nproc",
        "tp",
        "ep",
        "steps",
        "batch",
        "seq_len",
        "eval_batches",
        "eval_batch",
        "log_every",
        "save_every",
    ):
        if getattr(args, name) <= 0:
            raise SystemExit(f"--{name.replace('_', '-')} must be positive")
    if args.experts < 0 or (args.experts and not 1 <= args.top_k <= args.experts):
        raise SystemExit(
            f"--experts must be >= 0 and --top-k in [1, --experts], got --experts {args.experts} "
            f"--top-k {args.top_k}"
            + (" (--top-k defaults to 2: with one expert pass --top-k 1)" if args.experts == 1 else "")
        )
    if args.aux_loss_coef < 0:
        raise SystemExit(f"--aux-loss-coef must be >= 0, got {args.aux_loss_coef}")
    if args.ep > 1:
        if not args.experts:
            raise SystemExit(
                f"--ep {args.ep} needs --experts E: expert parallelism splits the MoE's experts over ranks"
            )
        if args.experts % args.ep:
            raise SystemExit(f"--ep {args.ep} must divide --experts {args.experts} (each rank holds E/P experts)")
        if args.tp > 1:
            raise SystemExit("--ep with --tp: expert parallelism together with tensor parallelism is not supported")
        if args.optimizer == "adamw":
            raise SystemExit(
                f"--ep with --optimizer {args.optimizer}: expert parallelism needs dmuon, which owns and "
                "averages the local experts (--compare adamw runs its baseline without --ep)"
            )
    if args.experts and args.tp > 1:
        raise SystemExit("--experts with --tp: tensor parallelism of the MoE model is not supported")
    if args.qk_clip is not None and not args.qk_clip > 0:
        raise SystemExit(f"--qk-clip must be a positive threshold, got {args.qk_clip}")
    if args.eval_every < 0 or args.warmup < 0 or not 0.0 <= args.cooldown_frac <= 1.0:
        raise SystemExit("--eval-every and --warmup must be >= 0, --cooldown-frac in [0, 1]")
    if args.tp > 1 and args.owner_groups not in ("off", 1):
        raise SystemExit(
            "--owner-groups with --tp: owner groups are not supported with tensor parallelism "
            "(leave --owner-groups off)"
        )
    compared = compare_list(args)  # SystemExit on a bad --compare
    args.compare = compared or None  # the names, in order: what the training loop runs
    if "normuon" in (args.optimizer, *compared) and (args.tp > 1 or args.owner_groups not in ("off", 1)):
        raise SystemExit(
            "--optimizer normuon with --tp or --owner-groups: NorMuon runs on matrices whose owner holds "
            "them whole (docs/muon_variants.md, 'NorMuon'); leave --tp 1 and --owner-groups off"
        )
    if args.lr < 0 or args.adamw_lr < 0:
        raise SystemExit(f"--lr and --adamw-lr must be >= 0, got --lr {args.lr} --adamw-lr {args.adamw_lr}")
    if args.router_optimizer != "muon" and not args.experts:
        raise SystemExit(f"--router-optimizer {args.router_optimizer} needs --experts E: a dense model has no router")
    _check_paths(args)
    if args.png:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise SystemExit("--png needs matplotlib: pip install -e '.[train]'") from None
        if args.eval_every == 0:
            raise SystemExit("--png plots validation loss: --eval-every must be > 0")


def _check_paths(args: argparse.Namespace) -> None:
    """Before any rank starts: ``--data`` is a file long enough for ``--seq-len`` (the split rule
    of :func:`dmuon._train.data.split_val_tokens`; one byte = one token), and the folders that
    ``--json`` / ``--png`` write into and ``--save`` creates exist and are writable, so no run
    trains to its end and then fails on an output path (``--save`` is created here)."""
    from pathlib import Path

    from dmuon._train.data import DEFAULT_CORPUS_NBYTES, split_val_tokens

    if args.data is not None:
        path = Path(args.data)
        if not path.is_file():
            raise SystemExit(
                f"--data {args.data}: not a file (pass a text file; without --data the job trains on "
                "the Python standard library's sources)"
            )
        if not os.access(path, os.R_OK):
            raise SystemExit(f"--data {args.data}: not readable")
        n = path.stat().st_size
    else:
        n = DEFAULT_CORPUS_NBYTES  # the stdlib corpus is at most this long
    try:
        split_val_tokens(n, args.seq_len, args.val_fraction)
    except ValueError as exc:
        raise SystemExit(
            f"--data {args.data or '(python stdlib sources)'} with --seq-len {args.seq_len}: {exc}"
        ) from None
    for flag, target in (("--json", args.json), ("--png", args.png)):
        if target is None:
            continue
        folder = Path(target).parent
        if not folder.is_dir() or not os.access(folder, os.W_OK):
            raise SystemExit(f"{flag} {target}: the folder {str(folder)!r} does not exist or is not writable")
    if args.save is not None:  # created now (the run would create it at its first save)
        try:
            Path(args.save).mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise SystemExit(f"--save {args.save}: cannot create the folder ({exc.strerror or exc})") from None
        if not os.access(args.save, os.W_OK):
            raise SystemExit(f"--save {args.save}: the folder is not writable")


def compare_list(args: argparse.Namespace) -> tuple[str, ...]:
    """The optimizers of ``--compare`` (``"normuon,adamw"`` -> ``("normuon", "adamw")``; a list or
    tuple is taken as is), in order; ``()`` without it.

    Raises:
        SystemExit: an unknown name, a duplicate, or the run's own ``--optimizer``.
    """
    value = getattr(args, "compare", None)
    if not value:
        return ()
    names = tuple(x.strip() for x in value.split(",")) if isinstance(value, str) else tuple(value)
    for name in names:
        if name not in OPTIMIZERS:
            raise SystemExit(f"--compare: unknown optimizer {name!r}; expected a comma-separated list of {OPTIMIZERS}")
    if len(set(names)) != len(names) or args.optimizer in names:
        raise SystemExit(
            f"--compare {value}: list each optimizer once, and not the run's own --optimizer {args.optimizer}"
        )
    return names


def _complete(args: argparse.Namespace | Mapping[str, Any]) -> argparse.Namespace:
    """Defaults overlaid with ``args`` (a Namespace or a mapping of flag dests, e.g.
    ``{"steps": 30, "optimizer": "adamw"}``); unknown names raise TypeError."""
    full = parse_args([])
    given = vars(args) if isinstance(args, argparse.Namespace) else dict(args)
    unknown = sorted(set(given) - set(vars(full)))
    if unknown:
        raise TypeError(f"unknown train options: {unknown}")
    for k, v in given.items():
        setattr(full, k, v)
    _validate(full)
    return full


def _backend(args: argparse.Namespace) -> str:
    return "nccl" if args.device == "cuda" else "gloo"


def _rank_body(args: argparse.Namespace) -> str | None:
    """One spawned rank (in the group :func:`dmuon._launch.run_distributed` set up): train;
    rank 0 returns the metrics as JSON (the caller reads them back as the JSON file they were)."""
    from dmuon._train.loop import run_job as train

    metrics = train(args)
    return json.dumps(metrics) if dist.get_rank() == 0 else None


def _under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def run(args: argparse.Namespace | Mapping[str, Any]) -> dict[str, Any]:
    """Train and return the metrics dict of :func:`dmuon._train.loop.train` (rank 0's).

    * default group already initialised: train in it, in this process (every rank calls run);
    * under torchrun (RANK and WORLD_SIZE set): initialise from the environment, train,
      tear down;
    * otherwise: spawn ``args.nproc`` local processes (:func:`dmuon._launch.run_distributed`)
      and wait for them; an exception in any rank terminates the others and is raised here as
      :class:`dmuon._launch.DistributedError` with that rank's traceback, a ``SystemExit`` (a
      user error) as this process's ``SystemExit`` with the rank's one-line message.
    """
    from dmuon._train.loop import run_job as train

    args = _complete(args)
    if dist.is_initialized():
        return train(args)
    if _under_torchrun():
        dist.init_process_group(_backend(args), timeout=_PG_TIMEOUT)
        try:
            metrics = train(args)
            # every rank done before any tears the group down: a rank still in gloo when a peer
            # destroys the group can abort ("terminate called without an active exception")
            dist.barrier()
            return metrics
        finally:
            dist.destroy_process_group()
    from dmuon._train.loop import parse_mesh

    if args.nproc % args.tp:
        raise SystemExit(f"--nproc {args.nproc} must be a multiple of --tp {args.tp}")
    dp = args.nproc // args.tp
    if args.nproc % args.ep:
        raise SystemExit(f"--ep {args.ep} must divide the world size {args.nproc} (--nproc)")
    shape = parse_mesh(args.mesh, dp)  # a bad --mesh fails here, before any process starts
    if shape[-1] % args.ep:  # EP groups are P consecutive shard ranks of one replicate row
        raise SystemExit(
            f"--ep {args.ep} must divide the mesh's shard dim N = {shape[-1]} (--mesh {args.mesh}): EP groups are "
            f"P consecutive shard ranks of one replicate group"
        )
    if args.batch % dp or args.eval_batch % dp:
        raise SystemExit(
            f"--batch {args.batch} and --eval-batch {args.eval_batch} must be multiples of the "
            f"data-parallel size {dp} (--nproc / --tp)"
        )
    if args.n_heads % args.tp or args.d_mlp % args.tp:
        raise SystemExit(f"--tp {args.tp} must divide --n-heads {args.n_heads} and --d-mlp {args.d_mlp}")
    if args.device == "cuda" and args.nproc > torch.cuda.device_count():
        raise SystemExit(f"--nproc {args.nproc} > {torch.cuda.device_count()} visible GPUs")
    # A rank that ends in SystemExit (a user error, e.g. --resume of a folder without a
    # checkpoint) is raised here as this process's SystemExit with its one-line message; any
    # other failure (a bug) raises DistributedError with that rank's traceback.
    (metrics, *_) = run_distributed(
        _rank_body,
        args.nproc,
        args,
        timeout_s=None,
        backend=_backend(args),
        threads=0,
        group_timeout_s=_PG_TIMEOUT.total_seconds(),
        system_exit=True,
    )
    return json.loads(metrics)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m dmuon train [flags]``; returns the exit status."""
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if _under_torchrun() and int(os.environ["WORLD_SIZE"]) != args.nproc:
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"torchrun world size {os.environ['WORLD_SIZE']} overrides --nproc {args.nproc}", flush=True)
    run(args)
    return 0
