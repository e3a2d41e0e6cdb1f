"""The collective of each buffer (pure, no process group): the plan's settings and their
JSON (``dmuon.plan/2``, version-1 plans read as broadcast with their bytes and fingerprints), the
alpha-beta rule of ``collectives="auto"`` against hand-computed figures, forced modes, the slot
layout, the collectives per step of an all-gathered buffer, and the planner's constants against
the simulator preset they were copied from. Goldens of both kinds: tests/plan/test_plan_golden.py,
tests/plan/test_schedule.py, tests/plan/test_moe_plan.py."""

from __future__ import annotations

import json
import pathlib
import warnings
from collections import Counter

import pytest
import torch
import torch.nn as nn

import dmuon.plan as P
from dmuon.plan import _rules as rules
from dmuon.plan._cost.seconds import all_gather_call_s, broadcast_call_s, buffer_collective_s
from dmuon.plan._layout.collective_rule import choose_collective
from dmuon.plan._records.plan_json import JSON_FORMAT, JSON_FORMAT_V1, JSON_FORMAT_V2
from test_moe_plan import grouped_meta
from test_plan_golden import build_a, build_b

DATA = pathlib.Path(__file__).parents[1] / "data"
# fingerprints of the version-1 fixtures, as the code before per-buffer collectives computed them
V1_FIXTURES = {
    "plan_v1_model_a_n2.json": "56f6f2dfb127030d81579da21f06e448be457c528f7795eab81e08076e844e6e",
    "plan_v1_grouped_experts_n4.json": "801816d9e81ef15913609ad0727e42cf3955eafdfa45a980d4d4a6b61e5fe1e8",
}


@pytest.mark.parametrize("name", sorted(V1_FIXTURES))
def test_version_1_plan_loads_as_broadcast_and_keeps_its_bytes(name):
    """A plan saved before the collective choice existed (format dmuon.plan/1, no "collectives"):
    every buffer broadcast, the default settings, and re-dumped byte for byte (same fingerprint:
    ranks comparing it at apply time, or a saved fingerprint, still agree)."""
    text = (DATA / name).read_text()
    old = json.loads(text)
    assert old["format"] == JSON_FORMAT_V1 and "collectives" not in old
    plan = P.ShardingPlan.from_json(text)
    assert plan.collectives == P.CollectiveSettings() and plan.collectives.mode == "broadcast"
    assert {buf.collective for b in plan.boundaries for buf in b.buffers} == {"broadcast"}
    assert plan.to_json() == json.dumps(old, separators=(",", ":"), ensure_ascii=True)
    assert plan.fingerprint() == V1_FIXTURES[name]
    # the runtime's view of it: one broadcast per segment, one reduce per segment
    kinds = Counter(op.kind for op in plan.schedule().ops if op.collective)
    assert set(kinds) == {"broadcast", "reduce"}


def test_json_format_2_round_trip_and_fingerprint():
    auto = P.compile(build_a(), 2)
    d = json.loads(auto.to_json())
    assert d["format"] == JSON_FORMAT_V2 == "dmuon.plan/2"  # the nccl record's form needs nothing of version 3
    assert d["collectives"] == {"mode": "auto", "latency_s": 8e-06, "bandwidth_Bps": 45000000000.0}
    assert [buf["collective"] for b in d["boundaries"] for buf in b["buffers"]] == ["all_gather"] * 2
    assert P.ShardingPlan.from_json(auto.to_json()) == auto
    # a forced broadcast plan with the default numbers needs nothing of version 2: written as version 1
    bc = P.compile(build_a(), 2, collectives="broadcast")
    assert json.loads(bc.to_json())["format"] == JSON_FORMAT_V1 and "collectives" not in bc.to_json()
    assert P.ShardingPlan.from_json(bc.to_json()) == bc
    # the settings are in the fingerprint: other alpha / B, same choice, other fingerprint
    slow = P.compile(build_a(), 2, collective_latency_s=9e-6)
    assert slow.boundaries == auto.boundaries and slow.fingerprint() != auto.fingerprint()
    assert json.loads(slow.to_json())["collectives"]["latency_s"] == 9e-6
    assert slow.collectives.link == "custom" and json.loads(slow.to_json())["format"] == JSON_FORMAT == "dmuon.plan/3"
    # a version-1 plan cannot carry the settings; unknown formats are refused
    d1 = dict(d, format=JSON_FORMAT_V1)
    with pytest.raises(ValueError, match="has no 'collectives'"):
        P.ShardingPlan.from_dict(d1)
    with pytest.raises(ValueError, match="known format"):
        P.ShardingPlan.from_dict(dict(d, format="dmuon.plan/9"))


