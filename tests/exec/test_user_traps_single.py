"""Traps real Muon / FSDP2 users fell into: the single-process cases.

* tiny and zero gradients in one fp32 NS batch: each matrix divided by ``max(||X||_F, eps)`` of
  its own, as torch's ``clamp(min=eps)``, in the standard, Gram and TP-Gram paths and through
  ``dmuon.Muon``'s batched bucket, against torch.optim.Muon's iteration (fp32);
* the planner's coverage warning (blocks the boundary heuristic cannot see);
* degenerate "matrices" (a side of 1, depthwise conv kernels) left to AdamW.
"""

from __future__ import annotations

import datetime
import threading
import warnings

import pytest
import torch
import torch.nn as nn

import dmuon
from dmuon.exec._optim import ns_backends as ns
from oracle import Block, _ns_fp32

COEFFS = (3.4445, -4.775, 2.0315)
EPS = 1e-7


def _three(shape=(8, 20), seed=0):
    """A normal matrix, one whose norm is below eps (1e-9 scale: ||X|| ~ 1e-8), one all zero."""
    g = torch.Generator().manual_seed(seed)
    normal = torch.randn(shape, generator=g)
    tiny = torch.randn(shape, generator=g) * 1e-9
    assert tiny.norm() < EPS
    return [normal, tiny, torch.zeros(shape)]


def _reference(x):
    return _ns_fp32(x, COEFFS, 5, EPS)


def _assert_matches_torch(outs, ins, tol, where):
    for i, (o, x) in enumerate(zip(outs, ins)):
        want = _reference(x)
        if not x.any():
            assert not o.any() and torch.isfinite(o).all(), (where, i)  # all-zero stays zero
            continue
        scale = want.abs().max().item()
        assert scale > 0.05, (where, i, scale)  # below eps: scaled by 1/eps, not normalised
        err = (o.float() - want).abs().max().item()
        assert err <= tol * scale, (where, i, err, scale)


@pytest.mark.parametrize("shape", [(8, 20), (20, 8)], ids=["wide", "tall"])
def test_tiny_and_zero_matrices_in_one_batch_match_torch(shape):
    ins = _three(shape)
    kw = dict(coefficients=COEFFS, steps=5, eps=EPS, dtype=torch.float32)
    # standard NS: 2-D one by one, and the three as one (3, m, n) batch
    _assert_matches_torch([ns.newton_schulz(x, **kw) for x in ins], ins, 1e-5, "standard 2-D")
    _assert_matches_torch(ns.newton_schulz(torch.stack(ins), **kw).unbind(0), ins, 1e-5, "standard batch")
    # Gram NS (with its restarts and fallback), batched
    _assert_matches_torch(ns.gram_newton_schulz(torch.stack(ins), **kw).unbind(0), ins, 1e-4, "gram batch")
    # TP-Gram: the wide orientation split by columns over T=2 "ranks" (threads, summing all-reduce)
    wide = [x if x.shape[0] <= x.shape[1] else x.T for x in ins]
    X = torch.stack(wide)
    halves = X.chunk(2, dim=-1)
    results = [None, None]
    barrier = threading.Barrier(2)
    box: list = [None, None]

    def all_reduce(t, rank):
        box[rank] = t.clone()
        barrier.wait()
        t.copy_(box[0] + box[1])
        barrier.wait()
        return t

    def run(rank):
        results[rank] = ns.sharded_gram_newton_schulz(
            halves[rank].contiguous(), all_reduce_sum=lambda t: all_reduce(t, rank), **kw
        )

    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    out = torch.cat(results, dim=-1)
    _assert_matches_torch(out.unbind(0), wide, 1e-4, "tp-gram T=2")


def test_muon_bucket_with_tiny_and_zero_gradients_matches_torch_muon(monkeypatch):
    """dmuon.Muon (fp32 NS: the three share one batched call) vs torch.optim.Muon (fp32 NS)."""
    from dmuon.exec._optim import muon as optim_mod
    from oracle import fp32_newton_schulz
    from test_optim_single import tag

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
# coverage warning
# ----------------------------------------------------------------------------------------------


class DictLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(11, 8)
        self.blocks = nn.ModuleDict({"first": Block(), "second": Block()})
        self.head = nn.Linear(8, 11)


class EncoderDecoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = Block()
        self.decoder = Block()


