"""Hugging Face transformers models, accelerate's FSDP2 prepare and transformers.Trainer.

* The default predicate and hook-boundary heuristic on Llama, Qwen2 (tied), Qwen3, GPT-2
  (Conv1D, tied), BERT and ViT: a golden table (no process group).
* W = 2 on CPU/gloo against the single-process oracle (torch.optim.Muon with fp32 Newton-Schulz
  + AdamW, global batch), in ONE process group: each model with the plain FSDP2 recipe;
  accelerate's FSDP2 ``prepare`` (Llama: the data_ptr re-map, gradient clipping through
  ``accelerator.clip_grad_norm_``); ``transformers.Trainer`` with FSDP2 (GPT-2); and the first
  errors (fully_shard before dedicate_params, an optimizer from model.parameters(), DDP,
  cpu_ram_efficient_loading).

accelerate 1.15 turns FSDP on only for GPU-like devices (``AcceleratorState`` never makes
``MULTI_CPU`` into ``DistributedType.FSDP``), so on CPU the tests set
``state.distributed_type = FSDP`` and ``state.fsdp_plugin`` right after the Accelerator is
built (:func:`_force_fsdp2_on_cpu`); everything after that is accelerate's and Trainer's own code.
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers", reason="the [hf] extra is not installed: pip install -e '.[hf]'")
pytest.importorskip("accelerate", reason="the [hf] extra is not installed: pip install -e '.[hf]'")

import torch  # noqa: E402

import hf_models  # noqa: E402
from dist_utils import run_distributed  # noqa: E402
from oracle import dmuon_muon_kwargs, dmuon_optimizer, train_steps  # noqa: E402

import dmuon  # noqa: E402

STEPS = 3
LOSS_RTOL = 1e-6  # the fp32 contract (README, "The oracle guarantee")
PARAM_TOL = 1e-4
ORACLE_KINDS = ("llama", "qwen2", "qwen3", "gpt2", "bert", "vit")

# -- golden table: what the defaults pick -----------------------------------------------------

PER_LAYER = {  # kind -> (boundary of layer i, dedicated weights below it)
    "llama": (
        "model.layers.{i}",
        [
            "self_attn.q_proj",
            "self_attn.k_proj",
            "self_attn.v_proj",
            "self_attn.o_proj",
            "mlp.gate_proj",
            "mlp.up_proj",
            "mlp.down_proj",
        ],
    ),
    "qwen2": (
        "model.layers.{i}",
        [
            "self_attn.q_proj",
            "self_attn.k_proj",
            "self_attn.v_proj",
            "self_attn.o_proj",
            "mlp.gate_proj",
            "mlp.up_proj",
            "mlp.down_proj",
        ],
    ),
    "qwen3": (
        "model.layers.{i}",
        [
            "self_attn.q_proj",
            "self_attn.k_proj",
            "self_attn.v_proj",
            "self_attn.o_proj",
            "mlp.gate_proj",
            "mlp.up_proj",
            "mlp.down_proj",
        ],
    ),
    "gpt2": ("transformer.h.{i}", ["attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"]),
    "bert": (
        "bert.encoder.layer.{i}",
        [
            "attention.self.query",
            "attention.self.key",
            "attention.self.value",
            "attention.output.dense",
            "intermediate.dense",
            "output.dense",
        ],
    ),
    "vit": (
        "vit.layers.{i}",
        ["attention.q_proj", "attention.k_proj", "attention.v_proj", "attention.o_proj", "mlp.fc1", "mlp.fc2"],
    ),
}
NOT_DEDICATED_2D = {  # 2-D (or more) parameters left to FSDP2 + AdamW, and why
    "llama": ["model.embed_tokens.weight", "lm_head.weight"],  # embedding; outside any block
    "qwen2": ["model.embed_tokens.weight"],  # lm_head tied to it
    "qwen3": ["model.embed_tokens.weight", "lm_head.weight"],
    "gpt2": ["transformer.wte.weight", "transformer.wpe.weight"],  # lm_head tied to wte
    "bert": [
        "bert.embeddings.word_embeddings.weight",
        "bert.embeddings.position_embeddings.weight",
        "bert.embeddings.token_type_embeddings.weight",
        "cls.predictions.transform.dense.weight",
    ],
    "vit": [
        "vit.embeddings.cls_token",
        "vit.embeddings.position_embeddings",
        "vit.embeddings.patch_embeddings.projection.weight",
        "classifier.weight",
    ],
}


@pytest.mark.parametrize("kind", hf_models.KINDS)
def test_default_plan_picks_block_matrices(kind):
    """Every block's projection matrices (GPT-2's Conv1D (in, out) weights included) and nothing
    else: embeddings, heads outside the blocks, norms, biases, the patch convolution stay with
    FSDP2 + AdamW; boundaries are the blocks accelerate wraps (``_no_split_modules``)."""
    with torch.device("meta"):
        model = hf_models.build(kind)
    plan = dmuon.plan.compile(model, 2)
    boundary, subs = PER_LAYER[kind]
    want = [f"{boundary.format(i=i)}.{s}.weight" for i in range(2) for s in subs]
    assert sorted(plan.dedicated) == sorted(want)
    assert [b.fqn for b in plan.boundaries] == [boundary.format(i=i) for i in range(2)]
    assert all(f.startswith(plan.boundary(f) + ".") for f in plan.dedicated)
    matrices = {n for n, p in model.named_parameters() if p.ndim >= 2}
    assert matrices - set(plan.dedicated) == set(NOT_DEDICATED_2D[kind])
    blocks = {type(m).__name__ for m in dmuon.integrations.boundary_modules(model, plan)}
    assert blocks <= set(model._no_split_modules)
    if kind == "gpt2":  # Conv1D stores (in, out): the matrix Muon orthogonalises is that one
        assert plan.param("transformer.h.0.attn.c_attn.weight").matrix_shape == (32, 96)


# -- W = 2 against the oracle ------------------------------------------------------------------


def _force_fsdp2_on_cpu(accelerator, plugin) -> None:
    from accelerate.utils import DistributedType

    state = accelerator.state
    state.distributed_type = DistributedType.FSDP
    state.fsdp_plugin = plugin


def _fsdp2_recipe(kind):
    """The plain recipe: dedicate, fully_shard each boundary block, the root, dmuon.Muon."""
    from torch.distributed.fsdp import fully_shard

    model = hf_models.build(kind)
    data = hf_models.batches(kind, STEPS)
    plan = dmuon.dedicate_params(model, None)
    ref_losses, ref_sd = hf_models.reference_run(hf_models.build(kind), set(plan.dedicated), data)
    for block in dmuon.integrations.boundary_modules(model, plan):
        fully_shard(block)
    fully_shard(model)
    opt = dmuon_optimizer(model)
    losses = train_steps(
        model, opt, data, lambda m, batch, r, w: hf_models.loss_of(m, hf_models.rank_slice(batch, r, w))
    )
    full = dmuon.full_state_dict(model, rank0_only=False)
    return {
        "losses": losses,
        "ref_losses": ref_losses,
        "param_err": hf_models.max_param_error(full, ref_sd),
        "n_dedicated": len(plan.dedicated),
    }


def _accelerate_recipe():
    """accelerate's FSDP2 prepare on Llama: dedicate, dmuon.Muon, prepare, clip through the
    accelerator; the same oracle with the same clipping."""
    import torch.distributed as dist
    from accelerate import Accelerator
    from accelerate.utils import FullyShardedDataParallelPlugin

    rank, world = dist.get_rank(), dist.get_world_size()
    model = hf_models.build("llama")
    data = hf_models.batches("llama", STEPS)
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2,
        auto_wrap_policy="transformer_based_wrap",
        reshard_after_forward=True,
        cpu_ram_efficient_loading=False,
    )
    acc = Accelerator(fsdp_plugin=plugin, cpu=True)
    _force_fsdp2_on_cpu(acc, plugin)
    plan = dmuon.dedicate_params(model, None)
    ref_norms = []
    ref_losses, ref_sd = hf_models.reference_run(
        hf_models.build("llama"), set(plan.dedicated), data, max_grad_norm=0.05, grad_norms=ref_norms
    )
    opt = dmuon_optimizer(model)
    n_before = [len(g["params"]) for g in opt.param_groups]
    model, aopt = acc.prepare(model, opt)
    muon_group = opt.param_groups[0]["params"]
    names = {id(p): n for n, p in model.named_parameters()}
    out = {
        "groups_kept": [len(g["params"]) for g in opt.param_groups] == n_before,
        "muon_group_is_dedicated_in_order": [names[id(p)] for p in muon_group] == list(plan.dedicated),
    }
    losses, norms = [], []
    for batch in data:
        loss = hf_models.loss_of(model, hf_models.rank_slice(batch, rank, world))
        acc.backward(loss)
        norms.append(float(acc.clip_grad_norm_(model.parameters(), 0.05)))
        aopt.step()
        aopt.zero_grad()
        t = loss.detach().clone()
        dist.all_reduce(t)
        losses.append(t.item() / world)
    full = dmuon.full_state_dict(model, rank0_only=False)
    out.update(
        losses=losses,
        ref_losses=ref_losses,
        norms=norms,
        ref_norms=ref_norms,
        param_err=hf_models.max_param_error(full, ref_sd),
    )
    return out


def _trainer_recipe(out_dir):
    """transformers.Trainer with FSDP2 (GPT-2: Conv1D, tied embeddings), max_grad_norm=0.05,
    constant LR, sequential data: the same oracle."""
    import torch.distributed as dist
    import transformers as T
    from accelerate.utils import FullyShardedDataParallelPlugin

    from dmuon.integrations.hf import MuonFactory

    world = dist.get_world_size()
    per_device = 2
    data = hf_models.batches("gpt2", STEPS, global_batch=per_device * world)
    rows = [{k: v[i] for k, v in b.items()} for b in data for i in range(per_device * world)]

    class Rows(torch.utils.data.Dataset):
        def __len__(self):
            return len(rows)

        def __getitem__(self, i):
            return rows[i]

    class CPUFSDP2Trainer(T.Trainer):
        def create_accelerator_and_postprocess(self):
            super().create_accelerator_and_postprocess()
            _force_fsdp2_on_cpu(self.accelerator, FullyShardedDataParallelPlugin(**self.args.fsdp_plugin_args))
            self.is_fsdp_enabled = True

        def _get_train_sampler(self, *args, **kwargs):  # rank r's batch t = rows of global batch t
            return torch.utils.data.SequentialSampler(self.train_dataset)

    model = hf_models.build("gpt2")
    plan = dmuon.dedicate_params(model, None)
    ref_norms = []
    ref_losses, ref_sd = hf_models.reference_run(
        hf_models.build("gpt2"), set(plan.dedicated), data, max_grad_norm=0.05, grad_norms=ref_norms
    )
    muon_kwargs = dmuon_muon_kwargs()
    args = T.TrainingArguments(
        output_dir=out_dir,
        max_steps=STEPS,
        per_device_train_batch_size=per_device,
        lr_scheduler_type="constant",
        max_grad_norm=0.05,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        remove_unused_columns=False,
        dataloader_drop_last=True,
        fsdp=True,
        fsdp_config={"fsdp_version": 2, "reshard_after_forward": True, "transformer_layer_cls_to_wrap": ["GPT2Block"]},
        disable_tqdm=True,
        average_tokens_across_devices=False,  # per-rank mean, as the oracle
    )
    trainer = CPUFSDP2Trainer(
        model=model, args=args, train_dataset=Rows(), optimizer_cls_and_kwargs=(MuonFactory, muon_kwargs)
    )
    trainer.train()
    out = {"optimizer": type(trainer.optimizer.optimizer).__name__}
    # Trainer's default optimizer (AdamW over model.parameters()) is refused in prepare
    model = hf_models.build("gpt2")
    dmuon.dedicate_params(model, None)
    try:
        CPUFSDP2Trainer(model=model, args=args, train_dataset=Rows()).train()
    except TypeError as e:
        out["default_optimizer"] = str(e)
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    norms = [e["grad_norm"] for e in trainer.state.log_history if "grad_norm" in e]
    full = dmuon.full_state_dict(trainer.model, rank0_only=False)
    errors = hf_models.param_errors(full, ref_sd)
    out.update(
        losses=losses,
        ref_losses=ref_losses,
        norms=norms,
        ref_norms=ref_norms,
        param_err=hf_models.max_param_error(full, ref_sd),
        worst=sorted(errors.items(), key=lambda kv: -kv[1])[:3],
    )
    return out


def _first_errors():
    """Each mistake raises on every rank, before any collective, with the framework's fix."""
    import torch.distributed as dist
    from accelerate import Accelerator
    from accelerate.utils import FullyShardedDataParallelPlugin
    from torch.distributed.fsdp import fully_shard

    out = {}
    # accelerate prepared the model (fully_shard) before dedicate_params
    model = hf_models.build("llama")
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap")
    acc = Accelerator(fsdp_plugin=plugin, cpu=True)
    _force_fsdp2_on_cpu(acc, plugin)
    model, _ = acc.prepare(model, torch.optim.AdamW(model.parameters()))
    try:
        dmuon.dedicate_params(model, None)
    except ValueError as e:
        out["fully_shard_first"] = str(e)
    # an optimizer built from model.parameters() (Trainer's default) passed to prepare
    model = hf_models.build("llama")
    dmuon.dedicate_params(model, None)
    _force_fsdp2_on_cpu(acc, plugin)
    try:
        acc.prepare(model, torch.optim.AdamW(model.parameters()))
    except TypeError as e:
        out["foreign_prepare"] = str(e)
    # ... or stepped directly: the global step pre-hook
    model = hf_models.build("llama")
    dmuon.dedicate_params(model, None)
    for block in model.model.layers:
        fully_shard(block)
    fully_shard(model)
    adamw = torch.optim.AdamW(model.parameters())
    try:
        adamw.step()
    except TypeError as e:
        out["foreign_step"] = str(e)
    # cpu_ram_efficient_loading would reload with assign=True over dmuon's parameters
    model = hf_models.build("llama")
    dmuon.dedicate_params(model, None)
    plugin.cpu_ram_efficient_loading = True
    _force_fsdp2_on_cpu(acc, plugin)
    try:
        acc.prepare(model, dmuon.Muon(model))
    except ValueError as e:
        out["ram_efficient"] = str(e)
    plugin.cpu_ram_efficient_loading = False
    # accelerate without FSDP2 wraps the model in DistributedDataParallel
    from accelerate.utils import DistributedType

    acc.state.distributed_type = DistributedType.MULTI_CPU
    acc.state.fsdp_plugin = None
    model = hf_models.build("llama")
    dmuon.dedicate_params(model, None)
    try:
        acc.prepare(model, dmuon.Muon(model))
    except ValueError as e:
        out["ddp"] = str(e)
    dist.barrier()
    return out


