"""Checkpoints and meta-device initialisation under tensor parallelism.

The main job's GPT with Megatron-style TP (q/k/v/up colwise, o/down rowwise), every TP matrix
gathered for Newton-Schulz (``TPPolicy(ns="gather")``) so that one reference serves every mesh: one
process, the global batch, ``torch.optim.Muon`` (fp32 iteration) + AdamW (``tests/oracle.py``).

Two process groups, run once per module:

* **4 ranks** — (dp=2, tp=2): meta-device build -> ``to_empty`` -> ``dmuon.init_params``
  equals the CPU build bit for bit, holders hold exactly their TP shard, ``model.to(float64)``
  raises as without TP (the plan fixes dtypes); then train 2 steps,
  check the sharded state dicts (same keys on every rank, every dedicated matrix and momentum a
  DTensor of full shape whose local part is what ``compute_local_shape_and_global_offset``
  says), ``dmuon.full_state_dict`` == ``get_model_state_dict(full_state_dict=True)``,
  ``dcp.save``; continue 1 step vs a fresh model resumed from the checkpoint (bit-identical).
  The checkpoint then loads at dp=4 without TP (and is saved again), at HSDP (2, 2) without TP,
  at HSDP x TP (2, 1, 2) and at TP degree 4 (dp=1, tp=4); the dp=4 checkpoint loads back at
  (dp=2, tp=2).
* **2 ranks** — the (2, 2) checkpoint at (dp=1, tp=2) and at dp=2 without TP; the dp=4
  checkpoint back at (dp=1, tp=2); a rank-0 full state dict (``cpu_offload``, through
  ``torch.save`` bytes) broadcast into a fresh (dp=1, tp=2) model continues bit-identically.

Across meshes every run is checked against the reference after the same number of steps with
the fp32 contract: losses within ``LOSS_RTOL``, parameters within ``PARAM_TOL`` of each
tensor's largest magnitude.
"""

from __future__ import annotations

import math

import pytest
import torch

from dist_utils import run_distributed
from dmuon.exec import dedicated_info
from oracle import HP, dmuon_optimizer, global_batches, lm_loss, reference_run

LOSS_RTOL = 1e-5
PARAM_TOL = 1e-4
TOTAL_STEPS = 4
SAVE_AT = 2


def _cfg():
    from dmuon._train.byte_gpt import GPTConfig

    return GPTConfig(vocab_size=32, d_model=16, n_layers=2, n_heads=4, d_mlp=64, seq_len=8)


def _batches():
    return global_batches(TOTAL_STEPS, batch=8, seq=8, vocab=32, seed=3)


def _gpt_init_fn(model, seed: int = 0):
    """``GPT.reset_parameters(seed)`` as a per-module ``init_fn`` for ``dmuon.init_params``: the
    same generator, drawn in the same (``named_parameters()``) order."""
    gen = torch.Generator().manual_seed(seed)
    prefix = {id(m): (n + "." if n else "") for n, m in model.named_modules()}
    std, resid = 0.02, 0.02 / math.sqrt(2 * model.cfg.n_layers)

    def init(module):
        for name, p in module.named_parameters(recurse=False):
            if p.ndim == 1:
                p.fill_(1.0)
                continue
            fqn = prefix[id(module)] + name
            s = resid if fqn.endswith(("o_proj.weight", "down_proj.weight")) else std
            p.copy_(torch.empty(p.shape).normal_(0.0, s, generator=gen))

    return init


# ----------------------------------------------------------------------------------------------
# inside the ranks
# ----------------------------------------------------------------------------------------------


def _meshes(kind: str, shape):
    """(data-parallel mesh, TP mesh or None) for ``kind`` in "tp" (dp, tp), "dp" (1-D or HSDP
    without TP), "hsdp_tp" (R, N, T)."""
    from torch.distributed.device_mesh import init_device_mesh

    if kind == "tp":
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=("dp", "tp"))
        return mesh["dp"], mesh["tp"]
    if kind == "hsdp_tp":
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard", "tp"))
        return mesh["replicate", "shard"], mesh["tp"]
    names = ("replicate", "shard") if len(shape) == 2 else ("dp",)
    return init_device_mesh("cpu", shape, mesh_dim_names=names), None


def _build(kind: str, shape, *, meta: bool = False):
    from torch.distributed.fsdp import fully_shard

    import dmuon
    from dmuon._train.byte_gpt import GPT, apply_tensor_parallel

    dp_mesh, tp_mesh = _meshes(kind, shape)
    model = GPT(_cfg(), seed=0, device="meta" if meta else None)
    if tp_mesh is not None:
        apply_tensor_parallel(model, tp_mesh)
    plan = dmuon.dedicate_params(model, dp_mesh, tp=dmuon.plan.TPPolicy(ns="gather"))
    for layer in model.layers:
        fully_shard(layer, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)
    if meta:
        model.to_empty(device="cpu")
        dmuon.init_params(model, init_fn=_gpt_init_fn(model))
    opt = dmuon_optimizer(model, torch.float32)
    opt.init_state()
    return dict(model=model, opt=opt, plan=plan, dp_mesh=dp_mesh)


