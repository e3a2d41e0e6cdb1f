"""Matrix views (per-head / split-QKV orthogonalisation) and QK-clip (MuonClip).

Plan level (pure): the view record and its JSON, the helpers' blocks for Llama (GQA) / GPT-2
``c_attn`` / Megatron's grouped QKV, NS FLOPs and LPT weights counted per block (hand-computed),
which TP combinations work (``tp_ns="local"``) and which raise, the QK-clip records, its
all-reduce in the schedule and the byte cost (hand-computed), QK-norm refused, summary / diff.

Runtime (gloo, W = 2 1-D and W = 4 HSDP (2, 2), fp32 NS), against a single-process oracle:
``torch.optim.Muon`` with every view block as its own 2-D parameter (gradients sliced out of the
full gradient, blocks copied back after the step), ``torch.optim.AdamW`` on the rest, and the
QK-clip rule applied after the step, head by head, from the reference's own forward logits
(written independently of ``dmuon.exec._optim.qk_clip``). Checked: losses (1e-6 relative), full
parameters (1e-4 of each tensor's largest magnitude), bytes per step per rank equal to the
plan's schedule (QK-clip's all-reduce included, also with 2 micro-batches under
``dmuon.no_sync``), clipped-head counts equal to the oracle's with both clipped and unclipped
heads in the run; NorMuon with per-head q/k/v rows and o_proj column blocks, against
``dmuon.testing``'s NorMuon reference on ``matrix_view`` proxies (its collectives: the schedule's,
op for op). Measured deviations are in docs/muon_variants.md.
"""

from __future__ import annotations

import contextlib
import copy
import math

import pytest
import torch

from attn_models import AttnLM, apply_clip_reference as _apply_clip_reference
from dist_utils import run_distributed
from shared_launch import shared_run
from oracle import HP, dmuon_muon_kwargs, dmuon_optimizer, fp32_newton_schulz, global_batches, lm_loss

import dmuon
from dmuon.plan._model import views as V
from dmuon.plan._records.qk_clip_records import AttentionClip, HeadRows, QKClip, attention_qk_clip, gpt2_qk_clip
from dmuon.plan._records.params import MatrixView

STEPS = 3
LOSS_RTOL = 1e-6
PARAM_TOL = 1e-4


# ----------------------------------------------------------------------------------- plan level


def test_view_record_json_and_validation():
    v = MatrixView(dim=1, sizes=(4, 4, 8), label="x")
    assert MatrixView.from_dict(v.to_dict()) == v and v.offsets() == (0, 4, 8)
    assert v.blocks((16, 16)) == ((16, 4), (16, 4), (16, 8))
    with pytest.raises(ValueError, match="dim must be 0"):
        MatrixView(dim=2, sizes=(1,))
    with pytest.raises(ValueError, match=">= 1"):
        MatrixView(dim=0, sizes=(0, 4))
    model = AttnLM("gqa")
    plan = dmuon.plan.compile(model, 2, matrix_views=_views_for("llama"))
    assert dmuon.plan.ShardingPlan.from_json(plan.to_json()) == plan
    with pytest.raises(ValueError, match=r"view sizes sum to 12"):
        import dataclasses

        dataclasses.replace(plan.params[0], view=MatrixView(dim=0, sizes=(4, 4, 4)))
    # plans without views keep their JSON (no "view" key)
    assert '"view"' not in dmuon.plan.compile(model, 2).to_json()


def test_view_helpers_blocks():
    llama = V.hf_llama_views(num_heads=4, num_kv_heads=2, head_dim=4)
    model = AttnLM("gqa")
    llama = {k.replace("self_attn", "attn"): r for k, r in llama.items()}
    plan = dmuon.plan.compile(model, 2, matrix_views=llama)
    assert plan.param("layers.0.attn.q_proj.weight").matrices == ((4, 16),) * 4
    assert plan.param("layers.0.attn.k_proj.weight").matrices == ((4, 16),) * 2  # H_kv = 2
    assert plan.param("layers.1.attn.o_proj.weight").matrices == ((16, 4),) * 4  # column blocks
    assert plan.param("layers.0.fc.weight").view is None
    gpt2 = dmuon.plan.compile(AttnLM("fused"), 2, matrix_views=V.gpt2_views(num_heads=4))
    assert gpt2.param("layers.0.attn.c_attn.weight").matrices == ((16, 16),) * 3  # (D, 3D) along dim 1
    heads = dmuon.plan.compile(AttnLM("fused"), 2, matrix_views=V.gpt2_views(num_heads=4, per_head=True))
    assert heads.param("layers.0.attn.c_attn.weight").matrices == ((16, 4),) * 12
    assert heads.param("layers.0.attn.c_proj.weight").matrices == ((4, 16),) * 4
    # Megatron's grouped layout, H = 4, H_kv = 2, d_h = 3: per group [q q k v]
    rule = V.fused_qkv(4, 2, 3, layout="grouped")
    assert rule((24, 10)).sizes == (6, 3, 3, 6, 3, 3)
    assert V.fused_qkv(4, 2, 3)((24, 10)).sizes == (12, 6, 6)  # concat [Q; K; V]
    with pytest.raises(ValueError, match="is not"):
        rule((25, 10))
    # a pattern that matches nothing, a rule that does not fit: both named
    with pytest.raises(ValueError, match=r"pattern '\*\.nope' matches no dedicated parameter"):
        dmuon.plan.compile(model, 2, matrix_views={"*.nope": V.heads(2)})
    with pytest.raises(
        ValueError, match=r"layers\.0\.attn\.q_proj\.weight: dim 0 of \(16, 16\) is not divisible by num_heads=3"
    ):
        dmuon.plan.compile(model, 2, matrix_views={"*.q_proj.weight": V.heads(3)})
    # the callable form
    plan_c = dmuon.plan.compile(
        model, 2, matrix_views=lambda fqn, shape: V.heads(4) if fqn.endswith("q_proj.weight") else None
    )
    assert [p.fqn for p in plan_c.params if p.view] == ["layers.0.attn.q_proj.weight", "layers.1.attn.q_proj.weight"]


