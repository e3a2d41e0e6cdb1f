"""Lightning's ModelParallelStrategy with dmuon, W = 2 on CPU/gloo, against the oracle.

``configure_model`` calls ``dmuon.dedicate_params`` on the strategy's data-parallel mesh, then
``fully_shard`` per boundary block and the root; ``configure_optimizers`` returns
``dmuon.Muon``. The strategy is given ``data_parallel_size=2, tensor_parallel_size=1``: its
defaults on one node are dp = 1 x tp = 2 (data-parallel size = number of nodes). Also: an
optimizer built from ``self.parameters()`` fails at its first step with Lightning's fix, and
``strategy="ddp"`` fails when it wraps the dedicated model.
"""

from __future__ import annotations

import pytest

pytest.importorskip("lightning", reason="the [lightning] extra is not installed: pip install -e '.[lightning]'")

import torch  # noqa: E402

import oracle  # noqa: E402
from dist_utils import run_distributed  # noqa: E402

STEPS = 3


def _lit_module(foreign_optimizer: bool):
    import lightning as L
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    import dmuon

    class LitLM(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = oracle.make_model("tiny", seed=0)
            self.losses = []

        def configure_model(self):
            if dmuon.exec.get_model_runtime(self.model) is not None:
                return  # configure_model may run again (e.g. trainer.test after fit)
            mesh = self.device_mesh["data_parallel"]
            plan = dmuon.dedicate_params(self.model, mesh)
            for block in dmuon.integrations.boundary_modules(self.model, plan):
                fully_shard(block, mesh=mesh)
            fully_shard(self.model, mesh=mesh)

        def configure_optimizers(self):
            if foreign_optimizer:
                return torch.optim.AdamW(self.parameters())
            return oracle.dmuon_optimizer(self.model)  # dmuon.Muon, fp32 Newton-Schulz

        def training_step(self, batch, batch_idx):
            loss = oracle.lm_loss(self.model, batch[0])
            t = loss.detach().clone()
            dist.all_reduce(t)
            self.losses.append(t.item() / dist.get_world_size())
            return loss

    return LitLM()


def _lightning_cases():
    import lightning as L
    import torch.distributed as dist
    from lightning.pytorch.strategies import ModelParallelStrategy

    import dmuon

    rank, world = dist.get_rank(), dist.get_world_size()
    batches = oracle.global_batches(STEPS)
    # rank r's loader yields its contiguous slice of each global batch, in step order
    local = torch.cat([b.chunk(world)[rank] for b in batches])
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(local), batch_size=local.shape[0] // STEPS, shuffle=False
    )

    def trainer():
        return L.Trainer(
            accelerator="cpu",
            devices=world,
            max_steps=STEPS,
            strategy=ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1),
            use_distributed_sampler=False,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )

    lit = _lit_module(foreign_optimizer=False)
    trainer().fit(lit, loader)
    plan = dmuon.exec.get_model_runtime(lit.model).plan
    ref_losses, ref_sd, _ = oracle.reference_run(
        oracle.make_model("tiny", seed=0), set(plan.dedicated), batches, ns_fp32=True
    )
    full = dmuon.full_state_dict(lit.model, rank0_only=False)
    err = max((full[k] - v).abs().max().item() / (v.abs().max().item() or 1.0) for k, v in ref_sd.items())
    out = {"losses": lit.losses, "ref_losses": ref_losses, "param_err": err, "mesh": tuple(lit.device_mesh.shape)}
    try:
        trainer().fit(_lit_module(foreign_optimizer=True), loader)
    except TypeError as e:
        out["foreign"] = str(e)
    # DDPStrategy wraps the dedicated model in DistributedDataParallel
    lit = _lit_module(foreign_optimizer=False)
    lit.configure_model = lambda: dmuon.dedicate_params(lit.model, None) and None
    try:
        L.Trainer(
            accelerator="cpu",
            devices=world,
            max_steps=1,
            strategy="ddp",
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            use_distributed_sampler=False,
        ).fit(lit, loader)
    except ValueError as e:
        out["ddp"] = str(e)
    return out


def test_lightning_model_parallel_strategy_matches_oracle():
    results = run_distributed(_lightning_cases, 2, timeout_s=300)
    for r in results:
        assert r["mesh"] == (2, 1)  # (data_parallel, tensor_parallel)
        torch.testing.assert_close(r["losses"], r["ref_losses"], rtol=1e-6, atol=0)
        assert r["param_err"] < 1e-4, r["param_err"]
        assert r["losses"][-1] < r["losses"][0]
        assert "AdamW holds" in r["foreign"] and "lightning:" in r["foreign"]
        assert "configure_optimizers" in r["foreign"]
        assert "DistributedDataParallel around" in r["ddp"] and "ModelParallelStrategy" in r["ddp"]
