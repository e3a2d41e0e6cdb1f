"""The training loop around a dmuon model as users write it with torch's own tools: loss scaling,
non-finite steps, frozen-then-unfrozen matrices, clipping, set-up order, and checkpoints through
DCP (resume, param groups and LR schedules, plain-FSDP2 interop, a peer's exit, a missing shard),
each against the single-process oracle or as the same clear error on every rank.

Two process groups for the whole module (process start-up dominates on 2 cores): W=4 runs the
1-D N=4 and HSDP (2, 2) cases, W=2 the 1-D N=2 ones. Each case is a function ``_case_*`` that
returns a picklable record; the tests below compare the records with the oracle
(``tests/oracle.py``: ``torch.optim.Muon`` + ``torch.optim.AdamW``, fp32 Newton-Schulz; README
bounds: losses within 1e-6 relative, parameters within 1e-4 of each tensor's largest magnitude).

* loss scaling: ``torch.amp.GradScaler`` (explicit ``unscale_``), FSDP1's ``ShardedGradScaler``
  and HSDP; an inf in one dedicated matrix's local gradient on one non-owner rank at step 2;
* resume into a fresh optimizer through DCP's helpers on a mesh where ranks own nothing;
  ``load_state_dict`` of a mismatching state dict;
* set-up order mistakes (``dmuon.Muon`` before ``fully_shard``; no ``fully_shard(model)``).
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

from dist_utils import run_distributed
from dmuon.exec import dedicated_info, get_model_runtime
from oracle import HP, dmuon_optimizer, fp32_newton_schulz, global_batches, lm_loss, make_model, reference_optimizers

LOSS_RTOL = 1e-6
PARAM_TOL = 1e-4
AMP_STEPS = 4
AMP_SKIP = 1  # 0-based: the second step overflows
AMP_INIT_SCALE = 2.0**10


def _catch(fn):
    try:
        fn()
    except BaseException as exc:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
        return (type(exc).__name__, str(exc))
    return None


def _mesh(shape):
    from torch.distributed.device_mesh import init_device_mesh

    return None if shape is None else init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))


def _build(kind="tiny", mesh=None, *, opt=True):
    from torch.distributed.fsdp import fully_shard

    import dmuon

    model = make_model(kind)
    plan = dmuon.dedicate_params(model, mesh)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, (dmuon_optimizer(model) if opt else None), plan


# ----------------------------------------------------------------------------------------------
# cases (run inside the ranks)
# ----------------------------------------------------------------------------------------------


def _case_amp(mesh_shape, scaler_kind):
    """Scaled steps; at step AMP_SKIP one non-owner rank's local gradient of ``target`` is inf."""
    import torch.distributed as dist

    import dmuon

    rank, world = dist.get_rank(), dist.get_world_size()
    model, opt, plan = _build("tiny", _mesh(mesh_shape))
    target = "layers.1.out.weight"
    poison_rank = (plan.owner(target).rank + 1) % world
    if scaler_kind == "sharded":
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        scaler = ShardedGradScaler("cpu", init_scale=AMP_INIT_SCALE, growth_interval=1)
    else:
        scaler = torch.amp.GradScaler("cpu", init_scale=AMP_INIT_SCALE, growth_interval=1)
    out_mod = model.get_submodule("layers.1.out")
    handles = []

    def poison(module, args):  # inside the boundary's forward: module.weight is the compute tensor
        handles.append(module.weight.register_hook(lambda g: torch.full_like(g, float("inf"))))

    losses, scales, fulls, momenta, adamw_steps = [], [], [], [], []
    owned = [p for p in model.parameters() if dedicated_info(p) is not None and dedicated_info(p).is_owner]
    adamw = [p for g in opt.param_groups if not g["use_muon"] for p in g["params"]]
    for step, batch in enumerate(global_batches(AMP_STEPS, batch=12)):
        pre = out_mod.register_forward_pre_hook(poison) if (step == AMP_SKIP and rank == poison_rank) else None
        loss = lm_loss(model, batch.chunk(world)[rank])
        scaler.scale(loss).backward()
        if pre is not None:
            pre.remove()
            for h in handles:
                h.remove()
        if scaler_kind == "plain_unscale":
            scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        t = loss.detach().clone()
        dist.all_reduce(t)
        losses.append(t.item() / world)
        scales.append(scaler.get_scale())
        fulls.append(dmuon.full_state_dict(model))
        momenta.append([opt.state[p]["momentum_buffer"].clone() for p in owned])
        adamw_steps.append(sorted({opt.state[p]["step"].item() for p in adamw}))
    dist.barrier()
    return dict(
        dedicated=plan.dedicated,
        losses=losses,
        scales=scales,
        full=fulls if rank == 0 else None,
        momenta=momenta,
        adamw_steps=adamw_steps,
    )


