"""``dmuon.exec.apply`` and ``dmuon.dedicate_params``: bind a plan to a model and a mesh."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from . import fsdp2
from .runtime import DmuonRuntime, MeshGroups

__all__ = ["apply", "dedicate_params", "get_model_runtime"]

_RUNTIME_ATTR = "_dmuon_runtime"


def _mesh_shape(mesh) -> tuple[int, int]:
    if mesh is None:
        return (1, dist.get_world_size())
    shape = tuple(int(x) for x in mesh.mesh.shape)
    if len(shape) == 1:
        return (1, shape[0])
    if len(shape) == 2:
        names = getattr(mesh, "mesh_dim_names", None)
        if names and set(names) == {"replicate", "shard"} and names[0] == "shard":
            return (shape[1], shape[0])
        return shape
    raise ValueError(f"dmuon: mesh must be 1-D or 2-D, got shape {shape}")


def _device_of(model: nn.Module, plan) -> torch.device:
    for spec in plan.params:
        p = model.get_parameter(spec.fqn)
        return p.device
    return torch.device("cpu")


def _validate(plan, model: nn.Module, mesh) -> None:
    """Local checks, before any collective: every rank raises the same error on the same input."""
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "dmuon.exec.apply needs an initialised default process group: call "
            "torch.distributed.init_process_group(...) first (use world size 1 for a single process)"
        )
    fsdp2.check_not_fully_sharded(model)
    _check_not_applied(model)
    shape = _mesh_shape(mesh)
    if tuple(plan.mesh_shape) != shape:
        raise ValueError(
            f"dmuon: the plan was compiled for mesh {tuple(plan.mesh_shape)} (R, N) but the mesh is "
            f"{shape}; compile with the same mesh (dmuon.plan.compile(model, mesh))"
        )
    if mesh is None and shape[0] * shape[1] != dist.get_world_size():  # pragma: no cover
        raise ValueError("dmuon: mesh size differs from the world size")
    from dmuon.plan import snapshot as _snapshot

    digest = _snapshot.take_snapshot(model).digest
    if digest != plan.model_digest:
        raise ValueError(
            "dmuon: the model differs from the one the plan was compiled for (parameter names, "
            "shapes, dtypes or ties changed after planning); recompile the plan with "
            "dmuon.plan.compile(model, mesh) after the last change to the model"
        )
    devices = {str(model.get_parameter(spec.fqn).device) for spec in plan.params}
    if len(devices) > 1:
        raise ValueError(
            f"dmuon: the dedicated parameters are on several devices {sorted(devices)}; apply dmuon to "
            "a model on one device, or on the meta device (then model.to_empty(device=...))"
        )


def _check_not_applied(model: nn.Module) -> None:
    if getattr(model, _RUNTIME_ATTR, None) is not None:
        raise ValueError(
            "dmuon: this model already has dedicated parameters (dedicate_params/apply was called "
            "before); call it once per model"
        )


def _check_same_plan_everywhere(plan) -> None:
    """All ranks must hold the same plan: compare fingerprints (one all_gather_object)."""
    mine = plan.fingerprint()
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    bad = sorted({i for i, f in enumerate(everyone) if f != everyone[0]})
    if bad:
        raise RuntimeError(
            f"dmuon: ranks hold different plans (fingerprint of rank 0: {everyone[0][:12]}, "
            f"differing ranks: {bad}). Compile the plan identically on every rank (same model "
            "definition, mesh and arguments), or compile once and broadcast its JSON"
        )


def apply(plan, model: nn.Module, mesh=None, *, collective_timeout_s: float | None = None) -> DmuonRuntime:
    """Install owners, placeholders and hooks for ``plan`` on ``model`` (every rank calls it).

    Args:
        plan: a :class:`dmuon.plan.ShardingPlan` compiled for this model and mesh shape.
        model: the full model, identical on every rank (as before ``fully_shard``), either
            materialised or on the ``meta`` device: then nothing is allocated until
            ``model.to_empty(device=...)``, which gives each holder its own segments only
            (see :mod:`dmuon.exec.materialize` and docs/checkpointing.md).
        mesh: a ``DeviceMesh`` of the plan's shape (2-D: ``("replicate", "shard")``); ``None``
            = a 1-D mesh over the world.
        collective_timeout_s: a dmuon collective not complete within this many seconds raises
            :class:`~dmuon.exec.collectives.CollectiveTimeout` naming the boundary and phase
            (``None``: wait forever, as torch does up to the process group's own timeout).

    Returns:
        the :class:`~dmuon.exec.runtime.DmuonRuntime` (also at ``model._dmuon_runtime``).

    Raises:
        RuntimeError: no process group; ranks hold different plans.
        ValueError: the model is already wrapped by ``fully_shard``; the plan was compiled for
            another mesh shape or another model (changed after planning); applied twice.
        ValueError: dedicated parameters on more than one device.

    Collectives: one ``all_gather_object`` (plan fingerprints), then ``new_group`` calls; all
    local validation happens before them.
    """
    fsdp2.install()
    _validate(plan, model, mesh)
    _check_same_plan_everywhere(plan)
    groups = MeshGroups.build(mesh)
    runtime = DmuonRuntime(plan, model, groups, _device_of(model, plan))
    runtime.timeout_s = collective_timeout_s
    object.__setattr__(model, _RUNTIME_ATTR, runtime)
    from . import checkpoint, materialize

    checkpoint.register_state_dict_hooks(runtime)
    materialize.install(runtime, model)
    return runtime


def dedicate_params(
    model: nn.Module,
    mesh=None,
    *,
    predicate=None,
    reshard_after_forward: bool = True,
    hook_boundary_predicate=None,
    hook_boundary_strict: bool = True,
    replicate_async: bool = True,
    mp_policy=None,
    collective_timeout_s: float | None = None,
    **compile_kwargs,
):
    """``dmuon.plan.compile`` + :func:`apply`; returns the plan (DESIGN.md §2).

    ``mesh``: a ``DeviceMesh`` or ``None`` (1-D over the world). Extra keyword arguments go to
    ``dmuon.plan.compile`` (e.g. ``cost_model``).
    """
    from dmuon import plan as _plan

    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "dmuon.dedicate_params needs an initialised default process group: call "
            "torch.distributed.init_process_group(...) first (use world size 1 for a single process)"
        )
    fsdp2.check_not_fully_sharded(model)
    _check_not_applied(model)
    compile_mesh = mesh if mesh is not None else dist.get_world_size()
    plan = _plan.compile(
        model,
        compile_mesh,
        predicate=predicate,
        reshard_after_forward=reshard_after_forward,
        hook_boundary_predicate=hook_boundary_predicate,
        hook_boundary_strict=hook_boundary_strict,
        replicate_async=replicate_async,
        mp_policy=mp_policy,
        **compile_kwargs,
    )
    apply(plan, model, mesh, collective_timeout_s=collective_timeout_s)
    return plan


def get_model_runtime(model: nn.Module) -> DmuonRuntime | None:
    return getattr(model, _RUNTIME_ATTR, None)
