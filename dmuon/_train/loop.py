"""The training loop of ``python -m dmuon train``, run by every rank of an initialised group.

The set-up it runs (the README's three lines), the baseline and one step: Note: the main job's
loop (docs/design.md).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from typing import Any

import torch
import torch.distributed as dist

import dmuon.exec
from dmuon.plan import ByteCost, parse_mesh_text
from dmuon._train.checkpoint import load_checkpoint, run_flags, save_checkpoint
from dmuon._train.data import VOCAB_SIZE, Corpus, load_corpus
from dmuon._train.progress import progress_bar, progress_note, write_line
from dmuon._train.byte_gpt import GPT, GPTConfig, apply_tensor_parallel, lm_loss

__all__ = ["LEDGER_PHASES", "train", "run_job", "lr_factor", "model_config", "expert_share_stats"]

_DMUON_OPTIMIZERS = ("dmuon", "normuon")  # --optimizer values that train with dmuon.Muon

LEDGER_PHASES = dmuon.exec.Ledger.PHASES
"""Ledger phases, in the order of the per-step byte vector (``dmuon.exec.Ledger.PHASES``):
the phases of ``plan.cost`` first, in ``ByteCost.PHASES`` order ("tp": tensor-parallel Gram
all-reduces and gathers), then "other", which collects any other phase the ledger reports (not
part of the plan)."""

_PLAN_PHASES = tuple(name.removesuffix("_nbytes") for name in ByteCost.PHASES)
assert LEDGER_PHASES[: len(_PLAN_PHASES)] == _PLAN_PHASES, "ledger phases must start with the plan's"


def parse_mesh(text: str | None, world: int) -> tuple[int, ...]:
    """``None`` -> ``(world,)``; ``"N"`` -> ``(N,)``; ``"RxN"`` -> ``(R, N)``; product must be ``world``."""
    if text is None:
        return (world,)
    try:
        shape = parse_mesh_text(text)
    except ValueError:
        raise SystemExit(f"--mesh must be N or RxN, got {text!r}") from None
    if math.prod(shape) != world:
        raise SystemExit(f"--mesh {text} does not describe {world} ranks (N or RxN with R*N = {world})")
    return shape


def model_config(args: argparse.Namespace) -> GPTConfig:
    """The :class:`GPTConfig` the flags describe (vocab 256: byte tokenizer)."""
    return GPTConfig(
        vocab_size=VOCAB_SIZE,
        d_model=args.d_model,
        n_layers=args.n_layers,
        n_heads=args.n_heads,
        d_mlp=args.d_mlp,
        seq_len=args.seq_len,
        n_experts=getattr(args, "experts", 0),
        top_k=getattr(args, "top_k", 2),
        ep=getattr(args, "ep", 1),
    )


def expert_share_stats(load: torch.Tensor) -> dict[str, Any]:
    """Load balance of an MoE from ``load`` ``(n_layers, E)`` (token slots per expert, e.g. over
    the validation batches): each layer's expert shares ``share`` (slots / all slots of the
    layer), their ``min`` and ``max`` over all layers and experts, each layer's normalised
    entropy ``-Σ_e s_e ln s_e / ln E`` (1 = uniform, 0 = one expert takes every slot) and its
    minimum over layers, and ``dead``: the (layer, expert) pairs that got no slot."""
    share = load / load.sum(-1, keepdim=True).clamp(min=1)
    E = share.shape[-1]
    plogp = torch.where(share > 0, share * share.clamp(min=1e-30).log(), torch.zeros_like(share))
    entropy = (-plogp.sum(-1) / math.log(E)) if E > 1 else torch.ones(share.shape[0], dtype=share.dtype)
    dead = [[int(i), int(e)] for i, e in (load == 0).nonzero().tolist()]
    return {
        "share": share.tolist(),
        "min": float(share.min()),
        "max": float(share.max()),
        "entropy": entropy.tolist(),
        "entropy_min": float(entropy.min()),
        "dead": dead,
    }


def optimizer_desc(optimizer: str, mode: str, ns_name: str) -> str:
    """The run header's optimizer field: dmuon's Z2 / Z3 mode and NS dtype, or for AdamW (no
    dmuon mode, no Newton-Schulz) FSDP2's ``reshard_after_forward`` that the mode sets."""
    if optimizer in _DMUON_OPTIMIZERS:
        return f"optimizer {optimizer} | mode {mode} | ns {ns_name}"
    return f"optimizer {optimizer} | FSDP2 reshard_after_forward={mode == 'z3'} (no Newton-Schulz)"