def _case_skip_nonfinite(clip: bool):
    """``dmuon.Muon(skip_nonfinite=True)`` at W = 4, no scaler: at step AMP_SKIP one non-owner
    rank's local gradient of ``target`` is NaN (before dmuon's reduce); with ``clip`` every step
    is clipped by ``dmuon.clip_grad_norm_`` first (a bound that never binds, so the oracle need not
    clip), whose all-reduce carries the flags. Records per step the losses, full state, momenta,
    AdamW step counters, ``last_step_skipped``, the collectives of ``step()`` and of the clip, and
    the ``dmuon`` logger's warnings on this rank."""
    import logging

    import torch.distributed as dist

    import dmuon
    from oracle import dmuon_muon_kwargs

    rank, world = dist.get_rank(), dist.get_world_size()
    model, _, plan = _build("tiny", None, opt=False)
    opt = dmuon.Muon(model, **dmuon_muon_kwargs(torch.float32), skip_nonfinite=True)
    target = "layers.1.out.weight"
    poison_rank = (plan.owner(target).rank + 1) % world
    out_mod = model.get_submodule("layers.1.out")
    handles = []

    def poison(module, args):  # inside the boundary's forward: module.weight is the compute tensor
        handles.append(module.weight.register_hook(lambda g: torch.full_like(g, float("nan"))))

    records: list = []

    class Capture(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    handler = Capture(level=logging.WARNING)
    logging.getLogger("dmuon").addHandler(handler)
    losses, fulls, momenta, adamw_steps, skipped, step_ops, clip_ops = [], [], [], [], [], [], []
    owned = [p for p in model.parameters() if dedicated_info(p) is not None and dedicated_info(p).is_owner]
    adamw = [p for g in opt.param_groups if not g["use_muon"] for p in g["params"]]
    try:
        for step, batch in enumerate(global_batches(AMP_STEPS, batch=12)):
            pre = out_mod.register_forward_pre_hook(poison) if (step == AMP_SKIP and rank == poison_rank) else None
            loss = lm_loss(model, batch.chunk(world)[rank])
            loss.backward()
            if pre is not None:
                pre.remove()
                for h in handles:
                    h.remove()
            if clip:
                with dmuon.exec.metered(record=True) as led:
                    dmuon.clip_grad_norm_(model, 1e9)
                clip_ops.append([(op.kind, op.numel) for op in led.ops])
            with dmuon.exec.metered(record=True) as led:
                opt.step()
            step_ops.append([(op.kind, op.phase, op.numel) for op in led.ops])
            skipped.append(opt.last_step_skipped)
            opt.zero_grad()
            t = loss.detach().clone()
            dist.all_reduce(t)
            losses.append(t.item() / world)
            fulls.append(dmuon.full_state_dict(model))
            momenta.append([opt.state[p]["momentum_buffer"].clone() for p in owned])
            adamw_steps.append(sorted({opt.state[p]["step"].item() for p in adamw}))
    finally:
        logging.getLogger("dmuon").removeHandler(handler)
    dist.barrier()
    return dict(
        dedicated=plan.dedicated,
        poison_rank=poison_rank,
        losses=losses,
        full=fulls if rank == 0 else None,
        momenta=momenta,
        adamw_steps=adamw_steps,
        skipped=skipped,
        skipped_steps=opt.skipped_steps,
        step_ops=step_ops,
        clip_ops=clip_ops,
        warnings=records,
    )


def _case_resume_fresh(root):
    """4 ranks, 2 dedicated matrices: ranks 2 and 3 own nothing. Save after 2 steps, resume into
    a fresh model + dmuon.Muon WITHOUT init_state() (DCP's helpers decide on a dummy step per
    rank), step once; compare with the uninterrupted run."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    import dmuon
    from oracle import train_steps

    rank = dist.get_rank()
    batches = global_batches(3)
    model, opt, plan = _build("two")
    train_steps(model, opt, batches[:2])
    path = f"{root}/fresh"
    dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}, checkpoint_id=path)
    cont = train_steps(model, opt, batches[2:])
    cont_full = dmuon.full_state_dict(model)

    model2, opt2, _ = _build("two")
    state_before = len(opt2.state)
    sd = {"model": get_model_state_dict(model2), "optim": get_optimizer_state_dict(model2, opt2)}
    dcp.load(sd, checkpoint_id=path)
    set_model_state_dict(model2, sd["model"])
    set_optimizer_state_dict(model2, opt2, sd["optim"])
    res = train_steps(model2, opt2, batches[2:])
    res_full = dmuon.full_state_dict(model2)

    # load_state_dict of mismatching state dicts: the same error on every rank, before any collective
    good = opt2.state_dict()
    errors = {}
    extra = copy.copy(good)
    extra["state"] = dict(good["state"])
    extra["state"][max(good["state"]) + 1] = {"exp_avg": torch.zeros(1)}
    errors["extra_key"] = _catch(lambda: opt2.load_state_dict(extra))
    missing = copy.copy(good)
    missing["state"] = {k: dict(v) for k, v in good["state"].items()}
    idx = len(good["param_groups"][0]["params"])  # first AdamW entry
    del missing["state"][idx]["exp_avg_sq"]
    errors["missing_key"] = _catch(lambda: opt2.load_state_dict(missing))
    other, other_opt, _ = _build("tiny")  # another model: other group sizes
    errors["other_model"] = _catch(lambda: opt2.load_state_dict(other_opt.state_dict()))
    dist.barrier()
    return dict(
        owned=[f for f in plan.dedicated if plan.owner(f).rank == rank],
        state_at_construction=state_before,
        cont=cont,
        res=res,
        same_params=rank != 0 or all(torch.equal(cont_full[k], res_full[k]) for k in cont_full),
        errors=errors,
    )


def _case_order_mistakes():
    """Set-up order mistakes: detected at the first step on every rank, or harmless."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    import dmuon

    rank, world = dist.get_rank(), dist.get_world_size()
    batch = global_batches(1, batch=12)[0].chunk(world)[rank]
    out = {}
    for variant in ("muon_before_fully_shard", "no_root_fully_shard", "no_fully_shard", "no_block_fully_shard"):
        model = make_model("tiny")
        dmuon.dedicate_params(model)
        opt = dmuon_optimizer(model) if variant == "muon_before_fully_shard" else None
        if variant not in ("no_block_fully_shard", "no_fully_shard"):
            for layer in model.layers:
                fully_shard(layer)
        if variant not in ("no_root_fully_shard", "no_fully_shard"):
            fully_shard(model)
        opt = opt or dmuon_optimizer(model)
        lm_loss(model, batch).backward()
        out[variant] = _catch(opt.step)
        dist.barrier()
    return out


TOGGLE_STEPS = 6
FREEZE_AT, UNFREEZE_AT = 2, 4  # 0-based steps: frozen for steps 2 and 3
FROZEN = ("layers.1.fc1.weight", "layers.1.fc2.weight", "layers.1.gate.weight", "layers.1.out.weight")


LATE_FROM = 2  # "late": FROZEN's matrices get no gradient (None) for steps 0 and 1, then one


def _toggle(model, step, freeze_at=FREEZE_AT, unfreeze_at=UNFREEZE_AT):
    if step in (freeze_at, unfreeze_at):
        for fqn in FROZEN:
            model.get_parameter(fqn).requires_grad_(step == unfreeze_at)


def _case_requires_grad_toggle(set_to_none, late=False):
    """A block's matrices frozen after step 2 and unfrozen after step 4; ``late``: frozen from
    the start (gradient None on every rank for the first LATE_FROM steps), then trained."""
    import torch.distributed as dist

    import dmuon

    rank, world = dist.get_rank(), dist.get_world_size()
    model, opt, plan = _build("tiny")
    losses = []
    for step, batch in enumerate(global_batches(TOGGLE_STEPS, batch=12)):
        _toggle(model, step, *((0, LATE_FROM) if late else ()))
        loss = lm_loss(model, batch.chunk(world)[rank])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)
        t = loss.detach().clone()
        dist.all_reduce(t)
        losses.append(t.item() / world)
    full = dmuon.full_state_dict(model)
    dist.barrier()
    return dict(dedicated=plan.dedicated, losses=losses, full=full if rank == 0 else None)


