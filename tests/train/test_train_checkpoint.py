"""The main job's ``--save`` / ``--resume`` (DCP) and ``--compare normuon,adamw`` / ``--png``.

One 2-rank process group runs: an uninterrupted 1-D run that saves every 2 steps; resumes from
its step-2 checkpoint on the same mesh (bit-identical losses, validation losses, LR schedule and
RNG) and on an HSDP mesh 2x1 (fp32 bounds); the AdamW baseline saved and resumed the same way;
the MoE job with expert parallelism (``--experts 4 --ep 2``) saved and resumed at ``--ep 2`` and
without EP, and the MoE job without EP resumed at ``--ep 2``; and ``--compare normuon,adamw --png``
(every run in one figure). A 1-rank group resumes the 2-rank checkpoint (another world size).
"""

from __future__ import annotations

import math
import os

import numpy as np
import pytest

from dist_utils import run_distributed
from train_job import TINY, write_corpus

from dmuon._train.checkpoint import latest_checkpoint, step_dir


def _resume_cases(root: str, data: str):
    """Every rank: the runs of the module docstring (2 ranks) or the world-size resume (1 rank)."""
    import torch
    import torch.distributed as dist

    from dmuon._train import run

    base = dict(TINY, data=data)
    if dist.get_world_size() == 1:
        return {"n1": run(dict(base, resume=step_dir(os.path.join(root, "dmuon"), 2)))}
    out = {}
    out["full"] = run(dict(base, save=os.path.join(root, "dmuon"), save_every=2))
    rng_at_end = torch.get_rng_state().clone()  # nothing draws after the step-2 save
    torch.manual_seed(1234)  # scrambled: the resume must restore the saved state
    out["same"] = run(dict(base, resume=step_dir(os.path.join(root, "dmuon"), 2)))
    out["rng_restored"] = torch.equal(torch.get_rng_state(), rng_at_end)
    out["hsdp"] = run(dict(base, resume=step_dir(os.path.join(root, "dmuon"), 2), mesh="2x1"))
    out["adamw_full"] = run(dict(base, optimizer="adamw", save=os.path.join(root, "adamw"), save_every=2))
    out["adamw_same"] = run(dict(base, optimizer="adamw", resume=step_dir(os.path.join(root, "adamw"), 2)))
    moe, ep_root = dict(base, experts=4, top_k=2), os.path.join(root, "ep")
    out["ep_full"] = run(dict(moe, ep=2, save=ep_root, save_every=2))
    out["ep_same"] = run(dict(moe, ep=2, resume=step_dir(ep_root, 2)))
    out["ep_to_1"] = run(dict(moe, resume=step_dir(ep_root, 2)))  # the same checkpoint without EP
    out["moe_full"] = run(dict(moe, save=os.path.join(root, "moe"), save_every=2))  # no EP
    out["moe_to_ep"] = run(dict(moe, ep=2, resume=step_dir(os.path.join(root, "moe"), 2)))
    try:
        run(dict(base, seed=1, resume=os.path.join(root, "dmuon")))
    except SystemExit as e:
        out["mismatch"] = str(e)
    png = os.path.join(root, "curves.png")
    out["compare"] = run(dict(base, compare="normuon,adamw", png=png))
    out["png"] = open(png, "rb").read(8) if dist.get_rank() == 0 else None
    return out


def _losses(m, kind="train"):
    return [v for _, v in m["history"][kind]]


