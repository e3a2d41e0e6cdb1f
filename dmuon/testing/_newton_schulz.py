"""The Newton-Schulz iteration of :mod:`dmuon.testing`'s reference in a chosen dtype:
:func:`reference_newton_schulz` (``torch.optim.Muon``'s arithmetic, any dtype, per-step
coefficient tables), and :func:`patched_newton_schulz` / :func:`fp32_newton_schulz`, which put it
into torch's Muon. A leaf of the package: the Muon reference (:mod:`dmuon.testing._reference`) and
the NorMuon reference (:mod:`dmuon.testing._normuon_reference`) both use it."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

__all__ = ["reference_newton_schulz", "patched_newton_schulz", "fp32_newton_schulz"]


def reference_newton_schulz(
    grad: Tensor, ns_coefficients, ns_steps: int, eps: float, *, dtype: torch.dtype = torch.float32
) -> Tensor:
    """``torch.optim._muon._zeropower_via_newtonschulz`` with the iteration in ``dtype`` (torch's
    is bf16) and the same arithmetic otherwise. ``ns_coefficients``: one ``(a, b, c)`` triple,
    or a per-step table of ``ns_steps`` triples (dmuon's per-step presets)."""
    table = _as_table(ns_coefficients, ns_steps)
    if len(table) != ns_steps:
        raise ValueError(f"a per-step coefficient table needs ns_steps = {ns_steps} triples, got {len(table)}")
    x = grad.to(dtype)
    if grad.size(0) > grad.size(1):
        x = x.T
    x = x / x.norm().clamp(min=eps)
    for a, b, c in table:
        gram = x @ x.T
        upd = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, upd, x, beta=a)
    if grad.size(0) > grad.size(1):
        x = x.T
    return x


def _as_table(coefficients, steps: int) -> tuple[tuple[float, float, float], ...]:
    if len(coefficients) == 3 and not isinstance(coefficients[0], (tuple, list)):
        return (tuple(coefficients),) * steps
    return tuple(tuple(t) for t in coefficients)


@contextlib.contextmanager
def patched_newton_schulz(fn: Callable[[Tensor, Any, int, float], Tensor]):
    """``torch.optim.Muon``'s ``_zeropower_via_newtonschulz(grad, ns_coefficients, ns_steps, eps)``
    replaced by ``fn`` inside the block (nothing else of torch's Muon changes). Process-wide
    while it lasts: do not step another torch Muon from another thread meanwhile."""
    import torch.optim._muon as m

    orig = m._zeropower_via_newtonschulz
    m._zeropower_via_newtonschulz = fn
    try:
        yield
    finally:
        m._zeropower_via_newtonschulz = orig


def fp32_newton_schulz():
    """:func:`patched_newton_schulz` with :func:`reference_newton_schulz` in float32: the
    "reference patched to iterate in fp32" of the contract."""
    return patched_newton_schulz(reference_newton_schulz)
