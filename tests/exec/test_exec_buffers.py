"""Reused reduce buffers and one presence-flag read per backward.

Every segment reduces through ONE buffer tensor built on its first reduce and reused by every
later backward (same tensor, same storage object), whose storage is released at the end of each
backward (no rank keeps gradient-sized memory between backwards); owners' ``.grad`` never
aliases it (the next backward zeroes and rewrites it while ``.grad`` may still accumulate). Checked against the
single-process gradient of the global batch through the ways ``.grad`` is used between steps:
accumulation over two backwards, ``zero_grad()`` (``.grad`` back to None),
``zero_grad(set_to_none=False)``, optimizer steps. ``finish_reduces`` reads the flags this rank
owns with exactly one ``Tensor.tolist`` (one host sync on CUDA), whatever the number of
boundaries. Ledger bytes of each backward equal the plan. Each post-backward retires the
boundary reduced before it before its own buffers grow (every buffer on 1-D, the averages
staged; on HSDP what the rank only sent), so the most reduce-buffer bytes held at once equal the
memory model's (``rank_memory.reduce_buffer_nbytes``); a boundary's received copies are freed
before its reduce buffers grow. 1-D mesh N = 2 (its buffers
all-gathered, as collectives="auto" picks, and broadcast) and HSDP (2, 1). An all-gathered
buffer's reduce buffers are its reduce-scatter input and output (the held segment's reduce_buf).
"""

from __future__ import annotations

import copy

import pytest
import torch

from dmuon.exec import dedicated_info, get_model_runtime
from shared_launch import shared_run
from oracle import dmuon_optimizer, global_batches, lm_loss, make_model


