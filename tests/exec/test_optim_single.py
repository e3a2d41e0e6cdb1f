"""dmuon.Muon in one process against torch.optim.Muon + torch.optim.AdamW (the oracle).

Dedicated parameters are tagged by hand with a fake info (``_tags.write(p, _tags.PARAM, info)``, no
process group, no plan), so these tests pin the optimizer's math alone:

- default bf16 Newton-Schulz, 2-D / conv-view matrices: parameters and state BIT-IDENTICAL to
  the oracle after every step;
- expert stacks (E, m, n): bf16 bit-identical to torch.optim.Muon run on each slice; fp32
  (batched NS) within 1e-5 of each tensor's largest magnitude of the oracle patched to iterate
  in fp32 (the README's oracle guarantee: 1e-4; only bmm-vs-mm reduction order differs).
"""

from __future__ import annotations

import dataclasses
import io
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dmuon
from dmuon import _tags
import dmuon.exec._optim.ns_backends as ns_mod
import dmuon._update as ns_coef
import dmuon.exec._optim.muon as optim_mod
from dmuon._update import adjust_lr
from dmuon.exec._optim.muon import Muon
from ns_spy import spy_ns
from oracle import hand_fp32_newton_schulz

MUON_KW = dict(lr=0.02, weight_decay=0.1, momentum=0.9, nesterov=True, adjust_lr_fn=None)
ADAMW_KW = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.05)
STEPS = 5


@pytest.fixture(autouse=True, scope="module")
def _single_thread():
    """Tiny matrices gain nothing from intra-op threads, and on a loaded CI box OpenMP
    barriers turn each small matmul into a scheduler quantum; both sides run alike anyway."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@dataclasses.dataclass(frozen=True)
class FakeInfo:
    """Duck-typed stand-in for dmuon.exec._runtime.packed_buffers.DedicatedInfo."""

    fqn: str
    owner_global_rank: int
    is_owner: bool
    shape: tuple[int, ...]
    matrix_shape: tuple[int, int]
    num_matrices: int
    holds_full: bool = True
    runtime: Callable[[], Any] = lambda: None  # the real tag holds a weakref to the runtime


def tag(p: torch.Tensor, fqn: str, *, is_owner=True, shape=None, matrix_shape=None, num_matrices=1):
    shape = tuple(p.shape) if shape is None else tuple(shape)
    if matrix_shape is None:
        matrix_shape = (shape[0], math.prod(shape[1:])) if num_matrices == 1 else shape[-2:]
    _tags.write(
        p, _tags.PARAM, FakeInfo(fqn, 0, is_owner, shape, tuple(matrix_shape), num_matrices, holds_full=is_owner)
    )
    return p


@pytest.fixture(autouse=True)
def _no_runtime_hooks(monkeypatch):
    """Keep the real runtime's hooks out of these single-process optimizer tests."""
    monkeypatch.setattr(optim_mod, "wait_pending", lambda params: None)
    monkeypatch.setattr(optim_mod, "after_step", lambda params: None)


# ---------------------------------------------------------------------------------------------
# models
# ---------------------------------------------------------------------------------------------

VOCAB, CLASSES = 11, 5


