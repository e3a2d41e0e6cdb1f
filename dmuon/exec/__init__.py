"""dmuon.exec: the side-effecting half of dmuon (collectives, hooks, optimizer, checkpoints).

``apply(plan, model, mesh=None)`` binds a :class:`dmuon.plan.ShardingPlan` to a model;
``dedicate_params`` compiles and applies in one call. See ``dmuon.exec.boundary`` for the
per-boundary phases and ``dmuon.exec.collectives`` for the byte ledger.
"""

from . import collectives
from .api import apply, dedicate_params
from .collectives import LEDGER
from .runtime import get_model_runtime

__all__ = ["apply", "dedicate_params", "get_model_runtime", "LEDGER", "collectives"]
