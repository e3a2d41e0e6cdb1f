"""dmuon inside torchtitan (>= 0.3) without forking it: the pieces a torchtitan config uses.

Recipe (docs/integrations.md, "torchtitan")::

    from dmuon.integrations.torchtitan import dmuon_model_spec, muon_optimizer

    config = llama3_debugmodel()                                   # any Trainer.Config
    config.model_spec = dmuon_model_spec(config.model_spec)        # 1. dedicate inside parallelize
    config.optimizer = muon_optimizer(lr=0.02, adamw_lr=8e-4)      # 2. dmuon.Muon in the container

What each piece does (dedication inside parallelize, the optimizers container, gradient scale,
clipping, expert parallelism) and what is refused: Note: the torchtitan integration
(docs/design.md).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import warnings
from typing import Any, Callable

import torch
import torch.nn as nn
from torchtitan.components.optimizer import OptimizersContainer, ParamGroupConfig

from dmuon._dtensor import is_dtensor

__all__ = [
    "wrap_parallelize",
    "dmuon_model_spec",
    "data_parallel_mesh",
    "DmuonOptimizersContainer",
    "muon_optimizer",
    "build_muon",
]

_WRAPPED_ATTR = "__dmuon_parallelize__"


# ------------------------------------------------------------------------------------------
# 1. dedication inside the parallelize step
# ------------------------------------------------------------------------------------------


def data_parallel_mesh(parallel_dims):
    """The mesh dmuon dedicates over: the one torchtitan gives ``fully_shard``
    (``["dp_replicate", "fsdp"]`` with a replicate degree, else ``["fsdp"]``; ``"fsdp"`` is
    ``dp_shard x cp``), with the ``tp`` dim appended when tensor parallelism is on (dmuon reads
    the dims by name, ``dmuon.plan._records.mesh.MESH_DIM_NAMES``)."""
    names = ["dp_replicate", "fsdp"] if parallel_dims.dp_replicate_enabled else ["fsdp"]
    if parallel_dims.tp_enabled:
        names.append("tp")
    return parallel_dims.get_mesh(names)


def _refuse_unsupported(parallel_dims, kwargs) -> None:
    parallelism = kwargs.get("parallelism")
    why = []
    if parallel_dims.pp_enabled and parallel_dims.tp_enabled:  # dmuon.dedicate_params refuses PP with TP
        why.append("pipeline parallelism together with tensor_parallel_degree > 1")
    if parallel_dims.ep_enabled and parallel_dims.tp_enabled:
        # an expert stack would be TP-sharded (torchtitan's ETP) as well as split over ep: dmuon's
        # EP stacks are plain tensors of whole experts (docs/moe_ep.md, "What is refused")
        why.append("expert parallelism with tensor_parallel_degree > 1")
    backend = getattr(parallelism, "spmd_backend", None) if parallelism is not None else None
    if backend in ("full_dtensor", "spmd_types"):
        why.append(
            f'parallelism.spmd_backend = "{backend}" (set "partial_dtensor": FSDP2 then shards plain '
            "parameters over the data-parallel mesh, the path dmuon is tested on; under "
            f'"{backend}" FSDP2 is given the full SPMD mesh with dp_mesh_dims)'
        )
    if why:
        raise NotImplementedError(
            "dmuon.integrations.torchtitan: not supported with " + ", ".join(why) + " (docs/integrations.md)"
        )


def _mp_policy(training):
    """FSDP2's policy as torchtitan's ``apply_fsdp_to_decoder`` builds it (param / reduce dtypes)."""
    if training is None:
        return None
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torchtitan.config import TORCH_DTYPE_MAP

    return MixedPrecisionPolicy(
        param_dtype=TORCH_DTYPE_MAP[training.mixed_precision_param],
        reduce_dtype=TORCH_DTYPE_MAP[training.mixed_precision_reduce],
        cast_forward_inputs=False,
    )


def wrap_parallelize(parallelize_fn: Callable, **dedicate_kwargs: Any) -> Callable:
    """``parallelize_fn`` (a ``ModelSpec.parallelize_fn``) with ``dmuon.dedicate_params`` run
    right before its first ``fully_shard`` call (after TP, AC and compile).

    ``dedicate_kwargs`` go to ``dmuon.dedicate_params`` (``predicate=``, ``owner_groups=``,
    ``tp=dmuon.plan.TPPolicy(...)`` ...). Defaults taken from torchtitan's config when not given:
    ``reshard_after_forward`` from ``parallelism.fsdp_reshard_after_forward`` as torchtitan
    resolves it for FSDP2 ("always" -> Z3, "never" -> Z2, "default" -> Z3, or Z2 under pipeline
    parallelism), ``mp_policy`` from ``training.mixed_precision_*``, ``offload_policy`` from
    ``training.enable_cpu_offload`` (``CPUOffloadPolicy()``, as torchtitan's ``fully_shard`` gets
    it: owned masters and momenta on the host), and with ``pipeline_parallel_degree`` > 1
    ``pipeline=True`` (each model part one stage).

    Raises:
        NotImplementedError: pipeline or expert parallelism together with TP, an expert-parallel
            layout dmuon does not take (Note: the torchtitan integration, docs/design.md),
            ``spmd_backend`` other than ``"partial_dtensor"``.
        RuntimeError: the parallelize function called no ``fully_shard`` (nothing to dedicate
            before), so dmuon was not applied.
    """
    if getattr(parallelize_fn, _WRAPPED_ATTR, False):
        return parallelize_fn

    @functools.wraps(parallelize_fn)
    def parallelize(model: nn.Module, *args: Any, parallel_dims, **kwargs: Any) -> nn.Module:
        from dmuon import _registry
        from dmuon.exec._setup.api import dedicate_params
        from dmuon.exec._setup.fsdp2 import before_next_fully_shard
        from torchtitan.tools.logging import logger

        _refuse_unsupported(parallel_dims, kwargs)
        training, parallelism = kwargs.get("training"), kwargs.get("parallelism")
        opts = dict(dedicate_kwargs)
        if "mp_policy" not in opts and training is not None:
            opts["mp_policy"] = _mp_policy(training)
        if "reshard_after_forward" not in opts and parallelism is not None:
            from torchtitan.distributed.fsdp import get_fsdp_reshard_after_forward_policy

            opts["reshard_after_forward"] = get_fsdp_reshard_after_forward_policy(
                parallelism.fsdp_reshard_after_forward, parallel_dims.pp_enabled
            )
        if "offload_policy" not in opts and getattr(training, "enable_cpu_offload", False):
            from torch.distributed.fsdp import CPUOffloadPolicy

            opts["offload_policy"] = CPUOffloadPolicy()  # what torchtitan's apply_fsdp gives fully_shard

        def dedicate():
            mesh = data_parallel_mesh(parallel_dims)
            kw = dict(opts)
            if parallel_dims.pp_enabled:  # this model part is one pipeline stage, dedicated on its dp mesh
                kw.setdefault("pipeline", True)
            if parallel_dims.ep_enabled:
                _check_ep_layout(parallel_dims, mesh)
                _localize_expert_dtensors(model, parallel_dims)
                kw.setdefault("ep", parallel_dims.ep)
            with warnings.catch_warnings():
                if parallel_dims.pp_enabled and not _holds_blocks(model):
                    # a pipeline part of only the embedding or the head: nothing to dedicate, by design
                    warnings.filterwarnings("ignore", message=r"dmuon\.plan\._compile: no matrix is dedicated")
                plan = dedicate_params(model, mesh, **kw)
            logger.info(
                f"dmuon: dedicated {len(plan.dedicated)} matrices to owners on mesh "
                f"{tuple(mesh.mesh_dim_names or ())} {tuple(mesh.shape)} (Muon on owners, "
                f"FSDP2 + AdamW for the rest)\n{plan.summary()}"
            )
            return plan

        # the hook below runs inside the fully_shard skip, which the first dedication installs:
        # install that stage now (as before, DMUON_NO_PATCHES=1 leaves it out: the RuntimeError below)
        _registry.install_stage("dedicate")
        with before_next_fully_shard(dedicate) as ran:
            out = parallelize_fn(model, *args, parallel_dims=parallel_dims, **kwargs)
        if not ran:
            raise RuntimeError(
                f"dmuon.integrations.torchtitan: {getattr(parallelize_fn, '__qualname__', parallelize_fn)} "
                "never called fully_shard, so dmuon had no point to dedicate at; dmuon needs FSDP2 "
                "(torchtitan applies it for data_parallel_shard_degree != 1 and on one rank too)"
            )
        _full_size_param_init(out, ran[0])
        return out

    setattr(parallelize, _WRAPPED_ATTR, True)
    return parallelize


def _holds_blocks(model: nn.Module) -> bool:
    """Whether a torchtitan model (part) holds any transformer block: torchtitan's pipeline split
    leaves a part of only the embedding or only the norm and head with an empty ``layers``."""
    layers = getattr(model, "layers", None)
    return layers is None or len(layers) > 0


def _check_ep_layout(parallel_dims, mesh) -> None:
    """dmuon's expert-parallel layout (docs/moe_ep.md): in each replicate row, shard rank ``s``
    of the FSDP dim holds the experts of EP coordinate ``s mod ep`` (EP groups are ``ep``
    consecutive shard ranks) and is index ``s // ep`` of its efsdp group. torchtitan unflattens
    the world into ``(pp, dp_replicate, fsdp, tp)`` for the dense parameters and
    ``(pp, dp_replicate, efsdp, ep)`` for the experts, ``ep`` innermost, so with ``tp = 1`` that
    holds (``ParallelDims.build_mesh``); checked here on every rank against the global ranks of
    its ``ep`` and ``efsdp`` groups, and agreed by an all-reduce, so that a layout that breaks it raises the same error on
    every rank instead of training wrongly."""
    import torch.distributed as dist

    def ranks(m, dim=None):  # the global ranks of this rank's group along a mesh dim, in group-rank order
        group = m.get_group(dim) if dim is not None else m.get_group()
        return [dist.get_global_rank(group, i) for i in range(group.size())]

    ep = parallel_dims.ep
    names = tuple(mesh.mesh_dim_names or ())
    row = ranks(mesh, "fsdp" if len(names) > 1 else None)  # this replicate row's shard ranks, s = 0 .. N-1
    s = row.index(dist.get_rank())
    ok = (
        ranks(parallel_dims.get_mesh("ep")) == row[s - s % ep : s - s % ep + ep]
        and ranks(parallel_dims.get_mesh("efsdp")) == row[s % ep :: ep]
    )
    flag = torch.tensor([int(ok)], device=mesh.device_type)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    if not int(flag.item()):
        raise NotImplementedError(
            "dmuon.integrations.torchtitan: torchtitan's expert-parallel groups are not what dmuon plans for: "
            f"dmuon assumes shard rank s of the FSDP dim ({names}) holds the experts of EP coordinate s mod "
            f"ep (ep = {ep}: EP groups of ep consecutive shard ranks, efsdp groups s, s+ep, ...), and the 'ep' / "
            "'efsdp' meshes torchtitan built disagree on some rank (docs/moe_ep.md)"
        )


def _localize_expert_dtensors(model: nn.Module, parallel_dims) -> list[str]:
    """Expert parallelism: each 3-D parameter torchtitan's ``parallelize`` made a DTensor sharded
    ``Shard(0)`` over the ``ep`` mesh dim becomes a plain ``nn.Parameter`` of this rank's experts
    (its local tensor, no copy), the form ``dmuon.dedicate_params(..., ep=N)`` takes. Returns the
    FQNs replaced."""
    from torch.distributed.tensor import Shard

    done = []
    for mod_fqn, module in model.named_modules():
        for name, p in list(module._parameters.items()):
            if not is_dtensor(p) or p.dim() != 3:
                continue
            names = tuple(p.device_mesh.mesh_dim_names or ())
            if "ep" not in names:
                continue
            ep_dim = names.index("ep")
            if p.placements[ep_dim] != Shard(0) or any(
                pl.is_shard() for i, pl in enumerate(p.placements) if i != ep_dim
            ):
                raise NotImplementedError(
                    f"dmuon.integrations.torchtitan: expert parameter {mod_fqn}.{name} is placed "
                    f"{tuple(p.placements)} on mesh {names}; dmuon takes experts sharded Shard(0) over "
                    "'ep' only (no TP on experts)"
                )
            module._parameters[name] = nn.Parameter(p.to_local(), requires_grad=p.requires_grad)
            done.append(f"{mod_fqn}.{name}" if mod_fqn else name)
    return done


def _full_size_param_init(model: nn.Module, plan) -> None:
    """torchtitan's ``init_weights`` (run by the Trainer after ``to_empty``) initialises each
    module's own parameters with its config's ``param_init`` functions, which may build the full
    value and ``copy_`` it in (the fused ``wqkv`` init does): on a non-holder's zero-row
    placeholder that fails. Each module owning a dedicated parameter gets an instance-level
    ``_init_self_parameters`` that runs torchtitan's under
    :func:`dmuon.exec._setup.materialize.full_size_params` (dedicated parameters full size, FSDP2's
    DTensors left to torchtitan), so every rank draws the same random numbers and holders keep
    the values."""
    from dmuon.exec._setup.materialize import full_size_params

    homes = {spec.module_fqn for spec in plan.params}
    for fqn in sorted(homes):
        module = model.get_submodule(fqn)
        init = getattr(module, "_init_self_parameters", None)
        if init is None or getattr(init, _WRAPPED_ATTR, False):
            continue

        def _init_self_parameters(module=module, init=init):
            with full_size_params(module, dedicated_only=True):
                init()

        setattr(_init_self_parameters, _WRAPPED_ATTR, True)
        module._init_self_parameters = _init_self_parameters


def dmuon_model_spec(model_spec, **dedicate_kwargs: Any):
    """A copy of ``model_spec`` whose ``parallelize_fn`` is :func:`wrap_parallelize`'d."""
    return dataclasses.replace(
        model_spec, parallelize_fn=wrap_parallelize(model_spec.parallelize_fn, **dedicate_kwargs)
    )


