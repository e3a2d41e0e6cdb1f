"""The step schedule (dmuon.plan.schedule): hand-computed op lists, step variants, the cost it
derives against the closed-form formulas (tests/formula_cost.py), and the deadlock replay on
schedules broken by hand."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import dmuon.plan as P
from dmuon.plan._cost import nbytes as plan_cost
from dmuon.sim import zoo
from dmuon.plan import MicroBatch, ScheduleError, Step
from dmuon.plan._scheduling.schedule_replay import programs_of, replay
from formula_cost import formula_cost, formula_rank_stats, schedule_fields
from test_plan_compile import build, model_specs
from test_plan_golden import build_a, build_b

SETTINGS = settings(max_examples=60, deadline=None)


def _ops(sched, rank, *, collectives_only=False):
    return [
        (op.kind, op.phase, op.boundary, op.segment, op.root, op.numel)
        for op in sched.rank_ops(rank)
        if op.collective or not collectives_only
    ]


# --------------------------------------------------------------------------- golden: model A, N = 2

# Layout (tests/plan/test_plan_golden.py, align 16, fp32): layers.0: seg 0 (a, c + 2 flags) 48 el,
# seg 1 (b + 1 flag) 32 el; layers.1: seg 0 (b) 32 el, seg 1 (a, c) 48 el. Owners: L0.a, L0.c,
# L1.b on rank 0; L0.b, L1.a, L1.c on rank 1.
L0, L1 = "layers.0", "layers.1"
# FSDP2 units (external ops): the root holds embed (7, 3) and head (7, 3) + bias (7,): padded
# dim-0 shards 4·3 + 4·3 + 4 = 28 elements per rank; each layers.N holds its norm's weight and bias
# (3,): 2 + 2 = 4.
FWD_A = [
    ("fsdp2_all_gather", "fsdp2", "", None, None, 28),  # root unit, start of the forward
    ("broadcast", "forward_broadcast", L0, 0, 0, 48),
    ("broadcast", "forward_broadcast", L0, 1, 1, 32),
    ("broadcast", "forward_broadcast", L1, 0, 0, 32),  # prefetched by L0's pre-forward
    ("broadcast", "forward_broadcast", L1, 1, 1, 48),
    ("fsdp2_all_gather", "fsdp2", L0, None, None, 4),
    ("forward", "compute", L0, None, None, 0),
    ("fsdp2_all_gather", "fsdp2", L1, None, None, 4),
    ("forward", "compute", L1, None, None, 0),
]


def test_golden_a_z3_rank0():
    sched = P.compile(build_a(), 2, collectives="broadcast").schedule()
    ops = _ops(sched, 0)
    assert ops[:9] == FWD_A
    assert ops[9:] == [
        ("broadcast", "backward_broadcast", L1, 0, 0, 32),  # L1 pre-backward: re-fetch (Z3)
        ("broadcast", "backward_broadcast", L1, 1, 1, 48),
        ("broadcast", "backward_broadcast", L0, 0, 0, 48),  # prefetch of L0 for its backward
        ("broadcast", "backward_broadcast", L0, 1, 1, 32),
        ("fsdp2_all_gather", "fsdp2", L1, None, None, 4),  # FSDP2 Z3 re-gathers too
        ("backward", "compute", L1, None, None, 0),
        ("reduce", "reduce", L1, 0, 0, 32),  # L1 post-backward
        ("reduce", "reduce", L1, 1, 1, 48),
        ("fsdp2_reduce_scatter", "fsdp2", L1, None, None, 4),
        ("fsdp2_all_gather", "fsdp2", L0, None, None, 4),
        ("backward", "compute", L0, None, None, 0),
        ("reduce", "reduce", L0, 0, 0, 48),
        ("reduce", "reduce", L0, 1, 1, 32),
        ("fsdp2_reduce_scatter", "fsdp2", L0, None, None, 4),
        ("fsdp2_reduce_scatter", "fsdp2", "", None, None, 28),  # root unit, end of the backward
        # rank 0 owns layers.0.a, layers.0.c, layers.1.b: one NS each, plan order
        ("newton_schulz", "optimizer", None, None, None, 0),
        ("newton_schulz", "optimizer", None, None, None, 0),
        ("newton_schulz", "optimizer", None, None, None, 0),
    ]
    assert all(
        op.external and op.charged_nbytes(0) == 0 for op in sched.rank_ops(0) if op.phase in ("fsdp2", "compute")
    )
    ns = [op for op in sched.rank_ops(0) if op.kind == "newton_schulz"]
    assert [op.fqns for op in ns] == [("layers.0.a.weight",), ("layers.0.c.weight",), ("layers.1.b.weight",)]
    # NS FLOPs: 5 steps of 4a²b + 2a³ with a = min side: a (3,4): 5·(4·9·4+2·27) = 990;
    # c (3,3): 5·(108+54) = 810; b (5,2): 5·(4·4·5+16) = 480
    assert [op.flops for op in ns] == [990, 810, 480]
    # each NS waits for the reduces of its boundary's segments
    reduce_l0 = {op.id for op in sched.rank_ops(0) if op.kind == "reduce" and op.boundary == L0}
    assert set(ns[0].deps) == reduce_l0
    # bytes charged to rank 0: it receives every shard-1 segment (32 + 48 el = 320 B) twice and
    # sends its part of them once
    assert [sched.rank_nbytes(0, ph) for ph in ("forward_broadcast", "backward_broadcast", "reduce")] == [320, 320, 320]
    assert sched.rank_nbytes(1) == 3 * 4 * (48 + 32)


def test_golden_a_all_gather_z3_rank0():
    """Model A on N = 2 with all-gathers (what collectives="auto" picks for it: two 8 us steps per
    call beat two broadcasts of 1 + ceil(log2 2) steps each). Slot of both buffers: round_up(48 + 1,
    16) = 64 elements (the larger segment and its step code); per phase and buffer every rank
    sends / receives (N-1)·64·4 = 256 B."""
    for mode in ("auto", "all_gather"):
        plan = P.compile(build_a(), 2, collectives=mode)
        assert [(buf.collective, buf.slot_numel) for b in plan.boundaries for buf in b.buffers] == [
            ("all_gather", 64)
        ] * 2
        sched = plan.schedule()
        assert _ops(sched, 0, collectives_only=True) == [
            ("all_gather", "forward_broadcast", L0, None, None, 64),
            ("all_gather", "forward_broadcast", L1, None, None, 64),  # prefetched by L0's pre-forward
            ("all_gather", "backward_broadcast", L1, None, None, 64),
            ("all_gather", "backward_broadcast", L0, None, None, 64),
            ("reduce_scatter", "reduce", L1, None, None, 64),
            ("reduce_scatter", "reduce", L0, None, None, 64),
        ]
        c = plan.cost
        assert (c.forward_broadcast_nbytes, c.backward_broadcast_nbytes, c.reduce_nbytes) == (1024, 1024, 1024)
        assert c.per_rank_nbytes == (1536, 1536)
        # the whole gathered tensor is transient on every rank: 2 slots of 64 fp32
        assert [r.peak_transient_nbytes for r in plan.rank_stats()] == [512, 512]


def test_golden_a_z2_rank1():
    sched = P.compile(build_a(), 2, reshard_after_forward=False, collectives="broadcast").schedule()
    assert _ops(sched, 1, collectives_only=True) == [
        ("broadcast", "forward_broadcast", L0, 0, 0, 48),
        ("broadcast", "forward_broadcast", L0, 1, 1, 32),
        ("broadcast", "forward_broadcast", L1, 0, 0, 32),
        ("broadcast", "forward_broadcast", L1, 1, 1, 48),
        # Z2: the buffers stay resident from the forward; no re-broadcast
        ("reduce", "reduce", L1, 0, 0, 32),
        ("reduce", "reduce", L1, 1, 1, 48),
        ("reduce", "reduce", L0, 0, 0, 48),
        ("reduce", "reduce", L0, 1, 1, 32),
    ]
    assert not any(op.phase == "backward_broadcast" for op in sched.ops)


def test_single_rank_reduces_on_a_group_of_one():
    """N = 1: no broadcast; the runtime still posts each segment's reduce (charged 0)."""
    sched = P.compile(build_a(), 1).schedule()
    kinds = [(op.kind, op.boundary) for op in sched.rank_ops(0) if op.collective]
    assert kinds == [("reduce", L1), ("reduce", L0)]
    assert sched.rank_nbytes(0) == 0


