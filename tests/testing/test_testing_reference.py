"""dmuon.testing: the reference users run, validated independently, and the one-call checker.

(a) :class:`dmuon.testing.ReferenceOptimizer` on a model with fused parameters (a plain matrix,
    a conv weight, row / column matrix views and one expert stack per layout, fused and not)
    equals plain ``torch.optim.Muon`` + ``torch.optim.AdamW`` on the hand-built unfused model a
    user would have (every matrix its own ``nn.Parameter``, same initial values, forward written
    per layout by hand), bit for bit, with torch's bf16 iteration and with an fp32 one;
(b) proxies read and write back the strided / transposed slices exactly;
(c) an expert no token reached (zero gradient) decays as torch decays it; a parameter without
    gradient is skipped;
(d) ``check_against_reference`` on 2 ranks passes with the fp32 bounds, and fails when the
    reference is given a different learning rate.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import dmuon.testing as T
from oracle import hand_fp32_newton_schulz

E, D, FF = 3, 5, 3  # experts, model dim, per-expert hidden (F)
ROWS = (0, 0, 0, 1, 1, 1)  # token -> expert; expert 2 gets no token (zero gradient, not None)
HP = dict(lr=0.05, weight_decay=0.1, momentum=0.9, nesterov=True, adamw_lr=0.01, adamw_weight_decay=0.02)
STEPS = 3


class Fused(nn.Module):
    """Fused storage; the forward slices each matrix out by hand (contiguous, (out, in))."""

    def __init__(self, fused_gate_up: bool):
        super().__init__()
        self.fused_gate_up = fused_gate_up
        r = lambda *s: nn.Parameter(torch.randn(*s) * 0.3)  # noqa: E731
        self.lin = r(D, D)  # plain matrix
        self.conv = r(4, 2, 3, 3)  # conv weight
        self.qkv = r(9, D)  # row view (4, 3, 2)
        self.o = r(D, 6)  # column view (2, 4)
        self.hf_gate_up = r(E, 2 * FF, D)  # HF 5.x: (E, 2F, D), gate rows then up rows
        self.gpt_gate_up = r(E, D, 2 * FF)  # gpt-oss: (E, D, 2F) (in, out), interleaved
        self.gpt_down = r(E, FF, D)  # gpt-oss down: (E, F, D) (in, out)
        self.down = r(E, D, FF)  # linear: (E, D, F) (out, in)
        self.bias = nn.Parameter(torch.zeros(D))
        self.frozen_grad = r(D, D)  # Muon target never used: .grad None

    def mats(self, e):
        """(gate, up, gate2, up2, down_io, down_lin) of expert e, or fused (gu, gu2, ...)."""
        if self.fused_gate_up:
            gu = self.hf_gate_up[e]
            gu2 = self.gpt_gate_up[e].T.contiguous()
            return gu, gu2, self.gpt_down[e].T.contiguous(), self.down[e]
        gate, up = self.hf_gate_up[e, :FF], self.hf_gate_up[e, FF:]
        gate2 = self.gpt_gate_up[e][:, 0::2].T.contiguous()
        up2 = self.gpt_gate_up[e][:, 1::2].T.contiguous()
        return gate, up, gate2, up2, self.gpt_down[e].T.contiguous(), self.down[e]

    def dense(self):
        q, k, v = self.qkv[:4], self.qkv[4:7], self.qkv[7:]
        o0, o1 = self.o[:, :2].contiguous(), self.o[:, 2:].contiguous()
        return self.lin, self.conv.view(4, 18), (q, k, v), (o0, o1)

    def forward(self, x, img):
        return _forward(self, x, img)


class Unfused(nn.Module):
    """What a user without fused storage has: one nn.Parameter per matrix."""

    def __init__(self, fused: Fused):
        super().__init__()
        c = lambda t: nn.Parameter(t.detach().clone())  # noqa: E731
        self.fused_gate_up = fused.fused_gate_up
        lin, conv, qkv, o = fused.dense()
        self.lin, self.conv = c(lin), c(conv)
        self.q, self.k, self.v = (c(t) for t in qkv)
        self.o0, self.o1 = (c(t) for t in o)
        self.experts = nn.ModuleList()
        for e in range(E):
            m = nn.Module()
            m.mats = nn.ParameterList([c(t) for t in fused.mats(e)])
            self.experts.append(m)
        self.bias = c(fused.bias)
        self.frozen_grad = c(fused.frozen_grad)

    def mats(self, e):
        return tuple(self.experts[e].mats)

    def dense(self):
        return self.lin, self.conv, (self.q, self.k, self.v), (self.o0, self.o1)

    def forward(self, x, img):
        return _forward(self, x, img)

    def muon_params(self):
        return [self.lin, self.conv, self.q, self.k, self.v, self.o0, self.o1, *_stack_major(self), self.frozen_grad]


def _forward(m, x, img):
    lin, conv, (q, k, v), (o0, o1) = m.dense()
    h = torch.tanh(x @ lin.T) + m.bias
    att = torch.cat([h @ q.T, h @ k.T, h @ v.T], dim=-1)  # (B, 9)
    h = h + att[:, :2] @ o0.T + att[:, 2:6] @ o1.T
    y = torch.zeros_like(h)
    rows = torch.tensor(ROWS)
    for e in range(E):
        xe = h[rows == e]  # expert 2: (0, D) -> zero gradients
        mats = m.mats(e)
        if m.fused_gate_up:
            gu, gu2, down_io, down_lin = mats
            a = xe @ gu.T
            g, u = a[:, :FF], a[:, FF:]
            b = xe @ gu2.T
            g2, u2 = b[:, 0::2], b[:, 1::2]
        else:
            gate, up, gate2, up2, down_io, down_lin = mats
            g, u, g2, u2 = xe @ gate.T, xe @ up.T, xe @ gate2.T, xe @ up2.T
        ye = (F.silu(g) * u) @ down_io.T + (F.silu(g2) * u2) @ down_lin.T
        y = y.index_put((torch.nonzero(rows == e).flatten(),), ye)
    c = F.conv2d(img, conv.view(4, 2, 3, 3))
    return (h + y).square().mean() + c.square().mean()


def _proxies(fused_gate_up):
    return {
        "lin": T.matrix((D, D)),
        "conv": T.conv((4, 2, 3, 3)),
        "qkv": T.matrix_view((9, D), 0, (4, 3, 2)),
        "o": T.matrix_view((D, 6), 1, (2, 4)),
        "hf_gate_up": T.expert_stack((E, 2 * FF, D), "hf_gate_up", fused=fused_gate_up),
        "gpt_gate_up": T.expert_stack((E, D, 2 * FF), "gpt_oss_gate_up", fused=fused_gate_up),
        "gpt_down": T.expert_stack((E, FF, D), "in_out"),
        "down": T.expert_stack((E, D, FF), "linear"),
        "frozen_grad": T.matrix((D, D)),
    }


def _stack_major(m):
    """The experts' matrices stack by stack (the fused model's parameter order), expert-major
    inside a stack (gate0, up0, gate1, up1, ...)."""
    groups = [[0], [1], [2], [3]] if m.fused_gate_up else [[0, 1], [2, 3], [4], [5]]
    return [m.mats(e)[i] for grp in groups for e in range(E) for i in grp]


def _fused_views(fused: Fused):
    """The fused model's matrices in Unfused.muon_params() order (hand-written slices)."""
    lin, conv, qkv, o = fused.dense()
    return [lin, conv, *qkv, *o, *_stack_major(fused), fused.frozen_grad]