def test_settings_and_buffer_validation():
    with pytest.raises(ValueError, match="collectives must be one of"):
        P.compile(build_a(), 2, collectives="all-gather")
    with pytest.raises(ValueError, match="bandwidth_Bps must be a finite number > 0"):
        P.compile(build_a(), 2, collective_bandwidth_Bps=0)
    with pytest.raises(ValueError, match="latency_s must be a finite number >= 0"):
        P.CollectiveSettings(latency_s=float("nan"))
    auto = P.compile(build_a(), 2)
    d = json.loads(auto.to_json())
    d["collectives"]["mode"] = "broadcast"  # buffers all-gathered under a forced broadcast: refused
    with pytest.raises(ValueError, match="under collectives='broadcast'"):
        P.ShardingPlan.from_dict(d)
    d = json.loads(auto.to_json())
    d["boundaries"][0]["buffers"][0]["slot_numel"] = 48  # no room for the 48-element segment + code
    with pytest.raises(ValueError, match="leaves no room"):
        P.ShardingPlan.from_dict(d)
    d["boundaries"][0]["buffers"][0]["slot_numel"] = 80  # room, but not the rule's round_up(48 + 1, 16)
    with pytest.raises(ValueError, match="expected 64"):
        P.ShardingPlan.from_dict(d)
    # one rank per group: nothing moves, every mode keeps broadcast (no op at all)
    one = P.compile(build_a(), 1, collectives="all_gather")
    assert {buf.collective for b in one.boundaries for buf in b.buffers} == {"broadcast"}
    hsdp = P.compile(build_b(), (2, 1), collectives="all_gather")
    assert {buf.collective for b in hsdp.boundaries for buf in b.buffers} == {"broadcast"}


def test_constants_are_the_simulator_preset():
    """The auto rule's defaults are COPIED from the simulator's h100 inter-node link (dmuon.plan never
    imports dmuon.sim)."""
    from dmuon.sim._engine.hardware import PRESETS

    link = PRESETS["h100"].inter
    assert rules.COLLECTIVE_LATENCY_S == link.latency_s
    assert rules.COLLECTIVE_BANDWIDTH_BPS == pytest.approx(link.bandwidth_Bps, rel=1e-12)


