"""The runtime issues exactly the plan's schedule (processes + gloo).

Every rank records each collective it issues during one training step
(``LEDGER.recording()``: kind, phase, group, root, dtype, elements, bytes charged) and the test
compares that sequence, op by op, with ``plan.schedule(step).rank_ops(rank)`` for the matching
:class:`dmuon.plan.Step`: 1-D Z3 and Z2, a matrix used twice per forward / by one rank only / by
no rank, a boundary called twice, a boundary not called, ``no_sync`` accumulation, activation
checkpointing, HSDP (2, 2) and tensor parallelism (dp 2 x tp 2, Gram and gather). The meshes here
span the world, so schedule ranks are global ranks.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn

import dmuon.plan as P
from dist_utils import run_distributed
from oracle import TinyLM, dmuon_optimizer, global_batches, lm_loss, make_model

STEPS = 2  # record the second step (the first one's optimizer initialises state)


class RepeatLM(TinyLM):
    """``layers.1`` is called twice per forward; ``layers.2`` is skipped when ``skip_last``."""

    def __init__(self, skip_last: bool = False):
        super().__init__(n_layers=3)
        self.skip_last = skip_last

    def forward(self, tokens):
        x = self.embed(tokens)
        x = self.layers[0](x)
        x = self.layers[1](x)
        x = self.layers[1](x)
        if not self.skip_last:
            x = self.layers[2](x)
        return self.head(self.norm(x))


def _model(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "repeat":
        return RepeatLM()
    if kind == "skip":
        return RepeatLM(skip_last=True)
    return make_model(kind)


def _step(kind: str, micro: int, plan) -> P.Step:
    """The :class:`dmuon.plan.Step` a case runs (the test's side of the contract)."""
    forward = None
    recompute = ()
    unused = ()
    if kind == "repeat":
        forward = ("layers.0", "layers.1", "layers.1", "layers.2")
    elif kind == "skip":
        forward = ("layers.0", "layers.1", "layers.1")
    elif kind == "ckpt_parent":
        recompute = tuple(b.fqn for b in plan.boundaries)
    elif kind == "gated":
        unused = tuple(f for f in plan.dedicated if ".never." in f)  # no rank uses it
    mbs = tuple(P.MicroBatch(forward=forward, sync=i == micro - 1, recompute=recompute) for i in range(micro))
    return P.Step(micro_batches=mbs, unused=unused)


def _run_steps(model, opt, batches, *, world, rank, micro):
    import dmuon
    from dmuon.exec._comm.collective_calls import LEDGER

    recorded = []
    for step, batch in enumerate(batches):
        local = batch.chunk(world)[rank]
        with LEDGER.recording() if step == STEPS - 1 else contextlib.nullcontext():
            for i, part in enumerate(local.chunk(micro)):
                ctx = dmuon.no_sync(model) if i < micro - 1 else contextlib.nullcontext()
                with ctx:
                    (lm_loss(model, part) / micro).backward()
            opt.step()
            opt.zero_grad()
            if step == STEPS - 1:
                recorded = [
                    (o.kind, o.phase, tuple(sorted(o.group)), o.root, o.dtype, o.numel, o.nbytes) for o in LEDGER.ops
                ]
    return recorded


def _dp_worker(cases, mesh_shape):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import dmuon

    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("replicate", "shard")) if len(mesh_shape) == 2 else None
    out = []
    for kind, z3, micro in cases:
        model = _model(kind)
        if hasattr(model, "set_rank"):
            model.set_rank(rank)
        plan = dmuon.dedicate_params(model, mesh, reshard_after_forward=z3)
        for layer in model.layers:
            fully_shard(layer, mesh=mesh, reshard_after_forward=z3)
        fully_shard(model, mesh=mesh, reshard_after_forward=z3)
        opt = dmuon_optimizer(model)
        batches = global_batches(STEPS, batch=12 * world)  # local batch of 12: 1, 2 or 3 micro-batches
        out.append((plan.to_json(), _run_steps(model, opt, batches, world=world, rank=rank, micro=micro)))
        dist.barrier()
    return out


