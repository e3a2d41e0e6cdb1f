"""``torch.distributed.checkpoint`` round trips the checkpoint tests share (called inside ranks)."""

from __future__ import annotations


def sharded_state(model, opt) -> dict:
    """``{"model": ..., "optim": ...}``: the sharded model and optimizer state dicts DCP saves."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    return {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}


def dcp_load(model, opt, path) -> None:
    """Load the checkpoint at ``path`` into ``model`` and ``opt`` (every rank)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    sd = sharded_state(model, opt)
    dcp.load(sd, checkpoint_id=path)
    set_model_state_dict(model, sd["model"])
    set_optimizer_state_dict(model, opt, sd["optim"])
