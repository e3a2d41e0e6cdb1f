"""Meta-device initialisation: plan and dedicate on ``meta``, ``to_empty``, initialise.

One process group of 4 ranks runs a 1-D mesh (N=4) and an HSDP mesh (2, 2). For each:

* on ``meta`` nothing is allocated, and reading a state dict or running a forward raises a clear
  error instead of touching meta storage;
* ``model.to_empty(device="cpu")``: each holder allocates exactly its own segments (the plan's
  layout for its shard coordinate), its logical parameters are views of them; non-holders keep
  zero-size placeholders and no segment storage;
* ``torch.manual_seed(0); dmuon.init_params(model)`` equals the single-process ``TinyLM()`` built
  with seed 0, bit for bit (rank-0 ``dmuon.full_state_dict``), and training from there matches
  the single-process oracle (fp32 Newton-Schulz contract);
* the documented recipe ``set_model_state_dict(full_state_dict=True, broadcast_from_rank0=True)``
  from a rank-0 CPU model gives the same values bit for bit;
* the model's own ``reset_parameters`` run directly after ``to_empty`` works on every rank
  (placeholders have zero rows), and HSDP replicas hold their owner's values before first use
  even when every rank drew different numbers.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import dmuon
from dist_utils import run_distributed
from dmuon.exec import dedicated_info, get_model_runtime
from oracle import TinyLM, dmuon_optimizer, global_batches, make_model, reference_run, train_steps

CASES = {"1d": None, "hsdp": (2, 2)}
STEPS = 2


def _build_meta(mesh, *, shard=True):
    from torch.distributed.fsdp import fully_shard

    import dmuon

    torch.manual_seed(0)
    with torch.device("meta"):
        model = TinyLM()
    plan = dmuon.dedicate_params(model, mesh)
    if shard:
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model, plan


def _storage_report(model, plan):
    rt = get_model_runtime(model)
    me = rt.groups.shard
    want = sum(seg.numel for b in plan.boundaries for buf in b.buffers for seg in buf.segments if seg.shard == me)
    held = [seg for b in rt.boundaries for seg in b.segments if seg.held]
    views = all(
        s.logical.untyped_storage()._cdata == seg.master.untyped_storage()._cdata for seg in held for s in seg.slots
    )
    placeholders = [
        p.numel() for p in model.parameters() if dedicated_info(p) is not None and not dedicated_info(p).holds_full
    ]
    return dict(
        held_numel=sum(seg.master.numel() for seg in held),
        held_devices=sorted({str(seg.master.device) for seg in held}),
        want_numel=want,
        logical_views_of_master=views,
        placeholder_numel=sum(placeholders),
        non_held_bytes=sum(
            seg.wire.untyped_storage().nbytes() for b in rt.boundaries for seg in b.segments if not seg.held
        ),
    )


def _worker():
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    import dmuon

    torch.set_num_threads(1)
    rank = dist.get_rank()
    out = {}
    for name, shape in CASES.items():
        mesh = None if shape is None else init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))
        res = {}
        # -- errors while on meta ------------------------------------------------------------
        bare, _ = _build_meta(mesh, shard=False)
        try:
            bare(global_batches(1)[0][:2, :-1])
            res["forward_on_meta"] = "no error"
        except RuntimeError as exc:
            res["forward_on_meta"] = str(exc)
        model, plan = _build_meta(mesh)
        res["all_meta"] = all(p.device.type == "meta" for p in model.parameters())
        try:
            model.state_dict()
            res["state_dict_on_meta"] = "no error"
        except RuntimeError as exc:
            res["state_dict_on_meta"] = str(exc)
        # -- to_empty + dmuon.init_params -----------------------------------------------------
        params_before = {id(p) for p in model.parameters()}
        model.to_empty(device="cpu")
        res["same_param_objects"] = {id(p) for p in model.parameters()} == params_before
        res["storage"] = _storage_report(model, plan)
        torch.manual_seed(0)
        dmuon.init_params(model)
        res["init"] = dmuon.full_state_dict(model)
        opt = dmuon_optimizer(model, torch.float32)
        res["losses"] = train_steps(model, opt, global_batches(STEPS))
        res["trained"] = dmuon.full_state_dict(model)
        res["plan_dedicated"] = plan.dedicated
        # -- recipe: full state dict broadcast from rank 0 ------------------------------------
        model2, _ = _build_meta(mesh)
        model2.to_empty(device="cpu")
        full = make_model("tiny").state_dict() if rank == 0 else {}
        set_model_state_dict(model2, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
        res["recipe"] = dmuon.full_state_dict(model2)
        # -- the model's own init, run directly ----------------------------------------------
        model3, _ = _build_meta(mesh)
        model3.to_empty(device="cpu")
        torch.manual_seed(100 + rank)  # replicas draw different numbers: dmuon must sync them
        for m in model3.modules():
            if hasattr(m, "reset_parameters"):
                m.reset_parameters()
        with torch.no_grad():
            model3(global_batches(1)[0][:2, :-1])
        rt = get_model_runtime(model3)
        res["held_masters"] = {
            (b.fqn, seg.shard): seg.master.clone() for b in rt.boundaries for seg in b.segments if seg.held
        }
        res["coords"] = (rt.groups.replicate, rt.groups.shard)
        out[name] = res
        dist.barrier()
    return out


def test_meta_device_init():
    results = run_distributed(_worker, 4, timeout_s=240)
    ref_init = make_model("tiny").state_dict()
    for name in CASES:
        per_rank = [r[name] for r in results]
        for rank, res in enumerate(per_rank):
            where = f"{name} rank {rank}"
            for key in ("forward_on_meta", "state_dict_on_meta"):
                assert res[key].startswith("dmuon:") and "to_empty" in res[key], (where, res[key])
            assert res["all_meta"], where
            assert res["same_param_objects"], where
            st = res["storage"]
            assert st["held_numel"] == st["want_numel"] and st["held_devices"] in ([], ["cpu"]), (where, st)
            assert st["logical_views_of_master"], where
            assert st["placeholder_numel"] == 0 and st["non_held_bytes"] == 0, (where, st)
        # bit-identical to the single-process init, by replay and by the rank-0 recipe
        for key in ("init", "recipe"):
            got = per_rank[0][key]
            assert set(got) == set(ref_init), (name, key)
            for k, v in ref_init.items():
                assert torch.equal(got[k], v), (name, key, k)
            assert all(r[key] == {} for r in per_rank[1:])
        # training from there: the single-process oracle (fp32 NS contract)
        ref_losses, ref_state = reference_run(
            make_model("tiny"), set(per_rank[0]["plan_dedicated"]), global_batches(STEPS), ns_fp32=True
        )[:2]
        for got, want in zip(per_rank[0]["losses"], ref_losses):
            assert math.isclose(got, want, rel_tol=1e-6), (name, got, want)
        for k, want in ref_state.items():
            err = (per_rank[0]["trained"][k] - want).abs().max().item()
            assert err <= 1e-4 * (want.abs().max().item() or 1.0), (name, k, err)
        # direct reset_parameters: every holder of a segment holds the same values (HSDP sync)
        by_segment = {}
        for res in per_rank:
            for key, value in res["held_masters"].items():
                by_segment.setdefault(key, []).append(value)
        for key, values in by_segment.items():
            assert all(torch.equal(values[0], v) for v in values[1:]), (name, key)
        if CASES[name] is not None:
            assert all(len(v) == CASES[name][0] for v in by_segment.values()), name


# ----------------------------------------------------------------------------------------------
# init_params: parameters no reset_parameters covers
# ----------------------------------------------------------------------------------------------


def test_init_params_reports_uncovered_raw_parameters():
    from oracle import TinyLM

    class PosLM(TinyLM):
        def __init__(self):
            super().__init__()
            self.pos = nn.Parameter(torch.randn(5, 8) * 0.02)  # no module's reset_parameters covers it

    with torch.device("meta"):
        model = PosLM()
    model.to_empty(device="cpu")
    with pytest.raises(ValueError, match=r"1 parameter\(s\) \('pos'\) belong to modules without reset_parameters"):
        dmuon.init_params(model)

    def init_fn(m):
        if hasattr(m, "reset_parameters"):
            m.reset_parameters()
        if isinstance(m, PosLM):
            nn.init.normal_(m.pos, std=0.02)

    torch.manual_seed(0)
    dmuon.init_params(model, init_fn)
    assert model.pos.abs().max() < 1.0 and torch.isfinite(model.pos).all()
    # a model every parameter of which some reset_parameters covers: no error, as before
    with torch.device("meta"):
        plain = TinyLM()
    plain.to_empty(device="cpu")
    torch.manual_seed(0)
    dmuon.init_params(plain)
    torch.manual_seed(0)
    ref = TinyLM()
    assert all(torch.equal(a, b) for a, b in zip(plain.state_dict().values(), ref.state_dict().values()))