def test_view_ns_flops_lpt_and_summary():
    from dmuon.plan._cost.flops import ns_flops, spec_ns_flops

    model = AttnLM("gqa")
    views = {"*.q_proj.weight": V.heads(4), "*.o_proj.weight": V.heads(4, dim=1)}
    plan = dmuon.plan.compile(model, 2, matrix_views=views, cost_model="ns_flops")
    q = plan.param("layers.0.attn.q_proj.weight")
    # 4 blocks of (4, 16): 5 * (4*4*4*16 + 2*4**3) each; the whole (16, 16) would be 5 * (4*16**3 + 2*16**3)
    assert spec_ns_flops(q) == 4 * 5 * (4 * 16 * 16 + 2 * 64) == 23040
    assert ns_flops(16, 16) == 122880
    assert plan.owned_weight == tuple(
        sum(spec_ns_flops(p) for p, o in zip(plan.params, plan.owners) if o.rank == r) for r in range(2)
    )
    ns_ops = {op.fqns[0]: op.flops for op in plan.schedule().ops if op.kind == "newton_schulz"}
    assert ns_ops["layers.0.attn.q_proj.weight"] == 23040
    text = plan.summary()
    assert "matrix views: 4 params orthogonalised as 16 blocks" in text
    assert "heads: 4 blocks (16, 4) x4 along dim 1" in text
    d = dmuon.plan.diff(dmuon.plan.compile(model, 2, cost_model="ns_flops"), plan)
    assert d["layers.0.attn.q_proj.weight"].spec_changed
    assert "view [heads: 4 blocks (4, 16) x4 along dim 0]" in d.render()


def test_view_tp_combinations():
    """Per-head views under TP work when TP shards the view's dim with whole blocks per shard
    (colwise q/k/v, rowwise o_proj): tp_ns='local', no TP collective, NS per rank = its blocks."""
    from dmuon._train.byte_gpt import GPT, GPTConfig

    cfg = GPTConfig(vocab_size=32, d_model=16, n_layers=1, n_heads=4, d_mlp=64, seq_len=8)
    model = GPT(cfg, device="meta")
    dims = {f"layers.0.attn.{n}.weight": d for n, d in (("q_proj", 0), ("k_proj", 0), ("v_proj", 0), ("o_proj", 1))}
    views = {"*.attn.[qkv]_proj.weight": V.heads(4), "*.attn.o_proj.weight": V.heads(4, dim=1)}
    plan = dmuon.plan.compile(model, 1, tp=dmuon.plan.TPPolicy(size=2, shard_dims=dims), matrix_views=views)
    assert {p.fqn: p.tp_ns for p in plan.params if p.view} == {f: "local" for f in dims}
    assert not [op for op in plan.schedule().ops if op.phase == "tp"]
    q = plan.param("layers.0.attn.q_proj.weight")
    assert q.shard_matrices(0) == q.shard_matrices(1) == ((4, 16),) * 2
    # 4 heads over T = 4 ... ok; 4 heads over T = 8 straddles; a view across the TP split raises
    with pytest.raises(ValueError, match=r"q_proj\.weight: its view cuts dim 1 while TP shards dim 0"):
        dmuon.plan.compile(
            model,
            1,
            tp=dmuon.plan.TPPolicy(size=2, shard_dims=dims),
            matrix_views={"*.q_proj.weight": V.heads(4, dim=1)},
        )
    with pytest.raises(ValueError, match=r"k_proj\.weight: its blocks \(6, 10\) along dim 0 straddle"):
        dmuon.plan.compile(
            model,
            1,
            tp=dmuon.plan.TPPolicy(size=2, shard_dims=dims),
            matrix_views={"*.k_proj.weight": V.split((6, 10))},
        )


