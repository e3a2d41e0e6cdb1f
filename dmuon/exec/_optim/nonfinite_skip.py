"""``dmuon.Muon(skip_nonfinite=True)``: a step whose gradients are non-finite on any rank is skipped
on every rank together.

**The flags.** Each rank of the job contributes two flags, as one-hot entries of a float32 vector of
``2·W`` elements (``W`` ranks of the job's group: the world, or the data-parallel ranks of one
pipeline stage), reduced over the job (SUM; MAX when it rides on the infinity norm's all-reduce:
the same zero / non-zero pattern):

* entry ``r``: rank ``r``'s *local* gradient of a dedicated matrix was non-finite **before the
  reduce**: the runtime checks every reduce buffer it packs (its own gradients, accumulated over
  micro-batches, :meth:`~dmuon.exec._runtime.runtime.DmuonRuntime.note_reduce_input`). Only dmuon's
  own reduces are seen this way;
* entry ``W + r``: rank ``r`` **holds** a non-finite gradient at the step (after the reduces): the
  averaged gradients of the matrices it owns, its FSDP2 shards, its plain tensors. FSDP2 reduces its
  gradients inside its own hooks, so a NaN that reached FSDP2's reduce-scatter is seen only here,
  on every rank that holds a shard of it.

**One collective.** After ``dmuon.clip_grad_norm_`` (which every rank calls before ``step``), the
vector rides on the clip's all-reduce of the owners' norms (:func:`append_to_clip`, the result
kept on the runtime for the step); otherwise ``step`` all-reduces it alone (:func:`reduce_flags`).

**The skip.** Where any entry is set, every rank skips the whole step: no Muon update, no AdamW
update, no step counter, momentum or moment change, no QK-clip (its max logits are dropped), no
replicate broadcast; the gradients stay as they are (``zero_grad`` as usual). Rank 0 of the job
logs one warning on the ``dmuon`` logger (:func:`skip_message`) naming the rank(s) whose local
gradient was non-finite before the reduce, or, where no rank's was (a NaN only FSDP2's parameters
saw, or one produced after the reduce), the ranks that hold a non-finite gradient after it (owners
and shard holders). The LR scheduler is the caller's to step (``opt.last_step_skipped``); with a
``GradScaler`` the scaler's own check runs first (``scaler.step`` does not call ``step`` when it
found an inf), so this one only sees what it missed.
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
    """This rank's one-hot float32 vector of ``2·W`` elements (module docstring)."""
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
    """The warning rank 0 logs for skipped step ``step`` (1-based; module docstring)."""
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
