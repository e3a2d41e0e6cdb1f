"""dmuon under ``torch.distributed.pipelining`` against the single-process oracle.

One launch of W = 4 gloo processes on a ``("pp", "dp")`` mesh of (2, 2) runs every case but one
(each case is its own test); a second launch of W = 8 runs the stages on HSDP meshes,
``("pp", "replicate", "shard")`` of (2, 2, 2). The model (4 blocks of uneven matrices) is split the way torchtitan
splits it (a deep copy per stage with the other stages' layers deleted, FQNs kept), each stage
is dedicated over its stage's ``mesh["dp"]``, ``fully_shard`` per block then the stage, wrapped
in a ``PipelineStage``, and driven by a schedule with 4 micro-batches. Each case checks against
single-process ``torch.optim.Muon`` + ``AdamW`` on the whole model over the same global batch
(fp32 Newton-Schulz on both sides):

* losses within 1e-6 relative, final parameters within 1e-4 of each tensor's max magnitude;
* every dedicated matrix's gradient on its owner before ``step()`` equal to the reference's
  (within 1e-5 of its max): reduced once, averaged over every micro-batch and data-parallel
  rank, the schedule's micro-batch scaling applied once, with ``scale_grads=True`` and
  ``False`` (Muon's update does not see a uniform gradient scale; the gradients do);
* the bytes each stage moves per step (ledger, summed over its data-parallel ranks) equal to
  :func:`dmuon.plan.pipeline_cost` of its plan for 4 micro-batches (after the first step,
  whose shape inference runs one more forward; from the first step with static stage shapes);
* clipping: ``dmuon.clip_grad_norm_`` over a rank's stages returns the reference's norm of the
  whole model's gradients, and the clipped run still matches the clipped reference;
* a mutant whose dedicated reduce is skipped fails the oracle (its gradients and parameters
  leave the bounds), and without dmuon's reduce wrapper ``step()`` raises on every rank;
* ``dmuon.Muon(skip_nonfinite=True)``: a NaN in one stage's gradient on one rank skips the step
  on every rank of every stage, against the oracle that skips that step;
* a split whose first rank holds only the embedding (or whose last rank holds only the final norm
  and the head), so that its stage dedicates nothing: clipping and ``skip_nonfinite`` run the same
  collectives there (a NaN in the lone embedding's gradient on one rank skips that step on every
  rank), the norms and the run against the oracle;
* a zero-bubble schedule raises the same ``NotImplementedError`` on every rank at its first step;
* checkpoints across layouts, in the same launch: a DCP checkpoint (model + flattened optimizer
  state) saved at (pp 2, dp 2) after one GPipe step, loaded into fresh stages at (pp 2, dp 2)
  with ``set_optimizer_state_dict(flatten_optimizer_state_dict=True)`` (the next steps
  bit-identical to the uninterrupted run; without dmuon's ``dcp.unflatten_optim`` integration the
  same ``ValueError`` on every rank, not a hang) and into the whole model at (pp 1, dp 4) through
  the patch-free unflattening (the next steps against the oracle);
* tied embeddings across the first and last stage (declared ``enable_weight_tying``): the same
  ``NotImplementedError`` on every rank at ``dedicate_params``;
* QK-clip: an attention model split in two stages (GPipe, shape inference included) against the
  single-process oracle whose max logits are taken over the whole global batch (clipped heads and
  largest logit per stage and step, losses, parameters);
* expert parallelism: an MoE model at pp 2 x ep 2 on a ``("pp", "efsdp", "ep")`` mesh against the
  single-process oracle (every expert's matrices Muon's, fp32 Newton-Schulz).
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from dmuon.testing import FP32_LOSS_RTOL, FP32_PARAM_TOL
from oracle import HP, Block, ReferenceOptimizer, dmuon_muon_kwargs, dmuon_optimizer, proxies_for
from shared_launch import shared_run

M = 4  # micro-batches
STEPS = 3
VOCAB, D, LAYERS = 11, 8, 4
GRAD_TOL = 1e-5  # gradients: fp32 sums in another order (measured ~1e-7 of max)
CLIP = 0.05  # well below the gradient norms here (~1): clipping acts every step
NAN_STEP = 1  # nan_skip: the step whose gradient holds a NaN on one rank of the last stage

# (label, schedule, reshard_after_forward (None: dmuon's default under PP, Z2), scale_grads, extra)
CASES = [
    ("gpipe_z2", "gpipe", None, True, ""),
    ("gpipe_z3", "gpipe", True, True, ""),
    ("1f1b_z2_noscale", "1f1b", False, False, ""),
    ("1f1b_z3_static_clip", "1f1b", True, True, "static,clip"),
    ("interleaved_z2", "interleaved", False, True, ""),
    ("interleaved_z3_clip", "interleaved", True, True, "clip,per_stage_optimizer"),
    ("loopedbfs_z3", "loopedbfs", True, True, ""),
    ("1f1b_z3_autograd_reduce", "1f1b", True, True, "no_root_fsdp"),
    ("skipped_reduce", "gpipe", False, True, "skip_reduce"),
    ("gpipe_z2_nan_skip", "gpipe", None, True, "nan_skip"),
    # a pipeline rank whose stage dedicates nothing: the embedding alone (a NaN in its gradient on
    # one rank skips the step), or the head alone
    ("gpipe_z2_embed_alone_clip_nan_skip", "gpipe", None, True, "embed_alone,clip,nan_skip"),
    ("gpipe_z3_head_alone_clip_skip_nonfinite", "gpipe", True, True, "head_alone,clip,skip_nonfinite"),
]
LABELS = [c[0] for c in CASES]
# W = 8 as (pp 2, replicate 2, shard 2): every stage on an HSDP mesh (one more launch)
HSDP_CASES = [("hsdp_gpipe_z2_clip", "gpipe", None, True, "clip")]
HSDP_LABELS = [c[0] for c in HSDP_CASES]
ALL_CASES = CASES + HSDP_CASES


class PPLM(nn.Module):
    """Token model whose blocks live at ``layers.<i>`` of a ``ModuleDict`` (torchtitan's layout:
    deleting a stage's foreign blocks keeps the others' FQNs)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.layers = nn.ModuleDict({str(i): Block(D) for i in range(LAYERS)})
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, VOCAB)

    def forward(self, x):
        if self.embed is not None:
            x = self.embed(x)
        for layer in self.layers.values():
            x = layer(x)
        if self.head is not None:
            x = self.head(self.norm(x))
        return x


