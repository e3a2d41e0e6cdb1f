"""dmuon inside torchtitan (issue 30): the Llama-3 debug model, FSDP2 applied by torchtitan's own
``parallelize_llama``, dmuon through :mod:`dmuon.integrations.torchtitan`, against the
single-process oracle.

What runs is torchtitan's own code for every piece of a training step except the ``Trainer``
object itself: the model built from its config on ``meta``, ``parallelize_llama`` (wrapped by
``wrap_parallelize``: dedication at its first ``fully_shard``), ``to_empty`` + ``init_weights``,
the optimizer ``Config.build(model_parts=...)`` (``DmuonOptimizersContainer``), the LR scheduler
container, the loss (``CrossEntropyLoss``: sum over this rank's tokens / global token count, as
``Trainer.train_step`` passes ``global_valid_tokens``), ``dist_utils.clip_grad_norm_`` (routed to
``dmuon.clip_grad_norm_`` by ``import dmuon``), and the checkpointer's ``ModelWrapper`` /
optimizer state dicts through DCP. ``Trainer`` cannot be built on a CPU-only machine:
``torchtitan.tools.utils.device_type`` is ``_get_available_device_type() or "cuda"``, so
``Trainer.__init__`` calls ``torch.cuda.set_device`` (and ``ParallelDims.build_mesh`` builds a
"cuda" mesh); the test sets ``torchtitan.distributed.parallel_dims.device_type = "cpu"`` for the
mesh and plays ``train_step``'s lines itself.

CPU adaptations (none is dmuon's): the layers' ``inner_attention`` is
``ScaledDotProductAttention`` (flex attention has no CPU backward, varlen no CPU kernel, and
torchtitan refuses ``attn_backend="sdpa"`` for language models); ``mixed_precision_param =
"float32"``; FSDP2's units get ``set_force_sum_reduction_for_comms(True)`` (torchtitan's divide
factor 1.0 makes FSDP2 reduce with ``ReduceOp.PREMUL_SUM``, which gloo lacks);
``spmd_backend = "partial_dtensor"`` (see dmuon.integrations.torchtitan).

Oracle: one process, the same model and weights, the global batch, mean token loss,
``torch.nn.utils.clip_grad_norm_`` at the same max norm, ``torch.optim.Muon`` (fp32
Newton-Schulz) on the dedicated matrices + ``torch.optim.AdamW`` on the rest, learning rates
scaled per step by the factor torchtitan's scheduler applied. Bounds: the contract's fp32 ones
(losses 1e-6 relative, parameters 1e-4 of max|p|), clipping norms 1e-5 relative.
"""

from __future__ import annotations

import math
import types

import pytest
import torch

pytest.importorskip(
    "torchtitan",
    reason="torchtitan not installed: pip install -e '.[torchtitan]' triton torch==2.13.0 (docs/integrations.md)",
)
pytest.importorskip("triton", reason="torchtitan's models import triton: pip install triton (CPU wheel works)")

from dist_utils import run_distributed  # noqa: E402

STEPS = 3
BATCH, SEQ = 4, 16  # global batch: BATCH sequences of SEQ + 1 tokens
DIM, HEADS, LAYERS, VOCAB = 64, 4, 2, 256
MAX_NORM = 0.5  # bites (the step-0 norm is ~2): the clip depends on the gradients' scale
HP = dict(lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True, adamw_lr=3e-3, adamw_betas=(0.9, 0.95),
          adamw_eps=1e-8, adamw_weight_decay=0.1)


def _model_config():
    """torchtitan's Llama-3 debug model, smaller (2 layers, dim 64, vocab 256), SDPA attention."""
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm, compute_ffn_hidden_dim
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3 import Llama3Model, _build_llama3_layers

    layers = _build_llama3_layers(
        n_layers=LAYERS, dim=DIM, n_heads=HEADS, hidden_dim=compute_ffn_hidden_dim(DIM, multiple_of=32),
        rope=ComplexRoPE.Config(dim=DIM // HEADS, max_seq_len=SEQ, theta=500000, scaling="llama"),
        attn_backend="flex",
    )
    for layer in layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    std = DIM**-0.5
    return Llama3Model.Config(
        dim=DIM, vocab_size=VOCAB,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM,
                                        param_init={"weight": torch.nn.init.normal_}),
        norm=RMSNorm.Config(normalized_shape=DIM, param_init={"weight": torch.nn.init.ones_}),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB,
                              param_init={"weight": lambda t: torch.nn.init.trunc_normal_(t, std=std)}),
        layers=layers,
    )


