"""dmuon.exec.newton_schulz: bit-identity with torch, batching, presets, counter, FLOPs.

Tolerances used here:
- 2-D, dtype=bf16: bit-identical to ``torch.optim._muon._zeropower_via_newtonschulz``.
- batched vs loop, fp32: <= 1e-5 absolute (outputs are O(1)); only the norm and bmm-vs-mm
  reduction order differ (observed up to ~2e-6: fp32 ulp ~1e-7, amplified by the iteration's
  slope, ~3.4 per step near zero).
- batched vs loop, bf16: <= 4e-2 absolute, i.e. a few bf16 ulps at magnitude ~1-2 (ulp 2^-7
  = 7.8e-3 in [1, 2)) compounded over 5 steps; on common CPU builds the results are equal.
- fp32 vs a float64 reference polynomial: <= 2e-5 of the reference's largest magnitude
  (measured ~2e-6 for these shapes).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.optim._muon import _zeropower_via_newtonschulz as torch_ns
from torch.utils.flop_counter import FlopCounterMode

import dmuon.exec.newton_schulz as ns_mod
from dmuon.exec.newton_schulz import (
    NS_PRESETS,
    coefficient_schedule,
    newton_schulz,
    ns_flops,
    reset_ns_calls,
)

MUON = (3.4445, -4.775, 2.0315)
SHAPES = [(16, 16), (36, 16), (5, 8), (1, 33), (33, 1), (64, 48), (7, 7)]


@pytest.fixture(autouse=True, scope="module")
def _single_thread():
    """Tiny matrices gain nothing from intra-op threads, and on a loaded CI box OpenMP
    barriers turn each small matmul into a scheduler quantum; both sides run alike anyway."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _randn(*shape, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=dtype)


def _ref64(x: torch.Tensor, schedule, eps: float = 1e-7) -> torch.Tensor:
    """Independent float64 formulation: X <- aX + b(XXᵀ)X + c(XXᵀ)²X on the wide orientation."""
    X = x.double()
    tall = X.shape[-2] > X.shape[-1]
    if tall:
        X = X.mT
    X = X / torch.linalg.vector_norm(X, dim=(-2, -1), keepdim=True).clamp(min=eps)
    for a, b, c in schedule:
        G = X @ X.mT
        GX = G @ X
        X = a * X + b * GX + c * (G @ GX)
    return X.mT if tall else X


@pytest.mark.parametrize("shape", SHAPES)
def test_bit_identical_to_torch_bf16(shape):
    x = _randn(*shape, seed=sum(shape))
    expected = torch_ns(x, MUON, 5, 1e-7)
    got = newton_schulz(x)
    assert got.dtype == torch.bfloat16 and got.shape == x.shape
    assert torch.equal(got, expected)
    assert got.stride() == expected.stride()  # same layout, incl. the transposed view


@pytest.mark.parametrize("steps", [0, 1, 3, 7])
@pytest.mark.parametrize("eps", [1e-7, 1e-3])
def test_bit_identical_to_torch_other_steps_and_eps(steps, eps):
    x = _randn(24, 40, seed=steps)
    assert torch.equal(newton_schulz(x, steps=steps, eps=eps), torch_ns(x, MUON, steps, eps))


def test_bf16_input_is_not_mutated_and_still_bit_identical():
    x = _randn(36, 16, seed=3).bfloat16()
    x_before = x.clone()
    expected = torch_ns(x.clone(), MUON, 5, 1e-7)  # torch divides its bf16 input in place
    got = newton_schulz(x)
    assert torch.equal(got, expected)
    assert torch.equal(x, x_before)


def test_fp32_input_not_mutated_in_fp32_mode():
    x = _randn(8, 12, seed=4)
    x_before = x.clone()
    newton_schulz(x, dtype=torch.float32)
    assert torch.equal(x, x_before)


