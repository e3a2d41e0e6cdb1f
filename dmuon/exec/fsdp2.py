"""FSDP2 integration: after ``import dmuon``, ``fully_shard`` leaves dedicated parameters alone.

FSDP2 already supports parameters it must not manage: ``fully_shard(..., ignored_params=S)``.
dmuon adds every dedicated parameter reachable from the modules being sharded to ``S``, at the
narrowest point that serves every way of calling ``fully_shard`` (however it was imported):
``torch.distributed.fsdp._fully_shard._fsdp_init._get_managed_modules`` and
``_get_managed_states``, the two functions through which ``fully_shard`` reads
``ignored_params``. Both are wrapped, not replaced; the wrappers only widen ``ignored_params``.

:func:`install` checks the signatures of both functions and raises ``RuntimeError`` on a torch
whose internals differ, rather than letting FSDP2 shard owner-held parameters silently.

Also here: the set-up order check of :class:`dmuon.Muon`'s first step (:data:`SET_UP_ORDER`,
:func:`_check_set_up_order`), which reads the ``fully_shard`` units' managed parameters.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import warnings
from typing import TYPE_CHECKING

import torch.nn as nn
from torch import Tensor

from dmuon.plan.render import fmt_names

if TYPE_CHECKING:
    from .optim import Muon

__all__ = [
    "install",
    "is_installed",
    "dedicated_params_in",
    "check_not_fully_sharded",
    "fsdp_state",
    "requires_gradient_sync",
    "check_mp_policy",
    "sharded_params_for_optimizer",
]

_PATCHED_ATTR = "__dmuon_wrapped__"
_TARGETS = ("_get_managed_modules", "_get_managed_states")


def dedicated_params_in(modules) -> set[nn.Parameter]:
    """Every parameter tagged by :func:`dmuon.exec.apply` under ``modules`` (recursively)."""
    out: set[nn.Parameter] = set()
    for module in modules:
        for p in module.parameters():
            if getattr(p, "_dmuon", None) is not None:
                out.add(p)
    return out


#: Callbacks to run once, at the next ``fully_shard`` call (:func:`before_next_fully_shard`).
_BEFORE_NEXT_FULLY_SHARD: list = []


@contextlib.contextmanager
def before_next_fully_shard(callback):
    """Within the context, run ``callback()`` once, at the start of the next ``fully_shard`` call,
    before FSDP2 reads the modules it is given (and however ``fully_shard`` was imported).

    The hook point for frameworks whose set-up function applies tensor parallelism, activation
    checkpointing and ``torch.compile`` and then ``fully_shard`` in one call (torchtitan's
    ``parallelize_*``, :mod:`dmuon.integrations.torchtitan`): dedication has to run between the
    two. Runs inside the wrapper of ``_get_managed_modules``, which ``fully_shard`` calls after
    validating its arguments and before it creates any state. Yields a list that holds
    ``callback``'s return value once it ran (empty if no ``fully_shard`` was called). On exit a
    callback that did not run is dropped.
    """
    ran: list = []

    def once():
        ran.append(callback())

    _BEFORE_NEXT_FULLY_SHARD.append(once)
    try:
        yield ran
    finally:
        if once in _BEFORE_NEXT_FULLY_SHARD:
            _BEFORE_NEXT_FULLY_SHARD.remove(once)


def _wrap(fn):
    @functools.wraps(fn)
    def wrapper(modules, ignored_params=None, *args, **kwargs):
        if _BEFORE_NEXT_FULLY_SHARD and fn.__name__ == "_get_managed_modules":
            pending = list(_BEFORE_NEXT_FULLY_SHARD)
            _BEFORE_NEXT_FULLY_SHARD.clear()
            for callback in pending:
                callback()
        roots = modules if isinstance(modules, (list, tuple)) else (modules,)
        dedicated = dedicated_params_in(roots)
        if dedicated:
            ignored_params = set(ignored_params or ()) | dedicated
        return fn(modules, ignored_params, *args, **kwargs)

    setattr(wrapper, _PATCHED_ATTR, fn)
    return wrapper


def _fsdp_init_module():
    try:
        from torch.distributed.fsdp._fully_shard import _fsdp_init
    except ImportError as exc:  # pragma: no cover - depends on the torch build
        raise RuntimeError(
            "dmuon: this torch has no torch.distributed.fsdp._fully_shard._fsdp_init; dmuon's "
            "fully_shard integration supports torch >= 2.7 (tested on 2.13)"
        ) from exc
    return _fsdp_init


def install() -> None:
    """Wrap FSDP2's managed-state discovery so dedicated parameters are ignored (idempotent).

    Raises:
        RuntimeError: the installed torch's FSDP2 internals differ from what dmuon was tested
            against (missing function, or its first two parameters are not
            ``(modules, ignored_params)``).
    """
    mod = _fsdp_init_module()
    for name in _TARGETS:
        fn = getattr(mod, name, None)
        if fn is None:
            raise RuntimeError(
                f"dmuon: FSDP2 internals changed: {mod.__name__}.{name} is missing; dmuon cannot "
                "make fully_shard skip dedicated parameters on this torch version"
            )
        if hasattr(fn, _PATCHED_ATTR):
            continue
        params = list(inspect.signature(fn).parameters)
        if len(params) < 2 or params[1] != "ignored_params":
            raise RuntimeError(
                f"dmuon: FSDP2 internals changed: {mod.__name__}.{name}{inspect.signature(fn)} no "
                "longer takes (modules, ignored_params, ...); dmuon cannot make fully_shard skip "
                "dedicated parameters on this torch version"
            )
        setattr(mod, name, _wrap(fn))


def is_installed() -> bool:
    mod = _fsdp_init_module()
    return all(hasattr(getattr(mod, n, None), _PATCHED_ATTR) for n in _TARGETS)


def check_not_fully_sharded(model: nn.Module) -> None:
    """Raise ``ValueError`` if ``fully_shard`` was already applied anywhere in ``model``.

    dmuon must decide ownership of full matrices before FSDP2 shards them: the order is
    ``dedicate_params`` → ``fully_shard(layer)`` for each layer → ``fully_shard(model)``.
    ``DTensor`` parameters alone are fine: tensor parallelism (``parallelize_module``) comes
    first (the plan rejects placements it cannot own).
    """
    from torch.distributed.fsdp import FSDPModule

    from dmuon.integrations import framework_hint

    wrapped = [name or "<root>" for name, m in model.named_modules() if isinstance(m, FSDPModule)]
    if wrapped:
        what = f"modules {wrapped[:5]}"
        raise ValueError(
            f"dmuon: the model is already sharded ({what}{' ...' if len(wrapped) > 5 else ''}). "
            "Call dmuon.dedicate_params(model, mesh) BEFORE fully_shard: dedicate_params -> "
            "fully_shard(layer) for each layer -> fully_shard(model) -> dmuon.Muon(model). "
            + framework_hint("fully_shard_first", model)
        )


# ----------------------------------------------------------------------------------------------
# Units left unsharded when the optimizer is built
# ----------------------------------------------------------------------------------------------


def _unsharded_units(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` of every ``fully_shard`` unit of ``model`` whose parameters are now
    unsharded (FSDP2 registers the unsharded plain tensors in place of the sharded DTensors)."""
    out = []
    for name, m in model.named_modules():
        groups = getattr(fsdp_state(m), "_fsdp_param_groups", None) or ()
        if any(not getattr(g, "is_sharded", True) for g in groups):
            out.append((name or "<root>", m))
    return out


