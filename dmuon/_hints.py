"""Which framework a call comes from, and the fix to name for it: a leaf module (no dmuon imports),
read by the set-up guards (:mod:`dmuon.exec._setup.guards`) and re-exported by :mod:`dmuon.integrations`.

Also the one statement of dmuon's set-up order (:data:`SET_UP_ORDER`), which every set-up error
quotes.
"""

from __future__ import annotations

import inspect

__all__ = ["SET_UP_ORDER", "detect_framework", "framework_hint"]

#: the set-up order every set-up error names (one statement of it)
SET_UP_ORDER = (
    "dmuon.dedicate_params(model, mesh) -> fully_shard(block) for each block -> fully_shard(model) -> "
    "dmuon.Muon(model, ...)"
)

_FRAMEWORK_MODULES = (  # (framework, module prefixes whose frames on the stack name it)
    ("trainer", ("transformers.trainer",)),
    ("accelerate", ("accelerate.",)),
    ("lightning", ("lightning.", "pytorch_lightning.", "lightning_fabric.")),
    ("torchtitan", ("torchtitan.",)),
)


def detect_framework(model=None) -> str | None:
    """The framework the current call comes from: ``"trainer"`` (transformers.Trainer),
    ``"accelerate"``, ``"lightning"``, ``"torchtitan"``, or None.

    Read from the call stack (the innermost framework frame wins, Trainer before accelerate,
    which it calls), then from the model's classes (a ``LightningModule``; a transformers
    ``PreTrainedModel`` counts as ``"accelerate"``, which is how such models get sharded).
    """
    names = []
    for frame in inspect.stack(context=0)[1:]:
        mod = frame.frame.f_globals.get("__name__", "")
        names.append(mod)
    for fw, prefixes in _FRAMEWORK_MODULES:
        if any(n.startswith(prefixes) for n in names):
            return fw
    if model is not None:
        for cls in type(model).__mro__:
            mod = cls.__module__ or ""
            if mod.startswith(("lightning.", "pytorch_lightning.")):
                return "lightning"
            if mod.startswith("transformers."):
                return "accelerate"
            if mod.startswith("torchtitan."):
                return "torchtitan"
    return None


_HINTS: dict[str, dict[str, str]] = {
    "fully_shard_first": {
        "trainer": (
            "transformers.Trainer with FSDP2 shards the model inside trainer.train() "
            "(accelerator.prepare): call dmuon.dedicate_params(model, mesh) on the unsharded "
            "model BEFORE Trainer(...), and pass optimizer_cls_and_kwargs="
            "(dmuon.integrations.hf.MuonFactory, {...})"
        ),
        "accelerate": (
            "accelerate's FSDP2 prepare() calls fully_shard: call dmuon.dedicate_params(model, "
            "mesh) and build dmuon.Muon(model, ...) BEFORE accelerator.prepare(model, optimizer), "
            "not on the prepared model"
        ),
        "lightning": (
            "in LightningModule.configure_model call dmuon.dedicate_params(self.model, "
            "self.device_mesh['data_parallel']) first, then fully_shard each block, then the "
            "model; return dmuon.Muon(self.model, ...) from configure_optimizers"
        ),
        "torchtitan": (
            "torchtitan's parallelize function calls fully_shard: dedicate inside it, by setting "
            "model_spec.parallelize_fn = dmuon.integrations.torchtitan.wrap_parallelize("
            "model_spec.parallelize_fn) (or dmuon_model_spec(model_spec)); do not call "
            "dmuon.dedicate_params on the parallelized model"
        ),
    },
    "foreign_optimizer": {
        "trainer": (
            "transformers.Trainer built its own optimizer from model.parameters(): pass "
            "optimizer_cls_and_kwargs=(dmuon.integrations.hf.MuonFactory, {'lr': ..., "
            "'adamw_lr': ...}) to Trainer(...) (with FSDP Trainer refuses optimizers=(...))"
        ),
        "accelerate": (
            "pass dmuon.Muon(model, ...) to accelerator.prepare(model, optimizer) instead of an "
            "optimizer built from model.parameters()"
        ),
        "lightning": (
            "return dmuon.Muon(self.model, ...) from LightningModule.configure_optimizers "
            "(configure_model must have called dmuon.dedicate_params)"
        ),
        "torchtitan": (
            "torchtitan's OptimizersContainer builds Adam/AdamW/DistMuon over every parameter: set "
            "config.optimizer = dmuon.integrations.torchtitan.muon_optimizer(lr=..., adamw_lr=...) "
            "(a DmuonOptimizersContainer.Config whose param groups use optimizer_name='Muon')"
        ),
    },
    "wrapped_after": {
        "trainer": (
            "transformers.Trainer wraps the model in DistributedDataParallel unless FSDP2 is "
            "on: TrainingArguments(fsdp='full_shard', fsdp_config={'fsdp_version': 2, ...}) "
            "(or an accelerate config with distributed_type: FSDP, fsdp_version: 2)"
        ),
        "accelerate": (
            "accelerate wraps the model in DistributedDataParallel unless FSDP2 is on: "
            "Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2, ...)) or "
            "an accelerate config with distributed_type: FSDP and fsdp_version: 2"
        ),
        "lightning": (
            "use strategy=ModelParallelStrategy(...) and apply dmuon + fully_shard in "
            "configure_model; DDPStrategy / FSDPStrategy wrap the dedicated model"
        ),
        "torchtitan": (
            "let torchtitan's parallelize function apply fully_shard (data_parallel_shard_degree), "
            "wrapped by dmuon.integrations.torchtitan.wrap_parallelize; do not enable DDP "
            "(data_parallel_replicate_degree without sharding)"
        ),
    },
}

_GENERIC = {
    "fully_shard_first": "Set-up order: " + SET_UP_ORDER,
    "foreign_optimizer": "build the optimizer with dmuon.Muon(model, ...): it runs Muon on the "
    "dedicated matrices (owner only) and AdamW on every other parameter",
    "wrapped_after": "dmuon composes with FSDP2 (fully_shard) only; DistributedDataParallel "
    "sees different parameter shapes on different ranks",
}


def framework_hint(kind: str, model=None) -> str:
    """The fix for mistake ``kind`` (``"fully_shard_first"``, ``"foreign_optimizer"``,
    ``"wrapped_after"``) in the framework of this call (:func:`detect_framework`), as one
    sentence starting with the framework's name; the generic rule when no framework is
    recognised. Docs: docs/integrations.md."""
    fw = detect_framework(model)
    if fw is None:
        return _GENERIC[kind] + " (docs/integrations.md)"
    return f"{fw}: {_HINTS[kind][fw]} (docs/integrations.md)"
