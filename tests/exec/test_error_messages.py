"""Error messages that name the real mistake and its fix.

One 2-rank launch runs cases a-c; each case returns ``(exception type, message)`` per rank, so
every test checks that all ranks raised the same error. The CLI case (d) runs
``python -m dmuon train`` in a subprocess.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from dist_utils import run_distributed
from oracle import make_model

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _catch(fn):
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the test inspects it
        return type(exc).__name__, str(exc)
    return None


def _cases():
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    import dmuon

    rank = dist.get_rank()
    out = {}

    # a. dedicate_params again: after fully_shard, and before it; fully_shard genuinely first
    model = make_model("tiny")
    plan = dmuon.dedicate_params(model)
    out["plan_fingerprint"] = plan.fingerprint()[:12]
    out["again_before_fully_shard"] = _catch(lambda: dmuon.dedicate_params(model))
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    out["again_after_fully_shard"] = _catch(lambda: dmuon.dedicate_params(model))
    out["apply_again_after_fully_shard"] = _catch(lambda: dmuon.exec.apply(plan, model))
    model = make_model("tiny")
    fully_shard(model.layers[0])
    out["fully_shard_first"] = _catch(lambda: dmuon.dedicate_params(model))

    # b. an int / tuple mesh that does not span the world
    out["mesh_too_big"] = _catch(lambda: dmuon.dedicate_params(make_model("tiny"), 4))
    out["hsdp_mesh_too_big"] = _catch(lambda: dmuon.dedicate_params(make_model("tiny"), (2, 2)))
    out["mesh_too_small"] = _catch(lambda: dmuon.dedicate_params(make_model("tiny"), 1))

    # c. ranks whose plans differ: rank 1 leaves layers.1.fc1.weight to AdamW; then a plan whose
    # only difference is a setting
    model = make_model("tiny")
    default = set(dmuon.plan.compile(model, 2).dedicated)
    pred = None if rank == 0 else (lambda fqn, p: fqn in default and fqn != "layers.1.fc1.weight")
    plan = dmuon.plan.compile(model, 2, predicate=pred)
    out["plans_differ_fqn"] = _catch(lambda: dmuon.exec.apply(plan, model))
    model = make_model("tiny")
    plan = dmuon.plan.compile(model, 2, reshard_after_forward=(rank == 0))
    out["plans_differ_setting"] = _catch(lambda: dmuon.exec.apply(plan, model))
    # rank 1 registers layers.0's submodules in another order: fc1 last (same FQNs and shapes)
    model = make_model("tiny")
    if rank == 1:
        block = model.layers[0]
        block._modules["fc1"] = block._modules.pop("fc1")
    out["plans_differ_order"] = _catch(lambda: dmuon.dedicate_params(model))

    # the happy path exchanges fingerprints only: one all_gather_object
    calls = []
    real = dist.all_gather_object

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    dist.all_gather_object = counting
    try:
        happy = dmuon.dedicate_params(make_model("tiny"))
    finally:
        dist.all_gather_object = real
    out["happy_path_gathers"] = len(calls)
    out["happy_path_link"] = happy.collectives.link  # read from the process group's backend (gloo)
    dist.barrier()
    return out


@pytest.fixture(scope="module")
def results():
    per_rank = run_distributed(_cases, 2, timeout_s=180)
    assert per_rank[0].keys() == per_rank[1].keys()
    for case in per_rank[0]:
        assert per_rank[0][case] == per_rank[1][case], case  # the same error on every rank
    return per_rank[0]


def test_dedicate_params_again_says_already_dedicated(results):
    fp = results["plan_fingerprint"]
    for case in ("again_after_fully_shard", "apply_again_after_fully_shard"):
        kind, msg = results[case]
        assert kind == "ValueError", case
        assert "already dedicated" in msg and fp in msg and "a second call is not needed" in msg, msg
        assert "build dmuon.Muon(model, ...) next" in msg, msg
        assert "BEFORE fully_shard" not in msg and "already sharded" not in msg, msg
    kind, msg = results["again_before_fully_shard"]
    assert kind == "ValueError" and "already dedicated" in msg and fp in msg
    assert "continue with fully_shard(block)" in msg, msg
    kind, msg = results["fully_shard_first"]  # the genuine order mistake keeps its message
    assert kind == "ValueError" and "already sharded" in msg and "BEFORE fully_shard" in msg
    from dmuon._hints import SET_UP_ORDER

    assert msg.count(SET_UP_ORDER) == 1 and msg.count("order:") == 1, msg  # the set-up order once
    assert msg.endswith(f"Set-up order: {SET_UP_ORDER} (docs/integrations.md)"), msg


def test_mesh_larger_than_world_names_sizes_and_fix(results):
    kind, msg = results["mesh_too_big"]
    assert kind == "ValueError"
    assert "mesh 4 needs 4 ranks but the world has 2" in msg, msg
    assert "pass a mesh of 2 ranks" in msg and "start 4 processes" in msg, msg
    assert "subset" not in msg, msg
    kind, msg = results["hsdp_mesh_too_big"]
    assert "needs R*N = 2 x 2 = 4 ranks but the world has 2" in msg, msg
    kind, msg = results["mesh_too_small"]  # a subset is what a smaller mesh may mean
    assert kind == "ValueError" and "has R*N = 1 ranks but the world has 2" in msg, msg
    assert "pass that DeviceMesh" in msg, msg


def test_plans_differ_names_what_differs(results):
    kind, msg = results["plans_differ_fqn"]
    assert kind == "RuntimeError" and "ranks hold different plans" in msg
    assert "differing ranks: [1]" in msg and "dmuon.plan.diff(plan of rank 0, plan of rank 1)" in msg, msg
    assert "- layers.1.fc1.weight" in msg, msg
    assert "Compile the plan identically on every rank" in msg
    assert "bytes per step" not in msg  # the difference, not the whole cost table
    kind, msg = results["plans_differ_setting"]
    assert kind == "RuntimeError" and "setting reshard_after_forward: True -> False" in msg, msg
    assert "Likely cause: different arguments: the models are identical" in msg, msg
    assert "First difference: none among the" in msg, msg
    # a predicate that differs on the same model: the arguments, and the first differing parameter
    msg = results["plans_differ_fqn"][1]
    assert "Likely cause: different arguments" in msg, msg
    assert (
        "position 4 (named_parameters() order of the dedicated ones) is 'layers.1.fc1.weight' (36, 8) on rank 0" in msg
    )


def test_plans_differ_by_registration_order_names_the_parameter_and_cause(results):
    """Rank 1 registers layers.0's fc1 after its other submodules: the same FQNs and shapes in another
    order. Both ranks raise the same error (the fixture checks it) naming the first parameter whose
    position differs and the registration order as the cause, in one line."""
    kind, msg = results["plans_differ_order"]
    assert kind == "RuntimeError" and "ranks hold different plans" in msg, msg
    first = (
        "First differing dedicated parameter: position 0 (named_parameters() order of the dedicated ones) is "
        "'layers.0.fc1.weight' (36, 8) on rank 0 but 'layers.0.fc2.weight' (8, 36) on rank 1."
    )
    assert first in msg.splitlines(), msg
    cause = [line for line in msg.splitlines() if line.startswith("Likely cause:")]
    assert len(cause) == 1 and cause[0].startswith("Likely cause: a different registration order"), msg
    assert "named_parameters() order" in cause[0]
    assert results["happy_path_gathers"] == 1
    assert results["happy_path_link"] == "gloo"  # dedicate_params priced collectives="auto" with gloo's record


def test_train_cli_user_error_inside_ranks_prints_one_clean_line(tmp_path):
    missing = tmp_path / "no_checkpoint_here"
    proc = subprocess.run(
        [sys.executable, "-m", "dmuon", "train", "--resume", str(missing), "--steps", "2", "--quiet"],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": REPO},
        capture_output=True,
        text=True,
        timeout=240,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "Traceback" not in out and "ProcessExitedException" not in out and "SIGTERM" not in out, out
    assert f"--resume {missing}: no complete checkpoint there" in out, out
    assert out.count("no complete checkpoint there") == 1, out
