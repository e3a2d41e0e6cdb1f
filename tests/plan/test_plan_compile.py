"""compile(): properties over random models, presets, records, JSON, diff, optree."""

from __future__ import annotations

import dataclasses
import json
import random
from collections import defaultdict

import optree
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import dmuon.plan as P
from dmuon.plan._cost import nbytes as plan_nbytes
from dmuon.plan._cost import weights as plan_cost
from dmuon.sim import zoo
from dmuon.plan import Owner, ShardingPlan

SETTINGS = settings(max_examples=60, deadline=None, database=None)


# --------------------------------------------------------------------------- random models


@st.composite
def model_specs(draw):
    """layers -> list of (name, shape, dtype); plus a mesh and a registration-order seed."""
    n_layers = draw(st.integers(1, 5))
    layers = []
    for _ in range(n_layers):
        n = draw(st.integers(1, 6))
        params = []
        for j in range(n):
            shape = (draw(st.integers(1, 12)), draw(st.integers(1, 12)))
            dtype = draw(st.sampled_from([torch.float32, torch.bfloat16]))
            params.append((f"m{j}", shape, dtype))
        layers.append(params)
    mesh = draw(st.sampled_from([1, 2, 3, 4, (2, 2), (3, 2), (2, 3)]))
    seed = draw(st.integers(0, 2**16))
    cost_model = draw(st.sampled_from(["numel", "ns_flops"]))
    return layers, mesh, seed, cost_model


def build(layers, order_seed: int | None = None) -> nn.Module:
    """``layers.{i}.{name}.weight`` + a norm per layer; registration order shuffled by seed."""
    rng = random.Random(order_seed)
    with torch.device("meta"):
        root = nn.Module()
        container = nn.Module()
        root.add_module("embed", nn.Embedding(5, 3))
        root.add_module("layers", container)
        idx = list(range(len(layers)))
        if order_seed is not None:
            rng.shuffle(idx)
        for i in idx:
            layer = nn.Module()
            items = list(layers[i])
            if order_seed is not None:
                rng.shuffle(items)
            for name, shape, dtype in items:
                lin = nn.Module()
                lin.register_parameter("weight", nn.Parameter(torch.empty(shape, dtype=dtype)))
                layer.add_module(name, lin)
            layer.add_module("norm", nn.LayerNorm(3))
            container.add_module(str(i), layer)
    return root


@SETTINGS
@given(model_specs())
def test_one_owner_per_matrix_and_valid_layout(spec):
    layers, mesh, _, cost_model = spec
    plan = P.compile(build(layers), mesh, cost_model=cost_model)
    R, N = plan.mesh_shape
    # a side of 1 is a vector, not a matrix: the default rule leaves it to AdamW
    expected = [
        f"layers.{i}.{name}.weight" for i, params in enumerate(layers) for name, shape, _ in params if min(shape) > 1
    ]
    assert plan.dedicated == tuple(expected)
    seen = defaultdict(list)
    for boundary in plan.boundaries:
        for buf in boundary.buffers:
            for entry in buf.entries():
                seen[entry.fqn].append((boundary.fqn, entry.owner))
                assert entry.offset % plan.align_numel == 0
            for sub in buf.subsegments():
                assert sub.flags_offset % plan.align_numel == 0 and sub.numel % plan.align_numel == 0
    for fqn, owner in zip(plan.dedicated, plan.owners):
        assert seen[fqn] == [(fqn.rsplit(".", 2)[0], owner)]  # exactly one entry, owner agrees
        assert 0 <= owner.shard < N and 0 <= owner.replicate < R
        assert owner.rank == owner.replicate * N + owner.shard
    assert sum(plan.owned_numel) == sum(p.numel for p in plan.params)
    # balance bound in the plan's own cost model
    weights = [plan_cost.param_weight(p, cost_model) for p in plan.params]
    assert max(plan.owned_weight) * plan.world_size <= sum(weights) + plan.world_size * max(weights, default=0)
    # cost invariants
    c = plan.cost
    assert sum(c.per_rank_nbytes) == c.total_nbytes and len(c.per_rank_nbytes) == R * N
    if R == 1:
        assert c.replicate_reduce_nbytes == c.replicate_broadcast_nbytes == 0


