"""Expert parallelism (ep = N, efsdp = 1, no replicate): each rank's model holds its own
experts and routes tokens with all_to_all; dmuon owns every rank's experts locally, moves no
byte for them, and trains as the single-process reference on the global batch.

Plan side (pure): the refusals and their messages, JSON round trip, the cost of an EP plan
(the non-EP plan's minus the stacks' bytes), boundary lookups, the schedule. Runtime: W = 4
(ep = 4, ep given) and W = 2 (ep = 2, a 1-D DeviceMesh named "ep") against
``dmuon.testing.reference_run`` with fp32 Newton-Schulz, the ledger against ``plan.cost``, and
the state-dict view of the stacks (full logical shape, DTensor Shard(0)); in the same launches
the model built on ``meta``, ``to_empty`` + ``dmuon.init_params``, against the same reference.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dmuon.exec import dedicated_info
import dmuon
import dmuon.plan as P
import dmuon.testing
from dmuon.plan import ShardingPlan
from dmuon.plan._records.owners import ExpertOwners
from dist_utils import run_distributed
from moe_ep_models import E, full_model, ep_model, global_batches, is_expert, lm_loss

STEPS = 3
HP = dict(lr=0.02, weight_decay=0.1, adamw_lr=3e-3)


# ------------------------------------------------------------------------------ plan side (pure)


def test_ep_plan_records_global_stacks_owned_locally():
    plan = P.compile(ep_model(4, 0), 4, ep=4)
    stacks = [(s, o) for s, o in zip(plan.params, plan.owners) if s.experts is not None]
    assert len(stacks) == 6
    for spec, owner in stacks:
        assert spec.experts.ep_size == 4 and spec.experts.num_experts == E
        assert spec.shape[0] == E and spec.local_shape == (E // 4,) + spec.shape[1:]
        assert spec.local_numel * 4 == spec.numel
        assert isinstance(owner, ExpertOwners) and owner.local
        assert owner.ranks == (0, 1, 2, 3) and owner.sizes == (2, 2, 2, 2)
        assert plan.boundary(spec.fqn) == spec.fqn.split(".moe")[0]
        assert all(e.fqn != spec.fqn for b in plan.boundaries for e in b.entries())
    assert plan.ep_size == 4
    assert ShardingPlan.from_json(plan.to_json()) == plan
    assert '"local":true' in plan.to_json() and '"ep_size":4' in plan.to_json()
    plan.schedule().check()
    ns = [op for op in plan.schedule().ops if op.kind == "newton_schulz" and "layers.0.moe.experts.w1" in op.fqns]
    assert sorted(op.group for op in ns) == [(0,), (1,), (2,), (3,)] and all(op.deps == () for op in ns)
    assert "expert-parallel, local" in plan.summary()


def test_ep_plan_without_ep_keeps_json():
    plan = P.compile(full_model(), 4)
    text = plan.to_json()
    assert '"local"' not in text and '"ep_size"' not in text and plan.ep_size == 1


@pytest.mark.parametrize("world,align", [(4, 1), (2, 1), (4, 16)])
def test_ep_cost_is_non_ep_cost_minus_stacks(world, align):
    # broadcast arithmetic (one segment per owner); the stacks' ranges are placed alike
    full = P.compile(full_model(), world, align_numel=align, collectives="broadcast")
    ep = P.compile(ep_model(world, 0), world, ep=world, align_numel=align, collectives="broadcast")
    # (the dense owners may differ: the non-EP plan places them by LPT alone and fills the stacks
    # around them, the EP plan places them around each rank's own experts; with align 1 the bytes
    # below do not depend on who owns what)
    stacks = [s.fqn for s in full.params if s.experts is not None]
    # the stacks' bytes in the non-EP plan: every forward/backward broadcast and reduce of the
    # segments, counted without the stacks' entries (same boundary programs, their segments shrunk)
    assert ep.cost.total_nbytes < full.cost.total_nbytes
    if align == 1:  # packed without padding: each range entry is its elements + one flag element
        isz, n = 4, world
        ranges = {f: getattr(full.owner_record(f), "k", 1) for f in stacks}  # the planner's range count
        stack_elems = sum(full.param(f).numel + ranges[f] for f in stacks)
        assert full.cost.total_nbytes - ep.cost.total_nbytes == 3 * (n - 1) * isz * stack_elems
    assert sum(ep.cost.per_rank_nbytes) == ep.cost.total_nbytes


def test_ep_mesh_named_ep_implies_ep_n():
    class Mesh:
        shape = (4,)
        mesh_dim_names = ("ep",)

    plan = P.compile(ep_model(4, 0), Mesh())
    assert plan.ep_size == 4
    with pytest.raises(ValueError, match="named 'ep'"):
        P.compile(ep_model(4, 0), Mesh(), ep=2)


def test_ep_refusals():
    with pytest.raises(ValueError, match="does not divide"):
        P.compile(ep_model(4, 0), 6, ep=4)
    with pytest.raises(ValueError, match="ep=3 does not divide the 4 shard ranks"):
        P.compile(ep_model(2, 0), (2, 4), ep=3)
    with pytest.raises(ValueError, match="must be an int >= 1"):
        P.compile(ep_model(2, 0), 2, ep=0)
    with pytest.raises(ValueError, match="not dedicated"):
        P.compile(ep_model(2, 0), 2, ep=2, predicate=lambda fqn, p: p.ndim == 2 and fqn.startswith("layers."))
    with pytest.raises(ValueError, match="not dedicated"):
        P.compile(ep_model(2, 0), 2, ep=2, experts="off")
    with pytest.raises(ValueError, match="with tensor parallelism"):
        P.compile(ep_model(2, 0), 2, ep=2, tp=P.TPPolicy(size=2, shard_dims={"layers.0.qkv.weight": 0}))
    with pytest.raises(ValueError, match="no expert stack"):
        P.compile(torch.nn.Sequential(torch.nn.Linear(4, 4)), 2, ep=2, hook_boundary_strict=False)


def test_ep_stack_count_mismatch_hint_fits_the_case():
    """The fix named for a stack/router mismatch under ep= fits the case: a rank holding every
    expert is told to drop ep=; a rank holding another count (a model built for another ep) is
    told to build E/ep experts per stack or pass the ep its count implies, not to drop ep=."""
    with pytest.raises(ValueError) as info:
        P.compile(full_model(), 4, ep=4)
    msg = str(info.value)
    assert "holds 8 experts, expected 2 (= 8 / ep 4)" in msg and msg.endswith(
        "not expert-parallel: drop ep= "
        "(under expert parallelism each rank's model builds only its own experts and routes tokens with all_to_all, "
        "docs/moe_ep.md)."
    ), msg
    for built, asked in ((2, 4), (4, 2)):  # a model built for ep=built, compiled with ep=asked
        with pytest.raises(ValueError) as info:
            P.compile(ep_model(built, 0), 4, ep=asked)
        msg = str(info.value)
        assert f"holds {E // built} experts, expected {E // asked} (= {E} / ep {asked})" in msg, msg
        assert "drop ep=" not in msg, msg
        assert msg.endswith(
            f"build each rank's model with E/ep experts per stack, or pass ep={built}, the degree this "
            "model was built for."
        ), msg


def test_ep_efsdp_plan_by_hand():
    """ep 2 x efsdp 2 on 4 ranks (align 1, Z3, fp32): each EP coordinate's 4 experts of a stack
    cut into two ranges of 2, one per member of its efsdp group ({0, 2} holds experts 0-3, {1, 3}
    experts 4-7); a rank's expert-parallel segment per boundary is its three ranges (w1, w2, w3:
    2 x 24 x 16 = 768 elements each) plus 3 presence flags = 2,307 elements, and each rank
    receives its one efsdp peer's segment in the forward and backward broadcasts and sends its
    own in the reduce: 2 layers x 3 phases x 2,307 x 4 B = 55,368 B per rank and step, on the
    efsdp groups only. All-gathered (the default "auto" picks it: one call per group and phase
    instead of two broadcasts), the two equal segments fill slots of 2,307 + 1 step code = 2,308
    elements: 2 layers x 3 phases x (2 - 1) x 2,308 x 4 B = 55,392 B, on the same groups."""
    plan = P.compile(ep_model(2, 0), 4, ep=2, align_numel=1, collectives="broadcast")
    for spec, owner in zip(plan.params, plan.owners):
        if spec.experts is not None:
            assert spec.shape[0] == E and spec.local_shape[0] == E // 2
            assert owner.sizes == (2, 2, 2, 2) and not owner.local
            shards = [o.shard for o in plan.expert_owners(spec.fqn)]
            assert shards[:4] in ([0, 0, 2, 2], [2, 2, 0, 0]) and shards[4:] in ([1, 1, 3, 3], [3, 3, 1, 1])
    for b in plan.boundaries:
        ep_bufs = [buf for buf in b.buffers if buf.ep == 2]
        assert len(ep_bufs) == 1 and [seg.numel for seg in ep_bufs[0].segments] == [2307] * 4
    sched = plan.schedule()
    ep_bytes = [0] * 4
    for op in sched.ops:
        if op.buffer is not None and op.buffer.endswith("/ep2"):
            assert op.group in ((0, 2), (1, 3)), op
            for x in op.group:
                ep_bytes[x] += op.charged_nbytes(x)
    assert ep_bytes == [55_368] * 4
    gathered = P.compile(ep_model(2, 0), 4, ep=2, align_numel=1)
    assert gathered.owners == plan.owners
    ep_bytes = [0] * 4
    for op in gathered.schedule().ops:
        if op.buffer is not None and op.buffer.endswith("/ep2"):
            assert op.group in ((0, 2), (1, 3)) and op.kind in ("all_gather", "reduce_scatter") and op.numel == 2308
            for x in op.group:
                ep_bytes[x] += op.charged_nbytes(x)
    assert ep_bytes == [55_392] * 4
    # HSDP (2, 2) with ep = 2 (efsdp 1): no shard-group traffic for the experts, only the
    # replicate reduce / broadcast of each range between its two holders
    hsdp = P.compile(ep_model(2, 0), (2, 2), ep=2, align_numel=1)
    phases = {
        op.phase
        for op in hsdp.schedule().ops
        if op.buffer is not None and op.buffer.endswith("/ep2") and sum(op.charged_nbytes(x) for x in op.group) > 0
    }
    assert phases == {"replicate_reduce", "replicate_broadcast"}
    assert "expert-parallel: 6 stacks over ep = 2 x efsdp = 2" in plan.summary()
    # a record that puts a range outside the efsdp group holding its experts is refused
    import json

    d = json.loads(plan.to_json())
    i = next(i for i, p in enumerate(plan.params) if p.experts is not None)
    members = d["owners"][i]["experts"]
    members[1], members[2] = members[2], members[1]  # EP coordinate 0's second range to an odd shard
    with pytest.raises(ValueError, match="outside its efsdp group"):
        ShardingPlan.from_json(json.dumps(d))


def test_ep_dtensor_stack_refused():
    """A stack held as a DTensor (EP by Shard(0)) is refused with the reason (duck-typed DTensor)."""
    import dmuon.plan._model.snapshot as snap

    real = snap._tp_placement

    def fake(tensor):
        if tensor.ndim == 3:
            return 2, 0, ""
        return real(tensor)

    snap._tp_placement = fake
    try:
        with pytest.raises(ValueError, match="is a DTensor.*plain tensor"):
            P.compile(ep_model(2, 0), 2, ep=2)
    finally:
        snap._tp_placement = real


def test_ep_plan_validation():
    plan = P.compile(ep_model(2, 0), 2, ep=2)
    i = next(i for i, s in enumerate(plan.params) if s.experts is not None)
    owners = list(plan.owners)
    owners[i] = dataclasses.replace(owners[i], local=False)
    with pytest.raises(ValueError, match="expert-parallel"):
        dataclasses.replace(plan, owners=tuple(owners))
    with pytest.raises(ValueError, match="rank order"):
        ExpertOwners(members=tuple(reversed(plan.owners[i].members)), sizes=(4, 4), local=True)


# ------------------------------------------------------------------------------ runtime


def _worker(ep: int, named_mesh: bool):
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = None
    if named_mesh:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    # a model holding every expert on every rank passed with ep=: shapes cannot tell (its router
    # renamed, so no expert count shows), the identical stacks on every rank of the EP group can:
    # the same warning on every rank
    import warnings

    every = full_model()
    for layer in every.layers:
        layer.moe.wg = layer.moe.router
        del layer.moe.router
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dmuon.dedicate_params(every, mesh, **({} if named_mesh else {"ep": ep}))
    warned_full = [str(w.message) for w in caught if "identical expert stacks" in str(w.message)]
    model = ep_model(ep, rank)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = dmuon.dedicate_params(model, mesh, **({} if named_mesh else {"ep": ep}))
    warned_ep = [str(w.message) for w in caught if "identical expert stacks" in str(w.message)]
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = dmuon.Muon(model, ns_dtype=torch.float32, **HP)
    experts = {n: p for n, p in model.named_parameters() if is_expert(n)}
    assert all(type(p) is torch.nn.Parameter and dedicated_info(p).ep_local for p in experts.values())
    grads = {}

    def first_step():  # the experts' gradients (the global-batch mean's)
        for n, p in experts.items():
            parts = [torch.empty_like(p) for _ in range(world)]
            dist.all_gather(parts, p.grad.contiguous())
            grads[n] = torch.cat(parts)

    losses, ledgers, norm = _train(model, opt, first_step)
    gathered = {}
    for n, p in experts.items():
        parts = [torch.empty_like(p) for _ in range(world)]
        dist.all_gather(parts, p.detach().contiguous())
        gathered[n] = torch.cat(parts)
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    full = {k: v.detach().clone() for k, v in full.items()}
    osd = get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    mom = {k: v["momentum_buffer"].shape for k, v in osd["state"].items() if is_expert(k)}
    # load back (full tensors of the global shape): each rank takes its own experts
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    before = {n: p.detach().clone() for n, p in experts.items()}
    moms = {n: opt.state[p]["momentum_buffer"].clone() for n, p in experts.items()}
    with torch.no_grad():
        for p in experts.values():
            p.zero_()
            opt.state[p]["momentum_buffer"].zero_()
    set_model_state_dict(model, {k: v.clone() for k, v in full.items()}, options=StateDictOptions(full_state_dict=True))
    set_optimizer_state_dict(model, opt, osd, options=StateDictOptions(full_state_dict=True))
    reloaded = all(torch.equal(p, before[n]) for n, p in experts.items()) and all(
        torch.equal(opt.state[p]["momentum_buffer"], moms[n]) for n, p in experts.items()
    )
    return dict(
        plan_json=plan.to_json(),
        losses=losses,
        ledgers=ledgers,
        gathered=gathered,
        full=full,
        mom=mom,
        norm=norm,
        reloaded=reloaded,
        warned_full=warned_full,
        warned_ep=warned_ep,
        grads=grads,
        meta=_meta_init_run(ep, mesh, named_mesh),
    )


def _meta_init_run(ep: int, mesh, named_mesh: bool, group=None, fsdp_mesh=None):
    """The same EP model built on ``meta``, dedicated and sharded there, then ``to_empty`` +
    ``dmuon.init_params`` (seed 0: the stacks drawn whole, each rank keeping its experts, so
    the values are ``full_model(0)``'s) and STEPS steps: the stacks keep their dedicated
    object, tag, gradient hook and state-dict hooks across ``to_empty``; stacks owned in efsdp
    groups (``group``: the EP group, ``fsdp_mesh``: FSDP2's mesh) keep their tag."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.fsdp import fully_shard

    from moe_ep_models import MoELM

    with torch.device("meta"):
        model = MoELM(ep=ep, group=group)
    dmuon.dedicate_params(model, mesh, **({} if named_mesh else {"ep": ep}))
    fsdp_mesh = mesh if fsdp_mesh is None else fsdp_mesh
    for layer in model.layers:
        fully_shard(layer, mesh=fsdp_mesh)
    fully_shard(model, mesh=fsdp_mesh)
    rt = dmuon.exec.get_model_runtime(model)
    before = dict(rt.ep_params)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    dmuon.init_params(model)
    experts = {n: p for n, p in model.named_parameters() if is_expert(n)}
    if before:  # local EP stacks: the same objects, tagged, hooked
        kept = all(
            rt.ep_params[n] is p and before[n] is p and p.device.type == "cpu" and dedicated_info(p).ep_local
            for n, p in experts.items()
        ) and sorted(rt.ep_hooks) == sorted(experts)
    else:  # owned in efsdp groups
        kept = all(p.device.type == "cpu" and dedicated_info(p).group is not None for p in experts.values())
    opt = dmuon.Muon(model, ns_dtype=torch.float32, **HP)
    losses, _, norm = _train(model, opt)  # the global gradient norm: the stacks' hook divided by W
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))  # the experts' hooks
    return dict(kept=kept, losses=losses, norm=norm, full={k: v.detach().clone() for k, v in full.items()})


