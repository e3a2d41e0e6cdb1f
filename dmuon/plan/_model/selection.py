"""Which parameters are dedicated (get one Muon owner), their matrix views and boundaries.

The default selection and the matrix view of each kind of selected parameter: Note: parameter
selection (docs/design.md).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import torch
from torch import nn

from dmuon.plan._model.boundaries import BoundaryResolver, Resolution
from dmuon.plan._model.expert_ranges import EXPERT_MODES, ROUTER_MODES, expert_stack, is_router, is_stacked_bias
from dmuon.plan._records.params import ExpertStack
from dmuon.plan._tools.render import fmt_names
from dmuon.plan._model.snapshot import ModelSnapshot, ModuleKind, ParamRecord, take_snapshot

__all__ = [
    "Selected",
    "matrix_view",
    "record_stack",
    "select_params",
    "router_fqns",
    "matrix_predicate",
    "degenerate_reason",
    "coverage_warning",
    "unrecognised_stack_warning",
]


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Selected:
    """A dedicated parameter with its view and boundary (internal to compile)."""

    record: ParamRecord
    matrix_shape: tuple[int, int]
    num_matrices: int
    boundary: str
    fallback: bool
    experts: ExpertStack | None = None


def matrix_view(record: ParamRecord) -> tuple[tuple[int, int], int] | None:
    """``((m, n), num_matrices)`` of ``record`` per Note: parameter selection (docs/design.md), or None if undefined."""
    shape = record.shape
    kind = record.module_kinds[0]
    if len(shape) == 2:
        return (shape[0], shape[1]), 1
    if kind == ModuleKind.CONV and len(shape) >= 3:
        return (shape[0], math.prod(shape[1:])), 1
    if kind == ModuleKind.CONV_TRANSPOSE:
        return None
    if len(shape) == 3:
        return (shape[1], shape[2]), shape[0]
    return None


def _view_error(record: ParamRecord) -> str:
    kind = record.module_kinds[0]
    if record.ndim < 2:
        why = f"is {record.ndim}-D (shape {record.shape}); Muon needs matrices"
    elif kind == ModuleKind.CONV_TRANSPOSE:
        why = f"is a ConvTranspose weight (shape {record.shape}, first dim = input channels); no matrix view is defined"
    else:
        why = f"is {record.ndim}-D (shape {record.shape}) and not an nn.Conv1d/2d/3d weight; no matrix view is defined"
    return f"  {record.fqn}: {why}"


def degenerate_reason(record: ParamRecord) -> str | None:
    """Why ``record`` has a matrix view that Muon should not orthogonalise, or None.

    * a view with a side of 1 per matrix (a ``(1, C)`` gate or head, a ``(C, 1)`` column, a
      LayerScale gain ``(C, 1, 1)`` read as ``C`` matrices of ``(1, 1)``): Newton-Schulz of a
      vector only normalises it (``v / ||v||``, a sign step for a scalar), not an
      orthogonalisation;
    * a depthwise / fully grouped conv kernel ``(C, 1, *k)`` (one input channel per group): C
      independent ``k``-tap filters, not one linear map between channel spaces.

    Both stay with FSDP2 and AdamW under the default predicate and :func:`matrix_predicate`;
    a user predicate may still select them (their view is defined).
    """
    view = matrix_view(record)
    if view is None:
        return None
    (m, n), _ = view
    if record.module_kinds[0] == ModuleKind.CONV and len(record.shape) >= 3 and record.shape[1] == 1:
        return f"depthwise conv kernel {record.shape} (one input channel per group)"
    if min(m, n) == 1:
        return f"matrix view {(m, n)} has a side of 1 (Newton-Schulz would only normalise a vector)"
    return None


def record_stack(snapshot: ModelSnapshot, record: ParamRecord, gate_up: str = "split") -> ExpertStack | None:
    """The :class:`ExpertStack` of a recognised 3-D expert parameter (its canonical module's
    attributes and names, :func:`dmuon.plan._model.expert_ranges.expert_stack`), else None."""
    if record.ndim != 3 or record.module_kinds[0] != ModuleKind.OTHER:
        return None
    return expert_stack(
        record.shape, record.attr, record.module_fqn, snapshot.modules[record.module_fqn], gate_up=gate_up
    )


def _default_candidate(record: ParamRecord, stack: ExpertStack | None = None) -> bool:
    return (
        ((record.ndim == 2 and not is_stacked_bias(record.shape, record.attr)) or stack is not None)
        and not record.is_embedding_weight
        and bool(record.tensor.requires_grad)
        and degenerate_reason(record) is None
    )


# Coverage warning of the default rule: warn when nothing is dedicated, or when more than this
# fraction of the elements of the default candidates (2-D, not embedding, trainable, not
# degenerate) lies outside every hook boundary. An untied lm_head next to the blocks stays far
# below it (Llama-3 8B: 0.5 of 7.0 G elements).
UNCOVERED_WARN_FRACTION = 0.5


def coverage_warning(snapshot: ModelSnapshot, hook_boundary_predicate=None, experts: str = "auto") -> str | None:
    """The warning :func:`dmuon.plan.compile` gives for the default rule (None if the blocks are
    covered): how many default candidates (2-D matrices and expert stacks, counted by elements)
    lie outside every hook boundary, and the ``hook_boundary_predicate=`` line that would cover
    them; with ``experts="off"``, how many expert-stack elements that rule leaves to AdamW."""
    resolver = BoundaryResolver(snapshot.modules, hook_boundary_predicate)
    stacks = {r.fqn: record_stack(snapshot, r) for r in snapshot.params}
    candidates = [r for r in snapshot.params if _default_candidate(r, stacks[r.fqn])]
    if not candidates:
        return None
    inside = [r for r in candidates if resolver.resolve(r).boundary is not None or resolver.resolve(r).conflict]
    total = sum(r.numel for r in candidates)
    if experts == "off":
        left_stacks = [r for r in inside if stacks[r.fqn] is not None]
        stack_numel = sum(r.numel for r in left_stacks)
        if left_stacks and stack_numel > UNCOVERED_WARN_FRACTION * total:
            return (
                f"dmuon.plan._compile: experts='off' leaves {len(left_stacks)} expert stacks "
                f"({100 * stack_numel / total:.0f}% of the matrix elements: {fmt_names([r.fqn for r in left_stacks], 4)}) "
                "to AdamW. Fix: experts='auto' (the default) gives every expert its own Muon owner."
            )
        candidates = [r for r in candidates if stacks[r.fqn] is None]
        total = sum(r.numel for r in candidates)
    inside_fqns = {r.fqn for r in inside}
    outside = [r for r in candidates if r.fqn not in inside_fqns]
    left = sum(r.numel for r in outside)
    if not candidates or not outside or (len(outside) < len(candidates) and left <= UNCOVERED_WARN_FRACTION * total):
        return None
    # the most common class among the parents of the left-out matrices' modules: the likely block
    parents: dict[str, int] = {}
    for r in outside:
        parent = r.module_fqn.rpartition(".")[0]
        name = type(snapshot.modules[parent]).__name__
        parents[name] = parents.get(name, 0) + 1
    block = max(sorted(parents), key=parents.get)
    names = fmt_names([r.fqn for r in outside], 4)
    n_stacks = sum(1 for r in outside if stacks[r.fqn] is not None)
    what = "no matrix is dedicated" if len(outside) == len(candidates) else "most matrix elements are not dedicated"
    kinds = f"2-D matrices and expert stacks ({n_stacks} stacks)" if n_stacks else "2-D matrices"
    return (
        f"dmuon.plan._compile: {what}: {len(outside)} of {len(candidates)} {kinds} "
        f"({100 * left / total:.0f}% of their elements: {names}) lie outside every hook boundary and "
        "train with AdamW only. The default boundary rule looks for blocks at '<container>.<int>' "
        "(layers.N, h.N, blocks.N, ...); blocks in an nn.ModuleDict or as plain attributes are not "
        f"found. Fix: hook_boundary_predicate=lambda module: isinstance(module, {block})"
    )


def unrecognised_stack_warning(snapshot: ModelSnapshot, hook_boundary_predicate=None) -> str | None:
    """The warning :func:`dmuon.plan.compile` gives for the default rule when 3-D parameters inside
    hook boundaries are not recognised expert stacks (no ``experts`` module on their path, no
    transformers markers, no torchtitan names) and so train with AdamW; None when there are none."""
    resolver = BoundaryResolver(snapshot.modules, hook_boundary_predicate)
    left = [
        r
        for r in snapshot.params
        if r.ndim == 3
        and r.module_kinds[0] == ModuleKind.OTHER
        and not r.attr.endswith("bias")
        and bool(r.tensor.requires_grad)
        and record_stack(snapshot, r) is None
        and resolver.resolve(r).boundary is not None
    ]
    if not left:
        return None
    return (
        f"dmuon.plan._compile: {len(left)} 3-D parameter(s) inside hook boundaries are not recognised expert "
        f"stacks and train with AdamW: {fmt_names([f'{r.fqn} {r.shape}' for r in left], 4)}. Recognised: "
        "transformers' experts modules, torchtitan's GroupedExperts (w1/w2/w3), any 3-D parameter under a module "
        "whose path contains 'experts'. If they are (E, out, in) expert stacks, pass "
        "predicate=dmuon.plan.matrix_predicate(model) (every 3-D parameter as E matrices) or rename the module"
    )


def select_params(
    snapshot: ModelSnapshot,
    *,
    predicate: Callable[[str, torch.Tensor], bool] | None,
    hook_boundary_predicate: Callable[[nn.Module], bool] | None,
    hook_boundary_strict: bool,
    experts: str = "auto",
    expert_gate_up: str = "split",
    ep: int = 1,
    routers: str = "muon",
) -> tuple[Selected, ...]:
    """Dedicated parameters of ``snapshot`` in ``named_parameters()`` order.

    Args:
        predicate: ``(canonical_fqn, parameter) -> bool``; None = the default rule.
        hook_boundary_predicate: see :class:`~dmuon.plan._model.boundaries.BoundaryResolver`.
        hook_boundary_strict: raise for a dedicated parameter without a boundary; if False,
            fall back to the parameter's own module (``fallback=True``).
        experts: ``"auto"`` (recognised expert stacks are default candidates and carry an
            :class:`~dmuon.plan._records.params.ExpertStack`) or ``"off"`` (2-D only; a stack a
            predicate selects has no layout record), :data:`~dmuon.plan._model.expert_ranges.EXPERT_MODES`.
        expert_gate_up: ``"split"`` or ``"fused"``, :data:`~dmuon.plan._model.expert_ranges.GATE_UP_MODES`.
        ep: expert-parallel degree: each rank's stacks hold ``E / ep`` of their module's experts.
        routers: ``"muon"`` or ``"adamw"`` (:data:`~dmuon.plan._model.expert_ranges.ROUTER_MODES`): with
            ``"adamw"`` the default rule leaves MoE routers
            (:func:`~dmuon.plan._model.expert_ranges.is_router`) to FSDP2 and AdamW. A ``predicate``
            decides alone (``routers`` does not filter what it selects).

    Raises:
        ValueError: (checked in this order, each listing every offending parameter)
            a selected parameter has no matrix view (0-D/1-D/ConvTranspose/4-D+ non-conv);
            a selected tied parameter resolves to different boundaries under its aliases;
            ``hook_boundary_strict`` and a selected parameter has no boundary.
    """
    if experts not in EXPERT_MODES:
        raise ValueError(f"dmuon.plan._compile: experts must be one of {EXPERT_MODES}, got {experts!r}")
    if routers not in ROUTER_MODES:
        raise ValueError(f"dmuon.plan._compile: routers must be one of {ROUTER_MODES}, got {routers!r}")
    resolver = BoundaryResolver(snapshot.modules, hook_boundary_predicate)
    stacks = {
        r.fqn: (record_stack(snapshot, r, expert_gate_up) if experts == "auto" else None) for r in snapshot.params
    }
    skip = router_fqns(snapshot, ep) if predicate is None and routers == "adamw" else frozenset()
    chosen: list[tuple[ParamRecord, Resolution]] = []
    for record in snapshot.params:
        if predicate is None:
            if not _default_candidate(record, stacks[record.fqn]) or record.fqn in skip:
                continue
            res = resolver.resolve(record)
            if res.boundary is None and not res.conflict:
                continue  # default rule: only parameters inside a hook boundary
            chosen.append((record, res))
        elif predicate(record.fqn, record.tensor):
            chosen.append((record, resolver.resolve(record)))

    frozen = [r.fqn for r, _ in chosen if not r.tensor.requires_grad]
    if frozen:
        raise ValueError(
            "dmuon.plan._compile: the predicate selected frozen parameters (requires_grad=False): "
            + ", ".join(frozen)
            + "\nFix: exclude them in predicate (e.g. `lambda fqn, p: p.requires_grad and ...`); Muon "
            "has nothing to update in a frozen matrix, and FSDP2 shards it without reducing gradients."
        )

    view_errors = [_view_error(r) for r, _ in chosen if matrix_view(r) is None]
    if view_errors:
        raise ValueError(
            "dmuon.plan._compile: the predicate selected parameters without a matrix view:\n"
            + "\n".join(view_errors)
            + "\nFix: exclude them in predicate (e.g. `lambda fqn, p: p.ndim == 2 and ...`); they stay "
            "with FSDP2 and AdamW. Defined views: 2-D (m, n); nn.Conv1d/2d/3d weight (out, in, *k) -> "
            "(out, in*prod(k)); 3-D expert stack (E, m, n) -> E matrices (m, n)."
        )

    e_errors = _num_experts_errors(
        snapshot, [r for r, _ in chosen if r.ndim == 3 and r.module_kinds[0] == ModuleKind.OTHER], ep
    )
    if e_errors:
        held = "all E experts of its module" if ep == 1 else f"E / ep (ep={ep}) of its module's E experts"
        raise ValueError(
            "dmuon.plan._compile: expert stacks whose leading dim disagrees with their module's expert count:\n"
            + "\n".join(line for line, _, _ in e_errors)
            + f"\nAn expert stack (E, a, b) must hold {held} (dim 0 = the expert index); "
            + _num_experts_fix(e_errors, ep)
        )

    conflicts = [res.conflict_message(r) for r, res in chosen if res.conflict]
    if conflicts:
        raise ValueError("dmuon.plan._compile: " + "\n".join(conflicts))

    missing = [r for r, res in chosen if res.boundary is None]
    if missing and hook_boundary_strict:
        lines = "\n".join(f"  {r.fqn} (module {r.module_fqn or '<root>'})" for r in missing)
        raise ValueError(
            f"dmuon.plan._compile: {len(missing)} dedicated parameter(s) have no hook-boundary ancestor:\n"
            f"{lines}\n"
            "Fix one of: pass hook_boundary_predicate=lambda module: <is a block> (the innermost "
            "matching ancestor is used); exclude them via predicate; or pass "
            "hook_boundary_strict=False to use each parameter's own module as its boundary."
        )
    # Non-strict fallback: the parameter's own module must serve every alias.
    tied_fallback = [r for r in missing if len(set(r.module_fqns)) > 1]
    if tied_fallback:
        raise ValueError(
            "dmuon.plan._compile: tied parameter(s) without a hook boundary are used by different "
            "modules, so no single own-module fallback serves them: "
            + ", ".join(f"{r.fqn} (aliases {', '.join(r.aliases)})" for r in tied_fallback)
            + ". Exclude them via predicate or pass a hook_boundary_predicate covering all uses."
        )

    out: list[Selected] = []
    for record, res in chosen:
        (m, n), e = matrix_view(record)  # type: ignore[misc]
        stack = stacks[record.fqn]
        if stack is None and experts == "auto" and record.ndim == 3 and record.module_kinds[0] == ModuleKind.OTHER:
            stack = ExpertStack(num_experts=record.shape[0])  # a predicate-selected 3-D parameter: a generic stack
        if stack is not None:
            (m, n), e = stack.matrix_shape(record.shape), stack.num_experts * stack.matrices_per_expert
        fallback = res.boundary is None
        out.append(
            Selected(
                record=record,
                matrix_shape=(m, n),
                num_matrices=e,
                boundary=record.module_fqn if fallback else res.boundary,  # type: ignore[arg-type]
                fallback=fallback,
                experts=stack,
            )
        )
    return tuple(out)


def router_fqns(snapshot: ModelSnapshot, ep: int = 1) -> frozenset[str]:
    """FQNs of the MoE routers of ``snapshot`` (:func:`~dmuon.plan._model.expert_ranges.is_router` next to
    the recognised expert stacks, whatever ``experts=`` mode plans them; ``ep``: each stack holds
    ``E / ep`` of the experts its router scores)."""
    stacks: dict[str, int] = {}
    for r in snapshot.params:
        stack = record_stack(snapshot, r)
        if stack is not None:
            stacks[r.module_fqn] = stack.num_experts * ep
    if not stacks:
        return frozenset()
    return frozenset(r.fqn for r in snapshot.params if is_router(r.module_fqn, r.attr, r.shape, stacks))


def declared_num_experts(snapshot: ModelSnapshot, module_fqn: str, *, router: bool = True) -> tuple[int, str] | None:
    """``(E, where)`` the model declares for the experts module ``module_fqn``: its integer
    attribute ``num_experts`` (Hugging Face's experts modules, torchtitan's ``GroupedExperts``),
    else (``router=True``: for a recognised expert stack only) the rows of a sibling router
    (``gate`` / ``router`` with a 2-D ``weight`` ``(E, D)``, as in Qwen3-MoE, Mixtral, gpt-oss);
    None when neither exists."""
    module = snapshot.modules.get(module_fqn)
    declared = getattr(module, "num_experts", None)
    if isinstance(declared, int) and not isinstance(declared, bool):
        return declared, f"its module {module_fqn or '<root>'} ({type(module).__name__}) has num_experts = {declared}"
    if not router:
        return None
    parent = module_fqn.rpartition(".")[0]
    for name in ("gate", "router"):
        router = snapshot.modules.get(f"{parent}.{name}" if parent else name)
        weight = getattr(router, "weight", None)
        if router is not None and getattr(weight, "ndim", 0) == 2:
            rows = int(weight.shape[0])
            return rows, f"its router {parent + '.' if parent else ''}{name}.weight has {rows} rows (experts)"
    return None


def _num_experts_errors(snapshot: ModelSnapshot, records, ep: int = 1) -> list[tuple[str, int, int]]:
    """``(line, experts held, experts declared)`` per selected 3-D parameter whose leading dim is
    not ``E / ep`` of the experts its model declares (:func:`declared_num_experts`)."""
    out = []
    for r in records:
        found = declared_num_experts(snapshot, r.module_fqn, router=record_stack(snapshot, r) is not None)
        if found is None:
            continue
        declared, where = found
        if declared % ep or declared // ep != r.shape[0]:
            want = f"{declared // ep} (= {declared} / ep {ep})" if ep > 1 and not declared % ep else str(declared)
            out.append(
                (
                    f"  {r.fqn}: shape {r.shape} holds {r.shape[0]} experts, expected {want}: {where}",
                    int(r.shape[0]),
                    declared,
                )
            )
    return out


def _num_experts_fix(errors: list[tuple[str, int, int]], ep: int) -> str:
    """The fix that fits the mismatch: without ``ep``, the model; a rank holding every expert
    under ``ep > 1``, dropping ``ep=``; a rank holding another count, building each rank's
    ``E / ep`` experts or passing the ``ep`` its count implies."""
    if ep == 1:
        return "fix the model (or its config), or exclude the parameter via predicate."
    if all(held == declared for _, held, declared in errors):
        return (
            "each rank holds every expert: a model holding every expert on every rank is not expert-parallel: "
            "drop ep= (under expert parallelism each rank's model builds only its own experts and routes tokens "
            "with all_to_all, docs/moe_ep.md)."
        )
    implied = {declared // held for _, held, declared in errors if held and declared % held == 0 and held != declared}
    hint = f", or pass ep={implied.pop()}, the degree this model was built for" if len(implied) == 1 else ""
    return (
        f"under expert parallelism rank j of an EP group builds only experts j*E/ep .. (j+1)*E/ep-1 of each stack "
        f"and routes tokens with all_to_all (docs/moe_ep.md): build each rank's model with E/ep experts per stack"
        f"{hint}."
    )


def matrix_predicate(
    model: nn.Module,
    *,
    hook_boundary_predicate: Callable[[nn.Module], bool] | None = None,
) -> Callable[[str, torch.Tensor], bool]:
    """A ``predicate`` for :func:`dmuon.plan.compile` that selects every parameter with a
    defined matrix view (2-D, conv weight, 3-D stack) that is inside a hook boundary and is
    neither an embedding weight nor a stacked bias: the default rule extended to conv kernels
    and every 3-D parameter.

    Evaluated against a snapshot of ``model`` taken now (pure; the model is not mutated).
    """
    snapshot = take_snapshot(model)
    resolver = BoundaryResolver(snapshot.modules, hook_boundary_predicate)
    keep: set[str] = set()
    for r in snapshot.params:
        if (
            r.is_embedding_weight
            or r.ndim < 2
            or is_stacked_bias(r.shape, r.attr)
            or matrix_view(r) is None
            or degenerate_reason(r) is not None
        ):
            continue
        res = resolver.resolve(r)
        if res.boundary is not None or res.conflict:  # conflicts are reported by compile
            keep.add(r.fqn)

    frozen = frozenset(keep)

    def predicate(fqn: str, param: torch.Tensor) -> bool:
        return fqn in frozen

    return predicate
