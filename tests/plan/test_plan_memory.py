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
  receives the other block's (Z3: the largest, 192 B); the reduce buffer of a block 192 B.

dmuon, each rank: parameters 128 + 176 = 304; gradients 128 + 176 = 304; momentum 128; AdamW
2 x 176 = 352; transient 192 + 192 + 320 = 704; peak 1,792. NorMuon adds 8 rows x 4 B = 32.
FSDP2 + AdamW: fc shards 4 x 4 el = 64 B each, 128 B; parameters 176 + 128 = 304; gradients 304;
AdamW 2 x 304 = 608; transient: the root unit (320) and its gradient (320) = 640; peak 1,856.
FSDP2 + naive Muon: momentum 128, AdamW 352, transient max(640, 256 + 320) = 640; peak 1,728.

CPU offload (``offload=True``; the terms are the device's, ``host_*`` the host's), each rank:
dmuon: host parameters = its held 48-element segment (fp32, padding and flag included: 192) + the
rest's shards 176 = 368; host gradients 304, momentum 128, AdamW 352 (host 1,152). Device:
parameters = the held segment's broadcast buffer (fp32 wire: 192), transient 704 + the step's
copies of its one matrix (parameter, gradient, momentum: 3 x 128 = 384) = 1,088; peak 1,280.
FSDP2 + AdamW: host 304 + 304 + 608 = 1,216, device the transient 640. FSDP2 + naive Muon: host
304 + 304 + 128 + 352 = 1,088, device 640.
"""

from __future__ import annotations

import re

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


DMUON = MemoryTerms(
    parameters_nbytes=304,
    gradients_nbytes=304,
    momentum_nbytes=128,
    second_moment_nbytes=0,
    adamw_nbytes=352,
    transient_nbytes=704,
)
ADAMW = MemoryTerms(
    parameters_nbytes=304,
    gradients_nbytes=304,
    momentum_nbytes=0,
    second_moment_nbytes=0,
    adamw_nbytes=608,
    transient_nbytes=640,
)
NAIVE = MemoryTerms(
    parameters_nbytes=304,
    gradients_nbytes=304,
    momentum_nbytes=128,
    second_moment_nbytes=0,
    adamw_nbytes=352,
    transient_nbytes=640,
)


def test_memory_terms_by_hand():
    plan = _plan()
    assert plan.dedicated == ("layers.0.fc.weight", "layers.1.fc.weight")
    assert plan.owned_numel == (32, 32)
    stats = plan.rank_stats()
    assert [s.peak_transient_nbytes for s in stats] == [192, 192]
    assert [s.memory for s in stats] == [DMUON, DMUON]
    assert DMUON.peak_nbytes == 1792 and DMUON.optimizer_state_nbytes == 480
    assert [s.memory for s in plan.adamw_rank_stats()] == [ADAMW, ADAMW] and ADAMW.peak_nbytes == 1856
    assert [s.memory for s in plan.baseline_rank_stats()] == [NAIVE, NAIVE] and NAIVE.peak_nbytes == 1728
    adamw = plan.adamw_rank_stats()[0]  # the dedicated matrices' figures under FSDP2 + AdamW
    assert (adamw.owned_numel, adamw.resident_nbytes, adamw.ns_flops) == (32, 3 * 128, 0)
    normuon = plan.rank_stats(variant="normuon")
    assert [s.memory.second_moment_nbytes for s in normuon] == [32, 32]  # (8, 1) fp32 per owned fc
    assert normuon[0].memory.peak_nbytes == 1792 + 32


def test_z2_holds_every_unit_and_buffer():
    """Z2: the packed buffers of both blocks (192: each rank receives one) and every FSDP2 unit
    unsharded (16 + 16 + 320 = 352): transient 192 + 192 + 352 = 736."""
    plan = _plan(reshard_after_forward=False)
    assert {s.memory.transient_nbytes for s in plan.rank_stats()} == {736}


def test_second_moment_shape_is_the_runtime_rule():
    """The runtime's NorMuon state takes its shape from the same function (one rule)."""
    from dmuon.exec._optim import normuon_update

    assert normuon_update.second_moment_shape is second_moment_shape
    assert second_moment_shape((8, 4), matrix_shape=(8, 4)) == (8, 1)
    assert second_moment_shape((8, 4, 3, 3), matrix_shape=(8, 36)) == (8, 1, 1, 1)


