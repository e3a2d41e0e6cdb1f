"""CLI functions behind `python -m dmuon plan` / `python -m dmuon diff` (dmuon/_cli/plan_commands.py)."""

from __future__ import annotations

import argparse

import pytest

from dmuon.sim import zoo
from dmuon.plan import ShardingPlan
from dmuon._cli.plan_commands import main_diff, main_plan, parse_mesh


def test_parse_mesh():
    assert parse_mesh("8") == 8
    assert parse_mesh("2x8") == (2, 8)
    for bad in ("0", "2x", "x8", "2x3x4", "eight"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_mesh(bad)


def test_plan_prints_summary_and_writes_json(tmp_path, capsys):
    path = tmp_path / "p.json"
    assert main_plan(["--model", "tiny-llama", "--mesh", "2x2", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "DMuon-Z3 HSDP sharding plan: mesh (R=2, N=2)" in out
    assert f"wrote {path}" in out
    plan = ShardingPlan.from_json(path.read_text())
    assert plan.mesh_shape == (2, 2) and len(plan.dedicated) == 28


def test_plan_options(tmp_path, capsys):
    path = tmp_path / "p.json"
    rc = main_plan(
        [
            "--model",
            "tiny-moe",
            "--mesh",
            "4",
            "--z2",
            "--cost-model",
            "ns_flops",
            "--all-matrices",
            "--param-dtype",
            "bfloat16",
            "--reduce-dtype",
            "float32",
            "--json",
            str(path),
        ]
    )
    assert rc == 0
    plan = ShardingPlan.from_json(path.read_text())
    assert not plan.reshard_after_forward and plan.cost_model == "ns_flops"
    assert (plan.param_dtype, plan.reduce_dtype) == ("torch.bfloat16", "torch.float32")
    assert plan.is_dedicated("layers.0.mlp.experts.w1")
    assert "DMuon-Z2" in capsys.readouterr().out


def test_plan_rejects_unknown_model(capsys):
    with pytest.raises(SystemExit):
        main_plan(["--model", "gpt-17", "--mesh", "8"])
    assert "python -m dmuon plan" in capsys.readouterr().err


def test_tp_degree_that_does_not_divide_names_the_widths_and_the_degrees_that_do(capsys):
    # tiny-llama's TP-split widths: 32 (the KV heads' rows), 64 (hidden), 160 (the MLP's rows);
    # 2 to 32 divide all three, 64 does not divide 160, 3 divides none
    from dmuon._cli.plan_commands import tp_degree_error

    model = zoo.tiny_llama()
    assert tp_degree_error(model, 1) is None and tp_degree_error(model, 2) is None
    msg = tp_degree_error(model, 3)
    assert (
        msg
        == "--tp 3 does not divide the widths tensor parallelism splits (32, 64, 160); use --tp 2 or 4 or 8 or 16 or 32"
    )
    assert tp_degree_error(model, 64).startswith(
        "--tp 64 does not divide the widths tensor parallelism splits (32, 160);"
    )
    with pytest.raises(SystemExit):
        main_plan(["--model", "tiny-llama", "--mesh", "4", "--tp", "3"])
    assert "--tp 3 does not divide" in capsys.readouterr().err


def test_diff(tmp_path, capsys):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    main_plan(["--model", "tiny-llama", "--mesh", "4", "--json", str(a)])
    main_plan(["--model", "tiny-llama", "--mesh", "8", "--json", str(b)])
    capsys.readouterr()
    assert main_diff([str(a), str(a)]) == 0
    assert "PlanDiff: no differences" in capsys.readouterr().out
    assert main_diff([str(a), str(b)]) == 0
    out = capsys.readouterr().out
    assert "owner(s) moved" in out and "setting mesh_shape: (1, 4) -> (1, 8)" in out
    assert main_diff([str(a), str(b), "--exit-code"]) == 1


def test_plan_tp_megatron_preset(tmp_path, capsys):
    """--tp T: Megatron-style shard dims on the preset; JSON keeps them; every TP matrix is
    Shard(0) for q/k/v/gate/up and Shard(1) for o/down; --tp-ns forces the method."""
    out_json = tmp_path / "tp.json"
    assert (
        main_plan(["--model", "tiny-llama", "--mesh", "2", "--tp", "2", "--tp-ns", "gram", "--json", str(out_json)])
        == 0
    )
    out = capsys.readouterr().out
    assert "tensor parallel: T=2" in out and "TP Gram all-reduce / gather" in out
    plan = ShardingPlan.from_json(out_json.read_text())
    assert plan.tp_size == 2 and plan.cost.tp_nbytes > 0
    assert len(plan.cost.per_rank_nbytes) == 4
    for spec in plan.params:
        leaf = spec.fqn.split(".")[-2]
        assert spec.tp_shard_dim == (1 if leaf in ("o_proj", "down_proj") else 0), spec
        assert spec.tp_ns == "gram"
    with pytest.raises(SystemExit):
        main_plan(["--model", "tiny-llama", "--mesh", "2", "--tp", "0"])


def test_plan_schedule_prints_one_ranks_step(capsys):
    """``--schedule RANK``: RANK's whole nominal step, one op per line, and the bytes charged to
    it, which equal ``plan.cost.per_rank_nbytes[RANK]``."""
    import dmuon.plan as P

    assert main_plan(["--model", "tiny-llama", "--mesh", "2x2", "--schedule", "3"]) == 0
    out = capsys.readouterr().out
    plan = P.compile(zoo.PRESETS["tiny-llama"](), (2, 2))
    ops = plan.schedule().rank_ops(3)
    assert f"rank 3, {len(ops):,} ops, {plan.cost.per_rank_nbytes[3]:,} B charged per step" in out
    body = [line for line in out.splitlines()[2:] if line.strip()]
    assert len(body) == len(ops)
    assert [line.split()[:2] for line in body] == [[str(op.id), op.kind] for op in ops]
    # tiny-llama's small buffers are all-gathered (collectives="auto"); HSDP's replicate phases broadcast
    assert any(line.split()[1:3] == ["all_gather", "forward_broadcast"] for line in body)
    assert any(line.split()[1:3] == ["broadcast", "replicate_broadcast"] for line in body)
    assert any("replicate_broadcast" in line for line in body)
    with pytest.raises(SystemExit):
        main_plan(["--model", "tiny-llama", "--mesh", "2x2", "--schedule", "4"])


def test_plan_owner_groups_flag(tmp_path, capsys):
    from dmuon.plan import OwnerGroup

    path = tmp_path / "g.json"
    assert main_plan(["--model", "tiny-llama", "--mesh", "64", "--owner-groups", "auto", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "ownership: 0 of 64 ranks own nothing" in out and "owner groups:" in out
    plan = ShardingPlan.from_json(path.read_text())
    assert any(isinstance(o, OwnerGroup) for o in plan.owners) and min(plan.owned_numel) > 0
    for bad, why in (("yes", "expected off, auto or an int"), ("0", "K must be >= 1")):
        with pytest.raises(SystemExit):
            main_plan(["--model", "tiny-llama", "--mesh", "4", "--owner-groups", bad])
        assert why in capsys.readouterr().err
    with pytest.raises(SystemExit):  # an argparse error, not a traceback
        main_plan(["--model", "tiny-llama", "--mesh", "4", "--tp", "2", "--owner-groups", "2"])
    assert "not supported with tensor parallelism" in capsys.readouterr().err


def test_moe_presets_shapes_and_plan():
    """The HF fused-layout MoE presets: real shapes on the meta device (Qwen3-30B-A3B 30.5 B
    parameters, DeepSeek-V3-like 671 B), expert stacks recognised as 'hf', fused gate/up split."""
    import dmuon.plan as P
    from dmuon._zoo import PRESETS

    qwen = PRESETS["qwen3-30b-a3b"]()
    shapes = {n: tuple(p.shape) for n, p in qwen.named_parameters()}
    assert round(sum(p.numel() for p in qwen.parameters()) / 1e9, 2) == 30.53
    assert shapes["model.layers.0.mlp.experts.gate_up_proj"] == (128, 1536, 2048)
    assert shapes["model.layers.47.mlp.experts.down_proj"] == (128, 2048, 768)
    assert shapes["model.layers.0.mlp.gate.weight"] == (128, 2048)
    assert shapes["model.layers.0.self_attn.q_proj.weight"] == (4096, 2048)
    assert shapes["model.layers.0.self_attn.k_proj.weight"] == (512, 2048)
    ds = PRESETS["deepseek-v3"]()
    shapes = {n: tuple(p.shape) for n, p in ds.named_parameters()}
    assert round(sum(p.numel() for p in ds.parameters()) / 1e9, 2) == 671.03
    assert shapes["model.layers.2.mlp.gate_proj.weight"] == (18432, 7168)  # dense layers 0-2
    assert shapes["model.layers.3.mlp.experts.gate_up_proj"] == (256, 4096, 7168)
    assert shapes["model.layers.60.mlp.shared_experts.down_proj.weight"] == (7168, 2048)
    assert shapes["model.layers.3.self_attn.kv_b_proj.weight"] == (32768, 512)
    plan = P.compile(qwen, 8)
    spec = plan.param("model.layers.0.mlp.experts.gate_up_proj")
    assert spec.experts.layout == "hf" and spec.matrix_shape == (768, 2048) and spec.num_matrices == 256
    assert len(plan.expert_owners(spec.fqn)) == 128
    # the default (collectives="auto") all-gathers every layer with its experts water-filled into
    # near-equal slots (measured: 1.1 % padding over the 48 buffers)
    bufs = [buf for b in plan.boundaries for buf in b.buffers]
    assert {buf.collective for buf in bufs} == {"all_gather"}
    assert sum(buf.padding_numel(8) for buf in bufs) <= 0.02 * sum(buf.numel for buf in bufs)


def _one_stack_model(num_experts: int):
    """``layers.0.experts.w1`` ``(num_experts, 6, 4)``: one expert stack, nothing else."""
    import torch
    from torch import nn

    class Experts(nn.Module):
        def __init__(self):
            super().__init__()
            self.w1 = nn.Parameter(torch.empty(num_experts, 6, 4, device="meta"))

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.experts = Experts()

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList([Block()])

    return Model()


def test_expert_lines_singular_and_plural():
    """The summary's experts line counts in words that agree with their numbers: one stack of one
    expert on one rank is "1 stack, 1 expert, 1 Muon matrix ... 1 of 1 rank, 1 expert each"; the
    plural forms and an uneven range ("2-3 experts each") as before."""
    import dmuon.plan as P
    from dmuon.plan._tools.render import expert_lines

    one = expert_lines(P.compile(_one_stack_model(1), 1))
    assert one == [
        "experts: 1 stack, 1 expert, 1 Muon matrix, 100% of dedicated elements; layout torchtitan",
        "  owned by 1 of 1 rank, 1 expert each; stacks with a single owner: 1",
    ]
    five = expert_lines(P.compile(_one_stack_model(5), 2))
    assert five == [
        "experts: 1 stack, 5 experts, 5 Muon matrices, 100% of dedicated elements; layout torchtitan",
        "  owned by 2 of 2 ranks, 2-3 experts each; stacks with a single owner: 0",
    ]
    moe = expert_lines(P.compile(zoo.PRESETS["tiny-moe"](), 4))
    assert moe[0].startswith("experts: 6 stacks, ") and " Muon matrices, " in moe[0]
    assert ", 1 Muon matrix" not in moe[0] and " 1 stacks" not in moe[0]


def test_plan_prints_compile_warnings_as_clean_lines(capsys):
    """``python -m dmuon plan`` shows compile's warnings (here: ``--experts off`` leaves the stacks
    to AdamW) as one ``warning: ...`` line each on stderr, not Python's ``UserWarning`` form; the
    message is the one ``dmuon.plan.compile`` warns with."""
    import warnings

    import dmuon.plan as P

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        P.compile(zoo.PRESETS["tiny-moe"](), 4, experts="off")
    (expected,) = [str(w.message) for w in caught]
    assert main_plan(["--model", "tiny-moe", "--mesh", "4", "--experts", "off"]) == 0
    captured = capsys.readouterr()
    assert captured.err.splitlines() == [f"warning: {expected}"]
    assert "UserWarning" not in captured.err + captured.out
    assert "sharding plan" in captured.out
    assert main_plan(["--model", "tiny-moe", "--mesh", "4"]) == 0  # the default: nothing to warn about
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize(
    "model,top_k,why",
    [
        (
            "tiny-moe",
            0,
            "--top-k 0: experts per token must be between 1 and 4, the number of experts of layers.0.mlp.experts.w1",
        ),
        ("tiny-moe", 5, "--top-k 5: experts per token must be between 1 and 4"),
        ("tiny-llama", 1, "--top-k 1: the model has no expert stacks"),
    ],
)
def test_simulate_refuses_top_k_outside_the_models_experts(capsys, model, top_k, why):
    """``python -m dmuon simulate --top-k K`` needs 1 <= K <= E of the model's stacks: an argparse
    error naming the bound (the tiny-moe preset has 4 experts per stack), before any simulation."""
    from dmuon._zoo import PRESETS
    from dmuon._cli.sim_commands import expert_counts, main_simulate

    if model == "tiny-moe":
        assert set(expert_counts(PRESETS[model]()).values()) == {4}
    with pytest.raises(SystemExit):
        main_simulate(["--model", model, "--mesh", "4", "--hw", "h100", "--top-k", str(top_k)])
    captured = capsys.readouterr()
    assert why in captured.err and captured.out == ""


def test_plan_ep(tmp_path, capsys):
    """``plan --ep K`` plans the preset as one rank of ep = K holds it (E/K experts per stack):
    the JSON's stacks are global with ep_size K, each expert owned inside its efsdp group; a K
    that does not divide the experts or the shard ranks, or a model without stacks, is a usage
    error naming the flag."""
    from dmuon.plan import ShardingPlan

    path = tmp_path / "ep.json"
    assert main_plan(["--model", "tiny-moe", "--mesh", "4", "--ep", "2", "--json", str(path)]) == 0
    assert "expert-parallel: 6 stacks over ep = 2 x efsdp = 2" in capsys.readouterr().out
    plan = ShardingPlan.from_json(path.read_text())
    stacks = [p for p in plan.params if p.experts is not None]
    assert len(stacks) == 6 and all(p.ep_size == 2 and p.shape[0] == 4 and p.local_shape[0] == 2 for p in stacks)
    for p in stacks:
        assert [o.shard % 2 for o in plan.expert_owners(p.fqn)] == [0, 0, 1, 1]
    for argv, msg in (
        (
            ["--model", "tiny-moe", "--mesh", "4", "--ep", "3"],
            "--ep 3: expert_parallel_variant: ep=3 does not divide the 4 experts",
        ),
        (
            ["--model", "tiny-moe", "--mesh", "2x2", "--ep", "4"],
            "tiny-moe on --mesh (2, 2) --ep 4: dmuon.plan._compile: ep=4 does not divide the 2 shard ranks",
        ),
        (["--model", "tiny-llama", "--mesh", "4", "--tp", "3"], "--tp 3 does not divide the widths"),
        (
            ["--model", "tiny-moe", "--mesh", "4", "--experts", "off", "--expert-gate-up", "fused"],
            "--expert-gate-up with --experts off",
        ),
        (
            ["--model", "tiny-llama", "--mesh", "4", "--ep", "2"],
            "--ep 2: expert_parallel_variant: the model has no expert stack",
        ),
    ):
        with pytest.raises(SystemExit):
            main_plan(argv)
        assert msg in capsys.readouterr().err, argv


def test_diff_reads_errors_as_usage_errors(tmp_path, capsys):
    """A missing, non-JSON or non-plan file, and a negative --max-lines: one usage line (exit 2)
    naming the file and what is wrong, no traceback."""
    plan = tmp_path / "a.json"
    assert main_plan(["--model", "tiny-llama", "--mesh", "2", "--json", str(plan)]) == 0
    (tmp_path / "bad.json").write_text("nope")
    (tmp_path / "other.json").write_text('{"x": 1}')
    capsys.readouterr()
    for other, message in (
        (tmp_path / "missing.json", "missing.json: cannot read it (No such file or directory)"),
        (
            tmp_path / "bad.json",
            "bad.json: not a dmuon plan JSON (python -m dmuon plan --json FILE writes one): JSONDecodeError",
        ),
        (
            tmp_path / "other.json",
            "other.json: not a dmuon plan JSON (python -m dmuon plan --json FILE writes one): "
            "ValueError: not a dmuon plan of a known format",
        ),
    ):
        with pytest.raises(SystemExit) as exc:
            main_diff([str(plan), str(other)])
        assert exc.value.code == 2
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, err
    with pytest.raises(SystemExit) as exc:
        main_diff([str(plan), str(plan), "--max-lines", "-3"])
    assert exc.value.code == 2 and "argument --max-lines: must be >= 0, got -3" in capsys.readouterr().err


def test_wire_dtypes_are_floating_point_only(capsys):
    """--param-dtype / --reduce-dtype and compile(mp_policy=...) accept only the dtypes dmuon's
    buffers carry (the runtime's list), refused at planning instead of inside the ranks."""
    import torch
    from types import SimpleNamespace

    import dmuon.plan as P

    for flag, value in (("--param-dtype", "int8"), ("--reduce-dtype", "bool"), ("--param-dtype", "complex64")):
        with pytest.raises(SystemExit) as exc:
            main_plan(["--model", "tiny-llama", "--mesh", "2", flag, value])
        assert exc.value.code == 2
        assert (
            f"{value!r} is not a floating-point torch dtype dmuon's buffers carry (float32, float64, float16, "
            "bfloat16)" in capsys.readouterr().err
        )
    with pytest.raises(
        ValueError,
        match=r"^mp_policy.param_dtype = torch.int8: dmuon's buffers carry floating-point "
        r"dtypes only \(float32, float64, float16, bfloat16\)$",
    ):
        P.compile(zoo.tiny_llama(), 2, mp_policy=SimpleNamespace(param_dtype=torch.int8, reduce_dtype=None))
    plan = P.compile(
        zoo.tiny_llama(), 2, mp_policy=SimpleNamespace(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    )
    assert (plan.param_dtype, plan.reduce_dtype) == ("torch.bfloat16", "torch.float32")


def test_plan_refusal_is_cut_and_keeps_its_fix():
    """A compile refusal that names every parameter (224 lines here) is cut to its first lines,
    how many it left out, and its last line, the fix (the cut ``plan`` and ``simulate`` print)."""
    from dmuon._cli.plan_commands import ERROR_LINES, refusal_text

    lines = ["dmuon.plan._compile: selected parameters dmuon cannot own:"]
    lines += [f"  layers.{i}.w: dim 0 is not divisible by the TP degree 3" for i in range(222)]
    text = refusal_text(ValueError("\n".join(lines + ["Fix: exclude them in predicate"])))
    out = text.splitlines()
    assert out[:ERROR_LINES] == lines[:ERROR_LINES]
    assert out[ERROR_LINES] == f"  ... ({223 - ERROR_LINES} more lines)" and out[-1] == "Fix: exclude them in predicate"
    assert len(out) == ERROR_LINES + 2
    assert refusal_text(ValueError("one line")) == "one line"


def test_apply_names_a_plan_that_is_not_one():
    """``dmuon.exec.apply`` takes a ShardingPlan; a JSON path is refused with how to load it,
    before anything is installed (no process group needed to see it)."""
    import dmuon.exec

    with pytest.raises(
        TypeError,
        match=r"^dmuon.exec.apply: plan must be a dmuon.plan.ShardingPlan, got str "
        r"'plan.json' \(a JSON file: dmuon.plan.ShardingPlan.from_json\(open\(path\).read\(\)\)\)$",
    ):
        dmuon.exec.apply("plan.json", zoo.tiny_llama())


def test_plan_offload_prints_device_and_host(capsys):
    """``--offload``: the summary's memory block under CPU offload, the busiest rank's device peak and
    host memory as ``plan.rank_stats(offload=True)`` counts them; a plan the runtime cannot offload
    (owner groups) is a usage error naming the refusal."""
    from dmuon.plan import compile
    from dmuon.plan._tools.render import fmt_nbytes

    assert main_plan(["--model", "tiny-llama", "--mesh", "4", "--offload"]) == 0
    out = capsys.readouterr().out
    assert "CPU offload: device terms, then host" in out
    terms = [s.memory for s in compile(zoo.PRESETS["tiny-llama"](), 4).rank_stats(offload=True)]
    top = max(terms, key=lambda t: t.peak_nbytes)
    assert f"device peak{fmt_nbytes(top.peak_nbytes):>{26 + 13}}" in out
    assert "\nhost " in out and fmt_nbytes(top.host_nbytes) in out
    with pytest.raises(SystemExit):
        main_plan(["--model", "tiny-llama", "--mesh", "4", "--owner-groups", "2", "--offload"])
    assert (
        "--offload: dmuon: offload_policy=CPUOffloadPolicy(...) with owner-grouped matrices" in capsys.readouterr().err
    )
