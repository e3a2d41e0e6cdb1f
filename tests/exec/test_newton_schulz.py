"""dmuon._update (the standard kernel, coefficients) / ns_gram / ns_backends: bit-identity with torch, batching, presets, counter, FLOPs.

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

import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.optim._muon import _zeropower_via_newtonschulz as torch_ns
from torch.utils.flop_counter import FlopCounterMode

import dmuon.exec._optim.ns_backends as ns_mod
from dmuon._update import NS_PRESETS, coefficient_schedule
from dmuon._update import newton_schulz
from dmuon.plan._cost.flops import ns_flops
from ns_spy import spy_ns
from oracle import _ns_fp32
from test_optim_single import EPS, _three

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


def test_ns_calls_counts_matrices(monkeypatch):
    # the module keeps no counters; the tests' spy (tests/ns_spy.py) counts matrices per call
    assert not {"NS_CALLS", "GRAM_FALLBACKS", "reset_ns_calls"} & set(vars(ns_mod))
    calls = spy_ns(monkeypatch)
    ns_mod.newton_schulz(_randn(8, 4))
    assert calls.matrices == 1
    ns_mod.newton_schulz(_randn(3, 8, 4))
    assert calls.matrices == 4
    ns_mod.newton_schulz(_randn(2, 3, 8, 4), dtype=torch.float32)
    assert calls.matrices == 10
    assert calls.reset() == 10
    assert calls.matrices == 0


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


# ---------------------------------------------------------------------------------------------
# Polar Express preset, Gram Newton-Schulz, backends
#
# Tolerances:
# - Gram vs standard NS in float64: <= 1e-12 of the result's largest magnitude (measured
#   <= ~2e-14 on these shapes; Gram NS is the same polynomial, only the op order differs).
# - Gram vs standard in float32: <= 1e-4 absolute (outputs O(1); measured ~1e-5).
# - polar_express preset vs an independent float64 transcription of the reference
#   PolarExpress (normalisation by 1.01·‖X‖_F, safety-scaled table): <= 1e-12.
# ---------------------------------------------------------------------------------------------

from dmuon.exec._optim.ns_backends import NS_BACKENDS, get_ns_backend  # noqa: E402
from dmuon._update import (  # noqa: E402
    POLAR_EXPRESS_PUBLISHED,
    POLAR_EXPRESS_SAFETY,
    schedule_gain_bounds,
)
from dmuon._ns_gram import (  # noqa: E402
    gram_newton_schulz,
    gram_ns_flops,
    gram_ns_from_gram,
    gram_segments,
)


def _polar_express_reference64(x: torch.Tensor, steps: int) -> torch.Tensor:
    """The reference algorithm, transcribed independently (float64, no +1e-7 in the norm):
    X / (1.01·‖X‖_F), then the published table with (a/1.01, b/1.01³, c/1.01⁵) for all but the
    last triple, the last one repeated beyond the table."""
    s = POLAR_EXPRESS_SAFETY
    table = [(a / s, b / s**3, c / s**5) for a, b, c in POLAR_EXPRESS_PUBLISHED[:-1]]
    table.append(POLAR_EXPRESS_PUBLISHED[-1])
    table = table[:steps] + [table[-1]] * max(0, steps - len(table))
    X = x.double()
    tall = X.shape[-2] > X.shape[-1]
    if tall:
        X = X.mT
    X = X / (torch.linalg.vector_norm(X, dim=(-2, -1), keepdim=True) * s)
    for a, b, c in table:
        A = X @ X.mT
        X = a * X + (b * A + c * A @ A) @ X
    return X.mT if tall else X


def test_polar_express_published_table_is_verbatim():
    # arXiv 2505.16932 / github.com/NoahAmsel/PolarExpress polar_express/basic.py (_COEFFS)
    assert POLAR_EXPRESS_PUBLISHED == (
        (8.28721201814563, -23.595886519098837, 17.300387312530933),
        (4.107059111542203, -2.9478499167379106, 0.5448431082926601),
        (3.9486908534822946, -2.908902115962949, 0.5518191394370137),
        (3.3184196573706015, -2.488488024314874, 0.51004894012372),
        (2.300652019954817, -1.6689039845747493, 0.4188073119525673),
        (1.891301407787398, -1.2679958271945868, 0.37680408948524835),
        (1.8750014808534479, -1.2500016453999487, 0.3750001645474248),
        (1.875, -1.25, 0.375),
    )
    assert POLAR_EXPRESS_SAFETY == 1.01
    preset = NS_PRESETS["polar_express"]
    assert len(preset) == 8 and preset[-1] == (1.875, -1.25, 0.375)
    a, b, c = POLAR_EXPRESS_PUBLISHED[1]
    assert preset[1] == (a / 1.01, b / 1.01**3, c / 1.01**5)
    a, b, c = POLAR_EXPRESS_PUBLISHED[0]  # the 1.01 normalisation folded into step 1
    assert preset[0] == (a / 1.01 / 1.01, b / 1.01**3 / 1.01**3, c / 1.01**5 / 1.01**5)


def test_per_step_preset_truncates_and_repeats_its_last_triple():
    preset = NS_PRESETS["polar_express"]
    assert coefficient_schedule("polar_express", 5) == preset[:5]
    assert coefficient_schedule("polar_express", 8) == preset
    assert coefficient_schedule("polar_express", 10) == preset + (preset[-1],) * 2
    assert coefficient_schedule("polar_express", 0) == ()
    with pytest.raises(ValueError, match="8 triples but steps=5"):  # explicit tables stay exact
        coefficient_schedule(list(preset), 5)


@pytest.mark.parametrize("steps", [1, 5, 8, 10])
@pytest.mark.parametrize("shape", [(24, 40), (40, 24), (3, 16, 20)])
def test_polar_express_preset_equals_reference_algorithm(steps, shape):
    x = _randn(*shape, seed=steps, dtype=torch.float64)
    got = newton_schulz(x, coefficients="polar_express", steps=steps, dtype=torch.float64)
    ref = _polar_express_reference64(x, steps)
    assert (got - ref).abs().max().item() < 1e-12 * max(1.0, ref.abs().max().item())


def test_deepseek_v4_preset_is_fixed_length_and_never_truncated():
    """The DeepSeek-V4 schedule (8 x Muon's triple, then 2 x (2, -1.5, 0.5)) is a
    fixed 10-step recipe: 10 steps or an error, ns_steps=None selects 10; every per-step preset
    declares its length policy (none truncates silently)."""
    from dmuon._update import DEEPSEEK_V4, PRESET_LENGTH_POLICY, resolve_ns_steps

    assert DEEPSEEK_V4 == (MUON,) * 8 + ((2.0, -1.5, 0.5),) * 2 and NS_PRESETS["deepseek_v4"] == DEEPSEEK_V4
    assert coefficient_schedule("deepseek_v4", 10) == DEEPSEEK_V4
    for steps in (0, 5, 8, 9, 11):
        with pytest.raises(ValueError, match="fixed 10-step schedule"):
            coefficient_schedule("deepseek_v4", steps)
    # every per-step preset has a declared policy; only "prefix" presets take another length
    per_step = {k for k, v in NS_PRESETS.items() if not isinstance(v[0], float)}
    assert per_step == set(PRESET_LENGTH_POLICY) == {"polar_express", "deepseek_v4"}
    assert PRESET_LENGTH_POLICY == {"polar_express": "prefix", "deepseek_v4": "fixed"}
    assert [resolve_ns_steps(c, None) for c in ("muon", "polar_express", "deepseek_v4", MUON, [MUON] * 3)] == [
        5,
        5,
        10,
        5,
        3,
    ]
    assert resolve_ns_steps("deepseek_v4", 7) == 7  # given: kept (and then refused by coefficient_schedule)
    # the p(1) = 1, p'(1) = 0 finish: exact arithmetic maps [1e-3, 1] into [1.0000, 1.0005]
    s = torch.cat([torch.logspace(-3, 0, 2000, dtype=torch.float64)])
    y = s.clone()
    for a, b, c in DEEPSEEK_V4:
        y = a * y + b * y**3 + c * y**5
    assert 0.99999 < y.min().item() and y.max().item() < 1.00055
    lo, hi = schedule_gain_bounds(DEEPSEEK_V4)
    assert abs(lo - 1.0) < 1e-4 and 1.0018 < hi < 1.0021  # peak of the finishing polynomial: 1.0018
    # truncated, it would be exactly "muon" x 5; reordered (finish first), it would not converge
    assert schedule_gain_bounds(DEEPSEEK_V4[:5]) == schedule_gain_bounds(coefficient_schedule("muon", 5))
    y = s.clone()
    for a, b, c in DEEPSEEK_V4[8:] + DEEPSEEK_V4[:8]:
        y = a * y + b * y**3 + c * y**5
    assert y.min().item() < 0.7 and y.max().item() > 1.1
    # the standard iteration in float64 equals the composed polynomial on a known spectrum
    x = _randn(24, 40, seed=3, dtype=torch.float64)
    u, sv, vh = torch.linalg.svd(x, full_matrices=False)
    got = newton_schulz(x, coefficients="deepseek_v4", steps=10, dtype=torch.float64)
    z = sv / torch.linalg.matrix_norm(x)
    for a, b, c in DEEPSEEK_V4:
        z = a * z + b * z**3 + c * z**5
    assert (got - (u * z) @ vh).abs().max().item() < 1e-12


def test_muon_with_deepseek_v4_runs_10_steps_or_raises():
    import dmuon

    w = torch.nn.Linear(8, 6)
    h = dmuon.Muon._checked_muon_hparams(
        dict(
            lr=0.02,
            momentum=0.95,
            nesterov=True,
            weight_decay=0.0,
            ns_coefficients="deepseek_v4",
            ns_steps=None,
            eps=1e-7,
            adjust_lr_fn=None,
            ns_dtype=torch.float32,
            ns_backend="standard",
            variant="muon",
            normuon_beta2=0.95,
            normuon_eps=1e-10,
        )
    )
    assert h["ns_steps"] == 10 and h["ns_coefficients"] == NS_PRESETS["deepseek_v4"]
    with pytest.raises(ValueError, match="pass ns_steps=10 or ns_steps=None"):
        dmuon.Muon([w.weight], ns_coefficients="deepseek_v4", ns_steps=5)


def test_schedule_gain_bounds():
    lo, hi = schedule_gain_bounds(coefficient_schedule("muon", 5))
    assert 0.69 < lo < 0.70 and 1.20 < hi < 1.21  # P(1) = 0.696; peak ~1.202
    lo, hi = schedule_gain_bounds(coefficient_schedule("polar_express", 5))
    assert 0.87 < lo < 0.88 and 1.12 < hi < 1.13
    lo, hi = schedule_gain_bounds(coefficient_schedule("polar_express", 8))
    assert abs(lo - 1) < 1e-6 and abs(hi - 1) < 1e-6  # 8 steps: [1e-3, 1] -> 1 to ~1e-12
    assert schedule_gain_bounds(()) == (1.0, 1.0)


def test_gram_segments():
    sched = coefficient_schedule(MUON, 5)
    assert [len(s) for s in gram_segments(sched)] == [2, 2, 1]  # default: every 2
    assert [len(s) for s in gram_segments(sched, 3)] == [3, 2]
    assert [len(s) for s in gram_segments(sched, 1)] == [1] * 5
    assert [len(s) for s in gram_segments(sched, None)] == [5]
    assert [len(s) for s in gram_segments(sched, [2])] == [2, 3]  # Dao-AILab's reset after step 2
    assert [len(s) for s in gram_segments(sched, [0, 2, 2, 9])] == [2, 3]
    assert gram_segments((), 2) == ()
    for bad in (0, -1, "2", 2.0, True, [1.5]):
        with pytest.raises(ValueError, match="restart_every"):
            gram_segments(sched, bad)


def test_flop_formulas_and_segment_rule_are_the_cost_models():
    """One definition each (dmuon.plan._cost.flops, dmuon.plan._rules): the optimizer and the plan cannot disagree."""
    from dmuon.plan._cost import flops as cost
    from dmuon.plan import _rules as rules

    sched = coefficient_schedule(MUON, 5)
    for restart_every in (None, 1, 2, 3, 7, [2], [0, 2, 2, 9], ()):
        lengths = rules.gram_segment_lengths(5, restart_every)
        assert tuple(len(s) for s in gram_segments(sched, restart_every)) == lengths
        assert gram_ns_flops(4, 10, 5, restart_every=restart_every) == cost.gram_ns_segment_flops(4, 10, lengths)
    for bad in (0, -1, "2", 2.0, True, [1.5]):
        with pytest.raises(ValueError, match="restart_every"):
            rules.gram_segment_lengths(5, bad)


GRAM_SHAPES = [(16, 16), (36, 16), (5, 8), (1, 33), (33, 1), (12, 200), (3, 12, 40), (2, 2, 9, 7)]


@pytest.mark.parametrize("shape", GRAM_SHAPES)
@pytest.mark.parametrize("coefficients", ["muon", "polar_express"])
def test_gram_equals_standard_in_float64(shape, coefficients):
    x = _randn(*shape, seed=sum(shape))
    ref = newton_schulz(x, coefficients=coefficients, dtype=torch.float64)
    scale = ref.abs().max().item()
    for restart_every in (1, 2, 3, None, [2]):
        got = gram_newton_schulz(x, coefficients=coefficients, dtype=torch.float64, restart_every=restart_every)
        assert got.shape == x.shape and got.dtype == torch.float64
        assert (got - ref).abs().max().item() <= 1e-12 * scale, restart_every


@pytest.mark.parametrize("steps", [0, 1, 2, 7])
def test_gram_equals_standard_in_float64_any_steps(steps):
    x = _randn(20, 48, seed=steps)
    ref = newton_schulz(x, steps=steps, dtype=torch.float64)
    got = gram_newton_schulz(x, steps=steps, dtype=torch.float64)
    assert (got - ref).abs().max().item() <= 1e-12 * max(1.0, ref.abs().max().item())


@pytest.mark.parametrize("shape", [(64, 64), (36, 16), (64, 256), (3, 16, 48)])
def test_gram_close_to_standard_in_float32(shape):
    x = _randn(*shape, seed=21)
    ref = newton_schulz(x, dtype=torch.float32)
    got = gram_newton_schulz(x, dtype=torch.float32)
    assert got.dtype == torch.float32
    assert (got - ref).abs().max().item() < 1e-4


@pytest.mark.parametrize("shape", [(16, 16), (36, 16), (3, 5, 8)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("coefficients", ["muon", "polar_express"])
def test_zero_input_maps_to_zeros_every_backend(shape, dtype, coefficients):
    for name in NS_BACKENDS:
        y = get_ns_backend(name)(torch.zeros(shape), coefficients=coefficients, dtype=dtype)
        assert y.shape == shape and y.dtype == dtype
        assert torch.isfinite(y).all() and not y.any(), name


def test_gram_input_not_mutated_and_tall_result_contiguous():
    """A tall input's iterates live in its own layout (products computed as their transposes):
    the result is contiguous, the input untouched, and equal in float64 to the wide input's
    result transposed."""
    x = _randn(36, 16, seed=22).bfloat16()
    before = x.clone()
    y = gram_newton_schulz(x)
    assert torch.equal(x, before)
    assert y.shape == (36, 16) and y.dtype == torch.bfloat16 and y.is_contiguous()
    x64 = _randn(3, 40, 12, seed=23, dtype=torch.float64)
    tall = gram_newton_schulz(x64, dtype=torch.float64)
    assert tall.is_contiguous()
    wide = gram_newton_schulz(x64.mT.contiguous(), dtype=torch.float64)
    assert (tall - wide.mT).abs().max().item() <= 1e-12


def test_gram_ns_from_gram_is_the_tensor_parallel_split():
    """Simulate a 4-way TP shard of a (12, 200) matrix along its long side: all-reduce the
    Gram, normalise by its trace, run gram_ns_from_gram per segment, apply Q to each shard."""
    x = _randn(12, 200, seed=23, dtype=torch.float64)
    shards = list(x.split(50, dim=1))
    sched = coefficient_schedule("polar_express", 5)
    g = sum(s @ s.T for s in shards)  # the all-reduce
    fro = torch.trace(g).sqrt()  # ‖X‖_F from the Gram alone
    shards = [s / fro for s in shards]
    for segment in gram_segments(sched):
        g = sum(s @ s.T for s in shards)  # one all-reduce per segment (restart)
        q = gram_ns_from_gram(g, coefficients=segment, steps=len(segment))
        shards = [q @ s for s in shards]
    tp = torch.cat(shards, dim=1)
    full = gram_newton_schulz(x, coefficients="polar_express", dtype=torch.float64)
    std = newton_schulz(x, coefficients="polar_express", dtype=torch.float64)
    torch.testing.assert_close(tp, full, rtol=0, atol=1e-12)
    torch.testing.assert_close(tp, std, rtol=0, atol=1e-12)


def test_gram_ns_from_gram_shapes_and_errors():
    g = torch.eye(4, dtype=torch.float64) * 0.25
    assert torch.equal(gram_ns_from_gram(g, coefficients=MUON, steps=0), torch.eye(4, dtype=torch.float64))
    q = gram_ns_from_gram(g, coefficients=MUON, steps=1)  # Z = a + b/4 + c/16 on the diagonal
    torch.testing.assert_close(q, torch.eye(4, dtype=torch.float64) * (3.4445 - 4.775 / 4 + 2.0315 / 16))
    batched = gram_ns_from_gram(g.expand(2, 3, 4, 4), coefficients="polar_express", steps=3)
    assert batched.shape == (2, 3, 4, 4)
    before = g.clone()
    gram_ns_from_gram(g, coefficients=MUON, steps=5)
    assert torch.equal(g, before)
    with pytest.raises(ValueError, match="square"):
        gram_ns_from_gram(torch.ones(3, 4), coefficients=MUON, steps=5)
    with pytest.raises(ValueError, match="steps"):
        gram_ns_from_gram(g, coefficients=MUON, steps=100)


def test_gram_bad_arguments_raise():
    with pytest.raises(ValueError, match="matrix"):
        gram_newton_schulz(torch.ones(5))
    with pytest.raises(ValueError, match="real"):
        gram_newton_schulz(torch.ones(3, 3, dtype=torch.complex64), dtype=torch.float32)
    with pytest.raises(ValueError, match="restart_every"):
        gram_newton_schulz(torch.ones(3, 4), restart_every=0)
    with pytest.raises(ValueError, match="unknown Newton-Schulz preset"):
        gram_newton_schulz(torch.ones(3, 4), coefficients="polar")
    with pytest.raises(ValueError, match="unknown Newton-Schulz backend"):
        get_ns_backend("cholesky")
    assert get_ns_backend("standard") is newton_schulz and get_ns_backend("gram") is gram_newton_schulz


def test_gram_counts_ns_calls(monkeypatch):
    calls = spy_ns(monkeypatch)
    fell_back = []
    ns_mod.gram_newton_schulz(_randn(8, 4), on_fallback=fell_back.append)
    ns_mod.gram_newton_schulz(_randn(3, 8, 4), dtype=torch.float32, on_fallback=fell_back.append)
    assert calls.matrices == 4 and fell_back == []
    assert calls.reset() == 4


def test_gram_ns_flops_hand_checked():
    d, D = 4, 10
    # segments (2, 2, 1): 3 x 4·d²·D + (10 + 10 + 2)·d³
    assert gram_ns_flops(d, D, 5) == 3 * 4 * 16 * 10 + 22 * 64
    assert gram_ns_flops(D, d, 5) == gram_ns_flops(d, D, 5)
    # one restart after step 2 (segments 2, 3): 8·d²·D + 28·d³
    assert gram_ns_flops(d, D, 5, restart_every=[2]) == 8 * 16 * 10 + 28 * 64
    assert gram_ns_flops(d, D, 5, restart_every=None) == 4 * 16 * 10 + 34 * 64
    assert gram_ns_flops(d, D, 5, num_matrices=3) == 3 * gram_ns_flops(d, D, 5)
    assert gram_ns_flops(d, D, 0) == 0
    # restart_every=1 costs what the standard iteration costs
    assert gram_ns_flops(d, D, 5, restart_every=1) == ns_flops(d, D, 5)
    # pays off for D >> d: 1024 x 16384, one restart: 0.47x the standard FLOPs
    assert gram_ns_flops(1024, 16384, 5, restart_every=[2]) / ns_flops(1024, 16384, 5) < 0.5
    assert gram_ns_flops(1024, 1024, 5) > ns_flops(1024, 1024, 5)  # square: not
    with pytest.raises(ValueError):
        gram_ns_flops(-1, 3, 5)


@pytest.mark.parametrize("shape", [(36, 16), (5, 8), (16, 16), (4, 12, 20), (2, 129, 160), (160, 128), (257, 300)])
@pytest.mark.parametrize("restart_every", [2, None, [2], 1])
def test_gram_ns_flops_matches_flop_counter(shape, restart_every):
    """Below and from d = 256 (GRAM_SYM_MIN_SIDE, odd d = 257): the general product, and the
    symmetric Gram product's blocks, are what the formula counts."""
    x = _randn(*shape)
    with FlopCounterMode(display=False) as counter:
        gram_newton_schulz(x, dtype=torch.float32, steps=5, restart_every=restart_every, fallback=False)
    batch = shape[0] if len(shape) == 3 else 1
    expected = gram_ns_flops(shape[-2], shape[-1], 5, restart_every=restart_every, num_matrices=batch)
    assert counter.get_total_flops() == expected


@pytest.mark.parametrize("shape", [(3, 256, 40), (2, 257, 33), (2, 8, 50)])
def test_symmetric_gram_is_x_xt(shape):
    """Gram NS's X Xᵀ: from d = 256 its lower blocks only, the upper right block
    mirrored exactly; the same values as the full product (the same dot products, up to the
    kernel's summation order), also for a transposed (tall) view."""
    from dmuon._ns_gram import _symmetric_gram
    from dmuon.plan._cost.flops import GRAM_SYM_MIN_SIDE

    x = _randn(*shape).double()
    h = shape[-2] // 2
    for X in (x, x.mT.contiguous().mT):
        G = _symmetric_gram(X)
        if shape[-2] >= GRAM_SYM_MIN_SIDE:
            assert torch.equal(G[:, h:, :h], G[:, :h, h:].mT)
        torch.testing.assert_close(G, G.mT, rtol=1e-14, atol=1e-12)
        torch.testing.assert_close(G, X @ X.mT, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("batch", [3, 20])  # one dot per matrix / vecdot (_DOT_LOOP_MAX_BATCH)
def test_fallback_inner_product_paths(batch):
    """The fallback check's ⟨Y, X⟩ per matrix, on its fast paths and its strided fallback,
    against the sum of products in float64."""
    from dmuon._ns_gram import _batched_inner

    Y, X = _randn(batch, 12, 40), _randn(batch, 12, 40)
    expect = (Y.double() * X.double()).sum(dim=(-2, -1))
    for a, b in ((Y, X), (Y, X.mT.contiguous().mT)):
        got = _batched_inner(a, b, torch.float32)
        assert got.shape == (batch,) and got.dtype == torch.float32
        torch.testing.assert_close(got.double(), expect, rtol=1e-5, atol=1e-4)


# ----------------------------------------------------------------------------------------------
# tiny and zero matrices in one fp32 NS batch: each divided by max(||X||_F, eps) of its own, as
# torch's clamp(min=eps), in the standard, Gram and TP-Gram paths, against torch.optim.Muon's iteration
# ----------------------------------------------------------------------------------------------

COEFFS = (3.4445, -4.775, 2.0315)


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
    _assert_matches_torch([ns_mod.newton_schulz(x, **kw) for x in ins], ins, 1e-5, "standard 2-D")
    _assert_matches_torch(ns_mod.newton_schulz(torch.stack(ins), **kw).unbind(0), ins, 1e-5, "standard batch")
    # Gram NS (with its restarts and fallback), batched
    _assert_matches_torch(ns_mod.gram_newton_schulz(torch.stack(ins), **kw).unbind(0), ins, 1e-4, "gram batch")
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
        results[rank] = ns_mod.sharded_gram_newton_schulz(
            halves[rank].contiguous(), all_reduce_sum=lambda t: all_reduce(t, rank), **kw
        )

    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    out = torch.cat(results, dim=-1)
    _assert_matches_torch(out.unbind(0), wide, 1e-4, "tp-gram T=2")