# --------------------------------------------------------------------------- golden: HSDP (2, 2)


def test_golden_b_hsdp_rank_lists():
    """Model B on (R, N) = (2, 2): rank (r, s) = r·2 + s. Shard-group ops run per replicate row,
    replicate reduces per column (sub-segment by sub-segment, to the owner; with two blocks all
    after the last shard-group reduce, test_hsdp_replicate_reduces_one_boundary_behind),
    replicate broadcasts from the owner after the step; per-phase bytes equal the golden table
    (tests/plan/test_plan_golden.py)."""
    plan = P.compile(build_b(), (2, 2), collectives="broadcast")
    sched = plan.schedule()
    rows = {0: (0, 1), 1: (2, 3)}
    cols = {0: (0, 2), 1: (1, 3)}
    for rank in range(4):
        r, s = divmod(rank, 2)
        ops = [op for op in sched.rank_ops(rank) if op.collective]
        for op in ops:
            if op.phase in ("forward_broadcast", "backward_broadcast", "reduce"):
                assert op.group == rows[r] and op.root == r * 2 + op.segment
            else:
                assert op.phase in ("replicate_reduce", "replicate_broadcast")
                assert op.group == cols[s] and op.segment == s and op.root == op.subsegment * 2 + s
        phases = [op.phase for op in ops]
        # the replicate reduces follow every shard-group reduce; replicate broadcasts come last
        last_reduce = max(i for i, ph in enumerate(phases) if ph == "reduce")
        assert all(i > last_reduce for i, ph in enumerate(phases) if ph == "replicate_reduce")
        first_bc = phases.index("replicate_broadcast")
        assert set(phases[first_bc:]) == {"replicate_broadcast"}
        # one replicate reduce and one replicate broadcast per sub-segment of shard s
        subs = [
            (b.fqn, sub.owner.replicate)
            for b in plan.boundaries
            for buf in b.buffers
            for seg in buf.segments
            if seg.shard == s
            for sub in seg.subsegments
        ]
        assert [(op.boundary, op.subsegment) for op in ops if op.phase == "replicate_broadcast"] == subs
        assert sorted((op.boundary, op.subsegment) for op in ops if op.phase == "replicate_reduce") == sorted(subs)
    c = plan.cost
    assert (c.forward_broadcast_nbytes, c.replicate_reduce_nbytes, c.per_rank_nbytes) == (
        1536,
        768,
        (1664, 1664, 1408, 1408),
    )
    # FSDP2 (external; model B has no other parameters, model A's root holds embed and head):
    # HSDP all-reduces each unit's reduce-scattered gradient shards over the replicate column,
    # after the unit's reduce-scatter in the row
    sched_a = P.compile(build_a(), (2, 2)).schedule()
    assert not any(op.phase == "fsdp2" for op in sched.ops)
    fsdp2 = [(op.kind, op.group) for op in sched_a.rank_ops(1) if op.phase == "fsdp2" and op.boundary == ""]
    assert fsdp2 == [("fsdp2_all_gather", (0, 1)), ("fsdp2_reduce_scatter", (0, 1)), ("fsdp2_all_reduce", (1, 3))]


