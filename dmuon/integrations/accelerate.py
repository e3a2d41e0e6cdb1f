"""accelerate (and so ``transformers.Trainer``) with FSDP2: what dmuon changes in ``prepare``.

The user's order stays the one of plain FSDP2, with accelerate's ``prepare`` in place of the
``fully_shard`` calls::

    plan = dmuon.dedicate_params(model, mesh)          # unsharded model, every rank
    optimizer = dmuon.Muon(model, lr=..., adamw_lr=...)
    model, optimizer = accelerator.prepare(model, optimizer)   # FSDP2: fully_shard per block

Recipe: docs/integrations.md, "accelerate with FSDP2". When the wrappers are installed and what
each changes: Note: the accelerate patch (docs/design.md).
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn

from dmuon import _registry
from dmuon import _tags
from dmuon._hints import framework_hint
from dmuon._tags import dedicated_info
from dmuon.exec._setup.guards import check_optimizer

__all__ = ["patch", "is_patched", "wrap_prepare_fsdp2", "wrap_prepare_model", "wrap_clip_grad_norm_"]


def _cpu_note(accelerator) -> str:
    """The CPU case of the DDP refusal: accelerate never turns FSDP on for ``MULTI_CPU``, even with
    an ``fsdp_plugin`` given, so the usual fix (configure FSDP2) is not the one that applies."""
    if "CPU" not in str(accelerator.distributed_type):
        return ""
    return (
        "On CPU, accelerate ignores fsdp_plugin and never selects FSDP (its AcceleratorState makes a "
        "MULTI_CPU run DDP); to run FSDP2 on CPU/gloo anyway, right after Accelerator(...) set "
        "accelerator.state.distributed_type = DistributedType.FSDP and assign accelerator.state.fsdp_plugin "
        "= FullyShardedDataParallelPlugin(fsdp_version=2, ...) (docs/integrations.md, 'On CPU'). "
    )


def _check_fsdp2_plugin(accelerator, model: nn.Module) -> None:
    plugin = accelerator.state.fsdp_plugin
    if getattr(plugin, "cpu_ram_efficient_loading", False):
        raise ValueError(
            "dmuon: accelerate's cpu_ram_efficient_loading moves the model to meta and reloads it "
            "with load_state_dict(..., assign=True), which would replace the parameters "
            "dmuon.dedicate_params gave to their owners. Set fsdp_cpu_ram_efficient_loading: false "
            "(FullyShardedDataParallelPlugin(cpu_ram_efficient_loading=False), or "
            "FSDP_CPU_RAM_EFFICIENT_LOADING=false). For models that do not fit in host memory use "
            "dmuon's meta-device recipe (docs/checkpointing.md, 'Large-model initialisation')."
        )
    if accelerator.mixed_precision != "no":
        low = [
            dedicated_info(p).fqn
            for p in model.parameters()
            if dedicated_info(p) is not None and p.requires_grad and p.dtype != torch.float32
        ]
        if low:
            raise ValueError(
                f"dmuon: accelerate with mixed_precision={accelerator.mixed_precision!r} upcasts "
                f"parameters that are not float32 (param.data = param.data.float()), which would "
                f"detach dmuon's owner-held masters from their buffers: {low[:3]}"
                f"{' ...' if len(low) > 3 else ''} are {torch.float32} only after loading the model "
                f"in float32 (from_pretrained(..., dtype=torch.float32)) BEFORE "
                f"dmuon.dedicate_params; accelerate's mixed_precision then casts for compute."
            )


def _unique_data_ptrs(models) -> list:
    """Give every dedicated parameter of ``models`` a distinct ``data_ptr()`` for the duration of
    accelerate's re-map (an instance attribute shadowing the method, as accelerate itself does
    for the stand-ins it puts in the optimizer); returns the parameters to restore."""
    tagged = []
    for model in models:
        for p in model.parameters():
            if dedicated_info(p) is not None and "data_ptr" not in p.__dict__:
                key = -(len(tagged) + 1)  # never a real address
                p.data_ptr = functools.partial(int, key)
                tagged.append(p)
    return tagged


def _restore_data_ptrs(tagged) -> None:
    for p in tagged:
        p.__dict__.pop("data_ptr", None)


def wrap_prepare_fsdp2(orig):
    """``Accelerator._prepare_fsdp2`` (entry ``accelerate.prepare_fsdp2``)."""

    @functools.wraps(orig)
    def _prepare_fsdp2(self, *args):
        models = [a for a in args if isinstance(a, nn.Module) and _tags.has_dedicated(a.parameters())]
        if not models:
            return orig(self, *args)
        optimizers = [a for a in args if isinstance(a, torch.optim.Optimizer)]
        for model in models:
            _check_fsdp2_plugin(self, model)
        for opt in optimizers:
            check_optimizer(opt, models[0])
        tagged = _unique_data_ptrs(models)
        try:
            with _registry.scoped("fsdp2"):  # accelerate calls fully_shard: it must skip dedicated params
                return orig(self, *args)
        finally:
            _restore_data_ptrs(tagged)

    return _prepare_fsdp2


def wrap_prepare_model(orig):
    """``Accelerator.prepare_model`` (entry ``accelerate.prepare_model``)."""

    @functools.wraps(orig)
    def prepare_model(self, model, device_placement=None, evaluation_mode=False):
        if not evaluation_mode and not self.is_fsdp2 and _tags.has_dedicated(model.parameters()):
            from torch.distributed.fsdp import FSDPModule

            if self.num_processes > 1 and not isinstance(model, FSDPModule):
                raise ValueError(
                    f"dmuon: accelerate is about to wrap a model with dedicated parameters for "
                    f"{self.distributed_type} (DistributedDataParallel), whose ranks hold different "
                    f"parameter shapes (owners: full matrices, others: zero-size placeholders). "
                    + _cpu_note(self)
                    + framework_hint("wrapped_after", model)
                )
        return orig(self, model, device_placement, evaluation_mode)

    return prepare_model


def wrap_clip_grad_norm_(orig):
    """``Accelerator.clip_grad_norm_`` (entry ``accelerate.clip_grad_norm_``)."""

    @functools.wraps(orig)
    def clip_grad_norm_(self, parameters, max_norm, norm_type=2):
        params = list(parameters)
        if _tags.has_dedicated(params):
            from dmuon.integrations._clip_handoff import dmuon_clip

            self.unscale_gradients()  # as accelerate does first (fp16 grad scaler)
            return dmuon_clip(params, max_norm, norm_type)
        return orig(self, params, max_norm, norm_type)

    return clip_grad_norm_


def patch(module=None) -> None:
    """Install the accelerate integration now (``dmuon.integrations.enable("accelerate")``;
    idempotent; ``module``, accelerate.accelerator, is accepted for compatibility)."""
    _registry.install("accelerate")


def is_patched() -> bool:
    """Whether accelerate is imported and dmuon's wrappers are installed on it."""
    return all(_registry.installed(n) for n in _registry._FAMILIES["accelerate"])