def _case_torch_clip():
    """torch.nn.utils.clip_grad_norm_ on a dmuon model: the global norm, every rank."""
    import torch.distributed as dist

    import dmuon

    rank, world = dist.get_rank(), dist.get_world_size()
    model, opt, plan = _build("tiny")
    norms, strict, losses = [], [], []
    for batch in global_batches(2, batch=12):
        loss = lm_loss(model, batch.chunk(world)[rank])
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05).item())
        # error_if_nonfinite is passed on to dmuon.clip_grad_norm_: finite here, so the norm of the
        # gradients just clipped to 0.05 (max_norm 1e9 scales nothing)
        strict.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9, error_if_nonfinite=True).item())
        opt.step()
        opt.zero_grad()
        t = loss.detach().clone()
        dist.all_reduce(t)
        losses.append(t.item() / world)
    err = _catch(lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05, error_if_nonfinite=True))
    full = dmuon.full_state_dict(model)
    dist.barrier()
    return dict(
        dedicated=plan.dedicated, norms=norms, strict=strict, losses=losses, full=full if rank == 0 else None, err=err
    )


def _case_dmuon_clip():
    """dmuon.clip_grad_norm_ with torch's signature. Step 0: error_if_nonfinite=True on finite
    gradients, foreach=True, recorded by a metered ledger around the whole step (dmuon's step
    collectives next to clip's), then the same clip with foreach=False on a copy of the
    gradients. Step 1: a NaN in a gradient rank 1 holds (a dedicated matrix it owns):
    error_if_nonfinite=True raises on every rank, gradients untouched; without it, the norm is
    NaN on every rank (torch's behaviour)."""
    import logging

    import torch.distributed as dist

    import dmuon
    from dmuon.exec._comm import collective_calls as C

    rank, world = dist.get_rank(), dist.get_world_size()
    model, opt, plan = _build("tiny")
    batches = global_batches(2, batch=12)

    def grads():
        return {
            n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
            for n, p in model.named_parameters()
            if p.grad is not None
        }

    with dmuon.exec.metered(record=True) as led:
        lm_loss(model, batches[0].chunk(world)[rank]).backward()
        before = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        logged = []  # the dmuon.comm logger at DEBUG: one line per issued collective

        class Keep(logging.Handler):
            def emit(self, record):
                logged.append(record.getMessage())

        log, keep = logging.getLogger("dmuon.comm"), Keep()
        level = log.level
        log.addHandler(keep)
        log.setLevel(logging.DEBUG)
        try:
            with dmuon.exec.metered(record=True) as clip_led:
                norm = dmuon.clip_grad_norm_(model, 0.05, error_if_nonfinite=True, foreach=True).item()
        finally:
            log.removeHandler(keep)
            log.setLevel(level)
        group = C._LAST[0][2] or dist.group.WORLD  # the group of the last op: its count of collectives so far
        seq, last = group._get_sequence_number_for_group(), C.last_issued()
        clipped = grads()
        for n, p in model.named_parameters():  # the same clip, tensor by tensor
            if p.grad is not None:
                p.grad.copy_(before[n])
        norm_loop = dmuon.clip_grad_norm_(model.parameters(), 0.05, foreach=False).item()
        same_loop = all(torch.allclose(clipped[n], g, rtol=1e-6, atol=0) for n, g in grads().items())
        opt.step()
    opt.zero_grad()

    def op(o):
        return (o.kind, o.phase, tuple(sorted(o.group)), o.root, o.dtype, o.numel, o.nbytes)

    issued = [op(o) for o in led.ops if o.phase != "other"]
    planned = [
        (o.kind, o.phase, o.group, o.root, o.dtype, o.numel, o.charged_nbytes(rank))
        for o in plan.schedule().rank_ops(rank)
        if o.collective
    ]
    lm_loss(model, batches[1].chunk(world)[rank]).backward()
    target = next(f for f in plan.dedicated if plan.owner(f).rank == 1)
    if rank == 1:
        model.get_parameter(target).grad[0, 0] = float("nan")
    kept = grads()
    err = _catch(lambda: dmuon.clip_grad_norm_(model, 0.05, error_if_nonfinite=True))
    untouched = all(
        torch.equal(kept[n], g) or (n == target and torch.equal(kept[n].nan_to_num(), g.nan_to_num()))
        for n, g in grads().items()
    )
    nan_norm = dmuon.clip_grad_norm_(model, 0.05).item()
    dist.barrier()
    return dict(
        dedicated=plan.dedicated,
        norm=norm,
        norm_loop=norm_loop,
        same_loop=same_loop,
        clip_ops=[op(o) for o in clip_led.ops],
        clip_other=clip_led.snapshot()["other"],
        step_other=[op(o) for o in led.ops if o.phase == "other"],
        ops_match=issued == planned,
        step_nbytes=led.total_nbytes(),
        plan_nbytes=plan.cost.per_rank_nbytes[rank],
        target=target,
        err=err,
        untouched=untouched,
        nan_norm=nan_norm,
        logged=logged,
        seq=seq,
        last=last,
    )


def _case_predicate_changed(root):
    """A checkpoint saved under the default predicate, loaded under one that dedicates fewer."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )
    from torch.distributed.fsdp import fully_shard

    import dmuon
    from oracle import train_steps

    model, opt, _ = _build("tiny")
    train_steps(model, opt, global_batches(1))
    path = f"{root}/predicate"
    dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}, checkpoint_id=path)
    model2 = make_model("tiny")
    dmuon.dedicate_params(
        model2, predicate=lambda fqn, p: p.ndim == 2 and fqn.startswith("layers.") and "gate" not in fqn
    )
    for layer in model2.layers:
        fully_shard(layer)
    fully_shard(model2)
    opt2 = dmuon_optimizer(model2)

    def load():
        sd = {"model": get_model_state_dict(model2), "optim": get_optimizer_state_dict(model2, opt2)}
        dcp.load(sd, checkpoint_id=path)
        set_model_state_dict(model2, sd["model"])
        set_optimizer_state_dict(model2, opt2, sd["optim"])

    err = _catch(load)
    dist.barrier()
    return dict(err=err)


GROUP_STEPS, GROUP_SAVE_AT = 4, 2
GROUP_HP = [  # (lr, weight_decay) of dmuon.Muon's groups 0..3: Muon, AdamW, Muon (layers.1), AdamW (layers.1)
    (0.02, 0.1),
    (3e-3, 0.01),
    (0.05, 0.0),
    (1e-3, 0.2),
]
LAMBDAS = [lambda s: 1.0 / (1 + s), lambda s: 0.9**s, lambda s: 1.0 + 0.5 * s, lambda s: 1.0 if s < 3 else 0.1]


def _grouped(mesh):
    """dmuon.Muon with four groups: the constructor's two (everything but layers.1), then
    add_param_group for layers.1's dedicated and its other parameters; LambdaLR, one lambda each."""
    from torch.distributed.fsdp import fully_shard

    import dmuon

    model = make_model("tiny")
    dmuon.dedicate_params(model, mesh)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    params = dict(model.named_parameters())
    late = [n for n in params if n.startswith("layers.1.")]
    (lr0, wd0), (lr1, wd1), (lr2, wd2), (lr3, wd3) = GROUP_HP
    opt = dmuon.Muon(
        [p for n, p in params.items() if n not in late],
        lr=lr0,
        weight_decay=wd0,
        momentum=HP["momentum"],
        adamw_lr=lr1,
        adamw_weight_decay=wd1,
        ns_dtype=torch.float32,
    )
    opt.add_param_group(
        {"params": [params[n] for n in late if (dedicated_info(params[n]) is not None)], "lr": lr2, "weight_decay": wd2}
    )
    opt.add_param_group(
        {
            "params": [params[n] for n in late if not (dedicated_info(params[n]) is not None)],
            "lr": lr3,
            "weight_decay": wd3,
        }
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, LAMBDAS)
    return model, opt, sched


