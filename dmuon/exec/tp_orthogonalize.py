"""Newton-Schulz of tensor-parallel dedicated matrices on their owner's TP group (``dmuon.Muon``).

A TP-sharded dedicated matrix is owned by ``T`` ranks (one TP group), each holding one block of
rows or columns of its momentum. :func:`orthogonalize_and_apply` orthogonalises the full matrix
without any rank holding it (``"gram"``) or after one all-gather (``"gather"``), as the plan's
``tp_ns`` says, and applies each rank's block of the update.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from . import collectives as C
from . import newton_schulz as _ns

__all__ = ["orthogonalize_and_apply"]


def orthogonalize_and_apply(entries, *, steps: int, orthogonalize, ns_kw: dict, apply) -> None:
    """Newton-Schulz of TP-sharded matrices on their owner's TP group, then the update.

    ``entries``: ``(p, local update, TPInfo)`` in ``group["params"]`` order, identical on
    the ``T`` ranks of an owner group (they own the same matrices and agree on which have a
    gradient), so every TP collective below runs in the same order on all of them.

    * ``"gram"`` matrices, batched by local shape: :func:`~dmuon.exec.newton_schulz.
      sharded_gram_newton_schulz` with one fp32 Gram all-reduce per segment (the plan's
      ``tp_gram_restart_every``); row-sharded matrices enter transposed.
    * ``"gather"`` matrices: one all-gather of all their local updates (storage dtype),
      then the group's NS backend on each full matrix on every TP rank, each keeping its
      block.
    """
    rt = entries[0][0]._dmuon.runtime()
    plan = rt.plan
    gram: dict[tuple, list] = {}
    gather: dict[tuple, list] = {}
    for p, update, tp in entries:
        if tp.method == "gram":
            if steps != plan.tp_ns_steps:
                raise ValueError(
                    f"dmuon.Muon: ns_steps={steps} but the plan of the TP-sharded matrix "
                    f"{p._dmuon.fqn!r} assumes tp_ns_steps={plan.tp_ns_steps} (its Gram all-reduce "
                    f"count); compile the plan with tp_ns_steps={steps}"
                )
            x = update.mT if tp.shard_dim == 0 else update  # (d, D_local), d = unsplit side
            gram.setdefault((tuple(x.shape), x.dtype, id(tp.group)), []).append((p, x, tp))
        else:
            gather.setdefault((update.dtype, id(tp.group)), []).append((p, update, tp))

    for items in gram.values():
        tp = items[0][2]

        def all_reduce(g, tp=tp):
            C.all_reduce_sum(g, group=tp.group, phase="tp")
            return g

        x = torch.stack([e[1] for e in items]) if len(items) > 1 else items[0][1].unsqueeze(0)
        ortho = _ns.sharded_gram_newton_schulz(
            x,
            all_reduce_sum=all_reduce,
            coefficients=ns_kw["coefficients"],
            steps=steps,
            eps=ns_kw["eps"],
            dtype=ns_kw["dtype"],
            restart_every=plan.tp_gram_restart_every,
        )
        for (p, _, tp), o in zip(items, ortho.unbind(0)):
            o = o.mT if tp.shard_dim == 0 else o
            apply(p.to_local(), o, tp.shape)

    for items in gather.values():
        tp = items[0][2]
        flat = torch.cat([u.reshape(-1) for _, u, _ in items])
        out = torch.empty(tp.size * flat.numel(), dtype=flat.dtype, device=flat.device)
        C.wait_all(
            [C.all_gather_into(out, flat, group=tp.group, phase="tp", async_op=True)],
            what="TP all-gather of Muon updates",
            timeout_s=rt.timeout_s,
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