def test_auto_rule_by_hand():
    """alpha = 8 us, B = 45 GB/s. Model A, layers.0 on N = 2 (segments 48 and 32 fp32 elements, slot 64):
    broadcast per phase 2 x ((1 + 1) x 8 us) + (48 + 32) x 4 B / B; all-gather 2 x 8 us + 1 x 64 x 4 B / B."""
    a, B = 8e-6, 45e9
    assert broadcast_call_s(192, 2, a, B) == pytest.approx(2 * a + 192 / B)
    assert broadcast_call_s(192, 64, a, B) == pytest.approx(7 * a + 192 / B)  # 1 + ceil(log2 64) = 7 steps
    assert all_gather_call_s(256, 64, a, B) == pytest.approx(64 * a + 63 * 256 / B)
    assert broadcast_call_s(10, 1, a, B) == all_gather_call_s(10, 1, a, B) == 0.0
    buf = P.compile(build_a(), 2, collectives="broadcast").boundaries[0].buffers[0]
    kw = dict(num_shards=2, slot_numel=64, wire_itemsize=4, reduce_itemsize=4, latency_s=a, bandwidth_Bps=B)
    t_b = buffer_collective_s(buf, "broadcast", reshard_after_forward=True, **kw)
    t_a = buffer_collective_s(buf, "all_gather", reshard_after_forward=True, **kw)
    assert t_b == pytest.approx(3 * (2 * (2 * a) + 80 * 4 / B))
    assert t_a == pytest.approx(3 * (2 * a + 64 * 4 / B))
    assert buffer_collective_s(buf, "all_gather", reshard_after_forward=False, **kw) == pytest.approx(
        2 * (2 * a + 256 / B)
    )
    choice = choose_collective(
        buf,
        P.CollectiveSettings(mode="auto"),
        num_shards=2,
        align_numel=16,
        wire_itemsize=4,
        reduce_itemsize=4,
        reshard_after_forward=True,
    )
    assert (choice.kind, choice.slot_numel, choice.group_size) == ("all_gather", 64, 2)
    # bytes only (alpha = 0): a rank receives (N-1) x 64 = 64 elements from the all-gather, 80 from
    # the two broadcasts (a pipelined broadcast takes S / B whatever k): still the all-gather
    bytes_only = P.CollectiveSettings(mode="auto", latency_s=0.0, bandwidth_Bps=1.0)
    assert (
        choose_collective(
            buf,
            bytes_only,
            num_shards=2,
            align_numel=16,
            wire_itemsize=4,
            reduce_itemsize=4,
            reshard_after_forward=True,
        ).kind
        == "all_gather"
    )
    # a buffer of one segment stays broadcast: test_a_buffer_with_one_segment_stays_broadcast


class _OneOwner(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(64, 64, bias=False) for _ in range(3))


def test_a_buffer_with_one_segment_stays_broadcast():
    """One owner per boundary: one broadcast of S vs an all-gather of N slots >= S + 1: broadcast (auto)."""
    with torch.device("meta"):
        model = _OneOwner()
    for N in (2, 4, 8):
        plan = P.compile(model, N)
        assert {buf.collective for b in plan.boundaries for buf in b.buffers} == {"broadcast"}, N


@pytest.mark.parametrize("mesh", [2, 3, 4, (2, 2), (2, 3)])
@pytest.mark.parametrize("z3", [True, False])
def test_at_most_three_collectives_per_all_gathered_buffer(mesh, z3):
    """Where a buffer is all-gathered, each rank issues at most 3 of its collectives per step (forward,
    Z3 backward, reduce-scatter), plus HSDP's replicate phases (per sub-segment, unchanged)."""
    for model in (build_a(), grouped_meta(5, n_layers=2)):
        plan = P.compile(model, mesh, reshard_after_forward=z3, collectives="all_gather")
        sched = plan.schedule()
        R, N = plan.mesh_shape
        for rank in range(R * N):
            per = Counter(
                (op.boundary, op.buffer)
                for op in sched.rank_ops(rank)
                if op.collective and op.phase in ("forward_broadcast", "backward_broadcast", "reduce")
            )
            assert per and max(per.values()) == (3 if z3 else 2), (mesh, rank, per)


def test_slot_layout_and_padding_figures():
    """Every segment sits at the start of its slot, the step code takes the slot's last element,
    the padding is N x slot - numel, and the summary reports kind, padding and the modelled times.
    (Forced: "auto" keeps these buffers broadcast, their slots would pad more than the 2 % a buffer
    holding expert stacks may.)"""
    plan = P.compile(grouped_meta(5, n_layers=2), 3, collectives="all_gather")
    for b in plan.boundaries:
        for buf in b.buffers:
            assert buf.collective == "all_gather"
            assert [buf.slot_index(seg.shard) for seg in buf.segments] == [seg.shard for seg in buf.segments]
            assert all(seg.numel <= buf.slot_numel - 1 for seg in buf.segments)
            assert buf.padding_numel(3) == 3 * buf.slot_numel - buf.numel >= len(buf.segments) - 0
    text = plan.summary()
    assert "collectives: 'all_gather'" in text and "per rank per step (rank 0): 4 all_gather, 2 reduce_scatter" in text
    line = next(ln for ln in text.splitlines() if "x torch.float32" in ln and "all_gather" in ln)
    assert "padding" in line and "modelled" in line
    # the words say what the numbers count: per buffer, one collective per phase (Z3: 3), and the
    # broadcasts it would take instead (one per segment and phase)
    segs = len(next(buf for b in plan.boundaries for buf in b.buffers).segments)
    assert (
        f"3 collectives/step per buffer (one per phase; {3 * segs} if broadcast: {segs} segment(s) x 3 phases)" in line
    )
    n = sum(len(b.buffers) for b in plan.boundaries)
    assert f"{n} of {n} buffers all-gathered (one collective per phase), 0 broadcast" in text