# --------------------------------------------------------------------------- step variants


def _phase_nbytes(sched):
    return {f: getattr(plan_cost.schedule_byte_cost(sched), f) for f in P.ByteCost.PHASES}


def test_no_sync_micro_batches_broadcast_each_and_reduce_once():
    plan = P.compile(build_b(), (2, 2))
    one = _phase_nbytes(plan.schedule())
    three = _phase_nbytes(plan.schedule(Step(micro_batches=(MicroBatch(sync=False),) * 2 + (MicroBatch(),))))
    for f in ("forward_broadcast_nbytes", "backward_broadcast_nbytes"):
        assert three[f] == 3 * one[f]
    for f in ("reduce_nbytes", "replicate_reduce_nbytes", "replicate_broadcast_nbytes"):
        assert three[f] == one[f]
    # accumulation without no_sync: every micro-batch reduces (owners accumulate)
    synced = _phase_nbytes(plan.schedule(Step(micro_batches=(MicroBatch(),) * 3)))
    assert synced["reduce_nbytes"] == 3 * one["reduce_nbytes"]
    assert synced["replicate_reduce_nbytes"] == 3 * one["replicate_reduce_nbytes"]
    assert synced["replicate_broadcast_nbytes"] == one["replicate_broadcast_nbytes"]


