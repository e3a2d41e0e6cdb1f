"""Set-up guards: the checks that stop a wrong set-up before it trains wrongly, in one place.

Each raises on every rank alike and names the fix for the framework on the call stack. The
guards and when each runs: Note: set-up guards (docs/design.md).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch
import torch.nn as nn
from torch import Tensor

from dmuon._hints import SET_UP_ORDER, detect_framework, framework_hint
from dmuon.plan._tools.render import fmt_names

from dmuon import _tags
from dmuon._tags import dedicated_info
from dmuon.exec._setup import fsdp2
from dmuon.exec._setup import host_offload

if TYPE_CHECKING:
    from dmuon.exec._optim.muon import Muon

__all__ = [
    "SET_UP_ORDER",
    "embedding_tie_sides",
    "check_no_cross_stage_tie",
    "check_not_fully_sharded",
    "check_set_up_order",
    "check_optimizer",
    "wrap_ddp_init",
    "install_optimizer_guard",
]


def _dedicated(params) -> list[Tensor]:
    return [p for p in params if dedicated_info(p) is not None]


def check_not_fully_sharded(model: nn.Module) -> None:
    """Raise ``ValueError`` if ``fully_shard`` was already applied anywhere in ``model``.

    dmuon must decide ownership of full matrices before FSDP2 shards them. ``DTensor``
    parameters alone are fine: tensor parallelism (``parallelize_module``) comes first (the plan
    rejects placements it cannot own).
    """
    from torch.distributed.fsdp import FSDPModule

    wrapped = [name or "<root>" for name, m in model.named_modules() if isinstance(m, FSDPModule)]
    if wrapped:
        what = f"modules {wrapped[:5]}"
        raise ValueError(
            f"dmuon: the model is already sharded ({what}{' ...' if len(wrapped) > 5 else ''}). "
            "Call dmuon.dedicate_params(model, mesh) BEFORE fully_shard. "
            # the order once: the generic hint is the order itself, a framework's follows it
            + (f"Set-up order: {SET_UP_ORDER}. " if detect_framework(model) is not None else "")
            + framework_hint("fully_shard_first", model)
        )


def check_set_up_order(opt: "Muon", dedicated: list[Tensor]) -> None:
    """First ``step()``: the optimizer must hold the model's FSDP2-sharded parameters.

    Two set-up mistakes would otherwise train without an error: ``dmuon.Muon`` built before
    ``fully_shard`` (it holds the pre-shard tensors that ``fully_shard`` replaced, so every
    non-dedicated parameter stays at its initial value), and a missing ``fully_shard`` (e.g. the
    final ``fully_shard(model)``: parameters outside every unit get no gradient averaging and the
    ranks drift apart). Local and structural, so every rank raises alike; skipped without a live
    dmuon runtime, and the missing ``fully_shard`` check also on a data-parallel mesh of one rank. (Skipping only the per-block
    ``fully_shard`` calls is not an error: the root unit then manages every parameter, at the
    cost of one large all-gather.) Also: no dedicated parameter may be managed by FSDP2
    (:func:`dmuon.exec._setup.fsdp2.check_dedicated_unmanaged`, any mesh).

    Raises:
        RuntimeError: naming the count, the first parameters and the set-up order.
    """
    from dmuon.exec._runtime.runtime import runtimes_of

    runtimes = runtimes_of(dedicated)
    for rt in runtimes:
        model = rt.model_ref()
        if model is not None:
            fsdp2.check_dedicated_unmanaged(model)
            host_offload.check_fully_shard_policies(model, rt.offload)
    models = [m for m in (rt.model_ref() for rt in runtimes) if m is not None]
    if not models:
        return
    # one optimizer over several dedicated models (e.g. the pipeline stages a rank holds): each
    # parameter is checked against the models' parameters together
    named = {id(p): n for model in models for n, p in model.named_parameters()}
    others = [p for g in opt.param_groups if not g["use_muon"] for p in g["params"]]
    stale = [p for p in others if id(p) not in named]
    if stale:  # on any mesh: fully_shard replaces the parameters on one rank too
        raise RuntimeError(
            f"dmuon.Muon: {len(stale)} of its parameters are no longer parameters of the model "
            "(fully_shard replaced them with sharded DTensors after the optimizer was built), so they "
            f"would never be updated: build dmuon.Muon after fully_shard. Set-up order: {SET_UP_ORDER}"
        )
    if runtimes[0].world_numel == 1:  # one data-parallel rank: nothing to average
        return
    managed: set = set()
    for model in models:
        found = fsdp2._fsdp_managed_params(model)
        if found is None:
            return
        managed |= found
    unmanaged = [named[id(p)] for p in others if p.requires_grad and id(p) not in managed]
    if unmanaged:
        shown = fmt_names([repr(n) for n in unmanaged], 4)
        raise RuntimeError(
            f"dmuon.Muon: {len(unmanaged)} non-dedicated parameters ({shown}) are not managed by any "
            "fully_shard unit, so their gradients are never averaged across ranks and the replicas "
            "drift apart: call fully_shard on every block, then fully_shard(model) (it takes every "
            f"parameter left over). Set-up order: {SET_UP_ORDER}"
        )


_check_set_up_order = check_set_up_order  # the name dmuon.exec._optim.muon imports


# ----------------------------------------------------------------------------------------------
# Foreign optimizers
# ----------------------------------------------------------------------------------------------


def check_optimizer(optimizer: torch.optim.Optimizer, model: nn.Module | None = None) -> None:
    """Raise ``TypeError`` if ``optimizer`` holds dmuon-dedicated parameters but is not a
    ``dmuon.Muon``: such an optimizer would update owner-held masters as if they were ordinary
    parameters (and skip the zero-size placeholders), i.e. train wrongly. The message names the
    parameter and the framework-specific fix (:func:`framework_hint`)."""
    inner = getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer
    if _is_dmuon_muon(inner):
        return
    params = [p for g in inner.param_groups for p in g["params"]]
    dedicated = _dedicated(params)
    parts = getattr(inner, "optimizers", None)  # a container (torchtitan's OptimizersContainer)
    if dedicated and isinstance(parts, (list, tuple)) and all(isinstance(o, torch.optim.Optimizer) for o in parts):
        # the container steps its parts, each checked on its own step: here only that every
        # dedicated parameter it holds is in one of its dmuon.Muon parts
        in_muon = {id(p) for o in parts if _is_dmuon_muon(o) for g in o.param_groups for p in g["params"]}
        dedicated = [p for p in dedicated if id(p) not in in_muon]
    if dedicated:
        fqn = dedicated_info(dedicated[0]).fqn
        raise TypeError(
            f"dmuon: {type(inner).__name__} holds {len(dedicated)} parameter(s) dedicated by "
            f"dmuon.dedicate_params (e.g. {fqn!r}); only dmuon.Muon can update them. "
            + framework_hint("foreign_optimizer", model)
        )


def _is_dmuon_muon(optimizer) -> bool:
    """``isinstance(optimizer, dmuon.Muon)`` without importing the optimizer module (which imports
    this one): the method only ``dmuon.Muon`` defines, the one the GradScaler integration uses."""
    return callable(getattr(type(optimizer), "_unscale_grads_for_scaler", None))


def _groups_key(optimizer) -> tuple:
    """What changes when parameters are added or swapped: each group's params list and length
    (O(groups), not O(parameters))."""
    return tuple((id(g["params"]), len(g["params"])) for g in optimizer.param_groups)


def _optimizer_step_pre_hook(optimizer, args, kwargs) -> None:
    """The ``optimizer.guard`` integration: :func:`check_optimizer` at an optimizer's first step,
    and again only when its parameter groups changed; ``dmuon.Muon`` is skipped. Per step, for an
    optimizer already checked: one tuple of (id, len) per parameter group."""
    if _is_dmuon_muon(optimizer):
        return
    key = _groups_key(optimizer)
    if _tags.read(optimizer, _tags.CHECKED_GROUPS) == key:
        return
    check_optimizer(optimizer)
    try:
        _tags.write(optimizer, _tags.CHECKED_GROUPS, key)
    except AttributeError:  # an optimizer with __slots__: check every step
        pass


def install_optimizer_guard():
    """Register :func:`_optimizer_step_pre_hook` globally; returns its removable handle."""
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    return register_optimizer_step_pre_hook(_optimizer_step_pre_hook)


# ----------------------------------------------------------------------------------------------
# DistributedDataParallel
# ----------------------------------------------------------------------------------------------


def wrap_ddp_init(orig):
    """``DistributedDataParallel.__init__`` that raises a ``ValueError`` naming the framework's fix
    for a model with dedicated parameters, before DDP's own parameter-shape check (which fails
    with a size mismatch between owners and non-owners, or hangs on ranks that disagree)."""

    @functools.wraps(orig)
    def __init__(self, module, *args, **kwargs):
        dedicated = _dedicated(module.parameters()) if isinstance(module, nn.Module) else []
        if dedicated:
            raise ValueError(
                f"dmuon: DistributedDataParallel around a model with {len(dedicated)} parameter(s) "
                f"dedicated by dmuon.dedicate_params (e.g. {dedicated_info(dedicated[0]).fqn!r}): owners hold "
                f"full matrices, other ranks zero-size placeholders, and dmuon already averages their "
                f"gradients. " + framework_hint("wrapped_after", module)
            )
        orig(self, module, *args, **kwargs)

    return __init__


# ----------------------------------------------------------------------------------------------
# Tied embeddings across pipeline stages
# ----------------------------------------------------------------------------------------------

#: module names of an input embedding / an output projection (torchtitan, Hugging Face, GPT-2, small models)
_INPUT_EMBEDDING_NAMES = ("tok_embeddings", "embed_tokens", "wte", "word_embeddings", "embed", "embedding")
_OUTPUT_PROJECTION_NAMES = ("lm_head", "output", "head")


def _declared_tie(model: nn.Module) -> str | None:
    """How ``model`` declares its input embedding and output projection tied, or None: torchtitan's
    ``enable_weight_tying`` attribute, Hugging Face's ``config.tie_word_embeddings``."""
    if getattr(model, "enable_weight_tying", False) is True:
        return "enable_weight_tying=True"
    if getattr(getattr(model, "config", None), "tie_word_embeddings", False) is True:
        return "config.tie_word_embeddings=True"
    return None