def lr_factor(step: int, total_steps: int, warmup_steps: int, cooldown_frac: float) -> float:
    """Multiplier of every group's base LR for optimizer step ``step`` (0-based).

    Linear warm-up from 1/warmup_steps to 1 over the first ``warmup_steps`` steps, constant,
    then a linear cool-down to 0 over the last ``ceil(cooldown_frac · total_steps)`` steps
    (warmup-stable-decay). The first factor is never 0, so step 0 always moves.
    """
    f = 1.0
    if warmup_steps > 0:
        f = min(f, (step + 1) / warmup_steps)
    cooldown = math.ceil(cooldown_frac * total_steps)
    if cooldown > 0 and step >= total_steps - cooldown:
        f = min(f, (total_steps - step) / cooldown)
    return f


def _device(args: argparse.Namespace, rank: int) -> torch.device:
    if args.device == "cpu":
        return torch.device("cpu")
    if args.device == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("--device cuda but torch.cuda.is_available() is False")
        local = int(os.environ.get("LOCAL_RANK", rank % torch.cuda.device_count()))
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    raise ValueError(f"unknown --device {args.device!r} (expected cpu or cuda)")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _ledger_vector(snapshot: dict[str, int]) -> list[int]:
    """Ledger snapshot (phase -> bytes charged to this rank) -> counts in LEDGER_PHASES order;
    unknown phases are added to "other"."""
    vec = [0] * len(LEDGER_PHASES)
    for phase, nbytes in snapshot.items():
        i = LEDGER_PHASES.index(phase) if phase in LEDGER_PHASES else len(LEDGER_PHASES) - 1
        vec[i] += int(nbytes)
    return vec


def _mean(total: int, steps: int) -> int | float:
    """total / steps, as an int when exact (byte counts per step are integers when every step
    moves the same bytes)."""
    return total // steps if total % steps == 0 else total / steps


def _rank0_float(x: float, comm_device: torch.device) -> float:
    """Rank 0's value of ``x`` on every rank (one clock for the whole run: wall times saved in
    checkpoints and plotted are rank 0's)."""
    t = torch.tensor([x], dtype=torch.float64, device=comm_device)
    dist.broadcast(t, src=0)
    return float(t)


def _fmt_bytes(n: int | None) -> str:
    return "n/a" if n is None else f"{n:,} B"


def _is_expert_stack(fqn: str) -> bool:
    """``layers.{i}.mlp.experts.w1`` / ``w2`` / ``w3``: the job's expert stacks."""
    return ".experts.w" in fqn


def _variant_kwargs(args: argparse.Namespace, model: GPT) -> dict[str, Any]:
    """``dedicate_params`` arguments of ``--matrix-views``, ``--qk-clip`` (docs/muon_variants.md)
    and ``--owner-groups`` (docs/owner_groups.md)."""
    from dmuon._train.byte_gpt import per_head_views, qk_clip_spec
    from dmuon.plan import ExpertPolicy

    kw: dict[str, Any] = {}
    if getattr(args, "matrix_views", "none") == "per-head":
        kw["matrix_views"] = per_head_views(model.cfg)
    if getattr(args, "qk_clip", None) is not None:
        kw["qk_clip"] = qk_clip_spec(model, args.qk_clip)
    if getattr(args, "owner_groups", "off") != "off":
        kw["owner_groups"] = args.owner_groups
    if getattr(args, "experts", 0) and getattr(args, "router_optimizer", "muon") != "muon":
        kw["expert_policy"] = ExpertPolicy(routers=args.router_optimizer)
    return kw


