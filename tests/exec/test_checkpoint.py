"""Checkpoint oracle tests: torch.distributed.checkpoint with owner-held matrices.

Three process groups, run once per module (process start-up dominates on 2 cores):

* **N=4** — cases ``1d`` (mesh N=4, Z3), ``hsdp`` (mesh (2, 2), Z2) and ``1d_normuon`` (N=4 with
  ``dmuon.Muon(variant="normuon")``: its second moments ``(m, 1)`` chunked like the momentum, issue
  37): train 2 steps, a no-grad
  eval forward, then ``dcp.save`` of the sharded model + optimizer state dicts. Checked there:
  identical keys on every rank, every dedicated matrix and momentum as a full-shape DTensor whose
  local part is one row chunk, plain ``model.state_dict()`` semantics, ``dmuon.full_state_dict``
  on rank 0 only, the dummy-step guard; then a resume at the same N (fresh model, ``dcp.load``,
  one more step) against the uninterrupted run: bit-identical losses, parameters and optimizer
  state; and the optimizer state flattened (``flatten_optimizer_state_dict=True``) loaded through
  torch's own unflattening into a fresh model, equal bit for bit.
* **N=1** — loads the two Muon N=4 checkpoints, trains 2 steps, saves again.
* **N=2** — loads the N=4 checkpoints (1-D -> N=2, HSDP -> HSDP (2, 1), NorMuon 1-D -> N=2) and,
  "back" up, the N=1 ones, and trains one more step; a Muon checkpoint into NorMuon (zero second
  moments, a warning) and a NorMuon checkpoint into Muon (refused on every rank); then full-state-dict
  round trips, Muon and NorMuon (``full_state_dict=True, cpu_offload=True`` on rank 0 ->
  ``broadcast_from_rank0=True`` into a fresh model), continue bit-identically.

Across N the run is checked against the single-process oracle (``tests/oracle.py``) with the fp32
Newton-Schulz contract: losses within ``LOSS_RTOL`` relative, every parameter within
``PARAM_TOL`` of its largest magnitude (measured worst: see ``docs/checkpointing.md``).
The model has a dedicated matrix (and an AdamW bias) that never gets a gradient.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn

from dcp_utils import dcp_load as _load
from dcp_utils import sharded_state as _sharded
from dist_utils import run_distributed
from dmuon.exec import dedicated_info, get_model_runtime
from oracle import Block, TinyLM, dmuon_optimizer, global_batches, reference_run, train_steps

LOSS_RTOL = 1e-6
PARAM_TOL = 1e-4
TOTAL_STEPS = 5
SAVE_AT = 2  # steps before the N=4 checkpoint
RESAVE_AT = 4  # steps before the N=1 checkpoint

# name -> (mesh shape, reshard_after_forward[, optimizer variant])
CASES4 = {"1d": (None, True), "hsdp": ((2, 2), False), "1d_normuon": (None, True, "normuon")}


def _variant(name: str) -> str:
    return (CASES4[name][2:] or ("muon",))[0]


class NeverBlock(Block):
    """A ``Block`` with a matrix (and a bias) that no forward ever uses."""

    def __init__(self):
        super().__init__()
        self.never = nn.Linear(8, 8)


class NeverLM(TinyLM):
    def __init__(self):
        super().__init__(n_layers=2)
        self.layers = nn.ModuleList(NeverBlock() for _ in range(2))


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return NeverLM()


# ----------------------------------------------------------------------------------------------
# helpers run inside the ranks
# ----------------------------------------------------------------------------------------------


def _mesh(shape):
    from torch.distributed.device_mesh import init_device_mesh

    return None if shape is None else init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))


def _build(mesh, z3=True, variant="muon"):
    from torch.distributed.fsdp import fully_shard

    import dmuon

    model = make_model()
    plan = dmuon.dedicate_params(model, mesh, reshard_after_forward=z3)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = dmuon_optimizer(model, torch.float32, variant=variant)
    opt.init_state()  # torch's DCP helpers would otherwise dummy-step an empty state
    return model, opt, plan


def _save(model, opt, path):
    import torch.distributed.checkpoint as dcp

    dcp.save(_sharded(model, opt), checkpoint_id=path)


def _full_optim(model, opt):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    osd = get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return osd


def _flat_round_trip(model, opt, mesh, z3, variant) -> bool | None:
    """The sharded optimizer state flattened (``flatten_optimizer_state_dict=True``, as under pipeline
    parallelism) and loaded with torch's own unflattening into a fresh model at the same layout: the
    full optimizer state equal bit for bit (rank 0; None elsewhere)."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    flat = StateDictOptions(flatten_optimizer_state_dict=True)
    msd, osd = get_model_state_dict(model), get_optimizer_state_dict(model, opt, options=flat)
    fresh, fresh_opt, _ = _build(mesh, z3, variant)
    set_model_state_dict(fresh, msd)
    set_optimizer_state_dict(fresh, fresh_opt, osd, options=flat)
    want, got = _full_optim(model, opt), _full_optim(fresh, fresh_opt)
    if dist.get_rank() != 0:
        return None
    return set(want["state"]) == set(got["state"]) and all(
        torch.equal(torch.as_tensor(v), torch.as_tensor(got["state"][k][key]))
        for k, entry in want["state"].items()
        for key, v in entry.items()
    )


