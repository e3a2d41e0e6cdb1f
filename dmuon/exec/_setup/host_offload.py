"""Offload of owned state: the contract between ``dedicate_params(offload_policy=...)`` and
``fully_shard(offload_policy=...)``, and where offloaded masters and momenta live (the host; their
broadcast buffers on the compute device). Note: CPU offload (docs/design.md)."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn

__all__ = ["HostOffload", "resolve", "check_fully_shard_policies", "host_zeros", "HOST"]

#: where offloaded masters and momenta live
HOST = torch.device("cpu")


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class HostOffload:
    """Offload of this rank's owned state: masters and Muon momenta on the host, their updates
    and broadcasts on ``compute_device``. ``pin_memory``: host tensors page-locked (FSDP2's
    ``CPUOffloadPolicy.pin_memory``; needs an accelerator)."""

    compute_device: torch.device
    pin_memory: bool


def _is_cpu_offload(policy) -> bool:
    from torch.distributed.fsdp import CPUOffloadPolicy

    return isinstance(policy, CPUOffloadPolicy)


def resolve(offload_policy, mesh, model: nn.Module) -> HostOffload | None:
    """The :class:`HostOffload` of ``dedicate_params(offload_policy=...)`` (``None``: no offload).

    The compute device is the mesh's device type (a ``DeviceMesh``) on the current device of that
    type; without a ``DeviceMesh``, the device of the model's parameters (on ``meta``: the
    accelerator when there is one, else the CPU, as :func:`dmuon.exec._setup.api.collective_backend`
    reads a model on ``meta``).

    Raises:
        TypeError: ``offload_policy`` is neither ``None``, FSDP2's ``OffloadPolicy()`` (no
            offload) nor a ``CPUOffloadPolicy``.
        ValueError: ``pin_memory=True`` on a machine without an accelerator (page-locked memory
            needs one).
    """
    from torch.distributed.fsdp import OffloadPolicy

    if offload_policy is None or (type(offload_policy) is OffloadPolicy):
        return None
    if not _is_cpu_offload(offload_policy):
        raise TypeError(
            "dmuon.dedicate_params: offload_policy must be FSDP2's CPUOffloadPolicy(...) (the one given to "
            f"fully_shard), OffloadPolicy() or None; got {offload_policy!r}"
        )
    if offload_policy.pin_memory and not torch.accelerator.is_available():
        raise ValueError(
            "dmuon.dedicate_params: CPUOffloadPolicy(pin_memory=True) (its default) needs an accelerator to pin "
            "host memory, and this machine has none: pass CPUOffloadPolicy(pin_memory=False) here and to fully_shard"
        )
    device_type = getattr(mesh, "device_type", None)
    if device_type is None:
        device_type = next((p.device.type for p in model.parameters()), "cpu")
        if device_type == "meta":
            acc = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
            device_type = "cpu" if acc is None else acc.type
    device = torch.device(device_type)
    if device.type != "cpu" and device.index is None:
        module = getattr(torch, device.type, None)
        index = module.current_device() if module is not None and hasattr(module, "current_device") else 0
        device = torch.device(device.type, index)
    return HostOffload(compute_device=device, pin_memory=bool(offload_policy.pin_memory))


def host_zeros(numel_or_shape, dtype: torch.dtype, offload: HostOffload) -> torch.Tensor:
    """Zeros in host memory (pinned when ``offload.pin_memory``)."""
    return torch.zeros(numel_or_shape, dtype=dtype, device=HOST, pin_memory=offload.pin_memory)


def _fully_shard_policies(model: nn.Module) -> dict[str, object]:
    """``{unit FQN: offload policy}`` of every ``fully_shard`` unit of ``model`` that has an
    FSDP2 param group (a unit whose parameters are all dedicated has none, so no policy to read)."""
    from dmuon.exec._setup.fsdp2 import fsdp_param_groups

    out: dict[str, object] = {}
    for name, module in model.named_modules():
        for group in fsdp_param_groups(module):
            policy = getattr(group, "offload_policy", None)
            if policy is not None:
                out.setdefault(name or "<root>", policy)
    return out


def check_fully_shard_policies(model: nn.Module, offload: HostOffload | None) -> None:
    """Raise ``ValueError`` when ``fully_shard``'s offload policy differs from dmuon's: offload on
    one side only, or ``pin_memory`` differing. Local and structural (every rank raises alike);
    called at ``dmuon.Muon``'s first step (after ``fully_shard``)."""
    for unit, policy in _fully_shard_policies(model).items():
        theirs = bool(_is_cpu_offload(policy))
        if theirs == (offload is not None) and (not theirs or bool(policy.pin_memory) == offload.pin_memory):
            continue
        ours = "no offload_policy" if offload is None else f"CPUOffloadPolicy(pin_memory={offload.pin_memory})"
        raise ValueError(
            f"dmuon: fully_shard({unit}) has offload_policy={policy!r} but dmuon.dedicate_params was given "
            f"{ours}: the dedicated matrices' masters and momenta would live elsewhere than the rest. Pass the same "
            "policy to both: dmuon.dedicate_params(model, mesh, offload_policy=policy) and "
            "fully_shard(module, ..., offload_policy=policy)"
        )
