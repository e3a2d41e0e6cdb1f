"""dmuon: Muon on FSDP2 with exclusive ownership of every Muon-target matrix.

``import dmuon`` changes two things in torch: ``fully_shard`` (however it was imported) skips
parameters dedicated by :func:`dedicate_params`, and ``torch.nn.utils.clip_grad_norm_`` over
dedicated parameters hands off to :func:`clip_grad_norm_` (other calls unchanged). The first
:func:`dedicate_params` installs the rest (GradScaler, DCP load errors, the DDP and foreign-optimizer
guards, accelerate / transformers when imported). All of it is one list, :mod:`dmuon._registry`:
``dmuon.integrations.status()`` shows it, ``DMUON_NO_PATCHES=1`` or
``dmuon.integrations.disable()`` leaves every library untouched (explicit paths:
:func:`fsdp2_ignored_params`, :class:`GradScaler`, :func:`clip_grad_norm_`, :class:`DCPLoadPlanner`,
``dmuon.integrations.enable("accelerate")``; docs/integrations.md). Public names (the README's "API" section):

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
from . import _registry
from . import integrations
from .exec.api import dedicate_params
from .exec.amp import GradScaler
from .exec.clip import clip_grad_norm_
from .exec.dcp_errors import DCPLoadPlanner
from .exec.fsdp2 import ignored_params as fsdp2_ignored_params
from .exec.optim import Muon
from .exec.checkpoint import full_state_dict
from .exec.materialize import init_params
from .exec.runtime import no_sync
from .exec import qk_clip

_registry.install_stage("import")  # the fully_shard skip and the clip_grad_norm_ hand-off only

__all__ = ["plan", "exec", "integrations", "dedicate_params", "Muon", "no_sync", "clip_grad_norm_"]
__all__ += ["full_state_dict", "init_params", "qk_clip", "GradScaler", "DCPLoadPlanner", "fsdp2_ignored_params"]