class Net(nn.Module):
    """Linear weights (16, 8) tall, (36, 16) tall, (8, 36) wide, (5, 8) wide; biases;
    LayerNorm; Embedding."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 8)
        self.fc1 = nn.Linear(8, 16)
        self.norm = nn.LayerNorm(16)
        self.fc2 = nn.Linear(16, 36)
        self.fc3 = nn.Linear(36, 8, bias=False)
        self.head = nn.Linear(8, CLASSES)

    def forward(self, tokens):
        h = self.emb(tokens)
        h = h + self.fc3(F.gelu(self.fc2(self.norm(self.fc1(h)))))
        return self.head(h).mean(dim=1)


DEDICATED = ("fc1.weight", "fc2.weight", "fc3.weight", "head.weight")


def make_pair(seed=0):
    torch.manual_seed(seed)
    ours, ref = Net(), Net()
    ref.load_state_dict(ours.state_dict())
    for name, p in ours.named_parameters():
        if name in DEDICATED:
            tag(p, name)
    return ours, ref


def batch(step, seed=100):
    g = torch.Generator().manual_seed(seed + step)
    return torch.randint(0, VOCAB, (4, 6), generator=g), torch.randint(0, CLASSES, (4,), generator=g)


def loss_backward(model, step):
    x, y = batch(step)
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    return loss


def ref_optimizers(ref: nn.Module, muon_kw, adamw_kw, dedicated=DEDICATED):
    named = dict(ref.named_parameters())
    muon = torch.optim.Muon([named[n] for n in dedicated], **muon_kw)
    adamw = torch.optim.AdamW([p for n, p in named.items() if n not in dedicated], **adamw_kw)
    return muon, adamw


def ours_optimizer(model, muon_kw, adamw_kw, **extra):
    return Muon(
        model,
        **muon_kw,
        adamw_lr=adamw_kw["lr"],
        adamw_betas=adamw_kw["betas"],
        adamw_eps=adamw_kw["eps"],
        adamw_weight_decay=adamw_kw["weight_decay"],
        **extra,
    )


def assert_params_equal(ours, ref):
    for (n1, p1), (n2, p2) in zip(ours.named_parameters(), ref.named_parameters()):
        assert n1 == n2
        assert torch.equal(p1, p2), f"{n1}: max diff {(p1 - p2).abs().max().item()}"


def assert_state_equal(opt, ours, ref_opts, ref):
    ref_state = {}
    for o in ref_opts:
        ref_state.update(o.state)
    for (name, p1), (_, p2) in zip(ours.named_parameters(), ref.named_parameters()):
        s1, s2 = opt.state.get(p1, {}), ref_state.get(p2, {})
        if name in DEDICATED and not s2:  # never had a gradient: our eager buffer is still zero
            assert set(s1) == {"momentum_buffer"} and not s1["momentum_buffer"].any(), name
            continue
        if not s2:  # an AdamW parameter that never had a gradient: our eager state is zeros, step 0
            assert set(s1) == {"step", "exp_avg", "exp_avg_sq"} and s1["step"].item() == 0, name
            assert not s1["exp_avg"].any() and not s1["exp_avg_sq"].any(), name
            continue
        assert set(s1) == set(s2), (name, set(s1), set(s2))
        for key in s1:
            assert s1[key].dtype == s2[key].dtype and s1[key].device == s2[key].device, (name, key)
            assert torch.equal(s1[key], s2[key]), (name, key)


def run_both(muon_kw=MUON_KW, adamw_kw=ADAMW_KW, steps=STEPS, drop_grads=None, schedules=None):
    """Train ours vs the oracle for `steps` steps, checking bit-identity after each step.

    drop_grads: {step: [param names whose grad is set to None before that step]}.
    schedules: (muon_lambda, adamw_lambda) for LambdaLR on both sides.
    """
    ours, ref = make_pair()
    opt = ours_optimizer(ours, muon_kw, adamw_kw)
    ref_opts = ref_optimizers(ref, muon_kw, adamw_kw)
    scheds = []
    if schedules is not None:
        scheds = [torch.optim.lr_scheduler.LambdaLR(opt, list(schedules))]
        scheds += [torch.optim.lr_scheduler.LambdaLR(o, f) for o, f in zip(ref_opts, schedules)]
    for step in range(steps):
        l1, l2 = loss_backward(ours, step), loss_backward(ref, step)
        assert torch.equal(l1, l2)
        dropped = (drop_grads or {}).get(step, ())
        before = {}
        for model in (ours, ref):
            for name, p in model.named_parameters():
                if name in dropped:
                    p.grad = None
                    before[(id(model), name)] = p.detach().clone()
        opt.step()
        for o in ref_opts:
            o.step()
        for s in scheds:
            s.step()
        for model in (ours, ref):
            for name, p in model.named_parameters():
                if name in dropped:  # skipped exactly like torch: no decay, no update
                    assert torch.equal(p, before[(id(model), name)]), name
        assert_params_equal(ours, ref)
        assert_state_equal(opt, ours, ref_opts, ref)
        opt.zero_grad()
        for o in ref_opts:
            o.zero_grad()
    return opt, ours, ref


# ---------------------------------------------------------------------------------------------
# oracle equality
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "muon_kw",
    [
        MUON_KW,
        {**MUON_KW, "nesterov": False},
        {**MUON_KW, "weight_decay": 0.0},
        {**MUON_KW, "adjust_lr_fn": "match_rms_adamw", "lr": 3e-3},
        {**MUON_KW, "adjust_lr_fn": "original", "momentum": 0.95, "ns_steps": 3, "eps": 1e-5},
    ],
    ids=["default", "no-nesterov", "no-decay", "match_rms_adamw", "original-3steps"],
)
def test_bit_identical_to_torch_muon_and_adamw(muon_kw):
    run_both(muon_kw=muon_kw)


def test_torch_defaults_bit_identical():
    # Both sides with their own defaults (the dmuon defaults mirror torch's).
    ours, ref = make_pair()
    opt = Muon(ours)
    ref_opts = ref_optimizers(ref, {}, {})
    for step in range(3):
        loss_backward(ours, step), loss_backward(ref, step)
        opt.step()
        for o in ref_opts:
            o.step()
        opt.zero_grad()
        for o in ref_opts:
            o.zero_grad()
    assert_params_equal(ours, ref)
    assert_state_equal(opt, ours, ref_opts, ref)


def test_param_without_grad_is_skipped_like_torch():
    # fc3.weight (Muon) and norm.bias (AdamW) lose their grad in step 2; head.weight and
    # emb.weight have none in step 0, so torch creates their state only at step 1.
    run_both(
        drop_grads={
            0: ["head.weight", "emb.weight"],
            2: ["fc3.weight", "norm.bias"],
            3: ["fc3.weight"],
        }
    )


def test_lambda_lr_per_group():
    opt, _, _ = run_both(schedules=(lambda s: 0.5**s, lambda s: 1.0 + s))
    muon_group, adamw_group = opt.param_groups
    assert muon_group["lr"] == pytest.approx(MUON_KW["lr"] * 0.5**STEPS)
    assert adamw_group["lr"] == pytest.approx(ADAMW_KW["lr"] * (1.0 + STEPS))
    assert muon_group["initial_lr"] == MUON_KW["lr"] and adamw_group["initial_lr"] == ADAMW_KW["lr"]


def test_lambda_lr_changes_only_its_group():
    ours, _ = make_pair()
    opt = ours_optimizer(ours, MUON_KW, ADAMW_KW)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, [lambda s: 0.1, lambda s: 1.0])
    assert opt.param_groups[0]["lr"] == pytest.approx(MUON_KW["lr"] * 0.1)
    assert opt.param_groups[1]["lr"] == ADAMW_KW["lr"]
    sched.step()
    assert opt.param_groups[1]["lr"] == ADAMW_KW["lr"]


# ---------------------------------------------------------------------------------------------
# views: conv weights and expert stacks
# ---------------------------------------------------------------------------------------------


class ConvNet(nn.Module):
    def __init__(self, as_matrix: bool):
        super().__init__()
        self.as_matrix = as_matrix
        shape = (8, 27) if as_matrix else (8, 3, 3, 3)
        self.w = nn.Parameter(torch.randn(shape) * 0.2)
        self.b = nn.Parameter(torch.zeros(8))

    def forward(self, x):
        return F.conv2d(x, self.w.view(8, 3, 3, 3), self.b).square().mean()


def test_conv_weight_uses_its_matrix_view():
    torch.manual_seed(1)
    ours, ref = ConvNet(as_matrix=False), ConvNet(as_matrix=True)
    with torch.no_grad():
        ref.w.copy_(ours.w.view(8, 27))
    tag(ours.w, "w", matrix_shape=(8, 27))
    opt = ours_optimizer(ours, MUON_KW, ADAMW_KW)
    ref_opts = ref_optimizers(ref, MUON_KW, ADAMW_KW, dedicated=("w",))
    g = torch.Generator().manual_seed(2)
    for _ in range(STEPS):
        x = torch.randn(2, 3, 6, 6, generator=g)
        ours(x).backward(), ref(x).backward()
        opt.step()
        for o in ref_opts:
            o.step()
        opt.zero_grad()
        for o in ref_opts:
            o.zero_grad()
        assert torch.equal(ours.w.view(8, 27), ref.w) and torch.equal(ours.b, ref.b)
        assert torch.equal(
            opt.state[ours.w]["momentum_buffer"].view(8, 27), ref_opts[0].state[ref.w]["momentum_buffer"]
        )


E = 3


class Experts(nn.Module):
    """Expert stacks (E, 12, 20) wide and (E, 20, 12) tall, plus two plain (12, 20) matrices
    that share a batching bucket with the first stack."""

    def __init__(self, stacked: bool):
        super().__init__()
        self.stacked = stacked
        up = torch.randn(E, 12, 20) * 0.2
        down = torch.randn(E, 20, 12) * 0.2
        if stacked:
            self.up, self.down = nn.Parameter(up), nn.Parameter(down)
        else:
            self.up = nn.ParameterList([nn.Parameter(t.clone()) for t in up])
            self.down = nn.ParameterList([nn.Parameter(t.clone()) for t in down])
        self.a = nn.Parameter(torch.randn(12, 20) * 0.2)
        self.c = nn.Parameter(torch.randn(12, 20) * 0.2)
        self.bias = nn.Parameter(torch.zeros(12))

    def forward(self, x):  # x: (E, T, 12)
        up = self.up if self.stacked else torch.stack(list(self.up))
        down = self.down if self.stacked else torch.stack(list(self.down))
        h = torch.tanh(torch.bmm(x, up))  # (E, T, 20)
        y = torch.bmm(h, down) + self.bias  # (E, T, 12)
        return (y @ self.a @ self.c.T).square().mean()


@pytest.mark.parametrize("ns_dtype", [torch.bfloat16, torch.float32])
def test_expert_stack_equals_torch_muon_per_slice(ns_dtype, monkeypatch):
    if ns_dtype == torch.float32:
        monkeypatch.setattr(torch.optim._muon, "_zeropower_via_newtonschulz", hand_fp32_newton_schulz)
    torch.manual_seed(3)
    ours = Experts(stacked=True)
    torch.manual_seed(3)
    ref = Experts(stacked=False)
    tag(ours.up, "up", num_matrices=E, matrix_shape=(12, 20))
    tag(ours.down, "down", num_matrices=E, matrix_shape=(20, 12))
    tag(ours.a, "a")
    tag(ours.c, "c")
    opt = ours_optimizer(ours, MUON_KW, ADAMW_KW, ns_dtype=ns_dtype)
    ref_muon = torch.optim.Muon([*ref.up, *ref.down, ref.a, ref.c], **MUON_KW)
    ref_adamw = torch.optim.AdamW([ref.bias], **ADAMW_KW)
    g = torch.Generator().manual_seed(4)
    calls = spy_ns(monkeypatch)
    for step in range(STEPS):
        x = torch.randn(E, 5, 12, generator=g)
        ours(x).backward(), ref(x).backward()
        opt.step(), ref_muon.step(), ref_adamw.step()
        opt.zero_grad(), ref_muon.zero_grad(), ref_adamw.zero_grad()
        pairs = [
            (ours.up, torch.stack(list(ref.up))),
            (ours.down, torch.stack(list(ref.down))),
            (ours.a, ref.a),
            (ours.c, ref.c),
            (ours.bias, ref.bias),
        ]
        for mine, theirs in pairs:
            if ns_dtype == torch.bfloat16:
                assert torch.equal(mine, theirs)
            else:
                tol = 1e-5 * theirs.abs().max().item()
                torch.testing.assert_close(mine, theirs, rtol=0, atol=tol)
    assert calls.matrices == STEPS * (2 * E + 2)  # one NS per matrix per step
    buf = opt.state[ours.up]["momentum_buffer"]
    assert buf.shape == (E, 12, 20)
    ref_buf = torch.stack([ref_muon.state[p]["momentum_buffer"] for p in ref.up])
    torch.testing.assert_close(buf, ref_buf, rtol=0, atol=1e-6 * ref_buf.abs().max().item())


def test_ns_batches_same_shape_matrices(monkeypatch):
    """``ns_batching="batched"`` (default): one call per bucket in fp32 and bf16 alike;
    ``"exact"``: one 2-D call per matrix, as ``torch.optim.Muon``."""
    calls = []
    real = ns_mod.newton_schulz

    def spy(x, **kw):
        calls.append((tuple(x.shape), kw["dtype"]))
        return real(x, **kw)

    monkeypatch.setattr(ns_mod, "newton_schulz", spy)
    torch.manual_seed(5)
    model = Experts(stacked=True)
    tag(model.up, "up", num_matrices=E, matrix_shape=(12, 20))
    tag(model.down, "down", num_matrices=E, matrix_shape=(20, 12))
    tag(model.a, "a")
    tag(model.c, "c")
    model(torch.randn(E, 5, 12)).backward()
    Muon(model, ns_dtype=torch.float32).step()
    # one bucket (12, 20): up's 3 matrices, down's 3 (transposed), a and c -> a single call.
    assert calls == [((2 * E + 2, 12, 20), torch.float32)]
    calls.clear()
    model(torch.randn(E, 5, 12)).backward()
    Muon(model).step()  # bf16: batched the same way
    assert calls == [((2 * E + 2, 12, 20), torch.bfloat16)]
    for ns_dtype in (torch.bfloat16, torch.float32):
        calls.clear()
        model(torch.randn(E, 5, 12)).backward()
        Muon(model, ns_dtype=ns_dtype, ns_batching="exact").step()  # per matrix, 2-D only
        assert len(calls) == 2 * E + 2 and all(len(s) == 2 and d == ns_dtype for s, d in calls)


# ---------------------------------------------------------------------------------------------
# placeholders, groups, state
# ---------------------------------------------------------------------------------------------


def test_non_owner_placeholders_untouched(monkeypatch):
    torch.manual_seed(6)
    lin = nn.Linear(4, 4)
    placeholder = tag(nn.Parameter(torch.empty(0)), "remote.weight", is_owner=False, shape=(32, 16))
    opt = Muon([lin.weight, lin.bias, placeholder])
    assert placeholder not in opt.state
    assert opt.param_groups[0]["params"] == [placeholder]
    lin(torch.randn(2, 4)).sum().backward()
    placeholder.grad = torch.empty(0)  # even a (bogus) grad does not make it step
    calls = spy_ns(monkeypatch)
    opt.step()
    assert calls.matrices == 0
    assert placeholder.numel() == 0 and placeholder not in opt.state
    assert set(opt.state[lin.weight]) == {"step", "exp_avg", "exp_avg_sq"}


def test_param_groups_layout_and_flags():
    ours, _ = make_pair()
    opt = ours_optimizer(ours, MUON_KW, ADAMW_KW, ns_dtype=torch.float32)
    assert len(opt.param_groups) == 2
    muon, adamw = opt.param_groups
    named = dict(ours.named_parameters())
    assert muon["use_muon"] is True and adamw["use_muon"] is False
    assert muon["params"] == [named[n] for n in DEDICATED]
    assert adamw["params"] == [p for n, p in named.items() if n not in DEDICATED]
    assert set(muon) == {
        "params",
        "lr",
        "momentum",
        "nesterov",
        "weight_decay",
        "ns_coefficients",
        "ns_steps",
        "eps",
        "adjust_lr_fn",
        "ns_dtype",
        "ns_backend",
        "ns_batching",
        "use_muon",
        "variant",
        "normuon_beta2",
        "normuon_eps",
    }
    assert muon["ns_backend"] == "standard"  # A new group field, standard by default
    assert muon["ns_batching"] == "batched"  # a group field, batched by default
    assert (muon["variant"], muon["normuon_beta2"], muon["normuon_eps"]) == ("muon", 0.95, 1e-10)
    assert muon["ns_steps"] == 5  # ns_steps=None resolves to an int
    assert set(adamw) == {"params", "lr", "betas", "eps", "weight_decay", "use_muon"}
    assert muon["lr"] == MUON_KW["lr"] and adamw["lr"] == ADAMW_KW["lr"]
    assert muon["ns_dtype"] is torch.float32 and muon["ns_coefficients"] == (3.4445, -4.775, 2.0315)
    assert adamw["betas"] == ADAMW_KW["betas"] and adamw["weight_decay"] == ADAMW_KW["weight_decay"]
    # eager state from construction: momentum for every owned matrix, then zero AdamW moments
    assert [id(p) for p in opt.state] == [id(named[n]) for n in DEDICATED] + [
        id(p) for n, p in named.items() if n not in DEDICATED
    ]
    for n in DEDICATED:
        buf = opt.state[named[n]]["momentum_buffer"]
        assert buf.shape == named[n].shape and not buf.any()


def test_groups_exist_even_when_empty():
    """Nothing dedicated: both groups exist (the Muon group empty, for add_param_group), and it
    is not silent: every rank warns that Muon runs on nothing."""
    with pytest.warns(UserWarning, match=r"none of its 2 parameters is dedicated.*dedicate_params"):
        opt = Muon(nn.Linear(3, 3))
    assert [g["use_muon"] for g in opt.param_groups] == [True, False]
    assert opt.param_groups[0]["params"] == []


def test_add_param_group_infers_kind_and_fills_defaults():
    ours, _ = make_pair()
    opt = ours_optimizer(ours, MUON_KW, ADAMW_KW)
    extra = tag(nn.Parameter(torch.randn(6, 4)), "extra")
    opt.add_param_group({"params": [extra], "lr": 0.5})
    opt.add_param_group({"params": nn.Parameter(torch.zeros(3))})
    g_muon, g_adamw = opt.param_groups[2:]
    assert g_muon["use_muon"] and g_muon["lr"] == 0.5 and g_muon["momentum"] == MUON_KW["momentum"]
    assert not g_adamw["use_muon"] and g_adamw["lr"] == ADAMW_KW["lr"]
    assert "momentum_buffer" in opt.state[extra]
    with pytest.raises(ValueError, match="mixes"):
        opt.add_param_group({"params": [tag(nn.Parameter(torch.ones(2, 2)), "x"), nn.Parameter(torch.ones(2))]})
    with pytest.raises(ValueError, match="Muon group"):
        opt.add_param_group({"params": [nn.Parameter(torch.ones(2, 2))], "use_muon": True})


def _train(opt, model, steps, start=0):
    for step in range(start, start + steps):
        loss_backward(model, step)
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("ns_dtype", [torch.bfloat16, torch.float32])
def test_state_dict_round_trip(ns_dtype):
    full, _ = make_pair()
    opt_full = ours_optimizer(full, MUON_KW, ADAMW_KW, ns_dtype=ns_dtype)
    _train(opt_full, full, 5)

    first, _ = make_pair()
    opt_first = ours_optimizer(first, MUON_KW, ADAMW_KW, ns_dtype=ns_dtype)
    _train(opt_first, first, 3)
    buffer = io.BytesIO()
    torch.save({"model": first.state_dict(), "optim": opt_first.state_dict()}, buffer)
    buffer.seek(0)
    ckpt = torch.load(buffer, weights_only=True)

    resumed, _ = make_pair(seed=123)  # different init, overwritten by the checkpoint
    resumed.load_state_dict(ckpt["model"])
    opt_resumed = ours_optimizer(resumed, {**MUON_KW, "lr": 9.0}, ADAMW_KW)  # hparams come from ckpt
    opt_resumed.load_state_dict(ckpt["optim"])
    assert opt_resumed.param_groups[0]["lr"] == MUON_KW["lr"]
    assert opt_resumed.param_groups[0]["ns_dtype"] is ns_dtype
    _train(opt_resumed, resumed, 2, start=3)

    assert_params_equal(resumed, full)
    sd_a, sd_b = opt_resumed.state_dict(), opt_full.state_dict()
    assert sd_a["param_groups"] == sd_b["param_groups"]
    assert sd_a["state"].keys() == sd_b["state"].keys()
    for k in sd_a["state"]:
        for key, value in sd_a["state"][k].items():
            assert torch.equal(value, sd_b["state"][k][key]), (k, key)


def test_load_state_dict_accepts_serialised_forms():
    ours, _ = make_pair()
    opt = ours_optimizer(ours, MUON_KW, ADAMW_KW)
    _train(opt, ours, 1)
    sd = opt.state_dict()
    groups = [dict(g) for g in sd["param_groups"]]
    groups[0]["ns_dtype"] = "torch.float32"
    groups[0]["ns_coefficients"] = list(groups[0]["ns_coefficients"])
    groups[1]["betas"] = list(groups[1]["betas"])
    other, _ = make_pair()
    opt2 = ours_optimizer(other, MUON_KW, ADAMW_KW)
    opt2.load_state_dict({"state": sd["state"], "param_groups": groups})
    assert opt2.param_groups[0]["ns_dtype"] is torch.float32
    assert opt2.param_groups[0]["ns_coefficients"] == (3.4445, -4.775, 2.0315)
    assert opt2.param_groups[1]["betas"] == (0.9, 0.95)
    _train(opt2, other, 1)


def test_load_state_dict_keeps_eager_momentum_for_unsaved_matrices():
    ours, _ = make_pair()
    opt = ours_optimizer(ours, MUON_KW, ADAMW_KW)
    sd = opt.state_dict()
    sd["state"] = {}
    opt.load_state_dict(sd)
    for n in DEDICATED:
        assert not opt.state[dict(ours.named_parameters())[n]]["momentum_buffer"].any()


def test_init_state_is_numerically_a_no_op():
    a, _ = make_pair()
    b, _ = make_pair()
    opt_a = ours_optimizer(a, MUON_KW, ADAMW_KW)
    opt_b = ours_optimizer(b, MUON_KW, ADAMW_KW)
    opt_b.init_state()
    assert all(len(opt_b.state[p]) > 0 for p in b.parameters())
    step = opt_b.state[b.emb.weight]["step"]
    assert step.dtype == torch.float32 and step.device.type == "cpu" and step.item() == 0.0
    _train(opt_a, a, 3)
    _train(opt_b, b, 3)
    assert_params_equal(a, b)


def test_zero_grad_sets_none():
    ours, _ = make_pair()
    opt = Muon(ours)
    loss_backward(ours, 0)
    opt.zero_grad()
    assert all(p.grad is None for p in ours.parameters())


# ---------------------------------------------------------------------------------------------
# hooks, counter, closure
# ---------------------------------------------------------------------------------------------


def test_runtime_hooks_wrap_the_step(monkeypatch):
    ours, _ = make_pair()
    opt = Muon(ours)
    events = []
    w = ours.fc1.weight

    def wait_pending(params):
        events.append(("wait", [id(p) for p in params], w.detach().clone()))

    def after_step(params):
        events.append(("after", [id(p) for p in params], w.detach().clone()))

    monkeypatch.setattr(optim_mod, "wait_pending", wait_pending)
    monkeypatch.setattr(optim_mod, "after_step", after_step)
    before = w.detach().clone()
    loss = opt.step(closure=lambda: loss_backward(ours, 0))
    assert loss is not None
    ids = [id(p) for p in opt.param_groups[0]["params"]]
    assert [e[0] for e in events] == ["wait", "after"]
    assert events[0][1] == ids and events[1][1] == ids
    assert torch.equal(events[0][2], before) and not torch.equal(events[1][2], before)


def test_runtime_hooks_without_live_runtime_are_noops(monkeypatch):
    # the real hooks, on parameters whose runtime is gone (the tag's weakref answers None): they
    # find no runtime, do nothing, and the steps stay bit-identical to torch's Muon + AdamW
    import dmuon.exec._runtime.runtime as runtime_mod

    ours, ref = make_pair()
    assert all(runtime_mod.get_runtime(p) is None for p in ours.parameters())
    opt = Muon(ours)
    ref_opts = ref_optimizers(ref, {}, {})
    calls = []

    def traced(name, fn):
        def hook(params):
            calls.append(name)
            return fn(params)

        return hook

    monkeypatch.setattr(optim_mod, "wait_pending", traced("wait", runtime_mod.wait_pending))
    monkeypatch.setattr(optim_mod, "after_step", traced("after", runtime_mod.after_step))
    for step in range(2):
        loss_backward(ours, step), loss_backward(ref, step)
        opt.step()
        for o in ref_opts:
            o.step()
        opt.zero_grad()
        for o in ref_opts:
            o.zero_grad()
    assert calls == ["wait", "after"] * 2  # the real hooks ran, around every step
    assert_params_equal(ours, ref)
    assert_state_equal(opt, ours, ref_opts, ref)


def test_one_ns_per_owned_matrix_per_step(monkeypatch):
    ours, _ = make_pair()
    opt = Muon(ours)
    calls = spy_ns(monkeypatch)
    for step in range(3):
        loss_backward(ours, step)
        if step == 1:
            ours.fc3.weight.grad = None
        opt.step()
        opt.zero_grad()
    assert calls.matrices == 3 * len(DEDICATED) - 1


def test_adjust_lr_matches_torch():
    from torch.optim._muon import _adjust_lr

    for shape in [(16, 8), (8, 16), (36, 16), (5, 8), (7, 7)]:
        for fn in (None, "original", "match_rms_adamw"):
            assert adjust_lr(0.02, fn, shape) == _adjust_lr(0.02, fn, torch.Size(shape))
    with pytest.raises(ValueError, match="adjust_lr_fn"):
        adjust_lr(0.1, "sqrt", (2, 2))


# ---------------------------------------------------------------------------------------------
# validation
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(adjust_lr_fn="sqrt"), "adjust_lr_fn"),
        (dict(ns_steps=100), "steps < 100"),
        (dict(ns_coefficients=(1.0, 2.0)), "triple"),
        (dict(ns_coefficients=[(3.0, -3.0, 1.0)] * 2, ns_steps=5), "2 triples but steps=5"),
        (dict(ns_coefficients="deepseek_v4", ns_steps=5), "fixed 10-step schedule"),
        (dict(variant="adam"), "unknown variant"),
        (dict(variant="normuon", normuon_beta2=1.0), "normuon_beta2"),
        (dict(variant="normuon", normuon_eps=-1.0), "normuon_eps"),
        (dict(ns_coefficients="polar"), "preset"),
        (dict(ns_dtype=torch.int32), "ns_dtype"),
        (dict(ns_dtype="torch.banana"), "ns_dtype"),
        (dict(lr=-1.0), "learning rate"),
        (dict(momentum=-0.1), "momentum"),
        (dict(weight_decay=-0.1), "weight_decay"),
        (dict(adamw_betas=(0.9, 1.0)), "betas"),
        (dict(adamw_lr=-1.0), "AdamW learning rate"),
        (dict(adamw_eps=-1.0), "eps"),
    ],
)
def test_bad_hyper_parameters(kwargs, match):
    ours, _ = make_pair()
    with pytest.raises(ValueError, match=match):
        Muon(ours, **kwargs)


def test_bad_inputs():
    lin = nn.Linear(3, 3)
    with pytest.raises(ValueError, match="1-D|matrix"):
        Muon([tag(nn.Parameter(torch.ones(4)), "v", matrix_shape=(4, 1))])
    with pytest.raises(ValueError, match="tile"):
        Muon([tag(nn.Parameter(torch.ones(4, 6)), "w", matrix_shape=(4, 5))])
    bad_owner = nn.Parameter(torch.ones(4, 6))
    _tags.write(bad_owner, _tags.PARAM, FakeInfo("w", 0, True, (8, 6), (8, 6), 1))
    with pytest.raises(ValueError, match="full"):
        Muon([bad_owner])
    with pytest.raises(TypeError, match="param-group dicts"):
        Muon([{"params": list(lin.parameters())}])
    with pytest.raises(TypeError, match="single"):
        Muon(lin.weight)
    with pytest.raises(ValueError, match="empty"):
        Muon([])
    with pytest.raises(ValueError, match="twice"):
        Muon([lin.weight, lin.weight])


def test_per_step_coefficient_table_and_preset_name():
    ours, ref = make_pair()
    opt = ours_optimizer(ours, MUON_KW, ADAMW_KW, ns_coefficients=[(3.4445, -4.775, 2.0315)] * 5)
    assert opt.param_groups[0]["ns_coefficients"] == ((3.4445, -4.775, 2.0315),) * 5
    opt_named = Muon(ref, ns_coefficients="muon")
    assert opt_named.param_groups[0]["ns_coefficients"] == (3.4445, -4.775, 2.0315)


# ---------------------------------------------------------------------------------------------
# AdamW on DTensors (a 1-rank gloo group in a subprocess, so this process stays group-free)
# ---------------------------------------------------------------------------------------------

_DTENSOR_SCRIPT = textwrap.dedent(
    """
    import os, tempfile, torch, torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor, Shard, Replicate
    from torch import nn
    import dmuon.exec._optim.muon as optim_mod
    from dmuon import _tags
    optim_mod.wait_pending = optim_mod.after_step = lambda params: None
    tmp = tempfile.TemporaryDirectory()
    dist.init_process_group("gloo", init_method=f"file://{tmp.name}/init", rank=0, world_size=1)
    mesh = init_device_mesh("cpu", (1,))
    torch.manual_seed(0)
    vals = [torch.randn(6, 4), torch.randn(5)]
    grads = [[torch.randn_like(v) for v in vals] for _ in range(3)]
    def make():
        ps = [nn.Parameter(distribute_tensor(vals[0].clone(), mesh, [Shard(0)])),
              nn.Parameter(distribute_tensor(vals[1].clone(), mesh, [Replicate()]))]
        return ps
    ours, ref = make(), make()
    w = nn.Parameter(torch.randn(12, 4)); w_ref = nn.Parameter(w.detach().clone())
    class Info: pass
    info = Info(); info.fqn="w"; info.owner_global_rank=0; info.is_owner=True; info.shape=(12, 4)
    info.matrix_shape=(12, 4); info.num_matrices=1; info.runtime=lambda: None
    _tags.write(w, _tags.PARAM, info)
    opt = optim_mod.Muon(ours + [w], adamw_lr=0.01, adamw_weight_decay=0.1)
    ropt = torch.optim.AdamW(ref, lr=0.01, weight_decay=0.1)
    rmu = torch.optim.Muon([w_ref])
    for gs in grads:
        for p, q, g in zip(ours, ref, gs):
            p.grad = distribute_tensor(g, mesh, p.placements)
            q.grad = distribute_tensor(g, mesh, q.placements)
        w.grad = gs[0].repeat(2, 1); w_ref.grad = w.grad.clone()
        opt.step(); ropt.step(); rmu.step()
    for p, q in zip(ours, ref):
        assert type(p.data).__name__ == "DTensor", type(p.data)
        assert torch.equal(p.full_tensor(), q.full_tensor())
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(opt.state[p][k].full_tensor(), ropt.state[q][k].full_tensor()), k
        assert torch.equal(opt.state[p]["step"], ropt.state[q]["step"])
    assert torch.equal(w, w_ref)
    dist.barrier()
    dist.destroy_process_group()
    tmp.cleanup()
    print("DTENSOR_OK")
    """
)


@pytest.mark.distributed  # a process group in a subprocess
def test_adamw_on_dtensors_bit_identical():
    proc = subprocess.run(
        [sys.executable, "-c", _DTENSOR_SCRIPT],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).resolve().parents[2],
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0 and "DTENSOR_OK" in proc.stdout, proc.stdout + proc.stderr


# ---------------------------------------------------------------------------------------------
# Ns_backend="gram" and the "polar_express" preset
#
# Tolerances (gram vs standard backend, same model, data and hyper-parameters, 5 steps):
# - ns_dtype=float64 on a float64 model: parameters within 1e-12 of each tensor's largest
#   magnitude (Gram NS is the same polynomial; measured <= 8e-15);
# - ns_dtype=float32: within 1e-4 of each tensor's largest magnitude (measured <= 5e-6);
# - ns_dtype=bfloat16 (default): within 0.15 of it (measured <= 5.4e-2: bf16 NS results of the
#   two backends differ by a few 1e-2, the bf16 rounding error of docs/newton_schulz.md's table).
# ---------------------------------------------------------------------------------------------


def _train_backends(ns_dtype, model_dtype, steps=STEPS, **extra):
    results = []
    for backend in ("standard", "gram"):
        ours, _ = make_pair()
        ours.to(model_dtype)
        opt = ours_optimizer(ours, MUON_KW, ADAMW_KW, ns_dtype=ns_dtype, ns_backend=backend, **extra)
        _train(opt, ours, steps)
        results.append((opt, ours))
    return results


@pytest.mark.parametrize(
    "ns_dtype, model_dtype, rel_tol",
    [
        (torch.float64, torch.float64, 1e-12),
        (torch.float32, torch.float32, 1e-4),
        (torch.bfloat16, torch.float32, 0.15),
    ],
)
@pytest.mark.parametrize("coefficients", ["muon", "polar_express"])
def test_gram_backend_matches_standard(ns_dtype, model_dtype, rel_tol, coefficients):
    (opt_std, std), (opt_gram, gram) = _train_backends(ns_dtype, model_dtype, ns_coefficients=coefficients)
    assert opt_gram.param_groups[0]["ns_backend"] == "gram"
    for (name, a), (_, b) in zip(gram.named_parameters(), std.named_parameters()):
        assert torch.isfinite(a).all(), name
        tol = rel_tol * b.abs().max().item()
        torch.testing.assert_close(a, b, rtol=0, atol=tol, msg=name)


def test_gram_backend_calls_gram_ns(monkeypatch):
    calls = []
    real = ns_mod.gram_newton_schulz

    def spy(x, **kw):
        calls.append((tuple(x.shape), kw["dtype"]))
        return real(x, **kw)

    monkeypatch.setattr(ns_mod, "gram_newton_schulz", spy)
    ours, _ = make_pair()
    opt = ours_optimizer(ours, MUON_KW, ADAMW_KW, ns_backend="gram")  # bf16: one call per matrix
    ns_calls = spy_ns(monkeypatch)
    _train(opt, ours, 1)
    assert [s for s, _ in calls] == [tuple(dict(ours.named_parameters())[n].shape) for n in DEDICATED]
    assert all(dt is torch.bfloat16 for _, dt in calls) and ns_calls.matrices == len(DEDICATED)
    assert all(torch.isfinite(p).all() for p in ours.parameters())


@pytest.mark.parametrize("ns_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("ns_backend", ["standard", "gram"])
def test_polar_express_preset_runs_and_round_trips(ns_dtype, ns_backend):
    kw = dict(ns_dtype=ns_dtype, ns_backend=ns_backend, ns_coefficients="polar_express")
    full, _ = make_pair()
    opt_full = ours_optimizer(full, MUON_KW, ADAMW_KW, **kw)
    group = opt_full.param_groups[0]
    assert group["ns_coefficients"] == ns_coef.NS_PRESETS["polar_express"][:5]  # resolved, 5 steps
    _train(opt_full, full, 5)
    assert all(torch.isfinite(p).all() for p in full.parameters())

    first, _ = make_pair()
    opt_first = ours_optimizer(first, MUON_KW, ADAMW_KW, **kw)
    _train(opt_first, first, 3)
    buffer = io.BytesIO()
    torch.save({"model": first.state_dict(), "optim": opt_first.state_dict()}, buffer)
    buffer.seek(0)
    ckpt = torch.load(buffer, weights_only=True)

    resumed, _ = make_pair(seed=123)
    resumed.load_state_dict(ckpt["model"])
    opt_resumed = ours_optimizer(resumed, MUON_KW, ADAMW_KW)  # standard / "muon": the ckpt wins
    opt_resumed.load_state_dict(ckpt["optim"])
    assert opt_resumed.param_groups[0]["ns_backend"] == ns_backend
    assert opt_resumed.param_groups[0]["ns_coefficients"] == ns_coef.NS_PRESETS["polar_express"][:5]
    _train(opt_resumed, resumed, 2, start=3)
    assert_params_equal(resumed, full)
    assert opt_resumed.state_dict()["param_groups"] == opt_full.state_dict()["param_groups"]


def test_polar_express_preset_differs_from_muon():
    a, _ = make_pair()
    b, _ = make_pair()
    _train(ours_optimizer(a, MUON_KW, ADAMW_KW, ns_coefficients="polar_express"), a, 1)
    _train(ours_optimizer(b, MUON_KW, ADAMW_KW), b, 1)
    assert any(not torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


def test_polar_express_preset_with_other_step_counts():
    ours, _ = make_pair()
    opt = Muon(ours, ns_coefficients="polar_express", ns_steps=10)
    preset = ns_coef.NS_PRESETS["polar_express"]
    assert opt.param_groups[0]["ns_coefficients"] == preset + (preset[-1],) * 2


def test_ns_backend_validation_and_old_checkpoints():
    ours, _ = make_pair()
    with pytest.raises(ValueError, match="unknown Newton-Schulz backend 'polar'"):
        Muon(ours, ns_backend="polar")
    with pytest.raises(TypeError):  # keyword-only
        Muon(
            ours,
            1e-3,
            0.1,
            0.95,
            True,
            (3.4445, -4.775, 2.0315),
            1e-7,
            5,
            None,
            torch.bfloat16,
            1e-3,
            (0.9, 0.999),
            1e-8,
            1e-2,
            "gram",
        )
    opt = ours_optimizer(ours, MUON_KW, ADAMW_KW, ns_backend="gram")
    with pytest.raises(ValueError, match="backend"):
        opt.add_param_group({"params": [tag(nn.Parameter(torch.randn(6, 4)), "x")], "ns_backend": "nope"})
    # a checkpoint written before ns_backend existed loads as the standard backend
    sd = opt.state_dict()
    for g in sd["param_groups"]:
        g.pop("ns_backend", None)
    opt.load_state_dict(sd)
    assert opt.param_groups[0]["ns_backend"] == "standard"
    _train(opt, ours, 1)


def test_skip_nonfinite_without_process_group(caplog):
    """One process, no process group (AdamW only): a NaN gradient skips the step (parameters and
    AdamW state untouched, last_step_skipped, one warning naming rank 0); a finite one steps."""
    import logging
    import warnings

    model = nn.Sequential(nn.Linear(4, 3))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # nothing dedicated: AdamW only
        opt = Muon(model, skip_nonfinite=True)
    before = [p.detach().clone() for p in model.parameters()]
    model(torch.ones(2, 4)).sum().backward()
    model[0].bias.grad[0] = float("nan")
    with caplog.at_level(logging.WARNING, logger="dmuon"):
        opt.step()
    assert opt.last_step_skipped and opt.skipped_steps == 1
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert all(opt.state[p]["step"].item() == 0 for p in model.parameters())
    msgs = [r.getMessage() for r in caplog.records if r.name == "dmuon"]
    assert len(msgs) == 1 and "optimizer step 1 (1-based) skipped on every rank" in msgs[0], msgs
    assert "rank(s) [0] hold a non-finite gradient after the reduces" in msgs[0], msgs
    opt.zero_grad()
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    assert not opt.last_step_skipped and opt.skipped_steps == 1
    assert all(opt.state[p]["step"].item() == 1 for p in model.parameters())
    with pytest.raises(TypeError, match="skip_nonfinite must be a bool"):
        Muon(model, skip_nonfinite="yes")


# ----------------------------------------------------------------------------------------------
# tiny and zero gradients: each matrix divided by max(||X||_F, eps) of its own, as torch's
# clamp(min=eps), through dmuon.Muon's batched bucket (fp32) and its default bf16 iteration
# ----------------------------------------------------------------------------------------------

EPS = 1e-7


def _three(shape=(8, 20), seed=0):
    """A normal matrix, one whose norm is below eps (1e-9 scale: ||X|| ~ 1e-8), one all zero."""
    g = torch.Generator().manual_seed(seed)
    normal = torch.randn(shape, generator=g)
    tiny = torch.randn(shape, generator=g) * 1e-9
    assert tiny.norm() < EPS
    return [normal, tiny, torch.zeros(shape)]


def test_muon_bucket_with_tiny_and_zero_gradients_matches_torch_muon(monkeypatch):
    """dmuon.Muon (fp32 NS: the three share one batched call) vs torch.optim.Muon (fp32 NS)."""
    from dmuon.exec._optim import muon as optim_mod
    from oracle import fp32_newton_schulz

    monkeypatch.setattr(optim_mod, "wait_pending", lambda params: None)
    monkeypatch.setattr(optim_mod, "after_step", lambda params: None)
    grads = _three((8, 20), seed=3)
    ours = [tag(nn.Parameter(torch.randn(8, 20)), f"layers.0.w{i}") for i in range(3)]
    ref = [nn.Parameter(p.detach().clone()) for p in ours]
    opt = dmuon.Muon(ours, lr=0.02, weight_decay=0.1, ns_dtype=torch.float32)
    ref_opt = torch.optim.Muon(ref, lr=0.02, weight_decay=0.1)
    for _ in range(2):
        for p, q, g in zip(ours, ref, grads):
            p.grad, q.grad = g.clone(), g.clone()
        opt.step()
        with fp32_newton_schulz():
            ref_opt.step()
    for i, (p, q) in enumerate(zip(ours, ref)):
        assert torch.isfinite(p).all(), i
        err = (p - q).abs().max().item()
        assert err <= 1e-5 * q.abs().max().item(), (i, err)


# ----------------------------------------------------------------------------------------------
# edge cases against torch.optim.Muon, the default (bf16) Newton-Schulz on both sides
# ----------------------------------------------------------------------------------------------


def _pair(shapes, seed=0):
    """dmuon.Muon and torch.optim.Muon over copies of the same matrices (default hyper-parameters
    but lr 0.02, weight decay 0.1: the decay shows whether a skipped matrix was touched)."""
    g = torch.Generator().manual_seed(seed)
    ours = [tag(nn.Parameter(torch.randn(s, generator=g)), f"layers.0.w{i}") for i, s in enumerate(shapes)]
    ref = [nn.Parameter(p.detach().clone()) for p in ours]
    return ours, ref, dmuon.Muon(ours, lr=0.02, weight_decay=0.1), torch.optim.Muon(ref, lr=0.02, weight_decay=0.1)


def test_gradient_norm_below_eps_default_bf16_equals_torch_muon(monkeypatch):
    """||G||_F below eps (1e-7) and exactly 0, next to a normal gradient, in dmuon.Muon's default
    bf16 iteration: bit-equal to torch.optim.Muon's, finite (torch divides by max(||X||, eps):
    a tiny gradient is scaled by 1/eps, not normalised; a zero one stays zero)."""
    from dmuon.exec._optim import muon as optim_mod

    monkeypatch.setattr(optim_mod, "wait_pending", lambda params: None)
    monkeypatch.setattr(optim_mod, "after_step", lambda params: None)
    grads = _three((8, 20), seed=5)
    assert 0 < grads[1].norm() < EPS
    ours, ref, opt, ref_opt = _pair([(8, 20)] * 3)
    assert opt.param_groups[0]["ns_dtype"] == torch.bfloat16  # the default, as torch's
    for _ in range(3):
        for p, q, g in zip(ours, ref, grads):
            p.grad, q.grad = g.clone(), g.clone()
        opt.step()
        ref_opt.step()
        for i, (p, q) in enumerate(zip(ours, ref)):
            assert torch.isfinite(p).all(), i
            assert torch.equal(p, q), (i, (p - q).abs().max().item())


def test_gradient_absent_for_the_first_steps_then_present_equals_torch_muon(monkeypatch):
    """A matrix whose gradient is None for the first K steps: untouched by them (no momentum, no
    weight decay), then updated from step K+1 on exactly as torch.optim.Muon, which creates its
    momentum buffer at the first gradient (dmuon's exists from construction, zero)."""
    from dmuon.exec._optim import muon as optim_mod

    monkeypatch.setattr(optim_mod, "wait_pending", lambda params: None)
    monkeypatch.setattr(optim_mod, "after_step", lambda params: None)
    K, steps = 2, 5
    ours, ref, opt, ref_opt = _pair([(8, 20), (12, 6)], seed=7)
    start = ours[1].detach().clone()
    g = torch.Generator().manual_seed(8)
    for step in range(steps):
        for i, (p, q) in enumerate(zip(ours, ref)):
            grad = torch.randn(p.shape, generator=g)
            p.grad = q.grad = None
            if i == 0 or step >= K:
                p.grad, q.grad = grad.clone(), grad.clone()
        opt.step()
        ref_opt.step()
        if step < K:
            assert torch.equal(ours[1], start) and "momentum_buffer" not in ref_opt.state[ref[1]], step
        for i, (p, q) in enumerate(zip(ours, ref)):
            assert torch.equal(p, q), (step, i, (p - q).abs().max().item())
    assert not torch.equal(ours[1], start)
    assert torch.equal(opt.state[ours[1]]["momentum_buffer"], ref_opt.state[ref[1]]["momentum_buffer"])
