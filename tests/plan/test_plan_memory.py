"""Memory per rank, whole model (dmuon/plan/_cost/rank_memory.py): exact bytes on a small plan
computed by hand, for dmuon (Muon and NorMuon), FSDP2 + AdamW and FSDP2 + naive Muon; the
summary's and the page's comparison against FSDP2 + AdamW; the simulator's terms are the plan's.

The model (fp32, N = 2, Z3, align 16): ``embed`` (10, 4) and ``head`` (10, 4) outside any block
(FSDP2's root unit), ``layers.{0,1}.fc.weight`` (8, 4) dedicated, ``layers.{0,1}.norm.weight``
(4,) left to FSDP2 in their block's unit.

By hand:
* owners (equal weights, round robin): layers.0.fc -> rank 0, layers.1.fc -> rank 1; each owns
  32 elements = 128 B.
* FSDP2 shards of the rest on 2 ranks: norm (4,) -> 2 el, embed / head (10, 4) -> 5 x 4 = 20 el;
  per rank 2 + 2 + 20 + 20 = 44 el = 176 B. Units unsharded: layers.0 / layers.1 16 B, root 320 B.
* packed buffer of a block: fc 32 el + 1 flag -> round_up(33, 16) = 48 el = 192 B: each rank
  receives the other block's; the reduce buffer of a block 192 B.

Transient, phase by phase (``step_transient_nbytes``). dmuon, per block on a rank: unsharded =
the received copy (192 on the rank that does not hold it, 0 on its holder) + FSDP2's norm
(16); gradients = fc 128 + norm 16 = 144; reduce = 192 + the norm's reduce-scatter input 16 =
208. The root unit (embed, head): unsharded 320 from the forward on, gradients 320 through the
backward, reduce-scatter input 320. Rank 0 (holds layers.0): forward layers.0 with layers.1
prefetched 16 + 208 = 224; backward layers.1: 208 + 16 (layers.0 prefetched) + 144 = 368, its
reduce 16 + 144 + 208 = 368; layers.0: 16 + 144 + 208 (layers.1's reduce in flight) = 368, its
reduce 144 + 208 = 352; the root's reduce beside layers.0's: 320 + 208 = 528; transient
320 + max(224, 320 + 528) = 1,168. Rank 1: layers.1's reduce with layers.0 prefetched
208 + 144 + 208 = 560 -> 320 + 320 + 560 = 1,200.

dmuon: parameters 128 + 176 = 304; gradients 128 + 176 = 304; momentum 128; AdamW 2 x 176 =
352; peak 1,216 + 1,168 = 2,256 (rank 0), 2,288 (rank 1). NorMuon adds 8 rows x 4 B = 32.
FSDP2 + AdamW: fc shards 4 x 4 el = 64 B each, 128 B; parameters 176 + 128 = 304; gradients 304;
AdamW 2 x 304 = 608; a block unit 36 el = 144 B unsharded, gradients and reduce-scatter input:
backward layers.1 with layers.0 prefetched 144 + 144 + 144 = 432, the root's reduce beside
layers.0's 320 + 144 = 464; transient 320 + 320 + 464 = 1,104; peak 2,320.
FSDP2 + naive Muon: momentum 128, AdamW 352, transient max(1,104, 256 + 320) = 1,104; peak 2,192.

CPU offload (``offload=True``; the terms are the device's, ``host_*`` the host's), each rank:
dmuon: host parameters = its held 48-element segment (fp32, padding and flag included: 192) + the
rest's shards 176 = 368; host gradients 304, momentum 128, AdamW 352 (host 1,152). Device: no
parameters between steps (the held segment's broadcast copy, 192, lives while its block is
unsharded, like a received one: every block 192 + 16 = 208 on both ranks); transient: forward
208 + 208 = 416, backward layers.1 208 + 208 + 144 = 560 -> 320 + 320 + 560 = 1,200, + the
step's copies of its one matrix (parameter, gradient, momentum: 3 x 128 = 384) = 1,584 = the
device peak. FSDP2 + AdamW: host 304 + 304 + 608 = 1,216, device the transient 1,104. FSDP2 +
naive Muon: host 304 + 304 + 128 + 352 = 1,088, device 1,104.
"""

from __future__ import annotations