@pytest.mark.parametrize("adjust_lr_fn", [None, "match_rms_adamw"])
def test_view_step_equals_torch_muon_per_block(adjust_lr_fn):
    """One process, unequal column blocks (12, 2) | (12, 6) of a (12, 8) matrix: dmuon.Muon with
    the view equals torch.optim.Muon on the two blocks as parameters of their own, bit for bit
    with the default bf16 iteration (per-matrix path), within 1e-6 with fp32 (batched path);
    adjust_lr is the block's (original: sqrt(6) and sqrt(2), the whole matrix's would be sqrt(1.5);
    match_rms_adamw: 0.2*sqrt(12) for both)."""
    from dmuon import _tags
    from dmuon.exec._runtime.packed_buffers import DedicatedInfo

    for ns_dtype in (torch.bfloat16, torch.float32):
        torch.manual_seed(0)
        w = torch.nn.Parameter(torch.randn(12, 8))
        _tags.write(
            w,
            _tags.PARAM,
            DedicatedInfo(
                fqn="w",
                owner_global_rank=0,
                is_owner=True,
                holds_full=True,
                shape=(12, 8),
                matrix_shape=(12, 8),
                num_matrices=1,
                runtime=lambda: None,
                view=MatrixView(dim=1, sizes=(2, 6)),
            ),
        )
        blocks = [torch.nn.Parameter(w.detach()[:, :2].clone()), torch.nn.Parameter(w.detach()[:, 2:].clone())]
        ours = dmuon.Muon([w], lr=0.02, adjust_lr_fn=adjust_lr_fn, ns_dtype=ns_dtype)
        ref = torch.optim.Muon(blocks, lr=0.02, adjust_lr_fn=adjust_lr_fn)
        with fp32_newton_schulz() if ns_dtype == torch.float32 else contextlib.nullcontext():
            for _ in range(3):
                g = torch.randn(12, 8)
                w.grad = g.clone()
                blocks[0].grad, blocks[1].grad = g[:, :2].clone(), g[:, 2:].clone()
                ours.step()
                ref.step()
        got = torch.cat([b.detach() for b in blocks], dim=1)
        if ns_dtype == torch.bfloat16:
            assert torch.equal(w.detach(), got)
        else:
            assert (w.detach() - got).abs().max() / got.abs().max() < 1e-6
    from dmuon._update import adjust_lr

    assert [adjust_lr(1.0, adjust_lr_fn, b) for b in MatrixView(dim=1, sizes=(2, 6)).blocks((12, 8))] == (
        [1.0 * math.sqrt(6), math.sqrt(2)] if adjust_lr_fn is None else [0.2 * math.sqrt(12)] * 2
    )


def _qk_for(kind: str, model, tau: float) -> QKClip:
    if kind == "fused":
        return gpt2_qk_clip(model, tau, num_heads=4)
    return attention_qk_clip(
        model,
        tau,
        suffix="attn",
        q="q_proj",
        k="k_proj",
        num_heads=4,
        num_kv_heads=2 if kind == "gqa" else 4,
        head_dim=4,
    )


def test_qk_clip_plan_cost_and_errors():
    model = AttnLM("gqa")
    qk = _qk_for("gqa", model, 5.0)
    assert qk.attention[0].q == HeadRows(
        fqn="layers.0.attn.q_proj.weight", num_heads=4, head_dim=4, bias="layers.0.attn.q_proj.bias"
    )
    assert qk.attention[0].gqa and qk.num_heads == 8
    plan = dmuon.plan.compile(model, (2, 2), qk_clip=qk)
    assert dmuon.plan.ShardingPlan.from_json(plan.to_json()) == plan
    (op,) = [op for op in plan.schedule().ops if op.phase == "qk_clip"]
    assert (op.kind, op.group, op.numel, op.dtype) == ("all_reduce", (0, 1, 2, 3), 8, "torch.float32")
    # ring all-reduce of 8 fp32 over 4 ranks: 2 * 3 * ceil(8/4) * 4 = 48 B per rank
    assert plan.cost.qk_clip_nbytes == 4 * 48
    base = dmuon.plan.compile(model, (2, 2))
    assert plan.cost.total_nbytes == base.cost.total_nbytes + 192
    assert plan.cost.per_rank_nbytes == tuple(b + 48 for b in base.cost.per_rank_nbytes)
    assert "QK-clip (MuonClip): tau=5, 2 layers, 8 q heads, 2 GQA layers (q-only rule)" in plan.summary()
    assert "setting qk_clip: None -> tau=5" in dmuon.plan.diff(base, plan).render()
    # W_q not dedicated: refused, named
    with pytest.raises(ValueError, match=r"W_q 'layers\.0\.attn\.q_proj\.weight' is not a dedicated parameter"):
        dmuon.plan.compile(
            model,
            2,
            qk_clip=qk,
            predicate=lambda fqn, p: fqn.startswith("layers") and p.ndim == 2 and "q_proj" not in fqn,
        )
    # QK-norm (Qwen3-style q_norm / k_norm): rescaling has no effect, refused in the helper and in compile
    normed = AttnLM("gqa")
    for layer in normed.layers:
        layer.attn.q_norm = torch.nn.RMSNorm(4)
    with pytest.raises(ValueError, match=r"'layers\.0\.attn': the module has 'q_norm' \(QK-norm"):
        _qk_for("gqa", normed, 5.0)
    with pytest.raises(ValueError, match=r"QK-norm"):
        dmuon.plan.compile(normed, 2, qk_clip=qk)
    with pytest.raises(ValueError, match="tau must be a finite number > 0"):
        QKClip(tau=0.0, attention=qk.attention)
    with pytest.raises(ValueError, match="not a multiple of 3 k heads"):
        AttentionClip(
            module="a", q=HeadRows(fqn="q", num_heads=4, head_dim=2), k=HeadRows(fqn="k", num_heads=3, head_dim=2)
        )


def test_max_logits_helpers():
    from dmuon.exec._optim.qk_clip import max_logits_eager, max_logits_sdpa

    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 5, 3, generator=g)
    k = torch.randn(2, 2, 5, 3, generator=g)
    kk = k.repeat_interleave(2, dim=1)
    scores = q @ kk.transpose(-1, -2) / math.sqrt(3)
    mask = torch.ones(5, 5, dtype=torch.bool).tril()
    want = scores.masked_fill(~mask, float("-inf")).amax(dim=(0, 2, 3))
    assert torch.allclose(max_logits_eager(scores, mask), want)
    assert torch.allclose(max_logits_sdpa(q, k, is_causal=True, block_q=2), want, atol=1e-6)
    assert torch.allclose(max_logits_sdpa(q, k, attn_mask=mask), want, atol=1e-6)
    assert torch.allclose(max_logits_sdpa(q, kk), scores.amax(dim=(0, 2, 3)), atol=1e-6)


