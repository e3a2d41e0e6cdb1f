"""Expert-parallel stacks (``Boundary.local``) of :class:`~dmuon.exec._runtime.runtime.DmuonRuntime`:
each rank's model holds its own experts, tagged as owned here (:func:`bind_expert_parallel`), and a
tensor hook scales each gradient contribution (:func:`hook_ep_param`, :func:`_ep_grad_divisor`).
``rt`` is that runtime (not imported here: the runtime imports this module)."""

from __future__ import annotations

import weakref

import torch
import torch.nn as nn

from dmuon import _tags
from dmuon._dtensor import is_dtensor
from dmuon.exec._runtime.packed_buffers import DedicatedInfo

__all__ = ["bind_expert_parallel", "hook_ep_param"]


def bind_expert_parallel(rt, modules, original) -> dict[str, nn.Parameter]:
    """Expert-parallel stacks (``Boundary.local``): each rank's model holds its own experts.
    The parameter stays where it is (no buffer, no broadcast, no reduce); it is tagged
    dmuon's tag (``ep_local``, owned here, so ``fully_shard`` skips it and ``dmuon.Muon``
    orthogonalises its experts) and a tensor hook divides every gradient contribution by
    :meth:`DmuonRuntime.grad_divisor` (the data-parallel world ``W = R*N``, or FSDP2's gradient divide
    factor when one is set): tokens of every rank reach a local expert through the model's
    all-to-all, so its gradient is the SUM over ranks of their local-loss gradients, and
    ``/W`` makes it the global-batch mean's (as the reduce-AVG does for the dense
    matrices). Stacks owned in efsdp groups need no hook: their reduce SUMs the holders'
    gradients, which together are that same SUM, and the owner divides it like any
    other. Returns ``{fqn: parameter}``."""
    import torch.distributed as dist

    out: dict[str, nn.Parameter] = {}
    specs = {p.fqn: p for p in rt.plan.params}
    me = dist.get_rank()
    for index, b in enumerate(rt.plan.boundaries):
        for fqn in b.local:
            spec = specs[fqn]
            p = original[fqn]
            if not isinstance(p, nn.Parameter) or is_dtensor(p):
                raise ValueError(
                    f"dmuon: expert-parallel stack {fqn!r} must be a plain nn.Parameter of this rank's experts "
                    f"{spec.local_shape}, got {type(p).__name__}"
                )
            if tuple(p.shape) != tuple(spec.local_shape) or str(p.dtype) != spec.dtype:
                raise ValueError(
                    f"dmuon: expert-parallel stack {fqn!r} is {tuple(p.shape)} {p.dtype} on this rank but the plan "
                    f"gives each rank {spec.local_shape} {spec.dtype} (E/ep experts of {spec.shape})"
                )
            stack = spec.experts
            _tags.write(
                p,
                _tags.PARAM,
                DedicatedInfo(
                    fqn=fqn,
                    owner_global_rank=me,
                    is_owner=True,
                    holds_full=True,
                    shape=tuple(spec.local_shape),
                    matrix_shape=tuple(spec.matrix_shape),
                    num_matrices=stack.local_experts * stack.matrices_per_expert,
                    runtime=weakref.ref(rt),
                    experts=stack,
                    ep_local=True,
                ),
            )
            rt.hook_ep_param(fqn, p, index)
            out[fqn] = p
    return out


def hook_ep_param(rt, fqn: str, p: nn.Parameter, boundary_index: int) -> None:
    """(Re-)register the gradient-divisor hook of the local expert-parallel stack ``fqn`` on
    ``p`` (dropping the one it had): at ``dedicate_params``, and again when ``to_empty``
    gave the stack a new tensor (:func:`dmuon.exec._setup.materialize.rebind_storage`)."""
    old = rt.ep_hooks.pop(fqn, None)
    if old is not None:
        old.remove()
    if rt.world_numel > 1 and p.requires_grad:
        rt.ep_hooks[fqn] = p.register_hook(_ep_grad_divisor(weakref.ref(rt), boundary_index))


def _ep_grad_divisor(runtime_ref, boundary_index: int):
    """The tensor hook of a local expert-parallel stack: each backward contribution ``g``
    becomes ``g / d`` with ``d`` what an owner divides a reduced gradient by
    (:meth:`DmuonRuntime.grad_divisor`: FSDP2's gradient divide factor when one is set, e.g.
    torchtitan's 1.0, else the data-parallel world ``R*N``), read at every call, of the stack's
    boundary ``runtime.boundaries[boundary_index]`` (plan order)."""

    def hook(grad: torch.Tensor) -> torch.Tensor:
        rt = runtime_ref()
        if rt is None:
            return grad
        divisor = rt.grad_divisor(rt.boundaries[boundary_index])
        return grad if divisor == 1.0 else grad / divisor

    return hook
