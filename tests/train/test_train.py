"""The main job (dmuon._train): data, model, and short real training runs on 2 CPU ranks.

Distributed runs use tests/dist_utils.run_distributed and call ``dmuon._train.run`` inside the
already-initialised group, several cases per process group; one test goes through the real
command line (``python -m dmuon train``, which spawns its own processes).
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import torch

from conftest import REPO_ROOT, SHARED_DATA
from shared_launch import shared_run

from dmuon._train.data import (
    DEFAULT_CORPUS_NBYTES,
    Corpus,
    decode,
    encode,
    stdlib_corpus,
    unigram_cross_entropy,
)
from dmuon._cli.train_command import _complete, parse_args
from dmuon._train.loop import lr_factor
from dmuon._train.byte_gpt import GPT, GPTConfig, lm_loss

SHAKESPEARE = SHARED_DATA / "tinyshakespeare.txt"
needs_shakespeare = pytest.mark.skipif(
    not SHAKESPEARE.exists(), reason=f"{SHAKESPEARE} not found (../shared/data beside the checkout)"
)

# A model small enough for 30 steps on 2 cores in a few seconds.
SMALL = dict(
    d_model=64, n_layers=2, n_heads=4, d_mlp=256, seq_len=64, batch=16, eval_batch=16, eval_batches=4, quiet=True
)
# 30 steps on tinyshakespeare: val loss must end below the unigram baseline.
LEARN = dict(SMALL, steps=30, eval_every=30, data=str(SHAKESPEARE), log_every=10)
# 6 steps without LR decay, fp32 Newton-Schulz: compared across world sizes 1 and 2.
SHORT = dict(SMALL, steps=6, eval_every=6, cooldown_frac=0.0, ns_dtype="fp32", log_every=1)


def _train_cases(cases):
    """Every rank: ``dmuon._train.run`` on each config, in this process group."""
    from dmuon._train import run

    return [run(c) for c in cases]


def _runs_of_2(label: str) -> list[dict]:
    """The runs ``label`` names, from the ONE launch of 2 ranks every 2-rank test of this file
    shares (process start-up dominates on 2 cores): rank 0's metrics, in the label's order.
    The tinyshakespeare runs join the launch only when the file exists (their tests skip
    otherwise)."""
    labels = _labels_of_2()
    runs = shared_run(("test_train", 2), _train_cases, 2, [c for _, c in labels], timeout_s=600)[0]
    return [r for (name, _), r in zip(labels, runs) if name == label]


def _labels_of_2() -> list[tuple[str, dict]]:
    """``(label, config)`` of every 2-rank run, in launch order."""
    out = []
    if SHAKESPEARE.exists():
        out += [
            ("learn", dict(LEARN, mode="z3")),
            ("learn", dict(LEARN, mode="z2", steps=3)),
            ("adamw", dict(LEARN, optimizer="adamw")),
        ]
    moe = dict(SMALL, d_mlp=128, experts=4, top_k=2, steps=30, eval_every=30, log_every=10)
    out += [("moe", moe), ("moe", MOE_SHORT), ("moe", dict(MOE_SHORT, ep=2))]
    out += [("invariance", c) for c in _invariance_cases(2)]
    return out


# -- data ---------------------------------------------------------------------------------


def test_byte_tokenizer_round_trip():
    text = "héllo, wörld — ∑\n"
    ids = encode(text)
    assert ids.dtype == np.uint8 and ids.shape == (len(text.encode("utf-8")),)
    assert decode(ids) == text
    assert decode(torch.from_numpy(ids)) == text


def test_stdlib_corpus_is_deterministic_and_capped():
    a = stdlib_corpus(max_nbytes=200_000)
    assert len(a) == 200_000 and a == stdlib_corpus(max_nbytes=200_000)
    assert b"def " in a and b"import " in a
    assert len(stdlib_corpus()) <= DEFAULT_CORPUS_NBYTES


def test_global_batch_is_independent_of_world_size():
    tokens = encode(bytes(range(256)) * 40)
    c = Corpus.from_tokens(tokens, seq_len=16, seed=3)
    for step in (0, 7):
        x1, y1 = c.train_batch(step, 8)
        assert x1.shape == (8, 16) and x1.dtype == torch.int64
        for world in (2, 4, 8):
            parts = [c.train_batch(step, 8, r, world) for r in range(world)]
            assert torch.equal(torch.cat([p[0] for p in parts]), x1)
            assert torch.equal(torch.cat([p[1] for p in parts]), y1)
    # targets are inputs shifted by one token (the data is 0..255 repeated)
    assert torch.equal((x1 + 1) % 256, y1)
    assert not torch.equal(c.train_batch(0, 8)[0], c.train_batch(1, 8)[0])
    v1 = c.val_batches(3, 8)
    v4 = [c.val_batches(3, 8, r, 4) for r in range(4)]
    for i in range(3):
        assert torch.equal(torch.cat([v[i][0] for v in v4]), v1[i][0])
    with pytest.raises(ValueError, match="multiple of the world size"):
        c.train_batch(0, 6, 0, 4)


def test_split_and_unigram_baseline():
    tokens = encode(b"ab" * 500)
    c = Corpus.from_tokens(tokens, seq_len=8, val_fraction=0.1)
    assert c.train.size == 900 and c.val.size == 100
    # p(a) = p(b) = 451/902 (add-one smoothing over 256 bytes): close to ln 2
    expected = -math.log(451 / (900 + 256))
    assert c.unigram_val_loss == pytest.approx(expected)
    assert unigram_cross_entropy(c.train, c.val) == pytest.approx(expected)
    with pytest.raises(ValueError, match="too small"):
        Corpus.from_tokens(encode(b"abc" * 5), seq_len=8)


# -- model --------------------------------------------------------------------------------


def test_model_names_init_and_causality():
    cfg = GPTConfig(d_model=32, n_layers=2, n_heads=4, d_mlp=64, seq_len=16)
    m = GPT(cfg, seed=1)
    names = dict(m.named_parameters())
    for i in range(2):
        for sub in ("attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.o_proj", "mlp.up_proj", "mlp.down_proj"):
            assert names[f"layers.{i}.{sub}.weight"].ndim == 2
    assert names["layers.0.mlp.up_proj.weight"].shape == (64, 32)
    assert not any(n.endswith(".bias") for n in names)
    assert set(names) >= {"embed.weight", "pos_embed.weight", "norm.weight", "lm_head.weight"}
    # deterministic from the seed, independent of the global RNG
    torch.manual_seed(123)
    same = GPT(cfg, seed=1)
    assert all(torch.equal(p, q) for p, q in zip(m.parameters(), same.parameters()))
    other = GPT(cfg, seed=2)
    assert not torch.equal(m.layers[0].attn.q_proj.weight, other.layers[0].attn.q_proj.weight)
    # causal: changing the last token leaves earlier logits unchanged
    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    x2 = x.clone()
    x2[:, -1] = (x2[:, -1] + 1) % 256
    with torch.no_grad():
        a, b = m(x), m(x2)
    assert a.shape == (2, 16, 256)
    assert torch.allclose(a[:, :-1], b[:, :-1], atol=1e-6)
    assert not torch.allclose(a[:, -1], b[:, -1])
    assert lm_loss(a, x).item() == pytest.approx(math.log(256), rel=0.05)  # near-uniform at init
    meta = GPT(cfg, device="meta")
    assert all(p.is_meta for p in meta.parameters())


def test_lr_schedule_and_flags():
    assert [lr_factor(s, 10, 0, 0.2) for s in range(10)] == [1] * 8 + [1.0, 0.5]
    assert lr_factor(0, 10, 4, 0.0) == 0.25 and lr_factor(5, 10, 4, 0.0) == 1.0
    args = parse_args([])
    assert (args.nproc, args.device, args.optimizer, args.mode) == (2, "cpu", "dmuon", "z3")
    args = parse_args(["--mode", "z2", "--optimizer", "adamw", "--ns-dtype", "bf16"])
    assert (args.mode, args.optimizer, args.ns_dtype) == ("z2", "adamw", "bf16")
    # run()'s mapping form: defaults overlaid, names and choices checked
    assert _complete({"steps": 3, "mode": "z2"}).steps == 3
    with pytest.raises(TypeError, match="stepz"):
        _complete({"stepz": 3})
    with pytest.raises(SystemExit, match="--optimizer must be one of"):
        _complete({"optimizer": "sgd"})
    args = parse_args(["--experts", "8", "--top-k", "2"])
    assert (args.experts, args.top_k, args.aux_loss_coef) == (8, 2, 0.01)
    with pytest.raises(SystemExit, match="--top-k in"):
        _complete({"experts": 2, "top_k": 3})
    with pytest.raises(SystemExit, match="--experts with --tp"):
        _complete({"experts": 2, "tp": 2})


def test_ep_flags_are_refused_with_clear_messages():
    """``--ep P``: the job's own checks, before any process starts (dmuon's plan decides which
    mesh layouts it supports)."""
    from dmuon._train import run

    assert parse_args(["--experts", "4", "--ep", "2"]).ep == 2 and parse_args([]).ep == 1
    for given, message in (
        ({"ep": 0}, "--ep must be positive"),
        ({"ep": 2}, "--ep 2 needs --experts E: expert parallelism splits the MoE's experts over ranks"),
        ({"experts": 6, "ep": 4}, r"--ep 4 must divide --experts 6 \(each rank holds E/P experts\)"),
        (
            {"experts": 4, "ep": 2, "tp": 2},
            "--ep with --tp: expert parallelism together with tensor parallelism is not supported",
        ),
        ({"experts": 4, "ep": 2, "optimizer": "adamw"}, "--ep with --optimizer adamw: expert parallelism needs dmuon"),
    ):
        with pytest.raises(SystemExit, match=f"^{message}"):
            _complete(given)
    with pytest.raises(SystemExit, match=r"^--ep 4 must divide the world size 2 \(--nproc\)$"):
        run({"experts": 4, "ep": 4, "nproc": 2})  # refused before spawning


def test_paths_and_values_are_refused_before_any_rank_starts(tmp_path):
    """User errors a run would otherwise hit inside its ranks (a traceback per rank) or only
    after training (the output paths): refused by the launcher, one line each."""
    tiny = tmp_path / "tiny.txt"
    tiny.write_bytes(b"abcdef")  # 6 tokens: too few for --seq-len 64 (needs 2 x 65)
    text = tmp_path / "text.txt"
    text.write_bytes(b"x" * 200)
    missing = str(tmp_path / "no" / "such")
    for argv, message in (
        (["--data", str(tmp_path / "nothing.txt")], r"--data .*nothing\.txt: not a file"),
        (["--data", str(tmp_path)], r"--data .*: not a file"),
        (
            ["--data", str(tiny)],
            r"--data .*tiny\.txt with --seq-len 64: corpus of 6 tokens is too small for "
            r"seq_len=64 \(needs at least 130 tokens\)",
        ),
        (
            ["--seq-len", "100000000"],
            r"--data \(python stdlib sources\) with --seq-len 100000000: corpus of "
            r"4194304 tokens is too small",
        ),
        (["--json", missing + ".json"], r"--json .*: the folder '.*no' does not exist or is not writable"),
        (["--png", missing + ".png"], r"--png .*: the folder '.*no' does not exist or is not writable"),
        (["--save", str(tiny / "ckpt")], r"--save .*ckpt: cannot create the folder \(Not a directory\)"),
        (["--lr", "-1"], r"--lr and --adamw-lr must be >= 0, got --lr -1.0"),
        (["--adamw-lr", "-0.5"], r"--lr and --adamw-lr must be >= 0"),
        (["--router-optimizer", "adamw"], r"--router-optimizer adamw needs --experts E: a dense model has no router"),
    ):
        with pytest.raises(SystemExit, match=f"^{message}"):
            parse_args(argv)
    assert parse_args(["--data", str(text), "--seq-len", "8"]).data == str(text)  # 200 tokens are enough
    save = tmp_path / "ckpt" / "tp"  # parents too, as DCP's own writer creates them
    assert parse_args(["--save", str(save)]).save == str(save) and save.is_dir()  # created before the run


def test_ep_model_holds_its_slice_of_the_full_model():
    """``GPTConfig(ep=P)``: rank j's expert stacks are experts ``j*E/P ..`` of the ``ep = 1`` model
    of the same seed, every other parameter equal; ``num_experts`` stays the global E."""
    full_cfg = GPTConfig(d_model=16, n_layers=2, n_heads=2, d_mlp=24, seq_len=8, n_experts=4, top_k=2)
    full = dict(GPT(full_cfg, seed=3).named_parameters())
    ep_cfg = GPTConfig(**{**full_cfg.__dict__, "ep": 2})
    for j in range(2):
        model = GPT(ep_cfg, seed=3, ep_rank=j)
        assert model.layers[0].mlp.experts.num_experts == 4
        assert list(model.layers[0].mlp.experts.held) == [2 * j, 2 * j + 1]
        for name, p in model.named_parameters():
            want = full[name][2 * j : 2 * j + 2] if ".experts.w" in name else full[name]
            assert torch.equal(p, want), name
    with pytest.raises(ValueError, match="ep must be >= 1 and, when > 1, divide n_experts"):
        GPTConfig(n_experts=4, ep=3)


# -- real runs on 2 ranks --------------------------------------------------------------------


def _check_learns(m: dict, *, below_unigram: bool) -> None:
    assert m["world_size"] == 2 and m["steps"] == 30 and len(m["history"]["train"]) == 30
    assert all(math.isfinite(loss) for _, loss in m["history"]["train"])
    assert m["initial_val_loss"] == pytest.approx(math.log(256), rel=0.05)
    assert m["final_val_loss"] < m["first_train_loss"] - 1.0, m
    if below_unigram:
        assert m["final_val_loss"] < m["unigram_val_loss"] - 0.2, m


@needs_shakespeare
def test_dmuon_run_learns_and_ledger_matches_plan():
    """dmuon.Muon (Z3 then Z2), 30 steps on tinyshakespeare: val loss ends below the unigram
    baseline and far below the first loss; the measured ledger bytes per step equal the plan's
    total, and Z2 moves 2/3 of Z3's bytes (docs/planning.md, "Costs")."""
    z3, z2 = _runs_of_2("learn")
    _check_learns(z3, below_unigram=True)
    assert z3["plan_total_nbytes"] > 0
    assert z3["ledger_nbytes_per_step"] == z3["plan_total_nbytes"]
    assert sum(z3["plan_per_rank_nbytes"]) == z3["plan_total_nbytes"]
    assert z2["ledger_nbytes_per_step"] == z2["plan_total_nbytes"]
    assert 3 * z2["plan_total_nbytes"] == 2 * z3["plan_total_nbytes"]