def train(args: argparse.Namespace) -> dict[str, Any]:
    """Run one training job on the current default process group; every rank calls this.

    Requires ``torch.distributed`` to be initialised (gloo for ``--device cpu``, nccl for
    ``cuda``); the 1-D device mesh spans the whole world. Rank 0 prints the log and, with
    ``--json FILE``, writes the metrics there.

    Returns (identical on every rank; losses in nats/token, byte counts per optimizer step
    summed over all ranks):
        ``first_train_loss``, ``final_train_loss``, ``initial_val_loss``, ``final_val_loss``,
        ``unigram_val_loss``, ``tokens_per_s`` (global tokens per second of training wall time,
        evaluation excluded, rank 0's clock), ``ledger_nbytes_per_step`` (mean measured bytes,
        plan phases only; None for adamw), ``ledger_phase_nbytes_per_step`` (phase -> mean
        bytes), ``plan_total_nbytes`` and ``plan_per_rank_nbytes`` (None for adamw),
        ``history`` ({"train": [[step, loss], ...], "val": [[step, loss], ...]}), the run's
        configuration, and sizes.
    """
    if not dist.is_initialized():
        raise RuntimeError("dmuon._train.loop.train needs an initialised process group")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = _device(args, rank)
    tp = int(getattr(args, "tp", 1))
    if world % tp:
        raise ValueError(f"--tp {tp} does not divide the world size {world}")
    dp_world = world // tp  # data-parallel ranks; TP ranks of one data-parallel rank see the same data
    if device.type == "cpu" and args.threads > 0:
        torch.set_num_threads(args.threads)
    is_log = rank == 0 and not args.quiet

    def log(msg: str) -> None:
        if is_log:
            write_line(msg)

    mesh_shape = parse_mesh(args.mesh, dp_world)
    if args.batch % dp_world or args.eval_batch % dp_world:
        raise ValueError(
            f"--batch {args.batch} and --eval-batch {args.eval_batch} must be multiples of the "
            f"data-parallel size {dp_world}"
        )
    z3 = args.mode == "z3"
    ns_name = args.ns_dtype
    if ns_name == "auto":
        ns_name = "bf16" if device.type == "cuda" else "fp32"
    ns_dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[ns_name]

    # -- data ------------------------------------------------------------------------------
    tokens, desc = load_corpus(args.data)
    corpus = Corpus.from_tokens(
        tokens,
        seq_len=args.seq_len,
        seed=args.seed,
        val_fraction=args.val_fraction,
        description=desc,
    )
    unigram = corpus.unigram_val_loss
    from torch.distributed.device_mesh import init_device_mesh

    # HSDP: FSDP2 shards over "shard", replicates over "replicate". With --tp the world mesh is
    # (dp..., tp), row-major, so global rank = dp_rank * tp + tp_rank.
    dp_names = ("replicate", "shard") if len(mesh_shape) == 2 else ("dp",)
    if tp > 1:
        world_mesh = init_device_mesh(device.type, (*mesh_shape, tp), mesh_dim_names=(*dp_names, "tp"))
        mesh = world_mesh[dp_names]  # the data-parallel mesh, for dmuon and FSDP2
    else:
        mesh = init_device_mesh(device.type, mesh_shape, mesh_dim_names=dp_names)
    dp_rank = rank // tp
    val_batches = [
        (x.to(device), y.to(device))
        for x, y in corpus.val_batches(args.eval_batches, args.eval_batch, dp_rank, dp_world)
    ]

    # -- model, sharding, optimizer ----------------------------------------------------------
    cfg = model_config(args)
    ep_group = None
    if cfg.ep > 1:  # expert parallelism: EP groups of cfg.ep consecutive ranks (dmuon._train.moe_ep)
        if world % cfg.ep:
            raise SystemExit(f"--ep {cfg.ep} must divide the world size {world}")
        from dmuon._train.moe_ep import new_ep_group

        ep_group = new_ep_group(cfg.ep)
    model = GPT(cfg, seed=args.seed, device=device, ep_group=ep_group)
    # the logical model's parameters: an EP rank holds 1/ep of each expert stack
    n_params = sum(p.numel() * (cfg.ep if _is_expert_stack(n) else 1) for n, p in model.named_parameters())
    if tp > 1:  # TP first, then dmuon on the data-parallel mesh, then FSDP2 (docs/tensor_parallel.md)
        apply_tensor_parallel(model, world_mesh["tp"])
    plan = None
    if args.optimizer in _DMUON_OPTIMIZERS:
        import dmuon

        kw = _variant_kwargs(args, model)
        if cfg.ep > 1:
            kw["ep"] = cfg.ep
        try:
            plan = dmuon.dedicate_params(
                model, mesh, reshard_after_forward=z3, tp=dmuon.plan.TPPolicy(ns=getattr(args, "tp_ns", "auto")), **kw
            )
        except ValueError as exc:
            if cfg.ep == 1:
                raise
            # a layout dmuon's expert parallelism refuses (the same message on every rank)
            raise SystemExit(f"--ep {cfg.ep} on mesh {'x'.join(map(str, mesh_shape))}: {exc}") from None
    # Looked up after the dedication, which installs dmuon's fully_shard skip (also passed explicitly below).
    import torch.distributed.fsdp as fsdp

    # dedicated parameters passed as ignored_params explicitly: the job also runs with dmuon's
    # patches off (DMUON_NO_PATCHES=1), where fully_shard does not skip them by itself
    ignored = dmuon.fsdp2_ignored_params if plan is not None else (lambda module: None)
    for layer in model.layers:
        fsdp.fully_shard(layer, mesh=mesh, reshard_after_forward=z3, ignored_params=ignored(layer))
    fsdp.fully_shard(model, mesh=mesh, reshard_after_forward=z3, ignored_params=ignored(model))

    if args.optimizer in _DMUON_OPTIMIZERS:
        import dmuon

        opt = dmuon.Muon(
            model,
            lr=args.lr,
            weight_decay=args.weight_decay,
            adamw_lr=args.adamw_lr,
            adamw_weight_decay=args.adamw_weight_decay,
            ns_dtype=ns_dtype,
            **({"variant": "normuon"} if args.optimizer == "normuon" else {}),
        )
        LEDGER = dmuon.exec.ledger()
    elif args.optimizer == "adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=args.adamw_lr, weight_decay=args.adamw_weight_decay)
        LEDGER = None
    else:
        raise ValueError(f"unknown --optimizer {args.optimizer!r} (expected dmuon, normuon or adamw)")
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, args.steps, args.warmup, args.cooldown_frac))

    tokens_per_step = args.batch * args.seq_len
    aux_coef = float(getattr(args, "aux_loss_coef", 0.0)) if cfg.n_experts else 0.0
    log(
        f"dmuon train | world {world} ({device.type}, {dist.get_backend()}) | "
        f"mesh {'x'.join(map(str, mesh_shape))}{f' x tp {tp}' if tp > 1 else ''} | "
        f"{optimizer_desc(args.optimizer, args.mode, ns_name)} | seed {args.seed}"
    )
    moe_desc = ""
    if cfg.n_experts:
        per_expert = 3 * cfg.d_model * cfg.d_mlp * cfg.n_layers
        active = n_params - (cfg.n_experts - cfg.top_k) * per_expert
        moe_desc = (
            f" | MoE: {cfg.n_experts} experts, top-{cfg.top_k}, aux-loss coef {aux_coef}, "
            f"{active:,} active parameters per token"
        )
        if cfg.ep > 1:
            moe_desc += f", expert parallel over ep = {cfg.ep} ranks ({cfg.n_experts // cfg.ep} experts each)"
    log(
        f"model: {cfg.n_layers} layers, d_model {cfg.d_model}, heads {cfg.n_heads}, "
        f"d_mlp {cfg.d_mlp}, seq_len {cfg.seq_len}, {n_params:,} parameters{moe_desc}"
    )
    log(
        f"data: {corpus.description}: {corpus.train.size:,} train / {corpus.val.size:,} val "
        f"tokens | global batch {args.batch} x {args.seq_len} = {tokens_per_step:,} tokens/step"
    )
    plan_cost = plan.cost if plan is not None else None  # derived from the schedule: once
    if plan is not None:
        dedicated_numel = sum(plan.param(f).numel for f in plan.dedicated)
        log(
            f"plan: {len(plan.dedicated)} dedicated params "
            f"({sum(plan.param(f).num_matrices for f in plan.dedicated)} Muon matrices, {dedicated_numel:,} elements), "
            f"owned elements per rank {list(plan.owned_numel)}, "
            f"{plan_cost.total_nbytes:,} B/step over all ranks "
            f"(per rank {list(plan_cost.per_rank_nbytes)})"
        )

        for line in plan.expert_lines():  # MoE: the plan summary's experts line
            log(line)
    log(f"unigram baseline (train -> val): {unigram:.4f} nats/token")

    val_load: list[torch.Tensor] = []  # MoE: (n_layers, E) token slots of the last validation, all ranks

    def evaluate() -> float:
        """Mean loss over the fixed validation batches and all ranks, nats/token (MoE: the
        token slots each expert got over them, summed over ranks, in ``val_load``)."""
        acc = torch.zeros(2, dtype=torch.float64, device=device)
        load = None
        with torch.no_grad():
            for x, y in val_batches:
                acc[0] += lm_loss(model(x), y).double()
                acc[1] += 1
                if cfg.n_experts:
                    batch_load = model.expert_load().to(torch.float64)
                    load = batch_load if load is None else load + batch_load
        dist.all_reduce(acc)
        if load is not None:
            load = load.to(comm_device)
            dist.all_reduce(load)
            val_load[:] = [load.cpu()]
        return float(acc[0] / acc[1])

    comm_device = device if dist.get_backend() == "nccl" else torch.device("cpu")
    history_qk: list[list[float]] = []  # [step, clipped heads, max logit] at log steps (--qk-clip)
    history_aux: list[list[float]] = []  # [step, aux loss, min, max expert share] at log steps (--experts)
    history_train: list[list[float]] = []
    history_val: list[list[float]] = []
    history_val_time: list[float] = []  # training wall time (s) at each validation
    train_time = 0.0
    start_step = 0
    flags = run_flags(args, ns_name)
    save_dir = getattr(args, "save", None)
    if getattr(args, "resume", None):
        state = load_checkpoint(args.resume, model=model, optimizer=opt, scheduler=sched, flags=flags, device=device)
        start_step, train_time = state.step, state.train_time_s
        history_train = [list(e) for e in state.history["train"]]
        history_val = [list(e) for e in state.history["val"]]
        history_val_time = list(state.history["val_train_time_s"])
        history_qk = [list(e) for e in state.history.get("qk_clip", [])]
        history_aux = [list(e) for e in state.history.get("moe", [])]
        log(f"resumed from {state.path} at step {start_step}/{args.steps}")
    elif args.eval_every > 0:
        v0 = evaluate()
        history_val.append([0, v0])
        history_val_time.append(0.0)
        log(f"step {0:>6}/{args.steps} | val {v0:.4f}")

    def history() -> dict:
        out = {"train": history_train, "val": history_val, "val_train_time_s": history_val_time}
        if history_qk:
            out["qk_clip"] = history_qk
        if history_aux:
            out["moe"] = history_aux
        return out

    n_phases = len(LEDGER_PHASES)
    ledger_total = torch.zeros(n_phases, dtype=torch.int64)  # this rank, summed over steps
    ledger_step = torch.zeros(n_phases, dtype=torch.int64)  # this rank, last step
    pending: list[torch.Tensor] = []
    interval_time, interval_steps = 0.0, 0
    bar = progress_bar(total=args.steps, initial=start_step, enabled=is_log)
    note = progress_note(enabled=is_log, png=getattr(args, "png", None), log_every=getattr(args, "log_every", None))
    if note is not None:
        log(note)

    for step in range(start_step + 1, args.steps + 1):
        x, y = corpus.train_batch(step - 1, args.batch, dp_rank, dp_world)
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        if LEDGER is not None:
            LEDGER.reset()
        _sync(device)
        t0 = time.perf_counter()
        loss = lm_loss(model(x), y)
        aux = model.aux_loss() if cfg.n_experts else None
        (loss + aux_coef * aux if aux is not None and aux_coef else loss).backward()
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        pending.append(loss.detach())
        _sync(device)
        dt = time.perf_counter() - t0
        train_time += dt
        interval_time += dt
        interval_steps += 1
        if LEDGER is not None:
            ledger_step = torch.tensor(_ledger_vector(LEDGER.snapshot()), dtype=torch.int64)
            ledger_total += ledger_step

        last = step == args.steps
        if step == 1 or step % args.log_every == 0 or last:
            losses = torch.stack(pending).to(comm_device, torch.float64)
            dist.all_reduce(losses)
            losses /= world
            first = step - len(pending) + 1
            history_train.extend([first + i, float(v)] for i, v in enumerate(losses.tolist()))
            pending.clear()
            msg = (
                f"step {step:>6}/{args.steps} | train {history_train[-1][1]:.4f} | "
                f"{tokens_per_step * interval_steps / max(interval_time, 1e-9):,.0f} tok/s"
            )
            interval_time, interval_steps = 0.0, 0
            if aux is not None:  # the last step's load balance, over all ranks
                load = model.expert_load().to(comm_device, torch.float64)
                stats = torch.cat([aux.detach().reshape(1).to(comm_device, torch.float64), load.flatten()])
                dist.all_reduce(stats)
                share = stats[1:].view_as(load)
                share = share / share.sum(-1, keepdim=True)
                aux_last = float(stats[0]) / world
                share_min, share_max = float(share.min()), float(share.max())
                history_aux.append([step, aux_last, share_min, share_max])
                msg += f" | aux {aux_last:.3f}, expert share {share_min:.3f}-{share_max:.3f}"
            if LEDGER is not None:
                step_bytes = ledger_step.to(comm_device)
                dist.all_reduce(step_bytes)
                measured = int(step_bytes[: len(_PLAN_PHASES)].sum())
                msg += f" | bytes/step {measured:,} (plan {plan_cost.total_nbytes:,})"
                if int(step_bytes[-1]):
                    msg += f" + other {int(step_bytes[-1]):,}"
            clip = dmuon.qk_clip.stats(model) if plan is not None and plan.qk_clip is not None else None
            if clip is not None:  # the last step's figures (identical on every rank)
                history_qk.append([step, clip["clipped_heads"], clip["max_logit"]])
                msg += f" | qk-clip {clip['clipped_heads']} heads clipped, max logit {clip['max_logit']:.2f}"
            log(msg)
        if args.eval_every > 0 and (step % args.eval_every == 0 or last):
            v = evaluate()
            history_val.append([step, v])
            history_val_time.append(_rank0_float(train_time, comm_device))
            log(f"step {step:>6}/{args.steps} | val {v:.4f} | unigram {unigram:.4f}")
        bar.update(1)
        if save_dir and (step % args.save_every == 0 or last):
            path = save_checkpoint(
                save_dir,
                step=step,
                model=model,
                optimizer=opt,
                scheduler=sched,
                history=history(),
                train_time_s=_rank0_float(train_time, comm_device),
                flags=flags,
                device=device,
            )
            log(f"step {step:>6}/{args.steps} | saved {path}")
    bar.close()

    # -- summary -----------------------------------------------------------------------------
    phase_mean: dict[str, int | float] | None = None
    measured_mean: int | float | None = None
    steps_run = args.steps - start_step  # this session's steps (the ledger's)
    if LEDGER is not None and steps_run > 0:
        tot = ledger_total.to(comm_device)
        dist.all_reduce(tot)
        phase_mean = {p: _mean(int(b), steps_run) for p, b in zip(LEDGER_PHASES, tot.tolist())}
        measured_mean = _mean(int(tot[: len(_PLAN_PHASES)].sum()), steps_run)
    tokens_per_s = tokens_per_step * args.steps / max(train_time, 1e-9)
    # Rank 0's clock defines the throughput; broadcast so every rank returns the same dict.
    tps = torch.tensor([tokens_per_s], dtype=torch.float64, device=comm_device)
    dist.broadcast(tps, src=0)
    tokens_per_s = float(tps)

    final_val = history_val[-1][1] if history_val else None
    metrics: dict[str, Any] = {
        "world_size": world,
        "tp": tp,
        "device": device.type,
        "backend": dist.get_backend(),
        "optimizer": args.optimizer,
        "mode": args.mode,
        "ns_dtype": ns_name,
        "steps": args.steps,
        "global_batch": args.batch,
        "seq_len": args.seq_len,
        "tokens_per_step": tokens_per_step,
        "n_params": n_params,
        "experts": cfg.n_experts,
        "top_k": cfg.top_k if cfg.n_experts else None,
        "ep": cfg.ep,
        "final_aux_loss": history_aux[-1][1] if history_aux else None,
        "router_optimizer": getattr(args, "router_optimizer", "muon") if cfg.n_experts else None,
        "expert_share": expert_share_stats(val_load[0]) if val_load else None,
        "data": corpus.description,
        "first_train_loss": history_train[0][1],
        "final_train_loss": history_train[-1][1],
        "initial_val_loss": history_val[0][1] if history_val else None,
        "final_val_loss": final_val,
        "unigram_val_loss": unigram,
        "tokens_per_s": tokens_per_s,
        "train_time_s": train_time,
        "ledger_nbytes_per_step": measured_mean,
        "ledger_phase_nbytes_per_step": phase_mean,
        "plan_total_nbytes": plan_cost.total_nbytes if plan is not None else None,
        "plan_per_rank_nbytes": list(plan_cost.per_rank_nbytes) if plan is not None else None,
        "history": history(),
        "start_step": start_step,
        "config": {k: v for k, v in vars(args).items() if not k.startswith("_")},
    }
    val_str = "n/a" if final_val is None else f"{final_val:.4f}"
    measured_str = "n/a" if measured_mean is None else f"{measured_mean:,.0f} B"
    log(
        f"summary: train {metrics['final_train_loss']:.4f} | val {val_str} | "
        f"unigram {unigram:.4f} nats/token | {tokens_per_s:,.0f} tok/s | "
        f"bytes/step measured {measured_str} vs plan {_fmt_bytes(metrics['plan_total_nbytes'])}"
    )
    if rank == 0 and args.json:
        with open(args.json, "w") as f:
            json.dump(metrics, f, indent=2)
            f.write("\n")
    return metrics


