"""Golden plans with hand-computed owners, layouts and byte counts (arithmetic in comments).

Conventions: cost_model="numel", align_numel=16, fp32 = 4 bytes, bf16 = 2 bytes. Models A and B
are checked with one broadcast per segment (``collectives="broadcast"``) and, below each, with the
all-gathers that ``collectives="auto"`` (the default) picks for their small, latency-bound
buffers; model C's buffers have one segment each, which auto keeps as broadcasts.
LPT: items sorted by (-numel, fqn); g = least-loaded slot (lowest index); e = least-loaded slot
whose shard coordinate the item's boundary has not used; take e iff
load[e] + w <= max(M, load[g] + w_max).
"""

from __future__ import annotations

import dataclasses
import types

import pytest
import torch
from torch import nn

import dmuon.plan as P
from dmuon.plan import Boundary, BufferLayout, ByteCost, Owner
from dmuon.plan._layout.buffer_layout import LayoutEntry, Segment, SubSegment


def o(shard: int, replicate: int, N: int) -> Owner:
    return Owner(shard=shard, replicate=replicate, rank=replicate * N + shard)


# --------------------------------------------------------------------------- model A, 1-D N=2


class BlockA(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 3, bias=False)  # weight (3, 4): 12 elements
        self.b = nn.Linear(2, 5, bias=False)  # weight (5, 2): 10 elements
        self.c = nn.Linear(3, 3, bias=False)  # weight (3, 3):  9 elements
        self.norm = nn.LayerNorm(3)  # 1-D: never dedicated by default


