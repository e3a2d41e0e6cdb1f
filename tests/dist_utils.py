"""The multi-process test helper: :mod:`dmuon._launch` (the package's one launcher), re-exported
under the name the tests import (``from dist_utils import run_distributed``), and
:func:`run_fault_ranks` for the fault tests whose ranks must fail, hang or be killed."""

from __future__ import annotations

from dmuon._launch import DistributedError, DistributedTimeout, free_port
from dmuon._launch import run_distributed as _run_distributed

__all__ = ["run_distributed", "DistributedError", "DistributedTimeout", "free_port", "run_fault_ranks"]

#: set by ``tests/conftest.py`` before each test: whether it is marked ``distributed`` (None outside pytest)
ALLOW_LAUNCH: bool | None = None


def run_distributed(fn, world: int, *args, **kwargs):
    """:func:`dmuon._launch.run_distributed`, refused inside a test the fast lane runs (one not
    marked ``distributed``), so a launch the conftest's scan misses fails there instead of
    slowing the fast lane down unnoticed."""
    if ALLOW_LAUNCH is False:
        raise RuntimeError(
            "run_distributed in a test not marked 'distributed': the fast lane (-m 'not distributed') would start "
            "process groups. Mark the test @pytest.mark.distributed (the conftest marks it by itself when the "
            "launch is reached by name, not through request.getfixturevalue)."
        )
    return _run_distributed(fn, world, *args, **kwargs)


def run_fault_ranks(target, world: int, args: tuple, deadline_s: float) -> tuple[list, list[int]]:
    """Start ``target(rank, world, port, *args)`` on ``world`` spawned processes that set up their
    own process group (a short timeout, a fault of their own), wait until ``deadline_s`` has
    passed (start-up included) and kill whatever still runs. Returns ``(exit codes, ranks still
    alive at the deadline)``: unlike :func:`run_distributed`, a failing or hung rank is the result,
    not an error. The ranks report through files of their own."""
    import time

    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=target, args=(r, world, port, *args), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + deadline_s
    try:
        for p in procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
        alive = [r for r, p in enumerate(procs) if p.is_alive()]
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
    for p in procs:
        p.join(timeout=10)
    return [p.exitcode for p in procs], alive