def _group_steps(model, opt, sched, batches):
    from oracle import train_steps

    losses = []
    for b in batches:
        losses += train_steps(model, opt, [b])
        sched.step()
    return losses


def _group_sd(model, opt, sched):
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    return {
        "model": get_model_state_dict(model),
        "optim": get_optimizer_state_dict(model, opt),
        "sched": sched.state_dict(),
    }


def _group_load(model, opt, sched, path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    sd = _group_sd(model, opt, sched)
    dcp.load(sd, checkpoint_id=path)
    set_model_state_dict(model, sd["model"])
    set_optimizer_state_dict(model, opt, sd["optim"])
    sched.load_state_dict(sd["sched"])


def _group_record(model, opt, losses):
    import torch.distributed as dist

    import dmuon

    full = dmuon.full_state_dict(model)
    groups = [(g["use_muon"], g["lr"], g["weight_decay"], len(g["params"])) for g in opt.param_groups]
    return dict(losses=losses, groups=groups, full=full if dist.get_rank() == 0 else None)


def _case_groups_save(root):
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    batches = global_batches(GROUP_STEPS)
    model, opt, sched = _grouped(None)
    first = _group_steps(model, opt, sched, batches[:GROUP_SAVE_AT])
    dcp.save(_group_sd(model, opt, sched), checkpoint_id=f"{root}/groups")
    dist.barrier()
    return dict(first=first)


def _case_groups_load(root, mesh_shape):
    batches = global_batches(GROUP_STEPS)
    model, opt, sched = _grouped(_mesh(mesh_shape))
    _group_load(model, opt, sched, f"{root}/groups")
    after_load = [(g["lr"], g["weight_decay"]) for g in opt.param_groups]
    rest = _group_steps(model, opt, sched, batches[GROUP_SAVE_AT:])
    return dict(after_load=after_load, **_group_record(model, opt, rest))


def _interop_model(seed):
    """TinyLM plus a (3, 8) matrix in a block: dim 0 below N = 4; gate (5, 8), head (11, 8): not
    divisible by N."""
    from oracle import TinyLM

    torch.manual_seed(seed)
    model = TinyLM(n_layers=2)
    model.layers[0].narrow = torch.nn.Linear(8, 3, bias=False)
    return model


def _interop_build(seed, dedicate, mesh=None):
    from torch.distributed.fsdp import fully_shard

    import dmuon

    model = _interop_model(seed)
    if dedicate:
        dmuon.dedicate_params(model, mesh)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _full_model_sd(model):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def _max_diff(got, seed):
    want = _interop_model(seed).state_dict()
    if set(got) != set(want):
        return ("keys differ", sorted(set(got) ^ set(want)))
    return max((got[k].float() - want[k].float()).abs().max().item() for k in want)


def _interop_broadcast(seed_target):
    """A full state dict on rank 0 only, broadcast into a dmuon model."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    model = _interop_build(seed_target, dedicate=True)
    sd = _interop_model(7).state_dict() if dist.get_rank() == 0 else {}
    set_model_state_dict(model, sd, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    full = _full_model_sd(model)
    return _max_diff(full, 7) if dist.get_rank() == 0 else None


def _case_interop_4(root):
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    plain = _interop_build(5, dedicate=False)
    dcp.save({"model": get_model_state_dict(plain)}, checkpoint_id=f"{root}/plain4")
    ours = _interop_build(6, dedicate=True)
    dcp.save({"model": get_model_state_dict(ours)}, checkpoint_id=f"{root}/dmuon4")
    out = dict(broadcast=_interop_broadcast(0))
    dist.barrier()
    return out


def _case_interop_2(root):
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    def load(model, path):
        sd = {"model": get_model_state_dict(model)}
        dcp.load(sd, checkpoint_id=path)
        set_model_state_dict(model, sd["model"])
        full = _full_model_sd(model)
        return full if dist.get_rank() == 0 else None

    ours = _interop_build(0, dedicate=True)
    plain_into_dmuon = load(ours, f"{root}/plain4")
    plain = _interop_build(0, dedicate=False)
    dmuon_into_plain = load(plain, f"{root}/dmuon4")
    out = dict(broadcast=_interop_broadcast(0))
    if dist.get_rank() == 0:
        out.update(plain_into_dmuon=_max_diff(plain_into_dmuon, 5), dmuon_into_plain=_max_diff(dmuon_into_plain, 6))
    dist.barrier()
    return out


FAULT_PG_TIMEOUT_S = 5  # gloo process-group timeout in the fault runs
FAULT_DMUON_TIMEOUT_S = 3  # dmuon's collective_timeout_s there
FAULT_DEADLINE_S = 30  # a survivor must have ended by then (it would hang forever otherwise)
FAULTS = ("broadcast", "reduce")  # the dmuon collective the survivor waits in when rank 1 exits


def _fault_rank(rank, world, port, root, where):
    """One rank of a fault run: a step, a DCP checkpoint, then rank 1 exits (``os._exit``, as a
    rank that stopped early or died) in the backward of a second model while the survivor waits
    in a dmuon collective: at the start of the backward, so the survivor waits in the last
    boundary's backward broadcast (``where="broadcast"``), or inside the first boundary's
    backward, after its backward broadcast and before its gradient reduce, so the survivor
    waits in that reduce (``"reduce"``). The second model is dedicated but not ``fully_shard``'ed:
    every collective of its forward and backward is dmuon's (FSDP2's all-gathers and
    reduce-scatters would otherwise meet the closed connection first, in FSDP2's own waits). The
    survivor records how it ended and how long it waited."""
    import datetime
    import os
    import pickle
    import time

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
    from torch.distributed.fsdp import fully_shard

    import dmuon
    from oracle import train_steps

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=FAULT_PG_TIMEOUT_S))
    model = make_model("tiny")
    dmuon.dedicate_params(model, collective_timeout_s=FAULT_DMUON_TIMEOUT_S)
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    opt = dmuon_optimizer(model)
    batches = global_batches(3)
    train_steps(model, opt, batches[:1])
    dcp.save(
        {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)},
        checkpoint_id=f"{root}/fault_{where}",
    )
    probe = make_model("tiny")
    dmuon.dedicate_params(probe, collective_timeout_s=FAULT_DMUON_TIMEOUT_S)
    dist.barrier()

    def leave(*args):
        return os._exit(0)

    def leave_in_backward(module, args):  # inside layers.0's forward: its compute weight's gradient hook
        module.weight.register_hook(leave)

    if rank == 1 and where == "reduce":
        probe.get_submodule("layers.0.fc1").register_forward_pre_hook(leave_in_backward)
    t0 = time.monotonic()
    try:
        loss = lm_loss(probe, batches[1].chunk(world)[rank])
        if rank == 1 and where == "broadcast":
            loss.register_hook(leave)
        loss.backward()
        result = ("no error", "")
    except BaseException as exc:  # noqa: BLE001
        result = (type(exc).__name__, str(exc))
    with open(f"{root}/fault_{where}_{rank}.pkl", "wb") as f:
        pickle.dump(dict(result=result, elapsed_s=time.monotonic() - t0), f)
    os._exit(0)


def _run_fault(root, where):
    import pickle

    from dist_utils import run_fault_ranks

    # start-up included (a loaded 2-core machine is slow)
    exitcodes, alive = run_fault_ranks(_fault_rank, 2, (root, where), deadline_s=240)
    try:
        with open(f"{root}/fault_{where}_0.pkl", "rb") as f:
            survivor = pickle.load(f)
    except FileNotFoundError:
        survivor = dict(result=("no record", f"survivor exit code {exitcodes[0]}"), elapsed_s=float("inf"))
    return dict(alive=alive, victim_exitcode=exitcodes[1], survivor=survivor)


def _case_resume_after_fault(root):
    """The checkpoint written before the kill loads and resumes bit-exactly."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    import dmuon
    from oracle import train_steps

    batches = global_batches(3)
    model, opt, _ = _build("tiny")
    want = train_steps(model, opt, batches)
    want_full = dmuon.full_state_dict(model)
    out = {}
    for where in FAULTS:
        model2, opt2, _ = _build("tiny")
        sd = {"model": get_model_state_dict(model2), "optim": get_optimizer_state_dict(model2, opt2)}
        dcp.load(sd, checkpoint_id=f"{root}/fault_{where}")
        set_model_state_dict(model2, sd["model"])
        set_optimizer_state_dict(model2, opt2, sd["optim"])
        got = train_steps(model2, opt2, batches[1:])
        full = dmuon.full_state_dict(model2)
        out[where] = got == want[1:] and (dist.get_rank() != 0 or all(torch.equal(full[k], want_full[k]) for k in full))
    dist.barrier()
    return out


def _case_missing_shard(root):
    """A DCP directory with a shard file removed: every rank fails to load, the model unchanged."""
    import os

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    import dmuon

    model, opt, _ = _build("tiny")
    path = f"{root}/missing_shard"
    dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=path)
    dist.barrier()
    if dist.get_rank() == 0:
        os.remove(os.path.join(path, sorted(f for f in os.listdir(path) if f.endswith(".distcp"))[-1]))
    dist.barrier()
    torch.manual_seed(1)
    target, _, _ = _build("tiny", opt=False)
    for p in target.parameters():  # make it differ from the checkpoint
        with torch.no_grad():
            p.add_(1.0)
    before = dmuon.full_state_dict(target)

    def load():
        sd = {"model": get_model_state_dict(target)}
        dcp.load(sd, checkpoint_id=path)
        set_model_state_dict(target, sd["model"])

    err = _catch(load)
    after = dmuon.full_state_dict(target)
    dist.barrier()
    dedicated = set(get_model_runtime(target).slots_by_fqn)
    same = {k: torch.equal(before[k], after[k]) for k in before} if dist.get_rank() == 0 else {}
    return dict(
        err=err,
        dedicated_unchanged=all(v for k, v in same.items() if k in dedicated),
        fsdp2_changed=sorted(k for k, v in same.items() if k not in dedicated and not v),
    )


