"""``ns_backend="auto"``: the plan records the backend each matrix runs, the cost
model counts its FLOPs, ``dmuon.Muon`` runs it and refuses a plan that records another one.

* the rule (:func:`dmuon.plan._rules.choose_ns_backend`) against hand-computed FLOP counts;
* ``compile(ns_backend=...)`` on the main job's GPT (meta device): which matrices get Gram NS,
  JSON round trip, default plans' JSON unchanged, busiest-rank FLOPs of both benchmark sizes;
* :func:`auto_newton_schulz` equals the backend it picks, bit for bit;
* ``dmuon.Muon`` validation against a real plan (no process group: a tag whose runtime carries
  the plan);
* 2 processes: ``dedicate_params(ns_backend="auto")`` + ``dmuon.Muon(ns_backend="auto")`` in fp32
  against single-process torch.optim.Muon + AdamW (the fp32 contract's tolerance holds: Gram NS
  in fp32 is within 5e-5 of the standard iteration), with the Gram calls and each rank's NS
  FLOPs equal to the plan's.
"""

from __future__ import annotations

import dataclasses
import json
import types

import pytest
import torch
from torch import nn

import dmuon
from dmuon import _tags
from dmuon.exec._optim import ns_backends as ns
from dmuon.plan._cost import flops as cost
from dmuon.plan import _rules as rules
from dmuon.plan._records.params import ParamSpec
from dmuon._train.byte_gpt import GPT, GPTConfig
from dist_utils import run_distributed

SIZES = {  # benchmarks/step_time.py
    "small": dict(d_model=128, n_layers=4, n_heads=4, d_mlp=512, seq_len=64),
    "large": dict(d_model=256, n_layers=8, n_heads=8, d_mlp=1024, seq_len=128),
}


def _gpt(size: str) -> nn.Module:
    return GPT(GPTConfig(vocab_size=256, **SIZES[size]), seed=0, device="meta")


def test_choose_ns_backend_rule():
    # d >= 256: Gram 10.5 d²D + 22 d³ (symmetric X Xᵀ) vs standard 20 d²D + 10 d³: D > 1.26 d
    assert cost.matrix_ns_flops(256, 1024, "gram") == 10.5 * 256**2 * 1024 + 22 * 256**3
    assert cost.matrix_ns_flops(1024, 256, "standard") == 20 * 256**2 * 1024 + 10 * 256**3
    assert rules.GRAM_AUTO_MIN_SIDE == 256
    assert rules.choose_ns_backend((256, 324), "auto") == "gram"  # 9.5 d²D > 12 d³: D > 1.263·256 = 323.4
    assert rules.choose_ns_backend((323, 256), "auto") == "standard"
    assert rules.choose_ns_backend((1024, 256), "auto") == "gram"  # the large GPT's MLP
    # below GRAM_AUTO_MIN_SIDE: standard whatever the FLOPs (the small GPT's 128 x 512 MLP)
    assert rules.choose_ns_backend((128, 512), "auto") == "standard"
    assert rules.choose_ns_backend((255, 4096), "auto") == "standard"
    assert rules.choose_ns_backend((512, 512), "auto") == "standard"
    # a restart before every step: from d = 256 the symmetric X Xᵀ alone saves; no steps: nothing to save
    assert rules.choose_ns_backend((256, 4096), "auto", restart_every=1) == "gram"
    assert rules.choose_ns_backend((256, 4096), "auto", steps=0) == "standard"
    assert rules.choose_ns_backend((8, 8), "gram") == "gram"
    with pytest.raises(ValueError, match="ns_backend must be one of"):
        rules.choose_ns_backend((8, 8), "fast")


def test_choose_ns_backend_flop_rule_below_the_side_threshold(monkeypatch):
    """The FLOP part of the rule on its own (the threshold lowered, as the tiny-model tests
    below do): d < 256 counts a general Gram product, 12 d²D + 22 d³ vs 20 d²D + 10 d³:
    D > 1.5 d (from 256, D > 1.26 d: test_choose_ns_backend_rule); a tie goes to torch's iteration."""
    monkeypatch.setattr(rules, "GRAM_AUTO_MIN_SIDE", 1)
    assert rules.choose_ns_backend((128, 193), "auto") == "gram"  # 193 > 1.5·128
    assert rules.choose_ns_backend((192, 128), "auto") == "standard"
    assert rules.choose_ns_backend((64, 96), "auto") == "standard"
    assert rules.choose_ns_backend((97, 64), "auto") == "gram"
    # below d = 256 a restart before every step is the standard iteration's FLOPs: a tie
    assert rules.choose_ns_backend((64, 4096), "auto", restart_every=1) == "standard"