@pytest.mark.parametrize("fused_gate_up", [False, True])
@pytest.mark.parametrize("ns_dtype", [torch.bfloat16, torch.float32])
def test_reference_equals_hand_built_torch_muon(ns_dtype, fused_gate_up, monkeypatch):
    torch.manual_seed(0)
    fused = Fused(fused_gate_up)
    unfused = Unfused(fused)
    ref = T.ReferenceOptimizer(fused, _proxies(fused_gate_up), ns_dtype=ns_dtype, **HP)
    hand_muon = torch.optim.Muon(
        unfused.muon_params(),
        lr=HP["lr"],
        weight_decay=HP["weight_decay"],
        momentum=HP["momentum"],
        nesterov=HP["nesterov"],
    )
    hand_adamw = torch.optim.AdamW([unfused.bias], lr=HP["adamw_lr"], weight_decay=HP["adamw_weight_decay"])
    # every proxy's matrix in the same order as the hand model's parameters
    assert [tuple(pp.shape) for pps in ref.proxy_params.values() for pp in pps] == [
        tuple(p.shape) for p in unfused.muon_params()
    ]
    g = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        x, img = torch.randn(len(ROWS), D, generator=g), torch.randn(2, 2, 5, 5, generator=g)
        lf, lu = fused(x, img), unfused(x, img)
        assert torch.equal(lf, lu)
        lf.backward()
        lu.backward()
        assert fused.frozen_grad.grad is None and unfused.frozen_grad.grad is None
        assert unfused.mats(2)[0].grad is not None and not unfused.mats(2)[0].grad.any()  # zero, not None
        ref.step()
        if ns_dtype == torch.float32:
            monkeypatch.setattr(torch.optim._muon, "_zeropower_via_newtonschulz", hand_fp32_newton_schulz)
        hand_muon.step()
        monkeypatch.undo()
        hand_adamw.step()
        ref.zero_grad()
        hand_muon.zero_grad()
        hand_adamw.zero_grad()
        with torch.no_grad():
            for mine, theirs in zip(_fused_views(fused), unfused.muon_params()):
                assert torch.equal(mine, theirs)
            assert torch.equal(fused.bias, unfused.bias)
    bufs = [
        ref.muon.state[pp]["momentum_buffer"]
        for pps in ref.proxy_params.values()
        for pp in pps[:]
        if pp in ref.muon.state
    ]
    hand_bufs = [hand_muon.state[p]["momentum_buffer"] for p in unfused.muon_params() if p in hand_muon.state]
    assert len(bufs) == len(hand_bufs) == len(unfused.muon_params()) - 1  # frozen_grad: never stepped
    assert all(torch.equal(a, b) for a, b in zip(bufs, hand_bufs))