def _layout_report(model, opt, plan):
    """Keys, and for each dedicated entry: global shape and local rows vs the row-chunk bound."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    sd = _sharded(model, opt)
    msd, osd = sd["model"], sd["optim"]
    rt = get_model_runtime(model)
    N = rt.groups.shape[1]
    dedicated = set(plan.dedicated)
    bad = []
    for key, value in msd.items():
        if key in dedicated:
            chunk = -(-value.shape[0] // N)
            if not isinstance(value, DTensor) or value.to_local().shape[0] > chunk:
                bad.append(("model", key))
            if tuple(value.shape) != tuple(plan.param(key).shape):
                bad.append(("model shape", key))
    for key in dedicated:
        buf = osd["state"][key]["momentum_buffer"]
        chunk = -(-buf.shape[0] // N)
        if not isinstance(buf, DTensor) or buf.to_local().shape[0] > chunk or tuple(buf.shape) != plan.param(key).shape:
            bad.append(("momentum", key))
        v = osd["state"][key].get("second_momentum_buffer")  # NorMuon: (out, 1), chunked like the momentum
        if v is not None and (
            not isinstance(v, DTensor)
            or v.to_local().shape[0] > chunk
            or tuple(v.shape) != (plan.param(key).shape[0], 1)
            or v.dtype != torch.float32
        ):
            bad.append(("second moment", key))
    # a plain model.state_dict(): the same sharded form, no zero-size placeholder anywhere
    plain = model.state_dict()
    zero = [k for k, v in plain.items() if isinstance(v, torch.Tensor) and v.numel() == 0]
    plain_dtensor = all(
        isinstance(plain[k], DTensor) and tuple(plain[k].shape) == plan.param(k).shape for k in dedicated
    )
    return dict(
        rank=dist.get_rank(),
        model_keys=list(msd),
        optim_keys={k: sorted(v) for k, v in osd["state"].items()},
        groups=[sorted(g["params"]) for g in osd["param_groups"]],
        bad=bad,
        plain_zero=zero,
        plain_dtensor=plain_dtensor,
        plain_keys=sorted(plain),
    )


def _placeholder_guard(model, opt):
    """A gradient on a placeholder (what DCP's dummy-step init does) makes step() raise."""
    ph = [p for p in model.parameters() if dedicated_info(p) is not None and not dedicated_info(p).is_owner]
    if not ph:
        return "no placeholder"
    ph[0].grad = torch.zeros_like(ph[0])
    try:
        opt.step()
    except RuntimeError as exc:
        return str(exc)
    finally:
        ph[0].grad = None
    return "did not raise"


# ----------------------------------------------------------------------------------------------
# the three process groups
# ----------------------------------------------------------------------------------------------


def _worker4(root):
    import torch.distributed as dist

    import dmuon

    torch.set_num_threads(1)
    rank = dist.get_rank()
    batches = global_batches(TOTAL_STEPS)
    probe = global_batches(1, seed=9)[0][:2, :-1]
    out = {}
    for name, (shape, z3, *_) in CASES4.items():
        mesh = _mesh(shape)
        model, opt, plan = _build(mesh, z3, _variant(name))
        losses = train_steps(model, opt, batches[:SAVE_AT])
        with torch.no_grad():  # eval forward right before saving
            model(probe)
        report = _layout_report(model, opt, plan)
        full_at_save = dmuon.full_state_dict(model)
        full_all = dmuon.full_state_dict(model, rank0_only=False, cpu_offload=False)
        osd_at_save = _full_optim(model, opt)
        _save(model, opt, f"{root}/{name}_s{SAVE_AT}")
        with torch.no_grad():
            eval_at_save = model(probe)
        # uninterrupted vs resumed at the same N
        cont_losses = train_steps(model, opt, batches[SAVE_AT : SAVE_AT + 1])
        cont_full, cont_osd = dmuon.full_state_dict(model), _full_optim(model, opt)
        model2, opt2, _ = _build(mesh, z3, _variant(name))
        _load(model2, opt2, f"{root}/{name}_s{SAVE_AT}")
        with torch.no_grad():  # every rank's first forward sees the loaded values
            same_eval = torch.equal(eval_at_save, model2(probe))
        res_losses = train_steps(model2, opt2, batches[SAVE_AT : SAVE_AT + 1])
        res_full, res_osd = dmuon.full_state_dict(model2), _full_optim(model2, opt2)
        guard = _placeholder_guard(model2, opt2)
        flat_round_trip = _flat_round_trip(model2, opt2, mesh, z3, _variant(name))
        out[name] = dict(
            plan_dedicated=plan.dedicated,
            losses=losses,
            report=report,
            full_at_save=full_at_save,
            full_all_keys=sorted(full_all),
            full_all_equal=all(torch.equal(full_all[k], full_at_save[k]) for k in full_at_save),
            osd_at_save=osd_at_save if rank == 0 else None,
            cont=(cont_losses, cont_full, cont_osd if rank == 0 else None),
            res=(res_losses, res_full, res_osd if rank == 0 else None),
            same_eval=same_eval,
            guard=guard,
            flat_round_trip=flat_round_trip,
        )
        dist.barrier()
    return out


def _worker1(root):
    import dmuon

    torch.set_num_threads(1)
    batches = global_batches(TOTAL_STEPS)
    out = {}
    for name in CASES4:
        if _variant(name) != "muon":
            continue  # NorMuon reshards 4 -> 2 below (the N = 2 launch)
        model, opt, _ = _build(None)
        _load(model, opt, f"{root}/{name}_s{SAVE_AT}")
        losses = train_steps(model, opt, batches[SAVE_AT:RESAVE_AT])
        _save(model, opt, f"{root}/{name}_n1_s{RESAVE_AT}")
        out[name] = dict(losses=losses, full=dmuon.full_state_dict(model))
    return out


def _worker2(root):
    import torch.distributed as dist

    import dmuon

    torch.set_num_threads(1)
    batches = global_batches(TOTAL_STEPS)
    out = {}
    # (label, checkpoint, mesh shape at N=2, steps done in the checkpoint, variant)
    runs = [
        ("1d from N=4", f"{root}/1d_s{SAVE_AT}", None, SAVE_AT, "muon"),
        ("hsdp(2,2) -> hsdp(2,1)", f"{root}/hsdp_s{SAVE_AT}", (2, 1), SAVE_AT, "muon"),
        ("1d back from N=1", f"{root}/1d_n1_s{RESAVE_AT}", None, RESAVE_AT, "muon"),
        ("hsdp back from N=1 -> hsdp(2,1)", f"{root}/hsdp_n1_s{RESAVE_AT}", (2, 1), RESAVE_AT, "muon"),
        ("normuon 1d from N=4", f"{root}/1d_normuon_s{SAVE_AT}", None, SAVE_AT, "normuon"),
    ]
    kept, kept_normuon = None, None
    for label, path, shape, done, variant in runs:
        model, opt, _ = _build(_mesh(shape), variant=variant)
        _load(model, opt, path)
        losses = train_steps(model, opt, batches[done : done + 1])
        out[label] = dict(done=done, losses=losses, full=dmuon.full_state_dict(model), variant=variant)
        if variant == "muon":
            kept = kept or (model, opt, done + 1)
        else:
            kept_normuon = (model, opt, done + 1)
        dist.barrier()
    out["full round trip"] = _full_round_trip(*kept, batches)
    out["normuon full round trip"] = _full_round_trip(*kept_normuon, batches, variant="normuon")
    out["muon into normuon"], out["normuon into muon"] = _cross_variant_loads(root)
    return out


def _cross_variant_loads(root):
    """A Muon checkpoint into ``variant="normuon"`` (DCP with ``allow_partial_load=True``, the
    documented way: the second moments are not in it): a warning, zero second moments, momenta
    loaded. A NorMuon checkpoint into ``variant="muon"``: the same ValueError on every rank."""
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    model, opt, _ = _build(None, variant="normuon")
    sd = _sharded(model, opt)
    dcp.load(sd, checkpoint_id=f"{root}/1d_s{SAVE_AT}", planner=DefaultLoadPlanner(allow_partial_load=True))
    set_model_state_dict(model, sd["model"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        set_optimizer_state_dict(model, opt, sd["optim"])
    owned = [st for st in opt.state.values() if "second_momentum_buffer" in st]
    into_normuon = dict(
        warned=[str(w.message) for w in caught if "second moments start at zero" in str(w.message)],
        zeros=all(not st["second_momentum_buffer"].any() for st in owned),
        momenta=sum(bool(st["momentum_buffer"].any()) for st in owned),
        owned=len(owned),
    )
    model, opt, _ = _build(None)
    try:
        _load(model, opt, f"{root}/1d_normuon_s{SAVE_AT}")
        into_muon = None
    except ValueError as exc:
        into_muon = str(exc)
    return into_normuon, into_muon


def _full_round_trip(model, opt, done, batches, variant="muon"):
    """full_state_dict=True + cpu_offload (rank 0 only) -> torch.save / torch.load(weights_only)
    -> broadcast_from_rank0 into a fresh model: continuing both gives bit-identical results."""
    import io

    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    import dmuon

    rank = dist.get_rank()
    get = StateDictOptions(full_state_dict=True, cpu_offload=True)
    msd = get_model_state_dict(model, options=get)
    osd = get_optimizer_state_dict(model, opt, options=get)
    only_rank0 = (msd == {} and osd == {}) if rank else bool(msd and osd)
    if rank == 0:  # through bytes, as an export would go (and no tensor shared with `opt`)
        buf = io.BytesIO()
        torch.save({"model": msd, "optim": osd}, buf)
        buf.seek(0)
        loaded = torch.load(buf, weights_only=True)
        msd, osd = loaded["model"], loaded["optim"]
    full_shapes = rank != 0 or all(
        v.shape == osd["state"][k]["momentum_buffer"].shape
        for k, v in msd.items()
        if k in osd["state"] and "momentum_buffer" in osd["state"][k]
    )
    if rank == 0 and variant == "normuon":  # plain full tensors of the second-moment shape (out, 1)
        full_shapes = full_shapes and all(
            osd["state"][k]["second_momentum_buffer"].shape == (v.shape[0], 1)
            for k, v in msd.items()
            if k in osd["state"] and "momentum_buffer" in osd["state"][k]
        )
    fresh, fresh_opt, _ = _build(None, variant=variant)
    put = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(fresh, msd, options=put)
    set_optimizer_state_dict(fresh, fresh_opt, osd, options=put)
    a = train_steps(model, opt, batches[done : done + 1])
    b = train_steps(fresh, fresh_opt, batches[done : done + 1])
    fa, fb = dmuon.full_state_dict(model), dmuon.full_state_dict(fresh)
    return dict(
        only_rank0=only_rank0,
        full_shapes=full_shapes,
        same_losses=a == b,
        same_params=all(torch.equal(fa[k], fb[k]) for k in fa),
    )


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("dmuon-ckpt"))
    r4 = run_distributed(_worker4, 4, root, timeout_s=360)
    r1 = run_distributed(_worker1, 1, root, timeout_s=120)
    r2 = run_distributed(_worker2, 2, root, timeout_s=300)
    return r4, r1, r2


@pytest.fixture(scope="module")
def reference():
    """Single-process oracle after k steps, k = 0..TOTAL_STEPS: (losses, state); NorMuon's
    under ``("normuon", k)`` for the steps its cases reach."""
    model = make_model()
    from dmuon.plan import compile as compile_plan

    dedicated = set(compile_plan(model, 1).dedicated)
    batches = global_batches(TOTAL_STEPS)
    out = {}
    for k in range(1, TOTAL_STEPS + 1):
        res = reference_run(model, dedicated, batches[:k], ns_fp32=True)
        out[k] = (res[0], res[1])
    for k in (SAVE_AT, SAVE_AT + 1):
        res = reference_run(model, dedicated, batches[:k], ns_fp32=True, variant="normuon")
        out[("normuon", k)] = (res[0], res[1])
    return out


def _assert_close_state(got, want, where):
    assert set(got) == set(want), where
    worst = 0.0
    for k, w in want.items():
        g = got[k]
        assert g.shape == w.shape, (where, k)
        scale = w.abs().max().item() or 1.0
        err = (g - w).abs().max().item() / scale
        worst = max(worst, err)
        assert err <= PARAM_TOL, (where, k, err)
    return worst


def _assert_losses(got, want, where):
    for g, w in zip(got, want):
        assert math.isclose(g, w, rel_tol=LOSS_RTOL), (where, g, w)


# ----------------------------------------------------------------------------------------------
# tests
# ----------------------------------------------------------------------------------------------


def test_sharded_state_dicts_have_identical_keys_and_row_chunks(chain):
    r4, _, _ = chain
    for name in CASES4:
        reports = [r[name]["report"] for r in r4]
        dedicated = r4[0][name]["plan_dedicated"]
        assert any("never" in k for k in dedicated), "the never-used matrix must be dedicated"
        for rep in reports:
            assert rep["bad"] == [], (name, rep["rank"], rep["bad"])
            assert rep["model_keys"] == reports[0]["model_keys"], name
            assert rep["optim_keys"] == reports[0]["optim_keys"], name
            assert rep["groups"] == reports[0]["groups"], name
            # every dedicated param (never-used included) has its momentum on every rank
            want = ["momentum_buffer"] + (["second_momentum_buffer"] if _variant(name) == "normuon" else [])
            for k in dedicated:
                assert rep["optim_keys"][k] == want, (name, k)
            # ...and every AdamW param its state (eager init_state, never-used bias included)
            for k, v in rep["optim_keys"].items():
                if k not in dedicated:
                    assert v == ["exp_avg", "exp_avg_sq", "step"], (name, k)


def test_plain_state_dict_is_sharded_never_placeholders(chain):
    r4, _, _ = chain
    for name in CASES4:
        for r in r4:
            rep = r[name]["report"]
            assert rep["plain_zero"] == [], (name, rep["rank"])
            assert rep["plain_dtensor"], (name, rep["rank"])
            assert rep["plain_keys"] == sorted(rep["model_keys"]), name


def test_rank0_full_state_dict_matches_single_process(chain, reference):
    r4, _, _ = chain
    for name in CASES4:
        ref_losses, ref_state = reference[SAVE_AT] if _variant(name) == "muon" else reference[("normuon", SAVE_AT)]
        full = r4[0][name]["full_at_save"]
        _assert_close_state(full, ref_state, f"N=4 {name} at save")
        assert all(r[name]["full_at_save"] == {} for r in r4[1:]), name  # rank 0 only
        assert r4[0][name]["full_all_equal"] and r4[1][name]["full_all_keys"] == sorted(ref_state), name
        _assert_losses(r4[0][name]["losses"], ref_losses, f"N=4 {name}")
        # the never-used matrix: untouched, momentum exactly zero
        osd = r4[0][name]["osd_at_save"]
        never = [k for k in r4[0][name]["plan_dedicated"] if "never" in k]
        for k in never:
            assert torch.equal(full[k], make_model().state_dict()[k]), k
            assert not osd["state"][k]["momentum_buffer"].any(), k
            assert tuple(osd["state"][k]["momentum_buffer"].shape) == tuple(full[k].shape)


def test_resume_at_same_n_is_bit_identical(chain):
    r4, _, _ = chain
    for name in CASES4:
        for r in r4:
            assert r[name]["same_eval"], (name, "loaded values not seen by the first forward")
        cont_losses, cont_full, cont_osd = r4[0][name]["cont"]
        res_losses, res_full, res_osd = r4[0][name]["res"]
        assert cont_losses == res_losses, name
        assert set(cont_full) == set(res_full)
        for k in cont_full:
            assert torch.equal(cont_full[k], res_full[k]), (name, k)
        assert set(cont_osd["state"]) == set(res_osd["state"])
        for k, entry in cont_osd["state"].items():
            for key, value in entry.items():
                assert torch.equal(value, res_osd["state"][k][key]), (name, k, key)


def test_flattened_optimizer_state_round_trip(chain):
    """``set_optimizer_state_dict(..., flatten_optimizer_state_dict=True)`` (torch's unflattening, with
    dmuon's ``dcp.unflatten_optim`` integration) loads every momentum, HSDP's and NorMuon's second
    moments included, bit for bit: no rank skips its part of the gather to the owner."""
    r4, _, _ = chain
    for name in CASES4:
        assert r4[0][name]["flat_round_trip"] is True, name


def test_dcp_dummy_step_guard(chain):
    r4, _, _ = chain
    for r in r4:
        for name in CASES4:
            assert "init_state" in r[name]["guard"], r[name]["guard"]


def test_reshard_4_to_1_to_2_matches_single_process(chain, reference):
    _, r1, r2 = chain
    for name in CASES4:
        if _variant(name) != "muon":
            continue
        got = r1[0][name]
        _assert_losses(got["losses"], reference[RESAVE_AT][0][SAVE_AT:], f"N=4 {name} -> N=1")
        _assert_close_state(got["full"], reference[RESAVE_AT][1], f"N=4 {name} -> N=1")
    for label, got in r2[0].items():
        if "round trip" in label or " into " in label:
            continue
        k = got["done"] + 1
        ref = reference[k] if got["variant"] == "muon" else reference[("normuon", k)]
        _assert_losses(got["losses"], ref[0][got["done"] :], label)
        _assert_close_state(got["full"], ref[1], label)


def test_full_state_dict_round_trip_through_rank0(chain):
    _, _, r2 = chain
    for r in r2:
        for label in ("full round trip", "normuon full round trip"):
            got = r[label]
            assert got["only_rank0"] and got["full_shapes"], (label, got)
            assert got["same_losses"] and got["same_params"], (label, got)


def test_muon_checkpoint_into_normuon_and_back(chain):
    """Muon -> NorMuon: zero second moments, loaded momenta, one warning on every rank;
    NorMuon -> Muon: refused with the same message on every rank, naming the fix."""
    _, _, r2 = chain
    for r in r2:
        got = r["muon into normuon"]
        assert len(got["warned"]) == 1 and got["zeros"] and got["owned"] > 0, got
        assert got["momenta"] >= got["owned"] - 2, got  # every owned matrix but the never-used one moved
        assert r["normuon into muon"] == r2[0]["normuon into muon"]
        assert "is NorMuon's" in r["normuon into muon"] and "variant='normuon'" in r["normuon into muon"]
