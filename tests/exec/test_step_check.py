"""Ranks out of step: a rank that skips or repeats a backward / optimizer step
is detected at the next dmuon broadcast, and no rank reports success.

Each holder writes ``step_code(optimizer steps, phase, forward index)`` into its segment's flag
slots before a broadcast; every receiver compares it with its own (``dmuon.exec._runtime._boundary.step_check``).
Two fault runs at W = 2 (own processes: a short gloo timeout, dmuon's ``collective_timeout_s``),
each rank recording how it ended; plus the code's exactness in every wire dtype.
"""

from __future__ import annotations

import pytest
import torch

from oracle import dmuon_optimizer, global_batches, lm_loss, make_model

pytestmark = pytest.mark.distributed

PG_TIMEOUT_S = 5
DMUON_TIMEOUT_S = 3
DEADLINE_S = 240  # start-up included on a loaded 2-core machine; a hang would run forever


def _rank(rank, world, port, root, fault):
    import datetime
    import os
    import pickle
    import time

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    import dmuon

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=PG_TIMEOUT_S))
    model = make_model("tiny")
    dmuon.dedicate_params(model, collective_timeout_s=DMUON_TIMEOUT_S)
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    opt = dmuon_optimizer(model)
    t0 = time.monotonic()
    try:
        for step, batch in enumerate(global_batches(4)):
            loss = lm_loss(model, batch.chunk(world)[rank])
            if rank == 1 and step == 1 and fault == "skip":
                continue  # this rank skips one backward + optimizer step and carries on
            loss.backward()
            if rank == 1 and step == 1 and fault == "extra":  # one extra forward / backward
                lm_loss(model, batch.chunk(world)[rank]).backward()
            opt.step()
            opt.zero_grad()
        result = ("no error", "")
    except BaseException as exc:  # noqa: BLE001
        result = (type(exc).__name__, str(exc))
    with open(f"{root}/{fault}_{rank}.pkl", "wb") as f:
        pickle.dump(dict(result=result, elapsed_s=time.monotonic() - t0), f)
    os._exit(0)


def _run(root, fault):
    import pickle

    from dist_utils import run_fault_ranks

    exitcodes, hung = run_fault_ranks(_rank, 2, (root, fault), deadline_s=DEADLINE_S)
    out = {}
    for r in range(2):
        try:
            with open(f"{root}/{fault}_{r}.pkl", "rb") as f:
                out[r] = pickle.load(f)
        except FileNotFoundError:
            out[r] = dict(result=("no record", f"exit code {exitcodes[r]}"), elapsed_s=float("inf"))
    return out, hung


@pytest.mark.timeout(600)
@pytest.mark.parametrize("fault", ["skip", "extra"])
def test_a_rank_out_of_step_fails_every_rank_naming_the_steps(tmp_path, fault):
    out, hung = _run(str(tmp_path), fault)
    assert not hung, f"ranks {hung} still running after {DEADLINE_S} s: {out}"
    kinds = {r: out[r]["result"][0] for r in out}
    assert "no error" not in kinds.values(), f"a rank reported success: {out}"
    seen = [out[r]["result"][1] for r in out if kinds[r] == "RanksOutOfStep"]
    assert seen, f"no rank detected the mismatch: {out}"
    for msg in seen:  # names both sides' step and phase, and the fix
        assert "ranks out of step at boundary 'layers." in msg, msg
        assert msg.count("step ") >= 2 and "broadcast" in msg, msg
        assert "same forwards, backwards and opt.step() calls" in msg, msg
    for r in out:  # the others end through a timeout or the peer's exit, never silently
        assert kinds[r] in (
            "RanksOutOfStep",
            "CollectiveTimeout",
            "CollectiveTransportError",
            "DistBackendError",
            "RuntimeError",
        ), out[r]


def test_step_code_is_exact_in_every_wire_dtype_and_distinguishes_the_faults():
    from dmuon.exec._runtime._boundary.step_check import describe_code, step_code

    codes = {step_code(s, b, f) for s in range(32) for b in (False, True) for f in range(4)}
    assert len(codes) == 256 and min(codes) == 1 and max(codes) == 256
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        t = torch.tensor(sorted(codes), dtype=dtype)
        assert t.float().tolist() == sorted(codes), dtype
    # skip: the skipping rank's next forward meets the others' backward of the same step
    assert step_code(1, False, 1) != step_code(1, True, 1)
    # extra forward / backward: its extra forward meets the others' next step
    assert step_code(1, False, 1) != step_code(2, False, 0)
    assert (
        describe_code(step_code(3, True, 1))
        == "step 3 (mod 32), backward broadcast, after 1 forward(s) of this step (mod 4)"
    )