def sharded_params_for_optimizer(model_or_params):
    """``dmuon.Muon``'s argument, made safe to collect parameters from: a forward without its
    backward (an evaluation under ``torch.no_grad()``, or a loss never backpropagated) leaves
    FSDP2's root unit unsharded, and ``model.parameters()`` then yields its unsharded plain tensors,
    which no step updates. A module: every such unit is resharded (``FSDPModule.reshard()``, local,
    no collective), so its sharded ``DTensor`` parameters are collected. An iterable of
    parameters: returned as a list; raises ``RuntimeError`` if it holds unsharded parameters of
    such a unit (every rank alike: the units' state is the same everywhere). Anything else is
    returned unchanged (``dmuon.Muon`` reports it).
    """
    import torch

    if isinstance(model_or_params, nn.Module):
        for _, unit in _unsharded_units(model_or_params):
            unit.reshard()
        return model_or_params
    if isinstance(model_or_params, torch.Tensor) or not hasattr(model_or_params, "__iter__"):
        return model_or_params
    params = list(model_or_params)
    from .runtime import get_runtime

    runtime = next((get_runtime(p) for p in params if isinstance(p, torch.Tensor) and get_runtime(p)), None)
    model = runtime.model_ref() if runtime is not None else None
    if model is None:
        return params
    given = {id(p) for p in params if isinstance(p, torch.Tensor)}
    bad = []
    for name, unit in _unsharded_units(model):
        for g in fsdp_state(unit)._fsdp_param_groups:
            if any(id(getattr(fp, "_unsharded_param", None)) in given for fp in g.fsdp_params):
                bad.append(name)
                break
    if bad:
        raise RuntimeError(
            f"dmuon.Muon: its parameters include unsharded tensors of the fully_shard unit(s) {bad[:5]}: a forward "
            "without its backward (e.g. an evaluation under torch.no_grad()) left them unsharded, so "
            "model.parameters() yielded plain tensors instead of the sharded DTensor parameters, and no step "
            "would update them. Call model.reshard() (on each unit listed) before collecting the parameters, "
            "or pass the model itself: dmuon.Muon(model, ...) reshards it"
        )
    return params


