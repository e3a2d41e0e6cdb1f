"""Reused reduce buffers and one presence-flag read per backward (issue #7).

Every segment reduces through ONE buffer tensor built on its first reduce and reused by every
later backward (same tensor, same storage object), whose storage is released at the end of each
backward (no rank keeps gradient-sized memory between backwards); owners' ``.grad`` never
aliases it (the next backward zeroes and rewrites it while ``.grad`` may still accumulate). Checked against the
single-process gradient of the global batch through the ways ``.grad`` is used between steps:
accumulation over two backwards, ``zero_grad()`` (``.grad`` back to None),
``zero_grad(set_to_none=False)``, optimizer steps. ``finish_reduces`` reads the flags this rank
owns with exactly one ``Tensor.tolist`` (one host sync on CUDA), whatever the number of
boundaries. Ledger bytes of each backward equal the plan. 1-D mesh N = 2 and HSDP (2, 1).
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


def _worker(mesh_shape):
    import torch.distributed as dist

    import dmuon
    from dmuon.exec.comm.collectives import LEDGER

    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    ref_model = make_model("tiny")
    model = copy.deepcopy(ref_model)
    batches = global_batches(2)
    ref = [_reference_grads(ref_model, b) for b in batches]
    plan = dmuon.dedicate_params(model, mesh_shape, reshard_after_forward=True)
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

    tolist_calls = []
    orig_tolist = torch.Tensor.tolist

    def counting_tolist(self):
        tolist_calls.append(tuple(self.shape))
        return orig_tolist(self)

    def backward(i):
        LEDGER.reset()
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
            "inflight": any(seg.reduce_inflight for seg in segments),
            "released": all(seg.reduce_buf.untyped_storage().nbytes() == 0 for seg in segments),
        }
        tolist_calls.clear()
        return out

    def buffers():  # tensor objects and their storage objects (StorageImpl), not the memory
        return [(id(seg.reduce_buf), seg.reduce_buf.untyped_storage()._cdata) for seg in segments]

    def aliases_buffer(g):
        storages = {seg.reduce_buf.untyped_storage()._cdata for seg in segments}
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

    log = {"owned": len(owned), "cost": [plan.cost.reduce_nbytes, plan.cost.replicate_reduce_nbytes]}
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
        seg.reduce_buf.dtype == seg.reduce_dtype and seg.reduce_buf.device == seg.wire.device
        and seg.reduce_buf.numel() == seg.numel
        for seg in segments
    )
    dist.barrier()
    return log


MESH_SHAPES = [None, (2, 1)]


def _meshes_worker(mesh_shapes):
    return [_worker(mesh_shape) for mesh_shape in mesh_shapes]


@pytest.mark.parametrize("mesh_shape", MESH_SHAPES, ids=["n2", "hsdp_2x1"])
def test_reduce_buffers_reused_released_and_one_flag_read(mesh_shape):
    # both meshes in one launch of 2 ranks; this test reads its mesh's results
    runs = shared_run("test_exec_buffers", _meshes_worker, 2, MESH_SHAPES, timeout_s=2 * 180)
    results = [r[MESH_SHAPES.index(mesh_shape)] for r in runs]
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
