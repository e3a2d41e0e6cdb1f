"""``dmuon.exec.apply`` and ``dmuon.dedicate_params``: bind a plan to a model and a mesh."""

from __future__ import annotations

import dataclasses
import warnings

import torch
import torch.distributed as dist
import torch.nn as nn

from dmuon import _registry
from dmuon import _tags
from dmuon._dtensor import is_dtensor

from dmuon.exec._state import model_state
from dmuon.exec._setup import guards
from dmuon.exec._setup import host_offload
from dmuon.exec._setup import materialize
from dmuon.exec._comm.collective_calls import DEFAULT_TIMEOUT_S
from dmuon.exec._comm.groups import MeshGroups, mesh_rank_table, mesh_tp_ranks
from dmuon.plan._records.policies import refuse_removed_keywords
from dmuon.exec._runtime.runtime import DmuonRuntime, get_model_runtime, record_bare_stage

__all__ = ["apply", "dedicate_params"]


def _table_shape(table) -> tuple[int, int]:
    return (len(table), len(table[0]))


def _device_of(model: nn.Module, plan) -> torch.device:
    for spec in plan.params:
        p = model.get_parameter(spec.fqn)
        return p.device
    return torch.device("cpu")


def _validate(plan, model: nn.Module, table) -> None:
    """Local checks, before any collective: every rank raises the same error on the same input."""
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "dmuon.exec.apply needs an initialised default process group: call "
            "torch.distributed.init_process_group(...) first (use world size 1 for a single process)"
        )
    _check_not_applied(model)  # first: a dedicated model that was then fully_shard-ed is not "sharded first"
    guards.check_not_fully_sharded(model)
    shape = _table_shape(table)
    if tuple(plan.mesh_shape) != shape:
        raise ValueError(
            f"dmuon: the plan was compiled for mesh {tuple(plan.mesh_shape)} (R, N) but the mesh is "
            f"{shape}; compile with the same mesh (dmuon.plan.compile(model, mesh))"
        )
    from dmuon.plan._model import snapshot as _snapshot

    digest = _snapshot.take_snapshot(model).digest
    if digest != plan.model_digest:
        raise ValueError(
            "dmuon: the model differs from the one the plan was compiled for (parameter names, "
            "shapes, dtypes or ties changed after planning); recompile the plan with "
            "dmuon.plan.compile(model, mesh) after the last change to the model"
        )
    devices = {str(model.get_parameter(spec.fqn).device) for spec in plan.params}
    if len(devices) > 1:
        raise ValueError(
            f"dmuon: the dedicated parameters are on several devices {sorted(devices)}; apply dmuon to "
            "a model on one device, or on the meta device (then model.to_empty(device=...))"
        )


def _check_tp(plan, model: nn.Module, table, mesh_tp: tuple[int, ...] | None = None):
    """Tensor parallelism: the TP ``DeviceMesh`` shared by the TP-sharded dedicated matrices
    (None without TP), after local checks: one 1-D mesh of ``plan.tp_size`` ranks, and a
    data-parallel mesh that with it spans the world. ``mesh_tp``: this rank's line along the TP
    dim of the mesh passed to dmuon (a 3-D or named ``("dp", "tp")`` mesh), which must be the
    matrices' TP mesh."""
    if plan.tp_size == 1:
        return None
    meshes = {}
    for spec in plan.params:
        if spec.tp_size > 1:
            p = model.get_parameter(spec.fqn)
            m = p.device_mesh if is_dtensor(p) else None
            if m is None:
                raise ValueError(
                    f"dmuon: the plan says {spec.fqn!r} is TP-sharded but the model's parameter is a plain "
                    "tensor; call parallelize_module before dedicate_params / apply"
                )
            meshes.setdefault(tuple(m.mesh.flatten().tolist()), m)
    if len(meshes) != 1:
        raise ValueError(
            f"dmuon: the TP-sharded dedicated matrices live on {len(meshes)} different TP meshes "
            f"{sorted(meshes)}; use one TP mesh"
        )
    tp_mesh = next(iter(meshes.values()))
    if mesh_tp is not None and tuple(int(x) for x in tp_mesh.mesh.flatten().tolist()) != mesh_tp:
        raise ValueError(
            f"dmuon: the TP dim of the mesh passed to dmuon joins ranks {list(mesh_tp)} but the dedicated "
            f"matrices are TP-sharded over ranks {tp_mesh.mesh.flatten().tolist()}; parallelize_module with "
            "mesh['tp'] of the same mesh (or pass tp_dim= naming the TP dim)"
        )
    dp = sum(len(row) for row in table)
    world = dist.get_world_size()
    if dp * plan.tp_size != world:
        raise ValueError(
            f"dmuon: with tensor parallelism the data-parallel mesh times the TP degree must span the "
            f"world: the mesh passed has {dp} ranks, times TP degree {plan.tp_size} is {dp * plan.tp_size}, "
            f"but the world has {world}. Pass the data-parallel DeviceMesh (mesh['dp'] of "
            "init_device_mesh('cpu', (dp, tp), mesh_dim_names=('dp', 'tp'))) or the whole named mesh, "
            "whose TP dim dmuon finds by name (tp_dim=); None means the whole world"
        )
    return tp_mesh


