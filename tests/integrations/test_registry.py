"""dmuon's integration registry (``dmuon._registry``): what ``import dmuon`` and the first
dedication change in other libraries, undo, the opt-out, the signature checks, and the explicit
(patch-free) paths.

In-process tests restore the registry's state after themselves; the identity checks of "what
changes when" run in fresh subprocesses (a 1-rank gloo group for the dedication)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import dmuon
from dmuon import _registry

REPO = Path(__file__).resolve().parents[2]
TESTS = Path(__file__).resolve().parents[1]
LOCAL = [i for i in _registry.INTEGRATIONS if i.trigger is None]


@pytest.fixture
def registry_state():
    """Run with the registry as this test leaves it, then put back what was installed before."""
    before = {n: rec.reason for n, rec in _registry._INSTALLED.items()}
    stages, disabled = set(_registry._STAGES_DONE), _registry._DISABLED
    yield
    _registry.uninstall()
    _registry._DISABLED = disabled
    _registry._STAGES_DONE.clear()
    _registry._STAGES_DONE.update(stages)
    for name, reason in before.items():
        _registry.install(name, reason=reason)


def _target(integ):
    owner = _registry._resolve_owner(integ)
    return None if owner is None else _registry._current(owner, _registry._split(integ.target)[2])


def _hook_state():
    from torch.optim.optimizer import _global_optimizer_pre_hooks

    return list(_global_optimizer_pre_hooks), list(sys.meta_path)


def test_every_integration_is_listed_once_with_a_known_stage():
    names = [i.name for i in _registry.INTEGRATIONS]
    assert len(names) == len(set(names))
    assert {i.stage for i in _registry.INTEGRATIONS} == {"import", "dedicate"}
    # import dmuon installs the clip hand-off only; the fully_shard skip moved to the first dedication
    assert [i.name for i in _registry.INTEGRATIONS if i.stage == "import"] == ["clip.nn_utils", "clip.clip_grad"]
    for integ in _registry.INTEGRATIONS:
        assert integ.why and integ.explicit, integ.name


def test_install_is_idempotent_and_undo_restores_every_original(registry_state):
    _registry.uninstall()
    originals = {i.name: _target(i) for i in LOCAL if i.kind == "attr"}
    hooks = _hook_state()
    done = _registry.install(*[i.name for i in LOCAL])
    assert set(done) >= {i.name for i in LOCAL if i.required}
    wrapped = {i.name: _target(i) for i in LOCAL if i.kind == "attr"}
    for name, w in wrapped.items():
        if name in done:
            assert getattr(w, _registry.MARKER) == name and w.__wrapped__ is originals[name]
    hooks_on = _hook_state()
    assert len(hooks_on[0]) == len(hooks[0]) + 1 and len(hooks_on[1]) == len(hooks[1]) + 1
    _registry.install(*[i.name for i in LOCAL])  # idempotent: the same wrappers, no second hook
    assert {i.name: _target(i) for i in LOCAL if i.kind == "attr"} == wrapped
    assert _hook_state() == hooks_on
    assert sorted(_registry.uninstall()) == sorted(done)
    for name, orig in originals.items():
        assert _target(_registry._BY_NAME[name]) is orig, name
    assert _hook_state() == hooks
    # a class attribute that was inherited comes back as inherited (not an own copy)
    from torch.amp.grad_scaler import GradScaler

    assert GradScaler.__dict__["_unscale_grads_"] is originals["amp.grad_scaler"]


def test_status_says_what_and_why(registry_state):
    rows = {s.name: s for s in dmuon.integrations.status()}
    assert rows["clip.nn_utils"].installed and "import dmuon" in rows["clip.nn_utils"].why
    text = str(dmuon.integrations.status())
    assert "fsdp2.managed_states" in text and "accelerate.prepare_fsdp2" in text
    dmuon.integrations.disable()
    assert not any(s.installed for s in dmuon.integrations.status())
    assert all("disabled" in s.why for s in dmuon.integrations.status())
    _registry.install_stage("dedicate")  # blocked
    assert not any(s.installed for s in dmuon.integrations.status())
    assert dmuon.integrations.enable("clip") == ["clip.nn_utils", "clip.clip_grad"]  # explicit still works


def test_changed_signature_raises_a_named_error(registry_state, monkeypatch):
    from torch.distributed.checkpoint import default_planner
    from torch.distributed.fsdp._fully_shard import _fsdp_init

    _registry.uninstall("dcp", "fsdp2")

    def other(state_dict, plan_metadata, strict=True):  # renamed second parameter
        raise AssertionError("never called")

    monkeypatch.setattr(default_planner, "create_default_local_load_plan", other)
    with pytest.raises(_registry.IntegrationError, match=r"'dcp.load_plan'.*DMUON_NO_PATCHES=1.*DCPLoadPlanner"):
        _registry.install("dcp")
    assert default_planner.create_default_local_load_plan is other  # left alone

    def managed(modules, ignored, *rest):
        raise AssertionError("never called")

    monkeypatch.setattr(_fsdp_init, "_get_managed_modules", managed)
    with pytest.raises(
        _registry.IntegrationError, match=r"'fsdp2.managed_modules'.*ignored_params.*fsdp2_ignored_params"
    ):
        _registry.install("fsdp2.managed_modules")
    monkeypatch.delattr(_fsdp_init, "_get_managed_states")
    with pytest.raises(_registry.IntegrationError, match=r"'fsdp2.managed_states'.*missing"):
        _registry.install("fsdp2.managed_states")


def test_clip_hand_off_passes_other_calls_through_unchanged(monkeypatch):
    assert _registry.installed("clip.nn_utils")
    orig = torch.nn.utils.clip_grad_norm_.__wrapped__
    seen = []

    def spy(parameters, max_norm, norm_type=2.0, error_if_nonfinite=False, foreach=None):
        seen.append((parameters, max_norm, norm_type, error_if_nonfinite, foreach))
        return orig(parameters, max_norm, norm_type, error_if_nonfinite, foreach)

    wrapper = dmuon.integrations._clip_handoff.hand_off(spy)
    w = torch.nn.Parameter(torch.ones(3))
    w.grad = torch.full((3,), 4.0)
    norm = wrapper((p for p in [w]), 1.0, 2.0, False, True)
    assert seen == [([w], 1.0, 2.0, False, True)]
    assert torch.allclose(norm, torch.tensor(48.0).sqrt())
    assert torch.allclose(w.grad.norm(), torch.tensor(1.0), atol=1e-5)


def test_dcp_load_planner_explains_a_dedicated_set_mismatch():
    from torch.distributed.checkpoint.metadata import Metadata, TensorProperties, TensorStorageMetadata

    meta = TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size([2]), [])
    metadata = Metadata(
        state_dict_metadata={"optim.state.layers.0.w.step": meta, "optim.state.layers.0.w.exp_avg": meta}
    )
    planner = dmuon.DCPLoadPlanner()
    planner.set_up_planner({"optim.state.layers.0.w.momentum_buffer": torch.zeros(2)}, metadata, True)
    with pytest.raises(
        RuntimeError,
        match=r"dedicated set differs.*dedicated \(Muon\) here but AdamW in the checkpoint: optim.state.layers.0.w",
    ):
        planner.create_local_plan()
    plain = dmuon.DCPLoadPlanner()
    plain.set_up_planner({"model.x": torch.zeros(2)}, metadata, True)
    with pytest.raises(RuntimeError, match="Missing key in checkpoint state_dict") as err:
        plain.create_local_plan()
    assert "dmuon" not in str(err.value)


def test_dmuon_grad_scaler_is_torch_scaler_for_other_optimizers():
    w = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([w], lr=0.1)
    scaler = dmuon.GradScaler("cpu", init_scale=4.0)
    assert isinstance(scaler, torch.amp.GradScaler)
    scaler.scale(w.sum()).backward()  # gradient 4 = scale x 1
    scaler.step(opt)
    scaler.update()
    assert torch.allclose(w.detach(), torch.full((3,), 0.9))


# ------------------------------------------------------------------------------------------------
# Fresh processes: identities of every target before / after import / after a first dedication
# ------------------------------------------------------------------------------------------------

_PRELUDE = r"""
import json, os, sys, tempfile
sys.path.insert(0, {tests!r})
import torch, torch.distributed as dist
import torch.nn.utils, torch.nn.utils.clip_grad
from torch.amp.grad_scaler import GradScaler
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.distributed.fsdp._fully_shard import _fsdp_init
from torch.distributed.checkpoint import default_planner
from torch.distributed.checkpoint import state_dict as dcp_state_dict
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.optim.optimizer import _global_optimizer_pre_hooks