def _train(model, opt, first_step=None, ops=None) -> tuple[list[float], list[int], float]:
    """``STEPS`` steps on this rank's share of the global batches (inside a worker): the
    global-batch mean losses, this rank's ledger bytes per step, and the global gradient norm
    of step 0 (``dmuon.clip_grad_norm_``), where ``first_step()`` also runs. ``ops``: a list that
    receives every step's issued collectives (the ledger's record, as tuples)."""
    import torch.distributed as dist

    from dmuon.exec._comm.collective_calls import LEDGER, metered

    rank, world = dist.get_rank(), dist.get_world_size()
    losses, ledgers, norm = [], [], None
    for batch in global_batches(STEPS, world):
        LEDGER.reset()
        with metered(record=True) as led:
            loss = lm_loss(model, batch.chunk(world)[rank])
            loss.backward()
            if norm is None:
                norm = dmuon.clip_grad_norm_(model, 1e9).item()
                if first_step is not None:
                    first_step()
            opt.step()
            opt.zero_grad()
        if ops is not None:
            ops.append([dataclasses.astuple(op) for op in led.ops])
        ledgers.append(LEDGER.total_nbytes())
        t = loss.detach().clone()
        dist.all_reduce(t)
        losses.append(t.item() / world)
    return losses, ledgers, norm


