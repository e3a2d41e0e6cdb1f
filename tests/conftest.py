"""Shared test set-up.

* ``tests/`` is put on ``sys.path`` so test modules can ``from dist_utils import
  run_distributed`` (and spawned ranks, which inherit ``sys.path``, can unpickle functions
  defined in test modules).
* :data:`SHARED_DATA` is ``../shared/data`` beside the checkout (real data for tests; may be
  absent: tests that need it skip). The ``shared_data`` fixture returns it.
"""

from __future__ import annotations

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
