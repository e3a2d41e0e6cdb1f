"""The planner: :func:`compile` builds a :class:`~dmuon.plan._records.plan.ShardingPlan`.

``compile(model, mesh, ...)`` is pure: it reads a snapshot of the model (names, shapes, dtypes,
module types; meta-device models work), selects the dedicated parameters, resolves their hook
boundaries, assigns ONE owner rank per parameter with constrained LPT over the ``R*N`` mesh
slots, and lays out the packed per-boundary buffers. It never touches ``torch.distributed``,
never mutates or allocates the model, and gives byte-identical plans (same
:meth:`ShardingPlan.fingerprint`) for the same model and arguments on every rank.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from dmuon.plan import _rules as _rules
from dmuon.plan._model.boundaries import BoundaryResolver
from dmuon.plan._layout.buffer_layout import build_boundaries
from dmuon.plan._layout.collective_rule import assign_collectives
from dmuon.plan._layout.slots import equal_slots
from dmuon.plan._records.collective_records import CollectiveSettings
from dmuon.plan._records.mesh import normalize_mesh
from dmuon.plan._ownership.assign import assign_owners, fills_expert_ranges
from dmuon.plan._records.plan import ShardingPlan
from dmuon.plan._records.qk_clip_records import QKClip, check_qk_clip
from dmuon.plan._records.fields import itemsize_nbytes, wire_dtype_str
from dmuon.plan._records.owners import ExpertOwners
from dmuon.plan._records.policies import ExpertPolicy, TPPolicy, refuse_removed_keywords
from dmuon.plan._records.params import Fsdp2Unit, ParamSpec
from dmuon.plan._model.selection import select_params
from dmuon.plan._model.snapshot import take_snapshot

__all__ = ["compile"]


def _mp_dtypes(mp_policy: Any) -> tuple[str | None, str | None]:
    if mp_policy is None:
        return None, None
    return (
        wire_dtype_str(getattr(mp_policy, "param_dtype", None), "mp_policy.param_dtype"),
        wire_dtype_str(getattr(mp_policy, "reduce_dtype", None), "mp_policy.reduce_dtype"),
    )


@refuse_removed_keywords("dmuon.plan.compile()")
def compile(  # noqa: A001 - shadows the builtin on purpose: dmuon.plan.compile is the public name
    model: nn.Module,
    mesh: Any,
    *,
    predicate: Callable[[str, torch.Tensor], bool] | None = None,
    reshard_after_forward: bool = True,
    hook_boundary_predicate: Callable[[nn.Module], bool] | None = None,
    hook_boundary_strict: bool = True,
    replicate_async: bool = True,
    mp_policy: Any = None,
    cost_model: str = "numel",
    align_numel: int = 16,
    tp: TPPolicy | None = None,
    matrix_views: Any = None,
    qk_clip: Any = None,
    ns_backend: str = "standard",
    owner_groups: str | int = "off",
    experts: str = "auto",
    expert_policy: ExpertPolicy | None = None,
    ep: int | None = None,
    collectives: str = "auto",
    collective_latency_s: float | None = None,
    collective_bandwidth_Bps: float | None = None,
    collective_backend: str | None = None,
) -> ShardingPlan:
    """Plan DMuon for ``model`` on ``mesh`` (pure; no process group; meta models work).

    Args:
        model: any ``nn.Module`` on any device; only names/shapes/dtypes/module types are read.
        mesh: ``N`` | ``(N,)`` | ``(R, N)`` | an object with ``.shape`` (DeviceMesh).
        predicate: ``(fqn, param) -> bool`` selecting dedicated params by canonical FQN; None =
            every 2-D param inside a hook boundary that is not an embedding weight or a stacked
            bias, and every expert stack there (:mod:`dmuon.plan._model.expert_ranges`).
        reshard_after_forward: True = DMuon-Z3, False = DMuon-Z2.
        hook_boundary_predicate: ``(module) -> bool``; innermost matching ancestor is the
            boundary. None = FQN heuristic (:mod:`dmuon.plan._model.boundaries`).
        hook_boundary_strict: raise if a dedicated param has no boundary (else own-module fallback).
        replicate_async: recorded for the runtime (HSDP post-step broadcast overlap).
        mp_policy: object with ``.param_dtype`` / ``.reduce_dtype`` (torch dtypes, dtype strings
            or None), e.g. FSDP2's ``MixedPrecisionPolicy``: wire dtypes of broadcast/reduce.
        cost_model: ``"numel"`` (elements) or ``"ns_flops"`` (Newton-Schulz FLOPs) LPT weight.
        align_numel: alignment of every layout entry and flags region, in elements (>= 1).
        tp: tensor parallelism, a :class:`~dmuon.plan.TPPolicy`: its size and shard dims for a
            model that is not parallelised (else TP is read from the model's ``DTensor``
            parameters), how each TP-sharded matrix is orthogonalised (``ns``: ``"auto"`` /
            ``"gram"`` / ``"gather"``), and the Newton-Schulz steps and Gram restart period the
            TP cost and owner groups assume. None = ``TPPolicy()``.
        matrix_views: which blocks of dedicated matrices Muon orthogonalises separately
            (per-head q/k/v/o, split QKV): ``{fqn_pattern: MatrixView | rule}`` (fnmatch globs,
            first match wins) or ``(fqn, shape) -> MatrixView | None``; None = whole matrices.
            Helpers: :mod:`dmuon.plan._model.views` (``hf_llama_views``, ``gpt2_views``, ...). Under TP
            a view must cut the TP-sharded dim with whole blocks per shard (``ParamSpec.tp_ns == "local"``).
        qk_clip: QK-clip (MuonClip) settings, a :class:`dmuon.plan._records.qk_clip_records.QKClip` (threshold
            ``tau`` and the attention layers whose W_q / W_k rows are rescaled after each step);
            the plan's schedule and cost then include its one all-reduce (max) per step.
        ns_backend: the Newton-Schulz backend each (non-TP) matrix's owner will run, recorded
            in its ``ParamSpec.ns_backend``: ``"standard"`` (default: torch's iteration),
            ``"gram"`` (Gram NS everywhere) or ``"auto"`` (per matrix, Gram NS where its short
            side is at least ``GRAM_AUTO_MIN_SIDE`` = 256 and it needs fewer FLOPs with 5 steps
            and the default restarts, :func:`~dmuon.plan._rules.choose_ns_backend`: e.g. an MLP's
            ``(4d, d)`` / ``(d, 4d)`` weights from ``d = 256``, not square attention projections). ``cost_model="ns_flops"`` balances by
            those FLOPs; ``dmuon.Muon`` must then be built with the same ``ns_backend`` (it
            raises otherwise, naming the parameter).
        owner_groups: ``"off"`` (default: ONE owner rank per matrix), ``"auto"`` (the planner
            gives a matrix an owner group of ``k`` shard ranks of one replicate row only where
            exclusive owners cannot balance the mesh, e.g. more ranks than matrices:
            :func:`~dmuon.plan._ownership.partition.lpt_partition_groups`) or an int ``k`` (every matrix
            that can be cut gets ``min(k, N, long side)`` members; ``1`` = ``"off"``). A grouped
            matrix is cut along its long side into balanced blocks (``OwnerGroup``), each
            member holding, broadcasting and updating its block, and is orthogonalised by
            sharded Gram Newton-Schulz over the group (one fp32 ``(d, d)`` all-reduce per Gram
            segment of ``tp.ns_steps`` / ``tp.gram_restart_every``; ``dmuon.Muon``'s
            ``ns_steps`` must agree): the Gram form, not torch's iteration, for those matrices,
            which is why it is opt-in. Matrices with a TP shard, a matrix view, an expert stack
            or a conv kernel, and QK-clip's W_q / W_k, keep one owner.
        experts: ``"auto"`` (default): recognised 3-D expert stacks (HF fused ``gate_up_proj`` /
            ``down_proj``, gpt-oss's transposed interleaved layout, torchtitan's
            ``GroupedExperts`` ``w1``/``w2``/``w3``, any 3-D parameter under an ``experts``
            module) are selected by the default rule, each expert is ``E`` Muon matrices in
            ``nn.Linear`` orientation (:class:`~dmuon.plan._records.params.ExpertStack`), and a stack's
            experts get owners of contiguous ranges (:class:`ExpertOwners`). With one owner per
            matrix the ranges fill every rank to the same level (owned elements within one
            expert of the mean wherever the dense matrices allow; on HSDP meshes whole stacks and
            matrices are spread over the replicate rows first:
            :mod:`dmuon.plan._ownership.level_fill`); otherwise at most ``min(E, N)`` ranges of at
            most ``g`` experts (:func:`~dmuon.plan._model.expert_ranges.expert_range_count`).
            ``"off"``: the selection before expert support (2-D parameters only; a stack a
            predicate selects is one owned unit of ``E`` matrices ``shape[1:]``).
        ep: expert-parallel degree (docs/moe_ep.md). ``None`` (default): ``N`` when ``mesh`` is
            a 1-D ``DeviceMesh`` whose dim is named ``"ep"``, else 1. With ``ep > 1`` the model
            on each rank holds only its own ``E/ep`` experts of every expert stack, as plain
            tensors (EP groups: ``ep`` consecutive shard ranks), and routes tokens to them
            itself (``all_to_all``); the plan records the global stack ``(E, a, b)``
            (:attr:`ExpertStack.ep_size`, ``ParamSpec.local_shape`` the rank's experts) and each
            rank owns its own experts (:class:`ExpertOwners` with ``local=True``): no dmuon byte
            moves for them, when ``ep = N`` and ``R = 1``. With ``efsdp = N/ep > 1`` or HSDP
            replicas the ``efsdp`` ranks holding one EP coordinate's experts own them in
            contiguous ranges, broadcast and reduced over that efsdp group only
            (:attr:`~dmuon.plan._layout.buffer_layout.BufferLayout.ep`). Not with TP.
        expert_policy: the gate/up split of fused experts and the routers' optimizer, an
            :class:`~dmuon.plan.ExpertPolicy`; None = ``ExpertPolicy()`` (gate and up two Muon
            matrices, routers on Muon).
        collectives: the collective of every packed buffer (hook boundary x dtype), recorded in
            its :attr:`~dmuon.plan._layout.buffer_layout.BufferLayout.collective`, for the forward and
            backward parameter phases; the gradient phase pairs with it.
            ``"broadcast"``: one broadcast per owner segment, gradient one SUM-reduce per
            segment to its holder. ``"all_gather"``: every buffer whose group (replicate row, or
            efsdp group under EP) has >= 2 ranks is one all-gather of equal slots (each shard
            rank's segment padded to the largest, :mod:`dmuon.plan._layout.buffer_layout`) per group and
            phase, gradient one reduce-scatter (SUM) of the same slots. ``"auto"`` (default): per
            buffer, the all-gather where the alpha-beta rule
            (:func:`~dmuon.plan._cost.seconds.buffer_collective_s`: bytes with padding, per-call
            latency ``alpha``, bandwidth ``B``) prices it strictly below the broadcasts, and for
            a buffer holding expert stacks only when its slots pad it by at most
            :data:`~dmuon.plan._rules.ALL_GATHER_MAX_PADDING` (2 %). With ``"auto"`` /
            ``"all_gather"`` a boundary's expert ranges are re-placed for equal slots where that
            pays (:mod:`dmuon.plan._layout.slots`), and the other stacks are filled again around
            them. HSDP's replicate phases stay per sub-segment in every mode.
        collective_latency_s, collective_bandwidth_Bps: ``alpha`` (seconds per collective step)
            and ``B`` (bytes/s) of the ``"auto"`` rule, for every kind (the plan's link record is
            then ``"custom"``); None = the numbers of ``collective_backend``'s link record.
        collective_backend: the process-group backend whose link record
            (:data:`~dmuon.plan._rules.COLLECTIVE_LINKS`) the ``"auto"`` rule prices with:
            ``"nccl"`` (the h100 preset's inter-node link: alpha 8 us, B 45 GB/s for every kind)
            or ``"gloo"`` (measured on CPU and fitted: one alpha / B for broadcasts and reduces,
            one for all-gathers and reduce-scatters; how, in the record's comment). None
            (default): ``"nccl"``, since ``compile`` has no process group to read;
            ``dmuon.dedicate_params`` passes its process group's backend. Recorded in the plan
            (``plan.collectives.link``, JSON, fingerprint) and named by ``plan.summary()``.

    Returns:
        A validated, frozen :class:`ShardingPlan` whose nominal step schedule passed the
        deadlock replay (:meth:`~dmuon.plan._scheduling.step_schedule.StepSchedule.check`).

    Raises:
        TypeError: ``model`` is not an ``nn.Module``; ``tp`` / ``expert_policy`` of another
            type; a keyword this release removed (``tp_size=`` ... ``routers=``), naming its new
            form.
        ValueError: bad mesh / cost_model / align_numel; a selected param without a matrix
            view; a tied param across boundaries; a boundary-less param when strict; a
            selected ``DTensor`` that dmuon cannot own (not ``Shard(0)``/``Shard(1)`` on a 1-D
            mesh, uneven, not 2-D), TP degrees that differ, ``tp.shard_dims`` naming a
            parameter that is not dedicated or combined with a parallelised model.
    """
    tp = _policy(tp, TPPolicy, "tp")
    expert_policy = _policy(expert_policy, ExpertPolicy, "expert_policy")
    mesh_shape = normalize_mesh(mesh)
    ep = _ep_degree(mesh, mesh_shape, ep)
    collective_settings = collective_settings_for(
        collectives, collective_backend, collective_latency_s, collective_bandwidth_Bps
    )
    if cost_model not in _rules.COST_MODELS:
        raise ValueError(f"cost_model must be one of {_rules.COST_MODELS}, got {cost_model!r}")
    _rules.choose_ns_backend((1, 1), ns_backend)  # ValueError naming the known modes
    if isinstance(align_numel, bool) or not isinstance(align_numel, int) or align_numel < 1:
        raise ValueError(f"align_numel must be a positive int (elements), got {align_numel!r}")
    param_dtype, reduce_dtype = _mp_dtypes(mp_policy)
    snapshot = take_snapshot(model)
    selected = select_params(
        snapshot,
        predicate=predicate,
        hook_boundary_predicate=hook_boundary_predicate,
        hook_boundary_strict=hook_boundary_strict,
        experts=experts,
        expert_gate_up=expert_policy.gate_up,
        ep=ep,
        routers=expert_policy.routers,
    )
    if predicate is None:
        import warnings

        from dmuon.plan._model.selection import coverage_warning, unrecognised_stack_warning

        for message in (
            coverage_warning(snapshot, hook_boundary_predicate, experts),
            unrecognised_stack_warning(snapshot, hook_boundary_predicate) if experts == "auto" else None,
        ):
            if message is not None:
                # 3: the caller of compile, past refuse_removed_keywords' wrapper
                warnings.warn(message, UserWarning, stacklevel=3)
    specs = tuple(
        ParamSpec(
            fqn=s.record.fqn,
            shape=s.record.shape,
            dtype=s.record.dtype,
            numel=s.record.numel,
            matrix_shape=s.matrix_shape,
            num_matrices=s.num_matrices,
            aliases=s.record.aliases,
            module_fqn=s.record.module_fqn,
            attr=s.record.attr,
            experts=s.experts,
        )
        for s in selected
    )
    _check_expert_dtensors(selected)
    if ep > 1:
        specs = _ep_specs(snapshot, selected, specs, ep, expert_policy.gate_up)
    if matrix_views is not None:
        from dmuon.plan._model.views import resolve_views

        views = resolve_views(specs, matrix_views)
        specs = tuple(dataclasses.replace(spec, view=views[spec.fqn]) if spec.fqn in views else spec for spec in specs)
    T, specs = _tp_specs(snapshot, selected, specs, tp)
    if ep > 1 and T > 1:
        raise ValueError(
            f"dmuon.plan._compile: ep={ep} with tensor parallelism (T={T}) is not supported yet; use ep = N on a "
            "1-D data-parallel mesh without TP"
        )
    if qk_clip is not None:
        if not isinstance(qk_clip, QKClip):
            raise TypeError(
                f"qk_clip must be a dmuon.plan._records.qk_clip_records.QKClip, got {type(qk_clip).__name__}"
            )
        check_qk_clip(qk_clip, specs, snapshot.modules, {a: r for r in snapshot.params for a in r.aliases})
    if ns_backend != "standard":
        with_view = [spec.fqn for spec in specs if spec.view is not None]
        if with_view:
            raise ValueError(
                f"compile: ns_backend={ns_backend!r} with matrix views is not supported yet ({with_view[0]} has "
                f"a view; its blocks may differ in shape and so in the backend 'auto' would pick): use "
                f"ns_backend='standard' with matrix_views, or drop matrix_views"
            )
        specs = tuple(
            spec
            if spec.tp_size > 1
            else dataclasses.replace(spec, ns_backend=_rules.choose_ns_backend(spec.matrix_shape, ns_backend))
            for spec in specs
        )
    R, N = mesh_shape
    owners = assign_owners(
        specs,
        [s.boundary for s in selected],
        mesh_shape,
        cost_model,
        owner_groups,
        T,
        qk_clip,
        _rules.gram_segment_lengths(tp.ns_steps, tp.gram_restart_every),
    )
    fallback = {s.boundary: s.fallback for s in selected}
    used = set(fallback)
    boundary_order = [fqn for fqn in snapshot.module_fqns if fqn in used]

    def layout(owners):
        return build_boundaries(
            [
                (
                    spec.fqn,
                    spec.local_shape,
                    spec.local_numel,
                    spec.dtype,
                    owner,
                    s.boundary,
                    spec.ep_size if isinstance(owner, ExpertOwners) and not owner.local else 1,
                )
                for spec, owner, s in zip(specs, owners, selected)
            ],
            boundary_order,
            fallback,
            align_numel=align_numel,
        )

    def itemsizes(dtype: str) -> tuple[int, int]:
        wire = _rules.bcast_dtype(dtype, param_dtype)
        return itemsize_nbytes(wire), itemsize_nbytes(_rules.reduce_dtype(dtype, param_dtype, reduce_dtype))

    boundaries = layout(owners)
    z3 = bool(reshard_after_forward)
    placed = equal_slots(
        specs,
        owners,
        [s.boundary for s in selected],
        boundaries,
        collective_settings,
        mesh_shape=mesh_shape,
        align_numel=align_numel,
        itemsizes=itemsizes,
        reshard_after_forward=z3,
        cost_model=cost_model,
        segment_lengths=_rules.gram_segment_lengths(tp.ns_steps, tp.gram_restart_every),
        refill=fills_expert_ranges(specs, mesh_shape, owner_groups),
    )
    if placed != owners:
        owners, boundaries = placed, layout(placed)
    boundaries = assign_collectives(
        boundaries,
        collective_settings,
        num_shards=N,
        align_numel=align_numel,
        itemsizes=itemsizes,
        reshard_after_forward=z3,
    )
    plan = ShardingPlan(
        mesh_shape=mesh_shape,
        reshard_after_forward=bool(reshard_after_forward),
        replicate_async=bool(replicate_async),
        cost_model=cost_model,
        align_numel=align_numel,
        param_dtype=param_dtype,
        reduce_dtype=reduce_dtype,
        params=specs,
        owners=owners,
        boundaries=boundaries,
        model_digest=snapshot.digest,
        tp_size=T,
        tp_ns_steps=tp.ns_steps,
        tp_gram_restart_every=tp.gram_restart_every,
        fsdp2_units=_fsdp2_units(snapshot, {s.record.fqn for s in selected}, hook_boundary_predicate),
        qk_clip=qk_clip,
        collectives=collective_settings,
    )
    plan.schedule().check()  # the nominal step replays without deadlock on every rank
    return plan


def _ep_degree(mesh: Any, mesh_shape: tuple[int, int], ep: int | None) -> int:
    """The expert-parallel degree: ``ep``, or ``N`` for a 1-D mesh named ``("ep",)``; ``ep``
    must divide the ``N`` shard ranks (``efsdp = N/ep``)."""
    R, N = mesh_shape
    names = tuple(getattr(mesh, "mesh_dim_names", None) or ()) if hasattr(mesh, "shape") else ()
    if names == ("ep",):
        if ep is not None and ep != N:
            raise ValueError(
                f"dmuon.plan._compile: the mesh's only dim is named 'ep' (expert parallelism over its {N} ranks) "
                f"but ep={ep!r}; drop ep= or pass ep={N}"
            )
        ep = N
    if ep is None:
        return 1
    if isinstance(ep, bool) or not isinstance(ep, int) or ep < 1:
        raise ValueError(f"dmuon.plan._compile: ep (the expert-parallel degree) must be an int >= 1, got {ep!r}")
    if ep == 1:
        return 1
    if N % ep:
        raise ValueError(
            f"dmuon.plan._compile: ep={ep} does not divide the {N} shard ranks (EP groups are ep consecutive "
            f"shard ranks, efsdp = N/ep of them hold the same experts); use a divisor of {N}"
        )
    return ep


def _check_expert_dtensors(selected) -> None:
    """A recognised expert stack given as a ``DTensor`` (expert parallelism by ``Shard(0)``) is
    refused: dmuon's expert parallelism wants each rank's experts as a plain tensor."""
    bad = [s.record.fqn for s in selected if s.experts is not None and s.record.tp_size > 1]
    if bad:
        raise ValueError(
            f"dmuon.plan._compile: expert stack {bad[0]!r}"
            + (f" (and {len(bad) - 1} more)" if len(bad) > 1 else "")
            + " is a DTensor (expert parallelism by Shard(0) over a device mesh?); dmuon does not own DTensor "
            "expert stacks. Hold each rank's local experts as a plain tensor (E/ep, a, b), route tokens with "
            "all_to_all, and pass ep= (dmuon.plan.compile / dmuon.dedicate_params), see docs/moe_ep.md"
        )


def _ep_specs(snapshot, selected, specs, ep: int, gate_up: str):
    """The specs of an expert-parallel model: every expert stack at its global logical shape
    ``(ep * E_local, a, b)`` with :attr:`ExpertStack.ep_size` ``= ep``.

    Raises:
        ValueError: no expert stack; a dedicated 3-D parameter that is not a recognised stack; a
            recognised stack that is not dedicated (FSDP2 would average ranks' different experts).
    """
    from dmuon.plan._model.selection import record_stack

    chosen = {s.record.fqn for s in selected}
    unrecognised = [s.record.fqn for s in selected if s.experts is None and len(s.record.shape) == 3]
    if unrecognised:
        raise ValueError(
            f"dmuon.plan._compile: ep={ep}, but the dedicated 3-D parameter {unrecognised[0]!r} is not a recognised "
            "expert stack (dmuon.plan._model.expert_ranges: HF fused, gpt-oss, torchtitan GroupedExperts w1/w2/w3, or a 3-D "
            "parameter under an 'experts' module); expert parallelism needs every stack recognised (experts='auto')"
        )
    left = [
        r.fqn
        for r in snapshot.params
        if r.fqn not in chosen and r.ndim == 3 and record_stack(snapshot, r, gate_up) is not None
    ]
    if left:
        raise ValueError(
            f"dmuon.plan._compile: ep={ep}, but the expert stack {left[0]!r} is not dedicated (predicate / "
            "experts='off'); under expert parallelism each rank holds different experts, which FSDP2 must not "
            "average: dedicate every expert stack"
        )
    if not any(spec.experts is not None for spec in specs):
        raise ValueError(
            f"dmuon.plan._compile: ep={ep} but the model has no expert stack (dmuon.plan._model.expert_ranges)"
        )
    out = []
    for spec in specs:
        if spec.experts is not None:
            stack = dataclasses.replace(spec.experts, num_experts=spec.experts.num_experts * ep, ep_size=ep)
            shape = (spec.shape[0] * ep,) + tuple(spec.shape[1:])
            spec = dataclasses.replace(
                spec, shape=shape, numel=spec.numel * ep, num_matrices=spec.num_matrices * ep, experts=stack
            )
        out.append(spec)
    return tuple(out)


def _fsdp2_units(snapshot, dedicated: set[str], hook_boundary_predicate) -> tuple[Fsdp2Unit, ...]:
    """The non-dedicated parameters per ``fully_shard`` unit (:class:`Fsdp2Unit`): each one's
    hook boundary (the same resolution as for dedicated parameters), else the root; units in
    ``named_modules()`` order of their module, the root last."""
    resolver = BoundaryResolver(snapshot.modules, hook_boundary_predicate)
    order = snapshot.module_order()
    by_unit: dict[str, list] = {}
    for record in snapshot.params:
        if record.fqn in dedicated:
            continue
        res = resolver.resolve(record)
        unit = res.boundary if res.boundary is not None and not res.conflict else ""
        shape = record.shape
        if record.tp_size > 1 and record.tp_shard_dim is not None:
            d = record.tp_shard_dim
            shape = shape[:d] + (-(-shape[d] // record.tp_size),) + shape[d + 1 :]
        by_unit.setdefault(unit, []).append((record.fqn, shape, record.dtype, bool(record.tensor.requires_grad)))
    units = sorted((u for u in by_unit if u), key=lambda u: order.get(u, len(order)))
    if "" in by_unit:
        units.append("")
    return tuple(
        Fsdp2Unit(
            fqn=u,
            params=tuple(p[0] for p in by_unit[u]),
            shapes=tuple(p[1] for p in by_unit[u]),
            dtypes=tuple(p[2] for p in by_unit[u]),
            requires_grad=tuple(p[3] for p in by_unit[u]),
        )
        for u in units
    )


def _policy(value, cls, keyword: str):
    """``value`` (a ``cls``), or ``cls()`` for None; TypeError for another type."""
    if value is None:
        return cls()
    if not isinstance(value, cls):
        raise TypeError(f"dmuon.plan.compile: {keyword}= takes a dmuon.plan.{cls.__name__}, got {type(value).__name__}")
    return value


def _tp_specs(snapshot, selected, specs, tp: TPPolicy):
    """``(T, specs)`` with the TP fields filled in (see :class:`TPPolicy`)."""
    dims: dict[str, int] = {}
    sizes: dict[str, int] = {}
    problems: list[str] = []
    if tp.shard_dims is not None or tp.size is not None:
        parallel = [r.fqn for r in snapshot.params if r.tp_size > 1]
        if parallel:
            raise ValueError(
                f"dmuon.plan._compile: TPPolicy(size=, shard_dims=) describe TP for a model that is not "
                f"parallelised, but {parallel[:3]} are already DTensors; drop them "
                "(TP is read from the model)"
            )
        names = {s.record.fqn: s.record.fqn for s in selected}
        names.update({a: s.record.fqn for s in selected for a in s.record.aliases})
        for fqn, dim in dict(tp.shard_dims or {}).items():
            if fqn not in names:
                raise ValueError(
                    f"dmuon.plan._compile: TPPolicy.shard_dims names {fqn!r}, which is not a dedicated parameter"
                )
            dims[names[fqn]] = dim
            sizes[names[fqn]] = tp.size
    else:
        for sel in selected:
            r = sel.record
            if r.tp_size == 1:
                continue
            if r.tp_unsupported:
                problems.append(f"  {r.fqn}: {r.tp_unsupported}")
            elif r.tp_shard_dim is None:
                problems.append(f"  {r.fqn}: replicated over the TP mesh (Replicate()); dmuon owns TP-sharded matrices")
            else:
                dims[r.fqn] = r.tp_shard_dim
                sizes[r.fqn] = r.tp_size
    for spec in specs:
        if spec.fqn in dims:
            d = dims[spec.fqn]
            if spec.num_matrices != 1 or len(spec.shape) != 2:
                problems.append(f"  {spec.fqn}: TP-sharded but {len(spec.shape)}-D {spec.shape}; only 2-D matrices")
            elif spec.shape[d] % sizes[spec.fqn]:
                problems.append(
                    f"  {spec.fqn}: dim {d} of {spec.shape} is not divisible by the TP degree {sizes[spec.fqn]}"
                )
    if problems:
        raise ValueError(
            "dmuon.plan._compile: selected tensor-parallel parameters dmuon cannot own:\n"
            + "\n".join(problems)
            + "\nFix: exclude them in predicate (they stay with FSDP2 and AdamW), or shard them with "
            "ColwiseParallel/RowwiseParallel (Shard(0)/Shard(1) on a 1-D TP mesh, evenly)."
        )
    degrees = sorted(set(sizes.values()) - {1})
    if len(degrees) > 1:
        raise ValueError(f"dmuon.plan._compile: dedicated matrices use different TP degrees {degrees}; use one TP mesh")
    T = degrees[0] if degrees else 1
    if T == 1:
        return 1, specs
    segments = len(_rules.gram_segment_lengths(tp.ns_steps, tp.gram_restart_every))
    out = []
    view_problems = []
    for spec in specs:
        if spec.fqn in dims:
            spec = dataclasses.replace(spec, tp_size=T, tp_shard_dim=dims[spec.fqn], tp_ns="gather")
            if spec.view is not None and spec.view_tp_problem() is not None:
                view_problems.append(f"  {spec.fqn}: {spec.view_tp_problem()}")
                continue
            spec = dataclasses.replace(spec, tp_ns=_rules.choose_tp_ns(spec, tp.ns, segments))
        out.append(spec)
    if view_problems:
        raise ValueError(
            "dmuon.plan._compile: matrix views that tensor parallelism splits:\n"
            + "\n".join(view_problems)
            + "\nA view works under TP when it cuts the dim TP shards and every TP shard holds whole blocks "
            "(per-head q/k/v with colwise TP, per-head o_proj with rowwise TP, heads divisible by the TP degree); "
            "drop the view for these matrices (matrix_views) or shard them so."
        )
    return T, tuple(out)


def collective_settings_for(
    mode: str,
    backend: str | None,
    latency_s: float | None = None,
    bandwidth_Bps: float | None = None,
) -> CollectiveSettings:
    """The plan's :class:`CollectiveSettings` for ``compile(collectives=mode,
    collective_backend=backend, collective_latency_s=..., collective_bandwidth_Bps=...)``: the
    link record of ``backend`` (None: ``"nccl"``), or, where the caller gives a number, those
    numbers for every kind (link ``"custom"``; the one not given from the record)."""
    link = _rules.collective_link("nccl" if backend is None else backend)
    if latency_s is None and bandwidth_Bps is None:
        same = (link.all_gather_latency_s, link.all_gather_bandwidth_Bps) == (link.latency_s, link.bandwidth_Bps)
        return CollectiveSettings(
            mode=mode,
            latency_s=link.latency_s,
            bandwidth_Bps=link.bandwidth_Bps,
            all_gather_latency_s=None if same else link.all_gather_latency_s,
            all_gather_bandwidth_Bps=None if same else link.all_gather_bandwidth_Bps,
            link=link.name,
        )
    return CollectiveSettings(
        mode=mode,
        latency_s=link.latency_s if latency_s is None else latency_s,
        bandwidth_Bps=link.bandwidth_Bps if bandwidth_Bps is None else bandwidth_Bps,
        link="custom",
    )