LAYOUTS = [
    ("linear", False, (E, 4, 6)),
    ("hf_gate_up", False, (E, 2 * FF, D)),
    ("hf_gate_up", True, (E, 2 * FF, D)),
    ("in_out", False, (E, 4, 6)),
    ("gpt_oss_gate_up", False, (E, D, 2 * FF)),
    ("gpt_oss_gate_up", True, (E, D, 2 * FF)),
]


def _hand_slices(w, layout, fused):
    out = []
    for e in range(w.shape[0]):
        if layout == "linear" or (layout == "hf_gate_up" and fused):
            out.append(w[e])
        elif layout == "hf_gate_up":
            f = w.shape[1] // 2
            out += [w[e, :f], w[e, f:]]
        elif layout == "in_out" or fused:
            out.append(w[e].T)
        else:
            out += [w[e][:, ::2].T, w[e][:, 1::2].T]
    return out


@pytest.mark.parametrize("layout, fused, shape", LAYOUTS)
def test_proxies_read_and_write_back_exactly(layout, fused, shape):
    w = torch.randn(shape)
    proxies = T.expert_stack(shape, layout, fused=fused)
    hand = _hand_slices(w, layout, fused)
    assert len(proxies) == len(hand)
    assert all(torch.equal(p.of(w), h) and p.of(w).shape == p.shape for p, h in zip(proxies, hand))
    # write-back: every element of a zero tensor written once, through strided / transposed slices
    z = torch.zeros_like(w)
    for p in proxies:
        p.of(z).copy_(p.of(w).clone(memory_format=torch.contiguous_format))
    assert torch.equal(z, w)
    # a reference step without gradients leaves the parameter bit-identical (proxy round trip),
    # and a change made to the real parameter between steps is what the proxies see next
    model = nn.Module()
    model.w = nn.Parameter(w.clone())
    ref = T.ReferenceOptimizer(model, {"w": proxies}, ns_dtype=torch.float32, lr=0.1)
    ref.step()
    assert torch.equal(model.w, w)
    with torch.no_grad():
        model.w.mul_(2)
    model.w.grad = torch.zeros_like(w)
    ref.step()  # zero gradient: decay only, on the doubled values
    assert torch.equal(model.w.detach(), (w * 2) * (1 - 0.1 * 0.1))