def snapshot():
    out = {{
        "fsdp2.managed_modules": _fsdp_init._get_managed_modules,
        "fsdp2.managed_states": _fsdp_init._get_managed_states,
        "clip.nn_utils": torch.nn.utils.clip_grad_norm_,
        "clip.clip_grad": torch.nn.utils.clip_grad.clip_grad_norm_,
        "amp.grad_scaler": GradScaler.__dict__["_unscale_grads_"],
        "amp.sharded_grad_scaler": ShardedGradScaler.__dict__.get("_unscale_grads_"),
        "dcp.load_plan": default_planner.create_default_local_load_plan,
        "dcp.unflatten_optim": dcp_state_dict._unflatten_optim_state_dict,
        "ddp.guard": DDP.__dict__["__init__"],
    }}
    ids = {{k: id(v) for k, v in out.items()}}
    ids["optimizer.guard"] = tuple(_global_optimizer_pre_hooks)
    ids["import_hook"] = tuple(id(f) for f in sys.meta_path)
    acc = sys.modules.get("accelerate.accelerator")
    if acc is not None:
        for a in ("_prepare_fsdp2", "prepare_model", "clip_grad_norm_"):
            ids["accelerate." + a] = id(acc.Accelerator.__dict__[a])
    keep.append(out)
    return ids

