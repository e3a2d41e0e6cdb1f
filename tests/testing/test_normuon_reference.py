"""The NorMuon reference (:mod:`dmuon.testing._normuon_reference`) against values computed by hand on small
matrices, its invariants (Frobenius norm kept, rows equalised at the first step, a bias
correction would cancel, batches are per matrix), the owner-group / TP block form with one
all-reduce against the whole matrix, and the reference's Newton-Schulz against torch's."""

from __future__ import annotations

import math
import pytest
import torch

import dmuon.testing._normuon_reference as R

f64 = torch.float64


def test_normalize_2x3_two_steps_by_hand():
    # Step 1. O1 = [[3, 0, 4], [0, 1, 0]] (2 x 3, rows = output neurons), v0 = 0,
    # beta2 = 0.75 (so 1 - beta2 = 1/4 is exact), eps = 0 (no zero row here).
    #   row mean squares s1 = [(9 + 16)/3, 1/3] = [25/3, 1/3]
    #   v1 = 0.75*0 + 0.25*s1 = [25/12, 1/12];  sqrt(v1) = [5, 1] / (2*sqrt(3))
    #   Ô = O1 / sqrt(v1): row0 = [3, 0, 4] * 2*sqrt(3)/5, row1 = [0, 1, 0] * 2*sqrt(3)
    #   ‖O1‖² = 25 + 1 = 26;  ‖Ô‖² = 25 * 12/25 + 12 = 24
    #   U1 = Ô * sqrt(26/24):  row0 = [3, 0, 4] * sqrt(13)/5,  row1 = [0, sqrt(13), 0]
    #   (both rows now have norm sqrt(13); total norm² 13 + 13 = 26 = ‖O1‖²)
    o1 = torch.tensor([[3.0, 0.0, 4.0], [0.0, 1.0, 0.0]], dtype=f64)
    u1, v1 = R.normuon_normalize(o1, None, beta2=0.75, eps=0.0, dtype=f64)
    r13 = math.sqrt(13)
    torch.testing.assert_close(v1, torch.tensor([25 / 12, 1 / 12], dtype=f64), rtol=1e-15, atol=0)
    want1 = torch.tensor([[3 * r13 / 5, 0.0, 4 * r13 / 5], [0.0, r13, 0.0]], dtype=f64)
    torch.testing.assert_close(u1, want1, rtol=1e-14, atol=1e-15)

    # Step 2. O2 = rows swapped = [[0, 1, 0], [3, 0, 4]], v1 from step 1:
    #   s2 = [1/3, 25/3]
    #   v2 = 0.75*[25/12, 1/12] + 0.25*[1/3, 25/3] = [75/48 + 4/48, 3/48 + 100/48] = [79/48, 103/48]
    #   Ô: row0 = [0, 1, 0] * sqrt(48/79), row1 = [3, 0, 4] * sqrt(48/103)
    #   ‖Ô‖² = 48/79 + 25*48/103 = 48 * (103 + 1975) / (79*103) = 48 * 2078 / 8137
    #   row0 scale: sqrt(48/79) * sqrt(26) / sqrt(48*2078/8137) = sqrt(26*103/2078) = sqrt(1339/1039)
    #   row1 scale: sqrt(48/103) * sqrt(26) / sqrt(48*2078/8137) = sqrt(26*79/2078) = sqrt(1027/1039)
    #   check: 1339/1039 + 25*1027/1039 = 27014/1039 = 26 = ‖O2‖²
    o2 = torch.tensor([[0.0, 1.0, 0.0], [3.0, 0.0, 4.0]], dtype=f64)
    u2, v2 = R.normuon_normalize(o2, v1, beta2=0.75, eps=0.0, dtype=f64)
    torch.testing.assert_close(v2, torch.tensor([79 / 48, 103 / 48], dtype=f64), rtol=1e-15, atol=0)
    a, b = math.sqrt(1339 / 1039), math.sqrt(1027 / 1039)
    want2 = torch.tensor([[0.0, a, 0.0], [3 * b, 0.0, 4 * b]], dtype=f64)
    torch.testing.assert_close(u2, want2, rtol=1e-14, atol=1e-15)
    # inputs untouched (pure function)
    assert torch.equal(v1, torch.tensor([25 / 12, 1 / 12], dtype=f64))


