"""torchtitan's gradient clipping made dmuon-aware (registry entry ``torchtitan.clip_grad_norm_``,
installed at the first dedication, or when ``torchtitan.distributed.utils`` is imported after it).

torchtitan's ``Trainer.train_step`` clips with ``torchtitan.distributed.utils.clip_grad_norm_``,
which calls ``torch.nn.utils.get_total_norm`` on every gradient directly (not
``torch.nn.utils.clip_grad_norm_``, which dmuon already routes). With dedicated parameters the
list mixes FSDP2 DTensor shards with owner-only plain gradients: the norm would fail on the mix or
count each rank's owned matrices locally. The wrapper sends such calls to
``dmuon.clip_grad_norm_`` (global norm, each owned gradient counted once) and leaves every other
call to torchtitan. Kept apart from :mod:`dmuon.integrations.torchtitan` because it may be applied
while torchtitan is still being imported.
"""

from __future__ import annotations

import functools

from dmuon import _tags


def wrap_clip_grad_norm(fn):
    """The wrapper of ``torchtitan.distributed.utils.clip_grad_norm_`` (registry factory)."""

    @functools.wraps(fn)
    def clip_grad_norm_(
        parameters, max_norm, norm_type=2.0, error_if_nonfinite=False, foreach=None, pp_mesh=None, ep_enabled=False
    ):
        import torch

        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        if not _tags.has_dedicated(params):
            return fn(params, max_norm, norm_type, error_if_nonfinite, foreach, pp_mesh, ep_enabled)
        if pp_mesh is not None:
            raise NotImplementedError(
                "dmuon: gradient clipping over dmuon-dedicated parameters with pipeline parallelism "
                "is not supported (dmuon.integrations.torchtitan refuses it at parallelize time)"
            )
        from dmuon.exec._optim.grad_clip import clip_grad_norm_ as dmuon_clip

        total = dmuon_clip(params, max_norm, norm_type)
        if error_if_nonfinite and not torch.isfinite(total):
            raise RuntimeError(f"dmuon: the total norm of order {norm_type} of the gradients is non-finite")
        return total

    return clip_grad_norm_
