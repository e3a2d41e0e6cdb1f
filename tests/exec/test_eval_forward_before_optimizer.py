"""dmuon.Muon built after a forward without its backward.

After ``fully_shard``, an evaluation forward under ``torch.no_grad()`` (or a forward whose loss is
never backpropagated) leaves FSDP2's root unit unsharded, so ``model.parameters()`` yields its
unsharded plain tensors. ``dmuon.Muon(model)`` reshards such units before collecting parameters
and then trains exactly as without the extra forward (bitwise, after 2 steps); built from
``model.parameters()`` it raises naming the cause and ``model.reshard()``, on every rank.
"""

from __future__ import annotations

import pytest
import torch

from dist_utils import run_distributed
from oracle import lm_loss, make_model


def _setup():
    from torch.distributed.fsdp import fully_shard

    import dmuon

    model = make_model("tiny")
    dmuon.dedicate_params(model)
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    return model


def _train(model, opt, steps=2):
    import torch.distributed as dist

    import dmuon

    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        batch = torch.randint(0, 11, (4, 6), generator=g)
        r = dist.get_rank()
        lm_loss(model, batch[2 * r % 4 : 2 * r % 4 + 2]).backward()
        opt.step()
        opt.zero_grad()
    sd = dmuon.full_state_dict(model, rank0_only=False)
    return {k: v.clone() for k, v in sd.items()}


def _cases():
    import dmuon

    batch = torch.randint(0, 11, (2, 6), generator=torch.Generator().manual_seed(1))
    out = {}
    model = _setup()
    out["reference"] = _train(model, dmuon.Muon(model, lr=0.02, adamw_lr=3e-3))

    model = _setup()
    with torch.no_grad():
        lm_loss(model, batch)
    out["no_grad_root_unsharded"] = not all(hasattr(p, "to_local") for n, p in model.named_parameters() if "emb" in n)
    out["no_grad"] = _train(model, dmuon.Muon(model, lr=0.02, adamw_lr=3e-3))

    model = _setup()
    lm_loss(model, batch)  # a loss whose backward never runs
    out["no_backward"] = _train(model, dmuon.Muon(model, lr=0.02, adamw_lr=3e-3))

    model = _setup()
    with torch.no_grad():
        lm_loss(model, batch)
    try:
        dmuon.Muon(model.parameters(), lr=0.02)
        out["params_error"] = None
    except RuntimeError as exc:
        out["params_error"] = str(exc)
    model.reshard()  # the fix the message names
    out["params_after_reshard"] = _train(model, dmuon.Muon(model.parameters(), lr=0.02, adamw_lr=3e-3))
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_optimizer_after_forward_without_backward(world):
    results = run_distributed(_cases, world, timeout_s=240)
    for r in results:
        assert r["no_grad_root_unsharded"]  # the state the test is about
        ref = r["reference"]
        for case in ("no_grad", "no_backward", "params_after_reshard"):
            assert r[case].keys() == ref.keys()
            for k in ref:
                assert torch.equal(r[case][k], ref[k]), (case, k)
        msg = r["params_error"]
        assert msg is not None and msg == results[0]["params_error"]
        assert "['<root>']" in msg and "torch.no_grad()" in msg and "model.reshard()" in msg, msg
        assert "built before fully_shard" not in msg and "after fully_shard" not in msg
