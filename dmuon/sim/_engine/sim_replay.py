"""The engine: the clocked replay of lowered ops in table order (:func:`replay_ops`) and the
critical path through it (:func:`_critical_path`); the model is in :mod:`dmuon.sim.simulate`'s
docstring. Its ops come from :func:`dmuon.sim._engine.lower._lower`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from dmuon.sim._engine.hardware import Hardware, comm_cpu_share_at
from dmuon.sim._engine.lower import _CHANNELS, _SimOp
from dmuon.sim._engine.records import Interval, PathStep

__all__ = ["replay_ops"]


def replay_ops(sim_ops: list[_SimOp], num_ranks: int, hw: Hardware, *, timeline_ranks: Sequence[int] = ()) -> dict:
    """Clocked replay of lowered ops in table order (Note: the simulator's replay, docs/design.md). Returns raw
    arrays."""
    n = num_ranks
    neg = -np.inf
    host = np.zeros(n)  # thread free
    cstart = np.zeros(n)  # start of the latest compute op (separate engines issue from there)
    issued = np.zeros(n)  # latest issue time (separate engines)
    chan = {c: np.zeros(n) for c in _CHANNELS}
    chan_op = {c: np.full(n, -1, dtype=np.int64) for c in _CHANNELS}
    host_op = np.full(n, -1, dtype=np.int64)
    comm_end = np.zeros(n)  # end of the rank's last collective that the step waits for
    comm_end_op = np.full(n, -1, dtype=np.int64)
    deferred_end = np.zeros(n)
    busy = np.zeros(n)
    wait = np.zeros(n)
    ns = np.zeros(n)
    comm_busy = np.zeros(n)  # end of the latest collective issued by each rank (its CPU share)
    threads = hw.comm_engine == "threads"
    share = comm_cpu_share_at(hw) if threads else 0.0
    tl_mask = np.zeros(n, dtype=bool)
    tl = [r for r in timeline_ranks if 0 <= r < n]
    tl_mask[tl] = True
    timelines: dict[int, list[Interval]] = {r: [] for r in tl}
    m = len(sim_ops)
    end_scalar = np.full(m, neg)
    start_scalar = np.full(m, neg)
    end_vec: dict[int, np.ndarray] = {}
    start_vec: dict[int, np.ndarray] = {}
    pred: dict[int, Any] = {}  # collective: (op, rank); local: (pred op array n, pred rank array n)

    # Groups are interned once: ``gid[i]`` names op i's group, ``garr[g]`` its global ranks.
    # Hashing a rank tuple costs O(group size), so everything below is keyed by group id.
    gids: dict[tuple[int, ...], int] = {}
    gid = [gids.setdefault(op.group, len(gids)) for op in sim_ops]
    garr = [np.asarray(g, dtype=np.int64) for g in gids]
    overlap_cache: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}
    pattern_cache: dict[tuple, tuple] = {}
    # dep_ready is a function of (group, deps) once the deps are replayed (they precede the op),
    # so ops with the same deps on the same group (e.g. the naive baseline's all-gathers of every
    # matrix of a unit, row by row) read them once; the arrays returned are never written to
    ready_cache: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}
    is_coll = [op.collective for op in sim_ops]
    sgid = [g if c else ~g for g, c in zip(gid, is_coll)]  # ~: a local op's group
    spans_all = [c and len(garr[g]) == n for g, c in zip(gid, is_coll)]

    def overlap(dep_g: int, g: int) -> tuple[np.ndarray, np.ndarray]:
        """(positions in group ``g``, global ranks) of the members ``g`` shares with ``dep_g``."""
        hit = overlap_cache.get((dep_g, g))
        if hit is None:
            pos = np.full(n, -1, dtype=np.int64)
            pos[garr[g]] = np.arange(len(garr[g]))
            p = pos[garr[dep_g]]
            keep = p >= 0
            hit = overlap_cache[(dep_g, g)] = (p[keep], garr[dep_g][keep])
        return hit

    def pattern(g: int, vec: list[int]) -> tuple:
        """The flattened (member position, dep order, local-dep slices) of ``vec``'s deps as seen
        from group ``g``; the same for every op whose deps sit on the same groups (every layer)."""
        key = (g, tuple(map(sgid.__getitem__, vec)))
        hit = pattern_cache.get(key)
        if hit is None:
            cols, rows, counts, local = [], [], [], []
            at = 0
            for j, d in enumerate(vec):
                pos, ranks = overlap(gid[d], g)
                cols.append(pos)
                rows.append(np.full(len(pos), j, dtype=np.int64))
                counts.append(len(pos))
                if not is_coll[d]:
                    local.append((j, at, at + len(pos), ranks))
                at += len(pos)
            cols_a, rows_a = np.concatenate(cols), np.concatenate(rows)
            # every member reached by exactly one dep (e.g. a replicate all-reduce after the
            # reduce-scatters of its rows): the dep of each member, in member order
            one = None
            if len(cols_a) == len(garr[g]) and not local and len(np.unique(cols_a)) == len(cols_a):
                one = rows_a[np.argsort(cols_a)]
            hit = pattern_cache[key] = (cols_a, rows_a, np.asarray(counts), local, one)
        return hit

    def dep_ready(deps, i, G):
        """(ready per member of op ``i``, dep index per member or -1): the latest end among the
        deps each member takes part in; on ties the first dep in ``deps`` order wins (a
        collective on the op's own group, or on every rank, counts as one scalar read first).
        The other deps are read in one pass: every (dep, shared member) pair flattened, the max
        per member by ``np.maximum.at``, the first dep reaching it by ``np.minimum.at``."""
        g = gid[i]
        hit = ready_cache.get((g, deps))
        if hit is not None:
            return hit
        sbest, swho = neg, -1
        vec = []
        for d in deps:
            if spans_all[d] or (is_coll[d] and gid[d] == g):
                e = end_scalar[d]
                if e > sbest:
                    sbest, swho = e, d
            else:
                vec.append(d)
        k = len(G)
        if not vec:
            hit = ready_cache[(g, deps)] = (np.full(k, sbest), np.full(k, swho, dtype=np.int64))
            return hit
        cols, rows, counts, local, one = pattern(g, vec)
        vec_arr = np.asarray(vec, dtype=np.int64)
        if one is not None:  # no ties to break: each member's dep is read directly
            mine = vec_arr[one]
            top = end_scalar[mine]
            better = top > sbest
            hit = ready_cache[(g, deps)] = (np.where(better, top, sbest), np.where(better, mine, swho))
            return hit
        vals = np.repeat(end_scalar[vec_arr], counts)
        for j, a, b, ranks in local:
            vals[a:b] = end_vec[vec[j]][ranks]
        top = np.full(k, neg)
        np.maximum.at(top, cols, vals)
        win = vals == top[cols]
        first = np.full(k, len(vec), dtype=np.int64)
        np.minimum.at(first, cols[win], rows[win])
        better = top > sbest
        best = np.where(better, top, sbest)
        who = np.where(better, np.append(vec_arr, -1)[first], swho)
        hit = ready_cache[(g, deps)] = (best, who)
        return hit

    for i, op in enumerate(sim_ops):
        G = garr[gid[i]]
        if op.collective:
            if threads:
                host[G] += op.host_s
                busy[G] += op.host_s
                issue = host[G]
            else:
                issued[G] = np.maximum(cstart[G], issued[G]) + op.host_s
                issue = issued[G]
            c = op.channel
            free = chan[c][G]
            a, b = int(issue.argmax()), int(free.argmax())
            j_issue, j_chan = int(G[a]), int(G[b])
            cand_t = [issue[a], free[b]]
            cand_p = [(int(host_op[j_issue]), j_issue), (int(chan_op[c][j_chan]), j_chan)]
            if op.deps:
                dr, who = dep_ready(op.deps, i, G)
                k = int(dr.argmax())
                cand_t.append(dr[k])
                cand_p.append((int(who[k]), int(G[k])))
            k = max(range(len(cand_t)), key=cand_t.__getitem__)  # the first of the latest, as np.argmax
            start = max(0.0, float(cand_t[k]))
            end = start + float(op.seconds)
            pred[i] = cand_p[k] if cand_t[k] > 0 else (-1, -1)
            start_scalar[i] = start
            end_scalar[i] = end
            chan[c][G] = end
            chan_op[c][G] = i
            if op.deferred:
                deferred_end[G] = np.maximum(deferred_end[G], end)
            else:
                later = G[comm_end[G] < end]
                comm_end[later] = end
                comm_end_op[later] = i
            if share:
                comm_busy[G] = np.maximum(comm_busy[G], end)
            if tl:
                for x in G[tl_mask[G]]:
                    timelines[int(x)].append(Interval(start, end, c, op.kind, op.label))
        else:
            dur = op.seconds
            h = host[G]
            if op.deps:
                dr, who = dep_ready(op.deps, i, G)
                start = np.maximum(h, dr)
                from_dep = dr > h
            else:
                start = h.copy()
                from_dep = np.zeros(len(G), dtype=bool)
                who = np.full(len(G), -1, dtype=np.int64)
            if share:  # gloo's threads take their share of the part of the op the rank's collectives overlap
                dur = dur + share * np.clip(np.minimum(comm_busy[G], start + dur) - start, 0.0, None)
            wait[G] += start - h
            end = start + dur
            busy[G] += dur
            if op.ns:
                ns[G] += dur
            pv = np.where(from_dep, who, host_op[G])
            full_end = np.full(n, neg)
            full_end[G] = end
            full_start = np.full(n, neg)
            full_start[G] = start
            end_vec[i] = full_end
            start_vec[i] = full_start
            pa = np.full(n, -1, dtype=np.int64)
            pa[G] = pv
            pred[i] = pa
            host[G] = end
            cstart[G] = start
            host_op[G] = i
            if tl:
                for x in G[tl_mask[G]]:
                    p = int(np.searchsorted(G, x)) if len(G) > 1 else 0
                    s0 = float(start[p]) if np.ndim(start) else float(start)
                    e0 = float(end[p]) if np.ndim(end) else float(end)
                    timelines[int(x)].append(Interval(s0, e0, "compute", op.kind, op.label))
    rank_end = np.maximum(host, comm_end)
    return dict(
        host=host,
        chan_end=comm_end,
        comm_end_op=comm_end_op,
        deferred_end=deferred_end,
        rank_end=rank_end,
        busy=busy,
        wait=wait,
        ns=ns,
        pred=pred,
        end_scalar=end_scalar,
        start_scalar=start_scalar,
        end_vec=end_vec,
        start_vec=start_vec,
        timelines={r: tuple(v) for r, v in timelines.items()},
        chan_op=chan_op,
        host_op=host_op,
        chan=chan,
    )


def _critical_path(sim_ops: list[_SimOp], raw: dict) -> tuple[int, list[PathStep]]:
    rank_end = raw["rank_end"]
    r = int(np.argmax(rank_end))
    # the last op on that rank: its thread's, or a channel's if that ends later
    cands = [(raw["host"][r], int(raw["host_op"][r])), (raw["chan_end"][r], int(raw["comm_end_op"][r]))]
    _, i = max(cands)
    steps: list[PathStep] = []
    seen = 0
    while i >= 0 and seen < 10_000_000:
        seen += 1
        op = sim_ops[i]
        if op.collective:  # shown on the member that arrived last (the one it waited for)
            s, e = float(raw["start_scalar"][i]), float(raw["end_scalar"][i])
            nxt, nr = raw["pred"][i]
            r = int(nr) if nr >= 0 else r
        else:
            s, e = float(raw["start_vec"][i][r]), float(raw["end_vec"][i][r])
            nxt, nr = int(raw["pred"][i][r]), r
        steps.append(PathStep(rank=r, kind=op.kind, label=op.label, start_s=s, end_s=e))
        i, r = int(nxt), int(nr) if nr >= 0 else r
    steps.reverse()
    return int(np.argmax(rank_end)), steps