# ----------------------------------------------------------------------------------------------
# the process groups
# ----------------------------------------------------------------------------------------------


def _worker4(root):
    torch.set_num_threads(1)
    return dict(
        amp_hsdp=_case_amp((2, 2), "plain"),
        skip_nonfinite=_case_skip_nonfinite(False),
        skip_nonfinite_clip=_case_skip_nonfinite(True),
        resume=_case_resume_fresh(root),
        groups_save=_case_groups_save(root),
        groups_hsdp=_case_groups_load(root, (2, 2)),
        interop=_case_interop_4(root),
    )


def _worker2(root):
    torch.set_num_threads(1)
    return dict(
        amp_unscale=_case_amp(None, "plain_unscale"),
        amp_sharded=_case_amp(None, "sharded"),
        order=_case_order_mistakes(),
        toggle_none=_case_requires_grad_toggle(True),
        toggle_zero=_case_requires_grad_toggle(False),
        late_grad=_case_requires_grad_toggle(True, late=True),
        torch_clip=_case_torch_clip(),
        dmuon_clip=_case_dmuon_clip(),
        predicate_changed=_case_predicate_changed(root),
        groups_n2=_case_groups_load(root, None),
        interop=_case_interop_2(root),
        resume_after_fault=_case_resume_after_fault(root),
        missing_shard=_case_missing_shard(root),
    )


def _worker1():
    torch.set_num_threads(1)
    return dict(order=_case_order_mistakes())


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("dmuon-reliability"))
    faults = {where: _run_fault(root, where) for where in FAULTS}
    r4 = run_distributed(_worker4, 4, root, timeout_s=300)
    r2 = run_distributed(_worker2, 2, root, timeout_s=240)
    r1 = run_distributed(_worker1, 1, timeout_s=120)
    return r4, r2, faults, r1


# ----------------------------------------------------------------------------------------------
# oracles
# ----------------------------------------------------------------------------------------------


def _reference_skipping(kind, dedicated, batches, skip):
    """torch.optim.Muon + AdamW, fp32 NS, one process; step ``skip`` is skipped by both."""
    model = make_model(kind)
    muon, adamw = reference_optimizers(model, dedicated)
    losses, states = [], []
    with fp32_newton_schulz():
        for step, batch in enumerate(batches):
            loss = lm_loss(model, batch)
            loss.backward()
            if step != skip:
                muon.step()
                adamw.step()
            muon.zero_grad()
            adamw.zero_grad()
            losses.append(loss.item())
            states.append({k: v.detach().clone() for k, v in model.state_dict().items()})
    return losses, states


