"""dmuon.sim: collective costs by hand, a hand-timed 2-rank replay, invariants, workload terms."""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import dmuon.plan as P
from dmuon.sim import zoo
import dmuon.sim as S
from dmuon.plan._cost import flops as CF
from dmuon.plan._cost import nbytes as C
from dmuon.plan import _rules as R
from dmuon.sim import hardware as H
from dmuon.sim._engine import lower as _sim_lower
from dmuon.sim._engine.lower import _SimOp
from dmuon.sim._engine.sim_replay import _critical_path, replay_ops

LINK = H.Link(latency_s=1e-5, bandwidth_Bps=1e9)


# ------------------------------------------------------------------ collective cost by hand


@pytest.mark.parametrize(
    "kind, expected",
    [
        # k = 4, S = 1 MB per rank, alpha = 10 us, 1 GB/s
        ("broadcast", 2 * 1e-5 + 1e-3),  # ceil(log2 4) hops + S/B (pipelined tree)
        ("reduce", 2 * 1e-5 + 1e-3),
        ("all_reduce", 6 * 1e-5 + 1.5e-3),  # ring 2(k-1)a + 2(k-1)/k S/B beats tree 4a + 2 S/B
        ("all_gather", 3 * 1e-5 + 3e-3),  # (k-1) a + (k-1) S/B
        ("reduce_scatter", 3 * 1e-5 + 3e-3),
        ("all_to_all", 3 * 1e-5 + 0.75e-3),  # (k-1) a + (k-1)/k S/B
    ],
)
def test_formula_collective_by_hand(kind, expected):
    assert H.formula_collective_s(kind, 4, 1e6, LINK) == pytest.approx(expected, rel=1e-12)
    assert H.formula_collective_s(kind, 4, 1e6, LINK, launch_s=5e-6) == pytest.approx(expected + 5e-6, rel=1e-12)
    assert H.formula_collective_s(kind, 1, 1e6, LINK, launch_s=5e-6) == 5e-6


def test_small_all_reduce_takes_the_tree():
    # k = 64, 1 KB: ring 2*63 hops, tree 2*6 hops
    ring = 2 * 63 * 1e-5 + 2 * 63 / 64 * 1e3 / 1e9
    tree = 2 * 6 * 1e-5 + 2 * 1e3 / 1e9
    assert tree < ring
    assert H.formula_collective_s("all_reduce", 64, 1e3, LINK) == pytest.approx(tree)


def test_group_link_and_preset_collective():
    hw = H.preset("h100")
    assert H.group_link(hw, tuple(range(8))) is hw.intra
    assert H.group_link(hw, (7, 8)) is hw.inter
    s = 2**20
    k = 16
    by_hand = hw.launch_s + (k - 1) * hw.inter.latency_s + (k - 1) * s / hw.inter.bandwidth_Bps
    assert H.collective_s(hw, "all_gather", tuple(range(0, 128, 8)), s) == pytest.approx(by_hand)


def test_measured_curve_interpolation_and_group_scaling():
    c = H.CollectiveCurve(kind="broadcast", group_size=2, nbytes=(1000, 2000), seconds=(1e-3, 3e-3))
    assert c.at(500) == 1e-3
    assert c.at(1500) == pytest.approx(2e-3)
    assert c.at(3000) == pytest.approx(5e-3)  # extrapolated along the last segment
    hw = dataclasses.replace(H.preset("h100"), curves=(c,))
    assert H.collective_s(hw, "broadcast", (0, 1), 1500) == pytest.approx(2e-3)
    assert H.collective_s(hw, "broadcast", (0, 1, 2, 3), 1500) == pytest.approx(2e-3 * 3)  # (k-1)/(k'-1)
    # a kind without a curve falls back to the formula
    assert H.collective_s(hw, "all_gather", (0, 1), 1e6) == pytest.approx(
        H.formula_collective_s("all_gather", 2, 1e6, hw.intra, hw.launch_s)
    )


def test_hardware_json_round_trip(tmp_path):
    c = H.CollectiveCurve(kind="reduce", group_size=3, nbytes=(10, 20), seconds=(1.0, 2.0))
    hw = dataclasses.replace(H.preset("a800"), curves=(c,), comm_engine="threads", comm_cpu_share=0.25)
    path = tmp_path / "hw.json"
    H.dump(hw, str(path), raw={"x": 1})
    assert json.loads(path.read_text())["raw"] == {"x": 1}
    assert H.load(str(path)) == hw
    with pytest.raises(ValueError, match="unknown hardware"):
        H.preset("tpu")


def test_matmul_efficiency_curve():
    hw = H.preset("h100")
    assert H.matmul_efficiency(hw, 1.0) == hw.matmul_efficiency[0][1]
    assert H.matmul_efficiency(hw, 1e6) == hw.matmul_efficiency[-1][1]
    mid = H.matmul_efficiency(hw, math.sqrt(512 * 1024))  # halfway in log d
    assert mid == pytest.approx((0.35 + 0.55) / 2)
    assert H.matmul_s(hw, 2e12, 8192, "torch.bfloat16") == pytest.approx(2e12 / (989e12 * 0.78))


def test_training_terms_and_in_situ_costs_by_group():
    """The calibrated training terms: forward / backward matmuls on the autograd curve, operators
    at ``autograd_op_s``; FSDP2 and DTensor-gather costs by group size, the scalar elsewhere;
    without the new fields every figure is the plain one (GPU presets unchanged)."""
    hw = dataclasses.replace(
        _cpu(),
        matmul_efficiency=((100.0, 0.5),),
        autograd_matmul_efficiency=((10.0, 0.1), (1000.0, 0.4)),
        op_overhead_s=1e-6,
        autograd_op_s=5e-6,
        elementwise_Bps=1e9,
        fsdp2_call_s=1e-4,
        fsdp2_call_s_by_group=((2, 3e-3), (4, 9e-3)),
        dtensor_gather_s=2e-4,
        dtensor_gather_s_by_group=((2, 1e-3),),
        comm_cpu_share=0.5,
        comm_cpu_share_by_group=((2, 0.25),),
    )
    assert H.matmul_s(hw, 1e9, 100.0, "torch.float32") == pytest.approx(1e9 / (1e9 * 0.5))
    assert H.train_matmul_s(hw, 1e9, 100.0, "torch.float32") == pytest.approx(1e9 / (1e9 * 0.25))  # halfway in log d
    assert H.train_elementwise_s(hw, 1e6, 10) == pytest.approx(1e-3 + 10 * 5e-6)
    assert H.elementwise_s(hw, 1e6, 10) == pytest.approx(1e-3 + 10 * 1e-6)
    assert (H.fsdp2_call_s_at(hw, 2), H.fsdp2_call_s_at(hw, 3), H.fsdp2_call_s_at(hw, 4)) == (3e-3, 1e-4, 9e-3)
    assert (H.dtensor_gather_s_at(hw, 2), H.dtensor_gather_s_at(hw, 4)) == (1e-3, 2e-4)
    assert H.comm_cpu_share_at(hw) == 0.25 and H.comm_cpu_share_at(dataclasses.replace(hw, ranks_per_node=3)) == 0.5
    plain = _cpu(matmul_efficiency=((100.0, 0.5),), op_overhead_s=1e-6)
    assert H.train_matmul_s(plain, 1e9, 100.0, "torch.float32") == H.matmul_s(plain, 1e9, 100.0, "torch.float32")
    assert H.train_elementwise_s(plain, 1e6, 10) == H.elementwise_s(plain, 1e6, 10)
    assert H.Hardware.from_dict(json.loads(json.dumps(hw.to_dict()))) == hw


def test_attention_norm_activation_terms_by_hand():
    """The calibrated kernels of training: attention on its own curve at one head's mean
    dimension, norms and the activation function per element (a third of the calibrated
    forward + backward in the forward); without them, the matmul curve at the whole width and
    6 resp. 2 memory passes (the GPU presets' figures, unchanged)."""
    from dmuon.sim._engine.lower import _work_s
    from dmuon.sim._engine.workload import Work

    plain = _cpu(autograd_matmul_efficiency=((10.0, 0.1), (1000.0, 0.4)), elementwise_Bps=1e9, autograd_op_s=5e-6)
    hw = dataclasses.replace(
        plain,
        attention_efficiency=((50.0, 0.1), (200.0, 0.4)),
        norm_train_s_per_numel=9e-9,
        activation_train_s_per_numel=6e-9,
    )
    # head_d 100 is halfway between 50 and 200 in log d: efficiency 0.25 of the 1 GFLOP/s peak
    assert H.train_attention_s(hw, 1e9, 1000.0, 100.0, "torch.float32") == pytest.approx(1e9 / (1e9 * 0.25))
    assert H.train_attention_s(hw, 1e9, 1000.0, 0.0, "torch.float32") == H.train_matmul_s(
        hw, 1e9, 1000.0, "torch.float32"
    )
    assert H.train_attention_s(plain, 1e9, 1000.0, 100.0, "torch.float32") == pytest.approx(1e9 / (1e9 * 0.4))
    assert H.train_norm_s(hw, 3e6, 4) == pytest.approx(3e6 * 9e-9 / 3)
    assert H.train_norm_s(plain, 3e6, 4) == pytest.approx(6 * 3e6 * 4 / 1e9)
    assert H.train_activation_s(hw, 3e6, 4) == pytest.approx(3e6 * 6e-9 / 3)
    assert H.train_activation_s(plain, 3e6, 4) == pytest.approx(2 * 3e6 * 4 / 1e9)
    assert H.Hardware.from_dict(json.loads(json.dumps(hw.to_dict()))) == hw
    # one unit's forward and backward (x2), term by term
    w = Work(
        fqn="b",
        label="boundary",
        matmuls=((int(1e8), 1000.0),),
        attention_flops=int(1e8),
        attention_d=1000.0,
        attention_head_d=100.0,
        elementwise_nbytes=int(1e6),
        norm_numel=30_000,
        activation_numel=60_000,
        ops=10,
    )
    fwd = 1e8 / 0.4e9 + 1e8 / 0.25e9 + 30_000 * 9e-9 / 3 + 60_000 * 6e-9 / 3 + 1e6 / 1e9 + 10 * 5e-6
    assert _work_s(hw, w, 1.0, "torch.float32", 4) == pytest.approx(fwd)
    assert _work_s(hw, w, 2.0, "torch.float32", 4) == pytest.approx(2 * fwd)
    old = 1e8 / 0.4e9 + 1e8 / 0.4e9 + (6 * 30_000 + 2 * 60_000) * 4 / 1e9 + 1e6 / 1e9 + 10 * 5e-6
    assert _work_s(plain, w, 1.0, "torch.float32", 4) == pytest.approx(old)


def test_busy_node_factors_by_hand():
    """With every core busy the calibrated factors apply, matmul-class and memory-bound terms each
    their own; linear in the busy cores from 1 at one; one rank per node or the GPU default: 1."""
    from dmuon.sim._engine.lower import _work_s
    from dmuon.sim._engine.workload import Work

    hw = _cpu(
        ranks_per_node=4,
        cores_per_node=4,
        busy_compute_factor=1.3,
        busy_memory_factor=1.6,
        autograd_matmul_efficiency=((10.0, 0.5),),
        elementwise_Bps=1e9,
    )
    assert H.busy_factors(hw) == pytest.approx((1.3, 1.6))
    assert H.busy_factors(dataclasses.replace(hw, ranks_per_node=3)) == pytest.approx((1.2, 1.4))  # 2 of 3 steps
    assert H.busy_factors(dataclasses.replace(hw, ranks_per_node=8)) == pytest.approx((1.3, 1.6))  # all busy
    assert H.busy_factors(dataclasses.replace(hw, ranks_per_node=1)) == (1.0, 1.0)
    assert H.busy_factors(H.preset("h100")) == (1.0, 1.0)
    w = Work(fqn="b", label="boundary", matmuls=((int(1e8), 100.0),), elementwise_nbytes=int(1e6))
    assert _work_s(hw, w, 1.0, "torch.float32", 4) == pytest.approx(1.3 * 1e8 / 0.5e9 + 1.6 * 1e6 / 1e9)


