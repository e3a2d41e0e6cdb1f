"""The one list of what dmuon changes in other libraries (docs/integrations.md).

Each entry is a :class:`dmuon._registry.Integration`: the target, the wrapper factory (named as
``"module:function"``, imported only when the entry is installed), the stage that installs it,
why, and the explicit, patch-free path. ``import dmuon`` registers this list with
:mod:`dmuon._registry` (the machinery: install, undo, checks, status) and installs the
``"import"`` stage (the ``clip_grad_norm_`` hand-off); the first ``dmuon.dedicate_params`` /
``dmuon.exec.apply`` installs the ``"dedicate"`` stage (the rest, the ``fully_shard`` skip
first). ``dmuon.integrations.status()`` prints it.

Nothing in ``dmuon.exec`` or in the wrapper modules imports this list: the names below point
down at them, and they import only the leaf :mod:`dmuon._registry`, so the list and its
wrappers form no import cycle.
"""

from __future__ import annotations

from dmuon import _registry
from dmuon._registry import Integration

__all__ = ["INTEGRATIONS", "FAMILIES"]

_FSDP_INIT = "torch.distributed.fsdp._fully_shard._fsdp_init"

INTEGRATIONS: tuple[Integration, ...] = (
    Integration(
        "fsdp2.managed_modules",
        f"{_FSDP_INIT}:_get_managed_modules",
        "dmuon.exec._setup.fsdp2:skip_dedicated",
        "dedicate",
        "fully_shard (however imported) adds the dedicated parameters under its modules to ignored_params",
        expects=("*", "ignored_params"),
        explicit="fully_shard(module, ignored_params=dmuon.fsdp2_ignored_params(module))",
    ),
    Integration(
        "fsdp2.managed_states",
        f"{_FSDP_INIT}:_get_managed_states",
        "dmuon.exec._setup.fsdp2:skip_dedicated",
        "dedicate",
        "the same for FSDP2's parameter / buffer discovery",
        expects=("*", "ignored_params"),
        explicit="fully_shard(module, ignored_params=dmuon.fsdp2_ignored_params(module))",
    ),
    Integration(
        "clip.nn_utils",
        "torch.nn.utils:clip_grad_norm_",
        "dmuon.integrations._clip_handoff:hand_off",
        "import",
        "clip_grad_norm_ over dedicated parameters is dmuon.clip_grad_norm_ (global norm, owned "
        "gradients counted once); other calls go to torch unchanged",
        expects=("parameters", "max_norm", "norm_type", "error_if_nonfinite", "foreach"),
        explicit="dmuon.clip_grad_norm_(model, max_norm)",
    ),
    Integration(
        "clip.clip_grad",
        "torch.nn.utils.clip_grad:clip_grad_norm_",
        "dmuon.integrations._clip_handoff:hand_off",
        "import",
        "the same function under torch.nn.utils.clip_grad",
        expects=("parameters", "max_norm", "norm_type", "error_if_nonfinite", "foreach"),
        explicit="dmuon.clip_grad_norm_(model, max_norm)",
    ),
    Integration(
        "amp.grad_scaler",
        "torch.amp.grad_scaler:GradScaler._unscale_grads_",
        "dmuon.exec._optim.amp:route_unscale",
        "dedicate",
        "GradScaler.unscale_ on a dmuon.Muon unscales owner-held gradients and agrees on found_inf "
        "over every rank (one all-reduce)",
        expects=("self", "optimizer", "inv_scale", "found_inf", "allow_fp16"),
        explicit="dmuon.GradScaler(device)",
    ),
    Integration(
        "amp.sharded_grad_scaler",
        "torch.distributed.fsdp.sharded_grad_scaler:ShardedGradScaler._unscale_grads_",
        "dmuon.exec._optim.amp:route_unscale",
        "dedicate",
        "the same for FSDP1's ShardedGradScaler override",
        expects=("self", "optimizer", "inv_scale", "found_inf", "allow_fp16"),
        required=False,
        explicit="dmuon.GradScaler(device)",
    ),
    Integration(
        "pipelining.initialize",
        "torch.distributed.pipelining.schedules:_PipelineSchedule._initialize_pp_stages",
        "dmuon.exec._runtime.pipeline_hooks:wrap_initialize",
        "dedicate",
        "a pipeline schedule's first step refuses split-backward (zero-bubble) schedules, marks the stages' dmuon "
        "runtimes as pipelined and resets them after the stage's shape inference, as the stage resets FSDP2",
        expects=("self", "stages"),
        required=False,
        explicit="none: pipeline schedules need it (docs/pipeline_parallel.md)",
    ),
    Integration(
        "pipelining.reduce_grad",
        "torch.distributed.pipelining.stage:_PipelineStageBase.perform_reduce_grad",
        "dmuon.exec._runtime.pipeline_hooks:wrap_perform_reduce_grad",
        "dedicate",
        "a pipeline schedule's REDUCE_GRAD reduces the dedicated matrices' gradients of the step to their owners "
        "before FSDP2's reduce and the schedule's micro-batch scaling",
        expects=("self", "grad_scale_factor"),
        required=False,
        explicit="none: pipeline schedules need it (docs/pipeline_parallel.md)",
    ),
    Integration(
        "dcp.load_plan",
        "torch.distributed.checkpoint.default_planner:create_default_local_load_plan",
        "dmuon.exec._state.dcp_errors:explain_mismatch",
        "dedicate",
        "a DCP load whose checkpoint dedicated other matrices says so (instead of 'Missing key ... .step')",
        expects=("state_dict", "metadata"),
        required=False,
        explicit="dcp.load(..., planner=dmuon.DCPLoadPlanner())",
    ),
    Integration(
        "dcp.unflatten_optim",
        "torch.distributed.checkpoint.state_dict:_unflatten_optim_state_dict",
        "dmuon.exec._state.optimizer_state:wrap_unflatten_optim_state_dict",
        "dedicate",
        "set_optimizer_state_dict(..., flatten_optimizer_state_dict=True) of a dmuon.Muon passes every dedicated "
        "matrix's momentum on every rank (torch keeps only the names a rank's optimizer.state holds; a non-owner "
        "holds none, and its part of the gather to the owner would be missing)",
        expects=("optim", "state_dict", "info"),
        required=False,
        explicit="unflatten against get_optimizer_state_dict(model, optimizer)'s layout, then "
        "set_optimizer_state_dict without the option (docs/pipeline_parallel.md)",
    ),
    Integration(
        "ddp.guard",
        "torch.nn.parallel.distributed:DistributedDataParallel.__init__",
        "dmuon.exec._setup.guards:wrap_ddp_init",
        "dedicate",
        "DistributedDataParallel(model) of a dedicated model raises ValueError naming the fix",
        expects=("self", "module"),
        explicit="dmuon composes with fully_shard only; no wrapper needed to stay correct",
    ),
    Integration(
        "optimizer.guard",
        "torch.optim.optimizer:register_optimizer_step_pre_hook",
        "dmuon.exec._setup.guards:install_optimizer_guard",
        "dedicate",
        "an optimizer other than dmuon.Muon holding dedicated parameters raises TypeError at its first step",
        kind="hook",
        expects=("hook",),
        explicit="build the optimizer with dmuon.Muon(model, ...)",
    ),
    Integration(
        "import_hook",
        "sys:meta_path",
        "dmuon._registry:_install_finder",
        "dedicate",
        "installs the accelerate / transformers integrations when those libraries are imported after "
        "the first dedication",
        kind="hook",
        explicit="dmuon.integrations.enable('accelerate', 'trainer')",
    ),
    Integration(
        "accelerate.prepare_fsdp2",
        "accelerate.accelerator:Accelerator._prepare_fsdp2",
        "dmuon.integrations.accelerate:wrap_prepare_fsdp2",
        "dedicate",
        "accelerate's FSDP2 prepare keeps dedicated parameters (distinct data_ptr during its re-map) and "
        "rejects settings that would break them",
        expects=("self",),
        trigger="accelerate.accelerator",
        explicit="dmuon.integrations.enable('accelerate')",
    ),
    Integration(
        "accelerate.prepare_model",
        "accelerate.accelerator:Accelerator.prepare_model",
        "dmuon.integrations.accelerate:wrap_prepare_model",
        "dedicate",
        "accelerate's DDP path on a dedicated model raises ValueError naming the FSDP2 configuration",
        expects=("self", "model", "device_placement", "evaluation_mode"),
        trigger="accelerate.accelerator",
        explicit="dmuon.integrations.enable('accelerate')",
    ),
    Integration(
        "accelerate.clip_grad_norm_",
        "accelerate.accelerator:Accelerator.clip_grad_norm_",
        "dmuon.integrations.accelerate:wrap_clip_grad_norm_",
        "dedicate",
        "accelerator.clip_grad_norm_ over dedicated parameters is dmuon.clip_grad_norm_",
        expects=("self", "parameters", "max_norm", "norm_type"),
        trigger="accelerate.accelerator",
        explicit="dmuon.integrations.enable('accelerate')",
    ),
    Integration(
        "torchtitan.clip_grad_norm_",
        "torchtitan.distributed.utils:clip_grad_norm_",
        "dmuon.integrations._clip_handoff:wrap_torchtitan_clip_grad_norm",
        "dedicate",
        "torchtitan's trainer clipping over dedicated parameters is dmuon.clip_grad_norm_",
        expects=("parameters", "max_norm", "norm_type", "error_if_nonfinite", "foreach", "pp_mesh", "ep_enabled"),
        trigger="torchtitan.distributed.utils",
        required=False,
        explicit="dmuon.clip_grad_norm_(model, max_norm) in place of torchtitan's clip_grad_norm_",
    ),
    Integration(
        "trainer.grad_norm",
        "transformers.trainer:Trainer._mixed_mesh_grad_norm",
        "dmuon.integrations.hf:wrap_mixed_mesh_grad_norm",
        "dedicate",
        "Trainer's max_grad_norm clipping over dedicated parameters is dmuon.clip_grad_norm_",
        expects=("self", "model", "max_norm"),
        trigger="transformers.trainer",
        required=False,
        explicit="dmuon.integrations.enable('trainer')",
    ),
)

#: short names ``dmuon.integrations.enable`` accepts for a family ("accelerate" -> its three entries)
FAMILIES = {
    "fsdp2": ("fsdp2.managed_modules", "fsdp2.managed_states"),
    "clip": ("clip.nn_utils", "clip.clip_grad"),
    "amp": ("amp.grad_scaler", "amp.sharded_grad_scaler"),
    "dcp": ("dcp.load_plan", "dcp.unflatten_optim"),
    "ddp": ("ddp.guard",),
    "optimizer": ("optimizer.guard",),
    "accelerate": ("accelerate.prepare_fsdp2", "accelerate.prepare_model", "accelerate.clip_grad_norm_"),
    "trainer": ("trainer.grad_norm",),
    "torchtitan": ("torchtitan.clip_grad_norm_",),
    "pipelining": ("pipelining.initialize", "pipelining.reduce_grad"),
}


_registry.register(INTEGRATIONS, FAMILIES)