def _train(run, batches) -> list[float]:
    """Data-parallel steps over the dp mesh (TP ranks of one dp coordinate share its slice)."""
    import torch.distributed as dist

    mesh = run["dp_mesh"]
    coord = mesh.get_coordinate()
    dp_index = coord[0] if len(coord) == 1 else coord[0] * mesh.shape[1] + coord[1]
    losses = []
    for batch in batches:
        loss = lm_loss(run["model"], batch.chunk(mesh.size())[dp_index])
        loss.backward()
        run["opt"].step()
        run["opt"].zero_grad()
        t = loss.detach().clone()
        dist.all_reduce(t)
        losses.append(t.item() / dist.get_world_size())
    return losses


def _sharded(run):
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    return {"model": get_model_state_dict(run["model"]), "optim": get_optimizer_state_dict(run["model"], run["opt"])}


def _save(run, path):
    import torch.distributed.checkpoint as dcp

    dcp.save(_sharded(run), checkpoint_id=path)


def _load(run, path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    sd = _sharded(run)
    dcp.load(sd, checkpoint_id=path)
    set_model_state_dict(run["model"], sd["model"])
    set_optimizer_state_dict(run["model"], run["opt"], sd["optim"])


def _full(run):
    """(rank-0 full model state dict, rank-0 full optimizer state dict) via torch's helpers."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    o = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(run["model"], options=o), get_optimizer_state_dict(run["model"], run["opt"], options=o)


def _layout_report(run):
    """Keys per rank, and every dedicated entry / momentum that is not a full-shape DTensor
    whose local part has the shape DTensor's own layout rule gives."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    from dmuon.exec._comm.collective_calls import LEDGER

    plan = run["plan"]
    LEDGER.reset()
    get_model_state_dict(run["model"])
    model_sd_nbytes = LEDGER.snapshot().get("other", 0)
    sd = _sharded(run)
    bad = []

    def check(what, key, v):
        ok = isinstance(v, DTensor) and tuple(v.shape) == tuple(plan.param(key).shape)
        if ok:
            want, _ = compute_local_shape_and_global_offset(v.shape, v.device_mesh, v.placements)
            ok = tuple(v.to_local().shape) == tuple(want)
        if not ok:
            bad.append((what, key))

    for key in plan.dedicated:
        check("model", key, sd["model"][key])
        check("momentum", key, sd["optim"]["state"][key]["momentum_buffer"])
    placements = {k: str(tuple(sd["model"][k].placements)) for k in plan.dedicated}
    return dict(
        bad=bad,
        model_keys=list(sd["model"]),
        optim_keys={k: sorted(v) for k, v in sd["optim"]["state"].items()},
        placements=placements,
        model_sd_nbytes=model_sd_nbytes,
    )


def _meta_report(run, plan):
    """Holders keep exactly their TP shard (a view of their own segment), others nothing."""
    bad = []
    for spec in plan.params:
        p = run["model"].get_parameter(spec.fqn)
        info = dedicated_info(p)
        local = p.to_local() if hasattr(p, "to_local") else p
        want = tuple(spec.local_shape) if info.holds_full else (0, *spec.local_shape[1:])
        if tuple(local.shape) != want:
            bad.append((spec.fqn, tuple(local.shape), want))
    return bad


def _worker4(root):
    import torch.distributed as dist

    import dmuon

    torch.set_num_threads(1)
    rank = dist.get_rank()
    batches = _batches()
    out = {}

    # meta-device initialisation under TP == the CPU build
    meta = _build("tp", (2, 2), meta=True)
    out["meta_holders"] = _meta_report(meta, meta["plan"])
    out["meta_full"] = dmuon.full_state_dict(meta["model"])
    with pytest.raises(
        ValueError, match=r"dedicated parameter 'layers\.0\.[a-z_.]+' became torch.float64, the plan says torch.float32"
    ):
        meta["model"].to(torch.float64)  # as without TP: the plan fixes dtypes (use mp_policy)
    run = _build("tp", (2, 2))
    out["cpu_full"] = dmuon.full_state_dict(run["model"])
    del meta

    # train, inspect, save, then continue vs resume
    out["losses_s2"] = _train(run, batches[:SAVE_AT])
    out["report"] = _layout_report(run)
    out["full_s2"] = dmuon.full_state_dict(run["model"])
    torch_full, _ = _full(run)
    out["torch_full_equal"] = rank != 0 or (
        sorted(torch_full) == sorted(out["full_s2"])
        and all(torch.equal(torch_full[k], out["full_s2"][k]) for k in torch_full)
    )
    out["full_all_ranks"] = sorted(dmuon.full_state_dict(run["model"], rank0_only=False))
    _save(run, f"{root}/tp22_s2")
    cont = _train(run, batches[SAVE_AT : SAVE_AT + 1])
    cont_full, cont_osd = _full(run)
    fresh = _build("tp", (2, 2))
    _load(fresh, f"{root}/tp22_s2")
    res = _train(fresh, batches[SAVE_AT : SAVE_AT + 1])
    res_full, res_osd = _full(fresh)
    out["same_mesh"] = dict(
        losses=(cont, res),
        params=rank != 0 or all(torch.equal(cont_full[k], res_full[k]) for k in cont_full),
        optim=rank != 0 or _same_optim(cont_osd, res_osd),
    )
    del run, fresh

    # reshard: (dp=2, tp=2) -> dp=4 (saved again), HSDP (2, 2), HSDP x TP (2, 1, 2); and back
    runs = [
        ("tp(2,2) -> dp=4", "dp", (4,), "tp22_s2", "dp4_s3"),
        ("tp(2,2) -> hsdp(2,2)", "dp", (2, 2), "tp22_s2", None),
        ("tp(2,2) -> hsdp x tp (2,1,2)", "hsdp_tp", (2, 1, 2), "tp22_s2", None),
        ("tp(2,2) -> tp(1,4)", "tp", (1, 4), "tp22_s2", None),
        ("dp=4 -> tp(2,2)", "tp", (2, 2), "dp4_s3", None),
    ]
    out["reshard"] = _reshard_runs(root, runs, batches)
    return out


def _reshard_runs(root, runs, batches):
    import torch.distributed as dist

    import dmuon

    out = {}
    for label, kind, shape, src, dst in runs:
        done = int(src.rsplit("_s", 1)[1])
        run = _build(kind, shape)
        _load(run, f"{root}/{src}")
        losses = _train(run, batches[done : done + 1])
        if dst is not None:
            _save(run, f"{root}/{dst}")
        out[label] = dict(done=done, losses=losses, full=dmuon.full_state_dict(run["model"]))
        dist.barrier()
    return out


def _same_optim(a, b) -> bool:
    if set(a["state"]) != set(b["state"]):
        return False
    for k, entry in a["state"].items():
        for key, value in entry.items():
            other = b["state"][k][key]
            if not (torch.equal(value, other) if isinstance(value, torch.Tensor) else value == other):
                return False
    return True


def _worker2(root):
    import io

    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict

    import dmuon

    torch.set_num_threads(1)
    rank = dist.get_rank()
    batches = _batches()
    runs = [
        ("tp(2,2) -> tp(1,2)", "tp", (1, 2), "tp22_s2", None),
        ("tp(2,2) -> dp=2", "dp", (2,), "tp22_s2", None),
        ("dp=4 -> tp(1,2)", "tp", (1, 2), "dp4_s3", None),
    ]
    out = {"reshard": _reshard_runs(root, runs, batches)}

    # full state dict on rank 0 (cpu_offload) -> bytes -> broadcast_from_rank0 into a fresh TP model
    run = _build("tp", (1, 2))
    _load(run, f"{root}/tp22_s2")
    msd, osd = _full(run)
    if rank == 0:
        buf = io.BytesIO()
        torch.save({"model": msd, "optim": osd}, buf)
        buf.seek(0)
        loaded = torch.load(buf, weights_only=True)
        msd, osd = loaded["model"], loaded["optim"]
    only_rank0 = bool(msd) if rank == 0 else msd == {}
    fresh = _build("tp", (1, 2))
    put = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(fresh["model"], msd, options=put)
    set_optimizer_state_dict(fresh["model"], fresh["opt"], osd, options=put)
    a = _train(run, batches[SAVE_AT : SAVE_AT + 1])
    b = _train(fresh, batches[SAVE_AT : SAVE_AT + 1])
    fa, fb = dmuon.full_state_dict(run["model"]), dmuon.full_state_dict(fresh["model"])
    out["full round trip"] = dict(
        only_rank0=only_rank0, same_losses=a == b, same_params=all(torch.equal(fa[k], fb[k]) for k in fa)
    )
    return out


# ----------------------------------------------------------------------------------------------
# tests
# ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("dmuon-tp-ckpt"))
    r4 = run_distributed(_worker4, 4, root, timeout_s=300)
    r2 = run_distributed(_worker2, 2, root, timeout_s=200)
    return r4, r2


@pytest.fixture(scope="module")
def reference():
    """Single-process oracle after k steps: (losses, state)."""
    from dmuon.plan import compile as compile_plan
    from dmuon._train.byte_gpt import GPT

    model = GPT(_cfg(), seed=0)
    dedicated = set(compile_plan(model, 1).dedicated)
    batches = _batches()
    return {k: reference_run(model, dedicated, batches[:k], ns_fp32=True, hp=HP)[:2] for k in range(1, TOTAL_STEPS + 1)}


def _assert_close(got, want, where) -> float:
    """Every tensor within PARAM_TOL of its largest magnitude; returns the worst ratio."""
    assert set(got) == set(want), where
    worst = 0.0
    for k, w in want.items():
        err = (got[k] - w).abs().max().item() / (w.abs().max().item() or 1.0)
        assert err <= PARAM_TOL, (where, k, err)
        worst = max(worst, err)
    return worst


def _assert_losses(got, want, where) -> float:
    worst = 0.0
    for g, w in zip(got, want):
        assert math.isclose(g, w, rel_tol=LOSS_RTOL), (where, g, w)
        worst = max(worst, abs(g - w) / abs(w))
    return worst


def test_tp_meta_init_equals_cpu_build(chain):
    r4, _ = chain
    for r in r4:
        assert r["meta_holders"] == [], r["meta_holders"]
    meta, cpu = r4[0]["meta_full"], r4[0]["cpu_full"]
    assert sorted(meta) == sorted(cpu)
    for k in cpu:
        assert torch.equal(meta[k], cpu[k]), k


def test_tp_sharded_state_dicts(chain, reference):
    r4, _ = chain
    reports = [r["report"] for r in r4]
    for rep in reports:
        assert rep["bad"] == [], rep["bad"]
        assert rep["model_keys"] == reports[0]["model_keys"]
        assert rep["optim_keys"] == reports[0]["optim_keys"]
    # colwise matrices: Shard(0) on tp before Shard(0) on shard; rowwise: Shard(1) on tp
    pl = reports[0]["placements"]
    assert pl["layers.0.attn.q_proj.weight"] == "(Shard(dim=0), Shard(dim=0))", pl
    assert pl["layers.0.attn.o_proj.weight"] == "(Shard(dim=1), Shard(dim=0))", pl
    # bytes: each TP coordinate's holder scatters its shard's row chunks over the shard group,
    # every other rank receives one chunk of ceil(rows/N) rows (N = 2, T = 2, fp32)
    from dmuon.plan import TPPolicy
    from dmuon.plan import compile as compile_plan
    from dmuon._train.byte_gpt import GPT

    plan = compile_plan(
        GPT(_cfg(), seed=0),
        2,
        tp=TPPolicy(
            size=2,
            ns="gather",
            shard_dims={
                f"layers.{i}.{n}.weight": (1 if n in ("attn.o_proj", "mlp.down_proj") else 0)
                for i in range(2)
                for n in ("attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.o_proj", "mlp.up_proj", "mlp.down_proj")
            },
        ),
    )
    want = sum(2 * (2 - 1) * -(-p.local_shape[0] // 2) * p.local_shape[1] * 4 for p in plan.params)
    assert sum(r["report"]["model_sd_nbytes"] for r in r4) == want, [r["report"]["model_sd_nbytes"] for r in r4]
    assert all(r["torch_full_equal"] for r in r4)
    assert all(r["full_s2"] == {} for r in r4[1:])
    assert all(r["full_all_ranks"] == sorted(r4[0]["full_s2"]) for r in r4)
    _assert_close(r4[0]["full_s2"], reference[SAVE_AT][1], "tp(2,2) at save")
    _assert_losses(r4[0]["losses_s2"], reference[SAVE_AT][0], "tp(2,2) at save")


def test_tp_resume_same_mesh_is_bit_identical(chain):
    r4, _ = chain
    got = r4[0]["same_mesh"]
    assert got["losses"][0] == got["losses"][1]
    assert got["params"] and got["optim"]


def test_tp_reshard_across_tp_and_dp(chain, reference):
    r4, r2 = chain
    labels = set()
    for r in (r4[0], r2[0]):
        for label, got in r["reshard"].items():
            k = got["done"] + 1
            loss_err = _assert_losses(got["losses"], reference[k][0][got["done"] :], label)
            param_err = _assert_close(got["full"], reference[k][1], label)
            labels.add(label)
            print(f"{label:<34} params {param_err:.1e} losses {loss_err:.1e}")  # docs/checkpointing.md
    assert len(labels) == 8, labels


def test_tp_full_state_dict_broadcast_from_rank0(chain):
    _, r2 = chain
    for r in r2:
        got = r["full round trip"]
        assert got["only_rank0"] and got["same_losses"] and got["same_params"], got
