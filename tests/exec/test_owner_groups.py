"""Owner groups: a matrix owned by k shard ranks, each holding a block of it.

Model: one hook boundary with THREE dedicated matrices on FOUR ranks, one much larger — the case
where exclusive ownership leaves a rank owning nothing: ``tall`` (48, 8) (row blocks),
``square`` (8, 8) and ``wide`` (8, 10) (column blocks; uneven at k = 4: 3 + 3 + 2 + 2, so members
pad to the widest block).

Pure plan checks (hand-computed): forced ``k = 2`` / ``k = 4`` owners, blocks and layout entries,
the owner-group Gram all-reduce bytes, JSON / diff / summary.

Distributed (gloo, 4 processes, one process group): 1-D ``k = 2`` (Z3) and ``k = 4`` (Z2), HSDP
(2, 2) ``k = 2`` (Z3 and Z2), 3 steps each, against single-process ``torch.optim.Muon`` +
``torch.optim.AdamW`` whose Newton-Schulz is Gram NS of the full matrix (fp32, the plan's
restarts) — the form the group runs sharded; losses within 1e-6 relative, parameters within 1e-4
of each tensor's largest magnitude (measured: ~2e-6). Ledger bytes per rank == ``plan.cost`` per
rank at every step, the ``owner_group`` phase included; ``dmuon.clip_grad_norm_`` == the single
process gradient norm; ``dmuon.no_sync`` accumulation == one step on the whole batch; DCP
save / load to the same plan (bit-identical continuation), to exclusive owners and to HSDP
``k = 2`` (same values); meta-device build + ``init_params`` == the single-process init.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn

from dcp_utils import dcp_load as _load
from dcp_utils import sharded_state as _sharded
from dist_utils import run_distributed
from oracle import dmuon_optimizer, global_batches, lm_loss, reference_run, train_steps

STEPS = 3
LOSS_RTOL = 1e-6
PARAM_TOL = 1e-4
VOCAB = 11


class FewBlock(nn.Module):
    def __init__(self, d: int = 8):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.tall = nn.Linear(d, 48, bias=False)  # (48, 8): the large one, cut into row blocks
        self.square = nn.Linear(d, d, bias=False)  # (8, 8)
        self.wide = nn.Linear(10, d, bias=False)  # (8, 10): cut into column blocks

    def forward(self, x):
        h = self.norm(x)
        t = torch.tanh(self.tall(h))
        return x + self.square(h) + self.wide(t[..., :10]) + t.reshape(*t.shape[:-1], 6, 8).mean(-2)


class FewMatrixLM(nn.Module):
    def __init__(self, d: int = 8):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, d)
        self.layers = nn.ModuleList([FewBlock(d)])
        self.head = nn.Linear(d, VOCAB)

    def forward(self, tokens):
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return FewMatrixLM()


def batches(steps: int = STEPS):
    return global_batches(steps, batch=8, seq=5, vocab=VOCAB)


def _gram_reference_ns(grad, ns_coefficients, ns_steps, eps):
    """torch.optim.Muon's iteration replaced by Gram NS of the full matrix (fp32, the plan's
    default restart every 2 steps): what an owner group computes, sharded."""
    from dmuon import _ns_gram as ns

    return ns.gram_newton_schulz(
        grad, coefficients=ns_coefficients, steps=ns_steps, eps=eps, dtype=torch.float32, fallback=False
    )


# ---------------------------------------------------------------------------------- plan (pure)


def _plan(mesh, k, **kw):
    import dmuon

    return dmuon.plan.compile(make_model(), mesh, owner_groups=k, **kw)


def test_exclusive_owners_leave_a_rank_idle_and_the_summary_says_so():
    plan = _plan(4, "off")
    assert sorted(plan.owned_numel) == [0, 64, 80, 384]  # 3 matrices, 4 ranks
    text = plan.summary()
    assert "ownership: 1 of 4 ranks own nothing" in text
    assert "100% of them in layers.0.tall.weight" in text


def test_forced_k2_plan_by_hand():
    from dmuon.plan import OwnerGroup
    from dmuon.plan._cost.nbytes import all_reduce_rank_nbytes

    plan = _plan(4, 2)
    owners = {spec.fqn: o for spec, o in zip(plan.params, plan.owners)}
    assert all(isinstance(o, OwnerGroup) and o.k == 2 for o in owners.values())
    tall, square, wide = (owners[f"layers.0.{n}.weight"] for n in ("tall", "square", "wide"))
    assert (tall.dim, tall.sizes) == (0, (24, 24))
    assert (square.dim, square.sizes) == (0, (4, 4))
    assert (wide.dim, wide.sizes) == (1, (5, 5))
    for o in owners.values():  # one replicate row, distinct shard coordinates
        assert len({m.shard for m in o.members}) == 2
    # every rank owns a block; owned elements = the blocks
    owned = plan.owned_numel
    assert sum(owned) == 384 + 64 + 80 and min(owned) > 0
    # one layout entry per block, in its member's segment, with the block's shape
    entries = [e for e in plan.boundaries[0].entries() if e.fqn == "layers.0.wide.weight"]
    assert sorted((e.block, e.shape, e.owner.shard) for e in entries) == [
        (0, (8, 5), wide.members[0].shard),
        (1, (8, 5), wide.members[1].shard),
    ]
    # Gram all-reduces: per group, buckets by (d = 8, padded width, fp32); 3 Gram segments (5
    # steps, restart every 2); each member charged 2 (k-1) ceil(64 B / k) 4 bytes per call
    groups: dict = {}
    for spec, o in zip(plan.params, plan.owners):
        groups.setdefault(tuple(sorted(o.ranks)), set()).add(max(o.sizes))
    expected = sum(3 * 2 * all_reduce_rank_nbytes(64, 4, 2) * len(widths) for widths in groups.values())
    assert plan.cost.owner_group_nbytes == expected
    # broadcasts / reduces: the same segments, blocks instead of whole matrices (padding aside)
    assert plan.cost.forward_broadcast_nbytes == plan.cost.reduce_nbytes
    from dmuon.plan import ShardingPlan

    assert ShardingPlan.from_json(plan.to_json()) == plan
    text = plan.summary()
    assert "ownership: 0 of 4 ranks own nothing" in text and "owner groups: 3 matrices cut into blocks" in text
    assert "owner-group Gram all-reduce" in text
    import dmuon

    d = str(dmuon.plan.diff(_plan(4, "off"), plan))
    assert "owner group ranks" in d and "rows 24+24" in d and "cols 5+5" in d


def test_forced_k4_and_hsdp_rows():
    from dmuon.plan import OwnerGroup
    from dmuon.plan._cost.nbytes import all_reduce_rank_nbytes

    plan = _plan(4, 4)
    for o in plan.owners:
        assert isinstance(o, OwnerGroup) and sorted(o.ranks) == [0, 1, 2, 3]
    # one group of all 4 ranks; widths 12 (tall 48/4), 2 (square), 3 (wide 10 = 3+3+2+2, padded
    # to 3): 3 buckets, 3 Gram segments, 4 members
    assert plan.cost.owner_group_nbytes == 4 * 3 * 3 * all_reduce_rank_nbytes(64, 4, 4)
    wide = plan.owner("layers.0.wide.weight")
    assert wide.sizes == (3, 3, 2, 2)
    assert sorted(plan.owned_numel) == [128, 128, 136, 136]  # 96 + 16 + 8*3 or 8*2 each
    hsdp = _plan((2, 2), 2)
    for o in hsdp.owners:  # members inside one shard group (one replicate row)
        assert isinstance(o, OwnerGroup) and {m.shard for m in o.members} == {0, 1}
    # the summary's bound is the planner's (HSDP: N/(N-K+1) on the mean term, here 2/1)
    assert max(hsdp.owned_weight) <= hsdp.balance_bound
    total = sum(hsdp.owned_weight)
    biggest = max(
        w for spec, o in zip(hsdp.params, hsdp.owners) for w in (s * (spec.shape[1 - o.dim]) for s in o.sizes)
    )
    assert hsdp.balance_bound == 2 * total / 4 + biggest


def test_auto_with_ns_flops_never_raises_the_busiest_rank_ns():
    """``"auto"`` sizes groups by elements and places them by the cost model: with
    ``cost_model="ns_flops"`` (where a member's Gram NS share does not shrink like 1/k) the
    busiest rank's NS FLOPs must still fall, and no rank own nothing (found by a user trial:
    sizing by NS FLOPs cut every matrix across every rank, 44x the busiest rank's FLOPs)."""
    import dmuon
    from dmuon._zoo import PRESETS

    for name, mesh in (("tiny-llama", 64), ("llama3-8b", 512)):
        model = PRESETS[name]()
        off = dmuon.plan.compile(model, mesh, cost_model="ns_flops")
        auto = dmuon.plan.compile(model, mesh, cost_model="ns_flops", owner_groups="auto")
        busiest = lambda p: max(r.ns_flops for r in p.rank_stats())  # noqa: E731
        assert busiest(auto) < busiest(off), name
        assert min(auto.owned_numel) > 0 and min(off.owned_numel) == 0, name
        by_numel = dmuon.plan.compile(model, mesh, owner_groups="auto")
        assert [getattr(o, "k", 1) for o in auto.owners] == [getattr(o, "k", 1) for o in by_numel.owners], name


def test_owner_group_errors():
    import dmuon

    for bad in ("yes", 0, True, 2.0):
        with pytest.raises(ValueError, match="owner_groups must be one of"):
            _plan(4, bad)
    assert _plan(4, 1) == _plan(4, "off")
    # matrices that cannot be cut keep one owner: a matrix view
    from dmuon.plan._records.params import MatrixView

    plan = dmuon.plan.compile(
        make_model(), 4, owner_groups=2, matrix_views={"layers.0.square.weight": MatrixView(dim=0, sizes=(4, 4))}
    )
    from dmuon.plan import Owner

    assert isinstance(plan.owner("layers.0.square.weight"), Owner)
    with pytest.raises(ValueError, match=r"owner_groups=2 with tensor parallelism \(T=2\) is not supported"):
        dmuon.plan.compile(
            make_model(), 2, owner_groups=2, tp=dmuon.plan.TPPolicy(size=2, shard_dims={"layers.0.tall.weight": 0})
        )


# -------------------------------------------------------------------------------- distributed

CASES = [  # (mesh shape, k, reshard_after_forward[, collectives]); default "auto" (all-gathers here)
    (None, 2, True),
    (None, 4, False),
    ((2, 2), 2, True),
    ((2, 2), 2, False),
    (None, 2, True, "broadcast"),
]


def _mesh(shape):
    from torch.distributed.device_mesh import init_device_mesh

    return None if shape is None else init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))