import re

import pytest

import torch
from torch import nn

import dmuon.plan as P
from dmuon.plan._cost.cost_model import MemoryTerms
from dmuon.plan import MatrixView
from dmuon.plan._cost.rank_memory import ranks_above, second_moment_shape


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 8, bias=False)
        self.norm = nn.RMSNorm(4)


class _Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.layers = nn.ModuleList([_Block(), _Block()])
        self.head = nn.Linear(4, 10, bias=False)


def _plan(**kw):
    with torch.device("meta"):
        model = _Tiny()
    return P.compile(model, 2, **kw)


DMUON0, DMUON1 = (
    MemoryTerms(
        parameters_nbytes=304,
        gradients_nbytes=304,
        momentum_nbytes=128,
        second_moment_nbytes=0,
        adamw_nbytes=352,
        transient_nbytes=t,
    )
    for t in (1168, 1200)
)
ADAMW = MemoryTerms(
    parameters_nbytes=304,
    gradients_nbytes=304,
    momentum_nbytes=0,
    second_moment_nbytes=0,
    adamw_nbytes=608,
    transient_nbytes=1104,
)
NAIVE = MemoryTerms(
    parameters_nbytes=304,
    gradients_nbytes=304,
    momentum_nbytes=128,
    second_moment_nbytes=0,
    adamw_nbytes=352,
    transient_nbytes=1104,
)


def test_memory_terms_by_hand():
    plan = _plan()
    assert plan.dedicated == ("layers.0.fc.weight", "layers.1.fc.weight")
    assert plan.owned_numel == (32, 32)
    stats = plan.rank_stats()
    assert [s.peak_transient_nbytes for s in stats] == [192, 192]
    assert [s.memory for s in stats] == [DMUON0, DMUON1]
    assert (DMUON0.peak_nbytes, DMUON1.peak_nbytes) == (2256, 2288) and DMUON0.optimizer_state_nbytes == 480
    assert [s.memory for s in plan.adamw_rank_stats()] == [ADAMW, ADAMW] and ADAMW.peak_nbytes == 2320
    assert [s.memory for s in plan.baseline_rank_stats()] == [NAIVE, NAIVE] and NAIVE.peak_nbytes == 2192
    adamw = plan.adamw_rank_stats()[0]  # the dedicated matrices' figures under FSDP2 + AdamW
    assert (adamw.owned_numel, adamw.resident_nbytes, adamw.ns_flops) == (32, 3 * 128, 0)
    normuon = plan.rank_stats(variant="normuon")
    assert [s.memory.second_moment_nbytes for s in normuon] == [32, 32]  # (8, 1) fp32 per owned fc
    assert normuon[0].memory.peak_nbytes == 2256 + 32


@pytest.mark.parametrize(
    "case", ["tiny-llama/4", "tiny-llama/4 all_gather", "tiny-moe/2x2", "tiny-moe/4 broadcast", "tiny-moe/4 ep2"]
)
def test_received_bytes_from_the_layout_are_the_schedules(case):
    """The transient reads each rank's received bytes per boundary from the layout
    (``boundary_received_nbytes``, no pass over the op table); the schedule's forward broadcasts
    and all-gathers are the oracle, every schedule rank and boundary."""
    import warnings

    from dmuon.plan._cost.rank_memory import boundary_received_nbytes, received_nbytes
    from dmuon.plan._model.parallel import expert_parallel_variant
    from dmuon.sim import zoo

    name, _, rest = case.partition("/")
    mesh_s, _, extra = rest.partition(" ")
    mesh = tuple(int(x) for x in mesh_s.split("x")) if "x" in mesh_s else int(mesh_s)
    model, kw = zoo.PRESETS[name](), {}
    if extra == "ep2":
        model, kw = expert_parallel_variant(model, 2), {"ep": 2}
    elif extra:
        kw = {"collectives": extra}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = P.compile(model, mesh, **kw)
    N = plan.mesh_shape[1]
    n = len(plan.rank_stats())
    from_sched = received_nbytes(plan.schedule(), n)
    from_layout = boundary_received_nbytes(plan)
    assert any(any(row) for row in from_layout.values()), case
    for b in plan.boundaries:
        want = from_sched.get(b.fqn, [0] * n)
        assert [from_layout[b.fqn][x % N] for x in range(n)] == want, (case, b.fqn)