def make_full() -> PPLM:
    torch.manual_seed(0)
    return PPLM()


def split_stage(full: PPLM, stage: int, num_stages: int, alone: str = "") -> PPLM:
    """torchtitan's split: a deep copy, the other stages' blocks deleted, FQNs kept. ``alone``
    (two stages): ``"embed"`` gives stage 0 the embedding and no block, ``"head"`` gives stage 1
    the final norm and the head and no block."""
    m = copy.deepcopy(full)
    per = LAYERS // num_stages
    keep = {str(i) for i in range(stage * per, (stage + 1) * per)}
    if alone:
        bare = 0 if alone == "embed" else 1
        keep = set() if stage == bare else {str(i) for i in range(LAYERS)}
    for k in list(m.layers.keys()):
        if k not in keep:
            del m.layers[k]
    if stage != 0:
        m.embed = None
    if stage != num_stages - 1:
        m.norm = None
        m.head = None
    return m


def batches():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (16, 6), generator=g) for _ in range(STEPS)]


def ce(out, target):
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), target.reshape(-1))


def ce_over_microbatches(out, target):  # scale_grads=False: the loss carries the 1/M itself
    return ce(out, target) / M


def reference(clip: bool, skip_step: int | None = None):
    """Single process, global batch: losses, dedicated gradients per step, final state, norms;
    ``skip_step``: that step's update is skipped (its gradients are dropped)."""
    from dmuon.plan import compile as compile_plan

    model = make_full()
    dedicated = set(compile_plan(copy.deepcopy(model), 2).dedicated)
    named = dict(model.named_parameters())
    opt = ReferenceOptimizer(
        model, {n: proxies_for(p.shape) for n, p in named.items() if n in dedicated}, ns_dtype=torch.float32, **HP
    )
    losses, grads, norms = [], [], []
    for batch in batches():
        loss = ce(model(batch[:, :-1]), batch[:, 1:])
        loss.backward()
        grads.append({n: named[n].grad.detach().clone() for n in dedicated})
        if clip:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        if len(losses) != skip_step:
            opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return dict(
        losses=losses, grads=grads, norms=norms, state={k: v.detach().clone() for k, v in model.state_dict().items()}
    )