@SETTINGS
@given(model_specs())
def test_owners_independent_of_registration_order(spec):
    layers, mesh, seed, cost_model = spec
    base = P.compile(build(layers), mesh, cost_model=cost_model)
    shuffled = P.compile(build(layers, order_seed=seed), mesh, cost_model=cost_model)
    assert set(base.dedicated) == set(shuffled.dedicated)
    for fqn in base.dedicated:
        assert base.owner(fqn) == shuffled.owner(fqn)
        assert base.boundary(fqn) == shuffled.boundary(fqn)
    # determinism: same model, same arguments -> byte-identical plan
    again = P.compile(build(layers, order_seed=seed), mesh, cost_model=cost_model)
    assert again == shuffled and again.fingerprint() == shuffled.fingerprint()


@SETTINGS
@given(model_specs(), st.booleans(), st.sampled_from([None, "bfloat16"]))
def test_json_round_trip_and_self_diff(spec, z2, param_dtype):
    layers, mesh, _, cost_model = spec
    mp = None if param_dtype is None else type("MP", (), {"param_dtype": param_dtype, "reduce_dtype": "float32"})()
    plan = P.compile(build(layers), mesh, cost_model=cost_model, reshard_after_forward=not z2, mp_policy=mp)
    text = plan.to_json()
    back = ShardingPlan.from_json(text)
    assert back == plan
    assert back.to_json() == text
    assert back.fingerprint() == plan.fingerprint()
    assert back.cost == plan.cost
    d = P.diff(plan, back)
    assert d.empty and not d and str(d) == "PlanDiff: no differences"


# --------------------------------------------------------------------------- presets


def _balance_ratio(plan: ShardingPlan) -> float:
    total = sum(p.numel for p in plan.params)
    largest = max(p.numel for p in plan.params)
    N = plan.world_size
    return max(plan.owned_numel) / max(total / N, largest)


@pytest.fixture(scope="module")
def llama8b():
    return zoo.llama3_8b()


def test_llama3_8b_shapes(llama8b):
    shapes = {n: tuple(p.shape) for n, p in llama8b.named_parameters()}
    layer = "model.layers.31."
    assert shapes[layer + "self_attn.q_proj.weight"] == (4096, 4096)
    assert shapes[layer + "self_attn.k_proj.weight"] == (1024, 4096)
    assert shapes[layer + "self_attn.v_proj.weight"] == (1024, 4096)
    assert shapes[layer + "self_attn.o_proj.weight"] == (4096, 4096)
    assert shapes[layer + "mlp.gate_proj.weight"] == (14336, 4096)
    assert shapes[layer + "mlp.up_proj.weight"] == (14336, 4096)
    assert shapes[layer + "mlp.down_proj.weight"] == (4096, 14336)
    assert shapes[layer + "input_layernorm.weight"] == (4096,)
    assert shapes["model.embed_tokens.weight"] == (128256, 4096)
    assert shapes["lm_head.weight"] == (128256, 4096)
    assert "model.layers.32.mlp.up_proj.weight" not in shapes


@pytest.mark.parametrize("N, limit", [(8, 1.05), (64, 1.10)])
def test_llama3_8b_balance(llama8b, N, limit):
    plan = P.compile(llama8b, N)
    assert len(plan.dedicated) == 32 * 7
    assert _balance_ratio(plan) <= limit


def test_llama3_8b_layers_spread_over_distinct_owners(llama8b):
    plan = P.compile(llama8b, 8)
    per_boundary = defaultdict(set)
    for fqn, owner in zip(plan.dedicated, plan.owners):
        per_boundary[plan.boundary(fqn)].add(owner.rank)
    assert len(per_boundary) == 32
    assert all(len(ranks) == 7 for ranks in per_boundary.values())


