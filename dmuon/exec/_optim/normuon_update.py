"""NorMuon (``dmuon.Muon(variant="normuon")``): Muon's orthogonalised update normalised per
output neuron. The normalisation itself is :func:`dmuon._update.normuon_normalize` (plain tensors);
this module holds its second-moment state layout, which the Muon step (:mod:`dmuon.exec._optim.muon_step`) reads.

NorMuon (Li, Liu, Liang, Chen, Zhao, "NorMuon: Making Muon more efficient and scalable",
arXiv 2510.05491; the authors' ``normuon.py``, github.com/zichongli5/NorMuon) keeps one fp32
second-moment vector ``v`` per Muon matrix ``O`` ``(out, in)`` (``nn.Linear`` orientation), one
entry per output row, and after Newton-Schulz:

1. ``s_i = mean_j O_ij²`` (the mean over ``in``: one value per row / output neuron);
2. ``v <- lerp(v, s, 1 - beta2)`` (an EMA from zeros, no bias correction: a bias correction
   divides every row by the same constant, which step 4 undoes exactly);
3. ``Ô = O / (sqrt(v) + eps)`` (row ``i`` divided by ``sqrt(v_i) + eps``);
4. ``Ô <- Ô · ‖O‖_F / (‖Ô‖_F + eps)`` (the Frobenius norm of Muon's update restored, so Muon's
   learning rate, :func:`~dmuon._update.adjust_lr` and weight decay carry over);

then Muon's update ``p <- p·(1 - lr·wd) - adjust_lr(lr, (out, in))·Ô``. The normalisation runs in
fp32 whatever ``ns_dtype`` (the authors' bf16 path differs from fp32 by ~1e-2 relative).

The neuron axis is dmuon's own ``(out, in)`` view of every Muon matrix, never a shape heuristic:
one statistic per OUTPUT row of each matrix Muon orthogonalises, one Frobenius rescale per
matrix. So an ``nn.Linear`` ``(out, in)`` has ``out`` entries; a conv weight viewed
``(out, in·k)`` ``out`` entries; an expert stack one row of ``out`` per expert (each expert its
own rescale; gpt-oss's ``(in, out)`` storage is read through its transpose); a split gate/up
expert separate rows and rescales for gate and up; a row-block view (per-head q/k/v) one entry
per row and one rescale per block; a column-block view (per-head o_proj ``(D, H·d)``) ``D``
entries per block. A ``(1, n)`` matrix is left as it is (its one row is the whole norm).

State: ``optimizer.state[p]["second_momentum_buffer"]``, fp32, on the owner next to the momentum,
of the *second-moment shape* (:func:`second_moment_shape`): the parameter's storage shape with
its ``in`` axis collapsed to 1 (``(out, 1)`` for a Linear, ``(out, 1, 1, 1)`` for a conv,
``(E, 2F, 1)`` for an HF gate/up stack, ``(E, 1, D)`` for gpt-oss's ``(E, F, D)`` down stack),
or to the number of column blocks (``(D, H)`` for an o_proj column view). Its dim 0 is the
parameter's dim 0, so checkpoints cut it into the momentum's ``Shard(0)`` row chunks and reshard
it like the momentum, whatever the plan (expert ranges, EP, another world size).

Cost: on a matrix whose owner holds it whole (one owner, expert ranges, EP) no byte and no
collective. An owner group or a TP-sharded matrix would need one small all-reduce per group and
step (docs/muon_variants.md, "NorMuon"): dmuon refuses those (:func:`check_supported`).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor

from dmuon.exec._optim.expert_update import matrices_to_stack, stack_to_matrices
from dmuon.plan._cost.rank_memory import second_moment_shape  # the shape rule, written once with its byte count

__all__ = [
    "VARIANTS",
    "NORMUON_BETA2",
    "NORMUON_EPS",
    "SECOND_MOMENT_KEY",
    "second_moment_shape",
    "new_second_moment",
    "second_moment_rows",
    "write_second_moment_rows",
    "check_supported",
]

#: ``dmuon.Muon(variant=...)``: ``"muon"`` (default) or ``"normuon"``.
VARIANTS = ("muon", "normuon")
#: The authors' defaults: ``beta2 = 0.95``; ``1e-10`` in both divisions.
NORMUON_BETA2 = 0.95
NORMUON_EPS = 1e-10
#: The optimizer-state key of ``v`` (the authors' name).
SECOND_MOMENT_KEY = "second_momentum_buffer"


def new_second_moment(p: Tensor, info) -> Tensor:
    """Zeros of ``p``'s second-moment shape (``p``: the owner's tensor; ``info``: its tag), fp32."""
    shape = second_moment_shape(p.shape, matrix_shape=info.matrix_shape, experts=info.experts, view=info.view)
    return torch.zeros(shape, dtype=torch.float32, device=p.device)


def second_moment_rows(v: Tensor, info, block: Optional[int], m: int) -> Tensor:
    """``(k, m)``: the rows of ``v`` of the ``k`` Muon matrices ``(m, n)`` the step hands over at
    once (the whole parameter, its experts in :func:`stack_to_matrices` order, or view block
    ``block``). A view of ``v`` or a copy: write back with :func:`write_second_moment_rows`."""
    view = info.view
    if view is not None:
        if view.dim == 0:
            return v[view.offsets()[block] : view.offsets()[block] + view.sizes[block], 0].unsqueeze(0)
        return v[:, block].unsqueeze(0)
    if info.experts is not None:
        return stack_to_matrices(v, info.experts).squeeze(-1)
    return v.reshape(-1, m)


def write_second_moment_rows(v: Tensor, rows: Tensor, info, block: Optional[int]) -> None:
    """Store ``rows`` (``(k, m)``, :func:`second_moment_rows`'s layout) into ``v``."""
    view = info.view
    if view is not None:
        if view.dim == 0:
            v[view.offsets()[block] : view.offsets()[block] + view.sizes[block], 0].copy_(rows[0])
        else:
            v[:, block].copy_(rows[0])
    elif info.experts is not None:
        v.copy_(matrices_to_stack(rows.unsqueeze(-1), info.experts, tuple(v.shape)))
    else:
        v.copy_(rows.reshape(v.shape))


def check_supported(info: Any) -> None:
    """Raise ``ValueError`` for a dedicated matrix NorMuon does not run on: one owned by an owner
    group (its rows or columns on several ranks) or sharded by tensor parallelism. The tag is the
    same on every rank, so every rank raises the same error at ``dmuon.Muon(...)`` construction,
    before any collective."""
    tp = getattr(info, "tp", None)
    group = getattr(info, "group", None)
    if tp is None and (group is None or getattr(info, "experts", None) is not None):
        return
    what = (
        f"tensor-parallel (sharded over {getattr(tp, 'size', '?')} TP ranks)"
        if tp is not None
        else "owned by an owner group (its blocks on several ranks)"
    )
    fix = (
        "leave it out of TP (parallelize_module) or of the dmuon predicate"
        if tp is not None
        else "compile the plan with owner_groups='off' (the default)"
    )
    raise ValueError(
        f"dmuon.Muon(variant='normuon'): {info.fqn!r} is {what}; NorMuon's row statistic and norm rescale "
        f"would need an all-reduce over its ranks every step, which dmuon does not run "
        f"(docs/muon_variants.md, 'NorMuon'). Fix: {fix}, or use variant='muon'"
    )
