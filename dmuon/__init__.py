"""dmuon: Muon on FSDP2 with exclusive ownership of every Muon-target matrix.

``import dmuon`` makes ``fully_shard`` (however it was imported) skip parameters dedicated by
:func:`dedicate_params`, makes accelerate's FSDP2 ``prepare`` dmuon-aware when accelerate is
imported, and makes any optimizer other than :class:`Muon` that holds dedicated parameters raise
at its first step (:mod:`dmuon.integrations`). Public names (the README's "API" section):

* :mod:`dmuon.plan` — pure planning: ``dmuon.plan.compile(model, mesh, ...)`` → ``ShardingPlan``.
* :mod:`dmuon.exec` — execution: ``dmuon.exec.apply(plan, model, mesh=None)``.
* :func:`dedicate_params` — compile + apply; returns the plan.
* :class:`Muon` — Muon on dedicated matrices (owner only) + AdamW on everything else.
* :func:`no_sync` — gradient accumulation without communication.
* :func:`clip_grad_norm_` — global gradient-norm clipping with owner-held gradients counted once.
* :func:`full_state_dict` — gathered full tensors (rank 0 by default) for export; docs/checkpointing.md.
* :mod:`qk_clip` — QK-clip (MuonClip): ``dmuon.qk_clip.record(attn_module, max_logits)``; docs/muon_variants.md.
* :func:`init_params` — initialise a ``to_empty``-ed meta model as one process would; docs/checkpointing.md.
* :mod:`dmuon.testing` (``import dmuon.testing``, not imported here) — the single-process
  reference and ``check_against_reference``: check dmuon on your own model; docs/testing.md.
"""

from . import plan
from . import exec  # noqa: A004 - the public sub-package name is fixed by the API
from .exec import amp as _amp
from .exec import clip as _clip
from .exec import dcp_errors as _dcp_errors
from .exec import fsdp2 as _fsdp2
from . import integrations as _integrations
from .exec.api import dedicate_params
from .exec.clip import clip_grad_norm_
from .exec.optim import Muon
from .exec.checkpoint import full_state_dict
from .exec.materialize import init_params
from .exec.runtime import no_sync
from .exec import qk_clip

_fsdp2.install()
_amp.install()
_clip.install()
_dcp_errors.install()
_integrations.install()

__all__ = ["plan", "exec", "dedicate_params", "Muon", "no_sync", "clip_grad_norm_"]
__all__ += ["full_state_dict", "init_params", "qk_clip"]
