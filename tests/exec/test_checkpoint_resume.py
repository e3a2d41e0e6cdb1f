"""Resume across a process restart, and asynchronous saves.

Two launches of W = 2 gloo ranks (new processes each), several cases per launch:

* **first launch** — per case: train ``SAVE_AT`` steps, save the sharded model + optimizer state
  with ``torch.distributed.checkpoint`` (``dcp.save``, or ``dcp.async_save`` on a gloo group of
  its own with the next training step started before the save completes), then train to
  ``TOTAL_STEPS`` uninterrupted. Records the full state at the save and at the end.
* **second launch** (fresh interpreters, so nothing survives in memory) — per case: build the
  same set-up, ``dcp.load``, check the loaded state equals the state at the save bit for bit
  (dedicated masters and momenta included), train to ``TOTAL_STEPS``, and compare with the
  uninterrupted run: losses, parameters and optimizer state bit-identical.

Cases: fp32 masters with bf16 compute (FSDP2 ``MixedPrecisionPolicy`` and the same policy for
dmuon); gradient accumulation 4 with ``dmuon.no_sync``; ``async_save`` on a 1-D and on an HSDP
(2, 1) mesh; a checkpoint saved by a plan that broadcasts every buffer and resumed by one that
all-gathers them, and the reverse (``collectives=``: the state dicts hold the same masters and
momenta whatever moves them; on N = 2 every gradient is a sum of two, so a reduce and a
reduce-scatter give the same bits and the continuation is bit-identical. On N >= 3 the two may sum
in different orders: the continuation then agrees within the oracle's fp32 bounds, 1e-6 relative
on losses, not bit for bit); a checkpoint saved with offload of owned state on
(``CPUOffloadPolicy(pin_memory=False)`` to ``dedicate_params`` and ``fully_shard``: masters and
momenta on the host) and resumed with it off, against the run that went on with it on.
"""

from __future__ import annotations

import pytest
import torch

from dcp_utils import dcp_load, sharded_state
from dist_utils import run_distributed
from oracle import dmuon_optimizer, global_batches, lm_loss, make_model

pytestmark = pytest.mark.timeout(600)

TOTAL_STEPS = 4
SAVE_AT = 2
GLOBAL_BATCH = 16  # 2 ranks x 4 micro-batches x 2 sequences

CASES = {
    "bf16 compute, fp32 masters": dict(mesh=None, mp=True),
    "gas 4 with no_sync": dict(mesh=None, gas=4),
    "async_save 1-D": dict(mesh=None, async_save=True),
    "async_save HSDP (2, 1)": dict(mesh=(2, 1), async_save=True, z3=False),
    "saved broadcast, loaded all-gathered": dict(mesh=None, collectives=("broadcast", "all_gather")),
    "saved all-gathered, loaded broadcast": dict(mesh=None, collectives=("all_gather", "broadcast")),
    "saved with offload, loaded without": dict(mesh=None, offload=(True, False)),
}


def _build(case, launch: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    import dmuon

    mesh = case["mesh"] and init_device_mesh("cpu", case["mesh"], mesh_dim_names=("replicate", "shard"))
    model = make_model("tiny")
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if case.get("mp") else None
    collectives = case.get("collectives", ("auto", "auto"))[launch]
    offload = case.get("offload", (False, False))[launch]
    off = {"offload_policy": CPUOffloadPolicy(pin_memory=False)} if offload else {}
    plan = dmuon.dedicate_params(
        model, mesh, reshard_after_forward=case.get("z3", True), mp_policy=mp, collectives=collectives, **off
    )
    if collectives != "auto":
        assert {buf.collective for b in plan.boundaries for buf in b.buffers} == {collectives}
    kw = ({} if mp is None else {"mp_policy": mp}) | off
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, **kw)
    fully_shard(model, mesh=mesh, **kw)
    return model, dmuon_optimizer(model, torch.float32)