@pytest.mark.parametrize("size, expect_ratio", [("small", 1.0), ("large", 0.8266)])
def test_compile_auto_records_backends_and_balances_their_flops(size, expect_ratio):
    model = _gpt(size)
    gram_mlp = min(SIZES[size]["d_model"], SIZES[size]["d_mlp"]) >= rules.GRAM_AUTO_MIN_SIDE
    std = dmuon.plan.compile(model, 4, cost_model="ns_flops")
    auto = dmuon.plan.compile(model, 4, cost_model="ns_flops", ns_backend="auto")
    assert "ns_backend" not in std.to_json()  # default plans keep their JSON and fingerprint
    assert dmuon.plan.ShardingPlan.from_json(auto.to_json()) == auto
    for spec in auto.params:
        mlp = spec.fqn.endswith(("up_proj.weight", "down_proj.weight"))
        assert spec.ns_backend == ("gram" if mlp and gram_mlp else "standard"), spec.fqn
        assert std.param(spec.fqn).ns_backend == "standard"
    # the per-rank NS FLOPs of the schedule are the FLOPs of the recorded backends
    per_rank = [s.ns_flops for s in auto.rank_stats()]
    assert sum(per_rank) == sum(cost.spec_ns_flops(p) for p in auto.params)
    assert max(per_rank) == sum(per_rank) // 4  # balanced exactly (N divides every block's matrices)
    ratio = max(per_rank) / max(s.ns_flops for s in std.rank_stats())
    # large: MLP d x 4d at 0.711 of its standard FLOPs; small (d = 128): all standard
    assert ratio == pytest.approx(expect_ratio, abs=1e-4)
    gram_all = dmuon.plan.compile(model, 4, ns_backend="gram")
    assert {p.ns_backend for p in gram_all.params} == {"gram"}
    with pytest.raises(ValueError, match="ns_backend must be one of"):
        dmuon.plan.compile(model, 4, ns_backend="Gram")


def test_param_spec_ns_backend_validation():
    spec = ParamSpec(
        fqn="w",
        shape=(8, 32),
        dtype="torch.float32",
        numel=256,
        matrix_shape=(8, 32),
        num_matrices=1,
        aliases=("w",),
        module_fqn="",
        attr="w",
    )
    assert spec.ns_backend == "standard" and "ns_backend" not in spec.to_dict()
    g = dataclasses.replace(spec, ns_backend="gram")
    assert ParamSpec.from_dict(json.loads(json.dumps(g.to_dict()))) == g
    with pytest.raises(ValueError, match="ns_backend must be"):
        dataclasses.replace(spec, ns_backend="auto")  # the plan stores resolved backends only
    with pytest.raises(ValueError, match="TP-sharded"):
        dataclasses.replace(spec, tp_size=2, tp_shard_dim=1, tp_ns="gram", ns_backend="gram")


@pytest.mark.parametrize(
    "shape, backend",
    [((2, 256, 512), "gram"), ((512, 256), "gram"), ((4, 128, 512), "standard"), ((3, 64, 64), "standard")],
)
def test_auto_newton_schulz_is_the_backend_it_picks(shape, backend):
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    for dtype in (torch.float32, torch.bfloat16):
        want = ns.get_ns_backend(backend)(x, dtype=dtype)
        assert torch.equal(ns.auto_newton_schulz(x, dtype=dtype), want)
    assert ns.get_ns_backend("auto") is ns.auto_newton_schulz


