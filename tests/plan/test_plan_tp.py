"""Plans with tensor parallelism: hand-computed layouts, bytes and choices; errors.

Pure: TP is described with ``TPPolicy(size=, shard_dims=)`` on an unparallelised model (what
``parallelize_module`` would produce is covered by tests/exec/test_tp.py).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import dmuon
from dmuon.plan import TPPolicy
from dmuon.plan import _rules as C


class Block(nn.Module):
    def __init__(self, d: int = 4, hidden: int = 32):
        super().__init__()
        self.up = nn.Linear(d, hidden, bias=False)  # (32, 4): colwise -> Shard(0)
        self.down = nn.Linear(hidden, d, bias=False)  # (4, 32): rowwise -> Shard(1)
        self.sq = nn.Linear(d, d, bias=False)  # (4, 4)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([Block()])


DIMS = {"layers.0.up.weight": 0, "layers.0.down.weight": 1}


def _plan(*, tp_kw=None, **kw):
    kw.setdefault("predicate", lambda fqn, p: fqn in DIMS)
    kw.setdefault("collectives", "broadcast")  # the goldens below: one broadcast per segment
    return dmuon.plan.compile(Net(), 2, tp=TPPolicy(size=2, shard_dims=DIMS, **(tp_kw or {})), **kw)


def test_golden_tp_plan():
    """N = 2, T = 2, fp32, align 16, Z3, 5 NS steps with a restart every 2 (3 Gram segments).

    Local shards: up (16, 4), down (4, 16): 64 elements each; one per owner, so each segment is
    64 elements + 1 flag, rounded to 80; buffer 160 elements = 640 B per TP coordinate.
    Data-parallel phases per TP coordinate: (N-1)·640 each → ×T = 1280 B each (Z3: three of them).
    TP: Gram side d = 4 for both (the unsplit side): 3 · 2·(2-1)·ceil(16/2)·4 = 192 B per rank
    vs gathering (T-1)·64·4 = 256 B → "gram"; 4 ranks × 192 = 768 B.
    Per global rank: 320 (fwd) + 320 (bwd) + 320 (reduce) + 192 (TP) = 1152.
    """
    plan = _plan()
    assert plan.tp_size == 2 and plan.mesh_shape == (1, 2)
    up, down = plan.param("layers.0.up.weight"), plan.param("layers.0.down.weight")
    assert (up.local_shape, down.local_shape) == ((16, 4), (4, 16))
    assert (up.tp_shard_dim, down.tp_shard_dim, up.tp_ns, down.tp_ns) == (0, 1, "gram", "gram")
    (boundary,) = plan.boundaries
    (buf,) = boundary.buffers
    assert buf.numel == 160 and [s.numel for s in buf.segments] == [80, 80]
    assert [e.shape for s in buf.segments for e in s.subsegments[0].entries] in ([(16, 4), (4, 16)], [(4, 16), (16, 4)])
    c = plan.cost
    assert (c.forward_broadcast_nbytes, c.backward_broadcast_nbytes, c.reduce_nbytes) == (1280, 1280, 1280)
    assert (c.replicate_reduce_nbytes, c.replicate_broadcast_nbytes) == (0, 0)
    assert c.tp_nbytes == 768 and c.total_nbytes == 4608
    assert c.per_rank_nbytes == (1152, 1152, 1152, 1152)
    stats = plan.rank_stats()
    assert [s.rank for s in stats] == [0, 1, 2, 3]
    # Gram NS FLOPs per TP rank, segments of 2, 2, 1 steps: Σ 4·d²·D_local + (8L-6)·d³, d=4, D_local=16
    per_matrix = sum(4 * 16 * 16 + (8 * L - 6) * 64 for L in (2, 2, 1))
    assert per_matrix == 4480
    assert all(s.ns_flops == per_matrix and s.owned_numel == 64 for s in stats)
    assert plan.baseline_cost.per_rank_nbytes.__len__() == 4
    # all-gathered (the default "auto" picks it): slots round_up(80 + 1, 16) = 96 elements, per
    # rank and phase (N-1)·96·4 = 384 B per TP coordinate's row: 3·384 + 192 (TP) = 1344 per rank
    gathered = _plan(collectives="auto")
    assert [(b.collective, b.slot_numel) for b in gathered.boundaries[0].buffers] == [("all_gather", 96)]
    g = gathered.cost
    assert (g.forward_broadcast_nbytes, g.backward_broadcast_nbytes, g.reduce_nbytes, g.tp_nbytes) == (1536,) * 3 + (
        768,
    )
    assert g.per_rank_nbytes == (1344,) * 4
    assert dmuon.plan.ShardingPlan.from_json(plan.to_json()) == plan
    assert "tensor parallel: T=2" in plan.summary()


def test_forced_methods_and_restarts():
    gather = _plan(tp_kw=dict(ns="gather"))
    assert {p.tp_ns for p in gather.params} == {"gather"}
    assert gather.cost.tp_nbytes == 4 * 256  # (T-1) · 64 elements · 4 B per rank
    one_segment = _plan(tp_kw=dict(gram_restart_every=None))  # 1 Gram all-reduce: 64 B per rank
    assert one_segment.cost.tp_nbytes == 4 * 64
    assert one_segment.tp_segment_lengths == (5,)
    assert _plan(tp_kw=dict(ns_steps=4)).tp_segment_lengths == (2, 2)


def test_auto_gathers_square_and_short_side_shards():
    """A square matrix, or one sharded along its short side (Gram side = long side), gathers."""
    plan = dmuon.plan.compile(
        Net(), 2, tp=TPPolicy(size=2, shard_dims={"layers.0.sq.weight": 0, "layers.0.up.weight": 1})
    )
    methods = {p.fqn: p.tp_ns for p in plan.params}
    # up (32, 4) sharded on dim 1 (its short side): Gram side d = 32: 3·2·512·4 = 12288 > 256
    assert methods == {"layers.0.up.weight": "gather", "layers.0.down.weight": None, "layers.0.sq.weight": "gather"}
    assert plan.param("layers.0.down.weight").local_shape == (4, 32)  # no TP: replicated, full


def test_choose_tp_ns_threshold():
    """Gram wins once 3·2·(T-1)·ceil(d²/T)·4 < (T-1)·(m·n/T)·4, i.e. D > 6·d (any T)."""

    def spec(m, n, dim):
        return dmuon.plan.ParamSpec(
            fqn="w",
            shape=(m, n),
            dtype="torch.float32",
            numel=m * n,
            matrix_shape=(m, n),
            num_matrices=1,
            aliases=("w",),
            module_fqn="",
            attr="w",
            tp_size=2,
            tp_shard_dim=dim,
            tp_ns="gram",
        )

    assert C.choose_tp_ns(spec(8, 48, 1), "auto", 3) == "gather"  # D = 6·d: 768 B each, tie -> gather
    assert C.choose_tp_ns(spec(8, 56, 1), "auto", 3) == "gram"  # 768 < 896
    assert C.choose_tp_ns(spec(56, 8, 0), "auto", 3) == "gram"
    assert C.choose_tp_ns(spec(56, 8, 1), "auto", 3) == "gather"  # split along the short side
    assert C.choose_tp_ns(spec(8, 56, 1), "auto", 1) == "gram" and C.choose_tp_ns(spec(8, 56, 1), "auto", 5) == "gather"
    with pytest.raises(ValueError, match="tp_ns must be one of"):
        C.choose_tp_ns(spec(8, 8, 0), "fast", 3)


def test_tp_errors_name_the_parameter_and_fix():
    with pytest.raises(ValueError, match="layers.0.up.weight.*not divisible by the TP degree 3"):
        dmuon.plan.compile(Net(), 2, tp=TPPolicy(size=3, shard_dims={"layers.0.up.weight": 1}))
    with pytest.raises(ValueError, match="'layers.0.nope' , which is not a dedicated|which is not a dedicated"):
        dmuon.plan.compile(Net(), 2, tp=TPPolicy(size=2, shard_dims={"layers.0.nope": 0}))
    with pytest.raises(ValueError, match="must be 0 or 1"):
        dmuon.plan.compile(Net(), 2, tp=TPPolicy(size=2, shard_dims={"layers.0.up.weight": 2}))
    with pytest.raises(ValueError, match="tp_size must be an int"):
        dmuon.plan.compile(Net(), 2, tp=TPPolicy(shard_dims={"layers.0.up.weight": 0}))
    with pytest.raises(ValueError, match="tp_ns must be one of"):
        dmuon.plan.compile(Net(), 2, tp=TPPolicy(ns="fastest"))
    with pytest.raises(ValueError, match="tp_gram_restart_every"):
        dmuon.plan.compile(Net(), 2, tp=TPPolicy(gram_restart_every=0))


def test_plans_without_tp_keep_their_json():
    plan = dmuon.plan.compile(Net(), 2)
    text = plan.to_json()
    assert "tp_" not in text and plan.tp_size == 1 and plan.cost.tp_nbytes == 0
    assert "tp_nbytes" not in plan.cost.to_dict()


def test_snapshot_reads_dtensor_placements_by_duck_typing():
    """The plan never imports torch.distributed: DTensor placements are read as attributes."""
    from dmuon.plan._model.snapshot import _tp_placement

    class Shard:
        def __init__(self, dim):
            self.dim = dim

    class Replicate:
        pass

    class Partial:
        def __repr__(self):
            return "Partial(sum)"

    class Mesh:
        shape = (2,)

    class Fake:
        def __init__(self, placement, ndim=2):
            self.placements = (placement,)
            self.device_mesh = Mesh()
            self.ndim = ndim

    assert _tp_placement(torch.zeros(2)) == (1, None, "")
    assert _tp_placement(Fake(Shard(-1))) == (2, 1, "")
    assert _tp_placement(Fake(Replicate())) == (2, None, "")
    size, dim, why = _tp_placement(Fake(Partial()))
    assert (size, dim) == (2, None) and "Partial(sum)" in why


def test_tp_size_without_shard_dims_is_an_error():
    """``TPPolicy(size=T)`` alone would plan no TP matrix at all: say so instead of dropping TP."""
    with pytest.raises(ValueError, match="tp_size=2 without tp_shard_dims plans no TP-sharded matrix"):
        dmuon.plan.compile(Net(), 2, tp=TPPolicy(size=2))
    assert dmuon.plan.compile(Net(), 2, tp=TPPolicy(size=1)).tp_size == 1


def test_baseline_charges_the_tp_gather_of_naive_muon():
    """N = 2, T = 2, fp32, Z3: the golden plan's up (16, 4) and down (4, 16) local shards.

    FSDP2 shard c = ceil(16/2)·4 = 32 (up), ceil(4/2)·16 = 32 (down): per rank and phase
    (N-1)·c·4 = 128 B per matrix, 256 B for both, in each of forward all-gather, backward
    all-gather, reduce-scatter and the naive grad all-gather: 1024 B. The TP all-gather of the
    full matrix (128 elements) over T = 2 ranks: (T-1)·64·4 = 256 B per matrix, 512 B per rank.
    Per rank 1536 B, 4 ranks: 6144 B, of which 2048 B TP."""
    plan = _plan()
    b = plan.baseline_cost
    assert (b.forward_all_gather_nbytes, b.backward_all_gather_nbytes, b.reduce_scatter_nbytes) == (1024,) * 3
    assert b.muon_all_gather_nbytes == 1024 and b.tp_all_gather_nbytes == 2048
    assert b.per_rank_nbytes == (1536,) * 4 and b.total_nbytes == 6144
    # without TP nothing is charged to it
    assert dmuon.plan.compile(Net(), 2, predicate=lambda fqn, p: fqn in DIMS).baseline_cost.tp_all_gather_nbytes == 0
    summary = plan.summary()
    assert "TP Gram all-reduce / gather" in summary and "without TP traffic" not in summary
    assert "saving vs FSDP2+naive                            25.0%" in summary  # 1 - 4608 / 6144


def test_removed_keywords_name_their_new_form():
    """The keywords grouped into TPPolicy / ExpertPolicy raise TypeError naming the new form,
    before any work (dedicate_params forwards them to compile: no process group needed)."""
    with pytest.raises(TypeError, match=r"tp_size= is now tp=dmuon\.plan\.TPPolicy\(size=\.\.\.\)"):
        dmuon.plan.compile(Net(), 2, tp_size=2)
    with pytest.raises(TypeError, match=r"routers= is now expert_policy=dmuon\.plan\.ExpertPolicy\(routers=\.\.\.\)"):
        dmuon.dedicate_params(Net(), routers="adamw")