def _compile_warnings(model, **kw):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = dmuon.plan.compile(model, 2, **kw)
    return plan, [str(w.message) for w in caught if "hook boundary" in str(w.message)]


@pytest.mark.parametrize(
    "model,count,first",
    [
        (DictLM, "9 of 9", "blocks.first.fc1.weight"),
        (EncoderDecoder, "8 of 8", "encoder.fc1.weight"),
        (Block, "4 of 4", "fc1.weight"),
    ],
    ids=["moduledict", "plain_attributes", "one_block"],
)
def test_invisible_blocks_warn_with_the_fix(model, count, first):
    plan, msgs = _compile_warnings(model())
    assert plan.dedicated == () and len(msgs) == 1, msgs
    msg = msgs[0]
    assert "no matrix is dedicated" in msg and f"{count} 2-D matrices" in msg and first in msg, msg
    assert "Fix: hook_boundary_predicate=lambda module: isinstance(module, Block)" in msg, msg
    # the line it shows fixes it, without a warning
    fixed, msgs = _compile_warnings(model(), hook_boundary_predicate=lambda m: isinstance(m, Block))
    assert len(fixed.dedicated) == int(count.split()[0]) - (model is DictLM) and msgs == []


def test_lm_head_outside_the_blocks_does_not_warn():
    from oracle import TinyLM

    plan, msgs = _compile_warnings(TinyLM())
    assert len(plan.dedicated) == 12 and msgs == []
    # strict mode keeps its meaning: a predicate selecting the head still raises
    with pytest.raises(ValueError, match="no hook-boundary ancestor"):
        dmuon.plan.compile(TinyLM(), 2, predicate=lambda fqn, p: p.ndim == 2 and "embed" not in fqn)


