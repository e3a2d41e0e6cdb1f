"""Shared test set-up.

* ``tests/`` is put on ``sys.path`` so test modules can ``from dist_utils import
  run_distributed`` (and spawned ranks, which inherit ``sys.path``, can unpickle functions
  defined in test modules).
* :data:`SHARED_DATA` is ``../shared/data`` beside the checkout (real data for tests; may be
  absent: tests that need it skip). The ``shared_data`` fixture returns it.
* Tests that launch processes through ``run_distributed`` are marked ``distributed``
  (:func:`pytest_collection_modifyitems`): ``pytest -m "not distributed"`` is the fast lane.
"""

from __future__ import annotations

import inspect
import sys
from pathlib import Path

import pytest

TESTS_DIR = Path(__file__).resolve().parent
REPO_ROOT = TESTS_DIR.parent
if str(TESTS_DIR) not in sys.path:
    sys.path.insert(0, str(TESTS_DIR))

SHARED_DATA = Path(__file__).parents[1].parent / "shared" / "data"
"""``<checkout>/../shared/data``: tinyshakespeare.txt and other real data, when present."""


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """:data:`SHARED_DATA` (may not exist; check before use)."""
    return SHARED_DATA


# --------------------------------------------------------------------------- the distributed mark

_LAUNCHERS = frozenset({"run_distributed"})


def _launches_processes(fn, seen: set) -> bool:
    """Whether ``fn`` (a test or a fixture function) reaches :func:`dist_utils.run_distributed`
    through the names its code uses: module-level functions of the tests are followed, nested
    functions and lambdas included."""
    fn = inspect.unwrap(fn)
    code = getattr(fn, "__code__", None)
    if code is None or code in seen:
        return False
    seen.add(code)
    glb = getattr(fn, "__globals__", {})
    stack = [code]
    while stack:
        co = stack.pop()
        for name in co.co_names:
            if name in _LAUNCHERS:
                return True
            target = glb.get(name)
            if inspect.isfunction(target) and str(TESTS_DIR) in (getattr(target.__code__, "co_filename", "")):
                if _launches_processes(target, seen):
                    return True
        stack.extend(c for c in co.co_consts if inspect.iscode(c))
    return False


def pytest_collection_modifyitems(config, items):
    """Mark ``distributed`` every test that launches processes through ``run_distributed``
    (directly, through a helper of the tests, or through a fixture); tests that start process
    groups another way (a subprocess CLI), or that reach a launching fixture through
    ``request.getfixturevalue`` (no name to follow), carry the mark themselves. ``-m "not distributed"``
    is the fast lane (CONTRIBUTING.md, "Test lanes")."""
    for item in items:
        if item.get_closest_marker("distributed") is not None:
            continue
        fns = [getattr(item, "function", None)]
        info = getattr(item, "_fixtureinfo", None)
        for defs in info.name2fixturedefs.values() if info is not None else ():
            fns.extend(d.func for d in defs)
        seen: set = set()
        if any(f is not None and _launches_processes(f, seen) for f in fns):
            item.add_marker(pytest.mark.distributed)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """Before the test's fixtures: tell :func:`dist_utils.run_distributed` whether this test may
    launch processes (it refuses in an unmarked one)."""
    import dist_utils

    dist_utils.ALLOW_LAUNCH = item.get_closest_marker("distributed") is not None
