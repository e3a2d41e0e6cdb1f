"""FSDP2: ``fully_shard`` must leave dedicated parameters alone; reading FSDP2's per-module state.

FSDP2 already supports parameters it must not manage: ``fully_shard(..., ignored_params=S)``.
:func:`ignored_params` is that set for a dedicated model (the patch-free path:
``fully_shard(block, ignored_params=dmuon.fsdp2_ignored_params(block))``). By default the first
dedication instead makes ``fully_shard`` add every dedicated parameter reachable from the modules
being sharded to ``S``,
at the narrowest point that serves every way of calling ``fully_shard`` (however it was
imported): ``torch.distributed.fsdp._fully_shard._fsdp_init._get_managed_modules`` and
``_get_managed_states``, the two functions through which ``fully_shard`` reads ``ignored_params``.
Both are wrapped by :func:`skip_dedicated`, not replaced; the wrappers only widen
``ignored_params``. The wrapping itself is the ``fsdp2.*`` entries of :mod:`dmuon._registry`
(signature-checked; ``DMUON_NO_PATCHES=1`` leaves FSDP2 untouched, and then
:func:`check_dedicated_unmanaged` stops a dedicated parameter that FSDP2 ended up managing).
"""

from __future__ import annotations

import contextlib
import functools
import warnings

import torch.nn as nn

from dmuon import _registry
from dmuon import _tags
from dmuon._tags import dedicated_info

__all__ = [
    "install",
    "is_installed",
    "ignored_params",
    "dedicated_params_in",
    "check_dedicated_unmanaged",
    "fsdp_state",
    "fsdp_param_groups",
    "gradient_divide_factor",
    "requires_gradient_sync",
    "check_mp_policy",
    "sharded_params_for_optimizer",
]


def dedicated_params_in(modules) -> set[nn.Parameter]:
    """Every parameter tagged by :func:`dmuon.exec.apply` under ``modules`` (recursively)."""
    out: set[nn.Parameter] = set()
    for module in modules:
        for p in module.parameters():
            if dedicated_info(p) is not None:
                out.add(p)
    return out


def ignored_params(model_or_modules) -> set[nn.Parameter]:
    """The ``ignored_params`` to give ``fully_shard`` for a dedicated model (or block, or list of
    modules): its dedicated parameters. With it no patch of FSDP2 is needed::

        for block in dmuon.integrations.boundary_modules(model, plan):
            fully_shard(block, mesh=mesh, ignored_params=dmuon.fsdp2_ignored_params(block))
        fully_shard(model, mesh=mesh, ignored_params=dmuon.fsdp2_ignored_params(model))
    """
    roots = model_or_modules if isinstance(model_or_modules, (list, tuple)) else (model_or_modules,)
    return dedicated_params_in(roots)


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


def skip_dedicated(fn):
    """The wrapper of FSDP2's ``_get_managed_modules`` / ``_get_managed_states`` (registry entries
    ``fsdp2.*``): ``ignored_params`` widened by the dedicated parameters under ``modules``."""

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

    return wrapper


def install() -> None:
    """Install the ``fully_shard`` skip now (``dmuon._registry.install("fsdp2")``), even when the
    automatic installs are disabled. Idempotent.

    Raises:
        dmuon._registry.IntegrationError: this torch's FSDP2 internals differ from what dmuon
            relies on (missing function, or its second parameter is not ``ignored_params``).
    """
    _registry.install("fsdp2")


def is_installed() -> bool:
    return all(_registry.installed(n) for n in ("fsdp2.managed_modules", "fsdp2.managed_states"))