def _find_weight(model: nn.Module, names: tuple[str, ...]) -> tuple[str, Tensor] | None:
    """The shallowest module named one of ``names`` that has a ``weight``: its FQN and weight."""
    found = [
        (fqn.count("."), f"{fqn}.weight", module.weight)
        for fqn, module in model.named_modules()
        if fqn.rsplit(".", 1)[-1] in names and isinstance(getattr(module, "weight", None), Tensor)
    ]
    return min(found, key=lambda f: f[0])[1:] if found else None


def embedding_tie_sides(model: nn.Module) -> tuple[tuple[str, str, str], ...]:
    """The sides of a declared embedding tie (:func:`_declared_tie`) that this pipeline stage holds
    without the other: ``((side, fqn, declaration), ...)`` with ``side`` ``"input"`` (the embedding)
    or ``"output"`` (the projection); empty when the model declares no tie, holds both sides as one
    tensor (a tie inside the stage, trained as one parameter) or neither. Local."""
    declared = _declared_tie(model)
    if declared is None:
        return ()
    found = {
        side: _find_weight(model, names)
        for side, names in (("input", _INPUT_EMBEDDING_NAMES), ("output", _OUTPUT_PROJECTION_NAMES))
    }
    present = {side: f for side, f in found.items() if f is not None}
    if len(present) != 1:  # both (tied here, or untied by the user) or neither (a middle stage)
        return ()
    ((side, (fqn, _)),) = present.items()
    return ((side, fqn, declared),)