keep = []
def changed(a, b):
    return sorted(k for k in a if k in b and a[k] != b[k])

def init_one_rank():
    f = tempfile.NamedTemporaryFile(delete=False).name
    dist.init_process_group("gloo", init_method="file://" + f, rank=0, world_size=1)
"""


def _run(*bodies: str, env_extra: dict | None = None, timeout: int = 240) -> dict:
    env = dict(os.environ)
    env.pop("DMUON_NO_PATCHES", None)
    env.update(env_extra or {})
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    script = _PRELUDE.format(tests=str(TESTS)) + "\n".join(textwrap.dedent(b) for b in bodies)
    r = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=timeout, cwd=REPO
    )
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


_DEDICATE = r"""
from torch.distributed.fsdp import fully_shard
from oracle import make_model, lm_loss, global_batches
init_one_rank()
model = make_model("tiny")
plan = dmuon.dedicate_params(model, None)
"""


def test_import_changes_only_the_clip_hand_off_then_dedication_the_rest():
    r = _run(
        """
        s0 = snapshot()
        import dmuon
        s1 = snapshot()
        """,
        _DEDICATE,
        """
        s2 = snapshot()
        status = {s.name: s.installed for s in dmuon.integrations.status()}
        undone = dmuon.integrations.disable()
        s3 = snapshot()
        print(json.dumps(dict(on_import=changed(s0, s1), on_dedicate=changed(s1, s2), status=status,
                              restored=changed(s0, s3), undone=sorted(undone))))
        """,
    )
    # import dmuon: the clip hand-off only; the fully_shard skip installs with the rest at the first dedication
    assert r["on_import"] == ["clip.clip_grad", "clip.nn_utils"]
    assert r["on_dedicate"] == [
        "amp.grad_scaler",
        "amp.sharded_grad_scaler",
        "dcp.load_plan",
        "dcp.unflatten_optim",
        "ddp.guard",
        "fsdp2.managed_modules",
        "fsdp2.managed_states",
        "import_hook",
        "optimizer.guard",
    ]
    assert r["restored"] == []  # every original object back (identity)
    assert sorted(k for k, v in r["status"].items() if v) == r["undone"]


def test_opt_out_env_leaves_torch_untouched_and_ignored_params_path_trains():
    r = _run(
        """
        s0 = snapshot()
        import dmuon
        s1 = snapshot()
        """,
        _DEDICATE,
        """
        s2 = snapshot()
        # without ignored_params FSDP2 takes the dedicated matrices: dmuon.Muon names the fix
        import copy
        try:
            bad = make_model("tiny")
            dmuon.dedicate_params(bad, None)
            for layer in bad.layers:
                fully_shard(layer)
            fully_shard(bad)
            dmuon.Muon(bad, lr=0.02)
            error = None
        except RuntimeError as exc:
            error = str(exc)
        # the patch-free path: ignored_params, dmuon.GradScaler, dmuon.clip_grad_norm_
        for layer in model.layers:
            fully_shard(layer, ignored_params=dmuon.fsdp2_ignored_params(layer))
        fully_shard(model, ignored_params=dmuon.fsdp2_ignored_params(model))
        opt = dmuon.Muon(model, lr=0.02, adamw_lr=3e-3)
        scaler = dmuon.GradScaler("cpu", init_scale=2.0)
        losses = []
        for batch in global_batches(2):
            loss = lm_loss(model, batch)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            norm = dmuon.clip_grad_norm_(model, 1.0)
            scaler.step(opt); scaler.update(); opt.zero_grad()
            losses.append(loss.item())
        s3 = snapshot()
        print(json.dumps(dict(changed=changed(s0, s1) + changed(s1, s2) + changed(s0, s3), error=error,
                              losses=losses, any_installed=any(s.installed for s in dmuon.integrations.status()))))
        """,
        env_extra={"DMUON_NO_PATCHES": "1"},
    )
    assert r["changed"] == [] and not r["any_installed"]
    assert r["error"] is not None and "ignored_params=dmuon.fsdp2_ignored_params" in r["error"], r["error"]
    assert len(r["losses"]) == 2 and all(x == x for x in r["losses"])


def test_scaler_and_clip_made_before_the_first_dedication_still_work():
    r = _run(
        """
        import dmuon
        from torch.nn.utils import clip_grad_norm_       # bound after import dmuon: the hand-off
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0)   # instantiated before any dedication
        """,
        _DEDICATE,
        """
        for layer in model.layers:
            fully_shard(layer)
        fully_shard(model)
        opt = dmuon.Muon(model, lr=0.02, adamw_lr=3e-3)
        sgd = torch.optim.SGD(model.parameters(), lr=0.1)
        for batch in global_batches(1):
            scaler.scale(lm_loss(model, batch)).backward()
            scaler.unscale_(opt)
            ours = clip_grad_norm_(model.parameters(), 1e9)
            ref = dmuon.clip_grad_norm_(model, 1e9)
            scaler.step(opt); scaler.update()
        calls0 = dmuon.exec.ledger().calls["other"]
        with dmuon.exec.metered(record=True) as led:  # the ledger accessor and a metered block
            dmuon.exec._comm.collective_calls.all_reduce_sum(torch.ones(3), group=None, phase="other")
        metered = dict(calls=dict(led.calls), ops=len(led.ops), process=dmuon.exec.ledger().calls["other"] - calls0)
        try:
            sgd.step()
            foreign = None
        except TypeError as exc:
            foreign = str(exc)
        try:
            DDP(model)
            ddp = None
        except ValueError as exc:
            ddp = str(exc)
        print(json.dumps(dict(ours=ours.item(), ref=ref.item(), scale=scaler.get_scale(), foreign=foreign, ddp=ddp,
                              metered=metered)))
        """,
    )
    assert abs(r["ours"] - r["ref"]) <= 1e-6 * max(1.0, r["ref"])
    assert r["scale"] == 2.0  # no inf found: the step ran and the scale kept
    assert "SGD holds" in r["foreign"] and "dmuon.Muon" in r["foreign"]
    assert "DistributedDataParallel" in r["ddp"]
    assert r["metered"] == {"calls": {"other": 1}, "ops": 1, "process": 1}


@pytest.mark.parametrize("order", ["before", "after", "never"])
def test_accelerate_imported_before_or_after_dmuon(order):
    pytest.importorskip("accelerate")
    r = _run(
        *{
            "before": ["import accelerate.accelerator\ns0 = snapshot()\nimport dmuon", _DEDICATE],
            "after": ["import dmuon", _DEDICATE, "import accelerate.accelerator\ns0 = {}"],
            "never": ["import dmuon\nimport accelerate.accelerator\ns0 = snapshot()"],
        }[order],
        """
        from accelerate.accelerator import Accelerator
        wrapped = sorted(a for a in ("_prepare_fsdp2", "prepare_model", "clip_grad_norm_")
                         if getattr(Accelerator.__dict__[a], "__dmuon_wraps__", None))
        status = {s.name: s.installed for s in dmuon.integrations.status() if s.name.startswith("accelerate")}
        dmuon.integrations.uninstall("accelerate")
        restored = changed(s0, snapshot()) if s0 else []
        print(json.dumps(dict(wrapped=wrapped, status=status, restored=[k for k in restored if k.startswith("accelerate")])))
        """,
    )
    if order == "never":
        assert r["wrapped"] == [] and not any(r["status"].values())
    else:
        assert r["wrapped"] == ["_prepare_fsdp2", "clip_grad_norm_", "prepare_model"]
        assert all(r["status"].values())
    assert r["restored"] == []