def test_llama3_8b_hsdp_covers_every_slot(llama8b):
    plan = P.compile(llama8b, (2, 8))
    assert set(o.rank for o in plan.owners) == set(range(16))
    assert all(o.rank == o.replicate * 8 + o.shard for o in plan.owners)
    c = plan.cost
    assert c.replicate_reduce_nbytes > 0 and c.replicate_broadcast_nbytes > 0


def test_meta_model_compiles_without_allocating_or_mutating():
    model = zoo.llama3_405b()  # ~1.6 TB if materialised in fp32
    before = {n: p for n, p in model.named_parameters()}
    plan = P.compile(model, (2, 64), reshard_after_forward=False)
    after = dict(model.named_parameters())
    assert after.keys() == before.keys()
    assert all(after[n] is before[n] and p.device.type == "meta" for n, p in before.items())
    assert len(plan.dedicated) == 126 * 7
    assert plan.param("model.layers.0.mlp.down_proj.weight").shape == (16384, 53248)


def test_cpu_model_is_not_mutated():
    model = zoo.tiny_llama(device="cpu")
    state = {k: (v.data_ptr(), v.clone()) for k, v in model.state_dict().items()}
    P.compile(model, 4)
    for k, v in model.state_dict().items():
        assert v.data_ptr() == state[k][0] and torch.equal(v, state[k][1])


def test_presets_all_compile():
    for name, builder in zoo.PRESETS.items():
        if name == "llama3-405b":
            continue  # covered above
        plan = P.compile(builder(), 4)
        assert plan.dedicated, name


def test_vit_and_moe_presets():
    vit = zoo.vit_b16()
    plan = P.compile(vit, 8)
    assert [b.fqn for b in plan.boundaries] == [f"blocks.{i}" for i in range(12)]
    assert plan.param("blocks.0.attn.qkv.weight").shape == (2304, 768)
    assert not plan.is_dedicated("patch_embed.proj.weight")  # conv outside boundaries
    moe = zoo.mixtral_8x7b()
    plan = P.compile(moe, 8, predicate=P.matrix_predicate(moe), cost_model="ns_flops")
    spec = plan.param("layers.0.mlp.experts.w1")
    assert (spec.shape, spec.matrix_shape, spec.num_matrices) == ((8, 14336, 4096), (14336, 4096), 8)


# --------------------------------------------------------------------------- mesh / arguments


class FakeMesh:
    def __init__(self, shape):
        self.shape = shape


@pytest.mark.parametrize(
    "mesh, shape",
    [
        (4, (1, 4)),
        ((4,), (1, 4)),
        ((2, 4), (2, 4)),
        ([2, 4], (2, 4)),
        (FakeMesh((8,)), (1, 8)),
        (FakeMesh((2, 4)), (2, 4)),
    ],
)
def test_mesh_forms(mesh, shape):
    assert P.normalize_mesh(mesh) == shape
    assert P.compile(zoo.tiny_llama(), mesh).mesh_shape == shape


@pytest.mark.parametrize("mesh", [0, (2, 0), (1, 2, 3), True, "8", 2.5])
def test_bad_mesh(mesh):
    with pytest.raises(ValueError):
        P.normalize_mesh(mesh)


def test_bad_arguments():
    model = zoo.tiny_llama()
    with pytest.raises(ValueError, match="cost_model"):
        P.compile(model, 2, cost_model="time")
    with pytest.raises(ValueError, match="align_numel"):
        P.compile(model, 2, align_numel=0)
    with pytest.raises(TypeError, match="nn.Module"):
        P.compile({"w": torch.empty(2, 2)}, 2)


