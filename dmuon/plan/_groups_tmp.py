"""TEMPORARY stand-in for partition.lpt_partition_groups (forced k only); replaced at merge."""
from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class GroupPartitionResult:
    members: tuple[tuple[int, ...], ...]
    loads: tuple[int, ...]
    bound: tuple[int, int]

    @property
    def max_load(self) -> int:
        return max(self.loads) if self.loads else 0


def lpt_partition_groups(weights, piece_weights, max_split, keys, groups, *, num_shards, num_replicas=1,
                         split="auto", slack=0.25):
    from .partition import lpt_partition

    S = num_shards * num_replicas
    ks = [1 if split in ("auto", 1) else min(int(split), int(m)) for m in max_split]
    if all(k == 1 for k in ks):
        r = lpt_partition(weights, keys, groups, num_shards=num_shards, num_replicas=num_replicas)
        return GroupPartitionResult(members=tuple((s,) for s in r.slots), loads=r.loads, bound=r.bound)
    loads = np.zeros(S, dtype=np.int64)
    order = sorted(range(len(weights)), key=lambda i: (-int(weights[i]), keys[i]))
    out = [()] * len(weights)
    for i in order:
        pw = piece_weights(i, ks[i])
        best = None
        for r in range(num_replicas):
            row = loads[r * num_shards:(r + 1) * num_shards]
            idx = np.argsort(row, kind="stable")[: ks[i]]
            score = int(row[idx].max()) + max(pw)
            if best is None or score < best[0]:
                best = (score, r, idx)
        _, r, idx = best
        slots = [r * num_shards + int(j) for j in idx]
        for s, w in zip(slots, pw):
            loads[s] += w
        out[i] = tuple(slots)
    total = int(loads.sum())
    return GroupPartitionResult(members=tuple(out), loads=tuple(int(x) for x in loads), bound=(total + S * max(max(piece_weights(i, ks[i])) for i in range(len(weights))), S))
