"""Pipeline stages as torchtitan splits them, and one dmuon plan per stage (pure; no process group)."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

import dmuon.plan
import dmuon.sim
from dmuon.plan import compile_stages, split_model, stage_model
from dmuon.plan._model.pipeline_split import stage_fqns


class _Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.attn = nn.Linear(d, d, bias=False)
        self.mlp = nn.Linear(d, 2 * d, bias=False)
        self.norm = nn.RMSNorm(d)


class _Titan(nn.Module):
    """torchtitan's names: tok_embeddings, layers (a ModuleDict), norm, lm_head."""

    def __init__(self, n: int, d: int = 16, vocab: int = 32) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, d)
        self.layers = nn.ModuleDict({str(i): _Block(d) for i in range(n)})
        self.norm = nn.RMSNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)


class _HF(nn.Module):
    """Hugging Face's nesting: model.{embed_tokens, layers, norm} and lm_head."""

    def __init__(self, n: int, d: int = 16, vocab: int = 32) -> None:
        super().__init__()
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(vocab, d)
        self.model.layers = nn.ModuleList(_Block(d) for _ in range(n))
        self.model.norm = nn.RMSNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)


def test_stage_fqns_equal_torchtitans_own_split() -> None:
    """Every (stages, layers, weights) torchtitan accepts gives its lists; every one it refuses is refused."""
    pp = pytest.importorskip("torchtitan.distributed.pipeline_parallel")
    for stages, layers, iw, ow in itertools.product(range(1, 9), range(1, 14), range(3), range(3)):
        try:
            ref = pp._generate_llm_fqn_per_model_part(stages, layers, iw, ow)
        except ValueError:
            ref = None
        try:
            got = [list(s) for s in stage_fqns(stages, layers, input_weight=iw, output_weight=ow)]
        except ValueError:
            got = None
        assert got == ref, (stages, layers, iw, ow)


def test_split_hand_computed_default_weights() -> None:
    """6 layers, 4 stages: 8 effective layers, 2 each; the embedding and the head take one slot."""
    split = split_model(_Titan(6), 4)
    assert split.stages == (
        ("tok_embeddings", "layers.0"),
        ("layers.1", "layers.2"),
        ("layers.3", "layers.4"),
        ("layers.5", "norm", "lm_head"),
    )
    assert split.method.startswith("torchtitan's default split")
    assert [split.rank_stages(r) for r in range(4)] == [(0,), (1,), (2,), (3,)]


def test_split_nested_names_and_looped_stages() -> None:
    """HF nesting: the input and output modules are found on each level, in model order; with 2
    stages per rank pipeline rank r holds stages r and r + pp."""
    split = split_model(_HF(6), 2, stages_per_rank=2)
    assert split.layers == "model.layers"
    assert split.input_modules == ("model.embed_tokens",)
    assert split.output_modules == ("model.norm", "lm_head")
    assert split.stages[0] == ("model.embed_tokens", "model.layers.0")
    assert split.stages[3] == ("model.layers.5", "model.norm", "lm_head")
    assert split.rank_stages(0) == (0, 2) and split.rank_stages(1) == (1, 3)
    assert "stage 3 (pp rank 1): layer 5 + model.norm, lm_head" in split.describe()


def test_stage_model_keeps_fqns_and_shares_parameters() -> None:
    model = _HF(4)
    split = split_model(model, 2)
    part = stage_model(model, split, 1)
    names = [n for n, _ in part.named_parameters()]
    assert names[0] == "model.layers.2.attn.weight" and names[-1] == "lm_head.weight"
    assert part.get_parameter("lm_head.weight") is model.lm_head.weight
    assert isinstance(part.get_submodule("model.norm"), nn.RMSNorm)


def test_split_refusals_name_the_fix() -> None:
    with pytest.raises(ValueError, match="no layer container"):
        split_model(nn.Sequential(nn.Linear(2, 2)), 2)
    with pytest.raises(ValueError, match="cannot be more than the 8 effective layers"):
        split_model(_Titan(6), 9)
    from dmuon import _zoo

    vit = _zoo.vit_b16()  # cls_token / pos_embed sit on the root: one stage holds them, two cannot
    assert stage_model(vit, split_model(vit, 1), 0) is vit
    with pytest.raises(ValueError, match="the root module holds parameters directly"):
        split_model(vit, 2)


def test_compile_stages_one_plan_per_stage() -> None:
    """Each stage's plan holds exactly its own layers' matrices, under the whole model's FQNs,
    and equals compile() on that stage alone; reuse_equal_stages shares equal stages' plans."""
    with torch.device("meta"):
        model = _HF(6)
    sp = compile_stages(model, 4, pp=3)
    assert len(sp.plans) == 3
    assert sp.plans[1].dedicated == tuple(f"model.layers.{i}.{m}.weight" for i in (2, 3, 4) for m in ("attn", "mlp"))
    assert sp.plans[1] == dmuon.plan.compile(stage_model(model, sp.split, 1), 4)
    assert "=== stage 2 of 3 (pp rank 2) ===" in sp.summary()
    shared = compile_stages(model, 4, pp=3, reuse_equal_stages=True)
    assert shared.plans[0] is not shared.plans[1] and shared.plans[1] is not shared.plans[2]  # first / last differ
    eight = compile_stages(_HF(8), 4, pp=2, stages_per_rank=2, reuse_equal_stages=True)  # 10 effective: 3, 3, 2, 2
    assert [len(s) for s in eight.split.stages] == [3, 3, 2, 3]
    assert eight.plans[1] is not eight.plans[2]  # 3 layers vs 2 layers
    with pytest.raises(ValueError, match=r"stage 3 of 4 \(model.norm, lm_head\) holds no matrix tensor parallelism"):
        tiny = dmuon.sim.zoo.tiny_llama()
        compile_stages(
            tiny,
            2,
            pp=2,
            stages_per_rank=2,
            tp=dmuon.plan.TPPolicy(size=2, shard_dims=dmuon.plan.megatron_tp_shard_dims(tiny)),
        )
    ten = compile_stages(_HF(10), 4, pp=4, reuse_equal_stages=True)  # 12 effective: 2+embed, 3, 3, 2+head
    assert ten.plans[1] is ten.plans[2] and ten.plans[1].dedicated[0] == "model.layers.2.attn.weight"


def test_plan_cli_pp_prints_the_split_and_one_plan_per_stage(capsys, tmp_path) -> None:
    from dmuon._cli import main

    assert main(["plan", "--model", "tiny-llama", "--mesh", "2", "--pp", "2", "--json", str(tmp_path / "p.json")]) == 0
    out = capsys.readouterr().out
    assert "2 stages on 2 pipeline ranks (1 per rank), 4 layers of model.layers; torchtitan's default split" in out
    assert "stage 1 (pp rank 1): layers 2-3 + model.norm, lm_head" in out
    assert out.count("sharding plan: mesh (R=1, N=2)") == 2
    back = dmuon.plan.ShardingPlan.from_json((tmp_path / "p.stage1.json").read_text())
    assert back.dedicated[0] == "model.layers.2.self_attn.q_proj.weight"
    for argv, msg in [
        (["--pp", "2", "--stages-per-rank", "4"], "8 stages cannot be more than the 6 effective layers"),
        (["--stages-per-rank", "2"], "--stages-per-rank needs --pp K > 1"),
        (["--pp", "2", "--schedule", "0"], "--schedule with --pp"),
    ]:
        with pytest.raises(SystemExit) as e:
            main(["plan", "--model", "tiny-llama", "--mesh", "2", *argv])
        assert e.value.code == 2 and msg in capsys.readouterr().err