def test_conv_and_views_cover_and_reject_bad_proxies():
    w = torch.randn(4, 2, 3, 3)
    (p,) = T.conv(w.shape)
    assert torch.equal(p.of(w), w.reshape(4, 18))
    rows = T.matrix_view((9, 5), 0, (4, 3, 2))
    assert [r.shape for r in rows] == [(4, 5), (3, 5), (2, 5)]
    cols = T.matrix_view((5, 6), 1, (2, 4))
    m = torch.randn(5, 6)
    assert torch.equal(cols[1].of(m), m[:, 2:])
    model = nn.Linear(6, 5, bias=False)
    with pytest.raises(ValueError, match="exactly once"):
        T.ReferenceOptimizer(model, {"weight": cols[:1]})
    with pytest.raises(ValueError, match="sum to"):
        T.matrix_view((5, 6), 1, (2, 3))
    with pytest.raises(KeyError, match="not parameter names"):
        T.ReferenceOptimizer(model, {"nope": T.matrix((5, 6))})
    with pytest.raises(TypeError, match="unknown hyper-parameters"):
        T.ReferenceOptimizer(model, {"weight": T.matrix((5, 6))}, betas=(0.9, 0.9))


def test_zero_grad_expert_decays_none_grad_param_skipped():
    lr, wd = 0.1, 0.2
    model = nn.Module()
    model.stack = nn.Parameter(torch.randn(E, 4, 6))
    model.unused = nn.Parameter(torch.randn(4, 6))
    w0, u0 = model.stack.detach().clone(), model.unused.detach().clone()
    ref = T.ReferenceOptimizer(
        model,
        {"stack": T.expert_stack((E, 4, 6)), "unused": T.matrix((4, 6))},
        ns_dtype=torch.float32,
        lr=lr,
        weight_decay=wd,
    )
    grad = torch.randn(E, 4, 6)
    grad[1] = 0  # expert 1 reached by no token
    model.stack.grad = grad
    ref.step()
    # torch's Muon: zero gradient -> zero momentum, NS(0) = 0, but decoupled decay still applies
    assert torch.equal(model.stack[1].detach(), w0[1] * (1 - lr * wd))
    assert not torch.equal(model.stack[0].detach(), w0[0] * (1 - lr * wd))  # a real update
    assert torch.equal(model.unused.detach(), u0)  # no .grad: skipped, no decay
    assert all(pp not in ref.muon.state for pp in ref.proxy_params["unused"])
    assert all(pp.grad is None for pp in ref.proxy_params["unused"])


def test_per_step_coefficients_and_preset():
    """A per-step coefficient table (dmuon's presets) runs through the same iteration, each step
    with its own triple; a constant preset is passed to torch as its triple."""
    from dmuon._update import coefficient_schedule

    model = nn.Linear(6, 4, bias=False)
    ref = T.ReferenceOptimizer(model, {"weight": T.matrix((4, 6))}, ns_coefficients="polar_express")
    assert ref.muon.param_groups[0]["ns_coefficients"] == coefficient_schedule("polar_express", 5)
    g = torch.randn(4, 6)
    model.weight.grad = g.clone()
    w0 = model.weight.detach().clone()
    ref.step()
    sched = coefficient_schedule("polar_express", 5)
    buf = torch.zeros_like(g).lerp_(g, 1 - 0.95)
    u = g.lerp(buf, 0.95)
    o = T.reference_newton_schulz(u, sched, 5, 1e-7, dtype=torch.bfloat16)
    want = w0 * (1 - 1e-3 * 0.1)
    want.add_(o, alpha=-1e-3 * max(1, 4 / 6) ** 0.5)
    assert torch.equal(model.weight.detach(), want)
    ref2 = T.ReferenceOptimizer(nn.Linear(6, 4, bias=False), {"weight": T.matrix((4, 6))}, ns_coefficients="muon")
    assert ref2._ns is None and len(ref2.muon.param_groups[0]["ns_coefficients"]) == 3


