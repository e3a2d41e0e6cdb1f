"""The option objects of :func:`dmuon.plan.compile` (and ``dmuon.dedicate_params``), as FSDP2
groups its options into ``MixedPrecisionPolicy`` / ``OffloadPolicy``: :class:`TPPolicy`
(``tp=``) and :class:`ExpertPolicy` (``expert_policy=``). Both are frozen and checked when
built; the plan records what they decide in its own fields (``tp_size``, ``tp_ns_steps``,
``tp_gram_restart_every``, each ``ParamSpec``'s ``tp_ns`` / ``experts``), so a plan's JSON does
not depend on how the options were passed.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any, TypeVar

from dmuon.plan import _rules
from dmuon.plan._model.expert_ranges import GATE_UP_MODES, ROUTER_MODES

__all__ = ["TPPolicy", "ExpertPolicy", "REMOVED_KEYWORDS", "refuse_removed_keywords"]


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclasses.dataclass(frozen=True, kw_only=True)
class TPPolicy:
    """Tensor parallelism of the dedicated matrices (``compile(..., tp=TPPolicy(...))``).

    Args:
        size, shard_dims: plan tensor parallelism for a model that is not parallelised (e.g. on
            the meta device): the TP degree ``T`` and ``{fqn: dim}`` of the dedicated matrices TP
            shards (``0`` colwise, ``1`` rowwise; e.g.
            :func:`dmuon.plan.megatron_tp_shard_dims`). Both None (default): TP is read from the
            model's ``DTensor`` parameters (``parallelize_module`` on a 1-D TP mesh). ``size=1``
            plans no TP; ``size > 1`` needs ``shard_dims``.
        ns: how a TP-sharded matrix is orthogonalised: ``"auto"`` (default: per matrix, the
            cheaper in bytes of Gram NS and gathering, :func:`~dmuon.plan._rules.choose_tp_ns`),
            ``"gram"`` or ``"gather"``. A matrix view inside the TP shards is orthogonalised
            locally whatever this says (``ParamSpec.tp_ns == "local"``).
        ns_steps, gram_restart_every: Newton-Schulz steps (default 5) and Gram restart period
            (default 2; None = no restart) the TP cost and the owner groups' Gram segments
            assume; ``dmuon.Muon``'s ``ns_steps`` must agree (restarts as
            ``gram_newton_schulz(restart_every=...)``). Recorded as the plan's ``tp_ns_steps`` /
            ``tp_gram_restart_every``.

    Raises:
        ValueError: ``ns`` not in :data:`~dmuon.plan._rules.TP_NS_MODES`; ``ns_steps`` not an int
            >= 0; ``gram_restart_every`` neither None nor an int >= 1; ``shard_dims`` without an int
            ``size >= 1``; ``size > 1`` without ``shard_dims``; a ``shard_dims`` dim other than 0 / 1.
    """

    size: int | None = None
    shard_dims: Mapping[str, int] | None = dataclasses.field(default=None, hash=False)
    ns: str = "auto"
    ns_steps: int = 5
    gram_restart_every: int | None = 2

    def __post_init__(self) -> None:
        where = "dmuon.plan.TPPolicy"
        if self.ns not in _rules.TP_NS_MODES:
            raise ValueError(f"{where}(ns={self.ns!r}): tp_ns must be one of {_rules.TP_NS_MODES}")
        if not _is_int(self.ns_steps) or self.ns_steps < 0:
            raise ValueError(f"{where}(ns_steps={self.ns_steps!r}): tp_ns_steps must be an int >= 0")
        every = self.gram_restart_every
        if every is not None and (not _is_int(every) or every < 1):
            raise ValueError(
                f"{where}(gram_restart_every={every!r}): tp_gram_restart_every must be None or an int >= 1"
            )
        if self.shard_dims is None and self.size is None:
            return
        if not _is_int(self.size) or self.size < 1:
            raise ValueError(
                f"{where}(size={self.size!r}): tp_size must be an int >= 1 when shard_dims is given "
                "(TPPolicy(size=T, shard_dims={fqn: 0 | 1}))"
            )
        if self.size > 1 and not self.shard_dims:
            raise ValueError(
                f"{where}(size={self.size}): tp_size={self.size} without tp_shard_dims plans no TP-sharded "
                "matrix; pass shard_dims={fqn: 0 (colwise) | 1 (rowwise)} for the dedicated matrices TP shards "
                "(e.g. dmuon.plan.megatron_tp_shard_dims(model)), or parallelize the model first"
            )
        dims = dict(self.shard_dims or {})
        for fqn, dim in dims.items():
            if not isinstance(fqn, str):
                raise ValueError(f"{where}: shard_dims keys are parameter FQNs (str), got {fqn!r}")
            if dim not in (0, 1) or isinstance(dim, bool):
                raise ValueError(f"{where}: tp_shard_dims[{fqn!r}] must be 0 or 1, got {dim!r}")
        object.__setattr__(self, "shard_dims", MappingProxyType(dims))

    def __reduce__(self):  # picklable although its read-only mapping is not
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        if fields["shard_dims"] is not None:
            fields["shard_dims"] = dict(fields["shard_dims"])
        return (_rebuild, (TPPolicy, fields))


def _rebuild(cls, fields: dict):
    return cls(**fields)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ExpertPolicy:
    """How MoE expert stacks and routers are dedicated (``compile(..., expert_policy=...)``).

    Args:
        gate_up: ``"split"`` (default): a fused gate/up expert is two Muon matrices, gate and
            up, as ``torch.optim.Muon`` treats the unfused model; ``"fused"``: one ``(2F, D)``
            matrix per expert.
        routers: the optimizer of MoE routers under the default rule: ``"muon"`` (default:
            dedicated like every 2-D matrix in a block) or ``"adamw"`` (left to FSDP2 and AdamW).
            A router is the ``(E, D)`` ``weight`` of a module named ``gate`` / ``router`` next to
            a recognised expert stack of ``E`` experts
            (:func:`~dmuon.plan._model.expert_ranges.is_router`). With a ``predicate``, the
            predicate alone decides.

    Raises:
        ValueError: ``gate_up`` not in ``("split", "fused")``; ``routers`` not in
            ``("muon", "adamw")``.
    """

    gate_up: str = "split"
    routers: str = "muon"

    def __post_init__(self) -> None:
        if self.gate_up not in GATE_UP_MODES:
            raise ValueError(
                f"dmuon.plan.ExpertPolicy(gate_up={self.gate_up!r}): expert_gate_up must be one of {GATE_UP_MODES}"
            )
        if self.routers not in ROUTER_MODES:
            raise ValueError(f"dmuon.plan.ExpertPolicy: routers must be one of {ROUTER_MODES}, got {self.routers!r}")


#: The keywords ``compile`` took before its options were grouped, and their new form.
REMOVED_KEYWORDS: Mapping[str, str] = MappingProxyType(
    {
        "tp_size": "tp=dmuon.plan.TPPolicy(size=...)",
        "tp_shard_dims": "tp=dmuon.plan.TPPolicy(shard_dims=...)",
        "tp_ns": "tp=dmuon.plan.TPPolicy(ns=...)",
        "tp_ns_steps": "tp=dmuon.plan.TPPolicy(ns_steps=...)",
        "tp_gram_restart_every": "tp=dmuon.plan.TPPolicy(gram_restart_every=...)",
        "expert_gate_up": "expert_policy=dmuon.plan.ExpertPolicy(gate_up=...)",
        "routers": "expert_policy=dmuon.plan.ExpertPolicy(routers=...)",
    }
)

_F = TypeVar("_F", bound=Callable[..., Any])


def refuse_removed_keywords(name: str) -> Callable[[_F], _F]:
    """Decorate a function (public name ``name``) to raise ``TypeError`` naming the new form for a
    keyword of :data:`REMOVED_KEYWORDS` (e.g. ``tp_size= is now tp=dmuon.plan.TPPolicy(size=...)``),
    before it runs."""

    def decorate(fn: _F) -> _F:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            old = [k for k in kwargs if k in REMOVED_KEYWORDS]
            if old:
                raise TypeError(f"{name}: " + "; ".join(f"{k}= is now {REMOVED_KEYWORDS[k]}" for k in old))
            return fn(*args, **kwargs)

        return wrapper  # type: ignore[return-value]

    return decorate