@pytest.mark.parametrize("shape", [(4, 36, 16), (3, 5, 8), (2, 16, 16), (5, 1, 9)])
def test_batched_equals_loop(shape):
    x = _randn(*shape, seed=7)
    x[0] *= 1e3  # per-matrix normalisation: a large matrix must not shrink the others
    for dtype, atol in ((torch.float32, 1e-5), (torch.bfloat16, 4e-2)):
        batched = newton_schulz(x, dtype=dtype)
        looped = torch.stack([newton_schulz(m, dtype=dtype) for m in x])
        assert batched.dtype == dtype and batched.shape == x.shape
        torch.testing.assert_close(batched.float(), looped.float(), rtol=0, atol=atol)


def test_extra_leading_dims_flatten_and_restore():
    x = _randn(2, 3, 10, 6, seed=8)
    y = newton_schulz(x, dtype=torch.float32)
    assert y.shape == x.shape
    torch.testing.assert_close(y[1, 2], newton_schulz(x[1, 2], dtype=torch.float32), rtol=0, atol=1e-5)


@settings(max_examples=25, deadline=None, database=None)
@given(
    b=st.integers(1, 4),
    m=st.integers(1, 24),
    n=st.integers(1, 24),
    seed=st.integers(0, 2**16),
)
def test_batched_equals_loop_property(b, m, n, seed):
    x = _randn(b, m, n, seed=seed)
    batched = newton_schulz(x, dtype=torch.float32)
    looped = torch.stack([newton_schulz(t, dtype=torch.float32) for t in x])
    torch.testing.assert_close(batched, looped, rtol=0, atol=1e-5)


@pytest.mark.parametrize("shape", [(16, 16), (36, 16), (3, 5, 8)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_zero_input_maps_to_zeros(shape, dtype):
    y = newton_schulz(torch.zeros(shape), dtype=dtype)
    assert torch.isfinite(y).all() and not y.any()


def test_zero_matrix_inside_a_batch_stays_zero_and_others_unaffected():
    x = _randn(3, 12, 20, seed=9)
    x[1] = 0
    y = newton_schulz(x, dtype=torch.float32)
    assert not y[1].any()
    torch.testing.assert_close(y[0], newton_schulz(x[0], dtype=torch.float32), rtol=0, atol=1e-5)


def test_per_step_table_of_repeated_triple_equals_triple():
    x = _randn(36, 16, seed=10)
    for dtype in (torch.bfloat16, torch.float32):
        a = newton_schulz(x, coefficients=MUON, steps=5, dtype=dtype)
        b = newton_schulz(x, coefficients=[MUON] * 5, steps=5, dtype=dtype)
        c = newton_schulz(x, coefficients="muon", steps=5, dtype=dtype)
        assert torch.equal(a, b) and torch.equal(a, c)


def test_per_step_table_applies_each_triple_in_order():
    table = ((4.0, -5.0, 2.0), (3.4445, -4.775, 2.0315), (1.875, -1.25, 0.375))
    x = _randn(20, 12, seed=11)
    got = newton_schulz(x, coefficients=table, steps=3, dtype=torch.float64)
    torch.testing.assert_close(got, _ref64(x, table), rtol=0, atol=1e-12)
    reversed_ = newton_schulz(x, coefficients=table[::-1], steps=3, dtype=torch.float64)
    assert (reversed_ - got).abs().max() > 1e-3  # order matters, so the table is honoured


@pytest.mark.parametrize("shape", [(64, 64), (36, 16), (5, 8), (1, 33), (200, 50), (3, 36, 16)])
def test_fp32_matches_float64_reference_polynomial(shape):
    x = _randn(*shape, seed=12)
    got = newton_schulz(x, dtype=torch.float32)
    ref = _ref64(x, [MUON] * 5)
    assert got.dtype == torch.float32
    assert ((got.double() - ref).abs().max() / ref.abs().max()).item() < 2e-5


def test_orthogonalises_with_a_convergent_schedule():
    # The cubic (1.5, -0.5, 0) iteration converges to the polar factor (all singular values 1).
    x = _randn(40, 20, seed=13, dtype=torch.float64)
    y = newton_schulz(x, coefficients=(1.5, -0.5, 0.0), steps=60, dtype=torch.float64)
    torch.testing.assert_close(y.T @ y, torch.eye(20, dtype=torch.float64), rtol=0, atol=1e-9)
    u, _, vh = torch.linalg.svd(x, full_matrices=False)
    torch.testing.assert_close(y, u @ vh, rtol=0, atol=1e-9)


def test_muon_preset_singular_values_band():
    # Jordan et al.: the "muon" quintic leaves singular values roughly in [0.7, 1.2].
    x = _randn(128, 64, seed=14)
    sv = torch.linalg.svdvals(newton_schulz(x, dtype=torch.float32).double())
    assert 0.6 < sv.min().item() and sv.max().item() < 1.25


def test_presets_table():
    assert NS_PRESETS["muon"] == (3.4445, -4.775, 2.0315)
    assert coefficient_schedule("muon", 2) == (MUON, MUON)
    assert coefficient_schedule([MUON, (1.0, 2.0, 3.0)], 2) == (MUON, (1.0, 2.0, 3.0))
    assert coefficient_schedule(MUON, 0) == ()


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(coefficients="nope"), "unknown Newton-Schulz preset"),
        (dict(coefficients=(1.0, 2.0)), "triple"),
        (dict(coefficients=[MUON] * 4, steps=5), "4 triples but steps=5"),
        (dict(coefficients=[MUON, (1.0, 2.0)], steps=2), "not triples"),
        (dict(steps=100), "steps < 100"),
        (dict(steps=-1), "0 <= steps"),
    ],
)
def test_bad_arguments_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        newton_schulz(torch.ones(3, 4), **kwargs)