# ----------------------------------------------------------------------------------- oracle


def _views_for(name: str):
    if name == "llama":
        return {
            "*.attn.q_proj.weight": V.heads(4),
            "*.attn.[kv]_proj.weight": V.heads(2),
            "*.attn.o_proj.weight": V.heads(4, dim=1),
        }
    if name == "mha":
        return {"*.attn.[qkv]_proj.weight": V.heads(4), "*.attn.o_proj.weight": V.heads(4, dim=1)}
    if name == "gpt2":
        return V.gpt2_views(num_heads=4)
    return None


def _reference(model, dedicated, views, batches, *, qk=None, micro=1, adjust_lr_fn=None):
    """(losses, final state, clipped heads per step): one process, global batch, fp32 NS."""
    model = copy.deepcopy(model)
    params = dict(model.named_parameters())
    maxes: dict[str, torch.Tensor] = {}
    names = {m: n for n, m in model.named_modules()}

    def recorder(module, s):
        n = names[module]
        maxes[n] = s.detach().clone() if n not in maxes else torch.maximum(maxes[n], s.detach())

    for layer in model.layers:
        layer.attn.report = recorder
    blocks = []  # (full param, dim, offset, size, leaf block)
    muon_params = []
    for fqn in dedicated:
        p = params[fqn]
        view = views.get(fqn)
        if view is None:
            muon_params.append(p)
            continue
        for off, size in zip(view.offsets(), view.sizes):
            leaf = torch.nn.Parameter(p.detach().narrow(view.dim, off, size).clone())
            blocks.append((p, view.dim, off, size, leaf))
            muon_params.append(leaf)
    muon = torch.optim.Muon(
        muon_params,
        lr=HP["lr"],
        weight_decay=HP["weight_decay"],
        momentum=HP["momentum"],
        nesterov=HP["nesterov"],
        adjust_lr_fn=adjust_lr_fn,
    )
    rest = [p for n, p in params.items() if n not in dedicated]
    adamw = torch.optim.AdamW(rest, lr=HP["adamw_lr"], weight_decay=HP["adamw_weight_decay"])
    losses, clipped = [], []
    with fp32_newton_schulz():
        for batch in batches:
            maxes.clear()
            loss = 0.0
            for part in batch.chunk(micro):
                part_loss = lm_loss(model, part) / micro
                part_loss.backward()
                loss += part_loss.item()
            for p, dim, off, size, leaf in blocks:
                leaf.grad = p.grad.narrow(dim, off, size).clone()
            muon.step()
            adamw.step()
            with torch.no_grad():
                for p, dim, off, size, leaf in blocks:
                    p.narrow(dim, off, size).copy_(leaf)
                    p.grad = leaf.grad = None  # the full matrix is in no optimizer: its grad is reset here
                clipped.append(_apply_clip_reference(params, qk, maxes) if qk is not None else 0)
                for p, dim, off, size, leaf in blocks:  # the clip rescaled p: the blocks follow
                    leaf.copy_(p.narrow(dim, off, size))
            muon.zero_grad()
            adamw.zero_grad()
            losses.append(loss)
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}, clipped