def test_boundary_called_twice_z3():
    """Forward L0, L1, L1 (Z3): L1 is broadcast again for its second call; its backward
    re-broadcast runs once (the buffer stays resident until the boundary's last backward), and it
    reduces once."""
    plan = P.compile(build_a(), 2, collectives="broadcast")
    sched = plan.schedule(Step(micro_batches=(MicroBatch(forward=(L0, L1, L1)),)))
    coll = [(op.phase, op.boundary) for op in sched.rank_ops(0) if op.collective]
    assert coll == (
        [("forward_broadcast", L0)] * 2
        + [("forward_broadcast", L1)] * 4
        + [("backward_broadcast", L1)] * 2
        + [("backward_broadcast", L0)] * 2
        + [("reduce", L1)] * 2
        + [("reduce", L0)] * 2
    )
    assert [op.kind for op in sched.rank_ops(0) if op.phase == "compute"] == ["forward"] * 3 + ["backward"] * 3
    # FSDP2 (Z3) re-gathers L1's norm for its second call, and reduce-scatters it once
    assert [(op.kind, op.boundary) for op in sched.rank_ops(0) if op.phase == "fsdp2" and op.boundary == L1] == [
        ("fsdp2_all_gather", L1),
        ("fsdp2_all_gather", L1),
        ("fsdp2_all_gather", L1),
        ("fsdp2_reduce_scatter", L1),
    ]


def test_boundary_never_called():
    """Forward L1 only: L0 is neither broadcast nor reduced, and its matrices get no NS."""
    plan = P.compile(build_a(), 2)
    sched = plan.schedule(Step(micro_batches=(MicroBatch(forward=(L1,)),)))
    assert {op.boundary for op in sched.ops if op.collective} == {L1}
    assert {f for op in sched.ops if op.kind == "newton_schulz" for f in op.fqns} == {
        "layers.1.a.weight",
        "layers.1.b.weight",
        "layers.1.c.weight",
    }


def test_unused_matrix_skips_ns_only():
    plan = P.compile(build_a(), 2)
    sched = plan.schedule(Step(unused=("layers.0.a.weight",)))
    nominal = plan.schedule()
    assert [op.signature() for op in sched.ops if op.collective] == [
        op.signature() for op in nominal.ops if op.collective
    ]
    assert "layers.0.a.weight" not in {f for op in sched.ops for f in op.fqns}


def test_recompute_adds_compute_not_collectives():
    plan = P.compile(build_a(), 2)
    sched = plan.schedule(Step(micro_batches=(MicroBatch(recompute=(L0, L1)),)))
    nominal = plan.schedule()
    assert [op.signature() for op in sched.ops if op.collective] == [
        op.signature() for op in nominal.ops if op.collective
    ]
    kinds = [(op.kind, op.boundary) for op in sched.rank_ops(0) if op.phase == "compute"]
    assert kinds[2:] == [("recompute", L1), ("backward", L1), ("recompute", L0), ("backward", L0)]