def _case(label, sched_name, z3, scale_grads, extra, mesh):
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining import schedules as S

    import dmuon
    from dmuon import _registry
    from dmuon.exec import dedicated_info, get_model_runtime, metered

    extra = set(extra.split(",")) - {""}
    pp = mesh["pp"].get_local_rank()
    dp_mesh, dp, dp_size = _dp(mesh)
    V = 2 if sched_name in ("interleaved", "loopedbfs") else 1
    num_stages = 2 * V
    stage_ids = [pp + 2 * v for v in range(V)]
    full = make_full()
    mods, stages, plans = [], [], []
    mb = 16 // 2 // M
    alone = next((a for a in ("embed", "head") if f"{a}_alone" in extra), "")
    for si in stage_ids:
        m = split_stage(full, si, num_stages, alone)
        kw = {} if z3 is None else dict(reshard_after_forward=z3)
        plans.append(dmuon.dedicate_params(m, dp_mesh, **kw))
        for layer in m.layers.values():
            fully_shard(layer, mesh=dp_mesh)
        if "no_root_fsdp" in extra:
            # the stage itself is no FSDPModule: pipelining runs plain backwards (gradient sync on),
            # so dmuon reduces through its autograd hooks, and not again at REDUCE_GRAD
            for sub in (m.embed, m.norm, m.head):
                if sub is not None:
                    fully_shard(sub, mesh=dp_mesh)
        else:
            fully_shard(m, mesh=dp_mesh)
        mods.append(m)
        static = {}
        if "static" in extra:
            x_in = torch.zeros(mb, 5, dtype=torch.long) if si == 0 else torch.zeros(mb, 5, D, requires_grad=True)
            x_out = torch.zeros(mb, 5, VOCAB if si == num_stages - 1 else D, requires_grad=True)
            static = dict(input_args=(x_in,), output_args=(x_out,))
        stages.append(PipelineStage(m, si, num_stages, torch.device("cpu"), group=mesh["pp"].get_group(), **static))
    loss_fn = ce if scale_grads else ce_over_microbatches
    if sched_name == "gpipe":
        sched = S.ScheduleGPipe(stages[0], M, loss_fn=loss_fn, scale_grads=scale_grads)
    elif sched_name == "1f1b":
        sched = S.Schedule1F1B(stages[0], M, loss_fn=loss_fn, scale_grads=scale_grads)
    elif sched_name == "loopedbfs":
        sched = S.ScheduleLoopedBFS(stages, M, loss_fn=loss_fn, scale_grads=scale_grads)
    else:
        sched = S.ScheduleInterleaved1F1B(stages, M, loss_fn=loss_fn, scale_grads=scale_grads)
    # one dmuon.Muon over every stage this rank holds, or one per stage (docs/pipeline_parallel.md)
    opts = (
        [dmuon_optimizer(m) for m in mods] if "per_stage_optimizer" in extra else [dmuon_optimizer(nn.ModuleList(mods))]
    )
    if {"nan_skip", "skip_nonfinite"} & extra:
        opts = [dmuon.Muon(nn.ModuleList(mods), **dmuon_muon_kwargs(torch.float32), skip_nonfinite=True)]
    skipped = []
    removed = []
    if "skip_reduce" in extra:  # the mutant: dmuon's reduce at the schedule's REDUCE_GRAD is skipped
        removed = _registry.uninstall("pipelining.reduce_grad")
    losses, grads, ledgers, norms, step_error = [], [], [], [], None
    try:
        for step, batch in enumerate(batches()):
            x, y = batch[:, :-1].chunk(dp_size)[dp], batch[:, 1:].chunk(dp_size)[dp]
            out = []
            with metered() as led:
                if 0 in stage_ids:
                    sched.step(x, target=y, losses=out)
                elif num_stages - 1 in stage_ids:
                    sched.step(target=y, losses=out)
                else:
                    sched.step()
            ledgers.append({p: v for p, v in led.snapshot().items() if v})
            if "skip_reduce" in extra:
                if step == 0:
                    try:
                        opts[0].step()  # dmuon's guard: unreduced local gradients
                    except RuntimeError as exc:
                        step_error = str(exc)
                for m in mods:  # what a run without the guard would do: the local gradients are dropped
                    for b in get_model_runtime(m).boundaries:
                        for slot in b.installable:
                            slot.compute.grad = None
            grads.append(
                {
                    info.fqn: p.grad.detach().clone()
                    for m in mods
                    for p in m.parameters()
                    if (info := dedicated_info(p)) is not None and info.is_owner and p.grad is not None
                }
            )
            if "nan_skip" in extra and step == NAN_STEP and dp == 0:
                # an FSDP2 shard of the last stage's head (embed_alone: of the bare first stage's
                # embedding), on one rank, before the clip
                g = None
                if "embed_alone" in extra and 0 in stage_ids:
                    g = mods[0].embed.weight.grad
                elif "embed_alone" not in extra and num_stages - 1 in stage_ids:
                    g = mods[-1].head.weight.grad
                if g is not None:
                    (g.to_local() if hasattr(g, "to_local") else g).view(-1)[0] = float("nan")
            if "clip" in extra:
                norms.append(float(dmuon.clip_grad_norm_([p for m in mods for p in m.parameters()], CLIP)))
            with metered() as led_step:  # HSDP: the replicate broadcasts after the owners' update
                for opt in opts:
                    opt.step()
                    skipped.append(bool(getattr(opt, "last_step_skipped", False)))
                    opt.zero_grad()
            for p, v in led_step.snapshot().items():
                if v:
                    ledgers[-1][p] = ledgers[-1].get(p, 0) + v
            per_mb = 1 if scale_grads else M  # scale_grads=False: the schedule's losses carry 1/M
            loss = torch.tensor(sum(float(v) for v in out) * per_mb / M if out else 0.0)
            dist.all_reduce(loss)  # the last stage's dp ranks hold the losses
            losses.append(loss.item() / dp_size)
    finally:
        if removed:
            _registry.install(*removed)
    full_state = {}
    for m in mods:
        sd = get_model_state_dict(m, options=StateDictOptions(full_state_dict=True))
        full_state.update({k: v.detach().clone() for k, v in sd.items()})
    # the zero-bubble refusal, on the stages of the interleaved case (two per rank)
    refusal = None
    if sched_name == "interleaved" and z3 is False:
        zb = S.ScheduleInterleavedZeroBubble(stages, M, loss_fn=loss_fn)
        try:
            x = batches()[0][:, :-1].chunk(2)[dp]
            zb.step(x) if 0 in stage_ids else zb.step()
        except NotImplementedError as exc:
            refusal = str(exc)
    costs = [dmuon.plan.pipeline_cost(p, M) for p in plans]
    return dict(
        stages=stage_ids,
        reshard=[p.reshard_after_forward for p in plans],
        losses=losses,
        grads=grads,
        ledgers=ledgers,
        norms=norms,
        step_error=step_error,
        skipped=skipped,
        refusal=refusal,
        state=full_state if dp == 0 else None,
        cost_total=sum(c.total_nbytes for c in costs),
        cost_phases={
            f: sum(getattr(c, f) for c in costs)
            for f in ("forward_broadcast_nbytes", "backward_broadcast_nbytes", "reduce_nbytes")
        },
    )


def _dp(mesh):
    """The stage's data-parallel mesh, this rank's index in it and its size: ``mesh["dp"]`` of
    ``("pp", "dp")``, or the HSDP ``mesh["replicate", "shard"]`` of ``("pp", "replicate", "shard")``."""
    if "dp" in mesh.mesh_dim_names:
        return mesh["dp"], mesh["dp"].get_local_rank(), mesh["dp"].size()
    r, s = mesh["replicate"].get_local_rank(), mesh["shard"].get_local_rank()
    return mesh["replicate", "shard"], r * mesh["shard"].size() + s, mesh["replicate"].size() * mesh["shard"].size()


def _errors(mesh):
    """User errors, each raised alike on every rank: the whole ("pp", "dp") mesh passed, and two
    ranks of one stage holding different plans (only stage 0's differ; stage 1's ranks agree)."""
    import dmuon

    pp, dp = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    out = {}
    try:
        dmuon.dedicate_params(split_stage(make_full(), pp, 2), mesh)
    except ValueError as exc:
        out["whole_mesh"] = str(exc)
    stage = split_stage(make_full(), pp, 2)
    skip = "layers.0.fc1.weight" if (pp, dp) == (0, 1) else None
    try:
        dmuon.dedicate_params(
            stage, mesh["dp"], predicate=lambda fqn, p: fqn.startswith("layers.") and p.ndim == 2 and fqn != skip
        )
    except RuntimeError as exc:
        out["plans_differ"] = str(exc)
    tied = make_full()  # the head tied to the embedding, declared as torchtitan declares it
    tied.enable_weight_tying = True
    tied.head.weight = tied.embed.weight
    try:
        dmuon.dedicate_params(split_stage(tied, pp, 2), mesh["dp"])
    except NotImplementedError as exc:
        out["tied"] = str(exc)
    return out


SAVE_AT = 1  # steps at (pp 2, dp 2) before the checkpoint; the runs continue to STEPS