def test_mostly_uncovered_warns():
    class Wide(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList([nn.Linear(4, 4)])  # 16 elements inside
            self.trunk = Block()  # 2·288 + 2·40 = 656 outside

    plan, msgs = _compile_warnings(Wide())
    assert plan.dedicated == ("layers.0.weight",) and len(msgs) == 1
    assert "most matrix elements are not dedicated: 4 of 5 2-D matrices (98% of their elements" in msgs[0], msgs


# ----------------------------------------------------------------------------------------------
# degenerate matrices
# ----------------------------------------------------------------------------------------------


class Degenerate(nn.Module):
    def __init__(self):
        super().__init__()
        block = nn.Module()
        block.fc = nn.Linear(8, 8)
        block.gate = nn.Linear(8, 1)  # (1, 8): a vector
        block.col = nn.Linear(1, 8, bias=False)  # (8, 1)
        block.depthwise = nn.Conv1d(8, 8, 3, groups=8)  # (8, 1, 3)
        block.pointwise = nn.Conv1d(8, 8, 1)  # (8, 8, 1): an (8, 8) matrix view
        block.layer_scale = nn.Parameter(torch.ones(8, 1, 1))  # C matrices of (1, 1)
        self.layers = nn.ModuleList([block])


def test_degenerate_views_stay_with_adamw():
    from dmuon.plan._model.selection import degenerate_reason
    from dmuon.plan._model.snapshot import take_snapshot

    model = Degenerate()
    assert dmuon.plan.compile(model, 2).dedicated == ("layers.0.fc.weight",)
    pred = dmuon.plan.matrix_predicate(model)
    assert dmuon.plan.compile(model, 2, predicate=pred).dedicated == ("layers.0.fc.weight", "layers.0.pointwise.weight")
    reasons = {r.fqn: degenerate_reason(r) for r in take_snapshot(model).params}
    assert reasons["layers.0.gate.weight"].startswith("matrix view (1, 8) has a side of 1")
    assert reasons["layers.0.col.weight"].startswith("matrix view (8, 1) has a side of 1")
    assert reasons["layers.0.depthwise.weight"].startswith("depthwise conv kernel (8, 1, 3)")
    assert reasons["layers.0.layer_scale"].startswith("matrix view (1, 1) has a side of 1")
    assert reasons["layers.0.fc.weight"] is None and reasons["layers.0.pointwise.weight"] is None
    # a user predicate may still select one (its view is defined): Muon normalises the vector
    plan = dmuon.plan.compile(model, 2, predicate=lambda fqn, p: fqn == "layers.0.gate.weight")
    assert plan.param("layers.0.gate.weight").matrix_shape == (1, 8)


def test_plan_summary_reports_vectors_left_to_adamw():
    plan = dmuon.plan.compile(Degenerate(), 2)
    text = plan.summary()
    assert (
        "left to AdamW inside hook boundaries, a side of 1 (not a matrix for Muon): 2: "
        "layers.0.gate.weight (1, 8), layers.0.col.weight (8, 1)"
    ) in text, text
    from oracle import TinyLM

    assert "left to AdamW inside hook boundaries" not in dmuon.plan.compile(TinyLM(), 2).summary()


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


# ----------------------------------------------------------------------------------------------
# wait_all: a failed wait named for what it is (no process group: fake works)
# ----------------------------------------------------------------------------------------------


class _FakeWork:
    """A ``Work`` whose ``wait`` raises ``exc`` after ``delay_s`` (or returns ``result``)."""

    def __init__(self, exc=None, delay_s=0.0, result=True):
        self.exc, self.delay_s, self.result, self.timeouts = exc, delay_s, result, []

    def wait(self, timeout=None):
        import time

        self.timeouts.append(timeout)
        time.sleep(self.delay_s)
        if self.exc is not None:
            raise self.exc
        return self.result


GLOO_CLOSED = (
    "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
    "[127.0.0.1]:13447. This is typically caused by a remote worker crashing."
)


def test_wait_all_names_a_transport_error_and_chains_the_backend_error():
    from dmuon.exec._comm import collective_calls as C

    exc = RuntimeError(GLOO_CLOSED)
    with pytest.raises(C.CollectiveTransportError) as info:
        C.wait_all(
            [None, _FakeWork(exc)], what="boundary 'layers.0' forward_broadcast", timeout_s=30.0, step=3, forwards=1
        )
    msg = str(info.value)
    assert (
        info.value.__cause__ is exc
        and isinstance(info.value, C.CollectiveError)
        and isinstance(info.value, RuntimeError)
    )
    assert msg.startswith(
        "dmuon: collective for boundary 'layers.0' forward_broadcast failed in the transport after 0.0"
    )
    assert "the backend names the peer [127.0.0.1]:13447 ('Connection closed by peer [127.0.0.1]:13447." in msg, msg
    assert "pair.cc" not in msg and "did not complete within" not in msg and "this is not a timeout" in msg, msg
    assert "3 optimizer step(s) done, 1 grad-enabled forward(s) of this boundary since the last step" in msg, msg
    first, second, third = (
        msg.index(s)
        for s in (
            "1) a rank stopped early or skipped a whole step",
            "2) a rank died",
            "3) a rank-dependent number of micro-batches",
        )
    )
    assert first < second < third, msg
    # the same with no dmuon timeout (the bare wait of before): named the same way
    with pytest.raises(C.CollectiveTransportError, match="failed in the transport"):
        C.wait_all(
            [_FakeWork(RuntimeError("NCCL error: remote process exited or there was a network error"))],
            what="x",
            timeout_s=None,
        )


def test_wait_all_timeouts_stay_timeouts():
    from dmuon.exec._comm import collective_calls as C

    # gloo's wait(timeout) raising "Operation timed out!" after dmuon's timeout
    work = _FakeWork(RuntimeError("Operation timed out!"), delay_s=0.2)
    with pytest.raises(C.CollectiveTimeout) as info:
        C.wait_all([work], what="boundary 'layers.1' reduce", timeout_s=0.2)
    assert (
        "dmuon: collective for boundary 'layers.1' reduce did not complete within 0.2 s (collective_timeout_s)"
        in str(info.value)
    )
    assert work.timeouts[0].total_seconds() == 0.2
    # an error raised after dmuon's timeout whatever its words, and Work.wait returning False
    with pytest.raises(C.CollectiveTimeout, match="did not complete within 0.1 s"):
        C.wait_all([_FakeWork(RuntimeError("some backend failure"), delay_s=0.1)], what="x", timeout_s=0.1)
    with pytest.raises(C.CollectiveTimeout, match="did not complete within 5 s"):
        C.wait_all([_FakeWork(result=False)], what="x", timeout_s=5.0)
    # the process group's own timeout, before dmuon's: a timeout, saying whose
    with pytest.raises(C.CollectiveTimeout) as info:
        C.wait_all(
            [_FakeWork(RuntimeError("[../gloo/pair.cc:1] Timed out waiting 5000ms for recv operation to complete"))],
            what="x",
            timeout_s=600.0,
        )
    assert "did not complete within the process group's timeout" in str(info.value), str(info.value)
    assert not isinstance(info.value, C.CollectiveTransportError)
    # the default: DEFAULT_TIMEOUT_S (600 s); None: the bare wait
    work = _FakeWork()
    C.wait_all([work], what="x")
    C.wait_all([work], what="x", timeout_s=None)
    assert C.DEFAULT_TIMEOUT_S == 600.0 and work.timeouts == [datetime.timedelta(seconds=600.0), None]


def test_blocking_timeout_only_where_the_wait_blocks_the_cpu(monkeypatch):
    import torch.distributed as dist

    from dmuon.exec._comm import collective_calls as C

    assert C.blocking_timeout_s(600.0, torch.device("cpu")) == 600.0
    assert C.blocking_timeout_s(None, torch.device("cpu")) is None
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.delenv("TORCH_NCCL_BLOCKING_WAIT", raising=False)
    monkeypatch.delenv("NCCL_BLOCKING_WAIT", raising=False)
    assert C.blocking_timeout_s(600.0, torch.device("cuda", 0)) is None  # NCCL's non-blocking wait: the watchdog's
    monkeypatch.setenv("TORCH_NCCL_BLOCKING_WAIT", "1")
    assert C.blocking_timeout_s(600.0, torch.device("cuda", 0)) == 600.0
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    monkeypatch.delenv("TORCH_NCCL_BLOCKING_WAIT")
    assert C.blocking_timeout_s(30.0, torch.device("cuda", 0)) == 30.0


def test_wait_report_classifies_backend_messages():
    from dmuon.exec._comm.wait_report import backend_peer, is_timeout

    for text in (
        "Operation timed out!",
        "Application timeout caused pair closure",
        "[Rank 0] Work WorkNCCL(SeqNum=7, OpType=BROADCAST) timed out in blocking wait.",
        "Watchdog caught collective operation timeout: WorkNCCL(SeqNum=7) ran for 600031 milliseconds",
    ):
        assert is_timeout(text, 0.1, 600.0), text
    for text in (
        GLOO_CLOSED,
        "Read error [127.0.0.1]:9629: Connection reset by peer",
        "NCCL error in: ProcessGroupNCCL.cpp:1, remote process exited or there was a network error",
    ):
        assert not is_timeout(text, 0.1, 600.0), text
    assert is_timeout("Connection reset by peer", 599.0, 600.0)  # raised once dmuon's time was up
    assert backend_peer(GLOO_CLOSED) == "[127.0.0.1]:13447"
    assert backend_peer("Read error [127.0.0.1]:9629: Connection reset by peer") == "[127.0.0.1]:9629"
    assert backend_peer("NCCL error: peer rank 3 failed") == "rank 3"
    assert backend_peer("something else") is None


# ----------------------------------------------------------------------------------------------
# edge cases against torch.optim.Muon, the default (bf16) Newton-Schulz on both sides
# ----------------------------------------------------------------------------------------------


def _pair(shapes, seed=0):
    """dmuon.Muon and torch.optim.Muon over copies of the same matrices (default hyper-parameters
    but lr 0.02, weight decay 0.1: the decay shows whether a skipped matrix was touched)."""
    from test_optim_single import tag

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


# ----------------------------------------------------------------------------------------------
# the main job off a terminal: the note in place of the bar
# ----------------------------------------------------------------------------------------------


def test_main_job_notes_no_bar_and_no_plot_off_a_terminal(monkeypatch):
    import io
    import sys

    from dmuon._train import progress

    monkeypatch.setattr(sys, "stderr", io.StringIO())  # not a terminal: no bar, one note
    assert isinstance(progress.progress_bar(total=3), progress._NoBar)
    assert progress.progress_note(log_every=25) == (
        "progress: no bar (stderr is not a terminal), a log line every 25 steps; no plot without --png FILE"
    )
    assert progress.progress_note(png="run.png").endswith("log lines only; the plot goes to run.png")
    assert progress.progress_note(enabled=False) is None  # --quiet: nothing

    class Tty(io.StringIO):
        def isatty(self):
            return True

    monkeypatch.setattr(sys, "stderr", Tty())
    pytest.importorskip("tqdm")
    assert progress.progress_note() is None  # the bar shows: no note