def _exchange(plan, table, tp_mesh, owner_groups, tie_sides=()) -> list:
    """One ``all_gather_object`` over the world: every rank's ``(TP coordinate or None, its
    data-parallel rank table, its plan's fingerprint, its plan's owner-group member sets, the
    sides of a declared embedding tie its pipeline stage holds alone)``, in global rank order.
    The same list on every rank, so every decision taken from it (which ranks must hold the same
    plan, which groups to create, a tie split across stages) is the same on every rank."""
    mine = (
        int(tp_mesh.get_local_rank()) if tp_mesh is not None else None,
        tuple(tuple(int(x) for x in row) for row in table),
        plan.fingerprint(),
        tuple(owner_groups),
        tuple(tie_sides),
    )
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return everyone


def _world_tables(everyone, tp_mesh=None):
    """Every data-parallel rank table of the world (from :func:`_exchange`) with its owner-group
    member sets: with ``tp_mesh``, one per TP coordinate in TP order (ranks of a coordinate must
    agree, every coordinate must appear); without, the distinct sub-meshes (e.g. one per
    pipeline stage) in order of their smallest rank. They must not overlap."""
    tables: dict[int, tuple] = {}
    owner_sets: dict[int, tuple] = {}
    for t, tab, _, owners, *_ in everyone:
        key = t if tp_mesh is not None else min(min(row) for row in tab)
        if tables.setdefault(key, tab) != tab:
            what = (
                f"ranks of TP coordinate {t} passed different"
                if tp_mesh is not None
                else "the ranks passed overlapping"
            )
            raise ValueError(f"dmuon: {what} data-parallel meshes")
        owner_sets.setdefault(key, owners)
    if tp_mesh is not None and sorted(tables) != list(range(tp_mesh.size())):
        raise ValueError(f"dmuon: TP coordinates {sorted(tables)} do not cover 0..{tp_mesh.size() - 1}")
    ordered = tuple(tables[k] for k in sorted(tables))
    flat = [x for tab in ordered for row in tab for x in row]
    if len(set(flat)) != len(flat):
        raise ValueError(f"dmuon: the data-parallel meshes of different ranks overlap: {ordered}")
    return ordered, tuple(owner_sets[k] for k in sorted(tables))