class ModelA(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(7, 3)  # excluded: embedding weight
        self.layers = nn.ModuleList([BlockA(), BlockA()])
        self.head = nn.Linear(3, 7)  # 2-D but outside any boundary: not selected by default


def build_a() -> nn.Module:
    with torch.device("meta"):
        return ModelA()


# Sorted items: L0.a 12, L1.a 12, L0.b 10, L1.b 10, L0.c 9, L1.c 9; w_max = 12.
#   L0.a: loads [0,0]   g=0 e=0                              -> 0  [12, 0]  M=12
#   L1.a: g=1 e=1                                            -> 1  [12,12]
#   L0.b: g=0; L0 used {0} -> e=1: 12+10=22 <= max(12,12+12) -> 1  [12,22]  M=22
#   L1.b: g=0; L1 used {1} -> e=0: 22 <= max(22, 24)         -> 0  [22,22]
#   L0.c: g=0; all coords used -> e=g                        -> 0  [31,22]
#   L1.c: g=1; e=g                                           -> 1  [31,31]
OWNERS_A = {
    "layers.0.a.weight": 0,
    "layers.0.b.weight": 1,
    "layers.0.c.weight": 0,
    "layers.1.a.weight": 1,
    "layers.1.b.weight": 0,
    "layers.1.c.weight": 1,
}


def expected_boundaries_a() -> tuple[Boundary, ...]:
    f32 = "torch.float32"
    # layers.0: shard 0 owns a (12) and c (9); shard 1 owns b (10).
    #   seg s0 @0: a @0; c @round_up(12)=16; flags @round_up(16+9)=32 (2 flags);
    #              numel = round_up(32+2-0) = 48
    #   seg s1 @48: b @48; flags @round_up(58)=64 (1 flag); numel = round_up(64+1-48=17) = 32
    #   buffer numel 80
    l0 = BufferLayout(
        dtype=f32,
        numel=80,
        segments=(
            Segment(
                shard=0,
                offset=0,
                numel=48,
                subsegments=(
                    SubSegment(
                        owner=o(0, 0, 2),
                        offset=0,
                        numel=48,
                        entries=(
                            LayoutEntry(fqn="layers.0.a.weight", owner=o(0, 0, 2), offset=0, numel=12, shape=(3, 4)),
                            LayoutEntry(fqn="layers.0.c.weight", owner=o(0, 0, 2), offset=16, numel=9, shape=(3, 3)),
                        ),
                        flags_offset=32,
                    ),
                ),
            ),
            Segment(
                shard=1,
                offset=48,
                numel=32,
                subsegments=(
                    SubSegment(
                        owner=o(1, 0, 2),
                        offset=48,
                        numel=32,
                        entries=(
                            LayoutEntry(fqn="layers.0.b.weight", owner=o(1, 0, 2), offset=48, numel=10, shape=(5, 2)),
                        ),
                        flags_offset=64,
                    ),
                ),
            ),
        ),
    )
    # layers.1: shard 0 owns b (10); shard 1 owns a (12), c (9).
    #   seg s0 @0: b @0; flags @16; numel round_up(17) = 32
    #   seg s1 @32: a @32; c @round_up(44)=48; flags @round_up(57)=64; numel round_up(64+2-32=34) = 48
    #   buffer numel 80
    l1 = BufferLayout(
        dtype=f32,
        numel=80,
        segments=(
            Segment(
                shard=0,
                offset=0,
                numel=32,
                subsegments=(
                    SubSegment(
                        owner=o(0, 0, 2),
                        offset=0,
                        numel=32,
                        entries=(
                            LayoutEntry(fqn="layers.1.b.weight", owner=o(0, 0, 2), offset=0, numel=10, shape=(5, 2)),
                        ),
                        flags_offset=16,
                    ),
                ),
            ),
            Segment(
                shard=1,
                offset=32,
                numel=48,
                subsegments=(
                    SubSegment(
                        owner=o(1, 0, 2),
                        offset=32,
                        numel=48,
                        entries=(
                            LayoutEntry(fqn="layers.1.a.weight", owner=o(1, 0, 2), offset=32, numel=12, shape=(3, 4)),
                            LayoutEntry(fqn="layers.1.c.weight", owner=o(1, 0, 2), offset=48, numel=9, shape=(3, 3)),
                        ),
                        flags_offset=64,
                    ),
                ),
            ),
        ),
    )
    return (
        Boundary(fqn="layers.0", fallback=False, buffers=(l0,)),
        Boundary(fqn="layers.1", fallback=False, buffers=(l1,)),
    )


def test_golden_a_owners_and_layout():
    plan = P.compile(build_a(), 2, collectives="broadcast")
    assert plan.mesh_shape == (1, 2)
    assert plan.dedicated == (
        "layers.0.a.weight",
        "layers.0.b.weight",
        "layers.0.c.weight",
        "layers.1.a.weight",
        "layers.1.b.weight",
        "layers.1.c.weight",
    )
    assert {f: plan.owner(f).rank for f in plan.dedicated} == OWNERS_A
    assert plan.owned_numel == (31, 31)
    assert plan.boundaries == expected_boundaries_a()
    assert plan.boundary("layers.1.c.weight") == "layers.1"
    spec = plan.param("layers.0.b.weight")
    assert (spec.shape, spec.matrix_shape, spec.num_matrices, spec.module_fqn, spec.attr) == (
        (5, 2),
        (5, 2),
        1,
        "layers.0.b",
        "weight",
    )


def test_golden_a_cost_z3_and_z2():
    # Segment numels: layers.0 [s0 48, s1 32], layers.1 [s0 32, s1 48] -> 160 elements, fp32.
    # forward = R*(N-1)*160*4 = 640; backward (Z3) 640; reduce 640; total 1920.
    # rank 0 receives shard-1 segments 32+48 = 80 el = 320 B per broadcast (x2 for Z3) and
    # sends 80 el = 320 B in the reduce -> 960; rank 1 symmetric (48+32) -> 960.
    plan = P.compile(build_a(), 2, collectives="broadcast")
    assert plan.cost == ByteCost(
        forward_broadcast_nbytes=640,
        backward_broadcast_nbytes=640,
        reduce_nbytes=640,
        replicate_reduce_nbytes=0,
        replicate_broadcast_nbytes=0,
        total_nbytes=1920,
        per_rank_nbytes=(960, 960),
    )
    # Z2: no backward broadcast -> 1280 total, 640 per rank.
    z2 = P.compile(build_a(), 2, reshard_after_forward=False, collectives="broadcast")
    assert z2.cost.backward_broadcast_nbytes == 0
    assert z2.cost.total_nbytes == 1280
    assert z2.cost.per_rank_nbytes == (640, 640)
    # Baseline FSDP2+naive: shards ceil(d0/2)*d1: a (3,4)->2*4=8, b (5,2)->3*2=6, c (3,3)->2*3=6;
    # per layer 20 el, 2 layers 40 el per rank = 160 B. Per rank: fwd AG (N-1)*160=160,
    # bwd AG 160, RS 160, naive Muon AG 160 -> 640 per rank, 1280 total.
    base = plan.baseline_cost
    assert base.per_rank_nbytes == (640, 640)
    assert base.total_nbytes == 1280
    assert base.muon_all_gather_nbytes == 320


def test_golden_a_rank_stats():
    plan = P.compile(build_a(), 2, collectives="broadcast")
    s0, s1 = plan.rank_stats()
    # owned: rank 0 = L0.a 12 + L0.c 9 + L1.b 10 = 31 el = 124 B; resident = params + momentum = 248 B
    assert (s0.owned_numel, s0.owned_nbytes, s0.resident_nbytes) == (31, 124, 248)
    # Z3 peak transient: max over boundaries of (buffer - own subsegments) * 4 B:
    # rank 0: layers.0 80-48 = 32, layers.1 80-32 = 48 -> 48 el = 192 B; rank 1: 80-32=48 / 80-48=32 -> 192 B
    assert s0.peak_transient_nbytes == 192 and s1.peak_transient_nbytes == 192
    # NS FLOPs, 5 steps of 4*m^2*n + 2*m^3 with m=min: a (3,4): 5*(144+54)=990; c (3,3): 5*(108+54)=810;
    # b (5,2): m=2,n=5: 5*(80+16)=480 -> rank 0: 990+810+480 = 2280
    assert s0.ns_flops == 2280
    assert s0.comm_nbytes == 960
    # Z2 peak transient is the sum over boundaries: rank 0: (32 + 48) * 4 = 320
    assert (
        P.compile(build_a(), 2, reshard_after_forward=False, collectives="broadcast")
        .rank_stats()[0]
        .peak_transient_nbytes
        == 320
    )


def _gathered(boundaries, slot: int):
    """``boundaries`` with every buffer all-gathered over slots of ``slot`` elements."""
    return tuple(
        dataclasses.replace(
            b, buffers=tuple(dataclasses.replace(buf, collective="all_gather", slot_numel=slot) for buf in b.buffers)
        )
        for b in boundaries
    )


def test_golden_a_all_gather():
    # Same owners and segments as above; each buffer's slot = round_up(largest segment 48 + 1 step
    # code, 16) = 64 elements. auto: per phase 2 broadcasts of (1 + ceil(log2 2))·8 us = 32 us vs one
    # all-gather of 2·8 us + 64·4 B / 45 GB/s: all-gather.
    for mode in ("auto", "all_gather"):
        plan = P.compile(build_a(), 2, collectives=mode)
        assert {f: plan.owner(f).rank for f in plan.dedicated} == OWNERS_A
        assert plan.boundaries == _gathered(expected_boundaries_a(), 64)
        assert plan.collectives == P.CollectiveSettings(mode=mode)
        # every rank sends / receives (N-1) slots per buffer and phase: 2 buffers x 64 el x 4 B = 512 B
        # per rank and phase, 1024 over the 2 ranks; Z3 three phases: 1536 per rank, 3072 total
        assert plan.cost == ByteCost(
            forward_broadcast_nbytes=1024,
            backward_broadcast_nbytes=1024,
            reduce_nbytes=1024,
            replicate_reduce_nbytes=0,
            replicate_broadcast_nbytes=0,
            total_nbytes=3072,
            per_rank_nbytes=(1536, 1536),
        )
        # transient: the whole gathered tensor, 2 slots x 64 el x 4 B = 512 B (Z3: one boundary)
        assert [r.peak_transient_nbytes for r in plan.rank_stats()] == [512, 512]
    z2 = P.compile(build_a(), 2, reshard_after_forward=False)
    assert (z2.cost.total_nbytes, z2.cost.per_rank_nbytes) == (2048, (1024, 1024))
    assert z2.rank_stats()[0].peak_transient_nbytes == 1024  # Z2: both boundaries resident


# --------------------------------------------------------------------------- model B, HSDP (2, 2)


class BlockB(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.p = nn.Parameter(torch.empty(4, 4))  # 16 elements
        self.q = nn.Parameter(torch.empty(2, 4))  # 8
        self.r = nn.Parameter(torch.empty(2, 2))  # 4


class ModelB(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([BlockB(), BlockB()])


def build_b() -> nn.Module:
    with torch.device("meta"):
        return ModelB()


# Slots 0:(s0,r0) 1:(s1,r0) 2:(s0,r1) 3:(s1,r1). Sorted: b0.p 16, b1.p 16, b0.q 8, b1.q 8, b0.r 4, b1.r 4.
#   b0.p: g=0 e=0                                             -> 0  [16, 0, 0, 0] M=16
#   b1.p: g=1 e=1                                             -> 1  [16,16, 0, 0]
#   b0.q: g=2; b0 used {0}: coord-1 slots 1 (16), 3 (0) -> e=3: 8 <= max(16, 0+16) -> 3 [16,16,0,8]
#   b1.q: g=2; b1 used {1}: coord-0 slots 0 (16), 2 (0) -> e=2 -> 2  [16,16, 8, 8]
#   b0.r: g=2 (tie 2/3 -> lowest); all coords used -> e=g     -> 2  [16,16,12, 8]
#   b1.r: g=3; e=g                                            -> 3  [16,16,12,12]
OWNERS_B = {
    "blocks.0.p": (0, 0),
    "blocks.0.q": (1, 1),
    "blocks.0.r": (0, 1),
    "blocks.1.p": (1, 0),
    "blocks.1.q": (0, 1),
    "blocks.1.r": (1, 1),
}


def test_golden_b_hsdp_owners_layout_cost():
    plan = P.compile(build_b(), (2, 2), collectives="broadcast")
    assert plan.mesh_shape == (2, 2)
    assert {f: (plan.owner(f).shard, plan.owner(f).replicate) for f in plan.dedicated} == OWNERS_B
    for f in plan.dedicated:
        ow = plan.owner(f)
        assert ow.rank == ow.replicate * 2 + ow.shard
    assert plan.owned_numel == (16, 16, 12, 12)
    f32 = "torch.float32"
    # blocks.0: seg s0 = [r0: p @0, flags @16, numel 32 | r1: r @32, flags @48, numel round_up(48+1-32)=32]
    #           seg s1 @64 = [r1: q @64, flags @80, numel round_up(80+1-64)=32]; buffer 96
    b0 = BufferLayout(
        dtype=f32,
        numel=96,
        segments=(
            Segment(
                shard=0,
                offset=0,
                numel=64,
                subsegments=(
                    SubSegment(
                        owner=o(0, 0, 2),
                        offset=0,
                        numel=32,
                        entries=(LayoutEntry(fqn="blocks.0.p", owner=o(0, 0, 2), offset=0, numel=16, shape=(4, 4)),),
                        flags_offset=16,
                    ),
                    SubSegment(
                        owner=o(0, 1, 2),
                        offset=32,
                        numel=32,
                        entries=(LayoutEntry(fqn="blocks.0.r", owner=o(0, 1, 2), offset=32, numel=4, shape=(2, 2)),),
                        flags_offset=48,
                    ),
                ),
            ),
            Segment(
                shard=1,
                offset=64,
                numel=32,
                subsegments=(
                    SubSegment(
                        owner=o(1, 1, 2),
                        offset=64,
                        numel=32,
                        entries=(LayoutEntry(fqn="blocks.0.q", owner=o(1, 1, 2), offset=64, numel=8, shape=(2, 4)),),
                        flags_offset=80,
                    ),
                ),
            ),
        ),
    )
    # blocks.1: seg s0 = [r1: q @0, flags @16, numel 32]; seg s1 @32 = [r0: p @32, flags @48, numel 32 |
    #           r1: r @64, flags @80, numel 32]; buffer 96
    b1 = BufferLayout(
        dtype=f32,
        numel=96,
        segments=(
            Segment(
                shard=0,
                offset=0,
                numel=32,
                subsegments=(
                    SubSegment(
                        owner=o(0, 1, 2),
                        offset=0,
                        numel=32,
                        entries=(LayoutEntry(fqn="blocks.1.q", owner=o(0, 1, 2), offset=0, numel=8, shape=(2, 4)),),
                        flags_offset=16,
                    ),
                ),
            ),
            Segment(
                shard=1,
                offset=32,
                numel=64,
                subsegments=(
                    SubSegment(
                        owner=o(1, 0, 2),
                        offset=32,
                        numel=32,
                        entries=(LayoutEntry(fqn="blocks.1.p", owner=o(1, 0, 2), offset=32, numel=16, shape=(4, 4)),),
                        flags_offset=48,
                    ),
                    SubSegment(
                        owner=o(1, 1, 2),
                        offset=64,
                        numel=32,
                        entries=(LayoutEntry(fqn="blocks.1.r", owner=o(1, 1, 2), offset=64, numel=4, shape=(2, 2)),),
                        flags_offset=80,
                    ),
                ),
            ),
        ),
    )
    assert plan.boundaries == (
        Boundary(fqn="blocks.0", fallback=False, buffers=(b0,)),
        Boundary(fqn="blocks.1", fallback=False, buffers=(b1,)),
    )
    # Segment bytes by shard: s0 = (64 + 32) * 4 = 384, s1 = (32 + 64) * 4 = 384; all = 768.
    # forward = R*(N-1)*768 = 1536; backward 1536; reduce 1536.
    # Subsegments: 6 x 32 el = 192 el = 768 B -> replicate reduce (R-1)*768 = 768, broadcast 768.
    # total = 3*1536 + 2*768 = 6144.
    # Per rank (s, r): broadcasts 2*(768-384) = 768; reduce 384;
    #   replicate (reduce + broadcast): shard-0 subsegment bytes by r: r0 32 el=128 B, r1 64 el=256 B:
    #   rank0 (s0,r0) charged 384-128 = 256 twice = 512; rank2 (s0,r1) 384-256 = 128 twice = 256;
    #   shard 1: r0 32 el (128 B), r1 64 el (256 B): rank1 512, rank3 256.
    #   -> rank0 = 768+384+512 = 1664, rank1 1664, rank2 = 768+384+256 = 1408, rank3 1408.
    assert plan.cost == ByteCost(
        forward_broadcast_nbytes=1536,
        backward_broadcast_nbytes=1536,
        reduce_nbytes=1536,
        replicate_reduce_nbytes=768,
        replicate_broadcast_nbytes=768,
        total_nbytes=6144,
        per_rank_nbytes=(1664, 1664, 1408, 1408),
    )
    # HSDP resident: every (s, r') holds replicas of all params with owner shard s, plus momentum of
    # its own: shard 0 params p0 16 + r0 4 + q1 8 = 28 el; rank0 owns 16 el -> (28+16)*4 = 176 B.
    assert plan.rank_stats()[0].resident_nbytes == 176
    # Z3 peak transient: buffer (96 el) minus the segment of the rank's shard coordinate (owned or
    # replica): shard 0: blocks.0 96-64 = 32, blocks.1 96-32 = 64 -> 64 el = 256 B; shard 1 likewise.
    assert [s.peak_transient_nbytes for s in plan.rank_stats()] == [256, 256, 256, 256]


# --------------------------------------------------------------------------- model C, mixed precision


class BlockC(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(4, 8))  # fp32, 32 elements
        self.w2 = nn.Parameter(torch.empty(2, 8, dtype=torch.bfloat16))  # bf16, 16 elements


class ModelC(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([BlockC()])


def build_c() -> nn.Module:
    with torch.device("meta"):
        return ModelC()


# Owners: w1 (32) -> slot 0; w2 (16): g=1, e=1 -> slot 1.
# Buffers sorted by dtype string: "torch.bfloat16" < "torch.float32".
#   bf16: seg s1 @0: w2 @0, flags @16, numel round_up(17) = 32 -> buffer 32
#   fp32: seg s0 @0: w1 @0, flags @32, numel round_up(33) = 48 -> buffer 48
EXPECTED_C = Boundary(
    fqn="layers.0",
    fallback=False,
    buffers=(
        BufferLayout(
            dtype="torch.bfloat16",
            numel=32,
            segments=(
                Segment(
                    shard=1,
                    offset=0,
                    numel=32,
                    subsegments=(
                        SubSegment(
                            owner=o(1, 0, 2),
                            offset=0,
                            numel=32,
                            entries=(
                                LayoutEntry(fqn="layers.0.w2", owner=o(1, 0, 2), offset=0, numel=16, shape=(2, 8)),
                            ),
                            flags_offset=16,
                        ),
                    ),
                ),
            ),
        ),
        BufferLayout(
            dtype="torch.float32",
            numel=48,
            segments=(
                Segment(
                    shard=0,
                    offset=0,
                    numel=48,
                    subsegments=(
                        SubSegment(
                            owner=o(0, 0, 2),
                            offset=0,
                            numel=48,
                            entries=(
                                LayoutEntry(fqn="layers.0.w1", owner=o(0, 0, 2), offset=0, numel=32, shape=(4, 8)),
                            ),
                            flags_offset=32,
                        ),
                    ),
                ),
            ),
        ),
    ),
)


def _policy_stand_in():
    return types.SimpleNamespace(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def _real_policy():
    fsdp = pytest.importorskip("torch.distributed.fsdp")
    return fsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


@pytest.mark.parametrize("make_policy", [_policy_stand_in, _real_policy], ids=["stand-in", "MixedPrecisionPolicy"])
def test_golden_c_mixed_precision(make_policy):
    plan = P.compile(build_c(), 2, mp_policy=make_policy())
    assert (plan.param_dtype, plan.reduce_dtype) == ("torch.bfloat16", "torch.float32")
    assert plan.boundaries == (EXPECTED_C,)
    assert plan.bcast_dtype("torch.float32") == "torch.bfloat16"
    assert plan.reduce_dtype_for("torch.bfloat16") == "torch.float32"
    # Broadcast in bf16 (param_dtype) for both buffers, reduce in fp32:
    #   forward = (N-1) * (32 + 48) el * 2 B = 160; backward 160; reduce = 80 * 4 = 320; total 640.
    #   rank 0 (owns the fp32 segment) receives the bf16 segment: 32*2 = 64 B per broadcast (x2)
    #     and sends its share of it in the reduce: 32*4 = 128 -> 256.
    #   rank 1 receives the fp32 segment cast to bf16: 48*2 = 96 (x2) and reduces 48*4 = 192 -> 384.
    assert plan.cost == ByteCost(
        forward_broadcast_nbytes=160,
        backward_broadcast_nbytes=160,
        reduce_nbytes=320,
        replicate_reduce_nbytes=0,
        replicate_broadcast_nbytes=0,
        total_nbytes=640,
        per_rank_nbytes=(256, 384),
    )


def test_golden_c_without_mixed_precision_uses_storage_dtypes():
    plan = P.compile(build_c(), 2)
    # forward = 32 el * 2 B (bf16 buffer) + 48 el * 4 B (fp32 buffer) = 256; x3 phases (Z3) = 768
    assert plan.cost.forward_broadcast_nbytes == 256
    assert plan.cost.reduce_nbytes == 256
    assert plan.cost.total_nbytes == 768
    # reduce_dtype alone: reduce in fp32, broadcast in storage dtypes
    plan = P.compile(build_c(), 2, mp_policy=types.SimpleNamespace(param_dtype=None, reduce_dtype="float32"))
    assert plan.cost.reduce_nbytes == 320 and plan.cost.forward_broadcast_nbytes == 256


def test_golden_align_one_packs_tightly():
    # align_numel=1: layers.0 seg s0 = a @0 (12), c @12 (9), flags @21 (2) -> 23; seg s1 = b @23, flags @33 -> 11
    plan = P.compile(build_a(), 2, align_numel=1)
    buf = plan.boundaries[0].buffers[0]
    assert [(e.fqn, e.offset) for e in buf.entries()] == [
        ("layers.0.a.weight", 0),
        ("layers.0.c.weight", 12),
        ("layers.0.b.weight", 23),
    ]
    assert [s.numel for s in buf.segments] == [23, 11]
    assert buf.numel == 34


def test_golden_b_hsdp_all_gather():
    # Model B on (2, 2) with the default collectives ("auto": all-gathers): owners and segments as
    # in the broadcast golden; slots round_up(64 + 1, 16) = 80 (blocks.0: segments 64, 32;
    # blocks.1: 32, 64). Shard phases per rank: 2 buffers x (N-1) x 80 el x 4 B = 640 B per phase,
    # 1920 for Z3's three; the replicate phases stay per sub-segment (768 + 768 B, as broadcast):
    # ranks (s, r0) take part in 512 B of them, ranks (s, r1) 256 B (the golden above's per-rank
    # figures minus their broadcasts: 1664 - 1152, 1408 - 1152).
    plan = P.compile(build_b(), (2, 2))
    assert {f: (plan.owner(f).shard, plan.owner(f).replicate) for f in plan.dedicated} == OWNERS_B
    assert [(buf.collective, buf.slot_numel) for b in plan.boundaries for buf in b.buffers] == [("all_gather", 80)] * 2
    assert plan.cost == ByteCost(
        forward_broadcast_nbytes=2560,
        backward_broadcast_nbytes=2560,
        reduce_nbytes=2560,
        replicate_reduce_nbytes=768,
        replicate_broadcast_nbytes=768,
        total_nbytes=9216,
        per_rank_nbytes=(2432, 2432, 2176, 2176),
    )
    assert [r.peak_transient_nbytes for r in plan.rank_stats()] == [640] * 4  # 2 slots x 80 x 4 B
