"""Expert parallelism of the main job (``python -m dmuon train --experts E --ep P``).

EP groups are ``P`` consecutive ranks (``{0..P-1}, {P..2P-1}, ...``); rank ``j`` of a group holds
the experts ``j·E/P .. (j+1)·E/P - 1`` of every stack as plain parameters (docs/moe_ep.md, "Set-up").
An MoE block then runs :func:`dispatch_combine`: every routed token slot goes to the rank holding
its expert and its output comes back, with ``torch.distributed.nn.functional.all_to_all_single``
(autograd-aware, uneven splits, gloo and NCCL). Its backward is the reverse all-to-all, so a local
expert's gradient is the SUM over the group's ranks of their local losses' gradients; dmuon divides
it by the data-parallel world (``dmuon.dedicate_params(..., ep=P)``).

What :func:`dispatch_combine` computes is, token by token, what
:meth:`dmuon._train.byte_gpt.GroupedExperts.forward` computes with every expert in the process: each
expert's SwiGLU on its token slots, the outputs weighted by the router and added back in the order
of the experts.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

__all__ = ["new_ep_group", "expert_range", "dispatch_combine"]


def new_ep_group(ep: int):
    """This rank's EP process group of ``ep`` consecutive ranks (a collective: every rank of the
    default group calls it, and creates every group, in the same order).

    Raises:
        ValueError: ``ep`` does not divide the world size.
    """
    world, rank = dist.get_world_size(), dist.get_rank()
    if ep < 1 or world % ep:
        raise ValueError(f"expert-parallel degree {ep} must divide the world size {world}")
    mine = None
    for first in range(0, world, ep):
        group = dist.new_group(list(range(first, first + ep)))
        if first <= rank < first + ep:
            mine = group
    # every group connected before any rank goes on: a rank that then stops (a user error raised
    # on every rank) must not take the default group's store away from peers still connecting
    dist.barrier()
    return mine


def expert_range(num_experts: int, ep: int, ep_rank: int) -> range:
    """The experts rank ``ep_rank`` of an EP group of ``ep`` ranks holds: ``E/ep`` consecutive ones."""
    if ep < 1 or num_experts % ep or not 0 <= ep_rank < ep:
        raise ValueError(
            f"{num_experts} experts over ep = {ep}: ep must divide the experts, rank {ep_rank} in 0..{ep - 1}"
        )
    local = num_experts // ep
    return range(ep_rank * local, (ep_rank + 1) * local)


def _all_to_all(x: torch.Tensor, out_split: list[int], in_split: list[int], group) -> torch.Tensor:
    """Autograd-aware ``all_to_all_single`` of ``x``'s rows (``in_split`` rows to each rank of
    ``group``; ``out_split`` rows from each)."""
    with warnings.catch_warnings():  # deprecated for a private module; still the autograd-aware one on gloo
        warnings.simplefilter("ignore", FutureWarning)
        from torch.distributed.nn.functional import all_to_all_single

        out = x.new_empty((sum(out_split), *x.shape[1:]))
        return all_to_all_single(out, x.contiguous(), out_split, in_split, group=group)


def dispatch_combine(
    x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor, experts, *, num_experts: int, group
) -> torch.Tensor:
    """The expert-parallel MoE of one block on this rank's tokens.

    Args:
        x: ``(T, D)`` this rank's tokens.
        idx, weights: ``(T, K)`` each token's routed experts (global ids ``0..E-1``) and their weights.
        experts: this rank's :class:`~dmuon._train.byte_gpt.GroupedExperts` (``E/ep`` local experts);
            :meth:`~dmuon._train.byte_gpt.GroupedExperts.grouped` runs them on rows grouped by expert.
        num_experts: ``E``, the experts of the whole stack.
        group: the EP process group (``ep`` ranks; this rank's index in it picks its experts).

    Returns:
        ``(T, D)``: ``Σ_k weights[t, k] · expert_{idx[t, k]}(x[t])``, added in the order of the experts.

    Steps: sort the ``T·K`` token slots by expert; exchange the per-expert counts (one
    ``all_to_all_single`` of ``E`` ints); send each slot's row to the rank holding its expert; that
    rank regroups what it received by local expert (the rows of one expert: source rank by source
    rank), runs each expert once, and sends the outputs back the same way; weight and add.
    """
    ep = dist.get_world_size(group)
    local = num_experts // ep
    k = idx.shape[1]
    flat_idx = idx.reshape(-1)
    order = torch.argsort(flat_idx, stable=True)  # token slots grouped by expert, then by token
    rows = torch.arange(x.shape[0], device=x.device).repeat_interleave(k).index_select(0, order)
    counts = torch.bincount(flat_idx, minlength=num_experts)  # (E,) slots per expert, this rank
    recv = torch.empty_like(counts)
    dist.all_to_all_single(recv, counts, group=group)  # (ep·local,): [source rank, local expert]
    recv = recv.view(ep, local).cpu()
    send_split = counts.view(ep, local).sum(1).tolist()
    recv_split = recv.sum(1).tolist()
    x_recv = _all_to_all(x.index_select(0, rows), recv_split, send_split, group)
    # received rows are source-major, local expert minor: regroup expert-major for the experts
    chunks = x_recv.split(recv.flatten().tolist())
    grouped = [chunks[s * local + e] for e in range(local) for s in range(ep)]
    y = experts.grouped(torch.cat(grouped) if grouped else x_recv, recv.sum(0).tolist())
    ychunks = y.split(recv.t().flatten().tolist())  # expert-major, source minor: back to source-major
    back = [ychunks[e * ep + s] for s in range(ep) for e in range(local)]
    y_sorted = _all_to_all(torch.cat(back) if back else y, send_split, recv_split, group)
    w_sorted = weights.reshape(-1, 1).to(x.dtype).index_select(0, order)
    return torch.zeros_like(x).index_add(0, rows, y_sorted * w_sorted)