def _reference_model():
    """The unsharded model with its torchtitan initialisation, seed 0 (every rank builds it alike)."""
    torch.manual_seed(0)
    model = _model_config().build()
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    return model


def _batches():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g) for _ in range(STEPS)]


def _setup(world, mesh_shape, tmp, tp=1):
    """torchtitan's build path up to the optimizer: model on meta, parallelize (wrapped), init,
    the reference weights loaded, optimizer / LR scheduler / loss from their configs."""
    import torch.distributed as dist
    import torchtitan.distributed.parallel_dims as titan_pd
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.fsdp import FSDPModule
    from torchtitan.components.loss import CrossEntropyLoss
    from torchtitan.components.optimizer import LRSchedulersContainer
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.models.llama3 import parallelize_llama

    from dmuon.integrations.torchtitan import muon_optimizer, wrap_parallelize

    replicate, shard = mesh_shape
    parallelism = ParallelismConfig(spmd_backend="partial_dtensor", data_parallel_replicate_degree=replicate,
                                    data_parallel_shard_degree=shard, tensor_parallel_degree=tp)
    training = TrainingConfig(mixed_precision_param="float32", local_batch_size=BATCH // world, seq_len=SEQ,
                              steps=STEPS, max_norm=MAX_NORM)
    titan_pd.device_type = "cpu"  # torchtitan's default is "cuda" on a machine without accelerator
    parallel_dims = ParallelDims.from_config(parallelism, world)
    parallel_dims.build_mesh()
    dist_utils.set_spmd_backend(parallelism.spmd_backend)

    config = _model_config()
    config.update_from_config(config=types.SimpleNamespace(parallelism=parallelism))
    with torch.device("meta"):
        model = config.build()
    parallelize = wrap_parallelize(parallelize_llama)
    model = parallelize(model, parallel_dims=parallel_dims, training=training, parallelism=parallelism,
                        compile_config=CompileConfig(), ac_config=None, dump_folder=tmp)
    for module in model.modules():  # gloo has no PREMUL_SUM (torchtitan's divide factor is 1.0)
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    set_model_state_dict(model, _reference_model().state_dict(), options=StateDictOptions(full_state_dict=True))
    model.train()

    hp = dict(HP)
    optimizer_config = muon_optimizer(lr=hp.pop("lr"), adamw_lr=hp.pop("adamw_lr"), ns_dtype="float32", **hp)
    optimizers = optimizer_config.build(model_parts=[model])
    lr_schedulers = LRSchedulersContainer.Config(warmup_steps=2, decay_ratio=0.5, min_lr_factor=0.1).build(
        optimizers=optimizers, training_steps=STEPS
    )
    loss_fn = CrossEntropyLoss.Config(global_vocab_size=VOCAB).build(compile_config=CompileConfig())
    assert dist.get_world_size() == world
    return model, parallel_dims, training, optimizers, lr_schedulers, loss_fn


def _train_step(model, parallel_dims, training, optimizers, lr_schedulers, loss_fn, batch):
    """``Trainer.train_step``'s lines for one micro-batch per step, no PP: returns (global loss,
    grad norm, LR factor applied at this step)."""
    import torch.distributed as dist
    from torchtitan.distributed import utils as dist_utils

    optimizers.zero_grad()
    if parallel_dims.dp_enabled:  # as Trainer: the batch mesh's rank picks the slice
        batch_mesh = parallel_dims.get_mesh("batch")
        local = batch.chunk(batch_mesh.size())[batch_mesh.get_local_rank()]
    else:
        local = batch
    inputs, labels = local[:, :-1], local[:, 1:]
    if parallel_dims.dp_enabled:
        global_valid_tokens = dist_utils.dist_sum_tensor(torch.tensor(labels.numel()), batch_mesh)
    else:
        global_valid_tokens = torch.tensor(labels.numel())
    pred = model(inputs)
    loss, _ = loss_fn(pred, labels, global_valid_tokens)
    loss.backward()
    grad_norm = dist_utils.clip_grad_norm_([p for p in model.parameters()], training.max_norm, foreach=True,
                                           pp_mesh=None, ep_enabled=False)
    group = optimizers.optimizers[0].param_groups[0]
    factor = group["lr"] / group["initial_lr"]
    optimizers.step()
    lr_schedulers.step()
    total = loss.detach().clone()
    if parallel_dims.dp_enabled:
        dist.all_reduce(total, group=batch_mesh.get_group())
    return total.item(), grad_norm.item(), factor