def run_job(args: argparse.Namespace) -> dict[str, Any]:
    """:func:`train`, then each optimizer of ``--compare`` (e.g. ``normuon,adamw``) in the same
    process group (same data, seed, model, steps and schedule; no ``--save`` / ``--resume``;
    ``adamw``: ``torch.optim.AdamW`` at ``--adamw-lr`` on every parameter, without ``--ep``), then
    with ``--png FILE`` rank 0's plot of every run in one figure
    (:func:`dmuon._train.loss_plot.plot_runs`). Returns the first run's metrics with the compared runs'
    metrics under ``"compare"`` (a list, ``--compare`` order); rank 0 prints each final
    validation loss. ``args.compare``: the optimizers' names, in order, as
    :func:`dmuon._cli.train_command.compare_list` checked them (``dmuon._cli.train_command`` validates every
    run's flags before they reach here)."""
    metrics = train(args)
    runs = [metrics]
    for name in args.compare or ():
        other = argparse.Namespace(**vars(args))
        other.optimizer, other.save, other.resume, other.json, other.compare = name, None, None, None, None
        if name == "adamw":
            other.ep = 1  # the baseline on the same model without expert parallelism (AdamW on FSDP2 shards)
        runs.append(train(other))
    if len(runs) > 1:
        metrics["compare"] = runs[1:]
        if dist.get_rank() == 0 and not args.quiet and metrics["final_val_loss"] is not None:
            write_line(
                f"compare after {args.steps} steps: "
                + " vs ".join(
                    f"val {m['final_val_loss']:.4f} ({m['optimizer']}, train time {m['train_time_s']:.1f} s)"
                    for m in runs
                )
            )
    if getattr(args, "png", None) and dist.get_rank() == 0:
        from dmuon._train.loss_plot import plot_runs

        plot_runs(runs, args.png)
        if not args.quiet:
            write_line(f"wrote {args.png}")
    if dist.get_rank() == 0 and args.json and "compare" in metrics:
        with open(args.json, "w") as f:
            json.dump(metrics, f, indent=2)
            f.write("\n")
    return metrics