# ----------------------------------------------------------------------------------------------
# Reading FSDP2's per-module state (the runtime's hooks ask it)
# ----------------------------------------------------------------------------------------------


def fsdp_state(module):
    """FSDP2 state of ``module`` if ``fully_shard`` was applied to it, else ``None``."""
    get = getattr(module, "_get_fsdp_state", None)
    return get() if get is not None else None


def requires_gradient_sync(module) -> bool:
    """False when FSDP2's ``set_requires_gradient_sync(False)`` is in force on ``module``'s unit."""
    groups = getattr(fsdp_state(module), "_fsdp_param_groups", None) or ()
    return all(getattr(g, "reduce_grads", True) for g in groups)


def check_mp_policy(module, plan, fqn: str) -> None:
    """Warn when ``fully_shard(module)`` uses a mixed-precision policy other than the plan's."""
    policy = getattr(fsdp_state(module), "_mp_policy", None)
    if policy is None:
        return
    theirs = (_dtype_name(policy.param_dtype), _dtype_name(policy.reduce_dtype))
    ours = (plan.param_dtype, plan.reduce_dtype)
    if theirs != ours:
        warnings.warn(
            f"dmuon: fully_shard({fqn or '<root>'}) uses mp_policy param_dtype/reduce_dtype "
            f"{theirs} but dmuon's plan uses {ours} for the dedicated matrices of this boundary; "
            "pass the same MixedPrecisionPolicy to dmuon.dedicate_params(..., mp_policy=...)",
            stacklevel=3,
        )


def _dtype_name(dtype) -> str | None:
    return None if dtype is None else str(dtype)


SET_UP_ORDER = (
    "dmuon.dedicate_params(model, mesh) -> fully_shard(block) for each block -> fully_shard(model) -> "
    "dmuon.Muon(model, ...)"
)


def _fsdp_managed_params(model: nn.Module) -> set[int] | None:
    """ids of the sharded parameters the ``fully_shard`` units in ``model`` manage (None if this
    torch's FSDP2 state does not expose them)."""
    managed: set[int] = set()
    for module in model.modules():
        state = fsdp_state(module)
        if state is None:
            continue
        groups = getattr(state, "_fsdp_param_groups", None)
        if groups is None:
            group = getattr(state, "_fsdp_param_group", None)
            groups = [] if group is None else [group]
        for group in groups:
            for fp in getattr(group, "fsdp_params", None) or ():
                sharded = getattr(fp, "sharded_param", None)
                if sharded is None:
                    return None
                managed.add(id(sharded))
    return managed


def _check_set_up_order(opt: "Muon", dedicated: list[Tensor]) -> None:
    """First ``step()``: the optimizer must hold the model's FSDP2-sharded parameters.

    Two set-up mistakes would otherwise train without an error: ``dmuon.Muon`` built before
    ``fully_shard`` (it holds the pre-shard tensors that ``fully_shard`` replaced, so every
    non-dedicated parameter stays at its initial value), and a missing ``fully_shard`` (e.g. the
    final ``fully_shard(model)``: parameters outside every unit get no gradient averaging and the
    ranks drift apart). Local and structural, so every rank raises alike; skipped for a
    data-parallel mesh of one rank and without a live dmuon runtime. (Skipping only the per-block
    ``fully_shard`` calls is not an error: the root unit then manages every parameter, at the
    cost of one large all-gather.)

    Raises:
        RuntimeError: naming the count, the first parameters and the set-up order.
    """
    from .runtime import _runtimes

    runtimes = _runtimes(dedicated)
    if not runtimes or runtimes[0].world_numel == 1:
        return
    model = runtimes[0].model_ref()
    if model is None:
        return
    named = {id(p): n for n, p in model.named_parameters()}
    others = [p for g in opt.param_groups if not g["use_muon"] for p in g["params"]]
    stale = [p for p in others if id(p) not in named]
    if stale:
        raise RuntimeError(
            f"dmuon.Muon: {len(stale)} of its parameters are no longer parameters of the model "
            "(fully_shard replaced them with sharded DTensors after the optimizer was built), so they "
            f"would never be updated: build dmuon.Muon after fully_shard. Set-up order: {SET_UP_ORDER}"
        )
    managed = _fsdp_managed_params(model)
    if managed is None:
        return
    unmanaged = [named[id(p)] for p in others if p.requires_grad and id(p) not in managed]
    if unmanaged:
        shown = fmt_names([repr(n) for n in unmanaged], 4)
        raise RuntimeError(
            f"dmuon.Muon: {len(unmanaged)} non-dedicated parameters ({shown}) are not managed by any "
            "fully_shard unit, so their gradients are never averaged across ranks and the replicas "
            "drift apart: call fully_shard on every block, then fully_shard(model) (it takes every "
            f"parameter left over). Set-up order: {SET_UP_ORDER}"
        )
