"""Bad input to ``dmuon.exec.apply`` / ``dedicate_params`` fails loudly, before any collective
(or, for an offload policy that differs from ``fully_shard``'s, at ``dmuon.Muon``'s first step).

One 2-rank process group runs every case; each case returns the exception type and message
seen on each rank, so the test checks that every rank raised the same clear error (a rank that
raised while another went on into a collective would hang the job, and the timeout would fail
the test).
"""

from __future__ import annotations

import pytest
import torch

from dist_utils import run_distributed
from dmuon.exec import dedicated_info
from oracle import lm_loss, make_model


def _catch(fn):
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the test inspects it
        return type(exc).__name__, str(exc)
    return None


def _error_cases():
    import torch.distributed as dist
    import torch.nn as nn
    from torch.distributed.fsdp import fully_shard

    import dmuon

    rank = dist.get_rank()
    out = {}

    model = make_model("tiny")
    fully_shard(model.layers[0])
    out["fully_shard_first"] = _catch(lambda: dmuon.dedicate_params(model))

    model = make_model("tiny")
    plan4 = dmuon.plan.compile(model, 4)
    out["mesh_mismatch"] = _catch(lambda: dmuon.exec.apply(plan4, model))

    model = make_model("tiny")
    plan = dmuon.plan.compile(model, 2)
    model.layers[1].fc1 = nn.Linear(8, 40)
    out["model_changed"] = _catch(lambda: dmuon.exec.apply(plan, model))

    model = make_model("tiny")
    plan = dmuon.plan.compile(model, 2, reshard_after_forward=(rank == 0))
    out["plans_differ"] = _catch(lambda: dmuon.exec.apply(plan, model))

    model = make_model("tiny")
    out["predicate_1d"] = _catch(
        lambda: dmuon.dedicate_params(model, predicate=lambda fqn, p: fqn.startswith("layers.0"))
    )

    model = make_model("tiny")
    dmuon.dedicate_params(model)
    out["applied_twice"] = _catch(lambda: dmuon.dedicate_params(model))

    opt = dmuon.Muon(model)
    with dmuon.no_sync(model):  # every micro-batch inside no_sync: nothing was ever reduced
        lm_loss(model, torch.randint(0, 11, (2, 5))).backward()
    out["step_without_sync"] = _catch(opt.step)
    dist.barrier()

    # offload of owned state: the policy given to dedicate_params must be the one fully_shard got
    from torch.distributed.fsdp import CPUOffloadPolicy

    batch = torch.randint(0, 11, (2, 5), generator=torch.Generator().manual_seed(rank))
    for case, (ours, theirs) in {
        "offload_dmuon_only": (CPUOffloadPolicy(pin_memory=False), None),
        "offload_fully_shard_only": (None, CPUOffloadPolicy(pin_memory=False)),
    }.items():
        model = make_model("tiny")
        dmuon.dedicate_params(model, offload_policy=ours)
        kw = {} if theirs is None else {"offload_policy": theirs}
        for layer in model.layers:
            fully_shard(layer, **kw)
        fully_shard(model, **kw)
        opt = dmuon.Muon(model)
        lm_loss(model, batch).backward()
        out[case] = _catch(opt.step)
        dist.barrier()
    out["offload_policy_type"] = _catch(lambda: dmuon.dedicate_params(make_model("tiny"), offload_policy="cpu"))
    if not torch.accelerator.is_available():  # the default pin_memory=True needs an accelerator
        out["offload_pinned_on_cpu"] = _catch(
            lambda: dmuon.dedicate_params(make_model("tiny"), offload_policy=CPUOffloadPolicy())
        )
    # and with the same policy on both sides, the model built on meta (to_empty, init_params):
    # dmuon.clip_grad_norm_ over host gradients (owned and FSDP2's) gives the norm of the same
    # set-up without offload, bit for bit
    norms = []
    for policy in (None, CPUOffloadPolicy(pin_memory=False)):
        with torch.device("meta"):
            model = make_model("tiny")
        dmuon.dedicate_params(model, offload_policy=policy)
        kw = {} if policy is None else {"offload_policy": policy}
        for layer in model.layers:
            fully_shard(layer, **kw)
        fully_shard(model, **kw)
        model.to_empty(device="cpu")
        torch.manual_seed(0)
        dmuon.init_params(model)
        lm_loss(model, batch).backward()
        norms.append(dmuon.clip_grad_norm_(model, 0.5))
    out["offload_clip_norm_equal"] = bool(torch.equal(norms[0], norms[1])) and norms[0].item() > 0.5
    return out


def test_bad_input_errors_on_every_rank():
    results = run_distributed(_error_cases, 2, timeout_s=120)
    assert results[0].keys() == results[1].keys()
    for case in results[0]:
        assert results[0][case] == results[1][case], case  # same error everywhere
    r = results[0]
    assert r["fully_shard_first"][0] == "ValueError"
    assert "BEFORE fully_shard" in r["fully_shard_first"][1]
    assert r["mesh_mismatch"][0] == "ValueError" and "(1, 4)" in r["mesh_mismatch"][1]
    assert r["model_changed"][0] == "ValueError" and "recompile" in r["model_changed"][1]
    assert r["plans_differ"][0] == "RuntimeError" and "different plans" in r["plans_differ"][1]
    assert r["predicate_1d"][0] == "ValueError" and "layers.0.norm.weight" in r["predicate_1d"][1]
    assert r["applied_twice"][0] == "ValueError"
    assert r["step_without_sync"][0] == "RuntimeError" and "no_sync" in r["step_without_sync"][1]
    for case in ("offload_dmuon_only", "offload_fully_shard_only"):
        assert r[case][0] == "ValueError", case
        assert "offload_policy" in r[case][1] and "Pass the same policy to both" in r[case][1], case
    assert r["offload_policy_type"][0] == "TypeError" and "CPUOffloadPolicy" in r["offload_policy_type"][1]
    assert r["offload_clip_norm_equal"] is True
    if "offload_pinned_on_cpu" in r:
        assert r["offload_pinned_on_cpu"][0] == "ValueError" and "pin_memory=False" in r["offload_pinned_on_cpu"][1]


def test_apply_without_process_group():
    import torch.distributed as dist

    import dmuon

    assert not dist.is_initialized()
    model = make_model("tiny")
    plan = dmuon.plan.compile(model, 1)
    with pytest.raises(RuntimeError, match="init_process_group"):
        dmuon.exec.apply(plan, model)
    # nothing was modified: parameters are still the model's own full tensors
    assert all(dedicated_info(p) is None for p in model.parameters())
    assert model.layers[0].fc1.weight.shape == torch.Size([36, 8])


def test_collective_backend_reads_the_backend_for_the_device(monkeypatch):
    """dedicate_params' link record: gloo's for a gloo group, the NCCL preset for NCCL and any other
    backend; a group with a backend per device type is read for the model's device."""
    import torch.distributed as dist

    from dmuon.exec._setup.api import collective_backend

    cpu = torch.nn.Linear(2, 2)
    meta = torch.nn.Linear(2, 2, device="meta")
    for backend, model, want in [
        ("gloo", cpu, "gloo"),
        ("nccl", cpu, "nccl"),
        ("mpi", cpu, "nccl"),
        ("cpu:gloo,cuda:nccl", cpu, "gloo"),
        ("cpu:gloo,cuda:nccl", meta, "nccl" if torch.cuda.is_available() else "gloo"),
    ]:
        monkeypatch.setattr(dist, "get_backend", lambda group=None, b=backend: b)
        assert collective_backend(model) == want, backend
