"""A reference users can run: check dmuon on your own model against plain torch.

The numerical contract (README, "The oracle guarantee") says that ``dmuon.Muon`` on any mesh
matches ONE process running ``torch.optim.Muon`` on the Muon-target matrices and
``torch.optim.AdamW`` on the other parameters over the global batch. This module is that single
process, usable on any model, plus a one-call checker::

    import dmuon.testing
    report = dmuon.testing.check_against_reference(build_model, loss_fn, batches, world_size=2)
    print(report); assert report.passed

Two parts:

* **The single-process reference** (:class:`ReferenceOptimizer`, :func:`reference_run`):
  unmodified ``torch.optim.Muon`` + ``torch.optim.AdamW``. ``torch.optim.Muon`` only takes 2-D
  parameters, so every Muon-target parameter is described by its *proxies*
  (:class:`Proxy`): 2-D matrices in ``nn.Linear`` ``(out, in)`` orientation, each a slice
  (possibly strided, possibly transposed) of the real parameter -- the matrices dmuon
  orthogonalises one by one (a conv weight's ``(out, in*prod(k))`` view, each expert of a
  stack, each block of a per-head matrix view). Each step copies the real parameter's slices
  into the proxies (separate leaf ``nn.Parameter`` s), copies each proxy's gradient out of the
  real parameter's ``.grad``, runs ``torch.optim.Muon.step()`` on the proxies and writes them
  back into the real parameter (exactly: ``copy_`` into the slice). Constructors:
  :func:`matrix`, :func:`conv`, :func:`matrix_view`, :func:`expert_stack` (layouts
  :data:`EXPERT_LAYOUTS`), and :func:`proxies_from_plan` for the dedicated parameters of a
  :class:`dmuon.plan.ShardingPlan`. Only the dtype of the Newton-Schulz iteration is changed,
  when asked (``ns_dtype=torch.float32``; :func:`reference_newton_schulz`).
* **The one-call checker** (:func:`check_against_reference`): runs dmuon on ``world_size``
  local CPU processes (gloo, spawned, with a hard timeout) and the reference on the global
  batches, and returns a :class:`Report` of the loss and parameter deviations against the
  documented bounds (:func:`bounds`).

NorMuon (``dmuon.Muon(variant="normuon")``): ``ReferenceOptimizer(..., variant="normuon")`` runs
:func:`dmuon.testing._normuon_reference.normuon_step` (a single-process NorMuon written from the paper and
the authors' code, with its own hand-computed tests) on every proxy instead of torch's Muon step.

Modules: :mod:`~dmuon.testing._proxies` (:class:`Proxy` and its constructors),
:mod:`~dmuon.testing._reference` (the reference and its Newton-Schulz), :mod:`~dmuon.testing._normuon_reference`
(the NorMuon reference), :mod:`~dmuon.testing._check` (the checker, :class:`Report`, :func:`bounds`);
every public name but the NorMuon functions is importable from here.
"""

from dmuon.testing._check import (
    BF16_LOSS_RTOL,
    BF16_PARAM_TOL,
    FP32_LOSS_RTOL,
    FP32_PARAM_TOL,
    Report,
    bounds,
    check_against_reference,
)
from dmuon.testing._proxies import (
    EXPERT_LAYOUTS,
    Proxy,
    conv,
    expert_stack,
    matrix,
    matrix_view,
    proxies_for,
    proxies_from_plan,
)
from dmuon.testing._reference import (
    ReferenceOptimizer,
    fp32_newton_schulz,
    patched_newton_schulz,
    reference_newton_schulz,
    reference_run,
)

__all__ = [
    "Proxy",
    "EXPERT_LAYOUTS",
    "matrix",
    "conv",
    "matrix_view",
    "expert_stack",
    "proxies_for",
    "proxies_from_plan",
    "reference_newton_schulz",
    "patched_newton_schulz",
    "fp32_newton_schulz",
    "ReferenceOptimizer",
    "reference_run",
    "bounds",
    "FP32_LOSS_RTOL",
    "FP32_PARAM_TOL",
    "BF16_LOSS_RTOL",
    "BF16_PARAM_TOL",
    "Report",
    "check_against_reference",
]