def _assert_state_close(got, want, where):
    assert set(got) == set(want), where
    for k, w in want.items():
        scale = w.abs().max().item() or 1.0
        err = (got[k].float() - w).abs().max().item()
        assert err <= PARAM_TOL * scale, (where, k, err, scale)


# ----------------------------------------------------------------------------------------------
# tests
# ----------------------------------------------------------------------------------------------

AMP_CASES = [("amp_hsdp", 0), ("amp_unscale", 1), ("amp_sharded", 1)]  # (name, index of the run: r4, r2)


@pytest.mark.parametrize("name,which", AMP_CASES, ids=[c[0] for c in AMP_CASES])
def test_grad_scaler_skips_the_same_step_everywhere(runs, name, which):
    per_rank = [r[name] for r in runs[which]]
    r0 = per_rank[0]
    # the scale moves identically on every rank: x2 (growth_interval=1), /2 at the inf, x2, x2
    want_scales = [AMP_INIT_SCALE * f for f in (2.0, 1.0, 2.0, 4.0)]
    for r in per_rank:
        assert r["scales"] == want_scales, (name, r["scales"])
        # AdamW step counters: the skipped step advanced none
        assert r["adamw_steps"] == [[1.0], [1.0], [2.0], [3.0]], (name, r["adamw_steps"])
        # momenta of the matrices this rank owns: untouched by the skipped step
        for a, b in zip(r["momenta"][AMP_SKIP - 1], r["momenta"][AMP_SKIP]):
            assert torch.equal(a, b), name
    full = r0["full"]
    for k in full[AMP_SKIP]:  # parameters untouched by the skipped step
        assert torch.equal(full[AMP_SKIP - 1][k], full[AMP_SKIP][k]), (name, k)
    ref_losses, ref_states = _reference_skipping(
        "tiny", set(r0["dedicated"]), global_batches(AMP_STEPS, batch=12), AMP_SKIP
    )
    for step in range(AMP_STEPS):
        assert math.isclose(r0["losses"][step], ref_losses[step], rel_tol=LOSS_RTOL), (name, step)
        _assert_state_close(full[step], ref_states[step], f"{name} step {step}")


@pytest.mark.parametrize("name", ["skip_nonfinite", "skip_nonfinite_clip"])
def test_skip_nonfinite_skips_the_same_step_everywhere(runs, name):
    """W = 4, a NaN in one non-owner rank's local gradient of one matrix at step AMP_SKIP: every rank
    skips that whole step (parameters, momenta and AdamW step counters untouched), the run equals
    torch.optim.Muon + AdamW skipping the same step (fp32 NS: losses 1e-6, parameters 1e-4 of max),
    rank 0 alone says so once, naming the poisoned rank (seen before the reduce), and the flags cost
    one all-reduce of 2·W floats in step(), or none there when the clip's all-reduce carried them."""
    per_rank = [r[name] for r in runs[0]]
    world = len(per_rank)
    r0 = per_rank[0]
    poison = r0["poison_rank"]
    assert poison != 0  # the message comes from rank 0, about another rank
    for rank, r in enumerate(per_rank):
        assert r["skipped"] == [step == AMP_SKIP for step in range(AMP_STEPS)], (name, rank)
        assert r["skipped_steps"] == 1
        assert r["adamw_steps"] == [[1.0], [1.0], [2.0], [3.0]], (name, r["adamw_steps"])
        for a, b in zip(r["momenta"][AMP_SKIP - 1], r["momenta"][AMP_SKIP]):
            assert torch.equal(a, b), name
        if rank == 0:
            assert len(r["warnings"]) == 1, r["warnings"]
            msg = r["warnings"][0]
            assert f"optimizer step {AMP_SKIP + 1} (1-based) skipped on every rank (skip_nonfinite=True)" in msg, msg
            assert f"non-finite on rank(s) [{poison}] before the reduce" in msg, msg
        else:
            assert r["warnings"] == [], (rank, r["warnings"])
        flags = ("all_reduce", "other", 2 * world)
        for step, ops in enumerate(r["step_ops"]):
            if name == "skip_nonfinite":
                assert ops.count(flags) == 1, (step, ops)  # alone, once per step
            else:
                assert flags not in ops and [o for o in ops if o[1] == "other"] == [], (step, ops)
        if name == "skip_nonfinite_clip":  # the clip's one all-reduce: its norm term + the 2·W flags
            for ops in r["clip_ops"]:
                assert ops.count(("all_reduce", 1 + 2 * world)) == 1, ops
    full = r0["full"]
    for k in full[AMP_SKIP]:
        assert torch.equal(full[AMP_SKIP - 1][k], full[AMP_SKIP][k]), (name, k)
    ref_losses, ref_states = _reference_skipping(
        "tiny", set(r0["dedicated"]), global_batches(AMP_STEPS, batch=12), AMP_SKIP
    )
    for step in range(AMP_STEPS):  # the NaN is in a gradient: every loss is finite
        assert math.isclose(r0["losses"][step], ref_losses[step], rel_tol=LOSS_RTOL), (name, step)
        _assert_state_close(full[step], ref_states[step], f"{name} step {step}")


def test_resume_into_fresh_optimizer_where_ranks_own_nothing(runs):
    per_rank = [r["resume"] for r in runs[0]]
    assert [bool(r["owned"]) for r in per_rank].count(False) >= 1  # the trap needs a rank owning nothing
    for r in per_rank:
        assert r["state_at_construction"] > 0  # state exists from construction: no DCP dummy step
        assert r["res"] == r["cont"]  # bit-identical resume
        assert r["same_params"]


def test_load_state_dict_mismatch_errors_name_the_key_on_every_rank(runs):
    per_rank = [r["resume"]["errors"] for r in runs[0]]
    assert all(e == per_rank[0] for e in per_rank)  # the same error on every rank
    e = per_rank[0]
    assert e["extra_key"][0] == "ValueError" and "state key 7 indexes no parameter" in e["extra_key"][1], e
    assert e["missing_key"][0] == "ValueError", e
    assert (
        "'embed.weight' (key 2) has keys ['exp_avg', 'step'], expected ['exp_avg', 'exp_avg_sq', 'step']"
        in e["missing_key"][1]
    ), e
    assert e["other_model"][0] == "ValueError", e
    assert "Muon param group 0 holds 2 parameters here but 12 in the state dict" in e["other_model"][1], e
    assert "predicate" in e["other_model"][1], e