def _reference_grads(model, batch):
    model.zero_grad(set_to_none=True)
    lm_loss(model, batch).backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def _worker(mesh_shape, collectives):
    import torch.distributed as dist

    import dmuon
    from dmuon.exec._comm.collective_calls import LEDGER

    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    ref_model = make_model("tiny")
    model = copy.deepcopy(ref_model)
    batches = global_batches(2)
    ref = [_reference_grads(ref_model, b) for b in batches]
    plan = dmuon.dedicate_params(model, mesh_shape, reshard_after_forward=True, collectives=collectives)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    fsdp_mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("replicate", "shard")) if mesh_shape else None
    for layer in model.layers:  # the set-up order dmuon.Muon checks at its first step
        fully_shard(layer, mesh=fsdp_mesh)
    fully_shard(model, mesh=fsdp_mesh)
    rt = get_model_runtime(model)
    opt = dmuon_optimizer(model)
    params = dict(model.named_parameters())
    owned = [fqn for fqn in plan.dedicated if dedicated_info(params[fqn]).is_owner]
    segments = [seg for b in rt.boundaries for seg in b.segments]
    # the reduce buffers: a broadcast segment's own; an all-gathered buffer's reduce-scatter input
    # (k slots) and output (this rank's slot, its held segment's reduce_buf)
    gathers = [gb for b in rt.boundaries for gb in b.gathers]

    def reduce_tensors():
        return [seg.reduce_buf for seg in segments if seg.gather is None] + [
            t for gb in gathers for t in (gb.rs_in, gb.rs_out)
        ]

    # live reduce-buffer bytes whenever a boundary's reduces are launched or finished (just
    # before the earlier ones are retired, and at the end of the backward: the most held at
    # once), and whether any buffer retired (all on 1-D; the sent ones on HSDP) outlives it
    from dmuon.exec._runtime._boundary import grad_reduce as _gr

    def live_nbytes():
        seen = {}
        for t in reduce_tensors():
            if t is not None:
                seen[t.untyped_storage()._cdata] = t.untyped_storage().nbytes()
        return sum(seen.values())

    live = {"peak": 0, "retired_outlived": False, "received_at_reduce": 0}
    orig_retire, orig_finish = _gr.retire_reduces_before, _gr.finish_reduces

    def measuring_retire(ctx):
        live["peak"] = max(live["peak"], live_nbytes())
        orig_retire(ctx)
        for p in ctx.pending_reduces:
            bufs = [p.gather.rs_in] if p.gather is not None else []
            if ctx.groups.shape[0] == 1 or p.segment is None or not p.segment.held:
                bufs.append(p.buf)
            live["retired_outlived"] |= any(t.untyped_storage().nbytes() for t in bufs)

    def measuring_finish(ctx):
        live["peak"] = max(live["peak"], live_nbytes())
        orig_finish(ctx)

    _gr.retire_reduces_before, _gr.finish_reduces = measuring_retire, measuring_finish
    # received bytes still resident on this rank when a boundary's reduce buffers are about to
    # grow: none (its copies are freed first, as FSDP2 reshards before its reduce-scatter)
    orig_launch = _gr.launch_reduce

    def received_nbytes(boundary):
        segs = [seg for seg in boundary.segments if not seg.held and seg.gather is None]
        return sum(seg.wire.untyped_storage().nbytes() for seg in segs) + sum(
            gb.gathered.untyped_storage().nbytes() for gb in boundary.gathers if gb.resident
        )

    def measuring_launch(boundary):
        live["received_at_reduce"] = max(live["received_at_reduce"], received_nbytes(boundary))
        orig_launch(boundary)

    _gr.launch_reduce = measuring_launch
    from dmuon.plan._cost.rank_memory import reduce_buffer_nbytes

    tolist_calls = []
    orig_tolist = torch.Tensor.tolist

    def counting_tolist(self):
        tolist_calls.append(tuple(self.shape))
        return orig_tolist(self)

    def backward(i):
        LEDGER.reset()
        live.update(peak=0, retired_outlived=False, received_at_reduce=0)
        reads = rt._flag_host_reads
        loss = lm_loss(model, batches[i].chunk(world)[rank])
        torch.Tensor.tolist = counting_tolist
        try:
            loss.backward()
        finally:
            torch.Tensor.tolist = orig_tolist
        snap = LEDGER.snapshot()
        t = torch.tensor([snap["reduce"], snap["replicate_reduce"]], dtype=torch.int64)
        dist.all_reduce(t)
        out = {
            "flag_reads": rt._flag_host_reads - reads,
            "tolist": len(tolist_calls),
            "reduce_nbytes": t.tolist(),
            "pending": len(rt.pending_reduces),
            "inflight": any(seg.reduce_inflight for seg in segments) or any(gb.reduce_inflight for gb in gathers),
            "released": all(t.untyped_storage().nbytes() == 0 for t in reduce_tensors()),
            "live_peak": live["peak"],
            "retired_outlived": live["retired_outlived"],
            "received_at_reduce": live["received_at_reduce"],
        }
        tolist_calls.clear()
        return out

    def buffers():  # tensor objects and their storage objects (StorageImpl), not the memory
        return [(id(t), t.untyped_storage()._cdata) for t in reduce_tensors()]

    def aliases_buffer(g):
        storages = {t.untyped_storage()._cdata for t in reduce_tensors()}
        return g.untyped_storage()._cdata in storages

    def grad_errors(expected):
        errs = {}
        for fqn in owned:
            g = params[fqn].grad
            if g is None:
                errs[fqn] = "None"
                continue
            if aliases_buffer(g):
                errs[fqn] = "aliases the reduce buffer"
            err = (g - expected[fqn]).abs().max().item()
            if err > 1e-5 * max(1.0, expected[fqn].abs().max().item()):
                errs[fqn] = err
        return errs

    log = {
        "owned": len(owned),
        "cost": [plan.cost.reduce_nbytes, plan.cost.replicate_reduce_nbytes],
        "model_reduce_nbytes": reduce_buffer_nbytes(plan)[rank],
    }
    log["b0"] = backward(0)
    log["err0"] = grad_errors(ref[0])
    bufs = buffers()
    grad_ptrs = {fqn: params[fqn].grad.data_ptr() for fqn in owned}
    # accumulation: a second backward before the step adds into the same .grad
    log["b1"] = backward(1)
    acc = {fqn: ref[0][fqn] + ref[1][fqn] for fqn in owned}
    log["err_acc"] = grad_errors(acc)
    log["grad_kept"] = all(params[fqn].grad.data_ptr() == grad_ptrs[fqn] for fqn in owned)
    log["bufs_same_1"] = buffers() == bufs
    # zero_grad() (set_to_none=True): .grad is None until the next backward
    opt.zero_grad()
    log["none_after_zero_grad"] = all(p.grad is None for p in params.values())
    log["b2"] = backward(0)
    log["err_after_none"] = grad_errors(ref[0])
    # zero_grad(set_to_none=False): the zeroed .grad receives exactly the next average
    opt.zero_grad(set_to_none=False)
    log["b3"] = backward(1)
    log["err_after_zero"] = grad_errors(ref[1])
    # optimizer steps: the buffers survive them unchanged
    opt.step()
    opt.zero_grad()
    log["b4"] = backward(0)
    opt.step()
    opt.zero_grad()
    log["bufs_same_end"] = buffers() == bufs
    log["dtype_device"] = all(
        seg.reduce_buf.dtype == seg.reduce_dtype
        and seg.reduce_buf.device == seg.wire.device
        and seg.reduce_buf.numel() == seg.numel
        for seg in segments
        if seg.gather is None
    ) and all(
        gb.rs_in.dtype == gb.rs_out.dtype == gb.reduce_dtype
        and gb.rs_in.numel() == gb.k * gb.slot_numel
        and gb.rs_out.numel() == gb.slot_numel
        and (gb.held is None or gb.held.reduce_buf is gb.rs_out)
        for gb in gathers
    )
    log["kinds"] = sorted({buf.collective for b in plan.boundaries for buf in b.buffers})
    dist.barrier()
    return log