def _build(mesh, k, z3, *, meta=False, collectives="auto"):
    from torch.distributed.fsdp import fully_shard

    import dmuon

    if meta:
        with torch.device("meta"):
            model = FewMatrixLM()
    else:
        model = make_model()
    plan = dmuon.dedicate_params(model, mesh, owner_groups=k, reshard_after_forward=z3, collectives=collectives)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if meta:
        model.to_empty(device="cpu")
        torch.manual_seed(0)
        dmuon.init_params(model)
    opt = dmuon_optimizer(model, torch.float32)
    return model, opt, plan


def _full(model):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return {k: v.detach().clone() for k, v in sd.items()}


def _full_optim(model, opt):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    osd = get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    return {
        k: {n: t.detach().clone() for n, t in v.items() if isinstance(t, torch.Tensor)} for k, v in osd["state"].items()
    }


def _worker(root):
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import dmuon
    from dmuon.exec._comm.collective_calls import LEDGER

    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {"cases": []}
    for shape, k, z3, *kind in CASES:
        mesh = _mesh(shape)
        model, opt, plan = _build(mesh, k, z3, collectives=kind[0] if kind else "auto")
        losses, ledgers, norms = [], [], []
        for batch in batches():
            LEDGER.reset()
            loss = lm_loss(model, batch.chunk(world)[rank])
            loss.backward()
            norms.append(dmuon.clip_grad_norm_(model, 1e9).item())  # no clipping: the norm only
            opt.step()
            opt.zero_grad()
            ledgers.append(LEDGER.snapshot())
            t = loss.detach().clone()
            dist.all_reduce(t)
            losses.append(t.item() / world)
        out["cases"].append(
            dict(plan_json=plan.to_json(), losses=losses, ledgers=ledgers, norms=norms, full=_full(model))
        )
        dist.barrier()

    # no_sync: two micro-batches, the first inside the context == one step on the whole batch
    model, opt, plan = _build(None, 2, True)
    batch = batches(1)[0].chunk(world)[rank]
    halves = batch.chunk(2)
    with dmuon.no_sync(model):
        (lm_loss(model, halves[0]) * 0.5).backward()
    (lm_loss(model, halves[1]) * 0.5).backward()
    opt.step()
    out["no_sync"] = _full(model)

    # checkpoint: save from 1-D k = 2 after 2 steps; load into the same plan (continuation is
    # bit-identical), into exclusive owners and into HSDP k = 2 (same values everywhere)
    path = f"{root}/og"
    model, opt, plan = _build(None, 2, True)
    train_steps(model, opt, batches(2))
    dcp.save(_sharded(model, opt), checkpoint_id=path)
    saved_full, saved_optim = _full(model), _full_optim(model, opt)
    more = batches(3)[2:]
    cont = train_steps(model, opt, more)
    cont_full = _full(model)
    resumed = {}
    for name, shape, k in (("same", None, 2), ("exclusive", None, "off"), ("hsdp", (2, 2), 2)):
        m2, o2, _ = _build(_mesh(shape), k, True)
        _load(m2, o2, path)
        got_full, got_optim = _full(m2), _full_optim(m2, o2)
        entry = dict(
            params_equal=all(torch.equal(got_full[n], saved_full[n]) for n in saved_full),
            momentum_equal=all(
                torch.equal(got_optim[n][s], saved_optim[n][s]) for n in saved_optim for s in saved_optim[n]
            ),
        )
        if name == "same":
            entry["cont_losses_equal"] = train_steps(m2, o2, more) == cont
            entry["cont_params_equal"] = all(torch.equal(v, cont_full[n]) for n, v in _full(m2).items())
        resumed[name] = entry
    out["resumed"] = resumed

    # meta-device build + init_params == the single-process init (seed 0)
    model, opt, plan = _build(None, 2, True, meta=True)
    out["meta_full"] = _full(model)
    # NorMuon on owner-grouped matrices: refused at construction, the same error on every rank
    try:
        dmuon.Muon(model, ns_dtype=torch.float32, variant="normuon")
        out["normuon_error"] = None
    except ValueError as exc:
        out["normuon_error"] = str(exc)
    dist.barrier()
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("owner_groups"))
    return run_distributed(_worker, 4, root, timeout_s=300)