def test_set_up_order_mistakes_are_detected_on_every_rank(runs):
    per_rank = [r["order"] for r in runs[1]]
    assert per_rank[0] == per_rank[1]
    r = per_rank[0]
    order = (
        "dmuon.dedicate_params(model, mesh) -> fully_shard(block) for each block -> fully_shard(model) -> dmuon.Muon"
    )
    kind, msg = r["muon_before_fully_shard"]
    assert kind == "RuntimeError" and "17 of its parameters are no longer parameters of the model" in msg, msg
    assert "build dmuon.Muon after fully_shard" in msg and order in msg
    kind, msg = r["no_root_fully_shard"]
    assert kind == "RuntimeError" and "5 non-dedicated parameters ('embed.weight', 'norm.weight'" in msg, msg
    assert order in msg
    kind, msg = r["no_fully_shard"]
    assert kind == "RuntimeError" and "17 non-dedicated parameters" in msg and order in msg, msg
    # only the per-block calls skipped: the root unit manages everything, nothing drifts
    assert r["no_block_fully_shard"] is None


def test_set_up_order_on_one_rank(runs):
    """One data-parallel rank: fully_shard still replaces the parameters, so dmuon.Muon built
    before it would leave every non-dedicated parameter at its initial value; the first step
    says so. Without fully_shard nothing is averaged on one rank, so those orders are fine."""
    (r,) = [x["order"] for x in runs[3]]
    kind, msg = r["muon_before_fully_shard"]
    assert kind == "RuntimeError" and "17 of its parameters are no longer parameters of the model" in msg, msg
    assert "build dmuon.Muon after fully_shard" in msg
    assert r["no_root_fully_shard"] is None and r["no_fully_shard"] is None and r["no_block_fully_shard"] is None


def _reference_toggle(dedicated, set_to_none, late=False):
    model = make_model("tiny")
    muon, adamw = reference_optimizers(model, dedicated)
    losses = []
    with fp32_newton_schulz():
        for step, batch in enumerate(global_batches(TOGGLE_STEPS, batch=12)):
            _toggle(model, step, *((0, LATE_FROM) if late else ()))
            loss = lm_loss(model, batch)
            loss.backward()
            muon.step()
            adamw.step()
            muon.zero_grad(set_to_none=set_to_none)
            adamw.zero_grad(set_to_none=set_to_none)
            losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize(
    "name,set_to_none,late", [("toggle_none", True, False), ("toggle_zero", False, False), ("late_grad", True, True)]
)
def test_requires_grad_toggled_mid_run_matches_oracle(runs, name, set_to_none, late):
    """Toggled mid-run, or (late_grad) no gradient on any rank for the first steps, then present:
    untouched while absent (no momentum, no decay), then trained exactly as the oracle."""
    r0 = runs[1][0][name]
    ref_losses, ref_state = _reference_toggle(set(r0["dedicated"]), set_to_none, late)
    for step, (got, want) in enumerate(zip(r0["losses"], ref_losses)):
        assert math.isclose(got, want, rel_tol=LOSS_RTOL), (name, step, got, want)
    _assert_state_close(r0["full"], ref_state, name)


def test_torch_clip_grad_norm_gives_the_global_norm(runs):
    per_rank = [r["torch_clip"] for r in runs[1]]
    r0 = per_rank[0]
    assert per_rank[1]["norms"] == r0["norms"]
    model = make_model("tiny")
    dedicated = set(r0["dedicated"])
    muon, adamw = reference_optimizers(model, dedicated)
    with fp32_newton_schulz():
        for step, batch in enumerate(global_batches(2, batch=12)):
            lm_loss(model, batch).backward()
            want = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05).item()
            assert math.isclose(r0["norms"][step], want, rel_tol=1e-5), (step, r0["norms"][step], want)
            assert want > 0.05  # the clip bites
            muon.step()
            adamw.step()
            muon.zero_grad()
            adamw.zero_grad()
    _assert_state_close(r0["full"], {k: v.detach() for k, v in model.state_dict().items()}, "torch clip")
    for r in per_rank:
        assert r["err"] is None, r["err"]  # error_if_nonfinite=True is passed on, the norm is finite
        assert all(math.isclose(s, 0.05, rel_tol=1e-4) for s in r["strict"]), r["strict"]


def test_dmuon_clip_grad_norm_takes_torchs_signature_and_names_nonfinite_ranks(runs):
    per_rank = [r["dmuon_clip"] for r in runs[1]]
    r0 = per_rank[0]
    model = make_model("tiny")  # the single-process oracle's norm on the global batch
    lm_loss(model, global_batches(2, batch=12)[0]).backward()
    want = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05, error_if_nonfinite=True).item()
    for rank, r in enumerate(per_rank):
        assert math.isclose(r["norm"], want, rel_tol=1e-5) and math.isclose(r["norm_loop"], r["norm"], rel_tol=1e-6), r
        assert r["same_loop"]  # foreach=True and foreach=False scale identically
        # ledger: clip's collectives are charged to "other" (the all-reduce of one fp32 scalar,
        # 2*(k-1)*ceil(1/k)*4 = 8 B; the flags' all-gather of 3 int64, (k-1)*3*8 = 24 B) ...
        assert r["clip_ops"] == [
            ("all_reduce", "other", (0, 1), None, "torch.float32", 1, 8),
            ("all_gather", "other", (0, 1), None, "torch.int64", 3, 24),
        ], r["clip_ops"]
        assert r["clip_other"] == 32 and r["step_other"] == r["clip_ops"] + r["clip_ops"][:1]  # 2nd clip: no flags
        # ... and are no op of the plan's step: the step's other collectives are exactly the schedule's
        assert r["ops_match"] and r["step_nbytes"] == r["plan_nbytes"], rank
        # dmuon.comm at DEBUG logs each issued collective with its group's sequence number (NCCL's
        # watchdog SeqNum): the last line names the last op and the group's count after it
        op = f"all_gather (phase other) over global ranks (0, 1), 3 int64 elements, group sequence number {r['seq']}"
        assert len(r["logged"]) == 2 and r["logged"][-1] == f"dmuon rank {rank} issues {op}", r["logged"]
        assert r["last"] == op and r["logged"][0].startswith(f"dmuon rank {rank} issues all_reduce (phase other)")
    # a NaN in a gradient rank 1 holds: every rank raises the same error naming rank 1 and the parameter
    errs = [r["err"] for r in per_rank]
    assert errs[0] == errs[1] and errs[0][0] == "RuntimeError", errs
    msg = errs[0][1]
    assert "dmuon.clip_grad_norm_: the total norm of order 2 of the gradients is non-finite" in msg, msg
    assert (
        "global rank(s) [1] hold non-finite gradients" in msg and f"the first such parameter: {r0['target']!r}" in msg
    ), msg
    assert all(r["untouched"] for r in per_rank)  # raised before any gradient was scaled
    assert all(math.isnan(r["nan_norm"]) for r in per_rank)  # without the flag: torch's NaN norm