def _check_not_applied(model: nn.Module) -> None:
    """A second ``dedicate_params`` / ``apply`` on a model that already has a dmuon runtime
    (also after ``fully_shard``, which would otherwise read as "sharded before dedication")."""
    found = next(
        ((n, get_model_runtime(m)) for n, m in model.named_modules() if get_model_runtime(m) is not None), None
    )
    if found is None:
        return
    from torch.distributed.fsdp import FSDPModule

    where, runtime = found
    plan = runtime.plan
    sharded = any(isinstance(m, FSDPModule) for m in model.modules())
    R, N = tuple(plan.mesh_shape)
    what = (
        f"plan {plan.fingerprint()[:12]}: mesh (R={R}, N={N}), {len(plan.dedicated)} dedicated "
        f"parameter{'s' if len(plan.dedicated) != 1 else ''}{f', on submodule {where!r}' if where else ''}"
    )
    nxt = (
        "it was also fully_shard-ed since, so the set-up is complete: build dmuon.Muon(model, ...) next"
        if sharded
        else "continue with fully_shard(block) for each block -> fully_shard(model) -> dmuon.Muon(model, ...)"
    )
    raise ValueError(
        f"dmuon: this model was already dedicated by dmuon.dedicate_params / dmuon.exec.apply ({what}); "
        f"a second call is not needed (one call per model; dmuon.exec.get_model_runtime(model).plan is that plan): {nxt}. "
        "To change the plan, build the model again and dedicate it once"
    )


#: per-parameter lines of the plan difference shown when ranks hold different plans
PLAN_DIFF_LINES = 5


def _check_same_plan_everywhere(plan, everyone, *, per_table: bool) -> None:
    """The ranks that hold the same model must hold the same plan: the whole world, or with
    ``per_table`` (independent data-parallel sub-meshes, e.g. one per pipeline stage, which hold
    different models by design) the ranks of each data-parallel table. ``everyone``: the
    fingerprints of :func:`_exchange`. Only when some set differs, a second ``all_gather_object``
    (on every rank: the decision is taken from the same list everywhere) exchanges the plans'
    JSON so that every rank raises the same error naming the first set that differs and what
    differs between its first rank's plan and its first differing rank's."""
    sets: dict = {}
    for rank, (_, tab, fingerprint, *_) in enumerate(everyone):
        key = tuple(sorted(x for row in tab for x in row)) if per_table else ()
        sets.setdefault(key, []).append((rank, fingerprint))
    bad_set = next(((key, members) for key, members in sets.items() if len({f for _, f in members}) > 1), None)
    if bad_set is None:
        return
    key, members = bad_set
    first, fp0 = members[0]
    bad = [r for r, f in members if f != fp0]
    plans: list = [None] * dist.get_world_size()
    dist.all_gather_object(plans, plan.to_json())
    who = f"the ranks {list(key)} of one data-parallel mesh (one pipeline stage)" if per_table else "ranks"
    raise RuntimeError(
        f"dmuon: {who} hold different plans (fingerprint of rank {first}: {fp0[:12]}, "
        f"differing ranks: {bad}; rank {bad[0]}: {everyone[bad[0]][2][:12]}).\n"
        f"{_plan_difference(plans[first], plans[bad[0]], bad[0], first)}\n"
        "Compile the plan identically on every rank of the mesh (same model definition, mesh and arguments), "
        "or compile once and broadcast its JSON"
    )


def _check_ep_stacks_differ(plan, model: nn.Module, table) -> None:
    """Expert parallelism: the ranks of an EP group must hold different experts.

    Shapes cannot tell an EP model from one that holds every expert on every rank when the
    model shows no expert count (a router named ``gate`` / ``router`` or a ``num_experts``
    attribute): ``E/ep`` local experts look like ``E``. So each rank sends a digest of its
    stacks (sum and sum of squares, float64) in one ``all_gather_object``; when every EP group
    holds identical stacks on all its ranks, every rank warns the same ``UserWarning``. Not on
    the meta device (nothing to compare before ``to_empty``)."""
    if plan.ep_size <= 1:
        return
    modules = dict(model.named_modules(remove_duplicate=False))
    digest = []
    for spec in plan.params:
        if spec.experts is None:
            continue
        p = modules[spec.module_fqn]._parameters[spec.attr]
        if p is None or p.is_meta:
            digest = None
            break
        with torch.no_grad():
            x = p.detach().to(torch.float64)
            digest.append((spec.fqn, float(x.sum()), float(x.square().sum())))
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, digest)
    ep = plan.ep_size
    groups = [row[g : g + ep] for row in table for g in range(0, len(row), ep)]
    if any(everyone[x] is None for group in groups for x in group):
        return
    if all(all(everyone[x] == everyone[group[0]] for x in group) for group in groups):
        fqn = everyone[groups[0][0]][0][0]
        warnings.warn(
            f"dmuon.dedicate_params: ep={ep}, but the ranks of every EP group hold identical expert stacks (e.g. "
            f"{fqn!r}): under expert parallelism rank j of an EP group holds its own experts j*E/ep .. (j+1)*E/ep-1. "
            "If the model holds every expert on every rank, drop ep=; if its initialisation draws the same values "
            "on every rank, give each rank its slice of one full initialisation (docs/moe_ep.md)",
            UserWarning,
            stacklevel=3,
        )