def _tagged(model: nn.Module, plan) -> list[torch.Tensor]:
    """Tag the plan's matrices as a live runtime would (owner everywhere), with a runtime that
    carries ``plan`` (and no model: ``model_ref()`` is None, as for a runtime whose model is gone)."""
    rt = types.SimpleNamespace(plan=plan, model_ref=lambda: None)
    params = dict(model.named_parameters())
    for spec in plan.params:
        _tags.write(
            params[spec.fqn],
            _tags.PARAM,
            types.SimpleNamespace(
                fqn=spec.fqn,
                owner_global_rank=0,
                is_owner=True,
                holds_full=True,
                shape=spec.shape,
                matrix_shape=spec.matrix_shape,
                num_matrices=spec.num_matrices,
                runtime=lambda: rt,
                tp=None,
            ),
        )
    return list(model.parameters())


def test_muon_checks_the_plans_backend(monkeypatch):
    monkeypatch.setattr(rules, "GRAM_AUTO_MIN_SIDE", 1)  # the tiny MLP's (64, 16) runs Gram NS
    model = GPT(GPTConfig(vocab_size=32, d_model=16, n_layers=1, n_heads=2, d_mlp=64, seq_len=8), seed=0)
    auto = dmuon.plan.compile(model, 1, ns_backend="auto")
    std = dmuon.plan.compile(model, 1)
    dmuon.Muon(_tagged(model, auto), ns_backend="auto")  # agrees
    with pytest.raises(ValueError, match=r"ns_backend='standard'.*records 'gram'.*compile the plan"):
        dmuon.Muon(_tagged(model, auto), ns_backend="standard")
    with pytest.raises(ValueError, match=r"ns_backend='auto'.*records 'standard'"):
        dmuon.Muon(_tagged(model, std), ns_backend="auto")
    with pytest.raises(ValueError, match=r"ns_steps=1"):  # auto with 1 step picks differently
        dmuon.Muon(_tagged(model, auto), ns_backend="auto", ns_steps=1)
    dmuon.Muon(_tagged(model, std), ns_backend="gram")  # a default plan accepts Gram everywhere


def _muon_step_calls(model: nn.Module, backend: str) -> tuple[list, dict]:
    """One ``muon_step`` of ``dmuon.Muon(ns_backend=backend)`` on ``model`` planned with the same
    backend (tags without a process group, fixed gradients): the backend functions it called, in
    order, with their input shapes, and the parameters after the step."""
    from dmuon.exec._optim.muon_step import muon_step

    plan = dmuon.plan.compile(model, 1, ns_backend=backend)
    params = _tagged(model, plan)
    for i, p in enumerate(model.parameters()):
        p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(i))
    opt = dmuon.Muon(params, ns_backend=backend, ns_dtype=torch.float32)
    calls = []
    names = ("newton_schulz", "gram_newton_schulz", "auto_newton_schulz")
    real = {n: getattr(ns, n) for n in names}

    def spy(name):
        return lambda x, **kw: calls.append((name, tuple(x.shape))) or real[name](x, **kw)

    try:
        for n in names:
            setattr(ns, n, spy(n))
        with torch.no_grad():
            muon_step(opt.param_groups[0], opt.state)
    finally:
        for n, f in real.items():
            setattr(ns, n, f)
    return calls, {k: v.detach().clone() for k, v in model.named_parameters()}


@pytest.mark.parametrize("min_side", [256, 1])
def test_auto_runs_the_picked_backends_calls(monkeypatch, min_side):
    """``dmuon.Muon(ns_backend="auto")`` decides once per NS bucket and calls the picked backend
    itself (``resolve_ns_backend``): on the step_time benchmark's small GPT (every matrix below
    ``GRAM_AUTO_MIN_SIDE``) exactly the calls of ``"standard"``, same inputs, same parameters bit
    for bit, and never the per-call ``auto_newton_schulz``; with the threshold lowered, Gram NS
    on the MLP bucket and the standard iteration on the square one."""
    monkeypatch.setattr(rules, "GRAM_AUTO_MIN_SIDE", min_side)
    cfg = GPTConfig(vocab_size=32, d_model=128, n_layers=1, n_heads=2, d_mlp=512, seq_len=8)
    std_calls, std_params = _muon_step_calls(GPT(cfg, seed=0), "standard")
    auto_calls, auto_params = _muon_step_calls(GPT(cfg, seed=0), "auto")
    assert std_calls == [("newton_schulz", (4, 128, 128)), ("newton_schulz", (2, 128, 512))]
    if min_side == 256:
        assert auto_calls == std_calls
        assert all(torch.equal(auto_params[k], std_params[k]) for k in std_params)
    else:
        assert auto_calls == [("newton_schulz", (4, 128, 128)), ("gram_newton_schulz", (2, 128, 512))]
    assert ns.resolve_ns_backend("auto", (128, 512), steps=5) is ns.get_ns_backend(
        "standard" if min_side == 256 else "gram"
    )
    assert ns.resolve_ns_backend("gram", (8, 8), steps=5) is ns.gram_newton_schulz
    with pytest.raises(ValueError, match="unknown Newton-Schulz backend"):
        ns.resolve_ns_backend("fast", (8, 8), steps=5)