def test_dedicate_params_takes_the_keyword():
    """``dmuon.dedicate_params(..., collectives=...)`` reaches compile through its keywords (the
    signature check fails before any process group is needed)."""
    import inspect

    import dmuon

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sig = inspect.signature(P.compile)
    assert sig.parameters["collectives"].default == "auto"
    assert "compile_kwargs" in inspect.signature(dmuon.dedicate_params).parameters


# ----------------------------------------------------------------------------------------------
# link records: which numbers the auto rule prices with (gloo measured, NCCL the preset)
# ----------------------------------------------------------------------------------------------

REPO = pathlib.Path(__file__).parents[2]


def test_gloo_link_is_the_fit_of_the_shipped_curves():
    """The gloo record's four numbers are the fit of the curves benchmarks/gloo_link_fit.py measured
    (the file it wrote), by the fitting function the script uses: re-fitted here, equal within the
    rounding of the shipped constants (0.5 %)."""
    from dmuon.sim._calibrate.link_fit import fit_link

    shipped = json.loads((REPO / "benchmarks" / "gloo_link_fit.json").read_text())
    fit = fit_link(shipped["curves"])
    link = rules.COLLECTIVE_LINKS["gloo"]
    for name in ("latency_s", "bandwidth_Bps", "all_gather_latency_s", "all_gather_bandwidth_Bps"):
        assert getattr(link, name) == pytest.approx(fit[name], rel=5e-3), name
        assert fit[name] == pytest.approx(shipped["fit"][name], rel=1e-9), name
    assert {"2", "3", "4"} <= set(shipped["curves"])


def test_fit_alpha_beta_recovers_the_formula():
    """Points generated by the planner's own formulas are fitted back exactly, for both families."""
    from dmuon.sim._calibrate.link_fit import fit_link

    a_t, b_t, a_r, b_r = 100e-6, 2e9, 250e-6, 0.5e9
    curves = {
        str(k): {
            "broadcast": [[s, broadcast_call_s(s, k, a_t, b_t)] for s in (256, 65536, 8 << 20)],
            "reduce": [[s, broadcast_call_s(s, k, a_t, b_t)] for s in (4096, 1 << 20)],
            "all_gather": [[s, all_gather_call_s(s, k, a_r, b_r)] for s in (256, 65536, 8 << 20)],
            "reduce_scatter": [[s, all_gather_call_s(s, k, a_r, b_r)] for s in (4096, 1 << 20)],
        }
        for k in (2, 3, 4)
    }
    fit = fit_link(curves)
    assert fit["latency_s"] == pytest.approx(a_t, rel=1e-9)
    assert fit["bandwidth_Bps"] == pytest.approx(b_t, rel=1e-9)
    assert fit["all_gather_latency_s"] == pytest.approx(a_r, rel=1e-9)
    assert fit["all_gather_bandwidth_Bps"] == pytest.approx(b_r, rel=1e-9)