def test_step_names_unknown_boundary():
    plan = P.compile(build_a(), 2)
    with pytest.raises(ValueError, match="not a hook boundary.*layers.0"):
        plan.schedule(Step(micro_batches=(MicroBatch(forward=("layers.7",)),)))
    with pytest.raises(ValueError, match="Step.unused.*closest: layers.0.a.weight"):
        plan.schedule(Step(unused=("layers.0.a.weigth",)))
    with pytest.raises(ValueError, match=r"recomputes \['layers.1'\], which its forward does not call"):
        plan.schedule(Step(micro_batches=(MicroBatch(forward=(L0,), recompute=(L1,)),)))
    with pytest.raises(ValueError, match="the last micro-batch must sync"):
        Step(micro_batches=(MicroBatch(), MicroBatch(sync=False)))
    with pytest.raises(TypeError, match="tuple of MicroBatch"):
        Step(micro_batches=[MicroBatch()])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="at least one"):
        Step(micro_batches=())
    sched = plan.schedule()
    with pytest.raises(ValueError, match="phase must be one of"):
        sched.rank_nbytes(0, "forward")
    with pytest.raises(ValueError, match="boundary 'layers.9'"):
        sched.summary(0, boundary="layers.9")


def test_tp_schedule_batches_gram_all_reduces():
    """TP (N = 2, T = 2): the two Gram matrices of one owner with the same (d, D_local) form one
    batch: one fp32 all-reduce of 2·d² elements per Gram segment (3 with the default restarts)."""
    from test_plan_tp import Net

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.up = torch.nn.Linear(4, 32, bias=False)
            self.up2 = torch.nn.Linear(4, 32, bias=False)

    net = Net()
    net.layers[0] = Block()
    dims = {"layers.0.up.weight": 0, "layers.0.up2.weight": 0}
    plan = P.compile(net, 1, tp=P.TPPolicy(size=2, shard_dims=dims))
    sched = plan.schedule()
    tp = [op for op in sched.rank_ops(1) if op.phase == "tp"]
    assert [(op.kind, op.group, op.numel, op.dtype) for op in tp] == [
        ("all_reduce", (0, 1), 2 * 16, "torch.float32")
    ] * 3
    assert sched.rank_nbytes(1, "tp") == 3 * 2 * 1 * 16 * 4 == plan.cost.tp_nbytes // 2


# --------------------------------------------------------------------------- derived cost == formulas


@SETTINGS
@given(model_specs(), st.booleans(), st.sampled_from([None, "bfloat16"]))
def test_schedule_cost_equals_formulas(spec, z3, param_dtype):
    import types

    layers, mesh, seed, cost_model = spec
    mp = types.SimpleNamespace(param_dtype=param_dtype, reduce_dtype=None) if param_dtype else None
    plan = P.compile(build(layers, seed), mesh, reshard_after_forward=z3, cost_model=cost_model, mp_policy=mp)
    assert plan.cost == formula_cost(plan)
    assert schedule_fields(plan.rank_stats()) == formula_rank_stats(plan)
    sched = plan.schedule()
    sched.check()
    replay(programs_of(sched))  # the explicit per-rank lists replay too
    for rank in range(sched.num_ranks):
        assert sched.rank_nbytes(rank) == plan.cost.per_rank_nbytes[rank]


@SETTINGS
@given(model_specs(), st.booleans(), st.sampled_from([2, 4]), st.sampled_from(["auto", "gram", "gather"]))
def test_tp_schedule_cost_equals_formulas(spec, z3, T, tp_ns):
    """TP: even shapes (the formula charges each matrix's Gram on its own, the schedule one
    all-reduce per batch: equal when T divides every batch's d²·k and d²)."""
    layers, mesh, seed, _ = spec
    layers = [[(n, (4 * a, 4 * b), dt) for n, (a, b), dt in params] for params in layers]
    dims = {
        f"layers.{i}.{n}.weight": (i + j) % 2 for i, params in enumerate(layers) for j, (n, _, _) in enumerate(params)
    }
    plan = P.compile(
        build(layers, seed), mesh, reshard_after_forward=z3, tp=P.TPPolicy(size=T, shard_dims=dims, ns=tp_ns)
    )
    assert plan.cost == formula_cost(plan)
    assert schedule_fields(plan.rank_stats()) == formula_rank_stats(plan)
    plan.schedule().check()


