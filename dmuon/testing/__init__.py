"""A reference users can run: check dmuon on your own model against plain torch.

The single-process reference (:class:`ReferenceOptimizer`, :func:`reference_run`: unmodified
``torch.optim.Muon`` + ``torch.optim.AdamW`` on the Muon-target matrices' proxies) and a one-call
checker::

    import dmuon.testing
    report = dmuon.testing.check_against_reference(build_model, loss_fn, batches, world_size=2)
    print(report); assert report.passed

Guide: docs/testing.md. How the reference and the checker work: Note: the reference and the
checker (docs/design.md).
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