def _tp_worker(cases):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import dmuon
    from dmuon._train.byte_gpt import GPT, apply_tensor_parallel
    from test_tp import _cfg

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp_rank = mesh["dp"].get_local_rank()
    cfg = _cfg()
    out = []
    for tp_ns, z3, micro in cases:
        model = GPT(cfg, seed=0)
        apply_tensor_parallel(model, mesh["tp"])
        plan = dmuon.dedicate_params(model, mesh["dp"], reshard_after_forward=z3, tp=dmuon.plan.TPPolicy(ns=tp_ns))
        for layer in model.layers:
            fully_shard(layer, mesh=mesh["dp"], reshard_after_forward=z3)
        fully_shard(model, mesh=mesh["dp"], reshard_after_forward=z3)
        opt = dmuon_optimizer(model)
        batches = global_batches(STEPS, batch=8, seq=cfg.seq_len, vocab=cfg.vocab_size, seed=3)
        out.append((plan.to_json(), _run_steps(model, opt, batches, world=2, rank=dp_rank, micro=micro)))
        dist.barrier()
    return out


def _expected(plan, step: P.Step, rank: int) -> list[tuple]:
    return [
        (op.kind, op.phase, op.group, op.root, op.dtype, op.numel, op.charged_nbytes(rank))
        for op in plan.schedule(step).rank_ops(rank)
        if op.collective
    ]


def _check(results, cases, step_of, what: str) -> None:
    for i, case in enumerate(cases):
        plans = {r[i][0] for r in results}
        assert len(plans) == 1, f"{what} {case}: ranks disagree on the plan"
        plan = P.ShardingPlan.from_json(plans.pop())
        step = step_of(case, plan)
        for rank, per_case in enumerate(results):
            recorded = per_case[i][1]
            expected = _expected(plan, step, rank)
            first = next((k for k, (a, b) in enumerate(zip(recorded, expected)) if a != b), None)
            assert first is None and len(recorded) == len(expected), (
                f"{what} {case} rank {rank}: op {first if first is not None else min(len(recorded), len(expected))} "
                f"differs (recorded {len(recorded)} ops, scheduled {len(expected)}):\n"
                f"  recorded:  {recorded[first] if first is not None and first < len(recorded) else None}\n"
                f"  scheduled: {expected[first] if first is not None and first < len(expected) else None}"
            )
            assert recorded, f"{what} {case} rank {rank}: nothing recorded"


DP_CASES = [
    # (model, reshard_after_forward, micro-batches; all but the last under dmuon.no_sync)
    ("tiny", True, 1),
    ("tiny", False, 1),
    ("gated", True, 1),  # a matrix used twice per forward, one used by rank 0 only, one by none
    ("repeat", True, 1),  # a boundary called twice
    ("repeat", False, 1),
    ("skip", True, 1),  # a boundary never called: neither broadcast nor reduced
    ("tiny", True, 3),  # gradient accumulation with no_sync
    ("tiny", False, 2),
    ("ckpt", True, 1),  # checkpoint inside the boundary
    ("ckpt_parent", True, 1),  # each boundary checkpointed from its parent: recomputed in backward
    ("ckpt_parent", False, 1),
]


def test_runtime_issues_the_schedule_1d():
    results = run_distributed(_dp_worker, 2, DP_CASES, (2,), timeout_s=300)
    _check(results, DP_CASES, lambda case, plan: _step(case[0], case[2], plan), "1-D N=2")


HSDP_CASES = [("tiny", True, 1), ("tiny", False, 2), ("repeat", True, 1), ("gated", False, 1)]
TP_CASES = [("gram", True, 1), ("gather", False, 2)]


def _hsdp_and_tp_worker():
    return _dp_worker(HSDP_CASES, (2, 2)), _tp_worker(TP_CASES)


def test_runtime_issues_the_schedule_hsdp_and_tp():
    """HSDP (2, 2) and TP (dp 2 x tp 2), one after the other in one 4-rank process group."""
    runs = run_distributed(_hsdp_and_tp_worker, 4, timeout_s=2 * 300)
    results = [r[0] for r in runs]
    _check(results, HSDP_CASES, lambda case, plan: _step(case[0], case[2], plan), "HSDP (2, 2)")
    results = [r[1] for r in runs]
    _check(results, TP_CASES, lambda case, plan: _step("gpt", case[2], plan), "TP dp=2 x tp=2")
    tp_plan = P.ShardingPlan.from_json(results[0][0][0])
    assert tp_plan.tp_size == 2 and any(op.phase == "tp" for op in tp_plan.schedule().ops)