def _tiny_gpt() -> nn.Module:
    """The main job's GPT, tiny: square attention projections (standard) and (64, 16) MLP (Gram
    once the workers lower ``GRAM_AUTO_MIN_SIDE``)."""
    return GPT(GPTConfig(vocab_size=11, d_model=16, n_layers=2, n_heads=2, d_mlp=64, seq_len=8), seed=0)


def _auto_worker(steps):
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from dmuon.exec._optim import ns_backends as ns_mod
    from ns_spy import counting_ns
    from oracle import dmuon_muon_kwargs, global_batches, lm_loss

    torch.set_num_threads(1)
    rules.GRAM_AUTO_MIN_SIDE = 1  # this worker process only: the FLOP rule picks Gram for the MLP
    rank, world = dist.get_rank(), dist.get_world_size()
    model = _tiny_gpt()
    plan = dmuon.dedicate_params(model, None, cost_model="ns_flops", ns_backend="auto")
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    errors = []
    try:
        dmuon.Muon(model, ns_backend="standard")
    except ValueError as exc:
        errors.append(str(exc))
    opt = dmuon.Muon(model, **dmuon_muon_kwargs(), ns_backend="auto")
    flops = []
    real = {name: getattr(ns_mod, name) for name in ("newton_schulz", "gram_newton_schulz")}
    losses = []
    for batch in global_batches(steps):
        with counting_ns() as counter:
            loss = lm_loss(model, batch.chunk(world)[rank])
            loss.backward()
            opt.step()
            opt.zero_grad()
        backends = sorted(set(counter.calls))
        flops.append((counter.matrices, backends))
        t = loss.detach().clone()
        dist.all_reduce(t)
        losses.append(t.item() / world)
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    assert all(getattr(ns_mod, n) is f for n, f in real.items())
    return dict(
        errors=errors,
        losses=losses,
        calls=flops,
        plan_json=plan.to_json(),
        full={k: v.detach().clone() for k, v in full.items()} if rank == 0 else None,
    )


def test_auto_backend_trains_within_the_fp32_contract():
    from oracle import global_batches, reference_run

    steps = 3
    results = run_distributed(_auto_worker, 2, steps, timeout_s=180)
    plan = dmuon.plan.ShardingPlan.from_json(results[0]["plan_json"])
    gram = {p.fqn for p in plan.params if p.ns_backend == "gram"}
    assert gram == {f for f in plan.dedicated if f.endswith(("up_proj.weight", "down_proj.weight"))}
    for r in results:
        assert len(r["errors"]) == 1 and "records 'gram'" in r["errors"][0]  # same error on every rank
    # every rank ran Gram NS exactly when it owns a Gram matrix, one call per NS bucket
    owned = [{p.fqn for p, o in zip(plan.params, plan.owners) if o.rank == r} for r in range(2)]
    for r, res in enumerate(results):
        for matrices, backends in res["calls"]:
            assert matrices == len(owned[r])
            assert ("gram_newton_schulz" in backends) == bool(owned[r] & gram)
    ref = reference_run(_tiny_gpt(), set(plan.dedicated), global_batches(steps), ns_fp32=True, world=2)
    ref_losses, ref_params, _ = ref
    for a, b in zip(results[0]["losses"], ref_losses):
        assert a == pytest.approx(b, rel=1e-6)
    for name, want in ref_params.items():
        got = results[0]["full"][name]
        tol = 1e-4 * want.abs().max().item()
        torch.testing.assert_close(got, want, rtol=0, atol=tol, msg=name)
