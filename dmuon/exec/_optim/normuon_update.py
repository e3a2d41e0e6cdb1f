"""NorMuon (``dmuon.Muon(variant="normuon")``): Muon's orthogonalised update normalised per
output neuron. The normalisation itself is :func:`dmuon._update.normuon_normalize` (plain tensors);
this module holds its second-moment state layout, which the Muon step (:mod:`dmuon.exec._optim.muon_step`) reads.

The algorithm, the neuron axis of every kind of Muon matrix, the state's shape and what is
refused: Note: NorMuon (docs/design.md).
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
