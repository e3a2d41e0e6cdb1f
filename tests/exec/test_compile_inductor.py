"""dmuon's hooks next to blocks compiled with the default inductor backend.

``layer.compile()`` compiles ``Module._call_impl``, forward hooks included. dmuon registers its
hooks as FSDP2 does (``torch._dynamo.disable(recursive=True)``, ``dmuon.exec._runtime._boundary.hook_boundary.eager_hook``),
so Dynamo never traces them. Checked on 2 ranks with a tiny model (inductor compiles a few small
kernels; the suite's ``aot_eager`` case in test_training_features.py covers the oracle):

* no graph break anywhere (before: 22 per rank, five sites in dmuon/exec/_runtime/_boundary/hook_boundary.py) and no
  Dynamo warning (before: "Dynamo does not know how to trace the builtin ...");
* losses and parameters of the compiled run equal the eager dmuon run's within fp32 reordering
  (inductor fuses the blocks' elementwise ops: 1e-5 relative losses, 1e-4 of each tensor's
  largest magnitude);
* the ledger of the compiled run equals the plan's bytes every step (the hooks still run).
"""

from __future__ import annotations

import pytest
import torch

from dist_utils import run_distributed

STEPS = 2


def _worker(steps):
    import warnings

    import torch.distributed as dist
    from torch._dynamo.utils import counters
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.fsdp import fully_shard

    import dmuon
    from dmuon.exec._comm.collective_calls import LEDGER
    from oracle import TinyLM, dmuon_optimizer, global_batches, lm_loss

    import torch._inductor.config as inductor_config

    inductor_config.compile_threads = 1  # no compile worker pool: its start-up costs more than these kernels
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for compiled in (False, True):
        torch.manual_seed(0)
        model = TinyLM(n_layers=2)
        plan = dmuon.dedicate_params(model, None)
        for layer in model.layers:
            fully_shard(layer)
            if compiled:
                layer.compile()  # default backend: inductor
        fully_shard(model)
        opt = dmuon_optimizer(model, torch.float32)
        counters.clear()
        losses, ledger_ok = [], True
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for batch in global_batches(steps):
                LEDGER.reset()
                loss = lm_loss(model, batch.chunk(world)[rank])
                loss.backward()
                opt.step()
                opt.zero_grad()
                snap = LEDGER.snapshot()
                ledger_ok &= sum(b for ph, b in snap.items() if ph != "other") == plan.cost.per_rank_nbytes[rank]
                t = loss.detach().clone()
                dist.all_reduce(t)
                losses.append(t.item() / world)
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
        out[compiled] = dict(
            losses=losses,
            ledger_ok=ledger_ok,
            graph_breaks={str(k)[:200]: v for k, v in counters["graph_break"].items()},
            graphs=counters["stats"]["unique_graphs"],
            dynamo_warnings=[str(w.message)[:200] for w in caught if "ynamo" in str(w.message)],
            full={k: v.detach().clone() for k, v in full.items()} if rank == 0 else None,
        )
    return out


def test_inductor_compiled_blocks_with_dmuon_hooks():
    results = run_distributed(_worker, 2, STEPS, timeout_s=400)
    for rank, res in enumerate(results):
        eager, compiled = res[False], res[True]
        assert compiled["graphs"] >= 1, "nothing was compiled"
        assert compiled["graph_breaks"] == {}, (rank, compiled["graph_breaks"])
        assert compiled["dynamo_warnings"] == [], (rank, compiled["dynamo_warnings"])
        assert eager["ledger_ok"] and compiled["ledger_ok"]
        for a, b in zip(compiled["losses"], eager["losses"]):
            assert a == pytest.approx(b, rel=1e-5)
    eager, compiled = results[0][False]["full"], results[0][True]["full"]
    for name, want in eager.items():
        tol = 1e-4 * want.abs().max().item()
        torch.testing.assert_close(compiled[name], want, rtol=0, atol=tol, msg=name)