def _plan_difference(json_a: str, json_b: str, rank_b: int, rank_a: int = 0) -> str:
    """What differs from rank ``rank_a``'s plan to rank ``rank_b``'s: the first differing dedicated
    parameter and the likely cause (:func:`dmuon.plan._tools.plan_mismatch.mismatch_lines`), then
    ``dmuon.plan.diff``'s first lines."""
    from dmuon.plan import ShardingPlan
    from dmuon.plan._tools.diff import diff

    from dmuon.plan._tools.plan_mismatch import mismatch_lines

    try:
        a, b = ShardingPlan.from_json(json_a), ShardingPlan.from_json(json_b)
        first = "\n".join(mismatch_lines(a, b, rank_a, rank_b)) + "\n"
        d = diff(a, b)
    except Exception as exc:  # noqa: BLE001 - the report must not hide the real error
        return f"(the plans could not be compared: {type(exc).__name__}: {exc})"
    if d.empty:
        return first + (
            "dmuon.plan.diff finds no difference in parameters, owners, boundaries or settings: "
            "compare the ranks' plan.to_json()"
        )
    # the most telling differences first: parameters dedicated on one rank only, then boundary or
    # shape changes, then owners that moved (a consequence of the others)
    rank_of = lambda c: (c.kind == "changed", not (c.boundary_changed or c.spec_changed))  # noqa: E731
    d = dataclasses.replace(d, changes=tuple(sorted(d.changes, key=rank_of)))
    lines = d.render(max_lines=PLAN_DIFF_LINES).splitlines()
    cut = next((i for i, line in enumerate(lines) if line.lstrip().startswith("bytes per step")), len(lines))
    return first + f"dmuon.plan.diff(plan of rank {rank_a}, plan of rank {rank_b}):\n" + "\n".join(lines[:cut])


