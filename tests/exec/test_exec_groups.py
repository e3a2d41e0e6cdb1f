"""dmuon's process-group cache (dmuon.exec._comm.groups): one launch, several dedications.

``dist.new_group`` is counted by a spy on every rank:

* the first dedication on a mesh creates its groups, a second dedication (another model, the
  same mesh) creates none and both models, trained step for step side by side on the shared
  groups, match each other bit for bit and the single-process oracle (fp32 NS bounds of
  tests/exec/test_exec_oracle.py);
* another mesh's rank table gets its own groups;
* :func:`dmuon.exec._comm.groups.release_groups` destroys them (the next dedication creates them
  again), and so does re-initialising the default group (the cache forgets the old world).
"""

from __future__ import annotations

import math
import os
import tempfile

import torch

from dist_utils import run_distributed
from dmuon.exec import get_model_runtime
from oracle import dmuon_optimizer, global_batches, lm_loss, make_model, reference_run

STEPS = 3
FP32_LOSS_RTOL = 1e-6  # the oracle bounds of tests/exec/test_exec_oracle.py (fp32 Newton-Schulz)
FP32_PARAM_TOL = 1e-4


def _worker(store_path):
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.fsdp import fully_shard

    import dmuon
    from dmuon.exec._comm import groups as G

    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    calls = []
    orig = dist.new_group

    def spy(*args, **kwargs):
        calls.append(tuple(kwargs.get("ranks", args[0] if args else ())))
        return orig(*args, **kwargs)

    dist.new_group = spy
    try:

        def dedicate(mesh, shard=True):
            """A dedicated model, its plan and the new_group calls dedicate_params made."""
            model = make_model("tiny")
            before = len(calls)
            plan = dmuon.dedicate_params(model, mesh)
            made = len(calls) - before
            if shard:
                for layer in model.layers:
                    fully_shard(layer)
                fully_shard(model)
            return model, plan, made

        out = {}
        a, plan, out["first"] = dedicate(None)
        b, _, out["second"] = dedicate(None)
        out["second_shares_groups"] = get_model_runtime(a).groups.shard_group is get_model_runtime(b).groups.shard_group
        opts = [dmuon_optimizer(m, torch.float32) for m in (a, b)]
        out["losses"] = [[], []]
        for batch in global_batches(STEPS):  # the two models interleaved, step for step
            local = batch.chunk(world)[rank]
            for i, (m, opt) in enumerate(zip((a, b), opts)):
                loss = lm_loss(m, local)
                loss.backward()
                opt.step()
                opt.zero_grad()
                t = loss.detach().clone()
                dist.all_reduce(t)
                out["losses"][i].append(t.item() / world)
        full = [get_model_state_dict(m, options=StateDictOptions(full_state_dict=True)) for m in (a, b)]
        out["full"] = [{k: v.detach().clone() for k, v in f.items()} for f in full] if rank == 0 else None
        out["plan_json"] = plan.to_json()
        out["tables"] = len(G.cached_group_tables())

        _, _, out["hsdp_first"] = dedicate((world, 1), shard=False)  # another rank table: its own groups
        _, _, out["hsdp_second"] = dedicate((world, 1), shard=False)
        out["tables_after_hsdp"] = len(G.cached_group_tables())

        out["released"] = G.release_groups()
        out["tables_after_release"] = len(G.cached_group_tables())
        _, _, out["after_release"] = dedicate(None, shard=False)

        # a re-initialised world: torch destroyed every group, the cache must not hand them out
        dist.barrier()
        dist.destroy_process_group()
        store = dist.FileStore(store_path, world)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
        out["tables_after_reinit"] = len(G.cached_group_tables())
        model, _, out["after_reinit"] = dedicate(None)
        opt = dmuon_optimizer(model, torch.float32)
        loss = lm_loss(model, global_batches(1)[0].chunk(world)[rank])
        loss.backward()
        opt.step()  # the fresh groups work
        out["calls"] = calls
        return out
    finally:
        dist.new_group = orig


def test_second_dedication_reuses_groups_and_matches_oracle():
    world = 2
    with tempfile.TemporaryDirectory() as d:
        results = run_distributed(_worker, world, os.path.join(d, "store"), timeout_s=240)
    for rank, r in enumerate(results):
        where = f"rank {rank}"
        # 1-D mesh over 2 ranks: one shard group; HSDP (2, 1): two shard groups + one replicate group
        assert r["first"] == 1, (where, r["calls"])
        assert r["second"] == 0, (where, r["calls"])
        assert r["second_shares_groups"], where
        assert r["tables"] == 1, where
        assert r["hsdp_first"] == 3 and r["hsdp_second"] == 0, (where, r["calls"])
        assert r["tables_after_hsdp"] == 2, where
        # rank r belongs to the world-wide shard group, its own (2, 1) shard group and the replicate group
        assert r["released"] == 3, where
        assert r["tables_after_release"] == 0, where
        assert r["after_release"] == 1, (where, r["calls"])
        assert r["tables_after_reinit"] == 0, where
        assert r["after_reinit"] == 1, (where, r["calls"])
        assert r["calls"] == results[0]["calls"], where  # the same new_group calls on every rank
    from dmuon.plan import ShardingPlan

    plan = ShardingPlan.from_json(results[0]["plan_json"])
    ref_losses, ref_state, _ = reference_run(
        make_model("tiny"), set(plan.dedicated), global_batches(STEPS), ns_fp32=True, world=world
    )
    first, second = results[0]["losses"]
    assert first == second  # same groups, same data: bit for bit
    for got, want in zip(first, ref_losses):
        assert math.isclose(got, want, rel_tol=FP32_LOSS_RTOL), (got, want)
    full_a, full_b = results[0]["full"]
    assert set(full_a) == set(full_b) == set(ref_state)
    for k, want in ref_state.items():
        assert torch.equal(full_a[k], full_b[k]), k
        scale = want.abs().max().item() or 1.0
        err = (full_a[k] - want).abs().max().item()
        assert err <= FP32_PARAM_TOL * scale, (k, err, scale)