def test_full_step_3x2_by_hand():
    # A tall (out=3, in=2) matrix whose polar factor is known exactly:
    #   Q = [[0.6, 0], [0.8, 0], [0, 1]] (orthonormal columns), G = Q·diag(2, 1)
    #     = [[1.2, 0], [1.6, 0], [0, 1]].
    # momentum = 0.5, Nesterov, buffer 0:  buf = 0.lerp(G, 0.5) = G/2;  NS input = G.lerp(buf, 0.5)
    #   = G/2 + G/4 = 0.75·G (checked inside the injected "NS", which returns Q).
    # NorMuon, beta2 = 0.75, v0 = 0:  s = [0.36/2, 0.64/2, 1/2] = [0.18, 0.32, 0.5]
    #   v = s/4 = [0.045, 0.08, 0.125];  sqrt(v) = sqrt(2)·[0.15, 0.2, 0.25]
    #   Ô = [[0.6/(0.15√2), 0], [0.8/(0.2√2), 0], [0, 1/(0.25√2)]] = 2√2·[[1, 0], [1, 0], [0, 1]]
    #   ‖Q‖² = 2, ‖Ô‖² = 3·8 = 24  ->  U = Ô·sqrt(2/24) = sqrt(2/3)·[[1, 0], [1, 0], [0, 1]]
    # Update: lr = 0.1, weight_decay = 0.5, adjust_lr "original": sqrt(max(1, 3/2)) = sqrt(1.5)
    #   W1 = W0·(1 - 0.1·0.5) - 0.1·sqrt(1.5)·U = 0.95·W0 - 0.1·[[1, 0], [1, 0], [0, 1]]
    #   (sqrt(1.5)·sqrt(2/3) = 1), with W0 = ones: [[0.85, 0.95], [0.85, 0.95], [0.95, 0.85]].
    Q = torch.tensor([[0.6, 0.0], [0.8, 0.0], [0.0, 1.0]], dtype=f64)
    G = Q @ torch.diag(torch.tensor([2.0, 1.0], dtype=f64))
    seen = []

    def fake_ns(x):
        seen.append(x.clone())
        return Q

    W0 = torch.ones(3, 2, dtype=f64)
    W1, buf, v = R.normuon_step(
        W0,
        G,
        None,
        None,
        lr=0.1,
        weight_decay=0.5,
        momentum=0.5,
        nesterov=True,
        beta2=0.75,
        eps=1e-10,
        orthogonalize=fake_ns,
    )
    torch.testing.assert_close(seen[0], 0.75 * G, rtol=1e-15, atol=0)
    torch.testing.assert_close(buf, 0.5 * G, rtol=1e-15, atol=0)
    # v is fp32 (normalisation dtype): [0.045, 0.08, 0.125]
    torch.testing.assert_close(v, torch.tensor([0.045, 0.08, 0.125]), rtol=1e-6, atol=0)
    want = torch.tensor([[0.85, 0.95], [0.85, 0.95], [0.95, 0.85]], dtype=f64)
    torch.testing.assert_close(W1, want, rtol=0, atol=1e-7)  # fp32 normalisation + eps = 1e-10
    assert torch.equal(W0, torch.ones(3, 2, dtype=f64))


def test_zero_update_and_zero_rows_are_finite():
    # All-zero O: s = 0, v = 0, Ô = 0/(0 + eps) = 0, rescale 0/(0 + eps) = 0: no NaN.
    u, v = R.normuon_normalize(torch.zeros(4, 5), None)
    assert torch.equal(u, torch.zeros(4, 5)) and torch.equal(v, torch.zeros(4))
    # A dead row stays exactly zero and the others are rescaled to the whole norm.
    o = torch.tensor([[1.0, 2.0], [0.0, 0.0]])
    u, _ = R.normuon_normalize(o, None)
    assert torch.equal(u[1], torch.zeros(2))
    torch.testing.assert_close(u.norm(), o.norm())


def test_bias_correction_would_cancel():
    # Bias correction divides the new v by c = 1 - beta2^t, the same constant for every row:
    # Ô changes by sqrt(c) uniformly and the Frobenius rescale undoes it (only eps can tell).
    g = torch.Generator().manual_seed(0)
    o = torch.randn(6, 9, generator=g, dtype=f64)
    v = torch.rand(6, generator=g, dtype=f64)
    u, v_new = R.normuon_normalize(o, v, eps=0.0, dtype=f64)
    v_hat = v_new / (1 - 0.95**3)  # bias-corrected at t = 3
    u_bc = o / v_hat.sqrt().unsqueeze(-1)
    u_bc = u_bc * (o.norm() / u_bc.norm())
    torch.testing.assert_close(u_bc, u, rtol=1e-13, atol=1e-14)