def test_ranks_above_and_the_summary():
    terms = (DMUON, ADAMW, NAIVE)
    assert ranks_above(terms, NAIVE) == (0, 1)
    assert ranks_above(terms, ADAMW) == ()
    text = _plan().summary()
    block = text[text.index("memory per rank") :]
    assert re.search(r"peak\s+1\.75 KiB\s+1\.75 KiB\s+1\.81 KiB\s+1\.69 KiB", block), block
    assert "peak: every rank at or below FSDP2 + AdamW's (1.75 KiB vs 1.81 KiB" in block


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
    assert [m.peak_nbytes for m in got] == [1792 + 1000] * 2
    assert got[0].optimizer_state_nbytes == 128 + 352 and got[0].transient_nbytes == 704
    assert memory(plan, wl, "adamw")[0].peak_nbytes == 1856 + 1000
    assert memory(plan, wl, "naive")[0].peak_nbytes == 1728 + 1000


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
    parameters_nbytes=192,
    gradients_nbytes=0,
    momentum_nbytes=0,
    second_moment_nbytes=0,
    adamw_nbytes=0,
    transient_nbytes=1088,
    host_parameters_nbytes=368,
    host_gradients_nbytes=304,
    host_momentum_nbytes=128,
    host_adamw_nbytes=352,
)


def test_offload_terms_by_hand():
    """Device and host apart under CPU offload (module docstring); ``offload=False`` unchanged."""
    plan = _plan()
    assert [s.memory for s in plan.rank_stats(offload=True)] == [DMUON_OFFLOAD] * 2
    assert (DMUON_OFFLOAD.peak_nbytes, DMUON_OFFLOAD.host_nbytes) == (1280, 1152)
    adamw = plan.adamw_rank_stats(offload=True)[0].memory
    assert (adamw.peak_nbytes, adamw.transient_nbytes, adamw.host_nbytes) == (640, 640, 1216)
    assert (adamw.host_parameters_nbytes, adamw.host_gradients_nbytes, adamw.host_adamw_nbytes) == (304, 304, 608)
    naive = plan.baseline_rank_stats(offload=True)[0].memory
    assert (naive.peak_nbytes, naive.host_momentum_nbytes, naive.host_nbytes) == (640, 128, 1088)
    assert [s.memory for s in plan.rank_stats()] == [DMUON] * 2 and DMUON.host_nbytes == 0
    assert plan.adamw_rank_stats()[0].memory == ADAMW and plan.baseline_rank_stats()[0].memory == NAIVE
    block = plan.summary(offload=True)
    block = block[block.index("memory per rank") :]
    assert re.search(r"device peak\s+1\.25 KiB\s+1\.25 KiB\s+640 B\s+640 B", block), block
    assert re.search(r"\nhost\s+1\.12 KiB\s+1\.12 KiB\s+1\.19 KiB\s+1\.06 KiB", block), block
    assert "device peak (both under offload): ABOVE FSDP2 + AdamW's on 2 of 2 ranks" in block


def test_offload_wire_buffers_in_the_broadcast_dtype():
    """Under a bf16 mp_policy the held segment's broadcast buffer is bf16 (48 x 2 = 96 B on the
    device) while the master stays fp32 on the host (192), and the step copies fp32 storage: the
    offloaded transient is the plan's own + 384."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    plan = _plan(mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    on, off = plan.rank_stats(offload=True)[0].memory, plan.rank_stats()[0].memory
    assert (on.parameters_nbytes, on.host_parameters_nbytes) == (96, 192 + 176)
    assert on.transient_nbytes == off.transient_nbytes + 384


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