def _reference(world: int, variant: str = "muon"):
    ref_plan = P.compile(full_model(), world)
    proxies = dmuon.testing.proxies_from_plan(ref_plan)
    return dmuon.testing.reference_run(
        full_model(), lm_loss, global_batches(STEPS, world), proxies, ns_dtype=torch.float32, variant=variant, **HP
    )


@pytest.mark.parametrize("world,named_mesh", [(4, False), (2, True)])
def test_ep_matches_single_process_reference(world, named_mesh):
    results = run_distributed(_worker, world, world, named_mesh, timeout_s=600)
    ref_losses, ref_state = _reference(world)
    plan = ShardingPlan.from_json(results[0]["plan_json"])
    assert plan.ep_size == world
    loss_dev = max(abs(a - b) / abs(b) for a, b in zip(results[0]["losses"], ref_losses))
    assert loss_dev < 1e-6, (results[0]["losses"], ref_losses)
    worst = 0.0
    for r in results:
        for key, want in ref_state.items():
            got = r["gathered"][key] if is_expert(key) else r["full"][key]
            assert tuple(r["full"][key].shape) == tuple(want.shape), key  # experts: full logical shape
            dev = (got - want).abs().max().item() / want.abs().max().item()
            worst = max(worst, dev)
            assert dev < 1e-4, (key, dev)
            if is_expert(key):  # the state-dict DTensor is the ranks' experts, in expert order
                assert torch.equal(r["full"][key], r["gathered"][key]), key
        assert all(shape[0] == E for shape in r["mom"].values()) and len(r["mom"]) == 6
        assert r["reloaded"]
    # gradient scale: a local expert's gradient is the global-batch mean's (the hook's / W), and
    # dmuon.clip_grad_norm_ counts each rank's experts once (Muon alone would not see a wrong scale)
    model = full_model()
    lm_loss(model, global_batches(STEPS, world)[0]).backward()
    want_norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]).item()
    for r in results:
        assert abs(r["norm"] - want_norm) / want_norm < 1e-5, (r["norm"], want_norm)
        for name, p in model.named_parameters():
            if is_expert(name):
                dev = (r["grads"][name] - p.grad).abs().max().item() / p.grad.abs().max().item()
                assert dev < 1e-5, (name, dev)
    per_rank = plan.cost.per_rank_nbytes
    for rank, r in enumerate(results):
        assert r["ledgers"] == [per_rank[rank]] * STEPS, (rank, r["ledgers"], per_rank[rank])
    # every expert on every rank passed with ep=: the same warning on every rank; the EP model: none
    assert all(len(r["warned_full"]) == 1 and r["warned_full"] == results[0]["warned_full"] for r in results)
    assert "drop ep=" in results[0]["warned_full"][0]
    assert not any(r["warned_ep"] for r in results)
    print(f"EP world={world}: loss dev {loss_dev:.2e}, param dev {worst:.2e}, bytes/rank/step {per_rank}")
    # meta-device build, to_empty, dmuon.init_params: the same training as the reference's
    meta_loss, meta_param = _check_meta(results, ref_losses, ref_state, want_norm, "an EP stack's object, tag or hook")
    print(f"EP world={world} from meta: loss dev {meta_loss:.2e}, param dev {meta_param:.2e}")