def test_z2_holds_every_unit_until_its_reduce():
    """Z2: both blocks stay unsharded from the forward to their reduce. Rank 1 (receives
    layers.0: 208 with its norm, holds layers.1: 16): forward end 224; layers.1's backward 224 +
    144 = 368, its reduce (layers.0 still unsharded) 208 + 144 + 208 = 560; layers.0's backward
    with layers.1's reduce in flight 208 + 144 + 208 = 560: transient 320 + 320 + 560 = 1,200, as
    Z3 with its prefetch on two blocks. Rank 0: 16 + 144 + 208 = 368 at most, the root's reduce
    528: 1,168. A third block tells them apart (test below)."""
    plan = _plan(reshard_after_forward=False)
    assert [s.memory.transient_nbytes for s in plan.rank_stats()] == [1168, 1200]


def test_step_transient_by_phase():
    """``step_transient_nbytes`` on three units (unsharded, assembled, grad, reduce, kept) by
    hand; root (100, 10, 1). Z3 with forward prefetch: forward max(5+1+7, 7+0+9, 9) = 16;
    backward unit 2: 9 + 7 + 3 = 19, its reduce 7 + 3 + 4 = 14; unit 1: 7 + 5 + 2 + 4 = 18,
    reduce 5 + 2 + 4 = 11; unit 0: 5 + 1 + 1 + 4 = 11, reduce 1 + 4 = 5; root's reduce 1 + 4 =
    5 -> 100 + max(16, 10 + 19) = 129. Z2: forward 22; unit 2: 22 + 3 = 25, its reduce 13 + 3 +
    4 = 20; unit 1: 13 + 2 + 4 = 19 -> 100 + 10 + 25 = 135. HSDP kept bytes add after a retire:
    kept 1 on each unit, Z3: unit 1's reduce 5 + 2 + 4 + 1 (unit 2's kept) = 12; unit 0's
    backward 5 + 1 + 1 + 4 + 1 = 12 -> still 129."""
    from dmuon.plan._cost.rank_memory import step_transient_nbytes

    units = [(5, 1, 1, 4, 0), (7, 0, 2, 4, 0), (9, 0, 3, 4, 0)]
    root = (100, 10, 1)
    assert step_transient_nbytes(units, root, reshard_after_forward=True, forward_prefetch=True) == 129
    assert step_transient_nbytes(units, root, reshard_after_forward=False, forward_prefetch=True) == 135
    assert step_transient_nbytes(units, root, reshard_after_forward=True, forward_prefetch=False) == 129
    kept = [u[:4] + (1,) for u in units]
    assert step_transient_nbytes(kept, root, reshard_after_forward=True, forward_prefetch=True) == 129
    assert step_transient_nbytes([], root, reshard_after_forward=True, forward_prefetch=True) == 111


def test_step_transient_with_accumulated_gradients():
    """Micro-batches without sync, one reduce after the last (``accumulate=True``), the units of
    the test above: every gradient held (1 + 2 + 3 = 6) beside the root's. Z3: the most unsharded
    while one unit computes with the one before it prefetched, max(5 + 1, 7 + 5, 9 + 7) = 16; the
    reduce after the last backward, two units' buffers 4 + 4 = 8 -> 100 + 10 + 6 + 16 = 132;
    with 3 bytes kept unsharded after their backward (FSDP2's units under a pipeline schedule)
    16 + 3 = 19 -> 135. Z2: every unit unsharded to the reduce, 22, and at it 22 + 8 = 30 ->
    146."""
    from dmuon.plan._cost.rank_memory import step_transient_nbytes

    units = [(5, 1, 1, 4, 0), (7, 0, 2, 4, 0), (9, 0, 3, 4, 0)]
    kw = dict(forward_prefetch=True, accumulate=True)
    assert step_transient_nbytes(units, (100, 10, 1), reshard_after_forward=True, **kw) == 132
    assert step_transient_nbytes(units, (100, 10, 1), reshard_after_forward=True, kept_after_backward=3, **kw) == 135
    assert step_transient_nbytes(units, (100, 10, 1), reshard_after_forward=False, **kw) == 146