def test_proxies_from_plan():
    import dmuon.plan
    from dmuon.plan._model import views

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = nn.Linear(8, 12, bias=False)
            self.conv = nn.Conv1d(4, 6, 3)
            self.experts = nn.Module()
            self.experts.w = nn.Parameter(torch.randn(E, 6, 8))

    model = nn.Module()
    model.layers = nn.ModuleList([Block()])
    plan = dmuon.plan.compile(
        model,
        2,
        predicate=dmuon.plan._model.selection.matrix_predicate(model),
        matrix_views={"layers.0.attn.weight": views.heads(3)},
    )
    px = T.proxies_from_plan(plan)
    assert set(px) == set(plan.dedicated)
    assert [p.shape for p in px["layers.0.attn.weight"]] == [(4, 8)] * 3
    assert [p.shape for p in px["layers.0.conv.weight"]] == [(6, 12)]
    assert px["layers.0.experts.w"] == T.expert_stack((E, 6, 8), "linear")
    px = T.proxies_from_plan(plan, stack_layouts={"layers.0.experts.w": "hf_gate_up"})
    assert px["layers.0.experts.w"] == T.expert_stack((E, 6, 8), "hf_gate_up")
    with pytest.raises(KeyError, match="not dedicated 3-D"):
        T.proxies_from_plan(plan, stack_layouts={"layers.0.attn.weight": "linear"})


def test_report_str_and_verdict():
    r = T.Report(
        world_size=2,
        mesh_shape=(1, 2),
        ns_dtype="torch.float32",
        dedicated=("a",),
        losses=(1.0, 0.9),
        reference_losses=(1.0, 0.9),
        loss_dev=0.0,
        param_devs={"a": 2e-4},
        param_dev=2e-4,
        worst_param="a",
        loss_bound=1e-6,
        param_bound=1e-4,
    )
    assert not r.passed
    text = str(r)
    assert "FAILED" in text and "EXCEEDED" in text and "worst: a" in text
    assert T.bounds(torch.float32) == (1e-6, 1e-4) and T.bounds(torch.bfloat16) == (2e-3, 5e-2)


# ---------------------------------------------------------------------------------------------
# (d) the one-call checker on 2 ranks
# ---------------------------------------------------------------------------------------------


def test_check_against_reference_passes_and_can_fail():
    from oracle import dmuon_muon_kwargs, global_batches, lm_loss, make_model

    kw = dmuon_muon_kwargs()
    kw.pop("ns_dtype")
    model_fn = functools.partial(make_model, "tiny")
    report = T.check_against_reference(
        model_fn, lm_loss, global_batches(2), world_size=2, optimizer_kwargs=kw, timeout_s=120
    )
    assert report.passed, str(report)
    assert report.loss_bound == 1e-6 and report.param_bound == 1e-4
    assert len(report.losses) == 2 and report.dedicated and report.mesh_shape == (1, 2)
    # the reference at another learning rate: the checker must see it (1 rank: start-up is cheaper)
    wrong = T.check_against_reference(
        model_fn,
        lm_loss,
        global_batches(2),
        world_size=1,
        optimizer_kwargs=kw,
        reference_kwargs={**kw, "lr": kw["lr"] * 1.5},
        timeout_s=120,
    )
    assert not wrong.passed and wrong.param_dev > 1e-3, str(wrong)
    assert "FAILED" in str(wrong)