@pytest.mark.parametrize("name, mesh", [("llama3-8b", 8), ("llama3-8b", (2, 4)), ("llama3-70b", (8, 16))])
def test_presets_cost_equals_formulas(name, mesh):
    model = zoo.PRESETS[name]()
    for z3 in (True, False):
        plan = P.compile(model, mesh, reshard_after_forward=z3)
        assert plan.cost == formula_cost(plan)
        assert schedule_fields(plan.rank_stats()) == formula_rank_stats(plan)


def test_hsdp_replicate_reduces_one_boundary_behind():
    """HSDP: a boundary's replicate reduces are issued at the next boundary's post-backward,
    after that boundary's shard-group reduces (the runtime waits for the earlier shard reduces
    there), and the last boundary's at the end of the backward. The tiny Llama's 4 layers on
    (2, 2), every rank, by hand: reduce 3, reduce 2, replicate 3, reduce 1, replicate 2, reduce
    0, replicate 1, replicate 0 (the replicate broadcasts after the step follow)."""
    plan = P.compile(zoo.tiny_llama(), (2, 2), collectives="broadcast")
    sched = plan.schedule()
    layer = {b.fqn: i for i, b in enumerate(plan.boundaries)}
    expected = [
        ("reduce", 3),
        ("reduce", 2),
        ("replicate_reduce", 3),
        ("reduce", 1),
        ("replicate_reduce", 2),
        ("reduce", 0),
        ("replicate_reduce", 1),
        ("replicate_reduce", 0),
    ]
    for rank in range(4):
        seq = [
            (op.phase, layer[op.boundary]) for op in sched.rank_ops(rank) if op.phase in ("reduce", "replicate_reduce")
        ]
        runs = [key for i, key in enumerate(seq) if i == 0 or seq[i - 1] != key]  # one entry per run of ops
        assert runs == expected, (rank, runs)
        # every replicate reduce depends on shard-group reduces of its own boundary only
        for op in sched.rank_ops(rank):
            if op.phase == "replicate_reduce":
                assert op.deps and all(
                    sched.ops[d].phase == "reduce" and sched.ops[d].boundary == op.boundary for d in op.deps
                )
    replay(programs_of(sched))


# --------------------------------------------------------------------------- replay catches


def test_replay_catches_cross_group_cycle():
    """HSDP (2, 2): ranks 0 and 3 (the diagonal) each move their first replicate reduce (column
    group) before their last shard-group reduce (row group). Every group is still issued in the
    same order by its members, yet the step deadlocks: 0 waits in column (0, 2) for 2, which waits
    in row (2, 3) for 3, which waits in column (1, 3) for 1, which waits in row (0, 1) for 0."""
    sched = P.compile(build_b(), (2, 2)).schedule()
    progs = [list(p) for p in programs_of(sched)]
    for rank in (0, 3):
        mine = progs[rank]
        last_reduce = max(i for i, op in enumerate(mine) if op.phase == "reduce")
        first_rep = next(i for i, op in enumerate(mine) if op.phase == "replicate_reduce")
        mine.insert(last_reduce, mine.pop(first_rep))
    with pytest.raises(ScheduleError, match="deadlock") as exc:
        replay(progs)
    err = exc.value
    assert err.cycle == (0, 2, 3, 1, 0)
    assert err.op is not None and err.rank in err.cycle
    assert "cycle of waiting ranks" in str(err)