# ------------------------------------------------------------------------------------------
# 2. dmuon.Muon through torchtitan's OptimizersContainer
# ------------------------------------------------------------------------------------------

#: torchtitan's implementation keys on every group (from ``OptimizersContainer.Config.implementation``)
_IMPL_KEYS = ("fused", "foreach")
#: optimizer_kwargs key -> AdamW group key
_ADAMW_KEYS = {"adamw_lr": "lr", "adamw_betas": "betas", "adamw_eps": "eps", "adamw_weight_decay": "weight_decay"}


def _muon_signature_defaults() -> dict[str, Any]:
    from dmuon.exec._optim.muon import Muon

    sig = inspect.signature(Muon.__init__)
    return {n: p.default for n, p in sig.parameters.items() if n not in ("self", "model_or_params")}


def build_muon(param_groups: list[dict[str, Any]], **factory_kwargs: Any):
    """``dmuon.Muon`` from torchtitan's param-group dicts (the ``"Muon"`` factory of
    :class:`DmuonOptimizersContainer`).

    Each dict's ``optimizer_kwargs`` take ``dmuon.Muon``'s constructor names; keys a dict does
    not give take ``factory_kwargs`` (``optimizer_factory_kwargs_by_name["Muon"]``), then
    ``dmuon.Muon``'s defaults. ``fused`` / ``foreach`` (torchtitan's implementation switches) are
    dropped: dmuon's step has one implementation. Every resulting group carries
    ``param_names`` (torchtitan's checkpoint keys); empty groups are not kept.
    """
    from dmuon._tags import dedicated_info as _info
    from dmuon.exec._optim.muon import Muon

    signature = _muon_signature_defaults()
    unknown = sorted(set(factory_kwargs) - set(signature))
    if unknown:
        raise TypeError(
            f"dmuon.integrations.torchtitan: optimizer_factory_kwargs_by_name['Muon'] {unknown} are not dmuon.Muon arguments"
        )
    defaults = {**signature, **factory_kwargs}
    opt = None
    for i, group in enumerate(param_groups):
        group = dict(group)
        params = list(group.pop("params"))
        names = list(group.pop("param_names", [None] * len(params)))
        for key in _IMPL_KEYS:
            group.pop(key, None)
        unknown = sorted(set(group) - set(defaults))
        if unknown:
            raise TypeError(
                f"dmuon.integrations.torchtitan: optimizer_kwargs {unknown} of param group {i} are not "
                f"dmuon.Muon arguments; expected some of {sorted(defaults)}"
            )
        h = {**defaults, **group}
        muon_h = {k: v for k, v in h.items() if k not in _ADAMW_KEYS}
        adamw_h = {_ADAMW_KEYS[k]: v for k, v in h.items() if k in _ADAMW_KEYS}
        parts = [
            (True, [(n, p) for n, p in zip(names, params) if _info(p) is not None]),
            (False, [(n, p) for n, p in zip(names, params) if _info(p) is None]),
        ]
        for use_muon, named in parts:
            if not named:
                continue
            ps = [p for _, p in named]
            if opt is None:
                opt = Muon(ps, **h)
                opt.param_groups[:] = [g for g in opt.param_groups if g["params"]]
                opt.param_groups[0]["param_names"] = [n for n, _ in named]
                continue
            hp = {k: v for k, v in (muon_h if use_muon else adamw_h).items() if k != "ns_backend" or use_muon}
            opt.add_param_group({"params": ps, "param_names": [n for n, _ in named], "use_muon": use_muon, **hp})
    if opt is None:
        raise ValueError("dmuon.integrations.torchtitan: the Muon param groups hold no parameters")
    return opt