def _tau_for(kind: str) -> float:
    """Between the heads' step-0 max logits (the 3rd and 4th smallest of 8): some heads above, some below."""
    model = AttnLM(kind, gain=GAIN)
    vals = []
    for layer in model.layers:
        layer.attn.report = lambda m, s: vals.extend(s.tolist())
    with torch.enable_grad():
        lm_loss(model, global_batches(1, batch=8, seq=6, seed=5)[0])
    vals.sort()
    return 0.5 * (vals[len(vals) // 2 - 1] + vals[len(vals) // 2])


GAIN = 2.0


def _build(kind, case, mesh, qk_tau, adjust_lr_fn, z3):
    from torch.distributed.fsdp import fully_shard

    model = AttnLM(kind, gain=GAIN)
    qk = _qk_for(kind, model, qk_tau) if qk_tau is not None else None
    dmuon.dedicate_params(model, mesh, reshard_after_forward=z3, matrix_views=_views_for(case[1]), qk_clip=qk)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=z3)
    fully_shard(model, mesh=mesh)
    opt = dmuon.Muon(model, **dmuon_muon_kwargs(), adjust_lr_fn=adjust_lr_fn)
    return model, opt


def _resume_matches(model, opt, kind, case, mesh, qk, adjust_lr_fn, z3) -> dict:
    """Full state dicts (rank 0, through torch.save bytes) into a fresh model: one more step on
    both gives the same parameters and the same QK-clip figures (QK-clip keeps no state)."""
    import io

    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    rank, world = dist.get_rank(), dist.get_world_size()
    opt.init_state()
    get = StateDictOptions(full_state_dict=True, cpu_offload=True)
    msd, osd = get_model_state_dict(model, options=get), get_optimizer_state_dict(model, opt, options=get)
    if rank == 0:
        buf = io.BytesIO()
        torch.save({"model": msd, "optim": osd}, buf)
        buf.seek(0)
        loaded = torch.load(buf, weights_only=True)
        msd, osd = loaded["model"], loaded["optim"]
    fresh, fresh_opt = _build(kind, case, mesh, qk.tau, adjust_lr_fn, z3)
    fresh_opt.init_state()
    put = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(fresh, msd, options=put)
    set_optimizer_state_dict(fresh, fresh_opt, osd, options=put)
    batch = global_batches(1, batch=8, seq=6, seed=11)[0].chunk(world)[rank]
    figures = []
    for m, o in ((model, opt), (fresh, fresh_opt)):
        lm_loss(m, batch).backward()
        o.step()
        o.zero_grad()
        figures.append(dmuon.qk_clip.stats(m))
    fa, fb = dmuon.full_state_dict(model), dmuon.full_state_dict(fresh)
    same = rank != 0 or all(torch.equal(fa[k], fb[k]) for k in fa)
    return dict(same_params=same, same_stats=figures[0] == figures[1], stats=figures[0])


def _worker(cases, mesh_shape, check_error):
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from dmuon.exec._comm.collective_calls import LEDGER
    from dmuon.plan._cost.nbytes import schedule_byte_cost
    from dmuon.plan._scheduling.ops import MicroBatch, Step

    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("replicate", "shard")) if len(mesh_shape) == 2 else None
    out = []
    for case in cases:
        kind, view_name, tau, micro, adjust_lr_fn, z3, *rest = case
        variant = rest[0] if rest else "muon"
        model = AttnLM(kind, gain=GAIN)
        qk = _qk_for(kind, model, tau) if tau is not None else None
        batches = global_batches(STEPS, batch=8, seq=6, seed=5)
        plan = dmuon.dedicate_params(
            model, mesh, reshard_after_forward=z3, matrix_views=_views_for(view_name), qk_clip=qk
        )
        for layer in model.layers:
            fully_shard(layer, mesh=mesh, reshard_after_forward=z3)
        fully_shard(model, mesh=mesh)
        opt = dmuon.Muon(model, **dmuon_muon_kwargs(), adjust_lr_fn=adjust_lr_fn, variant=variant)
        step = Step(micro_batches=tuple(MicroBatch(sync=i == micro - 1) for i in range(micro)))
        expected_nbytes = schedule_byte_cost(plan.schedule(step)).per_rank_nbytes[rank]
        losses, ledgers, stats = [], [], []
        for n, batch in enumerate(batches):
            LEDGER.reset()
            local = batch.chunk(world)[rank]
            loss = torch.zeros(())
            with LEDGER.recording() if n == STEPS - 1 else contextlib.nullcontext():
                for i, part in enumerate(local.chunk(micro)):
                    ctx = dmuon.no_sync(model) if i < micro - 1 else contextlib.nullcontext()
                    with ctx:
                        part_loss = lm_loss(model, part) / micro
                        part_loss.backward()
                    loss += part_loss.detach()
                opt.step()
                opt.zero_grad()
            ledgers.append(LEDGER.total_nbytes())
            stats.append(dmuon.qk_clip.stats(model))
            dist.all_reduce(loss)
            losses.append(loss.item() / world)
        # the last step's collectives, op by op, are the schedule's (QK-clip's all-reduce included)
        issued = [(o.kind, o.phase, tuple(sorted(o.group)), o.root, o.dtype, o.numel, o.nbytes) for o in LEDGER.ops]
        planned = [
            (op.kind, op.phase, op.group, op.root, op.dtype, op.numel, op.charged_nbytes(rank))
            for op in plan.schedule(step).rank_ops(rank)
            if op.collective
        ]
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
        resumed = None
        if tau is not None and check_error:  # checkpoint -> fresh model -> one more step: identical
            resumed = _resume_matches(model, opt, kind, case, mesh, qk, adjust_lr_fn, z3)
        out.append(
            dict(
                case=case,
                losses=losses,
                ledgers=ledgers,
                expected_nbytes=expected_nbytes,
                stats=stats,
                full={k: v.detach().clone() for k, v in full.items()} if rank == 0 else None,
                dedicated=plan.dedicated,
                views={p.fqn: p.view for p in plan.params if p.view is not None},
                qk=plan.qk_clip,
                qk_nbytes=plan.cost.qk_clip_nbytes,
                resumed=resumed,
                ops_match=issued == planned,
                qk_ops=sum(o[1] == "qk_clip" for o in issued),
            )
        )
    if not check_error:
        return out, None
    # a step in which no layer reported: the same clear error on every rank, after the collective
    model = AttnLM("mha", gain=GAIN)
    plan = dmuon.dedicate_params(model, mesh, qk_clip=_qk_for("mha", model, 1.0))
    for layer in model.layers:
        layer.attn.report = lambda m, s: None
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = dmuon.Muon(model, ns_dtype=torch.float32)
    lm_loss(model, global_batches(1, batch=8, seq=6)[0].chunk(world)[rank]).backward()
    try:
        opt.step()
        err = None
    except RuntimeError as exc:
        err = str(exc)
    return out, err


