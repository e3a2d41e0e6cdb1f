"""Hook-boundary resolution and parameter selection (boundaries.py, selection.py)."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import dmuon
import dmuon.plan as P
from dmuon.sim import zoo
from dmuon.plan._model.boundaries import ancestors, heuristic_boundary
from oracle import Block


def tree(params: dict[str, tuple[int, ...]], special: dict[str, nn.Module] | None = None) -> nn.Module:
    """A meta model holding exactly ``params`` (FQN -> shape) under generic nn.Modules; modules at
    the FQNs in ``special`` are given instances (e.g. nn.Conv2d) instead of generic ones."""
    special = special or {}
    with torch.device("meta"):
        root = nn.Module()
        for path, mod in special.items():
            _ensure(root, path, mod)
        for fqn, shape in params.items():
            mod_path, _, attr = fqn.rpartition(".")
            owner = _ensure(root, mod_path, None)
            if attr not in dict(owner.named_parameters(recurse=False)):
                owner.register_parameter(attr, nn.Parameter(torch.empty(shape)))
    return root


def _ensure(root: nn.Module, path: str, leaf: nn.Module | None) -> nn.Module:
    mod = root
    if not path:
        return mod
    parts = path.split(".")
    for i, part in enumerate(parts):
        child = mod._modules.get(part)
        if child is None:
            child = leaf if (leaf is not None and i == len(parts) - 1) else nn.Module()
            mod.add_module(part, child)
        mod = child
    return mod


# --------------------------------------------------------------------------- heuristic


@pytest.mark.parametrize(
    "param, boundary",
    [
        ("model.layers.3.self_attn.q_proj.weight", "model.layers.3"),  # Llama / Qwen
        ("model.layers.3.mlp.experts.7.w1", "model.layers.3"),  # MoE experts below a layer
        ("layers.0.mlp.0.weight", "layers.0"),  # nn.Sequential mlp inside a layer
        ("transformer.h.11.attn.c_attn.weight", "transformer.h.11"),  # GPT-2
        ("encoder.layer.5.attention.self.query.weight", "encoder.layer.5"),  # BERT
        ("blocks.4.mlp.fc1.weight", "blocks.4"),  # ViT / timm
        ("encoder.block.0.layer.1.DenseReluDense.wi.weight", "encoder.block.0"),  # T5
        ("decoder.block.2.layer.0.SelfAttention.q.weight", "decoder.block.2"),  # T5 decoder
        ("stages.1.blocks.2.mlp.fc1.weight", "stages.1.blocks.2"),  # Swin / ConvNeXt
        ("features.3.conv.weight", "features.3"),  # fallback: outermost <name>.<int>
        ("trunk.0.sub.4.weight", "trunk.0"),  # fallback picks the OUTERMOST
        ("0.weight", "0"),  # nn.Sequential root: bare <int>
    ],
)
def test_heuristic_architectures(param, boundary):
    module_fqn = param.rpartition(".")[0]
    assert heuristic_boundary(module_fqn) == boundary
    # and through compile, on a model with exactly that path
    plan = P.compile(tree({param: (4, 4)}), 2)
    assert plan.boundary(param) == boundary
    assert plan.boundaries[0].fqn == boundary and not plan.boundaries[0].fallback


@pytest.mark.parametrize("module_fqn", ["", "encoder", "lm_head", "model.norm", "layers", "layers.x"])
def test_heuristic_none(module_fqn):
    assert heuristic_boundary(module_fqn) is None


def test_ancestors():
    assert ancestors("a.b.c") == ("", "a", "a.b", "a.b.c")
    assert ancestors("") == ("",)


def test_default_selection_llama_like():
    plan = P.compile(zoo.tiny_llama(), 4)
    assert len(plan.dedicated) == 4 * 7
    assert all(f.startswith("model.layers.") and f.endswith("_proj.weight") for f in plan.dedicated)
    # excluded: embedding, lm_head (no boundary), RMSNorm weights (1-D)
    for f in ("model.embed_tokens.weight", "lm_head.weight", "model.layers.0.input_layernorm.weight"):
        assert not plan.is_dedicated(f)
    assert [b.fqn for b in plan.boundaries] == [f"model.layers.{i}" for i in range(4)]


# --------------------------------------------------------------------------- predicate boundaries


def test_hook_boundary_predicate_picks_innermost():
    model = tree(
        {"stack.a.inner.w": (4, 4), "stack.a.v": (4, 4), "stack.b.w": (4, 4)},
    )
    marked = {model.stack, model.stack.a, model.stack.a.inner}
    plan = P.compile(
        model,
        2,
        predicate=lambda fqn, p: p.ndim == 2,
        hook_boundary_predicate=lambda m: m in marked,
    )
    assert plan.boundary("stack.a.inner.w") == "stack.a.inner"  # own module matches: innermost
    assert plan.boundary("stack.a.v") == "stack.a"
    assert plan.boundary("stack.b.w") == "stack"  # stack.b not marked -> next ancestor
    assert [b.fqn for b in plan.boundaries] == ["stack", "stack.a", "stack.a.inner"]


def test_hook_boundary_predicate_root():
    model = tree({"w": (4, 4)})
    plan = P.compile(model, 2, predicate=lambda f, p: True, hook_boundary_predicate=lambda m: m is model)
    assert plan.boundary("w") == ""


def test_hook_boundary_predicate_by_type():
    plan = P.compile(
        zoo.tiny_llama(),
        2,
        hook_boundary_predicate=lambda m: type(m).__name__ in ("LlamaAttention", "LlamaMLP"),
    )
    assert plan.boundary("model.layers.1.self_attn.k_proj.weight") == "model.layers.1.self_attn"
    assert plan.boundary("model.layers.1.mlp.down_proj.weight") == "model.layers.1.mlp"
    assert len(plan.boundaries) == 8


# --------------------------------------------------------------------------- strict / fallback


def test_strict_error_lists_every_param_and_fixes():
    model = zoo.tiny_llama()
    with pytest.raises(ValueError) as info:
        P.compile(model, 2, predicate=lambda fqn, p: p.ndim == 2 and "embed" not in fqn)
    msg = str(info.value)
    assert "lm_head.weight" in msg
    assert "1 dedicated parameter(s) have no hook-boundary ancestor" in msg
    for fix in ("hook_boundary_predicate", "predicate", "hook_boundary_strict=False"):
        assert fix in msg

    model = tree({"a.w": (2, 2), "b.w": (2, 2), "layers.0.w": (2, 2)})
    with pytest.raises(ValueError) as info:
        P.compile(model, 2, predicate=lambda fqn, p: True)
    assert "a.w" in str(info.value) and "b.w" in str(info.value) and "2 dedicated" in str(info.value)


def test_non_strict_fallback_to_own_module():
    model = zoo.tiny_llama()
    plan = P.compile(
        model,
        2,
        predicate=lambda fqn, p: p.ndim == 2 and "embed" not in fqn,
        hook_boundary_strict=False,
    )
    assert plan.boundary("lm_head.weight") == "lm_head"
    b = plan.boundary_record("lm_head.weight")
    assert b.fallback is True
    assert not plan.boundary_record("model.layers.0.mlp.up_proj.weight").fallback
    assert "1 fallback: lm_head" in plan.summary()
    assert [x.fqn for x in plan.boundaries][-1] == "lm_head"  # named_modules order


# --------------------------------------------------------------------------- selection and views


def test_one_d_selected_raises_naming_fqn():
    model = zoo.tiny_llama()
    with pytest.raises(ValueError, match=r"model\.layers\.0\.input_layernorm\.weight: is 1-D") as info:
        P.compile(model, 2, predicate=lambda fqn, p: fqn.startswith("model.layers.0."))
    assert "exclude them in predicate" in str(info.value)


def test_zero_d_selected_raises():
    model = tree({"layers.0.scale": ()})
    with pytest.raises(ValueError, match=r"layers\.0\.scale: is 0-D"):
        P.compile(model, 2, predicate=lambda f, p: True)


def test_conv_view():
    with torch.device("meta"):
        conv = nn.Conv2d(3, 8, kernel_size=(3, 5), bias=False)  # weight (8, 3, 3, 5)
        conv1 = nn.Conv1d(4, 6, kernel_size=2, bias=False)  # weight (6, 4, 2): 3-D but conv
    model = tree({}, special={"blocks.0.conv": conv, "blocks.0.conv1": conv1})
    plan = P.compile(model, 2, predicate=lambda f, p: True)
    spec = plan.param("blocks.0.conv.weight")
    assert (spec.shape, spec.matrix_shape, spec.num_matrices) == ((8, 3, 3, 5), (8, 45), 1)
    spec1 = plan.param("blocks.0.conv1.weight")
    assert (spec1.matrix_shape, spec1.num_matrices) == ((6, 8), 1)
    # default predicate: only 2-D -> conv weights not selected; an empty plan is valid
    empty = P.compile(model, 2)
    assert empty.params == () and empty.boundaries == ()
    assert empty.cost.total_nbytes == 0 and empty.owned_numel == (0, 0)
    assert "dedicated: 0 params" in empty.summary()


def test_default_predicate_selects_experts_and_experts_off_restores_2d_only():
    model = zoo.tiny_moe()  # torchtitan-style GroupedExperts: experts.w1/w3 (4, 48, 32), w2 (4, 32, 48)
    plan = P.compile(model, 2)
    assert {f for f in plan.dedicated if ".experts." in f} == {
        f"layers.{i}.mlp.experts.{w}" for i in range(2) for w in ("w1", "w2", "w3")
    }
    assert plan.param("layers.0.mlp.experts.w1").experts.layout == "torchtitan"
    assert plan.is_dedicated("layers.0.mlp.gate.weight")  # router (E, hidden) is 2-D
    with pytest.warns(UserWarning, match=r"experts='off' leaves 6 expert stacks"):
        old = P.compile(model, 2, experts="off")
    assert not any(".experts." in f for f in old.dedicated)
    assert old.is_dedicated("layers.0.mlp.gate.weight")


def test_expert_stack_view():
    model = zoo.tiny_moe()  # experts.w1/w3 (4, 48, 32), w2 (4, 32, 48)
    plan = P.compile(model, 4, predicate=P.matrix_predicate(model))
    spec = plan.param("layers.1.mlp.experts.w2")
    assert (spec.shape, spec.matrix_shape, spec.num_matrices, spec.numel) == ((4, 32, 48), (32, 48), 4, 6144)
    assert plan.boundary("layers.1.mlp.experts.w2") == "layers.1"
    # ns_flops weights count each expert matrix: 4 * 5 * (4*32*32*48 + 2*32**3)
    from dmuon.plan._cost.flops import ns_flops

    assert ns_flops(32, 48, num_matrices=4) == 4 * 5 * (4 * 32 * 32 * 48 + 2 * 32**3)
    assert ns_flops(48, 32) == ns_flops(32, 48)
    assert "embed.weight" not in plan.dedicated and "lm_head.weight" not in plan.dedicated


def test_four_d_non_conv_and_conv_transpose_raise():
    model = tree({"layers.0.w": (2, 3, 4, 5)})
    with pytest.raises(ValueError, match=r"layers\.0\.w: is 4-D .* not an nn\.Conv1d/2d/3d weight"):
        P.compile(model, 2, predicate=lambda f, p: True)
    with torch.device("meta"):
        deconv = nn.ConvTranspose1d(4, 6, kernel_size=3, bias=False)  # weight (4, 6, 3)
    model = tree({}, special={"layers.0.up": deconv})
    with pytest.raises(ValueError, match=r"layers\.0\.up\.weight: is a ConvTranspose weight"):
        P.compile(model, 2, predicate=lambda f, p: True)


# --------------------------------------------------------------------------- ties


def test_tied_embedding_is_excluded_under_every_alias():
    model = zoo.tiny_llama(tie_embeddings=True)
    # lm_head.weight IS model.embed_tokens.weight: not dedicated, even if a predicate ignores it
    plan = P.compile(model, 2)
    assert not plan.is_dedicated("lm_head.weight")


def test_tied_within_one_boundary_accepts_any_alias():
    model = tree({"layers.0.a.w": (4, 4), "layers.0.b.v": (3, 4)})
    model.layers.get_submodule("0").b.w = model.layers.get_submodule("0").a.w  # alias inside the same boundary
    plan = P.compile(model, 2)
    assert plan.dedicated == ("layers.0.a.w", "layers.0.b.v")
    spec = plan.param("layers.0.b.w")
    assert spec.fqn == "layers.0.a.w"
    assert spec.aliases == ("layers.0.a.w", "layers.0.b.w")
    assert plan.owner("layers.0.b.w") == plan.owner("layers.0.a.w")
    assert plan.boundary("layers.0.b.w") == "layers.0"


def test_tied_across_boundaries_raises_naming_it():
    model = tree({"layers.0.w": (4, 4), "layers.1.v": (4, 4)})
    model.layers.get_submodule("1").w = model.layers.get_submodule("0").w
    with pytest.raises(ValueError, match=r"tied parameter 'layers\.0\.w'.*layers\.1\.w -> layers\.1") as info:
        P.compile(model, 2)
    assert "predicate=lambda fqn, p: fqn != 'layers.0.w'" in str(info.value)
    # excluding it via predicate works
    plan = P.compile(model, 2, predicate=lambda fqn, p: fqn != "layers.0.w")
    assert plan.dedicated == ("layers.1.v",)


def test_unknown_fqn_keyerror_names_closest():
    plan = P.compile(zoo.tiny_llama(), 2)
    with pytest.raises(KeyError, match=r"closest: model\.layers\.1\.mlp\.up_proj\.weight"):
        plan.owner("model.layers.1.mlp.up_proj.wieght")
    with pytest.raises(KeyError):
        plan.boundary("nope")
    with pytest.raises(KeyError):
        plan.param("model.embed_tokens.weight")


# ----------------------------------------------------------------------------------------------
# coverage warning
# ----------------------------------------------------------------------------------------------


class DictLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(11, 8)
        self.blocks = nn.ModuleDict({"first": Block(), "second": Block()})
        self.head = nn.Linear(8, 11)


class EncoderDecoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = Block()
        self.decoder = Block()


def _compile_warnings(model, **kw):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = dmuon.plan.compile(model, 2, **kw)
    return plan, [str(w.message) for w in caught if "hook boundary" in str(w.message)]


@pytest.mark.parametrize(
    "model,count,first",
    [
        (DictLM, "9 of 9", "blocks.first.fc1.weight"),
        (EncoderDecoder, "8 of 8", "encoder.fc1.weight"),
        (Block, "4 of 4", "fc1.weight"),
    ],
    ids=["moduledict", "plain_attributes", "one_block"],
)
def test_invisible_blocks_warn_with_the_fix(model, count, first):
    plan, msgs = _compile_warnings(model())
    assert plan.dedicated == () and len(msgs) == 1, msgs
    msg = msgs[0]
    assert "no matrix is dedicated" in msg and f"{count} 2-D matrices" in msg and first in msg, msg
    assert "Fix: hook_boundary_predicate=lambda module: isinstance(module, Block)" in msg, msg
    # the line it shows fixes it, without a warning
    fixed, msgs = _compile_warnings(model(), hook_boundary_predicate=lambda m: isinstance(m, Block))
    assert len(fixed.dedicated) == int(count.split()[0]) - (model is DictLM) and msgs == []


def test_lm_head_outside_the_blocks_does_not_warn():
    from oracle import TinyLM

    plan, msgs = _compile_warnings(TinyLM())
    assert len(plan.dedicated) == 12 and msgs == []
    # strict mode keeps its meaning: a predicate selecting the head still raises
    with pytest.raises(ValueError, match="no hook-boundary ancestor"):
        dmuon.plan.compile(TinyLM(), 2, predicate=lambda fqn, p: p.ndim == 2 and "embed" not in fqn)


def test_mostly_uncovered_warns():
    class Wide(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList([nn.Linear(4, 4)])  # 16 elements inside
            self.trunk = Block()  # 2·288 + 2·40 = 656 outside

    plan, msgs = _compile_warnings(Wide())
    assert plan.dedicated == ("layers.0.weight",) and len(msgs) == 1
    assert "most matrix elements are not dedicated: 4 of 5 2-D matrices (98% of their elements" in msgs[0], msgs


# ----------------------------------------------------------------------------------------------
# degenerate matrices
# ----------------------------------------------------------------------------------------------


class Degenerate(nn.Module):
    def __init__(self):
        super().__init__()
        block = nn.Module()
        block.fc = nn.Linear(8, 8)
        block.gate = nn.Linear(8, 1)  # (1, 8): a vector
        block.col = nn.Linear(1, 8, bias=False)  # (8, 1)
        block.depthwise = nn.Conv1d(8, 8, 3, groups=8)  # (8, 1, 3)
        block.pointwise = nn.Conv1d(8, 8, 1)  # (8, 8, 1): an (8, 8) matrix view
        block.layer_scale = nn.Parameter(torch.ones(8, 1, 1))  # C matrices of (1, 1)
        self.layers = nn.ModuleList([block])


def test_degenerate_views_stay_with_adamw():
    from dmuon.plan._model.selection import degenerate_reason
    from dmuon.plan._model.snapshot import take_snapshot

    model = Degenerate()
    assert dmuon.plan.compile(model, 2).dedicated == ("layers.0.fc.weight",)
    pred = dmuon.plan.matrix_predicate(model)
    assert dmuon.plan.compile(model, 2, predicate=pred).dedicated == ("layers.0.fc.weight", "layers.0.pointwise.weight")
    reasons = {r.fqn: degenerate_reason(r) for r in take_snapshot(model).params}
    assert reasons["layers.0.gate.weight"].startswith("matrix view (1, 8) has a side of 1")
    assert reasons["layers.0.col.weight"].startswith("matrix view (8, 1) has a side of 1")
    assert reasons["layers.0.depthwise.weight"].startswith("depthwise conv kernel (8, 1, 3)")
    assert reasons["layers.0.layer_scale"].startswith("matrix view (1, 1) has a side of 1")
    assert reasons["layers.0.fc.weight"] is None and reasons["layers.0.pointwise.weight"] is None
    # a user predicate may still select one (its view is defined): Muon normalises the vector
    plan = dmuon.plan.compile(model, 2, predicate=lambda fqn, p: fqn == "layers.0.gate.weight")
    assert plan.param("layers.0.gate.weight").matrix_shape == (1, 8)


def test_plan_summary_reports_vectors_left_to_adamw():
    plan = dmuon.plan.compile(Degenerate(), 2)
    text = plan.summary()
    assert (
        "left to AdamW inside hook boundaries, a side of 1 (not a matrix for Muon): 2: "
        "layers.0.gate.weight (1, 8), layers.0.col.weight (8, 1)"
    ) in text, text
    from oracle import TinyLM

    assert "left to AdamW inside hook boundaries" not in dmuon.plan.compile(TinyLM(), 2).summary()