def apply(
    plan,
    model: nn.Module,
    mesh=None,
    *,
    collective_timeout_s: float | None = DEFAULT_TIMEOUT_S,
    shard_dim: str | None = None,
    replicate_dim: str | None = None,
    tp_dim: str | None = None,
    pipeline: bool | None = None,
    offload_policy=None,
) -> DmuonRuntime:
    """Install owners, placeholders and hooks for ``plan`` on ``model`` (every rank calls it).

    Args:
        plan: a :class:`dmuon.plan.ShardingPlan` compiled for this model and mesh shape.
        model: the full model, identical on every rank (as before ``fully_shard``), either
            materialised or on the ``meta`` device: then nothing is allocated until
            ``model.to_empty(device=...)``, which gives each holder its own segments only
            (see :mod:`dmuon.exec._setup.materialize` and docs/checkpointing.md).
        mesh: a ``DeviceMesh`` whose data-parallel dims have the plan's shape (1-D: shard; 2-D:
            ``(replicate, shard)`` or a named ``("dp", "tp")``; 3-D: named, e.g. torchtitan's
            unsliced ``("dp_replicate", "dp_shard", "tp")``), an int ``N``, ``(N,)`` or
            ``(R, N)`` spanning the world, or ``None`` = a 1-D mesh over the world.
        shard_dim, replicate_dim, tp_dim: the names of the mesh's dims when they are not among
            :data:`dmuon.plan.MESH_DIM_NAMES` (see :func:`dmuon.plan.mesh_dim_roles`).
        pipeline: ``model`` is one pipeline stage (:func:`dedicate_params`); ``None``: when
            ``mesh`` is a sub-mesh of a ``DeviceMesh`` with a dim named ``"pp"``.
        offload_policy: FSDP2's ``CPUOffloadPolicy(...)``, the one given to every ``fully_shard``
            call: every segment this rank holds keeps its master, and every owned matrix its Muon
            momentum, in host memory; each matrix is copied to the compute device (the mesh's)
            for its update and each broadcast sends a compute-device copy
            (:mod:`dmuon.exec._setup.host_offload`). ``None`` (default) or ``OffloadPolicy()``:
            no offload. ``dmuon.Muon``'s first step checks that ``fully_shard`` got the same
            policy. Not with TP-sharded or owner-grouped matrices.
        collective_timeout_s: a dmuon wait not complete within this many seconds raises
            :class:`~dmuon.exec._comm.collective_calls.CollectiveTimeout` naming the boundary and phase
            (default :data:`~dmuon.exec._comm.collective_calls.DEFAULT_TIMEOUT_S`, 600 s; ``None``: no
            dmuon timeout, the process group's own applies). Enforced where the wait blocks the
            CPU anyway: gloo, or NCCL with ``TORCH_NCCL_BLOCKING_WAIT=1``; on NCCL's default
            non-blocking wait the process group's watchdog and its timeout handle a hang. The
            two timeouts run side by side: whichever is shorter fires first (gloo's default
            process-group timeout is 30 min, so dmuon's fires first); either way the error is a
            ``CollectiveTimeout`` naming the boundary, and a peer that exits or closes its
            connection raises :class:`~dmuon.exec._comm.collective_calls.CollectiveTransportError` at
            once (docs/troubleshooting.md, "Collective failures").

    Returns:
        the :class:`~dmuon.exec._runtime.runtime.DmuonRuntime` (also ``dmuon.exec.get_model_runtime(model)``).

    Raises:
        TypeError: ``plan`` is not a ``ShardingPlan`` (e.g. the path of its JSON).
        RuntimeError: no process group; ranks hold different plans.
        ValueError: the model is already wrapped by ``fully_shard``; the plan was compiled for
            another mesh shape or another model (changed after planning); applied twice.
        ValueError: dedicated parameters on more than one device.
        TypeError / NotImplementedError: an ``offload_policy`` that is not FSDP2's, or offload with
            TP-sharded or owner-grouped matrices.

    Collectives: one ``all_gather_object`` (plan fingerprints; a second of the expert stacks'
    digests under expert parallelism), then ``new_group`` calls; all local validation happens
    before them.
    """
    from dmuon.plan._records.plan import ShardingPlan

    if not isinstance(plan, ShardingPlan):  # local: every rank raises alike, before any collective
        raise TypeError(
            f"dmuon.exec.apply: plan must be a dmuon.plan.ShardingPlan, got {type(plan).__name__} {plan!r:.80}"
            + (" (a JSON file: dmuon.plan.ShardingPlan.from_json(open(path).read()))" if isinstance(plan, str) else "")
        )
    _registry.install_stage(
        "dedicate"
    )  # the fully_shard skip, GradScaler, DCP, guards, frameworks (not with DMUON_NO_PATCHES)
    if not (dist.is_available() and dist.is_initialized()):
        _validate(plan, model, None)  # raises the "no process group" error
    dims = dict(shard_dim=shard_dim, replicate_dim=replicate_dim, tp_dim=tp_dim)
    _check_not_whole_pipeline_mesh(mesh)
    table = mesh_rank_table(mesh, **dims)
    _validate(plan, model, table)
    offload = host_offload.resolve(offload_policy, mesh, model)
    if offload is not None:
        _check_offloadable(plan)
    tp_mesh = _check_tp(plan, model, table, mesh_tp_ranks(mesh, **dims))
    pipeline = is_pipeline_mesh(mesh) if pipeline is None else bool(pipeline)
    if pipeline and tp_mesh is not None:  # local: every rank raises alike, before any collective
        raise NotImplementedError(
            "dmuon: pipeline parallelism together with tensor parallelism is not supported yet: "
            "dedicate the stages on a (pp, dp) or (pp, replicate, shard) mesh without TP (docs/pipeline_parallel.md)"
        )
    owner_groups = owner_group_member_sets(plan)
    sub_mesh = tp_mesh is None and sum(len(row) for row in table) < dist.get_world_size()
    tie_sides = guards.embedding_tie_sides(model) if pipeline else ()
    everyone = _exchange(plan, table, tp_mesh, owner_groups, tie_sides)
    _check_same_plan_everywhere(plan, everyone, per_table=sub_mesh)
    guards.check_no_cross_stage_tie(
        [(tuple(sorted(x for row in entry[1] for x in row)), entry[4]) for entry in everyone]
    )
    _check_ep_stacks_differ(plan, model, table)
    if tp_mesh is not None:
        groups = MeshGroups.build(table, tp_tables=_world_tables(everyone, tp_mesh)[0])
    elif sub_mesh:
        # a data-parallel sub-mesh (e.g. mesh["dp"] of a ("pp", "dp") mesh: one pipeline stage):
        # every rank must create every sub-mesh's groups in the same order, so it learns the
        # other sub-meshes' tables and owner groups (their plans differ) from the exchange
        tables, owner_sets = _world_tables(everyone)
        groups = MeshGroups.build(table, peer_tables=tables, peer_owner_groups=owner_sets)
    else:
        groups = MeshGroups.build(table, owner_groups=owner_groups)
    runtime = DmuonRuntime(plan, model, groups, _device_of(model, plan), timeout_s=collective_timeout_s)
    runtime.pipelined = pipeline
    runtime.offload = offload
    if not plan.dedicated:  # a stage with nothing to dedicate still joins the clip's collectives
        record_bare_stage(runtime)
    _tags.write(model, _tags.RUNTIME, runtime)
    model_state.register_state_dict_hooks(runtime)
    materialize.install(runtime, model)
    if offload is not None:  # held masters to the host, broadcast buffers to the compute device
        materialize.rebind_storage(runtime)
    return runtime