class DmuonOptimizersContainer(OptimizersContainer):
    """torchtitan's ``OptimizersContainer`` that also knows ``optimizer_name="Muon"``
    (``dmuon.Muon``, :func:`build_muon`); every other name resolves as in torchtitan."""

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(OptimizersContainer.Config):
        pass

    def __init__(self, config: OptimizersContainer.Config, *, model_parts: list[nn.Module]) -> None:
        """torchtitan's: one optimizer per model part and optimizer name, so one ``dmuon.Muon`` per
        pipeline stage. A stage whose plan dedicated nothing (a part of only the embedding or the
        head) gets a ``dmuon.Muon`` of AdamW groups, without ``dmuon.Muon``'s warning about it."""
        from dmuon.exec._runtime.runtime import get_model_runtime

        def blockless_stage(m):
            rt = get_model_runtime(m)
            return rt is not None and rt.pipelined and not rt.plan.dedicated

        with warnings.catch_warnings():
            if any(blockless_stage(m) for m in model_parts):
                warnings.filterwarnings("ignore", message=r"dmuon\.Muon: none of its \d+ parameters is dedicated")
            super().__init__(config, model_parts=model_parts)

    @staticmethod
    def _resolve_optimizer_factory(name: str) -> Callable[..., torch.optim.Optimizer]:
        if name == "Muon":
            return build_muon
        return OptimizersContainer._resolve_optimizer_factory(name)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torchtitan's load, with every dedicated matrix's momentum key on every rank.

        torchtitan's ``load_flat_optim_state_dict`` asks the checkpoint only for the state of
        parameters already in ``optimizer.state``; ``dmuon.Muon`` keeps a matrix's momentum on
        its owner only, so each rank would ask for different matrices and dmuon's load hook
        (which gathers each momentum's rows to its owner, a collective per matrix) would hang.
        Non-owners get a ``momentum_buffer`` key for the lookup (``None``; the load replaces
        the whole state, and dmuon's hook keeps momentum on owners only)."""
        from dmuon.exec._optim.muon import Muon
        from torchtitan.components.optimizer.utils import init_optim_state, load_flat_optim_state_dict

        for optim in self.optimizers:
            init_optim_state(optim)
            if isinstance(optim, Muon):
                for group in optim.param_groups:
                    if group["use_muon"]:
                        for p in group["params"]:
                            optim.state[p].setdefault("momentum_buffer", None)
            load_flat_optim_state_dict(optim, state_dict)


def muon_optimizer(
    lr: float = 0.02,
    adamw_lr: float = 8e-4,
    *,
    weight_decay: float = 0.1,
    momentum: float = 0.95,
    nesterov: bool = True,
    adamw_betas: tuple[float, float] = (0.9, 0.95),
    adamw_eps: float = 1e-8,
    adamw_weight_decay: float = 0.1,
    extra_param_groups: list[ParamGroupConfig] = (),
    **muon_kwargs: Any,
) -> DmuonOptimizersContainer.Config:
    """``config.optimizer`` for dmuon: one catch-all ``"Muon"`` group (Muon on the dedicated
    matrices, AdamW on everything else; AdamW defaults as torchtitan's ``default_adamw``).
    ``extra_param_groups`` come first (first match wins), e.g. a different ``adamw_lr`` for
    the embeddings; ``muon_kwargs``: more ``dmuon.Muon`` arguments (``ns_steps``,
    ``adjust_lr_fn``, ``ns_dtype`` ...)."""
    kwargs = dict(
        lr=lr,
        weight_decay=weight_decay,
        momentum=momentum,
        nesterov=nesterov,
        adamw_lr=adamw_lr,
        adamw_betas=tuple(adamw_betas),
        adamw_eps=adamw_eps,
        adamw_weight_decay=adamw_weight_decay,
        **muon_kwargs,
    )
    return DmuonOptimizersContainer.Config(
        param_groups=[
            *extra_param_groups,
            ParamGroupConfig(pattern=r".*", optimizer_name="Muon", optimizer_kwargs=kwargs),
        ],
        implementation="for-loop",
    )