def test_newton_schulz_on_its_calibrated_curve_by_hand():
    """With ``ns_efficiency`` one NS call is ``flops / (peak · eff(d))`` (the whole call) plus the
    update's 6 passes and operators; without it, the matmuls on the plain curve plus ``2 · steps``
    passes and the iteration's operators (the GPU presets' figure)."""
    from dmuon.sim._engine.lower import _ns_s

    plain = _cpu(matmul_efficiency=((100.0, 0.5),), elementwise_Bps=1e9, op_overhead_s=1e-6, ns_dtype="torch.float32")
    hw = dataclasses.replace(plain, ns_efficiency=((64.0, 0.2), (256.0, 0.8)))
    assert H.ns_call_s(hw, 1e9, 128.0) == pytest.approx(1e9 / (1e9 * 0.5))  # halfway in log d
    spec = SimpleNamespace(matrix_shape=(128, 128), dtype="torch.float32", local_numel=128 * 128)
    wl = SimpleNamespace(muon_ops_per_matrix=8, ns_ops_per_step=5)
    flops = CF.ns_flops(128, 128)
    update = 6 * 128 * 128 * 4 / 1e9 + 8 * 1e-6
    assert _ns_s(hw, wl, spec, flops) == pytest.approx(flops / (1e9 * 0.5) + update)
    passes = 2 * R.NS_STEPS * 128 * 128 * 4 / 1e9 + 5 * R.NS_STEPS * 1e-6
    assert _ns_s(plain, wl, spec, flops) == pytest.approx(flops / (1e9 * 0.5) + passes + update)
    assert H.Hardware.from_dict(json.loads(json.dumps(hw.to_dict()))) == hw


def test_ns_batch_factor_by_hand():
    """Per matrix, a batched NS call of ``B`` costs ``factor(d, B)``: 1 at ``B = 1`` and without a
    table; linear in ``log B`` from (1, 1) through the measured batches, held beyond the largest;
    linear in ``log d`` between the measured ``d``, held outside; priced into one matrix's NS."""
    from dmuon.sim._engine.lower import _ns_s

    hw = _cpu(
        ns_dtype="torch.float32",
        ns_efficiency=((64.0, 0.5), (512.0, 0.5)),
        ns_batch_factor=((128.0, 4.0, 0.8), (128.0, 16.0, 0.9), (512.0, 4.0, 1.2)),
    )
    f = H.ns_batch_factor_at
    assert f(hw, 128.0, 1) == 1.0 and f(_cpu(), 128.0, 8) == 1.0
    assert f(hw, 128.0, 2) == pytest.approx(0.9)  # halfway from (1, 1.0) to (4, 0.8) in log B
    assert f(hw, 128.0, 8) == pytest.approx(0.85) and f(hw, 128.0, 64) == pytest.approx(0.9)
    assert f(hw, 64.0, 4) == pytest.approx(0.8) and f(hw, 1024.0, 64) == pytest.approx(1.2)
    assert f(hw, 256.0, 4) == pytest.approx(1.0)  # halfway between d = 128 and 512 in log d
    spec = SimpleNamespace(matrix_shape=(128, 128), dtype="torch.float32", local_numel=128 * 128)
    wl = SimpleNamespace(muon_ops_per_matrix=8, ns_ops_per_step=5)
    flops = CF.ns_flops(128, 128)
    update = _ns_s(hw, wl, spec, 0)
    assert _ns_s(hw, wl, spec, flops, 0.8) - update == pytest.approx(0.8 * flops / (1e9 * 0.5))
    assert H.Hardware.from_dict(json.loads(json.dumps(hw.to_dict()))) == hw
    with pytest.raises(ValueError, match="ns_batch_factor"):
        _cpu(ns_batch_factor=((128.0, 16.0, 0.9), (128.0, 4.0, 0.8)))


def test_gram_ns_priced_on_its_own_curve():
    """A matrix that runs Gram NS (the plan's ``ns_backend="gram"``; owner groups' sharded Gram
    NS) is priced on ``gram_ns_efficiency`` where the record has it, on ``ns_efficiency``
    otherwise; the standard iteration and every baseline's NS stay on ``ns_efficiency``."""
    from dmuon.sim._engine.lower import _lower, _ns_backend, _owner_group_fqns
    from dmuon.sim._engine.simulate import _variant_ops
    from dmuon._train.byte_gpt import GPT, GPTConfig

    def _ns_backends(plan):
        return {spec.fqn: _ns_backend(spec, _owner_group_fqns(plan)) for spec in plan.params}

    hw = _cpu(ns_dtype="torch.float32", ns_efficiency=((64.0, 0.8),), gram_ns_efficiency=((64.0, 0.4),))
    assert H.ns_call_s(hw, 1e9, 300.0, "gram") == pytest.approx(1e9 / (1e9 * 0.4))
    assert H.ns_call_s(hw, 1e9, 300.0) == pytest.approx(1e9 / (1e9 * 0.8))
    no_gram = dataclasses.replace(hw, gram_ns_efficiency=())
    assert H.ns_call_s(no_gram, 1e9, 300.0, "gram") == pytest.approx(1e9 / (1e9 * 0.8))
    cfg = GPTConfig(vocab_size=256, d_model=256, n_layers=1, n_heads=4, d_mlp=1024, seq_len=64)
    plan = P.compile(GPT(cfg, device="meta"), 2, cost_model="ns_flops", ns_backend="auto")
    backends = _ns_backends(plan)
    assert {f for f, b in backends.items() if b == "gram"} == {
        s.fqn for s in plan.params if s.ns_backend == "gram"
    } and "gram" in backends.values()
    assert all(b == "gram" for b in _ns_backends(P.compile(GPT(cfg, device="meta"), 2, owner_groups=2)).values())
    wl = S.from_plan(plan, tokens_per_rank=128, seq_len=64)
    for variant in ("z3", "naive"):
        ops, n, *_ = _variant_ops(plan, variant, None, False)
        a, b = (_lower(ops, plan, h, wl, variant=variant, num_ranks=n) for h in (hw, no_gram))
        for op, x, y in ((op, x, y) for x, y in zip(a, b) if x.kind == "newton_schulz" for op in [plan.param(x.label)]):
            gram = variant == "z3" and op.ns_backend == "gram"
            assert (x.seconds > y.seconds) == gram and (x.seconds == y.seconds) == (not gram)


