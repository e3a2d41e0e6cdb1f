"""Newton-Schulz orthogonalisation backends, by name, and the one module callers resolve them
from at call time.

Backends (:data:`NS_BACKENDS`; every one is a pure function with the same keywords):

- ``"standard"``: :func:`~dmuon._update.newton_schulz`, the quintic iteration; the
  default everywhere, and the only backend of the numerical contract (the README's "The oracle
  guarantee": same losses and parameters as one process running ``torch.optim.Muon``, up to
  reduction order).
- ``"gram"``: :func:`~dmuon._ns_gram.gram_newton_schulz` (Zhang, Amsel, Chen, Dao,
  "Gram Newton-Schulz", 2026): the same polynomial evaluated on the ``(d, d)`` Gram matrix,
  ``d = min(m, n)``, with restarts; equal to ``"standard"`` in exact arithmetic, cheaper when
  ``max(m, n) >> min(m, n)``, and the form tensor parallelism needs
  (:func:`~dmuon._ns_gram.gram_ns_from_gram`).
- ``"auto"``: :func:`auto_newton_schulz`: ``"gram"`` where it needs fewer FLOPs for the
  matrix's shape and the short side is at least 256, ``"standard"`` elsewhere (opt-in, like
  ``"gram"``). ``dmuon.Muon`` decides once per batched NS bucket (:func:`resolve_ns_backend`)
  and calls the picked backend itself, so ``"auto"`` runs exactly that backend's calls.

Coefficient presets (:data:`dmuon._update.NS_PRESETS`) are orthogonal to the backend.

Every function here is a pure function of its arguments: no module holds state (no call
counters; to count calls, wrap the module attribute a caller resolves, and observe Gram
fallbacks with ``gram_newton_schulz(on_fallback=...)``). The backend functions are attributes of
this module, where callers resolve them at call time: :func:`get_ns_backend` (``dmuon.Muon``)
and :func:`auto_newton_schulz` look ``newton_schulz`` / ``gram_newton_schulz`` up here, and
:mod:`dmuon.exec._optim.tp_orthogonalize` calls ``sharded_gram_newton_schulz`` through here; a
wrapper set on this module sees every optimizer call. Momentum, learning rates and parameter
updates live in :mod:`dmuon.exec._optim.muon_step`. docs/newton_schulz.md compares the backends
and presets.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from dmuon.plan._rules import choose_ns_backend

from dmuon._update import Coefficients, _check_input, newton_schulz

# the backend functions, resolved as attributes of this module at call time (see above)
from dmuon._ns_gram import gram_newton_schulz, sharded_gram_newton_schulz

__all__ = [
    "NS_BACKENDS",
    "auto_newton_schulz",
    "get_ns_backend",
    "resolve_ns_backend",
    # defined in dmuon._update / ns_gram; here as the attributes callers resolve at call time
    "gram_newton_schulz",
    "newton_schulz",
    "sharded_gram_newton_schulz",
]

#: Orthogonalisation backends, by name -> the name of the function in this module (looked up
#: at call time by :func:`get_ns_backend`). ``"standard"`` is the default everywhere.
NS_BACKENDS: dict[str, str] = {
    "standard": "newton_schulz",
    "gram": "gram_newton_schulz",
    "auto": "auto_newton_schulz",
}


def get_ns_backend(name: str) -> Callable[..., Tensor]:
    """The orthogonalisation function of backend ``name`` (a key of :data:`NS_BACKENDS`).

    Resolved at call time from this module, so monkeypatching ``newton_schulz`` /
    ``gram_newton_schulz`` is seen by callers such as :class:`dmuon.Muon`.

    Raises:
        ValueError: an unknown backend name.
    """
    try:
        return globals()[NS_BACKENDS[name]]
    except (KeyError, TypeError):
        raise ValueError(f"unknown Newton-Schulz backend {name!r}; expected one of {tuple(NS_BACKENDS)}") from None


def resolve_ns_backend(name: str, matrix_shape: tuple[int, int], *, steps: int) -> Callable[..., Tensor]:
    """The function one call on ``(m, n)`` matrices runs under backend ``name``: for ``"auto"``
    the backend :func:`dmuon.plan._rules.choose_ns_backend` picks for that shape and ``steps``
    (``newton_schulz`` or ``gram_newton_schulz``, resolved here from this module as
    :func:`get_ns_backend` does), so that ``dmuon.Muon`` decides once per bucket and ``"auto"``
    runs exactly the calls of the backend it picks — on shapes where it picks the standard
    iteration, the very calls ``"standard"`` runs; any other name: :func:`get_ns_backend`.

    Raises:
        ValueError: an unknown backend name.
    """
    if name == "auto":
        name = choose_ns_backend(tuple(int(v) for v in matrix_shape), "auto", steps=steps)
    return get_ns_backend(name)


def auto_newton_schulz(
    x: Tensor,
    *,
    coefficients: Coefficients = (3.4445, -4.775, 2.0315),
    steps: int = 5,
    eps: float = 1e-7,
    dtype: torch.dtype = torch.bfloat16,
) -> Tensor:
    """:func:`gram_newton_schulz` (default restarts, safe fallback) where it needs fewer matmul
    FLOPs than :func:`newton_schulz` for ``x``'s matrix shape and ``steps``, else
    :func:`newton_schulz` and the short side reaches ``GRAM_AUTO_MIN_SIDE`` — the rule
    :func:`dmuon.plan._rules.choose_ns_backend` (ties: standard).

    Every matrix of a batch has the same shape, so one call runs one backend. Same arguments,
    shapes and result as the backend it picks. With 5 steps: Gram NS for ``(d, D)`` with
    ``d >= GRAM_AUTO_MIN_SIDE`` (256) and ``D > 1.26·d``, e.g. an MLP's ``(4d, d)`` weights from
    ``d = 256``; the standard iteration on square and thinner matrices. Measured deviation and savings:
    docs/newton_schulz.md ("auto").
    """
    _check_input(x, dtype, "auto_newton_schulz")
    backend = choose_ns_backend(x.shape[-2:], "auto", steps=steps)
    fn = gram_newton_schulz if backend == "gram" else newton_schulz  # module globals: spies see them
    return fn(x, coefficients=coefficients, steps=steps, eps=eps, dtype=dtype)
