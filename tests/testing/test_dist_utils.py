"""The multi-process test helper: results, failures and hangs."""

from __future__ import annotations

import time

import pytest

from conftest import SHARED_DATA
from dist_utils import DistributedError, DistributedTimeout, run_distributed


def _all_reduce_cases(values):
    """Several cases in one process group: an all_reduce per value, plus rank/world."""
    import torch
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    out = []
    for v in values:
        t = torch.tensor([float(v * (rank + 1))])
        dist.all_reduce(t)
        out.append(t.item())
    return {"rank": rank, "world": world, "sums": out, "threads": torch.get_num_threads()}


def _hang_on_rank1():
    import torch.distributed as dist

    if dist.get_rank() == 1:
        time.sleep(600)
    dist.barrier()  # rank 0 waits for rank 1 forever


def _raise_on_rank1(msg):
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise ValueError(msg)
    dist.barrier()  # rank 0 would block here until killed


def _user_error_on_rank1(msg):
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise SystemExit(msg)
    dist.barrier()  # rank 0 would block here until killed


def test_two_rank_all_reduce_several_cases():
    res = run_distributed(_all_reduce_cases, 2, [1, 2.5], timeout_s=120)
    assert [r["rank"] for r in res] == [0, 1]
    assert all(r["world"] == 2 and r["threads"] == 1 for r in res)
    # sum over ranks of v * (rank + 1) = 3v
    assert all(r["sums"] == [3.0, 7.5] for r in res)


def test_single_rank():
    (res,) = run_distributed(_all_reduce_cases, 1, [4], timeout_s=120)
    assert res["sums"] == [4.0]


def test_hang_fails_fast():
    t0 = time.monotonic()
    with pytest.raises(DistributedTimeout, match="not finished after 10 s"):
        run_distributed(_hang_on_rank1, 2, timeout_s=10)
    assert time.monotonic() - t0 < 40


def test_exception_propagates_with_traceback():
    t0 = time.monotonic()
    with pytest.raises(DistributedError, match="rank 1 of 2 failed") as info:
        run_distributed(_raise_on_rank1, 2, "boom-42", timeout_s=120)
    msg = str(info.value)
    assert "ValueError: boom-42" in msg and "_raise_on_rank1" in msg
    assert not isinstance(info.value, DistributedTimeout)
    assert time.monotonic() - t0 < 60  # rank 0 blocked in barrier was killed, not waited for


def test_system_exit_in_a_rank():
    """A rank's SystemExit with a message: the parent's own SystemExit with it (system_exit=True),
    else a DistributedError with the rank's traceback like any other exception."""
    with pytest.raises(SystemExit) as info:
        run_distributed(_user_error_on_rank1, 2, "--flag 3: wrong", timeout_s=120, system_exit=True)
    assert info.value.code == "--flag 3: wrong"
    with pytest.raises(DistributedError, match="rank 1 of 2 failed") as err:
        run_distributed(_user_error_on_rank1, 2, "--flag 3: wrong", timeout_s=120)
    assert "SystemExit: --flag 3: wrong" in str(err.value)


def test_shared_data_path():
    assert SHARED_DATA.name == "data" and SHARED_DATA.parent.name == "shared"
