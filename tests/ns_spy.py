"""Counting spies on the Newton-Schulz backends, as :mod:`dmuon.exec._optim.ns_backends` resolves them.

The NS modules keep no state, so tests that need "how many matrices were orthogonalised" wrap its
public entry points with a counter for the duration of a test:

* :func:`spy_ns` (in-process tests): ``counter = spy_ns(monkeypatch)``; pytest undoes it.
* :func:`counting_ns` (inside a spawned worker, where fixtures do not reach):
  ``with counting_ns() as counter: ...`` (``unittest.mock.patch.object``).

The wrapped names are the module attributes :class:`dmuon.Muon` resolves at call time
(``get_ns_backend`` looks ``newton_schulz`` / ``gram_newton_schulz`` up in the module's
globals; the TP path calls ``_ns.sharded_gram_newton_schulz``), so every optimizer call goes
through the counter. A call made through a name imported *before* patching
(``from dmuon._update import newton_schulz``) is not seen: call ``ns_mod.<name>``.

:attr:`NSCounter.matrices` counts what a call orthogonalises: ``prod(x.shape[:-2])`` (a batch of
``B`` matrices counts ``B``, a 2-D matrix 1). Gram NS's safe fallback recomputes through the
private ``_newton_schulz``, not through a wrapped name, so a matrix is never counted twice.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Iterator
from unittest import mock

from dmuon.exec._optim import ns_backends as ns_mod

#: The public orthogonalisation functions that are counted.
BACKENDS = ("newton_schulz", "gram_newton_schulz", "sharded_gram_newton_schulz")


class NSCounter:
    """Matrices orthogonalised (:attr:`matrices`) and the backend of every call (:attr:`calls`)."""

    def __init__(self) -> None:
        self.matrices = 0
        self.calls: list[str] = []

    def wrap(self, name: str, fn):
        @functools.wraps(fn)
        def counting(x, *args, **kwargs):
            out = fn(x, *args, **kwargs)
            self.matrices += math.prod(x.shape[:-2])
            self.calls.append(name)
            return out

        return counting

    def reset(self) -> int:
        """Set the counts to zero; return the previous :attr:`matrices`."""
        previous, self.matrices = self.matrices, 0
        self.calls.clear()
        return previous


def spy_ns(monkeypatch) -> NSCounter:
    """Wrap :data:`BACKENDS` with one counter through pytest's ``monkeypatch``."""
    counter = NSCounter()
    for name in BACKENDS:
        monkeypatch.setattr(ns_mod, name, counter.wrap(name, getattr(ns_mod, name)))
    return counter


@contextlib.contextmanager
def counting_ns() -> Iterator[NSCounter]:
    """:func:`spy_ns` for code without fixtures (spawned workers): patched inside the block."""
    counter = NSCounter()
    with contextlib.ExitStack() as stack:
        for name in BACKENDS:
            stack.enter_context(mock.patch.object(ns_mod, name, counter.wrap(name, getattr(ns_mod, name))))
        yield counter