def _check_meta(results, ref_losses, ref_state, want_norm, what: str) -> tuple[float, float]:
    """Each rank's run built on the meta device (``r["meta"]``) against the reference: losses
    (relative 1e-6), the global gradient norm (1e-5), every parameter (1e-4 of its max)."""
    meta_loss, meta_param = 0.0, 0.0
    for r in results:
        m = r["meta"]
        assert m["kept"], f"to_empty lost {what}"
        meta_loss = max(meta_loss, *(abs(a - b) / abs(b) for a, b in zip(m["losses"], ref_losses)))
        assert abs(m["norm"] - want_norm) / want_norm < 1e-5, (m["norm"], want_norm)
        for key, want in ref_state.items():
            dev = (m["full"][key] - want).abs().max().item() / want.abs().max().item()
            meta_param = max(meta_param, dev)
            assert dev < 1e-4, ("meta", key, dev)
    assert meta_loss < 1e-6, meta_loss
    return meta_loss, meta_param


# ------------------------------------------------------- efsdp > 1 and HSDP (owners in efsdp groups)

# (mesh shape, ep, collectives, variant): ep 2 x efsdp 2 on a 1-D mesh of 4 (the default "auto": its
# efsdp buffers all-gathered); ep 2 on a (2, 2) HSDP mesh (efsdp 1, two replicas of every expert);
# ep 2 x efsdp 2 again with broadcasts; NorMuon on ep 2 x efsdp 2 (its ledger must equal Muon's);
# run one after the other in one launch of 4 ranks
EFSDP_CASES = (
    ((1, 4), 2, "auto", "muon"),
    ((2, 2), 2, "auto", "muon"),
    ((1, 4), 2, "broadcast", "muon"),
    ((1, 4), 2, "auto", "normuon"),
)