def test_replay_catches_two_ranks_in_opposite_group_order():
    """The textbook case: rank 0 issues on group (0, 1) then (0, 2); rank 1 on (0, 1); rank 2 on
    (0, 2) — fine. Swap rank 0's order and add a second dependency: ranks 1 and 2 each issue on
    both groups in the opposite order to rank 0."""

    def mk(i, g):
        return P.Op(id=i, kind="broadcast", phase="forward_broadcast", group=g, root=0, dtype="torch.float32", numel=4)

    a, b = (0, 1, 2), (0, 1, 2, 3)
    ok = [[mk(0, a), mk(1, b)], [mk(0, a), mk(1, b)], [mk(0, a), mk(1, b)], [mk(1, b)]]
    replay(ok)
    bad = [[mk(0, a), mk(1, b)], [mk(1, b), mk(0, a)], [mk(0, a), mk(1, b)], [mk(1, b)]]
    with pytest.raises(ScheduleError, match=r"cycle of waiting ranks 0 -> 1 -> 0"):
        replay(bad)


def test_replay_catches_mismatched_root():
    sched = P.compile(build_a(), 2, collectives="broadcast").schedule()
    progs = [list(p) for p in programs_of(sched)]
    i = next(i for i, op in enumerate(progs[1]) if op.phase == "backward_broadcast")
    progs[1][i] = dataclasses.replace(progs[1][i], root=1 - progs[1][i].root)
    with pytest.raises(ScheduleError, match="differ in root") as exc:
        replay(progs)
    assert exc.value.rank == 1


def test_replay_catches_missing_collective():
    sched = P.compile(build_a(), 2, collectives="broadcast").schedule()
    progs = [list(p) for p in programs_of(sched)]
    progs[1] = [op for op in progs[1] if not (op.phase == "reduce" and op.boundary == L0 and op.segment == 1)]
    with pytest.raises(ScheduleError, match="rank 1.*ends its step without issuing it"):
        replay(progs)


def test_replay_rejects_op_on_foreign_group():
    op = P.Op(id=0, kind="reduce", phase="reduce", group=(1, 2), root=1, dtype="torch.float32", numel=1)
    with pytest.raises(ScheduleError, match="rank 0 issues .* which rank 0 is not in"):
        replay([[op], [op], [op]])
    ns = P.Op(id=1, kind="newton_schulz", phase="optimizer", group=(0,), flops=8)
    with pytest.raises(ScheduleError, match="rank 1 issues .*newton_schulz.* which rank 1 is not in"):
        replay([[ns], [ns]])


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(root=7), r"root 7 is not a member of its group \(0, 1\)"),  # agreed by both ranks
        (dict(root=None), "root None is not a member"),
        (dict(group=(0, 0)), "not a tuple of distinct ranks in 0..1"),
        (dict(group=(-1, 0)), "not a tuple of distinct ranks in 0..1"),
        (dict(group=(0, 5)), "not a tuple of distinct ranks in 0..1"),
        (dict(numel=-5), "numel must be an int >= 0"),
        (dict(kind="alltoall"), "unknown kind 'alltoall'"),
        (dict(kind="all_reduce"), "all_reduce takes no root, got 0"),
    ],
)
def test_replay_rejects_malformed_ops_every_rank_agrees_on(change, message):
    """Agreement is not validity: both ranks issue the same malformed collective."""
    progs = [list(p) for p in programs_of(P.compile(build_a(), 2, collectives="broadcast").schedule())]
    for rank in (0, 1):
        i = next(i for i, op in enumerate(progs[rank]) if op.collective)
        progs[rank][i] = dataclasses.replace(progs[rank][i], **change)
    with pytest.raises(ScheduleError, match=message):
        replay(progs)


def test_replay_rejects_non_ops():
    with pytest.raises(ScheduleError, match="holds None, not a dmuon.plan.Op"):
        replay([[None]])


def test_schedule_is_frozen_and_pure():
    plan = P.compile(build_a(), 2)
    a, b = plan.schedule(), plan.schedule()
    assert a == b and a.ops == b.ops
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.ops[0].root = 1  # type: ignore[misc]
    assert not hasattr(plan, "__dict__")  # slots: nothing can be cached on the plan