# 6 steps of the MoE job without and with expert parallelism (same data, same init; fp32 NS)
MOE_SHORT = dict(SHORT, d_mlp=64, experts=4, top_k=2)


def _moe_runs():
    """The MoE runs of the 2-rank launch: a 30-step run, then MOE_SHORT without and with ``--ep 2``."""
    (case, _, _) = [c for name, c in _labels_of_2() if name == "moe"]
    return case, _runs_of_2("moe")


def test_moe_run_learns_and_ledger_matches_plan():
    """``--experts 4 --top-k 2`` (router + torchtitan-layout expert stacks w1/w3/w2, every expert
    its own Muon matrices, the block's experts split over both ranks), 30 steps on the embedded
    corpus: val loss ends below the unigram baseline, the ledger's bytes per step equal the plan's
    at every step, and the load-balancing loss is logged."""
    from dmuon.plan import compile as plan_compile
    from dmuon._train.loop import model_config

    case, (m, *_) = _moe_runs()
    _check_learns(m, below_unigram=True)
    assert m["experts"] == 4 and m["top_k"] == 2
    assert m["ledger_nbytes_per_step"] == m["plan_total_nbytes"] > 0
    assert [s for s, *_ in m["history"]["moe"]] == [1, 10, 20, 30]
    assert all(1.0 <= aux < 4.0 for _, aux, _, _ in m["history"]["moe"])  # E * sum f_e P_e >= 1 (uniform = 1)
    # what the job dedicated: the router and the three stacks of every block; each block's buffer
    # all-gathered (collectives="auto") with its experts water-filled over both ranks (w1 on rank 0,
    # w3 2 + 2, w2 on rank 1: equal slots), every expert one owner
    model = GPT(model_config(_complete(case)), device="meta")
    plan = plan_compile(model, 2)
    stacks = [p for p in plan.params if p.experts is not None]
    assert sorted(p.fqn for p in stacks) == sorted(f"layers.{i}.mlp.experts.w{j}" for i in range(2) for j in (1, 2, 3))
    block = [o.rank for j in (1, 2, 3) for o in plan.expert_owners(f"layers.0.mlp.experts.w{j}")]
    assert len(block) == 12 and sorted(set(block)) == [0, 1]
    assert {buf.collective for b in plan.boundaries for buf in b.buffers} == {"all_gather"}
    assert "layers.0.mlp.gate.weight" in plan.dedicated