def _check(results, report, *, expect_error: bool):
    outs, err = results[0][0], results[0][1]
    assert all(r[1] == err for r in results)
    assert (err is not None) == expect_error
    assert err is None or "no attention layer reported its max logits" in err
    for i, res in enumerate(outs):
        kind, view_name, tau, micro, adjust_lr_fn, z3, *rest = res["case"]
        variant = rest[0] if rest else "muon"
        qk = res["qk"]
        if variant == "normuon":  # NorMuon per view block: dmuon.testing's reference on matrix_view proxies
            ref_losses, ref_state, ref_clipped = _normuon_reference(kind, res["dedicated"], res["views"])
        else:
            ref_losses, ref_state, ref_clipped = _reference(
                AttnLM(kind, gain=GAIN),
                res["dedicated"],
                res["views"],
                global_batches(STEPS, batch=8, seq=6, seed=5),
                qk=qk,
                micro=micro,
                adjust_lr_fn=adjust_lr_fn,
            )
        for rank, r in enumerate(results):
            mine = r[0][i]
            assert mine["ledgers"] == [mine["expected_nbytes"]] * STEPS, (res["case"], rank, mine["ledgers"])
            assert mine["ops_match"] and mine["qk_ops"] == (qk is not None), (res["case"], rank)
        loss_err = max(abs(a - b) / abs(b) for a, b in zip(res["losses"], ref_losses))
        assert loss_err < LOSS_RTOL, (res["case"], res["losses"], ref_losses)
        param_err = max(((res["full"][k] - v).abs().max() / v.abs().max()).item() for k, v in ref_state.items())
        assert param_err < PARAM_TOL, (res["case"], param_err)
        if res["views"] and variant == "muon":  # the views matter: whole-matrix Muon lands far outside the tolerance
            _, whole, _ = _reference(
                AttnLM(kind, gain=GAIN),
                res["dedicated"],
                {},
                global_batches(STEPS, batch=8, seq=6, seed=5),
                qk=qk,
                micro=micro,
                adjust_lr_fn=adjust_lr_fn,
            )
            assert (
                max(((res["full"][k] - v).abs().max() / v.abs().max()).item() for k, v in whole.items())
                > 100 * PARAM_TOL
            )
        if res["resumed"] is not None:
            assert all(r[0][i]["resumed"]["same_params"] for r in results) and res["resumed"]["same_stats"], res[
                "resumed"
            ]
        if qk is not None:
            got = [s["clipped_heads"] for s in res["stats"]]
            assert got == ref_clipped, (res["case"], got, ref_clipped)
            assert 0 < sum(ref_clipped) < STEPS * qk.num_heads, ref_clipped  # some heads above tau, some below
            assert res["qk_nbytes"] > 0
        else:
            assert res["stats"] == [None] * STEPS
        report.append((res["case"], loss_err, param_err, ref_clipped))


def _normuon_reference(kind, dedicated, views):
    """NorMuon with every view block its own matrix (one second-moment row per block row, one
    rescale per block), :class:`dmuon.testing.ReferenceOptimizer` on ``matrix_view`` proxies."""
    import dmuon.testing as T

    model = AttnLM(kind, gain=GAIN)
    params = dict(model.named_parameters())
    proxies = {
        f: T.matrix_view(params[f].shape, views[f].dim, views[f].sizes)
        if f in views
        else T.proxies_for(params[f].shape)
        for f in dedicated
    }
    losses, state = T.reference_run(
        model,
        lm_loss,
        global_batches(STEPS, batch=8, seq=6, seed=5),
        proxies,
        ns_dtype=torch.float32,
        variant="normuon",
        **HP,
    )
    return losses, state, [0] * STEPS


def _cases(mesh: str):
    taus = {k: _tau_for(k) for k in ("gqa", "mha", "fused")}
    if mesh == "1d":
        return [
            ("gqa", "llama", None, 1, None, True),  # per-head q/k/v (GQA) + o_proj columns; adjust_lr by block
            ("mha", "mha", taus["mha"], 1, "match_rms_adamw", True),  # MHA sqrt rule + per-head views
            ("gqa", "llama", None, 1, None, True, "normuon"),  # NorMuon per view block (rows and columns)
        ]
    return [
        (
            "fused",
            "gpt2",
            taus["fused"],
            1,
            "match_rms_adamw",
            False,
        ),  # c_attn split along dim 1; QK-clip with bias, Z2
        ("gqa", None, taus["gqa"], 2, None, True),  # GQA q-only rule, q/k biases, 2 micro-batches under no_sync
    ]


TAU_NONFINITE, BIG = 5.0, 20.0
# per rank, per layer: the (H,) max logits reported in one step. Layer 0: head 0 inf on rank 0, head
# 1 NaN on rank 1, head 2 below tau, head 3 above (clipped); layer 1: every logit negative.
NONFINITE_REPORTS = (
    ([float("inf"), 1.0, 2.0, BIG], [-1.0, -2.0, -3.0, -4.0]),
    ([0.5, float("nan"), -3.0, 1.0], [-0.5, -6.0, -1.0, -2.0]),
)


def _nonfinite_worker():
    """QK-clip with non-finite and all-negative max logits (W = 2, MHA): reported through
    ``dmuon.qk_clip.record`` with no gradient anywhere, so ``opt.step()`` changes nothing but
    QK-clip's rescaling; returns the q / k weights before and after, the warnings and the stats."""
    import warnings

    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    rank = dist.get_rank()
    model = AttnLM("mha", gain=GAIN)
    dmuon.dedicate_params(model, qk_clip=_qk_for("mha", model, TAU_NONFINITE))
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    opt = dmuon.Muon(model, ns_dtype=torch.float32)
    names = [f"layers.{i}.attn.{w}_proj.weight" for i in range(2) for w in "qk"]
    before = {k: v for k, v in dmuon.full_state_dict(model).items() if k in names}
    with torch.enable_grad():
        for layer, logits in zip(model.layers, NONFINITE_REPORTS[rank]):
            assert dmuon.qk_clip.record(layer.attn, torch.tensor(logits))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.step()
    after = {k: v for k, v in dmuon.full_state_dict(model).items() if k in names}
    warned = [(type(w.message).__name__, str(w.message)) for w in caught if "QK-clip" in str(w.message)]
    return dict(before=before, after=after, warned=warned, stats=dmuon.qk_clip.stats(model))


