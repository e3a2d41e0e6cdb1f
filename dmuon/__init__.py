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

from dmuon import plan
from dmuon import exec  # noqa: A004 - the public sub-package name is fixed by the API
from dmuon import _registry
from dmuon import integrations
from dmuon.exec.setup.api import dedicate_params
from dmuon.exec.optim.amp import GradScaler
from dmuon.exec.optim.clip import clip_grad_norm_
from dmuon.exec.state.dcp_errors import DCPLoadPlanner
from dmuon.exec.setup.fsdp2 import ignored_params as fsdp2_ignored_params
from dmuon.exec.optim.muon import Muon
from dmuon.exec.state.model_state import full_state_dict
from dmuon.exec.setup.materialize import init_params
from dmuon.exec.runtime.runtime import no_sync
from dmuon.exec.optim import qk_clip

_registry.install_stage("import")  # the fully_shard skip and the clip_grad_norm_ hand-off only

__all__ = ["plan", "exec", "integrations", "dedicate_params", "Muon", "no_sync", "clip_grad_norm_"]
__all__ += ["full_state_dict", "init_params", "qk_clip", "GradScaler", "DCPLoadPlanner", "fsdp2_ignored_params"]