def test_moe_ep_run_computes_the_non_ep_run():
    """``--experts 4 --ep 2`` on 2 ranks: each rank holds 2 experts, token slots travel by
    all_to_all, dmuon owns the local experts. Same data and init as ``--experts 4`` without EP,
    fp32 Newton-Schulz: every step's train loss and the validation losses agree to the oracle
    contract's 1e-6; the ledger's bytes per step equal the plan's, which is the plan of the EP
    model compiled on its own (meta device, ``ep=2``): the non-EP plan minus the stacks' bytes."""
    from dmuon.plan import compile as plan_compile
    from dmuon._train.loop import model_config

    _, (_, dense, ep) = _moe_runs()
    assert (dense["ep"], ep["ep"]) == (1, 2) and ep["n_params"] == dense["n_params"]
    losses = {k: [loss for _, loss in r["history"]["train"]] for k, r in (("dense", dense), ("ep", ep))}
    assert len(losses["ep"]) == 6 and losses["ep"][-1] < losses["ep"][0]
    np.testing.assert_allclose(losses["ep"], losses["dense"], rtol=1e-6)
    np.testing.assert_allclose([v for _, v in ep["history"]["val"]], [v for _, v in dense["history"]["val"]], rtol=1e-6)
    assert ep["ledger_nbytes_per_step"] == ep["plan_total_nbytes"] > 0
    cfg = model_config(_complete(dict(MOE_SHORT, ep=2)))
    planned = plan_compile(GPT(cfg, device="meta"), 2, ep=2)
    assert planned.cost.total_nbytes == ep["plan_total_nbytes"]
    assert list(planned.cost.per_rank_nbytes) == ep["plan_per_rank_nbytes"]
    stacks = [p.fqn for p in planned.params if p.experts is not None]
    assert len(stacks) == 6 and all(planned.param(f).experts.ep_size == 2 for f in stacks)
    assert ep["plan_total_nbytes"] < dense["plan_total_nbytes"]


