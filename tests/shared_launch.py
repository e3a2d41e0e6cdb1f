"""One :func:`dist_utils.run_distributed` launch shared by several tests.

Process start-up dominates on a 2-core machine, so the cases of one world size run in ONE
launch even when they are reported as separate tests (a parametrized test, one id per case)::

    def _configs(world):                     # every case of that world size, a fixed order
        ...

    def _results(world, label):
        runs = shared_run(("my_module", world), _multi_worker, world, _configs(world))
        return [r[_labels(world).index(label)] for r in runs]   # this case, every rank

The first test that asks for a key launches; the others read its results (or get its error
again, without launching). Selecting one case (``-k``) still runs its launch's other cases.
"""

from __future__ import annotations

from typing import Any, Callable, Hashable

from dist_utils import run_distributed

__all__ = ["shared_run"]

_RUNS: dict[Hashable, tuple[bool, Any]] = {}


def shared_run(key: Hashable, fn: Callable[..., Any], world_size: int, *args: Any, **kwargs: Any) -> list[Any]:
    """``run_distributed(fn, world_size, *args, **kwargs)`` once per ``key`` for the session;
    later calls with the same key return its results or raise its error again."""
    if key not in _RUNS:
        try:
            _RUNS[key] = (True, run_distributed(fn, world_size, *args, **kwargs))
        except Exception as exc:  # noqa: BLE001 - every test of the launch reports it
            _RUNS[key] = (False, exc)
    ok, value = _RUNS[key]
    if not ok:
        raise value
    return value