def _check_offloadable(plan) -> None:
    """Offload (``offload_policy=CPUOffloadPolicy(...)``) supports matrices with one owner each:
    refuse TP-sharded and owner-grouped ones (local: every rank raises alike, before any collective;
    the rule: :func:`dmuon.plan._cost.rank_memory.check_offloadable`, which the memory terms share)."""
    from dmuon.plan._cost.rank_memory import check_offloadable

    check_offloadable(plan)


#: the dim name of the pipeline-parallel dim of a ``DeviceMesh`` (torchtitan's)
PIPELINE_DIM_NAME = "pp"


def _check_not_whole_pipeline_mesh(mesh) -> None:
    """A ``DeviceMesh`` that itself has a ``"pp"`` dim: dmuon takes the stage's data-parallel
    sub-mesh, never the pipeline dim (local: every rank raises alike)."""
    names = tuple(getattr(mesh, "mesh_dim_names", None) or ()) if hasattr(mesh, "mesh") else ()
    if PIPELINE_DIM_NAME in names:
        dp = tuple(n for n in names if n != PIPELINE_DIM_NAME)
        raise ValueError(
            f"dmuon: the mesh passed has the pipeline dim {PIPELINE_DIM_NAME!r} (dims {names}); pass the stage's "
            f"data-parallel mesh instead, mesh[{dp[0]!r}]"
            + (f" or mesh[{dp!r}]" if len(dp) > 1 else "")
            + ", once per stage this rank holds (docs/pipeline_parallel.md)"
        )


def is_pipeline_mesh(mesh) -> bool:
    """Whether ``mesh`` is a sub-mesh (e.g. ``mesh["dp"]``) of a ``DeviceMesh`` with a dim named
    :data:`PIPELINE_DIM_NAME` (``init_device_mesh(..., mesh_dim_names=("pp", "dp"))``): the
    model it is passed with is one pipeline stage."""
    root_of = getattr(mesh, "_get_root_mesh", None)
    if root_of is None:
        return False
    root = root_of()
    names = tuple(getattr(root, "mesh_dim_names", None) or ())
    return PIPELINE_DIM_NAME in names and root is not mesh