@needs_shakespeare
def test_adamw_baseline_runs():
    (m,) = _runs_of_2("adamw")
    _check_learns(m, below_unigram=False)
    assert m["optimizer"] == "adamw" and m["ledger_nbytes_per_step"] is None
    assert m["plan_total_nbytes"] is None


INVARIANCE_OPTIMIZERS = ["adamw", "dmuon"]


def _invariance_cases(world):
    """The runs of every optimizer of test_world_size_invariance at one world size, in order."""
    out = []
    for optimizer in INVARIANCE_OPTIMIZERS:
        case = dict(SHORT, optimizer=optimizer)
        if world == 1:
            out.append(case)
        else:
            out += [case, dict(case, tp=2)] + ([dict(case, mesh="2x1")] if optimizer == "dmuon" else [])
    return out


def _invariance_runs(world, optimizer):
    """This optimizer's runs of ``world`` ranks: one launch of 1 rank for every optimizer's, the
    2-rank ones from the file's one launch of 2 ranks."""
    cases = _invariance_cases(world)
    if world == 2:
        runs = _runs_of_2("invariance")
    else:
        runs = shared_run(
            ("test_world_size_invariance", world),
            _train_cases,
            world,
            cases,
            timeout_s=240 * len(INVARIANCE_OPTIMIZERS),
        )[0]
    return [r for c, r in zip(cases, runs) if c["optimizer"] == optimizer]


