"""dmuon._update, the Muon update as plain functions: against torch.optim.Muon's
``_single_tensor_muon`` on plain tensors (bit for bit at its own bf16 iteration, and bit for bit
with the fp32 oracle the suite patches in), batched against unbatched (within 1e-5 in fp32, within
the stated bf16 bound), and the batched step's op count (constant per bucket).

Inputs are Gaussian matrices from 5x8 to 96x160, tall, wide and square, a few steps each."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch.optim._muon import _single_tensor_muon

import dmuon
from dmuon import _update as U
from dmuon.testing import fp32_newton_schulz, reference_newton_schulz

MUON = (3.4445, -4.775, 2.0315)
SHAPES = [(36, 8), (8, 36), (5, 8), (8, 5), (16, 16), (36, 8), (8, 36), (16, 16)]
HP = dict(lr=0.02, weight_decay=0.1, momentum=0.95, ns_coefficients=MUON, ns_steps=5, eps=1e-7)


def _tensors(shapes, seed: int = 0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    params = [torch.randn(s, generator=g).to(dtype) for s in shapes]
    bufs = [torch.zeros_like(p) for p in params]
    grads = [[torch.randn(s, generator=g).to(dtype) for s in shapes] for _ in range(3)]
    return params, bufs, grads


def _run(fn, shapes, *, dtype=torch.float32, **kw):
    params, bufs, grads = _tensors(shapes, dtype=dtype)
    for step_grads in grads:
        fn(params, step_grads, bufs, **kw)
    return params, bufs


def _torch(params, grads, bufs, **kw):
    _single_tensor_muon(params, grads, bufs, has_complex=False, **kw)


@pytest.mark.parametrize(
    "nesterov, adjust_lr_fn, dtype",
    [
        (True, None, torch.float32),
        (False, None, torch.float32),
        (True, "match_rms_adamw", torch.float32),
        (False, "original", torch.float32),
        (True, None, torch.bfloat16),
        (True, "match_rms_adamw", torch.bfloat16),
    ],
)
def test_exact_is_single_tensor_muon_bit_for_bit(nesterov, adjust_lr_fn, dtype):
    """``ns_batching="exact"`` at torch's own bf16 iteration: every parameter and momentum buffer
    bit for bit ``_single_tensor_muon``'s after 3 steps (fp32 and bf16 parameters). Not bf16
    parameters without Nesterov: there torch's iteration divides its bf16 input in place, which is
    then the momentum buffer itself (``grad.bfloat16()`` returns it), so torch's buffer is
    normalised by its own step; dmuon never modifies the NS input."""
    kw = dict(HP, nesterov=nesterov, adjust_lr_fn=adjust_lr_fn)
    ref_p, ref_b = _run(_torch, SHAPES, dtype=dtype, **kw)
    ours_p, ours_b = _run(U.single_tensor_muon, SHAPES, dtype=dtype, ns_batching="exact", **kw)
    for a, b in zip(ref_p + ref_b, ours_p + ours_b):
        assert torch.equal(a, b)


def test_exact_fp32_is_the_fp32_oracle_bit_for_bit():
    """With ``ns_dtype=float32``, single matrices: bit for bit torch's Muon patched with the fp32
    iteration (:func:`dmuon.testing.fp32_newton_schulz`, the oracle of the fp32 contract)."""
    kw = dict(HP, nesterov=True, adjust_lr_fn=None)
    with fp32_newton_schulz():
        ref_p, ref_b = _run(_torch, SHAPES, **kw)
    ours_p, ours_b = _run(U.single_tensor_muon, SHAPES, ns_dtype=torch.float32, ns_batching="exact", **kw)
    for a, b in zip(ref_p + ref_b, ours_p + ours_b):
        assert torch.equal(a, b)


def test_batched_fp32_within_1e_5_of_the_oracle():
    """Batched (tall and wide of the same sides share a call): each NS result within 1e-5 of the
    fp32 oracle's per matrix, and the parameters after 3 steps within 1e-5."""
    g = torch.Generator().manual_seed(1)
    mats = [torch.randn(s, generator=g) for s in [(96, 160), (160, 96), (96, 160), (24, 40), (40, 24)]]
    for key in ((96, 160), (24, 40)):
        group = [m for m in mats if tuple(sorted(m.shape)) == key]
        outs = U.orthogonalize_batch([m.unsqueeze(0) for m in group], dtype=torch.float32, coefficients=MUON)
        for m, o in zip(group, outs):
            ref = reference_newton_schulz(m, MUON, 5, 1e-7)
            assert o.squeeze(0).shape == m.shape
            assert (o.squeeze(0) - ref).abs().max().item() <= 1e-5
    kw = dict(HP, nesterov=True, adjust_lr_fn=None)
    with fp32_newton_schulz():
        ref_p, ref_b = _run(_torch, SHAPES, **kw)
    ours_p, ours_b = _run(U.single_tensor_muon, SHAPES, ns_dtype=torch.float32, ns_batching="batched", **kw)
    for a, b in zip(ref_p + ref_b, ours_p + ours_b):
        assert (a - b).abs().max().item() <= 1e-5