def _checkpoint_state(m, opt):
    """The stage's sharded model and optimizer state dicts, the optimizer's flattened to one key per
    parameter (``state.<fqn>.<name>``, ``param_groups.<fqn>.<name>``): the stages hold different
    parameters, and a flattened state dict keeps their param groups from colliding in the checkpoint."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    flat = StateDictOptions(flatten_optimizer_state_dict=True)
    return {"model": get_model_state_dict(m), "optim": get_optimizer_state_dict(m, opt, options=flat)}


def _checkpoint_load_flat(m, opt, path):
    """Load the checkpoint at ``path`` into ``m`` and ``opt`` with torch's own unflattening,
    ``set_optimizer_state_dict(..., flatten_optimizer_state_dict=True)`` (dmuon's
    ``dcp.unflatten_optim`` integration gives every rank the momentum names it does not hold)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    sd = _checkpoint_state(m, opt)
    dcp.load(sd, checkpoint_id=path)
    set_model_state_dict(m, sd["model"])
    set_optimizer_state_dict(m, opt, sd["optim"], options=StateDictOptions(flatten_optimizer_state_dict=True))


def _checkpoint_load(m, opt, path):
    """Load the checkpoint at ``path`` into ``m`` and ``opt`` without patches (the recipe of
    docs/pipeline_parallel.md): the flattened optimizer state is unflattened against
    ``get_optimizer_state_dict``'s own layout (every dedicated matrix's momentum on every rank)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    sd = _checkpoint_state(m, opt)
    dcp.load(sd, checkpoint_id=path)
    set_model_state_dict(m, sd["model"])
    flat, layout = sd["optim"], get_optimizer_state_dict(m, opt)
    state = {fqn: {k: flat[f"state.{fqn}.{k}"] for k in entry} for fqn, entry in layout["state"].items()}
    groups = [
        {k: (v if k == "params" else flat[f"param_groups.{g['params'][0]}.{k}"]) for k, v in g.items()}
        for g in layout["param_groups"]
    ]
    set_optimizer_state_dict(m, opt, {"state": state, "param_groups": groups})


def _full_state(m):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    sd = get_model_state_dict(m, options=StateDictOptions(full_state_dict=True))
    return {k: v.detach().clone() for k, v in sd.items()}


def _checkpoint_across_layouts(mesh):
    """A DCP checkpoint (model + optimizer) saved at (pp 2, dp 2) after SAVE_AT GPipe steps, loaded
    at (pp 2, dp 2) and at (pp 1, dp 4) (the whole model on a 1-D mesh of 4), each continued to STEPS."""
    import shutil
    import tempfile

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    import dmuon
    from dmuon import _registry

    pp, dp = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    refusal = None
    holder = [tempfile.mkdtemp(prefix="dmuon-pp-ckpt-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(holder, src=0)
    path = holder[0]
    data = batches()

    def build_stage():
        m = split_stage(make_full(), pp, 2)
        dmuon.dedicate_params(m, mesh["dp"])
        for layer in m.layers.values():
            fully_shard(layer, mesh=mesh["dp"])
        fully_shard(m, mesh=mesh["dp"])
        opt = dmuon_optimizer(m)
        opt.init_state()  # torch's DCP helpers would otherwise dummy-step an empty state
        stage = PipelineStage(m, pp, 2, torch.device("cpu"), group=mesh["pp"].get_group())
        return m, opt, ScheduleGPipe(stage, M, loss_fn=ce)

    def pp_steps(m, opt, sched, steps):
        losses = []
        for batch in steps:
            x, y = batch[:, :-1].chunk(2)[dp], batch[:, 1:].chunk(2)[dp]
            out = []
            sched.step(x, target=y, losses=out) if pp == 0 else sched.step(target=y, losses=out)
            opt.step()
            opt.zero_grad()
            loss = torch.tensor(sum(float(v) for v in out) / M if out else 0.0)
            dist.all_reduce(loss)
            losses.append(loss.item() / 2)
        return losses

    try:
        m, opt, sched = build_stage()
        pp_steps(m, opt, sched, data[:SAVE_AT])
        dcp.save(_checkpoint_state(m, opt), checkpoint_id=path)
        straight = pp_steps(m, opt, sched, data[SAVE_AT:])  # the uninterrupted run
        straight_state = _full_state(m)
        dist.barrier()

        m, opt, sched = build_stage()  # the same layout, fresh
        removed = _registry.uninstall("dcp.unflatten_optim")  # torch's unflattening alone: refused alike
        try:
            _checkpoint_load_flat(m, opt, path)
        except ValueError as exc:
            refusal = str(exc)
        finally:
            _registry.install(*removed)
        _checkpoint_load_flat(m, opt, path)
        resumed = pp_steps(m, opt, sched, data[SAVE_AT:])
        resumed_state = _full_state(m)
        dist.barrier()

        flat_mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))  # (pp 1, dp 4)
        rank, world = flat_mesh.get_local_rank(), 4
        full = make_full()
        dmuon.dedicate_params(full, flat_mesh)
        for layer in full.layers.values():
            fully_shard(layer, mesh=flat_mesh)
        fully_shard(full, mesh=flat_mesh)
        opt = dmuon_optimizer(full)
        opt.init_state()
        _checkpoint_load(full, opt, path)
        flat_losses = []
        for batch in data[SAVE_AT:]:
            loss = ce(full(batch[:, :-1].chunk(world)[rank]), batch[:, 1:].chunk(world)[rank])
            loss.backward()
            opt.step()
            opt.zero_grad()
            loss = loss.detach().clone()
            dist.all_reduce(loss)
            flat_losses.append(loss.item() / world)
        flat_state = _full_state(full)
        dist.barrier()
    finally:
        if dist.get_rank() == 0:
            shutil.rmtree(path, ignore_errors=True)
    return dict(
        stage=pp,
        straight=straight,
        resumed=resumed,
        straight_state=straight_state if dp == 0 else None,
        resumed_state=resumed_state if dp == 0 else None,
        flat_losses=flat_losses,
        flat_state=flat_state if rank == 0 else None,
        refusal=refusal,
    )


# ---------------------------------------------------------------------------------------------- QK-clip

QK_GAIN = 2.0  # large logits, different per head: some heads above tau, some below (tests/attn_models.py)


class PPAttnLM(nn.Module):
    """``tests/attn_models.AttnLM``'s embedding, blocks and head with the blocks at ``layers.<i>`` of a
    ``ModuleDict`` (the same FQNs), so that a stage can drop the others' blocks."""

    def __init__(self, src):
        super().__init__()
        self.embed = src.embed
        self.layers = nn.ModuleDict({str(i): layer for i, layer in enumerate(src.layers)})
        self.head = src.head

    def forward(self, x):
        if self.embed is not None:
            x = self.embed(x)
        for layer in self.layers.values():
            x = layer(x)
        return self.head(x) if self.head is not None else x