def test_accumulated_gradients_by_hand():
    """The small plan with micro-batches accumulated (fp32, Z3), rank 1: blocks (208 unsharded on
    the rank that receives layers.0, 16 for layers.1), gradients 144 each held to the reduce,
    reduce buffers 208 each; FSDP2's norms (16 + 16) kept unsharded after their backward. Every
    gradient 288 + the root's 320; the most unsharded: layers.1 computing with layers.0
    prefetched 16 + 208 = 224, + 32 = 256; the reduce: 32 + 208 + 208 = 448; the root's reduce
    beside layers.0's 320 + 208 = 528 -> 320 + 320 + 288 + 528 = 1,456 (rank 0 alike). FSDP2 + AdamW (every unit kept unsharded, 144 each): 288 + 320 gradients, units
    288 and at the reduce 288 + 144 + 144 = 576 -> 320 + 320 + 288 + 576 = 1,504."""
    from dmuon.plan._cost.rank_memory import dmuon_memory, fsdp2_memory

    plan = _plan()
    got = dmuon_memory(plan, plan.rank_stats(), accumulate=True)
    assert [t.transient_nbytes for t in got] == [1456, 1456]
    assert fsdp2_memory(plan, "adamw", accumulate=True).transient_nbytes == 1504


def test_second_moment_shape_is_the_runtime_rule():
    """The runtime's NorMuon state takes its shape from the same function (one rule)."""
    from dmuon.exec._optim import normuon_update

    assert normuon_update.second_moment_shape is second_moment_shape
    assert second_moment_shape((8, 4), matrix_shape=(8, 4)) == (8, 1)
    assert second_moment_shape((8, 4, 3, 3), matrix_shape=(8, 36)) == (8, 1, 1, 1)


def test_ranks_above_and_the_summary():
    terms = (DMUON0, ADAMW, NAIVE)
    assert ranks_above(terms, NAIVE) == (0, 1)
    assert ranks_above(terms, ADAMW) == ()
    text = _plan().summary()
    block = text[text.index("memory per rank") :]
    assert re.search(r"peak\s+2\.23 KiB\s+2\.22 KiB\s+2\.27 KiB\s+2\.14 KiB", block), block
    assert "peak: every rank at or below FSDP2 + AdamW's (2.23 KiB vs 2.27 KiB" in block


def test_summary_and_page_flag_ranks_above_adamw():
    """A plan whose busiest rank peaks above FSDP2 + AdamW: the summary names the ranks and the
    gap by term, the page carries the same figures (Qwen3-30B-A3B on 64 ranks: the assembled
    expert stacks and the fp32 reduce buffer outweigh AdamW's second moment)."""
    from dmuon.sim import zoo

    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = P.compile(zoo.PRESETS["qwen3-30b-a3b"](), 64)
    text = plan.summary()
    assert "peak: ABOVE FSDP2 + AdamW's on 64 of 64 ranks" in text and "gap by term: " in text
    page = plan.to_html()
    peaks = [int(x) for x in re.search(r'data-peak-nbytes="([0-9 ]+)"', page).group(1).split()]
    ref = int(re.search(r'data-adamw-peak-nbytes="([0-9]+)"', page).group(1))
    assert peaks == [s.memory.peak_nbytes for s in plan.rank_stats()]
    assert ref == plan.adamw_rank_stats()[0].memory.peak_nbytes
    assert re.search(r'data-ranks-above-adamw="([0-9 ]*)"', page).group(1) == " ".join(map(str, range(64)))


def test_simulator_memory_is_the_plans_terms_plus_activations():
    from types import SimpleNamespace

    from dmuon.sim._engine.sim_memory import memory

    plan = _plan()
    wl = SimpleNamespace(activation_nbytes=1000, recompute_transient_nbytes=0)  # memory() reads only these
    got = memory(plan, wl, "z3")
    assert [m.peak_nbytes for m in got] == [2256 + 1000, 2288 + 1000]
    assert got[0].optimizer_state_nbytes == 128 + 352 and got[0].transient_nbytes == 1168
    assert memory(plan, wl, "adamw")[0].peak_nbytes == 2320 + 1000
    assert memory(plan, wl, "naive")[0].peak_nbytes == 2192 + 1000


