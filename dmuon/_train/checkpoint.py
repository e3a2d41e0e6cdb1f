"""Save and resume the main job: one sharded ``torch.distributed.checkpoint`` (DCP) per save.

All functions here are collectives. The folder layout, what one checkpoint holds and how it
reshards: Note: the main job's checkpoints (docs/design.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "RUN_FLAGS",
    "TrainState",
    "step_dir",
    "latest_checkpoint",
    "save_checkpoint",
    "load_checkpoint",
]

RUN_FLAGS = (
    "optimizer",
    "steps",
    "batch",
    "seq_len",
    "d_model",
    "n_layers",
    "n_heads",
    "d_mlp",
    "lr",
    "adamw_lr",
    "weight_decay",
    "adamw_weight_decay",
    "warmup",
    "cooldown_frac",
    "seed",
    "data",
    "val_fraction",
    "ns_dtype",
    "qk_clip",
    "matrix_views",
    "experts",
    "top_k",
    "aux_loss_coef",
    "router_optimizer",
)
"""Flags that define the run: a resumed run must be given the same values (anything else --
mesh, world size, Z2/Z3, logging, evaluation -- may change). ``ns_dtype`` is compared after
``auto`` is resolved, so a CPU run and a CUDA run differ there."""

_ADDED_FLAG_DEFAULTS = {"experts": 0, "top_k": 2, "aux_loss_coef": 0.01, "router_optimizer": "muon"}
"""Run flags added after checkpoints were first written: a checkpoint without one was saved
with its default (the dense model)."""

_STEP_RE = re.compile(r"^step_(\d+)$")


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainState:
    """What :func:`load_checkpoint` returns besides the loaded model / optimizer / scheduler.

    Attributes:
        step: optimizer steps done (the next step to run is ``step + 1``).
        history: the run's ``{"train": [[step, loss], ...], "val": [[step, loss], ...],
            "val_train_time_s": [...]}`` up to ``step``.
        train_time_s: training wall time so far (rank 0's clock, evaluation excluded).
        path: the checkpoint folder read.
    """

    step: int
    history: dict
    train_time_s: float
    path: str


def step_dir(root: str, step: int) -> str:
    """``root/step_XXXXXXXX``: the folder of the checkpoint taken after ``step`` steps."""
    return os.path.join(root, f"step_{step:08d}")


def _is_complete(path: str) -> bool:
    return os.path.isfile(os.path.join(path, ".metadata"))


def latest_checkpoint(path: str) -> str | None:
    """``path`` itself when it is a complete DCP checkpoint, else its newest complete
    ``step_*`` sub-folder, else None."""
    if _is_complete(path):
        return path
    if not os.path.isdir(path):
        return None
    steps = []
    for name in os.listdir(path):
        m = _STEP_RE.match(name)
        if m and _is_complete(os.path.join(path, name)):
            steps.append((int(m.group(1)), name))
    return os.path.join(path, max(steps)[1]) if steps else None


def run_flags(args: argparse.Namespace, ns_dtype: str) -> dict[str, Any]:
    """The values of :data:`RUN_FLAGS` for this run (``ns_dtype`` resolved)."""
    flags = {k: getattr(args, k, _ADDED_FLAG_DEFAULTS.get(k)) for k in RUN_FLAGS}
    flags["ns_dtype"] = ns_dtype
    return flags


def _rng_states(device: torch.device) -> torch.Tensor:
    """Every rank's RNG state, gathered: (world, n) uint8 (CPU state, then CUDA's if any)."""
    state = torch.get_rng_state()
    if device.type == "cuda":
        state = torch.cat([state, torch.cuda.get_rng_state(device)])
    comm = device if dist.get_backend() == "nccl" else torch.device("cpu")
    out = [torch.empty_like(state, device=comm) for _ in range(dist.get_world_size())]
    dist.all_gather(out, state.to(comm))
    return torch.stack([t.cpu() for t in out])


def _set_rng_state(states: torch.Tensor, device: torch.device) -> None:
    row = dist.get_rank() if states.shape[0] == dist.get_world_size() else 0
    state = states[row]
    n_cpu = torch.get_rng_state().numel()
    torch.set_rng_state(state[:n_cpu].clone())
    if device.type == "cuda" and state.numel() > n_cpu:
        torch.cuda.set_rng_state(state[n_cpu:].clone(), device)


def _state_dicts(model, optimizer) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    return {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)}


def save_checkpoint(
    root: str,
    *,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler,
    history: dict,
    train_time_s: float,
    flags: dict[str, Any],
    device: torch.device,
) -> str:
    """Write the checkpoint after ``step`` steps to :func:`step_dir` ``(root, step)``; every
    rank calls it, between steps. Returns the folder."""
    import torch.distributed.checkpoint as dcp

    if hasattr(optimizer, "init_state"):  # dmuon.Muon: every entry exists on every rank
        optimizer.init_state()
    path = step_dir(root, step)
    sd = _state_dicts(model, optimizer)
    sd["train"] = json.dumps(
        {  # one JSON leaf: DCP loads only the leaves it is asked for
            "step": step,
            "scheduler": scheduler.state_dict(),
            "history": history,
            "train_time_s": float(train_time_s),
            "flags": dict(flags),
        }
    )
    sd["rng"] = _rng_states(device)
    dcp.save(sd, checkpoint_id=path)
    return path


def load_checkpoint(
    path: str,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler,
    flags: dict[str, Any],
    device: torch.device,
) -> TrainState:
    """Resume from ``path`` (a checkpoint or a ``--save`` root, :func:`latest_checkpoint`) into
    the already built ``model`` / ``optimizer`` / ``scheduler``, on this run's mesh; every rank
    calls it. Raises ``SystemExit`` (the same on every rank, before any collective) when no
    complete checkpoint is found, and after reading the run's flags when they differ from
    ``flags``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    found = latest_checkpoint(path)
    if found is None:
        raise SystemExit(
            f"--resume {path}: no complete checkpoint there (a DCP folder with "
            f".metadata, or step_* folders written by --save)"
        )
    holder = {"train": ""}
    dcp.load(holder, checkpoint_id=found)
    train = json.loads(holder["train"])
    saved = {**_ADDED_FLAG_DEFAULTS, **train["flags"]}
    diff = {k: (saved.get(k), v) for k, v in flags.items() if saved.get(k) != v}
    if diff:
        lines = ", ".join(f"--{k.replace('_', '-')} {s!r} (given {g!r})" for k, (s, g) in diff.items())
        raise SystemExit(
            f"--resume {found}: the checkpoint belongs to another run; pass the flags it was saved with: {lines}"
        )
    if hasattr(optimizer, "init_state"):
        optimizer.init_state()
    sd = _state_dicts(model, optimizer)
    # The saved RNG tensor's shape is the saving world's: read it from the metadata.
    meta = dcp.FileSystemReader(found).read_metadata()
    sd["rng"] = torch.empty(meta.state_dict_metadata["rng"].size, dtype=torch.uint8)
    dcp.load(sd, checkpoint_id=found)
    set_model_state_dict(model, sd["model"])
    set_optimizer_state_dict(model, optimizer, sd["optim"])
    scheduler.load_state_dict(train["scheduler"])
    _set_rng_state(sd["rng"], device)
    return TrainState(
        step=int(train["step"]), history=train["history"], train_time_s=float(train["train_time_s"]), path=found
    )
