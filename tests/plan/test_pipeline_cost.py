"""``dmuon.plan.pipeline_cost``: the bytes per step of one pipeline stage for M micro-batches,
against ``plan.cost`` and the one-micro-batch step schedule (hand rule: Z2 moves one micro-batch's
bytes; Z3 moves M forward and M backward broadcasts and one reduce)."""

from __future__ import annotations

import pytest

import dmuon.plan as P
from oracle import make_model


@pytest.mark.parametrize("mesh", [2, (2, 2)])
@pytest.mark.parametrize("z3", [True, False])
def test_pipeline_cost_counts_microbatches(mesh, z3):
    plan = P.compile(make_model("tiny"), mesh, reshard_after_forward=z3)
    nominal = P.schedule(plan)
    for m in (1, 4):
        got = P.pipeline_cost(plan, m)
        if not z3:
            assert got == plan.cost
            continue
        extra = m - 1
        c = plan.cost
        assert got.forward_broadcast_nbytes == m * c.forward_broadcast_nbytes
        assert got.backward_broadcast_nbytes == m * c.backward_broadcast_nbytes
        assert c.backward_broadcast_nbytes > 0
        for field in ("reduce_nbytes", "replicate_reduce_nbytes", "replicate_broadcast_nbytes", "tp_nbytes"):
            assert getattr(got, field) == getattr(c, field), field
        for rank, (a, b) in enumerate(zip(got.per_rank_nbytes, c.per_rank_nbytes)):
            bcast = nominal.rank_nbytes(rank, "forward_broadcast") + nominal.rank_nbytes(rank, "backward_broadcast")
            assert a == b + extra * bcast, rank


@pytest.mark.parametrize("bad", [0, -1, 2.0, "4"])
def test_pipeline_cost_refuses_a_bad_count(bad):
    plan = P.compile(make_model("tiny"), 2)
    with pytest.raises(ValueError, match="microbatches must be a positive int"):
        P.pipeline_cost(plan, bad)


@pytest.mark.parametrize("mesh", [2, (2, 2)])
@pytest.mark.parametrize("z3", [True, False])
def test_pipeline_cost_is_the_pipelined_steps_schedule(mesh, z3):
    """pipeline_cost(plan, M) is the bytes of the whole pipelined step's schedule (Step(pipelined=True),
    M micro-batches), per rank and per phase, for M past the two it builds."""
    from dmuon.plan._cost.nbytes import schedule_byte_cost
    from dmuon.plan._cost.stage_bytes import pipeline_step

    plan = P.compile(make_model("tiny"), mesh, reshard_after_forward=z3)
    for m in (1, 2, 5):
        step = pipeline_step(m)
        assert step.pipelined and len(step.micro_batches) == m
        assert P.pipeline_cost(plan, m) == schedule_byte_cost(plan.schedule(step)), m