def test_reduce_buffers_by_hand_on_hsdp():
    """HSDP (2, 2): the fc matrices go to ranks 0 and 1 (shards 0 and 1 of row 0); each block's
    buffer is one 48-element segment (192 B fp32) on its owner's shard. Backward order layers.1,
    layers.0. Shard 0 sends layers.1's (192), then holds layers.0's (192): 192. Shard 1 holds
    layers.1's (192, kept to the end of the backward: the replicate reduce reads it), then sends
    layers.0's (192) beside it: 384. On one row the held buffer is retired too: 192 each."""
    from dmuon.plan._cost.rank_memory import reduce_buffer_nbytes

    assert reduce_buffer_nbytes(_plan()) == (192, 192)
    with torch.device("meta"):
        model = _Tiny()
    plan = P.compile(model, (2, 2))
    assert [plan.owner(f).rank for f in plan.dedicated] == [0, 1]
    assert reduce_buffer_nbytes(plan) == (192, 384, 192, 384)


DMUON_OFFLOAD = MemoryTerms(
    parameters_nbytes=0,
    gradients_nbytes=0,
    momentum_nbytes=0,
    second_moment_nbytes=0,
    adamw_nbytes=0,
    transient_nbytes=1584,
    host_parameters_nbytes=368,
    host_gradients_nbytes=304,
    host_momentum_nbytes=128,
    host_adamw_nbytes=352,
)


def test_offload_terms_by_hand():
    """Device and host apart under CPU offload (module docstring); ``offload=False`` unchanged."""
    plan = _plan()
    assert [s.memory for s in plan.rank_stats(offload=True)] == [DMUON_OFFLOAD] * 2
    assert (DMUON_OFFLOAD.peak_nbytes, DMUON_OFFLOAD.host_nbytes) == (1584, 1152)
    adamw = plan.adamw_rank_stats(offload=True)[0].memory
    assert (adamw.peak_nbytes, adamw.transient_nbytes, adamw.host_nbytes) == (1104, 1104, 1216)
    assert (adamw.host_parameters_nbytes, adamw.host_gradients_nbytes, adamw.host_adamw_nbytes) == (304, 304, 608)
    naive = plan.baseline_rank_stats(offload=True)[0].memory
    assert (naive.peak_nbytes, naive.host_momentum_nbytes, naive.host_nbytes) == (1104, 128, 1088)
    assert [s.memory for s in plan.rank_stats()] == [DMUON0, DMUON1] and DMUON0.host_nbytes == 0
    assert plan.adamw_rank_stats()[0].memory == ADAMW and plan.baseline_rank_stats()[0].memory == NAIVE
    block = plan.summary(offload=True)
    block = block[block.index("memory per rank") :]
    assert re.search(r"device peak\s+1\.55 KiB\s+1\.55 KiB\s+1\.08 KiB\s+1\.08 KiB", block), block
    assert re.search(r"\nhost\s+1\.12 KiB\s+1\.12 KiB\s+1\.19 KiB\s+1\.06 KiB", block), block
    assert "device peak (both under offload): ABOVE FSDP2 + AdamW's on 2 of 2 ranks" in block


def test_offload_wire_buffers_in_the_broadcast_dtype():
    """Under a bf16 mp_policy the held segment's broadcast copy is bf16 (48 x 2 = 96 B, on the
    device while its block is unsharded, with or without offload) while the master stays fp32
    (on the host under offload: 192), and the step copies fp32 storage: the offloaded transient
    is the plan's own + 384. Rank 0 without offload (reduce dtype = param dtype, bf16, as FSDP2
    defaults): layers.0 = its copy 96 + norm 8 = 104, layers.1 = received 96 + 8 = 104;
    gradients 64 + 8 = 72, reduce 96 + 8 = 104; root 160 unsharded, gradients and reduce:
    backward layers.1 104 + 104 + 72 = 280, its reduce 104 + 72 + 104 = 280, the root's reduce
    160 + 104 = 264 -> 160 + 160 + 280 = 600."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    plan = _plan(mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    on, off = plan.rank_stats(offload=True)[0].memory, plan.rank_stats()[0].memory
    assert (on.parameters_nbytes, on.host_parameters_nbytes) == (0, 192 + 176)
    assert on.transient_nbytes == off.transient_nbytes + 384 and off.transient_nbytes == 600


class _Shapes(nn.Module):
    """Three blocks whose matrices fall in three NS buckets: (8, 4), (16, 4), (8, 8)."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(i, o, bias=False) for o, i in ((8, 4), (16, 4), (8, 8)))