def test_frobenius_norm_preserved_and_rows_equalised_at_first_step():
    # At step 1 (v0 = 0) every row of Ô gets the same norm: ‖O‖_F / sqrt(out).
    g = torch.Generator().manual_seed(1)
    o = torch.randn(5, 7, generator=g, dtype=f64)
    u, _ = R.normuon_normalize(o, None, eps=0.0, dtype=f64)
    torch.testing.assert_close(u.norm(), o.norm())
    torch.testing.assert_close(u.norm(dim=1), torch.full((5,), float(o.norm() / math.sqrt(5)), dtype=f64))


def test_batch_is_per_matrix():
    # A (k, out, in) stack (experts, view blocks): each matrix its own v rows and rescale.
    g = torch.Generator().manual_seed(2)
    o = torch.randn(3, 4, 6, generator=g)
    v = torch.rand(3, 4, generator=g)
    ub, vb = R.normuon_normalize(o, v)
    for i in range(3):
        ui, vi = R.normuon_normalize(o[i], v[i])
        assert torch.equal(ub[i], ui) and torch.equal(vb[i], vi)


@pytest.mark.parametrize("dim", [0, 1])
def test_blocks_with_one_all_reduce_match_whole_matrix(dim):
    # Owner group / TP split: the fused one-all-reduce form equals the unsplit computation.
    g = torch.Generator().manual_seed(3)
    o = torch.randn(12, 20, generator=g)
    v = torch.rand(12, generator=g) * 0.1
    u, v_new = R.normuon_normalize(o, v)
    sizes = [4, 5, 3] if dim == 0 else [7, 7, 6]
    blocks = list(o.split(sizes, dim=dim))
    calls = []

    def all_reduce_sum(parts):
        calls.append(parts[0].numel())
        return torch.stack(parts).sum(0)

    ub, vb = R.normuon_normalize_blocks(blocks, dim, v, all_reduce_sum=all_reduce_sum)
    assert calls == ([2] if dim == 0 else [12])  # 2 scalars, or `out` row sums
    torch.testing.assert_close(torch.cat(ub, dim=dim), u, rtol=2e-6, atol=1e-7)
    torch.testing.assert_close(vb, v_new, rtol=2e-6, atol=0)


def test_none_grad_skip_and_zeros():
    p = torch.ones(2, 3)
    buf = torch.full((2, 3), 0.5)
    v = torch.full((2,), 0.1)
    out = R.normuon_step(p, None, buf, v, lr=0.1, weight_decay=0.5)
    assert out[0] is p and out[1] is buf and out[2] is v  # torch / dmuon: untouched
    p2, buf2, v2 = R.normuon_step(p, None, buf, v, lr=0.1, weight_decay=0.5, none_grad="zeros")
    torch.testing.assert_close(buf2, buf * 0.95)  # momentum decays towards the zero gradient
    assert not torch.equal(p2, p)  # a step from the momentum, but no weight decay:
    p3, _, _ = R.normuon_step(p, torch.zeros(2, 3), buf, v, lr=0.1, weight_decay=0.0)
    torch.testing.assert_close(p2, p3)


def test_ns_matches_torch_bf16_bitwise():
    # The reference NS is torch.optim.Muon's iteration (bf16, 2-D): bit-identical.
    from torch.optim._muon import _zeropower_via_newtonschulz as torch_ns

    g = torch.Generator().manual_seed(4)
    for shape in [(8, 16), (16, 8)]:
        x = torch.randn(*shape, generator=g)
        want = torch_ns(x.clone(), R.MUON_COEFFICIENTS, 5, 1e-7)
        got = R.newton_schulz(x, R.MUON_COEFFICIENTS, 5, 1e-7, torch.bfloat16)
        assert torch.equal(got, want)


def test_fp32_ns_step_runs_and_shapes():
    g = torch.Generator().manual_seed(5)
    p = torch.randn(3, 8, 4, generator=g)  # 3 experts of (out=8, in=4)
    grad = torch.randn(3, 8, 4, generator=g)
    p1, buf, v = R.normuon_step(p, grad, None, None, lr=0.02, ns_dtype=torch.float32)
    assert p1.shape == p.shape and buf.shape == p.shape and v.shape == (3, 8) and v.dtype == torch.float32
    assert torch.isfinite(p1).all()
    p2, _, v2 = R.normuon_step(p1, grad, buf, v, lr=0.02, ns_coefficients=R.DEEPSEEK_V4_COEFFICIENTS, ns_steps=10)
    assert torch.isfinite(p2).all() and v2.shape == (3, 8)
    with pytest.raises(ValueError):
        R.normuon_step(p, grad, None, None, lr=0.02, ns_coefficients=R.DEEPSEEK_V4_COEFFICIENTS, ns_steps=5)