def _two_rank_worker():
    """Everything of W = 2 in one launch: the TP views and the main job first, QK-clip with
    non-finite logits, then the 1-D oracle cases (they end with the step that raises)."""
    return _tp_and_main_job_worker(), _worker(_cases("1d"), (2,), True), _nonfinite_worker()


def _two_rank_results(which):
    runs = shared_run("test_muon_variants W=2", _two_rank_worker, 2, timeout_s=280 + 180)
    return [r[{"tp_and_main_job": 0, "1d": 1, "nonfinite": 2}[which]] for r in runs]


@pytest.mark.timeout(300 + 200)  # the launch it shares with test_variants_oracle_1d
def test_qk_clip_non_finite_logits_never_zero_or_poison_a_head():
    """A head whose step maximum is inf (rank 0) or NaN (rank 1) keeps its W_q / W_k rows, with the
    same warning on every rank naming the layer, the heads and the step; a finite head above tau in
    the same layer is clipped by sqrt(tau/S); a layer whose logits are all negative is untouched."""
    results = _two_rank_results("nonfinite")
    r0 = results[0]
    for r in results:
        assert r["warned"] == r0["warned"] and len(r0["warned"]) == 1, r["warned"]
        assert r["stats"] == r0["stats"]
    kind, msg = r0["warned"][0]
    assert kind == "QKClipNonFinite", kind
    assert (
        "non-finite max logit (inf, or NaN on some rank) at optimizer step 1 in 'layers.0.attn' head(s) [0, 1]" in msg
    ), msg
    assert "'layers.1.attn'" not in msg and "left unscaled" in msg, msg
    assert r0["stats"] == {"clipped_heads": 1, "max_logit": float("inf"), "tau": TAU_NONFINITE, "nonfinite_heads": 2}
    factor = math.sqrt(TAU_NONFINITE / BIG)
    for w in "qk":
        b, a = r0["before"][f"layers.0.attn.{w}_proj.weight"], r0["after"][f"layers.0.attn.{w}_proj.weight"]
        assert torch.isfinite(a).all()
        assert torch.equal(a[: 3 * 4], b[: 3 * 4]), w  # heads 0 (inf), 1 (NaN), 2 (below tau): unchanged
        assert torch.allclose(a[12:], b[12:] * factor, rtol=1e-6, atol=0), w  # head 3: sqrt(tau / S)
        assert torch.equal(
            r0["after"][f"layers.1.attn.{w}_proj.weight"], r0["before"][f"layers.1.attn.{w}_proj.weight"]
        )


@pytest.mark.timeout(300 + 200)  # the launch it shares with test_views_tp_local_and_main_job
def test_variants_oracle_1d():
    """W = 2, 1-D: per-head views (GQA and MHA, o_proj column blocks), QK-clip's MHA rule, and
    the error of a step in which no layer reported."""
    results = _two_rank_results("1d")
    report = []
    _check(results, report, expect_error=True)
    print(report)


@pytest.mark.timeout(300)
def test_variants_oracle_hsdp():
    """W = 4, HSDP (2, 2): GPT-2 c_attn split along dim 1 with QK-clip on the fused weight and
    its bias (Z2), and the GQA q-only rule with 2 micro-batches under dmuon.no_sync."""
    results = run_distributed(_worker, 4, _cases("hsdp"), (2, 2), False, timeout_s=280)
    report = []
    _check(results, report, expect_error=False)
    print(report)


