"""dmuon.exec: the side-effecting half of dmuon (collectives, hooks, optimizer, checkpoints).

``apply(plan, model, mesh=None)`` binds a :class:`dmuon.plan.ShardingPlan` to a model
(``dmuon.dedicate_params`` compiles and applies in one call). :func:`ledger` is the per-process
byte ledger every dmuon collective charges (a :class:`Ledger`), :func:`metered` the bytes of one
block; :func:`dedicated_info` says whether a parameter is dedicated (and its owner, shape, ...);
:func:`get_model_runtime` / :func:`runtimes_of` reach the runtime bound to a model.
"""

from dmuon._tags import dedicated_info
from dmuon.exec._comm.collective_calls import Ledger, ledger, metered
from dmuon.exec._runtime.runtime import get_model_runtime, runtimes_of
from dmuon.exec._setup.api import apply

__all__ = ["apply", "ledger", "metered", "Ledger", "dedicated_info", "get_model_runtime", "runtimes_of"]