def owner_group_member_sets(plan) -> tuple[tuple[int, ...], ...]:
    """The distinct member sets (sorted mesh ranks) of the plan's owner groups, plan order."""
    from dmuon.plan._records.owners import OwnerGroup

    seen: dict[tuple[int, ...], None] = {}
    for owner in plan.owners:
        if isinstance(owner, OwnerGroup):
            seen.setdefault(tuple(sorted(owner.ranks)), None)
    for members in efsdp_member_sets(plan):
        seen.setdefault(members, None)
    return tuple(seen)


def efsdp_member_sets(plan) -> tuple[tuple[int, ...], ...]:
    """Expert parallelism with ``efsdp = N/ep > 1``: the efsdp groups (mesh ranks ``r*N + j +
    i*ep`` for ``i < efsdp``, per replicate row ``r`` and EP coordinate ``j``) over which the
    expert-parallel buffers' segments are broadcast and reduced; empty otherwise."""
    eps = {buf.ep for b in plan.boundaries for buf in b.buffers if buf.ep > 1}
    R, N = plan.mesh_shape
    return tuple(
        tuple(r * N + s for s in range(j, N, ep))
        for ep in sorted(eps)
        if N // ep > 1
        for r in range(R)
        for j in range(ep)
    )


def collective_backend(model: nn.Module) -> str:
    """The link record (:data:`dmuon.plan._rules.COLLECTIVE_LINKS`) of the default process group's
    backend for the model's device: ``"gloo"`` where that backend is gloo, ``"nccl"`` for NCCL and
    every other backend (the preset). A group with one backend per device type
    (``"cpu:gloo,cuda:nccl"``) is read for the device of the model's first parameter (a model on
    ``meta``: CUDA when present, else CPU)."""
    backend = str(dist.get_backend())
    if ":" in backend:
        by_device = dict(part.split(":", 1) for part in backend.split(",") if ":" in part)
        device = next((p.device.type for p in model.parameters()), "cpu")
        if device == "meta":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        backend = by_device.get(device, next(iter(by_device.values()), backend))
    return "gloo" if backend == "gloo" else "nccl"


