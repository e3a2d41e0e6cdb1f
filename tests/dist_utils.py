"""The multi-process test helper: :mod:`dmuon._launch` (the package's one launcher), re-exported
under the name the tests import (``from dist_utils import run_distributed``)."""

from __future__ import annotations

from dmuon._launch import DistributedError, DistributedTimeout, free_port, run_distributed

__all__ = ["run_distributed", "DistributedError", "DistributedTimeout", "free_port"]
