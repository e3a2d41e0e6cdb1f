"""dmuon.exec: the side-effecting half of dmuon (collectives, hooks, optimizer, checkpoints).

``apply(plan, model, mesh=None)`` binds a :class:`dmuon.plan.ShardingPlan` to a model;
``dedicate_params`` compiles and applies in one call. See ``dmuon.exec._runtime.boundary`` for the
per-boundary phases and ``dmuon.exec._comm.collective_calls`` for the byte ledger (:func:`ledger`, the
per-process one; :func:`metered`, the bytes of one block; ``LEDGER`` stays for existing code).
:func:`dedicated_info` says whether a parameter is dedicated (and its owner, shape ...).
"""

from dmuon.exec._comm import collective_calls as collectives
from dmuon.exec._setup.api import apply, dedicate_params
from dmuon._tags import dedicated_info
from dmuon.exec._comm.collective_calls import LEDGER, ledger, metered
from dmuon.exec._runtime.runtime import get_model_runtime, runtimes_of

__all__ = ["apply", "dedicate_params", "get_model_runtime", "runtimes_of", "dedicated_info", "ledger", "metered"]
__all__ += ["LEDGER", "collectives"]