@pytest.mark.parametrize("optimizer", INVARIANCE_OPTIMIZERS)
def test_world_size_invariance(optimizer):
    """The global batch does not depend on N: 1 and 2 ranks give the same losses (up to
    reduction order; fp32 Newton-Schulz), on the embedded stdlib corpus; so does ``--tp 2``
    (one data-parallel rank, tensor parallel over 2; with this model's shapes every matrix is
    gathered, so the standard iteration runs: 1e-5, TP's row-parallel sums reorder); for dmuon
    also an HSDP mesh ``--mesh 2x1`` (2 replicate groups of 1 shard); ledgers match plans.
    Both optimizers' runs share one launch per world size."""
    (one,) = _invariance_runs(1, optimizer)
    two, tp, *hsdp = _invariance_runs(2, optimizer)
    assert tp["tp"] == 2
    np.testing.assert_allclose(
        [loss for _, loss in tp["history"]["train"]], [loss for _, loss in one["history"]["train"]], rtol=1e-5
    )
    if optimizer == "dmuon":
        assert tp["ledger_nbytes_per_step"] == tp["plan_total_nbytes"] > 0
        assert tp["ledger_phase_nbytes_per_step"]["tp"] > 0
    for h in hsdp:
        assert h["ledger_nbytes_per_step"] == h["plan_total_nbytes"] > 0
        np.testing.assert_allclose(
            [loss for _, loss in h["history"]["train"]], [loss for _, loss in one["history"]["train"]], rtol=1e-6
        )
    assert one["world_size"] == 1 and two["world_size"] == 2
    assert one["initial_val_loss"] == pytest.approx(two["initial_val_loss"], rel=1e-6)
    l1 = [loss for _, loss in one["history"]["train"]]
    l2 = [loss for _, loss in two["history"]["train"]]
    assert len(l1) == len(l2) == 6
    np.testing.assert_allclose(l2, l1, rtol=1e-6)
    assert two["final_val_loss"] == pytest.approx(one["final_val_loss"], rel=1e-6)


