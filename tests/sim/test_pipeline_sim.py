"""Pipeline parallelism and activation checkpointing in dmuon.sim: schedules by hand and against
torch's own order, the bubble, in-flight activations, AC terms, the pipelined step's composition,
and advise's memory filter against simulate (pure; no process group)."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

import dmuon.plan as P
import dmuon.sim as S
from dmuon import _zoo as zoo
from dmuon.sim import hardware as H
from dmuon.sim._pipeline import advise_search as A
from dmuon.sim._pipeline.pp_schedule import Action, pipeline_order, replay_pipeline

MP = SimpleNamespace(param_dtype="bfloat16", reduce_dtype="float32")


def _acts(text: str) -> tuple[Action, ...]:
    """``"0F0 0F1 0B0"`` -> actions."""
    out = []
    for tok in text.split():
        kind = "F" if "F" in tok else "B"
        s, m = tok.split(kind)
        out.append(Action(kind, int(s), int(m)))
    return tuple(out)


# ------------------------------------------------------------------ schedules


def test_gpipe_and_1f1b_orders_by_hand() -> None:
    assert pipeline_order("gpipe", 2, 2) == (_acts("0F0 0F1 0B0 0B1"), _acts("1F0 1F1 1B0 1B1"))
    # torch's Schedule1F1B: min(M, P - r) warm-up forwards, then backward / forward in turn
    assert pipeline_order("1f1b", 3, 4) == (
        _acts("0F0 0F1 0F2 0B0 0F3 0B1 0B2 0B3"),
        _acts("1F0 1F1 1B0 1F2 1B1 1F3 1B2 1B3"),
        _acts("2F0 2B0 2F1 2B1 2F2 2B2 2F3 2B3"),
    )


def test_interleaved_order_equals_torchs() -> None:
    """ScheduleInterleaved1F1B's own per-rank order (its alignment no-ops dropped)."""
    sched = pytest.importorskip("torch.distributed.pipelining.schedules")
    for pp, V, M in [(2, 2, 2), (2, 2, 4), (4, 2, 8), (3, 3, 6), (4, 2, 4), (2, 3, 1), (4, 2, 12)]:
        ref = sched.ScheduleInterleaved1F1B.__new__(sched.ScheduleInterleaved1F1B)
        ref.n_local_stages, ref.pp_group_size, ref._n_microbatches = V, pp, M
        ref.number_of_rounds = max(1, M // pp)
        ref.microbatches_per_round = M // ref.number_of_rounds
        want = []
        for r in range(pp):
            acts = [a for a in ref._calculate_single_rank_operations(r) if a is not None]
            fwd = sched._ComputationType.FORWARD
            want.append(
                tuple(
                    Action("F" if a.computation_type == fwd else "B", a.stage_index, a.microbatch_index) for a in acts
                )
            )
        assert pipeline_order("interleaved", pp, M, V) == tuple(want), (pp, V, M)


def test_schedule_refusals() -> None:
    with pytest.raises(ValueError, match="one stage per rank"):
        pipeline_order("1f1b", 2, 4, 2)
    with pytest.raises(ValueError, match="at least 2 stages per rank"):
        pipeline_order("interleaved", 2, 4, 1)
    with pytest.raises(ValueError, match="multiple of the number of rounds"):
        pipeline_order("interleaved", 2, 5, 2)
    with pytest.raises(ValueError, match="deadlocks"):
        replay_pipeline((_acts("0B0 0F0"), _acts("1F0 1B0")), [1.0, 1.0], [1.0, 1.0])


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_bubble_is_textbook_on_uniform_costs(schedule: str) -> None:
    """F = 1, B = 2, no send: every rank ends at (M + P - 1)(F + B) and rank 0 idles (P - 1)(F + B),
    a share of (P - 1) / (M + P - 1); GPipe holds M micro-batches' activations, 1F1B's rank r
    min(M, P - r)."""
    pp, M = 4, 8
    rp = replay_pipeline(pipeline_order(schedule, pp, M), [1.0] * pp, [2.0] * pp, activation_nbytes=[10] * pp)
    assert rp.makespan_s == pytest.approx((M + pp - 1) * 3.0)
    assert rp.idle_s[0] / rp.end_s[0] == pytest.approx((pp - 1) / (M + pp - 1))
    assert rp.busy_s == (M * 3.0,) * pp
    want = [M] * pp if schedule == "gpipe" else [min(M, pp - r) for r in range(pp)]
    assert list(rp.in_flight) == want and list(rp.activation_nbytes) == [10 * k for k in want]


def test_interleaved_bubble_shrinks_by_stages_per_rank() -> None:
    """4 ranks x 2 stages of F = 0.5, B = 1 against 4 ranks x 1 stage of F = 1, B = 2 (the same
    work per rank), 8 micro-batches: the bubble (P - 1)(F + B) of a rank's whole work is cut by V."""
    rp = replay_pipeline(pipeline_order("interleaved", 4, 8, 2), [0.5] * 8, [1.0] * 8)
    one = replay_pipeline(pipeline_order("1f1b", 4, 8), [1.0] * 4, [2.0] * 4)
    assert one.idle_s[0] == pytest.approx(3 * 3.0) and rp.idle_s[0] == pytest.approx(3 * 3.0 / 2)
    assert rp.busy_s == one.busy_s


def test_sends_delay_the_receiver() -> None:
    """2 stages, 1 micro-batch, F = B = 1, send 0.5: F0, send, F1, B1, send, B0 = 5."""
    rp = replay_pipeline(pipeline_order("1f1b", 2, 1), [1.0, 1.0], [1.0, 1.0], send_s=0.5)
    assert rp.end_s == (5.0, 3.5) and rp.idle_s == (3.0, 1.5)


# ------------------------------------------------------------------ activation checkpointing terms


def _tiny_plan():
    return P.compile(zoo.tiny_llama(), 2, mp_policy=MP)


def test_ac_activation_and_recompute_terms_by_hand() -> None:
    plan = _tiny_plan()
    tokens, isz = 512, 2
    none, full, sel = (
        S.from_plan(plan, tokens_per_rank=tokens, seq_len=128, ac=ac) for ac in ("none", "full", "selective")
    )
    fqn, w = none.boundaries[0]
    h = w.hidden
    layer = zoo.tiny_llama().model.layers[0]
    d_attn = layer.self_attn.q_proj.weight.shape[0]
    outs = sum(m.weight.shape[0] for m in layer.modules() if hasattr(m, "weight") and m.weight.ndim == 2)
    assert w.activation_nbytes == 34 * tokens * h * isz // 2 and w.recompute is None
    fw = full.work(fqn)
    assert fw.activation_nbytes == tokens * h * isz
    assert fw.recompute.flops == w.flops and fw.recompute_all_to_all
    sw = sel.work(fqn)
    assert sw.activation_nbytes == min(w.activation_nbytes, isz * (tokens * h + tokens * d_attn + tokens * outs // 2))
    assert sw.recompute.attention_flops == 0 and sw.recompute.matmul_flops == sum(f // 2 for f, _ in w.matmuls)
    assert sw.recompute.elementwise_nbytes == w.elementwise_nbytes and not sw.recompute_all_to_all
    assert full.recompute_transient_nbytes == w.activation_nbytes - tokens * h * isz
    assert none.recompute_transient_nbytes == 0
    with pytest.raises(ValueError, match="ac must be one of"):
        S.from_plan(plan, tokens_per_rank=tokens, seq_len=128, ac="sometimes")


def test_ac_recompute_is_priced_into_the_step() -> None:
    """A step that recomputes every boundary under full AC is longer than without by the boundaries'
    forward compute (the replay is otherwise the same), for dmuon and for FSDP2 + AdamW alike."""
    plan = _tiny_plan()
    hw = H.preset("h100")
    wl0 = S.from_plan(plan, tokens_per_rank=4096, seq_len=1024)
    wl1 = S.from_plan(plan, tokens_per_rank=4096, seq_len=1024, ac="full")
    rec = tuple(b.fqn for b in plan.boundaries)
    step = P.Step(micro_batches=(P.MicroBatch(recompute=rec),))
    for v in ("z3", "adamw"):
        a = S.simulate(plan, hw, wl0, variant=v, timeline_ranks=(0,))
        b = S.simulate(plan, hw, wl1, step, variant=v, timeline_ranks=(0,))
        recomputed = sum(i.end_s - i.start_s for i in b.timelines[0] if i.kind == "recompute")
        assert recomputed > 0 and b.step_s > a.step_s
        assert max(b.peak_memory_nbytes) < max(a.peak_memory_nbytes)


# ------------------------------------------------------------------ the pipelined step


def test_pipelined_step_composes_stage_steps_bubble_and_memory() -> None:
    """step = max over pipeline ranks of (its end in the pipeline replay + its stages' tails); each
    rank's peak = its stage's peak less one micro-batch's activations + the in-flight ones (1F1B:
    min(M, P - r) micro-batches) + one recompute."""
    hw = H.preset("h100")
    sp = P.compile_stages(zoo.tiny_llama(), 2, pp=2, mp_policy=MP, reuse_equal_stages=True)
    M = 4
    sims = S.simulate_pipeline(
        sp,
        hw,
        tokens_per_rank=4096,
        seq_len=1024,
        micro_batches=M,
        schedule="1f1b",
        ac="full",
        variants=("adamw", "z2"),
    )
    for v, sim in sims.items():
        order = pipeline_order("1f1b", 2, M)
        rp = replay_pipeline(
            order, [s.forward_s for s in sim.stages], [s.backward_s for s in sim.stages], send_s=sim.send_s
        )
        assert sim.step_s == pytest.approx(max(rp.end_s[r] + sim.stages[r].tail_s for r in range(2)))
        for r, rank in enumerate(sim.ranks):
            st = sim.stages[r]
            static = st.memory.peak_nbytes - st.memory.activations_nbytes
            assert rank.in_flight == min(M, 2 - r)
            assert (
                rank.peak_memory_nbytes
                == static + rank.in_flight * st.activation_nbytes + st.recompute_transient_nbytes
            )
        assert sim.stages[0].recompute_s > 0 and sim.bound() in (
            "bubble",
            "exposed communication",
            "Newton-Schulz",
            "recompute",
        )
        assert sum(sim.terms().values()) == pytest.approx(sim.step_s)
    assert sims["z2"].ns_s > 0 == sims["adamw"].ns_s


def _fsdp2_gathers(ops) -> tuple[int, int]:
    """FSDP2 all-gathers in a step's ops, and those after its last forward (the backward's)."""
    last_fwd = max(op.id for op in ops if op.kind == "forward")
    gathers = [op for op in ops if op.kind == "fsdp2_all_gather"]
    return len(gathers), sum(op.id > last_fwd for op in gathers)


@pytest.mark.parametrize("mesh", [2, (2, 2)])
def test_pipelined_stage_bytes_equal_pipeline_cost(mesh) -> None:
    """Each stage's simulated dmuon bytes per step are pipeline_cost's (the ledger's): Z2 one forward
    broadcast and one reduce per step (plan.cost) however many micro-batches, Z3 M forward and M
    backward broadcasts; the reduce follows the last backward (the schedule's REDUCE_GRAD), and
    FSDP2 under the schedule gathers a unit kept after its backward once per step (Z2) or once per
    backward plus the first forward (Z3), for dmuon's FSDP2 part and for FSDP2 + AdamW alike."""
    from dmuon.plan._cost.stage_bytes import pipeline_step
    from dmuon.sim._engine import alternatives as alt

    hw = H.preset("h100")
    M = 4
    sp = P.compile_stages(zoo.tiny_llama(), mesh, pp=2, mp_policy=MP)
    sims = S.simulate_pipeline(
        sp, hw, tokens_per_rank=4096, seq_len=1024, micro_batches=M, variants=("adamw", "z2", "z3")
    )
    for v in ("z2", "z3"):
        for s, plan in enumerate(sp.plans):
            mode = dataclasses.replace(plan, reshard_after_forward=v == "z3")
            c = mode.cost
            per_mb = c.forward_broadcast_nbytes + c.backward_broadcast_nbytes  # Z3: repeated per micro-batch
            want = c.total_nbytes + (M - 1) * per_mb if v == "z3" else c.total_nbytes
            assert c.forward_broadcast_nbytes > 0 and (c.backward_broadcast_nbytes > 0) == (v == "z3")
            assert sims[v].stages[s].dmuon_nbytes == P.pipeline_cost(mode, M).total_nbytes == want, (v, s)
            sched = mode.schedule(pipeline_step(M))
            last_bwd = max(op.id for op in sched.ops if op.kind == "backward")
            assert min(op.id for op in sched.ops if op.phase == "reduce") > last_bwd
            gathers, in_bwd = _fsdp2_gathers(mode.schedule().ops)
            assert gathers > 0 and (in_bwd > 0) == (v == "z3")
            assert _fsdp2_gathers(sched.ops)[0] == gathers + (M - 1) * in_bwd, (v, s)
    assert all(st.dmuon_nbytes == 0 for st in sims["adamw"].stages)
    plan = sp.plans[0]
    for reshard in (False, True):
        nominal = alt.build("adamw", plan, fsdp2_reshard_after_forward=reshard)
        piped = alt.build("adamw", plan, pipeline_step(M), fsdp2_reshard_after_forward=reshard)
        gathers, in_bwd = _fsdp2_gathers(nominal)
        assert (in_bwd > 0) == reshard and _fsdp2_gathers(piped)[0] == gathers + (M - 1) * in_bwd, reshard
        rs = [op for op in piped if op.kind == "fsdp2_reduce_scatter"]
        assert rs and min(op.id for op in rs) > max(op.id for op in piped if op.kind == "backward")


# ------------------------------------------------------------------ advise


@pytest.mark.parametrize("preset", ["tiny_llama", "tiny_moe"])
def test_advise_memory_filter_agrees_with_simulate(preset: str) -> None:
    """On a small preset and a device sized so that some configurations fit and some do not,
    every configuration advise keeps or drops for memory has the analytic peak simulate reports,
    so both make the same call; the best are simulated, fit, and come with FSDP2 + AdamW's step."""
    base = H.preset("h100")
    builder = getattr(zoo, preset)
    probe = A.advise(builder, 4, base, tokens_per_rank=2048, seq_len=512, simulate_configs=2, top=2)
    peaks = sorted({c.peak_nbytes for c in probe.candidates if c.fate != "refused"})
    hw = dataclasses.replace(base, memory_nbytes=peaks[len(peaks) // 2])
    adv = A.advise(builder, 4, hw, tokens_per_rank=2048, seq_len=512, simulate_configs=3, top=3)
    fates = {c.fate for c in adv.candidates}
    assert {"no_fit", "simulated"} <= fates
    layouts = A._Layouts(builder, hw, 2048, 512, S.workload.model_top_k(builder()), "bfloat16")
    checked = 0
    for cand in adv.candidates:
        if cand.fate == "refused":
            continue
        c = cand.config
        sp = layouts.stage_plans(c)
        v = "z3" if c.z3 else "z2"
        sim = S.simulate_pipeline(
            sp,
            hw,
            tokens_per_rank=2048 * c.pp * c.tp,
            seq_len=512,
            micro_batches=c.micro_batches,
            schedule=c.schedule,
            ac=c.ac,
            variants=(v,),
            top_k=layouts.top_k,
        )[v]
        peak = max(sim.peak_memory_nbytes)
        assert peak == cand.peak_nbytes, c.label()
        assert (cand.fate == "no_fit") == (peak > hw.memory_nbytes), c.label()
        checked += 1
    assert checked == sum(c.fate != "refused" for c in adv.candidates) > 10
    for c in adv.best:
        assert c.simulated_peak_nbytes <= hw.memory_nbytes and c.adamw_step_s > 0 and c.step_s > 0
    assert [c.step_s for c in adv.best] == sorted(c.step_s for c in adv.best)
    assert adv.dropped_line().startswith(f"of {len(adv.candidates):,} configurations:")


def test_simulate_cli_pipelined_rows_and_refusals(capsys, tmp_path) -> None:
    import json

    from dmuon._cli import main

    argv = ["simulate", "--model", "tiny-llama", "--mesh", "2", "--hw", "h100", "--tokens-per-rank", "4096"]
    assert main([*argv, "--pp", "2", "--seq-len", "1024", "--ac", "selective", "--json", str(tmp_path / "s.json")]) == 0
    out = capsys.readouterr().out
    assert "4 micro-batches of 1,024 tokens, schedule 1f1b, AC selective" in out and "global batch 8,192 tokens" in out
    assert "device GiB" in out and "fits" in out and "z2 - adamw = " in out and "recommended: dmuon" in out
    assert main([*argv, "--mode", "z2"]) == 0  # the path without PP says every row's fit too
    assert "peak per rank against the device's 80.0 GiB: adamw fits, naive fits, z2 fits" in capsys.readouterr().out
    data = json.loads((tmp_path / "s.json").read_text())
    assert data["split"][1] == ["model.layers.2", "model.layers.3", "model.norm", "lm_head"]
    # the pipelined "recommended:" line is recommendation.recommend's (Z3 within 1 %, memory first)
    from dmuon.sim._pages.recommendation import recommend

    rows = {
        v: SimpleNamespace(step_s=r["step_ms"] / 1e3, peak_memory_nbytes=tuple(r["peak_memory_nbytes"]))
        for v, r in data["variants"].items()
        if v != "adamw"
    }
    mode, why = recommend(rows, data["device_memory_nbytes"])
    assert f"recommended: dmuon {mode.upper()} (" in out and f"): {why}" in out
    assert set(data["variants"]) == {"adamw", "z2", "z3"} and data["micro_batches"] == 4
    for extra, msg in [
        (["--pp", "2", "--microbatches", "3"], "must be >= 1 and divide --tokens-per-rank"),
        (["--pp", "2", "--stages-per-rank", "2", "--schedule", "1f1b"], "runs one stage per rank"),
        (["--pp", "2", "--schedule", "interleaved"], "needs --stages-per-rank V >= 2"),
        (["--pp", "2", "--png", str(tmp_path / "x.png")], "not drawn for a pipelined step"),
        (["--pp", "9"], "cannot be more than the 6 effective layers"),
    ]:
        with pytest.raises(SystemExit) as e:
            main([*argv, *extra])
        assert e.value.code == 2 and msg in capsys.readouterr().err, extra


def test_advise_cli_prints_the_best_and_why_the_rest_were_dropped(capsys) -> None:
    from dmuon._cli import main

    argv = ["advise", "--model", "tiny-llama", "--gpus", "4", "--hw", "h100", "--tokens-per-rank", "2048"]
    assert main([*argv, "--seq-len", "512", "--top", "2", "--simulate", "2"]) == 0
    out = capsys.readouterr().out
    assert "global batch 8,192 tokens (2,048 per GPU)" in out and "x AdamW" in out
    assert out.count(", dp ") >= 2 and "dropped: of " in out and "python -m dmuon simulate --model tiny-llama" in out
    with pytest.raises(SystemExit) as e:
        main([*argv, "--gpus", "0"])
    assert e.value.code == 2 and "--gpus must be >= 1" in capsys.readouterr().err