def _tp_worker():
    """(dp=1, tp=2): the main job's GPT with Megatron-style TP, per-head views on q/k/v (colwise)
    and o_proj (rowwise): tp_ns='local', each TP rank orthogonalises its own heads."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from dmuon.exec._comm.collective_calls import LEDGER
    from dmuon._train.byte_gpt import GPT, GPTConfig, apply_tensor_parallel

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))
    cfg = GPTConfig(vocab_size=32, d_model=16, n_layers=2, n_heads=4, d_mlp=32, seq_len=8)
    views = {"*.attn.[qkv]_proj.weight": V.heads(4), "*.attn.o_proj.weight": V.heads(4, dim=1)}
    model = GPT(cfg, seed=0)
    apply_tensor_parallel(model, mesh["tp"])
    plan = dmuon.dedicate_params(model, mesh["dp"], tp=dmuon.plan.TPPolicy(ns="gather"), matrix_views=views)
    methods = {p.fqn: p.tp_ns for p in plan.params}
    for layer in model.layers:
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    opt = dmuon_optimizer(model)
    batches = global_batches(STEPS, batch=4, seq=cfg.seq_len, vocab=cfg.vocab_size, seed=3)
    losses, ledgers, tp_bytes = [], [], []
    for batch in batches:
        LEDGER.reset()
        loss = lm_loss(model, batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
        ledgers.append(LEDGER.total_nbytes())
        tp_bytes.append(LEDGER.snapshot()["tp"])
        losses.append(loss.item())
    full = {}
    for name, p in model.named_parameters():
        full[name] = (p.full_tensor() if hasattr(p, "full_tensor") else p.detach()).clone()
    ref_losses, ref_state, _ = _reference(
        GPT(cfg, seed=0), plan.dedicated, {p.fqn: p.view for p in plan.params if p.view}, batches
    )
    loss_err = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
    param_err = max(((full[k] - v).abs().max() / v.abs().max()).item() for k, v in ref_state.items() if k in full)
    _, whole, _ = _reference(GPT(cfg, seed=0), plan.dedicated, {}, batches)  # the same run without views
    whole_err = max(((full[k] - v).abs().max() / v.abs().max()).item() for k, v in whole.items() if k in full)
    rank = dist.get_rank()
    gather_nbytes = plan.cost.tp_nbytes // 2  # the MLP's gathers; the viewed attention matrices add none
    return dict(
        methods=methods,
        loss_err=loss_err,
        param_err=param_err,
        whole_err=whole_err,
        ledgers=ledgers,
        expected=plan.cost.per_rank_nbytes[rank],
        tp_bytes=tp_bytes,
        gather_nbytes=gather_nbytes,
    )


def _tp_and_main_job_worker():
    from dmuon._train import run

    job = dict(
        d_model=32,
        n_layers=2,
        n_heads=4,
        d_mlp=64,
        seq_len=16,
        batch=4,
        eval_batch=4,
        eval_batches=1,
        steps=3,
        eval_every=0,
        log_every=1,
        quiet=True,
        qk_clip=0.02,
        matrix_views="per-head",
        ns_dtype="fp32",
    )
    return _tp_worker(), run(job)


@pytest.mark.timeout(300 + 200)  # the launch it shares with test_variants_oracle_1d
def test_views_tp_local_and_main_job():
    """Per-head views under TP (dp=1, tp=2); then, in the same process group, the main job with
    ``--qk-clip 0.02 --matrix-views per-head`` (1-D over both ranks): it logs clipped heads and
    the largest logit at every log step, and its bytes per step equal the plan's."""
    results = _two_rank_results("tp_and_main_job")
    job = results[0][1]
    assert (
        job["ledger_nbytes_per_step"] == job["plan_total_nbytes"] and job["ledger_phase_nbytes_per_step"]["qk_clip"] > 0
    )
    steps = job["history"]["qk_clip"]
    assert [s[0] for s in steps] == [1, 2, 3] and all(s[1] > 0 and s[2] > 0.02 for s in steps), steps
    for r, _ in results:
        viewed = {f: m for f, m in r["methods"].items() if ".attn." in f}
        assert set(viewed.values()) == {"local"} and len(viewed) == 8
        assert {m for f, m in r["methods"].items() if ".mlp." in f} == {"gather"}
        assert r["ledgers"] == [r["expected"]] * STEPS
        # only the MLP's all-gathers: (T-1) * (32*16/2) * 4 B per matrix per rank, 4 matrices
        assert r["tp_bytes"] == [r["gather_nbytes"]] * STEPS == [4 * 256 * 4] * STEPS
        assert r["loss_err"] < 1e-5 and r["param_err"] < PARAM_TOL < 100 * PARAM_TOL < r["whole_err"], r
    print([(r["loss_err"], r["param_err"], r["whole_err"]) for r, _ in results], steps)


def test_hf_llama_helpers_on_hf_names():
    """The HF helpers on a module tree with Hugging Face Llama / Qwen names (transformers is not
    a dependency): GQA head counts from the config, Qwen2 biases, Qwen3's q_norm refused."""
    import types

    from dmuon.plan._records.qk_clip_records import hf_llama_qk_clip

    def lm(bias: bool, qk_norm: bool):
        attn = torch.nn.Module()
        attn.q_proj, attn.k_proj = torch.nn.Linear(16, 16, bias=bias), torch.nn.Linear(16, 8, bias=bias)
        attn.v_proj, attn.o_proj = torch.nn.Linear(16, 8, bias=False), torch.nn.Linear(16, 16, bias=False)
        if qk_norm:
            attn.q_norm, attn.k_norm = torch.nn.RMSNorm(4), torch.nn.RMSNorm(4)
        layer = torch.nn.Module()
        layer.self_attn = attn
        model = torch.nn.Module()
        model.model = torch.nn.Module()
        model.model.layers = torch.nn.ModuleList([layer])
        model.config = types.SimpleNamespace(num_attention_heads=4, num_key_value_heads=2, hidden_size=16)
        return model

    qwen2 = lm(bias=True, qk_norm=False)
    (a,) = hf_llama_qk_clip(qwen2, 50.0).attention
    assert (a.module, a.q.num_heads, a.k.num_heads, a.q.head_dim) == ("model.layers.0.self_attn", 4, 2, 4)
    assert (a.q.bias, a.k.bias) == ("model.layers.0.self_attn.q_proj.bias", "model.layers.0.self_attn.k_proj.bias")
    plan = dmuon.plan.compile(
        qwen2,
        2,
        hook_boundary_strict=False,
        qk_clip=hf_llama_qk_clip(qwen2, 50.0),
        matrix_views=V.hf_qwen_views(qwen2.config),
    )
    assert plan.param("model.layers.0.self_attn.k_proj.weight").matrices == ((4, 16),) * 2
    assert plan.param("model.layers.0.self_attn.o_proj.weight").matrices == ((16, 4),) * 4
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.self_attn': the module has 'q_norm'"):
        hf_llama_qk_clip(lm(bias=False, qk_norm=True), 50.0)