def _split_k_newton_schulz(x, parts: int = 2):
    """bf16 NS with every matmul's inner dimension cut in ``parts`` partial products accumulated
    in fp32 and rounded once (a split-K order as a GPU library may pick for a batched call)."""

    def mm(a, b):
        out = sum(a[:, k].float() @ b[k, :].float() for k in torch.tensor_split(torch.arange(a.shape[1]), parts))
        return out.bfloat16()

    X = x.bfloat16()
    tall = X.shape[0] > X.shape[1]
    X = X.T if tall else X
    X = X / X.norm().clamp(min=1e-7)
    a, b, c = MUON
    for _ in range(5):
        A = mm(X, X.T)
        B = (b * A.float() + c * mm(A, A).float()).bfloat16()
        X = (a * X.float() + mm(B, X).float()).bfloat16()
    return X.T if tall else X


def _rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def test_batched_bf16_within_the_stated_bound():
    """The bound of Note: NS batching (docs/design.md): every bf16 evaluation order lies within
    ``2⁻⁵`` of the fp32 iteration (relative Frobenius norm; torch's, the batched one and a split-K
    order, which differs from torch's by 1-3 %), so any two, batched and exact among them, lie
    within ``BATCHED_BF16_REL_BOUND = 2⁻⁴`` of each other."""
    delta = U.BATCHED_BF16_REL_BOUND / 2
    g = torch.Generator().manual_seed(2)
    for shape in [(8, 36), (36, 8), (64, 64), (128, 384)]:
        xs = torch.randn(4, *shape, generator=g)
        batched = U.orthogonalize_batch([xs], dtype=torch.bfloat16, coefficients=MUON)[0]
        for x, o in zip(xs, batched):
            fp32 = reference_newton_schulz(x, MUON, 5, 1e-7)
            exact = U.orthogonalize_each(x, dtype=torch.bfloat16, coefficients=MUON)
            split_k = _split_k_newton_schulz(x)
            for other in (exact, o, split_k):
                assert _rel(other, fp32) <= delta, shape
            assert _rel(o, exact) <= U.BATCHED_BF16_REL_BOUND
            assert 0 < _rel(split_k, exact) <= U.BATCHED_BF16_REL_BOUND  # another order: different, within


#: aten ops that make a view or read metadata: no kernel on any device
VIEW_OPS = {
    "aten::view", "aten::reshape", "aten::_reshape_alias", "aten::transpose", "aten::t", "aten::numpy_T",
    "aten::mT", "aten::split", "aten::split_with_sizes", "aten::unbind", "aten::narrow", "aten::slice",
    "aten::select", "aten::as_strided", "aten::alias", "aten::unsqueeze", "aten::squeeze", "aten::expand",
    "aten::permute", "aten::detach",
}  # fmt: skip