def test_offload_step_copies_two_runs_at_a_time(monkeypatch):
    """One rank owns everything (N = 1), fp32. Three NS buckets, one run each: 3 x 32 x 4 = 384,
    3 x 64 x 4 = 768 and 768 B; two consecutive runs at a time: 768 + 768 = 1,536. With a (4, 16)
    third matrix, the (16, 4) one's bucket: runs of 384 and 2 x 768 = 1,536 (one batched run),
    together 1,920; with runs cut at 64 elements, three runs again: 1,536."""
    from dmuon.plan import _rules
    from dmuon.plan._cost.rank_memory import OFFLOAD_RUNS_IN_FLIGHT, staged_run_nbytes

    assert OFFLOAD_RUNS_IN_FLIGHT == 2
    with torch.device("meta"):
        model = _Shapes()
    pred = lambda fqn, p: p.ndim == 2  # noqa: E731
    plan = P.compile(model, 1, predicate=pred, hook_boundary_strict=False)
    assert staged_run_nbytes(plan) == (768 + 768,)
    with torch.device("meta"):
        model = _Shapes()
        model.layers[2] = nn.Linear(16, 4, bias=False)  # (4, 16): the (16, 4) matrix's bucket
    plan = P.compile(model, 1, predicate=pred, hook_boundary_strict=False)
    assert staged_run_nbytes(plan) == (384 + 2 * 768,)  # runs: (8, 4) alone, then both (4, 16)-sided
    monkeypatch.setattr(_rules, "NS_BATCH_MAX_NUMEL", 64)  # each 64-element matrix a run of its own
    assert staged_run_nbytes(plan) == (768 + 768,)
    # a matrix view: each block copies its parameter block and its update block (the momentum ran on
    # the host), 2 x 32 x 4 = 256 B each; the (16, 4) matrix as two (8, 4) blocks joins layers.0's
    # bucket: runs of 384 + 256 + 256 = 896 (96 elements) and of the (8, 8) matrix, 768
    monkeypatch.undo()
    with torch.device("meta"):
        model = _Shapes()
    views = {"layers.1.weight": MatrixView(dim=0, sizes=(8, 8))}
    plan = P.compile(model, 1, predicate=pred, hook_boundary_strict=False, matrix_views=views)
    assert staged_run_nbytes(plan) == (896 + 768,)


class _ExpertBlock(nn.Module):
    """A stack of 4 SwiGLU experts (w1, w3: (4, 8, 4); w2: (4, 4, 8); one expert's matrix: 32
    elements, all three in the (4, 8) NS bucket) and an (8, 4) matrix of the same bucket after it."""

    def __init__(self):
        super().__init__()
        from dmuon._zoo.moe import Experts

        self.experts = Experts(4, 4, 8)
        self.out = nn.Linear(4, 8, bias=False)


def test_offload_step_copies_expert_ranges_in_runs_of_whole_experts(monkeypatch):
    """fp32, 12 B copied per element (parameter, gradient, momentum), runs cut at 100 elements: an
    expert stack (or owned range) above the cap runs in pieces of whole experts, 3 experts (96
    elements) per piece. N = 1: w1, w2, w3 (128 each) and the (8, 4) matrix (32) run as 96 | 32 |
    96 | 32 | 96 | 32 + 32: the most of two consecutive runs is 96 + 64 = 160 elements = 1,920 B
    (whole stacks, never cut: 128 + 128 = 3,072 B; without the cap, one run of 416: 4,992 B). N = 2
    (rank 0 owns w1, w2's experts 0-1 and the matrix; rank 1 w2's experts 2-3 and w3): rank 0 96 |
    32 + 64 | 32: 192 elements = 2,304 B; rank 1 64 | 96 | 32: 160 = 1,920 B."""
    from dmuon.plan import _rules
    from dmuon.plan._cost.rank_memory import staged_run_nbytes
    from dmuon.plan._records.owners import ExpertOwners

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList([_ExpertBlock()])

    with torch.device("meta"):
        model = Model()
    one, two = P.compile(model, 1), P.compile(model, 2)
    assert staged_run_nbytes(one) == (416 * 12,)
    owners = dict(zip(two.dedicated, two.owners))
    assert [owners[f].rank for f in ("layers.0.experts.w1", "layers.0.out.weight", "layers.0.experts.w3")] == [0, 0, 1]
    w2 = owners["layers.0.experts.w2"]
    assert isinstance(w2, ExpertOwners) and [m.rank for m in w2.members] == [0, 1] and w2.sizes == (2, 2)
    monkeypatch.setattr(_rules, "NS_BATCH_MAX_NUMEL", 100)
    assert staged_run_nbytes(one) == (1920,)
    assert staged_run_nbytes(two) == (2304, 1920)