def _attn_full():
    from attn_models import AttnLM

    return AttnLM("gqa", gain=QK_GAIN)  # seeded inside: the same model in every process


def _attn_batches():
    from oracle import global_batches

    return global_batches(STEPS, batch=16, seq=6, vocab=7, seed=5)


def _qk_spec(model, tau):
    from dmuon.plan._records.qk_clip_records import attention_qk_clip

    return attention_qk_clip(model, tau, suffix="attn", q="q_proj", k="k_proj", num_heads=4, num_kv_heads=2, head_dim=4)


def _qk_tau() -> float:
    """Between the heads' max logits over the first global batch (the 2nd and 3rd smallest of 8, both
    layers' heads in it): heads of both stages above it, some of the first stage's below."""
    model, vals = _attn_full(), []
    for layer in model.layers:
        layer.attn.report = lambda m, s: vals.extend(s.tolist())
    with torch.enable_grad():
        model(_attn_batches()[0][:, :-1])
    vals.sort()
    return 0.5 * (vals[1] + vals[2])


def qk_reference():
    """Single process, global batch: the step's max logits over the WHOLE batch per attention module,
    then torch.optim.Muon + AdamW (fp32 Newton-Schulz), then the clip rule (independent of dmuon's)."""
    from attn_models import apply_clip_reference

    from dmuon.plan import compile as compile_plan

    model = _attn_full()
    tau = _qk_tau()
    qk = _qk_spec(model, tau)
    dedicated = set(compile_plan(copy.deepcopy(model), 2).dedicated)
    params = dict(model.named_parameters())
    opt = ReferenceOptimizer(
        model, {n: proxies_for(p.shape) for n, p in params.items() if n in dedicated}, ns_dtype=torch.float32, **HP
    )
    names = {m: n for n, m in model.named_modules()}
    maxes: dict[str, torch.Tensor] = {}

    def recorder(module, s):
        n = names[module]
        maxes[n] = s.detach().clone() if n not in maxes else torch.maximum(maxes[n], s.detach())

    for layer in model.layers:
        layer.attn.report = recorder
    losses, per_step = [], []
    for batch in _attn_batches():
        maxes.clear()
        loss = ce(model(batch[:, :-1]), batch[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad()
        step = {}
        for stage in (0, 1):  # one layer per stage: layers.<stage>
            sub = dataclasses.replace(
                qk, attention=tuple(a for a in qk.attention if a.module.startswith(f"layers.{stage}."))
            )
            step[stage] = (
                sum(int((maxes[a.module] > tau).sum()) for a in sub.attention),
                max(float(maxes[a.module].max()) for a in sub.attention),
            )
        apply_clip_reference(params, qk, maxes)
        per_step.append(step)
        losses.append(loss.item())
    return dict(losses=losses, per_step=per_step, state={k: v.detach().clone() for k, v in model.state_dict().items()})


def _qk_clip_case(mesh):
    """GPipe, 4 micro-batches, Z2: each stage (one attention block) has its own QK-clip spec; the
    shape inference of the first step runs a forward that must not count. That forward's input on
    the second stage is ``torch.empty``: here filled with NaN (uninitialised memory may hold any
    bits), so that counting it would leave every head of the second stage unclipped that step."""
    from torch.distributed.pipelining import stage as pipeline_stage

    to_tensor = pipeline_stage.PipelineStage._to_tensor

    def loud_to_tensor(self, arg):
        t = to_tensor(self, arg)
        if not isinstance(arg, torch.Tensor) and t.is_floating_point():  # materialised from metadata
            with torch.no_grad():
                t.fill_(float("nan"))
        return t

    pipeline_stage.PipelineStage._to_tensor = loud_to_tensor
    try:
        return _qk_clip_run(mesh)
    finally:
        pipeline_stage.PipelineStage._to_tensor = to_tensor


def _qk_clip_run(mesh):
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    import dmuon

    pp, dp = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    tau = _qk_tau()
    m = PPAttnLM(_attn_full())
    for k in list(m.layers.keys()):
        if k != str(pp):
            del m.layers[k]
    if pp != 0:
        m.embed = None
    if pp != 1:
        m.head = None
    dmuon.dedicate_params(m, mesh["dp"], qk_clip=_qk_spec(m, tau))
    for layer in m.layers.values():
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(m, mesh=mesh["dp"])
    opt = dmuon_optimizer(m)
    sched = ScheduleGPipe(PipelineStage(m, pp, 2, torch.device("cpu"), group=mesh["pp"].get_group()), M, loss_fn=ce)
    losses, stats = [], []
    for batch in _attn_batches():
        x, y = batch[:, :-1].chunk(2)[dp], batch[:, 1:].chunk(2)[dp]
        out = []
        sched.step(x, target=y, losses=out) if pp == 0 else sched.step(target=y, losses=out)
        opt.step()
        opt.zero_grad()
        st = dmuon.qk_clip.stats(m)
        stats.append((st["clipped_heads"], st["max_logit"]))
        loss = torch.tensor(sum(float(v) for v in out) / M if out else 0.0)
        dist.all_reduce(loss)
        losses.append(loss.item() / 2)
    state = _full_state(m)  # a collective: on every rank
    return dict(stage=pp, losses=losses, stats=stats, state=state if dp == 0 else None)


# ---------------------------------------------------------------------------------------------- MoE, EP

MOE_HP = dict(lr=0.02, weight_decay=0.1, adamw_lr=3e-3)  # tests/exec/test_moe_ep.py's


class PPMoE(nn.Module):
    """One stage of ``tests/moe_ep_models.MoELM`` (two blocks): the embedding and block 0, or block 1,
    the norm and the head, at the full model's FQNs."""

    def __init__(self, src, stage: int):
        super().__init__()
        self.embed = src.embed if stage == 0 else None
        self.layers = nn.ModuleDict({str(stage): src.layers[stage]})
        self.norm = src.norm if stage == 1 else None
        self.lm_head = src.lm_head if stage == 1 else None

    def forward(self, x):
        if self.embed is not None:
            x = self.embed(x)
        for layer in self.layers.values():
            x = layer(x)
        return self.lm_head(self.norm(x)) if self.lm_head is not None else x


def _moe_batches():
    from moe_ep_models import global_batches as moe_batches

    return moe_batches(STEPS, 2, per_rank=8)  # 16 sequences: 8 per data-parallel rank, 2 per micro-batch


def moe_reference():
    import dmuon.plan as P
    import dmuon.testing
    from moe_ep_models import full_model, lm_loss as moe_loss

    proxies = dmuon.testing.proxies_from_plan(P.compile(full_model(), 2))
    return dmuon.testing.reference_run(
        full_model(), moe_loss, _moe_batches(), proxies, ns_dtype=torch.float32, **MOE_HP
    )


def _moe_ep_case():
    """pp 2 x ep 2 (efsdp 1) on a ("pp", "efsdp", "ep") mesh: each stage's two ranks hold half of its
    experts each and route tokens between them (all-to-all over mesh["ep"]); GPipe, 4 micro-batches."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    import dmuon
    from dmuon.exec import dedicated_info
    from moe_ep_models import ep_model

    mesh = init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("pp", "efsdp", "ep"))
    pp, ep_mesh = mesh["pp"].get_local_rank(), mesh["ep"]
    er = ep_mesh.get_local_rank()
    m = PPMoE(ep_model(2, er, group=ep_mesh.get_group()), pp)
    plan = dmuon.dedicate_params(m, ep_mesh)  # a 1-D mesh named "ep": ep = 2
    for layer in m.layers.values():
        fully_shard(layer, mesh=ep_mesh)
    fully_shard(m, mesh=ep_mesh)
    opt = dmuon.Muon(m, ns_dtype=torch.float32, **MOE_HP)
    local_experts = sum(1 for p in m.parameters() if getattr(dedicated_info(p), "ep_local", False))

    def loss_fn(out, target):
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), target.reshape(-1))

    sched = ScheduleGPipe(
        PipelineStage(m, pp, 2, torch.device("cpu"), group=mesh["pp"].get_group()), M, loss_fn=loss_fn
    )
    losses = []
    for batch in _moe_batches():
        x, y = batch[:, :-1].chunk(2)[er], batch[:, 1:].chunk(2)[er]
        out = []
        sched.step(x, target=y, losses=out) if pp == 0 else sched.step(target=y, losses=out)
        opt.step()
        opt.zero_grad()
        loss = torch.tensor(sum(float(v) for v in out) / M if out else 0.0)
        dist.all_reduce(loss)
        losses.append(loss.item() / 2)
    state = _full_state(m)  # a collective: on every rank
    return dict(
        stage=pp,
        ep_size=plan.ep_size,
        local_experts=local_experts,
        losses=losses,
        state=state if er == 0 else None,
    )


def _worker(cases):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    if dist.get_world_size() == 8:
        mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("pp", "replicate", "shard"))
    else:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    out = []
    for case in cases:
        out.append(_case(*case, mesh))
        dist.barrier()
    if dist.get_world_size() == 4:
        out.append(_errors(mesh))
        dist.barrier()
        out.append(_checkpoint_across_layouts(mesh))
        dist.barrier()
        out.append(_qk_clip_case(mesh))
        dist.barrier()
        out.append(_moe_ep_case())
    return out


def _results(label):
    if label in HSDP_LABELS:
        runs = shared_run(("pipeline_parallel", 8), _worker, 8, HSDP_CASES, timeout_s=600)
        return [r[HSDP_LABELS.index(label)] for r in runs]
    runs = shared_run(("pipeline_parallel", 4), _worker, 4, CASES, timeout_s=600)
    return [r[LABELS.index(label)] for r in runs]


_REFS: dict = {}


def _reference(clip: bool):
    if clip not in _REFS:
        _REFS[clip] = reference(clip)
    return _REFS[clip]


def _max_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-12))


def _check_oracle(runs, ref):
    losses = runs[0]["losses"]
    for r in runs:
        assert r["losses"] == pytest.approx(losses, rel=1e-12)
    assert losses == pytest.approx(ref["losses"], rel=FP32_LOSS_RTOL)
    state = {}
    for r in runs:
        state.update(r["state"] or {})
    assert set(state) == set(ref["state"])
    for k, v in ref["state"].items():
        assert _max_rel(state[k], v) <= FP32_PARAM_TOL, k
    for step in range(STEPS):
        got = {}
        for r in runs:
            for k, g in r["grads"][step].items():
                assert k not in got, f"{k} owned twice"
                got[k] = g
        assert set(got) == set(ref["grads"][step])
        for k, g in got.items():
            assert _max_rel(g, ref["grads"][step][k]) <= GRAD_TOL, (step, k)


@pytest.mark.distributed
@pytest.mark.parametrize("label", [c[0] for c in ALL_CASES if not {"skip_reduce", "nan_skip"} & set(c[4].split(","))])
def test_pipeline_matches_oracle(label):
    case = next(c for c in ALL_CASES if c[0] == label)
    runs = _results(label)
    clip = "clip" in case[4]
    ref = _reference(clip)
    _check_oracle(runs, ref)
    if clip:
        for r in runs:
            assert r["norms"] == pytest.approx(ref["norms"], rel=1e-5)


@pytest.mark.distributed
@pytest.mark.parametrize(
    "label", [c[0] for c in ALL_CASES if not {"skip_reduce", "no_root_fsdp"} & set(c[4].split(","))]
)
def test_pipeline_ledger_equals_plan(label):
    """Bytes per step of each stage (its data-parallel ranks) = pipeline_cost(plan, M); the first step
    of a dynamic-shape stage also runs the shape inference's forward. (A stage that is no
    FSDPModule reduces through autograd whenever a block has no forward left in flight: on
    1F1B's last stage once per micro-batch, more bytes than the plan's one reduce.)"""
    case = next(c for c in ALL_CASES if c[0] == label)
    runs = _results(label)
    first = 0 if "static" in case[4] else 1
    for pp in (0, 1):
        members = [r for r in runs if r["stages"][0] % 2 == pp]
        expected = members[0]["cost_total"]
        for step in range(first, STEPS):
            got = sum(v for r in members for p, v in r["ledgers"][step].items() if p != "other")
            assert got == expected, (pp, step)
            for phase in ("forward_broadcast", "backward_broadcast", "reduce"):
                got_phase = sum(r["ledgers"][step].get(phase, 0) for r in members)
                assert got_phase == members[0]["cost_phases"][phase + "_nbytes"], (pp, step, phase)


@pytest.mark.distributed
def test_z2_is_the_default_under_pipeline_parallelism():
    """dedicate_params on mesh["dp"] of a ("pp", "dp") mesh without reshard_after_forward: Z2."""
    assert all(r["reshard"] == [False] for r in _results("gpipe_z2"))
    assert all(r["reshard"] == [True] for r in _results("gpipe_z3"))


@pytest.mark.distributed
def test_skipped_reduce_fails_the_oracle():
    runs = _results("skipped_reduce")
    assert all(r["step_error"] and r["step_error"].startswith("dmuon: step() with unreduced gradients") for r in runs)
    with pytest.raises(AssertionError):
        _check_oracle(runs, _reference(False))


@pytest.mark.distributed
def test_zero_bubble_schedule_refused_on_every_rank():
    runs = _results("interleaved_z2")
    messages = {r["refusal"] for r in runs}
    assert len(messages) == 1
    (msg,) = messages
    assert msg is not None and "ScheduleInterleavedZeroBubble" in msg and "weight" in msg


@pytest.mark.distributed
def test_pipeline_user_errors_on_every_rank():
    runs = shared_run(("pipeline_parallel", 4), _worker, 4, CASES, timeout_s=600)
    errors = [r[len(CASES)] for r in runs]
    assert len({e.get("whole_mesh") for e in errors}) == 1
    msg = errors[0]["whole_mesh"]
    assert "pipeline dim 'pp'" in msg and "mesh['dp']" in msg, msg
    assert len({e.get("plans_differ") for e in errors}) == 1  # stage 1's ranks too, the same words
    msg = errors[0]["plans_differ"]
    assert msg.startswith("dmuon: the ranks [0, 1] of one data-parallel mesh (one pipeline stage) hold different plans")
    assert "differing ranks: [1]" in msg and "layers.0.fc1.weight" in msg, msg
    assert len({e.get("tied") for e in errors}) == 1  # every rank of both stages, the same words
    msg = errors[0]["tied"]
    assert msg is not None and msg.startswith("dmuon: tied embeddings across pipeline stages are not supported"), msg
    assert "enable_weight_tying=True" in msg and "'embed.weight'" in msg and "'head.weight'" in msg, msg
    assert "ranks [0, 1]" in msg and "ranks [2, 3]" in msg, msg


@pytest.mark.distributed
def test_pipeline_checkpoint_resumes_bit_identically_at_the_same_layout():
    """Saved at (pp 2, dp 2) after one step, loaded into fresh stages at (pp 2, dp 2): the next
    steps' losses and parameters equal the uninterrupted run's bit for bit."""
    runs = [r[len(CASES) + 1] for r in shared_run(("pipeline_parallel", 4), _worker, 4, CASES, timeout_s=600)]
    for r in runs:
        assert r["resumed"] == r["straight"]
    # set_optimizer_state_dict(flatten_optimizer_state_dict=True) without dmuon's integration: refused
    # alike on the ranks of each stage (each names its own model's first matrix)
    for stage, first in ((0, "layers.0.fc1.weight"), (1, "layers.2.fc1.weight")):
        (msg,) = {r["refusal"] for r in runs if r["stage"] == stage}
        assert msg is not None and "flatten_optimizer_state_dict=True" in msg and "dcp.unflatten_optim" in msg, msg
        assert f"'momentum_buffer' of the dedicated matrix {first!r} on 1 of the 2 ranks" in msg, msg
        assert "get_optimizer_state_dict(model, optimizer)'s layout" in msg, msg
    assert runs[0]["straight"] == pytest.approx(_reference(False)["losses"][SAVE_AT:], rel=FP32_LOSS_RTOL)
    keys = set()
    for r in runs:
        if r["straight_state"] is not None:
            assert set(r["resumed_state"]) == set(r["straight_state"])
            keys |= set(r["straight_state"])
            for k, v in r["straight_state"].items():
                assert torch.equal(r["resumed_state"][k], v), k
    assert keys == set(_reference(False)["state"])


@pytest.mark.distributed
def test_pipeline_checkpoint_loads_without_pipeline():
    """Saved at (pp 2, dp 2), loaded into the whole model at (pp 1, dp 4) and continued: the
    losses and final parameters match the single-process oracle over the whole run (losses 1e-6
    relative, parameters 1e-4 of each tensor's max; fp32 Newton-Schulz)."""
    runs = [r[len(CASES) + 1] for r in shared_run(("pipeline_parallel", 4), _worker, 4, CASES, timeout_s=600)]
    ref = _reference(False)
    for r in runs:
        assert r["flat_losses"] == pytest.approx(ref["losses"][SAVE_AT:], rel=FP32_LOSS_RTOL)
    (state,) = [r["flat_state"] for r in runs if r["flat_state"] is not None]
    assert set(state) == set(ref["state"])
    for k, v in ref["state"].items():
        assert _max_rel(state[k], v) <= FP32_PARAM_TOL, k


@pytest.mark.distributed
@pytest.mark.parametrize("label", ["gpipe_z2_embed_alone_clip_nan_skip", "gpipe_z3_head_alone_clip_skip_nonfinite"])
def test_rank_whose_stage_dedicates_nothing(label):
    """A split that gives pipeline rank 0 only the embedding (or rank 1 only the final norm and the
    head): its stage dedicates nothing, yet ``dmuon.clip_grad_norm_`` and ``skip_nonfinite``'s
    flags run the same collectives on its ranks as on the others (no hang). The clip returns the
    oracle's norm of the whole model on every rank; with the embedding alone, a NaN in its gradient
    on one rank at step NAN_STEP skips that step on every rank (its norm is NaN there); the run
    matches the oracle (clipped, skipping that step)."""
    runs = _results(label)
    plans_empty = [r for r in runs if r["cost_total"] == 0 and not r["grads"][0]]
    assert len(plans_empty) == 2, [r["stages"] for r in runs]  # the bare stage's two ranks own nothing
    nan = "nan_skip" in label
    expected = [nan and step == NAN_STEP for step in range(STEPS)]
    assert [r["skipped"] for r in runs] == [expected] * len(runs)
    ref = reference(clip=True, skip_step=NAN_STEP if nan else None)
    _check_oracle(runs, ref)
    for r in runs:
        for step in range(STEPS):
            if expected[step]:
                assert r["norms"][step] != r["norms"][step], r["norms"]  # NaN
            else:
                assert r["norms"][step] == pytest.approx(ref["norms"][step], rel=1e-5), (step, r["norms"])


@pytest.mark.distributed
def test_nonfinite_step_skipped_on_every_stage():
    """skip_nonfinite=True: a NaN in the last stage's head gradient on one of its ranks at step
    NAN_STEP makes every rank of both stages skip that step (the flags span the world, not one
    stage's ranks), and the run matches the oracle that skips it."""
    runs = _results("gpipe_z2_nan_skip")
    expected = [step == NAN_STEP for step in range(STEPS)]
    assert [r["skipped"] for r in runs] == [expected] * len(runs)
    ref = reference(clip=False, skip_step=NAN_STEP)
    _check_oracle(runs, ref)


def _extra(index: int):
    return [r[len(CASES) + index] for r in shared_run(("pipeline_parallel", 4), _worker, 4, CASES, timeout_s=600)]


def _check_state(runs, ref_state):
    state = {}
    for r in runs:
        state.update(r["state"] or {})
    assert set(state) == set(ref_state)
    for k, v in ref_state.items():
        assert tuple(state[k].shape) == tuple(v.shape), k
        assert _max_rel(state[k], v) <= FP32_PARAM_TOL, k


@pytest.mark.distributed
def test_qk_clip_takes_the_max_over_the_steps_micro_batches():
    """QK-clip under PP (two stages, one attention block each, 4 micro-batches per data-parallel rank)
    equals the single-process run whose max logits are taken over the whole global batch: the clipped
    heads and the largest logit of each stage per step, the losses and the final parameters."""
    runs = _extra(2)
    ref = qk_reference()
    assert all(step[0][0] and step[1][0] for step in ref["per_step"][:1])  # heads of both stages clipped
    for r in runs:
        assert r["losses"] == pytest.approx(ref["losses"], rel=FP32_LOSS_RTOL)
        for step, (clipped, top) in enumerate(r["stats"]):
            want_clipped, want_top = ref["per_step"][step][r["stage"]]
            assert clipped == want_clipped, (r["stage"], step)
            assert top == pytest.approx(want_top, rel=1e-5), (r["stage"], step)
    _check_state(runs, ref["state"])


@pytest.mark.distributed
def test_pipeline_with_expert_parallelism_matches_oracle():
    """pp 2 x ep 2 on a ("pp", "efsdp", "ep") mesh: losses within 1e-6 relative and every parameter
    (expert stacks at their full shape) within 1e-4 of its max of single-process torch.optim.Muon
    (every expert's matrices) + AdamW on the same global batch."""
    runs = _extra(3)
    ref_losses, ref_state = moe_reference()
    for r in runs:
        assert r["ep_size"] == 2 and r["local_experts"] == 3  # w1, w2, w3 of the stage's block
        assert r["losses"] == pytest.approx(ref_losses, rel=FP32_LOSS_RTOL)
    _check_state(runs, ref_state)


def test_embedding_tie_sides_of_a_stage():
    """Which side of a declared embedding tie a stage holds alone (local, before the exchange), and
    when the stages' sides make a refusal: an embedding on one stage and the projection on another
    only (an encoder without a head, or a tie kept inside one stage, is not refused)."""
    from dmuon.exec._setup.guards import check_no_cross_stage_tie, embedding_tie_sides

    full = make_full()
    assert embedding_tie_sides(split_stage(full, 0, 2)) == ()  # no tie declared
    full.enable_weight_tying = True  # torchtitan's attribute
    full.head.weight = full.embed.weight
    assert embedding_tie_sides(full) == ()  # both sides, one tensor: tied inside the stage
    first, last = split_stage(full, 0, 2), split_stage(full, 1, 2)
    assert embedding_tie_sides(first) == (("input", "embed.weight", "enable_weight_tying=True"),)
    assert embedding_tie_sides(last) == (("output", "head.weight", "enable_weight_tying=True"),)
    middle = split_stage(full, 1, 4)
    assert embedding_tie_sides(middle) == ()

    class Config:
        tie_word_embeddings = True

    hf = split_stage(make_full(), 0, 2)
    hf.config = Config()  # Hugging Face's declaration
    assert embedding_tie_sides(hf) == (("input", "embed.weight", "config.tie_word_embeddings=True"),)

    check_no_cross_stage_tie([((0, 1), embedding_tie_sides(first)), ((2, 3), ())])  # one side only: allowed
    with pytest.raises(NotImplementedError, match=r"ranks \[0, 1\] hold 'embed.weight' while the ranks \[2, 3\]"):
        check_no_cross_stage_tie([((0, 1), embedding_tie_sides(first)), ((2, 3), embedding_tie_sides(last))])
