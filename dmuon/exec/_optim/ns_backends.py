"""Newton-Schulz orthogonalisation backends, by name, and the one module callers resolve them
from at call time.

``"standard"``, ``"gram"`` and ``"auto"`` (:data:`NS_BACKENDS`), all pure functions with the
same keywords, resolved from this module at call time. What each computes and why callers resolve
them here: Note: NS backends (docs/design.md).
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