def check_dedicated_unmanaged(model: nn.Module) -> None:
    """Raise ``RuntimeError`` if ``fully_shard`` took over a dedicated parameter of ``model`` (its
    module now holds an FSDP2 ``DTensor`` without dmuon's tag in its place): this happens only
    without the ``fully_shard`` skip (``DMUON_NO_PATCHES=1`` / ``dmuon.integrations.disable()``)
    when ``fully_shard`` was not given ``ignored_params``. Local and structural: every rank raises
    alike, before any collective of dmuon's."""
    rt = _tags.model_runtime(model)
    if rt is None:
        return
    taken = []
    for fqn in rt.plan.dedicated:
        try:
            p = model.get_parameter(fqn)
        except AttributeError:
            continue
        if dedicated_info(p) is None:
            taken.append(fqn)
    if taken:
        raise RuntimeError(
            f"dmuon: fully_shard manages {len(taken)} dedicated parameter(s) (e.g. {taken[0]!r}) that their "
            "owner ranks must keep: dmuon's fully_shard skip is not installed (DMUON_NO_PATCHES=1 or "
            "dmuon.integrations.disable()), so pass them as ignored: fully_shard(module, ..., "
            "ignored_params=dmuon.fsdp2_ignored_params(module)) for every fully_shard call on the dedicated "
            "model (docs/integrations.md, 'Without patches')"
        )


# ----------------------------------------------------------------------------------------------
# Units left unsharded when the optimizer is built
# ----------------------------------------------------------------------------------------------


def _unsharded_units(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` of every ``fully_shard`` unit of ``model`` whose parameters are now
    unsharded (FSDP2 registers the unsharded plain tensors in place of the sharded DTensors)."""
    out = []
    for name, m in model.named_modules():
        groups = fsdp_param_groups(m)
        if any(not getattr(g, "is_sharded", True) for g in groups):
            out.append((name or "<root>", m))
    return out


def _runtime_of(p):
    info = dedicated_info(p)
    return None if info is None else info.runtime()


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
        check_dedicated_unmanaged(model_or_params)
        for _, unit in _unsharded_units(model_or_params):
            unit.reshard()
        return model_or_params
    if isinstance(model_or_params, torch.Tensor) or not hasattr(model_or_params, "__iter__"):
        return model_or_params
    params = list(model_or_params)
    runtime = next((rt for rt in map(_runtime_of, params) if rt is not None), None)
    model = runtime.model_ref() if runtime is not None else None
    if model is None:
        return params
    check_dedicated_unmanaged(model)
    given = {id(p) for p in params if isinstance(p, torch.Tensor)}
    bad = []
    for name, unit in _unsharded_units(model):
        for g in fsdp_param_groups(unit):
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
    # looked up on the class (FSDPModule's method): a plain module then costs no failed instance
    # lookup (nn.Module.__getattr__ raising), which the hooks would pay per module and backward
    get = getattr(type(module), "_get_fsdp_state", None)
    return get(module) if get is not None else None


def fsdp_param_groups(module) -> tuple:
    """The FSDP2 param groups of ``module``'s unit (empty when it is not one); the one reading of
    FSDP2's per-module state (``_fsdp_param_groups``, or the single ``_fsdp_param_group`` of
    older torch)."""
    state = fsdp_state(module)
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:
        group = getattr(state, "_fsdp_param_group", None)
        groups = () if group is None else (group,)
    return tuple(groups)


def requires_gradient_sync(module) -> bool:
    """False when FSDP2's ``set_requires_gradient_sync(False)`` is in force on ``module``'s unit."""
    return all(getattr(g, "reduce_grads", True) for g in fsdp_param_groups(module))


def gradient_divide_factor(module) -> float | None:
    """The ``gradient_divide_factor`` set on ``module``'s FSDP2 param groups
    (``FSDPModule.set_gradient_divide_factor``), or None."""
    for group in fsdp_param_groups(module):
        factor = getattr(group, "gradient_divide_factor", None)
        if factor is not None:
            return factor
    return None


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


def _fsdp_managed_params(model: nn.Module) -> set[int] | None:
    """ids of the sharded parameters the ``fully_shard`` units in ``model`` manage (None if this
    torch's FSDP2 state does not expose them)."""
    managed: set[int] = set()
    for module in model.modules():
        for group in fsdp_param_groups(module):
            for fp in getattr(group, "fsdp_params", None) or ():
                sharded = getattr(fp, "sharded_param", None)
                if sharded is None:
                    return None
                managed.add(id(sharded))
    return managed