def _all_cases(out_dir):
    out = {kind: _fsdp2_recipe(kind) for kind in ORACLE_KINDS}
    out["accelerate"] = _accelerate_recipe()
    out["trainer"] = _trainer_recipe(out_dir)
    out["errors"] = _first_errors()
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_distributed(_all_cases, 2, str(tmp_path_factory.mktemp("trainer")), timeout_s=400)


def _check_oracle(r):
    torch.testing.assert_close(r["losses"], r["ref_losses"], rtol=LOSS_RTOL, atol=0)
    assert r["param_err"] < PARAM_TOL, r["param_err"]
    assert r["losses"][-1] < r["losses"][0]


@pytest.mark.parametrize("kind", ORACLE_KINDS)
def test_hf_model_fsdp2_matches_oracle(results, kind):
    for rank in (0, 1):
        _check_oracle(results[rank][kind])
    assert results[0][kind]["n_dedicated"] == 2 * len(PER_LAYER[kind][1])


def test_accelerate_fsdp2_prepare_matches_oracle(results):
    """accelerate's data_ptr re-map keeps every dedicated parameter (zero-size placeholders all
    have data_ptr 0), in order; accelerator.clip_grad_norm_ clips by the global norm."""
    for rank in (0, 1):
        r = results[rank]["accelerate"]
        assert r["groups_kept"] and r["muon_group_is_dedicated_in_order"]
        _check_oracle(r)
        torch.testing.assert_close(r["norms"], r["ref_norms"], rtol=1e-5, atol=0)
        assert all(n > 0.05 for n in r["norms"])  # the clip is active in every step
    assert results[0]["accelerate"]["norms"] == results[1]["accelerate"]["norms"]


