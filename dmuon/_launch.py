"""Run a function on W local processes that share one gloo process group, with a hard timeout.

Used by the tests, :func:`dmuon.testing.check_against_reference`, ``python -m dmuon train``, the
calibration and the benchmarks; run several cases in ONE call (start-up dominates). Usage and
guarantees: Note: the local launcher (docs/design.md).
"""

from __future__ import annotations

import datetime
import os
import pickle
import socket
import sys
import tempfile
import time
import traceback
from typing import Any, Callable

import torch.multiprocessing as mp

__all__ = ["run_distributed", "DistributedError", "DistributedTimeout", "free_port"]

_POLL_S = 0.05


class DistributedError(RuntimeError):
    """A rank raised or died; the message holds its traceback (or exit code)."""


class DistributedTimeout(DistributedError, TimeoutError):
    """The run exceeded its timeout; every rank was killed."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    port: int,
    backend: str,
    threads: int,
    group_timeout_s: float,
    out_dir: str,
    args: tuple,
    kwargs: dict,
) -> None:
    """One rank: write ``(True, result, t, None)`` or ``(False, traceback, t, exit_message)`` to
    ``out_dir/{rank}.pkl``, t = ``time.time()`` when it finished or failed, exit_message the
    message of a ``SystemExit`` with a non-zero code (else None)."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    path = os.path.join(out_dir, f"{rank}.pkl")
    try:
        import torch
        import torch.distributed as dist

        if threads > 0:
            torch.set_num_threads(threads)
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(
            backend,
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=group_timeout_s),
        )
        result = fn(*args, **kwargs)
        payload = pickle.dumps((True, result, time.time(), None))
        # every rank done before any tears the group down: gloo can abort a rank still waiting in
        # it when a peer destroys the group ("terminate called without an active exception")
        dist.barrier()
        dist.destroy_process_group()
    except BaseException as exc:  # noqa: BLE001 - everything goes back to the parent
        # Report before any clean-up: tearing the group down would make peers fail too, and
        # the parent must see this rank as the first to fail.
        message = str(exc.code) if isinstance(exc, SystemExit) and exc.code not in (None, 0) else None
        _write_atomic(path, pickle.dumps((False, traceback.format_exc(), time.time(), message)))
        sys.stderr.flush()
        os._exit(1)  # skip clean-up and atexit handlers that could block on a dead peer
    _write_atomic(path, payload)
    # The result is on disk: skip interpreter teardown, where a C++ thread left by the backend
    # can abort the process ("terminate called without an active exception") after the work
    # succeeded, and the parent would see a failed rank.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _write_atomic(path: str, payload: bytes) -> None:
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(payload)
    os.replace(tmp, path)


def _kill_all(procs: list) -> None:
    for p in procs:
        if p.is_alive():
            p.kill()
    for p in procs:
        p.join(timeout=10)


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout_s: float | None = 300.0,
    backend: str = "gloo",
    threads: int = 1,
    group_timeout_s: float = 1800.0,
    system_exit: bool = False,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` fresh processes in one process group.

    Args:
        fn: a picklable (module-level) function; its return value must be picklable.
        world_size: number of ranks, >= 1.
        timeout_s: wall-clock limit for the whole run in seconds, process start-up included;
            None: no limit.
        backend: ``torch.distributed`` backend ("gloo" on CPU; "nccl": rank i on ``cuda:i``).
        threads: ``torch.set_num_threads`` in each rank (0 = leave torch's default).
        group_timeout_s: the process group's own timeout (``init_process_group(timeout=)``).
        system_exit: a rank that ended in ``SystemExit`` with a non-zero code makes this raise
            ``SystemExit`` with its message (the lowest such rank's) rather than
            :class:`DistributedError`: a user error found inside the ranks reads as the
            caller's own one-line error.

    Returns: ``[result of rank 0, result of rank 1, ...]``.

    Raises:
        DistributedError: a rank raised (its traceback is in the message) or exited non-zero.
        DistributedTimeout: not finished within ``timeout_s``; every rank was killed first.
        SystemExit: with ``system_exit``, as above.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    ctx = mp.get_context("spawn")
    name = getattr(fn, "__qualname__", repr(fn))
    with tempfile.TemporaryDirectory(prefix="dmuon-dist-") as out_dir:
        port = free_port()
        procs = [
            ctx.Process(
                target=_entry,
                args=(fn, rank, world_size, port, backend, threads, group_timeout_s, out_dir, args, kwargs),
                name=f"{name}-rank{rank}",
                daemon=True,  # never outlive the test process
            )
            for rank in range(world_size)
        ]
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        try:
            for p in procs:
                p.start()
            while True:
                failed = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
                if failed:
                    time.sleep(0.5)  # let peers that fail because of it report too
                    _kill_all(procs)
                    raise _failure(name, world_size, procs, out_dir, system_exit)
                if all(p.exitcode == 0 for p in procs):
                    break
                if deadline is not None and time.monotonic() > deadline:
                    alive = [r for r, p in enumerate(procs) if p.is_alive()]
                    _kill_all(procs)
                    raise DistributedTimeout(
                        f"{name}: not finished after {timeout_s:.0f} s on {world_size} ranks; "
                        f"killed ranks {alive} that were still running"
                    )
                time.sleep(_POLL_S)
            results = []
            for rank in range(world_size):
                with open(os.path.join(out_dir, f"{rank}.pkl"), "rb") as f:
                    ok, value, _, _ = pickle.load(f)
                if not ok:  # exited 0 after an error: cannot happen, but never lose it
                    raise DistributedError(f"{name}: rank {rank} failed:\n{value}")
                results.append(value)
            return results
        finally:
            _kill_all(procs)


def _read_report(out_dir: str, rank: int) -> tuple[bool, Any, float, str | None] | None:
    try:
        with open(os.path.join(out_dir, f"{rank}.pkl"), "rb") as f:
            return pickle.load(f)
    except (OSError, EOFError, pickle.UnpicklingError):
        return None


def _failure(name: str, world_size: int, procs: list, out_dir: str, system_exit: bool = False) -> BaseException:
    """The error for a failed run: the traceback of the rank that failed FIRST (by the time
    it reported; a peer usually fails a moment later on the broken connection), then a line
    for every other failed rank. With ``system_exit``: ``SystemExit(message)`` of the lowest
    rank that ended in a ``SystemExit`` with a message, if any did."""
    failed = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
    reports = {r: _read_report(out_dir, r) for r in failed}
    if system_exit:
        for r in failed:
            if reports[r] is not None and reports[r][3] is not None:
                return SystemExit(reports[r][3])
    # ranks that reported an error, earliest first; then ranks that died silently
    order = sorted(failed, key=lambda r: (reports[r] is None, reports[r][2] if reports[r] else 0))
    first = order[0]
    rep = reports[first]
    detail = (
        rep[1]
        if rep is not None and not rep[0]
        else "(no traceback: the process died without reporting, e.g. killed or crashed)"
    )
    others = ""
    for r in order[1:]:
        if reports[r] is None:
            last = "no report"
        elif reports[r][0]:
            last = "it had reported its result, then died"
        else:
            last = (reports[r][1].strip().splitlines() or [""])[-1]
        others += f"\n  also failed: rank {r} (exit code {procs[r].exitcode}): {last}"
    return DistributedError(
        f"{name}: rank {first} of {world_size} failed (exit code {procs[first].exitcode}):\n{detail}{others}"
    )