@refuse_removed_keywords("dmuon.dedicate_params()")
def dedicate_params(
    model: nn.Module,
    mesh=None,
    *,
    predicate=None,
    reshard_after_forward: bool | None = None,
    hook_boundary_predicate=None,
    hook_boundary_strict: bool = True,
    replicate_async: bool = True,
    mp_policy=None,
    collective_timeout_s: float | None = DEFAULT_TIMEOUT_S,
    shard_dim: str | None = None,
    replicate_dim: str | None = None,
    tp_dim: str | None = None,
    ep: int | None = None,
    pipeline: bool | None = None,
    offload_policy=None,
    **compile_kwargs,
):
    """``dmuon.plan.compile`` + :func:`apply`; returns the plan.

    ``mesh``: a ``DeviceMesh`` (1-D; 2-D ``(replicate, shard)`` or named ``("dp", "tp")``; 3-D
    named ``("dp_replicate", "dp_shard", "tp")`` as torchtitan builds it, unsliced; dims found by
    :func:`dmuon.plan.mesh_dim_roles`, ``shard_dim`` / ``replicate_dim`` / ``tp_dim`` name them
    when they are called otherwise), an int ``N`` / ``(N,)`` / ``(R, N)`` spanning the world,
    or ``None`` (1-D over the world). ``ep``: the expert-parallel degree (``dmuon.plan.compile``;
    ``None``: ``N`` for a 1-D ``DeviceMesh`` whose dim is named ``"ep"``, else 1; docs/moe_ep.md).
    Extra keyword arguments go to ``dmuon.plan.compile`` (e.g. ``cost_model``, or its option
    objects ``tp=dmuon.plan.TPPolicy(...)`` and ``expert_policy=dmuon.plan.ExpertPolicy(...)``).
    Unless they set ``collective_backend`` or the rule's numbers, the plan's ``collectives="auto"``
    rule prices with the link record of the process group's backend for the model's device
    (:func:`collective_backend`: ``"gloo"`` on gloo, ``"nccl"`` otherwise).

    ``reshard_after_forward``: ``True`` DMuon-Z3, ``False`` DMuon-Z2; ``None`` (default): Z3,
    except Z2 for a pipeline stage (torchtitan's ``reshard_after_forward = not pp``).

    ``offload_policy``: FSDP2's ``CPUOffloadPolicy(...)`` to keep the owned masters and Muon
    momenta in host memory (:func:`apply`); pass the same policy to every ``fully_shard`` call
    (``pin_memory=False`` on a machine without an accelerator).

    Pipeline parallelism (``torch.distributed.pipelining``, docs/pipeline_parallel.md):
    ``model`` is one stage, ``mesh`` its data-parallel mesh, e.g. ``mesh["dp"]`` of
    ``init_device_mesh(device, (pp, dp), mesh_dim_names=("pp", "dp"))``. ``pipeline``: whether
    ``model`` is a pipeline stage; ``None``: when ``mesh`` is a sub-mesh of a ``DeviceMesh`` with
    a dim named ``"pp"`` (pass ``pipeline=True`` for another layout). The set-up, on every rank:

    1. split the model into stages (torchtitan's split: a deep copy per stage, the other stages'
       layers deleted, FQNs kept);
    2. ``dmuon.dedicate_params(stage, dp_mesh)`` for each stage the rank holds, in stage order
       (every rank holds as many stages; each call is a collective over the world, and the
       plan is checked against the ranks that hold the same stage only);
    3. ``fully_shard(block, mesh=dp_mesh)`` for each block, then ``fully_shard(stage, ...)``;
    4. ``PipelineStage(stage, ...)`` and a schedule: ``ScheduleGPipe``, ``Schedule1F1B``,
       ``ScheduleInterleaved1F1B`` or ``ScheduleLoopedBFS`` (a zero-bubble schedule raises
       ``NotImplementedError`` at its first step);
    5. one ``dmuon.Muon`` over every parameter of every stage the rank holds (or one per stage).
    """
    from dmuon.plan._compile import compile as compile_plan

    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "dmuon.dedicate_params needs an initialised default process group: call "
            "torch.distributed.init_process_group(...) first (use world size 1 for a single process)"
        )
    _check_not_applied(model)
    guards.check_not_fully_sharded(model)
    _check_not_whole_pipeline_mesh(mesh)
    table = mesh_rank_table(mesh, shard_dim=shard_dim, replicate_dim=replicate_dim, tp_dim=tp_dim)
    names = tuple(getattr(mesh, "mesh_dim_names", None) or ()) if hasattr(mesh, "shape") else ()
    if ep is None and names == ("ep",):  # compile reads the (R, N) below, without the dim's name
        ep = len(table[0])
    if not any(k in compile_kwargs for k in ("collective_backend", "collective_latency_s", "collective_bandwidth_Bps")):
        compile_kwargs["collective_backend"] = collective_backend(model)
    if pipeline is None:
        pipeline = is_pipeline_mesh(mesh)
    if reshard_after_forward is None:
        reshard_after_forward = not pipeline
    plan = compile_plan(
        model,
        (len(table), len(table[0])),
        ep=ep,
        predicate=predicate,
        reshard_after_forward=reshard_after_forward,
        hook_boundary_predicate=hook_boundary_predicate,
        hook_boundary_strict=hook_boundary_strict,
        replicate_async=replicate_async,
        mp_policy=mp_policy,
        **compile_kwargs,
    )
    apply(
        plan,
        model,
        mesh,
        collective_timeout_s=collective_timeout_s,
        shard_dim=shard_dim,
        replicate_dim=replicate_dim,
        tp_dim=tp_dim,
        pipeline=pipeline,
        offload_policy=offload_policy,
    )
    return plan