def _kernel_ops(fn) -> int:
    """aten ops dispatched from Python by ``fn`` that run a kernel (top-level, views excluded)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    n = 0
    for e in prof.events():
        parent = e.cpu_parent
        while parent is not None and not parent.name.startswith("aten::"):
            parent = parent.cpu_parent
        if e.name.startswith("aten::") and parent is None and e.name not in VIEW_OPS:
            n += 1
    return n


@pytest.mark.parametrize("ns_dtype", [torch.bfloat16, torch.float32])
def test_batched_step_ops_per_bucket_not_per_matrix(ns_dtype):
    """One step of 4 and of 16 same-shape matrices (tall and wide) launches the same number of
    kernel ops batched; exact launches a fixed number more per extra matrix."""

    def ops(n: int, mode: str) -> int:
        shapes = [(24, 40), (40, 24)] * (n // 2)
        params, bufs, grads = _tensors(shapes)
        kw = dict(HP, nesterov=True, adjust_lr_fn="match_rms_adamw", ns_dtype=ns_dtype, ns_batching=mode)
        U.single_tensor_muon(params, grads[0], bufs, **kw)  # warm-up
        return _kernel_ops(lambda: U.single_tensor_muon(params, grads[1], bufs, **kw))

    batched = [ops(n, "batched") for n in (4, 16)]
    exact = [ops(n, "exact") for n in (4, 16)]
    assert batched[0] == batched[1] <= 40, batched
    assert (exact[1] - exact[0]) % 12 == 0 and exact[1] - exact[0] >= 12 * 15, exact


def test_expert_stack_item_is_one_call_equal_to_its_matrices():
    """A ``(k, m, n)`` item (an expert stack's matrices) is one batched call, equal to the loop
    over its matrices in fp32 within 1e-5; the loop (``"exact"``) is one 2-D call per matrix."""
    g = torch.Generator().manual_seed(3)
    stack = torch.randn(6, 20, 12, generator=g)
    calls = []

    def spy(x, **kw):
        calls.append(tuple(x.shape))
        return U.newton_schulz(x, **kw)

    (batched,) = U.orthogonalize_batch([stack], spy, dtype=torch.float32, coefficients=MUON)
    assert calls == [(6, 12, 20)] and batched.shape == stack.shape
    calls.clear()
    looped = U.orthogonalize_each(stack, spy, dtype=torch.float32, coefficients=MUON)
    assert calls == [(20, 12)] * 6
    assert (batched - looped).abs().max().item() <= 1e-5


def test_bucket_runs_and_bad_mode():
    keys = ["a", "b", "a", "a", "b"]

    def entries(runs):  # the item indices of each run
        return [[p.entry for p in run] for run in runs]

    assert entries(U.bucket_runs(keys, [1] * 5, "exact")) == [[0], [1], [2], [3], [4]]
    assert entries(U.bucket_runs(keys, [1] * 5, "batched")) == [[0, 2, 3], [1, 4]]
    big = dmuon.plan._rules.NS_BATCH_MAX_NUMEL
    assert entries(U.bucket_runs(keys, [big, 1, 1, 1, 1], "batched")) == [[0], [2, 3], [1, 4]]
    # item 0, an expert range of 4 units (experts) of u > big / 2 elements: one unit per run; item 2
    # (1 element) joins its last piece, item 3 (big) does not fit beside it
    u = big // 2 + 2
    runs = U.bucket_runs(keys, [4 * u, 1, 1, big, 1], "batched", [u, 1, 1, big, 1])
    assert runs == [[(0, 0, 1)], [(0, 1, 2)], [(0, 2, 3)], [(0, 3, 4), (2, 0, 1)], [(3, 0, 1)], [(1, 0, 1), (4, 0, 1)]]
    # units of exactly big / 2: two per run; "exact" cuts an item the same way, alone
    assert U.bucket_runs(["a"], [5 * (big // 2)], "batched", [big // 2]) == [[(0, 0, 2)], [(0, 2, 4)], [(0, 4, 5)]]
    assert U.bucket_runs(["a", "a"], [3 * big, 1], "exact", [big, 1]) == [
        [(0, 0, 1)],
        [(0, 1, 2)],
        [(0, 2, 3)],
        [(1, 0, 1)],
    ]
    with pytest.raises(ValueError, match="a unit of 3 elements does not divide its 10"):
        U.bucket_runs(["a"], [10], "batched", [3])
    with pytest.raises(ValueError, match=r"ns_batching must be one of \('batched', 'exact'\), got 'fast'"):
        dmuon.Muon(torch.nn.Linear(4, 4), ns_batching="fast")


def test_calibration_imports_the_functions_not_the_runtime():
    """The simulator's calibration times the update's plain functions (``dmuon._update``,
    ``dmuon._ns_gram``), which import neither the runtime nor the simulator."""
    from test_import_graph import PKG, imports_of

    calibration = {m for _, m in imports_of(PKG / "sim" / "_calibrate" / "compute.py")}
    assert {"dmuon._update", "dmuon._ns_gram"} <= calibration
    assert not {m for m in calibration if m.startswith("dmuon.exec")}
    for name in ("_update.py", "_ns_gram.py"):
        assert not [m for _, m in imports_of(PKG / name) if m.startswith(("dmuon.exec", "dmuon.sim"))], name


def test_staged_runs_double_buffered_and_bit_identical(monkeypatch):
    """``muon_update(stage=offload_stage.staged_runs(device))``, the offloaded step, on the CPU: each
    run computes on copies of its own (never the host tensors), run ``i + 1`` is uploaded before run
    ``i`` computes and run ``i`` written back before run ``i + 2`` is uploaded (at most two runs on
    the device), and the host tensors end bit-identical to the in-place update."""
    from dmuon.exec._optim import offload_stage as S

    shapes = [(36, 8), (16, 16), (5, 8), (12, 40)]  # distinct (short, long) sides: four runs
    kw = dict(lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True, adjust_lr_fn=None)
    kw.update(coefficients=MUON, steps=5, eps=1e-7, dtype=torch.float32)
    (p_ref, b_ref, grads), (p_off, b_off, _) = _tensors(shapes), _tensors(shapes)
    events, computed = [], []
    upload, write_back, apply = S._upload, S._write_back, U.decay_and_apply_

    alive = []  # per upload: the earlier runs whose device copies are still referenced

    def spy_upload(group, device, stream):
        events.append(("up", [tuple(it.param.shape) for it in group]))
        gc.collect()
        alive.append(sum(any(r() is not None for r in run) for run in copies))
        dev, event = upload(group, device, stream)
        copies.append([weakref.ref(getattr(it, f)) for it in dev for f in ("param", "grad", "buf")])
        return dev, event

    def spy_write_back(host, dev, device, stream):
        events.append(("back", [tuple(it.param.shape) for it in host]))
        return write_back(host, dev, device, stream)

    def spy_apply(params, updates, **k):
        events.append(("compute", [tuple(p.shape) for p in params]))
        computed.extend(p.untyped_storage().data_ptr() for p in params)
        return apply(params, updates, **k)

    monkeypatch.setattr(S, "_upload", spy_upload)
    monkeypatch.setattr(S, "_write_back", spy_write_back)
    for step, g in enumerate(grads):
        copies = []
        refs = [U.Matrices(param=p, grad=x, buf=b, matrix_shape=tuple(p.shape)) for p, x, b in zip(p_ref, g, b_ref)]
        U.muon_update(refs, **kw)
        items = [U.Matrices(param=p, grad=x, buf=b, matrix_shape=tuple(p.shape)) for p, x, b in zip(p_off, g, b_off)]
        monkeypatch.setattr(U, "decay_and_apply_", spy_apply)
        U.muon_update(items, **kw, stage=S.staged_runs(torch.device("cpu")))
        monkeypatch.setattr(U, "decay_and_apply_", apply)
        if step == 0:
            order = list(events)
            r = [[s] for s in shapes]
            assert order == [
                ("up", r[0]), ("up", r[1]), ("compute", r[0]), ("back", r[0]),
                ("up", r[2]), ("compute", r[1]), ("back", r[1]),
                ("up", r[3]), ("compute", r[2]), ("back", r[2]),
                ("compute", r[3]), ("back", r[3]),
            ], order  # fmt: skip
    # while run i + 1 is uploaded, only run i's copies are alive (run i - 1's released): two runs on
    # the device at a time, as the memory model counts (rank_memory.OFFLOAD_RUNS_IN_FLIGHT)
    assert alive == [0, 1, 1, 1] * len(grads), alive
    host = {t.untyped_storage().data_ptr() for t in p_off + b_off}
    assert len(computed) == len(shapes) * len(grads) and not host & set(computed)  # updates on copies
    for a, b in zip(p_off + b_off, p_ref + b_ref):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_expert_range_cut_into_runs_of_whole_experts(monkeypatch, dtype):
    """An item with units (an expert range: ``unit_matrices`` matrices per expert, dim 0 of its
    tensors) larger than ``NS_BATCH_MAX_NUMEL`` runs in pieces of whole experts, offloaded or not:
    with a cap of 400 elements, a dense (8, 12) matrix A (96), a 6-expert gate/up stack (12 matrices
    (8, 12), 192 elements per expert) and a dense B of the same bucket run as A | experts 0-1 |
    2-3 | 4-5 | B (96, 384, 384, 384, 96 elements copied per run: none above the cap). The
    offloaded step ends bit-identical to the in-place one (the same runs), and both equal the
    uncut step (cap 2**26: one run of all three), the per-matrix Newton-Schulz being the same
    whatever else shares its batch (NS dtype ``dtype``)."""
    from dmuon.exec._optim import offload_stage as S
    from dmuon.plan import _rules

    shapes = [(8, 12), (6, 16, 12), (8, 12)]
    kw = dict(lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True, adjust_lr_fn=None)
    kw.update(coefficients=MUON, steps=5, eps=1e-7, dtype=dtype)

    def items(params, grads, bufs):
        return [
            U.Matrices(param=p, grad=g, buf=b, matrix_shape=(8, 12), num_matrices=p.numel() // 96, unit_matrices=2)
            if p.ndim == 3
            else U.Matrices(param=p, grad=g, buf=b, matrix_shape=(8, 12))
            for p, g, b in zip(params, grads, bufs)
        ]

    uploaded = []
    upload = S._upload

    def spy_upload(group, device, stream):
        uploaded.append([it.param.numel() for it in group])
        return upload(group, device, stream)

    monkeypatch.setattr(S, "_upload", spy_upload)
    (p_whole, b_whole, grads), (p_in, b_in, _), (p_off, b_off, _) = (_tensors(shapes) for _ in range(3))
    for g in grads:
        U.muon_update(items(p_whole, g, b_whole), **kw)  # the default cap: one run
    monkeypatch.setattr(_rules, "NS_BATCH_MAX_NUMEL", 400)
    for g in grads:
        U.muon_update(items(p_in, g, b_in), **kw)
        U.muon_update(items(p_off, g, b_off), **kw, stage=S.staged_runs(torch.device("cpu")))
    assert uploaded == [[96], [384], [384], [384], [96]] * len(grads), uploaded
    for a, b, c in zip(p_off + b_off, p_in + b_in, p_whole + b_whole):
        assert torch.equal(a, b)
        assert torch.equal(b, c)