def check_no_cross_stage_tie(findings) -> None:
    """Raise the same ``NotImplementedError`` on every rank when one pipeline stage holds the input
    side of a declared embedding tie and another the output side. ``findings``: per stage (its
    sorted ranks), :func:`embedding_tie_sides` of its model, the same list on every rank."""
    sides: dict[str, tuple] = {}
    for ranks, stage_sides in findings:
        for side, fqn, declared in stage_sides:
            sides.setdefault(side, (list(ranks), fqn, declared))
    if len(sides) < 2:
        return
    (in_ranks, in_fqn, declared), (out_ranks, out_fqn, _) = sides["input"], sides["output"]
    raise NotImplementedError(
        f"dmuon: tied embeddings across pipeline stages are not supported: the model declares its input embedding "
        f"and output projection tied ({declared}), and after the split the ranks {in_ranks} hold {in_fqn!r} while "
        f"the ranks {out_ranks} hold {out_fqn!r} as a separate tensor. Each stage would train its own copy and "
        "nothing would sum their gradients, so the two would drift apart silently. Untie them (enable_weight_tying="
        "False / tie_word_embeddings=False; torchtitan refuses weight tying under pipeline parallelism too), or "
        "keep the embedding and the output projection in one stage (docs/pipeline_parallel.md)"
    )