def _case_key(mesh_shape, ep, collectives, variant) -> str:
    return f"{mesh_shape}/{ep}/{collectives}" + ("" if variant == "muon" else f"/{variant}")


def _ep_groups(mesh_shape, ep):
    """Every EP group (``ep`` consecutive shard ranks of a row), created on every rank; returns
    this rank's."""
    import torch.distributed as dist

    R, N = mesh_shape
    mine = None
    for r in range(R):
        for start in range(0, N, ep):
            ranks = [r * N + start + j for j in range(ep)]
            pg = dist.new_group(ranks)
            if dist.get_rank() in ranks:
                mine = pg
    return mine


def _efsdp_worker():
    import tempfile

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from dcp_utils import dcp_load, sharded_state

    torch.set_num_threads(1)
    rank = dist.get_rank()
    out = {}
    path = None
    for mesh_shape, ep, collectives, variant in EFSDP_CASES:
        R, N = mesh_shape
        shard = rank % N
        group = _ep_groups(mesh_shape, ep)
        model = ep_model(ep, shard % ep, group=group)
        mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("dp_replicate", "dp_shard"))
        plan = dmuon.dedicate_params(model, mesh, ep=ep, collectives=collectives)
        fsdp_mesh = mesh if R > 1 else mesh["dp_shard"]
        for layer in model.layers:
            fully_shard(layer, mesh=fsdp_mesh)
        fully_shard(model, mesh=fsdp_mesh)
        opt = dmuon.Muon(model, ns_dtype=torch.float32, variant=variant, **HP)
        ops = []
        losses, ledgers, norm = _train(model, opt, ops=ops)
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
        full = {k: v.detach().clone() for k, v in full.items()}
        # DCP: the first case saves (sharded, experts at full logical shape), the other Muon cases
        # load it into their own layout (efsdp owners -> HSDP replicas; all-gathered -> broadcast buffers)
        if variant != "muon":
            reload = None
        elif path is None:
            path = [tempfile.mkdtemp(prefix="dmuon_efsdp_") if rank == 0 else None]
            dist.broadcast_object_list(path)
            path = path[0]
            dcp.save(sharded_state(model, opt), checkpoint_id=path)
            saved = full
            reload = None
        else:
            dcp_load(model, opt, path)
            got = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
            reload = all(torch.equal(got[k], saved[k]) for k in saved)
        out[_case_key(mesh_shape, ep, collectives, variant)] = dict(
            plan_json=plan.to_json(),
            losses=losses,
            ledgers=ledgers,
            full=full,
            norm=norm,
            reload=reload,
            ops=ops,
        )
        if R == 1 and collectives == "auto" and variant == "muon":  # ep 2 x efsdp 2 from meta: to_empty + init_params
            out["meta"] = _meta_init_run(ep, mesh, False, group=group, fsdp_mesh=fsdp_mesh)
    return out