def _reference(steps_batches, dedicated):
    return reference_run(
        make_model(), dedicated, steps_batches, ns_fp32=True, newton_schulz=_gram_reference_ns, grad_norms=(norms := [])
    )[:2] + (norms,)


def _assert_close(got: dict, want: dict, where):
    assert set(got) == set(want), where
    for k, w in want.items():
        scale = w.abs().max().item() or 1.0
        err = (got[k] - w).abs().max().item()
        assert err <= PARAM_TOL * scale, (where, k, err, scale)


@pytest.mark.parametrize("case", range(len(CASES)))
def test_matches_gram_ns_oracle_and_plan_bytes(results, case):
    from dmuon.plan import ShardingPlan

    shape, k, z3, *kind = CASES[case]
    where = f"mesh={shape} k={k} z3={z3} {kind}"
    per_rank = [r["cases"][case] for r in results]
    plan = ShardingPlan.from_json(per_rank[0]["plan_json"])
    kinds = {buf.collective for b in plan.boundaries for buf in b.buffers}
    assert kinds == ({"broadcast"} if kind else {"all_gather"}), (where, kinds)
    if kind:  # the all-gathered twin (case 0, N = 2): the same run bit for bit
        assert per_rank[0]["losses"] == results[0]["cases"][0]["losses"], where
    ref_losses, ref_state, ref_norms = _reference(batches(), set(plan.dedicated))
    for got, want in zip(per_rank[0]["losses"], ref_losses):
        assert math.isclose(got, want, rel_tol=LOSS_RTOL), (where, got, want)
    for r in per_rank:
        _assert_close(r["full"], ref_state, where)
        for got, want in zip(r["norms"], ref_norms):
            assert math.isclose(got, want, rel_tol=1e-5), (where, got, want)
    cost = plan.cost
    assert cost.owner_group_nbytes > 0
    for step in range(STEPS):
        per_rank_bytes = tuple(sum(v for p, v in r["ledgers"][step].items() if p != "other") for r in per_rank)
        assert per_rank_bytes == cost.per_rank_nbytes, (where, step)
        assert sum(r["ledgers"][step]["owner_group"] for r in per_rank) == cost.owner_group_nbytes, where