def _steps(model, opt, batches, gas: int) -> list[float]:
    import torch.distributed as dist

    import dmuon

    rank, world = dist.get_rank(), dist.get_world_size()
    losses = []
    for batch in batches:
        total = 0.0
        micros = batch.chunk(world)[rank].chunk(gas)
        for i, micro in enumerate(micros):
            ctx = dmuon.no_sync(model) if i < gas - 1 else torch.enable_grad()
            with ctx:
                loss = lm_loss(model, micro) / gas
                loss.backward()
            total += loss.item()
        opt.step()
        opt.zero_grad()
        t = torch.tensor(total)
        dist.all_reduce(t)
        losses.append(t.item() / world)
    return losses


def _full(model, opt):
    """Full model and optimizer state on rank 0 (None elsewhere)."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    msd = get_model_state_dict(model, options=options)
    osd = get_optimizer_state_dict(model, opt, options=options)
    return (msd, osd["state"]) if dist.get_rank() == 0 else None


def _first(root):
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    torch.set_num_threads(1)
    # the background save's collectives run on a gloo group of their own, never interleaved
    # with training collectives on the default group (as torchtitan does)
    ckpt_group = dist.new_group(backend="gloo")
    batches = global_batches(TOTAL_STEPS, batch=GLOBAL_BATCH)
    out = {}
    for name, case in CASES.items():
        gas = case.get("gas", 1)
        model, opt = _build(case, 0)
        losses = _steps(model, opt, batches[:SAVE_AT], gas)
        at_save = _full(model, opt)
        path = f"{root}/{name.replace(' ', '_')}"
        if case.get("async_save"):
            future = dcp.async_save(sharded_state(model, opt), checkpoint_id=path, process_group=ckpt_group)
            losses += _steps(model, opt, batches[SAVE_AT : SAVE_AT + 1], gas)  # trains while the save runs
            future.result()
            losses += _steps(model, opt, batches[SAVE_AT + 1 :], gas)
        else:
            dcp.save(sharded_state(model, opt), checkpoint_id=path)
            losses += _steps(model, opt, batches[SAVE_AT:], gas)
        out[name] = dict(losses=losses, at_save=at_save, final=_full(model, opt))
        dist.barrier()
    return out


def _second(root):
    import torch.distributed as dist

    torch.set_num_threads(1)
    batches = global_batches(TOTAL_STEPS, batch=GLOBAL_BATCH)
    out = {}
    for name, case in CASES.items():
        model, opt = _build(case, 1)
        dcp_load(model, opt, f"{root}/{name.replace(' ', '_')}")
        loaded = _full(model, opt)
        losses = _steps(model, opt, batches[SAVE_AT:], case.get("gas", 1))
        out[name] = dict(loaded=loaded, losses=losses, final=_full(model, opt))
        dist.barrier()
    return out


def _assert_equal_states(got, want, where):
    (msd_g, osd_g), (msd_w, osd_w) = got, want
    assert set(msd_g) == set(msd_w), where
    for k in msd_w:
        assert torch.equal(msd_g[k], msd_w[k]), (where, k)
    assert set(osd_g) == set(osd_w), where
    for k, entry in osd_w.items():
        assert set(osd_g[k]) == set(entry), (where, k)
        for key, value in entry.items():
            assert torch.equal(torch.as_tensor(osd_g[k][key]), torch.as_tensor(value)), (where, k, key)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("resume"))
    first = run_distributed(_first, 2, root, timeout_s=420)
    second = run_distributed(_second, 2, root, timeout_s=420)
    return first[0], second[0]


@pytest.mark.parametrize("name", list(CASES))
def test_resume_in_new_processes_is_bit_identical(runs, name):
    first, second = runs
    _assert_equal_states(second[name]["loaded"], first[name]["at_save"], f"{name}: loaded vs state at the save")
    assert second[name]["losses"] == first[name]["losses"][SAVE_AT:], name
    _assert_equal_states(second[name]["final"], first[name]["final"], f"{name}: resumed vs uninterrupted")


def test_masters_and_momenta_are_in_the_checkpoint(runs):
    first, _ = runs
    msd, osd = first["bf16 compute, fp32 masters"]["at_save"]
    dedicated = [k for k, v in osd.items() if "momentum_buffer" in v]
    assert dedicated, "no Muon state in the checkpoint"
    for k in dedicated:
        assert msd[k].dtype == torch.float32, k  # fp32 masters, not the bf16 compute copies
        assert osd[k]["momentum_buffer"].abs().sum() > 0, k
