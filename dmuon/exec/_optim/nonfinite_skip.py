"""``dmuon.Muon(skip_nonfinite=True)``: a step whose gradients are non-finite on any rank is skipped
on every rank together.

The flags, the one collective that carries them and what a skipped step leaves untouched:
Note: skipping non-finite steps (docs/design.md).
"""

from __future__ import annotations

import dataclasses
import logging

import torch
import torch.distributed as dist

from dmuon._dtensor import is_dtensor
from dmuon.exec._comm import collective_calls as C
from dmuon.exec._runtime.packed_buffers import dedicated_info

__all__ = [
    "NonFiniteFlags",
    "local_flags",
    "flag_vector",
    "decode",
    "reduce_flags",
    "append_to_clip",
    "keep_from_clip",
    "skip_message",
]

LOG = logging.getLogger("dmuon")


@dataclasses.dataclass(frozen=True, slots=True)
class NonFiniteFlags:
    """The reduced flags of one step: global ranks whose local gradient of a dedicated matrix was
    non-finite before the reduce (``before_reduce``), and those holding a non-finite gradient at the
    step (``held``)."""

    before_reduce: tuple[int, ...]
    held: tuple[int, ...]

    @property
    def skip(self) -> bool:
        return bool(self.before_reduce or self.held)


def _held_grads(params) -> list[torch.Tensor]:
    """The gradients this rank holds among ``params``: owned dedicated matrices' (full, averaged),
    FSDP2 shards (local), plain tensors; placeholders of matrices owned elsewhere hold none."""
    out = []
    for p in params:
        g = p.grad
        if g is None:
            continue
        info = dedicated_info(p)
        if info is not None and not info.is_owner:
            continue
        out.append(g.to_local() if is_dtensor(g) else g)
    return out


def local_flags(params, runtimes, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(before the reduce, held)`` of this rank, 0-d bool tensors on ``device`` (no host sync)."""
    before = torch.zeros((), dtype=torch.bool, device=device)
    for rt in runtimes:
        if rt.nonfinite_before_reduce is not None:
            before = before | rt.nonfinite_before_reduce.to(device)
    grads = _held_grads(params)
    held = (
        torch.stack([~torch.isfinite(g).all().to(device) for g in grads]).any()
        if grads
        else torch.zeros((), dtype=torch.bool, device=device)
    )
    return before, held


def _group_size_rank(group) -> tuple[int, int]:
    if not (dist.is_available() and dist.is_initialized()):
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def flag_vector(before: torch.Tensor, held: torch.Tensor, group) -> torch.Tensor:
    """This rank's one-hot float32 vector of ``2·W`` elements (Note: skipping non-finite steps, docs/design.md)."""
    k, me = _group_size_rank(group)
    vec = torch.zeros(2 * k, dtype=torch.float32, device=before.device)
    vec[me] = before.float()
    vec[k + me] = held.float()
    return vec


def decode(vec: torch.Tensor, group) -> NonFiniteFlags:
    """The reduced vector (one host read) as global ranks."""
    k, _ = _group_size_rank(group)
    values = (vec != 0).tolist()
    to_global = (lambda r: dist.get_global_rank(group, r)) if group is not None else (lambda r: r)
    return NonFiniteFlags(
        before_reduce=tuple(to_global(r) for r in range(k) if values[r]),
        held=tuple(to_global(r) for r in range(k) if values[k + r]),
    )


def reduce_flags(params, runtimes, group, device: torch.device) -> NonFiniteFlags:
    """The step's flags: the clip's result where ``dmuon.clip_grad_norm_`` carried them this step,
    else one all-reduce (SUM, ledger phase ``"other"``) of this rank's vector over ``group``."""
    carried = next((rt.nonfinite_flags for rt in runtimes if rt.nonfinite_flags is not None), None)
    if carried is not None:
        return carried
    vec = flag_vector(*local_flags(params, runtimes, device), group)
    if dist.is_available() and dist.is_initialized():
        C.all_reduce_sum(vec, group=group, phase="other")
    return decode(vec, group)


def append_to_clip(part: torch.Tensor, params, runtimes, group) -> torch.Tensor:
    """``dmuon.clip_grad_norm_``: ``part`` (the 0-d owners' norm term it all-reduces) with this
    rank's flag vector appended, to be reduced in the same all-reduce."""
    vec = flag_vector(*local_flags(params, runtimes, part.device), group)
    return torch.cat([part.reshape(1), vec.to(part.dtype)])


def keep_from_clip(reduced: torch.Tensor, runtimes, group) -> torch.Tensor:
    """After the clip's all-reduce of :func:`append_to_clip`'s vector: keep the flags on every
    runtime for the step and return the norm term (0-d)."""
    flags = decode(reduced[1:], group)
    for rt in runtimes:
        rt.nonfinite_flags = flags
    return reduced[0]


def skip_message(flags: NonFiniteFlags, step: int) -> str:
    """The warning rank 0 logs for skipped step ``step`` (1-based; Note: skipping non-finite steps, docs/design.md)."""
    if flags.before_reduce:
        who = (
            f"the local gradient of a dedicated matrix was non-finite on rank(s) {list(flags.before_reduce)} "
            "before the reduce"
        )
    else:
        who = (
            f"no rank's local gradient of a dedicated matrix was non-finite before dmuon's reduces; rank(s) "
            f"{list(flags.held)} hold a non-finite gradient after the reduces (owners of dedicated matrices, FSDP2 "
            "shard holders: FSDP2 reduces its gradients before dmuon sees them, so the rank that produced it is "
            "not known)"
        )
    return (
        f"dmuon.Muon: optimizer step {step} (1-based) skipped on every rank (skip_nonfinite=True): {who}. Parameters, momenta, AdamW "
        "moments and step counters are unchanged; step your LR scheduler only if you want it to advance "
        "(optimizer.last_step_skipped)"
    )