def test_compile_names_the_link_record_it_priced_with():
    """Without a process group compile assumes NCCL (the preset, one pair for every kind) and the
    summary says so; collective_backend="gloo" takes the gloo record (a pair per family, JSON
    version 3, round trip); numbers given by the caller are the "custom" link; unknown backends raise."""
    nccl = P.compile(build_a(), 2)
    assert nccl.collectives.link == "nccl" and nccl.collectives.all_gather_latency_s is None
    text = nccl.summary()
    assert "link record 'nccl': the h100 preset's inter-node link" in text, text
    assert "dmuon.plan.compile without collective_backend assumes NCCL" in text
    gloo = P.compile(build_a(), 2, collective_backend="gloo")
    link = rules.COLLECTIVE_LINKS["gloo"]
    s = gloo.collectives
    assert (s.link, s.latency_s, s.bandwidth_Bps) == ("gloo", link.latency_s, link.bandwidth_Bps)
    assert (s.gather_latency_s, s.gather_bandwidth_Bps) == (link.all_gather_latency_s, link.all_gather_bandwidth_Bps)
    d = json.loads(gloo.to_json())
    assert d["format"] == JSON_FORMAT and d["collectives"]["link"] == "gloo"
    assert P.ShardingPlan.from_json(gloo.to_json()) == gloo and gloo.fingerprint() != nccl.fingerprint()
    text = gloo.summary()
    assert "link record 'gloo': gloo on CPU, fitted" in text and "all-gather / reduce-scatter alpha" in text, text
    assert "assumes NCCL" not in text
    assert "link record 'gloo'" in s.describe()
    given = P.compile(build_a(), 2, collective_backend="gloo", collective_bandwidth_Bps=1e9)
    assert given.collectives.link == "custom" and given.collectives.bandwidth_Bps == 1e9
    assert given.collectives.latency_s == link.latency_s and given.collectives.all_gather_latency_s is None
    assert "numbers given to dmuon.plan.compile" in given.summary()
    with pytest.raises(ValueError, match=r"collective_backend must be one of \('nccl', 'gloo'\)"):
        P.compile(build_a(), 2, collective_backend="mpi")
    with pytest.raises(ValueError, match="CollectiveSettings.link must be one of"):
        P.CollectiveSettings(link="ib")


def test_gloo_rule_by_hand():
    """The gloo record prices a broadcast and an all-gather with their own pairs: model A, layers.0
    on N = 2 (segments 48 and 32 fp32 elements, slot 64), Z3."""
    link = rules.COLLECTIVE_LINKS["gloo"]
    buf = P.compile(build_a(), 2, collectives="broadcast").boundaries[0].buffers[0]
    settings = P.compile(build_a(), 2, collective_backend="gloo").collectives
    choice = choose_collective(
        buf, settings, num_shards=2, align_numel=16, wire_itemsize=4, reduce_itemsize=4, reshard_after_forward=True
    )
    a, B = link.latency_s, link.bandwidth_Bps
    ag, Bg = link.all_gather_latency_s, link.all_gather_bandwidth_Bps
    assert choice.broadcast_s == pytest.approx(3 * (2 * (2 * a) + 80 * 4 / B))
    assert choice.all_gather_s == pytest.approx(3 * (2 * ag + 64 * 4 / Bg))


@pytest.mark.parametrize("size", ["small", "large"])
def test_gloo_record_keeps_the_benchmark_models_broadcast(size):
    """The side-by-side benchmark's models (benchmarks/collective_kinds.py: the main job's GPT, 4
    blocks x hidden 128 and 8 blocks x hidden 256; N = 2 and 4; Z2 and Z3), planned for gloo: every
    buffer broadcast, the kind measured faster there (benchmarks/results/2026-12-06-collectives-per-buffer.md,
    "Measured on CPU: broadcast against all-gather"); planned for NCCL (the preset) the same buffers are all-gathered."""
    from dmuon._train.byte_gpt import GPT, GPTConfig

    dims = {
        "small": dict(n_layers=4, d_model=128, d_mlp=512, n_heads=4, seq_len=64),
        "large": dict(n_layers=8, d_model=256, d_mlp=1024, n_heads=8, seq_len=128),
    }[size]
    for n in (2, 4):
        for z3 in (True, False):
            model = GPT(GPTConfig(vocab_size=256, **dims), device="meta")
            kinds = {
                buf.collective
                for b in P.compile(model, n, reshard_after_forward=z3, collective_backend="gloo").boundaries
                for buf in b.buffers
            }
            assert kinds == {"broadcast"}, (size, n, z3)
            kinds = {
                buf.collective for b in P.compile(model, n, reshard_after_forward=z3).boundaries for buf in b.buffers
            }
            assert kinds == {"all_gather"}, (size, n, z3)