def test_no_sync_accumulation_matches_one_step(results):
    import copy

    model = make_model()
    dedicated = {n for n, p in model.named_parameters() if n.startswith("layers.") and p.ndim == 2}
    ref_losses, ref_state, _ = _reference(batches(1), dedicated)
    for r in results:
        _assert_close(r["no_sync"], ref_state, "no_sync")
    del copy


def test_checkpoint_round_trips(results):
    for r in results:
        res = r["resumed"]
        assert res["same"] == dict(
            params_equal=True, momentum_equal=True, cont_losses_equal=True, cont_params_equal=True
        )
        assert res["exclusive"] == dict(params_equal=True, momentum_equal=True)
        assert res["hsdp"] == dict(params_equal=True, momentum_equal=True)


def test_normuon_is_refused_on_owner_groups_on_every_rank(results):
    """NorMuon's row statistic would need an all-reduce per owner group and step;
    dmuon.Muon(variant="normuon") refuses, naming the first grouped parameter and the fix."""
    errors = [r["normuon_error"] for r in results]
    assert errors[0] is not None and all(e == errors[0] for e in errors)
    assert "is owned by an owner group" in errors[0] and "owner_groups='off'" in errors[0], errors[0]


def test_meta_init_equals_single_process_init(results):
    want = make_model().state_dict()
    for r in results:
        assert set(r["meta_full"]) == set(want)
        for k, v in want.items():
            assert torch.equal(r["meta_full"][k], v), k
