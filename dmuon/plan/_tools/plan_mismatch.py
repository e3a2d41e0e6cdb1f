"""Why two ranks hold different plans, in two lines (:func:`mismatch_lines`): the first dedicated
parameter at which they differ (FQN, position, shape) and which usual cause fits.

Used by ``dmuon.exec.apply`` when the ranks' plan fingerprints differ: every rank compares rank
0's plan with the first differing rank's, so every rank prints the same lines. Pure.

The causes, told apart by the model digest (names, shapes, dtypes and ties of ALL parameters, in
``named_parameters()`` order) and the dedicated parameters (``plan.params``, in that order):

* **a different registration order**: the digests differ, and both ranks dedicate the same
  parameters (same names and shapes) in another order: a module registers its submodules in
  another order on one rank (the same FQNs, another ``named_parameters()`` order);
* **a different model per rank**: the digests differ otherwise (names, shapes, dtypes or ties);
* **different arguments**: the digests are equal (the same model), so the difference comes from
  ``dmuon.plan.compile``'s arguments (predicate, mesh, settings).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dmuon.plan._records.params import ParamSpec
    from dmuon.plan._records.plan import ShardingPlan

__all__ = ["first_param_difference", "mismatch_cause", "mismatch_lines"]

#: the usual causes (:func:`mismatch_cause`), each one line
CAUSES = {
    "order": (
        "a different registration order: the same dedicated parameters (names and shapes) come in another "
        "named_parameters() order on one rank; build the model with its submodules registered in one order on "
        "every rank"
    ),
    "model": (
        "a different model per rank: parameter names, shapes, dtypes or ties differ between the ranks' models; "
        "build the same model on every rank"
    ),
    "arguments": (
        "different arguments: the models are identical, so dmuon.plan.compile / dedicate_params got another "
        "predicate, mesh or setting on one rank; pass the same arguments on every rank"
    ),
}


def _key(spec: ParamSpec) -> tuple:
    return (spec.fqn, tuple(spec.shape), spec.dtype)


def first_param_difference(a: ShardingPlan, b: ShardingPlan) -> tuple[int, ParamSpec | None, ParamSpec | None] | None:
    """``(position, a's spec there, b's spec there)`` of the first position in ``plan.params``
    (the dedicated parameters in ``named_parameters()`` order) where the two plans hold another
    FQN, shape or dtype (``None`` past a plan's end); ``None`` when the lists are equal."""
    for i in range(max(len(a.params), len(b.params))):
        x = a.params[i] if i < len(a.params) else None
        y = b.params[i] if i < len(b.params) else None
        if x is None or y is None or _key(x) != _key(y):
            return i, x, y
    return None


def mismatch_cause(a: ShardingPlan, b: ShardingPlan) -> str:
    """``"order"``, ``"model"`` or ``"arguments"`` (module docstring; keys of :data:`CAUSES`)."""
    if a.model_digest == b.model_digest:
        return "arguments"
    keys_a = [_key(s) for s in a.params]
    keys_b = [_key(s) for s in b.params]
    if keys_a != keys_b and sorted(keys_a) == sorted(keys_b):
        return "order"
    return "model"


def _describe(spec: ParamSpec | None) -> str:
    return "nothing (the list ends)" if spec is None else f"{spec.fqn!r} {tuple(spec.shape)}"


def mismatch_lines(a: ShardingPlan, b: ShardingPlan, rank_a: int, rank_b: int) -> list[str]:
    """Two lines for the error: the first differing dedicated parameter (or that they agree) and the
    likely cause."""
    first = first_param_difference(a, b)
    if first is None:
        where = (
            f"First difference: none among the {len(a.params)} dedicated parameters (same FQNs, shapes and order); "
            "the plans differ in owners, layout or settings."
        )
    else:
        i, x, y = first
        where = (
            f"First differing dedicated parameter: position {i} (named_parameters() order of the dedicated ones) is "
            f"{_describe(x)} on rank {rank_a} but {_describe(y)} on rank {rank_b}."
        )
    return [where, f"Likely cause: {CAUSES[mismatch_cause(a, b)]}."]