def test_offload_refusals_and_the_runtime_rule(monkeypatch):
    """NorMuon on offloaded matrices is refused as dmuon.Muon refuses it; owner groups as
    dedicate_params refuses them, by the same function."""
    import pytest

    from dmuon.exec._setup import api
    from dmuon.plan._cost import rank_memory

    with pytest.raises(ValueError, match="variant='normuon' with offload"):
        _plan().rank_stats(variant="normuon", offload=True)
    grouped = _plan(owner_groups=2)
    with pytest.raises(NotImplementedError, match="owner-grouped matrices .* is not supported yet"):
        grouped.rank_stats(offload=True)
    seen = []
    monkeypatch.setattr(rank_memory, "check_offloadable", seen.append)
    api._check_offloadable(grouped)
    assert seen == [grouped]


def test_simulate_offload_lines_add_the_activations_to_the_device_peak(capsys):
    """``simulate --offload``: each variant's busiest device peak under offload + the activations
    (on the device), and its host memory: here 1 GiB of activations, so dmuon's 1,280 B device
    peak and FSDP2 + AdamW's 640 B print as 1.00 GiB; the CLI prints the block."""
    from types import SimpleNamespace

    from dmuon._cli.sim_commands import main_simulate, offload_lines

    plan = _plan()
    wl = SimpleNamespace(activation_nbytes=2**30 - 1280, recompute_transient_nbytes=0)
    lines = offload_lines({"adamw": plan, "z3": plan}, wl)
    assert lines[-2:] == [f"{'adamw':<12}{0:>6}{'1.00':>14}{'0.00':>10}", f"{'z3':<12}{0:>6}{'1.00':>14}{'0.00':>10}"]
    argv = ["--model", "tiny-llama", "--mesh", "2", "--hw", "h100", "--tokens-per-rank", "1024", "--mode", "z3"]
    assert main_simulate([*argv, "--offload"]) == 0
    out = capsys.readouterr().out
    assert "under CPU offload (memory only" in out and "\nz3 " in out.split("under CPU offload")[1]


def test_muon_step_temporaries_by_hand():
    """The optimizer step's Newton-Schulz temporaries (``muon_step_nbytes``, bf16 NS, fp32
    storage). The small plan: each rank's one (8, 4) matrix, E = 32, sides (4, 8): during NS
    2·32·4 + 2·32·2 + 2·32·2·4/8 = 448, cast back 3·32·4 + 32·2 = 448 -> 448, below the
    backward's 1,168, so the transient is unchanged. Two (16, 4) matrices in one run on one
    rank, E = 128, sides (4, 16): during 1,024 + 512 + 128 = 1,664, cast back 1,536 + 256 =
    1,792 -> 1,792. (Measured on CPU, benchmarks/measured_memory.py's MoE model: 84 MiB by this
    rule for a run of 48 (256, 512) fp32 matrices, 86 MiB live at the step's peak.)"""
    from dmuon.plan._cost.rank_memory import muon_step_nbytes

    assert muon_step_nbytes(_plan()) == (448, 448)

    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(
                [nn.ModuleDict({"a": nn.Linear(4, 16, bias=False), "b": nn.Linear(4, 16, bias=False)})]
            )

    with torch.device("meta"):
        model = Two()
    plan = P.compile(model, 1)
    assert len(plan.dedicated) == 2
    assert muon_step_nbytes(plan) == (1792,)
    assert plan.rank_stats()[0].memory.transient_nbytes >= 1792