# (mesh, collectives): N = 2 all-gathers these buffers under "auto" (its default) and broadcasts
# them when forced; HSDP (2, 1) has one rank per shard group (nothing moves but the replicate phases)
CONFIGS = [(None, "auto"), (None, "broadcast"), ((2, 1), "auto")]


def _meshes_worker(configs):
    return [_worker(mesh_shape, collectives) for mesh_shape, collectives in configs]


@pytest.mark.parametrize("config", CONFIGS, ids=["n2", "n2_broadcast", "hsdp_2x1"])
def test_reduce_buffers_reused_released_and_one_flag_read(config):
    # every configuration in one launch of 2 ranks; this test reads its configuration's results
    runs = shared_run("test_exec_buffers", _meshes_worker, 2, CONFIGS, timeout_s=3 * 180)
    results = [r[CONFIGS.index(config)] for r in runs]
    kinds = {(None, "auto"): ["all_gather"], (None, "broadcast"): ["broadcast"], ((2, 1), "auto"): ["broadcast"]}
    assert all(r["b0"]["live_peak"] > 0 for r in results), config
    assert all(r["kinds"] == kinds[config] for r in results), config
    assert any(r["owned"] for r in results)
    for rank, log in enumerate(results):
        for key in ("err0", "err_acc", "err_after_none", "err_after_zero"):
            assert log[key] == {}, (rank, key, log[key])
        assert log["grad_kept"], rank
        assert log["bufs_same_1"] and log["bufs_same_end"], rank
        assert log["none_after_zero_grad"], rank
        assert log["dtype_device"], rank
        for key in ("b0", "b1", "b2", "b3", "b4"):
            b = log[key]
            assert b["pending"] == 0 and not b["inflight"] and b["released"], (rank, key, b)
            # one host read of the flags per backward on a rank that owns a matrix, none otherwise
            want = 1 if log["owned"] else 0
            assert b["flag_reads"] == want and b["tolist"] == want, (rank, key, b)
            assert b["reduce_nbytes"] == log["cost"], (rank, key, b)
            # the earlier boundaries' buffers go before the next one's grow; the most held is the
            # memory model's figure
            assert not b["retired_outlived"], (rank, key, b)
            assert b["received_at_reduce"] == 0, (rank, key, b)
            assert b["live_peak"] == log["model_reduce_nbytes"], (rank, key, b, log["model_reduce_nbytes"])


def test_coalescing_guard_and_the_coalesced_issue(monkeypatch):
    """NCCL-style coalescing is used only where the group's backend reports it for the device (never
    on CPU / gloo, whose startCoalescing raises); coalesced, a list's broadcasts go inside one
    ``_coalescing_manager`` and return its one work, charged exactly as one by one; otherwise one
    broadcast (and one work) each. No process group needed: torch's calls are stubbed."""
    import contextlib

    from dmuon.exec._comm import collective_calls as C

    class Backend:
        supports_coalescing = True

    class Group:
        def _get_backend(self, device):
            return Backend()

    assert not C.coalescing_supported(Group(), torch.device("cpu"))
    assert C.coalescing_supported(Group(), torch.device("cuda"))
    assert not C.coalescing_supported(object(), torch.device("cuda"))  # no backend query: one by one

    calls = []
    monkeypatch.setattr(
        C, "_charge", lambda kind, phase, t, group, root: calls.append(("charge", kind, t.numel(), root))
    )

    class CM:
        works = ["coalesced work"]

    @contextlib.contextmanager
    def manager(group, device, async_ops):
        calls.append(("start", async_ops))
        yield CM
        calls.append(("end",))

    monkeypatch.setattr(C.dist.distributed_c10d, "_coalescing_manager", manager)
    monkeypatch.setattr(C.dist, "broadcast", lambda t, src, group, async_op: calls.append(("broadcast", src)) or "work")
    items = [(torch.zeros(2), 0), (torch.zeros(3), 1)]
    assert C.broadcast_many(items, group=Group(), phase="forward_broadcast", coalesce=True) == ["coalesced work"]
    assert calls == [
        ("charge", "broadcast", 2, 0),
        ("charge", "broadcast", 3, 1),
        ("start", True),
        ("broadcast", 0),
        ("broadcast", 1),
        ("end",),
    ]
    calls.clear()
    assert C.broadcast_many(items, group=Group(), phase="forward_broadcast", coalesce=False) == ["work", "work"]
    assert calls == [("charge", "broadcast", 2, 0), ("charge", "broadcast", 3, 1), ("broadcast", 0), ("broadcast", 1)]