def test_save_resume_any_mesh_and_compare(tmp_path):
    root, data = str(tmp_path / "ckpt"), write_corpus(tmp_path)
    two = run_distributed(_resume_cases, 2, root, data, timeout_s=300)
    (one,) = run_distributed(_resume_cases, 1, root, data, timeout_s=120)
    r = two[0]
    full, same, hsdp, n1 = r["full"], r["same"], r["hsdp"], one["n1"]

    # checkpoints after steps 2 and 4; the root resolves to the newest
    assert latest_checkpoint(os.path.join(root, "dmuon")) == step_dir(os.path.join(root, "dmuon"), 4)
    assert latest_checkpoint(os.path.join(root, "nothing")) is None

    # same mesh: the resumed run IS the uninterrupted one, bit for bit (losses of every step,
    # validation losses, and the history carried over from the checkpoint)
    assert same["start_step"] == 2 and full["start_step"] == 0
    assert _losses(same) == _losses(full) and len(_losses(full)) == 4
    assert _losses(same, "val") == _losses(full, "val")
    assert r["rng_restored"] and two[1]["rng_restored"]
    assert r["adamw_same"]["history"]["train"] == r["adamw_full"]["history"]["train"]
    assert same["ledger_nbytes_per_step"] == same["plan_total_nbytes"]  # 2 resumed steps only

    # another mesh (HSDP 2x1) and another world size (1): the fp32 bounds of the oracle contract
    for other in (hsdp, n1):
        assert other["start_step"] == 2
        assert _losses(other)[:2] == _losses(full)[:2]  # carried over from the checkpoint
        np.testing.assert_allclose(_losses(other), _losses(full), rtol=1e-6)
        np.testing.assert_allclose(_losses(other, "val"), _losses(full, "val"), rtol=1e-6)
    assert _losses(full)[3] < _losses(full)[0]

    # expert parallelism: the checkpoint holds each stack and its momentum at the full logical
    # shape (E, F, D) (DCP reshards it); resuming at --ep 2 is the uninterrupted run bit for bit,
    # resuming without EP (every expert on both ranks, expert ranges owned by dmuon) within fp32 bounds
    import torch.distributed.checkpoint as dcp

    meta = dcp.FileSystemReader(step_dir(os.path.join(root, "ep"), 2)).read_metadata().state_dict_metadata
    assert tuple(meta["model.layers.0.mlp.experts.w1"].size) == (4, 64, 32)
    assert tuple(meta["optim.state.layers.0.mlp.experts.w2.momentum_buffer"].size) == (4, 32, 64)
    ep_full, ep_same, ep_to_1 = r["ep_full"], r["ep_same"], r["ep_to_1"]
    moe_full, moe_to_ep = r["moe_full"], r["moe_to_ep"]
    assert (ep_full["ep"], ep_same["ep"], ep_to_1["ep"], moe_full["ep"], moe_to_ep["ep"]) == (2, 2, 1, 1, 2)
    assert _losses(ep_same) == _losses(ep_full) and _losses(ep_same, "val") == _losses(ep_full, "val")
    assert ep_same["start_step"] == ep_to_1["start_step"] == moe_to_ep["start_step"] == 2
    # the EP run is the run without EP (fp32 bounds), and a resume across EP degrees in either
    # direction continues it within the same bounds
    for other, ref in ((moe_full, ep_full), (ep_to_1, ep_full), (moe_to_ep, moe_full)):
        assert _losses(other)[:2] == _losses(ref)[:2] or other is moe_full
        np.testing.assert_allclose(_losses(other), _losses(ref), rtol=1e-6)
        np.testing.assert_allclose(_losses(other, "val"), _losses(ref, "val"), rtol=1e-6)
    assert ep_same["ledger_nbytes_per_step"] == ep_same["plan_total_nbytes"]

    # the run-defining flags must match: the same clear error on every rank
    for rank in (0, 1):
        assert "belongs to another run" in two[rank]["mismatch"] and "--seed 0 (given 1)" in two[rank]["mismatch"]

    # --compare normuon,adamw: each compared run is exactly its standalone run (same data and seed)
    cmp = r["compare"]
    normuon, adamw = cmp["compare"]
    assert cmp["optimizer"] == "dmuon" and (normuon["optimizer"], adamw["optimizer"]) == ("normuon", "adamw")
    assert adamw["history"]["train"] == r["adamw_full"]["history"]["train"]
    assert _losses(cmp) == _losses(full)
    # NorMuon: the same model and first batch (its first loss is Muon's), 0 extra bytes, another trajectory
    assert _losses(normuon)[0] == _losses(full)[0] and _losses(normuon)[1:] != _losses(full)[1:]
    assert normuon["ledger_nbytes_per_step"] == normuon["plan_total_nbytes"] == full["plan_total_nbytes"]
    times = cmp["history"]["val_train_time_s"]
    assert len(times) == len(cmp["history"]["val"]) == 3 and times[0] == 0.0 < times[1] <= times[2]
    assert r["png"] == b"\x89PNG\r\n\x1a\n" and two[1]["png"] is None
    assert all(math.isfinite(v) for m in cmp["compare"] for v in _losses(m, "val"))


def test_png_without_matplotlib_fails_before_training(monkeypatch):
    import builtins

    from dmuon._cli.train_command import _complete

    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name == "matplotlib" or name.startswith("matplotlib."):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    with pytest.raises(SystemExit, match=r"pip install -e '\.\[train\]'"):
        _complete({"png": "x.png"})
    with pytest.raises(SystemExit, match="not the run's own --optimizer adamw"):
        _complete({"compare": "adamw", "optimizer": "adamw"})
    with pytest.raises(SystemExit, match="unknown optimizer 'sgd'"):
        _complete({"compare": "normuon,sgd"})
    with pytest.raises(SystemExit, match="NorMuon runs on matrices whose owner holds them whole"):
        _complete({"optimizer": "normuon", "owner_groups": "auto"})