def _worker(mesh_shape, tmp, tp=1):
    import torch.distributed as dist
    import dmuon
    from dmuon.exec.optim import Muon

    torch.set_num_threads(1)
    world = dist.get_world_size()
    model, parallel_dims, training, optimizers, lr_schedulers, loss_fn = _setup(world, mesh_shape, tmp, tp)
    runtime = dmuon.exec.get_model_runtime(model)
    assert runtime is not None, "wrap_parallelize did not dedicate"
    muon = [o for o in optimizers.optimizers if isinstance(o, Muon)]
    groups = [(g["use_muon"], len(g["params"]), len(g["param_names"])) for g in muon[0].param_groups]
    losses, norms, factors = [], [], []
    for batch in _batches():
        loss, norm, factor = _train_step(model, parallel_dims, training, optimizers, lr_schedulers, loss_fn, batch)
        losses.append(loss)
        norms.append(norm)
        factors.append(factor)
    return dict(
        dedicated=list(runtime.plan.dedicated),
        n_optimizers=len(optimizers.optimizers),
        groups=groups,
        losses=losses,
        norms=norms,
        factors=factors,
        full=_full_params(model),
    )


def _full_params(model):
    """Every parameter in full: dedicated ones from their owner (each rank returns those it
    owns), FSDP2's DTensors gathered (rank 0 keeps them). Not ``model.state_dict()``: torchtitan's
    ``FusedQKVLinear`` splits ``wqkv`` into ``wq``/``wk``/``wv`` there."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    out = {}
    for name, p in model.named_parameters():
        info = getattr(p, "_dmuon", None)
        if info is not None:
            if info.is_owner:  # under TP the owner is a TP group (every member calls full_tensor)
                out[name] = (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        elif isinstance(p, DTensor):
            full = p.full_tensor()
            if dist.get_rank() == 0:
                out[name] = full.detach().clone()
        else:
            out[name] = p.detach().clone()
    return out


def _reference(dedicated, factors):
    from dmuon.testing import ReferenceOptimizer, matrix

    model = _reference_model()
    hp = dict(HP)
    opt = ReferenceOptimizer(model, {n: matrix(model.get_parameter(n).shape) for n in dedicated},
                             ns_dtype=torch.float32, **hp)
    base = [[g["lr"] for g in o.param_groups] for o in (opt.muon, opt.adamw)]
    losses, norms = [], []
    for batch, factor in zip(_batches(), factors):
        for o, lrs in zip((opt.muon, opt.adamw), base):
            for g, lr in zip(o.param_groups, lrs):
                g["lr"] = lr * factor
        logits = model(batch[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB).float(), batch[:, 1:].reshape(-1))
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM).item())
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, norms, {k: v.detach().clone() for k, v in model.named_parameters()}


@pytest.mark.parametrize("mesh_shape, tp", [((1, 2), 1), ((2, 1), 1), ((1, 1), 2), ((1, 2), 2)], ids=["fsdp2", "hsdp2x1", "tp2", "fsdp2_tp2"])
def test_llama3_debug_model_matches_oracle(mesh_shape, tp, tmp_path):
    """tp2: torchtitan's tensor parallelism (tensor_parallel_degree 2, no data parallelism):
    dedication after TP on the ("fsdp", "tp") mesh, the owner a TP group (dmuon's TP path)."""
    world = mesh_shape[0] * mesh_shape[1] * tp
    results = run_distributed(_worker, world, mesh_shape, str(tmp_path), tp, timeout_s=300)
    got = results[0]
    # the five projections of every block are Muon's (torchtitan's fused wqkv is one matrix)
    assert len(got["dedicated"]) == 5 * LAYERS, got["dedicated"]
    assert all(".attention." in n or ".feed_forward." in n for n in got["dedicated"]), got["dedicated"]
    assert got["n_optimizers"] == 1
    assert got["groups"] == [(True, 5 * LAYERS, 5 * LAYERS), (False, 3 + 2 * LAYERS, 3 + 2 * LAYERS)], got["groups"]
    assert len(set(got["factors"])) > 1, "the LR schedule must vary for the test to mean anything"
    ref_losses, ref_norms, ref_state = _reference(got["dedicated"], got["factors"])
    assert ref_norms[0] > MAX_NORM, "the clip must bite"
    for r in results:
        for g, w in zip(r["norms"], ref_norms):
            assert math.isclose(g, w, rel_tol=1e-5), ("grad norm", g, w)
    for g, w in zip(got["losses"], ref_losses):
        assert math.isclose(g, w, rel_tol=1e-6), ("loss", g, w)
    loss_dev = max(abs(g - w) / abs(w) for g, w in zip(got["losses"], ref_losses))
    norm_dev = max(abs(g - w) / abs(w) for r in results for g, w in zip(r["norms"], ref_norms))
    full = {k: v for r in results for k, v in r["full"].items()}
    ref_state = dict(ref_state)
    assert set(full) == set(ref_state)
    param_dev = 0.0
    for k, want in ref_state.items():
        scale = want.abs().max().item() or 1.0
        err = (full[k].float() - want.float()).abs().max().item()
        param_dev = max(param_dev, err / scale)
        assert err <= 1e-4 * scale, (k, err, scale)
    print(f"torchtitan {mesh_shape} tp={tp}: losses {loss_dev:.1e} rel, grad norms {norm_dev:.1e} rel, "
          f"parameters {param_dev:.1e} of max|p|")


def _checkpointer(model, optimizers, lr_schedulers, tmp):
    from torchtitan.components.checkpoint import CheckpointManager

    config = CheckpointManager.Config(enable=True, folder="checkpoint", interval=1, last_save_model_only=False)
    return config.build(dataloader=None, model_parts=[model], optimizers=optimizers, lr_schedulers=lr_schedulers,
                        states={}, sd_adapter=None, base_folder=tmp)


def _save_worker(tmp):
    """W = 4: two steps, torchtitan's checkpointer saves (step 2), then the third step."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    model, parallel_dims, training, optimizers, lr_schedulers, loss_fn = _setup(dist.get_world_size(), (1, 4), tmp)
    checkpointer = _checkpointer(model, optimizers, lr_schedulers, tmp)
    batches = _batches()
    for batch in batches[:2]:
        _train_step(model, parallel_dims, training, optimizers, lr_schedulers, loss_fn, batch)
    checkpointer.save(curr_step=2, last_step=True)
    loss, norm, _ = _train_step(model, parallel_dims, training, optimizers, lr_schedulers, loss_fn, batches[2])
    return dict(loss=loss, norm=norm, full=_full_params(model))


def _load_worker(tmp):
    """W = 2: fresh model (the reference init), torchtitan's checkpointer loads step 2, third step."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    model, parallel_dims, training, optimizers, lr_schedulers, loss_fn = _setup(dist.get_world_size(), (1, 2), tmp)
    checkpointer = _checkpointer(model, optimizers, lr_schedulers, tmp)
    assert checkpointer.load(step=2)
    loss, norm, _ = _train_step(model, parallel_dims, training, optimizers, lr_schedulers, loss_fn, _batches()[2])
    return dict(loss=loss, norm=norm, full=_full_params(model))


def test_checkpoint_saved_at_4_resumes_at_2(tmp_path):
    """torchtitan's CheckpointManager (DCP; model via ModelWrapper = model.state_dict() with the
    fused-wqkv split hook, optimizer via the container's flat FQN-keyed state, LR schedulers) saves
    at W = 4 after two steps; a fresh W = 2 job loads it and runs the third step: same loss, grad
    norm and parameters as the W = 4 job's third step (fp32 bounds)."""
    saved = run_distributed(_save_worker, 4, str(tmp_path), timeout_s=240)
    resumed = run_distributed(_load_worker, 2, str(tmp_path), timeout_s=240)
    assert math.isclose(resumed[0]["loss"], saved[0]["loss"], rel_tol=1e-6), (resumed[0]["loss"], saved[0]["loss"])
    assert math.isclose(resumed[0]["norm"], saved[0]["norm"], rel_tol=1e-5), (resumed[0]["norm"], saved[0]["norm"])
    want = {k: v for r in saved for k, v in r["full"].items()}
    got = {k: v for r in resumed for k, v in r["full"].items()}
    assert set(got) == set(want)
    dev = 0.0
    for k, w in want.items():
        scale = w.abs().max().item() or 1.0
        err = (got[k] - w).abs().max().item()
        dev = max(dev, err / scale)
        assert err <= 1e-4 * scale, (k, err, scale)
    print(f"torchtitan checkpoint W=4 -> W=2: loss {abs(resumed[0]['loss'] - saved[0]['loss']):.1e} abs, "
          f"parameters {dev:.1e} of max|p|")