def test_trainer_fsdp2_matches_oracle(results):
    """Trainer's own loop (its FSDP2 prepare, clipping at max_grad_norm, constant schedule) with
    dmuon.integrations.hf.MuonFactory; Trainer's logged losses are averaged over ranks and its
    logged gradient norms are the global ones (its mixed-mesh norm path goes to
    dmuon.clip_grad_norm_)."""
    for rank in (0, 1):
        r = results[rank]["trainer"]
        assert len(r["losses"]) == STEPS
        torch.testing.assert_close(r["losses"], r["ref_losses"], rtol=LOSS_RTOL, atol=0)
        torch.testing.assert_close(r["norms"], r["ref_norms"], rtol=1e-5, atol=0)
        assert r["param_err"] < PARAM_TOL, r["worst"]
        assert r["optimizer"] == "Muon"
        assert "transformers.Trainer built its own optimizer" in r["default_optimizer"]
        assert "optimizer_cls_and_kwargs=(dmuon.integrations.hf.MuonFactory" in r["default_optimizer"]


def test_first_errors_name_the_framework_fix(results):
    for rank in (0, 1):
        e = results[rank]["errors"]
        assert "already sharded" in e["fully_shard_first"]
        assert "accelerate" in e["fully_shard_first"] and "BEFORE accelerator.prepare" in e["fully_shard_first"]
        assert "AdamW holds" in e["foreign_prepare"] and "dmuon.Muon" in e["foreign_prepare"]
        assert "AdamW holds" in e["foreign_step"]
        assert "cpu_ram_efficient_loading" in e["ram_efficient"] and "assign=True" in e["ram_efficient"]
        assert "DistributedDataParallel" in e["ddp"] and "fsdp_version=2" in e["ddp"]
