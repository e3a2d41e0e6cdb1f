"""Newton-Schulz of dedicated matrices that several ranks hold, on the ranks that hold them
(``dmuon.Muon``): TP-sharded matrices on their owner's TP group, and matrices owned by an
owner group (``dmuon.plan.compile(owner_groups=...)``) on its members.

A TP-sharded dedicated matrix is owned by ``T`` ranks (one TP group), each holding one block of
rows or columns of its momentum. :func:`orthogonalize_and_apply` orthogonalises the full matrix
without any rank holding it (``"gram"``) or after one all-gather (``"gather"``), as the plan's
``tp_ns`` says, and applies each rank's block of the update.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from dmuon.exec._comm import collective_calls as C
from dmuon._tags import dedicated_info
from dmuon.exec._optim import ns_backends as _ns

__all__ = ["orthogonalize_and_apply", "orthogonalize_groups_and_apply", "check_gram_steps"]


def check_gram_steps(steps: int, plan, fqn: str, what: str) -> None:
    """Raise ``ValueError`` unless ``steps`` (``dmuon.Muon``'s ``ns_steps``) is the plan's
    ``tp_ns_steps``, from which the plan counts the Gram all-reduces of a ``what`` matrix
    (``"TP-sharded"`` / ``"owner-grouped"``) ``fqn``: another count would desynchronise them."""
    if steps != plan.tp_ns_steps:
        raise ValueError(
            f"dmuon.Muon: ns_steps={steps} but the plan of the {what} matrix {fqn!r} assumes "
            f"tp_ns_steps={plan.tp_ns_steps} (its Gram all-reduce count); compile the plan with "
            f"tp=dmuon.plan.TPPolicy(ns_steps={steps})"
        )


def _sharded_gram(x, group, phase: str, *, steps: int, ns_kw: dict, restart_every):
    """:func:`~dmuon._ns_gram.sharded_gram_newton_schulz` of the ``(B, d, D)`` batch
    ``x`` with its Gram all-reduces on ``group``, charged to the ledger as ``phase``."""

    def all_reduce(g):
        C.all_reduce_sum(g, group=group, phase=phase)
        return g

    return _ns.sharded_gram_newton_schulz(
        x,
        all_reduce_sum=all_reduce,
        coefficients=ns_kw["coefficients"],
        steps=steps,
        eps=ns_kw["eps"],
        dtype=ns_kw["dtype"],
        restart_every=restart_every,
    )


def orthogonalize_and_apply(entries, *, steps: int, orthogonalize, ns_kw: dict, apply) -> None:
    """Newton-Schulz of TP-sharded matrices on their owner's TP group, then the update.

    ``entries``: ``(p, local update, TPInfo)`` in ``group["params"]`` order, identical on
    the ``T`` ranks of an owner group (they own the same matrices and agree on which have a
    gradient), so every TP collective below runs in the same order on all of them.

    * ``"gram"`` matrices, batched by local shape: :func:`~dmuon._ns_gram.
      sharded_gram_newton_schulz` with one fp32 Gram all-reduce per segment (the plan's
      ``tp_gram_restart_every``); row-sharded matrices enter transposed.
    * ``"gather"`` matrices: one all-gather of all their local updates (storage dtype),
      then the group's NS backend on each full matrix on every TP rank, each keeping its
      block.
    """
    rt = dedicated_info(entries[0][0]).runtime()
    plan = rt.plan
    gram: dict[tuple, list] = {}
    gather: dict[tuple, list] = {}
    for p, update, tp in entries:
        if tp.method == "gram":
            check_gram_steps(steps, plan, dedicated_info(p).fqn, "TP-sharded")
            x = update.mT if tp.shard_dim == 0 else update  # (d, D_local), d = unsplit side
            gram.setdefault((tuple(x.shape), x.dtype, id(tp.group)), []).append((p, x, tp))
        else:
            gather.setdefault((update.dtype, id(tp.group)), []).append((p, update, tp))

    for items in gram.values():
        tp = items[0][2]

        x = torch.stack([e[1] for e in items]) if len(items) > 1 else items[0][1].unsqueeze(0)
        ortho = _sharded_gram(x, tp.group, "tp", steps=steps, ns_kw=ns_kw, restart_every=plan.tp_gram_restart_every)
        for (p, _, tp), o in zip(items, ortho.unbind(0)):
            o = o.mT if tp.shard_dim == 0 else o
            apply(p.to_local(), o, tp.shape)

    for items in gather.values():
        tp = items[0][2]
        flat = torch.cat([u.reshape(-1) for _, u, _ in items])
        out = torch.empty(tp.size * flat.numel(), dtype=flat.dtype, device=flat.device)
        rt.wait(
            [C.all_gather_into(out, flat, group=tp.group, phase="tp", async_op=True)],
            "TP all-gather of Muon updates",
            group=tp.group,
        )
        out = out.view(tp.size, -1)
        by_coord = [out[dist.get_group_rank(tp.group, tp.ranks[t])] for t in range(tp.size)]
        offset = 0
        for p, u, tp in items:
            n = u.numel()
            full = torch.cat([b[offset : offset + n].view(u.shape) for b in by_coord], dim=tp.shard_dim)
            offset += n
            ortho = orthogonalize(full, **ns_kw)
            rows = u.shape[tp.shard_dim]
            mine = ortho.narrow(tp.shard_dim, tp.rank * rows, rows)
            apply(p.to_local(), mine, tp.shape)


def orthogonalize_groups_and_apply(entries, *, steps: int, ns_kw: dict, apply) -> None:
    """Sharded Gram Newton-Schulz of owner-grouped matrices over their members, then the update.

    ``entries``: ``(p, block update, GroupInfo)`` in ``group["params"]`` order, this rank's
    block of each grouped matrix it owns with a gradient. Every member of one owner group owns
    the same matrices and agrees on which have a gradient, so the all-reduces below run in the
    same order on all of them: groups in order of first appearance, within a group Gram
    buckets by ``(d, padded block width, dtype)`` in order of first appearance (the plan's
    schedule, phase ``"owner_group"``). Each block enters as ``(d, D_j)`` (row blocks
    transposed, ``d`` = the short side) padded with zero columns to the group's largest block
    ``ceil(L/k)`` — zero columns add nothing to the Gram and stay zero — so every member stacks
    the same batch; one fp32 ``(B, d, d)`` all-reduce per Gram segment
    (:func:`~dmuon._ns_gram.sharded_gram_newton_schulz`).
    """
    rt = dedicated_info(entries[0][0]).runtime()
    plan = rt.plan
    check_gram_steps(steps, plan, dedicated_info(entries[0][0]).fqn, "owner-grouped")
    by_group: dict[tuple, dict[tuple, list]] = {}
    for p, update, og in entries:
        x = update.mT if og.dim == 0 else update  # (d, D_j)
        width = max(og.sizes)
        key = (int(x.shape[0]), width, x.dtype)
        by_group.setdefault(og.mesh_ranks, {}).setdefault(key, []).append((p, x, og))
    for buckets in by_group.values():
        for (d, width, dtype), items in buckets.items():
            x = torch.zeros((len(items), d, width), dtype=dtype, device=items[0][1].device)
            for b, (_, xb, _) in enumerate(items):
                x[b, :, : xb.shape[1]].copy_(xb)
            ortho = _sharded_gram(
                x, items[0][2].pg, "owner_group", steps=steps, ns_kw=ns_kw, restart_every=plan.tp_gram_restart_every
            )
            for (p, xb, og), o in zip(items, ortho.unbind(0)):
                o = o[:, : xb.shape[1]]
                apply(p, o.mT if og.dim == 0 else o, og.shape)
