"""Hook-boundary resolution: which module's forward/backward hooks serve a dedicated parameter.

Two rules, the container heuristic (:data:`CONTAINER_NAMES`) and a user predicate, with examples:
Note: hook boundaries (docs/design.md). A tied parameter must resolve to the same boundary under
every alias (:func:`resolve_boundaries` raises ``ValueError`` otherwise).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping

from torch import nn

from dmuon.plan._model.snapshot import ParamRecord

__all__ = [
    "CONTAINER_NAMES",
    "ancestors",
    "heuristic_boundary",
    "BoundaryResolver",
    "Resolution",
]

#: container attribute names recognised by the default heuristic
CONTAINER_NAMES: frozenset[str] = frozenset({"layers", "layer", "blocks", "block", "h"})

_INT = re.compile(r"[0-9]+\Z")


def ancestors(module_fqn: str) -> tuple[str, ...]:
    """All ancestors of module path ``module_fqn``, outermost first, itself last.

    ``ancestors("a.b.c") == ("", "a", "a.b", "a.b.c")``; ``ancestors("") == ("",)``.
    """
    if not module_fqn:
        return ("",)
    parts = module_fqn.split(".")
    return ("",) + tuple(".".join(parts[: i + 1]) for i in range(len(parts)))


def heuristic_boundary(module_fqn: str) -> str | None:
    """Default boundary of a parameter living in module ``module_fqn``, or None.

    Pure string function (see Note: hook boundaries in docs/design.md for the rule and examples).
    """
    if not module_fqn:
        return None
    parts = module_fqn.split(".")
    fallback: str | None = None
    for i, part in enumerate(parts):
        if not _INT.match(part):
            continue
        if i >= 1 and parts[i - 1] in CONTAINER_NAMES:
            return ".".join(parts[: i + 1])  # outermost container match wins
        if fallback is None:
            fallback = ".".join(parts[: i + 1])
    return fallback


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Resolution:
    """Boundary of one parameter record.

    Attributes:
        boundary: resolved boundary FQN, or None when no alias has one.
        per_alias: boundary of each alias (aligned with ``record.aliases``; None = none).
        conflict: True when the aliases disagree (different boundaries, or some None and some
            not); ``boundary`` is then None.
    """

    boundary: str | None
    per_alias: tuple[str | None, ...]
    conflict: bool

    def conflict_message(self, record: ParamRecord) -> str:
        pairs = ", ".join(
            f"{alias} -> {b if b is not None else '<no boundary>'}" for alias, b in zip(record.aliases, self.per_alias)
        )
        return (
            f"tied parameter {record.fqn!r} resolves to different hook boundaries under its aliases "
            f"({pairs}); one owner's broadcast cannot serve both uses. Exclude it with "
            f"predicate=lambda fqn, p: fqn != {record.fqn!r} and <your rule> (it then stays with "
            f"FSDP2/AdamW), or pass a hook_boundary_predicate that selects a common ancestor."
        )


class BoundaryResolver:
    """Resolve hook boundaries over a snapshot's modules (memoised per module path).

    Args:
        modules: FQN -> module (``ModelSnapshot.modules``), read only by the predicate.
        hook_boundary_predicate: ``(module) -> bool`` or None for the FQN heuristic.
    """

    def __init__(
        self,
        modules: Mapping[str, nn.Module],
        hook_boundary_predicate: Callable[[nn.Module], bool] | None,
    ) -> None:
        self._modules = modules
        self._predicate = hook_boundary_predicate
        self._pred_cache: dict[str, bool] = {}
        self._boundary_cache: dict[str, str | None] = {}

    def _pred(self, fqn: str) -> bool:
        hit = self._pred_cache.get(fqn)
        if hit is None:
            hit = bool(self._predicate(self._modules[fqn]))  # type: ignore[misc]
            self._pred_cache[fqn] = hit
        return hit

    def of_module(self, module_fqn: str) -> str | None:
        """Boundary FQN for a parameter living directly in ``module_fqn``, or None."""
        if module_fqn in self._boundary_cache:
            return self._boundary_cache[module_fqn]
        if self._predicate is None:
            result = heuristic_boundary(module_fqn)
        else:
            result = None
            for anc in reversed(ancestors(module_fqn)):  # innermost first
                if self._pred(anc):
                    result = anc
                    break
        self._boundary_cache[module_fqn] = result
        return result

    def resolve(self, record: ParamRecord) -> Resolution:
        """Boundary of ``record`` over all its aliases."""
        per_alias = tuple(self.of_module(m) for m in record.module_fqns)
        distinct = set(per_alias)
        if len(distinct) == 1:
            return Resolution(boundary=per_alias[0], per_alias=per_alias, conflict=False)
        return Resolution(boundary=None, per_alias=per_alias, conflict=True)