def test_cost_model_ns_flops_changes_weights():
    plan = P.compile(zoo.tiny_llama(), 4, cost_model="ns_flops")
    spec = plan.param("model.layers.0.mlp.down_proj.weight")  # (64, 160): m=64, n=160
    assert plan_cost.param_weight(spec, "ns_flops") == 5 * (4 * 64 * 64 * 160 + 2 * 64**3)
    assert sum(plan.owned_weight) == sum(plan_cost.param_weight(p, "ns_flops") for p in plan.params)


# --------------------------------------------------------------------------- records


def test_records_are_frozen_and_validated():
    plan = P.compile(zoo.tiny_llama(), 2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.mesh_shape = (1, 4)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.owners[0].rank = 3
    assert not hasattr(plan.owners[0], "__dict__")  # slots
    with pytest.raises(TypeError):
        Owner(0, 0, 0)  # kw_only
    with pytest.raises(ValueError, match="not on mesh"):
        dataclasses.replace(plan, owners=(Owner(shard=5, replicate=0, rank=5),) + plan.owners[1:])
    other = 1 - plan.owners[0].rank  # the other rank of N=2: layouts now disagree with owners
    with pytest.raises(ValueError, match="disagrees"):
        dataclasses.replace(plan, owners=(Owner(shard=other, replicate=0, rank=other),) + plan.owners[1:])
    with pytest.raises(ValueError, match="numel"):
        dataclasses.replace(plan.params[0], numel=3)
    # a tampered JSON is rejected
    d = json.loads(plan.to_json())
    d["boundaries"][0]["buffers"][0]["segments"][0]["subsegments"][0]["entries"][0]["offset"] = 1
    with pytest.raises(ValueError):
        ShardingPlan.from_json(json.dumps(d))
    d = json.loads(plan.to_json())
    d["format"] = "something/0"
    with pytest.raises(ValueError, match="format"):
        ShardingPlan.from_json(json.dumps(d))


def test_plan_accessors():
    plan = P.compile(zoo.tiny_llama(), (2, 2))
    assert plan.world_size == 4
    assert len(plan.owned_numel) == 4
    assert plan.bcast_dtype("torch.float32") == "torch.float32"
    assert plan.reduce_dtype_for("torch.bfloat16") == "torch.bfloat16"
    stats = plan.rank_stats()
    assert [s.rank for s in stats] == [0, 1, 2, 3]
    assert tuple(s.owned_numel for s in stats) == plan.owned_numel
    assert tuple(s.comm_nbytes for s in stats) == plan.cost.per_rank_nbytes
    base = plan.baseline_rank_stats()
    # naive Muon: every rank runs NS on every matrix
    assert all(b.ns_flops == sum(s.ns_flops for s in stats) for b in base)
    assert plan.cost.total_nbytes < plan.baseline_cost.total_nbytes
    html = plan._repr_html_()
    assert html.startswith("<div") and "FSDP2+naive" in html
    text = plan.summary()
    assert "DMuon-Z3 HSDP" in text and "saving vs FSDP2+naive" in text


def test_fsdp2_baseline_matches_formula():
    # 1-D, Z3, fp32: baseline = 4 (N-1) S with S the padded dedicated bytes; DMuon = 3 (N-1) P with
    # P the packed bytes: a broadcast buffer's segments, an all-gathered buffer's N slots
    for mode in ("broadcast", "auto"):
        plan = P.compile(zoo.tiny_llama(), 4, collectives=mode)
        S = sum(plan_nbytes.fsdp2_shard_numel(p.shape, 4) * 4 * 4 for p in plan.params)
        assert plan.baseline_cost.total_nbytes == 4 * 3 * S
        Pm = sum(
            (buf.numel if buf.collective == "broadcast" else 4 * buf.slot_numel) * 4
            for b in plan.boundaries
            for buf in b.buffers
        )
        assert plan.cost.total_nbytes == 3 * 3 * Pm


# --------------------------------------------------------------------------- optree


def test_optree_registration():
    model = zoo.tiny_llama()
    a = P.compile(model, 4)
    b = P.compile(model, 4)
    leaves = optree.tree_leaves(a, namespace="dmuon")
    assert len(leaves) == 2 * len(a.params) + len(a.boundaries)
    assert leaves[0] is a.params[0] and leaves[len(a.params)] is a.owners[0]
    paths = optree.tree_paths(a, namespace="dmuon")
    assert paths[0] == ("params", 0) and paths[len(a.params)] == ("owners", 0)
    same = optree.tree_map(lambda x, y: x == y, a, b, namespace="dmuon")
    assert all(optree.tree_leaves(same, namespace="dmuon"))
    ranks = optree.tree_map(lambda x: x.rank if isinstance(x, Owner) else None, a, namespace="dmuon", none_is_leaf=True)
    assert ranks.owners == tuple(o.rank for o in a.owners)
    # round trip through flatten/unflatten gives an equal, working plan
    leaves, spec = optree.tree_flatten(a, namespace="dmuon")
    c = optree.tree_unflatten(spec, leaves)
    assert c == a and c.owner(a.dedicated[3]) == a.owners[3]
    # different settings -> different treespec
    with pytest.raises(ValueError):
        optree.tree_map(lambda x, y: x, a, P.compile(model, 8), namespace="dmuon")


# --------------------------------------------------------------------------- diff


def test_diff_z2_vs_z3_only_costs_and_setting():
    model = zoo.tiny_llama()
    z3 = P.compile(model, 4)
    z2 = P.compile(model, 4, reshard_after_forward=False)
    d = P.diff(z3, z2)
    assert d and not d.empty
    assert d.changes == ()
    assert [s.name for s in d.settings] == ["reshard_after_forward"]
    assert d.cost_delta("backward_broadcast_nbytes") == -z3.cost.backward_broadcast_nbytes
    assert d.cost_delta("forward_broadcast_nbytes") == 0
    assert "reshard_after_forward" in str(d) and "backward_broadcast_nbytes" in str(d)


def test_diff_across_mesh_sizes_and_hsdp():
    model = zoo.tiny_llama()
    p4, p8, h = P.compile(model, 4), P.compile(model, 8), P.compile(model, (2, 4))
    d = P.diff(p4, p8)
    assert set(d.owners_moved) == {f for f in p4.dedicated if p4.owner(f) != p8.owner(f)}
    assert d.owners_moved and not d.added and not d.removed and not d.boundaries_changed
    f = d.owners_moved[0]
    assert d[f].owner_before == p4.owner(f) and d[f].owner_after == p8.owner(f)
    assert "owner rank" in str(d) and "mesh_shape" in str(d)
    dh = P.diff(p4, h)
    assert dh.cost_delta("replicate_reduce_nbytes") == h.cost.replicate_reduce_nbytes
    assert any(s.name == "mesh_shape" and s.after == (2, 4) for s in dh.settings)


def test_diff_added_removed_and_boundaries():
    model = zoo.tiny_llama()
    full = P.compile(model, 4)
    fewer = P.compile(
        model,
        4,
        predicate=lambda fqn, p: p.ndim == 2 and "embed" not in fqn and "lm_head" not in fqn and "q_proj" not in fqn,
    )
    d = P.diff(full, fewer)
    assert set(d.removed) == {f"model.layers.{i}.self_attn.q_proj.weight" for i in range(4)}
    assert P.diff(fewer, full).added == d.removed
    inner = P.compile(
        model,
        4,
        hook_boundary_predicate=lambda m: type(m).__name__ == "LlamaMLP" or type(m).__name__ == "LlamaDecoderLayer",
    )
    db = P.diff(full, inner)
    assert set(db.boundaries_changed) == {
        f"model.layers.{i}.mlp.{n}_proj.weight" for i in range(4) for n in ("gate", "up", "down")
    }
    assert "boundary model.layers.0 -> model.layers.0.mlp" in str(db)
    with pytest.raises(KeyError):
        db["model.layers.0.no_such.weight"]