@pytest.mark.distributed  # a process group in a subprocess
@pytest.mark.parametrize("optimizer,patches", [("adamw", "on"), ("dmuon", "off")])
def test_cli_end_to_end(tmp_path, optimizer, patches):
    """``python -m dmuon train`` spawns its 2 ranks itself and writes --json; dmuon's run also with
    its patches off (``DMUON_NO_PATCHES=1``): the job passes ``ignored_params`` to ``fully_shard``."""
    out = tmp_path / "metrics.json"
    cmd = [
        sys.executable,
        "-m",
        "dmuon",
        "train",
        "--optimizer",
        optimizer,
        "--steps",
        "3",
        "--d-model",
        "32",
        "--n-layers",
        "1",
        "--n-heads",
        "2",
        "--d-mlp",
        "64",
        "--seq-len",
        "32",
        "--batch",
        "4",
        "--eval-batch",
        "4",
        "--eval-batches",
        "1",
        "--eval-every",
        "3",
        "--log-every",
        "1",
        "--json",
        str(out),
    ]
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    if patches == "off":
        env["DMUON_NO_PATCHES"] = "1"
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "unigram baseline" in proc.stdout and "summary:" in proc.stdout
    assert "python stdlib sources" in proc.stdout
    if optimizer == "dmuon":  # bytes per step measured == plan at the last log step
        summary = proc.stdout.split("summary:")[1]
        measured, planned = re.search(r"measured ([\d,]+) B vs plan ([\d,]+) B", summary).groups()
        assert measured == planned, summary
    m = json.loads(out.read_text())
    assert m["world_size"] == 2 and m["steps"] == 3 and m["optimizer"] == optimizer
    assert math.isfinite(m["final_val_loss"]) and m["tokens_per_s"] > 0


def test_run_header_says_what_applies_to_the_optimizer():
    """The AdamW run of --compare has no dmuon mode and no Newton-Schulz: its header names FSDP2's
    reshard_after_forward instead of "mode z3 | ns fp32"."""
    from dmuon._train.loop import optimizer_desc

    assert optimizer_desc("dmuon", "z3", "fp32") == "optimizer dmuon | mode z3 | ns fp32"
    assert optimizer_desc("normuon", "z2", "bf16") == "optimizer normuon | mode z2 | ns bf16"
    adamw = optimizer_desc("adamw", "z3", "fp32")
    assert adamw == "optimizer adamw | FSDP2 reshard_after_forward=True (no Newton-Schulz)"
    assert "mode" not in adamw and "ns " not in adamw


# ----------------------------------------------------------------------------------------------
# the main job off a terminal: the note in place of the bar
# ----------------------------------------------------------------------------------------------


def test_main_job_notes_no_bar_and_no_plot_off_a_terminal(monkeypatch):
    import io
    import sys

    from dmuon._train import progress

    monkeypatch.setattr(sys, "stderr", io.StringIO())  # not a terminal: no bar, one note
    assert isinstance(progress.progress_bar(total=3), progress._NoBar)
    assert progress.progress_note(log_every=25) == (
        "progress: no bar (stderr is not a terminal), a log line every 25 steps; no plot without --png FILE"
    )
    assert progress.progress_note(png="run.png").endswith("log lines only; the plot goes to run.png")
    assert progress.progress_note(enabled=False) is None  # --quiet: nothing

    class Tty(io.StringIO):
        def isatty(self):
            return True

    monkeypatch.setattr(sys, "stderr", Tty())
    pytest.importorskip("tqdm")
    assert progress.progress_note() is None  # the bar shows: no note