def test_ep_efsdp_and_hsdp_match_single_process_reference():
    """ep 2 x efsdp 2 (1-D, 4 ranks) and ep 2 on HSDP (2, 2): every expert owned once inside its
    efsdp group, the training equal to the single-process per-expert oracle on the global batch,
    the ledger equal to the plan per rank and step, a DCP checkpoint saved under one layout
    loading under the other. NorMuon on ep 2 x efsdp 2: equal to the NorMuon reference, and every
    collective issued (kind, phase, group, root, dtype, bytes, order) equal to Muon's."""
    results = run_distributed(_efsdp_worker, 4, timeout_s=900)
    world = 4
    refs = {v: _reference(world, v) for v in sorted({c[3] for c in EFSDP_CASES})}
    model = full_model()
    lm_loss(model, global_batches(STEPS, world)[0]).backward()
    want_norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]).item()
    for mesh_shape, ep, collectives, variant in EFSDP_CASES:
        key = _case_key(mesh_shape, ep, collectives, variant)
        ref_losses, ref_state = refs[variant]
        plan = ShardingPlan.from_json(results[0][key]["plan_json"])
        assert plan.ep_size == ep
        ep_kinds = {buf.collective for b in plan.boundaries for buf in b.buffers if buf.ep > 1}
        assert ep_kinds == ({"all_gather"} if collectives == "auto" and mesh_shape[0] == 1 else {"broadcast"}), key
        for spec, owner in zip(plan.params, plan.owners):
            if spec.experts is not None:  # every expert exactly one owner, inside its efsdp group
                per = plan.expert_owners(spec.fqn)
                assert len(per) == spec.num_experts and not owner.local
                for e, o in enumerate(per):
                    assert o.shard % ep == e // (E // ep), (key, spec.fqn, e, o)
        per_rank = plan.cost.per_rank_nbytes
        for rank, r in enumerate(results):
            got = r[key]
            assert got["ledgers"] == [per_rank[rank]] * STEPS, (key, rank, got["ledgers"], per_rank[rank])
            dev = max(abs(a - b) / abs(b) for a, b in zip(got["losses"], ref_losses))
            assert dev < 1e-6, (key, got["losses"], ref_losses)
            assert abs(got["norm"] - want_norm) / want_norm < 1e-5, (key, got["norm"], want_norm)
            for name, want in ref_state.items():
                have = got["full"][name]
                assert tuple(have.shape) == tuple(want.shape), (key, name)
                d = (have - want).abs().max().item() / want.abs().max().item()
                assert d < 1e-4, (key, name, d)
        print(f"EP {key}: bytes/rank/step {per_rank}")
    for case in EFSDP_CASES[1:3]:  # saved with all-gathered efsdp buffers, loaded bit for bit
        assert all(r[_case_key(*case)]["reload"] for r in results), case
    # efsdp 2 moves every expert gradient as a sum of two: broadcast and all-gather runs agree bit for bit
    a, b = (_case_key(*c) for c in (EFSDP_CASES[0], EFSDP_CASES[2]))
    assert results[0][a]["losses"] == results[0][b]["losses"]
    for r in results:  # NorMuon: not one extra collective or byte
        assert r[_case_key(*EFSDP_CASES[3])]["ops"] == r[_case_key(*EFSDP_CASES[0])]["ops"]
        assert r[_case_key(*EFSDP_CASES[3])]["ops"][0]
    ref_losses, ref_state = refs["muon"]
    _check_meta(results, ref_losses, ref_state, want_norm, "an efsdp-owned stack's tag")  # ep 2 x efsdp 2 from meta
