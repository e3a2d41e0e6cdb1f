"""How one rank of a tensor- or expert-parallel run sees a model that is not parallelised yet
(a zoo preset on the meta device): the TP shard dims a Megatron-style plan uses
(:func:`megatron_tp_shard_dims`, for ``dmuon.plan.compile(..., tp=TPPolicy(size=T, shard_dims=...))``)
and a model cut to one EP rank's experts (:func:`expert_parallel_variant`, for ``ep=``)."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["TP_COLWISE", "TP_ROWWISE", "megatron_tp_shard_dims", "expert_parallel_variant"]

#: Linear layers a Megatron-style TP plan splits by output features (``ColwiseParallel``:
#: weight ``Shard(0)``) and by input features (``RowwiseParallel``: ``Shard(1)``).
TP_COLWISE = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "qkv", "fc1")
TP_ROWWISE = ("o_proj", "down_proj", "proj", "fc2")


def megatron_tp_shard_dims(model: nn.Module) -> dict[str, int]:
    """``{fqn: dim}`` of every 2-D ``nn.Linear`` weight a Megatron-style TP plan shards: 0 for
    :data:`TP_COLWISE` module names, 1 for :data:`TP_ROWWISE`; for ``dmuon.plan.compile(...,
    tp=dmuon.plan.TPPolicy(size=T, shard_dims=...))`` on a model that is not parallelised (e.g. a preset on the
    meta device). Embeddings, heads, norms and 3-D expert stacks are left out."""
    out: dict[str, int] = {}
    for name, mod in model.named_modules():
        if isinstance(mod, nn.Linear):
            leaf = name.rpartition(".")[2]
            if leaf in TP_COLWISE:
                out[f"{name}.weight"] = 0
            elif leaf in TP_ROWWISE:
                out[f"{name}.weight"] = 1
    return out


def expert_parallel_variant(model: nn.Module, ep: int) -> nn.Module:
    """``model`` (in place) as one rank of expert parallelism ``ep`` holds it: every 3-D
    parameter under a module path containing ``experts`` (the stacks of the presets) cut to
    ``E/ep`` experts, on the meta device; routers and everything else unchanged. For
    ``dmuon.plan.compile(model, mesh, ep=ep)`` on a preset (``python -m dmuon plan --ep``).

    Raises:
        ValueError: ``ep < 1``, no expert stack, or ``ep`` not dividing a stack's experts.
    """
    if ep < 1:
        raise ValueError(f"expert_parallel_variant: ep must be >= 1, got {ep}")
    found = False
    for mod_name, mod in model.named_modules():
        for name, p in list(mod._parameters.items()):
            if p is None or p.ndim != 3 or "experts" not in mod_name:
                continue
            if p.shape[0] % ep:
                raise ValueError(
                    f"expert_parallel_variant: ep={ep} does not divide the {p.shape[0]} experts of {mod_name}.{name}"
                )
            found = True
            mod._parameters[name] = nn.Parameter(
                torch.empty((p.shape[0] // ep, *p.shape[1:]), dtype=p.dtype, device="meta"),
                requires_grad=p.requires_grad,
            )
    if not found:
        raise ValueError("expert_parallel_variant: the model has no expert stack (a 3-D parameter under 'experts')")
    return model
