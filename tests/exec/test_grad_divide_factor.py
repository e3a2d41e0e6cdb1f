"""dmuon's reduce honours FSDP2's gradient divide factor.

torchtitan (and anyone who normalises the loss by a *global* token count) calls
``set_gradient_divide_factor(1.0)`` on every ``fully_shard`` unit and divides each rank's summed
token loss by the token count of the whole global batch, so that FSDP2's SUM-reduce yields the
gradient of the global mean loss. dmuon's owners must then divide the reduced gradient by the
same factor (1), not by ``R·N``; otherwise the dedicated matrices would see gradients ``R·N``
times too small while the FSDP2-sharded parameters see the right ones.

One launch at W = 2 runs a 1-D mesh and an HSDP ``(2, 1)`` mesh, 3 steps each, with
``loss = sum of token losses on this rank / global token count`` and factor 1.0, against the
single-process oracle on the mean loss: the owners' step-0 gradients (1e-5 of max|g|), the
clipping norm of every step (1e-5 relative; clipped at 0.05, so it bites), losses (1e-6
relative) and parameters (1e-4 of max|p|, fp32 Newton-Schulz). On gloo the units also get ``set_force_sum_reduction_for_comms(True)``: FSDP2
reduces with ``ReduceOp.PREMUL_SUM(1/factor)`` otherwise, which gloo lacks. A third case leaves the factor unset and averages the loss locally (dmuon's
default ``R·N`` path, unchanged); a fourth sets the factor to ``W`` explicitly with the locally
averaged loss (the same arithmetic FSDP2 does by default).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from dist_utils import run_distributed
from dmuon.exec import dedicated_info
from oracle import global_batches, lm_loss, make_model

STEPS = 3
MAX_NORM = 0.05  # bites: the clip coefficient depends on the gradients' scale
GLOBAL_BATCH = 12

CASES = [
    dict(name="factor_1_sum_over_global_tokens", mesh=None, factor=1.0, global_sum=True),
    dict(name="hsdp_factor_1_sum_over_global_tokens", mesh=(2, 1), factor=1.0, global_sum=True),
    dict(name="default_factor_local_mean", mesh=None, factor=None, global_sum=False),
    dict(name="factor_W_local_mean", mesh=None, factor="world", global_sum=False),
]


def _worker(cases):
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, fully_shard

    import dmuon
    from oracle import dmuon_optimizer

    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    out = []
    for case in cases:
        mesh = init_device_mesh("cpu", case["mesh"], mesh_dim_names=("replicate", "shard")) if case["mesh"] else None
        model = make_model("tiny")
        plan = dmuon.dedicate_params(model, mesh)
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        factor = case["factor"]
        if factor is not None:
            for module in model.modules():  # per unit, as torchtitan's disable_fsdp_gradient_division
                if isinstance(module, FSDPModule):
                    module.set_gradient_divide_factor(float(world if factor == "world" else factor))
                    # gloo has no ReduceOp.PREMUL_SUM, which FSDP2 uses for a factor other than N
                    module.set_force_sum_reduction_for_comms(True)
        opt = dmuon_optimizer(model, torch.float32)
        losses, norms, grads = [], [], {}
        for batch in global_batches(STEPS, batch=GLOBAL_BATCH):
            local = batch.chunk(world)[rank]
            if case["global_sum"]:
                logits = model(local[:, :-1])
                token_sum = F.cross_entropy(
                    logits.reshape(-1, logits.shape[-1]), local[:, 1:].reshape(-1), reduction="sum"
                )
                global_tokens = batch[:, 1:].numel()  # what torchtitan all-reduces as global_valid_tokens
                loss = token_sum / global_tokens
            else:
                loss = lm_loss(model, local)
            loss.backward()
            if not grads:  # first step: the owners' reduced gradients
                for fqn, p in model.named_parameters():
                    info = dedicated_info(p)
                    if info is not None and info.is_owner and p.grad is not None:
                        grads[fqn] = p.grad.detach().clone()
            norms.append(dmuon.clip_grad_norm_(model, MAX_NORM).item())
            opt.step()
            opt.zero_grad()
            t = loss.detach().clone()
            dist.all_reduce(t)
            losses.append(t.item() if case["global_sum"] else t.item() / world)
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
        out.append(
            dict(
                dedicated=list(plan.dedicated),
                losses=losses,
                norms=norms,
                grads=grads,
                full={k: v.detach().float().clone() for k, v in full.items()} if rank == 0 else None,
            )
        )
        dist.barrier()
    return out


def _reference(dedicated, batches):
    """Single process, global batch, mean loss: step-0 gradients, per-step total norms (clipped to
    MAX_NORM), losses and final state (torch Muon with fp32 NS + AdamW)."""
    import copy

    from oracle import fp32_newton_schulz, reference_optimizers

    model = copy.deepcopy(make_model("tiny"))
    muon, adamw = reference_optimizers(model, dedicated)
    losses, norms, grads = [], [], {}
    with fp32_newton_schulz():
        for batch in batches:
            loss = lm_loss(model, batch)
            loss.backward()
            if not grads:
                grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if n in dedicated}
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM).item())
            muon.step()
            adamw.step()
            muon.zero_grad()
            adamw.zero_grad()
            losses.append(loss.item())
    return losses, norms, grads, {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_dedicated_gradients_follow_fsdp2_gradient_divide_factor():
    """Muon's update is invariant to the gradient's scale (momentum is linear, Newton-Schulz
    normalises), so a wrong divisor shows in the gradients themselves and in the clipping norm
    (torchtitan clips at max_norm 1.0 and logs the norm), not in Muon's parameters: all three
    are compared."""
    results = run_distributed(_worker, 2, CASES, timeout_s=300)
    batches = global_batches(STEPS, batch=GLOBAL_BATCH)
    for i, case in enumerate(CASES):
        where = case["name"]
        got = results[0][i]
        ref_losses, ref_norms, ref_grads, ref_state = _reference(set(got["dedicated"]), batches)
        assert ref_norms[0] > MAX_NORM, "the clip must bite"
        for r in results:  # every owned gradient equals the single-process gradient of the mean loss
            for fqn, g in r[i]["grads"].items():
                want = ref_grads[fqn]
                err = (g - want).abs().max().item()
                assert err <= 1e-5 * want.abs().max().item(), (where, fqn, err)
        assert sorted(f for r in results for f in r[i]["grads"]) == sorted(ref_grads), where
        for r in results:
            for g, w in zip(r[i]["norms"], ref_norms):
                assert math.isclose(g, w, rel_tol=1e-5), (where, g, w)
        for g, w in zip(got["losses"], ref_losses):
            assert math.isclose(g, w, rel_tol=1e-6), (where, g, w)
        assert set(got["full"]) == set(ref_state), where
        for k, want in ref_state.items():
            scale = want.abs().max().item() or 1.0
            err = (got["full"][k] - want.float()).abs().max().item()
            assert err <= 1e-4 * scale, (where, k, err, scale)
