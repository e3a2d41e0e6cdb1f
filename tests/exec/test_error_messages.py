"""Error messages that name the real mistake and its fix.

One 2-rank launch runs cases a-c; each case returns ``(exception type, message)`` per rank, so
every test checks that all ranks raised the same error. The CLI case (d) runs
``python -m dmuon train`` in a subprocess.
"""

from __future__ import annotations

import datetime
import os
import subprocess
import sys

import pytest
import torch

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


# ----------------------------------------------------------------------------------------------
# wait_all: a failed wait named for what it is (no process group: fake works)
# ----------------------------------------------------------------------------------------------


class _FakeWork:
    """A ``Work`` whose ``wait`` raises ``exc`` after ``delay_s`` (or returns ``result``)."""

    def __init__(self, exc=None, delay_s=0.0, result=True):
        self.exc, self.delay_s, self.result, self.timeouts = exc, delay_s, result, []

    def wait(self, timeout=None):
        import time

        self.timeouts.append(timeout)
        time.sleep(self.delay_s)
        if self.exc is not None:
            raise self.exc
        return self.result


GLOO_CLOSED = (
    "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
    "[127.0.0.1]:13447. This is typically caused by a remote worker crashing."
)


def test_wait_all_names_a_transport_error_and_chains_the_backend_error():
    from dmuon.exec._comm import collective_calls as C

    exc = RuntimeError(GLOO_CLOSED)
    with pytest.raises(C.CollectiveTransportError) as info:
        C.wait_all(
            [None, _FakeWork(exc)], what="boundary 'layers.0' forward_broadcast", timeout_s=30.0, step=3, forwards=1
        )
    msg = str(info.value)
    assert (
        info.value.__cause__ is exc
        and isinstance(info.value, C.CollectiveError)
        and isinstance(info.value, RuntimeError)
    )
    assert msg.startswith(
        "dmuon: collective for boundary 'layers.0' forward_broadcast failed in the transport after 0.0"
    )
    assert "the backend names the peer [127.0.0.1]:13447 ('Connection closed by peer [127.0.0.1]:13447." in msg, msg
    assert "pair.cc" not in msg and "did not complete within" not in msg and "this is not a timeout" in msg, msg
    assert "3 optimizer step(s) done, 1 grad-enabled forward(s) of this boundary since the last step" in msg, msg
    first, second, third = (
        msg.index(s)
        for s in (
            "1) a rank stopped early or skipped a whole step",
            "2) a rank died",
            "3) a rank-dependent number of micro-batches",
        )
    )
    assert first < second < third, msg
    # the same with no dmuon timeout (the bare wait of before): named the same way
    with pytest.raises(C.CollectiveTransportError, match="failed in the transport"):
        C.wait_all(
            [_FakeWork(RuntimeError("NCCL error: remote process exited or there was a network error"))],
            what="x",
            timeout_s=None,
        )


def test_wait_all_timeouts_stay_timeouts():
    from dmuon.exec._comm import collective_calls as C

    # gloo's wait(timeout) raising "Operation timed out!" after dmuon's timeout
    work = _FakeWork(RuntimeError("Operation timed out!"), delay_s=0.2)
    with pytest.raises(C.CollectiveTimeout) as info:
        C.wait_all([work], what="boundary 'layers.1' reduce", timeout_s=0.2)
    assert (
        "dmuon: collective for boundary 'layers.1' reduce did not complete within 0.2 s (collective_timeout_s)"
        in str(info.value)
    )
    assert work.timeouts[0].total_seconds() == 0.2
    # an error raised after dmuon's timeout whatever its words, and Work.wait returning False
    with pytest.raises(C.CollectiveTimeout, match="did not complete within 0.1 s"):
        C.wait_all([_FakeWork(RuntimeError("some backend failure"), delay_s=0.1)], what="x", timeout_s=0.1)
    with pytest.raises(C.CollectiveTimeout, match="did not complete within 5 s"):
        C.wait_all([_FakeWork(result=False)], what="x", timeout_s=5.0)
    # the process group's own timeout, before dmuon's: a timeout, saying whose
    with pytest.raises(C.CollectiveTimeout) as info:
        C.wait_all(
            [_FakeWork(RuntimeError("[../gloo/pair.cc:1] Timed out waiting 5000ms for recv operation to complete"))],
            what="x",
            timeout_s=600.0,
        )
    assert "did not complete within the process group's timeout" in str(info.value), str(info.value)
    assert not isinstance(info.value, C.CollectiveTransportError)
    # the default: DEFAULT_TIMEOUT_S (600 s); None: the bare wait
    work = _FakeWork()
    C.wait_all([work], what="x")
    C.wait_all([work], what="x", timeout_s=None)
    assert C.DEFAULT_TIMEOUT_S == 600.0 and work.timeouts == [datetime.timedelta(seconds=600.0), None]


def test_blocking_timeout_only_where_the_wait_blocks_the_cpu(monkeypatch):
    import torch.distributed as dist

    from dmuon.exec._comm import collective_calls as C

    assert C.blocking_timeout_s(600.0, torch.device("cpu")) == 600.0
    assert C.blocking_timeout_s(None, torch.device("cpu")) is None
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.delenv("TORCH_NCCL_BLOCKING_WAIT", raising=False)
    monkeypatch.delenv("NCCL_BLOCKING_WAIT", raising=False)
    assert C.blocking_timeout_s(600.0, torch.device("cuda", 0)) is None  # NCCL's non-blocking wait: the watchdog's
    monkeypatch.setenv("TORCH_NCCL_BLOCKING_WAIT", "1")
    assert C.blocking_timeout_s(600.0, torch.device("cuda", 0)) == 600.0
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    monkeypatch.delenv("TORCH_NCCL_BLOCKING_WAIT")
    assert C.blocking_timeout_s(30.0, torch.device("cuda", 0)) == 30.0


def test_wait_report_classifies_backend_messages():
    from dmuon.exec._comm.wait_report import backend_peer, is_timeout

    for text in (
        "Operation timed out!",
        "Application timeout caused pair closure",
        "[Rank 0] Work WorkNCCL(SeqNum=7, OpType=BROADCAST) timed out in blocking wait.",
        "Watchdog caught collective operation timeout: WorkNCCL(SeqNum=7) ran for 600031 milliseconds",
    ):
        assert is_timeout(text, 0.1, 600.0), text
    for text in (
        GLOO_CLOSED,
        "Read error [127.0.0.1]:9629: Connection reset by peer",
        "NCCL error in: ProcessGroupNCCL.cpp:1, remote process exited or there was a network error",
    ):
        assert not is_timeout(text, 0.1, 600.0), text
    assert is_timeout("Connection reset by peer", 599.0, 600.0)  # raised once dmuon's time was up
    assert backend_peer(GLOO_CLOSED) == "[127.0.0.1]:13447"
    assert backend_peer("Read error [127.0.0.1]:9629: Connection reset by peer") == "[127.0.0.1]:9629"
    assert backend_peer("NCCL error: peer rank 3 failed") == "rank 3"
    assert backend_peer("something else") is None