def test_non_matrix_and_complex_raise():
    with pytest.raises(ValueError, match="matrix"):
        newton_schulz(torch.ones(5))
    with pytest.raises(ValueError, match="real"):
        newton_schulz(torch.ones(3, 3, dtype=torch.complex64), dtype=torch.float32)
    with pytest.raises(TypeError, match="int"):
        newton_schulz(torch.ones(3, 3), steps=5.0)


def test_ns_calls_counts_matrices():
    reset_ns_calls()
    newton_schulz(_randn(8, 4))
    assert ns_mod.NS_CALLS == 1
    newton_schulz(_randn(3, 8, 4))
    assert ns_mod.NS_CALLS == 4
    newton_schulz(_randn(2, 3, 8, 4), dtype=torch.float32)
    assert ns_mod.NS_CALLS == 10
    assert reset_ns_calls() == 10
    assert ns_mod.NS_CALLS == 0


def test_ns_flops_hand_checked():
    # per step 4·d²·D + 2·d³ with d = min, D = max
    assert ns_flops(2, 3, 1) == 4 * 4 * 3 + 2 * 8 == 64
    assert ns_flops(3, 2, 1) == 64  # orientation does not matter
    assert ns_flops(4, 4, 5) == 5 * (4 * 64 + 2 * 64) == 1920
    assert ns_flops(1024, 4096, 5) == 5 * (4 * 1024**2 * 4096 + 2 * 1024**3)
    assert ns_flops(36, 16, 5, num_matrices=8) == 8 * ns_flops(16, 36, 5)
    assert ns_flops(7, 9, 0) == 0
    with pytest.raises(ValueError):
        ns_flops(-1, 3, 5)


@pytest.mark.parametrize("shape", [(36, 16), (5, 8), (16, 16), (4, 12, 20)])
def test_ns_flops_matches_flop_counter(shape):
    x = _randn(*shape)
    with FlopCounterMode(display=False) as counter:
        newton_schulz(x, dtype=torch.float32, steps=3)
    batch = shape[0] if len(shape) == 3 else 1
    assert counter.get_total_flops() == ns_flops(shape[-2], shape[-1], 3, num_matrices=batch)