def test_checkpoint_after_predicate_change_says_the_dedicated_set_differs(runs):
    per_rank = [r["predicate_changed"]["err"] for r in runs[1]]
    for kind, msg in per_rank:
        assert kind == "CheckpointException", (kind, msg)  # DCP gathers every rank's planning error
        assert "dmuon: the checkpoint's dedicated set differs from this model's" in msg, msg
        assert "dedicated (Muon) in the checkpoint but AdamW here: optim.state.layers.0.gate.weight" in msg, msg


def _reference_groups():
    """torch.optim.Muon (groups 0, 2) + AdamW (groups 1, 3), LambdaLR each, uninterrupted."""
    model = make_model("tiny")
    from dmuon.plan import compile as compile_plan

    dedicated = set(compile_plan(model, 1).dedicated)
    named = dict(model.named_parameters())
    late = {n for n in named if n.startswith("layers.1.")}

    def pick(muon, late_):
        return [p for n, p in named.items() if (n in dedicated) == muon and (n in late) == late_]

    (lr0, wd0), (lr1, wd1), (lr2, wd2), (lr3, wd3) = GROUP_HP
    muon = torch.optim.Muon(
        [
            {"params": pick(True, False), "lr": lr0, "weight_decay": wd0},
            {"params": pick(True, True), "lr": lr2, "weight_decay": wd2},
        ],
        momentum=HP["momentum"],
    )
    adamw = torch.optim.AdamW(
        [
            {"params": pick(False, False), "lr": lr1, "weight_decay": wd1},
            {"params": pick(False, True), "lr": lr3, "weight_decay": wd3},
        ]
    )
    s_muon = torch.optim.lr_scheduler.LambdaLR(muon, [LAMBDAS[0], LAMBDAS[2]])
    s_adamw = torch.optim.lr_scheduler.LambdaLR(adamw, [LAMBDAS[1], LAMBDAS[3]])
    losses, lrs = [], []
    with fp32_newton_schulz():
        for batch in global_batches(GROUP_STEPS):
            loss = lm_loss(model, batch)
            loss.backward()
            muon.step()
            adamw.step()
            muon.zero_grad()
            adamw.zero_grad()
            s_muon.step()
            s_adamw.step()
            losses.append(loss.item())
            lrs.append(
                [
                    muon.param_groups[0]["lr"],
                    adamw.param_groups[0]["lr"],
                    muon.param_groups[1]["lr"],
                    adamw.param_groups[1]["lr"],
                ]
            )
    return losses, lrs, {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("name,which", [("groups_hsdp", 0), ("groups_n2", 1)])
def test_param_groups_and_lambda_lr_through_dcp_at_other_meshes(runs, name, which):
    ref_losses, ref_lrs, ref_state = _reference_groups()
    first = runs[0][0]["groups_save"]["first"]
    r0 = runs[which][0][name]
    for step, (got, want) in enumerate(zip(first + r0["losses"], ref_losses)):
        assert math.isclose(got, want, rel_tol=LOSS_RTOL), (name, step, got, want)
    # every group's hyper-parameters in the right group after the load (schedule at step 2) ...
    want_after_load = [(lr, wd) for lr, (_, wd) in zip(ref_lrs[GROUP_SAVE_AT - 1], GROUP_HP)]
    for got, want in zip(r0["after_load"], want_after_load):
        assert math.isclose(got[0], want[0], rel_tol=1e-12) and got[1] == want[1], (
            name,
            r0["after_load"],
            want_after_load,
        )
    # ... and the schedule continued to the end
    assert [g[0] for g in r0["groups"]] == [True, False, True, False]
    for (_, lr, wd, _), want_lr, (_, want_wd) in zip(r0["groups"], ref_lrs[-1], GROUP_HP):
        assert math.isclose(lr, want_lr, rel_tol=1e-12) and wd == want_wd, (name, r0["groups"])
    _assert_state_close(r0["full"], ref_state, name)


def test_plain_fsdp2_checkpoints_load_into_dmuon_and_back(runs):
    r4, r2 = runs[0][0]["interop"], runs[1][0]["interop"]
    assert r2["plain_into_dmuon"] == 0.0, r2  # plain FSDP2 at N=4 -> dmuon at N=2, exact
    assert r2["dmuon_into_plain"] == 0.0, r2  # dmuon at N=4 -> plain FSDP2 at N=2, exact
    assert r4["broadcast"] == 0.0 and r2["broadcast"] == 0.0, (r4, r2)  # rank-0 full state dict, N=4 and 2


@pytest.mark.parametrize("where", FAULTS)
def test_peer_exit_during_a_dmuon_collective_names_the_transport_error(runs, where):
    """Rank 1 exits while the survivor waits in a dmuon broadcast / reduce: the survivor raises
    dmuon's transport error at once (not a timeout), naming the boundary and phase, its step and
    forward count, the peer and the usual causes; the checkpoint written before resumes exactly."""
    import re

    fault = runs[2][where]
    assert fault["alive"] == [] and fault["victim_exitcode"] == 0, fault
    kind, msg = fault["survivor"]["result"]
    assert fault["survivor"]["elapsed_s"] < FAULT_DEADLINE_S, fault
    assert kind == "CollectiveTransportError", fault
    phase = "'layers.2' backward_broadcast" if where == "broadcast" else "' reduce"
    assert "dmuon: collective for boundary " in msg and phase in msg and "failed in the transport" in msg, msg
    assert "did not complete within" not in msg, msg
    waited = float(re.search(r"after ([0-9.]+) s of waiting", msg).group(1))
    assert waited < FAULT_DMUON_TIMEOUT_S, msg  # named at once, well within dmuon's timeout
    assert "global rank 0, 0 optimizer step(s) done" in msg and "grad-enabled forward(s) of this boundary" in msg, msg
    assert "(the only other rank: 1)" in msg and "the backend names the peer" in msg, msg
    causes = [
        msg.index(c)
        for c in ("stopped early or skipped a whole step", "a rank died", "rank-dependent number of micro-batches")
    ]
    assert causes == sorted(causes), msg
    assert "Last collective dmuon issued on this rank:" in msg, msg
    assert runs[1][0]["resume_after_fault"][where] and runs[1][1]["resume_after_fault"][where]


def test_missing_shard_file_fails_on_every_rank_and_leaves_the_model_unchanged(runs):
    per_rank = [r["missing_shard"] for r in runs[1]]
    for r in per_rank:  # every rank raises DCP's gathered error naming the missing file
        assert r["err"] is not None and r["err"][0] == "CheckpointException", r["err"]
        assert "No such file or directory" in r["err"][1] and ".distcp" in r["err"][1], r["err"]
    # the dedicated matrices are loaded from staged copies (written only by set_model_state_dict):
    # untouched; FSDP2's shards are DCP's in-place targets: the surviving files' shards were written
    assert per_rank[0]["dedicated_unchanged"], per_rank[0]