def test_ns_batch_runs_by_hand():
    """The batched-NS rule ``dmuon.Muon`` runs and the simulator prices: consecutive entries up to
    ``NS_BATCH_MAX_NUMEL`` elements per call, an entry larger than that alone."""
    big = R.NS_BATCH_MAX_NUMEL
    assert R.ns_batch_runs([]) == []
    assert R.ns_batch_runs([big // 2, big // 2, 1, big + 1, 3]) == [[0, 1], [2], [3], [4]]
    assert R.ns_bucket_sides(1024, 256) == R.ns_bucket_sides(256, 1024) == (256, 1024)
    # with units (an expert range of 7 experts of big / 4 elements): pieces of 4 whole experts, the
    # last (3 experts) joined by the next entry that fits (big / 4); an expert above the cap alone
    q = big // 4
    assert R.ns_batch_pieces([7 * q, q, 2 * (big + 2)], [q, q, big + 2]) == [
        [(0, 0, 4)],
        [(0, 4, 7), (1, 0, 1)],
        [(2, 0, 1)],
        [(2, 1, 2)],
    ]


def test_ns_batches_reach_the_ops():
    """dmuon prices each matrix's NS by the batch its owner runs it in (same-side matrices of one
    owner, tall and wide together), the naive baseline by the batch of every such matrix (every
    rank runs all of them), in fp32 and bf16 alike; dion's all-to-all and ``ns_batching="exact"``
    unbatched."""
    from dmuon.sim._engine.lower import _lower, _ns_batch_factors, _ns_s, _owner_group_fqns
    from dmuon.sim._engine.simulate import _variant_ops
    from dmuon._train.byte_gpt import GPT, GPTConfig

    cfg = GPTConfig(vocab_size=256, d_model=128, n_layers=2, n_heads=4, d_mlp=512, seq_len=64)
    plan = P.compile(GPT(cfg, device="meta"), 2, cost_model="ns_flops")
    specs = {spec.fqn: spec for spec in plan.params}
    table = tuple((d, b, 1.0 + d / 1000 + b / 100) for d in (128.0, 203.18733465192946) for b in (2.0, 4.0, 8.0))
    hw = _cpu(ns_dtype="torch.float32", ns_efficiency=((64.0, 0.5),), ns_batch_factor=table)
    for variant in ("z3", "naive"):
        ops, *_ = _variant_ops(plan, variant, None, False)
        got = _ns_batch_factors(ops, specs, _owner_group_fqns(plan), hw, variant, "batched")
        bf16 = dataclasses.replace(hw, ns_dtype="torch.bfloat16")
        assert _ns_batch_factors(ops, specs, _owner_group_fqns(plan), bf16, variant, "batched") == got
        ns = [op for op in ops if op.kind == "newton_schulz"]
        assert set(got) == {op.id for op in ns}
        for op in ns:
            spec = plan.param(op.fqns[0])
            sides = R.ns_bucket_sides(*spec.matrix_shape)
            batch = sum(
                1 for o in ns if o.group == op.group and R.ns_bucket_sides(*plan.param(o.fqns[0]).matrix_shape) == sides
            )
            d = (sides[0] ** 2 * sides[1]) ** (1 / 3)
            assert got[op.id] == pytest.approx((H.ns_batch_factor_at(hw, d, batch), batch))
        if variant == "z3":  # the owners' batches hold every matrix once, some more than one
            calls = {(op.group, R.ns_bucket_sides(*plan.param(op.fqns[0]).matrix_shape)) for op in ns}
            assert len(ns) == 12 and len(calls) < len(ns)
            wl = S.from_plan(plan, tokens_per_rank=256, seq_len=64)
            lowered = [x for x in _lower(ops, plan, hw, wl, variant=variant, num_ranks=2) if x.kind == "newton_schulz"]
            assert [x.seconds for x in lowered] == pytest.approx(
                [
                    _ns_s(hw, wl, plan.param(op.fqns[0]), op.flops, got[op.id][0], batch=got[op.id][1])
                    * hw.oversubscription
                    for op in ns
                ]
            )
        if variant == "naive":  # 2 layers: 8 square matrices, 4 MLP matrices, all on every rank
            assert sorted({round(v, 6) for v, _ in got.values()}) == pytest.approx(
                sorted([H.ns_batch_factor_at(hw, 128.0, 8), H.ns_batch_factor_at(hw, (128 * 128 * 512) ** (1 / 3), 4)])
            )
    for variant, mode in (("all_to_all", "batched"), ("z3", "exact")):
        ops, *_ = _variant_ops(plan, variant, None, False)
        assert _ns_batch_factors(ops, specs, _owner_group_fqns(plan), hw, variant, mode) == {}


def test_gpu_preset_prices_batched_ns_by_call():
    """On a GPU preset (no calibrated batch factor) a batched call's operators are shared by its
    matrices: each NS op costs its matmuls plus ``1 / batch`` of the per-operator cost of its call
    and of its update, so ``ns_batching="batched"`` prices the optimizer below ``"exact"`` by exactly
    the operators saved, and ``"exact"`` as one call per matrix."""
    from dmuon.sim._engine.lower import _lower, _ns_batch_factors, _ns_s, _owner_group_fqns
    from dmuon.sim._engine.simulate import _variant_ops
    from dmuon._train.byte_gpt import GPT, GPTConfig

    cfg = GPTConfig(vocab_size=256, d_model=128, n_layers=2, n_heads=4, d_mlp=512, seq_len=64)
    plan = P.compile(GPT(cfg, device="meta"), 2, cost_model="ns_flops")
    hw = H.preset("h100")
    wl = S.from_plan(plan, tokens_per_rank=256, seq_len=64)
    ops, *_ = _variant_ops(plan, "z3", None, False)
    got = _ns_batch_factors(ops, {s.fqn: s for s in plan.params}, _owner_group_fqns(plan), hw, "z3", "batched")
    assert {f for f, _ in got.values()} == {1.0} and max(b for _, b in got.values()) > 1
    secs = {}
    for mode in ("batched", "exact"):
        w = dataclasses.replace(wl, ns_batching=mode)
        secs[mode] = [
            x.seconds for x in _lower(ops, plan, hw, w, variant="z3", num_ranks=2) if x.kind == "newton_schulz"
        ]
    ns = [op for op in ops if op.kind == "newton_schulz"]
    per_op = (wl.ns_ops_per_step * R.NS_STEPS + wl.muon_ops_per_matrix) * hw.op_overhead_s * hw.oversubscription
    for op, b, e in zip(ns, secs["batched"], secs["exact"]):
        batch = got[op.id][1]
        assert e == pytest.approx(_ns_s(hw, wl, plan.param(op.fqns[0]), op.flops) * hw.oversubscription)
        assert e - b == pytest.approx(per_op * (1 - 1 / batch))
    with pytest.raises(ValueError, match="ns_batching must be one of"):
        dataclasses.replace(wl, ns_batching="fast")


def test_in_situ_costs_reach_the_ops(tiny):
    """FSDP2 calls pay ``fsdp2_call_s_at(k)`` on the thread and the naive baseline's all-gathers
    ``dtensor_gather_s_at(k)``: each extra second per call moves the replay by calls x seconds
    on the critical rank when nothing overlaps (one rank per core, no compute)."""
    from dmuon.sim._engine.lower import _lower
    from dmuon.sim._engine.simulate import _variant_ops

    plan, wl = tiny
    hw = _cpu(ranks_per_node=4, cores_per_node=4)
    more = dataclasses.replace(hw, fsdp2_call_s_by_group=((4, 1e-3),), dtensor_gather_s_by_group=((4, 2e-3),))
    for variant in ("adamw", "naive"):
        ops, n, *_ = _variant_ops(plan, variant, None, False)
        a, b = (_lower(ops, plan, h, wl, variant=variant, num_ranks=n) for h in (hw, more))
        extra = [y.host_s - x.host_s for x, y in zip(a, b)]
        fsdp = sum(1 for op in a if op.kind.startswith("fsdp2_"))
        gathers = sum(1 for op in a if op.kind == "all_gather")
        assert sum(extra) == pytest.approx(fsdp * 1e-3 + gathers * 2e-3)
        assert (gathers > 0) == (variant == "naive")
        # gloo: the thread waits for each full_tensor() gather before the next and for each of
        # FSDP2's collectives (issued without async_op): one wait op right after each,
        # depending on it; separate engines only make the consumers wait (no wait ops)
        blocking = [j for j, op in enumerate(a) if op.kind == "all_gather" or op.kind.startswith("fsdp2_")]
        waits = [j for j, op in enumerate(a) if op.kind == "wait"]
        assert waits == [j + 1 for j in blocking] and all(a[j].deps == (j - 1,) for j in waits)
        assert sum(1 for op in a if op.kind == "fsdp2_reduce_scatter") == len(plan.fsdp2_units) > 1  # one per unit
        gpu = _lower(ops, plan, dataclasses.replace(hw, comm_engine="separate"), wl, variant=variant, num_ranks=n)
        assert not any(op.kind == "wait" for op in gpu)


@pytest.mark.parametrize("mesh, kind", [(4, "reduce_scatter"), (4, "all_gather"), ((2, 2), "all_reduce")])
def test_fsdp2_collectives_block_the_thread_on_gloo(mesh, kind):
    """FSDP2 issues its all-gathers (prefetches included) and its gradient reduce-scatter /
    HSDP all-reduce without ``async_op``: on gloo the thread waits for the whole collective, so
    each extra second of one moves the step by exactly that second per call (one rank per core,
    nothing to hide it behind); on a GPU preset's streams the compute goes on, and of the
    gradient collectives only the two after the last backward (the first block's, the root's)
    are exposed."""
    from dmuon.sim._engine.simulate import _variant_ops

    plan = P.compile(zoo.tiny_llama(), mesh)
    group = plan.mesh_shape[0] if kind == "all_reduce" else plan.mesh_shape[1]

    def curve(seconds):
        return (H.CollectiveCurve(kind=kind, group_size=group, nbytes=(1, 2), seconds=(seconds, seconds)),)

    ops, *_ = _variant_ops(plan, "adamw", None, False)
    calls = sum(1 for op in ops if op.kind == "fsdp2_" + kind and 0 in op.group)  # rank 0's calls
    assert calls == len(plan.fsdp2_units) * (2 if kind == "all_gather" else 1) - (
        kind == "all_gather"
    )  # root: no re-gather
    gloo = (_cpu(ranks_per_node=4, cores_per_node=4), S.from_plan(plan, tokens_per_rank=512, seq_len=128))
    gpu = (H.preset("h100"), S.from_plan(plan, tokens_per_rank=2**22, seq_len=128))  # ~50 ms per block backward
    for hw, w in (gloo, gpu):
        fast, slow = (
            S.simulate(plan, dataclasses.replace(hw, curves=curve(s)), w, variant="adamw").step_s for s in (1e-3, 11e-3)
        )
        if hw is gloo[0]:
            assert slow - fast == pytest.approx(calls * 10e-3)
        elif kind == "all_gather":
            assert slow - fast < calls * 10e-3 - 1e-3
        else:
            assert slow - fast == pytest.approx(2 * 10e-3)


def test_step_factor_and_blocking_wait_by_hand():
    """A blocking wait on k ranks costs FSDP2's k-rank call less its 1-rank call, on gloo only and
    for measured k; the step-compute factor is 1 at k = 1 and where not measured; the
    calibration's three FSDP2 stacks give the fixed cost and the factor (by hand)."""
    hw = _cpu(
        fsdp2_call_s=4e-4, fsdp2_call_s_by_group=((2, 2e-3), (4, 5e-3)), step_compute_factor_by_group=((2, 1.25),)
    )
    assert (H.blocking_wait_s_at(hw, 2), H.blocking_wait_s_at(hw, 4)) == (pytest.approx(1.6e-3), pytest.approx(4.6e-3))
    assert H.blocking_wait_s_at(hw, 3) == 0.0 and H.blocking_wait_s_at(hw, 1) == 0.0
    assert H.blocking_wait_s_at(dataclasses.replace(hw, comm_engine="separate"), 2) == 0.0
    assert (H.step_compute_factor_at(hw, 1), H.step_compute_factor_at(hw, 2), H.step_compute_factor_at(hw, 4)) == (
        1.0,
        1.25,
        1.0,
    )
    assert H.Hardware.from_dict(json.loads(json.dumps(hw.to_dict()))) == hw
    # three stacks by hand: 2 ms fixed (+ 3 ms on the block-sized units), 0.2 s extra per second
    # of compute between the 12 calls
    from dmuon.sim._calibrate import fsdp2_terms

    def stack(fixed_s, compute_s):
        return dict(call_s=fixed_s + 0.2 * compute_s / 12, compute_s=compute_s, calls=12)

    fixed, factor = fsdp2_terms(stack(2e-3, 0.002), stack(5e-3, 0.02), stack(5e-3, 0.08))
    assert (fixed, factor) == (pytest.approx(2e-3), pytest.approx(1.2))
    # noise below zero clamps to the physical range (no compute share then: the fixed cost is the
    # small stack's whole per-call cost)
    small = stack(2e-3, 0.002)
    assert fsdp2_terms(small, stack(5e-3, 0.08), stack(5e-3, 0.02)) == (small["call_s"], 1.0)


def test_step_factor_and_blocking_waits_reach_the_ops(tiny):
    """The step-compute factor scales exactly the forward / backward (and the root's) compute, not
    Newton-Schulz or the optimizer; dmuon pays one blocking wait per (phase, boundary) of its
    broadcasts (or all-gathers) and one per micro-batch for its reduces (or reduce-scatters), FSDP2 +
    AdamW none beyond its calls."""
    from dmuon.sim._engine.lower import _lower
    from dmuon.sim._engine.simulate import _variant_ops

    plan, wl = tiny
    hw = _cpu(ranks_per_node=4, cores_per_node=4)
    more = dataclasses.replace(
        hw, fsdp2_call_s=1e-4, fsdp2_call_s_by_group=((4, 1.1e-3),), step_compute_factor_by_group=((4, 1.5),)
    )  # a blocking wait: 1 ms
    for variant in ("z3", "z2", "adamw"):
        ops, n, *_ = _variant_ops(plan, variant, None, False)
        a, b = (_lower(ops, plan, h, wl, variant=variant, num_ranks=n) for h in (hw, more))
        for x, y in zip(a, b):
            # (dmuon's backwards also pack their gradients: not compute between collectives)
            if x.kind == "forward" or (x.kind == "backward" and not variant.startswith("z")):
                assert y.seconds == pytest.approx(1.5 * x.seconds)
            elif x.kind in ("newton_schulz", "optimizer"):
                assert y.seconds == x.seconds
        fsdp = sum(1 for op in a if op.kind.startswith("fsdp2_"))
        # the parameter phases' broadcasts or all-gathers, the gradient reduces or reduce-scatters
        groups = {
            (op.phase, op.boundary, op.micro_batch)
            for op in ops
            if op.kind in ("broadcast", "all_gather") and op.phase.endswith("broadcast")
        }
        drains = {op.micro_batch for op in ops if op.kind in ("reduce", "reduce_scatter") and op.phase == "reduce"}
        waits = len(groups) + len(drains) if variant.startswith("z") else 0
        extra = sum(y.host_s - x.host_s for x, y in zip(a, b))
        assert extra == pytest.approx(fsdp * 1.1e-3 + waits * 1e-3)
        assert (waits > 0) == variant.startswith("z")


def test_comm_cpu_share_stretches_the_overlapped_part():
    """gloo's threads share the cores: a 2 s broadcast issued before a 3 s compute op overlaps
    2 s of it, so with share 0.5 the op takes 3 + 0.5 * 2 = 4 s; a compute op after the
    broadcast has ended is not stretched."""
    ops = [
        _SimOp("broadcast", "b", (0, 1), (), True, 2.0, 0.0, "bcast"),
        _SimOp("forward", "f", (0, 1), (), False, 3.0),
        _SimOp("forward", "g", (0, 1), (), False, 1.0),
    ]
    for share, end in ((0.0, 4.0), (0.5, 5.0), (1.0, 6.0)):
        raw = replay_ops(ops, 2, _cpu(comm_cpu_share_by_group=((2, share),)))
        assert list(raw["rank_end"]) == [end, end]  # f: 0 .. 3 + 2 share, g: 1 s after
        assert list(raw["busy"]) == [4.0 + 2 * share] * 2


# ------------------------------------------------------------------ a 2-rank replay by hand


def _cpu(**kw):
    base = dict(
        name="hand",
        ranks_per_node=2,
        intra=LINK,
        inter=LINK,
        matmul_peak_flops=(("torch.float32", 1e9),),
        comm_engine="threads",
        cores_per_node=2,
    )
    base.update(kw)
    return H.Hardware(**base)


def test_two_rank_critical_path_by_hand():
    """forward: rank 0 1 s, rank 1 3 s; reduce to rank 0 (2 s) after it; NS on rank 0 (1.5 s);
    rank 1 then a backward of 0.5 s. By hand: the reduce starts when rank 1 issues it (3 s), ends
    at 5 s; NS runs 5-6.5 s; the step is 6.5 s; the critical path is rank 1's forward, the
    reduce, rank 0's NS. Rank 0 waits 4 s for the reduce; rank 1 is busy 3.5 s, its reduce runs
    1.5 s past its thread, it idles 3 s."""
    ops = [
        _SimOp("forward", "f", (0, 1), (), False, np.array([1.0, 3.0])),
        _SimOp("reduce", "r", (0, 1), (0,), True, 2.0, 0.0, "reduce"),
        _SimOp("newton_schulz", "ns", (0,), (1,), False, 1.5, ns=True),
        _SimOp("backward", "b", (1,), (), False, 0.5),
    ]
    hw = _cpu()
    raw = replay_ops(ops, 2, hw, timeline_ranks=(0, 1))
    assert list(raw["rank_end"]) == [6.5, 5.0]
    assert list(raw["busy"]) == [2.5, 3.5]
    assert list(raw["wait"]) == [4.0, 0.0]
    assert list(raw["ns"]) == [1.5, 0.0]
    rank, path = _critical_path(ops, raw)
    assert rank == 0
    assert [(p.label, p.rank, p.start_s, p.end_s) for p in path] == [
        ("f", 1, 0.0, 3.0),
        ("r", 1, 3.0, 5.0),
        ("ns", 0, 5.0, 6.5),
    ]
    lanes = {(i.lane, i.label, i.start_s, i.end_s) for i in raw["timelines"][1]}
    assert lanes == {("compute", "f", 0.0, 3.0), ("reduce", "r", 3.0, 5.0), ("compute", "b", 3.0, 3.5)}


def test_separate_engines_issue_while_the_previous_op_runs():
    """GPU: the collective after a compute op is issued when that op starts (the CPU runs ahead)."""
    ops = [
        _SimOp("forward", "f", (0, 1), (), False, 2.0),
        _SimOp("broadcast", "b", (0, 1), (), True, 1.0, 0.0, "bcast"),
        _SimOp("forward", "g", (0, 1), (1,), False, 1.0),
    ]
    threads = replay_ops(ops, 2, _cpu())
    separate = replay_ops(ops, 2, _cpu(comm_engine="separate"))
    assert list(threads["rank_end"]) == [4.0, 4.0]  # broadcast 2-3 s, g 3-4 s
    assert list(separate["rank_end"]) == [3.0, 3.0]  # broadcast 0-1 s, hidden behind f
    assert list(separate["wait"]) == [0.0, 0.0]


def test_processor_sharing_slows_compute_when_ranks_outnumber_cores():
    hw = _cpu(ranks_per_node=4, cores_per_node=2)
    assert hw.oversubscription == 2.0
    plan = P.compile(zoo.tiny_llama(), 4)
    wl = S.from_plan(plan, tokens_per_rank=256, seq_len=64, activation_dtype="torch.float32")
    shared = S.simulate(plan, hw, wl, variant="adamw")
    alone = S.simulate(plan, dataclasses.replace(hw, cores_per_node=4), wl, variant="adamw")
    busy = lambda s: max(r.busy_s for r in s.ranks)  # noqa: E731
    assert busy(shared) > 1.9 * busy(alone)


# ------------------------------------------------------------------ whole plans


@pytest.fixture(scope="module")
def tiny():
    plan = P.compile(zoo.tiny_llama(), 4)
    wl = S.from_plan(plan, tokens_per_rank=512, seq_len=128)
    return plan, wl


def test_simulation_accounts_every_second(tiny):
    plan, wl = tiny
    for hw in (H.preset("h100"), _cpu(ranks_per_node=4)):
        for v, sim in S.simulate_variants(plan, hw, wl).items():
            assert sim.step_s == pytest.approx(max(r.end_s for r in sim.ranks))
            for r in sim.ranks:
                assert r.busy_s + r.comm_wait_s + r.idle_s == pytest.approx(sim.step_s, rel=1e-9), v
            path = sim.critical_path
            assert path[0].start_s == pytest.approx(0.0, abs=1e-9) or path[0].start_s <= path[0].end_s
            assert path[-1].end_s == pytest.approx(sim.step_s)
            for a, b in zip(path, path[1:]):
                assert b.start_s >= a.end_s - 1e-12, (v, a, b)
            assert set(sim.timelines) == set(range(4))
            assert (sim.ns_s > 0) == (v != "adamw")


def test_dmuon_bytes_equal_the_plan(tiny):
    plan, wl = tiny
    for z3 in (False, True):
        p = P.compile(zoo.tiny_llama(), 4, reshard_after_forward=z3)
        sim = S.simulate(p, H.preset("h100"), wl)
        fsdp = S.alternatives.moved_nbytes([op for op in p.schedule().ops if op.kind.startswith("fsdp2_")])
        assert sim.comm_nbytes == p.cost.total_nbytes + fsdp
    # FSDP2 + AdamW moves every parameter: 2 all-gathers + 1 reduce-scatter of (k-1)/k of each
    ops = S.alternatives.build("adamw", plan)
    total = 0
    for u in plan.fsdp2_units:
        total += (
            sum(3 * C.fsdp2_shard_numel(s, 4) * 4 * 3 * 4 for s in u.shapes)
            if u.fqn
            else sum(2 * C.fsdp2_shard_numel(s, 4) * 4 * 3 * 4 for s in u.shapes)
        )
    total += sum(3 * C.fsdp2_shard_numel(s.local_shape, 4) * 4 * 3 * 4 for s in plan.params)
    assert S.alternatives.moved_nbytes(ops) == total


def test_alternatives_structure(tiny):
    plan, _ = tiny
    naive = S.alternatives.build("naive", plan)
    ns = [op for op in naive if op.kind == "newton_schulz"]
    assert len(ns) == len(plan.params) and all(op.group == (0, 1, 2, 3) for op in ns)
    a2a = S.alternatives.build("all_to_all", plan)
    ns = [op for op in a2a if op.kind == "newton_schulz"]
    assert len(ns) == len(plan.params) and all(len(op.group) == 1 for op in ns)
    # each rank runs about total / N of the NS FLOPs (batches of N matrices)
    per = [sum(op.flops for op in ns if op.group == (r,)) for r in range(4)]
    assert sum(per) == sum(CF.ns_flops(*s.matrix_shape) for s in plan.params)
    # batches of N = 4 same-shape matrices: q/o 8 -> 2, k/v 8 -> 2, gate/up 8 -> 2, down 4 -> 1; 2 all-to-alls each
    assert len([op for op in a2a if op.kind == "all_to_all"]) == 2 * 7
    with pytest.raises(ValueError, match="unknown alternative"):
        S.alternatives.build("zero1", plan)


def test_workload_terms_by_hand():
    plan = P.compile(zoo.tiny_llama(), 2)
    t, s = 512, 128
    wl = S.from_plan(plan, tokens_per_rank=t, seq_len=s, activation_dtype="torch.float32")
    w = wl.work("model.layers.0")
    # q, o (64, 64); k, v (32, 64); gate, up (160, 64); down (64, 160)
    weights = 2 * 64 * 64 + 2 * 32 * 64 + 3 * 160 * 64
    assert w.matmul_flops == 2 * t * weights
    assert w.attention_flops == 2 * 2 * t * s * 64 // 2  # causal: half of Q K^T and P V
    assert w.ops == 7 * 2 + 2 * 6 + 10
    # SwiGLU: the activation runs on gate_proj's output; every other matmul output is one pass
    assert w.activation_numel == t * 160
    assert w.elementwise_nbytes == 2 * t * 4 * (64 + 32 + 32 + 64 + 160 + 64)
    assert w.norm_numel == 2 * t * 64
    assert w.attention_head_d == pytest.approx((s * s * 64) ** (1 / 3))  # default: min(128, d_attn = 64)
    heads = S.from_plan(plan, tokens_per_rank=t, seq_len=s, head_dim=16).work("model.layers.0")
    assert heads.attention_head_d == pytest.approx((s * s * 16) ** (1 / 3))
    assert wl.head.norm_numel == t * 64 and wl.head.activation_numel == 0  # the final norm; lm_head is a matmul
    from dmuon._train.byte_gpt import GPT, GPTConfig

    gpt = P.compile(GPT(GPTConfig(d_model=32, d_mlp=128, n_layers=1, n_heads=2, seq_len=16), device="meta"), 2)
    g = S.from_plan(gpt, tokens_per_rank=t, seq_len=16, activation_dtype="torch.float32").work("layers.0")
    assert g.activation_numel == t * 128  # up_proj feeds the GELU
    assert g.elementwise_nbytes == 2 * t * 4 * (4 * 32 + 32)  # q, k, v, o, down_proj
    with pytest.raises(ValueError, match="head_dim"):
        S.from_plan(plan, tokens_per_rank=t, seq_len=s, head_dim=0)
    assert w.activation_nbytes == 34 * t * 64 * 4 // 2
    assert wl.head.matmul_flops == 2 * t * 256 * 64  # lm_head
    assert wl.embed.matmul_flops == 0
    assert wl.forward_flops == 4 * w.flops + wl.head.flops
    two = S.from_plan(plan, tokens_per_rank=t, seq_len=s, micro_batches=2)
    assert two.work("model.layers.0").matmul_flops == w.matmul_flops // 2
    moe = P.compile(zoo.tiny_moe(), 2, predicate=P.matrix_predicate(zoo.tiny_moe()))
    mw = S.from_plan(moe, tokens_per_rank=t, seq_len=s).work("layers.0")
    expert_flops = 2 * t * 2 * (3 * 48 * 32)  # top_k = 2 of 4 experts: k/E of the stacked weights
    dense = 2 * t * (2 * 32 * 32 + 2 * 16 * 32 + 4 * 32)  # attention projections + router
    assert mw.matmul_flops == pytest.approx(expert_flops + dense, rel=1e-9)


def test_memory_terms(tiny):
    plan, wl = tiny
    z2 = S.simulate(P.compile(zoo.tiny_llama(), 4, reshard_after_forward=False), H.preset("h100"), wl)
    z3 = S.simulate(plan, H.preset("h100"), wl)
    assert max(z3.peak_memory_nbytes) < max(z2.peak_memory_nbytes)
    owned = sum(s.numel * 4 for s in plan.params)
    assert (
        sum(r.memory.optimizer_state_nbytes for r in z3.ranks)
        - 4 * 2 * sum(C.fsdp2_shard_numel(s, 4) * 4 for u in plan.fsdp2_units for s in u.shapes)
        == owned
    )
    assert all(r.memory.activations_nbytes == wl.activation_nbytes for r in z3.ranks)


def test_early_ns_is_a_reordering(tiny):
    plan, _ = tiny
    for mesh in (4, (2, 2)):
        p = P.compile(zoo.tiny_llama(), mesh)
        sched = p.schedule()
        early = S.early_ns_schedule(sched)
        key = lambda o: (o.kind, o.phase, o.group, o.root, o.numel, o.flops, o.fqns, o.boundary, o.segment)  # noqa: E731
        assert sorted(map(key, early.ops)) == sorted(map(key, sched.ops))
        assert C.schedule_byte_cost(early) == C.schedule_byte_cost(sched)
        kinds = [o.kind for o in early.ops]
        assert kinds.index("newton_schulz") < len(kinds) - 1 - kinds[::-1].index("backward")
        for op in early.ops:
            assert all(d < op.id for d in op.deps)


def test_hsdp_replicate_broadcast_is_deferred():
    plan = P.compile(zoo.tiny_llama(), (2, 2))
    wl = S.from_plan(plan, tokens_per_rank=512, seq_len=128)

    def last_replicate_broadcast_end(sim):
        return max(i.end_s for tl in sim.timelines.values() for i in tl if i.label.startswith("replicate_broadcast"))

    # one node (a100: 8 ranks per node): the broadcasts finish under the optimizer step, nothing runs past it
    sim = S.simulate(plan, H.preset("a100"), wl)
    sync = S.simulate(dataclasses.replace(plan, replicate_async=False), H.preset("a100"), wl)
    assert sim.step_s <= sync.step_s
    assert last_replicate_broadcast_end(sim) < sim.step_s
    assert sim.deferred_comm_s == 0.0 and sync.deferred_comm_s == 0.0
    # replicas on two nodes over a slow link: the broadcasts outlast the step. deferred_comm_s is how
    # far the last one runs past step_s, and the synchronous step waits for exactly that much more
    a100 = H.preset("a100")
    slow = dataclasses.replace(
        a100,
        ranks_per_node=2,
        curves=(),
        inter=dataclasses.replace(a100.inter, bandwidth_Bps=a100.inter.bandwidth_Bps / 100),
    )
    sim = S.simulate(plan, slow, wl)
    sync = S.simulate(dataclasses.replace(plan, replicate_async=False), slow, wl)
    assert sim.deferred_comm_s > 0.0
    assert sim.deferred_comm_s == pytest.approx(last_replicate_broadcast_end(sim) - sim.step_s, rel=1e-12)
    assert sync.deferred_comm_s == 0.0
    assert sync.step_s == pytest.approx(sim.step_s + sim.deferred_comm_s, rel=1e-9)


# ------------------------------------------------------------------ invariants (hypothesis)


_MESHES = st.sampled_from([2, 4, 8, (2, 4), (2, 8), 16])


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    layers=st.integers(1, 3),
    hidden=st.sampled_from([64, 128, 256]),
    mesh=_MESHES,
    factor=st.floats(1.0, 20.0),
    hw=st.sampled_from(["h100", "a100", "a800"]),
    z3=st.booleans(),
    tokens=st.sampled_from([256, 4096]),
)
def test_more_bandwidth_never_slows_a_gpu_step(layers, hidden, mesh, factor, hw, z3, tokens):
    model = zoo.llama(
        num_layers=layers, hidden=hidden, kv_dim=hidden // 2, intermediate=2 * hidden, vocab=512, head_dim=32
    )
    plan = P.compile(model, mesh, reshard_after_forward=z3)
    wl = S.from_plan(plan, tokens_per_rank=tokens, seq_len=min(tokens, 1024))
    base = H.preset(hw)
    fast = base.with_bandwidth(factor)
    for v in S.VARIANTS:
        slow_s = S.simulate(plan, base, wl, variant=v, timeline_ranks=()).step_s
        fast_s = S.simulate(plan, fast, wl, variant=v, timeline_ranks=()).step_s
        assert fast_s <= slow_s * (1 + 1e-12), (v, fast_s, slow_s)


@settings(max_examples=15, deadline=None)
@given(
    layers=st.integers(1, 3),
    hidden=st.sampled_from([64, 128, 192]),
    mesh=_MESHES,
    mp=st.sampled_from([None, "bfloat16"]),
)
def test_z2_never_moves_more_bytes_than_z3(layers, hidden, mesh, mp):
    model = zoo.llama(
        num_layers=layers,
        hidden=hidden,
        kv_dim=hidden // 2 if hidden != 192 else 64,
        intermediate=3 * hidden,
        vocab=256,
        head_dim=32,
    )
    pol = SimpleNamespace(param_dtype=mp, reduce_dtype=None) if mp else None
    z2 = P.compile(model, mesh, reshard_after_forward=False, mp_policy=pol)
    z3 = P.compile(model, mesh, reshard_after_forward=True, mp_policy=pol)
    assert z2.cost.total_nbytes <= z3.cost.total_nbytes
    assert all(a <= b for a, b in zip(z2.cost.per_rank_nbytes, z3.cost.per_rank_nbytes))
    wl = S.from_plan(z3, tokens_per_rank=256, seq_len=256)
    hw = H.preset("h100")
    assert (
        S.simulate(z2, hw, wl, timeline_ranks=()).comm_nbytes <= S.simulate(z3, hw, wl, timeline_ranks=()).comm_nbytes
    )


# ------------------------------------------------------------------ CLI


def test_gantt_draws_every_interval_with_a_duration(tiny):
    """One bar per timeline interval of positive length; a gloo thread's zero-length waits (an
    FSDP2 call whose collective was already done when it returned) draw nothing and get no
    legend entry."""
    pytest.importorskip("matplotlib")
    from matplotlib.patches import Rectangle

    from dmuon.sim._pages.sim_plot import gantt

    plan, wl = tiny
    sims = {v: S.simulate(plan, _cpu(ranks_per_node=4, cores_per_node=4), wl, variant=v) for v in ("adamw", "z3")}
    assert any(iv.kind == "wait" and iv.end_s == iv.start_s for iv in sims["adamw"].timelines[0])
    fig = gantt(sims, 0)
    for ax, sim in zip(fig.axes, sims.values()):
        bars = [p for p in ax.patches if isinstance(p, Rectangle)]
        assert len(bars) == sum(1 for iv in sim.timelines[0] if iv.end_s > iv.start_s)
    labels = {t.get_text() for t in fig.legends[0].get_texts()}
    assert "wait" not in labels and {"forward", "backward", "fsdp2_reduce_scatter"} <= labels
    import matplotlib.pyplot as plt

    plt.close(fig)


def test_simulate_cli(tmp_path, capsys):
    from dmuon.__main__ import main

    out = tmp_path / "s.json"
    assert (
        main(
            [
                "simulate",
                "--model",
                "llama3-8b",
                "--mesh",
                "8",
                "--hw",
                "h100",
                "--tokens-per-rank",
                "4096",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    text = capsys.readouterr().out
    assert "recommended: dmuon" in text
    d = json.loads(out.read_text())
    assert set(d["variants"]) == set(S.VARIANTS)
    # the memory block: every variant's busiest rank by term (the JSON's busiest_memory_nbytes), and
    # the dmuon modes against FSDP2 + AdamW's peak (Llama-3-8B on 8: below it)
    assert "peak memory per rank, busiest rank, GiB" in text
    for v, fig in d["variants"].items():
        mem = fig["busiest_memory_nbytes"]
        terms = ("parameters_nbytes", "gradients_nbytes", "optimizer_state_nbytes", "transient_nbytes")
        assert (
            mem["peak_nbytes"] == sum(mem[t] for t in terms + ("activations_nbytes",)) == max(fig["peak_memory_nbytes"])
        ), v
    assert "dmuon Z3: every rank at or below FSDP2 + AdamW's peak" in text
    assert d["variants"]["adamw"]["ratio_to_adamw"] == 1.0
    assert d["variants"]["naive"]["step_ms"] > d["variants"]["z3"]["step_ms"]
    assert d["recommended"] in ("z2", "z3")
    assert (
        main(["simulate", "--model", "tiny-llama", "--mesh", "2x2", "--hw", "a100", "--tp", "2", "--mode", "z2"]) == 0
    )
    text = capsys.readouterr().out
    assert "z3 " not in text and "z2 " in text
    with pytest.raises(SystemExit):
        main(["simulate", "--model", "llama3-8b", "--mesh", "8", "--hw", "tpu"])


def test_simulate_cli_user_errors(tmp_path, capsys):
    """Each user error is one argparse error (exit 2, no traceback) naming the problem: a TP degree
    that does not divide the model's widths (with the degrees that do), an unreadable calibration record, a dtype, a sequence length,
    a folder given as an output file; a model that cannot fit prints a warning, not a silent pick."""
    from dmuon.__main__ import main

    bad_record = tmp_path / "bad.json"
    bad_record.write_text('{"name": "not a record"}')
    corrupt = tmp_path / "corrupt.json"
    corrupt.write_text("{\n")
    cases = [
        (
            ["--tp", "3"],
            ["--tp 3 does not divide the widths tensor parallelism splits (1024, 4096, 14336); use --tp 2"],
        ),
        (["--hw", str(bad_record)], ["not a preset", "calibrate --json"]),
        (["--hw", str(corrupt)], [str(corrupt), "JSONDecodeError"]),
        (["--param-dtype", "fp8"], ["'fp8' is not a floating-point torch dtype dmuon's buffers carry"]),
        (["--seq-len", "0"], ["--seq-len must be between 1 and"]),
        (["--json", str(tmp_path)], ["is a folder"]),
    ]
    for extra, needles in cases:
        argv = ["simulate", "--model", "llama3-8b", "--mesh", "8", "--hw", "h100", "--tokens-per-rank", "4096", *extra]
        with pytest.raises(SystemExit) as e:
            main(argv)
        err = capsys.readouterr().err
        assert e.value.code == 2 and "Traceback" not in err, extra
        assert all(n in err for n in needles), (extra, err[-400:])
        assert len(err.splitlines()) < 30, extra
    assert main(["simulate", "--model", "llama3-70b", "--mesh", "8x128", "--hw", "h100", "--mode", "z2"]) == 0
    assert "warning: no dmuon mode fits the device: Z2 peaks at" in capsys.readouterr().out


# ------------------------------------------------------------------ purity


SIM_FILES = sorted((pathlib.Path(__file__).resolve().parents[2] / "dmuon" / "sim").rglob("*.py"))


@pytest.mark.parametrize("path", [p for p in SIM_FILES if "_calibrate" not in p.parts], ids=lambda p: p.name)
def test_sim_never_imports_distributed_or_exec(path):
    """dmuon/sim is pure like dmuon/plan; only _calibrate/ (gloo microbenchmarks, run by the
    `calibrate` command in its own processes) touches torch.distributed."""
    from tests.plan.test_plan_static import offending_imports

    assert offending_imports(path) == []


def test_step_time_prediction_column():
    """benchmarks/step_time.py's `pred ms` column: simulate of the benchmark's own plan and GPT."""
    import sys

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "benchmarks"))
    import step_time

    hw = _cpu(ranks_per_node=2, compute_dtype="torch.float32", ns_dtype="torch.float32")
    preds = {v: step_time.predict("small", 2, v, hw, "ns_flops") for v in step_time.SIM_VARIANT}
    assert all(p["step_ms"] > 0 for p in preds.values())
    assert preds["adamw"]["ns_ms"] == 0 and preds["naive"]["ns_ms"] > preds["dmuon_z3"]["ns_ms"] > 0
    assert step_time.predict("small", 1, "plain", hw, "ns_flops") is None
    rows = [dict(size="small", nproc=2, variant=v, step_ms=100.0) for v in ("adamw", "dmuon_z3")]
    step_time.add_predictions(rows, [hw, hw], "ns_flops")
    assert rows[0]["predicted_ratio"] == 1.0 and rows[1]["predicted_ms_all"] == [rows[1]["predicted_ms"]] * 2
    # --calibrate: a launch's rows from the calibrations that bracket it, not the sitting's median
    slow = dataclasses.replace(hw, matmul_peak_flops=tuple((d, f / 2) for d, f in hw.matmul_peak_flops))
    rows2 = [dict(size="small", nproc=n, variant="adamw", step_ms=100.0) for n in (2, 4)]
    step_time.add_predictions(rows2, [hw, hw, slow, slow], "ns_flops", {2: [hw, hw], 4: [slow, slow]})
    assert rows2[0]["predicted_ms"] == preds["adamw"]["step_ms"]
    assert rows2[1]["predicted_ms"] == step_time.predict("small", 4, "adamw", slow, "ns_flops")["step_ms"]
    assert rows2[1]["predicted_ms"] > step_time.predict("small", 4, "adamw", hw, "ns_flops")["step_ms"]


def test_calibrate_assembles_the_record(monkeypatch):
    """``calibrate`` turns its measurements into the record: the gloo launches faked (they need
    processes), everything else measured for real in quick mode; the in-situ figures are each
    one's median over the repeats (by hand), the new kernel curves present with ``d`` rising."""
    from dmuon.sim import _calibrate as K

    runs = [
        dict(fsdp2_call_s=3e-3, dtensor_gather_s=1e-3, comm_cpu_share=0.9, step_compute_factor=1.1),
        dict(fsdp2_call_s=1e-3, dtensor_gather_s=4e-3, comm_cpu_share=0.2, step_compute_factor=1.3),
        dict(fsdp2_call_s=2e-3, dtensor_gather_s=2e-3, comm_cpu_share=0.5, step_compute_factor=1.2),
    ]
    assert K._median_of_runs(runs) == dict(
        fsdp2_call_s=2e-3, dtensor_gather_s=2e-3, comm_cpu_share=0.5, step_compute_factor=1.2
    )

    def fake_launch(fn, world, sizes, repeats, fsdp_solo, in_situ_repeats, timeout_s=300.0):
        assert fn is K._worker
        res = {kind: [(b, 1e-5 * world + b * 1e-9) for b in sizes] for kind in K.KINDS}
        res.update(issue_s=1e-4, in_situ=K._median_of_runs([{k: v * world for k, v in r.items()} for r in runs]))
        if fsdp_solo:
            res["fsdp"] = dict(fsdp2_call_s=3e-4, dtensor_op_s=1e-6)
        return [res] + [None] * (world - 1)  # rank 0 returns the measurements

    monkeypatch.setattr(K, "run_distributed", fake_launch)
    monkeypatch.setattr(K, "_busy_node", lambda repeats: dict(busy_compute_factor=1.2, busy_memory_factor=1.3))
    hw, raw = K.calibrate(group_sizes=(2, 3), quick=True)
    assert (hw.busy_compute_factor, hw.busy_memory_factor) == (1.2, 1.3)
    assert hw.fsdp2_call_s_by_group == ((2, 4e-3), (3, 6e-3))
    assert hw.comm_cpu_share_by_group == ((2, 1.0), (3, 1.5))
    assert hw.dtensor_gather_s_by_group == ((2, 4e-3), (3, 6e-3))
    assert hw.step_compute_factor_by_group == (pytest.approx((2, 2.4)), pytest.approx((3, 3.6)))
    assert H.collective_s(hw, "broadcast", (0, 1), 4096) == pytest.approx(2e-5 + 4096e-9)
    for curve in (hw.attention_efficiency, hw.ns_efficiency, hw.autograd_matmul_efficiency):
        assert len(curve) >= 2 and all(b[0] > a[0] for a, b in zip(curve, curve[1:])) and all(e > 0 for _, e in curve)
    assert hw.norm_train_s_per_numel > 0 and hw.activation_train_s_per_numel > 0
    assert len(raw["newton_schulz"]) == len(K.QUICK_NS_SHAPES)
    assert [round(d) for d, _ in hw.gram_ns_efficiency] == [round((128 * 128 * 512) ** (1 / 3))]  # 1:4 only
    assert hw.ns_batch_factor == tuple((d, float(b), f) for d, b, f in raw["ns_batch_factor"])
    assert [(round(d), b) for d, b, _ in hw.ns_batch_factor] == [(128, 4)] and hw.ns_batch_factor[0][2] > 0
    assert H.Hardware.from_dict(json.loads(json.dumps(hw.to_dict()))) == hw


def _in_situ_worker():
    import torch
    import torch.distributed as dist

    from dmuon.sim._calibrate import gloo as K

    return K._in_situ(dist, torch, dist.group.WORLD, dist.get_world_size(), 3)


def test_in_situ_measurement_runs_in_a_real_group():
    """The in-situ measurements (FSDP2 stacks, DTensor gather, CPU share) on a real 2-rank gloo
    group: every figure present, finite, in its physical range, the same on both ranks (they are
    max-reduced). Timings themselves have no oracle here; benchmarks/results/2026-12-01-step-time-simulator.md compares the
    simulator they feed against measured steps."""
    from dist_utils import run_distributed

    res = run_distributed(_in_situ_worker, 2, timeout_s=240)
    assert res[0] == res[1]
    r = res[0]
    assert set(r) == {"fsdp2_call_s", "dtensor_gather_s", "comm_cpu_share", "step_compute_factor"}
    assert all(math.isfinite(v) for v in r.values())
    assert r["fsdp2_call_s"] >= 0 and r["dtensor_gather_s"] >= 0 and 0 <= r["comm_cpu_share"] <= 1
    assert r["step_compute_factor"] >= 1


def test_simulate_accepts_the_plan_selection_options(tmp_path, capsys):
    """`simulate` takes every plan-selection option `plan` takes (one definition,
    dmuon._cli.plan_commands.add_selection_args), and they reach the simulated plan."""
    import argparse

    from dmuon.__main__ import main
    from dmuon._cli.plan_commands import add_selection_args

    p = argparse.ArgumentParser()
    add_selection_args(p)
    options = [o for a in p._actions for o in a.option_strings if o.startswith("--") and o != "--help"]
    assert {
        "--all-matrices",
        "--experts",
        "--expert-gate-up",
        "--tp-ns",
        "--owner-groups",
        "--cost-model",
        "--param-dtype",
        "--reduce-dtype",
        "--tp",
    } <= set(options)
    for cmd in ("plan", "simulate"):
        with pytest.raises(SystemExit) as e:
            main([cmd, "--help"])
        assert e.value.code == 0
        text = capsys.readouterr().out
        assert all(o in text for o in options), (cmd, [o for o in options if o not in text])

    def z3(*extra):
        out = tmp_path / "s.json"
        assert main(["simulate", "--hw", "a100", "--tokens-per-rank", "1024", "--json", str(out), *extra]) == 0
        capsys.readouterr()
        return json.loads(out.read_text())["variants"]["z3"]

    moe = ["--model", "tiny-moe", "--mesh", "4"]
    assert z3(*moe)["ns_ms"] > z3(*moe, "--experts", "off")["ns_ms"]  # the expert stacks are dedicated by default
    tp = ["--model", "tiny-llama", "--mesh", "2", "--tp", "2"]
    assert z3(*tp, "--tp-ns", "gram") != z3(*tp, "--tp-ns", "gather")
    with pytest.raises(SystemExit) as e:  # the same refusal as `plan`
        main(["simulate", *tp, "--hw", "a100", "--owner-groups", "2"])
    assert e.value.code == 2 and "--owner-groups with --tp" in capsys.readouterr().err


def test_expert_plans_simulate_with_the_models_top_k_and_range_batches(monkeypatch):
    """Expert plans (several owners per stack) simulate: the workload's expert FLOPs follow the
    model's routing ``top_k`` (``model_top_k``, the CLI's default), and a batched NS call counts an
    owner's range of experts, not the whole stack (one NS op per range)."""
    import sys

    from dmuon._zoo import hf_moe
    from dmuon.plan._records.owners import ExpertOwners
    from dmuon.sim._engine.workload import from_plan, model_top_k

    m = hf_moe(
        num_layers=2, hidden=64, num_experts=8, moe_ffn=32, top_k=4, vocab=128, num_heads=4, num_kv_heads=2, head_dim=16
    )
    assert model_top_k(m) == 4 and model_top_k(torch_linear()) == 2
    plan = P.compile(m, 4)
    assert sum(1 for p in plan.params if p.experts is not None) == 4
    wl2, wl4 = (from_plan(plan, tokens_per_rank=256, seq_len=256, top_k=k) for k in (2, 4))
    dense = from_plan(plan, tokens_per_rank=256, seq_len=256, top_k=0).forward_flops
    assert wl4.forward_flops - dense == pytest.approx(2 * (wl2.forward_flops - dense), rel=1e-6)
    batches = []
    sim_mod = sys.modules["dmuon.sim._engine.lower"]
    real = sim_mod.ns_batch_factor_at
    monkeypatch.setattr(sim_mod, "ns_batch_factor_at", lambda hw, d, b: batches.append(b) or real(hw, d, b))
    hw = _cpu(
        ns_dtype="torch.float32",
        ns_efficiency=((16.0, 0.5), (512.0, 0.5)),
        ns_batch_factor=((32.0, 4.0, 0.8), (32.0, 16.0, 0.7)),
    )
    s = S.simulate(plan, hw, wl4, variant="z3")
    assert s.step_s > 0 and s.ns_s > 0
    owned = [0] * 4  # Muon matrices each rank orthogonalises
    for spec, o in zip(plan.params, plan.owners):
        if isinstance(o, ExpertOwners):
            for member, size in zip(o.members, o.sizes):
                owned[member.rank] += size * spec.experts.matrices_per_expert
        else:
            owned[o.rank] += spec.num_matrices
    # a call holds at most the matrices its rank owns (a range op counted as its whole stack's
    # 16 / 8 matrices overshot this)
    assert batches and max(batches) <= max(owned), (sorted(set(batches)), owned)


def torch_linear():
    import torch

    return torch.nn.Linear(2, 2)


# ------------------------------------------------------------------ fair FSDP2 baseline,
# all-gather / reduce-scatter phases, coalescing, expert parallelism's token all-to-all


def test_fsdp2_expert_stack_placement_by_hand():
    """torchtitan's apply_fsdp_to_decoder: a stack Shard(1) when its FSDP group outnumbers its
    (local) experts, else Shard(0); with EP over its efsdp group; dense tensors always Shard(0)."""
    from dmuon.plan._cost import baseline as B

    qwen_w1 = (128, 1536, 2048)  # Qwen3-30B-A3B gate_up, E = 128
    assert C.fsdp2_shard_numel(qwen_w1, 256, expert_stack=True) == 6 * 128 * 2048  # ceil(1536/256) rows of every expert
    assert C.fsdp2_shard_numel(qwen_w1, 256) == 1 * 1536 * 2048  # dim 0: one expert per rank, half the ranks empty
    assert C.fsdp2_shard_numel(qwen_w1, 64, expert_stack=True) == 2 * 1536 * 2048  # 64 <= 128: Shard(0)
    assert C.fsdp2_shard_numel((1536, 2048), 256, expert_stack=True) == 6 * 2048  # not 3-D: Shard(0)
    assert B.is_expert_stack("layers.0.mlp.experts.gate_up_proj", qwen_w1)
    assert not B.is_expert_stack("layers.0.mlp.experts.gate_up_proj", (1536, 2048))
    assert not B.is_expert_stack("layers.0.conv.weight", (8, 4, 3))
    name = "layers.0.mlp.experts.w1"
    # ep 8 on 64 ranks: 16 local experts over an efsdp group of 8 -> Shard(0)
    assert B.fsdp2_param_shard(name, (16, 1536, 2048), 64, ep=8) == (8, 2 * 1536 * 2048)
    # ep 128 on 256 ranks: 1 local expert over efsdp 2 -> Shard(1)
    assert B.fsdp2_param_shard(name, (1, 1536, 2048), 256, ep=128) == (2, 768 * 2048)
    # efsdp 1: FSDP2 has no group to shard over
    assert B.fsdp2_param_shard(name, (16, 1536, 2048), 8, ep=8) == (1, 16 * 1536 * 2048)
    assert B.fsdp2_param_shard("layers.0.attn.q.weight", (4096, 2048), 64, ep=8) == (64, 64 * 2048)  # dense: the row


def test_fair_baseline_bytes_by_hand():
    """tiny-moe (2 layers; q (32, 32), k / v (16, 32), o (32, 32), router (4, 32), stacks w1 / w3
    (4, 48, 32) and w2 (4, 32, 48), norms (32,)) on 8 ranks, fp32: per layer the dense shards are
    ceil(d0/8)*d1 = 128 + 64 + 64 + 128 + 32 = 416 elements; the stacks, 8 ranks > 4 experts,
    Shard(1): ceil(48/8)*4*32 = ceil(32/8)*4*48 = 768 each, 2,304 (dim 0 would pad each to 1 expert
    per rank, 1,536). Forward all-gather per rank 7 x 2 x 2,720 x 4 B = 152,320 B, x 8 ranks."""
    moe = zoo.tiny_moe()
    plan = P.compile(moe, 8)
    base = plan.baseline_cost
    assert base.forward_all_gather_nbytes == 8 * 7 * 2 * (416 + 2304) * 4 == 1_218_560
    assert base.total_nbytes == 4 * 1_218_560  # Z3: forward, backward, reduce-scatter, naive gather
    assert plan.baseline_rank_stats()[0].owned_numel == 2 * (416 + 2304)
    # the simulator's FSDP2 + AdamW: per boundary one all-gather of dense + norms (2 x 4) + stacks
    ops = S.alternatives.build("adamw", plan)
    ag = [(op.group, op.numel) for op in ops if op.kind == "fsdp2_all_gather" and op.boundary == "layers.0"]
    assert ag == [(tuple(range(8)), 416 + 8 + 2304)] * 2  # forward and backward
    # the same model with EP 2 (efsdp 4): dense over the row, each rank's 2 experts over ranks
    # j, j+2, j+4, j+6 -- 4 > 2 experts: Shard(1), ceil(48/4)*2*32 = ceil(32/4)*2*48 = 768 each
    from dmuon.plan._model.parallel import expert_parallel_variant

    ep_plan = P.compile(expert_parallel_variant(zoo.tiny_moe(), 2), 8, ep=2)
    ops = S.alternatives.build("adamw", ep_plan)
    ag = sorted((op.group, op.numel) for op in ops if op.kind == "fsdp2_all_gather" and op.boundary == "layers.0")
    assert ag == sorted([(tuple(range(8)), 424), ((0, 2, 4, 6), 2304), ((1, 3, 5, 7), 2304)] * 2)
    # EP 4 on 4 ranks (efsdp 1): no FSDP2 traffic for the stacks at all
    ep4 = P.compile(expert_parallel_variant(zoo.tiny_moe(), 4), 4, ep=4)
    ag = [
        (op.group, op.numel)
        for op in S.alternatives.build("adamw", ep4)
        if op.kind == "fsdp2_all_gather" and op.boundary == "layers.0"
    ]
    assert ag == [((0, 1, 2, 3), 8 * 32 + 4 * 32 + 4 * 32 + 8 * 32 + 1 * 32 + 2 * 8)] * 2  # dense + norms only
    with pytest.raises(ValueError, match="not modelled with expert parallelism"):
        S.alternatives.build("all_to_all", ep4)
    # experts="off": the stacks stay with FSDP2 under dmuon too, placed as the baseline places
    # them (Shard(1), 2,304) with the norms (2 x 4): dmuon's schedule and FSDP2 + AdamW agree
    off = P.compile(zoo.tiny_moe(), 8, experts="off")
    fsdp2 = sorted(
        {
            (op.kind, op.group, op.numel)
            for op in off.schedule().ops
            if op.kind.startswith("fsdp2_") and op.boundary == "layers.0"
        }
    )
    assert fsdp2 == [
        ("fsdp2_all_gather", tuple(range(8)), 2304 + 8),
        ("fsdp2_reduce_scatter", tuple(range(8)), 2304 + 8),
    ]


def _hand_hw(**kw):
    base = dict(
        name="hand",
        ranks_per_node=8,
        intra=LINK,
        inter=LINK,
        launch_s=5e-6,
        matmul_peak_flops=(("torch.float32", 1e12),),
        compute_dtype="torch.float32",
        ns_dtype="torch.float32",
    )
    base.update(kw)
    return H.Hardware(**base)


def _op(i, kind, phase, group=(0, 1, 2, 3), **kw):
    if kind in ("forward", "backward"):
        kw.setdefault("external", True)
    elif kind not in ("newton_schulz",):
        kw.setdefault("dtype", "torch.float32")
    return P.Op(id=i, kind=kind, phase=phase, group=group, **kw)


def test_dmuon_all_gather_and_reduce_scatter_run_on_their_phases_channel():
    """A dmuon all-gather on the forward phase and a reduce-scatter on the gradient phase (the
    per-buffer kinds of) are timed by the ring formula and run on the broadcast /
    reduce channels; a TP all-gather keeps the TP channel. By hand (k = 4, 1,000 fp32 per rank,
    alpha 10 us, 1 GB/s, launch 5 us): 5 + 3 x 10 + 3 x 4 = 47 us each; the TP gather does not
    queue behind the forward gather (both start at 0)."""
    plan = P.compile(zoo.tiny_llama(), 4)
    wl = S.from_plan(plan, tokens_per_rank=64, seq_len=16, activation_dtype="torch.float32")
    b = plan.boundaries[0].fqn
    ops = [
        _op(0, "all_gather", "forward_broadcast", numel=1000, boundary=b),
        _op(1, "all_gather", "tp", numel=1000),
        _op(2, "forward", "compute", boundary=b, deps=(0,)),
        _op(3, "backward", "compute", boundary=b, deps=(2,)),
        _op(4, "reduce_scatter", "reduce", numel=1000, boundary=b, deps=(3,)),
    ]
    hw = _hand_hw()
    sim_ops = _sim_lower._lower(ops, plan, hw, wl, variant="z3", num_ranks=4)
    colls = [(o.kind, o.channel, o.seconds) for o in sim_ops if o.collective]
    each = 5e-6 + 3 * 1e-5 + 3 * 4000 / 1e9
    assert [(k, c) for k, c, _ in colls] == [
        ("all_gather", "bcast"),
        ("all_gather", "tp"),
        ("reduce_scatter", "reduce"),
    ]
    assert all(s == pytest.approx(each) for _, _, s in colls)
    raw = replay_ops(sim_ops, 4, hw)
    starts = [float(raw["start_scalar"][i]) for i, o in enumerate(sim_ops) if o.collective]
    assert starts[:2] == [0.0, 0.0]
    # on gloo the runtime blocks once on the forward gather and once on the gradient drain, as
    # on broadcasts and reduces (FSDP2's in-situ call on 4 ranks less its call on one: 200 us)
    gloo = _hand_hw(comm_engine="threads", fsdp2_call_s=1e-4, fsdp2_call_s_by_group=((4, 3e-4),))
    hosts = [o.host_s for o in _sim_lower._lower(ops, plan, gloo, wl, variant="z3", num_ranks=4) if o.collective]
    assert hosts == pytest.approx([2e-4, 0.0, 2e-4])


def test_coalesced_broadcasts_by_hand():
    """NCCL coalescing (Hardware.coalesces): the forward broadcasts of one boundary on one group
    become ONE op, issued once: launch 5 us + ceil(log2 4) x 10 us + (4,000 + 8,000 + 12,000) B
    / 1 GB/s + 2 x 10 us per extra call = 69 us (serial), with coalesced_op_s = 1 us 51 us. Two
    groups interleaved (HSDP rows) give one op each; the gradient reduces are their own block.
    Concurrent (uncalibrated): with every member a root (4 payloads of 4..16 kB) the busiest
    member receives all but its own smallest 4 kB: 36 kB."""
    plan = P.compile(zoo.tiny_llama(), 4)
    wl = S.from_plan(plan, tokens_per_rank=64, seq_len=16, activation_dtype="torch.float32")
    b = plan.boundaries[0].fqn
    bcasts = [_op(i, "broadcast", "forward_broadcast", root=i, numel=1000 * (i + 1), boundary=b) for i in range(3)]
    ops = bcasts + [
        _op(3, "forward", "compute", boundary=b, deps=(0, 1, 2)),
        _op(4, "backward", "compute", boundary=b, deps=(3,)),
        _op(5, "reduce", "reduce", root=0, numel=1000, boundary=b, deps=(4,)),
        _op(6, "reduce", "reduce", root=1, numel=1000, boundary=b, deps=(4,)),
    ]
    hw = _hand_hw(issue_s=1e-6, coalesces=True)
    sim_ops = _sim_lower._lower(ops, plan, hw, wl, variant="z3", num_ranks=4)
    colls = [o for o in sim_ops if o.collective]
    assert [(o.kind, o.channel) for o in colls] == [("broadcast", "bcast"), ("reduce", "reduce")]
    assert colls[0].seconds == pytest.approx(5e-6 + 2e-5 + 24000 / 1e9 + 2 * 1e-5)
    assert colls[1].seconds == pytest.approx(5e-6 + 2e-5 + 8000 / 1e9 + 1e-5)
    assert colls[0].host_s == 1e-6  # issued once
    fwd = next(i for i, o in enumerate(sim_ops) if o.kind == "forward" and o.label == b)
    assert sim_ops[fwd].deps == (sim_ops.index(colls[0]),)
    op_s = _sim_lower._lower(ops, plan, dataclasses.replace(hw, coalesced_op_s=1e-6), wl, variant="z3", num_ranks=4)
    assert [o.seconds for o in op_s if o.collective][0] == pytest.approx(5e-6 + 2e-5 + 24000 / 1e9 + 2e-6)
    # not coalescing: one op per broadcast, each by the broadcast formula
    plain = [
        o
        for o in _sim_lower._lower(ops, plan, dataclasses.replace(hw, coalesces=False), wl, variant="z3", num_ranks=4)
        if o.collective
    ]
    assert [o.seconds for o in plain[:3]] == pytest.approx([5e-6 + 2e-5 + 4000 * (i + 1) / 1e9 for i in range(3)])
    # two groups interleaved in one boundary phase: one coalesced op per group, first-seen order
    rows = [
        _op(
            i,
            "broadcast",
            "forward_broadcast",
            group=(0, 1) if i % 2 == 0 else (2, 3),
            root=0 if i % 2 == 0 else 2,
            numel=1000,
            boundary=b,
        )
        for i in range(4)
    ]
    rows.append(_op(4, "forward", "compute", boundary=b, deps=(0, 1, 2, 3)))
    got = [
        (o.group, o.seconds) for o in _sim_lower._lower(rows, plan, hw, wl, variant="z3", num_ranks=4) if o.collective
    ]
    two = 5e-6 + 1e-5 + 8000 / 1e9 + 1e-5
    assert [g for g, _ in got] == [(0, 1), (2, 3)] and all(s == pytest.approx(two) for _, s in got)
    # the coalesced cost model on its own
    from dmuon.sim._engine.coalesce import coalesced_collective_s

    four = [4000.0, 8000.0, 12000.0, 16000.0]
    conc = dataclasses.replace(hw, coalesce_model="concurrent")
    assert coalesced_collective_s(conc, "broadcast", (0, 1, 2, 3), four, [0, 1, 2, 3]) == pytest.approx(
        5e-6 + 2e-5 + 36000 / 1e9 + 3e-5
    )
    assert coalesced_collective_s(hw, "broadcast", (0, 1, 2, 3), four, [0, 1, 2, 3]) == pytest.approx(
        5e-6 + 2e-5 + 40000 / 1e9 + 3e-5
    )
    assert coalesced_collective_s(conc, "reduce", (0, 1, 2, 3), four[:3], [0, 1, 2]) == pytest.approx(
        5e-6 + 2e-5 + 24000 / 1e9 + 2e-5
    )  # rank 3 roots nothing: the serial figure
    with pytest.raises(ValueError, match="only broadcasts and reduces"):
        coalesced_collective_s(hw, "all_gather", (0, 1), [1.0], [0])
    with pytest.raises(ValueError, match="coalesce_model"):
        _hand_hw(coalesce_model="fast")
    # presets coalesce (NCCL), records that do not say do not (gloo)
    assert (
        H.preset("h100").coalesces
        and not H.Hardware.from_dict({k: v for k, v in _hand_hw().to_dict().items() if k != "coalesces"}).coalesces
    )
    assert H.Hardware.from_dict(json.loads(json.dumps(conc.to_dict()))) == conc


def test_token_all_to_all_by_hand():
    """tiny-moe with EP 2 on 4 ranks, 64 tokens per rank, top-2, fp32, hidden 32: one dispatch
    sends 64 x 2 x 32 x 4 = 16,384 B per rank; per MoE layer and micro-batch 4 all-to-alls (dispatch,
    combine, their gradients) on each EP group (0, 1) and (2, 3): 2 layers x 4 x 2 groups = 16,
    each 5 us + (2-1) x 10 us + 1/2 x 16,384 B / 1 GB/s = 23.192 us, on the all-to-all channel.
    The expert FLOPs per rank do not change with EP (uniform routing): 3 stacks x 2 x 48 x 32
    FLOP x 64 tokens x 2 experts = 1,179,648 per layer."""
    from dmuon.plan._model.parallel import expert_parallel_variant

    ep_plan = P.compile(expert_parallel_variant(zoo.tiny_moe(), 2), 4, ep=2)
    plain = P.compile(zoo.tiny_moe(), 4)
    kw = dict(tokens_per_rank=64, seq_len=64, activation_dtype="torch.float32", top_k=2)
    wl, wl_plain = S.from_plan(ep_plan, **kw), S.from_plan(plain, **kw)
    w = wl.work("layers.0")
    assert w.dispatch_nbytes == 64 * 2 * 32 * 4 == 16_384
    assert w.experts.matmul_flops == wl_plain.work("layers.0").experts.matmul_flops == 1_179_648
    assert wl.forward_flops == wl_plain.forward_flops
    hw = _hand_hw()
    sim_ops = _sim_lower._lower(ep_plan.schedule().ops, ep_plan, hw, wl, variant="z3", num_ranks=4)
    a2a = [o for o in sim_ops if o.kind == "all_to_all"]
    assert len(a2a) == 16 and {o.group for o in a2a} == {(0, 1), (2, 3)} and {o.channel for o in a2a} == {"a2a"}
    assert all(o.seconds == pytest.approx(5e-6 + 1e-5 + 0.5 * 16_384 / 1e9) for o in a2a)
    # forward of layers.0: dense | dispatch | experts | combine, each waiting for the one before
    i = next(j for j, o in enumerate(sim_ops) if o.kind == "forward" and o.label == "layers.0")
    seq = [(o.kind, o.label) for o in sim_ops[i : i + 7]]
    assert seq == [
        ("forward", "layers.0"),
        ("all_to_all", "tokens layers.0 mb0"),
        ("all_to_all", "tokens layers.0 mb0"),
        ("forward", "layers.0 experts"),
        ("all_to_all", "tokens layers.0 mb0"),
        ("all_to_all", "tokens layers.0 mb0"),
        ("forward", "layers.0 combined"),
    ]
    assert (
        sim_ops[i + 1].deps == (i,) and sim_ops[i + 3].deps == (i + 1, i + 2) and sim_ops[i + 6].deps == (i + 4, i + 5)
    )
    # the split keeps the compute: with a FLOP-bound hardware the forward seconds equal the
    # non-EP plan's (same FLOPs per rank), and only the EP plan has all-to-alls
    fwd = lambda ops: sum(o.seconds for o in ops if o.kind == "forward")  # noqa: E731
    plain_ops = _sim_lower._lower(plain.schedule().ops, plain, hw, wl_plain, variant="z3", num_ranks=4)
    assert fwd(sim_ops) == pytest.approx(fwd(plain_ops)) and not any(o.kind == "all_to_all" for o in plain_ops)
    # every variant runs the model's all-to-alls: each rank issues 8 of them
    # FSDP2 + AdamW with EP: the 8 all-to-alls, and per layer the stacks' own all-gathers (forward,
    # backward) and reduce-scatter on the efsdp group beside the row's
    adamw = S.simulate(ep_plan, hw, wl, variant="adamw").collectives_per_rank[0]
    assert adamw - S.simulate(plain, hw, wl_plain, variant="adamw").collectives_per_rank[0] == 8 + 2 * 3
    # calls per rank: the schedule's collectives (dmuon's and FSDP2's) + the 8 all-to-alls
    calls = lambda p: sum(1 for o in p.schedule().ops if o.kind in H.OP_COLLECTIVE and 0 in o.group)  # noqa: E731
    assert S.simulate(ep_plan, hw, wl, variant="z3").collectives_per_rank[0] == calls(ep_plan) + 8
    assert S.simulate(plain, hw, wl_plain, variant="z3").collectives_per_rank[0] == calls(plain)


def test_buffer_wire_numel():
    """What a rank holds while a buffer is gathered: a broadcast buffer's segments (an EP buffer:
    its largest efsdp group's), an all-gather buffer's k slots."""
    from dmuon.sim._engine.sim_memory import buffer_wire_numel

    segs = tuple(SimpleNamespace(shard=s, numel=n) for s, n in enumerate((10, 20, 30, 40)))
    assert buffer_wire_numel(SimpleNamespace(ep=1, numel=100, segments=segs), 4) == 100
    assert buffer_wire_numel(SimpleNamespace(ep=2, numel=100, segments=segs), 4) == 60  # shards 1, 3
    gathered = SimpleNamespace(ep=1, numel=100, segments=segs, collective="all_gather", slot_numel=48)
    assert buffer_wire_numel(gathered, 4) == 4 * 48
    gathered_ep = SimpleNamespace(ep=2, numel=100, segments=segs, collective="all_gather", slot_numel=48)
    assert buffer_wire_numel(gathered_ep, 4) == 2 * 48  # efsdp group of 2


def test_simulate_cli_expert_parallel(tmp_path, capsys):
    """`simulate --ep K`: the EP plan, the token all-to-all line (4 calls per MoE layer, bytes by
    hand: 256 tokens x top-2 x hidden 32 x 2 B bf16 = 32,768 B), the baseline statement, dmuon's
    collectives and padding, adamw / z2 / z3 only; user errors are argparse errors."""
    from dmuon.__main__ import main
    from dmuon._cli.sim_commands import BASELINE_LINE

    out = tmp_path / "ep.json"
    assert (
        main(
            [
                "simulate",
                "--model",
                "tiny-moe",
                "--mesh",
                "4",
                "--ep",
                "2",
                "--hw",
                "h100",
                "--tokens-per-rank",
                "256",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    text = capsys.readouterr().out
    assert BASELINE_LINE in text and "EP 2 (efsdp 2)" in text
    assert "token all-to-all over EP groups of 2 ranks: 8 calls per step" in text and "0.0 MB per rank" in text
    assert "dmuon Z3 collectives per step: all_gather" in text and "buffer padding" in text and "calls/rank" in text
    d = json.loads(out.read_text())
    assert d["ep"] == 2 and set(d["variants"]) == {"adamw", "z2", "z3"}
    assert d["dmuon_collectives"]["all_gather"] > 0 and d["buffer_wire_numel"] >= d["buffer_payload_numel"] > 0
    for extra, needle in (
        (["--ep", "3"], "--ep 3"),
        (["--ep", "2", "--tp", "2"], "--ep with --tp"),
        (["--ep", "0"], "--ep must be >= 1"),
    ):
        with pytest.raises(SystemExit) as e:
            main(["simulate", "--model", "tiny-moe", "--mesh", "4", "--hw", "h100", *extra])
        assert e.value.code == 2 and needle in capsys.readouterr().err, extra
    calls = {}
    for mode in ("record", "off"):
        assert (
            main(
                [
                    "simulate",
                    "--model",
                    "tiny-moe",
                    "--mesh",
                    "4",
                    "--hw",
                    "h100",
                    "--mode",
                    "z3",
                    "--collectives",
                    "broadcast",
                    "--coalesce",
                    mode,
                    "--json",
                    str(out),
                ]
            )
            == 0
        )
        capsys.readouterr()
        calls[mode] = json.loads(out.read_text())["variants"]["z3"]["collectives_busiest_rank"]
    assert calls["off"] > calls["record"]  # one call per broadcast / reduce without coalescing


def test_buffer_kind_costs_by_hand():
    """dmuon.sim._engine.kinds on tiny-llama, 4 ranks in one node, fp32: layers.0's buffer has segments of
    14,352 / 10,256 / 10,256 / 8,208 elements (43,072, 172,288 B) and slot 14,368 (57,472 B); link
    10 us, 1 GB/s, launch 5 us, issue 2 us. Per phase (Z3: forward, backward, gradient):
    broadcasts one call each 5 + ceil(log2 4) x 10 + 2 us + S / B; coalesced ONE call 5 + 2 x 10
    + 3 x 10 (extra calls) + 2 us + 172,288 B / B; all-gather 5 + 3 x 10 + 2 us + 3 x 57,472 B / B.
    Z2 has no backward phase."""
    from dmuon.sim._engine.kinds import buffer_kind_costs

    segs = [14352, 10256, 10256, 8208]
    bcast = sum(5e-6 + 2e-5 + 2e-6 + 4 * n / 1e9 for n in segs)
    coalesced = 5e-6 + 2e-5 + 3e-5 + 2e-6 + 4 * sum(segs) / 1e9
    gather = 5e-6 + 3e-5 + 2e-6 + 3 * 4 * 14368 / 1e9
    for z3, phases in ((True, 3), (False, 2)):
        plan = P.compile(zoo.tiny_llama(), 4, reshard_after_forward=z3)
        buf = plan.boundaries[0].buffers[0]
        assert [s.numel for s in buf.segments] == segs and buf.collective == "all_gather"
        for coalesces, b_s in ((False, bcast), (True, coalesced)):
            c = buffer_kind_costs(plan, _hand_hw(issue_s=2e-6, coalesces=coalesces))[0]
            assert (c.boundary, c.buffer, c.chosen, c.group_size, c.segments, c.slot_numel) == (
                plan.boundaries[0].fqn,
                "torch.float32",
                "all_gather",
                4,
                4,
                14368,
            )
            assert c.broadcast_s == pytest.approx(phases * b_s) and c.all_gather_s == pytest.approx(phases * gather)
            assert (c.chosen_s, c.other_s) == (c.all_gather_s, c.broadcast_s)
    # forced broadcasts on the same layout: every buffer's chosen kind is the slower one here
    forced = buffer_kind_costs(P.compile(zoo.tiny_llama(), 4, collectives="broadcast"), _hand_hw(issue_s=2e-6))
    assert forced and all(c.chosen == "broadcast" and c.chosen_s > c.other_s for c in forced)
    # a one-rank group moves nothing: no entry
    assert buffer_kind_costs(P.compile(zoo.tiny_llama(), 1), _hand_hw()) == ()


@pytest.mark.parametrize(
    "name, mesh, ep",
    [
        ("tiny-llama", 2, 1),
        ("tiny-llama", 4, 1),
        ("tiny-moe", 4, 1),
        ("llama3-8b", 8, 1),
        ("llama3-8b", (16, 8), 1),
        ("qwen3-30b-a3b", 64, 1),
        ("qwen3-30b-a3b", 64, 8),
    ],
)
def test_auto_kind_is_not_slower_in_the_simulator(name, mesh, ep):
    """On each row the kind ``collectives="auto"`` picks for a buffer is not modelled
    slower by the simulator (h100, with and without NCCL coalescing) than the other kind on the
    same layout, but where a buffer of expert stacks would pad more than 2 % (then broadcast by
    rule). Rows small enough for the fast lane, each choice present (all-gathers on tiny-llama and
    Qwen3-30B-A3B's efsdp buffers, broadcasts on the dense models, tiny-moe (padding) and
    Qwen3-30B-A3B without EP); ``benchmarks/collective_plans.py --simulate`` checks every row of the issue."""
    from dmuon.plan._layout.buffer_layout import slot_numel_of
    from dmuon.plan._layout.collective_rule import padding_fraction, places_expert_ranges
    from dmuon.plan._model.parallel import expert_parallel_variant
    from dmuon.sim._engine.kinds import buffer_kind_costs

    model = zoo.PRESETS[name]()
    kw: dict = dict(mp_policy=SimpleNamespace(param_dtype="bfloat16", reduce_dtype="float32"), cost_model="ns_flops")
    if ep > 1:
        model, kw["ep"] = expert_parallel_variant(model, ep), ep
    plan = P.compile(model, mesh, **kw)
    hw = H.preset("h100")
    N = plan.mesh_shape[1]
    # a buffer holding expert stacks whose slots would pad more than 2 % stays broadcast even where
    # the all-gather is modelled faster (rules.ALL_GATHER_MAX_PADDING: the balance and memory trade)
    capped = {
        (b.fqn, buf.key)
        for b in plan.boundaries
        for buf in b.buffers
        if places_expert_ranges(buf) and padding_fraction(buf, N, slot_numel_of(buf, plan.align_numel)) > 0.02
    }
    kinds = set()
    for h in (hw, dataclasses.replace(hw, coalesces=False)):
        costs = buffer_kind_costs(plan, h)
        assert costs
        kinds |= {c.chosen for c in costs}
        slower = [
            (c.boundary, c.buffer, c.chosen, c.chosen_s, c.other_s)
            for c in costs
            if c.chosen_s > c.other_s and (c.boundary, c.buffer) not in capped
        ]
        assert not slower
    assert kinds == (
        {"all_gather"} if name == "tiny-llama" else {"broadcast", "all_gather"} if ep > 1 else {"broadcast"}
    )


def test_hsdp_replicate_reduces_run_during_the_backward_on_their_own_channel():
    """HSDP (2, 2): the replicate reduces run on the replicate channel (the replicate process
    group's stream, beside the shard group's reduces), and all but the last boundary's go out
    during the backward: the first one ends before the last backward compute starts. The last
    boundary of the backward (layers.0) is the one whose replicate reduce follows its shard reduce
    at the end."""
    plan = P.compile(zoo.tiny_llama(), (2, 2), collectives="broadcast")
    wl = S.from_plan(plan, tokens_per_rank=256, seq_len=256)
    sim = S.simulate(plan, H.preset("h100"), wl, variant="z3", timeline_ranks=(0,))
    tl = sim.timelines[0]
    rep = [i for i in tl if i.label.startswith("replicate_reduce")]
    assert rep and {i.lane for i in rep} == {"replicate"}
    assert {i.lane for i in tl if i.label.startswith("reduce ")} == {"reduce"}
    last_backward_start = max(i.start_s for i in tl if i.kind == "backward")
    assert min(i.end_s for i in rep) < last_backward_start
    last_rep = max(rep, key=lambda i: i.start_s)
    assert last_rep.label.startswith("replicate_reduce model.layers.0")


def test_recommendation_and_memory_flags_say_why():
    """The simulate page's notes (and the terminal's recommendation): memory decides where only one
    dmuon mode fits, and says so; every variant above the device's memory is named with its peak;
    the faster rule otherwise (Z3 within 1 %)."""
    from types import SimpleNamespace as NS

    from dmuon.sim._pages.recommendation import recommend
    from dmuon.sim._pages.sim_html import _notes

    GiB = 2**30
    sims = {
        "adamw": NS(step_s=4.0, peak_memory_nbytes=(37 * GiB,)),
        "naive": NS(step_s=6.0, peak_memory_nbytes=(144 * GiB, 10 * GiB)),
        "z2": NS(step_s=3.5, peak_memory_nbytes=(127 * GiB,)),
        "z3": NS(step_s=3.9, peak_memory_nbytes=(39 * GiB,)),
    }
    mode, why = recommend(sims, 80 * GiB)
    assert mode == "z3" and why.startswith("memory decided: Z2 peaks at 127.0 GiB per rank, above the device's 80.0")
    notes = _notes(sims, 80 * GiB)
    assert notes[0].startswith("Does not fit: naive (144.0 GiB), z2 (127.0 GiB) peak above the device's 80.0 GiB")
    assert notes[1] == f"Recommended: dmuon Z3 (0.975 x FSDP2 + AdamW): {why}."
    assert recommend(sims, 0) == ("z2", "Z2 is 10.3 % faster than Z3")  # memory unknown: the faster
    sims["z2"] = NS(step_s=3.88, peak_memory_nbytes=(30 * GiB,))  # within 1 %: Z3, which holds less
    mode, why = recommend(sims, 80 * GiB)
    assert mode == "z3" and "within 1 %" in why and "both fit the device's 80.0 GiB" in why
    assert recommend({"z3": sims["z3"]}, 0)[0] == "z3" and _notes({"z3": sims["z3"]}, 0) == []
